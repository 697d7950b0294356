"""ZeroRedundancyOptimizer with parameters that get no gradient: frozen ones (requires_grad=False
at construction) and ones a step leaves without a gradient (a model branch used only in some
iterations). torch optimizers skip a parameter whose grad is None; so must ZeRO (Note [piece
splitting] in fusedist/zero/partition.py).

The oracle is torch.optim.AdamW (foreach and fused) in one process on the *global* batch: DDP
averages per-rank mean losses over equal-sized chunks, which is the global mean loss, so the
averaged gradient equals the single-process one up to summation order. A branch used only by
some ranks is reproduced by applying it only to those ranks' rows of the global batch.

Tolerance 1e-5 (fp32) after 10 steps: both sides run the same AdamW math on gradients that
differ only in summation order (a few ulps); lr 1e-2 with weight_decay 0.1 moves parameters by
~1e-2 per step, so a wrongly stepped skipped parameter (weight decay alone changes it by lr *
wd * |p| ~ 1e-4 per step), a wrong step count (bias correction) or a missed step is caught.
"""

import copy
import os

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fusedist.testing import run_distributed

TINY_BUCKETS = dict(bucket_cap_mb=0.002, first_bucket_cap_mb=0.001)  # several buckets, params split
GLOBAL_BATCH = 12  # divisible by world sizes 1, 2, 3
STEPS = 10
TOL = 1e-5


class Branchy(nn.Module):
    """stem -> body -> (+ branch on some rows) -> (+ late, from step LATE_FROM) -> head."""

    LATE_FROM = 7

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(16, 24)
        self.body = nn.Linear(24, 24)
        self.branch = nn.Linear(24, 24)
        self.late = nn.Linear(24, 24)
        self.head = nn.Linear(24, 4)

    def forward(self, x, rows=None, late=False):
        """``rows``: indices of the rows the branch is applied to (None or empty: not used, so
        its parameters get no gradient)."""
        h = torch.tanh(self.body(torch.tanh(self.stem(x))))
        if rows is not None and len(rows):
            extra = torch.zeros_like(h)
            extra[rows] = torch.tanh(self.branch(h[rows]))
            h = h + extra
        if late:
            h = h + torch.tanh(self.late(h))
        return self.head(h)


def _batch(step):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 16, generator=gen), torch.randn(GLOBAL_BATCH, 4, generator=gen)


def _branch_ranks(step, world_size, schedule):
    """Which ranks use the branch at ``step``: "always"; "some" -- everyone, nobody (so its
    grad is None on every rank), or only rank 0 (others contribute zero); "allnone" --
    everyone or nobody."""
    if schedule == "always":
        return list(range(world_size))
    phase = step % 3
    if phase == 2:
        return []
    return [0] if phase == 1 and schedule == "some" else list(range(world_size))


def _rows(ranks, world_size):
    """Rows of the global batch the branch is applied to: those of ``ranks`` at ``world_size``."""
    chunk = GLOBAL_BATCH // world_size
    return torch.cat([torch.arange(r * chunk, (r + 1) * chunk) for r in ranks]) if ranks else None


def _make(frozen, freeze_late=False):
    torch.manual_seed(0)
    model = Branchy()
    if frozen:
        model.stem.requires_grad_(False)
    if freeze_late:
        model.late.requires_grad_(False)
    return model


def _groups(model, all_params=True):
    """Two groups (weights decay, biases do not, half lr). Frozen parameters stay in them, as
    with ``model.parameters()`` in a fine-tuning script."""
    params = [(n, p) for n, p in model.named_parameters() if all_params or p.requires_grad]
    return [dict(params=[p for n, p in params if n.endswith("weight")], weight_decay=0.1),
            dict(params=[p for n, p in params if n.endswith("bias")], weight_decay=0.0, lr=5e-3)]


def _reference(frozen, schedule, world_size, impl, steps=STEPS, late=False, model=None, opt=None, start=0,
               clip=None):
    """Single-process torch AdamW on the global batch; returns (model, optimizer)."""
    if model is None:
        model = _make(frozen)
        opt = torch.optim.AdamW(_groups(model), lr=1e-2, **{impl: True})
    for step in range(start, steps):
        x, y = _batch(step)
        opt.zero_grad()
        rows = _rows(_branch_ranks(step, world_size, schedule), world_size)
        nn.functional.mse_loss(model(x, rows, late and step >= Branchy.LATE_FROM), y).backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)  # parameters without grad: ignored
        opt.step()
    return model, opt


