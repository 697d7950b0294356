"""Jobs that survive failures: fusedist.checkpoint.Checkpointer under torchrun restarts.

* A rank exits hard at step 35 of 40 (checkpoints every 10); ``torchrun --max-restarts=1``
  restarts both ranks, which resume from step 30 and end with the same final loss and
  parameters, bit for bit, as a run that never failed (and never checkpointed).
* A rank SIGKILLed while an asynchronous save is being written: the directory of that step
  has no manifest, ``restore`` skips it with a warning and loads the previous one intact.
* A relaunch of that job at another rank count (2 -> 3) resumes: the ZeRO state is resharded
  and the rest of the epoch is re-split over the new ranks.
* Without a process group: latest-complete discovery, retention, corrupt-checkpoint
  fallback, and the elastic sampler's exactly-once re-split.
"""

import math
import os
import re
import shutil
import signal
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn
from torchrun_launch import finish, launch

from fusedist.checkpoint import CheckpointError, Checkpointer, ElasticDistributedSampler, layout

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_gpt.py")
TINY = ("--dim", "32", "--layers", "1", "--heads", "2", "--context", "16", "--batch", "4", "--precision", "fp32",
        "--lr-schedule", "cosine")
# torch's shared rendezvous store keeps the first attempt's gloo addresses; a restarted
# worker can read them and fail to connect (pytorch/pytorch#135712). README: "Surviving failures".
RESTART_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _final(out: str) -> tuple[str, str]:
    loss = re.findall(r"^final loss (\S+)$", out, re.M)
    digest = re.findall(r"^final parameters sha256 (\S+)$", out, re.M)
    assert len(loss) == 1 and len(digest) == 1, out[-3000:]
    return loss[0], digest[0]


# ---------------------------------------------------------------- under torchrun
#: the torchrun jobs of each test, all started by the first test that asks (``torchrun_jobs``)
_JOBS = {"test_restart_after_a_rank_dies_is_bitwise_identical_to_an_uninterrupted_run": ("clean", "failing"),
         "test_relaunch_at_another_rank_count_reshards_and_resplits_the_epoch": ("clean", "failing"),
         "test_zero3_demo_restarts_and_matches_ddp_bitwise": ("ddp", "zero3")}


@pytest.fixture(scope="module")
def torchrun_jobs(request, tmp_path_factory):
    """({job: future of ``finish``}, {job: checkpoint directory}) of the selected tests' torchrun
    jobs, started at once and each waited for on its own thread: they spend much of their time
    starting up, rendezvousing and restarting, which then overlaps instead of adding up.

    * ``failing``: rank 1 dies at step 35 of 40; torchrun restarts both ranks, which resume from
      the periodic checkpoint. ``clean``: the same job uninterrupted, never checkpointing.
    * ``zero3``: the same failure under ``--zero 3 --optimizer torch``; ``ddp``: its
      uninterrupted reference under ``--zero 0``."""
    wanted = {getattr(item, "originalname", item.name) for item in request.session.items
              if item.module is request.module}
    jobs = {job for test, names in _JOBS.items() if test in wanted for job in names}
    ckpt = {job: str(tmp_path_factory.mktemp(job) / "ckpt") for job in ("failing", "zero3")}
    restart = ("--checkpoint-every", "10", "--fail-at-step", "35")
    args = {"clean": ("--steps", "40", *TINY),
            "failing": ("--steps", "40", *TINY, "--checkpoint-dir", ckpt["failing"], *restart),
            "ddp": ("--steps", "40", *TINY, "--zero", "0", "--optimizer", "torch"),
            "zero3": ("--steps", "40", *TINY, "--zero", "3", "--optimizer", "torch", "--checkpoint-dir",
                      ckpt["zero3"], *restart)}
    procs = {job: launch(SCRIPT, *args[job], env=RESTART_ENV,
                         torchrun_args=("--max-restarts=1",) if job in ckpt else ())
             for job in args if job in jobs}
    # (240 s: four jobs, eight ranks, share the cores; only a hang comes near it)
    with ThreadPoolExecutor(max(len(procs), 1)) as pool:
        yield {job: pool.submit(finish, proc, timeout=240) for job, proc in procs.items()}, ckpt


@pytest.fixture(scope="module")
def restarted_job(torchrun_jobs):
    """The ``failing`` job and the ``clean`` one beside it: (exit codes, outputs, the failing job's
    checkpoint directory as it left it). Shared by the restart test and the relaunch at 3 ranks,
    which goes on from a copy (a shorter suite)."""
    futures, ckpt = torchrun_jobs
    rc_clean, out_clean = futures["clean"].result()
    rc, out = futures["failing"].result()
    return rc_clean, out_clean, rc, out, ckpt["failing"]


