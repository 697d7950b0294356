"""The fingerprints a ZeroRedundancyOptimizer without a DDP model compares at its first step (Note
[gradients nobody averaged] in fusedist/zero/grad_agreement.py), in one process: gradients that differ in
rounding only (summed in another order) are alike; another batch's gradient, the same values in other
places (same norm), a gradient on one side only and an inf on one side only are not."""

import torch

from fusedist.zero import grad_agreement as agreement


def _verdict(a, b, dtype=torch.float32):
    fa, fb = agreement.fingerprint(a, "cpu").tolist(), agreement.fingerprint(b, "cpu").tolist()
    high, low = [max(x, y) for x, y in zip(fa, fb)], [min(x, y) for x, y in zip(fa, fb)]
    return agreement._differs(high, low, agreement.tolerance(dtype))


def test_rounding_is_alike_and_other_gradients_are_not():
    gen = torch.Generator().manual_seed(0)
    terms = torch.randn(64, 300, generator=gen)
    grad = terms.sum(0)
    reordered = terms.flip(0).sum(0)  # the same sum in another order: a few ulps apart
    assert not torch.equal(grad, reordered)
    assert _verdict(grad, reordered) is None
    assert _verdict(grad, grad.clone()) is None
    assert _verdict(grad, torch.randn(64, 300, generator=gen).sum(0)) == "other values"
    assert _verdict(grad, grad.flip(0)) == "other values"  # same norm, same sum of elements
    assert _verdict(grad, None) == "a gradient on some ranks only"
    assert _verdict(None, None) is None
    inf = grad.clone()
    inf[3] = float("inf")
    assert _verdict(grad, inf) == "inf/nan on some ranks only"
    nan = grad.clone()
    nan[5] = float("nan")
    assert _verdict(inf, nan) is None  # (an overflowing scaler step on every rank: nothing to compare)


def test_half_precision_rounding_is_alike():
    gen = torch.Generator().manual_seed(1)
    terms = torch.randn(16, 200, generator=gen)
    grad = terms.sum(0).bfloat16()
    rounded_elsewhere = (terms.sum(0) * (1 + 2 ** -9)).bfloat16()  # at most one bf16 rounding step apart
    assert _verdict(grad, rounded_elsewhere, torch.bfloat16) is None
    other = torch.randn(16, 200, generator=gen).sum(0).bfloat16()
    assert _verdict(grad, other, torch.bfloat16) == "other values"


def test_complex_and_chunked_gradients(monkeypatch):
    monkeypatch.setattr(agreement, "CHUNK", 64)  # (the chunks of a large gradient, on a small one)
    gen = torch.Generator().manual_seed(2)
    grad = torch.randn(3 * agreement.CHUNK + 17, generator=gen)
    other_tail = grad.clone()
    other_tail[3 * agreement.CHUNK:] = torch.randn(17, generator=gen)  # the values of the last chunk differ
    assert _verdict(grad, grad.clone()) is None
    assert _verdict(grad, other_tail) == "other values"
    complex_grad = torch.randn(40, dtype=torch.complex64, generator=gen)
    assert _verdict(complex_grad, complex_grad.clone(), torch.complex64) is None
    assert _verdict(complex_grad, complex_grad.conj(), torch.complex64) == "other values"
