"""A gradient changed on one rank after DDP averaged it (code between backward() and step()):
the ranks ran the same steps and collectives, only their parameters differ, and the error
says so -- it names gradients or weights changed on some ranks, not rank-dependent control
flow (Note [parameters that differ after the same steps] in fusedist/reliability/step_check.py)."""

import pytest
import torch
from torch import nn

from fusedist.reliability.step_check import FIELDS, render_bounds
from shared_rank_launch import launch_for_selected, results_of

AFTER_REDUCE = "drifted apart after the reduce"
CONTROL_FLOW = "rank-dependent control flow"


def _edit_after_reduce(rank: int, world: int, optimizer: str) -> dict:
    """Four steps; on step 1, rank 1 adds 1 to one element of its averaged gradient (a
    rank-local edit). The parameter check (every step here) takes step 2's digest at the end of
    its backward; the verdict is read at step 3's forward."""
    import fusedist
    from fusedist import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    ddp = DDP(model)
    params = list(ddp.parameters())
    opt = torch.optim.SGD(params, lr=0.1) if optimizer == "torch" else fusedist.optim.FusedAdam(params, lr=0.01)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(4):
        try:
            loss = ddp(torch.randn(4, 6, generator=gen)).square().mean()
        except fusedist.RankMismatchError as exc:
            return {"step": step, "message": str(exc)}
        loss.backward()
        if step == 1 and rank == 1:
            model[0].weight.grad[2, 3] += 1.0
        opt.step()
        opt.zero_grad()
    return {"step": None, "message": None}


SCENARIOS = {
    "test_grad_changed_after_reduce_is_named_on_both_ranks": {
        "torch": (_edit_after_reduce, ("torch",)),
        "fused": (_edit_after_reduce, ("fused",)),
    },
}


@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, SCENARIOS, 2, timeout=180, env={"FUSEDIST_PARAM_CHECK_EVERY": "1"})


@pytest.mark.parametrize("optimizer", ["torch", "fused"])
def test_grad_changed_after_reduce_is_named_on_both_ranks(launched, optimizer):
    per_rank = results_of(launched, optimizer)
    for rank, result in enumerate(per_rank):
        assert result["step"] == 3, (rank, result)  # step 2 backward digest, read at step 3
        message = result["message"]
        assert f"this is rank {rank}" in message
        assert "their parameters differ" in message
        assert "parameter '0.weight' (shape (5, 6)) differs across ranks: ranks [0] | ranks [1]" in message
        assert "'2.weight'" not in message and "'0.bias'" not in message  # (the edit reached only 0.weight)
        assert "changed its gradients after they were averaged" in message
        assert AFTER_REDUCE in message and "between backward() and optimizer.step()" in message
        assert CONTROL_FLOW not in message, message
    assert per_rank[0]["message"].replace("rank 0)", "rank 1)") == per_rank[1]["message"]


def _bounds(differing: dict) -> list:
    """The reduced ``[max(v), max(-v)]`` of two ranks at the same point but for ``differing``."""
    k = len(FIELDS)
    high, low = [3] * k, [3] * k
    for field, (a, b) in differing.items():
        i = FIELDS.index(field)
        high[i], low[i] = max(a, b), min(a, b)
    return high + [-v for v in low]


def test_advice_without_details_follows_what_differs():
    """The verdict read without the all-gather (a rank left) gives the same advice by what
    differs: parameters alone -> changed after the reduce; a step count too -> control flow."""
    values = [3] * len(FIELDS)
    only_params = render_bounds(_bounds({"params": (11, 12)}), values, 0, {"buckets": 1}, None)
    assert AFTER_REDUCE in only_params and CONTROL_FLOW not in only_params
    skipped = render_bounds(_bounds({"sync_step": (3, 4), "params": (11, 12)}), values, 0, {"buckets": 1}, None)
    assert CONTROL_FLOW in skipped and AFTER_REDUCE not in skipped
    counted = render_bounds(_bounds({"optimizer_steps": (2, 3), "params": (11, 12)}), values, 0,
                            {"buckets": 1}, None)
    assert CONTROL_FLOW in counted and AFTER_REDUCE not in counted
