"""The optimizer side of the GradScaler protocol (Note [scaler protocol] in
fusedist/amp/grad_scaler.py), shared by the fused optimizers and ZeroRedundancyOptimizer.

A subclass says which gradients it reads (:meth:`_fusedist_local_grads`), which parameters the
global norm covers (:meth:`_fusedist_grad_params`) and, when it is sharded, how the local
found-inf flag and sum of squares become global (:meth:`_fusedist_reduce_found_inf_and_norm`).
What the scaler and clip decided for the next step lives in one :class:`StepContext`
(``optimizer.step_context``), which ``step()`` consumes and clears.
"""

from __future__ import annotations

import contextlib
import operator
import weakref
from itertools import compress, repeat
from typing import NamedTuple, Optional

import torch

from ._complex import grads_as_memory
from .functional import _effective_factor
from .step_context import StepContext

# Note [whole-list passes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# Each phase of an AMP step (unscale_, clip, step) looks at every gradient: is it still the
# one recorded, was it written since. On a GPU the host issues the step, and a Python loop over
# hundreds of tensors costs hundreds of microseconds there, as much as the kernels. So these
# checks map C-level getters over whole lists (``map(_grad_of, params)``) and compare the
# resulting lists, and fall back to a per-tensor loop only to find and name what changed.
_grad_of = operator.attrgetter("grad")
_version_of = operator.attrgetter("_version")
_data_ptr = torch.Tensor.data_ptr
_deref = weakref.ref.__call__


def without_none(params: list, grads: list) -> tuple[list, list]:
    """``(params, grads)`` less the pairs whose gradient is None (Note [whole-list passes])."""
    has = list(map(operator.is_not, grads, repeat(None)))
    if all(has):
        return params, grads
    return list(compress(params, has)), list(compress(grads, has))


# Note [gradients looked up once a call]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Inside one call of the protocol -- GradScaler.unscale_, fusedist.clip_grad_norm_, the checks of
# GradScaler.step, the body of a fused optimizer's step() -- no program code runs, so no
# gradient can be replaced: a fused optimizer's first look at (parameters, gradients) serves
# the rest of the call (:class:`looked_up_once`), where each check used to walk the parameters
# again. In-place writes inside the call keep the tensors, so the look stays true. Only inside
# the call: between calls the program may replace or write gradients, which is what the checks
# are for; step()'s pre-hooks and closure run before its body looks.
_LOOKED = "_fusedist_looked"


class looked_up_once:
    """``with looked_up_once(optimizer):`` one call of the protocol (Note [gradients looked up
    once a call]); nested uses keep the outer one's look."""

    __slots__ = ("_state", "_outer")

    def __init__(self, optimizer) -> None:
        self._state = optimizer.__dict__

    def __enter__(self) -> None:
        self._outer = _LOOKED in self._state
        if not self._outer:
            self._state[_LOOKED] = None  # (in a call; not looked yet)

    def __exit__(self, *exc) -> None:
        if not self._outer:
            self._state.pop(_LOOKED, None)


# Note [the protocol's owner behind a wrapper]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Frameworks hand programs a wrapper of the optimizer that forwards missing attributes with
# ``__getattr__`` (Lightning's LightningOptimizer and Fabric's optimizer, which also subclass
# the wrapped class dynamically; accelerate's AcceleratedOptimizer). Reading the protocol
# through such a wrapper works, but GradScaler's writes (``found_inf``, ``grad_scale``) landed in
# the wrapper's own ``__dict__``, and the fused optimizer's step never saw them: an overflowing
# step was applied, and without ``unscale_`` the scaled gradients were (weights inf/nan at the
# first overflow). The scaler therefore reads and writes the protocol on its owner: the object
# holding ``step_context`` itself, found among the wrapper's attributes.
def protocol_owner(optimizer):
    """The object that owns the scaler protocol of ``optimizer`` (itself, the fused optimizer
    a forwarding wrapper holds, Note [the protocol's owner behind a wrapper], or the one it was
    handed over to, Note [the protocol of a handed-over optimizer], also behind a wrapper of the
    one handed over); else ``optimizer`` itself (or the one it was handed over to: a
    ZeroRedundancyOptimizer makes its step context lazily)."""
    obj = found = optimizer
    for _ in range(8):  # (wrappers of wrappers; bounded against cycles)
        state = getattr(obj, "__dict__", None)
        if state is None:
            return obj
        handed = state.get(_HANDED_TO)
        successor = None if handed is None else handed()
        if successor is not None:
            obj = found = successor  # (its own, unless it wraps one in turn)
            continue
        if "step_context" in state:
            return obj
        inner = next((v for v in state.values() if isinstance(v, ScalerProtocol) and v is not obj), None)
        if inner is None:  # (a wrapper of an optimizer that was handed over: the chain of stepped_optimizer)
            inner = _held_optimizer(obj, state)
        if inner is None:
            return found
        obj = inner
    return found


