"""``fusedist.integrations.lightning.grad_norm`` under ``FusedistModelParallelStrategy``, where
``configure_model`` shards with ``fusedist.fully_shard`` and a parameter is this rank's piece
(Note [gradient norms of fully_shard pieces]), against, on the same module, data and seed:

* Lightning's ``ModelParallelStrategy`` over torch's ``fully_shard`` (FSDP2), logging what
  Lightning's ``grad_norm`` computes there: ``p.grad.data.norm(norm_type)`` per parameter,
  which on FSDP2's DTensor gradients is the whole parameter's norm, and the norm of those as the
  total. Lightning's function itself cannot log it in this torch: it stacks the norms with
  ``torch.tensor(list_of_norms)``, which fails on DTensors, so the reference is its two lines
  with each DTensor norm read out with ``full_tensor()``. FSDP2 cannot take the inf-norm of a
  parameter with an empty piece (torch's vector_norm refuses the empty local tensor), so this
  reference covers the orders 2 and 1.5;
* Lightning's ``strategy="ddp"`` with Lightning's own ``grad_norm`` on the unsharded module.

Before, fusedist's ``grad_norm`` was Lightning's on the pieces: each rank logged the norms of
its own pieces. The module has parameters whose pieces differ in size between the ranks and a
one-element bias whose piece on rank 1 is empty. Inputs are fresh random draws per run (the
seed is in the failure message). Tolerances as in test_lightning_grad_norm.py: the same math in
another order, 1e-5 relative in fp32 and 1e-3 under fp16 autocast (norms of order 1).
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from torch import nn

from shared_rank_launch import results_of
from test_e2e_lightning_recipe import _launched_env
from test_lightning_drop_in import _memory_logger
from test_lightning_launch import register, shared_launch

WORLD = 2
TOL = {"32-true": 1e-5, "16-mixed": 1e-3}
NORM_TYPES = (2, "inf", 1.5)
FSDP2_NORM_TYPES = (2, 1.5)  # (module docstring)


def _reference_grad_norm(module, norm_type, group_separator="/"):
    """Lightning's ``grad_norm`` with DTensor norms made plain tensors (module docstring)."""
    from torch.distributed.tensor import DTensor

    norm_type = float(norm_type)
    norms = {}
    for name, p in module.named_parameters():
        if p.grad is not None:
            norm = p.grad.data.norm(norm_type)
            norms[f"grad_{norm_type}_norm{group_separator}{name}"] = \
                norm.full_tensor() if isinstance(norm, DTensor) else norm
    if norms:
        norms[f"grad_{norm_type}_norm_total"] = torch.tensor(list(norms.values())).norm(norm_type)
    return norms


def _module(side: str, seed: int):
    import lightning as L

    if side == "fusedist":
        from fusedist import fully_shard
        from fusedist.integrations.lightning import grad_norm
    elif side == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        grad_norm = _reference_grad_norm
    else:
        from lightning.pytorch.utilities import grad_norm
        fully_shard = None

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 12))
                                        for _ in range(2))
            self.head = nn.Linear(12, 3)  # a bias of 3: pieces of 2 and 1
            self.gate = nn.Linear(12, 1)  # a bias of 1: rank 1's piece is empty

        def forward(self, x):
            for block in self.blocks:
                x = x + block(x)
            return self.head(x) * torch.sigmoid(self.gate(x))

    class Logged(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            self.net = Net()

        def configure_model(self):
            if fully_shard is None:
                return
            mesh = self.device_mesh["data_parallel"]
            for block in self.net.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x).float(), y)

        def on_before_optimizer_step(self, optimizer):
            for norm_type in FSDP2_NORM_TYPES if side == "fsdp2" else NORM_TYPES:
                self.log_dict(grad_norm(self, norm_type=norm_type))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.net.parameters(), lr=0.02, weight_decay=0.1)

    return Logged()


def _data(seed: int):
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(64, 12, generator=g)
    y = torch.sin(2 * x[:, :3]) + 0.1 * torch.randn(64, 3, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _fit(side: str, seed: int, precision: str, **trainer_kw) -> list:
    import lightning as L
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning.pytorch.strategies import ModelParallelStrategy

    from fusedist.integrations.lightning import FusedistModelParallelStrategy

    if side == "ddp":
        strategy = "ddp"
    else:
        kind = FusedistModelParallelStrategy if side == "fusedist" else ModelParallelStrategy
        strategy = kind(data_parallel_size=WORLD, tensor_parallel_size=1)
    # Lightning turns precision="16-mixed" into bf16 on a CPU; the plugin keeps fp16 and its scaler.
    plugins = [MixedPrecision("16-mixed", "cpu")] if precision == "16-mixed" else None
    logger = _memory_logger()
    trainer = L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_epochs=1, logger=logger,
                        precision=None if plugins else precision, plugins=plugins, log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        **trainer_kw)
    trainer.fit(_module(side, seed), _data(seed))
    return logger.rows


CASES = {
    "fp32": dict(precision="32-true"),
    "16-mixed, accumulate 2, clip": dict(precision="16-mixed", accumulate_grad_batches=2, gradient_clip_val=0.3),
}


def _worker(rank: int, world: int, seed: int):
    _launched_env(rank, world)
    warnings.filterwarnings("ignore")
    return {name: {side: _fit(side, seed, **options) for side in ("fusedist", "fsdp2", "ddp")}
            for name, options in CASES.items()}


def _compare(ours: list, ref: list, tol: float, what: str, subset: bool = False) -> None:
    """Row by row, the same keys (``subset``: all of ``ref``'s) and values within ``tol``."""
    steps = [row for _, row in ref if any(k.startswith("grad_") for k in row)]
    assert len(steps) >= 2, (what, ref[:2])
    assert len(ours) == len(ref), what
    for (step, mine), (ref_step, theirs) in zip(ours, ref):
        same_keys = mine.keys() >= theirs.keys() if subset else mine.keys() == theirs.keys()
        assert step == ref_step and same_keys, \
            f"{what}: logged\n {step} {sorted(mine)}\nvs\n {ref_step} {sorted(theirs)}"
        for key, value in theirs.items():
            # (fp16's first steps overflow at the initial scale: inf on both sides)
            assert mine[key] == value or abs(mine[key] - value) <= tol * max(1.0, abs(value)), \
                f"{what}: {key} at step {step}: {mine[key]} vs {value}"


SEED = random.randrange(2**20)  # fresh each run


def _jobs(tmp_path_factory):
    """The three sides' runs, in the launch shared with the other Lightning and Fabric files
    (test_lightning_launch.py)."""
    return {"test_grad_norm_of_fully_shard_pieces_matches_fsdp2_and_ddp": {"grad norms": (_worker, (SEED,))}}


register(_jobs, seconds=600)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    return shared_launch(request, tmp_path_factory)


def test_grad_norm_of_fully_shard_pieces_matches_fsdp2_and_ddp(launched):
    """Every step logs the keys and values of FSDP2's per-parameter global norms (and of DDP's
    on the unsharded module), the same on every rank."""
    seed = SEED
    results = results_of(launched, "grad norms")
    for rank, cases in enumerate(results):
        for name, runs in cases.items():
            tol = TOL[CASES[name]["precision"]]
            for ref in ("fsdp2", "ddp"):
                _compare(runs["fusedist"], runs[ref], tol, f"seed {seed}, {name}, rank {rank}, against {ref}",
                         subset=ref == "fsdp2")
    for name in CASES:
        assert results[0][name]["fusedist"] == results[1][name]["fusedist"], f"seed {seed}, {name}"
