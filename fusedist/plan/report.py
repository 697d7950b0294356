"""The readable table of a plan (``--json`` prints the plan itself)."""

from __future__ import annotations

from typing import Optional

from .memory import STRATEGIES
from .suggest import grad_accum

GB = 1e9


def _gb(x) -> str:
    return "n/a" if x is None else f"{x / GB:.2f}"


def _seconds(x: float) -> str:
    if x == 0:
        return "0"
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def model_line(plan: dict) -> str:
    i = plan["inputs"]
    m = i["model"]
    line = f"model: {i['params']:,} parameters ({i['params'] / 1e9:.2f}B)"
    if m.get("experts") is not None:  # Note [active parameters] in model.py
        line += (f", {i['active_params']:,} ({i['active_params'] / 1e9:.2f}B) active per token "
                 f"(compute counts these; memory and communication all)")
    if "layers" in m:
        line += (f", {m['arch']} {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads"
                 + (f" ({m['kv_heads']} kv)" if m.get("kv_heads") not in (None, m["heads"]) else "")
                 + (f" of {m['head_dim']}" if m.get("head_dim") is not None else "")
                 + "".join(f", {name.replace('_', ' ')}" for name in ("qkv_bias", "out_bias", "mlp_bias",
                                                                       "qk_norm", "sandwich_norm", "gemma_norm",
                                                                       "parallel_attn", "shared_norm")
                           if m.get(name))
                 + (f", latent attention (kv rank {m['kv_lora_rank']}, q rank {m.get('q_lora_rank') or 'full'}, "
                    f"values of {m['v_head_dim']})" if m.get("kv_lora_rank") else "")
                 + (f", {m['experts']} experts of {m['expert_ffn']} ({m['experts_per_token']} per token"
                    + (f", a shared one of {m['shared_ffn']}" if m.get("shared_ffn") else "")
                    + (f", {m['dense_layers']} dense layers" if m.get("dense_layers") else "") + ")"
                    if m.get("experts") is not None else "")
                 + _moe_freq_text(m)
                 + _window_text(i) + _softcap_text(m)
                 + f", vocab {m['vocab']}" + (", tied" if m.get("tied") else ""))
    if m.get("source", "shape") not in ("shape", "params"):
        line += f"; from {m['source']}"
    return line


def _moe_freq_text(m: dict) -> str:
    """DeepSeek's moe_layer_freq, which transformers' classes ignore (Note [moe_layer_freq] in hf_config.py)."""
    freq = m.get("moe_layer_freq")
    if freq is None:
        return ""
    return (f", experts on one block in {freq} (moe_layer_freq {freq}, as DeepSeek's modeling code; "
            "transformers' DeepseekV2/V3 ignore it and put experts on every block from first_k_dense_replace)")


def _window_text(i: dict) -> str:
    """The sliding window and how many blocks it limits at this --seq (Note [sliding windows])."""
    window = i.get("sliding_window")
    if window is None:
        return ""
    layers = len(i["model"].get("window_layers", ()))
    if not i.get("windowed_layers"):
        return f", sliding window {window} on {layers} layers (no shorter than seq {i['seq']}: full attention)"
    return f", sliding window {window} on {i['windowed_layers']} of {i['model']['layers']} layers"


def _softcap_text(m: dict) -> str:
    """Gemma-2's soft-caps (Note [soft-capping] in model.py), which add saved tensors."""
    caps = [f"{what} at {m[key]:g}" for what, key in (("scores", "attn_softcap"), ("logits", "final_softcap"))
            if m.get(key) is not None]
    return f", soft-capped {' and '.join(caps)}" if caps else ""


def _expert_lines(plan: dict) -> list:
    """The all-to-alls of expert parallelism, which the table's comm columns leave out."""
    i, c = plan["inputs"], plan["comm"]["ddp"]
    if i.get("ep", 1) == 1:
        return []
    return [f"expert parallelism ep={i['ep']}: {i['expert_params']:,} routed-expert parameters, 1/{i['ep']} of them "
            f"on each GPU; all-to-alls {_gb(c['all_to_all_bytes_per_step'])} GB per step per GPU at "
            f"{c['all_to_all_gbps']:g} GB/s, {_seconds(c['all_to_all_seconds'])}, added to every step "
            "(not overlapped)"]


