"""fusedist.ZeroRedundancyOptimizer as a drop-in for torch.distributed.optim.ZeroRedundancyOptimizer:
what a training script written for torch's does, run with both, on fresh random inputs (the
seed is in every assertion message).

* One spawn at 2 ranks checks the refusals: parameter lists that differ between ranks (gloo
  aborted the process, or the ranks silently stepped each other's elements) and a parameter
  given twice.
"""

import random

import torch
from torch import nn

from fusedist.testing import run_distributed


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 13)
        self.b = nn.Linear(13, 5)
        self.c = nn.Linear(5, 3)

    def forward(self, x, skip_b=False):
        h = torch.tanh(self.a(x))
        h = h[:, :5] if skip_b else torch.tanh(self.b(h))
        return self.c(h)


def _net(seed):
    torch.manual_seed(seed)
    return Net()


def _flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _refusal_worker(rank, ws, seed):
    import fusedist

    def message(fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the test reads the type and message
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    m = _net(seed)
    params = list(m.parameters())
    zero = fusedist.ZeroRedundancyOptimizer
    out = {}
    extra = nn.Parameter(torch.randn(5))
    # One parameter more on rank 1; the same list in another order; other param groups.
    out["extra"] = message(lambda: zero(params + ([extra] if rank == 1 else []),
                                        optimizer_class=torch.optim.AdamW, lr=0.1))
    out["order"] = message(lambda: zero(params[::-1] if rank == 1 else params,
                                        optimizer_class=torch.optim.AdamW, lr=0.1))
    out["groups"] = message(lambda: zero([{"params": params[:3]}, {"params": params[3:], "lr": 0.5}]
                                         if rank == 1 else params, optimizer_class=torch.optim.AdamW, lr=0.1))
    # The ranks are still in step after the refusals: a matching optimizer trains.
    opt = zero(params, optimizer_class=torch.optim.AdamW, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    out["after"] = _flat(m).tolist()
    out["twice"] = message(lambda: zero([m.a.weight, m.a.bias, m.a.weight], optimizer_class=torch.optim.AdamW))
    out["twice added"] = message(lambda: opt.add_param_group({"params": [extra, extra]}))
    out["groups after"] = len(opt.param_groups)
    out["no params key"] = message(lambda: zero([{"lr": 0.1}], optimizer_class=torch.optim.AdamW))
    return out


def test_refusals_name_the_parameter_and_ranks():
    seed = random.randrange(2**31)
    results = run_distributed(_refusal_worker, 2, seed, timeout=120, pg_timeout=30)
    for rank, out in enumerate(results):
        where = f"seed {seed}, rank {rank}: {out}"
        assert out["extra"].startswith("RankMismatchError"), where
        assert "this is rank" in out["extra"] and "parameter 6" in out["extra"] and "(5,)" in out["extra"], where
        assert "ranks [0]: <missing>; ranks [1]" in out["extra"], where
        assert out["order"].startswith("RankMismatchError") and "(13, 7)" in out["order"], where
        assert out["groups"].startswith("RankMismatchError") and "param group 1" in out["groups"], where
        assert out["twice"].startswith("ValueError") and "parameter 2 (shape (13, 7))" in out["twice"], where
        assert "same tensor as parameter 0" in out["twice"], where
        assert out["twice added"].startswith("ValueError") and "parameter 7 (shape (5,))" in out["twice added"], where
        assert out["groups after"] == 1, where
        assert out["no params key"].startswith("ValueError") and "'params'" in out["no params key"], where
    assert results[0]["after"] == results[1]["after"], f"seed {seed}: the ranks' parameters differ"
