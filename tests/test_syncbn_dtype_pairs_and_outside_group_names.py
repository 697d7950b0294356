"""SyncBatchNorm's (input dtype, parameter dtype) pairs against torch's BatchNorm, and the text
of the warning for layers whose group leaves a rank out.

Oracle: ``nn.BatchNorm1d`` on the same input in one process (no process group: torch's
SyncBatchNorm is that op there). Note [input and parameter dtypes] in
fusedist/nn/_dtype_rule.py; Note [a rank outside the layer's group] in _outside_group.py (the
multi-rank check of that warning is in test_syncbn_adversarial.py's launch).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn

from fusedist.nn import SyncBatchNorm
from fusedist.nn._outside_group import NAMES_SHOWN, describe

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# a few roundings in the output's dtype, relative to the largest value of the tensor
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _run(cls, input_dtype, param_dtype, train, seed):
    g = torch.Generator().manual_seed(seed)
    layer = cls(3)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(3, generator=g) + 0.5)
        layer.bias.copy_(torch.randn(3, generator=g))
        layer.running_mean.copy_(torch.randn(3, generator=g))
        layer.running_var.copy_(torch.rand(3, generator=g) + 0.5)
    layer.to(param_dtype).train(train)
    x = (torch.randn(5, 3, 4, generator=g) * 2 + 1).to(input_dtype).requires_grad_(True)
    try:
        y = layer(x)
    except RuntimeError as exc:
        return exc
    (y.float() * torch.randn(y.shape, generator=g)).sum().backward()
    return y, x.grad, layer.weight.grad, layer.running_var


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("input_dtype,param_dtype", list(itertools.product(DTYPES, DTYPES)),
                         ids=lambda d: str(d).replace("torch.", ""))
def test_dtype_pairs_as_torch_batchnorm(input_dtype, param_dtype, train):
    """Each pair torch's BatchNorm takes (same dtype; fp16/bf16 input with fp32 parameters) gives
    torch's dtypes and values; each it refuses is refused, by name, before anything is counted
    (an fp32 input to a model.half() layer came back fp32 with fp16 parameter gradients)."""
    seed = DTYPES.index(input_dtype) * 4 + DTYPES.index(param_dtype)
    theirs = _run(nn.BatchNorm1d, input_dtype, param_dtype, train, seed)
    ours = _run(SyncBatchNorm, input_dtype, param_dtype, train, seed)
    if isinstance(theirs, Exception):
        assert isinstance(ours, RuntimeError), f"torch refuses ({theirs}); ours returned {ours[0].dtype}"
        message = str(ours)
        assert "SyncBatchNorm(3)" in message and f"the input is {input_dtype}" in message, message
        assert "layer.to(" in message, message
        return
    assert not isinstance(ours, Exception), ours
    tol = TOL[input_dtype]
    for got, want in zip(ours, theirs):
        assert got.dtype == want.dtype
        scale = want.double().abs().max().item()  # the gradient's largest values set its ulp
        torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol * scale)


def test_dtype_refusal_counts_no_batch():
    layer = SyncBatchNorm(3).half()
    with pytest.raises(RuntimeError, match=r"input is torch.float32 but the layer's weight is torch.float16, bias"):
        layer(torch.randn(4, 3))
    assert int(layer.num_batches_tracked) == 0
    mixed = SyncBatchNorm(3)
    mixed.bias.data = mixed.bias.data.half()
    with pytest.raises(RuntimeError, match=r"bias is torch.float16.*one dtype \(layer.to\(torch.float32\)\)"):
        mixed(torch.randn(4, 3))


@pytest.mark.parametrize("input_dtype,param_dtype,stats_dtype", [
    (torch.bfloat16, torch.bfloat16, torch.float32),  # FSDP2's param_dtype=bf16: fp32 buffers stay
    (torch.float16, torch.float16, torch.float32),
    (torch.float16, torch.float32, torch.float16),
    (torch.float32, torch.float32, torch.bfloat16),
], ids=str)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_running_statistics_of_another_dtype(input_dtype, param_dtype, stats_dtype, train):
    """Running statistics of another dtype than the parameters' are taken, as torch's CUDA
    kernels take them (its CPU op refuses: Note [input and parameter dtypes]). Oracle:
    BatchNorm in fp64 on the same values; output within two roundings of its dtype, running
    statistics within one of theirs."""
    g = torch.Generator().manual_seed(7)
    ours, oracle = SyncBatchNorm(3), nn.BatchNorm1d(3).double()
    with torch.no_grad():
        for name, value in (("weight", torch.rand(3, generator=g) + 0.5), ("bias", torch.randn(3, generator=g)),
                            ("running_mean", torch.randn(3, generator=g)),
                            ("running_var", torch.rand(3, generator=g) + 0.5)):
            value = value.to(param_dtype if name in ("weight", "bias") else stats_dtype)
            getattr(ours, name).data = value.clone()
            getattr(oracle, name).copy_(value.double())
    ours.train(train), oracle.train(train)
    x = (torch.randn(6, 3, 5, generator=g) * 2 + 1).to(input_dtype)
    y = ours(x)
    want = oracle(x.double())
    assert y.dtype == input_dtype and ours.running_var.dtype == stats_dtype
    eps = torch.finfo(input_dtype).eps
    torch.testing.assert_close(y.double(), want, rtol=2 * eps, atol=2 * eps * want.abs().max().item())
    stats_eps = torch.finfo(stats_dtype).eps
    for name in ("running_mean", "running_var"):
        got, ref = getattr(ours, name).double(), getattr(oracle, name)
        torch.testing.assert_close(got, ref, rtol=stats_eps, atol=stats_eps * ref.abs().max().item())


def test_outside_group_warning_text_is_bounded():
    names = [repr(f"layer{i}.bn") for i in range(NAMES_SHOWN + 2)]
    text = describe(3, names)
    assert f"rank 3 is not a member of the process_group of {NAMES_SHOWN + 2} SyncBatchNorm layers" in text
    assert ", ".join(names[:NAMES_SHOWN]) + " and 2 more)" in text and names[-1] not in text
    assert "of 1 SyncBatchNorm layer ('bn')" in describe(0, ["'bn'"])
