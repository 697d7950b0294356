"""Exit: what fusedist's exit hooks do after ``destroy_process_group()`` -- stop every thread they
started, and free the destroyed group while the interpreter still runs (Note [a released
communicator that outlives the exit hooks] in fusedist/comm/__init__.py)."""

import gc
import threading
import weakref

import torch
import torch.distributed as dist

from fusedist.testing import run_distributed


def _train_and_drop(rank, world):
    """A training ``main`` that returns: its DDP model goes with its frame."""
    from fusedist import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).sum().backward()
        opt.step()
        opt.zero_grad()
    weights = [p.detach().clone() for p in model.parameters()]
    gathered = [[torch.empty_like(w) for w in weights] for _ in range(world)]
    for i, w in enumerate(weights):
        dist.all_gather([g[i] for g in gathered], w)
    assert all(torch.equal(a, b) for g in gathered for a, b in zip(g, weights)), "replicas differ"


def _drain_after_destroy(rank, world):
    from fusedist.comm import _drain_at_exit

    before = set(threading.enumerate())
    _train_and_drop(rank, world)
    group = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()

    full = []
    callback = lambda phase, info: full.append(info) if phase == "start" and info["generation"] == 2 else None  # noqa
    gc.callbacks.append(callback)
    try:
        _drain_at_exit()  # what runs at interpreter exit
    finally:
        gc.callbacks.remove(callback)
    # the interpreter's own collection comes after it is marked finalizing, when freeing a gloo
    # group can abort the process: the group must be gone before the exit hooks return
    assert group() is None, f"rank {rank}: the destroyed group outlived the exit drain"
    assert len(full) <= 1, f"rank {rank}: the exit drain ran {len(full)} full garbage collections"
    left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    assert not left, f"rank {rank}: threads still running after the exit drain: {left}"


def test_exit_drain_after_destroy_stops_threads_and_frees_the_group():
    run_distributed(_drain_after_destroy, 2, timeout=60)
