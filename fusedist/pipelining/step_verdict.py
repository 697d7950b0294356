"""The per-step check of a stage module's data parallelism read at the pipeline step's end, before any optimizer step.

Note [the step check's verdict read at the step's end]
    The per-step check of fusedist's data parallelism (Note [step check] in fusedist/reliability/step_check.py,
    Note [stage-3 step check] in fusedist/reliability/sharded_watch.py) is read at the next training forward.
    Under a pipeline schedule that is the next step's first micro-batch: a divergence of a stage's
    data-parallel peers in a step (a rank ran an extra forward of the stage module, or put a module in eval
    mode alone) was named only after every rank had applied that step's optimizer step on gradients reduced
    across ranks at different points. So the step's end reads it, through the step's status exchange (Note [a
    failure told at the step's end] in step_status.py), on every rank of every pipeline:
    - before the exchange, each rank turns each of its stages' pending verdicts into a flag -- nonzero where
      the check's reduced ``max(v)`` and ``min(v)`` differ -- without the host waiting for the device: where
      the last gradient bucket carried the check (a DDP stage on the host, Note [the check carried by the last
      bucket] in fusedist/reliability/carried_check.py) from the rows that bucket brought, already on this
      rank (the backward waited for the bucket); where the check ran its own all-reduce (``fully_shard``,
      ZeRO's strategies, a communication hook) on the host after waiting for that tiny all-reduce, launched
      at the end of the step's last backward; on CUDA by a kernel on the step's stream, made to wait for the
      check's copy event on the device (the check's own stream): no host synchronization;
    - the flag raises the rank's integer in the exchange's one all-reduce, as a failure would (Note [the
      failure told, of several]); the exchange reads that integer on the host as it always did, so a step
      whose ranks agree reads nothing more and adds no collective;
    - after an exchange that found a failure, every rank reads its checks' verdicts -- a divergence's
      all-gather of the details pairs up, as every data-parallel peer of the stage has the flag, so is
      here too -- and the lowest rank that found one broadcasts the stage's error: the stage's peers raise
      the check's own ``RankMismatchError``, their pipelines' other ranks a ``RuntimeError`` naming the
      stage and the check's text. No step ends, no optimizer step follows.
    A pipeline of one rank has no exchange: a verdict the host can read without waiting on the device
    (carried, or of the host's own all-reduce) is read at once; on CUDA it is left for the next forward, as
    before (reading it would make the host wait for the device at every step). Where the pipeline has no
    exchange (a schedule not armed, ``FUSEDIST_CHECKS=0``) the verdict is read at the next forward too.
    Cost on a step whose ranks agree: no collective and no host synchronization more; on the host, the wait
    for the check's tiny all-reduce moves from the next forward to the step's end, and on CUDA the exchange's
    read of its integer (the host waited there for the step's work already) also waits for that all-reduce.
    (The check's pending verdict is read through ``StepCheck.is_pending()``, ``readable_on_host()``,
    ``disagreement_flag()`` and ``settle(reported_at=...)``.)

Note [a retried step paired with a late peer's]
    A rank whose step failed may take the next at once (a failed shape inference counts as ended; a one-rank
    pipeline drops what its failed step left), while a data-parallel peer is still in the failed step's first
    attempt: with the divergence probe on, the retry waits until the peers were told (Note [the next step
    waits until the peers were told] in told_peers.py); with it off (``FUSEDIST_DIVERGENCE_PROBE_S=0``)
    nobody is told, and the retry's reductions paired with the late peer's of the step before: both steps
    returned, every rank applied an optimizer step on gradients averaged across steps, and only the next
    forward's step check named it, by a counter. The step check is now read at the step's end (above), so
    that pairing raises there on every rank, before any optimizer step, wherever a counter differs (the
    failed attempt's forwards); and the error names the pipeline step each data-parallel rank was in (one
    all-gather over the check's group, on the failure path only), so both ranks and their attempts are named.
    Where the failed attempt left every counter the check compares alike, nothing names the pairing: the
    check compares no step number (a field of its own would, at the cost of one more value per step).
"""

from __future__ import annotations

from typing import Optional

import torch

from .._consistency import RankMismatchError


def step_check_of(module):
    """The per-step check of a stage module of fusedist's data parallelism: a ``fully_shard`` root's, a DDP
    (or ``fusedist.replicate``) module's; None for any other, or where checks are off."""
    from .sync_switch import ddp_engine_of
    from ..fsdp import FullyShardedModule

    if isinstance(module, FullyShardedModule):
        ctx = getattr(module._fs_state(), "ctx", None)
        return getattr(getattr(ctx, "watch", None), "step_check", None)
    return getattr(getattr(ddp_engine_of(module), "watch", None), "step_check", None)


def reported_at(stage) -> str:
    return f"the end of the pipeline step (stage {stage.stage_index}), before any optimizer step"


