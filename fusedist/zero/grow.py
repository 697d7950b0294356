"""Parameters that join a ZeroRedundancyOptimizer after construction.

Note [growing the partition]
    torch's ZeroRedundancyOptimizer.add_param_group keeps every parameter where it was and
    adds the new ones, so frozen layers can be made trainable as training progresses. Here
    the flat partition (Note [flat partition]) only grows: joining parameters get new buckets
    after the existing ones -- DDP appends them to its layout (Note [trainable set changes]
    in ``fusedist/ddp/trainable.py``), without DDP they are bucketed here -- so every rank's
    slices of the existing buckets, with their masters, optimizer state and piece splits, stay
    where they are. Growing reallocates the flat parameter buffers, the masters and the
    gradient shards with room for the new slices (copying the old contents; the new masters
    come from the parameters), re-points the inner optimizer's pieces (their state moves with
    them) and appends pieces for the new slices to their param groups.

    Who joins: the parameters of a group added with :meth:`add_param_group`, and parameters
    that were frozen (``requires_grad=False``) when the optimizer was constructed and are
    trainable now. With DDP they join when DDP takes them on: in the synchronized backward
    after the first training forward that saw them trainable, whose averaged gradient the next
    ``step()`` applies (DDP's layout listener, ``on_layout_change``, both stages). Without DDP
    they join at the first ``step()`` -- or ``GradScaler.unscale_`` / clip before it -- that
    sees them trainable.
    A parameter frozen later stays sharded; it gets no gradient, so steps skip it as torch's
    optimizers skip a parameter whose grad is None; made trainable again, it takes its averaged
    gradient from the backward that saw it trainable, as torch's DDP rebuilt. ``offload="cpu"``
    grows its host masters, gradient and parameter staging the same way (``HostShardOffload.grow``),
    before or after the first step or a load.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from ..ddp.layout import append_buckets
from ..ownership import register_gradient_holder
from . import deferred_stage2, param_checks, param_labels, trainable_check
from . import state as zstate
from .offload import check_offload_config
from .shard_store import ShardStore, bucket_grad_slice
from .partition import FlatParams, FlatPartition


def refresh_sharded(zero) -> None:
    """At construction: the parameters to shard are those DDP reduces (with DDP),
    or those trainable now."""
    if zero.ddp is not None:
        _check_held(zero, zero.ddp.reducer.params, zero.ddp.reducer.names)
        inside = set(zero.ddp.reducer.params)
        sharded = [i for i, p in enumerate(zero._params) if p in inside]
    else:
        sharded = [i for i, p in enumerate(zero._params) if p.requires_grad]
    _set_sharded(zero, sharded)


def _set_sharded(zero, sharded) -> None:
    chosen = set(sharded)
    zero._trainable = sorted(chosen)
    zero._frozen = [i for i in range(len(zero._params)) if i not in chosen]
    zero._may_grow = getattr(zero, "_may_grow", False) or bool(zero._frozen)  # (Note [parameters unfrozen ...])
    if zero.stage == 2 and zero.ddp is not None:  # fusedist.clip_grad_norm_ finds the shards (not while pending)
        register_gradient_holder([zero._params[i] for i in zero._trainable], zero)


def _check_held(zero, params, names) -> None:
    held = set(zero._params)
    missing = [n for p, n in zip(params, names) if p not in held]
    if missing:
        raise RuntimeError(
            f"ZeroRedundancyOptimizer (rank {zero.rank}): parameter(s) {missing[:10]} became trainable in its "
            "DistributedDataParallel model, which now reduces their gradients, but this optimizer does "
            "not hold them: add them with optimizer.add_param_group({'params': [...]}) before the "
            "training forward that first trains them (torch's ZeroRedundancyOptimizer takes them the same way)"
        )


def add_param_group(zero, param_group: dict) -> None:
    """torch's ``add_param_group``: the group's trainable parameters join the partition. Every
    rank adds the group, and the ranks compare it before it joins (Note [the same parameters on
    every rank]); a group refused on some ranks only (torch's checks, a parameter given twice) is
    refused on every rank, not left for the others to wait on."""
    zero.wait_for_params()
    refusal, appended, gi = None, False, len(zero.param_groups)
    try:
        Optimizer.add_param_group(zero, param_group)  # torch's checks (duplicates) and defaults
        appended = True
        new = list(zero.param_groups[gi]["params"])
        # Note [refusals of one rank's own arguments]: a parameter given twice, a dtype, the
        # defaults filled in, and with offload what the host Adam cannot run -- as the constructor
        refusal = param_checks.own_refusal(zero, groups=[gi], params=new, first=len(zero._params),
                                           op="ZeroRedundancyOptimizer.add_param_group")
        refusal = refusal or deferred_stage2.refusal_to_complete(zero, new)
    except (ValueError, TypeError) as exc:
        refusal = exc  # raised after the ranks compared their groups, on every rank alike
        if not appended:  # (torch's check normalizes the list in place before refusing it)
            given = param_group.get("params") if isinstance(param_group, dict) else None
            new = [p for p in given if isinstance(p, torch.Tensor)] if isinstance(given, list) else []
    try:
        # Note [the same parameters on every rank]: a collective, as every rank adds the group
        param_checks.check_same_params_on_every_rank(zero, new, [gi] * len(new), first=len(zero._params),
                                                     refusal=refusal)
    except Exception:
        if appended:
            zero.param_groups.pop()
        raise
    start = len(zero._params)
    zero._params.extend(new)
    zero._group_of.extend([gi] * len(new))
    zero._frozen.extend(range(start, start + len(new)))
    zero._may_grow = True  # (every rank adds alike: Note [parameters unfrozen on some ranks only])
    zero._sharded_state.invalidate()
    if zero.inner is not None:
        zero.inner.add_param_group(dict(zstate.hyperparameters(zero.param_groups[gi]), params=[]))
    if not deferred_stage2.complete_if_whole(zero):  # Note [stage 2 completed by add_param_group]
        join_pending(zero, force=True)


def join_pending(zero, compare: bool = False, force: bool = False) -> None:
    """Shard what should be sharded now and is not (Note [growing the partition]). ``compare``:
    called where every rank calls it, compare the sharded parameters across ranks first, and join
    only where they agree (Note [parameters unfrozen on some ranks only] in trainable_check.py) --
    unless they were compared in this step already (Note [one comparison a step]), in which case
    nothing joins until the next step. Without ``compare``, where the ranks compare, nothing joins:
    the comparison point does (Note [parameters join after the comparison]).
    ``force``: join and compare whatever was compared before (``add_param_group``)."""
    deferred_stage2.complete_settled(zero)  # Note [stage 2 completed by add_param_group]: then zero.ddp is set
    if zero.ddp is not None:
        return  # DDP's layout listener (on_layout_change) took them on when DDP appended them
    if zero._sharded_compared and not force:
        return  # Note [one comparison a step]: what is unfrozen since joins at the next step
    compared = trainable_check.compares(zero)
    if not (compare or force):
        if not compared:
            joining = pending(zero)
            if joining:
                _join(zero, joining)
        return
    if not zero._sharded_compared:
        trainable_check.settle(zero)  # an earlier step's verdict, kept on the device
    joining = pending(zero)
    if compared:
        sharded = _sharded_once_joined(zero, joining)
        if not trainable_check.conclude(zero, trainable_check.compare_own(zero, sharded), sharded, joining):
            return
    if joining:
        _join(zero, joining)


def pending(zero) -> list:
    """The parameters that wait to join: frozen when last sharded, trainable now."""
    return [i for i in zero._frozen if zero._params[i].requires_grad]


def _sharded_once_joined(zero, joining: list) -> list:
    """The parameter indices this rank shards once ``joining`` joined: the set the ranks compare."""
    return sorted(zero._trainable + joining)


def awaiting(zero) -> list:
    """The parameters waiting to join at this step's comparison (Note [parameters join after the
    comparison]): the same on every rank that compares alike."""
    if zero.ddp is not None or zero._sharded_compared or not trainable_check.compares(zero):
        return []
    return pending(zero)


def awaiting_with_grad(zero) -> bool:
    return any(zero._params[i].grad is not None for i in awaiting(zero))


def awaiting_grads(zero) -> list:
    """The gradients of the parameters waiting to join at this step's comparison, whole, on rank 0
    only: what the norm and found-inf check read of them before they have slices (Note
    [parameters join after the comparison])."""
    if zero.rank != 0:
        return []
    return [g for g in (zero._params[i].grad for i in awaiting(zero)) if g is not None]


def _join(zero, joining: list) -> None:
    params = [zero._params[i] for i in reversed(joining)]  # bucketed like bucketize: reverse order
    buckets = append_buckets(zero._partition.buckets, params, [f"param {i}" for i in reversed(joining)],
                             bucket_cap_bytes=zero.bucket_cap_bytes, world_size=zero.world_size)
    _grow(zero, buckets)


def fingerprint_entries(zero) -> list:
    """The numbers this rank adds to the found-inf and norm all-reduce (a sum) so that it compares
    the sharded parameters too -- with the pending ones, which join once the sums agree (Note
    [parameters join after the comparison]) -- or [] where nothing is compared (Note [one
    comparison a step]; the pending ones join at once where the ranks compare nothing)."""
    if zero.ddp is not None:
        return []
    if zero._sharded_compared or not trainable_check.compares(zero):
        join_pending(zero)
        return []
    trainable_check.settle(zero)  # an earlier step's verdict, kept on the device
    keys = trainable_check.keys(_sharded_once_joined(zero, pending(zero)))
    return [float(k) for k in keys] + [float(k * k) for k in keys]


def check_fingerprint_sums(zero, sums: torch.Tensor) -> None:
    """After the all-reduce that carried :func:`fingerprint_entries` (``sums``: its part of it):
    join the pending parameters where every rank's keys are equal; raise on every rank where
    they differ, or keep the verdict on the device (Note [the comparison read without a
    synchronization] in trainable_check.py)."""
    joining = pending(zero)
    sharded = _sharded_once_joined(zero, joining)
    if trainable_check.conclude(zero, trainable_check.sums_differ(sums, zero.world_size), sharded, joining) \
            and joining:
        _join(zero, joining)


def on_layout_change(zero, layout) -> None:
    """DDP's layout listener: take on the parameters of buckets DDP appended."""
    part = zero._partition
    old, new = part.buckets, layout.buckets
    changed = _changed_bucket(old, new)
    if changed is not None:
        # (the same on every rank: DDP's own listener compared the new layout across ranks first)
        raise RuntimeError(
            f"ZeroRedundancyOptimizer (rank {zero.rank}): the DDP bucket layout changed after the shards were "
            f"built ({changed}); the shards follow only buckets DDP appends. Build the optimizer again over the "
            "model's parameters after such a change (carry its state over with state_dict()/load_state_dict()).")
    if len(new) == len(old):
        return  # parameters frozen since: they keep their slices and are skipped without a gradient
    added = [(p, n) for b in new[len(old):] for p, n in zip(b.params, b.names)]
    _check_held(zero, [p for p, _ in added], [n for _, n in added])
    _grow(zero, list(new))


