"""``--measure``: train the model with fusedist's DDP, ZeRO-1, ZeRO-2 (and ZeRO-2 with
``offload="cpu"`` for Adam), ZeRO-3 (``fusedist.fully_shard``) and ZeRO-3 with
``CPUOffloadPolicy`` under torchrun and put the planner's numbers next to measured ones.

What is measured, per strategy, on each rank, from public objects:

* model states: the distinct storages of the parameters and of ``p.grad`` (flat buffers,
  padding included), plus the optimizer's state (DDP and ZeRO-3: every tensor in
  ``optimizer.state``, FP32 masters included; ZeRO-1/2: ``memory_stats()``, whose device/host
  split also gives the offloaded bytes);
* communication: every collective the communicator issues during the timed steps, counted
  by wrapping its public methods for the run: payload bytes times the ring algorithm's
  per-rank factor (all-reduce 2(N-1)/N, reduce-scatter and all-gather (N-1)/N of the full
  buffer), per step. Small control collectives (the per-step cross-rank check) are included;
* step time (median of the timed steps) and, for comparison with the compute model, the
  model FLOPs utilisation it implies against this process's own matmul rate (Note [the
  measured peak]);
* activations: bytes of the tensors autograd saves for backward in one forward (parameters
  excluded); the planner's figure is Megatron's layer (Korthikanti et al.), so this is shown,
  not checked; peak allocated device memory on CUDA.

Note [measuring ZeRO-3]
    zero3 wraps every block with ``fully_shard`` and then the root (embedding, final norm,
    head), all with ``reshard_after_forward=True``, and steps ``model.parameters()`` (the
    rank's pieces) with the optimizer DDP uses at that precision. True for the root too, on
    purpose: every unit, the root included, is then gathered for forward and gathered again
    for backward, which is the planner's two parameter all-gathers plus one gradient
    reduce-scatter. (``reshard_after_forward=None``, the default as in torch, keeps the root gathered
    from forward to backward: one root gather less per step than the planner counts.) The
    collectives per step are checked by count: 2 all-gathers and 1 reduce-scatter per unit.

    The planner's Ψ/N has no padding; fully_shard's flat buffers do (Note [row-aligned flat
    layout] in fusedist/fsdp/layout.py: shards of equal size, cuts between rows). The
    padding is known exactly from ``memory_stats()``: ``unsharded_bytes`` is every unit's
    gathered buffer, so ``unsharded_bytes / element size - Ψ`` elements are padding. Those
    elements are sent by every all-gather and reduce-scatter, and each rank's parameter and
    gradient shards hold 1/N of them on average (the optimizer state lives on the pieces and
    has none). The comparison adds these two terms to the prediction, reported separately
    (``padding_*``), instead of widening the tolerance. The rank's pieces are not exactly
    Ψ/N either (the padding falls on some ranks more than others), so zero3's model-state
    bytes are averaged over the ranks, which is what Ψ/N and the padding term describe.

    The temporary term of zero3 (gathered units, gradient reduce buffers) is compared with
    ``memory_stats()``' ``peak_gathered_bytes`` + ``peak_scratch_bytes`` over the timed
    steps, within the same tolerance of the predicted range: a reduction that lands before
    the next is issued frees its buffers at once, so whether two are in flight at the peak
    or one depends on timing (one run in several measured the single-reduction peak, 17%
    below the two-reduction one); ``temp_error`` is the distance outside the range.

Note [the measured peak]
    The MFU column divides the step's planned FLOPs (6 x the active parameters in matrix
    products + attention, per token) by the step time and by a peak measured here, in the
    step's dtype. A peak taken from one 1024 x 1024 product is not a peak: on a CPU without
    native bf16 matrix units that product runs at a third of the rate of the step's own small,
    cache-resident bf16 products, and the MFU came out above 100%. The peak is the best rate
    over the products the step makes (each weight's forward, input-gradient and weight-gradient
    shapes) and one large square one, timed over repeated calls after a first, and the largest
    over the ranks, so every rank divides by the same figure and the step's matrix products
    cannot beat it. The planned FLOPs must not count more products than the step makes: with
    the untied input embedding counted as 6 FLOPs a parameter (a fifth of the tiny llama's),
    a quick step read 100.4% (Note [lookups are not products] in model.py).
    A mixture of experts sends each token through its top-k experts only (Note [routed tokens]
    in fusedist/plan/torch_model.py), the active FLOPs the plan counts; its experts' products
    are taken at their average rows, tokens x top-k / experts. A model with sliding windows
    computes more than the plan counts, so its MFU is a lower bound: its windowed blocks mask
    the scores (Note [sliding windows] in model.py) and compute all s x s of them, where the
    plan charges min(s, w) keys a query.

Note [measuring ZeRO-3 offload]
    zero3_offload is zero3 with ``offload_policy=CPUOffloadPolicy()`` on every unit: the
    pieces, their gradients and the optimizer state (made on the pieces) live in host memory,
    and the planner puts all three there, none on the device. So the model states are split
    by where each tensor is: those on the host are ``host_bytes``, the rest
    ``model_states_bytes`` (predicted 0: its error is 0 when nothing is there, else
    infinite). On a CPU run the compute device is the host itself, so that split cannot
    fail; what is checked there is the host total (with the padding term of the note
    above, all on the host here), the collectives and the temporary term, which are zero3's.
    The step is the planner's offloaded update: the optimizer DDP uses at that precision,
    stepping host tensors (fusedist's FusedAdamW runs its C++ CPU Adam on them).

Note [the ZeRO-2 buckets measured]
    zero2 and zero2_offload train ``DistributedDataParallel(model, bucket_cap_mb=--bucket-cap-mb)``,
    the buckets the plan counts, and report the most full-gradient bytes a timed backward held
    (``comm_stats()["peak_grad_bytes"]``) beside the plan's ZeRO-2 temporary term less
    ``--scratch-gb``: three consecutive buckets (``memory.temp_bytes``: two in flight and one
    filling). Shown, not checked: how many buckets are held depends on when each
    reduce-scatter lands (two when each lands before the bucket after next fills; Note
    [buckets in flight] in fusedist/ddp/in_flight.py).

Gradient accumulation is not exercised (one micro-batch per step).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .memory import STRATEGIES
from .plan import GB
from .model import count_params
from .plan import build_plan
from .torch_model import Experts, Transformer

TOLERANCE = 0.05
NOT_MEASURED = "not measured (offload steps Adam only)"
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_PAYLOAD = {  # which argument is the collective's full buffer
    "all_reduce": lambda a, k: a[0], "broadcast": lambda a, k: a[0],
    "reduce_scatter": lambda a, k: a[1], "all_gather": lambda a, k: a[0],
}


class CommCounter:
    """Counts the collectives of ``comm`` while active (instance attributes shadow its
    methods; :meth:`close` removes them)."""

    def __init__(self, comm):
        self.comm, self.active, self.bytes, self.calls = comm, False, 0.0, {}
        n = comm.world_size
        factor = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
                  "all_gather": (n - 1) / n, "broadcast": (n - 1) / n}
        for op, payload in _PAYLOAD.items():
            setattr(comm, op, self._wrap(op, getattr(comm, op), payload, factor[op]))

    def _wrap(self, op, method, payload, factor):
        def counted(*args, **kwargs):
            if self.active:
                t = payload(args, kwargs)
                self.bytes += factor * t.numel() * t.element_size()
                self.calls[op] = self.calls.get(op, 0) + 1
            return method(*args, **kwargs)
        return counted

    def close(self):
        for op in _PAYLOAD:
            self.comm.__dict__.pop(op, None)


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        if t is not None:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _model_state_bytes(params, opt, where=lambda t: True) -> int:
    """The storages of the parameters and their gradients, and the optimizer's state tensors,
    that ``where`` selects."""
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return (_storage_bytes(t for t in params if where(t)) + _storage_bytes(g for g in grads if where(g))
            + sum(v.numel() * v.element_size() for v in state if where(v)))


def saved_storage_bytes(module, run, counted=lambda t: True) -> int:
    """Bytes of the distinct storages autograd saves while ``run()`` runs, ``module``'s
    parameters left out, of the tensors ``counted`` keeps."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.nbytes() and counted(t):
            seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def _saved_activation_bytes(model, tokens, targets) -> int:
    return saved_storage_bytes(
        model, lambda: F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten()))


