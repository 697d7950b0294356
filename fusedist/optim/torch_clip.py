"""torch's own gradient clip, made global over gradients that fusedist keeps sharded.

Note [torch's clip on sharded gradients]
----------------------------------------
torch FSDP2's parameters are DTensors, so ``torch.nn.utils.clip_grad_norm_(model.parameters())``
there measures the *global* norm: the per-tensor norms are partial DTensors, reduced across
the ranks when the clip coefficient is applied. ``fusedist.fully_shard``'s parameters are plain
tensors holding this rank's piece, and ZeRO stage 2 keeps no ``p.grad`` at all: torch's function
would measure this rank's share only (each rank clipping by its own norm, the ranks silently
departing from FSDP2's training), or nothing (stage 2's clip a silent no-op). Code that clips
with torch's function is everywhere (training loops, Lightning's precision plugins, Hugging
Face's Trainer, torchtitan's ``get_total_norm`` + ``clip_grads_with_norm_``), so the swap of one
import must keep it right rather than ask every caller to switch.

The first registration of a gradient holder (``fusedist/ownership.py``: a ``fully_shard`` unit or
a stage-2 ``ZeroRedundancyOptimizer``) therefore installs four narrow replacements in torch (so
does the first DDP model with the per-step check on, which counts the clips: Note [a clip on some
ranks only] in fusedist/reliability/clip_check.py):

* ``torch.nn.utils.clip_grad_norm_`` (also under ``torch.nn.utils.clip_grad``): parameters with
  a gradient holder go to :func:`fusedist.clip_grad_norm_` (the global norm, one small
  all-reduce; stage 2 applies the coefficient in its step), except ``fully_shard`` pieces, which
  torch's own scaling clips by the global norm cast to the gradients' dtype, as FSDP2's clip
  does (a bf16 model: a bf16 norm and coefficient). Any other call is torch's function,
  unchanged.
* ``torch.nn.utils.get_total_norm`` and the module-level ``_get_total_norm`` that torch's
  ``clip_grad_norm_`` calls: gradients that are ``fully_shard`` pieces' ``.grad`` give the global
  norm. Patching the name torch's clip looks up at call time keeps even a
  ``from torch.nn.utils import clip_grad_norm_`` bound before fusedist was imported right for
  ``fully_shard`` (its ``_clip_grads_with_norm_`` then scales every rank's pieces by the same
  global coefficient).

* ``_clip_grads_with_norm_`` (also ``torch.nn.utils.clip_grads_with_norm_``, the same function),
  the scaling step torch's ``clip_grad_norm_`` calls after the norm: stage 2 through a name
  bound before the installation, and torchtitan's ``get_total_norm`` + ``clip_grads_with_norm_``. That function (torch's
  own) finds no ``p.grad`` and asks the norm of an empty list -- it cannot see which parameters
  it clips -- then hands the parameters and that norm to ``_clip_grads_with_norm_``. So the
  replaced ``_get_total_norm`` remembers the zero it returned for an empty list (with the norm
  type asked), and when that very tensor reaches ``_clip_grads_with_norm_`` with parameters a
  stage-2 optimizer holds, the clip is fusedist's (the global norm; the coefficient applied in
  the step) and the global norm is written into that tensor, which torch's function returns:
  the caller sees the norm torch's DDP would give. torchtitan's two calls meet the same way:
  ``get_total_norm`` of the (empty) list of ``p.grad`` returns that zero, and
  ``clip_grads_with_norm_`` of the parameters with it clips globally and fills it in. Without
  this, the common ``from torch.nn.utils import clip_grad_norm_`` at a script's top, and the
  two-call recipe, clipped nothing under stage 2 and returned 0.

* ``clip_grad_value_`` (module attribute): refused for parameters whose gradients a stage-2
  optimizer holds -- torch's function would clamp no ``p.grad`` and change nothing, silently
  (Lightning's value clip is refused there already). A value clip on ``fully_shard`` pieces is
  elementwise, so torch's function is right on them and runs unchanged.

* ``torch.nn.utils.get_total_norm`` itself (the public name) of an empty list while ZeRO stage-2
  optimizers hold gradients: torchtitan's clip across pipeline stages (Note [torchtitan's clip
  across pipeline stages of stage 2]).

Units on one data-parallel group, some tensor-parallel and some not (a module left out of the
plan), are measured together (Note [plain units beside tensor-parallel ones] in
fusedist/fsdp/holder.py). What stays outside: a list mixing sharded and unsharded gradients or
units of different data-parallel groups, which raises, naming the units on each side (FSDP2's
clip refuses DTensors mixed with plain tensors too), and, under stage 2, the norm read before
``clip_grads_with_norm_`` runs (it is 0 until then) or the two calls made through names bound
before the installation.
The replacements are collectives exactly when they see sharded gradients: every rank calls them
with the same parameters, as FSDP2 requires of its clip.

Note [torchtitan's clip across pipeline stages of stage 2]
---------------------------------------------------------
torchtitan's ``clip_grad_norm_(..., pp_mesh=...)`` takes each stage's norm with ``get_total_norm``
of the ``p.grad``, raises it to ``p``, all-reduces it over the pipeline group in place (a max for
``inf``), takes the ``p``-th root in place, and clips with ``clip_grads_with_norm_`` by that whole
model's norm. A stage-2 stage has no ``p.grad``: the zero of the empty list went into the sum,
and the clip above then measured and clipped the stage by its own norm and wrote that into the
tensor -- every stage clipped by another norm than torch's over the whole model, and returned it.
So the public ``get_total_norm`` of an empty list, while the stage-2 optimizers of this process's
``fusedist.pipelining.PipelineStage`` modules hold gradients (the same ones on every rank of a
stage), is their global norm (a collective over their groups, one all-reduce each), remembered
with the tensor's value and version. Given exactly those optimizers' parameters,
``clip_grads_with_norm_`` with that tensor -- as returned, or combined by the caller over the
stages (changed in place) -- clips by it: each optimizer records torch's coefficient
``max_norm / (norm + 1e-6)``, at most 1, for its step, and the tensor is left as the caller made
it. Given other parameters, an unchanged tensor is the clip above; a changed one is refused
(its norm counts gradients that would not be clipped). Only the stages' optimizers are
measured: one no longer in use but not yet collected would count on some ranks and not others,
and their collectives would mismatch. torch's own ``clip_grad_norm_`` calls the internal name,
which keeps the zero.
"""

