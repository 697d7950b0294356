"""A param group added to the optimizer between ``GradScaler.unscale_`` and ``step`` (Note [a param
group added after unscale_] in fusedist/amp/added_params.py).

torch.amp.GradScaler steps such a group with its gradients still scaled (shown below with SGD: an
update ``scale`` times too large); fusedist's refuses the step before anything is written, on
torch's optimizers and the fused ones, eager or lazy. A group without gradients (the usual
unfreezing) steps as with torch's scaler. Scales are powers of two, so unscaling is exact: plain
SGD matches torch bit for bit, fused updates to fp32 rounding (1e-6).
"""

from __future__ import annotations

import pytest
import torch

from fusedist.amp import GradScaler
from fusedist.optim import FusedAdamW, FusedSGD

SCALE = 1024.0
TOL = dict(rtol=1e-6, atol=1e-6)

_OPTIMIZERS = {
    "torch_sgd": (lambda ps: torch.optim.SGD(ps, lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1), {}),
    "fused_sgd": (lambda ps: FusedSGD(ps, lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1), {}),
    "fused_adamw": (lambda ps: FusedAdamW(ps, lr=0.1), lambda ps: torch.optim.AdamW(ps, lr=0.1), {}),
    "fused_adamw_lazy": (lambda ps: FusedAdamW(ps, lr=0.1), lambda ps: torch.optim.AdamW(ps, lr=0.1),
                         {"lazy_unscale": True}),
}


def _iteration(make_opt, scaler, seed, new_has_grad):
    """unscale_, then add a group holding ``b``; return (a, b, optimizer) before step()."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(5, generator=gen).requires_grad_()
    b = torch.randn(3, generator=gen).requires_grad_()
    xa, xb = torch.randn(5, generator=gen), torch.randn(3, generator=gen)
    opt = make_opt([a])
    loss = (a * xa).sum() + ((b * xb).sum() if new_has_grad else 0.0)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    opt.add_param_group({"params": [b]})
    return a, b, opt


def test_torch_scaler_steps_an_added_group_with_scaled_gradients():
    """Why the refusal: torch's scaler moves ``b`` by lr * scale * grad."""
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    a, b, opt = _iteration(lambda ps: torch.optim.SGD(ps, lr=0.1), scaler, 0, True)
    before, grad = b.detach().clone(), b.grad.clone()
    scaler.step(opt)
    torch.testing.assert_close(b.detach(), before - 0.1 * grad)
    assert grad.abs().max() > 100  # still scaled (1024x the true gradient)


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_added_group_with_gradients_is_refused_before_anything_steps(name):
    make, _, kwargs = _OPTIMIZERS[name]
    scaler = GradScaler("cpu", init_scale=SCALE, **kwargs)
    a, b, opt = _iteration(make, scaler, 1, True)
    a0, b0 = a.detach().clone(), b.detach().clone()
    with pytest.raises(RuntimeError, match=r"param group 1 \(1 added parameter\(s\) with gradients, shapes \(3,\)\)"):
        scaler.step(opt)
    torch.testing.assert_close(a.detach(), a0, rtol=0, atol=0)
    torch.testing.assert_close(b.detach(), b0, rtol=0, atol=0)
    b.grad = None  # what the message suggests: then the step is torch's
    scaler.step(opt)
    scaler.update()
    assert not torch.equal(a.detach(), a0)


@pytest.mark.parametrize("name", sorted(_OPTIMIZERS))
def test_added_group_without_gradients_steps_as_torch(name):
    make, make_ref, kwargs = _OPTIMIZERS[name]
    scaler = GradScaler("cpu", init_scale=SCALE, **kwargs)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    a, b, opt = _iteration(make, scaler, 2, False)
    ra, rb, ref = _iteration(make_ref, ref_scaler, 2, False)
    for s, o in ((scaler, opt), (ref_scaler, ref)):
        s.step(o)
        s.update()
    # a second iteration with both groups and gradients, as after an unfreezing
    for s, o, p, q in ((scaler, opt, a, b), (ref_scaler, ref, ra, rb)):
        o.zero_grad()
        s.scale((p * 2).sum() + (q * 3).sum()).backward()
        s.unscale_(o)
        s.step(o)
        s.update()
    torch.testing.assert_close(a.detach(), ra.detach(), **TOL)
    torch.testing.assert_close(b.detach(), rb.detach(), **TOL)
    assert scaler.get_scale() == ref_scaler.get_scale()
