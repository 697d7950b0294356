"""fusedist.ZeroRedundancyOptimizer as a drop-in for torch.distributed.optim.ZeroRedundancyOptimizer:
what a training script written for torch's does, run with both, on fresh random inputs (the
seed is in every assertion message).

* One spawn at 3 ranks (odd: padded shards) runs the training checks: the constructor forms
  torch users write (``optimizer_class=`` with param-group dicts of their own lr / weight decay /
  betas, ``parameters_as_bucket_view``) over SGD with Nesterov momentum, Adam with amsgrad,
  RMSprop, Adagrad and an optimizer that writes its groups in ``step()`` (its own lr decay,
  restarted from the constructor's value at every step; torch copies the groups back) and keeps
  a string in its state (consolidating it on the last rank raised a TypeError there), LR
  schedulers editing ``param_groups`` (OneCycleLR, ReduceLROnPlateau),
  ``step(closure)``, ``add_param_group`` mid-training, ``no_sync`` accumulation, state dicts
  traded with torch's ZeroRedundancyOptimizer both ways (``optimizer_class`` given as a
  ``functools.partial``: consolidation failed on it; a zero-element parameter's state in
  torch's state dict was refused), and ``zero_grad(set_to_none=False)`` with a layer no rank
  uses in some steps, or followed by steps without a backward (stage 2 skipped them; torch
  steps the zero gradients), the optimizer's
  state-dict hooks (never called), and torch's attributes (``rank``, ``global_rank``,
  ``world_size``, ``optim``: the shard's optimizer, also read before the first step).
* One spawn at 2 ranks checks the refusals: parameter lists that differ between ranks (gloo
  aborted the process, or the ranks silently stepped each other's elements), a parameter
  given twice, a partial of a non-elementwise optimizer, and torch's ``Join`` over torch's
  DDP (torch's own message was "Using join context manager with multiple process groups");
  and, without a DDP model, a step on a rank with no gradients while another has some. The same
  spawn builds an optimizer again for the same model (stage 1 and 2, against torch's AdamW
  rebuilt alike): the model kept every optimizer built for it alive, with the hooks of its
  overlapped gathers, and a second stage-2 optimizer was refused. It also deep-copies and
  pickles the model right after an overlapped step, the gathers held back by a rank that steps
  late: the copy held the other ranks' slices from before the step.
* One process: a step or clip compiled with ``fullgraph=True`` is refused with the reason it
  runs eagerly; an inner torch optimizer built with ``fused=True`` steps under the GradScaler as
  torch's does with torch's scaler (overflowed step skipped on the device).

Tolerance: fp32 throughout, 1e-5 absolute on parameters of magnitude ~0.5 after at most 8
steps. The two sides compute the same updates; they differ in the order gradients are summed
(gloo all-reduce vs reduce-scatter, 3 ranks) and in how elementwise updates are batched (the
flat shard vs per-parameter tensors), i.e. a few fp32 ulps per step (measured: <= 6e-8). Every
defect checked here moves a parameter by ~1e-3 or more (lr >= 5e-3, weight decay 0.1).
"""

import contextlib
import copy
import functools
import io
import random

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed

TOL = 1e-5
# Adam's and RMSprop's first update is g / (c·|g| + eps)-like (Adam c = 1, centered RMSprop
# c ~ 0.1), whose slope at g = 0 is 1/eps: a gradient element within eps/c of zero has its
# summation-order error (a few ulps of the gradients, ~1e-8) amplified to lr·1e-8/eps in the
# parameter. At eps=1e-5 that is up to 1e-5 with lr=0.01 (RMSprop was 1.06e-5 off for seed
# 335706219); at eps=1e-3 it is <= 5e-7 even at OneCycleLR's 0.05 (measured over 9 seeds:
# <= 3e-7). The updates stay nonlinear in g, so a wrong state or shard still moves a
# parameter by ~lr.
EPS = 1e-3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 13)
        self.b = nn.Linear(13, 5)
        self.c = nn.Linear(5, 3)
        # No elements: torch's optimizers give it state (empty moments, a step count), which a
        # state dict carries; a shard holds no slice of it.
        self.empty = nn.Parameter(torch.zeros(0, 3))

    def forward(self, x, skip_b=False):
        h = torch.tanh(self.a(x))
        h = h[:, :5] if skip_b else torch.tanh(self.b(h))
        return self.c(h) + self.empty.sum()


