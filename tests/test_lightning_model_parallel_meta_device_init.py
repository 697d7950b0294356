"""A LightningModule built on the meta device (``with trainer.init_module(empty_init=True)``,
Lightning's recipe for models too big for one device) under ``FusedistModelParallelStrategy``,
whose ``configure_model`` shards with ``fusedist.fully_shard``.

Lightning materializes such a module in ``ModelParallelStrategy.setup`` with ``to_empty`` and
``reset_parameters()`` on every submodule. On fusedist's pieces that failed ("Fan in and fan
out can not be computed": the head's weight is cut anywhere, a 1-D piece) or drew the same
numbers on every rank; the strategy now initializes through ``fusedist.fsdp.init_parameters``
(Note [materializing fully_shard units]). Reference, on the same fresh random seed: the
unsharded module built on the CPU from that RNG state, and Lightning's ``ModelParallelStrategy``
over torch's ``fully_shard`` training that module. Tolerances: the initial weights are the same
draws, bit for bit; after training, as in test_lightning_model_parallel.py (fp32, the same
operations in another order over 8 steps on values of order 1): 1e-5.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from shared_rank_launch import results_of
from test_e2e_lightning_recipe import _launched_env
from test_lightning_launch import register, shared_launch
from test_lightning_model_parallel import _data, _module_class

WORLD = 2


def _trainer(strategy_class, dp: int, tp: int, epochs: int = 1):
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=dp * tp, strategy=strategy_class(data_parallel_size=dp,
                                                                                 tensor_parallel_size=tp),
                     max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)


def _whole(module):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(module.net, options=StateDictOptions(full_state_dict=True))
    return torch.cat([full[k].float().reshape(-1) for k in sorted(full)])


def _fusedist_on_meta(seed: int, dp: int, tp: int, fit: bool):
    from fusedist import fully_shard
    from fusedist.integrations.lightning import FusedistModelParallelStrategy

    trainer = _trainer(FusedistModelParallelStrategy, dp, tp, epochs=1 if fit else 0)  # 0: set up, no step
    with trainer.init_module(empty_init=True):
        module = _module_class(fully_shard, tensor_parallel=tp > 1)(seed)
    assert next(module.parameters()).is_meta
    torch.manual_seed(seed)  # the RNG state the reference module is built from
    trainer.fit(module, _data(seed))
    return _whole(module)


def _worker(rank: int, world: int, seed: int, dp: int, tp: int):
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    _launched_env(rank, world)
    warnings.filterwarnings("ignore")
    reference_class = _module_class(fully_shard, tensor_parallel=tp > 1)
    initial = torch.cat([t.float().reshape(-1) for _, t in sorted(reference_class(seed).net.state_dict().items())])
    trainer = _trainer(ModelParallelStrategy, dp, tp)
    module = reference_class(seed)
    trainer.fit(module, _data(seed))
    trained = _whole(module)
    return {"initial weights": (float((_fusedist_on_meta(seed, dp, tp, fit=False) - initial).abs().max()), 0.0),
            "trained weights": (float((_fusedist_on_meta(seed, dp, tp, fit=True) - trained).abs().max()), 1e-5)}


def _check(results, seed):
    failures = [f"rank {rank}: {name}: max |fusedist - torch| = {err:.3g} > {tol:g}"
                for rank, cases in enumerate(results) for name, (err, tol) in cases.items() if not err <= tol]
    assert not failures, f"seed {seed}:\n" + "\n".join(failures)


SEEDS = [random.randrange(2**20) for _ in range(2)]  # fresh each run


def _jobs(tmp_path_factory):
    """Both tests' workers, each on a fresh random seed, in the launch shared with the other
    Lightning and Fabric files (test_lightning_launch.py)."""
    return {"test_meta_device_build_initializes_as_the_unsharded_module": {"dp": (_worker, (SEEDS[0], WORLD, 1))},
            "test_meta_device_build_with_tensor_parallelism": {"tp": (_worker, (SEEDS[1], 1, WORLD))}}


register(_jobs, seconds=450)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    return dict(shared_launch(request, tmp_path_factory), seeds=SEEDS)


def test_meta_device_build_initializes_as_the_unsharded_module(launched):
    """2 ranks: the root unit's head weight (3x12, with the head bias) is cut mid-row."""
    _check(results_of(launched, "dp"), launched["seeds"][0])


def test_meta_device_build_with_tensor_parallelism(launched):
    """data_parallel_size=1, tensor_parallel_size=2: the plan's DTensors are made whole as the
    global parameters, each rank keeping its columns or rows."""
    _check(results_of(launched, "tp"), launched["seeds"][1])
