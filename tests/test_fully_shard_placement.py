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

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusedist
from phased_launches import launch_phase
from shared_rank_launch import results_of

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
    """Shard(-1) for 3-D weights, Shard(1) for 2-D weights with more rows than columns (the
    expert and up-projection matrices), else None (FSDP2's default, Shard(0))."""
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
    from fusedist.fsdp.owners import owner_of

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
            unit, i = owner_of(p)
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


def test_dim_sharded_training_matches_fsdp2_world_2(at_2):
    assert results_of(at_2, "training") == [True] * 2


def test_dim_sharded_training_matches_fsdp2_world_3(at_3):
    assert results_of(at_3, "training") == [True] * 3


# ---------------------------------------------------------------------------- padding
class Uneven(Net):
    """Lengths on the sharded dims the world size does not divide: ``inp.weight`` (12, 7) on
    dim 1 at world 2 and 3, and ``tiny`` (3, 2) on dim 1, whose last chunk is empty at world 3
    (torch.chunk gives two chunks of one)."""

    def __init__(self):
        super().__init__(d=12, d_in=7)
        self.tiny = nn.Parameter(torch.randn(3, 2) * 0.3)

    def forward(self, x):
        out = super().forward(x)
        return out + (x[:, :3] @ self.tiny).sum(-1, keepdim=True)


def _padding(rank, ws):
    mesh = _mesh(ws)
    torch.manual_seed(0)
    ref = Uneven()
    ours = _shard(copy.deepcopy(ref), mesh, False)
    chunked = _dim_sharded(ref)
    assert {"inp.weight", "tiny", "blocks.0.fc1.weight", "blocks.0.experts"} <= chunked, chunked
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    shapes = {}
    for step in range(3):
        # the reference: the unsharded model on every rank's batch, the loss averaged as FSDP averages
        loss = sum(F.mse_loss(ref(_batch(r, step, d_in=7)[0]), _batch(r, step, d_in=7)[1]) for r in range(ws)) / ws
        loss.backward()
        x, y = _batch(rank, step, d_in=7)
        F.mse_loss(ours(x), y).backward()
        theirs = dict(ref.named_parameters())
        for name, p in ours.named_parameters():
            if name not in chunked:
                continue
            dim = placement(theirs[name]).dim % theirs[name].dim()
            chunks = list(torch.chunk(theirs[name].detach(), ws, dim))
            want = chunks[rank] if rank < len(chunks) else None
            if want is None:  # past the last chunk: empty, 0 on the dim (FSDP2's sharded_size)
                shape = list(theirs[name].shape)
                shape[dim] = 0
                want = torch.empty(shape)
            shapes[name] = tuple(p.shape)
            torch.testing.assert_close(p.detach(), want, **FP32, msg=lambda m: f"step {step}: {name}: {m}")
            g = torch.chunk(theirs[name].grad, ws, dim)
            torch.testing.assert_close(p.grad, g[rank] if rank < len(g) else want, **FP32,
                                       msg=lambda m: f"step {step}: {name} grad: {m}")
        o_ref.step(), o_ours.step()
        o_ref.zero_grad(), o_ours.zero_grad()
    got = fusedist.fsdp.full_state_dict(ours)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, **FP32, msg=lambda m: f"{k}: {m}")
    # torch's FSDP2 refuses these lengths (the reason they are checked against the unsharded model)
    from torch.distributed.fsdp import fully_shard

    try:
        fully_shard(Uneven(), mesh=mesh, shard_placement_fn=placement)
        fsdp2 = "accepted"
    except NotImplementedError as e:
        fsdp2 = str(e)
    return shapes, fsdp2


def test_lengths_the_world_size_does_not_divide_are_padded(at_2, at_3):
    for ws, launched in ((2, at_2), (3, at_3)):
        res = results_of(launched, "padding")
        for rank, (shapes, fsdp2) in enumerate(res):
            assert "uneven sharding" in fsdp2, fsdp2
        if ws == 3:
            assert [r[0]["inp.weight"] for r in res] == [(12, 3), (12, 3), (12, 1)]
            assert [r[0]["tiny"] for r in res] == [(3, 1), (3, 1), (3, 0)]


