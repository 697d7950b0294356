"""Shared machinery of the fused optimizers: validation, state, master weights, and the
fused side of the GradScaler protocol (Note [scaler protocol] in fusedist/amp/grad_scaler.py).
Loading a state dict lives in _loaded_state.py.
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import Callable, Iterable, Optional

import torch
from torch.optim import Optimizer

from .. import _extension
from .._wrapper import PLAIN_TYPES, values_of, wrapped_name
from . import _complex, _scaler_protocol, functional
from ._complex import state_dtype_of
from ._eager import STEP_REASON, eager_under_compile
from .functional import _device_of, _dtype_of, _layout_of, _shape_of
from ._hyperparameters import check_lr
from ._loaded_state import LoadedStateMixin, same_setting, step_device
from ._scaler_protocol import _LOOKED, ScalerProtocol, _grad_of, looked_up_once, without_none

_HALF = (torch.float16, torch.bfloat16)


def check_steppable(p: torch.Tensor, where: str) -> None:
    """The kernels write a parameter's memory: ``p``'s own, or for a tensor subclass that wraps
    one tensor of its own shape and dtype (torchao's float8 training weights) that tensor's
    (``values_of``), whose in-place updates are the parameter's, as the subclass's own ops
    make them. Other subclasses have no memory the kernels could write (a wrapper's data
    pointer is null): refused, naming the parameter (``where``)."""
    if type(p) in PLAIN_TYPES:  # the common case, per parameter per step
        return
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(p):
        return
    if wrapped_name(p) is None:
        raise TypeError(f"{where} is a tensor subclass, {type(p).__qualname__}, that is not a wrapper of one tensor "
                        f"of its shape and dtype (it holds {p.__tensor_flatten__()[0]}); the fused kernels cannot "
                        "step it. Use a torch optimizer for it (a separate optimizer, or foreach=True).")


class FusedOptimizerBase(ScalerProtocol, LoadedStateMixin, Optimizer):
    """Base of FusedAdam/AdamW/SGD/LAMB.

    Subclasses implement :meth:`_validate_group` and :meth:`_step_group`; this class owns
    state creation (fp32 optimizer states, an fp32 ``master_param`` for bf16/fp16 parameters
    when the group has ``master_weights=True``, a per-parameter fp32 ``step`` tensor on the
    parameter's device -- the CPU for one on ``meta``: :func:`step_device`) and the scaler
    protocol attributes.
    """

    _state_keys: tuple[str, ...] = ()
    #: The torch optimizer this one replaces: its state dicts and this one's are interchangeable,
    #: through ``load_state_dict`` and torch's distributed checkpoint alike (Note [param groups
    #: in torch's keys]); and this optimizer's own group settings with their defaults.
    _torch_counterpart: Optional[type] = None
    _own_group_defaults: dict = {}
    #: what to use for sparse gradients, which the fused kernels do not take
    _sparse_alternative = "torch.optim.SparseAdam"

    # Note [param groups in torch's keys]
    #     torch's distributed checkpoint loads an optimizer state by the keys of the *target's* state dict, flattened
    #     (``param_groups.0.master_weights``), and its flattened form (``flatten_optimizer_state_dict``) rebuilds
    #     groups from the live optimizer's keys: every one must be in the checkpoint. A fused optimizer's groups
    #     carried keys torch's lack (``master_weights``, ``bias_correction``) and lacked some of torch's (``foreach``,
    #     ``fused``, ...), so neither library loaded the other's checkpoint. So the groups themselves are kept in the
    #     key set of the torch counterpart: a fusedist-only setting is stored only when it differs from its default
    #     (what torch's optimizer does: no masters, bias correction on) and read with that default, and torch's keys
    #     are present with torch's defaults. A setting torch has no equivalent for (``master_weights=True``) stays: a
    #     torch optimizer loading it keeps the key and ignores it. ``load_state_dict`` fills a key the saved groups
    #     lack with this optimizer's own setting. A group added later leaves out a fusedist-only setting given at its
    #     default, as the constructor does.

    def __init__(self, params, defaults: dict):
        # torch's load_state_dict adds this key to every group; having it from the start keeps
        # state_dict() stable across a save/load round trip.
        defaults = self._in_torch_keys({**defaults, "differentiable": False})
        super().__init__(params, defaults)  # (each group through add_param_group)
        for gi, group in enumerate(self.param_groups):
            self._validate_group(group, gi)
        self._fusedist_clear_protocol()
        self._fusedist_reset_bookkeeping()

    _takes_complex = False  # whether complex parameters are stepped (Note [complex parameters] in _complex.py)

    def add_param_group(self, param_group: dict) -> None:
        """torch's (for the constructor's groups too), refusing a parameter the kernels cannot step
        (integer; complex where the class does not take it; nothing is added then), and leaving
        out a fusedist-only setting given at its default (Note [param groups in torch's keys]),
        and naming the parameter where torch refuses one already in another group."""
        self._refuse_in_another_group(param_group)
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        self._refuse_listed_twice(gi)
        self._drop_own_keys_at_default(self.param_groups[gi:])
        for pi, p in enumerate(self.param_groups[gi]["params"]):
            refusal = _complex.dtype_refusal(p, self._takes_complex)
            if refusal:
                self.param_groups.pop()
                raise TypeError(f"{type(self).__name__}: param {pi} of param group {gi} has dtype {p.dtype}; {refusal}")
        self._fusedist_complex = self.__dict__.get("_fusedist_complex") or (
            self._takes_complex and _complex.any_complex(self.param_groups[gi]["params"]))

    # Note [a parameter listed twice]
    # torch's optimizers take a group that lists one parameter twice, with a warning that this will be an error,
    # and step it once per listing: its single-tensor and foreach steps give different values (the foreach ops
    # apply each part of the update twice in turn). The fused step updates every listed tensor in one pass, so
    # both listings read the same state and write the same memory: a third result, and on a GPU a race between
    # the two writes. No result is the one to match, so such a group is refused, naming both positions.
    def _refuse_listed_twice(self, gi: int) -> None:
        """Refuse group ``gi`` (removing it) when it lists a parameter twice (Note [a parameter listed twice])."""
        group = self.param_groups[gi]
        first_at: dict[int, int] = {}
        for pi, p in enumerate(group["params"]):
            earlier = first_at.setdefault(id(p), pi)
            if earlier == pi:
                continue
            self.param_groups.pop()
            names = group.get("param_names")
            named = f" ({names[pi]!r})" if names else ""
            raise ValueError(
                f"{type(self).__name__}: param group {gi} lists the same parameter{named} twice, as param "
                f"{earlier} and param {pi} (shape {tuple(p.shape)}); the fused step would update it twice in one "
                "pass from the same state, which no torch optimizer computes (torch's warn that this will be an "
                "error). List each parameter once (e.g. model.parameters(), which skips tied weights' repeats).")

    def _refuse_in_another_group(self, param_group: dict) -> None:
        """torch's refusal of a parameter already in another group ("some parameters appear in more than one
        parameter group", kept as the message's start), saying which parameter and where it is."""
        params = param_group.get("params")
        if isinstance(params, (torch.Tensor, set)) or params is None or not self.__dict__.get("param_groups"):
            return  # (torch's own handling: one tensor, or its refusals)
        param_group["params"] = params = list(params)  # (a generator is read once: torch's loader gets the list)
        where = {id(p): (gi, pi) for gi, g in enumerate(self.param_groups) for pi, p in enumerate(g["params"])}
        for pi, item in enumerate(params):
            name, p = item if isinstance(item, tuple) and len(item) == 2 else (None, item)
            if id(p) not in where:
                continue
            gi, earlier = where[id(p)]
            names = self.param_groups[gi].get("param_names")
            known_as = f" ({names[earlier]!r})" if names else (f" ({name!r})" if name else "")
            raise ValueError(
                f"some parameters appear in more than one parameter group: param {pi} of the added group{known_as} "
                f"is param {earlier} of param group {gi} (shape {tuple(p.shape)}), and torch's optimizers keep one "
                f"group per parameter; {type(self).__name__} is unchanged. Leave it out of the added group, or "
                "change the existing group's settings instead.")

    def _fusedist_reset_bookkeeping(self) -> None:
        """What this optimizer knows of its states besides the states themselves: none is known
        ready or written by it, so the next step looks at each again (at construction, after
        ``load_state_dict`` and after unpickling)."""
        # ids of parameters whose state _init_state has completed: spares per-step dict
        # lookups for every parameter.
        self._fusedist_ready: set[int] = set()
        # Note [masters and writes from outside]: id(p) -> p._version after this optimizer's last
        # write, for parameters with an FP32 master.
        self._master_versions: dict[int, int] = {}
        # Note [loaded masters checked against the parameters]: ids of parameters whose loaded
        # master the next step compares with the parameter.
        self._masters_to_check: set[int] = {id(p) for p, st in self.state.items() if "master_param" in st}
        # whether a step may see complex parameters (Note [complex parameters] in _complex.py)
        self._fusedist_complex = any(_complex.any_complex(g["params"]) for g in self.param_groups)

    # Note [an optimizer pickled or copied]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # torch's Optimizer pickles -- and so ``copy.deepcopy`` and ``torch.save`` of the whole
    # object -- keep its defaults, state and param groups only. A fused optimizer's own settings
    # kept outside them (``_pickled_attrs``: FusedLAMB's modes) travel with them; its
    # bookkeeping (the step context, which states are ready, the masters' versions) is made
    # afresh, as by ``load_state_dict``. Without this, a copy failed at its first step.
    _pickled_attrs: tuple[str, ...] = ()

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.update({name: self.__dict__[name] for name in self._pickled_attrs})
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._fusedist_clear_protocol()
        self._fusedist_reset_bookkeeping()

    # -- scaler protocol (Note [scaler protocol]; bookkeeping in ScalerProtocol) --------------

    def _fusedist_params_and_grads(self) -> tuple[list, list]:
        # One pass over the groups' parameters (Note [whole-list passes] in _scaler_protocol.py),
        # once a call (Note [gradients looked up once a call]). (The lists are read, not changed.)
        looked = self.__dict__.get(_LOOKED, False)
        if looked:
            return looked
        groups = self.param_groups
        params = list(groups[0]["params"]) if len(groups) == 1 else [p for g in groups for p in g["params"]]
        params_and_grads = without_none(params, list(map(_grad_of, params)))
        if looked is None:
            self.__dict__[_LOOKED] = params_and_grads
        return params_and_grads

    def _fusedist_grad_params(self) -> list[torch.Tensor]:
        return self._fusedist_params_and_grads()[0]

    def _fusedist_has_grads(self) -> bool:
        # (Stops at the first gradient, where listing them all costs a pass over the parameters.)
        if type(self)._fusedist_grad_params is not FusedOptimizerBase._fusedist_grad_params:
            return super()._fusedist_has_grads()  # a sharded subclass says which gradients count
        return any(p.grad is not None for g in self.param_groups for p in g["params"])

    def _fusedist_local_grads(self) -> list[torch.Tensor]:  # (as their memory: _complex.grads_as_memory)
        return _complex.grads_as_memory(self._fusedist_params_and_grads()[1], self._fusedist_complex)

    def _fusedist_unscale_targets(self) -> list[torch.Tensor]:
        return _complex.grads_as_memory(self._fusedist_params_and_grads()[1], self._fusedist_complex)

    def _fusedist_check_norm_and_unscale(self, inv_scale: torch.Tensor):
        cls = type(self)
        if (cls._fusedist_local_grads is not FusedOptimizerBase._fusedist_local_grads
                or cls._fusedist_unscale_targets is not FusedOptimizerBase._fusedist_unscale_targets):
            return super()._fusedist_check_norm_and_unscale(inv_scale)  # a subclass reads other gradients
        with _scaler_protocol.gradients_named_on_refusal(self):  # (the step's checks name the parameter)
            found_inf, sumsq = functional.check_and_norm(self._fusedist_local_grads(), inv_scale, unscale_in_place=True)
        return self._fusedist_reduce_found_inf_and_norm(found_inf, sumsq)

    def _fusedist_check_and_norm(self, inv_scale: Optional[torch.Tensor]):
        """One read-only pass over :meth:`_fusedist_local_grads`: (found_inf, sum of squares of
        grad*inv_scale), made global by :meth:`_fusedist_reduce_found_inf_and_norm`."""
        with _scaler_protocol.gradients_named_on_refusal(self):
            found_inf, sumsq = functional.check_and_norm(self._fusedist_local_grads(), inv_scale)
        return self._fusedist_reduce_found_inf_and_norm(found_inf, sumsq)

    # -- hooks for subclasses -----------------------------------------------------------------

    def _validate_group(self, group: dict, index: int) -> None:
        raise NotImplementedError

    def _step_group(self, group: dict, params: list, grads: list, states: list, *,
                    inv_scale, clip_coef, found_inf) -> None:
        raise NotImplementedError

    def _init_state(self, group: dict, p: torch.Tensor, state: dict) -> None:
        """Create what is missing of the per-parameter state: ``step``, the keys in
        ``_state_keys`` and, for bf16/fp16 parameters of a ``master_weights`` group, the FP32
        ``master_param``. Runs on a parameter's first step and on the first step after
        ``load_state_dict``, so a state loaded from torch's optimizer is completed lazily.
        (``master_weights`` is therefore read when a parameter's state is created.)"""
        p = values_of(p)  # (states of a wrapper subclass are plain, as torch's optimizers make them)
        for key in self._state_keys:  # a loaded state made like the parameter (empty_like) is its tensor
            if isinstance(state.get(key), torch.Tensor):
                state[key] = values_of(state[key])
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=step_device(p))
        state_dtype = state_dtype_of(p)
        for key in self._state_keys:
            if state.get(key) is None:
                # Laid out like the parameter (as torch's optimizers make them), so a dense
                # parameter in any memory format steps on the kernels' flat path.
                state[key] = torch.zeros_like(p, dtype=state_dtype, memory_format=torch.preserve_format)
        if not group.get("master_weights", False):
            state.pop("master_param", None)  # Note [a loaded master in a group without masters]
        elif "master_param" not in state and p.dtype in _HALF:
            state["master_param"] = p.detach().to(torch.float32, memory_format=torch.preserve_format, copy=True)

    # Note [a loaded master in a group without masters]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A state may carry a ``master_param`` its group does not ask for: a checkpoint of a run with
    # masters whose groups are saved without ``master_weights=True`` (a ZeRO or "bf16-true" state
    # in torch's format), a group's setting changed before the load. The kernels step whatever
    # master a state holds, so such a group trained on FP32 masters, not on its 16-bit parameters
    # as configured and as torch's optimizer on those parameters does. The group's setting wins:
    # the master is dropped when the state is made ready (the first step after a load), and the
    # step updates the parameter itself; the next state dict has no master. (The reverse, a
    # masters group loading a state without one, makes it from the parameter, above.)

    # -- torch.optim.Optimizer API ------------------------------------------------------------

    # Disabled for dynamo: ``torch.compile(optimizer.step)`` (or a compiled training step) traced
    # into the launches of the fused kernels (the step is one fused pass already; compiling it
    # gains nothing): the step runs eagerly between graphs (Note [a compiled step runs eagerly]
    # in fusedist/zero/optimizer.py), with the reason dynamo shows where ``fullgraph=True`` meets
    # it (Note [a fused step under fullgraph=True] in _eager.py).
    @eager_under_compile(STEP_REASON)
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            with looked_up_once(self):  # Note [gradients looked up once a call]
                self._step_groups()
        finally:
            self._fusedist_clear_protocol()
        return loss

    def _step_groups(self) -> None:
        """The body of :meth:`step`, after the closure."""
        self._fusedist_settle_clip()  # Note [gradients changed after the clip]
        inv_scale = self._effective_inv_scale()
        clip_coef = self.step_context.clip_coef
        found_inf = self.found_inf
        if found_inf is not None:
            found_inf = found_inf.reshape(1).to(torch.float32)
        if clip_coef is not None:
            clip_coef = clip_coef.reshape(1).to(torch.float32)
        # Validate every group before anything changes: a bad gradient in the last group
        # must not leave the earlier ones stepped (Note [validate, then mutate]).
        self._fusedist_in_step = True  # (a tensor lr on the device is not read: Note [a tensor learning rate])
        try:
            work = [(group, *self._collect_group(group, gi)) for gi, group in enumerate(self.param_groups)]
        finally:
            self._fusedist_in_step = False
        # a misspelt kernel setting raised after the step counts were bumped (Note [an extension's
        # settings are checked when it is first asked for] in fusedist/_extension.py)
        _extension.check_settings("_cpu_ops")
        for group, params, grads in work:
            if not params:
                continue
            states = self._ready_states(group, params)
            self._take_outside_writes(params, states)
            steps = fp32_steps(params, states)
            torch._foreach_add_(steps, 1.0)
            # (a wrapper subclass is stepped through its tensor; _collect_group checked each: check_steppable)
            tensors = params if set(map(type, params)) <= PLAIN_TYPES else [values_of(p) for p in params]
            if self._fusedist_complex and _complex.any_complex(tensors):  # Note [complex parameters]
                views, made = _complex.real_states(states)
                self._step_group(group, _complex.real_views(tensors), _complex.read_views(grads), views,
                                 inv_scale=inv_scale, clip_coef=clip_coef, found_inf=found_inf)
                _complex.keep_created_states(tensors, states, views, made)
            else:
                self._step_group(group, tensors, grads, states, inv_scale=inv_scale,
                                 clip_coef=clip_coef, found_inf=found_inf)
            if group.get("master_weights", False):
                self._record_master_versions(params, states)
            if found_inf is not None:
                _uncount_if_skipped(steps, found_inf)

    # Note [validate, then mutate]
    # An optimizer step, a state-dict load: either it completes or it changes nothing. Every
    # check that can fail (hyperparameters, gradient dtype/shape/device/sparsity, a state dict
    # the optimizer could not step) runs before the first write, and each error names the
    # tensor by its real position (param i of param group g).

    _fusedist_in_step = False

    def _check_lr(self, owner: str, lr) -> None:
        """:func:`check_lr`, reading a tensor lr on an accelerator only outside ``step()``."""
        check_lr(owner, lr, read_device_value=not self._fusedist_in_step)

    def _collect_group(self, group: dict, gi: int) -> tuple[list, list]:
        """The parameters of group ``gi`` that have a gradient, and the gradients, checked."""
        self._validate_group(group, gi)
        if len(self.param_groups) == 1:  # (the one look of this call: Note [gradients looked up once a call])
            collected = _checked_plain(*self._fusedist_params_and_grads())
        else:
            params = list(group["params"])
            collected = _checked_plain(*without_none(params, list(map(_grad_of, params))))
        if collected is not None:
            if self._fusedist_complex:  # (a real gradient of a complex parameter: its grad_dtype lifted)
                _complex.check_gradients(*collected, group["params"], f"{type(self).__name__} (group {gi})")
            return collected
        params, grads = [], []
        for pi, p in enumerate(group["params"]):
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients (param {pi} of "
                    f"param group {gi}); use {self._sparse_alternative} for this parameter, or a dense gradient."
                )
            if (not g.is_floating_point() and not g.is_complex()) or g.is_complex() != p.is_complex():
                raise TypeError(f"{type(self).__name__}: gradient of param {pi} of group {gi} has dtype {g.dtype}, "
                                f"the parameter {p.dtype}")
            self._fusedist_complex |= g.is_complex()  # (a complex parameter put into a group by hand)
            if g.shape != p.shape or g.device != p.device:
                raise ValueError(
                    f"{type(self).__name__}: gradient of param {pi} of group {gi} has shape "
                    f"{tuple(g.shape)} on {g.device}, the parameter {tuple(p.shape)} on {p.device}"
                )
            check_steppable(p, f"{type(self).__name__}: param {pi} of group {gi}")
            params.append(p)
            grads.append(g)
        return params, grads

    # Note [masters and writes from outside]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # With ``master_weights=True`` a bf16/fp16 parameter is stepped through its FP32 master, and
    # each step writes the parameter from it. A write the program makes between steps --
    # ``model.load_state_dict``, an in-place ``p.copy_()`` / ``p.mul_()`` under ``no_grad`` --
    # would be silently reverted by the next step from the stale master, where torch's
    # optimizers (no masters) update whatever the parameter holds. Such writes bump the
    # parameter's version counter; so the version after the optimizer's own write is recorded
    # and, when a step finds it moved, the master is refreshed from the parameter first (as
    # ZeroRedundancyOptimizer does, Note [parameters changed outside the optimizer]). Writes
    # through ``p.data`` bypass the counter.
    #
    # Note [loaded masters checked against the parameters]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A loaded ``master_param`` may not belong to the parameters the program loaded. torch's
    # distributed checkpoint loads by the target's keys: from a checkpoint of torch's optimizer
    # (which has no masters) with a planner that lets fusedist's own keys be missing
    # (``fusedist.checkpoint.FusedOptimizerLoadPlanner``), the target's ``master_param`` is
    # left as it was -- the pre-load parameters' copy that ``get_state_dict`` made -- while the
    # model received the checkpoint's weights; the next step then wrote the stale master over
    # them. The check cannot be made at load: a program may load the optimizer before the
    # model. So the first step after a load compares each loaded master with its parameter: a
    # master this optimizer wrote the parameter from rounds to it exactly (the kernels write
    # ``master.to(dtype)``), so a master of a consistent checkpoint is kept bit for bit, and
    # one that does not round to the parameter is replaced by it, as when the checkpoint has
    # no master at all (``_init_state``) -- the parameter the program holds wins, as in Note
    # [masters and writes from outside]. One comparison per master, once per load.
    # The rule is the kernels' rounding (to nearest, ties to even), not a distance, and it has a
    # limit no rule on the values can pass: a master that rounds to its parameter is kept even
    # where it is stale -- an optimizer state older than the weights loaded with it, from a run
    # that trained on after the save (torch's optimizer on the bf16 weights, an fp32 or
    # bf16-mixed run) by updates too small to change the 16-bit values. The parameter then holds
    # the very bits the master was written to, and nothing in the state says which run or step
    # wrote them; replacing every master by its parameter instead would break the normal resume,
    # dropping the bits below the 16-bit weights that masters exist to keep. Such a master is at
    # most half an ulp from the parameter (one ulp from that run's fp32 weights), and as old as
    # the moments and step counts loaded with it. A program that loads an older optimizer state
    # with newer weights and wants masters made from the weights removes ``master_param`` from
    # the state it loads.
    def _take_outside_writes(self, params: list, states: list) -> None:
        pending = self._masters_to_check
        if pending:
            for p, state in zip(params, states):
                if id(p) in pending:
                    pending.discard(id(p))
                    master = state.get("master_param")
                    # (a parameter on meta holds no values to compare)
                    if master is not None and not p.is_meta and not torch.equal(master.to(p.dtype), p.detach()):
                        master.copy_(p.detach())
        versions = self._master_versions
        if not versions:
            return
        for p, state in zip(params, states):
            recorded = versions.get(id(p))
            if recorded is not None and recorded != p._version:
                state["master_param"].copy_(p.detach())

    def _record_master_versions(self, params: list, states: list) -> None:
        for p, state in zip(params, states):
            if "master_param" in state:
                self._master_versions[id(p)] = p._version

    def _ready_states(self, group: dict, params: list) -> list:
        """The state of each parameter, completed by :meth:`_init_state` where this optimizer
        has not made it ready yet (a first step, a load). One loop: this runs for every
        parameter on every step, where a method call each costs more than the lookups."""
        state_of, ready = self.state, self._fusedist_ready
        states = []
        for p in params:
            state = state_of[p]
            if not state or id(p) not in ready:
                self._init_state(group, p, state)
                ready.add(id(p))
            states.append(state)
        return states

    def _in_torch_keys(self, defaults: dict) -> dict:
        """``defaults`` in the key set of the torch counterpart's groups (Note [param groups in
        torch's keys])."""
        if self._torch_counterpart is None:
            return defaults
        own = self._own_group_defaults
        kept = {k: v for k, v in defaults.items() if not (k in own and same_setting(v, own[k]))}
        # In torch's key order, fusedist-only settings last: a state dict written as text
        # (JSON, YAML, a log) reads as torch's.
        out = {key: kept.pop(key, value) for key, value in _torch_group_defaults(self._torch_counterpart).items()}
        out.update(kept)
        return out

    def master_params(self) -> Iterable[torch.Tensor]:
        """The FP32 weights the optimizer steps: the master copy where one exists."""
        for group in self.param_groups:
            masters = group.get("master_weights", False)  # (Note [a loaded master in a group without masters])
            for p in group["params"]:
                yield self.state[p].get("master_param", p) if masters and p in self.state else p


_FLOAT_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))


