"""Parameters that received no gradient in a synchronized backward (``find_unused_parameters``).

Note [unused parameters]
    A parameter whose hook did not fire by the end of backward is unused this iteration. Its
    slot is zero-filled (when it holds no gradient) and its bucket is launched then, so every
    rank issues the same collectives (with ``find_unused_parameters``, most are known, and
    counted, as the backward begins: Note [unused parameters known after the forward]). With
    ``find_unused_parameters=True`` a small used-map all-reduce (issued after all buckets, so
    the order stays the same on every rank) tells which parameters no rank used: those keep
    ``grad=None``, as in torch, or the gradient each rank held (Note [a gradient no rank
    produced]). With it False the
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

Note [unused parameters known after the forward]
    Buckets launch in order, so a bucket whose unused parameter waits for the end of backward
    holds back every later one: no overlap, and ZeRO stage 2 held every gradient to the end.
    As torch's DDP (its graph traversal in ``prepare_for_backward``), with
    ``find_unused_parameters=True`` (and no static graph) a synchronized training forward walks
    the autograd graph of its output (:func:`note_unreached`), and the next backward counts
    the parameters it does not reach as ready at once, their slots zero
    (:func:`mark_known_unused`). They are unused for the used map as before, so no rank's
    result changes. A graph holding a reentrant checkpoint (whose parameters it hides) is not
    used, nor are parameters holding a gradient already; those are found at the end, as
    before. A parameter counted unused that still gets a gradient (used in the loss outside
    the forward) is reduced if its bucket has not launched yet; otherwise the used map tells
    every rank, and every rank raises, naming it, where torch's DDP fails too.

Note [a gradient no rank produced]
    A parameter no rank used in a synchronized backward may still hold a gradient: one left
    from an earlier step without ``zero_grad``, or assigned by hand. Its slot takes it into the
    bucket, as every slot must be written before the collective, and the all-reduce averages
    it. torch's DDP copies the bucket back only into parameters some rank used, so each rank
    keeps its own value, and so does this one: the locally unused parameters holding a
    gradient (only those: the common path copies nothing) keep a copy of it before their
    bucket launches (:func:`keep_local_grads`), put back once the used map says no rank used
    them. A parameter used on some rank is averaged, the local stale gradient included, as in
    torch. (torch's ``gradient_as_bucket_view=True`` averages in place the bucket its gradient
    aliases, an accident of the aliasing its code says it means to avoid; fusedist's gradients
    alias the bucket in every mode and keep the local value in every mode, as torch's default.)
    Where a ZeRO stage-2 optimizer released the bucket there is no ``p.grad`` to put it back in:
    its shard holds the average (torch's ZeroRedundancyOptimizer steps such a parameter with its
    owner's own gradient).

Note [the cost of the graph walk]
    torch walks the graph in C++; here it is Python, once per synchronized training forward,
    about two node visits per parameter tensor. Measured on a 1000-layer MLP of width 4 (2000
    parameter tensors, 2-core CPU, :func:`note_unreached` 20 times): the first version, which
    asked every node its type name, pushed every edge before checking it and kept the reached
    tensors themselves in a set, took 10.5-11.5 ms per forward (the forward itself ~80 ms under
    DDP; torch's find_unused_parameters adds ~5-10 ms). Checking each node once as it is met,
    comparing types by identity, asking only custom functions' nodes their name and keeping the
    reached tensors' ids, 3.6-6.4 ms: the bare walk over ``next_functions`` is ~3 ms of it, and
    reading the 2000 leaves' tensors ~2 ms. The walk is never skipped or cached: a stale
    "unused" would count a used parameter's bucket as ready before its gradient arrives.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from torch.autograd.function import BackwardCFunction

if TYPE_CHECKING:
    from .reducer import Reducer


def keep_local_grads(reducer: "Reducer", unused: list) -> dict:
    """Copies of the gradients the locally unused parameters hold, before their buckets average
    them (Note [a gradient no rank produced]); none where nothing unused holds one."""
    if not reducer.config.tolerates_unused or reducer.shadowing:
        return {}
    return {p: p.grad.detach().clone() for p in unused if p.grad is not None}


def settle_unused(reducer: "Reducer", unused: list, had_grad: dict, kept: dict) -> list:
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
        for p in reducer.marked_unused:  # Note [unused parameters known after the forward]
            i = reducer.index_of[p]
            local[i] = int(reducer.entries[i].accumulated > since)
        for p in reducer.late_arrivals:
            local[reducer.index_of[p]] = 2  # every rank learns of it, and raises
    static, changed = reducer.arrivals, []
    if static is not None and static.used_anywhere is not None:
        used_anywhere = static.used_anywhere
        if not reducer.shadowing:
            changed = _changed_since_learned(reducer, static, local)
    else:
        used = torch.tensor(local, dtype=torch.int32, device=reducer.comm.device)
        reducer.comm.all_reduce(used, op="max", tag="ddp used-parameter map")
        used_anywhere = used.tolist()
        if 2 in used_anywhere:
            late = [reducer.names[i] for i, v in enumerate(used_anywhere) if v == 2]
            raise late_arrivals_error(reducer, late)
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
            elif p in kept and p.grad is not None:  # Note [a gradient no rank produced]
                p.grad.copy_(kept[p])
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


def note_unreached(reducer: "Reducer", out) -> None:
    """After a synchronized training forward with ``find_unused_parameters``: the parameters
    its autograd graph does not reach are unused in the next backward (Note [unused parameters
    known after the forward]). Several forwards before one backward: those none of them reach."""
    reached = _reached_leaf_ids(out)
    if reached is None:  # (a reentrant checkpoint hides its parameters: found at the end instead)
        reducer.known_unused = set()
        return
    unreached = {p for p in reducer.params if id(p) not in reached}
    known = reducer.known_unused
    reducer.known_unused = unreached if known is None else known & unreached


def _reached_leaf_ids(out):
    """The ids of the leaf tensors the autograd graph of ``out`` accumulates into, or None where a reentrant
    checkpoint's node hides the ones behind it (torch's DDP marks those unused, then fails).

    It runs after every synchronized training forward, so it is kept lean (Note [the cost of
    the graph walk]): each node is looked at once, as it is first met; leaves are told apart by
    their exact type, and only custom functions' nodes are asked their name."""
    from .prepared import _tensors

    reached, seen, stack = set(), set(), []
    for t in _tensors(out):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
            seen.add(t.grad_fn)
        elif t.requires_grad:
            reached.add(id(t))  # a parameter returned as it is
    if any(_is_reentrant_checkpoint(node) for node in stack):
        return None
    leaves, accumulate, custom = [], _ACCUMULATE_GRAD, BackwardCFunction
    pop, push, see, leaf = stack.pop, stack.append, seen.add, leaves.append
    while stack:
        for node, _ in pop().next_functions:
            if node is None or node in seen:
                continue
            see(node)
            if type(node) is accumulate:
                leaf(node)
            elif isinstance(node, custom) and type(node).__name__ == "CheckpointFunctionBackward":
                return None
            else:
                push(node)
    reached.update(id(node.variable) for node in leaves)
    return reached


