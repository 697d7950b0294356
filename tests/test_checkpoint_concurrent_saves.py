"""Two saves into one checkpoint directory at once (Note [one save at a time] in
fusedist/checkpoint/_files.py): the save that finds another's claim on the directory stops
before its manifest, on every rank, with an error naming the other writer, and removes
nothing; a save that completes before another starts removes nothing that save writes; a
claim left by a killed save does not get in the way.

The other save is played by what another job would leave in the directory: its claim file
and a rank file with a name of its own (2 gloo ranks here, the other job's files planted by
rank 0 at the moment under test).
"""

from __future__ import annotations

import json
import os
import random
import warnings

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed

OTHER_CLAIM = {"token": "0" * 32, "host": "other-host", "pid": 4242, "started_unix": 0.0}
OTHER_FILE = "rank-00001.abcdefabcdef.pt"  # a file the other save wrote and has not listed yet


def _plant_other_save(directory: str, claim: bool = True) -> None:
    from fusedist.checkpoint import _files

    if claim:
        with open(os.path.join(directory, _files.CLAIM), "w") as f:
            json.dump(OTHER_CLAIM, f)
    else:
        os.unlink(os.path.join(directory, _files.CLAIM))
    with open(os.path.join(directory, OTHER_FILE), "wb") as f:
        f.write(b"the other save's bytes")


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = nn.Linear(6, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    return model, opt


def _worker(rank, world_size, directory, when, seed):
    from fusedist import checkpoint
    from fusedist.checkpoint import _files, api

    model, opt = _model_and_optimizer(seed)
    checkpoint.save(directory, model, opt, extra={"step": 1}, per_rank={"rank": rank})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the second save holds other values
    if when == "claim left by a killed save" and rank == 0:
        _plant_other_save(directory)
    patched = []
    if rank == 0 and when in ("other save started", "other save started and finished"):
        original = api._write

        def write_then_other_save_starts(*args, **kwargs):
            entry = original(*args, **kwargs)
            _plant_other_save(directory, claim=when == "other save started")
            return entry

        patched.append(("_write", original))
        api._write = write_then_other_save_starts
    if rank == 0 and when == "other save started after the manifest":
        original = _files.write_manifest

        def manifest_then_other_save_starts(*args, **kwargs):
            original(*args, **kwargs)
            _plant_other_save(directory)

        patched.append(("write_manifest", original))
        _files.write_manifest = manifest_then_other_save_starts
    error, caught = None, []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            checkpoint.save(directory, model, opt, extra={"step": 2}, per_rank={"rank": rank})
    except checkpoint.CheckpointError as exc:
        error = str(exc)
    finally:
        for name, fn in patched:
            setattr(api if name == "_write" else _files, name, fn)
    fresh, fresh_opt = _model_and_optimizer(seed + 1)
    extra = checkpoint.load(directory, fresh, fresh_opt)
    loaded = fresh.state_dict()
    return dict(error=error, warnings=[str(w.message) for w in caught if "another save" in str(w.message)],
                step=extra["step"], same_as_first=all(torch.equal(loaded[k], before[k]) for k in before),
                same_as_second=all(torch.equal(loaded[k], model.state_dict()[k]) for k in before),
                listing=sorted(os.listdir(directory)))


def _run(tmp_path, when):
    seed = random.randrange(2**31)
    return seed, run_distributed(_worker, 2, str(tmp_path / "ckpt"), when, seed, timeout=120)


def test_a_save_that_finds_another_save_started_stops_and_removes_nothing(tmp_path):
    seed, results = _run(tmp_path, "other save started")
    for r in results:
        assert r["error"] is not None and "another save" in r["error"], (seed, r["error"])
        assert "process 4242 on host other-host" in r["error"], (seed, r["error"])
        # No manifest of its own: the directory still holds the first checkpoint, whole.
        assert r["step"] == 1 and r["same_as_first"], (seed, r)
        assert OTHER_FILE in r["listing"], (seed, r["listing"])


def test_a_save_whose_claim_vanished_stops(tmp_path):
    # The other save started and finished (and released its claim) while this one ran.
    seed, results = _run(tmp_path, "other save started and finished")
    for r in results:
        assert r["error"] is not None and "finished since" in r["error"], (seed, r["error"])
        assert r["step"] == 1 and r["same_as_first"] and OTHER_FILE in r["listing"], (seed, r)


def test_a_completed_save_leaves_the_files_of_a_save_started_after_its_manifest(tmp_path):
    seed, results = _run(tmp_path, "other save started after the manifest")
    for rank, r in enumerate(results):
        assert r["error"] is None, (seed, r["error"])
        assert r["step"] == 2 and r["same_as_second"], (seed, r)
        assert OTHER_FILE in r["listing"], (seed, r["listing"])
        assert bool(r["warnings"]) == (rank == 0), (seed, r["warnings"])  # rank 0 removes files


@pytest.mark.parametrize("when", ["no other save", "claim left by a killed save"])
def test_saves_one_after_another_complete_and_leave_no_claim(tmp_path, when):
    from fusedist.checkpoint import _files

    seed, results = _run(tmp_path, when)
    for r in results:
        assert r["error"] is None and r["step"] == 2 and r["same_as_second"], (seed, r)
        assert _files.CLAIM not in r["listing"], (seed, r["listing"])
        # The replaced checkpoint's files, and a killed save's, are removed as before.
        assert OTHER_FILE not in r["listing"], (seed, r["listing"])
