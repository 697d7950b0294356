"""One pipeline stage per rank under each of fusedist's data-parallel wrappings, beside an unwrapped
twin: the set-up the accumulation tests of fusedist.pipelining share (pp 1 x dp 2, GPipe)."""

from __future__ import annotations

import torch

KINDS = ("fully_shard", "DistributedDataParallel", "replicate", "ZeRO-2")


def stages_of_each_kind(make_model, seed, n_microbatches, loss_fn, lr=0.1):
    """For each kind in ``KINDS``: ``(kind, ours, theirs, wrapped, schedule, opt, ref_opt)`` --
    ``ours`` wrapped and staged under GPipe, ``theirs`` its unwrapped twin (same ``seed``), each
    with SGD at ``lr`` (a stage-2 ZeroRedundancyOptimizer for "ZeRO-2")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import ScheduleGPipe

    import fusedist
    from fusedist.pipelining import PipelineStage

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "dp"))
    group = mesh["dp"].get_group()
    for kind in KINDS:
        ours, theirs = make_model(seed), make_model(seed)
        if kind == "fully_shard":
            wrapped = fusedist.fully_shard(ours, mesh=mesh["dp"])
        elif kind == "replicate":
            wrapped = fusedist.replicate(ours, device_mesh=mesh["dp"])
        else:
            wrapped = fusedist.DistributedDataParallel(ours, process_group=group)
        opt = (fusedist.ZeroRedundancyOptimizer(list(ours.parameters()), torch.optim.SGD, process_group=group,
                                                stage=2, lr=lr)
               if kind == "ZeRO-2" else torch.optim.SGD(ours.parameters(), lr=lr))
        stage = PipelineStage(wrapped, 0, 1, torch.device("cpu"), group=mesh["pp"].get_group())
        schedule = ScheduleGPipe(stage, n_microbatches=n_microbatches, loss_fn=loss_fn)
        yield kind, ours, theirs, wrapped, schedule, opt, torch.optim.SGD(theirs.parameters(), lr=lr)


def set_gradient_sync(kind, wrapped, synchronize: bool) -> None:
    """The user's own switch of each kind: the wrapper's flag, or the module's setter."""
    if kind in ("DistributedDataParallel", "ZeRO-2"):
        wrapped.require_backward_grad_sync = synchronize
    else:
        wrapped.set_requires_gradient_sync(synchronize)


def largest_difference(kind, wrapped, ours, theirs) -> float:
    """The largest difference between the wrapped model's whole weights and its twin's."""
    import fusedist

    whole = fusedist.fsdp.full_state_dict(wrapped) if kind == "fully_shard" else ours.state_dict()
    return max(float((whole[k] - v).abs().max()) for k, v in theirs.state_dict().items())
