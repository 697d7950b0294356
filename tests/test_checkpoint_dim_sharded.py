"""fusedist.checkpoint with fully_shard models whose parameters are sharded on a dim other
than 0 (Note [dim-sharded pieces in checkpoints]): a Shard(1) weight (10 columns: uneven at
world 3 and 4), a Shard(0) one and a 3-D Shard(-1) one (7 on the last dim), trained with
AdamW at world 2, saved, and loaded at world 3 and 2 into the same placement, the default
placement (Shard(0)), DDP + torch AdamW and ZeRO-2 (and ZeRO-2's checkpoint back), and
resumed through a Checkpointer saving in the background; FusedAdamW's fp32 master_param
over bf16 pieces likewise. The format: one box fragment per dim-sharded piece (Note [box
fragments] in fusedist/zero/box_fragments.py), a version-3 manifest.

Exactness: right after a load the whole parameters and the whole optimizer state (torch's
full optimizer state dict) equal, bit for bit, the source's (``fusedist.fsdp.full_state_dict``
and the same dict taken before the save). Continuation: every step uses one global batch
split evenly over the ranks, so a load at world 2 continues bit for bit as the uninterrupted
run; at world 3 only the summation order of the gradients differs (within 1e-5 after 3
AdamW steps; a misplaced chunk or a lost moment is off by about lr = 1e-2).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fusedist.testing import run_distributed
from phased_launches import launch_phase
from shared_rank_launch import results_of

GLOBAL_BATCH = 12
SAVE_AT, STEPS = 3, 6
TOL = 1e-5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(10, 14)  # weight (14, 10): Shard(1)
        self.experts = nn.Parameter(torch.randn(2, 14, 7) * 0.2)  # Shard(-1): 7 columns

    def forward(self, x):
        h = torch.relu(self.up(x))
        return torch.einsum("bd,edk->bk", h, self.experts)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.down = nn.Linear(7, 5)  # weight (5, 7): Shard(0), the default
        self.skip = nn.Parameter(torch.randn(5, 4) * 0.2)  # Shard(1): no columns on rank 2 at world 3
        self.register_buffer("shift", torch.randn(5))

    def forward(self, x):
        return self.down(self.block(x)) + x[:, :4] @ self.skip.T + self.shift


def placement(p):
    """Shard(-1) for the 3-D weight, Shard(1) for the (14, 10) and (5, 4) ones, else the default."""
    from torch.distributed.tensor import Shard

    if p.dim() == 3:
        return Shard(-1)
    if tuple(p.shape) in ((14, 10), (5, 4)):
        return Shard(1)
    return None


def _net(seed):
    torch.manual_seed(seed)
    return Net()


def _sharded(seed=0, dims=True, dtype=torch.float32):
    import fusedist

    fn = placement if dims else None
    model = _net(seed).to(dtype)
    fusedist.fully_shard(model.block, shard_placement_fn=fn)
    fusedist.fully_shard(model, shard_placement_fn=fn)
    return model


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _steps(model, opt, first, last):
    rank, ws = dist.get_rank(), dist.get_world_size()
    per = GLOBAL_BATCH // ws
    for step in range(first, last):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(GLOBAL_BATCH, 10, generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g)
        dtype = next(iter(model.parameters())).dtype
        F.mse_loss(model(x[rank * per:(rank + 1) * per].to(dtype)).float(), y[rank * per:(rank + 1) * per]).backward()
        opt.step()
        opt.zero_grad()
    if hasattr(opt, "wait_for_params"):
        opt.wait_for_params()


def _full_optim(model, opt) -> dict:
    """``fqn.key`` -> the whole optimizer state (torch's full optimizer state dict; an optimizer
    filled by a load and not stepped since needs its state-dict hooks first)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    import fusedist

    fusedist.fsdp.track_optimizer(opt)
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {f"{fqn}.{k}": v.detach().clone() for fqn, st in osd["state"].items() for k, v in st.items()}


