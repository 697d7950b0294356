"""fusedist.ZeroRedundancyOptimizer compares its param groups' hyperparameters across ranks
(Note [the same hyperparameters on every rank] in fusedist/zero/hyper_checks.py), world 2, one
launch of the ranks.

Each rank steps only its own slice of every parameter with its own copy of the param groups, so a
rank built (or given a group, or a state dict) with another lr / betas / eps / weight decay trained
its slices differently and nothing failed: the parameters became patchworks. Now construction,
``add_param_group`` and ``load_state_dict`` raise the same RankMismatchError on every rank, naming
the rank, the group and both values, and change nothing; the optimizer built (or the group added,
the dict loaded) right afterwards trains as torch's AdamW on the global batch. An LR schedule that
changes the rates at every step, alike on every rank, never trips the checks (an ExponentialLR through
an ``add_param_group`` and a ``load_state_dict`` mid-run). A state dict refused on one rank only
is refused on every rank (the others no longer wait in the comparison), and one refused on every
rank raises each rank's own error, as before.

Tolerance 1e-5 absolute: at most 8 AdamW steps (lr <= 0.02, eps 1e-3) on parameters of magnitude
~0.5 in fp32; the two sides differ only in gradient summation order and batching of elementwise
updates (measured <= 1e-7). A rank stepping its slices with another lr (0.01 vs 0.02) moves them
by ~1e-2 within one step.
"""

import copy

import pytest
import torch
from torch import nn

from models import max_param_diff, raised
from shared_rank_launch import launch_for_selected, results_of

TOL = 1e-5
WORLD = 2
SEED = 20261207


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 9)
        self.b = nn.Linear(9, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x):
        return self.c(self.b(torch.tanh(self.a(x))))


def _batch(seed, step, rank, world, n=3):
    g = torch.Generator().manual_seed(seed * 97 + step)
    x, y = torch.randn(world * n, 6, generator=g), torch.randn(world * n, 4, generator=g)
    return x, y, x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


@torch.no_grad()
def _groups(m, lr_b=0.02, betas=(0.9, 0.999)):
    return [{"params": [m.a.weight, m.a.bias]}, {"params": [m.b.weight, m.b.bias], "lr": lr_b, "betas": betas}]


def _constructed_differently(rank, world, seed, stage):
    """Rank 1 builds the optimizer with another lr in group 1, then with other betas; then every
    rank builds it alike and trains (ExponentialLR at every step, a group added and a state dict
    loaded mid-run) as torch's AdamW on the global batch."""
    import fusedist

    torch.manual_seed(seed)
    ref = Net()
    model = copy.deepcopy(ref)
    for m in (ref, model):
        m.c.requires_grad_(False)  # (trained from step 2 on, in a group added then)
    run = fusedist.DistributedDataParallel(model) if stage == 2 else model

    def build(**kw):
        return fusedist.ZeroRedundancyOptimizer(_groups(model, **kw), optimizer_class=torch.optim.AdamW,
                                               stage=stage, lr=0.01, eps=1e-3)

    errors = [raised(lambda: build(lr_b=0.02 if rank == 0 else 0.03)),
              raised(lambda: build(betas=(0.9, 0.999) if rank == 0 else (0.8, 0.999)))]
    zopt = build()
    ropt = torch.optim.AdamW(_groups(ref), lr=0.01, eps=1e-3)
    zsched = torch.optim.lr_scheduler.ExponentialLR(zopt, 0.8)
    rsched = torch.optim.lr_scheduler.ExponentialLR(ropt, 0.8)
    diffs = []
    for step in range(6):
        x, y, lx, ly = _batch(seed, step, rank, world)
        for m, o, xx, yy in ((ref, ropt, x, y), (run, zopt, lx, ly)):
            o.zero_grad()
            nn.functional.mse_loss(m(xx), yy).backward()
        if stage == 1:  # (without DDP the gradients come synchronized)
            for p in model.parameters():
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad)
                    p.grad /= world
        ropt.step()
        zopt.step()
        rsched.step()
        zsched.step()
        diffs.append(max_param_diff(ref, model))
        if step == 1:  # a group added while the schedule has changed the rates: compared, alike
            for m, o in ((ref, ropt), (model, zopt)):
                m.c.requires_grad_(True)
                o.add_param_group({"params": [m.c.weight, m.c.bias], "lr": 0.015})
        if step == 3:  # a state dict of the run itself loaded back: compared, alike
            zopt.consolidate_state_dict(to=0)
            box = [zopt.state_dict() if rank == 0 else None]
            torch.distributed.broadcast_object_list(box, 0)
            zopt.load_state_dict(box[0])
    return {"errors": errors, "diffs": diffs, "lrs": [g["lr"] for g in zopt.param_groups]}


