"""Stall reports and per-step checks where several models share a process group, and the names
the reliability layer gives its own collectives. The two fully_shard checks share one launch of
the ranks (``launched``); the stall stays in a launch of its own (it leaves a collective unpaired)."""

import os
import time

import pytest
import torch

import models
from fusedist.testing import run_distributed
from shared_rank_launch import launch_for_selected, results_of

FAST_FAILURE = {"FUSEDIST_TIMEOUT_S": "2", "FUSEDIST_STALL_REPORT_S": "1"}


class SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a rank stuck in backward, outside any collective."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(5)
        return grad


def _two_models_stall_worker(rank, world_size):
    import fusedist
    from fusedist.reliability import StallError

    torch.manual_seed(0)
    first = fusedist.DistributedDataParallel(models.MLP())
    second = fusedist.DistributedDataParallel(models.MLP(hidden=8))  # built last: its position overwrote
    x, y = models.MLP.batch(torch.Generator().manual_seed(rank))
    for _ in range(3):
        (second(x) - y).pow(2).mean().backward()
    try:
        out = first(x)
        if rank == 1:
            out = SlowBackward.apply(out)
        (out - y).pow(2).mean().backward()
    except StallError as exc:
        return exc.report
    return "finished"


def test_stall_report_shows_the_position_of_the_model_in_backward():
    """Two DDP models on one group share its monitor: rank 0's report on the first model's stuck
    bucket gives that model's position (step 0, inside backward), not the second's (step 3)."""
    report = run_distributed(_two_models_stall_worker, 2, env=FAST_FAILURE, timeout=60)[0]
    line = next(text for text in report.splitlines() if text.startswith("  rank 0 on"))
    assert "DDP step 0, 1 training forwards" in line, line
    assert "inside backward" in line and "of 2 models on this group" in line, line
    assert "DDP step 3" not in line, line


