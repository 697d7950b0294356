"""fully_shard against torch's FSDP2 (or the unsharded model) on gloo: what a dropped model
held leaves ``memory_stats()``, a parameter frozen after unsynchronized backwards keeps their
gradients, and a refused ``init_parameters`` leaves the model usable.

``set_requires_gradient_sync(False)`` keeps each unit's unsharded gradients in a flat
accumulator, HSDP's ``set_requires_all_reduce(False)`` keeps reduce-scattered partial sums, and
a backward that raised leaves its reductions listed until the next forward: all counted in the
process-wide ``scratch_bytes``. A model dropped while holding them frees them with it, so they
must leave the count (Note [held gradient buffers of a dropped model] in fusedist/fsdp/grads.py).
Byte counts are exact. The training comparisons gather the same values and reduce the same sums
as FSDP2 on gloo, so FP32_TOL leaves an ulp or two; the initialization is exact (the same RNG
draws written into the same places).
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

import fusedist
import models
from phased_launches import launch_phase
from shared_rank_launch import results_of

FP32_TOL = dict(rtol=2e-6, atol=2e-6)


def _shard(model, fully_shard, mesh):
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return {k: v.detach().clone() for k, v in
            get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()}


def _accumulate(model, x, y, hsdp: bool) -> None:
    """One unsynchronized backward (HSDP: reduce-scattered but not all-reduced)."""
    if hsdp:
        model.set_requires_all_reduce(False)
    else:
        model.set_requires_gradient_sync(False)
    F.mse_loss(model(x), y).backward()


def _dropped_worker(rank, world, mesh_shape):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    hsdp = len(mesh_shape) == 2
    names = ("dp_replicate", "dp_shard") if hsdp else ("dp",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    gen = torch.Generator().manual_seed(rank)
    x, y, x2, y2 = torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen), \
        torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)
    torch.manual_seed(0)
    base = models.BlockStack()
    # the accumulated step trains as FSDP2's
    stepped = {}
    for who, shard in (("fusedist", fusedist.fully_shard), ("torch", fully_shard)):
        m = _shard(copy.deepcopy(base), shard, mesh)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        _accumulate(m, x, y, hsdp)
        m.set_requires_gradient_sync(True)
        m.set_requires_all_reduce(True)
        F.mse_loss(m(x2), y2).backward()
        opt.step()
        stepped[who] = _full(m)
    for k, v in stepped["torch"].items():
        torch.testing.assert_close(stepped["fusedist"][k], v, **FP32_TOL, msg=f"{k} differs from FSDP2's")
    # a model dropped holding its accumulators (or partial sums) gives their bytes back
    before = _shard(copy.deepcopy(base), fusedist.fully_shard, mesh).memory_stats()["scratch_bytes"]
    m = _shard(copy.deepcopy(base), fusedist.fully_shard, mesh)
    _accumulate(m, x, y, hsdp)
    held = m.memory_stats()["scratch_bytes"] - before
    alive = weakref.ref(m)
    del m
    gc.collect()
    fresh = _shard(copy.deepcopy(base), fusedist.fully_shard, mesh)
    return held, alive() is None, fresh.memory_stats()["scratch_bytes"] - before


def test_dropped_model_with_no_sync_accumulators_leaves_scratch_bytes(at_2):
    for held, freed, left in results_of(at_2, "dropped"):
        assert held > 0 and freed
        assert left == 0, f"{left} scratch bytes of a dropped model still counted"


def test_dropped_hsdp_model_with_partial_sums_leaves_scratch_bytes(at_4):
    for held, freed, left in results_of(at_4, "dropped hsdp"):
        assert held > 0 and freed
        assert left == 0, f"{left} scratch bytes of a dropped model still counted"


def _reset(sub) -> None:
    if hasattr(sub, "reset_parameters"):
        sub.reset_parameters()


def _init_refused_worker(rank, world):
    from fusedist.fsdp import init_parameters

    with torch.device("meta"):
        model = models.BlockStack()
    _shard(model, fusedist.fully_shard, None)
    model.to_empty(device="cpu")
    pieces = list(model.parameters())
    before = model.memory_stats()["scratch_bytes"]
    layer = model.blocks[0].fc1

    def wrong_shape(sub):  # a replacement of another shape, refused with a ValueError
        if sub is layer:
            sub.weight = torch.nn.Parameter(torch.zeros(3, 3))
        else:
            _reset(sub)

    try:
        init_parameters(model, wrong_shape)
        refused = None
    except ValueError as e:
        refused = str(e)
    # the model holds its pieces again, nothing stays counted, and a second init is the unsharded one's
    same_pieces = [a is b for a, b in zip(model.parameters(), pieces)] == [True] * len(pieces)
    left = model.memory_stats()["scratch_bytes"] - before
    torch.manual_seed(1)
    init_parameters(model)
    ref = models.BlockStack()
    torch.manual_seed(1)
    ref.apply(_reset)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    return refused, same_pieces, left, _full(model), ref.state_dict(), model(x).detach(), ref(x).detach()


def test_init_parameters_refusal_leaves_the_model_usable(at_2):
    for refused, same_pieces, left, full, ref_full, out, ref_out in results_of(at_2, "init refused"):
        assert refused is not None and "has shape (3, 3)" in refused
        assert same_pieces, "the modules do not hold their sharded pieces after the refusal"
        assert left == 0, f"{left} scratch bytes of the refused initialization still counted"
        assert full.keys() == ref_full.keys()
        for k, v in ref_full.items():
            torch.testing.assert_close(full[k], v, rtol=0, atol=0, msg=f"{k} differs from the unsharded init")
        torch.testing.assert_close(out, ref_out, **FP32_TOL)


def _frozen_after_accumulating_worker(rank, world):
    from torch.distributed.fsdp import fully_shard

    gen = torch.Generator().manual_seed(rank)
    data = [(torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)) for _ in range(4)]
    torch.manual_seed(0)
    base = models.BlockStack()
    out = {}
    for who, shard in (("fusedist", fusedist.fully_shard), ("torch", fully_shard)):
        m = _shard(copy.deepcopy(base), shard, None)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for step in range(2):
            (x, y), (x2, y2) = data[2 * step], data[2 * step + 1]
            m.set_requires_gradient_sync(False)
            F.mse_loss(m(x), y).backward()
            m.set_requires_gradient_sync(True)
            if step == 1:  # frozen between the accumulated backward and the synchronized one
                m.blocks[0].fc1.weight.requires_grad_(False)
                m.inp.weight.requires_grad_(False)
            F.mse_loss(m(x2), y2).backward()
            has_grad = sorted(n for n, p in m.named_parameters() if p.grad is not None)
            opt.step()
            opt.zero_grad()
        out[who] = has_grad, _full(m)
    return out


def test_parameter_frozen_after_accumulating_keeps_its_gradients_as_fsdp2(at_2):
    for res in results_of(at_2, "frozen after accumulating"):
        (names, full), (ref_names, ref_full) = res["fusedist"], res["torch"]
        assert names == ref_names
        for k, v in ref_full.items():
            torch.testing.assert_close(full[k], v, **FP32_TOL, msg=f"{k} differs from FSDP2's")


class _Stop(torch.nn.Module):
    """Linear layers (one unit each); the backward raises once it reaches the output of layer 1."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x, stop: bool):
        for i, b in enumerate(self.blocks):
            x = b(x)
            if i == 1 and stop:
                x.register_hook(_boom)
        return x


