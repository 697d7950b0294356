"""Loading a state dict into a fused optimizer: the checks that run before anything changes
(Note [validate, then mutate] in _base.py) and the states as the kernels read them. torch's
loader casts state tensors to the parameter's dtype, which would round FP32 masters and moments
of bf16 parameters; and a state dict the optimizer could not step must be refused whole, naming
the state and the parameter, not at the next step.
"""

from __future__ import annotations

import numbers

import torch

from ._complex import state_dtype_of


def step_device(p: torch.Tensor) -> torch.device:
    """Where ``p``'s step count lives: its device, but the CPU for a parameter on ``meta``, as
    torch's optimizers keep it there -- a count on ``meta`` holds no value, so a load lost it
    and reading it (a state dict, the step) failed where torch's optimizers work."""
    return torch.device("cpu") if p.is_meta else p.device


class LoadedStateMixin:
    """``load_state_dict`` of :class:`~fusedist.optim._base.FusedOptimizerBase`, which supplies
    ``_validate_group``, ``_state_keys`` and ``_fusedist_reset_bookkeeping``; before torch's
    ``Optimizer`` in the bases, whose loader it calls."""

    # State tensors the kernels read: fp32 (fp64 for fp64 parameters), laid out like the parameter.
    _KERNEL_STATE_KEYS = ("master_param", "momentum_buffer", "max_exp_avg_sq")

    def load_state_dict(self, state_dict: dict) -> None:
        """Like torch's, but state tensors keep their saved dtype (torch casts them to the
        parameter's dtype, which would round fp32 master weights and moments to bf16), and a
        state dict this optimizer could not step is refused before anything changes (Note
        [validate, then mutate])."""
        # torch's loader runs the load pre-hooks first (fully_shard's cuts whole state tensors
        # to this rank's pieces, fusedist/fsdp/optim_state.py); the check must see what they
        # make of the state dict, so they run here, once, and not again inside torch's loader.
        state_dict = state_dict.copy()
        pre_hooks = self._optimizer_load_state_dict_pre_hooks
        for hook in pre_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        # torch's flattened-state loader puts {} where the checkpoint lacks a key this optimizer
        # holds (FusedSGD's step count, which torch's SGD does not keep): absent, made again by
        # _init_state.
        state_dict["state"] = {key: {k: v for k, v in values.items() if not (isinstance(v, dict) and not v)}
                               for key, values in state_dict["state"].items()}
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        self._check_loadable(saved_groups, saved_state)
        # The post-hooks run last, as in torch's loader: after the states are made below, so
        # what a hook changes stays.
        post_hooks = self._optimizer_load_state_dict_post_hooks
        self._optimizer_load_state_dict_pre_hooks = type(pre_hooks)()
        self._optimizer_load_state_dict_post_hooks = type(post_hooks)()
        try:
            super().load_state_dict(state_dict)
        finally:
            self._optimizer_load_state_dict_pre_hooks = pre_hooks
            self._optimizer_load_state_dict_post_hooks = post_hooks
        for group in self.param_groups:
            # A key missing (a torch optimizer's state dict, or a fusedist-only key left out as
            # the class default, Note [param groups in torch's keys]): this optimizer's setting.
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        self._drop_own_keys_at_default(self.param_groups)
        id_map = {
            old_id: p
            for old_group, group in zip(saved_groups, self.param_groups)
            for old_id, p in zip(old_group["params"], group["params"])
        }
        for old_id, values in saved_state.items():
            p = id_map.get(old_id)
            if p is None:
                continue
            self.state[p] = {key: self._loaded_value(key, value, p) for key, value in values.items()}
        # the loaded masters are checked at the next step (Note [loaded masters checked against
        # the parameters]), not against versions of the states before
        self._fusedist_reset_bookkeeping()
        for hook in post_hooks.values():
            hook(self)

    def _drop_own_keys_at_default(self, groups: list) -> None:
        """``groups`` holding fusedist-only settings as a constructed group does: only where they
        differ from the default (Note [param groups in torch's keys]) -- unless this optimizer was
        built with another default, which a missing key would read. For a group added, and for the
        groups of a load: older checkpoints spelled those settings out at their defaults
        (``master_weights: False``), torch's loader copies every saved key, and every later save
        carried keys torch's optimizers never hold."""
        own = self._own_group_defaults
        for key, default in own.items():
            if key in self.defaults and not same_setting(self.defaults[key], default):
                continue
            for group in groups:
                if key in group and same_setting(group[key], default):
                    del group[key]

    def _check_loadable(self, saved_groups: list, saved_state: dict) -> None:
        """Every check of :meth:`load_state_dict` that can fail, on the saved groups merged
        with this optimizer's parameters, before torch's loader writes anything."""
        if len(saved_groups) != len(self.param_groups):
            return  # torch's loader reports this one, before writing
        for gi, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                return  # likewise
            merged = {**self.defaults, **{k: v for k, v in saved.items() if k != "params"},
                      "params": group["params"]}
            self._validate_group(merged, gi)
            for pi, (old_id, p) in enumerate(zip(saved["params"], group["params"])):
                self._check_complete_state(saved_state.get(old_id, {}), pi, gi)
                for key, value in saved_state.get(old_id, {}).items():
                    if key == "step":
                        self._check_loadable_step(value, pi, gi)
                        continue
                    if not isinstance(value, torch.Tensor):
                        continue
                    if value.shape != p.shape:
                        raise ValueError(
                            f"{type(self).__name__}.load_state_dict: state {key!r} of param {pi} of param "
                            f"group {gi} has shape {tuple(value.shape)}, the parameter {tuple(p.shape)}; "
                            f"{_which_parameters(saved, group, pi)} (nothing was loaded)"
                        )

    # Note [a partial state refused]
    # A parameter's state that holds some of what this optimizer's update reads (its step count,
    # its moments) but not all of it: torch's Adam raises KeyError loading it (no 'step') or at
    # its next step (no 'exp_avg_sq'). The fused step made the missing parts afresh -- zero
    # moments, or a step count of 0 -- and stepped on silently: a state dict whose per-parameter
    # step counts were dropped
    # (apex's FusedAdam keeps one count per group) restarted Adam's bias correction on warm
    # moments, and one without ``exp_avg_sq`` divided warm first moments by a zero second one.
    # So such a state is refused at the load, naming the parameter and what is missing. States
    # with none of these (only an FP32 master, or nothing) still start afresh, and so does AMSGrad's
    # ``max_exp_avg_sq`` of a state saved without it (FusedAdam's docstring).
    def _check_complete_state(self, values: dict, pi: int, gi: int) -> None:
        """Refuse a state with some but not all of ``step`` and ``_state_keys`` (Note [a partial
        state refused])."""
        needed = ("step", *self._state_keys) if self._state_keys else ()
        present = [k for k in needed if k in values]
        if not present or len(present) == len(needed):
            return
        missing = [k for k in needed if k not in values]
        counterpart = self._torch_counterpart
        torch_refusal = f" (torch's {counterpart.__name__} raises KeyError on it)" if counterpart else ""
        raise ValueError(
            f"{type(self).__name__}.load_state_dict: the state of param {pi} of param group {gi} has "
            f"{', '.join(map(repr, present))} but not {', '.join(map(repr, missing))}, which its update reads"
            f"{torch_refusal}; the state dict is incomplete or of another optimizer. Load a complete one, or "
            "leave this parameter's state out to start it afresh (nothing was loaded)"
        )

    def _check_loadable_step(self, value, pi: int, gi: int) -> None:
        # A tensor of one element, or a number (torch before 1.12 saved steps as numbers).
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
            return
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return
        shown = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
        raise ValueError(
            f"{type(self).__name__}.load_state_dict: state 'step' of param {pi} of param group {gi} "
            f"is {shown}, not one step count (nothing was loaded)"
        )

    def _loaded_value(self, key: str, value, p: torch.Tensor):
        if key == "step":  # kept as an fp32 tensor on the parameter's device, as torch converts numbers
            step = value if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            return step.detach().to(device=step_device(p), dtype=torch.float32, copy=True).reshape(())
        if not isinstance(value, torch.Tensor):
            return value
        if key in self._state_keys or key in self._KERNEL_STATE_KEYS:
            # The kernels read states as fp32 (a torch state dict for bf16 params holds bf16
            # moments): widen, which is exact, laid out like the parameter.
            dtype = torch.float32 if key == "master_param" else state_dtype_of(p)
            return torch.empty_like(p, dtype=dtype, memory_format=torch.preserve_format).copy_(value)
        return value.detach().to(device=p.device, copy=True)


