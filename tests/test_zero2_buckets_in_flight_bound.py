"""ZeRO stage 2 bounds the gradient buckets whose reduce-scatter is in flight (Note [buckets in
flight] in fusedist/ddp/reducer.py, Note [stage 2 gradients] in fusedist/zero/grad_sync.py).

A slow network is simulated by a communicator whose reduce-scatter handles never read as
completed from a gradient hook: only ``wait()`` finishes them. Unbounded, every bucket then
stays allocated to the end of backward (the whole model's gradients); bounded, at most
``max_buckets_in_flight`` buckets plus the one being filled. The bound changes when buckets are
finished, never what is stored: the results equal the unbounded run's bit for bit, and torch's
DDP + AdamW within fp32 tolerance.
"""

import copy

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed

# One bucket per Linear(16, 16) layer (weight 1024 bytes + bias 64: the cap closes at the weight).
PER_LAYER = dict(bucket_cap_mb=0.001, first_bucket_cap_mb=0.001)
LAYERS = 8
STEPS = 4
ACCUMULATE_AT = 2  # this step runs one no_sync micro-batch before the synchronized one


class _NeverEarly:
    """A collective that reads as not completed whenever a gradient hook asks: it lands later
    than every following bucket's gradients (``wait()`` still returns its result)."""

    def __init__(self, inner):
        self._inner = inner

    def is_completed(self):
        return False

    def wait(self, *args, **kwargs):
        return self._inner.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _SlowReduceScatter:
    """The reducer's communicator with every reduce-scatter and all-reduce handle wrapped in
    ``_NeverEarly``."""

    def __init__(self, inner):
        self._inner = inner

    def reduce_scatter(self, *args, **kwargs):
        return _NeverEarly(self._inner.reduce_scatter(*args, **kwargs))

    def all_reduce(self, *args, **kwargs):
        return _NeverEarly(self._inner.all_reduce(*args, **kwargs))

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _model():
    torch.manual_seed(7)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*layers)


def _groups(model):
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [dict(params=weights, weight_decay=0.1), dict(params=biases, weight_decay=0.0, lr=5e-3)]


def _batches(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    n = 2 if step == ACCUMULATE_AT else 1
    return [(torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)) for _ in range(n)]


def _train(rank, model, opt, no_sync, reducer=None):
    """STEPS steps (one with a no_sync micro-batch first); the reducer's stats of each step."""
    stats = []
    for step in range(STEPS):
        opt.zero_grad()
        *early, (x, y) = _batches(rank, step)
        for ex, ey in early:
            with no_sync():
                nn.functional.mse_loss(model(ex), ey).backward()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if reducer is not None:
            stats.append(dict(reducer.last_stats))
    return stats


def _zero2(base, bound, reduce_dtype):
    """fusedist DDP + ZeRO stage 2 AdamW over a slow reduce-scatter, ``bound`` buckets in flight
    (``"default"``: left as constructed)."""
    import fusedist

    ddp = fusedist.DistributedDataParallel(copy.deepcopy(base), reduce_dtype=reduce_dtype, **PER_LAYER)
    bound = {} if bound == "default" else {"max_buckets_in_flight": bound}
    opt = fusedist.ZeroRedundancyOptimizer(_groups(ddp.module), torch.optim.AdamW, stage=2, lr=1e-2, **bound)
    ddp.reducer.comm = _SlowReduceScatter(ddp.reducer.comm)
    return ddp, opt


def _worker(rank, world):
    base = _model()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ref_opt = torch.optim.AdamW(_groups(ref.module), lr=1e-2)
    _train(rank, ref, ref_opt, ref.no_sync)
    out = {"torch": torch.cat([p.detach().reshape(-1) for p in ref.parameters()])}
    for reduce_dtype in (None, torch.bfloat16):
        for bound in (None, 1, "default"):
            ddp, opt = _zero2(base, bound, reduce_dtype)
            stats = _train(rank, ddp, opt, ddp.no_sync, ddp.reducer)
            opt.wait_for_params()
            out[(reduce_dtype, bound)] = {
                "params": torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]),
                "stats": stats,
                "bucket_bytes": [b.nbytes for b in ddp.reducer.layout.buckets],
                "resolved": ddp.reducer.strategy.max_buckets_in_flight,
            }
    return out


@pytest.fixture(scope="module")
def slow_runs():
    return run_distributed(_worker, 3, timeout=180)