def _changed_bucket(old: list, new: list):
    """How ``new`` (DDP's layout's buckets) changed the buckets ``old`` the shards were built on,
    or None where it only appended some."""
    if len(new) < len(old):
        return f"{len(old)} buckets before, {len(new)} now"
    for k, (a, b) in enumerate(zip(old, new)):
        if a.dtype != b.dtype:
            return f"bucket {k}: {a.dtype} before, {b.dtype} now"
        if (a.start, a.end) != (b.start, b.end):
            return f"bucket {k}: elements [{a.start}, {a.end}) before, [{b.start}, {b.end}) now"
        if list(a.offsets) != list(b.offsets):
            return f"bucket {k}: parameter offsets {list(a.offsets)[:6]} before, {list(b.offsets)[:6]} now"
        if len(a.params) != len(b.params) or any(x is not y for x, y in zip(a.params, b.params)):
            names = getattr(b, "names", None) or ["?"] * len(b.params)
            return f"bucket {k}: other parameters now ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
    return None


@torch.no_grad()
def _grow(zero, buckets: list) -> None:
    zero.wait_for_params()
    old = zero._partition
    index_of = {p: i for i, p in enumerate(zero._params)}
    sharded = sorted({index_of[p] for b in buckets for p in b.params})
    joined = sorted(set(sharded) - set(zero._trainable))
    if zero._offload is not None:  # what the host Adam cannot step is refused before anything changes
        check_offload_config(zero.optimizer_class, {i: zero._params[i] for i in joined},
                             lambda i: param_labels.named(zero, i))
    _set_sharded(zero, sharded)
    part = FlatPartition(buckets, zero._params, zero._group_of, zero.rank, zero.world_size, sharded=sharded)
    part.keep_pieces_of(old)
    zero._grad_shards = _regrow(zero._grad_shards, part, zero, torch.zeros, dtypes=zero._own_grad_dtypes(part))
    zero._grad_store = ShardStore(part, bucket_grad_slice, zero._grad_shards)
    zero._partition = part
    if zero.inner is not None:
        _regrow_state(zero, old, part)
        zero._sharded_state.install_joined(joined)  # Note [loaded state of parameters not sharded yet]
    # The joiners' masters were just copied from them; the others keep their recorded versions,
    # so a write from outside since the last step still reaches their masters at the next one
    # (Note [parameters changed outside the optimizer] in ``shards.py``).
    zero._record_param_versions(joined)


