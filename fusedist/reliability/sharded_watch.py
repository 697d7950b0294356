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
    a CRC of the wrapping, the sequence number of the last collective, a digest of which
    parameters had a gradient in each unit's reduction (Note [rank-independent reductions] in
    ``fusedist/fsdp/grads.py``) -- and reads its verdict
    at the next training forward. A divergence is a ``RankMismatchError`` on every rank, one
    step after it happened. ``check_now()`` checks at once (``fusedist.checkpoint.save``
    calls it before writing). ``FUSEDIST_CHECKS=0`` turns it off.

    At world size 1 the root has its watch too, as a DDP model has its ``StepWatch``: the
    counters and the optimizer step guard apply; the cross-rank check (and the wrapping
    check) are off, so the watch issues no collective there.
"""

from __future__ import annotations

import zlib

from ..ownership import register_step_watch
from .config import checks_enabled
from .engine_watch import PIPELINE_HINT, WatchBase

SUBJECT = {"subject": "fully_shard", "model": "fully_shard model", "reduced": "units", "explain": {
    "unused": "a different set of parameters received gradients (a branch of a unit ran on some ranks only): "
    "the ranks would step different pieces of one parameter; use every trainable parameter in the loss on "
    "every rank (e.g. add 0 * the branch's output on the ranks that skip it), or call "
    "model.set_reduce_scatter_unused_params(True) on the root so that every rank reduces every trainable "
    "parameter of a unit that ran (zeros where a rank computed no gradient), as torch's FSDP2 requires",
    "trainable": "the ranks ran different units in forward (a unit skipped, repeated or reordered on some ranks: "
    "rank-dependent control flow such as a per-rank layer drop), so their all-gathers and reduce-scatters "
    "paired one unit's with another's; every rank must call the same units in the same order"}}


class ShardedStepWatch(WatchBase):
    """Counters, the per-step check and the stall-report context of one fully_shard root."""

    owner_name = "fully_shard model"
    check_tag = "fully_shard step check"
    no_backward_advice = "so there are no reduced gradients to apply. Call loss.backward() before optimizer.step()."
    unsynced_advice = ("under set_requires_gradient_sync(False): the gradients are this rank's unreduced local "
                       "sums, so the ranks would diverge. Turn gradient synchronization back on for the last "
                       "micro-batch's backward before stepping." + PIPELINE_HINT)

    def __init__(self, comm, wrapping: list, params: list):
        self.comm = comm
        self.units = len(wrapping)
        self.wrapping_crc = zlib.crc32(repr(wrapping).encode()) & 0x7FFFFFFF
        self.backwards = 0
        self.in_backward = False
        self._gradients_crc, self._without_grad = 0, []  # the last synchronized backward's reductions
        self._units_crc, self._units = 0, []  # the units its forward ran, in order
        super().__init__(comm)
        from . import optimizer_guard

        if checks_enabled():  # FUSEDIST_CHECKS=0 turns the guard off, as for a DDP model
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

    def backward_aborted(self) -> None:
        """The backward that began raised before its end (``reset_iter_state``, or Note [aborted
        backward] in ``fusedist/fsdp/state.py``): no longer in it. It is not counted as a
        backward: it reduced nothing the step check could compare."""
        self.in_backward = False

    def backward_ends(self, synced: bool, reductions: list = (), units: list = ()) -> None:
        """After the last unit's reduce-scatter was issued (and finished). ``reductions``: the
        backward's (unit, section, parameters with a gradient, names of those without) log
        (Note [rank-independent reductions] in ``fusedist/fsdp/grads.py``); ``units``: the
        units its forward ran, in order (their paths), compared too: ranks that ran different
        alike units pair gathers of equal sizes silently."""
        self.in_backward = False
        if synced and self.step_check is not None:
            log = sorted(entry[:3] for entry in reductions)
            self._gradients_crc = zlib.crc32(repr(log).encode()) & 0x7FFFFFFF
            self._without_grad = [name for entry in reductions for name in entry[3]]
            self._units = list(units)
            self._units_crc = zlib.crc32(repr(self._units).encode()) & 0x7FFFFFFF
            self._launch(checked_now=False)
        self.backwards += 1
        self.last_backward_synced = synced
        if synced:
            self.sync_steps += 1

    # ------------------------------------------------------------------ checks
    def check_now(self) -> None:
        """Compare where the ranks are now (a collective: every rank calls it at the same point)."""
        self._check_now(lambda: self._launch(checked_now=True))

    def _launch(self, checked_now: bool) -> None:
        self.step_check.launch(
            [self.sync_steps, self.forwards, self.backwards, self.optimizer_steps, self.wrapping_crc,
             self.comm.last_seq, self._gradients_crc, self._units_crc, 0],  # (no replicated parameters)
            dict(SUBJECT, buckets=self.units, checked_now=checked_now, unused_names=self._without_grad,
                 describe_trainable=self._describe_units))

    def _describe_units(self, comm) -> list:
        """This rank's units in forward order, for the mismatch report (every rank prints its own)."""
        units = self._units
        shown = ", ".join(units[:12]) + (f", ... ({len(units)} calls)" if len(units) > 12 else "")
        return [f"  units run in forward on rank {self.rank}: {shown}"]

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
