"""fusedist.DistributedDataParallel against torch's DDP where the user's own gradient hooks meet
the reducer's (Note [the user's gradient hooks first] in fusedist/ddp/grad_hook.py): a
post-accumulate-grad hook that changes ``p.grad`` in place is part of what is averaged,
whether it was registered before or after wrapping, as with torch's DDP. 2 gloo ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from fusedist.testing import run_distributed


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _clip_and_scale(p):
    """A user's in-place change of the fresh local gradient (clipping, then scaling)."""
    p.grad.clamp_(-0.05, 0.05).mul_(3.0)


def _run(wrap, rank, register_after: bool, no_sync: bool, zero_to_none: bool):
    torch.manual_seed(0)
    net = _Net()
    if not register_after:
        handles = [p.register_post_accumulate_grad_hook(_clip_and_scale) for p in net.parameters()]
    model = wrap(net)
    if register_after:
        handles = [p.register_post_accumulate_grad_hook(_clip_and_scale) for p in net.parameters()]
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + rank)
        if no_sync:
            with model.no_sync():
                model(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
        model(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
        grads.append([p.grad.clone() for p in net.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=zero_to_none)
    for h in handles:
        h.remove()
    return grads, [p.detach().clone() for p in net.parameters()]


def _worker(rank, world):
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import fusedist

    failures = []
    for register_after in (True, False):
        for views in (True, False):
            for no_sync, zero_to_none in ((False, True), (True, False)):
                case = f"after={register_after} views={views} no_sync={no_sync} set_to_none={zero_to_none}"
                want = _run(lambda m: TorchDDP(m, gradient_as_bucket_view=views), rank, register_after,
                            no_sync, zero_to_none)
                got = _run(lambda m: fusedist.DistributedDataParallel(m, gradient_as_bucket_view=views), rank,
                           register_after, no_sync, zero_to_none)
                for step, (w, h) in enumerate(zip(want[0], got[0])):
                    for i, (a, b) in enumerate(zip(w, h)):
                        if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
                            failures.append(f"{case}: step {step} grad {i} off by {(a - b).abs().max():.3g}")
                for i, (a, b) in enumerate(zip(want[1], got[1])):
                    if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
                        failures.append(f"{case}: param {i} off by {(a - b).abs().max():.3g}")
    return failures


def test_user_post_accumulate_grad_hooks_change_what_is_averaged_as_in_torch():
    for rank, failures in enumerate(run_distributed(_worker, 2, timeout=120)):
        assert not failures, f"rank {rank}: " + "; ".join(failures[:6])
