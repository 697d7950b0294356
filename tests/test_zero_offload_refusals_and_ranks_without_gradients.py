"""``ZeroRedundancyOptimizer(offload="cpu")``: a hyperparameter the host Adam cannot run is
refused by every rank before anything is updated, and the step can then be retried; and a rank
without gradients, without a DDP model, still joins the others' all-gathers.

The host step updates and all-gathers bucket by bucket. When the kernel's own check was the
only one, a bad value in one param group (a schedule that made the learning rate NaN, betas
edited to 1.0) raised on the ranks whose shard held a piece of that group -- after earlier
buckets had been stepped -- while the other ranks stepped on into an all-gather the failing
rank never joined: parameters and step counts diverged across ranks, and the job hung.

In the same launch: a step in which no parameter has a gradient steps the inner optimizer, as torch's
ZeroRedundancyOptimizer steps its local one every time (an optimizer that decays every parameter and
counts its steps in its param group, the step hooks registered on ``optimizer.optim`` and an LR scheduler
built on it, skipped such a step and diverged from torch's), with and without a DDP model, stage 1 and 2;
and the constructor's refusals of its own options and of stage 2 over a model whose gradients a
communication hook synchronizes name the rank, and where one rank alone is refused every rank raises at
once.

Tolerance 1e-6 absolute for the steps without gradients: SGD-like updates (lr 0.05, decay 0.01) of the
same averaged gradients on the same elements, 4 steps in fp32 (a skipped decay moves weights of magnitude
~0.3 by ~3e-3).
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import models
from shared_rank_launch import launch_for_selected, results_of


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def _groups(model):
    """Group 1 is only the last bias: its two elements lie in one rank's shard."""
    ps = list(model.parameters())
    return [dict(params=ps[:-1]), dict(params=ps[-1:], weight_decay=0.0)]


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _refused_then_retried(rank, world_size, key, bad):
    import fusedist

    model = _model()
    ref = _model()
    ddp = fusedist.DistributedDataParallel(model, bucket_cap_mb=0.0005, first_bucket_cap_mb=0.0002)
    ref_ddp = nn.parallel.DistributedDataParallel(ref)
    opt = fusedist.ZeroRedundancyOptimizer(_groups(model), torch.optim.AdamW, offload="cpu", lr=1e-2)
    ref_opt = torch.optim.AdamW(_groups(ref), lr=1e-2)
    gen = torch.Generator().manual_seed(10 + rank)
    out = {}
    for step in range(3):
        x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 2, generator=gen)
        for m, o in ((ddp, opt), (ref_ddp, ref_opt)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
        ref_opt.step()
        if step == 1:
            good = opt.param_groups[1][key]
            before = _flat(model)
            opt.param_groups[1][key] = bad
            try:
                opt.step()
                out["error"] = None
            except ValueError as e:
                out["error"] = str(e)
            out["changed"] = int((_flat(model) != before).sum())
            out["steps"] = sorted({float(s["step"]) for s in opt.inner.state.values()})
            dist.barrier()  # every rank is here: none is left in a parameter all-gather
            opt.param_groups[1][key] = good
        opt.step()  # the refused step again, with the gradients it kept
    opt.wait_for_params()
    out["diff"] = (_flat(model) - _flat(ref)).abs().max().item()
    return out


BAD = {"betas": (0.9, 1.0), "lr": float("nan")}


@pytest.mark.parametrize("key,message", [
    ("betas", r"betas must lie in \[0, 1\)"),
    ("lr", "lr and weight_decay must be finite"),
], ids=["betas", "lr"])
def test_a_bad_hyperparameter_is_refused_on_every_rank_before_any_update(key, message, launched):
    import re

    bad = BAD[key]
    for rank, out in enumerate(results_of(launched, f"refused {key}")):
        assert out["error"] is not None, f"rank {rank} stepped with {key}={bad}"
        assert "param group 1" in out["error"] and re.search(message, out["error"]), out["error"]
        assert out["changed"] == 0, f"rank {rank}: {out['changed']} parameter elements changed by a refused step"
        assert out["steps"] == [1.0], f"rank {rank}: step counts {out['steps']} after a refused step"
        assert out["diff"] < 1e-6, f"rank {rank}: after the retried step, max |fusedist - torch| = {out['diff']}"


def _rank_without_gradients(rank, world_size, offload):
    import fusedist

    model = _model()
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, stage=1,
                                           offload=offload, lr=1e-2)
    errors = []
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        if not (rank == 1 and step == 1):  # (no DDP model: rank 1 alone has no gradients in step 1)
            # (the same batch on every rank: the first step refuses gradients that differ across ranks,
            # Note [gradients nobody averaged] in fusedist/zero/grad_agreement.py)
            g = torch.Generator().manual_seed(10 * step)
            model(torch.randn(4, 16, generator=g)).square().mean().backward()
        try:  # (alike at the first step, so unlike in this one: every rank raises at its end,
            opt.step()  # Note [gradients compared at every step] in fusedist/zero/carried_agreement.py)
        except RuntimeError as exc:
            errors.append(f"step {step}: {exc}")
    return _flat(model), errors


