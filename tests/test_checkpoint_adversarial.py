"""fusedist.checkpoint under the misuse and failures that tests/test_checkpoint.py and
tests/test_resume.py do not cover: resharding with FusedAdamW and across optimizer kinds
(with GradScaler and LR-scheduler state), and of parameters whose lengths 2 and 3 do not divide
(fp32 masters over bf16 parameters, ZeRO-2 with CPU offload, fully_shard with bf16 compute), a
write failing on rank 0, mismatched models, and directories that are not checkpoints.
"""

from __future__ import annotations

import json
import re
import os
import time

import pytest
import torch
from torch import nn

from shared_rank_launch import launch_for_selected, results_of

# ----------------------------------------------------------------------------- resharding

GLOBAL_ROWS = 6  # split evenly over 2 or 3 ranks; DDP's average is the global-batch mean


def _global_batch(step):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_ROWS, 8, generator=gen), torch.randn(GLOBAL_ROWS, 3, generator=gen)


def _build(kind, seed):
    import fusedist

    torch.manual_seed(seed)
    model = fusedist.DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)))
    if kind.startswith("ddp"):
        cls = fusedist.optim.FusedAdamW if kind.endswith("fused") else torch.optim.AdamW
        return model, cls(model.parameters(), lr=1e-2)
    stage = int(kind[len("zero")])
    cls = fusedist.optim.FusedAdamW if kind.endswith("fused") else torch.optim.AdamW
    return model, fusedist.ZeroRedundancyOptimizer(model.parameters(), cls, stage=stage, lr=1e-2)


def _train(rank, world_size, root, saved_kind, kind, phase, steps):
    """6 steps with a save after step 3 ("before"), or a load of that save then 3 steps
    ("after", a different initialization that the load must overwrite). GradScaler and a
    StepLR scheduler run along; the scheduler's state travels in ``extra``."""
    import fusedist
    from fusedist import checkpoint

    model, opt = _build(kind, 0 if phase == "before" else 99)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = fusedist.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    directory = os.path.join(root, saved_kind)
    first = 0
    if phase == "after":
        extra = checkpoint.load(directory, model, opt, scaler)  # safe loader: no trusted=True
        first = extra["step"]
        sched.load_state_dict(extra["sched"])
    rows = GLOBAL_ROWS // world_size
    for step in range(first, first + steps):
        x, y = _global_batch(step)
        opt.zero_grad()
        loss = (model(x[rank * rows:(rank + 1) * rows]) - y[rank * rows:(rank + 1) * rows]).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        if phase == "before" and step == 2:
            checkpoint.save(directory, model, opt, scaler, extra={"step": step + 1, "sched": sched.state_dict()})
    if hasattr(opt, "wait_for_params"):
        opt.wait_for_params()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return params, scaler.get_scale(), [g["lr"] for g in opt.param_groups], sched.state_dict()["last_epoch"]


def _train_all(rank, world_size, root, pairs, phase, steps):
    return [_train(rank, world_size, root, saved, kind if phase == "after" else saved, phase, steps)
            for saved, kind in pairs]


# (saved with, loaded into): FusedAdamW alone, ZeRO-1/2 with FusedAdamW, and across kinds
PAIRS_2_TO_3 = [("ddp_fused", "ddp_fused"), ("zero2_fused", "zero2_fused"), ("zero2_torch", "zero1_fused")]
PAIRS_3_TO_2 = [("zero1_fused", "zero1_fused"), ("zero2_fused", "ddp_torch"), ("ddp_fused", "zero2_fused")]


PAIRS = {(2, 3): PAIRS_2_TO_3, (3, 2): PAIRS_3_TO_2}


