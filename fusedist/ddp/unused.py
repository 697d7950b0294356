"""Parameters that received no gradient in a synchronized backward (``find_unused_parameters``).

Note [unused parameters]
    A parameter whose hook did not fire by the end of backward is unused this iteration. Its
    slot is zero-filled (when it holds no gradient) and its bucket is launched then, so every
    rank issues the same collectives. With ``find_unused_parameters=True`` a small used-map
    all-reduce (issued after all buckets, so the order stays the same on every rank) tells
    which parameters no rank used: those keep ``grad=None``, as in torch. With it False the
    rank raises after the collectives completed, naming the parameters, instead of leaving
    the other ranks to hang in the next step.

    "Used" means since the last synchronized backward, ``no_sync`` backwards included (as
    torch's local-used map): a parameter that got a gradient only in a ``no_sync``
    micro-batch, on some ranks, is reduced like any other -- every rank ends with the
    average, also the ranks that never computed a gradient for it. Counting the synchronized
    backward alone would leave those ranks with ``grad=None`` while the others step with the
    average: the replicas would silently drift apart.

Note [the used map of a static graph]
    With ``static_graph=True`` every iteration uses the same parameters, so the used map is
    all-reduced in the first synchronized backward only and kept, as torch's static graph
    does: later steps skip that collective (and its read back to the host, a synchronization
    on a GPU). Each rank keeps its own first map too and compares every later one with it: a
    parameter used now and not then (or the reverse) means the graph is not static, and the
    rank raises, naming it, rather than giving that parameter the wrong gradient. Parameters
    frozen since the last forward are not compared; a change of the trainable set or of the
    parameters (agreed by every rank) forgets the map, and the next backward learns it again.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .reducer import Reducer


def settle_unused(reducer: "Reducer", unused: list, had_grad: dict) -> list:
    """After the buckets finished: one all-reduce of the used map (once, with a static graph),
    then the parameters no rank used keep (or get back) ``grad=None`` and the others used
    elsewhere get their average. Returns the names of the parameters whose use differs from the
    static graph's first backward (Note [the used map of a static graph])."""
    # Built on the host and read back once: one transfer each way, not one per parameter.
    generation = reducer.generation
    if reducer.shadowing:
        # Note [a joined rank's used map]: as torch's joined rank, the used map of the last
        # synchronized backward it took part in, as all the ranks reduced it then: a parameter
        # some rank used then gets an (averaged, zero where no active rank uses it now)
        # gradient on the active ranks, not None, as with torch's DDP.
        local = reducer.last_used_map
        if len(local) != len(reducer.entries):  # (none yet, or the layout has grown since)
            local = [0] * len(reducer.entries)
    else:
        # Used in this backward or in a no_sync one since the last synchronization.
        since = reducer.synced_generation
        local = [int(e.ready == generation or e.accumulated > since) for e in reducer.entries]
    static, changed = reducer.arrivals, []
    if static is not None and static.used_anywhere is not None:
        used_anywhere = static.used_anywhere
        if not reducer.shadowing:
            changed = _changed_since_learned(reducer, static, local)
    else:
        used = torch.tensor(local, dtype=torch.int32, device=reducer.comm.device)
        reducer.comm.all_reduce(used, op="max", tag="ddp used-parameter map")
        used_anywhere = used.tolist()
        if static is not None:
            static.used_anywhere, static.local_used = used_anywhere, None if reducer.shadowing else local
    if not reducer.shadowing:
        reducer.last_used_map = used_anywhere
    globally_unused, without_grad, used_elsewhere = [], [], []
    for p in unused:
        if used_anywhere[reducer.index_of[p]] == 0:
            globally_unused.append(reducer.names[reducer.index_of[p]])
            if not had_grad[p]:
                p.grad = None
                without_grad.append(p)
        else:
            used_elsewhere.append(p)
    # (a released bucket -- ZeRO stage 2 -- exposes no gradients: its shard holds them)
    reducer.expose_grads(used_elsewhere)
    reducer.params_without_grad = without_grad + list(reducer.inactive) + list(reducer.frozen_now)
    if globally_unused and not reducer.warned_unused:
        reducer.warned_unused = True
        warnings.warn(
            f"fusedist DDP: {len(globally_unused)} parameter(s) received no gradient on any rank "
            f"in iteration {reducer.iteration}: {globally_unused[:10]} (reported once)",
            stacklevel=2,
        )
    return changed


def _changed_since_learned(reducer: "Reducer", static, local: list) -> list:
    """The names of the parameters used now and not in the backward that learned the map, or
    the reverse (frozen ones aside)."""
    if static.local_used is None:  # (this rank was joined then)
        static.local_used = local
        return []
    skip = reducer.frozen_now | reducer.inactive
    return [reducer.names[i] for i, (now, then) in enumerate(zip(local, static.local_used))
            if now != then and reducer.params[i] not in skip]


def raise_graph_changed(reducer: "Reducer", changed: list) -> None:
    raise RuntimeError(
        f"fusedist DDP (rank {reducer.comm.rank}): with static_graph=True every iteration must use the same "
        f"parameters, but {len(changed)} parameter(s) received a gradient in this backward and not in the first "
        f"one, or the reverse: {changed[:10]}{' ...' if len(changed) > 10 else ''}. Pass "
        "find_unused_parameters=True instead of static_graph=True if the set of used parameters changes"
    )


def unused_without_find_unused(reducer: "Reducer", unused: list) -> RuntimeError:
    """The error of a rank whose parameters got no gradient while ``find_unused_parameters``
    is off (Note [unused parameters]), raised after the collectives completed."""
    names = [reducer.names[reducer.index_of[p]] for p in unused]
    return RuntimeError(
        f"fusedist DDP (rank {reducer.comm.rank}): {len(names)} parameter(s) received no "
        f"gradient in this backward: {names[:10]}{' ...' if len(names) > 10 else ''}. "
        "Pass find_unused_parameters=True to DistributedDataParallel if parts of the model "
        "are legitimately unused in some iterations, or make sure every parameter takes part "
        "in computing the loss."
    )
