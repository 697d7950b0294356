"""FusedistFabricStrategy against Fabric's own ``strategy="ddp"`` where an optimizer is used through
the wrapper Fabric (or Lightning's Trainer) puts around it, and where ``fabric.setup_optimizers``
is given several ZeRO optimizers for one module.

* A GAN loop: the generator's backward also writes the discriminator's gradients, which
  ``opt_d.zero_grad()`` clears. Through Fabric's wrapper, ZeroRedundancyOptimizer's zero_grad ran
  with the wrapper as ``self`` and kept the stage-2 gradient shard, so the discriminator then
  stepped with the generator step's gradients too (weights off by 1e-2 after a few steps; the
  same loop matches to 1e-7). Note [state shared with wrappers] in
  ``fusedist/zero/shared_state.py``.
* ``fabric.setup_optimizers(opt_a, opt_b)`` over one module with ``zero_stage`` 1 or 2: refused
  with the strategy's advice, as ``fabric.setup(module, opt_a, opt_b)`` is (ZeRO's own message
  advised freezing the parameters the other optimizer trains).

Ranks are processes of :func:`fusedist.testing.run_distributed` with the torchelastic variables
set, so Fabric starts no workers of its own. Tolerance 1e-5 as in test_fabric_strategy.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from shared_rank_launch import results_of
from test_e2e_lightning_recipe import _launched_env
from test_lightning_launch import register, shared_launch

TOL = 1e-5


def _fabric(strategy):
    import lightning as L

    fabric = L.Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy)
    fabric.launch()
    return fabric


def _flat(module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _gan(fabric, rank: int):
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
    critic = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    generator, opt_g = fabric.setup(generator, torch.optim.Adam(generator.parameters(), lr=1e-2, betas=(0.5, 0.9)))
    critic, opt_d = fabric.setup(critic, torch.optim.SGD(critic.parameters(), lr=1e-2, momentum=0.9))
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + rank)
        real, z = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        fabric.backward(critic(generator(z).detach()).mean() - critic(real).mean())
        opt_d.step()
        opt_d.zero_grad()
        fabric.backward(-critic(generator(z)).mean())  # writes the critic's gradients too
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()
    return _flat(generator), _flat(critic)


def _gan_loop(rank, world, zero_stage):
    _launched_env(rank, world)
    from fusedist.integrations.fabric import FusedistFabricStrategy

    ours = _gan(_fabric(FusedistFabricStrategy(zero_stage=zero_stage)), rank)
    theirs = _gan(_fabric("ddp"), rank)
    for name, a, b in zip(("generator", "critic"), ours, theirs):
        assert (a - b).abs().max().item() <= TOL, (name, (a - b).abs().max().item())

    # Lightning's LightningOptimizer wraps an optimizer the same way (manual optimization)
    import fusedist
    from lightning.pytorch.core.optimizer import LightningOptimizer

    from fusedist.integrations._optimizer_swap import convert_optimizer

    torch.manual_seed(0)
    module = fusedist.DistributedDataParallel(nn.Linear(8, 3))
    optimizer = convert_optimizer(torch.optim.SGD(module.parameters(), lr=0.1), fused_optimizer=True,
                                  zero_stage=zero_stage, master_weights=False, strategy="test", fresh_from="")
    wrapped = LightningOptimizer(optimizer)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    module(x).pow(2).sum().backward()  # to be cleared
    wrapped.zero_grad()
    module(x).sum().backward()
    before = _flat(module)
    optimizer.step()
    # d(sum(Wx + b))/dW is the batch's column sums, averaged over the ranks
    xs = torch.cat([torch.randn(4, 8, generator=torch.Generator().manual_seed(r)) for r in range(world)])
    expected = torch.cat([(xs.sum(0) / world).repeat(3), torch.full((3,), 4.0)])
    assert torch.allclose(before - _flat(module), 0.1 * expected, atol=TOL), (before - _flat(module), expected)


GAN_STAGES = [2]


@pytest.mark.parametrize("zero_stage", GAN_STAGES)
def test_gan_loop_with_two_zero_optimizers_trains_as_fabrics_ddp(zero_stage, launched):
    results_of(launched, f"gan {zero_stage}")


def _separate_setup_refusal(rank, world):
    _launched_env(rank, world)
    from fusedist.integrations.fabric import FusedistFabricStrategy

    for zero_stage in (1, 2):
        fabric = _fabric(FusedistFabricStrategy(zero_stage=zero_stage))
        model = fabric.setup_module(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)))
        first = torch.optim.AdamW(model.module[0].parameters(), lr=1e-2)
        second = torch.optim.SGD(model.module[2].parameters(), lr=0.1)
        with pytest.raises(ValueError, match=r"zero_stage=%d\) shards one optimizer over all the trainable "
                                             r"parameters of its module.*\['2.weight', '2.bias'\].*zero_stage=0"
                           % zero_stage):
            fabric.setup_optimizers(first, second)
    # one optimizer holding the whole module is set up as before
    model = fabric.setup_module(nn.Linear(8, 3))
    fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))


def test_setup_optimizers_refuses_several_zero_optimizers_for_one_module_by_name(launched):
    results_of(launched, "separate setup")


def _jobs(tmp_path_factory):
    """Both tests' cases (each sets up its own Fabrics and models), in the launch shared with
    the other Lightning and Fabric files (test_lightning_launch.py)."""
    return {
        "test_gan_loop_with_two_zero_optimizers_trains_as_fabrics_ddp": {
            f"gan {stage}": (_gan_loop, (stage,)) for stage in GAN_STAGES},
        "test_setup_optimizers_refuses_several_zero_optimizers_for_one_module_by_name": {
            "separate setup": (_separate_setup_refusal, ())},
    }


register(_jobs, seconds=300)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    return shared_launch(request, tmp_path_factory)
