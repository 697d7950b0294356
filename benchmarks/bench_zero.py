"""Benchmark: ZeRO's communication and step time against DDP with an unsharded optimizer.

Part 1 -- collectives for the same Ψ elements (fp32): one all-reduce (what DDP + an
unsharded optimizer moves) against a reduce-scatter of Ψ followed by an all-gather of Ψ
(what ZeRO stage 2 moves: gradients reduce-scattered in backward, parameters all-gathered
after the step). Both move 2Ψ(N-1)/N elements per rank on a ring; the target is RS+AG
within 1.1x of AR. Ratio > 1 means RS+AG is slower. On gloo, RS+AG is timed twice in the
same run: through fusedist's point-to-point exchange (the communicator's default) and
through gloo's builtin collectives.

Part 2 -- a training iteration (forward + backward + step) of an MLP:
  ddp+adamw   fusedist DDP, torch.optim.AdamW(fused=True) on full parameters
  zero1       fusedist DDP, ZeroRedundancyOptimizer(stage=1, AdamW(fused=True))
  zero2       fusedist DDP, ZeroRedundancyOptimizer(stage=2, AdamW(fused=True))
  zeroN+offload  the same with offload="cpu": masters and AdamW state in host memory, stepped
              by the C++ CPU Adam per bucket (on CPU "devices" this measures the offload
              pipeline's overhead, not the device memory it frees on a GPU)
with the memory each rank holds for master weights + optimizer state (memory_stats()), and
for the offload rows how much of the rank's optimizer memory is on the host / device. Every
row also gives the most full-gradient memory held during the last backward
(``reducer.last_stats["peak_grad_bytes"]``) next to all of it: stage 2 releases each bucket
once its reduce-scatter is stored, so its peak is a few buckets (DDP and stage 1 hold all).
The unsharded baseline holds fp32 moments only (its master weights are the parameters).

Part 3 (``--stage3``) -- ZeRO stage 3: ``fusedist.fully_shard`` against torch's FSDP2
``fully_shard`` with the same wrapping (each block, then the root; same defaults), both stepped
by ``torch.optim.AdamW``, on a stack of 8 transformer-MLP blocks (width 320 on CPU: ~6.5M
parameters), timed interleaved in one run (median of paired ratios). Memory: each contender
alone in a fresh process, the growth of the process's peak RSS over a few steps from just
before the model is built, next to the formula 16Ψ/N + two largest units gathered +
activations (activations: the bytes autograd saves in one forward) and fusedist's own
accounting (memory_stats: shards, gathered and scratch peaks). With ``--float8`` the blocks'
Linears are torchao's float8 training weights on both sides, gathered as float8 (FSDP2's
all-gather extension; results ``..._stage3_float8_<date>``); with ``--qlora`` they are QLoRA
layers, frozen NF4 weights with trainable rank-8 adapters (``..._stage3_qlora_<date>``).

Part 4 (``--memory``) -- one model (part 3's 8 transformer-MLP blocks), per-rank model-state
bytes for DDP + AdamW, ZeRO-1, ZeRO-2, ZeRO-3 (``fusedist.fully_shard``) and the offload
variants of ZeRO-2 and ZeRO-3, each alone in a fresh process: the bytes of every tensor
storage alive right after a step (before ``zero_grad``: parameters, gradients, master weights,
optimizer state, bucket and staging buffers; found by walking the live objects, so every
variant is counted the same way, minus what was alive before the model was built), next to
the textbook figure for fp32 Adam, and the growth of the peak RSS over building the model
and the steps (activations and temporaries included).

Every rank runs the same loop; timings are rank 0's, each repetition after a barrier. gloo
on CPU; ``--device cuda`` uses NCCL, one GPU per rank (run it on a GPU machine; the script
never reports GPU numbers it did not measure).

Usage: python benchmarks/bench_zero.py [--world-size 2] [--device cpu|cuda] [--quick]
       [--iterations-only | --collectives-only | --stage3 [--float8 | --qlora] | --memory]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, rank_device, time_interleaved, write_results  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, comm, warmup, repeats, run=1):
    """Median and p20/p80 in ms of ``fn``; each sample is ``run`` calls back to back (divided
    by ``run``), so work one call leaves in flight -- ZeRO's overlapped parameter all-gathers
    -- is paid by the next call as in a training loop, not hidden in the barrier between
    samples."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        comm.barrier()
        _sync(device)
        start = time.perf_counter()
        for _ in range(run):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - start) * 1e3 / run)
    q = statistics.quantiles(samples, n=10) if len(samples) > 1 else samples * 9
    return statistics.median(samples), q[1], q[7]


