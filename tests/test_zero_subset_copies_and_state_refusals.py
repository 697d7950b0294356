"""ZeroRedundancyOptimizer against torch's, at 2 ranks in one launch, on fresh random inputs (the
seed is in every assertion message):

* optimizers over a subset of a fusedist DDP model's parameters (two optimizers over two parts,
  the part still trained after another was frozen once the model was wrapped) train as torch's
  ZeroRedundancyOptimizer over the same subsets of torch's DDP model; stage 2 over a subset is
  refused naming the missing parameters (they were all refused) -- before any backward too, ahead
  of the reliability guard's "step() before any backward" (Note [a sharded optimizer's refusals
  before the step hooks] in fusedist/zero/step_refusals.py);
* stage 2 over a subset completed later trains as torch's AdamW: over the parameters left
  trainable after part of the wrapped model was frozen (its step was refused, naming no parameter:
  "missing: []"), and with the rest added between a backward and its step (that backward's
  gradients were dropped); where it cannot complete, the refusal names the frozen parameters or the
  no_sync backward; torch's ``hook_with_zero_step`` given this optimizer is refused naming what to
  use (a bare ``AttributeError: _overlap_with_ddp``);
* ``state_dict()["state"]`` before ``consolidate_state_dict`` raises a clear error (a KeyError and
  a RuntimeError) saying to consolidate, where torch raises a RuntimeError (it was a bare
  ``KeyError: 'state'``); the shard still saves and loads (``torch.load(weights_only=True)`` too,
  without fusedist imported: it comes back a plain dict);
* ``copy.deepcopy`` / ``copy.copy`` of the optimizer are refused (the copy was hollow and failed at
  its first step; torch's copy fails at first use too), and the original still trains as torch's;
* the shards of an optimizer over ``torch.optim.AdamW`` load into one over
  ``Adam(decoupled_weight_decay=True)`` and back (one algorithm in torch; it was refused as
  another's), which then steps as torch's AdamW from the consolidated state; Adam's L2 decay
  stays refused;
* ``consolidate_state_dict(to=)`` with a rank outside the group is refused on every rank before
  any collective (no collective sequence number used), naming ``to``;
* stage 1 over a DDP model, where ``p.grad`` is the gradient shard's memory: gradients replaced
  by lazily negated / conjugated views of that memory (same values) step as torch's AdamW over
  the global batch (the shard held the negation / conjugate, stepped the wrong way); the
  collectives' ``real_pairs`` refuses flagged tensors and the replica digest reads values.

Tolerance: fp32 Adam/AdamW/SGD, 3-4 steps: both sides average the same gradients and run the same
elementwise update on the same elements, differing in summation order and batching (a few fp32
ulps per step); 1e-5 absolute on weights of magnitude ~0.5 moved ~1e-2 a step (a defect moves
them by ~lr).
"""

from __future__ import annotations

import copy
import io
import random

import pytest
import torch
from torch import nn

from models import raised
from shared_rank_launch import launch_for_selected, results_of

TOL = 1e-5