def _by_name(module, state: dict) -> dict:
    """A torch-format optimizer state (by index, in ``module.parameters()`` order) by ``fqn.key``."""
    names = [n for n, _ in module.named_parameters()]
    return {f"{names[int(i)]}.{k}": v.detach().clone() for i, st in state.items() for k, v in st.items()}


def _same(a: dict, b: dict, tol=None) -> list:
    """Keys whose values differ (bit for bit, or beyond ``tol``); a missing key counts."""
    bad = sorted(set(a) ^ set(b))
    for k in set(a) & set(b):
        x, y = torch.as_tensor(a[k]).float(), torch.as_tensor(b[k]).float()
        if x.shape != y.shape or not (torch.equal(x, y) if tol is None else torch.allclose(x, y, atol=tol, rtol=0)):
            bad.append(k)
    return sorted(bad)


# ---------------------------------------------------------------------------------------- save
def _save(rank, ws, root, fused=False):
    import fusedist
    from fusedist.checkpoint import _files

    model = _sharded(dtype=torch.bfloat16 if fused else torch.float32)
    opt = _fused(model.parameters()) if fused else _adamw(model.parameters())
    periodic = fusedist.checkpoint.Checkpointer(os.path.join(root, "periodic"))  # saving in the background
    assert periodic.restore(model, opt) == 0
    _steps(model, opt, 0, SAVE_AT)
    fusedist.checkpoint.save(os.path.join(root, "ckpt"), model, opt, extra={"step": SAVE_AT})
    periodic.save(SAVE_AT)
    periodic.close()
    truth = {"world": ws, "model": fusedist.fsdp.full_state_dict(model), "optim": _full_optim(model, opt),
             "versions": [_files.read_manifest(os.path.join(root, d))["version"]
                          for d in ("ckpt", os.path.join("periodic", "step-00000003"))]}
    _steps(model, opt, SAVE_AT, STEPS)
    truth["final"] = fusedist.fsdp.full_state_dict(model)
    if rank == 0:
        torch.save(truth, os.path.join(root, "truth.pt"))


def _fused(params):
    import fusedist

    return fusedist.optim.FusedAdamW(params, lr=1e-2, weight_decay=0.1, master_weights=True)




# ---------------------------------------------------------------------------------------- load
def _into_fully_shard(rank, ws, root):
    """Loaded into the same placement, the default one, and by a Checkpointer's restore."""
    import fusedist

    truth = torch.load(os.path.join(root, "truth.pt"))
    out = {}
    tol = None if ws == truth["world"] else TOL
    for what, dims in (("same placement", True), ("default placement", False), ("checkpointer", True)):
        model = _sharded(seed=7, dims=dims)
        opt = _adamw(model.parameters())
        if what == "checkpointer":
            periodic = fusedist.checkpoint.Checkpointer(os.path.join(root, "periodic"), async_save=False)
            out[f"{what} step"] = periodic.restore(model, opt)
            periodic.close()
        else:
            out[f"{what} extra"] = fusedist.checkpoint.load(os.path.join(root, "ckpt"), model, opt)
        out[f"{what} model"] = _same(fusedist.fsdp.full_state_dict(model), truth["model"])
        out[f"{what} optim"] = _same(_full_optim(model, opt), truth["optim"])
        _steps(model, opt, SAVE_AT, STEPS)
        out[f"{what} resumed"] = _same(fusedist.fsdp.full_state_dict(model), truth["final"], tol)
    return out


def _check_fully_shard(results):
    for out in results:
        assert out["same placement extra"] == out["default placement extra"] == {"step": SAVE_AT}, out
        assert out["checkpointer step"] == SAVE_AT, out
        for what in ("same placement", "default placement", "checkpointer"):
            for part in ("model", "optim", "resumed"):
                assert out[f"{what} {part}"] == [], (what, part, out)