# ---------------------------------------------------------------------------- clip, scaler, accumulation, offload
def _scaled(rank, ws):
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload

    mesh = _mesh(ws)
    # the clip coefficients: the norms' sums are associated differently (an fp32 ulp apart)
    fp32 = dict(rtol=1e-5, atol=1e-7)
    out = {}
    for what, ours_kw, torch_kw in [("on device", {}, {}),
                                    ("offload", dict(offload_policy=fusedist.CPUOffloadPolicy(pin_memory=False)),
                                     dict(offload_policy=TorchOffload(pin_memory=False)))]:
        torch.manual_seed(0)
        ref = Net()
        ours = copy.deepcopy(ref)
        _shard(ref, mesh, True, **torch_kw)
        _shard(ours, mesh, False, **ours_kw)
        o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        o_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2)
        s_ref = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        s_ours = fusedist.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        clips = [fusedist.clip_grad_norm_, torch.nn.utils.clip_grad_norm_]
        norms = []
        for step in range(4):
            micro = 2  # accumulation without gradient sync, then a synchronized backward
            for model, scaler in ((ref, s_ref), (ours, s_ours)):
                for m in range(micro):
                    model.set_requires_gradient_sync(m == micro - 1)
                    x, y = _batch(rank, 10 * step + m)
                    scaler.scale(F.mse_loss(model(x), y)).backward()
            if step == 2:  # an inf in one rank's dim-sharded gradient: every rank skips the step
                p = ours.blocks[0].fc1.weight
                r = ref.blocks[0].fc1.weight
                if rank == ws - 1:
                    p.grad.view(-1)[0] = float("inf")
                    r.grad.to_local().view(-1)[0] = float("inf")
            s_ref.unscale_(o_ref), s_ours.unscale_(o_ours)
            n_ref = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.05)
            n_ours = clips[step % 2](list(ours.parameters()), 0.05)
            norms.append((float(n_ours), float(n_ref.full_tensor())))
            if step != 2:
                _check_pieces(ref, ours, f"{what} step {step} clipped", fp32)
            s_ref.step(o_ref), s_ours.step(o_ours)
            s_ref.update(), s_ours.update()
            o_ref.zero_grad(), o_ours.zero_grad()
            assert s_ref.get_scale() == s_ours.get_scale(), (what, step, s_ref.get_scale(), s_ours.get_scale())
        _check_whole(ref, ours, what, fp32)
        out[what] = norms
    return out


def test_clip_scaler_accumulation_and_offload_match_fsdp2(at_2, at_3):
    for ws, launched in ((2, at_2), (3, at_3)):
        for res in results_of(launched, "scaled"):
            for what, norms in res.items():
                for step, (a, b) in enumerate(norms):
                    if step == 2:
                        assert a == b == float("inf"), (ws, what, norms)
                    else:
                        assert abs(a - b) <= 1e-6 * b, (ws, what, step, a, b)


