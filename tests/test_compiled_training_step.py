"""A whole training step under ``torch.compile``: forward, ``loss.backward()`` and
``optimizer.step()`` in one compiled function, as torch's own DDP, FSDP2 and
ZeroRedundancyOptimizer take it.

The backward inside a compiled function breaks dynamo's graph and runs eagerly, but under
dynamo's frame hook: every Python hook autograd calls there (gradient hooks, the
end-of-backward callback, a custom Function's backward) is compiled as a frame of its own
unless it is disabled, and fusedist's communicator cannot be traced. Likewise a compiled
``optimizer.step()`` of a ZeroRedundancyOptimizer traced into its parameter all-gathers, and
one of any optimizer over a fusedist model traced fusedist's step guard (a global step hook),
recompiling it per parameter until dynamo's recompile limit (made an error here).
Each ran eagerly in torch's (C++ reducer, files dynamo skips); here each failed on every rank
at the first step. Compared with torch's eager run (the compiled steps run the same ops);
backend ``eager``, as the failures were in dynamo's tracing; the number of graphs compiled
stays the same from step to step.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import models
from shared_rank_launch import launch_for_selected, results_of, with_fresh_compiler

BACKEND = "eager"


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.bn, self.l2 = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)

    def forward(self, x):
        return self.l2(torch.tanh(self.bn(self.l1(x))))


def _train(run, opt, batches, compile_step=True, compile_opt_step=False):
    """Steps over ``batches`` (a list of (x, y)); the number of graphs compiled after each."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(opt.step, backend=BACKEND) if compile_opt_step else opt.step

    def train_step(x, y):
        loss = F.mse_loss(run(x), y)
        loss.backward()
        step()
        opt.zero_grad()
        return loss.detach()

    fn = torch.compile(train_step, backend=BACKEND) if compile_step else train_step
    graphs = []
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):  # a frame recompiled 8 times raises
        for x, y in batches:
            fn(x, y)
            graphs.append(counters["stats"]["unique_graphs"])
    return graphs


def _eager_and_compiled_scaled(make, batches) -> list:
    """Two fresh ``make()`` = (model, optimizer) trained on ``batches`` with fusedist's GradScaler
    and clip in one step, eagerly and then compiled (recompiling to the limit is an error)."""
    import fusedist

    trained = []
    for compiled in (False, True):
        model, opt = make()
        scaler = fusedist.amp.GradScaler("cpu", init_scale=1024.0)

        def scaled_step(x, y):
            scaler.scale(F.mse_loss(model(x), y)).backward()
            scaler.unscale_(opt)
            fusedist.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

        step = torch.compile(scaled_step, backend=BACKEND) if compiled else scaled_step
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            for x, y in batches:
                step(x, y)
        trained.append(model)
    return trained


def _batches(rank, n=8, steps=3, width=16):
    gen = torch.Generator().manual_seed(rank)
    return [(torch.randn(n, width, generator=gen), torch.randn(n, 4, generator=gen)) for _ in range(steps)]


def _max_diff(a, b):
    return max((x.detach() - y.detach()).abs().max().item() for x, y in zip(a, b))


def _ddp_worker(rank, ws):
    import fusedist

    torch.manual_seed(0)
    base = models.MLP()
    batches = _batches(rank)
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2), batches, compile_step=False)
    out = {}

    ddp = fusedist.DistributedDataParallel(copy.deepcopy(base))
    graphs = _train(ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2), batches)
    out["ddp, compiled training step"] = (_max_diff(ref.parameters(), ddp.parameters()), graphs)

    ddp = fusedist.DistributedDataParallel(copy.deepcopy(base))
    zero = fusedist.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, stage=2, lr=1e-2)
    graphs = _train(ddp, zero, batches)
    out["zero2, compiled training step"] = (_max_diff(ref.parameters(), ddp.parameters()), graphs)

    # torch.compile(optimizer.step) alone, the model eager (torch's ZeroRedundancyOptimizer takes it)
    ddp = fusedist.DistributedDataParallel(copy.deepcopy(base))
    zero = fusedist.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2)
    graphs = _train(ddp, zero, batches, compile_step=False, compile_opt_step=True)
    out["zero1, compiled opt.step"] = (_max_diff(ref.parameters(), ddp.parameters()), graphs)

    # fusedist's GradScaler and clip in the compiled step: ZeRO's found-inf/norm all-reduce
    # and its clip were traced too; compared with the same steps run eagerly
    def zero2():
        ddp = fusedist.DistributedDataParallel(copy.deepcopy(base))
        return ddp, fusedist.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, stage=2, lr=1e-2)

    runs = [list(m.parameters()) for m in _eager_and_compiled_scaled(zero2, batches)]
    out["zero2 + GradScaler + clip, compiled training step"] = (_max_diff(*runs), [0])

    # a fused optimizer: its step traced into the kernel launches; fusedist's clip looked up
    # each parameter's holder, recompiling per parameter (the limit is an error here)
    ddp = fusedist.DistributedDataParallel(copy.deepcopy(base))
    graphs = _train(ddp, fusedist.optim.FusedAdamW(ddp.parameters(), lr=1e-2), batches, compile_step=False,
                    compile_opt_step=True)
    out["fused AdamW, compiled opt.step"] = (_max_diff(ref.parameters(), ddp.parameters()), graphs)

    def fused():
        ddp = fusedist.DistributedDataParallel(copy.deepcopy(base))
        return ddp, fusedist.optim.FusedAdamW(ddp.parameters(), lr=1e-2)

    runs = [list(m.parameters()) for m in _eager_and_compiled_scaled(fused, batches)]
    out["fused AdamW + GradScaler + clip, compiled training step"] = (_max_diff(*runs), [0])
    return out


