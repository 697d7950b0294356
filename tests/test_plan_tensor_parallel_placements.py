"""What one tensor-parallel rank holds, against torch's tensor parallelism: the measured model's
modules parallelized with ``parallelize_module`` on a CPU DeviceMesh of two ranks, in this one
process (torch's in-process "fake" process group: the collectives do nothing, the placements and
the local shapes are torch's own), and their local tensors counted.

* Norms under sequence parallelism (``SequenceParallel``, as Megatron-LM and torchtitan run them):
  each rank normalises ``1/t`` of the rows, its weight replicated, so Gemma's fp32 ``1 + weight``
  is whole on every rank (Note [what a norm keeps] in fusedist/plan/norm_bytes.py).
* Parameters under torchtitan's plans: each tensor's elements on a rank, and which are whole (Note
  [what tensor parallelism splits] in fusedist/plan/param_tensors.py).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from fusedist.plan import ModelSpec, activation_bytes
from fusedist.plan.model import recomputed_layer_bytes
from fusedist.plan.pipeline import pipeline_activation_bytes, stage_activation_bytes
from fusedist.plan.torch_model import Transformer

TP = 2
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _saved_on_rank(module, x, width: int) -> tuple:
    """This rank's bytes of the distinct storages autograd saves through ``module(x)``, parameters
    left out: those of the rows, and those shaped as the weight (Gemma's fp32 ``1 + weight``)."""
    params = {_local(p).untyped_storage().data_ptr() for p in module.parameters()}
    seen = {}

    def pack(t):
        local = _local(t)
        st = local.untyped_storage()
        if st.data_ptr() not in params and st.nbytes():
            seen[st.data_ptr()] = (st.nbytes(), tuple(local.shape) == (width,))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _local(module(x)).float().sum()
    rows = sum(n for n, weight_shaped in seen.values() if not weight_shaped)
    return rows, sum(n for n, weight_shaped in seen.values() if weight_shaped)


def _norms_on_rank(spec: ModelSpec, mesh, dtype, b: int, s: int) -> tuple:
    """Rows and weight-shaped bytes one rank's norms save for one micro-batch: every block's norms and
    the final one, parallelized as Megatron-LM and torchtitan do (SequenceParallel over the sequence,
    the q/k norms over the heads their rank holds), their inputs this rank's shards."""
    model = Transformer(spec).to(dtype)
    blocks = rows = weight = 0
    for block in model.blocks:
        wide = [block.norm1, block.norm2] + ([block.post1, block.post2] if spec.sandwich_norm else [])
        per_head = [(block.q_norm, spec.heads), (block.k_norm, spec.kv)] if spec.qk_norm else []
        for norm in wide:
            parallelize_module(norm, mesh, SequenceParallel())
            x = torch.randn(b, s // TP, spec.hidden, dtype=dtype, requires_grad=True)
            r, w = _saved_on_rank(norm, x, spec.hidden)
            rows, weight = rows + r, weight + w
        for norm, heads in per_head:
            parallelize_module(norm, mesh, SequenceParallel(sequence_dim=2))
            x = torch.randn(b, s, heads // TP, spec.head_size, dtype=dtype, requires_grad=True)
            r, w = _saved_on_rank(norm, x, spec.head_size)
            rows, weight = rows + r, weight + w
        blocks += 1
    parallelize_module(model.norm, mesh, SequenceParallel())
    final = _saved_on_rank(model.norm, torch.randn(b, s // TP, spec.hidden, dtype=dtype, requires_grad=True),
                           spec.hidden)
    return (rows, weight), final


@DTYPES
def test_gemma_norms_keep_a_whole_one_plus_weight_on_every_tensor_parallel_rank(tp_mesh, dtype):
    """A rank's share of the activations differs between Gemma's norms and Llama's by the rows it
    normalises (1/t of them) and, whole, each norm's fp32 ``1 + weight``: the planner divided that
    by t too (at t = 2, half of it missing from each rank's figure)."""
    torch.manual_seed(0)
    b, s = 2, 8
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    shape = dict(arch="llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=48, seq=s, vocab=16,
                 head_dim=16, qk_norm=True, sandwich_norm=True)
    gemma, llama = ModelSpec(**shape, gemma_norm=True), ModelSpec(**shape)
    (g_rows, g_weight), (g_final_rows, g_final_weight) = _norms_on_rank(gemma, tp_mesh, dtype, b, s)
    (l_rows, l_weight), (l_final_rows, l_final_weight) = _norms_on_rank(llama, tp_mesh, dtype, b, s)
    assert l_weight == l_final_weight == 0
    # the fp32 1 + weight of each of a block's four norms and two q/k norms, whole on the rank
    assert g_weight == 4 * (4 * 32 + 2 * 16) * gemma.layers and g_final_weight == 4 * 32
    rows_more = g_rows + g_final_rows - l_rows - l_final_rows  # the rank's normalised rows, fp32 for Gemma's
    measured = rows_more + g_weight + g_final_weight
    for recompute in ("none", "selective"):
        assert (activation_bytes(gemma, b, s, precision, recompute, tp=TP)
                - activation_bytes(llama, b, s, precision, recompute, tp=TP)) == measured, recompute
    # full recomputation stores each block's input alone, then reruns one block, which holds its norms' tensors
    one_block = (g_rows - l_rows + g_weight) // gemma.layers
    assert (recomputed_layer_bytes(gemma, b, s, precision, "full", tp=TP)
            - recomputed_layer_bytes(llama, b, s, precision, "full", tp=TP)) == one_block
    # a pipeline of two stages, one block each, under 1F1B over two micro-batches: the first stage holds both
    # micro-batches' block, the last one its block and the final norm
    stages = [stage_activation_bytes(spec, b, s, precision, "none", TP, 2, 2, "1f1b", stage)
              for stage in (0, 1) for spec in (gemma, llama)]
    assert stages[0] - stages[1] == 2 * one_block
    assert stages[2] - stages[3] == one_block + g_final_rows - l_final_rows + g_final_weight


def _tp_plan(model, mesh) -> None:
    """torchtitan's plans (Llama, DeepSeek-V3, its MoE) on the measured model: the embedding by vocabulary
    rows, q/k/v, MLP-up, latent up-projections and the output layer by columns, the attention output and
    MLP-down by rows, norms SequenceParallel; latent attention's down-projections and norms, the router, the
    shared-expert gate and GPT's position embedding left whole; the stacked experts split by their MLP width
    (torchtitan's TensorParallel on grouped experts). The fused q/k/v and gate-and-up matrices are split as
    whole blocks of columns, not per head as a trained model needs: the same bytes a rank."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"wte": RowwiseParallel(), "norm": SequenceParallel()}
    if model.head is not None:
        plan["head"] = ColwiseParallel()
    for i, block in enumerate(model.blocks):
        at = f"blocks.{i}."
        plan.update({at + "norm1": SequenceParallel(), at + "proj": RowwiseParallel()})
        plan.update({at + name: SequenceParallel() for name in ("norm2", "post1", "post2")
                     if isinstance(getattr(block, name), (torch.nn.LayerNorm, type(block.norm1)))})
        plan.update({at + name: SequenceParallel(sequence_dim=2) for name in ("q_norm", "k_norm")
                     if not isinstance(getattr(block, name), torch.nn.Identity)})
        if block.latent is None:
            plan[at + "qkv"] = ColwiseParallel()
        else:
            plan[at + ("latent.q.2" if isinstance(block.latent.q, torch.nn.Sequential) else "latent.q")] = \
                ColwiseParallel()
            plan[at + "latent.kv_b"] = ColwiseParallel()
        if block.experts is None:
            plan.update({at + "fc": ColwiseParallel(), at + "out": RowwiseParallel()})
        else:
            experts = block.experts
            if experts.shared is not None:
                plan.update({at + "experts.shared.fc": ColwiseParallel(), at + "experts.shared.out": RowwiseParallel()})
            experts.w_in = torch.nn.Parameter(distribute_tensor(experts.w_in.data, mesh, [Shard(1)]))
            experts.w_out = torch.nn.Parameter(distribute_tensor(experts.w_out.data, mesh, [Shard(0)]))
    parallelize_module(model, mesh, plan)


_SPECS = {
    "gpt": dict(arch="gpt", layers=2, hidden=32, heads=4, seq=8, vocab=16),
    "llama_biases_qk_and_sandwich_norms": dict(arch="llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=48,
                                               seq=8, vocab=16, head_dim=16, qkv_bias=True, out_bias=True,
                                               mlp_bias=True, qk_norm=True, sandwich_norm=True, gemma_norm=True),
    "falcon_shared_norm": dict(arch="falcon", layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, seq=8,
                               vocab=16, parallel_attn=True, shared_norm=True, qkv_bias=True, out_bias=True,
                               mlp_bias=True, tied=True),
    "latent_attention_and_experts": dict(arch="llama", layers=2, hidden=32, heads=4, ffn_hidden=48, seq=8, vocab=16,
                                         head_dim=12, kv_lora_rank=16, q_lora_rank=24, rope_head_dim=4,
                                         v_head_dim=8, qkv_bias=True, experts=4, experts_per_token=2,
                                         expert_ffn=8, shared_ffn=8, shared_gate=True, dense_layers=1),
    "latent_attention_full_q": dict(arch="llama", layers=1, hidden=32, heads=4, ffn_hidden=48, seq=8, vocab=16,
                                    head_dim=12, kv_lora_rank=16, rope_head_dim=4, v_head_dim=8),
}


@pytest.mark.parametrize("name", list(_SPECS))
def test_a_tensor_parallel_rank_holds_the_parameters_the_planner_counts(tp_mesh, name):
    """Each parameter's elements on a rank of torch's tensor-parallel model, in registration order, and
    which are whole: norms, row-split biases, GPT's position embedding, latent attention's down-projections
    and the router were counted as split (the planner put Ψ / t on a rank)."""
    from fusedist.plan import count_params
    from fusedist.plan.param_tensors import Whole, on_tp_rank, param_tensors
    from fusedist.plan.hardware import PRESETS
    from fusedist.plan.plan import Job, _memory_entry, _root_params, _tp_params, _zero3_units

    spec = ModelSpec(**_SPECS[name])
    model = Transformer(spec)
    _tp_plan(model, tp_mesh)
    local = [(_local(p).numel(), not isinstance(p, DTensor) or all(pl.is_replicate() for pl in p.placements))
             for p in model.parameters()]
    planned = [(on_tp_rank(t, TP), isinstance(t, Whole)) for t in param_tensors(spec)]
    assert local == planned
    assert _tp_params(spec, count_params(spec), TP) == sum(n for n, _ in local)
    # ZeRO-3's units, a block each, as a rank gathers them
    blocks = [sum(_local(p).numel() for p in block.parameters()) for block in model.blocks]
    assert _zero3_units(spec, TP, 1, 1)[0] == blocks
    assert _root_params(spec, TP) == sum(n for n, _ in local) - sum(blocks)  # the embeddings, final norm, head
    # the plan's model states a rank: the ZeRO paper's 16 bytes a parameter of DDP with mixed-precision Adam
    job = Job(gpus=TP, micro_batch=1, seq=spec.seq, convention="paper")
    entry = _memory_entry(spec, count_params(spec), job, PRESETS["h100"], "ddp", 1, tp=TP)
    assert entry["model_states_bytes"] == 16 * sum(n for n, _ in local)


def _routed_on_tp_rank(experts, t: torch.Tensor, mesh) -> torch.Tensor:
    """Rank 0's routed experts under tensor and sequence parallelism as Megatron-Core runs them
    (Note [routed tokens under tensor parallelism]): the router on this rank's ``1/TP`` of the tokens
    ``t``, the dispatch an all-gather of the group's tokens and their routing, each expert's SwiGLU
    split by its width (gate and up columns, down rows: expert tensor parallelism), the weighted
    outputs combined on the gathered tokens and reduce-scattered back to this rank's shard."""
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F

    e, h, f = experts.shape
    k, width = experts.top_k, f // TP
    probs = F.softmax(experts.router(t), dim=-1, dtype=torch.float32)
    top, idx = probs.topk(k, dim=-1)
    weights = (top / top.sum(-1, keepdim=True)).to(t.dtype)
    tokens = funcol.all_gather_single_autograd(t, 0, mesh).wait()
    weights = funcol.all_gather_single_autograd(weights, 0, mesh).wait()
    pairs = funcol.all_gather_single(idx, 0, mesh).wait().flatten()
    order = pairs.argsort(stable=True)
    token_of = order // k
    rows = tokens[token_of]
    counts = torch.bincount(pairs, minlength=e).tolist()
    w_in, w_out = experts.w_in.view(e, h, 2 * f), experts.w_out.view(e, f, h)
    outs = []
    for i, chunk in enumerate(rows.split(counts)):
        gate, up = chunk @ w_in[i][:, :width], chunk @ w_in[i][:, f:f + width]
        outs.append((F.silu(gate) * up) @ w_out[i][:width])
    weighted = torch.cat(outs) * weights.flatten()[order].unsqueeze(-1)
    combined = torch.zeros_like(tokens).scatter_add(0, token_of.unsqueeze(-1).expand(-1, h), weighted)
    return funcol.reduce_scatter_single_autograd(combined, "sum", 0, mesh).wait()


_ROUTED = {"mixtral": dict(experts=8, experts_per_token=2, expert_ffn=24),
           "three_of_six": dict(experts=6, experts_per_token=3, expert_ffn=12)}


@DTYPES
@pytest.mark.parametrize("name", list(_ROUTED))
def test_a_tensor_parallel_rank_keeps_its_gathered_token_expert_pairs_whole(tp_mesh, name, dtype):
    """What an MoE block saves on one rank: the router's tensors for ``1/t`` of the tokens, but each
    gathered token-expert pair's copy, expert output, weight and sort indices whole; only the SwiGLU's
    tensors are split. The planner divided all of it by t (Mixtral-8x7B at t = 8, s = 4096: 3.8 GB of
    a rank's activations missing)."""
    from fusedist.plan.measure import saved_storage_bytes
    from fusedist.plan.torch_model import Experts

    torch.manual_seed(0)
    b, s = 2, 8
    spec = ModelSpec(arch="llama", layers=1, hidden=16, heads=2, seq=s, vocab=10, **_ROUTED[name])
    experts = Experts(spec).to(dtype)
    x = torch.randn(b * s, spec.hidden, dtype=dtype)
    shard = x[: b * s // TP].clone().requires_grad_()
    whole_run = saved_storage_bytes(experts, lambda: experts(x.clone().requires_grad_()).float().sum().backward())
    on_rank = saved_storage_bytes(experts, lambda: _routed_on_tp_rank(experts, shard, tp_mesh).float().sum().backward())
    # split bytes halve at TP = 2, so what a rank keeps whole is twice its share less the unsplit run's
    measured_whole = TP * on_rank - whole_run
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    for recompute in ("none", "selective"):
        one = activation_bytes(spec, b, s, precision, recompute)
        split = activation_bytes(spec, b, s, precision, recompute, tp=TP)
        assert TP * split - one == measured_whole > 0, recompute
        assert pipeline_activation_bytes(spec, b, s, precision, recompute, tp=TP) == split  # a job's figure
    word, k, h = x.element_size(), spec.experts_per_token, spec.hidden
    assert measured_whole == b * s * k * (word * (2 * h + 1) + 16)  # the Note's k (2h + 1) elements and 16 k bytes


def _loss_path_on_rank(mesh, dtype, vocab_parallel: bool, b: int, s: int, h: int, v: int) -> int:
    """Bytes rank 0 saves through the output layer, Gemma-2's soft-cap and the loss, the layer
    ``ColwiseParallel``: logits left split for torch's vocabulary-parallel ``loss_parallel()``, or
    gathered (``output_layouts=Replicate()``) for a plain cross-entropy."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel

    head = torch.nn.Linear(h, v, bias=False).to(dtype)
    layer = ColwiseParallel(use_local_output=False) if vocab_parallel else ColwiseParallel(output_layouts=Replicate())
    parallelize_module(head, mesh, layer)
    x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, v, (b * s,))

    def step():
        logits = 30.0 * torch.tanh(head(x) / 30.0)
        flat = logits.float().flatten(0, 1)
        if vocab_parallel:
            with loss_parallel():
                F.cross_entropy(flat, targets).backward()
        else:
            F.cross_entropy(flat, targets).backward()
    params = {_local(p).untyped_storage().data_ptr() for p in head.parameters()}
    seen = {}

    def pack(t):
        st = _local(t).untyped_storage()
        if st.data_ptr() not in params and st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


@DTYPES
def test_without_a_vocabulary_parallel_loss_a_rank_keeps_whole_logits(tp_mesh, dtype, capsys):
    """torch's loss on gathered logits keeps the whole fp32 logits' log-softmax (and the soft-cap's
    tanh) on each rank, ``loss_parallel()`` its 1/t: --no-loss-parallel counts the former, the
    default the latter (the planner counted only the split logits)."""
    from fusedist.plan import cli
    from fusedist.plan.hardware import PRESETS
    from fusedist.plan.plan import Job, _memory_entry

    torch.manual_seed(0)
    b, s, h, v = 2, 8, 32, 16
    split = _loss_path_on_rank(tp_mesh, dtype, True, b, s, h, v)
    whole = _loss_path_on_rank(tp_mesh, dtype, False, b, s, h, v)
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    spec = ModelSpec(arch="llama", layers=2, hidden=h, heads=4, kv_heads=2, ffn_hidden=48, seq=s, vocab=v,
                     final_softcap=30.0)
    for recompute in ("none", "full"):
        assert (activation_bytes(spec, b, s, precision, recompute, tp=TP, loss_parallel=False)
                - activation_bytes(spec, b, s, precision, recompute, tp=TP)) == whole - split > 0
        assert (activation_bytes(spec, b, s, precision, recompute, loss_parallel=False)
                == activation_bytes(spec, b, s, precision, recompute))  # nothing to split on one rank
    # a job's figure on a tensor-parallel rank
    entries = [_memory_entry(spec, 0, Job(gpus=TP, micro_batch=b, seq=s, precision=precision, loss_parallel=lp),
                             PRESETS["h100"], "ddp", 1, tp=TP)["activation_bytes"] for lp in (False, True)]
    assert entries[0] - entries[1] == whole - split
    # a pipeline of two stages: the last one holds the logits
    for stage, more in ((0, 0), (1, whole - split)):
        held = [stage_activation_bytes(spec, b, s, precision, "none", TP, 2, 2, "1f1b", stage, loss_parallel=lp)
                for lp in (False, True)]
        assert held[0] - held[1] == more, stage
    # the option, and the plan saying which loss it counted
    shape = ["--arch", "llama", "--layers", "80", "--hidden", "8192", "--heads", "64", "--kv-heads", "8",
             "--ffn-hidden", "28672", "--vocab", "32000", "--seq", "3072", "--gpus", "64", "--recompute", "selective"]
    for flags, said in (([], "loss: vocabulary-parallel, the logits split by tp"),
                        (["--no-loss-parallel"], "loss: on whole logits (--no-loss-parallel)")):
        assert cli.main(shape + flags) == 0
        out = capsys.readouterr().out
        assert " x tp=" in out and said in out, out


class _GatherInsideLinear(torch.autograd.Function):
    """Megatron-LM's column-parallel layer under sequence parallelism, forward only (what it saves is
    what is measured): the input's sequence shard all-gathered inside the layer and the shard saved for
    the weight gradient, which Megatron's backward gathers again."""

    @staticmethod
    def forward(ctx, shard, weight, bias, mesh):
        import torch.distributed._functional_collectives as funcol
        import torch.nn.functional as F

        ctx.save_for_backward(shard, weight)
        gathered = funcol.all_gather_single(shard.transpose(0, 1).contiguous(), 0, mesh).wait().transpose(0, 1)
        return F.linear(gathered, weight, bias)


class _MegatronColumn(torch.nn.Module):
    """A ColwiseParallel layer's column-split weight run as Megatron-LM runs it (:class:`_GatherInsideLinear`)."""

    def __init__(self, linear, mesh):
        super().__init__()
        self.weight, self.bias, self.mesh = linear.weight, linear.bias, mesh

    def forward(self, x):
        bias = None if self.bias is None else _local(self.bias)
        return _GatherInsideLinear.apply(_local(x), _local(self.weight), bias, self.mesh)


def _sequence_parallel_model(spec: ModelSpec, mesh, dtype, style: str):
    """The measured model's blocks, final norm and output layer under torchtitan's Llama plan (norms
    SequenceParallel, the column-parallel layers' inputs redistributed from Shard(1) to Replicate, the
    row-parallel outputs reduce-scattered to Shard(1), the output layer vocabulary-parallel), or with its
    column-parallel layers run as Megatron-LM's (``style`` "megatron")."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model = Transformer(spec).to(dtype)
    plan = {"norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}
    for i, block in enumerate(model.blocks):
        at = f"blocks.{i}."
        plan.update({at + "norm1": SequenceParallel(), at + "norm2": SequenceParallel(),
                     at + "qkv": ColwiseParallel(input_layouts=Shard(1)),
                     at + "fc": ColwiseParallel(input_layouts=Shard(1)),
                     at + "proj": RowwiseParallel(output_layouts=Shard(1)),
                     at + "out": RowwiseParallel(output_layouts=Shard(1))})
        block.heads, block.kv, block.q_dim, block.kv_dim = (n // TP for n in (block.heads, block.kv, block.q_dim,
                                                                                block.kv_dim))  # a rank's heads
    parallelize_module(model, mesh, plan)
    if style == "megatron":
        for block in model.blocks:
            block.qkv, block.fc = _MegatronColumn(block.qkv, mesh), _MegatronColumn(block.fc, mesh)
        model.head = _MegatronColumn(model.head, mesh)
    return model


def _saved_through(model, run) -> int:
    """Rank 0's bytes of the distinct storages autograd saves while ``run()`` runs, parameters left out."""
    import torch.distributed._functional_collectives as funcol

    params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        local = _local(t)
        if isinstance(local, funcol.AsyncCollectiveTensor):
            local = local.wait()
        st = local.untyped_storage()
        if st.data_ptr() not in params and st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def _blocks_and_output_on_rank(spec: ModelSpec, mesh, dtype, style: str, b: int, s: int) -> tuple:
    """Bytes rank 0 saves through the blocks, and through the final norm and output layer, from its
    ``1/TP`` of the sequence."""
    model = _sequence_parallel_model(spec, mesh, dtype, style)
    x = torch.randn(b, s // TP, spec.hidden, dtype=dtype, requires_grad=True)
    out = {}

    def blocks():
        y = x
        for block in model.blocks:
            y = block(y)
        out["y"] = y.detach().requires_grad_()
        y.float().sum()
    blocks_bytes = _saved_through(model, blocks)
    return blocks_bytes, _saved_through(model, lambda: _local(model.head(model.norm(out["y"]))).float().sum())


_STYLED = {"llama_biases": dict(arch="llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=48, seq=8, vocab=16,
                                qkv_bias=True, out_bias=True, mlp_bias=True),
           "gpt_untied": dict(arch="gpt", layers=2, hidden=32, heads=4, seq=8, vocab=16, tied=False)}


@DTYPES
@pytest.mark.parametrize("name", list(_STYLED))
def test_torchtitan_s_column_parallel_layers_keep_their_gathered_inputs(tp_mesh, name, dtype):
    """torch's ColwiseParallel on a sequence-sharded input saves the all-gathered input for the weight
    gradient, Megatron-LM's layer the shard: under --tp-style torchtitan a rank keeps q/k/v's, the MLP's and
    the output layer's inputs whole (the planner counted Megatron's 1/t for torchtitan's plans too)."""
    from fusedist.plan.hardware import PRESETS
    from fusedist.plan.plan import Job, _memory_entry

    torch.manual_seed(0)
    b, s = 2, 8
    spec = ModelSpec(**_STYLED[name])
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    (tt_blocks, tt_out), (mg_blocks, mg_out) = (_blocks_and_output_on_rank(spec, tp_mesh, dtype, style, b, s)
                                                for style in ("torchtitan", "megatron"))
    one_block, output = (tt_blocks - mg_blocks) // spec.layers, tt_out - mg_out
    assert one_block * spec.layers == tt_blocks - mg_blocks
    word = 2 if dtype == torch.bfloat16 else 4
    assert (one_block, output) == (2 * word * b * s * 32 // TP, word * b * s * 32 // TP)  # the Note's (t - 1)/t

    def figures(style):
        return {r: activation_bytes(spec, b, s, precision, r, tp=TP, tp_style=style)
                for r in ("none", "selective", "full")}
    tt, mg = figures("torchtitan"), figures("megatron")
    for recompute in ("none", "selective"):
        assert tt[recompute] - mg[recompute] == spec.layers * one_block + output, recompute
    # full recomputation stores each block's input shard; the block it recomputes keeps its gathered inputs
    assert tt["full"] - mg["full"] == one_block + output
    assert (recomputed_layer_bytes(spec, b, s, precision, "full", TP, "torchtitan")
            - recomputed_layer_bytes(spec, b, s, precision, "full", TP)) == one_block
    # a pipeline of two stages, one block each, 1F1B over two micro-batches: the first holds two micro-batches' block
    held = [[stage_activation_bytes(spec, b, s, precision, "none", TP, 2, 2, "1f1b", stage, tp_style=style)
             for style in ("torchtitan", "megatron")] for stage in (0, 1)]
    assert [t - m for t, m in held] == [2 * one_block, one_block + output]
    # a job's figure, and nothing to gather on one rank
    entries = [_memory_entry(spec, 0, Job(gpus=TP, micro_batch=b, seq=s, precision=precision, tp_style=style),
                             PRESETS["h100"], "ddp", 1, tp=TP)["activation_bytes"]
               for style in ("torchtitan", "megatron")]
    assert entries[0] - entries[1] == spec.layers * one_block + output
    assert (activation_bytes(spec, b, s, precision, "none", tp_style="torchtitan")
            == activation_bytes(spec, b, s, precision, "none"))


def test_the_tp_style_option_says_what_it_counts_and_the_recipe_follows_it(capsys, tmp_path):
    """--tp-style shows in the plan's assumptions and recipe: Megatron-LM's layers for the default figure
    (the recipe named torch's parallelize_module for Megatron's figure), torch's parallelize_module with
    torchtitan's plans for --tp-style torchtitan, with latent attention's and a mixture's placements
    (Note [what a column-parallel layer keeps] in fusedist/plan/tp_style.py)."""
    import dataclasses
    import json

    from fusedist.plan import Job, build_plan, cli
    from fusedist.plan.hardware import PRESETS

    shape = ["--arch", "llama", "--layers", "80", "--hidden", "8192", "--heads", "64", "--kv-heads", "8",
             "--ffn-hidden", "28672", "--vocab", "32000", "--seq", "3072", "--gpus", "64", "--recompute", "selective"]
    for flags, said, recipe, not_said in (
            ([], "counted as Megatron-LM keeps them", "Megatron-LM's layers within a node", "parallelize_module("),
            (["--tp-style", "torchtitan"], "counted as torch's ColwiseParallel keeps them",
             "parallelize_module(block, mesh[\"tp\"], plan)", "Megatron-LM's layers")):
        assert cli.main(shape + flags) == 0
        out = capsys.readouterr().out
        assert " x tp=" in out and said in out and recipe in out and not_said not in out, out
    # a DeepSeek-V3-shaped model (latent attention, routed and shared experts) under torchtitan's plans
    deepseek = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
                "moe_intermediate_size": 2048, "num_attention_heads": 128, "num_hidden_layers": 61,
                "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
                "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                "v_head_dim": 128, "max_position_embeddings": 4096, "vocab_size": 129280}
    config = tmp_path / "config.json"
    config.write_text(json.dumps(deepseek))
    args = ["--hf-config", str(config), "--seq", "16384", "--gpus", "512", "--gpus-per-node", "8", "--ep", "8",
            "--recompute", "full", "--tp-style", "torchtitan"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert " x tp=8 " in out and "NoParallel router on the gathered tokens" in out, out
    assert "NoParallel latent attention's down-projections" in out and "ExpertTensorParallel" in out, out
    assert "latent attention's down-projections and norms run replicated" in out, out
    job = Job(gpus=8, micro_batch=1, seq=8, tp_style="torchtitan")
    for name in ("latent_attention_and_experts", "latent_attention_full_q"):  # counted now, no refusal
        spec = ModelSpec(**_SPECS[name])
        if spec.shared_gate:
            spec = dataclasses.replace(spec, shared_gate=False)
        build_plan(spec, job, PRESETS["h100"])
