"""Ranks compare their parts of gloo's own all-reduces: before launching a synchronous one, once an
asynchronous one completed.

Note [parts agreed before gloo's own all-reduce]
    gloo pairs its own collectives by issue order and trusts every rank to pass the same number of
    bytes and the same reduction. When one rank passes another size, gloo's transport fails an
    assertion and terminates every process of the group (SIGABRT: no error, no report); another
    dtype of the same byte count (1000 float32 here, 500 float64 there), or another op, completes
    "successfully" with garbage on every rank. torch.distributed on gloo does the same. The small
    all-reduces go through the exchange, whose messages are labelled by size, dtype and op (Note
    [small all-reduces through the exchange] in torch_comm.py). Every other all-reduce of CPU tensors
    on gloo posts a fingerprint of this rank's part -- sequence number, element count, dtype, op,
    shape, and the collective it serves (Note [the collective's kind in a fingerprint]) -- to every
    peer, and receives theirs; so does gloo's own reduce-scatter, an all-reduce of a
    copy of the input (``FUSEDIST_GLOO_COLLECTIVES=builtin``, dtypes the exchange does not reduce), whose
    ranks, passing different ops, each went on with a result of both:

    * waited for at once (``async_op=False``), gloo's all-reduce is launched only once every peer's
      fingerprint landed and agrees. Otherwise every rank (each has every fingerprint) raises the
      same error naming each rank's part; nothing was reduced, the ranks are still in step, and the
      group stays usable. Its wait is one deadline, never sliced (as a synchronous exchange's):
      gloo's receive works report completion only through a wait, and one whose wait times out
      closes the group's connections.
    * launched with ``async_op=True`` (a fully_shard replicate group's gradients, user code), gloo's
      all-reduce is launched at once -- a launch that waited for the peers would stall the
      backward that launches it -- and the fingerprints are read once it completed: a part of
      another dtype or op is an error naming each part instead of garbage taken for a result
      (another size still ends the processes, as with torch; the engines' layouts are checked
      across ranks when they are built and at every step, Note [step check] in
      fusedist/reliability/step_check.py). Its wait is sliced like any gloo work's.

    A rank may launch the collective either way, whatever the others do: each posts its
    fingerprint at launch. A caller whose parts are checked otherwise passes ``parts_checked=True``
    on every rank and posts none (DDP's buckets, a replicated module's, a joined rank's shadows of
    them: Note [parts a caller checked] in base.py). The price is a small message to and from every
    peer per all-reduce, and for a synchronous one a message latency before the launch (the figures
    are in the README).
    ``FUSEDIST_AGREE_PARTS=0`` on every rank turns it off.
"""

from __future__ import annotations

import datetime
import os
import time
import zlib
from typing import Callable, Optional

import torch
import torch.distributed as dist

