"""``python -m fusedist.plan``: argument parsing, validation, output.

Exit status: 0 when the plan has a strategy or layout that fits; 1 when nothing fits (the
plan is still printed); 2 for bad input, which ends with one line on stderr naming the flag."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Optional

from . import hardware, memory, timing
from .errors import PlanError
from .hf_config import HF_MODEL_TYPES, MAX_LAYERS, config_key, from_hf_config
from .model import ARCHS, ModelSpec, count_params, validate
from .pipeline import SCHEDULES
from .plan import PARAM_GROUPS, Job, build_plan, check_expert_parallel
from .tp_style import TP_STYLES

PROG = "python -m fusedist.plan"
_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_SHAPE_FLAGS = ("layers", "hidden", "heads", "vocab")
# What the planner models at most: far past any model or cluster built, and where its figures
# still hold (huge counts overflowed to a traceback, printed Infinity in --json, or, with a
# million layers, ran for minutes; the per-layer terms walk the blocks).
MAX_PARAMS = 1e16
_MAX = {"layers": MAX_LAYERS, "hidden": 1 << 20, "heads": 1 << 16, "kv_heads": 1 << 16, "vocab": 1 << 26,
        "ffn_hidden": 1 << 24, "seq": 1 << 26, "expert_ffn": 1 << 24, "experts": 1 << 20}
_MAX_JOB = {"gpus": 1 << 24, "gpus_per_node": 1 << 16, "micro_batch": 1 << 24, "global_batch": 1 << 40,
            "ref_batch": 1 << 40, "ep": 1 << 24}
MEASURE_STEPS = 6  # --steps' default
_REAL_RANGE = (1e-9, 1e12)  # GB, TFLOPS, GB/s, MB, learning rates: far past any job, none overflow


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A value that starts with a minus and a digit is a (negative) value, never a flag: argparse
        # takes only plain integers and decimals for numbers, so "--params -7B" or "--ref-lr -1e-4"
        # was "expected one argument" rather than the value's own error. No flag here starts so.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message):  # one line, no usage block
        raise PlanError("", message)  # argparse names the flag: "argument --x: ..."


def _count(text: str) -> float:
    """A count such as ``7.5e9``, ``124M`` or ``7B``."""
    t = text.strip().lower().replace("_", "")
    scale = _SUFFIX.get(t[-1:], None)
    try:
        value = float(t[:-1]) * scale if scale else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def _choice(text: str) -> str:
    """A named choice in any case (``BF16``, ``Selective``), as --arch and --gpu take theirs."""
    return text.strip().lower()


def _real(text: str) -> float:
    """A finite float (``nan`` and ``inf`` would go through every comparison) of a magnitude
    the planner models: 0 or within ``_REAL_RANGE`` (a 1e300 GB GPU overflowed its headroom to
    a traceback, a 1e-300 TFLOPS peak times the MFU underflowed to a division by zero)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    low, high = _REAL_RANGE
    if value and not low <= abs(value) <= high:
        raise argparse.ArgumentTypeError(f"{text} is beyond what the planner models (0 or a size from {low:g} "
                                         f"to {high:g})")
    return value