def _local_step(model, step, rank, world_size, schedule, late=False, schedule_world=None):
    """Forward/backward of this rank's chunk of the global batch. The branch rows follow the
    schedule of ``schedule_world`` ranks (default: this world size), so a run resumed at
    another world size computes the same global loss."""
    x, y = _batch(step)
    chunk = GLOBAL_BATCH // world_size
    lo = rank * chunk
    x, y = x[lo:lo + chunk], y[lo:lo + chunk]
    sw = schedule_world or world_size
    rows = _rows(_branch_ranks(step, sw, schedule), sw)
    if rows is not None:
        rows = rows[(rows >= lo) & (rows < lo + chunk)] - lo
    nn.functional.mse_loss(model(x, rows, late and step >= Branchy.LATE_FROM), y).backward()


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train_zero(rank, world_size, *, frozen, schedule, stage, ddp, offload=None, inner=None, groups=True,
                steps=STEPS, late=False, freeze_late=False, clip=None, clip_fn=False):
    """ZeRO over a fusedist DDP model (ddp=True) or a bare model whose gradients are averaged
    by hand (stage 1 without DDP); returns (module, optimizer)."""
    import fusedist

    module = _make(frozen, freeze_late)
    model = (fusedist.DistributedDataParallel(module, find_unused_parameters=True, **TINY_BUCKETS)
             if ddp else module)
    # clip_fn: the optimizer gets the trainable parameters only and the loop clips with
    # fusedist.clip_grad_norm_(module.parameters()), frozen ones included (a common script).
    params = _groups(module, all_params=not clip_fn) if groups else module.parameters()
    opt = fusedist.ZeroRedundancyOptimizer(params, inner, stage=stage, offload=offload, lr=1e-2,
                                           bucket_cap_mb=0.002, weight_decay=0.1)
    for step in range(steps):
        opt.zero_grad()
        _local_step(model, step, rank, world_size, schedule, late)
        if not ddp:
            for p in module.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad.div_(world_size)
        if clip is not None and clip_fn:
            fusedist.clip_grad_norm_(module.parameters(), clip)
        elif clip is not None:
            opt.clip_grad_norm_(clip)  # the global norm over every rank's shard
        opt.step()
    opt.wait_for_params()
    return module, opt


def _shared_references(rank, world_size, keys):
    """{(frozen, schedule, clip, impl): flat weights} of the single-process torch runs, each
    computed once: by one rank in turn, then gathered on every rank (the same runs on every
    rank were a large share of the test's time)."""
    mine = {key: _flat(_reference(key[0], key[1], world_size, key[3], clip=key[2])[0])
            for i, key in enumerate(keys) if i % world_size == rank}
    gathered = [None] * world_size
    dist.all_gather_object(gathered, mine)
    return {key: flat for part in gathered for key, flat in part.items()}


