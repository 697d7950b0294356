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
DualPipe) is not modelled. Offload adds the PCIe copies to the communication side, and the
host optimizer update to both: it runs in ``step()``, after backward, on the node's CPUs,
whose memory bandwidth bounds it (:func:`host_update_bytes`; ZeRO-Offload's "delayed
parameter update", which overlaps it with the next step, is not what fusedist does).
"""

from __future__ import annotations

from .memory import host_grad_bytes, optimizer_k, param_bytes

DEFAULT_MFU = 0.40


def host_update_bytes(psi: float, n: int, strategy: str, precision: str, optimizer: str = "adamw",
                      convention: str = "fusedist") -> float:
    """Bytes of host memory one GPU's offloaded optimizer update reads and writes per step:
    its ``Ψ/N`` parameters' gradient read, optimizer state (K bytes: masters, moments) read
    and written, and the updated 16-bit parameters written for the copy up. A CPU Adam does a
    few flops a byte, so memory bandwidth bounds it (fusedist's C++ Adam runs at the speed of
    a copy: benchmarks/bench_cpu_adam.py). fusedist's ZeRO-2 offload reads its FP32 gradient
    staging; fp32 parameters are their host masters, written as part of K. 0 without offload."""
    if not strategy.endswith("_offload"):
        return 0.0
    p = param_bytes(precision)
    k = optimizer_k(precision, optimizer, strategy, convention)
    written = p if (p < 4 or convention != "fusedist") else 0
    return (host_grad_bytes(strategy, precision, convention) + 2 * k + written) * psi / n


def flops_per_token(psi: float, recompute: str, attention_fwd: float = 0.0) -> float:
    """``attention_fwd``: the attention scores' forward FLOPs per token, 4·L·s·d_q
    (:func:`fusedist.plan.model.attention_flops_per_token`); backward is twice that."""
    weights = (8.0 if recompute == "full" else 6.0) * psi
    attention = (4.0 if recompute in ("full", "selective") else 3.0) * attention_fwd
    return weights + attention


def compute_seconds(psi: float, tokens: float, n: int, peak_flops: float, mfu: float, recompute: str,
                    attention_fwd: float = 0.0) -> float:
    return flops_per_token(psi, recompute, attention_fwd) * tokens / (n * peak_flops * mfu)


def step_times(compute_s: float, comm_s: float, pcie_s: float, tokens: float, blocking_s: float = 0.0,
               host_update_s: float = 0.0) -> dict:
    """``blocking_s``: communication on the compute's path (the expert all-to-alls: an MoE
    layer's experts wait for their tokens, the next layer for their outputs), added to the
    step rather than overlapped; ``host_update_s``: the offloaded optimizer update, after
    backward, added too."""
    other = comm_s + pcie_s
    step = max(compute_s, other) + blocking_s + host_update_s
    serial = compute_s + other + blocking_s + host_update_s
    return {"compute_s": compute_s, "step_s": step, "step_s_no_overlap": serial, "host_update_s": host_update_s,
            "tokens_per_s": tokens / step if step > 0 else float("inf")}