#: The fingerprints' tags: below the exchange's (Note [exchange tags] in exchange_tags.py) and the
#: closing receive's, far above user point-to-point tags; sequence numbers wrap at 2**SEQ_BITS.
TAG_BASE = 1 << 29
SEQ_BITS = 20
#: Dimensions a fingerprint spells out; a tensor with more is named by its element count alone.
MAX_DIMS = 8
_LEN = 6 + MAX_DIMS
_OPS = ("sum", "avg", "max", "min")
#: The collectives made of gloo's own all-reduce, told apart by the fingerprint's last slot (Note [the
#: collective's kind in a fingerprint]); an all-reduce's is 0, as in a fingerprint made without one.
_KINDS = ("all_reduce", "reduce_scatter")
_KIND = _LEN - 1
_DTYPES = {zlib.crc32(str(d).encode()): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


#: ``0`` launches gloo's own synchronous all-reduces without the agreement (every rank alike: a rank
#: that waits for fingerprints the others never send times out, naming them).
ENV_VAR = "FUSEDIST_AGREE_PARTS"


def enabled() -> bool:
    """Whether this process agrees on the parts first (``FUSEDIST_AGREE_PARTS``, default 1)."""
    value = os.environ.get(ENV_VAR, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_VAR} must be 0 or 1, got {value!r}")
    return value == "1"


class PartMismatchError(RuntimeError):
    """The ranks' parts of one all-reduce differ (every rank raises it)."""


def fingerprint(tensor: torch.Tensor, op: str, seq: int) -> torch.Tensor:
    """``[seq, numel, dtype, op, ndim, shape...]`` as int64 (shape beyond MAX_DIMS left out)."""
    shape = list(tensor.shape)[:MAX_DIMS]
    values = [seq, tensor.numel(), zlib.crc32(str(tensor.dtype).encode()), _OPS.index(op), tensor.dim()] + shape
    return torch.tensor(values + [0] * (_LEN - len(values)), dtype=torch.int64)


# Note [the collective's kind in a fingerprint]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# gloo's own reduce-scatter is an all-reduce of a copy of its input, so an all-reduce on one rank paired
# with a reduce-scatter of as many elements and the same op on another: both completed, the ranks went on
# out of step, each believing the other ran its collective. The fingerprint now carries the collective's
# kind (in its last slot, unused by the shape), and different kinds are a mismatch named on every rank.
def with_kind(fp: torch.Tensor, kind: str) -> torch.Tensor:
    """``fp`` marked as the fingerprint of a ``kind`` collective (``all_reduce`` or ``reduce_scatter``)."""
    fp[_KIND] = _KINDS.index(kind)
    return fp


def describe(fp: list, named_kind: bool = False) -> str:
    """``1000 x torch.float32 (shape (10, 100)), op sum`` from a fingerprint, led by its collective
    (``reduce_scatter of ...``) when ``named_kind``."""
    numel, dtype, op, ndim = fp[1], _DTYPES.get(fp[2], "an unknown dtype"), _OPS[fp[3]], fp[4]
    shape = f"shape {tuple(fp[5:5 + ndim])}" if ndim <= MAX_DIMS else f"{ndim} dims"
    kind = f"{_KINDS[fp[_KIND]]} of " if named_kind else ""
    return f"{kind}{numel} x {dtype} ({shape}), op {op}"


class AgreedAllReduce:
    """A work: the fingerprints' messages and gloo's all-reduce (``launch()`` starts it and returns
    its work), launched at once when ``launch_now``, else once every part agrees (Note [parts agreed
    before gloo's own all-reduce]). ``limit_s``: the collective's timeout (the communicator's, or the
    process group's own where shorter), which bounds the fingerprints' receives too."""

    def __init__(self, tensor: torch.Tensor, op: str, seq: int, group, rank: int, world_size: int,
                 launch: Callable[[], object], launch_now: bool, limit_s: float, kind: str = "all_reduce"):
        self._launch, self.rank = launch, rank
        self._deadline = time.monotonic() + limit_s
        self._mine = with_kind(fingerprint(tensor, op, seq), kind)
        self._theirs = {p: torch.empty(_LEN, dtype=torch.int64) for p in range(world_size) if p != rank}
        tag = TAG_BASE | (seq % (1 << SEQ_BITS))
        self._recvs, self._sends = [], []
        #: A failure to post the messages (a connection closed after an earlier failure), raised by the wait:
        #: it is the collective's failure, named as such, not a failed launch.
        self._post_error: Optional[Exception] = None
        try:
            # receives first: a send then finds its receive announced and is written at once
            self._recvs = [dist.irecv(buf, group=group, tag=tag, **_peer("src", p, group))
                           for p, buf in self._theirs.items()]
            self._sends = [dist.isend(self._mine, group=group, tag=tag, **_peer("dst", p, group))
                           for p in self._theirs]
        except Exception as exc:  # noqa: BLE001 - gloo's errors are RuntimeErrors of many kinds
            self._post_error = exc
        self._work = launch() if launch_now and self._post_error is None else None
        self.launched_first = launch_now
        self._agreed = False
        #: The parts differed (set by the wait that found it), on every rank alike; ``launched_first``
        #: tells whether gloo reduced them anyway (garbage) or not at all.
        self.mismatched = False

    def is_completed(self) -> bool:
        if self.mismatched:
            return True
        return self._work is not None and bool(self._work.is_completed())

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> None:
        end = time.monotonic() + (timeout.total_seconds() if timeout is not None else float("inf"))
        if self._post_error is not None:
            raise RuntimeError(str(self._post_error)) from self._post_error
        if self._work is None:
            self._agree(min(end, self._deadline))
            self._work = self._launch()
        _wait(self._work, end)  # (a slice that runs out leaves gloo's work running)
        if not self._agreed:
            # gloo's all-reduce completed, so every peer launched it and posted its fingerprint first:
            # the receives end at once; never cut short by a slice (that would close the connections).
            self._agree(self._deadline)

    def _agree(self, end: float) -> None:
        """Wait for every peer's fingerprint until ``end``; raise :class:`PartMismatchError` where any
        differs from this rank's."""
        for (peer, _), work in zip(self._theirs.items(), self._recvs):
            try:
                _wait(work, end)
            except Exception as exc:  # noqa: BLE001 - gloo's timeout or a closed connection
                raise (TimeoutError if "timed out" in str(exc).lower() else RuntimeError)(
                    f"the part of rank {peer} did not arrive (Note [parts agreed before gloo's own all-reduce]): "
                    f"{exc}") from exc
        for work in self._sends:
            _wait(work, end)
        self._agreed = True
        mine = self._mine.tolist()
        parts = {self.rank: mine, **{p: buf.tolist() for p, buf in self._theirs.items()}}
        if all(fp[:4] == mine[:4] and fp[_KIND] == mine[_KIND] for fp in parts.values()):
            return
        self.mismatched = True
        kinds_differ = len({fp[_KIND] for fp in parts.values()}) > 1  # (named only then)
        groups: dict = {}
        for r in sorted(parts):
            groups.setdefault(describe(parts[r], kinds_differ), []).append(r)
        listed = "; ".join(f"rank {ranks[0]}: {what}" if len(ranks) == 1 else f"ranks {ranks}: {what}"
                           for what, ranks in groups.items())
        if self.launched_first:
            outcome = ("it was launched with async_op=True, before the parts could be compared, and gloo reduced "
                       "them anyway: the tensor holds garbage")
        else:
            outcome = ("gloo would pair them anyway -- another size ends every process, another dtype or op gives "
                       "garbage -- so it was launched on no rank, and the group stays usable")
        advice = ("Issue the same collective, with tensors of one size and dtype and one op, on every rank"
                  if kinds_differ else "Pass tensors of one size and dtype, and one op, on every rank")
        differ = "collectives" if kinds_differ else "tensors"
        raise PartMismatchError(f"the ranks' {differ} differ ({listed}); {outcome}. {advice}")


def _peer(which: str, rank: int, group) -> dict:
    """``src``/``dst`` keyword for a peer at position ``rank`` of ``group`` (a global rank on the default group)."""
    return {f"group_{which}": rank} if group is not None else {which: rank}


def _wait(work, end: float) -> None:
    """``work.wait`` until ``end`` (monotonic seconds; infinite: no timeout)."""
    if end == float("inf"):
        work.wait()
    else:
        work.wait(timeout=datetime.timedelta(seconds=max(end - time.monotonic(), 1e-3)))
