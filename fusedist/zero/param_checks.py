"""Parameter lists a ZeroRedundancyOptimizer refuses, with the reason, before it builds shards.

Kept apart from the optimizer because each check is about what the *user* passed -- the
``params`` argument, a group given to ``add_param_group``, the same list on every rank -- and
says so in torch's terms; the shards themselves are never half-built when one fails.

Note [the same parameters on every rank]
    Every rank shards the same flat space (Note [flat partition] in ``partition.py``), so the
    ranks must pass the same parameters: the same count, shapes, dtypes, trainability and
    param groups, in the same order. With a fusedist DDP model its construction check sees the
    model; the optimizer's own list (which parameters, in which groups and order) is not the
    model's. Without one nothing compared them: ranks whose lists differed built different
    buckets, and the first parameter all-gather received a message of another size (gloo
    aborted the process) or, with equal sizes in another order, every rank silently stepped
    other parameters' elements. torch's ZeroRedundancyOptimizer has the same hazard. So the
    constructor exchanges one small description per parameter (a collective: every rank
    constructs the optimizer, as every rank wraps the model) and every rank raises the same
    :class:`fusedist.RankMismatchError` naming the first parameter that differs and the ranks.
    ``add_param_group`` compares the group it adds the same way, before the group joins, and a
    refusal of a rank's own list (a subset of a DDP model's parameters in stage 2) is raised only
    after the comparison, so that a list differing on one rank fails on every rank alike.
    The same exchange carries every param group's hyperparameters (Note [the same
    hyperparameters on every rank] in ``hyper_checks.py``), after the parameters, and the
    settings that decide the collectives and the shards (offload, stage, optimizer_class, and
    without DDP bucket_cap_mb: offload on one rank only ran the offload's own collective there
    alone). The memory format is compared: a parameter channels_last on one rank only lies in
    another element order in that rank's flat buffer (``shaped_like``), and the ranks would
    exchange unrelated elements; so is the device type (a layer left on the meta device on one
    rank). A refusal of a rank's own arguments is an entry of the exchange too (Note [refusals of
    one rank's own arguments]).
"""

from __future__ import annotations

import re

import torch

from .._consistency import gather_objects, raise_if_different
from ..ddp.layout import slot_order
from . import hyper_checks, param_labels


# Note [refusals of one rank's own arguments]
#     What the constructor refuses from one rank's own arguments alone -- its options (stage,
#     offload, an optimizer_class that is not elementwise), a parameter given twice or on another
#     device, a hyperparameter the inner optimizer refuses (a negative lr), and with ``offload="cpu"`` a
#     dtype or a group option the host Adam cannot run (amsgrad, differentiable, capturable) --
#     was raised before the comparison of the parameter lists, a collective. Where it differed
#     across ranks (a config read per host: offload or amsgrad on one rank, a model cast to
#     float64 on one rank) the refusing rank raised alone and the others waited in the comparison
#     until the stall timeout. So the constructor collects this rank's refusal first, the ranks
#     compare (the refusal is an entry of the exchange), and then every rank raises: the same
#     RankMismatchError naming the refusing rank and its reason where the ranks differ, each its
#     own error where all refuse alike. ``add_param_group`` does the same with its group.
def check_arguments(stage, offload, max_buckets_in_flight, overlap_with_ddp) -> None:
    """The constructor's own arguments, refused by name (Note [refusals of one rank's own arguments])."""
    from .._rank import this_rank
    from .grad_sync import check_max_buckets_in_flight
    from .offload import OFFLOAD_CHOICES

    op = f"ZeroRedundancyOptimizer (rank {this_rank()})"  # (a config read per host differs by rank)
    if overlap_with_ddp:
        raise ValueError(f"{op}: overlap_with_ddp=True is torch's option (its DDP communication hook steps the "
                         "optimizer during backward); leave it out and use stage=2 with a fusedist "
                         "DistributedDataParallel model, which reduce-scatters each gradient bucket during backward")
    if stage not in (1, 2):
        raise ValueError(f"{op}: stage must be 1 or 2, got {stage!r} (stage 3 is fusedist.fully_shard)")
    check_max_buckets_in_flight(max_buckets_in_flight, this_rank())
    if offload not in OFFLOAD_CHOICES:
        raise ValueError(f"{op}: offload must be None or 'cpu', got {offload!r}")


