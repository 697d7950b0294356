"""Memory per GPU: model states, activations, temporary buffers.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", arXiv:1910.02054, Section 3.1 and Figure 1):
mixed-precision Adam holds 2Ψ bytes of 16-bit parameters, 2Ψ of 16-bit gradients and KΨ of
optimizer state, K = 12 (FP32 master weights, momentum, variance). Per GPU, with N
data-parallel ranks:

    DDP     (2 + 2 + K)·Ψ          ZeRO-1  4Ψ + K·Ψ/N
    ZeRO-2  2Ψ + (2 + K)·Ψ/N       ZeRO-3  (2 + 2 + K)·Ψ/N

ZeRO-Offload (Ren et al. 2021, arXiv:2101.06840, Section 4) keeps the 16-bit parameters on
the GPU and moves the gradient shard and the K term to host memory, where the CPU steps them;
at stage 3 the parameter shard goes there too (ZeRO-Infinity's CPU offload, arXiv:2104.07857),
so the GPU keeps no model states between steps. Host memory is reported as ``host_bytes`` and
must fit (Note [host memory fits too]).
fp32 training replaces the 2s by 4s and drops the master copy (K = 8 for Adam); SGD with
momentum keeps one state instead of two (K = 8 mixed, 4 in fp32).

Two conventions (``--convention``):

* ``paper``: exactly the formulas above.
* ``fusedist`` (default): what fusedist's DDP and ZeroRedundancyOptimizer allocate, which
  ``--measure`` checks. The differences:
  - ZeRO keeps an FP32 gradient shard (4Ψ/N bytes): stage 2 reduce-scatters into it, and
    stage 1 with 16-bit parameters copies its slice of the averaged gradient there (with fp32
    parameters stage 1 steps with that slice where DDP left it). So ZeRO-1 is ``(p+g)Ψ +
    (K+4)Ψ/N`` (fp32: ``(p+g)Ψ + KΨ/N``) and ZeRO-2 ``pΨ + (K+4)Ψ/N`` (the paper's ZeRO-2
    has gΨ/N).
  - ZeRO's masters of fp32 parameters are the parameters themselves (K = 8 for Adam, as
    for DDP); only ZeRO-Offload keeps FP32 master copies (in host memory) for fp32
    parameters too, so K = 12 for Adam (8 for SGD) there at every precision.
  - ZeRO-2 offload keeps the FP32 gradient shard on the device and, on the host, an FP32
    gradient staging shard and (16-bit parameters) a 16-bit parameter staging shard.
  - ZeRO-3 offload is ``fully_shard(..., offload_policy=CPUOffloadPolicy())``: parameter
    shard, gradient shard and optimizer state all in host memory, as FSDP2's.
  - Each gradient bucket is padded to a multiple of N·16 elements (shard alignment): at
    most N·16 elements per bucket (one bucket per 25 MiB), not modelled (< 0.01% for any
    model worth planning).
  - ZeRO-3 is ``fusedist.fully_shard``: the paper's (p + g + K)·Ψ/N, with the gradient
    shard in the parameters' dtype (the default reduce dtype) and K as for DDP, because
    the optimizer is any optimizer stepping the rank's pieces like ordinary parameters:
    an FP32 master only for 16-bit parameters (K = 12 mixed, 8 in fp32 for Adam).
    fully_shard pads each unit's flat buffer (equal shards, cuts between rows): below one
    row per shard boundary plus the tail, not modelled; ``--measure`` reads it off the
    run and adds it to the prediction it compares with.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
CONVENTIONS = ("fusedist", "paper")
MiB = 1 << 20


def param_bytes(precision: str) -> int:
    """Bytes of one parameter (and one gradient) in the model's precision."""
    return 4 if precision == "fp32" else 2


def optimizer_k(precision: str, optimizer: str, strategy: str = "ddp", convention: str = "paper") -> int:
    """K: optimizer-state bytes per parameter (ZeRO paper, Section 3.1; K = 12 for
    mixed-precision Adam: FP32 master 4 + momentum 4 + variance 4)."""
    states = 8 if optimizer == "adamw" else 4  # Adam: momentum + variance; SGD: momentum
    master = 4
    # fp32 parameters are their own master; fusedist's ZeRO-Offload keeps a host copy anyway
    # (Note [shards aliasing the parameters and gradients] in fusedist/zero/shard_store.py)
    keeps_master = convention == "fusedist" and strategy == "zero2_offload"
    if precision == "fp32" and not keeps_master:
        master = 0
    return states + master


