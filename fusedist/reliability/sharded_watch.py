"""The reliability layer's view of one ``fully_shard`` model (ZeRO-3), as ``engine_watch.py``
is for a DDP model.

Note [stage-3 step check]
    Unit all-gathers and reduce-scatters pair up by issue order, like DDP's buckets: a rank that
    skips a step, runs an extra forward, or steps its optimizer on a different iteration leaves
    the ranks out of step, and with sharded parameters nothing fails until the numbers are
    wrong. One case is easy to hit: ``torch.amp.GradScaler`` decides to skip a step from this
    rank's pieces of the gradients only, so the rank whose piece overflowed skips alone.

    So at the end of every synchronized backward, after the last unit's reduce-scatter (the
    same point of every rank's collective order), the root launches the per-step check of
    Note [step check] in ``step_check.py`` with the same fields -- synchronized backwards,
    training forwards, all backwards, optimizer steps (counted by the optimizer step guard),
    a CRC of the wrapping, the sequence number of the last collective -- and reads its verdict
    at the next training forward. A divergence is a ``RankMismatchError`` on every rank, one
    step after it happened. ``check_now()`` checks at once (``fusedist.checkpoint.save``
    calls it before writing). ``FUSEDIST_CHECKS=0`` turns it off.
"""

from __future__ import annotations

import zlib

from ..ownership import register_step_watch
from .config import checks_enabled
from .monitor import attach_monitor
from .step_check import StepCheck

SUBJECT = {"subject": "fully_shard", "model": "fully_shard model", "reduced": "units"}


class ShardedStepWatch:
    """Counters, the per-step check and the stall-report context of one fully_shard root."""

    owner_name = "fully_shard model"
    unsynced_hint = "set_requires_gradient_sync(False)"

    def __init__(self, comm, wrapping: list, params: list):
        self.comm = comm
        self.rank = comm.rank
        self.units = len(wrapping)
        self.wrapping_crc = zlib.crc32(repr(wrapping).encode()) & 0x7FFFFFFF
        self.sync_steps = 0
        self.forwards = 0
        self.backwards = 0
        self.optimizer_steps = 0  # counted by fusedist.reliability.optimizer_guard
        self.last_backward_synced = True
        self.in_backward = False
        self.step_check = StepCheck(comm) if checks_enabled() and comm.world_size > 1 else None
        self.monitor = attach_monitor(comm)
        if self.monitor is not None:
            self.monitor.add_context_provider(self.position)
        from . import optimizer_guard

        optimizer_guard.install()  # counts optimizer steps over these parameters
        register_step_watch(params, self)

    # ------------------------------------------------------------------ events of the root
    def forward_begins(self) -> None:
        """A training forward of the root, before its first all-gather."""
        self.settle()
        self.forwards += 1

    def backward_begins(self) -> None:
        self.in_backward = True
        if self.monitor is not None:
            self.monitor.step_hint = self.sync_steps

    def backward_ends(self, synced: bool) -> None:
        """After the last unit's reduce-scatter was issued (and finished)."""
        self.in_backward = False
        if synced and self.step_check is not None:
            self._launch(checked_now=False)
        self.backwards += 1
        self.last_backward_synced = synced
        if synced:
            self.sync_steps += 1

    # ------------------------------------------------------------------ checks
    def settle(self) -> None:
        if self.step_check is not None:
            self.step_check.settle()

    def check_now(self) -> None:
        """Compare where the ranks are now (a collective: every rank calls it at the same point)."""
        if self.step_check is None:
            return
        self.step_check.settle()
        self._launch(checked_now=True)
        self.step_check.settle()

    def _launch(self, checked_now: bool) -> None:
        self.step_check.launch(
            [self.sync_steps, self.forwards, self.backwards, self.optimizer_steps, self.wrapping_crc,
             self.comm.last_seq, 0, 0],
            dict(SUBJECT, buckets=self.units, checked_now=checked_now))

    def backward_count(self) -> int:
        return self.backwards

    def position(self) -> dict:
        return {
            "fully_shard_step": self.sync_steps,
            "fully_shard_backward": self.backwards,
            "fully_shard_forwards": self.forwards,
            "optimizer_steps": self.optimizer_steps,
            "in_backward": self.in_backward,
        }