class TorchZeroHookRefusal(ValueError, AttributeError):
    """Raised by the ``_overlap_with_ddp`` attribute torch's ZeRO hooks read: an AttributeError too,
    so ``hasattr`` and introspection (``inspect.getmembers``) read the attribute as absent."""


def torch_zero_hook_refusal(rank: int) -> ValueError:
    """The error for torch's DDP communication hooks that step torch's ZeroRedundancyOptimizer
    (``hook_with_zero_step``): they need its ``overlap_with_ddp`` internals."""
    return TorchZeroHookRefusal(
        f"fusedist.ZeroRedundancyOptimizer (rank {rank}) does not run in torch's hook_with_zero_step / "
        "hook_with_zero_step_interleaved (they step torch's ZeroRedundancyOptimizer built with "
        "overlap_with_ddp=True). Leave the hook out and use stage=2 with a fusedist DistributedDataParallel "
        "model: it reduce-scatters each gradient bucket during backward (overlap_param_gather=True also "
        "overlaps the parameter all-gather with the next forward)")


def own_refusal(zero, groups=None, params=None, first: int = 0, op: str = "ZeroRedundancyOptimizer"):
    """This rank's refusal of its own arguments (Note [refusals of one rank's own arguments]), or
    None: ``params`` (default: the optimizer's), indexed from ``first``, and ``groups`` (default:
    every param group, by index; given, the groups ``add_param_group`` adds) after their defaults
    are filled in."""
    from .offload import check_offload_config, check_offload_group

    try:
        everything = zero._params if params is None else zero._params + list(params)
        group_of = zero._group_of + [len(zero.param_groups) - 1] * (len(everything) - len(zero._group_of))

        def name(i):  # Note [naming a parameter given without its name] in param_labels.py
            return param_labels.describe(zero, i, everything, group_of)

        def short(i):
            return param_labels.short(zero, i, everything, group_of)

        def named(i):
            return param_labels.named(zero, i, everything, group_of)

        check_distinct(everything, group_of, name, first=first)
        trainable = {i: p for i, p in enumerate(everything) if i >= first and p.requires_grad}
        for i, p in trainable.items():
            if not (p.is_floating_point() or p.is_complex()):
                raise TypeError(f"{op}: parameter {i} has dtype {p.dtype}{named(i)}; only floating-point and complex "
                                "parameters can be sharded")
        _refuse_fully_sharded(trainable, op)
        _check_one_device(zero, trainable, op, name, short)
        zero._fill_group_defaults()
        if zero.offload:
            if groups is None:  # (a joining parameter's dtype is checked when it joins, Note [growing ...])
                check_offload_config(zero.optimizer_class, trainable, named)
            for gi in range(len(zero.param_groups)) if groups is None else groups:
                check_offload_group(zero.param_groups[gi], gi, constructing=True)
    except Exception as exc:  # noqa: BLE001 - raised as it is, once the ranks have compared
        return exc
    return None


def _refuse_fully_sharded(trainable: dict, op: str) -> None:
    """A ``fully_shard`` model's parameters are pieces, already sharded over the ranks (each rank holds
    another piece, of another shape): the ranks' parameter lists differed, and the comparison said
    only that, pointing away from the cause."""
    held = next((i for i, p in trainable.items() if param_labels.fully_shard_holds(p)), None)
    if held is not None:  # (named without the piece's shape, which differs across ranks: the same error on every rank)
        raise ValueError(
            f"{op}: parameter {held} ('{param_labels.module_path(trainable[held])}') belongs to a fully_shard "
            "model, whose parameters are already sharded over the "
            "ranks (each rank holds its own piece) and whose optimizer state is sharded with them. Step its "
            "parameters with an ordinary optimizer (torch.optim.AdamW, fusedist.optim.FusedAdamW); "
            "ZeroRedundancyOptimizer shards the replicated parameters of a DDP (or unwrapped) model.")


