"""fusedist.amp.GradScaler against torch.amp.GradScaler("cpu") on recipes the other scaler
tests do not cover: several optimizers sharing one scaler, half-precision weights with FP32
masters overflowing for real, scaler states traded with torch's mid-training, settings torch
accepts but cannot train with, ZeRO with gradient accumulation and an LR scheduler, and
fully_shard with two optimizers and an empty piece.

Loss scales are powers of two, so unscaling is exact and both sides see the same unscaled
gradients; fp32 parameters then agree to fp32 rounding of the optimizer math (1e-6, as in
test_grad_scaler.py), and the scale trajectories agree exactly.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from fusedist.amp import GradScaler
from fusedist.optim import FusedAdamW
from fusedist.testing import run_distributed

TOL = 1e-6


def _params(shapes=((5,), (3, 7), (4,)), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).requires_grad_() for s in shapes]


def _clone(params):
    return [p.detach().clone().requires_grad_() for p in params]


def _scaled_backward(scaler, params, step, poison=None):
    """loss = sum(p * x); ``poison`` = (param index, value) written into that gradient."""
    gen = torch.Generator().manual_seed(100 + step)
    loss = sum((p * torch.randn(p.shape, generator=gen)).sum() for p in params)
    scaler.scale(loss).backward()
    if poison is not None:
        with torch.no_grad():
            params[poison[0]].grad.view(-1)[0] = poison[1]


def _max_diff(a, b):
    return max((x.detach().float() - y.detach().float()).abs().max().item() for x, y in zip(a, b))


# -------------------------------------------------------------- several optimizers, one scaler
@pytest.mark.parametrize("unscale", [False, True], ids=["step only", "unscale_ first"])
def test_two_optimizers_share_one_scaler_like_torch(unscale):
    """A fused and a torch optimizer on one scaler: each skips on its own found-inf, update()
    backs off on either's; an optimizer left out of a step (and, after unscale_, one unscaled
    but not stepped) still counts in update(), as with torch."""
    poison = {1: (0, float("inf")), 4: (2, float("nan"))}  # A's gradient, then B's
    ours, theirs = _params(), None
    theirs = _clone(ours)
    a, b = FusedAdamW(ours[:2], lr=1e-2, weight_decay=0.1), torch.optim.SGD(ours[2:], lr=0.1, momentum=0.9)
    ra, rb = torch.optim.AdamW(theirs[:2], lr=1e-2, weight_decay=0.1), torch.optim.SGD(theirs[2:], lr=0.1, momentum=0.9)
    kw = dict(init_scale=2.0 ** 8, growth_interval=2)
    sc, rsc = GradScaler("cpu", **kw), torch.amp.GradScaler("cpu", **kw)
    skipped = []
    for step in range(9):
        for s, ps, oa, ob in ((sc, ours, a, b), (rsc, theirs, ra, rb)):
            oa.zero_grad()
            ob.zero_grad()
            _scaled_backward(s, ps, step, poison.get(step))
            if unscale:
                s.unscale_(oa)
                s.unscale_(ob)
            if step != 6 or not unscale:  # step 6: A unscaled, then left out
                s.step(oa)
            if step != 5:  # step 5: B left out
                s.step(ob)
            s.update()
        assert sc.get_scale() == rsc.get_scale(), step
        assert sc._get_growth_tracker() == rsc._get_growth_tracker(), step
        skipped.append(sc.last_step_skipped)
        assert _max_diff(ours, theirs) < TOL, step
    assert skipped == [step in poison for step in range(9)]
    assert a.state[ours[0]]["step"].item() == ra.state[theirs[0]]["step"].item()


# ---------------------------------------------- half weights, FP32 masters, a real fp16 overflow
def _half_run(dtype, unscale, lazy, steps=8):
    """Ours: half parameters, FusedAdamW(master_weights=True). torch's: a half twin for the
    same forward/backward, FP32 masters stepped by torch's AdamW from the half gradients."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) * 0.5 for s in ((16, 8), (4, 16))]
    ours = [t.to(dtype).requires_grad_() for t in init]
    twin = [t.to(dtype).requires_grad_() for t in init]
    masters = [t.to(dtype).float().requires_grad_() for t in init]
    opt = FusedAdamW(ours, lr=1e-2, weight_decay=0.01, master_weights=True)
    ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.01)
    kw = dict(init_scale=2.0 ** 20, growth_interval=2)  # 2**20 overflows fp16 gradients
    sc, rsc = GradScaler("cpu", lazy_unscale=lazy, **kw), torch.amp.GradScaler("cpu", **kw)
    scales = []
    for step in range(steps):
        x = torch.randn(5, 8, generator=gen).to(dtype)
        for ps, s in ((ours, sc), (twin, rsc)):
            loss = (torch.tanh(x @ ps[0].t()) @ ps[1].t()).float().square().mean() * 8
            s.scale(loss).backward()
        for m, t in zip(masters, twin):
            m.grad, t.grad = t.grad.float(), None
        if unscale:
            sc.unscale_(opt)
        rsc.unscale_(ref)
        sc.step(opt)
        rsc.step(ref)
        sc.update()
        rsc.update()
        opt.zero_grad()
        with torch.no_grad():
            for t, m in zip(twin, masters):
                t.copy_(m)
        assert sc.get_scale() == rsc.get_scale(), step
        scales.append(sc.get_scale())
        for p, m in zip(ours, masters):
            if p in opt.state:
                torch.testing.assert_close(opt.state[p]["master_param"], m.detach(), rtol=0, atol=TOL)
            # One ulp of the half type: an fp32 master 1e-6 off may round to the neighbour.
            torch.testing.assert_close(p.detach().float(), m.detach().to(dtype).float(),
                                       rtol=torch.finfo(dtype).eps, atol=0)
    return scales


