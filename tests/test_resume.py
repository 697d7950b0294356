"""Fault matrix, checkpoint items: (4) killed mid-save, (5) truncated file, (6) exact bitwise
resume, (7) a ZeRO checkpoint continued at another world size.

Also covered by fusedist.checkpoint's own tests (tests/test_checkpoint.py): corrupted and
missing files refused with a message naming them, nothing half-loaded, and resharding at
load (test_load_at_world_size_3_reshards, ..._at_world_size_1_without_ddp).
"""

import os
import random
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fusedist.testing import run_distributed

# 4 steps per epoch per rank: the resume is mid-epoch and crosses an epoch, and the GradScaler's
# growth tracker is mid-interval when saved (it grows every 3 steps)
TOTAL, HALF = 7, 2


class DropoutNet(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.fc1 = nn.Linear(16, 32, dtype=dtype)
        self.drop = nn.Dropout(0.25)  # consumes the torch generator every step
        self.fc2 = nn.Linear(32, 4, dtype=dtype)

    def forward(self, x):
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


def _setup(rank, seed, dtype):
    import fusedist
    from fusedist.checkpoint.resume import ResumableDistributedSampler

    gen = torch.Generator().manual_seed(7)  # the same dataset on every rank
    data = TensorDataset(torch.randn(32, 16, generator=gen), torch.randn(32, 4, generator=gen))
    sampler = ResumableDistributedSampler(data, shuffle=True, seed=3)
    torch.manual_seed(seed)
    model = fusedist.DistributedDataParallel(DropoutNet(dtype))
    opt = fusedist.optim.FusedAdamW(model.parameters(), lr=1e-2, master_weights=dtype != torch.float32)
    scaler = fusedist.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)  # grows mid-run
    return data, sampler, model, opt, scaler


def _train(steps, data, sampler, model, opt, scaler, dtype, after_step=None):
    """``steps`` steps; ``after_step(i)`` after the i-th (from 1), if given."""
    # Its own generator: each iter() over a DataLoader draws a base seed from its generator,
    # and the resumed run creates an iterator where the uninterrupted one did not.
    loader = DataLoader(data, batch_size=4, sampler=sampler, generator=torch.Generator())
    batches = iter(loader)
    for step in range(1, steps + 1):
        try:
            x, y = next(batches)
        except StopIteration:
            sampler.set_epoch(sampler.epoch + 1)
            batches = iter(loader)
            x, y = next(batches)
        x = (x + 0.01 * torch.randn_like(x)).to(dtype)  # more generator use: input noise
        opt.zero_grad()
        loss = (model(x).float() - y).pow(2).mean() + random.random() * 0  # python RNG too
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sampler.advance(len(x))
        if after_step is not None:
            after_step(step)


def _state(model, opt, scaler):
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    masters = [s["master_param"].clone() for s in opt.state.values() if "master_param" in s]
    return flat, masters, scaler.get_scale()


def _resume_worker(rank, world_size, root, phase):
    from fusedist import checkpoint
    from fusedist.checkpoint import resume

    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        path = os.path.join(root, name)
        if phase == "uninterrupted":  # saving after step HALF on the way
            parts = _setup(rank, 0, dtype)
            data, sampler, model, opt, scaler = parts

            def save_at_half(step):
                if step != HALF:
                    return
                checkpoint.save(path, model, opt, scaler, extra={"step": HALF}, per_rank=resume.resume_state(sampler))
                # The generators move on after the save: the resume must undo this. This run
                # goes on from the states it had, as if it had not saved.
                states = torch.get_rng_state(), random.getstate()
                torch.rand(1000)
                random.random()
                torch.set_rng_state(states[0])
                random.setstate(states[1])

            sampler.set_epoch(0)
            _train(TOTAL, *parts, dtype, after_step=save_at_half)
            out[name] = _state(model, opt, scaler)
        else:  # second_half, in new processes with a new process group
            data, sampler, model, opt, scaler = _setup(rank, 1234, dtype)  # different init: load must win
            extra = checkpoint.load(path, model, opt, scaler)
            assert resume.restore(checkpoint.load_per_rank(path), sampler)
            _train(TOTAL - extra["step"], data, sampler, model, opt, scaler, dtype)
            out[name] = _state(model, opt, scaler)
    return out


