"""The warning for SyncBatchNorm layers whose process group leaves this rank out.

Note [a rank outside the layer's group]
    torch.distributed.new_group is called by every rank, and returns a placeholder
    (GroupMember.NON_GROUP_MEMBER, world size -1) on the ranks it leaves out. A layer handed
    that placeholder -- ``convert_sync_batchnorm(model, groups[0])`` run on every rank, where
    the ranks outside ``groups[0]`` should have passed their own group -- is, in
    torch.nn.SyncBatchNorm, plain BatchNorm on the rank's own batch: it synchronizes only for
    a world size above one. This layer does the same (it used to refuse the forward, so
    models that train under torch's layer stopped at their first step), and warns once per
    process: the ranks outside the group then normalize over fewer samples than their
    group-mates, which is seldom what was meant.

    The mistake is made once for a whole model, so the one warning names every layer it
    affects, not only the first one to run: each layer is remembered when it is made (with
    its place in the model when ``convert_sync_batchnorm`` made it), and the warning lists
    the live layers whose group leaves the rank out -- the first few by name, then a count.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from typing import Optional

import torch
import torch.distributed as dist

# layer -> (creation order, its path in the model it was converted in, or None)
_layers: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[int, Optional[str]]]" = weakref.WeakKeyDictionary()
_order = itertools.count()
_warned = False
NAMES_SHOWN = 5  # enough to recognize the pattern; the count says how many more


def remember(layer: torch.nn.Module, path: Optional[str] = None) -> None:
    """Record ``layer`` for the warning, with its ``path`` in the converted model if known (a
    layer remembered before keeps its place in the order)."""
    try:
        order, known = _layers.get(layer, (None, None))
        _layers[layer] = (next(_order) if order is None else order, known if path is None else path)
    except TypeError:  # a subclass that made itself unhashable: left out of the list, not refused
        pass


def path_of(layer: torch.nn.Module) -> Optional[str]:
    try:
        return _layers.get(layer, (None, None))[1]
    except TypeError:
        return None


def leaves_rank_out(layer: torch.nn.Module) -> bool:
    """Whether ``layer``'s process group is torch's placeholder for a group this rank is not in."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        return dist.get_world_size(layer.process_group) < 0
    except (RuntimeError, ValueError):  # a group destroyed since, or not of this job
        return False


def _name(layer: torch.nn.Module, path: Optional[str]) -> str:
    if path is None:
        return f"SyncBatchNorm({layer.num_features})"
    return repr(path) if path else f"the converted module itself (SyncBatchNorm({layer.num_features}))"


def describe(rank: int, names: list) -> str:
    """The warning's text for the layers ``names`` (in order) on ``rank``."""
    shown = ", ".join(names[:NAMES_SHOWN])
    if len(names) > NAMES_SHOWN:
        shown += f" and {len(names) - NAMES_SHOWN} more"
    layers = "1 SyncBatchNorm layer" if len(names) == 1 else f"{len(names)} SyncBatchNorm layers"
    return (
        f"fusedist.nn.SyncBatchNorm: rank {rank} is not a member of the process_group of {layers} ({shown}), "
        "so they normalize with this rank's own batch statistics, as torch.nn.SyncBatchNorm does. To "
        "synchronize, give each rank a group that contains it (e.g. the first value of "
        "torch.distributed.new_subgroups(), or groups[i] for the group i holding this rank) when "
        "converting the model."
    )


def warn_once(layer: torch.nn.Module) -> None:
    """The once-per-process warning of Note [a rank outside the layer's group], raised by the
    first forward of ``layer`` (whose group leaves this rank out)."""
    global _warned
    if _warned:
        return
    _warned = True
    remember(layer)
    outside = sorted(((order, path, m) for m, (order, path) in list(_layers.items()) if leaves_rank_out(m)),
                     key=lambda entry: entry[0])
    names = [_name(m, path) for _, path, m in outside] or [_name(layer, None)]  # (an unhashable layer)
    warnings.warn(describe(dist.get_rank(), names), UserWarning, stacklevel=2)
