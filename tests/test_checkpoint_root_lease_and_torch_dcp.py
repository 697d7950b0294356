"""fusedist.checkpoint as a demanding user meets it: two jobs given one
Checkpointer root (the second is refused, naming the first; a restart of the same run
continues; a job whose lease was taken over stops without writing or pruning)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import weakref

import pytest
import torch
from torch import nn

from fusedist.checkpoint import CheckpointError, Checkpointer, _owner, _root_checks, layout
from fusedist.testing import run_distributed
from test_optim_lamb_and_recipes import _bf16_net, _grads_of, _torch_job


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _step(model, opt, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
    opt.step()


def _job(root, run_id=None, keep=2, seed=0, **kw):
    """A training job's start: model, optimizer, a Checkpointer restored (synchronous saves)."""
    model = _net(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(root, every_steps=1, keep=keep, async_save=False, run_id=run_id, **kw)
    start = ckpt.restore(model, opt)
    return model, opt, ckpt, start


def _train(model, opt, ckpt, steps):
    for step in steps:
        _step(model, opt, step)
        ckpt.maybe_save(step)


def _steps(root):
    return [e.step for e in layout.scan(root) if e.complete]


def _write_lease(root, **fields):
    lease = {"run": "other", "run_source": "run_id", "token": "t" * 32, "host": "elsewhere", "pid": 1,
             "started_unix": 0.0, **fields}
    with open(os.path.join(root, _owner.LEASE), "w") as f:
        json.dump(lease, f)


def test_a_second_job_on_a_root_in_use_is_refused_and_the_first_keeps_its_checkpoints(tmp_path):
    """Job A saves steps 1-3 (keep=2) and runs on. Job B, another run, given the same root:
    refused at restore, naming A; it read and wrote nothing, so A's steps and its next save
    are as they would be alone. (Before: B restored A's step 3 and its saves replaced and
    pruned A's.)"""
    root = str(tmp_path)
    a_model, a_opt, a_ckpt, start = _job(root, run_id="job-a")
    assert start == 0
    _train(a_model, a_opt, a_ckpt, range(1, 4))
    assert _steps(root) == [3, 2]
    b_model, b_opt = _net(5), None
    b_opt = torch.optim.AdamW(b_model.parameters(), lr=1e-2)
    b_ckpt = Checkpointer(root, every_steps=1, keep=1, async_save=False, run_id="job-b")
    before = [p.detach().clone() for p in b_model.parameters()]
    with pytest.raises(CheckpointError, match=r"root of another job: run 'job-a' \(from run_id\), rank 0 process "
                                              rf"{os.getpid()} .*this job is run 'job-b'.*run_id='job-a'"):
        b_ckpt.restore(b_model, b_opt)
    assert all(torch.equal(a, b) for a, b in zip(before, b_model.parameters()))  # nothing loaded
    _train(a_model, a_opt, a_ckpt, range(4, 5))
    assert _steps(root) == [4, 3]
    a_ckpt.close()
    # Once A has closed, the root is free: B starts from A's latest step.
    assert not os.path.exists(os.path.join(root, _owner.LEASE))
    model, opt, ckpt, start = _job(root, run_id="job-b")
    assert start == 4 and all(torch.equal(a, b) for a, b in zip(a_model.parameters(), model.parameters()))
    ckpt.close()


def test_a_restart_of_the_same_run_continues_and_the_old_instance_stops(tmp_path, monkeypatch):
    """torchrun restarts keep TORCHELASTIC_RUN_ID: the new instance restores and saves; the old
    one, if it still runs, fails its next save on every rank naming the new one, and writes
    or prunes nothing."""
    root = str(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rdzv-17")
    old_model, old_opt, old, _ = _job(root, keep=1)
    _train(old_model, old_opt, old, range(1, 3))
    # The restart is another process, whose Checkpointers have not seen this one's
    # (Note [one saving Checkpointer per root in a process]).
    old_process = _root_checks._SAVING
    monkeypatch.setattr(_root_checks, "_SAVING", weakref.WeakValueDictionary())
    new_model, new_opt, new, start = _job(root, keep=1)  # the restart (its predecessor hung, say)
    assert start == 2
    _train(new_model, new_opt, new, range(3, 5))
    assert _steps(root) == [4]
    _step(old_model, old_opt, 3)
    monkeypatch.setattr(_root_checks, "_SAVING", old_process)
    with pytest.raises(CheckpointError, match=r"saving step 3 .*run 'rdzv-17' \(from TORCHELASTIC_RUN_ID\).* took "
                                              r"over .*a restarted instance of this same run"):
        old.save(3)
    assert sorted(os.listdir(root)) == [_owner.LEASE, "step-00000004"]  # step 3 not written, 4 not pruned
    old.close()  # releases nothing that is not its own
    assert os.path.exists(os.path.join(root, _owner.LEASE))
    new.close()
    assert sorted(os.listdir(root)) == ["step-00000004"]


def test_torchruns_default_rdzv_id_is_not_a_run(tmp_path, monkeypatch):
    """Every torchrun launch without --rdzv-id has TORCHELASTIC_RUN_ID=none: two such jobs are
    not one run."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert _owner.run_identity(None)[1] == "this launch"
    root = str(tmp_path)
    _write_lease(root, run="launch-0123456789ab", run_source="this launch")
    with pytest.raises(CheckpointError, match="root of another job: run 'launch-0123456789ab'"):
        _job(root)


def test_a_lease_its_holder_stopped_renewing_is_taken_over(tmp_path):
    """Note [lease heartbeat]: a job killed on another host left its lease, which refused every
    other run until removed by hand. Its heartbeat now tells: a lease not renewed for
    ``lease_timeout_s`` is taken over with a warning, one renewed meanwhile is refused (after
    waiting at most that long), and a saving job renews its own until close()."""
    import threading
    import time
    import warnings

    root = str(tmp_path)
    _write_lease(root, host="node-7", beat_unix=time.time() - 100, beat_s=0.25, token="7" * 32)
    with pytest.warns(UserWarning, match=r"held by run 'other' .* on host node-7, .* was last renewed 1\d\d s ago "
                                         r"\(lease_timeout_s=1\): that job has ended; this one takes the root over"):
        model, opt, ckpt, start = _job(root, lease_timeout_s=1.0)
    _train(model, opt, ckpt, range(1, 2))
    mine = _owner.read(root)
    assert mine["pid"] == os.getpid() and mine["beat_s"] == 0.25
    time.sleep(0.8)  # a few beats
    assert _owner.read(root)["token"] == mine["token"] and _owner.read(root)["beat_unix"] > mine["beat_unix"]
    ckpt.close()
    assert not os.path.exists(os.path.join(root, _owner.LEASE)) and ckpt._heartbeat is None

    # a holder that keeps renewing (another host's job, still running): waited on, then refused
    _write_lease(root, host="node-8", beat_unix=time.time(), beat_s=0.1, token="8" * 32)
    stop = threading.Event()

    def renew():
        while not stop.wait(0.1):
            lease = _owner.read(root)
            lease["beat_unix"] = time.time()
            _owner.write(root, lease)

    renewer = threading.Thread(target=renew)
    renewer.start()
    try:
        t0 = time.perf_counter()
        with pytest.raises(CheckpointError, match=r"root of another job: run 'other'.* on host node-8.*Its holder "
                                                  r"renews the lease"):
            _job(root, lease_timeout_s=2.0)
        assert time.perf_counter() - t0 < 2.0
    finally:
        stop.set()
        renewer.join()

    # one that stopped renewing half a timeout ago: waited out, then taken over
    _write_lease(root, host="node-9", beat_unix=time.time() - 0.5, beat_s=0.25, token="9" * 32)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt, ckpt, start = _job(root, lease_timeout_s=1.0)
    assert 0.3 < time.perf_counter() - t0 < 3.0 and start == 1
    assert any("takes the root over" in str(w.message) for w in caught)
    ckpt.close()
    with pytest.raises(ValueError, match="lease_timeout_s must be a positive number"):
        Checkpointer(root, lease_timeout_s=0)


def test_leases_of_ended_and_unknown_holders(tmp_path):
    """A holder on this host whose process has exited (a job killed, then started again by hand
    without a run id) is taken over; one on another host, where nothing can be checked, is
    refused unless it is this run."""
    root = str(tmp_path)
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True)
    import socket

    _write_lease(root, host=socket.gethostname(), pid=int(child.stdout))  # exited and reaped
    model, opt, ckpt, start = _job(root)
    _train(model, opt, ckpt, range(1, 2))
    assert _owner.read(root)["pid"] == os.getpid()
    ckpt.close()
    _write_lease(root, host="node-7", pid=os.getpid())
    with pytest.raises(CheckpointError, match="root of another job: run 'other'.* on host node-7"):
        _job(root)
    model, opt, ckpt, start = _job(root, run_id="other")  # the same run, on another node now
    assert start == 1
    _train(model, opt, ckpt, range(2, 3))
    assert _owner.read(root)["host"] == socket.gethostname()
    ckpt.close()


@pytest.mark.parametrize("failing", [_owner.LEASE, "rank-00000.pt", "common.pt", "manifest.json"])
def test_a_full_disk_at_any_write_leaves_no_complete_looking_step(tmp_path, monkeypatch, failing):
    """ENOSPC at each write of a save (the lease at the first save, a rank file, common.pt,
    the manifest), asynchronous: the error names what could not be written, no step of it
    looks complete, the earlier one stays, and the next save, with space again, works."""
    from fusedist.checkpoint import _files

    root = str(tmp_path)
    real = _files.atomic_write

    def full(path, write):
        if os.path.basename(path) == failing:
            raise OSError(28, "No space left on device", path)
        return real(path, write)

    model, opt = _net(0), None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(root, keep=1)
    ckpt.restore(model, opt)
    if failing != _owner.LEASE:
        ckpt.save(1)
        ckpt.wait()
    monkeypatch.setattr(_files, "atomic_write", full)
    ckpt.save(2)
    what = {_owner.LEASE: "could not write the lease .fusedist-checkpointer.json",
            "rank-00000.pt": "writing the rank files", "common.pt": "writing the manifest",
            "manifest.json": "writing the manifest"}[failing]
    with pytest.raises(CheckpointError, match=rf"saving step 2 .*{what}.*No space left on device"):
        ckpt.wait()
    assert 2 not in _steps(root) and _steps(root) == ([] if failing == _owner.LEASE else [1])
    monkeypatch.setattr(_files, "atomic_write", real)
    ckpt.save(3)
    ckpt.close()
    assert _steps(root) == [3] and sorted(os.listdir(root)) == ["step-00000003"]


def _two_jobs_worker(rank, world_size, root):
    import fusedist

    model = fusedist.DistributedDataParallel(_net(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(root, every_steps=1, async_save=True, run_id="second")
    try:
        ckpt.restore(model, opt)
    except CheckpointError as exc:
        return str(exc)
    return None


def test_every_rank_of_the_second_job_is_refused(tmp_path):
    """Rank 0 decides; every rank raises the same error at restore (none waits in a collective)."""
    root = str(tmp_path)
    _write_lease(root, run="first", host="node-0", pid=4242)
    errors = run_distributed(_two_jobs_worker, 2, root, timeout=120, pg_timeout=20)
    assert all(e is not None and "root of another job: run 'first'" in e and "node-0" in e for e in errors), errors
    assert json.load(open(os.path.join(root, _owner.LEASE)))["run"] == "first"
    assert os.listdir(root) == [_owner.LEASE]


# ------------------------------------------------- torch's distributed checkpoint into ZeRO


def _dcp_into_zero_worker(rank, world_size, root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    import fusedist
    from fusedist import checkpoint
    from fusedist.optim import FusedAdamW

    kw = dict(lr=1e-2, weight_decay=0.1)
    # A torch job (every rank the same batch: the gradients DDP would average are equal).
    source, source_opt = _torch_job(kw)
    for name, flatten in (("nested", False), ("flat", True)):
        msd, osd = get_state_dict(source, source_opt, options=StateDictOptions(flatten_optimizer_state_dict=flatten))
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(root, name))

    out = {}
    for name in ("nested", "flat"):
        target = _bf16_net(1)
        zero = fusedist.ZeroRedundancyOptimizer(target.parameters(), FusedAdamW, master_weights=True, **kw)
        _grads_of(target, 50)
        zero.step()  # other weights, other masters and moments
        zero.wait_for_params()
        assert checkpoint.load(os.path.join(root, name), target, zero) is None
        loaded = all(torch.equal(a, b) for a, b in zip(target.parameters(), source.parameters()))
        for step in range(2, 5):
            _grads_of(target, step)
            zero.step()
        zero.wait_for_params()
        out[name] = (loaded, [p.detach().clone() for p in target.parameters()])
    try:
        checkpoint.load(os.path.join(root, "nested"), target, zero, fusedist.amp.GradScaler("cpu"))
    except checkpoint.CheckpointError as exc:
        out["scaler"] = str(exc)
    return out


def test_torch_dcp_checkpoint_continues_on_zero_with_master_weights(tmp_path):
    """A torch job's DCP checkpoint (model and AdamW state from get_state_dict, nested or
    flattened as torchtitan saves it) continued on ZeroRedundancyOptimizer(FusedAdamW,
    master_weights=True) at 2 ranks: torch's helpers cannot (a ZeRO state dict is a shard) and
    fusedist.checkpoint.load refused the directory (no manifest). It now loads it: masters
    from the loaded bf16 weights, moments resharded; three more steps match torch's AdamW
    stepping FP32 copies of the loaded weights (the master-weight recipe by hand)."""
    root = str(tmp_path)
    results = run_distributed(_dcp_into_zero_worker, 2, root, timeout=180, pg_timeout=60)
    source = _bf16_net(0)
    source_opt = torch.optim.AdamW(source.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(2):
        _grads_of(source, step)
        source_opt.step()
    ref = _bf16_net(2).float()
    ref.load_state_dict({k: v.float() for k, v in source.state_dict().items()})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt.load_state_dict(source_opt.state_dict())  # bf16 moments widened to fp32, exactly
    follower = _bf16_net(3)  # computes the gradients at the bf16 weights, as the ranks did
    for step in range(2, 5):
        with torch.no_grad():
            for f, r in zip(follower.parameters(), ref.parameters()):
                f.copy_(r)
        for r, g in zip(ref.parameters(), _grads_of(follower, step)):
            r.grad = g.float()
        ref_opt.step()
    for rank, out in enumerate(results):
        assert "holds no GradScaler state" in out["scaler"], out["scaler"]
        for name in ("nested", "flat"):
            loaded, params = out[name]
            assert loaded, (rank, name)
            for p, r in zip(params, ref.parameters()):
                # bf16 weights: the fp32 masters (1e-6 from torch's, as elsewhere) rounded, so
                # within one bf16 ulp (2**-7 relative) of torch's.
                torch.testing.assert_close(p.float(), r.detach(), rtol=2**-7, atol=1e-6,
                                           msg=lambda m: f"rank {rank}, {name}: {m}")
        assert all(torch.equal(a, b) for a, b in zip(out["nested"][1], out["flat"][1]))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_dcp_checkpoint_of_a_model_with_a_child_called_state(tmp_path):
    """Every key of this model starts with 'state.', the form of a flattened optimizer state:
    the model is found by its names (it was refused as holding no state of the model)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from fusedist import checkpoint
    from fusedist.optim import FusedAdamW

    def make(seed):
        torch.manual_seed(seed)
        return nn.ModuleDict({"state": nn.Linear(4, 3)})

    source = make(0)
    opt = torch.optim.AdamW(source.parameters(), lr=1e-2)
    opt.zero_grad()
    source["state"](torch.randn(2, 4)).pow(2).sum().backward()
    opt.step()
    msd, osd = get_state_dict(source, opt)
    assert all(k.startswith("state.") for k in msd)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
    target = make(1)
    target_opt = FusedAdamW(target.parameters(), lr=1e-2)
    assert checkpoint.load(str(tmp_path), target, target_opt) is None
    assert all(torch.equal(a, b) for a, b in zip(source.parameters(), target.parameters()))
    assert torch.equal(target_opt.state[target["state"].weight]["exp_avg"],
                       opt.state[source["state"].weight]["exp_avg"])


def test_a_rollback_is_not_undone_by_the_next_restart(tmp_path):
    """restore(step=2) out of steps 2, 4, 6 (rolling back past a loss spike), then steps 3 and
    4 saved: a crash and restart restored step 6 of the abandoned branch (the newest complete
    one), undoing the rollback. The first save after the rollback now sets 6 aside
    (abandoned-step-00000006, kept); the restart continues from 4 of the new branch."""
    root = str(tmp_path)
    model, opt, ckpt, _ = _job(root, keep=None)
    _train(model, opt, ckpt, range(1, 7))
    ckpt.close()
    assert _steps(root) == [6, 5, 4, 3, 2, 1]
    model, opt = _net(3), None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(root, every_steps=1, keep=None, async_save=False)
    assert ckpt.restore(model, opt, step=2) == 2
    assert _steps(root) == [6, 5, 4, 3, 2, 1]  # a restore alone moves nothing
    with pytest.warns(UserWarning, match=r"continues from step 2; .*set aside as \['abandoned-step-00000003', "
                                         r"'abandoned-step-00000004', 'abandoned-step-00000005', "
                                         r"'abandoned-step-00000006'\]"):
        _train(model, opt, ckpt, range(3, 5))
    expected = [p.detach().clone() for p in model.parameters()]
    # killed here (no close); the restart:
    model, opt, ckpt, start = _job(root, keep=None, seed=9)
    assert start == 4 and all(torch.equal(a, b) for a, b in zip(expected, model.parameters()))
    assert sorted(n for n in os.listdir(root) if n.startswith("abandoned-")) == [
        f"abandoned-step-{s:08d}" for s in (3, 4, 5, 6)]
    ckpt.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_dcp_checkpoint_of_state_dicts_saved_as_they_are(tmp_path):
    """dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}): the optimizer's
    parameters by index (DCP makes the state's keys strings). It was refused ("has no
    parameter '0.weight'"); it loads, and the run continues as torch's does."""
    import torch.distributed.checkpoint as dcp

    from fusedist import checkpoint
    from fusedist.optim import FusedAdamW

    def groups(m):
        return [{"params": m[0].parameters()}, {"params": m[2].parameters(), "lr": 3e-3}]

    source = _net(0)
    opt = torch.optim.AdamW(groups(source), lr=1e-2)
    _step(source, opt, 0)
    dcp.save({"model": source.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=str(tmp_path))
    target = _net(1)
    target_opt = FusedAdamW(groups(target), lr=1e-2)
    assert checkpoint.load(str(tmp_path), target, target_opt) is None
    assert target_opt.param_groups[1]["lr"] == 3e-3
    _step(source, opt, 1)
    _step(target, target_opt, 1)
    # fp32, one step after an exact load: the fused kernel's rounding, 1e-6 as against torch elsewhere
    for a, b in zip(source.parameters(), target.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    with pytest.raises(CheckpointError, match=r"param groups of \[2, 2\] parameters, the optimizer \[4\]"):
        checkpoint.load(str(tmp_path), target, FusedAdamW(target.parameters(), lr=1e-2))


def test_a_param_group_added_during_training_is_named_when_missing_at_restore(tmp_path):
    """A group added mid-training (add_param_group) is in the checkpoint; a restarted program
    that builds the optimizer without it is told which parameters and what to do."""
    from fusedist.optim import FusedAdamW

    root = str(tmp_path)
    model = _net(0)
    opt = FusedAdamW(model[0].parameters(), lr=1e-2)
    ckpt = Checkpointer(root, async_save=False)
    ckpt.restore(model, opt)
    _step(model, opt, 0)
    opt.add_param_group({"params": model[2].parameters(), "lr": 1e-3})  # unfrozen at step 1
    _step(model, opt, 1)
    ckpt.save(2)
    ckpt.close()
    fresh = _net(1)
    with pytest.raises(CheckpointError, match=r"4 parameters saved, 2 here.*also holds \['2\.weight', '2\.bias'\]: "
                                              r"param groups it gained during training \(add_param_group\)"):
        Checkpointer(root).restore(fresh, FusedAdamW(fresh[0].parameters(), lr=1e-2))
    fresh_opt = FusedAdamW(fresh[0].parameters(), lr=1e-2)
    fresh_opt.add_param_group({"params": fresh[2].parameters(), "lr": 1e-3})
    assert Checkpointer(root).restore(fresh, fresh_opt) == 2
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_a_param_group_added_after_the_save_is_named_with_what_to_do(tmp_path):
    """The reverse: the optimizer gained a group after the save. torch's load_state_dict refuses
    other param groups; load and restore refuse too and name the parameters and the remedy (load,
    then add_param_group), which gives what torch gives for that order."""
    from fusedist import checkpoint

    model = _net(0)
    opt = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
    ckpt = Checkpointer(str(tmp_path / "root"), async_save=False)
    ckpt.restore(model, opt)
    _step(model, opt, 0)
    ckpt.save(1)
    ckpt.close()
    checkpoint.save(str(tmp_path / "plain"), model, opt)
    grown = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
    grown.add_param_group({"params": model[2].parameters(), "lr": 1e-3})
    with pytest.raises(CheckpointError, match=r"also holds \['2\.weight', '2\.bias'\]: param groups added since "
                                              r"the save \(add_param_group\) are added after loading"):
        checkpoint.load(str(tmp_path / "plain"), model, grown)
    with pytest.raises(CheckpointError, match=r"lacks \['2\.weight', '2\.bias'\]: param groups added since the "
                                              r"save \(add_param_group\) are added after loading"):
        Checkpointer(str(tmp_path / "root")).restore(model, grown)
    reference = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
    reference.load_state_dict(opt.state_dict())
    reference.add_param_group({"params": model[2].parameters(), "lr": 1e-3})
    as_told = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
    checkpoint.load(str(tmp_path / "plain"), model, as_told)
    as_told.add_param_group({"params": model[2].parameters(), "lr": 1e-3})
    told, ref = as_told.state_dict(), reference.state_dict()
    assert told["param_groups"] == ref["param_groups"] and list(told["state"]) == list(ref["state"]) == [0, 1]
    assert all(torch.equal(told["state"][i][k], ref["state"][i][k]) for i in ref["state"] for k in ref["state"][i])


def test_a_lease_temporary_left_by_a_killed_writer_is_removed_by_the_next_save(tmp_path):
    """A process killed while writing the root's lease (its first save, a heartbeat) left the
    temporary in the root for good; the next complete save removes it by the rule of a step
    directory's temporaries (older than that save), keeping a newer one and a user's file."""
    root = str(tmp_path)
    os.makedirs(root, exist_ok=True)
    abandoned, newer, users = (os.path.join(root, n) for n in (
        f".{_owner.LEASE}.tmp-4242-4243", f".{_owner.LEASE}.tmp-4244-4245", ".notes.json.tmp-7"))
    for path in (abandoned, newer, users):
        with open(path, "w") as f:
            f.write('{"run": "r", "tok')
    os.utime(abandoned, (0, 0))
    os.utime(newer, (2 ** 31, 2 ** 31))  # modified after the save began (another job's, being written)
    model, opt, ckpt, _ = _job(root, run_id="r")
    _train(model, opt, ckpt, range(1, 2))
    ckpt.close()
    assert sorted(os.listdir(root)) == sorted([os.path.basename(newer), os.path.basename(users), "step-00000001"])


def test_two_jobs_started_before_either_saved(tmp_path):
    """Neither job had saved when the other restored (no lease yet): the first save takes the
    root, the other job's first save is refused on every rank, naming it, writing nothing."""
    root = str(tmp_path)
    a_model, a_opt, a_ckpt, _ = _job(root, run_id="job-a")
    b_model, b_opt, b_ckpt, _ = _job(root, run_id="job-b")
    _train(a_model, a_opt, a_ckpt, range(1, 2))
    _step(b_model, b_opt, 1)
    with pytest.raises(CheckpointError, match=r"saving step 1 .*root of another job: run 'job-a'"):
        b_ckpt.save(1)
    _train(a_model, a_opt, a_ckpt, range(2, 4))
    assert _steps(root) == [3, 2]
    b_ckpt.close()
    a_ckpt.close()
    assert sorted(os.listdir(root)) == ["step-00000002", "step-00000003"]
