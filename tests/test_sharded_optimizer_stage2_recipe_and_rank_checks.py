"""fusedist.ZeroRedundancyOptimizer against torch, world 2, gloo, one launch:

* torch's recipe -- the optimizer built over a subset of the model's parameters, the rest added
  with ``add_param_group`` -- works in stage 2 (Note [stage 2 completed by add_param_group] in
  fusedist/zero/deferred_stage2.py): the added group's gradients are reduce-scattered into the
  shards like the others', the weights follow torch's DDP + AdamW with the same two param groups
  (what torch's ZeroRedundancyOptimizer built by the recipe steps), and a shard checkpoint loads
  into a second optimizer built so, which steps as the first.
  It was refused at construction.
* An empty parameter list on one rank (torch's own refusal in ``Optimizer.__init__``) fails
  every rank at once, naming the rank and torch's message (Note [torch's refusals before the
  communicator is known] in fusedist/zero/param_checks.py); the other rank waited until the stall
  timeout (``FUSEDIST_TIMEOUT_S``, 15 s here).
* Without DDP, an optimizer that held frozen parameters compares the ranks' sharded parameters in
  the GradScaler's found-inf / norm all-reduce, not in an all-reduce of its own (Note [one
  comparison a step] in fusedist/zero/trainable_check.py), with the same detection;
  ``gradient_slices()`` compares too (it joined a parameter unfrozen on one rank alone, silently).
  A parameter unfrozen on one rank joins only after the comparison: the refusal leaves every
  rank's optimizer as it was (the unfreezing rank had grown its partition, and the run could not
  go on), and training goes on as torch's AdamW once the rank freezes it again (Note [parameters
  join after the comparison]). Where reading the verdict would synchronize with an accelerator
  (simulated here), no comparison result is read on the host in a step where nothing joins; a
  step whose ranks differ applies nothing, and the next step raises on every rank (Note [the
  comparison read without a synchronization]); the run trains as torch's AdamW otherwise.
  A step that applied nothing so (skipped, or refused on every rank) leaves an LR scheduler's
  first step warning "before `optimizer.step()`", as torch's does after a step its GradScaler
  skipped or refused (Note [a refused or skipped sharded step and the LR scheduler]), also with
  the scheduler built on a framework's wrapper of the optimizer (the flag is the wrapper's; the
  decision was kept on the wrapper, where the optimizer's step never found it, and no warning came).
* A stage-1 optimizer following a module wrapped again is seen through a framework wrapper that
  copied its ``__dict__`` with its new DDP model (``ddp`` is shared state), and steps from the
  newer wrapper's gradient buckets, without a copy of its own (Note [the buckets of a newer
  wrapper] in fusedist/zero/shards.py).

Tolerance 1e-5 absolute: a few AdamW steps (lr <= 0.1) in fp32 on parameters of magnitude ~0.5;
sharded and torch's updates differ in summation order only (~1e-7).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import models
from shared_rank_launch import launch_for_selected, results_of

TOL = 1e-5
SEED = 20261207
TIMEOUT_S = 15
PROMPT_S = TIMEOUT_S / 2


def _net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _batch(seed, step, rank):
    g = torch.Generator().manual_seed(seed * 31 + step * 7 + rank)
    return torch.randn(3, 5, generator=g), torch.randn(3, 3, generator=g)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _recipe(module, zero_cls, **kw):
    """torch's two-call recipe: the body at construction, the head (its own lr) added."""
    opt = zero_cls(list(module[0].parameters()), optimizer_class=torch.optim.AdamW, lr=0.01, **kw)
    opt.add_param_group({"params": list(module[2].parameters()), "lr": 0.1})
    return opt