def _parity_worker(rank, world_size):
    """(a) frozen parameters and (b) parameters without a gradient in some steps: every
    configuration against torch AdamW (foreach and fused)."""
    from fusedist.optim import FusedAdamW

    os.environ["FUSEDIST_KERNEL_BACKEND"] = "torch"  # FusedAdamW's PyTorch path (kernels tested elsewhere)
    refs = _shared_references(rank, world_size, [
        (frozen, schedule, clip, impl)
        for frozen, schedule, clip in ((True, "always", None), (False, "some", None), (True, "some", None),
                                       (True, "allnone", None), (True, "some", 0.05))
        for impl in ("foreach", "fused")])
    configs = []
    for frozen, schedule in ((True, "always"), (False, "some"), (True, "some")):
        for stage in (1, 2):
            configs.append(dict(frozen=frozen, schedule=schedule, stage=stage, ddp=True, inner=FusedAdamW))
            configs.append(dict(frozen=frozen, schedule=schedule, stage=stage, ddp=True, inner=FusedAdamW,
                                offload="cpu"))
        configs.append(dict(frozen=frozen, schedule=schedule, stage=1, ddp=True, inner=torch.optim.AdamW))
    # Without fusedist DDP (stage 1, gradients averaged outside): frozen, and a branch no rank
    # uses in some steps ("some" uses it on rank 0 only, which only DDP's zero fill covers).
    for schedule in ("always", "allnone"):
        configs.append(dict(frozen=True, schedule=schedule, stage=1, ddp=False, inner=FusedAdamW))
        configs.append(dict(frozen=True, schedule=schedule, stage=1, ddp=False, inner=FusedAdamW, offload="cpu"))
    # A global clip: skipped parameters' (zero) gradient slices do not change the norm.
    for stage in (1, 2):
        configs.append(dict(frozen=True, schedule="some", stage=stage, ddp=True, inner=FusedAdamW, clip=0.05))
    configs.append(dict(frozen=True, schedule="some", stage=2, ddp=True, inner=FusedAdamW, clip=0.05,
                        offload="cpu"))
    configs.append(dict(frozen=True, schedule="some", stage=2, ddp=True, inner=FusedAdamW, clip=0.05,
                        clip_fn=True))
    # One param group, every trainable parameter used in every step: nothing is skipped, so
    # nothing is split (one tensor per bucket for the fused step).
    configs.append(dict(frozen=True, schedule="always", stage=2, ddp=True, inner=FusedAdamW, groups=False,
                        freeze_late=True))
    out = []
    for cfg in configs:
        module, opt = _train_zero(rank, world_size, **cfg)
        flat = _flat(module)
        key = (cfg["frozen"], cfg["schedule"], cfg.get("clip"))
        if not cfg.get("groups", True):
            ref_model = _make(cfg["frozen"], freeze_late=True)
            ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
            ref, _ = _reference(cfg["frozen"], cfg["schedule"], world_size, "foreach", model=ref_model, opt=ref_opt)
            diffs = [(flat - _flat(ref)).abs().max().item()]
        else:
            diffs = [(flat - refs[key + (impl,)]).abs().max().item() for impl in ("foreach", "fused")]
        stem_unchanged = all(torch.equal(p, q) for p, q in zip(module.stem.parameters(),
                                                                _make(cfg["frozen"]).stem.parameters()))
        out.append(dict(cfg={k: getattr(v, "__name__", v) for k, v in cfg.items()}, diffs=diffs,
                        stem_unchanged=stem_unchanged, pieces=len(opt._pieces),
                        unsplit=len(opt._partition._pieces())))  # one per bucket slice and group run
    return out


@pytest.mark.parametrize("world_size", [2, 3], ids=lambda w: f"world{w}")
def test_frozen_and_skipped_parameters_match_torch(world_size, request):
    per_rank = _outcome(request.getfixturevalue({2: "two_ranks", 3: "three_ranks"}[world_size]), "parity")
    for r in per_rank:
        for item in r:
            cfg = item["cfg"]
            assert max(item["diffs"]) < TOL, item
            if cfg["frozen"]:
                assert item["stem_unchanged"], cfg
            if cfg.get("groups") is False:
                assert item["pieces"] == item["unsplit"], item  # nothing skipped: never split


def test_frozen_parameters_are_in_state_dicts_like_torch(monkeypatch):
    """Single process: state dict indices, no state for frozen parameters, and a gradient
    appearing on a frozen parameter is an error naming it."""
    import fusedist

    model = _make(frozen=True)
    ref = copy.deepcopy(model)
    opt = fusedist.ZeroRedundancyOptimizer(_groups(model), torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2)
    for step in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            _local_step(m, step, 0, 1, "some")
            o.step()
    full = opt.consolidate_state_dict()
    theirs = ref_opt.state_dict()
    assert [g["params"] for g in full["param_groups"]] == [g["params"] for g in theirs["param_groups"]]
    assert sorted(full["state"]) == sorted(theirs["state"])  # frozen stem: no state on either side
    _same_state(full, theirs)

    # Unfrozen after construction: it joins the shards and is stepped as torch steps it
    # (Note [growing the partition] in fusedist/zero/grow.py).
    for m, o in ((model, opt), (ref, ref_opt)):
        m.stem.weight.requires_grad_(True)
        o.zero_grad()
        _local_step(m, 3, 0, 1, "always")
        o.step()
    assert (_flat(model) - _flat(ref)).abs().max().item() < TOL
    _same_state(opt.consolidate_state_dict(), ref_opt.state_dict())
    # A gradient on a parameter that is still frozen cannot be stepped: named, with the cause.
    opt.zero_grad()
    model.stem.bias.grad = torch.ones_like(model.stem.bias)
    with pytest.raises(RuntimeError, match=r"parameter 5 \(shape \(24,\)\) has a gradient, but it is not sharded.*"
                                           r"requires_grad=False"):
        opt.step()



