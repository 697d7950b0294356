"""Reduce-scatter and all-gather on a gloo process group, built from point-to-point messages.

Why: gloo's flat ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` are much slower than
its all-reduce for the same bytes, so ZeRO's reduce-scatter + all-gather (RS+AG) would cost
several all-reduces where a ring needs about one. A direct exchange -- one ``isend`` + one
``irecv`` per peer and chunk (``batch_isend_irecv`` is slower) -- brings RS+AG to about one
all-reduce for large tensors. Small ones are latency-bound: RS+AG pays two synchronizations
where the all-reduce pays one, a floor that is gloo's, not this module's (bare send/recv with
none of this module's checks, and gloo's own all-to-all, are no faster). The figures are in
the README and ``benchmarks/results/`` (``zero_cpu_ws*_collectives_*``, and
``gloo_exchange_notes.md`` for the measurements behind each choice below);
``benchmarks/bench_zero.py`` times every variant in one run. The exchange:

* reduce-scatter: rank r sends chunk j of its input to rank j for every peer j, receives
  the peers' copies of chunk r, and reduces them chunk by chunk as they land;
* all-gather: rank r sends its input to every peer and receives each peer's slice straight
  into the output;
* broadcast: the source sends its tensor to every peer (Note [broadcasts through the
  exchange]);
* gather: every peer sends its input to the destination;
* all-to-all: rank r sends each peer its part of the input and receives each peer's part
  for it, parts labelled by their sizes (``all_to_all``).

Memory: a reduce-scatter in flight holds a landing buffer of (N-2)/N of its input (the
peers' copies of this rank's slice but one, which lands in the output; (N-1)/N when the
output is the input's own slice). Landing buffers are reused (see ``exchange_fold.LandingPool``):
a fresh multi-MiB CPU allocation is page-faulted in as the messages land, a cost that grows
with the buffer and is a large share of a big reduce-scatter.

Supported: ops sum, avg, max, min on float32/64, bfloat16, float16 and integer tensors (avg
only on floating-point ones, as gloo); any dtype for all-gather. In place works as with torch:
a reduce-scatter output may be this rank's slice of the input, an all-gather input this
rank's slice of the output.

``FUSEDIST_GLOO_COLLECTIVES=p2p`` (default) uses this exchange for CPU tensors on gloo;
``builtin`` keeps gloo's own collectives. Every rank of a group must use the same setting
(a mix turns into a timeout, not a wrong result).

See Note [receives first, sends later], Note [exchange tags] (exchange_tags.py) and Note
[exchange determinism] (exchange_fold.py, with how a reduce-scatter folds what lands and the
landing buffers' pool). What drives a launched exchange to completion -- the work handle and the
progress thread -- is in ``exchange_progress.py`` (Note [exchange progress]).
"""

from __future__ import annotations

import datetime
import functools
import os
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .checks import _overlaps
from .closed_connections import ClosedConnections, PeerClosedConnection, explained
from .exchange_fold import ChunkFold, LandingPool, unrecorded
from .exchange_progress import ExchangeWork, ProgressThread, _where
from .exchange_tags import message_tag

ENV_VAR = "FUSEDIST_GLOO_COLLECTIVES"
MODES = ("p2p", "builtin")

#: Bytes per message. Each message costs a handshake in gloo's unbound buffers (the receiver
#: announces it, then the sender writes), so fewer, larger messages are cheaper, up to the
#: point where larger ones stop helping (16 MiB beat 4 MiB, 64 MiB did not beat 16:
#: benchmarks/results/gloo_exchange_notes.md). Reducing one chunk while the next is in flight
#: does not pay for more handshakes. Module-level so tests can shrink it and drive many
#: chunks through small tensors.
CHUNK_BYTES = 16 << 20

