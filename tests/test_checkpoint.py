"""fusedist.checkpoint: save at world size 2, load at 3 and at 1 (resharding), errors.

Training here is world-size independent: every step uses one global batch of 12 samples
split evenly over the ranks, and DDP averages, so the gradients equal the full-batch ones up
to summation order. Continued training after a load must then equal uninterrupted training
within 1e-5 (fp32, ~100 ulps of the parameters after 8 AdamW steps; a wrong shard, a lost
moment or a wrong step count gives errors of order lr = 1e-2).
"""

import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn

import models
from fusedist.testing import run_distributed

GLOBAL_BATCH = 12
TINY_BUCKETS = dict(bucket_cap_mb=0.0005, first_bucket_cap_mb=0.0002)


def _batch(step, rank, world_size):
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = models.MLP.batch(gen, n=GLOBAL_BATCH)
    per = GLOBAL_BATCH // world_size
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _groups(model):
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [dict(params=weights, weight_decay=0.1), dict(params=biases, weight_decay=0.0, lr=5e-3)]


def _run_steps(model, opt, first, last, rank, world_size):
    for step in range(first, last):
        opt.zero_grad()
        x, y = _batch(step, rank, world_size)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    if hasattr(opt, "wait_for_params"):
        opt.wait_for_params()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _zero_model(rank, world_size, stage, seed):
    import fusedist

    torch.manual_seed(seed)
    model = fusedist.DistributedDataParallel(models.MLP(), **TINY_BUCKETS)
    opt = fusedist.ZeroRedundancyOptimizer(_groups(model.module), torch.optim.AdamW, stage=stage, lr=1e-2)
    return model, opt


def _snapshot(model, opt):
    opt.wait_for_params()
    params = [p.detach().clone() for p in model.parameters()]
    return params, opt.shard_state_dict()


def _same_snapshot(a, b):
    if not all(torch.equal(x, y) for x, y in zip(a[0], b[0])):
        return False
    fa, fb = a[1]["fragments"], b[1]["fragments"]
    if fa.keys() != fb.keys():
        return False
    for k in fa:
        for x, y in zip(fa[k], fb[k]):
            if not torch.equal(x["master"], y["master"]):
                return False
            for key in x["state"]:
                if not torch.equal(torch.as_tensor(x["state"][key]), torch.as_tensor(y["state"][key])):
                    return False
    return True


def _save_worker(rank, world_size, directory):
    """Train 4 steps, save, train 4 more (the uninterrupted run); then check load errors."""
    import fusedist
    from fusedist.checkpoint import CheckpointError

    model, opt = _zero_model(rank, world_size, stage=2, seed=0)
    _run_steps(model, opt, 0, 4, rank, world_size)
    scaler = fusedist.amp.GradScaler("cpu", init_scale=1234.0)
    fusedist.checkpoint.save(directory, model, opt, scaler, extra={"step": 4, "note": "hello"})
    files = sorted(os.listdir(directory))
    final = _run_steps(model, opt, 4, 8, rank, world_size)

    out = {"files": files, "final": final, "errors": {}}
    # Damaged copies, made by rank 0; every rank must refuse each and change nothing.
    variants = {
        "corrupt": lambda d: _flip_byte(os.path.join(d, "rank-00001.pt")),
        "truncated": lambda d: _truncate(os.path.join(d, "rank-00000.pt")),
        "missing": lambda d: os.unlink(os.path.join(d, "rank-00001.pt")),
        "no manifest": lambda d: os.unlink(os.path.join(d, "manifest.json")),
    }
    if rank == 0:
        for name, damage in variants.items():
            copy = directory + "-" + name.replace(" ", "_")
            shutil.copytree(directory, copy)
            damage(copy)
    dist.barrier()
    before = _snapshot(model, opt)
    # (a listed file that is not there may be late: a load waits this long for it to show)
    os.environ["FUSEDIST_CHECKPOINT_VISIBLE_S"] = "0.5"
    for name in variants:
        try:
            fusedist.checkpoint.load(directory + "-" + name.replace(" ", "_"), model, opt)
            out["errors"][name] = None
        except CheckpointError as exc:
            out["errors"][name] = str(exc)
    # A model of a different shape: refused before anything is loaded.
    torch.manual_seed(0)
    other = fusedist.DistributedDataParallel(models.MLP(hidden=33))
    other_opt = fusedist.ZeroRedundancyOptimizer(other.parameters(), torch.optim.AdamW, lr=1e-2)
    try:
        fusedist.checkpoint.load(directory, other, other_opt)
        out["errors"]["shape"] = None
    except CheckpointError as exc:
        out["errors"]["shape"] = str(exc)
    out["untouched"] = _same_snapshot(before, _snapshot(model, opt))
    return out


