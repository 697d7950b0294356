"""fully_shard over a group torch's own ``init_process_group`` made, on two gloo ranks:

- Note [settings that must agree] (fusedist/reliability/settings_agreement.py): ``init_distributed`` compares the
  FUSEDIST_* settings that decide which collectives a step runs; a program that made its group with torch's
  ``init_process_group`` skipped that, and fully_shard's first-forward wrapping check (fusedist/fsdp/wrapping_check.py)
  did not compare them, so a rank with another value paired its collectives wrongly later. The check now compares
  them: every rank raises the same RankMismatchError naming the variable and each rank's value (torch knows none of
  these settings: the reference is that prompt error on every rank), and equal settings run as the unsharded model.
- ``shard_placement_fn`` returning ``_StridedShard``: torch 2.13's FSDP2 refuses it (ValueError: "Invalid
  shard_placement_fn result"); fusedist refuses it too, naming the parameter and saying what to return instead.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed
from shared_rank_launch import refused as _refused


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))


def _sharded(net):
    import fusedist

    for layer in (net[0], net[2]):
        fusedist.fully_shard(layer)
    return fusedist.fully_shard(net)


def _worker(rank, world):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.placement_types import _StridedShard

    import fusedist

    out = {}
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    if rank == 1:
        os.environ["FUSEDIST_PARAM_CHECK_EVERY"] = "7"
    out["differ"] = _refused(lambda: _sharded(_net())(x))
    os.environ.pop("FUSEDIST_PARAM_CHECK_EVERY", None)
    out["alike"] = float((_sharded(_net())(x) - _net()(x)).detach().abs().max())

    def strided(p):
        return _StridedShard(0, split_factor=2)

    out["strided torch"] = _refused(lambda: torch_fully_shard(nn.Linear(4, 8), shard_placement_fn=strided))
    out["strided"] = _refused(lambda: fusedist.fully_shard(nn.Linear(4, 8), shard_placement_fn=strided))
    return out


@pytest.fixture(scope="module")
def launched():
    return run_distributed(_worker, 2, timeout=120)


def test_fully_shard_over_torchs_own_group_compares_the_settings_that_must_agree(launched):
    from fusedist.reliability.config import param_check_every

    default = param_check_every()
    for rank, out in enumerate(launched):
        differ = out["differ"]
        assert differ is not None and differ.startswith("RankMismatchError"), (rank, differ)
        assert "the fully_shard wrapping of the model differs across ranks" in differ, (rank, differ)
        assert f"the setting FUSEDIST_PARAM_CHECK_EVERY={default!r}" in differ, (rank, differ)
        assert "the setting FUSEDIST_PARAM_CHECK_EVERY=7" in differ, (rank, differ)
        assert out["alike"] < 1e-6, (rank, out["alike"])  # equal settings: the unsharded model's output


def test_a_strided_shard_placement_is_refused_as_torch_refuses_it(launched):
    for rank, out in enumerate(launched):
        assert out["strided torch"].startswith("ValueError: Invalid shard_placement_fn result"), out["strided torch"]
        refused = out["strided"]
        assert refused is not None and "shard_placement_fn returned _StridedShard" in refused, (rank, refused)
        assert "for 'weight' (shape (8, 4))" in refused and "Return Shard(dim)" in refused, (rank, refused)