class _SelfDecayingSGD(torch.optim.Optimizer):
    """An elementwise optimizer that writes its param groups in ``step()`` (its own lr decay, as
    D-Adaptation's ``d`` or a schedule-free optimizer's sums), with a per-parameter state of its
    own, a string among it: torch's ZeroRedundancyOptimizer copies the groups back after every
    step, and its state dict carries any value."""

    _fusedist_elementwise = True

    def __init__(self, params, lr=0.1, decay=0.8):
        super().__init__(params, dict(lr=lr, decay=decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["rule"] = "peak-normalized"
                    peak = self.state[p].setdefault("peak", torch.zeros_like(p))
                    torch.maximum(peak, p.grad.abs(), out=peak)
                    p.add_(p.grad / (1.0 + peak), alpha=-group["lr"])
            group["lr"] *= group["decay"]


def _net(seed):
    torch.manual_seed(seed)
    return Net()


def _batch(seed, step, rank, world_size, n=4):
    g = torch.Generator().manual_seed(seed * 31 + step)
    x, y = torch.randn(world_size * n, 7, generator=g), torch.randn(world_size * n, 3, generator=g)
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _groups(m, betas=False):
    """Two param groups with their own hyperparameters, as a torch script writes them."""
    first = {"params": [m.a.weight, m.b.weight], "lr": 0.02, "weight_decay": 0.05}
    if betas:
        first["betas"] = (0.8, 0.95)
    return [first, {"params": [m.a.bias, m.b.bias, m.c.weight, m.c.bias, m.empty], "lr": 0.005}]


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _train(model, opt, seed, rank, ws, steps, *, first=0, sched=None, closure=False, accumulate=1,
           skip_b_from=None, set_to_none=True, steps_without_backward=0):
    for step in range(first, first + steps):
        opt.zero_grad(set_to_none=set_to_none)
        skip = skip_b_from is not None and step >= skip_b_from
        for k in range(accumulate):
            x, y = _batch(seed, step * 10 + k, rank, ws)
            if k < accumulate - 1:
                with model.no_sync():
                    nn.functional.mse_loss(model(x), y).backward()
            elif closure:
                def fn():
                    opt.zero_grad()
                    loss = nn.functional.mse_loss(model(x, skip), y)
                    loss.backward()
                    return loss
            else:
                nn.functional.mse_loss(model(x, skip), y).backward()
        loss = opt.step(fn) if closure else opt.step()
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            sched.step(10.0 - step if step < 2 else 10.0)  # the same metric on every rank
        elif sched is not None:
            sched.step()
    for _ in range(steps_without_backward):  # torch steps the zero gradients zero_grad(False) left
        opt.zero_grad(set_to_none=set_to_none)
        loss = opt.step()
    return loss


def consolidated_state_differences(failures, what, opt, ref_opt, rank, ws):
    """Consolidate both optimizers on the last rank; there, append to ``failures`` how fusedist's
    full state dict differs from torch's."""
    ref_opt.consolidate_state_dict(to=ws - 1)
    try:
        opt.consolidate_state_dict(to=ws - 1)
    except Exception as exc:  # noqa: BLE001 - the test reports it (the collective ended on every rank)
        failures.append(f"{what} consolidate_state_dict: {type(exc).__name__}: {exc}")
        return
    if rank != ws - 1:
        return
    mine, theirs = opt.state_dict(), ref_opt.state_dict()
    if mine["param_groups"] != theirs["param_groups"]:
        failures.append(f"{what} consolidated param_groups: fusedist {mine['param_groups']}, "
                        f"torch {theirs['param_groups']}")
    for index, want in theirs["state"].items():
        got = mine["state"].get(index, {})
        if sorted(got) != sorted(want):
            failures.append(f"{what} consolidated state {index}: keys {sorted(got)}, torch {sorted(want)}")
            continue
        for key, value in want.items():
            same = (torch.allclose(got[key], value, rtol=0, atol=TOL) if isinstance(value, torch.Tensor)
                    else got[key] == value)
            if not same:
                failures.append(f"{what} consolidated state {index} {key!r}: {got[key]!r}, torch {value!r}")


def _training_worker(rank, ws, seed):
    import fusedist
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

    failures = []

    def close(what, got, want):
        err = (got - want).abs().max().item()
        if not err <= TOL:
            failures.append(f"{what}: max |fusedist - torch| = {err:.3g}")

    def torch_run(make_opt, steps, **kw):
        m = _net(seed)
        model = nn.parallel.DistributedDataParallel(m, find_unused_parameters=kw.pop("unused", False))
        opt = make_opt(m)
        sched = kw.pop("sched", None)
        _train(model, opt, seed, rank, ws, steps, sched=sched(opt) if sched else None, **kw)
        return m, opt

    def fusedist_run(make_opt, steps, **kw):
        m = _net(seed)
        model = fusedist.DistributedDataParallel(m, bucket_cap_mb=0.0005,
                                                 find_unused_parameters=kw.pop("unused", False))
        opt = make_opt(m)
        sched = kw.pop("sched", None)
        _train(model, opt, seed, rank, ws, steps, sched=sched(opt) if sched else None, **kw)
        return m, opt

    # Optimizer classes and constructor forms, against torch's ZeroRedundancyOptimizer.
    classes = [
        (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01), False),
        (torch.optim.Adam, dict(lr=0.01, amsgrad=True, eps=EPS), True),
        (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True, eps=EPS), False),
        (torch.optim.Adagrad, dict(lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1), False),
        (_SelfDecayingSGD, dict(lr=0.05), False),  # (its lr was reset to 0.05 before every step)
    ]
    for cls, kw, betas in classes:
        ref, ref_opt = torch_run(lambda m: TorchZeRO(_groups(m, betas), optimizer_class=cls, **kw), 4)
        for stage in (1, 2):
            got, opt = fusedist_run(lambda m: fusedist.ZeroRedundancyOptimizer(
                _groups(m, betas), optimizer_class=cls, stage=stage, parameters_as_bucket_view=True, **kw), 4)
            close(f"{cls.__name__} stage {stage}", _flat(got), _flat(ref))
            # torch's attributes, which scripts and frameworks read.
            for attr in ("rank", "global_rank", "world_size"):
                if getattr(opt, attr) != getattr(ref_opt, attr):
                    failures.append(f"{attr}: fusedist {getattr(opt, attr)!r}, torch {getattr(ref_opt, attr)!r}")
            if opt.parameters_as_bucket_view is not True:  # (given True; and always so here)
                failures.append(f"parameters_as_bucket_view: {opt.parameters_as_bucket_view!r}")
            if type(opt.optim) is not type(ref_opt.optim) or not opt.optim.state:
                failures.append(f"optim: fusedist {type(opt.optim).__name__} with {len(opt.optim.state)} states")
            mine, theirs = ([{k: v for k, v in g.items() if k != "params"} for g in o.optim.param_groups]
                            for o in (opt, ref_opt))
            if mine != theirs:
                failures.append(f"{cls.__name__} stage {stage} optim.param_groups: fusedist {mine}, torch {theirs}")
            mine, theirs = ([{k: v for k, v in g.items() if k != "params"} for g in o.param_groups]
                            for o in (opt, ref_opt))
            if mine != theirs:
                failures.append(f"{cls.__name__} stage {stage} param_groups: fusedist {mine}, torch {theirs}")
            if cls is _SelfDecayingSGD:  # consolidated on the last rank (its string state failed there)
                consolidated_state_differences(failures, f"{cls.__name__} stage {stage}", opt, ref_opt, rank, ws)

    adamw = dict(lr=0.01, weight_decay=0.1, eps=EPS)
    # torch's ``optim`` read before the first step, which makes it here: training is unchanged.
    def read_optim_first(opt):
        assert isinstance(opt.optim, torch.optim.AdamW) and not opt.optim.state
        return opt

    ref, _ = torch_run(lambda m: TorchZeRO(_groups(m), optimizer_class=torch.optim.AdamW, **adamw), 4)
    for stage in (1, 2):
        got, _ = fusedist_run(lambda m: read_optim_first(fusedist.ZeroRedundancyOptimizer(
            _groups(m), optimizer_class=torch.optim.AdamW, stage=stage, **adamw)), 4)
        close(f"optim read before the first step, stage {stage}", _flat(got), _flat(ref))
    # LR schedulers editing param_groups (OneCycleLR reads betas from the defaults: torch's
    # ZeroRedundancyOptimizer needs them passed, fusedist fills them in).
    for name, sched in {
        "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=10),
        "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.3),
    }.items():
        ref, _ = torch_run(lambda m: TorchZeRO(_groups(m), optimizer_class=torch.optim.AdamW,
                                               betas=(0.9, 0.999), **adamw), 5, sched=sched)
        got, _ = fusedist_run(lambda m: fusedist.ZeroRedundancyOptimizer(
            _groups(m), optimizer_class=torch.optim.AdamW, stage=2, **adamw), 5, sched=sched)
        close(name, _flat(got), _flat(ref))

    # step(closure) (the closure zeroes, runs forward and backward); no_sync accumulation.
    ref, _ = torch_run(lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), 3, closure=True)
    got, _ = fusedist_run(lambda m: fusedist.ZeroRedundancyOptimizer(
        m.parameters(), optimizer_class=torch.optim.SGD, stage=2, lr=0.05, momentum=0.9), 3, closure=True)
    close("step(closure)", _flat(got), _flat(ref))
    ref, _ = torch_run(lambda m: torch.optim.AdamW(m.parameters(), **adamw), 3, accumulate=3)
    got, _ = fusedist_run(lambda m: fusedist.ZeroRedundancyOptimizer(
        m.parameters(), optimizer_class=torch.optim.AdamW, stage=2, **adamw), 3, accumulate=3)
    close("no_sync accumulation", _flat(got), _flat(ref))

    # zero_grad(set_to_none=False) with a layer no rank uses from step 2 on: torch keeps its
    # gradient as zeros and AdamW still moves it (moments, weight decay); with the default
    # set_to_none=True torch skips it. Then two steps with no backward at all: after
    # zero_grad(set_to_none=False) torch steps every parameter's zero gradient (stage 2 returned
    # without stepping), after zero_grad() nothing.
    for set_to_none in (False, True):
        ref, _ = torch_run(lambda m: torch.optim.AdamW(m.parameters(), **adamw), 5, unused=True,
                           skip_b_from=2, set_to_none=set_to_none, steps_without_backward=2)
        for stage in (1, 2):
            got, _ = fusedist_run(lambda m: fusedist.ZeroRedundancyOptimizer(
                m.parameters(), optimizer_class=torch.optim.AdamW, stage=stage, **adamw), 5, unused=True,
                skip_b_from=2, set_to_none=set_to_none, steps_without_backward=2)
            close(f"zero_grad(set_to_none={set_to_none}), a layer unused, stage {stage}", _flat(got), _flat(ref))

    # State dicts both ways: torch's consolidated state into fusedist, fusedist's into torch's.
    tm, topt = torch_run(lambda m: TorchZeRO(_groups(m), optimizer_class=torch.optim.AdamW, **adamw), 3)
    # optimizer_class as a functools.partial (Hydra's `_partial_: true` configs give one).
    adamw_partial = functools.partial(torch.optim.AdamW, weight_decay=0.1, eps=EPS)
    fm, fopt = fusedist_run(lambda m: fusedist.ZeroRedundancyOptimizer(
        _groups(m), optimizer_class=adamw_partial, stage=2, lr=0.01), 3)
    close("3 steps", _flat(fm), _flat(tm))
    # Optimizer state-dict hooks run around state_dict() / load_state_dict(), as torch's.
    hooks_seen = []
    fopt.register_state_dict_pre_hook(lambda opt: hooks_seen.append("state_dict pre"))
    fopt.register_state_dict_post_hook(lambda opt, sd: {**sd, "saved_by": "hook"})
    topt.consolidate_state_dict(to=0)
    fopt.consolidate_state_dict(to=0)
    sds = [(_roundtrip(topt.state_dict()), _roundtrip(fopt.state_dict())) if rank == 0 else None]
    torch.distributed.broadcast_object_list(sds, 0)
    torch_sd, fusedist_sd = sds[0]
    if fusedist_sd.get("saved_by") != "hook" or (rank == 0 and hooks_seen != ["state_dict pre"]):
        failures.append(f"state_dict hooks: {hooks_seen}, keys {sorted(fusedist_sd)}")
    start = [p.detach().clone() for p in fm.parameters()]

    def resumed(make_opt, sd, runner):
        m = _net(seed)
        with torch.no_grad():
            for p, q in zip(m.parameters(), start):
                p.copy_(q)
        model = runner(m)
        opt = make_opt(m)
        loaded = []
        opt.register_load_state_dict_pre_hook(lambda opt, sd: loaded.append(sorted(sd)))
        opt.register_load_state_dict_post_hook(lambda opt: loaded.append("post"))
        opt.load_state_dict(copy.deepcopy(sd))  # torch's load empties other ranks' entries
        if loaded != [sorted(sd), "post"]:
            failures.append(f"load_state_dict hooks of {type(opt).__name__}: {loaded}")
        _train(model, opt, seed, rank, ws, 3, first=3)
        return m

    _train(nn.parallel.DistributedDataParallel(tm), topt, seed, rank, ws, 3, first=3)
    got = resumed(lambda m: fusedist.ZeroRedundancyOptimizer(_groups(m), optimizer_class=torch.optim.AdamW,
                                                              stage=1, **adamw),
                  torch_sd, lambda m: fusedist.DistributedDataParallel(m, bucket_cap_mb=0.0005))
    close("torch's state dict loaded into fusedist", _flat(got), _flat(tm))
    got = resumed(lambda m: TorchZeRO(_groups(m), optimizer_class=torch.optim.AdamW, **adamw),
                  fusedist_sd, nn.parallel.DistributedDataParallel)
    close("fusedist's state dict loaded into torch's", _flat(got), _flat(tm))

    # add_param_group mid-training: a frozen head unfrozen after 3 steps, its own lr.
    def unfreeze(make_opt, wrap):
        m = _net(seed)
        m.c.requires_grad_(False)
        model = wrap(m)
        opt = make_opt([p for p in m.parameters() if p.requires_grad])
        for step in range(6):
            if step == 3:
                m.c.requires_grad_(True)
                opt.add_param_group({"params": list(m.c.parameters()), "lr": 0.03, "weight_decay": 0.0})
            x, y = _batch(seed, step, rank, ws)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            if isinstance(opt, TorchZeRO):  # (torch DDP would not average the unfrozen head)
                for p in m.parameters():
                    if p.grad is not None:
                        torch.distributed.all_reduce(p.grad)
                        p.grad.div_(ws)
            opt.step()
        return m

    ref = unfreeze(lambda ps: TorchZeRO(ps, optimizer_class=torch.optim.AdamW, **adamw), lambda m: m)
    for stage in (1, 2):
        got = unfreeze(lambda ps: fusedist.ZeroRedundancyOptimizer(ps, optimizer_class=torch.optim.AdamW,
                                                                   stage=stage, **adamw),
                       lambda m: fusedist.DistributedDataParallel(m, bucket_cap_mb=0.0005))
        close(f"add_param_group after 3 steps, stage {stage}", _flat(got), _flat(ref))
    return failures


