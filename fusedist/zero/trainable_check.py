"""Comparing across ranks which parameters a ZeroRedundancyOptimizer without a DDP model shards,
before parameters made trainable since construction join its partition.

Note [parameters unfrozen on some ranks only]
    Without DDP nothing compared which parameters are trainable after construction: a
    parameter unfrozen on one rank only (a schedule read per host, a rank that missed the
    epoch that unfreezes) joined there alone, that rank's flat space grew, and its next
    all-gather met the others' of another size -- they waited until the stall timeout. So
    where every rank calls ``join_pending`` with ``compare`` (``step()``, the scaler's and the
    clip's norm, which all-reduce anyway, ``gradient_slices()`` and ``add_param_group``) the ranks
    compare the parameters they would shard once the pending ones joined, a fingerprint (their
    count and hash) per rank, and the pending ones join only where the ranks agree (Note
    [parameters join after the comparison]); only where they differ do the ranks exchange the
    lists, to raise the same RankMismatchError naming the parameters and ranks on every rank.
    Under ``Join`` (uneven inputs) a joined rank shadows only the step's own collectives, so
    nothing is compared there. Nor where no parameter of the optimizer was ever frozen
    (``_may_grow``: set at construction and by ``add_param_group``, both compared across ranks,
    and never cleared, so it is the same on every rank): nothing can join there, and the step
    pays no collective or host synchronization.

Note [one comparison a step]
    The comparison costs a collective. The scaler's found-inf check and the clip's norm
    all-reduce two numbers anyway: the fingerprint rides in that all-reduce
    (``grow.fingerprint_entries``, read back by ``grow.check_fingerprint_sums``), and once the
    ranks compared in a step, the later points of the same step (``gradient_slices()``, ``step()``
    itself) compare nothing and join nothing: parameters unfrozen after the comparison join at
    the next step's first point (they have no gradient in this one: the backward ran before).
    Whether a step compared is the same on every rank (every rank calls the scaler, clip and
    step alike), so the ranks issue the same collectives. A step without a scaler, a clip or a
    gradient-norm read compares in ``step()`` with a small all-reduce of its own.

Note [parameters join after the comparison]
    A parameter unfrozen on one rank only grew that rank's partition before the comparison
    refused it (a local gradient read, such as the scaler's "any gradients?" before its
    all-reduce, took it on): the refusal left the ranks' optimizers different. Now, wherever the
    ranks compare, a pending parameter joins only after the comparison found every rank alike;
    until then the norm and the found-inf check read its gradient whole, on rank 0 only (the
    global sum of squares and the flag are the same; the parameter's slices exist only once it
    joined). A refused step changes nothing: no partition grows and no parameter moves.

Note [the comparison read without a synchronization]
    The comparison's verdict lives on the communicator's device. Where that is the host (gloo),
    every rank reads it at once and raises in the call that compared. On an accelerator (NCCL)
    reading it would synchronize the host with the device in every step of a run that ever froze
    a parameter. There a rank reads it at once only where parameters wait to join on it (once per
    unfreezing, to know whether they may join); every other rank keeps it on the device, where
    the step folds it into the found-inf flag it already consumes (ranks that differ apply
    nothing, as for an inf), and every rank reads it at the next step's first comparison point,
    long after it landed (a copy to the host and an event: no wait for later work), and raises
    the same RankMismatchError there. (An inner optimizer that cannot take a found-inf flag on
    the device is skipped through a host read of the flag, as torch's GradScaler does: torch's
    foreach and for-loop steps refuse one, "Expected grad_scale and found_inf to be None"; only
    its ``fused=True`` steps take it.) A step skipped so counts as no step for an LR scheduler
    (Note [a refused or skipped sharded step and the LR scheduler] in step_flag.py).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import param_labels

OP = "ZeroRedundancyOptimizer: trainable parameter check"
_KEY_BITS = 20  # each key and its square summed over up to 8192 ranks stay exact in float64 and int64


def compares(zero) -> bool:
    """Whether the ranks compare their sharded parameters (Note [parameters unfrozen on some ranks only])."""
    return zero.comm is not None and zero.world_size > 1 and not zero._join_config.enable and zero._may_grow


def keys(sharded: list) -> list:
    """The fingerprint of a sharded set: its count and a 60-bit hash, as keys of 20 bits."""
    h = hash(tuple(sharded)) % (1 << 60)
    mask = (1 << _KEY_BITS) - 1
    return [len(sharded) & mask] + [(h >> (_KEY_BITS * k)) & mask for k in range(3)]


def sums_differ(sums: torch.Tensor, world_size: int) -> torch.Tensor:
    """From the all-reduced sums of the keys and of their squares: whether the ranks' keys
    differ, on the sums' device. Every key is equal iff ``world * sum(k^2) == sum(k)^2``, tested
    in int64 as ``sum(k) % world == 0`` and ``sum(k^2) == sum(k) * (sum(k) // world)`` (exact)."""
    n = sums.numel() // 2
    exact = sums.to(torch.int64)
    totals, squares = exact[:n], exact[n:]
    return ((totals % world_size != 0) | (squares != totals * (totals // world_size))).any()


def compare_own(zero, sharded: list) -> torch.Tensor:
    """A small all-reduce of its own: the keys and their negations (the maximum and the
    minimum); whether the ranks' keys differ, on the communicator's device."""
    key = keys(sharded)
    mark = torch.tensor(key + [-k for k in key], dtype=torch.int64, device=zero.comm.device)
    zero.comm.all_reduce(mark, op="max", tag=OP)
    n = len(key)
    return (mark[:n] != -mark[n:]).any()


def reads_for_free(flag: torch.Tensor) -> bool:
    """Whether reading ``flag`` on the host costs no synchronization (Note [the comparison read
    without a synchronization])."""
    return flag.device.type == "cpu"


class Verdict:
    """A comparison not read on the host yet: the flag (the step's skip) and this rank's set,
    read at the next step's first comparison point (Note [the comparison read without a
    synchronization])."""

    def __init__(self, differ: torch.Tensor, sharded: list):
        self.differ = differ
        self.sharded = sharded
        self._event = None
        self._host = differ
        if differ.device.type == "cuda":
            self._host = differ.to("cpu", non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def read(self) -> bool:
        if self._event is not None:
            self._event.synchronize()  # (the copy of this flag, not the work queued after it)
        return bool(self._host)


def conclude(zero, differ: torch.Tensor, sharded: list, joining: list) -> bool:
    """After the ranks compared ``sharded`` (this rank's set with ``joining``): whether the
    pending parameters may join now. Raises on every rank where the verdict reads for free;
    otherwise keeps it for the step and the next comparison point (Note [the comparison read
    without a synchronization])."""
    if reads_for_free(differ):
        if bool(differ):
            raise_different(zero, sharded)  # (not compared: the next comparison point raises it again)
        zero._sharded_compared = True
        return True
    zero._sharded_compared = True
    if joining and not bool(differ):  # (a host read only where parameters wait to join on this rank)
        return True
    zero._trainable_verdict = Verdict(differ, sharded)
    return False


def settle(zero) -> None:
    """At a step's first comparison point: the verdict of an earlier step that was kept on the
    device; raises the ranks' RankMismatchError on every rank where the sets differed."""
    verdict = zero._trainable_verdict
    if verdict is None:
        return
    if verdict.read():
        raise_different(zero, verdict.sharded)  # (kept: every later comparison point raises it again)
    zero._trainable_verdict = None


def with_skip(zero, found: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The step's found-inf flag with the kept verdict folded in: a step whose comparison found
    the ranks different applies nothing."""
    verdict = zero._trainable_verdict
    if verdict is None:
        return found
    skip = verdict.differ.to(device=zero._device, dtype=torch.float32).reshape(1)
    return skip if found is None else torch.maximum(found.reshape(1).float(), skip)


def raise_different(zero, sharded: list) -> None:
    """The ranks shard different parameters: exchange the lists and raise the same error on every rank."""
    from .._consistency import gather_objects, raise_if_different

    names = param_labels.names_for_exchange(zero, zero._params, zero._group_of)  # (for the message only)
    entries = [param_labels.NamedEntry((i, tuple(zero._params[i].shape), names[i])) for i in sharded]
    everyone = gather_objects(entries, zero.comm, OP)
    raise_if_different(
        everyone, zero.rank, "the trainable parameters of ZeroRedundancyOptimizer",
        lambda e: param_labels.label_of(e[0], e[1], e[2]) + " trainable",
        "Without a DDP model a parameter made trainable after construction joins the shards at the first step "
        "(or unscale_/clip before it) that sees it trainable, and every rank must shard the same parameters: set "
        "requires_grad=True on the same parameters on every rank before the same step.")
