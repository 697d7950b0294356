"""Detection: stall reports through the store, the per-step cross-rank check, layout checks.

Every scenario is bounded: collective timeouts of a few seconds (FUSEDIST_TIMEOUT_S), a short
report window (FUSEDIST_STALL_REPORT_S) and a wall-clock bound asserted on the whole run.

The scenarios that leave the process group usable (every rank raised at the same point, or none
did) share one launch of the ranks (``launched``), each under the settings its test's own launch had.
"""

import datetime
import os
import time

import pytest
import torch

import models
from conftest import requires_rank_slots
from fault_scripts.train_fault import RaiseInBackward
from fusedist.testing import device_for_rank, run_distributed
from shared_rank_launch import launch_for_selected, results_of, under_env

FAST_FAILURE = {"FUSEDIST_TIMEOUT_S": "3", "FUSEDIST_STALL_REPORT_S": "3"}


class BranchMLP(models.MLP):
    """An MLP whose ``short=True`` branch skips the last layer (its parameters get no gradient)."""

    def forward(self, x, short=False):
        if not short:
            return super().forward(x)
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return x[:, :4]


def _train(model, opt, gen, steps, hook=None):
    for step in range(steps):
        x, y = models.MLP.batch(gen)
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        if hook is not None and hook(step, loss) == "skip":
            continue
        loss.backward()
        opt.step()


# ---------------------------------------------------------------- stall reports
def _stuck_outside_worker(rank, world_size, directory):
    import fusedist
    from fusedist.reliability import StallError

    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(models.MLP())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    # (a store of its own: the group's store goes with the peers)
    reported = torch.distributed.FileStore(os.path.join(directory, "stuck-outside-reported"), world_size)

    def hook(step, loss):
        if rank == 2 and step == 2:
            # e.g. a stalled data loader: alive, but in no collective, until both peers have
            # their reports (a fixed sleep of 9 s outlasted their timeout and report window, 6 s)
            reported.wait(["rank 0", "rank 1"], datetime.timedelta(seconds=60))

    try:
        _train(model, opt, gen, 4, hook)
    except StallError as exc:
        return ("stall", str(exc), exc.report)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return ("other", f"{type(exc).__name__}: {exc}", None)
    finally:
        if rank != 2:
            reported.set(f"rank {rank}", "1")
    return ("finished", "", None)


def test_stall_report_names_rank_stuck_outside_collectives(tmp_path):
    start = time.monotonic()
    results = run_distributed(_stuck_outside_worker, 3, str(tmp_path), env=FAST_FAILURE, timeout=90)
    elapsed = time.monotonic() - start
    for rank in (0, 1):
        kind, text, report = results[rank]
        assert kind == "stall", text
        assert "all_reduce [ddp bucket" in text and "Stall report" in text
        assert "ranks [0, 1] reached all_reduce [ddp bucket" in report
        assert "rank 2: did not report" in report
        assert "DDP step 2" in report  # where the waiting ranks were
    # rank 2 woke up to find its peers gone: its own error carries the others' entries.
    assert results[2][0] in ("stall", "other")
    assert elapsed < 60


def _crash_worker(rank, world_size):
    import fusedist
    from fusedist.reliability import StallError, publish_crash

    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(models.MLP())
    x, y = models.MLP.batch(torch.Generator().manual_seed(rank))
    try:
        model(x).pow(2).mean().backward()  # one good step
        out = model(x)
        if rank == 1:
            out = RaiseInBackward.apply(out)
        out.pow(2).mean().backward()
    except StallError as exc:
        return ("stall", exc.report)
    except ValueError as exc:
        # Under torchrun the chained sys.excepthook does this for an uncaught exception.
        publish_crash(exc)
        time.sleep(1.0)  # keep the process group up while the peer's collective is pending
        return ("crashed", str(exc))
    return ("finished", None)