def test_training_matches_torch_zero():
    seed = random.randrange(2**31)
    results = run_distributed(_training_worker, 3, seed, timeout=240)
    failures = [f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs]
    assert not failures, f"seed {seed}:\n" + "\n".join(failures)


def _refusal_worker(rank, ws, seed):
    import fusedist

    def message(fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the test reads the type and message
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    m = _net(seed)
    params = [m.a.weight, m.a.bias, m.b.weight, m.b.bias, m.c.weight, m.c.bias]
    zero = fusedist.ZeroRedundancyOptimizer
    out = {}
    extra = nn.Parameter(torch.randn(5))
    # One parameter more on rank 1; the same list in another order; other param groups.
    out["extra"] = message(lambda: zero(params + ([extra] if rank == 1 else []),
                                        optimizer_class=torch.optim.AdamW, lr=0.1))
    out["order"] = message(lambda: zero(params[::-1] if rank == 1 else params,
                                        optimizer_class=torch.optim.AdamW, lr=0.1))
    out["groups"] = message(lambda: zero([{"params": params[:3]}, {"params": params[3:], "lr": 0.5}]
                                         if rank == 1 else params, optimizer_class=torch.optim.AdamW, lr=0.1))
    # The ranks are still in step after the refusals: a matching optimizer trains.
    opt = zero(params, optimizer_class=torch.optim.AdamW, lr=0.1)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    # Without a DDP model the gradients are the caller's: a step where only rank 0 has any
    # (rank 1 returned at once and left rank 0 in the parameter all-gather until the timeout). The
    # gradients were alike at the first step, so every rank now raises at this step's end, in step.
    for p in params:
        p.grad = torch.ones_like(p) if rank == 0 else None
    out["one rank's gradients"] = message(opt.step)
    opt.zero_grad()
    opt.step()  # no rank has gradients
    out["after"] = _flat(m).tolist()
    out["twice"] = message(lambda: zero([m.a.weight, m.a.bias, m.a.weight], optimizer_class=torch.optim.AdamW))
    out["twice added"] = message(lambda: opt.add_param_group({"params": [extra, extra]}))
    out["groups after"] = len(opt.param_groups)
    out["partial LBFGS"] = message(lambda: zero(params, optimizer_class=functools.partial(torch.optim.LBFGS)))
    # torch's Join over torch's DDP: a joined rank could not see the averaged gradients.
    from torch.distributed.algorithms.join import Join

    net = _net(seed)
    torch_ddp = nn.parallel.DistributedDataParallel(net)
    out["join torch ddp"] = message(
        lambda: Join([torch_ddp, zero(net.parameters(), optimizer_class=torch.optim.AdamW)]))
    out["no params key"] = message(lambda: zero([{"lr": 0.1}], optimizer_class=torch.optim.AdamW))
    return out


def _built_again(rank, ws, seed):
    """An optimizer built again for the same model (``opt = make_optimizer(model)`` to start from
    a fresh state), twice in four steps, against torch's AdamW rebuilt alike under torch's DDP;
    whether the replaced optimizers were freed; a replaced stage-2 optimizer's step, and a stage-2
    optimizer built while the one before holds gradients it has not stepped."""
    import gc
    import weakref

    import fusedist

    def message(fn):
        try:
            fn()
        except (RuntimeError, ValueError) as exc:
            return str(exc)
        return "no error"

    out = {}
    for stage in (1, 2):
        final = {}
        for kind in ("torch", "fusedist"):
            model = _net(seed)
            ddp = (nn.parallel.DistributedDataParallel(model) if kind == "torch"
                   else fusedist.DistributedDataParallel(model))

            def build():
                if kind == "torch":
                    return torch.optim.AdamW(ddp.parameters(), lr=0.01, weight_decay=0.1)
                return fusedist.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, stage=stage, lr=0.01,
                                                        weight_decay=0.1, overlap_param_gather=True)

            def hooks():  # the overlapped gathers' forward pre-hooks on the model
                return sum(len(m._forward_pre_hooks) for m in model.modules())

            opt, replaced = build(), []
            for step in range(4):
                if step in (1, 3):
                    replaced.append(weakref.ref(opt))
                    opt = build()
                x, y = _batch(seed, step, rank, ws)
                nn.functional.mse_loss(ddp(x), y).backward()
                opt.step()
                opt.zero_grad()
                if step == 0:
                    first_hooks = hooks()
            gc.collect()
            getattr(opt, "wait_for_params", lambda: None)()  # (the overlapped gathers of the last step)
            final[kind] = _flat(model)
            if kind == "fusedist":
                out[f"stage {stage} alive"] = sum(ref() is not None for ref in replaced)
                with torch.no_grad():
                    ddp(x)  # (a collected optimizer's hooks come off before the model's next forward)
                out[f"stage {stage} hooks"] = (first_hooks, hooks())
                newer = build()
                out[f"stage {stage} old step"] = message(opt.step)
                x, y = _batch(seed, 9, rank, ws)
                nn.functional.mse_loss(ddp(x), y).backward()
                out[f"stage {stage} unstepped"] = message(build)
                newer.step()
        out[f"stage {stage} diff"] = (final["torch"] - final["fusedist"]).abs().max().item()
    return out


