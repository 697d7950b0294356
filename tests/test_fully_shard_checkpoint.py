"""fusedist.checkpoint with fully_shard models: save at world size 2, load at 3 and 1 (resharded
at load), and across data-parallel kinds: a stage-3 checkpoint into DDP (torch AdamW) and ZeRO-2
runs, DDP and ZeRO-2 checkpoints into stage-3 runs.

Exactness: right after a load, every rank's pieces and its optimizer state (exp_avg,
exp_avg_sq, step) must equal, bit for bit, the matching ranges of what the saving run held
(gathered whole at save time, independently of the checkpoint code).

Continuation: every step uses one global batch of 12 samples split evenly over the ranks, and
gradients are averaged, so training is world-size independent up to summation order. Each
loaded run continues to step 8 and is compared with an uninterrupted single-process run of
torch.optim.AdamW on the whole batch: within 1e-5 (fp32, as tests/test_checkpoint.py: ~100
ulps after 8 AdamW steps; a wrong range, a lost moment or a wrong step count is off by about
lr = 1e-2). FusedAdamW on the pieces runs its own kernel (not torch's op order), inside the same bound.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import models
from fusedist.testing import run_distributed

GLOBAL_BATCH = 12
STEPS = 8
SAVE_AT = 4
TOL = 1e-5
TINY_BUCKETS = dict(bucket_cap_mb=0.0005, first_bucket_cap_mb=0.0002)


class Net(nn.Module):
    """Blocks of whole-row pieces at any world size, plus a buffer (saved whole, by rank 0)."""

    def __init__(self, d: int = 16, n: int = 3):
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(models.ResidualBlock(d, width=3) for _ in range(n))
        self.head = nn.Linear(d, 4)
        self.register_buffer("shift", torch.randn(4))

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x) + self.shift


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _batch(step, rank, ws):
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
    per = GLOBAL_BATCH // ws
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _groups(model):
    named = list(model.named_parameters())
    return [dict(params=[p for n, p in named if n.endswith("weight")], weight_decay=0.1),
            dict(params=[p for n, p in named if not n.endswith("weight")], weight_decay=0.0, lr=5e-3)]


def _adamw(model, fused=False):
    import fusedist

    cls = fusedist.optim.FusedAdamW if fused else torch.optim.AdamW
    return cls(_groups(model), lr=1e-2)


def _steps(model, opt, first, last, rank, ws):
    for step in range(first, last):
        x, y = _batch(step, rank, ws)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    if hasattr(opt, "wait_for_params"):
        opt.wait_for_params()


def _stage3(group=None, seed=0):
    import fusedist

    model = _net(seed)
    for b in model.blocks:
        fusedist.fully_shard(b, process_group=group)
    fusedist.fully_shard(model, process_group=group)
    return model


def _ddp(seed=0):
    import fusedist

    return fusedist.DistributedDataParallel(_net(seed), **TINY_BUCKETS)


def _zero2(seed=0):
    import fusedist

    model = _ddp(seed)
    return model, fusedist.ZeroRedundancyOptimizer(_groups(model.module), torch.optim.AdamW, stage=2, lr=1e-2)


def _reference():
    """Uninterrupted: torch AdamW on one process, the whole batch, 8 steps."""
    model = _net()
    opt = _adamw(model)
    _steps(model, opt, 0, STEPS, 0, 1)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _final(model) -> dict:
    """The whole weights (a collective for a stage-3 model)."""
    from fusedist.fsdp import full_state_dict
    from fusedist.fsdp.state_dict import units_of

    if units_of(model):
        return full_state_dict(model)
    module = getattr(model, "module", model)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _ranges(model, opt):
    """name -> (flat range this rank holds, its flat values, its flat optimizer state)."""
    from fusedist.fsdp.state_dict import piece_index, units_of

    where = piece_index(units_of(model))
    module = getattr(model, "module", model)
    out = {}
    for name, p in module.named_parameters():
        hit = where.get(id(p))
        lo, hi = hit[0].element_range(hit[1]) if hit else (0, p.numel())
        st = opt.state.get(p, {})
        out[name] = (lo, hi, p.detach().reshape(-1).clone(),
                     {k: v.detach().reshape(-1).clone() if v.dim() else v.detach().clone() for k, v in st.items()})
    return out


def _truth(model, opt) -> dict:
    """The whole values and optimizer state of a stage-3 run, stitched from every rank's ranges."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, _ranges(model, opt))
    out = {}
    for name in everyone[0]:
        parts = sorted((r[name] for r in everyone if r[name][1] > r[name][0]), key=lambda t: t[0])
        state = {k: (torch.cat([s[k] for *_, s in parts]) if parts[0][3][k].dim() else parts[0][3][k])
                 for k in parts[0][3]}
        out[name] = (torch.cat([v for _, _, v, _ in parts]), state)
    return out