def test_stall_report_names_crashed_rank():
    results = run_distributed(_crash_worker, 2, env=FAST_FAILURE, timeout=60)
    assert results[1] == ("crashed", "injected failure in backward")
    kind, report = results[0]
    assert kind == "stall"
    assert "rank 1" in report and "CRASHED with ValueError: injected failure in backward" in report
    assert "ranks [0] reached all_reduce [ddp bucket" in report


# ---------------------------------------------------------------- construction, consolidation, checkpoints
def _lone_exchange_worker(rank, world_size, directory):
    """Exchanges made by one rank only, each on its own group (a timed-out exchange leaves its
    group unusable): (1) checkpoint.save on rank 0 while rank 1 consolidates, (2)
    consolidate_state_dict on rank 0 while rank 1 trains on, (3) DDP wrapped on rank 0 only
    while rank 1 waits in a Checkpointer exchange."""
    import torch.distributed as dist

    import fusedist
    from fusedist.checkpoint._writer import Coordinator
    from fusedist.comm import CollectiveError
    from fusedist.reliability import StallError

    groups = [dist.new_group([0, 1]), dist.new_group([0, 1])]  # made while both ranks are here
    coordinator = Coordinator()
    out = {}

    # (1) Ranks in different checkpoint/consolidation exchanges: told at once, group still usable.
    torch.manual_seed(0)
    module = models.MLP()
    opt = fusedist.ZeroRedundancyOptimizer(module.parameters(), torch.optim.SGD, process_group=groups[0], lr=0.1)
    try:
        if rank == 0:
            fusedist.checkpoint.save(directory, module, opt)
        else:
            opt.consolidate_state_dict(to=0)
    except CollectiveError as exc:
        out["mismatch"] = (type(exc).__name__, str(exc))
    out["after_mismatch"] = opt.consolidate_state_dict(to=0) is not None  # both ranks, in step

    # (2) consolidate_state_dict on rank 0 only; rank 1 runs a training step meanwhile. Each report
    # names the other rank's collective, so it waits for the other's entry: the first rank to fail
    # closes the connection and the other fails at once, with a report window that starts before the
    # first one, descheduled on a loaded machine, may have written its entry (2 s was once too short).
    # A report returns as soon as every entry is in: the longer window costs nothing where all report.
    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(models.MLP(), process_group=groups[1])
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    _train(model, opt, gen, 1)
    window, os.environ["FUSEDIST_STALL_REPORT_S"] = os.environ["FUSEDIST_STALL_REPORT_S"], "12"
    start = time.monotonic()
    try:
        if rank == 0:
            opt.consolidate_state_dict(to=0)
        else:
            _train(model, opt, gen, 1)
    except StallError as exc:
        out["consolidate"] = (str(exc), exc.report, time.monotonic() - start)
    finally:
        os.environ["FUSEDIST_STALL_REPORT_S"] = window  # (3) waits its window out: no entry comes there

    # (3) DistributedDataParallel on rank 0 only (default group); rank 1 meanwhile waits for
    # rank 0 in an exchange of the checkpoint writer's group, which never comes.
    start = time.monotonic()
    try:
        if rank == 0:
            fusedist.DistributedDataParallel(models.MLP())
        else:
            coordinator.all_gather(None, "test exchange")
    except StallError as exc:
        out["construction"] = (str(exc), exc.report, time.monotonic() - start)
    # Keep the default group up until both ranks have their reports: each waits for the other's word
    # (a sleep of a few seconds assumed the ranks raise within that of each other, which a loaded
    # machine need not keep; and rank 0 leaving before rank 1's report was read made it say rank 0
    # exited, where it did not report).
    done = dist.FileStore(os.path.join(os.path.dirname(directory), "lone-exchange-done"), 2)
    done.set(f"rank {rank} reported", "1")
    done.wait([f"rank {1 - rank} reported"], datetime.timedelta(seconds=60))
    return out


