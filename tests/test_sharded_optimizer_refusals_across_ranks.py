"""fusedist.ZeroRedundancyOptimizer refusals of one rank's own arguments reach every rank (Note
[refusals of one rank's own arguments] in fusedist/zero/param_checks.py), world 2, one launch.

A config read per host can give one rank alone ``offload="cpu"``, ``amsgrad=True``,
``capturable=True``, a negative lr, float64 parameters, a layer left on the meta device or an
invalid option (stage=3). The constructor refused these before the ranks' parameter comparison (a
collective): the refusing rank raised alone and the other waited in the comparison until the stall
timeout (``FUSEDIST_TIMEOUT_S``, 15 s here). Now every rank raises the same RankMismatchError naming
rank 1 and its reason, at once (each refusal is timed: well under the timeout). ``offload`` on one
rank only (nothing refused locally) is a difference in the settings, named. ``add_param_group`` with
offload refuses amsgrad / differentiable / capturable in the added group when it is added (they were
refused only at ``step()``, or taken), on every rank alike, and adds nothing. An optimizer built
(and a group added) alike trains as torch's AdamW on the global batch. Parameters on several devices
(a layer left on the meta device) are refused at construction, naming the parameter and both
devices, as fusedist DDP refuses them. Without a DDP model, gradients that differ across ranks (nobody
averaged them; a DDP wrapper nobody kept) are refused at the first step, and stage 2 over a dropped wrapper
at construction, saying what to do.

Tolerance 1e-5 absolute: 3 AdamW steps (lr 0.01, eps 1e-3) in fp32 on parameters of magnitude
~0.5; the host Adam and torch's differ in summation order and fused arithmetic (~1e-7).
"""

import copy

import pytest
import torch
from torch import nn

import models
from shared_rank_launch import launch_for_selected, results_of

TOL = 1e-5
WORLD = 2
SEED = 20261207
TIMEOUT_S = 15
# Each refusal must come well before the stall timeout a waiting rank would run into.
PROMPT_S = TIMEOUT_S / 2


def _net():
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _train_against_torch(rank, world, seed, model, ref, zopt, ropt):
    """Three steps of both on the global batch (gradients averaged by hand: no DDP model)."""
    diffs = []
    for step in range(3):
        g = torch.Generator().manual_seed(seed * 31 + step)
        x, y = torch.randn(world * 2, 5, generator=g), torch.randn(world * 2, 3, generator=g)
        for m, o, xx, yy in ((ref, ropt, x, y), (model, zopt, x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])):
            o.zero_grad()
            nn.functional.mse_loss(m(xx), yy).backward()
        for p in model.parameters():
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad)
                p.grad /= world
        ropt.step()
        zopt.step()
        diffs.append(max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters())))
    return diffs


def _constructed_on_one_rank(rank, world, seed):
    """Rank 1 alone asks for what it is refused (or, for offload alone, what differs); the
    optimizer both built alike with offload before trains as torch's AdamW after the refusals."""
    import fusedist

    torch.manual_seed(seed)
    ref = _net()
    model = copy.deepcopy(ref)
    one = rank == 1

    def build(params=None, offload="cpu", **kw):
        return fusedist.ZeroRedundancyOptimizer(list(model.parameters()) if params is None else params,
                                               optimizer_class=torch.optim.AdamW, offload=offload,
                                               **{"lr": 0.01, "eps": 1e-3, **kw})

    doubled = copy.deepcopy(model).double()
    on_meta = nn.Linear(7, 3, device="meta")  # a layer left unmaterialized
    cases = {
        "amsgrad": lambda: build(amsgrad=one),
        "capturable": lambda: build([{"params": list(model[0].parameters())},
                                     {"params": list(model[2].parameters()), "capturable": one}]),
        "offload": lambda: build(offload="cpu" if one else None),
        "lr": lambda: build(lr=-1.0 if one else 0.01),
        "float64": lambda: build(list((doubled if one else model).parameters())),
        "twice": lambda: build(list(model.parameters()) + ([model[0].weight] if one else [])),
        "stage": lambda: build(stage=3 if one else 1),
        "meta": lambda: build(list(model[0].parameters()) + list((on_meta if one else model[2]).parameters())),
    }
    zopt = build()  # (first: loads the host Adam's extension, which a timed case must not wait for)
    errors = {name: models.raised_timed(fn) for name, fn in cases.items()}
    # Left on the meta device on every rank: refused alike at construction, each rank's own error
    # (it failed at the first step with a bare "Cannot copy out of meta tensor").
    everywhere = list(model[0].parameters()) + list(on_meta.parameters())
    errors["meta everywhere"] = models.raised_timed(lambda: build(everywhere))
    ropt = torch.optim.AdamW(ref.parameters(), lr=0.01, eps=1e-3)
    return {"errors": errors, "diffs": _train_against_torch(rank, world, seed, model, ref, zopt, ropt)}


