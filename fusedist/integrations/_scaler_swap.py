"""fusedist's GradScaler in place of the torch scaler a framework's precision plugin was given
(Lightning's Trainer and Fabric alike): the same settings and state, and a user's subclass's
overrides kept (Note [a subclass of torch's GradScaler])."""

from __future__ import annotations

import torch

import fusedist

# Note [a subclass of torch's GradScaler]
# MixedPrecision("16-mixed", ..., scaler=MyScaler(...)) with the user's subclass of
# torch.amp.GradScaler (an update() that logs the scale or caps it, a hook around step) runs
# that subclass under strategy="ddp". Replacing it by a plain fusedist GradScaler dropped the
# overrides without a word. As a plugin subclass is adapted (Note [a subclass of a Lightning
# plugin] in lightning_precision.py), the scaler is adapted by a class deriving from the user's
# class and fusedist's GradScaler, in that order: the user's methods run first and their super()
# calls reach fusedist's (which derives from torch's). The adapter shares the user's scaler's
# __dict__, whose torch attributes are replaced by fusedist's scaler's (same names, the same
# state), so what the overrides record is read from the user's reference, as under
# strategy="ddp". torch's own subclasses (ShardedGradScaler: a found-inf all-reduced over its
# process group, an unscale of p.grad) do what fusedist's scaler does for the gradients it
# steps, including those ZeRO stage 2 keeps in shards, which theirs would not see: like torch's
# GradScaler, they are replaced. A user's subclass of one of them would put torch's unscale
# before fusedist's, and is refused.


def fusedist_scaler(torch_scaler, device, strategy: str, plugin_name: str):
    """fusedist's GradScaler with the settings and state of ``torch_scaler`` (None: None, for
    bf16; fusedist's own: itself), over a user's subclass's overrides. ``strategy`` and
    ``plugin_name`` name the strategy and plugin in refusals."""
    if torch_scaler is None or isinstance(torch_scaler, fusedist.amp.GradScaler):
        return torch_scaler
    if not isinstance(torch_scaler, torch.amp.GradScaler):
        raise TypeError(
            f"{strategy}: {plugin_name}(scaler=...) got a {type(torch_scaler).__name__}, which is not a "
            "torch.amp.GradScaler: fusedist's strategies scale through fusedist.amp.GradScaler, which takes the "
            "settings and state of a torch.amp.GradScaler (or of a subclass of it, whose overrides it keeps)"
        )
    settings = {}
    if torch_scaler._enabled:  # (a disabled torch scaler, GradScaler(enabled=False), keeps no settings)
        settings = dict(init_scale=torch_scaler._init_scale, growth_factor=torch_scaler._growth_factor,
                        backoff_factor=torch_scaler._backoff_factor, growth_interval=torch_scaler._growth_interval)
    scaler = fusedist.amp.GradScaler(device, enabled=torch_scaler._enabled, **settings)
    scaler.load_state_dict(torch_scaler.state_dict())
    if not _is_torchs(type(torch_scaler)):
        scaler = _adapt_scaler_subclass(torch_scaler, scaler, strategy)
    return scaler


def _is_torchs(kind: type) -> bool:
    return kind.__module__ == "torch" or kind.__module__.startswith("torch.")


def _adapt_scaler_subclass(user_scaler: torch.amp.GradScaler, scaler: fusedist.amp.GradScaler, strategy: str):
    """``scaler``'s state and methods under the user's overrides (Note [a subclass of torch's GradScaler])."""
    kind = type(user_scaler)
    mro = kind.__mro__
    torchs = [c for c in mro[:mro.index(torch.amp.GradScaler)] if _is_torchs(c) and c is not torch.cuda.amp.GradScaler]
    if torchs:
        raise TypeError(
            f"{strategy}: the GradScaler {kind.__name__} subclasses torch's {torchs[0].__name__}, whose unscale "
            "would run instead of fusedist's GradScaler's; derive it from torch.amp.GradScaler (or "
            f"fusedist.amp.GradScaler), or pass a {torchs[0].__name__} itself"
        )
    adapted_kind = type(kind.__name__, (kind, fusedist.amp.GradScaler), {"__module__": __name__,
                                                                         "__qualname__": kind.__qualname__})
    adapted = adapted_kind.__new__(adapted_kind)
    adapted.__dict__ = vars(user_scaler)  # shared, not copied
    adapted.__dict__.update(vars(scaler))
    return adapted
