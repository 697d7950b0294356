"""A module wrapped in fusedist.DistributedDataParallel and then, the same module, in torch's
(Note [a torch DDP over a fusedist wrapper's module] in fusedist/reliability/optimizer_guard.py):
the step after a backward through torch's wrapper is refused naming torch's wrapper and what to
do, nothing changed; done as it says (the fusedist wrapper dropped), torch's wrapper trains
exactly as torch's DDP over a module fusedist never wrapped."""

from __future__ import annotations

import os

import pytest

from shared_rank_launch import results_of
from test_lightning_launch import register, shared_launch


def _torch_ddp_after_fusedist(rank, world, seed):
    import gc

    import torch
    from torch import nn

    import fusedist

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    reference = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)))
    reference.module.load_state_dict(model.state_dict())
    ours = fusedist.DistributedDataParallel(model)
    theirs = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(seed + 1 + rank)
    batches = [(torch.randn(6, 5, generator=generator), torch.randn(6, 3, generator=generator)) for _ in range(3)]
    before = [p.detach().clone() for p in model.parameters()]
    nn.functional.mse_loss(theirs(batches[0][0]), batches[0][1]).backward()
    try:
        opt.step()
        refusal = None
    except RuntimeError as error:
        refusal = str(error)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and not opt.state
    del ours  # what the refusal says to do
    gc.collect()
    opt.zero_grad()
    for x, y in batches:
        for net, optimizer in ((theirs, opt), (reference, reference_opt)):
            nn.functional.mse_loss(net(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    # (the same reducer over the same gradients in the same order: equal, not merely close)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.module.parameters()))
    return {"refusal": refusal, "unchanged": unchanged, "same": same}


def _jobs(tmp_path_factory):
    seed = int.from_bytes(os.urandom(2), "little")
    return {"test_a_step_after_torchs_ddp_wrapped_a_fusedist_wrappers_module_names_it":
            {"torch DDP after fusedist's": (_torch_ddp_after_fusedist, (seed,))}}


register(_jobs, seconds=120)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    return shared_launch(request, tmp_path_factory)


def test_a_step_after_torchs_ddp_wrapped_a_fusedist_wrappers_module_names_it(launched):
    for rank, out in enumerate(results_of(launched, "torch DDP after fusedist's")):
        refusal = out["refusal"]
        assert refusal is not None, "the step after a backward through torch's DDP alone was not refused"
        assert (f"fusedist (rank {rank}): AdamW.step() after a backward pass through torch's DistributedDataParallel, "
                "which wraps the Sequential module that fusedist.DistributedDataParallel wrapped before") in refusal, \
            refusal
        assert "drop every reference to the fusedist wrapper" in refusal, refusal
        assert out["unchanged"], "the refused step changed the parameters or the optimizer state"
        assert out["same"], "after the fusedist wrapper was dropped, torch's DDP trained otherwise than torch's DDP"