def _copies_under_gathers_in_flight(rank, ws, seed):
    """A deep copy and a loaded pickle of the DDP model taken right after an overlapped step, while
    its parameter all-gathers are in flight (held back: rank 1 steps half a second late). The model is one
    Linear, whose own parameters are copied before its hooks are: each copy's parameters minus the
    model's once it waited for its gathers."""
    import pickle
    import time

    import fusedist

    out = {}
    for how in ("deepcopy", "pickle"):
        torch.manual_seed(seed)
        ddp = fusedist.DistributedDataParallel(nn.Linear(7, 3))
        opt = fusedist.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.5,
                                               overlap_param_gather=True)
        x, y = _batch(seed, 0, rank, ws)
        nn.functional.mse_loss(ddp(x), y).backward()
        if rank == 1:
            time.sleep(0.5)
        opt.step()
        copied = copy.deepcopy(ddp) if how == "deepcopy" else pickle.loads(pickle.dumps(ddp))
        opt.wait_for_params()
        out[how] = (_flat(copied.module) - _flat(ddp.module)).abs().max().item()
    return out


def _accumulated_under_torch_ddp(make_opt, seed, rank, ws, *, dtype=torch.float32, unsynced_from=None,
                                 by_flag=False, steps=3):
    """Steps 1..``steps`` of two micro-batches under torch's DDP, the first under no_sync(); from step
    ``unsynced_from`` on the last one is not averaged either (under no_sync(), or ``by_flag``:
    ``require_backward_grad_sync`` left False). Returns the module and the error text (or "no error")."""
    m = _net(seed).to(dtype)
    model = nn.parallel.DistributedDataParallel(m)
    opt = make_opt(m)
    try:
        for step in range(1, steps + 1):
            opt.zero_grad()
            for k in range(2):
                x, y = _batch(seed, step * 10 + k, rank, ws)
                unsynced = k == 0 or (unsynced_from is not None and step >= unsynced_from)
                if unsynced and by_flag and k == 1:
                    model.require_backward_grad_sync = False
                with model.no_sync() if unsynced else contextlib.nullcontext():
                    nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
            opt.step()
    except RuntimeError as exc:
        return m, str(exc)
    return m, "no error"