def _exact(model, opt, truth) -> list:
    """Names whose loaded values or optimizer state differ from ``truth`` in this rank's range."""
    bad = []
    for name, (lo, hi, value, state) in _ranges(model, opt).items():
        whole, whole_state = truth[name]
        if not torch.equal(value, whole[lo:hi]) or set(state) != set(whole_state):
            bad.append(name)
            continue
        for k, v in state.items():
            expect = whole_state[k][lo:hi] if v.dim() else whole_state[k]
            if not torch.equal(v.float(), expect.float()):
                bad.append(f"{name}.{k}")
    return bad


# ---------------------------------------------------------------------------------------- world 2
def _world2(rank, ws, root):
    import fusedist
    from fusedist.checkpoint import CheckpointError

    out = {"ref": _reference()}
    s3, z2, dp = (os.path.join(root, n) for n in ("stage3", "zero2", "ddp"))
    # Stage 3, uninterrupted, saving at step 4.
    model = _stage3()
    opt = _adamw(model)
    periodic = fusedist.checkpoint.Checkpointer(os.path.join(root, "periodic"), async_save=False)
    assert periodic.restore(model, opt) == 0
    _steps(model, opt, 0, SAVE_AT, rank, ws)
    fusedist.checkpoint.save(s3, model, opt, extra={"step": SAVE_AT})
    periodic.save(SAVE_AT)
    periodic.close()
    truth = _truth(model, opt)
    if rank == 0:
        torch.save(truth, os.path.join(root, "truth.pt"))
    out["files"] = sorted(os.listdir(s3))
    _steps(model, opt, SAVE_AT, STEPS, rank, ws)
    out["stage3 uninterrupted"] = _final(model)
    # ZeRO-2 and DDP + torch AdamW runs saving at step 4.
    zm, zo = _zero2()
    _steps(zm, zo, 0, SAVE_AT, rank, ws)
    fusedist.checkpoint.save(z2, zm, zo)
    dm = _ddp()
    do = _adamw(dm.module)
    _steps(dm, do, 0, SAVE_AT, rank, ws)
    fusedist.checkpoint.save(dp, dm, do)

    # Same world size, stage 3 -> stage 3 (fresh, differently initialized): exact, continue.
    model = _stage3(seed=7)
    opt = _adamw(model)
    _steps(model, opt, 0, 1, rank, ws)  # state exists before the load: it must be replaced
    out["extra"] = fusedist.checkpoint.load(s3, model, opt)
    out["exact stage3->stage3"] = _exact(model, opt, truth)
    _steps(model, opt, SAVE_AT, STEPS, rank, ws)
    out["stage3->stage3"] = _final(model)

    # Stage 3 -> DDP with torch AdamW (the optimizer receives whole parameters' state).
    dm = _ddp(seed=7)
    do = _adamw(dm.module)
    fusedist.checkpoint.load(s3, dm, do)
    out["exact stage3->ddp"] = _exact(dm, do, truth)
    _steps(dm, do, SAVE_AT, STEPS, rank, ws)
    out["stage3->ddp"] = _final(dm)

    # Stage 3 -> ZeRO-2.
    zm, zo = _zero2(seed=7)
    fusedist.checkpoint.load(s3, zm, zo)
    _steps(zm, zo, SAVE_AT, STEPS, rank, ws)
    out["stage3->zero2"] = _final(zm)

    # ZeRO-2 and DDP -> stage 3 (FusedAdamW for the DDP one).
    for name, src, fused in (("zero2->stage3", z2, False), ("ddp->stage3 fused", dp, True)):
        model = _stage3(seed=7)
        opt = _adamw(model, fused=fused)
        fusedist.checkpoint.load(src, model, opt)
        _steps(model, opt, SAVE_AT, STEPS, rank, ws)
        out[name] = _final(model)

    # A checkpoint missing a rank's file: refused on every rank, nothing changed (after a short wait
    # for the file to show: the load waits for lagging files on a shared filesystem).
    os.environ["FUSEDIST_CHECKPOINT_VISIBLE_S"] = "0.5"
    if rank == 0:
        shutil.copytree(s3, s3 + "-missing")
        os.unlink(os.path.join(s3 + "-missing", "rank-00001.pt"))
    dist.barrier()
    model = _stage3(seed=7)
    opt = _adamw(model)
    _steps(model, opt, 0, 1, rank, ws)
    before = _ranges(model, opt)
    try:
        fusedist.checkpoint.load(s3 + "-missing", model, opt)
        out["missing"] = None
    except CheckpointError as exc:
        out["missing"] = str(exc)
    after = _ranges(model, opt)
    out["untouched"] = all(torch.equal(before[n][2], after[n][2]) and
                           all(torch.equal(before[n][3][k], after[n][3][k]) for k in before[n][3]) for n in before)
    return out