def test_exchanges_made_by_one_rank_are_bounded_and_reported(tmp_path):
    """Construction checks, consolidation and checkpoint exchanges go through the monitored
    path: bounded by FUSEDIST_TIMEOUT_S (3 s, not the group's 30 s), a StallError naming the op
    and the absent rank, and reports that say which op each rank was in."""
    env = {"FUSEDIST_TIMEOUT_S": "3", "FUSEDIST_STALL_REPORT_S": "2"}
    # The monitored path raises after the 3 s timeout, plus the report's wait for the other rank's
    # entry (measured: 3.0-3.2 s for consolidation, where both report; 5.0-5.1 s for construction,
    # which waits its 2 s window out); an exchange outside it waits for the group's 30 s. Any bound
    # between the two tells them apart: 20 s leaves a loaded 2-core machine 15 s of scheduling
    # delay, where 8 s left 3.
    bound = 20
    results = run_distributed(_lone_exchange_worker, 2, str(tmp_path / "ckpt"), env=env, timeout=90,
                              pg_timeout=30)
    # (1) every rank names both calls, and the group stays usable.
    for rank in (0, 1):
        kind, text = results[rank]["mismatch"]
        assert kind == "CollectiveError", text
        assert ("rank 0: fusedist.checkpoint.save: start; "
                "rank 1: ZeroRedundancyOptimizer.consolidate_state_dict") in text, text
    assert [r["after_mismatch"] for r in results] == [True, False]
    # (2) rank 0 waited in consolidate_state_dict, rank 1 in its gradient all-reduce.
    text, report, elapsed = results[0]["consolidate"]
    assert "all_gather [ZeroRedundancyOptimizer.consolidate_state_dict]" in text and "rank 1" in text, text
    assert "rank 1" in report and "failed waiting on all_reduce [ddp bucket" in report, report
    assert elapsed < bound, elapsed
    text, report, elapsed = results[1]["consolidate"]
    assert "all_reduce [ddp bucket" in text
    assert "ranks [0] reached all_gather [ZeroRedundancyOptimizer.consolidate_state_dict]" in report, report
    assert elapsed < bound, elapsed
    # (3) the construction-time model check names itself and the rank that never wrapped.
    text, report, elapsed = results[0]["construction"]
    assert "DistributedDataParallel construction: model check" in text, text
    assert "from rank 1" in text and "rank 1: did not report" in report, report
    assert "ranks [0] reached all_gather [DistributedDataParallel construction: model check]" in report
    assert elapsed < bound, elapsed
    text, report, elapsed = results[1]["construction"]
    assert "all_gather [fusedist.checkpoint.Checkpointer test exchange]" in text and "from rank 0" in text, text
    assert "rank 0: did not report" in report, report
    assert elapsed < bound, elapsed


# ---------------------------------------------------------------- per-step check
def _divergence_worker(rank, world_size):
    """Three divergences in one process group: after each, the group is still usable
    (every rank raised at the same point), so the next scenario starts clean."""
    import fusedist
    from fusedist._consistency import RankMismatchError

    errors = {}

    def fresh(**kwargs):
        torch.manual_seed(0)
        model = fusedist.DistributedDataParallel(BranchMLP(), bucket_cap_mb=0.001, first_bucket_cap_mb=0.001, **kwargs)
        return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.Generator().manual_seed(rank)

    # 1. rank 1 computes a loss at step 2 but skips backward and step ("if bad: continue").
    model, opt, gen = fresh()
    try:
        _train(model, opt, gen, 5, lambda step, loss: "skip" if (rank == 1 and step == 2) else None)
    except RankMismatchError as exc:
        errors["skip"] = str(exc)

    # 2. rank 0 forgets optimizer.step() at step 1.
    model, opt, gen = fresh()
    try:
        for step in range(4):
            x, y = models.MLP.batch(gen)
            opt.zero_grad()
            (model(x) - y).pow(2).mean().backward()
            if not (rank == 0 and step == 1):
                opt.step()
    except RankMismatchError as exc:
        errors["step"] = str(exc)

    # 3. rank 1 runs a different branch (the last layer unused) at step 1.
    model, opt, gen = fresh()
    try:
        for step in range(3):
            x, y = models.MLP.batch(gen)
            opt.zero_grad()
            loss = (model(x, short=(rank == 1 and step == 1)) - y).pow(2).mean()
            loss.backward()
            opt.step()
    except RankMismatchError as exc:
        errors["branch"] = str(exc)

    # The group survived all three: a last collective proves it.
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    errors["alive"] = t.item()
    return errors


