"""torch's own clip (``torch.nn.utils.clip_grad_norm_``, ``get_total_norm``, torchtitan's
``get_total_norm`` + ``clip_grads_with_norm_``) on complex gradients that fusedist keeps sharded,
against torch's clip of the whole model in one process (Note [torch's clip on sharded gradients]
in fusedist/optim/torch_clip.py).

torch measures complex gradients by their magnitudes and returns a *real* norm (float32 for
complex64, float64 for complex128). The replacements cast the global norm to the promotion of the
gradients' dtypes, which kept it complex: ``get_total_norm`` returned a complex tensor, and every
clip then failed in its ``clamp`` (``fully_shard`` pieces, and ZeRO-2 pipeline stages).

And ``GradScaler(found_inf_group=...)``'s first iteration, whose ``step()`` waits for ``update()``
(Note [the first iteration's steps wait for update()] in fusedist/amp/found_inf_group.py), in a
loop that steps an LR scheduler between ``scaler.step`` and ``scaler.update``: the deferred step
ran at the scheduler's *next* learning rate, and the scheduler warned that ``optimizer.step()``
had not been called. Oracle: torch's scaler (an inf in one rank's loss reaches every rank's
gradient through DDP, so torch's per-rank decision is the group's).

Tolerances: complex64 norms and gradients are fp32 sums of a dozen magnitudes taken in another
order over the pieces (a few ulp: 2e-6 relative); complex128 ones are fp64 (1e-12). The scaler
loop: fp32 AdamW/SGD steps, fused kernels against torch's (1e-6, as tests/test_optim.py).
"""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shared_rank_launch import launch_for_selected, results_of

DTYPES = (torch.complex64, torch.complex128)
MAX_NORM = 0.5


def _tol(dtype) -> dict:
    return dict(rtol=1e-12, atol=0) if dtype == torch.complex128 else dict(rtol=2e-6, atol=1e-7)


class _Complex(nn.Module):
    def __init__(self, dtype, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(4, 3, dtype=dtype, generator=g))

    def forward(self, x):
        return x @ self.w.T


def _input(seed: int, dtype):
    return torch.randn(5, 3, dtype=dtype, generator=torch.Generator().manual_seed(1000 + seed))


def _fully_shard_case(rank, world, seed):
    """torch's clip_grad_norm_ and get_total_norm on complex ``fully_shard`` pieces: mismatches
    against torch's clip on the unsharded model (norm value and dtype, this rank's clipped rows)."""
    import fusedist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    bad = []
    for dtype in DTYPES:
        ours = fusedist.fully_shard(_Complex(dtype, seed), mesh=mesh)
        ours(_input(seed + rank, dtype)).abs().sum().backward()
        total = torch.nn.utils.get_total_norm([p.grad for p in ours.parameters()])
        norm = torch.nn.utils.clip_grad_norm_(ours.parameters(), MAX_NORM)
        ref = _Complex(dtype, seed)  # fully_shard averages: the mean of the ranks' losses
        (sum(ref(_input(seed + r, dtype)).abs().sum() for r in range(world)) / world).backward()
        expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        for name, got in (("get_total_norm", total), ("clip_grad_norm_", norm)):
            if got.dtype != expected.dtype or not torch.allclose(got, expected, **_tol(dtype)):
                bad.append((str(dtype), name, got, expected))
        piece = ref.w.grad.chunk(world)[rank]
        if not torch.allclose(ours.w.grad, piece, **_tol(dtype)):
            bad.append((str(dtype), "clipped gradient"))
    return bad


def _zero2_stage_case(rank, world, seed):
    """torchtitan's clip over ZeRO-2 pipeline stages (one stage per rank) of complex parameters:
    mismatches of the norm and the clipped SGD step against torch's clip over both stages."""
    import fusedist
    from fusedist.pipelining import PipelineStage
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp"))
    bad = []
    for dtype in DTYPES:
        ddp = fusedist.DistributedDataParallel(_Complex(dtype, seed + rank), process_group=mesh["dp"].get_group())
        opt = fusedist.ZeroRedundancyOptimizer(list(ddp.parameters()), torch.optim.SGD, lr=0.1, stage=2,
                                               process_group=mesh["dp"].get_group())
        stage = PipelineStage(ddp, rank, world, torch.device("cpu"), group=mesh["pp"].get_group())
        ddp(_input(seed + rank, dtype)).abs().sum().backward()
        total = torch.nn.utils.get_total_norm([])  # (stage 2 keeps no p.grad)
        dtype_seen = total.dtype
        total **= 2.0
        dist.all_reduce(total, group=mesh["pp"].get_group())
        total **= 0.5
        torch.nn.utils.clip_grads_with_norm_(list(ddp.parameters()), MAX_NORM, total)
        opt.step()
        refs = [_Complex(dtype, seed + r) for r in range(world)]
        sum(m(_input(seed + r, dtype)).abs().sum() for r, m in enumerate(refs)).backward()
        params = [p for m in refs for p in m.parameters()]
        expected = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        torch.optim.SGD(params, lr=0.1).step()
        if dtype_seen != expected.dtype or not torch.allclose(total, expected, **_tol(dtype)):
            bad.append((str(dtype), "norm", dtype_seen, total, expected))
        if not torch.allclose(ddp.module.w.detach(), refs[rank].w.detach(), **_tol(dtype)):
            bad.append((str(dtype), "weights"))
        del stage, opt, ddp
        gc.collect()  # (one stage's optimizer alive at a time: get_total_norm measures the live ones)
    return bad