EPILOG = """\
exit status: 0 a plan with a strategy (or a dp x tp x pp layout) that fits; 1 nothing fits
(the plan is printed all the same); 2 bad input (one line on stderr naming the option).

assumptions (printed with every plan): GB = 1e9 bytes and the GPU's memory is the
datasheet's (80 GB = 80e9 bytes, below what the driver reports, which leaves room for the
CUDA context and NCCL's buffers); --scratch-gb (1) for workspaces; model states of
mixed-precision Adam, 16 bytes per parameter before sharding (ZeRO paper; a tensor-parallel
rank holds 1/tp of the split matrices and all of the norms, the row-split projections' biases,
latent attention's down-projections and the routers, as Megatron-LM and torchtitan place
them); activations per Korthikanti et al. 2022 with unfused attention (flash attention needs
about the selective figure), sequence parallelism wherever tensor parallelism is suggested,
under --recompute full the stored block inputs plus the one block backward recomputes at a
time, a vocabulary-parallel loss (logits split by tp; --no-loss-parallel: whole on each tp rank)
and a mixture's token-expert pairs gathered whole on each tp rank (Megatron-Core's dispatch);
compute 6 x the parameters in matrix products (not the embedding lookups) + attention
FLOPs per token at --mfu of the dense peak (a sliding-window layer charged min(seq, window) keys a query;
--precision fp32 at the TF32 tensor-core peak, which fp32 matmuls reach only with
torch.set_float32_matmul_precision('high'): torch's default is plain fp32, several times
slower, so give --peak-tflops for that); communication at the slowest link's peak, per GPU
and direction; under --ep, the experts' all-to-alls on the step's critical path (not
overlapped) and even routing (no load imbalance)."""


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter, description=(
        "Memory, communication and step time of data-parallel and ZeRO training, per GPU. "
        "Memory in GB = 1e9 bytes; bandwidths in GB/s per GPU and direction."))
    m = p.add_argument_group("model (one of: --params, the shape, --hf-config)")
    m.add_argument("--params", type=_count, help="parameter count, e.g. 7.5e9 or 7B")
    m.add_argument("--arch", help=f"block shape for the shape flags: {', '.join(ARCHS)} (default gpt)")
    for flag, text in (("layers", "transformer blocks"), ("hidden", "model width h"),
                       ("heads", "attention heads"), ("vocab", "vocabulary size"),
                       ("ffn-hidden", "MLP width (default 4h)"),
                       ("kv-heads", "key/value heads, grouped-query attention (default: --heads)")):
        m.add_argument(f"--{flag}", type=int, help=text)
    m.add_argument("--hf-config", help=f"a Hugging Face config.json (model_type {', '.join(HF_MODEL_TYPES)}; "
                                       "of a mixture of experts, compute counts the active parameters)")
    j = p.add_argument_group("job")
    j.add_argument("--gpus", type=int, help="data-parallel GPUs N (with --measure: the torchrun world size)")
    j.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8): NVLink within, "
                                                                "the network between")
    j.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per micro-batch (default 1)")
    j.add_argument("--global-batch", type=int, help="sequences per optimizer step (sets gradient accumulation)")
    j.add_argument("--seq", type=int, help="sequence length (default: the config's maximum, "
                                           "max_position_embeddings or n_positions)")
    j.add_argument("--precision", type=_choice, default="bf16", choices=("bf16", "fp16", "fp32"))
    j.add_argument("--recompute", type=_choice, default="none", choices=("none", "selective", "full"))
    j.add_argument("--optimizer", type=_choice, default="adamw", choices=("adamw", "sgd"))
    j.add_argument("--ep", type=int, default=1,
                   help="expert parallelism, mixtures of experts: each MoE layer's routed experts split over ep of "
                        "the data-parallel GPUs (dividing the experts and --gpus; default 1, none)")
    j.add_argument("--pp-schedule", type=_choice, default="1f1b", choices=SCHEDULES,
                   help="pipeline schedule of a suggested pp layout: 1f1b (the first stage holds pp micro-batches' "
                        "activations), gpipe (every stage holds all of a step's) or interleaved (torch's "
                        "ScheduleInterleaved1F1B, --virtual-stages a rank); default 1f1b")
    j.add_argument("--param-groups", type=_choice, default="one", choices=PARAM_GROUPS,
                   help="the optimizer's param groups, which ZeRO-1/2 step as separate flat pieces: one (default) or "
                        "no-decay (norms' weights and biases, the 1-D tensors, in a group of their own)")
    j.add_argument("--virtual-stages", type=int,
                   help="--pp-schedule interleaved: pipeline stages each pp rank runs (v; 1 or more)")
    j.add_argument("--no-loss-parallel", dest="loss_parallel", action="store_false",
                   help="a suggested tensor-parallel layout's loss is not vocabulary-parallel: the output layer "
                        "gathers the logits, whole fp32 logits on each tp rank (torchtitan without loss_parallel); "
                        "default: split by tp (Megatron's, torchtitan's loss_parallel)")
    j.add_argument("--tp-style", type=_choice, default="megatron", choices=TP_STYLES,
                   help="whose tensor parallelism a suggested tp layout's activations follow: megatron (default; a "
                        "column-parallel layer saves its input's sequence shard) or torchtitan (torch's "
                        "ColwiseParallel saves the gathered input: q/k/v's, the MLP's and the output layer's whole "
                        "on each tp rank, and latent attention's replicated down-projections and norms and a "
                        "mixture's router on the gathered tokens as torchtitan's DeepSeek-V3/Llama-4 plans run "
                        "them; a gated shared expert is refused); the printed recipe follows the style")
    h = p.add_argument_group("hardware")
    h.add_argument("--gpu", default="h100", help=f"{', '.join(hardware.CHOICES)} (default h100)")
    h.add_argument("--gpu-memory-gb", type=_real)
    h.add_argument("--peak-tflops", type=_real, help="dense peak for the run's precision (the presets' fp32 is "
                                                      "TF32's, which fp32 matmuls reach only with "
                                                      "torch.set_float32_matmul_precision('high'))")
    h.add_argument("--intra-node-gbps", type=_real, help="GB/s per GPU per direction within a node")
    h.add_argument("--inter-node-gbps", type=_real, help="GB/s per GPU per direction between nodes")
    h.add_argument("--pcie-gbps", type=_real, help="GB/s per direction host <-> GPU (offload)")
    h.add_argument("--host-memory-gb", type=_real,
                   help="host memory per node, shared by its GPUs' ranks, which offload must fit (default 2000: "
                        "the DGX systems' 2 TB)")
    h.add_argument("--host-memory-gbps", type=_real,
                   help="host memory bandwidth per node, which bounds the offloaded optimizer update (default: the "
                        "preset's peak, 563 for H100/H200/B200 nodes, 410 for A100)")
    h.add_argument("--mfu", type=_real, default=timing.DEFAULT_MFU,
                   help=f"assumed model FLOPs utilisation (default {timing.DEFAULT_MFU})")
    o = p.add_argument_group("other")
    o.add_argument("--convention", type=_choice, default="fusedist", choices=memory.CONVENTIONS,
                   help="model states as fusedist allocates them (default) or as the ZeRO paper counts")
    o.add_argument("--bucket-cap-mb", type=_real, default=25.0, help="gradient bucket size (default 25)")
    o.add_argument("--scratch-gb", type=_real, default=1.0, help="allowance for workspaces (default 1)")
    o.add_argument("--ref-lr", type=_real, help="learning rate tuned at --ref-batch")
    o.add_argument("--ref-batch", type=int, help="global batch (sequences) --ref-lr was tuned at")
    o.add_argument("--json", action="store_true", help="print the plan as JSON")
    o.add_argument("--measure", action="store_true",
                   help="under torchrun: train the model with fusedist DDP, ZeRO-1, ZeRO-2, ZeRO-2 offload "
                        "and ZeRO-3 and compare")
    o.add_argument("--steps", type=int, help=f"--measure: steps per strategy (default {MEASURE_STEPS}); only with "
                                             "--measure")
    return p