def _gradients_compared_every_step(rank, ws, seed):
    """Gradients averaged at the first step and not later (Note [gradients compared at every step])."""
    import fusedist
    from fusedist.zero import carried_agreement
    from shared_rank_launch import under_env
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

    def zero(**kw):
        return lambda m: fusedist.ZeroRedundancyOptimizer(m.named_parameters(), torch.optim.AdamW, lr=0.01, **kw)

    def run(make_opt, **kw):
        return _accumulated_under_torch_ddp(make_opt, seed, rank, ws, **kw)

    out = {}
    # Healthy: several buckets (the smallest carries the fingerprints), against torch's sharded optimizer.
    got, out["healthy"] = run(zero(bucket_cap_mb=0.0002))
    want, _ = run(lambda m: TorchZeRO(m.parameters(), torch.optim.AdamW, lr=0.01))
    out["healthy diff"] = (_flat(got) - _flat(want)).abs().max().item()
    out["healthy bf16"] = run(zero(), dtype=torch.bfloat16)[1]
    out["healthy offload"] = run(zero(offload="cpu"))[1]
    out["no_sync at step 2"] = run(zero(), unsynced_from=2)[1]
    out["flag at step 3, bf16"] = run(zero(), unsynced_from=3, by_flag=True, dtype=torch.bfloat16)[1]
    out["checks off"] = under_env(rank, ws, {"FUSEDIST_CHECKS": "0"}, lambda *_: run(zero(), unsynced_from=2)[1])
    saved, carried_agreement.MAX_CARRIER_ELEMENTS = carried_agreement.MAX_CARRIER_ELEMENTS, 0
    try:  # no bucket small enough to carry them: the fingerprints' own all-gather
        out["own gather, no_sync at step 3"] = run(zero(offload="cpu"), unsynced_from=3)[1]
    finally:
        carried_agreement.MAX_CARRIER_ELEMENTS = saved
    return out


