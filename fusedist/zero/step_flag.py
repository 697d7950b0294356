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

    A scheduler built on a framework's wrapper of the optimizer (Fabric's ``setup_optimizers``,
    Lightning's LightningOptimizer; Note [state shared with wrappers] in shared_state.py) wraps
    the wrapper's ``step``, so the flag and the decision land on the wrapper, whose step then
    calls the optimizer's: the decision is kept in the shared state with the object that holds
    the flag, where the optimizer's step finds it (a mark kept on the wrapper was never seen,
    and such a refused or skipped first step went without the warning).
"""

from __future__ import annotations

import weakref
from typing import Optional

from . import trainable_check

_FLAG = "_fusedist_opt_called"  # where the scaler protocol keeps ``_opt_called`` (its property)


def remember(holder, before, decided, found) -> None:
    """The scheduler's wrapper set the flag of ``holder`` (the optimizer or a framework's wrapper
    of it): what it was, what was decided, and the scaler's found-inf flag then (the step clears
    it), kept in the state the optimizer shares with its wrappers."""
    holder._zero_flag_mark = (weakref.ref(holder), before, decided, found)


def take(zero) -> Optional[tuple]:
    """At the start of ``step()``: ``(holder, before, decided, found)`` as :func:`remember` kept
    it for this call, or None -- also where the flag no longer holds the decision (a mark set
    outside a step, put back since)."""
    mark, zero._zero_flag_mark = zero._zero_flag_mark, None
    holder = mark[0]() if mark is not None else None
    if holder is None or holder.__dict__.get(_FLAG) is not mark[2]:
        return None
    return (holder,) + mark[1:]


def undo(zero, mark: Optional[tuple]) -> None:
    """The step raised: it was no step, the flag is as before the call."""
    if mark is not None and mark[0].__dict__.get(_FLAG) is mark[2]:
        mark[0].__dict__[_FLAG] = mark[1]


def redecide(zero, mark: Optional[tuple]) -> None:
    """The step ran: with a comparison verdict kept on the device (which skipped it where the
    ranks differ), the flag is decided from the scaler's flag and the verdict together."""
    if mark is None or zero._trainable_verdict is None or mark[0].__dict__.get(_FLAG) is not mark[2]:
        return
    holder, before, _, found = mark
    holder.__dict__[_FLAG] = zero._fusedist_step_ran_given(before, trainable_check.with_skip(zero, found))
