"""FusedSGD: torch.optim.SGD semantics as one multi-tensor launch per dtype bucket."""

from __future__ import annotations

import torch

from . import functional
from ._base import FusedOptimizerBase, masters_of, state_values
from ._complex import state_dtype_of
from ._hyperparameters import check_finite_hyper, hyper_number
from ._loaded_state import step_device


class FusedSGD(FusedOptimizerBase):
    """Drop-in for ``torch.optim.SGD`` (momentum, dampening, nesterov, weight decay, maximize),
    plus ``master_weights`` (see :class:`FusedAdam`). The momentum buffer is FP32 and is kept
    as ``state["momentum_buffer"]`` like torch's (created zero, filled with the gradient on the
    parameter's first step, which is decided on the device so a skipped first step is safe).
    A gradient of another floating dtype than its parameter (its ``grad_dtype`` lifted) steps
    as torch's SGD on the gradient converted to the compute dtype: torch's own takes it too but
    keeps the momentum buffer in the *gradient's* dtype (a bf16 buffer for fp32 weights, rounded
    at every step), and its ``fused=True`` refuses it.
    """

    # ZeRO's slices and fully_shard's pieces may be stepped (Note [elementwise optimizers
    # only] in elementwise.py).
    _fusedist_elementwise = True
    _takes_complex = True  # Note [complex parameters] in _complex.py

    _torch_counterpart = torch.optim.SGD
    _sparse_alternative = "torch.optim.SGD (which takes sparse gradients)"
    _own_group_defaults = {"master_weights": False}

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False,
                 *, maximize=False, foreach=None, differentiable=False, fused=None, master_weights=False):
        if differentiable:
            raise ValueError("FusedSGD: differentiable=True is not supported")
        if fused is False:
            raise ValueError("FusedSGD: fused=False asks for torch's unfused implementation; use torch.optim.SGD")
        if fused and foreach:  # (torch's refusal: the two name different implementations)
            raise RuntimeError("FusedSGD: `fused` and `foreach` cannot be `True` together.")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, master_weights=master_weights,
                        foreach=foreach, fused=fused)  # kept as torch keeps them (its keys)
        # Note [momentum switched on later]: ids of the param groups that may hold states
        # without a momentum buffer (``_groups_without_buffers``, made with the bookkeeping).
        super().__init__(params, defaults)

    def _validate_group(self, group, index):
        name = f"FusedSGD (param group {index})"
        self._check_lr(name, group["lr"])  # Note [a tensor learning rate]
        check_finite_hyper(name, momentum=group["momentum"], dampening=group["dampening"],
                           weight_decay=group["weight_decay"])
        if group["momentum"] < 0:
            raise ValueError(f"{name}: invalid momentum {group['momentum']}")
        if group["weight_decay"] < 0:
            raise ValueError(f"{name}: invalid weight_decay {group['weight_decay']}")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(f"{name}: nesterov momentum requires a momentum and zero dampening")

    def _init_state(self, group, p, state):
        if "step" not in state and isinstance(state.get("momentum_buffer"), torch.Tensor):
            # A state from torch's SGD (no step count): its buffer has seen at least one step.
            state["step"] = torch.ones((), dtype=torch.float32, device=step_device(p))
        super()._init_state(group, p, state)
        if state.get("momentum_buffer") is not None:
            return
        if group["momentum"] != 0:
            _add_momentum_buffer(p, state, step=0.0)  # the step about to be counted is its first
        else:
            self._groups_without_buffers.add(id(group))

    # Note [momentum switched on later]
    # A group stepped with momentum 0 makes states without a momentum buffer; when a schedule
    # switches momentum on, each such state needs one, started from that step's gradient as
    # torch's SGD does. Looking for them costs a pass over the states, so it runs only for a
    # group recorded as possibly lacking buffers (by _init_state, the one place states are
    # made: also after load_state_dict, which re-creates them all), until none lacks one.
    def _step_group(self, group, params, grads, states, *, inv_scale, clip_coef, found_inf):
        momentum = group["momentum"]
        if momentum != 0 and id(group) in self._groups_without_buffers:
            self._add_missing_buffers(group, params, states)
        functional.sgd_update(
            params, grads, state_values(states, "momentum_buffer") if momentum != 0 else None,
            masters_of(states), lr=group["lr"], momentum=hyper_number(momentum),
            dampening=_dampening(group["dampening"]), weight_decay=hyper_number(group["weight_decay"]),
            nesterov=group["nesterov"], maximize=group["maximize"],
            step=state_values(states, "step"), inv_scale=inv_scale, clip_coef=clip_coef, found_inf=found_inf,
            validate=False,
        )

    def _add_missing_buffers(self, group: dict, params: list, states: list) -> None:
        for p, s in zip(params, states):
            if s.get("momentum_buffer") is None:
                # Stepped so far without momentum: this step, counted already, is the buffer's first.
                _add_momentum_buffer(p, s, step=1.0)
        # Parameters without a gradient this step may still lack one: keep looking until none does.
        if all(st.get("momentum_buffer") is not None for q in group["params"] if (st := self.state.get(q))):
            self._groups_without_buffers.discard(id(group))

    def state_dict(self) -> dict:
        """torch's SGD state dict: a momentum buffer no step has filled yet (every step so far
        was skipped for inf/nan gradients) is left out -- torch's SGD has no buffer then, and
        would take a zero one as a buffer to decay, which with dampening starts it from
        ``(1 - dampening) * grad`` instead of ``grad`` -- and so are the step counts, which
        torch's SGD does not keep (torch's distributed checkpoint loads by the target's keys,
        so an extra key is a missing one for the other side). A loaded buffer means its first
        step is done (``_init_state``), all the count decides. (Reads the step counts: one host
        synchronization per device.) The state-dict post-hooks run on that state dict, as
        torch's SGD runs them on its own: they saw the step counts and the unfilled buffers."""
        post_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = type(post_hooks)()
        try:
            state_dict = super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks
        state = {}
        for key, values in without_unfilled_buffers(state_dict["state"]).items():
            kept = {k: v for k, v in values.items() if k != "step"}
            if kept:
                state[key] = kept
        state_dict = {**state_dict, "state": state}
        for hook in post_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _fusedist_reset_bookkeeping(self) -> None:
        super()._fusedist_reset_bookkeeping()
        # The groups may be new dicts, and every state is looked at by _init_state at its next
        # step, which records the groups again.
        self._groups_without_buffers = set()