# ---------------------------------------------------------------------------- state dicts and checkpoints
def _full_optim(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {f"{fqn}.{k}": v.detach().clone() for fqn, st in osd["state"].items() for k, v in st.items()
            if isinstance(v, torch.Tensor) and v.dim()}


def _train(model, opt, rank, steps):
    for step in steps:
        x, y = _batch(rank, step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _equal(a: dict, b: dict, tol=None) -> bool:
    """Equal entries: bit for bit, or within ``tol`` (two trainings at world 3, see the docstring)."""
    same = (lambda x, y: torch.equal(x, y)) if tol is None else (lambda x, y: torch.allclose(x, y, **tol))
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


def _checkpoints(rank, ws, directory):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                         set_state_dict)
    from fusedist.fsdp.dcp import ShardedPiece

    mesh = _mesh(ws)
    out = {}
    tol = None if ws == 2 else FP32  # ours against FSDP2 trained alike (interchanged values: bit for bit)
    ref, ours = _pair(mesh)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    _train(ref, o_ref, rank, range(2))
    _train(ours, o_ours, rank, range(2))
    trained = fusedist.fsdp.full_state_dict(ours)
    out["trained"] = _equal(trained, {k: v.full_tensor() for k, v in ref.state_dict().items()}, tol)
    # the entries: a dim-sharded piece is FSDP2's local tensor, of the whole parameter's size()
    sd, theirs = ours.state_dict(), ref.state_dict()
    out["entries"] = all(isinstance(sd[k], ShardedPiece) and sd[k].size() == theirs[k].size()
                         and sd[k].shape == theirs[k].to_local().shape
                         and _equal({0: sd[k].local()}, {0: theirs[k].to_local()}, tol) for k in _dim_sharded(ref))
    # torch's full state dicts: the model's and the optimizer's equal FSDP2's
    full = get_model_state_dict(ours, options=StateDictOptions(full_state_dict=True))
    out["full model"] = _equal(full, get_model_state_dict(ref, options=StateDictOptions(full_state_dict=True)), tol)
    out["full optim"] = _equal(_full_optim(ours, o_ours), _full_optim(ref, o_ref), tol)

    # model.state_dict() round trip, and a full state dict loaded with load_state_dict
    for what, source in (("sharded", {k: v.clone() for k, v in ours.state_dict().items()}), ("full", trained)):
        torch.manual_seed(5)
        fresh = _shard(Net(), mesh, False)
        fresh.load_state_dict(source)
        out[f"load_state_dict {what}"] = _equal(fusedist.fsdp.full_state_dict(fresh), trained)

    # DCP, model and optimizer: fusedist -> FSDP2 -> fusedist; each resumes training as the source
    where = os.path.join(directory, "ours")
    msd, osd = get_state_dict(ours, o_ours)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=where)
    torch.manual_seed(1)
    back_ref = _shard(Net(), mesh, True)
    back_ref_opt = torch.optim.AdamW(back_ref.parameters(), lr=1e-2)
    msd, osd = get_state_dict(back_ref, back_ref_opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=where)
    set_state_dict(back_ref, back_ref_opt, model_state_dict=msd, optim_state_dict=osd)
    out["dcp to fsdp2"] = _equal({k: v.full_tensor() for k, v in back_ref.state_dict().items()}, trained)
    out["dcp to fsdp2 optim"] = _equal(_full_optim(back_ref, back_ref_opt), _full_optim(ours, o_ours))
    where = os.path.join(directory, "theirs")
    msd, osd = get_state_dict(back_ref, back_ref_opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=where)
    torch.manual_seed(2)
    back = _shard(Net(), mesh, False)
    back_opt = torch.optim.AdamW(back.parameters(), lr=1e-2)
    msd, osd = get_state_dict(back, back_opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=where)
    set_state_dict(back, back_opt, model_state_dict=msd, optim_state_dict=osd)
    out["dcp from fsdp2"] = _equal(fusedist.fsdp.full_state_dict(back), trained)
    _train(back, back_opt, rank, range(2, 4))
    _train(ours, o_ours, rank, range(2, 4))
    _train(back_ref, back_ref_opt, rank, range(2, 4))
    resumed = fusedist.fsdp.full_state_dict(ours)
    out["resumed"] = _equal(fusedist.fsdp.full_state_dict(back), resumed)
    out["resumed fsdp2"] = _equal({k: v.full_tensor() for k, v in back_ref.state_dict().items()}, resumed, tol)
    if rank == 0:
        torch.save(resumed, os.path.join(directory, f"resumed-{ws}.pt"))

    # built on meta: initialized as the unsharded model is, and loaded with whole parameters
    def init_fn(m):
        if isinstance(m, nn.Linear):
            m.reset_parameters()
        if isinstance(m, Block):
            nn.init.normal_(m.experts, std=0.2)

    with torch.device("meta"):
        meta = _shard(Net(), mesh, False)
    meta.to_empty(device="cpu")
    torch.manual_seed(11)
    fusedist.fsdp.init_parameters(meta, init_fn)
    plain = Net()
    torch.manual_seed(11)
    plain.apply(init_fn)
    out["init"] = _equal(fusedist.fsdp.full_state_dict(meta), plain.state_dict())
    fusedist.fsdp.load_full_state_dict(meta, trained)
    out["meta"] = _equal(fusedist.fsdp.full_state_dict(meta), trained)
    # fusedist.checkpoint saves it, and loads a Shard(0) model's checkpoint into it
    # (Note [dim-sharded pieces in checkpoints]; tests/test_checkpoint_dim_sharded.py)
    fusedist.checkpoint.save(os.path.join(directory, "fusedist"), ours, o_ours)
    torch.manual_seed(0)
    rows = Net()
    for b in rows.blocks:
        fusedist.fully_shard(b, mesh=mesh)
    fusedist.fully_shard(rows, mesh=mesh)
    rows_opt = torch.optim.AdamW(rows.parameters(), lr=1e-2)
    _train(rows, rows_opt, rank, range(1))
    fusedist.checkpoint.save(os.path.join(directory, "fusedist-rows"), rows, rows_opt)
    fusedist.checkpoint.load(os.path.join(directory, "fusedist-rows"), ours, o_ours)
    out["fusedist.checkpoint load"] = _equal(fusedist.fsdp.full_state_dict(ours), fusedist.fsdp.full_state_dict(rows))
    return out