@pytest.fixture(scope="module", params=[(2, 3), (3, 2)], ids=["2to3", "3to2"])
def across(request, tmp_path_factory):
    """The selected cross-world scenarios of this file, saved at ``sizes[0]`` ranks in one launch
    and loaded at ``sizes[1]`` in another: ``(sizes, saved, loaded)``."""
    sizes = request.param
    root = str(tmp_path_factory.mktemp(f"across_{sizes[0]}_to_{sizes[1]}"))

    def scenarios(phase: str) -> dict:
        return {"test_continues_at_another_world_size_like_an_uninterrupted_run":
                {"pairs": (_train_all, (root, PAIRS[sizes], phase, 6 if phase == "before" else 3))},
                "test_odd_sized_parameters_continue_at_another_world_size":
                {"odd sizes": (_odd_sizes, (root, sizes, phase))}}

    saved = launch_for_selected(request, scenarios("before"), sizes[0], timeout=300)
    loaded = launch_for_selected(request, scenarios("after"), sizes[1], timeout=300)
    return sizes, saved, loaded


def test_continues_at_another_world_size_like_an_uninterrupted_run(across):
    sizes, saved, loaded = across
    reference, resumed = results_of(saved, "pairs"), results_of(loaded, "pairs")
    for i, pair in enumerate(PAIRS[sizes]):
        ref, got = reference[0][i], resumed[0][i]
        assert all(torch.equal(r[i][0], got[0]) for r in resumed), f"{pair}: ranks differ"
        # Same global-batch math, another per-rank split: fp32 summation order only (see
        # test_resume.test_zero_checkpoint_continues_at_another_world_size); a lost moment or
        # step count is of order lr = 1e-2.
        torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=0, msg=lambda m: f"{pair}: {m}")
        assert got[1:] == ref[1:], f"{pair}: scaler scale / lr / scheduler epoch {got[1:]} != {ref[1:]}"


# ------------------------------------------------------------- parameters of odd sizes, bf16 and offload

ODD_SAVE_AT, ODD_LAST = 3, 5  # saved after 3 steps, 2 more after the load
ODD_KINDS = ("ddp bf16 master", "zero2", "zero2 offload", "fully_shard bf16")
# how each kind is saved and loaded: checkpoint.save/load, or a Checkpointer's save/restore; each
# kind takes the other way in the other direction
ODD_WAYS = {(2, 3): ("load", "restore", "load", "restore"), (3, 2): ("restore", "load", "restore", "load")}


class _OddSizes(nn.Module):
    """Parameters no world size of 2 or 3 divides: an 11x3 embedding, Linear(6, 7), Linear(7, 5)
    (a bias of 5) and a head of one row (pieces of one rank only under fully_shard)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 3)
        self.fc1 = nn.Linear(6, 7)
        self.fc2 = nn.Linear(7, 5)
        self.head = nn.Linear(5, 1)

    def forward(self, tokens):
        z = self.fc2(torch.tanh(self.fc1(self.emb(tokens).flatten(1))))
        return torch.cat([z, self.head(z)], 1)


def _odd_batch(step):
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, 11, (GLOBAL_ROWS, 2), generator=gen), torch.randn(GLOBAL_ROWS, 6, generator=gen)


def _odd_loss(model, step, rank=0, world_size=1):
    tokens, y = _odd_batch(step)
    rows = slice(rank * GLOBAL_ROWS // world_size, (rank + 1) * GLOBAL_ROWS // world_size)
    return (model(tokens[rows]).float() - y[rows]).pow(2).mean()


def _odd_build(kind, seed):
    """fusedist DDP + FusedAdamW with fp32 masters over bf16 parameters; DDP + ZeRO-2 (with and
    without CPU offload); or fully_shard with bf16 compute (fp32 sharded parameters) + torch AdamW."""
    import fusedist

    torch.manual_seed(seed)
    net = _OddSizes()
    if kind == "ddp bf16 master":
        model = fusedist.DistributedDataParallel(net.to(torch.bfloat16))
        return model, fusedist.optim.FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, master_weights=True)
    if kind.startswith("zero2"):
        model = fusedist.DistributedDataParallel(net)
        return model, fusedist.ZeroRedundancyOptimizer(model.parameters(), fusedist.optim.FusedAdamW, stage=2, lr=1e-2,
                                                       weight_decay=0.1, offload="cpu" if "offload" in kind else None)
    policy = fusedist.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for unit in (net.emb, net.fc1, net.fc2, net.head):
        fusedist.fully_shard(unit, mp_policy=policy)
    return fusedist.fully_shard(net, mp_policy=policy), torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)


def _odd_whole(model, opt) -> dict:
    """The whole parameters (fp32) and optimizer state, by name (the state on rank 0 only)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    import fusedist

    if isinstance(opt, fusedist.ZeroRedundancyOptimizer):
        opt.wait_for_params()
        opt.consolidate_state_dict(0)
    if isinstance(model, fusedist.DistributedDataParallel):
        names = [n for n, _ in model.module.named_parameters()]
        params = {n: p.detach().float().clone() for n, p in model.module.named_parameters()}
        state = opt.state_dict()["state"] if dist.get_rank() == 0 else {}
        state = {names[i]: s for i, s in state.items()}
    else:
        params = {k: v.float().clone() for k, v in fusedist.fsdp.full_state_dict(model).items()}
        state = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))["state"]
    out = {f"param {n}": v for n, v in params.items()}
    if dist.get_rank() == 0:
        out.update({f"{n}/{k}": torch.as_tensor(v).clone() for n, s in state.items() for k, v in s.items()})
    return out