# Note [the protocol of a handed-over optimizer]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A strategy that swaps the user's optimizer for a fused or sharded one hands the old one over
# (``hand_over`` in fusedist/integrations/_optimizer_swap.py): its step runs the new one's. A
# program that kept the old one and scales it itself (``scaler.step(their_opt)`` in a Fabric
# loop) had the scaler write ``grad_scale`` and ``found_inf`` on the old one, which its step
# never reads: the new one applied the scaled gradients (weights inf/nan at the first overflow),
# or an overflowed step; behind a torch optimizer the scaler unscaled ``p.grad``, which a ZeRO
# stage-2 optimizer leaves None ("No inf checks were recorded"). The old one therefore names
# its successor, and the scaler checks, unscales and tells the successor, as if it were passed.
_HANDED_TO = "_fusedist_handed_to"


def hand_protocol_over(old, new) -> None:
    """From now on ``old``'s scaler protocol is ``new``'s (Note [the protocol of a handed-over
    optimizer]); held weakly, as ``old``'s step flag holds ``new``."""
    old.__dict__[_HANDED_TO] = weakref.ref(new)


def follows_protocol(optimizer) -> bool:
    """Whether the scaler steps ``optimizer`` through the protocol (Note [scaler protocol]): it
    is (or forwards to) a fused or sharded optimizer, or was handed over to one, or wraps one that
    was (the chain of :func:`stepped_optimizer`). Only hand-overs and wrappers sharing the param
    groups of the one they hold are followed: an object merely holding fused optimizers may step
    several of them."""
    for _ in range(8):  # (bounded against cycles)
        if getattr(optimizer, "_fusedist_fused", False):
            return True
        optimizer = _next_stepped(optimizer)
        if optimizer is None:
            return False
    return False


# Note [one scaler state per stepped optimizer]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's GradScaler keeps an iteration's record of an optimizer (unscaled yet? stepped? its
# inf/nan flags) under ``id(optimizer)``. A framework gives a program several objects that step
# the same parameters: Fabric's and Lightning's wrappers, which forward to the strategy's
# optimizer, and the optimizer the program built, handed over to the fused or sharded one the
# strategy made (Note [the protocol of a handed-over optimizer]). A loop that unscaled through
# one (``fabric.clip_gradients(model, optimizer_it_kept, max_norm)``) and stepped through another
# (the wrapper's ``step``) had two records: the step found its own "not unscaled" and unscaled the
# gradients again (divided twice by the scale: SGD's updates ``scale`` times too small), and a
# second ``unscale_`` through the other name was not refused. The scaler therefore keys its
# record by the optimizer that all the names lead to (:func:`stepped_optimizer`).
def stepped_optimizer(optimizer):
    """The optimizer that steps when ``optimizer`` is stepped, which the scaler's record of an
    iteration is kept under (Note [one scaler state per stepped optimizer]): following hand-overs,
    and wrappers that hold one optimizer and share its param groups (the same list object, as
    Fabric's, Lightning's and accelerate's forward them). Anything else is its own."""
    obj = optimizer
    for _ in range(8):  # (wrappers of wrappers; bounded against cycles)
        successor = _next_stepped(obj)
        if successor is None:
            return obj
        obj = successor
    return obj