def _collectives(rank, world_size, device, sizes, repeats):
    """One all-reduce of Ψ against RS + AG of Ψ, for every reduce-scatter / all-gather
    implementation this backend has: on gloo, fusedist's point-to-point exchange (what the
    communicator uses) and gloo's builtin collectives; on NCCL, the communicator's."""
    from fusedist.comm import TorchCommunicator, get_communicator

    comm = get_communicator(None, device)
    # name -> (communicator, launched with async_op=True and then waited, as ZeRO launches
    # them; on gloo that hands the exchange to its progress thread, Note [exchange progress])
    impls = {"nccl" if device.type == "cuda" else "p2p exchange": (comm, False)}
    if device.type == "cpu":
        impls["p2p exchange, async launch"] = (comm, True)
        impls["gloo builtin"] = (TorchCommunicator(gloo_collectives="builtin"), False)
    rows = []
    for numel in sizes:
        numel = numel // (world_size * 16) * (world_size * 16)
        full = torch.randn(numel, device=device)
        # As ZeRO calls them: the reduce-scatter of a gradient bucket into a separate shard, the
        # all-gather of the parameters in place (each rank's shard is its slice of the bucket).
        grad_shard = torch.empty(numel // world_size, device=device)
        own = full.view(world_size, -1)[rank]
        fns = {"ar": lambda: comm.all_reduce(full)}
        if device.type == "cpu":
            # The floor of the latency-bound range: gloo's own all-to-all (one C++ collective)
            # moving a reduce-scatter's bytes, plus the same fold.
            landing = torch.empty_like(full)

            def a2a_reduce_scatter():
                torch.distributed.all_to_all_single(landing, full)
                torch.sum(landing.view(world_size, -1), 0, out=grad_shard)

            fns["rs a2a"] = a2a_reduce_scatter
            # The floor of any point-to-point implementation: the same messages as the exchange
            # (one per peer and direction) posted straight on the process group, without the
            # communicator's checks, tags, timeouts and completion tracking.
            bare_rs, bare_ag = _bare_p2p(full, grad_shard, rank, world_size)
            fns["rsag bare"] = lambda: (bare_rs(), bare_ag())
            fns["rs bare"], fns["ag bare"] = bare_rs, bare_ag
        for impl, (c, a) in impls.items():
            fns[f"rsag {impl}"] = lambda c=c, a=a: (c.reduce_scatter(grad_shard, full, async_op=a).wait(),
                                                    c.all_gather(full, own, async_op=a).wait())
            fns[f"rs {impl}"] = lambda c=c, a=a: c.reduce_scatter(grad_shard, full, async_op=a).wait()
            fns[f"ag {impl}"] = lambda c=c, a=a: c.all_gather(full, own, async_op=a).wait()
        t = time_interleaved(fns, device, comm, 2, repeats)
        ar = t["ar"]
        busbytes = 2 * numel * 4 * (world_size - 1) / world_size
        for impl in impls:
            rsag = t[f"rsag {impl}"]
            paired = [z / b for z, b in zip(t["_samples"][f"rsag {impl}"], t["_samples"]["ar"])]
            rows.append({
                "part": "collectives", "config": f"{numel / 1e6:.1f}M fp32, RS+AG by {impl}",
                "baseline_ms": ar[0], "zero_ms": rsag[0], "ratio_zero/baseline": rsag[0] / ar[0],
                "ratio_paired": statistics.median(paired),
                "baseline_busbw_GBs": busbytes / ar[0] / 1e6, "zero_busbw_GBs": busbytes / rsag[0] / 1e6,
                "baseline_p20_p80": f"{ar[1]:.2f}-{ar[2]:.2f}", "zero_p20_p80": f"{rsag[1]:.2f}-{rsag[2]:.2f}",
                "reduce_scatter_ms": t[f"rs {impl}"][0], "all_gather_ms": t[f"ag {impl}"][0],
                "gloo_all_to_all_rs_ms": t["rs a2a"][0] if "rs a2a" in t else "",
                "bare_p2p_rsag_ms": t["rsag bare"][0] if "rsag bare" in t else "",
                "bare_p2p_ratio_paired": (statistics.median(
                    [z / b for z, b in zip(t["_samples"]["rsag bare"], t["_samples"]["ar"])])
                    if "rsag bare" in t else ""),
            })
    return rows


def _bare_p2p(full, grad_shard, rank, world_size):
    """Reduce-scatter and all-gather of ``full`` by bare ``send``/``recv`` on the default
    group: every receive posted, then every send, then waited; the reduction adds the peers'
    slices to this rank's own. For measurement only (no checks, no timeout)."""
    group = torch.distributed.group.WORLD
    rows = full.view(world_size, -1)
    peers = [(rank + k) % world_size for k in range(1, world_size)]
    landing = torch.empty(max(world_size - 2, 0), rows.shape[1])

    def reduce_scatter():
        # Two ranks: the peer's slice lands in the output itself, as in the exchange.
        targets = [grad_shard] + list(landing)
        recvs = [group.recv([targets[i]], src, 901) for i, src in enumerate(peers)]
        sends = [group.send([rows[dst]], dst, 901) for dst in peers]
        for w in recvs + sends:
            w.wait()
        if world_size > 2:
            grad_shard.add_(landing.sum(0))
        grad_shard.add_(rows[rank])

    def all_gather():
        recvs = [group.recv([rows[src]], src, 902) for src in peers]
        sends = [group.send([rows[rank]], dst, 902) for dst in peers]
        for w in recvs + sends:
            w.wait()

    return reduce_scatter, all_gather


class _MLP(nn.Module):
    def __init__(self, d, layers):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _training(rank, world_size, device, d, layers, batch, repeats):
    import fusedist
    from fusedist.comm import get_communicator

    comm = get_communicator(None, device)
    gen = torch.Generator(device="cpu").manual_seed(rank)
    x = torch.randn(batch, d, generator=gen).to(device)
    y = torch.randn(batch, d, generator=gen).to(device)
    results = {}
    names = ("ddp+adamw", "zero1", "zero2", "zero1+offload", "zero2+offload", "zero2 1-layer buckets",
             "zero1 overlapped gather", "zero2 overlapped gather")
    # Stage 2 frees each bucket once reduced: with buckets of about one layer its peak
    # full-gradient memory in backward is a few layers' worth (the default buckets hold most
    # of this model in one).
    layer_mb = (d * d + d) * 4 / 2**20 * 1.01
    ddp_kwargs = {"zero2 1-layer buckets": dict(bucket_cap_mb=layer_mb, first_bucket_cap_mb=layer_mb)}
    # overlap_param_gather=True: step() returns before the parameter all-gathers land and the
    # next forward waits for them; by default every gather completes inside step(), as with
    # torch's ZeroRedundancyOptimizer.
    overlapped = dict(overlap_param_gather=True)
    zero_kwargs = {"zero1 overlapped gather": overlapped, "zero2 overlapped gather": overlapped}
    for name in names:
        torch.manual_seed(0)
        model = fusedist.DistributedDataParallel(_MLP(d, layers).to(device), **ddp_kwargs.get(name, {}))
        if name == "ddp+adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        else:
            stage, _, offload = name[len("zero"):].split(" ")[0].partition("+")
            opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=int(stage),
                                                   lr=1e-4, fused=True, offload="cpu" if offload else None,
                                                   **zero_kwargs.get(name, {}))

        def iteration():
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()

        timing = _time(iteration, device, comm, 3, repeats, run=4)
        last = model.reducer.last_stats
        grad_mem = (last["peak_grad_bytes"], last["grad_bytes"], last["buckets"], last["buckets_finished_in_backward"])
        if name == "ddp+adamw":
            state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                        if isinstance(v, torch.Tensor))
        else:
            opt.wait_for_params()
            stats = opt.memory_stats()
            state = (stats["total_bytes"], stats["host_bytes"], stats["device_bytes"])
        results[name] = (timing, state, grad_mem)
    psi = sum(p.numel() for p in _MLP(d, layers).parameters())
    base_t, base_mem, _ = results["ddp+adamw"]
    rows = []
    for name in names[1:]:
        t, (mem, host, dev), (peak_grad, all_grad, buckets, early) = results[name]
        rows.append({
            "part": "iteration",
            "config": f"{name} vs ddp+adamw, MLP {layers}x{d} ({psi / 1e6:.2f}M params), batch {batch}",
            "baseline_ms": base_t[0], "zero_ms": t[0], "ratio_zero/baseline": t[0] / base_t[0],
            "baseline_busbw_GBs": "", "zero_busbw_GBs": "",
            "baseline_p20_p80": f"{base_t[1]:.2f}-{base_t[2]:.2f}", "zero_p20_p80": f"{t[1]:.2f}-{t[2]:.2f}",
            "baseline_state_MB": base_mem / 2**20, "zero_state_MB_per_rank": mem / 2**20,
            "zero_host_MB": host / 2**20, "zero_device_MB": dev / 2**20,
            "zero_peak_grad_MB_in_backward": peak_grad / 2**20, "grad_MB": all_grad / 2**20,
            "buckets": buckets, "buckets_finished_in_backward": early,
        })
    return rows


