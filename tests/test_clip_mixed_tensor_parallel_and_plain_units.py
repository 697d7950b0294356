"""The clip over a tensor-parallel model one of whose ``fully_shard`` units holds no
tensor-parallel parameter (a plain head left out of the plan, sharded on ``mesh["dp"]`` beside
the tensor-parallel units): one global norm over both, the plain unit's pieces counted once over
the tensor-parallel ranks (Note [plain units beside tensor-parallel ones] in
fusedist/fsdp/holder.py).

torch's FSDP2 cannot clip this model (DTensors on a 2-D and a 1-D mesh do not stack), so the
reference is the unsharded model on the global batch: its ``torch.nn.utils.clip_grad_norm_`` norm
and the SGD step on its clipped gradients. One 4-rank launch on a (dp=2, tp=2) gloo mesh; every
scenario is a fresh model on fresh random data.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shared_rank_launch import launch_for_selected, results_of

IN, HID, OUT = 6, 8, 5
MAX_NORM = 0.05  # below every norm these models have: the clip scales


def _net():
    return nn.Sequential(nn.Linear(IN, HID), nn.ReLU(), nn.Linear(HID, IN), nn.Linear(IN, OUT))


def _batch(seed: int, dp_rank: int):
    g = torch.Generator().manual_seed(seed * 10 + dp_rank)
    return torch.randn(3, IN, generator=g), torch.randn(3, OUT, generator=g)


def _build(mesh, seed: int):
    """m[0] ColwiseParallel, m[2] RowwiseParallel (Replicate() bias), m[3] a plain Linear out of
    the plan with its own fully_shard unit on the data-parallel mesh; the root unit takes the rest."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fusedist

    torch.manual_seed(seed)
    model = _net()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fusedist.fully_shard(model[3], mesh=mesh["dp"])
    fusedist.fully_shard(model, mesh=mesh["dp"])
    return model


def _reference(seed: int, dp_world: int, norm_type: float):
    """The unsharded model's clip norm and its parameters after one clipped SGD step on the
    global batch (the mean of the data-parallel ranks' losses, as fully_shard averages)."""
    torch.manual_seed(seed)
    model = _net()
    loss = sum(nn.functional.mse_loss(model(x), y) for x, y in map(lambda r: _batch(seed, r), range(dp_world)))
    (loss / dp_world).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    return float(norm), model.state_dict()


def _clip_and_step(rank, world, seed, how, norm_type):
    """This rank's clip norm and the step's largest distance from the reference's parameters."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _build(mesh, seed)
    x, y = _batch(seed, mesh["dp"].get_local_rank())
    nn.functional.mse_loss(model(x), y).backward()
    params = list(model.parameters())
    if how == "torch":
        norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM, norm_type)
    elif how == "fusedist":
        norm = fusedist.clip_grad_norm_(params, MAX_NORM, norm_type)
    else:  # torchtitan's two calls
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
        torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, norm)
    torch.optim.SGD(params, lr=1.0).step()
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    ref_norm, ref_state = _reference(seed, 2, norm_type)
    diff = max(float((whole[k] - ref_state[k]).abs().max()) for k in ref_state)
    return float(norm), ref_norm, diff


def _refusal(rank, world, seed):
    """A plain parameter listed with the units' pieces: the refusal names the units on each side."""
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _build(mesh, seed)
    x, y = _batch(seed, mesh["dp"].get_local_rank())
    extra = nn.Parameter(torch.randn(3))
    (nn.functional.mse_loss(model(x), y) + extra.sum()).backward()
    out = {}
    for name, clip in (("torch", torch.nn.utils.clip_grad_norm_), ("fusedist", fusedist.clip_grad_norm_)):
        try:
            clip([*model.parameters(), extra], MAX_NORM)
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    return out


_SCENARIOS = {
    "test_clip_over_tensor_parallel_and_plain_units_matches_the_unsharded_model": {
        f"{how} {norm_type}": (_clip_and_step, (seed, how, norm_type))
        for seed, (how, norm_type) in enumerate(
            [("torch", 2.0), ("fusedist", 2.0), ("two calls", 2.0), ("torch", float("inf")), ("torch", 1.0),
             ("fusedist", 0.0)], start=int(torch.randint(1, 10_000, ()).item()))
    },
    "test_refusal_names_the_units_on_each_side": {"refusal": (_refusal, (7,))},
}


@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, _SCENARIOS, 4, timeout=240)


def test_clip_over_tensor_parallel_and_plain_units_matches_the_unsharded_model(launched):
    """Norm as the unsharded model's (fp32, summed in another order over the groups: 1e-6
    relative), the same bits on every rank (one coefficient: the plain unit's copies stay
    identical across tensor-parallel ranks), and the clipped SGD step as the unsharded one's
    (lr 1: the parameters' difference is the clipped gradients' own, a few fp32 ulps)."""
    for scenario, (_, (seed, _, _)) in _SCENARIOS[
            "test_clip_over_tensor_parallel_and_plain_units_matches_the_unsharded_model"].items():
        per_rank = results_of(launched, scenario)
        norms = {norm for norm, _, _ in per_rank}
        assert len(norms) == 1, (scenario, seed, per_rank)
        for rank, (norm, ref_norm, diff) in enumerate(per_rank):
            assert norm == pytest.approx(ref_norm, rel=1e-6), (scenario, seed, rank, norm, ref_norm)
            assert diff < 1e-6, (scenario, seed, rank, diff)


def test_refusal_names_the_units_on_each_side(launched):
    """A list no single norm covers (here a plain parameter beside the units' pieces): each side
    named -- the units (the plain head's with the tensor-parallel ones, whose holder it shares) with
    their parameters and groups, the plain parameter by place and shape."""
    for out in results_of(launched, "refusal"):
        for name in ("torch", "fusedist"):
            msg = out[name]
            # (the plain head shares the tensor-parallel units' holder: one owner, held alike across tp ranks)
            # (the units named as fully_shard's messages name them: the root's own as the root module)
            assert "fully_shard units the root module (Sequential) (0.weight, 0.bias, ...), '3' (Linear) (3.weight, " \
                   "3.bias) [data-parallel group of 2, tensor-parallel group of 2]" in msg, (name, msg)
            assert "not sharded by fully_shard or a ZeRO optimizer (parameter 6 of shape (3,))" in msg, (name, msg)
            assert "clip each owner's parameters on their own" in msg, (name, msg)