from __future__ import annotations

import functools
import threading
import types

import torch
import torch.nn.utils as nn_utils
import torch.nn.utils.clip_grad as clip_grad_module

from ..ownership import gradient_holder, held_parameters
from ..reliability.clip_check import count_clip
from ._eager import TORCH_CLIP_REASON, eager_under_compile
from .grad_norms import norm_result_dtype
from .step_context import materialize_unscales

__all__ = ["install", "installed", "joint_fully_shard_holder", "mixed_holders_message", "torch_clip_grad_norm_"]

#: torch's own functions, saved before replacement (also what fusedist's clip falls back to)
_TORCH_CLIP = clip_grad_module.clip_grad_norm_
_TORCH_TOTAL_NORM = clip_grad_module._get_total_norm
_TORCH_CLIP_WITH_NORM = clip_grad_module._clip_grads_with_norm_
_TORCH_CLIP_VALUE = clip_grad_module.clip_grad_value_
# this thread's last norm of an empty gradient list: (the tensor returned, norm_type,
# error_if_nonfinite, its value and version then, the stage-2 optimizers measured or None) -- what
# torch's clip_grad_norm_ hands on to _clip_grads_with_norm_
_empty_norm = threading.local()


# The replacements look up each parameter's gradient holder and all-reduce: traced in a compiled
# training step, the lookup recompiled once per parameter shape (up to dynamo's limit) and the
# collectives failed. They run eagerly between the graphs, one graph break per call (a lookup
# disabled one by one would cost each parameter's lookup its own eager frame). With fullgraph=True,
# dynamo's error says so (Note [a fused step under fullgraph=True] in _eager.py). Parameters that no
# holder holds are torch's, traced (Note [torch's clip on plain parameters under torch.compile]).
_eager_in_compiled_code = eager_under_compile(TORCH_CLIP_REASON)


