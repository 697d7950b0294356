"""Parameters converted to another memory format after wrapping (``model.to(memory_format=...)``).

Note [memory format changed after wrapping]
    ``Module._apply`` converts a parameter's gradient along with the parameter, in place of its
    data: ``p.grad.data = converted``. With gradient views ``p.grad`` is the parameter's bucket
    view, so after ``model.to(memory_format=torch.channels_last)`` that view object looks at a
    fresh tensor: the next backward accumulated into it, the bucket kept the previous step's
    values, and every rank stepped with its own gradient, or with a stale average, without an
    error. torch's DDP trains wrongly there too (checked against one process on the global
    batch: with ``gradient_as_bucket_view=False`` even a conversion before the first backward
    goes wrong), so the reference is the single-process model.

    Every training forward looks at one parameter per bucket that a memory-format conversion
    changes (4-D or 5-D, not laid out the same in both formats): a whole-module conversion
    changes them all, so one look per bucket finds it (as ``converted_param`` does for dtypes),
    at no per-parameter cost. When a view no longer points into its bucket, each such slot is
    cut again on the bucket storage and keeps the values the old tensor held (a ``no_sync``
    accumulation, zeros); that tensor, still ``p.grad``, is moved onto the new slot rather than
    replaced, so a reference to ``p.grad`` held across the conversion (an optimizer's, a
    logger's) stays the gradient, as under torch. A tensor moved in its slot's own order is no
    conversion but ``p.grad.data = t`` by hand: it keeps ``t``'s memory and receives the averages
    (Note [gradients the user holds] in held_grads.py).

    The slots keep the element order recorded when the buckets were cut (Note [slot order
    fixed at bucketing] in layout.py: the ranks agreed on it and ZeRO's shards follow it), so
    once the layout is final a converted parameter's slot keeps the old strides (so does its
    ``.grad`` with gradient views) and each gradient is copied across layouts: values are
    right, the copy costs time. A warning says so once per model, as torch's DDP warns about
    gradient strides; converting before wrapping (or before the first backward, whose rebuilt
    layout follows the parameters) avoids it.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from .layout import slot_geometry


# layout -> [(bucket, parameter, its slot, its slot's strides, its name)] of the parameters looked
# at (Note [memory format changed after wrapping]); weak: a rebuilt layout drops its entry.
_probes: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_warned: "weakref.WeakSet" = weakref.WeakSet()  # reducers that warned about copies across layouts


def _format_sensitive(p: torch.Tensor) -> bool:
    """Whether ``.to(memory_format=...)`` gives ``p`` new data in at least one of the two formats."""
    if p.dim() == 4:
        fmt = torch.channels_last
    elif p.dim() == 5:
        fmt = torch.channels_last_3d
    else:
        return False
    return not (p.is_contiguous() and p.is_contiguous(memory_format=fmt))


def _probes_of(layout) -> list:
    probes = _probes.get(layout)
    if probes is None:
        probes = []
        for bucket in layout.buckets:
            i = next((i for i, q in enumerate(bucket.params) if _format_sensitive(q)), None)
            if i is not None:
                p = bucket.params[i]
                shape, strides = bucket.orders[i]
                probes.append((bucket, p, layout.slots[p], strides or _row_major(shape), bucket.names[i]))
        _probes[layout] = probes
    return probes


def _row_major(shape) -> tuple:
    """The strides of a row-major tensor of ``shape`` (what a slot recorded as row-major is cut with)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _detached(view, bucket, slot) -> bool:
    """Whether ``view`` (a slot's gradient view) no longer points into its bucket."""
    data = bucket.data
    expected = data.data_ptr() + (slot.offset - bucket.start) * data.element_size()
    return view.data_ptr() != expected


def check_memory_format(reducer) -> None:
    """Called by every training forward (Note [memory format changed after wrapping])."""
    layout = reducer.layout
    warn = reducer.layout_final and reducer not in _warned
    for bucket, p, slot, strides, name in _probes_of(layout):
        view = slot.view
        if view is not None and _detached(view, bucket, slot):
            reattach_views(reducer)
        if warn and p.stride() != strides:
            warn = False
            _warned.add(reducer)
            warnings.warn(
                f"fusedist DDP (rank {reducer.comm.rank}): parameter '{name}' changed memory format after "
                f"the gradient buckets were laid out (strides {tuple(p.stride())}, its bucket slot's "
                f"{strides}): each backward copies its gradient between the two layouts "
                "(with gradient_as_bucket_view=True, its .grad keeps the slot's strides). Values are "
                "unaffected; convert the model (model.to(memory_format=...)) before wrapping it to avoid the copies",
                stacklevel=4,
            )


def _laid_out_as_slot(tensor, p, record) -> bool:
    """Whether ``tensor`` has the shape and strides of ``p``'s slot: moved by ``p.grad.data = t``
    rather than by a conversion, which changes the strides, it keeps ``t``'s memory as under torch."""
    shape, strides = slot_geometry(p, record)
    return tuple(tensor.shape) == shape and tuple(tensor.stride()) == (strides or _row_major(shape))


@torch.no_grad()
def reattach_views(reducer) -> None:
    """Cut each gradient slot again where its tensor no longer points into its bucket, carrying
    the values it held; the moved tensor, where it is ``p.grad``, goes back onto the new slot (the
    same object, as torch keeps ``p.grad``: a reference an optimizer holds sees the next averages)."""
    layout = reducer.layout
    for bucket in layout.buckets:
        if bucket.data is None:
            continue
        for p, record in zip(bucket.params, bucket.orders):
            slot = layout.slots[p]
            old = slot.view
            if old is None or not _detached(old, bucket, slot) or _laid_out_as_slot(old, p, record):
                continue  # (one moved in its slot's order is no conversion: Note [gradients the user holds])
            view = layout.recut(p)
            view.copy_(old)
            if p.grad is old:
                old.set_(view)
                slot.view = old
