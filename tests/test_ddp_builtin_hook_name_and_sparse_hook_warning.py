"""torch DDP's communication hook API on fusedist's DistributedDataParallel, beyond
test_ddp_comm_hooks.py: ``_register_builtin_comm_hook`` -- torch's only name for the C++
builtin hooks, the one its docs show -- is answered as torch answers it, before the first
backward and after it, on 2 gloo ranks side by side with torch DDP.
The two-rank scenarios share one launch of the ranks (``launched``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shared_rank_launch import launch_for_selected, results_of


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 16), nn.GELU(), nn.Linear(16, 3))


def _builtin_worker(rank, world):
    import torch.distributed as dist

    import fusedist

    ref = nn.parallel.DistributedDataParallel(_model())
    ours = fusedist.DistributedDataParallel(_model())
    plain = fusedist.DistributedDataParallel(_model())  # no hook: what a missed registration leaves
    gen = torch.Generator().manual_seed(rank + 1)
    diffs, plain_diffs = [], []
    for step in range(3):
        if step == 1:  # after the first backward, as torch allows
            for model in (ref, ours):
                model._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
        x, y = torch.randn(8, 12, generator=gen) * 7, torch.randn(8, 3, generator=gen)
        for model in (ref, ours, plain):
            for p in model.parameters():
                p.grad = None
            nn.functional.mse_loss(model(x), y).backward()
        diffs.append(max((a.grad - b.grad).abs().max().item() for a, b in zip(ref.parameters(), ours.parameters())))
        plain_diffs.append(max((a.grad - b.grad).abs().max().item()
                               for a, b in zip(ref.parameters(), plain.parameters())))
    again = []
    for model in (ref, ours):
        try:
            model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        except RuntimeError as exc:
            again.append("only be called once" in str(exc))
    return diffs, plain_diffs, again


def test_private_builtin_hook_name_compresses_as_torchs(launched):
    """FP16_COMPRESS through ``_register_builtin_comm_hook``: the fp16 rounding of torch's
    reduction, to the last bit (fp32 averaging differs by ~1e-4 here), and a second
    registration refused by both."""
    for rank, (diffs, plain_diffs, again) in enumerate(results_of(launched, "builtin")):
        assert max(diffs) == 0.0, (rank, diffs)
        assert min(plain_diffs[1:]) > 1e-5, (rank, plain_diffs)  # the hook changed the numbers
        assert again == [True, True], (rank, again)


class _SparseModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.lin = nn.Linear(4, 2)

    def forward(self, idx):
        return self.lin(self.emb(idx))


def _sparse_hook_worker(rank, world):
    import warnings

    import fusedist
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks

    out = {}
    for name, cls in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        model = cls(_SparseModel())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.register_comm_hook(None, debugging_hooks.noop_hook)
        said = [str(w.message) for w in caught if "sparse" in str(w.message)]
        model(torch.tensor([rank, 3, 3 + rank])).sum().backward()
        out[name] = (model.module.emb.weight.grad.to_dense(), said)
    return out


def test_hook_on_a_model_with_sparse_weights_says_they_bypass_it(launched):
    """The no-op hook leaves torch's sparse gradient local; fusedist averages it outside the
    buckets (the hook never sees it) and says so at registration, naming the weight."""
    for rank, out in enumerate(results_of(launched, "sparse hook")):
        (torch_grad, torch_said), (ours_grad, ours_said) = out["torch"], out["fusedist"]
        assert torch_said == [], torch_said
        assert len(ours_said) == 1 and "emb.weight" in ours_said[0] and "noop_hook" in ours_said[0], ours_said
        assert not torch.equal(torch_grad, ours_grad)  # what the warning is about: averaged, not local


# ---------------------------------------------------------------- the shared launch
@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, {
        "test_private_builtin_hook_name_compresses_as_torchs": {"builtin": (_builtin_worker, ())},
        "test_hook_on_a_model_with_sparse_weights_says_they_bypass_it": {"sparse hook": (_sparse_hook_worker, ())},
    }, 2, timeout=240)