# Note [receives first, sends later]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A launch posts only the receives; the sends are posted when the exchange is driven (by the
# progress thread, or by a caller of ``wait``). Why, from how gloo's TCP transport pairs
# messages: a send whose matching receive the peer has already announced is written to the
# socket at once *by the thread that posts it*, up to the whole message; a send posted first
# waits for that announcement and is then written by gloo's event-loop thread, the same
# thread that reads the peer's incoming data, so the two directions take turns. Posting every
# receive at launch means the peers' sends find them announced and both directions flow at
# once; deferring our sends keeps the launch -- called from autograd's gradient hooks in the
# middle of backward -- from writing megabytes to a socket before it returns.
# A synchronous launch also defers them, although its caller drives it at once: posting them
# right after the receives helps only when the ranks enter a collective together, which they
# do not when ZeRO runs RS then AG back to back (benchmarks/results/gloo_exchange_notes.md).


#: The label of the one-element sum all-reduce that carries a communicator's barrier: its messages pair with
#: no user all-reduce (whose labels name size, dtype and op), and its errors say "barrier".
BARRIER_LABEL = "barrier"

#: dtypes the exchange reduces; others go to gloo's builtin collectives.
REDUCIBLE_DTYPES = (
    torch.float32, torch.float64, torch.bfloat16, torch.float16,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
)


def mode_from_env() -> str:
    """The configured implementation, ``p2p`` or ``builtin``; raises on any other value."""
    mode = os.environ.get(ENV_VAR, "p2p").strip().lower() or "p2p"
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR} must be one of {MODES}, got {os.environ.get(ENV_VAR)!r}")
    return mode


def validate_reduce_op(op: str, dtype: torch.dtype) -> None:
    """Raise ``ValueError`` for the one reduction the exchange refuses, as gloo does: avg of an
    integer tensor. Shapes, contiguity and overlap are the communicator's checks
    (``Communicator.reduce_scatter`` / ``all_gather``), done before any launch."""
    if op == "avg" and not dtype.is_floating_point:
        raise ValueError(
            f"fusedist reduce_scatter: op='avg' needs a floating-point tensor, got {dtype} (as with "
            "gloo); reduce with 'sum' and divide, or convert to a floating-point dtype"
        )


