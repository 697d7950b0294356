"""torch.compile patterns around fusedist's optimizers, beyond the compiled training step.

* ``fusedist.optim.functional`` (``adam_update``, ``sgd_update``, ``lamb_update``,
  ``check_and_norm``) called inside a compiled function -- a hand-written optimizer step, as
  torch's recipe compiles ``opt.step`` -- with a tensor learning rate decayed every step: the
  Triton launches were traced (under the interpreter, their pointer arithmetic ran on fake
  tensors) and every call failed at the first step. Compared with torch's AdamW / SGD run
  eagerly (LAMB, which torch lacks, with fusedist's own eager run).
* ``fusedist.integrations.lightning_grad_norm.grad_norm`` in a compiled training step over a
  ZeRO stage-2 model: its all-reduce of the held gradients' norms was traced into fusedist's
  communicator and failed on every rank. Compared with Lightning's ``grad_norm`` over torch's
  DDP run eagerly.
* ``model.unshard()`` / ``block.unshard(async_op=True)`` of a ``fully_shard`` model in a
  compiled training step (explicit prefetching): the all-gather was traced into fusedist's
  communicator and failed on every rank, where torch's FSDP2 runs it. Compared with FSDP2.

Backend ``eager`` (the failure was in dynamo's tracing); a recompile past dynamo's limit is an
error, and the number of graphs stays the same from step to step. The two multi-rank checks
share one launch of the ranks (tests/shared_rank_launch.py), each compiling from fresh caches.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import models
from shared_rank_launch import launch_for_selected, results_of, with_fresh_compiler

SHAPES = [(3, 4), (5,), (2, 3, 2), (7,), (1,), (4, 4)]
STEPS = 4


def _tensors(seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _grads() -> list:
    return [_tensors(100 + k) for k in range(STEPS)]


def _run_steps(update, grads: list, compiled: bool) -> list:
    """``update(step_grads, lr)`` over every step's gradients, ``lr`` a tensor decayed each step
    (torch's advice against recompiles); the number of graphs compiled after each step."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(update, backend="eager") if compiled else update
    lr = torch.tensor(1e-2)
    graphs = []
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for step_grads in grads:
            fn(step_grads, lr)
            lr.mul_(0.9)
            graphs.append(counters["stats"]["unique_graphs"])
    return graphs


def _torch_reference(make_opt, grads: list) -> list:
    params = [p.clone().requires_grad_() for p in _tensors(0)]
    opt = make_opt(params)
    for k, step_grads in enumerate(grads):
        for g in opt.param_groups:
            g["lr"] = 1e-2 * 0.9 ** k
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _adam_step(params, m, v, steps):
    from fusedist.optim import functional

    def update(grads, lr):
        for s in steps:
            s += 1
        # a clip coefficient from the gradients' norm, as a hand-written clipped step takes it
        _, sumsq = functional.check_and_norm(grads)
        clip = torch.clamp(1e3 / (sumsq.sqrt() + 1e-6), max=1.0).float()
        functional.adam_update(params, grads, m, v, None, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8,
                               weight_decay=1e-2, adamw=True, step=steps, clip_coef=clip)

    return update


def test_functional_adam_and_sgd_inside_compiled_step_match_torch():
    from fusedist.optim import functional

    grads = _grads()
    ref_adam = _torch_reference(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=1e-2), grads)
    ref_sgd = _torch_reference(lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True), grads)

    params = _tensors(0)
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    steps = [torch.zeros(()) for _ in params]
    graphs = _run_steps(_adam_step(params, m, v, steps), grads, compiled=True)
    diff = _max_diff(ref_adam, params)
    assert diff < 1e-6, f"adam_update in a compiled step: max |torch AdamW - fusedist| = {diff}"
    assert graphs[-1] == graphs[0], f"adam_update in a compiled step recompiled: graphs after each step {graphs}"

    params = _tensors(0)
    bufs = [torch.zeros_like(p) for p in params]
    sgd_steps = [torch.zeros(()) for _ in params]

    def sgd(grads, lr):
        for s in sgd_steps:
            s += 1
        functional.sgd_update(params, grads, bufs, None, lr=lr, momentum=0.9, dampening=0.0, weight_decay=0.0,
                              nesterov=True, step=sgd_steps)

    graphs = _run_steps(sgd, grads, compiled=True)
    diff = _max_diff(ref_sgd, params)
    assert diff < 1e-6, f"sgd_update in a compiled step: max |torch SGD - fusedist| = {diff}"
    assert graphs[-1] == graphs[0], f"sgd_update in a compiled step recompiled: graphs after each step {graphs}"


