"""``reshard_after_forward`` as an int: after forward a unit keeps a larger part of itself, shared
with a small group of ranks, and backward gathers within that group.

Note [resharding to a smaller group after forward]
    ``fully_shard(block, reshard_after_forward=k)``, with ``k`` a divisor of the shard group's
    size ``S`` other than 1 and ``S``, is torch FSDP2's middle ground between True (free the
    gathered unit after forward, gather it over all ``S`` ranks again in backward) and False
    (keep it whole until backward). The shard group's ranks, in group order, are cut into
    consecutive runs of ``k`` (FSDP2 views its mesh as ``(-1, k)``; on a 2-D HSDP mesh the
    same runs, inside each replica's shard group, since ``k`` divides ``S``): ranks 0-1 and
    2-3 for ``S = 4, k = 2``, e.g. the ranks of one node. After forward, rank ``r`` at
    position ``j`` of its run keeps part ``j`` of ``k`` of each section of the gathered buffer
    (Note [trainable section] in layout.py) -- ``S / k`` consecutive ranks' shards, already
    in the gathered dtype -- in a copy of its own, and the gathered buffer is freed; the
    modules hold the pieces, as after any reshard. The unit's next gather (its backward, or an
    activation-checkpoint recompute, or the next forward after one without gradients)
    all-gathers those parts within the run instead of the shards over the shard group: the
    same bytes in the same places, so the results are bitwise those of ``True``, over a
    smaller, nearer group. Between forward and backward a rank holds ``1/k`` of each such
    unit (``memory_stats()['post_forward_bytes']``, also counted in ``gathered_bytes``).
    Gradients are reduce-scattered over the whole shard group as always, and the unit
    reshards fully after backward.

    Which values mean what is FSDP2's (``_get_post_forward_mesh_info``): ``k == S`` is True,
    ``k == 1`` is False (with a warning: world size 1 means "keep it all"), anything else that
    does not divide ``S`` -- 0, negative, larger than ``S`` -- is a ``ValueError`` naming the
    value and the group size, and a non-int (a float, a string) is a ``ValueError`` too. As
    in FSDP2 it applies under ``no_grad`` as well (Note [forward without gradients] in
    state.py), the root under the default ``None`` still keeps its parameters, an explicit
    int on the root is honoured, and ``set_reshard_after_forward`` takes a bool only
    (True then reshards fully after forward, False keeps the unit: the int is dropped).

    The runs' process groups are made with ``torch.distributed.new_group`` once per set of
    ranks and reused by every unit and model of the process (a unit would otherwise create a
    group per ``fully_shard`` call, which FSDP2's per-call mesh does). Each rank creates only
    its own run's group, with ``use_local_synchronization`` (only the run's members meet), so
    a shard group smaller than the world (HSDP, ZeRO groups) needs nothing from ranks
    outside it.

    The groups are made at the root's first forward, after the wrapping check
    (``wrapping_check.py``), not by ``fully_shard``: ``new_group`` waits for every member of the
    run, so a rank given ``k`` whose run partner was given ``True`` (or another ``k``) would
    wait there until the store's timeout. The check compares each unit's resolved value across
    the shard group (``reshard_after_forward=2`` on rank 0, ``True`` on the others: a
    ``RankMismatchError`` on every rank naming the unit and each rank's value), and only once it
    has passed does each rank create its runs' groups, unit by unit in the root's order -- the
    same on every rank, which ``new_group``'s naming (it counts the groups a process has) and
    its member barriers need.

    What frees the parts: the gather that consumes them, or a full reshard -- the end of a
    backward, ``reshard()``, ``reset_iter_state()``, a state-dict save or load, a conversion
    (``model.to``), an optimizer step over the unit's pieces (the parts are a gathered copy
    the step makes stale: Note [gathered copies and the optimizer step] in stale.py). A unit
    whose tied weight is still used by a gathered borrower (Note [lent parameters] in
    unit.py) reshards fully once that borrower is done, as with True.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch.distributed as dist

__all__ = ["PostForwardGroup", "resolve_reshard_after_forward"]


@dataclasses.dataclass(frozen=True)
class PostForwardGroup:
    """The run of ``size`` ranks a unit reshards to after forward: this rank is at ``rank`` of
    ``ranks`` (global ranks); :attr:`comm` gathers over them."""

    size: int
    rank: int
    ranks: tuple
    device: object

    @property
    def comm(self):
        return self.connect()

    def connect(self):
        """The run's communicator. The first call makes the run's process group, which waits for
        the run's members: only once the wrapping check has passed (Note [resharding to a
        smaller group after forward])."""
        from ..comm import get_communicator

        world = dist.group.WORLD
        entry = _GROUPS.get((id(world), self.ranks))
        if entry is None or entry[0] is not world:  # (a re-created world gets fresh groups)
            group = dist.new_group(list(self.ranks), use_local_synchronization=True)
            entry = _GROUPS[(id(world), self.ranks)] = (world, group)
        return get_communicator(entry[1], self.device)


#: (world group, run's global ranks) -> (world group, process group): one group per run
_GROUPS: dict = {}


def _meaning_of_factors(size: int) -> str:
    """What the ends of the factor range mean; a one-rank shard group (HSDP with one shard per
    replica) has a single factor, which keeps the parameters whole."""
    if size == 1:
        return "a shard group of one rank has the single factor 1, which keeps the parameters whole, as False"
    return f"k = {size} is True, k = 1 is False"


def resolve_reshard_after_forward(value, shard_comm, shard_group, device, *, who: str = "fully_shard"):
    """``(flag, group)`` for a ``reshard_after_forward`` value (Note [resharding to a smaller
    group after forward]): ``flag`` None/True/False as the unit's, ``group`` the
    :class:`PostForwardGroup` for an int ``k`` with ``1 < k < S``, else None. Makes no process
    group: :attr:`PostForwardGroup.comm` does, once the ranks are known to agree."""
    if value is None or isinstance(value, bool):
        return value, None
    if not isinstance(value, int):
        raise ValueError(f"fusedist.{who}: reshard_after_forward should be a bool or an int representing the group "
                         f"size to reshard to, not {value!r}")
    size = shard_comm.world_size
    if value < 1 or value > size or size % value != 0:
        raise ValueError(
            f"fusedist.{who}: if passing reshard_after_forward as an int, it should be a factor of the shard "
            f"group's size {size}, not {value} (an int k reshards each unit after forward to groups of k ranks; "
            f"{_meaning_of_factors(size)})")
    if value == 1:
        warnings.warn("reshard_after_forward=1 (int) means resharding parameters to world size 1, i.e. keeping "
                      "them whole after forward, as reshard_after_forward=False; pass True (a bool) to reshard "
                      "to the whole shard group", UserWarning, stacklevel=3)
        return False, None
    if value == size:
        return True, None
    ranks = dist.get_process_group_ranks(shard_group if shard_group is not None else dist.group.WORLD)
    pos = shard_comm.rank
    start = pos // value * value
    return True, PostForwardGroup(value, pos - start, tuple(ranks[start:start + value]), device)
