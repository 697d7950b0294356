"""What the norms keep for backward (Note [what a norm keeps] in fusedist/plan/norm_bytes.py),
byte for byte against autograd in bf16 and fp32: the Llama-style RMSNorm --measure trains
keeps its fp32 rows, its normalised rows and an fp32 rstd a row (latent attention's two norms
too); Gemma's its fp32 rows, fp32 normalised rows and rstd, and once a forward its fp32
``1 + weight``; LayerNorm its input (and two per-row statistics the planner leaves out).
Latent attention's up-projections keep the normalised compressed rows (Note [what latent
attention keeps] in fusedist/plan/latent_bytes.py)."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusedist.plan import ModelSpec, activation_bytes, cli, from_hf_config
from fusedist.plan.latent_bytes import latent_projection_bytes
from fusedist.plan.measure import _saved_activation_bytes, saved_storage_bytes
from fusedist.plan.model import block_activation_bytes
from fusedist.plan.norm_bytes import (block_norm_bytes, block_norm_weight_bytes, final_norm_bytes,
                                      final_norm_weight_bytes, layer_norm_bytes, rms_norm_bytes)
from fusedist.plan.torch_model import GemmaRMSNorm, RMSNorm, Transformer
from test_plan_configs import DEEPSEEK_V2_LITE, DEEPSEEK_V3, GEMMA2_9B, GEMMA3_1B, GEMMA_2B, QWEN3_8B

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])


def _saved(module, x, leave_out_rows=False):
    """Bytes of the distinct storages autograd saves through ``module(x)``, parameters left out
    (and, with ``leave_out_rows``, the tensors of one value a row)."""
    rows = x.numel() // x.shape[-1]
    return saved_storage_bytes(module, lambda: module(x).float().sum().backward(),
                               lambda t: not (leave_out_rows and t.numel() == rows))


class _HFGemmaRMSNorm(nn.Module):
    """GemmaRMSNorm as transformers writes it (Gemma-2's and Gemma-3's are the same code)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


def _saved_rows_and_weight(norm, x):
    """Saved bytes of ``norm(x)`` per token, and those of tensors shaped as its weight (Gemma's
    fp32 ``1 + weight``, one each time the norm runs), parameters left out."""
    width, tokens = norm.weight.numel(), x.shape[0] * x.shape[1]
    rows = saved_storage_bytes(norm, lambda: norm(x).float().sum().backward(), lambda t: t.shape != (width,))
    weight = saved_storage_bytes(norm, lambda: norm(x).float().sum().backward(), lambda t: t.shape == (width,))
    assert rows % tokens == 0
    return rows // tokens, weight


@DTYPES
@pytest.mark.parametrize("gemma", [False, True], ids=["llama_norm", "gemma_norm"])
def test_every_norm_of_the_measured_model_saves_what_the_planner_counts(dtype, gemma):
    """Llama's RMSNorm keeps its fp32 rows, its normalised rows in the activations' dtype and an
    fp32 rstd a row; Gemma's keeps the normalised rows in fp32 and, once a forward, its fp32
    ``1 + weight`` (also as transformers writes the norm)."""
    torch.manual_seed(0)
    b, s = 2, 5
    spec = ModelSpec(arch="llama", layers=1, hidden=32, heads=4, kv_heads=2, ffn_hidden=48, seq=s, vocab=11,
                     head_dim=16, qk_norm=True, sandwich_norm=True, gemma_norm=gemma)
    model = Transformer(spec).to(dtype)
    word = torch.finfo(dtype).bits // 8
    kept = 4 if gemma else word  # the normalised rows' bytes an element
    block = model.blocks[0]
    per_token = once = 0
    for norm, rows in ((block.norm1, 1), (block.norm2, 1), (block.post1, 1), (block.post2, 1),
                       (block.q_norm, spec.heads), (block.k_norm, spec.kv)):
        assert type(norm) is (GemmaRMSNorm if gemma else RMSNorm)
        width = norm.weight.numel()
        x = torch.randn(b, s, rows, width, dtype=dtype, requires_grad=True)
        saved, weight = _saved_rows_and_weight(norm, x)
        assert saved == rms_norm_bytes(width, rows, word, gemma) == rows * ((4 + kept) * width + 4)
        assert weight == 4 * width * gemma  # the fp32 1 + weight, once per norm
        if gemma:
            reference = _HFGemmaRMSNorm(width).to(dtype)
            assert _saved_rows_and_weight(reference, x) == (saved, weight)
        per_token += saved
        once += weight
    assert per_token == block_norm_bytes(spec, word)
    assert once == block_norm_weight_bytes(spec)
    x = torch.randn(b, s, spec.hidden, dtype=dtype, requires_grad=True)
    saved, weight = _saved_rows_and_weight(model.norm, x)
    assert saved == final_norm_bytes(spec, word) == (4 + kept) * spec.hidden + 4
    assert weight == final_norm_weight_bytes(spec) == 4 * spec.hidden * gemma
    if gemma:
        llama = ModelSpec(**{**spec.__dict__, "gemma_norm": False})
        assert block_norm_bytes(spec, word) - block_norm_bytes(llama, word) == (4 - word) * (
            4 * spec.hidden + (spec.heads + spec.kv) * spec.head_size)  # 2 bytes a normalised element more in bf16
        # the plan holds both, per block and on the output side, for each micro-batch
        precision = "bf16" if dtype == torch.bfloat16 else "fp32"
        assert (activation_bytes(spec, b, s, precision, "none") - activation_bytes(llama, b, s, precision, "none")
                == b * s * (block_norm_bytes(spec, word) - block_norm_bytes(llama, word)
                            + final_norm_bytes(spec, word) - final_norm_bytes(llama, word)) + once + weight)


