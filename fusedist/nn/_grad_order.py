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
weak tokens (a token dies with its autograd graph: a forward that is never backpropagated leaves
nothing behind). A backward whose layer is the latest live entry -- the order every rank's
forwards agreed on -- passes ``parts_checked=True``; any other all-reduce keeps the check (a layer
out of order on every rank alike still works, at the old cost). The ranks' stacks evolve alike
because their forwards were agreed, so they pass the same value. A joined rank's shadows
(fusedist/ddp/join.py) replay the active ranks' backwards in exactly this reverse order and pass
True too.
"""

from __future__ import annotations

import weakref


class OrderToken:
    """Held by a forward's autograd context; the stack holds it weakly."""

    __slots__ = ("__weakref__",)


_pending: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # communicator -> [weakref(OrderToken)]


def forwarded(comm) -> OrderToken:
    """Record a training forward over ``comm`` whose backward will all-reduce; keep the token
    on the autograd context."""
    stack = _pending.get(comm)
    if stack is None:
        stack = _pending[comm] = []
    else:
        stack[:] = [ref for ref in stack if ref() is not None]  # graphs freed without a backward
    token = OrderToken()
    stack.append(weakref.ref(token))
    return token


def in_forward_order(comm, token) -> bool:
    """Whether ``token``'s backward runs in the reverse order of the agreed forwards (it is the
    latest live entry); takes it off the stack either way."""
    stack = _pending.get(comm)
    if stack is None or token is None:
        return False
    while stack and stack[-1]() is None:
        stack.pop()
    if stack and stack[-1]() is token:
        stack.pop()
        return True
    stack[:] = [ref for ref in stack if ref() is not None and ref() is not token]
    return False
