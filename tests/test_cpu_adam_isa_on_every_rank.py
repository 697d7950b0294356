"""``FUSEDIST_CPU_ISA`` forced on a rank that cannot run that path -- its CPU lacks the
instructions (mixed node types), or the value is not a path -- is refused by the ZeRO-Offload
construction on every rank at once, naming the rank and the path, before anything is updated
(Note [a forced ISA on every rank] in fusedist/optim/_cpu_adam.py). Before, only that rank failed,
inside its first host step, and the others waited in the step's all-gathers until the timeout.

This machine's CPU may run every path, so a rank "lacks" one by hiding it from the CPU-feature
probe the check reads (``available_isas``). A path every rank runs, forced on all of them, steps
as ``torch.optim.AdamW`` does: fp32, the same gradient on each rank, the C++ kernel against torch's
foreach AdamW (a few float32 ulp per step; 3 steps of lr 1e-2 stay far below 1e-6, while a missed
step or a wrong element moves a weight by ~1e-3)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from shared_rank_launch import launch_for_selected, results_of

TOL = 1e-6


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))


def _step_offloaded(rank, world, forced: dict, hidden: dict, steps: int = 3):
    """Rank r forces ``forced.get(r)`` (None: the variable unset) while its probe hides the paths
    ``hidden.get(r, ())``; ``steps`` steps of ZeRO-Offload AdamW on the same batch on every rank.
    Returns ("raised", message, whether the parameters are unchanged) or ("stepped", parameters,
    torch.optim.AdamW's parameters)."""
    import fusedist
    from fusedist.optim import _cpu_adam

    probe = _cpu_adam.available_isas
    saved = os.environ.get(_cpu_adam.ISA_ENV)
    if forced.get(rank) is None:
        os.environ.pop(_cpu_adam.ISA_ENV, None)
    else:
        os.environ[_cpu_adam.ISA_ENV] = forced[rank]
    _cpu_adam.available_isas = lambda: [isa for isa in probe() if isa not in hidden.get(rank, ())]
    try:
        model, reference = _model(), _model()
        before = [p.detach().clone() for p in model.parameters()]
        try:  # refused at construction, where every rank is (a rank may read .optim alone later)
            opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, offload="cpu", lr=1e-2,
                                                   weight_decay=0.1)
        except RuntimeError as exc:
            unchanged = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
            return ("raised", str(exc), unchanged)
        if rank == 0:
            opt.optim  # (builds the shards on this rank alone: no collective there)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
        gen = torch.Generator().manual_seed(7)
        for _ in range(steps):
            x = torch.randn(5, 6, generator=gen)
            for m, o in ((model, opt), (reference, ref_opt)):
                o.zero_grad()
                m(x).square().mean().backward()
                o.step()
        opt.wait_for_params()
        return ("stepped", [p.detach().clone() for p in model.parameters()],
                [p.detach().clone() for p in reference.parameters()])
    finally:
        _cpu_adam.available_isas = probe
        if saved is None:
            os.environ.pop(_cpu_adam.ISA_ENV, None)
        else:
            os.environ[_cpu_adam.ISA_ENV] = saved


_SCENARIOS = {
    "test_a_path_forced_on_a_rank_that_lacks_it_is_refused_on_every_rank_naming_it": {
        "lacks avx512": (_step_offloaded, ({0: "avx2", 1: "avx512"}, {1: ("avx512",)})),
        "not a path": (_step_offloaded, ({0: "avx9"}, {})),
    },
    "test_a_path_every_rank_runs_steps_as_torch_adamw": {
        "scalar everywhere": (_step_offloaded, ({0: "scalar", 1: "scalar"}, {1: ("avx512",)})),
    },
}


@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, _SCENARIOS, 2, timeout=150)


def test_a_path_forced_on_a_rank_that_lacks_it_is_refused_on_every_rank_naming_it(launched):
    for rank, (outcome, message, unchanged) in enumerate(results_of(launched, "lacks avx512")):
        assert outcome == "raised", (rank, outcome)
        assert unchanged, (rank, "parameters changed before the refusal")
        assert "ZeroRedundancyOptimizer(offload='cpu')" in message and "1 of 2 rank(s)" in message, (rank, message)
        assert "rank 1: FUSEDIST_CPU_ISA=avx512 but its CPU and build run only scalar, avx2" in message, message
        assert "force a path every rank runs (scalar, avx2)" in message, message
        assert "rank 0" not in message, message  # (avx2 forced on rank 0 is fine)
    for rank, (outcome, message, unchanged) in enumerate(results_of(launched, "not a path")):
        assert outcome == "raised" and unchanged, (rank, outcome, message)
        assert "rank 0: FUSEDIST_CPU_ISA is not one of auto, scalar, avx2, avx512" in message, (rank, message)


def test_a_path_every_rank_runs_steps_as_torch_adamw(launched):
    for rank, (outcome, params, reference) in enumerate(results_of(launched, "scalar everywhere")):
        assert outcome == "stepped", (rank, params)
        for p, r in zip(params, reference):
            torch.testing.assert_close(p, r, atol=TOL, rtol=0)
        assert not any(torch.equal(p, q) for p, q in zip(params, _model().parameters())), "nothing was stepped"