def _boom(grad):
    raise RuntimeError("stop this backward")


def _aborted_then_dropped_worker(rank, world):
    from fusedist.fsdp.memory import COUNTERS

    torch.manual_seed(0)
    before = (COUNTERS.scratch, COUNTERS.gathered)
    m = _Stop()
    for b in m.blocks:
        fusedist.fully_shard(b)
    fusedist.fully_shard(m, reshard_after_forward=False)
    m(torch.randn(2, 8), False).sum().backward()
    try:  # the last unit's reduction is issued, then the backward raises
        m(torch.randn(2, 8), True).sum().backward()
        raised = False
    except RuntimeError:
        raised = True
    alive = weakref.ref(m)
    del m, b
    gc.collect()
    return raised, alive() is None, COUNTERS.scratch - before[0], COUNTERS.gathered - before[1]


def test_model_dropped_after_an_aborted_backward_leaves_memory_stats(at_2):
    for raised, freed, scratch, gathered in results_of(at_2, "aborted then dropped"):
        assert raised and freed
        assert (scratch, gathered) == (0, 0), f"a dropped model still counted: {scratch} scratch, {gathered} gathered"


# ------------------------------------------------------------------ the launches
def _after_collecting(rank, world, fn, *args):
    """``fn`` once the models an earlier scenario of the launch left in reference cycles are
    collected: the byte counters are process-wide, and such a model freed inside ``fn``'s own
    ``gc.collect()`` would move them between its before and after."""
    gc.collect()
    return fn(rank, world, *args)


@pytest.fixture(scope="module")
def at_2(request):
    return launch_phase(request, {
        "test_dropped_model_with_no_sync_accumulators_leaves_scratch_bytes": {
            "dropped": (_after_collecting, (_dropped_worker, (2,)))},
        "test_init_parameters_refusal_leaves_the_model_usable": {
            "init refused": (_after_collecting, (_init_refused_worker,))},
        "test_parameter_frozen_after_accumulating_keeps_its_gradients_as_fsdp2": {
            "frozen after accumulating": (_frozen_after_accumulating_worker, ())},
        "test_model_dropped_after_an_aborted_backward_leaves_memory_stats": {
            "aborted then dropped": (_after_collecting, (_aborted_then_dropped_worker,))},
    }, 2, timeout=240)


@pytest.fixture(scope="module")
def at_4(request):
    return launch_phase(request, {"test_dropped_hsdp_model_with_partial_sums_leaves_scratch_bytes": {
        "dropped hsdp": (_after_collecting, (_dropped_worker, (2, 2)))}}, 4, timeout=120)
