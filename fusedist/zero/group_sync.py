"""The hyperparameters passed between a ZeroRedundancyOptimizer's ``param_groups`` and its inner
optimizer's, around each step.

Note [hyperparameters written back after the step]
    The inner optimizer steps with the values of ``param_groups`` (an LR scheduler's or the
    user's edits take effect at the next step). Some optimizers write their groups in ``step()``
    too: a learning rate they decay themselves, a counter or an estimate they keep per group
    (D-Adaptation's ``d``, the schedule-free optimizers' ``weight_sum``). torch's
    ZeroRedundancyOptimizer copies the local optimizer's groups back into ``param_groups`` after
    each step; here they were overwritten by the next step's copy, so such an optimizer restarted
    from its constructor's values at every step (a decayed lr stayed at its first value, trained
    apart from torch's, and the state dict saved the first value). Each group now takes back what
    the inner step wrote, after the stand-ins of parameters with no elements stepped with the same
    values as the pieces.
"""

from __future__ import annotations

from . import state as zstate


def to_inner(groups, inner_groups) -> None:
    """Give each inner group its group's current hyperparameters, before the inner step."""
    for group, inner_group in zip(groups, inner_groups):
        inner_group.update(zstate.hyperparameters(group))


def from_inner(groups, inner_groups) -> None:
    """Take back into each group what the inner step wrote into its inner group (Note
    [hyperparameters written back after the step])."""
    for group, inner_group in zip(groups, inner_groups):
        for key, value in inner_group.items():
            if key != "params" and (key not in group or group[key] is not value):
                group[key] = value
