"""fusedist.nn.SyncBatchNorm under torch.func transforms (grad, vmap, jvp, jacrev, functional_call
with buffers) wherever torch's layer is F.batch_norm: eval, or training without other ranks.
Oracle: torch.nn.BatchNorm1d on the same random inputs."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.func import functional_call, grad, jacrev, jvp, vmap

from fusedist.nn import SyncBatchNorm

TOL = dict(rtol=1e-5, atol=1e-5)


def _pair(**kw):
    """Our layer and torch's BatchNorm1d(3) with the same random parameters and statistics."""
    ref = nn.BatchNorm1d(3, **kw)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
        if ref.running_mean is not None:
            ref.running_mean.normal_()
            ref.running_var.uniform_(0.5, 2.0)
    ours = SyncBatchNorm(3, **kw)
    ours.load_state_dict(ref.state_dict())
    return ours, ref


def test_torch_func_transforms_where_torchs_layer_is_batch_norm():
    """torch.func's grad / vmap / jvp / jacrev through the layer in eval, and in training
    without other ranks (batch statistics only; the buffers handed to functional_call), work
    as through torch's layer (Note [SyncBatchNorm under torch.func]); they used to fail with
    "must override the setup_context staticmethod"."""
    x = torch.randn(4, 3, 5)
    ours, ref = _pair()
    ours.eval(), ref.eval()
    t = torch.randn_like(x)
    for transform in (lambda m: grad(lambda v: m(v).pow(3).sum())(x), lambda m: vmap(m)(x[:, None]),
                      lambda m: jvp(m, (x,), (t,)), lambda m: jacrev(m)(x[:2])):
        torch.testing.assert_close(transform(ours), transform(ref), **TOL)
    ours, ref = _pair(track_running_stats=False)
    torch.testing.assert_close(vmap(ours)(x[:, None]), vmap(ref)(x[:, None]), **TOL)
    torch.testing.assert_close(grad(lambda v: ours(v).pow(3).sum())(x), grad(lambda v: ref(v).pow(3).sum())(x), **TOL)
    ours, ref = _pair()

    def param_grads_and_buffers(m):
        params, buffers = dict(m.named_parameters()), {k: v.clone() for k, v in m.named_buffers()}
        grads = grad(lambda p, b: functional_call(m, (p, b), (x,)).pow(3).sum())(params, buffers)
        return grads, buffers

    torch.testing.assert_close(param_grads_and_buffers(ours), param_grads_and_buffers(ref), **TOL)
