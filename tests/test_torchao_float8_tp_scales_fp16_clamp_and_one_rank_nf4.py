"""torchao's float8 training and NF4 weights under fully_shard, against torch's FSDP2 with
torchao's own helpers, in the corners the main tests leave out.

* ``fusedist.fsdp.precompute_float8_dynamic_scale_for_fsdp`` is the drop-in for torchao's: its
  scales must be torchao's. With tensor parallelism torchao's amax spans the tensor-parallel
  group too (it reduces the DTensor weight over the whole mesh), and an fp16 weight's scale is
  clamped to fp16's largest value; fusedist's took the shard group's amax only and left fp16
  scales unclamped, so training drifted from FSDP2's.
* An NF4 weight of one block of scales (128x128 at torchao's default block sizes) holds its
  ``quantization_factor`` as ``(1,)`` with stride 256: laying it out as bytes raised in
  ``view(uint8)``, so ``fully_shard`` on a one-rank group failed at construction.

Tolerances: both sides compute the same scales, gather the same bytes and reduce in the same
order, so losses and weights are bit-identical (``rtol=0``); a wrong scale moves them by the
float8 rounding of a weight (about 1e-3 relative after a step).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fusedist
from fusedist.testing import run_distributed
from fusedist.testing.fsdp_compare import full_state

pytest.importorskip("torchao")

EXACT = dict(rtol=0, atol=0)


def _float8_model(dtype=torch.float32, small_first=False):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
    if small_first:  # an amax below 448 / 65504: the scale an fp16 weight's clamp bounds
        with torch.no_grad():
            m[0].weight.mul_(1e-3)
    m.to(dtype)
    return convert_to_float8_training(m, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))


def _train(m, ours: bool, x_of, dtype=torch.float32, steps: int = 3):
    """SGD steps with the scales precomputed after each, by fusedist's helper or torchao's."""
    import torchao.float8

    precompute = (fusedist.fsdp.precompute_float8_dynamic_scale_for_fsdp if ours
                  else torchao.float8.precompute_float8_dynamic_scale_for_fsdp)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    precompute(m)
    losses = []
    for step in range(steps):
        loss = m(x_of(step).to(dtype)).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        precompute(m)
        losses.append(loss.item())
    return losses


def _batch(step: int, rank: int, world: int) -> torch.Tensor:
    torch.manual_seed(100 + step)
    return torch.randn(4 * world, 32)[rank * 4:(rank + 1) * 4]


def _assert_same(ours, ref, what: str) -> None:
    a, b = full_state(ours, True), full_state(ref, False)
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), **EXACT, msg=f"{k} differs from FSDP2's {what}")


def _tensor_parallel(ours: bool):
    """torchtitan's float8 with tensor parallelism: a column/row-wise plan on mesh["tp"], the
    units on mesh["dp"] (here of one rank, so two ranks make the 1x2 mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    m = _float8_model()
    # (every float8 weight in the plan: torchao's helper stacks the amaxes of DTensors of one mesh)
    parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel(),
                                       "4": ColwiseParallel(output_layouts=Replicate())})
    fs = fusedist.fully_shard if ours else fully_shard
    fs(m[0], mesh=mesh["dp"])
    fs(m, mesh=mesh["dp"])
    return m


def _nf4_one_block(rank):
    """fully_shard over a one-rank group: 128x128 NF4 weights (one block of scales each) train as
    the unsharded model and come back whole."""
    import torch.distributed as dist
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4

    class QLoRALinear(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(to_nf4(torch.randn(128, 128) / 128 ** 0.5), requires_grad=False)
            self.lora_a = nn.Parameter(torch.randn(4, 128) * 0.1)
            self.lora_b = nn.Parameter(torch.randn(128, 4) * 0.1)

        def forward(self, x):
            return linear_nf4(x, self.weight) + (x @ self.lora_a.t()) @ self.lora_b.t()

    def qlora():
        torch.manual_seed(0)
        return nn.Sequential(QLoRALinear(), nn.ReLU(), QLoRALinear())

    single = dist.new_group([0])
    if rank != 0:
        return
    plain, m = qlora(), qlora()
    assert m[0].weight.quantization_factor.stride() == (256,)  # (the layout this checks)
    fusedist.fully_shard(m[0], process_group=single)
    fusedist.fully_shard(m, process_group=single)
    losses = []
    for model in (plain, m):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses.append(_train_plain(model, opt))
    torch.testing.assert_close(losses[0], losses[1], **EXACT)
    whole = fusedist.fsdp.full_state_dict(m)
    for k, v in plain.state_dict().items():
        if k.endswith("weight"):
            names = v.__tensor_flatten__()[0]
            assert all(torch.equal(getattr(whole[k], n), getattr(v, n)) for n in names), k
        else:
            torch.testing.assert_close(whole[k], v, **EXACT, msg=k)


def _train_plain(model, opt) -> list:
    out = []
    for step in range(2):
        torch.manual_seed(200 + step)
        loss = model(torch.randn(4, 128)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _worker(rank, world):
    from torch.distributed.fsdp import fully_shard

    # tensor parallelism: the precomputed scales are of the global weight, as torchao's
    ours, ref = _tensor_parallel(True), _tensor_parallel(False)
    x_of = lambda step: _batch(step, 0, 1)  # noqa: E731  (one data-parallel rank: one batch)
    torch.testing.assert_close(_train(ours, True, x_of, steps=1), _train(ref, False, x_of, steps=1), **EXACT)
    _assert_same(ours, ref, "with tensor parallelism and precomputed scales")
    # fp16 weights of a small amax: the scale clamped to fp16's largest value, as torchao's
    models = {}
    for flag, fs in ((True, fusedist.fully_shard), (False, fully_shard)):
        m = _float8_model(torch.float16, small_first=True)
        for layer in (m[0], m[2], m):
            fs(layer)
        x_of = lambda step: _batch(step, rank, world)  # noqa: E731
        models[flag] = (m, _train(m, flag, x_of, torch.float16, steps=1))
    torch.testing.assert_close(models[True][1], models[False][1], **EXACT)
    _assert_same(models[True][0], models[False][0], "with fp16 weights and precomputed scales")
    _nf4_one_block(rank)


def test_precomputed_scales_and_one_block_nf4_match_torch():
    run_distributed(_worker, 2, timeout=120)
