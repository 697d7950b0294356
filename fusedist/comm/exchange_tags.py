"""The tags of the gloo exchange's point-to-point messages (``gloo_exchange.py``).

Note [exchange tags]
    Every message carries the tag
        TAG_BASE | kind << 29 | label << 23 | (seq mod 2**SEQ_BITS) << CHUNK_BITS | (chunk mod 2**CHUNK_BITS)
    where seq is the communicator's collective sequence number, kind tells reduce-scatter (0)
    from all-gather (1) and label is 6 bits of a hash of the collective's tag ("zero2 bucket
    3", "fully_shard grads blocks.1 (Block)"). All ranks issue collectives in the same order,
    so one collective has the same seq, kind and label everywhere. A rank that is out of step
    posts receives that no send matches, the wait times out and becomes a CollectiveError,
    instead of pairing two collectives of the same size: a rank that issued a collective of
    the other kind differs in kind; one that skipped a collective (a unit its forward did not
    run) issues the next one at the skipped one's seq, and differs in label (seq alone matched
    there, and the two all-gathers of alike blocks paired silently) -- unless the two tags'
    hashes agree, one chance in 64. (A caller may give a label other than the tag: the object
    exchanges' headers share one, so that ranks in different exchanges pair there and each
    sees what the others are in, Note in objects.py.) The hash also covers the size and dtype
    of a rank's part ("zero2 bucket 3 [4096 x torch.float32]"): ranks whose parts differ (a
    shape that depends on the rank) time out too, where gloo paired the messages anyway and
    terminated the process whose receive was smaller, while the other rank went on with
    garbage in the rest of its output. The chunk index makes the pairing of
    chunks independent of the transport's message order. Tags lie in [2**30, 2**31): far from
    user point-to-point traffic (tag 0 by default) and within gloo's C int tags. Several
    collectives may be in flight at once: they differ in seq; a clash would need 2**13
    collectives in flight on one group. A collective of more than 2**10 chunks (16 GiB) reuses
    chunk tags, posted in the same order on both sides. Each process group has its own gloo
    connections, so groups never share tags.
"""

from __future__ import annotations

import zlib

TAG_BASE = 1 << 30
KIND_SHIFT = 29
LABEL_BITS = 6
CHUNK_BITS = 10
SEQ_BITS = KIND_SHIFT - LABEL_BITS - CHUNK_BITS
_KINDS = {"reduce_scatter": 0, "all_gather": 1}


def label_bits(label: str) -> int:
    """6 bits of a hash of a collective's tag, the same in every process (not Python's hash)."""
    return zlib.crc32(label.encode()) % (1 << LABEL_BITS)


def message_tag(kind: str, seq: int, chunk: int, label: str = "") -> int:
    """The tag of chunk ``chunk`` of collective ``seq`` (``kind``, labelled ``label``)."""
    return (TAG_BASE | _KINDS[kind] << KIND_SHIFT | label_bits(label) << (KIND_SHIFT - LABEL_BITS)
            | (seq % (1 << SEQ_BITS)) << CHUNK_BITS | (chunk % (1 << CHUNK_BITS)))
