"""torchao's float8 training weights under fusedist's data parallelism -- DDP, ``replicate``,
ZeRO-1/2 -- against torch DDP with torch's AdamW on the same model.

Such a weight is a tensor subclass wrapping an fp32 tensor (``fusedist/_wrapper.py``); each
forward casts it to float8. Everything that writes parameters must write the wrapped tensor:
ZeRO re-points every parameter into its flat buffer (the updated shards are gathered there),
and re-pointing a wrapper's ``.data`` left the tensor its cast reads on the initial weights,
so every step after the first trained the wrong model without a word. Fused optimizers step
the wrapped tensor too (a wrapper has no memory of its own).

``fusedist.checkpoint`` saves their fp32 values (a wrapper has no storage to write), which load
into the float8 weights of any strategy: a ZeRO-2 checkpoint into ``fully_shard``, that one into
DDP, each continuing the saved training exactly.

Tolerance: the same float8 casts and fp32 reductions on both sides; torch's AdamW on both, or
fusedist's fused AdamW (a few fp32 ulps per step): ``rtol=1e-5, atol=1e-6`` on losses and
weights. A stale weight is off by the whole first update (lr 1e-2).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fusedist
from shared_rank_launch import launch_for_selected, results_of

CLOSE = dict(rtol=1e-5, atol=1e-6)


def _model():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16))
    return convert_to_float8_training(m, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))


def _train(rank, wrap, make_opt):
    m = _model()
    w = wrap(m)
    opt = make_opt(w.parameters())
    losses = []
    for step in range(3):
        torch.manual_seed(100 + step)
        x = torch.randn(16, 32)[rank * 8:(rank + 1) * 8]
        loss = w(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in m.state_dict().items()}, type(m[0].weight).__name__


def _worker(rank, world):
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    adamw = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731
    ref_losses, ref_weights, _ = _train(rank, torch.nn.parallel.DistributedDataParallel, adamw)
    variants = {
        "DDP": (fusedist.DistributedDataParallel, adamw),
        "DDP + FusedAdamW": (fusedist.DistributedDataParallel,
                             lambda params: fusedist.optim.FusedAdamW(params, lr=1e-2)),
        "replicate": (fusedist.replicate, adamw),
    }
    for stage in (1, 2):
        variants[f"ZeRO-{stage}"] = (fusedist.DistributedDataParallel, lambda params, stage=stage:
                                     fusedist.ZeroRedundancyOptimizer(params, torch.optim.AdamW, stage=stage, lr=1e-2))
        variants[f"ZeRO-{stage} + FusedAdamW"] = (
            fusedist.DistributedDataParallel, lambda params, stage=stage:
            fusedist.ZeroRedundancyOptimizer(params, fusedist.optim.FusedAdamW, stage=stage, lr=1e-2))
    for name, (wrap, make_opt) in variants.items():
        losses, weights, kind = _train(rank, wrap, make_opt)
        assert kind == WeightWithDynamicFloat8CastTensor.__name__, (name, kind)  # still float8 weights
        torch.testing.assert_close(losses, ref_losses, **CLOSE, msg=lambda m, name=name: f"{name}: {m}")
        for k, v in ref_weights.items():
            torch.testing.assert_close(weights[k].float(), v.float(), **CLOSE,
                                       msg=lambda m, name=name, k=k: f"{name}, {k}: {m}")
    return sorted(variants)


def test_float8_weights_train_as_under_torch_ddp(launched):
    assert len(results_of(launched, "train")[0]) == 7


def _checkpoint_worker(rank, world, path):
    import os

    def steps(w, opt, seeds):
        out = []
        for s in seeds:
            torch.manual_seed(100 + s)
            loss = w(torch.randn(16, 32)[rank * 8:(rank + 1) * 8]).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    def sharded():
        m = _model()
        for layer in (m[0], m[2], m):
            fusedist.fully_shard(layer)
        return m

    # ZeRO-2 -> fully_shard -> DDP: each load continues the saved training exactly
    zero = fusedist.DistributedDataParallel(_model())
    zero_opt = fusedist.ZeroRedundancyOptimizer(zero.parameters(), torch.optim.AdamW, stage=2, lr=1e-2)
    steps(zero, zero_opt, range(2))
    fusedist.checkpoint.save(os.path.join(path, "zero"), zero, zero_opt)
    fs = sharded()
    fs_opt = torch.optim.AdamW(fs.parameters(), lr=1e-2)
    fusedist.checkpoint.load(os.path.join(path, "zero"), fs, fs_opt)
    assert steps(fs, fs_opt, (5,)) == steps(zero, zero_opt, (5,))
    fusedist.checkpoint.save(os.path.join(path, "fully_shard"), fs, fs_opt)
    ddp = fusedist.DistributedDataParallel(_model())
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    fusedist.checkpoint.load(os.path.join(path, "fully_shard"), ddp, ddp_opt)
    assert steps(ddp, ddp_opt, (6,)) == steps(fs, fs_opt, (6,))
    return type(ddp.module[0].weight).__name__


def test_float8_checkpoints_cross_strategies(launched):
    """fusedist.checkpoint with float8 weights (it failed on the wrapper's missing storage):
    the files hold their fp32 values, which load into any strategy's float8 weights."""
    assert results_of(launched, "checkpoints") == ["WeightWithDynamicFloat8CastTensor"] * 2


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """Both tests' 2-rank cases in one launch (each builds its own models)."""
    return launch_for_selected(request, {
        "test_float8_weights_train_as_under_torch_ddp": {"train": (_worker, ())},
        "test_float8_checkpoints_cross_strategies": {
            "checkpoints": (_checkpoint_worker, (str(tmp_path_factory.mktemp("float8")),))},
    }, 2, timeout=240)
