"""fusedist.amp.GradScaler against torch.amp.GradScaler, the fused protocol, and the extras
(hysteresis, min_scale, skip signal), plus fusedist.clip_grad_norm_.

Scales are powers of two, so scaling/unscaling is exact and the fused path (which multiplies by
inv_scale inside the update) sees bit-identical unscaled gradients; parameters then agree to fp32
rounding of the optimizer math (1e-6 absolute, as in test_optim.py).
"""

from __future__ import annotations

import math
import pickle
import warnings

import pytest
import torch

import fusedist
from fusedist.amp import GradScaler
from fusedist.optim import FusedAdamW, FusedSGD, clip_grad_norm_

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
SHAPES = [(5,), (3, 7), (1,)]


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(DEVICE).requires_grad_() for s in SHAPES]


def _clone(params):
    return [p.detach().clone().requires_grad_() for p in params]


def _backward(scaler, params, step, inject=None):
    """loss = sum(p * x): grad = x * scale. ``inject`` puts inf/nan in one gradient element."""
    gen = torch.Generator().manual_seed(100 + step)
    loss = sum((p * torch.randn(p.shape, generator=gen).to(DEVICE)).sum() for p in params)
    scaler.scale(loss).backward()
    if inject is not None:
        with torch.no_grad():
            params[1].grad.view(-1)[4] = inject


OVERFLOWS = {2: float("inf"), 3: float("nan"), 9: float("inf")}


def _run_pair(make_ours, make_theirs, clip, steps=14, scaler_kwargs=None, lazy_unscale=False, clip_api="fusedist"):
    """``clip_api="torch"``: our side clips with torch.nn.utils.clip_grad_norm_ too -- the
    loop torch documents for AMP, which must see unscaled gradients after unscale_ (Note
    [lazy unscale]); then p.grad is compared with torch's after unscale_ as well."""
    scaler_kwargs = scaler_kwargs or dict(init_scale=2.0**10, growth_interval=3)
    ours_p, theirs_p = _params(), None
    theirs_p = _clone(ours_p)
    ours_opt, theirs_opt = make_ours(ours_p), make_theirs(theirs_p)
    ours_sc = GradScaler(DEVICE.type, lazy_unscale=lazy_unscale, **scaler_kwargs)
    theirs_sc = torch.amp.GradScaler(DEVICE.type, **scaler_kwargs)
    for step in range(steps):
        inject = OVERFLOWS.get(step)
        for sc, ps, opt in ((ours_sc, ours_p, ours_opt), (theirs_sc, theirs_p, theirs_opt)):
            opt.zero_grad()
            _backward(sc, ps, step, inject)
        if clip:
            ours_sc.unscale_(ours_opt)
            theirs_sc.unscale_(theirs_opt)
            if not lazy_unscale:
                for a, b in zip(ours_p, theirs_p):  # unscaled in place, as torch's unscale_ does
                    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, equal_nan=True)
            clip_ours = torch.nn.utils.clip_grad_norm_ if clip_api == "torch" else clip_grad_norm_
            n_ours = clip_ours(ours_p, 0.5)
            n_theirs = torch.nn.utils.clip_grad_norm_(theirs_p, 0.5)
            torch.testing.assert_close(n_ours, n_theirs, rtol=1e-6, atol=0, equal_nan=True)
        before = [p.detach().clone() for p in ours_p]
        ours_sc.step(ours_opt)
        theirs_sc.step(theirs_opt)
        ours_sc.update()
        theirs_sc.update()
        assert ours_sc.get_scale() == theirs_sc.get_scale(), f"step {step}"
        assert ours_sc._get_growth_tracker() == theirs_sc._get_growth_tracker()
        skipped = step in OVERFLOWS
        assert ours_sc.last_step_skipped == skipped
        if skipped:
            for p, b in zip(ours_p, before):
                assert torch.equal(p.detach(), b)
        for a, b in zip(ours_p, theirs_p):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)
    return ours_opt, theirs_opt


@pytest.mark.parametrize("clip,lazy_unscale,clip_api", [
    (False, False, None), (True, False, "fusedist"), (True, True, "fusedist"), (True, False, "torch")],
    ids=["no clip", "fusedist clip", "lazy unscale, fusedist clip", "torch clip_grad_norm_"])
