"""Lightning's precision plugins, adapted for fusedist's strategies (Note [Lightning precision]).

``RoutesPrecision`` is the ``precision_plugin`` property both strategies share
(``FusedistStrategy``, ``FusedistModelParallelStrategy``): whatever plugin Lightning's
connector hands over is swapped for its adapter here.
"""

from __future__ import annotations

from typing import Optional

from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.optim import LBFGS

import fusedist

from ._scaler_swap import fusedist_scaler
from ._strategy_options import clip_by_norm

__all__ = ["RoutesPrecision"]


class RoutesPrecision:
    """A strategy mixin: its precision plugin is fusedist's adapter of the one Lightning chose."""

    @property
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            return _adapt_precision(Precision(), type(self).__name__)
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = None if plugin is None else _adapt_precision(plugin, type(self).__name__)


# Note [Lightning precision]
# Lightning's precision plugins own the backward, the optimizer step and gradient clipping.
# Two of their steps go wrong on a fused or sharded optimizer: torch.amp.GradScaler cannot
# step ZeRO stage 2 (it keeps no p.grad), and Lightning skips unscale_ for an optimizer that
# unscales inside step() and then refuses to clip; torch.nn.utils.clip_grad_norm_ measures
# p.grad, which stage 2 does not have. The adapters below keep each plugin (autocast, dtype
# conversion, scaler state in checkpoints) and swap only those steps: fusedist's GradScaler
# (same API and state dict), an unscale_ before the clip for every optimizer, and the clip of
# fusedist.clip_grad_norm_ / ZeroRedundancyOptimizer.clip_grad_norm_.


class _FusedistClip:
    """Clipping by norm through fusedist, and the checkpoint key of the Lightning plugin it
    stands in for (mixed into each adapted plugin; Note [plugin state under Lightning's key]).
    ``_fusedist_strategy`` is the class name of the strategy that adapted it, which its refusals name."""

    _fusedist_strategy = "FusedistStrategy"

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        clip_by_norm(optimizer, clip_val)

    def clip_grad_by_value(self, optimizer, clip_val) -> None:
        """torch's clip on ``p.grad``; refused on ZeRO stage 2, which keeps none (Note
        [clipping by value on stage 2])."""
        inner = getattr(optimizer, "_optimizer", optimizer)
        if getattr(inner, "stage", None) == 2 and isinstance(inner, fusedist.ZeroRedundancyOptimizer):
            raise ValueError(
                f"{self._fusedist_strategy}: gradient_clip_algorithm='value' cannot be applied with zero_stage=2 "
                "(a ZeroRedundancyOptimizer of stage 2), which keeps only this rank's shard of the gradients "
                "and no p.grad; clip by norm (gradient_clip_algorithm='norm') or use zero_stage=1"
            )
        super().clip_grad_by_value(optimizer, clip_val)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        own = type(self).__qualname__
        if own in checkpoint:
            checkpoint[_lightning_base(self).__qualname__] = checkpoint.pop(own)
        super().on_save_checkpoint(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        key = _lightning_base(self).__qualname__
        if key in checkpoint and type(self).__qualname__ not in checkpoint:
            self.load_state_dict(checkpoint[key])


def _lightning_base(plugin) -> type:
    """The plugin class an adapter stands in for: Lightning's, or the user's subclass of it."""
    return next(c for c in type(plugin).__mro__ if c.__module__ != __name__)


# Note [clipping by value on stage 2]
# Lightning clips by value with torch.nn.utils.clip_grad_value_ over the parameters' p.grad.
# ZeRO stage 2 reduces each gradient straight into its owner's shard and leaves p.grad None,
# so that clip finds no gradient: torch fails deep in its foreach grouping ("Expected
# !nested_tensorlist[0].empty()"), and a torch that skips empty lists would train unclipped
# without a word. Stage 1
# and plain DDP keep the full averaged p.grad (unscaled first under "16-mixed"), where torch's
# clip is exact; stage 2 refuses the setting.


# Note [plugin state under Lightning's key]
# Lightning files a precision plugin's state (the GradScaler's scale and growth tracker) in the
# checkpoint under the plugin's class name, and restores it only from that name. The adapters'
# own names would make a checkpoint of this strategy carry "_FusedistMixedPrecision", which
# strategy="ddp" ignores when it resumes, and the adapters would ignore the "MixedPrecision" of
# a strategy="ddp" checkpoint: the scaler silently restarted at its initial scale. The adapters
# save under the name of the Lightning plugin they stand in for and load from it.


class _FusedistPrecision(_FusedistClip, Precision):
    """``"32-true"``: fusedist's clip."""


class _FusedistDoublePrecision(_FusedistClip, DoublePrecision):
    """``"64-true"``: the module and inputs in float64, fusedist's clip."""


class _FusedistHalfPrecision(_FusedistClip, HalfPrecision):
    """``"16-true"`` / ``"bf16-true"``: the module in half precision (FP32 masters in the
    fused optimizer), fusedist's clip."""


class _FusedistMixedPrecision(_FusedistClip, MixedPrecision):
    """``"16-mixed"`` / ``"bf16-mixed"``: autocast as Lightning does; fp16 scales with
    fusedist's GradScaler and always unscales before the clip."""

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):  # Lightning's refusal: the scaler cannot step a closure optimizer
            raise MisconfigurationException("AMP and the LBFGS optimizer are not compatible.")
        closure_result = closure()
        skip_unscaling = closure_result is None and model.automatic_optimization
        if not skip_unscaling:
            self.scaler.unscale_(optimizer)  # read-only on stage 2; the step applies it
        self._after_closure(model, optimizer)
        if skip_unscaling:
            return closure_result
        step_output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return step_output

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=None) -> None:
        # MixedPrecision refuses to clip for optimizers that unscale in step(); fusedist's
        # scaler has unscaled (or recorded the unscale) already -- or, in manual optimization,
        # not yet (Note [clipping before the unscale]).
        kwargs = {} if gradient_clip_algorithm is None else {"gradient_clip_algorithm": gradient_clip_algorithm}
        Precision.clip_gradients(self, optimizer, clip_val=clip_val, **kwargs)


