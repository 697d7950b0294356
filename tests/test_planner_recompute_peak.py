"""The planner's activation figure under full recomputation is the peak of backward: the
stored block inputs plus the one block being recomputed, held in full beside them (Note [the
recomputed layer] in fusedist/plan/model.py). Checked byte for byte against the tensors autograd
saves for Megatron's GPT layer (Korthikanti et al. 2022, Section 4.1), built here in torch."""

import json
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fusedist.plan import ModelSpec, activation_bytes, cli
from fusedist.plan.model import recomputed_layer_bytes


def _drop(t):
    # the fused kernel's 1-byte mask, as in the paper (CPU's F.dropout keeps a 2-byte noise tensor)
    return torch.native_dropout(t, 0.1, True)[0]


class _GPTLayer(nn.Module):
    """Megatron's layer: unfused attention with dropout on the probabilities, GELU MLP of 4h."""

    def __init__(self, h, a):
        super().__init__()
        self.a, self.d = a, h // a
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.q, self.k, self.v = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.proj, self.fc, self.out = nn.Linear(h, h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def _heads(self, t):
        b, s, _ = t.shape
        return t.view(b, s, self.a, self.d).transpose(1, 2).contiguous().view(b * self.a, s, self.d)

    def forward(self, x):
        b, s, h = x.shape
        y = self.ln1(x)
        q, k, v = self._heads(self.q(y)), self._heads(self.k(y)), self._heads(self.v(y))
        p = _drop(torch.softmax(torch.bmm(q, k.transpose(1, 2)) * (1 / math.sqrt(self.d)), -1))
        o = torch.bmm(p, v).view(b, self.a, s, self.d).transpose(1, 2).reshape(b, s, h)
        x = x + _drop(self.proj(o))
        return x + _drop(self.out(F.gelu(self.fc(self.ln2(x)))))


def _peak_saved_bytes(step, params, per_token_numel):
    """Most bytes of saved-for-backward storage alive at once while ``step`` runs (each storage
    counted once; parameters and LayerNorm's per-token mean/rstd, which the paper leaves out,
    not counted). A saved tensor is alive until autograd drops its packed holder."""
    live, peak = {}, [0]

    class Held:
        def __init__(self, t):
            self.t, self.key = t, t.untyped_storage().data_ptr()
            count, size = live.get(self.key, (0, t.untyped_storage().nbytes()))
            live[self.key] = (count + 1, size)
            peak[0] = max(peak[0], sum(n for _, n in live.values()))

        def __del__(self):
            count, size = live[self.key]
            live[self.key] = (count - 1, size)
            if count == 1:
                del live[self.key]

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() in params or t.numel() == per_token_numel or not st.nbytes():
            return t
        return Held(t)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda p: p.t if isinstance(p, Held) else p):
        step()
    assert not live  # every saved tensor released: the count above saw all of them
    return peak[0]


