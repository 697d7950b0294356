"""The divergence probe: ranks blocked in collectives that can never pair are told so at once.

Note [divergence probe]
~~~~~~~~~~~~~~~~~~~~~~~
A rank that skips a backward the others run and goes on to ``check_consistency()`` (or any rank
whose program took another path) waits in a collective the others never issue, while they wait
inside the backward it skipped (Note [a rank behind at the check] in ``engine_watch.py``). Nothing
on the wire tells a peer that never comes from one that is slow, so this used to end only at the
collective timeout (``FUSEDIST_TIMEOUT_S``, minutes by default). The store can tell: a wait that
has blocked for ``FUSEDIST_DIVERGENCE_PROBE_S`` (default 5 s) publishes where this rank waits --
the collective's sequence number, op and part (this rank's tensor of it), and whether it is inside
``check_consistency()`` -- in its stall-report entry (kind ``waiting``, or the ``checking`` entry
the check left, now with its collective), and reads the other ranks' entries every
``PROBE_EVERY_S`` while it keeps waiting. When every rank of the group is stuck like that --
blocked past the delay, or failed already (a peer whose probe got there first has replaced its
entry with its failure) -- in collectives that cannot pair -- different sequence numbers or ops,
parts of different sizes (not compared for an all-to-all, whose splits may differ), or some inside
``check_consistency()`` and others outside it -- and the same evidence still holds a quarter of
the delay later (an entry a peer is about to withdraw is not taken for a stall), the wait fails
with a ``StallError`` and its usual report on every rank, about a second past the delay instead
of at the timeout, and the communicator refuses further collectives. Ranks at the same collective
are only slow: the probe keeps waiting, as it does while some peer is not blocked (it may be
computing). Tags are not compared: collectives that must pair may carry different tags (a joined
rank's shadows, fusedist/ddp/join.py); labels are, where they pair the messages (below).

Note [exchange labels in the divergence probe]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The gloo exchange matches the messages of an all-gather, reduce-scatter, gather and all-to-all by
a hash of the caller's label (its tag unless the caller chose another: Note [exchange tags] in
fusedist/comm/exchange_tags.py). Ranks at one sequence number, op and part size whose labels differ
-- a rank that skipped one of two alike units, whose next all-gather took the skipped one's number --
can never pair, yet compared equal and waited out the timeout. Each rank now publishes its label
(``waiting_on["label"]``, recorded at the launch by the monitor), and different labels are a
verdict. Only there: an all-reduce's and a broadcast's messages are matched by size, op and source,
not by the tag, and gloo's own collectives and NCCL's by order alone, so collectives of different
tags pair there and no label is published; where a rank's entry has none (another transport, a
collective launched more than HISTORY collectives ago), labels are not compared. A failure entry
carries the label and part too (monitor.py), so a peer still probing reads the same comparison.

Note [reduce ops and roots in the divergence probe]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Ranks at one sequence number, op and part size may still pass what no transport can pair: another
reduce op (an all-reduce with max on one rank, sum on another) or another root (a broadcast from rank
0 on one rank, from rank 1 on another; a gather to different ranks). The gloo exchange labels the
messages of a small all-reduce and a reduce-scatter by their op and those of a broadcast and a gather by
their root, so such ranks never pair -- and waited out the collective timeout, since their entries
compared equal (a reduce-scatter's label lacked its op: each rank folded with its own and went on); gloo's
own broadcast and gather (``FUSEDIST_GLOO_COLLECTIVES=builtin``) hang the same way, as torch's do
(torch's gloo all-reduce with different ops completes, each rank folding with its own op: the
agreement of parts catches that, Note [parts agreed before gloo's own all-reduce] in
fusedist/comm/part_agreement.py). The launch now records the collective's ``variant`` (``op max``,
``from rank 0``, ``to rank 1``: ``CommHandle.variant``), each rank publishes it
(``waiting_on["variant"]``), and different variants are a verdict. Unlike a label it means the same on
every transport, but it too is compared only where every rank's entry has one.

A barrier is a collective of its own (``barrier``), not a one-element sum all-reduce: against a rank in
such an all-reduce it paired, that rank going on with its own value; now the exchange labels its messages
apart (gloo's own barrier has slots of its own), the two never pair, and the probe names both. Ranks
blocked in collectives of different groups, waiting for each other, are found from records across groups
(Note [waits across groups in the divergence probe] in wait_cycle.py).

Note [a peer that failed elsewhere, in the divergence probe]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A peer that failed outside the group's collectives (a pipeline stage's loss) publishes a failure entry
carrying its message (``failed_elsewhere``: Note [a failure outside the group's collectives] in
failed_elsewhere.py) while it waits to tell it, and never issues the collective this rank waits in. The
probe read it as one more rank stuck in a collective that cannot pair, waited for every rank to be stuck,
and told "their programs diverged" -- advice that sends the user after a skipped backward that never was.
Such an entry is now a verdict of its own, given at the first read past the delay (the entry is
withdrawn once the failure has been told, or at the rank's next launch in the group -- Note [a failure
entry withdrawn at the next launch] in failed_elsewhere.py -- so while it stands the rank issues nothing
there and it cannot be a passing one): "rank N failed elsewhere:
<its message>", the peer named by its rank in the group and its global rank -- for a wait in a collective
the peer had not launched when it failed (its entry names the first such); one it had launched may still
complete, and is probed as before.

Note [the verdict before the closed connections]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The rank whose probe gives the verdict first ends its wait and closes the group's gloo connections
(Note [closing the connections of an abandoned collective] in fusedist/comm/torch_comm.py). A peer whose
probe had not confirmed the same evidence yet then failed with gloo's "Connection closed by peer ...
typically caused by a remote worker crashing" as its first line -- a crash that never was -- and the
verdict only in the stall report below it: the closing rank had withdrawn its probe's entry and published
its failure entry only after closing. Now the probe publishes its failure entry, with the verdict
(``verdict``), as it gives it -- before anything ends the wait or closes a connection -- and the report's
entry keeps it. A wait that fails on a connection a peer closed reads the peers' entries once
(:func:`peer_verdict`: the failure path only) and, where one carries a verdict, raises that verdict,
naming the peer that gave it first; else the backend's error as before. Where a watched wait completed
just as its verdict was given, the probe's own entry is put back (``WaitProbe.retract``).

The wait is sliced in fusedist/comm/sliced_wait.py. Costs: none for a wait that ends before the
delay (one comparison; a DDP step measured the same with the probe on and off); past it, a store
write and a read per peer every ``PROBE_EVERY_S``, and the entry is withdrawn when the wait ends.
The store's timeout is left alone (training may be healthy). Only waits that can be sliced without
disturbing the collective are probed that way: gloo's own works and the gloo exchange's asynchronous
ones; synchronous exchanges and synchronous agreed all-reduces, which cannot be sliced, are probed from
a watcher thread (Note [probing waits that cannot be sliced] in fusedist/comm/watched_wait.py). A
direct-NCCL wait does not block the host: there the communicator's watchdog probes its oldest
pending collective instead, with the same probe (Note [probing stream-ordered waits for divergence] in
fusedist/comm/watchdog.py); a torch-NCCL wait is not probed. After the verdict the collectives left
pending still run until their deadline (a gloo transfer cannot be cancelled); when the error reaches
the top of the program, or the program that caught it calls ``sys.exit(n)``, the process ends at
once after its exit handlers, with status 1 (or ``n``), instead of waiting for them (Note [ending
after given-up collectives] in fusedist/comm/given_up_exit.py).
"""