def _chunk_bounds(numel: int, element_size: int) -> list[tuple[int, int]]:
    """Element ranges of the messages of one part; an empty part is one empty message (Note
    [empty parts are messages too])."""
    if numel == 0:
        return [(0, 0)]
    step = max(1, CHUNK_BYTES // element_size)
    return [(lo, min(lo + step, numel)) for lo in range(0, numel, step)]


def _described(kind: str, part: torch.Tensor) -> str:
    """How errors name an exchange: with this rank's part, since ranks whose parts differ in
    size or dtype never pair (Note [exchange tags]) and time out instead."""
    return f"{kind} [{part.numel()} x {part.dtype} per rank]"


def _offsets(counts: list[int]) -> list[int]:
    """Where each rank's part starts, for parts of ``counts`` elements laid end to end."""
    at = [0]
    for c in counts[:-1]:
        at.append(at[-1] + c)
    return at


def _as_real(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t  # as dist.isend / irecv do


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class GlooExchange:
    """Reduce-scatter and all-gather over one gloo process group by point-to-point messages.

    ``rank``/``world_size`` are positions in ``group``, and so are the peers of its messages
    (posted on the group itself); errors also name a peer's global rank.
    """

    def __init__(self, group, rank: int, world_size: int, timeout: Optional[datetime.timedelta] = None):
        self.group = group if group is not None else dist.group.WORLD  # messages are posted on it
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout.total_seconds() if timeout is not None else 30 * 60.0
        self._progress = ProgressThread()
        self.global_ranks = (
            list(dist.get_process_group_ranks(group)) if group is not None else list(range(world_size))
        )
        self._landing = LandingPool()
        self._writing: list = []  # (work in flight, tensor it writes): Note [one buffer, issue order]
        self._failed: Optional[str] = None  # Note [no collectives after a failed exchange]
        self._closing = ClosedConnections(self.group, self.global_ranks[rank])
        #: Told the first failure of an exchange of this group when it happens, from the thread that found it
        #: (the owner's record of the group's failure: Note [one failure per process group] in torch_comm.py).
        self.on_failure: Optional[Callable[[str], None]] = None

    # ---- public
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str, seq: int,
                       label: str = "") -> Optional[ExchangeWork]:
        """Start ``output = reduce(input[r-th slice] over ranks)``; None when already done.

        ``output`` may be this rank's own slice of ``input`` (in place; the communicator has
        refused every other overlap). ``op`` passed :func:`validate_reduce_op`.
        """
        rows, output, in_place = self._rows("reduce_scatter", input, output)
        if rows is None:
            return None
        self._after_writes_to(input, output)
        n, r, m = self.world_size, self.rank, output.numel()
        # One peer's part lands straight in ``output`` (Note [in-place fold]); the others land
        # in rows of a pooled buffer, in ring order after this rank.
        direct = None if in_place else (1 if r == 0 else 0)
        landed = [p for p in ((r + k) % n for k in range(1, n)) if p != direct]
        peer_row = {p: i for i, p in enumerate(landed)}
        pooled = self._landing.take(len(landed) * m, input.dtype) if landed else None
        landing = pooled[:len(landed) * m].view(len(landed), m) if landed else None
        # The op in the label: ranks that fold with different ops never pair (each went on with its own op's
        # result; Note [reduce ops and roots in the divergence probe] in fusedist/reliability/divergence.py).
        sends, receives = self._post(
            "reduce_scatter", seq, f"{label} (op {op})", output,
            send_slice=lambda dst, lo, hi: rows[dst, lo:hi],
            recv_slice=lambda src, lo, hi: output[lo:hi] if src == direct else landing[peer_row[src], lo:hi])
        holder = r if in_place else direct  # the contribution ``output`` holds before the fold
        ordered = self._reduction_schedule(receives, rows, landing, peer_row, output, op, holder)
        pool = self._landing
        return self._writes(output, ExchangeWork(
            _described("reduce_scatter", output), ordered, sends, (landing, rows, output), timeout_s=self.timeout_s,
            on_success=functools.partial(pool.give_back, pooled) if pooled is not None else None,
            on_failure=functools.partial(pool.drop, pooled) if pooled is not None else None,
            background=self._progress.submit))

    def all_reduce(self, tensor: torch.Tensor, op: str, seq: int, label: str = "") -> Optional[ExchangeWork]:
        """Start a small ``tensor = reduce(tensor over ranks)`` (Note [small all-reduces through
        the exchange]): every rank's tensor is gathered, then folded in rank order, in place."""
        n = self.world_size
        if n == 1:
            return None  # nothing to exchange: the tensor is the result
        gathered = torch.empty(n * tensor.numel(), dtype=tensor.dtype)

        def fold() -> None:
            rows = gathered.view(n, -1)
            if op == "max":
                result = torch.amax(rows, dim=0)
            elif op == "min":
                result = torch.amin(rows, dim=0)
            else:  # sum: rank order, as the reduce-scatter (Note [exchange determinism])
                result = rows[0].clone()
                for row in rows[1:]:
                    result.add_(row)
            # Through detach(): a parameter outside no_grad is written in place as by gloo's own
            # all-reduce, not refused by autograd after the exchange.
            with unrecorded(tensor):
                tensor.detach().view(-1).copy_(result)

        # Its own label: an all-reduce never pairs with an all-gather of the same tag.
        work = self.all_gather(gathered, tensor, seq, label=f"all_reduce {label}", on_success=fold)
        # How its errors name it: a barrier's carrier as a barrier (the caller's collective), not as the
        # one-element all-reduce it is here.
        work.op = "barrier" if label == BARRIER_LABEL else _described("all_reduce", tensor)
        return self._writes(tensor, work)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, seq: int, label: str = "",
                   on_success: Optional[Callable[[], None]] = None) -> Optional[ExchangeWork]:
        """Start ``output[p-th slice] = input of rank p`` for every rank p; None when already done.

        ``input`` may be this rank's own slice of ``output`` (in place; the communicator has
        refused every other overlap). ``on_success`` runs once every message has landed.
        """
        rows, input, in_place = self._rows("all_gather", output, input)
        if rows is None:
            return None
        self._after_writes_to(input, output)
        # The sends read this rank's row of ``output``, which holds ``input`` as it was at the
        # launch (copied below; sends are posted later, Note [receives first, sends later]):
        # every rank then gathers the same contribution from this one, also when ``input``
        # changes before the exchange is driven -- another collective in flight on it, such as
        # a second all-reduce of the same tensor, whose result the ranks would otherwise differ on.
        sends, receives = self._post(
            "all_gather", seq, label, input,
            send_slice=lambda dst, lo, hi: rows[self.rank, lo:hi],
            recv_slice=lambda src, lo, hi: rows[src, lo:hi])
        receives = [(*recv, None) for recv in receives]  # nothing to fold as they land
        if not in_place:
            with unrecorded(output):
                rows[self.rank].copy_(input)  # after posting the messages: the copy overlaps the transfers
        return self._writes(output, ExchangeWork(_described("all_gather", input), receives, sends, (input, output),
                                                 timeout_s=self.timeout_s, on_success=on_success,
                                                 background=self._progress.submit))

    def broadcast(self, tensor: torch.Tensor, src: int, seq: int) -> Optional[ExchangeWork]:
        """Start ``tensor = tensor of rank src`` (Note [broadcasts through the exchange]): rank
        ``src`` sends its tensor to every peer, chunk by chunk; None when already done."""
        flat = tensor.view(-1)
        if self.world_size == 1:
            return None
        self._after_writes_to(flat)
        # Labelled by size, dtype and source, not by tag (as the small all-reduces): ranks whose
        # tensors or sources differ never pair, whatever their tags.
        label = f"broadcast from {src} [{flat.numel()} x {flat.dtype}]"
        sends: list = []
        receives: list = []
        for chunk, (lo, hi) in enumerate(_chunk_bounds(flat.numel(), flat.element_size())):
            tag = message_tag("all_gather", seq, chunk, label)
            if self.rank == src:
                for k in range(1, self.world_size):
                    dst = (src + k) % self.world_size
                    sends.append((self._send_later(flat[lo:hi], dst, tag), dst, self.global_ranks[dst], chunk))
            else:
                receives.append((self._irecv(flat[lo:hi], src, tag), src, self.global_ranks[src], chunk, None))
        return self._writes(flat, ExchangeWork(_described("broadcast", flat), receives, sends, (flat,),
                                               timeout_s=self.timeout_s, background=self._progress.submit))

    def gather(self, output: Optional[torch.Tensor], input: torch.Tensor, dst: int, seq: int,
               label: str = "") -> Optional[ExchangeWork]:
        """Start ``output[p-th slice] = input of rank p`` on rank ``dst`` (``output`` None on the
        others): every peer sends its input to ``dst``; None when already done. Labelled by
        the size, dtype and destination of the parts, as the broadcast (Note [broadcasts
        through the exchange]): where gloo's own gather got a part larger than the destination
        expected it terminated that process, and a smaller one left stale data in the output."""
        flat, n, r = input.view(-1), self.world_size, self.rank
        rows = output.view(n, -1) if output is not None else None
        self._after_writes_to(flat, *([] if rows is None else [rows]))
        label = f"gather to {dst} {label} [{flat.numel()} x {flat.dtype}]"
        sends: list = []
        receives: list = []
        for chunk, (lo, hi) in enumerate(_chunk_bounds(flat.numel(), flat.element_size())):
            tag = message_tag("reduce_scatter", seq, chunk, label)
            if r != dst:
                sends.append((self._send_later(flat[lo:hi], dst, tag), dst, self.global_ranks[dst], chunk))
                continue
            for k in range(1, n):
                src = (dst + k) % n
                receives.append((self._irecv(rows[src, lo:hi], src, tag), src, self.global_ranks[src], chunk, None))
        if rows is not None:
            with unrecorded(rows):
                rows[r].copy_(flat)
        if not sends and not receives:
            return None
        # (the input too: the sends read it when the exchange is driven, after the launch)
        return self._writes(flat if rows is None else rows, ExchangeWork(
            _described("gather", flat), receives, sends, (flat,) if rows is None else (flat, rows),
            timeout_s=self.timeout_s, background=self._progress.submit))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_counts: list[int],
                   input_counts: list[int], seq: int, label: str = "") -> Optional[ExchangeWork]:
        """Start ``output[part from rank j] = input of rank j[part for this rank]`` for every
        rank j (``all_to_all_single``; counts in elements, per rank); None when already done.
        Each pair's messages are labelled by the counts of both its directions, as this rank
        sees them (Note [all-to-all pairs without rows]): ranks whose splits disagree never
        pair, and each waits out the timeout naming that peer, where gloo's own all-to-all
        pairs them and terminates the process whose receive is smaller."""
        out, inp = output.view(-1), input.view(-1)
        n, r = self.world_size, self.rank
        out_at, in_at = _offsets(output_counts), _offsets(input_counts)
        self._after_writes_to(inp, out)
        sends: list = []
        receives: list = []
        for k in range(1, n):
            dst, src = (r + k) % n, (r - k) % n
            # this rank -> dst, and back (dst -> this rank): what this rank sends, what it expects
            sent = _pair_label(label, inp.dtype, r, dst, input_counts[dst], output_counts[dst])
            if _carries_pair(r, dst, input_counts[dst], output_counts[dst]):
                for chunk, (lo, hi) in enumerate(_chunk_bounds(input_counts[dst], inp.element_size())):
                    part = inp[in_at[dst] + lo:in_at[dst] + hi]
                    tag = message_tag("all_gather", seq, chunk, sent)
                    sends.append((self._send_later(part, dst, tag), dst, self.global_ranks[dst], chunk))
            # src -> this rank, and back
            expected = _pair_label(label, out.dtype, src, r, output_counts[src], input_counts[src])
            if _carries_pair(src, r, output_counts[src], input_counts[src]):
                for chunk, (lo, hi) in enumerate(_chunk_bounds(output_counts[src], out.element_size())):
                    part = out[out_at[src] + lo:out_at[src] + hi]
                    tag = message_tag("all_gather", seq, chunk, expected)
                    receives.append((self._irecv(part, src, tag), src, self.global_ranks[src], chunk, None))
        with unrecorded(out):
            out[out_at[r]:out_at[r] + output_counts[r]].copy_(inp[in_at[r]:in_at[r] + input_counts[r]])
        if not sends and not receives:
            return None
        what = f"all_to_all_single [{inp.numel()} x {inp.dtype} sent, {out.numel()} received]"
        return self._writes(out, ExchangeWork(what, receives, sends, (inp, out), timeout_s=self.timeout_s,
                                              background=self._progress.submit))

    # Note [no collectives after a failed exchange]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # An exchange that failed -- a transfer that timed out (a rank that never joined, or ranks
    # out of step) or a peer whose connection closed -- leaves the group unusable: gloo closes
    # its connection to that peer at a timeout, and the ranks no longer agree on which
    # collective comes next. Every later collective then failed with gloo's bare "Application
    # timeout caused pair closure", naming neither the failure nor what to do. So the failure
    # is recorded, and later launches on the group raise an error naming it instead.
    def failure(self) -> Optional[str]:
        """What the first failed exchange of this group was and why (None: none failed)."""
        if self._failed is None:
            for work, _ in self._writing:
                if work.failure is not None:
                    self._failed = str(work.failure)
                    break
        return self._failed

    def _given_up(self, reason: str) -> None:
        """Record an exchange's failure when it happens (Note [no collectives after a failed exchange])."""
        if self._failed is None:
            self._failed = reason
        if self.on_failure is not None:
            self.on_failure(reason)

    def _after_writes_to(self, *tensors: torch.Tensor) -> None:
        """Wait for the exchanges in flight that write any of ``tensors`` (Note [one buffer,
        issue order]); forget the finished ones, a failure recorded first. Raises when one has
        failed: the launch that called this would post its messages on a connection gloo closed."""
        live = []
        for work, written in self._writing:
            if not work.is_completed() and any(_overlaps(written, t) for t in tensors):
                try:
                    work.wait()
                except Exception:  # noqa: BLE001 - its own wait() raises it to its caller
                    pass
            if not work.is_completed():
                live.append((work, written))
            elif self._failed is None and work.failure is not None:
                # (read after is_completed(): one that fails between the two is recorded too)
                self._failed = str(work.failure)
        self._writing = live
        if self._failed is not None:
            raise RuntimeError(
                f"this process group can no longer run collectives: an earlier exchange of it failed "
                f"({self._failed}), and gloo closes its connection to a peer after a failed "
                "transfer. Destroy and re-create the process group on every rank, or restart the job "
                "(torchrun --max-restarts)")

    def _writes(self, written: torch.Tensor, work: Optional[ExchangeWork]) -> Optional[ExchangeWork]:
        if work is not None:
            work.closing = self._closing  # (Note [connections a peer closed])
            work.on_given_up = self._given_up
            self._writing.append((work, written))
        return work

    def progress_in_background(self, work: ExchangeWork) -> None:
        """Have the progress thread drive ``work`` (in launch order) unless its caller gets to
        it first; for launches the caller does not wait for at once (Note [exchange
        progress])."""
        self._progress.submit(work)

    def stop_progress_thread(self, join_timeout: Optional[float] = None) -> None:
        """End the progress thread once it has run the exchanges already launched (a later
        launch starts a new one); with ``join_timeout``, wait for that up to so many
        seconds."""
        self._progress.stop(join_timeout)

    def scratch_bytes(self) -> int:
        """Bytes of reduce-scatter landing buffers this group holds: pooled between exchanges
        (at most ``LandingPool.max_bytes``) and lent to exchanges in flight."""
        return self._landing.held_bytes()

    # ---- helpers
    def _rows(self, kind: str, whole: torch.Tensor, part: torch.Tensor):
        """View ``whole`` (reduce-scatter input / all-gather output) as one row per rank; returns
        (rows or None when nothing is left to exchange, flat ``part``, in place?). A single
        rank finishes here: the slice is copied across if needed. Empty slices are exchanged
        (Note [empty parts are messages too])."""
        n, r, m = self.world_size, self.rank, part.numel()
        rows, part = whole.view(n, m), part.view(-1)  # any contiguous shape, flat slices
        in_place = m > 0 and part.data_ptr() == whole.data_ptr() + r * m * whole.element_size()
        if n == 1:
            if not in_place:
                with unrecorded(whole if kind == "all_gather" else part):
                    if kind == "reduce_scatter":
                        part.copy_(rows[0])
                    else:
                        rows[r].copy_(part)
            return None, part, in_place
        return rows, part, in_place

    def _post(self, kind: str, seq: int, label: str, part: torch.Tensor, send_slice, recv_slice):
        """Post the receives of one exchange and prepare its sends (posted when driven; Note
        [receives first, sends later]): chunk by chunk, one message per peer and chunk, tagged
        by Note [exchange tags] in exchange_tags.py, the size and dtype of a rank's ``part``
        (its slice) in the label. ``send_slice(dst, lo, hi)`` is what goes to peer ``dst``,
        ``recv_slice(src, lo, hi)`` where peer ``src``'s part lands, for elements [lo, hi) of a
        slice. Returns (sends, receives), each entry (work or send to post, peer, global peer,
        chunk)."""
        n, r = self.world_size, self.rank
        sends: list = []
        receives: list = []
        label = f"{label} [{part.numel()} x {part.dtype}]"
        for chunk, (lo, hi) in enumerate(_chunk_bounds(part.numel(), part.element_size())):
            tag = message_tag(kind, seq, chunk, label)
            # Ring order spreads the first messages of all ranks over all links.
            for k in range(1, n):
                dst, src = (r + k) % n, (r - k) % n
                sends.append((self._send_later(send_slice(dst, lo, hi), dst, tag), dst, self.global_ranks[dst], chunk))
                receives.append((self._irecv(recv_slice(src, lo, hi), src, tag), src, self.global_ranks[src], chunk))
        return sends, receives

    # The process group's own send/recv, with group ranks: what dist.isend / dist.irecv call
    # after their argument checks and rank translation, which cost more than the posting
    # itself and which the communicator has done.
    def _send_later(self, tensor, peer, tag) -> Callable[[], object]:
        return functools.partial(self.group.send, [_as_real(tensor)], peer, tag)

    def _irecv(self, tensor, peer, tag):
        try:
            return self.group.recv([_as_real(tensor)], peer, tag)
        except Exception as exc:  # noqa: BLE001 - gloo's errors are RuntimeErrors of many kinds
            # A peer that gave up first closed the connection (Note [connections a peer closed]): name it and
            # its error, and give the group up, as a wait that found it would.
            global_peer = self.global_ranks[peer]
            why = explained(self._closing, exc, _where(peer, global_peer), global_peer)
            if why is None:
                raise
            closed = PeerClosedConnection(f"posting the receive from {_where(peer, global_peer)} failed: {why}")
            self._given_up(str(closed))
            raise closed from exc

    def _reduction_schedule(self, receives, rows, landing, peer_row, output, op, holder) -> list:
        """Order the receives chunk by chunk, peers in rank order, each with the step that folds
        the contributions now in hand into the output (Note [exchange determinism])."""
        n, r = self.world_size, self.rank
        by_chunk: dict[int, dict[int, tuple]] = {}
        for recv, src, global_src, chunk in receives:
            by_chunk.setdefault(chunk, {})[src] = (recv, global_src)
        schedule = []
        for chunk, (lo, hi) in enumerate(_chunk_bounds(output.numel(), rows.element_size())):
            peers = {j: landing[row, lo:hi] for j, row in peer_row.items()}
            fold = ChunkFold(output[lo:hi], rows[r, lo:hi], peers, r, n, op, holder)
            for j in range(n):
                if j == r:
                    continue
                recv, global_src = by_chunk[chunk][j]
                # Once rank j's part has landed, contributions 0..j are in hand, and this
                # rank's own one too when it comes next.
                in_hand = j + 2 if r == j + 1 else j + 1
                schedule.append((recv, j, global_src, chunk, functools.partial(fold.advance, in_hand)))
        return schedule