def _fullgraph_worker(rank, ws):
    """``fullgraph=True`` with the wrapper: the module compiled inside it trains as torch's eager
    DDP on fresh inputs (two steps: recompiles on other batch sizes cost seconds, probed without a
    defect); the wrapper compiled whole
    fails at its eager bookkeeping (as torch's DDP does unless its Python reducer is chosen),
    with a reason that says how to compile whole."""
    import fusedist

    torch.manual_seed(0)
    base = models.MLP()
    gen = torch.Generator().manual_seed(rank)
    batches = [models.MLP.batch(gen, 8) for _ in range(2)]
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ddp = fusedist.DistributedDataParallel(torch.compile(copy.deepcopy(base), backend=BACKEND, fullgraph=True))
    for model in (ref, ddp):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for x, y in batches:
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    whole = torch.compile(fusedist.DistributedDataParallel(copy.deepcopy(base)), backend=BACKEND, fullgraph=True)
    try:
        whole(batches[0][0])
        refused = "compiled"
    except Exception as exc:  # dynamo's Unsupported
        refused = str(exc)
    return _max_diff(ref.parameters(), ddp.parameters()), refused


def test_fullgraph_compile_inside_the_wrapper_matches_torch_and_whole_wrapper_says_how(shared_launch):
    for rank, (diff, refused) in enumerate(results_of(shared_launch, "fullgraph")):
        assert diff < 1e-6, (rank, diff)
        assert "fusedist.DistributedDataParallel(torch.compile(model, fullgraph=True))" in refused, (rank, refused)


def test_compiled_training_step_ddp_and_zero_match_torch(shared_launch):
    for rank, out in enumerate(results_of(shared_launch, "ddp")):
        for case, (diff, graphs) in out.items():
            # (a compiled AdamW against the eager one: last bits only)
            assert diff < 1e-5, f"rank {rank}, {case}: max |torch DDP - fusedist| = {diff}"
            assert graphs[-1] == graphs[0], f"rank {rank}, {case}: recompiled, graphs after each step {graphs}"


def _syncbn_worker(rank, ws):
    import fusedist

    torch.manual_seed(0)
    base = BNNet()
    local = [_batches(r) for r in range(ws)]
    # the reference: BatchNorm on the global batch in one process (torch's SyncBatchNorm has no CPU kernel)
    glob = [(torch.cat([b[i][0] for b in local]), torch.cat([b[i][1] for b in local])) for i in range(len(local[0]))]
    single = copy.deepcopy(base)
    _train(single, torch.optim.SGD(single.parameters(), lr=0.1), glob, compile_step=False)
    sync = fusedist.DistributedDataParallel(fusedist.nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(base)))
    graphs = _train(sync, torch.optim.SGD(sync.parameters(), lr=0.1), local[rank])
    return _max_diff(single.parameters(), sync.module.parameters()), graphs


def test_compiled_training_step_syncbn_matches_global_batchnorm(shared_launch):
    """SyncBatchNorm's backward, a custom Function, inside the compiled step."""
    for rank, (diff, graphs) in enumerate(results_of(shared_launch, "syncbn")):
        assert diff < 1e-5, f"rank {rank}: max |BatchNorm on the global batch - SyncBatchNorm| = {diff}"
        assert graphs[-1] == graphs[0], f"rank {rank}: recompiled, graphs after each step {graphs}"


