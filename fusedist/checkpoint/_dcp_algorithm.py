"""The algorithm of an optimizer state read from torch's distributed checkpoint, told by its settings.

Note [the algorithm of a torch distributed checkpoint's optimizer]
    A fusedist checkpoint records the class and algorithm of the optimizer that saved it, and
    ``load`` refuses another algorithm's state (``_checks.check_algorithm``). A torch DCP
    checkpoint records neither: AdamW's state loaded into SGD was taken silently, as torch's
    ``load_state_dict`` takes it -- SGD's param groups then held ``betas``, ``eps`` and
    ``amsgrad`` and its state ``exp_avg``, and its next step failed or ran with settings it was
    never given. What the checkpoint does record is each param group's settings. So its
    hyperparameters are compared with the optimizer's: a setting of some optimizer's algorithm
    (a key of a torch or fusedist optimizer's ``defaults``) that this optimizer does not have
    means another algorithm's state, and is refused naming the settings. Keys no optimizer
    defines (an LR scheduler's ``initial_lr``, a user's group name) and the ones that only say
    how a step runs (``foreach``, ``fused``, ...) are left out, as are settings the optimizer
    has and the checkpoint lacks (an older torch saved fewer). ``decoupled_weight_decay`` is a
    setting of one class but two algorithms (Adam and AdamW), and is compared by value, except in
    a group saved without weight decay (Note [Adam without weight decay is AdamW without it] in
    ``_adam_family.py``).

Note [a checkpoint without decoupled_weight_decay]
    A torch older than that setting saved Adam's and AdamW's groups without it, the same keys
    either way. torch's loaders then decide: ``Adam.__setstate__`` (and NAdam's, RAdam's, fusedist's
    FusedAdam's) fills it with False, ``AdamW``'s (and FusedAdamW's) with True (torch 2.13). So
    ``Adam(decoupled_weight_decay=True)`` loading such a group silently ran Adam's L2 decay from then
    on, where AdamW loads it as AdamW. (torch's own DCP load refuses the checkpoint outright, "Missing
    key in checkpoint state_dict", as the live optimizer's groups have the key; with
    ``allow_partial_load`` the optimizer keeps its own setting.) So a group saved without the key is
    refused only where the optimizer's loader would change the setting the group has: what the
    loader does is read from a probe instance of the optimizer's class, so that a subclass is judged
    by its own ``__setstate__``; a class that cannot be probed is not refused.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch

from ._adam_family import without_decay
from ._files import CheckpointError

# How a step runs, not what it computes: states load across them (torch's loaders keep the saved ones).
_HOW_IT_RUNS = frozenset({"params", "foreach", "fused", "capturable", "differentiable", "maximize"})


@functools.lru_cache(maxsize=None)
def _known_settings() -> frozenset:
    """Every hyperparameter of torch's and fusedist's optimizers (the keys of their ``defaults``),
    read once from an instance of each over one parameter."""
    from .. import optim as fused

    param = torch.nn.Parameter(torch.zeros(1))
    classes = [getattr(torch.optim, n) for n in dir(torch.optim)]
    classes += [getattr(fused, n) for n in dir(fused) if n.startswith("Fused")]
    known = set()
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                known.update(cls([param]).defaults)
        except Exception:  # noqa: BLE001 - one that needs more arguments adds nothing
            continue
    return frozenset(known - _HOW_IT_RUNS)


def _settings_of(optimizer) -> tuple[set, list]:
    """The settings ``optimizer``'s algorithm has (its defaults and its groups' keys) and its groups."""
    groups = optimizer.param_groups
    own = set(getattr(optimizer, "defaults", {}) or {})
    for group in groups:
        own.update(group)
    return own, groups


_DECOUPLED = "decoupled_weight_decay"


@functools.lru_cache(maxsize=None)
def _loaded_without_key(cls: type, value: bool) -> Optional[bool]:
    """The ``decoupled_weight_decay`` a group of ``cls`` that has ``value`` is left with after
    ``load_state_dict`` of a saved group without the key (Note [a checkpoint without
    decoupled_weight_decay]); None where no class of its MRO can be probed over one parameter."""
    param = torch.nn.Parameter(torch.zeros(1))
    for klass in cls.__mro__:
        if not issubclass(klass, torch.optim.Optimizer) or klass is torch.optim.Optimizer:
            break
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                try:
                    probe = klass([param], **{_DECOUPLED: value})
                except Exception:  # noqa: BLE001 - a class that does not take it (torch's AdamW)
                    probe = klass([param])
                probe.param_groups[0][_DECOUPLED] = value
                saved = probe.state_dict()
                saved["param_groups"][0].pop(_DECOUPLED, None)
                probe.load_state_dict(saved)
                return bool(probe.param_groups[0].get(_DECOUPLED, value))
            except Exception:  # noqa: BLE001 - one that needs more arguments: try its base
                continue
    return None


def _switched_without_key(saved_groups: list, optimizer) -> Optional[str]:
    """The problem, where loading a group saved without ``decoupled_weight_decay`` would change the
    optimizer's setting (Note [a checkpoint without decoupled_weight_decay]); else None."""
    for i, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups)):
        if _DECOUPLED in saved or _DECOUPLED not in group or without_decay(saved):
            continue  # (no weight decay: either setting runs the same steps)
        value = bool(group[_DECOUPLED])
        loaded = _loaded_without_key(type(optimizer), value)
        if loaded is not None and loaded != value:
            name = type(optimizer).__name__
            return (f"param group {i} was saved without {_DECOUPLED} (by a torch older than that setting: Adam's "
                    f"and AdamW's groups look alike there), and {name}.load_state_dict fills it with {loaded}, "
                    f"where the optimizer here has {_DECOUPLED}={group[_DECOUPLED]!r}: from then on it would run "
                    f"{'AdamW' if loaded else 'Adam'}'s weight decay instead of "
                    f"{'AdamW' if value else 'Adam'}'s. If the checkpoint is AdamW's, load it into torch.optim.AdamW "
                    f"or fusedist.optim.FusedAdamW, which keep decoupled weight decay; if Adam's, build the optimizer "
                    f"with {_DECOUPLED}={loaded}")
    return None


def check(saved_groups: list, optimizer, directory: str) -> None:
    """Refuse a torch DCP checkpoint's optimizer state whose param groups hold another algorithm's
    settings (Note [the algorithm of a torch distributed checkpoint's optimizer])."""
    own, groups = _settings_of(optimizer)
    known = _known_settings()
    foreign = sorted({k for g in saved_groups for k in g if k in known and k not in own})
    problem: Optional[str] = None
    if foreign:
        problem = f"its param groups hold settings {foreign}, which {type(optimizer).__name__} does not have"
    else:
        for i, (saved, group) in enumerate(zip(saved_groups, groups)):
            key = "decoupled_weight_decay"
            if key in saved and key in group and bool(saved[key]) != bool(group[key]) and not without_decay(saved):
                problem = (f"param group {i} was saved with {key}={saved[key]!r} ("
                           f"{'AdamW' if saved[key] else 'Adam'}'s weight decay), the optimizer here has "
                           f"{key}={group[key]!r}")
                break
        else:
            problem = _switched_without_key(saved_groups, optimizer)
    if problem is not None:
        raise CheckpointError(
            f"fusedist.checkpoint: the optimizer state in {directory} (torch's distributed checkpoint) is another "
            f"algorithm's than {type(optimizer).__name__}'s: {problem}; its state and hyperparameters would be read "
            "as this algorithm's. Load it into the optimizer that saved it, or load the model alone "
            "(optimizer=None) to start a new optimizer from it")
