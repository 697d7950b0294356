"""torch's ``clip_grad_norm_`` / ``clip_grad_value_`` over parameters no fusedist object shards,
in ``torch.compile(..., fullgraph=True)``, once a ``fully_shard`` unit exists in the process
(which replaces torch's clip process-wide, Note [torch's clip on plain parameters under
torch.compile] in fusedist/optim/torch_clip.py): the replacement ran eagerly, so dynamo refused
the graph that it captures whole with torch's own function.

Compared with torch's clip as shipped, run eagerly on the same fresh gradients (fp32, the same
operations in the same order: 1e-6); the compiled function is traced once for every step. The
sharded path keeps its global norm (torch's clip on the whole model over both ranks' batches)
and, under fullgraph=True, its refusal naming why.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from fusedist.testing import run_distributed

STEPS, MAX_NORM, CLIP_VALUE = 3, 0.1, 0.05
TOL = dict(rtol=1e-6, atol=1e-6)


def _worker(rank, ws):
    import fusedist
    from torch._dynamo.testing import CompileCounter
    from torch.distributed.device_mesh import init_device_mesh

    from fusedist.optim.torch_clip import torch_clip_grad_norm_

    torch_clip_value = torch.nn.utils.clip_grad_value_  # torch's own, before any sharding
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1))
    sharded = fusedist.fully_shard(copy.deepcopy(base), mesh=init_device_mesh("cpu", (ws,)))
    assert torch.nn.utils.clip_grad_value_ is not torch_clip_value, "the clip was not replaced"

    gen = torch.Generator().manual_seed(1000 + rank)
    plain = nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 3))
    reference = copy.deepcopy(plain)
    norm_counter, value_counter = CompileCounter(), CompileCounter()

    @torch.compile(fullgraph=True, backend=norm_counter)
    def clip_norm():
        return torch.nn.utils.clip_grad_norm_(plain.parameters(), MAX_NORM)

    @torch.compile(fullgraph=True, backend=value_counter)
    def clip_value():
        torch.nn.utils.clip_grad_value_(plain.parameters(), CLIP_VALUE)

    for step in range(STEPS):
        for p, r in zip(plain.parameters(), reference.parameters()):
            p.grad = torch.randn(p.shape, generator=gen)
            r.grad = p.grad.clone()
        norm = clip_norm()
        expected = torch_clip_grad_norm_(reference.parameters(), MAX_NORM)
        torch.testing.assert_close(norm, expected, **TOL, msg=lambda m: f"rank {rank} step {step} norm: {m}")
        clip_value()
        torch_clip_value(reference.parameters(), CLIP_VALUE)
        for p, r in zip(plain.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, r.grad, **TOL, msg=lambda m: f"rank {rank} step {step}: {m}")
    assert (norm_counter.frame_count, value_counter.frame_count) == (1, 1), (
        f"rank {rank}: traced {norm_counter.frame_count} / {value_counter.frame_count} times in {STEPS} steps")

    # the sharded path: the global norm, and under fullgraph=True the eager replacement's refusal
    xs = [torch.randn(3, 6, generator=torch.Generator().manual_seed(50 + r)) for r in range(ws)]
    full = copy.deepcopy(base)
    sum(F.mse_loss(full(x), x[:, :1]) for x in xs).div(ws).backward()
    expected = torch_clip_grad_norm_(full.parameters(), MAX_NORM)
    F.mse_loss(sharded(xs[rank]), xs[rank][:, :1]).backward()
    norm = torch.compile(lambda: torch.nn.utils.clip_grad_norm_(sharded.parameters(), MAX_NORM),
                         backend="eager")()
    torch.testing.assert_close(norm, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} sharded: {m}")
    torch._dynamo.reset()
    try:
        torch.compile(lambda: torch.nn.utils.clip_grad_norm_(sharded.parameters(), MAX_NORM),
                      backend="eager", fullgraph=True)()
    except Exception as e:  # dynamo's error type differs between versions
        assert "replaced by fusedist" in str(e), f"rank {rank}: {e}"
    else:
        raise AssertionError(f"rank {rank}: the sharded clip was captured under fullgraph=True")
    return True


def test_torch_clip_of_plain_parameters_compiles_fullgraph_beside_fully_shard():
    assert run_distributed(_worker, 2, timeout=240) == [True, True]
