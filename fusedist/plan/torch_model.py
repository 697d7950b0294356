"""The model ``--measure`` trains: a decoder-only transformer with exactly the parameters
:func:`fusedist.plan.model.count_params` counts (``gpt``, ``llama`` or ``falcon`` blocks, with
q/k norms, sandwich norms, Gemma's RMSNorm, experts and sliding attention windows where the
spec has them).
Rotary position encoding is left out of the llama block: it has no parameters and does not
change the bytes that are measured.

The mixture of experts routes each token to the router's top-k experts only, as the real
models do (Note [routed tokens]): the FLOPs and the saved activations are the active
experts', which is what the planner counts (Note [active parameters] in model.py). The
experts are two stacked parameters, so an expert that no token picked still has a (zero)
gradient every step, as DDP's and ZeRO's reductions expect.

Note [routed tokens]
    The router's softmax (in fp32, as Mixtral's and Qwen-MoE's) picks ``experts_per_token``
    experts a token, their weights renormalised to sum to one. The token-expert pairs are
    sorted by expert; each expert's rows are gathered, go through its SwiGLU, and are
    weighted and added back to their tokens with ``scatter_add`` (Megatron-Core's unpermute),
    whose backward needs only the indices (``index_add``, which transformers' Mixtral uses,
    also saves the weighted outputs: a third ``h`` a pair). What autograd keeps, per token:
    the fp32 router probabilities (``4·experts`` bytes), the top-k indices and the two sort
    indices (int64, ``24·k``), the top-k weights and their sum (fp32, ``4·k + 4``) and, per
    pair, the gathered input, the SwiGLU's four tensors, the expert's output and its weight
    (``(2h + 4·expert_ffn + 1)`` elements); :func:`fusedist.plan.model.activation_bytes` counts
    these.

Gemma-2's logit soft-capping (``cap · tanh(x / cap)``) is applied where the spec has it: on
the final logits, and on the attention scores, which then take the unfused path (scores,
cap, mask, softmax), as transformers' eager attention does for Gemma-2."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .model import ModelSpec


class RMSNorm(nn.Module):
    """transformers' Llama RMSNorm (Mistral's, Qwen's and DeepSeek's are the same): the rows in
    fp32, cast back before the weight, on every device; torch's nn.RMSNorm keeps other tensors
    on CUDA than elsewhere (Note [what a norm keeps] in fusedist/plan/norm_bytes.py)."""

    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.to(torch.float32)
        normed = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """transformers' Gemma RMSNorm (Gemma-2's and Gemma-3's are the same): the weight is an offset
    from one, and the product with ``1 + weight`` is taken in fp32 before the cast back, so the
    normalised rows it keeps are fp32 (Note [what a norm keeps] in fusedist/plan/norm_bytes.py)."""

    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.float()
        normed = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


def rms_norm_class(spec: ModelSpec):
    """The RMSNorm the spec's model uses: Gemma's or Llama's."""
    return GemmaRMSNorm if spec.gemma_norm else RMSNorm


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
        y = self._routed(t)
        if self.shared is not None:
            g, u = self.shared["fc"](t).chunk(2, dim=-1)
            s = self.shared["out"](F.silu(g) * u)
            y = y + (torch.sigmoid(self.shared_gate(t)) * s if self.shared_gate is not None else s)
        return y.view_as(x)

    def _routed(self, t: torch.Tensor) -> torch.Tensor:
        """Each token through its top-k experts only (Note [routed tokens])."""
        e, h, f = self.shape
        probs = F.softmax(self.router(t), dim=-1, dtype=torch.float32)
        top, idx = probs.topk(self.top_k, dim=-1)
        weights = (top / top.sum(-1, keepdim=True)).to(t.dtype)
        pairs = idx.flatten()
        order = pairs.argsort(stable=True)  # the token-expert pairs, grouped by expert
        token_of = order // self.top_k
        rows = t[token_of]
        counts = torch.bincount(pairs, minlength=e).tolist()
        w_in, w_out = self.w_in.view(e, h, 2 * f), self.w_out.view(e, f, h)
        outs = []
        for i, chunk in enumerate(rows.split(counts)):  # an expert with no rows still runs: a zero gradient
            gate, up = (chunk @ w_in[i]).chunk(2, dim=-1)
            outs.append((F.silu(gate) * up) @ w_out[i])
        weighted = torch.cat(outs) * weights.flatten()[order].unsqueeze(-1)
        return torch.zeros_like(t).scatter_add(0, token_of.unsqueeze(-1).expand(-1, h), weighted)