def test_full_recompute_peak_is_checkpoints_plus_one_recomputed_layer():
    torch.manual_seed(0)
    b, s, h, a, layers = 2, 16, 32, 4, 3
    blocks = [_GPTLayer(h, a).to(torch.bfloat16) for _ in range(layers)]
    params = {p.untyped_storage().data_ptr() for m in blocks for p in m.parameters()}
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    spec = ModelSpec(layers=layers, hidden=h, heads=a, seq=s, vocab=7)
    outside = activation_bytes(spec, b, s, "bf16", "none") - layers * recomputed_layer_bytes(spec, b, s, "bf16",
                                                                                                "full")

    # one layer without recomputation: what it saves is the planner's per-layer figure, 34sbh + 5as²b
    one = _peak_saved_bytes(lambda: blocks[0](x).float().sum().backward(), params, b * s)
    assert one == recomputed_layer_bytes(spec, b, s, "bf16", "full") == s * b * h * (34 + 5 * a * s // h)

    def full():
        y = x
        for block in blocks:
            y = checkpoint(block, y, use_reentrant=True)
        y.float().sum().backward()

    peak = _peak_saved_bytes(full, params, b * s)
    stored = layers * 2 * s * b * h  # Korthikanti et al.'s 2sbhL
    planned = activation_bytes(spec, b, s, "bf16", "full") - outside
    assert planned == stored + one  # checkpoints + one layer
    # the recomputed layer re-saves its own stored input (one storage, counted once here): the
    # planner counts it twice, standing for the layer's output gradient held meanwhile
    assert peak == planned - 2 * s * b * h
    assert peak > stored + one // 2  # the stored figure alone misses most of the peak


def test_plan_reports_the_recomputed_layer(capsys):
    """The JSON gives the recomputed layer's part of the activations; the table's note splits the
    figure into stored and recomputed (Llama-3-8B at 8192 tokens: 12 GB recomputed, unfused)."""
    shape = ["--arch", "llama", "--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8",
             "--ffn-hidden", "14336", "--vocab", "128256", "--seq", "8192", "--gpus", "8", "--recompute", "full"]
    spec = ModelSpec(arch="llama", layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, seq=8192,
                     vocab=128256)
    assert cli.main([*shape, "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)["memory"]["zero1"]
    layer = recomputed_layer_bytes(spec, 1, 8192, "bf16", "full")
    assert entry["activation_recompute_bytes"] == layer
    assert entry["activation_bytes"] == activation_bytes(spec, 1, 8192, "bf16", "full")
    assert 12.4e9 < layer < 12.5e9  # 12.18 GB before its two RMSNorms' fp32 rows and rstd were counted
    assert cli.main(shape) == 0
    assert f"plus {layer / 1e9:.2f} GB for the one layer backward recomputes" in capsys.readouterr().out


def test_the_recomputed_layer_is_the_largest_block():
    """In a mixture of experts with dense blocks, backward recomputes every block in turn: the
    peak carries the larger of the two working sets, whichever kind it is."""
    s, b = 512, 1
    moe = dict(arch="llama", hidden=256, heads=4, kv_heads=2, seq=s, vocab=11, experts=8,
               experts_per_token=2, expert_ffn=128)
    per_layer = {}
    for kind, extra in (("moe", {}), ("dense_narrow", {"dense_layers": 1, "ffn_hidden": 64}),
                        ("dense_wide", {"dense_layers": 1, "ffn_hidden": 4096})):
        only = ModelSpec(**{**moe, **extra, "layers": 1})  # one block of that kind
        # embedding mask, the final RMSNorm's tensors and the output layer's input, fp32 logits
        outside = s * b * 256 + (6 * 256 + 4 + 2 * 256) * s * b + 4 * s * b * 11
        per_layer[kind] = activation_bytes(only, b, s, "bf16", "none") - outside
    assert per_layer["dense_narrow"] < per_layer["moe"] < per_layer["dense_wide"]
    # under tensor parallelism each token-expert pair's gathered copy, expert output and weight (bf16) and
    # two int64 sort indices stay whole on a rank (Note [routed tokens under tensor parallelism])
    moe_whole = s * b * 2 * (2 * (2 * 256 + 1) + 16)
    moe_on_rank = (per_layer["moe"] - moe_whole) // 2 + moe_whole
    for ffn, largest, dense in ((64, per_layer["moe"], per_layer["dense_narrow"]),
                                (4096, per_layer["dense_wide"], per_layer["dense_wide"])):
        spec = ModelSpec(**moe, layers=4, dense_layers=1, ffn_hidden=ffn)
        stored = activation_bytes(spec, b, s, "bf16", "full") - recomputed_layer_bytes(spec, b, s, "bf16", "full")
        assert recomputed_layer_bytes(spec, b, s, "bf16", "full") == largest
        assert activation_bytes(spec, b, s, "bf16", "full") == stored + largest
        largest_on_rank = max(dense // 2, moe_on_rank)
        assert recomputed_layer_bytes(spec, b, s, "bf16", "full", tp=2) == largest_on_rank
        assert activation_bytes(spec, b, s, "bf16", "full", tp=2) == stored // 2 + largest_on_rank


def test_a_mixture_without_dense_blocks_recomputes_an_moe_block():
    """Every block a mixture of experts (no dense_layers): the recomputed layer is an MoE block's,
    whatever ``ffn_hidden`` says of a dense MLP the model does not have (the planner took the larger of
    an MoE and a dense block, so a wide ffn_hidden set the peak: 2.4x the MoE block here)."""
    from fusedist.plan.torch_model import Transformer

    s, b = 512, 1
    moe = dict(arch="llama", hidden=256, heads=4, kv_heads=2, seq=s, vocab=11, experts=8, experts_per_token=2,
               expert_ffn=128)
    # one MoE block as it is stored without recomputation, less the embedding's and the output layer's side
    outside = s * b * 256 + (6 * 256 + 4 + 2 * 256) * s * b + 4 * s * b * 11
    one_moe = activation_bytes(ModelSpec(**moe, layers=1, ffn_hidden=64), b, s, "bf16", "none") - outside
    moe_whole = s * b * 2 * (2 * (2 * 256 + 1) + 16)  # the routed pairs a tensor-parallel rank keeps whole
    for ffn in (64, 4096):
        spec = ModelSpec(**moe, layers=4, ffn_hidden=ffn)
        assert all(block.experts is not None for block in Transformer(spec).blocks)  # no dense MLP built
        assert recomputed_layer_bytes(spec, b, s, "bf16", "full") == one_moe, ffn
        assert recomputed_layer_bytes(spec, b, s, "bf16", "full", tp=2) == (one_moe - moe_whole) // 2 + moe_whole
