"""Adam's state without weight decay loads into AdamW, and AdamW's into Adam.

Note [Adam without weight decay is AdamW without it]
    Adam and AdamW differ only in how a step applies weight decay: added to the gradient (L2) or
    to the weights apart from it (decoupled). With ``weight_decay=0`` a step of one is the other's,
    and their state (``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``) is the same. So a
    param group saved without weight decay is taken by either algorithm: the algorithm check reads
    it as the loading group's algorithm (Note [Adam and AdamW are one class in torch] in
    ``zero/sharded_state.py``), and the loaded group keeps the loading optimizer's own
    ``decoupled_weight_decay``. torch's ``load_state_dict`` takes the saved setting with the
    state: an AdamW that loaded Adam's groups ran L2 decay once it was given a weight decay. A
    group saved with weight decay is still refused: its decay would change algorithm.
"""

from __future__ import annotations

from typing import Optional

import torch

_KEY = "decoupled_weight_decay"


def without_decay(group: dict) -> bool:
    """Whether a saved param group has ``weight_decay`` 0 (not merely lacking the setting)."""
    decay = group.get("weight_decay")
    if isinstance(decay, torch.Tensor):
        return decay.numel() == 1 and float(decay) == 0.0
    return isinstance(decay, (int, float)) and not isinstance(decay, bool) and float(decay) == 0.0


def recorded(groups) -> list:
    """Each group's weight decay as a manifest records it (None where it is not a plain number)."""
    out = []
    for group in groups:
        decay = group.get("weight_decay")
        if isinstance(decay, torch.Tensor) and decay.numel() == 1:
            decay = float(decay)
        out.append(float(decay) if isinstance(decay, (int, float)) and not isinstance(decay, bool) else None)
    return out


def read_as_loading(saved_groups: Optional[list], decays: Optional[list], algorithms_here: list) -> Optional[list]:
    """``saved_groups`` (the settings that tell each saved group's algorithm) with each group saved
    without weight decay (``decays``: the saved groups' weight decays) read as running the
    algorithm of the loading group (``algorithms_here``: "Adam" or "AdamW" per group)."""
    if saved_groups is None or decays is None:
        return saved_groups
    if len(decays) != len(saved_groups):  # (one value in every saved group stands for any number)
        decays = [decays[0]] * len(saved_groups) if len(set(decays)) == 1 else [None] * len(saved_groups)
    return [dict(g, **{_KEY: here == "AdamW"}) if decay == 0.0 and here in ("Adam", "AdamW") else g
            for g, decay, here in zip(saved_groups, decays, algorithms_here)]


def keep_own_setting(full: dict, optimizer) -> dict:
    """``full`` (an optimizer state in torch's format) with each group saved without weight decay
    given the loading group's ``decoupled_weight_decay``, which ``load_state_dict`` then keeps."""
    groups = getattr(optimizer, "param_groups", None) or []
    if not any(_KEY in g for g in groups):
        return full
    saved = full.get("param_groups") or []
    kept = [dict(s, **{_KEY: g[_KEY]}) if _KEY in g and without_decay(s) and s.get(_KEY) != g[_KEY] else s
            for s, g in zip(saved, groups)]
    if all(a is b for a, b in zip(kept, saved)):
        return full
    return dict(full, param_groups=kept + list(saved[len(kept):]))