def _dampening(value):
    """``dampening`` as the number whose ``1 - dampening`` (what the update weighs the gradient
    by) is torch's: torch's SGD takes ``1 - dampening`` of a tensor in the tensor's dtype, so a
    float32 tensor 0.1 weighs it by float32(0.9), 1e-8 from ``1 - 0.1`` in Python's float64 --
    a difference float64 training shows. ``1 - x`` is exact for such an ``x`` both ways, so the
    number returned carries torch's rounding."""
    if isinstance(value, torch.Tensor):
        return 1.0 - (1 - value).item()
    return value


def _add_momentum_buffer(p, state: dict, step: float) -> None:
    """A zero momentum buffer, and the step count set so that the kernel sees 1 when it next
    runs: it then fills the buffer with the gradient, as torch's SGD does when it finds no
    buffer. ``step``: 0 before the step that will use it is counted, 1 after."""
    state["momentum_buffer"] = torch.zeros_like(p, dtype=state_dtype_of(p), memory_format=torch.preserve_format)
    state["step"].fill_(step)


def without_unfilled_buffers(state: dict) -> dict:
    """``state`` (an SGD state dict's ``"state"``) without the momentum buffers no step has
    filled and their step counts (``FusedSGD.state_dict``); a state left empty goes, as torch's
    SGD has none then. ``state`` itself when there are none."""
    unfilled = _unfilled_buffers(state)
    if not unfilled:
        return state
    state = dict(state)
    for key in unfilled:
        rest = {k: v for k, v in state[key].items() if k not in ("momentum_buffer", "step")}
        if rest:
            state[key] = rest
        else:
            del state[key]  # nothing else stepped: no state at all, as with torch
    return state


def _unfilled_buffers(state: dict) -> list:
    """Keys of the states whose momentum buffer exists and whose step count is 0."""
    counted = [(key, st["step"]) for key, st in state.items()
               if isinstance(st.get("momentum_buffer"), torch.Tensor) and isinstance(st.get("step"), torch.Tensor)]
    by_device: dict = {}
    for key, step in counted:
        by_device.setdefault(step.device, []).append((key, step))
    unfilled = []
    for entries in by_device.values():
        zero = (torch.stack([step.reshape(()) for _, step in entries]) == 0).tolist()
        unfilled.extend(key for (key, _), z in zip(entries, zero) if z)
    return unfilled
