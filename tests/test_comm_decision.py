"""Which communicator a rank gets for CUDA tensors, decided the same way on every rank
(Note [one decision on every rank], Note [no recovery after an abort] in
fusedist/comm/__init__.py), and bound to the device the caller names. Checked on CPU with
gloo: the decision, the cache and the refusals are Python, and a stand-in factory takes the
place of the direct-NCCL communicator where one is needed."""

import logging

import pytest
import torch

from fusedist.testing import run_distributed


def _extension_missing_on_rank_1(rank, world_size):
    """Rank 1 runs as if ``fusedist._C`` had failed to import there (a mixed install); the
    registration is redone as at import, then both ranks ask for a CUDA communicator."""
    import fusedist.comm as comm_mod
    from fusedist import _extension
    from fusedist.comm import TorchCommunicator, get_communicator

    if rank == 1:
        _extension._modules["_C"] = None
        _extension._errors["_C"] = "ImportError: libcudart.so.13: cannot open shared object file"
    comm_mod._cuda_factory = None
    comm_mod._register_direct_nccl()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("fusedist.comm.nccl_comm").addHandler(handler)
    comm = get_communicator(device="cuda")
    assert isinstance(comm, TorchCommunicator), type(comm)
    # The next collective pairs with the other rank's (nobody is still in the NCCL exchange).
    t = torch.full((4,), float(rank + 1))
    comm.all_reduce(t, tag="after the decision")
    return t.tolist(), [r.getMessage() for r in records]


def test_extension_missing_on_one_rank_falls_back_on_every_rank_together():
    # Before the shared decision, rank 1 built a torch communicator straight away while rank 0
    # waited in the NCCL communicator's readiness exchange: its all_reduce paired with that
    # exchange, and the run failed or hung.
    results = run_distributed(_extension_missing_on_rank_1, 2, timeout=90, pg_timeout=15)
    for total, messages in results:
        assert total == [3.0] * 4
        # Every rank learns every rank's reason, rank 1's missing extension among them.
        text = "\n".join(messages)
        assert "rank 1: the CUDA extension is not built (ImportError: libcudart.so.13" in text, text


def _comm_setting_per_rank(rank, world_size, settings):
    """Each rank sets its own FUSEDIST_COMM (an environment variable: per process), then asks
    for a CUDA communicator through the registered direct-NCCL factory."""
    import os

    import fusedist.comm as comm_mod
    from fusedist._consistency import RankMismatchError
    from fusedist.comm import TorchCommunicator, get_communicator

    os.environ["FUSEDIST_COMM"] = settings[rank]
    comm_mod._register_direct_nccl()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("fusedist.comm.nccl_comm").addHandler(handler)
    try:
        comm = get_communicator(device="cuda")
    except RankMismatchError as exc:
        outcome = ("mismatch", str(exc))
    else:
        assert isinstance(comm, TorchCommunicator), type(comm)
        outcome = ("torch", [r.getMessage() for r in records])
    # Whatever the outcome, the ranks are still paired: the next collective matches up.
    t = torch.full((2,), float(rank + 1))
    torch.distributed.all_reduce(t)
    return outcome, t.tolist()


def test_comm_setting_that_differs_across_ranks_fails_on_every_rank():
    # Before the setting travelled in the exchange, rank 0 (torch) built its communicator at
    # once while rank 1 waited in the direct-NCCL readiness exchange: the next collectives
    # paired with the wrong partners.
    results = run_distributed(_comm_setting_per_rank, 2, ["torch", "auto"], timeout=90, pg_timeout=15)
    for rank, ((kind, message), total) in enumerate(results):
        assert kind == "mismatch" and total == [3.0, 3.0]
        for needle in ("FUSEDIST_COMM differs across the ranks", "rank 0: torch, rank 1: auto",
                       f"this is rank {rank}", "set it the same on every rank"):
            assert needle in message, message


def test_comm_setting_torch_on_every_rank_uses_torch_without_a_fallback_warning():
    results = run_distributed(_comm_setting_per_rank, 2, ["torch", "torch"], timeout=90, pg_timeout=15)
    for (kind, messages), total in results:
        assert kind == "torch" and messages == [] and total == [3.0, 3.0]


class _StandIn:
    """A factory recording what it was asked for, returning torch communicators that can be
    marked aborted (as a timed-out NCCL communicator is)."""

    def __init__(self):
        self.calls = []

    def __call__(self, group, device):
        from fusedist.comm import TorchCommunicator

        class Comm(TorchCommunicator):
            name = "stand-in"
            aborted = False
            abort_reason = ""

        self.calls.append(device)
        comm = Comm(group)
        comm.bound_device = device
        return comm


def _binding_membership_abort(rank, world_size):
    import torch.distributed as dist

    import fusedist.comm as comm_mod
    from fusedist.comm import CollectiveError, get_communicator, register_cuda_communicator

    out = {}
    factory = _StandIn()
    register_cuda_communicator(factory)
    # Finding 5: bound to the device the caller names, one communicator per device.
    c1 = get_communicator(device="cuda:1")
    c0 = get_communicator(device="cuda:0")
    out["devices"] = [str(c1.bound_device), str(c0.bound_device)]
    out["distinct"] = c1 is not c0
    out["cached"] = get_communicator(device=torch.device("cuda", 1)) is c1
    # Finding 5: a rank outside the group is refused with a clear error, for both kinds.
    only_rank0 = dist.new_group([0])
    for device in ("cpu", "cuda:0"):
        if rank == 0:
            assert get_communicator(only_rank0, device).world_size == 1
        else:
            with pytest.raises(ValueError, match="rank 1 is not a member of this process group"):
                get_communicator(only_rank0, device)
    # Finding 6: an aborted communicator is not handed out again as if usable; the message
    # says the group must be rebuilt. A new group gets a fresh communicator.
    c0.aborted, c0.abort_reason = True, "all_reduce [ddp bucket 3] did not complete within 10 s"
    with pytest.raises(CollectiveError) as info:
        get_communicator(device="cuda:0")
    out["abort_message"] = str(info.value)
    with pytest.raises(CollectiveError):
        get_communicator(device="cuda:0")  # still, on every later lookup
    rebuilt = dist.new_group([0, 1])
    fresh = get_communicator(rebuilt, "cuda:0")
    out["fresh"] = fresh is not c0 and not fresh.aborted
    t = torch.ones(2)
    fresh.all_reduce(t)
    out["sum"] = t.tolist()
    out["calls"] = [str(d) for d in factory.calls]
    comm_mod._register_direct_nccl()
    return out


def test_device_binding_non_members_and_aborted_communicators():
    for rank, out in enumerate(run_distributed(_binding_membership_abort, 2, timeout=90, pg_timeout=15)):
        assert out["devices"] == ["cuda:1", "cuda:0"] and out["distinct"] and out["cached"]
        # Then the one-rank group (on its member only) and the rebuilt group.
        assert out["calls"] == ["cuda:1", "cuda:0"] + ["cuda:0"] * (2 if rank == 0 else 1)
        message = out["abort_message"]
        for needle in ("was aborted after an earlier failure (all_reduce [ddp bucket 3] did not "
                       "complete within 10 s)", "destroy and re-create the process group",
                       "new_group", "restart the job"):
            assert needle in message, message
        assert out["fresh"] and out["sum"] == [2.0, 2.0]