# ---------------------------------------------------------------------------------------- world 3 and 1
def _world3(rank, ws, root):
    import fusedist

    out = {"ref": _reference()}
    truth = torch.load(os.path.join(root, "truth.pt"))
    s3 = os.path.join(root, "stage3")
    model = _stage3(seed=7)
    opt = _adamw(model)
    fusedist.checkpoint.load(s3, model, opt)
    out["exact 2->3"] = _exact(model, opt, truth)
    _steps(model, opt, SAVE_AT, STEPS, rank, ws)
    out["2->3"] = _final(model)

    # The periodic Checkpointer writes the same stage-3 format.
    model = _stage3(seed=7)
    opt = _adamw(model)
    periodic = fusedist.checkpoint.Checkpointer(os.path.join(root, "periodic"), async_save=False)
    out["restored step"] = periodic.restore(model, opt)
    out["exact periodic 2->3"] = _exact(model, opt, truth)

    model = _stage3(seed=7)
    opt = _adamw(model, fused=True)
    fusedist.checkpoint.load(s3, model, opt)
    _steps(model, opt, SAVE_AT, STEPS, rank, ws)
    out["2->3 fused"] = _final(model)

    model = _stage3(seed=7)
    opt = _adamw(model)
    fusedist.checkpoint.load(os.path.join(root, "zero2"), model, opt)
    _steps(model, opt, SAVE_AT, STEPS, rank, ws)
    out["zero2 at 2->stage3 at 3"] = _final(model)

    # World size 1: each rank alone in its own group, on the whole batch.
    own, _ = dist.new_subgroups(group_size=1)
    model = _stage3(group=own, seed=7)
    opt = _adamw(model)
    fusedist.checkpoint.load(s3, model, opt)
    out["exact 2->1"] = _exact(model, opt, truth)
    _steps(model, opt, SAVE_AT, STEPS, 0, 1)
    out["2->1"] = _final(model)
    return out


def test_stage3_checkpoint_reshards_and_crosses_ddp_and_zero2(tmp_path):
    root = str(tmp_path)
    for rank, res in enumerate(run_distributed(_world2, 2, root, timeout=240)):
        ref = res.pop("ref")
        assert "manifest.json" in res.pop("files")
        assert res.pop("extra") == {"step": SAVE_AT}
        assert res.pop("exact stage3->stage3") == [], rank
        assert res.pop("exact stage3->ddp") == [], rank
        missing = res.pop("missing")
        assert missing and "rank-00001.pt" in missing, (rank, missing)
        assert res.pop("untouched"), rank
        for name, final in res.items():
            assert _diff(final, ref) < TOL, (rank, name, _diff(final, ref))
    for rank, res in enumerate(run_distributed(_world3, 3, root, timeout=240)):
        ref = res.pop("ref")
        assert res.pop("exact 2->3") == [], rank
        assert res.pop("exact 2->1") == [], rank
        assert res.pop("restored step") == SAVE_AT
        assert res.pop("exact periodic 2->3") == [], rank
        for name, final in res.items():
            assert _diff(final, ref) < TOL, (rank, name, _diff(final, ref))
