"""fully_shard units whose parameters have different dtypes: bf16 Linear weights with an fp32
LayerNorm and MoE-style router in one decoder block (Hugging Face's ``_keep_in_fp32_modules``).
Each (trainable, dtype) group of a unit is a section of its own, gathered and reduced in its
dtype or the policy's (Note [dtype sections] in fusedist/fsdp/layout.py).

torch 2.13's FSDP2 takes such a block only when its *trainable* parameters share one dtype (its
parameter group asserts "uniform original parameter dtype" at the first forward; checked
below). So the references are: FSDP2 with the same wrapping where it accepts it (frozen bf16
weights beside trainable fp32 ones), and otherwise FSDP2 with the fp32 modules sharded as
units of their own -- the same per-parameter math, gathers and reductions, grouped differently.

Tolerances: every gathered value is the sharded value (cast to ``param_dtype`` alike) and each
parameter is reduced in the same dtype as FSDP2's, so at world size 2 (a sum of two values,
one rounding either way) the gradients and the AdamW steps come out bit-identical to FSDP2's;
the comparisons allow a bf16 ulp (``rtol=2**-7``) for bf16 pieces and ``rtol=1e-5`` for fp32
ones. The clipped last step is looser: both clips take each bf16 gradient's norm in bf16
(torch's ``_foreach_norm``), so each total norm is within a bf16 rounding (``2**-8``) of the
exact fp32 norm, and so is the ratio of the two clip coefficients: the clipped fp32 gradients
agree to ``rtol=2**-8``. AdamW's update is nearly invariant to the gradient's scale, so the
step after moves weights apart by at most about ``lr * 2**-8`` = 4e-5 plus a rounding
(``atol=1e-4``). World size 3: see ``_world3``.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusedist
import models
from phased_launches import launch_phase
from shared_rank_launch import results_of, under_env

BF16 = dict(rtol=2 ** -7, atol=1e-6)
FP32 = dict(rtol=1e-5, atol=1e-6)
NORM = 2 ** -8  # relative: a bf16 rounding of the per-tensor norms of bf16 gradients
CLIPPED = dict(rtol=NORM, atol=1e-6)  # fp32 gradients scaled by the two clip coefficients
STEPPED = dict(rtol=2 ** -7, atol=1e-4)  # weights after an AdamW step from those gradients


class Block(nn.Module):
    """A decoder-like block loaded in bf16 with fp32 modules kept: ``norm`` and ``router`` fp32,
    ``fc1``/``fc2`` bf16. Each module runs in its own weight's dtype (as HF models cast)."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, 3, bias=False)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.fc1.to(torch.bfloat16)
        self.fc2.to(torch.bfloat16)

    def forward(self, x):
        h = self.norm(x.to(self.norm.weight.dtype))
        gate = torch.softmax(self.router(h.to(self.router.weight.dtype)), dim=-1)[..., :1]
        y = self.fc2(F.gelu(self.fc1(h.to(self.fc1.weight.dtype))))
        return x + (y.float() * gate.float()).to(x.dtype)


class Net(nn.Module):
    def __init__(self, d: int = 24, n: int = 2):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        x = self.inp(x.to(self.inp.weight.dtype))
        for b in self.blocks:
            x = b(x)
        return self.head(x.to(self.head.weight.dtype)).float()


def _batch(rank: int, step: int):
    return models.rank_step_batch(rank, step, 6, seed=7000)


def _mesh(ws):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (ws,))


def _shard_ours(model, mesh, **kw):
    for b in model.blocks:
        fusedist.fully_shard(b, mesh=mesh, **kw)
    fusedist.fully_shard(model, mesh=mesh, **kw)
    return model


