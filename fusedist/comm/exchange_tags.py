"""The tags of the gloo exchange's point-to-point messages (``gloo_exchange.py``).

Note [exchange tags]
    Every message carries the tag
        TAG_BASE | kind << 29 | label << 15 | (seq mod 2**SEQ_BITS) << CHUNK_BITS | (chunk mod 2**CHUNK_BITS)
    where seq is the communicator's collective sequence number, kind tells reduce-scatter (0)
    from all-gather (1) and label is 14 bits of a hash of the collective's tag ("zero2 bucket
    3", "fully_shard grads blocks.1 (Block)"). All ranks issue collectives in the same order,
    so one collective has the same seq, kind and label everywhere. A rank that is out of step
    posts receives that no send matches, the wait times out and becomes a CollectiveError,
    instead of pairing two collectives of the same size: a rank that issued a collective of
    the other kind differs in kind; one that skipped a collective (a unit its forward did not
    run) issues the next one at the skipped one's seq, and differs in label (seq alone matched
    there, and the two all-gathers of alike blocks paired silently) -- unless the two tags'
    hashes agree, one chance in 2**14 (see Note [the label's width]). (A caller may give a label
    other than the tag: the object exchanges' headers share one, so that ranks in different
    exchanges pair there and each sees what the others are in, Note in objects.py.) The hash also
    covers the size and dtype of a rank's part ("zero2 bucket 3 [4096 x torch.float32]"), and a reduce-scatter's op
    (ranks that folded with different ops paired and each went on with its own op's result): ranks whose parts differ (a
    shape that depends on the rank) time out too, where gloo paired the messages anyway and
    terminated the process whose receive was smaller, while the other rank went on with
    garbage in the rest of its output. Tags lie in [2**30, 2**31): far from user point-to-point
    traffic (tag 0 by default) and within gloo's non-negative C int tags. Several collectives may be
    in flight at once: they differ in seq; a clash would need 2**13 collectives in flight on one
    group. The chunks of one collective share their tag but for the chunk's index mod 4: gloo pairs
    the messages of one tag between two ranks in the order they were posted, and both sides post a
    collective's chunks in chunk order. Each process group has its own gloo connections, so groups
    never share tags.

Note [the label's width]
    The label was 6 bits, next to 10 bits of chunk index: ranks out of step paired two different
    collectives one time in 64 -- silently where the parts had the same size and dtype, and with
    gloo's assertion ending a process (SIGABRT, no error) where they did not. The chunk index buys
    nothing the posting order does not (above), so it keeps 2 bits and the label takes the other 8:
    one chance in 16384, without a message more per collective. A check that caught every clash
    would have to carry the whole label with the data, which gloo's size check reaches first when
    the sizes differ; ranks whose collectives do not pair are found promptly by the divergence probe
    (Note [probing waits that cannot be sliced] in watched_wait.py).
"""

from __future__ import annotations

import zlib

TAG_BASE = 1 << 30
KIND_SHIFT = 29
LABEL_BITS = 14
CHUNK_BITS = 2
SEQ_BITS = KIND_SHIFT - LABEL_BITS - CHUNK_BITS
_KINDS = {"reduce_scatter": 0, "all_gather": 1}


def label_bits(label: str) -> int:
    """LABEL_BITS of a hash of a collective's tag, the same in every process (not Python's hash)."""
    return zlib.crc32(label.encode()) % (1 << LABEL_BITS)


def message_tag(kind: str, seq: int, chunk: int, label: str = "") -> int:
    """The tag of chunk ``chunk`` of collective ``seq`` (``kind``, labelled ``label``)."""
    return (TAG_BASE | _KINDS[kind] << KIND_SHIFT | label_bits(label) << (KIND_SHIFT - LABEL_BITS)
            | (seq % (1 << SEQ_BITS)) << CHUNK_BITS | (chunk % (1 << CHUNK_BITS)))