def model_spec(args) -> ModelSpec:
    if args.hf_config is not None and not args.hf_config.strip():
        # (an unset shell variable, --hf-config "$CONFIG": a model given another way was planned
        # as if the config were not there, or the error asked for a model the user had given)
        raise PlanError("--hf-config", "the path is empty; give the config.json to read")
    given = [name for name, on in (("--params", args.params is not None), ("--hf-config", args.hf_config),
                                   ("the shape flags", any(getattr(args, f) is not None for f in _SHAPE_FLAGS)))
             if on]
    if not given:
        raise PlanError("--params", "give the model: --params, its shape (--layers --hidden --heads --seq "
                                    "--vocab) or --hf-config")
    if len(given) > 1:
        raise PlanError("--params" if "--params" in given else "--hf-config",
                        f"give the model one way, not {' and '.join(given)}")
    shape_only = [_flag(f) for f in ("arch", "ffn_hidden", "kv_heads") if getattr(args, f) is not None]
    if args.hf_config:
        if shape_only:
            raise PlanError("--hf-config", f"{'/'.join(shape_only)} {'come' if len(shape_only) > 1 else 'comes'} "
                                           "from the config")
        return _params_within_bounds(_within_bounds(from_hf_config(args.hf_config), "--hf-config"), "--hf-config")
    if args.params is not None:
        if shape_only:
            raise PlanError("--params", f"{'/'.join(shape_only)} {'describe' if len(shape_only) > 1 else 'describes'} "
                                        "a shape, which --params does not give")
        if args.params <= 0:
            raise PlanError("--params", f"must be positive, got {args.params:g}")
        if round(args.params) < 1:
            raise PlanError("--params", f"{args.params:g} rounds to no parameters")
        _bounded("--params", args.params, MAX_PARAMS)
        return ModelSpec(params=int(round(args.params)), source="params")
    arch = (args.arch or "gpt").lower()  # as --gpu: Llama, LLAMA and llama alike
    if arch not in ARCHS:
        raise PlanError("--arch", f"unknown architecture {args.arch!r} (choose {', '.join(ARCHS)}, in any case)")
    for f in (*_SHAPE_FLAGS, "seq"):
        if getattr(args, f) is None:
            raise PlanError(f"--{f}", "missing: the shape needs --layers --hidden --heads --seq --vocab")
    spec = ModelSpec(arch=arch, layers=args.layers, hidden=args.hidden, heads=args.heads,
                     kv_heads=args.kv_heads, seq=args.seq, vocab=args.vocab, ffn_hidden=args.ffn_hidden)
    _within_bounds(spec, None)
    validate(spec)
    return _params_within_bounds(spec, "--layers")