def _stage2_recipe(rank, world, seed):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import fusedist

    out = {}
    # (torch's ZeroRedundancyOptimizer built by the recipe steps as AdamW with these two groups;
    # importing it costs seconds of TorchScript compilation per rank)
    ref = TorchDDP(_net(seed))
    ref_opt = torch.optim.AdamW([{"params": list(ref.module[0].parameters())},
                                 {"params": list(ref.module[2].parameters()), "lr": 0.1}], lr=0.01)
    ours = fusedist.DistributedDataParallel(_net(seed), bucket_cap_mb=0.0001)  # several buckets
    opt = _recipe(ours.module, fusedist.ZeroRedundancyOptimizer, stage=2)
    diffs, grads_none, shards = [], True, True
    for step in range(3):
        x, y = _batch(seed, step, rank)
        for model, o in ((ref, ref_opt), (ours, opt)):
            o.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if o is opt:
                grads_none &= all(p.grad is None for p in ours.parameters())  # stage 2: shards only
                shards &= sum(t.numel() for t in opt.gradient_shards().values()) > 0
            o.step()
        diffs.append((_flat(ours.module) - _flat(ref.module)).abs().max().item())
        if step == 1:
            everyone = [None] * world
            dist.all_gather_object(everyone, opt.shard_state_dict())
            resumed_model = fusedist.DistributedDataParallel(copy.deepcopy(ours.module), bucket_cap_mb=0.0001)
    out["diffs"], out["grads none"], out["shards"] = diffs, grads_none, shards
    out["every parameter sharded"] = (opt.memory_stats()["shard_elements"] * world
                                      >= sum(p.numel() for p in ours.parameters()))
    # The checkpoint of step 2 loads into an optimizer built by the same recipe (on a copy of
    # the model as it was then): its third step is the first optimizer's.
    resumed = _recipe(resumed_model.module, fusedist.ZeroRedundancyOptimizer, stage=2)
    resumed.load_state_dict(everyone)
    x, y = _batch(seed, 2, rank)
    nn.functional.mse_loss(resumed_model(x), y).backward()
    resumed.step()
    out["resumed"] = (_flat(resumed_model.module) - _flat(ours.module)).abs().max().item()
    # Stepped before the set is complete, or completed after the state exists: refused.
    other = fusedist.DistributedDataParallel(_net(seed))
    part = fusedist.ZeroRedundancyOptimizer(list(other.module[0].parameters()), torch.optim.AdamW, stage=2)
    nn.functional.mse_loss(other(x), y).backward()
    out["step before"] = models.raised_timed(part.step)[0]
    part.optim  # (the state, over the subset)
    rest = list(other.module[2].parameters())
    out["added after state"] = models.raised_timed(lambda: part.add_param_group({"params": rest}))
    return out


def _empty_on_one_rank(rank, world, seed):
    import fusedist

    model = fusedist.DistributedDataParallel(_net(seed))
    params = [] if rank == 1 else list(model.parameters())
    return models.raised_timed(lambda: fusedist.ZeroRedundancyOptimizer(params, torch.optim.AdamW, lr=0.01))


def _counting(comm):
    """The tags of ``comm``'s all-reduces from now on (a list that grows)."""
    tags, original = [], comm.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        tags.append(kwargs.get("tag"))
        return original(tensor, *args, **kwargs)

    comm.all_reduce = all_reduce
    return tags


def _average(model, world):
    import torch.distributed as dist

    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= world


def _scaled_without_ddp(rank, world, seed):
    """No DDP, the head frozen at construction and unfrozen after step 1 on every rank, steps with a
    GradScaler and a clip: torch's AdamW on the global batch; one all-reduce per step besides the
    parameter gathers. Then the head of a fresh optimizer unfrozen on rank 1 only is refused by
    unscale_ on both ranks, and by gradient_slices()."""
    import fusedist

    out = {}
    ref, model = _net(seed), _net(seed)
    for m in (ref, model):
        m[2].requires_grad_(False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    opt = fusedist.ZeroRedundancyOptimizer(list(model.parameters()), torch.optim.AdamW, lr=0.01)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 6)
    scaler = fusedist.amp.GradScaler("cpu", init_scale=2.0 ** 6)
    tags = _counting(opt.comm)
    diffs, per_step = [], []
    for step in range(3):
        if step == 1:
            for m in (ref, model):
                m[2].requires_grad_(True)
        x, y = _batch(seed, step, rank)
        for m, o, s in ((ref, ref_opt, ref_scaler), (model, opt, scaler)):
            before = len(tags)
            o.zero_grad()
            s.scale(nn.functional.mse_loss(m(x), y)).backward()
            _average(m, world)
            s.unscale_(o)
            if o is opt:
                o.clip_grad_norm_(0.5)
            else:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            s.step(o)
            s.update()
        per_step.append(tags[before:])
        diffs.append((_flat(model) - _flat(ref)).abs().max().item())
    out["diffs"], out["tags"] = diffs, per_step

    model = _net(seed)
    model[2].requires_grad_(False)
    opt = fusedist.ZeroRedundancyOptimizer(list(model.parameters()), torch.optim.AdamW, lr=0.01)
    if rank == 1:
        model[2].requires_grad_(True)
    x, y = _batch(seed, 0, rank)
    scaler = fusedist.amp.GradScaler("cpu")
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    out["slices"] = models.raised_timed(opt.gradient_slices)
    out["unscale"] = models.raised_timed(lambda: scaler.unscale_(opt))
    return out