def _gemm_shapes(model, tokens: int) -> list:
    """(m, k, n) of every matrix product a training step of ``model`` makes with its 2-D
    weights, ``tokens`` rows a micro-batch: forward, input gradient and weight gradient."""
    shapes = set()
    stacked = set()
    for m in model.modules():
        if isinstance(m, Experts):  # each expert's (h, 2f) and (f, h), on its share of the pairs
            e, h, f = m.shape
            rows = max(1, tokens * m.top_k // e)
            for inp, out in ((h, 2 * f), (f, h)):
                shapes |= {(rows, inp, out), (rows, out, inp), (inp, rows, out)}
            stacked |= {id(m.w_in), id(m.w_out)}
    for p in model.parameters():
        if p.dim() == 2 and id(p) not in stacked:
            out, inp = p.shape
            shapes |= {(tokens, inp, out), (tokens, out, inp), (out, tokens, inp)}
    return sorted(shapes)


def _peak_matmul_flops(shapes, dtype, device) -> float:
    """The best dense matmul rate (FLOP/s) this process reaches in ``dtype``, over the step's
    own products and one square one, the largest over the ranks: the "peak" the achieved MFU
    is measured against (Note [the measured peak])."""
    square = 4096 if device.type == "cuda" else 512
    best = 0.0
    for m, k, n in [*shapes, (square, square, square)]:
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        a @ b  # first call: kernel selection, allocations
        reps = max(1, min(20, int(2e8 // (2 * m * k * n))))  # ~0.2 GFLOP a timing
        for _ in range(3):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                a @ b
            if device.type == "cuda":
                torch.cuda.synchronize()
            best = max(best, 2 * m * k * n * reps / (time.perf_counter() - t0))
    peak = torch.tensor([best], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()


def _optimizer(strategy, params, job):
    import fusedist
    from fusedist.optim import FusedAdamW, FusedSGD
    adam = job.optimizer == "adamw"
    kw = {"lr": 1e-4, "weight_decay": 0.0} if adam else {"lr": 1e-4, "momentum": 0.9}
    if job.param_groups == "no-decay":  # the 1-D tensors in a group of their own, as planned
        params = list(params)
        params = [{"params": [p for p in params if p.dim() >= 2]}, {"params": [p for p in params if p.dim() < 2]}]
    if strategy in ("ddp", "zero3", "zero3_offload"):  # zero3 steps the pieces like any parameters
        if job.precision == "fp32":
            return (torch.optim.AdamW if adam else torch.optim.SGD)(params, **kw)
        return (FusedAdamW if adam else FusedSGD)(params, master_weights=True, **kw)
    inner = torch.optim.AdamW if adam else torch.optim.SGD
    stage = 1 if strategy == "zero1" else 2
    return fusedist.ZeroRedundancyOptimizer(params, inner, stage=stage, offload="cpu" if "offload" in strategy
                                            else None, **kw)


def _wrap(strategy, model, job, device):
    """The model as trained, its communicator and its optimizer."""
    import fusedist
    from fusedist.comm import get_communicator
    if strategy.startswith("zero3"):  # Note [measuring ZeRO-3], Note [measuring ZeRO-3 offload]
        policy = fusedist.CPUOffloadPolicy() if strategy == "zero3_offload" else None
        for block in model.blocks:
            fusedist.fully_shard(block, reshard_after_forward=True, offload_policy=policy)
        fusedist.fully_shard(model, reshard_after_forward=True, offload_policy=policy)
        return model, get_communicator(None, device), _optimizer(strategy, model.parameters(), job)
    ddp = fusedist.DistributedDataParallel(model, bucket_cap_mb=job.bucket_cap_mb)  # the planned buckets
    return ddp, ddp.comm, _optimizer(strategy, ddp.parameters(), job)


def _mean_over_ranks(x: float, device) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _zero3_padding(model, psi: int, job, n: int) -> tuple[float, float]:
    """(model-state bytes, communication bytes per step) that fully_shard's padding adds to
    the planner's figures, per rank on average (Note [measuring ZeRO-3])."""
    from .comm import ring_factor
    from .memory import param_bytes
    p = g = param_bytes(job.precision)  # gathered in, and gradients reduced in, the model's dtype
    padded = model.memory_stats()["unsharded_bytes"] / p
    pad = padded - psi
    return (p + g) * pad / n, ring_factor("all_gather", n) * pad * (2 * p + g)


def measure_one(spec, job, strategy, steps, warmup, device) -> dict:
    torch.manual_seed(0)
    dtype = _DTYPES[job.precision]
    model = Transformer(spec).to(device=device, dtype=dtype)
    params_counted = sum(p.numel() for p in model.parameters())
    wrapped, comm, opt = _wrap(strategy, model, job, device)
    counter = CommCounter(comm)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    times, peak_grad = [], 0
    try:
        for i in range(warmup + steps):
            tokens = torch.randint(0, spec.vocab, (job.micro_batch, job.seq + 1), generator=gen).to(device)
            counter.active = i >= warmup
            if strategy.startswith("zero3") and i == warmup:
                from fusedist.fsdp import reset_peak_memory_stats
                reset_peak_memory_stats()
            t0 = time.perf_counter()
            logits = wrapped(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                if strategy.startswith("zero2"):  # Note [the ZeRO-2 buckets measured]
                    peak_grad = max(peak_grad, wrapped.comm_stats()["peak_grad_bytes"])
        counter.active = False
    finally:
        counter.close()
    params = list(model.parameters())
    if strategy == "zero3_offload":  # Note [measuring ZeRO-3 offload]
        states = _model_state_bytes(params, opt, lambda t: t.device.type != "cpu")
        host = _model_state_bytes(params, opt, lambda t: t.device.type == "cpu")
    elif strategy in ("ddp", "zero3"):
        states, host = _model_state_bytes(params, opt), 0
    else:
        ms = opt.memory_stats()
        states = _storage_bytes(params) + _storage_bytes(p.grad for p in params) + ms["device_bytes"]
        host = ms["host_bytes"]
    result = {"params": params_counted, "model_states_bytes": states, "host_bytes": host,
              "comm_bytes_per_step": counter.bytes / steps, "collectives_per_step":
              {k: v / steps for k, v in counter.calls.items()}, "step_s": statistics.median(times)}
    if strategy.startswith("zero2"):
        result["peak_grad_bytes"] = peak_grad
    if strategy.startswith("zero3"):
        from fusedist.fsdp import FullyShardedModule
        ms = model.memory_stats()
        result.update({
            "units": sum(1 for m in model.modules() if isinstance(m, FullyShardedModule)),
            "rank_model_states_bytes": states,
            "model_states_bytes": _mean_over_ranks(states, device),
            "rank_host_bytes": host, "host_bytes": _mean_over_ranks(host, device),
            "gathered_bytes_at_rest": ms["gathered_bytes"],
            # the temporary term's two parts (Note [measuring ZeRO-3]): gathered units and
            # gradients on their way through the reduce-scatters, each at its peak
            "peak_gathered_bytes": ms["peak_gathered_bytes"], "peak_scratch_bytes": ms["peak_scratch_bytes"],
        })
        pad_states, result["padding_comm_bytes_per_step"] = _zero3_padding(model, params_counted, job,
                                                                           dist.get_world_size())
        result["padding_host_bytes" if strategy == "zero3_offload" else "padding_model_states_bytes"] = pad_states
        # A forward outside training would leave units gathered and hooks pending; the
        # saved-activation figure is shown for DDP only.
        result["saved_activation_bytes"] = None
    else:
        tokens = torch.randint(0, spec.vocab, (job.micro_batch, job.seq + 1), generator=gen).to(device)
        result["saved_activation_bytes"] = _saved_activation_bytes(model, tokens[:, :-1], tokens[:, 1:])
    del opt, wrapped, model
    return result


def run(spec, job, hw, plan, *, steps: int = 6, warmup: int = 3, as_json: bool = False) -> int:
    """Measure under torchrun; rank 0 prints. Exit status 1, on every rank, when a
    model-state, communication, host or zero3 temporary figure of any rank is off the
    prediction by more than 5%; rank 0 names the rank and the figure."""
    import fusedist
    info = fusedist.init_distributed()
    asked_batch = job.global_batch  # not exercised: said with the table, not dropped silently
    job = dataclasses.replace(job, convention="fusedist", global_batch=None)
    plan = build_plan(spec, job, hw)  # what fusedist allocates, one micro-batch per step
    with torch.device("meta"):
        shapes = _gemm_shapes(Transformer(spec), job.micro_batch * job.seq)
    peak = _peak_matmul_flops(shapes, _DTYPES[job.precision], info.device)
    strategies = ["ddp", "zero1", "zero2", "zero3", "zero3_offload"] + (["zero2_offload"] if job.optimizer == "adamw"
                                                                        else [])
    measured = {}
    for s in strategies:
        m = measure_one(spec, job, s, steps, warmup, info.device)
        mem, com = plan["memory"][s], plan["comm"][s]
        predicted_compute = plan["time"][s]["compute_s"] * job.mfu * hw.peak_flops(job.precision) / peak
        m.update({
            "predicted_model_states_bytes": mem["model_states_bytes"], "predicted_host_bytes": mem["host_bytes"],
            "predicted_comm_bytes_per_step": com["bytes_per_step"],
            "predicted_activation_bytes": mem["activation_bytes"],
            "model_states_error": _relative_error(m["model_states_bytes"], mem["model_states_bytes"]
                                                  + m.get("padding_model_states_bytes", 0)),
            "comm_error": _relative_error(m["comm_bytes_per_step"], com["bytes_per_step"]
                                          + m.get("padding_comm_bytes_per_step", 0)),
            "matmul_flops": peak, "achieved_mfu": predicted_compute / m["step_s"],
        })
        if s.endswith("offload"):
            m["host_error"] = _relative_error(m["host_bytes"], mem["host_bytes"] + m.get("padding_host_bytes", 0))
        if s.startswith("zero2"):  # the bucket term without the --scratch-gb allowance: shown, not checked
            m["predicted_grad_bucket_bytes"] = mem["temp_bytes"] - int(job.scratch_gb * GB)
        if s.startswith("zero3"):  # the temporary term without the --scratch-gb allowance
            m["predicted_gathered_and_scratch_bytes"] = mem["temp_bytes"] - int(job.scratch_gb * GB)
            m["predicted_min_gathered_and_scratch_bytes"] = mem["temp_min_bytes"] - int(job.scratch_gb * GB)
            m["temp_error"] = _range_error(m["peak_gathered_bytes"] + m["peak_scratch_bytes"],
                                           m["predicted_min_gathered_and_scratch_bytes"],
                                           m["predicted_gathered_and_scratch_bytes"])
        if info.device.type == "cuda":
            m["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(info.device)
            torch.cuda.reset_peak_memory_stats(info.device)
        measured[s] = m
    for s in STRATEGIES:
        if s not in measured:
            measured[s] = NOT_MEASURED
    rank_errors = _errors_over_ranks(measured, info.device)
    off = _out_of_tolerance(rank_errors)
    ok = not off
    assert count_params(spec) == measured["ddp"]["params"], "the built model differs from the count"
    if info.rank == 0:
        if as_json:
            print(json_text({"plan": plan, "measured": measured, "within_tolerance": ok,
                             "tolerance": TOLERANCE, "rank_errors": rank_errors, "out_of_tolerance": off}))
        else:
            print(format_measured(plan, measured, info, steps, warmup, ok, asked_batch))
            for line in off:
                print(line)
    from fusedist.comm import get_communicator

    get_communicator(None, info.device).barrier()  # bounded and reported, like fusedist's own exchanges
    dist.destroy_process_group()
    return 0 if ok else 1


def json_text(doc) -> str:
    """``doc`` as strict JSON, as the plan's ``--json`` is: an error with no finite value (a
    prediction of nothing met by something, :func:`_relative_error`) is ``null`` -- json's
    default wrote ``Infinity``, which strict parsers (``jq``, JavaScript) refuse."""
    def finite(x):
        if isinstance(x, float):
            return x if math.isfinite(x) else None
        if isinstance(x, dict):
            return {k: finite(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [finite(v) for v in x]
        return x
    return json.dumps(finite(doc), indent=2, allow_nan=False)


_ERRORS = ("model_states_error", "comm_error", "host_error", "temp_error")


def _errors_over_ranks(measured, device) -> dict:
    """{strategy: {figure: [error on rank 0, rank 1, ...]}}: every rank measures its own
    figures (zero3's pieces and peaks differ by rank), and the verdict, which every rank
    returns as its exit status, must cover them all, not rank 0's alone."""
    keys = [(s, k) for s, m in measured.items() if isinstance(m, dict) for k in _ERRORS if k in m]
    mine = torch.tensor([float(measured[s][k]) for s, k in keys], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    table = torch.stack(every).cpu()
    out: dict = {}
    for j, (s, k) in enumerate(keys):
        out.setdefault(s, {})[k] = table[:, j].tolist()
    return out


def _relative_error(measured: float, predicted: float) -> float:
    """``measured / predicted - 1``; for a prediction of nothing (zero3_offload's device model
    states), 0 when nothing was measured either, else infinite."""
    if predicted == 0:
        return 0.0 if measured == 0 else float("inf")
    return measured / predicted - 1


def _range_error(measured: float, low: float, high: float) -> float:
    """How far ``measured`` lies outside ``[low, high]``, relative to the bound it passes (0
    inside): zero3's temporary peak, two reductions in flight or one, depending on when the
    first lands (Note [measuring ZeRO-3])."""
    if measured > high:
        return measured / high - 1
    return measured / low - 1 if measured < low else 0.0


def _out_of_tolerance(rank_errors) -> list:
    """One line per figure off its prediction by more than the tolerance, naming the rank."""
    return [f"rank {r}: {s} {k.removesuffix('_error').replace('_', ' ')} off by {e:+.2%} "
            f"(tolerance {TOLERANCE:.0%})"
            for s, figures in rank_errors.items() for k, errors in figures.items()
            for r, e in enumerate(errors) if not abs(e) <= TOLERANCE]


def _b(x: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= size:
            return f"{x / size:.3f} {unit}"
    return f"{x:.0f} B"


def format_measured(plan, measured, info, steps, warmup, ok, asked_batch=None) -> str:
    from .report import model_line
    i = plan["inputs"]
    out = [model_line(plan),
           f"measured on {i['gpus']} ranks ({info.device.type}, {info.backend}), {i['precision']}, {i['optimizer']}, "
           f"micro-batch {i['micro_batch']} x seq {i['seq']}, {steps} timed steps after {warmup} warm-up; "
           "predictions in the fusedist convention"
           + (f"; one micro-batch a step: --global-batch {asked_batch} (gradient accumulation) is not measured"
              if asked_batch is not None else ""),
           "",
           f"{'strategy':<15}{'model states: predicted':>25}{'measured':>13}{'diff':>8}"
           f"{'comm/step: predicted':>23}{'measured':>13}{'diff':>8}{'step':>10}{'MFU':>7}"]
    for s in STRATEGIES:
        m = measured[s]
        if not isinstance(m, dict):
            out.append(f"{s:<15}{m}")
            continue
        pad_states, pad_comm = m.get("padding_model_states_bytes", 0), m.get("padding_comm_bytes_per_step", 0)
        out.append(f"{s:<15}{_b(m['predicted_model_states_bytes'] + pad_states):>25}{_b(m['model_states_bytes']):>13}"
                   f"{m['model_states_error']:>+8.2%}{_b(m['predicted_comm_bytes_per_step'] + pad_comm):>23}"
                   f"{_b(m['comm_bytes_per_step']):>13}{m['comm_error']:>+8.2%}"
                   f"{m['step_s'] * 1e3:>8.1f}ms{m['achieved_mfu']:>7.1%}")
        if "padding_model_states_bytes" in m:
            out.append(f"{'  of which pad':<15}{_b(pad_states):>25}{'':>21}{_b(pad_comm):>23}")
        if "host_error" in m:
            pad_host = m.get("padding_host_bytes", 0)
            out.append(f"{'  host':<15}{_b(m['predicted_host_bytes'] + pad_host):>25}{_b(m['host_bytes']):>13}"
                       f"{m['host_error']:>+8.2%}")
            if "padding_host_bytes" in m:
                out.append(f"{'  of which pad':<15}{_b(pad_host):>25}{'':>21}{_b(pad_comm):>23}")
    d = measured["ddp"]
    out += ["",
            f"MFU: the step's FLOPs as planned (6 x {'active ' if 'experts' in i['model'] else ''}params in matrix "
            f"products + attention, per token) against the best {i['precision']} matmul rate of these ranks "
            f"over the step's own products ({d['matmul_flops'] / 1e9:.1f} GFLOP/s); use it as --mfu for this machine",
            f"activations: predicted {_b(d['predicted_activation_bytes'])} (Megatron's layer, Korthikanti et al.); "
            f"this model saved {_b(d['saved_activation_bytes'])} for backward (shown, not checked)",
            "peak allocated: " + (_b(d["peak_allocated_bytes"]) if "peak_allocated_bytes" in d else "n/a on CPU"),
            *_zero2_lines(measured, i["assumptions"]["bucket_cap_mb"]),
            *_zero3_lines("zero3", measured.get("zero3")),
            *_zero3_lines("zero3_offload", measured.get("zero3_offload")),
            f"model states, communication (and zero3's temporary bytes) within {TOLERANCE:.0%}: "
            f"{'yes' if ok else 'NO'}"]
    return "\n".join(out)


def _zero2_lines(measured, cap_mb) -> list:
    """ZeRO-2's gradient buckets held at once, predicted and measured (Note [the ZeRO-2 buckets
    measured])."""
    return [f"{s} gradient buckets (three consecutive, --bucket-cap-mb {cap_mb:g}): predicted "
            f"{_b(m['predicted_grad_bucket_bytes'])}, measured peak {_b(m['peak_grad_bytes'])} on this rank "
            "(shown, not checked: two are held when each reduce-scatter lands in time)"
            for s in ("zero2", "zero2_offload") if isinstance(m := measured.get(s), dict)]


def _zero3_lines(s, m) -> list:
    if not isinstance(m, dict):
        return []
    calls = m["collectives_per_step"]
    where = (f"host model states are the mean over ranks (this rank: {_b(m['rank_host_bytes'])})"
             if s == "zero3_offload" else
             f"model states are the mean over ranks (this rank: {_b(m['rank_model_states_bytes'])})")
    return [f"{s}: fully_shard per block and the root ({m['units']} units), reshard_after_forward=True"
            f"{', CPUOffloadPolicy' if s == 'zero3_offload' else ''}; "
            f"per step {calls.get('all_gather', 0):g} all-gathers, {calls.get('reduce_scatter', 0):g} "
            "reduce-scatters (2 and 1 per unit); predictions include the flat buffers' padding; " + where,
            f"{s} temporary (gathered units + reduce-scatter buffers, at their peaks): predicted "
            f"{_b(m['predicted_min_gathered_and_scratch_bytes'])} to {_b(m['predicted_gathered_and_scratch_bytes'])} "
            f"(one or two reductions in flight), measured {_b(m['peak_gathered_bytes'])} + "
            f"{_b(m['peak_scratch_bytes'])} ({m['temp_error']:+.2%} outside)"]
