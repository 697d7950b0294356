"""The model ``--measure`` trains: a decoder-only transformer with exactly the parameters
:func:`fusedist.plan.model.count_params` counts (``gpt``, ``llama`` or ``falcon`` blocks, with
q/k norms, sandwich norms and experts where the spec has them). Rotary position encoding is left out of
the llama block: it has no parameters and does not change the bytes that are measured.

The mixture of experts runs every expert on every token and weights the outputs by the
router's top-k (zero for the others): each expert then has a gradient every step, as DDP's
and ZeRO's reductions expect, and the bytes held and sent are the ones the planner counts;
the FLOPs are all experts', not the active ones' (Note [active parameters] in model.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .model import ModelSpec


class Experts(nn.Module):
    """Router, ``experts`` SwiGLU MLPs (gate and up as one matrix) and the optional gated
    shared expert of a mixture-of-experts block."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, e, f = spec.hidden, spec.experts, spec.expert_ffn
        self.top_k = spec.experts_per_token
        self.router = nn.Linear(h, e, bias=False)
        # 2-D, experts stacked by rows: fully_shard cuts its flat buffers between rows, and
        # an expert a row would pad them by up to an expert's weights
        self.w_in = nn.Parameter(torch.randn(e * h, 2 * f) * 0.02)
        self.w_out = nn.Parameter(torch.randn(e * f, h) * 0.02)
        self.shape = (e, h, f)
        self.shared = None
        if spec.shared_ffn:
            self.shared = nn.ModuleDict({"fc": nn.Linear(h, 2 * spec.shared_ffn, bias=False),
                                         "out": nn.Linear(spec.shared_ffn, h, bias=False)})
        self.shared_gate = nn.Linear(h, 1, bias=False) if spec.shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(t).float(), dim=-1)
        top, idx = probs.topk(self.top_k, dim=-1)
        weights = torch.zeros_like(probs).scatter(1, idx, top / top.sum(-1, keepdim=True)).to(t.dtype)
        e, h, f = self.shape
        gate, up = torch.einsum("th,ehf->etf", t, self.w_in.view(e, h, 2 * f)).chunk(2, dim=-1)
        y = torch.einsum("etf,efh,te->th", F.silu(gate) * up, self.w_out.view(e, f, h), weights)
        if self.shared is not None:
            g, u = self.shared["fc"](t).chunk(2, dim=-1)
            s = self.shared["out"](F.silu(g) * u)
            y = y + (torch.sigmoid(self.shared_gate(t)) * s if self.shared_gate is not None else s)
        return y.view_as(x)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, moe: bool = False):
        super().__init__()
        h, f = spec.hidden, spec.ffn
        self.heads, self.kv, self.head_dim = spec.heads, spec.kv, spec.head_size
        self.q_dim, self.kv_dim = spec.q_dim, spec.kv_dim
        self.gpt = spec.arch == "gpt"
        self.gelu, self.parallel = spec.arch != "llama", spec.parallel_attn
        norm = nn.LayerNorm if self.gelu else nn.RMSNorm
        self.norm1 = norm(h)
        self.norm2 = None if spec.shared_norm else norm(h)  # Falcon-7B: norm1 feeds the MLP too
        # Gemma-2/3 normalise the attention's and the MLP's outputs too
        self.post1, self.post2 = (norm(h), norm(h)) if spec.sandwich_norm else (nn.Identity(), nn.Identity())
        self.q_norm, self.k_norm = ((nn.RMSNorm(self.head_dim), nn.RMSNorm(self.head_dim)) if spec.qk_norm
                                    else (nn.Identity(), nn.Identity()))
        self.qkv = nn.Linear(h, self.q_dim + 2 * self.kv_dim, bias=self.gpt or spec.qkv_bias)
        self.proj = nn.Linear(self.q_dim, h, bias=self.gpt or spec.out_bias)
        self.experts = Experts(spec) if moe else None
        if self.gelu:
            self.fc, self.out = (nn.Linear(h, f, bias=self.gpt or spec.mlp_bias),
                                 nn.Linear(f, h, bias=self.gpt or spec.mlp_bias))
        elif not moe:  # gate and up projections as one matrix: same parameters as two
            self.fc = nn.Linear(h, 2 * f, bias=spec.mlp_bias)
            self.out = nn.Linear(f, h, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        x0 = x
        q, k, v = self.qkv(self.norm1(x)).split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
        q = self.q_norm(q.view(b, s, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(b, s, self.kv, self.head_dim)).transpose(1, 2)
        v = v.view(b, s, self.kv, self.head_dim).transpose(1, 2)
        if self.kv != self.heads:
            k = k.repeat_interleave(self.heads // self.kv, dim=1)
            v = v.repeat_interleave(self.heads // self.kv, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.post1(self.proj(att.transpose(1, 2).reshape(b, s, self.q_dim)))
        norm2 = self.norm1 if self.norm2 is None else self.norm2
        mlp_in = norm2(x0 if self.parallel else x)  # Falcon: both from the block's input
        if self.experts is not None:
            return x + self.post2(self.experts(mlp_in))
        m = self.fc(mlp_in)
        if self.gelu:
            m = F.gelu(m)
        else:
            gate, up = m.chunk(2, dim=-1)
            m = F.silu(gate) * up
        return x + self.post2(self.out(m))


class Transformer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        h = spec.hidden
        self.gpt = spec.arch == "gpt"
        self.wte = nn.Embedding(spec.vocab, h)
        self.wpe = nn.Embedding(spec.seq, h) if self.gpt else None
        # which blocks are dense does not change what is counted or sent: the first ones
        self.blocks = nn.ModuleList(Block(spec, moe=spec.moe and i >= spec.dense_layers) for i in range(spec.layers))
        self.norm = nn.RMSNorm(h) if spec.arch == "llama" else nn.LayerNorm(h)
        self.head = None if spec.tied_embeddings else nn.Linear(h, spec.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return F.linear(x, self.wte.weight) if self.head is None else self.head(x)
