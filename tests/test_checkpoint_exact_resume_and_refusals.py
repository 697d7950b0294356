"""fusedist.checkpoint used the way a demanding user uses it: exact resume of ZeRO-1/2 (with
and without CPU offload) in bf16/fp16 with FP32 masters and a GradScaler that skips a step,
a save before any step, and the mistakes that must be refused rather than written or loaded
silently: an optimizer of another kind, ranks saving into or loading from different
directories, ranks passing different things to the same save, an argument error on one rank.

Exactness: at the same world size a resumed run does the same arithmetic as the uninterrupted
one, so parameters, GradScaler scale and hysteresis must match bit for bit.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import models
from phased_launches import launch_phase
from shared_rank_launch import results_of, under_env

GLOBAL_ROWS = 6
TINY_BUCKETS = dict(bucket_cap_mb=0.0001, first_bucket_cap_mb=0.00005)


def _net(seed: int, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)


def _global_batch(step: int):
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randn(GLOBAL_ROWS, 8, generator=gen), torch.randn(GLOBAL_ROWS, 3, generator=gen)


def _rank_batch(step: int, rank: int, world_size: int):
    x, y = _global_batch(step)
    rows = GLOBAL_ROWS // world_size
    return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]


# ----------------------------------------------------------------------------- exact resume

# (name, ZeRO stage or 0 for plain DDP + FusedAdamW, offload, parameter dtype, GradScaler)
RESUME_CONFIGS = [
    ("zero1 bf16", 1, None, torch.bfloat16, False),
    ("zero2 fp16 scaler", 2, None, torch.float16, True),
    ("zero2 offload bf16 scaler", 2, "cpu", torch.bfloat16, True),
    ("zero1 offload fp16 scaler", 1, "cpu", torch.float16, True),
    ("ddp fp16 scaler", 0, None, torch.float16, True),
]
# With a GradScaler the loss is infinite at these steps: each is skipped, the first one only
# uses up the hysteresis, the second (right after the save at step 3) backs the scale off
# only if the hysteresis left at the save was restored.
OVERFLOW_STEPS = (2, 3)


def _build_resume(config, seed):
    import fusedist
    from fusedist.optim import FusedAdamW

    _, stage, offload, dtype, with_scaler = config
    model = fusedist.DistributedDataParallel(_net(seed, dtype), **TINY_BUCKETS)
    if stage:
        opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), FusedAdamW, stage=stage, lr=1e-2,
                                               weight_decay=0.1, master_weights=True, offload=offload)
    else:
        opt = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, master_weights=True)
    scaler = (fusedist.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2, hysteresis=2)
              if with_scaler else None)
    return model, opt, scaler


def _train_resume(model, opt, scaler, first, last, rank, world_size):
    for step in range(first, last):
        x, y = _rank_batch(step, rank, world_size)
        opt.zero_grad()
        out = model(x.to(next(model.parameters()).dtype)).float()
        loss = (out - y).pow(2).mean() * (float("inf") if step in OVERFLOW_STEPS and scaler is not None else 1.0)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    if hasattr(opt, "wait_for_params"):
        opt.wait_for_params()


def _resume_state(model, scaler):
    params = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    if scaler is None:
        return params, None
    return params, (scaler.get_scale(), scaler.state_dict().get("_hysteresis_tracker"))


def _resume_worker(rank, world_size, root):
    """Per config: 6 uninterrupted steps; 3 steps, save, load into fresh objects (another
    initialization), 3 more; a save before any step, loaded and trained 6 steps; and the
    uninterrupted run's own objects rolled back to the step-3 checkpoint, redoing 3 steps."""
    from fusedist import checkpoint

    out = {}
    for config in RESUME_CONFIGS:
        name = config[0]
        trained, trained_opt, trained_scaler = _build_resume(config, 0)
        _train_resume(trained, trained_opt, trained_scaler, 0, 6, rank, world_size)
        reference = _resume_state(trained, trained_scaler)
        for save_at in (3, 0):
            directory = os.path.join(root, f"{name.replace(' ', '_')}-{save_at}")
            model, opt, scaler = _build_resume(config, 0)
            _train_resume(model, opt, scaler, 0, save_at, rank, world_size)
            checkpoint.save(directory, model, opt, scaler, extra={"step": save_at})
            model, opt, scaler = _build_resume(config, 99)
            first = checkpoint.load(directory, model, opt, scaler)["step"]
            _train_resume(model, opt, scaler, first, 6, rank, world_size)
            out[(name, save_at)] = (reference, _resume_state(model, scaler))
        first = checkpoint.load(os.path.join(root, f"{name.replace(' ', '_')}-3"), trained, trained_opt,
                                trained_scaler)["step"]
        _train_resume(trained, trained_opt, trained_scaler, first, 6, rank, world_size)
        out[(name, "rollback")] = (reference, _resume_state(trained, trained_scaler))
    return out


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """The scenarios at world size 2 in one launch, then the load at world size 3 in another."""
    roots = {name: str(tmp_path_factory.mktemp("ckpt")) for name in ("resume", "reshard", "disagreeing ranks")}
    out = launch_phase(request, {
        "test_resume_is_bitwise_for_zero_offload_half_precision_and_scaler": {
            "resume": (_resume_worker, (roots["resume"],))},
        "test_offloaded_zero_with_scaler_reshards_2_to_3": {
            "reshard, before": (_reshard_worker, (roots["reshard"], "before"))},
        "test_ranks_that_disagree_are_refused_on_every_rank": {"disagreeing ranks": (
            under_env, ({"FUSEDIST_TIMEOUT_S": "20"}, _disagreeing_ranks_worker, roots["disagreeing ranks"]))},
    }, 2, timeout=240)
    out.update(launch_phase(request, {"test_offloaded_zero_with_scaler_reshards_2_to_3": {
        "reshard, after": (_reshard_worker, (roots["reshard"], "after"))}}, 3, timeout=120))
    out["roots"] = roots
    return out


