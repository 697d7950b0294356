"""copy.deepcopy of a fusedist.DistributedDataParallel model (Note [copies of the wrapper] in
fusedist/ddp/wrapper.py): torch.optim.swa_utils.AveragedModel(model) averages as with torch DDP,
a copy trains as a wrapper of its own with the original's options, a copy made on one rank only
issues no collective; a pickled model (``torch.save(model)``) loads into a model that trains as
torch DDP's loaded one, over the default group only, as torch's (Note [a pickled wrapper] in
fusedist/ddp/copies.py). Compared with torch DDP on 2 gloo ranks.
"""

from __future__ import annotations

import copy
import io
import os
import pickle

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from fusedist.testing import run_distributed


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


def _batches(rank, n):
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def _train(model, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _worker(rank, world):
    import fusedist

    out = {}
    for who, cls in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        model = cls(_net(), bucket_cap_mb=0.001, find_unused_parameters=True)
        averaged = AveragedModel(model)  # a deep copy of the wrapper
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in _batches(rank, 4):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            averaged.update_parameters(model)
        twin = copy.deepcopy(model)
        _train(twin, _batches(10 + rank, 3))  # the copy trains as a wrapper of its own
        out[who] = dict(
            averaged=[p.detach().clone() for p in averaged.module.parameters()],
            twin=[p.detach().clone() for p in twin.parameters()],
            shares=any(a.data_ptr() == b.data_ptr() for a, b in zip(twin.parameters(), model.parameters())),
            kind=type(averaged.module).__name__,
        )
    copied = copy.deepcopy(fusedist.DistributedDataParallel(_net(), bucket_cap_mb=0.001))
    out["options"] = (copied.config.bucket_cap_mb, copied.process_group is torch.distributed.group.WORLD)
    out["pickled"] = _pickled_models_train_as_torchs(rank)
    out["refused"] = _pickling_refused_as_torch_refuses_it()
    return out


def _saved_and_loaded(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _pickled_models_train_as_torchs(rank):
    """torch.save(model) after some steps, then the loaded model trains on (both ranks)."""
    import fusedist

    out = {}
    for who, cls in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        model = cls(_net(), bucket_cap_mb=0.001)
        _train(model, _batches(rank, 2))
        model.require_backward_grad_sync = False
        loaded = _saved_and_loaded(model)
        flags = (loaded.require_backward_grad_sync, loaded.training,
                 loaded.process_group is torch.distributed.group.WORLD,
                 all(p.grad is None for p in loaded.parameters()), type(loaded) is cls)
        loaded.require_backward_grad_sync = True
        x, y = _batches(20 + rank, 1)[0]
        nn.functional.mse_loss(loaded(x), y).backward()
        grads = [p.grad.clone() for p in loaded.parameters()]
        _train(loaded, _batches(30 + rank, 2))
        out[who] = dict(flags=flags, grads=grads, trained=[p.detach().clone() for p in loaded.parameters()],
                        shares=any(a.data_ptr() == b.data_ptr() for a, b in zip(loaded.parameters(),
                                                                                 model.parameters())))
    out["static graph"] = _pickled_static_graph_model_averages(rank)
    return out


def _pickled_static_graph_model_averages(rank):
    """A loaded ``static_graph=True`` model keeps the setting and averages its first backward's
    gradients. (torch 2.13's loaded one leaves that backward's gradients rank-local: its pickle
    keeps the flag saying the delayed all-reduce was queued. So the reference is the average of
    the plain module's gradients.)"""
    import fusedist

    model = fusedist.DistributedDataParallel(_net(), bucket_cap_mb=0.001, static_graph=True)
    _train(model, _batches(rank, 2))
    loaded = _saved_and_loaded(model)
    plain = copy.deepcopy(loaded.module)
    x, y = _batches(20 + rank, 1)[0]
    nn.functional.mse_loss(loaded(x), y).backward()
    nn.functional.mse_loss(plain(x), y).backward()
    average = torch.cat([p.grad.flatten() for p in plain.parameters()])
    torch.distributed.all_reduce(average)
    average /= 2
    got = torch.cat([p.grad.flatten() for p in loaded.parameters()])
    return loaded.static_graph, (got - average).abs().max().item()


def _pickling_refused_as_torch_refuses_it():
    """Over another group (torch refuses it too), over a destroyed group, and copy.copy."""
    import fusedist

    group = torch.distributed.new_group([0, 1])
    errors = {}
    for who, cls in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        model = cls(_net(), process_group=group)
        try:
            pickle.dumps(model)
        except RuntimeError as exc:
            errors[who] = str(exc)
    model = fusedist.DistributedDataParallel(_net())
    try:
        copy.copy(model)
    except TypeError as exc:
        errors["shallow"] = str(exc)
    model = fusedist.DistributedDataParallel(_net(), process_group=group)
    torch.distributed.destroy_process_group(group)
    try:
        pickle.dumps(model)
    except RuntimeError as exc:
        errors["destroyed"] = str(exc)
    return errors


@pytest.fixture(scope="module")
def copies_launched():
    """The copies' and the pickled models' scenarios share one launch of the ranks."""
    return run_distributed(_worker, 2, timeout=120)


def test_copies_average_and_train_as_torch_ddp_copies(copies_launched):
    """SGD, averages and BatchNorm in fp32 with the same reduction order: equal to 1e-6."""
    for out in copies_launched:
        ref, ours = out["torch"], out["fusedist"]
        for what in ("averaged", "twin"):
            diff = max((a - b).abs().max().item() for a, b in zip(ref[what], ours[what]))
            assert diff <= 1e-6, (what, diff)
        assert not ours["shares"] and ours["kind"] == "DistributedDataParallel"
        assert out["options"] == (0.001, True)



def test_a_pickled_model_loads_and_trains_as_torch_ddps_and_over_another_group_is_refused_as_torch_refuses(
        copies_launched):
    for out in copies_launched:
        ref, ours = out["pickled"]["torch"], out["pickled"]["fusedist"]
        # no_sync's flag and train mode kept; the default group; no gradients pickled
        assert ours["flags"] == ref["flags"] == (False, True, True, True, True)
        for what in ("grads", "trained"):
            diff = max((a - b).abs().max().item() for a, b in zip(ref[what], ours[what]))
            assert diff <= 1e-6, (what, diff)
        assert not ours["shares"]
        static_graph, diff = out["pickled"]["static graph"]
        assert static_graph and diff <= 1e-6, diff
        refused = out["refused"]
        assert "only supported when using DDP with the default process group" in refused["torch"]
        assert "other than the default one (ranks [0, 1])" in refused["fusedist"], refused["fusedist"]
        assert "save model.module" in refused["fusedist"]
        assert "its process group was destroyed" in refused["destroyed"]
        assert "copy.copy(model)" in refused["shallow"] and "copy.deepcopy(model)" in refused["shallow"]


def _one_rank_copy_worker(rank, world):
    import fusedist

    model = fusedist.DistributedDataParallel(_net())
    batches = _batches(rank, 3)
    _train(model, batches[:1])
    if rank == 0:
        # e.g. to save a snapshot: no collective may happen here. (A forward of the copy is a
        # DDP forward, which broadcasts buffers, as torch's copy's does.)
        snapshot = copy.deepcopy(model)
        torch.save(snapshot.module.state_dict(), os.devnull)
        _saved_and_loaded(model)  # (Note [a pickled wrapper]: no collective at saving nor at loading)
    _train(model, batches[1:])  # the ranks' collectives still pair
    return [p.detach().clone() for p in model.parameters()]


def test_a_copy_on_one_rank_issues_no_collective():
    r0, r1 = run_distributed(_one_rank_copy_worker, 2, timeout=60, env={"FUSEDIST_TIMEOUT_S": "10"})
    assert all(torch.equal(a, b) for a, b in zip(r0, r1))
