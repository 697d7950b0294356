"""Complex parameters under fusedist's DDP and ZeRO, against torch's DDP and an unsharded optimizer.

torch's DDP keeps a complex parameter's gradient in a complex bucket and all-reduces it as its real
pairs (``view_as_real``); an average divides both parts. fusedist's buckets do the same (the
communicators carry a complex tensor as its real pairs), and ZeRO's shards are ranges of those
buckets, stepped as the fused and torch optimizers step complex parameters (on the real view);
ZeRO-Offload's host Adam steps complex64 shards as their real pairs too (complex128 is refused).

Tolerances: at world size 2 a reduction is one addition and a division by 2 (exact), so the
averaged gradients are bit-identical to torch's; what may differ is the optimizer's rounding
(fused kernels against torch's foreach AdamW): 1e-6 absolute for complex64/fp32 parameters of order
1 after a few steps (as tests/test_optim.py), 1e-12 for complex128/fp64.
The two-rank scenarios share one launch of the ranks (``launched``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shared_rank_launch import launch_for_selected, results_of

ATOL = {torch.float32: 1e-6, torch.complex64: 1e-6, torch.float64: 1e-12, torch.complex128: 1e-12}


class MixedNet(nn.Module):
    """A real layer, one complex parameter among real ones, and a complex linear layer."""

    def __init__(self, cdtype: torch.dtype, unused: bool = False, rdtype: torch.dtype = None):
        super().__init__()
        rdtype = rdtype or (torch.float32 if cdtype == torch.complex64 else torch.float64)
        self.inp = nn.Linear(6, 5, dtype=rdtype)
        self.phase = nn.Parameter(torch.randn(5, dtype=cdtype))
        self.w = nn.Parameter(torch.randn(4, 5, dtype=cdtype) / 3)
        self.b = nn.Parameter(torch.randn(4, dtype=cdtype))
        self.out = nn.Linear(4, 2, dtype=rdtype)
        self.spare = nn.Parameter(torch.randn(3, dtype=cdtype)) if unused else None

    def forward(self, x):
        h = self.inp(x.to(self.inp.weight.dtype)).to(self.phase.dtype) * self.phase
        h = h @ self.w.T + self.b
        return self.out(h.abs().to(self.out.weight.dtype))


class NcclDtypes:
    """A DDP model's communicator that refuses what NCCL cannot reduce (complex tensors), with the
    direct-NCCL communicator's own dtype check; the collectives themselves are the wrapped one's."""

    def __init__(self, comm):
        self.comm = comm

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def all_reduce(self, t, **kw):
        from fusedist.comm._nccl_types import nccl_dtype

        nccl_dtype(t.dtype, "DDP all-reduce")
        return self.comm.all_reduce(t, **kw)

    def reduce_scatter(self, out, src, **kw):
        from fusedist.comm._nccl_types import nccl_dtype

        nccl_dtype(out.dtype, "ZeRO reduce-scatter"), nccl_dtype(src.dtype, "ZeRO reduce-scatter")
        return self.comm.reduce_scatter(out, src, **kw)


def _nccl_dtypes_only(ddp):
    """``ddp``'s gradient engine on a communicator with NCCL's dtypes only."""
    ddp.reducer.comm = NcclDtypes(ddp.reducer.comm)
    return ddp


def _loss(model, x, y):
    return (model(x) - y).pow(2).mean()


def _train(ddp, opt, data, accumulate, clip=None):
    """Losses and the final parameters after a few steps (``accumulate``: a no_sync backward
    before each synchronized one; ``clip``: the function clipping the gradient norm to 0.5)."""
    losses = []
    for x, y in data:
        if accumulate:
            with ddp.no_sync():
                _loss(ddp, x * 0.5, y).backward()
        loss = _loss(ddp, x, y)
        loss.backward()
        if clip is not None:
            losses.append(clip(ddp.parameters(), 0.5).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in getattr(ddp, "module", ddp).parameters()]


def _ddp_cases_worker(rank, world):
    import fusedist
    from fusedist.optim import FusedAdamW, FusedSGD

    cases = [  # (name, complex dtype, DDP keywords, optimizer, accumulate)
        ("view", torch.complex64, dict(gradient_as_bucket_view=True, bucket_cap_mb=1e-4), "torch_adamw", False),
        ("copy", torch.complex64, dict(gradient_as_bucket_view=False), "fused_adamw", True),
        ("unused", torch.complex64, dict(find_unused_parameters=True), "fused_sgd", False),
        ("static", torch.complex128, dict(static_graph=True, bucket_cap_mb=1e-4), "fused_adamw", False),
        ("c128", torch.complex128, dict(gradient_as_bucket_view=True), "torch_sgd", True),
        ("replicate", torch.complex64, dict(), "fused_adamw", False),
    ]
    makers = {
        "torch_adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
        "fused_adamw": lambda ps: FusedAdamW(ps, lr=0.05, weight_decay=0.1),
        "fused_sgd": lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9),
        "torch_sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    }
    out = {}
    for name, cdtype, kw, opt_name, accumulate in cases:
        torch.manual_seed(0)
        model = MixedNet(cdtype, unused=kw.get("find_unused_parameters", False))
        gen = torch.Generator().manual_seed(100 + rank)
        data = [(torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen)) for _ in range(3)]
        ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), **kw)
        ours = (fusedist.replicate(copy.deepcopy(model)) if name == "replicate"
                else _nccl_dtypes_only(fusedist.DistributedDataParallel(copy.deepcopy(model), **kw)))
        want = _train(ref, makers[opt_name.replace("fused", "torch")](ref.parameters()), data, accumulate)
        got = _train(ours, makers[opt_name](ours.parameters()), data, accumulate)
        diffs = [(a - b).abs().max().item() for a, b in zip(got[1], want[1])]
        out[name] = dict(loss_diff=max(abs(a - b) for a, b in zip(got[0], want[0])), param_diff=max(diffs),
                         atol=ATOL[cdtype])
    return out


def test_ddp_trains_complex_parameters_as_torch_ddp(launched):
    for rank, out in enumerate(results_of(launched, "ddp cases")):
        for name, r in out.items():
            assert r["loss_diff"] <= r["atol"], (rank, name, r)
            assert r["param_diff"] <= r["atol"], (rank, name, r)


def _grads_after_backward(ddp, x, y):
    _loss(ddp, x, y).backward()
    return [p.grad.clone() for p in ddp.module.parameters()]


def _user_hook(state, bucket):
    """A hook of the user's own, recording what buffer it is handed."""
    import torch.distributed as dist

    buf = bucket.buffer()
    state.append((str(buf.dtype), buf.numel()))
    buf.div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _fp16_user_hook(state, bucket):
    """The user's hook under torch's fp16 compression wrapper (``set_buffer``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh

    return dh.fp16_compress_wrapper(_user_hook)(state, bucket)


def _set_buffer_hook(state, bucket):
    """A hook that compresses by ``set_buffer`` and reads ``gradients()`` of the new buffer: views
    shaped like the parameters, complex ones complex (torch's DDP cuts real views of a complex
    bucket's real pairs there, so this is not compared with torch's)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh

    before = [g.clone() for g in bucket.gradients()]
    bucket.set_buffer(bucket.buffer().to(torch.float16))
    after = bucket.gradients()
    state.append(all(a.shape == b.shape and a.is_complex() == b.is_complex()
                     and torch.allclose(a.to(b.dtype), b, rtol=1e-3, atol=1e-4) for a, b in zip(after, before)))
    return dh.allreduce_hook(None, bucket)


