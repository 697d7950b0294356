"""Fused optimizers against torch: hyperparameters that are not numbers.

torch's Adam, AdamW and SGD refuse a string hyperparameter (``lr: 1e-3`` read from a YAML file
is the string "1e-3") with a TypeError when the optimizer is built. The fused optimizers read
their values with ``float()``, which parses strings: the string was kept, and the first step
failed with an unrelated TypeError on the CPU paths, or stepped with the parsed number on the
Triton path. Numbers of the other kinds torch takes (int, bool, numpy scalars and 0-d arrays) stay
accepted and step as torch's do.

Inputs are fresh random values per run; the seed (from random.randrange) is in every failure
message.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fusedist.optim import FusedAdam, FusedAdamW, FusedLAMB, FusedSGD

from test_optim import BACKENDS, DEVICE  # noqa: F401 - the backend fixture's parameters

PAIRS = [(FusedAdam, torch.optim.Adam), (FusedAdamW, torch.optim.AdamW), (FusedSGD, torch.optim.SGD)]
PAIR_IDS = ["Adam", "AdamW", "SGD"]
ATOL = 1e-6  # fp32 parameters of order 1, three steps


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", request.param)
    return request.param


def _params(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(DEVICE)) for s in [(5,), (3, 4)]]


def _string_cases(fused_cls) -> list:
    cases = [dict(lr="1e-3")]
    if fused_cls is FusedSGD:
        cases += [dict(momentum="0.9")]
    elif fused_cls is FusedLAMB:
        cases += [dict(betas=("0.9", "0.999")), dict(max_grad_norm="1.0")]
    else:
        cases += [dict(betas=("0.9", "0.999")), dict(eps="1e-8")]
    return cases


@pytest.mark.parametrize("fused_cls,torch_cls", PAIRS + [(FusedLAMB, None)], ids=PAIR_IDS + ["LAMB"])
def test_string_hyperparameter_refused_when_built_as_torch(fused_cls, torch_cls):
    for kw in _string_cases(fused_cls):
        if torch_cls is not None:
            with pytest.raises(TypeError):
                torch_cls(_params(0), **kw)
        name = next(iter(kw))
        with pytest.raises(TypeError, match=f"{name} must be a number"):
            fused_cls(_params(0), **kw)


@pytest.mark.parametrize("fused_cls", [FusedAdam, FusedAdamW, FusedSGD, FusedLAMB],
                         ids=["Adam", "AdamW", "SGD", "LAMB"])
def test_string_lr_put_in_a_group_refused_by_step_before_any_write(backend, fused_cls):
    seed = random.randrange(2**31)
    params = _params(seed)
    opt = fused_cls(params, lr=0.1)
    for p in params:
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in params]
    opt.param_groups[0]["lr"] = "0.1"
    with pytest.raises(TypeError, match="lr must be a number"):
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b), f"seed {seed}: a parameter was written by a refused step"
    assert not opt.state, f"seed {seed}: states were made by a refused step"


@pytest.mark.parametrize("fused_cls,torch_cls", PAIRS, ids=PAIR_IDS)
@pytest.mark.parametrize("lr", [np.float64(0.05), np.array(0.05), 1, True], ids=["numpy", "numpy-0d", "int", "bool"])
def test_real_numbers_of_other_types_still_step_as_torch(backend, fused_cls, torch_cls, lr):
    seed = random.randrange(2**31)
    kw = dict(lr=lr, weight_decay=0.01) if fused_cls is not FusedSGD else dict(lr=lr, momentum=0.9)
    fused_params, torch_params = _params(seed), _params(seed)
    fused, ref = fused_cls(fused_params, **kw), torch_cls(torch_params, **kw)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(3):
        for a, b in zip(fused_params, torch_params):
            grad = torch.randn(a.shape, generator=g).to(DEVICE)
            a.grad, b.grad = grad.clone(), grad.clone()
        fused.step()
        ref.step()
    for a, b in zip(fused_params, torch_params):
        torch.testing.assert_close(a.detach(), b.detach(), atol=ATOL, rtol=0, msg=lambda m: f"seed {seed}: {m}")