def _within_bounds(spec: ModelSpec, source: Optional[str]) -> ModelSpec:
    """``spec`` unless a dimension is past what the planner models (``_MAX``), naming the flag
    (or ``source``, the config). A config's maximum positions count only as gpt's learned
    position embedding; elsewhere they are just the default --seq, which :func:`job_of`
    bounds as the job's, so a long-context config planned at a given --seq is not refused."""
    for name, limit in _MAX.items():
        if name == "seq" and spec.arch != "gpt":
            continue
        value = getattr(spec, name)
        if isinstance(value, int):
            named = repr(config_key(spec, name)) if source else name.replace("_", " ")
            _bounded(source or _flag(name), value, limit, named=named)
    return spec


def _params_within_bounds(spec: ModelSpec, flag: str) -> ModelSpec:
    """``spec`` unless its parameters are past :data:`MAX_PARAMS`, as ``--params`` is bounded:
    each dimension within its bound can still multiply to more (a thousand times a head size,
    or 10^5 layers of width 2^20: 1.8e18 parameters, planned as if they were a model)."""
    psi = count_params(spec)
    if psi > MAX_PARAMS:
        shape = "the config" if flag == "--hf-config" else "the shape"
        raise PlanError(flag, f"{shape} gives {psi:.3g} parameters, beyond what the planner models "
                              f"(at most {MAX_PARAMS:g})")
    return spec


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _bounded(flag: str, value, limit, named: str = "") -> None:
    """Refuse ``value`` (None: not given) past ``limit``, what the planner models."""
    if value is not None and value > limit:
        def shown(x):
            return f"{x:g}" if isinstance(x, float) else str(x)
        raise PlanError(flag, f"{named + ' ' if named else ''}{shown(value)} is beyond what the planner models "
                              f"(at most {shown(limit)})")


def job_of(args, spec: ModelSpec, gpus: int) -> Job:
    seq = args.seq if args.seq is not None else spec.seq
    if seq is None:
        raise PlanError("--seq", "needed (tokens per step)")
    for name, limit in _MAX_JOB.items():
        _bounded(_flag(name), gpus if name == "gpus" else getattr(args, name), limit)
    if args.seq is None and seq > _MAX["seq"]:  # (the user gave no --seq: say where it came from)
        raise PlanError("--seq", f"the model's {seq} positions, the default --seq, are beyond what the planner "
                                 f"models (at most {_MAX['seq']}); give --seq, the tokens per sequence you train")
    _bounded("--seq", seq, _MAX["seq"])
    checks = (("--gpus", gpus), ("--gpus-per-node", args.gpus_per_node), ("--micro-batch", args.micro_batch),
              ("--global-batch", args.global_batch), ("--seq", seq), ("--ref-batch", args.ref_batch),
              ("--bucket-cap-mb", args.bucket_cap_mb), ("--ref-lr", args.ref_lr), ("--steps", args.steps))
    for flag, value in checks:
        if value is not None and not value > 0:
            raise PlanError(flag, f"must be positive, got {value:g}")
    if args.scratch_gb < 0:
        raise PlanError("--scratch-gb", f"must not be negative, got {args.scratch_gb:g}")
    if not 0 < args.mfu <= 1:
        raise PlanError("--mfu", f"must be in (0, 1], got {args.mfu:g}")
    if gpus > args.gpus_per_node and gpus % args.gpus_per_node:
        raise PlanError("--gpus-per-node", f"{gpus} GPUs are not whole nodes of {args.gpus_per_node}")
    if args.global_batch is not None and args.global_batch % (args.micro_batch * gpus):
        per_step = args.micro_batch * gpus
        lower = args.global_batch // per_step * per_step
        options = " or ".join(str(x) for x in (lower, lower + per_step) if x > 0)
        raise PlanError("--global-batch", f"{args.global_batch} sequences are not whole micro-batches on every "
                                          f"GPU: a multiple of --micro-batch {args.micro_batch} x {gpus} GPUs "
                                          f"= {per_step} (e.g. {options})")
    if spec.arch == "gpt" and spec.has_shape and seq > spec.seq:
        raise PlanError("--seq", f"{seq} is longer than the model's {spec.seq} learned positions")
    check_expert_parallel(args.ep, spec, gpus)
    virtual = _virtual_stages(args)
    if (args.ref_lr is None) != (args.ref_batch is None):
        raise PlanError("--ref-batch" if args.ref_batch is None else "--ref-lr",
                        "give --ref-lr and --ref-batch together")
    return Job(gpus=gpus, micro_batch=args.micro_batch, seq=seq, gpus_per_node=args.gpus_per_node,
               global_batch=args.global_batch, precision=args.precision, recompute=args.recompute,
               optimizer=args.optimizer, convention=args.convention, mfu=args.mfu,
               bucket_cap_mb=args.bucket_cap_mb, scratch_gb=args.scratch_gb, ref_lr=args.ref_lr,
               ref_batch=args.ref_batch, seq_from_config=args.seq is None, ep=args.ep,
               pp_schedule=args.pp_schedule, virtual_stages=virtual, param_groups=args.param_groups,
               loss_parallel=args.loss_parallel, tp_style=args.tp_style)


