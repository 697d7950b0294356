"""Which training precision a device runs fastest: :func:`choose_precision`.

Low-precision weights pay off only where the hardware computes them fast. GPUs from Ampere
on have bf16 tensor cores; older ones have fp16 (and need a loss scaler). CPUs differ more
than their dtype lists suggest: one with AVX512-BF16 or AMX runs a bf16 matmul about twice
as fast as fp32, while fp16 on a CPU without fp16 units can be 10-40x slower than fp32. So
on a CPU the answer is measured: a small matmul in fp32 and in bf16, best of a few runs.

Ranks must agree (the model's dtype is part of DDP's construction check), and a timing can
differ between ranks, so rank 0's choice is broadcast when a process group is up.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["PrecisionChoice", "choose_precision"]

_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class PrecisionChoice:
    """The weights' dtype, whether it needs a loss scaler (fp16), and why it was chosen."""

    name: str  # "fp32", "bf16" or "fp16"
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        return _NAMES[self.name]

    @property
    def needs_scaler(self) -> bool:
        return self.name == "fp16"


def _matmul_seconds(dtype: torch.dtype, device: torch.device, repeats: int = 5) -> float:
    # 256x512 @ 512x512: large enough to reach the vector units, ~1 ms in fp32 on one core.
    a = torch.randn(256, 512, device=device).to(dtype)
    b = torch.randn(512, 512, device=device).to(dtype)
    torch.mm(a, b)  # warm-up (kernel selection, page faults)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return best


def _local_choice(device: torch.device) -> PrecisionChoice:
    if device.type == "cuda":
        if not torch.cuda.is_available():  # (else an assertion deep in torch.cuda)
            raise RuntimeError(
                f"choose_precision: the device {device} is not available (torch.cuda.is_available() is "
                "False); pass the device the model trains on, or choice='fp32'/'bf16'/'fp16'.")
        if torch.cuda.is_bf16_supported():
            name = torch.cuda.get_device_name(device)
            return PrecisionChoice("bf16", f"{name} computes bf16 natively")
        return PrecisionChoice("fp16", f"{torch.cuda.get_device_name(device)} has no fast bf16: fp16 + loss scaling")
    if device.type != "cpu":
        return PrecisionChoice("fp32", f"no precision probe for {device.type}")
    fp32 = _matmul_seconds(torch.float32, device)
    bf16 = _matmul_seconds(torch.bfloat16, device)
    ratio = fp32 / bf16
    probe = f"a bf16 matmul runs {ratio:.2f}x the speed of fp32 on this CPU"
    # bf16 must clearly win: weights in bf16 cost rounding, for no gain at parity.
    if ratio >= 1.2:
        return PrecisionChoice("bf16", probe)
    return PrecisionChoice("fp32", probe + " (bf16 needs >= 1.2x)")


def choose_precision(device: torch.device | str, group=None, *, choice: Optional[str] = None) -> PrecisionChoice:
    """The fastest precision for training on ``device``: bf16 (+ FP32 master weights in the
    optimizer) where the device computes bf16 fast, fp16 (+ a loss scaler) on GPUs without
    bf16, fp32 otherwise. ``choice`` ("fp32", "bf16", "fp16") overrides the probe. With an
    initialized process group, every rank of ``group`` gets rank 0's answer."""
    device = torch.device(device)
    if choice is not None:
        if choice not in _NAMES:
            raise ValueError(f"precision must be one of {sorted(_NAMES)} or None (probe), got {choice!r}")
        return PrecisionChoice(choice, "requested")
    local = _local_choice(device)
    if not (dist.is_available() and dist.is_initialized()):
        return local
    from ..comm import get_communicator
    from ..comm.objects import broadcast_object

    comm = get_communicator(group, device)  # bounded and reported like every fusedist exchange
    return broadcast_object(comm, local, 0, tag="choose_precision")
