"""Counting the all-gathers of ``fully_shard`` models, fusedist's and torch's FSDP2 side by side:
how tests and benchmarks check that the two gather alike (e.g. once per generation loop)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def counting_gathers():
    """Yield ``{"fsdp2": n, "fusedist": m}``, the all-gathers issued inside the block: FSDP2's
    one per parameter group and unshard, fusedist's one per unit and unshard."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as group_mod

    from ..fsdp.unit import ShardedUnit

    counts = {"fsdp2": 0, "fusedist": 0}
    torch_gather, our_gather = group_mod.foreach_all_gather, ShardedUnit.gather_into

    def counted_torch(*args, **kwargs):
        counts["fsdp2"] += 1
        return torch_gather(*args, **kwargs)

    def counted_ours(self, *args, **kwargs):
        counts["fusedist"] += 1
        return our_gather(self, *args, **kwargs)

    group_mod.foreach_all_gather, ShardedUnit.gather_into = counted_torch, counted_ours
    try:
        yield counts
    finally:
        group_mod.foreach_all_gather, ShardedUnit.gather_into = torch_gather, our_gather
