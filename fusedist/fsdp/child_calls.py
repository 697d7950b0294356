"""Refuse a module inside a unit called on its own while the unit holds only this rank's pieces.

Note [a unit's module called on its own]
    The unit gathers its parameters in the pre-forward of the modules given to ``fully_shard``
    (each member of a list). A module under them -- ``net.tail[0](x)`` after
    ``fully_shard([net.body, net.tail])`` -- runs no such hook: it computed on this rank's pieces,
    a wrong output of another shape (empty where its weight lies on another rank), and its
    backward failed far away (``setStorage ... storage of size 0``) or not at all. FSDP2 fails
    too (its pieces are DTensors mixed with plain inputs). So each module holding the unit's
    parameters, other than the members, refuses a forward while the unit is not gathered, naming
    itself, the unit and what to call. Inside the unit's own forward (and its backward's
    recomputation, which regathers first) the unit is gathered: the hook is one flag check.

Note [a unit's module called on its own while gathered]
    A unit kept gathered (``reshard_after_forward=False`` after an evaluation forward, ``unshard()``)
    holds the whole parameters: such a call computes the right output, and its backward gives the
    unit's parameters their gradients, which the unit reduces (the end-of-backward callback) into
    its pieces' ``.grad`` -- as FSDP2's. But nothing held the unit gathered until that backward:
    resharded in between (``reshard()``, the end of another backward, an optimizer step's reshard,
    a state-dict save), the backward read the freed parameters and failed far away ("setStorage:
    ... storage of size 0"; FSDP2 fails so too). So the outputs of such a call, under grad, get a
    hook that gathers the unit again before the call's backward reads the parameters (a collective,
    as the unit's own backward pre-hook: every rank runs that backward), and the backward's end
    reduces and reshards it as after any backward of the unit.

Note [a unit's module called on its own before its root's first forward]
    The hold above, and the reduction at the backward's end, belong to the iteration the root sets
    up at its first forward. A unit gathered by ``unshard()`` before that forward has none: such a
    call's backward failed on the freed parameters once the unit was resharded ("setStorage ...
    storage of size 0", as FSDP2's), and otherwise on the missing iteration in the gradient hook
    (FSDP2 leaves those gradients on its unsharded parameters, unreduced, to be added into the
    next backward's). So such a call under grad is refused at once, on every rank alike (the
    condition is the model's state), naming the module and what to do; under ``no_grad`` it runs
    (no backward to hold for), and after any forward of the root it is held as above.
"""

from __future__ import annotations

import functools
import weakref

import torch

from .containers import grad_tensors
from .replaced_modules import user_class_name
from .tree_names import unit_named


def guard_child_calls(unit, members: list) -> None:
    """Give each module holding ``unit``'s parameters, other than ``members``, the checks."""
    from .state import state_of

    member_ids = {id(m) for m in members}
    seen: dict = {}
    for regs in unit.registrations:
        for module, attr in regs:
            if id(module) not in member_ids and id(module) not in seen:
                seen[id(module)] = (module, attr)
    # weak: the unit holds these modules, so a strong reference back would keep a dropped model alive
    unit_ref, member_refs = weakref.ref(unit), [weakref.ref(m) for m in members]
    state_ref = weakref.ref(state_of(members[0]))
    for module, attr in seen.values():
        module.register_forward_pre_hook(functools.partial(_refuse_ungathered, unit_ref, member_refs, state_ref, attr))


