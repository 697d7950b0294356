"""Compute and step time.

Training FLOPs per token: 6Ψ for the weights (2 forward + 4 backward per parameter in a matrix
product, so Ψ leaves out the embedding lookups: Note [lookups are not products] in model.py;
Kaplan et al. 2020, "Scaling Laws for Neural Language Models", Section 2.1) plus the
attention scores, which have no parameters: QKᵀ and the product with V are 2·s·d_q FLOPs
each per token and layer forward (d_q = heads · head_dim), 12·L·s·d_q for training
(Chowdhery et al. 2022, "PaLM", Appendix B: 6N + 12·L·H·Q·T; Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters", Section 5.1, whose
96·B·s·l·h²·(1 + s/6h + ...) is the same with full recomputation). Counted over the full
s x s score matrix, as both papers do, causal masking or not; a block with a sliding window
is charged min(s, w) keys a query by the same convention (Note [sliding windows] in
model.py). For a 7B Llama at s = 4096 the attention adds 16% to 6Ψ, at s = 32768 more than
6Ψ itself.

Of a mixture of experts, Ψ here is the parameters a token goes through: the router, its
top-k experts and the shared one (Note [active parameters] in model.py); memory and
communication count them all.

Full recomputation runs the forward again: 8Ψ + 16·L·s·d_q. Selective recomputation reruns
the attention core only: 6Ψ + 16·L·s·d_q. A model given by --params alone has no shape:
6Ψ (8Ψ), the attention left out.

    compute_s = flops_per_token · tokens / (N · peak · MFU)

``step_s`` overlaps communication with compute (``max``), as fusedist's bucketed backward
does; ``step_s_no_overlap`` adds them. The expert all-to-alls of a mixture of experts under
expert parallelism are on the critical path (no layer can go on before its tokens are back)
and add to both; overlapping them with another micro-batch's compute (DeepSeek-V3's
DualPipe) is not modelled. Offload adds the PCIe copies to the communication
side; the host optimizer update itself is not modelled.
"""

from __future__ import annotations

DEFAULT_MFU = 0.40


def flops_per_token(psi: float, recompute: str, attention_fwd: float = 0.0) -> float:
    """``attention_fwd``: the attention scores' forward FLOPs per token, 4·L·s·d_q
    (:func:`fusedist.plan.model.attention_flops_per_token`); backward is twice that."""
    weights = (8.0 if recompute == "full" else 6.0) * psi
    attention = (4.0 if recompute in ("full", "selective") else 3.0) * attention_fwd
    return weights + attention


def compute_seconds(psi: float, tokens: float, n: int, peak_flops: float, mfu: float, recompute: str,
                    attention_fwd: float = 0.0) -> float:
    return flops_per_token(psi, recompute, attention_fwd) * tokens / (n * peak_flops * mfu)


def step_times(compute_s: float, comm_s: float, pcie_s: float, tokens: float, blocking_s: float = 0.0) -> dict:
    """``blocking_s``: communication on the compute's path (the expert all-to-alls: an MoE
    layer's experts wait for their tokens, the next layer for their outputs), added to the
    step rather than overlapped."""
    other = comm_s + pcie_s
    step = max(compute_s, other) + blocking_s
    serial = compute_s + other + blocking_s
    return {"compute_s": compute_s, "step_s": step, "step_s_no_overlap": serial,
            "tokens_per_s": tokens / step if step > 0 else float("inf")}