def _added_differently(rank, world, seed):
    """Rank 1 adds the group with another weight decay: refused on every rank, nothing added; the
    group added alike afterwards trains as torch's."""
    import fusedist

    torch.manual_seed(seed)
    ref = Net()
    model = copy.deepcopy(ref)
    for m in (ref, model):
        m.c.requires_grad_(False)
    run = fusedist.DistributedDataParallel(model)
    zopt = fusedist.ZeroRedundancyOptimizer(_groups(model), optimizer_class=torch.optim.AdamW, stage=2,
                                           lr=0.01, eps=1e-3)
    ropt = torch.optim.AdamW(_groups(ref), lr=0.01, eps=1e-3)
    for m in (ref, model):
        m.c.requires_grad_(True)
    error = raised(lambda: zopt.add_param_group({"params": [model.c.weight, model.c.bias],
                                                 "weight_decay": 0.1 if rank == 0 else 0.2}))
    groups_after = len(zopt.param_groups)
    zopt.add_param_group({"params": [model.c.weight, model.c.bias], "weight_decay": 0.1})
    ropt.add_param_group({"params": [ref.c.weight, ref.c.bias], "weight_decay": 0.1})
    diffs = []
    for step in range(3):
        x, y, lx, ly = _batch(seed, step, rank, world)
        for m, o, xx, yy in ((ref, ropt, x, y), (run, zopt, lx, ly)):
            o.zero_grad()
            nn.functional.mse_loss(m(xx), yy).backward()
            o.step()
        diffs.append(max_param_diff(ref, model))
    return {"error": error, "groups_after": groups_after, "diffs": diffs}


def _loaded_differently(rank, world, seed):
    """A consolidated state dict whose eps rank 1 edited (each rank reading its own copy): refused
    on every rank, nothing loaded. Then a dict refused by rank 1 only (a parameter's state of
    another shape), then one refused by every rank; then the right dict loads and training goes on
    as torch's."""
    import fusedist

    torch.manual_seed(seed)
    ref = Net()
    model = copy.deepcopy(ref)
    run = fusedist.DistributedDataParallel(model)
    zopt = fusedist.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, stage=2,
                                           lr=0.01, eps=1e-3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=0.01, eps=1e-3)

    def train(steps):
        for step in steps:
            x, y, lx, ly = _batch(seed, step, rank, world)
            for m, o, xx, yy in ((ref, ropt, x, y), (run, zopt, lx, ly)):
                o.zero_grad()
                nn.functional.mse_loss(m(xx), yy).backward()
                o.step()

    train(range(2))
    saved = copy.deepcopy(ropt.state_dict())  # torch's state after two steps (the same on every rank)
    train(range(2, 3))
    before = [p.detach().clone() for p in model.parameters()]
    edited = copy.deepcopy(saved)
    edited["param_groups"][0]["eps"] = 1e-3 if rank == 0 else 1e-6
    errors = [raised(lambda: zopt.load_state_dict(edited))]
    broken = copy.deepcopy(saved)
    if rank == 1:
        broken["state"][0]["exp_avg"] = torch.zeros(3)
    errors.append(raised(lambda: zopt.load_state_dict(broken)))
    everywhere = copy.deepcopy(saved)
    everywhere["state"][0]["exp_avg"] = torch.zeros(3)
    errors.append(raised(lambda: zopt.load_state_dict(everywhere)))
    unchanged = max(float((p.detach() - q).abs().max()) for p, q in zip(model.parameters(), before))
    eps_after = zopt.param_groups[0]["eps"]
    zopt.load_state_dict(copy.deepcopy(saved))
    ropt.load_state_dict(copy.deepcopy(saved))
    ref.load_state_dict(model.state_dict())  # (the loaded dict carries no parameters: both go on from here)
    train(range(3, 6))
    return {"errors": errors, "unchanged": unchanged, "eps_after": eps_after, "diff": max_param_diff(ref, model)}