def test_exact_resume_is_bitwise(tmp_path, killed_save_run):
    root = str(tmp_path)
    full = run_distributed(_resume_worker, 2, root, "uninterrupted", timeout=180)
    resumed = run_distributed(_resume_worker, 2, root, "second_half", timeout=180)
    for rank in range(2):
        for name in ("fp32", "bf16"):
            flat_a, masters_a, scale_a = full[rank][name]
            flat_b, masters_b, scale_b = resumed[rank][name]
            assert torch.equal(flat_a, flat_b), (rank, name, (flat_a - flat_b).abs().max())
            assert len(masters_a) == len(masters_b) == (4 if name == "bf16" else 0)
            assert all(torch.equal(a, b) for a, b in zip(masters_a, masters_b))
            assert scale_a == scale_b and scale_a > 2.0**8  # the scale grew, and resumed exactly
    assert torch.equal(full[0]["fp32"][0], full[1]["fp32"][0])  # ranks agree, too


# ---------------------------------------------------------------- killed mid-save, truncated
def _killed_save_worker(rank, world_size, root, kill_fraction):
    import fusedist
    from fusedist import checkpoint
    from fusedist.checkpoint import _files, resume

    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(DropoutNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))

    def step():
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    step()
    checkpoint.save(os.path.join(root, "ckpt-1"), model, opt, per_rank=resume.resume_state())
    saved = [p.detach().clone() for p in model.module.parameters()]
    step()
    if rank == 1:
        real_write = _files.atomic_write

        def dying_write(path, write):
            def partial(f):  # write part of the file, then die as if SIGKILLed at that point
                import io

                buf = io.BytesIO()
                write(buf)
                data = buf.getvalue()
                f.write(data[: int(len(data) * kill_fraction)])
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)

            return real_write(path, partial)

        _files.atomic_write = dying_write
    try:
        checkpoint.save(os.path.join(root, "ckpt-2"), model, opt, per_rank=resume.resume_state())
    except Exception as exc:  # noqa: BLE001 - rank 0 learns that its peer died
        return saved, f"{type(exc).__name__}: {exc}"
    return saved, None


@pytest.fixture(scope="module")
def killed_save_run(tmp_path_factory):
    """(root, future of the killed-save launch), started by the first test that asks: rank 0 waits
    for its dead peer's beat to stay silent (FUSEDIST_CHECKPOINT_PEER_SILENCE_S, 3 s here rather
    than the default 10 s), which overlaps the exact-resume launches instead of adding to them."""
    root = str(tmp_path_factory.mktemp("killed_save"))
    with ThreadPoolExecutor(1) as pool:
        yield root, pool.submit(run_distributed, _killed_save_worker, 2, root, random.Random(0).uniform(0.1, 0.9),
                                timeout=120, pg_timeout=10, expect_failure=True,
                                env={"FUSEDIST_CHECKPOINT_PEER_SILENCE_S": "3"})


def test_killed_save_leaves_previous_checkpoint_intact_and_truncation_is_refused(killed_save_run):
    from fusedist import checkpoint
    from fusedist.checkpoint import CheckpointError

    root, outcome = killed_save_run[0], killed_save_run[1].result()
    assert outcome[1][0] == "error" and "without reporting" in outcome[1][1]  # SIGKILLed
    status, value = outcome[0]
    assert status == "ok", value
    saved, error = value
    assert error is not None  # rank 0's save failed instead of hanging
    # waiting for its peer's writes (Note [waiting for a peer's I/O] in fusedist/checkpoint/_writer.py),
    # it saw the peer's beat stop and named it, without waiting out FUSEDIST_TIMEOUT_S (600 s)
    assert "fusedist.checkpoint.save: rank 0" in error and "rank(s) [1] showed no sign of life for 3 s" in error, error

    # The interrupted checkpoint: its directory is gone (Note [a failed save leaves nothing] in
    # fusedist/checkpoint/_failed_save.py), and loading it is refused with a message that says why.
    assert not os.path.exists(os.path.join(root, "ckpt-2"))
    try:
        checkpoint.load(os.path.join(root, "ckpt-2"), DropoutNet())
        raise AssertionError("loading an interrupted checkpoint must fail")
    except CheckpointError as exc:
        assert "does not exist" in str(exc) and "ckpt-2" in str(exc)

    # The previous checkpoint loads intact (at world size 1, outside any process group).
    model = DropoutNet()
    checkpoint.load(os.path.join(root, "ckpt-1"), model)
    assert all(torch.equal(a, b) for a, b in zip(saved, model.parameters()))
    assert checkpoint.load_per_rank(os.path.join(root, "ckpt-1")) is None  # saved at world size 2
    assert checkpoint.load_per_rank(os.path.join(root, "ckpt-1"), rank=1, world_size=2) is not None

    # A truncated file: refused, naming it, and nothing is loaded half-way.
    bad = os.path.join(root, "ckpt-bad")
    shutil.copytree(os.path.join(root, "ckpt-1"), bad)
    common = os.path.join(bad, "common.pt")
    with open(common, "r+b") as f:
        f.truncate(os.path.getsize(common) // 2)
    fresh = DropoutNet()
    before = [p.detach().clone() for p in fresh.parameters()]
    try:
        checkpoint.load(bad, fresh)
        raise AssertionError("loading a truncated checkpoint must fail")
    except CheckpointError as exc:
        assert "common.pt" in str(exc) and "truncated" in str(exc)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))