def test_a_rank_without_gradients_joins_the_offloaded_gathers(launched):
    """Without a DDP model a rank with no gradient returned from step() at once under offload,
    and the rank that stepped waited in its all-gather until the timeout; without offload it
    all-gathers its slices as they are. Both now agree (the host Adam within fp32 rounding of
    torch's AdamW), and every rank ends with the same parameters -- and, the gradients having been alike
    at the first step, every rank says at the end of that step that they differed."""
    offloaded = results_of(launched, "without gradients, offloaded")
    on_device = results_of(launched, "without gradients, on device")
    assert torch.equal(offloaded[0][0], offloaded[1][0])
    torch.testing.assert_close(offloaded[0][0], on_device[0][0], rtol=1e-5, atol=1e-6)
    for rank, (_, errors) in enumerate(offloaded + on_device):  # the gradients differed: said on every rank
        assert len(errors) == 1 and errors[0].startswith(f"step 1: ZeroRedundancyOptimizer (rank {rank % 2}): at "
                                                         "step 2 the gradients differ across ranks"), errors
        assert "a gradient on some ranks only: rank 0 has a gradient of norm" in errors[0], errors


class _DecayingSGD(torch.optim.Optimizer):
    """An elementwise optimizer that does something without gradients: it decays every parameter
    and counts its steps in its param group, at every step."""

    _fusedist_elementwise = True

    def __init__(self, params, lr=0.05, decay=0.01):
        super().__init__(params, dict(lr=lr, decay=decay, steps=0))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])
                p.mul_(1.0 - group["decay"])
            group["steps"] += 1


def _counted(optimizer) -> list:
    """[pre-hook calls, post-hook calls] of ``optimizer``, counted from now on."""
    calls = [0, 0]
    optimizer.register_step_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    optimizer.register_step_post_hook(lambda *_: calls.__setitem__(1, calls[1] + 1))
    return calls


def _steps_without_gradients(rank, world_size, wrapped, stage):
    """Steps 1 and 3 have no gradient anywhere; fusedist's optimizer against torch's ZeroRedundancyOptimizer
    over torch's DDP (fusedist's without a DDP model: gradients averaged by hand)."""
    import fusedist
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    ref, model = _model(), _model()
    ref_ddp = nn.parallel.DistributedDataParallel(ref)
    net = fusedist.DistributedDataParallel(model) if wrapped else model
    ref_opt = TorchZero(ref.parameters(), _DecayingSGD, lr=0.05, decay=0.01)
    opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), _DecayingSGD, stage=stage, lr=0.05, decay=0.01)
    calls = {"torch": _counted(ref_opt.optim), "fusedist": _counted(opt.optim)}
    diffs = []
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 16, generator=g), torch.randn(4, 2, generator=g)
        for m, o in ((ref_ddp, ref_opt), (net, opt)):
            o.zero_grad(set_to_none=True)
            if step % 2 == 0:
                nn.functional.mse_loss(m(x), y).backward()
        if not wrapped and step % 2 == 0:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world_size
        ref_opt.step()
        opt.step()
        diffs.append((_flat(model) - _flat(ref)).abs().max().item())
    steps = [[g["steps"] for g in o.param_groups] for o in (ref_opt, opt)]
    return {"diffs": diffs, "calls": calls, "group steps": steps}


STEPLESS = {"ddp stage 1": (True, 1), "ddp stage 2": (True, 2), "no ddp": (False, 1)}


@pytest.mark.parametrize("case", list(STEPLESS))
def test_a_step_without_gradients_steps_the_inner_optimizer_as_torch(case, launched):
    """Before, such a step returned before the inner optimizer: no decay, no step counted, no hook
    called, and the parameters ~3e-3 off torch's from step 1 on."""
    for rank, out in enumerate(results_of(launched, f"stepless {case}")):
        where = f"rank {rank}: {out}"
        assert max(out["diffs"]) < 1e-6, where
        assert out["calls"]["fusedist"] == out["calls"]["torch"] == [4, 4], where
        assert out["group steps"][1] == out["group steps"][0] == [4], where