def _scheduler_loop(rank, world, seed, who, fused_cls, torch_cls, tensor_lr, sched_before_update, inf_first):
    """Three iterations of DDP + scaler + StepLR (an inf in rank 0's first loss when
    ``inf_first``): (the weights, the scheduler's warnings, the scales)."""
    import fusedist

    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    lr = torch.tensor(0.05) if tensor_lr else 0.05
    if who == "ours":
        model = fusedist.DistributedDataParallel(copy.deepcopy(base))
        if fused_cls == "zero2":  # (a sharded optimizer stepping FusedAdamW on its shards)
            opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), fusedist.optim.FusedAdamW, stage=2, lr=lr)
        else:
            opt = fused_cls(model.parameters(), lr=lr)
        scaler = fusedist.amp.GradScaler("cpu", init_scale=2.0 ** 6, found_inf_group=dist.group.WORLD)
    else:
        model = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
        opt = torch_cls(model.parameters(), lr=lr)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 6)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.3)
    scales = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for it in range(3):
            g = torch.Generator().manual_seed(seed + 10 * it + rank)
            blowup = float("inf") if inf_first and it == 0 and rank == 0 else 1.0
            opt.zero_grad()
            scaler.scale(model(torch.randn(4, 6, generator=g)).square().mean() * blowup).backward()
            scaler.step(opt)
            if sched_before_update:
                sched.step()
            scaler.update()
            if not sched_before_update:
                sched.step()
            scales.append(scaler.get_scale())
    warned = sorted({str(w.message)[:40] for w in caught if "lr_scheduler" in str(w.message)})
    return [p.detach().clone() for p in model.parameters()], warned, scales


def _deferred_steps_case(rank, world, seed):
    """Each loop of fusedist's scaler against torch's: (case, weight difference, our warnings,
    torch's warnings, our scales, torch's scales)."""
    import fusedist

    adamw, sgd = (fusedist.optim.FusedAdamW, torch.optim.AdamW), (fusedist.optim.FusedSGD, torch.optim.SGD)
    cases = [  # (optimizers, tensor lr, scheduler before update, an inf in the first iteration)
        (adamw, False, True, False), (adamw, False, True, True), (adamw, True, True, False),
        (adamw, False, False, False), (adamw, False, False, True), (sgd, True, True, False), (sgd, False, True, True),
        (("zero2", torch.optim.AdamW), True, True, False), ((torch.optim.AdamW, torch.optim.AdamW), False, True, True)]
    out = []
    for (fused_cls, torch_cls), tensor_lr, before, inf_first in cases:
        args = (fused_cls, torch_cls, tensor_lr, before, inf_first)
        w_ours, warn_ours, s_ours = _scheduler_loop(rank, world, seed, "ours", *args)
        w_torch, warn_torch, s_torch = _scheduler_loop(rank, world, seed, "torch", *args)
        diff = max(float((a - b).abs().max()) for a, b in zip(w_ours, w_torch))
        case = (getattr(fused_cls, "__name__", fused_cls), "tensor lr" if tensor_lr else "float lr",
                "scheduler before update" if before else "scheduler after update",
                "inf first" if inf_first else "finite")
        out.append((case, diff, warn_ours, warn_torch, s_ours, s_torch))
    return out


def _closure_loop(rank, seed, who, fused_cls, torch_cls, inf_first, split):
    """Three iterations of DDP + scaler, each ``scaler.step(opt, closure)`` (with ``split``, a first
    optimizer on the first layer stepped without a closure before): (the weights, the closure's
    calls, what step() returned, the scales)."""
    import fusedist

    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    if who == "ours":
        model = fusedist.DistributedDataParallel(copy.deepcopy(base))
        scaler = fusedist.amp.GradScaler("cpu", init_scale=2.0 ** 6, found_inf_group=dist.group.WORLD)
        cls = fused_cls
    else:
        model = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 6)
        cls = torch_cls
    layers = list(model.module)
    opts = [cls(layers[0].parameters(), lr=0.05), cls(layers[2].parameters(), lr=0.05)] if split else \
        [cls(model.parameters(), lr=0.05)]
    calls, returned, scales = [], [], []
    for it in range(3):
        g = torch.Generator().manual_seed(seed + 10 * it + rank)
        blowup = float("inf") if inf_first and it == 0 and rank == 0 else 1.0
        for opt in opts:
            opt.zero_grad()
        scaler.scale(model(torch.randn(4, 6, generator=g)).square().mean() * blowup).backward()

        def closure(it=it):
            calls.append(it)
            return torch.tensor(float(it) + 0.5)

        if split:
            scaler.step(opts[0])
        out = scaler.step(opts[-1], closure)
        returned.append(None if out is None else float(out))
        scaler.update()
        scales.append(scaler.get_scale())
    return [p.detach().clone() for p in model.parameters()], calls, returned, scales