def _hooks_worker(rank, world):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh

    import fusedist

    torch.manual_seed(0)
    model = MixedNet(torch.complex64)
    gen = torch.Generator().manual_seed(7 + rank)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen)
    plain = _grads_after_backward(torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model)), x, y)
    out = {}
    for name, hook in [("allreduce", dh.allreduce_hook), ("fp16", dh.fp16_compress_hook),
                       ("bf16", dh.bf16_compress_hook), ("user", _user_hook), ("wrapped", _fp16_user_hook)]:
        ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        ours = fusedist.DistributedDataParallel(copy.deepcopy(model))
        seen = {"torch": [], "ours": []}
        ours.register_comm_hook(seen["ours"] if name in ("user", "wrapped") else None, hook)
        got = _grads_after_backward(ours, x, y)
        out[name] = dict(vs_plain=max((a - b).abs().max().item() for a, b in zip(got, plain)),
                         imag=min(a.imag.abs().max().item() for a in got if a.is_complex()))
        if name != "bf16":  # torch refuses bf16_compress_hook without NCCL (its engine fails on complex)
            ref.register_comm_hook(seen["torch"] if name in ("user", "wrapped") else None, hook)
            want = _grads_after_backward(ref, x, y)
            out[name].update(vs_torch_hook=max((a - b).abs().max().item() for a, b in zip(got, want)),
                             buffers=(sorted(seen["torch"]), sorted(seen["ours"])))
    seen = []
    ours = fusedist.DistributedDataParallel(copy.deepcopy(model))
    ours.register_comm_hook(seen, _set_buffer_hook)
    got = _grads_after_backward(ours, x, y)
    out["set_buffer"] = dict(vs_plain=max((a - b).abs().max().item() for a, b in zip(got, plain)),
                             imag=min(a.imag.abs().max().item() for a in got if a.is_complex()), views=seen)
    return out