def test_functional_lamb_inside_compiled_step_matches_eager():
    from fusedist.optim import functional

    grads = _grads()
    runs = []
    for compiled in (False, True):
        params = _tensors(0)
        m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
        steps = [torch.zeros(()) for _ in params]

        def lamb(grads, lr):
            for s in steps:
                s += 1
            functional.lamb_update(params, grads, m, v, None, lr=lr, beta1=0.9, beta2=0.999, eps=1e-6,
                                   weight_decay=1e-2, step=steps)

        graphs = _run_steps(lamb, grads, compiled)
        runs.append(params)
    diff = _max_diff(*runs)
    assert diff < 1e-6, f"lamb_update in a compiled step: max |eager - compiled| = {diff}"
    assert graphs[-1] == graphs[0], f"lamb_update in a compiled step recompiled: graphs after each step {graphs}"


def _grad_norm_worker(rank, ws):
    import fusedist
    from fusedist.integrations.lightning_grad_norm import grad_norm
    from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    base = models.BlockStack(d_in=5, d=8, d_out=3, blocks=2)
    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)) for _ in range(3)]
    key = "grad_2.0_norm_total"

    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_norms = []
    for x, y in batches:
        F.mse_loss(ref(x), y).backward()
        ref_norms.append(lightning_grad_norm(ref, 2)[key])
        ref_opt.step()
        ref_opt.zero_grad()

    model = fusedist.DistributedDataParallel(copy.deepcopy(base))
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-2)

    def step(x, y):
        F.mse_loss(model(x), y).backward()
        norms = grad_norm(model, 2)
        opt.step()
        opt.zero_grad()
        return norms[key]

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, backend="eager")
    norms, graphs = [], []
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for x, y in batches:
            norms.append(compiled(x, y))
            graphs.append(counters["stats"]["unique_graphs"])
    norm_diff = max((a - b).abs().item() for a, b in zip(ref_norms, norms))
    param_diff = _max_diff([p.detach() for p in ref.parameters()], [p.detach() for p in model.parameters()])
    return norm_diff, param_diff, graphs


def test_lightning_grad_norm_under_zero2_inside_compiled_step_matches_torch(shared_launch):
    pytest.importorskip("lightning")
    for rank, (norm_diff, param_diff, graphs) in enumerate(results_of(shared_launch, "grad_norm")):
        assert norm_diff < 1e-5, f"rank {rank}: max |torch DDP's grad_norm - fusedist ZeRO-2's| = {norm_diff}"
        assert param_diff < 1e-5, f"rank {rank}: max |torch DDP - fusedist ZeRO-2| = {param_diff}"
        assert graphs[-1] == graphs[0], f"rank {rank}: recompiled, graphs after each step {graphs}"


def _unshard_worker(rank, ws):
    import fusedist
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    base = models.BlockStack(d_in=5, d=8, d_out=3, blocks=2)
    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)) for _ in range(3)]
    out = {}
    for how in ("model.unshard()", "block.unshard(async_op=True)"):
        full = {}
        for name, shard in (("torch", fully_shard), ("fusedist", fusedist.fully_shard)):
            model = copy.deepcopy(base)
            for block in model.blocks:
                shard(block, mesh=mesh)
            shard(model, mesh=mesh)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)

            def step(x, y):
                if how == "model.unshard()":
                    model.unshard()
                else:
                    model.blocks[0].unshard(async_op=True).wait()
                F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()

            torch._dynamo.reset()
            counters.clear()
            compiled = torch.compile(step, backend="eager")
            graphs = []
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
                for x, y in batches:
                    compiled(x, y)
                    graphs.append(counters["stats"]["unique_graphs"])
            full[name] = ({k: v.full_tensor() for k, v in model.state_dict().items()} if name == "torch"
                          else fusedist.fsdp.full_state_dict(model))
        out[how] = (max((full["torch"][k] - full["fusedist"][k]).abs().max().item() for k in full["torch"]), graphs)
    return out


def test_fully_shard_unshard_inside_compiled_step_matches_fsdp2(shared_launch):
    for rank, out in enumerate(results_of(shared_launch, "unshard")):
        for how, (diff, graphs) in out.items():
            assert diff < 1e-6, f"rank {rank}, {how}: max |torch FSDP2 - fusedist| = {diff}"
            assert graphs[-1] == graphs[0], f"rank {rank}, {how}: recompiled, graphs after each step {graphs}"


@pytest.fixture(scope="module")
def shared_launch(request):
    return launch_for_selected(request, with_fresh_compiler({
        "test_lightning_grad_norm_under_zero2_inside_compiled_step_matches_torch": {"grad_norm": (_grad_norm_worker,)},
        "test_fully_shard_unshard_inside_compiled_step_matches_fsdp2": {"unshard": (_unshard_worker,)},
    }), 2, timeout=180)
