"""A parameter whose storage is replaced by a tensor of other strides between steps, under a fusedist
DDP model, world size 2 on gloo, against a single-process ``torch.optim.AdamW`` on the same batches
(every rank sees the same batch, so the averaged gradient is the local one).

* ZeroRedundancyOptimizer stage 2 cuts each backward's gradient views afresh (per-bucket storage):
  they keep the slot order recorded when the layout was fixed, not the replaced tensor's strides
  (Note [slot order fixed at bucketing] in fusedist/ddp/layout.py), else the gradient shard is
  read transposed.
* A model converted to channels_last after wrapping, before the optimizer is built: the optimizer
  lays out its storage by the parameters then, and the gradient views follow that order.
* Plain DDP with gradients as bucket views stays as torch's optimizer.
"""

import torch
from torch import nn

from fusedist.testing import run_distributed
from models import TwoLinearTanh


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.conv(x)).mean((2, 3)))


def _transposed(model):
    with torch.no_grad():
        model.fc.weight.set_(torch.randn(4, 4, generator=torch.Generator().manual_seed(3)).t())


def _column_major_q(model):
    q, _ = torch.linalg.qr(torch.randn(4, 4, generator=torch.Generator().manual_seed(3)))
    with torch.no_grad():
        model.fc.weight = q  # the setter keeps Q's column-major strides


def _train(model, opt, forward, replace, conv=False) -> dict:
    gen = torch.Generator().manual_seed(1)
    for s in range(3):
        if s == 1 and replace is not None:
            replace(model)
        x = torch.randn(4, 3, 5, 5, generator=gen) if conv else torch.randn(6, 4, generator=gen)
        y = torch.randn(x.shape[0], 2, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(forward(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _error(got, ref) -> float:
    return max((got[k] - ref[k]).abs().max().item() for k in ref)


def _worker(rank, world_size):
    import fusedist

    errors = {}
    cases = (("set_ transposed", _transposed, False, (0, 2)), ("orthogonal Q", _column_major_q, True, (2,)))
    for name, replace, parametrized, stages in cases:
        m = TwoLinearTanh(parametrized)
        ref = _train(m, torch.optim.AdamW(m.parameters(), lr=0.05), m, replace)
        for stage in stages:  # 0: plain DDP, gradients as bucket views
            m = TwoLinearTanh(parametrized)
            ddp = fusedist.DistributedDataParallel(m, gradient_as_bucket_view=stage == 0)
            opt = (torch.optim.AdamW(m.parameters(), lr=0.05) if stage == 0 else
                   fusedist.ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, stage=stage, lr=0.05))
            errors[name, stage] = _error(_train(m, opt, ddp, replace), ref)

    m = ConvNet().to(memory_format=torch.channels_last)
    ref = _train(m, torch.optim.AdamW(m.parameters(), lr=0.05), m, None, conv=True)
    m = ConvNet()
    ddp = fusedist.DistributedDataParallel(m)
    m.to(memory_format=torch.channels_last)
    opt = fusedist.ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, stage=2, lr=0.05)
    errors["channels_last after wrapping"] = _error(_train(m, opt, ddp, None, conv=True), ref)
    return errors


def test_replaced_strides_keep_the_slot_order():
    for errors in run_distributed(_worker, 2, timeout=120):
        bad = {case: err for case, err in errors.items() if not err < 1e-5}
        assert not bad, bad
