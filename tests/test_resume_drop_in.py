"""Exact and elastic resume used the way training scripts use torch's DistributedSampler.

* The samplers against ``torch.utils.data.DistributedSampler`` for every constructor form
  (shuffle, drop_last, seed, explicit num_replicas/rank, datasets smaller than or not
  divisible by the world size), ``set_epoch`` at every epoch, ``len``, a second ``iter()``
  without ``set_epoch``, and a DataLoader with batches and workers.
* A loop that never calls ``set_epoch``: each ``iter()`` is a new pass of the epoch order, as
  torch's; the position counts the current pass (Note [a pass of the sampler]). Counted
  across passes it could not be loaded, and the elastic sampler's later passes repeated the
  resumed remainder.
* The usual ``for epoch in range(start_epoch, E): sampler.set_epoch(epoch)`` loop after a
  restore continues mid-epoch (Note [set_epoch after a resume]).
* ``advance`` past the end of the pass refused, a pass that never advanced warned about.
* Elastic positions past the end of the epoch (padding) load at any world size, through any
  chain of resumes, every remaining sample exactly once.
* The Checkpointer's steps: no step count, or a step below the run's, refused (Note [steps
  only go forward]); a step saved twice; two Checkpointers in one program; an explicit step.
* Two spawned runs: a Checkpointer job whose loop never calls ``set_epoch`` resumes bit for
  bit at the same world size and re-splits the rest of the pass exactly once at 3 ranks,
  where ``load_per_rank`` is None and the RNG states stay as the script seeded them.
"""

from __future__ import annotations

import random
import shutil
import warnings
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from fusedist.checkpoint import Checkpointer, ElasticDistributedSampler, layout
from fusedist.checkpoint.resume import ResumableDistributedSampler
from fusedist.testing import run_distributed

SAMPLERS = (ElasticDistributedSampler, ResumableDistributedSampler)


def _run_loop(cls, n, world, rank, seed, steps, state=None, set_epoch=True, batch=4, **loader_kw):
    """A training loop's data side: ``steps`` batches, ``advance(len(batch))`` after each, a new
    ``iter(loader)`` at the end of a pass (with ``set_epoch`` or without). Returns the batches
    and the sampler's state at the end."""
    sampler = cls(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed)
    if state is not None:
        sampler.load_state_dict(state)
    loader = DataLoader(range(n), batch_size=batch, sampler=sampler, **loader_kw)
    batches, out = iter(loader), []
    for _ in range(steps):
        try:
            x = next(batches)
        except StopIteration:
            if set_epoch:
                sampler.set_epoch(sampler.epoch + 1)
            batches = iter(loader)
            x = next(batches)
        out.append(x.tolist())
        sampler.advance(len(x))
    return out, sampler.state_dict()


