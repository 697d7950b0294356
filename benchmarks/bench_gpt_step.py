"""Benchmark: a GPT-style training step at world size 2, fusedist against torch in the same run.

Rows, each contender timed in turn within every repetition (ranks barrier-aligned), ratios the
median of the paired per-repetition ratios (below 1: fusedist is faster):

  ddp            fusedist DDP vs torch DDP, both + AdamW(fused), bf16 autocast on CUDA
  ddp, step check off
                 the same with fusedist's per-step cross-rank check off (FUSEDIST_CHECKS=0 when
                 built): that check's share of the step
  ddp blocking   fusedist DDP with host-blocking waits (``blocking_wait``, the
                 FUSEDIST_NCCL_BLOCKING_WAIT=1 form) vs the same with stream-ordered waits and
                 the watchdog (the default): what blocking the host in every bucket wait costs
  zero2          fusedist DDP + ZeroRedundancyOptimizer(stage=2, AdamW) vs torch FSDP2
                 ``fully_shard`` (each block, then the root) with reshard_after_forward=False,
                 with ``overlap_param_gather=True``: the parameter all-gathers run behind the next
                 forward, as FSDP2's do (it reshards after backward and gathers each unit in the
                 next forward, the next unit's gather issued ahead of it). Both timed over
                 four consecutive steps and reported per step: a step's gathers land in the next
                 step's forward, which a one-step sample (ending in a device synchronize, or
                 leaving them to the next contender's sample on gloo) would not show; the last
                 step's gathers are waited for inside the sample (a quarter of one step's
                 gathers not overlapped, counted against fusedist)
  zero2, gathers inside step
                 the same with the optimizer's default: every all-gather lands before ``step()``
                 returns, so the parameters are final after it (what an EMA or a log reads), a
                 guarantee FSDP2's sharded parameters do not give: the cost of that guarantee
  zero3          ``fusedist.fully_shard`` vs torch FSDP2 ``fully_shard``, the same wrapping
                 (each block, then the root) and FSDP2's defaults (blocks reshard after
                 forward, the root keeps its parameters), both + AdamW over the sharded
                 parameters; on CUDA both gather in bf16 and reduce in fp32
                 (``MixedPrecisionPolicy``), the recipe FSDP2 users run

and, for each contender, the exposed-communication fraction of its step: (forward+backward
with gradient sync - the same without sync) / step, i.e. the part of the step that
communication adds on top of compute (0: fully hidden behind backward).

On one GPU run it with ``--ranks-per-gpu 2`` (Note [several ranks on one GPU] in
fusedist/testing/shared_gpu.py): both ranks share the GPU and NCCL carries the traffic over
sockets, for torch's NCCL and fusedist's communicator alike, so ratios are fair and absolute
bandwidth is not NVLink's. ``--device cpu`` (gloo, by default a small model: 2 layers of width
64) checks that the script runs; ``--layers`` / ``--width`` make it a CPU measurement.

    python benchmarks/bench_gpt_step.py --device cuda --ranks-per-gpu 2 [--layers 12 --width 768]

Writes benchmarks/results/gpt_step_<device>_ws<N>_<date>.md and .csv.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, rank_device, time_interleaved, write_results  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embeddings, pre-norm blocks, a head tied to the token embedding."""

    def __init__(self, vocab: int, seq: int, d: int, layers: int, heads: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.t()


# The contender whose step leaves work for the next one (ZeRO-2's parameter gathers), and its
# baseline: both timed over this many consecutive steps.
LEAVES_GATHERS = "fusedist zero2"
OVERLAPPED = (LEAVES_GATHERS, "torch fsdp2")
OVERLAPPED_STEPS = 4


def _config(device: torch.device, args) -> dict:
    if device.type == "cuda":
        return dict(vocab=16384, seq=256, d=args.width or 768, layers=args.layers or 12, heads=12, batch=8)
    return dict(vocab=512, seq=32, d=args.width or 64, layers=args.layers or 2, heads=4, batch=4)


def _contenders(base: nn.Module, device: torch.device, mesh) -> dict:
    """name -> (model, optimizer, no_sync context factory)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision, fully_shard as torch_fully_shard

    import fusedist

    fused = device.type == "cuda"
    ids = [device.index] if device.type == "cuda" else None
    out = {}
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=ids)
    out["torch ddp"] = (ref, torch.optim.AdamW(ref.parameters(), lr=1e-4, fused=fused), ref.no_sync)
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base), device_ids=ids)
    out["fusedist ddp"] = (ours, torch.optim.AdamW(ours.parameters(), lr=1e-4, fused=fused), ours.no_sync)
    # The same without the per-step cross-rank check (one small all-reduce per step, on the
    # gradients' communicator): its share of the step, large where a collective's latency is
    # (NCCL over sockets, milliseconds), negligible over NVLink.
    previous = os.environ.get("FUSEDIST_CHECKS")
    os.environ["FUSEDIST_CHECKS"] = "0"
    try:
        unchecked = fusedist.DistributedDataParallel(copy.deepcopy(base), device_ids=ids)
    finally:
        if previous is None:
            del os.environ["FUSEDIST_CHECKS"]
        else:
            os.environ["FUSEDIST_CHECKS"] = previous
    out["fusedist ddp unchecked"] = (unchecked, torch.optim.AdamW(unchecked.parameters(), lr=1e-4, fused=fused),
                                     unchecked.no_sync)
    zero = fusedist.DistributedDataParallel(copy.deepcopy(base), device_ids=ids)
    opt = fusedist.ZeroRedundancyOptimizer(zero.parameters(), torch.optim.AdamW, stage=2, lr=1e-4, fused=fused,
                                           overlap_param_gather=True)
    out["fusedist zero2"] = (zero, opt, zero.no_sync)
    final = fusedist.DistributedDataParallel(copy.deepcopy(base), device_ids=ids)
    opt = fusedist.ZeroRedundancyOptimizer(final.parameters(), torch.optim.AdamW, stage=2, lr=1e-4, fused=fused)
    out["fusedist zero2 gathers inside step"] = (final, opt, final.no_sync)
    fsdp = copy.deepcopy(base)
    for block in fsdp.blocks:
        torch_fully_shard(block, mesh=mesh, reshard_after_forward=False)
    torch_fully_shard(fsdp, mesh=mesh, reshard_after_forward=False)

    out["torch fsdp2"] = (fsdp, torch.optim.AdamW(fsdp.parameters(), lr=1e-4, fused=fused), _sync_off(fsdp))
    for name, shard, policy in (("torch fsdp2 zero3", torch_fully_shard, TorchMixedPrecision),
                                ("fusedist zero3", fusedist.fully_shard, fusedist.MixedPrecisionPolicy)):
        model = copy.deepcopy(base)
        mp = policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if fused else policy()
        for block in model.blocks:
            shard(block, mesh=mesh, mp_policy=mp)
        shard(model, mesh=mesh, mp_policy=mp)
        out[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused), _sync_off(model))
    return out


def _sync_off(model):
    """A ``no_sync`` for a ``fully_shard`` model: its gradient reductions off for one backward."""
    @contextlib.contextmanager
    def no_sync():
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    return no_sync


def _worker(rank, world_size, device_type, repeats, args):
    from torch.distributed.device_mesh import init_device_mesh

    from fusedist.comm import get_communicator

    device = rank_device(device_type, rank)
    cfg = _config(device, args)
    torch.manual_seed(0)
    base = GPT(cfg["vocab"], cfg["seq"], cfg["d"], cfg["layers"], cfg["heads"]).to(device)
    params = sum(p.numel() for p in base.parameters())
    mesh = init_device_mesh(device.type, (world_size,))
    comm = get_communicator(None, device)
    contenders = _contenders(base, device, mesh)
    gen = torch.Generator().manual_seed(rank)
    idx = torch.randint(cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=gen).to(device)
    autocast = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda"
                else contextlib.nullcontext)

    def fwd_bwd(model):
        with autocast():
            logits = model(idx[:, :-1])
        F.cross_entropy(logits.float().reshape(-1, cfg["vocab"]), idx[:, 1:].reshape(-1)).backward()

    def step(model, opt):
        fwd_bwd(model)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def local(model, opt, no_sync):
        with no_sync():
            fwd_bwd(model)
        opt.zero_grad(set_to_none=True)

    def synced(model, opt):
        fwd_bwd(model)
        opt.zero_grad(set_to_none=True)

    def steps(model, opt):
        for _ in range(OVERLAPPED_STEPS):
            step(model, opt)
        if hasattr(opt, "wait_for_params"):  # the last step's gathers, inside the sample
            opt.wait_for_params()

    # (a contender leaving gathers in flight has no one-step sample: they would land in the next one)
    fns = {f"step {n}": (lambda m=m, o=o: step(m, o)) for n, (m, o, _) in contenders.items()
           if n != LEAVES_GATHERS}
    for n in OVERLAPPED:
        m, o, _ = contenders[n]
        fns[f"{OVERLAPPED_STEPS} steps {n}"] = lambda m=m, o=o: steps(m, o)
    blocking_comm = comm if hasattr(comm, "blocking_wait") else None
    if blocking_comm is not None:
        m, o, _ = contenders["fusedist ddp"]

        def blocking_step():
            blocking_comm.blocking_wait = True
            try:
                step(m, o)
            finally:
                blocking_comm.blocking_wait = False

        blocking_comm.blocking_wait = False
        fns["step fusedist ddp blocking"] = blocking_step
    for n, (m, o, ns) in contenders.items():
        fns[f"fwd+bwd {n}"] = lambda m=m, o=o: synced(m, o)
        fns[f"fwd+bwd local {n}"] = lambda m=m, o=o, ns=ns: local(m, o, ns)
    res = time_interleaved(fns, device, comm, warmup=args.warmup, repeats=repeats)
    samples = res.pop("_samples")

    def paired(a, b):
        return statistics.median(y / x for x, y in zip(samples[a], samples[b]))

    def step_ms(name):
        if f"step {name}" in res:
            return res[f"step {name}"][0]
        return res[f"{OVERLAPPED_STEPS} steps {name}"][0] / OVERLAPPED_STEPS

    def exposed(name):
        if f"fwd+bwd {name}" not in res:
            return float("nan")
        return (res[f"fwd+bwd {name}"][0] - res[f"fwd+bwd local {name}"][0]) / step_ms(name)

    rows = []
    pairs = [("ddp", "torch ddp", "fusedist ddp", "<= 1.0"), ("zero2", "torch fsdp2", "fusedist zero2", "<= 1.0"),
             ("zero2, gathers inside step", "torch fsdp2", "fusedist zero2 gathers inside step",
              "(parameters final after step())"),
             ("zero3", "torch fsdp2 zero3", "fusedist zero3", "<= 1.0")]
    pairs.insert(1, ("ddp, step check off", "torch ddp", "fusedist ddp unchecked", "(the check's share)"))
    if blocking_comm is not None:
        pairs.insert(1, ("ddp blocking", "fusedist ddp", "fusedist ddp blocking", "(cost of host-blocking waits)"))
    for row, baseline, ours, target in pairs:
        timed, per = (f"{OVERLAPPED_STEPS} steps", OVERLAPPED_STEPS) if ours in OVERLAPPED else ("step", 1)
        rows.append({
            "row": row, "params_M": round(params / 1e6, 1), "baseline": baseline,
            "baseline_ms": res[f"{timed} {baseline}"][0] / per, "fusedist_ms": res[f"{timed} {ours}"][0] / per,
            "fusedist_p20_ms": res[f"{timed} {ours}"][1] / per, "fusedist_p80_ms": res[f"{timed} {ours}"][2] / per,
            "ratio_paired": paired(f"{timed} {baseline}", f"{timed} {ours}"), "target": target,
            "exposed_comm_baseline": exposed(baseline), "exposed_comm_fusedist": exposed(ours),
        })
    return rows


def _untimed_rounds(text: str) -> int:
    """``--warmup``'s value: a count, 0 included (every contender then meets its first, slow step timed)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a count of rounds, 0 or more")
    return value


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--ranks-per-gpu", type=int, default=0,
                        help="with --device cuda: ranks sharing each GPU (FUSEDIST_TEST_RANKS_PER_GPU)")
    parser.add_argument("--layers", type=int, default=0, help="blocks (default: 12 on cuda, 2 on cpu)")
    parser.add_argument("--width", type=int, default=0, help="model width (default: 768 on cuda, 64 on cpu)")
    parser.add_argument("--repeats", type=int, default=0, help="timed repetitions (default: 5 on cuda, 3 on cpu)")
    parser.add_argument("--warmup", type=_untimed_rounds, default=2,
                        help="untimed rounds of every contender before the timed ones (default: 2; a smoke run "
                             "that reads no figures can use 1)")
    parser.add_argument("--no-write", action="store_true", help="print only; do not write benchmarks/results/")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpt_step: skipped, no CUDA GPU visible (run with --device cpu to check the script)")
        return
    if args.ranks_per_gpu:
        from fusedist.testing import RANKS_PER_GPU_ENV

        os.environ[RANKS_PER_GPU_ENV] = str(args.ranks_per_gpu)  # read by every spawned rank
    from fusedist.testing import run_distributed

    repeats = args.repeats or (5 if args.device == "cuda" else 3)
    backend = "nccl" if args.device == "cuda" else "gloo"
    rows = run_distributed(_worker, args.world_size, args.device, repeats, args, backend=backend,
                           timeout=900, threads=1)[0]
    for r in rows:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
    worst = max(r["ratio_paired"] for r in rows if r["target"] == "<= 1.0")
    print(f"bench_gpt_step: worst ratio against torch {worst:.3f} (target <= 1.0)")
    if not args.no_write:
        env = environment()
        env.update(world_size=args.world_size, backend=backend, ranks_per_gpu=args.ranks_per_gpu or 1)
        notes = ("Step = forward + backward + AdamW step (bf16 autocast on CUDA). exposed_comm = (fwd+bwd with "
                 "sync - fwd+bwd under no_sync) / step. Ranks sharing a GPU time-share it and talk over NCCL's "
                 "socket transport: compare ratios, not absolute times.")
        md, csv = write_results(f"gpt_step_{args.device}_ws{args.world_size}", rows, notes, env)
        print("wrote", md, csv)


if __name__ == "__main__":
    main()