from __future__ import annotations

import json
import time
from typing import Optional

from ..comm.group_ranks import global_ranks
from . import stall_report, wait_cycle

#: Seconds between two reads of the other ranks' entries while a wait goes on.
PROBE_EVERY_S = 0.25

#: The entry kinds that say where a rank is stuck: blocked in a collective, or failed in one (a peer
#: whose probe reached the verdict first has replaced its entry with its failure; crashed and
#: exited ranks close their connections, which ends the waits on them).
_STUCK = ("waiting", "checking", "failure")


def waiting_on(op: str, tag: str, seq: int, part=None, label=None, variant=None) -> dict:
    """The collective a rank's entry says it waits on, as :func:`diverged` compares it: with its part
    (what must match across ranks: this rank's tensor of the collective), its label (Note
    [exchange labels in the divergence probe]: only where it pairs the messages) and its variant (Note
    [reduce ops and roots in the divergence probe]), where known."""
    entry = {"op": op, "tag": tag, "seq": seq}
    if part is not None:
        entry["part"] = f"{part.numel()} x {part.dtype}"
    if label is not None:
        entry["label"] = label
    if variant is not None:
        entry["variant"] = variant
    return entry


class WaitProbe:
    """One blocking wait's probe (Note [divergence probe]): :meth:`check` after each slice of the
    wait, :meth:`close` when the wait ends either way."""

    #: How long the wait goes on between two checks.
    every_s = PROBE_EVERY_S

    def __init__(self, monitor, op: str, tag: str, seq: int, delay_s: float, part=None, label=None, variant=None):
        self.monitor, self.delay_s = monitor, delay_s
        self.waiting_on = waiting_on(op, tag, seq, part, label, variant)
        self._reports_before = len(monitor.reports)
        self._published: Optional[str] = None  # the kind of the entry this wait wrote
        self._evidence = None  # what the last read found, to be found again
        self._blocked: Optional[dict] = None  # this wait's record across groups, once published
        self._gave_verdict = False
        self._cycle: Optional[list] = None  # the waits of a cycle across groups the last read found

    def check(self) -> Optional[str]:
        """Publish this rank's place (once), read the others'; the verdict once confirmed, else None."""
        monitor = self.monitor
        if monitor.store is None or monitor.reports:
            return None  # (a rank that failed keeps its failure entry: Note [one entry per rank] in monitor.py)
        comm = monitor.comm
        if self._published is None:
            kind = "checking" if monitor.check_announced else "waiting"
            entry = {"kind": kind, "error": "", "context": monitor.context(), "recent": list(monitor.history),
                     "waiting_on": dict(self.waiting_on)}
            if not stall_report.publish(monitor.store, monitor.group_name, monitor.generation, comm.rank, entry,
                                        bounded=False):
                return None
            self._published = kind
            self._mine = entry
            # Note [waits across groups in the divergence probe] in wait_cycle.py
            wait_cycle.drop_kept()  # (a record kept after an earlier verdict: this one replaces it)
            self._blocked = wait_cycle.record(monitor, self.waiting_on)
            if self._blocked is not None and not wait_cycle.publish(monitor.store, self._blocked):
                self._blocked = None
        read = stall_report.read_entries(monitor.store, monitor.group_name, monitor.generation,
                                         [r for r in range(comm.world_size) if r != comm.rank])
        told = _failed_elsewhere(read, comm, self.waiting_on["seq"])
        if told is not None:  # Note [a peer that failed elsewhere, in the divergence probe]
            return self._verdict(
                f"{told}. It waits in no collective of this group, so this one can never complete; found by the "
                "divergence probe (FUSEDIST_DIVERGENCE_PROBE_S) instead of waiting out the collective timeout "
                f"({comm.timeout.total_seconds():g} s, FUSEDIST_TIMEOUT_S)")
        others = _stuck(read)
        found = None if others is None else diverged({comm.rank: self._mine, **others})
        if found is not None:
            evidence = tuple((r, e.get("kind"), e.get("time"), json.dumps(e.get("waiting_on"), sort_keys=True))
                             for r, e in sorted(others.items()))
            self._cycle = None
        elif others is None and self._blocked is not None:
            found, evidence, self._cycle = wait_cycle.find(monitor.store, self._blocked) or (None, None, None)
        if found is None:
            self._evidence = None
            return None
        now = time.monotonic()
        if self._evidence is None or self._evidence[0] != evidence:
            self._evidence = (evidence, now)
            return None
        if now - self._evidence[1] < max(PROBE_EVERY_S, self.delay_s / 4):
            return None  # (the same evidence must hold a while: a peer's entry may be about to go)
        where = (f"every rank of the group has been blocked in a collective for over {self.delay_s:g} s, in "
                 f"collectives that can never pair: {found}" if others is not None else
                 f"ranks of several groups have been blocked in collectives for over {self.delay_s:g} s, "
                 f"waiting for each other: {found}")
        return self._verdict(
            f"{where}. Their programs diverged (a backward, step or "
            "collective skipped or added on some ranks); found by the divergence probe "
            "(FUSEDIST_DIVERGENCE_PROBE_S) instead of waiting out the collective timeout "
            f"({comm.timeout.total_seconds():g} s, FUSEDIST_TIMEOUT_S)")

    def _verdict(self, verdict: str) -> str:
        """Publish ``verdict`` as this rank's failure entry, before the caller ends the wait (Note [the verdict
        before the closed connections]), and return it."""
        monitor = self.monitor
        entry = dict(self._mine, kind="failure", error=verdict[:400], verdict=verdict, verdict_of=monitor.comm.rank)
        stall_report.publish(monitor.store, monitor.group_name, monitor.generation, monitor.comm.rank, entry,
                             bounded=False)
        self._gave_verdict = True
        return verdict

    def retract(self) -> None:
        """The wait completed after all, as the verdict was given (a watched wait: Note [probing waits that cannot
        be sliced] in fusedist/comm/watched_wait.py): put back the entry the verdict replaced."""
        monitor = self.monitor
        if self._gave_verdict and not monitor.reports:
            stall_report.publish(monitor.store, monitor.group_name, monitor.generation, monitor.comm.rank, self._mine,
                                 bounded=False)
        self._gave_verdict = False

    def close(self) -> None:
        """Withdraw the ``waiting`` entry (a ``checking`` one is the check's to withdraw; the failure entry of a
        verdict, or one published since, replaced it and stays)."""
        monitor = self.monitor
        if self._published == "waiting" and len(monitor.reports) == self._reports_before and not self._gave_verdict:
            stall_report.withdraw(monitor.store, monitor.group_name, monitor.generation, monitor.comm.rank,
                                  bounded=False)
        if self._blocked is not None:  # (after a cycle's verdict it stays for the peers, until the next launch)
            if self._gave_verdict and self._cycle is not None:
                wait_cycle.keep(monitor.store, self._blocked, self._cycle)
            else:
                wait_cycle.withdraw(monitor.store, self._blocked["rank"])


