"""fusedist.DistributedDataParallel against torch DDP (gloo, world sizes 2 and 3).

Tolerance: both sides compute the same fp32 math (pre-divided all-reduce of the same
gradients), so differences come only from summation order in gloo vs bucket boundaries:
1e-5 absolute after 10 steps is ~100 ulps of the parameter magnitudes involved.

The two-rank scenarios share one launch of the ranks (``launched``): starting ranks costs more
than most scenarios.
"""

import copy
import json
import os
import warnings

import pytest
import torch
from torch import nn

import models
from fusedist.testing import run_distributed
from shared_rank_launch import launch_for_selected, results_of

BUCKET_CONFIGS = {
    "tiny": dict(bucket_cap_mb=0.0005, first_bucket_cap_mb=0.0002),  # ~many buckets
    "one": dict(bucket_cap_mb=100.0, first_bucket_cap_mb=100.0),  # a single bucket
    "default": dict(),
}


def _train_pair(rank, model_cls, fused_kwargs, steps=10, micro=1, torch_kwargs=None, zero_grad_none=True,
                hook=None, torch_hook=True):
    """Train a torch-DDP and a fusedist-DDP copy of one model on the same per-rank data
    (fusedist's with torch's communication ``hook``, if given; torch's too if ``torch_hook``)."""
    import fusedist

    torch.manual_seed(1234)  # identical init on every rank...
    base = model_cls()
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), **(torch_kwargs or {}))
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base), **fused_kwargs)
    if hook is not None:
        ours.register_comm_hook(None, hook)
        if torch_hook:
            ref.register_comm_hook(None, hook)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)  # ...different data per rank
    for _ in range(steps):
        opt_ref.zero_grad(set_to_none=zero_grad_none)
        opt_ours.zero_grad(set_to_none=zero_grad_none)
        for m in range(micro):
            x, y = model_cls.batch(gen)
            for model in (ref, ours):
                ctx = model.no_sync() if m < micro - 1 else _nullcontext()
                with ctx:
                    loss = models.loss_fn(model_cls, model(x), y)
                    loss.backward()
        opt_ref.step()
        opt_ours.step()
    diffs = {}
    for (name, p_ref), (_, p_ours) in zip(ref.module.named_parameters(), ours.module.named_parameters()):
        diffs[name] = (p_ref - p_ours).abs().max().item()
    for (name, b_ref), (_, b_ours) in zip(ref.module.named_buffers(), ours.module.named_buffers()):
        if b_ref.is_floating_point():
            diffs["buffer " + name] = (b_ref - b_ours).abs().max().item()
    flat = torch.cat([p.detach().reshape(-1) for p in ours.parameters()])
    return diffs, flat, ours


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _parity_worker(rank, world_size):
    results = {}
    for model_cls in (models.MLP, models.ConvBN, models.TiedLM):
        for cfg_name, cfg in BUCKET_CONFIGS.items():
            diffs, flat, ours = _train_pair(rank, model_cls, cfg)
            results[(model_cls.__name__, cfg_name)] = (max(diffs.values()), flat, len(ours.buckets))
    # no_sync: 4 micro-batches accumulated, then one synchronized backward.
    diffs, flat, _ = _train_pair(rank, models.MLP, BUCKET_CONFIGS["tiny"], steps=3, micro=4)
    results[("MLP", "no_sync x4")] = (max(diffs.values()), flat, 0)
    # gradients not kept as bucket views; zero_grad(set_to_none=False).
    diffs, flat, _ = _train_pair(rank, models.ConvBN, dict(gradient_as_bucket_view=False), steps=4)
    results[("ConvBN", "grad copies")] = (max(diffs.values()), flat, 0)
    diffs, flat, _ = _train_pair(rank, models.MLP, BUCKET_CONFIGS["tiny"], steps=4, zero_grad_none=False)
    results[("MLP", "zero_grad(set_to_none=False)")] = (max(diffs.values()), flat, 0)
    # bf16 reduction: one bf16 rounding of pre-divided gradients per step.
    diffs, flat, _ = _train_pair(rank, models.MLP, dict(reduce_dtype=torch.bfloat16), steps=4)
    results[("MLP", "reduce bf16")] = (max(diffs.values()), flat, 0)
    # torch's built-in communication hooks, registered on both sides (torch refuses its bf16
    # hook without NCCL: there the reference reduces in fp32, as for "reduce bf16").
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    wire = {"allreduce_hook": None, "fp16_compress_hook": torch.float16, "bf16_compress_hook": torch.bfloat16}
    for name, dtype in wire.items():
        diffs, flat, ours = _train_pair(rank, models.MLP, BUCKET_CONFIGS["tiny"], steps=4,
                                        hook=getattr(default_hooks, name), torch_hook=name != "bf16_compress_hook")
        assert ours.config.reduce_dtype == dtype, (name, ours.config.reduce_dtype)  # reduced in the hook's dtype
        results[("MLP", name)] = (max(diffs.values()), flat, 0)
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_parity_with_torch_ddp(world_size, request):
    if world_size == 2:
        per_rank = results_of(request.getfixturevalue("launched"), "parity")
    else:
        per_rank = run_distributed(_parity_worker, world_size, timeout=300)
    for key, (max_diff, flat0, nbuckets) in per_rank[0].items():
        # One bf16 / fp16 rounding of the (pre-divided) gradients per step, ~1e-2-sized
        # gradients, 4 steps of lr 0.05: ~1e-5 (fp16, eps 1e-3) and ~1e-4 (bf16, eps 8e-3)
        # measured; fusedist splits the fp16 division around the sum (divide_factors) where
        # torch's hook divides first. The bf16 references reduce in fp32.
        tol = {"reduce bf16": 2e-3, "fp16_compress_hook": 1e-4, "bf16_compress_hook": 1e-3}.get(key[1], 1e-5)
        assert max_diff < tol, f"{key}: max |torch - fusedist| = {max_diff}"
        for rank in range(1, world_size):
            assert torch.equal(per_rank[rank][key][1], flat0), f"{key}: rank {rank} diverged from rank 0"
    # The bucket configurations really differ.
    assert per_rank[0][("MLP", "tiny")][2] >= 3  # (as many as torch DDP makes of these caps)
    assert per_rank[0][("MLP", "one")][2] == 1