# Note [one chain of names]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The scaler asks three things of what it is given: where its record of the iteration is kept
# (:func:`stepped_optimizer`), whether it steps through the protocol (:func:`follows_protocol`) and
# where the protocol's attributes are written (:func:`protocol_owner`). All three follow the same
# links -- a hand-over, and a wrapper sharing the param groups of the optimizer it holds -- so no
# name leads one of them elsewhere. A Fabric or Lightning wrapper of the optimizer a program kept,
# which a strategy handed over to its fused or sharded one, found the record of the new one but
# went through torch's path: it unscaled ``p.grad`` (which a ZeRO stage-2 optimizer leaves None:
# "No inf checks were recorded for this optimizer") and wrote nothing the new one reads.
def _next_stepped(obj):
    """The next link of :func:`stepped_optimizer`'s chain from ``obj``, or None at its end."""
    state = getattr(obj, "__dict__", None)
    if state is None:
        return None
    handed = state.get(_HANDED_TO)
    successor = None if handed is None else handed()
    return successor if successor is not None else _held_optimizer(obj, state)


def _held_optimizer(obj, state: dict):
    """The optimizer ``obj`` wraps and steps: one it holds that shares its param groups (the same
    list object, as Fabric's, Lightning's and accelerate's wrappers forward them); else None."""
    groups = getattr(obj, "param_groups", None)
    if groups is None:
        return None
    return next((v for v in state.values() if isinstance(v, torch.optim.Optimizer) and v is not obj
                 and getattr(v, "param_groups", None) is groups), None)


class FlagOfAnother:
    """A value of an optimizer's ``_opt_called`` (torch's LR schedulers' step-order flag) that
    says whether *another* optimizer has stepped, decided when read: the optimizer handed its
    place to that one, whose steps are its steps. :class:`ScalerProtocol`'s flag keeps it as it
    is (Note [a skipped step and the LR scheduler])."""

    __slots__ = ()

    def __bool__(self) -> bool:
        raise NotImplementedError

    def optimizer(self):
        """The optimizer whose flag this reads (None once it is gone)."""
        raise NotImplementedError


class ClippedGrads(NamedTuple):
    """What fusedist's clip recorded (Note [gradients changed after the clip]): parallel lists
    of the parameters, weak references to their gradients and the gradients' version counts."""

    params: list
    refs: list
    versions: list