def torch_clip_grad_norm_(*args, **kwargs) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` as torch ships it (whatever is installed in its place)."""
    return _TORCH_CLIP(*args, **kwargs)


def joint_fully_shard_holder(groups: list):
    """``(holder, params)`` measuring the ``fully_shard`` pieces of ``groups`` (``(holder, params)``
    of several holders) as one, or None (Note [plain units beside tensor-parallel ones] in
    fusedist/fsdp/holder.py)."""
    from ..fsdp.holder import joint_holder  # (fusedist.fsdp imports the optimizers)

    return joint_holder(groups)


def _describe_holder(holder, params: list) -> str:
    """Who holds ``params``' gradients, for an error: the ``fully_shard`` units by name, with their
    first parameters' names, and their groups; or the owner's type (a ZeRO optimizer)."""
    if not hasattr(holder, "tp"):
        return f"{type(holder).__name__} ({len(params)} parameters)"
    from ..fsdp.owners import owner_of
    from ..fsdp.tree_names import param_path, unit_where

    units: dict = {}  # (named as the fully_shard messages name them: Note [unit paths follow the module])
    for p in params:
        owned = owner_of(p)
        if owned is not None:
            units.setdefault(id(owned[0]), (unit_where(owned[0]), []))[1].append(param_path(*owned))
    names = ", ".join(f"{name} ({', '.join(fqns[:2])}{', ...' if len(fqns) > 2 else ''})"
                      for name, fqns in units.values())
    groups = [f"data-parallel group of {holder.comm.world_size}"]
    if holder.replicate is not None:
        groups.append(f"replicate group of {holder.replicate.world_size}")
    groups.append(f"tensor-parallel group of {holder.tp.world_size}" if holder.tp is not None
                  else "no tensor-parallel parameters")
    return f"fully_shard units {names or '?'} [{', '.join(groups)}]"


def mixed_holders_message(what: str, params: list, unheld) -> str:
    """The refusal of a total norm over gradients that no single collective can measure: ``what``
    (the function and the problem), then which owners hold which of them, and what to do.
    ``unheld``: whether some of ``params`` have no gradient holder."""
    groups: dict = {}
    plain = []
    for i, p in enumerate(params):
        holder = gradient_holder(p)
        if holder is not None:
            groups.setdefault(id(holder), (holder, []))[1].append(p)
        elif p.requires_grad:
            plain.append(f"parameter {i} of shape {tuple(p.shape)}")
    sides = [_describe_holder(h, ps) for h, ps in groups.values()]
    if unheld:
        shown = f" ({', '.join(plain[:2])}{', ...' if len(plain) > 2 else ''})" if plain else ""
        sides.append(f"parameters whose gradients are not sharded by fully_shard or a ZeRO optimizer{shown}")
    return (
        f"{what}: no single global norm covers these gradients. They are held by "
        + "; ".join(sides) + ". A norm over them would mix one rank's local values with global ones, "
        "or units whose data-parallel groups differ. Shard every trainable module with fully_shard on the same "
        "data-parallel mesh (a module left out of the tensor-parallel plan may be sharded beside it on that "
        "mesh), or clip each owner's parameters on their own (e.g. optimizer.clip_grad_norm_ for a "
        "ZeroRedundancyOptimizer). torch's FSDP2 refuses DTensors of different meshes, or mixed with plain "
        "tensors, too.")


def _pieces_by_holder(grads: list) -> tuple[dict, bool]:
    """The parameters whose ``.grad`` is among ``grads``, grouped by gradient holder, and
    whether some of ``grads`` belong to no holder."""
    ids = {id(g) for g in grads}
    found: dict = {}
    for p, holder in held_parameters():
        g = p.grad
        if g is not None and id(g) in ids and hasattr(holder, "grad_norm"):
            found.setdefault(id(holder), (holder, []))[1].append(p)
            ids.discard(id(g))
    return found, bool(ids)


@_eager_in_compiled_code
@torch.no_grad()
def _global_total_norm_eager(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None) -> torch.Tensor:
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    tensors = list(tensors)
    if not tensors:  # maybe torch's clip over stage-2 parameters (their p.grad is None)
        total = _TORCH_TOTAL_NORM(tensors, norm_type, error_if_nonfinite, foreach)
        _empty_norm.last = (total, norm_type, error_if_nonfinite, total.clone(), total._version, None)
        return total
    found, unheld = _pieces_by_holder(tensors)
    if not found:
        return _TORCH_TOTAL_NORM(tensors, norm_type, error_if_nonfinite, foreach)
    joint = None if unheld or len(found) == 1 else joint_fully_shard_holder(list(found.values()))
    if joint is not None:  # Note [plain units beside tensor-parallel ones] in fusedist/fsdp/holder.py
        holder, params = joint
    elif len(found) > 1 or unheld:
        held = [p for _, ps in found.values() for p in ps]
        raise ValueError(mixed_holders_message(
            "torch.nn.utils.get_total_norm / clip_grad_norm_: some of these gradients are pieces of "
            "fusedist.fully_shard parameters and some are not, or they belong to units whose groups differ",
            held, unheld))
    else:
        holder, params = next(iter(found.values()))
    materialize_unscales(params)  # lazily unscaled gradients: torch's values first
    total = holder.grad_norm(params, norm_type)
    _check_finite(total, norm_type, error_if_nonfinite)
    # torch returns the norm in the gradients' (promoted) dtype, real for complex gradients
    dtype = norm_result_dtype({t.dtype for t in tensors})
    return total.to(device=tensors[0].device, dtype=dtype)


@_eager_in_compiled_code
@torch.no_grad()
def _public_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm``: of an empty list while the stage-2 optimizers of this
    process's pipeline stages hold gradients, their global norm (Note [torchtitan's clip across
    pipeline stages of stage 2]); else as torch's clip sees it."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    tensors = list(tensors)
    holders = _stage2_holders_with_grads() if not tensors else []
    if not holders:
        return _global_total_norm(tensors, norm_type, error_if_nonfinite, foreach)
    norm_type = float(norm_type)
    norms = [h._global_grad_norm(norm_type, h.step_context.inv_scale).double().reshape(1) for h in holders]
    norms = torch.cat([n.to(norms[0].device) for n in norms])
    total = norms.sum() if norm_type == 0.0 else torch.linalg.vector_norm(norms, norm_type)  # (0: counts add)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite: the gradients "
            "the ZeroRedundancyOptimizer(stage=2) of this rank's pipeline stage holds over every rank's shard "
            "(its p.grad are None), so they cannot be clipped (every rank of the stage raises this). To disable "
            "this error and scale the gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    dtype = norm_result_dtype({p.dtype for h in holders for p in h._trainable_params()})
    total = total.to(dtype)
    _empty_norm.last = (total, norm_type, error_if_nonfinite, total.clone(), total._version, holders)
    return total


def _stage2_holders_with_grads() -> list:
    """The ZeRO stage-2 optimizers of this process's fusedist pipeline stages that hold
    gradients of a synchronized backward, in the order the stages were made (the same on every
    rank of a stage). Only the stages' own: an optimizer no longer in use but not yet collected
    would be counted on some ranks and not others."""
    import sys

    pipelining = sys.modules.get("fusedist.pipelining")  # (not imported: no stage to measure)
    if pipelining is None:
        return []
    return [h for h in pipelining.stage_holders_outside_grad() if h._fusedist_has_grads()]


@_eager_in_compiled_code
@torch.no_grad()
def _global_clip_grad_norm_eager(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    if isinstance(parameters, torch.Tensor):
        params = [parameters]
    else:
        params = list(parameters)
        if not params and isinstance(parameters, types.GeneratorType):
            # (the exhausted generator itself: torch warns that an empty one clips nothing)
            return _TORCH_CLIP(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    holders = [gradient_holder(p) for p in params]  # (one lookup per parameter, for every use below)
    if any(h is not None for h in holders):
        holder = _one_fully_shard_holder(params, holders)
        if holder is not None:
            count_clip(params, max_norm)  # Note [a clip on some ranks only] in fusedist/reliability/clip_check.py
            held = [p for p, h in zip(params, holders) if h is not None]
            return _clip_pieces_as_torch(holder, held, max_norm, norm_type, error_if_nonfinite, foreach)
        from .clip import clip_grad_norm_

        return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)  # (counts the call)
    return _TORCH_CLIP(params, max_norm, norm_type, error_if_nonfinite, foreach)  # (counted by its scaling step)


def _one_fully_shard_holder(params: list, holders: list):
    """The ``fully_shard`` gradient holder of every trainable parameter in ``params`` (whose
    holders are ``holders``) -- for plain units beside tensor-parallel ones, one measuring them
    together -- or None (a stage-2 optimizer's parameters, holders that do not combine, or pieces
    mixed with plain parameters: fusedist's clip handles or refuses those)."""
    distinct = {id(h): h for h in holders if h is not None}
    if not distinct or any(h is None and p.requires_grad for p, h in zip(params, holders)):
        return None
    if len(distinct) > 1:  # Note [plain units beside tensor-parallel ones] in fusedist/fsdp/holder.py
        groups = {i: (h, []) for i, h in distinct.items()}
        for p, h in zip(params, holders):
            if h is not None:
                groups[id(h)][1].append(p)
        joint = joint_fully_shard_holder(list(groups.values()))
        return joint[0] if joint is not None else None
    holder = next(iter(distinct.values()))
    return holder if hasattr(holder, "grad_norm") else None


@torch.no_grad()
def _clip_pieces_as_torch(holder, held, max_norm, norm_type, error_if_nonfinite, foreach) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` over ``fully_shard`` pieces, as FSDP2's over its DTensors: the
    global norm, returned in the gradients' (promoted) dtype, and torch's own scaling by it, so
    the coefficient is taken in that dtype too. (``fusedist.clip_grad_norm_`` returns the fp32
    norm; a bf16 model clipped by an fp32 coefficient left every clipped gradient an ulp from
    FSDP2's.) The holder's norm is a collective on every rank, one whose pieces have no
    gradient included. ``held``: the pieces among the parameters to clip."""
    materialize_unscales(held)  # lazily unscaled gradients: torch's values first
    with_grad = [p for p in held if p.grad is not None]
    grads = [p.grad for p in with_grad]
    total = holder.grad_norm(held, norm_type)
    total = total.to(norm_result_dtype({g.dtype for g in grads} or {p.dtype for p in held}))
    _check_finite(total, norm_type, error_if_nonfinite)
    if with_grad:
        _TORCH_CLIP_WITH_NORM(with_grad, max_norm, total.to(grads[0].device), foreach)
    return total


def _check_finite(total: torch.Tensor, norm_type, error_if_nonfinite: bool) -> None:
    """torch's ``error_if_nonfinite`` for the global norm of ``fully_shard`` pieces (a read of
    the norm: one host synchronization, as torch's)."""
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite "
            "over all ranks' pieces of the fully_shard parameters, so it cannot be clipped (every rank "
            "raises this). To disable this error and scale the gradients by the non-finite norm "
            "anyway, set `error_if_nonfinite=False`")