def test_restart_after_a_rank_dies_is_bitwise_identical_to_an_uninterrupted_run(killed_async_save_run, torchrun_jobs,
                                                                                restarted_job):
    rc_clean, out_clean, rc, out, ckpt = restarted_job
    assert rc_clean == 0, out_clean[-3000:]
    assert rc == 0, out[-3000:]
    # Step 30's save is asynchronous: on a loaded machine it may still be in flight when rank 1
    # dies at step 35, and the restart then resumes from step 20, the newest complete one.
    assert "rank 1: failing at step 35" in out and re.search(r"resumed from step (20|30)\b", out), out[-3000:]
    assert "resumed" not in out_clean
    assert _final(out) == _final(out_clean)
    # Retention (keep 3) and the one-shot failure marker.
    assert sorted(os.listdir(ckpt)) == ["failed-at-step-35", "step-00000020", "step-00000030", "step-00000040"]


def test_relaunch_at_another_rank_count_reshards_and_resplits_the_epoch(restarted_job, tmp_path):
    """The restarted job's checkpoint of step 40 (world size 2), relaunched at 3 ranks."""
    rc_clean, out_clean, rc, out, job_ckpt = restarted_job
    assert rc == 0 and rc_clean == 0 and "resumed" not in out_clean, (out[-3000:], out_clean[-3000:])
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(job_ckpt, ckpt)
    args = (*TINY, "--checkpoint-dir", ckpt, "--checkpoint-every", "10")
    rc, out = finish(launch(SCRIPT, "--steps", "50", *args, nproc=3), timeout=150)
    assert rc == 0, out[-3000:]
    # 40 steps x 4 sequences x 2 ranks consumed; the 3 ranks go on from there.
    assert re.search(r"resumed from step 40 \(saved at world size 2, now 3: optimizer resharded, data re-split "
                     r"at epoch 0, sample 320 of \d+\)", out), out[-3000:]
    loss = float(_final(out)[0])
    assert 0 < loss < 3.5  # trained on (the untrained loss is ~3.6), not restarted from scratch
    assert layout.latest_complete(ckpt).step == 50
    # The optimizer state went on from step 40 (an AdamW state started afresh at 3 ranks counts
    # 10 steps; the loss above cannot tell), held once over the 3 ranks' shards.
    steps, coverage = _optimizer_steps_and_coverage(layout.step_dir(ckpt, 50), world=3)
    assert steps == {50.0}, f"the optimizer state's step counts at step 50: {sorted(steps)}"
    assert all(held == numel for held, numel in coverage.values()), coverage


def _optimizer_steps_and_coverage(step_dir: str, world: int) -> tuple[set, dict]:
    """The AdamW step counts in a ZeRO checkpoint's shard files, and per parameter (elements held
    by the shards, its numel): read from the files, not through a load that could fill gaps."""
    steps, held, numels = set(), {}, []
    for rank in range(world):
        shard = torch.load(os.path.join(step_dir, f"rank-{rank:05d}.pt"), weights_only=False)["optimizer_shard"]
        assert shard["world_size"] == world, (step_dir, shard["world_size"])
        numels = [math.prod(meta["shape"]) for meta in shard["param_meta"]]
        for index, fragments in shard["fragments"].items():
            for fragment in fragments:
                start, end = fragment["range"]
                held[index] = held.get(index, 0) + end - start
                steps.add(float(fragment["state"]["step"]))
    return steps, {index: (held.get(index, 0), numel) for index, numel in enumerate(numels)}


def test_zero3_demo_restarts_and_matches_ddp_bitwise(torchrun_jobs):
    """The demo under ``--zero 3`` (fully_shard per block and root): a rank dies at step 35,
    torchrun restarts both ranks, the periodic Checkpointer's stage-3 checkpoint resumes them,
    and the final parameters equal those of an uninterrupted DDP run bit for bit (world 2,
    fp32: a reduce-scatter of two ranks sums exactly as the all-reduce does)."""
    futures = torchrun_jobs[0]
    rc_ddp, out_ddp = futures["ddp"].result()
    rc, out = futures["zero3"].result()
    assert rc_ddp == 0, out_ddp[-3000:]
    assert rc == 0, out[-3000:]
    assert "(ZeRO-3)" in out and "rank 1: failing at step 35" in out, out[-3000:]
    assert re.search(r"resumed from step (20|30)\b", out), out[-3000:]  # (as above: step 30's save may be in flight)
    assert _final(out) == _final(out_ddp)