# What each data-parallel strategy is in fusedist, over the mesh's "dp" dim.
_DATA_PARALLEL = {
    "ddp": 'fusedist.DistributedDataParallel(module, process_group=mesh["dp"].get_group()) (or fusedist.replicate)',
    "zero1": 'fusedist.ZeroRedundancyOptimizer(..., stage=1, process_group=mesh["dp"].get_group()) over a '
             'fusedist.DistributedDataParallel module',
    "zero2": 'fusedist.ZeroRedundancyOptimizer(..., stage=2, process_group=mesh["dp"].get_group()) over a '
             'fusedist.DistributedDataParallel module',
    "zero3": 'fusedist.fully_shard(block, mesh=mesh["dp"]) for each block, then the root module',
}


def recipe(layout: dict, loss_parallel: bool = True, tp_style: str = "megatron", model: Optional[dict] = None) -> list:
    """How to build a model-parallel ``layout`` with fusedist and torch: the mesh, tensor
    parallelism as the style the activations were counted for (Megatron-LM's layers, or torch's
    ``parallelize_module`` with torchtitan's plans for the ``model``'s blocks), the loss, the
    data-parallel strategy, pipeline stages and their checkpoints."""
    dims = [(name, layout[name]) for name in ("pp", "dp", "tp") if layout[name] > 1 or name == "dp"]
    def tuple_of(items) -> str:
        return f"({', '.join(items)}{',' if len(items) == 1 else ''})"

    mesh = (f'mesh = init_device_mesh("cuda", {tuple_of([str(n) for _, n in dims])}, '
            f'mesh_dim_names={tuple_of([chr(34) + d + chr(34) for d, _ in dims])})')
    out = [f"  how: {mesh}"]
    if layout["tp"] > 1:
        out += _tensor_parallel_lines(loss_parallel, tp_style, model or {})
    out.append(f"  data parallelism ({layout['strategy']}): {_DATA_PARALLEL[layout['strategy']]}")
    if layout["pp"] > 1:
        group = 'mesh["dp", "tp"]' if layout["tp"] > 1 else 'mesh["dp"]'
        out.append('  pipeline: stage modules cut from the whole model with the other layers removed (names kept), '
                   'run by fusedist.pipelining.PipelineStage(stage, i, num_stages, device, '
                   'group=mesh["pp"].get_group()) under torch\'s schedules (one gradient reduction per step)')
        out.append(f"  checkpoints: fusedist.checkpoint.Checkpointer(root, process_group={group}, pipeline=True) "
                   "(one root, restorable at another pipeline split)")
    return out


def _tensor_parallel_lines(loss_parallel: bool, tp_style: str, model: dict) -> list:
    """The recipe's tensor parallelism, its loss and its activations, in the style they were counted for
    (Note [what a column-parallel layer keeps] in tp_style.py)."""
    latent, moe = model.get("kv_lora_rank") is not None, model.get("experts") is not None
    if tp_style == "megatron":
        return ["  tensor parallelism: Megatron-LM's layers within a node over mesh[\"tp\"] with "
                "sequence_parallel=True: ColumnParallelLinear q/k/v" + (" (latent attention's up-projections)"
                                                                         if latent else "")
                + ", MLP up and output layer, RowParallelLinear attention output and MLP down, "
                "VocabParallelEmbedding, norms on the sequence shard"
                + ("; the routers on the sequence shard, the experts split by their MLP width (expert tensor "
                   "parallelism)" if moe else ""),
                "  loss: " + ("vocabulary-parallel, the logits split by tp (Megatron's vocab_parallel_cross_entropy)"
                              if loss_parallel else
                              "on whole logits (--no-loss-parallel): the output layer gathers them, whole fp32 logits "
                              "on each tp rank"),
                "  activations: counted as Megatron-LM keeps them (a column-parallel layer saves its input's "
                "sequence shard); torch's parallelize_module (torchtitan's plans) keeps more a rank: "
                "--tp-style torchtitan counts it"]
    ups = f"latent attention's up-projections ({'wq_b' if model.get('q_lora_rank') else 'wq'}, wkv_b)"
    plan = ("ColwiseParallel " + (ups if latent else "q/k/v")
            + ", MLP up and output layer, RowwiseParallel attention output, MLP down and embedding, SequenceParallel "
            "norms" + (", NoParallel latent attention's down-projections and their norms on the gathered input"
                       if latent else ""))
    if moe:
        plan += ("; each MoE module's input all-gathered and its output reduce-scattered (PrepareModuleInputOutput), "
                 "NoParallel router on the gathered tokens, the routed experts split by their MLP width "
                 "(torchtitan's TensorParallel; ExpertTensorParallel over the ep x tp ranks with --ep), the shared "
                 "expert Colwise/RowwiseParallel")
    return ["  tensor parallelism: torch's parallelize_module(block, mesh[\"tp\"], plan) within a node, before the "
            "data-parallel wrapping (a 2-D mesh); the plan counted (torchtitan's): " + plan,
            "  loss: " + ("vocabulary-parallel, the logits split by tp (torchtitan's loss_parallel(), the output layer "
                          "ColwiseParallel(use_local_output=False))" if loss_parallel else
                          "on whole logits (--no-loss-parallel): the output layer ColwiseParallel("
                          "output_layouts=Replicate()), whole fp32 logits on each tp rank"),
            "  activations: counted as torch's ColwiseParallel keeps them (--tp-style torchtitan: q/k/v's, the MLP's "
            "and the output layer's gathered inputs whole"
            + (", latent attention's down-projections' and norms' tensors whole" if latent else "")
            + (", the router's tensors for every gathered token" if moe else "") + ")"]


