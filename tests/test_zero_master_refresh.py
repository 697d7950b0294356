"""ZeroRedundancyOptimizer takes parameters written from outside into its masters, and only
those (Note [parameters changed outside the optimizer] in fusedist/zero/shards.py).

With bf16 parameters the FP32 masters hold more than the parameters: refreshing a master
from its parameter rounds it. A write to one parameter (``clamp_`` under no_grad, a partial
``load_state_dict``) must reach that parameter's master and leave every other master as it
is, bit for bit. Checked on the masters directly (a step with lr=0 leaves AdamW's masters
exactly as the refresh left them), against an oracle that keeps FP32 masters by hand and
refreshes only the written one, and across parameters joining the partition after the write.
"""

import copy
import os

import pytest
import torch
from torch import nn

import models
from shared_rank_launch import launch_for_selected, results_of

TINY_BUCKETS = dict(bucket_cap_mb=0.0005, first_bucket_cap_mb=0.0002)  # several buckets


class Mixed(nn.Module):
    """fp32 -> bf16 -> bf16 layers: aliased (fp32) and copied (bf16) masters in one optimizer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16).to(torch.bfloat16)
        self.c = nn.Linear(16, 4).to(torch.bfloat16)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h.to(torch.bfloat16)))
        return self.c(h).float()


def _step(model, opt, gen):
    x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _masters(opt) -> dict:
    """This rank's master of every parameter it owns elements of: index -> (range, FP32 copy)."""
    return {i: (f[0]["range"], f[0]["master"]) for i, f in opt.shard_state_dict()["fragments"].items()}


def _write(kind, module):
    """The write from outside; returns the written parameter."""
    with torch.no_grad():
        if kind == "clamp_ bf16":
            module.b.weight.clamp_(-0.05, 0.05)
            return module.b.weight
        if kind == "partial load_state_dict bf16":
            module.load_state_dict({"c.bias": torch.full_like(module.c.bias, 0.3)}, strict=False)
            return module.c.bias
        module.a.weight.mul_(0.5)  # fp32: aliased master without offload, a copy with it
        return module.a.weight


def _masters_worker(rank, world_size):
    import fusedist

    out = {}
    for stage in (1, 2):
        for offload in (None, "cpu"):
            for kind in ("clamp_ bf16", "partial load_state_dict bf16", "mul_ fp32"):
                name = f"stage={stage} offload={offload} {kind}"
                model = fusedist.DistributedDataParallel(Mixed(), **TINY_BUCKETS)
                opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=stage,
                                                       offload=offload, lr=1e-2, weight_decay=0.1)
                params = [p for g in opt.param_groups for p in g["params"]]  # the state dict's indexing
                gen = torch.Generator().manual_seed(10 + rank)
                for _ in range(3):
                    _step(model, opt, gen)
                before = _masters(opt)
                # The FP32 masters of bf16 parameters hold more than bf16 (else rounding them
                # would go unnoticed).
                out[f"{name}: masters finer than bf16"] = any(
                    not torch.equal(m, m.bfloat16().float())
                    for i, (_, m) in before.items() if params[i].dtype == torch.bfloat16)
                written = _write(kind, model.module)
                w = next(i for i, p in enumerate(params) if p is written)
                for g in opt.param_groups:
                    g["lr"] = 0.0  # AdamW with lr=0 leaves the masters as the refresh left them
                _step(model, opt, gen)
                after = _masters(opt)
                bad = []
                for i, (rng, m) in after.items():
                    if i == w:
                        lo, hi = rng
                        if not torch.equal(m, written.detach().reshape(-1)[lo:hi].float()):
                            bad.append(f"written parameter {i}: master is not the written value")
                    elif not torch.equal(m, before[i][1]):
                        bad.append(f"parameter {i}: master changed")
                out[f"{name}: written parameter owned here"] = w in after
                out[name] = bad
    return out


def test_refresh_takes_only_the_written_parameter(launched):
    results = results_of(launched, "masters")
    for r in results:
        assert all(v for k, v in r.items() if k.endswith("masters finer than bf16")), r
        bad = {k: v for k, v in r.items() if not k.endswith(("bf16", "here")) and v}
        assert not bad, bad
    for kind in ("clamp_ bf16", "partial load_state_dict bf16", "mul_ fp32"):
        for stage in (1, 2):  # some rank owns elements of the written parameter
            assert any(r[f"stage={stage} offload=None {kind}: written parameter owned here"] for r in results)