def _drop_in_checks(rank, ws, seed):
    return {"refusals": _refusal_worker(rank, ws, seed), "built again": _built_again(rank, ws, seed),
            "copies in flight": _copies_under_gathers_in_flight(rank, ws, seed),
            "compared every step": _gradients_compared_every_step(rank, ws, seed)}


@pytest.fixture(scope="module")
def two_rank_run():
    """The 2-rank checks, in one spawn: (seed, per-rank results)."""
    seed = random.randrange(2**31)
    return seed, run_distributed(_drop_in_checks, 2, seed, timeout=120, pg_timeout=30,
                                 env={"FUSEDIST_TIMEOUT_S": "20"})


def test_optimizer_built_again_trains_as_torch_and_frees_the_old_one(two_rank_run):
    seed, results = two_rank_run
    for rank, per_rank in enumerate(results):
        out = per_rank["built again"]
        where = f"seed {seed}, rank {rank}: {out}"
        for stage in (1, 2):
            assert out[f"stage {stage} diff"] <= TOL, where
            assert out[f"stage {stage} alive"] == 0, where  # the model kept every optimizer built for it
            first, last = out[f"stage {stage} hooks"]
            assert first > 0 and last == first, where  # the hooks of one optimizer, not of three
        assert out["stage 1 old step"] == "no error", where  # two stage-1 optimizers: as two torch ones
        assert out["stage 1 unstepped"] == "no error", where
        assert "a newer stage-2 optimizer was built" in out["stage 2 old step"], where
        assert f"(rank {rank})" in out["stage 2 unstepped"], where
        assert "holds the gradients of a backward it has not stepped" in out["stage 2 unstepped"], where