def _shard_torch(model, mesh, split: bool, **kw):
    from torch.distributed.fsdp import fully_shard

    for b in model.blocks:
        if split:  # the fp32 modules as units of their own: FSDP2 refuses them inside the bf16 block
            fully_shard(b.norm, mesh=mesh, **kw)
            fully_shard(b.router, mesh=mesh, **kw)
        fully_shard(b, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _tol(t, fp32=FP32, bf16=BF16):
    return bf16 if t.dtype in (torch.bfloat16, torch.float16) else fp32


def _check_grads(ref, ours, what, fp32=FP32, bf16_sum=False):
    from fusedist.fsdp.owners import owner_of

    whole = {n: p.grad.full_tensor() if p.grad is not None else None for n, p in ref.named_parameters()}
    for name, p in ours.named_parameters():
        assert (p.grad is None) == (whole[name] is None), f"{what}: {name}: gradient presence differs"
        if p.grad is None:
            continue
        assert p.grad.dtype == whole[name].dtype == p.dtype, (what, name, p.grad.dtype, whole[name].dtype)
        unit, i = owner_of(p)
        a, b = unit.element_range(i)
        expected = whole[name].reshape(-1)[a:b].view(p.shape)
        tol = _tol(p, fp32)
        if bf16_sum and p.dtype == torch.bfloat16:  # world 3: see the module's docstring
            tol = dict(rtol=BF16["rtol"], atol=2 ** -6 * whole[name].float().abs().max().item())
        torch.testing.assert_close(p.grad, expected, **tol, msg=lambda m: f"{what}: {name}: {m}")


def _check_params(ref, ours, what, fp32=FP32, bf16=BF16):
    got = fusedist.fsdp.full_state_dict(ours)
    want = {k: v.full_tensor() for k, v in ref.state_dict().items()}
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype, (what, k, got[k].dtype, v.dtype)
        torch.testing.assert_close(got[k], v, **_tol(v, fp32, bf16), msg=lambda m: f"{what}: {k}: {m}")


def _step(model, opt, rank, step):
    x, y = _batch(rank, step)
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _torch_norm(model):
    total = sum(p.grad.full_tensor().float().pow(2).sum() for p in model.parameters() if p.grad is not None)
    return total.sqrt()


def _parity(rank, ws, directory):
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    mesh = _mesh(ws)
    out = {}
    # FSDP2 itself refuses trainable parameters of two dtypes in one unit (the premise above)
    torch.manual_seed(0)
    probe = _shard_torch(Net(), mesh, split=False)
    try:
        probe(_batch(rank, 0)[0])
        out["fsdp2_refuses"] = False
    except AssertionError as e:
        out["fsdp2_refuses"] = "uniform original parameter dtype" in str(e)

    configs = [
        ("plain", {}, True),
        ("mp", dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), False),
        ("frozen", {}, False),
        ("mp frozen", dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), True),
    ]
    for what, mp, raf in configs:
        torch.manual_seed(0)
        ref = Net()
        if "frozen" in what:  # a frozen parameter of each dtype
            for b in ref.blocks:
                b.fc1.weight.requires_grad_(False)
                b.norm.bias.requires_grad_(False)
        ours = copy.deepcopy(ref)
        ours_kw = dict(reshard_after_forward=raf)
        torch_kw = dict(reshard_after_forward=raf)
        if mp:
            ours_kw["mp_policy"] = fusedist.MixedPrecisionPolicy(**mp)
            torch_kw["mp_policy"] = TorchMP(**mp)
        _shard_torch(ref, mesh, split=True, **torch_kw)
        _shard_ours(ours, mesh, **ours_kw)
        o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        o_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2)
        for step in range(3):
            for model in (ref, ours):
                x, y = _batch(rank, step)
                F.mse_loss(model(x), y).backward()
            _check_grads(ref, ours, f"{what} step {step}")
            if step == 2:  # the global norm over both dtypes' pieces, and the clipped gradients
                exact = _torch_norm(ref)
                n_ref = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.05)
                n_ours = fusedist.clip_grad_norm_(list(ours.parameters()), 0.05)
                out[what] = (float(n_ours), float(n_ref.full_tensor()), float(exact))
                _check_grads(ref, ours, f"{what} clipped", fp32=CLIPPED)
            o_ref.step(), o_ours.step()
            o_ref.zero_grad(), o_ours.zero_grad()
        _check_params(ref, ours, what, fp32=STEPPED, bf16=STEPPED)
    # gradient accumulation without communication (each section accumulates in its dtype)
    torch.manual_seed(0)
    ref = Net()
    ours = copy.deepcopy(ref)
    _shard_torch(ref, mesh, split=True)
    _shard_ours(ours, mesh)
    for model in (ref, ours):
        model.set_requires_gradient_sync(False)
        for micro in range(3):
            if micro == 2:
                model.set_requires_gradient_sync(True)
            x, y = _batch(rank, 10 + micro)
            F.mse_loss(model(x), y).backward()
    _check_grads(ref, ours, "accumulation")

    # FSDP2 with the same wrapping where it accepts it: trainable fp32, frozen bf16 in one unit
    torch.manual_seed(0)
    ref = Net()
    for b in ref.blocks:
        b.fc1.requires_grad_(False)
        b.fc2.requires_grad_(False)
    ours = copy.deepcopy(ref)
    _shard_torch(ref, mesh, split=False)
    _shard_ours(ours, mesh)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    o_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    for step in range(3):
        for model in (ref, ours):
            x, y = _batch(rank, step)
            F.mse_loss(model(x), y).backward()
        _check_grads(ref, ours, f"same wrapping step {step}")
        o_ref.step(), o_ours.step()
        o_ref.zero_grad(), o_ours.zero_grad()
    _check_params(ref, ours, "same wrapping")
    return out