@pytest.mark.parametrize("dtype,unscale,lazy", [
    (torch.float16, False, False), (torch.float16, True, True),
    (torch.bfloat16, False, False), (torch.bfloat16, True, False), (torch.bfloat16, True, True)],
    ids=["fp16 step only", "fp16 lazy unscale_", "bf16 step only", "bf16 unscale_", "bf16 lazy unscale_"])
def test_half_weights_with_fp32_masters_follow_torch(dtype, unscale, lazy):
    scales = _half_run(dtype, unscale, lazy)
    if dtype == torch.float16:  # the gradients overflowed for real: the scale backed off
        assert min(scales) < 2.0 ** 20 / 4, scales
    else:
        assert scales[-1] > 2.0 ** 20, scales


def test_fp16_gradients_unscaled_in_place_are_refused_by_name():
    p = torch.randn(4, dtype=torch.float16, requires_grad=True)
    opt = FusedAdamW([p], master_weights=True)
    sc = GradScaler("cpu")
    sc.scale(p.float().sum()).backward()
    with pytest.raises(ValueError, match="float16 gradients.*lazy_unscale=True"):
        sc.unscale_(opt)


# -------------------------------------------------------------- scaler states traded with torch
@pytest.mark.parametrize("ours_kw", [{}, {"min_scale": 1.0}], ids=["torch's kernel", "tensor-op update"])
def test_scaler_states_traded_with_torch_mid_training(ours_kw):
    """At step 4 each side loads the other's state into a fresh scaler of the other kind; the
    trajectories carry on as if nothing had happened (torch's rule on both sides; a floor
    that is never reached leaves it unchanged)."""
    poison = {2: (1, float("inf")), 6: (1, float("nan")), 7: (0, float("inf"))}
    ours = _params()
    theirs = _clone(ours)
    o, r = FusedAdamW(ours, lr=1e-2), torch.optim.AdamW(theirs, lr=1e-2)
    kw = dict(init_scale=2.0 ** 6, growth_interval=3)
    sc, rsc = GradScaler("cpu", **kw), torch.amp.GradScaler("cpu", **kw)
    for step in range(10):
        for s, ps, opt in ((sc, ours, o), (rsc, theirs, r)):
            opt.zero_grad()
            _scaled_backward(s, ps, step, poison.get(step))
            s.step(opt)
            s.update()
        if step == 4:
            mine, torchs = sc.state_dict(), rsc.state_dict()
            sc = GradScaler("cpu", **ours_kw)
            sc.load_state_dict(torchs)  # keeps this scaler's min_scale
            rsc = torch.amp.GradScaler("cpu")
            rsc.load_state_dict(mine)
        assert (sc.get_scale(), sc._get_growth_tracker()) == (rsc.get_scale(), rsc._get_growth_tracker()), step
        assert _max_diff(ours, theirs) < TOL, step
    assert sc.state_dict()["min_scale"] == ours_kw.get("min_scale")


