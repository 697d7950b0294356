"""``fusedist.replicate`` against torch's composable ``replicate`` (torchtitan's DDP) on 2 gloo
ranks: the same losses and weights (AdamW; BatchNorm statistics kept per rank by both),
accumulation through ``set_requires_gradient_sync(False)``, a ``forward`` replaced on the
instance, a communication hook, ignored
modules, a model built on the meta device whose engine a ZeroRedundancyOptimizer builds before
the first forward (and its fusedist.checkpoint round trip), a submodule sharded by fully_shard
(left to its unit, against FSDP2's under torch's replicate), and the module left as it was
(class tree, state-dict keys, one call of its hooks per forward). Refusals are checked in one
process.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(8, 3))
        self.side = nn.Linear(6, 3)  # ignored in the "ignored_modules" case

    def forward(self, x):
        return self.head(self.bn(self.inp(x))) + self.side(x)


def _train(model, opt, rank, steps, accumulate, seed):
    """Losses of ``steps`` optimizer steps; each step ``accumulate`` micro-batches, the first
    ``accumulate - 1`` without gradient sync. Data differ between ranks."""
    g = torch.Generator().manual_seed(seed + 101 * rank)
    losses, unsynced = [], []
    for _ in range(steps):
        for micro in range(accumulate):
            model.set_requires_gradient_sync(micro == accumulate - 1)
            x = torch.randn(5, 6, generator=g, dtype=model.inp.weight.dtype)
            loss = model(x).square().mean()
            loss.backward()
            losses.append(loss.item())
            if micro < accumulate - 1:  # this rank's own gradient, not yet reduced
                unsynced.append(model.inp.weight.grad.clone())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, unsynced


def _case(rank, name, seed, directory):
    import torch.distributed as dist
    from torch.distributed._composable.replicate import replicate as torch_replicate

    import fusedist
    from fusedist import ZeroRedundancyOptimizer

    torch.manual_seed(seed + rank)  # different initial weights: both broadcast rank 0's
    base = _Net()
    theirs, ours = copy.deepcopy(base), copy.deepcopy(base)
    calls = []
    ours.inp.register_forward_pre_hook(lambda m, a: calls.append("inp"))
    ours.register_forward_pre_hook(lambda m, a: calls.append("root"))
    kwargs = {}
    if name == "ignored_modules":
        ignored_theirs, ignored_ours = [theirs.side], [ours.side]
    else:
        ignored_theirs = ignored_ours = None
    torch_replicate(theirs, ignored_modules=ignored_theirs, **kwargs)
    if name == "meta init":  # built on meta, replicated, materialized; ZeRO before the first forward
        with torch.device("meta"):
            ours = _Net()
        fusedist.replicate(ours, **kwargs)
        assert fusedist.ddp.replicate.wrapper_of(ours) is None  # pending
        ours.to_empty(device="cpu")
        with torch.no_grad():
            for p_o, p_b in zip(ours.parameters(), base.parameters()):
                p_o.copy_(p_b)
            for b_o, b_b in zip(ours.buffers(), base.buffers()):
                b_o.copy_(b_b)
        opt_ours = ZeroRedundancyOptimizer(ours.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
        assert fusedist.ddp.replicate.wrapper_of(ours) is not None  # built by the optimizer
    else:
        fusedist.replicate(ours, ignored_modules=ignored_ours, **kwargs)
        if name == "plain":  # converted after replicate, before the first forward (built there)
            assert fusedist.ddp.replicate.wrapper_of(ours) is None
            theirs.double()
            ours.double()
        opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    if name == "forward replaced":  # on the instance, as Accelerate wraps forward in autocast
        import types

        for m in (theirs, ours):
            m.forward = types.MethodType(_Net.forward, m)
    if name == "comm hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        theirs.register_comm_hook(None, default_hooks.fp16_compress_hook)
        ours.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt_theirs = torch.optim.AdamW(theirs.parameters(), lr=1e-2)

    accumulate = 3 if name == "accumulation" else 1
    l_theirs, _ = _train(theirs, opt_theirs, rank, 4, accumulate, seed)
    calls.clear()
    l_ours, unsynced = _train(ours, opt_ours, rank, 4, accumulate, seed)
    if name == "meta init":  # a checkpoint of the replicated model and its ZeRO state, loaded back
        fusedist.checkpoint.save(directory, ours, opt_ours, extra={"step": 4})
        fresh = fusedist.replicate(_Net())
        opt_fresh = ZeroRedundancyOptimizer(fresh.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
        assert fusedist.checkpoint.load(directory, fresh, opt_fresh) == {"step": 4}
        for a, b in zip(ours.parameters(), fresh.parameters()):
            assert torch.equal(a, b)
        assert keys_equal(opt_ours.state_dict(), opt_fresh.state_dict())
    out = {
        "losses": (l_theirs, l_ours),
        "params": ([p.detach().clone() for p in theirs.parameters()], [p.detach().clone() for p in ours.parameters()]),
        "buffers": ([b.clone() for b in theirs.buffers()], [b.clone() for b in ours.buffers()]),
        "keys": (list(theirs.state_dict()), list(ours.state_dict()), list(base.state_dict())),
        "class": (type(theirs).__name__, type(ours).__name__, isinstance(ours, _Net)),
        "calls": calls.count("root") if name != "meta init" else None,
        "forwards": 4 * accumulate,
        "world": dist.get_world_size(),
        "unsynced": unsynced,
    }
    return out


CASES = ["plain", "accumulation", "comm hook", "ignored_modules", "meta init", "forward replaced"]


def keys_equal(a, b) -> bool:
    """Whether two (nested) state dicts hold equal tensors and values under the same keys."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(keys_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(keys_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _compiled(rank, seed):
    """torch.compile of a replicated module against the same module run eagerly: the largest
    difference of the weights after 3 steps."""
    import fusedist

    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    eager, compiled = fusedist.replicate(copy.deepcopy(base)), fusedist.replicate(copy.deepcopy(base))
    runs = [(eager, torch.optim.SGD(eager.parameters(), lr=0.1)),
            (torch.compile(compiled, backend="aot_eager"), torch.optim.SGD(compiled.parameters(), lr=0.1))]
    g = torch.Generator().manual_seed(seed + rank)
    for _ in range(3):
        x = torch.randn(4, 6, generator=g)
        for model, opt in runs:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    return max((a - b).abs().max().item() for a, b in zip(eager.parameters(), compiled.parameters()))


