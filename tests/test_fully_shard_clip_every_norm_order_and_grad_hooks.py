"""Gradient norms, clips and gradient hooks of ``fusedist.fully_shard`` against torch:

* every order torch's clip takes -- 0 (the count of tensors with a nonzero gradient), 1, 2,
  3.5, inf, -inf and a negative p -- through ``fusedist.clip_grad_norm_``, torch's
  ``clip_grad_norm_`` and ``get_total_norm`` + ``clip_grads_with_norm_``, over all the
  parameters and over some, on a 1-D mesh of 4 (pieces empty on some ranks) and on HSDP (2x2):
  the norm and the clipped, stepped parameters match torch DDP + torch's clip, and
  ``error_if_nonfinite`` raises exactly where torch's does; with tensor parallelism (2x2), over
  parameters every tensor-parallel rank holds alike, the norm of the unsharded model;
* a float64 model: the norm is float64 and the parameters match torch's to float64 precision;
* a ``register_post_accumulate_grad_hook`` on a parameter after sharding runs on its reduced
  gradient, as FSDP2's does (once per synchronized backward, not under no-sync accumulation):
  an in-place clamp and the optimizer-in-backward recipe train as torch DDP + the clamp, also
  with the units kept gathered after backward (the stepped pieces are gathered afresh);
* per-parameter inf / -inf norms keep a NaN on one rank through a max all-reduce that drops
  NaNs (NCCL's max), as torch's norm of the whole gradient does.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import models
from phased_launches import launch_phase
from shared_rank_launch import results_of

INF = float("inf")
ORDERS = [0.0, 1.0, 2.0, 3.5, INF, -INF, -1.5]
MAX_NORM = 0.01


def _mesh(ws: int, hsdp: bool):
    from torch.distributed.device_mesh import init_device_mesh

    if hsdp:
        return init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (ws,))


def _pair(mesh, dtype=torch.float32):
    """torch DDP and fusedist.fully_shard (one unit per block, the root) of the same model."""
    import fusedist

    torch.manual_seed(0)
    base = models.BlockStack(d_out=1).to(dtype)  # the head's bias: one element, empty on most ranks
    ref = nn.parallel.DistributedDataParallel(base)
    torch.manual_seed(0)
    ours = models.BlockStack(d_out=1).to(dtype)
    for block in ours.blocks:
        fusedist.fully_shard(block, mesh=mesh)
    fusedist.fully_shard(ours, mesh=mesh)
    return ref, ours


def _titan(params, max_norm, norm_type, error_if_nonfinite=False):
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _clips():
    import fusedist

    return {"fusedist": fusedist.clip_grad_norm_, "torch": torch.nn.utils.clip_grad_norm_, "titan": _titan}


def _some(model) -> list:
    """A subset of the parameters: the first block's and the head's."""
    model = getattr(model, "module", model)
    return list(model.blocks[0].parameters()) + list(model.head.parameters())


def _backward(ref, ours, rank, dtype=torch.float32):
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank), dtype=torch.float32).to(dtype)
    for m in (ref, ours):
        m(x).square().mean().backward()


def _sgd_and_compare(ref, ours) -> float:
    """One plain SGD step on both from the clipped gradients; the largest parameter difference."""
    import fusedist

    with torch.no_grad():
        for m in (ref, ours):
            for p in m.parameters():
                if p.grad is not None:
                    p.sub_(p.grad)
    full = fusedist.fsdp.full_state_dict(ours)
    return max((full[k] - v).abs().max().item() for k, v in ref.module.state_dict().items())


def _every_order_worker(rank, ws):
    bad = []
    for hsdp in (False, True):
        mesh = _mesh(ws, hsdp)
        cases = [(c, False, nt) for c in _clips().items() for nt in ORDERS]
        cases += [(("torch", torch.nn.utils.clip_grad_norm_), True, nt) for nt in (0.0, 2.0, -INF, -1.5)]
        for (name, clip), subset, nt in cases:
            ref, ours = _pair(mesh)
            _backward(ref, ours, rank)
            pick = _some if subset else (lambda m: list(m.parameters()))
            expected = torch.nn.utils.clip_grad_norm_(pick(ref), MAX_NORM, nt)
            got = clip(pick(ours), MAX_NORM, nt)
            err = _sgd_and_compare(ref, ours)
            if got.dtype != expected.dtype or not torch.allclose(got, expected, rtol=1e-5, atol=1e-7) or err > 1e-6:
                bad.append((hsdp, name, subset, nt, float(got), float(expected), err))
    assert not bad, bad


def test_every_norm_order_matches_torch_on_1d_and_hsdp_meshes(at_4):
    results_of(at_4, "every order")


def _nonfinite_worker(rank, ws):
    mesh = _mesh(ws, False)
    bad = []
    for value in (INF, float("nan")):
        for (name, clip), nt in ((c, nt) for c in _clips().items() for nt in ORDERS):
            ref, ours = _pair(mesh)
            _backward(ref, ours, rank)
            # the same element of the full gradient: DDP's replicas all hold it, rank 0's piece starts with it
            ref.module.blocks[0].fc1.weight.grad.view(-1)[0] = value
            if rank == 0:
                assert ours.blocks[0].fc1.weight.grad.numel()
                ours.blocks[0].fc1.weight.grad.view(-1)[0] = value
            outcome = []
            for m, f in ((ref, torch.nn.utils.clip_grad_norm_), (ours, clip)):
                try:
                    outcome.append(float(f(list(m.parameters()), MAX_NORM, nt, error_if_nonfinite=True)))
                except RuntimeError:
                    outcome.append("raised")
            same = (outcome[0] == outcome[1] or (isinstance(outcome[0], float) and isinstance(outcome[1], float)
                                                 and math.isclose(outcome[0], outcome[1], rel_tol=1e-5)))
            if not same:
                bad.append((value, name, nt, *outcome))
    assert not bad, bad


def test_error_if_nonfinite_raises_where_torch_does_for_every_order(at_3):
    results_of(at_3, "nonfinite")


def _fp64_worker(rank, ws):
    mesh = _mesh(ws, False)
    bad = []
    for (name, clip), nt in ((c, nt) for c in _clips().items() for nt in ORDERS):
        ref, ours = _pair(mesh, torch.float64)
        _backward(ref, ours, rank, torch.float64)
        expected = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), MAX_NORM, nt)
        got = clip(list(ours.parameters()), MAX_NORM, nt)
        err = _sgd_and_compare(ref, ours)
        if got.dtype != torch.float64 or not torch.allclose(got, expected, rtol=1e-12, atol=0) or err > 1e-13:
            bad.append((name, nt, got.dtype, float(got), float(expected), err))
    assert not bad, bad


def test_float64_norms_are_not_rounded_to_float32(at_2):
    results_of(at_2, "fp64")


def _hooks_worker(rank, ws, hsdp, accumulate, keep_gathered=False):
    mesh = _mesh(ws, hsdp)
    ref, ours = _pair(mesh)
    # (gathered after backward: the step in backward must not leave the next forward a stale copy)
    ours.set_reshard_after_backward(not keep_gathered)
    calls, opts = [0], {}

    def hook(p):  # an elementwise clip of the reduced gradient, then the optimizer in backward
        calls[0] += 1
        p.grad.clamp_(-0.05, 0.05)
        opts[p].step()
        opts[p].zero_grad()

    for p in ours.parameters():
        opts[p] = torch.optim.SGD([p], lr=0.5)
        p.register_post_accumulate_grad_hook(hook)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(rank)
    steps, micro = 2, (2 if accumulate else 1)
    for _ in range(steps):
        for i in range(micro):
            x = torch.randn(4, 5, generator=gen)
            last = i == micro - 1
            ours.set_requires_gradient_sync(last)
            ours(x).square().mean().backward()
            with (ref.no_sync() if not last else torch.enable_grad()):
                ref(x).square().mean().backward()
        for p in ref.parameters():
            p.grad.clamp_(-0.05, 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
    import fusedist

    full = fusedist.fsdp.full_state_dict(ours)
    err = max((full[k] - v).abs().max().item() for k, v in ref.module.state_dict().items())
    n_params = len(list(ours.parameters()))
    assert calls[0] == steps * n_params, (calls[0], steps * n_params)  # once per synchronized backward
    assert err < 1e-6, err
    assert all(p.grad is None for p in ours.parameters())


def test_post_accumulate_grad_hooks_after_sharding_run_on_the_reduced_gradient(at_2, at_3, at_4):
    results_of(at_3, "hooks")
    results_of(at_4, "hooks hsdp accumulated")
    results_of(at_2, "hooks accumulated kept gathered")


def _nan_through_fmax_worker(rank, ws):
    import fusedist
    from fusedist.fsdp import holder as holder_mod
    from fusedist.ownership import gradient_holder

    real = holder_mod.all_reduce_on_comm_device

    def dropping_nan(comm, t, op, tag):  # a max all-reduce as NCCL's (fmax: a NaN loses to a number)
        if op == "max":
            t.copy_(t.nan_to_num(nan=-INF))
        real(comm, t, op, tag)

    holder_mod.all_reduce_on_comm_device = dropping_nan
    torch.manual_seed(0)
    model = models.BlockStack()
    fusedist.fully_shard(model, mesh=_mesh(ws, False))
    model(torch.randn(4, 5)).square().mean().backward()
    params = list(model.parameters())
    sizes = torch.tensor([float(p.numel()) for p in params])
    torch.distributed.all_reduce(sizes, op=torch.distributed.ReduceOp.MIN)
    p = params[int(torch.nonzero(sizes > 0)[0])]  # a piece no rank holds empty
    if rank == 1:
        p.grad.view(-1)[0] = float("nan")
    holder = gradient_holder(p)
    for nt in (INF, -INF):
        norm = holder.parameter_grad_norms([p], nt)[0]
        assert torch.isnan(norm), (nt, float(norm))
        total = holder.grad_norm([p], nt)
        assert torch.isnan(total), (nt, float(total))


def test_per_parameter_max_norms_keep_a_nan_through_a_max_that_drops_it(at_2):
    results_of(at_2, "nan through fmax")


class _TPNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(8, 16)
        self.w2 = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)  # not parallelized: every tensor-parallel rank holds it alike

    def forward(self, x):
        return self.norm(self.w2(torch.relu(self.w1(x))))


def _tp_worker(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fusedist

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    bad = []
    for nt in ORDERS:
        torch.manual_seed(0)
        ref = _TPNet()  # the unsharded model on both data-parallel batches, gradients averaged
        sum(ref(x).square().mean() / 2 for x in batches).backward()
        torch.manual_seed(0)
        model = _TPNet()
        parallelize_module(model, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        fusedist.fully_shard(model, mesh=mesh["dp"])
        model(batches[mesh["dp"].get_local_rank()]).square().mean().backward()
        # parameters without a zero gradient (a ReLU's dead unit zeroes -inf and negative orders)
        picked = [lambda m: m.norm.weight, lambda m: m.norm.bias, lambda m: m.w2.bias]
        expected = torch.nn.utils.clip_grad_norm_([f(ref) for f in picked], 0.01, nt)
        got = torch.nn.utils.clip_grad_norm_([f(model) for f in picked], 0.01, nt)
        if not torch.allclose(got, expected, rtol=1e-5, atol=1e-7):
            bad.append((nt, float(got), float(expected)))
    assert not bad, bad


def test_every_norm_order_with_tensor_parallelism_matches_fsdp2(at_4):
    results_of(at_4, "tensor parallel")


# ---------------------------------------------------------------- one launch per world size
_HOOKS = "test_post_accumulate_grad_hooks_after_sharding_run_on_the_reduced_gradient"


@pytest.fixture(scope="module")
def at_2(request):
    return launch_phase(request, {
        "test_float64_norms_are_not_rounded_to_float32": {"fp64": (_fp64_worker, ())},
        _HOOKS: {"hooks accumulated kept gathered": (_hooks_worker, (False, True, True))},
        "test_per_parameter_max_norms_keep_a_nan_through_a_max_that_drops_it": {
            "nan through fmax": (_nan_through_fmax_worker, ())},
    }, 2, timeout=300)


@pytest.fixture(scope="module")
def at_3(request):
    return launch_phase(request, {
        "test_error_if_nonfinite_raises_where_torch_does_for_every_order": {"nonfinite": (_nonfinite_worker, ())},
        _HOOKS: {"hooks": (_hooks_worker, (False, False))},
    }, 3, timeout=300)


@pytest.fixture(scope="module")
def at_4(request):
    return launch_phase(request, {
        "test_every_norm_order_matches_torch_on_1d_and_hsdp_meshes": {"every order": (_every_order_worker, ())},
        _HOOKS: {"hooks hsdp accumulated": (_hooks_worker, (True, True))},
        "test_every_norm_order_with_tensor_parallelism_matches_fsdp2": {"tensor parallel": (_tp_worker, ())},
    }, 4, timeout=300)