def test_ddp_comm_hooks_on_complex_buckets(launched):
    """torch's DDP hands a hook a complex bucket's buffer as its real pairs (``view_as_real``):
    ``fp16_compress_hook`` sends both parts in fp16, and the future may hold the real pairs.
    fusedist's buckets do the same (Note [complex buckets] in fusedist/ddp/strategy.py), so every
    hook gives torch's gradients bit for bit at world size 2 (one fp16 addition, an exact
    halving), imaginary parts included. torch refuses ``bf16_compress_hook`` without NCCL (and
    its engine fails on a bf16 complex bucket), so fusedist's is checked against the plain average."""
    for out in results_of(launched, "hooks"):
        for name, r in out.items():
            assert r["imag"] > 0, (name, r)  # both parts reduced, never cast away
            if name not in ("bf16", "set_buffer"):
                assert r["vs_torch_hook"] == 0.0 and r["buffers"][0] == r["buffers"][1], (name, r)
        assert out["allreduce"]["vs_plain"] == 0.0 and out["user"]["vs_plain"] == 0.0, out
        # fp16 rounds gradients of order 1 by up to 2^-11 relative, bf16 by up to 2^-8
        assert 0 < out["fp16"]["vs_plain"] < 2e-3 and 0 < out["bf16"]["vs_plain"] < 1e-2, out
        assert out["set_buffer"]["views"] == [True, True] and out["set_buffer"]["vs_plain"] < 2e-3, out


def _ratio(got, want):
    """The largest difference between ``got`` and ``want`` (tensors or floats) in units of the
    tolerance of each one's dtype."""
    return max((a - b).abs().max().item() / ATOL[b.dtype] if isinstance(b, torch.Tensor) else abs(a - b) / 1e-6
               for a, b in zip(got, want))


