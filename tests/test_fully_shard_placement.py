"""fully_shard with a ``shard_placement_fn`` sharding parameters on dims other than 0, against
torch's FSDP2 with the same function (Note [dim-sharded sections] in
fusedist/fsdp/chunk_layout.py).

The model mixes Shard(0) (the default, fusedist's row-aligned layout, uneven rows at world 3),
Shard(1) on 2-D weights and Shard(-1) on a 3-D expert weight. A dim-sharded piece is
``torch.chunk(param, S, dim)[rank]``: its shape and values are those of FSDP2's ``to_local()``,
and its gradient is FSDP2's local gradient. With fp32 everything, each rank's gathered values
and gradient sums are FSDP2's (at world 2 a sum of two values rounds one way either side), so
gradients and AdamW steps are compared bit for bit at world 2 and within fp32 rounding at world
3 (three addends, associated as gloo chooses). bf16 compute allows a bf16 ulp.

torch 2.13's FSDP2 refuses a length on a dim other than 0 that the world size does not divide;
fusedist pads it (the last chunks shorter or empty), so those cases are checked against the
unsharded model stepped on every rank's batch.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.nn.functional as F
from torch import nn

import fusedist
from fusedist.testing import run_distributed

EXACT = dict(rtol=0, atol=0)
FP32 = dict(rtol=1e-5, atol=1e-6)
BF16 = dict(rtol=2 ** -7, atol=1e-5)


class Block(nn.Module):
    def __init__(self, d: int, experts: int = 2):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)  # weight (2d, d): Shard(1)
        self.fc2 = nn.Linear(2 * d, d)  # weight (d, 2d): Shard(0), the default
        self.experts = nn.Parameter(torch.randn(experts, d, d) * 0.2)  # Shard(-1)

    def forward(self, x):
        y = self.fc2(F.gelu(self.fc1(x)))
        gate = torch.softmax(x[:, : self.experts.shape[0]].float(), dim=-1).to(x.dtype)
        mixed = torch.einsum("be,bd,edf->bf", gate, x, self.experts)
        return x + y + mixed


class Net(nn.Module):
    def __init__(self, d: int = 12, d_in: int = 12, n: int = 2):
        super().__init__()
        self.inp = nn.Linear(d_in, d)  # weight (d, d_in)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 4)  # weight (4, d): Shard(0), uneven at world 3

    def forward(self, x):
        x = self.inp(x.to(self.inp.weight.dtype))
        for b in self.blocks:
            x = b(x)
        return self.head(x).float()


def placement(p):
    """Shard(-1) for 3-D weights, Shard(1) for 2-D weights wider than... taller than wide, else
    the default."""
    from torch.distributed.tensor import Shard

    if p.dim() == 3:
        return Shard(-1)
    if p.dim() == 2 and p.shape[0] > p.shape[1]:
        return Shard(1)
    return None


def _batch(rank: int, step: int, d_in: int = 12, n: int = 6):
    g = torch.Generator().manual_seed(9100 + 1000 * step + rank)
    return torch.randn(n, d_in, generator=g), torch.randn(n, 4, generator=g)


def _mesh(ws, shape=None):
    from torch.distributed.device_mesh import init_device_mesh

    if shape is None:
        return init_device_mesh("cpu", (ws,))
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _shard(model, mesh, fsdp2: bool, **kw):
    if fsdp2:
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = fusedist.fully_shard
    for b in model.blocks:
        fully_shard(b, mesh=mesh, shard_placement_fn=placement, **kw)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement, **kw)
    return model


def _dim_sharded(model):
    """The names of ``model``'s parameters ``placement`` shards on a dim other than 0."""
    return {n for n, p in model.named_parameters() if (pl := placement(p)) is not None and pl.dim % p.dim() != 0}


def _check_pieces(ref, ours, what, tol, grads=True):
    """Each dim-sharded piece (and its gradient) equals FSDP2's local tensor in shape and value;
    every other gradient equals this rank's range of FSDP2's whole gradient."""
    from fusedist.fsdp.api import _OWNED

    chunked = _dim_sharded(ref)
    theirs = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        r = theirs[name]
        if name in chunked:
            assert tuple(p.shape) == tuple(r.to_local().shape), (what, name, tuple(p.shape), tuple(r.to_local().shape))
            torch.testing.assert_close(p.detach(), r.to_local().detach(), **tol, msg=lambda m: f"{what}: {name}: {m}")
        if not grads:
            continue
        assert (p.grad is None) == (r.grad is None), (what, name)
        if p.grad is None:
            continue
        if name in chunked:
            expected = r.grad.to_local()
        else:
            unit, i = _OWNED[p]
            a, b = unit.element_range(i)
            expected = r.grad.full_tensor().reshape(-1)[a:b].view(p.shape)
        torch.testing.assert_close(p.grad, expected, **tol, msg=lambda m: f"{what}: {name} grad: {m}")


def _check_whole(ref, ours, what, tol):
    got = fusedist.fsdp.full_state_dict(ours)
    want = {k: v.full_tensor() for k, v in ref.state_dict().items()}
    assert got.keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, **tol, msg=lambda m: f"{what}: {k}: {m}")


def _pair(mesh, **kw):
    torch.manual_seed(0)
    ref = Net()
    ours = copy.deepcopy(ref)
    return _shard(ref, mesh, True, **kw), _shard(ours, mesh, False, **kw)


# ---------------------------------------------------------------------------- training parity
def _training(rank, ws):
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    mesh = _mesh(ws)
    fp32 = EXACT if ws == 2 else FP32
    configs = [
        ("fp32", {}, {}, fp32),
        ("fp32 no reshard", dict(reshard_after_forward=False), dict(reshard_after_forward=False), fp32),
        ("bf16", dict(mp_policy=fusedist.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
         dict(mp_policy=TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)), BF16),
    ]
    for what, ours_kw, torch_kw, tol in configs:
        torch.manual_seed(0)
        ref = Net()
        ours = copy.deepcopy(ref)
        _shard(ref, mesh, True, **torch_kw)
        _shard(ours, mesh, False, **ours_kw)
        _check_pieces(ref, ours, f"{what} at rest", EXACT, grads=False)
        o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        o_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2)
        for step in range(3):
            for model in (ref, ours):
                x, y = _batch(rank, step)
                F.mse_loss(model(x), y).backward()
            _check_pieces(ref, ours, f"{what} step {step}", tol)
            o_ref.step(), o_ours.step()
            o_ref.zero_grad(), o_ours.zero_grad()
        _check_pieces(ref, ours, f"{what} stepped", tol, grads=False)
        _check_whole(ref, ours, what, tol)
    return True


def test_dim_sharded_training_matches_fsdp2_world_2():
    assert run_distributed(_training, 2, timeout=300) == [True] * 2


def test_dim_sharded_training_matches_fsdp2_world_3():
    assert run_distributed(_training, 3, timeout=300) == [True] * 3
