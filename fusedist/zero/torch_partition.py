"""torch's partition attributes, which a flat sharded optimizer cannot give.

Note [torch's whole-parameter partition]
    torch's ZeroRedundancyOptimizer assigns whole parameters to ranks, and scripts read the
    assignment through ``_partition_parameters()`` (each rank's param groups) and
    ``_param_to_rank`` (parameter -> its one rank), e.g. to log which rank owns a layer or to
    gather a parameter's state from its owner. Here every rank owns an equal contiguous slice of
    each bucket of the flat parameter space, so a parameter may be cut between ranks and has no
    one owner; reading them failed with a bare ``AttributeError: 'ZeroRedundancyOptimizer' object
    has no attribute '_param_to_rank'``, which reads as a missing feature or a version mismatch.
    Each now raises an AttributeError (``hasattr`` still answers False) that says why and what to
    read instead.
"""

from __future__ import annotations


class TorchPartitionRefusal(AttributeError):
    """Raised when torch's whole-parameter partition attributes are read (Note [torch's
    whole-parameter partition])."""


def partition_refusal(zero, name: str) -> TorchPartitionRefusal:
    return TorchPartitionRefusal(
        f"fusedist.ZeroRedundancyOptimizer (rank {getattr(zero, 'rank', 0)}) has no {name}: it does not assign "
        "whole parameters to ranks as torch's ZeroRedundancyOptimizer does; every rank owns an equal slice of "
        "each bucket of the flat parameter space, so a parameter may be cut between ranks. Read this rank's "
        "share with shard_state_dict() or memory_stats(), or every parameter's state with "
        "consolidate_state_dict(to=...) and then state_dict() on that rank")


def _refused(name: str) -> property:
    def get(self):
        raise partition_refusal(self, name)
    return property(get, doc=f"torch's ``{name}``: refused (Note [torch's whole-parameter partition]).")


def refuse_partition_attributes(cls: type) -> None:
    """Give ``cls`` torch's partition attributes, each raising :class:`TorchPartitionRefusal`."""
    cls._partition_parameters = _refused("_partition_parameters()")
    cls._param_to_rank = _refused("_param_to_rank")