class LatentAttention(nn.Module):
    """DeepSeek-V2/V3's projections (Note [latent attention] in model.py): returns the heads'
    outputs, ``heads x v_head_dim`` a token, for the block's output projection."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, r, qr = spec.hidden, spec.kv_lora_rank, spec.q_lora_rank
        self.heads, self.head_dim, self.rank = spec.heads, spec.head_size, r
        self.rope, self.v_dim = spec.rope_head_dim, spec.v_head_dim
        if qr:
            self.q = nn.Sequential(nn.Linear(h, qr, bias=spec.qkv_bias), RMSNorm(qr),
                                   nn.Linear(qr, spec.q_dim, bias=False))
        else:
            self.q = nn.Linear(h, spec.q_dim, bias=False)
        self.kv_a = nn.Linear(h, r + self.rope, bias=spec.qkv_bias)
        self.kv_norm = RMSNorm(r)
        self.kv_b = nn.Linear(r, spec.heads * (self.head_dim - self.rope + self.v_dim), bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        latent, k_rope = self.kv_a(x).split([self.rank, self.rope], dim=-1)
        kv = self.kv_b(self.kv_norm(latent)).view(b, s, self.heads, -1)
        k_nope, v = kv.split([self.head_dim - self.rope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(b, s, self.heads, self.rope)], dim=-1)
        att = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return att.transpose(1, 2).reshape(b, s, self.heads * self.v_dim)


def window_mask(s: int, window: int, device) -> torch.Tensor:
    """Causal sliding window: query i attends keys i - window < j <= i (transformers'
    sliding_window_overlay and causal mask; Note [sliding windows] in model.py)."""
    i = torch.arange(s, device=device)
    distance = i[:, None] - i[None, :]
    return (distance >= 0) & (distance < window)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, moe: bool = False, window=None):
        super().__init__()
        self.window, self.softcap = window, spec.attn_softcap
        h, f = spec.hidden, spec.ffn
        self.heads, self.kv, self.head_dim = spec.heads, spec.kv, spec.head_size
        self.q_dim, self.kv_dim = spec.q_dim, spec.kv_dim
        self.gpt = spec.arch == "gpt"
        self.gelu, self.parallel = spec.arch != "llama", spec.parallel_attn
        rms_norm = rms_norm_class(spec)
        norm = nn.LayerNorm if self.gelu else rms_norm
        self.norm1 = norm(h)
        self.norm2 = None if spec.shared_norm else norm(h)  # Falcon-7B: norm1 feeds the MLP too
        # Gemma-2/3 normalise the attention's and the MLP's outputs too
        self.post1, self.post2 = (norm(h), norm(h)) if spec.sandwich_norm else (nn.Identity(), nn.Identity())
        self.q_norm, self.k_norm = ((rms_norm(self.head_dim), rms_norm(self.head_dim)) if spec.qk_norm
                                    else (nn.Identity(), nn.Identity()))
        self.latent = LatentAttention(spec) if spec.kv_lora_rank is not None else None
        if self.latent is None:
            self.qkv = nn.Linear(h, self.q_dim + 2 * self.kv_dim, bias=self.gpt or spec.qkv_bias)
        self.proj = nn.Linear(spec.o_dim, h, bias=self.gpt or spec.out_bias)
        self.experts = Experts(spec) if moe else None
        if self.gelu:
            self.fc, self.out = (nn.Linear(h, f, bias=self.gpt or spec.mlp_bias),
                                 nn.Linear(f, h, bias=self.gpt or spec.mlp_bias))
        elif not moe:  # gate and up projections as one matrix: same parameters as two
            self.fc = nn.Linear(h, 2 * f, bias=spec.mlp_bias)
            self.out = nn.Linear(f, h, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0 = x
        x = x + self.post1(self.proj(self._attend(self.norm1(x))))
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

    def _attend(self, x: torch.Tensor) -> torch.Tensor:
        if self.latent is not None:
            return self.latent(x)
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
        q = self.q_norm(q.view(b, s, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(b, s, self.kv, self.head_dim)).transpose(1, 2)
        v = v.view(b, s, self.kv, self.head_dim).transpose(1, 2)
        if self.kv != self.heads:
            k = k.repeat_interleave(self.heads // self.kv, dim=1)
            v = v.repeat_interleave(self.heads // self.kv, dim=1)
        att = self._scores(q, k, v)
        return att.transpose(1, 2).reshape(b, s, self.q_dim)

    def _scores(self, q, k, v) -> torch.Tensor:
        s = q.shape[-2]
        if self.softcap is not None:
            return self._capped_scores(q, k, v)
        if self.window is None or self.window >= s:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask(s, self.window, q.device))

    def _capped_scores(self, q, k, v) -> torch.Tensor:
        """Unfused attention with Gemma-2's soft-capped scores (Note [soft-capping] in model.py)."""
        s = q.shape[-2]
        scores = soft_cap(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, self.softcap)
        # an additive mask, as transformers' eager attention: adding keeps nothing for backward
        hidden = torch.zeros(s, s, dtype=scores.dtype, device=q.device)
        hidden.masked_fill_(~window_mask(s, self.window or s, q.device), float("-inf"))
        return F.softmax(scores + hidden, dim=-1) @ v


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap · tanh(x / cap)``: Gemma-2's logit soft-capping."""
    return torch.tanh(x / cap) * cap


class Transformer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        h = spec.hidden
        self.gpt = spec.arch == "gpt"
        self.wte = nn.Embedding(spec.vocab, h)
        self.wpe = nn.Embedding(spec.seq, h) if self.gpt else None
        # the dense blocks where the config puts them: ZeRO-3 gathers consecutive blocks together
        self.blocks = nn.ModuleList(Block(spec, moe=spec.is_moe_block(i),
                                          window=spec.sliding_window if i in spec.window_layers else None)
                                    for i in range(spec.layers))
        self.norm = rms_norm_class(spec)(h) if spec.arch == "llama" else nn.LayerNorm(h)
        self.head = None if spec.tied_embeddings else nn.Linear(h, spec.vocab, bias=False)
        self.final_softcap = spec.final_softcap

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        logits = F.linear(x, self.wte.weight) if self.head is None else self.head(x)
        return logits if self.final_softcap is None else soft_cap(logits, self.final_softcap)