# Note [broadcasts through the exchange]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# gloo's own broadcast pairs by issue order alone and trusts every rank's size: where a
# rank's tensor is larger than the source's (a shape that depends on the rank, a dtype that
# differs), its tail keeps stale data and the broadcast "succeeds"; where it is smaller,
# gloo's transport thread fails an assertion and the process dies (SIGABRT). Here the
# source's messages are labelled by the size, dtype and source of the broadcast (Note
# [exchange tags]), so ranks that disagree on any of them never pair: each waits out the
# timeout and raises a CollectiveError naming its own part, and no rank keeps stale data as
# a result. The source sends to each peer in turn. Against gloo's broadcast on a quiet 2-core
# CPU (medians of 7): the same from 1K to 1M fp32 elements at 2 and 4 ranks (0.6-1.1x), 1.27x
# at 8M elements on 2 ranks (16 vs 12.5 ms), equal at 4; the broadcasts of a training loop
# (buffers at each forward, objects at checkpoints) are small, a model's first one is large.


# Note [empty parts are messages too]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A rank whose part is empty still posts one empty message per peer, labelled "[0 x dtype]" like
# any part (Note [exchange tags]). Before, an empty part was "done" without messages: where one
# rank's part was empty and another's was not (a shape that depends on the rank), the empty rank
# returned as if the collective had succeeded -- and went on out of step -- while the other
# waited out its whole timeout for messages that never came. Now neither pairs and both fail
# alike, each naming its own part, as for any other size mismatch: within seconds where a monitor
# watches the group (DDP, ZeRO and SyncBatchNorm attach one), whose divergence probe finds both ranks
# blocked with parts of different sizes (Note [probing waits that cannot be sliced] in
# watched_wait.py), else at the timeout. (Not from the messages themselves: the non-empty rank would
# have to post a receive for the empty rank's news -- a message on every collective -- or poll its
# receives, and a gloo wait that runs out closes the connection. Where the ranks' timeouts differ, the
# later one learns at the first one's: Note [connections a peer closed] in closed_connections.py.)
# Whether a part
# is empty can differ across ranks, so even a collective empty on every rank costs its empty
# messages (one message latency, ~0.35 ms on 2 ranks where it cost nothing), and so does a pair
# of an all-to-all that exchanges no rows either way (Note [all-to-all pairs without rows]); a non-empty
# part's messages are unchanged (same launch and completion times, measured interleaved).


