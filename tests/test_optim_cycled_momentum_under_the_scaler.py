"""LR schedulers that cycle the momentum (OneCycleLR, CyclicLR with ``cycle_momentum``) on the
fused optimizers, against torch's optimizers with the same schedulers, through a GradScaler
whose second step overflows (skipped on both sides), with the optimizer's state handed over to
torch's optimizer halfway and the schedule continued there.

The schedulers write the groups in place every step: FusedSGD's ``momentum``, FusedAdam's
``betas[0]`` (replacing a tensor beta1 by a float, leaving beta2 a tensor), and a tensor ``lr``
filled in place. Each is read when the step runs, as torch's optimizers read them. Scales are
powers of two, so both sides step the same unscaled gradients: parameters agree to fp32
rounding of the optimizer math (1e-6 after eight steps at lr <= 0.05).
"""

from __future__ import annotations

import pytest
import torch

from fusedist.amp import GradScaler
from fusedist.optim import FusedAdam, FusedSGD

STEPS, HANDOVER, OVERFLOW = 8, 4, 1


def _one_cycle(opt):
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS + 2)


def _cyclic(opt):
    return torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.001, max_lr=0.05, step_size_up=3)


def _params(seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).requires_grad_() for shape in [(7,), (3, 5)]]


def _train(opt, sched, params, scaler, seed: int, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(seed + 1 + step)
        opt.zero_grad()
        loss = sum((p * torch.randn(p.shape, generator=gen)).sum() for p in params)
        scaler.scale(loss).backward()
        if step == OVERFLOW:
            with torch.no_grad():
                params[1].grad.view(-1)[3] = float("inf")
        scaler.step(opt)
        scaler.update()
        sched.step()


def _torch_run(torch_cls, kw, make_sched, seed):
    params = _params(seed)
    opt = torch_cls(params, **kw())
    sched, scaler = make_sched(opt), torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    _train(opt, sched, params, scaler, seed, range(STEPS))
    return params, opt


def _fused_then_torch(fused_cls, torch_cls, kw, make_sched, seed):
    """The first steps with the fused optimizer, the rest with torch's, loaded from its state dict."""
    params = _params(seed)
    opt = fused_cls(params, **kw())
    sched, scaler = make_sched(opt), GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    _train(opt, sched, params, scaler, seed, range(HANDOVER))
    theirs = torch_cls(params, **kw())
    sched_state, sched = sched.state_dict(), make_sched(theirs)  # (built first: it writes the groups)
    theirs.load_state_dict(opt.state_dict())
    sched.load_state_dict(sched_state)
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.load_state_dict(scaler.state_dict())
    _train(theirs, sched, params, torch_scaler, seed, range(HANDOVER, STEPS))
    return params, opt


def _close(ours, theirs, what):
    for i, (a, b) in enumerate(zip(ours, theirs)):
        diff = (a.detach() - b.detach()).abs().max().item()
        assert diff <= 1e-6, f"{what}: parameter {i} is {diff:.3g} from torch's"


@pytest.mark.parametrize("fused_cls, torch_cls, kw, make_sched", [
    (FusedSGD, torch.optim.SGD, lambda: dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.01), _one_cycle),
    (FusedSGD, torch.optim.SGD, lambda: dict(lr=torch.tensor(0.01), momentum=0.9, dampening=0.2), _cyclic),
    (FusedAdam, torch.optim.Adam, lambda: dict(lr=torch.tensor(0.01), betas=(torch.tensor(0.9), torch.tensor(0.99)),
                                                 weight_decay=0.1, decoupled_weight_decay=True), _one_cycle),
    (FusedAdam, torch.optim.Adam, lambda: dict(lr=0.01, amsgrad=True, maximize=True), _cyclic),
], ids=["sgd-nesterov-onecycle", "sgd-tensor-lr-cyclic", "adam-tensor-betas-onecycle", "adam-amsgrad-cyclic"])
def test_cycled_momentum_matches_torch_through_skips_and_a_handover(fused_cls, torch_cls, kw, make_sched):
    seed = int(torch.randint(0, 2**31 - STEPS - 1, ()))
    theirs, _ = _torch_run(torch_cls, kw, make_sched, seed)
    ours, opt = _fused_then_torch(fused_cls, torch_cls, kw, make_sched, seed)
    _close(ours, theirs, f"{fused_cls.__name__} with {make_sched.__name__} (seed {seed})")
    # the schedule reached the fused optimizer's groups: momentum was cycled before the handover
    momentum = opt.param_groups[0]["betas"][0] if fused_cls is FusedAdam else opt.param_groups[0]["momentum"]
    assert float(momentum) != 0.9, f"the scheduler did not cycle the momentum (seed {seed})"
