"""The persist half of an asynchronous save: one background thread, one save in flight.

Serialization, checksums, fsyncs and the manifest run on a daemon thread while training
goes on (the CheckFreq snapshot/persist split; torch DCP's ``async_save``). Its coordination
between ranks uses a process group of its own (:class:`Coordinator`), never the training
group: collectives on one group must be issued in the same order by every rank, and a
background thread's exchanges would interleave unpredictably with DDP's.

A save that fails records its error, raised in the training thread at the next
``wait()``. At interpreter exit, and when ``destroy_process_group()`` is called, an unfinished
save is waited for (so a normal end never loses the last checkpoint: Note [a destroy waits for
the save in flight] in ``_destroy_waits.py``); a process killed mid-save leaves a directory
without a manifest, which the next start skips.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import threading
import time
import weakref
from typing import Callable, Optional

import torch.distributed as dist

from ..comm import aborted_groups, get_communicator
from ..comm.objects import all_gather_object, broadcast_object
from ..distributed import collective_timeout
from .._exit_codes import flush_files
from .._process_hooks import at_exit
from . import _destroy_waits, _exit_status


class Coordinator:
    """Rank, world size and object exchanges for checkpoint saves, on a dedicated gloo group
    (created collectively: every rank constructs it at the same point of the program). The
    exchanges go through the group's communicator: bounded by the collective timeout, and a
    rank missing from one is named in a StallError whose report says where each rank is."""

    NAME = "fusedist.checkpoint.Checkpointer"

    def __init__(self, process_group=None, silence: Optional[float] = None):
        self.comm = None
        self.silence = peer_silence(silence, f"{self.NAME}(peer_silence_s=...)")
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.ranks, self.group = _checkpoint_group(process_group)
            self.rank, self.size = self.ranks.index(dist.get_rank()), len(self.ranks)
            if self.size > 1:
                self.comm = get_communicator(self.group)
        else:
            self.rank, self.size, self.group, self.ranks = 0, 1, None, [0]
        from ._io_rounds import IOWaits

        self._io = IOWaits(self) if self.comm is not None else None

    @contextlib.contextmanager
    def io_round(self):
        """The background part of one save (Note [waiting for a peer's I/O]): this rank shows
        it is alive while inside, and leaves only once every rank is done with its own I/O."""
        if self._io is None:
            yield
            return
        from ._files import CheckpointError

        self._io.start()
        try:
            yield
        except CheckpointError as exc:
            # A failure every rank agreed on: the ranks are alive, rank 0 may still clean up.
            # Not one of a rank gone silent, or of a failed collective (a peer died): waiting
            # for it would only add the collective timeout. Nor one of a barrier given up on:
            # its slow rank leaves at that barrier too (Note [a save given up on]).
            self._io.unsettled = bool(getattr(exc, "given_up", False))
            if getattr(exc, "silent_ranks", None) is None and not self._io.unsettled:
                with contextlib.suppress(Exception):  # the error on its way says more
                    self._io.wait("the failed save")
                    self.all_gather(None, "failed save finished")
            raise
        else:
            self._io.wait("the save (its retention)")
            self.all_gather(None, "save finished")
            self._io.left_together = True
        finally:
            self._io.stop()

    def close(self) -> None:
        """Remove the store keys of this Coordinator's saves that no rank reads any more (Note [the
        keys a Checkpointer leaves at close]); not a collective, so each rank removes them alone."""
        if self._io is not None:
            self._io.close()

    def settle(self) -> None:
        """Before the next save's first exchange: wait until every rank has left a save given up
        on (Note [a save given up on]); no-op otherwise."""
        if self._io is not None:
            self._io.settle()

    def io_wait(self, what: str) -> None:
        """Wait, however long their disks take, until every rank is done with the I/O before
        the exchange ``what`` (Note [waiting for a peer's I/O]); no-op on a single rank."""
        if self._io is not None:
            self._io.wait(what)

    def all_gather(self, obj, what: str = "exchange") -> list:
        if self.comm is None:
            return [obj]
        return all_gather_object(self.comm, obj, tag=f"{self.NAME} {what}")

    def broadcast(self, obj, what: str = "broadcast from rank 0"):
        """Rank 0's ``obj`` on every rank."""
        if self.comm is None:
            return obj
        return broadcast_object(self.comm, obj, 0, tag=f"{self.NAME} {what}")


# Note [a Checkpointer per pipeline stage]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A Checkpointer saves one model for its group: by default the whole job. Under pipeline
# parallelism each stage's ranks hold another model (other parameters, sharded over that
# stage's data-parallel group), so each stage takes a Checkpointer of its own, over its
# ranks and with a root of its own (``process_group=``: the stage's data-parallel group, or
# its mesh -- ``mesh["dp", "tp"]`` -- when the stage is also tensor-parallel or HSDP, whose
# checkpoints are written by every rank of the mesh). Creating a process group is a
# collective of the whole job in which every rank names the same ranks, so the ranks first
# exchange the groups they ask for (over a gloo group of the whole job, made first as
# before, bounded by the collective timeout), check that they split the job (each rank in
# exactly one), and then every rank creates every group in one order and keeps its own. A
# problem on any rank is raised on every rank. With ``pipeline=True`` the stages share one root
# instead (Note [pipelined checkpoints] in pipeline.py): the coordinator is the whole job's,
# and the stage's group, made as above, only says which ranks save each part.
def _checkpoint_group(process_group) -> tuple:
    """This rank's group's ranks (ascending) and its gloo group, once every rank created every
    asked-for group (Note [a Checkpointer per pipeline stage])."""
    from torch.distributed.device_mesh import DeviceMesh

    from ..comm.objects import all_gather_object as gather

    me, world = dist.get_rank(), dist.get_world_size()
    whole_job = dist.new_group(backend="gloo", timeout=collective_timeout())
    mine, problem = list(range(world)), None
    if isinstance(process_group, DeviceMesh):  # e.g. mesh["dp", "tp"]: every rank of the stage's mesh
        mine = sorted(int(r) for r in process_group.mesh.flatten().tolist())
    elif process_group is not None:
        mine = sorted(dist.get_process_group_ranks(process_group))
    if me not in mine:
        problem = f"rank {me}'s process_group {mine} does not hold it; pass the group of the rank's pipeline stage"
    asked = gather(get_communicator(whole_job), (mine, problem), tag=f"{Coordinator.NAME} groups")
    problem = next((p for _, p in asked if p is not None), None)
    groups = sorted({tuple(g) for g, _ in asked})
    if problem is None:
        holders = {r: [list(g) for g in groups if r in g] for r in range(world)}
        bad = {r: g for r, g in holders.items() if len(g) != 1}
        if bad:
            r = next(iter(bad))
            problem = (f"the ranks' process groups {[g for g, _ in asked]} do not split the job into disjoint groups "
                       f"(rank {r} is in {bad[r]}); give each pipeline stage's ranks one group")
    if problem is not None:
        raise ValueError(f"{Coordinator.NAME}: {problem}")
    if groups == [tuple(range(world))]:
        return mine, whole_job
    made = {g: dist.new_group(ranks=list(g), backend="gloo", timeout=collective_timeout()) for g in groups}
    return mine, made[tuple(mine)]


# Note [waiting for a peer's I/O]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A save writes files and then exchanges the outcome with the other ranks. Were the
# exchange's collective deadline (FUSEDIST_TIMEOUT_S) counted while a peer still writes, one
# slow write (a busy shared filesystem, a large shard) would end the exchange on the waiting
# rank -- and a gloo group whose collective failed closes its connections: every later save of
# a Checkpointer failed, and a ``fusedist.checkpoint.save`` broke the training group itself.
# Torch DCP bounds these waits by its process group's timeout only (30 minutes by default). So
# before each exchange that follows I/O (a Checkpointer's background part, and ``save``'s), every
# rank first arrives at a barrier in the job's store, and waits there for as long as the missing
# ranks show they are alive: each process renews a beat key while a save of it runs, and a
# missing rank is given up on after its beat stopped for SILENT_AFTER_S (its process ended;
# FUSEDIST_CHECKPOINT_PEER_SILENCE_S or a Checkpointer's ``peer_silence_s`` sets it: peer_silence),
# or once it kept writing for IO_LIMIT_S (its disk hangs) -- an error that names it. The
# exchange itself starts once every rank arrived, well within its deadline. A Checkpointer save also
# ends at such a barrier, so the next save's exchanges never wait on a peer's retention, and
# then at one small exchange: a barrier in the store alone would let the first rank to see
# it complete leave -- and exit, ending the store it may host -- before a slower rank polled.
class IOBarrier:
    """Store barriers between the I/O of the ranks of one group (Note [waiting for a peer's
    I/O]): ``name`` is the same on every rank and new for each run of the group's saves."""

    def __init__(self, store, name: str, rank: int, ranks: list, who: str = Coordinator.NAME,
                 silence: Optional[float] = None):
        self.store, self.rank, self.ranks, self.who = store, rank, ranks, who
        # seconds a peer's beat may stop before it is given up on (:func:`peer_silence`)
        self.silence = SILENT_AFTER_S if silence is None else silence
        self.prefix, self.phase = f"{_PREFIX}/{name}", 0
        self._beating = False

    def start_beat(self) -> None:
        """Renew this process's beat until :meth:`stop_beat` (the peers' waits read it)."""
        if not self._beating:
            self._beating = True
            _Beat.acquire(self.store)

    def stop_beat(self) -> None:
        if self._beating:
            self._beating = False
            _Beat.release()

    def wait_beating(self, what: str) -> None:
        """:meth:`wait`, beating meanwhile (a wait outside a save's rounds, at one more barrier
        of a save given up on, so the ranks still writing it see this one alive)."""
        self.start_beat()
        try:
            self.wait(what)
        finally:
            self.stop_beat()

    def wait(self, what: str) -> None:
        """Arrive at the next barrier; return once every rank has, or raise a CheckpointError
        naming the ranks whose process showed no sign of life for the collective timeout, or
        saying that a rank gave up on the barrier (Note [a save given up on])."""
        from ._files import CheckpointError

        self.phase += 1
        key, size = f"{self.prefix}/{self.phase}", len(self.ranks)
        outcome = f"{key}/outcome"
        arrived, limit = self.store.add(key, 1), collective_timeout().total_seconds()
        silence = min(limit, self.silence)  # a beat renewed every second or faster stopped: gone
        seen: dict = {}
        started = next_check = time.monotonic()
        give_up = started + max(limit, IO_LIMIT_S)
        pause = 0.005
        while arrived < size:
            time.sleep(pause)
            pause = min(0.1, pause * 2)
            arrived = self.store.add(key, 0)
            now = time.monotonic()
            if arrived < size and now >= next_check:
                next_check = now + min(1.0, limit / 4)
                if self.store.check([outcome]):  # another rank gave up on this barrier
                    break
                # Note [an abort told to waits in the store] in fusedist/comm/aborted_groups.py
                peers = [r for r in self.ranks if r != self.ranks[self.rank]]
                aborted = aborted_groups.aborted_peers(self.store, peers)
                if aborted:
                    self._decide(outcome, _GIVEN_UP + f"{self.who}: rank {self.ranks[self.rank]}: waiting for the "
                                 f"other ranks to be done with {what}, {'; '.join(aborted.values())}: it will not "
                                 "arrive")
                    break
                silent = self._silent(seen, started, now, silence)
                if not silent and now > give_up:
                    message = (
                        f"{self.who}: rank {self.ranks[self.rank]}: the other ranks were not done with {what} "
                        f"after {now - started:.0f} s; their storage seems to hang (a save waits at most "
                        f"{give_up - started:g} s for another rank's writes: the longer of FUSEDIST_TIMEOUT_S and "
                        f"{IO_LIMIT_S:g} s, torch's default process group timeout)")
                    self._decide(outcome, _GIVEN_UP + message)
                    break
                if silent:
                    error = CheckpointError(
                        f"{self.who}: rank {self.ranks[self.rank]}: waiting for the other ranks to be done "
                        f"with {what}, rank(s) {silent} showed no sign of life for {silence:g} s (their beat, renewed "
                        "every second while a save runs, stopped): their process ended or hangs (how long a beat "
                        f"may stop: {SILENCE_ENV} or Checkpointer(peer_silence_s=), FUSEDIST_TIMEOUT_S if shorter)")
                    error.silent_ranks = silent
                    raise error
        decided = self._decide(outcome, _PASSED)
        if decided != _PASSED:
            raise _given_up(decided[len(_GIVEN_UP):], self.ranks[self.rank])

    def _decide(self, outcome: str, decision: str) -> str:
        """The barrier's outcome: ``decision`` where this rank decides first, else the one decided
        first -- atomically, so a rank giving up and the last rank arriving cannot both win."""
        try:
            value = self.store.compare_set(outcome, "", decision)
        except (RuntimeError, NotImplementedError):  # a store without it: each rank keeps its own
            return decision
        return value.decode() if isinstance(value, bytes) else str(value)

    def forget(self, phases: int) -> None:
        """Remove the keys of this barrier's first ``phases`` phases (once every rank left them)."""
        for phase in range(1, phases + 1):
            self.forget_phase(phase)

    def forget_phase(self, phase: int) -> None:
        """Remove the keys of ``phase`` (once every rank left it: a rank still waiting would
        recreate them and wait on)."""
        for key in (f"{self.prefix}/{phase}", f"{self.prefix}/{phase}/outcome"):
            with contextlib.suppress(Exception):  # keys only take space
                self.store.delete_key(key)

    def _silent(self, seen: dict, started: float, now: float, limit: float) -> list:
        """The job's ranks whose beat has not changed for ``limit`` seconds."""
        silent = []
        for r in self.ranks:
            if r == self.ranks[self.rank]:
                continue
            key = _beat_key(r)
            value = self.store.get(key) if self.store.check([key]) else None
            if r not in seen or seen[r][0] != value:
                seen[r] = (value, now if r in seen else started)
            elif now - seen[r][1] > limit:
                silent.append(r)
        return silent


# Note [a save given up on]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# A rank that gave up waiting at a barrier after IO_LIMIT_S (a peer's storage hangs) used to
# leave the save alone; the peer, its write done at last, passed the barrier (every rank had
# arrived) into the exchange after it, which the other rank had left: from then on the ranks
# were one exchange apart, and every later save of the job failed with "the ranks are in
# different exchanges", as if the user's code called them in another order. So each barrier
# has an outcome, decided once, atomically (``compare_set``): passed by the last rank to
# arrive, or given up on by a rank that waited too long. Every rank follows it: a rank that
# arrives after the barrier was given up on raises the giving-up rank's error too, and no rank
# runs the save's closing exchanges (as for a silent rank). The ranks leave that save at the
# same point; a Checkpointer's next save first waits at one more barrier of it (``settle``, as
# long as the slow ranks show they are alive, up to IO_LIMIT_S again), so that its exchanges
# never time out on a rank still writing, and then starts afresh on every rank.
_PASSED = "passed"
_GIVEN_UP = "given up: "


def _given_up(message: str, rank: int):
    """The CheckpointError of a barrier given up on (Note [a save given up on]), on ``rank``."""
    from ._files import CheckpointError

    error = CheckpointError(f"{message}; the save was given up on every rank (raised on rank {rank}), and the next "
                            "save starts afresh once the slow writes have ended")
    error.given_up = True
    return error


_PREFIX = "fusedist/checkpoint-io"
IO_LIMIT_S = 1800.0  # the longest wait for another rank's writes (Note [waiting for a peer's I/O])
# A rank whose beat has not changed for this long (or FUSEDIST_TIMEOUT_S, if shorter) has ended
# or hangs: its beat thread renews it every second or faster, even while the rank writes (file
# writes release the GIL), so ten missed renewals are not a slow disk. Not the collective timeout
# (600 s by default): a rank killed mid-save was then waited for ten minutes, where the failed
# exchange used to tell at once. The default of SILENCE_ENV and of a Checkpointer's
# ``peer_silence_s`` (:func:`peer_silence`).
SILENT_AFTER_S = 10.0
SILENCE_ENV = "FUSEDIST_CHECKPOINT_PEER_SILENCE_S"
# The shortest silence accepted: a beat is renewed each second, and a busy host (a rank's
# training thread holding the GIL through a long kernel launch) delays a renewal now and then;
# below two renewals a live rank writing a large file would be given up on.
MIN_SILENCE_S = 2.0


def peer_silence(value: Optional[float] = None, what: str = SILENCE_ENV) -> float:
    """How long, in seconds, a peer's beat may stay unchanged during a save before its rank is
    given up on as ended (Note [waiting for a peer's I/O]): ``value`` when given (named ``what``
    in errors), else ``FUSEDIST_CHECKPOINT_PEER_SILENCE_S``, else :data:`SILENT_AFTER_S`. A
    shorter silence reports a killed rank sooner; a longer one tolerates a host so loaded that
    a beat thread is not scheduled for seconds. ValueError unless a finite number of seconds,
    at least :data:`MIN_SILENCE_S`."""
    seconds = math.nan
    if value is None:
        raw = os.environ.get(SILENCE_ENV)
        if raw is None:
            return SILENT_AFTER_S
        value, what = raw, SILENCE_ENV
        with contextlib.suppress(ValueError):
            seconds = float(raw)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):  # (an argument: a number, not text)
        seconds = float(value)
    if not (math.isfinite(seconds) and seconds >= MIN_SILENCE_S):
        raise ValueError(f"{what} must be a finite number of seconds of at least {MIN_SILENCE_S:g} (a peer's beat "
                         f"is renewed each second), got {value!r}")
    return seconds


def _beat_key(rank: int) -> str:
    return f"{_PREFIX}/alive/{rank}"


class _Beat:
    """This process's sign of life in the store, renewed while any save of it runs."""

    lock = threading.Lock()
    users = 0
    stop: Optional[threading.Event] = None

    @classmethod
    def acquire(cls, store) -> None:
        with cls.lock:
            cls.users += 1
            if cls.stop is None:
                cls.stop = threading.Event()
                threading.Thread(target=cls._run, args=(store, cls.stop), name=f"{_PREFIX} beat", daemon=True).start()

    @classmethod
    def release(cls) -> None:
        with cls.lock:
            cls.users = max(0, cls.users - 1)
            if cls.users == 0 and cls.stop is not None:
                cls.stop.set()
                cls.stop = None

    @staticmethod
    def _run(store, stop: threading.Event) -> None:
        key, count = _beat_key(dist.get_rank()), 0
        while True:
            count += 1
            with contextlib.suppress(Exception):  # a store that fails: the peers' waits report it
                store.set(key, str(count))
            if stop.wait(min(1.0, collective_timeout().total_seconds() / 4)):
                return


def io_barrier(name: str, rank: int, ranks: list, who: str = Coordinator.NAME,
               silence: Optional[float] = None) -> Optional[IOBarrier]:
    """An :class:`IOBarrier` in the job's store, None without one (then the exchanges wait as
    any collective does); ``who`` is what its errors say they come from, ``silence`` how long a
    peer's beat may stop (:func:`peer_silence`)."""
    from ..reliability.stall_report import default_store

    store = default_store()
    if store is None or len(ranks) < 2:
        return None
    return IOBarrier(store, name, rank, ranks, who, peer_silence(silence, who))


def stage_group(process_group) -> tuple:
    """The ranks of this rank's pipeline stage and a gloo group over them, for a pipelined
    Checkpointer (Note [pipelined checkpoints] in ``pipeline.py``): ``process_group``'s (split
    and checked as above), the whole job's without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return [0], None
    if process_group is None:
        return list(range(dist.get_world_size())), None
    return _checkpoint_group(process_group)


class BackgroundWriter:
    """Runs one job at a time on a daemon thread; errors surface at :meth:`wait`."""

    def __init__(self, name: str):
        self.name = name
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.started = self.finished = 0.0
        _live.add(self)
        at_exit("finish checkpoint writes", _finish_at_exit)  # fusedist/_process_hooks.py
        _finish_before_exit_handlers()  # Note [a save that fails at exit]
        _destroy_waits.install(_join_live)  # Note [a destroy waits for the save in flight]

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Callable[[], None]) -> None:
        if self.busy:
            raise RuntimeError(f"{self.name}: a save is already in flight; wait() for it first")

        def run():
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread
                self._error = exc
            finally:
                self.finished = time.perf_counter()

        self._error = None
        self.started = time.perf_counter()
        _exit_status.watch()  # Note [the status of a save lost at exit] in _exit_status.py
        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()

    def join(self) -> None:
        """Block until the job in flight (if any) is done, keeping its error for :meth:`wait`."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def wait(self) -> None:
        """Block until the job in flight (if any) is done; raise its error, once."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if not any(w._thread is not None or w._error is not None for w in list(_live)):
            _exit_status.unwatch()  # (no save in flight: sys.exit is Python's own again)
        if error is not None:
            raise error


_live: "weakref.WeakSet[BackgroundWriter]" = weakref.WeakSet()


def _join_live() -> None:
    """Let every save in flight of this process end (Note [a destroy waits for the save in flight])."""
    for writer in list(_live):
        writer.join()


def _finish_at_exit(status: Optional[int] = None) -> bool:
    """Let the saves in flight end (Note [a save that fails at exit]); True where one failed. ``status``:
    the program's, where the process will end by :func:`_end_failed` (its error says what it becomes)."""
    lost = False
    for writer in list(_live):
        try:
            writer.wait()
        except BaseException as exc:  # noqa: BLE001 - too late to raise; say what was lost
            lost = True
            print(f"{writer.name}: the checkpoint being written at exit was not completed: "
                  f"{type(exc).__name__}: {exc} (call the Checkpointer's wait() or close() before "
                  "destroy_process_group() and exit: the save needs the process group to finish)"
                  + ("" if status is None else f"; {_exit_status.words(status)}"), flush=True)
    return lost


# Note [a save that fails at exit]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A save still in flight when the program ends is finished at exit; when it fails there (a peer
# died, the group was destroyed) the checkpoint is lost, yet the process ended with status 0 and a
# job scheduler took the run for a success. An exit handler cannot change the interpreter's status,
# and one that ends the process itself must run first among the exit handlers and run the others
# (the interpreter runs them newest first, and a handler registered while they run never runs; one
# run in the middle would run the newer ones twice). So the saves are finished earlier, at the
# start of the interpreter's shutdown (threading's exit callbacks, before the exit handlers): where
# one failed, a handler registered then is the newest; it runs the others, once, flushes the
# standard streams and ends the process with status 1 (or the program's own non-zero status: Note [the
# status of a save lost at exit] in _exit_status.py) -- as fusedist/comm/given_up_exit.py ends a
# process whose collectives were given up. The exit handler above stays for what remains (a writer
# made during the shutdown): it can only say what was lost.
_thread_exit_registered = False


def _finish_before_exit_handlers() -> None:
    """Register, once, the finishing of the saves at the start of the interpreter's shutdown."""
    global _thread_exit_registered
    register = getattr(threading, "_register_atexit", None)
    if _thread_exit_registered or register is None:
        return
    try:
        register(_finish_at_shutdown)
        _thread_exit_registered = True
    except RuntimeError:  # (the shutdown has begun: the exit handler finishes them)
        pass


def _finish_at_shutdown() -> None:
    status = _exit_status.program_status()  # (main has ended: its sys.exit, if any, was noted)
    if _finish_at_exit(status):
        atexit.register(_end_failed, status)  # the newest exit handler: it runs first


def _end_failed(status: int) -> None:
    atexit.unregister(_end_failed)
    atexit._run_exitfuncs()  # (every other handler, once: none has run yet)
    flush_files()  # (what os._exit would leave unwritten: a log file the program never closed too)
    _exit_status.end(status)  # 1 for 0, else the program's (Note [the status of a save lost at exit])