def host_grad_bytes(strategy: str, precision: str, convention: str = "fusedist") -> int:
    """Bytes of one gradient element an offload strategy hands to the host: fusedist's ZeRO-2
    offload stages its FP32 gradient shard there, the others send the gradients' own dtype."""
    return 4 if convention == "fusedist" and strategy == "zero2_offload" else param_bytes(precision)


@dataclasses.dataclass
class ModelStates:
    device: float
    host: float
    terms: dict  # name -> bytes per GPU (device) or "host:<name>"


def held_params(psi: float, expert_psi: float, ep: int) -> float:
    """Parameters one rank holds whole: the dense ones and 1/ep of the routed experts.

    Expert parallelism (Lepikhin et al. 2020, GShard, arXiv:2006.16668; Rajbhandari et al.
    2022, DeepSpeed-MoE, arXiv:2201.05596; Megatron-Core's expert model parallel group) puts
    each MoE layer's experts on ``ep`` ranks of the data-parallel group, ``experts / ep``
    each; the dense parameters stay replicated over all ``N``. Activations do not change on
    average: a rank's experts receive ``tokens · top_k`` token copies from the group, as many
    as its own tokens send out, which the activation count already holds (each routed
    expert's copy of the token); load imbalance between experts is not modelled."""
    return psi - expert_psi + expert_psi / ep


def step_counts(strategy: str, precision: str, optimizer: str, tensors: Optional[int]) -> dict:
    """The optimizer's step counts, as ``--measure``'s optimizers keep them (Note [step counts]):
    ``{"steps": bytes}`` on the device or ``{"host:steps": bytes}``; none without the tensors."""
    fused = precision != "fp32" and strategy in ("ddp", "zero3", "zero3_offload")  # fusedist's Fused* optimizer
    if not tensors or not (optimizer == "adamw" or fused):  # torch's SGD keeps no count
        return {}
    on_device = fused and strategy != "zero3_offload"  # (the offloaded pieces live in host memory)
    return {"steps" if on_device else "host:steps": 4 * tensors}


# Note [step counts]
# ~~~~~~~~~~~~~~~~~~
# torch's Adam/AdamW keep a step count per parameter they step: a 0-dim float32 tensor (float64
# under a float64 default dtype), on the CPU unless the optimizer is ``fused`` or ``capturable``,
# which keep it on the parameter's device; fusedist's FusedAdamW and FusedSGD keep one fp32
# count on the parameter's device. Under ``--convention fusedist`` they are counted as
# ``--measure`` trains: 16-bit DDP and ZeRO-3 step with FusedAdamW / FusedSGD (a count on the
# device a tensor: every parameter, every piece), fp32 with torch's AdamW (in host memory) or
# SGD (none), and ZeRO-1/2's inner torch AdamW steps one flat piece per gradient bucket (in
# host memory) and param group run: with a no-weight-decay group (``--param-groups no-decay``)
# each bucket's slice is cut wherever the group changes, a piece more per norm or bias between
# two matrices, counted on the busiest rank (:func:`zero_pieces`). 4 bytes a tensor, a few KB
# for any model: counted so that the figures are what the optimizers allocate, and where
# (device or host), as ``--measure`` reads them.