def _added_with_offload(rank, world, seed):
    """With offload, a group added with amsgrad / differentiable / capturable on rank 1 only, then
    amsgrad on both: refused when added, on every rank, nothing added; then the group added alike
    trains as torch's."""
    import fusedist

    torch.manual_seed(seed)
    ref = _net()
    model = copy.deepcopy(ref)
    for m in (ref, model):
        m[2].requires_grad_(False)
    zopt = fusedist.ZeroRedundancyOptimizer(model[0].parameters(), optimizer_class=torch.optim.AdamW,
                                           offload="cpu", lr=0.01, eps=1e-3)
    ropt = torch.optim.AdamW(ref[0].parameters(), lr=0.01, eps=1e-3)
    for m in (ref, model):
        m[2].requires_grad_(True)
    head = list(model[2].parameters())
    errors = {flag: models.raised_timed(lambda: zopt.add_param_group({"params": head, flag: rank == 1}))
              for flag in ("amsgrad", "differentiable", "capturable")}
    errors["amsgrad everywhere"] = models.raised_timed(lambda: zopt.add_param_group({"params": head, "amsgrad": True}))
    groups_after = len(zopt.param_groups)
    zopt.add_param_group({"params": head, "lr": 0.02})
    ropt.add_param_group({"params": list(ref[2].parameters()), "lr": 0.02})
    return {"errors": errors, "groups_after": groups_after,
            "diffs": _train_against_torch(rank, world, seed, model, ref, zopt, ropt)}