def _held_by_stage2(p) -> bool:
    """Whether a ZeRO stage-2 optimizer holds ``p``'s gradient (then ``p.grad`` is None)."""
    return p.grad is None and getattr(gradient_holder(p), "stage", None) == 2


@_eager_in_compiled_code
@torch.no_grad()
def _clip_grads_with_norm_eager(parameters, max_norm, total_norm, foreach=None) -> None:
    last = getattr(_empty_norm, "last", None)
    _empty_norm.last = None
    # (torch's clip_grad_norm_ scales through here, bound before the installation or not: each clip
    # is counted once, here or by fusedist's clip: Note [a clip on some ranks only] in
    # fusedist/reliability/clip_check.py)
    params = _as_list(parameters)
    if last is not None and last[0] is total_norm:
        _, norm_type, error_if_nonfinite, measured, version, holders = last
        # (an in-place all-reduce leaves the version as it was: the value tells)
        changed = total_norm._version != version or not torch.allclose(total_norm, measured, 0.0, 0.0, True)
        if holders is not None and _all_parameters_of(params, holders):
            count_clip(params, max_norm)
            _clip_stage2_by(max_norm, total_norm, holders)  # the norm measured, or the caller's from it
            return
        if changed:  # combined by the caller over other stages: no norm of these gradients to take
            _refuse_combined_norm(params, holders)
        elif any(_held_by_stage2(p) for p in params):
            from .clip import clip_grad_norm_

            norm = clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)  # (counts the call)
            total_norm.copy_(norm)  # the tensor torch's clip_grad_norm_ returns to its caller
            return
    count_clip(params, max_norm)
    _TORCH_CLIP_WITH_NORM(params, max_norm, total_norm, foreach)