def test_resume_is_bitwise_for_zero_offload_half_precision_and_scaler(launched):
    results = results_of(launched, "resume")
    for rank, out in enumerate(results):
        for (name, save_at), ((ref_params, ref_scaler), (params, scaler)) in out.items():
            assert torch.equal(ref_params, params), (
                f"rank {rank}, {name}, saved after {save_at} steps: parameters differ by "
                f"{(ref_params - params).abs().max().item()}")
            assert ref_scaler == scaler, (rank, name, save_at, ref_scaler, scaler)


RESHARD_CONFIGS = [
    ("zero2 offload scaler", 2, "cpu", torch.float32, True),
    ("zero1 offload scaler", 1, "cpu", torch.float32, True),
]


def _reshard_worker(rank, world_size, root, phase):
    """"before": 6 steps with a save after 3; "after": load that save (another world size,
    another initialization) and train steps 3 to 6."""
    from fusedist import checkpoint

    out = {}
    for config in RESHARD_CONFIGS:
        directory = os.path.join(root, config[0].replace(" ", "_"))
        model, opt, scaler = _build_resume(config, 0 if phase == "before" else 99)
        if phase == "before":
            _train_resume(model, opt, scaler, 0, 3, rank, world_size)
            checkpoint.save(directory, model, opt, scaler)
        else:
            checkpoint.load(directory, model, opt, scaler)
        _train_resume(model, opt, scaler, 3, 6, rank, world_size)
        out[config[0]] = _resume_state(model, scaler)
    return out


def test_offloaded_zero_with_scaler_reshards_2_to_3(launched):
    """Same global batches at both sizes: only fp32 summation order differs (a lost moment,
    master or step count is of order lr = 1e-2); the scaler (which skipped a step) exactly."""
    before = results_of(launched, "reshard, before")
    after = results_of(launched, "reshard, after")
    for name, (params, scaler) in before[0].items():
        for rank, out in enumerate(after):
            torch.testing.assert_close(out[name][0], params, atol=1e-5, rtol=0,
                                       msg=lambda m: f"{name}, rank {rank}: {m}")
            assert out[name][1] == scaler, (name, rank, out[name][1], scaler)


# ----------------------------------------------------------------------------- optimizer kind