def _into_ddp(rank, ws, root):
    """Loaded into DDP with torch's AdamW: the whole parameters and state; and back."""
    import fusedist

    truth = torch.load(os.path.join(root, "truth.pt"))
    out = {}
    ddp = fusedist.DistributedDataParallel(_net(7))
    ddp_opt = _adamw(ddp.module.parameters())
    fusedist.checkpoint.load(os.path.join(root, "ckpt"), ddp, ddp_opt)
    out["ddp model"] = _same(ddp.module.state_dict(), truth["model"])
    out["ddp optim"] = _same(_by_name(ddp.module, ddp_opt.state_dict()["state"]), truth["optim"])
    # back: DDP's checkpoint (whole parameters, torch's optimizer state) into a dim-sharded model
    fusedist.checkpoint.save(os.path.join(root, f"ddp-{ws}"), ddp, ddp_opt)
    back = _sharded(seed=9)
    back_opt = _adamw(back.parameters())
    fusedist.checkpoint.load(os.path.join(root, f"ddp-{ws}"), back, back_opt)
    out["ddp back"] = _same(fusedist.fsdp.full_state_dict(back), truth["model"])
    out["ddp back optim"] = _same(_full_optim(back, back_opt), truth["optim"])
    return out


def _into_zero2(rank, ws, root):
    """Loaded into ZeRO-2: the whole parameters and state (consolidated on rank 0); and back."""
    import fusedist

    truth = torch.load(os.path.join(root, "truth.pt"))
    out = {}
    z2 = fusedist.DistributedDataParallel(_net(7))
    z2_opt = fusedist.ZeroRedundancyOptimizer(z2.module.parameters(), torch.optim.AdamW, stage=2, lr=1e-2,
                                              weight_decay=0.1)
    fusedist.checkpoint.load(os.path.join(root, "ckpt"), z2, z2_opt)
    out["zero2 model"] = _same(z2.module.state_dict(), truth["model"])
    full = z2_opt.consolidate_state_dict(to=0)
    if rank == 0:
        out["zero2 optim"] = _same(_by_name(z2.module, full["state"]), truth["optim"])
    # back: ZeRO-2's checkpoint into a dim-sharded fully_shard model
    _steps(z2, z2_opt, SAVE_AT, STEPS)
    fusedist.checkpoint.save(os.path.join(root, f"zero2-{ws}"), z2, z2_opt)
    want = {k: v.detach().clone() for k, v in z2.module.state_dict().items()}
    back = _sharded(seed=9)
    back_opt = _adamw(back.parameters())
    fusedist.checkpoint.load(os.path.join(root, f"zero2-{ws}"), back, back_opt)
    out["zero2 back"] = _same(fusedist.fsdp.full_state_dict(back), want)
    out["zero2 resumed"] = _same(want, truth["final"], None if ws == truth["world"] else TOL)
    return out


def _check_all_empty(results):
    for out in results:
        for k, v in out.items():
            assert v == [], (k, out)


