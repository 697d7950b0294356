"""Reliability defects found by probing, each kept as a regression test (gloo, 2 ranks):

* a rank ended by an uncaught KeyboardInterrupt was reported as one that "EXITED without an
  error" (it ran fewer iterations), not as interrupted;
* an optimizer kept across a re-wrap of its module still counted its steps for the dropped
  wrapper: a rank that skipped ``optimizer.step()`` was never reported;
* one optimizer over two DDP models refused to step while only one of them had run a backward
  ("step() was called before any backward pass"), where torch's DDP steps the trained one;
* an optimizer built over a wrapper dropped at once (the plain module trained) refused its step
  ("not synchronized") on the ranks where no garbage collection had freed the wrapper yet, and
  trained on the others: the outcome now is torch's on every rank, whenever collections run.

The three runs share one launch of the ranks: torch's reference first (before any fusedist model
touched the group), the interrupted rank last (its crash entry stays in the group's store).
"""

import gc
import sys
import weakref

import pytest
import torch
from torch import nn

from shared_rank_launch import launch_for_selected, results_of, under_env

FAST_FAILURE = {"FUSEDIST_TIMEOUT_S": "5", "FUSEDIST_STALL_REPORT_S": "1"}


# ---------------------------------------------------------------- an interrupted rank
def _interrupted_worker(rank, world_size):
    import torch.distributed as dist

    import fusedist
    from fusedist.reliability import stall_report
    from fusedist.reliability.monitor import monitor_of

    model = fusedist.DistributedDataParallel(nn.Linear(4, 4))
    monitor = monitor_of(model.comm)
    if rank == 1:  # what Python does with an uncaught Ctrl-C, before the process exits
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            sys.excepthook(type(exc), exc, exc.__traceback__)
    dist.barrier()
    entries = stall_report.collect(monitor.store, monitor.group_name, monitor.generation, [0, 1], 0.5)
    return stall_report.render(entries, world_size, 0.5, rank)


def test_an_interrupted_rank_is_reported_as_interrupted_not_as_exited(launched):
    for report in results_of(launched, "interrupted"):
        assert "rank 1" in report and "CRASHED with KeyboardInterrupt" in report, report
        assert "EXITED" not in report


# ---------------------------------------------------------------- the step guard's models
def _models_worker(rank, world_size, which):
    import fusedist

    wrap = torch.nn.parallel.DistributedDataParallel if which == "torch" else fusedist.DistributedDataParallel
    torch.manual_seed(0)
    enc, head = nn.Linear(6, 5), nn.Linear(5, 3)
    gen = torch.Generator().manual_seed(100 + rank)
    out = {}

    # Two models, one optimizer; the first phase trains the encoder only.
    a, b = wrap(enc), wrap(head)
    opt = torch.optim.AdamW(list(a.parameters()) + list(b.parameters()), lr=0.1)
    try:
        for _ in range(2):
            opt.zero_grad()
            a(torch.randn(4, 6, generator=gen)).pow(2).mean().backward()
            opt.step()
        out["two_models"] = [p.detach().clone() for p in (*enc.parameters(), *head.parameters())]
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["two_models"] = f"{type(exc).__name__}: {exc}"
    out["dropped"] = _dropped_wrapper(rank, wrap, gen)
    if which == "torch":
        return out

    # The module wrapped again (the first wrapper dropped), the optimizer kept; rank 1 skips a step.
    model = fusedist.DistributedDataParallel(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    model(torch.randn(2, 4, generator=gen)).sum().backward()
    opt.step()
    module = model.module
    del model
    gc.collect()
    model = fusedist.DistributedDataParallel(module)
    try:
        for step in range(3):
            opt.zero_grad()
            model(torch.randn(2, 4, generator=gen)).sum().backward()
            if not (rank == 1 and step == 1):
                opt.step()
        model.check_consistency()
        out["rewrapped"] = "no error"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["rewrapped"] = f"{type(exc).__name__}: {exc}"
    return out


def _dropped_wrapper(rank, wrap, gen):
    """An optimizer built over a wrapper dropped at once, the plain module trained; a garbage
    collection runs on rank 0 only (automatic ones held off), as it may in any program."""
    from fusedist.ddp.reducer import Reducer

    torch.manual_seed(1)
    net = nn.Linear(6, 3)
    gc.disable()
    try:
        model = wrap(net)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        # fusedist's engine (hooks, step watch) goes with its wrapper, not at a later collection
        engine = weakref.ref(model.reducer) if isinstance(model.reducer, Reducer) else None
        del model
        if engine is not None and engine() is not None:
            return "the dropped wrapper's engine is still alive"
        if rank == 0:
            gc.collect()
        for _ in range(2):
            opt.zero_grad()
            net(torch.randn(4, 6, generator=gen)).pow(2).mean().backward()
            opt.step()
        return [p.detach().clone() for p in net.parameters()]
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"
    finally:
        gc.enable()


def test_step_guard_follows_rewrapped_modules_and_several_models(launched):
    ours, ref = results_of(launched, "models, fusedist"), results_of(launched, "models, torch")
    for rank in range(2):
        got, want = ours[rank]["two_models"], ref[rank]["two_models"]
        assert not isinstance(got, str), got
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
        got, want = ours[rank]["dropped"], ref[rank]["dropped"]  # torch: the plain module trains
        assert not isinstance(got, str), f"rank {rank}: {got}"
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
        text = ours[rank]["rewrapped"]
        assert text.startswith("RankMismatchError") and "optimizer_steps: ranks [0]: 2; ranks [1]: 1" in text, text


# ---------------------------------------------------------------- the shared launch
@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, {
        "test_step_guard_follows_rewrapped_modules_and_several_models": {
            "models, torch": (_models_worker, ("torch",)),
            "models, fusedist": (under_env, (FAST_FAILURE, _models_worker, "fusedist"))},
        "test_an_interrupted_rank_is_reported_as_interrupted_not_as_exited": {
            "interrupted": (under_env, (FAST_FAILURE, _interrupted_worker))},
    }, 2, timeout=150)
