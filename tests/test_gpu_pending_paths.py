"""GPU tier, one process: CUDA paths changed lately whose own tests run on CPU only, each against
torch on CUDA (auto-skipped without a CUDA device; ``benchmarks/gpu/run_checks.sh`` runs them with
the compiled Triton kernels). The multi-rank ones: tests/test_gpu_pending_paths_ws2.py.

* **SyncBatchNorm wider than a CUDA grid's second axis** (Note [channel blocks on the grid's second
  axis] in triton_kernels/syncbn.py): a contiguous ``(N, C, L)`` input with ``C`` = 70001 and a
  long ``L`` asked the elementwise kernels for one program per channel on the grid's second axis,
  which CUDA caps at 65535 (the interpreter has no cap, so only a GPU shows it); channels_last 4-D
  of the same width too. Against ``nn.BatchNorm1d`` / ``nn.BatchNorm2d`` in fp64 on the same input,
  with per-channel means, spreads, weights and biases all different, so a channel block that
  reads another channel's values is off by O(1). Tolerances: fp32 statistics over 4098 (3-D) or
  45 (4-D) values per channel: outputs and input gradients within ``2e-5`` of their largest
  magnitude (tests/test_syncbn.py's CUDA check allows 1e-5 for up to ~2200 values per channel;
  twice that for about twice as many); weight and bias gradients are fp32 sums of 4098 terms,
  of order 60: ``1e-3`` absolute (the same kernels under the interpreter were 2e-5 to 4e-5 off
  at 4200 terms; a channel summed from another block's values is off by O(10)).
* **Direct-NCCL wait timeouts** (Note [wait timeouts] in csrc/cuda/wait_deadline.h): the host wait
  of ``blocking_wait`` (``FUSEDIST_NCCL_BLOCKING_WAIT=1``) turns its timeout into a deadline. An
  infinite timeout, ``timedelta.max``'s seconds and any longer value wait without one (the
  undefined float-to-clock cast gave a deadline in the past: an immediate timeout and an aborted
  communicator); NaN and negative timeouts raise ValueError naming the operation, and leave the
  communicator and the collective alone. ``CommHandle.wait(timeout)`` bounds what it passes by
  the collective's own deadline (Note [one deadline per collective]), and only a wait shorter than
  what is left of that deadline tightens the watchdog's entry (a wait without a timeout or a longer
  one leaves the collective's timeout as launched: the stand-in test in tests/test_comm_watchdog.py,
  here on the real communicator); a ``timedelta`` holds
  no NaN or infinity, so those reach ``NcclComm.wait`` only directly: the test calls it on a
  launched collective's done event. Results are compared with torch's NCCL in the same process.
* **Negated-view gradients on the Triton optimizer path** (Note [lazily negated tensors] in
  fusedist/optim/_negated.py): ``p.grad = torch._neg_view(g)`` (memory ``-g``, value ``g``) and
  ``z.conj().imag`` stepped by ``FusedAdamW`` as ``torch.optim.AdamW`` steps the values, alone
  and under the GradScaler (unscale and inf check on the device, one step with an inf skipped).
  fp32 parameters of order 1, a few steps: ``rtol=1e-5, atol=1e-6`` (as
  tests/test_kernels_gpu_launch.py's AdamW check); stepping the memory is off by ~1e-2.
"""

from __future__ import annotations

import datetime
import math
import random

import pytest
import torch
from torch import nn

import fusedist
from fusedist.testing import run_distributed

pytestmark = pytest.mark.gpu

WIDE_C = 70_001  # > 65535, odd: the last widened channel block is a partial one


def _seed() -> int:
    return random.randrange(2**31)


# ------------------------------------------------------------------ SyncBatchNorm, wide layers
def _wide_input(shape, gen, device):
    """Per-channel means and spreads (mean 0 +- 3, std 0.5 to 1.5), fp32."""
    C = shape[1]
    per_channel = (1, C) + (1,) * (len(shape) - 2)
    mean = (torch.randn(C, generator=gen, device=device) * 3).view(per_channel)
    std = (torch.rand(C, generator=gen, device=device) + 0.5).view(per_channel)
    return torch.randn(shape, generator=gen, device=device) * std + mean