def _net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _losses_step(model, opts, rank, seed, steps=3):
    g = torch.Generator().manual_seed(seed * 10 + rank)
    for _ in range(steps):
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
        for opt in opts:
            opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        for opt in opts:
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _subsets(rank, world, seed):
    """Two optimizers over two parts; the part still trained after freezing; stage 2 refused."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import fusedist

    out = {}
    theirs = TorchDDP(_net(seed))
    ref = _losses_step(theirs, [
        TorchZero(theirs.module[0].parameters(), optimizer_class=torch.optim.AdamW, lr=0.01, weight_decay=0.1),
        TorchZero(theirs.module[2].parameters(), optimizer_class=torch.optim.SGD, lr=0.05, momentum=0.9)],
        rank, seed)
    ours = fusedist.DistributedDataParallel(_net(seed))
    opts = [fusedist.ZeroRedundancyOptimizer(ours.module[0].parameters(), optimizer_class=torch.optim.AdamW,
                                             lr=0.01, weight_decay=0.1),
            fusedist.ZeroRedundancyOptimizer(ours.module[2].parameters(), optimizer_class=torch.optim.SGD,
                                             lr=0.05, momentum=0.9)]
    out["two parts"] = _diff(ref, _losses_step(ours, opts, rank, seed))

    theirs = TorchDDP(_net(seed), find_unused_parameters=True)
    theirs.module[0].requires_grad_(False)  # frozen after wrapping: only the head is trained
    ref = _losses_step(theirs, [TorchZero(theirs.module[2].parameters(), optimizer_class=torch.optim.Adam,
                                          lr=0.01)], rank, seed)
    ours = fusedist.DistributedDataParallel(_net(seed), find_unused_parameters=True)
    ours.module[0].requires_grad_(False)
    head = [p for p in ours.parameters() if p.requires_grad]
    got = _losses_step(ours, [fusedist.ZeroRedundancyOptimizer(head, optimizer_class=torch.optim.Adam, lr=0.01)],
                       rank, seed)
    out["trained part"] = _diff(ref, got)

    other = fusedist.DistributedDataParallel(_net(seed))
    part = fusedist.ZeroRedundancyOptimizer(other.module[2].parameters(), optimizer_class=torch.optim.Adam,
                                            lr=0.01, stage=2)
    out["stage 2 before backward"] = raised(part.step)  # (its own refusal first, not the reliability guard's)
    other(torch.randn(2, 5)).sum().backward()
    out["stage 2"] = raised(part.step)  # (stage 2 starts once add_param_group adds the rest)
    return out


def _frozen_after_wrap(rank, world, seed):
    """Stage 2 over a subset of a fusedist DDP model completed later, against torch's AdamW under
    torch's DDP: over the parameters left trainable after the head was frozen on the wrapped model
    (refused naming no parameter, "missing: []"), the head unfrozen and added with its own lr after
    2 steps, also under a GradScaler (an overflow) with a clip; and the head's group added
    between a backward and its step (that backward's gradients were dropped: nothing stepped).
    Where it cannot complete (state made before, a no_sync backward) the refusal names the frozen
    parameters / no_sync. torch's hook_with_zero_step given this optimizer: refused by name (a
    bare AttributeError)."""
    from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import fusedist

    def train(model, opt, head, add_at, unfreeze=True, steps=4, scaler=None):
        g = torch.Generator().manual_seed(seed * 10 + rank)
        for step in range(steps):
            if step == 2 and unfreeze:
                head.requires_grad_(True)
            x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
            if add_at == (step, "before"):
                opt.add_param_group({"params": list(head.parameters()), "lr": 0.05})
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if scaler is None:
                loss.backward()
            else:  # an overflow in step 1; the clip binds (gradient norms ~0.5)
                scaler.scale(loss * (float("inf") if step == 1 else 1.0)).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 0.05)
            if add_at == (step, "after backward"):
                opt.add_param_group({"params": list(head.parameters()), "lr": 0.05})
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
        return [p.detach().clone() for p in model.parameters()]

    out = {}
    theirs = TorchDDP(_net(seed), find_unused_parameters=True)
    theirs.module[2].requires_grad_(False)
    ref = train(theirs, torch.optim.AdamW(theirs.module[0].parameters(), lr=0.01), theirs.module[2], (2, "before"))
    theirs = TorchDDP(_net(seed), find_unused_parameters=True)
    theirs.module[2].requires_grad_(False)
    scaled_ref = train(theirs, torch.optim.AdamW(theirs.module[0].parameters(), lr=0.01), theirs.module[2],
                       (2, "before"), scaler=torch.amp.GradScaler("cpu", init_scale=4.0))
    zero = fusedist.ZeroRedundancyOptimizer(theirs.module[0].parameters(), optimizer_class=torch.optim.AdamW, lr=0.01)
    out["hook_with_zero_step"] = raised(lambda: hook_with_zero_step(allreduce_hook, theirs, zero))
    for how in ("trainable only", "frozen given too", "frozen before wrap", "optim read first", "scaler and clip"):
        net = _net(seed)
        if how == "frozen before wrap":
            net[2].requires_grad_(False)
        ours = fusedist.DistributedDataParallel(net)
        net[2].requires_grad_(False)
        groups = [{"params": [p for p in ours.parameters() if p.requires_grad]}]
        if how == "frozen given too":
            groups.append({"params": list(net[2].parameters()), "lr": 0.05})
        opt = fusedist.ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=0.01, stage=2)
        if how == "optim read first":
            opt.optim  # noqa: B018 - makes the state over the subset
        scaler = fusedist.amp.GradScaler("cpu", init_scale=4.0) if how == "scaler and clip" else None
        out[how] = raised(lambda: out.__setitem__(how + " diff", _diff(scaled_ref if scaler else ref, train(
            ours, opt, net[2], None if how == "frozen given too" else (2, "before"), scaler=scaler))))

    theirs = TorchDDP(_net(seed))
    ref = train(theirs, torch.optim.AdamW(theirs.module[0].parameters(), lr=0.01), theirs.module[2],
                (0, "after backward"), unfreeze=False, steps=3)
    ours = fusedist.DistributedDataParallel(_net(seed))
    opt = fusedist.ZeroRedundancyOptimizer(ours.module[0].parameters(), optimizer_class=torch.optim.AdamW, lr=0.01,
                                           stage=2)
    out["added after backward"] = _diff(ref, train(ours, opt, ours.module[2], (0, "after backward"), unfreeze=False,
                                                   steps=3))
    ours = fusedist.DistributedDataParallel(_net(seed))
    opt = fusedist.ZeroRedundancyOptimizer(ours.module[0].parameters(), optimizer_class=torch.optim.AdamW, lr=0.01,
                                           stage=2)
    with ours.no_sync():
        ours(torch.randn(2, 5)).sum().backward()
    out["added after no_sync"] = raised(lambda: opt.add_param_group({"params": list(ours.module[2].parameters())}))
    out["groups after no_sync"] = len(opt.param_groups)
    return out


def _unconsolidated_and_copies(rank, world, seed):
    """state_dict()["state"] before consolidation; copies refused; the original trains on."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import fusedist

    out = {}
    theirs = TorchDDP(_net(seed))
    torch_opt = TorchZero(theirs.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    ref = _losses_step(theirs, [torch_opt], rank, seed, steps=2)
    out["torch state"] = raised(lambda: torch_opt.state_dict()["state"])
    ours = fusedist.DistributedDataParallel(_net(seed))
    opt = fusedist.ZeroRedundancyOptimizer(ours.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    _losses_step(ours, [opt], rank, seed, steps=2)
    sd = opt.state_dict()
    out["state"] = raised(lambda: sd["state"])
    out["caught as KeyError"] = raised(lambda: _catch(KeyError, lambda: sd["state"]))
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    shards = [None] * world
    torch.distributed.all_gather_object(shards, torch.load(buf, weights_only=True))
    out["deepcopy"] = raised(lambda: copy.deepcopy(opt))
    out["copy"] = raised(lambda: copy.copy(opt))
    # The shards load into a fresh optimizer, which then trains on as torch's (2 more steps).
    fresh_model = fusedist.DistributedDataParallel(_net(seed))
    with torch.no_grad():
        for a, b in zip(fresh_model.parameters(), ours.parameters()):
            a.copy_(b)
    fresh = fusedist.ZeroRedundancyOptimizer(fresh_model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    fresh.load_state_dict(shards)
    ref = _losses_step(theirs, [torch_opt], rank, seed + 1, steps=2)
    out["resumed"] = _diff(ref, _losses_step(fresh_model, [fresh], rank, seed + 1, steps=2))
    out["original"] = _diff(ref, _losses_step(ours, [opt], rank, seed + 1, steps=2))
    return out


def _catch(kind, fn):
    try:
        fn()
    except kind:
        return
    raise AssertionError(f"not a {kind.__name__}")


def _adam_family_and_destination(rank, world, seed):
    """AdamW's shard into Adam(decoupled_weight_decay=True) and back; L2 refused; a bad ``to``."""
    import fusedist

    out = {}
    hyper = dict(lr=0.01, weight_decay=0.1)
    model = fusedist.DistributedDataParallel(_net(seed))
    adamw = fusedist.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, **hyper)
    _losses_step(model, [adamw], rank, seed, steps=2)
    shards = [None] * world
    torch.distributed.all_gather_object(shards, adamw.shard_state_dict())
    start = [p.detach().clone() for p in model.parameters()]
    # The reference: torch's AdamW over the whole model, from the consolidated state.
    adamw.consolidate_state_dict(to=0)
    full = [adamw.state_dict() if rank == 0 else None]
    torch.distributed.broadcast_object_list(full, src=0)
    plain = _net(seed)
    with torch.no_grad():
        for a, b in zip(plain.parameters(), start):
            a.copy_(b)
    ref_opt = torch.optim.AdamW(plain.parameters(), **hyper)
    ref_opt.load_state_dict(full[0])
    ref = _losses_step(_Averaged(plain), [ref_opt], rank, seed + 1, steps=2)

    decoupled = fusedist.DistributedDataParallel(_net(seed))
    with torch.no_grad():
        for a, b in zip(decoupled.parameters(), start):
            a.copy_(b)
    adam = fusedist.ZeroRedundancyOptimizer(decoupled.parameters(), optimizer_class=torch.optim.Adam,
                                            decoupled_weight_decay=True, **hyper)
    out["AdamW into Adam(decoupled)"] = raised(lambda: adam.load_state_dict(shards))
    out["AdamW into Adam(decoupled) steps"] = _diff(ref, _losses_step(decoupled, [adam], rank, seed + 1, steps=2))
    back = [None] * world
    torch.distributed.all_gather_object(back, adam.shard_state_dict())
    # (the models held: an optimizer follows a DDP model while it lives, and a dropped wrapper lives
    # until the cyclic garbage collection, which comes at another time on each rank)
    models_held = [fusedist.DistributedDataParallel(_net(seed)) for _ in range(2)]
    again = fusedist.ZeroRedundancyOptimizer(models_held[0].parameters(), optimizer_class=torch.optim.AdamW, **hyper)
    out["Adam(decoupled) into AdamW"] = raised(lambda: again.load_state_dict(back))
    l2 = fusedist.ZeroRedundancyOptimizer(models_held[1].parameters(), optimizer_class=torch.optim.Adam, **hyper)
    out["AdamW into Adam(L2)"] = raised(lambda: l2.load_state_dict(shards))

    before = model.comm.last_seq if hasattr(model.comm, "last_seq") else None
    out["to=2"] = raised(lambda: adamw.consolidate_state_dict(to=2))
    out["to=-1"] = raised(lambda: adamw.consolidate_state_dict(to=-1))
    out["collectives"] = (before, getattr(model.comm, "last_seq", None))
    return out


class _Averaged(nn.Module):
    """A plain model whose backward averages the gradients over the ranks (the reference of a
    DDP model trained by an unsharded optimizer)."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        for p in module.parameters():
            p.register_hook(lambda g: _average(g))

    def forward(self, x):
        return self.module(x)


def _average(g):
    g = g.clone()
    torch.distributed.all_reduce(g)
    return g / torch.distributed.get_world_size()


class _Mixed(nn.Module):
    """A complex parameter and a real layer."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.w = nn.Parameter(torch.randn(6, dtype=torch.complex64))
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x).sum(-1) + (self.w.abs() ** 2).sum() * x[:, 0]


def _flagged_grads(rank, world, seed):
    """Stage 1 over a DDP model, whose ``p.grad`` is the shard's memory: gradients replaced by
    lazily negated / conjugated views of that same memory (the same values) step as torch's
    AdamW over the global batch; p.grad keeps its values."""
    import fusedist

    out = {}
    for how in ("negated", "conjugated"):
        ref, model = _Mixed(seed), fusedist.DistributedDataParallel(_Mixed(seed))
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
        opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=0.05,
                                               weight_decay=0.1)
        kept = []
        for step in range(3):
            xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(seed + 100 * step + r))
                  for r in range(world)]
            ref_opt.zero_grad()
            opt.zero_grad()
            ref(torch.cat(xs)).sum().div(world).backward()
            model(xs[rank]).sum().backward()
            for p in model.parameters():
                g = p.grad
                if how == "negated":  # the memory negated, the view reads the values
                    p.grad = torch._neg_view(g.neg_())
                elif p.is_complex():
                    p.grad = g.conj_physical_().conj()
            values = [p.grad.resolve_conj().resolve_neg() for p in model.parameters()]
            opt.step()
            ref_opt.step()
            kept.append(_diff(values, [p.grad for p in model.parameters()]))
        out[how] = _diff(ref.parameters(), model.parameters())
        out[how + " grads kept"] = max(kept)
    return out