def _is_reentrant_checkpoint(node) -> bool:
    return type(node).__name__ == "CheckpointFunctionBackward"


def _accumulate_grad_type() -> type:
    """The node type that accumulates a leaf's gradient (``AccumulateGrad``)."""
    leaf = torch.zeros(1, requires_grad=True)
    return type(leaf.view(1).grad_fn.next_functions[0][0])


_ACCUMULATE_GRAD = _accumulate_grad_type()


def mark_known_unused(reducer: "Reducer", known: set) -> None:
    """As a synchronized backward begins: count the parameters the forward's graph did not reach
    as ready now, their slots zero, so that the buckets after theirs launch during backward
    (Note [unused parameters known after the forward]). Those holding a gradient already (a
    no_sync one, or zero_grad(set_to_none=False)) are left to the end of backward."""
    generation, marked = reducer.generation, reducer.marked_unused
    for p in reducer.params:
        if p not in known or p.grad is not None or not p.requires_grad:
            continue
        entry = reducer.entries[reducer.index_of[p]]
        if entry.slot is None or entry.ready == generation:
            continue
        bucket = entry.slot.bucket
        if bucket.data is not None:  # (else the launch allocates it zeroed)
            reducer.layout.grad_view(p).zero_()  # the slot may hold a stale gradient
        entry.ready = generation  # an arrival after all takes the rare path: late_arrival
        marked.add(p)
        reducer.pending[bucket.index] -= 1


def late_arrival(reducer: "Reducer", entry, p) -> bool:
    """A gradient for a parameter counted unused as the backward began (Note [unused parameters
    known after the forward]): used outside the forward, or through a graph the traversal could
    not see. Its count is taken already (returns False); a bucket not launched yet holds the
    gradient (the hook copied it), one launched without it is reported by every rank at the end."""
    reducer.marked_unused.discard(p)
    # (a last bucket held back for the step check counts as launched: Note [the check carried by the last bucket])
    if entry.slot.bucket.index < reducer.next_launch + reducer.holding_last:
        reducer.late_arrivals.append(p)
    return False


