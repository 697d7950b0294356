"""``fusedist.fully_shard`` under Lightning's ModelParallelStrategy, the way Lightning users
train FSDP2 models: ``configure_model`` shards each block and the root over
``self.device_mesh["data_parallel"]``. Each fusedist run (``FusedistModelParallelStrategy``,
``fusedist.fully_shard``) is compared with Lightning's ``ModelParallelStrategy`` over torch's
``fully_shard`` on the same data, at 2 ranks:

* gradient clipping by norm (``gradient_clip_val`` small enough to clip every step): Lightning
  clips with torch's clip_grad_norm_, whose norm over fusedist's plain pieces is the rank's own;
  the strategy clips by the global norm;
* fp16 mixed precision with its scaler (fusedist's GradScaler, found-inf across the ranks);
* resuming with ``trainer.fit(ckpt_path=...)`` from Lightning's sharded checkpoint (Lightning's
  loader did not recognise a fusedist model: "Could not find a distributed model") and from
  its full one (``save_distributed_checkpoint=False``), written by fusedist or by torch: one
  epoch, save, one more epoch equal two epochs straight.

Ranks are processes of :func:`fusedist.testing.run_distributed` with the torchelastic
variables set (test_e2e_lightning_recipe.py). Tolerance: fp32, the same operations in another
order (flat-buffer reduce-scatter against FSDP2's per-parameter one, fused clip) over 8 steps
on values of order 1: 1e-5; fp16 autocast: 1e-3 (a differently rounded fp32 weight can move a
matmul output by one fp16 ulp, 2^-11 relative). What the tests exist for moves the weights by
1e-3 or more (clipping by another coefficient; a resume that restarts the optimizer).
"""

from __future__ import annotations

import os
import random
import warnings

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed
from shared_rank_launch import results_of
from test_e2e_lightning_recipe import _launched_env
from test_lightning_launch import register, shared_launch

WORLD = 2


def _module_class(fully_shard, tensor_parallel: bool = False):
    import lightning as L

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 12))
                                        for _ in range(2))
            self.head = nn.Linear(12, 3)

        def forward(self, x):
            for block in self.blocks:
                x = x + block(x)
            return self.head(x)

    class Sharded(L.LightningModule):
        def __init__(self, seed: int):
            super().__init__()
            torch.manual_seed(seed)
            self.net = Net()

        def configure_model(self):
            if tensor_parallel:  # Lightning's TP recipe: the plan on "tensor_parallel", then fully_shard
                from torch.distributed.tensor import Replicate
                from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

                plan = {f"blocks.{i}.{j}": style for i in range(2)
                        for j, style in ((0, ColwiseParallel()), (2, RowwiseParallel()))}
                plan["head"] = ColwiseParallel(output_layouts=Replicate())
                parallelize_module(self.net, self.device_mesh["tensor_parallel"], plan)
            mesh = self.device_mesh["data_parallel"]
            for block in self.net.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.net.parameters(), lr=0.02, weight_decay=0.1)

    return Sharded