def _check_one_device(zero, trainable: dict, op: str, name, short) -> None:
    """The flat buffers, masters and collectives of one optimizer are on one device
    (``zero._device``): a trainable parameter elsewhere (a layer left on the meta device, or on
    another GPU) failed at the first step with a bare copy error, on that rank alone."""
    for i, p in trainable.items():
        if p.device != zero._device:
            j = next((k for k, q in enumerate(zero._params) if q.requires_grad and q.device == zero._device), None)
            raise ValueError(
                f"{op}: {name(i)} is on {p.device}, "
                + (f"{short(j)} on {zero._device}" if j is not None else f"the optimizer's on {zero._device}")
                + "; one optimizer shards the parameters of one device (its flat buffers and collectives are "
                "there). Move the model to one device before building it; a parameter on the meta device must be "
                "materialized first (module.to_empty(device=...) and its initialization)")


# Note [torch's refusals before the communicator is known]
#     torch's ``Optimizer.__init__`` refuses some parameter lists itself -- an empty one, a single
#     tensor, a non-leaf tensor, a parameter in two groups -- and it runs before this optimizer knows
#     its parameters' DDP model or device. Where one rank alone was refused (an empty list on the
#     rank whose pipeline stage or expert owns nothing, a per-host config), it raised alone and the
#     others waited in the parameter comparison (Note [the same parameters on every rank]) until the
#     stall timeout. So a refused rank still takes part in that comparison, with the refusal as its
#     one entry, over the communicator of ``process_group`` (the default group when None), and every
#     rank raises at once: the same RankMismatchError naming the refused rank and torch's message, or,
#     where every rank was refused alike, torch's own error. (Ranks whose parameters belong to a DDP
#     model over another group than the one given compare over the model's communicator: pass that
#     group as ``process_group`` for the refused rank to meet them.)
def refuse_with_every_rank(zero, refusal: Exception, process_group, bucket_cap_bytes: int) -> None:
    """Raise ``refusal`` of torch's ``Optimizer.__init__`` after the parameter comparison, on
    every rank alike (Note [torch's refusals before the communicator is known])."""
    import torch.distributed as dist

    from ..comm import get_communicator

    if not (dist.is_available() and dist.is_initialized()):
        raise refusal
    group = process_group if process_group is not None else dist.group.WORLD
    try:
        nccl = "nccl" in str(dist.get_backend(group)).lower() and torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        comm = get_communicator(process_group, device)
    except (RuntimeError, ValueError):
        raise refusal from None  # (not a member of the group: no comparison to meet)
    zero.ddp, zero.comm, zero.world_size = None, comm, comm.world_size
    zero._params, zero._group_of, zero.param_groups = [], [], []
    zero.bucket_cap_bytes = bucket_cap_bytes
    check_same_params_on_every_rank(zero, refusal=refusal)
    raise refusal


def check_param_groups_given(params) -> list:
    """``params`` as a list; a group dict without ``"params"`` is refused as torch's
    ZeroRedundancyOptimizer refuses it (torch's ``Optimizer`` fails with a bare KeyError)."""
    if isinstance(params, torch.Tensor):
        return params  # torch's Optimizer raises its TypeError for a single tensor
    params = list(params)
    for gi, group in enumerate(params):
        if isinstance(group, dict) and "params" not in group:
            raise ValueError(
                f"ZeroRedundancyOptimizer: param group {gi} has no 'params' key (it has {sorted(group)}); "
                "each parameter group passed via `params` must map 'params' to the group's parameters"
            )
    return params


def check_distinct(params: list, group_of: list, describe, first: int = 0) -> None:
    """Refuse a parameter given twice (from index ``first`` on). torch's optimizers only warn
    when one group lists a tensor twice, and step it twice per step; a sharded parameter has
    one slot in the flat space, so it cannot be stepped twice. (Twice in *different* groups
    torch refuses already.)"""
    seen: dict = {}
    for i, p in enumerate(params):
        j = seen.setdefault(p, i)
        if j != i and i >= first:
            raise ValueError(
                f"ZeroRedundancyOptimizer: {describe(i)} in param group {group_of[i]} is the same tensor as "
                f"{describe(j)} in param group {group_of[j]}; pass each parameter once (torch's optimizers "
                "would step it twice per step, and warn that this will become an error)"
            )