def _mesh_worker(rank, world_size):
    """A 2 x 2 mesh: DDP over its 'dp' dimension reduces within pairs of ranks only."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fusedist

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "dp"))
    dp = mesh["dp"]
    diffs, flat, ours = _train_pair(rank, models.MLP, dict(device_mesh=dp), steps=3,
                                    torch_kwargs=dict(device_mesh=dp))
    errors = {}
    for name, kwargs in (("both", dict(device_mesh=dp, process_group=dp.get_group())), ("2-D", dict(device_mesh=mesh))):
        try:
            fusedist.DistributedDataParallel(nn.Linear(2, 2), **kwargs)
        except ValueError as exc:
            errors[name] = str(exc)
    return max(diffs.values()), flat, dist.get_process_group_ranks(ours.process_group), errors


def test_device_mesh_selects_the_data_parallel_group():
    results = run_distributed(_mesh_worker, 4, timeout=120)
    for rank, (max_diff, flat, group, errors) in enumerate(results):
        assert max_diff < 1e-5, f"rank {rank}: max |torch - fusedist| = {max_diff}"
        assert group == ([0, 1] if rank < 2 else [2, 3])
        assert "not both" in errors["both"] and "must be 1-D" in errors["2-D"]
    assert torch.equal(results[0][1], results[1][1]) and torch.equal(results[2][1], results[3][1])
    assert not torch.equal(results[0][1], results[2][1])  # different data, separate groups


class _SometimesUnused(models.WithUnused):
    def forward(self, x, use_unused=False):
        out = self.used(x)
        return out + self.unused(x) if use_unused else out


def _unused_worker(rank, world_size):
    import fusedist

    out = {}
    # find_unused_parameters=True: parity with torch and a one-time warning naming them.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        diffs, _, ours = _train_pair(rank, models.WithUnused, dict(find_unused_parameters=True), steps=3,
                                     torch_kwargs=dict(find_unused_parameters=True))
    out["find_unused_diff"] = max(diffs.values())
    out["unused_grad_is_none"] = ours.module.unused.weight.grad is None
    out["warnings"] = [str(w.message) for w in caught if "received no gradient" in str(w.message)]
    # find_unused_parameters=False: a clear error after backward, then the next step still works.
    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(models.WithUnused())
    x, y = models.WithUnused.batch(torch.Generator().manual_seed(rank))
    try:
        nn.functional.mse_loss(model(x), y).backward()
        out["error"] = None
    except RuntimeError as exc:
        out["error"] = str(exc)
    # Used only on rank 0: with find_unused_parameters=True the grads are averaged over ranks.
    torch.manual_seed(0)
    base = models.WithUnused()
    model = fusedist.DistributedDataParallel(copy.deepcopy(base), find_unused_parameters=True)
    loss = nn.functional.mse_loss(model(x), y)
    if rank == 0:
        loss = loss + model.module.unused(x).pow(2).mean()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss.backward()
    g = model.module.unused.weight.grad
    out["partially_used_grad"] = None if g is None else g.clone()
    out["rank_local_unused_grad"] = torch.autograd.grad(base.unused(x).pow(2).mean(), base.unused.weight)[0]
    # Gradient views off: a parameter unused in this step reduces its p.grad as it is now
    # (zeroed by zero_grad(set_to_none=False)), not the last average its bucket slot still holds.
    torch.manual_seed(0)
    base = _SometimesUnused()
    pair = {"fusedist": fusedist.DistributedDataParallel(copy.deepcopy(base), find_unused_parameters=True,
                                                         gradient_as_bucket_view=False),
            "torch": nn.parallel.DistributedDataParallel(copy.deepcopy(base), find_unused_parameters=True)}
    out["views_off_unused_grad"] = {}
    for name, m in pair.items():
        for use in (True, False):
            for p in m.parameters():
                if p.grad is not None:
                    p.grad.zero_()
            loss = nn.functional.mse_loss(m(x, use), y)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loss.backward()
        out["views_off_unused_grad"][name] = m.module.unused.weight.grad.clone()
    return out


def test_unused_parameters(launched):
    r0, r1 = results_of(launched, "unused")
    for out in (r0, r1):
        assert out["find_unused_diff"] < 1e-5
        assert out["unused_grad_is_none"]
        assert len(out["warnings"]) == 1 and "unused.weight" in out["warnings"][0]
        assert out["error"] and "no gradient" in out["error"] and "unused.weight" in out["error"]
        assert "find_unused_parameters=True" in out["error"]
    # rank 0 used the parameter, rank 1 did not: both hold the average (rank 0's grad / 2).
    torch.testing.assert_close(r0["partially_used_grad"], r0["rank_local_unused_grad"] / 2)
    torch.testing.assert_close(r1["partially_used_grad"], r0["rank_local_unused_grad"] / 2)
    for out in (r0, r1):
        got = out["views_off_unused_grad"]
        torch.testing.assert_close(got["fusedist"], got["torch"], rtol=0, atol=0)


def _mismatch_worker(rank, world_size):
    import fusedist

    model = models.MLP(hidden=32 if rank != 1 else 33)
    fusedist.DistributedDataParallel(model)
    return "constructed"


def test_mismatched_model_raises_on_every_rank():
    import time

    # Every rank raises at construction, not at a timeout. The wall time includes starting
    # three ranks that import torch (6-7 s measured at a load average of 4.6 on 2 cores, more
    # on a busier machine), so the bound is 60 s, and the group's and fusedist's timeouts are
    # set at twice that, so that a rank left waiting for one exceeds the bound.
    start = time.monotonic()
    outcome = run_distributed(_mismatch_worker, 3, expect_failure=True, timeout=180, pg_timeout=120,
                              env={"FUSEDIST_TIMEOUT_S": "120"})
    assert time.monotonic() - start < 60
    for status, text in outcome:
        assert status == "error"
        assert "differs across ranks" in text
        assert "layers.0.weight" in text and "(33, 16)" in text and "(32, 16)" in text
        assert "[1]" in text  # the odd rank is named


def _overlap_worker(rank, world_size, trace):
    import fusedist

    os.environ["FUSEDIST_TIMELINE"] = trace  # (read when a model is wrapped: unset for the scenarios after)
    torch.manual_seed(0)
    try:
        model = fusedist.DistributedDataParallel(
            models.MLP(d_in=64, hidden=256, layers=6), bucket_cap_mb=0.25, first_bucket_cap_mb=0.05
        )
    finally:
        del os.environ["FUSEDIST_TIMELINE"]
    gen = torch.Generator().manual_seed(rank)
    stats = []
    for _ in range(3):
        x = torch.randn(64, 16, generator=gen).repeat(1, 4)
        model.zero_grad()
        model(x).pow(2).mean().backward()
        stats.append(model.comm_stats())
    model.timeline.flush()
    return stats


def test_first_bucket_launches_before_backward_ends(launched, overlap_trace):
    trace = overlap_trace
    per_rank = results_of(launched, "overlap")
    for stats in per_rank:
        assert all(s["buckets"] > 2 for s in stats)
        assert all(s["first_launch_before_last_grad"] for s in stats), stats
    events = json.load(open(trace + ".rank0.json"))["traceEvents"]
    names = [e["name"] for e in events]
    assert any(n.startswith("AllReduceAverage bucket 0") for n in names)
    assert "buckets rebuilt" in names or all(s["buckets"] > 2 for s in per_rank[0])
    # In the trace, bucket 0's all-reduce starts before the last bucket is ready.
    last_iter = [e for e in events if e["name"] == "backward begins"][-1]["ts"]
    launches = [e for e in events if e["name"].startswith("AllReduceAverage bucket 0") and e["ts"] >= last_iter]
    readies = [e for e in events if e["name"].endswith("ready") and e["ts"] >= last_iter]
    assert launches and readies and launches[0]["ts"] < max(r["ts"] for r in readies)


def _fp16_worker(rank, world_size):
    import fusedist

    lin = nn.Linear(4, 1, bias=False).half()
    model = fusedist.DistributedDataParallel(lin)
    x = torch.full((1, 4), 250.0, dtype=torch.float16)
    (model(x) * 240.0).sum().backward()  # each rank's gradient is 60000: the sum overflows fp16
    return lin.weight.grad.float()


def test_fp16_average_does_not_overflow(launched):
    grads = results_of(launched, "fp16")
    for g in grads:
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, torch.full_like(g, 60000.0), rtol=1e-3, atol=0)


def _state_dict_worker(rank, world_size):
    import fusedist

    torch.manual_seed(0)
    model = fusedist.DistributedDataParallel(models.ConvBN())
    ref = nn.parallel.DistributedDataParallel(models.ConvBN())
    keys_match = list(model.state_dict().keys()) == list(ref.state_dict().keys())
    torch.manual_seed(1)
    bare = models.ConvBN()
    model.load_state_dict(bare.state_dict())  # no "module." prefix
    loaded_bare = all(torch.equal(a, b) for a, b in zip(model.module.state_dict().values(), bare.state_dict().values()))
    torch.manual_seed(2)
    other = fusedist.DistributedDataParallel(models.ConvBN())
    model.load_state_dict(other.state_dict())  # with the prefix
    loaded_prefixed = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    # Training still works after loading (hooks attached to the same parameters).
    x, y = models.ConvBN.batch(torch.Generator().manual_seed(rank))
    nn.functional.mse_loss(model(x), y).backward()
    grads_synced = model.module.head.weight.grad.clone()
    return keys_match, loaded_bare, loaded_prefixed, grads_synced


def test_state_dict_round_trip(launched):
    results = results_of(launched, "state dict")
    for keys_match, loaded_bare, loaded_prefixed, _ in results:
        assert keys_match and loaded_bare and loaded_prefixed
    assert torch.equal(results[0][3], results[1][3])


def _bad_input_worker(rank, world_size):
    import fusedist

    errors = {}
    try:
        fusedist.DistributedDataParallel(nn.Linear(2, 2), device_ids=[0])
    except ValueError as exc:
        errors["device_ids"] = str(exc)
    # output_device alone on CPU: torch's DDP refuses it (its test: output_device=0 passes); it was ignored
    for ddp in (torch.nn.parallel.DistributedDataParallel, fusedist.DistributedDataParallel):
        for given in (0, 1):
            try:
                ddp(nn.Linear(2, 2), output_device=given)
                errors[f"output_device={given} {ddp.__module__}"] = "accepted"
            except ValueError as exc:
                errors[f"output_device={given} {ddp.__module__}"] = str(exc)
    # a negative cap: torch's DDP trains with it as no cap (one bucket), a negative list entry it refuses
    grads, buckets = {}, {}
    for ddp in (torch.nn.parallel.DistributedDataParallel, fusedist.DistributedDataParallel):
        torch.manual_seed(0)
        wrapped = ddp(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), bucket_cap_mb=-1)
        for step in range(2):
            wrapped(torch.randn(5, 3, generator=torch.Generator().manual_seed(10 * rank + step))).sum().backward()
        grads[ddp.__module__] = [p.grad.clone() for p in wrapped.parameters()]
        buckets[ddp.__module__] = wrapped
    errors["cap grads"] = all(torch.equal(a, b) for a, b in zip(*grads.values()))
    errors["cap buckets"] = len(buckets["fusedist.ddp.wrapper"].reducer.layout.buckets)
    try:
        fusedist.DistributedDataParallel(nn.Linear(2, 2), bucket_cap_mb_list=[-1])
    except ValueError as exc:
        errors["cap list"] = str(exc)
    try:
        fusedist.DistributedDataParallel(nn.Linear(2, 2), not_an_option=True)
    except TypeError as exc:
        errors["kwarg"] = str(exc)
    # torch's hook API: once, built-in averaging hooks on the model's group, other hooks not with
    # a reduce_dtype (tests/test_ddp_comm_hooks.py runs them); join() works (tests/test_ddp_join.py).
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    model = fusedist.DistributedDataParallel(nn.Linear(2, 2))
    try:
        fusedist.DistributedDataParallel(nn.Linear(2, 2), reduce_dtype=torch.bfloat16).register_comm_hook(
            powerSGD_hook.PowerSGDState(None), powerSGD_hook.powerSGD_hook)
    except ValueError as exc:
        errors["powersgd"] = str(exc)
    try:
        model.register_comm_hook(torch.distributed.new_group([0]), default_hooks.fp16_compress_hook)
    except ValueError as exc:
        errors["group"] = str(exc)
    model.register_builtin_comm_hook(torch.distributed.BuiltinCommHookType.FP16_COMPRESS)
    errors["builtin dtype"] = str(model.config.reduce_dtype)
    try:
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    except RuntimeError as exc:
        errors["twice"] = str(exc)
    try:
        fusedist.DistributedDataParallel(nn.Linear(2, 2), reduce_dtype=torch.bfloat16).register_comm_hook(
            None, default_hooks.fp16_compress_hook)
    except ValueError as exc:
        errors["conflict"] = str(exc)
    with model.join():
        pass  # every rank out at once: only the final broadcast
    errors["join"] = "ok"
    # torch's experimental mixed_precision: its reduce_dtype is honoured, casting is refused.
    from torch.nn.parallel.distributed import _MixedPrecision

    errors["mp none"] = str(fusedist.DistributedDataParallel(nn.Linear(2, 2), mixed_precision=None).config.reduce_dtype)
    errors["mp reduce"] = str(fusedist.DistributedDataParallel(
        nn.Linear(2, 2), mixed_precision=_MixedPrecision(reduce_dtype=torch.bfloat16)).config.reduce_dtype)
    try:
        fusedist.DistributedDataParallel(nn.Linear(2, 2), mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16))
    except NotImplementedError as exc:
        errors["mp cast"] = str(exc)
    # the tensors' own dtypes cast nothing (torch's DDP runs it as is; its integer buffers are not
    # floating, which torch documents as left alone): accepted; a dtype that changes one is refused
    same = _MixedPrecision(param_dtype=torch.float32, buffer_dtype=torch.float32)
    bn = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    kept = fusedist.DistributedDataParallel(bn, mixed_precision=same)
    errors["mp same"] = (str(kept.config.reduce_dtype), sorted(str(b.dtype) for b in bn.buffers()))
    for key, module, given in (("mp float64", nn.Linear(2, 2).double(), same),
                               ("mp buffer", bn, _MixedPrecision(buffer_dtype=torch.bfloat16))):
        try:
            fusedist.DistributedDataParallel(module, mixed_precision=given)
        except NotImplementedError as exc:
            errors[key] = str(exc)
    # not a _MixedPrecision (a string, a dict): torch's DDP fails on it; fusedist read it with defaults
    # and trained in float32 without a word
    for given in ("bf16", {"reduce_dtype": torch.bfloat16}):
        for ddp in (torch.nn.parallel.DistributedDataParallel, fusedist.DistributedDataParallel):
            try:
                ddp(nn.Linear(2, 2), mixed_precision=given)
                errors[f"mp {type(given).__name__} {ddp.__module__}"] = "accepted"
            except (AttributeError, TypeError) as exc:
                errors[f"mp {type(given).__name__} {ddp.__module__}"] = f"{type(exc).__name__}: {exc}"
    model._set_static_graph()  # accepted, as static_graph=True is
    # (an nn.Embedding(sparse=True) trains: its gradient is averaged apart; a sparse gradient
    # from elsewhere reaches the buckets)
    holder = nn.Module()
    holder.weight = nn.Parameter(torch.randn(10, 3))
    holder.forward = lambda ids: nn.functional.embedding(ids, holder.weight, sparse=True)
    emb = fusedist.DistributedDataParallel(holder)
    try:
        emb(torch.tensor([1, 2])).sum().backward()
    except RuntimeError as exc:
        errors["sparse"] = str(exc)
    return errors


def test_bad_input_messages(launched):
    for errors in results_of(launched, "bad input"):
        assert "device_ids=None for CPU" in errors["device_ids"] and "(rank " in errors["device_ids"]
        for module in ("torch.nn.parallel.distributed", "fusedist.ddp.wrapper"):
            assert errors[f"output_device=0 {module}"] == "accepted"
        assert "output_device 1" in errors["output_device=1 torch.nn.parallel.distributed"]
        ours = errors["output_device=1 fusedist.ddp.wrapper"]
        assert "output_device=1 given for a module on cpu" in ours and "device_ids=None for CPU" in ours, ours
        assert errors["cap grads"] is True and errors["cap buckets"] == 1
        assert "bucket_cap_mb_list must be a non-empty list of numbers of MiB >= 0" in errors["cap list"]
        assert "not_an_option" in errors["kwarg"]
        assert "sparse gradient" in errors["sparse"] and "'weight'" in errors["sparse"]
        assert "powerSGD_hook" in errors["powersgd"] and "reduce_dtype=torch.bfloat16" in errors["powersgd"]
        assert "state must be None or this model's process group" in errors["group"]
        assert errors["builtin dtype"] == "torch.float16"
        assert "can only be called once" in errors["twice"]
        assert "reduce_dtype=torch.bfloat16" in errors["conflict"] and "float16" in errors["conflict"]
        assert errors["join"] == "ok"
        assert errors["mp none"] == "None" and errors["mp reduce"] == "torch.bfloat16"
        assert "param_dtype" in errors["mp cast"] and "torch.autocast" in errors["mp cast"]
        assert errors["mp same"] == ("None", ["torch.float32", "torch.float32", "torch.int64"])
        assert "param_dtype=torch.float32 would cast parameter 'weight' (and 1 more) from torch.float64" in \
            errors["mp float64"], errors["mp float64"]
        assert "buffer_dtype=torch.bfloat16 would cast buffer '1.running_mean' (and 1 more)" in errors["mp buffer"]
        assert "(rank " in errors["mp buffer"]
        for given in ("str", "dict"):
            assert errors[f"mp {given} torch.nn.parallel.distributed"].startswith("AttributeError")
            ours = errors[f"mp {given} fusedist.ddp.wrapper"]
            assert ours.startswith("TypeError") and "mixed_precision must be torch's" in ours, ours
            assert f"got {given} " in ours and "reduce_dtype=torch.bfloat16" in ours and "(rank " in ours, ours


# ---------------------------------------------------------------- the shared launch (two ranks)
@pytest.fixture(scope="module")
def overlap_trace(tmp_path_factory):
    return str(tmp_path_factory.mktemp("overlap") / "trace")


@pytest.fixture(scope="module")
def launched(request, overlap_trace):
    return launch_for_selected(request, {
        "test_parity_with_torch_ddp": {"parity": (_parity_worker, ())},
        "test_unused_parameters": {"unused": (_unused_worker, ())},
        "test_fp16_average_does_not_overflow": {"fp16": (_fp16_worker, ())},
        "test_state_dict_round_trip": {"state dict": (_state_dict_worker, ())},
        "test_bad_input_messages": {"bad input": (_bad_input_worker, ())},
        "test_first_bucket_launches_before_backward_ends": {"overlap": (_overlap_worker, (overlap_trace,))},
    }, 2, timeout=420)