def _frozen_whole_worker(rank, world_size):
    """A model frozen whole when the optimizer is built (a fine-tuning script that unfreezes
    stage by stage, or builds its optimizer first): torch's ZeroRedundancyOptimizer takes it,
    steps it as a no-op and trains the parameters once they are unfrozen; so must ZeRO, with
    and without a DDP model (which follows the unfreezing, Note [trainable set changes]),
    stage 2 and host offload included. Rank 0 compares the consolidated state dicts."""
    import fusedist
    from fusedist.optim import FusedAdamW

    os.environ["FUSEDIST_KERNEL_BACKEND"] = "torch"  # FusedAdamW's PyTorch path (kernels tested elsewhere)
    ref_model, ref_opt = _reference(False, "always", world_size, "foreach")
    ref_state = ref_opt.state_dict()
    failures = []
    for stage, ddp, offload in ((1, False, None), (1, True, None), (2, True, None), (2, True, "cpu")):
        where = f"rank {rank}, stage {stage}, ddp {ddp}, offload {offload}"
        module = _make(frozen=False)
        initial = _flat(module)
        module.requires_grad_(False)
        model = fusedist.DistributedDataParallel(module, find_unused_parameters=True, **TINY_BUCKETS) if ddp else module
        opt = fusedist.ZeroRedundancyOptimizer(_groups(module), FusedAdamW, stage=stage, offload=offload, lr=1e-2,
                                               bucket_cap_mb=0.002, weight_decay=0.1)
        for _ in range(2):  # nothing to step: as torch's, which steps no parameter without a gradient
            opt.zero_grad()
            opt.step()
        frozen = opt.consolidate_state_dict(to=0)
        if not torch.equal(_flat(module), initial):
            failures.append(f"{where}: a step changed frozen parameters")
        if rank == 0 and (frozen["state"] != {} or [g["params"] for g in frozen["param_groups"]]
                          != [g["params"] for g in ref_state["param_groups"]]):
            failures.append(f"{where}: state dict while frozen {frozen}")
        module.requires_grad_(True)
        for step in range(STEPS):
            opt.zero_grad()
            _local_step(model, step, rank, world_size, "always")
            if not ddp:
                for p in module.parameters():
                    if p.grad is not None:  # (the late layer is unused)
                        dist.all_reduce(p.grad)
                        p.grad.div_(world_size)
            opt.step()
        opt.wait_for_params()
        diff = (_flat(module) - _flat(ref_model)).abs().max().item()
        if not diff < TOL:
            failures.append(f"{where}: max |fusedist - torch| = {diff:.3g} after unfreezing")
        full = opt.consolidate_state_dict(to=0)
        if rank == 0:
            assert sorted(full["state"]) == sorted(ref_state["state"]), where
            _same_state(full, ref_state)
    return failures


def test_a_model_frozen_whole_trains_once_unfrozen(two_ranks):
    failures = [f for fs in _outcome(two_ranks, "frozen whole") for f in fs]
    assert not failures, "\n".join(failures)


def _same_state(ours, theirs, tol=TOL):
    for index, state in theirs["state"].items():
        mine = ours["state"][index]
        assert set(mine) == set(state), (index, set(mine), set(state))
        for key, v in state.items():
            if key == "step":
                assert float(mine[key]) == float(v), (index, float(mine[key]), float(v))
            else:
                assert (mine[key].cpu() - v.cpu()).abs().max().item() < tol, (index, key)


CHECKPOINT_VARIANTS = ((1, None), (2, None), (2, "cpu"))  # (stage, offload)


def _variant_dir(directory, stage, offload):
    return os.path.join(directory, f"stage{stage}-{offload or 'device'}")


def _checkpoint_save_worker(rank, world_size, directory):
    """(c) ZeRO at world size 2 with frozen parameters and pieces split by skipped steps (the
    "late" layer never used yet: no state), saved after 5 steps. (d) consolidate_state_dict
    loads into torch AdamW and equals its state at that point. One checkpoint per variant."""
    import fusedist

    os.environ["FUSEDIST_KERNEL_BACKEND"] = "torch"
    out = {}
    for stage, offload in CHECKPOINT_VARIANTS:
        module, opt = _train_zero(rank, world_size, frozen=True, schedule="some", stage=stage, ddp=True,
                                  offload=offload, steps=5, late=True)
        pieces = len(opt._pieces)
        fusedist.checkpoint.save(_variant_dir(directory, stage, offload), module, opt, extra={"step": 5})
        full = opt.consolidate_state_dict()
        if rank != 0:
            out[(stage, offload)] = dict(pieces=pieces)
            continue
        ref_model, ref_opt = _reference(True, "some", world_size, "foreach", steps=5, late=True)
        torch_opt = torch.optim.AdamW(_groups(copy.deepcopy(ref_model)), lr=1e-2)
        torch_opt.load_state_dict(full)
        out[(stage, offload)] = dict(pieces=pieces, consolidated=full, torch_loaded=torch_opt.state_dict(),
                                     ref=ref_opt.state_dict())
    return out


