"""Resuming with a Checkpointer: refusals that must come at once, before anything is loaded or saved.

An optimizer whose parameters are the saved ones but grouped otherwise (a weight-decay split
added since) cannot take the checkpoint's state, whichever step is tried: the restore refuses
the newest checkpoint, naming the group sizes, without warning that it "could not be loaded"
and trying every older one as if its files were damaged (Note [param groups that do not
match] in ``fusedist/checkpoint/_restore.py``). A sampler that cannot save its position (torch's
``DistributedSampler``, a ``RandomSampler``) is refused by ``restore``, naming the drop-in that
can, instead of failing every later save with an AttributeError.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import models
from fusedist.testing import run_distributed


def _model_and_optimizer(split: bool, seed: int = 0):
    import fusedist

    torch.manual_seed(seed)
    module = models.BlockStack()
    params = list(module.parameters())
    groups = [dict(params=params[:4]), dict(params=params[4:], lr=5e-3)] if split else [dict(params=params)]
    model = fusedist.DistributedDataParallel(module)
    return model, fusedist.ZeroRedundancyOptimizer(groups, torch.optim.AdamW, stage=2, lr=1e-2)


def _train_and_save(rank, world, root):
    from fusedist.checkpoint import Checkpointer

    model, opt = _model_and_optimizer(split=True)
    ckpt = Checkpointer(root, run_id="groups")
    ckpt.restore(model, opt)
    g = torch.Generator().manual_seed(rank)
    for step in range(2):
        model(torch.randn(4, 5, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ckpt.save(step + 1)
    ckpt.close()


def _restore_grouped_otherwise(rank, world, root):
    from fusedist.checkpoint import CheckpointError, Checkpointer

    model, opt = _model_and_optimizer(split=False, seed=rank + 7)
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointError) as info:
            Checkpointer(root, run_id="groups").restore(model, opt)
    retried = [str(w.message) for w in caught if "trying the previous one" in str(w.message)]
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    fitting, fitting_opt = _model_and_optimizer(split=True, seed=rank + 7)
    restored = Checkpointer(root, run_id="groups").restore(fitting, fitting_opt)
    return str(info.value), retried, unchanged, restored


def test_an_optimizer_grouped_otherwise_is_refused_at_once_at_another_world_size(tmp_path):
    root = str(tmp_path / "ckpt")
    run_distributed(_train_and_save, 2, root, timeout=120)
    for message, retried, unchanged, restored in run_distributed(_restore_grouped_otherwise, 3, root, timeout=120):
        assert "param group sizes [4, 12] do not match the optimizer's [16]" in message
        assert "step 2" in message and "no older checkpoint is tried" in message and "step 1 " not in message
        assert retried == []
        assert unchanged
        assert restored == 2


class _Indices(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return i


@pytest.mark.parametrize("make", [lambda: torch.utils.data.DistributedSampler(_Indices(), num_replicas=1, rank=0),
                                  lambda: torch.utils.data.RandomSampler(_Indices())])
def test_a_sampler_that_cannot_save_its_position_is_refused_at_restore(tmp_path, make):
    from fusedist.checkpoint import Checkpointer, ElasticDistributedSampler

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    sampler = make()
    with pytest.raises(TypeError, match=f"the sampler, a {type(sampler).__name__}, has no state_dict.*"
                                        "ElasticDistributedSampler"):
        ckpt.restore(model, opt, sampler=sampler)
    elastic = ElasticDistributedSampler(_Indices(), num_replicas=1, rank=0)
    assert ckpt.restore(model, opt, sampler=elastic) == 0
    ckpt.save(1)
    ckpt.close()