def _load_at(rank, ws, directory):
    """The DCP checkpoint another world size saved, into FSDP2 and into fusedist at this one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    mesh = _mesh(ws)
    want = torch.load(os.path.join(directory, "resumed-2.pt"))
    out = {}
    for fsdp2 in (False, True):
        torch.manual_seed(7)
        model = _shard(Net(), mesh, fsdp2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        msd, osd = get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(directory, "resaved"))
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        got = ({k: v.full_tensor() for k, v in model.state_dict().items()} if fsdp2
               else fusedist.fsdp.full_state_dict(model))
        out["fsdp2" if fsdp2 else "ours"] = _equal(got, want)
        out["optim fsdp2" if fsdp2 else "optim ours"] = _full_optim(model, opt)
    a, b = out.pop("optim ours"), out.pop("optim fsdp2")
    out["optim"] = _equal(a, b)
    return out


def _resave(rank, ws, directory):
    """Save the resumed fusedist model and optimizer with DCP at this world size."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    mesh = _mesh(ws)
    torch.manual_seed(8)
    model = _shard(Net(), mesh, False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, rank, range(2))
    fusedist.fsdp.load_full_state_dict(model, torch.load(os.path.join(directory, "resumed-2.pt")))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(directory, "resaved"))
    return True


def test_state_dicts_and_dcp_interchange_with_fsdp2(at_2, at_3):
    for res in results_of(at_2, "checkpoints"):
        assert all(res.values()), (2, res)
    for res in results_of(at_3, "checkpoints"):
        assert all(res.values()), (3, res)


def test_dcp_checkpoint_saved_at_world_2_loads_at_world_3(at_2, at_3):
    assert results_of(at_2, "resave") == [True] * 2
    for res in results_of(at_3, "load at 3"):
        assert all(res.values()), res