def _checked_plain(params: list, grads: list) -> Optional[tuple[list, list]]:
    """``_collect_group``'s checks for the common group, made a whole list at a time: plain
    tensors, dense floating-point gradients of their parameters' shapes, one device. A step
    runs them for every parameter, and per-tensor Python costs add up on a GPU, where the host
    issues the step (hundreds of tensors: hundreds of microseconds). None when anything is
    unusual; the per-parameter loop then runs the checks again, naming the parameter at fault."""
    if not params:
        return params, grads
    if (
        set(map(type, params)) <= PLAIN_TYPES
        and set(map(_layout_of, grads)) == {torch.strided}
        and set(map(_dtype_of, grads)) <= _FLOAT_DTYPES
        and len(set(map(_device_of, grads)) | set(map(_device_of, params))) == 1
        and list(map(_shape_of, grads)) == list(map(_shape_of, params))
    ):
        return params, grads
    return None


def _uncount_if_skipped(steps: list, found_inf: torch.Tensor) -> None:
    """A skipped step does not count: decided on the device, like torch's fused Adam
    (``_foreach_add_`` has a Tensor overload; ``_foreach_sub_`` would read the flag on the
    host). A CPU flag is read instead -- free there -- so a step that ran costs no second pass
    over the step counts (on the CPU a foreach op loops over them one by one, ~1 us each)."""
    if found_inf.is_cpu:
        if found_inf.item() != 0:
            torch._foreach_add_(steps, -1.0)
        return
    torch._foreach_add_(steps, found_inf.reshape(()), alpha=-1.0)


