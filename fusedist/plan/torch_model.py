"""The model ``--measure`` trains: a decoder-only transformer with exactly the parameters
:func:`fusedist.plan.model.count_params` counts (``gpt`` or ``llama`` blocks). Rotary position
encoding is left out of the llama block: it has no parameters and does not change the bytes
that are measured."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .model import ModelSpec


class Block(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, f = spec.hidden, spec.ffn
        self.heads, self.kv, self.head_dim = spec.heads, spec.kv, spec.head_size
        self.q_dim, self.kv_dim = spec.q_dim, spec.kv_dim
        self.gpt = spec.arch == "gpt"
        norm = nn.LayerNorm if self.gpt else nn.RMSNorm
        self.norm1, self.norm2 = norm(h), norm(h)
        self.qkv = nn.Linear(h, self.q_dim + 2 * self.kv_dim, bias=self.gpt or spec.qkv_bias)
        self.proj = nn.Linear(self.q_dim, h, bias=self.gpt or spec.out_bias)
        if self.gpt:
            self.fc, self.out = nn.Linear(h, f), nn.Linear(f, h)
        else:  # gate and up projections as one matrix: same parameters as two
            self.fc = nn.Linear(h, 2 * f, bias=spec.mlp_bias)
            self.out = nn.Linear(f, h, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.kv, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.kv, self.head_dim).transpose(1, 2)
        if self.kv != self.heads:
            k = k.repeat_interleave(self.heads // self.kv, dim=1)
            v = v.repeat_interleave(self.heads // self.kv, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, self.q_dim))
        m = self.fc(self.norm2(x))
        if self.gpt:
            m = F.gelu(m)
        else:
            gate, up = m.chunk(2, dim=-1)
            m = F.silu(gate) * up
        return x + self.out(m)


class Transformer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        h = spec.hidden
        self.gpt = spec.arch == "gpt"
        self.wte = nn.Embedding(spec.vocab, h)
        self.wpe = nn.Embedding(spec.seq, h) if self.gpt else None
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.layers))
        self.norm = nn.LayerNorm(h) if self.gpt else nn.RMSNorm(h)
        self.head = None if spec.tied_embeddings else nn.Linear(h, spec.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return F.linear(x, self.wte.weight) if self.head is None else self.head(x)