def peer_verdict(monitor) -> Optional[tuple]:
    """(rank, verdict) of a peer of ``monitor``'s group whose probe gave a verdict (its failure entry carries it,
    and which rank gave it first: Note [the verdict before the closed connections]), else None. Read on a failure
    only."""
    comm = monitor.comm
    if monitor.store is None:
        return None
    entries = stall_report.read_entries(monitor.store, monitor.group_name, monitor.generation,
                                        [r for r in range(comm.world_size) if r != comm.rank])
    for rank, entry in sorted((entries or {}).items()):
        if (entry or {}).get("kind") == "failure" and entry.get("verdict"):
            return entry.get("verdict_of", rank), entry["verdict"]
    return None


def _stuck(entries: Optional[dict]) -> Optional[dict]:
    """``entries`` if every one of them says its rank is stuck in a collective, else None."""
    if entries is None:
        return None
    for entry in entries.values():
        if entry is None or entry.get("kind") not in _STUCK or "seq" not in (entry.get("waiting_on") or {}):
            return None  # (no entry, or a check's entry without its collective: not blocked for the delay yet)
    return entries


def _failed_elsewhere(entries: Optional[dict], comm, seq: int) -> Optional[str]:
    """Which peer of ``entries`` failed outside the group's collectives before launching collective ``seq``, and
    its message (Note [a peer that failed elsewhere, in the divergence probe]); None where none did."""
    for rank, entry in sorted((entries or {}).items()):
        entry = entry or {}
        message = entry.get("failed_elsewhere") if entry.get("kind") == "failure" else None
        if message and seq >= (entry.get("waiting_on") or {}).get("seq", seq):
            ranks = global_ranks(comm)
            where = f" (global rank {ranks[rank]})" if ranks is not None and rank < len(ranks) else ""
            return f"rank {rank}{where} failed elsewhere: {message}"
    return None