class _MLPBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class _QLoRALinear(nn.Module):
    """QLoRA's linear layer: ``linear``'s weight frozen in NF4 (torchao), its bias frozen, and a
    trainable rank-8 update."""

    def __init__(self, linear: nn.Linear, rank: int = 8):
        super().__init__()
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        out_features, in_features = linear.weight.shape
        self.weight = nn.Parameter(to_nf4(linear.weight.detach()), requires_grad=False)
        self.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, in_features, device=linear.weight.device) / in_features ** 0.5)
        self.lora_b = nn.Parameter(torch.randn(out_features, rank, device=linear.weight.device) / rank ** 0.5 * 0.1)

    def forward(self, x):
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight) + self.bias + (x @ self.lora_a.t()) @ self.lora_b.t()


def _stage3_model(kind: str, d: int, layers: int, mesh, device, variant: str = "fp32"):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fusedist

    torch.manual_seed(0)
    model = nn.Sequential(*[_MLPBlock(d) for _ in range(layers)]).to(device)
    if variant == "float8":  # torchao's float8 training, weights gathered as float8 (FSDP2's all-gather extension)
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    elif variant == "qlora":  # frozen NF4 weights gathered as NF4, trainable adapters (and norms)
        for block in model:
            block.fc1, block.fc2 = _QLoRALinear(block.fc1), _QLoRALinear(block.fc2)
    shard = torch_fully_shard if kind == "torch" else fusedist.fully_shard
    for block in model:
        shard(block, mesh=mesh, reshard_after_forward=None)
    shard(model, mesh=mesh, reshard_after_forward=None)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)


