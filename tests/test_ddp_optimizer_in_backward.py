"""The optimizer stepped inside backward, against torch: ``_apply_optimizer_in_backward`` under
``fusedist.DistributedDataParallel`` and ``fusedist.replicate`` (Note [optimizers applied in
backward] in fusedist/ddp/in_backward.py) steps each parameter on its averaged gradient and leaves
``.grad`` None, as torch's DDP does; gradient accumulation under ``no_sync`` steps once. torch's
own in-backward hook needs an accelerator stream, so the reference on CPU is torch's DDP stepping
the same optimizer after ``backward()`` and zeroing to None (the values torch's hook computes).
2 gloo ranks.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from fusedist.testing import run_distributed


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def _train(rank, kind: str, opt_cls, micro: int, kwargs: dict):
    """Three steps of ``micro`` micro-batches; the weights and whether every .grad is None.
    ``kind``: "torch" (step after backward), "ddp" or "replicate" (optimizers applied in backward)."""
    import fusedist
    from torch.distributed.optim import _apply_optimizer_in_backward

    net = _net()
    opt = None
    if kind == "torch":
        opt = opt_cls(net.parameters(), lr=0.05)
        model = fwd = torch.nn.parallel.DistributedDataParallel(net, **kwargs)
    else:
        _apply_optimizer_in_backward(opt_cls, net.parameters(), {"lr": 0.05})
        if kind == "ddp":
            model = fwd = fusedist.DistributedDataParallel(net, **kwargs)
        else:
            model, fwd = fusedist.replicate(net, **kwargs), net
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        for i in range(micro):
            last = i == micro - 1
            if kind == "replicate":
                model.set_requires_gradient_sync(last)
            with (model.no_sync() if not last and kind != "replicate" else contextlib.nullcontext()):
                fwd(torch.randn(4, 5, generator=gen)).square().mean().backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in net.parameters()], all(p.grad is None for p in net.parameters())


def _worker(rank, world_size):
    cases = [
        ("ddp", torch.optim.AdamW, torch.optim.AdamW, 2, {}),
        ("ddp", torch.optim.SGD, torch.optim.SGD, 1, {"find_unused_parameters": True}),
        ("replicate", torch.optim.AdamW, torch.optim.AdamW, 2, {}),
    ]
    out = []
    for kind, opt_cls, ref_cls, micro, kwargs in cases:
        want, _ = _train(rank, "torch", ref_cls, micro, kwargs)
        got, grads_none = _train(rank, kind, opt_cls, micro, kwargs)
        out.append((kind, opt_cls.__name__, micro, want, got, grads_none))
    return out


def test_optimizers_applied_in_backward_step_on_the_average_as_torch_ddp():
    for results in run_distributed(_worker, 2, timeout=120):
        for kind, name, micro, want, got, grads_none in results:
            for w, g in zip(want, got):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{kind} {name} x{micro}: {m}")
            assert grads_none, (kind, name, micro)
