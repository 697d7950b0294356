"""Whole-parameter state dicts of a ``fully_shard`` model taken after a submodule was converted
on its own (``model.b[0].double()``), before the next forward: torch's FSDP2 reports the
converted dtype at once (its parameters are DTensors the conversion changed), and so must
``get_model_state_dict(full_state_dict=True)`` and ``fusedist.fsdp.full_state_dict``. They
gathered the unit's old shard instead, in the old dtype, until a forward took the conversion
up. World 2 on gloo, compared with FSDP2 on the same model and inputs."""

from __future__ import annotations

import torch
from torch import nn

from fusedist.testing import run_distributed


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 6)
        self.b = nn.Sequential(nn.Linear(6, 7), nn.Tanh())
        self.c = nn.Linear(7, 3)

    def forward(self, x):
        h = self.b(self.a(x.to(self.a.weight.dtype)).to(self.b[0].weight.dtype))
        return self.c(h.to(self.c.weight.dtype))


def _built(ours: bool, mesh):
    import fusedist
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    shard = fusedist.fully_shard if ours else torch_fully_shard
    torch.manual_seed(0)
    model = _Net()
    shard(model.b, mesh=mesh)
    shard(model, mesh=mesh)
    return model


def _full_dicts_after_conversion(rank, world):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from fusedist.fsdp import full_state_dict

    mesh = init_device_mesh("cpu", (world,))
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    full = StateDictOptions(full_state_dict=True)
    for convert in (lambda m: m.b[0].double(), lambda m: m.c.double()):  # a whole unit; part of the root's
        dicts = {}
        for ours in (False, True):
            model = _built(ours, mesh)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            model(x).pow(2).sum().backward()
            opt.step()
            convert(model)
            dicts[ours] = get_model_state_dict(model, options=full)
            if ours:
                dicts["own"] = full_state_dict(model)
        for got in (dicts[True], dicts["own"]):
            assert set(got) == set(dicts[False])
            for key, want in dicts[False].items():
                assert got[key].dtype == want.dtype, (key, got[key].dtype, want.dtype)
                torch.testing.assert_close(got[key], want, rtol=1e-6, atol=1e-6, msg=key)
    # the adopted conversion trains on as FSDP2's does
    losses = {}
    for ours in (False, True):
        model = _built(ours, mesh)
        model.b[0].double()
        get_model_state_dict(model, options=full)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            loss = model(x).pow(2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses[ours] = (loss.item(), get_model_state_dict(model, options=full))
    torch.testing.assert_close(losses[True][0], losses[False][0], rtol=1e-5, atol=1e-6)
    for key, want in losses[False][1].items():
        torch.testing.assert_close(losses[True][1][key], want, rtol=1e-5, atol=1e-6, msg=key)


def test_full_state_dict_after_a_submodule_conversion_has_fsdp2s_dtype():
    run_distributed(_full_dicts_after_conversion, 2, timeout=60)
