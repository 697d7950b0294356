"""HostOffloadAdam: per-bucket host-side Adam with copies, equal to the direct kernel call.

On this machine the "device" tensors are CPU tensors, which exercises the protocol, the
buffer bookkeeping and the worker thread; the CUDA stream/event path is the gpu-marked test.
"""

from __future__ import annotations

import pytest
import torch

from fusedist import _extension

pytestmark = pytest.mark.skipif(not _extension.is_available("_cpu_ops"),
                                reason="fusedist._cpu_ops not built")

from fusedist.optim._cpu_adam import adam_update  # noqa: E402
from fusedist.optim._cpu_offload import HostOffloadAdam  # noqa: E402

HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


def _model(dtype, device="cpu"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.Tanh(), torch.nn.Linear(31, 7),
                                torch.nn.Tanh(), torch.nn.Linear(7, 3))
    return model.to(device=device, dtype=dtype)


def _buckets(model):
    # Reverse order, as backward produces them; uneven bucket sizes.
    params = list(model.parameters())[::-1]
    return [params[:2], params[2:5], params[5:]]


def _loss(model, step, dtype, device="cpu"):
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(16, 13, generator=gen).to(device=device, dtype=dtype)
    return model(x).float().pow(2).mean()


def _train_offloaded(dtype, steps, device="cpu", scale=None):
    model = _model(dtype, device)
    buckets = _buckets(model)
    off = HostOffloadAdam(buckets, **HYPER)
    losses = []
    for step in range(steps):
        loss = _loss(model, step, dtype, device)
        losses.append(loss.item())
        off.begin_step(inv_scale=None if scale is None else torch.tensor([1.0 / scale]))
        (loss * (scale or 1.0)).backward()
        # Buckets become ready in an order that differs from their index order.
        for k in (1, 0, 2):
            off.bucket_ready(k)
        off.finish()
        model.zero_grad(set_to_none=True)
    off.close()
    return model, losses, off


def _assert_params_are_rounded_masters(off):
    for k, bucket in enumerate(off.buckets):
        for j, (p, m) in enumerate(zip(bucket.params, bucket.views(bucket.master))):
            assert torch.equal(p.detach().cpu(), m.to(p.dtype)), f"bucket {k} param {j}"


def _train_direct(dtype, steps):
    """The same training with the kernel called directly on FP32 masters (no offload)."""
    model = _model(dtype)
    params = [p for b in _buckets(model) for p in b]
    masters = [p.detach().float().clone() for p in params]
    exp_avgs = [torch.zeros_like(m) for m in masters]
    exp_avg_sqs = [torch.zeros_like(m) for m in masters]
    losses = []
    for step in range(steps):
        loss = _loss(model, step, dtype)
        losses.append(loss.item())
        loss.backward()
        with torch.no_grad():
            adam_update([p.data for p in params], [p.grad for p in params], exp_avgs, exp_avg_sqs,
                        masters, lr=HYPER["lr"], beta1=HYPER["betas"][0], beta2=HYPER["betas"][1],
                        eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], adamw=True,
                        step=step + 1)
        model.zero_grad(set_to_none=True)
    return model, losses


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloaded_training_equals_direct_update_bitwise(dtype):
    offloaded, losses_off, off = _train_offloaded(dtype, 10)
    _assert_params_are_rounded_masters(off)
    direct, losses_direct = _train_direct(dtype, 10)
    assert losses_off == losses_direct
    for a, b in zip(offloaded.parameters(), direct.parameters()):
        assert torch.equal(a, b)


def test_offloaded_training_matches_torch_adamw():
    offloaded, losses, _ = _train_offloaded(torch.float32, 10)
    model = _model(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), **HYPER, foreach=True)
    ref_losses = []
    for step in range(10):
        loss = _loss(model, step, torch.float32)
        ref_losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    # Same tolerance reasoning as tests/test_cpu_adam.py: a few float32 ulp per step.
    for a, b in zip(offloaded.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * HYPER["lr"] * 10)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)


def test_inv_scale_and_deferred_overflow_skip():
    scaled, _, _ = _train_offloaded(torch.float32, 3, scale=512.0)
    plain, _, _ = _train_offloaded(torch.float32, 3)
    for a, b in zip(scaled.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)

    model = _model(torch.float32)
    off = HostOffloadAdam(_buckets(model), **HYPER)
    _loss(model, 0, torch.float32).backward()
    before = [p.detach().clone() for p in model.parameters()]
    off.begin_step()
    for k in range(3):
        off.bucket_ready(k, defer=True)
    assert off.finish(found_inf=torch.ones(1)) is False
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert off.step(found_inf=torch.zeros(1), clip_coef=torch.tensor([0.5])) is True
    assert not torch.equal(next(model.parameters()), before[0])
    off.close()


def test_protocol_misuse_is_reported():
    model = _model(torch.float32)
    off = HostOffloadAdam(_buckets(model), **HYPER)
    _loss(model, 0, torch.float32).backward()
    with pytest.raises(AssertionError, match="call begin_step"):
        off.bucket_ready(0)
    off.begin_step()
    off.bucket_ready(0)
    with pytest.raises(AssertionError, match="bucket 0 was made ready twice"):
        off.bucket_ready(0)
    with pytest.raises(RuntimeError, match=r"buckets \[1, 2\] were never made ready"):
        off.finish()
    off.begin_step()  # usable again after the error
    off.bucket_ready(0)
    with pytest.raises(RuntimeError, match="found_inf/clip_coef apply to deferred buckets only"):
        for k in (1, 2):
            off.bucket_ready(k)
        off.finish(found_inf=torch.zeros(1))
    with pytest.raises(ValueError, match="bucket 0: param 1 is torch.bfloat16"):
        HostOffloadAdam([[torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)]])
    off.close()


@pytest.mark.gpu
def test_cuda_offload_equals_cpu_logic():
    """Pinned buffers, side streams and events: same training as the CPU-device run."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cuda_model, cuda_losses, _ = _train_offloaded(torch.float32, 10, device="cuda")
    cpu_model, cpu_losses, _ = _train_offloaded(torch.float32, 10)
    # CUDA matmuls sum in another order than CPU ones: fp32 gradients differ by ~1e-7
    # relative, which Adam carries into ulp-level parameter differences.
    torch.testing.assert_close(torch.tensor(cuda_losses), torch.tensor(cpu_losses), rtol=1e-4, atol=1e-6)
    for a, b in zip(cuda_model.parameters(), cpu_model.parameters()):
        assert a.is_cuda
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_cuda_offload_bf16_params_follow_their_masters():
    model, _, off = _train_offloaded(torch.bfloat16, 3, device="cuda")
    torch.cuda.synchronize()
    assert all(p.dtype == torch.bfloat16 and p.is_cuda for p in model.parameters())
    # The copy back delivered exactly the rounded masters (no stale or torn buffers).
    _assert_params_are_rounded_masters(off)