def _flip_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)


def _load_worker(rank, world_size, directory, stage):
    """Load the world-size-2 checkpoint here (a fresh, differently initialized model) and
    continue training 4 steps."""
    import fusedist

    model, opt = _zero_model(rank, world_size, stage=stage, seed=99)
    scaler = fusedist.amp.GradScaler("cpu")
    extra = fusedist.checkpoint.load(directory, model, opt, scaler)
    final = _run_steps(model, opt, 4, 8, rank, world_size)
    return extra, final, scaler.get_scale()


def _resave_worker(rank, world_size, directory, resaved):
    """Load, save again before any step (a loop that saves at the top of the resumed step),
    then load that copy into fresh objects and continue."""
    import fusedist

    model, opt = _zero_model(rank, world_size, stage=2, seed=99)
    fusedist.checkpoint.load(directory, model, opt)
    fusedist.checkpoint.save(resaved, model, opt, extra={"step": 4})
    full = opt.consolidate_state_dict(to=0)  # also before any step: the loaded state, whole
    model, opt = _zero_model(rank, world_size, stage=2, seed=7)
    fusedist.checkpoint.load(resaved, model, opt)
    return _run_steps(model, opt, 4, 8, rank, world_size), None if full is None else len(full["state"])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("ckpt") / "step4")
    per_rank = run_distributed(_save_worker, 2, directory, timeout=180)
    return directory, per_rank


def test_save_writes_per_rank_files_and_refuses_damaged_ones(saved):
    directory, per_rank = saved
    assert per_rank[0]["files"] == ["common.pt", "manifest.json", "rank-00000.pt", "rank-00001.pt"]
    assert torch.equal(per_rank[0]["final"], per_rank[1]["final"])
    for rank, out in enumerate(per_rank):
        errors = out["errors"]
        assert "rank-00001.pt" in errors["corrupt"] and "corrupt" in errors["corrupt"], errors["corrupt"]
        assert "rank-00000.pt" in errors["truncated"] and "bytes" in errors["truncated"], errors["truncated"]
        assert "rank-00001.pt" in errors["missing"] and "missing" in errors["missing"], errors["missing"]
        assert "manifest.json" in errors["no manifest"], errors["no manifest"]
        assert "shape" in errors["shape"] and "layers.0.weight" in errors["shape"], errors["shape"]
        assert out["untouched"], f"rank {rank}: a failed load changed the model or optimizer"


def test_load_at_world_size_3_reshards(saved):
    directory, per_rank = saved
    uninterrupted = per_rank[0]["final"]
    results = run_distributed(_load_worker, 3, directory, 1, timeout=180)
    for extra, final, scale in results:
        assert extra == {"step": 4, "note": "hello"}
        assert scale == 1234.0
        assert (final - uninterrupted).abs().max().item() < 1e-5


def test_save_before_the_first_step_after_a_load_keeps_the_state(saved, tmp_path):
    # Before the first step DDP's bucket layout is not final and no rank owns a shard yet; the
    # loaded state must still reach the new checkpoint (Note [replicated shards]).
    directory, per_rank = saved
    uninterrupted = per_rank[0]["final"]
    results = run_distributed(_resave_worker, 3, directory, str(tmp_path / "resaved"), timeout=180)
    for rank, (final, consolidated) in enumerate(results):
        assert (final - uninterrupted).abs().max().item() < 1e-5
        assert consolidated == (len(list(models.MLP().parameters())) if rank == 0 else None)


def test_load_at_world_size_1_without_ddp(saved, monkeypatch):
    """A single process without torch.distributed: into a ZeroRedundancyOptimizer of world size
    1, and into unsharded optimizers (the consolidated state): torch.optim.AdamW and
    fusedist's FusedAdamW (same state keys; its pure-PyTorch path, kernels are tested apart)."""
    import fusedist
    from fusedist.optim import FusedAdamW

    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", "torch")
    directory, per_rank = saved
    uninterrupted = per_rank[0]["final"]
    assert not dist.is_initialized()
    for kind in ("zero", "torch", "zero+FusedAdamW", "FusedAdamW"):
        torch.manual_seed(99)
        model = models.MLP()
        if kind == "zero":
            opt = fusedist.ZeroRedundancyOptimizer(_groups(model), torch.optim.AdamW, lr=1e-2)
        elif kind == "zero+FusedAdamW":
            opt = fusedist.ZeroRedundancyOptimizer(_groups(model), FusedAdamW, lr=1e-2)
        elif kind == "FusedAdamW":
            opt = FusedAdamW(_groups(model), lr=1e-2)
        else:
            opt = torch.optim.AdamW(_groups(model), lr=1e-2)
        extra = fusedist.checkpoint.load(directory, model, opt)
        assert extra["step"] == 4
        final = _run_steps(model, opt, 4, 8, 0, 1)
        assert (final - uninterrupted).abs().max().item() < 1e-5, kind


