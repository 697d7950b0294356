"""The names a checkpoint gives a model's state: the module's own, without the segments that
wrappers insert, so that one model saved compiled, wrapped or bare loads as the same model.

Note [canonical names]
    ``torch.compile(model)`` returns an ``OptimizedModule`` whose state dict keys (and
    parameter names) all carry ``_orig_mod.``; DDP (fusedist's or torch's) adds ``module.``;
    torch's ``checkpoint_wrapper`` adds ``_checkpoint_wrapped_module.`` to parameter names;
    each can sit anywhere in the tree (``model.block = torch.compile(model.block)``).
    Checkpoints store every key and parameter name without those segments, found by walking
    the module tree along the key (as torch's ``get_model_state_dict`` does in
    ``_get_fqns``), never by string matching, so a user's own submodule called ``module`` or
    ``_orig_mod`` keeps its name. Loading maps the canonical names back to the target's own
    keys. Checkpoints written before names were canonical may carry ``_orig_mod.``:
    :func:`legacy_key` drops it from a saved key that names nothing in the model as it is.
"""

from __future__ import annotations

import heapq
from typing import Iterable, Optional

import torch

_ORIG_MOD = "_orig_mod"
#: the attribute of torch's activation checkpointing / offloading wrappers
#: (``checkpoint_wrapper``): their own state-dict hooks drop it from the keys, not from
#: parameter names.
_CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"
_EXTRA_STATE = torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX


def is_extra_state(key: str) -> bool:
    """Whether a state-dict key is a module's ``get_extra_state()`` entry: any object, which
    torch's ``load_state_dict`` hands to the module's ``set_extra_state``."""
    return key.rpartition(".")[2] == _EXTRA_STATE


def _inner(obj, part: str) -> Optional[torch.nn.Module]:
    """The wrapped module when ``obj`` is a wrapper and ``part`` its wrapping attribute, else None."""
    from ..ddp import DistributedDataParallel

    if part == _ORIG_MOD and isinstance(obj, torch._dynamo.eval_frame.OptimizedModule):
        return obj._orig_mod
    if part == "module" and isinstance(obj, (DistributedDataParallel, torch.nn.parallel.DistributedDataParallel)):
        return obj.module
    if part == _CHECKPOINT_WRAPPED:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

        if isinstance(obj, ActivationWrapper):
            return getattr(obj, _CHECKPOINT_WRAPPED)
    return None


