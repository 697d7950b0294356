"""fusedist.ZeroRedundancyOptimizer: what one rank alone refuses, or does, outside its argument
checks reaches every rank at once, world 2, one launch (Note [refusals of one rank's own
arguments] in fusedist/zero/param_checks.py; Note [parameters unfrozen on some ranks only] in
fusedist/zero/grow.py).

On rank 1 only: the parameters of two fusedist DDP models, a parameter its DDP model ignores, a
``process_group`` other than the model's, a ``load_state_dict`` pre-hook that raises, and (without
DDP) a parameter unfrozen after construction. Each was raised (or, for the unfrozen one, grown)
on rank 1 alone, and rank 0 waited in the next collective until the stall timeout
(``FUSEDIST_TIMEOUT_S``, 15 s here). Now both ranks raise the same RankMismatchError naming rank 1
and its reason, each timed well under the timeout. Built alike -- over a DDP model, and without one
with a layer unfrozen on every rank after the first step -- the optimizer trains as torch's AdamW
on the global batch.

Tolerance 1e-5 absolute: 3 AdamW steps (lr 0.01, eps 1e-3) in fp32 on parameters of magnitude
~0.5; the sharded step and torch's differ only in summation order (~1e-7).
"""

import copy

import torch
from torch import nn

import models
from shared_rank_launch import launch_for_selected, results_of

import pytest

TOL = 1e-5
WORLD = 2
SEED = 20261208
TIMEOUT_S = 15
PROMPT_S = TIMEOUT_S / 2  # each refusal well before the stall timeout a waiting rank would run into


def _net():
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _batch(world, seed, step):
    g = torch.Generator().manual_seed(seed * 31 + step)
    return torch.randn(world * 2, 5, generator=g), torch.randn(world * 2, 3, generator=g)


def _adamw(params, cls=None):
    import fusedist

    if cls is None:
        return fusedist.ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=0.01, eps=1e-3)
    return cls(params, lr=0.01, eps=1e-3)


def _max_diff(model, ref):
    return max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), ref.parameters()))


def _with_ddp(rank, world, seed):
    """Rank 1 alone: two models' parameters, an ignored parameter, another process group, a
    raising load pre-hook; then the optimizer built alike trains as torch's AdamW."""
    import torch.distributed as dist

    import fusedist

    torch.manual_seed(seed)
    ref = _net()
    model = fusedist.DistributedDataParallel(copy.deepcopy(ref))
    other = fusedist.DistributedDataParallel(nn.Linear(3, 2))
    with_ignored = nn.Linear(3, 2)
    fusedist.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(with_ignored, ["bias"])
    with_ignored = fusedist.DistributedDataParallel(with_ignored)
    alone = dist.new_group([0])  # (a collective: every rank creates it)
    one = rank == 1
    mine = list(model.parameters())
    errors = {
        "several": models.raised_timed(lambda: _adamw(mine + (list(other.parameters()) if one else []))),
        "ignored": models.raised_timed(lambda: _adamw(list(with_ignored.parameters()) if one
                                               else [with_ignored.module.weight])),
        "group": models.raised_timed(lambda: fusedist.ZeroRedundancyOptimizer(
            mine, torch.optim.AdamW, alone if one else None, lr=0.01, eps=1e-3)),
    }
    zopt = _adamw(mine)
    saved = _adamw(list(model.parameters()), torch.optim.AdamW).state_dict()  # (torch's format: loads on any rank)

    def refuse(optimizer, state_dict):
        raise ValueError("this rank's checkpoint is from another run")

    handle = zopt.register_load_state_dict_pre_hook(refuse) if one else None
    errors["load hook"] = models.raised_timed(lambda: zopt.load_state_dict(saved))
    if handle is not None:
        handle.remove()
    ropt = _adamw(ref.parameters(), torch.optim.AdamW)
    diffs = []
    for step in range(3):
        x, y = _batch(world, seed, step)
        ropt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ropt.step()
        zopt.zero_grad()
        nn.functional.mse_loss(model(x[2 * rank:2 * rank + 2]), y[2 * rank:2 * rank + 2]).backward()
        zopt.step()
        diffs.append(_max_diff(model.module, ref))
    return {"errors": errors, "diffs": diffs}


def _unfrozen_without_ddp(rank, world, seed):
    """No DDP: the head frozen at construction and unfrozen on rank 1 only is refused at the
    step; a fresh optimizer whose head is unfrozen on every rank after step 1 trains as torch's
    AdamW (which creates the head's state at its first gradient, as the joining head does)."""

    torch.manual_seed(seed)
    ref = _net()
    model = copy.deepcopy(ref)

    def backward(m, xx, yy):
        nn.functional.mse_loss(m(xx), yy).backward()

    x, y = _batch(world, seed, 0)
    model[2].requires_grad_(False)
    zopt = _adamw(list(model.parameters()))
    if rank == 1:
        model[2].requires_grad_(True)
    backward(model, x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
    errors = {"unfrozen": models.raised_timed(zopt.step)}

    model = copy.deepcopy(ref)
    for m in (model, ref):
        m[2].requires_grad_(False)
    zopt, ropt = _adamw(list(model.parameters())), _adamw(ref.parameters(), torch.optim.AdamW)
    diffs = []
    for step in range(3):
        if step == 1:
            for m in (model, ref):
                m[2].requires_grad_(True)
        x, y = _batch(world, seed, step)
        ropt.zero_grad()
        backward(ref, x, y)
        ropt.step()
        zopt.zero_grad()
        backward(model, x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
        for p in model.parameters():
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad)
                p.grad /= world
        zopt.step()
        diffs.append(_max_diff(model, ref))
    return {"errors": errors, "diffs": diffs}


SCENARIOS = {
    "test_wiring_and_load_refused_on_one_rank_fail_every_rank_at_once": {"ddp": (_with_ddp, (SEED,))},
    "test_parameter_unfrozen_on_one_rank_fails_every_rank_at_once": {"grow": (_unfrozen_without_ddp, (SEED + 1,))},
}


@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, SCENARIOS, WORLD, timeout=240, env={"FUSEDIST_TIMEOUT_S": str(TIMEOUT_S)})


REASONS = {
    "several": "the parameters belong to several fusedist DistributedDataParallel models",
    "ignored": "parameters ['bias'] are ignored by their DistributedDataParallel model",
    "group": "process_group is not the group of the parameters' DistributedDataParallel model)",
    "load hook": "this rank's own refusal of the state dict (ValueError: this rank's checkpoint is from another run)",
}


def _check_refused(per_rank, reasons):
    for rank, result in enumerate(per_rank):
        for name, (error, seconds) in result["errors"].items():
            assert seconds < PROMPT_S, (rank, name, seconds, error)
            assert error is not None and error.startswith("RankMismatchError"), (rank, name, error)
            assert f"this is rank {rank}" in error, error
            assert reasons[name] in error, (rank, name, error)
        assert max(result["diffs"]) < TOL, result["diffs"]


def test_wiring_and_load_refused_on_one_rank_fail_every_rank_at_once(launched):
    per_rank = results_of(launched, "ddp")
    own = "this rank's own refusal of its arguments (ValueError: ZeroRedundancyOptimizer: "
    _check_refused(per_rank, {k: "ranks [1]: " + ("" if k == "load hook" else own) + v for k, v in REASONS.items()})


def test_parameter_unfrozen_on_one_rank_fails_every_rank_at_once(launched):
    per_rank = results_of(launched, "grow")
    _check_refused(per_rank, {"unfrozen": "ranks [0]: <missing>; ranks [1]: parameter 2 (shape (3, 7)) trainable"})
