"""Suggestions: the cheapest strategy that fits, a (dp, tp, pp) layout when none does,
gradient accumulation for a target global batch, and a learning rate scaled from a
reference batch."""

from __future__ import annotations

import math
from typing import Callable, Optional

from .memory import STRATEGIES

IN_GPU = ("ddp", "zero1", "zero2", "zero3")


def runs(strategy: str, optimizer: str) -> bool:
    """Whether fusedist trains with ``strategy`` and ``optimizer``: ZeRO-2 offload
    (``ZeroRedundancyOptimizer(offload="cpu")``) steps Adam/AdamW only, with its C++ CPU Adam
    (``check_offload_config`` in fusedist/zero/offload.py refuses SGD)."""
    return not (strategy == "zero2_offload" and optimizer != "adamw")


def cheapest(memory: dict, time: dict, optimizer: str = "adamw") -> Optional[str]:
    """The fitting strategy with the shortest step (communication not overlapped, so extra
    traffic counts even where compute would hide it); ties go to the simpler strategy
    (order ddp, zero1, zero2, zero3, zero2_offload, zero3_offload). Only strategies that
    :func:`runs` with ``optimizer``."""
    fitting = [s for s in STRATEGIES if memory[s]["fits"] and runs(s, optimizer)]
    if not fitting:
        return None
    return min(fitting, key=lambda s: (round(time[s]["step_s_no_overlap"], 9), STRATEGIES.index(s)))


def grad_accum(global_batch: Optional[int], micro_batch: int, dp: int) -> tuple[int, int]:
    """(accumulation steps, the global batch they give): ``ceil(B / (b · dp))`` micro-batches
    per rank per step; the global batch is rounded up to a multiple of ``b · dp``."""
    per_step = micro_batch * dp
    if global_batch is None:
        return 1, per_step
    steps = max(1, math.ceil(global_batch / per_step))
    return steps, steps * per_step


def expert_parallel_sizes(experts: Optional[int], ep: int) -> tuple:
    """The ``ep`` values a layout may use: the job's first, then every divisor of the expert
    count (each rank holds whole experts); only the job's for a dense model."""
    if not experts:
        return (ep,)
    return (ep, *(e for e in range(1, experts + 1) if experts % e == 0 and e != ep))


def layout(n: int, gpus_per_node: int, heads: Optional[int], layers: Optional[int],
           total_of: Callable[[str, int, int, int, int], tuple[float, bool]],
           kv_heads: Optional[int] = None, eps: tuple = (1,),
           refusal: Optional[Callable[[int, int], Optional[str]]] = None) -> Optional[dict]:
    """Smallest model-parallel layout that fits: tensor parallelism within a node (``tp``
    a power of two up to the node's GPUs, dividing the heads and the key/value heads: each
    rank holds whole query groups, Megatron-LM's requirement for grouped-query attention,
    so multi-query attention gets none), pipeline stages dividing the
    layers, data parallelism over the rest (``dp = N / (tp · pp)``) and, for a mixture of
    experts, the routed experts over ``ep`` of the ``dp`` ranks (``eps``, the job's first),
    with the least model parallelism (tp·pp), then the fewest stages, then the job's ``ep``
    or else the smallest, then the simplest ZeRO stage. Expert parallelism comes before
    tensor parallelism: it leaves the dense layers whole and costs an all-to-all of the
    tokens instead of the activations' all-reduces. ``total_of(strategy, dp, tp, pp, ep)``
    gives (bytes per GPU, fits); ``refusal(dp, pp)`` why the pipeline schedule cannot run a
    layout (None: it can), which is then skipped."""
    if heads is None or layers is None:
        return None
    best = None
    for tp, pp in _model_parallel(n, gpus_per_node, heads, layers, kv_heads):
        dp = n // (tp * pp)
        if refusal is not None and refusal(dp, pp):
            continue
        for rank, ep in enumerate(eps):
            if dp % ep:
                continue
            for strategy in IN_GPU:
                total, fits = total_of(strategy, dp, tp, pp, ep)
                if not fits:
                    continue
                key = (tp * pp, pp, rank > 0, ep, IN_GPU.index(strategy))
                if best is None or key < best[0]:
                    best = (key, {"dp": dp, "tp": tp, "pp": pp, "ep": ep, "strategy": strategy,
                                  "total_bytes": int(total)})
                break  # the simplest stage that fits this (tp, pp, ep)
    return best[1] if best else None


def _model_parallel(n: int, gpus_per_node: int, heads: int, layers: int, kv_heads: Optional[int]):
    """(tp, pp) pairs: tp a power of two within a node dividing the heads and key/value heads,
    pp dividing the layers, tp·pp dividing N."""
    tp = 1
    while tp <= gpus_per_node and tp <= n:
        if heads % tp == 0 and (kv_heads or heads) % tp == 0:
            for pp in range(1, layers + 1):
                if layers % pp == 0 and n % (tp * pp) == 0:
                    yield tp, pp
        tp *= 2


def learning_rate(ref_lr: Optional[float], ref_batch: Optional[int], global_batch: int) -> Optional[dict]:
    """Scale a learning rate tuned at ``ref_batch`` to ``global_batch``.

    * linear (Goyal et al. 2017, "Accurate, Large Minibatch SGD", Section 2.1): lr·B/B_ref,
      with a gradual warm-up (they use 5 epochs); it breaks down past some batch size.
    * square root (Hoffer et al. 2017; Malladi et al. 2022 for Adam): lr·sqrt(B/B_ref), the
      usual starting point for Adam-type optimizers.
    Either is a starting point for a sweep, not a guarantee."""
    if ref_lr is None or ref_batch is None:
        return None
    ratio = global_batch / ref_batch
    return {
        "linear": ref_lr * ratio,
        "sqrt": ref_lr * math.sqrt(ratio),
        "ref_lr": ref_lr,
        "ref_batch": ref_batch,
        "note": ("linear rule (SGD; Goyal et al. 2017) needs a gradual warm-up and fails at very large "
                 "batches; square-root rule is the usual start for Adam; sweep around both"),
    }
