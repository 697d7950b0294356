"""``FusedistFabricStrategy``: Lightning Fabric's DDP strategy, with fusedist underneath.

``Fabric(strategy=FusedistFabricStrategy(), devices=N)`` wraps the module that
``fabric.setup`` is given in :class:`fusedist.DistributedDataParallel`; optionally the
optimizer is swapped for its fused counterpart (torch's Adam, AdamW and SGD ->
``fusedist.optim.FusedAdam/FusedAdamW/FusedSGD``, same hyperparameters and param groups, FP32
master weights under ``precision="16-true"/"bf16-true"``) and sharded with
:class:`fusedist.ZeroRedundancyOptimizer` (``zero_stage=1|2``), as ``FusedistStrategy`` does
for the Trainer. The loop stays Fabric's:

    fabric = L.Fabric(strategy=FusedistFabricStrategy(zero_stage=2), precision="bf16-mixed")
    model, optimizer, scheduler = fabric.setup(model, optimizer, scheduler=scheduler)
    with fabric.no_backward_sync(model, enabled=accumulating):
        fabric.backward(model(x).loss)
    fabric.clip_gradients(model, optimizer, max_norm=1.0)
    optimizer.step()

Note [Fabric's steps on a fused or sharded optimizer]
    Three of Fabric's DDP steps assume torch's classes: ``no_backward_sync`` accepts only
    torch's DDP module, ``"16-mixed"`` scales with torch's GradScaler (which cannot step ZeRO
    stage 2: no ``p.grad``) and refuses to clip for an optimizer that unscales inside its step
    (stage 2 does), and ``clip_gradients`` measures ``p.grad`` with torch's clip, which stage 2
    leaves None. The strategy takes fusedist's module in ``no_backward_sync``, swaps the
    precision plugin's scaler for ``fusedist.amp.GradScaler`` (same settings; its unscale of a
    stage-2 optimizer is read-only, and the step applies it), and clips through
    ``ZeroRedundancyOptimizer.clip_grad_norm_`` or ``fusedist.clip_grad_norm_``, which give the
    global norm over the shards, returned as Fabric returns torch's. Clipping by value needs
    ``p.grad``, so stage 2 refuses it.

    An LR scheduler passed to ``fabric.setup(..., scheduler=...)`` -- and any scheduler it holds
    (SequentialLR) -- drives the swapped optimizer, and the optimizer given to ``setup`` stands
    for the swapped one: its param groups, ``step``, ``zero_grad`` and state dicts are the swapped
    one's, so a scheduler built on it and a loop or ``fabric.save`` given it act on the optimizer
    that steps (Note [the returned optimizer] in ``_optimizer_swap.py``). ``fabric.save``
    consolidates a ZeRO optimizer's state on rank 0, as Fabric does for torch's
    ``ZeroRedundancyOptimizer``; ``fabric.load`` loads it on every rank.

    One torch optimizer may outlive one setup, as under Fabric's DDP: an optimizer that stepped
    before ``fabric.setup`` is converted with its state; set up again, it is converted from the
    state of the one swapped in before, which then forwards to the new one; and
    ``fabric.strategy.teardown()`` retires the wrappers and swapped-in optimizers, so another
    strategy (or a plain loop) trains the module and optimizer on from their state (Note
    [teardown]); a later Fabric with ``strategy="ddp"`` (or torch's DDP) over them retires them at
    its first forward, torn down or not (Note [a torch DDP over a module set up before] in
    ``_retirement.py``). The optimizer given to ``setup`` reads the swapped-in one's state by
    parameter (``optimizer.state[p]["exp_avg"]``); a ZeRO one's is sharded, and a lookup says
    where to read it (Note [the returned optimizer's state] in ``_optimizer_swap.py``).

Importing this module registers the strategy under Fabric's strategy names: ``"fusedist"``,
``"fusedist_zero1"``, ``"fusedist_zero2"`` and ``"fusedist_find_unused_parameters_true"``.
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl

import fusedist
from fusedist.ddp import DistributedDataParallel

from ._optimizer_swap import convert_optimizer, hand_over, kept_for, retire_successor, stepping_for
from ._retirement import retire, retire_when_torch_wraps
from ._scaler_swap import fusedist_scaler
from ._strategy_options import check_zero_stage, clip_by_norm, register_names

__all__ = ["FusedistFabricStrategy", "FusedistFabricModelParallelStrategy"]

_NAME = "FusedistFabricStrategy"


class FusedistFabricStrategy(DDPStrategy):
    """Fabric's ``DDPStrategy`` with fusedist's DDP, fused optimizers and ZeRO (module docstring).

    Args:
        zero_stage: 0 (plain data parallelism), 1 or 2 (``fusedist.ZeroRedundancyOptimizer``
            over each optimizer set up with the module; one optimizer per module).
        fused_optimizer: replace torch's Adam/AdamW/SGD by fusedist's fused ones (other
            optimizers are kept as they are).
        **kwargs: Fabric's ``DDPStrategy`` arguments (``timeout``, ``process_group_backend``,
            ``start_method``, ...) and fusedist ``DistributedDataParallel`` keywords
            (``bucket_cap_mb``, ``find_unused_parameters``, ``reduce_dtype``, ...).
    """

    def __init__(self, *, zero_stage: int = 0, fused_optimizer: bool = True, **kwargs: Any) -> None:
        check_zero_stage(_NAME, zero_stage)
        super().__init__(**kwargs)
        self.zero_stage = zero_stage
        self.fused_optimizer = bool(fused_optimizer)
        self._backward_sync_control = _FusedistBackwardSyncControl()
        self._set_up_modules: list = []  # weak references to the DDP modules setup_module made
        self._swapped_in: list = []  # weak references to the optimizers it swapped in (Note [teardown])

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """The strategy's names. Overrides DDPStrategy's, which would register ``"ddp"`` and its
        variants again, for this class."""
        register_names(cls, strategy_registry)

    # -- precision (Note [Fabric's steps on a fused or sharded optimizer]) --------------------

    @property
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    def precision(self, plugin: Optional[Precision]) -> None:
        self._precision = None if plugin is None else _adapt_precision(plugin)

    # -- module and optimizers ------------------------------------------------------------------

    def setup_module(self, module: torch.nn.Module, _converting: tuple = ()) -> DistributedDataParallel:
        ddp = DistributedDataParallel(module, device_ids=self._determine_ddp_device_ids(), **self._ddp_kwargs)
        self._set_up_modules.append(weakref.ref(ddp))
        retire_when_torch_wraps(ddp)  # (Fabric never tears down: Note [a torch DDP over a module set up before])
        self._rebuild_stage2_over(ddp, _converting)
        return ddp

    def _rebuild_stage2_over(self, ddp: DistributedDataParallel, converting) -> None:
        """Note [a module set up again under stage 2]. ``converting``: optimizers that the same
        ``fabric.setup`` converts next (from the current state, on ``ddp``)."""
        params = {id(p) for p in ddp.module.parameters()}
        for zero in [ref() for ref in self._swapped_in]:
            if not (isinstance(zero, fusedist.ZeroRedundancyOptimizer) and zero.stage == 2
                    and stepping_for(zero) is None
                    and any(id(p) in params for group in zero.param_groups for p in group["params"])):
                continue
            kept = kept_for(zero)
            if kept is not None and not any(kept is opt for opt in converting):
                self._converted(kept, None)  # (zero forwards to the new one: hand_over)

    def setup_module_and_optimizers(self, module: torch.nn.Module, optimizers: list, scheduler=None):
        if self.zero_stage and len(optimizers) > 1:
            # each ZeroRedundancyOptimizer shards along the DDP model's gradient buckets and must
            # own all of its trainable parameters
            raise ValueError(
                f"{_NAME}(zero_stage={self.zero_stage}) shards one optimizer over all the module's trainable "
                f"parameters, but fabric.setup was given {len(optimizers)}; use zero_stage=0 (fused, unsharded "
                "optimizers), or one optimizer with a param group per part of the module")
        module = self.setup_module(module, tuple(optimizers))
        return module, [self._converted(opt, scheduler) for opt in optimizers], scheduler

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``fabric.setup_optimizers`` after ``fabric.setup_module``: the same conversion."""
        if self.zero_stage == 2:
            self._check_module_set_up_first(optimizer)
        if self.zero_stage:
            self._check_holds_its_module(optimizer)
        return self._converted(optimizer, None)

    def _check_module_set_up_first(self, optimizer: torch.optim.Optimizer) -> None:
        """Note [stage 2 needs its module set up first]."""
        wrapped = {id(p) for ref in self._set_up_modules if ref() is not None for p in ref().module.parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        outside = [p for p in params if id(p) not in wrapped]
        if outside:
            shapes = [tuple(p.shape) for p in outside[:4]]
            raise ValueError(
                f"{_NAME}(zero_stage=2): the {type(optimizer).__name__} given to fabric.setup_optimizers trains "
                f"{len(outside)} parameter(s) (shapes {shapes}{' ...' if len(outside) > 4 else ''}) of no module "
                "set up yet. Stage 2 reduces the gradients into the optimizer's shards through the "
                "DistributedDataParallel wrapper that fabric.setup_module makes, so call fabric.setup_module(model) "
                "before fabric.setup_optimizers(optimizer) (as Fabric's FSDP strategy asks), or "
                "fabric.setup(model, optimizer), or use zero_stage=1")

    def _check_holds_its_module(self, optimizer: torch.optim.Optimizer) -> None:
        """The check ``fabric.setup`` makes for several optimizers, for ``fabric.setup_optimizers``:
        a ZeRO optimizer must hold every trainable parameter of the module it trains. (ZeRO's own
        refusal would advise freezing the parameters that another optimizer trains.)"""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for ref in self._set_up_modules:
            ddp = ref()
            trainable = [] if ddp is None else [(n, p) for n, p in ddp.module.named_parameters() if p.requires_grad]
            missing = [n for n, p in trainable if id(p) not in held]
            if missing and len(missing) < len(trainable):
                raise ValueError(
                    f"{_NAME}(zero_stage={self.zero_stage}) shards one optimizer over all the trainable parameters of "
                    f"its module, but the {type(optimizer).__name__} given to fabric.setup_optimizers does not hold "
                    f"{missing[:4]}{' ...' if len(missing) > 4 else ''}; set requires_grad=False on parameters that no "
                    "optimizer trains before fabric.setup_module, and for several optimizers over one module use "
                    "zero_stage=0 (fused, unsharded optimizers), or one optimizer with a param group per part")

    def _converted(self, optimizer, scheduler):
        new = convert_optimizer(optimizer, fused_optimizer=self.fused_optimizer, zero_stage=self.zero_stage,
                                master_weights=isinstance(self.precision, HalfPrecision), strategy=_NAME,
                                fresh_from="pass a fresh optimizer to fabric.setup")
        if new is not optimizer:
            hand_over(optimizer, new, [] if scheduler is None else [scheduler])
            self._swapped_in.append(weakref.ref(new))
        return new

    def teardown(self) -> None:
        """Fabric's teardown, with the module and the optimizer given to ``fabric.setup`` left as
        Fabric's DDP leaves them (Note [teardown])."""
        optimizers = [opt for opt in (ref() for ref in self._swapped_in) if opt is not None]
        for ddp in (ref() for ref in self._set_up_modules):
            if ddp is not None:
                retire(ddp, optimizers)
        for optimizer in optimizers:  # (also when no wrapper is alive any more)
            retire_successor(optimizer)
        self._set_up_modules, self._swapped_in = [], []
        super().teardown()

    def get_module_state_dict(self, module: torch.nn.Module) -> dict:
        return super().get_module_state_dict(module.module if isinstance(module, DistributedDataParallel) else module)

    def load_module_state_dict(self, module: torch.nn.Module, state_dict: dict, strict: bool = True) -> None:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        super().load_module_state_dict(module, state_dict, strict=strict)

    # -- clipping (Note [Fabric's steps on a fused or sharded optimizer]) -----------------------

    def clip_gradients_norm(self, module: torch.nn.Module, optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        self.precision.unscale_gradients(optimizer)
        return clip_by_norm(optimizer, max_norm, norm_type, error_if_nonfinite)

    def clip_gradients_value(self, module: torch.nn.Module, optimizer, clip_val: Union[float, int]) -> None:
        if isinstance(optimizer, fusedist.ZeroRedundancyOptimizer) and optimizer.stage == 2:
            raise ValueError(f"{_NAME}: fabric.clip_gradients(clip_val=...) cannot be applied with zero_stage=2, "
                             "which keeps only this rank's shard of the gradients and no p.grad; clip by norm "
                             "(max_norm=...) or use zero_stage=1")
        super().clip_gradients_value(module, optimizer, clip_val)


# Note [teardown]
# strategy.teardown() ends the strategy's part: Fabric's DDP leaves torch's wrapper, which dies
# with its last reference, and the torch optimizer that stepped. fusedist's wrapper outlives its
# references (its gradient hooks hold it) and stays the parameters' data-parallel owner, and the
# optimizer given to fabric.setup kept forwarding to the one swapped in: a later Fabric with
# strategy="ddp" over the same model and optimizer (or a plain loop) was refused at its first step
# as "not synchronized", and at ZeRO stage 2 would have stepped gradients nothing reduced any more.
# As Lightning's strategy does at the end of a fit (Note [the wrapper retires at teardown] in
# lightning.py), teardown removes the wrappers' hooks and registrations and retires the swapped-in
# optimizers: the kept optimizer takes its whole state back at its next use and steps as torch's.


# Note [a module set up again under stage 2]
# A ZeroRedundancyOptimizer at stage 2 steps the gradients that the wrapper it was built on
# reduces into its shards. Setting the module up again (fabric.setup_module(model) a second time,
# as Fabric's DDP allows: the newer wrapper trains it) retires the first wrapper (Note [a module
# wrapped again] in fusedist/ddp/wrapper.py), and the stage-2 optimizer swapped in with it went
# on stepping gradients no wrapper reduced any more: 2.4e-2 off Fabric's DDP in three steps,
# without a word. The strategy now rebuilds such an optimizer on the new wrapper from its whole
# state (a collective, which every rank's setup_module runs alike), and the earlier one forwards
# to it (Note [an earlier successor forwards to the new one] in _optimizer_swap.py), so the
# optimizer the program holds steps on. Stage 1 and the unsharded optimizers read p.grad, which
# the newest wrapper synchronizes, and need nothing.


# Note [stage 2 needs its module set up first]
# Fabric's DDP strategy takes fabric.setup_optimizers before fabric.setup_module. A stage-2
# ZeroRedundancyOptimizer is built on the gradient hooks of the fusedist DistributedDataParallel
# that fabric.setup_module makes, and refused to be built over the parameters of a module not
# wrapped yet, with advice ("Wrap the model, or use stage=1") that a Fabric program cannot
# follow. The strategy refuses that order itself, naming the calls to make; stage 1 (which
# shards only the optimizer's state) and the unsharded fused optimizers take either order.


class _FusedistBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync`` on fusedist's DDP module (Fabric's accepts torch's only)."""

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, DistributedDataParallel):
            raise TypeError(f"{_NAME}: no_backward_sync needs the module set up by fabric.setup (a fusedist "
                            f"DistributedDataParallel), got {type(module).__name__}")
        return module.no_sync()


class _FusedistMixedPrecision:
    """Mixed into Fabric's ``MixedPrecision`` (or the user's subclass of it): unscale before a
    clip for every optimizer, a stage-2 one included (Fabric refuses one that unscales inside its
    step; fusedist's GradScaler records the unscale for the step)."""

    def unscale_gradients(self, optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)


def _adapt_precision(plugin: Precision) -> Precision:
    """The plugin, with fusedist's GradScaler where it scales (Note [Fabric's steps on a fused
    or sharded optimizer]); Fabric's other plugins (bitsandbytes, Transformer Engine, FSDP,
    DeepSpeed, XLA) convert modules or step through engines this strategy does not run."""
    kind = type(plugin)
    base = next((c for c in kind.__mro__ if c in (MixedPrecision, HalfPrecision, DoublePrecision, Precision)), None)
    mro = kind.__mro__
    if base is None or any(c.__module__.startswith("lightning.") for c in mro[:mro.index(base)]):
        raise ValueError(f"{_NAME}: the precision plugin {kind.__name__} is not supported; use precision='32-true', "
                         "'64-true', '16-mixed', 'bf16-mixed', '16-true' or 'bf16-true', or a subclass of Fabric's "
                         "Precision, DoublePrecision, HalfPrecision or MixedPrecision")
    if base is not MixedPrecision or isinstance(plugin, _FusedistMixedPrecision):
        return plugin
    adapted_kind = type(kind.__name__, (_FusedistMixedPrecision, kind),
                        {"__module__": __name__, "__qualname__": kind.__qualname__})
    adapted = adapted_kind.__new__(adapted_kind)
    adapted.__dict__.update(vars(plugin))
    adapted.scaler = fusedist_scaler(plugin.scaler, plugin.device, _NAME, kind.__name__)
    return adapted


FusedistFabricStrategy.register_strategies(STRATEGY_REGISTRY)

# fully_shard modules under Fabric's ModelParallelStrategy (its own module).
from .fabric_model_parallel import FusedistFabricModelParallelStrategy  # noqa: E402