def test_the_measured_rms_norm_is_torchs():
    """Same function as torch's nn.RMSNorm (in fp32 the two compute the same thing; only what they
    keep for backward differs)."""
    torch.manual_seed(0)
    x = torch.randn(3, 7, 16, requires_grad=True)
    ours, theirs = RMSNorm(16), nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.weight.copy_(ours.weight)
    torch.testing.assert_close(ours(x), theirs(x))
    g = torch.randn(3, 7, 16)
    grads = [torch.autograd.grad(m(x), (x, m.weight), g) for m in (ours, theirs)]
    torch.testing.assert_close(grads[0], grads[1])


@DTYPES
def test_layer_norm_saves_its_input_and_two_statistics_a_row(dtype):
    torch.manual_seed(0)
    b, s, h = 2, 5, 32
    spec = ModelSpec(arch="gpt", layers=1, hidden=h, heads=4, seq=s, vocab=11)
    model = Transformer(spec).to(dtype)
    word = torch.finfo(dtype).bits // 8
    x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
    for norm in (model.blocks[0].norm1, model.blocks[0].norm2, model.norm):
        assert _saved(norm, x, leave_out_rows=True) == b * s * layer_norm_bytes(h, word)
        statistics = _saved(norm, x) - _saved(norm, x, leave_out_rows=True)
        assert statistics in (2 * b * s * 4, 2 * b * s * word)  # mean and rstd: fp32, or the input's dtype on CPU
    assert block_norm_bytes(spec, word) == 2 * layer_norm_bytes(h, word)


@DTYPES
def test_measured_llama_saves_about_what_the_planner_counts(dtype):
    """The whole model --measure trains: the planner's figure is within 10% above what autograd
    saves (it counts dropout masks and unfused attention the model does not keep). Counting an
    RMSNorm as keeping its input only, the model saved 1.33x the figure in bf16 and 1.10x in fp32."""
    torch.manual_seed(0)
    b, s = 2, 16
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    for extra in ({}, {"qk_norm": True}, {"sandwich_norm": True},
                  {"gemma_norm": True, "qk_norm": True, "sandwich_norm": True}):
        spec = ModelSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96, seq=s, vocab=50,
                         **extra)
        model = Transformer(spec).to(dtype)
        tokens = torch.randint(0, 50, (b, s + 1))
        saved = _saved_activation_bytes(model, tokens[:, :-1], tokens[:, 1:])
        planned = activation_bytes(spec, b, s, precision, "none")
        assert 0.9 < saved / planned <= 1.0, (extra, saved, planned)


@DTYPES
@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["compressed_q", "full_q"])
def test_latent_attention_norms_save_what_the_planner_counts(dtype, q_lora_rank):
    """DeepSeek's q_a_layernorm (over q_lora_rank) and kv_a_layernorm (over kv_lora_rank), one row
    of each a token, in the measured model's latent attention."""
    torch.manual_seed(0)
    b, s, h, rank = 2, 5, 32, 16
    spec = ModelSpec(arch="llama", layers=1, hidden=h, heads=4, ffn_hidden=48, seq=s, vocab=11, head_dim=12,
                     kv_lora_rank=rank, q_lora_rank=q_lora_rank, rope_head_dim=4, v_head_dim=8)
    block = Transformer(spec).to(dtype).blocks[0]
    word = torch.finfo(dtype).bits // 8
    latent_norms = [block.latent.kv_norm] + ([block.latent.q[1]] if q_lora_rank else [])
    per_token = 0
    for norm in (block.norm1, block.norm2, *latent_norms):
        assert isinstance(norm, RMSNorm)
        x = torch.randn(b, s, norm.weight.numel(), dtype=dtype, requires_grad=True)
        saved = _saved(norm, x)
        assert saved == b * s * rms_norm_bytes(norm.weight.numel(), 1, word)
        per_token += saved // (b * s)
    assert [n.weight.numel() for n in latent_norms] == [rank] + ([q_lora_rank] if q_lora_rank else [])
    assert per_token == block_norm_bytes(spec, word)


