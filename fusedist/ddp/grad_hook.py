"""The per-parameter gradient hook of the reducer and the bookkeeping it reads.

Note [per-parameter cost]
    A gradient hook runs once per parameter per backward, so with many small tensors its
    Python cost is what separates this reducer from torch's C++ one. The hook is a closure
    registered with ``register_post_accumulate_grad_hook`` (measured cheaper than a
    ``functools.partial``, a callable object, or a hook on the AccumulateGrad node) that
    holds only a weak reference to the reducer and an integer key; the key finds the
    parameter's ``ParamEntry``, which holds what the hook needs: its layout slot (bucket and
    gradient view, the view cut once per bucket allocation in ``layout.py``), its position,
    and the number of the last backward that delivered its gradient. So the hook does no
    dictionary or set lookup keyed by the parameter (hashing a tensor is a Python call), no
    view slicing, and runs in one Python frame: it calls nothing else unless a bucket became
    ready or a launched one may have completed. Readiness is a per-bucket counter; "received
    twice" compares the entry's stamp with the backward's number, and the end of backward
    looks for missing gradients only if a bucket's count is not down to zero. The entries
    follow every change of the layout, the parameter list and the inactive set
    (``Reducer._refresh_entries``); the hook itself never changes and holds nothing that leads back
    to the model, so dropping the wrapper frees it (the hooks go with the reducer).

Note [fresh gradient freed before the launch]
    With gradient views, a fresh gradient (autograd's own tensor, after
    ``zero_grad(set_to_none=True)``) is dead once it is copied into its bucket view and
    ``p.grad`` points at the view; the hook drops its local reference right there, before a
    bucket that became ready is launched, as torch's reducer replaces the gradient by its
    bucket view before it marks the bucket ready. Why it matters on CPU: every Linear(1536)
    weight gradient is a 9 MB block from glibc's heap, and whether the next layer's gradient
    reuses the freed block or the heap grows (and is trimmed again later, so its pages fault
    in afresh every step) depends on what else was allocated while the block was live --
    held until the hook returned, it was live across the launch's own allocations. Measured
    on bench_ddp's MLP row (2 ranks, 15 steps after the warm-up, minor faults per step and
    rank, one value per rank and launch, pooled over four runs): 4,670 on average (19
    launches) against 5,660 when held to the end of the hook (15 launches); torch DDP with
    bucket views 4,850 (15 launches). The heap's state differs from process to process (335
    to 9,200 faults per step, and one run of 4 launches averaged 5,670 with the early drop),
    so this lowers the average, not every run. No value changes: the copy has happened.

Note [gradient hooks under a compiled caller]
    A ``loss.backward()`` inside a compiled function (``torch.compile`` of a whole training
    step: forward, backward, ``optimizer.step()``) breaks dynamo's graph, and the backward
    runs eagerly -- but under dynamo's frame hook, so every Python hook autograd calls is
    compiled as a frame of its own. The gradient hook was traced, recompiled per parameter
    (its key) and, with the end-of-backward callback, traced into the communicator, which
    dynamo cannot trace: the first step failed on every rank ("Attempted to access
    unregistered member on an OpaqueObject"), where torch's DDP (whose reducer is C++) trains.
    So the hook and the callback run eagerly whoever calls them. The callback is
    ``torch.compiler.disable``-d. The hook was too, but that wrapper swaps dynamo's frame
    hook out and back on every call: ~0.8 us per gradient in a backward on a 2-core CPU
    (0.15-0.2 ms of a step's 3.9 ms CPU time with 200 tiny parameters, the step 1.08x torch
    DDP's against 1.03x without it). So the hook's code is on dynamo's skip list instead (its
    own frame is never traced), and only when dynamo's frame hook is set -- a compiled
    caller -- does it call itself again through the disabled wrapper, so that nothing it
    calls is traced either. Without a compiled caller that costs one C call.

Note [the user's gradient hooks first]
    torch's DDP reduces a gradient in a hook on the parameter's AccumulateGrad node, which
    runs after all of the parameter's post-accumulate-grad hooks: a hook the user registers
    (``p.register_post_accumulate_grad_hook``), before or after wrapping, sees the local
    gradient, and what it does to ``p.grad`` in place (scaling, clipping, adding noise) is
    part of what is averaged. The reducer's hook is a post-accumulate-grad hook itself, and
    torch runs those in the order they were registered, so a user's hook registered after
    wrapping ran after the reducer had copied the gradient and possibly launched its bucket:
    its change was lost (overwritten by the average, without gradient views) or raced the
    collective in flight, and the ranks stepped with neither torch's gradients nor their own.
    So every training forward puts the reducer's hook last again where a hook was registered
    since (``hooks_last``: torch's hook-handle counter tells whether any hook was registered
    at all; torch calls the hooks in the dicts' insertion order, hence pop and re-insert).

Note [gradients moved during the backward]
    ``p.grad.data = t`` in a post-accumulate-grad hook of the user's, which runs before this one
    (Note [the user's gradient hooks first]): under torch's DDP ``p.grad`` keeps ``t``'s memory and
    ``t`` receives the average of what the ranks' ``t`` held. Two cases reach the hook:

    * ``p.grad`` is still the slot tensor (kept from the last backward, autograd accumulated into
      it): it sits off the bucket now. The hook reads the slot's address on this path too, cuts
      the slot anew (``moved_during_backward``), copies ``t``'s values in and holds the tensor as a
      moved gradient (``held_grads.moved_grads``), which stays ``p.grad`` and receives the
      average. It was taken as accumulated in place: the bucket averaged autograd's values and
      ``t`` kept this rank's own, so the ranks stepped apart.
    * ``p.grad`` is autograd's fresh tensor (after ``zero_grad()``), now on ``t``'s memory: nobody
      holds that tensor, but its memory has another user, so it is kept as a gradient the user
      holds (stays ``p.grad``, given the average) where ``p.grad`` was replaced by the slot. The
      use count of the memory tells it, where the memory is the gradient's size: a gradient autograd
      cut from a larger one (``torch.cat`` of parameters: each one's gradient a slice of the same
      memory, not flagged as a view) keeps the bucket's slot and its memory, as before; so does a
      ``t`` that is a slice of a larger buffer of the user's (not told from those).

    Cost, on a loaded 2-core CPU: one use count of the memory per fresh gradient (0.3 us) and one
    address per gradient accumulated in place (0.12 us).
"""

