"""The resumable samplers against torch's ``DistributedSampler``, and the demo's resume.

* ``len()`` once a resumed pass is over: the next ``iter()`` (no ``set_epoch``) is the whole
  epoch again, as with torch's sampler; ``len()`` said the resumed remainder until that pass
  drew its first index (``tqdm(loader)`` and ``len(loader)`` before the next loop).
* A state of the wrong types (an epoch as a string, an offset as a float, a seed of None) is
  refused at ``load_state_dict`` naming the key, and the sampler is left as it was; it loaded
  and failed at the next ``iter()``.
* The demo (``examples/train_gpt.py``): a resumed cosine schedule continues the schedule it
  saved, so a resumed run split in two trains as the unsplit one; a run with no step to
  train says so, and one whose batch exceeds a rank's share of an epoch is refused; an
  explicit --lr at a resume replaces the saved LR. The Lightning example with no epoch to
  train says so too.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import io
import os
import random
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from fusedist.checkpoint import ElasticDistributedSampler
from fusedist.checkpoint.resume import ResumableDistributedSampler
import demo_recording
from fusedist.testing import run_distributed

SAMPLERS = (ElasticDistributedSampler, ResumableDistributedSampler)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--dim", "32", "--layers", "1", "--heads", "2", "--context", "16", "--batch", "4", "--precision", "fp32"]


def _case():
    rng = random.Random()
    n, world = rng.randint(9, 31), rng.randint(1, 4)
    return n, world, rng.randrange(world), rng.randrange(100), rng.choice([True, False]), rng.choice([True, False])


def _resumed(cls, n, world, rank, seed, shuffle, drop_last, k, epoch=3):
    """A ``cls`` sampler of ``rank`` restored after every rank trained ``k`` samples of ``epoch``."""
    state = None
    for r in range(world):
        s = cls(range(n), world, r, shuffle, seed, drop_last)
        s.set_epoch(epoch)
        iter(s)
        s.advance(k)
        state = s.state_dict() if r == rank else state
    resumed = cls(range(n), world, rank, shuffle, seed, drop_last)
    resumed.load_state_dict(state)
    return resumed, state


@pytest.mark.parametrize("cls", SAMPLERS)
def test_len_after_the_resumed_pass_is_the_whole_share_as_torchs(cls):
    n, world, rank, seed, shuffle, drop_last = _case()
    ref = DistributedSampler(range(n), world, rank, shuffle, seed, drop_last)
    ref.set_epoch(3)
    share = list(ref)
    k = random.randrange(1, len(share)) if len(share) > 1 else 0
    sampler, _ = _resumed(cls, n, world, rank, seed, shuffle, drop_last, k)
    loader = DataLoader(TensorDataset(torch.arange(n)), batch_size=2, sampler=sampler)
    assert len(sampler) == len(share) - k
    seen = []
    for (batch,) in loader:  # the resumed pass
        assert len(sampler) == len(share) - k  # in the loop, before the step's advance
        seen += batch.tolist()
        sampler.advance(len(batch))
    assert seen == share[k:]
    for _ in range(2):  # the next passes, without set_epoch: the whole share, as torch's
        assert len(sampler) == len(ref) == len(share), (len(sampler), len(share))
        assert len(loader) == len(DataLoader(range(n), batch_size=2, sampler=ref))
        seen = []
        for (batch,) in loader:
            assert len(sampler) == len(share)
            seen += batch.tolist()
            sampler.advance(len(batch))
        assert seen == share


@pytest.mark.parametrize("cls", SAMPLERS)
def test_states_of_the_wrong_types_are_refused_naming_the_key_and_change_nothing(cls):
    n, world, rank, seed, shuffle, drop_last = _case()
    _, state = _resumed(cls, n, world, rank, seed, shuffle, drop_last, 1)
    position = "consumed" if cls is ElasticDistributedSampler else "offset"
    bad = [("epoch", "3"), ("epoch", 3.0), ("epoch", None), ("epoch", True), ("seed", None), ("seed", str(seed)),
           ("num_replicas", str(world)), ("shuffle", int(shuffle)), ("drop_last", None), ("dataset_len", float(n)),
           (position, float(state[position]))]
    for key, value in bad:
        sampler = cls(range(n), world, rank, shuffle, seed, drop_last)
        sampler.set_epoch(5)
        before = list(sampler)
        with pytest.raises(ValueError, match=f"saved {key}=|saved position"):
            sampler.load_state_dict(dict(state, **{key: value}))
        assert sampler.epoch == 5 and list(sampler) == before, key
    cls(range(n), world, rank, shuffle, seed, drop_last).load_state_dict(state)  # the right types load


# ---------------------------------------------------------------- the demo
def _demo_runs(rank, world, tmp, seed, runs):
    """Each of ``runs`` (argv) through the demo's main() in turn: its printed lines and
    per-step losses, and its final parameters."""
    out = []
    for i, argv in enumerate(runs):
        if not torch.distributed.is_initialized():  # (the demo destroyed the previous one)
            torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/rdzv-{i}", rank=rank,
                                                 world_size=world, timeout=datetime.timedelta(seconds=60))
        demo, seen = demo_recording.recording_demo()
        text = io.StringIO()
        try:
            with contextlib.redirect_stdout(text):
                demo.main(TINY + ["--seed", str(seed)] + argv)  # (argv last: it wins)
        except SystemExit as exc:  # (the process group stays, for the next run)
            text.write(f"SystemExit: {exc}")
        out.append((text.getvalue(), seen["losses"], seen["state"]))
    return out


def test_demo_resumed_cosine_schedule_continues_the_saved_one_and_an_empty_run_says_so(tmp_path):
    """A resumed cosine schedule took the saved step index into a schedule rebuilt from the
    resumed run's --steps (the steps still to train): the LR jumped at the resume, and a
    resumed run split in two trained otherwise than the unsplit one. Now the saved schedule
    continues. A run with nothing to train ended with its header only, and a batch larger
    than a rank's share of an epoch failed with a bare StopIteration."""
    seed, tmp = random.randrange(1000), str(tmp_path)
    cos = ["--lr-schedule", "cosine"]
    runs = [["--steps", "3", "--save", f"{tmp}/a"] + cos,
            ["--resume", f"{tmp}/a", "--steps", "2", "--save", f"{tmp}/b1"] + cos,
            ["--resume", f"{tmp}/b1", "--steps", "3"] + cos,
            ["--resume", f"{tmp}/a", "--steps", "5"] + cos,
            ["--steps", "0"],
            ["--resume", f"{tmp}/a", "--steps", "0"] + cos,
            ["--steps", "1", "--batch", "40000"]]
    out = run_distributed(_demo_runs, 2, tmp, seed, runs, timeout=150)[0]
    (_, a, _), (_, b1, _), (_, b2, split), (text, whole, state), (empty, _, _), (empty2, _, _), (big, _, _) = out
    assert len(a) == 3 and b1 + b2 == whole, (b1, b2, whole)
    for k, v in state.items():
        assert torch.equal(split[k], v), k
    assert "the cosine schedule saved with the checkpoint ended at step 3" in text
    for text in (empty, empty2):
        assert "nothing to train: --steps 0" in text, text
    assert "SystemExit: --batch 40000 is more than a rank's share of an epoch" in big, big  # (a bare StopIteration)