def _stage3_step(model, opt, x):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _stage3_config(device, variant: str = "fp32"):
    if device.type == "cuda":
        return dict(d=2048, layers=8, batch=(8, 512))
    # (float8 matmuls are emulated on the CPU, ~100x slower than fp32 ones: a smaller stack; NF4
    # weights need widths whose blocks of scales the ranks divide: 256)
    return {"float8": dict(d=128, layers=4, batch=(8, 32)), "qlora": dict(d=256, layers=8, batch=(16, 64))}.get(
        variant, dict(d=320, layers=8, batch=(16, 64)))


def _stage3_timing(rank, world_size, device, repeats, variant="fp32"):
    """fusedist.fully_shard vs torch FSDP2, one step each per repetition, interleaved."""
    from torch.distributed.device_mesh import init_device_mesh

    from fusedist.comm import get_communicator

    cfg = _stage3_config(device, variant)
    mesh = init_device_mesh(device.type, (world_size,))
    comm = get_communicator(None, device)
    models = {kind: _stage3_model(kind, cfg["d"], cfg["layers"], mesh, device, variant)
              for kind in ("torch", "fusedist")}
    x = torch.randn(*cfg["batch"], cfg["d"], device=device)
    res = time_interleaved({k: (lambda m=m, o=o: _stage3_step(m, o, x)) for k, (m, o) in models.items()},
                            device, comm, warmup=2, repeats=repeats)
    samples = res.pop("_samples")
    ratios = [b / a for a, b in zip(samples["torch"], samples["fusedist"])]
    numel = sum(p.numel() for p in models["torch"][0].parameters())  # DTensors: global sizes
    return [{
        "part": "stage3", "case": f"{cfg['layers']} MLP blocks d={cfg['d']}, batch {cfg['batch']}"
                                  + {"float8": ", float8 (torchao, float8 all-gathers)",
                                     "qlora": ", QLoRA (frozen NF4 Linears, rank-8 adapters)"}.get(variant, ""),
        "params_M": round(numel / 1e6, 2),
        "torch_fsdp2_ms": res["torch"][0], "fusedist_ms": res["fusedist"][0],
        "fusedist_p20_ms": res["fusedist"][1], "fusedist_p80_ms": res["fusedist"][2],
        "ratio_paired": statistics.median(ratios), "target": "<= 0.9",
    }]