def _refuse_ungathered(unit_ref, member_refs: list, state_ref, attr: str, module, args) -> None:
    unit = unit_ref()
    if unit is None:
        return
    if unit.is_unsharded:
        st = state_ref()
        if torch.is_grad_enabled() and st is not None and st.ctx is None:
            _refuse_before_root_forward(unit, member_refs, module)
        if torch.is_grad_enabled() and _on_its_own(st):
            # Note [a unit's module called on its own while gathered]: a one-shot hook on this call's outputs
            handle = []
            handle.append(module.register_forward_hook(functools.partial(_hold_for_backward, unit_ref, state_ref,
                                                                         handle)))
        return
    members = [m for m in (r() for r in member_refs) if m is not None]
    member, path = _paths(unit.path, members, module)
    raise RuntimeError(
        f"fusedist.fully_shard: module '{path}' ({type(module).__name__}) was called on its own, outside the "
        f"forward of {unit_named(unit)}, which holds its parameter '{attr}' sharded: it would compute on rank "
        f"{unit.rank}'s pieces alone (a wrong result, then a failing backward). Call {member} or the "
        "model instead; a module that must run on its own needs its "
        "own fully_shard call, made before its parent's. If the call is in a method other than forward (generate, "
        "encode), register it with fusedist.register_fsdp_forward_method(module, 'method') to gather the unit "
        "around it (torch's register_fsdp_forward_method leaves a module fusedist sharded as it is).")


def _refuse_before_root_forward(unit, member_refs: list, module) -> None:
    """Note [a unit's module called on its own before its root's first forward]."""
    members = [m for m in (r() for r in member_refs) if m is not None]
    member, path = _paths(unit.path, members, module)
    raise RuntimeError(
        f"fusedist.fully_shard: module '{path}' ({type(module).__name__}) was called on its own under grad while "
        f"{unit_named(unit)} is gathered (unshard()) before the model's first forward: until the root's first "
        "forward sets up the iteration, nothing can hold the unit gathered for this call's backward or reduce the "
        "gradients it gives (torch's FSDP2 fails in that backward if the unit was resharded, else leaves them "
        f"unreduced). Run the model's forward once first (an evaluation under torch.no_grad() will do), make this "
        f"call under torch.no_grad(), or call {member} or the model instead.")


def _on_its_own(st) -> bool:
    """Whether a call now is outside the unit's own forward and its backward's recomputation."""
    return not (st is None or st.forward_running or st._in_backward or st.ctx is None or st.ctx.backward_running)


def _hold_for_backward(unit_ref, state_ref, handle: list, module, args, output) -> None:
    """The outputs of a call on its own while the unit is gathered, under grad: their backward
    gathers the unit again if it was resharded since (Note [a unit's module called on its own
    while gathered]). Removed once it ran."""
    handle.pop().remove()
    if not torch.is_grad_enabled() or not _on_its_own(state_ref()):
        return  # (a call an exception ended left it: this is another call)
    hook = functools.partial(_regather, unit_ref, state_ref)
    for t in grad_tensors(output, []):
        t.register_hook(hook)


@torch.compiler.disable  # (a collective: Note [hooks outside compiled graphs] in state.py)
def _regather(unit_ref, state_ref, grad):
    unit, st = unit_ref(), state_ref()
    if unit is not None and st is not None:
        st.ctx.ensure_final_callback()  # (the backward's end reduces and reshards the unit)
        st.backward_pending = True
        if not unit.is_unsharded:
            unit.unshard(async_op=False)
    return grad


def _paths(unit_path, members: list, module) -> tuple:
    """How to name the member holding ``module``, and ``module``'s path: under the root where the
    root named the unit, else under the member."""
    names = unit_path[1:-1].split(", ") if unit_path and len(members) > 1 else [unit_path]
    for k, m in enumerate(members):
        sub = next((n for n, s in m.named_modules() if s is module), None)
        if sub is None:
            continue
        name = names[k] if k < len(names) and names[k] not in (None, "?") else None
        if name is None:
            item = f", item {k} of the list" if len(members) > 1 else ""
            cls = user_class_name(m)
            return f"the {cls} given to fully_shard{item}, which holds it,", f"<{cls}{item}>.{sub}"
        member = f"'{name}' (the module given to fully_shard that holds it)" if name else "the root module"
        return member, (f"{name}.{sub}" if name else sub)
    return "the module given to fully_shard", "?"