def _sharded_block_stack():
    """A BlockStack sharded per block and at the root, with its SGD."""
    import fusedist

    torch.manual_seed(0)
    model = models.BlockStack()
    for block in model.blocks:
        fusedist.fully_shard(block)
    fusedist.fully_shard(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _sharded_tags_worker(rank, world_size):
    import fusedist
    from fusedist.fsdp.state import state_of
    from fusedist.reliability import monitor_of

    model, opt = _sharded_block_stack()
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        model(torch.randn(4, 5, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    model.check_consistency()
    monitor = monitor_of(state_of(model).ctx.watch.step_check.comm)
    tags = sorted({tag for _, _, tag, _ in monitor.history if "step check" in tag})
    ddp = fusedist.DistributedDataParallel(models.MLP())
    for _ in range(2):
        ddp(torch.randn(4, 16)).sum().backward()
    position = monitor.context()  # two models on the group: the last built, and it says so
    return tags, position.get("models_on_group"), position.get("ddp_step")


def test_fully_shard_step_check_is_not_named_a_ddp_one(launched):
    """The fully_shard model's per-step check shows in stall reports under its own name."""
    for tags, models_on_group, ddp_step in results_of(launched, "tags"):
        assert tags == ["fully_shard step check"], tags
        assert (models_on_group, ddp_step) == (2, 2)


def test_launch_time_of_a_collective_is_not_taken_from_a_later_one():
    """A failure of a collective launched more than HISTORY collectives ago (the first bucket of
    a model of many buckets) reports no age rather than the age of a later collective."""
    from types import SimpleNamespace

    from fusedist.reliability.monitor import HISTORY, CollectiveMonitor

    monitor = CollectiveMonitor.__new__(CollectiveMonitor)
    monitor.history, monitor.launch_times, monitor.step_hint = [], {}, 0
    for seq in range(HISTORY + 3):
        monitor.on_launch(None, SimpleNamespace(seq=seq, op="all_reduce", tag=f"ddp bucket {seq}"))
    assert monitor.launched_at(0) is None and monitor.launched_at(2) is None
    assert monitor.launched_at(HISTORY + 2) is not None and monitor.launched_at(3) is not None


def _sharded_eval_mode_worker(rank, world_size):
    """Rank 1 left in eval mode after a step (Note [train and eval modes in the step check])."""

    def outcome():
        model, opt = _sharded_block_stack()
        gen = torch.Generator().manual_seed(rank)
        for step in range(3):
            if rank == 1 and step == 1:
                model.eval()
            model(torch.randn(4, 5, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        model.check_consistency()

    return models.mismatch_or(outcome)


def test_fully_shard_ranks_in_different_train_eval_modes_are_named_on_every_rank(launched):
    for rank, text in enumerate(results_of(launched, "eval mode")):
        assert f"this is rank {rank}" in text and "synchronized backward #1" in text, text
        assert "modes: ranks [0] | ranks [1] ran in different modes -- " in text, text
        assert "in eval mode on others" in text and "trainable:" not in text, text
        assert "train mode on ranks [0], eval mode on ranks [1]" in text, text


def _sharded_dropout_mode_worker(rank, world_size):
    """A Dropout (no parameters) put in eval mode on one rank only, in the tree as wrapped and after
    it was replaced (Note [every module's mode under a fully_shard root] in sharded_watch.py); torch's
    FSDP2 trains on silently. Every rank switching it alike is no divergence."""
    import fusedist

    def outcome(switch, replace=False):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Dropout(0.5), torch.nn.Tanh(), torch.nn.Linear(6, 3))
        fusedist.fully_shard(net[0])
        fusedist.fully_shard(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        for step in range(3):
            if step == 1:
                if replace:  # (on every rank: the tree changed after the first forward)
                    net[1] = torch.nn.Dropout(0.25)
                if switch:
                    net[1].eval()
            net(torch.randn(4, 5, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        net.check_consistency()

    return {"alike": models.mismatch_or(outcome, True), "one rank": models.mismatch_or(outcome, rank == 1),
            "replaced": models.mismatch_or(outcome, rank == 1, True)}


def test_fully_shard_dropout_in_eval_mode_on_one_rank_is_named_on_every_rank(launched):
    for rank, out in enumerate(results_of(launched, "dropout mode")):
        assert out["alike"] == "no error", out["alike"]
        for case in ("one rank", "replaced"):
            text = out[case]
            assert f"this is rank {rank}" in text and "synchronized backward #1" in text, (case, text)
            assert "modes: ranks [0] | ranks [1] ran in different modes -- " in text, (case, text)
            assert "module '1' (Dropout): train mode on ranks [0], eval mode on ranks [1]" in text, (case, text)
            assert "module '0'" not in text and "trainable:" not in text, (case, text)


def _sharded_cleared_grads_worker(rank, world_size):
    """optimizer.zero_grad() between backward() and step() (Note [gradients cleared before the
    step] in optimizer_guard.py): on one rank, named at the next check; on every rank, no error."""
    def outcome(clears, set_to_none=True):
        model, opt = _sharded_block_stack()
        gen = torch.Generator().manual_seed(rank)
        for step in range(4):
            model(torch.randn(4, 5, generator=gen)).square().mean().backward()
            if step == 1 and clears:
                opt.zero_grad(set_to_none=set_to_none)
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)

    return {"alike": models.mismatch_or(outcome, True), "one rank": models.mismatch_or(outcome, rank == 1),
            "one rank in place": models.mismatch_or(outcome, rank == 1, False)}


def test_fully_shard_gradients_cleared_before_the_step_on_one_rank_are_named(launched):
    for rank, out in enumerate(results_of(launched, "cleared grads")):
        assert out["alike"] == "no error", out["alike"]
        for case in ("one rank", "one rank in place"):
            text = out[case]
            assert f"this is rank {rank}" in text and "synchronized backward #2" in text, (case, text)
            assert "grads_cleared: ranks [0]: 0; ranks [1]: 1 -- " in text, (case, text)


def _sharded_torch_loss_scale_worker(rank, world_size):
    """torch.amp.GradScaler kept with fully_shard, its scale set by update(new_scale) on one rank only:
    each rank unscales by its own scale, so the replicas drift apart while every counter agrees
    (torch's FSDP2 trains on silently). Noted where it unscales (Note [torch's GradScaler in the step
    check] in scale_check.py); the same scale set on every rank is no divergence."""
    def outcome(new_scale):
        model, opt = _sharded_block_stack()
        scaler = torch.amp.GradScaler("cpu")
        gen = torch.Generator().manual_seed(rank)
        for step in range(4):  # (far below the parameter check's period)
            scaler.scale(model(torch.randn(4, 5, generator=gen)).square().mean()).backward()
            scaler.step(opt)
            scaler.update(new_scale if step == 0 else None)
            opt.zero_grad()

    return {"alike": models.mismatch_or(outcome, 1024.0),
            "one rank": models.mismatch_or(outcome, 1024.0 if rank == 1 else None)}


def test_fully_shard_torch_grad_scaler_scales_that_differ_are_named_a_step_later(launched):
    for rank, out in enumerate(results_of(launched, "torch loss scale")):
        assert out["alike"] == "no error", out["alike"]
        text = out["one rank"]
        assert f"this is rank {rank}" in text and "synchronized backward #2" in text, text
        assert "loss_scale: ranks [0]: 65536.0; ranks [1]: 1024.0 -- " in text, text
        assert "trainable:" not in text and "optimizer_steps:" not in text, text


def _sharded_checks_off_worker(rank, world_size):
    """(Run before any model with the checks on: the optimizer-step guard, once installed, stays.)"""
    os.environ["FUSEDIST_CHECKS"] = "0"  # (as the whole launch had it: read when sharded and at each step)
    try:
        return _sharded_local_step(rank)
    finally:
        del os.environ["FUSEDIST_CHECKS"]


def _sharded_local_step(rank):
    model, opt = _sharded_block_stack()
    model.set_requires_gradient_sync(False)
    model(torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))).sum().backward()
    try:
        opt.step()  # a local step, as torch's FSDP2 allows: the guard is off with the checks
    except RuntimeError as exc:
        return f"refused: {exc}"
    return "stepped"


def test_checks_off_turns_the_fully_shard_step_guard_off(launched):
    """FUSEDIST_CHECKS=0 turns the optimizer-step guard off for fully_shard models too."""
    results = results_of(launched, "checks off")
    assert results == ["stepped", "stepped"], results


@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, {
        "test_checks_off_turns_the_fully_shard_step_guard_off": {"checks off": (_sharded_checks_off_worker, ())},
        "test_fully_shard_step_check_is_not_named_a_ddp_one": {"tags": (_sharded_tags_worker, ())},
        "test_fully_shard_ranks_in_different_train_eval_modes_are_named_on_every_rank": {
            "eval mode": (_sharded_eval_mode_worker, ())},
        "test_fully_shard_dropout_in_eval_mode_on_one_rank_is_named_on_every_rank": {
            "dropout mode": (_sharded_dropout_mode_worker, ())},
        "test_fully_shard_gradients_cleared_before_the_step_on_one_rank_are_named": {
            "cleared grads": (_sharded_cleared_grads_worker, ())},
        "test_fully_shard_torch_grad_scaler_scales_that_differ_are_named_a_step_later": {
            "torch loss scale": (_sharded_torch_loss_scale_worker, ())},
    }, 2, timeout=120)
