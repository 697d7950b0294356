"""ZeroRedundancyOptimizer under Join with a clip before each step, on ranks that run out early.

A rank with no batch at all (or whose last step clipped differently) must still take part in the
gradient-norm reductions of the ranks still training (Note [the announce] in fusedist/zero/join.py).
The oracle is torch's DDP with the unsharded torch optimizer and torch's clip under torch's Join.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shared_rank_launch import launch_for_selected, results_of

TOL = 2e-5


def _batches(seed, rank, count):
    g = torch.Generator().manual_seed(seed + 1000 * rank)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(count)]


def _clip_at(i):
    """The clip of step i: none at step 1, else a max_norm changing from step to step."""
    return None if i == 1 else 0.02 * (i + 1)


def _train(model, opt, batches, ctx, clip_fn):
    with ctx:
        for i, (x, y) in enumerate(batches):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if _clip_at(i) is not None:
                clip_fn(_clip_at(i))
            opt.step()


def _case(rank, seed, counts, stage, norm_type, opt_cls, kw, torch_clip=False):
    import fusedist
    from torch.distributed.algorithms import Join as TorchJoin

    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    batches = _batches(seed, rank, counts[rank])
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    opt_ref = opt_cls(ref.parameters(), **kw)
    _train(ref, opt_ref, batches, TorchJoin([ref]),
           lambda c: torch.nn.utils.clip_grad_norm_(ref.parameters(), c, norm_type))
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base))
    zero = fusedist.ZeroRedundancyOptimizer(ours.parameters(), opt_cls, stage=stage, **kw)
    clip = (lambda c: torch.nn.utils.clip_grad_norm_(ours.parameters(), c, norm_type)) if torch_clip else \
        (lambda c: zero.clip_grad_norm_(c, norm_type))
    _train(ours, zero, batches, fusedist.Join([ours, zero]), clip)
    ours.check_consistency()
    return max((a - b).abs().max().item() for a, b in zip(ref.module.parameters(), ours.module.parameters()))


def _worker(rank, world, seed, counts):
    sgd = (torch.optim.SGD, dict(lr=0.1, momentum=0.9))
    adamw = (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1))
    out = {}
    for stage, norm_type, (opt_cls, kw) in [(1, 2.0, sgd), (2, 2.0, adamw), (1, float("inf"), adamw),
                                            (2, float("inf"), sgd)]:
        out[f"stage {stage} norm {norm_type}"] = _case(rank, seed, counts, stage, norm_type, opt_cls, kw)
    return out


# Batches per rank, by world size: rank 0 has none at all.
COUNTS = {2: [0, 3], 3: [0, 1, 3]}


@pytest.mark.parametrize("world,counts", list(COUNTS.items()))
def test_clip_under_join_with_a_rank_without_batches_matches_torch(request, world, counts):
    launched = request.getfixturevalue({2: "two_ranks", 3: "three_ranks"}[world])
    seed = launched["seed"]
    for rank, out in enumerate(results_of(launched, "clip")):
        for key, value in out.items():
            assert value < TOL, f"rank {rank}, batches per rank {counts} (seed {seed}): {key}: max difference {value}"


def _torch_clip_worker(rank, world, seed, counts):
    sgd = (torch.optim.SGD, dict(lr=0.1, momentum=0.9))
    return {f"norm {n}": _case(rank, seed, counts, 1, n, *sgd, torch_clip=True) for n in (2.0, float("inf"))}


def test_stage1_torch_clip_of_grads_in_place_under_join_matches_torch(three_ranks):
    """Stage 1 steps with p.grad, which torch's clip_grad_norm_ on the model's parameters scales in
    place on the ranks still training: a joined rank's shard must be stepped with those gradients."""
    seed = three_ranks["seed"]
    for rank, out in enumerate(results_of(three_ranks, "torch clip")):
        for key, value in out.items():
            assert value < TOL, f"rank {rank} (seed {seed}): {key}: max difference {value}"


def _scaler_worker(rank, world, seed):
    """Stage 1 with an explicit ``unscale_`` (in place: no inverse scale left for the step), then a
    clip: docs/errors.md says a GradScaler under join is refused on every rank at the first step."""
    import fusedist

    out = {}
    for counts in ([1, 3], [0, 2]):
        torch.manual_seed(seed)
        model = fusedist.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
        zero = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, stage=1, lr=0.1)
        scaler = fusedist.amp.GradScaler("cpu")
        out[str(counts)] = None
        try:
            with fusedist.Join([model, zero]):
                for x, y in _batches(seed, rank, counts[rank]):
                    zero.zero_grad()
                    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
                    scaler.unscale_(zero)
                    zero.clip_grad_norm_(0.05)
                    scaler.step(zero)
                    scaler.update()
        except NotImplementedError as e:
            out[str(counts)] = str(e)
    return out


