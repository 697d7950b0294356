"""``SyncBatchNorm.convert_sync_batchnorm``: the walk over a model that replaces its BatchNorm
layers, keeping their tensors, and the warning for what a converted subclass loses."""

from __future__ import annotations

import warnings

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from . import _outside_group as outside_group


def replaced_tree(module: torch.nn.Module, replace, path: str = "", done: dict | None = None) -> torch.nn.Module:
    """``module`` with each module of its tree replaced by ``replace(module, path)`` under every name it is
    held by, a module met again becoming what it became the first time (Note [a layer held under several
    names]); ``done``: the modules replaced so far, by id, with what they became."""
    done = {} if done is None else done
    if id(module) in done:
        return done[id(module)][1]
    converted = replace(module, path)
    done[id(module)] = (module, converted)  # (the module itself is kept alive so that its id stays its own)
    for name, child in list(module._modules.items()):
        if child is not None:
            converted.add_module(name, replaced_tree(child, replace, f"{path}.{name}" if path else name, done))
    return converted


def convert_tree(cls, module: torch.nn.Module, process_group) -> torch.nn.Module:
    """``cls.convert_sync_batchnorm(module, process_group)``."""
    return replaced_tree(module, lambda m, path: _converted(cls, m, process_group, path))


def _converted(cls, module: torch.nn.Module, process_group, path: str) -> torch.nn.Module:
    """``module`` (found at ``path`` in the model being converted) as a ``cls`` layer where it is a BatchNorm,
    else ``module`` itself."""
    if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
        # Its num_features is 0 until the first forward: the converted layer would expect
        # 0 channels and fail with a misleading message at its first call.
        raise ValueError(
            f"SyncBatchNorm.convert_sync_batchnorm: {type(module).__name__} is still "
            "uninitialized (num_features is inferred at its first forward); run one forward "
            "of the model before converting it"
        )
    if not isinstance(module, _BatchNorm):
        return module
    # A SyncBatchNorm (ours included) is rebuilt too, as torch's conversion does: it
    # takes the process_group given now instead of silently keeping its old one.
    _warn_dropped(module, path)
    extra = {} if getattr(module, "bias", None) is not None or not module.affine else {"bias": False}
    converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                    module.track_running_stats, process_group, **extra)
    if module.affine:
        with torch.no_grad():
            converted.weight = module.weight
            converted.bias = module.bias
    converted.running_mean = module.running_mean
    converted.running_var = module.running_var
    converted.num_batches_tracked = module.num_batches_tracked
    converted.training = module.training
    outside_group.remember(converted, path)  # named in its warning: Note [a rank outside the layer's group]
    if hasattr(module, "qconfig"):
        converted.qconfig = module.qconfig
    return converted


# Note [a layer held under several names]
#     A model may hold one BatchNorm under several names: applied twice (``nn.Sequential(bn, act,
#     bn)``, a block reusing its ``self.norm``) or shared by two branches. ``named_children``
#     yields a module once per parent, so a walk over it (torch's conversion's) replaced the first
#     name only: the second kept the unsynchronized BatchNorm, normalizing each rank's batch alone
#     while sharing the weight and running statistics -- the global-batch statistics silently
#     lost for that call. The walk reads every name, and a module met again becomes the layer it
#     became the first time, so a shared BatchNorm stays one shared SyncBatchNorm.


# Note [converting BatchNorm subclasses]
#     The conversion builds a plain SyncBatchNorm from a BatchNorm's options and tensors, as
#     torch.nn.SyncBatchNorm.convert_sync_batchnorm does, for subclasses too. What a subclass
#     adds is then gone without a word: timm's BatchNormAct2d applies its activation in its own
#     forward (the converted layer keeps ``act`` as a child and never calls it, so the model
#     silently loses its ReLUs), a "frozen BN" subclass keeps its statistics fixed in its
#     forward, a parameter of the subclass's own (a learnable scale) leaves the state_dict, and
#     forward hooks (feature extractors, QAT observers) are not carried over. The conversion
#     still does what torch's does -- code written for torch's keeps working -- and warns,
#     naming the layer and what it loses, so that such layers get their own converter (timm's
#     ``convert_sync_batchnorm`` for BatchNormAct2d) or are left out. A synchronizing BatchNorm
#     (torch's or ours and their subclasses, detectron2's NaiveSyncBatchNorm, apex's
#     SyncBatchNorm: "Sync" in the class name) has its forward replaced on purpose, and is not
#     warned about for it.
_STANDARD_FORWARDS = (_BatchNorm.forward, torch.nn.SyncBatchNorm.forward)
_STANDARD_TENSORS = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


def _warn_dropped(module: torch.nn.Module, path: str) -> None:
    """Warn when converting ``module`` loses behaviour of its own (Note [converting BatchNorm
    subclasses])."""
    lost = []
    kind = type(module)
    synchronizing = isinstance(module, torch.nn.SyncBatchNorm) or "sync" in kind.__name__.lower()
    if kind.forward not in _STANDARD_FORWARDS and not synchronizing:
        lost.append(f"its own forward ({kind.__qualname__}.forward is not called)")
    own = [name for name, _ in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
           if name not in _STANDARD_TENSORS]
    if own:
        lost.append(f"its parameters/buffers {own} (no longer in the layer or its state_dict)")
    hooks = len(module._forward_hooks) + len(module._forward_pre_hooks)
    if hooks:
        lost.append(f"{hooks} forward hook(s) / pre-hook(s)")
    if not lost:
        return
    warnings.warn(
        f"SyncBatchNorm.convert_sync_batchnorm: {path or 'the root module'} ({kind.__qualname__}) becomes a plain "
        f"SyncBatchNorm, as torch's conversion makes it, and loses {'; '.join(lost)}. Convert that layer with "
        "a converter that knows its class (e.g. timm's convert_sync_batchnorm for BatchNormAct2d), or leave it "
        "out of the conversion.",
        UserWarning, stacklevel=3,
    )
