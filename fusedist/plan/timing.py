"""Compute and step time.

Training FLOPs per token ≈ 6Ψ (2 forward + 4 backward multiply-adds per parameter;
Kaplan et al. 2020, "Scaling Laws for Neural Language Models", Section 2.1; Narayanan et al.
2021, "Efficient Large-Scale Language Model Training on GPU Clusters", Section 5.1) and 8Ψ
with full activation recomputation (one more forward). Selective recomputation recomputes
only the attention core: counted as 6Ψ (Korthikanti et al. 2022 measure ~2-4% extra).
The attention score FLOPs (∝ s²) are left out, as in the 6Ψ rule.

    compute_s = (6 or 8)·Ψ·tokens / (N · peak · MFU)

``step_s`` overlaps communication with compute (``max``), as fusedist's bucketed backward
does; ``step_s_no_overlap`` adds them. Offload adds the PCIe copies to the communication
side; the host optimizer update itself is not modelled.
"""

from __future__ import annotations

DEFAULT_MFU = 0.40


def flops_per_token(psi: float, recompute: str) -> float:
    return (8.0 if recompute == "full" else 6.0) * psi


def compute_seconds(psi: float, tokens: float, n: int, peak_flops: float, mfu: float, recompute: str) -> float:
    return flops_per_token(psi, recompute) * tokens / (n * peak_flops * mfu)


def step_times(compute_s: float, comm_s: float, pcie_s: float, tokens: float) -> dict:
    other = comm_s + pcie_s
    step = max(compute_s, other)
    serial = compute_s + other
    return {"compute_s": compute_s, "step_s": step, "step_s_no_overlap": serial,
            "tokens_per_s": tokens / step if step > 0 else float("inf")}
