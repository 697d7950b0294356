"""Whether a SyncBatchNorm backward's all-reduce can skip the transport's part check.

Note [the backward's parts agreed in the forward]
gloo's own all-reduces compare the ranks' parts first (a fingerprint posted to every peer and
awaited before the launch: Note [parts agreed before gloo's own all-reduce] in
fusedist/comm/part_agreement.py), a message latency per call: measured 1.5-2 ms per layer and
backward on a loaded 2-core CPU machine (gloo, 2 ranks, C = 64 and 256). For the backward's
per-channel sums that comparison is already made, once per forward, by the statistics gather:
every rank there carries the same layer (its identity, Note
[the same layer on every rank]), the same channel count (the gather's length, checked once per
layer by ``check_channels_agree``), the same width of the sums (Note [one width for the backward's
sums]) and the same decision to all-reduce (Note [one backward decision for all ranks]), and a
disagreement is refused on every rank, naming the ranks and the layer. What the gather cannot see
is the order in which the backwards run: the all-reduces pair by issue order. On every rank the
autograd engine runs one device's nodes in decreasing creation order, so the backwards of the
layers a rank forwarded run in the reverse order of those forwards -- unless a rank's backward
skips a layer (its loss does not use that output) or runs separate graphs in another order.

So each communicator keeps the training forwards whose backward will all-reduce, as a stack of
weak tokens (a token dies with its autograd graph). A backward whose layer is the latest live entry
-- the order every rank's forwards agreed on -- passes ``parts_checked=True``; any other all-reduce
keeps the check (a layer out of order on every rank alike still works, at the old cost). A joined
rank's shadows (fusedist/ddp/join.py) replay the active ranks' backwards in exactly this reverse
order and pass True too.

The forwards are agreed, but what each rank keeps of them is not: a forward whose graph dies
without a backward on one rank (its output dropped) may stay alive on another (its output kept, never
backpropagated). An earlier forward's backward then found the live one above it on that rank (and
kept the check, posting a fingerprint) and nothing above it on the other (and launched gloo's
all-reduce at once): the ranks waited for each other until the timeout. So a dead token taints the
entries below it -- the ones whose "latest live entry" test another rank may answer differently --
and a tainted entry's backward keeps the check. Entries above a dead one are unaffected: every rank
has them above it, whatever it kept.
"""

from __future__ import annotations

import weakref


class OrderToken:
    """Held by a forward's autograd context; the stack holds it weakly."""

    __slots__ = ("__weakref__",)


class _Entry:
    """A stack entry: the token, weakly, and whether a dead token was found above it."""

    __slots__ = ("ref", "tainted")

    def __init__(self, token: OrderToken):
        self.ref, self.tainted = weakref.ref(token), False


_pending: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # communicator -> [_Entry]


def _prune(stack: list) -> None:
    """Drop the dead entries (graphs freed without a backward), tainting every entry below one."""
    kept, dead_above = [], False
    for entry in reversed(stack):
        if entry.ref() is None:
            dead_above = True
            continue
        entry.tainted = entry.tainted or dead_above
        kept.append(entry)
    stack[:] = kept[::-1]


def forwarded(comm) -> OrderToken:
    """Record a training forward over ``comm`` whose backward will all-reduce; keep the token
    on the autograd context."""
    stack = _pending.get(comm)
    if stack is None:
        stack = _pending[comm] = []
    else:
        _prune(stack)
    token = OrderToken()
    stack.append(_Entry(token))
    return token


def in_forward_order(comm, token) -> bool:
    """Whether ``token``'s backward runs in the reverse order of the agreed forwards on every rank
    (it is the latest live entry, and no forward above it died here without a backward); takes it
    off the stack either way."""
    stack = _pending.get(comm)
    if stack is None or token is None:
        return False
    dead_above = False
    while stack and stack[-1].ref() is None:  # (the top only: deeper dead entries taint when they get there)
        stack.pop()
        dead_above = True
    if dead_above and stack:
        stack[-1].tainted = True
    if stack and stack[-1].ref() is token:
        return not stack.pop().tainted
    _prune(stack)
    stack[:] = [entry for entry in stack if entry.ref() is not token]
    return False
