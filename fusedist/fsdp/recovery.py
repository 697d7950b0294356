"""Forwards and backwards that an exception ended midway: how the next forward tells, and
what it drops (the hooks that call this live in ``state.py``).

Note [aborted backward]
    A backward that raises midway -- an error in a module's backward, a ``KeyboardInterrupt``
    or other exception from a hook -- never runs the callback that ends it: autograd drops
    queued callbacks when the graph task fails. Its bookkeeping would stay "in backward",
    and the next forward would take itself for an activation-checkpointing recompute (no
    step counted, outputs not hooked, no final callback queued for the next backward), so
    the next step's gradients would silently stay unreduced -- torch's FSDP2 behaves so
    unless ``reset_iter_state()`` is called. A recompute runs inside a graph task of the
    autograd engine; a forward outside any while a backward is marked running can only
    follow an aborted one. So such a forward first does what ``reset_iter_state`` does
    (with a warning naming the module): the aborted iteration's gradients are dropped, the
    step watch leaves its backward (``ShardedStepWatch.backward_aborted``), and the step
    runs and is counted as any other. Every rank must have aborted alike (collectives pair
    up by order), as for ``reset_iter_state``.


Note [aborted forward]
    A forward that raises (user code in a unit, an OOM caught to skip the batch) never runs
    the root's post-hook: the iteration stays "in forward", units it gathered stay gathered,
    and its post-forward records stay. The next root forward would then continue that
    half-recorded iteration: not counted by the step watch (one forward low), its check's
    verdict not read, its implicit prefetch order mixed with the aborted one's, and the
    stale-unit reshard after ``optimizer.step()`` skipped as if a forward were running. A
    root forward may legitimately begin inside the running one (``forward`` called from a
    method registered with ``register_fsdp_forward_method``), so the root's pre-hook records
    the frame that called it -- alive exactly as long as that module call -- and a root
    forward that begins while the recorded one is no longer on the stack follows an aborted
    one. It then drops what the aborted forward started (with a warning naming the module):
    every unit reshards, the post-forward records go; gradients of earlier backwards stay
    (a ``set_requires_gradient_sync(False)`` accumulation continues, as FSDP2's does without
    ``reset_iter_state``). The forward that follows is counted as any other; the aborted
    one was counted when it began, as after ``reset_iter_state``. Until then the same frame
    test, over every thread's stack, tells the optimizer's post-step hook that no forward is
    running (``is_running``), so a step in between reshards what the aborted forward left
    gathered (Note [gathered copies and the optimizer step]).

    A group of modules as the root (``fully_shard([body, head])`` called from a plain parent)
    begins its forward at its first member's call, whose frame is gone when the parent calls
    the next member: that member continues the group call (``later_group_member``), it
    follows no aborted forward. Taken for one, each later member warned, dropped the group's
    bookkeeping and gathered the unit again; FSDP2 runs such a group without a word.

Note [aborted standalone call]
    A unit called on its own, outside the root's forward (an encoder run alone, a layer probed
    in evaluation), whose forward raises never runs its post-hook either: it stayed gathered,
    and counted as still running its forward, so its next calls never resharded after forward
    and ``reshard()`` took itself for a call from inside that forward and did nothing -- the
    memory came back only at the end of the next root forward. FSDP2 leaves it gathered until
    the unit's next call. No root forward is there to recover it, so a hook that runs after
    every call (``always_call``) unwinds such a call at once: the call ends and the unit
    reshards, whatever ``reshard_after_forward`` says (no backward will read what it gathered),
    as the recovery of an aborted root forward reshards every unit. Inside a running root
    forward the call is left to Note [aborted forward], which has the iteration to reset.

Note [reset during forward or backward]
    ``reset_iter_state()`` is for after an exception, between iterations. Called while the
    root's forward runs (from a hook or a submodule) it resharded every unit under the running
    forward: the rest of it computed with this rank's pieces -- silently, where their shapes
    fit (a head's output of this rank's rows, a loss and a backward that "worked"), where
    FSDP2 fails on the mix of tensors and DTensors. Called from a hook of the running
    backward, it freed the parameters the rest of that backward reads and dropped the
    reductions in flight, failing with a storage error. Both are refused, naming the call
    and when to make it; the forward or backward then fails on that error, and the next
    forward recovers from it as from any other (Notes [aborted forward] and [aborted
    backward]). A forward that an exception ended is no longer on the stack, and an aborted
    backward's graph task is over, so the documented use after an exception is unchanged.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch


def hook_caller():
    """The frame that called the forward hook running now -- ``Module._call_impl``'s, or the
    wrapper of a method registered with ``register_fsdp_forward_method`` -- past the hook's
    file, this one and ``torch.compiler.disable``'s wrapper: it lives exactly as long as the
    module call. (Files as the code objects name them, which is how the frames name them too.)"""
    f = sys._getframe(1)
    skip = {hook_caller.__code__.co_filename, f.f_code.co_filename}
    dynamo = os.path.dirname(torch._dynamo.eval_frame.innermost_fn.__code__.co_filename)
    while f is not None and (f.f_code.co_filename in skip or f.f_code.co_filename.startswith(dynamo)):
        f = f.f_back
    return f


def in_autograd_backward() -> bool:
    """Whether this code runs inside a graph task of the autograd engine (a backward)."""
    return torch._C._current_graph_task_id() != -1


def forward_is_live(ctx) -> bool:
    """Whether the root forward ``ctx`` began is still running (this call is nested in it, e.g.
    ``forward`` inside a method registered with ``register_fsdp_forward_method``) rather than
    ended by an exception (Note [aborted forward])."""
    frame, f = ctx._forward_frame, sys._getframe(1)
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return frame is None


def later_group_member(state, module) -> bool:
    """Whether ``module`` continues ``state``'s group call in progress: a member not run yet of a
    call some member has finished (Note [a list of modules as one unit] in members.py; Note
    [aborted forward])."""
    pending = state._group_pending
    return id(module) in pending and len(pending) < len(state.modules)


def is_running(ctx) -> bool:
    """Whether a forward or backward under ``ctx``'s root may be running now, in any thread: a
    forward that raised midway (marked running still, until the next forward drops it) is not.
    A backward marked running counts as running (an optimizer may step in another thread while
    it runs; one that raised is dropped by the next forward)."""
    if ctx.backward_running:
        return True
    if not ctx.in_forward or ctx._forward_frame is None:
        return ctx.in_forward
    frame = ctx._forward_frame
    for top in sys._current_frames().values():
        f = top
        while f is not None:
            if f is frame:
                return True
            f = f.f_back
    return False


def recover_aborted_forward(ctx, module) -> None:
    """The root's forward begins while the last one never ended: it raised (Note [aborted
    forward]). Forget what it started -- gathered units, post-forward records -- and keep
    gradients of earlier backwards (a no-sync accumulation continues, as in FSDP2)."""
    warnings.warn(
        f"fusedist.fully_shard({type(module).__name__}): the previous forward did not finish (an exception was "
        "raised during it); its gathered parameters and bookkeeping are dropped. Call model.reset_iter_state() "
        "on the root after such an exception to make this explicit.", RuntimeWarning, stacklevel=4)
    ctx.in_forward, ctx._forward_frame = False, None
    ctx.post_forward_order.clear()
    for st in ctx.states:
        st.reset_backward()
        if st.unit is not None:
            st.unit.reshard()


def recover_aborted_backward(ctx, module) -> None:
    """A forward outside autograd's backward while a backward is marked running: that
    backward raised before its end (Note [aborted backward]); reset as ``reset_iter_state``."""
    warnings.warn(
        f"fusedist.fully_shard({type(module).__name__}): the previous backward did not finish (an exception "
        "was raised during it); its gradients are dropped and the iteration state is reset, as "
        "reset_iter_state() does. Call model.reset_iter_state() on the root after such an exception, and "
        "zero_grad(), to make this explicit.", RuntimeWarning, stacklevel=4)
    ctx.reset_iteration()


def unwind_aborted_call(state) -> None:
    """A call of ``state``'s unit ended by an exception before its post-hook ran: outside the
    root's forward, end it and reshard (Note [aborted standalone call])."""
    ctx = state.ctx
    if ctx is None or state._in_backward or ctx.backward_running or (ctx.in_forward and forward_is_live(ctx)):
        return  # not begun (the first forward's checks raised), a recompute, or inside the root's forward
    state._group_pending.clear()
    state._call_opened = []
    state._depth = max(state._depth - 1, 0)
    state.forward_running = state._depth > 0
    if not state._depth and state.unit is not None:
        state.unit.reshard()


def refuse_reset_while_running(ctx, module) -> None:
    """``reset_iter_state()`` inside the root's running forward or a running backward is
    refused (Note [reset during forward or backward])."""
    if ctx.in_forward and ctx._forward_frame is not None and forward_is_live(ctx):
        when = "forward"
    elif ctx.backward_running and in_autograd_backward():
        when = "backward"
    else:
        return
    raise RuntimeError(
        f"fusedist.fully_shard({type(module).__name__}): reset_iter_state() was called during the model's {when} "
        f"(from a hook or a submodule); it would free the parameters the rest of the {when} uses. Call it on "
        "the root between iterations, after the exception that ended a forward or backward.")