class _CopyingWrapper:
    """A framework's wrapper as earlier Lightning versions made it: the optimizer's ``__dict__``
    copied, the optimizer's class a second base."""

    def __init__(self, optimizer):
        self.__dict__ = dict(optimizer.__dict__)
        self._optimizer = optimizer
        self.__class__ = type("Wrapped", (self.__class__, optimizer.__class__), {})

    def step(self, closure=None):
        return self._optimizer.step(closure)


def _scaled_step(m, o, s, x, y, world, only=None):
    """One step with a GradScaler, the gradients of ``only`` (default all) averaged over the ranks."""
    o.zero_grad()
    s.scale(nn.functional.mse_loss(m(x), y)).backward()
    _average(m if only is None else only, world)
    s.unscale_(o)
    s.step(o)
    s.update()


def _zero_state(opt):
    """What a refused step must leave as it was: the sharded set, the shard sizes, the inner state."""
    inner = torch.cat([v.detach().reshape(-1).float() for st in opt.inner.state.values() for v in st.values()
                       if isinstance(v, torch.Tensor)])
    return list(opt._trainable), dict(opt._partition.shard_numel), inner.clone()


def _same_state(a, b):
    return a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def _refused_unfreeze_changes_nothing(rank, world, seed):
    """No DDP, head frozen at construction: rank 1 unfreezes it alone before unscale_, which is
    refused on both ranks; every rank's optimizer is as it was, and once rank 1 freezes it again
    both train on as torch's AdamW (which never saw the refused step)."""
    import fusedist

    ref, model = _net(seed), _net(seed)
    for m in (ref, model):
        m[2].requires_grad_(False)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    opt = fusedist.ZeroRedundancyOptimizer(list(model.parameters()), torch.optim.AdamW, lr=0.01)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 6)
    scaler = fusedist.amp.GradScaler("cpu", init_scale=2.0 ** 6)
    x, y = _batch(seed, 0, rank)
    for m, o, s in ((ref, ref_opt, ref_scaler), (model, opt, scaler)):
        _scaled_step(m, o, s, x, y, world)
    out = {}
    if rank == 1:
        model[2].requires_grad_(True)
    x, y = _batch(seed, 1, rank)
    opt.zero_grad()
    before, weights = _zero_state(opt), _flat(model).clone()
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    _average(model[0], world)  # (the body: the gradients both ranks have)
    out["refused"] = models.raised_timed(lambda: scaler.unscale_(opt))
    out["unchanged"] = _same_state(before, _zero_state(opt)) and torch.equal(weights, _flat(model))
    model[2].requires_grad_(False)
    model[2].weight.grad = model[2].bias.grad = None
    scaler = fusedist.amp.GradScaler("cpu", init_scale=2.0 ** 6)  # (the refused unscale_ left it mid-step)
    diffs = []
    for step in (2, 3):
        x, y = _batch(seed, step, rank)
        for m, o, s in ((ref, ref_opt, ref_scaler), (model, opt, scaler)):
            _scaled_step(m, o, s, x, y, world)
        diffs.append((_flat(model) - _flat(ref)).abs().max().item())
    out["diffs"] = diffs
    return out


_HOST_READS = (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
               torch.Tensor.__float__, torch.Tensor.__index__)


class _ComparisonReads(torch.overrides.TorchFunctionMode):
    """Counts host reads (``tolist``, ``item``, ``bool`` ...) of what the optimizer's all-reduces
    wrote and of what is computed from it, while ``window`` is open: each one would synchronize
    the host with an accelerator."""

    def __init__(self):
        super().__init__()
        self.tainted, self.window, self.reads = {}, 0, 0

    def taint(self, t):
        self.tainted[id(t)] = t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hit = any(isinstance(a, torch.Tensor) and id(a) in self.tainted for a in (*args, *kwargs.values()))
        if hit and self.window and func in _HOST_READS:
            self.reads += 1
        out = func(*args, **kwargs)
        if hit:
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor):
                    self.taint(o)
        return out