def _peak_mib(device) -> float:
    """The process's peak memory so far: host RSS on CPU, allocated device memory on CUDA."""
    import resource

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / (1 << 20)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _stage3_memory(rank, world_size, device_type, kind, steps, variant="fp32"):
    """Peak memory growth of one contender alone in this process (MiB; RSS on CPU, allocated
    device memory on CUDA), and the formula's terms."""
    from torch.distributed.device_mesh import init_device_mesh

    device = rank_device(device_type, rank)
    cfg = _stage3_config(device, variant)
    mesh = init_device_mesh(device.type, (world_size,))
    x = torch.randn(*cfg["batch"], cfg["d"], device=device)
    before = _peak_mib(device)
    model, opt = _stage3_model(kind, cfg["d"], cfg["layers"], mesh, device, variant)
    # The bytes autograd saves, by storage; sizes only: holding the storages kept one forward's
    # activations alive through the timed steps, and the peak then measured twice the
    # activations plus the states for both contenders alike (an H200 run: equal to the MiB).
    saved: dict = {}

    def note_saved(t):
        saved.update((s.data_ptr(), s.nbytes()) for s in _storages(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(note_saved, lambda t: t):
        model(x).square().mean().backward()
    opt.zero_grad()
    for _ in range(steps):
        _stage3_step(model, opt, x)
    peak = _peak_mib(device) - before
    mib = 1 << 20
    activations = sum(saved.values()) / mib
    out = {"kind": kind, "peak_growth_MiB": peak, "activations_MiB": activations}
    if kind == "fusedist":
        stats = model.memory_stats()
        psi = sum(s.numel for b in model for s in _unit(b).layout.slots)
        out.update(psi=psi, largest_unit_MiB=stats["largest_unit_bytes"] / mib,
                   states_MiB=16 * psi / world_size / mib,
                   accounted_MiB=(stats["sharded_bytes"] * 4 + stats["peak_gathered_bytes"]
                                  + stats["peak_scratch_bytes"] + stats["comm_scratch_bytes"]) / mib + activations)
    return out


def _storages(t: torch.Tensor) -> list:
    """The storages holding ``t``'s data: its own, or a tensor subclass's inner tensors' (a float8
    weight's bytes), which have storages where the subclass has none."""
    if hasattr(t, "__tensor_flatten__"):
        return [s for name in t.__tensor_flatten__()[0] for s in _storages(getattr(t, name))]
    return [t.untyped_storage()]


def _unit(module):
    from fusedist.fsdp.state import state_of

    return state_of(module).unit


def _stage3(world_size, device_type, repeats, threads, backend, variant="fp32"):
    from fusedist.testing import run_distributed

    rows = run_distributed(_stage3_worker, world_size, device_type, repeats, variant, backend=backend, timeout=1800,
                           pg_timeout=600, threads=threads)[0]
    mem = {kind: run_distributed(_stage3_memory, world_size, device_type, kind, 3, variant, backend=backend,
                                 timeout=600, threads=threads)[0] for kind in ("torch", "fusedist")}
    f = mem["fusedist"]
    formula = f["states_MiB"] + 2 * f["largest_unit_MiB"] + f["activations_MiB"]
    rows[0].update(memory="device allocated" if device_type == "cuda" else "host RSS",
                   torch_peak_growth_MiB=mem["torch"]["peak_growth_MiB"],
                   fusedist_peak_growth_MiB=f["peak_growth_MiB"],
                   fusedist_accounted_MiB=f["accounted_MiB"], formula_MiB=formula,
                   formula_terms=f"16Ψ/N {f['states_MiB']:.1f} + 2 units {2 * f['largest_unit_MiB']:.1f} "
                                 f"+ activations {f['activations_MiB']:.1f}")
    return rows


MEMORY_KINDS = ("ddp+adamw", "zero1", "zero2", "zero3", "zero2+offload", "zero3+offload")


def _live_storages() -> dict:
    """data_ptr -> (nbytes, a tensor on it) of every tensor storage Python objects reach."""
    import gc

    out = {}
    for obj in gc.get_objects():
        if torch.is_tensor(obj) and obj.device.type != "meta":
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):  # e.g. tensor subclasses without storage
                continue
            if storage.nbytes():
                out[storage.data_ptr()] = (storage.nbytes(), obj)
    return out


def _memory_model(kind: str, world_size: int, device):
    """(model, optimizer) for one row of the memory table (fp32, AdamW)."""
    import fusedist

    cfg = _stage3_config(device)
    torch.manual_seed(0)
    model = nn.Sequential(*[_MLPBlock(cfg["d"]) for _ in range(cfg["layers"])]).to(device)
    if kind.startswith("zero3"):
        offload = fusedist.CPUOffloadPolicy() if kind.endswith("offload") else None
        for block in model:
            fusedist.fully_shard(block, offload_policy=offload)
        fusedist.fully_shard(model, offload_policy=offload)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    model = fusedist.DistributedDataParallel(model)
    if kind == "ddp+adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    stage = int(kind[len("zero")])
    return model, fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-4,
                                                   offload="cpu" if kind.endswith("offload") else None)


