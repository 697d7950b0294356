"""Which steps a ``Checkpointer`` saves: ``maybe_save``'s every-``every_steps`` schedule and the
checks every step number passes, apart from how a save is taken or written (``periodic.py``).

Note [steps only go forward]
    ``restore`` picks the complete checkpoint with the highest step, and retention never
    removes the steps above the one just saved. A save of a step below the run's last saved
    or restored one (a step counter reset at each epoch, a loop that passes the epoch instead
    of the step) wrote a checkpoint that no restart would pick while the newer ones existed:
    the run's progress since looked saved and was not. Such a save is refused; a run that
    means to go back restores that step first (Note [a restore that rolls back] in
    ``layout.py``). A step saved again (``save(N)`` after ``maybe_save(N)``) replaces it, the
    complete one kept until the new one is complete (Note [saving a step again] in
    ``_replace.py``). Only a save that completed counts: after a failed ``save(N)`` (a full
    disk, a peer lost) the run is still at its last complete checkpoint, and a step below N
    may be saved -- refusing it left the run unable to save until it passed N.
"""

from __future__ import annotations

import operator
from typing import Optional


def is_int(value) -> bool:
    """An int and not a bool (``every_steps=True`` is no schedule)."""
    return isinstance(value, int) and not isinstance(value, bool)


def step_count(step, what: str) -> int:
    """``step`` as an int (a NumPy or 0-d tensor integer too), or a ValueError: a bool, a
    float, a string or a negative number is no count of training steps (``restore(step=True)``
    restored step 1)."""
    try:
        count = operator.index(step) if not isinstance(step, bool) else None
    except TypeError:
        count = None
    if count is None or count < 0:
        raise ValueError(f"fusedist.checkpoint.Checkpointer.{what}: step must be a non-negative int (the "
                         f"number of completed training steps), got {step!r}")
    return count


class ScheduleMixin:
    """``maybe_save`` and the step check of ``Checkpointer`` (``last_saved_step``: the last
    completed save's or restored step; ``_in_flight``: the step of the save not yet waited for;
    ``restored_step``, ``every_steps`` are its attributes)."""

    def maybe_save(self, step: int, extra: Optional[dict] = None) -> bool:
        """Save if ``step`` (completed training steps) is a multiple of ``every_steps``; returns
        whether a save started. Call it on every rank after each step."""
        step = self._check_step(step, "maybe_save")
        if self.every_steps is None or step % self.every_steps or step in (self.last_saved_step, self._in_flight):
            return False
        self.save(step, extra)
        return True

    def _check_step(self, step, what: str) -> int:
        """``step`` as an int (a NumPy or 0-d tensor integer too); refuse a step that is no
        step count, or one below the last saved or restored (Note [steps only go forward])."""
        step = step_count(step, what)
        if self.last_saved_step is not None and step < self.last_saved_step:
            raise ValueError(
                f"fusedist.checkpoint.Checkpointer.{what}({step}): this run is at step {self.last_saved_step} (its "
                f"last {'restored' if self.last_saved_step == self.restored_step else 'saved'} checkpoint), and a "
                f"checkpoint of an earlier step would never be restored while the newer ones exist. Pass the "
                f"number of completed training steps; to roll back, restore(..., step={step}) first"
            )
        return step