def _fsdp_worker(rank, ws):
    import fusedist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(0)
    base = models.BlockStack(d_in=5, d=8, d_out=3, blocks=2)
    batches = _batches(rank, n=4, width=5)
    batches = [(x, y[:, :3]) for x, y in batches]
    out = {}
    for name, shard in (("torch", fully_shard), ("fusedist", fusedist.fully_shard)):
        model = copy.deepcopy(base)
        for block in model.blocks:
            shard(block, mesh=mesh)
        shard(model, mesh=mesh)
        graphs = _train(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, compile_step=name != "torch")
        full = ({k: v.full_tensor() for k, v in model.state_dict().items()} if name == "torch"
                else fusedist.fsdp.full_state_dict(model))
        out[name] = (full, graphs)
    (ref, _), (got, graphs) = out["torch"], out["fusedist"]
    assert ref.keys() == got.keys(), (sorted(ref), sorted(got))

    # fusedist's GradScaler and clip in the compiled step (the holder's found-inf and norm
    # all-reduces were traced); compared with the same steps run eagerly
    def sharded():
        model = copy.deepcopy(base)
        for block in model.blocks:
            fusedist.fully_shard(block, mesh=mesh)
        fusedist.fully_shard(model, mesh=mesh)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    runs = [fusedist.fsdp.full_state_dict(m) for m in _eager_and_compiled_scaled(sharded, batches)]
    scaled = max((runs[0][k] - runs[1][k]).abs().max().item() for k in runs[0])
    return max((ref[k] - got[k]).abs().max().item() for k in ref), graphs, scaled


def test_compiled_training_step_fully_shard_matches_fsdp2(shared_launch):
    """(16 parameters: the step guard, traced, recompiled past dynamo's limit of 8.)"""
    for rank, (diff, graphs, scaled) in enumerate(results_of(shared_launch, "fully_shard")):
        assert diff < 1e-6, f"rank {rank}: max |FSDP2 - fusedist| = {diff}"
        assert scaled < 1e-6, f"rank {rank}: GradScaler and clip, max |eager - compiled| = {scaled}"
        assert graphs[-1] == graphs[0], f"rank {rank}: recompiled, graphs after each step {graphs}"


def _compiled_autograd_worker(rank, ws, kind, around_forward):
    import fusedist
    from torch._dynamo import compiled_autograd
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = models.BlockStack(d_in=5, d=8, d_out=3, blocks=1)
    if kind == "fully_shard":
        mesh = init_device_mesh("cpu", (ws,))
        fusedist.fully_shard(model.blocks[0], mesh=mesh)
        fusedist.fully_shard(model, mesh=mesh)
    else:
        model = fusedist.DistributedDataParallel(model)
    x, y = torch.randn(4, 5), torch.randn(4, 3)
    enabled = compiled_autograd._enable(torch.compile(backend=BACKEND))
    with enabled if around_forward else contextlib.nullcontext():
        loss = F.mse_loss(model(x), y)
        with contextlib.nullcontext() if around_forward else enabled:
            loss.backward()


@pytest.mark.parametrize("kind", ["fully_shard", "DistributedDataParallel"])
def test_compiled_autograd_refused_by_name(kind, shared_launch):
    """DDP refused it at the training forward; enabled around the backward alone, it (and
    fully_shard in both cases) let the backward finish without its end-of-backward callback
    (fully_shard's last reduction), and the step then said no backward had run."""
    for around_forward in (True, False):
        for rank, (passed, raised) in enumerate(shared_launch[(kind, around_forward)]):
            assert not passed and f"{kind}: compiled autograd is enabled" in raised, \
                (kind, around_forward, rank, raised)


@pytest.fixture(scope="module")
def shared_launch(request):
    """One launch of 2 ranks runs the selected tests' checks in sequence, each with a fresh
    dynamo (each launch costs a process group and the imports in every rank, and dynamo's first
    compile in a process costs more than the next); the refusals run last, each raising."""
    return launch_for_selected(request, with_fresh_compiler({
        "test_compiled_training_step_ddp_and_zero_match_torch": {"ddp": (_ddp_worker,)},
        "test_compiled_training_step_syncbn_matches_global_batchnorm": {"syncbn": (_syncbn_worker,)},
        "test_compiled_training_step_fully_shard_matches_fsdp2": {"fully_shard": (_fsdp_worker,)},
        "test_fullgraph_compile_inside_the_wrapper_matches_torch_and_whole_wrapper_says_how": {
            "fullgraph": (_fullgraph_worker,)},
        "test_compiled_autograd_refused_by_name": {
            (kind, around): (_compiled_autograd_worker, kind, around)
            for kind in ("fully_shard", "DistributedDataParallel") for around in (True, False)},
    }), 2, timeout=600)