# ---------------------------------------------------------------- killed during an async save
def _killed_async_save_worker(rank, world_size, root):
    import fusedist
    from fusedist.checkpoint import _files

    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
    opt = fusedist.optim.FusedAdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)
    scaler = fusedist.amp.GradScaler("cpu", init_scale=2.0**8)
    ckpt = Checkpointer(root, every_steps=2, keep=3)
    assert ckpt.restore(model, opt, scaler, lr_scheduler=sched) == 0
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    saved = None
    for step in range(1, 5):
        opt.zero_grad()
        scaler.scale(model(x).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        if step == 2:
            ckpt.maybe_save(step)
            ckpt.wait()
            saved = [p.detach().clone() for p in model.module.parameters()]
        if step == 4:
            if rank == 1:  # die half-way through writing this rank's file, in the background
                real = _files.atomic_write

                def dying(path, write):
                    def partial(f):
                        import io

                        buf = io.BytesIO()
                        write(buf)
                        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                        f.flush()
                        os.kill(os.getpid(), signal.SIGKILL)

                    return real(path, partial)

                _files.atomic_write = dying
            ckpt.maybe_save(step)
            try:
                ckpt.close()
            except CheckpointError as exc:
                return saved, str(exc)
    return saved, None


@pytest.fixture(scope="module")
def killed_async_save_run(tmp_path_factory):
    """(root, future of the killed-async-save launch), started by the first test that asks: rank 0
    spends most of it waiting for its dead peer's beat to stay silent (3 s here,
    FUSEDIST_CHECKPOINT_PEER_SILENCE_S), which then overlaps the torchrun jobs instead of adding
    to them."""
    from fusedist.testing import run_distributed

    root = str(tmp_path_factory.mktemp("killed_async_save"))
    with ThreadPoolExecutor(1) as pool:
        yield root, pool.submit(run_distributed, _killed_async_save_worker, 2, root, timeout=120, pg_timeout=10,
                                expect_failure=True, env={"FUSEDIST_CHECKPOINT_PEER_SILENCE_S": "3"})


def test_kill_during_async_save_leaves_previous_checkpoint_loadable(killed_async_save_run):
    root, outcome = killed_async_save_run[0], killed_async_save_run[1].result()
    assert outcome[1][0] == "error"  # SIGKILLed
    status, (saved, error) = outcome[0]
    assert status == "ok" and error is not None, outcome[0]
    assert "save of step 4" in error and "step-00000004" in error and "incomplete" in error, error

    entries = {e.step: e for e in layout.scan(root)}
    assert entries[2].complete and 4 not in entries  # (the failed save's step directory is removed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters())
    assert Checkpointer(root).restore(model) == 2
    assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters()))
    del opt


