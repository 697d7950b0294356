"""Copies of a ZeroRedundancyOptimizer (``copy.deepcopy``, ``copy.copy``, ``pickle``, ``torch.save``): refused.

Note [copies of a sharded optimizer]
    torch's ``Optimizer`` copies through ``__getstate__``: its defaults, state and param groups.
    A copy of this optimizer made that way was hollow -- no shards, communicator, DDP wiring or
    inner optimizer -- and failed at its first ``step()`` on a missing attribute (torch's
    ZeroRedundancyOptimizer copies the same way and fails the same way). A working copy cannot
    be made by one rank alone: its shards are slices of a flat space over every rank of the
    process group, its step ends in collectives every rank must join in the same order, and a
    stage-2 optimizer receives the DDP model's reduce-scattered gradients, which one optimizer
    per model can. So a copy is refused at once, saying how to get a second optimizer with the
    same state: build one (on every rank) and load this one's. Pickling (``pickle.dumps``,
    ``torch.save(optimizer)``) went through the same ``__getstate__`` and unpickled into the same
    hollow object, which a program saving its optimizer object found only when resuming; it is
    refused alike, naming the state dicts to save instead -- in ``__getstate__`` too, which every
    pickling path reads (a subclass's own ``__reduce_ex__`` included).
"""

from __future__ import annotations


def _refuse(zero, memo=None):
    raise TypeError(
        f"ZeroRedundancyOptimizer (rank {zero.rank} of {zero.world_size}) cannot be copied or pickled: its state is "
        "sharded over the ranks of its process group and its step() runs collectives with the other ranks' "
        "shards (stage 2: it also receives its DDP model's reduced gradients), so a copy made by one rank "
        "would be hollow (torch's ZeroRedundancyOptimizer's copy fails at its first use). To get a second "
        "optimizer with this one's state, build a new ZeroRedundancyOptimizer on every rank and load it: "
        "new.load_state_dict(every rank's shard_state_dict(), as a list, e.g. from "
        "torch.distributed.all_gather_object), or fusedist.checkpoint.save / load. To save it, save "
        "shard_state_dict() on every rank, or consolidate_state_dict(to=0) on every rank and then "
        "state_dict() on rank 0")


def _refuse_pickle(zero, protocol=None):
    _refuse(zero)


def _refuse_getstate(zero):
    _refuse(zero)


def refuse_copies(cls: type) -> None:
    """Give ``cls`` a ``__deepcopy__``, ``__copy__``, ``__reduce_ex__`` and ``__getstate__`` that refuse
    (Note [copies of a sharded optimizer])."""
    cls.__deepcopy__ = _refuse
    cls.__copy__ = _refuse
    cls.__reduce_ex__ = _refuse_pickle
    cls.__reduce__ = _refuse_pickle
    cls.__getstate__ = _refuse_getstate
