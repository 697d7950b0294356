"""Putting the pieces together: one plan (the ``--json`` document) for a model, a job and
a GPU."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from . import comm, memory, suggest, timing
from .errors import PlanError
from .hardware import PRESETS, Hardware
from .model import (ModelSpec, activation_bytes, active_params, attention_flops_per_token, count_params,
                    expert_params, matmul_params, recomputed_layer_bytes)
from .memory import STRATEGIES
from .param_tensors import Vector, block_tensors, on_tp_rank, param_tensors, root_tensors, split_elements
from .pipeline import pipeline_activation_bytes, pipeline_schedule, schedule_refusal
from .tp_style import check_tp_style

GB = 10**9
# ModelSpec fields left out of the plan's model while off, so a plain model reads as before
_SHOWN_WHEN_ON = ("qkv_bias", "out_bias", "mlp_bias", "qk_norm", "sandwich_norm", "gemma_norm", "shared_ffn",
                  "shared_gate", "dense_layers", "parallel_attn", "shared_norm", "rope_head_dim", "dense_ids",
                  "window_layers")


@dataclasses.dataclass(frozen=True)
class Job:
    gpus: int
    micro_batch: int
    seq: int
    gpus_per_node: int = 8
    global_batch: Optional[int] = None
    precision: str = "bf16"
    recompute: str = "none"
    optimizer: str = "adamw"
    convention: str = "fusedist"
    mfu: float = timing.DEFAULT_MFU
    bucket_cap_mb: float = 25.0
    scratch_gb: float = 1.0
    ref_lr: Optional[float] = None
    ref_batch: Optional[int] = None
    seq_from_config: bool = False  # --seq not given: the model's maximum
    ep: int = 1  # expert parallelism: each MoE layer's routed experts over ep ranks of the N
    # a suggested pipeline's schedule: how many micro-batches a stage holds (fusedist/plan/pipeline.py)
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1  # pipeline stages a rank runs (the interleaved schedule)
    # the optimizer's param groups: "one", or "no-decay" (1-D tensors, norms and biases, in a group of their own)
    param_groups: str = "one"
    # a vocabulary-parallel loss (Megatron's, torchtitan's loss_parallel): logits split by tensor parallelism;
    # False: the output layer gathers them, whole on each tensor-parallel rank
    loss_parallel: bool = True
    # whose tensor parallelism the activations follow: "megatron" (a column-parallel layer saves its input's
    # shard) or "torchtitan" (torch's ColwiseParallel saves the gathered input; fusedist/plan/tp_style.py)
    tp_style: str = "megatron"

    @property
    def ranks_per_node(self) -> int:
        """The ranks one node runs, which share its host memory (all of them in a one-node job)."""
        return min(self.gpus, self.gpus_per_node)


def _memory_entry(spec: ModelSpec, psi: float, job: Job, hw: Hardware, strategy: str,
                  dp: int, tp: int = 1, pp: int = 1, ep: Optional[int] = None) -> dict:
    """Bytes per GPU of ``strategy`` with ``dp`` data-parallel ranks, the model split ``tp``
    ways by tensor and ``pp`` ways by pipeline parallelism, and the routed experts ``ep``
    ways within the ``dp`` ranks (default the job's)."""
    ep = job.ep if ep is None else ep
    tp_psi = _tp_params(spec, psi, tp)  # Note [what tensor parallelism splits] in param_tensors.py
    shard_psi = tp_psi / pp
    held = memory.held_params(tp_psi, expert_params(spec) / tp, ep) / pp if ep > 1 else None
    tensors = _tensors(spec, tp, ep)
    states = memory.model_states(shard_psi, dp, strategy, job.precision, job.optimizer, job.convention, held=held,
                                 step_tensors=_stepped_tensors(tensors, strategy, job, dp, pp,
                                                               _groups(spec, ep, job.param_groups)))
    # the micro-batches a step runs on each pipeline (Note [activations under pipeline parallelism])
    micro_batches = suggest.grad_accum(job.global_batch, job.micro_batch, dp)[0]
    act = pipeline_activation_bytes(spec, job.micro_batch, job.seq, job.precision, job.recompute, tp, pp,
                                    micro_batches, job.pp_schedule, job.virtual_stages, job.loss_parallel, job.tp_style)
    units, outputs = _zero3_units(spec, tp, dp, ep)
    root = _root_params(spec, tp)
    temp_args = (strategy, shard_psi if held is None else held, job.precision, units, job.bucket_cap_mb,
                 job.scratch_gb * GB)
    temp = memory.temp_bytes(*temp_args, root_params=root, n=dp, unit_outputs=outputs, tensors=tensors)
    # the least the peak can be: one gradient reduction in flight (memory.temp_bytes)
    temp_min = memory.temp_bytes(*temp_args, root_params=root, n=dp, unit_outputs=outputs, in_flight=1,
                                 tensors=tensors)
    total = states.device + (act or 0) + temp
    capacity = hw.memory_gb * GB
    # Note [host memory fits too]
    host_node = states.host * job.ranks_per_node
    host_capacity = hw.host_memory_gb * GB
    return {
        "model_states_bytes": int(round(states.device)),
        "activation_bytes": act,
        # of which the one layer full recomputation reruns in backward (Note [the recomputed layer])
        "activation_recompute_bytes": (None if act is None else
                                       recomputed_layer_bytes(spec, job.micro_batch, job.seq, job.precision,
                                                              job.recompute, tp, job.tp_style)),
        "temp_bytes": int(round(temp)),
        "temp_min_bytes": int(round(temp_min)),
        "total_bytes": int(round(total)),
        "host_bytes": int(round(states.host)),
        "host_node_bytes": int(round(host_node)),
        "host_fits": bool(host_node <= host_capacity),
        "host_headroom_bytes": int(round(host_capacity - host_node)),
        "fits": bool(total <= capacity and host_node <= host_capacity),
        "headroom_bytes": int(round(capacity - total)),
        "terms": {k: int(round(v)) for k, v in states.terms.items()},
    }


# Note [host memory fits too]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Offloading moves model states to host memory, which is finite too: a node's ranks share its
# system memory (2 TB on the DGX systems of the presets, --host-memory-gb), so a strategy fits
# only where each GPU's share and the node's sum of them both fit. Without this check every
# model "fits" with zero3_offload, whose GPU holds no model states between steps: a 7T-parameter
# model on 8 GPUs needs 16 x 7T / 8 = 14 TB of host memory a GPU, 112 TB on the node. The sum is
# over the ranks on one node (all of them when the job fits in a node); what the operating
# system, data loaders and pinned staging buffers take is left to the headroom.


def _stepped_tensors(tensors: Optional[tuple], strategy: str, job: Job, dp: int, pp: int,
                     groups: Optional[tuple] = None) -> Optional[int]:
    """The tensors a rank's optimizer steps (Note [step counts] in memory.py): every parameter (DDP) or
    piece (ZeRO-3), or the flat pieces of the busiest rank, one per gradient bucket and param group
    run (ZeRO-1/2); a pipeline stage its share."""
    if tensors is None:
        return None
    count = len(tensors)
    if strategy.startswith(("zero1", "zero2")):
        count = memory.zero_pieces(tensors, groups or (0,) * count, job.bucket_cap_mb,
                                   memory.param_bytes(job.precision), dp)
    return -(-count // pp)


PARAM_GROUPS = ("one", "no-decay")


@functools.lru_cache(maxsize=32)
def _groups(spec: ModelSpec, ep: int, param_groups: str) -> Optional[tuple]:
    """Each parameter tensor's param group, registration order: all in one, or ``no-decay``'s
    split (the 1-D tensors, norms' weights and biases, in group 1: nanoGPT's and the Hugging Face
    Trainer's no-weight-decay group)."""
    if not spec.has_shape:
        return None
    return tuple(int(param_groups == "no-decay" and isinstance(t, Vector)) for t in param_tensors(spec, ep))


@functools.lru_cache(maxsize=32)
def _tensors(spec: ModelSpec, tp: int, ep: int) -> Optional[tuple]:
    """A rank's parameter tensors, elements in registration order (ZeRO-2's buckets), each
    split ``tp`` ways; None without a shape. Cached: the layout search asks for it per strategy."""
    if not spec.has_shape:
        return None
    return tuple(on_tp_rank(t, tp) for t in param_tensors(spec, ep))


@functools.lru_cache(maxsize=32)
def _tp_params(spec: ModelSpec, psi: float, tp: int) -> float:
    """The parameters one of ``tp`` tensor-parallel ranks holds: the split ones' share and the whole
    ones (Note [what tensor parallelism splits] in param_tensors.py); ``psi / tp`` for a model given by
    --params alone."""
    if not spec.has_shape or tp == 1:
        return psi / tp
    return split_elements(param_tensors(spec), tp)


def _root_params(spec: ModelSpec, tp: int) -> float:
    """What one of ``tp`` ranks holds of the parameters outside the blocks (ZeRO-3's root unit)."""
    if not spec.has_shape:
        return 0.0
    return split_elements(root_tensors(spec, before_blocks=True) + root_tensors(spec, before_blocks=False), tp)


def _zero3_units(spec: ModelSpec, tp: int, dp: int, ep: int) -> tuple:
    """ZeRO-3's units in order, as one rank gathers them (1/ep of an MoE block's experts), and
    their reduce-scatter outputs: 1/N of the whole block, the experts' 1/(N/ep) of 1/ep; of a
    tensor-parallel rank's share of each block."""
    if not spec.has_shape:
        return 0.0, None
    units = [split_elements(block_tensors(spec, i, ep), tp) for i in range(spec.layers)]
    outputs = [split_elements(block_tensors(spec, i), tp) / dp for i in range(spec.layers)]
    return units, outputs


def _window_note(spec: ModelSpec, seq: int) -> str:
    """How the FLOPs line counts windowed blocks (Note [sliding windows] in model.py)."""
    windowed = spec.windowed_layers(seq)
    if not windowed:
        return ""
    return f"(seq -> window {spec.sliding_window} in {windowed} windowed layers) "


def _all_to_all(spec: ModelSpec, job: Job, hw: Hardware, accum: int) -> dict:
    """The expert all-to-alls of a step (:func:`comm.all_to_all_bytes`), per GPU."""
    nbytes = 0.0
    if spec.has_shape and spec.moe:
        per_micro = comm.all_to_all_bytes(job.micro_batch * job.seq, spec.hidden, spec.experts_per_token,
                                          memory.param_bytes(job.precision), job.ep, spec.moe_layers,
                                          comm.all_to_all_passes(job.recompute))
        nbytes = accum * per_micro
    gbps = comm.expert_bandwidth_gbps(job.ep, job.gpus, job.gpus_per_node, hw.intra_node_gbps, hw.inter_node_gbps)
    return {"all_to_all_bytes_per_step": int(round(nbytes)), "all_to_all_seconds": comm.seconds(nbytes, gbps),
            "all_to_all_gbps": gbps}


def _schedule_refusal(spec: ModelSpec, job: Job, dp: int, pp: int) -> Optional[str]:
    """Why ``pp`` stages on ``dp`` data-parallel ranks cannot run the job's pipeline schedule
    (:func:`fusedist.plan.pipeline.schedule_refusal`), or None."""
    if pp == 1:
        return None
    m = suggest.grad_accum(job.global_batch, job.micro_batch, dp)[0]
    why = schedule_refusal(job.pp_schedule, pp, m, job.virtual_stages, spec.layers if spec.has_shape else None)
    if why and job.pp_schedule == "1f1b":
        why += (f": give a --global-batch of at least {pp * job.micro_batch * dp} (pp x --micro-batch x dp "
                f"{dp}) or --pp-schedule gpipe")
    return why


def check_expert_parallel(ep: int, spec: ModelSpec, gpus: int) -> None:
    """--ep splits a mixture of experts' routed experts: whole experts on each of ep ranks, and
    ep ranks a group within the data-parallel GPUs."""
    if ep < 1:
        raise PlanError("--ep", f"must be positive, got {ep}")
    if ep == 1:
        return
    if not spec.moe:
        what = "a model given by --params" if not spec.has_shape else f"this model ({spec.source})"
        raise PlanError("--ep", f"{ep}: expert parallelism needs a mixture of experts; {what} has no experts")
    if spec.experts % ep:
        raise PlanError("--ep", f"{ep} does not divide the {spec.experts} experts of each MoE layer")
    if gpus % ep:
        raise PlanError("--ep", f"{ep} does not divide the {gpus} data-parallel GPUs")


def _peak_kind(hw: Hardware, precision: str) -> str:
    """What the peak is: a preset's for the precision -- for fp32 the TF32 tensor-core one,
    which fp32 matmuls reach only when allowed (torch's default keeps them plain fp32) -- or
    the figure --peak-tflops gave."""
    preset = PRESETS.get(hw.name)
    if preset is None or preset.peak_flops(precision) != hw.peak_flops(precision):
        return "given by --peak-tflops"
    if precision == "fp32":
        return "tf32 dense: needs torch.set_float32_matmul_precision('high'), else give --peak-tflops"
    return "bf16/fp16 dense"


def build_plan(spec: ModelSpec, job: Job, hw: Hardware) -> dict:
    """The full plan: ``inputs``, ``memory``, ``comm``, ``time``, ``suggestion``. Memory and
    communication move every parameter; compute is that of the parameters a token goes through
    (a mixture of experts': Note [active parameters] in model.py)."""
    check_expert_parallel(job.ep, spec, job.gpus)
    check_tp_style(spec, job.tp_style)
    psi = count_params(spec)
    psi_active = active_params(spec)
    psi_flops = matmul_params(spec)  # Note [lookups are not products] in model.py
    n = job.gpus
    accum, global_batch = suggest.grad_accum(job.global_batch, job.micro_batch, n)
    tokens = global_batch * job.seq
    gbps = comm.bandwidth_gbps(n, job.gpus_per_node, hw.intra_node_gbps, hw.inter_node_gbps)
    peak = hw.peak_flops(job.precision)
    attention_fwd = attention_flops_per_token(spec, job.seq)

    mem, com, tim = {}, {}, {}
    expert = expert_params(spec)
    a2a = _all_to_all(spec, job, hw, accum)
    for s in STRATEGIES:
        mem[s] = _memory_entry(spec, psi, job, hw, s, n)
        nbytes = comm.expert_parallel_bytes(psi, expert, job.ep, n, s, job.precision, job.convention, accum)
        com_s = comm.seconds(nbytes, gbps)
        pcie = comm.pcie_bytes(psi, n, s, job.precision, job.convention, accum)
        pcie_s = comm.seconds(pcie, hw.pcie_gbps)
        com[s] = {"bytes_per_step": int(round(nbytes)), "seconds": com_s,
                  "bandwidth_gbps": gbps, "pcie_bytes_per_step": int(round(pcie)), "pcie_seconds": pcie_s, **a2a}
        compute_s = timing.compute_seconds(psi_flops, tokens, n, peak, job.mfu, job.recompute, attention_fwd)
        # the node's ranks update at once, sharing its host memory bandwidth
        host_b = timing.host_update_bytes(psi, n, s, job.precision, job.optimizer, job.convention)
        host_s = comm.seconds(host_b * job.ranks_per_node, hw.host_memory_gbps)
        com[s]["host_update_bytes_per_step"] = int(round(host_b))
        tim[s] = timing.step_times(compute_s, com_s, pcie_s, tokens, a2a["all_to_all_seconds"], host_s)

    for s in STRATEGIES:
        mem[s]["runs"] = suggest.runs(s, job.optimizer)
    best = suggest.cheapest(mem, tim, job.optimizer)
    layout = None
    refused = {}  # pp -> why torch's schedule does not run it (Note [interleaved 1F1B as torch runs it])
    if best is None:
        def total_of(strategy, dp, tp, pp, ep):
            e = _memory_entry(spec, psi, job, hw, strategy, dp, tp, pp, ep)
            return e["total_bytes"], e["fits"]

        def refusal(dp, pp):
            why = _schedule_refusal(spec, job, dp, pp)
            if why:
                refused.setdefault(f"pp={pp}", why)
            return why
        layout = suggest.layout(n, job.gpus_per_node, spec.heads, spec.layers, total_of,
                                kv_heads=spec.kv if spec.has_shape else None,
                                eps=suggest.expert_parallel_sizes(spec.experts if spec.moe else None, job.ep),
                                refusal=refusal)
    if layout is not None:
        accum, global_batch = suggest.grad_accum(job.global_batch, job.micro_batch, layout["dp"])
        if layout["pp"] > 1:
            layout["pipeline"] = pipeline_schedule(spec, job.micro_batch, job.seq, job.precision, layout["tp"],
                                                   layout["pp"], accum, job.pp_schedule, job.virtual_stages)
    lr = suggest.learning_rate(job.ref_lr, job.ref_batch, global_batch)

    inputs = {
        "model": {k: v for k, v in dataclasses.asdict(spec).items()
                  if v is not None and not (k in _SHOWN_WHEN_ON and not v)},
        "params": psi,
        "active_params": psi_active,
        "matmul_params": psi_flops,
        "expert_params": expert,
        "ep": job.ep,
        "sliding_window": spec.sliding_window,
        "windowed_layers": spec.windowed_layers(job.seq),
        "gpus": n, "gpus_per_node": job.gpus_per_node, "micro_batch": job.micro_batch,
        "global_batch": job.global_batch, "seq": job.seq, "seq_from_config": job.seq_from_config,
        "precision": job.precision,
        "recompute": job.recompute, "optimizer": job.optimizer, "convention": job.convention,
        "pp_schedule": job.pp_schedule,
        "param_groups": job.param_groups,
        "loss_parallel": job.loss_parallel,
        "tp_style": job.tp_style,
        **({"virtual_stages": job.virtual_stages} if job.pp_schedule == "interleaved" else {}),
        "gpu": dataclasses.asdict(hw),
        "assumptions": {
            "mfu": job.mfu,
            "peak_flops": peak,
            "peak_flops_kind": _peak_kind(hw, job.precision),
            "flops_per_token": timing.flops_per_token(psi_flops, job.recompute, attention_fwd),
            "flops": (f"{8 if job.recompute == 'full' else 6} x {'active ' if spec.moe else ''}params in matrix "
                      f"products ({psi_flops:,}; embedding lookups are not) + "
                      f"{12 if job.recompute == 'none' else 16} x layers x seq x heads x head_dim "
                      + _window_note(spec, job.seq) +
                      f"(weights, attention scores{'' if job.recompute == 'none' else ', recomputation'}; "
                      "PaLM, Appendix B)"
                      if spec.has_shape else f"{8 if job.recompute == 'full' else 6} x params (attention not "
                      "counted: the model was given by --params, not its shape)"),
            "K": {s: memory.optimizer_k(job.precision, job.optimizer, s, job.convention) for s in STRATEGIES},
            "bucket_cap_mb": job.bucket_cap_mb,
            "temp": ("zero2: the largest three consecutive gradient buckets DDP builds at --bucket-cap-mb "
                     "(two reduce-scatters in flight, fusedist's bound, and the bucket filling; a bucket "
                     "closes once it reaches the cap, the tensor crossing it included; a mixture's "
                     "experts stacked, one tensor a layer; three caps for a model given by --params); "
                     "zero3: fully_shard with "
                     "reshard_after_forward=True on the blocks (the default), two gathered at once -- False "
                     "keeps every unit gathered from forward to backward, all the parameters, not counted"),
            "scratch_bytes": int(job.scratch_gb * GB),
            "tokens_per_step": tokens,
            "bytes_unit": "GB = 1e9 bytes in the table",
            "gpu_memory": "the datasheet's, in GB = 1e9 bytes (below what the driver reports: room for the "
                          "CUDA context and NCCL's buffers, which are not counted)",
            "activations": ("Korthikanti et al. 2022, unfused attention (flash attention needs about the "
                            "selective figure), dropout masks counted; sequence parallelism with any "
                            "suggested tensor parallelism; a suggested pipeline's fullest stage: its blocks times "
                            "the micro-batches it holds at once (1F1B: the first stage holds min(pp, micro-batches) "
                            "of them, GPipe: every stage all of them; Megatron's memory estimator; interleaved: "
                            "the chunks torch's ScheduleInterleaved1F1B keeps alive on a rank at its peak); "
                            + ("a vocabulary-parallel loss under tensor parallelism (Megatron's, torchtitan's "
                               "loss_parallel: the fp32 logits split by tp)" if job.loss_parallel else
                               "no vocabulary-parallel loss (--no-loss-parallel): the output layer gathers the "
                               "logits, whole fp32 logits on each tensor-parallel rank")
                            + ("; Megatron-LM's tensor parallelism: a column-parallel layer (q/k/v, MLP up/gate, "
                               "output layer) saves its input's 1/tp sequence shard and gathers it again in backward"
                               if job.tp_style == "megatron" else
                               "; torchtitan's tensor parallelism (--tp-style torchtitan: torch's ColwiseParallel "
                               "after a Shard(1) to Replicate redistribution): each tensor-parallel rank keeps the "
                               "attention's, the MLP's and the output layer's gathered inputs whole"
                               + ("; latent attention's down-projections and norms run replicated on the whole "
                                  "sequence (NoParallel), their tensors and the up-projections' inputs whole"
                                  if spec.kv_lora_rank is not None else "")
                               + ("; the router runs replicated on the gathered tokens, its probabilities, top-k "
                                  "indices and weights whole" if spec.moe else ""))),
        },
    }
    if job.recompute == "full" and spec.has_shape:  # Note [the recomputed layer] in model.py
        layer = recomputed_layer_bytes(spec, job.micro_batch, job.seq, job.precision, "full")
        stored = activation_bytes(spec, job.micro_batch, job.seq, job.precision, "full") - layer
        inputs["assumptions"]["activations"] += (
            f"; full recomputation peaks at {stored / GB:.2f} GB stored (the layers' inputs, the output "
            f"layer's) plus {layer / GB:.2f} GB for the one layer backward recomputes at a time "
            "(without tensor parallelism)")
    if spec.attn_softcap is not None or spec.final_softcap is not None:  # Note [soft-capping] in model.py
        inputs["assumptions"]["activations"] += (
            "; soft-capping keeps tanh's output: " + " and ".join(
                what for what, cap in (("one more heads x s x s tensor a layer (not under selective or "
                                        "flash attention)", spec.attn_softcap),
                                       ("the logits' s x vocab in the activations' dtype", spec.final_softcap))
                if cap is not None))
    if spec.has_shape and spec.arch == "llama":  # Note [what a norm keeps] in norm_bytes.py
        inputs["assumptions"]["activations"] += (
            "; an RMSNorm keeps its rows in fp32, the normalised rows in fp32 and an fp32 rstd a row (Gemma's "
            "RMSNorm, which multiplies by 1 + weight before the cast back: 8h + 4 bytes a token in bf16 and fp32, "
            "and that fp32 1 + weight once a norm for each micro-batch, whole on each tensor-parallel rank)"
            if spec.gemma_norm else
            "; an RMSNorm keeps its rows in fp32, the normalised rows and an fp32 rstd a row (transformers' "
            "Llama RMSNorm: 6h + 4 bytes a token in bf16, where a LayerNorm keeps its 2h input)")
        if spec.kv_lora_rank is not None:
            inputs["assumptions"]["activations"] += (
                "; latent attention's RMSNorms of its compressed keys/values (kv_lora_rank) and queries "
                "(q_lora_rank) keep the same, a row of their width a token, and its up-projections "
                "(kv_b_proj, q_b_proj) keep their inputs, those norms' outputs (in fp32 also the rotary "
                "columns of kv_a_proj_with_mqa's output)")
    if spec.has_shape and spec.moe:  # Note [routed tokens under tensor parallelism] in routed_bytes.py
        inputs["assumptions"]["activations"] += (
            "; under tensor parallelism a mixture's router runs on each rank's sequence-parallel tokens and its "
            "dispatch gathers the group's tokens (Megatron-Core): each token-expert pair's gathered copy, expert "
            "output and weight and two int64 sort indices whole on every rank, the experts' SwiGLU tensors split "
            "by tp")
    if spec.windowed_layers(job.seq):
        inputs["assumptions"]["activations"] += ("; a sliding window stores the same tensors (the unfused "
                                                 "softmax is s x s whatever the mask)")
    if not spec.has_shape:
        inputs["assumptions"]["activations"] = "not estimated: the model was given by --params, not its shape"
    return {
        "inputs": inputs,
        "memory": mem,
        "comm": com,
        "time": tim,
        "suggestion": {
            "strategy": best if best is not None else (layout["strategy"] if layout else None),
            "layout": layout if layout is not None else ({"dp": n, "tp": 1, "pp": 1, "ep": job.ep, "strategy": best}
                                                        if best else None),
            "grad_accum_steps": accum,
            "global_batch": global_batch,
            "lr": lr,
            **({"layouts_refused": refused} if refused else {}),
        },
    }