def test_fused_optimizer_matches_torch_scaler_with_overflows(clip, lazy_unscale, clip_api):
    ours, theirs = _run_pair(lambda ps: FusedAdamW(ps, lr=1e-2, weight_decay=0.1),
                             lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), clip,
                             lazy_unscale=lazy_unscale, clip_api=clip_api)
    # Skipped steps do not count: same step number as torch's (which never ran those steps).
    p_ours, p_theirs = ours.param_groups[0]["params"][0], theirs.param_groups[0]["params"][0]
    assert ours.state[p_ours]["step"].item() == theirs.state[p_theirs]["step"].item() == 14 - len(OVERFLOWS)


def test_fused_sgd_matches_torch_scaler_with_overflows():
    # Overflow on the very first step: momentum buffers must still start from the first real grad.
    global OVERFLOWS
    saved, OVERFLOWS = OVERFLOWS, {0: float("inf"), 5: float("nan")}
    try:
        _run_pair(lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9),
                  lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), clip=True, steps=8)
    finally:
        OVERFLOWS = saved


@pytest.mark.parametrize("clip", [False, True])
def test_plain_torch_optimizer_behaves_like_torch(clip):
    _run_pair(lambda ps: torch.optim.AdamW(ps, lr=1e-2), lambda ps: torch.optim.AdamW(ps, lr=1e-2), clip)


def test_gradients_written_after_unscale_are_measured_afresh():
    """Note [gradients changed after unscale_]: with the default (in-place) unscale_, code may
    write p.grad before clipping, as with torch; fusedist's clip then measures what is there
    instead of the norm recorded by unscale_."""
    ours_p = _params()
    theirs_p = _clone(ours_p)
    ours_opt, theirs_opt = FusedAdamW(ours_p, lr=1e-2), torch.optim.AdamW(theirs_p, lr=1e-2)
    ours_sc, theirs_sc = GradScaler(DEVICE.type, init_scale=4.0), torch.amp.GradScaler(DEVICE.type, init_scale=4.0)
    for sc, ps, opt in ((ours_sc, ours_p, ours_opt), (theirs_sc, theirs_p, theirs_opt)):
        _backward(sc, ps, 0)
        sc.unscale_(opt)
        with torch.no_grad():
            ps[1].grad.mul_(3.0)  # e.g. a per-layer gradient multiplier
    n_ours = clip_grad_norm_(ours_p, 0.5)
    n_theirs = torch.nn.utils.clip_grad_norm_(theirs_p, 0.5)
    torch.testing.assert_close(n_ours, n_theirs, rtol=1e-6, atol=0)
    ours_sc.step(ours_opt)
    theirs_sc.step(theirs_opt)
    for a, b in zip(ours_p, theirs_p):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("writer", ["torch clip_grad_norm_", "hand-written"])
def test_lazy_unscale_refuses_gradients_written_while_scaled(writer):
    """lazy_unscale=True leaves scaled values in p.grad; a write to them (torch's clip measures
    a norm 'scale' times too large) is refused before any parameter changes."""
    params = _params()
    opt = FusedAdamW(params, lr=1e-2)
    scaler = GradScaler(DEVICE.type, init_scale=2.0**8, lazy_unscale=True)
    _backward(scaler, params, 0)
    scaler.unscale_(opt)
    before = [p.detach().clone() for p in params]
    if writer == "torch clip_grad_norm_":
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        with pytest.raises(RuntimeError, match=r"written after GradScaler\(lazy_unscale=True\).unscale_"):
            scaler.step(opt)
    else:
        with torch.no_grad():
            params[0].grad.add_(1.0)
        with pytest.raises(RuntimeError, match="fusedist.clip_grad_norm_"):
            clip_grad_norm_(params, 1.0)
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)


def test_lazy_unscale_does_not_write_gradients():
    """lazy_unscale=True: after unscale_ + clip + step the gradients still hold scaled values."""
    params = _params()
    opt = FusedAdamW(params, lr=1e-2)
    scaler = GradScaler(DEVICE.type, init_scale=2.0**8, lazy_unscale=True)
    _backward(scaler, params, 0)
    scaled = [p.grad.clone() for p in params]
    scaler.unscale_(opt)
    assert opt.step_context.inv_scale is not None and opt.found_inf is None
    fusedist.clip_grad_norm_(params, 1e-3)
    assert opt.step_context.clip_coef is not None
    scaler.step(opt)
    for p, g in zip(params, scaled):
        assert torch.equal(p.grad, g)
    # The protocol attributes are consumed by the step.
    assert opt.grad_scale is None and opt.found_inf is None and opt.step_context.clip_coef is None
    scaler.update()


