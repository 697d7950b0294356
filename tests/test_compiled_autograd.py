"""fusedist's DDP and fully_shard under ``torch._dynamo.config.compiled_autograd = True``.

That setting enables compiled autograd only while a ``torch.compile``d function runs. With
``torch.compile(model)`` and ``loss.backward()`` outside it, the backward runs the plain autograd
engine, and torch's DDP (``optimize_ddp="python_reducer"``) and FSDP2 train as in eager; fusedist
refused it at the forward. With the whole training step compiled, the backward runs compiled and
fusedist refuses it by name on every rank; there the registration hooks fusedist installs in the
process failed inside dynamo ("KeyError: _orig_mod"), torch's own DDP included. Compiled autograd
enabled explicitly (``compiled_autograd._enable``) is refused at the forward
(tests/test_compiled_training_step.py).
"""

from __future__ import annotations

import contextlib
import copy
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import models
from shared_rank_launch import launch_for_selected, results_of, with_fresh_compiler

BACKEND = "eager"


def _batches(rank, steps=3):
    gen = torch.Generator().manual_seed(rank)
    return [models.MLP.batch(gen) for _ in range(steps)]


@contextlib.contextmanager
def _compiled_autograd_setting(python_reducer: bool = False):
    """The program-wide setting, and torch's DDP reducer that works with it where asked (read at
    torch's DDP construction)."""
    patches = {"compiled_autograd": True}
    if python_reducer:
        patches["optimize_ddp"] = "python_reducer"
    with torch._dynamo.config.patch(**patches):
        yield


def _train(model, batches, compile_step: bool):
    """An AdamW step a batch: ``torch.compile(model)`` with the backward outside it, or the whole
    forward and backward compiled."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = model if compile_step else torch.compile(model, backend=BACKEND)

    def step(x, y):
        F.mse_loss(run(x), y).backward()

    step = torch.compile(step, backend=BACKEND) if compile_step else step
    for x, y in batches:
        step(x, y)
        opt.step()
        opt.zero_grad()
    return model


def _full(model) -> list:
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(_full(a), _full(b)))


def _shard(model, shard_fn, ws):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    for layer in model.layers:
        shard_fn(layer, mesh=mesh)
    return shard_fn(model, mesh=mesh)


def _compiled_model_worker(rank, ws):
    """fusedist's DDP and fully_shard against torch's DDP and FSDP2, each under the setting with
    ``torch.compile(model)``; then, the fusedist wrappers built, torch's DDP in a compiled training
    step against its run above. The max |difference| of each pair's parameters after 3 steps."""
    import fusedist
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    base, batches = models.MLP(), _batches(rank)
    with _compiled_autograd_setting(python_reducer=True):
        theirs = _train(nn.parallel.DistributedDataParallel(copy.deepcopy(base)), batches, compile_step=False)
        ours = _train(fusedist.DistributedDataParallel(copy.deepcopy(base)), batches, compile_step=False)
        fsdp2 = _train(_shard(copy.deepcopy(base), fully_shard, ws), batches, compile_step=False)
        sharded = _train(_shard(copy.deepcopy(base), fusedist.fully_shard, ws), batches, compile_step=False)
        diffs = {"DistributedDataParallel": _max_diff(theirs.module, ours.module),
                 "fully_shard": _max_diff(fsdp2, sharded)}
        try:
            step = _train(nn.parallel.DistributedDataParallel(copy.deepcopy(base)), batches, compile_step=True)
            diffs["torch's DDP, compiled step"] = _max_diff(theirs.module, step.module)
        except Exception:  # noqa: BLE001 - its own test reports it
            diffs["torch's DDP, compiled step"] = traceback.format_exc()
    return diffs


def test_compiled_model_with_the_setting_matches_torch(launched):
    """fusedist was refused at the forward, where torch's DDP and FSDP2 train; torch's DDP in a
    compiled step failed inside dynamo ("KeyError: _orig_mod") once any fusedist wrapper had been
    built in the process (Note [registration hooks called outside a trace])."""
    for rank, diffs in enumerate(results_of(launched, "compiled model")):
        for kind, diff in diffs.items():
            assert not isinstance(diff, str) and diff < 1e-5, f"rank {rank}: {kind}: max |torch - fusedist|: {diff}"


def _compiled_step_worker(rank, ws):
    """A whole training step compiled under the setting, whose backward runs under compiled
    autograd: what each wrapper raised."""
    import fusedist

    raised = {}
    for kind in ("DistributedDataParallel", "fully_shard"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = models.MLP(d_in=16, hidden=8, d_out=4, layers=2)
        with _compiled_autograd_setting():
            model = _shard(model, fusedist.fully_shard, ws) if kind == "fully_shard" \
                else fusedist.DistributedDataParallel(model)
            raised[kind] = models.error_text(lambda: _train(model, _batches(rank, steps=1), compile_step=True))
    return raised


@pytest.mark.parametrize("kind", ["DistributedDataParallel", "fully_shard"])
def test_compiled_step_with_the_setting_refused_by_name(kind, launched):
    """DDP's backward failed inside dynamo ("KeyError: _orig_mod", its registration hook compiled
    as a frame of its own) instead of naming compiled autograd."""
    for rank, raised in enumerate(results_of(launched, "compiled step")):
        assert f"fusedist {kind}: compiled autograd is enabled" in (raised[kind] or "no error"), (rank, raised[kind])


@pytest.fixture(scope="module")
def launched(request):
    """One launch of 2 ranks for the file's scenarios: no other file's launch runs under this
    setting, and its compiles would change what that launch's scenarios compile."""
    return launch_for_selected(request, with_fresh_compiler({
        "test_compiled_model_with_the_setting_matches_torch": {"compiled model": (_compiled_model_worker,)},
        "test_compiled_step_with_the_setting_refused_by_name": {"compiled step": (_compiled_step_worker,)},
    }), 2, timeout=600)