def _data(seed: int):
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(64, 12, generator=g)
    y = torch.sin(2 * x[:, :3]) + 0.1 * torch.randn(64, 3, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _fit(side: str, seed: int, epochs: int, *, ckpt_path=None, save=None, distributed_ckpt=True, tp: int = 1,
         **trainer_kw):
    """One fit; returns the whole parameters (gathered) and the loss logged last."""
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if side == "torch":
        from torch.distributed.fsdp import fully_shard
        strategy_class = ModelParallelStrategy
    else:
        from fusedist import fully_shard
        from fusedist.integrations.lightning import FusedistModelParallelStrategy as strategy_class
    strategy = strategy_class(data_parallel_size=WORLD, tensor_parallel_size=tp,
                              save_distributed_checkpoint=distributed_ckpt)
    trainer = L.Trainer(accelerator="cpu", devices=WORLD * tp, strategy=strategy, max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        **trainer_kw)
    module = _module_class(fully_shard, tensor_parallel=tp > 1)(seed)
    trainer.fit(module, _data(seed), ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    full = get_model_state_dict(module.net, options=StateDictOptions(full_state_dict=True))
    torch.distributed.barrier()
    return torch.cat([full[k].float().reshape(-1) for k in sorted(full)])


def _worker(rank: int, world: int, seed: int, root: str):
    from lightning.pytorch.plugins.precision import MixedPrecision

    _launched_env(rank, world)
    warnings.filterwarnings("ignore")
    out = {}
    clip = dict(gradient_clip_val=0.05)
    out["clip by norm"] = (_fit("fusedist", seed, 2, **clip), _fit("torch", seed, 2, **clip), 1e-5)
    # Lightning turns precision="16-mixed" into bf16 on a CPU; the plugin keeps fp16 and its scaler.
    # One plugin per fit: a plugin keeps its scaler's state across fits (as under strategy="ddp"), so
    # a shared one started the second fit at the scale the first ended with (a step skipped at the
    # initial scale in one fit was taken in the other).
    def fp16():
        return dict(plugins=[MixedPrecision("16-mixed", "cpu")], **clip)
    out["16-mixed + clip"] = (_fit("fusedist", seed, 2, **fp16()), _fit("torch", seed, 2, **fp16()), 1e-3)

    # (one epoch, 4 steps, before the save: a resume that restarted the optimizer moves the
    # weights by far more than the tolerance within the 4 steps after it)
    straight = _fit("torch", seed, 2)
    for distributed_ckpt in (True, False):
        kind = "sharded" if distributed_ckpt else "full"
        for writer in ("fusedist", "torch"):
            path = os.path.join(root, f"{kind}-{writer}.ckpt")
            _fit(writer, seed, 1, save=path, distributed_ckpt=distributed_ckpt)
            resumed = _fit("fusedist", seed, 2, ckpt_path=path, distributed_ckpt=distributed_ckpt)
            out[f"resume from {writer}'s {kind} checkpoint"] = (resumed, straight, 1e-5)
    return {name: (float((ours - ref).abs().max()), tol) for name, (ours, ref, tol) in out.items()}


SEED = random.randrange(2**20)  # fresh each run


def _jobs(tmp_path_factory):
    """The fully_shard runs (2 ranks), in the launch shared with the other Lightning and Fabric
    files (test_lightning_launch.py); the tensor-parallel test needs 4 ranks: a launch of its own."""
    return {"test_fully_shard_under_model_parallel_strategy_matches_fsdp2": {
        "fully_shard": (_worker, (SEED, str(tmp_path_factory.mktemp("model_parallel"))))}}


register(_jobs, seconds=600)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    return shared_launch(request, tmp_path_factory)


def test_fully_shard_under_model_parallel_strategy_matches_fsdp2(launched):
    seed = SEED
    results = results_of(launched, "fully_shard")
    failures = [f"rank {rank}: {name}: max |fusedist - torch| = {err:.3g} > {tol:g}"
                for rank, cases in enumerate(results) for name, (err, tol) in cases.items() if not err <= tol]
    assert not failures, f"seed {seed}:\n" + "\n".join(failures)


def _tensor_parallel_worker(rank: int, world: int, seed: int, root: str):
    _launched_env(rank, world)
    warnings.filterwarnings("ignore")
    tp = dict(tp=2)
    out = {"clip by norm": (_fit("fusedist", seed, 2, gradient_clip_val=0.05, **tp),
                            _fit("torch", seed, 2, gradient_clip_val=0.05, **tp), 1e-5)}
    straight = _fit("torch", seed, 2, **tp)  # (one epoch, save, one more: as in _worker)
    for writer in ("fusedist", "torch"):
        path = os.path.join(root, f"tp-{writer}.ckpt")
        _fit(writer, seed, 1, save=path, **tp)
        out[f"resume from {writer}'s sharded checkpoint"] = (_fit("fusedist", seed, 2, ckpt_path=path, **tp),
                                                              straight, 1e-5)
    return {name: (float((ours - ref).abs().max()), tol) for name, (ours, ref, tol) in out.items()}


def test_tensor_parallel_under_model_parallel_strategy_matches_fsdp2(tmp_path):
    """tensor_parallel_size=2: configure_model applies a column/row-wise plan on
    device_mesh["tensor_parallel"] and fully_shard on device_mesh["data_parallel"] (2x2, 4
    ranks); the global-norm clip and resuming from Lightning's sharded checkpoint, written by
    fusedist or by torch, as under FSDP2."""
    seed = random.randrange(2**20)
    results = run_distributed(_tensor_parallel_worker, 2 * WORLD, seed, str(tmp_path), timeout=600)
    failures = [f"rank {rank}: {name}: max |fusedist - torch| = {err:.3g} > {tol:g}"
                for rank, cases in enumerate(results) for name, (err, tol) in cases.items() if not err <= tol]
    assert not failures, f"seed {seed}:\n" + "\n".join(failures)