def test_clip_on_a_subset_falls_back_to_torch_numerics():
    ours_p = _params()
    theirs_p = _clone(ours_p)
    ours_opt, theirs_opt = FusedAdamW(ours_p, lr=1e-2), torch.optim.AdamW(theirs_p, lr=1e-2)
    ours_sc, theirs_sc = GradScaler(DEVICE.type, init_scale=4.0), torch.amp.GradScaler(DEVICE.type, init_scale=4.0)
    for sc, ps in ((ours_sc, ours_p), (theirs_sc, theirs_p)):
        _backward(sc, ps, 0)
    ours_sc.unscale_(ours_opt)
    theirs_sc.unscale_(theirs_opt)
    # A subset (and then an inf-norm) cannot use the recorded norm: gradients get unscaled for real.
    n1 = clip_grad_norm_(ours_p[:2], 0.3)
    t1 = torch.nn.utils.clip_grad_norm_(theirs_p[:2], 0.3)
    n2 = clip_grad_norm_(ours_p, 0.2, norm_type=float("inf"))
    t2 = torch.nn.utils.clip_grad_norm_(theirs_p, 0.2, norm_type=float("inf"))
    assert torch.equal(n1, t1) and torch.equal(n2, t2)
    for a, b in zip(ours_p, theirs_p):
        assert torch.equal(a.grad, b.grad)
    ours_sc.step(ours_opt)
    theirs_sc.step(theirs_opt)
    for a, b in zip(ours_p, theirs_p):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)


def test_clip_without_scaler_is_torch():
    ours_p = _params()
    theirs_p = _clone(ours_p)
    for ps in (ours_p, theirs_p):
        sum((p * p).sum() for p in ps).backward()
    assert torch.equal(clip_grad_norm_(ours_p, 0.1), torch.nn.utils.clip_grad_norm_(theirs_p, 0.1))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours_p, theirs_p))
    assert fusedist.clip_grad_norm_ is clip_grad_norm_


def test_clip_error_if_nonfinite_on_fast_path():
    params = _params()
    opt = FusedAdamW(params)
    scaler = GradScaler(DEVICE.type)
    _backward(scaler, params, 0, inject=float("inf"))
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(params, 1.0, error_if_nonfinite=True)


def _drive(scaler, overflow_pattern, opt_factory=lambda ps: FusedSGD(ps, lr=0.1)):
    params = _params()
    opt = opt_factory(params)
    scales, skipped = [], []
    for step, overflow in enumerate(overflow_pattern):
        opt.zero_grad()
        _backward(scaler, params, step, float("inf") if overflow else None)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(bool(scaler.last_step_skipped_tensor.item()))
    return scales, skipped


def test_hysteresis_delays_backoff_for_consecutive_overflows():
    scaler = GradScaler(DEVICE.type, init_scale=1024.0, growth_interval=100, hysteresis=2)
    pattern = [True, False, True, True, True, False, True]
    scales, skipped = _drive(scaler, pattern)
    # 1st overflow tolerated; a finite step resets; 2nd consecutive backs off, and every
    # further one until a finite step.
    assert scales == [1024, 1024, 1024, 512, 256, 256, 256]
    assert skipped == pattern


def test_skip_flag_read_late_reports_the_last_update():
    """The flag is compared on first read (Note [the skip flag on demand]): read after the next
    iteration's unscale_ found the opposite, it still reports the iteration update() closed,
    and update() leaves the found-inf flag the step used as it was."""
    scaler = GradScaler(DEVICE.type, init_scale=1024.0, growth_interval=100)
    params = _params()
    opt = FusedAdamW(params, lr=0.1)
    for step, overflow in enumerate([True, False, True]):
        opt.zero_grad()
        _backward(scaler, params, step, float("inf") if overflow else None)
        scaler.unscale_(opt)
        flag = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"][scaler._scale.device]
        scaler.step(opt)
        scaler.update()
        assert float(flag) == float(overflow), step  # update() did not write it
        opt.zero_grad()
        _backward(scaler, params, step + 1, None if overflow else float("inf"))  # the opposite, unread
        scaler.unscale_(opt)
        assert scaler.last_step_skipped is overflow, step
        assert bool(scaler.last_step_skipped_tensor.item()) is overflow, step
        scaler.step(opt)
        scaler.update()
        assert scaler.last_step_skipped is (not overflow), step
    restored = pickle.loads(pickle.dumps(scaler))
    assert restored.last_step_skipped_tensor is None and not restored.last_step_skipped