def test_optimizer_of_another_kind_is_refused(tmp_path):
    """An SGD checkpoint into AdamW (torch's, fused, sharded) and an Adam one into AdamW load
    without complaint into torch's optimizers, which then step with the other optimizer's
    hyperparameters (or fail at the next step): refused at load, nothing changed. The same kind
    under another implementation (torch's Adam into FusedAdam, into a subclass of Adam) loads
    and continues like torch's."""
    import fusedist
    from fusedist import checkpoint
    from fusedist.optim import FusedAdam, FusedAdamW

    class MyAdam(torch.optim.Adam):
        pass

    def one_step(model, opt, step):
        x, y = _global_batch(step)
        opt.zero_grad()
        (model(x) - y).pow(2).mean().backward()
        opt.step()

    saved = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
             "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1)}
    continued = {}
    for name, make in saved.items():
        model = _net(0)
        opt = make(model.parameters())
        one_step(model, opt, 0)
        checkpoint.save(str(tmp_path / name), model, opt)
        one_step(model, opt, 1)
        continued[name] = models.flat_params(model)

    refused = [
        ("sgd", "AdamW", lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
        ("sgd", "FusedAdamW", lambda ps: FusedAdamW(ps, lr=1e-2)),
        ("sgd", "AdamW", lambda ps: fusedist.ZeroRedundancyOptimizer(ps, torch.optim.AdamW, lr=1e-2)),
        ("adam", "AdamW", lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
        ("adam", "FusedAdamW", lambda ps: FusedAdamW(ps, lr=1e-2)),
    ]
    for name, target, make in refused:
        model = _net(7)
        opt = make(model.parameters())
        before = models.flat_params(model)
        with pytest.raises(checkpoint.CheckpointError) as info:
            checkpoint.load(str(tmp_path / name), model, opt)
        saved_class = "SGD" if name == "sgd" else "Adam"
        assert re.search(rf"\b{saved_class}\b.*\b{target}\b", str(info.value)), (name, target, str(info.value))
        assert torch.equal(before, models.flat_params(model)), (name, target)
        assert opt.param_groups[0]["lr"] == 1e-2 and not getattr(opt, "state", {}), (name, target)

    for target in (lambda ps: FusedAdam(ps, lr=1.0), lambda ps: MyAdam(ps, lr=1.0)):
        model = _net(7)
        opt = target(model.parameters())
        checkpoint.load(str(tmp_path / "adam"), model, opt)
        one_step(model, opt, 1)
        torch.testing.assert_close(models.flat_params(model), continued["adam"], atol=1e-6, rtol=0)


def test_a_load_that_cannot_complete_changes_nothing(tmp_path):
    """A disabled GradScaler's checkpoint into an enabled scaler, AMSGrad state into offloaded
    ZeRO: the scaler and ZeRO refuse these, but only after the model (and the optimizer's
    groups) had been loaded, or at every later step. Now refused first, naming the cause,
    with nothing changed; a disabled scaler still loads anything. A checkpoint of torch's
    AdamW with a tensor learning rate loads into FusedAdamW (alone, inside ZeRO, offloaded)
    and steps as torch's AdamW does."""
    import fusedist
    from fusedist import checkpoint
    from fusedist.optim import FusedAdamW

    model = _net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2))
    x, y = _global_batch(0)
    (model(x) - y).pow(2).mean().backward()
    opt.step()
    checkpoint.save(str(tmp_path / "tensor_lr"), model, opt)
    amsgrad = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True)
    amsgrad.step()
    checkpoint.save(str(tmp_path / "amsgrad"), model, amsgrad)
    checkpoint.save(str(tmp_path / "no_scaler"), model, torch.optim.AdamW(model.parameters()),
                    fusedist.amp.GradScaler("cpu", enabled=False))

    cases = [
        ("no_scaler", lambda ps: torch.optim.AdamW(ps), lambda: fusedist.amp.GradScaler("cpu", init_scale=8.0),
         "disabled GradScaler"),
        ("amsgrad", lambda ps: fusedist.ZeroRedundancyOptimizer(ps, FusedAdamW, lr=1e-3, offload="cpu"),
         lambda: None, "amsgrad=True is not supported by the host Adam"),
    ]
    for name, make_opt, make_scaler, message in cases:
        fresh = _net(7)
        fresh_opt, scaler = make_opt(fresh.parameters()), make_scaler()
        before = models.flat_params(fresh)
        with pytest.raises(checkpoint.CheckpointError, match=message):
            checkpoint.load(str(tmp_path / name), fresh, fresh_opt, scaler)
        assert torch.equal(before, models.flat_params(fresh)), name
        group = fresh_opt.param_groups[0]
        assert not fresh_opt.state and not torch.is_tensor(group["lr"]) and not group.get("amsgrad"), name
        assert scaler is None or scaler.get_scale() == 8.0, name
    fresh = _net(7)
    checkpoint.load(str(tmp_path / "no_scaler"), fresh, None, fusedist.amp.GradScaler("cpu", enabled=False))
    assert torch.equal(models.flat_params(fresh), models.flat_params(model))

    # A tensor learning rate loads where torch's AdamW takes one, and the next step is torch's
    # (fp32; FusedAdamW forms lr / bias_correction in fp64, torch in fp32: a few ulps apart).
    x, y = _global_batch(1)
    reference = _net(7)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=torch.tensor(1e-3))
    checkpoint.load(str(tmp_path / "tensor_lr"), reference, torch_opt)
    (reference(x) - y).pow(2).mean().backward()
    torch_opt.step()
    for make in (lambda ps: FusedAdamW(ps, lr=1e-3),
                 lambda ps: fusedist.ZeroRedundancyOptimizer(ps, FusedAdamW, lr=1e-3),
                 lambda ps: fusedist.ZeroRedundancyOptimizer(ps, FusedAdamW, lr=1e-3, offload="cpu")):
        fresh = _net(7)
        fresh_opt = make(fresh.parameters())
        checkpoint.load(str(tmp_path / "tensor_lr"), fresh, fresh_opt)
        assert float(fresh_opt.param_groups[0]["lr"]) == float(torch_opt.param_groups[0]["lr"])
        (fresh(x) - y).pow(2).mean().backward()
        fresh_opt.step()
        if hasattr(fresh_opt, "wait_for_params"):
            fresh_opt.wait_for_params()
        torch.testing.assert_close(models.flat_params(fresh), models.flat_params(reference), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- ranks that disagree


def _build_zero(seed):
    import fusedist

    model = fusedist.DistributedDataParallel(_net(seed))
    return model, fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-2)