BY_TEST = {
    "test_subsets_of_a_ddp_model_train_as_torch_and_stage2_is_refused": {
        "subsets": (_subsets, ())},
    "test_stage2_completed_after_a_freeze_or_a_backward_trains_as_torch": {
        "frozen after wrap": (_frozen_after_wrap, ())},
    "test_unconsolidated_state_and_copies_refused_clearly": {
        "unconsolidated": (_unconsolidated_and_copies, ())},
    "test_adam_family_loads_across_and_bad_destination_refused_first": {
        "adam family": (_adam_family_and_destination, ())},
    "test_flagged_gradients_over_their_bucket_view_step_as_torch": {
        "flagged": (_flagged_grads, ())},
}


@pytest.fixture(scope="module")
def launched(request):
    seed = random.randrange(2**20)
    by_test = {t: {n: (fn, (seed,)) for n, (fn, _) in s.items()} for t, s in BY_TEST.items()}
    return seed, launch_for_selected(request, by_test, 2, timeout=180)


def test_subsets_of_a_ddp_model_train_as_torch_and_stage2_is_refused(launched):
    seed, results = launched
    for rank, out in enumerate(results_of(results, "subsets")):
        where = f"seed {seed}, rank {rank}: {out}"
        assert out["two parts"] <= TOL, where
        assert out["trained part"] <= TOL, where
        assert out["stage 2"].startswith("RuntimeError: ZeroRedundancyOptimizer(stage=2) (rank"), where
        assert "subset" in out["stage 2"] and "'0.weight'" in out["stage 2"], where
        assert out["stage 2 before backward"] == out["stage 2"], where