def _oracle_worker(rank, world_size):
    """ZeRO (stage 1, 2; offload) against a DDP model of bf16 parameters stepped by torch's
    AdamW over FP32 masters kept by hand, where a write refreshes only the written master.
    lr=1e-3 moves a weight by about one bf16 ulp or less per step, so the masters' extra bits
    carry the training: masters rounded once end 1e-5..1e-4 off. Tolerance 2e-6: the offloaded
    C++ Adam and torch's AdamW differ by a few float32 ulp."""
    import fusedist

    base = models.MLP(d_in=8, hidden=16).to(torch.bfloat16)
    out = {}
    for stage in (1, 2):
        for offload in (None, "cpu"):
            ref = fusedist.DistributedDataParallel(copy.deepcopy(base), **TINY_BUCKETS)
            masters = [p.detach().float().clone() for p in ref.parameters()]
            ropt = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.1, foreach=False)
            model = fusedist.DistributedDataParallel(copy.deepcopy(base), **TINY_BUCKETS)
            opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=stage,
                                                   offload=offload, lr=1e-3, weight_decay=0.1, foreach=False)
            for step in range(6):
                gen = torch.Generator().manual_seed(1000 * step + rank)  # fresh inputs per step
                x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
                if step == 3:
                    with torch.no_grad():
                        for m in (model.module, ref.module):
                            m.layers[1].weight.clamp_(-0.1, 0.1)
                        masters[2].copy_(ref.module.layers[1].weight.float())  # the written one only
                for m, o in ((model, opt), (ref, None)):
                    m.zero_grad()
                    nn.functional.mse_loss(m(x.bfloat16()).float(), y).backward()
                    if o is not None:
                        o.step()
                with torch.no_grad():
                    for mst, p in zip(masters, ref.parameters()):
                        mst.grad = p.grad.float()
                    ropt.step()
                    for mst, p in zip(masters, ref.parameters()):
                        p.copy_(mst)
            diffs = {}
            for i, (rng, m) in _masters(opt).items():
                lo, hi = rng
                diffs[i] = (m - masters[i].reshape(-1)[lo:hi]).abs().max().item()
            out[f"stage={stage} offload={offload}"] = diffs
    return out


def test_refresh_against_an_oracle(launched):
    for r in results_of(launched, "oracle"):
        for name, diffs in r.items():
            assert diffs and max(diffs.values()) <= 2e-6, (name, diffs)


def _grow_worker(rank, world_size):
    """Without DDP (stage 1, the same batches on every rank): a parameter written, then a
    param group added before the next step. The write reaches the master; the other masters
    stay as they were."""
    import fusedist

    os.environ["FUSEDIST_KERNEL_BACKEND"] = "torch"
    torch.manual_seed(0)
    model = models.MLP(d_in=8, hidden=16).to(torch.bfloat16)
    model.layers[2].requires_grad_(False)
    opt = fusedist.ZeroRedundancyOptimizer(list(model.layers[:2].parameters()), torch.optim.AdamW,
                                           lr=1e-2, bucket_cap_mb=0.0005)
    gen = torch.Generator().manual_seed(5)

    def step():
        x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
        opt.step()

    for _ in range(2):
        step()
    before = _masters(opt)
    with torch.no_grad():
        model.layers[0].weight.mul_(0.5)
    written = model.layers[0].weight.detach().clone()
    model.layers[2].requires_grad_(True)
    opt.add_param_group({"params": list(model.layers[2].parameters())})
    for g in opt.param_groups:
        g["lr"] = 0.0
    step()
    after = _masters(opt)
    params = [p for g in opt.param_groups for p in g["params"]]  # the state dict's indexing
    return {
        "write kept": torch.equal(model.layers[0].weight.detach(), written),
        "masters not their parameter": [  # the written one and the joined ones
            i for i, ((lo, hi), m) in after.items()
            if (i not in before or i == 0) and not torch.equal(m, params[i].detach().reshape(-1)[lo:hi].float())],
        "other masters changed": [i for i, (_, m) in before.items() if i != 0 and not torch.equal(after[i][1], m)],
        "owned": sorted(after),
    }


def test_refresh_after_parameters_joined(launched):
    results = results_of(launched, "grow")
    for r in results:
        assert r["write kept"] and not r["masters not their parameter"] and not r["other masters changed"], r
    assert sorted({i for r in results for i in r["owned"]}) == list(range(6))  # every parameter, joined too


@pytest.fixture(scope="module")
def launched(request):
    """The three checks in one launch of 2 ranks. The last one selects the torch kernel
    backend for its process (FUSEDIST_KERNEL_BACKEND), so it runs after the others."""
    return launch_for_selected(request, {
        "test_refresh_takes_only_the_written_parameter": {"masters": (_masters_worker, ())},
        "test_refresh_against_an_oracle": {"oracle": (_oracle_worker, ())},
        "test_refresh_after_parameters_joined": {"grow": (_grow_worker, ())},
    }, 2, timeout=300)
