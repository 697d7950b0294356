"""torch DDP's communication hooks on fusedist's DistributedDataParallel (Note [communication
hooks] in fusedist/ddp/comm_hook.py): PowerSGD (in one bucket and in two, with error feedback,
warm start and its switch from plain all-reduce), a compression wrapper around it, the no-op
debugging hook and a user's own hook, each trained side by side with torch DDP running the same
hook on 2 gloo ranks; and the errors: a hook that returns no future, the wrong size, a future
that never completes (bounded by FUSEDIST_TIMEOUT_S), and a hook with ZeRO stage 2 or
reduce_dtype. The side-by-side runs share one launch of the ranks (``launched``); the errors, whose
hooks leave collectives unfinished, keep a launch of their own.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from fusedist.testing import run_distributed
from shared_rank_launch import launch_for_selected, results_of

STEPS = 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 40), nn.GELU(), nn.Linear(40, 6))


def _user_hook(state, bucket):
    """A hook written against torch's GradBucket interface: sums, then averages in a callback,
    and counts what it saw (the state is the user's dict)."""
    import torch.distributed as dist

    state["calls"] += 1
    state["last_seen"] += bucket.is_last()
    state["numel"] = max(state["numel"], bucket.buffer().numel())
    assert sum(g.numel() for g in bucket.gradients()) == bucket.buffer().numel()
    assert [tuple(g.shape) for g in bucket.gradients()] == [tuple(p.shape) for p in bucket.parameters()]
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(dist.get_world_size()))


def _hook_and_state(kind: str):
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks, powerSGD_hook as ps

    def powersgd_state():
        return ps.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=3,
                                min_compression_rate=0.5, use_error_feedback=True, warm_start=True,
                                random_seed=7)

    if kind in ("powersgd", "powersgd, 2 buckets"):
        return powersgd_state(), ps.powerSGD_hook
    if kind == "fp16 wrapper around powersgd":
        return powersgd_state(), default_hooks.fp16_compress_wrapper(ps.powerSGD_hook)
    if kind == "noop":
        return None, debugging_hooks.noop_hook
    if kind == "user":
        return {"calls": 0, "last_seen": 0, "numel": 0}, _user_hook
    raise AssertionError(kind)


def _one_at_a_time(hook):
    """torch DDP's side of the several-bucket runs: the hook waits for the previous bucket's
    future before it starts (Note [one hook at a time]). Without it torch's own run fails on
    gloo -- PowerSGD's callbacks issue collectives on gloo's thread while the next bucket's
    hook issues its own on the training thread, and the ranks pair them differently (3 runs
    in 4 failed, "Timed out waiting for recv" or "Connection reset by peer")."""
    previous = []

    def serialized(state, bucket):
        if previous:
            previous.pop().wait()
        fut = hook(state, bucket)
        previous.append(fut)
        return fut

    return serialized


def _side_by_side_worker(rank, world, kind):
    import fusedist

    base = _model()
    caps = {}
    if kind.endswith("buckets"):
        # Two buckets, the same in both (PowerSGD compresses per bucket): the last two
        # layers, then the first (Note [buckets close as torch's do] in fusedist/ddp/layout.py).
        caps = dict(bucket_cap_mb_list=[0.004, 0.01])
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), **caps)
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base), **caps)
    states = {}
    for name, model in (("torch", ref), ("fusedist", ours)):
        states[name], hook = _hook_and_state(kind)
        if name == "torch" and caps:
            hook = _one_at_a_time(hook)
        model.register_comm_hook(states[name], hook)
    opts = {name: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
            for name, m in (("torch", ref), ("fusedist", ours))}
    gen = torch.Generator().manual_seed(100 + rank)
    worst = []
    for _ in range(STEPS):
        x, y = torch.randn(32, 24, generator=gen), torch.randn(32, 6, generator=gen)
        for name, model in (("torch", ref), ("fusedist", ours)):
            opts[name].zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            opts[name].step()
        worst.append(max((a - b).abs().max().item() for a, b in zip(ref.parameters(), ours.parameters())))
    # What a wrong reduction would change: the update of one step.
    step_size = max((a - b).abs().max().item() for a, b in zip(base.parameters(), ours.module.parameters()))
    user = {k: v for k, v in states["fusedist"].items()} if kind == "user" else None
    ref_user = {k: v for k, v in states["torch"].items()} if kind == "user" else None
    buckets = (len(ours.buckets), len(ref.reducer._get_zeros_like_grad_buckets()))
    return worst, step_size, user, ref_user, buckets


KINDS = ["powersgd", "powersgd, 2 buckets", "fp16 wrapper around powersgd", "noop", "user"]


@pytest.mark.parametrize("kind", KINDS)
def test_hook_trains_as_torch_ddp_with_the_same_hook(launched, kind):
    """Bit for bit where the arithmetic is the same; PowerSGD's QR and matmuls see the same
    bucket contents in the same order in both, so they agree to the last bit too -- the
    tolerance (1e-6 on weights of order 0.1) only covers summation order, and a missed bucket,
    gradients that are not views of the buffer the hook set (the compression wrapper's) or
    a lost error-feedback term moves weights by 1e-3 or more."""
    results = results_of(launched, f"side by side, {kind}")
    for rank, (worst, step_size, user, ref_user, buckets) in enumerate(results):
        assert max(worst) <= 1e-6, (kind, rank, worst)
        assert step_size > 1e-3, (kind, step_size)  # the runs trained
        assert buckets == ((2, 2) if kind.endswith("buckets") else (1, 1)), buckets
        if kind == "user":
            assert user == ref_user, (user, ref_user)  # same calls, same last bucket, same sizes
            assert user["last_seen"] == STEPS