def _saved_outside_attention(module, x, monkeypatch):
    """Bytes ``module(x)`` saves for backward but for what scaled_dot_product_attention saves
    (its Q, K, V and what the kernel keeps of the scores, which differ between devices and are
    counted as Megatron's unfused attention)."""
    sdpa = F.scaled_dot_product_attention

    def unseen(*args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return sdpa(*args, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", unseen)
    return saved_storage_bytes(module, lambda: module(x).float().sum().backward())


@DTYPES
@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["compressed_q", "full_q"])
def test_latent_attention_block_saves_what_the_planner_counts(dtype, q_lora_rank, monkeypatch):
    """A measured DeepSeek block keeps, besides its norms, Megatron's tensors and its MLP's, the
    up-projections' inputs (q_b_proj's q_lora_rank, kv_b_proj's kv_lora_rank) and in fp32 the
    rotary columns of kv_a_proj_with_mqa's output (Note [what latent attention keeps])."""
    torch.manual_seed(0)
    b, s, h, rank, rope = 2, 5, 32, 16, 4
    spec = ModelSpec(arch="llama", layers=1, hidden=h, heads=4, ffn_hidden=48, seq=s, vocab=11, head_dim=12,
                     kv_lora_rank=rank, q_lora_rank=q_lora_rank, rope_head_dim=rope, v_head_dim=8)
    block = Transformer(spec).to(dtype).blocks[0]
    word = torch.finfo(dtype).bits // 8
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
    saved = _saved_outside_attention(block, x, monkeypatch)
    planned = block_activation_bytes(spec, 0, b, s, precision, "selective")
    # less attention's Q, K, V (saved inside the kernel here) and the dropout masks the block does not have
    planned -= b * s * (word * (spec.q_dim + spec.kv_dim + spec.o_dim) + 2 * h)
    assert saved == planned
    projections = word * (rank + (q_lora_rank or 0)) + 4 * rope * (word == 4)
    assert latent_projection_bytes(spec, word) == projections
    # what the block keeps besides: norms, the attention's input and output, the SwiGLU MLP's
    assert saved == b * s * (block_norm_bytes(spec, word) + projections
                             + word * (h + spec.o_dim + h + 4 * spec.ffn))


def test_the_gemma_norm_is_rms_norm_times_one_plus_weight():
    """In fp32 Gemma's norm is torch's nn.RMSNorm with the weight 1 + w, values and gradients."""
    torch.manual_seed(0)
    x = torch.randn(3, 7, 16, requires_grad=True)
    ours, theirs = GemmaRMSNorm(16), nn.RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        ours.weight.uniform_(-0.5, 0.5)
        theirs.weight.copy_(1 + ours.weight)
    torch.testing.assert_close(ours(x), theirs(x))
    g = torch.randn(3, 7, 16)
    grads = [torch.autograd.grad(m(x), (x, m.weight), g) for m in (ours, theirs)]
    torch.testing.assert_close(grads[0], grads[1])


def test_configs_pick_the_norms_their_models_use(tmp_path, capsys):
    path = tmp_path / "config.json"
    for cfg, gemma in ((GEMMA_2B, True), (GEMMA2_9B, True), (GEMMA3_1B, True), (QWEN3_8B, False),
                       (DEEPSEEK_V3, False)):
        path.write_text(json.dumps(cfg))
        assert from_hf_config(str(path)).gemma_norm is gemma, cfg["model_type"]
    for cfg, latent in ((DEEPSEEK_V3, 512 + 1536), (DEEPSEEK_V2_LITE, 512)):
        path.write_text(json.dumps(cfg))
        spec = from_hf_config(str(path))
        plain = ModelSpec(arch="llama", hidden=spec.hidden, heads=spec.heads, layers=1)
        assert block_norm_bytes(spec, 2) - block_norm_bytes(plain, 2) == 6 * latent + 4 * (1 + (latent > 512))
        assert latent_projection_bytes(spec, 2) == 2 * latent  # kv_b_proj's input, and q_b_proj's in V3
        assert latent_projection_bytes(spec, 4) == 4 * (latent + 64)  # and the rotary columns in fp32
    # the plan says which norm it counted
    path.write_text(json.dumps(GEMMA2_9B))
    assert cli.main(["--hf-config", str(path), "--gpus", "8", "--seq", "4096", "--json"]) in (0, 1)
    plan = json.loads(capsys.readouterr().out)
    assert plan["inputs"]["model"]["gemma_norm"] is True
    assert "the normalised rows in fp32 and an fp32 rstd a row (Gemma's RMSNorm" in \
        plan["inputs"]["assumptions"]["activations"]
    assert "and that fp32 1 + weight once a norm for each micro-batch" in plan["inputs"]["assumptions"]["activations"]
    path.write_text(json.dumps(DEEPSEEK_V3))
    assert cli.main(["--hf-config", str(path), "--gpus", "64", "--seq", "4096", "--json"]) in (0, 1)
    plan = json.loads(capsys.readouterr().out)
    assert "gemma_norm" not in plan["inputs"]["model"]
    assert "latent attention's RMSNorms of its compressed keys/values (kv_lora_rank) and queries" in \
        plan["inputs"]["assumptions"]["activations"]
    assert "its up-projections (kv_b_proj, q_b_proj) keep their inputs" in plan["inputs"]["assumptions"]["activations"]