def _memory_worker(rank, world_size, device_type, kind, steps):
    """Model-state bytes alive after a step, and peak RSS growth, of one variant alone."""
    import resource

    device = torch.device(device_type)
    cfg = _stage3_config(device)
    x = torch.randn(*cfg["batch"], cfg["d"], device=device)
    before_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    before = _live_storages()  # kept alive, so no new storage can take one of their addresses
    model, opt = _memory_model(kind, world_size, device)
    psi = sum(p.numel() for p in _MLPBlock(cfg["d"]).parameters()) * cfg["layers"]
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    if hasattr(opt, "wait_for_params"):
        opt.wait_for_params()
    after = _live_storages()
    state = sum(n for ptr, (n, _) in after.items() if ptr not in before)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before_rss
    del before, after
    mib = 1 << 20
    own = ""
    if hasattr(opt, "memory_stats"):  # ZeRO's own accounting of what it adds to the model
        st = opt.memory_stats()
        own = (f"masters {st['master_bytes'] / mib:.1f} + AdamW state {st['optimizer_state_bytes'] / mib:.1f} "
               f"+ gradient shard {st['gradient_shard_bytes'] / mib:.1f}; host {st['host_bytes'] / mib:.1f}, "
               f"device {st['device_bytes'] / mib:.1f}")
    elif hasattr(model, "memory_stats"):
        st = model.memory_stats()
        own = f"shards {st['sharded_bytes'] / mib:.1f} + gradient shards {st['sharded_grad_bytes'] / mib:.1f}"
    return {"kind": kind, "psi": psi, "model_state_bytes": state, "peak_rss_growth_MiB": peak, "own": own}


def _textbook(kind: str, psi: int, n: int) -> str:
    """Parameters + gradients + AdamW state for fp32 parameters (4 + 4 + 8 bytes per element;
    no master copy: fp32 parameters are their own masters), sharded as each stage shards them,
    without padding, buckets or staging. Offload keeps an FP32 master copy of the shard (host)."""
    mib = 1 << 20
    figures = {
        "ddp+adamw": (16 * psi, "16Ψ"),
        "zero1": (8 * psi + 8 * psi / n, "8Ψ + 8Ψ/N"),
        "zero2": (4 * psi + 12 * psi / n, "4Ψ + 12Ψ/N"),
        "zero2+offload": (4 * psi + 16 * psi / n, "4Ψ + 16Ψ/N"),
        "zero3": (16 * psi / n, "16Ψ/N"),
    }
    value, text = figures[kind if kind in figures else kind.split("+")[0]]
    return f"{text} = {value / mib:.1f}"


def _memory(world_size, device_type, threads, backend, steps=3):
    from fusedist.testing import run_distributed

    rows = []
    for kind in MEMORY_KINDS:
        per_rank = run_distributed(_memory_worker, world_size, device_type, kind, steps, backend=backend,
                                   timeout=900, threads=threads)
        mib = 1 << 20
        r0 = per_rank[0]
        rows.append({
            "part": "memory", "variant": kind, "params_M": round(r0["psi"] / 1e6, 2),
            "model_state_MiB_rank0": r0["model_state_bytes"] / mib,
            "model_state_MiB_max_rank": max(r["model_state_bytes"] for r in per_rank) / mib,
            "textbook_MiB": _textbook(kind, r0["psi"], world_size),
            "peak_rss_growth_MiB_rank0": r0["peak_rss_growth_MiB"],
            "own_accounting_MiB_rank0": r0["own"],
        })
    return rows


def _stage3_worker(rank, world_size, device_type, repeats, variant="fp32"):
    return _stage3_timing(rank, world_size, rank_device(device_type, rank), repeats, variant)


def _worker(rank, world_size, device_type, quick, collectives=True, iterations=True, repeats=0):
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        sizes = [1 << 20, 16 << 20, 64 << 20] if quick else [1 << 20, 16 << 20, 64 << 20, 256 << 20]
        model_cfg = dict(d=2048, layers=8, batch=64)
    else:
        device = torch.device("cpu")
        # 25 MiB of fp32 (6.5M elements) is DDP's default bucket: what ZeRO stage 2 reduce-scatters.
        sizes = [1 << 18, 1 << 20, 4 << 20] if quick else [1 << 18, 1 << 20, 4 << 20, 25 << 18, 16 << 20]
        model_cfg = dict(d=512, layers=8, batch=64)
    repeats = repeats or (5 if quick else 15)
    rows = _collectives(rank, world_size, device, sizes, repeats) if collectives else []
    if iterations:
        rows += _training(rank, world_size, device, repeats=repeats, **model_cfg)
    return rows