def _odd_sizes(rank, world_size, root, sizes, phase):
    """Each kind: ``before``: ODD_LAST steps, saved after ODD_SAVE_AT; ``after``: another
    initialization, loaded, the steps after ODD_SAVE_AT. ``{kind: (everything at the save or
    right after the load, everything at the end)}``."""
    from fusedist import checkpoint

    out = {}
    for kind, way in zip(ODD_KINDS, ODD_WAYS[sizes]):
        directory = os.path.join(root, f"odd {kind}")
        model, opt = _odd_build(kind, 0 if phase == "before" else 99)
        periodic = checkpoint.Checkpointer(directory, keep=1, async_save=False) if way == "restore" else None
        first = 0
        if periodic is not None:
            first = periodic.restore(model, opt)
        elif phase == "after":
            first = checkpoint.load(directory, model, opt)["step"]
        assert first == (ODD_SAVE_AT if phase == "after" else 0), (kind, way, first)
        at_save = _odd_whole(model, opt) if phase == "after" else None
        for step in range(first, ODD_LAST):
            opt.zero_grad()
            _odd_loss(model, step, rank, world_size).backward()
            opt.step()
            if phase == "before" and step + 1 == ODD_SAVE_AT:
                at_save = _odd_whole(model, opt)
                if periodic is not None:
                    periodic.save(ODD_SAVE_AT)
                else:
                    checkpoint.save(directory, model, opt, extra={"step": ODD_SAVE_AT})
        if periodic is not None:
            periodic.close()
        out[kind] = (at_save, _odd_whole(model, opt))
    return out


def _unsharded_adamw(kind: str) -> dict:
    """The reference of ``kind``: the whole model on the global batch, torch AdamW over fp32
    parameters; with bf16 compute, the forward and backward of a bf16 copy of them (what fp32
    masters and bf16 compute do), from the bf16 parameters' values where the model was bf16."""
    bf16 = "bf16" in kind
    torch.manual_seed(0)
    master = _OddSizes()
    if kind == "ddp bf16 master":
        master = master.to(torch.bfloat16).float()
    compute = _OddSizes().to(torch.bfloat16) if bf16 else master
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(ODD_LAST):
        with torch.no_grad():
            for c, m in zip(compute.parameters(), master.parameters()):
                c.copy_(m)
                c.grad = None
        _odd_loss(compute, step).backward()
        for c, m in zip(compute.parameters(), master.parameters()):
            m.grad = c.grad.float()
        opt.step()
    return {f"param {n}": p.detach().clone() for n, p in master.named_parameters()}