def _fully_shard_submodule(rank, seed):
    """FSDP2's fully_shard on a submodule, then torch's replicate on the model (each leaves the
    other's parameters alone), against fusedist's two: losses, and every parameter whole."""
    import torch.distributed as dist
    from torch.distributed._composable.replicate import replicate as torch_replicate
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fusedist

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(seed)
    base = _Net()
    theirs, ours = copy.deepcopy(base), copy.deepcopy(base)
    torch_fully_shard(theirs.head, mesh=mesh)
    torch_replicate(theirs)
    fusedist.fully_shard(ours.head, mesh=mesh)
    fusedist.replicate(ours)
    losses = [_train(m, torch.optim.AdamW(m.parameters(), lr=1e-2), rank, 4, 1, seed)[0] for m in (theirs, ours)]
    full = StateDictOptions(full_state_dict=True)
    return losses, [get_model_state_dict(m, options=full) for m in (theirs, ours)]


def _all_cases(rank, world_size, seed, directory):
    out = {name: _case(rank, name, seed, directory) for name in CASES}
    out["compiled"] = _compiled(rank, seed)
    out["fully_shard submodule"] = _fully_shard_submodule(rank, seed)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    seed = int(torch.randint(0, 10_000, ()).item())
    return run_distributed(_all_cases, 2, seed, str(tmp_path_factory.mktemp("replicate")), timeout=240)


@pytest.mark.parametrize("name", CASES)
def test_replicate_matches_torchs_replicate(results, name):
    for rank, per_rank in enumerate(results):
        r = per_rank[name]
        l_theirs, l_ours = r["losses"]
        # fp32 (fp64: "plain") AdamW, the same reduction order on 2 ranks; fp16 hook: same cast on both sides
        torch.testing.assert_close(torch.tensor(l_ours), torch.tensor(l_theirs), rtol=1e-5, atol=1e-6,
                                   msg=f"rank {rank} {name}: losses")
        for i, (a, b) in enumerate(zip(*r["params"])):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}: parameter {i}")
        for i, (a, b) in enumerate(zip(*r["buffers"])):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}: buffer {i}")
        theirs_keys, ours_keys, plain_keys = r["keys"]
        assert ours_keys == theirs_keys == plain_keys
        theirs_cls, ours_cls, still_net = r["class"]
        assert ours_cls == theirs_cls == "DDP_Net" and still_net
        if r["calls"] is not None:
            assert r["calls"] == r["forwards"]  # the module's own hooks ran once per forward
    # the ranks trained one model (the ignored module excepted, which stays rank-local)
    unsynced = [per_rank["accumulation"]["unsynced"] for per_rank in results]
    assert len(unsynced[0]) == 8  # 4 steps, 2 unsynchronized micro-batches each
    for a, b in zip(*unsynced):
        assert not torch.equal(a, b), "a backward with requires_gradient_sync=False reduced its gradients"
    for name_ in CASES:
        p0, p1 = results[0][name_]["params"][1], results[1][name_]["params"][1]
        side = {6, 7} if name_ == "ignored_modules" else set()  # side.weight, side.bias
        for i, (a, b) in enumerate(zip(p0, p1)):
            if i in side:
                assert not torch.equal(a, b), f"{name_}: ignored parameter {i} was synchronized"
            else:
                assert torch.equal(a, b), f"{name_}: parameter {i} differs between ranks"