def state_values(states: list, key: str) -> list:
    """``[s[key] for s in states]`` without a Python frame per state (a step asks for each
    state tensor of every parameter: Note [whole-list passes] in _scaler_protocol.py)."""
    return list(map(operator.itemgetter(key), states))


def fp32_steps(params: list, states: list) -> list:
    """The states' step counts, fp32 tensors as :meth:`FusedOptimizerBase._init_state` makes
    them. A count the program put in a state itself (an int64 tensor; a number, as torch before
    1.12 kept them) is replaced by its fp32 tensor, which the step counts up in place and the
    kernels read: ``_foreach_add_`` of 1.0 refused an int64 count with torch's "result type
    Float can't be cast to the desired output type Long", where torch's Adam counts it up
    (Note [states the program replaced] in functional.py)."""
    steps = state_values(states, "step")
    try:
        if set(map(_dtype_of, steps)) == {torch.float32}:  # (the common case, a whole-list pass)
            return steps
    except AttributeError:  # a number among them
        pass
    for p, state in zip(params, states):
        step = state["step"]
        if not isinstance(step, torch.Tensor) or step.dtype != torch.float32:
            device = step.device if isinstance(step, torch.Tensor) else step_device(p)
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=device)
    return state_values(states, "step")


def masters_of(states: list) -> Optional[list]:
    masters = list(map(dict.get, states, repeat("master_param")))
    return masters if any(m is not None for m in masters) else None


_TORCH_GROUP_DEFAULTS: dict = {}


def _torch_group_defaults(torch_cls: type) -> dict:
    """The keys and default values of a param group of torch's ``torch_cls``."""
    if torch_cls not in _TORCH_GROUP_DEFAULTS:
        group = torch_cls([torch.nn.Parameter(torch.zeros(1))]).param_groups[0]
        _TORCH_GROUP_DEFAULTS[torch_cls] = {k: v for k, v in group.items() if k != "params"}
    return _TORCH_GROUP_DEFAULTS[torch_cls]