# ---------------------------------------------------------------------------- HSDP, memory, mismatches
def _hsdp(rank, ws):
    out = {}
    for shape in ((2, 1), (1, 2)):  # replicas x shards
        mesh = _mesh(ws, shape)
        ref, ours = _pair(mesh)
        o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        o_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2)
        for step in range(2):
            for model in (ref, ours):
                x, y = _batch(rank, step)
                F.mse_loss(model(x), y).backward()
            _check_pieces(ref, ours, f"HSDP {shape} step {step}", EXACT)
            o_ref.step(), o_ours.step()
            o_ref.zero_grad(), o_ours.zero_grad()
        _check_whole(ref, ours, f"HSDP {shape}", EXACT)
        out[shape] = True
    # memory: a gathered dim-sharded unit holds its gathered chunks and the copied-out parameters
    mesh = _mesh(ws)
    torch.manual_seed(0)
    model = _shard(Net(), mesh, False)
    block = model.blocks[0]
    from fusedist.fsdp.state import state_of

    unit = state_of(block).unit
    chunked = sum(p.numel() for n, p in Net().blocks[0].named_parameters() if n in ("fc1.weight", "experts"))
    before = model.memory_stats()["gathered_bytes"]
    block.unshard()
    during = model.memory_stats()["gathered_bytes"]
    block.reshard()
    out["memory"] = (during - before == unit.unsharded_bytes,
                     unit.unsharded_bytes == 4 * (unit.layout.total_numel + chunked),
                     model.memory_stats()["gathered_bytes"] == before)
    return out


def test_hsdp_and_memory_stats(at_2):
    for res in results_of(at_2, "hsdp"):
        assert res[(2, 1)] and res[(1, 2)] and all(res["memory"]), res


def _mismatch(rank, ws):
    from torch.distributed.tensor import Shard

    mesh = _mesh(ws)
    torch.manual_seed(0)
    model = Net()
    fn = placement if rank == 0 else (lambda p: Shard(0))
    for b in model.blocks:
        fusedist.fully_shard(b, mesh=mesh, shard_placement_fn=fn)
    fusedist.fully_shard(model, mesh=mesh, shard_placement_fn=fn)
    try:
        model(_batch(rank, 0)[0])
        return None
    except fusedist.RankMismatchError as e:
        return str(e)


def test_placements_differing_across_ranks_are_a_rank_mismatch(at_2):
    for text in results_of(at_2, "mismatch"):
        assert text is not None and "Shard(1)" in text, text


def test_placements_refused_by_name():
    from torch.distributed.tensor import Replicate, Shard

    import pytest

    from fusedist.fsdp.placement import shard_dim

    w = torch.zeros(4, 6)
    assert shard_dim(w, "w", lambda p: Shard(-1), "M") == 1
    assert shard_dim(w, "w", lambda p: None, "M") == 0
    assert shard_dim(torch.zeros(()), "s", lambda p: Shard(0), "M") == 0
    with pytest.raises(ValueError, match=r"'w', which has shape \(4, 6\) \(2 dims\): the dim is out of range"):
        shard_dim(w, "w", lambda p: Shard(2), "M")
    with pytest.raises(NotImplementedError, match=r"returned Replicate\(\) for 'w'"):
        shard_dim(w, "w", lambda p: Replicate(), "M")


# ---------------------------------------------------------------------------- dtype and trainable sections
class MixedBlock(Block):
    """A block whose up-projection is bf16 (dim-sharded) beside fp32 experts (dim-sharded too):
    one dim-sharded section per dtype (Note [dtype sections] in layout.py)."""

    def __init__(self, d: int):
        super().__init__(d)
        self.fc1.to(torch.bfloat16)

    def forward(self, x):
        h = F.gelu(self.fc1(x.to(self.fc1.weight.dtype))).to(x.dtype)
        y = self.fc2(h)
        gate = torch.softmax(x[:, : self.experts.shape[0]], dim=-1)
        return x + y + torch.einsum("be,bd,edf->bf", gate, x, self.experts)


class MixedNet(Net):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(MixedBlock(12) for _ in range(2))
        self.blocks[1].experts.requires_grad_(False)  # a frozen dim-sharded section
        self.blocks[1].fc1.weight.requires_grad_(False)