# ------------------------------------------------------------------------------ shared launches
@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """The saves at world 2 in one launch, then every load at world 3 and the save at world 3 in
    another, then the loads at world 2 in a third: three launches for the tests' sixteen."""
    roots = {what: str(tmp_path_factory.mktemp(f"dim-sharded-{what}")) for what in ("plain", "fused", "world3")}
    plain, fused, world3 = roots["plain"], roots["fused"], roots["world3"]
    needs_save = {test: {"save": (_save, (plain, False))} for test in (
        "test_dim_sharded_checkpoint_loads_at_world_3_into_fully_shard",
        "test_dim_sharded_checkpoint_loads_at_world_2_into_fully_shard",
        "test_dim_sharded_checkpoint_loads_into_ddp_and_back", "test_dim_sharded_checkpoint_loads_into_zero2_and_back",
        "test_dim_sharded_checkpoint_format")}
    needs_fused = {test: {"save fused": (_save, (fused, True))} for test in (
        "test_dim_sharded_fused_adamw_master_weights_at_world_3",
        "test_dim_sharded_fused_adamw_master_weights_at_world_2")}
    out = launch_phase(request, {**needs_save, **needs_fused}, 2, timeout=180)
    out.update(launch_phase(request, {
        "test_dim_sharded_checkpoint_loads_at_world_3_into_fully_shard": {
            "fully_shard at 3": (_into_fully_shard, (plain,))},
        "test_dim_sharded_checkpoint_loads_into_ddp_and_back": {"ddp at 3": (_into_ddp, (plain,))},
        "test_dim_sharded_checkpoint_loads_into_zero2_and_back": {"zero2 at 3": (_into_zero2, (plain,))},
        "test_dim_sharded_fused_adamw_master_weights_at_world_3": {"fused at 3": (_fused_into, (fused,))},
        "test_dim_sharded_checkpoint_saved_at_world_3_loads_at_world_2": {"save at 3": (_save, (world3, False))},
    }, 3, timeout=180))
    out.update(launch_phase(request, {
        "test_dim_sharded_checkpoint_loads_at_world_2_into_fully_shard": {
            "fully_shard at 2": (_into_fully_shard, (plain,))},
        "test_dim_sharded_fused_adamw_master_weights_at_world_2": {"fused at 2": (_fused_into, (fused,))},
        "test_dim_sharded_checkpoint_saved_at_world_3_loads_at_world_2": {
            "fully_shard at 2 from 3": (_into_fully_shard, (world3,))},
    }, 2, timeout=180))
    out["roots"] = roots
    return out


def _loaded(launched, save: str, load: str) -> list:
    """The per-rank results of ``load``, once its ``save`` passed on every rank."""
    results_of(launched, save)
    return results_of(launched, load)


def test_dim_sharded_checkpoint_loads_at_world_3_into_fully_shard(launched):
    _check_fully_shard(_loaded(launched, "save", "fully_shard at 3"))


def test_dim_sharded_checkpoint_loads_at_world_2_into_fully_shard(launched):
    _check_fully_shard(_loaded(launched, "save", "fully_shard at 2"))


def test_dim_sharded_checkpoint_loads_into_ddp_and_back(launched):
    _check_all_empty(_loaded(launched, "save", "ddp at 3"))


def test_dim_sharded_checkpoint_loads_into_zero2_and_back(launched):
    results = _loaded(launched, "save", "zero2 at 3")
    _check_all_empty(results)
    assert "zero2 optim" in results[0]


def test_dim_sharded_checkpoint_format(launched, monkeypatch):
    """One box fragment per dim-sharded piece, ranges for Shard(0) ones; the manifests say
    version 3, which a fusedist reading up to version 2 counts as a newer format."""
    from fusedist.checkpoint import _files, layout

    results_of(launched, "save")
    root = launched["roots"]["plain"]
    assert torch.load(os.path.join(root, "truth.pt"))["versions"] == [3, 3]
    shard = torch.load(os.path.join(root, "ckpt", "rank-00001.pt"))
    model, optim = shard["model_shard"], shard["optimizer_shard"]
    kinds = {key: [sorted(set(f) - {"master", "state"}) for f in model["fragments"][k]]
             for k, key in enumerate(model["keys"]) if k in model["fragments"]}
    assert kinds == {"block.up.weight": [["box"]], "block.up.bias": [["range"]], "block.experts": [["box"]],
                     "down.weight": [["range"]], "down.bias": [["range"]], "skip": [["box"]]}, kinds
    up = model["keys"].index("block.up.weight")
    assert model["fragments"][up][0]["box"] == (1, 5, 5)  # torch.chunk(weight, 2, 1)[1]
    assert [f["box"] for f in optim["fragments"][up]] == [(1, 5, 5)]
    assert model["fragments"][model["keys"].index("block.experts")][0]["box"] == (2, 4, 3)
    monkeypatch.setattr(_files, "VERSION", 2)
    assert layout.entry(os.path.join(root, "periodic"), SAVE_AT).newer_format == 3


