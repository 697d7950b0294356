"""A whole training step under ``torch.compile`` (backend ``eager``; a recompile past dynamo's
limit made an error), in configurations that failed:

* a join context inside the compiled step, or around a compiled loop with uneven inputs:
  dynamo traced the context's enter and exit and the join hooks into fusedist's
  communicator, and every rank failed at the first compiled step;
* a gradient clip (fusedist's or torch's) over ``fully_shard`` or ZeRO-2 parameters of more
  than eight shapes: the lookup of each parameter's gradient holder, traced, recompiled per
  shape past the limit.

* torch's ``clip_grad_norm_`` / ``clip_grad_value_`` over parameters no fusedist object shards, in
  ``torch.compile(..., fullgraph=True)``, once a ``fully_shard`` unit exists in the process (which
  replaces torch's clip process-wide, Note [torch's clip on plain parameters under torch.compile]
  in fusedist/optim/torch_clip.py): the replacement ran eagerly, so dynamo refused the graph that
  it captures whole with torch's own function.

Compared with torch's DDP run eagerly; the number of graphs stays the same from step to step.
The plain clips are compared with torch's clip as shipped, run eagerly on the same fresh
gradients (fp32, the same operations in the same order: 1e-6), traced once for every step; the
sharded path keeps its global norm (torch's clip on the whole model over both ranks' batches)
and, under fullgraph=True, its refusal naming why.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import models
from shared_rank_launch import launch_for_selected, results_of, with_fresh_compiler

BACKEND = "eager"


def _batches(rank, steps=3):
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)) for _ in range(steps)]


def _run(step, batches):
    """``step`` compiled, over ``batches``; the number of graphs compiled after each step."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(step, backend=BACKEND)
    graphs = []
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for x, y in batches:
            fn(x, y)
            graphs.append(counters["stats"]["unique_graphs"])
    return graphs


def _max_diff(a, b):
    return max((x.detach() - y.detach()).abs().max().item() for x, y in zip(a, b))


def _torch_reference(base, batches):
    """torch's DDP and AdamW run eagerly."""
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x, y in batches:
        F.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    return list(ref.parameters())


def _join_worker(rank, ws):
    import fusedist
    from torch.distributed.algorithms import Join as TorchJoin

    torch.manual_seed(0)
    base = models.BlockStack(d_in=5, d=8, d_out=3, blocks=2)
    batches = _batches(rank)
    ref = _torch_reference(base, batches)
    out = {}
    for how in ("model.join()", "fusedist.Join", "torch Join, ZeRO-2"):
        model = fusedist.DistributedDataParallel(copy.deepcopy(base))
        if how.endswith("ZeRO-2"):
            opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-2)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def step(x, y):
            ctx = (model.join() if how == "model.join()" else fusedist.Join([model]) if how == "fusedist.Join"
                   else TorchJoin([model, opt]))
            with ctx:
                F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

        graphs = _run(step, batches)
        out[how] = (_max_diff(ref, model.parameters()), graphs)
    return out


PLAIN_STEPS, PLAIN_MAX_NORM, PLAIN_CLIP_VALUE = 3, 0.1, 0.05
PLAIN_TOL = dict(rtol=1e-6, atol=1e-6)


def _plain_fullgraph_worker(rank, ws):
    """torch's clips over plain parameters compiled with fullgraph=True beside a fully_shard unit."""
    import gc

    import fusedist
    from torch._dynamo.testing import CompileCounter
    from torch.distributed.device_mesh import init_device_mesh

    from fusedist.optim import torch_clip
    from fusedist.optim.torch_clip import torch_clip_grad_norm_

    gc.collect()  # (the earlier scenarios' models: none collected while this one compiles)
    torch_clip_value = torch_clip._TORCH_CLIP_VALUE  # torch's own, as shipped
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
        return torch.nn.utils.clip_grad_norm_(plain.parameters(), PLAIN_MAX_NORM)

    @torch.compile(fullgraph=True, backend=value_counter)
    def clip_value():
        torch.nn.utils.clip_grad_value_(plain.parameters(), PLAIN_CLIP_VALUE)

    for step in range(PLAIN_STEPS):
        for p, r in zip(plain.parameters(), reference.parameters()):
            p.grad = torch.randn(p.shape, generator=gen)
            r.grad = p.grad.clone()
        norm = clip_norm()
        expected = torch_clip_grad_norm_(reference.parameters(), PLAIN_MAX_NORM)
        torch.testing.assert_close(norm, expected, **PLAIN_TOL, msg=lambda m: f"rank {rank} step {step} norm: {m}")
        clip_value()
        torch_clip_value(reference.parameters(), PLAIN_CLIP_VALUE)
        for p, r in zip(plain.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, r.grad, **PLAIN_TOL, msg=lambda m: f"rank {rank} step {step}: {m}")
    assert (norm_counter.frame_count, value_counter.frame_count) == (1, 1), (
        f"rank {rank}: traced {norm_counter.frame_count} / {value_counter.frame_count} times in {PLAIN_STEPS} steps")

    # the sharded path: the global norm, and under fullgraph=True the eager replacement's refusal
    xs = [torch.randn(3, 6, generator=torch.Generator().manual_seed(50 + r)) for r in range(ws)]
    full = copy.deepcopy(base)
    sum(F.mse_loss(full(x), x[:, :1]) for x in xs).div(ws).backward()
    expected = torch_clip_grad_norm_(full.parameters(), PLAIN_MAX_NORM)
    F.mse_loss(sharded(xs[rank]), xs[rank][:, :1]).backward()
    norm = torch.compile(lambda: torch.nn.utils.clip_grad_norm_(sharded.parameters(), PLAIN_MAX_NORM),
                         backend="eager")()
    torch.testing.assert_close(norm, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} sharded: {m}")
    torch._dynamo.reset()
    try:
        torch.compile(lambda: torch.nn.utils.clip_grad_norm_(sharded.parameters(), PLAIN_MAX_NORM),
                      backend="eager", fullgraph=True)()
    except Exception as e:  # dynamo's error type differs between versions
        assert "replaced by fusedist" in str(e), f"rank {rank}: {e}"
    else:
        raise AssertionError(f"rank {rank}: the sharded clip was captured under fullgraph=True")
    return True


