"""A fused optimizer's step, or a functional update, inside ``torch.compile(fullgraph=True)``.

torch's AdamW is captured whole there; the fused step runs eagerly (its kernel launches cannot be
traced: Note [a fused step under fullgraph=True] in fusedist/optim/_eager.py), so dynamo refuses
the graph break. Its error said only "Skip calling `torch.compiler.disable()`d function ...
(reason: None) Hint: Remove the `torch.compiler.disable` call", naming neither the fused step nor
a way out. Checked: the error names both and nothing was updated; the way out it names (compile
without fullgraph) steps as torch's AdamW on the same gradients (fp32: the same operations in the
same order, 1e-6 covers a different summation of the bias corrections).
"""

from __future__ import annotations

import pytest
import torch

from fusedist.optim import FusedAdamW, FusedLAMB, functional


def _params(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((6, 5), (7,), ())]


def _with_grads(params: list, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return params


def test_fullgraph_names_the_fused_step_and_the_way_out():
    ours = _with_grads(_params(0), 1)
    before = [p.detach().clone() for p in ours]
    for opt in (FusedAdamW(ours, lr=1e-2), FusedLAMB(ours, lr=1e-2)):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=r"(?s)fused optimizer's step\(\).*compile without fullgraph"):
            torch.compile(opt.step, backend="eager", fullgraph=True)()
        for p, b in zip(ours, before):
            torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)

    states = [[torch.zeros_like(p) for p in ours] for _ in range(2)]

    def functional_step():
        functional.adam_update(ours, [p.grad for p in ours], *states, None, lr=1e-2, beta1=0.9, beta2=0.999,
                               eps=1e-8, weight_decay=0.0, adamw=True, step=1)

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"(?s)multi-tensor updates run eagerly.*compile without fullgraph"):
        torch.compile(functional_step, backend="eager", fullgraph=True)()

    # The way out: compiled without fullgraph, the step runs (eagerly) as torch's AdamW does.
    reference = _with_grads(_params(0), 1)
    ref_opt = torch.optim.AdamW(reference, lr=1e-2)
    opt = FusedAdamW(ours, lr=1e-2)
    torch._dynamo.reset()
    compiled = torch.compile(opt.step, backend="eager")
    for step in range(2):
        compiled()
        ref_opt.step()
        _with_grads(ours, 10 + step)
        _with_grads(reference, 10 + step)
    for p, r in zip(ours, reference):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-6)


def test_fullgraph_names_the_eager_clips():
    """fusedist's clip, and the replacement of torch's that fusedist installs once sharded
    gradients exist (its eager path, the one sharded parameters take, called here directly:
    installing it would change torch for this process), refused under fullgraph=True with
    "reason: None" too. Compiled without fullgraph, fusedist's
    clip gives torch's norm and clipped gradients (fp32, same reductions: 1e-6)."""
    from fusedist.optim import clip_grad_norm_
    from fusedist.optim.torch_clip import _global_clip_grad_norm_eager as _global_clip_grad_norm_

    ours = _with_grads(_params(2), 3)
    grads = [p.grad.clone() for p in ours]
    for clip, what in ((clip_grad_norm_, "fusedist.optim.clip_grad_norm_ runs eagerly"),
                       (_global_clip_grad_norm_, "gradient clipping is replaced by fusedist")):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=rf"(?s){what}.*compile without fullgraph"):
            # (called from the compiled function, as in a training step: compiling the clip itself
            # would unwrap it)
            torch.compile(lambda: clip(ours, 0.5), backend="eager", fullgraph=True)()
        for p, g in zip(ours, grads):
            torch.testing.assert_close(p.grad, g, rtol=0, atol=0)

    reference = _with_grads(_params(2), 3)
    expected = torch.nn.utils.clip_grad_norm_(reference, 0.5)
    torch._dynamo.reset()
    norm = torch.compile(lambda: clip_grad_norm_(ours, 0.5), backend="eager")()
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=1e-6)
    for p, r in zip(ours, reference):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-6)
