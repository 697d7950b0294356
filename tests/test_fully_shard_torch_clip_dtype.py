"""torch's clip_grad_norm_ in a Hugging Face-style loop on a bf16 fully_shard model, beside
FSDP2's: the norm is returned, and the coefficient applied, in the gradients' dtype
(Note [torch's clip on sharded gradients] in fusedist/optim/torch_clip.py)."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fusedist.testing import run_distributed

VOCAB, SEQ, DIM = 32, 8, 16


class TinyGPT(nn.Module):
    """Token and position embeddings, pre-norm MLP blocks, a final LayerNorm and an output head
    tied to the token embedding (GPT-2's layout, dropout off)."""

    def __init__(self, blocks: int = 2):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(SEQ, DIM)
        self.h = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
            for _ in range(blocks))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = x + block(x)
        return self.lm_head(self.ln_f(x))


def _bf16_clip_worker(rank, world, max_norm):
    """One bf16 step of each side, clipped with torch's clip: (norm dtype, norm, and whether the
    pieces' clipped gradients are the unclipped ones times torch's coefficient) per side."""
    import fusedist
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    g = torch.Generator().manual_seed(100 + rank)
    idx, tgt = torch.randint(0, VOCAB, (3, SEQ), generator=g), torch.randint(0, VOCAB, (3, SEQ), generator=g)
    out = {}
    for side, shard in (("torch", torch_fully_shard), ("fusedist", fusedist.fully_shard)):
        torch.manual_seed(0)
        model = TinyGPT().to(torch.bfloat16)  # a model loaded in bf16 (torch_dtype=torch.bfloat16)
        for block in model.h:
            shard(block)
        shard(model)
        loss = nn.functional.cross_entropy(model(idx).float().reshape(-1, VOCAB), tgt.reshape(-1))
        loss.backward()
        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
        before = [gr.clone() for gr in local]
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        # torch's arithmetic: the coefficient in the norm's dtype, multiplied into each gradient
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        clipped_as_torch = all(torch.equal(gr, b * coef) for gr, b in zip(local, before))
        out[side] = (norm.dtype, float(norm), clipped_as_torch)
    return out


def test_clip_on_a_bf16_fully_shard_model_returns_and_applies_the_norm_in_bf16_as_fsdp2():
    """A model held in bf16 and sharded with fully_shard (a fine-tune's ``torch_dtype=bfloat16``),
    clipped with ``torch.nn.utils.clip_grad_norm_``: FSDP2 returns the global norm in bf16, the
    gradients' dtype, and scales them by a bf16 coefficient. fusedist returned an fp32 norm and
    scaled by an fp32 coefficient: another dtype in the logs and a clipped gradient an ulp away
    from FSDP2's on every clipped step."""
    for result in run_distributed(_bf16_clip_worker, 2, 0.05, timeout=120):
        (t_dtype, t_norm, t_ok), (f_dtype, f_norm, f_ok) = result["torch"], result["fusedist"]
        assert t_ok and t_dtype == torch.bfloat16  # (what torch does, as this test reads it)
        assert f_dtype == t_dtype, f"norm dtype {f_dtype}, FSDP2's {t_dtype}"
        assert abs(f_norm - t_norm) <= 2 ** -7 * t_norm, (f_norm, t_norm)  # bf16 sums in another order
        assert f_ok, "the clipped gradients are not the unclipped ones times the bf16 coefficient"