def _virtual_stages(args) -> int:
    """--virtual-stages, which only the interleaved schedule has and which it needs."""
    v = args.virtual_stages
    if args.pp_schedule != "interleaved":
        if v is not None:
            raise PlanError("--virtual-stages", f"only with --pp-schedule interleaved (got --pp-schedule "
                                                f"{args.pp_schedule}, one stage a rank)")
        return 1
    if v is None:
        raise PlanError("--virtual-stages", "needed with --pp-schedule interleaved: the stages each pipeline rank "
                                            "runs, e.g. 2")
    if v < 1:
        raise PlanError("--virtual-stages", f"must be positive, got {v}")
    _bounded("--virtual-stages", v, MAX_LAYERS)
    return v


def main(argv=None) -> int:
    try:
        args = parser().parse_args(argv)
        if args.steps is not None and not args.measure:  # a plan trains nothing: say so, not ignore it
            raise PlanError("--steps", "counts the steps --measure trains; give it with --measure")
        spec = model_spec(args)
        hw = hardware.resolve(args.gpu, args.gpu_memory_gb, args.peak_tflops, args.intra_node_gbps,
                              args.inter_node_gbps, args.pcie_gbps, args.host_memory_gb, args.host_memory_gbps)
        if args.measure:
            try:
                world = int(os.environ.get("WORLD_SIZE", "0") or 0)
            except ValueError:
                raise PlanError("--measure", f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a rank count: "
                                             "run under torchrun") from None
            if world < 2:
                raise PlanError("--measure", "run under torchrun with 2 or more ranks, e.g. torchrun "
                                             "--nproc_per_node=2 -m fusedist.plan --measure ...")
            if args.gpus is not None and args.gpus != world:
                raise PlanError("--gpus", f"{args.gpus} differs from the torchrun world size {world}")
            if not spec.has_shape:
                raise PlanError("--measure", "needs the model's shape or --hf-config, not --params")
            if args.ep != 1:
                raise PlanError("--ep", f"{args.ep}: --measure trains fusedist's data-parallel strategies, which "
                                        "hold every expert on every rank; measure with --ep 1")
            job = job_of(args, spec, world)
        else:
            if args.gpus is None:
                raise PlanError("--gpus", "missing: the number of data-parallel GPUs")
            job = job_of(args, spec, args.gpus)
        plan = build_plan(spec, job, hw)
    except PlanError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if args.measure:
        from .measure import run  # imports torch.distributed only when measuring
        return run(spec, job, hw, plan, steps=args.steps or MEASURE_STEPS, as_json=args.json)
    if args.json:
        try:
            text = json.dumps(plan, indent=2, allow_nan=False)  # JSON itself: no Infinity, no NaN
        except ValueError as exc:
            print(f"{PROG}: error: a figure of the plan is not finite ({exc})", file=sys.stderr)
            return 2
        print(text)
    else:
        from .report import format_plan
        print(format_plan(plan))
    if plan["suggestion"]["strategy"] is None:
        print(f"{PROG}: nothing fits (exit status 1): see the suggestion above", file=sys.stderr)
        return 1
    return 0
