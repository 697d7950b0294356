"""init_distributed's GPU binding under NCCL, checked before the group is made (the CPU-testable parts): no GPU
at all is named as such, and a LOCAL_RANK that was never set is said to have been taken from RANK."""

from __future__ import annotations

import pytest


def _launch_env(monkeypatch, rank, world, local_rank=None):
    import fusedist.distributed as fd

    def reached(*args, **kwargs):
        raise AssertionError("init_process_group reached with a GPU binding that cannot work")

    monkeypatch.setattr(fd.dist, "init_process_group", reached)
    for name, value in {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    return fd


def test_nccl_without_any_gpu_is_named_as_such(monkeypatch):
    # it said "this node has 0 GPU(s); use --nproc_per_node <= 0"
    fd = _launch_env(monkeypatch, 0, 1, local_rank=0)
    monkeypatch.setattr(fd.torch.cuda, "device_count", lambda: 0)
    with pytest.raises(RuntimeError, match=r"backend 'nccl' needs a GPU, and rank 0 sees none .*use backend='gloo'"):
        fd.init_distributed(backend="nccl")


def test_local_rank_taken_from_rank_is_said_so(monkeypatch):
    # a hand-made launch of 4 ranks on 2-GPU nodes without LOCAL_RANK: rank 3 was told "LOCAL_RANK=3", a
    # variable it never set
    fd = _launch_env(monkeypatch, 3, 4)
    monkeypatch.setattr(fd.torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RuntimeError, match=r"rank 3 has LOCAL_RANK=3 \(LOCAL_RANK is not set: RANK=3 was taken for "
                                           r"it\) but this node has 2 GPU\(s\).*torchrun sets LOCAL_RANK"):
        fd.init_distributed(backend="nccl")


def test_a_local_rank_that_was_set_is_named_as_before(monkeypatch):
    fd = _launch_env(monkeypatch, 3, 4, local_rank=2)
    monkeypatch.setattr(fd.torch.cuda, "device_count", lambda: 2)
    with pytest.raises(RuntimeError, match=r"rank 3 has LOCAL_RANK=2 but this node has 2 GPU\(s\); use "
                                           r"--nproc_per_node <= 2$"):
        fd.init_distributed(backend="nccl")