def test_a_copy_taken_while_parameter_gathers_are_in_flight_holds_the_final_parameters(two_rank_run):
    seed, results = two_rank_run
    for rank, per_rank in enumerate(results):
        out = per_rank["copies in flight"]
        where = f"seed {seed}, rank {rank}: {out}"
        assert out["deepcopy"] == 0.0 and out["pickle"] == 0.0, where


def test_gradients_no_longer_averaged_after_the_first_step_are_refused_on_every_rank(two_rank_run):
    """fusedist ZeRO over torch DDP, two micro-batches a step: averaged, it trains as torch's sharded
    optimizer and raises nothing (fp32, bf16, offload); once the last micro-batch runs unaveraged
    (no_sync(), or require_backward_grad_sync left False), every rank raises at that step's end."""
    seed, results = two_rank_run
    for rank, per_rank in enumerate(results):
        out = per_rank["compared every step"]
        where = f"seed {seed}, rank {rank}: {out}"
        assert out["healthy diff"] <= TOL, where
        assert out["healthy"] == out["healthy bf16"] == out["healthy offload"] == "no error", where
        assert out["checks off"] == "no error", where  # FUSEDIST_CHECKS=0 turns it off
        for scenario, step in (("no_sync at step 2", 2), ("flag at step 3, bf16", 3),
                               ("own gather, no_sync at step 3", 3)):
            text = out[scenario]
            assert text.startswith(f"ZeroRedundancyOptimizer (rank {rank}): at step {step} the gradients differ "
                                   "across ranks at 6 parameter(s)"), where
            assert "'a.weight'" in text and "and 2 more" in text and "rank 0 has a gradient of norm" in text, where
            assert "rank 1 a gradient of norm" in text and "outside no_sync()" in text, where


