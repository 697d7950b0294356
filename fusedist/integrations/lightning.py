"""``FusedistStrategy``: PyTorch Lightning's DDP strategy, with fusedist underneath.

``L.Trainer(strategy=FusedistStrategy(), devices=N, precision="bf16-mixed")`` trains the
LightningModule with :class:`fusedist.DistributedDataParallel`; optionally the optimizer that
``configure_optimizers`` returns is swapped for its fused counterpart (torch's Adam, AdamW and
SGD -> ``fusedist.optim.FusedAdam/FusedAdamW/FusedSGD``, same hyperparameters and param
groups) and sharded with :class:`fusedist.ZeroRedundancyOptimizer` (``zero_stage=1|2``).

Lightning's precision plugins keep their behaviour, routed to fusedist where the fused path
needs it (Note [Lightning precision] in ``lightning_precision.py``): ``"16-mixed"`` scales
with ``fusedist.amp.GradScaler`` (torch's cannot step a stage-2 optimizer), and gradient clipping by norm
(``Trainer(gradient_clip_val=...)``) goes through ``fusedist.clip_grad_norm_`` or the ZeRO
optimizer's own clip, which see the sharded gradients that torch's clip would miss (clipping
by value needs ``p.grad``, so stage 2 refuses it). ``"64-true"`` trains as with Lightning's DDP.
``Trainer(sync_batchnorm=True)`` uses ``fusedist.nn.SyncBatchNorm``, which runs on CPU too
(Note [sync_batchnorm]); ``ddp_comm_hook`` / ``ddp_comm_wrapper`` / ``ddp_comm_state`` are
registered as Lightning registers them (Note [communication hook wrappers]). With
``zero_stage=2`` there is no ``p.grad``: log gradient norms with this module's ``grad_norm``,
Lightning's own ``grad_norm`` with the shards taken into account (Note [gradient norms under
ZeRO stage 2]).

Importing this module registers the strategy under Lightning's strategy names
(Note [strategy names]): ``Trainer(strategy="fusedist")``, ``"fusedist_zero1"``,
``"fusedist_zero2"`` and ``"fusedist_find_unused_parameters_true"``. A swapped optimizer keeps
the class name of the one ``configure_optimizers`` returned, so ``LearningRateMonitor`` logs the
keys it logs under ``strategy="ddp"`` (Note [the optimizer's name] in ``_optimizer_swap.py``);
the returned optimizer shares the swapped one's param groups (and its step, zero_grad and state
dicts), so composite LR schedulers, schedulers the module keeps and learning rates set by hand
reach the optimizer that steps (Note [the returned optimizer] there).

Install with ``pip install fusedist[lightning]``; launch as any Lightning DDP job (Lightning's
own launcher, or ``torchrun``).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Optional

import torch
from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from lightning.pytorch.plugins.precision import HalfPrecision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

import fusedist
from fusedist.ddp import DistributedDataParallel

from . import _optimizer_swap
from ._optimizer_swap import convert_optimizer, hand_over
from ._retirement import retire
from ._strategy_options import check_zero_stage, register_names
from .lightning_precision import RoutesPrecision

__all__ = ["FusedistStrategy", "FusedistModelParallelStrategy", "grad_norm"]

class FusedistStrategy(RoutesPrecision, DDPStrategy):
    """Lightning's ``DDPStrategy`` with fusedist's DDP, fused optimizers and ZeRO.

    Lightning's precision plugins are adapted on the way in (Note [Lightning precision] in
    ``lightning_precision.py``).

    Args:
        zero_stage: 0 (plain data parallelism), 1 or 2 (``fusedist.ZeroRedundancyOptimizer``
            over the optimizer ``configure_optimizers`` returns).
        fused_optimizer: replace torch's Adam/AdamW/SGD by fusedist's fused ones (other
            optimizers are kept as they are). With ``precision="16-true"/"bf16-true"`` the
            fused optimizer keeps FP32 master weights.
        **kwargs: Lightning's ``DDPStrategy`` arguments (``timeout``, ``process_group_backend``,
            ``ddp_comm_hook``, ...) and fusedist ``DistributedDataParallel`` keywords
            (``bucket_cap_mb``, ``find_unused_parameters``, ``reduce_dtype``, ...).
    """

    strategy_name = "fusedist"

    def __init__(self, *, zero_stage: int = 0, fused_optimizer: bool = True, **kwargs: Any) -> None:
        check_zero_stage("FusedistStrategy", zero_stage)
        super().__init__(**kwargs)
        self.zero_stage = zero_stage
        self.fused_optimizer = bool(fused_optimizer)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        """The strategy's names (Note [strategy names]). Overrides DDPStrategy's, which would
        register ``"ddp"`` and its variants again, for this class."""
        register_names(cls, strategy_registry)

    # -- Trainer(sync_batchnorm=True) (Note [sync_batchnorm]) ---------------------------------

    @property
    def _layer_sync(self) -> Optional[LayerSync]:
        return self.__dict__.get("_fusedist_layer_sync")

    @_layer_sync.setter
    def _layer_sync(self, plugin: Optional[LayerSync]) -> None:
        if type(plugin) is TorchSyncBatchNorm:
            plugin = _FusedistSyncBatchNorm()
        self.__dict__["_fusedist_layer_sync"] = plugin

    # -- model and optimizers -----------------------------------------------------------------

    @property
    def optimizers(self) -> list:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list) -> None:
        DDPStrategy.optimizers.fset(self, optimizers)
        for wrapper in self._lightning_optimizers:  # Note [a load through self.optimizers()]
            wrapper.load_state_dict = functools.partial(_load_into_wrapped, wrapper)

    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        return DistributedDataParallel(model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        """Lightning's ``ddp_comm_hook``, wrapped in its ``ddp_comm_wrapper`` as Lightning does
        (Note [communication hook wrappers])."""
        if self._ddp_comm_hook is not None:
            hook = _wrapped_hook(self._ddp_comm_hook, self._ddp_comm_wrapper)
            self.model.register_comm_hook(self._ddp_comm_state, hook)

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        if self.zero_stage and len(self.optimizers) > 1:
            # Each ZeroRedundancyOptimizer shards along the DDP model's gradient buckets and must
            # own all of its trainable parameters; ZeRO's own refusal would name the other
            # optimizers' parameters as missing and advise freezing them.
            raise ValueError(
                f"FusedistStrategy(zero_stage={self.zero_stage}) shards one optimizer over all the "
                f"model's trainable parameters, but configure_optimizers returned {len(self.optimizers)} "
                "optimizers; use zero_stage=0 (fused, unsharded optimizers), or one optimizer with a "
                "param group per part of the model"
            )
        master_weights = isinstance(self.precision_plugin, HalfPrecision)
        for i, optimizer in enumerate(self.optimizers):
            new = self._convert_optimizer(optimizer, master_weights)
            if new is not optimizer:
                hand_over(optimizer, new, [config.scheduler for config in self.lr_scheduler_configs])
                self.optimizers[i] = new

    def _convert_optimizer(self, optimizer: torch.optim.Optimizer, master_weights: bool):
        return convert_optimizer(optimizer, fused_optimizer=self.fused_optimizer, zero_stage=self.zero_stage,
                                 master_weights=master_weights, strategy="FusedistStrategy",
                                 fresh_from="return a fresh optimizer from configure_optimizers")

    def load_optimizer_state_dict(self, checkpoint) -> None:
        for optimizer in self.optimizers:  # Note [param groups assigned before a resume]
            if isinstance(optimizer, fusedist.ZeroRedundancyOptimizer):
                _adopt_assigned_groups(optimizer)
        super().load_optimizer_state_dict(checkpoint)

    @contextmanager
    def block_backward_sync(self):
        """Gradient accumulation: the micro-batches before the last skip the all-reduce."""
        if isinstance(self.model, DistributedDataParallel):
            with self.model.no_sync():
                yield None
        else:
            yield None

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        """Manual optimization: every ``manual_backward`` synchronizes (outside ``no_sync``), as
        Lightning's DDP prepares each one (Note [each manual_backward synchronizes])."""
        super().pre_backward(closure_loss)
        model = self.model
        if (isinstance(model, DistributedDataParallel) and not self.lightning_module.automatic_optimization
                and torch.is_grad_enabled() and not model.reducer.in_backward):
            model.reducer.prepared, model.reducer.next_backward_sync = True, model._no_sync_depth == 0

    def on_exception(self, exception: BaseException) -> None:
        """fusedist DDP's error about parameters without a gradient names its own keyword; with
        Lightning the setting is the strategy's, which the message then names too (as
        DDPStrategy rewrites torch's message to name its strategy string)."""
        super().on_exception(exception)
        if self.zero_stage:
            advice = f"FusedistStrategy(zero_stage={self.zero_stage}, find_unused_parameters=True)"
        else:
            advice = "strategy='fusedist_find_unused_parameters_true' or FusedistStrategy(find_unused_parameters=True)"
        advice = f" With Lightning, set it on the strategy: {advice}."
        exception.args = tuple(
            arg + advice if isinstance(arg, str) and "find_unused_parameters=True to DistributedDataParallel" in arg
            and advice not in arg else arg for arg in exception.args)

    def teardown(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            retire(self.model, self.optimizers)  # Note [the wrapper retires at teardown]
            self.model = self.lightning_module  # unwrap, as Lightning does for torch's DDP
        super().teardown()


# Note [the wrapper retires at teardown]
# Lightning unwraps the module when a fit ends, and torch's DDP wrapper dies with its last
# reference, its gradient hooks with it. fusedist's wrapper is kept alive by its hooks (Note [a
# module wrapped again] in fusedist/ddp/wrapper.py) and stays registered as the parameters'
# data-parallel owner, and a stage-2 optimizer as the holder of their gradients. So after
# trainer.fit the module was still fusedist's: a backward reduced into the retired buckets,
# torch's optimizers stepping it afterwards (a later Trainer with strategy="ddp", a plain
# loop) were refused as "not synchronized" through a wrapper no forward went through, and
# torch's clip_grad_norm_ asked the retired stage-2 shards for the norm (0: nothing clipped).
# At teardown the strategy removes the wrapper's hooks and the registrations that name it or
# its optimizers, leaving the module as Lightning's DDP leaves it; a later fit wraps it again.


# Note [a load through self.optimizers()]
# self.optimizers() hands the LightningModule a LightningOptimizer: an instance of a class made
# with the optimizer's class as a second base, which forwards the attributes it lacks to the
# optimizer. load_state_dict is found on the optimizer's class and runs with the wrapper as
# self: torch's loader assigns the loaded state and param groups, and a fused optimizer's
# bookkeeping, to the wrapper, and the optimizer that steps never sees them. A ZeRO optimizer
# keeps what a load changes where wrappers share it (Note [state shared with wrappers] in
# fusedist/zero/shared_state.py), so with zero_stage=1/2 a load took effect and with
# zero_stage=0 it was silently dropped: the same module trained from the loaded state or from
# scratch depending on the stage. The strategy's wrappers load into the optimizer they wrap,
# as Fabric's optimizer wrapper does (Lightning's own DDP strategy drops the load, for torch's
# optimizers too).


def _load_into_wrapped(wrapper, state_dict) -> None:
    """``wrapper.load_state_dict``: the wrapped optimizer's (Note [a load through
    self.optimizers()])."""
    wrapper.optimizer.load_state_dict(state_dict)


# Note [param groups assigned before a resume]
# Lightning's fine-tuning callbacks (BaseFinetuning, BackboneFinetuning) record the param groups
# they add, and on a resume rebuild them by assigning the optimizer's param_groups before the
# checkpoint's optimizer state is loaded: the groups of the backbone unfrozen before the save
# are in the list again. A ZeroRedundancyOptimizer shards the parameters it was built with and
# those add_param_group gave it; the assigned groups' parameters it did not hold, and the
# load failed ("state dict has state for parameter 2, the optimizer has 2") where Lightning's
# DDP resumed. Before the load the strategy adds the groups appended after those holding its
# parameters, as add_param_group would; any other change to the list is left to the load.


def _adopt_assigned_groups(zero) -> None:
    """``zero`` takes the groups assigned after the ones holding its parameters (Note [param
    groups assigned before a resume])."""
    held, groups = [id(p) for p in zero._params], zero.param_groups
    seen, known = [], 0
    while len(seen) < len(held) and known < len(groups):
        seen += [id(p) for p in groups[known]["params"]]
        known += 1
    while known < len(groups) and not groups[known]["params"]:  # empty groups it holds, as built
        known += 1
    if seen != held or known == len(groups):
        return
    zero.param_groups = groups[:known]
    for group in groups[known:]:
        zero.add_param_group(group)


# Note [strategy names]
# Lightning resolves Trainer(strategy="...") in its StrategyRegistry, which its own strategies
# fill through their register_strategies classmethod when lightning.pytorch.strategies is
# imported. This module registers FusedistStrategy's names the same way when it is imported;
# `import fusedist` does not, because it never imports Lightning (and registering only when
# Lightning happens to be imported first would make the string depend on import order). A
# script that names the strategy by string imports fusedist.integrations.lightning first;
# Lightning's launcher re-runs the script in each worker, which imports it there too.


# Note [each manual_backward synchronizes]
# In manual optimization the whole training_step, manual_backward calls included, runs inside
# one forward of the DDP wrapper. fusedist's DDP prepares one backward per training forward
# (Note [a backward no DDP forward prepared] in fusedist/ddp/prepared.py), so the second
# manual_backward of a step -- Lightning's GAN recipe: generator loss, step, discriminator
# loss, step -- accumulated local gradients and the second optimizer refused to step.
# Lightning's DDPStrategy.pre_backward prepares torch's reducer before each manual_backward
# (prepare_for_backward), but only for torch's class; the strategy does the same for
# fusedist's: synchronized unless the backward runs under no_sync.


# Note [communication hook wrappers]
# Lightning registers ddp_comm_wrapper(ddp_comm_hook), and so does the strategy. torch's
# fp16/bf16 compress wrappers around allreduce_hook are exactly its fp16/bf16 compress hooks
# (cast, divide, all-reduce, cast back), which fusedist's DDP runs as its own fused bucket
# reduction, so that pair is registered as the built-in hook; any other pair is registered
# wrapped, as a hook of torch's interface (Note [communication hooks] in
# fusedist/ddp/comm_hook.py).


def _wrapped_hook(hook, wrapper):
    """``wrapper(hook)``, or the built-in hook it amounts to (Note [communication hook wrappers])."""
    if wrapper is None:
        return hook
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as d

    same = {(d.fp16_compress_wrapper, d.allreduce_hook): d.fp16_compress_hook,
            (d.bf16_compress_wrapper, d.allreduce_hook): d.bf16_compress_hook}
    return same.get((wrapper, hook)) or wrapper(hook)


# Note [sync_batchnorm]
# Trainer(sync_batchnorm=True) hands the strategy Lightning's TorchSyncBatchNorm, which
# converts the module's BatchNorm layers to torch.nn.SyncBatchNorm: CUDA only, so a CPU (gloo)
# run stops at its first forward. The strategy converts them to fusedist.nn.SyncBatchNorm
# instead -- the same statistics over all ranks, on CPU and GPU -- keeping the very tensors
# (the optimizer built later sees them), and reverts them to plain BatchNorm at teardown as
# Lightning does. A custom LayerSync plugin is kept as given.


class _FusedistSyncBatchNorm(TorchSyncBatchNorm):
    """``sync_batchnorm=True`` with fusedist's SyncBatchNorm (Note [sync_batchnorm])."""

    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        return fusedist.nn.SyncBatchNorm.convert_sync_batchnorm(model)

    def revert(self, model: torch.nn.Module) -> torch.nn.Module:
        return _revert_sync_batchnorm(model)


def _revert_sync_batchnorm(module: torch.nn.Module) -> torch.nn.Module:
    """fusedist's SyncBatchNorm layers back to BatchNorm on the same tensors (Lightning's
    TorchSyncBatchNorm.revert, for fusedist's class). A layer held under several names (applied
    twice, shared by branches) becomes one BatchNorm under all of them, as the conversion made it
    one SyncBatchNorm (the same walk: Note [a layer held under several names] in fusedist/nn/_convert.py)."""
    from fusedist.nn._convert import replaced_tree

    return replaced_tree(module, lambda m, _path: _reverted(m))


def _reverted(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` as a BatchNorm on the same tensors where it is a fusedist SyncBatchNorm, else itself."""
    from lightning.pytorch.plugins.layer_sync import _BatchNormXd

    if not isinstance(module, fusedist.nn.SyncBatchNorm):
        return module
    converted = _BatchNormXd(module.num_features, module.eps, module.momentum, module.affine,
                             module.track_running_stats)
    if module.affine:
        converted.weight, converted.bias = module.weight, module.bias
    converted.running_mean, converted.running_var = module.running_mean, module.running_var
    converted.num_batches_tracked = module.num_batches_tracked
    converted.training = module.training
    return converted


# Optimizers pickled by an earlier version name the function that rebuilds their class here.
_new_named = _optimizer_swap._new_named

# Trainer(strategy="fusedist") and its variants (Note [strategy names]).
FusedistStrategy.register_strategies(StrategyRegistry)


# fully_shard models under Lightning's ModelParallelStrategy (its own module; it reuses the
# precision adapters above).
from .lightning_model_parallel import FusedistModelParallelStrategy  # noqa: E402

# Lightning's grad_norm for gradients that ZeRO stage 2 keeps in shards (Note [gradient norms
# under ZeRO stage 2]).
from .lightning_grad_norm import grad_norm  # noqa: E402
