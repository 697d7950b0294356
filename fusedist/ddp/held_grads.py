"""Gradient tensors the user holds behave as torch DDP's default gradient tensors.

Note [gradients the user holds]
    With gradient views (fusedist's default) ``p.grad`` is a slot of its bucket's storage: no
    copy between the gradient and the bucket, and no second copy of every gradient. torch's DDP
    defaults to ``gradient_as_bucket_view=False``, where each ``p.grad`` is a tensor of its own.
    Code written for that default saw plain autograd views of the bucket differ (as torch's
    own ``True`` still does):

    * a gradient kept across ``zero_grad()`` (a logger's ``g = p.grad``; set to None in between)
      keeps its values under torch, where the slot it shared was overwritten by the next backward;
    * one assigned by hand (``p.grad = t`` before the backward) stays ``p.grad`` and receives the
      average under torch, where the bucket view replaced it;
    * ``p.grad.detach_()`` raised (a view cannot be detached in place), and ``p.grad._base`` was set.

    A tensor nobody else holds is invisible: it is either ``p.grad`` or gone. So the views stay
    on the common path and only a held one is treated as torch treats its own:

    * the slots are not autograd views but tensors set onto the bucket's storage
      (``layout.alias_of``): no ``_base``, ``detach_()`` and ``requires_grad_()`` work;
    * as a backward begins, a slot tensor held by someone (its reference count above the slot's
      own) that is no longer ``p.grad`` is moved onto a copy of its values, the slot cut anew
      (``detach_kept_slots``): the backward's gradient and the bucket's collective write into
      the new slot, the kept tensor keeps its values (memory for that gradient only, only then);
    * a gradient the hook finds held by someone besides ``p.grad`` (assigned by hand) stays
      ``p.grad``: its values go into the slot as before, and once the buckets are averaged the
      average is copied back into it (``give_back_averages``), as torch's default copies it.
    * a slot tensor moved off the bucket (``p.grad.data = t``, ``p.grad.set_(t)``: ``Module._apply``
      does it, so does code that "detaches" a gradient by hand) would have taken autograd's
      accumulation, or the hook's copy, where the bucket's collective never looks: the slot
      remembers the address it was cut at (``ParamSlot.ptr``), and the hook (on the copy path,
      which reads the address anyway), this scan (where the slot is still ``p.grad``) and
      ``GradLayout.grad_view`` cut it anew on the bucket (``GradLayout.recut``); the moved tensor
      keeps ``t``'s memory and stays ``p.grad``, given each average as a gradient assigned by hand
      (the reducer holds it while it is ``p.grad``: ``moved_grads``), so ``t`` itself receives the
      averages, as under torch's default, where ``p.grad`` keeps ``t``'s memory;
    * a communication hook's ``bucket.gradients()`` are views of the bucket, as torch's, not the
      slot tensors: a hook keeping them across steps sees the buffer and holds no gradient.
    * the buckets' rebuild (after the first synchronized backward) moves each slot tensor that is
      ``p.grad`` onto its new slot (``rebucket.switch_layout``), not a new tensor: gradients cached
      after a first ``no_sync`` backward stay ``p.grad``, as torch's default ones.

    The counts are measured on this interpreter (``SLOT_IDLE``, ``GRAD_IDLE``), not assumed:
    CPython's count of a local, and torch's one reference from C++ holders (``p.grad``), are what
    they compare with. The cost on the common path: a reference count per slot as each backward
    begins (and a ``p.grad`` read and an address where the slot is still ``p.grad``: no ``zero_grad``
    to None), and one per fresh gradient in the hook; on a loaded 2-core CPU, 200 parameters: 9-14 us
    per backward after ``zero_grad()``, 40-85 us where every slot is still ``p.grad``.
    What stays different: a gradient's ``untyped_storage()`` is the gradient buffer it is a slot of
    (every gradient of its dtype; its bucket with per-bucket storage), so ``torch.save`` of a
    gradient alone writes all of them (torch's ``True`` writes its bucket): save ``p.grad.clone()``.
"""

from __future__ import annotations

import sys
import weakref

import torch

from .layout import alias_of

_refs = sys.getrefcount

#: reducer -> {parameter: its p.grad moved off its bucket by ``p.grad.data = t``}: held while it is
#: ``p.grad``, so the gradient hook counts it as the user's (it stays ``p.grad``, given the average).
moved_grads: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _Slot:
    __slots__ = ("view",)


def _slot_idle_count() -> int:
    """The reference count ``detach_kept_slots`` reads for a slot tensor nobody else holds."""
    slot = _Slot()
    slot.view = torch.empty(0)
    view = slot.view
    return _refs(view)


def _grad_idle_count() -> int:
    """The reference count the gradient hook reads for a ``p.grad`` only the parameter holds."""
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.zeros(1)
    grad = p.grad
    return _refs(grad)


SLOT_IDLE = _slot_idle_count()
GRAD_IDLE = _grad_idle_count()


def grad_held_elsewhere(grad: torch.Tensor) -> bool:
    """Whether ``grad`` (read as ``grad = p.grad`` by the caller) is held beyond ``p.grad``."""
    return _refs(grad) > GRAD_IDLE + 1  # (+1: the caller's argument to this function)


def detach_kept_slots(reducer) -> None:
    """As a backward begins: move each slot tensor kept by someone while it is no longer
    ``p.grad`` onto a copy of its values, and cut its slot anew (Note [gradients the user holds])."""
    layout = reducer.layout
    moved = moved_grads.get(reducer)
    if moved:  # a moved gradient no longer p.grad (zero_grad, another assigned) is nobody's concern here
        for p in [p for p, grad in moved.items() if p.grad is not grad or p not in layout.slots]:
            del moved[p]
    kept = []
    for p, slot in layout.slots.items():
        view = slot.view
        if view is not None and _refs(view) > SLOT_IDLE:  # (p.grad, a C++ holder, counts one while it is the slot)
            if p.grad is not view:
                kept.append((p, slot, view))
            elif view.data_ptr() != slot.ptr:  # moved off the bucket by p.grad.data = t: it stays p.grad on t's
                layout.recut(p)  # memory, given the averages; the bucket gets a slot of its own again
                moved_grads.setdefault(reducer, {})[p] = view
    if not kept:
        return
    with torch.no_grad():
        for _, slot, view in kept:
            slot.view = alias_of(view)  # the slot, a new tensor on the bucket's memory
            view.set_(view.clone())  # the holder's tensor, now on memory of its own


def give_back_averages(reducer) -> None:
    """After the buckets are averaged: copy each averaged slot into the gradient the user held
    (``reducer.own_grads``), which stays ``p.grad`` (Note [gradients the user holds])."""
    layout = reducer.layout
    for p in reducer.own_grads:
        slot = layout.slots.get(p)
        grad = p.grad
        if slot is None or slot.view is None or grad is None or grad.data_ptr() == slot.view.data_ptr():
            continue
        grad.copy_(slot.view)
    reducer.own_grads = []