def _gradients_nobody_averaged(rank, world, seed):
    """A model not wrapped in DDP, each rank backward-ing its own part of the batch: the first step is
    refused on every rank (the parameters unchanged); averaged by hand, the same step and the next match
    torch's ZeroRedundancyOptimizer fed the same averaged gradients, and only the refused step and the
    first one that found the gradients alike compare them."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    import fusedist
    from fusedist.zero import grad_agreement

    torch.manual_seed(seed)
    model = _net()
    theirs = copy.deepcopy(model)
    zopt = fusedist.ZeroRedundancyOptimizer(model.named_parameters(), optimizer_class=torch.optim.AdamW,
                                           lr=0.01, eps=1e-3)
    topt = TorchZero(theirs.parameters(), torch.optim.AdamW, lr=0.01, eps=1e-3)
    comm, tags = zopt.comm, []
    all_reduce = comm.all_reduce

    def counted(tensor, **kw):
        tags.append(kw.get("tag"))
        return all_reduce(tensor, **kw)

    comm.all_reduce = counted  # (the communicator is shared: restored below)
    out, diffs = {}, []
    try:
        before = [p.detach().clone() for p in model.parameters()]
        for step in range(3):
            g = torch.Generator().manual_seed(seed * 31 + step)
            x, y = torch.randn(world * 2, 5, generator=g), torch.randn(world * 2, 3, generator=g)
            own = slice(2 * rank, 2 * rank + 2)
            for m, o in ((model, zopt), (theirs, topt)):
                o.zero_grad()
                nn.functional.mse_loss(m(x[own]), y[own]).backward()
            if step == 0:
                out["error"] = models.raised_timed(zopt.step)
                out["unchanged"] = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
            for p in list(model.parameters()) + list(theirs.parameters()):
                dist.all_reduce(p.grad)
                p.grad /= world
            zopt.step()
            topt.step()
            diffs.append(max(float((p - q).abs().max()) for p, q in zip(model.parameters(), theirs.parameters())))
    finally:
        del comm.all_reduce
    out["diffs"] = diffs
    out["comparisons"] = tags.count(grad_agreement.OP)
    return out


def _dropped_wrapper(rank, world, seed):
    """A fusedist DDP wrapper nobody keeps (the optimizer built from ``DDP(net).parameters()``): freed at
    once, its hooks with it. Stage 2 is refused at construction, stage 1 at its first step (each rank's
    own, unaveraged gradients); both say to keep a reference to the wrapper."""
    import fusedist

    torch.manual_seed(seed)
    net = _net()
    errors = {"stage 2": models.raised_timed(lambda: fusedist.ZeroRedundancyOptimizer(
        fusedist.DistributedDataParallel(net).parameters(), torch.optim.AdamW, stage=2, lr=0.01))[0]}
    opt = fusedist.ZeroRedundancyOptimizer(fusedist.DistributedDataParallel(net).parameters(), torch.optim.AdamW,
                                          lr=0.01)
    x = torch.randn(2, 5, generator=torch.Generator().manual_seed(seed + rank))
    net(x).square().mean().backward()
    errors["stage 1"] = models.raised_timed(opt.step)[0]
    return errors


def _named_by_module_path(rank, world, seed):
    """Errors about parameters given as ``model.parameters()`` (no names) whose model the optimizer
    can find -- a subset of a fusedist DDP model (a step, a load, the constructor), a ``fully_shard``
    model -- and about named_parameters() that differ across ranks."""
    import fusedist

    torch.manual_seed(seed)
    errors = {}
    net = _net()
    ddp = fusedist.DistributedDataParallel(net)
    net[2].bias.requires_grad_(False)
    head = fusedist.ZeroRedundancyOptimizer(list(net[2].parameters()), torch.optim.AdamW, lr=0.01)
    net[2].bias.grad = torch.ones(3)  # a frozen parameter with a gradient: refused at the step
    ddp(torch.randn(4, 5)).sum().backward()
    errors["frozen with a gradient"] = models.raised(head.step)
    groups = torch.optim.AdamW(list(net[2].parameters()), lr=0.01).state_dict()["param_groups"]
    moments = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(5), "exp_avg_sq": torch.zeros(5)}
    errors["state of another size"] = models.raised(lambda: head.load_state_dict(
        {"state": {0: moments}, "param_groups": groups}))
    errors["twice"] = models.raised(lambda: fusedist.ZeroRedundancyOptimizer(
        list(net[0].parameters()) + [net[0].weight], torch.optim.AdamW, lr=0.01))
    sharded = _net()
    fusedist.fully_shard(sharded)
    errors["fully_shard"] = models.raised(lambda: fusedist.ZeroRedundancyOptimizer(
        sharded.parameters(), torch.optim.AdamW, lr=0.01))
    other = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3 + rank))  # the head differs on rank 1
    errors["named differ"] = models.raised(lambda: fusedist.ZeroRedundancyOptimizer(
        other.named_parameters(), torch.optim.AdamW, lr=0.01))
    return errors


SCENARIOS = {
    "test_construction_refused_on_one_rank_fails_every_rank_at_once": {
        "constructed": (_constructed_on_one_rank, (SEED,))},
    "test_offloaded_group_refused_when_added_on_every_rank": {
        "added": (_added_with_offload, (SEED + 1,))},
    "test_gradients_nobody_averaged_are_refused_and_averaged_ones_step_as_torch": {
        "unaveraged": (_gradients_nobody_averaged, (SEED + 2,))},
    "test_a_dropped_wrapper_is_refused_saying_to_keep_a_reference": {
        "dropped wrapper": (_dropped_wrapper, (SEED + 3,))},
    "test_errors_name_parameters_by_their_module_path": {
        "named by path": (_named_by_module_path, (SEED + 4,))},
}


@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, SCENARIOS, WORLD, timeout=240, env={"FUSEDIST_TIMEOUT_S": str(TIMEOUT_S)})


REASONS = {
    "amsgrad": "amsgrad=True is not supported by the host Adam",
    "capturable": "param group 1: capturable=True asks for a step",
    "lr": "Invalid learning rate: -1",
    "float64": "parameter 0 has dtype torch.float64",
    "twice": "parameter 4 (shape (7, 5)) in param group 0 is the same tensor as parameter 0",
    "meta": "parameter 2 (shape (3, 7)) is on meta, parameter 0 on cpu",
    "stage": "stage must be 1 or 2, got 3",
}


def test_construction_refused_on_one_rank_fails_every_rank_at_once(launched):
    per_rank = results_of(launched, "constructed")
    for rank, result in enumerate(per_rank):
        for name, (error, seconds) in result["errors"].items():
            assert seconds < PROMPT_S, (rank, name, seconds, error)
            if name == "meta everywhere":
                assert error is not None and error.startswith("ValueError") and REASONS["meta"] in error, error
                continue
            assert error is not None and error.startswith("RankMismatchError"), (rank, name, error)
            assert f"this is rank {rank}" in error, error
            if name == "offload":
                assert "settings" in error and "ranks [0]: offload=None; ranks [1]: offload=cpu" in error, error
            else:
                assert "ranks [1]: this rank's own refusal of its arguments" in error, error
                assert REASONS[name] in error, (name, error)
        assert max(result["diffs"]) < TOL, result["diffs"]


def test_offloaded_group_refused_when_added_on_every_rank(launched):
    per_rank = results_of(launched, "added")
    for rank, result in enumerate(per_rank):
        for flag, (error, seconds) in result["errors"].items():
            assert seconds < PROMPT_S, (rank, flag, seconds, error)
            if flag == "amsgrad everywhere":  # refused alike: each rank's own error, at add time
                assert error.startswith("ValueError") and "param group 1: amsgrad=True" in error, error
                continue
            name = flag if flag != "capturable" else "capturable=True asks for a step"
            assert error is not None and error.startswith("RankMismatchError"), (rank, flag, error)
            assert "ranks [1]: this rank's own refusal of its arguments" in error and name in error, error
        assert result["groups_after"] == 1
        assert max(result["diffs"]) < TOL, result["diffs"]


def test_gradients_nobody_averaged_are_refused_and_averaged_ones_step_as_torch(launched):
    """Without a DDP model each rank stepped its slice of the flat parameters with its own gradients: a
    parameter cut by the shard boundary (0.weight, 35 of 66 elements) ended a mix of both ranks' updates,
    matching neither torch's ZeroRedundancyOptimizer (each parameter stepped whole by its owner) nor any
    rank's step. Now the first step compares the gradients (Note [gradients nobody averaged] in
    fusedist/zero/grad_agreement.py) and refuses, on every rank at once, naming the parameter and the ranks;
    averaged by hand, the steps match torch's, and the run compares in those two steps only."""
    per_rank = results_of(launched, "unaveraged")
    for rank, result in enumerate(per_rank):
        error, seconds = result["error"]
        assert seconds < PROMPT_S, (rank, seconds, error)
        assert error is not None and error.startswith(
            f"RuntimeError: ZeroRedundancyOptimizer (rank {rank}): gradients differ across ranks at parameter 0 "
            "('0.weight', shape (7, 5)) (other values: rank 0 has a gradient of norm "), error
        assert ", rank 1 a gradient of norm " in error and "nothing was stepped" in error, error
        assert "Wrap the model in fusedist.DistributedDataParallel" in error, error
        assert error.replace(f"(rank {rank})", "") == per_rank[0]["error"][0].replace("(rank 0)", "")
        assert result["unchanged"], rank
        assert max(result["diffs"]) < TOL, result["diffs"]
        assert result["comparisons"] == 2, result["comparisons"]