class ScalerProtocol:
    # Note [scaler protocol]: marks the optimizer for fusedist.amp.GradScaler.
    _fusedist_fused = True

    def _fusedist_clear_protocol(self) -> None:
        """After a step (or at construction): torch's two attributes and the step context."""
        self.grad_scale: Optional[torch.Tensor] = None
        self.found_inf: Optional[torch.Tensor] = None
        if "step_context" not in self.__dict__:
            self.step_context = StepContext()
        self.step_context.clear()

    # Note [a skipped step and the LR scheduler]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # torch's LR schedulers wrap ``optimizer.step`` to set ``optimizer._opt_called = True`` and
    # warn at their first step when it is unset ("Detected call of `lr_scheduler.step()` before
    # `optimizer.step()`"). torch's GradScaler skips an overflowed step of its optimizers by not
    # calling ``step`` at all, so a skipped first step leaves the flag unset and the warning
    # comes; only torch's ``fused=True`` optimizers are called anyway (they skip on the device)
    # and give none. fusedist's scaler always calls a fused optimizer's step, which skips on
    # the device (Note [scaler protocol]), so the flag is a property here: setting it records
    # the step's ``found_inf`` (None when no scaler decides), and reading it says whether a step
    # ran that was not skipped -- what torch's flag means for its unfused optimizers, or, for a
    # group built with ``fused=True``, whether step was called, as for torch's fused ones. A
    # CPU flag is read when recorded; a device flag is kept (the minimum over the steps so far)
    # and read only when the flag is, which a scheduler does once, at its first step. A
    # :class:`FlagOfAnother` set here (this optimizer handed over to another that steps in its
    # place) is kept, and read when the flag is: the other's flag, skipped steps included.
    @property
    def _opt_called(self) -> bool:
        called = self.__dict__.get("_fusedist_opt_called", False)
        if isinstance(called, FlagOfAnother):
            return bool(called)
        if isinstance(called, torch.Tensor):  # Note [a skipped step and the LR scheduler]
            called = bool((called == 0).item())
            if called:
                self.__dict__["_fusedist_opt_called"] = True
        return called

    @_opt_called.setter
    def _opt_called(self, value) -> None:
        recorded = self.__dict__.get("_fusedist_opt_called", False)
        if isinstance(value, FlagOfAnother):
            self.__dict__["_fusedist_opt_called"] = value
        elif not value:
            self.__dict__["_fusedist_opt_called"] = False
        elif recorded is not True and not isinstance(recorded, FlagOfAnother):
            # (with a FlagOfAnother, this step was the other's, which keeps its own flag)
            self.__dict__["_fusedist_opt_called"] = self._fusedist_step_ran(recorded)

    def _fusedist_step_ran(self, recorded):
        """True once a step ran that the scaler did not skip, else the flag to read later (Note
        [a skipped step and the LR scheduler])."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None or any(g.get("fused") for g in getattr(self, "param_groups", ())):
            return True
        flag = found_inf.detach().reshape(())
        if flag.device.type == "cpu":
            return True if flag.item() == 0 else recorded
        return flag.clone() if recorded is False else torch.minimum(recorded, flag)

    # Note [gradients changed after unscale_]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # unscale_ records the gradients' norm (and, lazily, a pending inv_scale) for what the
    # gradients hold *then*. Code that writes them afterwards -- torch's clip_grad_norm_, a
    # hand-written clip or noise -- makes the recorded norm stale, and with a pending
    # inv_scale it worked on scaled values. unscale_ therefore records the tensors' version
    # counters: fusedist's clip then measures afresh instead of using a stale norm, and a
    # lazy unscale_ followed by writes raises at step() instead of stepping silently wrong.
    def _fusedist_record_grad_versions(self) -> None:
        self.step_context.grad_versions = _addresses_and_versions(self._fusedist_unscale_targets())

    def _fusedist_check_grads_since_unscale(self) -> bool:
        """Whether the gradients were written or replaced since unscale_ recorded them; raises
        when they were while a lazy unscale_ is pending (they held the scaled values)."""
        recorded = self.step_context.grad_versions
        if recorded is None:
            return False
        written = recorded != _addresses_and_versions(self._fusedist_unscale_targets())
        if written and self.step_context.inv_scale is not None:
            raise RuntimeError(self._written_while_scaled_message())
        return written

    def _written_while_scaled_message(self) -> str:
        name = type(self).__name__
        if not self._fusedist_grads_in_user_view():  # gradient shards: unscaled inside the step, always
            return (
                f"fusedist: {name}'s gradients changed after GradScaler.unscale_ (a backward accumulated "
                "into them, or they were written), while they still held the *scaled* values: this optimizer "
                "unscales its gradient shards inside step(), so the new values would be unscaled as if "
                "unscale_ had seen them and the recorded found-inf and norm miss them. Call unscale_ (and "
                "clip) after the last backward of the step.")
        own_clip = " (or optimizer.clip_grad_norm_)" if hasattr(self, "clip_grad_norm_") else ""
        return (
            f"fusedist: {name}'s gradients were written after "
            "GradScaler(lazy_unscale=True).unscale_, while they still held the *scaled* values (e.g. "
            "by torch.nn.utils.clip_grad_norm_, which then measured a norm 'scale' times too large): "
            f"stepping would apply a wrong update. Clip with fusedist.clip_grad_norm_{own_clip}, or build "
            "the GradScaler without lazy_unscale=True so that unscale_ writes the unscaled gradients as "
            "torch's does.")

    # Note [gradients changed after the clip]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # fusedist's clip records a coefficient that the step applies, instead of scaling p.grad.
    # torch's clip scales the values p.grad holds *then*, so a gradient written between the
    # clip and the step must not receive the coefficient. The clip therefore records each
    # gradient (a weak reference and its version counter), and before the coefficient is used
    # the gradients are compared with what was recorded:
    # * all unchanged: the coefficient stays deferred (the fast path);
    # * some replaced (``p.grad = new``, ``zero_grad`` and a new backward) or dropped, or new
    #   ones appeared: the coefficient is applied now to the unchanged ones only, as torch's
    #   clip did to them, and the step runs without it -- the same result as torch;
    # * one written in place (``p.grad.add_(noise)``, a second backward accumulating,
    #   torch's clip): the values before the write are gone, so no factor gives torch's result
    #   (``coef * old + written``); this raises before anything changes rather than stepping
    #   differently from torch.
    def _fusedist_record_clipped_grads(self) -> None:
        """Called by fusedist's clip after it recorded a coefficient for the step."""
        params, grads = self._fusedist_params_and_grads()
        self.step_context.clipped_grads = ClippedGrads(
            params, list(map(weakref.ref, grads)), list(map(_version_of, grads)))

    def _fusedist_settle_clip(self) -> None:
        """Before a recorded clip coefficient is used: keep it when the gradients it covers are
        unchanged, else apply it now to the unchanged ones (Note [gradients changed after the
        clip])."""
        ctx = self.step_context
        recorded = ctx.clipped_grads
        if recorded is None or ctx.clip_coef is None:
            return
        now = list(map(_grad_of, recorded.params))
        if (all(map(operator.is_, map(_deref, recorded.refs), now))
                and all(map(operator.is_not, now, repeat(None)))):  # none replaced or dropped
            if list(map(_version_of, now)) != recorded.versions:
                written = next(p for p, g, v in zip(recorded.params, now, recorded.versions) if g._version != v)
                raise RuntimeError(self._written_after_clip_message(written))
            if len(now) == len(self._fusedist_grad_params()):
                return  # (none appeared either)
        unchanged = []
        for p, ref, version in zip(*recorded):
            g = p.grad
            if g is None or ref() is not g:
                continue
            if g._version != version:
                raise RuntimeError(self._written_after_clip_message(p))
            unchanged.append(g)
        if ctx.inv_scale is not None:
            self._fusedist_check_grads_since_unscale()  # raises: these gradients were still scaled
        if unchanged:  # (a negated or conjugated one as its memory: Note [lazily conjugated gradients])
            torch._foreach_mul_(grads_as_memory(unchanged, True), ctx.clip_coef.reshape(()).to(unchanged[0].device))
        ctx.clip_coef = ctx.clipped_grads = None

    def _written_after_clip_message(self, p) -> str:
        where = next((f"param {pi} of param group {gi}" for gi, group in enumerate(getattr(self, "param_groups", []))
                      for pi, q in enumerate(group["params"]) if q is p), f"a parameter of shape {tuple(p.shape)}")
        return (
            f"fusedist: the gradient of {where} was written in place after fusedist.clip_grad_norm_ "
            f"recorded its clip coefficient for {type(self).__name__}'s step (that clip scales the "
            "gradients inside the step, not in p.grad). torch's clip would have scaled only the values "
            "before the write, which are gone, so stepping could not match it. Clip after the last write "
            "to the gradients (after the last backward), or clip with torch.nn.utils.clip_grad_norm_, "
            "which scales p.grad at once. Assigning a new tensor to p.grad after the clip is fine."
        )

    def _fusedist_has_grads(self) -> bool:
        """Whether this optimizer has gradients to check for inf/nan on any rank: without any,
        GradScaler.step raises as torch's does ("No inf checks were recorded ..."). In terms
        of the protocol, not of ``p.grad``: a sharded optimizer's gradients may be shards."""
        return bool(self._fusedist_grad_params())

    def _fusedist_grad_params(self) -> list:
        """Parameters whose gradients the *global* norm covers (what clip_grad_norm_ compares
        its argument with)."""
        raise NotImplementedError

    def _fusedist_local_grads(self) -> list:
        """Gradients this rank reads in the check pass (its shard, for a sharded optimizer)."""
        raise NotImplementedError

    def _fusedist_unscale_targets(self) -> list:
        """Gradients a materialized unscale writes: those users see in ``p.grad`` by default."""
        return self._fusedist_params_and_grads()[1]

    def _fusedist_params_and_grads(self) -> tuple[list, list]:
        """The parameters of :meth:`_fusedist_grad_params` that have a ``p.grad``, and those
        gradients (Note [whole-list passes])."""
        params = self._fusedist_grad_params()
        return without_none(params, list(map(_grad_of, params)))

    def _fusedist_grads_in_user_view(self) -> bool:
        """Whether users read the gradients this optimizer steps (``p.grad``): then
        GradScaler.unscale_ writes them unscaled, as torch's does (Note [lazy unscale]). A
        sharded optimizer whose gradients exist only as its own shards says no."""
        return True

    def _fusedist_check_norm_and_unscale(self, inv_scale: torch.Tensor):
        """``_fusedist_check_and_norm(inv_scale)``, then the gradients users see unscaled in place
        (GradScaler.unscale_ by default, Note [lazy unscale]). An optimizer whose check pass
        reads exactly those gradients does both in one pass."""
        found_inf, sumsq = self._fusedist_check_and_norm(inv_scale)
        grads = self._fusedist_unscale_targets()
        if grads:
            torch._foreach_mul_(grads, inv_scale.reshape(()))
        return found_inf, sumsq

    def _fusedist_reduce_found_inf_and_norm(self, found_inf: torch.Tensor, sumsq: torch.Tensor):
        """Combine the local flag and sum of squares into the global ones. Identity here; a
        sharded optimizer (ZeRO) overrides it to all-reduce them, so every rank sees the same
        flag and norm."""
        return found_inf, sumsq

    def _fusedist_materialize_unscale(self) -> None:
        """Apply a pending ``inv_scale`` (``lazy_unscale``) and a pending clip coefficient to
        the gradients in place, for a caller that needs the values the step would use and may
        change them (clip_grad_norm_ on a different set of parameters, or with another norm
        type, after fusedist's clip recorded its coefficient): the recorded norm is dropped
        either way. Afterwards the optimizer behaves as after torch's ``unscale_`` (and clip)."""
        ctx = self.step_context
        self._fusedist_settle_clip()  # Note [gradients changed after the clip]
        ctx.grad_sumsq = None
        factor = _effective_factor(ctx.inv_scale, ctx.clip_coef)  # what the step would apply
        if factor is None:
            return
        grads = self._fusedist_unscale_targets()
        if grads:
            torch._foreach_mul_(grads, factor.reshape(()))
        ctx.inv_scale = ctx.clip_coef = ctx.clipped_grads = None

    def _effective_inv_scale(self) -> Optional[torch.Tensor]:
        return self.step_context.effective_inv_scale(self.grad_scale)


def _addresses_and_versions(grads: list) -> tuple[list, list]:
    """What unscale_ records of the gradients (Note [gradients changed after unscale_]):
    addresses, not ids, as a sharded optimizer hands out fresh views of the same shards."""
    return list(map(_data_ptr, grads)), list(map(_version_of, grads))


@contextlib.contextmanager
def gradients_named_on_refusal(optimizer):
    """The check pass refuses a gradient the kernels cannot read (sparse, on another device) by
    its place in a flat list ("grads[0] is sparse"), where ``step()`` names the parameter and says
    what to use instead; the scaler runs that pass before the step. On such a refusal the step's
    own checks (``_collect_group``) run and raise theirs; nothing was written before either. Free
    when nothing is refused."""
    try:
        yield
    except (RuntimeError, TypeError, ValueError):
        for gi, group in enumerate(optimizer.param_groups):
            optimizer._collect_group(group, gi)
        raise