def test_refusals_name_the_parameter_and_ranks(two_rank_run):
    seed, results = two_rank_run
    results = [per_rank["refusals"] for per_rank in results]
    for rank, out in enumerate(results):
        where = f"seed {seed}, rank {rank}: {out}"
        assert out["extra"].startswith("RankMismatchError"), where
        assert "this is rank" in out["extra"] and "parameter 6" in out["extra"] and "(5,)" in out["extra"], where
        assert "ranks [0]: <missing>; ranks [1]" in out["extra"], where
        assert out["order"].startswith("RankMismatchError") and "(13, 7)" in out["order"], where
        assert out["groups"].startswith("RankMismatchError") and "param group 1" in out["groups"], where
        assert out["twice"].startswith("ValueError") and "parameter 2 (shape (13, 7))" in out["twice"], where
        assert "same tensor as parameter 0" in out["twice"], where
        assert out["twice added"].startswith("ValueError") and "parameter 7 (shape (5,))" in out["twice added"], where
        assert out["groups after"] == 1, where
        assert out["partial LBFGS"].startswith("ValueError: ZeroRedundancyOptimizer: LBFGS cannot"), where
        assert out["join torch ddp"].startswith("ValueError: ZeroRedundancyOptimizer (rank"), where
        assert "fusedist.DistributedDataParallel model" in out["join torch ddp"], where
        assert out["no params key"].startswith("ValueError") and "'params'" in out["no params key"], where
        assert out["one rank's gradients"].startswith(f"RuntimeError: ZeroRedundancyOptimizer (rank {rank}): at step "
                                                      "2 the gradients differ across ranks at 6 parameter(s)"), where
        assert "a gradient on some ranks only: rank 0 has a gradient of norm" in out["one rank's gradients"], where
    assert results[0]["after"] == results[1]["after"], f"seed {seed}: the ranks' parameters differ"


def test_positional_arguments_as_torch():
    """torch's ``ZeroRedundancyOptimizer(params, optimizer_class, process_group)`` works positionally."""
    import inspect

    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

    import fusedist

    def positional(cls):
        return [name for name, p in inspect.signature(cls.__init__).parameters.items()
                if p.kind == p.POSITIONAL_OR_KEYWORD][:4]

    assert positional(fusedist.ZeroRedundancyOptimizer) == positional(TorchZeRO)


@pytest.mark.parametrize("call", ["step", "clip"])
def test_fullgraph_compile_of_a_step_or_clip_names_why_it_runs_eagerly(call):
    """Under ``fullgraph=True`` dynamo refuses the graph break at the step (torch's
    ZeroRedundancyOptimizer.step breaks the graph too); its error gives the reason and the way
    out, not only "Remove the `torch.compiler.disable` call"."""
    import fusedist

    model = nn.Linear(3, 2)
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    torch._dynamo.reset()
    body = (lambda: opt.step()) if call == "step" else (lambda: opt.clip_grad_norm_(1.0))
    with pytest.raises(Exception) as caught:  # dynamo's error type differs between versions
        torch.compile(body, backend="eager", fullgraph=True)()
    text = str(caught.value)
    what = "step() runs" if call == "step" else "clip_grad_norm_ runs"
    assert f"fusedist.ZeroRedundancyOptimizer.{what} eagerly under torch.compile" in text, text
    assert "outside the compiled function, or compile without fullgraph=True" in text, text
    torch._dynamo.reset()


@pytest.mark.parametrize("optimizer_class", [torch.optim.AdamW, torch.optim.SGD])
def test_torch_fused_inner_optimizer_under_the_scaler_steps_as_torchs(optimizer_class):
    """An inner torch optimizer built with ``fused=True`` takes the scaler's found-inf flag in its
    step, and skips an overflowed step there; the flag was handed over with shape (1,) where
    torch's scaler gives a 0-dim one, and every step failed ("output with shape [] doesn't match
    the broadcast shape [1]")."""
    import fusedist

    torch.manual_seed(0)
    ours, theirs = nn.Linear(4, 3), nn.Linear(4, 3)
    theirs.load_state_dict(ours.state_dict())
    kw = dict(lr=0.1, fused=True, **({"momentum": 0.9} if optimizer_class is torch.optim.SGD else {}))
    opt = fusedist.ZeroRedundancyOptimizer(ours.parameters(), optimizer_class, **kw)
    ref = optimizer_class(theirs.parameters(), **kw)
    scaler, ref_scaler = fusedist.amp.GradScaler("cpu", init_scale=4.0), torch.amp.GradScaler("cpu", init_scale=4.0)
    for step in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        for model, o, s in ((ours, opt, scaler), (theirs, ref, ref_scaler)):
            o.zero_grad()
            s.scale(model(x).square().sum() * (float("inf") if step == 1 else 1.0)).backward()
            s.step(o)
            s.update()
        for p, q in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=lambda m: f"step {step}: {m}")
    assert scaler.get_scale() == ref_scaler.get_scale()
