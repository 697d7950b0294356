"""A periodic cross-rank comparison of DDP's replicated parameters, inside the per-step check.

Note [parameter check]
    The step check (Note [step check] in ``step_check.py``) compares where the ranks are, not
    what they hold: a rank that changes a weight in place between steps, loads a checkpoint
    or steps its optimizer on its own (outside the step guard), or a model wrapped with
    ``init_sync=False`` from different values, trains on with replicas that differ -- torch's
    DDP averages the gradients and never looks at the parameters, so nothing fails, the
    ranks just train different models. Replicated parameters are bit-identical on every rank
    (every rank applies the same averaged gradients with the same optimizer), so a digest of
    each parameter's bits must be equal on every rank.

    Every ``FUSEDIST_PARAM_CHECK_EVERY`` synchronized backwards (default 100; from the first
    one, so parameters that differ from the start are found at once) and at every
    ``check_consistency()`` (so ``fusedist.checkpoint.save`` refuses diverged replicas), the
    check's ``params`` field carries a digest of all of them: each parameter's bits, read as
    integers (int64 words where the size allows) and summed in int64 modulo 2**64 (so
    independent of the order of the sum; any change of one element changes it), mixed with
    its position. It is computed on the device, written into the check's buffer there (no
    host synchronization) and travels in the step check's one all-reduce. Only when the
    ranks' digests differ do they all-gather the per-parameter digests (every rank, as the
    verdict is the same everywhere), and the error names the first parameters that differ
    and which ranks agree.

    The digest is taken at the end of the backward, after the last bucket was launched: the
    parameters are final there on every rank, also with a ZeroRedundancyOptimizer whose
    all-gathers overlap the next forward (``check_consistency()``, called after a step, first
    waits for those gathers). It is skipped where replicas differ by design: a joined rank
    (Note [joined ranks]) is not compared, and a communication hook other than torch's
    averaging ones (all-reduce, fp16/bf16 compression, quantization, PowerSGD) -- post-local
    SGD, or a user's own -- turns the parameter comparison off.

    Cost: one pass over the parameters' bytes and one small kernel per parameter, once per
    period. Measured on CPU (one thread, 2026-12-06): 0.12 ms for 0.53M parameters in 16
    tensors (2% of that model's 6.2 ms step), 5.1 ms for 8.4M in 16 (4% of 121 ms), 2.5 ms
    for 0.42M in 200 (24% of 10.7 ms: ~12 us per tensor) -- at the default period of 100,
    0.02-0.24% of a step. ``FUSEDIST_PARAM_CHECK_EVERY=1`` checks every step (debugging);
    ``=0`` turns the comparison off, also at ``check_consistency()``: for replicas that differ
    on purpose in ways the hook rule above does not see.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

#: Integer dtypes to read a parameter's bits as, by element size.
_BITS_AS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: The combined digest's bits: |digest| < 2**62 (Note [step check] in step_check.py, JOINED).
_DIGEST_MASK = (1 << 62) - 1

#: The modules of torch's communication hooks whose result is the same on every rank.
_AVERAGING_HOOK_MODULES = ("default_hooks", "powerSGD_hook", "quantization_hooks", "mixed_precision_hooks")


def tensor_digest(t: torch.Tensor) -> torch.Tensor:
    """The int64 sum of ``t``'s elements read as integers of their size (a 0-dim tensor on
    ``t``'s device): exact, so the same on every rank for the same bits."""
    t = getattr(t, "_local_tensor", t).detach()  # (a DTensor's local values)
    if is_traceable_wrapper_subclass(t):  # (quantized storage, e.g. NF4: the bits of its inner tensors)
        inner = [tensor_digest(getattr(t, name)) for name in t.__tensor_flatten__()[0]]
        return torch.stack(inner).sum() if inner else torch.zeros((), dtype=torch.int64, device=t.device)
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_contiguous() and (t.numel() * t.element_size()) % 8 == 0:
        if (t.storage_offset() * t.element_size()) % 8:  # (a view into a flat buffer, e.g. ZeRO's:
            t = t.clone()                                 # the same digest as any other copy of its bits)
        # Read as int64 words, summed modulo 2**64 (any order gives the same sum): ~10x faster
        # on CPU than widening each element, and a change of any element still changes it.
        return t.reshape(-1).view(torch.int64).sum()
    return t.view(_BITS_AS[t.element_size()]).sum(dtype=torch.int64)


def replicates(engine) -> bool:
    """Whether the engine keeps the replicas equal: no communication hook, or one of torch's
    that averages (Note [parameter check])."""
    hook = getattr(getattr(engine, "strategy", None), "hook", None)
    if hook is None:
        return True
    module = getattr(getattr(hook, "func", hook), "__module__", "") or ""
    return module.startswith("torch.distributed.algorithms.ddp_comm_hooks.") and \
        module.rsplit(".", 1)[-1] in _AVERAGING_HOOK_MODULES


class ParamDigest:
    """The digests of one model's replicated parameters ``named`` ((name, parameter) pairs)."""

    def __init__(self, named: list):
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._weights: Optional[torch.Tensor] = None
        self.per_param: Optional[torch.Tensor] = None  # the last computed digests (on the device)

    @torch.no_grad()
    def compute(self, device: torch.device) -> torch.Tensor:
        """The combined digest of every parameter (a 0-dim int64 tensor on ``device``), each
        parameter's digest weighted by its position; the per-parameter ones are kept for
        :meth:`describe`."""
        if not self.params:
            self.per_param = torch.zeros(0, dtype=torch.int64, device=device)
            return torch.zeros((), dtype=torch.int64, device=device)
        digests = [tensor_digest(p) for p in self.params]
        home = digests[0].device  # (stacked where the parameters are, then moved once: one copy, not one each)
        self.per_param = torch.stack([d.to(home) for d in digests]).to(device)
        if self._weights is None or self._weights.device != self.per_param.device:
            self._weights = torch.arange(1, len(self.params) + 1, dtype=torch.int64, device=self.per_param.device)
        # 62 bits: the step check's vector holds v and -v, both above a joined rank's value
        # (step_check.JOINED = -2**62), which must stay the smallest for the MAX to ignore it.
        return (self.per_param * self._weights).sum() & _DIGEST_MASK

    def describe(self, comm, skip=(), limit: int = 5) -> list[str]:
        """Lines naming the first parameters whose digests differ across ranks (those in
        ``skip``, joined ones, apart), and which ranks agree. A collective: every rank calls it
        when the check's ``params`` field differs."""
        mine = self.per_param if self.per_param is not None else torch.zeros(len(self.params), dtype=torch.int64)
        mine = mine.to(comm.device)
        everyone = torch.empty(comm.world_size * mine.numel(), dtype=torch.int64, device=comm.device)
        comm.all_gather(everyone, mine, tag="ddp parameter digests")
        table = {r: row for r, row in enumerate(everyone.view(comm.world_size, mine.numel()).tolist())
                 if r not in skip}
        differing = [i for i in range(mine.numel()) if len({row[i] for row in table.values()}) > 1]
        lines = []
        for i in differing[:limit]:
            groups: dict[int, list[int]] = {}
            for r, row in table.items():
                groups.setdefault(row[i], []).append(r)
            alike = " | ".join(f"ranks {ranks}" for ranks in sorted(groups.values()))
            shape = tuple(self.params[i].shape)
            lines.append(f"  parameter '{self.names[i]}' (shape {shape}) differs across ranks: {alike} hold "
                         "different values")
        if len(differing) > limit:
            lines.append(f"  ... {len(differing) - limit} more of {len(self.names)} parameters differ")
        return lines
