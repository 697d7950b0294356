"""The resumable samplers against torch's ``DistributedSampler``.

* ``DataLoader(batch_size=None, num_workers>0)`` calls ``iter(sampler)`` twice and drops the
  first iterator unused: that must not count as a pass, or a resume retrains the epoch's start.
* ``len(ResumableDistributedSampler)`` during the resumed pass is what that pass yields.
* Saving a resumed ``ResumableDistributedSampler`` pass that drew indices but never advanced
  warns, as documented for every pass.
"""

import random
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from fusedist.checkpoint import ElasticDistributedSampler
from fusedist.checkpoint.resume import ResumableDistributedSampler

SAMPLERS = (ElasticDistributedSampler, ResumableDistributedSampler)


def _case():
    rng = random.Random()
    n, world = rng.randint(9, 31), rng.randint(1, 3)
    return n, world, rng.randrange(world), rng.randrange(100), rng.randrange(1, 3)


def _resumed(cls, n, world, rank, seed, k, epoch=2):
    """A ``cls`` sampler of ``rank`` restored after every rank trained ``k`` samples of ``epoch``."""
    state = None
    for r in range(world):
        s = cls(range(n), world, r, True, seed)
        s.set_epoch(epoch)
        iter(s)
        s.advance(k)
        state = s.state_dict() if r == rank else state
    resumed = cls(range(n), world, rank, True, seed)
    resumed.load_state_dict(state)
    resumed.set_epoch(epoch)  # the usual loop: set_epoch of the restored epoch keeps the position
    return resumed


def _torch(n, world, rank, seed, epoch=2):
    ref = DistributedSampler(range(n), world, rank, True, seed)
    ref.set_epoch(epoch)
    return list(ref)


@pytest.mark.parametrize("cls", SAMPLERS)
def test_multiworker_loader_without_batching_resumes_where_it_stopped(cls):
    n, world, rank, seed, k = _case()
    sampler = _resumed(cls, n, world, rank, seed, k)
    ds = TensorDataset(torch.arange(n))
    loader = DataLoader(ds, batch_size=None, sampler=sampler, num_workers=1)
    assert [int(x[0]) for x in loader] == _torch(n, world, rank, seed)[k:]
    sampler.advance(len(sampler))
    assert [int(x[0]) for x in loader] == _torch(n, world, rank, seed)  # the next pass: the whole epoch


def test_len_of_a_resumed_pass_is_what_it_yields():
    n, world, rank, seed, k = _case()
    sampler = _resumed(ResumableDistributedSampler, n, world, rank, seed, k)
    elastic = _resumed(ElasticDistributedSampler, n, world, rank, seed, k)
    for s in (sampler, elastic):
        it = iter(s)
        first = next(it)
        assert len(s) == 1 + len(list(it)) == len(_torch(n, world, rank, seed)) - k, type(s).__name__
        assert first == _torch(n, world, rank, seed)[k]
    resumed = _resumed(ResumableDistributedSampler, n, world, rank, seed, k)
    loader = DataLoader(TensorDataset(torch.arange(n)), batch_size=2, sampler=resumed)
    batches = iter(loader)
    next(batches)
    assert len(loader) == 1 + len(list(batches))  # len(loader) inside the loop


@pytest.mark.parametrize("cls", SAMPLERS)
def test_resumed_pass_saved_without_advance_warns(cls):
    n, world, rank, seed, k = _case()
    sampler = _resumed(cls, n, world, rank, seed, k)
    next(iter(sampler))
    with pytest.warns(UserWarning, match="advance\\(\\) was never called"):
        state = sampler.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler.advance(1)
        assert cls(range(n), world, rank, True, seed).state_dict()  # a fresh one draws nothing: no warning
    assert state["epoch"] == 2