def _scheduler_on_the_inner_optimizer(rank, world_size):
    """An LR scheduler built on ``optimizer.optim`` (torch's attribute), stepped after a first step
    without gradients: torch's ZeroRedundancyOptimizer called its local optimizer's step, so the
    scheduler does not warn that it was stepped first; the warnings of both, and the inner lr."""
    import warnings

    import fusedist
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    out = {}
    for name, cls in (("torch", TorchZero), ("fusedist", fusedist.ZeroRedundancyOptimizer)):
        opt = cls(_model().parameters(), torch.optim.SGD, lr=0.1)
        schedule = torch.optim.lr_scheduler.StepLR(opt.optim, 1, gamma=0.5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
            schedule.step()
        warned = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
        out[name] = (warned, opt.optim.param_groups[0]["lr"])
    return out


def test_a_scheduler_on_the_inner_optimizer_counts_a_step_without_gradients(launched):
    for rank, out in enumerate(results_of(launched, "scheduler on optim")):
        assert out["fusedist"] == out["torch"] == ([], 0.05), (rank, out)


def _frozen_then_unfrozen(rank, world_size):
    """A model frozen whole for its first two steps (step hooks and an LR scheduler on ``optimizer.optim``),
    then unfrozen for one step of hand-averaged gradients: torch's ZeroRedundancyOptimizer steps its local
    optimizer over the frozen parameters. Per optimizer: post-hook calls, scheduler warnings, the inner lr
    after the frozen steps, and the parameters at the end."""
    import warnings

    import fusedist
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    out = {}
    for name, cls in (("torch", TorchZero), ("fusedist", fusedist.ZeroRedundancyOptimizer)):
        model = _model().requires_grad_(False)
        opt = cls(model.parameters(), torch.optim.SGD, lr=0.1)
        calls = _counted(opt.optim)
        schedule = torch.optim.lr_scheduler.StepLR(opt.optim, 1, gamma=0.5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                opt.step()
                schedule.step()
        frozen_lr = opt.optim.param_groups[0]["lr"]
        model.requires_grad_(True)
        g = torch.Generator().manual_seed(rank)
        nn.functional.mse_loss(model(torch.randn(4, 16, generator=g)), torch.randn(4, 2, generator=g)).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
        opt.step()
        warned = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
        out[name] = {"calls": calls[1], "warned": warned, "lr": frozen_lr, "params": _flat(model)}
    return out


def test_a_model_frozen_whole_steps_the_inner_optimizer_as_torch(launched):
    """Before, a step over a model frozen whole returned before the inner optimizer: its post-hooks ran 1
    time of torch's 3, the scheduler warned that it was stepped before the optimizer, and the inner lr
    kept the scheduler's 0.025 where torch's step put the groups' 0.1 back (0.05 after the last)."""
    for rank, out in enumerate(results_of(launched, "frozen whole")):
        theirs, ours = out["torch"], out["fusedist"]
        assert (ours["calls"], ours["warned"], ours["lr"]) == (theirs["calls"], theirs["warned"], theirs["lr"]) \
            == (3, [], 0.05), (rank, out)
        assert (ours["params"] - theirs["params"]).abs().max().item() < 1e-6, rank


def _averaging_hook(state, bucket):
    """A communication hook of one's own (torch's recipe): DDP's gradient sync becomes the hook."""
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _rank_named_refusals(rank, world_size):
    """Options and stage-2 wirings refused on every rank alike, and on rank 1 alone, each timed; then a
    stage-2 optimizer built alike trains as torch's SGD over torch's DDP."""
    import fusedist

    def build(params, **kw):
        return fusedist.ZeroRedundancyOptimizer(params, torch.optim.SGD, **{"lr": 0.1, **kw})

    one = rank == 1
    hooked_on_one = fusedist.DistributedDataParallel(_model())
    if one:
        hooked_on_one.register_comm_hook(None, _averaging_hook)
    hooked = fusedist.DistributedDataParallel(_model())
    hooked.register_comm_hook(None, _averaging_hook)
    plain = _model()
    cases = {
        "hook on one rank": lambda: build(hooked_on_one.parameters(), stage=2),
        "hook": lambda: build(hooked.parameters(), stage=2),
        "stage": lambda: build(plain.parameters(), stage=3),
        "overlap_with_ddp": lambda: build(plain.parameters(), overlap_with_ddp=True),
        "overlap_with_ddp on one rank": lambda: build(plain.parameters(), overlap_with_ddp=one),
        "max_buckets_in_flight": lambda: build(plain.parameters(), max_buckets_in_flight=0),
    }
    errors = {name: models.raised_timed(fn) for name, fn in cases.items()}
    model, ref = _model(), _model()
    net, ref_ddp = fusedist.DistributedDataParallel(model), nn.parallel.DistributedDataParallel(ref)
    opt, ref_opt = build(model.parameters(), stage=2), torch.optim.SGD(ref.parameters(), lr=0.1)
    for m, o in ((net, opt), (ref_ddp, ref_opt)):
        g = torch.Generator().manual_seed(rank)
        nn.functional.mse_loss(m(torch.randn(4, 16, generator=g)), torch.randn(4, 2, generator=g)).backward()
        o.step()
    return {"errors": errors, "diff": (_flat(model) - _flat(ref)).abs().max().item()}


ALIKE = {  # refused on every rank: each raises its own error, naming its rank
    "hook": "ValueError: ZeroRedundancyOptimizer(stage=2) (rank {rank}): this DDP model's gradients are "
            "already synchronized by the communication hook _averaging_hook",
    "stage": "ValueError: ZeroRedundancyOptimizer (rank {rank}): stage must be 1 or 2, got 3",
    "overlap_with_ddp": "ValueError: ZeroRedundancyOptimizer (rank {rank}): overlap_with_ddp=True is torch's option",
    "max_buckets_in_flight": "ValueError: ZeroRedundancyOptimizer(stage=2) (rank {rank}): max_buckets_in_flight "
                             "must be an int >= 1",
}
ON_ONE_RANK = {  # refused on rank 1 alone: every rank raises at once, naming rank 1 and its reason
    "hook on one rank": "already synchronized by the communication hook _averaging_hook",
    "overlap_with_ddp on one rank": "overlap_with_ddp=True is torch's option",
}


def test_refusals_name_the_rank_and_one_rank_alone_fails_every_rank_at_once(launched):
    """Before, these refusals named no rank, and stage 2 over a model with a communication hook on one
    rank refused there alone: the other rank built its optimizer and waited in its first backward."""
    for rank, out in enumerate(results_of(launched, "rank named refusals")):
        for name, (error, seconds) in out["errors"].items():
            assert seconds < 5, (rank, name, seconds, error)  # (FUSEDIST_TIMEOUT_S is 20)
            if name in ALIKE:
                assert error is not None and error.startswith(ALIKE[name].format(rank=rank)), (rank, name, error)
                continue
            assert error is not None and error.startswith("RankMismatchError"), (rank, name, error)
            assert f"this is rank {rank}" in error and "ranks [1]: this rank's own refusal" in error, error
            assert ON_ONE_RANK[name] in error, (name, error)
        assert out["diff"] < 1e-6, (rank, out["diff"])


@pytest.fixture(scope="module")
def launched(request):
    """The scenarios of the tests above in one launch of 2 ranks (each launch costs a process
    group and the imports of torch in every rank). A rank left waiting in an all-gather the
    other never joins fails after FUSEDIST_TIMEOUT_S, not at the launch's limit."""
    return launch_for_selected(request, {
        "test_a_bad_hyperparameter_is_refused_on_every_rank_before_any_update": {
            f"refused {key}": (_refused_then_retried, (key, bad)) for key, bad in BAD.items()},
        "test_a_rank_without_gradients_joins_the_offloaded_gathers": {
            "without gradients, offloaded": (_rank_without_gradients, ("cpu",)),
            "without gradients, on device": (_rank_without_gradients, (None,))},
        "test_a_step_without_gradients_steps_the_inner_optimizer_as_torch": {
            f"stepless {case}": (_steps_without_gradients, args) for case, args in STEPLESS.items()},
        "test_a_model_frozen_whole_steps_the_inner_optimizer_as_torch": {
            "frozen whole": (_frozen_then_unfrozen, ())},
        "test_a_scheduler_on_the_inner_optimizer_counts_a_step_without_gradients": {
            "scheduler on optim": (_scheduler_on_the_inner_optimizer, ())},
        "test_refusals_name_the_rank_and_one_rank_alone_fails_every_rank_at_once": {
            "rank named refusals": (_rank_named_refusals, ())},
    }, 2, timeout=300, env={"FUSEDIST_TIMEOUT_S": "20"})
