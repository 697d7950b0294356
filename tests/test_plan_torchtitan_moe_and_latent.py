"""``--tp-style torchtitan`` for latent attention and mixtures of experts, against the tensors torch's
tensor parallelism saves: a block of the measured model parallelized as torchtitan's DeepSeek-V3 and
Llama-4 plans place it (Note [what a column-parallel layer keeps] in fusedist/plan/tp_style.py) on a
CPU DeviceMesh of two ranks in this one process (torch's "fake" process group: the collectives do
nothing, the placements and local shapes are torch's own), and the bytes of what autograd saves on
rank 0 counted. Split tensors halve at two ranks, so what a rank keeps whole is twice its share less
what the unsplit block saves: that is what the planner must count whole.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

from fusedist.plan import ModelSpec, activation_bytes
from fusedist.plan.model import block_whole_bytes
from fusedist.plan.torch_model import Transformer
from test_plan_tensor_parallel_placements import _local, _saved_through

TP = 2
B, S = 2, 8


def _saved_bytes(module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves through ``module(x)`` on this rank, parameters left out."""
    return _saved_through(module, lambda: _local(module(x)).float().sum())


class _ExpertsByWidth(torch.nn.Module):
    """torchtitan's MoE under tensor parallelism on rank 0 (``apply_moe_ep_tp``), inside the module's
    ``PrepareModuleInputOutput`` (the input all-gathered, the partial output reduce-scattered): the router
    replicated (``NoParallel``) on every gathered token, each routed expert's SwiGLU split by its width
    (``TensorParallel``: gate and up columns, down rows), the shared expert column-/row-parallel."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts = self.experts
        e, h, f = experts.shape
        t = x.reshape(-1, h)
        probs = F.softmax(experts.router(t), dim=-1, dtype=torch.float32)
        top, idx = probs.topk(experts.top_k, dim=-1)
        weights = (top / top.sum(-1, keepdim=True)).to(t.dtype)
        pairs = idx.flatten()
        order = pairs.argsort(stable=True)
        token_of = order // experts.top_k
        rows = t[token_of]
        width = f // TP
        w_in, w_out = experts.w_in.view(e, h, 2 * f), experts.w_out.view(e, f, h)
        outs = []
        for i, chunk in enumerate(rows.split(torch.bincount(pairs, minlength=e).tolist())):
            gate, up = chunk @ w_in[i][:, :width], chunk @ w_in[i][:, f:f + width]
            outs.append((F.silu(gate) * up) @ w_out[i][:width])
        weighted = torch.cat(outs) * weights.flatten()[order].unsqueeze(-1)
        y = torch.zeros_like(t).scatter_add(0, token_of.unsqueeze(-1).expand(-1, h), weighted)
        if experts.shared is not None:
            fc, out = experts.shared["fc"].weight, experts.shared["out"].weight
            sf = fc.shape[0] // 2
            part = sf // TP
            gate, up = F.linear(t, fc[:part]), F.linear(t, fc[sf:sf + part])
            y = y + F.linear(F.silu(gate) * up, out[:, :part])
        return y.view_as(x)


def _torchtitan_block(spec: ModelSpec, mesh, dtype):
    """Block 0 of the measured model under torchtitan's plans: norms SequenceParallel; latent attention's
    input made Replicate before the module, its down-projections and norms plain (NoParallel), its
    up-projections ColwiseParallel; q/k/v and the dense MLP's up ColwiseParallel from Shard(1); the
    attention output and MLP down RowwiseParallel to Shard(1); a mixture as :class:`_ExpertsByWidth`."""
    block = Transformer(spec).to(dtype).blocks[0]
    plan = {"norm1": SequenceParallel(), "norm2": SequenceParallel(), "proj": RowwiseParallel(output_layouts=Shard(1))}
    if block.latent is None:
        plan["qkv"] = ColwiseParallel(input_layouts=Shard(1))
        block.heads, block.kv, block.q_dim, block.kv_dim = (n // TP for n in (block.heads, block.kv, block.q_dim,
                                                                                block.kv_dim))
    else:
        plan["latent"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                            use_local_output=True)
        plan["latent.q.2" if isinstance(block.latent.q, torch.nn.Sequential) else "latent.q"] = ColwiseParallel()
        plan["latent.kv_b"] = ColwiseParallel()
        block.latent.heads //= TP
    if block.experts is None:
        plan.update({"fc": ColwiseParallel(input_layouts=Shard(1)), "out": RowwiseParallel(output_layouts=Shard(1))})
    else:
        block.experts = _ExpertsByWidth(block.experts)
        plan["experts"] = PrepareModuleInputOutput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                   use_local_input=True, output_layouts=(Partial(),),
                                                   desired_output_layouts=(Shard(1),), use_local_output=True)
    parallelize_module(block, mesh, plan)
    return block


def _whole_on_rank(spec: ModelSpec, mesh, dtype) -> int:
    """What rank 0 keeps whole of block 0: twice its saved bytes less the unsplit block's."""
    torch.manual_seed(0)
    x = torch.randn(B, S, spec.hidden, dtype=dtype)
    unsplit = _saved_bytes(Transformer(spec).to(dtype).blocks[0], x.clone().requires_grad_())
    on_rank = _saved_bytes(_torchtitan_block(spec, mesh, dtype), x[:, :S // TP].clone().requires_grad_())
    return TP * on_rank - unsplit


_LATENT = dict(arch="llama", layers=1, hidden=32, heads=4, ffn_hidden=48, seq=S, vocab=16, head_dim=12,
               kv_lora_rank=16, rope_head_dim=4, v_head_dim=8)
_BLOCKS = {  # (spec, dtypes): a dense MLP's and a mixture's blocks, queries compressed or not
    "latent_attention_experts_and_shared_expert": (dict(_LATENT, q_lora_rank=24, experts=4, experts_per_token=3,
                                                        expert_ffn=8, shared_ffn=16), ("bf16", "fp32")),
    "latent_attention_full_q": (dict(_LATENT), ("bf16",)),
}
_CASES = [pytest.param(name, dtype, id=f"{name}-{dtype}") for name, (_, dtypes) in _BLOCKS.items() for dtype in dtypes]


@pytest.mark.parametrize("name,precision", _CASES)
def test_torchtitan_s_latent_attention_and_experts_keep_what_the_planner_counts_whole(tp_mesh, name, precision):
    """Under torchtitan's plans a rank keeps whole the attention's and the MoE's gathered inputs, latent
    attention's replicated down-projections' and norms' tensors and the up-projections' inputs, and the
    router's tensors for every gathered token: the planner refused such models under --tp-style torchtitan."""
    spec = ModelSpec(**_BLOCKS[name][0])
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    measured = _whole_on_rank(spec, tp_mesh, dtype)
    counted = block_whole_bytes(spec, 0, B, S, precision, "none", "torchtitan")
    assert counted == measured > block_whole_bytes(spec, 0, B, S, precision, "none"), (counted, measured)
    # a rank's figure: whole what the block and the output layer's gathered input keep, the rest halved
    word = 2 if dtype == torch.bfloat16 else 4
    output = word * B * S * spec.hidden
    for recompute in ("none", "selective"):
        one = activation_bytes(spec, B, S, precision, recompute)
        split = activation_bytes(spec, B, S, precision, recompute, tp=TP, tp_style="torchtitan")
        assert TP * split - one == measured + output, recompute
    full = [activation_bytes(spec, B, S, precision, "full", tp=TP, tp_style=style) for style in ("torchtitan",
                                                                                                  "megatron")]
    assert full[0] - full[1] == (measured - block_whole_bytes(spec, 0, B, S, precision, "none")) // TP + output // TP


def test_a_gated_shared_expert_is_refused_under_torchtitan_naming_it():
    """Qwen2-MoE's shared-expert gate is in no torchtitan plan: refused, naming it and the option."""
    from fusedist.plan import Job, build_plan
    from fusedist.plan.errors import PlanError
    from fusedist.plan.hardware import PRESETS

    gated = ModelSpec(**_BLOCKS["latent_attention_experts_and_shared_expert"][0], shared_gate=True)
    with pytest.raises(PlanError, match="--tp-style: .*gated shared expert .*shared_expert_gate.*use --tp-style "
                                        "megatron"):
        build_plan(gated, Job(gpus=8, micro_batch=1, seq=S, tp_style="torchtitan"), PRESETS["h100"])
    build_plan(gated, Job(gpus=8, micro_batch=1, seq=S), PRESETS["h100"])