def _noop_worker(rank, world):
    """The no-op hook leaves each rank its own gradient, as torch's does: proof the hook, not
    fusedist's all-reduce, synchronized the buckets."""
    import fusedist
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks

    model = fusedist.DistributedDataParallel(_model())
    model.register_comm_hook(None, debugging_hooks.noop_hook)
    local = _model()
    x = torch.randn(8, 24, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    local(x).sum().backward()
    return max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), local.parameters()))


def test_noop_hook_leaves_local_gradients(launched):
    for diff in results_of(launched, "noop"):
        assert diff < 1e-6, diff


def _never_completes(state, bucket):
    return torch.futures.Future()


def _returns_none(state, bucket):
    return None


def _wrong_size(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer()[:-1].clone())
    return fut


def _error_worker(rank, world):
    import fusedist

    errors = {}
    x = torch.randn(8, 24)
    for name, hook in (("none", _returns_none), ("size", _wrong_size)):
        model = fusedist.DistributedDataParallel(_model())
        model.register_comm_hook(None, hook)
        try:
            model(x).sum().backward()
        except (TypeError, ValueError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"

    model = fusedist.DistributedDataParallel(_model())
    model.register_comm_hook(None, _never_completes)
    t0 = time.monotonic()
    try:
        model(x).sum().backward()
    except RuntimeError as exc:
        errors["never"] = f"{type(exc).__name__}: {exc}"
    errors["never_s"] = time.monotonic() - t0

    model = fusedist.DistributedDataParallel(_model())
    model.register_comm_hook({"calls": 0, "last_seen": 0, "numel": 0}, _user_hook)
    try:
        fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=2)
    except ValueError as exc:
        errors["zero2 after"] = str(exc)
    fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=1)  # stage 1 works with a hook
    try:
        model.register_comm_hook(None, _user_hook)
    except RuntimeError as exc:
        errors["twice"] = str(exc)

    model = fusedist.DistributedDataParallel(_model())
    fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=2)
    try:
        model.register_comm_hook(None, _user_hook)
    except ValueError as exc:
        errors["zero2 before"] = str(exc)
    try:
        fusedist.DistributedDataParallel(_model(), reduce_dtype=torch.bfloat16).register_comm_hook(None, _user_hook)
    except ValueError as exc:
        errors["reduce_dtype"] = str(exc)
    return errors


def test_hook_errors_name_the_hook_and_bucket():
    results = run_distributed(_error_worker, 2, env={"FUSEDIST_TIMEOUT_S": "3"}, timeout=120)
    for rank, errors in enumerate(results):
        assert (errors["none"].startswith("TypeError")
                and "_returns_none returned NoneType for bucket 0" in errors["none"])
        assert errors["size"].startswith("ValueError") and "_wrong_size returned a tensor of" in errors["size"]
        assert "holds" in errors["size"] and "bucket 0" in errors["size"]
        assert errors["never"].startswith("CollectiveError"), errors["never"]
        assert f"rank {rank}" in errors["never"] and "_never_completes did not complete bucket 0" in errors["never"]
        assert 2.5 < errors["never_s"] < 30, errors["never_s"]
        assert "the communication hook _user_hook" in errors["zero2 after"] and "stage=1" in errors["zero2 after"]
        assert "already registered" in errors["twice"]
        assert "ZeRO stage 2's reduce-scatter" in errors["zero2 before"] and "_user_hook" in errors["zero2 before"]
        assert "reduce_dtype=torch.bfloat16" in errors["reduce_dtype"] and "_user_hook" in errors["reduce_dtype"]


def _join_worker(rank, world):
    """Uneven inputs: rank 1 runs out one step early. torch's join runs the hook on zeroed
    buckets for the joined rank; so does fusedist's shadow backward."""
    import fusedist

    base = _model()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base))
    states = {"torch": {"calls": 0, "last_seen": 0, "numel": 0}, "fusedist": {"calls": 0, "last_seen": 0, "numel": 0}}
    ref.register_comm_hook(states["torch"], _user_hook)
    ours.register_comm_hook(states["fusedist"], _user_hook)
    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(16, 24, generator=gen), torch.randn(16, 6, generator=gen)) for _ in range(4 - rank)]
    for name, model in (("torch", ref), ("fusedist", ours)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with model.join():
            for x, y in batches:
                opt.zero_grad(set_to_none=True)
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
    diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), ours.parameters()))
    return diff, states["fusedist"]["calls"], states["torch"]["calls"]


def test_hook_under_join_matches_torch(launched):
    for diff, calls, ref_calls in results_of(launched, "join"):
        assert diff <= 1e-6, diff
        assert calls == ref_calls > 0, (calls, ref_calls)


# ---------------------------------------------------------------- the shared launch
@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, {
        "test_hook_trains_as_torch_ddp_with_the_same_hook": {
            f"side by side, {kind}": (_side_by_side_worker, (kind,)) for kind in KINDS},
        "test_noop_hook_leaves_local_gradients": {"noop": (_noop_worker, ())},
        "test_hook_under_join_matches_torch": {"join": (_join_worker, ())},
    }, 2, timeout=480)
