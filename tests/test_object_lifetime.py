"""Dropped training objects are freed: DDP models, their optimizers, ZeRO, SyncBatchNorm.

torch keeps a tensor's hooks where the garbage collector cannot see them, and fusedist's
process-wide pieces (the communicator cache and its monitor, the optimizer step guard) live
as long as the process group: any strong reference from there to a model keeps its
parameters, gradients and buckets alive for good. Each case trains one step, drops every
reference the test holds and collects garbage; a weak reference must then be dead. A closed
direct-NCCL communicator lets go of its process group likewise.
"""

import pytest

from fusedist.testing import run_distributed


def _dropped_objects_are_freed(rank, world_size):
    import gc
    import weakref

    import torch

    import fusedist

    def train(model, opt):
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()

    def mlp():
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))

    def mlp_with_sync_bn():
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
        return fusedist.nn.SyncBatchNorm.convert_sync_batchnorm(net)

    zero = fusedist.ZeroRedundancyOptimizer
    alive = {}
    cases = {  # name -> (module, optimizer of the DDP model)
        "ddp + torch SGD": (mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.1)),
        "ddp + ZeRO stage 1": (mlp, lambda m: zero(m.parameters(), stage=1, lr=0.1)),
        "ddp + ZeRO stage 2": (mlp, lambda m: zero(m.parameters(), stage=2, lr=0.1)),
        "ddp + ZeRO stage 2, CPU offload": (mlp, lambda m: zero(m.parameters(), stage=2, lr=0.1, offload="cpu")),
        "SyncBatchNorm + FusedAdamW": (mlp_with_sync_bn, lambda m: fusedist.optim.FusedAdamW(m.parameters(), lr=0.1)),
    }
    for name, (make_module, make_opt) in cases.items():
        model = fusedist.DistributedDataParallel(make_module())
        opt = make_opt(model)
        train(model, opt)
        refs = {"model": weakref.ref(model), "optimizer": weakref.ref(opt),
                "parameter": weakref.ref(next(model.module.parameters()))}
        del model, opt
        gc.collect()
        alive[name] = sorted(k for k, ref in refs.items() if ref() is not None)
    return alive


def test_dropped_models_and_optimizers_are_freed():
    for alive in run_distributed(_dropped_objects_are_freed, 2):
        assert alive == {name: [] for name in alive}, alive


def test_a_closed_nccl_communicator_lets_go_of_its_process_group(monkeypatch):
    """``close()`` runs when torch destroys the group (no GPU here: the communicator's NCCL pieces are
    stand-ins): the group is no longer held -- a communicator kept past the destroy would keep it into
    the interpreter's finalization -- and a later all-to-all, the one collective that used the group, is
    refused as closed rather than run on the default group."""
    import datetime
    import types
    import weakref

    import torch

    from fusedist.comm import nccl_comm
    from fusedist.comm.base import Communicator

    class Group:  # the process group a subgroup's communicator was made for
        pass

    aborts = []
    monkeypatch.setattr(nccl_comm, "return_comm_stream", lambda device, stream, torch_stream: None)
    comm = object.__new__(nccl_comm.NcclCommunicator)
    Communicator.__init__(comm, 0, 2, timeout=datetime.timedelta(seconds=60))
    comm._comm = types.SimpleNamespace(aborted=False, abort=aborts.append)
    comm.watchdog = types.SimpleNamespace(settle=lambda timeout_s: None, stop=lambda join_timeout: None, failure=None)
    comm._device, comm._stream, comm.torch_stream, comm.closed, comm._failure_raised = 0, None, None, False, False
    group = Group()
    comm.group, held = group, weakref.ref(group)
    del group
    comm.close()
    assert held() is None and comm.group is None and len(aborts) == 1
    with pytest.raises(RuntimeError, match="the NCCL communicator of rank 0 was closed"):
        comm._all_to_all(torch.zeros(2), torch.zeros(2), None, None)
