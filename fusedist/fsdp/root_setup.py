"""The set-up of a root at its first forward: which states it leads, their shared iteration
context, the units' paths, the check that the ranks wrapped the model alike and the step watch
(Note [unit schedule] in state.py). Kept apart from the per-call hooks, which run every step."""

from __future__ import annotations

import torch

from ..reliability.sharded_watch import ShardedStepWatch
from .iteration import CONTEXT_ATTRIBUTE, IterationContext
from .tree_names import name_units
from .wrapping_check import check_one_mesh, check_wrapping

__all__ = ["check_materialized", "set_up_root"]


def check_materialized(root) -> None:
    """Before the first forward sets up ``root`` (a ``FullyShardState``): every unit below holds
    data (a unit built on meta raises, naming itself, before any bookkeeping or collective). The
    units are named from the root first, so the message names the root's own unit as every other
    does ("the root module (Net)", Note [unit paths follow the module] in tree_names.py); only when
    one is refused, so a forward that goes on is named by ``set_up_root`` alone."""
    from .state import state_of

    states = []
    for m in (sub for member in root.modules for sub in member.modules()):
        st = state_of(m)
        if st is not None and st.unit is not None and st not in states:
            states.append(st)
    if not any(st.unit.is_meta for st in states):
        return
    name_units(states, {id(m): n for member in root.modules for n, m in member.named_modules()})
    for st in states:
        st.unit.check_materialized()


def set_up_root(root) -> None:
    """``root`` -- the first state to run forward -- becomes the root of the states below it (as torch)."""
    from .state import state_of

    root.is_root = True
    states = []
    for name, m in (item for member in root.modules for item in member.named_modules()):
        st = state_of(m)
        if st is None or st in states:
            continue
        if st is not root:
            if st.ctx is not None:
                raise RuntimeError(
                    f"fusedist.fully_shard: '{name}' already ran forward as a root of its own; run the "
                    "forward of the outermost fully_shard module first")
            st.is_root = False
        states.append(st)
    ctx = IterationContext(states, root.modules)
    for st in states:
        st.ctx = ctx
    for member in root.modules:  # Note [a dropped model freed at once] in state.py: the root's modules hold it
        object.__setattr__(member, CONTEXT_ATTRIBUTE, ctx)
    # as FSDP2: the root's context becomes the shared one, so only the root's event is kept
    ctx.post_optim_event, root.post_optim_event = root.post_optim_event, None
    if root.auto_reshard and root.unit is not None:
        root.unit.reshard_after_forward = False  # None: the root keeps its parameters gathered
    units = [st.unit for st in states if st.unit is not None]
    if not units:
        return
    names = {id(m): n for member in root.modules for n, m in member.named_modules()}
    name_units(states, names)  # Note [unit paths follow the module] in tree_names.py
    check_one_mesh(units)
    # (the root's path is "": named '<root>' by the check's messages)
    paths = [(st.path_in(names), st.unit) for st in states if st.unit is not None]
    signature = check_wrapping([("?" if path is None else path, unit) for path, unit in paths])
    # the runs' process groups, now that the ranks agree on them, in the same order on every rank
    for u in units:
        if u.post_forward is not None:
            u.post_forward.connect()
    # At world size 1 too, as DDP's StepWatch: the counters and the optimizer step guard
    # apply; its cross-rank check is off there (WatchBase), so no collective is issued.
    # Its buffers live across steps: made outside inference mode even when the first
    # forward runs under torch.inference_mode() (an evaluation before training).
    with torch.inference_mode(False):
        ctx.watch = ShardedStepWatch(units[0].comm, signature, [p for u in units for p in u.sharded], units,
                                     members=root.modules)