def _refuse_combined_norm(params: list, holders) -> None:
    """A norm combined from ``get_total_norm`` of an empty list that does not cover the stage-2
    gradients of ``params`` (Note [torchtitan's clip across pipeline stages of stage 2]): clipping
    by it would leave them unclipped, or clip them by a norm counting others' gradients."""
    held = {id(h): h for p in params if _held_by_stage2(p) for h in (gradient_holder(p),)}
    if not any(h._fusedist_has_grads() for h in held.values()):
        return
    if holders is None:
        raise ValueError(
            "torch.nn.utils.clip_grads_with_norm_: the norm given was combined from get_total_norm of an empty "
            "list, which measured nothing, but a ZeroRedundancyOptimizer(stage=2) holds gradients of these "
            "parameters (it keeps no p.grad): the combined norm leaves them out. Build the pipeline stages with "
            "fusedist.pipelining.PipelineStage (get_total_norm then measures their stage-2 optimizers), or clip "
            "with optimizer.clip_grad_norm_")
    raise ValueError(
        "torch.nn.utils.clip_grads_with_norm_: the norm given was combined from get_total_norm of an empty list "
        "-- the norm of the gradients of every ZeroRedundancyOptimizer(stage=2) of this process's pipeline "
        f"stages (stage 2 keeps no p.grad) -- but these parameters are not all of those {len(holders)} "
        "optimizers' parameters, so the norm counts gradients this would not clip. Clip exactly the parameters "
        "of the stage-2 optimizers of the stages on this rank")


