"""torch.compile with fusedist DDP and ZeRO: the compiled model trains exactly as the eager one.

Backend ``aot_eager``: dynamo and AOTAutograd trace the model (graphs, guards, the gradient
hooks) as with inductor, without inductor's C++ compile time (about 15 s per model on a
2-core machine). Compiled three ways users do it: ``torch.compile(module)`` inside the DDP
wrapper, ``module.compile()`` in place, and ``torch.compile(ddp_model)``.
"""

import copy

import torch
from torch import nn

import models
from fusedist.testing import run_distributed

TINY_BUCKETS = dict(bucket_cap_mb=0.0005, first_bucket_cap_mb=0.0002)
HOW = ("torch.compile(module)", "module.compile()", "torch.compile(ddp)")


def _compiled(base, how, wrap):
    """(model to call, DDP wrapper) with ``base`` compiled ``how``."""
    module = copy.deepcopy(base)
    if how == "torch.compile(module)":
        module = torch.compile(module, backend="aot_eager")
    elif how == "module.compile()":
        module.compile(backend="aot_eager")
    ddp = wrap(module)
    return (torch.compile(ddp, backend="aot_eager") if how == "torch.compile(ddp)" else ddp), ddp


def _worker(rank, world_size):
    import fusedist

    torch.manual_seed(0)
    base = models.MLP()
    out = {}
    for how in HOW:
        for kind in ("ddp+sgd", "zero1", "zero2"):
            ref = fusedist.DistributedDataParallel(copy.deepcopy(base), **TINY_BUCKETS)
            run, ddp = _compiled(base, how, lambda m: fusedist.DistributedDataParallel(m, **TINY_BUCKETS))
            if kind == "ddp+sgd":
                opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
                opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
            else:
                opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
                # Overlapped gathers: waited for by forward pre-hooks, which a compiled forward
                # may skip (Note [hooks inside compiled modules]).
                opt = fusedist.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, stage=int(kind[-1]),
                                                       lr=1e-2, overlap_param_gather=True)
            gen = torch.Generator().manual_seed(rank)
            for _ in range(4):
                x, y = models.MLP.batch(gen)
                for model, o in ((ref, opt_ref), (run, opt)):
                    o.zero_grad()
                    nn.functional.mse_loss(model(x), y).backward()
                    o.step()
            if kind != "ddp+sgd":
                opt.wait_for_params()
            out[(how, kind)] = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), ddp.parameters()))
    return out


def test_compiled_models_train_like_eager_ones():
    for rank, out in enumerate(run_distributed(_worker, 2, timeout=300)):
        for key, diff in out.items():
            # The same fp32 math in the same order (aot_eager runs the traced ops eagerly).
            assert diff < 1e-6, f"rank {rank}, {key}: max |eager - compiled| = {diff}"