def layers(model: torch.nn.Module) -> list:
    """``model`` and each module wrapped in it, down a stack of fusedist or torch DDP wrappers
    and ``torch.compile`` (``torch.compile(DistributedDataParallel(net))`` and the reverse)."""
    out = [model]
    while True:
        inner = _inner(out[-1], _ORIG_MOD) or _inner(out[-1], "module")
        if inner is None:
            return out
        out.append(inner)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare module inside the wrappers (:func:`layers`)."""
    return layers(model)[-1]


def canonical_key(root: torch.nn.Module, key: str) -> str:
    """``key`` of ``root``'s state dict (or a parameter name) without wrappers' segments, found
    by walking the module tree (a module whose name merely contains a wrapper's attribute keeps
    it)."""
    out, obj = [], root
    for part in key.split("."):
        inner = _inner(obj, part)
        if inner is not None:
            obj = inner
            continue
        out.append(part)
        obj = getattr(obj, part, None) if isinstance(obj, torch.nn.Module) else None
    return ".".join(out)


def canonical_state(root: torch.nn.Module, state: dict) -> dict:
    """``state`` (``root``'s state dict, or part of it) keyed by canonical names."""
    return type(state)((canonical_key(root, k), v) for k, v in state.items())


def own_keys(root: torch.nn.Module, keys: Iterable[str]) -> dict:
    """Canonical name -> ``root``'s own key, for the keys of its state dict."""
    return {canonical_key(root, k): k for k in keys}


def legacy_key(key: str) -> str:
    """A saved key as it is canonical now: without ``torch.compile``'s ``_orig_mod`` segments."""
    return ".".join(part for part in key.split(".") if part != _ORIG_MOD)


def strip_prefix(state: dict, expected) -> dict:
    """``state`` with canonical keys: without ``_orig_mod`` segments in keys the model does not
    know as they are (checkpoints of compiled models written before names were canonical), and
    without DDP's ``module.`` prefix when every key has it -- unless the keys are the model's
    own as they are: a model whose only child is called ``module`` saved keys that all start
    with it, and stripping them made its own checkpoint unloadable. ``expected`` may be part of
    the saved model (a pipeline stage's layers): one key of its own as it is tells."""
    state = type(state)((k if k in expected else legacy_key(k), v) for k, v in state.items())
    if has_ddp_prefix(list(state), expected):
        return type(state)((k[len(DDP_PREFIX):], v) for k, v in state.items())
    return state


DDP_PREFIX = "module."

# What to do with an optimizer's parameters its checkpoint does not hold: torch's
# load_state_dict refuses other param groups, and a group added after the load starts without state.
ADDED_AFTER_LOAD = ("param groups added since the save (add_param_group) are added after loading: load into the "
                    "optimizer as it was saved, then add them (they start without state)")


def has_ddp_prefix(names: list, expected) -> bool:
    """Whether every one of ``names`` (at least one) carries DDP's ``module.`` and none is a name
    of ``expected`` as it is (a model whose only child is called ``module``; ``expected`` may
    hold some of ``names`` only: a pipeline stage of that model, a load that is not strict)."""
    return bool(names) and all(n.startswith(DDP_PREFIX) for n in names) and not any(n in expected for n in names)


def unexpected_order(root, keys: list) -> list:
    """``keys`` (canonical names ``root`` does not hold) in the order torch's
    ``load_state_dict(strict=False)`` of ``root`` lists them as ``unexpected_keys``; ``root``: a
    module, or the module tree of one (:func:`module_tree`, :func:`merged_trees`).

    Note [the order of unexpected keys]
        torch walks the module tree depth first, and each module lists, in the state dict's
        order, the keys under its prefix whose next segment names none of its own entries
        (first an own ``_extra_state`` it has no ``set_extra_state`` for): a key is listed by
        the deepest module of ``root`` along its name, and a module's unexpected keys come
        before its submodules', whatever the saved order. Within one module the state dict's order is
        the checkpoint's, taken as a state dict orders a module tree: a module's own entries
        before its submodules', each submodule's together, in the order they first appear. A
        torch distributed checkpoint saved by several ranks reads its entries back spread over
        the ranks' files; its record of each rank's state dict (the planner data of a flattened
        save) gives them back in a rank's saved order (``_from_dcp.read``).
        Pipeline parts: no rank holds the whole model, so each rank sends the tree of its parts
        along the keys it does not load (:func:`module_tree`), and the trees of every part of the
        job are merged (:func:`merged_trees`): each part keeps the whole model's order of the
        modules it holds; modules of different parts under one parent (layers of two stages)
        come in the checkpoint's order. What no part tells -- the order of modules none holds,
        within one parent, saved by different stages -- is the checkpoint's."""
    tree = root if isinstance(root, dict) else module_tree(root, keys)
    first: dict = {}
    for i, key in enumerate(keys):
        parts = key.split(".")
        for j in range(1, len(parts) + 1):
            first.setdefault(tuple(parts[:j]), i)

    def place(key: str) -> tuple:
        path, parts = [], key.split(".")
        while len(parts) > len(path) + 1 and parts[len(path)] in tree.get(tuple(parts[:len(path)]), ()):
            path.append(tree[tuple(parts[:len(path)])].index(parts[len(path)]))
        below = range(len(path) + 1, len(parts) + 1)
        return tuple(path), parts[len(path):] != [_EXTRA_STATE], tuple((j < len(parts), first[tuple(parts[:j])])
                                                                     for j in below)

    return sorted(keys, key=place)


def missing_order(root, keys: list) -> list:
    """``keys`` (names the model holds) in the order torch's ``load_state_dict`` lists them as
    ``missing_keys``: depth first, a module's own before its submodules', each module's own in
    the order given (its state dict's); ``root`` as in :func:`unexpected_order`."""
    tree = root if isinstance(root, dict) else module_tree(root, keys)

    def place(item) -> tuple:
        path, parts = [], item[1].split(".")
        while len(parts) > len(path) + 1 and parts[len(path)] in tree.get(tuple(parts[:len(path)]), ()):
            path.append(tree[tuple(parts[:len(path)])].index(parts[len(path)]))
        return tuple(path), item[0]

    return [key for _, key in sorted(enumerate(keys), key=place)]


def module_tree(root: torch.nn.Module, keys: Iterable[str]) -> dict:
    """The modules of ``root`` along the names ``keys`` (canonical): ``{path: names of its
    submodules in order}``, the path a tuple of canonical segments (``()``: ``root``). Small and
    picklable: what a rank sends of its pipeline parts (Note [the order of unexpected keys])."""
    tree: dict = {}
    for key in keys:
        obj, parts = _bare(root), key.split(".")
        for depth in range(len(parts)):
            path = tuple(parts[:depth])
            if path not in tree:
                tree[path] = [name for name, child in obj._modules.items() if isinstance(child, torch.nn.Module)]
            child = obj._modules.get(parts[depth]) if depth + 1 < len(parts) else None
            if not isinstance(child, torch.nn.Module):
                break
            obj = _bare(child)
    return tree


def merged_trees(trees: list, keys: list) -> dict:
    """One module tree of the :func:`module_tree` of several parts of a model, each cut from the
    whole with the other layers removed: every part's order of the modules it holds is kept,
    and modules of different parts come in the order of ``keys`` (the checkpoint's; modules no
    key names last, by part)."""
    first: dict = {}
    for i, key in enumerate(keys):
        parts = key.split(".")
        for j in range(1, len(parts) + 1):
            first.setdefault(tuple(parts[:j]), i)
    out: dict = {}
    for path in dict.fromkeys(path for tree in trees for path in tree):
        orders = [tree[path] for tree in trees if path in tree]
        out[path] = _merged_order(orders, lambda name: first.get(path + (name,), len(keys)))
    return out


def _merged_order(orders: list, rank) -> list:
    """One order of the names of ``orders`` keeping each one's (a topological sort, ties by
    ``rank``, then by first sight); where they disagree the rest by ``rank``."""
    seen = list(dict.fromkeys(name for order in orders for name in order))
    position = {name: i for i, name in enumerate(seen)}
    waits = dict.fromkeys(seen, 0)
    follows: dict = {name: set() for name in seen}
    for order in orders:
        for before, name in zip(order, order[1:]):
            if name not in follows[before]:
                follows[before].add(name)
                waits[name] += 1
    ready = [(rank(n), position[n], n) for n in seen if not waits[n]]
    heapq.heapify(ready)
    out = []
    while ready:
        name = heapq.heappop(ready)[2]
        out.append(name)
        for other in follows[name]:
            waits[other] -= 1
            if not waits[other]:
                heapq.heappush(ready, (rank(other), position[other], other))
    done = set(out)
    return out + sorted((n for n in seen if n not in done), key=lambda n: (rank(n), position[n]))


def _bare(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` without the wrappers whose segments canonical names leave out."""
    while True:
        inner = _inner(module, _ORIG_MOD) or _inner(module, "module") or _inner(module, _CHECKPOINT_WRAPPED)
        if inner is None:
            return module
        module = inner
