"""torch dtype / reduce op -> NCCL codes: the one map the direct-NCCL path uses.

The codes are NCCL's own ``ncclDataType_t`` / ``ncclRedOp_t`` values (stable across NCCL 2.x),
passed as integers to :mod:`fusedist._C`, which never sees a torch type.
"""

from __future__ import annotations

import torch

NCCL_DTYPES: dict[torch.dtype, int] = {
    torch.int8: 0,
    torch.uint8: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}
# Unsigned 32/64-bit tensors exist in recent torch releases only.
for _name, _code in (("uint32", 3), ("uint64", 5)):
    if hasattr(torch, _name):
        NCCL_DTYPES[getattr(torch, _name)] = _code

FLOATING_CODES = frozenset({6, 7, 8, 9})

NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}

_HINTS = {
    torch.bool: "reduce it as torch.uint8 (t.to(torch.uint8)) and convert back",
    torch.int16: "cast it to torch.int32",
    torch.complex64: "reduce torch.view_as_real(t) (float32) instead",
    torch.complex128: "reduce torch.view_as_real(t) (float64) instead",
}


def nccl_dtype(dtype: torch.dtype, what: str = "collective") -> int:
    """The NCCL code of ``dtype``; raises TypeError naming the dtype and a way out."""
    try:
        return NCCL_DTYPES[dtype]
    except KeyError:
        hint = _HINTS.get(dtype, "cast it to one of the supported dtypes")
        supported = ", ".join(str(d).replace("torch.", "") for d in NCCL_DTYPES)
        raise TypeError(
            f"fusedist {what}: NCCL does not support {dtype}; {hint} (supported: {supported})"
        ) from None


def nccl_op(op: str, what: str = "collective") -> int:
    """The NCCL code of reduce op ``op``.

    ``avg`` maps to ``ncclAvg`` for every dtype, as torch's NCCL backend does (integers get
    the truncated mean).
    """
    try:
        return NCCL_OPS[op]
    except KeyError:
        raise ValueError(f"fusedist {what}: unknown reduce op {op!r} (one of {sorted(NCCL_OPS)})") from None