def test_stage2_completed_after_a_freeze_or_a_backward_trains_as_torch(launched):
    seed, results = launched
    for rank, out in enumerate(results_of(results, "frozen after wrap")):
        where = f"seed {seed}, rank {rank}: {out}"
        for how in ("trainable only", "frozen given too", "frozen before wrap", "scaler and clip"):
            assert out[how] == "no error" and out[how + " diff"] <= TOL, where
        assert out["added after backward"] <= TOL, where
        refused = out["optim read first"]
        assert refused.startswith(f"RuntimeError: ZeroRedundancyOptimizer(stage=2) (rank {rank})"), where
        assert "['2.weight', '2.bias'] were frozen after the model was wrapped" in refused, where
        assert "freeze them before wrapping the model" in refused, where
        no_sync = out["added after no_sync"]
        assert no_sync.startswith(f"ValueError: ZeroRedundancyOptimizer(stage=2).add_param_group (rank {rank})"), where
        assert "the last backward ran under no_sync" in no_sync and out["groups after no_sync"] == 1, where
        hook = out["hook_with_zero_step"]
        assert hook.startswith(f"TorchZeroHookRefusal: fusedist.ZeroRedundancyOptimizer (rank {rank}) does not run in "
                               "torch's hook_with_zero_step"), where
        assert "stage=2 with a fusedist DistributedDataParallel" in hook, where