def test_explicit_new_scale_restarts_hysteresis_and_reports_the_step():
    """update(new_scale) sets the scale (as torch's) and starts the hysteresis count afresh:
    the overflows counted before it were at the old scale, so the next one is again
    tolerated; the skip signal describes the iteration that update() closed."""
    scaler = GradScaler(DEVICE.type, init_scale=1024.0, growth_interval=100, hysteresis=2)
    params = _params()
    opt = FusedSGD(params, lr=0.1)
    pattern = [(True, None), (True, 512.0), (True, None), (True, None)]
    scales = []
    for step, (overflow, explicit) in enumerate(pattern):
        opt.zero_grad()
        _backward(scaler, params, step, float("inf") if overflow else None)
        scaler.step(opt)
        scaler.update(explicit)
        assert bool(scaler.last_step_skipped_tensor.item()) == overflow, step
        scales.append(scaler.get_scale())
    # 1st overflow tolerated; the explicit scale; then a fresh count: one tolerated, then backoff.
    assert scales == [1024.0, 512.0, 512.0, 256.0]


def test_hysteresis_one_and_floor_match_torch_trajectory():
    """The tensor-op update path (used with min_scale) equals torch's kernel when the floor is
    not reached."""
    pattern = [False, True, False, False, False, True, True, False, False, False, False]
    ours = GradScaler(DEVICE.type, init_scale=2.0**10, growth_interval=3, min_scale=1.0)
    theirs = GradScaler(DEVICE.type, init_scale=2.0**10, growth_interval=3)  # torch's kernel
    assert _drive(ours, pattern) == _drive(theirs, pattern)