def _syncbn_against_batchnorm(shape, channels_last, device, seed):
    """fusedist's SyncBatchNorm (no process group: the local batch, the same kernels) and
    torch's BatchNorm in fp64 on one input; returns the largest differences, each relative
    to what it is compared with."""
    from fusedist.nn import SyncBatchNorm

    gen = torch.Generator(device=device).manual_seed(seed)
    C = shape[1]
    weight = torch.randn(C, generator=gen, device=device)
    bias = torch.randn(C, generator=gen, device=device)
    x = _wide_input(shape, gen, device)
    dy = torch.randn(shape, generator=gen, device=device)
    if channels_last:
        x, dy = (t.contiguous(memory_format=torch.channels_last) for t in (x, dy))
    ours = SyncBatchNorm(C).to(device)
    ref = (nn.BatchNorm1d if len(shape) == 3 else nn.BatchNorm2d)(C).to(device, torch.float64)
    with torch.no_grad():
        for m in (ours, ref):
            m.weight.copy_(weight)
            m.bias.copy_(bias)
    x = x.requires_grad_(True)
    y = ours(x)
    y.backward(dy)
    x_ref = x.detach().double().requires_grad_(True)
    y_ref = ref(x_ref)
    y_ref.backward(dy.double())

    def rel(a, b):  # the largest difference over the largest magnitude (at least 1)
        return ((a.double() - b).abs().max() / b.abs().max().clamp(min=1.0)).item()

    out = dict(y=rel(y.detach(), y_ref.detach()), dx=rel(x.grad, x_ref.grad),
               dw=(ours.weight.grad.double() - ref.weight.grad).abs().max().item(),
               db=(ours.bias.grad.double() - ref.bias.grad).abs().max().item(),
               running_mean=rel(ours.running_mean, ref.running_mean),
               running_var=rel(ours.running_var, ref.running_var),
               out_format=y.is_contiguous(memory_format=torch.channels_last) if channels_last else y.is_contiguous())
    del x, y, dy, x_ref, y_ref
    return out


@pytest.mark.parametrize("layout", ["contiguous_3d", "channels_last_4d"])
def test_syncbn_wider_than_the_grid_axis_matches_batchnorm(layout, monkeypatch):
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", "triton")  # the compiled kernels, or an error
    from fusedist.triton_kernels import syncbn as kernels

    if layout == "contiguous_3d":
        shape = (2, WIDE_C, 2049)  # a spatial run over 2048: one-channel blocks before the widening
        block_c = kernels._tile(WIDE_C, shape[2], shape[2], 4096)[1]
        assert kernels._cdiv(WIDE_C, block_c) > kernels._GRID_AXIS1_LIMIT, \
            "this input no longer needs widened channel blocks: pick a longer run"
    else:
        shape = (3, WIDE_C, 3, 5)
    seed = _seed()
    try:
        out = _syncbn_against_batchnorm(shape, layout == "channels_last_4d", torch.device("cuda"), seed)
    finally:
        torch.cuda.empty_cache()
    where = f"{layout} {shape}, seed {seed}: {out}"
    assert out["out_format"], where  # the input's memory format, as torch's BatchNorm gives it
    assert out["y"] <= 2e-5 and out["dx"] <= 2e-5, where
    assert out["dw"] <= 1e-3 and out["db"] <= 1e-3, where
    assert out["running_mean"] <= 1e-5 and out["running_var"] <= 1e-5, where


# ------------------------------------------------------------------ direct-NCCL wait timeouts
GATE_CYCLES = 200_000_000  # ~0.1 s of GPU sleep ahead of a collective: its wait polls a while


def _wait_timeouts(rank, world_size, seed):
    from fusedist.comm import TorchCommunicator, get_communicator
    from fusedist.comm.nccl_comm import NcclCommunicator

    comm = get_communicator(device="cuda")
    assert isinstance(comm, NcclCommunicator), type(comm)
    comm.blocking_wait = True  # handle.wait() blocks the host in NcclComm.wait
    theirs = TorchCommunicator()
    gen = torch.Generator().manual_seed(seed)
    out = {}

    def launched(tag):
        """A collective queued behind a GPU sleep (still running when its wait starts), and
        torch's result for the same input."""
        x = torch.randn(4099, generator=gen).cuda()
        want = x.clone()
        theirs.all_reduce(want)
        torch.cuda._sleep(GATE_CYCLES)
        return x, comm.all_reduce(x, async_op=True, tag=tag), want

    # Only a wait(timeout) shorter than what is left of the deadline tightens the watchdog's entry
    # (every wait is handed that remainder, which moved nothing: Note [one deadline per collective]).
    tightened, tighten = [], comm.watchdog.tighten
    comm.watchdog.tighten = lambda entry, seconds: tightened.append(entry.tag) or tighten(entry, seconds)
    limit = comm.timeout.total_seconds()
    try:
        for label, timeout in (("default wait", None), ("longer wait", datetime.timedelta(seconds=2 * limit)),
                               ("shorter wait", datetime.timedelta(seconds=limit / 2))):
            x, handle, want = launched(label)
            handle.wait() if timeout is None else handle.wait(timeout)
            out[label] = (handle._work.watched.timeout_s, torch.equal(x, want))
    finally:
        comm.watchdog.tighten = tighten
    out["tightened"], out["limit"] = tightened, limit
    # The public path: a wait of timedelta.max waits for the collective (bounded by its deadline).
    x, handle, want = launched("timedelta.max wait")
    handle.wait(datetime.timedelta.max)
    out["handle timedelta.max"] = torch.equal(x, want)
    # No deadline: the wait returns when the collective completed, nothing aborted.
    for label, timeout_s in (("inf", math.inf), ("timedelta.max", datetime.timedelta.max.total_seconds()),
                             ("1e300", 1e300)):
        x, handle, want = launched(label)
        comm._comm.wait(handle._work.done, timeout_s, "all_reduce")
        out[label] = (handle._work.done.query(), comm._comm.aborted)
        handle.wait()
        out[label] += (torch.equal(x, want),)
    # Refused before anything is polled: ValueError naming the operation; the collective goes on.
    for label, timeout_s in (("nan", math.nan), ("-1", -1.0), ("-inf", -math.inf)):
        x, handle, want = launched(label)
        try:
            comm._comm.wait(handle._work.done, timeout_s, "all_reduce")
            error = None
        except ValueError as exc:
            error = str(exc)
        aborted = comm._comm.aborted
        handle.wait()
        out[label] = (error, aborted, torch.equal(x, want))
    return out


