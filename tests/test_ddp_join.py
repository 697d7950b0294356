"""Uneven inputs: fusedist DDP (and ZeRO, SyncBatchNorm) under join against torch DDP under Join.

Rank r gets its own number of batches (3 + r unless a case says otherwise). torch's DDP under
``model.join()`` (or the generic ``Join``) is the oracle for the model's final parameters and
buffers, with an unsharded torch optimizer for ZeRO; torch's SyncBatchNorm does not run on
CPU, so SyncBatchNorm is checked against BatchNorm on the concatenated batches of the ranks
still training, in one process. Every case of one world size shares a spawn; the cases that
end in an exception (early termination, a divergence) come last.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed

TOL = 2e-5


def _batch(rank, step, n=6, d_in=8, d_out=4):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)


def _mlp_bn():
    torch.manual_seed(7)
    # (no bias before the BatchNorm: its gradient is rounding noise, which Adam scales up to lr)
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    worst = 0.0
    for x, y in zip(list(a.parameters()) + list(a.buffers()), list(b.parameters()) + list(b.buffers())):
        worst = max(worst, (x.double() - y.double()).abs().max().item())
    return worst


def _train(model, opt, batches, ctx, clip=None, clip_fn=None):
    with ctx:
        for x, y in batches:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if clip is not None:
                clip_fn(clip)
            opt.step()


def _ddp_case(rank, world, opt_name, divide, forward_sync_buffers=True):
    """fusedist DDP vs torch DDP under model.join(), plain optimizer. With
    ``forward_sync_buffers=False`` every rank keeps its own BatchNorm statistics, also when the
    context ends (torch broadcasts the last joiner's parameters only)."""
    import fusedist

    base = _mlp_bn()
    batches = [_batch(rank, i) for i in range(3 + rank)]
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), forward_sync_buffers=forward_sync_buffers)
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.0005, first_bucket_cap_mb=0.0002,
                                            forward_sync_buffers=forward_sync_buffers)
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)}[opt_name]
    _train(ref, make(ref.parameters()), batches, ref.join(divide_by_initial_world_size=divide))
    _train(ours, make(ours.parameters()), batches, ours.join(divide_by_initial_world_size=divide))
    ours.check_consistency()  # the counters agree again after the context
    # Training goes on after the context, in step with torch.
    opt_ref, opt_ours = torch.optim.SGD(ref.parameters(), lr=0.05), torch.optim.SGD(ours.parameters(), lr=0.05)
    x, y = _batch(rank, 99)
    _train(ref, opt_ref, [(x, y)], contextlib.nullcontext())
    _train(ours, opt_ours, [(x, y)], contextlib.nullcontext())
    ours.check_consistency()
    return _max_diff(ref.module, ours.module)


class _Branches(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x, use_c):
        h = torch.tanh(self.a(x))
        return self.b(h) + self.c(h) if use_c else self.b(h)


def _find_unused_case(rank, world):
    """find_unused_parameters under join: ``c`` is used by the last rank alone, in its first
    batch only; once the others have joined it is unused. As torch's joined ranks send the used
    map of the last backward they took part in (Note [a joined rank's used map] in
    fusedist/ddp/unused.py), ``c`` then gets zero gradients, not None -- and SGD's momentum
    keeps moving it."""
    import fusedist

    base = _Branches()
    out = []
    for cls in (nn.parallel.DistributedDataParallel, fusedist.DistributedDataParallel):
        model = cls(copy.deepcopy(base), find_unused_parameters=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with model.join():
            for i in range(1 + 2 * rank):
                x, y = _batch(rank, i)
                opt.zero_grad()
                nn.functional.mse_loss(model(x, use_c=(rank == world - 1 and i == 0)), y).backward()
                opt.step()
        out.append(model.module)
    return _max_diff(*out)


_OPTIMIZERS = {"adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
               "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9))}


def _zero_case(rank, world, stage, generic_torch_join, divide, clip, opt_name="adamw"):
    """ZeRO stage 1/2 under Join([model, zero]) vs torch DDP + the unsharded optimizer under Join."""
    import fusedist
    from torch.distributed.algorithms import Join as TorchJoin

    base = _mlp_bn()
    batches = [_batch(rank, i) for i in range(3 + rank)]
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    opt_cls, kw = _OPTIMIZERS[opt_name]
    opt_ref = opt_cls(ref.parameters(), **kw)
    _train(ref, opt_ref, batches, TorchJoin([ref], divide_by_initial_world_size=divide), clip=clip,
           clip_fn=lambda c: torch.nn.utils.clip_grad_norm_(ref.parameters(), c))
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.0005, first_bucket_cap_mb=0.0002)
    zero = fusedist.ZeroRedundancyOptimizer(ours.parameters(), opt_cls, stage=stage, **kw)
    join = TorchJoin if generic_torch_join else fusedist.Join
    _train(ours, zero, batches, join([ours, zero], divide_by_initial_world_size=divide), clip=clip,
           clip_fn=lambda c: zero.clip_grad_norm_(c))
    ours.check_consistency()
    return _max_diff(ref.module, ours.module)


def _syncbn_model(sync_bn_cls):
    torch.manual_seed(11)
    model = nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))
    return model if sync_bn_cls is None else sync_bn_cls.convert_sync_batchnorm(model)