def _pipeline_lines(pipe) -> list:
    """The suggested pipeline's schedule: what the first rank holds, the bubble, the sends."""
    if not pipe:
        return []
    chunks = "chunks (a micro-batch on one of its stages)" if pipe["schedule"] == "interleaved" else "micro-batches"
    message = f" of {_gb(pipe['p2p_message_bytes'])} GB" if pipe["p2p_message_bytes"] is not None else ""
    return [f"  schedule: {pipe['schedule']}, {pipe['stages']} stages ({pipe['virtual_stages']} a rank), "
            f"{pipe['micro_batches']} micro-batches a step; the first rank holds {pipe['first_rank_in_flight']} "
            f"{chunks}; bubble {pipe['bubble_ratio']:.1%} of the compute ({pipe['bubble_fraction']:.1%} of the step, "
            f"not in the step times above); {pipe['p2p_sends_per_step']} sends a step{message} "
            f"({pipe['p2p_sends_more_than_1f1b']} more than 1F1B's)"]


def format_plan(plan: dict) -> str:
    i, a = plan["inputs"], plan["inputs"]["assumptions"]
    g = i["gpu"]
    s = plan["suggestion"]
    # The job as asked, which the tables are for; a suggested layout with fewer data-parallel
    # ranks has its own batch and accumulation, given with the suggestion.
    job_accum, job_batch = grad_accum(i["global_batch"], i["micro_batch"], i["gpus"])
    out = [
        model_line(plan),
        (f"job: {i['gpus']} GPUs ({i['gpus_per_node']} per node), micro-batch {i['micro_batch']}, "
         f"seq {i['seq']}{' (the model maximum: --seq sets the training length)' if i.get('seq_from_config') else ''}"
         f", global batch {job_batch} (gradient accumulation {job_accum}), "
         f"{i['precision']}, recompute {i['recompute']}, {i['optimizer']}"
         + (f", expert parallelism {i['ep']}" if i.get("ep", 1) > 1 else "")),
        (f"GPU: {g['name']}, {g['memory_gb']:g} GB ({g['hbm_gbps']:g} GB/s), peak {a['peak_flops'] / 1e12:g} TFLOPS "
         f"({a['peak_flops_kind']}), MFU {a['mfu']:g} (assumed), NVLink {g['intra_node_gbps']:g} GB/s, "
         f"network {g['inter_node_gbps']:g} GB/s, PCIe {g['pcie_gbps']:g} GB/s (per GPU, per direction); "
         f"host memory {g['host_memory_gb']:g} GB at {g['host_memory_gbps']:g} GB/s a node"),
        f"compute: {a['flops_per_token']:.4g} FLOPs per token = {a['flops']}",
        (f"model states: {i['convention']} convention; K = {a['K']['ddp']} (ddp), {a['K']['zero1']} (ZeRO)"
         + (f", {a['K']['zero2_offload']} (zero2_offload: FP32 masters on the host)"
            if a['K']['zero2_offload'] != a['K']['zero1'] else "")
         + f"; temp includes {a['scratch_bytes'] / GB:g} GB scratch"),
        f"GPU memory: {a['gpu_memory']}",
        f"activations: {a['activations']}",
        f"temp: {a['temp']}",
        "",
        "memory per GPU, GB (10^9 bytes); host: per GPU, the node's ranks share its host memory",
        f"{'strategy':<15}{'states':>9}{'activ.':>9}{'temp':>8}{'total':>9}{'host':>8}  fits (headroom)",
    ]
    for st in STRATEGIES:
        e = plan["memory"][st]
        fits = "yes" if e["fits"] else "NO"
        host = ""
        if not e["host_fits"]:  # Note [host memory fits too] in plan.py
            host = (f"; host {_gb(e['host_node_bytes'])} a node, {-e['host_headroom_bytes'] / GB:.2f} over its "
                    f"{g['host_memory_gb']:g}")
        out.append(f"{st:<15} {_gb(e['model_states_bytes']):>8} {_gb(e['activation_bytes']):>8}"
                   f" {_gb(e['temp_bytes']):>7} {_gb(e['total_bytes']):>8} {_gb(e['host_bytes']):>7}  "
                   f"{fits} ({e['headroom_bytes'] / GB:+.2f}{host})"
                   + ("" if e.get("runs", True) else f"; not with {i['optimizer']}: fusedist offloads Adam only"))
    out += ["", f"communication and time per step ({a['tokens_per_step']:,} tokens)",
            f"{'strategy':<15}{'comm GB':>9}{'comm':>10}{'compute':>10}{'step':>10}{'no overlap':>12}{'tokens/s':>11}"]
    for st in STRATEGIES:
        c, t = plan["comm"][st], plan["time"][st]
        comm_s = c["seconds"] + c["pcie_seconds"]
        out.append(f"{st:<15} {_gb(c['bytes_per_step']):>8} {_seconds(comm_s):>9} {_seconds(t['compute_s']):>9}"
                   f" {_seconds(t['step_s']):>9} {_seconds(t['step_s_no_overlap']):>11} {t['tokens_per_s']:>10,.0f}")
    out.append(f"(communication at {plan['comm']['ddp']['bandwidth_gbps']:g} GB/s, the ring's slowest link; "
               "offload rows add the PCIe copies to it and the host optimizer update to the step: "
               + ", ".join(f"{st} {_seconds(plan['time'][st]['host_update_s'])}" for st in STRATEGIES
                           if st.endswith("_offload"))
               + f" at {g['host_memory_gbps']:g} GB/s of host memory a node)")
    out += _expert_lines(plan)
    out.append("")
    lay = s["layout"]
    if s["strategy"] is None and "layers" not in i["model"]:
        out.append("suggestion: nothing fits; no (dp, tp, pp) layout was searched, which needs the model's "
                   "shape (give it, or --hf-config, instead of --params), or more GPUs")
    elif s["strategy"] is None:
        dims = "dp, tp, pp, ep" if i["model"].get("experts") is not None else "dp, tp, pp"
        out.append(f"suggestion: nothing fits, and no ({dims}) layout on these GPUs does: more GPUs, "
                   "a smaller micro-batch, a shorter --seq or recomputation")
    elif lay and (lay["tp"] > 1 or lay["pp"] > 1):
        out.append(f"suggestion: no data-parallel strategy fits; dp={lay['dp']} x tp={lay['tp']} x pp={lay['pp']} "
                   + (f"(ep={lay['ep']}) " if lay.get("ep", 1) > 1 else "")
                   + f"with {lay['strategy']} does ({_gb(lay['total_bytes'])} GB per GPU; tp within a node)")
        out += recipe(lay, i.get("loss_parallel", True), i.get("tp_style", "megatron"), i["model"])
        out += _pipeline_lines(lay.get("pipeline"))
    elif lay and lay.get("ep", 1) != i.get("ep", 1):
        out.append(f"suggestion: no data-parallel strategy fits at ep={i.get('ep', 1)}; {lay['strategy']} with the "
                   f"experts over ep={lay['ep']} of the {lay['dp']} GPUs does ({_gb(lay['total_bytes'])} GB per GPU)")
    else:
        out.append(f"suggestion: {s['strategy']} (the fitting strategy with the shortest step)")
    for pp, why in s.get("layouts_refused", {}).items():
        out.append(f"  not suggested, {pp}: {why}")
    at_dp = f" at the suggested dp={lay['dp']}" if lay and lay["dp"] != i["gpus"] else ""
    out.append(f"gradient accumulation{at_dp}: {s['grad_accum_steps']} step(s) for a global batch of "
               f"{s['global_batch']}"
               + (f" (asked {i['global_batch']}, rounded up)" if i["global_batch"] not in (None, s["global_batch"])
                  else ""))
    if s["lr"]:
        lr = s["lr"]
        out.append(f"learning rate from {lr['ref_lr']:g} at batch {lr['ref_batch']}: linear {lr['linear']:.3g}, "
                   f"square root {lr['sqrt']:.3g} ({lr['note']})")
    return "\n".join(out)