def test_slow_reduce_scatter_holds_at_most_the_bound_plus_the_bucket_filling(slow_runs):
    for out in slow_runs:
        for reduce_dtype in (None, torch.bfloat16):
            unbounded = out[(reduce_dtype, None)]
            assert len(unbounded["bucket_bytes"]) == LAYERS
            largest = max(unbounded["bucket_bytes"])
            for step, st in enumerate(unbounded["stats"]):
                if reduce_dtype is None:  # what the bound prevents: every bucket held to the end
                    assert st["peak_grad_bytes"] == st["grad_bytes"] > 3 * largest, st
                elif step != ACCUMULATE_AT:  # converted buckets are released at launch: their bf16 copies held
                    assert st["peak_grad_bytes"] < st["grad_bytes"], st
            for bound in (1, "default"):
                run = out[(reduce_dtype, bound)]
                k = run["resolved"]
                assert k == (1 if bound == 1 else 2)
                for step, st in enumerate(run["stats"]):
                    if step == ACCUMULATE_AT:  # no_sync filled every bucket before this backward
                        # (with a bf16 reduce, the first bucket's copy is made before the bucket is released)
                        copy_made = largest // 2 if reduce_dtype is not None else 0
                        assert st["peak_grad_bytes"] == st["grad_bytes"] + copy_made, st
                        continue
                    assert st["peak_grad_bytes"] <= (k + 1) * largest, (bound, reduce_dtype, step, st)
                    # waited for in the gradient hooks, all but the last k
                    assert st["buckets_finished_in_backward"] == LAYERS - k, st


def test_bounded_stage2_numerics_equal_unbounded_and_torch(slow_runs):
    for out in slow_runs:
        for reduce_dtype in (None, torch.bfloat16):
            unbounded = out[(reduce_dtype, None)]["params"]
            for bound in (1, "default"):
                assert torch.equal(out[(reduce_dtype, bound)]["params"], unbounded), (reduce_dtype, bound)
        torch.testing.assert_close(out[(None, 1)]["params"], out["torch"], rtol=0, atol=1e-5)
        # bf16 on the wire: within bf16 rounding of the fp32 result after a few steps
        torch.testing.assert_close(out[(torch.bfloat16, 1)]["params"], out["torch"], rtol=0, atol=2e-3)
    for out in slow_runs[1:]:
        assert torch.equal(out[(None, 1)]["params"], slow_runs[0][(None, 1)]["params"])


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2", float("inf")])
def test_bad_bounds_are_refused_with_the_knob_named(value):
    import fusedist
    from fusedist.zero.grad_sync import ReduceScatterToShard

    with pytest.raises(ValueError, match=r"max_buckets_in_flight must be an int >= 1.*got"):
        ReduceScatterToShard(None, value)
    with pytest.raises(ValueError, match=r"max_buckets_in_flight must be an int >= 1.*got"):
        fusedist.ZeroRedundancyOptimizer([nn.Parameter(torch.zeros(2))], stage=1, max_buckets_in_flight=value)
    strategy = ReduceScatterToShard(None)
    assert strategy.max_buckets_in_flight == 2
    with pytest.raises(ValueError, match="max_buckets_in_flight"):
        strategy.max_buckets_in_flight = value
    assert strategy.max_buckets_in_flight == 2  # unchanged by the refused value
    strategy.max_buckets_in_flight = None  # no bound
    strategy.max_buckets_in_flight = 5
    assert strategy.max_buckets_in_flight == 5


def test_a_collective_failing_while_the_bound_waits_surfaces_at_end_of_backward():
    """The wait for the oldest bucket runs in a gradient hook; a failure there is left to the
    end-of-backward callback (whose cleanup runs), as for a bucket finished early."""
    from fusedist.comm.base import CollectiveError
    from fusedist.ddp.strategy import AllReduceAverage
    from test_ddp_overlap import SlowMLP, _scripted_reducer

    class BoundedAverage(AllReduceAverage):
        max_buckets_in_flight = 1

    model = SlowMLP(layers=4, delay_s=0.0)
    reducer, comm = _scripted_reducer(model)
    reducer.strategy = BoundedAverage()
    reducer.comm = _SlowReduceScatter(comm)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    nn.functional.mse_loss(model(x), y).backward()
    assert reducer.last_stats["buckets_finished_in_backward"] == 3  # waited for: all but the last
    comm.failing = {"ddp bucket 1"}
    with pytest.raises(CollectiveError, match="ddp bucket 1"):
        nn.functional.mse_loss(model(x), y).backward()
    assert not reducer.in_backward and reducer._early_finish_stopped
    comm.failing = set()
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()  # the next backward works
    assert reducer.last_stats["buckets_finished_in_backward"] == 3