def _zero_worker(rank, world):
    import warnings

    import fusedist
    from fusedist.optim import FusedAdamW

    out = {}
    # fp32 with complex64; complex128 parameters among frozen fp32 ones (their norm is taken in fp64)
    for cdtype in (torch.complex64, torch.complex128):
        torch.manual_seed(1)
        model = MixedNet(cdtype, rdtype=torch.float32)
        if cdtype == torch.complex128:
            model.inp.requires_grad_(False)
            model.out.requires_grad_(False)
        gen = torch.Generator().manual_seed(30 + rank)
        data = [(torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen)) for _ in range(3)]
        ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1)
        # the global norm over complex and real gradient shards (torch's: of the magnitudes); with
        # complex64 over all parameters but the last (a subset: stage 2 scales those shards itself)
        norm, some = (2.0, slice(0, -1)) if cdtype == torch.complex64 else (float("inf"), slice(None))

        def clipper(clip):
            return lambda params, max_norm: clip(list(params)[some], max_norm, norm_type=norm)

        want = _train(ref, ref_opt, data, False, clipper(torch.nn.utils.clip_grad_norm_))
        want_state = ref_opt.state_dict()["state"]
        # ZeRO-Offload steps complex64 shards on the host as their real pairs (complex128: refused)
        offloaded = [(1, FusedAdamW, "offload"), (2, torch.optim.AdamW, "offload")] if cdtype == torch.complex64 else []
        for stage, inner, wrap in [(1, FusedAdamW, "fusedist"), (1, torch.optim.AdamW, "fusedist"),
                                   (2, FusedAdamW, "fusedist"), (2, torch.optim.AdamW, "fusedist"),
                                   (1, FusedAdamW, "torch")] + offloaded:
            ddp_class = (torch.nn.parallel.DistributedDataParallel if wrap == "torch"
                         else fusedist.DistributedDataParallel)
            ddp = ddp_class(copy.deepcopy(model), bucket_cap_mb=1e-4)
            zero = fusedist.ZeroRedundancyOptimizer(ddp.parameters(), inner, stage=stage, lr=0.05,
                                                    weight_decay=0.1, offload="cpu" if wrap == "offload" else None)
            if wrap != "torch":
                _nccl_dtypes_only(ddp)
            got = _train(ddp, zero, data, False, clipper(fusedist.clip_grad_norm_))
            zero.consolidate_state_dict(0)
            state = zero.state_dict()["state"] if rank == 0 else want_state
            pairs = [(state[i][k], v) for i, st in want_state.items() for k, v in st.items() if k != "step"]
            assert all(a.dtype == b.dtype for a, b in pairs)  # complex moments for complex parameters
            out[f"{cdtype}-stage{stage}-{inner.__name__}-{wrap}"] = max(
                _ratio(got[0], want[0]), _ratio(got[1], want[1]), _ratio(*zip(*pairs)))
    # torch's AdamW state (complex moments) loaded into ZeRO-2 (its host masters and moments with
    # offload), both going on from there; a cast of a complex state to real anywhere on the way is an error
    for offload in (None, "cpu"):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="Casting complex values to real")
            torch.manual_seed(4)
            ref = torch.nn.parallel.DistributedDataParallel(MixedNet(torch.complex64))
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
            _train(ref, ref_opt, data[:1], False)
            ddp = fusedist.DistributedDataParallel(copy.deepcopy(ref.module))
            zero = fusedist.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, stage=2, lr=0.05,
                                                    offload=offload)
            zero.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
            want, got = _train(ref, ref_opt, data[1:], False), _train(ddp, zero, data[1:], False)
            out[f"loaded, offload {offload}"] = max(_ratio(got[0], want[0]), _ratio(got[1], want[1]))
    # a bf16 reduce-scatter of a complex bucket (its real pairs) against DDP's bf16 all-reduce
    torch.manual_seed(2)
    model = MixedNet(torch.complex64)
    runs = []
    for stage in (None, 2):
        ddp = fusedist.DistributedDataParallel(copy.deepcopy(model), reduce_dtype=torch.bfloat16)
        opt = (torch.optim.AdamW(ddp.parameters(), lr=0.05) if stage is None
               else fusedist.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, stage=stage, lr=0.05))
        _nccl_dtypes_only(ddp)
        runs.append(_train(ddp, opt, data, False))
    out["bf16-stage2"] = max(_ratio(runs[1][0], runs[0][0]), _ratio(runs[1][1], runs[0][1]))
    return out


def test_zero_shards_complex_parameters_as_the_unsharded_optimizer(launched):
    for out in results_of(launched, "zero"):
        for name, worst in out.items():
            assert worst <= 1.0, (name, worst)  # in units of each dtype's tolerance