def _error(fn):
    """(exception type, text, seconds) of what ``fn()`` raises, or None."""
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported back to the test
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None


def _disagreeing_ranks_worker(rank, world_size, root):
    import fusedist
    from fusedist import checkpoint

    model, opt = _build_zero(0)
    _train_resume(model, opt, None, 0, 1, rank, world_size)
    out = {}
    # Each rank its own directory (a timestamp or a rank-local path in the name).
    out["save dirs"] = _error(lambda: checkpoint.save(os.path.join(root, f"own-{rank}"), model, opt))
    dist.barrier()
    out["save dirs manifest"] = os.path.exists(os.path.join(root, "own-0", "manifest.json"))
    # The same with the periodic Checkpointer (synchronous here, to read its error at once).
    ckpt = checkpoint.Checkpointer(os.path.join(root, f"periodic-{rank}"), async_save=False)
    ckpt.restore(model, opt)
    out["checkpointer dirs"] = _error(lambda: ckpt.save(1))
    dist.barrier()
    out["checkpointer complete"] = os.path.exists(os.path.join(root, "periodic-0", "step-00000001", "manifest.json"))
    # Rank 0 cannot list the checkpoints (an unreadable directory): every rank learns of it at once.
    from fusedist.checkpoint import layout

    def unreadable(directory):
        raise PermissionError(13, "Permission denied", directory)

    real_scan, layout.scan = layout.scan, (unreadable if rank == 0 else layout.scan)
    try:
        out["restore unreadable"] = _error(lambda: checkpoint.Checkpointer(os.path.join(root, "periodic"))
                                           .restore(model, opt))
    finally:
        layout.scan = real_scan
    # Different things passed to one save: a GradScaler on rank 0 only, per-rank state on rank 1 only.
    scaler = fusedist.amp.GradScaler("cpu")
    out["save scaler"] = _error(lambda: checkpoint.save(os.path.join(root, "scaler"), model, opt,
                                                        scaler if rank == 0 else None))
    out["save per_rank"] = _error(lambda: checkpoint.save(os.path.join(root, "per_rank"), model, opt,
                                                          per_rank={"r": rank} if rank == 1 else None))
    # An argument error on one rank: every rank learns of it at once, not at the timeout.
    out["save extra"] = _error(lambda: checkpoint.save(os.path.join(root, "extra"), model, opt,
                                                       extra={"step": 1} if rank == 0 else ["step", 1]))
    dist.barrier()
    out["manifests"] = sorted(d for d in ("scaler", "per_rank", "extra")
                              if os.path.exists(os.path.join(root, d, "manifest.json")))
    # Two complete checkpoints; each rank loads another one.
    checkpoint.save(os.path.join(root, "a"), model, opt, extra={"step": 1})
    _train_resume(model, opt, None, 1, 2, rank, world_size)
    checkpoint.save(os.path.join(root, "b"), model, opt, extra={"step": 2})
    fresh, fresh_opt = _build_zero(99)
    before = models.flat_params(fresh)
    out["load"] = _error(lambda: checkpoint.load(os.path.join(root, "a" if rank == 0 else "b"), fresh, fresh_opt))
    out["load untouched"] = torch.equal(before, models.flat_params(fresh))
    # The same checkpoint on every rank still loads.
    out["load same"] = checkpoint.load(os.path.join(root, "b"), fresh, fresh_opt)
    return out