def test_min_scale_warn_policy():
    scaler = GradScaler(DEVICE.type, init_scale=4.0, min_scale=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scales, skipped = _drive(scaler, [True] * 5)
    assert scales == [2, 1, 1, 1, 1]
    assert all(skipped)
    assert any("min_scale=1.0" in str(w.message) for w in caught)


def test_min_scale_raise_policy():
    scaler = GradScaler(DEVICE.type, init_scale=2.0, min_scale=1.0, min_scale_policy="raise")
    with pytest.raises(RuntimeError, match="min_scale=1.0"):
        _drive(scaler, [True] * 3)


def test_constructor_errors():
    with pytest.raises(ValueError, match="hysteresis"):
        GradScaler("cpu", hysteresis=0)
    with pytest.raises(ValueError, match="min_scale"):
        GradScaler("cpu", min_scale=-1.0)
    with pytest.raises(ValueError, match="min_scale_policy"):
        GradScaler("cpu", min_scale_policy="ignore")


def test_a_number_where_the_device_goes_is_refused_naming_init_scale():
    """torch.cuda.amp.GradScaler's first argument is init_scale, torch.amp's (and this one's) the
    device: torch.amp's takes ``GradScaler(1024.0)`` silently and keeps the default scale."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.amp.GradScaler(1024.0)._init_scale == 2.0**16  # (torch's, silently)
    for number in (1024.0, 2**14):
        with pytest.raises(TypeError, match=f"torch.cuda.amp.GradScaler's first argument is init_scale: pass "
                                            f"GradScaler\\('cuda', init_scale={number!r}\\)"):
            GradScaler(number)
    for device in ("cpu", torch.device("cpu")):
        assert GradScaler(device, 1024.0).get_scale() == torch.amp.GradScaler("cpu", 1024.0).get_scale() == 1024.0


def test_state_dict_round_trip_and_torch_compat():
    scaler = GradScaler(DEVICE.type, init_scale=64.0, growth_interval=2, hysteresis=3)
    _drive(scaler, [False, True])
    state = scaler.state_dict()
    assert state["_hysteresis_tracker"] == 2 and state["hysteresis"] == 3
    other = GradScaler(DEVICE.type)
    other.load_state_dict(state)
    assert other.state_dict() == state
    restored = pickle.loads(pickle.dumps(scaler))
    assert restored.state_dict() == state
    torch_state = torch.amp.GradScaler(DEVICE.type, init_scale=8.0).state_dict()
    plain = GradScaler(DEVICE.type, hysteresis=2)
    plain.load_state_dict(torch_state)
    assert plain.get_scale() == 8.0 and plain.state_dict()["hysteresis"] == 2


def test_disabled_scaler_is_a_passthrough():
    params = _params()
    opt = FusedAdamW(params, lr=0.1)
    scaler = GradScaler(DEVICE.type, enabled=False)
    _backward(scaler, params, 0)
    before = [p.detach().clone() for p in params]
    scaler.step(opt)
    scaler.update()
    assert not all(torch.equal(p, b) for p, b in zip(params, before))
    assert scaler.get_scale() == 1.0 and not scaler.last_step_skipped


def test_misuse_errors_like_torch():
    params = _params()
    opt = FusedAdamW(params)
    scaler = GradScaler(DEVICE.type)
    _backward(scaler, params, 0)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)


@pytest.mark.gpu
def test_gpu_fused_amp_step_never_syncs():
    params = [torch.randn(s, device="cuda", dtype=torch.bfloat16, requires_grad=True)
              for s in [(1,), (4097,), (300, 300)]]
    opt = FusedAdamW(params, lr=1e-3, master_weights=True)
    scaler = GradScaler("cuda")

    def iteration():
        loss = sum((p.float() * 1.5).sum() for p in params)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = clip_grad_norm_(params, 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return norm

    iteration()  # compile the kernels and upload the chunk tables
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        norm = iteration()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert math.isfinite(norm.item())


# ---- Note [host gradients under a device scaler]
def test_copies_of_the_scale_and_flag_to_the_host_are_blocking():
    """A host kernel reads the scale and sets the flag at once: a non-blocking copy from the GPU
    would land after it (an H200 run: wrong unscaling, a lost inf). Between devices it stays
    asynchronous."""
    from fusedist.amp.unscale import copy_to

    class Spy:  # a GPU tensor, as far as the copy uses it
        def to(self, **kw):
            self.kw = kw
            return self

    host, gpu = Spy(), Spy()
    copy_to(host, torch.device("cpu"))
    copy_to(gpu, torch.device("cuda", 1))
    assert host.kw == dict(device=torch.device("cpu"), non_blocking=False, copy=True)
    assert gpu.kw["non_blocking"] is True and gpu.kw["copy"] is True


@pytest.mark.parametrize("poison", [False, True])
def test_unscaling_by_device_matches_torchs(poison):
    """fusedist's per-device unscale (torch's optimizers) against torch's own: fp32 and bf16
    dense gradients, a sparse fp16 one with duplicate indices, a parameter without a gradient."""
    from torch.amp.grad_scaler import GradScaler as TorchGradScaler

    from fusedist.amp.unscale import unscale_per_device

    def make():
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(5, 3, generator=g).to(dtype))
                  for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float32)]
        params[0].grad = torch.randn(5, 3, generator=g) * 1024
        params[1].grad = (torch.randn(5, 3, generator=g) * 1024).bfloat16()
        values = torch.randn(3, 3, generator=g).half() * 1024  # rows 0, 0 and 4: a duplicate index
        params[2].grad = torch.sparse_coo_tensor(torch.tensor([[0, 0, 4]]), values, (5, 3))
        if poison:
            params[1].grad.view(-1)[7] = float("nan")
        return params, torch.optim.SGD(params, lr=0.1)

    inv_scale = torch.full((1,), 1.0 / 1024)
    ours, ours_opt = make()
    theirs, theirs_opt = make()
    flags = unscale_per_device(ours_opt, inv_scale, torch.zeros(1), allow_fp16=True)
    expected = TorchGradScaler("cpu")._unscale_grads_(theirs_opt, inv_scale, torch.zeros(1), True)
    assert list(flags) == list(expected) == [torch.device("cpu")]
    assert flags[torch.device("cpu")].item() == expected[torch.device("cpu")].item() == float(poison)
    for a, b in zip(ours, theirs):
        if b.grad is None:
            assert a.grad is None
            continue
        da, db = (a.grad.to_dense(), b.grad.to_dense()) if b.grad.is_sparse else (a.grad, b.grad)
        torch.testing.assert_close(da, db, rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        unscale_per_device(make()[1], inv_scale, torch.zeros(1), allow_fp16=False)