# ---------------------------------------------------------------- against torch's sampler
def test_samplers_yield_torchs_indices_for_every_constructor_form():
    seed = random.randrange(2**31)
    for cls in SAMPLERS:
        for n in (0, 1, 2, 3, 5, 7, 37):
            for world in (1, 2, 3, 5):
                for shuffle in (True, False):
                    for drop_last in (True, False):
                        for rank in range(world):
                            kw = dict(num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
                            ours, ref = cls(range(n), **kw), DistributedSampler(range(n), **kw)
                            got, want = [], []
                            for epoch in range(3):
                                ours.set_epoch(epoch)
                                ref.set_epoch(epoch)
                                got.append((list(ours), len(ours)))
                                want.append((list(ref), len(ref)))
                            got.append((list(ours), len(ours)))  # again, without set_epoch
                            want.append((list(ref), len(ref)))
                            assert got == want, (cls.__name__, n, kw)
        with pytest.raises(ValueError, match="Invalid rank 2"):
            cls(range(5), num_replicas=2, rank=2)


def test_samplers_in_a_dataloader_with_workers_match_torch():
    seed = random.randrange(2**31)
    loader_kw = dict(batch_size=3, num_workers=2, persistent_workers=True, prefetch_factor=3)
    for cls in SAMPLERS:
        ours = cls(range(23), num_replicas=3, rank=1, seed=seed)
        ref = DistributedSampler(range(23), num_replicas=3, rank=1, seed=seed)
        a, b = DataLoader(range(23), sampler=ours, **loader_kw), DataLoader(range(23), sampler=ref, **loader_kw)
        for epoch in (0, 1, 1):  # the last pass without set_epoch
            if epoch:
                ours.set_epoch(epoch)
                ref.set_epoch(epoch)
            got, want = [x.tolist() for x in a], [x.tolist() for x in b]
            assert got == want and len(a) == len(b) == 3, (cls.__name__, seed, epoch)


# ---------------------------------------------------------------- passes without set_epoch
@pytest.mark.parametrize("cls", SAMPLERS, ids=lambda c: c.__name__)
def test_a_loop_without_set_epoch_resumes_exactly_at_any_point(cls):
    """Dataset 37 at world 2: 19 per rank, 5 batches of 4 per pass; 22 steps cross four passes
    of epoch 0. A resume after any step continues the uninterrupted sequence."""
    seed = random.randrange(2**31)
    full, end = _run_loop(cls, 37, 2, 1, seed, 22, set_epoch=False)
    assert full[:5] == full[5:10] and end["epoch"] == 0, seed  # torch's behaviour: the same order again
    for k in (1, 4, 5, 6, 9, 10, 13, 21):
        first, state = _run_loop(cls, 37, 2, 1, seed, k, set_epoch=False)
        second, _ = _run_loop(cls, 37, 2, 1, seed, 22 - k, state=state, set_epoch=False)
        assert first + second == full, (cls.__name__, seed, k, state)
    # DataLoader workers (persistent), drop_last on the loader: passes end early, same rule.
    kw = dict(num_workers=1, persistent_workers=True, drop_last=True)
    full, _ = _run_loop(cls, 37, 2, 0, seed, 12, set_epoch=False, **kw)
    first, state = _run_loop(cls, 37, 2, 0, seed, 7, set_epoch=False, **kw)
    second, _ = _run_loop(cls, 37, 2, 0, seed, 5, state=state, set_epoch=False, **kw)
    assert first + second == full, (cls.__name__, seed, state)


@pytest.mark.parametrize("cls", SAMPLERS, ids=lambda c: c.__name__)
def test_the_usual_epoch_loop_resumes_mid_epoch(cls):
    """``for epoch in range(start_epoch, 3): sampler.set_epoch(epoch); for batch in loader``
    after ``load_state_dict``: set_epoch of the restored epoch restarted it from its
    beginning, training its first batches twice (Note [set_epoch after a resume])."""
    seed = random.randrange(2**31)

    def loop(sampler, first_epoch, stop_after=None):
        loader, out = DataLoader(range(29), batch_size=4, sampler=sampler), []
        for epoch in range(first_epoch, 3):
            sampler.set_epoch(epoch)
            for batch in loader:
                out.append(batch.tolist())
                sampler.advance(len(batch))
                if len(out) == stop_after:
                    return out, sampler.state_dict()
        return out, None

    full, _ = loop(cls(range(29), num_replicas=3, rank=2, seed=seed), 0)
    for k in (1, 3, 5, 6, 9):  # 3 batches an epoch; 3 and 6: saved at the end of an epoch
        first, state = loop(cls(range(29), num_replicas=3, rank=2, seed=seed), 0, stop_after=k)
        resumed = cls(range(29), num_replicas=3, rank=2, seed=seed)
        resumed.load_state_dict(state)
        second, _ = loop(resumed, state["epoch"])
        assert first + second == full, (cls.__name__, seed, k, state)
    # Another epoch after a restore, or the restored one once its pass began: from the start.
    other = cls(range(29), num_replicas=3, rank=2, seed=seed)
    other.load_state_dict(state)
    other.set_epoch(state["epoch"] + 1)
    again = cls(range(29), num_replicas=3, rank=2, seed=seed)
    again.load_state_dict(state)
    list(again)
    again.set_epoch(state["epoch"])
    for sampler, epoch in ((other, state["epoch"] + 1), (again, state["epoch"])):
        ref = DistributedSampler(range(29), num_replicas=3, rank=2, seed=seed)
        ref.set_epoch(epoch)
        assert list(sampler) == list(ref) and sampler.offset == 0, (cls.__name__, seed)


@pytest.mark.parametrize("cls", SAMPLERS, ids=lambda c: c.__name__)
def test_advance_past_the_pass_is_refused_and_a_pass_never_advanced_warns(cls):
    seed = random.randrange(2**31)
    sampler = cls(range(10), num_replicas=3, rank=0, seed=seed)  # 4 per rank, padded
    batches = list(DataLoader(range(10), batch_size=3, sampler=sampler))
    assert [len(b) for b in batches] == [3, 1]
    sampler.advance(3)
    with pytest.raises(ValueError, match=r"advance\(3\) after 3 would pass the end of this rank's share of "
                                         r"epoch 0, which ends at 4"):
        sampler.advance(3)  # advance(batch_size) for the shorter last batch
    sampler.advance(1)
    for bad in (-1, 1.0, True, "1"):
        with pytest.raises(ValueError, match="samples must be a non-negative int"):
            sampler.advance(bad)
    sampler.set_epoch(1)
    assert sampler.offset == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sampler.state_dict()  # nothing drawn yet: no warning
    list(sampler)
    with pytest.warns(UserWarning, match=r"4 indices of epoch 1 were drawn but advance\(\) was never called"):
        state = sampler.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sampler.state_dict() == state  # once per sampler


def test_states_of_another_sampler_kind_or_dataset_are_refused():
    elastic = ElasticDistributedSampler(range(10), num_replicas=2, rank=0, seed=1)
    resumable = ResumableDistributedSampler(range(10), num_replicas=2, rank=0, seed=1)
    with pytest.raises(ValueError, match=r"lacks \['offset'\].*an ElasticDistributedSampler's state\?"):
        resumable.load_state_dict(elastic.state_dict())
    with pytest.raises(ValueError, match=r"lacks \['consumed'\].*a ResumableDistributedSampler's state\?"):
        elastic.load_state_dict(resumable.state_dict())
    bigger = ResumableDistributedSampler(range(12), num_replicas=2, rank=0, seed=1)
    with pytest.raises(ValueError, match="saved dataset_len=10 differs from this sampler's 12"):
        bigger.load_state_dict(resumable.state_dict())
    dropping = ResumableDistributedSampler(range(10), num_replicas=2, rank=0, seed=1, drop_last=True)
    with pytest.raises(ValueError, match="saved drop_last=False differs"):
        dropping.load_state_dict(resumable.state_dict())
    old = {k: v for k, v in resumable.state_dict().items() if k not in ("drop_last", "dataset_len")}
    resumable.load_state_dict(old)  # a state of an earlier version still loads
    for bad in (-1, 2.5, None):
        with pytest.raises(ValueError, match="is not a number of samples"):
            elastic.load_state_dict(dict(elastic.state_dict(), consumed=bad))


# ---------------------------------------------------------------- elastic chains
def _elastic_chain(n, seed, shuffle, drop_last, worlds, takes):
    """``worlds[i]`` ranks take ``takes[i]`` samples each (None: the rest of the pass), save,
    and the next world size loads that state. Returns every sample trained and the last state."""
    seen, state = [], None
    for world, take in zip(worlds, takes):
        samplers = [ElasticDistributedSampler(range(n), num_replicas=world, rank=r, shuffle=shuffle, seed=seed,
                                              drop_last=drop_last) for r in range(world)]
        for s in samplers:
            if state is None:
                s.set_epoch(4)
            else:
                s.load_state_dict(state)
        share = len(samplers[0])
        take = share if take is None else min(take, share)
        for s in samplers:
            got = list(s)
            assert len(got) == share, (len(got), share)
            seen += got[:take]
            s.advance(take)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a take of 0 never advanced
            states = [s.state_dict() for s in samplers]
        assert all(st == states[0] for st in states)
        state = states[0]
    return seen, state


def test_elastic_positions_at_the_end_of_an_epoch_load_through_any_chain_of_world_sizes():
    """A position past the end of the permutation (padding, a world size's full shares) saved
    again at a smaller world size failed to load: "saved position 18 is outside the epoch of
    13 samples". Random chains of up to four world sizes: every sample of the epoch once (plus
    padding, less than the world sizes' sum), or, with drop_last, none twice."""
    rng = random.Random(random.randrange(2**31))
    fixed = [(13, [6, 4, 5], [3, 0, None]), (1, [6, 6, 3, 5], [1, 0, 0, None]), (37, [4, 4, 2], [10, 0, None])]
    cases = [(n, worlds, takes, shuffle, drop_last) for n, worlds, takes in fixed for shuffle in (True, False)
             for drop_last in (True, False)]
    for _ in range(300):
        hops = rng.randint(1, 4)
        cases.append((rng.choice([0, 1, 2, 5, 13, 37]), [rng.randint(1, 6) for _ in range(hops)],
                      [rng.randint(0, 9) for _ in range(hops - 1)] + [None], rng.random() < 0.5, rng.random() < 0.5))
    for n, worlds, takes, shuffle, drop_last in cases:
        seed = rng.randrange(2**31)
        case = (n, worlds, takes, shuffle, drop_last, seed)
        seen, state = _elastic_chain(n, seed, shuffle, drop_last, worlds, takes)
        counts = Counter(seen)
        if drop_last:
            assert max(counts.values(), default=1) == 1, case
        else:
            assert set(seen) == set(range(n)) and len(seen) - n < sum(worlds), case
        assert state["consumed"] <= n, case


# ---------------------------------------------------------------- the Checkpointer's steps
def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _train(model, opt, ckpt, steps):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    for step in steps:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        ckpt.maybe_save(step)


def test_checkpointer_steps_go_forward_and_bad_steps_are_refused(tmp_path):
    root = str(tmp_path / "a")
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(root, every_steps=2, keep=2)
    assert ckpt.restore(model, opt) == 0
    for bad in (-2, 2.0, "4", None, True):
        with pytest.raises(ValueError, match=r"step must be a non-negative int .*got " + repr(bad).replace(".", r"\.")):
            ckpt.save(bad)
        with pytest.raises(ValueError, match="step must be a non-negative int"):
            ckpt.maybe_save(bad)
    with pytest.raises(ValueError, match="every_steps must be a positive int"):
        Checkpointer(root, every_steps=True)
    _train(model, opt, ckpt, range(1, 9))
    ckpt.save(torch.tensor(8))  # a step saved twice (and given as a 0-d tensor) replaces it
    ckpt.wait()
    assert [e.step for e in layout.scan(root) if e.complete] == [8, 6]
    # A step counter reset (the step within the epoch): refused, the run's checkpoints untouched.
    with pytest.raises(ValueError, match=r"save\(3\): this run is at step 8 \(its last saved checkpoint\).*"
                                         r"restore\(\.\.\., step=3\) first"):
        ckpt.save(3)
    with pytest.raises(ValueError, match=r"maybe_save\(4\): this run is at step 8"):
        ckpt.maybe_save(4)
    ckpt.close()
    assert [e.step for e in layout.scan(root) if e.complete] == [8, 6]

    # A restart: an explicit older step is a rollback, and saves go on from it.
    again = Checkpointer(root, every_steps=2, keep=2)
    assert again.restore(_net()) == 8
    with pytest.raises(ValueError, match=r"save\(7\): this run is at step 8 \(its last restored checkpoint\)"):
        again.save(7)
    assert again.restore(_net(), step=6) == 6
    with pytest.warns(UserWarning, match=r"continues from step 6; .*set aside as \['abandoned-step-00000008'\]"):
        again.save(7)
        again.wait()
    again.close()
    assert [e.step for e in layout.scan(root) if e.complete] == [7, 6]


def test_two_checkpointers_in_one_program(tmp_path):
    """Every step into one root (keep 2), every third into another (all kept)."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    often = Checkpointer(str(tmp_path / "often"), every_steps=1, keep=2)
    rare = Checkpointer(str(tmp_path / "rare"), every_steps=3, keep=None, async_save=False)
    assert often.restore(model, opt) == 0 and rare.restore(model, opt) == 0
    x = torch.randn(3, 4)
    for step in range(1, 8):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        often.maybe_save(step)
        rare.maybe_save(step)
    often.close()
    rare.close()
    assert [e.step for e in layout.scan(str(tmp_path / "often"))] == [7, 6]
    assert [e.step for e in layout.scan(str(tmp_path / "rare"))] == [6, 3]
    fresh = _net()
    assert Checkpointer(str(tmp_path / "rare")).restore(fresh, step=3) == 3


# ---------------------------------------------------------------- spawned: the whole job
N, BATCH = 40, 3  # 20 samples per rank at world 2: 7 batches a pass, the last of 2


def _job(rank, world, root, stop):
    """A Checkpointer job (every 4 steps) whose loop never calls set_epoch, with dropout."""
    import fusedist
    from fusedist import checkpoint

    gen = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.arange(N), torch.randn(N, 4, generator=gen))
    sampler = ElasticDistributedSampler(data, shuffle=True, seed=11)
    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ckpt = Checkpointer(root, every_steps=4, keep=2)
    torch.manual_seed(100 + rank)  # a fresh start's dropout; a resume at world 2 restores the saved one
    start = ckpt.restore(model, opt, sampler=sampler)
    resplit = (sampler.consumed, len(sampler))
    per_rank = checkpoint.load_per_rank(layout.step_dir(root, start)) if start else None
    # At another world size the generators stay as seeded above: the first draw shows it.
    first_draw = torch.rand(1).item() if start and per_rank is None else None
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler, generator=torch.Generator())
    batches, seen = iter(loader), []
    for step in range(start, stop):
        try:
            idx, x = next(batches)
        except StopIteration:  # a new pass of the same epoch, as with torch's sampler
            batches = iter(loader)
            idx, x = next(batches)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        sampler.advance(len(idx))
        seen.append(idx.tolist())
        ckpt.maybe_save(step + 1)
    ckpt.close()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return start, seen, params, resplit, per_rank is not None, first_draw


def _jobs(rank, world, runs):
    """:func:`_job` for each ``(root, stop)`` of ``runs`` in turn, in the same processes (one
    launch: a shorter suite); each job seeds what it uses."""
    return [_job(rank, world, root, stop) for root, stop in runs]


def test_checkpointer_job_without_set_epoch_resumes_bitwise_and_resplits_at_3_ranks(tmp_path):
    """Steps 1-7 are the first pass, 8-14 the second. Killed after step 10 (checkpoints 4 and
    8): the resumed ranks continue from step 8 bit for bit. At 3 ranks, the rest of the second
    pass (34 samples, padded to 36) is split over them, each sample once."""
    runs = [(str(tmp_path / "full"), 16), (str(tmp_path / "ckpt"), 10)]
    full = [per_rank[0] for per_rank in run_distributed(_jobs, 2, runs, timeout=120)]
    shutil.copytree(tmp_path / "ckpt", tmp_path / "wide")  # steps 4 and 8, for the relaunch at 3 ranks
    resumed = run_distributed(_job, 2, str(tmp_path / "ckpt"), 16, timeout=120)
    for rank in range(2):
        start, seen, params, resplit, has_per_rank, _ = resumed[rank]
        assert start == 8 and has_per_rank and resplit == (2 * 3, 17), resumed[rank][3]
        assert seen == full[rank][1][8:], (rank, seen, full[rank][1])
        assert torch.equal(params, full[rank][2]), rank
    assert full[0][1][:7] == full[0][1][7:14]  # passes without set_epoch repeat the epoch order

    wider = run_distributed(_job, 3, str(tmp_path / "wide"), 12, timeout=120)
    second_pass = full[0][1][7] + full[1][1][7]  # step 8 at world 2, before the checkpoint
    rest = [i for rank in range(3) for batch in wider[rank][1] for i in batch]
    for rank in range(3):
        start, seen, _, resplit, has_per_rank, draw = wider[rank]
        assert start == 8 and resplit == (6, 12) and not has_per_rank, wider[rank][3:5]
        assert draw == torch.rand(1, generator=torch.Generator().manual_seed(100 + rank)).item(), rank
    assert sorted(set(second_pass + rest)) == list(range(N)) and len(second_pass + rest) == N + 2
