"""torch.compile with fusedist.fully_shard: compiled blocks train exactly as eager ones.

Compiled the ways FSDP2 users do it: ``block.compile()`` after ``fully_shard`` (in place),
``torch.compile(block)`` before it (the OptimizedModule is what gets sharded), and
``torch.compile(model)`` over the sharded root; once with bf16 ``param_dtype``. The hooks run
eagerly between graphs (Note [hooks outside compiled graphs] in fsdp/state.py), so the graphs
see the gathered parameters, and one graph serves every step (no recompile after the first).

Backend ``aot_eager`` (as tests/test_compile.py): dynamo and AOTAutograd trace forward and
backward as with inductor, without inductor's C++ compile time. It runs the traced ops
eagerly in the same order, so the comparison with the eager run is exact up to 1e-6 (fp32
and bf16 alike: the same ops on the same values).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from fusedist.testing import run_distributed
from test_fully_shard import Net

HOW = ("block.compile() after", "torch.compile(block) before", "torch.compile(model)", "block.compile() after, bf16")


def _worker(rank, ws):
    import fusedist
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    base = Net()
    out = {}

    def make(how):
        m = copy.deepcopy(base)
        kw = {}
        if how is not None and how.endswith("bf16"):
            kw["mp_policy"] = fusedist.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if how == "torch.compile(block) before":
            for i, b in enumerate(m.blocks):
                m.blocks[i] = torch.compile(b, backend="aot_eager")
        for b in m.blocks:
            fusedist.fully_shard(b, **kw)
        fusedist.fully_shard(m, **kw)
        if how is not None and how.startswith("block.compile() after"):
            for b in m.blocks:
                b.compile(backend="aot_eager")
        return torch.compile(m, backend="aot_eager") if how == "torch.compile(model)" else m

    for how in HOW:
        torch._dynamo.reset()
        counters.clear()
        ref, run = make(how.replace("block.compile() after", "eager") if how.endswith("bf16") else None), make(how)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, run)]
        graphs = []
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + rank)
            x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
            for m, opt in zip((ref, run), opts):
                F.mse_loss(m(x), y).backward()
                opt.step()
                opt.zero_grad()
            graphs.append(counters["stats"]["unique_graphs"])
        a = fusedist.fsdp.full_state_dict(ref)
        b = fusedist.fsdp.full_state_dict(getattr(run, "_orig_mod", run))
        b = {k.replace("_orig_mod.", ""): v for k, v in b.items()}
        assert a.keys() == b.keys(), (sorted(a), sorted(b))
        out[how] = (max((a[k].float() - b[k].float()).abs().max().item() for k in a), graphs)
    return out


def test_compiled_blocks_train_like_eager_ones():
    for rank, out in enumerate(run_distributed(_worker, 2, timeout=300)):
        for how, (diff, graphs) in out.items():
            assert diff < 1e-6, f"rank {rank}, {how}: max |eager - compiled| = {diff}"
            assert graphs[0] >= 1 and graphs[-1] == graphs[0], f"rank {rank}, {how}: graphs after each step {graphs}"