from __future__ import annotations

import sys
import time
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .reducer import Reducer

import torch
from torch.utils.hooks import RemovableHandle

from .held_grads import GRAD_IDLE, moved_grads
from .static_graph import arrived_again

_perf_counter = time.perf_counter
_refs = sys.getrefcount
_mul = torch.mul
_frame_hook = torch._C._dynamo.eval_frame.get_eval_frame_callback
_storage_uses = getattr(torch._C, "_storage_Use_Count", None)  # (absent: the check is skipped, as before it)


def _skip_code(code) -> None:
    """Keep dynamo from tracing frames of ``code`` (imported late: dynamo is heavy)."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(code)


class ParamEntry:
    """A hooked parameter's bookkeeping (Note [per-parameter cost]). ``slot``: its layout
    slot, None when the buckets do not reduce it; ``index``: its position in
    ``Reducer.params`` (-1 outside); ``ready``: the number of the last backward that
    delivered its gradient (synchronized backwards only); ``accumulated``: the same for
    ``no_sync`` backwards (a gradient accumulated there counts as used by the next
    synchronized backward, Note [unused parameters] in unused.py)."""

    __slots__ = ("slot", "index", "ready", "accumulated")

    def __init__(self):
        self.slot = None
        self.index = -1
        self.ready = 0
        self.accumulated = 0


def make_hook(reducer_ref: "weakref.ref[Reducer]", key: int):
    """The gradient hook of the parameter whose entry is ``_hook_entries[key]``: a closure
    over a weak reference and an int, so it keeps nothing alive, and one Python frame per
    gradient on the common path (Note [per-parameter cost]: keep it lean). Disabled for
    dynamo (Note [gradient hooks under a compiled caller])."""

    def grad_ready(p) -> None:
        if _frame_hook() is not None:  # Note [gradient hooks under a compiled caller]
            return eager(p)
        self = reducer_ref()
        if self is None:
            return
        if not self.in_backward:
            self._begin_backward()
        entry = self._hook_entries[key]
        slot = entry.slot
        if slot is None:
            return  # not reduced by the buckets: trainable since the last layout, or frozen
        grad = p.grad
        view = slot.view
        if view is None:  # per-bucket storage: allocated when its first gradient arrives
            self._layout.allocate(slot.bucket)
            view = slot.view
        bucket = slot.bucket
        fresh = grad is not view
        if fresh:
            if grad is None:  # frozen after the forward: autograd accumulated nothing (torch's DDP
                if p.requires_grad:  # leaves it None too); the end of backward handles it as unused
                    raise gradient_taken(self, entry)
                return
            if grad.is_sparse:
                raise self._sparse_gradient(entry)
            at = view.data_ptr()
            if at != slot.ptr:  # the slot's tensor moved off the bucket (p.grad.data = t): Note [gradients
                view = self._layout.recut(p)  # the user holds] (held_grads.py)
                at = slot.ptr
            fresh = grad.data_ptr() != at
        elif view.data_ptr() != slot.ptr:  # Note [gradients moved during the backward]
            view = moved_during_backward(self, p, grad)
            fresh = True
        if fresh:
            # A fresh gradient tensor (zero_grad(set_to_none=True), or gradient views
            # disabled): it holds this parameter's whole gradient, so copy, don't add, and
            # scale on the way when the bucket folds its division (Note [division folded
            # into the copy] in strategy.py).
            if bucket.fold is None:
                view.copy_(grad)
            else:
                _mul(grad, bucket.fold, out=view)
            if self.as_view:
                # held besides p.grad, or on memory another tensor holds (Note [gradients the user holds] in
                # held_grads.py, Note [gradients moved during the backward]): stays p.grad, given the average
                if _refs(grad) > GRAD_IDLE or _on_memory_of_another(grad):
                    self.own_grads.append(p)
                else:
                    try:
                        p.grad = view
                    except RuntimeError as exc:  # the parameter is no longer what the buffers hold
                        raise self.converted_after_wrapping(self.names[entry.index], p, view.dtype,
                                                            view.device) from exc
                    # Note [fresh gradient freed before the launch]: drop the last reference now.
                    grad = None
        elif bucket.fold is not None:
            bucket.unfolded.append(view)  # accumulated in place: still to be divided at launch
        self.t_last_grad = _perf_counter()
        if self._observed_order is not None:
            self._observed_order.append(entry.index)
        if not self.sync:
            entry.accumulated = self.generation
            return
        generation = self.generation
        if entry.ready == generation:  # Note [gradients that arrive twice]
            if not arrived_again(self, entry, p):
                return
        else:
            entry.ready = generation
        index = bucket.index
        pending = self.pending
        pending[index] -= 1
        if pending[index] == 0 and not self.defer_launch:
            self._bucket_ready(index)
        if self.next_finish < self.next_launch:
            self._finish_completed()

    eager = torch.compiler.disable(grad_ready)
    _skip_code(grad_ready.__code__)  # one code object for every parameter's hook
    return grad_ready


def moved_during_backward(reducer: "Reducer", p, grad: torch.Tensor) -> torch.Tensor:
    """``p``'s slot cut anew on its bucket after ``p.grad.data = t`` during the backward; ``grad``
    (on ``t``'s memory) held as a moved gradient, which stays ``p.grad`` and receives the average
    (Note [gradients moved during the backward]); the caller copies its values into the new slot."""
    view = reducer._layout.recut(p)
    moved_grads.setdefault(reducer, {})[p] = grad
    return view


def _on_memory_of_another(grad: torch.Tensor) -> bool:
    """Whether a fresh gradient lies on memory of its own size another tensor holds too: ``t`` of a
    ``p.grad.data = t`` in a hook during the backward (Note [gradients moved during the backward]).
    A gradient autograd cut from a larger one (``torch.cat`` of parameters) lies on more memory than
    its own and is not taken for one: it is handed the bucket's slot, as before."""
    if _storage_uses is None:
        return False
    storage = grad.untyped_storage()
    return storage.nbytes() == grad.numel() * grad.element_size() and _storage_uses(storage._cdata) > _STORAGE_IDLE


def _storage_idle_count() -> int:
    """The use count of a tensor's memory that the hook reads for a fresh gradient alone on its
    memory (Note [gradients moved during the backward]), measured as the hook reads it."""
    alone = torch.zeros(1)
    return _storage_uses(alone.untyped_storage()._cdata)


def gradient_taken(reducer: "Reducer", entry: ParamEntry) -> RuntimeError:
    """The error for a trainable parameter whose gradient was gone when the reducer's hook ran:
    autograd had accumulated it, so a hook of the user's, which runs first (Note [the user's
    gradient hooks first]), set ``p.grad = None`` -- typically an optimizer stepped in backward
    and zeroed it. That step used this rank's local gradient; reported as an unused parameter,
    the advice to pass find_unused_parameters=True pointed the wrong way."""
    return RuntimeError(
        f"fusedist DDP (rank {reducer.comm.rank}): the gradient of parameter '{reducer.names[entry.index]}' "
        "was set to None by a post-accumulate-grad hook before DistributedDataParallel averaged it "
        "(an optimizer stepping inside backward, then zero_grad()?). Such hooks run before the "
        "average, as with torch's DDP, so a step there uses this rank's local gradient and the ranks "
        "diverge: call optimizer.step() after loss.backward() returns, or give the parameters their "
        "optimizers with torch.distributed.optim._apply_optimizer_in_backward before the first forward "
        "(stepped once the average has landed, as by torch's DDP)"
    )


_STORAGE_IDLE = _storage_idle_count() if _storage_uses is not None else 0


def remove_hooks(handles) -> None:
    for handle in handles:
        handle.remove()


def hooks_last(handles, hook_dicts, ordered: int) -> int:
    """Move each of ``handles`` (the reducer's hooks, one per parameter; ``hook_dicts`` the
    parameters' post-accumulate-grad hook dicts, aligned) behind the hooks registered after it
    (Note [the user's gradient hooks first]). ``ordered``: torch's hook-handle counter when
    they were last put in order (-1: never); returns the counter now. Every hook registered
    anywhere takes the next number of that counter, so an unchanged counter means that no
    hook was registered since, at no per-parameter cost; a removed one leaves the order
    right. (The dicts' total size, compared before, missed a hook removed and another added.)"""
    if RemovableHandle.next_id == ordered:
        return ordered
    for handle, hooks in zip(handles, hook_dicts):
        key = handle.id
        if key in hooks and next(reversed(hooks)) != key:
            hooks[key] = hooks.pop(key)  # re-inserted: called last
    return RemovableHandle.next_id


def still_in_order(ordered: int, before: int) -> int:
    """The ``ordered`` mark of :func:`hooks_last` after the wrapper registered hooks of its
    own (on a forward's outputs, none on parameters) while the counter stood at ``before``:
    they need no reordering, so a mark that was current stays current."""
    return RemovableHandle.next_id if ordered == before else ordered