def test_box_fragments_must_tile_the_dim_once():
    import pytest
    from fusedist.zero import state as zstate

    whole = [torch.empty(4, 6, device="meta")]
    frag = lambda start, length: {"box": (1, start, length), "master": torch.ones(4 * length),  # noqa: E731
                                  "state": {}}
    got = zstate.assemble({0: [frag(3, 3), frag(0, 3)]}, whole, [0], source="s")
    assert torch.equal(got[0]["master"], torch.ones(24))
    for frags in ([frag(0, 3), frag(2, 4)], [frag(0, 3)], [frag(0, 3), frag(3, 3), frag(3, 3)],
                  [frag(0, 3), {"range": (12, 24), "master": torch.ones(12), "state": {}}]):
        with pytest.raises(zstate.StateDictError, match="parameter 0"):
            zstate.assemble({0: frags}, whole, [0], source="s")


def _fused_into(rank, ws, root):
    """A FusedAdamW over bf16 parameters (fp32 master_param) into the same placement and the default."""
    import fusedist

    truth = torch.load(os.path.join(root, "truth.pt"))
    out = {}
    for what, dims in (("same placement", True), ("default placement", False)):
        model = _sharded(seed=7, dims=dims, dtype=torch.bfloat16)
        opt = _fused(model.parameters())
        fusedist.checkpoint.load(os.path.join(root, "ckpt"), model, opt)
        out[f"{what} model"] = _same(fusedist.fsdp.full_state_dict(model), truth["model"])
        got = _full_optim(model, opt)
        out[f"{what} master"] = sorted(k for k in got if k.endswith("master_param"))
        out[f"{what} optim"] = _same(got, truth["optim"])
        if ws == truth["world"] and dims:
            _steps(model, opt, SAVE_AT, STEPS)
            out[f"{what} resumed"] = _same(fusedist.fsdp.full_state_dict(model), truth["final"])
    return out


def _check_fused(results):
    names = ["block.experts.master_param", "block.up.bias.master_param", "block.up.weight.master_param",
             "down.bias.master_param", "down.weight.master_param", "skip.master_param"]
    for out in results:
        for k, v in out.items():
            assert v == (names if k.endswith("master") else []), (k, out)


def test_dim_sharded_fused_adamw_master_weights_at_world_3(launched):
    _check_fused(_loaded(launched, "save fused", "fused at 3"))


def test_dim_sharded_fused_adamw_master_weights_at_world_2(launched):
    _check_fused(_loaded(launched, "save fused", "fused at 2"))


def test_dim_sharded_checkpoint_saved_at_world_3_loads_at_world_2(launched):
    """Saved where a piece is empty (``skip``'s 4 columns at world 3: 2, 2, 0), loaded at 2."""
    _check_fully_shard(_loaded(launched, "save at 3", "fully_shard at 2 from 3"))


def _hsdp(rank, ws, root):
    """Saved from an HSDP mesh (2 replicas x 2 shards: the first replica writes the pieces),
    loaded into a 1-D mesh of the 4 ranks (10 columns: 3, 3, 3, 1)."""
    import fusedist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _net(0)
    fusedist.fully_shard(model.block, mesh=mesh, shard_placement_fn=placement)
    fusedist.fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    opt = _adamw(model.parameters())
    _steps(model, opt, 0, SAVE_AT)
    fusedist.checkpoint.save(os.path.join(root, "hsdp"), model, opt)
    want, want_optim = fusedist.fsdp.full_state_dict(model), _full_optim(model, opt)
    flat = _sharded(seed=7)
    flat_opt = _adamw(flat.parameters())
    fusedist.checkpoint.load(os.path.join(root, "hsdp"), flat, flat_opt)
    return _same(fusedist.fsdp.full_state_dict(flat), want) + _same(_full_optim(flat, flat_opt), want_optim)


def test_dim_sharded_checkpoint_of_hsdp_loads_into_a_1d_mesh(tmp_path):
    assert run_distributed(_hsdp, 4, str(tmp_path), timeout=120) == [[]] * 4