def _syncbn_case(rank, world, counts):
    """SyncBatchNorm under join: statistics over the ranks still training. Oracle: BatchNorm
    on their concatenated batches in one process, loss summed over ranks / world size."""
    import fusedist

    ours = fusedist.DistributedDataParallel(_syncbn_model(fusedist.nn.SyncBatchNorm))
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    _train(ours, opt, [_batch(rank, i) for i in range(counts[rank])], ours.join())
    ours.check_consistency()
    ref = _syncbn_model(None)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(max(counts)):
        active = [r for r in range(world) if counts[r] > i]
        data = [_batch(r, i) for r in active]
        out = ref(torch.cat([x for x, _ in data]))
        loss = sum(nn.functional.mse_loss(o, y) for o, (_, y) in zip(out.split(6), data)) / world
        opt_ref.zero_grad()
        loss.backward()
        opt_ref.step()
    return _max_diff(ref, ours.module)


def _throw_case(rank, world):
    import fusedist

    model = fusedist.DistributedDataParallel(_mlp_bn())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        _train(model, opt, [_batch(rank, i) for i in range(2 + rank)], model.join(throw_on_early_termination=True))
    except RuntimeError as exc:
        return str(exc)
    return None


def _divergence_case(rank, world):
    """A rank that skips optimizer.step() while still training is caught on every rank, the
    ones that already joined included."""
    import fusedist

    model = fusedist.DistributedDataParallel(_mlp_bn())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    skip_at = world - 1  # seen by the check of the next step (rank 0 has joined there with 3 ranks)
    try:
        with model.join():
            for i in range(3 + 2 * rank):
                x, y = _batch(rank, i)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                if not (rank == world - 1 and i == skip_at):
                    opt.step()
    except fusedist.RankMismatchError as exc:
        return str(exc)
    return None


def _counters_after_join_case(rank, world):
    """What the per-step check compares and a joined rank did not do while it shadowed the others
    (their steps on gradients zeroed before the step, their torch GradScaler unscales) is the last
    joiner's after the context: training on after it is no divergence."""
    import fusedist

    model = fusedist.DistributedDataParallel(_mlp_bn())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def step(i, zero_before_step):
        x, y = _batch(rank, i)
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        if zero_before_step:
            opt.zero_grad(set_to_none=False)
        scaler.step(opt)
        scaler.update()

    try:
        with model.join():
            for i in range(2 + rank):
                step(i, zero_before_step=i == 2)  # (rank 0 has joined there)
        for i in range(2):
            step(10 + i, zero_before_step=False)
        model.check_consistency()
    except fusedist.RankMismatchError as exc:
        return str(exc)
    return "no error"


def _divisor_mismatch_case(rank, world):
    """Note [the join's divisor agreed across ranks] in fusedist/ddp/join_agreement.py: the last rank passes
    divide_by_initial_world_size=False, the others True. torch's DDP trains on, each rank dividing its own
    contribution by its own divisor once a rank joined (a mix neither value gives); here every rank raises at the
    first forward, naming the ranks of each value."""
    import fusedist

    model = fusedist.DistributedDataParallel(_mlp_bn())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        _train(model, opt, [_batch(rank, i) for i in range(1 + rank)],
               model.join(divide_by_initial_world_size=rank != world - 1))
    except RuntimeError as exc:
        return str(exc)
    return None


def _worker(rank, world):
    out = {}
    for opt_name, divide in [("sgd", True), ("sgd", False), ("adamw", True), ("adamw", False)]:
        out[f"ddp {opt_name} divide={divide}"] = _ddp_case(rank, world, opt_name, divide)
    out["ddp sgd forward_sync_buffers=False"] = _ddp_case(rank, world, "sgd", True, forward_sync_buffers=False)
    out["ddp find_unused_parameters"] = _find_unused_case(rank, world)
    out["zero1 torch Join"] = _zero_case(rank, world, 1, True, True, None)
    out["zero2 fusedist Join divide=False"] = _zero_case(rank, world, 2, False, False, None)
    out["zero2 clip torch Join"] = _zero_case(rank, world, 2, True, True, 0.05, "sgd")
    out["zero1 clip fusedist Join"] = _zero_case(rank, world, 1, False, True, 0.05)
    out["syncbn"] = _syncbn_case(rank, world, [2 + r for r in range(world)])
    out["syncbn rank without batches"] = _syncbn_case(rank, world, [0] + [2 + r for r in range(1, world)])
    out["counters after join"] = _counters_after_join_case(rank, world)
    out["divisor mismatch"] = _divisor_mismatch_case(rank, world)
    out["throw"] = _throw_case(rank, world)
    out["divergence"] = _divergence_case(rank, world)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_join_matches_torch_ddp(world):
    results = run_distributed(_worker, world, timeout=240)
    for rank, out in enumerate(results):
        for key, value in out.items():
            if key in ("throw", "divergence", "counters after join", "divisor mismatch"):
                continue
            assert value < TOL, f"rank {rank}: {key}: max difference {value}"
        assert out["counters after join"] == "no error", (rank, out["counters after join"])
        mismatch = out["divisor mismatch"]
        assert mismatch is not None and (f"True on ranks {list(range(world - 1))}, False on ranks [{world - 1}] "
                                         f"(this rank: {rank != world - 1})") in mismatch, (rank, mismatch)
        assert out["throw"] is not None, f"rank {rank} did not raise with throw_on_early_termination"
        expected = "Rank 0 exhausted all inputs" if rank == 0 else "Detected at least one rank that exhausted inputs"
        assert expected in out["throw"]
        assert out["divergence"] is not None, f"rank {rank} did not report the divergence"
        assert "optimizer_steps" in out["divergence"]
        if world == 3:
            assert "ranks [0] had run out of inputs (joined)" in out["divergence"]
