"""Resuming at another world size, more than once: ElasticDistributedSampler chains of world
sizes (to 1 rank and to more ranks than samples), a Checkpointer job of ZeRO-2 + FusedAdamW with
a GradScaler, a StepLR and the elastic sampler resized 2 -> 3 -> 2 in the middle of epochs
(compared with a one-process replay of the same global batches in torch), and a ZeRO checkpoint
of a model with fewer parameters than ranks: loaded at another world size, and refused whole
(nothing changed, on every rank) when one of its shard files is damaged.
"""

from __future__ import annotations

import collections
import itertools
import os
import random
import shutil

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from fusedist.checkpoint import ElasticDistributedSampler
from fusedist.testing import run_distributed

N = 23  # samples: divisible by none of the world sizes used


class _Indices(torch.utils.data.Dataset):
    def __init__(self, n: int = N):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


# ------------------------------------------------------------------ sampler resize chains
def _segment(state, n, world, steps, batch, drop_last):
    """Every rank of ``world`` resumes from ``state`` and trains ``steps`` batches (None: to
    the end of the pass); returns the indices trained and the saved position."""
    samplers = [ElasticDistributedSampler(_Indices(n), num_replicas=world, rank=r, shuffle=True, seed=11,
                                          drop_last=drop_last) for r in range(world)]
    for s in samplers:
        if state is not None:
            s.load_state_dict(state)
        s.set_epoch(state["epoch"] if state else 2)
    lengths = {len(s) for s in samplers}
    assert len(lengths) == 1
    iterators = [iter(s) for s in samplers]
    trained, done = [], 0
    while steps is None or done < steps:
        batches = [list(itertools.islice(it, batch)) for it in iterators]
        if not batches[0]:
            assert not any(batches)
            break
        assert len({len(b) for b in batches}) == 1
        for s, b in zip(samplers, batches):
            trained += b
            s.advance(len(b))
        done += 1
    if steps is None:
        assert len(trained) == lengths.pop() * world
    states = [s.state_dict() for s in samplers]
    assert all(s == states[0] for s in states)
    return trained, states[0]


@pytest.mark.parametrize("drop_last", [False, True])
def test_elastic_sampler_resized_several_times_in_one_epoch_trains_each_sample_once(drop_last):
    rnd = random.Random(1234 + drop_last)
    for _ in range(60):
        n = rnd.randint(1, 30)
        worlds = [rnd.randint(1, 6) for _ in range(rnd.randint(3, 4))]
        batch = rnd.randint(1, 3)
        state, trained = None, []
        for i, world in enumerate(worlds):
            last = i == len(worlds) - 1
            got, state = _segment(state, n, world, None if last else rnd.randint(0, 3), batch, drop_last)
            trained += got
        counts = collections.Counter(trained)
        what = dict(n=n, worlds=worlds, batch=batch)
        if drop_last:  # nothing twice; only the tail that no world size could split is left out
            assert max(counts.values(), default=1) == 1, what
            assert n - len(counts) < max(worlds), what
        else:  # everything once, plus the padding of the world size that reached the end
            assert set(counts) == set(range(n)), what
            assert len(trained) - n < max(worlds), what


# ---------------------------------------------- Checkpointer: ZeRO-2 resized 2 -> 3 -> 2
def _table():
    g = torch.Generator().manual_seed(9)
    return torch.randn(N, 4, generator=g), torch.randn(N, 2, generator=g)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _job_segment(rank, world, root, steps_to):
    import fusedist
    from fusedist.checkpoint import Checkpointer

    x_all, y_all = _table()
    model = fusedist.DistributedDataParallel(_model())
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), fusedist.optim.FusedAdamW, stage=2, lr=1e-2,
                                           weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    scaler = fusedist.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)
    sampler = ElasticDistributedSampler(_Indices(), shuffle=True, seed=3)
    loader = DataLoader(_Indices(), batch_size=2, sampler=sampler, generator=torch.Generator())
    ckpt = Checkpointer(root, keep=2, run_id="elastic-chain")
    start = ckpt.restore(model, opt, scaler, lr_scheduler=sched, sampler=sampler)
    batches, log = iter(loader), []
    for step in range(start, steps_to):
        try:
            idx = next(batches)
        except StopIteration:
            sampler.set_epoch(sampler.epoch + 1)
            batches = iter(loader)
            idx = next(batches)
        opt.zero_grad()
        loss = (model(x_all[idx]) - y_all[idx]).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        sampler.advance(len(idx))
        log.append((step, sampler.epoch, idx.tolist()))
        ckpt.save(step + 1)
    ckpt.close()
    return start, log, [p.detach().clone() for p in model.parameters()], scaler.state_dict()["scale"], \
        sched.state_dict()["_last_lr"]


