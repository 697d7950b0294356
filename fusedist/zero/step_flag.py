"""What a ZeroRedundancyOptimizer step that applied nothing tells torch's LR schedulers.

Note [a refused or skipped sharded step and the LR scheduler]
    torch's LR schedulers wrap ``optimizer.step`` to set ``optimizer._opt_called`` before the
    step runs, and warn at their first step while it is unset ("Detected call of
    `lr_scheduler.step()` before `optimizer.step()`"). torch's GradScaler skips an overflowed
    step by not calling the optimizer's step, and refuses (its own checks) by raising before it:
    either way the flag stays unset and a schedule whose first step applied nothing is warned
    about. fusedist's scaler protocol decides the flag from the found-inf flag the scaler gave
    (Note [a skipped step and the LR scheduler] in ``fusedist/optim/_scaler_protocol.py``), but a
    sharded step can apply nothing for reasons found inside it: a refusal it raises (trainable
    parameters that differ between the ranks, a stage-2 optimizer under torch's GradScaler, one
    replaced or not completed) and a step skipped by a comparison verdict kept on the device
    (Note [the comparison read without a synchronization] in ``trainable_check.py``). Both
    counted as steps, so such a first step went without the warning torch gives. Now the
    wrapper's decision is remembered with the flag before it (:func:`remember`), and taken up
    again once the step has run: a step that raised puts the flag back as it was, and a step
    the kept verdict skipped counts as a step the scaler skipped.
"""

from __future__ import annotations

from typing import Optional

from . import trainable_check

_FLAG = "_fusedist_opt_called"  # where the scaler protocol keeps ``_opt_called`` (its property)
_MARK = "_fusedist_zero_flag_mark"


def remember(zero, before, decided, found) -> None:
    """The scheduler's wrapper set the flag: what it was, what was decided, and the scaler's
    found-inf flag then (the step clears it)."""
    zero.__dict__[_MARK] = (before, decided, found)


def take(zero) -> Optional[tuple]:
    """At the start of ``step()``: what :func:`remember` kept for this call, or None -- also
    where the flag no longer holds the decision (a mark set outside a step, put back since)."""
    mark = zero.__dict__.pop(_MARK, None)
    if mark is None or zero.__dict__.get(_FLAG) is not mark[1]:
        return None
    return mark


def undo(zero, mark: Optional[tuple]) -> None:
    """The step raised: it was no step, the flag is as before the call."""
    if mark is not None and zero.__dict__.get(_FLAG) is mark[1]:
        zero.__dict__[_FLAG] = mark[0]


def redecide(zero, mark: Optional[tuple]) -> None:
    """The step ran: with a comparison verdict kept on the device (which skipped it where the
    ranks differ), the flag is decided from the scaler's flag and the verdict together."""
    if mark is None or zero._trainable_verdict is None or zero.__dict__.get(_FLAG) is not mark[1]:
        return
    before, _, found = mark
    zero.__dict__[_FLAG] = zero._fusedist_step_ran_given(before, trainable_check.with_skip(zero, found))
