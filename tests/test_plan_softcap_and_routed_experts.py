"""Activation bytes the planner counts against what autograd saves, byte for byte: Gemma-2's
logit soft-capping (Note [soft-capping] in fusedist/plan/model.py) on Megatron's layer and on
the output side, and the routed mixture of experts --measure builds (Note [routed tokens] in
fusedist/plan/torch_model.py), which sends each token through its top-k experts only."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusedist.plan import ModelSpec, PlanError, from_hf_config
from fusedist.plan.measure import saved_storage_bytes
from fusedist.plan.model import _moe_mlp_tensors, output_side_bytes, recomputed_layer_bytes
from fusedist.plan.torch_model import Experts, Transformer, soft_cap
from test_plan_configs import GEMMA2_2B, GEMMA2_27B, GEMMA3_1B, LLAMA3_8B
from test_planner_recompute_peak import _drop, _GPTLayer, _peak_saved_bytes


class _CappedGPTLayer(_GPTLayer):
    """Megatron's layer with Gemma-2's soft-capped attention scores."""

    def __init__(self, h, a, cap):
        super().__init__(h, a)
        self.cap = cap

    def forward(self, x):
        b, s, h = x.shape
        y = self.ln1(x)
        q, k, v = self._heads(self.q(y)), self._heads(self.k(y)), self._heads(self.v(y))
        scores = soft_cap(torch.bmm(q, k.transpose(1, 2)) * (1 / math.sqrt(self.d)), self.cap)
        p = _drop(torch.softmax(scores, -1))
        o = torch.bmm(p, v).view(b, self.a, s, self.d).transpose(1, 2).reshape(b, s, h)
        x = x + _drop(self.proj(o))
        return x + _drop(self.out(F.gelu(self.fc(self.ln2(x)))))


def _write(tmp_path, cfg):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_capped_attention_layer_saves_what_the_planner_counts():
    torch.manual_seed(0)
    b, s, h, a = 2, 16, 32, 4
    layer = _CappedGPTLayer(h, a, cap=50.0).to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    saved = _peak_saved_bytes(lambda: layer(x).float().sum().backward(), params, b * s)
    spec = ModelSpec(layers=1, hidden=h, heads=a, seq=s, vocab=7)
    capped = ModelSpec(layers=1, hidden=h, heads=a, seq=s, vocab=7, attn_softcap=50.0)
    # the uncapped layer's 34sbh + 5as²b, and tanh's a·s²·b output in bf16
    assert saved == recomputed_layer_bytes(capped, b, s, "bf16", "full")
    assert saved == recomputed_layer_bytes(spec, b, s, "bf16", "full") + 2 * a * s * s * b


def test_capped_logits_save_what_the_output_side_counts():
    """The final norm's and the output layer's inputs, bf16 tanh(logits / cap), fp32 log-probabilities."""
    torch.manual_seed(0)
    b, s, h, v = 2, 16, 32, 100
    norm, head = nn.LayerNorm(h).to(torch.bfloat16), nn.Linear(h, v, bias=False).to(torch.bfloat16)
    params = {p.untyped_storage().data_ptr() for m in (norm, head) for p in m.parameters()}
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, v, (b * s,))

    def step():
        logits = soft_cap(head(norm(x)), 30.0)
        # cross-entropy as log-softmax and a gather (F.cross_entropy also keeps a 4-byte total weight)
        F.log_softmax(logits.float().flatten(0, 1), -1).gather(1, targets[:, None]).mean().neg().backward()
    saved = _peak_saved_bytes(step, params, b * s)
    spec = ModelSpec(arch="gpt", layers=1, hidden=h, heads=4, seq=s, vocab=v, final_softcap=30.0)  # a LayerNorm
    assert saved == output_side_bytes(spec, b, s, "bf16")
    assert saved == output_side_bytes(ModelSpec(arch="gpt", layers=1, hidden=h, heads=4, seq=s, vocab=v),
                                      b, s, "bf16") + 2 * s * b * v


def test_gemma_soft_caps_are_read_with_their_classes_defaults(tmp_path):
    """Gemma2Config caps scores at 50 and logits at 30 unless told otherwise (gemma-2-27b's
    config.json says so; here its keys are left out); Gemma3TextConfig caps nothing by default."""
    for cfg in (GEMMA2_2B, GEMMA2_27B):
        spec = from_hf_config(_write(tmp_path, cfg))
        assert (spec.attn_softcap, spec.final_softcap) == (50.0, 30.0)
    spec = from_hf_config(_write(tmp_path, {**GEMMA2_2B, "attn_logit_softcapping": None}))
    assert (spec.attn_softcap, spec.final_softcap) == (None, 30.0)
    spec = from_hf_config(_write(tmp_path, GEMMA3_1B))
    assert (spec.attn_softcap, spec.final_softcap) == (None, None)
    assert from_hf_config(_write(tmp_path, LLAMA3_8B)).final_softcap is None
    with pytest.raises(PlanError, match="'final_logit_softcapping' must be a positive number or null, got 0"):
        from_hf_config(_write(tmp_path, {**GEMMA2_2B, "final_logit_softcapping": 0}))


def test_gemma2_plan_counts_the_capped_tensors(tmp_path):
    """At Gemma-2-2B's shape, s = 4096: 8 heads · 4096² · 2 bytes a layer (26 layers, 7.0 GB) and
    256,000 · 2 bytes a token (2.1 GB) more than the same model without caps."""
    from fusedist.plan import activation_bytes
    capped = from_hf_config(_write(tmp_path, GEMMA2_2B))
    plain = from_hf_config(_write(tmp_path, {**GEMMA2_2B, "attn_logit_softcapping": None,
                                             "final_logit_softcapping": None}))
    s = 4096
    extra = 26 * 8 * s * s * 2 + 2 * s * 256_000
    assert activation_bytes(capped, 1, s, "bf16", "none") - activation_bytes(plain, 1, s, "bf16", "none") == extra
    # selective recomputation drops the score tensors, capped or not; the logits' tanh stays
    assert (activation_bytes(capped, 1, s, "bf16", "selective")
            - activation_bytes(plain, 1, s, "bf16", "selective")) == 2 * s * 256_000


def test_measured_model_caps_scores_and_logits(tmp_path):
    """The model --measure builds for a Gemma-2 config applies both caps as transformers does."""
    tiny = {**GEMMA2_2B, "hidden_size": 16, "intermediate_size": 24, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 8, "num_hidden_layers": 2, "vocab_size": 32,
            "attn_logit_softcapping": 0.5, "final_logit_softcapping": 0.25}
    torch.manual_seed(0)
    model = Transformer(from_hf_config(_write(tmp_path, tiny)))
    tokens = torch.randint(0, 32, (2, 6))
    logits = model(tokens)
    model.final_softcap = None
    raw = model(tokens)
    torch.testing.assert_close(logits, 0.25 * torch.tanh(raw / 0.25))
    assert raw.abs().max() > 0.25 > logits.abs().max() - 1e-6
    block = model.blocks[1]
    q, k, v = (torch.randn(2, 2, 6, 8) * 3 for _ in range(3))
    scores = 0.5 * torch.tanh(q @ k.transpose(-1, -2) / 8 ** 0.5 / 0.5)
    expected = scores.masked_fill(torch.ones(6, 6).triu(1).bool(), float("-inf")).softmax(-1) @ v
    torch.testing.assert_close(block._scores(q, k, v), expected)


MOE_SPECS = {  # Mixtral's shape (no shared expert) and Qwen2-MoE's (a gated shared one)
    "mixtral": dict(experts=8, experts_per_token=2, expert_ffn=24),
    "qwen2_moe": dict(experts=6, experts_per_token=3, expert_ffn=12, shared_ffn=20, shared_gate=True),
    "deepseek": dict(experts=5, experts_per_token=2, expert_ffn=12, shared_ffn=24),
}


def _saved_bytes(module, x):
    """Bytes of the distinct storages autograd saves through ``module(x)`` and its backward,
    parameters left out (as --measure counts them)."""
    return saved_storage_bytes(module, lambda: module(x).float().sum().backward())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MOE_SPECS))
def test_routed_experts_save_what_the_planner_counts(name, dtype):
    """The MoE MLP --measure trains keeps exactly the planner's per-token figure; running every
    expert on every token kept ``experts / experts_per_token`` times the experts' tensors."""
    torch.manual_seed(0)
    spec = ModelSpec(arch="llama", layers=1, hidden=16, heads=2, seq=8, vocab=10, **MOE_SPECS[name])
    experts = Experts(spec).to(dtype)
    b, s = 3, 8
    x = torch.randn(b, s, spec.hidden, dtype=dtype, requires_grad=True)
    elements, other = _moe_mlp_tensors(spec)
    assert _saved_bytes(experts, x) == b * s * (elements * x.element_size() + other)
    assert experts.w_in.grad is not None and experts.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("name", list(MOE_SPECS))
