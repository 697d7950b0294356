"""fusedist.checkpoint as a demanding user meets it: a model saved under
``torch.compile`` loads uncompiled (and the reverse, inside DDP and ZeRO too) with the names
torch's ``get_model_state_dict`` gives; a save killed mid-write leaves temporaries that a
load ignores and the next complete save removes; a Checkpointer snapshot failing on one
rank fails every rank at once, naming it; a ZeroRedundancyOptimizer load that must be
refused changes nothing, not even the learning rate.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import models
from fusedist.testing import run_distributed
from test_checkpoint_exact_resume_and_refusals import _error

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def _step(model, opt, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(6, 8, generator=gen), torch.randn(6, 3, generator=gen)
    opt.zero_grad()
    (model(x) - y).pow(2).mean().backward()
    opt.step()
    if hasattr(opt, "wait_for_params"):
        opt.wait_for_params()


def _same(a, b) -> bool:
    """Bit-identical nested state (tensors compared with torch.equal, dtypes included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


# ----------------------------------------------------------------------------- torch.compile


def _saved_model_keys(directory: str) -> list:
    return list(torch.load(os.path.join(directory, "common.pt"))["model"])


def test_compiled_and_uncompiled_models_load_each_others_checkpoints(tmp_path):
    """A compiled model's keys and parameter names carry ``_orig_mod.``: its checkpoint was
    refused by the same model uncompiled, and the reverse. Saved now under the names torch's
    ``get_model_state_dict`` gives (it drops ``_orig_mod``), for a compiled model and for a
    compiled submodule; model and optimizer state load across the two."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from fusedist import checkpoint

    model = _net(0)
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    _step(compiled, opt)
    checkpoint.save(str(tmp_path / "compiled"), compiled, opt, extra={"step": 1})
    assert _saved_model_keys(str(tmp_path / "compiled")) == list(get_model_state_dict(compiled))
    checkpoint.save(str(tmp_path / "plain"), model, opt, extra={"step": 1})
    continued = copy.deepcopy(model)
    _step(continued, _copy_opt(continued, opt), seed=1)

    for source, make in (("compiled", lambda m: m), ("plain", lambda m: torch.compile(m, backend="eager"))):
        fresh = _net(5)
        target = make(fresh)
        fresh_opt = torch.optim.AdamW(target.parameters(), lr=1e-2)
        assert checkpoint.load(str(tmp_path / source), target, fresh_opt) == {"step": 1}, source
        assert torch.equal(models.flat_params(fresh), models.flat_params(model)), source
        assert _same(fresh_opt.state_dict(), opt.state_dict()), source
        _step(target, fresh_opt, seed=1)
        assert torch.equal(models.flat_params(fresh), models.flat_params(continued)), source

    # A compiled submodule: its `_orig_mod` is in the middle of the keys.
    nested = _net(1)
    nested[0] = torch.compile(nested[0], backend="eager")
    nested_opt = torch.optim.AdamW(nested.parameters(), lr=1e-2)
    _step(nested, nested_opt)
    checkpoint.save(str(tmp_path / "nested"), nested, nested_opt)
    assert sorted(_saved_model_keys(str(tmp_path / "nested"))) == sorted(get_model_state_dict(nested))
    fresh = _net(6)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    checkpoint.load(str(tmp_path / "nested"), fresh, fresh_opt)
    assert torch.equal(models.flat_params(fresh), models.flat_params(nested))
    assert _same(fresh_opt.state_dict(), nested_opt.state_dict())


def test_checkpoint_wrapped_and_bare_models_load_each_others_checkpoints(tmp_path):
    """torch's ``checkpoint_wrapper`` (activation checkpointing) puts
    ``_checkpoint_wrapped_module.`` into parameter names (its hooks drop it from state-dict
    keys): a checkpoint of the wrapped model named the optimizer's parameters differently from
    the bare model's and was refused. Both directions, model and optimizer state."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from fusedist import checkpoint

    def wrapped(model):
        model[0] = checkpoint_wrapper(model[0])
        return model

    for name, make_saved, make_loaded in (("wrapped", wrapped, lambda m: m), ("bare", lambda m: m, wrapped)):
        saved = make_saved(_net(0))
        opt = torch.optim.AdamW(saved.parameters(), lr=1e-2)
        _step(saved, opt)
        checkpoint.save(str(tmp_path / name), saved, opt, extra={"step": 1})
        fresh = make_loaded(_net(5))
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        assert checkpoint.load(str(tmp_path / name), fresh, fresh_opt) == {"step": 1}, name
        assert torch.equal(models.flat_params(fresh), models.flat_params(saved)), name
        assert _same(fresh_opt.state_dict(), opt.state_dict()), name


def test_a_compiled_models_checkpoint_with_orig_mod_keys_still_loads(tmp_path, monkeypatch):
    """Checkpoints of compiled models written before names were canonical hold
    ``_orig_mod.`` in their model keys and the optimizer's parameter names; they load into the
    model compiled or not."""
    from fusedist import checkpoint
    from fusedist.checkpoint import _names

    model = _net(0)
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    _step(compiled, opt)
    with monkeypatch.context() as m:  # names as they were saved before
        m.setattr(_names, "unwrap", lambda model: model)
        m.setattr(_names, "canonical_key", lambda root, key: key)
        m.setattr(_names, "canonical_state", lambda root, state: state)
        checkpoint.save(str(tmp_path), compiled, opt)
    assert all(k.startswith("_orig_mod.") for k in _saved_model_keys(str(tmp_path)))
    with open(tmp_path / "manifest.json") as f:
        assert all(n.startswith("_orig_mod.") for n in json.load(f)["optimizer"]["param_names"])
    for make in (lambda m: m, lambda m: torch.compile(m, backend="eager")):
        fresh = _net(5)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        checkpoint.load(str(tmp_path), make(fresh), fresh_opt)
        assert torch.equal(models.flat_params(fresh), models.flat_params(model))
        assert _same(fresh_opt.state_dict(), opt.state_dict())


def _copy_opt(model, opt):
    """An AdamW over ``model`` holding ``opt``'s state (to step a second copy alike)."""
    out = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out.load_state_dict(copy.deepcopy(opt.state_dict()))
    return out


def _compiled_ddp_worker(rank, world_size, root):
    import warnings

    import fusedist
    from fusedist import checkpoint

    warnings.simplefilter("ignore")  # dynamo's notes on graph breaks

    def zero(model):
        return fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-2)

    inner = _net(0)
    model = fusedist.DistributedDataParallel(torch.compile(inner, backend="eager"))
    opt = zero(model)
    _step(model, opt)
    checkpoint.save(os.path.join(root, "ddp_compiled"), model, opt)
    out = {}
    targets = {"compile(ddp)": lambda net: torch.compile(fusedist.DistributedDataParallel(net), backend="eager"),
               "ddp": lambda net: fusedist.DistributedDataParallel(net)}
    for name, make in targets.items():
        fresh = _net(5 + rank)
        target = make(fresh)
        fresh_opt = zero(target)
        checkpoint.load(os.path.join(root, "ddp_compiled"), target, fresh_opt)
        out[name] = (torch.equal(models.flat_params(fresh), models.flat_params(inner)),
                     _same(fresh_opt.shard_state_dict(), opt.shard_state_dict()))
        if name == "compile(ddp)":  # and back: saved compiled outside DDP, loaded bare inside it
            checkpoint.save(os.path.join(root, "compiled_ddp"), target, fresh_opt)
    fresh = _net(9)
    target = fusedist.DistributedDataParallel(fresh)
    fresh_opt = zero(target)
    checkpoint.load(os.path.join(root, "compiled_ddp"), target, fresh_opt)
    out["back"] = (torch.equal(models.flat_params(fresh), models.flat_params(inner)),
                   _same(fresh_opt.shard_state_dict(), opt.shard_state_dict()))
    dist.barrier()
    return out