# Note [parameter names in a load]
# torch's optimizers given named parameters save their names (a group's ``param_names``), and its loader pairs the
# saved states with the parameters by position only, whatever the names say: a state dict saved with the
# parameters in another order loads each state onto the wrong parameter (where the shapes differ, torch's
# loader takes them anyway and its next step fails). The shape check above refuses it; where both sides have
# names, the refusal says which saved parameter met which, so the fix -- the order of the saved names, or a
# load pre-hook that reorders the states by name, as torch documents -- is plain.
def _which_parameters(saved: dict, group: dict, pi: int) -> str:
    """What a shape refusal of param ``pi`` says of the two parameters: by name where both have one."""
    saved_names, names = saved.get("param_names"), group.get("param_names")
    if not (saved_names and names and pi < len(saved_names) and pi < len(names)):
        return "the state dict belongs to other parameters"
    if saved_names[pi] == names[pi]:
        return f"the state dict saved {saved_names[pi]!r} with another shape: it belongs to another model"
    return (f"it was saved for {saved_names[pi]!r} and met {names[pi]!r} at that position: the state dict lists "
            "its parameters in another order (loads pair them by position, as torch's do; build the optimizer "
            "with the saved order, or reorder the states by param_names in a load_state_dict pre-hook)")


def same_setting(a, b) -> bool:
    """Whether two values of a group setting are equal (a tensor-valued one equals no default)."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a tensor-valued setting is never the default
        return False
