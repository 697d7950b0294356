"""A Checkpointer refuses to write what its job's restore could not read back (Note
[checkpoints the restore cannot read] in fusedist/checkpoint/_safe_values.py).

A NumPy scalar in ``extra`` or in a param group's ``lr`` was saved without a word, and the
job's next ``restore()`` -- without ``trusted=True``, as the script itself called it -- found
every checkpoint unreadable and could not resume. Now such a save fails on every rank before
anything is written, naming the value; the earlier checkpoints stay the ones restored. A job
that restores with ``trusted=True`` saves and reads such values as before.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed


def _job(root: str, trusted: bool):
    import fusedist
    from fusedist.checkpoint import Checkpointer

    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = Checkpointer(root, keep=3, run_id="numpy-values")
    start = ckpt.restore(model, opt, trusted=trusted)
    return model, opt, ckpt, start


def _train_step(model, opt, rank):
    opt.zero_grad()
    model(torch.randn(3, 4) + rank).pow(2).mean().backward()
    opt.step()


def _save_outcome(ckpt, step, extra=None) -> str:
    from fusedist.checkpoint import CheckpointError

    try:
        ckpt.save(step, extra=extra)
        ckpt.wait()
        return "saved"
    except CheckpointError as exc:
        return str(exc)


def _untrusted_job(rank, world_size, root):
    model, opt, ckpt, _ = _job(root, trusted=False)
    out = {}
    _train_step(model, opt, rank)
    out["plain"] = _save_outcome(ckpt, 1, extra={"best": 0.5})
    _train_step(model, opt, rank)
    out["numpy extra"] = _save_outcome(ckpt, 2, extra={"best": np.float64(0.25), "epoch": 1})
    opt.param_groups[0]["lr"] = np.float64(0.05)  # a schedule computed with NumPy
    out["numpy lr"] = _save_outcome(ckpt, 3, extra={"best": 0.25})
    opt.param_groups[0]["lr"] = float(opt.param_groups[0]["lr"])
    out["after"] = _save_outcome(ckpt, 4, extra={"best": 0.125})
    ckpt.close()
    params = [p.detach().clone() for p in model.parameters()]
    model, opt, ckpt, start = _job(root, trusted=False)  # the restarted script
    out["restored"] = (start, ckpt.extra, all(torch.equal(a, b) for a, b in zip(params, model.parameters())))
    ckpt.close()
    return out


def _trusted_job(rank, world_size, root):
    model, opt, ckpt, _ = _job(root, trusted=True)
    _train_step(model, opt, rank)
    saved = _save_outcome(ckpt, 1, extra={"best": np.float64(0.25)})
    ckpt.close()
    model, opt, ckpt, start = _job(root, trusted=True)
    ckpt.close()
    return saved, start, ckpt.extra


def test_values_the_restore_cannot_read_are_refused_before_writing(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_distributed(_untrusted_job, 2, root, timeout=120)
    for out in results:
        assert out["plain"] == "saved" and out["after"] == "saved", out
        extra_error, lr_error = out["numpy extra"], out["numpy lr"]
        assert "failed on rank 0" in extra_error and "extra['best'] (numpy.float64)" in extra_error, extra_error
        assert "trusted=True" in extra_error and "Nothing was written for step 2" in extra_error, extra_error
        assert "the optimizer's state_dict()['param_groups'][0]['lr'] (numpy.float64)" in lr_error, lr_error
        assert out["restored"] == (4, {"best": 0.125}, True), out["restored"]
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-00000001", "step-00000004"]


def test_a_job_restoring_with_trusted_keeps_saving_such_values(tmp_path):
    for saved, start, extra in run_distributed(_trusted_job, 2, str(tmp_path / "ckpt"), timeout=120):
        assert saved == "saved" and start == 1
        assert extra == {"best": 0.25} and type(extra["best"]) is np.float64


def test_torchs_schedulers_and_fused_optimizer_states_are_readable():
    """No false refusal: the state of every kind of LR scheduler torch ships (a Counter of
    milestones included) and of a fused optimizer with masters is what the safe loader reads;
    a NumPy array or a user object is named where it sits."""
    import fusedist
    from fusedist.checkpoint._safe_values import first_unreadable

    S = torch.optim.lr_scheduler
    model = nn.Linear(3, 2).to(torch.bfloat16)
    opt = fusedist.optim.FusedAdamW(model.parameters(), lr=0.1, master_weights=True)
    model(torch.randn(2, 3, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    schedulers = [S.StepLR(opt, 2), S.MultiStepLR(opt, [1, 3]), S.OneCycleLR(opt, max_lr=0.1, total_steps=10),
                  S.CyclicLR(opt, 0.01, 0.1), S.CosineAnnealingWarmRestarts(opt, 3), S.ReduceLROnPlateau(opt),
                  S.LambdaLR(opt, lambda s: 0.9 ** s), S.PolynomialLR(opt),
                  S.SequentialLR(opt, [S.LinearLR(opt), S.ExponentialLR(opt, 0.9)], milestones=[2]),
                  torch.optim.swa_utils.SWALR(opt, swa_lr=0.05)]
    for sched in schedulers:
        assert first_unreadable(sched.state_dict(), type(sched).__name__) is None, type(sched).__name__
    assert first_unreadable(opt.state_dict(), "optimizer") is None
    assert first_unreadable({"a": [1, {"b": np.zeros(2)}]}, "extra") == "extra['a'][1]['b'] (numpy.ndarray)"
    assert first_unreadable({"cfg": _Config()}, "extra").startswith("extra['cfg'] (")


class _Config:
    width = 8


def test_plain_save_warns_about_values_only_a_trusted_load_reads(tmp_path):
    """fusedist.checkpoint.save (outside a Checkpointer, which refuses them) writes such values
    but says so at the save, naming them; the default load then refuses, a trusted one reads
    them; a save of plain values says nothing."""
    import warnings

    from fusedist import checkpoint

    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to say about plain values
        checkpoint.save(str(tmp_path / "plain"), model, opt, extra={"best": 0.25, "epoch": 1})
    opt.param_groups[0]["lr"] = np.float64(0.05)
    with pytest.warns(UserWarning) as caught:
        checkpoint.save(str(tmp_path / "numpy"), model, opt, extra={"best": np.float64(0.25)})
    messages = [str(w.message) for w in caught]
    assert any("extra['best'] (numpy.float64) cannot be read back by load() without trusted=True" in m
               for m in messages), messages
    assert any("the optimizer's param_groups[0]['lr'] (numpy.float64)" in m for m in messages), messages
    with pytest.raises(checkpoint.CheckpointError):
        checkpoint.load(str(tmp_path / "numpy"), nn.Linear(3, 2))
    assert checkpoint.load(str(tmp_path / "numpy"), nn.Linear(3, 2), trusted=True) == {"best": 0.25}
