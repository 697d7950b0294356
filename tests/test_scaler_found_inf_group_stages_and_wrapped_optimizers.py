"""GradScaler: pipeline stages spread unevenly over ranks, a stage without a loss, wrapped optimizers.

* ``found_inf_group`` with ranks holding different numbers of stages (rank 0 stages 0 and 2,
  rank 1 stage 1): one agreement per iteration, so no rank waits for a collective another never
  makes, and an inf in stage 2 skips every stage, as torch's scaler on one optimizer over the
  whole model does (Note [found_inf over the pipeline stages] in fusedist/amp/found_inf_group.py).
  Rank 1 never calls ``scale(loss)`` (a middle stage: its gradients arrive scaled); its scale is
  made on first use (Note [a stage without a loss]).
* An optimizer wrapped by a ``__getattr__``-forwarding wrapper (Lightning, Fabric, accelerate):
  the scaler's ``found_inf`` and ``grad_scale`` reach the fused optimizer (Note [the protocol's
  owner behind a wrapper] in fusedist/optim/_scaler_protocol.py); they landed on the wrapper,
  and an overflowing step made the weights nan.
Tolerance: fp32 SGD steps in another summation order, 1e-6.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fusedist
from fusedist.amp import GradScaler
from fusedist.testing import run_distributed

WIDTH = 6
STAGES_OF = {0: (0, 2), 1: (1,)}


def _stage(seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(WIDTH, WIDTH)


def _uneven_stages_worker(rank, world_size, seed):
    """Three stages on two ranks (a fused and a torch optimizer on rank 0), an inf in stage 2's
    loss at steps 1 and 3, unscale_ at steps 0 and 3: the weights' largest difference from torch's
    scaler and one SGD over the whole model, the scales of both, and the error (if any) of a first
    iteration that steps two optimizers without unscale_ (rank 0)."""
    stages = STAGES_OF[rank]
    models = {s: _stage(seed + s) for s in stages}
    opts = {s: (fusedist.optim.FusedSGD if s == 0 else torch.optim.SGD)(models[s].parameters(), lr=0.1)
            for s in stages}
    refs = [_stage(seed + s) for s in range(3)]
    ref_opt = torch.optim.SGD([p for r in refs for p in r.parameters()], lr=0.1)
    scaler = GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1, found_inf_group=dist.group.WORLD)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1)
    g = torch.Generator().manual_seed(seed)
    scales = []
    for step in range(4):
        xs = [torch.randn(3, WIDTH, generator=g) for _ in range(3)]
        blowup = [float("inf") if step % 2 and s == 2 else 1.0 for s in range(3)]
        loss = sum(models[s](xs[s]).square().mean() * blowup[s] for s in stages)
        if rank == 0:
            scaler.scale(loss).backward()
        else:  # a middle stage: the gradient it receives is already scaled
            (loss * scaler.get_scale()).backward()
        ref_scaler.scale(sum(r(x).square().mean() * b for r, x, b in zip(refs, xs, blowup))).backward()
        if step in (0, 3):
            for s in stages:
                scaler.unscale_(opts[s])
            ref_scaler.unscale_(ref_opt)
        for s in stages:
            scaler.step(opts[s])
        ref_scaler.step(ref_opt)
        scaler.update()
        ref_scaler.update()
        scales.append((scaler.get_scale(), ref_scaler.get_scale()))
        for opt in [*opts.values(), ref_opt]:
            opt.zero_grad()
    weights = max(float((p - q).abs().max()) for s in stages
                  for p, q in zip(models[s].parameters(), refs[s].parameters()))
    late = None
    fresh = GradScaler("cpu", init_scale=2.0 ** 8, found_inf_group=dist.group.WORLD)
    for s in stages:
        fresh.scale(models[s](xs[s]).sum()).backward()
    try:
        for s in stages:
            fresh.step(opts[s])
        fresh.update()
    except RuntimeError as e:
        late = str(e)
    return weights, scales, late


def test_found_inf_group_with_uneven_stages_and_a_stage_without_a_loss():
    """Before: one all-reduce per optimizer, paired by position, so the rank with two stages
    waited for a collective the other never made (and a middle stage without scale(loss)
    failed with torch's "_scale is None")."""
    seed = int(torch.randint(0, 10_000, ()).item())
    results = run_distributed(_uneven_stages_worker, 2, seed, timeout=60)
    for rank, (weights, scales, late) in enumerate(results):
        assert weights < 1e-6, (seed, rank, weights)
        assert all(ours == theirs for ours, theirs in scales), (seed, rank, scales)
        assert [s for s, _ in scales] == [512.0, 256.0, 512.0, 256.0], (seed, rank, scales)
    # A first iteration stepping two optimizers without unscale_ waits for update() (Note [the
    # first iteration's steps wait for update()]): no error.
    assert all(late is None for _, _, late in results), results


class _Forwarding:
    """accelerate-style: holds the optimizer and forwards what it lacks."""

    def __init__(self, optimizer):
        self._optimizer = optimizer

    def __getattr__(self, name):
        return getattr(self._optimizer, name)

    def step(self, closure=None):
        return self._optimizer.step(closure)


class _Imitating(_Forwarding):
    """Lightning/Fabric-style: also subclasses the wrapped optimizer's class."""

    def __init__(self, optimizer):
        super().__init__(optimizer)
        self.__class__ = type("Wrapped" + type(optimizer).__name__, (_Imitating, type(optimizer)), {})


@pytest.mark.parametrize("wrapper", [_Forwarding, _Imitating])
def test_wrapped_fused_optimizer_gets_the_scalers_decision(wrapper):
    """A wrapped FusedSGD/FusedAdamW beside torch's optimizer and scaler, with and without
    unscale_, an inf at step 1: same weights (before: nan from the first overflow)."""
    seed = int(torch.randint(0, 10_000, ()).item())
    for cls, ref_cls in ((fusedist.optim.FusedSGD, torch.optim.SGD), (fusedist.optim.FusedAdamW, torch.optim.AdamW)):
        for use_unscale in (False, True):
            model, ref = _stage(seed), _stage(seed)
            opt, ref_opt = wrapper(cls(model.parameters(), lr=0.01)), ref_cls(ref.parameters(), lr=0.01)
            scaler, ref_scaler = GradScaler("cpu", init_scale=4.0), torch.amp.GradScaler("cpu", init_scale=4.0)
            g = torch.Generator().manual_seed(seed)
            for step in range(3):
                x, blowup = torch.randn(2, WIDTH, generator=g), float("inf") if step == 1 else 1.0
                scaler.scale(model(x).square().sum() * blowup).backward()
                ref_scaler.scale(ref(x).square().sum() * blowup).backward()
                if use_unscale:
                    scaler.unscale_(opt)
                    ref_scaler.unscale_(ref_opt)
                scaler.step(opt)
                ref_scaler.step(ref_opt)
                scaler.update()
                ref_scaler.update()
                opt.zero_grad()
                ref_opt.zero_grad()
            diff = max(float((p - q).detach().abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
            assert diff < 1e-6, (seed, cls.__name__, use_unscale, diff)
            assert scaler.get_scale() == ref_scaler.get_scale()