def _opening(reads, fn):
    def opened(*args, **kwargs):
        reads.window += 1
        try:
            return fn(*args, **kwargs)
        finally:
            reads.window -= 1
    return opened


def _verdict_on_the_device(rank, world, seed):
    """As on an accelerator (reading the comparison's verdict would synchronize): steps without
    and with a GradScaler read no comparison result in the comparing calls where nothing joins,
    and train as torch's AdamW, the head unfrozen on every rank at step 3; then the head of a
    fresh optimizer unfrozen on rank 1 only: that step applies nothing and grows nothing, and the
    next step is refused on every rank."""
    import fusedist
    from fusedist.zero import grow, trainable_check

    cls = fusedist.ZeroRedundancyOptimizer
    saved = trainable_check.reads_for_free, grow.join_pending, cls._fusedist_reduce_found_inf_and_norm
    reads = _ComparisonReads()
    trainable_check.reads_for_free = lambda flag: False
    grow.join_pending = _opening(reads, saved[1])
    cls._fusedist_reduce_found_inf_and_norm = _opening(reads, saved[2])
    out = {"reads": []}
    try:
        ref, model = _net(seed), _net(seed)
        for m in (ref, model):
            m[2].requires_grad_(False)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
        opt = cls(list(model.parameters()), torch.optim.AdamW, lr=0.01)
        original = opt.comm.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            result = original(tensor, *args, **kwargs)
            reads.taint(tensor)
            return result

        opt.comm.all_reduce = all_reduce
        ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 6)
        scaler = fusedist.amp.GradScaler("cpu", init_scale=2.0 ** 6)
        diffs = []
        with reads:
            for step in range(5):
                if step == 3:
                    for m in (ref, model):
                        m[2].requires_grad_(True)
                x, y = _batch(seed, step, rank)
                reads.reads, reads.tainted = 0, {}
                for m, o, s in ((ref, ref_opt, ref_scaler), (model, opt, scaler)):
                    if step < 2:
                        o.zero_grad()
                        nn.functional.mse_loss(m(x), y).backward()
                        _average(m, world)
                        o.step()
                    else:
                        _scaled_step(m, o, s, x, y, world)
                out["reads"].append(reads.reads)
                diffs.append((_flat(model) - _flat(ref)).abs().max().item())
        out["diffs"] = diffs

        model = _net(seed)
        model[2].requires_grad_(False)
        opt = cls(list(model.parameters()), torch.optim.AdamW, lr=0.01)
        x, y = _batch(seed, 0, rank)
        nn.functional.mse_loss(model(x), y).backward()
        _average(model, world)
        opt.step()
        if rank == 1:
            model[2].requires_grad_(True)
        opt.zero_grad()
        before, weights = _zero_state(opt), _flat(model).clone()
        nn.functional.mse_loss(model(x), y).backward()
        _average(model[0], world)
        out["compared"] = models.raised_timed(opt.step)[0]
        out["unchanged"] = _same_state(before, _zero_state(opt)) and torch.equal(weights, _flat(model))
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        _average(model[0], world)
        out["next step"] = models.raised_timed(opt.step)
    finally:
        trainable_check.reads_for_free, grow.join_pending, cls._fusedist_reduce_found_inf_and_norm = saved
    return out


