"""DDP with parameters whose requires_grad changes after wrapping (progressive unfreezing;
Note [trainable set changes] in fusedist/ddp/trainable.py).

Oracles: torch DDP whose model was wrapped with the parameter already trainable, and torch
optimizers in one process on the global batch with the same freeze schedule (DDP averages
per-rank mean losses over equal chunks, i.e. the global mean loss). Tolerance 1e-5 (fp32,
gradients differ in summation order only); a gradient that is not averaged moves a parameter
by ~1e-2 per step (lr 0.1 on rank-dependent data), a frozen parameter that is stepped by
weight decay or momentum likewise. The two-rank scenarios share one launch of the ranks (``launched``)."""

import copy

import pytest
import torch
from torch import nn

import models

from fusedist.testing import run_distributed
from shared_rank_launch import launch_for_selected, results_of

GLOBAL_BATCH = 12  # divisible by 2 and 3
TOL = 1e-5


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def _batch(step, rank=None, world_size=1):
    return models.rank_slice_of_global_batch(step, rank, world_size, seed=100, n=GLOBAL_BATCH)


_flat = models.flat_params


def _apply(schedule, model, step):
    for name, flag in schedule.get(step, {}).items():
        model.get_parameter(name).requires_grad_(flag)


def _single_process(schedule, opt_fn, steps, micro=1):
    """torch optimizer on the global batch, requires_grad changed at the same steps."""
    model = _model()
    _apply(schedule, model, -1)
    opt = opt_fn(model.parameters())
    for step in range(steps):
        _apply(schedule, model, step)
        opt.zero_grad()
        for m in range(micro):
            x, y = _batch(step * micro + m)
            (nn.functional.mse_loss(model(x), y) / micro).backward()
        opt.step()
    return _flat(model)


def _fusedist(rank, world_size, schedule, opt_fn, steps, micro=1, **ddp_kwargs):
    import fusedist

    model = _model()
    _apply(schedule, model, -1)  # frozen when wrapped
    ddp = fusedist.DistributedDataParallel(model, **ddp_kwargs)
    opt = opt_fn(ddp.parameters())
    for step in range(steps):
        _apply(schedule, model, step)
        opt.zero_grad()
        for m in range(micro):
            x, y = _batch(step * micro + m, rank, world_size)
            ctx = ddp.no_sync() if m < micro - 1 else _null()
            with ctx:
                (nn.functional.mse_loss(ddp(x), y) / micro).backward()
        opt.step()
    return _flat(model)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


# name -> (schedule {step: {param: requires_grad}}, step -1 = before wrapping, ddp kwargs, micro)
SCENARIOS = {
    "unfreeze at step 3": ({-1: {"0.weight": False, "0.bias": False}, 3: {"0.weight": True, "0.bias": True}},
                           {}, 1),
    "freeze at step 2, find_unused_parameters=False": ({2: {"2.weight": False}}, {}, 1),
    "freeze then unfreeze": ({2: {"2.weight": False, "4.bias": False}, 4: {"2.weight": True}}, {}, 1),
    "unfreeze under no_sync accumulation": ({-1: {"0.weight": False}, 2: {"0.weight": True}}, {}, 2),
    "unfreeze, several buckets, grads not bucket views": (
        {-1: {"0.weight": False, "2.bias": False}, 1: {"0.weight": True, "2.bias": True}, 3: {"4.weight": False}},
        dict(bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005, gradient_as_bucket_view=False), 1),
    "unfreeze with find_unused_parameters": ({-1: {"0.weight": False}, 1: {"0.weight": True}},
                                             dict(find_unused_parameters=True), 1),
}


