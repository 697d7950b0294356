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
    errors["after_sync_ok"] = model.watch.optimizer_steps

    # step(closure): the backward runs inside step(), after the step hooks (Note [step with a
    # closure]): legal on the first step, and judged by the closure's own backward.
    import copy
    closure_diffs = {}
    for kind in ("torch SGD", "ZeRO stage 2"):
        torch.manual_seed(1)
        base = models.MLP()
        ref, ours = (fusedist.DistributedDataParallel(copy.deepcopy(base)) for _ in range(2))
        if kind == "torch SGD":
            opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
            opt_c = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
        else:
            opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
            opt_c = fusedist.ZeroRedundancyOptimizer(ours.parameters(), torch.optim.AdamW, stage=2, lr=1e-2)
        for step in range(3):
            x, y = models.MLP.batch(gen)
            opt_ref.zero_grad()
            (ref(x) - y).pow(2).mean().backward()
            opt_ref.step()

            def closure():
                opt_c.zero_grad()
                loss = (ours(x) - y).pow(2).mean()
                loss.backward()
                return loss

            opt_c.step(closure) if step % 2 == 0 else opt_c.step(closure=closure)
        closure_diffs[kind] = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), ours.parameters()))
    errors["closure_diffs"] = closure_diffs

    def no_sync_closure():
        with model.no_sync():
            loss = (model(x) - y).pow(2).mean()
        loss.backward()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    _capture(errors, "no_sync_closure", lambda: opt.step(no_sync_closure), RuntimeError)
    errors["no_sync_closure_unchanged"] = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    (model(x) - y).pow(2).mean().backward()

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

    # Complex parameter: trained as torch's DDP trains it (tests/test_ddp_zero_complex_parameters.py).
    holder = nn.Linear(2, 2)
    holder.z = nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    errors["complex"] = fusedist.DistributedDataParallel(holder).module.z.dtype

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
        for kind, diff in e["closure_diffs"].items():
            assert diff < 1e-6, f"rank {rank}, step(closure) with {kind}: max |difference| = {diff}"
        assert f"rank {rank}" in e["no_sync_closure"] and "under no_sync()" in e["no_sync_closure"]
        assert e["no_sync_closure_unchanged"]
        assert "param_groups[1]['params'][0]" in e["unowned"] and "(4,)" not in e["unowned"]
        assert "shape (2, 4)" in e["unowned"] and "does not own" in e["unowned"]
        assert "ddp_model.parameters()" in e["unowned"]
        assert "floating point" in e["int_param"]
        assert e["int_frozen_broadcast"] == [0, 0, 0]  # rank 0's value everywhere
        assert e["complex"] == torch.complex64
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
    from fusedist.reliability.config import param_check_every

    for bad in ("-1", "often", "1.5"):
        monkeypatch.setenv("FUSEDIST_PARAM_CHECK_EVERY", bad)
        with pytest.raises(ValueError, match="FUSEDIST_PARAM_CHECK_EVERY must be a whole number"):
            param_check_every()
    monkeypatch.setenv("FUSEDIST_PARAM_CHECK_EVERY", " 7 ")
    assert param_check_every() == 7


def test_stall_report_waits_briefly_for_a_peer_whose_connection_is_gone(monkeypatch):
    from fusedist.reliability.stall_report import PEER_GONE_WINDOW_S, peer_gone, report_window_s

    monkeypatch.delenv("FUSEDIST_STALL_REPORT_S", raising=False)
    assert report_window_s(600) == 15.0 and report_window_s(10) == 2.0
    assert report_window_s(600, peer_gone=True) == PEER_GONE_WINDOW_S == 2.0
    monkeypatch.setenv("FUSEDIST_STALL_REPORT_S", "7")
    assert report_window_s(600, peer_gone=True) == 7.0  # the setting wins
    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:33422: "
                        "Connection reset by peer")
    closed = RuntimeError("[pair.cc:598] Connection closed by peer [127.0.0.1]:48811")
    nccl = RuntimeError("NCCL error: remote process exited or there was a network error")
    timeout = RuntimeError("[pair.cc:446] Timed out waiting 3000ms for recv operation to complete")
    assert [peer_gone(e) for e in (gloo, closed, nccl, timeout)] == [True, True, True, False]


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises when ``armed`` is set (then disarms)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if _FailOnce.armed:
            _FailOnce.armed = False
            raise ValueError("injected failure in backward")
        return grad


class _Net(nn.Module):
    """Two layers, one bucket each; ``fail_at`` puts the failing identity at the output (before
    any gradient exists) or between the layers (after the last layer's bucket launched)."""

    def __init__(self, fail_at):
        super().__init__()
        self.first, self.last, self.fail_at = nn.Linear(8, 8), nn.Linear(8, 4), fail_at

    def forward(self, x):
        h = self.first(x)
        h = _FailOnce.apply(h) if self.fail_at == "middle" else h
        out = self.last(torch.tanh(h))
        return _FailOnce.apply(out) if self.fail_at == "output" else out


def _interrupted_backward_worker(rank, world_size):
    """Note [interrupted backward]: every rank's backward raises at the same point."""
    import warnings

    import fusedist

    out = {}
    # (where it fails, bucket cap in MB): before any gradient; after the last layer's
    # gradients but inside the one bucket (nothing launched); after tiny buckets launched.
    for case, (fail_at, cap) in {"output": ("output", 1e-4), "one bucket": ("middle", 25.0),
                                 "launched": ("middle", 1e-4)}.items():
        torch.manual_seed(0)
        model = fusedist.DistributedDataParallel(_Net(fail_at), bucket_cap_mb=cap, first_bucket_cap_mb=cap)
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(4, 8, generator=gen)
        model(x).sum().backward()  # a clean step first (the bucket rebuild happens here)
        model.zero_grad()
        _FailOnce.armed = True
        try:
            model(x).sum().backward()
        except ValueError:
            pass
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                model.zero_grad()
                model(x).sum().backward()
                grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
                everyone = [torch.empty_like(grads) for _ in range(world_size)]
                torch.distributed.all_gather(everyone, grads)
                out[case] = ("ok", all(torch.equal(everyone[0], g) for g in everyone),
                             [str(w.message) for w in caught])
            except RuntimeError as exc:
                out[case] = ("raised", str(exc), [])
    return out


def test_interrupted_backward_is_reset_or_reported():
    """A backward interrupted before any gradient collective resets with a warning and the next
    step synchronizes normally; one interrupted after a bucket was launched makes the next
    forward raise, naming the cause, instead of pairing collectives wrongly."""
    for r in run_distributed(_interrupted_backward_worker, 2):
        status, same, _ = r["output"]  # no gradient hook ran: nothing to reset
        assert status == "ok" and same, r
        status, same, warned = r["one bucket"]
        assert status == "ok" and same, r
        assert any("interrupted by an exception before any gradient collective" in w for w in warned), warned
        status, message, _ = r["launched"]
        assert status == "raised", r
        assert "previous backward did not complete" in message and "gradient bucket collectives" in message, message