def test_demo_lr_given_at_resume_replaces_the_saved_one(tmp_path):
    """--lr was ignored by --resume: the optimizer's state restored the saved LR. Resumed
    with --lr 0, AdamW moves no parameter (its decay is lr * weight_decay too), so the
    resumed run ends on the saved weights, with a constant schedule and mid-cosine."""
    seed, tmp = random.randrange(1000), str(tmp_path)
    cos = ["--lr-schedule", "cosine"]
    runs = [["--steps", "2", "--save", f"{tmp}/const"],
            ["--resume", f"{tmp}/const", "--steps", "2", "--lr", "0"],
            ["--steps", "4", "--save", f"{tmp}/cos"] + cos,
            ["--resume", f"{tmp}/cos", "--steps", "2", "--lr", "0"] + cos,
            ["--resume", f"{tmp}/const", "--steps", "1"]]
    out = run_distributed(_demo_runs, 2, tmp, seed, runs, timeout=150)[0]
    (_, _, const), (said, _, after_const), (_, _, cos_state), (_, _, after_cos), (kept, losses, _) = out
    for saved, resumed in ((const, after_const), (cos_state, after_cos)):
        for k, v in saved.items():
            assert torch.equal(resumed[k], v), k
    assert "lr: --lr 0 replaces the checkpoint's 0.003" in said, said
    assert "replaces" not in kept and len(losses) == 1  # (no --lr: the saved LR, silently)


def test_lightning_example_with_nothing_to_train_says_so_and_refuses_endless_epochs():
    """``examples/lightning_train.py --epochs 0`` failed with ``KeyError: 'loss'`` after the
    fit; ``--epochs -1`` (Lightning: no end) trained without end."""
    script = os.path.join(ROOT, "examples", "lightning_train.py")
    done = subprocess.run([sys.executable, script, "--devices", "1", "--epochs", "0"], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0 and "nothing trained: --epochs 0" in done.stdout, done.stderr[-2000:]
    spec = importlib.util.spec_from_file_location("lightning_train_sampdemo", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as err:
        module.main(["--epochs", "-1"])
    assert "--epochs must be >= 0, got -1" in err.getvalue()