def test_resumable_sampler_matches_torch_and_resumes_mid_epoch():
    from torch.utils.data import DistributedSampler

    from fusedist.checkpoint.resume import ResumableDistributedSampler

    data = list(range(37))  # odd size: torch pads the last rank's share
    for rank in range(3):
        ours = ResumableDistributedSampler(data, num_replicas=3, rank=rank, shuffle=True, seed=5)
        ref = DistributedSampler(data, num_replicas=3, rank=rank, shuffle=True, seed=5)
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            ref.set_epoch(epoch)
            assert list(ours) == list(ref)
        ours.advance(4)
        state = ours.state_dict()
        resumed = ResumableDistributedSampler(data, num_replicas=3, rank=rank, shuffle=True, seed=5)
        resumed.load_state_dict(state)
        assert len(list(ref)) == 13 and list(resumed) == list(ref)[4:]
        assert list(resumed) == list(ref)  # the offset applies to one pass only
    other = ResumableDistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=5)
    with pytest.raises(ValueError, match="num_replicas=3 differs"):
        other.load_state_dict(state)


# ---------------------------------------------------------------- 7. different world size
def _global_batch(step):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(6, 16, generator=gen), torch.randn(6, 4, generator=gen)


def _zero_world_size_worker(rank, world_size, root, phase, steps):
    """Global batch of 6 rows per step, split evenly over the ranks (3 ranks: 2 rows each,
    2 ranks: 3 rows each). DDP averages the per-rank means, which is the global mean."""
    import fusedist
    from fusedist import checkpoint

    torch.manual_seed(0 if phase == "before" else 99)  # "after": a different init, the load must win
    model = fusedist.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
    # Overlapped gathers: the checkpoint below is saved while the step's gathers may be landing.
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-2,
                                           overlap_param_gather=True)
    first = 0
    if phase == "after":
        first = checkpoint.load(os.path.join(root, "zero"), model, opt)["step"]
    rows = 6 // world_size
    for step in range(first, first + steps):
        x, y = _global_batch(step)
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        if phase == "before" and step == 2:
            checkpoint.save(os.path.join(root, "zero"), model, opt, extra={"step": step + 1})
    opt.wait_for_params()  # the last step's parameter all-gather overlaps the next forward
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_zero_checkpoint_continues_at_another_world_size(tmp_path):
    root = str(tmp_path)
    # 3 ranks train 6 steps, saving after step 3; 2 ranks resume from that checkpoint for 3
    # more steps of the same global batches.
    reference = run_distributed(_zero_world_size_worker, 3, root, "before", 6, timeout=180)
    resumed = run_distributed(_zero_world_size_worker, 2, root, "after", 3, timeout=180)
    assert torch.equal(resumed[0], resumed[1]) and torch.equal(reference[0], reference[2])
    # Same global-batch math, different per-rank split: the means differ only by fp32
    # summation order (~1e-7 relative), which Adam's normalized steps can amplify a little
    # over 3 steps at lr 1e-2; 1e-5 is far below a single step's change (~1e-2).
    torch.testing.assert_close(resumed[0], reference[0], atol=1e-5, rtol=0)
    assert (resumed[0] - reference[0]).abs().max() < 1e-5
