"""Probes of the pure layout functions (DDP buckets, fully_shard pieces, ZeRO partition,
checkpoint fragments) against torch's own references, on random inputs."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from fusedist.ddp.layout import build_layout

SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck))
DTYPES = [torch.float32, torch.bfloat16, torch.float64]


@settings(max_examples=150, **SETTINGS)
@given(st.lists(st.tuples(st.lists(st.integers(0, 6), max_size=3), st.sampled_from(DTYPES)), min_size=1, max_size=20),
       st.lists(st.integers(0, 300), min_size=1, max_size=3), st.integers(1, 4))
def test_ddp_buckets_are_numbered_in_the_order_they_become_ready(specs, caps, world_size):
    """Launches go in bucket order; a bucket of one dtype opened early but filled last (a bf16
    scale at both ends of an fp32 model) was bucket 0, so no bucket launched before backward
    ended. torch's rebuilt buckets come in the order they close."""
    params = [nn.Parameter(torch.zeros(tuple(shape), dtype=dtype)) for shape, dtype in specs]
    layout = build_layout(params, [str(i) for i in range(len(params))], caps=caps, world_size=world_size,
                          device=torch.device("meta"))
    index = {id(p): i for i, p in enumerate(params)}
    ours = [[index[id(p)] for p in b.params] for b in layout.buckets]
    theirs, _ = torch.distributed._compute_bucket_assignment_by_size(
        [p.detach() for p in params], caps, [False] * len(params), list(range(len(params))))
    # (torch lists the buckets still open at the end in no set order: ordered by readiness here)
    assert ours == sorted((list(b) for b in theirs), key=max)
    ready = [max(b) for b in ours]
    assert ready == sorted(ready)


def test_ddp_mixed_dtype_bucket_filled_last_is_launched_last():
    f32 = [nn.Parameter(torch.zeros(64, 64)) for _ in range(3)]
    first, last = nn.Parameter(torch.zeros(4, dtype=torch.bfloat16)), nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    params = [first, *f32, last]  # readiness order
    layout = build_layout(params, [str(i) for i in range(5)], caps=[64 * 64 * 4], world_size=2,
                          device=torch.device("meta"))
    assert [b.dtype for b in layout.buckets] == [torch.float32] * 3 + [torch.bfloat16]


def _memory_format_worker(rank, world, which, formats):
    import fusedist

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))
    if formats[rank] == "channels_last":
        model = model.to(memory_format=torch.channels_last)
    try:
        if which == "ddp":
            model = fusedist.DistributedDataParallel(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        else:
            opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    except fusedist.RankMismatchError as e:
        return str(e)
    # (ZeRO without a DDP model needs the same gradients on every rank: Note [gradients nobody averaged])
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(rank if which == "ddp" else 0))
    model(x).square().mean().backward()
    opt.step()
    inner = model.module if which == "ddp" else model
    return inner[0].weight.detach().contiguous()


def test_parameters_in_another_memory_format_on_one_rank_are_refused():
    """Each rank's gradient slot / flat parameter buffer holds a parameter in its memory order
    (``shaped_like``): channels_last on one rank only made DDP average unrelated elements and
    ZeRO exchange them, silently (ranks diverged). torch's DDP refuses such strides at
    construction; fusedist now raises RankMismatchError on every rank, naming the parameter."""
    from fusedist.testing import run_distributed

    for which in ("ddp", "zero"):
        errors = run_distributed(_memory_format_worker, 2, which, ("contiguous", "channels_last"), timeout=120)
        for e in errors:
            assert isinstance(e, str) and "differs across ranks" in e and "memory order of strides" in e, e
        assert "'0.weight'" in errors[0] if which == "ddp" else "parameter 0 " in errors[0]
        same = run_distributed(_memory_format_worker, 2, which, ("channels_last", "channels_last"), timeout=120)
        torch.testing.assert_close(same[0], same[1], rtol=0, atol=0)  # the ranks agree after a step