def _checkpoint_load_worker(rank, world_size, directory, save_world):
    """Load each world-2 checkpoint at ``world_size`` and train steps 5..9."""
    import fusedist

    os.environ["FUSEDIST_KERNEL_BACKEND"] = "torch"
    out = {}
    for stage, offload in CHECKPOINT_VARIANTS:
        module = _make(frozen=True)
        model = fusedist.DistributedDataParallel(module, find_unused_parameters=True, **TINY_BUCKETS)
        opt = fusedist.ZeroRedundancyOptimizer(_groups(module), stage=stage, offload=offload, lr=1e-2,
                                               weight_decay=0.1)
        extra = fusedist.checkpoint.load(_variant_dir(directory, stage, offload), model, opt)
        assert extra["step"] == 5
        for step in range(5, STEPS):
            opt.zero_grad()
            _local_step(model, step, rank, world_size, "some", late=True, schedule_world=save_world)
            opt.step()
        opt.wait_for_params()
        out[(stage, offload)] = _flat(module)
    return out


def test_checkpoint_after_split_reshards(two_ranks, three_ranks, monkeypatch):
    import fusedist

    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", "torch")  # FusedAdamW's PyTorch path
    directory = two_ranks["directory"]
    saved = _outcome(two_ranks, "checkpoint save")[0]
    model = _make(frozen=True)
    names = {p: n for n, p in model.named_parameters()}
    order = [names[p] for g in _groups(model) for p in g["params"]]  # the state dicts' indices
    for variant, item in saved.items():
        # Several pieces (the two groups alternate) whose parameters took different numbers
        # of steps (skipped ones) or none (the late layer): the loads below must keep them apart.
        assert item["pieces"] > 2, variant
        _same_state(item["consolidated"], item["ref"])
        _same_state(item["torch_loaded"], item["ref"])
        # The frozen stem and the not yet used late layer have no state, as in torch.
        assert sorted(order[i] for i in item["consolidated"]["state"]) == sorted(
            n for n in order if n.startswith(("body", "branch", "head"))), variant

    # Uninterrupted: 10 steps of torch AdamW. The data is the global batch at every world size,
    # so training resumed at 3 ranks or at 1 process must continue the same trajectory.
    uninterrupted = [_flat(_reference(True, "some", 2, impl, late=True)[0]) for impl in ("foreach", "fused")]
    at3 = _outcome(three_ranks, "checkpoint load")
    for per_variant in at3:
        for variant, flat in per_variant.items():
            for ref in uninterrupted:
                assert (flat - ref).abs().max().item() < TOL, variant
    # One process, no torch.distributed (stage 1 without DDP); the branch schedule of world
    # size 2 is reproduced on the full batch by the row selection.
    for stage, offload in CHECKPOINT_VARIANTS:
        model = _make(frozen=True)
        opt = fusedist.ZeroRedundancyOptimizer(_groups(model), offload=offload, lr=1e-2, weight_decay=0.1)
        assert fusedist.checkpoint.load(_variant_dir(directory, stage, offload), model, opt)["step"] == 5
        _single_process_steps(model, opt, 5, STEPS)
        for ref in uninterrupted:
            assert (_flat(model) - ref).abs().max().item() < TOL, (stage, offload)


def _single_process_steps(model, opt, start, stop):
    """Steps ``start``..``stop - 1`` in one process on the global batch, with the branch rows
    of the 2-rank "some" schedule (the late branch switched on as in the saved run)."""
    for step in range(start, stop):
        x, y = _batch(step)
        opt.zero_grad()
        rows = _rows(_branch_ranks(step, 2, "some"), 2)
        nn.functional.mse_loss(model(x, rows, step >= Branchy.LATE_FROM), y).backward()
        opt.step()