def test_ranks_that_disagree_are_refused_on_every_rank(launched):
    results = results_of(launched, "disagreeing ranks")
    root = launched["roots"]["disagreeing ranks"]
    for rank, out in enumerate(results):
        kind, text, _ = out["save dirs"] or (None, "", 0)
        assert kind == "CheckpointError", (rank, out["save dirs"])
        assert os.path.join(root, "own-1") in text and os.path.join(root, "own-0") in text, text
        assert out["save dirs manifest"] is False
        kind, text, _ = out["checkpointer dirs"] or (None, "", 0)
        assert kind == "CheckpointError" and os.path.join(root, "periodic-1") in text, (rank, out["checkpointer dirs"])
        assert out["checkpointer complete"] is False
        kind, text, seconds = out["restore unreadable"] or (None, "", 0)
        assert kind == "CheckpointError" and "Permission denied" in text and seconds < 10, \
            (rank, out["restore unreadable"])
        for case, what in (("save scaler", "scaler"), ("save per_rank", "per_rank")):
            kind, text, _ = out[case] or (None, "", 0)
            assert kind == "CheckpointError" and what in text and "ranks [0]" in text and "ranks [1]" in text, \
                (rank, case, text)
        kind, text, seconds = out["save extra"] or (None, "", 0)
        assert kind == "TypeError" and "rank 1" in text and "extra must be a dict" in text, (rank, out["save extra"])
        assert seconds < 10, (rank, seconds)
        assert out["manifests"] == [], (rank, out["manifests"])
        kind, text, _ = out["load"] or (None, "", 0)
        assert kind == "CheckpointError" and "different checkpoint" in text, (rank, out["load"])
        assert os.path.join(root, "a") in text and os.path.join(root, "b") in text, text
        assert out["load untouched"], rank
        assert out["load same"] == {"step": 2}


# ----------------------------------------------------------------------------- paths and names


class _Holder(nn.Module):
    """A model whose only child is called ``module``, as DDP's is."""

    def __init__(self):
        super().__init__()
        self.module = nn.Linear(4, 3)

    def forward(self, x):
        return self.module(x)


def test_a_model_whose_only_child_is_called_module_loads_its_own_checkpoint(tmp_path):
    """Its keys all start with ``module.``, which load took for DDP's prefix and stripped,
    so the checkpoint was refused as not matching the model that wrote it."""
    from fusedist import checkpoint

    torch.manual_seed(0)
    model = _Holder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    checkpoint.save(str(tmp_path), model, opt)
    torch.manual_seed(1)
    fresh = _Holder()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    checkpoint.load(str(tmp_path), fresh, fresh_opt)
    assert torch.equal(models.flat_params(fresh), models.flat_params(model))
    assert torch.equal(fresh_opt.state[fresh.module.weight]["exp_avg"], opt.state[model.module.weight]["exp_avg"])



def test_unusual_directory_names_and_repeated_saves(tmp_path):
    """Spaces, non-ASCII, glob and format characters, a pathlib.Path; three saves into one
    directory: the last one loads and only its files remain."""
    from fusedist import checkpoint

    for name in ("with space", "ünï–cødé", "glob[0]*?", "fmt{0}%s$HOME", "dots..pt"):
        directory = tmp_path / name / "ckpt"
        model = _net(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for v in range(3):
            x, y = _global_batch(v)
            opt.zero_grad()
            (model(x) - y).pow(2).mean().backward()
            opt.step()
            checkpoint.save(directory if v % 2 else str(directory), model, opt, extra={"v": v})
        fresh = _net(5)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        assert checkpoint.load(directory, fresh, fresh_opt) == {"v": 2}, name
        assert torch.equal(models.flat_params(fresh), models.flat_params(model)), name
        assert len(os.listdir(directory)) == 2, (name, os.listdir(directory))  # common + manifest


def test_a_cleanup_failure_after_a_complete_save_only_warns(tmp_path, monkeypatch):
    """Removing the replaced checkpoint's files runs on rank 0 after the last exchange: an
    error there made rank 0 alone report a failed save (the others returned, and the
    checkpoint was complete). Now a warning; the new checkpoint loads."""
    from fusedist import checkpoint
    from fusedist.checkpoint import _files

    model = _net(0)
    checkpoint.save(str(tmp_path), model, extra={"v": 1})

    def unreadable(directory):
        raise PermissionError(13, "Permission denied", directory)

    monkeypatch.setattr(_files, "remove_unlisted", unreadable)
    with pytest.warns(UserWarning, match="could not remove"):
        checkpoint.save(str(tmp_path), model, extra={"v": 2})
    assert checkpoint.load(str(tmp_path), _net(1)) == {"v": 2}
