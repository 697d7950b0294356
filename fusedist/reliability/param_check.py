"""A periodic cross-rank comparison of DDP's replicated parameters, inside the per-step check.

Note [parameter check]
    The step check (Note [step check] in ``step_check.py``) compares where the ranks are, not
    what they hold: a rank that changes its gradients after they were averaged (Note [parameters
    that differ after the same steps] in ``step_check_text.py``), changes a weight in place between
    steps, loads a checkpoint or steps its optimizer on its own (outside the step guard), or a
    model wrapped with ``init_sync=False`` from different values, trains on with replicas that
    differ -- torch's DDP averages the gradients and never looks at the parameters, so nothing
    fails, the ranks just train different models. Replicated parameters are bit-identical on every rank
    (every rank applies the same averaged gradients with the same optimizer), so a digest of
    each parameter's bits must be equal on every rank.

    Every ``FUSEDIST_PARAM_CHECK_EVERY`` synchronized backwards (default 100; from the first
    one, so parameters that differ from the start are found at once) and at every
    ``check_consistency()`` (so ``fusedist.checkpoint.save`` refuses diverged replicas), the
    check's ``params`` field carries a digest of all of them: each parameter's bits, read as
    integers (int64 words where the size allows) and combined by position (Note [a digest
    that sees positions]), then the parameters' digests weighted by their index. It is
    computed on the device, written into the check's buffer there (no host synchronization)
    and travels in the step check's one all-reduce. Only when the
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

    Cost: a few passes over the parameters' bytes (Note [a digest that sees positions]), the
    small parameters in one batch, once per period. Measured on CPU (one thread, a loaded
    2-core machine, 2026-12-06; the plain sums it replaced in brackets): 0.8 ms for 0.53M
    parameters in 16 tensors [0.1], 18-30 ms for 8.4M in 16 [1.7-2.4], 2.2 ms for 0.42M in
    200 [1.0-1.5] -- 12%, 15-25% and 21% of those models' steps (6.2, 121, 10.7 ms): at the
    default period of 100, 0.1-0.25% of a step. ``FUSEDIST_PARAM_CHECK_EVERY=1`` checks every step (debugging);
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


# Note [a digest that sees positions]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A plain sum of a parameter's words is blind to where each word sits: two elements (or two
# rows) of a replicated weight swapped on one rank left every digest unchanged; and with the
# combined digest cut to 62 bits, a change that only moved the top bits of a sum -- one
# element's sign flipped, in the upper half of a word -- was cut away too. So each word x at
# position i (in rows of CHUNK words: chunk c, offset k) counts as
#     M[c] * (x * W[k] + (x >> 32) * U[k])          (int64, modulo 2**64)
# with W, U, M fixed pseudo-random tables (W and M odd: a changed word is never multiplied away;
# the ``x >> 32`` term brings the word's upper half down, so a change of its top bits does not
# vanish when multiplied by an even difference of two weights, as a swap's is). Still exact
# integer arithmetic, the same on every rank for the same bits in any summation order; a swap
# or permutation now changes the digest but for chance cancellations (about 2**-31 per pair).
# The parameters' digests are combined with odd weights, and the top two bits of the sum are
# folded into the 62 that the step check carries. Cost: a few passes over the words where the
# plain sum made one (CPU: the two products are matrix-vector products); parameters of at most
# _BATCH_WORDS words are concatenated and weighed in one batch, their per-parameter sums
# gathered by index_add_ (Note [parameter check] has the figures).

#: Words per row of the position tables (Note [a digest that sees positions]).
CHUNK = 1 << 16

#: Rows of CHUNK words weighed at once: bounds the temporaries to 32 MiB.
_ROWS_AT_ONCE = 64

_tables: dict = {}  # device -> (W, U, M, M as a list): Note [a digest that sees positions]


def _mix(z: torch.Tensor) -> torch.Tensor:
    """A fixed scrambling of int64 values (splitmix64's steps, arithmetic shifts), exact on any
    device."""
    z = (z ^ (z >> 30)) * -4658895280553007687
    z = (z ^ (z >> 27)) * -7723592293110705685
    return z ^ (z >> 31)


def _position_tables(device: torch.device) -> tuple:
    """The odd weights W, the upper-half weights U (as ``U - W << 32``, so one product with
    the whole word and one with its upper half suffice) and the odd row weights M (M[0] = 1),
    built on the CPU once, then kept on ``device`` (no host synchronization after)."""
    if device not in _tables:
        if "cpu" not in _tables:
            k = torch.arange(CHUNK, dtype=torch.int64) * -7046029254386353131
            w = _mix(k) | 1
            u = _mix(k ^ 0x5DEECE66D) - (w << 32)  # x*W + (x>>32)*U == lo*W + hi*U' for the halves
            m = _mix(k ^ 0x2545F4914F6CDD1D) | 1
            m[0] = 1
            _tables["cpu"] = (w, u, m, m.tolist())
        _tables[device] = tuple(t.to(device) for t in _tables["cpu"][:3]) + (_tables["cpu"][3],)
    return _tables[device]


def _row_weight(c: int, rows: list) -> int:
    """M[c] for row ``c`` of CHUNK words, as a signed int64 value: ``rows`` (the CPU table) for
    the first CHUNK rows, times an odd number for each further CHUNK of rows."""
    z = rows[c % CHUNK] * (2 * (c // CHUNK) + 1) % (1 << 64)
    return z - (1 << 64) if z >= 1 << 63 else z


def _weighed(words: torch.Tensor) -> torch.Tensor:
    """The position-weighted int64 digest of a flat int64 tensor (Note [a digest that sees
    positions]); a tensor of at most CHUNK words (most of them) costs three small ops."""
    w, u, m, rows = _position_tables(words.device)
    n = words.numel()
    full = n - n % CHUNK
    tail = words[full:]
    total = _products(tail, w[:tail.numel()], u[:tail.numel()])
    if full:
        total = total * _row_weight(full // CHUNK, rows)
        blocks = words[:full].view(-1, CHUNK)
        for start in range(0, blocks.shape[0], _ROWS_AT_ONCE):  # (a block never crosses a CHUNK of rows)
            block = blocks[start:start + _ROWS_AT_ONCE]
            sums = _products(block, w, u)
            weights = m[start % CHUNK:start % CHUNK + block.shape[0]] * (2 * (start // CHUNK) + 1)
            total = total + (sums * weights).sum()
    return total


def _products(x: torch.Tensor, w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """sum(x * w + (x >> 32) * u) over the last dim of ``x`` (one row, or a block of rows), in int64."""
    if x.device.type == "cpu":  # (integer matrix-vector products: CPU only, and faster there)
        return x @ w + (x >> 32) @ u
    return (x * w).sum(-1) + ((x >> 32) * u).sum(-1)


def _values(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, as its values: a DTensor's local values; a lazily negated or conjugated
    tensor (torch's negative or conjugate bit: ``nn.Parameter(torch._neg_view(x))``,
    ``nn.Parameter(z.conj())``) resolved into a copy. Such a tensor's memory holds the negation
    or conjugate of its values, which cannot be read as integers in place (torch refuses the
    dtype view and ``view_as_real``: the check failed on it), and the ranks hold the same
    values whichever bits each carries, so its values are what is weighed."""
    t = getattr(t, "_local_tensor", t).detach()
    if t.is_neg() or t.is_conj():
        t = t.resolve_conj().resolve_neg()
    return t


def tensor_digest(t: torch.Tensor) -> torch.Tensor:
    """The position-weighted int64 digest of ``t``'s elements read as integers (a 0-dim
    tensor on ``t``'s device; Note [a digest that sees positions]): exact, so the same on
    every rank for the same bits, and changed by any changed, swapped or moved element."""
    t = _values(t)
    if is_traceable_wrapper_subclass(t):  # (quantized storage, e.g. NF4: the bits of its inner tensors)
        inner = [tensor_digest(getattr(t, name)) for name in t.__tensor_flatten__()[0]]
        return torch.stack(inner).sum() if inner else torch.zeros((), dtype=torch.int64, device=t.device)
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    if t.is_complex():
        t = torch.view_as_real(t)
    words = _as_words(t)
    if words is not None:  # (read as int64 words: several times faster on CPU than widening each element)
        return _weighed(words)
    return _weighed(t.reshape(-1).view(_BITS_AS[t.element_size()]).to(torch.int64))


def _as_words(t: torch.Tensor) -> Optional[torch.Tensor]:
    """``t``'s bits as a flat int64 tensor, where its size allows (else None)."""
    if not t.is_contiguous() or (t.numel() * t.element_size()) % 8:
        return None
    if (t.storage_offset() * t.element_size()) % 8:  # (a view into a flat buffer, e.g. ZeRO's:
        t = t.clone()                                 # the same digest as any other copy of its bits)
    return t.reshape(-1).view(torch.int64)


#: Parameters of at most this many int64 words are weighed together, in one batch: a model's
#: many small tensors (norms, biases) would otherwise cost a few small ops each.
_BATCH_WORDS = 4096


def _plain(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The int64 words :func:`tensor_digest` weighs for ``t``, if it can join the batch of
    small parameters (see ``_BATCH_WORDS``)."""
    t = _values(t)
    if is_traceable_wrapper_subclass(t) or t.is_complex() or t.numel() == 0 or t.numel() > 2 * _BATCH_WORDS:
        return None
    words = _as_words(t)
    if words is None:  # (an odd size: each element widened, as tensor_digest does)
        words = t.reshape(-1).view(_BITS_AS[t.element_size()]).to(torch.int64)
    return words if words.numel() <= _BATCH_WORDS else None


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
        self._batch: Optional[tuple] = None  # (sizes, device, W, U, segment of each word) of the small ones
        self.per_param: Optional[torch.Tensor] = None  # the last computed digests (on the device)

    @torch.no_grad()
    def compute(self, device: torch.device) -> torch.Tensor:
        """The combined digest of every parameter (a 0-dim int64 tensor on ``device``), each
        parameter's digest weighted by its position; the per-parameter ones are kept for
        :meth:`describe`."""
        if not self.params:
            self.per_param = torch.zeros(0, dtype=torch.int64, device=device)
            return torch.zeros((), dtype=torch.int64, device=device)
        words = [_plain(p) for p in self.params]
        small = [i for i, x in enumerate(words) if x is not None]
        small = [i for i in small if words[i].device == words[small[0]].device]  # (one device: one batch)
        if len(small) < 2:
            small = []
        others = sorted(set(range(len(self.params))) - set(small))
        parts = []  # (indices, their digests), stacked where the parameters are, then moved once
        if small:
            parts.append((small, self._small_digests([words[i] for i in small])))
        if others:
            digests = [tensor_digest(self.params[i]) for i in others]
            home = digests[0].device
            parts.append((others, torch.stack([d.to(home) for d in digests])))
        if len(parts) == 1:
            self.per_param = parts[0][1].to(device)  # (all of them, in order)
        else:
            self.per_param = torch.empty(len(self.params), dtype=torch.int64, device=device)
            for indices, digests in parts:
                self.per_param[indices] = digests.to(device)
        if self._weights is None or self._weights.device != self.per_param.device:
            # odd: a change of one parameter's digest is never multiplied away
            self._weights = torch.arange(1, 2 * len(self.params), 2, dtype=torch.int64, device=self.per_param.device)
        # 62 bits: the step check's vector holds v and -v, both above a joined rank's value
        # (step_check.JOINED = -2**62), which must stay the smallest for the MAX to ignore it.
        # The top two bits are folded in, not cut off (Note [a digest that sees positions]).
        total = (self.per_param * self._weights).sum()
        return (total ^ ((total >> 62) & 3)) & _DIGEST_MASK

    def _small_digests(self, words: list) -> torch.Tensor:
        """The digests of the small parameters' ``words`` at once, each as :func:`tensor_digest`
        makes it (one row of CHUNK words at most: the first row's weights)."""
        sizes = [x.numel() for x in words]
        device = words[0].device
        if self._batch is None or self._batch[:2] != (sizes, device):
            w, u = _position_tables(device)[:2]
            segment = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes)).to(device)
            self._batch = (sizes, device, torch.cat([w[:n] for n in sizes]), torch.cat([u[:n] for n in sizes]),
                           segment)
        _, _, w_all, u_all, segment = self._batch
        x = torch.cat(words)
        terms = x * w_all + (x >> 32) * u_all
        return torch.zeros(len(sizes), dtype=torch.int64, device=device).index_add_(0, segment, terms)

    def describe(self, comm, skip=(), limit: int = 5, labels: Optional[list] = None) -> list[str]:
        """Lines naming the first parameters whose digests differ across ranks (those in
        ``skip``, joined ones, apart), and which ranks agree (``labels[r]`` for position ``r``
        of ``comm``'s group: the global ranks on a subgroup). A collective: every rank calls it
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
                groups.setdefault(row[i], []).append(labels[r] if labels else r)
            alike = " | ".join(f"ranks {ranks}" for ranks in sorted(groups.values()))
            shape = tuple(self.params[i].shape)
            lines.append(f"  parameter '{self.names[i]}' (shape {shape}) differs across ranks: {alike} hold "
                         "different values")
        if len(differing) > limit:
            lines.append(f"  ... {len(differing) - limit} more of {len(self.names)} parameters differ")
        return lines