def test_load_torch_state_with_unequal_step_counts():
    """(d, reverse) A torch AdamW state dict whose parameters have different step counts (and
    some no state) loads into ZeRO, which splits its pieces accordingly and continues like torch."""
    import fusedist

    ref_model, ref_opt = _reference(True, "some", 2, "foreach", steps=5, late=True)
    model = _make(frozen=True)
    model.load_state_dict(ref_model.state_dict())
    opt = fusedist.ZeroRedundancyOptimizer(_groups(model), torch.optim.AdamW, lr=1e-2)
    opt.load_state_dict(ref_opt.state_dict())
    _same_state(opt.consolidate_state_dict(), ref_opt.state_dict())
    _reference(True, "some", 2, "foreach", steps=STEPS, late=True, model=ref_model, opt=ref_opt, start=5)
    _single_process_steps(model, opt, 5, STEPS)
    assert (_flat(model) - _flat(ref_model)).abs().max().item() < TOL
    _same_state(opt.consolidate_state_dict(), ref_opt.state_dict())


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=12),
    dtype_picks=st.lists(st.integers(0, 1), min_size=12, max_size=12),
    group_picks=st.lists(st.integers(0, 2), min_size=12, max_size=12),
    frozen_picks=st.lists(st.booleans(), min_size=12, max_size=12),
    skip_rounds=st.lists(st.sets(st.integers(0, 11)), min_size=1, max_size=4),
    world_size=st.integers(1, 4),
    cap=st.sampled_from([64, 400, 10_000]),
)
def test_piece_splitting_invariants(sizes, dtype_picks, group_picks, frozen_picks, skip_rounds, world_size, cap):
    """Note [piece splitting], for any layout and any sequence of skipped sets: pieces tile
    each shard, hold one group, never cut a parameter, hold padding only just where a bucket's
    slice is all padding, and after the
    cuts for a skipped set every piece's parameters are all skipped or all not."""
    from fusedist.zero.partition import FlatPartition, bucketize

    dtypes = [torch.float32, torch.bfloat16]
    params = [torch.zeros(n, dtype=dtypes[d]) for n, d in zip(sizes, dtype_picks)]
    groups = group_picks[:len(params)]
    sharded = [i for i in range(len(params)) if not frozen_picks[i]]
    buckets = bucketize([params[i] for i in sharded], [str(i) for i in sharded], cap_bytes=cap,
                        world_size=world_size)
    for rank in range(world_size):
        part = FlatPartition(buckets, params, groups, rank, world_size, sharded=sharded)
        assert not {e.index for e in part.entries} - set(sharded)  # frozen parameters own nothing
        for skipped in skip_rounds:
            part.split(part.cuts_around(skipped))
            members: dict = {}
            for e in part.entries:
                k = part.piece_index(e)
                piece = part.pieces[k]
                assert piece.group == e.group and piece.start <= e.pos and e.pos + e.numel <= piece.end
                members.setdefault(k, []).append(e.index in skipped)
            for k, flags in members.items():
                assert all(flags) or not any(flags), (k, flags)
            for dtype, total in part.shard_numel.items():
                ks = sorted((k for k, p in enumerate(part.pieces) if p.dtype == dtype),
                            key=lambda k: part.pieces[k].start)
                assert part.pieces[ks[0]].start == 0 and part.pieces[ks[-1]].end == total
                assert all(part.pieces[a].end == part.pieces[b].start for a, b in zip(ks, ks[1:]))
                # Padding only: exactly a bucket's slice that holds no parameter (Note [piece splitting]).
                empty_slices = {(bs.pos, bs.pos + bs.hi - bs.lo) for bs in part.bucket_shards
                                if bs.bucket.dtype == dtype
                                and not any(e.dtype == dtype and bs.pos <= e.pos < bs.pos + bs.hi - bs.lo
                                            for e in part.entries)}
                for k in ks:
                    if k not in members:
                        piece = part.pieces[k]
                        assert (piece.start, piece.end) in empty_slices, ("a piece of padding only", piece)


@pytest.mark.gpu
@pytest.mark.parametrize("offload", [None, "cpu"])
def test_cuda_skips_like_torch(offload):
    """One process on a GPU: FusedAdamW's device path (split pieces, some with grad=None, in
    one multi-tensor launch per group) and the offload pipeline (streams, events) against
    torch's fused AdamW on the same device, frozen stem and a branch unused in some steps."""
    _single_process_against_fused_torch(torch.device("cuda"), offload)