def _regrow(tensors: dict, part, zero, alloc, dtypes=None) -> dict:
    """Per-dtype flat shards sized for ``part`` (of ``dtypes``, default all), the old contents
    copied to their front."""
    out = {}
    for dt, n in part.shard_numel.items():
        if dtypes is not None and dt not in dtypes:
            continue
        t = alloc(n, dtype=zero._master_dtype(dt), device=zero._device)
        previous = tensors.get(dt)
        if previous is not None:
            t[:previous.numel()].copy_(previous)
        out[dt] = t
    return out


def _regrow_state(zero, old, part) -> None:
    """Masters, flat parameters and the inner optimizer's pieces for the grown partition."""
    zero._take_up_moved_params()  # (the new buffer copies the parameters; their masters still must)
    zero._flat_params = FlatParams(part, zero._params, zero._device)  # current values, re-pointed
    offload = zero._offload
    if offload is not None:  # host masters and gradients (Note [offload pipeline] in offload.py)
        offload.grow()
        own = offload.masters
        piece_grads = ShardStore(part, bucket_grad_slice, offload.host_grads)
    else:
        own = _regrow(zero._masters.own, part, zero, torch.empty, dtypes=zero._own_master_dtypes(part))
        piece_grads = zero._grad_store
    masters = ShardStore(part, zero._flat_params.shard_view, own)  # Note [shards aliasing the parameters ...]
    masters.copy_own_from_views(part.bucket_shards[len(old.bucket_shards):])  # the new slices only
    inner = zero.inner
    ready = getattr(inner, "_fusedist_ready", None)
    tensors = []
    for k, piece in enumerate(part.pieces):
        t = masters.slice(piece.dtype, piece.start, piece.end)
        t.grad = piece_grads.slice(piece.dtype, piece.start, piece.end)
        params = inner.param_groups[piece.group]["params"]
        if k < len(zero._pieces):
            before = zero._pieces[k]
            st = inner.state.pop(before, None)
            if st:
                inner.state[t] = st
            if ready is not None:
                ready.discard(id(before))
            at = next(j for j, x in enumerate(params) if x is before)  # identity: == is elementwise
            params[at] = t
        else:
            params.append(t)
        tensors.append(t)
    zero._masters = masters
    zero._piece_grads = piece_grads
    zero._pieces = tensors
    if zero.overlap_param_gather:
        zero._gatherer.hook_buckets(zero.ddp.module, part.bucket_shards[len(old.bucket_shards):])


def store_caught_up(zero, reducer, accumulate: bool) -> list:
    """Stage 2: the gradients DDP averaged outside its buckets in this backward (parameters it
    took on, Note [trainable set changes]) go into this rank's gradient shard. Returns the
    parameters taken on with a gradient (the same on every rank)."""
    caught = [p for p in reducer.take_caught_up() if p.grad is not None]
    if not caught:
        return []
    from ..ddp.layout import flat_like

    part = zero._partition
    index_of = {p: i for i, p in enumerate(zero._params)}
    for p in caught:
        e = part.entry_of.get(index_of.get(p, -1))
        if e is None:
            continue
        src = flat_like(p.grad, p)[e.lo:e.hi]
        dst = zero._grad_shards[e.dtype][e.pos:e.pos + e.numel]
        dst.add_(src) if accumulate else dst.copy_(src)
    return caught