def _replay(global_batches):
    """torch, one process: each step's loss is the mean of the ranks' batch means."""
    x_all, y_all = _table()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)
    for per_rank in global_batches:
        opt.zero_grad()
        loss = sum((model(x_all[i]) - y_all[i]).pow(2).mean() for i in per_rank) / len(per_rank)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    return list(model.parameters()), scaler.get_scale(), sched.get_last_lr()


def test_checkpointer_zero2_resized_twice_mid_epoch_matches_a_replay(tmp_path):
    root = str(tmp_path / "ckpt")
    global_batches, by_epoch, out = [], collections.defaultdict(list), None
    for world, upto, start in ((2, 3, 0), (3, 5, 3), (2, 9, 5)):  # 12 samples, then 18: epoch 0 ends at 3 ranks
        out = run_distributed(_job_segment, world, root, upto, timeout=120)
        assert [o[0] for o in out] == [start] * world
        for entries in zip(*(o[1] for o in out)):
            assert len({(e[0], e[1]) for e in entries}) == 1
            global_batches.append([e[2] for e in entries])
            for e in entries:
                by_epoch[e[1]] += e[2]
    assert len(global_batches) == 9
    epoch0 = collections.Counter(by_epoch[0])
    assert set(epoch0) == set(range(N)) and sum(epoch0.values()) - N < 3  # padding of the 3-rank remainder only
    assert max(collections.Counter(by_epoch[1]).values()) == 1
    params, scale, lr = _replay(global_batches)
    for ours, ref in zip(out[0][2], params):
        torch.testing.assert_close(ours, ref.detach(), rtol=1e-5, atol=1e-6)
    assert out[0][3] == scale and out[0][4] == pytest.approx(lr)


# ------------------------------- fewer parameters than ranks; a damaged shard of the set
def _tiny(seed):
    import fusedist

    torch.manual_seed(seed)
    model = fusedist.DistributedDataParallel(nn.Linear(2, 1))  # 3 elements over 4 ranks
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-2)
    return model, opt


def _tiny_steps(rank, world, model, opt, steps):
    rows = 12 // world
    for s in steps:
        g = torch.Generator().manual_seed(s)
        x, y = torch.randn(12, 2, generator=g), torch.randn(12, 1, generator=g)
        ((model(x[rank * rows:(rank + 1) * rows]) - y[rank * rows:(rank + 1) * rows]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _tiny_save(rank, world, directory):
    import fusedist.checkpoint as fc

    model, opt = _tiny(0)
    _tiny_steps(rank, world, model, opt, range(3))
    fc.save(directory, model, opt)


def _tiny_load(rank, world, directory, damaged):
    import fusedist.checkpoint as fc

    model, opt = _tiny(5)
    before = [p.detach().clone() for p in model.parameters()], opt.state_dict()
    with pytest.raises(fc.CheckpointError, match="rank-00003.pt is corrupt"):
        fc.load(damaged, model, opt)
    untouched = _same([p.detach() for p in model.parameters()], before[0]) and _same(opt.state_dict(), before[1])
    fc.load(directory, model, opt)
    _tiny_steps(rank, world, model, opt, range(3, 6))
    return untouched, [p.detach().clone() for p in model.parameters()]


def test_zero_checkpoint_of_fewer_parameters_than_ranks_reshards_and_a_damaged_shard_loads_nothing(tmp_path):
    good, damaged = str(tmp_path / "good"), str(tmp_path / "damaged")
    run_distributed(_tiny_save, 4, good, timeout=120)
    shutil.copytree(good, damaged)
    victim = os.path.join(damaged, "rank-00003.pt")  # a rank that held no parameter
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0x01
    with open(victim, "wb") as f:
        f.write(data)
    torch.manual_seed(0)
    ref = nn.Linear(2, 1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _tiny_steps(0, 1, ref, ref_opt, range(6))
    for untouched, params in run_distributed(_tiny_load, 3, good, damaged, timeout=120):
        assert untouched
        for ours, want in zip(params, ref.parameters()):
            torch.testing.assert_close(ours, want.detach(), rtol=1e-5, atol=1e-6)