def model_states(psi: float, n: int, strategy: str, precision: str, optimizer: str = "adamw",
                 convention: str = "fusedist", held: Optional[float] = None,
                 step_tensors: Optional[int] = None) -> ModelStates:
    """Model-state bytes per GPU for ``strategy`` (see the module docstring). ``held``: the
    parameters a rank holds whole under expert parallelism (:func:`held_params`; default Ψ).
    What ZeRO shards stays ``Ψ/N`` whatever ``ep``: the expert states (Ψ_e/ep on a rank) are
    sharded over the ``N/ep`` ranks holding the same experts, ``Ψ_e/N``, the dense ones over
    all ``N`` -- Megatron-Core's DistributedDataParallel keeps the experts' gradients in
    their own buffers (``expert_parallel_buffers``) reduced over the expert-data-parallel
    group, and its distributed optimizer shards each buffer over the group that reduces it.
    ``step_tensors``: the tensors the optimizer steps on a rank, each with a step count under
    the fusedist convention (Note [step counts]); None: not counted."""
    p = g = param_bytes(precision)
    k = optimizer_k(precision, optimizer, strategy, convention)
    fused = convention == "fusedist"
    shard = psi / n
    whole = psi if held is None else held  # what each rank holds unsharded
    if strategy == "ddp":
        # (2 + 2 + K)Ψ -- ZeRO paper, Figure 1 "Baseline"
        terms = {"params": p * whole, "grads": g * whole, "optimizer": k * whole}
    elif strategy == "zero1":
        # 4Ψ + KΨ/N -- ZeRO paper, Figure 1 "Pos"
        terms = {"params": p * whole, "grads": g * whole, "optimizer": k * shard}
        if fused and p < 4:
            terms["grad_shard"] = 4 * shard  # fusedist: FP32 gradient shard (fp32: DDP's buckets)
    elif strategy == "zero2":
        # 2Ψ + (2 + K)Ψ/N -- ZeRO paper, Figure 1 "Pos+g"
        terms = {"params": p * whole, "optimizer": k * shard}
        terms["grad_shard"] = (4 if fused else g) * shard
    elif strategy == "zero3":
        # (2 + 2 + K)Ψ/N -- ZeRO paper, Figure 1 "Pos+g+p"
        terms = {"params": p * shard, "grad_shard": g * shard, "optimizer": k * shard}
    elif strategy == "zero2_offload":
        # ZeRO-Offload: the gradient shard and the K term on the host (fusedist: the gradient
        # shard stays on the device, with staging copies on the host)
        terms = {"params": p * whole, "host:optimizer": k * shard}
        host_grad = host_grad_bytes(strategy, precision, convention) * shard
        if fused:
            terms["grad_shard"] = 4 * shard
            terms["host:grad_staging"] = host_grad
            if p < 4:
                terms["host:param_staging"] = p * shard
        else:
            terms["host:grad_shard"] = host_grad
    elif strategy == "zero3_offload":
        # ZeRO-Infinity's CPU offload, FSDP2's CPUOffloadPolicy: every shard on the host
        terms = {"host:params": p * shard, "host:grad_shard": host_grad_bytes(strategy, precision, convention) * shard,
                 "host:optimizer": k * shard}
    else:
        raise ValueError(f"unknown strategy {strategy!r}")
    if fused:  # Note [step counts]
        terms.update(step_counts(strategy, precision, optimizer, step_tensors))
    device = sum(v for name, v in terms.items() if not name.startswith("host:"))
    host = sum(v for name, v in terms.items() if name.startswith("host:"))
    return ModelStates(device, host, terms)