def test_compiled_models_inside_ddp_and_zero_share_checkpoints(tmp_path):
    """DistributedDataParallel(torch.compile(net)) with ZeRO-2, loaded into
    torch.compile(DistributedDataParallel(net)) and into the uncompiled DDP model; then saved
    from the former and loaded into the latter: parameters and every rank's shard equal."""
    results = run_distributed(_compiled_ddp_worker, 2, str(tmp_path), timeout=180,
                              env={"FUSEDIST_TIMEOUT_S": "60"})
    for rank, out in enumerate(results):
        assert out == {"compile(ddp)": (True, True), "ddp": (True, True), "back": (True, True)}, (rank, out)


# ----------------------------------------------------------------------------- killed saves

_KILLED_SAVE = r"""
import sys, time, torch
from torch import nn
from fusedist import checkpoint
from fusedist.checkpoint import _files

directory = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
checkpoint.save(directory, model, extra={"v": 1})
real_save = torch.save

def save_then_hang(obj, f):  # the bytes are written; the kill comes before the rename
    real_save(obj, f)
    f.flush()
    print("WRITING", flush=True)
    time.sleep(600)

_files.torch.save = save_then_hang
with torch.no_grad():
    model[0].weight.add_(1.0)
checkpoint.save(directory, model, extra={"v": 2})
"""


