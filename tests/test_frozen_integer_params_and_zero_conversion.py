"""Parameters of unusual dtypes against torch's engines.

* ``fully_shard`` over a unit holding frozen integer / bool parameters (quantization codes, masks
  stored as ``nn.Parameter(..., requires_grad=False)``): FSDP2 shards them like any tensor; fusedist
  failed at wrap time ("only Tensors of floating point dtype can require gradients").
* ``ZeroRedundancyOptimizer`` without a DDP model, the module converted (``model.double()``) after
  the optimizer was built: a KeyError at the first step, or parameters silently no longer updated
  after it; now a RuntimeError naming the parameter and both dtypes, on every rank.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed


class _Quantized(nn.Module):
    """A trainable Linear next to frozen int8 codes, a bool mask and a frozen bf16 table."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.lin = nn.Linear(6, 6)
        self.codes = nn.Parameter(torch.randint(-100, 100, (6, 6), dtype=torch.int8, generator=g),
                                  requires_grad=False)
        self.mask = nn.Parameter(torch.rand(6, generator=g) > 0.3, requires_grad=False)
        self.table = nn.Parameter(torch.randn(6, 6, generator=g).bfloat16(), requires_grad=False)

    def forward(self, x):
        w = self.codes.to(x.dtype) / 100 + self.table.to(x.dtype)
        return (self.lin(x) @ w) * self.mask.to(x.dtype)


def _fully_shard_worker(rank, ws, seed):
    import fusedist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fusedist.testing.fsdp_compare import full_state

    mesh = init_device_mesh("cpu", (ws,))
    torch.manual_seed(seed)
    base = _Quantized(seed)
    states = {}
    for ours in (True, False):
        model = copy.deepcopy(base)
        (fusedist.fully_shard if ours else torch_fully_shard)(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            x = torch.randn(3, 6, generator=torch.Generator().manual_seed(seed + 10 * rank + step))
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
        states[ours] = {k: v.detach().clone() for k, v in full_state(model, ours).items()}
    return states


def test_fully_shard_takes_frozen_integer_and_bool_parameters_as_fsdp2():
    seed = int(torch.randint(0, 10_000, ()).item())
    for states in run_distributed(_fully_shard_worker, 2, seed, timeout=120):
        ours, torchs = states[True], states[False]
        assert ours.keys() == torchs.keys()
        for k in torchs:
            assert ours[k].dtype == torchs[k].dtype, k
            if torchs[k].is_floating_point():
                torch.testing.assert_close(ours[k], torchs[k], rtol=1e-5, atol=1e-6, msg=k)
            else:
                assert torch.equal(ours[k], torchs[k]), k


def _zero_converted_worker(rank, ws, when, dtype):
    import fusedist

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, stage=1, lr=0.1)
    for step in range(3):
        if step == when:
            model.to(dtype)
        g = torch.Generator().manual_seed(rank * 7 + step)
        x = torch.randn(3, 5, generator=g, dtype=dtype if step >= when else None)
        opt.zero_grad()
        model(x).float().square().sum().backward()
        for p in model.parameters():  # the caller's own gradient average (no DDP model)
            torch.distributed.all_reduce(p.grad)
            p.grad /= ws
        try:
            opt.step()
        except RuntimeError as exc:
            return step, str(exc)
    return None


@pytest.mark.parametrize("when,dtype", [(0, torch.float64), (1, torch.float16)])
def test_zero_refuses_a_module_converted_after_it_was_built(when, dtype):
    for rank, got in enumerate(run_distributed(_zero_converted_worker, 2, when, dtype, timeout=120)):
        assert got is not None, f"rank {rank}: the steps after model.to({dtype}) went on"
        step, msg = got
        assert step == when, (rank, got)
        assert f"is now {dtype}, but the optimizer was built with it as torch.float32" in msg, msg
        assert f"rank {rank}" in msg and "parameter 3 (shape (3,))" in msg, msg