def test_routed_experts_compute_the_top_k_mixture(name):
    """Each token's output is the renormalised top-k weighted sum of its experts' SwiGLU outputs
    (plus the shared expert, gated where the spec says), computed token by token here."""
    torch.manual_seed(0)
    spec = ModelSpec(arch="llama", layers=1, hidden=16, heads=2, seq=8, vocab=10, **MOE_SPECS[name])
    experts = Experts(spec).double()
    x = torch.randn(2, 5, spec.hidden, dtype=torch.float64)
    e, h, f = experts.shape
    w_in, w_out = experts.w_in.view(e, h, 2 * f), experts.w_out.view(e, f, h)
    expected = []
    for t in x.reshape(-1, h):
        probs = experts.router(t).softmax(-1)
        top, idx = probs.topk(spec.experts_per_token)
        y = sum(w / top.sum() * (F.silu(t @ w_in[i][:, :f]) * (t @ w_in[i][:, f:])) @ w_out[i]
                for w, i in zip(top, idx.tolist()))
        if experts.shared is not None:
            g, u = experts.shared["fc"](t).chunk(2)
            shared = experts.shared["out"](F.silu(g) * u)
            y = y + (torch.sigmoid(experts.shared_gate(t)) * shared if experts.shared_gate is not None else shared)
        expected.append(y)
    torch.testing.assert_close(experts(x), torch.stack(expected).view_as(x))


