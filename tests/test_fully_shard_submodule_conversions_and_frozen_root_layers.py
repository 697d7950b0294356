"""Two cases against the unsharded model (what torch's FSDP2 gives for both), 2 gloo ranks, fresh
random inputs (the seed is in every failure message), one launch of ranks for the file:

* a submodule converted on its own after ``fully_shard`` (``block.fc.double()``, a plain child
  holding pieces of its parent's unit): the conversion reaches forward, backward and the
  optimizer steps, also when the unit was still gathered (the root after a forward without
  gradients); one that leaves a unit's parameters in several dtypes is refused naming them,
  as FSDP2 refuses it;
* a frozen layer of the root after a block with its own trainable unit, the root's inputs
  needing no gradient: the root stays gathered until the frozen weight has given its input's
  gradient (it used to reshard once the head's gradients were in, and backward failed on the
  freed weight), also when frozen between a no-sync backward and the synchronized one.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Sequential(nn.Linear(6, 8), nn.Tanh()), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _train_converted(seed: int, gathered: bool) -> dict:
    """Train one step, convert every child of both units on its own (after a forward without
    gradients when ``gathered``), train two more; the largest difference per entry from the
    unsharded model converted with ``.double()``."""
    import fusedist

    ours, ref = _model(seed), _model(seed)
    fusedist.fully_shard(ours[0])
    fusedist.fully_shard(ours)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref)]
    gen = torch.Generator().manual_seed(seed + 1)
    for step in range(3):
        dtype = torch.float64 if step else torch.float32
        if step == 1:
            if gathered:
                with torch.no_grad():
                    ours(torch.randn(2, 6))
            for child in (ours[0][0], ours[1], ours[3]):
                child.double()
            ref.double()
        x = torch.randn(4, 6, generator=gen, dtype=dtype)
        for model, opt in zip((ours, ref), opts):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    full = fusedist.fsdp.full_state_dict(ours)
    return {k: (str(full[k].dtype), (full[k].double() - v).abs().max().item()) for k, v in ref.state_dict().items()}


def _partial_conversion_refused(seed: int) -> str:
    import fusedist

    model = _model(seed)
    fusedist.fully_shard(model)
    model[1].double()
    with pytest.raises(ValueError) as err:
        model(torch.randn(2, 6))
    return str(err.value)


def _train_frozen_middle(seed: int, freeze_midway: bool) -> dict:
    """The root holds a frozen layer between a trainable block (a unit of its own) and its
    trainable head; two steps of gradient accumulation (the first backward without sync);
    ``freeze_midway`` freezes it between the two backwards instead of before sharding. The
    largest difference per gradient from the unsharded model's."""
    import fusedist

    ours, ref = _model(seed), _model(seed)
    if not freeze_midway:
        ours[1].requires_grad_(False)
        ref[1].requires_grad_(False)
    fusedist.fully_shard(ours[0])
    fusedist.fully_shard(ours)
    gen = torch.Generator().manual_seed(seed + 2)
    for micro in range(2):
        x = torch.randn(4, 6, generator=gen)
        ours.set_requires_gradient_sync(micro == 1)
        for model in (ours, ref):
            if micro == 1 and freeze_midway:
                model[1].requires_grad_(False)
            model(x).square().mean().backward()
    pieces = {n: p for n, p in ours.named_parameters()}
    out = {}
    for name, p in ref.named_parameters():
        got = pieces[name].grad
        whole = p.grad.reshape(-1)[_element_range(ours, name)] if got is not None else None
        out[name] = None if got is None else (got.reshape(-1) - whole).abs().max().item() if got.numel() else 0.0
    return out


def _element_range(model, name: str) -> slice:
    from fusedist.fsdp.owners import owner_of

    unit, index = owner_of(dict(model.named_parameters())[name])
    return slice(*unit.element_range(index))


def _worker(rank: int, world: int, seed: int) -> dict:
    return {"sharded": _train_converted(seed, False), "gathered": _train_converted(seed, True),
            "refused": _partial_conversion_refused(seed),
            "frozen": _train_frozen_middle(seed, False), "frozen midway": _train_frozen_middle(seed, True)}


@pytest.fixture(scope="module")
def results():
    seed = random.randrange(2 ** 31)
    return seed, run_distributed(_worker, 2, seed, timeout=90)


def test_submodule_converted_on_its_own_trains_as_the_unsharded_model(results):
    seed, ranks = results
    for rank, got in enumerate(ranks):
        for case in ("sharded", "gathered"):
            for name, (dtype, diff) in got[case].items():
                assert dtype == "torch.float64", (seed, rank, case, name, dtype)
                assert diff <= 1e-12, (seed, rank, case, name, diff)
        message = got["refused"]
        assert "'1.weight' torch.float64" in message and "'0.0.weight' torch.float32" in message, (seed, message)


def test_frozen_layer_of_a_root_without_input_gradients_trains_as_the_unsharded_model(results):
    seed, ranks = results
    for rank, got in enumerate(ranks):
        for case in ("frozen", "frozen midway"):
            for name, diff in got[case].items():
                if case == "frozen" and name.startswith("1."):
                    assert diff is None, (seed, rank, case, name, diff)  # frozen throughout: no gradient
                else:
                    assert diff is not None and diff <= 1e-6, (seed, rank, case, name, diff)