def _all_parameters_of(params: list, holders: list) -> bool:
    """Whether ``params`` are every trainable parameter of the stage-2 optimizers ``holders``
    and of no other stage-2 optimizer holding gradients (frozen ones and others aside)."""
    given = {id(p) for p in params if p.requires_grad}
    others = {id(h) for h in map(gradient_holder, params) if getattr(h, "stage", None) == 2}
    others -= {id(h) for h in holders}
    return (all(id(p) in given for h in holders for p in h._trainable_params())
            and not any(h._fusedist_has_grads() for h in map(gradient_holder, params) if id(h) in others))


def _clip_stage2_by(max_norm, total_norm: torch.Tensor, holders: list) -> None:
    """Clip the gradients ``holders`` (stage-2 optimizers) hold by ``total_norm``, the norm
    :func:`_public_total_norm` measured over them or one the caller made from it (Note
    [torchtitan's clip across pipeline stages of stage 2]): each records torch's coefficient,
    ``max_norm / (total_norm + 1e-6)`` at most 1, for its step."""
    sumsq = total_norm.detach().double().reshape(1).square()  # (record_clip takes a sum of squares)
    for holder in holders:
        dtypes = {p.dtype for p in holder._trainable_params()}
        holder.step_context.record_clip(sumsq.to(holder._device), float(max_norm), False, norm_result_dtype(dtypes))
        holder._fusedist_record_clipped_grads()  # Note [gradients changed after the clip] in _scaler_protocol.py


@_eager_in_compiled_code
def _clip_grad_value_eager(parameters, clip_value, foreach=None) -> None:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    for i, p in enumerate(params):
        if _held_by_stage2(p):
            raise RuntimeError(
                f"torch.nn.utils.clip_grad_value_: parameter {i} (shape {tuple(p.shape)}) has its gradient held "
                "in shards by a ZeroRedundancyOptimizer(stage=2), which keeps no p.grad, so clipping by value "
                "would change nothing. Clip by norm (torch.nn.utils.clip_grad_norm_ and fusedist.clip_grad_norm_ "
                "use the global norm there), or use stage=1.")
    _TORCH_CLIP_VALUE(params, clip_value, foreach)


# Note [torch's clip on plain parameters under torch.compile]
# The replacements are installed process-wide, so a compiled step clipping parameters that no
# fully_shard unit or stage-2 optimizer holds would meet them too: run eagerly, they broke that
# graph, and fullgraph=True, which captures torch's clip whole, refused the step as soon as any
# sharded object existed anywhere in the process. Traced, the replacements ask first whether
# any given parameter has a gradient holder -- once, when dynamo traces the call, by identity
# (the parameters are guarded by identity, and ``_generation``, counting the registrations, is
# guarded too: a new holder traces the call again) -- and with none, dynamo captures torch's
# own function, its inner norm and scaling included; only the sharded path runs eagerly.
# What this leaves, once a holder exists in the process (each checked by a compiled probe):
# * the decision is by parameter identity, so a compiled function that is handed a new list of
#   parameter objects each call (a list argument) traces again for each new set, where torch's own
#   clip guards on the tensors' metadata only and traces once; up to dynamo's recompile limit,
#   then eagerly. The same parameters with new gradients trace once.
# * ``get_total_norm`` of gradients, given without their parameters, and torch's
#   ``clip_grad_norm_`` bound by name before the replacement was installed (``from
#   torch.nn.utils import clip_grad_norm_`` at a script's top, which calls the replaced inner
#   ``_get_total_norm`` with gradients only) cannot be told from the sharded path by their
#   arguments (gradients are new tensors every step: keyed on them, every step would trace again),
#   so their norm runs eagerly: a graph break, and fullgraph=True refuses it with
#   TORCH_CLIP_REASON. ``clip_grads_with_norm_`` over plain parameters is traced.