# ---------------------------------------------------------------- without a process group
def _train_and_save(root, steps, every, keep=3, async_save=True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(root, every_steps=every, keep=keep, async_save=async_save)
    start = ckpt.restore(model, opt)
    x = torch.randn(4, 8)
    params = {}
    for step in range(start + 1, steps + 1):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        if ckpt.maybe_save(step, extra={"tag": f"s{step}"}):
            params[step] = [p.detach().clone() for p in model.parameters()]
    ckpt.close()
    return params, ckpt


def _fresh():
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_retention_keeps_the_newest_complete_and_leaves_other_files(tmp_path):
    root = str(tmp_path)
    os.makedirs(os.path.join(root, "step-00000003"))  # an interrupted save, superseded below
    open(os.path.join(root, "notes.txt"), "w").close()
    with pytest.warns(UserWarning, match=r"skipping incomplete checkpoint .*step-00000003 \(step 3\)"):
        params, ckpt = _train_and_save(root, 12, every=2, keep=2, async_save=False)
    assert sorted(os.listdir(root)) == ["notes.txt", "step-00000010", "step-00000012"]
    assert [s["step"] for s in ckpt.stats] == [2, 4, 6, 8, 10, 12]
    model, opt = _fresh()
    restored = Checkpointer(root, every_steps=2)
    assert restored.restore(model, opt) == 12 and restored.extra == {"tag": "s12"}
    assert all(torch.equal(a, b) for a, b in zip(params[12], model.parameters()))
    # keep=None keeps everything; a directory above the newest step is never touched.
    assert layout.retain(root, None, 12) == []
    os.makedirs(os.path.join(root, "step-00000099"))
    assert layout.retain(root, 1, 12) == [10] and os.path.isdir(os.path.join(root, "step-00000099"))


def test_latest_complete_skips_incomplete_truncated_and_corrupt_checkpoints(tmp_path):
    root = str(tmp_path)
    params, _ = _train_and_save(root, 8, every=2, keep=None)
    assert layout.latest_complete(root).step == 8
    os.unlink(os.path.join(layout.step_dir(root, 8), "manifest.json"))  # killed before its manifest
    common = os.path.join(layout.step_dir(root, 6), "common.pt")
    with open(common, "r+b") as f:
        f.truncate(os.path.getsize(common) - 10)
    entries = {e.step: e for e in layout.scan(root)}
    assert "no manifest" in entries[8].reason and "truncated" in entries[6].reason
    assert layout.latest_complete(root).step == 4
    # Step 4: same size, flipped bytes -- only the checksum at load can tell.
    common = os.path.join(layout.step_dir(root, 4), "common.pt")
    with open(common, "r+b") as f:
        f.seek(os.path.getsize(common) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    model, opt = _fresh()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert Checkpointer(root).restore(model, opt) == 2
    text = "\n".join(str(w.message) for w in caught)
    assert "skipping incomplete checkpoint" in text and "step-00000008" in text and "step-00000006" in text
    assert "checkpoint of step 4" in text and "corrupt" in text and "trying the previous one" in text
    assert all(torch.equal(a, b) for a, b in zip(params[2], model.parameters()))
    with pytest.raises(CheckpointError, match="cannot restore step 6 .*truncated"):
        Checkpointer(root).restore(*_fresh(), step=6)


def test_fresh_start_async_error_and_misuse(tmp_path):
    root = str(tmp_path / "none")
    model, opt = _fresh()
    ckpt = Checkpointer(root, every_steps=1)
    with pytest.raises(RuntimeError, match="call restore"):
        ckpt.save(1)
    assert ckpt.restore(model, opt) == 0
    os.makedirs(root)
    open(layout.step_dir(root, 1), "w").close()  # a file where the step directory goes
    assert ckpt.maybe_save(1) and not ckpt.maybe_save(1)  # the failure surfaces at the next wait
    with pytest.raises(CheckpointError, match=r"saving step 1 to .*step-00000001 failed \(creating the directory\)"):
        ckpt.wait()
    ckpt.wait()  # raised once
    with pytest.raises(ValueError, match="every_steps"):
        Checkpointer(root, every_steps=0)


def test_elastic_sampler_resplits_the_rest_of_the_epoch_exactly_once():
    from torch.utils.data import DistributedSampler

    data = list(range(37))  # odd: torch pads the last share
    for drop_last in (False, True):
        for rank in range(2):  # from the start of an epoch it is torch's sampler
            ours = ElasticDistributedSampler(data, num_replicas=2, rank=rank, seed=5, drop_last=drop_last)
            ref = DistributedSampler(data, num_replicas=2, rank=rank, seed=5, drop_last=drop_last)
            ours.set_epoch(3)
            ref.set_epoch(3)
            assert list(ours) == list(ref) and len(ours) == len(ref)
        # 2 ranks consume 6 samples each, then 3 ranks continue the same epoch.
        before = [ElasticDistributedSampler(data, num_replicas=2, rank=r, seed=5, drop_last=drop_last)
                  for r in range(2)]
        seen = []
        for s in before:
            s.set_epoch(1)
            seen += list(s)[:6]
            s.advance(6)
        state = before[0].state_dict()
        assert state == before[1].state_dict() and state["consumed"] == 12
        after = [ElasticDistributedSampler(data, num_replicas=3, rank=r, seed=5, drop_last=drop_last) for r in range(3)]
        for s in after:
            s.load_state_dict(state)
            seen += list(s)
        assert len({len(s) for s in after}) == 1
        if drop_last:  # 12 + 24: the last sample (not a multiple of 3) is dropped
            assert len(seen) == len(set(seen)) == 36
        else:  # every sample once, plus the padding that makes the remainder split evenly
            assert set(seen) == set(data) and len(seen) == 12 + 27
    # The same world size continues exactly the uninterrupted sequence.
    ref = DistributedSampler(data, num_replicas=2, rank=1, seed=5)
    resumed = ElasticDistributedSampler(data, num_replicas=2, rank=1, seed=5)
    state = dict(ElasticDistributedSampler(data, num_replicas=2, rank=0, seed=5).state_dict(), consumed=10)
    resumed.load_state_dict(state)
    assert list(resumed) == list(ref)[5:] and resumed.consumed == 10
    with pytest.raises(ValueError, match="saved seed=5 differs"):
        ElasticDistributedSampler(data, num_replicas=2, rank=0, seed=6).load_state_dict(state)