def _parity_worker(rank, world_size):
    import fusedist

    out = {}
    # The example: frozen when wrapped, unfrozen before the optimizer is built and
    # before the first forward. Oracle: torch DDP wrapped with the parameter trainable.
    model = _model()
    ref = copy.deepcopy(model)
    model[0].weight.requires_grad_(False)
    ddp = fusedist.DistributedDataParallel(model)
    model[0].weight.requires_grad_(True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_ddp = torch.nn.parallel.DistributedDataParallel(ref)
    ref_opt = torch.optim.SGD(ref_ddp.parameters(), lr=0.1)
    for step in range(4):
        x, y = _batch(step, rank, world_size)
        for m, o in ((ddp, opt), (ref_ddp, ref_opt)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
    out["issue example vs torch DDP"] = (_flat(model) - _flat(ref)).abs().max().item()
    out["layout holds the unfrozen parameter"] = any(
        p is model[0].weight for b in ddp.buckets for p in b.params)
    for name, (schedule, kwargs, micro) in SCENARIOS.items():
        for opt_name, opt_fn in (("sgd", _sgd), ("adamw", _adamw)):
            ours = _fusedist(rank, world_size, schedule, opt_fn, 6, micro, **kwargs)
            out[f"{name} ({opt_name})"] = (ours - _single_process(schedule, opt_fn, 6, micro)).abs().max().item()
    return out


@pytest.mark.parametrize("world_size", [2, 3], ids=lambda w: f"world{w}")
def test_trainability_changes_after_wrapping_match_torch(world_size, request):
    if world_size == 2:
        results = results_of(request.getfixturevalue("launched"), "parity")
    else:
        results = run_distributed(_parity_worker, world_size, timeout=300)
    for per_rank in results:
        assert per_rank.pop("layout holds the unfrozen parameter")
        for name, diff in per_rank.items():
            assert diff < TOL, (name, diff)


def _mismatch_worker(rank, world_size):
    """Each case on a fresh model, all on one process group."""
    import fusedist

    out = {}
    for case in ("unfreeze on rank 1", "freeze on rank 0"):
        model = _model()
        if case.startswith("unfreeze"):
            model[0].weight.requires_grad_(False)
        ddp = fusedist.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        try:
            for step in range(4):
                if step == 1 and case == "unfreeze on rank 1" and rank == 1:
                    model[0].weight.requires_grad_(True)
                if step == 1 and case == "freeze on rank 0" and rank == 0:
                    model[2].weight.requires_grad_(False)
                x, y = _batch(step, rank, world_size)
                opt.zero_grad()
                nn.functional.mse_loss(ddp(x), y).backward()
                opt.step()
            out[case] = None
        except fusedist.RankMismatchError as exc:
            out[case] = (step, str(exc))
    # Unfrozen after the last synchronized backward and stepped after a no_sync one: the
    # gradient is local, and the guard names the parameter and the cause.
    model = _model()
    model[0].weight.requires_grad_(False)
    ddp = fusedist.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = _batch(0, rank, world_size)
    nn.functional.mse_loss(ddp(x), y).backward()
    model[0].weight.requires_grad_(True)
    opt.step()  # no gradient yet for the unfrozen weight: skipped, as torch does
    before = _flat(model)
    with ddp.no_sync():
        nn.functional.mse_loss(ddp(x), y).backward()
    out["guard"] = models.error_text(opt.step, ValueError)
    out["guard left parameters unchanged"] = torch.equal(before, _flat(model))
    return out


def test_trainability_changed_on_some_ranks_raises_on_every_rank(launched):
    results = results_of(launched, "mismatch")
    for rank, out in enumerate(results):
        step, text = out["unfreeze on rank 1"]
        assert step == (1 if rank == 1 else 2), (rank, step)  # the changed rank at once, the other next forward
        assert "parameter '0.weight': requires_grad=True on ranks [1], False on ranks [0]" in text, text
        assert "trainable:" in text
        step, text = out["freeze on rank 0"]
        assert "parameter '2.weight': requires_grad=True on ranks [1], False on ranks [0]" in text, text
        assert ("parameter '0.weight'" in out["guard"]
                and "requires_grad=False when the model was wrapped" in out["guard"])
        assert out["guard left parameters unchanged"]


def _assignment_worker(rank, world_size):
    """Note [parameters replaced after wrapping]: each case assigns into a wrapped module, then
    runs a training forward; the error text (or None) per case."""
    import fusedist

    out = {}
    x, y = _batch(0, rank, world_size)

    def case(name, change, dtype=torch.float32, **ddp_kwargs):
        model = _model()
        ddp = fusedist.DistributedDataParallel(model, **ddp_kwargs)
        nn.functional.mse_loss(ddp(x), y).backward()  # a normal step first
        change(model)
        before = _flat(model)
        out[name] = models.error_text(
            lambda: nn.functional.mse_loss(ddp(x.to(dtype)), y.to(dtype)).backward(), RuntimeError)
        out[name + " left parameters unchanged"] = torch.equal(before, _flat(model))
        return model

    fresh = {k: v.clone() + 1 for k, v in _model().state_dict().items()}
    case("assign=True", lambda m: m.load_state_dict(fresh, assign=True), find_unused_parameters=True)
    case("one replaced", lambda m: setattr(m[2], "weight", nn.Parameter(torch.zeros(16, 16))))
    case("one added", lambda m: m[0].register_parameter("extra", nn.Parameter(torch.zeros(3))))
    case("converted", lambda m: m.double(), dtype=torch.float64)
    # Submodules added after wrapping: a new head, a layer replaced, an empty container filled later.
    case("submodule added", lambda m: setattr(m, "extra", nn.Linear(2, 2)))
    case("submodule replaced", lambda m: m.__setitem__(2, nn.Linear(16, 16)))
    case("container filled", lambda m: (m.append(nn.Sequential()), m[5].append(nn.Linear(2, 2))))
    # A followed submodule registered under a second name brings no new Parameter: training goes on.
    case("shared submodule", lambda m: setattr(m[1], "shared", m[0]))
    # One parameter converted, not the first of its bucket, used through a cast so the forward
    # runs: the gradient hook reports it (after zero_grad(set_to_none=True), a fresh gradient).
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    ddp = fusedist.DistributedDataParallel(model)
    second = ddp.buckets[0].params[1]
    name = ddp.buckets[0].names[1]
    second.data = second.data.double()
    model.register_forward_pre_hook(lambda m, args: None)
    for layer in (model[0], model[2]):  # compute in fp32 whatever the parameters hold
        layer.forward = (lambda lyr: lambda inp: nn.functional.linear(
            inp, lyr.weight.float(), lyr.bias.float()))(layer)
    loss = nn.functional.mse_loss(ddp(x), y)
    out["converted, one parameter"] = (name, models.error_text(loss.backward, RuntimeError))
    # The same Parameter assigned again is no change: training goes on.
    model = _model()
    ddp = fusedist.DistributedDataParallel(model)
    model[0].weight = model[0].weight
    nn.functional.mse_loss(ddp(x), y).backward()
    # Wrapping again takes a change: the new wrapper averages the new Parameter's gradient.
    model = _model()
    fusedist.DistributedDataParallel(model)
    model[2].weight = nn.Parameter(torch.full((16, 16), 0.1))
    again = fusedist.DistributedDataParallel(model)
    nn.functional.mse_loss(again(x), y).backward()
    out["rewrapped grad"] = model[2].weight.grad.clone()
    # A head appended after wrapping: refused, then trained by a new wrapper on averaged gradients.
    model = _model()
    ddp = fusedist.DistributedDataParallel(model)
    torch.manual_seed(1)
    model.append(nn.Linear(2, 2))
    out["appended head"] = models.error_text(lambda: ddp(x), RuntimeError)
    again = fusedist.DistributedDataParallel(model)
    nn.functional.mse_loss(again(x), y).backward()
    out["appended head grads"] = [p.grad.clone() for p in model.parameters()]
    # A submodule with buffers only, added after wrapping: its buffers are broadcast from rank 0
    # before each training forward, as torch's DDP broadcasts them (each rank updates them on
    # its own data in between). (torch's does so only if the model had a buffer when wrapped.)
    for kind, wrap in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        model = _model()
        model[1].register_buffer("marker", torch.zeros(1))
        ddp = wrap(model)
        nn.functional.mse_loss(ddp(x), y).backward()
        model.append(nn.BatchNorm1d(2, affine=False))
        for step in (1, 2, 3):
            nn.functional.mse_loss(ddp(_batch(step, rank, world_size)[0]), y).backward()
        out[f"added buffers, {kind}"] = [b.clone() for b in model[5].buffers()]
    # Note [a module wrapped again]: the older wrapper of the same module stops; an inner
    # wrapper that an outer one is built around passes through (the outer one reduces).
    model = _model()
    old = fusedist.DistributedDataParallel(model)
    new = fusedist.DistributedDataParallel(model)
    out["older wrapper"] = models.error_text(lambda: old(x), RuntimeError)
    nn.functional.mse_loss(new(x), y).backward()
    out["newer wrapper grads"] = [p.grad.clone() for p in model.parameters()]
    model = _model()
    model[0] = fusedist.DistributedDataParallel(model[0])
    outer = fusedist.DistributedDataParallel(model)
    out["nested"] = models.error_text(lambda: outer(x), RuntimeError)
    return out


@pytest.fixture(scope="module")
def assignment_results():
    return run_distributed(_assignment_worker, 2, timeout=180)


def test_parameters_assigned_after_wrapping_raise_before_training_on_them(assignment_results):
    results = assignment_results
    for rank, out in enumerate(results):
        text = out["assign=True"]
        assert text is not None and f"rank {rank}" in text and "assigned after it was wrapped" in text, text
        assert "'0.weight'" in text and "'4.bias'" in text and "assign=True" in text, text
        assert "'2.weight'" in out["one replaced"] and "replaced by new Parameter objects" in out["one replaced"]
        assert "added: ['0.extra']" in out["one added"], out["one added"]
        converted = out["converted"]
        assert converted is not None and "parameter '4." in converted, converted
        assert "now torch.float64" in converted and "as torch.float32" in converted, converted
        name, text = out["converted, one parameter"]
        assert text is not None and f"parameter '{name}' is now torch.float64" in text, text
        for name in ("assign=True", "one replaced", "one added"):
            assert out[name + " left parameters unchanged"], name
    # the rewrapped model's new Parameter got the averaged gradient: equal on both ranks
    torch.testing.assert_close(results[0]["rewrapped grad"], results[1]["rewrapped grad"], rtol=0, atol=0)
    for rank, out in enumerate(results):
        text = out["older wrapper"]
        assert text is not None and "wrapped again by a newer DistributedDataParallel" in text, text
        assert out["nested"] is None, out["nested"]
    # the newer wrapper alone reduced the gradients: averaged once, equal to the single-process
    # gradient of the global batch's mean loss
    reference = _model()
    x, y = _batch(0)
    nn.functional.mse_loss(reference(x), y).backward()
    for got0, got1, want in zip(results[0]["newer wrapper grads"], results[1]["newer wrapper grads"],
                                reference.parameters()):
        torch.testing.assert_close(got0, want.grad, rtol=TOL, atol=TOL)
        torch.testing.assert_close(got1, got0, rtol=0, atol=0)


def test_submodules_added_after_wrapping_raise_before_training_on_them(assignment_results):
    """torch DDP trains a submodule added after wrapping on each rank's own gradients (the ranks
    drift apart); here the next training forward raises on every rank, naming its parameters."""
    results = assignment_results
    for rank, out in enumerate(results):
        for name, kind, names in (("submodule added", "added", "['extra.weight', 'extra.bias']"),
                                  ("submodule replaced", "replaced by new Parameter objects", "['2.weight', '2.bias']"),
                                  ("container filled", "added", "['5.0.weight', '5.0.bias']"),
                                  ("appended head", "added", "['5.weight', '5.bias']")):
            text = out[name]
            assert text is not None and f"rank {rank}" in text, (name, text)
            assert f"{kind}: {names}" in text and "wrap the module again" in text, (name, text)
            assert out.get(name + " left parameters unchanged", True), name
        assert out["shared submodule"] is None, out["shared submodule"]
    # wrapped again, the appended head is reduced with the rest: the single-process gradients of
    # the global batch's mean loss (fp32, summation order only: TOL), the same on both ranks
    reference = _model()
    torch.manual_seed(1)
    reference.append(nn.Linear(2, 2))
    x, y = _batch(0)
    nn.functional.mse_loss(reference(x), y).backward()
    for got0, got1, want in zip(results[0]["appended head grads"], results[1]["appended head grads"],
                                reference.parameters()):
        torch.testing.assert_close(got0, want.grad, rtol=TOL, atol=TOL)
        torch.testing.assert_close(got1, got0, rtol=0, atol=0)


def test_buffers_of_submodules_added_after_wrapping_are_broadcast(assignment_results):
    """A BatchNorm without affine weights appended after wrapping: rank 0's statistics reach
    every rank before each training forward, as with torch's DDP."""
    for out in assignment_results:
        # the same ops in the same order on the same data as torch's DDP: fp32 rounding only
        for got, want in zip(out["added buffers, fusedist"], out["added buffers, torch"], strict=True):
            torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    # (the ranks' statistics differ: each updated rank 0's with its own batch)
    assert not torch.equal(assignment_results[0]["added buffers, torch"][0],
                           assignment_results[1]["added buffers, torch"][0])


def _frozen_after_forward_worker(rank, world_size, find_unused):
    """Freeze the head between the loss and its backward in step 1, unfreeze it before step 3's
    forward (Lightning's toggle_optimizer after the loss): gradients as torch DDP's with
    find_unused_parameters=True, which autograd's skipped accumulation needs there."""
    import fusedist

    base = _model()
    runs = []
    for wrap, unused in ((nn.parallel.DistributedDataParallel, True), (fusedist.DistributedDataParallel, find_unused)):
        model = copy.deepcopy(base)
        ddp = wrap(model, find_unused_parameters=unused)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        grads = []
        for step in range(4):
            if step == 3:
                model[4].requires_grad_(True)
            x, y = _batch(step, rank, world_size)
            loss = nn.functional.mse_loss(ddp(x), y)
            if step == 1:
                model[4].requires_grad_(False)
            loss.backward()
            grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
        runs.append((grads, _flat(model)))
    (want_grads, want), (got_grads, got) = runs
    for step, (a, b) in enumerate(zip(want_grads, got_grads)):
        assert [g is None for g in a] == [g is None for g in b], step
        for ga, gb in zip(a, b):
            if ga is not None:
                torch.testing.assert_close(gb, ga, rtol=TOL, atol=TOL)
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("find_unused", [True, False])
def test_parameters_frozen_between_forward_and_backward(launched, find_unused):
    """It raised AttributeError from the gradient hook (p.grad None), or, without
    find_unused_parameters, called the frozen parameters unused."""
    results_of(launched, f"frozen after forward, {find_unused}")


# ---------------------------------------------------------------- the shared launch
@pytest.fixture(scope="module")
def launched(request):
    # (the mismatches last: the ranks raised at different steps there; nothing needs to follow them)
    return launch_for_selected(request, {
        "test_trainability_changes_after_wrapping_match_torch": {"parity": (_parity_worker, ())},
        "test_parameters_frozen_between_forward_and_backward": {
            f"frozen after forward, {find_unused}": (_frozen_after_forward_worker, (find_unused,))
            for find_unused in (True, False)},
        "test_trainability_changed_on_some_ranks_raises_on_every_rank": {"mismatch": (_mismatch_worker, ())},
    }, 2, timeout=480)