def test_grad_scaler_after_unscale_is_refused_under_join_on_every_rank(two_ranks):
    for rank, out in enumerate(results_of(two_ranks, "scaler")):
        for counts, refusal in out.items():
            assert refusal is not None and "a GradScaler is not supported yet" in refusal, \
                f"rank {rank}, batches per rank {counts}: trained on (the joined rank steps with scaled gradients)"


def _one_rank_clip_worker(rank, world, seed):
    """The optimizer's own clip_grad_norm_ after GradScaler.unscale_ (which reduced the norm already: the
    clip communicates nothing) on one rank only: that rank's shard steps clipped, the other's not, and the
    all-gathered parameters agree on every rank, so no digest tells (torch's ZeroRedundancyOptimizer does
    the same silently). Counted as torch's clip is (Note [a clip on some ranks only] in clip_check.py)."""
    import fusedist
    from fusedist._consistency import RankMismatchError

    def outcome(stage, clips):
        torch.manual_seed(seed)
        model = fusedist.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
        zero = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, stage=stage, lr=0.1)
        scaler = fusedist.amp.GradScaler("cpu")
        norms = []
        try:
            for i, (x, y) in enumerate(_batches(seed, rank, 4)):  # (far below the parameter check's period)
                zero.zero_grad()
                scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
                scaler.unscale_(zero)
                if i == 1 and clips:
                    norms.append(float(zero.clip_grad_norm_(0.01)))
                scaler.step(zero)
                scaler.update()
        except RankMismatchError as exc:
            return str(exc)
        return norms

    return {f"stage {stage} {case}": outcome(stage, clips)
            for stage in (1, 2) for case, clips in (("alike", True), ("one rank", rank == 1))}


def test_a_zero_clip_on_one_rank_only_is_named_at_the_next_check(two_ranks):
    results = results_of(two_ranks, "one rank clip")
    for rank, out in enumerate(results):
        for stage in (1, 2):
            alike = out[f"stage {stage} alike"]
            assert isinstance(alike, list) and len(alike) == 1, (stage, alike)
            assert alike == results[0][f"stage {stage} alike"], (stage, alike)  # (the norm of averaged gradients)
            text = out[f"stage {stage} one rank"]
            assert f"this is rank {rank}" in text and "synchronized backward #2" in text, (stage, text)
            assert "clips: ranks [0]: 0; ranks [1]: 1 -- clip_grad_norm_ was called on some ranks only" in text, \
                (stage, text)
            assert "params:" not in text and "optimizer_steps:" not in text, (stage, text)


# ----------------------------------------------------------------------------- one launch per world size
# The 2-rank work of the tests above runs in one launch of the ranks, the 3-rank work in another
# (each launch costs a process group and the imports of torch in every rank); fresh seeds per launch.
_ENV = {"FUSEDIST_TIMEOUT_S": "15"}


def _launch(request, world: int, by_test) -> dict:
    seed = int(torch.randint(0, 2**30, ()))
    scenarios = {test: {name: (fn, (seed, *args)) for name, (fn, args) in jobs.items()}
                 for test, jobs in by_test.items()}
    return dict(launch_for_selected(request, scenarios, world=world, timeout=300, env=_ENV), seed=seed)


@pytest.fixture(scope="module")
def two_ranks(request):
    return _launch(request, 2, {
        "test_clip_under_join_with_a_rank_without_batches_matches_torch": {"clip": (_worker, (COUNTS[2],))},
        "test_grad_scaler_after_unscale_is_refused_under_join_on_every_rank": {"scaler": (_scaler_worker, ())},
        "test_a_zero_clip_on_one_rank_only_is_named_at_the_next_check": {"one rank clip": (_one_rank_clip_worker, ())},
    })


@pytest.fixture(scope="module")
def three_ranks(request):
    return _launch(request, 3, {
        "test_clip_under_join_with_a_rank_without_batches_matches_torch": {"clip": (_worker, (COUNTS[3],))},
        "test_stage1_torch_clip_of_grads_in_place_under_join_matches_torch": {
            "torch clip": (_torch_clip_worker, (COUNTS[3],))},
    })