def test_nccl_wait_without_deadline_completes_and_nan_or_negative_raise():
    assert fusedist.cuda_ext_available(), f"fusedist._C did not load: {fusedist.cuda_ext_error()}"
    seed = _seed()
    (out,) = run_distributed(_wait_timeouts, 1, seed, backend="nccl", timeout=240)
    where = f"seed {seed}: {out}"
    assert out["tightened"] == ["shorter wait"], where
    limit = out["limit"]
    assert out["default wait"] == out["longer wait"] == (limit, True), where
    assert out["shorter wait"] == (limit / 2, True), where
    assert out["handle timedelta.max"], where
    for label in ("inf", "timedelta.max", "1e300"):
        assert out[label] == (True, False, True), (label, where)  # completed, not aborted, torch's result
    for label in ("nan", "-1", "-inf"):
        error, aborted, equal = out[label]
        assert error is not None, (label, where)
        assert error.startswith("fusedist: all_reduce: the wait's timeout must be"), (label, where)
        assert not aborted and equal, (label, where)


# ------------------------------------------------------------------ negated gradients, Triton on CUDA
SHAPES = [(1,), (17,), (3, 5), (300, 33)]


def _negated_values(shape, gen):
    """(a negated view on the GPU, its values): ``z.conj().imag`` for one element (what complex
    math hands a real parameter), else ``torch._neg_view`` of the negation."""
    if shape == (1,):
        g = torch.randn(1, generator=gen, dtype=torch.complex64).cuda().conj().imag
    else:
        g = torch._neg_view(torch.randn(shape, generator=gen).cuda().neg())
    assert g.is_neg()
    return g, g.resolve_neg()


def _params(gen):
    start = [torch.randn(s, generator=gen).cuda() for s in SHAPES]
    return [nn.Parameter(p.clone()) for p in start], [nn.Parameter(p.clone()) for p in start]


def test_fused_adamw_steps_negated_gradients_on_cuda_as_torch(monkeypatch):
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", "triton")
    from fusedist.optim import FusedAdamW

    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    ours, theirs = _params(gen)
    opt = FusedAdamW(ours, lr=1e-2, weight_decay=0.05)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.05)
    for _ in range(3):
        for a, b, s in zip(ours, theirs, SHAPES):
            a.grad, b.grad = _negated_values(s, gen)
        opt.step()
        ref.step()
    for i, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, i=i: f"seed {seed}, param {i} {SHAPES[i]}: {m}")


def test_fused_adamw_with_scaler_steps_negated_gradients_on_cuda_as_torch(monkeypatch):
    """The scaled gradients replaced by negated views of their values after backward: the
    device-side inf check and unscale read memory, so an inf (step 1, both sides) must still skip
    the step and the scale back off as torch's GradScaler does."""
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", "triton")
    from fusedist.amp import GradScaler
    from fusedist.optim import FusedAdamW

    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    ours, theirs = _params(gen)
    opt = FusedAdamW(ours, lr=1e-2, weight_decay=0.05)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.05)
    scaler = GradScaler("cuda", init_scale=2.0**10, growth_interval=2)
    ref_scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=2)
    scales = []
    for step in range(4):
        weights = [torch.randn(s, generator=gen).cuda() for s in SHAPES]
        if step == 1:
            weights[2][1, 1] = float("inf")
        for params, sc in ((ours, scaler), (theirs, ref_scaler)):
            loss = sum((p * w).sum() for p, w in zip(params, weights))
            sc.scale(loss).backward()
        for p in ours:
            p.grad = torch._neg_view(p.grad.neg())  # the same values, the memory negated
            assert p.grad.is_neg()
        scaler.step(opt)
        scaler.update()
        ref_scaler.step(ref)
        ref_scaler.update()
        opt.zero_grad()
        ref.zero_grad()
        scales.append((scaler.get_scale(), ref_scaler.get_scale()))
    assert [a for a, _ in scales] == [b for _, b in scales] == [1024.0, 512.0, 512.0, 1024.0], (seed, scales)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, i=i: f"seed {seed}, param {i} {SHAPES[i]}: {m}")