def test_mixed_dtype_units_train_like_fsdp2(at_2):
    for res in results_of(at_2, "parity"):
        assert res["fsdp2_refuses"]
        for what in ("plain", "mp", "frozen", "mp frozen"):
            ours, ref, exact = res[what]
            assert abs(ours - exact) <= NORM * exact and abs(ref - exact) <= NORM * exact, (what, res[what])


def _full_optim(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {f"{fqn}.{k}": v.detach().clone() for fqn, st in osd["state"].items() for k, v in st.items()
            if isinstance(v, torch.Tensor) and v.dim()}


def _checkpoints(rank, ws, directory):
    import torch.distributed.checkpoint as dcp

    mesh = _mesh(ws)
    out = {}
    torch.manual_seed(0)
    ours = _shard_ours(Net(), mesh)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    for step in range(2):
        _step(ours, opt, rank, step)
    trained = fusedist.fsdp.full_state_dict(ours)
    # the whole optimizer state (torch's helper) equals FSDP2's after the same training
    torch.manual_seed(0)
    ref = _shard_torch(Net(), mesh, split=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(2):
        _step(ref, ref_opt, rank, step)
    a, b = _full_optim(ours, opt), _full_optim(ref, ref_opt)
    out["optim"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    out["optim dtypes"] = {k: str(v.dtype) for k, v in a.items()}
    out["dtypes"] = {k: str(v.dtype) for k, v in trained.items()}
    out["sd_dtypes"] = {k: str(v.dtype) for k, v in ours.state_dict().items()}

    # DCP: fusedist -> FSDP2 (the fp32 modules as units of their own) -> fusedist
    where = os.path.join(directory, "dcp-ours")
    dcp.save({"model": ours.state_dict()}, checkpoint_id=where)
    torch.manual_seed(1)
    ref = _shard_torch(Net(), mesh, split=True)
    sd = ref.state_dict()
    dcp.load({"model": sd}, checkpoint_id=where)
    ref.load_state_dict(sd)
    got = {k: v.full_tensor() for k, v in ref.state_dict().items()}
    out["dcp to fsdp2"] = all(torch.equal(got[k], trained[k]) and got[k].dtype == trained[k].dtype for k in trained)
    where = os.path.join(directory, "dcp-torch")
    dcp.save({"model": ref.state_dict()}, checkpoint_id=where)
    torch.manual_seed(2)
    back = _shard_ours(Net(), mesh)
    sd = back.state_dict()
    dcp.load({"model": sd}, checkpoint_id=where)
    back.load_state_dict(sd)
    got = fusedist.fsdp.full_state_dict(back)
    out["dcp from fsdp2"] = all(torch.equal(got[k], trained[k]) and got[k].dtype == trained[k].dtype for k in trained)

    # full state dict into a fresh model
    torch.manual_seed(3)
    fresh = _shard_ours(Net(), mesh)
    fusedist.fsdp.load_full_state_dict(fresh, trained)
    got = fusedist.fsdp.full_state_dict(fresh)
    out["full"] = all(torch.equal(got[k], trained[k]) for k in trained)

    # fusedist.checkpoint round trip with the optimizer: training resumes identically
    base = os.path.join(directory, "ckpt")
    fusedist.checkpoint.save(base, ours, opt)
    torch.manual_seed(4)
    again = _shard_ours(Net(), mesh)
    again_opt = torch.optim.AdamW(again.parameters(), lr=1e-2)
    fusedist.checkpoint.load(base, again, again_opt)
    for step in range(2, 4):
        _step(ours, opt, rank, step)
        _step(again, again_opt, rank, step)
    a, b = fusedist.fsdp.full_state_dict(ours), fusedist.fsdp.full_state_dict(again)
    out["checkpoint"] = all(torch.equal(a[k], b[k]) for k in a)

    # CPU offload: the same training as without it
    torch.manual_seed(0)
    off = _shard_ours(Net(), mesh, offload_policy=fusedist.CPUOffloadPolicy())
    torch.manual_seed(0)
    on = _shard_ours(Net(), mesh)
    for model in (off, on):
        o = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            _step(model, o, rank, step)
    a, b = fusedist.fsdp.full_state_dict(off), fusedist.fsdp.full_state_dict(on)
    out["offload"] = all(torch.equal(a[k], b[k]) for k in a)

    # built on meta, materialized, loaded: the sections keep their dtypes
    with torch.device("meta"):
        torch.manual_seed(0)
        meta = Net()
    _shard_ours(meta, mesh)
    meta.to_empty(device="cpu")
    fusedist.fsdp.load_full_state_dict(meta, trained)
    got = fusedist.fsdp.full_state_dict(meta)
    out["meta"] = all(torch.equal(got[k], trained[k]) and got[k].dtype == trained[k].dtype for k in trained)
    x, y = _batch(rank, 0)
    F.mse_loss(meta(x), y).backward()
    out["meta grads"] = sorted({str(p.grad.dtype) for p in meta.parameters() if p.grad is not None})
    # model.float() after sharding: every section becomes fp32, values kept
    meta.float()
    got = fusedist.fsdp.full_state_dict(meta)
    out["float"] = all(got[k].dtype == torch.float32 and torch.equal(got[k], trained[k].float()) for k in trained)
    meta.zero_grad()
    F.mse_loss(meta(x), y).backward()
    out["float grads"] = sorted({str(p.grad.dtype) for p in meta.parameters() if p.grad is not None})
    return out


def test_mixed_dtype_units_checkpoint_interchange(at_2):
    for res in results_of(at_2, "checkpoints"):
        assert res["dtypes"]["blocks.0.norm.weight"] == "torch.float32"
        assert res["dtypes"]["blocks.0.router.weight"] == "torch.float32"
        assert res["dtypes"]["blocks.0.fc1.weight"] == "torch.bfloat16"
        assert res["sd_dtypes"] == res["dtypes"]
        assert res["optim dtypes"]["blocks.0.fc1.weight.exp_avg"] == "torch.bfloat16"
        assert res["optim dtypes"]["blocks.0.norm.weight.exp_avg"] == "torch.float32"
        for key in ("optim", "dcp to fsdp2", "dcp from fsdp2", "full", "checkpoint", "offload", "meta"):
            assert res[key] is True, (key, res)
        assert res["meta grads"] == ["torch.bfloat16", "torch.float32"]
        assert res["float"] is True and res["float grads"] == ["torch.float32"], res


def _world3(rank, ws, directory):
    """One backward per policy at world size 3 (uneven pieces): the gradients. Without a policy
    the bf16 gradients are summed in bf16, and three ranks' sums round their partial sums in
    another order than FSDP2's: two roundings of half an ulp of values up to the largest
    gradient, hence ``atol = 2**-6 * max |grad|`` for those (fp32 sums: ``rtol=1e-5``). No
    training: AdamW's first steps (about ``lr * sign(grad)``) would turn such a rounding of a
    near-zero gradient into a whole ``lr`` step."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    mesh = _mesh(ws)
    for mp in ({}, dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)):
        torch.manual_seed(0)
        ref = Net(d=20)
        ours = copy.deepcopy(ref)
        _shard_torch(ref, mesh, split=True, **({"mp_policy": TorchMP(**mp)} if mp else {}))
        _shard_ours(ours, mesh, **({"mp_policy": fusedist.MixedPrecisionPolicy(**mp)} if mp else {}))
        for model in (ref, ours):
            x, y = _batch(rank, 0)
            F.mse_loss(model(x), y).backward()
        _check_grads(ref, ours, f"world 3 {mp}", bf16_sum=not mp)
    return True


def test_mixed_dtype_units_world_3(at_3):
    assert results_of(at_3, "world 3") == [True] * 3


def _dtype_differs(rank, ws):
    torch.manual_seed(0)
    model = Net()
    if rank == 1:  # this rank loaded the routers in bf16: other sections, other collectives
        for b in model.blocks:
            b.router.to(torch.bfloat16)
    _shard_ours(model, _mesh(ws))
    model(_batch(rank, 0)[0])


def _model_dtype_differs(rank, ws):
    import fusedist

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    if rank == 1:  # this rank loaded the whole model in float64: one dtype per unit, another one
        model.double()
    fusedist.fully_shard(model[0])
    fusedist.fully_shard(model)
    model(torch.randn(3, 8, dtype=model[0].weight.dtype))


def test_a_model_of_another_dtype_on_one_rank_fails_on_every_rank_without_hanging(at_2):
    """A unit of one dtype was compared without it: a rank that loaded the model in float64
    waited in its first all-gather until the timeout (a StallError, not the mismatch)."""
    for status, text in results_of(at_2, "model dtype differs"):
        assert status == "error"
        assert "RankMismatchError" in text and "fully_shard wrapping of the model differs across ranks" in text, text
        assert "the root module [2.weight (float32) (4, 8)" in text and "2.weight (float64)" in text, text


def test_dtypes_differing_across_ranks_fail_on_every_rank_without_hanging(at_2):
    for status, text in results_of(at_2, "dtype differs"):
        assert status == "error"
        assert "RankMismatchError" in text and "fully_shard wrapping of the model differs across ranks" in text, text
        assert "router.weight (float32)" in text or "router.weight (bfloat16)" in text, text


def test_sections_per_trainable_flag_and_dtype():
    from fusedist.fsdp.layout import SplitLayout

    bf, f32 = torch.bfloat16, torch.float32
    shapes = [(6, 4), (4,), (3, 4), (6, 4), (5,)]
    layout = SplitLayout(shapes, [True, True, True, False, False], 2, [bf, f32, bf, bf, f32])
    assert layout.mixed
    assert [(s.trainable, s.dtype, s.indices) for s in layout.sections] == [
        (True, bf, (0, 2)), (True, f32, (1,)), (False, bf, (3,)), (False, f32, (4,))]
    for i, shape in enumerate(shapes):  # every parameter whole across the ranks' pieces
        assert sum(layout.piece(i, r).numel for r in range(2)) == torch.Size(shape).numel()
    one = SplitLayout(shapes, [True, True, True, False, False], 2, [bf] * 5)
    assert not one.mixed and [(s.trainable, s.dtype) for s in one.sections] == [(True, None), (False, None)]


# ---------------------------------------------------------------------------- the launches
def _raised(rank, ws, fn, *args):
    """``fn``'s error on this rank as ("error", its type and text), or ("returned", None): the
    mismatch scenarios raise on every rank, and the launch goes on to the next scenario."""
    try:
        fn(rank, ws, *args)
    except Exception as e:  # noqa: BLE001 - the test reads which error
        return "error", f"{type(e).__name__}: {e}"
    return "returned", None


@pytest.fixture(scope="module")
def at_2(request, tmp_path_factory):
    """World 2 in one launch, the mismatches last (a rank that waited in a collective its peer
    never posts fails within the 30 s timeout)."""
    return launch_phase(request, {
        "test_mixed_dtype_units_train_like_fsdp2": {"parity": (_parity, (None,))},
        "test_mixed_dtype_units_checkpoint_interchange": {
            "checkpoints": (_checkpoints, (str(tmp_path_factory.mktemp("mixed-dtypes")),))},
        "test_a_model_of_another_dtype_on_one_rank_fails_on_every_rank_without_hanging": {
            "model dtype differs": (under_env, ({"FUSEDIST_TIMEOUT_S": "30"}, _raised, _model_dtype_differs))},
        "test_dtypes_differing_across_ranks_fail_on_every_rank_without_hanging": {
            "dtype differs": (under_env, ({"FUSEDIST_TIMEOUT_S": "30"}, _raised, _dtype_differs))},
    }, 2, timeout=300)


@pytest.fixture(scope="module")
def at_3(request):
    return launch_phase(request, {"test_mixed_dtype_units_world_3": {"world 3": (_world3, (None,))}}, 3, timeout=240)
