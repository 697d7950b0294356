"""How the gloo exchange's reduce-scatter (``gloo_exchange.py``) reduces what lands: the
contributions of each chunk folded in rank order, in place, into the output, and the
reusable buffers the peers' contributions land in."""

from __future__ import annotations

import threading

import torch

# Note [exchange determinism]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The reduce-scatter combines the contributions of ranks 0, 1, ..., N-1 in that order for
# every chunk, whatever order they arrive in, so every run computes bit-identical results.
# Like gloo, it accumulates in the tensor's dtype (bf16 + bf16 rounds to bf16 after each add):
# for N > 2 floating-point results can differ from gloo's own reduce-scatter in the last bits,
# as gloo's order is not rank order. avg is the sum divided by N, in the dtype.
#
# Note [in-place fold]
# ~~~~~~~~~~~~~~~~~~~~
# A reduction that writes a third buffer (``torch.add(a, b, out=c)``) costs several times an
# in-place one (``c.add_(b)``) on CPUs, and the reduce-scatter's fold is most of its CPU time.
# So ``output`` itself receives one of the first two contributions -- rank 1's part on rank 0,
# rank 0's part on every other rank -- or already holds this rank's own part when the
# reduce-scatter is in place, and every step of the fold is in place: ``out = out op c_j``. The fold order stays
# ((c_0 op c_1) op c_2) ... (Note [exchange determinism]): sum, max and min are commutative,
# so ``c_1 op c_0`` is bit-identical to ``c_0 op c_1``. The one exception is an in-place
# reduce-scatter on rank >= 2, whose own part is needed after c_0 op c_1 has overwritten it:
# that chunk keeps a copy of it and its first step writes ``output`` from two other buffers.
# With 2 ranks and a separate output, the reduce-scatter needs no landing buffer at all.


def unrecorded(written: torch.Tensor):
    """The mode to write ``written`` in, as a collective writes its output: outside autograd
    (an input that requires grad, a parameter, would make the fold's ``out=`` combines raise),
    and an inference tensor (a metric computed under ``torch.inference_mode()``) writable as
    gloo's own collectives write it. Set here, not taken from the caller: the driving thread
    may be the progress thread, whose grad and inference modes are its own."""
    return torch.inference_mode() if written.is_inference() else torch.no_grad()


class LandingPool:
    """Reusable landing buffers for reduce-scatters, per dtype.

    A buffer is taken at launch and given back when the exchange completes (never after a
    failure: a late message may still be written into it). Idle buffers are bounded: at most
    ``slots`` per dtype and ``max_bytes`` in all (the smallest go first), so between steps
    the pool holds at most what the reduce-scatters of one backward had in flight at once,
    and never more than ``max_bytes`` -- ZeRO shards gradients to save memory.
    """

    def __init__(self, slots: int = 16, max_bytes: int = 256 << 20):
        self.slots, self.max_bytes = slots, max_bytes
        self._free: dict[torch.dtype, list[torch.Tensor]] = {}
        self._lock = threading.Lock()  # gradient hooks may launch from autograd's threads
        self._in_flight = 0  # bytes of buffers taken and not yet given back or dropped

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat buffer of at least ``numel`` elements; hand it back whole."""
        with self._lock:
            free = self._free.get(dtype, [])
            fits = [i for i, b in enumerate(free) if b.numel() >= numel]
            if fits:
                best = min(fits, key=lambda i: free[i].numel())  # the smallest that fits
                buffer = free.pop(best)
            else:
                buffer = torch.empty(numel, dtype=dtype)
            self._in_flight += _nbytes(buffer)
            return buffer

    def give_back(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._in_flight -= _nbytes(buffer)
            free = self._free.setdefault(buffer.dtype, [])
            free.append(buffer)
            while free and (len(free) > self.slots or self.idle_bytes() > self.max_bytes):
                free.remove(min(free, key=torch.Tensor.numel))

    def drop(self, buffer: torch.Tensor) -> None:
        """Forget a buffer that is not coming back (its exchange failed; a late message may
        still land in it): it is freed once the failed work is gone."""
        with self._lock:
            self._in_flight -= _nbytes(buffer)

    def idle_bytes(self) -> int:
        return sum(_nbytes(b) for free in self._free.values() for b in free)

    def held_bytes(self) -> int:
        """Idle buffers plus those lent to exchanges in flight."""
        with self._lock:
            return self.idle_bytes() + self._in_flight


class ChunkFold:
    """Folds the N contributions to one output chunk left to right, in rank order:
    ``out = ((c_0 op c_1) op c_2) ...``, then ``/ N`` for avg; in place (Note [in-place fold]).
    ``holder`` is the contribution ``out`` holds once it has landed, or this rank's own part
    when the reduce-scatter is in place."""

    def __init__(self, out, own, peers, rank, world_size, op, holder):
        self.out, self.own, self.peers = out, own, peers
        self.rank, self.world_size, self.op, self.holder = rank, world_size, op, holder
        self.combine, self.combine_ = _COMBINE[op], _COMBINE_INPLACE[op]
        self.folded = 0  # contributions already in ``out``
        self.finished = False

    def _contribution(self, j):
        return self.own if j == self.rank else self.peers[j]

    def advance(self, in_hand: int) -> None:
        """Fold contributions up to ``in_hand`` (exclusive); all of them must have landed."""
        with unrecorded(self.out):
            self._advance(in_hand)

    def _advance(self, in_hand: int) -> None:
        if self.folded == 0:
            if in_hand < 2:
                return
            if self.holder in (0, 1):
                self.combine_(self.out, self._contribution(1 - self.holder))
            else:
                # In place on rank >= 2: ``out`` is this rank's own part, folded again later.
                self.own = self.own.clone()
                self.combine(self._contribution(0), self._contribution(1), self.out)
            self.folded = 2
        while self.folded < in_hand:
            self.combine_(self.out, self._contribution(self.folded))
            self.folded += 1
        if self.folded == self.world_size and not self.finished:
            self.finished = True
            if self.op == "avg":
                _divide(self.out, self.world_size)


def _sum(a, b, out):
    torch.add(a, b, out=out)


def _max(a, b, out):
    torch.maximum(a, b, out=out)


def _min(a, b, out):
    torch.minimum(a, b, out=out)


_COMBINE = {"sum": _sum, "avg": _sum, "max": _max, "min": _min}
_COMBINE_INPLACE = {
    "sum": torch.Tensor.add_,
    "avg": torch.Tensor.add_,
    "max": lambda out, b: torch.maximum(out, b, out=out),
    "min": lambda out, b: torch.minimum(out, b, out=out),
}


def _divide(out: torch.Tensor, n: int) -> None:
    out.div_(n)  # floating point only: validate_reduce_op() refuses integer avg


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
