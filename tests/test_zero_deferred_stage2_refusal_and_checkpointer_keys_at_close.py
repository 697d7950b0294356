"""A stage 2 completed by ``add_param_group`` refused on one rank only, and the store keys a
Checkpointer leaves once closed; one launch of 2 gloo ranks."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import models
from shared_rank_launch import launch_for_selected, results_of, under_env

REFUSAL_ENV = {"FUSEDIST_TIMEOUT_S": "20"}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _averaging_hook(state, bucket):
    """A communication hook of one's own (torch's recipe): DDP's gradient sync becomes the hook."""
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _hook_on_rank_1_only(rank, world_size):
    """Stage 2 over a model whose communication hook is registered on rank 1 only, built whole by the
    constructor and completed by ``add_param_group`` (torch's recipe of a subset, then the head): each
    path's error and seconds on this rank, and the optimizer's group count after the refused group."""
    import fusedist

    out = {}
    for path in ("constructor", "add_param_group"):
        ddp = fusedist.DistributedDataParallel(_model())
        if rank == 1:
            ddp.register_comm_hook(None, _averaging_hook)
        body, head = list(ddp.module[0].parameters()), list(ddp.module[2].parameters())
        if path == "constructor":
            out[path] = models.raised_timed(
                lambda: fusedist.ZeroRedundancyOptimizer(body + head, torch.optim.SGD, stage=2, lr=0.1))
            continue
        opt = fusedist.ZeroRedundancyOptimizer(body, torch.optim.SGD, stage=2, lr=0.1)
        out[path] = models.raised_timed(lambda: opt.add_param_group({"params": head, "lr": 0.01}))
        out["groups after"] = len(opt.param_groups)
    return out


def test_a_hook_on_one_rank_refuses_a_stage2_completed_by_add_param_group_on_every_rank(launched):
    """Before, the group completing the model installed stage 2 after it was added: rank 1 refused its hook
    there alone, with the group added, and rank 0 went on to train with stage 2 installed (its next
    backward's reduce-scatter waiting for rank 1's all-reduce). Now the refusal is compared with the
    group, as the constructor's is: every rank raises the constructor's RankMismatchError at once,
    naming rank 1 and its hook, and the group is not added."""
    for rank, out in enumerate(results_of(launched, "hook on rank 1")):
        built, added = out["constructor"], out["add_param_group"]
        for error, seconds in (built, added):
            assert error is not None and error.startswith("RankMismatchError"), (rank, error)
            assert f"this is rank {rank}" in error and "ranks [1]: this rank's own refusal" in error, error
            assert "already synchronized by the communication hook _averaging_hook" in error, error
            assert seconds < 5, (rank, seconds)
        assert out["groups after"] == 1, (rank, out)


def _checkpointer_keys(rank, world_size, directory):
    """The keys a Checkpointer added to the store once it saved twice (in the background) and was closed,
    and those torch's ``new_group`` adds (a Checkpointer makes a
    process group of its own, whose rendezvous keys stay as torch's do); each count between barriers."""
    from fusedist import checkpoint
    from fusedist.reliability.stall_report import default_store

    store = default_store()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint.save(os.path.join(directory, "first"), model, opt)  # (this process's beat key, kept)
    dist.barrier()
    before = store.num_keys()
    dist.barrier()
    dist.new_group(list(range(world_size)), backend="gloo")
    dist.barrier()
    added = {"torch's new_group": store.num_keys() - before}
    dist.barrier()
    dist.barrier()
    before = store.num_keys()
    dist.barrier()
    saver = checkpoint.Checkpointer(os.path.join(directory, "periodic"), keep=2)
    saver.restore(model, opt)
    for step in (1, 2):  # (each save's start removes the barrier keys of the save before the last)
        saver.save(step)
    saver.close()
    dist.barrier()
    added["Checkpointer"] = store.num_keys() - before
    dist.barrier()
    return added


def test_a_closed_checkpointer_leaves_no_store_keys(launched):
    """Before, a closed Checkpointer left the barrier keys of its last two saves (16 keys) in the store
    for its life; close() now removes the older round's (as the next save would) and the last round's, which
    ended with an exchange every rank joined after leaving its barriers: what stays is its process group's
    rendezvous keys, as many as torch's ``new_group`` leaves."""
    for rank, added in enumerate(results_of(launched, "checkpointer keys")):
        group_keys = added.pop("torch's new_group")
        assert added == {"Checkpointer": group_keys}, (rank, added)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("followups"))
    return launch_for_selected(request, {
        "test_a_hook_on_one_rank_refuses_a_stage2_completed_by_add_param_group_on_every_rank": {
            "hook on rank 1": (under_env, (REFUSAL_ENV, _hook_on_rank_1_only))},
        "test_a_closed_checkpointer_leaves_no_store_keys": {
            "checkpointer keys": (_checkpointer_keys, (directory,))},
    }, 2, timeout=120)