def _sections(rank, ws):
    """Mixed dtypes and frozen parameters: the same training with and without the placement
    (fusedist both, so the same sums in the same order: bit for bit; no clip, whose bf16
    per-piece norms depend on how the pieces are cut)."""
    mesh = _mesh(ws)
    torch.manual_seed(0)
    base = MixedNet()
    models = []
    for fn in (placement, None):
        m = copy.deepcopy(base)
        for b in m.blocks:
            fusedist.fully_shard(b, mesh=mesh, shard_placement_fn=fn)
        fusedist.fully_shard(m, mesh=mesh, shard_placement_fn=fn)
        models.append((m, torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)))
    from fusedist.fsdp.state import state_of

    kinds = [(s.trainable, str(s.dtype), s.chunked) for s in state_of(models[0][0].blocks[1]).unit.layout.sections]
    for step in range(3):
        for m, opt in models:
            x, y = _batch(rank, step)
            F.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad()
    a, b = (fusedist.fsdp.full_state_dict(m) for m, _ in models)
    same = _equal(a, b) and all(a[k].dtype == b[k].dtype for k in a)
    # model.double() after sharding rebuilds the sections around the converted pieces
    for m, _ in models:
        m.double()
        x, y = _batch(rank, 5)
        F.mse_loss(m(x.double()), y.double()).backward()
    a, b = (fusedist.fsdp.full_state_dict(m) for m, _ in models)
    grads = [{n: p.grad for n, p in m.named_parameters() if p.grad is not None} for m, _ in models]
    doubled = (all(v.dtype == torch.float64 for v in a.values()) and _equal(a, b)
               and grads[0].keys() == grads[1].keys() and all(g.dtype == torch.float64 for g in grads[0].values()))
    return kinds, same, doubled


def test_dim_sharded_sections_per_dtype_and_trainable_flag(at_3):
    for kinds, same, doubled in results_of(at_3, "sections"):
        assert same and doubled
        assert kinds == [(True, "torch.float32", False), (True, "torch.bfloat16", False),
                         (False, "torch.float32", True), (False, "torch.bfloat16", True)], kinds


# ---------------------------------------------------------------------------- a weight tied across units
def _tied(rank, ws):
    """An embedding weight (50, 16) sharded on dim 1 and tied to the root's output layer: the
    embedding's unit lends it (Note [lent parameters] in unit.py). The same training as without
    the placement, bit for bit (16 columns: chunks 6, 6, 4 at world 3)."""
    import models

    mesh = _mesh(ws)
    torch.manual_seed(0)
    base = models.TiedLM()
    trained = []
    for fn in (placement, None):
        m = copy.deepcopy(base)
        fusedist.fully_shard(m.embed, mesh=mesh, shard_placement_fn=fn)
        fusedist.fully_shard(m, mesh=mesh, shard_placement_fn=fn)
        if fn is not None:
            assert tuple(m.embed.weight.shape) == (50, (6, 6, 4)[rank] if ws == 3 else 8), tuple(m.embed.weight.shape)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for step in range(3):
            tokens, target = models.TiedLM.batch(torch.Generator().manual_seed(100 * step + rank))
            F.cross_entropy(m(tokens).flatten(0, 1), target.flatten()).backward()
            opt.step()
            opt.zero_grad()
        trained.append(fusedist.fsdp.full_state_dict(m))
    return _equal(*trained)


def test_dim_sharded_weight_tied_across_units(at_3):
    assert results_of(at_3, "tied") == [True] * 3


# ---------------------------------------------------------------------------- the launches
@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    """Where each world size's checkpoints go (world 3 reads world 2's resaved one)."""
    return {ws: str(tmp_path_factory.mktemp(f"checkpoints-{ws}")) for ws in (2, 3)}