def test_a_dropped_wrapper_is_refused_saying_to_keep_a_reference(launched):
    """Note [a dropped wrapper] in fusedist/zero/wiring.py: stage 2 told the user to wrap the model,
    which they had done; stage 1 stepped each rank's own gradients."""
    keep = ("Keep a reference to the DistributedDataParallel wrapper (model = fusedist.DistributedDataParallel(net)), "
            "run the forward through it, and build the optimizer from its parameters")
    for rank, errors in enumerate(results_of(launched, "dropped wrapper")):
        assert errors["stage 2"] == (
            f"ValueError: ZeroRedundancyOptimizer(stage=2) (rank {rank}): the fusedist.DistributedDataParallel "
            "wrapper of these parameters was dropped: nothing kept a reference to it, so it was freed and its "
            f"backward hooks, which reduce-scatter the gradients, came off. {keep}; or use stage=1."), errors
        stage1 = errors["stage 1"]
        assert stage1 is not None and stage1.startswith(
            f"RuntimeError: ZeroRedundancyOptimizer (rank {rank}): gradients differ across ranks at parameter 0 "
            "(shape (7, 5))"), stage1
        assert stage1.endswith(
            "The fusedist.DistributedDataParallel wrapper of these parameters was dropped: nothing kept a reference "
            f"to it, so it was freed and its backward hooks, which average the gradients, came off. {keep}."), stage1


def test_errors_name_parameters_by_their_module_path(launched):
    """Note [naming a parameter given without its name] in fusedist/zero/param_labels.py: given
    ``model.parameters()``, errors named a parameter by its index in the optimizer's list only (and
    a ``fully_shard`` model's pieces, another shape on each rank, were refused as parameter lists
    that differ across ranks); now by its path in the DDP or ``fully_shard`` model, or by the
    name given with ``named_parameters()``."""
    for rank, errors in enumerate(results_of(launched, "named by path")):
        assert errors["frozen with a gradient"].startswith(
            "RuntimeError: ZeroRedundancyOptimizer: parameter 1 ('2.bias', shape (3,)) has a gradient, but it is "
            "not sharded"), errors
        assert ("state 'exp_avg' of parameter 0 ('2.weight', shape (3, 7)) has 5 elements, the parameter has 21"
                in errors["state of another size"]), errors
        assert ("parameter 2 ('0.weight', shape (7, 5)) in param group 0 is the same tensor as parameter 0 "
                "('0.weight', shape (7, 5))") in errors["twice"], errors
        assert errors["fully_shard"].startswith(
            "ValueError: ZeroRedundancyOptimizer: parameter 0 ('0.weight') belongs to a fully_shard model, whose "
            "parameters are already sharded"), errors
        differ = errors["named differ"]
        assert differ.startswith("RankMismatchError") and f"this is rank {rank}" in differ, differ
        assert ("ranks [0]: parameter 2 ('2.weight') (param group 0) shape (3, 7) float32 on cpu; "
                "ranks [1]: parameter 2 ('2.weight') (param group 0) shape (4, 7) float32 on cpu") in differ, differ