# ------------------------------------------------- settings torch accepts but cannot train with
@pytest.mark.parametrize("kw,says", [
    (dict(init_scale=0.0), "init_scale must be a finite number > 0, got 0.0"),
    (dict(init_scale=-1024.0), "init_scale must be a finite number > 0"),
    (dict(init_scale=float("inf")), "init_scale must be a finite number > 0"),
    (dict(backoff_factor=0.0), "backoff_factor must be a number > 0, got 0.0"),
    (dict(backoff_factor=-0.5), "backoff_factor must be a number > 0"),
    (dict(growth_factor=float("inf")), "growth_factor must be a finite number, got inf"),
    (dict(growth_interval=0), "growth_interval must be an integer >= 1, got 0"),
    (dict(growth_interval=-5), "growth_interval must be an integer >= 1"),
    (dict(growth_interval=2.5), "growth_interval must be an integer >= 1, got 2.5"),
])
def test_settings_torch_accepts_but_cannot_train_with_are_refused(kw, says):
    """torch's scaler takes these silently: a scale of 0 never trains (every step skipped),
    a backoff <= 0 drives the scale to 0 or below after one overflow, growth_interval <= 0
    never grows (2.5 fails at the first update(), deep in the kernel)."""
    with pytest.raises(ValueError, match=f"^GradScaler: {says}"):
        GradScaler("cpu", **kw)
    GradScaler("cpu", enabled=False, **kw)  # ignored when disabled, as torch's checks are
    state = GradScaler("cpu").state_dict()
    state.update({("scale" if k == "init_scale" else k): v for k, v in kw.items()})
    target = GradScaler("cpu", init_scale=8.0)
    with pytest.raises(ValueError, match="^GradScaler.load_state_dict: " + says.replace("init_scale", "scale")):
        target.load_state_dict(state)
    assert target.state_dict() == GradScaler("cpu", init_scale=8.0).state_dict()


def test_a_foreign_state_dict_is_refused_before_anything_loads():
    """torch's load sets the scale, then fails on a later missing key, half-loaded."""
    target = GradScaler("cpu", init_scale=8.0)
    before = target.state_dict()
    with pytest.raises(KeyError, match=r"lacks \['growth_interval', '_growth_tracker'\]"):
        target.load_state_dict({"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5})
    assert target.state_dict() == before
    with pytest.raises(ValueError, match="hysteresis must be an integer >= 1, got 0"):
        target.load_state_dict({**before, "hysteresis": 0})
    assert target.state_dict() == before


@pytest.mark.parametrize("ours_kw,overflow", [(dict(min_scale=1.0), 3), (dict(hysteresis=2), None)],
                         ids=["min_scale", "hysteresis"])
def test_a_growth_count_loaded_beyond_the_interval_grows_as_torch(ours_kw, overflow):
    """A checkpoint's growth count at or past a (smaller) resumed growth_interval: torch's
    kernel grows only when the count hits the interval exactly, so it never grows again. The
    tensor-op update (min_scale / hysteresis) grew at once, leaving torch's trajectory."""
    state = dict(scale=8.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3, _growth_tracker=4)
    got = []
    for s in (torch.amp.GradScaler("cpu"), GradScaler("cpu", **ours_kw)):
        s.load_state_dict(state)
        p = torch.zeros(2, requires_grad=True)
        opt = torch.optim.SGD([p], lr=0.1)
        trajectory = []
        for step in range(5):
            opt.zero_grad()
            s.scale(p.sum() * (float("inf") if step == overflow else 1.0)).backward()
            s.step(opt)
            s.update()
            trajectory.append((s.get_scale(), s._get_growth_tracker()))
        got.append(trajectory)
    assert got[0] == got[1]


# ------------------------------------------------------------------------- ZeRO, two gloo ranks
class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _zero_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _zero_worker(rank, ws):
    """Three micro-batches per step (no_sync on the first two), growth_interval=1, an inf in
    rank 1's loss on steps 0 and 3 (the reduction carries it to both ranks), a LambdaLR
    stepped after each step: against torch DDP + AdamW + torch's scaler."""
    import fusedist

    out = {}
    base = _zero_net()
    for stage in (1, 2):
        for inner in ("torch", "fused"):
            runs = {}
            for who in ("ours", "torch"):
                kw = dict(init_scale=2.0 ** 8, growth_interval=1)
                if who == "ours":
                    m = fusedist.DistributedDataParallel(copy.deepcopy(base))
                    cls = FusedAdamW if inner == "fused" else torch.optim.AdamW
                    o = fusedist.ZeroRedundancyOptimizer(m.parameters(), cls, stage=stage, lr=0.05)
                    s = GradScaler("cpu", **kw)
                else:
                    m = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
                    o, s = torch.optim.AdamW(m.parameters(), lr=0.05), torch.amp.GradScaler("cpu", **kw)
                sched = torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e))
                scales = []
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    for step in range(5):
                        o.zero_grad()
                        for mb in range(3):
                            g = torch.Generator().manual_seed(100 * step + 10 * mb + rank)
                            x = torch.randn(4, 6, generator=g)
                            bad = float("inf") if step in (0, 3) and rank == 1 and mb == 2 else 1.0
                            with (m.no_sync() if mb < 2 else _Null()):
                                s.scale(m(x).square().sum() * bad).backward()
                        s.step(o)
                        s.update()
                        sched.step()
                        scales.append(s.get_scale())
                warned = sorted({str(w.message)[:40] for w in caught if "lr_scheduler" in str(w.message)})
                runs[who] = (scales, warned, [p.detach().clone() for p in m.parameters()])
            out[(stage, inner)] = (runs["ours"][:2], runs["torch"][:2], _max_diff(runs["ours"][2], runs["torch"][2]))
    return out