class StepVerdicts:
    """The pending step-check verdicts of a rank's stages at its step's end, carried by the step's status
    exchange (Note [the step check's verdict read at the step's end])."""

    def __init__(self, stages):
        self.checks = []
        self.failed = None  # (stage, error): computing a flag failed on this rank, told as a failure
        self.found = None  # (stage, error): what the reading after a failed exchange raised, the first
        flags = []
        for stage in stages:
            check = step_check_of(stage.submod)
            if check is None or not check.is_pending():
                continue
            self.checks.append((stage, check))
            try:
                flag = check.disagreement_flag(stage.device)
            except Exception as e:  # noqa: BLE001 - told to every rank of the pipeline, then raised here
                self.failed = self.failed or (stage, e)
                continue
            if flag is not None:
                flags.append(flag)
        self.flag = torch.cat(flags).amax().view(1) if flags else None

    def message(self) -> Optional[str]:
        """The failure this rank tells, known before the exchange (a flag that could not be computed)."""
        return None if self.failed is None else told_message(*self.failed)

    def read(self) -> Optional[str]:
        """After an exchange that found a failure: every check's verdict read (on a divergence an all-gather
        with the stage's data-parallel peers, who are all here too); the message of the first error."""
        for stage, check in self.checks:
            if not check.is_pending():
                continue
            try:
                settle_naming_steps(stage, check)
            except Exception as e:  # noqa: BLE001 - told to every rank of the pipeline, then raised here
                self.found = self.found or (stage, e)
        return None if self._first is None else told_message(*self._first)

    @property
    def _first(self):
        """(stage, error) of this rank's first failure: computing a flag, else reading a verdict; or None."""
        return self.failed or self.found

    def error(self) -> Optional[Exception]:
        return None if self._first is None else self._first[1]

    def own_message(self) -> str:
        return "" if self._first is None else told_message(*self._first)


def read_now(stage) -> None:
    """A one-rank pipeline: the stage module's pending verdict read at once where the host can read it
    without waiting on the device (else at the next forward); raises the check's error."""
    check = step_check_of(stage.submod)
    if check is not None and check.readable_on_host():
        settle_naming_steps(stage, check)


def settle_naming_steps(stage, check) -> None:
    """The stage's pending verdict read now; a divergence's error also names each data-parallel rank's
    pipeline step (Note [a retried step paired with a late peer's])."""
    try:
        check.settle(reported_at=reported_at(stage))
    except RankMismatchError as e:
        raise RankMismatchError(f"{e}\n{_steps_of_the_ranks(stage, check.comm)}") from e


def _steps_of_the_ranks(stage, comm) -> str:
    """Which pipeline step each data-parallel rank of the stage was in (an all-gather over the check's group:
    every rank there found the same divergence at the same point, so it pairs up); the failure path only."""
    from ..comm.group_ranks import global_ranks

    mine = torch.tensor([getattr(stage, "_steps_begun", 0)], dtype=torch.int64, device=comm.device)
    everyone = torch.empty(comm.world_size, dtype=torch.int64, device=comm.device)
    try:
        handle = comm.all_gather(everyone, mine, tag="pipeline step numbers")
        if handle is not None:
            handle.wait()
    except Exception as e:  # noqa: BLE001 - the divergence stands; which steps is what is missing
        return f"  pipeline steps of stage {stage.stage_index}'s data-parallel ranks: unknown ({type(e).__name__}: {e})"
    steps = everyone.tolist()
    named = global_ranks(comm) or list(range(comm.world_size))
    listing = "; ".join(f"global rank {named[r]}: step #{n}" for r, n in enumerate(steps))
    if len(set(steps)) == 1:
        return f"  pipeline steps of stage {stage.stage_index}'s data-parallel ranks: {listing} (the same step)"
    return (f"  pipeline steps of stage {stage.stage_index}'s data-parallel ranks differ: {listing} -- a rank took "
            "a step more than its peers (a failed step retried while a peer was still in that step's first "
            "attempt): their reductions paired across steps; no optimizer step applied them. Restart every rank "
            "from the last checkpoint")


def told_message(stage, error: Exception) -> str:
    """What the pipeline's other ranks raise: which stage's peers diverged, and the check's text."""
    if not isinstance(error, RankMismatchError):
        return (f"fusedist.pipelining.PipelineStage: reading the data-parallel step check of stage "
                f"{stage.stage_index} at the step's end failed (no rank's step ends): {type(error).__name__}: {error}")
    return (f"fusedist.pipelining.PipelineStage: the data-parallel replicas of stage {stage.stage_index} diverged "
            f"in this step (found at the step's end, before any optimizer step; no rank's step ends): {error}")


def raise_told(told: str, verdicts: Optional[StepVerdicts]) -> None:
    """Raise the failure the exchange told: this rank's own step-check error where it was the one told (the
    notice may have cut its text), else a ``RuntimeError`` of the told text, chained to this rank's."""
    error = None if verdicts is None else verdicts.error()
    if error is not None and verdicts.own_message().startswith(told):
        raise error
    raise RuntimeError(told) from error