def test_unconsolidated_state_and_copies_refused_clearly(launched):
    seed, results = launched
    for rank, out in enumerate(results_of(results, "unconsolidated")):
        where = f"seed {seed}, rank {rank}: {out}"
        assert out["torch state"].startswith("RuntimeError") and "consolidate_state_dict" in out["torch state"], where
        assert out["state"].startswith("NotConsolidatedError") and "consolidate_state_dict(to=0)" in out["state"], where
        assert f"(rank {rank} of 2)" in out["state"], where
        assert out["caught as KeyError"] == "no error", where
        for kind in ("deepcopy", "copy"):
            assert out[kind].startswith("TypeError") and "cannot be copied" in out[kind], where
            assert f"(rank {rank} of 2)" in out[kind] and "load_state_dict" in out[kind], where
        assert out["resumed"] <= TOL, where
        assert out["original"] <= TOL, where


def test_adam_family_loads_across_and_bad_destination_refused_first(launched):
    seed, results = launched
    for rank, out in enumerate(results_of(results, "adam family")):
        where = f"seed {seed}, rank {rank}: {out}"
        assert out["AdamW into Adam(decoupled)"] == "no error", where
        assert out["AdamW into Adam(decoupled) steps"] <= TOL, where
        assert out["Adam(decoupled) into AdamW"] == "no error", where
        assert out["AdamW into Adam(L2)"].startswith("StateDictError"), where
        assert "state of AdamW (AdamW), the optimizer here runs Adam (Adam) in param group 0" in \
            out["AdamW into Adam(L2)"], where
        for to in ("2", "-1"):
            assert out[f"to={to}"].startswith(f"ValueError: ZeroRedundancyOptimizer.consolidate_state_dict (rank "
                                              f"{rank}): to={to} is not a rank"), where
        before, after = out["collectives"]
        assert before is not None and before == after, where