def _write_and_print(kind: str, rows: list, notes: str, args, backend: str, threads: int) -> None:
    env = environment()
    env.update(world_size=args.world_size, backend=backend, torch_threads=threads)
    md, csv = write_results(f"zero_{args.device}_ws{args.world_size}_{kind}", rows, notes, env)
    for r in rows:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
    print("wrote", md, csv)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--ranks-per-gpu", type=int, default=0,
                        help="with --device cuda: ranks sharing each GPU (FUSEDIST_TEST_RANKS_PER_GPU; NCCL "
                             "over sockets between them, so absolute bandwidth is not NVLink's, ratios are fair)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=0,
                        help="timed repetitions per case (default: 15, 5 with --quick)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads per rank (default: cores / world size)")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--iterations-only", action="store_true", help="skip the collectives part")
    only.add_argument("--collectives-only", action="store_true", help="skip the training iterations")
    only.add_argument("--stage3", action="store_true", help="only part 3: fusedist.fully_shard vs torch FSDP2")
    only.add_argument("--memory", action="store_true", help="only part 4: model-state memory per variant")
    parser.add_argument("--float8", action="store_true",
                        help="with --stage3: the blocks' Linears in torchao's float8 training, gathered as float8")
    parser.add_argument("--qlora", action="store_true",
                        help="with --stage3: the blocks' Linears frozen in NF4 (torchao), trainable rank-8 adapters")
    args = parser.parse_args()
    if (args.float8 or args.qlora) and not args.stage3:
        parser.error("--float8 and --qlora go with --stage3")
    if args.float8 and args.qlora:
        parser.error("--float8 or --qlora, not both")
    if args.ranks_per_gpu:
        from fusedist.testing import RANKS_PER_GPU_ENV

        os.environ[RANKS_PER_GPU_ENV] = str(args.ranks_per_gpu)  # read by every spawned rank
    if args.device == "cuda":
        from fusedist.testing.shared_gpu import ranks_per_gpu_setting

        per_gpu = ranks_per_gpu_setting() or 1
        if torch.cuda.device_count() * per_gpu < args.world_size:
            sys.exit(f"--device cuda needs room for {args.world_size} ranks: {torch.cuda.device_count()} GPU(s) x "
                     f"{per_gpu} rank(s) per GPU (set FUSEDIST_TEST_RANKS_PER_GPU to share a GPU)")

    from fusedist.testing import run_distributed

    backend = "nccl" if args.device == "cuda" else "gloo"
    threads = args.threads or max(1, (os.cpu_count() or 2) // args.world_size)
    if args.memory:
        rows = _memory(args.world_size, args.device, threads, backend)
        notes = ("Memory per rank for one model (8 transformer-MLP blocks, fp32, torch.optim.AdamW as the "
                 "inner/unsharded optimizer, default buckets), each variant alone in a fresh process, after 3 "
                 "steps. model_state = bytes of every tensor storage alive right after the last step() "
                 "(gradients still held), minus those alive before the model was built: parameters, gradients, "
                 "master weights, optimizer state, gradient buckets, staging and communication buffers, counted "
                 "the same way for every variant. textbook = parameters + gradients + AdamW state (fp32 parameters are "
                 "their own masters; offload keeps an FP32 master copy of the shard) without padding or buffers. "
                 "peak_rss_growth = growth of the process's peak "
                 "RSS over building the model and the steps (activations, temporaries and what the allocator "
                 "keeps included). Offload variants on a CPU device: host and device are the same memory, so "
                 "offloading cannot lower these figures here; the rows show what it adds.")
        _write_and_print("memory", rows, notes, args, backend, threads)
        return
    if args.stage3:
        variant = "float8" if args.float8 else "qlora" if args.qlora else "fp32"
        rows = _stage3(args.world_size, args.device, args.repeats or (5 if args.quick else 15), threads, backend,
                       variant)
        notes = ("Stage 3: fusedist.fully_shard vs torch FSDP2 fully_shard, same wrapping (each block, then the "
                 "root; reshard_after_forward=None for both), torch.optim.AdamW for both; forward + backward + step "
                 "of rank 0, interleaved, ratio_paired = median over repetitions of fusedist / torch (< 1: fusedist "
                 "faster). Memory: each contender alone in a fresh process, growth of the peak memory (host RSS "
                 "on CPU, allocated device memory on CUDA) over building "
                 "the model and 4 steps (MiB, rank 0); formula = 16Ψ/N + two largest units gathered + activations "
                 "(saved by autograd in one forward); fusedist_accounted = its counters: shards x4 (parameters, "
                 "gradients, AdamW's two moments) + peak gathered + peak scratch + communicator scratch + activations.")
        if args.float8:
            notes += (" Float8: every block Linear converted by torchao's convert_to_float8_training with "
                      "enable_fsdp_float8_all_gather=True before sharding, on both sides; each gather computes "
                      "its scales (no precompute). On gloo FSDP2 gathers each unit through one byte buffer too "
                      "(its units mix float8 weights with fp32 biases and norms).")
        if args.qlora:
            notes += (" QLoRA: every block Linear's weight frozen in torchao's NF4 (to_nf4), its bias frozen, plus "
                      "trainable rank-8 adapters (AdamW steps the adapters and the norms only), on both sides; "
                      "fusedist stores each NF4 chunk as bytes on the unit's shard and gathers through NF4's "
                      "all-gather extension, as FSDP2 does. The 16Ψ/N term of the formula counts every parameter "
                      "as trained, so it overstates this model's states (frozen NF4 weights hold half a byte per "
                      "element).")
        _write_and_print({"fp32": "stage3"}.get(variant, f"stage3_{variant}"), rows, notes, args, backend, threads)
        return
    per_rank = run_distributed(_worker, args.world_size, args.device, args.quick, not args.iterations_only,
                               not args.collectives_only, args.repeats,
                               backend=backend,
                               timeout=1800, pg_timeout=600, threads=threads)
    rows = per_rank[0]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    rows = [{k: r.get(k, "") for k in keys} for r in rows]
    env = environment()
    env.update(world_size=args.world_size, backend=backend, torch_threads=threads,
               load_avg_1min=round(os.getloadavg()[0], 1))  # a shared machine: say how busy it was
    notes = (
        "Collectives: baseline = one all-reduce of Ψ; zero = reduce-scatter of Ψ + all-gather of Ψ "
        "(same bytes on a ring), called as ZeRO calls them (reduce-scatter into a separate gradient shard, "
        "all-gather in place), timed interleaved with the all-reduce in every repetition; ratio_paired = "
        "median over repetitions of RS+AG time / all-reduce time in that repetition. On gloo "
        "three rows per size: 'p2p exchange' is what fusedist's communicator uses (point-to-point "
        "messages, fusedist/comm/gloo_exchange.py), called synchronously; 'p2p exchange, async launch' "
        "the same launched with async_op=True and waited at once, as ZeRO launches them (the exchange "
        "goes to its progress thread, a hand-off the synchronous call skips); "
        "'gloo builtin' is FUSEDIST_GLOO_COLLECTIVES=builtin: "
        "gloo's own collectives (its reduce-scatter is an all-reduce of a copy of the input whose slice is "
        "copied out), slower than gloo's all-reduce for the same bytes (see the reduce_scatter_ms / "
        "all_gather_ms columns). gloo_all_to_all_rs_ms: a reduce-scatter built on gloo's own all-to-all (one "
        "C++ collective) plus the same fold, the floor for the exchange's reduce-scatter where messages are "
        "latency-bound. bare_p2p_rsag_ms / bare_p2p_ratio_paired: RS+AG by the same messages posted "
        "straight on the process group (bare send/recv, no checks, tags, timeouts or completion "
        "tracking; the fold included), the floor of any point-to-point implementation. "
        "Target: RS+AG within 1.1x of AR. "
        "Iteration: forward + backward + optimizer step, rank 0's median over samples of 4 "
        "iterations back to back (so the overlapped parameter all-gathers are paid by the next "
        "iteration, as in training); by default every parameter all-gather completes inside step(), as "
        "with torch's ZeroRedundancyOptimizer; 'overlapped gather' rows are overlap_param_gather=True "
        "(step() returns before the gathers land, the next forward waits for them); "
        "state = master weights + optimizer state bytes held by one rank. Ratio > 1: ZeRO slower. "
        "Offload rows: "
        "zero_host_MB / zero_device_MB split the rank's optimizer memory (host: masters, AdamW state, "
        "gradient and parameter staging; device: the gradient shard); on CPU both are host RAM, so "
        "the time ratio there is the cost of the offload pipeline (extra copies, per-bucket calls). "
        "zero_peak_grad_MB_in_backward: the most full-gradient memory held during the last backward, "
        "next to grad_MB, all of it (DDP's default buckets: 1 MiB first, 25 MiB after; the "
        "'1-layer buckets' row uses buckets of about one layer, so its time ratio also reflects "
        "the bucket size). The peak drops only where collectives complete while backward still "
        "runs (buckets_finished_in_backward > 0; Note [finishing buckets during backward])."
    )
    suffix = "_iterations" if args.iterations_only else "_collectives" if args.collectives_only else ""
    name = f"zero_{args.device}_ws{args.world_size}" + suffix + (f"_threads{args.threads}" if args.threads else "")
    md, csv = write_results(name, rows, notes, env)
    for r in rows:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
    print("wrote", md, csv)


if __name__ == "__main__":
    main()