_installed = False
_generation = 0
# while torch's clip_grad_norm_ over parameters without a holder is traced: its calls to the
# replaced _get_total_norm / _clip_grads_with_norm_ are torch's, traced with it
_tracing_torch_clip = False


@torch.compiler.assume_constant_result
def _ids_held(generation: int, ids: tuple) -> bool:
    """Whether a gradient holder holds any of the parameters whose ``id`` is in ``ids``
    (evaluated when dynamo traces the call; ``generation`` keys the answer to the registrations)."""
    del generation
    held = {id(p) for p, _ in held_parameters()}
    return any(i in held for i in ids)


def _traced_plain(params: list) -> bool:
    """Whether this call is being traced by dynamo over parameters without a gradient holder."""
    return torch.compiler.is_compiling() and not _ids_held(_generation, tuple(id(p) for p in params))


def _as_list(parameters) -> list:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _global_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None) -> torch.Tensor:
    if _tracing_torch_clip and torch.compiler.is_compiling():
        return _TORCH_TOTAL_NORM(tensors, norm_type, error_if_nonfinite, foreach)
    return _global_total_norm_eager(tensors, norm_type, error_if_nonfinite, foreach)


def _clip_grads_with_norm_stage2(parameters, max_norm, total_norm, foreach=None) -> None:
    if torch.compiler.is_compiling():
        params = _as_list(parameters)
        if _tracing_torch_clip or _traced_plain(params):
            return _TORCH_CLIP_WITH_NORM(params, max_norm, total_norm, foreach)
        parameters = params
    return _clip_grads_with_norm_eager(parameters, max_norm, total_norm, foreach)


def _global_clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    global _tracing_torch_clip
    if torch.compiler.is_compiling():
        params = _as_list(parameters)
        if _traced_plain(params):
            _tracing_torch_clip = True
            try:
                return _TORCH_CLIP(params, max_norm, norm_type, error_if_nonfinite, foreach)
            finally:
                _tracing_torch_clip = False
        parameters = params
    return _global_clip_grad_norm_eager(parameters, max_norm, norm_type, error_if_nonfinite, foreach)


def _clip_grad_value_refusing_stage2(parameters, clip_value, foreach=None) -> None:
    if torch.compiler.is_compiling():
        params = _as_list(parameters)
        if _traced_plain(params):
            return _TORCH_CLIP_VALUE(params, clip_value, foreach)
        parameters = params
    return _clip_grad_value_eager(parameters, clip_value, foreach)


functools.update_wrapper(_global_total_norm, _TORCH_TOTAL_NORM)
functools.update_wrapper(_public_total_norm, _TORCH_TOTAL_NORM)
functools.update_wrapper(_clip_grad_value_refusing_stage2, _TORCH_CLIP_VALUE)
functools.update_wrapper(_clip_grads_with_norm_stage2, _TORCH_CLIP_WITH_NORM)
functools.update_wrapper(_global_clip_grad_norm_, _TORCH_CLIP)


def install() -> None:
    """Install the replacements (once; Note [torch's clip on sharded gradients])."""
    global _installed, _generation
    _generation += 1  # (called at every registration: compiled plain clips are traced again)
    if _installed:
        return
    _installed = True
    clip_grad_module._get_total_norm = _global_total_norm
    clip_grad_module._clip_grads_with_norm_ = _clip_grads_with_norm_stage2
    nn_utils.clip_grads_with_norm_ = _clip_grads_with_norm_stage2
    nn_utils.get_total_norm = _public_total_norm
    clip_grad_module.clip_grad_norm_ = _global_clip_grad_norm_
    clip_grad_module.clip_grad_value_ = _clip_grad_value_refusing_stage2
    nn_utils.clip_grad_value_ = _clip_grad_value_refusing_stage2
    nn_utils.clip_grad_norm_ = _global_clip_grad_norm_


def installed() -> bool:
    return _installed
