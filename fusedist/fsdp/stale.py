"""Gathered copies of units that an optimizer step has made stale.

Note [gathered copies and the optimizer step]
    The optimizer steps a unit's pieces (Note [sharded parameters] in unit.py); a gathered
    copy of the unit made before the step still holds the old values, and the next forward
    would use it, since a unit that is gathered is not gathered again. Normally nothing is
    gathered at a step: units reshard after backward. But ``set_reshard_after_backward(False)``
    (gradient accumulation without regathering), ``reshard_after_forward=False`` (or the
    root under ``None``) after a forward outside backward -- an evaluation under ``no_grad``
    too (Note [forward without gradients] in state.py) -- or an explicit ``unshard()`` leave a unit gathered across
    ``optimizer.step()``, and training then silently runs the pre-step parameters (torch's
    FSDP2 does). So a global optimizer post-step hook reshards every gathered unit whose pieces
    the optimizer holds; the next forward gathers the stepped values. A hook rather than the
    pieces' version counters: fused optimizers write parameters without bumping them. A
    unit in the middle of its own forward or backward (an optimizer stepped from a hook) is
    left alone then, and resharded when its root's backward ends (``reshard_stepped``): an
    optimizer stepped from a gradient hook once a unit's reduction landed (optimizer in
    backward) under ``set_reshard_after_backward(False)`` left the gathered copy stale for the
    next forward. Writes to the pieces outside an optimizer (``p.mul_()`` under ``no_grad``
    while the unit is gathered) are not seen: reshard the unit first.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["note_gathered", "note_resharded", "install", "reshard_stepped"]

#: units gathered or being gathered now
_GATHERED: "weakref.WeakSet" = weakref.WeakSet()
#: gathered units whose pieces an optimizer stepped while their root was busy
_STEPPED_WHILE_BUSY: "weakref.WeakSet" = weakref.WeakSet()


def note_gathered(unit) -> None:
    _GATHERED.add(unit)


def note_resharded(unit) -> None:
    _GATHERED.discard(unit)
    _STEPPED_WHILE_BUSY.discard(unit)


@torch.compiler.disable  # a global step hook (as optim_state._before_step): runs eagerly between graphs
def _after_step(optimizer, args, kwargs) -> None:
    if not _GATHERED:
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for unit in list(_GATHERED):
        if any(id(sp) in held for sp in unit.sharded):
            if unit.busy():
                _STEPPED_WHILE_BUSY.add(unit)
            else:
                unit.reshard()


def reshard_stepped(units) -> None:
    """Reshard those of ``units`` (a root's, its backward over) an optimizer stepped while they
    were busy and that are still gathered (Note [gathered copies and the optimizer step])."""
    for unit in units:
        if unit in _STEPPED_WHILE_BUSY:
            _STEPPED_WHILE_BUSY.discard(unit)
            if unit.is_unsharded:
                unit.reshard()


def install() -> None:
    """The global post-step hook, once per process (fusedist/_process_hooks.py)."""
    from .._process_hooks import install_optimizer_step_hooks

    install_optimizer_step_hooks("fully_shard: stale gathered units", lambda *_: None, _after_step)