def test_flagged_gradients_over_their_bucket_view_step_as_torch(launched):
    seed, results = launched
    for rank, out in enumerate(results_of(results, "flagged")):
        where = f"seed {seed}, rank {rank}: {out}"
        for how in ("negated", "conjugated"):
            assert out[how] <= TOL, where
            assert out[how + " grads kept"] == 0.0, where


def test_collectives_refuse_flagged_tensors_and_the_digest_reads_values():
    """``real_pairs`` (what every collective of DDP, ZeRO and fully_shard carries) refuses a lazily
    negated or conjugated tensor (a negated one was carried as its memory, silently); the
    replica check's digest weighs values (it raised on such a parameter)."""
    from fusedist._dtypes import real_pairs
    from fusedist.reliability.param_check import tensor_digest

    x = torch.randn(5)
    z = torch.randn(6, dtype=torch.complex64)
    for flagged, kind in ((torch._neg_view(x.clone()), "negated"), (z.conj(), "conjugated"),
                          (torch._neg_view(z.clone()), "negated")):
        with pytest.raises(ValueError, match=f"lazily {kind} view"):
            real_pairs(flagged)
    assert real_pairs(z).shape == (12,) and real_pairs(x) is x
    for flagged, plain in ((torch._neg_view(-x), x), (z.conj_physical().conj(), z), (torch._neg_view(-z), z)):
        assert torch.equal(flagged, plain)
        assert tensor_digest(flagged).item() == tensor_digest(plain).item()
