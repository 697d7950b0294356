"""A training forward refused on some ranks only, made an error on every rank of the group.

Note [a refusal on one rank reaches every rank]
    The input checks run on each rank alone: an input of another width, dtype or device, or a
    layer whose parameters were cast on one rank only (``model.half()`` there), is refused on
    that rank before anything is exchanged. Its group-mates, whose inputs pass, went on into the
    forward's statistics gather and waited there for the refusing rank until the collective
    timeout (600 s by default), then failed naming neither the rank nor the cause. Now a rank
    that refuses a synchronized training forward still joins that gather, with a message whose
    count is -1 and whose next elements say why (a reason code and two details), and raises its
    own error; every other rank reads the marker with the counts it reads anyway and raises,
    naming the refusing ranks and the reason. No rank counts the batch or touches its running
    statistics. A healthy forward pays nothing: no extra collective, no extra read to the host.
    A synchronized training forward run under a torch.func transform (``vmap``, ``grad``, ...),
    which cannot synchronize, is refused the same way (reason TRANSFORM): a transform runs the
    training step on every rank (per-sample gradients, a functional training loop).

    Not routed here, on purpose: ``torch.jit.trace`` of a training forward (Note [a traced forward
    refuses on its own rank] in sync_batch_norm.py) and an input without data (Note [inputs without
    data] there). Both are what one rank does alone -- export, shape inference, a memory estimate --
    where a marker would wait for group-mates that never come, or meet their next training forward
    and fail it; and a rank given a meta or fake input cannot tell which case it is in.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..comm import Communicator
from ..comm.base import global_note, global_ranks
from ._dtype_rule import check_dtypes

REFUSED = -1.0  # in a message's count slot

# reason codes, each with what the other ranks are told (the details: two numbers)
DIMS, NOT_FLOAT, CHANNELS, DTYPES, DEVICE, OTHER, TRANSFORM = range(1, 8)
# dtypes named by their place here (-1: another one)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)


def _dtype_code(dtype) -> float:
    return float(_DTYPES.index(dtype)) if dtype in _DTYPES else -1.0


def _dtype_name(code: float) -> str:
    return str(_DTYPES[int(code)]) if 0 <= code < len(_DTYPES) else "another dtype"


def reason_of(layer: torch.nn.Module, input) -> tuple[float, float, float]:
    """``(code, detail, detail)`` for why ``layer``'s input checks refused ``input``: the first of
    SyncBatchNorm's own rules that it breaks, or OTHER (a subclass's own check)."""
    if not isinstance(input, torch.Tensor):
        return (OTHER, 0.0, 0.0)
    if input.dim() < 2:
        return (DIMS, float(input.dim()), 0.0)
    if not input.is_floating_point():
        return (NOT_FLOAT, _dtype_code(input.dtype), 0.0)
    if input.shape[1] != layer.num_features or input.shape[1] == 0:
        return (CHANNELS, float(input.shape[1]), 0.0)
    try:
        check_dtypes(layer, input)
    except RuntimeError:
        odd = [t.dtype for t in (layer.weight, layer.bias) if t is not None and t.dtype != input.dtype]
        return (DTYPES, _dtype_code(input.dtype), _dtype_code(odd[0] if odd else None))
    if layer.weight is not None and layer.weight.device != input.device:
        return (DEVICE, 0.0, 0.0)
    return (OTHER, 0.0, 0.0)


def _reason_text(code: float, a: float, b: float, num_features: int) -> str:
    if code == DIMS:
        return f"its input has {int(a)} dimension(s), not (N, C, ...)"
    if code == NOT_FLOAT:
        return f"its input is {_dtype_name(a)}, not floating point"
    if code == CHANNELS:
        return f"its input has {int(a)} channels in dim 1, not {num_features}"
    if code == DTYPES:
        return f"its input is {_dtype_name(a)} but the layer's parameters there are {_dtype_name(b)}"
    if code == DEVICE:
        return "its input is on another device than the layer's parameters"
    if code == TRANSFORM:
        return "the forward runs under a torch.func transform (vmap, grad, jvp, ...), which cannot synchronize"
    return "its input check raised"


def layer_device(layer: torch.nn.Module, input) -> torch.device:
    """The device the group's other ranks synchronize this layer on: its parameters' or buffers'
    (the refused input's may be the wrong one), else the input's. Not a device without data."""
    for t in (layer.weight, layer.running_mean, input):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def refusal_message(reason: tuple, length: int, device: torch.device) -> torch.Tensor:
    """The message a refusing rank sends in place of its statistics (Note [a refusal on one rank
    reaches every rank]): as long as the others' (``length`` >= 4), the count slot REFUSED."""
    message = torch.zeros(length, dtype=torch.float64)
    message[0] = REFUSED
    message[1:4] = torch.tensor(reason, dtype=torch.float64)
    return message.to(device)


def check_no_refusal(gathered: torch.Tensor, counts: list, num_features: int,
                     comm: Optional[Communicator]) -> None:
    """Raise, naming the ranks and why, when a gathered message is a refusal marker. ``counts``:
    the count slots, already read to the host."""
    refused = [r for r, count in enumerate(counts) if count == REFUSED]
    if not refused:
        return
    details = gathered[refused, 1:4].tolist()  # (only on this failure path: one more read)
    named = global_ranks(comm) if comm is not None else None
    shown = "; ".join(f"rank {r}{global_note([r], named)}: {_reason_text(*d, num_features)}"
                      for r, d in zip(refused, details))
    raise ValueError(
        f"SyncBatchNorm({num_features}): this training forward is refused on every rank of the layer's group, "
        f"because it was refused on {len(refused)} of them ({shown}); see the error raised there. "
        "No rank counted the batch. Give every rank an input the layer takes, the layer the same dtype "
        "and device on every rank, and run torch.func transforms over the layer in eval mode only."
    )