def check_same_params_on_every_rank(zero, params=None, group_of=None, first: int = 0, refusal=None) -> None:
    """Note [the same parameters on every rank]: ``params`` (default: the optimizer's), whose
    indices start at ``first``. ``add_param_group`` checks the group it adds (before the group
    joins): ranks adding different parameters grew different buckets, and the next step's
    all-gathers silently exchanged unrelated elements (without DDP) or left the ranks whose
    group missed a parameter DDP reduces raising alone while the others waited. ``refusal``: an
    error of this rank's own arguments, raised after the comparison (:func:`own_refusal`,
    :func:`wiring.find_ddp`). The exchange carries the settings too (:func:`_settings`)."""
    if zero.comm is None or zero.world_size == 1:
        if refusal is not None:
            raise refusal
        return
    params = zero._params if params is None else params
    group_of = zero._group_of if group_of is None else group_of
    names = param_labels.names_for_exchange(zero, params, group_of)  # for the message only (NamedEntry)
    entries = [param_labels.NamedEntry((first + i, group_of[i], tuple(p.shape), str(p.dtype).replace("torch.", ""),
                                        bool(p.requires_grad), slot_order(p), p.device.type, names[i]))
               for i, p in enumerate(params)]
    if refusal is not None:  # refused on some ranks only: the difference to name first (without the rank)
        reason = re.sub(r"\s*\(rank \d+\)", "", str(refusal)).split(";")[0][:160]
        entries.insert(0, ("refused", type(refusal).__name__, reason))

    def label(e):
        if e[0] == "refused":
            return f"this rank's own refusal of its arguments ({e[1]}: {e[2]})"
        return (f"parameter {e[0]}" + (f" ('{e[7]}')" if e[7] else "") + f" (param group {e[1]}) shape {e[2]} {e[3]}"
                + (f" in the memory order of strides {e[5]}" if e[5] else "")
                + ("" if e[4] else " requires_grad=False") + f" on {e[6]}")

    adding = first > 0
    op = "ZeroRedundancyOptimizer" + (".add_param_group" if adding else " construction") + ": parameter check"
    # One exchange for both (Note [the same hyperparameters on every rank] in hyper_checks.py),
    # compared apart: a parameter list one entry short must not pair its hyperparameters with
    # the others' parameters.
    hyper = hyper_checks.hyperparameter_entries(zero.param_groups)
    everyone = gather_objects((entries, hyper, _settings(zero)), zero.comm, op)
    if refusal is not None and all(e[0][:1] == entries[:1] for e in everyone):
        # Refused alike on every rank: each raises its own error, whatever else differs (rank-local
        # parameters a DDP model ignores may differ in shape across ranks).
        raise refusal
    rank = zero.comm.rank
    raise_if_different(
        [e[0] for e in everyone], rank,
        "the param group given to ZeroRedundancyOptimizer.add_param_group" if adding
        else "the parameter list given to ZeroRedundancyOptimizer", label,
        "Every rank must add the same parameters, in the same order; the group was not added." if adding
        else "Every rank must pass the same parameters, in the same param groups and order "
        "(e.g. model.parameters() of the same model on every rank).")
    raise_if_different(
        [e[2] for e in everyone], rank, "the settings given to ZeroRedundancyOptimizer", lambda e: f"{e[0]}={e[1]}",
        "Every rank must build the optimizer with the same offload, stage, optimizer_class (and, without a DDP "
        "model, bucket_cap_mb): each rank runs its part of the same collectives on the same shards.")
    raise_if_different(
        [e[1] for e in everyone], rank,
        "the param groups' hyperparameters given to ZeroRedundancyOptimizer"
        + (".add_param_group (the new group's, or the groups' before it)" if adding else ""), hyper_checks.label,
        ("Every rank must add the group with the same hyperparameters; the group was not added. " if adding
         else "") + hyper_checks.HINT)
    if refusal is not None:
        raise refusal


def _settings(zero) -> list:
    """The constructor's settings that decide the collectives and the shards: ranks that differ
    in one (offload on one rank only, read from a per-host config) ran different collectives
    (the offload's ISA check on one rank, the others on into their first step) or cut other shards."""
    cls = zero.optimizer_class
    settings = [("offload", zero.offload), ("stage", zero.stage),
                ("optimizer_class", f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls)}")]
    if zero.ddp is None:  # (with DDP its buckets are the shards' and bucket_cap_mb is not read)
        settings.append(("bucket_cap_mb", zero.bucket_cap_bytes / MIB))
    return settings


MIB = 1024 * 1024

