"""A load planner for torch's distributed checkpoint (DCP): a fused optimizer with FP32 master
weights loading a checkpoint that torch's optimizer wrote.

DCP loads by the *target's* keys, and strictly: every key of the state dict being loaded must
be in the checkpoint. A fused optimizer with ``master_weights=True`` has keys that torch's
optimizers never write -- ``state.<param>.master_param`` for each bf16/fp16 parameter and
``param_groups.<i>.master_weights`` (Note [param groups in torch's keys] in
``fusedist/optim/_base.py``) -- so loading a torch AdamW checkpoint into it failed with
``Missing key in checkpoint state_dict: ...master_weights``. ``allow_partial_load=True`` would
let them be missing, but also any model weight or moment, silently. This planner lets exactly
those keys be missing and is strict about every other one; the entries it skips keep the
target's values, and the optimizer then takes the masters from the loaded parameters at its
next step (Note [loaded masters checked against the parameters] in ``fusedist/optim/_base.py``)::

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(model, opt)              # opt: FusedAdamW(..., master_weights=True)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path, planner=fusedist.checkpoint.FusedOptimizerLoadPlanner())
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
"""

from __future__ import annotations

from torch.distributed.checkpoint import DefaultLoadPlanner

# fusedist-only entries of an optimizer state dict, by the segment a flattened key ends with,
# and the segment that must precede it (per-parameter state, or a param group's setting).
_OWN_KEYS = {"master_param": "state", "master_weights": "param_groups", "bias_correction": "param_groups"}


def fused_only_key(fqn: str) -> bool:
    """Whether a flattened DCP key is one a torch optimizer's checkpoint does not have."""
    parts = fqn.split(".")
    return len(parts) >= 3 and _OWN_KEYS.get(parts[-1]) in parts[:-1]


class FusedOptimizerLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` (strict) that lets a fused optimizer's own keys (``master_param``,
    ``master_weights``, ``bias_correction``) be missing from the checkpoint; see the module
    docstring."""

    def __init__(self, *args, **kwargs):
        if kwargs.get("allow_partial_load"):
            raise ValueError("FusedOptimizerLoadPlanner is strict about every other key; with "
                             "allow_partial_load=True use DefaultLoadPlanner itself")
        super().__init__(*args, **kwargs)

    def create_local_plan(self):
        saved = self.metadata.state_dict_metadata if self.metadata is not None else {}
        skipped = [k for k in self.state_dict if k not in saved and fused_only_key(k)]
        for key in skipped:  # left as they are: the target's own values
            del self.state_dict[key]
        self.skipped = skipped
        return super().create_local_plan()