def _pair_label(label: str, dtype: torch.dtype, sender: int, receiver: int, rows: int, back: int) -> str:
    """The label of the messages ``sender -> receiver`` of an all-to-all: ``rows`` elements that
    way, ``back`` elements the other way (Note [all-to-all pairs without rows])."""
    return f"all_to_all {label} [{rows} x {dtype}] {sender}->{receiver} [{back} back]"


def _carries_pair(sender: int, receiver: int, rows: int, back: int) -> bool:
    """Whether the direction ``sender -> receiver`` of a pair has messages: when it has rows, or
    when neither direction has any and it goes from the lower rank (Note [all-to-all pairs
    without rows])."""
    return rows > 0 or (back == 0 and sender < receiver)


# Note [all-to-all pairs without rows]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Each pair of ranks in an all-to-all has two directions. Every message of a direction is
# labelled by the counts of *both* directions as its side sees them (``_pair_label``), so a
# direction that has rows checks the pair's agreement on its own, and the other direction sends
# no empty message (before, each empty direction sent one: Note [empty parts are messages
# too]). A pair where neither direction has rows sends one empty message, from the lower rank.
# Every rank posts at least one message per pair, labelled by its own view of both counts: where
# two ranks' splits disagree on either direction, none of their messages pair, and both wait out
# the timeout naming the peer, as before. The saving is where a pair has rows one way only --
# an idle expert of a mixture of experts receives none but sends its tokens on -- which now costs
# only the rows' messages, and an all-to-all with no rows anywhere costs one message per pair
# where it cost two.


# Note [one buffer, issue order]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Two collectives in flight on one tensor (two asynchronous all-reduces of it, an all-gather
# into a buffer a broadcast is still writing) ran concurrently: an exchange launched with
# async_op=True is finished by the progress thread whenever its messages land, so whether the
# second read the tensor before or after the first wrote its result differed from rank to rank,
# and the ranks ended with different values (torch's gloo, with two worker threads, is
# no better). A launch now first waits for the exchanges in flight that write what it reads or
# writes, so the collectives on one buffer take effect in issue order on every rank, as on one
# NCCL stream. The peers launched those exchanges first too, so the wait completes; a failed
# one's error is its own wait's to raise, and the launch that waited for it is refused (Note [no
# collectives after a failed exchange]): its messages would go out on the connection gloo closed
# (it failed with gloo's bare "Application timeout caused pair closure").


