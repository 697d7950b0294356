"""Fused optimizers against torch with eps, weight_decay, momentum and dampening given as
1-element tensors (Note [tensor hyperparameters] in fusedist/optim/_hyperparameters.py): the same steps,
a change made in place between steps seen by the next, the tensors kept in the state dict,
and a tensor of several elements refused naming it.

fp32 parameters of order 1, a few steps: both sides differ only by rounding of the optimizer
math, so 1e-6 absolute (as in test_optim.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from fusedist.optim import FusedAdam, FusedAdamW, FusedSGD

from test_optim import BACKENDS

ATOL = 1e-6
CASES = [
    (FusedAdamW, torch.optim.AdamW, lambda: dict(eps=torch.tensor(1e-3), weight_decay=torch.tensor(0.1)),
     "weight_decay"),
    (FusedAdam, torch.optim.Adam, lambda: dict(weight_decay=torch.tensor(0.05), eps=torch.tensor(1e-4)), "eps"),
    (FusedSGD, torch.optim.SGD, lambda: dict(momentum=torch.tensor(0.9), dampening=torch.tensor(0.2),
                                             weight_decay=torch.tensor(0.01)), "momentum"),
]
IDS = ["AdamW", "Adam", "SGD"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", request.param)
    return request.param


@pytest.mark.parametrize("fused_cls, torch_cls, hypers, changed", CASES, ids=IDS)
def test_tensor_hyperparameters_step_as_torch(backend, fused_cls, torch_cls, hypers, changed):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    start = [torch.randn(5, generator=gen), torch.randn(3, 4, generator=gen)]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    our_hypers, their_hypers = hypers(), hypers()
    opt = fused_cls(ours, lr=0.05, **our_hypers)
    ref = torch_cls(theirs, lr=0.05, **their_hypers)
    for step in range(4):
        if step == 2:  # a schedule changing the tensor in place: the next step uses the new value
            our_hypers[changed].mul_(0.5)
            their_hypers[changed].mul_(0.5)
        for a, b in zip(ours, theirs):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=ATOL, msg=lambda m: f"seed {seed}: {m}")
    group = opt.state_dict()["param_groups"][0]
    assert isinstance(group[changed], torch.Tensor) and group[changed].item() == their_hypers[changed].item()


def test_a_tensor_hyperparameter_of_several_elements_is_refused_naming_it():
    p = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match=r"FusedSGD \(param group 0\): a tensor weight_decay must be one real number"):
        FusedSGD([p], lr=0.1, weight_decay=torch.tensor([0.1, 0.2]))
