"""GradScaler: torch.amp.GradScaler, plus a fused step, hysteresis, min_scale and a skip signal.

# Note [scaler protocol]
An optimizer opts in with the class attribute ``_fusedist_fused = True`` (fusedist's fused
optimizers and ZeroRedundancyOptimizer do). Such an optimizer provides:

* ``step(closure=None)`` that reads, applies and then clears torch's two attributes and the
  step context:

  - ``grad_scale``: Tensor or None. The loss scale; the gradients are divided by it inline.
    Set by ``GradScaler.step`` when ``unscale_`` was not called (same name and meaning as
    torch's fused Adam); None after ``unscale_``.
  - ``found_inf``: Tensor or None. 1-element fp32 on the device; when nonzero the step writes
    nothing and does not advance the step count (decided on the device).
  - ``step_context`` (:class:`fusedist.optim.step_context.StepContext`): ``inv_scale`` (set by
    a lazy ``unscale_``: the gradients still hold the scaled values and the update multiplies
    by it inline), ``clip_coef`` (set by ``fusedist.clip_grad_norm_``'s fast path; applied
    inline), ``grad_sumsq`` (set by ``unscale_``: the global sum of squares of the unscaled
    gradients, read by the clip), ``grad_versions`` and ``clipped_grads``.

* ``_fusedist_check_and_norm(inv_scale) -> (found_inf, sumsq)``: one read-only pass over
  ``_fusedist_local_grads()`` (the gradients this rank steps); it must return the *global*
  values, combining local ones through ``_fusedist_reduce_found_inf_and_norm(found_inf,
  sumsq)``. A sharded optimizer (ZeRO) overrides that hook to all-reduce (max for the flag,
  sum for the squares) so every rank skips together and clips with the same norm. The base
  class (``fusedist.optim._base.FusedOptimizerBase``) implements all of this; a sharded
  optimizer overrides ``_fusedist_local_grads``, ``_fusedist_grad_params`` and the reduce
  hook (see tests/test_grad_scaler_distributed.py for a minimal example).
* ``_fusedist_grad_params()``: the parameters whose gradients the global norm covers (what
  ``clip_grad_norm_`` compares its argument with to take the fast path; for ZeRO, every model
  parameter).
* ``_fusedist_has_grads()``: whether there is any gradient to check (without one ``step``
  raises as torch's does, Note [no inf checks recorded]).
* ``_fusedist_materialize_unscale()``: multiply the gradients by a pending
  ``step_context.inv_scale`` in place and clear it (slow path for callers needing real values).

With ``GradScaler(lazy_unscale=True)`` the iteration then costs two passes over the
gradients and no host synchronization (the default adds an in-place unscale to pass 1, Note
[lazy unscale])::

    scaler.scale(loss).backward()
    scaler.unscale_(opt)        # pass 1 (read-only): found_inf + sumsq; records inv_scale
    fusedist.clip_grad_norm_(model.parameters(), 1.0)   # no pass: norm = sqrt(sumsq),
                                                       # records the clip coefficient
    scaler.step(opt)            # pass 2: the update, grad * inv_scale * clip_coef, masked
    scaler.update()             #          by found_inf on the device

Without ``unscale_``, ``step`` runs the check pass itself (flag only) and passes
``grad_scale``. After ``unscale_`` on a fused optimizer, ``p.grad`` still holds the *scaled*
gradient (read it only through ``clip_grad_norm_``, or call
``optimizer._fusedist_materialize_unscale()`` first). That is ``GradScaler(lazy_unscale=True)``;
the default unscales in place (Note [lazy unscale]).

For any other optimizer every method is torch's own.

# Note [lazy unscale]
The read-only ``unscale_`` above leaves the *scaled* gradients in ``p.grad`` until the step,
which only fusedist's clip knows how to read. The loop torch documents for AMP --
``unscale_``, then ``torch.nn.utils.clip_grad_norm_``, then ``step`` -- would measure a norm
``scale`` times too large and shrink every update by that factor, silently (measured: FusedAdamW
parameters off by 1e-2 after six steps at lr 1e-2). So by default ``unscale_`` also writes the
unscaled gradients, as torch's does -- in the check pass itself where that pass reads exactly
the gradients users see (the fused optimizers; on the GPU one Triton kernel reads and writes
each gradient once), else in a second pass -- and keeps the recorded norm (it is the unscaled
gradients' norm), so fusedist's clip still costs no pass; the cost is one write of every
gradient. ``GradScaler(lazy_unscale=True)`` restores the read-only
form for loops that clip with fusedist. ZeroRedundancyOptimizer stage 2 is always lazy: its
gradients are shards only it reads (``p.grad`` is None), so there is nothing to show.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections import defaultdict
from typing import Any, Optional

import torch
from torch.amp.grad_scaler import GradScaler as _TorchGradScaler
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

from ..optim._scaler_protocol import follows_protocol, looked_up_once, protocol_owner, stepped_optimizer
from ..optim.step_context import inverse_scale, mark_pending
from . import added_params, skipped_step, unscale
from .found_inf_group import FoundInfGroupMixin
from .scaler_settings import check_device, check_loaded_state, check_settings, checked_new_scale
from ..reliability.scale_check import scaled_with

MIN_SCALE_POLICIES = ("warn", "raise")


def is_fused(optimizer) -> bool:
    """Whether ``optimizer`` is stepped through the protocol (Note [scaler protocol]), itself or,
    handed over, by the one that steps for it (Note [the protocol of a handed-over optimizer])."""
    return follows_protocol(optimizer)


def _device_type(device):
    """The device's type, as torch's ``update`` compares it with a new scale tensor's
    ``device.type``: torch keeps the argument as given, so ``GradScaler(torch.device("cpu"))`` or
    ``GradScaler("cuda:0")`` trained, then refused ``update(new_scale)`` with any tensor."""
    try:
        return torch.device(device).type
    except (TypeError, RuntimeError):
        return device  # (torch's own checks speak about it)


class GradScaler(FoundInfGroupMixin, _TorchGradScaler):
    """Drop-in for ``torch.amp.GradScaler`` (same arguments, defaults and methods).

    With a fused optimizer (Note [scaler protocol]) ``step`` without ``unscale_`` does no
    separate unscale pass, and nothing synchronizes the host (except a closure passed to ``step``,
    Note [a skipped step runs no closure], or step hooks registered on the optimizer, which a
    skipped step does not run, as torch's: Note [a skipped step runs no step hooks] in
    fusedist/amp/skipped_step.py; an optimizer built with ``fused=True`` runs both on a skipped
    step, as torch's fused optimizers do, and needs no sync for them). ``unscale_`` unscales the
    gradients in place, as torch's does, so ``torch.nn.utils.clip_grad_norm_`` and anything else
    reading ``p.grad`` sees unscaled values; it also records the global norm, so
    ``fusedist.clip_grad_norm_`` needs no pass of its own (Note [lazy unscale]). Like torch's,
    it refuses float16 gradients (in place they would underflow); ``lazy_unscale`` takes them.
    A fused update writes no gradient back: after ``step``, ``p.grad`` holds what it held
    before (scaled where ``unscale_`` was not called, unclipped after
    ``fusedist.clip_grad_norm_``), where torch's leaves unscaled, clipped gradients.
    Settings torch takes silently but cannot train with (``init_scale`` <= 0 or not finite,
    ``backoff_factor`` <= 0, an infinite ``growth_factor``, ``growth_interval`` not an integer
    >= 1) raise ValueError, here, in ``load_state_dict`` and in the ``set_*`` setters, as does
    ``update(new_scale)`` with a number <= 0 or not finite. ``update`` takes an int, and the
    1-element tensor torch documents (torch's fails on both). Extra keyword-only arguments:

    * ``lazy_unscale`` (default False): ``unscale_`` only checks and measures the gradients
      (one read-only pass) and the optimizer's update unscales inline, saving the write of
      every gradient. ``p.grad`` then keeps the *scaled* values until ``step()``: clip with
      ``fusedist.clip_grad_norm_`` (or a ZeroRedundancyOptimizer's ``clip_grad_norm_``), not with
      ``torch.nn.utils.clip_grad_norm_`` (which would measure and clip scaled gradients).

    * ``hysteresis`` (default 1 = torch): the scale backs off on the ``hysteresis``-th
      *consecutive* overflow, and on every further overflow until a step succeeds; a finite
      step resets the count. Every overflowing step is skipped regardless.
    * ``min_scale`` (default None = no floor): backoff never goes below it (a scale already
      below it, after ``update(new_scale)`` or a loaded state dict, is kept, not raised).
      ``min_scale_policy`` says what happens when the gradients still overflow at the floor:
      ``"warn"`` keeps skipping those steps and warns (the flag is read asynchronously, so the
      warning can come one ``update()`` late; no host sync), ``"raise"`` raises RuntimeError
      from ``update()`` (this reads the flag, a host sync per ``update()``).

    * ``found_inf_group`` (default None): a process group over which the inf/nan flags are
      combined (max), once per iteration, before any step is decided -- the pipeline group under
      pipeline parallelism, where each stage's optimizer sees only that stage's gradients: an
      overflow in any stage then skips every stage's step (every optimizer on every rank) and
      backs off the scale on every rank alike, as torchtitan and Megatron all-reduce found_inf
      over their model-parallel groups (torch's scaler has no such argument; without it each
      stage skipped by its own flag, and the stages' weights and scales drifted apart). Ranks
      may hold different numbers of stages (optimizers). In the first iteration, before the
      scaler knows the rank's optimizers, ``step()`` only checks, and ``update()`` steps them once
      the flags are agreed: zero the gradients after ``update()``. A ``step(optimizer, closure)``
      cannot wait: it agrees at once, over the optimizers unscaled or stepped so far, and returns
      the closure's loss (None when skipped) as torch's does; a rank stepping several optimizers
      so calls ``unscale_`` on each before that ``step()``. A stage without a loss needs no
      ``scale(loss)``: the scale is made on first use. Note [found_inf over the pipeline stages],
      Note [the first iteration's steps wait for update()], Note [a closure in the first
      iteration] and Note [a stage without a loss] in fusedist/amp/found_inf_group.py.

    ``last_step_skipped_tensor`` is a device bool tensor (set by ``update()``): True when an
    optimizer step of the last iteration was skipped for inf/nan gradients. The property
    ``last_step_skipped`` reads it (a host sync, only when read).
    """

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True, *,
                 hysteresis: int = 1, min_scale: Optional[float] = None, min_scale_policy: str = "warn",
                 lazy_unscale: bool = False, found_inf_group=None):
        check_device(device)  # (a number here is torch.cuda.amp.GradScaler's init_scale)
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        self._found_inf_group = found_inf_group
        self._group_optimizers: dict = {}  # (id -> weak reference) Note [found_inf over the pipeline stages]
        self._agreed = None  # (this iteration's agreed flag, and the optimizers it covers)
        self._pending_steps: list = []  # Note [the first iteration's steps wait for update()]
        self._knows_optimizers = False
        self._device = _device_type(device)
        if self._enabled:  # (torch checks its factors only when enabled, too)
            check_settings("GradScaler", "init_scale", init_scale, growth_factor, backoff_factor, growth_interval)
        self.lazy_unscale = bool(lazy_unscale)
        if int(hysteresis) != hysteresis or hysteresis < 1:
            raise ValueError(f"hysteresis must be an integer >= 1, got {hysteresis!r}")
        if min_scale is not None and not (0 < float(min_scale) <= init_scale):
            raise ValueError(f"min_scale must be in (0, init_scale={init_scale}], got {min_scale!r}")
        if min_scale_policy not in MIN_SCALE_POLICIES:
            raise ValueError(f"min_scale_policy must be one of {MIN_SCALE_POLICIES}, got {min_scale_policy!r}")
        self._hysteresis = int(hysteresis)
        self._min_scale = None if min_scale is None else float(min_scale)
        self._min_scale_policy = min_scale_policy
        self._init_hysteresis_tracker = self._hysteresis
        self._hysteresis_tracker: Optional[torch.Tensor] = None
        self.last_step_skipped_tensor = None
        self._min_scale_flag = unscale.LazyHostFlag()

    def scale(self, outputs):
        """torch's ``scale``; the scaler is noted for the per-step check (Note [loss scale in the step
        check] in fusedist/reliability/scale_check.py)."""
        scaled = super().scale(outputs)
        scaled_with(self)  # (after: torch's scale() makes the scale at its first call)
        return scaled

    # -- settings ------------------------------------------------------------------------------
    # torch's setters check nothing, so they took the values the constructor and load_state_dict
    # refuse (check_settings): set_backoff_factor(0) made the scale 0 at the next overflow, and
    # every later gradient 0, silently. They are checked here as there (when enabled, as torch's
    # constructor checks its factors).

    def set_growth_factor(self, new_factor: float) -> None:
        self._check_new_setting("set_growth_factor", growth_factor=new_factor)
        super().set_growth_factor(new_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        self._check_new_setting("set_backoff_factor", backoff_factor=new_factor)
        super().set_backoff_factor(new_factor)

    def set_growth_interval(self, new_interval: int) -> None:
        self._check_new_setting("set_growth_interval", growth_interval=new_interval)
        super().set_growth_interval(new_interval)

    def _check_new_setting(self, where: str, **setting) -> None:
        if self._enabled:
            settings = {"growth_factor": self._growth_factor, "backoff_factor": self._backoff_factor,
                        "growth_interval": self._growth_interval, **setting}
            check_settings(f"GradScaler.{where}", None, None, **settings)

    # -- state ---------------------------------------------------------------------------------

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._hysteresis_tracker = torch.full((), self._init_hysteresis_tracker, dtype=torch.int32, device=dev)

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last iteration's step was skipped (reads a device flag: a host sync)."""
        skipped = self.last_step_skipped_tensor
        if skipped is None:
            return False
        return bool(skipped.item())

    # Note [the skip flag on demand]
    # ``last_step_skipped_tensor`` is ``found_inf > 0`` of the last update(). Most programs
    # never read it, and on a GPU each small op costs a launch on the host's side of a step
    # that is bound by its launches when the model is small: update() keeps the found-inf
    # tensor (which nothing writes afterwards: each unscale_ makes a new one) and the
    # comparison runs when the flag is first read.
    @property
    def last_step_skipped_tensor(self) -> Optional[torch.Tensor]:
        """A device bool tensor: True when an optimizer step of the last iteration was skipped."""
        found = getattr(self, "_last_found_inf", None)
        if found is not None:
            self._last_skipped, self._last_found_inf = found > 0, None
        return getattr(self, "_last_skipped", None)

    @last_step_skipped_tensor.setter
    def last_step_skipped_tensor(self, value: Optional[torch.Tensor]) -> None:
        self._last_skipped, self._last_found_inf = value, None

    def _record_found_inf(self, found_inf: torch.Tensor) -> None:
        self._last_skipped, self._last_found_inf = None, found_inf

    # -- the record of each optimizer (Note [one scaler state per stepped optimizer]) ------------

    def _record_of(self, optimizer) -> dict:
        """This iteration's record of ``optimizer``, shared by every name of the optimizer that steps."""
        return self._per_optimizer_states[id(stepped_optimizer(optimizer))]

    @contextlib.contextmanager
    def _record_under_given_name(self, optimizer):
        """Within the block, ``id(optimizer)`` -- what torch's ``unscale_`` and ``step`` look the record
        up by -- names the shared record too; the alias goes after the outermost block (torch's
        ``step`` calls ``unscale_``), so ``update()`` sees each record once."""
        states, given, key = self._per_optimizer_states, id(optimizer), id(stepped_optimizer(optimizer))
        if given == key or (given in states and states[given] is states[key]):
            yield
            return
        states[given] = states[key]
        try:
            yield
        finally:
            states.pop(given, None)

    # -- fused protocol ------------------------------------------------------------------------

    # Disabled for dynamo: in a compiled training step it traced into the fused kernels' launches
    # (and a sharded optimizer's found-inf all-reduce); it runs eagerly between the graphs, as the
    # optimizer's step does (Note [a compiled step runs eagerly] in fusedist/zero/optimizer.py).
    @torch.compiler.disable
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self._enabled:
            self._scale_for_stage(optimizer)  # Note [a stage without a loss]
            if self._is_pending(optimizer):  # Note [the first iteration's steps wait for update()]
                raise RuntimeError("unscale_() is being called after step().")
        if not self._enabled:
            return super().unscale_(optimizer)
        counts = added_params.param_counts(optimizer)  # Note [a param group added after unscale_]
        if not is_fused(optimizer):
            with self._record_under_given_name(optimizer):  # Note [one scaler state per stepped optimizer]
                super().unscale_(optimizer)
            self._record_of(optimizer)[added_params.RECORD_KEY] = counts
            return None
        self._check_scale_growth_tracker("unscale_")
        optimizer_state = self._record_of(optimizer)
        if optimizer_state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        owner = protocol_owner(optimizer)  # Note [the protocol's owner behind a wrapper]
        if not owner._fusedist_has_grads():  # Note [no inf checks recorded]
            self._remember(optimizer)  # Note [found_inf over the pipeline stages]
            optimizer_state["found_inf_per_device"] = {}
            optimizer_state["stage"] = OptState.UNSCALED
            optimizer_state[added_params.RECORD_KEY] = counts
            return
        with looked_up_once(owner):  # Note [gradients looked up once a call]
            self._unscale_fused(owner, optimizer_state, optimizer)
        optimizer_state[added_params.RECORD_KEY] = counts

    def _unscale_fused(self, optimizer, optimizer_state: dict, given) -> None:
        """unscale_ of the protocol's owner ``optimizer``; ``given`` is what the program passed."""
        inv_scale = inverse_scale(self._scale)
        ctx = optimizer.step_context
        clipped_before = unscale.clip_before_unscale(optimizer)  # Note [a clip before unscale_]
        if not self.lazy_unscale and optimizer._fusedist_grads_in_user_view():  # Note [lazy unscale]
            unscale.refuse_fp16_in_place(optimizer)
            found_inf, sumsq = optimizer._fusedist_check_norm_and_unscale(inv_scale)
            ctx.inv_scale = None
        else:
            found_inf, sumsq = optimizer._fusedist_check_and_norm(inv_scale)
            ctx.inv_scale = inv_scale
        found_inf, sumsq = unscale.combine_over_shards(optimizer, found_inf, sumsq)  # [sharded gradients]
        found_inf = self._flag_in_iteration(given, found_inf)  # Note [found_inf over the pipeline stages]
        ctx.grad_sumsq = sumsq
        ctx.clip_coef = clipped_before
        if clipped_before is not None:  # the gradients it covers were just unscaled in place
            optimizer._fusedist_record_clipped_grads()
        optimizer._fusedist_record_grad_versions()  # Note [gradients changed after unscale_]
        mark_pending(optimizer)
        optimizer_state["found_inf_per_device"] = {self._scale.device: found_inf.reshape(())}
        optimizer_state["stage"] = OptState.UNSCALED
        optimizer_state["fused_optimizer"] = weakref.ref(optimizer)  # Note [an iteration without a step]

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
        if self._enabled:
            self._scale_for_stage(optimizer)  # Note [a stage without a loss]
            recorded = self._per_optimizer_states.get(id(stepped_optimizer(optimizer)), {})
            added_params.check_none_added(optimizer, recorded.get(added_params.RECORD_KEY))
            if self._defers_steps():  # Note [the first iteration's steps wait for update()]
                if not (args and args[0] is not None):
                    return self._defer_step(optimizer, args, kwargs)
                self._agree_for_closure(optimizer)  # Note [a closure in the first iteration]
        if not self._enabled:
            return super().step(optimizer, *args, **kwargs)
        if not is_fused(optimizer):
            if self._scale is not None:
                self._agree_iteration(optimizer)  # Note [found_inf over the pipeline stages]
            with self._record_under_given_name(optimizer):  # Note [one scaler state per stepped optimizer]
                return super().step(optimizer, *args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        optimizer_state = self._record_of(optimizer)
        if optimizer_state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        self._agree_iteration(optimizer)  # Note [found_inf over the pipeline stages]
        owner = protocol_owner(optimizer)  # Note [the protocol's owner behind a wrapper]
        with looked_up_once(owner):  # (not around optimizer.step: its pre-hooks are program code)
            self._before_fused_step(owner, optimizer_state, optimizer)
        found = list(optimizer_state["found_inf_per_device"].values())
        owner.found_inf = found[0] if len(found) == 1 else torch.stack(found).sum()
        # Note [a skipped step runs no closure]
        # and Note [a skipped step runs no step hooks] in skipped_step.py: the flag read on the host
        hooked = skipped_step.has_own_step_hooks(optimizer, owner)
        closure = bool(args) and args[0] is not None and not skipped_step.built_fused(owner)
        skipped = (closure or hooked) and bool(owner.found_inf.item())
        try:
            with skipped_step.own_step_hooks_off(optimizer, owner) if skipped and hooked else contextlib.nullcontext():
                retval = optimizer.step(*((None, *args[1:]) if skipped and args else args), **kwargs)
        finally:
            if hasattr(owner, "_fusedist_clear_protocol"):
                owner._fusedist_clear_protocol()
        optimizer_state["stage"] = OptState.STEPPED
        return None if skipped else retval

    # Note [a skipped step runs no closure]
    # torch's scaler refuses a closure passed by keyword, and takes one passed positionally
    # (``scaler.step(opt, closure)``) along with any other argument of ``optimizer.step``; when
    # the gradients overflowed it does not call ``optimizer.step``, so the closure (a forward and
    # backward, a counter, a log line) does not run, and ``step`` returns None. A fused optimizer
    # decides the skip on the device, so it ran the closure on a skipped step too. With a closure
    # the flag is therefore read on the host (the one sync here, with the one for step hooks),
    # and a skipped step calls the optimizer's step without the closure and returns None. The step
    # itself still runs, skipping on the device as without a closure, for the bookkeeping of a
    # skipped step: ZeRO stage 2 consumes the overflowed gradient shards there (else the next
    # backward adds to them), and an LR scheduler learns that the step was skipped (Note [a
    # skipped step and the LR scheduler] in fusedist/optim/_scaler_protocol.py).
    # As for step hooks and the scheduler's flag, a param group built with ``fused=True`` behaves
    # as torch's ``fused=True`` optimizers, which torch's scaler calls on a skipped step too: the
    # closure runs and its loss is returned (no host read for it). Code written for
    # ``torch.optim.AdamW(fused=True)`` -- a closure that logs or counts every iteration -- so
    # runs unchanged; drop ``fused=True`` for the unfused behaviour (no closure on a skip).

    def _before_fused_step(self, optimizer, optimizer_state: dict, given) -> None:
        """step()'s checks, and the found-inf check when unscale_ was not called (not again when
        the group's agreement made it); ``optimizer`` owns the protocol, ``given`` was passed."""
        if optimizer.step_context.inv_scale is not None:  # lazy: Note [gradients changed after unscale_]
            optimizer._fusedist_check_grads_since_unscale()
        if optimizer_state["stage"] is OptState.READY and not optimizer._fusedist_has_grads():
            optimizer_state["stage"] = OptState.UNSCALED  # as torch's step, which unscale_s first
        if optimizer_state["stage"] is OptState.UNSCALED and not optimizer_state["found_inf_per_device"]:
            raise AssertionError("No inf checks were recorded for this optimizer.")  # Note [no inf checks recorded]
        if optimizer_state["stage"] is OptState.READY:
            if not optimizer_state.pop("checked_for_step", False):
                found_inf, _ = optimizer._fusedist_check_and_norm(None)
                found_inf, _ = unscale.combine_over_shards(optimizer, found_inf)  # [sharded gradients]
                found_inf = self._flag_in_iteration(given, found_inf)  # Note [found_inf over the pipeline stages]
                optimizer_state["found_inf_per_device"] = {self._scale.device: found_inf.reshape(())}
            optimizer.grad_scale = self._scale
        else:
            optimizer.grad_scale = None

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        # torch's path (any other optimizer): unscale_ and step both come through here.
        per_device = unscale.unscale_per_device(optimizer, inv_scale, found_inf, allow_fp16)
        for flag in per_device.values():
            unscale.combine_over_shards(optimizer, flag)  # [sharded gradients]
            self._flag_in_iteration(optimizer, flag)  # Note [found_inf over the pipeline stages]
        if not per_device:  # no gradient here: no flag, but counted in the group's agreement
            self._remember(optimizer)
        return per_device

    # -- scale update --------------------------------------------------------------------------

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if not self._enabled:
            return
        self._scale_for_stage()  # Note [a stage without a loss]
        _scale, _growth_tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            new_scale = checked_new_scale(new_scale, self._device)
        # (made here when nothing was stepped: one per iteration on every rank; then the steps
        # that waited for it, Note [the first iteration's steps wait for update()])
        self._agree_and_run_pending()
        self._end_agreement()
        self._forget_unstepped()
        found_infs = [
            found_inf.to(device=_scale.device, non_blocking=True).reshape(())
            for state in self._per_optimizer_states.values()
            for found_inf in state["found_inf_per_device"].values()
        ]
        if new_scale is not None:
            # An explicit scale, as torch's: no growth/backoff decision. The skip signal still
            # tells about this iteration, and the hysteresis count starts afresh with the new
            # scale (the overflows it counted were at the old one).
            self.last_step_skipped_tensor = (torch.stack(found_infs).sum() > 0) if found_infs else None
            if self._hysteresis_tracker is not None:
                self._hysteresis_tracker.fill_(self._hysteresis)
            super().update(new_scale)
            return
        if len(found_infs) == 0:
            raise AssertionError("No inf checks were recorded prior to update.")
        found_inf = found_infs[0] if len(found_infs) == 1 else torch.stack(found_infs).sum()
        self._record_found_inf(found_inf)  # Note [the skip flag on demand]
        if self._hysteresis == 1 and self._min_scale is None:
            # Exactly torch's update (same kernel; it reads found_inf and writes only the scale
            # and the growth tracker).
            torch._amp_update_scale_(_scale, _growth_tracker, found_inf, self._growth_factor,
                                     self._backoff_factor, self._growth_interval)
        else:
            self._update_with_hysteresis(_scale, _growth_tracker, self.last_step_skipped_tensor)
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    # Note [no inf checks recorded]
    # torch's scaler checks the gradients of each device for inf/nan and refuses to step an
    # optimizer that had none to check (AssertionError "No inf checks were recorded for this
    # optimizer.", and at update() "... prior to update." when no optimizer had any): stepping
    # on would hide a backward that never reached the optimizer's parameters. With a fused
    # optimizer "had none" is asked of the protocol (``_fusedist_has_grads``), not of ``p.grad``:
    # ZeroRedundancyOptimizer stage 2 leaves ``p.grad`` None and checks its gradient shards, and
    # a rank may hold no shard while another does. unscale_ then records no check, as torch's
    # does, so step() and update() raise as torch's do.

    # Note [an iteration without a step]
    # A program may unscale_ and clip, then skip step() (e.g. for a non-finite norm) and call
    # update(). The fused optimizer's step context still holds that iteration's clip
    # coefficient, inverse scale and norm, which only step() clears; a later step() without
    # unscale_ would apply them to other gradients. torch's scaler forgets an iteration at
    # update(), so this one clears what such an optimizer was told -- after writing into the
    # gradients what torch's unscale_ and clip would have (a pending lazy inverse scale, a
    # recorded clip coefficient): a program that accumulates on adds to torch's values.
    def _forget_unstepped(self) -> None:
        for state in self._per_optimizer_states.values():
            ref = state.get("fused_optimizer")
            optimizer = None if ref is None else ref()
            if optimizer is not None and state["stage"] is OptState.UNSCALED:
                unscale.settle_unstepped(optimizer)
                optimizer._fusedist_clear_protocol()

    def _update_with_hysteresis(self, scale: torch.Tensor, growth_tracker: torch.Tensor,
                                found: torch.Tensor) -> None:
        """torch's growth/backoff rule, with backoff delayed by hysteresis and floored at
        min_scale; all tensor ops, no host sync."""
        hyst = self._hysteresis_tracker
        new_hyst = torch.where(found, hyst - 1, torch.full_like(hyst, self._hysteresis))
        backoff = found & (new_hyst <= 0)
        successful = growth_tracker + 1
        # "==" as torch's kernel: a count loaded beyond the interval never grows there either.
        attempt = (~found) & (successful == self._growth_interval)
        grown = scale * self._growth_factor
        # torch keeps the scale if growing overflows it, but restarts the growth count all
        # the same (its _amp_update_scale_): the tracker is reset on every attempt.
        grow = attempt & torch.isfinite(grown)
        shrunk = scale * self._backoff_factor
        if self._min_scale is not None:
            at_floor = backoff & (scale <= self._min_scale)
            shrunk = torch.maximum(shrunk, self._floor_for(scale))
            self._check_min_scale(at_floor)
        new_scale = torch.where(backoff, shrunk, torch.where(grow, grown, scale))
        new_tracker = torch.where(found | attempt, torch.zeros_like(growth_tracker), successful)
        scale.copy_(new_scale)
        growth_tracker.copy_(new_tracker)
        hyst.copy_(torch.clamp(new_hyst, min=0))

    def _floor_for(self, scale: torch.Tensor) -> torch.Tensor:
        """The lowest scale a backoff from ``scale`` may reach: ``min_scale``, or ``scale``
        itself when it is already below the floor. A scale can be there after ``update(new_scale)``
        or after loading a state dict (torch's has no min_scale, so this scaler's stays); flooring
        at min_scale then *raised* the scale on an overflow (64 -> 256 at min_scale=256),
        the opposite of a backoff, and the larger scale overflowed again."""
        return torch.clamp(scale, max=self._min_scale)

    def _check_min_scale(self, at_floor: torch.Tensor) -> None:
        message = (
            f"GradScaler: gradients overflow although the loss scale is at min_scale="
            f"{self._min_scale}; those optimizer steps are skipped. The model or data likely "
            "produce inf/nan independently of the scale (check the loss, learning rate, inputs)."
        )
        if self._min_scale_policy == "raise":
            if bool(at_floor.item()):
                raise RuntimeError(message)
            return
        self._min_scale_flag.record(at_floor)
        if self._min_scale_flag.poll():
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    # -- checkpointing -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if state:
            state["hysteresis"] = self._hysteresis
            state["_hysteresis_tracker"] = (
                self._init_hysteresis_tracker if self._hysteresis_tracker is None
                else int(self._hysteresis_tracker.item())
            )
            state["min_scale"] = self._min_scale
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._enabled and state_dict:  # validate, then load: torch's load stops half-way at a missing key
            check_loaded_state(state_dict)
        super().load_state_dict(state_dict)
        if not self._enabled:
            return
        # A torch GradScaler state dict has none of these keys: keep this scaler's settings.
        self._hysteresis = int(state_dict.get("hysteresis", self._hysteresis))
        min_scale = state_dict.get("min_scale", self._min_scale)
        self._min_scale = None if min_scale is None else float(min_scale)  # (as the constructor keeps it)
        self._init_hysteresis_tracker = int(state_dict.get("_hysteresis_tracker", self._hysteresis))
        if self._hysteresis_tracker is not None:
            self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._enabled:
            state["_init_hysteresis_tracker"] = (
                self._init_hysteresis_tracker if self._hysteresis_tracker is None
                else int(self._hysteresis_tracker.item())
            )
            state["_hysteresis_tracker"] = None
            state["_last_skipped"] = state["_last_found_inf"] = None
            state["_min_scale_flag"] = unscale.LazyHostFlag()
        state["_found_inf_group"] = None  # (a process group does not travel: pass it again)
        state["_group_optimizers"], state["_agreed"] = {}, None  # (weak references do not either)
        state["_pending_steps"], state["_knows_optimizers"] = [], False
        return state