def _shorten_a_moment(directory):
    """Drop the last element of one ``exp_avg`` fragment of the ZeRO optimizer shards (the manifest updated
    to match: a save whose shards disagree); the parameter's optimizer index."""
    import json

    from fusedist.checkpoint import _files

    manifest_path = os.path.join(directory, _files.MANIFEST)
    with open(manifest_path) as f:
        manifest = json.load(f)
    for name, info in sorted(manifest["files"].items()):
        path = os.path.join(directory, info.get("file", name))
        if "optimizer_shard" not in info.get("sections", []):
            continue
        obj = torch.load(path, weights_only=False)
        fragments = obj["optimizer_shard"]["fragments"]
        index = max(k for k, frags in fragments.items() if frags and frags[0]["state"]["exp_avg"].numel() > 1)
        fragments[index][0]["state"]["exp_avg"] = fragments[index][0]["state"]["exp_avg"][:-1].clone()
        torch.save(obj, path)
        info.update(_files.file_info(path))
        with open(manifest_path, "w") as f:
            json.dump(manifest, f)
        return index
    raise AssertionError("no optimizer shard in the checkpoint")


def test_inconsistent_zero_state_names_the_parameter_by_its_path(saved, tmp_path):
    """ZeRO optimizer shards whose fragments disagree with the parameter, loaded into an unsharded optimizer
    or read for a pipeline's stages: the error named the parameter by its position in the optimizer's list
    only ("parameter 5 (shape (4,))"); it names its path in the model too."""
    import fusedist
    from fusedist.checkpoint import CheckpointError

    directory = str(tmp_path / "damaged")
    shutil.copytree(saved[0], directory)
    index = _shorten_a_moment(directory)
    model = models.MLP()
    opt = torch.optim.AdamW(_groups(model), lr=1e-2)
    p = [q for g in opt.param_groups for q in g["params"]][index]
    path = next(n for n, q in model.named_parameters() if q is p)
    named = f"state 'exp_avg' of parameter {index} ('{path}', shape {tuple(p.shape)})"
    with pytest.raises(CheckpointError) as info:
        fusedist.checkpoint.load(directory, model, opt)
    assert named in str(info.value)
    # The same shards read for the stages of a pipelined job (an ordinary checkpoint is its one stage).
    from fusedist.checkpoint import _files, pipeline
    from fusedist.zero.state import StateDictError

    manifest = _files.read_manifest(directory)
    with pytest.raises(StateDictError) as info:
        pipeline._Reader(directory, manifest, False).optimizer(pipeline._stages(manifest)[0])
    assert named in str(info.value)


class _Config:
    """A user object in ``extra``: not loadable by the restricted unpickler."""

    def __init__(self, width):
        self.width = width


def test_untrusted_objects_refused_unless_trusted(tmp_path):
    """Files load with torch's weights-only unpickler: a checkpoint whose ``extra`` holds an
    arbitrary object is refused with an error naming the file and ``trusted=True``, leaving the
    model untouched; ``trusted=True`` loads it. fusedist's own content (model, optimizer, RNG
    states including NumPy's) loads without it."""
    import numpy as np

    import fusedist
    from fusedist.checkpoint import resume
    from fusedist.checkpoint._files import CheckpointError

    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    np.random.seed(7)
    fusedist.checkpoint.save(str(tmp_path / "plain"), model, opt, extra={"step": 1},
                             per_rank={"rng": resume.capture_rng_state()})
    fusedist.checkpoint.save(str(tmp_path / "object"), model, opt, extra={"config": _Config(8)})
    expected_numpy = np.random.rand(3)

    fresh = nn.Linear(5, 3)
    before = [p.detach().clone() for p in fresh.parameters()]
    with pytest.raises(CheckpointError, match=r"common\.pt.*trusted=True"):
        fusedist.checkpoint.load(str(tmp_path / "object"), fresh, torch.optim.AdamW(fresh.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters()))
    extra = fusedist.checkpoint.load(str(tmp_path / "object"), fresh, torch.optim.AdamW(fresh.parameters()),
                                     trusted=True)
    assert extra["config"].width == 8
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))

    assert fusedist.checkpoint.load(str(tmp_path / "plain"), nn.Linear(5, 3))["step"] == 1
    np.random.seed(123)
    resume.restore_rng_state(fusedist.checkpoint.load_per_rank(str(tmp_path / "plain"))["rng"])
    assert np.array_equal(np.random.rand(3), expected_numpy)