def _checks_worker(rank, world):
    import fusedist

    out = {}
    torch.manual_seed(3)
    model = MixedNet(torch.complex64)
    gen = torch.Generator().manual_seed(50 + rank)
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen)
    # ZeRO-Offload's host Adam has FP32 masters only: complex128 refused, naming the parameter and the way out
    wide = fusedist.DistributedDataParallel(MixedNet(torch.complex128, rdtype=torch.float32))
    try:
        fusedist.ZeroRedundancyOptimizer(wide.parameters(), torch.optim.AdamW, offload="cpu", lr=0.1)
        out["offload"] = "accepted"
    except TypeError as e:
        out["offload"] = str(e)
    ddp = fusedist.DistributedDataParallel(copy.deepcopy(model))
    # The parameter digest sees a change of an imaginary part on one rank only.
    _loss(ddp, x, y).backward()
    ddp.check_consistency()
    if rank == 1:
        with torch.no_grad():
            ddp.module.phase[2] += 1e-6j
    try:
        ddp.check_consistency()
        out["digest"] = "unnoticed"
    except fusedist.RankMismatchError as e:
        out["digest"] = str(e)
    # A complex parameter frozen at wrapping and trainable later is averaged as torch's DDP averages
    # it; in bf16, as fusedist's buckets average it (its real pairs in bf16, imaginary parts kept).
    for key, reduce_dtype in (("thawed", None), ("thawed_bf16", torch.bfloat16)):
        frozen = copy.deepcopy(model)
        frozen.phase.requires_grad_(False)
        ours = _nccl_dtypes_only(fusedist.DistributedDataParallel(frozen, reduce_dtype=reduce_dtype))
        ours.module.phase.requires_grad_(True)
        got = _grads_after_backward(ours, x, y)
        ref = (torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model)) if reduce_dtype is None
               else fusedist.DistributedDataParallel(copy.deepcopy(model), reduce_dtype=reduce_dtype))
        want = _grads_after_backward(ref, x, y)
        out[key] = max((a - b).abs().max().item() for a, b in zip(got, want))
    # Complex parameters thawed after ZeRO-Offload's first steps join its host shards (grown in
    # complex64); the reference is torch's AdamW on the same DDP model (whose thawed gradients are
    # checked against torch's DDP above).
    runs = []
    for offload in (False, True):
        thawing = copy.deepcopy(model)
        thawing.w.requires_grad_(False)
        ddp = fusedist.DistributedDataParallel(thawing)
        opt = (fusedist.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, stage=2, offload="cpu", lr=0.05)
               if offload else torch.optim.AdamW(ddp.parameters(), lr=0.05))
        _train(ddp, opt, [(x, y)], False)
        thawing.w.requires_grad_(True)
        runs.append(_train(ddp, opt, [(x * 2, y), (x, y)], False))
    out["offload thawed"] = _ratio(runs[1][0] + runs[1][1], runs[0][0] + runs[0][1])
    # Complex parameters joining a ZeRO optimizer by add_param_group (under torch's DDP).
    runs = []
    for sharded in (False, True):
        ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
        real = [p for p in ddp.parameters() if not p.is_complex()]
        opt = (fusedist.ZeroRedundancyOptimizer(real, torch.optim.AdamW, lr=0.05) if sharded
               else torch.optim.AdamW(real, lr=0.05))
        opt.add_param_group({"params": [p for p in ddp.parameters() if p.is_complex()]})
        runs.append(_train(ddp, opt, [(x, y), (x * 2, y)], False))
    out["joined"] = _ratio(runs[1][0] + runs[1][1], runs[0][0] + runs[0][1])
    return out


def test_complex_refusals_digest_and_thawed_parameters(launched):
    for out in results_of(launched, "checks"):
        assert "parameter 0 has dtype torch.complex128" in out["offload"], out  # phase
        assert "offload=None" in out["offload"], out
        assert "'phase'" in out["digest"], out
        # world size 2: exact (one addition, an exact halving), in bf16 too
        assert out["thawed"] == 0.0 and out["thawed_bf16"] == 0.0, out
        assert out["joined"] <= 1.0, out  # in units of each dtype's tolerance
        assert out["offload thawed"] <= 1.0, out


# ---------------------------------------------------------------- the shared launch
@pytest.fixture(scope="module")
def launched(request):
    return launch_for_selected(request, {
        "test_ddp_trains_complex_parameters_as_torch_ddp": {"ddp cases": (_ddp_cases_worker, ())},
        "test_ddp_comm_hooks_on_complex_buckets": {"hooks": (_hooks_worker, ())},
        "test_zero_shards_complex_parameters_as_the_unsharded_optimizer": {"zero": (_zero_worker, ())},
        "test_complex_refusals_digest_and_thawed_parameters": {"checks": (_checks_worker, ())},
    }, 2, timeout=300)
