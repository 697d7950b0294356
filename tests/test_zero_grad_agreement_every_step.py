"""The fingerprints a ZeroRedundancyOptimizer without a DDP model carries on a parameter all-gather at
every step after the first (Note [gradients compared at every step] and Note [the fingerprint of every
step] in fusedist/zero/carried_agreement.py), in one process: each "rank" is a list of gradients, and
the verdict is read from their rows as the gathered tail delivers them."""

import types

import torch

from fusedist.zero import carried_agreement as carried


def _zero(params, trainable=None):
    """What the rows and the verdict read of an optimizer."""
    return types.SimpleNamespace(_params=params, _trainable=list(range(len(params))) if trainable is None
                                 else trainable, rank=0, _param_name=lambda i: f"parameter {i}")


def _verdict(grads_per_rank, dtypes=None, trainable=None):
    """The verdict at step 7 on ranks whose gradients are ``grads_per_rank[rank][param]``."""
    count = len(grads_per_rank[0])
    dtypes = dtypes or [g.dtype if g is not None else torch.float32 for g in grads_per_rank[0]]
    params = [types.SimpleNamespace(dtype=d, grad=None) for d in dtypes]  # (what is read of a parameter)
    every = []
    for grads in grads_per_rank:
        for p, g in zip(params, grads):
            p.grad = g
        every.append(carried.local_rows(_zero(params, trainable)).tolist())
    assert len(every[0]) == count
    error = carried.verdict(_zero(params, trainable), 7, every)
    return None if error is None else str(error)


def test_alike_gradients_pass_in_every_dtype():
    gen = torch.Generator().manual_seed(0)
    terms = torch.randn(64, 300, generator=gen)
    grads = [terms.sum(0), terms.sum(0).bfloat16(), terms.sum(0).double(),
             torch.randn(30, dtype=torch.complex64, generator=gen), torch.zeros(0)]
    assert _verdict([grads, [g.clone() for g in grads]]) is None  # averaged: bitwise equal
    reordered = terms.flip(0).sum(0)  # the same sum in another order: a few ulps apart
    assert not torch.equal(grads[0], reordered)
    assert _verdict([grads, [reordered] + [g.clone() for g in grads[1:]]]) is None
    inf, nan = grads[0].clone(), grads[0].clone()
    inf[3], nan[5] = float("inf"), float("nan")
    assert _verdict([[inf], [nan]]) is None  # (an overflowing scaler step on every rank)


def test_other_gradients_are_named_with_the_step_and_ranks():
    gen = torch.Generator().manual_seed(1)
    a, b, c = (torch.randn(40, generator=gen) for _ in range(3))
    text = _verdict([[a, b], [a.clone(), b.clone()], [a.clone(), c]])
    assert text.startswith("ZeroRedundancyOptimizer (rank 0): at step 7 the gradients differ across ranks at 1 "
                           "parameter(s): parameter 1 (the first: other values: rank 0 has a gradient of norm "
                           f"{b.norm().item():.6g}, rank 2 a gradient of norm {c.norm().item():.6g})"), text
    assert "outside no_sync()" in text
    assert "a gradient on some ranks only" in _verdict([[a], [None]])
    inf = a.clone()
    inf[0] = float("inf")
    assert "inf/nan on some ranks only" in _verdict([[a], [inf]])
    bf16 = a.bfloat16()
    assert "other values" in _verdict([[bf16], [(a * 1.01).bfloat16()]])  # a 1% larger gradient
    assert "other values" in _verdict([[a.conj().to(torch.complex64)], [(a * 1j).to(torch.complex64) + 1]])
    many = _verdict([[torch.ones(3) * k for k in range(1, 7)], [torch.ones(3) * -k * 2 for k in range(1, 7)]])
    assert "at 6 parameter(s): parameter 0; parameter 1; parameter 2; parameter 3 and 2 more" in many


def test_parameters_not_sharded_are_not_compared():
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(10, generator=gen), torch.randn(10, generator=gen)
    assert _verdict([[a, a.clone()], [a.clone(), b]], trainable=[0]) is None
    assert _verdict([[a, a.clone()], [a.clone(), b]], trainable=[1]) is not None