# Tolerances of the continuation (the state right after the load is compared bit for bit). fp32
# kinds: summation order only (a lost moment or step count is of order lr = 1e-2). bf16 compute:
# each split rounds the bf16 gradients (and DDP's bf16 average) otherwise, a few 1e-4 on the fp32
# weights after 5 AdamW steps; ``ddp bf16 master``'s bf16 parameters are those weights rounded to
# bf16 (one ulp, up to 2**-9 for these weights), compared through its fp32 masters.
ODD_TOLERANCE = {"ddp bf16 master": 1e-3, "zero2": 1e-5, "zero2 offload": 1e-5, "fully_shard bf16": 1e-3}


def _fp32_weights(everything: dict) -> dict:
    """The fp32 weights by ``param <name>``: the optimizer's masters where it keeps them (rank 0)."""
    masters = {f"param {k[:-len('/master_param')]}": v for k, v in everything.items() if k.endswith("/master_param")}
    return masters or {k: v for k, v in everything.items() if k.startswith("param ")}


def test_odd_sized_parameters_continue_at_another_world_size(across):
    """Parameters of lengths 2 and 3 do not divide, saved at one world size and loaded at the
    other by ``checkpoint.load`` and by ``Checkpointer.restore``: FusedAdamW's fp32 masters over
    bf16 parameters under fusedist DDP, ZeRO-2 with and without CPU offload, fully_shard with
    bf16 compute. Right after the load every parameter and the whole optimizer state equal the
    saved ones bit for bit; 2 more steps continue as the run that was not interrupted and as
    the whole model with torch AdamW on the global batch."""
    sizes, saved, loaded = across
    before, after = results_of(saved, "odd sizes"), results_of(loaded, "odd sizes")
    for kind, way in zip(ODD_KINDS, ODD_WAYS[sizes]):
        where = f"{kind} ({way}, {sizes[0]} -> {sizes[1]} ranks)"
        at_save, at_load = before[0][kind][0], after[0][kind][0]
        assert sorted(at_load) == sorted(at_save), where
        differ = [k for k in at_save if at_save[k].dtype != at_load[k].dtype or not torch.equal(at_save[k], at_load[k])]
        assert not differ, f"{where}: differ right after the load: {differ}"
        final = _fp32_weights(after[0][kind][1])
        for rank, out in enumerate(after):
            params = {k: v for k, v in out[kind][1].items() if k.startswith("param ")}
            assert all(torch.equal(v, after[0][kind][1][k]) for k, v in params.items()), f"{where}: rank {rank} differs"
        uninterrupted, reference = _fp32_weights(before[0][kind][1]), _unsharded_adamw(kind)
        assert final.keys() == uninterrupted.keys() == reference.keys(), where
        for name in reference:
            for against, expected in (("the run not interrupted", uninterrupted), ("torch AdamW", reference)):
                torch.testing.assert_close(final[name], expected[name], atol=ODD_TOLERANCE[kind], rtol=0,
                                           msg=lambda m: f"{where}, {name} against {against}: {m}")


# ----------------------------------------------------------------------------- failed saves


def _disk_full_at(where: str, rank: int, real):
    """A stand-in for ``_files.atomic_write`` whose write fails half-way (disk full) for one
    file of a save: rank 1's shard, rank 0's common file, or rank 0's manifest."""
    def failing(path, write):
        name = os.path.basename(path)
        if ((where == "rank_file" and rank == 1 and name.startswith("rank-"))
                or (where == "common" and name.startswith("common"))
                or (where == "manifest" and name == "manifest.json")):
            def partial(f):
                f.write(b"partial")
                raise OSError(28, "No space left on device")
            return real(path, partial)
        return real(path, write)

    return failing


