"""The reliability layer's view of one DDP model: an observer of its gradient engine.

Counts what the ranks must agree on (training forwards, synchronized backwards, optimizer
steps), runs the per-step cross-rank check (Note [step check] in ``step_check.py``) at the
point of the collective order the engine announces, stamps the collective monitor's history
with the step, and describes the position in stall reports. The engine itself knows none of
this: it only announces events (``fusedist/ddp/events.py``).
"""

from __future__ import annotations

from typing import Optional

from ..ddp.events import EngineObserver
from .config import checks_enabled
from .monitor import attach_monitor
from .step_check import StepCheck, layout_crc

#: The other way to an unsynchronized step: a pipeline schedule's step synchronizes a stage's
#: gradients at its last micro-batch's backward only.
PIPELINE_HINT = (" In a pipeline stage: the schedule's step ran fewer backwards than micro-batches (a "
                 "forward-only step, or one stopped early), so the last one never synchronized.")


class WatchBase:
    """What every model's watch has: the counters the ranks must agree on, the per-step check,
    the stall-report context, and what the optimizer step guard reads (``rank``,
    ``backward_count()``, ``last_backward_synced``) and says (the class's wording)."""

    #: The model, as the step guard names it, and the ends of its two messages (subclasses).
    owner_name = no_backward_advice = unsynced_advice = ""
    #: The per-step check's collectives, as errors and stall reports name them.
    check_tag = "ddp step check"

    def __init__(self, comm):
        self.rank = comm.rank
        self.sync_steps = 0  # synchronized backwards completed
        self.forwards = 0  # training forwards (grad enabled)
        self.optimizer_steps = 0  # counted by fusedist.reliability.optimizer_guard
        self.last_backward_synced = True
        self.step_check = StepCheck(comm, self.check_tag) if checks_enabled() and comm.world_size > 1 else None
        self.monitor = attach_monitor(comm)
        if self.monitor is not None:
            self.monitor.add_context_provider(self.position)

    def settle(self) -> None:
        """Read the last step check's verdict (raises ``RankMismatchError`` on divergence)."""
        if self.step_check is not None:
            self.step_check.settle()

    def _check_now(self, launch) -> None:
        """The pending verdict, then ``launch()``'s check of the current counters, waited for."""
        if self.step_check is None:
            return
        self.step_check.settle()
        launch()
        self.step_check.settle()

    def backward_count(self) -> int:
        raise NotImplementedError

    def position(self) -> dict:
        raise NotImplementedError


class StepWatch(WatchBase, EngineObserver):
    """Counters, the step check and the stall-report context of one DDP engine."""

    owner_name = "DistributedDataParallel model"
    no_backward_advice = ("so there are no averaged gradients to apply. Call loss.backward() (outside no_sync()) "
                          "before optimizer.step().")
    unsynced_advice = ("that was not synchronized -- its forward ran under no_sync(), or it did not go through a "
                       "forward of the wrapper (a backward through model.module): the gradients are this rank's "
                       "local sums, not averaged across ranks, so the ranks would diverge. Run the last "
                       "micro-batch's forward (through the wrapper, outside no_sync()) and backward before "
                       "stepping." + PIPELINE_HINT)

    def __init__(self, engine):
        self._engine = engine  # (before the base registers position() with the monitor)
        self._layout_crc: Optional[tuple] = None
        super().__init__(engine.comm)

    def backward_count(self) -> int:
        return self._engine.iteration  # every backward, synchronized or not

    # ------------------------------------------------------------------ engine events
    def forward_begins(self, engine) -> None:
        self.settle()  # the last step's verdict, before this step's first collective
        self.forwards += 1

    def backward_begins(self, engine) -> None:
        if self.monitor is not None:  # stamps this step on the collective history
            self.monitor.step_hint = self.sync_steps

    def buckets_launched(self, engine, unused: list) -> None:
        if self.step_check is not None:
            self.launch_check(engine, unused)

    def backward_ends(self, engine) -> None:
        self.last_backward_synced = engine.sync
        if engine.sync:
            self.sync_steps += 1

    def agreement_point(self, engine) -> None:
        # If only some ranks got here, raise the every-rank mismatch instead (the other ranks
        # read it at their next forward).
        self.settle()

    # ------------------------------------------------------------------ checks
    def check_now(self, engine, joined: bool = False) -> None:
        """Compare where this rank is with every other rank now (Note [step check]): the pending
        verdict, then the current counters with one more tiny all-reduce, waited for."""
        self._check_now(lambda: self.launch_check(engine, [], checked_now=True, joined=joined))

    def launch_check(self, engine, unused: list, checked_now: bool = False, joined: bool = False) -> None:
        if joined or engine.joined:  # Note [joined ranks]: neutral in the comparison
            self.step_check.launch(None, {"buckets": len(engine.layout.buckets), "checked_now": checked_now})
            return
        handles = engine.handles
        last_seq = handles[-1].seq if handles and handles[-1] is not None else -1
        if self._layout_crc is None or self._layout_crc[0] is not engine.layout:
            self._layout_crc = (engine.layout, layout_crc(engine.layout))
        tracker = engine.tracker
        unused_count = 0 if engine.config.tolerates_unused else len(unused)
        self.step_check.launch([
            self.sync_steps,
            self.forwards,
            engine.iteration,  # every backward, synchronized or not
            self.optimizer_steps,
            self._layout_crc[1],
            last_seq,
            unused_count,
            tracker.crc if tracker is not None else 0,
        ], {"buckets": len(engine.layout.buckets),
            "unused_names": [engine.names[engine.index_of[p]] for p in unused],
            "checked_now": checked_now,
            "describe_trainable": tracker.describe_mismatch if tracker is not None else None})

    # ------------------------------------------------------------------ joined ranks
    def counters(self) -> list:
        return [self.sync_steps, self.forwards, self._engine.iteration, self.optimizer_steps]

    def set_counters(self, values: list) -> None:
        """Take the last joiner's counters (Note [joined ranks] in fusedist/ddp/join.py)."""
        self.sync_steps, self.forwards, self._engine.iteration, self.optimizer_steps = values

    def position(self) -> dict:
        """Where training is, for stall reports (fusedist.reliability)."""
        engine = self._engine
        return {
            "ddp_step": self.sync_steps,
            "ddp_backward": engine.iteration,
            "ddp_forwards": self.forwards,
            "optimizer_steps": self.optimizer_steps,
            "in_backward": engine.in_backward,
            "buckets_launched": f"{getattr(engine, 'next_launch', 0)}/{len(engine.layout.buckets)}",
            "buckets_finished": f"{getattr(engine, 'next_finish', 0)}/{len(engine.layout.buckets)}",
        }