def test_divergent_ranks_are_reported_on_every_rank(launched):
    results = results_of(launched, "divergence")
    for rank, errors in enumerate(results):
        assert errors["elapsed"] < 60, errors
        assert errors["alive"] == 2.0
        skip = errors["skip"]
        assert f"this is rank {rank}" in skip and "synchronized backward #2" in skip
        assert "forward: ranks [0]: 3; ranks [1]: 4" in skip
        assert "whose buckets 0.." in skip
        step = errors["step"]
        assert "optimizer_steps: ranks [0]: 1; ranks [1]: 2" in step
        assert "optimizer.step() was called on a different iteration" in step
        branch = errors["branch"]
        assert "unused: ranks [0]: 0; ranks [1]: 2" in branch and "different branch" in branch
    assert "layers.2.weight" in results[1]["branch"]  # the rank that ran the branch names the parameters


def _last_step_worker(rank, world_size, directory):
    """A divergence in the last step of a run has no next forward to be reported at:
    check_consistency() finds it, and checkpoint.save refuses to write it."""
    import os

    import fusedist

    outcome = models.mismatch_or

    def fresh():
        torch.manual_seed(0)
        model = fusedist.DistributedDataParallel(models.MLP())
        return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.Generator().manual_seed(rank)

    out = {}
    model, opt, gen = fresh()
    model.check_consistency()  # before any step: nothing to disagree on
    _train(model, opt, gen, 2)
    model.check_consistency()  # consistent so far: no error
    ckpt = os.path.join(directory, "ckpt")
    fusedist.checkpoint.save(ckpt, model, opt)
    saved = [p.detach().clone() for p in model.parameters()]
    # The last step: rank 0 forgets optimizer.step().
    x, y = models.MLP.batch(gen)
    opt.zero_grad()
    (model(x) - y).pow(2).mean().backward()
    if rank != 0:
        opt.step()
    out["save"] = outcome(fusedist.checkpoint.save, ckpt, model, opt)
    # The earlier checkpoint is untouched and still loads.
    restored, restored_opt, _ = fresh()
    fusedist.checkpoint.load(ckpt, restored, restored_opt)
    out["restored"] = all(torch.equal(a, b) for a, b in zip(restored.parameters(), saved))
    out["again"] = outcome(model.check_consistency)

    # An extra training forward on rank 1 after the last step.
    model, opt, gen = fresh()
    _train(model, opt, gen, 1)
    if rank == 1:
        model(models.MLP.batch(gen)[0])
    out["forward"] = outcome(model.check_consistency)
    # Saved through the bare module with a ZeroRedundancyOptimizer: the optimizer's DDP is checked.
    model, _, gen = fresh()
    zero = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    _train(model, zero, gen, 1)
    if rank == 1:
        model(models.MLP.batch(gen)[0])
    out["zero"] = outcome(fusedist.checkpoint.save, os.path.join(directory, "zero"), model.module, zero)
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    out["alive"] = t.item()
    return out


def test_last_step_divergence_is_found_before_a_checkpoint_is_written(launched):
    results = results_of(launched, "last step")
    for rank, out in enumerate(results):
        assert out["elapsed"] < 60, out
        assert out["alive"] == 2.0
        save = out["save"]
        assert f"this is rank {rank}" in save and "after 3 synchronized backward(s)" in save, save
        assert "check_consistency()" in save
        assert "optimizer_steps: ranks [0]: 2; ranks [1]: 3" in save, save
        assert out["restored"], "the checkpoint written before the divergence must still load"
        assert "optimizer_steps: ranks [0]: 2; ranks [1]: 3" in out["again"]
        assert "forward: ranks [0]: 1; ranks [1]: 2" in out["forward"], out["forward"]
        assert "forward: ranks [0]: 1; ranks [1]: 2" in out["zero"], out["zero"]


