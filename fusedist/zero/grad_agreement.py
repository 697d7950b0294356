"""Whether the gradients a ZeroRedundancyOptimizer without a DDP model steps are the same on every rank.

Note [gradients nobody averaged]
    The flat partition (Note [flat partition] in ``partition.py``) gives each rank a slice of the
    parameter space, which it steps with its own ``p.grad``; the slices are then all-gathered. That is
    right when every rank holds the same (averaged) gradients: a fusedist DDP model's, torch DDP's, or
    gradients the program all-reduced itself. A model not wrapped at all, each rank backward-ing its own
    batch, has other gradients on every rank: a parameter cut by a shard boundary then ended a mix of
    several ranks' updates, the same mix on every rank, matching no rank's step and no other optimizer's
    result (torch's ZeroRedundancyOptimizer steps each whole parameter with its owner's gradient). Nothing
    said so. Without a DDP model (and outside ``Join``, which needs one), the first ``step()`` that sees a
    gradient compares them across ranks: one all-reduce (MAX) of a fingerprint per parameter and its
    negation -- whether it has a gradient, whether that is finite, its L2 norm and a projection on a fixed
    +-1 pattern (which two different gradients of the same norm do not share) -- and on a difference
    every rank raises the same error, naming the parameter and two ranks, before anything is stepped. The
    ranks then exchange that one parameter's fingerprints to name the ranks (the error path only). Once a
    comparison found the gradients alike, later steps compare their norms on the tail of a parameter
    all-gather they make anyway (Note [gradients compared at every step] in carried_agreement.py): a
    program that averaged its gradients once may stop doing so (accumulation under torch DDP's
    no_sync() that takes in the last micro-batch too).

    Alike means within a relative ``tolerance`` of the largest norm (1e-5 in FP32/FP64, a few rounding
    steps in half precision): averaged gradients are bitwise equal on every rank, and the fingerprint of
    equal values differs at most in the summation order of its float64 sums; gradients of different
    batches differ by far more. Non-finite gradients (an overflowing GradScaler step) are alike where every
    rank's are non-finite; a step whose compared gradients were all non-finite leaves the check for the
    next step.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..comm.objects import all_gather_object
from ..reliability.config import checks_enabled
from .wiring import DROPPED_WRAPPER_ADVICE, dropped_wrapper

OP = "ZeroRedundancyOptimizer: gradients compared across ranks"
NAMING_OP = "ZeroRedundancyOptimizer: gradients compared across ranks (naming the ranks)"
# per parameter: has a gradient, non-finite, L2 norm, projection on the +-1 pattern
PRESENT, NONFINITE, NORM, PROJECTION = range(4)
WIDTH = 4
CHUNK = 1 << 20  # elements converted to float64 at once (bounded memory for the largest parameter)


def compares(zero) -> bool:
    """Whether this step compares the gradients across ranks (Note [gradients nobody averaged])."""
    return (not zero._grads_agreed and zero.stage == 1 and zero.ddp is None and not zero._averaged_by_model
            and zero.comm is not None and zero.world_size > 1 and not zero._join_config.enable)


def tolerance(dtype: torch.dtype) -> float:
    """How far apart (relative to the largest norm) fingerprints of alike gradients may lie."""
    real = dtype.to_real() if dtype.is_complex else dtype
    return max(1e-5, 4 * torch.finfo(real).eps) if real.is_floating_point else 1e-5


def _pattern(start: int, count: int, device) -> torch.Tensor:
    """+-1 at flat positions ``start .. start+count`` (a multiplicative hash's bit 15: the same on every rank)."""
    index = torch.arange(start, start + count, dtype=torch.int64, device=device)
    bits = ((index * 2654435761) % (1 << 32)) >> 15
    return 1.0 - 2.0 * (bits % 2).to(torch.float64)


@torch.no_grad()
def fingerprint(grad: Optional[torch.Tensor], device) -> torch.Tensor:
    """``[present, non-finite, norm, projection]`` of one gradient, float64 on ``device`` (the
    gradient's own where it has one; Note [gradients nobody averaged]); no host synchronization."""
    if grad is None:
        return torch.zeros(WIDTH, dtype=torch.float64, device=device)
    one = torch.ones((), dtype=torch.float64, device=grad.device)
    if grad.is_sparse:  # refused by the step on every rank (no flat slices): nothing to compare
        return torch.stack([one, one * 0, one * 0, one * 0])
    flat = (torch.view_as_real(grad.resolve_conj()) if grad.is_complex() else grad).reshape(-1)
    square_sum, projection = one * 0, one * 0
    for start in range(0, flat.numel(), CHUNK):
        part = flat[start:start + CHUNK].to(torch.float64)
        square_sum = square_sum + part.square().sum()
        projection = projection + (part * _pattern(start, part.numel(), part.device)).sum()
    finite = torch.isfinite(square_sum)  # (a square sum in float64 is inf or nan only from inf/nan values)
    return torch.stack([one, (~finite).to(torch.float64), torch.where(finite, square_sum.sqrt(), one * 0),
                        torch.where(finite & torch.isfinite(projection), projection, one * 0)])


def _differs(high: list, low: list, rtol: float) -> Optional[str]:
    """Why two fingerprint bounds (the largest and the smallest over some ranks) do not match, or None."""
    if high[PRESENT] != low[PRESENT]:
        return "a gradient on some ranks only"
    if high[PRESENT] == 0:
        return None
    if high[NONFINITE] != low[NONFINITE]:
        return "inf/nan on some ranks only"
    if high[NONFINITE]:
        return None
    slack = rtol * high[NORM]
    if high[NORM] - low[NORM] > slack or high[PROJECTION] - low[PROJECTION] > slack:
        return "other values"
    return None


def _pair(rows: list, rtol: float) -> tuple:
    """Two ranks whose fingerprints of one parameter differ (rank 0 and another where it can)."""
    for a in range(len(rows)):
        for b in range(a + 1, len(rows)):
            high = [max(x, y) for x, y in zip(rows[a], rows[b])]
            low = [min(x, y) for x, y in zip(rows[a], rows[b])]
            if _differs(high, low, rtol) is not None:
                return a, b
    return 0, 1  # (alike pairwise, apart over all ranks: the tolerance is not transitive)


def _describe(row: list) -> str:
    """One rank's fingerprint, as the error shows it."""
    if not row[PRESENT]:
        return "no gradient"
    if row[NONFINITE]:
        return "a gradient holding inf/nan"
    return f"a gradient of norm {row[NORM]:.6g}"


def carries(zero) -> bool:
    """Whether this step's parameter all-gathers carry the gradients' fingerprints: every step after the
    first comparison found them alike (Note [gradients compared at every step] in carried_agreement.py). On
    host tensors only: the fingerprints are read on the host, which on a GPU would synchronize every step."""
    return (zero._grads_agreed and zero.stage == 1 and zero.ddp is None and not zero._averaged_by_model
            and zero.comm is not None and zero.world_size > 1 and not zero._join_config.enable
            and zero._partition is not None and torch.device(zero.comm.device).type == "cpu"
            and checks_enabled())


def raise_carried(zero) -> None:
    """Raise the verdict of the fingerprints this step's gathers carried, if they differed (every rank
    alike, at the end of the step)."""
    refusal, zero._gatherer.refusal = zero._gatherer.refusal, None
    zero._gatherer.rows = None  # (rows no gather took: they hold the optimizer)
    if refusal is not None:
        raise refusal


def _local_fingerprints(zero) -> torch.Tensor:
    """This rank's fingerprint of each parameter's gradient, ``[parameters, WIDTH]`` float64. The sharded
    ones only: which parameters are sharded is compared on its own (Note [parameters unfrozen on some
    ranks only] in trainable_check.py), before a parameter unfrozen since joins."""
    sharded = set(zero._trainable)
    return torch.stack([fingerprint(p.grad if i in sharded else None, zero._device)
                        for i, p in enumerate(zero._params)])


def check(zero) -> None:
    """Compare the gradients of ``zero``'s parameters across ranks until they are found alike (Note
    [gradients nobody averaged]); raise on every rank, before anything is stepped, where they differ. A
    collective: every rank's ``step()`` calls it at the same point. Later steps hand their fingerprints to
    the parameter all-gathers instead (Note [gradients compared at every step] in carried_agreement.py)."""
    raise_carried(zero)  # (a verdict of gathers waited for after the step that made them)
    zero._gatherer.steps += 1
    zero._gatherer.rows = None  # (rows of an earlier step that never gathered them)
    if not compares(zero):
        if carries(zero):  # Note [gradients compared at every step] in carried_agreement.py
            from .carried_agreement import CarriedRows

            zero._gatherer.rows = CarriedRows(zero, zero._gatherer.steps)
        return
    params = zero._params  # (the same parameters on every rank: compared at construction)
    local = _local_fingerprints(zero).to(zero.comm.device)
    packed = torch.cat([local.reshape(-1), -local.reshape(-1)])
    zero.comm.all_reduce(packed, op="max", tag=OP)
    values = packed.cpu().tolist()
    half = len(values) // 2
    compared_finite = False
    for index, p in enumerate(params):
        high = values[index * WIDTH:(index + 1) * WIDTH]
        low = [-v for v in values[half + index * WIDTH:half + (index + 1) * WIDTH]]
        rtol = tolerance(p.dtype)
        why = _differs(high, low, rtol)
        if why is not None:
            raise _refusal(zero, index, local[index].cpu().tolist(), why, rtol)
        compared_finite = compared_finite or (high[PRESENT] == 1 and not high[NONFINITE])
    zero._grads_agreed = compared_finite  # (every rank decides alike: from the all-reduced values)


def _refusal(zero, index: int, row: list, why: str, rtol: float) -> RuntimeError:
    """The error every rank raises (after exchanging the parameter's fingerprints to name two ranks)."""
    every = all_gather_object(zero.comm, row, tag=NAMING_OP)
    a, b = _pair(every, rtol)
    if dropped_wrapper(zero._params):  # Note [a dropped wrapper] in wiring.py
        advice = ("The fusedist.DistributedDataParallel wrapper of these parameters was dropped: nothing kept a "
                  "reference to it, so it was freed and its backward hooks, which average the gradients, came off. "
                  f"{DROPPED_WRAPPER_ADVICE}.")
    else:
        advice = ("Wrap the model in fusedist.DistributedDataParallel (or torch's DistributedDataParallel), or "
                  "average the gradients yourself before step() (torch.distributed.all_reduce(p.grad, "
                  "op=ReduceOp.AVG) for every parameter).")
    return RuntimeError(
        f"ZeroRedundancyOptimizer (rank {zero.rank}): gradients differ across ranks at {zero._param_name(index)} "
        f"({why}: rank {a} has {_describe(every[a])}, rank {b} {_describe(every[b])}); nothing was stepped. "
        "ZeroRedundancyOptimizer expects the same (averaged) gradients on every rank: each rank steps its own "
        "slice of the parameters with its own gradients, so gradients that differ would leave every parameter "
        f"a mix of several ranks' updates. {advice}")