def _scheduler_warns(scheduler) -> bool:
    """Whether ``scheduler.step()`` warns that it came before any optimizer step."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler.step()
    return any("before `optimizer.step()`" in str(w.message) for w in caught)


def _torchs_first_step_applied_nothing(rank, world, seed):
    """torch's schedule after a first step its GradScaler skipped (an overflow) or refused (no
    gradients): the flag stays unset and the schedule warns."""
    warned = []
    for overflow in (True, False):
        model = _net(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 6)
        x, y = _batch(seed, 0, rank)
        if overflow:
            scaler.scale(nn.functional.mse_loss(model(x), y) * float("inf")).backward()
        models.raised(lambda: scaler.step(opt))  # (refused: "No inf checks were recorded")
        warned.append(_scheduler_warns(scheduler))
    return warned


def _scheduler_after_a_step_that_applied_nothing(rank, world, seed):
    """The head of an optimizer without DDP unfrozen on rank 1 only, an LR scheduler built after a
    first step: the next step applies nothing -- skipped by the comparison verdict kept on the
    device (an accelerator, simulated), or refused on every rank (gloo) -- and the scheduler's first
    step warns as torch's does after a step its GradScaler skipped or refused; after a step that
    applied its update (the verdict kept, the ranks alike) it does not. Also with the scheduler
    built on a framework's wrapper of the optimizer, stepped through the wrapper."""
    import fusedist
    from fusedist.zero import trainable_check

    def first_steps(on_device, differ, wrapped=False):
        model = _net(seed)
        model[2].requires_grad_(False)
        opt = fusedist.ZeroRedundancyOptimizer(list(model.parameters()), torch.optim.AdamW, lr=0.01)
        x, y = _batch(seed, 0, rank)
        nn.functional.mse_loss(model(x), y).backward()
        _average(model, world)
        opt.step()
        if wrapped:
            opt = _CopyingWrapper(opt)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 1)
        if differ and rank == 1:
            model[2].requires_grad_(True)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        _average(model[0], world)
        saved = trainable_check.reads_for_free
        if on_device:
            trainable_check.reads_for_free = lambda flag: False
        try:
            errors = [models.raised(opt.step)]
            warned = _scheduler_warns(scheduler)
            if on_device and differ:  # (the kept verdict refuses the next step on every rank)
                errors.append(models.raised(opt.step))
        finally:
            trainable_check.reads_for_free = saved
        return [e.split(":")[0] for e in errors], warned

    return {"skipped": first_steps(True, True), "refused": first_steps(False, True),
            "applied": first_steps(True, False), "wrapped skipped": first_steps(True, True, True),
            "wrapped refused": first_steps(False, True, True), "wrapped applied": first_steps(True, False, True)}


def _followed_wrapper(rank, world, seed):
    import fusedist

    ref = torch.nn.parallel.DistributedDataParallel(_net(seed))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    module = _net(seed)
    ours = fusedist.DistributedDataParallel(module, bucket_cap_mb=0.0001)
    opt = fusedist.ZeroRedundancyOptimizer(module.parameters(), torch.optim.AdamW, lr=0.05)
    wrapped = _CopyingWrapper(opt)
    diffs = []
    for step in range(4):
        if step == 2:
            ours = fusedist.DistributedDataParallel(module)  # the module wrapped again
        x, y = _batch(seed, step, rank)
        for m, o in ((ref, ref_opt), (ours, wrapped)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
        diffs.append((_flat(module) - _flat(ref.module)).abs().max().item())
    buffers = {t.untyped_storage().data_ptr() for t in ours.reducer.layout.buffers.values()}
    pieces = [t for g in opt.inner.param_groups for t in g["params"]]
    return {"diffs": diffs, "ddp": wrapped.ddp is ours and opt.ddp is ours,
            "aliased": all(t.grad.untyped_storage().data_ptr() in buffers for t in pieces)}


SCENARIOS = {
    "test_stage2_takes_torchs_recipe_of_a_subset_then_add_param_group": {"recipe": (_stage2_recipe, (SEED,))},
    "test_empty_parameter_list_on_one_rank_fails_every_rank_at_once": {"empty": (_empty_on_one_rank, (SEED,))},
    "test_trainable_comparison_rides_the_found_inf_all_reduce": {"scaled": (_scaled_without_ddp, (SEED,))},
    "test_parameter_unfrozen_on_one_rank_is_refused_before_it_joins": {
        "refused unfreeze": (_refused_unfreeze_changes_nothing, (SEED,))},
    "test_comparison_verdict_kept_on_the_device_until_the_next_step": {
        "device verdict": (_verdict_on_the_device, (SEED,))},
    "test_optimizer_following_a_rewrapped_module_shares_ddp_and_its_buckets": {
        "followed": (_followed_wrapper, (SEED,))},
    "test_scheduler_after_a_step_that_applied_nothing_warns_as_torchs": {
        "torch nothing applied": (_torchs_first_step_applied_nothing, (SEED,)),
        "nothing applied": (_scheduler_after_a_step_that_applied_nothing, (SEED,))},
}


@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, SCENARIOS, 2, timeout=240, env={"FUSEDIST_TIMEOUT_S": str(TIMEOUT_S)})


def test_stage2_takes_torchs_recipe_of_a_subset_then_add_param_group(launched):
    for rank, out in enumerate(results_of(launched, "recipe")):
        assert max(out["diffs"]) < TOL, (rank, out)
        assert out["resumed"] < TOL, (rank, out)
        assert out["grads none"] and out["shards"] and out["every parameter sharded"], (rank, out)
        step, added = out["step before"], out["added after state"][0]
        assert step.startswith("RuntimeError") and "missing: ['2.weight', '2.bias']" in step, step
        assert added is not None and "optimizer state was created over the subset" in added, added