SCENARIOS = {
    "test_construction_with_other_hyperparameters_is_refused_and_schedules_do_not_trip": {
        f"constructed stage {stage}": (_constructed_differently, (SEED + stage, stage)) for stage in (1, 2)},
    "test_added_group_with_other_hyperparameters_is_refused": {"added": (_added_differently, (SEED + 3,))},
    "test_load_with_other_hyperparameters_or_refused_on_one_rank": {"loaded": (_loaded_differently, (SEED + 4,))},
}


@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, SCENARIOS, WORLD, timeout=240)


def _names_both(error, rank, what, mine, theirs):
    assert error.startswith("RankMismatchError"), f"rank {rank}: {error}"
    assert f"this is rank {rank}" in error, error
    assert f"ranks [0]: {what}={mine}" in error and f"ranks [1]: {what}={theirs}" in error, error


def test_construction_with_other_hyperparameters_is_refused_and_schedules_do_not_trip(launched):
    for stage in (1, 2):
        for rank, got in enumerate(results_of(launched, f"constructed stage {stage}")):
            lr, betas = got["errors"]
            _names_both(lr, rank, "param group 1: lr", "0.02", "0.03")
            _names_both(betas, rank, "param group 1: betas", "(0.9, 0.999)", "(0.8, 0.999)")
            assert max(got["diffs"]) <= TOL, f"stage {stage} rank {rank} seed {SEED + stage}: {got['diffs']}"
            assert len(got["lrs"]) == 3 and got["lrs"][0] == pytest.approx(0.01 * 0.8 ** 6), got["lrs"]


def test_added_group_with_other_hyperparameters_is_refused(launched):
    for rank, got in enumerate(results_of(launched, "added")):
        _names_both(got["error"], rank, "param group 2: weight_decay", "0.1", "0.2")
        assert "add_param_group" in got["error"] and "the group was not added" in got["error"], got["error"]
        assert got["groups_after"] == 2, "the refused group stayed in param_groups"
        assert max(got["diffs"]) <= TOL, f"rank {rank} seed {SEED + 3}: {got['diffs']}"


def test_load_with_other_hyperparameters_or_refused_on_one_rank(launched):
    for rank, got in enumerate(results_of(launched, "loaded")):
        other_eps, one_rank, every_rank = got["errors"]
        _names_both(other_eps, rank, "param group 0: eps", "0.001", "1e-06")
        assert "load_state_dict" in other_eps and "nothing was loaded" in other_eps, other_eps
        assert one_rank.startswith("RankMismatchError"), f"rank {rank}: {one_rank}"
        assert "ranks [1]: this rank's own refusal of the state dict (StateDictError" in one_rank, one_rank
        assert every_rank.startswith("StateDictError"), f"rank {rank}: {every_rank}"
        assert got["unchanged"] == 0.0 and got["eps_after"] == 1e-3, got
        assert got["diff"] <= TOL, f"rank {rank} seed {SEED + 4}: {got['diff']}"
