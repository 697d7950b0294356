"""Argument checks of the communicator's collectives, and how messages name one.

Every check here runs before a launch and depends only on this rank's arguments, so misuse is a
``ValueError`` raised before anything is sent, never a collective that fails half-way.
"""

from __future__ import annotations

import torch

REDUCE_OPS = ("sum", "avg", "max", "min")


def check_op(op: str, name: str, dtype: torch.dtype, tag: str) -> None:
    """Refused before any launch, so on every rank alike: an unknown op, and avg of an
    integer tensor (gloo fails it inside the collective with a cast error; a mean of
    integers has no integer result on every backend)."""
    if op not in REDUCE_OPS:
        raise ValueError(f"fusedist: reduce op must be one of {REDUCE_OPS}, got {op!r}")
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"fusedist {name}{_tag(tag)}: op='avg' needs a floating-point tensor, got {dtype}; "
                         "reduce with 'sum' and divide, or convert to a floating-point dtype")


def check_flat(name: str, tag: str, rank: int, **tensors: torch.Tensor) -> None:
    """Contiguous tensors of one dtype: what every implementation's flat collectives take (torch.distributed
    refuses non-contiguous tensors too). ``tensors``: by the names the caller passed them as."""
    for which, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(
                f"fusedist {name}{_tag(tag)} on rank {rank}: the {which} (shape {tuple(t.shape)}, strides "
                f"{t.stride()}) is not contiguous; pass a contiguous tensor (.contiguous(), then copy the result "
                "back into the view)")
    if len({t.dtype for t in tensors.values()}) > 1:
        listed = ", ".join(f"{which} {t.dtype}" for which, t in tensors.items())
        raise ValueError(f"fusedist {name}{_tag(tag)} on rank {rank}: the tensors' dtypes differ ({listed}); "
                         "pass them in one dtype")


def check_in_place(kind: str, output: torch.Tensor, input: torch.Tensor, rank: int, world_size: int) -> None:
    """Raise ``ValueError`` when a reduce-scatter's output (an all-gather's input) overlaps the
    other tensor anywhere but at exactly this rank's slice: the one in-place form NCCL, gloo
    and the gloo exchange define. Any other overlap overwrites data still being sent, and
    the result would be silently wrong. Shapes are the caller's to check first."""
    whole, part = (input, output) if kind == "reduce_scatter" else (output, input)
    m = part.numel()
    if m == 0 or whole.numel() != m * world_size or not _overlaps(whole, part):
        return
    if part.data_ptr() != whole.data_ptr() + rank * m * whole.element_size():
        name = "output" if kind == "reduce_scatter" else "input"
        other = "input" if kind == "reduce_scatter" else "output"
        raise ValueError(
            f"fusedist {kind}: {name} overlaps {other} other than at this rank's own slice (rank "
            f"{rank}); pass a separate {name}, or exactly {other}.view(-1)[{rank * m}:{(rank + 1) * m}]"
        )


def _row_numel(t: torch.Tensor) -> int:
    """Elements per row (dim 0) of ``t``."""
    n = 1
    for d in t.shape[1:]:
        n *= d
    return n


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _tag(tag: str) -> str:
    return f" [{tag}]" if tag else ""


def describe_collective(op: str, tag: str, seq: int) -> str:
    """How messages name one collective: ``all_reduce [bucket 3] (collective #17)``."""
    return f"{op}{_tag(tag)} (collective #{seq})"