def _layout_worker(rank, world_size):
    import fusedist
    from fusedist._consistency import RankMismatchError

    try:
        fusedist.DistributedDataParallel(models.MLP(), bucket_cap_mb=0.001 if rank == 1 else 25.0,
                                         first_bucket_cap_mb=0.001 if rank == 1 else 1.0)
    except RankMismatchError as exc:
        return str(exc)
    return "constructed"


def test_bucket_layout_mismatch_is_reported_at_construction(launched):
    for text in results_of(launched, "layout"):
        assert "gradient bucket layout differs across ranks" in text
        assert "bucket_cap_mb" in text


def _no_false_positive_worker(rank, world_size):
    """no_sync micro-batches, unused parameters with find_unused_parameters, a GradScaler-style
    skipped step on *every* rank: none of these is a divergence."""
    import fusedist

    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(BranchMLP(), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for step in range(4):
        opt.zero_grad()
        for micro in range(2):
            x, y = models.MLP.batch(gen)
            ctx = model.no_sync() if micro == 0 else _null()
            with ctx:
                # an unused layer on one rank only: legitimate with find_unused_parameters
                loss = (model(x, short=(step == 2 and rank == 0)) - y).pow(2).mean()
                loss.backward()
        if step != 1:  # every rank skips step 1 (as GradScaler does on a global inf)
            opt.step()
    return model.watch.sync_steps, model.watch.optimizer_steps


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_consistent_irregular_training_is_not_flagged(launched):
    assert results_of(launched, "no false positive") == [(4, 3), (4, 3)]


def _eval_mode_worker(rank, world_size):
    """A rank left in eval mode (a validation pass without model.train() after it) trains with
    dropout off while the others train with it on: torch's DDP trains on silently (its replicas stay
    equal). Every rank in eval mode alike is no divergence."""
    import fusedist

    def fresh():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.5), torch.nn.Tanh(),
                                  torch.nn.Linear(32, 4))
        model = fusedist.DistributedDataParallel(net)
        return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.Generator().manual_seed(rank)

    def outcome(switch):
        model, opt, gen = fresh()
        _train(model, opt, gen, 1)
        switch(model)
        _train(model, opt, gen, 2)
        model.check_consistency()

    out = {"alike": models.mismatch_or(outcome, lambda model: model.eval()),
           "whole model": models.mismatch_or(outcome, lambda model: model.eval() if rank == 0 else None),
           "one layer": models.mismatch_or(outcome, lambda model: model.module[1].eval() if rank == 1 else None)}
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    out["alive"] = t.item()
    return out


def test_ranks_training_in_different_train_eval_modes_are_named_on_every_rank(launched):
    for rank, out in enumerate(results_of(launched, "eval mode")):
        assert out["alive"] == 2.0 and out["elapsed"] < 60, out
        assert out["alike"] == "no error", out["alike"]
        whole = out["whole model"]
        assert f"this is rank {rank}" in whole and "synchronized backward #1" in whole, whole
        assert "modes: ranks [0] | ranks [1] ran in different modes -- " in whole, whole
        assert "in eval mode on others" in whole and "trainable:" not in whole, whole
        assert "all 5 modules read: train mode on ranks [1], eval mode on ranks [0]" in whole, whole
        layer = out["one layer"]
        assert "module '1' (Dropout): train mode on ranks [0], eval mode on ranks [1]" in layer, layer
        assert "module '0'" not in layer, layer