def _temporaries(directory: str) -> list:
    return sorted(n for n in os.listdir(directory) if ".tmp-" in n)


def test_temporaries_of_a_killed_save_are_ignored_then_removed(tmp_path):
    """A process SIGKILLed while writing a save over a complete checkpoint leaves its
    temporary file behind, for ever. A load ignores it (the checkpoint before loads); the next
    complete save into the directory removes it, and the checkpoint-file temporaries of any
    other killed writer older than that save (the manifest's, a rank file's, one with a save
    id) -- but not a user's own files, nor a temporary touched after the save started (a
    writer that may still be alive)."""
    from fusedist import checkpoint

    directory = str(tmp_path / "ckpt")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, directory], stdout=subprocess.PIPE,
                            cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    try:
        line = proc.stdout.readline()
        assert line.strip() == b"WRITING", line
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    killed = _temporaries(directory)
    assert len(killed) == 1 and killed[0].startswith(".common."), killed

    old = time.time() - 600
    made = {".manifest.json.tmp-4000001": old, ".rank-00001.pt.tmp-4000002": old,
            ".common.0123456789ab.pt.tmp-4000003": old, ".rank-00000.pt.tmp-4000006-4000007": old,
            ".notes.txt.tmp-4000004": old, "mine.pt.tmp": old,  # not checkpoint temporaries
            ".rank-00000.pt.tmp-4000005": time.time() + 600}  # touched after the save started
    for name, mtime in made.items():
        with open(os.path.join(directory, name), "wb") as f:
            f.write(b"partial")
        os.utime(os.path.join(directory, name), (mtime, mtime))

    model = _net(0)
    fresh = _net(3)
    assert checkpoint.load(directory, fresh) == {"v": 1}
    assert torch.equal(models.flat_params(fresh), models.flat_params(model))

    checkpoint.save(directory, model, extra={"v": 3})
    assert _temporaries(directory) == [".notes.txt.tmp-4000004", ".rank-00000.pt.tmp-4000005"]
    rest = sorted(set(os.listdir(directory)) - set(_temporaries(directory)))
    assert len(rest) == 3 and rest[0].startswith("common.") and rest[1:] == ["manifest.json", "mine.pt.tmp"], rest
    assert checkpoint.load(directory, _net(4)) == {"v": 3}


