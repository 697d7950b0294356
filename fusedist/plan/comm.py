"""Communication per GPU per optimizer step, and its time.

Ring collectives (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for
clusters of workstations"; Thakur et al. 2005, "Optimization of Collective Communication
Operations in MPICH"): over N ranks an all-reduce of M bytes sends (and receives) 2(N-1)/N·M
bytes per rank, a reduce-scatter or an all-gather (N-1)/N·M each.

Per strategy (ZeRO paper, Section 7: stages 1 and 2 move the data-parallel volume, stage 3
1.5x of it):

* ddp: one all-reduce of the gradients, 2(N-1)/N·Ψ·g.
* zero2: a reduce-scatter of the gradients and an all-gather of the parameters, the same
  volume as DDP (with 16-bit gradients and parameters).
* zero1: the paper's stage 1 is the same; fusedist's stage 1 all-reduces the gradients (its
  DDP does) and then all-gathers the updated parameters: 3(N-1)/N·Ψ (1.5x), ``fusedist``
  convention only.
* zero3: two parameter all-gathers (forward and backward) and one gradient reduce-scatter,
  3(N-1)/N·Ψ; with gradient accumulation every micro-batch gathers again.
* offload: the same network traffic; the gradient shard goes down and the parameter shard
  comes up over PCIe (:func:`pcie_bytes`).
"""

from __future__ import annotations

from .memory import param_bytes


def ring_factor(op: str, n: int) -> float:
    """Bytes one rank sends per byte of the collective's full buffer (ring algorithms)."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    return (n - 1) / n  # reduce_scatter, all_gather (of the full buffer); broadcast, pipelined


def bytes_per_step(psi: float, n: int, strategy: str, precision: str, convention: str = "fusedist",
                   grad_accum: int = 1) -> float:
    """Bytes each GPU sends per optimizer step (received: the same)."""
    p = g = param_bytes(precision)
    base = strategy.replace("_offload", "")
    rs_ag = ring_factor("reduce_scatter", n) * psi
    if base == "ddp":
        return ring_factor("all_reduce", n) * psi * g
    if base == "zero1":
        if convention == "fusedist":
            return ring_factor("all_reduce", n) * psi * g + rs_ag * p
        return rs_ag * (g + p)
    if base == "zero2":
        return rs_ag * (g + p)
    if base == "zero3":
        # 1.5x: gather parameters for forward and again for backward, reduce-scatter gradients;
        # the gathers repeat for every micro-batch of an accumulated step.
        return grad_accum * rs_ag * (2 * p + g)
    raise ValueError(f"unknown strategy {strategy!r}")


def pcie_bytes(psi: float, n: int, strategy: str, precision: str, convention: str = "fusedist") -> float:
    """Offload only: host <-> GPU bytes per step (gradient shard down, parameter shard up).
    fusedist copies the FP32 gradient shard down; the paper's 16-bit gradients."""
    if not strategy.endswith("_offload"):
        return 0.0
    p = g = param_bytes(precision)
    down = (4 if convention == "fusedist" and strategy.startswith("zero2") else g) * psi / n
    return down + p * psi / n


def bandwidth_gbps(n: int, gpus_per_node: int, intra: float, inter: float) -> float:
    """The ring's slowest link: NVLink within one node, the network once the ring spans
    nodes (every inter-node hop carries the full per-rank volume)."""
    return intra if n <= gpus_per_node else inter


def seconds(nbytes: float, gbps: float) -> float:
    return nbytes / (gbps * 1e9) if nbytes else 0.0
