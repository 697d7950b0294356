"""A small GPT-style language model and a generated text corpus, for the demo and benchmarks."""

from __future__ import annotations

import math
import random

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int = 128, layers: int = 4, heads: int = 4, context: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings
        self.context = context
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * layers) if name.endswith("out.weight") else 1))
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


_SUBJECTS = ["the cat", "a small dog", "the old sailor", "my neighbour", "the quick fox", "a tired student",
             "the baker", "an engineer", "the river", "a quiet bird"]
_VERBS = ["sees", "follows", "paints", "finds", "remembers", "builds", "carries", "watches", "greets", "visits"]
_OBJECTS = ["the red boat", "a wooden house", "the morning train", "an empty street", "the tall tree",
            "a bright lamp", "the last letter", "a green field", "the stone bridge", "an open window"]
_ENDINGS = ["today", "at night", "in the rain", "before dinner", "with care", "again", "near the sea",
            "every day", "in silence", "after work"]


def generate_corpus(n_sentences: int = 20000, seed: int = 0) -> str:
    """Sentences from a small grammar with some structure to learn (agreement of clauses,
    punctuation, repeated phrases): the loss falls quickly and visibly in a short run."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_sentences):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}"
        if rng.random() < 0.3:
            s += f", and {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} it too"
        out.append(s[0].upper() + s[1:] + ".")
    return " ".join(out) + "\n"


class CharDataset:
    """Character-level tokens of a text, sampled as random windows with a per-rank generator."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, gen: torch.Generator, batch_size: int, context: int):
        starts = torch.randint(0, len(self.data) - context - 1, (batch_size,), generator=gen)
        x = torch.stack([self.data[s:s + context] for s in starts.tolist()])
        y = torch.stack([self.data[s + 1:s + context + 1] for s in starts.tolist()])
        return x, y


class CharWindows(torch.utils.data.Dataset):
    """Non-overlapping (input, target) windows of a token sequence: a map-style dataset, so a
    DistributedSampler can split epochs over ranks and a checkpoint can record how far an
    epoch got."""

    def __init__(self, tokens: torch.Tensor, context: int):
        self.tokens, self.context = tokens, context

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.context

    def __getitem__(self, i: int):
        s = i * self.context
        return self.tokens[s:s + self.context], self.tokens[s + 1:s + self.context + 1]