@pytest.fixture(scope="module")
def at_2(request, directories):
    """The world-2 scenarios of the selected tests, in one launch (the mismatch last: its ranks raise)."""
    saved = {"checkpoints": (_checkpoints, (directories[2],)), "resave": (_resave, (directories[2],))}
    return launch_phase(request, {
        "test_dim_sharded_training_matches_fsdp2_world_2": {"training": (_training, ())},
        "test_lengths_the_world_size_does_not_divide_are_padded": {"padding": (_padding, ())},
        "test_clip_scaler_accumulation_and_offload_match_fsdp2": {"scaled": (_scaled, ())},
        "test_state_dicts_and_dcp_interchange_with_fsdp2": {"checkpoints": saved["checkpoints"]},
        "test_dcp_checkpoint_saved_at_world_2_loads_at_world_3": saved,
        "test_hsdp_and_memory_stats": {"hsdp": (_hsdp, ())},
        "test_placements_differing_across_ranks_are_a_rank_mismatch": {"mismatch": (_mismatch, ())},
    }, 2, timeout=600)


@pytest.fixture(scope="module")
def at_3(request, directories, at_2):
    """The world-3 scenarios of the selected tests, in one launch after the world-2 one (whose
    resaved checkpoint ``load at 3`` reads)."""
    return launch_phase(request, {
        "test_dim_sharded_training_matches_fsdp2_world_3": {"training": (_training, ())},
        "test_lengths_the_world_size_does_not_divide_are_padded": {"padding": (_padding, ())},
        "test_clip_scaler_accumulation_and_offload_match_fsdp2": {"scaled": (_scaled, ())},
        "test_state_dicts_and_dcp_interchange_with_fsdp2": {"checkpoints": (_checkpoints, (directories[3],))},
        "test_dcp_checkpoint_saved_at_world_2_loads_at_world_3": {"load at 3": (_load_at, (directories[2],))},
        "test_dim_sharded_sections_per_dtype_and_trainable_flag": {"sections": (_sections, ())},
        "test_dim_sharded_weight_tied_across_units": {"tied": (_tied, ())},
    }, 3, timeout=600)


# ---------------------------------------------------------------------------- the layout alone
def test_chunk_layout_pieces_are_torch_chunks():
    """Every rank's piece is torch.chunk's (FSDP2's sharded_size past the last chunk), the
    copy-out of a gathered section reassembles each parameter, the copy-in puts each chunk where
    the reduce-scatter hands it to its rank, and the padding is exactly the rest of the slots."""
    from fusedist.fsdp.chunk_layout import ChunkLayout

    g = torch.Generator().manual_seed(3)
    shapes = [(5, 7), (3, 2), (2, 9, 4), (4, 1, 6), (6, 0)]
    dims = [1, 1, 2, 1, 1]
    for ws in (1, 2, 3, 4, 5):
        layout = ChunkLayout(shapes, dims, ws)
        wholes = [torch.randn(s, generator=g) for s in shapes]
        gathered = torch.full((layout.total_numel,), float("nan"))
        for j, (w, d) in enumerate(zip(wholes, dims)):
            chunks = list(torch.chunk(w, ws, d))
            for r in range(ws):
                p = layout.piece(j, r)
                want = chunks[r] if r < len(chunks) else None
                shape = list(w.shape)
                shape[d] = 0
                assert p.shape == (tuple(want.shape) if want is not None else tuple(shape)), (ws, j, r, p)
                a = r * layout.shard_numel + p.shard_offset
                if p.numel:
                    gathered[a:a + p.numel] = want.reshape(-1)
        for a, b in layout.gaps():
            assert gathered[a:b].isnan().all()
            gathered[a:b] = 0
        assert not gathered.isnan().any(), ws
        for j, w in enumerate(wholes):
            assert torch.equal(layout.assemble(gathered, j), w), (ws, j)
            back = torch.zeros_like(gathered)
            layout.copy_in(back, j, w)
            layout.copy_in(back, j, w, add=True)
            assert torch.equal(layout.assemble(back, j), 2 * w), (ws, j)