def _save_with_disk_full_at(where: str, rank: int, directory: str, model, opt) -> str:
    """``checkpoint.save`` with the write of ``where`` failing (:func:`_disk_full_at`): the
    error's text, or "saved"."""
    from fusedist import checkpoint
    from fusedist.checkpoint import _files

    real = _files.atomic_write
    _files.atomic_write = _disk_full_at(where, rank, real)
    try:
        checkpoint.save(directory, model, opt, extra={"v": 2})
        return "saved"
    except checkpoint.CheckpointError as exc:
        return str(exc)
    finally:
        _files.atomic_write = real


def _failing_save(rank, world_size, root):
    """A write that fails (disk full) on one rank, at each point of a save: rank 1's shard,
    rank 0's common.pt, rank 0's manifest. Every rank must raise CheckpointError at once (not
    wait for the collective timeout), the group must stay usable, and a checkpoint in another
    directory must stay loadable."""
    from fusedist import checkpoint

    model, opt = _build("zero2_torch", 0)
    good, other = os.path.join(root, "good"), os.path.join(root, "other")
    checkpoint.save(good, model, opt, extra={"v": 1})
    out = {}
    for where in ("rank_file", "common", "manifest"):
        start = time.monotonic()
        out[where] = _save_with_disk_full_at(where, rank, other, model, opt)
        out[where + " seconds"] = time.monotonic() - start
        out[where + " manifest"] = os.path.exists(os.path.join(other, "manifest.json"))
        out[where + " left"] = os.path.exists(other)
    assert checkpoint.load(good, model, opt) == {"v": 1}
    checkpoint.save(other, model, opt, extra={"v": 3})  # the group still works
    assert checkpoint.load(other, model, opt) == {"v": 3}
    return out


@pytest.fixture(scope="module")
def failed_writes(request, tmp_path_factory):
    """The two tests of failing writes at 2 ranks in one launch."""
    return launch_for_selected(request, {
        "test_a_failed_write_fails_every_rank_promptly_and_keeps_the_group": {
            "failing save": (_failing_save, (str(tmp_path_factory.mktemp("failing-save")),))},
        "test_a_failed_save_over_a_checkpoint_keeps_it": {
            "failing save over a checkpoint": (_failing_save_over_a_checkpoint,
                                               (str(tmp_path_factory.mktemp("failing-save-over")),))},
    }, 2, timeout=120, pg_timeout=20)


def test_a_failed_write_fails_every_rank_promptly_and_keeps_the_group(failed_writes):
    results = results_of(failed_writes, "failing save")
    for rank, out in enumerate(results):
        for where, who in (("rank_file", 1), ("common", 0), ("manifest", 0)):
            assert f"rank {who}" in out[where] and "No space left on device" in out[where], (rank, where, out[where])
            assert "no manifest was written" in out[where], out[where]
            assert out[where + " seconds"] < 10, (rank, where, out[where + " seconds"])
            assert out[where + " manifest"] is False and out[where + " left"] is False, (rank, where)


def _failing_save_over_a_checkpoint(rank, world_size, root):
    """Saving into a directory that holds a complete checkpoint, with a write failing at each
    point of the save: the checkpoint there must stay loadable, with no file of the failed
    save left behind; then successful saves replace it, and the replaced files go
    (Note [checkpoint atomicity] in fusedist/checkpoint/_files.py)."""
    from fusedist import checkpoint
    from fusedist.checkpoint import _files

    model, opt = _build("zero2_torch", 0)
    directory = os.path.join(root, "ckpt")
    checkpoint.save(directory, model, opt, extra={"v": 1})
    out = {"first": sorted(os.listdir(directory)),
           "first version": _files.read_manifest(directory)["version"]}
    for where in ("rank_file", "common", "manifest"):
        out[where] = _save_with_disk_full_at(where, rank, directory, model, opt)
        torch.distributed.barrier()
        out[where + " files"] = sorted(os.listdir(directory))
        out[where + " loads"] = checkpoint.load(directory, model, opt)
    for v in (3, 4):
        checkpoint.save(directory, model, opt, extra={"v": v})
        torch.distributed.barrier()
        out[f"saved {v}"] = (sorted(os.listdir(directory)), checkpoint.load(directory, model, opt),
                             _files.read_manifest(directory)["version"])
    return out


