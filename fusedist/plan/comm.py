"""Communication per GPU per optimizer step, and its time.

Ring collectives (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for
clusters of workstations"; Thakur et al. 2005, "Optimization of Collective Communication
Operations in MPICH"): over N ranks an all-reduce of M bytes sends (and receives) 2(N-1)/N·M
bytes per rank, a reduce-scatter or an all-gather (N-1)/N·M each.

Per strategy (ZeRO paper, Section 7: stages 1 and 2 move the data-parallel volume, stage 3
1.5x of it):

* ddp: one all-reduce of the gradients, 2(N-1)/N·Ψ·g.
* zero2: a reduce-scatter of the gradients and an all-gather of the parameters, the same
  volume as DDP (with 16-bit gradients and parameters); with gradient accumulation every
  micro-batch reduce-scatters, as the memory it is planned with holds no full gradients to
  accumulate into (``no_sync()`` would keep them: Note [stage 2 gradients] in
  fusedist/zero/grad_sync.py).
* zero1: the paper's stage 1 is the same; fusedist's stage 1 all-reduces the gradients (its
  DDP does) and then all-gathers the updated parameters: 3(N-1)/N·Ψ (1.5x), ``fusedist``
  convention only.
* zero3: two parameter all-gathers (forward and backward) and one gradient reduce-scatter,
  3(N-1)/N·Ψ; with gradient accumulation every micro-batch gathers again.
* offload: the same network traffic; the gradient shard goes down and the parameter shard
  comes up over PCIe (:func:`pcie_bytes`), at stage 3 for every gather and reduce-scatter.

Expert parallelism (``ep``, :func:`expert_parallel_bytes`): the dense parameters go through
the collectives above over all N ranks, a rank's routed experts (Ψ_e/ep) over the N/ep ranks
that hold the same experts (Megatron-Core's expert-data-parallel group); and every MoE layer
sends its tokens to their experts' ranks and back (:func:`all_to_all_bytes`).
"""

from __future__ import annotations

from .memory import host_grad_bytes, param_bytes


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
        return rs_ag * (grad_accum * g + p)
    if base == "zero3":
        # 1.5x: gather parameters for forward and again for backward, reduce-scatter gradients;
        # the gathers repeat for every micro-batch of an accumulated step.
        return grad_accum * rs_ag * (2 * p + g)
    raise ValueError(f"unknown strategy {strategy!r}")


def expert_parallel_bytes(psi: float, expert_psi: float, ep: int, n: int, strategy: str, precision: str,
                          convention: str = "fusedist", grad_accum: int = 1) -> float:
    """:func:`bytes_per_step` with the routed experts split over ``ep`` ranks: the dense
    parameters over ``N`` ranks, each rank's ``Ψ_e/ep`` over the ``N/ep`` holding the same
    experts; ``ep = 1`` is :func:`bytes_per_step` itself."""
    if ep == 1:
        return bytes_per_step(psi, n, strategy, precision, convention, grad_accum)
    dense = bytes_per_step(psi - expert_psi, n, strategy, precision, convention, grad_accum)
    return dense + bytes_per_step(expert_psi / ep, n // ep, strategy, precision, convention, grad_accum)


def all_to_all_bytes(tokens: int, hidden: int, top_k: int, word: int, ep: int, moe_layers: int,
                     passes: int) -> float:
    """Bytes one GPU sends (and receives) in the expert all-to-alls of one micro-batch.

    Each MoE layer's dispatch sends every one of the rank's ``tokens`` to its ``top_k``
    experts (``tokens · hidden · top_k · word`` bytes of activations) and the combine brings
    them back, once each in forward and once each in backward (their gradients): 4 a layer,
    6 under full recomputation, which runs the forward again (GShard, arXiv:2006.16668: the
    dispatch and combine all-to-alls; Megatron-Core's MoEAlltoAllTokenDispatcher permutes
    each token once per routed expert before its all-to-all, and its token_combine returns
    them the same way). With the
    experts spread evenly over ``ep`` ranks and tokens routed evenly (load imbalance is not
    modelled), ``1/ep`` of the copies go to experts on the sending rank and never leave it,
    as the ring's own slice does: ``(ep-1)/ep`` of the buffer crosses the links. ``passes``:
    the all-to-alls a layer makes per micro-batch."""
    if ep <= 1:
        return 0.0
    return passes * moe_layers * (ep - 1) / ep * tokens * hidden * top_k * word


def all_to_all_passes(recompute: str) -> int:
    """Dispatch and combine in forward and in backward; full recomputation repeats the forward's."""
    return 6 if recompute == "full" else 4


def expert_bandwidth_gbps(ep: int, n: int, gpus_per_node: int, intra: float, inter: float) -> float:
    """The expert group's link: NVLink when its ``ep`` consecutive ranks share a node (the job
    fits in one, or ``ep`` divides the node's GPUs), the network otherwise."""
    return intra if n <= gpus_per_node or gpus_per_node % ep == 0 else inter


def pcie_bytes(psi: float, n: int, strategy: str, precision: str, convention: str = "fusedist",
               grad_accum: int = 1) -> float:
    """Offload only: host <-> GPU bytes per step (gradient shard down, parameter shard up).
    fusedist copies the FP32 gradient shard down; the paper's 16-bit gradients. ZeRO-2
    offload copies it down after every micro-batch's reduce-scatter (Note [offload pipeline]
    in fusedist/zero/offload.py: a shard changed by a later backward is copied again) and the
    updated parameter shard up once. ZeRO-3 offload (``CPUOffloadPolicy``) keeps no shard on
    the GPU: every gather copies the parameter shard up first, twice a micro-batch as
    :func:`bytes_per_step` gathers, and every micro-batch's reduce-scatter copies its gradient
    shard down (``_gather_source`` in fusedist/fsdp/unit.py, ``finish`` in fusedist/fsdp/grads.py)."""
    if not strategy.endswith("_offload"):
        return 0.0
    down = host_grad_bytes(strategy, precision, convention) * psi / n
    up = param_bytes(precision) * psi / n
    if strategy == "zero3_offload":
        return grad_accum * (down + 2 * up)
    return grad_accum * down + up


def bandwidth_gbps(n: int, gpus_per_node: int, intra: float, inter: float) -> float:
    """The ring's slowest link: NVLink within one node, the network once the ring spans
    nodes (every inter-node hop carries the full per-rank volume)."""
    return intra if n <= gpus_per_node else inter


def seconds(nbytes: float, gbps: float) -> float:
    return nbytes / (gbps * 1e9) if nbytes else 0.0
