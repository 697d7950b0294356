"""Dropped training objects are freed: DDP models, their optimizers, ZeRO, SyncBatchNorm.

torch keeps a tensor's hooks where the garbage collector cannot see them, and fusedist's
process-wide pieces (the communicator cache and its monitor, the optimizer step guard) live
as long as the process group: any strong reference from there to a model keeps its
parameters, gradients and buckets alive for good. Each case trains one step, drops every
reference the test holds and collects garbage; a weak reference must then be dead.
"""

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