def test_a_failed_save_over_a_checkpoint_keeps_it(failed_writes):
    results = results_of(failed_writes, "failing save over a checkpoint")
    for rank, out in enumerate(results):
        first = out["first"]
        assert first == ["common.pt", "manifest.json", "rank-00000.pt", "rank-00001.pt"], first
        assert out["first version"] == 1  # no file with a name of its own: older readers read it
        for where, who in (("rank_file", 1), ("common", 0), ("manifest", 0)):
            assert f"rank {who}" in out[where] and "No space left on device" in out[where], (rank, where, out[where])
            assert "the checkpoint the directory held before is kept" in out[where], out[where]
            assert out[where + " files"] == first, (rank, where, out[where + " files"])
            assert out[where + " loads"] == {"v": 1}, (rank, where)
        names3, extra3, version3 = out["saved 3"]
        names4, extra4, version4 = out["saved 4"]
        assert extra3 == {"v": 3} and extra4 == {"v": 4} and version3 == version4 == 2
        for names in (names3, names4):  # the replaced checkpoint's files are gone
            assert len(names) == 4 and "manifest.json" in names and not set(names) & (set(first) - {"manifest.json"})
        assert not set(names3) & set(names4) - {"manifest.json"}, (names3, names4)


# ----------------------------------------------------------------------------- mismatches


def test_model_mismatch_names_parameters_and_shapes(tmp_path):
    """One process: renamed, missing, extra and reshaped parameters are refused with the
    names and shapes on both sides, and the model is left untouched."""
    from fusedist import checkpoint

    class Renamed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 3)

    saved = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    checkpoint.save(str(tmp_path), saved, torch.optim.AdamW(saved.parameters()))
    cases = {
        "renamed": (Renamed(), [r"missing .*a\.weight \(16, 8\)", r"unexpected .*0\.weight \(16, 8\)"]),
        "missing": (nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3, bias=False)),
                    [r"unexpected .*2\.bias \(3,\)"]),
        "extra": (nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3), nn.Linear(3, 2)),
                  [r"missing .*3\.weight \(2, 3\)", r"3\.bias \(2,\)"]),
        "shape": (nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)),
                  [r"'2\.weight' has shape \(3, 16\) in .*the model's is \(4, 16\)"]),
    }
    for name, (model, patterns) in cases.items():
        before = [p.detach().clone() for p in model.parameters()]
        for opt in (None, torch.optim.AdamW(model.parameters())):
            with pytest.raises(checkpoint.CheckpointError) as info:
                checkpoint.load(str(tmp_path), model, opt)
            for pattern in patterns:
                assert re.search(pattern, str(info.value)), (name, pattern, str(info.value))
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), name


def _size_mismatches(text: str, pattern: str) -> list:
    """(key, saved shape, model shape) of each size mismatch a refusal names, in its order."""
    return [(k, tuple(int(d) for d in a.split(",") if d.strip()), tuple(int(d) for d in b.split(",") if d.strip()))
            for k, a, b in re.findall(pattern, text)]


TORCH_SIZE_MISMATCH = (r"size mismatch for (\S+): copying a param with shape torch\.Size\(\[([\d, ]*)\]\) from "
                       r"checkpoint, the shape in current model is torch\.Size\(\[([\d, ]*)\]\)")
FUSEDIST_SIZE_MISMATCH = r"'(\S+)' has shape \(([\d, ]*)\) in the checkpoint, the model's is \(([\d, ]*)\)"