def test_threads_of_one_process_write_one_file_atomically(tmp_path):
    """Two threads of one process writing one file (two Checkpointers' background saves writing
    a root's lease): each writer has a temporary of its own, so every write lands whole and
    none fails -- they shared one temporary per process, and a rename or unlink of the other
    thread's temporary failed with ENOENT."""
    import threading

    from fusedist.checkpoint import _files

    path = str(tmp_path / "lease.json")
    errors, start = [], threading.Barrier(2)

    def writer(tag: bytes):
        start.wait()
        try:
            for _ in range(300):
                _files.atomic_write(path, lambda f: f.write(tag * 4096))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=writer, args=(tag,)) for tag in (b"a", b"b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    with open(path, "rb") as f:
        data = f.read()
    assert data in (b"a" * 4096, b"b" * 4096)
    assert [n for n in os.listdir(tmp_path) if ".tmp-" in n] == []


def test_checkpointer_skips_a_killed_step_and_removes_it_after_a_later_one(tmp_path):
    """The periodic Checkpointer's form of the same: a step directory a kill left without a
    manifest (temporaries in it) is skipped by restore and removed once a later step is
    complete; the complete checkpoints are untouched."""
    from fusedist import checkpoint

    model = _net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = checkpoint.Checkpointer(str(tmp_path), keep=None, async_save=False)
    assert ckpt.restore(model, opt) == 0
    _step(model, opt)
    ckpt.save(1)
    killed = tmp_path / "step-00000002"
    killed.mkdir()
    (killed / ".rank-00000.pt.tmp-4000001").write_bytes(b"partial")
    fresh = _net(3)
    with pytest.warns(UserWarning, match="incomplete checkpoint"):
        assert checkpoint.Checkpointer(str(tmp_path)).restore(fresh, torch.optim.AdamW(fresh.parameters())) == 1
    assert torch.equal(models.flat_params(fresh), models.flat_params(model))
    _step(model, opt, seed=1)
    ckpt.save(3)
    ckpt.close()
    assert sorted(os.listdir(tmp_path)) == ["step-00000001", "step-00000003"]


# ----------------------------------------------------------------------------- failing snapshots


class _Sampler:
    """A sampler whose position cannot be copied when ``fail`` is set."""

    def __init__(self):
        self.fail = False

    def state_dict(self):
        if self.fail:
            raise RuntimeError("the data position cannot be copied (injected)")
        return {"position": 0}

    def load_state_dict(self, state):
        pass


def _snapshot_worker(rank, world_size, root):
    import fusedist
    from fusedist import checkpoint

    model = fusedist.DistributedDataParallel(_net(0))
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    sampler = _Sampler()
    ckpt = checkpoint.Checkpointer(root, keep=None)  # asynchronous saves
    ckpt.restore(model, opt, sampler=sampler)
    _step(model, opt)
    out = {}
    sampler.fail = rank == 1
    out["sampler on rank 1"] = _error(lambda: ckpt.save(1))
    sampler.fail = False
    real_stage = ckpt._staging.stage

    def no_memory(state):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory (injected)")

    if rank == 0:
        ckpt._staging.stage = no_memory
    out["staging on rank 0"] = _error(lambda: ckpt.save(2))
    ckpt._staging.stage = real_stage
    out["later save"] = _error(lambda: (ckpt.save(3), ckpt.wait()))
    ckpt.close()
    dist.barrier()
    out["steps"] = sorted(os.listdir(root))
    return out


def test_a_snapshot_failing_on_one_rank_fails_every_rank_at_once(tmp_path):
    """A Checkpointer snapshot that raises on one rank (a state that cannot be copied, a host
    allocation refused) raised there alone: the other ranks' save waited for that rank's files
    until the collective timeout (20 s here). Now every rank raises within seconds, naming the
    rank and the cause; nothing is written for that step, and the next save works."""
    results = run_distributed(_snapshot_worker, 2, str(tmp_path), timeout=150, env={"FUSEDIST_TIMEOUT_S": "20"})
    for rank, out in enumerate(results):
        for case, failing, cause in (("sampler on rank 1", 1, "data position cannot be copied"),
                                     ("staging on rank 0", 0, "can't allocate memory")):
            kind, text, seconds = out[case] or (None, "", 0)
            assert kind == "CheckpointError", (rank, case, out[case])
            assert f"rank {failing}: RuntimeError" in text and cause in text, (rank, case, text)
            assert seconds < 10, (rank, case, seconds)
        assert out["later save"] is None, (rank, out["later save"])
        assert out["steps"] == ["step-00000003"], (rank, out["steps"])


# ----------------------------------------------------------------------------- ZeRO load_state_dict


def _zero_state(opt, model) -> tuple:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return copy.deepcopy(groups), copy.deepcopy(opt.shard_state_dict()), models.flat_params(model).clone()


def test_a_refused_zero_load_state_dict_changes_nothing():
    """ZeroRedundancyOptimizer.load_state_dict installed the saved hyperparameters (and
    rewrote masters and state pieces) before its inner optimizer refused the state: betas it
    cannot unpack, SGD's state (a full state dict or a
    shard) into AdamW, amsgrad under offload (refused only at every later step). Each is now
    refused first, naming the cause, with lr, every other hyperparameter, the shard and the
    parameters bit-identical. (torch's AdamW.load_state_dict takes the amsgrad state, and
    raises KeyError on SGD's state after replacing its param_groups.) A valid state dict
    still loads as into torch's AdamW, a tensor learning rate included (FusedAdamW takes one
    where torch's AdamW does)."""
    import fusedist
    from fusedist.optim import FusedAdamW
    from fusedist.zero.state import StateDictError

    def trained(make):
        model = _net(0)
        opt = make(model.parameters())
        _step(model, opt)
        return opt

    def zero(cls, **kw):
        return lambda ps: fusedist.ZeroRedundancyOptimizer(ps, cls, lr=1e-3, **kw)

    adamw = trained(lambda ps: torch.optim.AdamW(ps, lr=0.5))
    bad_betas = copy.deepcopy(adamw.state_dict())
    bad_betas["param_groups"][0]["betas"] = (0.9,)
    sgd_zero = trained(zero(torch.optim.SGD, momentum=0.9))
    adam_zero = trained(zero(torch.optim.Adam, weight_decay=0.1))  # (L2 decay: without it, Adam's state is AdamW's)
    cases = [
        ("betas", zero(FusedAdamW), bad_betas, "not enough values to unpack"),
        ("sgd full", zero(torch.optim.AdamW),
         trained(lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9)).state_dict(), "another algorithm"),
        ("sgd shard", zero(torch.optim.AdamW), sgd_zero.shard_state_dict(), r"SGD \(SGD\).*AdamW \(AdamW\)"),
        ("adam shard", zero(torch.optim.AdamW), adam_zero.shard_state_dict(), r"Adam \(Adam\).*AdamW \(AdamW\)"),
        ("amsgrad offload", zero(FusedAdamW, offload="cpu"),
         trained(lambda ps: torch.optim.AdamW(ps, lr=0.5, amsgrad=True)).state_dict(), "amsgrad=True"),
    ]
    for name, make, state_dict, message in cases:
        model = _net(1)
        opt = make(model.parameters())
        _step(model, opt, seed=2)
        before = _zero_state(opt, model)
        with pytest.raises(StateDictError, match=message):
            opt.load_state_dict(state_dict)
        assert _same(_zero_state(opt, model), before), name
        _step(model, opt, seed=3)  # still steps as it did

    model, reference = _net(1), _net(1)
    opt = zero(torch.optim.AdamW)(model.parameters())
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt.load_state_dict(adamw.state_dict())
    torch_opt.load_state_dict(adamw.state_dict())
    assert opt.param_groups[0]["lr"] == torch_opt.param_groups[0]["lr"] == 0.5
    _step(model, opt, seed=4)
    _step(reference, torch_opt, seed=4)
    torch.testing.assert_close(models.flat_params(model), models.flat_params(reference), rtol=0, atol=1e-6)

    # fp32 steps; FusedAdamW forms lr / bias_correction in fp64 where torch's AdamW uses fp32,
    # a few fp32 ulps of the update apart.
    tensor_lr = trained(lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(0.5))).state_dict()
    model, reference = _net(1), _net(1)
    opt = zero(FusedAdamW)(model.parameters())
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=torch.tensor(1e-3))
    opt.load_state_dict(tensor_lr)
    torch_opt.load_state_dict(tensor_lr)
    assert float(opt.param_groups[0]["lr"]) == float(torch_opt.param_groups[0]["lr"]) == 0.5
    for seed in (4, 5):
        _step(model, opt, seed=seed)
        _step(reference, torch_opt, seed=seed)
    torch.testing.assert_close(models.flat_params(model), models.flat_params(reference), rtol=0, atol=1e-6)