def temp_bytes(strategy: str, psi: float, precision: str, unit_params, bucket_cap_mb: float,
               scratch_bytes: float, root_params: float = 0.0, n: int = 1, unit_outputs=None,
               in_flight: int = 2, tensors=None) -> float:
    """Temporary buffers per GPU besides model states and activations.

    * DDP, ZeRO-1: none for gradients (the flat gradient buffers are the model states'
      gradients; fusedist and torch DDP make ``p.grad`` views of them).
    * ZeRO-2: the gradient buckets between "first gradient arrived" and "reduce-scatter
      stored" (fusedist's ``comm_stats()["peak_grad_bytes"]``): the largest three consecutive
      buckets DDP builds from ``tensors`` (every parameter tensor's elements in registration
      order, :func:`fusedist.plan.param_tensors.param_tensors`) -- the two reduce-scatters fusedist
      lets be in flight (``max_buckets_in_flight``, Note [buckets in flight] in
      fusedist/ddp/in_flight.py) and the bucket whose gradients are arriving, which a backward
      that outruns its collectives (a device-bound GPU; gloo on a CPU) holds at once; two are
      held when each reduce-scatter lands before the bucket after next fills. A bucket closes
      once it reaches the cap, the tensor that crosses it included, so a 128k-token embedding
      alone is a 1 GB bucket of bf16 gradients, 40 caps of 25 MiB. The run is what the buckets
      hold, not ``k (cap + largest tensor)``, which counted an untied model's embedding twice
      though it and the output layer fill the last and the first bucket, never neighbours
      (1.9x on a small untied llama). Under the default cap (25) the first bucket is DDP's
      1 MiB, or the cap when it is given explicitly: the larger run of the two layouts.
      Without a shape (``--params``) the tensors are unknown and three caps stand in.
    * ZeRO-3 (``fully_shard``): the gathered units -- two consecutive blocks (one in use, the
      next prefetched, in forward and in backward; a unit = one transformer block, ZeRO paper
      Section 5.3) and the root unit (embeddings, final norm, output layer: ``root_params``),
      which stays gathered through backward in fusedist's ``fully_shard`` and in FSDP2 alike
      because the input embedding's gradient arrives last -- plus the gradients on their way
      through the reduce-scatter: each unit's gradients are copied into a flat buffer of the
      whole unit, reduce-scattered into a 1/N output, and two such reductions may be in
      flight (``MAX_IN_FLIGHT`` in fusedist/fsdp/grads.py), consecutive in backward's order
      (the last block first, block 0, then the root): ``(1 + 1/N)`` times the largest such
      pair, the root and block 0 for any model with an embedding larger than a block. No
      gradient bucket cap applies there: the Llama-3-8B root alone is 2.1 GB of bf16
      gradients. Both are ``memory_stats()``' peaks (``peak_gathered_bytes``,
      ``peak_scratch_bytes``), which ``--measure`` compares with these terms; their sum bounds
      the two at once. ``unit_params`` is the blocks' sizes in order (a mixture of experts
      whose dense and MoE blocks alternate never gathers two MoE blocks together), or one
      size for blocks all alike; ``unit_outputs`` their reduce-scatter outputs (default
      ``1/N`` of each; under expert parallelism a block's experts are reduced over N/ep
      ranks). Without a shape (``--params``) the units are unknown and two buckets stand in.
      Whether the second reduction is still in flight when the next is issued depends on
      when the first lands (a landed one frees its buffers at once): ``in_flight=1`` gives
      the least the peak can be, with only the largest reduction in flight.
    * all: ``scratch_bytes`` (cuBLAS workspace, communicator buffers, allocator slack).
    """
    g = param_bytes(precision)
    extra = 0.0
    if strategy.startswith("zero2"):
        held = (zero2_buckets_held(tuple(tensors), bucket_cap_mb, g, n) if tensors
                else ZERO2_BUCKETS_HELD * bucket_cap_mb * MiB)
        extra = min(held, g * psi)
    elif strategy.startswith("zero3"):
        if unit_params or root_params:
            blocks = list(unit_params) if isinstance(unit_params, (list, tuple)) else [unit_params] * 2
            outputs = list(unit_outputs) if unit_outputs is not None else [b / n for b in blocks]
            extra = ((_largest_pair(blocks) + root_params) * g
                     + _reducing(blocks, outputs, root_params, n, in_flight) * g)
        else:
            extra = min(2 * bucket_cap_mb * MiB, g * psi)  # the units unknown: two buckets stand in
    return extra + scratch_bytes


def _largest_pair(sizes: list) -> float:
    """The most two consecutive units hold together (one unit alone if there is one)."""
    return _largest_run(sizes, 2)


def _largest_run(sizes: list, k: int) -> float:
    """The most ``k`` consecutive sizes add up to (all of them if there are fewer)."""
    if len(sizes) <= k:
        return sum(sizes)
    return max(sum(sizes[i:i + k]) for i in range(len(sizes) - k + 1))


def _reducing(blocks: list, outputs: list, root: float, n: int, in_flight: int = 2) -> float:
    """Elements of the reductions in flight at once (two, or one: ``temp_bytes``), flat buffers
    and outputs: units in backward's order (the blocks last to first, then the root)."""
    order = [b + o for b, o in zip(blocks, outputs)][::-1] + [root * (1 + 1 / n)]
    return _largest_pair(order) if in_flight == 2 else max(order)


DEFAULT_BUCKET_CAP_MB = 25.0
FIRST_BUCKET_BYTES = MiB  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES, fusedist's too, under the default cap
SHARD_ALIGN = 16  # elements: each bucket is padded to a multiple of N of them (fusedist/ddp/layout.py)