@pytest.mark.parametrize("backend", ["torch", "triton", "cpu_ext"])
def test_kernels_skip_like_torch(monkeypatch, backend):
    """FusedAdamW's implementations (Triton interpreted on CPU, the C++ CPU kernel, PyTorch)
    with split pieces that have different step counts and some grad=None, one process."""
    from fusedist import _extension

    if backend == "cpu_ext" and not _extension.is_available("_cpu_ops"):
        pytest.skip(f"fusedist._cpu_ops is not built: {_extension.load_error('_cpu_ops')}")
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    monkeypatch.setenv("FUSEDIST_KERNEL_BACKEND", backend)
    _single_process_against_fused_torch(torch.device("cpu"), None)


def _single_process_against_fused_torch(device, offload):
    import fusedist

    model = _make(frozen=True).to(device)
    ref = copy.deepcopy(model)
    opt = fusedist.ZeroRedundancyOptimizer(_groups(model), lr=1e-2, weight_decay=0.1, offload=offload,
                                           bucket_cap_mb=0.002)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2, fused=True)
    for step in range(STEPS):
        x, y = (t.to(device) for t in _batch(step))
        rows = _rows(_branch_ranks(step, 2, "some"), 2)
        rows = None if rows is None else rows.to(device)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            nn.functional.mse_loss(m(x, rows, step >= Branchy.LATE_FROM), y).backward()
            o.step()
    opt.wait_for_params()
    assert (_flat(model) - _flat(ref)).abs().max().item() < TOL
    _same_state(opt.consolidate_state_dict(), ref_opt.state_dict())


def _compiled_name_worker(rank, world_size):
    import fusedist

    model = _make(frozen=True)
    ddp = fusedist.DistributedDataParallel(torch.compile(model))
    opt = fusedist.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2)
    index = next(i for i, p in enumerate(ddp.parameters()) if p is model.stem.bias)
    return opt._param_name(index)


def test_parameter_named_in_errors_as_the_model_spells_it_under_torch_compile(two_ranks):
    # torch.compile's wrapper adds an `_orig_mod.` segment to every parameter name; errors name
    # the parameter as the user's model defines it.
    for name in _outcome(two_ranks, "compiled name"):
        assert "'stem.bias'" in name and "_orig_mod" not in name, name


# ----------------------------------------------------------------------------- one launch
# The 2-rank work of the tests above runs in one launch of the ranks (each launch costs a
# process group and the imports of torch in every rank), one job after the other; the 3-rank
# work likewise, after it (it loads the checkpoints the 2-rank launch saved).
def _jobs_worker(rank, world_size, directory):
    """{job: result, or ("raised", the traceback of the error it raised)}."""
    import traceback

    if world_size == 2:
        jobs = {"parity": (_parity_worker,), "frozen whole": (_frozen_whole_worker,),
                "checkpoint save": (_checkpoint_save_worker, directory), "compiled name": (_compiled_name_worker,)}
    else:
        jobs = {"parity": (_parity_worker,), "checkpoint load": (_checkpoint_load_worker, directory, 2)}
    out = {}
    for job, (worker, *args) in jobs.items():
        try:
            out[job] = worker(rank, world_size, *args)
        except Exception:  # noqa: BLE001 - reported by the job's test
            out[job] = ("raised", traceback.format_exc())
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """{job: per-rank results} of :func:`_two_rank_jobs_worker`, and the checkpoints' ``directory``."""
    directory = str(tmp_path_factory.mktemp("checkpoints"))
    per_rank = run_distributed(_jobs_worker, 2, directory, timeout=600)
    return dict({job: [results[job] for results in per_rank] for job in per_rank[0]}, directory=directory)


@pytest.fixture(scope="module")
def three_ranks(two_ranks):
    """{job: per-rank results} of :func:`_jobs_worker` at 3 ranks (the checkpoints of ``two_ranks`` loaded)."""
    per_rank = run_distributed(_jobs_worker, 3, two_ranks["directory"], timeout=600)
    return {job: [results[job] for results in per_rank] for job in per_rank[0]}


def _outcome(shared: dict, job: str) -> list:
    """The per-rank results of ``job``; a rank that raised fails the test with its traceback."""
    for rank, res in enumerate(shared[job]):
        assert not (isinstance(res, tuple) and res[:1] == ("raised",)), f"{job}, rank {rank} raised:\n{res[1]}"
    return shared[job]
