"""The FSDP2 names a training script imports from ``torch.distributed.fsdp`` exist in fusedist,
so moving the import is the whole swap: ``isinstance(m, FSDPModule)`` (torchtitan walks the
model with it to set per-module options) finds exactly the modules ``fully_shard`` was applied
to, and the loop trains as with torch's FSDP2 (same loss trajectory, 2 gloo ranks)."""

from __future__ import annotations

import random

import torch
from torch import nn

import fusedist
import fusedist.fsdp
from fusedist.testing import run_distributed

#: FSDP2's public names (torch.distributed.fsdp.__all__ less FSDP1's and DataParallelMeshDims, which is in
#: fusedist.fsdp only: fully_shard refuses it).
FSDP2_NAMES = ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "CPUOffloadPolicy", "OffloadPolicy",
               "UnshardHandle", "register_fsdp_forward_method", "share_comm_ctx")


def test_fsdp2_names_exported_at_top_level_and_in_fsdp():
    for name in FSDP2_NAMES:
        assert getattr(fusedist, name) is getattr(fusedist.fsdp, name), name
    assert fusedist.FSDPModule is fusedist.fsdp.FullyShardedModule


def test_every_public_fsdp_module_method_takes_fsdp2s_arguments():
    """Every public method of torch's ``FSDPModule`` exists on fusedist's with the same parameters
    (names, kinds, defaults), so calls written for torch's bind the same way."""
    import inspect

    from torch.distributed.fsdp import FSDPModule

    def shape(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    public = [n for n in vars(FSDPModule) if not n.startswith("_") and callable(getattr(FSDPModule, n))]
    assert len(public) > 20, public
    for name in public:
        ours = getattr(fusedist.FSDPModule, name, None)
        assert ours is not None, f"fusedist.FSDPModule has no {name}"
        assert shape(ours) == shape(getattr(FSDPModule, name)), name


def test_fsdp2s_other_names_answer_as_torchs_or_are_refused_by_name():
    """``DataParallelMeshDims`` imports from fusedist.fsdp (torch's class; ``fully_shard`` refuses the
    argument by name); ``UnshardHandle()`` is a handle with nothing to wait for, as torch's; and
    ``fully_shard.state(module)`` -- torch's composable-API state, which fusedist does not keep -- is
    refused naming what to use (it was an AttributeError on the function)."""
    import pytest
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.fsdp import UnshardHandle as TorchUnshardHandle

    assert fusedist.fsdp.DataParallelMeshDims is DataParallelMeshDims
    assert "DataParallelMeshDims" in fusedist.fsdp.__all__
    assert fusedist.UnshardHandle().wait() is None and TorchUnshardHandle().wait() is None
    with pytest.raises(NotImplementedError, match=r"fully_shard.state\(Linear\).*no torch composable-API state"):
        fusedist.fully_shard.state(nn.Linear(2, 2))


def test_fsdp1_names_are_refused_naming_fully_shard():
    """Every name of ``torch.distributed.fsdp.__all__`` is in fusedist.fsdp, or is FSDP1's and its
    import is refused saying so (it was Python's bare "cannot import name")."""
    import importlib

    import pytest
    import torch.distributed.fsdp as torch_fsdp

    missing = [n for n in torch_fsdp.__all__ if n not in fusedist.fsdp.__all__]
    assert "FullyShardedDataParallel" in missing and "fully_shard" not in missing, missing
    for name in missing:
        with pytest.raises(ImportError, match=rf"has no {name}: it belongs to torch's FSDP1 API.*fully_shard"):
            exec(f"from fusedist.fsdp import {name}", {})
    fsdp = importlib.import_module("fusedist.fsdp")
    assert not hasattr(fsdp, "NoSuchName")  # other names: a plain AttributeError


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 3))


def _shard(model, fully_shard):
    for block in (model[0], model[2]):
        fully_shard(block)
    fully_shard(model)
    return model


def _train(model, fsdp_module_cls, seed: int, rank: int) -> list:
    # torchtitan-style: per-module options set by walking the model with isinstance.
    found = []
    for name, m in model.named_modules():
        if isinstance(m, fsdp_module_cls):
            found.append(name)
            m.set_reshard_after_backward(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed * 10 + rank)
    losses = []
    for _ in range(3):
        x, y = torch.randn(8, 12, generator=g), torch.randn(8, 3, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return found, losses


def _worker(rank, world_size, seed):
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    ours = _shard(_model(seed), fusedist.fully_shard)
    theirs = _shard(_model(seed), torch_fully_shard)
    assert not isinstance(_model(seed), fusedist.FSDPModule)
    return _train(ours, fusedist.FSDPModule, seed, rank), _train(theirs, TorchFSDPModule, seed, rank)


def test_isinstance_fsdp_module_finds_the_sharded_modules_and_trains_like_torch():
    seed = random.randrange(2**31)
    for (found, losses), (found_torch, losses_torch) in run_distributed(_worker, 2, seed):
        assert found == found_torch == ["", "0", "2"], (seed, found, found_torch)
        # fp32, same ops on the same values: the losses agree to float rounding (the sum of
        # two ranks' gradient shards may be formed in another order).
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(losses_torch), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"seed {seed}: {m}")