def late_arrivals_error(reducer: "Reducer", names: list) -> RuntimeError:
    return RuntimeError(
        f"fusedist DDP (rank {reducer.comm.rank}): parameter(s) {names[:10]} received a gradient in this "
        "backward although the autograd graph of the wrapper's forward output does not reach them (used "
        "outside the forward, e.g. in the loss through model.module, hidden from the graph, or returned "
        "inside an object the wrapper does not look into: as torch's DDP, it finds a forward's output "
        "tensors in tuples, lists, dicts, namedtuples and dataclasses), so with find_unused_parameters=True "
        "their bucket was reduced without it, as torch's DDP refuses too. Use them inside the forward and "
        "return its tensors in such containers, or pass static_graph=True if every iteration uses the same "
        "parameters"
    )


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
    by_name = dict(zip(reducer.names, reducer.params))
    removed = removed_from_module(reducer, [by_name[n] for n in changed if n in by_name])
    if removed is not None:
        raise removed
    raise RuntimeError(
        f"fusedist DDP (rank {reducer.comm.rank}): with static_graph=True every iteration must use the same "
        f"parameters, but {len(changed)} parameter(s) received a gradient in this backward and not in the first "
        f"one, or the reverse: {changed[:10]}{' ...' if len(changed) > 10 else ''}. Pass "
        "find_unused_parameters=True instead of static_graph=True if the set of used parameters changes"
    )


def removed_from_module(reducer: "Reducer", params: list) -> "RuntimeError | None":
    """The error naming those of ``params`` (missing a gradient) that the module no longer holds,
    or None (Note [submodules removed] in trainable.py: a submodule deleted fires no hook)."""
    gone = reducer.tracker.not_in_module(params) if reducer.tracker is not None else []
    if not gone:
        return None
    emptied = set_to_none(reducer.tracker, gone)
    how = []
    if emptied:
        how.append("were set to None after wrapping, which runs no registration hook (module.fc.bias = None, "
                   f"eagerly or inside a torch.compile'd function): {_listed(emptied)}")
    deleted = [n for n in gone if n not in emptied]
    if deleted:
        how.append(f"are no longer in the module: {_listed(deleted)} (a submodule deleted after wrapping, e.g. "
                   "del model.module.fc)")
    return RuntimeError(
        f"fusedist DDP (rank {reducer.comm.rank}): {len(gone)} parameter(s) of the model as it was wrapped "
        f"{'; '.join(how)}. The wrapper still reduces the Parameters it was built with, so they received no "
        "gradient. Change the module before wrapping it, or wrap it again after the change")


def _listed(names: list) -> str:
    return f"{names[:10]}{' ...' if len(names) > 10 else ''}"


def set_to_none(tracker, names: list) -> list:
    """Those of ``names`` whose slot in the wrapped module holds None now (``module.fc.bias = None``):
    torch registers a None Parameter without calling the registration hooks, so only the error
    path can tell it from a deleted submodule."""
    owner = tracker.owner()
    if owner is None:
        return []
    emptied = []
    for name in names:
        path, _, leaf = name.rpartition(".")
        try:
            holder = owner.module.get_submodule(path)
        except AttributeError:
            continue
        if leaf in holder._parameters and holder._parameters[leaf] is None:
            emptied.append(name)
    return emptied


def unused_without_find_unused(reducer: "Reducer", unused: list) -> RuntimeError:
    """The error of a rank whose parameters got no gradient while ``find_unused_parameters``
    is off (Note [unused parameters]), raised after the collectives completed."""
    names = [reducer.names[reducer.index_of[p]] for p in unused]
    removed = removed_from_module(reducer, unused)
    if removed is not None:
        return removed
    return RuntimeError(
        f"fusedist DDP (rank {reducer.comm.rank}): {len(names)} parameter(s) received no "
        f"gradient in this backward: {names[:10]}{' ...' if len(names) > 10 else ''}. "
        "Pass find_unused_parameters=True to DistributedDataParallel if parts of the model "
        "are legitimately unused in some iterations, or make sure every parameter takes part "
        "in computing the loss. Under reentrant activation checkpointing (checkpoint(..., "
        "use_reentrant=True)), whose parameters get no gradient where no input of the checkpoint "
        "requires one, pass static_graph=True, as torch's DDP needs there, or use use_reentrant=False."
    )