def diverged(entries: dict) -> Optional[str]:
    """Why the ranks of ``entries`` (rank -> blocked entry, every rank of the group) wait in
    collectives that cannot pair, or None when they may be at the same one. Ranks inside
    ``check_consistency()`` and ranks outside it are named first: that says which ranks skipped
    what the others run (their collectives then differ too)."""
    checking = sorted(r for r, e in entries.items() if (e.get("context") or {}).get("in_check"))
    if checking and len(checking) < len(entries):
        outside = sorted(set(entries) - set(checking))
        tags = {r: entries[r]["waiting_on"].get("tag") for r in sorted(entries)}
        return (f"ranks {checking} wait in check_consistency()'s collective, ranks {outside} in a collective "
                f"outside it (tags {tags}): a check pairs only with the others' check")
    # Note [exchange labels in the divergence probe], Note [reduce ops and roots in the divergence probe]:
    # each compared only where every rank published one.
    labelled = all("label" in entry["waiting_on"] for entry in entries.values())
    varied = all("variant" in entry["waiting_on"] for entry in entries.values())
    at: dict = {}
    for rank, entry in sorted(entries.items()):
        w = entry["waiting_on"]
        key = (w["seq"], w["op"], w.get("part"), w["variant"] if varied else None, w["label"] if labelled else None)
        at.setdefault(key, []).append(rank)
    if len(at) > 1:
        groups = sorted(at.items(), key=lambda item: item[1])  # (by their first rank)
        # (variants and labels named only where they differ)
        named_variant, named_label = (len({key[i] for key in at}) > 1 for i in (3, 4))
        where = "; ".join(f"ranks {ranks} in {op}{f' ({variant})' if named_variant else ''}"
                          f"{f' {label!r}' if named_label else ''} (collective #{seq}"
                          f"{f', {part} per rank' if part else ''})"
                          for (seq, op, part, variant, label), ranks in groups)
        if len({key[:4] for key in at}) == 1:
            what = "the same collective under different labels (whose messages never pair)"
        elif len({key[:3] for key in at}) == 1:
            reduces = groups[0][0][1] in ("all_reduce", "reduce_scatter")
            what = f"the same collective {'with different reduce ops' if reduces else 'from or to different roots'}"
        elif len({key[:2] for key in at}) == 1:
            what = "the same collective with parts of different sizes"
        else:
            what = "different collectives"
        return f"they wait in {what} -- {where}"
    return None
