"""The per-gradient cost of DDP's gradient hook (Note [per-parameter cost] and Note [gradient
hooks under a compiled caller] in fusedist/ddp/grad_hook.py).

The hook used to be wrapped by ``torch.compiler.disable`` for every gradient, so that a
backward run from a compiled caller does not trace it; that wrapper swaps dynamo's frame hook
out and back on each call (~0.8 us a gradient on a 2-core CPU: 0.15-0.2 ms a step with 200
tiny parameters). Without a compiled caller the hook must not
go through it; with one it must (tests/test_compiled_training_step.py). Counted here through
the wrapper's call to dynamo's ``_callback_from_stance``, on a model of many small
parameters, whose gradients must still be torch DDP's.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from fusedist.testing import run_distributed

LAYERS = 20  # 40 parameters


def _stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(LAYERS)])


def _disabled_calls_and_grads(rank, world):
    import torch._dynamo.eval_frame as eval_frame

    import fusedist

    base = _stack()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base))
    gen = torch.Generator().manual_seed(10 + rank)
    calls = []
    real = eval_frame._callback_from_stance

    def counted(callback):
        calls[-1] += 1
        return real(callback)

    eval_frame._callback_from_stance = counted
    try:
        worst = 0.0
        for _ in range(3):
            x = torch.randn(8, 4, generator=gen)
            for model in (ref, ours):
                model.zero_grad(set_to_none=True)
                out = model(x)
                calls.append(0)
                out.pow(2).mean().backward()
            worst = max(worst, max((a.grad - b.grad).abs().max().item()
                                   for a, b in zip(ref.parameters(), ours.parameters())))
    finally:
        eval_frame._callback_from_stance = real
    return calls[1::2], worst, len(list(ours.parameters()))


def test_gradient_hook_skips_the_dynamo_wrapper_without_a_compiled_caller():
    for calls, worst, params in run_distributed(_disabled_calls_and_grads, 2, timeout=120):
        # the end-of-backward callback (and the synchronization it drives) may go through it;
        # per gradient, nothing may
        assert max(calls) < params // 2, (calls, params)
        # fp32 averages of the same two local gradients, bucketed alike: a few ulps apart at most
        assert worst <= 1e-6, worst