@pytest.mark.parametrize("layers", [2, 13])
def test_every_shape_mismatch_is_named_as_torch_names_them(tmp_path, layers):
    """A model with several keys of another shape: every one is named with both shapes, in
    torch's order (torch's load_state_dict lists every size mismatch), at most 20 of them and
    how many more; the model is left untouched."""
    from fusedist import checkpoint
    from fusedist.checkpoint._load_plan import SHOWN_SHAPE_MISMATCHES

    saved = nn.Sequential(*[nn.Linear(2, 2) for _ in range(layers)])
    checkpoint.save(str(tmp_path), saved)
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(layers)])
    with pytest.raises(RuntimeError) as torch_refusal:
        model.load_state_dict(saved.state_dict())
    expected = _size_mismatches(str(torch_refusal.value), TORCH_SIZE_MISMATCH)
    assert len(expected) == 2 * layers, str(torch_refusal.value)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.load(str(tmp_path), model)
    message = str(info.value)
    assert _size_mismatches(message, FUSEDIST_SIZE_MISMATCH) == expected[:SHOWN_SHAPE_MISMATCHES], message
    assert f"{2 * layers} keys have another shape in {tmp_path} than in the model: '0.weight'" in message, message
    more = 2 * layers - SHOWN_SHAPE_MISMATCHES
    assert message.endswith(f"; and {more} more" if more > 0 else "the model's is (3,)"), message
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_optimizer_mismatch_says_only_what_differs(tmp_path):
    """The optimizer's refusal names what it found: other counts without speaking of shapes,
    and other shapes (a checkpoint whose optimizer records them differently) by parameter."""
    from fusedist import checkpoint
    from fusedist.checkpoint import _files

    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    checkpoint.save(str(tmp_path), model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(checkpoint.CheckpointError) as fewer:
        checkpoint.load(str(tmp_path), model, torch.optim.AdamW(model[0].parameters()))
    assert "do not match" in str(fewer.value) and ": 4 parameters saved, 2 here; the checkpoint's optimizer also " \
        "holds ['1.weight', '1.bias']" in str(fewer.value), str(fewer.value)
    assert "shape" not in str(fewer.value), str(fewer.value)

    manifest = _files.read_manifest(str(tmp_path))
    manifest["optimizer"]["param_shapes"][0] = [3, 5]
    manifest["optimizer"]["param_shapes"][3] = [7]
    _files.write_manifest(str(tmp_path), manifest)
    with pytest.raises(checkpoint.CheckpointError) as reshaped:
        checkpoint.load(str(tmp_path), model, torch.optim.AdamW(model.parameters()))
    assert str(reshaped.value).endswith(
        f"do not match {tmp_path}: parameter 0 '0.weight' has shape (3, 5) in the checkpoint, (3, 4) here; "
        "parameter 3 '1.bias' has shape (7,) in the checkpoint, (2,) here"), str(reshaped.value)
    assert "parameters saved" not in str(reshaped.value), str(reshaped.value)


OPTIMIZER_RESHAPED = r"parameter (\d+) '(\S+)' has shape \(([\d, ]*)\) in the checkpoint, \(([\d, ]*)\) here"


def test_the_pipelined_load_names_every_optimizer_shape_mismatch_as_the_plain_load(tmp_path):
    """Optimizer state recorded with other shapes than the parameters': the pipelined load (by
    parameter name) named the first one only; it names every one as the ordinary load does (the
    first 20 by position and name with both shapes, then how many more), nothing loaded."""
    from fusedist import checkpoint
    from fusedist.checkpoint import _files
    from fusedist.checkpoint._load_plan import SHOWN_SHAPE_MISMATCHES

    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(13)])
    checkpoint.save(str(tmp_path), model, torch.optim.AdamW(model.parameters()))
    manifest = _files.read_manifest(str(tmp_path))
    manifest["optimizer"]["param_shapes"] = [[4] + shape for shape in manifest["optimizer"]["param_shapes"]]
    _files.write_manifest(str(tmp_path), manifest)
    names = [n for n, _ in model.named_parameters()]
    expected = [(str(i), n, "4, " + ("3, 3" if n.endswith("weight") else "3"), "3, 3" if n.endswith("weight") else
                 "3,") for i, n in enumerate(names)]
    messages = []
    for pipeline in (False, True):
        opt = torch.optim.AdamW(model.parameters())
        with pytest.raises(checkpoint.CheckpointError) as refused:
            checkpoint.load(str(tmp_path), model, opt, pipeline=pipeline)
        message = str(refused.value)
        assert f"the optimizer's parameters do not match {tmp_path}: " in message, message
        assert re.findall(OPTIMIZER_RESHAPED, message) == expected[:SHOWN_SHAPE_MISMATCHES], message
        assert message.endswith(f"; and {len(names) - SHOWN_SHAPE_MISMATCHES} more"), message
        assert opt.state_dict()["state"] == {}, pipeline
        messages.append(message)
    assert messages[0] == messages[1], messages