def test_zero_accumulation_one_rank_overflow_and_scheduler_like_torch():
    for out in run_distributed(_zero_worker, 2, timeout=240):
        for key, (ours, theirs, diff) in out.items():
            assert ours == theirs, key
            assert theirs[0] == [128.0, 256.0, 512.0, 256.0, 512.0], key  # skipped: steps 0 and 3
            assert theirs[1], key  # the first step was skipped: torch's scheduler warned
            assert diff < TOL, (key, diff)


# ------------------------------------------------------------------- fully_shard, two gloo ranks
class _Gained(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.gain = nn.Parameter(torch.ones(1))  # one element: rank 1's piece is empty

    def forward(self, x):
        return self.lin(x) * self.gain


def _fully_shard_worker(rank, ws):
    """Two optimizers (FusedAdamW on the Linear, torch's SGD on the gain) and one scaler over
    fully_shard pieces; an inf written into rank 0's piece of the gain's gradient only. Both
    ranks must skip the SGD step together and back off; reference: the unsharded model on
    the global batch (the mean of the ranks' gradients) with torch's optimizers and scaler."""
    import fusedist
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    ref = _Gained()
    ours = copy.deepcopy(ref)
    fusedist.fully_shard(ours, mesh=init_device_mesh("cpu", (ws,)))
    opts = [FusedAdamW([ours.lin.weight, ours.lin.bias], lr=1e-2), torch.optim.SGD([ours.gain], lr=0.1, momentum=0.9)]
    refs = [torch.optim.AdamW([ref.lin.weight, ref.lin.bias], lr=1e-2),
            torch.optim.SGD([ref.gain], lr=0.1, momentum=0.9)]
    kw = dict(init_scale=2.0 ** 8, growth_interval=1)
    sc, rsc = GradScaler("cpu", **kw), torch.amp.GradScaler("cpu", **kw)
    got, want = [], []
    for step in range(5):
        xs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(ws)]
        sc.scale(ours(xs[rank]).square().sum()).backward()
        rsc.scale(sum(ref(x).square().sum() for x in xs) / ws).backward()
        if step == 2:
            if ours.gain.grad.numel():
                ours.gain.grad.view(-1)[0] = float("inf")
            ref.gain.grad.view(-1)[0] = float("inf")
        for s, os_ in ((sc, opts), (rsc, refs)):
            for o in os_:
                s.unscale_(o)
            for o in os_:
                s.step(o)
            s.update()
            for o in os_:
                o.zero_grad()
        got.append(sc.get_scale())
        want.append(rsc.get_scale())
    full = fusedist.fsdp.full_state_dict(ours)
    diff = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return got, want, diff


def test_fully_shard_two_optimizers_and_an_empty_piece_skip_together():
    results = run_distributed(_fully_shard_worker, 2, timeout=180)
    for got, want, diff in results:
        assert got == want, (got, want)
        assert want[2] < want[1], want  # step 2 overflowed: backoff
        assert diff < TOL, diff


# --------------------------------------------------------------------------- choose_precision
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_choose_precision_for_an_absent_gpu_names_the_device():
    from fusedist.amp import choose_precision

    with pytest.raises(RuntimeError, match=r"choose_precision: the device cuda:0 is not available"):
        choose_precision("cuda:0")
    assert choose_precision("cuda", choice="bf16").name == "bf16"  # an explicit choice needs no probe