def _loss_scale_worker(rank, world_size):
    """A GradScaler whose state (another scale) was loaded on one rank only: each rank unscales the
    averaged gradients by its own scale, so the replicas drift apart while every counter agrees
    (torch's DDP trains on silently). The same scale loaded on every rank is no divergence."""
    import fusedist

    def outcome(loaded_scale):
        torch.manual_seed(0)
        model = fusedist.DistributedDataParallel(models.MLP())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = fusedist.amp.GradScaler("cpu")
        if loaded_scale is not None:
            scaler.load_state_dict(dict(scaler.state_dict(), scale=loaded_scale))
        gen = torch.Generator().manual_seed(rank)
        for _ in range(2):  # (far below the parameter check's period)
            x, y = models.MLP.batch(gen)
            opt.zero_grad()
            scaler.scale((model(x) - y).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update()

    return {"alike": models.mismatch_or(outcome, 1024.0),
            "one rank": models.mismatch_or(outcome, 1024.0 if rank == 1 else None)}


def _torch_loss_scale_worker(rank, world_size):
    """torch's own GradScaler (kept with fusedist's wrapper) whose scale update(new_scale) set on one
    rank only: as with fusedist's (above), the replicas drift apart while every counter agrees."""
    import fusedist

    def outcome(new_scale, fused=False):
        torch.manual_seed(0)
        model = fusedist.DistributedDataParallel(models.MLP())
        opt = (torch.optim.Adam(model.parameters(), lr=0.01, fused=True) if fused
               else torch.optim.SGD(model.parameters(), lr=0.1))
        scaler = torch.amp.GradScaler("cpu")
        gen = torch.Generator().manual_seed(rank)
        for step in range(4):  # (far below the parameter check's period)
            x, y = models.MLP.batch(gen)
            opt.zero_grad()
            scaler.scale((model(x) - y).pow(2).mean()).backward()
            scaler.step(opt)
            scaler.update(new_scale if step == 0 else None)

    return {"alike": models.mismatch_or(outcome, 1024.0),
            "one rank": models.mismatch_or(outcome, 1024.0 if rank == 1 else None),
            "fused one rank": models.mismatch_or(outcome, 1024.0 if rank == 1 else None, True)}


def test_ranks_scaling_losses_by_different_grad_scaler_scales_are_named_at_the_next_forward(launched):
    for rank, out in enumerate(results_of(launched, "loss scale")):
        assert out["alike"] == "no error", out["alike"]
        text = out["one rank"]
        assert f"this is rank {rank}" in text and "synchronized backward #0" in text, text
        assert "loss_scale: ranks [0]: 65536.0; ranks [1]: 1024.0 -- " in text, text
        assert "GradScaler scales" in text and "params:" not in text and "control flow" not in text, text
        assert "the ranks were at the same point but did not run it alike" in text, text


def test_torch_grad_scaler_scales_that_differ_are_named_a_step_later(launched):
    """torch.amp.GradScaler's scale is noted where it unscales (Note [torch's GradScaler in the step
    check]): named at the check of the next synchronized backward, with a plain and a fused optimizer."""
    for rank, out in enumerate(results_of(launched, "torch loss scale")):
        assert out["alike"] == "no error", out["alike"]
        for case in ("one rank", "fused one rank"):
            text = out[case]
            assert f"this is rank {rank}" in text and "synchronized backward #2" in text, (case, text)
            assert "loss_scale: ranks [0]: 65536.0; ranks [1]: 1024.0 -- " in text, (case, text)
            assert "params:" not in text and "control flow" not in text, (case, text)


def _cleared_grads_worker(rank, world_size):
    """optimizer.zero_grad() (set to None, or set_to_none=False: zeroed in place) between backward() and step()
    on one rank: its step applies nothing
    while the other's applies the averaged gradients (torch's DDP trains on silently, the replicas
    apart). Clearing on every rank alike is no divergence."""
    import fusedist

    def outcome(clears, set_to_none=True, handed_over=False):
        torch.manual_seed(0)
        model = fusedist.DistributedDataParallel(models.MLP())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if handed_over:  # (Lightning's and Fabric's swap to the fused SGD, before its first step; the loop keeps opt)
            from fusedist.integrations._optimizer_swap import convert_optimizer, hand_over

            hand_over(opt, convert_optimizer(opt, fused_optimizer=True, zero_stage=0, master_weights=False,
                                             strategy="swap", fresh_from="build it anew"), ())
        gen = torch.Generator().manual_seed(rank)
        for step in range(4):  # (far below the parameter check's period)
            x, y = models.MLP.batch(gen)
            opt.zero_grad(set_to_none=set_to_none)
            (model(x) - y).pow(2).mean().backward()
            if step == 1 and clears:
                opt.zero_grad(set_to_none=set_to_none)
            opt.step()

    return {"alike": models.mismatch_or(outcome, True), "one rank": models.mismatch_or(outcome, rank == 1),
            "alike in place": models.mismatch_or(outcome, True, False),
            "one rank in place": models.mismatch_or(outcome, rank == 1, False),
            "alike in place handed over": models.mismatch_or(outcome, True, False, True),
            "one rank in place handed over": models.mismatch_or(outcome, rank == 1, False, True)}


def test_gradients_cleared_before_the_step_on_one_rank_are_named_at_the_next_check(launched):
    """Set to None or zeroed in place (zero_grad(set_to_none=False): Note [gradients cleared before the step]),
    also through an optimizer handed over to a fused one before its first step (the kept one's zero_grad)."""
    for rank, out in enumerate(results_of(launched, "cleared grads")):
        for case in ("", " in place", " in place handed over"):
            assert out["alike" + case] == "no error", (case, out["alike" + case])
            text = out["one rank" + case]
            assert f"this is rank {rank}" in text and "synchronized backward #2" in text, (case, text)
            assert "grads_cleared: ranks [0]: 0; ranks [1]: 1 -- optimizer.step() ran with the model's gradients " \
                "cleared" in text, (case, text)
            assert "params:" not in text and "optimizer_steps:" not in text, (case, text)


def _one_rank_clip_worker(rank, world_size):
    """clip_grad_norm_ between backward() and step() on one rank only: its step applies clipped
    averaged gradients, the other's unclipped ones (torch's DDP trains on silently, the replicas
    apart). Clipping on every rank alike is no divergence, and returns torch's norm."""
    import fusedist
    from fusedist.optim.torch_clip import torch_clip_grad_norm_

    def outcome(clips, clip):
        torch.manual_seed(0)
        model = fusedist.DistributedDataParallel(models.MLP())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        norms = []
        for step in range(4):  # (far below the parameter check's period)
            x, y = models.MLP.batch(gen)
            opt.zero_grad()
            (model(x) - y).pow(2).mean().backward()
            if step == 1 and clips:
                # (torch's norm, as its clip takes it: of the per-gradient norms)
                expected = torch.linalg.vector_norm(torch.stack([g.grad.norm() for g in model.parameters()]))
                norms.append((float(clip()(model.parameters(), 0.01)), float(expected)))
            opt.step()
        return norms

    # (torch's name as looked up at the call, as bound before fusedist replaced it, and fusedist's own)
    clips = {"torch": lambda: torch.nn.utils.clip_grad_norm_, "torch bound before": lambda: torch_clip_grad_norm_,
             "fusedist": lambda: fusedist.clip_grad_norm_}
    out = {f"alike {name}": models.mismatch_or(outcome, True, clip) for name, clip in clips.items()}
    out.update({name: models.mismatch_or(outcome, rank == 1, clip) for name, clip in clips.items()})
    # the norm measured for logging on rank 0 only (max_norm=inf scales nothing): no divergence
    out["logged"] = models.mismatch_or(
        outcome, rank == 0, lambda: lambda params, _: torch.nn.utils.clip_grad_norm_(params, float("inf")))
    return out


def test_a_clip_on_one_rank_only_is_named_at_the_next_check(launched):
    for rank, out in enumerate(results_of(launched, "one rank clip")):
        for name in ("torch", "torch bound before", "fusedist"):
            norms = out[f"alike {name}"]
            assert isinstance(norms, list) and len(norms) == 1, (name, norms)
            assert norms[0][0] == pytest.approx(norms[0][1], rel=1e-6), (name, norms)
            text = out[name]
            assert f"this is rank {rank}" in text and "synchronized backward #2" in text, (name, text)
            assert "clips: ranks [0]: 0; ranks [1]: 1 -- clip_grad_norm_ was called on some ranks only" in text, \
                (name, text)
            # (words true of the replicas here and of a ZeRO optimizer's shards, whose clip is counted alike)
            assert "(DDP's replicas drift apart; under a ZeRO optimizer each rank's shard was updated" in text, \
                (name, text)
            assert "params:" not in text and "optimizer_steps:" not in text, (name, text)
            assert "the ranks were at the same point but did not run it alike" in text, (name, text)
        logged = out["logged"]
        assert isinstance(logged, list) and len(logged) == (1 if rank == 0 else 0), logged
        assert all(norm == pytest.approx(expected, rel=1e-6) for norm, expected in logged), logged


# ---------------------------------------------------------------- the shared launch
def _under(rank, world_size, env, fn, *args):
    """``under_env`` with a dict result given its wall time as ``elapsed``."""
    start = time.monotonic()
    result = under_env(rank, world_size, env, fn, *args)
    if isinstance(result, dict):
        result["elapsed"] = time.monotonic() - start
    return result


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    last_step_dir = str(tmp_path_factory.mktemp("last_step"))
    return launch_for_selected(request, {
        "test_divergent_ranks_are_reported_on_every_rank": {
            "divergence": (_under, (FAST_FAILURE, _divergence_worker))},
        "test_last_step_divergence_is_found_before_a_checkpoint_is_written": {
            "last step": (_under, (FAST_FAILURE, _last_step_worker, last_step_dir))},
        "test_bucket_layout_mismatch_is_reported_at_construction": {
            "layout": (_under, ({}, _layout_worker))},
        "test_consistent_irregular_training_is_not_flagged": {
            "no false positive": (_under, ({}, _no_false_positive_worker))},
        "test_ranks_training_in_different_train_eval_modes_are_named_on_every_rank": {
            "eval mode": (_under, (FAST_FAILURE, _eval_mode_worker))},
        "test_ranks_scaling_losses_by_different_grad_scaler_scales_are_named_at_the_next_forward": {
            "loss scale": (_under, (FAST_FAILURE, _loss_scale_worker))},
        "test_torch_grad_scaler_scales_that_differ_are_named_a_step_later": {
            "torch loss scale": (_under, (FAST_FAILURE, _torch_loss_scale_worker))},
        "test_gradients_cleared_before_the_step_on_one_rank_are_named_at_the_next_check": {
            "cleared grads": (_under, (FAST_FAILURE, _cleared_grads_worker))},
        "test_a_clip_on_one_rank_only_is_named_at_the_next_check": {
            "one rank clip": (_under, (FAST_FAILURE, _one_rank_clip_worker))},
    }, 2, timeout=180)


# ---------------------------------------------------------------- CUDA (the deferred host read)
def _cuda_skip_worker(rank, world_size):
    import fusedist
    from fusedist._consistency import RankMismatchError

    device = device_for_rank(rank)  # several ranks may share it (FUSEDIST_TEST_RANKS_PER_GPU)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(models.MLP().cuda(), device_ids=[device])
    assert model.watch.step_check.on_cuda
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    try:
        for step in range(5):
            x, y = (t.cuda() for t in models.MLP.batch(gen))
            opt.zero_grad()
            loss = (model(x) - y).pow(2).mean()
            if rank == 1 and step == 2:
                continue
            loss.backward()
            opt.step()
    except RankMismatchError as exc:
        return str(exc)
    return "not detected"


@pytest.mark.gpu
@requires_rank_slots(2)
def test_divergence_detected_on_cuda():
    for text in run_distributed(_cuda_skip_worker, 2, backend="nccl", timeout=120):
        assert "forward: ranks [0]: 3; ranks [1]: 4" in text