def test_fully_shard_submodules_are_left_to_their_units_as_by_torch(results):
    for rank, per_rank in enumerate(results):
        (l_theirs, l_ours), (theirs, ours) = per_rank["fully_shard submodule"]
        # fp32 AdamW; the shard's reduce-scatter and the rest's all-reduce sum the same 2 terms
        torch.testing.assert_close(torch.tensor(l_ours), torch.tensor(l_theirs), rtol=1e-5, atol=1e-6,
                                   msg=f"rank {rank}: losses")
        assert ours.keys() == theirs.keys(), (sorted(ours), sorted(theirs))
        for key in theirs:
            torch.testing.assert_close(ours[key], theirs[key], rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {key}")
    for key, value in results[0]["fully_shard submodule"][1][1].items():  # one model on both ranks
        if key.startswith(("inp.", "side.", "head.")):
            assert torch.equal(value, results[1]["fully_shard submodule"][1][1][key]), key


def test_compiled_replicated_module_trains_as_the_eager_one(results):
    assert [r["compiled"] for r in results] == [0.0, 0.0]  # the same ops in the same order (aot_eager)


def _refusals(rank, world_size):
    import fusedist

    out = {}
    m = fusedist.replicate(_Net())
    for label, fn in [("twice", lambda: fusedist.replicate(m)),
                      ("deepcopy", lambda: copy.deepcopy(m)),
                      ("fully_shard after", lambda: fusedist.fully_shard(m)),
                      ("fully_shard before", lambda: fusedist.replicate(fusedist.fully_shard(_Net()))),
                      ("bad device_id", lambda: fusedist.replicate(_Net(), device_id="cuda"))]:
        try:
            fn()
            out[label] = None
        except (ValueError, TypeError, NotImplementedError, AssertionError) as e:
            out[label] = str(e)
    try:
        out["constructed"] = _constructed_through_the_class()
    except Exception:  # noqa: BLE001 - reported by the test
        import traceback

        out["constructed"] = traceback.format_exc()
    with torch.device("meta"):
        pending = fusedist.replicate(_Net())
    try:
        pending(torch.randn(2, 6, device="meta"))
        out["meta forward"] = None
    except RuntimeError as e:
        out["meta forward"] = str(e)
    return out


def _constructed_through_the_class():
    """``type(replicated)(...)`` (a container's slice, a script's ``type(model)()``) and ``copy.copy``
    of a replicated module, by torch's replicates and fusedist's."""
    from torch.distributed._composable.replicate import replicate as torch_replicate
    from torch.distributed._composable.replicate_with_fsdp import replicate as torch_fsdp_replicate

    import fusedist

    def built(replicate):
        empty = type(replicate(nn.Sequential(nn.Linear(6, 3))))()
        linear = type(replicate(nn.Linear(6, 3)))(6, 2)
        try:
            type(replicate(nn.Linear(6, 3)))()
            missing = None
        except TypeError as e:
            missing = str(e)
        x = torch.ones(1, 6)
        return (type(empty).__name__, len(empty), torch.equal(empty(x), x), type(linear).__name__,
                tuple(linear(x).shape), missing)

    def shallow(replicate):
        m = replicate(nn.Linear(6, 3))
        twin = copy.copy(m)
        return type(twin).__name__, twin.weight is m.weight, torch.equal(twin(torch.ones(1, 6)), m(torch.ones(1, 6)))

    out = {"fusedist": built(fusedist.replicate), "torch": built(torch_fsdp_replicate)}
    out["copy"] = (shallow(fusedist.replicate), shallow(torch_replicate))
    try:  # torch's DDP-based replicate: an object of the original class whose __init__ never ran
        out["torch ddp"] = built(torch_replicate)
    except AttributeError as e:
        out["torch ddp"] = str(e)
    return out


@pytest.fixture(scope="module")
def refusals():
    """The refusals' and the constructions' scenarios share one launch of one rank."""
    return run_distributed(_refusals, 1)[0]


def test_constructing_through_a_replicated_class_builds_the_original_as_torchs_replicate(refusals):
    """Before, ``type(m)()`` gave an object whose __init__ never ran (no ``_modules``), which
    failed at its first use; now the original's __init__ runs, as with torch's FSDP-based
    replicate (and FSDP2); copy.copy gives what torch's DDP-based replicate's gives."""
    out = refusals["constructed"]
    assert not isinstance(out, str), out
    assert out["fusedist"] == out["torch"], out
    assert out["fusedist"][:5] == ("Sequential", 0, True, "Linear", (1, 2))
    assert "in_features" in out["fusedist"][5]
    assert "has no attribute '_modules'" in out["torch ddp"]  # the reference whose __init__ never ran
    ours, theirs = out["copy"]
    assert ours == theirs == ("Linear", True, True)


def test_refusals_name_the_problem(refusals):
    out = refusals
    assert "already replicated" in out["twice"]
    assert "deep-copied" in out["deepcopy"]
    assert "replicated (fusedist.replicate)" in out["fully_shard after"]
    assert "sharded by fully_shard" in out["fully_shard before"]
    assert "device_id must be" in out["bad device_id"]
    assert "still on the meta device" in out["meta forward"] and "inp.weight" in out["meta forward"]