def _closure_first_iteration_case(rank, world, seed):
    """Each closure loop of fusedist's scaler against torch's: (case, weight difference, ours,
    torch's), the latter two as (closure calls, step returns, scales)."""
    import fusedist

    cases = [((fusedist.optim.FusedAdamW, torch.optim.AdamW), inf_first, split)
             for inf_first in (False, True) for split in (False, True)]
    cases.append(((torch.optim.SGD, torch.optim.SGD), True, False))  # (torch's path under the group)
    out = []
    for (fused_cls, torch_cls), inf_first, split in cases:
        w_ours, *ours = _closure_loop(rank, seed, "ours", fused_cls, torch_cls, inf_first, split)
        w_torch, *theirs = _closure_loop(rank, seed, "torch", fused_cls, torch_cls, inf_first, split)
        diff = max(float((a - b).abs().max()) for a, b in zip(w_ours, w_torch))
        out.append(((fused_cls.__name__, inf_first, split), diff, ours, theirs))
    return out


SEED = int(torch.randint(0, 10_000, ()).item())
SCENARIOS = {
    "test_torch_clip_of_complex_fully_shard_pieces_is_real_as_torchs":
        {"fully_shard": (_fully_shard_case, (SEED,))},
    "test_torchtitan_clip_of_complex_zero2_stages_is_real_as_torchs":
        {"zero2 stages": (_zero2_stage_case, (SEED,))},
    "test_found_inf_group_first_step_keeps_its_learning_rate_under_a_scheduler":
        {"deferred steps": (_deferred_steps_case, (SEED,))},
    "test_found_inf_group_first_step_with_a_closure_returns_its_loss_as_torch":
        {"closure first": (_closure_first_iteration_case, (SEED,))},
}


@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, SCENARIOS, 2, timeout=120)


def test_torch_clip_of_complex_fully_shard_pieces_is_real_as_torchs(launched):
    for bad in results_of(launched, "fully_shard"):
        assert not bad, (SEED, bad)


def test_torchtitan_clip_of_complex_zero2_stages_is_real_as_torchs(launched):
    for bad in results_of(launched, "zero2 stages"):
        assert not bad, (SEED, bad)


def test_found_inf_group_first_step_keeps_its_learning_rate_under_a_scheduler(launched):
    """The first iteration's deferred step runs with the hyperparameters of its ``step()`` call;
    a scheduler stepped after ``update()`` warns as with torch's scaler (only after a skipped
    first step), one stepped before it never warns (documented: torch's warns there when the
    first step overflowed). Before: a scheduler stepped before ``update()`` always warned and the
    first step took the next learning rate (weights 1e-2 away)."""
    for rank, results in enumerate(results_of(launched, "deferred steps")):
        for case, diff, warn_ours, warn_torch, s_ours, s_torch in results:
            assert diff < 1e-6, (SEED, rank, case, diff)
            assert s_ours == s_torch, (SEED, rank, case, s_ours, s_torch)
            if case[2] == "scheduler after update":
                assert warn_ours == warn_torch, (SEED, rank, case, warn_ours, warn_torch)
            else:
                assert warn_ours == [], (SEED, rank, case, warn_ours)
            assert bool(warn_torch) == (case[3] == "inf first"), (rank, case, warn_torch)  # torch 2.13's


def test_found_inf_group_first_step_with_a_closure_returns_its_loss_as_torch(launched):
    """``scaler.step(opt, closure)`` in the first iteration returns the closure's loss (None when
    skipped, the closure not run) as torch's does, also after another optimizer's step waited
    (Note [a closure in the first iteration]). Before: the step waited for ``update()`` and
    returned None; the closure ran at ``update()``."""
    for rank, results in enumerate(results_of(launched, "closure first")):
        for case, diff, ours, theirs in results:
            assert diff < 1e-6, (SEED, rank, case, diff)
            assert ours == theirs, (SEED, rank, case, ours, theirs)
            assert ours[1][0] == (None if case[1] else 0.5), (rank, case, ours)