def test_every_optimizer_position_of_another_name_is_named_with_both_names(tmp_path):
    """An optimizer whose parameters are the checkpoint's in other groups (weights and biases
    split for weight decay): torch's Optimizer.load_state_dict refuses another group count;
    fusedist named the first position of another name only. Every such position is named
    with both names (the first 20, then how many more), and the optimizer is left as it was."""
    from fusedist import checkpoint
    from fusedist.checkpoint._load_plan import SHOWN_SHAPE_MISMATCHES

    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(12)])
    checkpoint.save(str(tmp_path), model, torch.optim.AdamW(model.parameters()))
    saved = [n for n, _ in model.named_parameters()]
    weights, biases = ([p for n, p in model.named_parameters() if n.endswith(end)] for end in ("weight", "bias"))
    split = torch.optim.AdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}])
    with pytest.raises(ValueError):  # torch's own refusal: another number of param groups
        split.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())
    here = [n for n in saved if n.endswith("weight")] + [n for n in saved if n.endswith("bias")]
    differing = [(str(i), a, b) for i, (a, b) in enumerate(zip(saved, here)) if a != b]
    assert len(differing) > SHOWN_SHAPE_MISMATCHES
    with pytest.raises(checkpoint.CheckpointError) as refused:
        checkpoint.load(str(tmp_path), model, split)
    message = str(refused.value)
    assert re.findall(r"parameter (\d+) is '(\S+)' in the checkpoint, '(\S+)' here", message) \
        == differing[:SHOWN_SHAPE_MISMATCHES], message
    assert message.endswith(f"; and {len(differing) - SHOWN_SHAPE_MISMATCHES} more"), message
    assert "parameters saved" not in message and split.state_dict()["state"] == {}, message


def test_not_a_checkpoint_is_named_as_such(tmp_path):
    from fusedist import checkpoint

    model = nn.Linear(3, 3)
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.bin").write_bytes(os.urandom(64))
    for name, text in (("badjson", "{not json"), ("foreign", json.dumps({"a": 1})), ("list", "[1, 2]")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(text)
    expected = {
        "empty": "holds no complete checkpoint",
        "missing": "does not exist",
        "file.bin": "is a file, not a checkpoint directory",
        "badjson": "is not valid JSON",
        "foreign": "is not a fusedist checkpoint manifest",
        "list": "is not a fusedist checkpoint manifest",
    }
    for name, message in expected.items():
        with pytest.raises(checkpoint.CheckpointError, match=message) as info:
            checkpoint.load(str(tmp_path / name), model)
        assert "AttributeError" not in str(info.value)
    # a directory that does not exist is not reported as one without a manifest
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.load(str(tmp_path / "missing"), model)
    assert "manifest.json" not in str(info.value), str(info.value)