#: ZeRO-2's gradient buckets held at once: ``max_buckets_in_flight`` (2, the default) and the
#: one filling (``temp_bytes``).
ZERO2_BUCKETS_HELD = 3


@functools.lru_cache(maxsize=64)
def zero2_buckets_held(tensors: tuple, bucket_cap_mb: float, g: int, n: int) -> float:
    """Bytes of the largest ``ZERO2_BUCKETS_HELD`` consecutive gradient buckets DDP builds of
    ``tensors`` (elements, registration order) at ``g`` bytes an element over ``n`` ranks (``temp_bytes``). Cached: the
    layout search asks for the same layout once per strategy and layout."""
    layouts = [(bucket_cap_mb * MiB,)]
    if bucket_cap_mb == DEFAULT_BUCKET_CAP_MB:
        layouts.append((FIRST_BUCKET_BYTES, bucket_cap_mb * MiB))
    return g * max(_largest_run(_bucket_elements(tensors[::-1], caps, g, n), ZERO2_BUCKETS_HELD) for caps in layouts)


def bucket_count(tensors: tuple, bucket_cap_mb: float, g: int, n: int) -> int:
    """How many gradient buckets DDP builds of ``tensors`` (the first one DDP's 1 MiB under the
    default cap): ZeRO-1/2 steps one flat piece of each (Note [step counts])."""
    caps = ((FIRST_BUCKET_BYTES, bucket_cap_mb * MiB) if bucket_cap_mb == DEFAULT_BUCKET_CAP_MB
            else (bucket_cap_mb * MiB,))
    return len(_bucket_elements(tensors[::-1], caps, g, n))


def zero_pieces(tensors: tuple, groups: tuple, bucket_cap_mb: float, g: int, n: int) -> int:
    """The flat pieces the busiest of ``n`` ranks steps under ZeRO-1/2 (Note [step counts]): one
    for each bucket's slice, and one more wherever the param group changes inside the slice
    (``groups``: each tensor's group, registration order), as fusedist/zero/partition.py cuts
    them."""
    caps = ((FIRST_BUCKET_BYTES, bucket_cap_mb * MiB) if bucket_cap_mb == DEFAULT_BUCKET_CAP_MB
            else (bucket_cap_mb * MiB,))
    order = list(range(len(tensors)))[::-1]
    members = _bucket_members([tensors[i] for i in order], caps, g)
    elements = _bucket_elements([tensors[i] for i in order], caps, g, n)
    extra = [0] * n
    for bucket, padded in zip(members, elements):
        shard, offset = padded // n, 0
        for k, j in enumerate(bucket):
            if k and groups[order[j]] != groups[order[bucket[k - 1]]] and offset % shard:
                extra[offset // shard] += 1
            offset += tensors[order[j]]
    return len(members) + max(extra)


def _bucket_members(order, caps: tuple, g: int) -> list:
    """Which of the tensors in ``order`` (their positions) each bucket holds (:func:`_bucket_elements`)."""
    buckets, open_bucket, open_elements = [], [], 0
    for j, t in enumerate(order):
        open_bucket.append(j)
        open_elements += t
        if open_elements * g >= caps[min(len(buckets), len(caps) - 1)]:
            buckets.append(open_bucket)
            open_bucket, open_elements = [], 0
    if open_bucket or not buckets:
        buckets.append(open_bucket)
    return buckets


def _bucket_elements(order, caps: tuple, g: int, n: int) -> list:
    """Elements of each bucket (padding included) of tensors taken in ``order``: the k-th bucket
    closes once it reaches ``caps[k]`` bytes (the last cap serving every later one), the tensor
    that crosses it included (Note [buckets close as torch's do] in fusedist/ddp/layout.py)."""
    pad = n * SHARD_ALIGN
    sizes, open_elements = [], 0
    for t in order:
        open_elements += t
        if open_elements * g >= caps[min(len(sizes), len(caps) - 1)]:
            sizes.append(open_elements)
            open_elements = 0
    if open_elements or not sizes:
        sizes.append(open_elements)
    return [-(-max(s, 1) // pad) * pad for s in sizes]
