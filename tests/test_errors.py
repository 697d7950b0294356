"""Bad input gets a clear error: one check per row of docs/errors.md not covered elsewhere.

Rows already covered by other tests (see docs/errors.md): models that differ across ranks
(test_ddp.py::test_mismatched_model_raises_on_every_rank), sparse gradients
(test_ddp.py::test_bad_input_messages), incomplete torchrun environment
(test_comm.py::test_init_distributed_incomplete_env), bucket layouts and per-step divergence
(test_reliability.py).

Each message must say what is wrong, where (parameter name / index, rank) and what to do.
"""

import pytest
import torch
from torch import nn

import models
from fusedist.testing import run_distributed


def _capture(errors, key, fn, *types):
    try:
        fn()
    except types as exc:
        errors[key] = f"{type(exc).__name__}: {exc}"
        return
    errors[key] = "no error"


def _misuse_worker(rank, world_size):
    """Optimizer misuse, parameter dtypes and devices; all checks on one process group."""
    import fusedist

    errors = {}
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(rank)

    # step() before any backward.
    model = fusedist.DistributedDataParallel(models.MLP())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _capture(errors, "step_first", opt.step, RuntimeError)

    # no_sync misuse: step right after a no_sync backward (local gradients only).
    x, y = models.MLP.batch(gen)
    with model.no_sync():
        (model(x) - y).pow(2).mean().backward()
    _capture(errors, "no_sync", opt.step, RuntimeError)
    (model(x) - y).pow(2).mean().backward()  # the synchronized backward makes step() legal again
    opt.step()
    errors["after_sync_ok"] = model.reducer.optimizer_steps

    # An optimizer given a parameter the DDP model does not own.
    extra = nn.Linear(4, 2)
    opt2 = torch.optim.SGD([{"params": model.parameters()}, {"params": extra.parameters()}], lr=0.1)
    _capture(errors, "unowned", opt2.step, ValueError)

    # Integer parameter: torch refuses requires_grad itself; a frozen one is broadcast as state.
    _capture(errors, "int_param", lambda: nn.Parameter(torch.zeros(3, dtype=torch.int64)), RuntimeError)
    holder = nn.Linear(2, 2)
    holder.ids = nn.Parameter(torch.full((3,), rank, dtype=torch.int64), requires_grad=False)
    wrapped = fusedist.DistributedDataParallel(holder)
    errors["int_frozen_broadcast"] = wrapped.module.ids.tolist()

    # Complex parameter: rejected by name.
    holder = nn.Linear(2, 2)
    holder.z = nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    _capture(errors, "complex", lambda: fusedist.DistributedDataParallel(holder), TypeError)

    # Parameters on several devices ('meta' stands in for a second device on a CPU machine).
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    _capture(errors, "mixed_devices", lambda: fusedist.DistributedDataParallel(mixed), ValueError)

    # SyncBatchNorm with a different number of channels on one rank (outside DDP, whose model
    # check would catch it first): every rank raises at the first synchronized forward.
    bn = fusedist.nn.SyncBatchNorm(8 if rank == 0 else 6)
    _capture(errors, "syncbn", lambda: bn(torch.randn(4, bn.num_features)), ValueError)

    # The process group is still healthy after all of the above.
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    errors["alive"] = t.item()
    return errors


def test_misuse_gets_clear_errors():
    results = run_distributed(_misuse_worker, 2, timeout=120)
    for rank, e in enumerate(results):
        assert e["alive"] == 2.0
        assert f"rank {rank}" in e["step_first"] and "before any backward" in e["step_first"]
        assert "Call loss.backward()" in e["step_first"]
        assert f"rank {rank}" in e["no_sync"] and "under no_sync()" in e["no_sync"]
        assert "outside no_sync()" in e["no_sync"]
        assert e["after_sync_ok"] == 1
        assert "param_groups[1]['params'][0]" in e["unowned"] and "(4,)" not in e["unowned"]
        assert "shape (2, 4)" in e["unowned"] and "does not own" in e["unowned"]
        assert "ddp_model.parameters()" in e["unowned"]
        assert "floating point" in e["int_param"]
        assert e["int_frozen_broadcast"] == [0, 0, 0]  # rank 0's value everywhere
        assert "'z'" in e["complex"] and "complex" in e["complex"]
        assert "several devices" in e["mixed_devices"] and "'1.weight'" in e["mixed_devices"]
        assert f"rank {rank}" in e["mixed_devices"]
        assert "module.to(device)" in e["mixed_devices"]
        assert "ranks disagree on the number of channels" in e["syncbn"] and "[8, 6]" in e["syncbn"]


def test_checks_switch_rejects_bad_values(monkeypatch):
    from fusedist.reliability import checks_enabled

    monkeypatch.setenv("FUSEDIST_CHECKS", "maybe")
    with pytest.raises(ValueError, match="FUSEDIST_CHECKS must be 0 or 1"):
        checks_enabled()
    monkeypatch.setenv("FUSEDIST_STALL_REPORT_S", "-1")
    from fusedist.reliability.stall_report import report_window_s

    with pytest.raises(ValueError, match="FUSEDIST_STALL_REPORT_S"):
        report_window_s(600)