@pytest.fixture(scope="module")
def shared_launch(request):
    """One launch of 2 ranks runs the selected tests' workers in turn, each with a fresh dynamo
    (each launch costs a process group and the imports in every rank); a worker's error fails
    only its test."""
    return launch_for_selected(request, with_fresh_compiler({
        "test_join_context_inside_compiled_step_matches_torch": {"join": (_join_worker,)},
        "test_compiled_training_loop_in_join_context_with_uneven_inputs_matches_torch": {"uneven": (_uneven_worker,)},
        "test_clip_in_compiled_step_over_many_parameter_shapes_matches_torch": {"clip": (_clip_worker,)},
        # (last: the models it leaves would change when the others' are collected, and so their guards)
        "test_torch_clip_of_plain_parameters_compiles_fullgraph_beside_fully_shard": {
            "plain_fullgraph": (_plain_fullgraph_worker,)},
    }), 2, timeout=600)


def test_join_context_inside_compiled_step_matches_torch(shared_launch):
    """The context's enter and exit (the count of ranks still training) and, under torch's
    Join, fusedist's join hooks (the shadowed step check) were traced into the communicator."""
    for rank, out in enumerate(results_of(shared_launch, "join")):
        for how, (diff, graphs) in out.items():
            assert diff < 1e-5, f"rank {rank}, {how}: max |torch DDP - fusedist| = {diff}"
            assert graphs[-1] == graphs[0], f"rank {rank}, {how}: recompiled, graphs after each step {graphs}"


def _uneven_worker(rank, ws):
    import fusedist
    from torch.distributed.algorithms import Join as TorchJoin

    torch.manual_seed(0)
    base = models.BlockStack(d_in=5, d=8, d_out=3, blocks=2)
    batches = _batches(rank, steps=2 + rank)  # rank 0 joins after two steps, rank 1 trains a third
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with TorchJoin([ref]):
        for x, y in batches:
            F.mse_loss(ref(x), y).backward()
            opt.step()
            opt.zero_grad()
    out = {}
    for how in ("fusedist.Join", "torch Join, ZeRO-2"):
        torch._dynamo.reset()
        model = fusedist.DistributedDataParallel(copy.deepcopy(base))
        if how.endswith("ZeRO-2"):
            opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-2)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def train(batches):
            with fusedist.Join([model]) if how == "fusedist.Join" else TorchJoin([model, opt]):
                for x, y in batches:
                    F.mse_loss(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()

        torch.compile(train, backend=BACKEND)(batches)
        out[how] = _max_diff(ref.parameters(), model.parameters())
    return out


def test_compiled_training_loop_in_join_context_with_uneven_inputs_matches_torch(shared_launch):
    """The joined rank's hooks (DDP's shadowed collectives, ZeRO's shadowed step) were traced
    when the loop with its join context was compiled."""
    for rank, out in enumerate(results_of(shared_launch, "uneven")):
        for how, diff in out.items():
            assert diff < 1e-5, f"rank {rank}, {how}: max |torch DDP under Join - fusedist| = {diff}"


class Ladder(nn.Module):
    """Linear layers of distinct widths: every parameter (and every piece of one) a shape of its own."""

    def __init__(self, widths=(5, 6, 7, 9, 10, 11, 12, 3)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


def _clip_worker(rank, ws):
    import fusedist
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    base = Ladder()
    batches = _batches(rank)
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches:
        F.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    ref = list(ref.parameters())
    out = {}
    for how in ("fully_shard, fusedist clip", "fully_shard, torch clip", "ZeRO-2, fusedist clip",
                "ZeRO-2, torch clip"):
        model = copy.deepcopy(base)
        if how.startswith("fully_shard"):
            mesh = init_device_mesh("cpu", (ws,))
            for layer in model.layers:
                fusedist.fully_shard(layer, mesh=mesh)
            fusedist.fully_shard(model, mesh=mesh)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        else:
            model = fusedist.DistributedDataParallel(model)
            opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, stage=2, lr=0.1)
        clip = fusedist.clip_grad_norm_ if "fusedist" in how else torch.nn.utils.clip_grad_norm_

        def step(x, y):
            F.mse_loss(model(x), y).backward()
            clip(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()

        graphs = _run(step, batches)
        got = (list(fusedist.fsdp.full_state_dict(model).values()) if how.startswith("fully_shard")
               else list(model.parameters()))
        out[how] = (_max_diff(ref, got), graphs)
    return out


def test_clip_in_compiled_step_over_many_parameter_shapes_matches_torch(shared_launch):
    """The clips look up each parameter's gradient holder: traced, the lookup recompiled per
    parameter shape, past dynamo's limit with more than eight."""
    for rank, out in enumerate(results_of(shared_launch, "clip")):
        for how, (diff, graphs) in out.items():
            assert diff < 1e-5, f"rank {rank}, {how}: max |torch DDP - fusedist| = {diff}"
            assert graphs[-1] == graphs[0], f"rank {rank}, {how}: recompiled, graphs after each step {graphs}"


def test_torch_clip_of_plain_parameters_compiles_fullgraph_beside_fully_shard(shared_launch):
    assert results_of(shared_launch, "plain_fullgraph") == [True, True]