def test_plan_says_it_counts_the_caps(tmp_path, capsys):
    from fusedist.plan import cli
    path = _write(tmp_path, GEMMA2_2B)
    assert cli.main(["--hf-config", path, "--gpus", "8", "--seq", "4096"]) in (0, 1)
    assert ", soft-capped scores at 50 and logits at 30, vocab 256000" in capsys.readouterr().out.splitlines()[0]
    assert cli.main(["--hf-config", path, "--gpus", "8", "--seq", "4096", "--json"]) in (0, 1)
    plan = json.loads(capsys.readouterr().out)
    assert plan["inputs"]["model"]["final_softcap"] == 30.0
    assert "soft-capping keeps tanh's output" in plan["inputs"]["assumptions"]["activations"]
    assert cli.main(["--hf-config", _write(tmp_path, GEMMA3_1B), "--gpus", "8", "--seq", "4096"]) in (0, 1)
    assert "soft-capped" not in capsys.readouterr().out


def test_measured_peak_times_the_experts_products_at_their_routed_rows():
    """--measure's peak rate is over the step's own products (Note [the measured peak]): an
    expert multiplies its share of the token-expert pairs by its (h, 2f) and (f, h) matrices,
    not every token by the stacked (experts·h, 2f) parameter."""
    from fusedist.plan.measure import _gemm_shapes
    spec = ModelSpec(arch="llama", layers=1, hidden=16, heads=2, seq=8, vocab=10, **MOE_SPECS["mixtral"])
    with torch.device("meta"):
        shapes = set(_gemm_shapes(Transformer(spec), 64))
    rows = 64 * 2 // 8
    assert {(rows, 16, 48), (rows, 48, 16), (16, rows, 48), (rows, 24, 16), (rows, 16, 24), (24, rows, 16)} <= shapes
    assert not any(8 * 16 in shape or 8 * 24 in shape for shape in shapes)  # no stacked parameter as one matrix
    assert (64, 16, 8) in shapes  # the router: every token