# Note [clipping before the unscale]
# In manual optimization the LightningModule clips (self.clip_gradients) between
# manual_backward and opt.step(), and Lightning's "16-mixed" unscales only inside the step: the
# clip sees the scaled gradients S*g. Lightning's DDP clips those, so the step's gradient is
# g * min(1, c / (S |g|)). fusedist's clip of a fused or ZeRO optimizer records that
# coefficient for the step, and fusedist's GradScaler.unscale_ keeps a coefficient recorded
# before it (Note [a clip before unscale_] in fusedist/amp/unscale.py); a clip by value
# scales p.grad, which the unscale then divides. So the adapter clips as it is asked, and the
# step unscales as Lightning's does.


# Note [a subclass of a Lightning plugin]
# A user's plugin subclassing one of Lightning's (another autocast dtype in forward_context, a
# hook around optimizer_step) keeps its overrides: it is adapted by a class deriving from the
# user's class and the adapter, in that order, so the user's methods run first and their
# super() calls reach fusedist's step and clip instead of torch's scaler and clip. The adapter
# shares the plugin's attributes (one __dict__; the torch scaler swapped for fusedist's): under
# Lightning's strategies the Trainer runs the user's very object, so what its methods record
# there (a count of skipped steps, a scale history) is read from the user's reference after
# fit; a copy left that reference at its initial values. Its state is filed under the user's
# class name, where Lightning's own strategies file it.

_ADAPTERS = {MixedPrecision: _FusedistMixedPrecision, HalfPrecision: _FusedistHalfPrecision,
             DoublePrecision: _FusedistDoublePrecision, Precision: _FusedistPrecision}


def _adapt_precision(plugin: Precision, strategy: str) -> Precision:
    """``plugin``'s adapter, for the strategy class named ``strategy`` (which its errors name)."""
    if isinstance(plugin, _FusedistClip):
        return plugin
    kind = type(plugin)
    if kind is Precision:
        adapted = _FusedistPrecision()
    elif kind is DoublePrecision:
        adapted = _FusedistDoublePrecision()
    elif kind is HalfPrecision:
        adapted = _FusedistHalfPrecision(plugin.precision)
    elif kind is MixedPrecision:
        adapted = _FusedistMixedPrecision(plugin.precision, plugin.device, scaler=_fusedist_scaler(plugin, strategy))
    else:
        return _adapt_subclass(plugin, strategy)
    adapted._fusedist_strategy = strategy
    return adapted


def _adapt_subclass(plugin: Precision, strategy: str) -> Precision:
    """Note [a subclass of a Lightning plugin]."""
    kind = type(plugin)
    mro = kind.__mro__
    base = next(c for c in mro if c in _ADAPTERS)
    if any(c.__module__.startswith("lightning.") for c in mro[:mro.index(base)]):
        # Lightning's other plugins (bitsandbytes, Transformer Engine, FSDP, DeepSpeed, XLA)
        # convert modules or step through their own engines this strategy does not run
        raise ValueError(
            f"{strategy}: the precision plugin {kind.__name__} is not supported; use precision="
            "'32-true', '64-true', '16-mixed', 'bf16-mixed', '16-true' or 'bf16-true', or a subclass "
            "of Lightning's Precision, DoublePrecision, HalfPrecision or MixedPrecision"
        )
    # (the strategy's name on the class: the instance's __dict__ is the user's plugin's)
    adapted_kind = type(kind.__name__, (kind, _ADAPTERS[base]), {"__module__": __name__, "_fusedist_strategy": strategy,
                                                                 "__qualname__": kind.__qualname__})
    adapted = adapted_kind.__new__(adapted_kind)
    adapted.__dict__ = vars(plugin)  # shared, not copied (Note [a subclass of a Lightning plugin])
    if base is MixedPrecision:
        adapted.scaler = _fusedist_scaler(plugin, strategy)
    return adapted


# Note [the plugin keeps the scaler that steps]
# A plugin object passed to Trainer(plugins=[...]) keeps its GradScaler, whose scale and growth
# tracker Lightning's own strategies carry on with: a second Trainer given the same plugin (a
# second fit of the same recipe) starts at the scale the first one ended with, and a scaler
# whose state the user loaded starts there. The adapter's fusedist scaler takes the torch
# scaler's state, and the user's plugin holds it in the torch scaler's place, so its state
# carries over as it does under strategy="ddp" (a fresh scaler at init_scale skipped steps the
# reference took, and the user's plugin.scaler read a scale that never moved).


def _fusedist_scaler(plugin: MixedPrecision, strategy: str):
    """fusedist's GradScaler with the settings and state of the plugin's torch scaler (None for
    bf16), which it replaces in ``plugin`` (Note [the plugin keeps the scaler that steps]); a
    user's subclass of torch's keeps its overrides (Note [a subclass of torch's GradScaler] in
    ``_scaler_swap.py``)."""
    scaler = fusedist_scaler(plugin.scaler, plugin.device, strategy, type(plugin).__name__)
    plugin.scaler = scaler
    return scaler