def test_empty_parameter_list_on_one_rank_fails_every_rank_at_once(launched):
    for rank, (error, seconds) in enumerate(results_of(launched, "empty")):
        assert seconds < PROMPT_S, (rank, seconds, error)
        assert error is not None and error.startswith("RankMismatchError"), (rank, error)
        assert f"this is rank {rank}" in error and "ranks [1]: this rank's own refusal" in error, error
        assert "optimizer got an empty parameter list" in error, error


def test_trainable_comparison_rides_the_found_inf_all_reduce(launched):
    for rank, out in enumerate(results_of(launched, "scaled")):
        assert max(out["diffs"]) < TOL, (rank, out["diffs"])
        # each step: the unscale_'s found-inf and norm all-reduce, nothing else (the clip reuses its norm) --
        # but the first step's comparison of the gradients (Note [gradients nobody averaged] in
        # fusedist/zero/grad_agreement.py)
        from fusedist.zero.grad_agreement import OP as COMPARED

        assert out["tags"] == [["zero found_inf and grad norm", COMPARED]] + [["zero found_inf and grad norm"]] * 2, \
            out["tags"]
        for name in ("slices", "unscale"):
            error, seconds = out[name]
            assert seconds < PROMPT_S, (rank, name, seconds, error)
            assert error is not None and error.startswith("RankMismatchError"), (rank, name, error)
            assert "ranks [1]: parameter 2 (shape (3, 7)) trainable" in error, (name, error)


def test_parameter_unfrozen_on_one_rank_is_refused_before_it_joins(launched):
    for rank, out in enumerate(results_of(launched, "refused unfreeze")):
        error, seconds = out["refused"]
        assert seconds < PROMPT_S, (rank, seconds, error)
        assert error is not None and error.startswith("RankMismatchError"), (rank, error)
        assert "ranks [1]: parameter 2 (shape (3, 7)) trainable" in error, error
        assert out["unchanged"], f"rank {rank}: the refused unscale_ changed the optimizer"
        assert max(out["diffs"]) < TOL, (rank, out["diffs"])


def test_comparison_verdict_kept_on_the_device_until_the_next_step(launched):
    for rank, out in enumerate(results_of(launched, "device verdict")):
        # no host read of a comparison result where nothing joins (step 3 joins the head: read once)
        assert [out["reads"][i] for i in (0, 1, 2, 4)] == [0, 0, 0, 0], (rank, out["reads"])
        assert max(out["diffs"]) < TOL, (rank, out["diffs"])
        assert out["compared"] is None, (rank, out["compared"])
        assert out["unchanged"], f"rank {rank}: the step whose ranks differ changed the optimizer"
        error, seconds = out["next step"]
        assert seconds < PROMPT_S, (rank, seconds, error)
        assert error is not None and error.startswith("RankMismatchError"), (rank, error)
        assert "ranks [1]: parameter 2 (shape (3, 7)) trainable" in error, error


def test_optimizer_following_a_rewrapped_module_shares_ddp_and_its_buckets(launched):
    for rank, out in enumerate(results_of(launched, "followed")):
        assert max(out["diffs"]) < TOL, (rank, out)
        assert out["ddp"], "a wrapper that copied the optimizer's __dict__ still saw the retired DDP model"
        assert out["aliased"], "the optimizer stepped from a gradient copy of its own, not the newer buckets"


def test_scheduler_after_a_step_that_applied_nothing_warns_as_torchs(launched):
    for rank, (torchs, ours) in enumerate(zip(results_of(launched, "torch nothing applied"),
                                              results_of(launched, "nothing applied"))):
        assert torchs == [True, True], f"rank {rank}: torch's schedule warned {torchs} (skipped, refused)"
        assert ours["skipped"] == (["no error", "RankMismatchError"], True), (rank, ours)
        assert ours["refused"] == (["RankMismatchError"], True), (rank, ours)
        assert ours["applied"] == (["no error"], False), (rank, ours)
        for how in ("skipped", "refused", "applied"):  # (the scheduler built on a framework's wrapper)
            assert ours[f"wrapped {how}"] == ours[how], (rank, how, ours)