def _frozen_and_joined_worker(rank, world):
    """(a) a whole bucket frozen after the optimizer fixed the layout: fusedist and torch DDP
    (find_unused_parameters, which tolerates parameters frozen after wrapping) + AdamW; (b)
    rank 1 runs out of batches under Join: fusedist's and torch's Join, and the joined rank's
    peak in its shadow steps."""
    import fusedist
    from torch.distributed.algorithms import Join as TorchJoin

    base = _model()
    out = {}
    for which in (0, 2 * LAYERS - 2):  # the first layer (the last bucket), the last (the first)
        ours = fusedist.DistributedDataParallel(copy.deepcopy(base), **PER_LAYER)
        opt = fusedist.ZeroRedundancyOptimizer(_groups(ours.module), torch.optim.AdamW, stage=2, lr=1e-2)
        ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), find_unused_parameters=True)
        ref_opt = torch.optim.AdamW(_groups(ref.module), lr=1e-2)
        for step in range(3):
            if step == 1:
                for model in (ours.module, ref.module):
                    model[which].requires_grad_(False)
            (x, y), = _batches(rank, 0 if step == ACCUMULATE_AT else step)
            for model, o in ((ref, ref_opt), (ours, opt)):
                o.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                o.step()
        opt.wait_for_params()
        out[which] = [(a - b).abs().max().item() for a, b in zip(ours.parameters(), ref.parameters())]
    steps = 4 - 2 * rank
    batches = [_batches(rank, 0 if s == ACCUMULATE_AT else s)[0] for s in range(steps)]
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ref_opt = torch.optim.AdamW(_groups(ref.module), lr=1e-2)
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base), **PER_LAYER)
    opt = fusedist.ZeroRedundancyOptimizer(_groups(ours.module), torch.optim.AdamW, stage=2, lr=1e-2)
    peaks = []
    for model, o, join in ((ref, ref_opt, TorchJoin([ref])), (ours, opt, fusedist.Join([ours, opt]))):
        with join:
            for x, y in batches:
                o.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                o.step()
                if model is ours:
                    peaks.append(ours.reducer.last_stats["peak_grad_bytes"])
        if model is ours:
            peaks.append(ours.reducer.last_stats["peak_grad_bytes"])  # the last shadow backward's
    opt.wait_for_params()
    out["join"] = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), ref.parameters()))
    out["join peaks"] = peaks
    out["bucket bytes"] = [b.nbytes for b in ours.reducer.layout.buckets]
    return out


def test_a_bucket_frozen_whole_and_a_joined_rank_stay_within_the_bound():
    for out in run_distributed(_frozen_and_joined_worker, 2, timeout=180):
        for which in (0, 2 * LAYERS - 2):
            # the bucket of the frozen layer used to reach its launch unallocated and fail
            assert max(out[which]) < 1e-5, (which, out[which])
        assert out["join"] < 1e-5, out["join"]
        # the joined rank's shadow backwards: at most the default bound of buckets, not the
        # whole model's gradients at once
        largest = max(out["bucket bytes"])
        assert max(out["join peaks"]) <= 3 * largest, out


def _peer_gone_worker(rank, world, bound):
    import time

    import fusedist

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    model = fusedist.DistributedDataParallel(net, bucket_cap_mb=0.005)
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, stage=2, lr=1e-2,
                                           max_buckets_in_flight=bound)
    for step in range(2):
        if rank == 1 and step == 1:
            time.sleep(5)  # never joins this step's reduce-scatters
            return None
        try:
            opt.zero_grad()
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
        except Exception as exc:  # noqa: BLE001 - the error is what is compared
            return f"{type(exc).__name__}: {exc}"
    return "trained on"


@pytest.mark.parametrize("bound", [1, 2])
def test_a_peer_missing_while_the_bound_waits_is_reported_as_itself(bound):
    """A reduce-scatter that failed while the bound waited for it (a peer gone) used to be followed
    by the next bucket's launch, which the communicator refused ("can no longer run collectives,
    because an earlier one failed"): the error the rank saw was that refusal, without the stall
    report. The launches stop at the failure, and the end of backward raises it."""
    out = run_distributed(_peer_gone_worker, 2, bound, timeout=60,
                          env={"FUSEDIST_TIMEOUT_S": "2", "FUSEDIST_STALL_REPORT_S": "1"})
    assert "can no longer run collectives" not in out[0], out[0]
    assert "StallError" in out[0] and "rank 1" in out[0], out[0]
