"""One multi-process harness for every distributed test.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initializes a
process group in each through a ``file://`` rendezvous on a fresh temp file (no ports), runs
``fn(rank, world_size, *args, **kwargs)`` and returns the per-rank results in rank order.

Failures are never silent and never hang the test run: a rank that raises is reported with
its traceback (and the others' fate), and if any rank does not finish within ``timeout``
seconds all are killed and the report says which ranks were still running; once a rank has
failed, the others have the process group's timeout and ``grace_after_failure`` (10 s) more
(Note [a failed rank ends the run]; not with ``backend=None``, where ``fn`` makes the group).

``fn`` must be importable by name (a module-level function), because children are spawned.

Note [ranks forked from a server that imported torch]
    Starting a rank costs mostly ``import torch`` (about 2 s of CPU each, two ranks on two
    cores: the bulk of a small multi-rank test), and as much again for ``torch._dynamo``,
    which torch.optim imports with the first optimizer a rank builds. So on Linux the ranks
    are started by multiprocessing's *forkserver*, which imports both once and forks each
    rank from itself: a rank starts with torch loaded and nothing else -- no CUDA context, no
    process group, no thread -- as a spawned one would. Without a GPU the server also imports
    fusedist's packages and torch's distributed checkpoint, FSDP2 and tensor parallelism
    (``_LIBRARY_MODULES``, another half second per rank); fusedist reads its settings from the
    environment when it uses them, not at import, so a rank's own environment still decides
    them. With a GPU it does not: the check for one is all a server may do with CUDA before
    forking ranks that use it. (Triton, which
    dynamo imports, reads its settings such as ``TRITON_INTERPRET`` when they are used, so the
    rank's own environment still decides them.) What a forked rank does not
    inherit as a spawned one does is the caller's *current* environment (the server keeps
    the one it started with), so the caller's whole environment travels with each rank and
    replaces the inherited one before anything else runs. Variables torch itself reads while
    being imported are the server's; ``FUSEDIST_TEST_START=spawn`` starts every rank fresh.
    A forked rank also ends without the interpreter's shutdown (multiprocessing ends it with
    ``os._exit``), so it runs the exit handlers itself -- fusedist's drain of in-flight work,
    the reliability layer's exit entry, a test's own -- where a spawned rank would.

Note [a frozen heap for forked ranks]
    A forked rank starts with the server's heap: torch, dynamo and fusedist, millions of
    objects the cycle collector would scan on every full collection. The harness collects
    as a rank releases a process group that a reference cycle still holds, and fusedist as it
    releases a destroyed group such a cycle holds, each ~0.3 s of CPU per rank scanning that
    heap -- most of what a small test costs after its body. So the server ends its preloading
    with ``gc.freeze()``: those objects sit in the permanent generation, which the ranks
    inherit and no collection scans, as CPython's documentation advises for processes that
    fork without exec. What a rank allocates is collected as ever.

Note [callbacks still holding the group]
    A future's ``then`` callback runs on a gloo worker thread, which drops the callback after
    it has completed the future -- and dropping a Python callback takes the GIL. PowerSGD's
    callbacks capture the process group (its ``group_to_use``), so right after the last
    backward the group's last references can be such a callback, held by a worker thread
    waiting for the GIL while the rank's main thread runs on to ``destroy_process_group``.
    When the main thread next lets go of the GIL, that worker frees the group, whose
    destructor joins the worker threads, the current one included: ``std::system_error:
    Resource deadlock avoided`` and an abort after the test passed. (Seen once, in a whole
    suite's run, at the exit of a rank of the PowerSGD test that trains torch's DDP and
    fusedist's side by side; 48 reruns of the PowerSGD cases did not show it again, so this
    is the reading of the message, not a reproduction.) So the harness gives the worker
    threads a moment with the GIL released before it destroys the group: they drop what
    they hold, and the main thread frees the group.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import signal
import sys
import tempfile
import time
import traceback
import weakref
from typing import Any, Callable, Optional

from .launch_arguments import check_launch_arguments
from .shared_gpu import rank_environment, ranks_per_gpu_setting
from .thread_states import describe_threads, thread_states


#: a rank's faulthandler file (Note [a crashed rank's last words])
_FAULTS = None


class DistributedRunError(RuntimeError):
    """One or more ranks failed or timed out; ``failures`` maps rank -> traceback text."""

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures


def _child(rank, world_size, init_file, backend, pg_timeout_s, threads, env, fn, args, kwargs, results,
           forked=False):
    # A rank that dies in native code (a segfault in an extension, NCCL or the CUDA driver)
    # leaves no Python traceback; faulthandler writes every thread's stack instead, to a file
    # the harness puts in the report (Note [a crashed rank's last words]).
    global _FAULTS
    _FAULTS = open(_fault_file(init_file, rank), "w")  # (held to the end: faulthandler writes to its descriptor)
    faulthandler.enable(file=_FAULTS, all_threads=True)
    # ... and every thread's stack on the harness's signal before it kills a hung rank (Note [a hung rank's stacks])
    faulthandler.register(_STACKS_SIGNAL, file=_FAULTS, all_threads=True)
    # The caller's environment as it is now (Note [ranks forked from a server that imported
    # torch]). LOCAL_RANK first: ``env`` carries the rank's GPU sharing settings (LOCAL_RANK =
    # its device, NCCL_HOSTID, ...), set before this process makes its first NCCL call.
    os.environ.clear()
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    os.environ.update(env)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if backend == "nccl" and torch.cuda.is_available():
            # Bound before the group exists, so torch's NCCL and fusedist's communicator
            # use the rank's own device (several ranks may share one: Note [several ranks
            # on one GPU] in fusedist/testing/shared_gpu.py).
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        if backend is not None:
            dist.init_process_group(
                backend,
                init_method=f"file://{init_file}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=pg_timeout_s),
            )
        value = fn(rank, world_size, *args, **kwargs)
        # Plain pickle to bytes: torch's multiprocessing reducers would share tensors through
        # this process's file descriptors, which vanish when it exits.
        results.put((rank, True, _pickled_result(rank, fn, value)))
    except SystemExit as exc:  # Note [a rank that calls sys.exit]
        status = _exit_status(exc.code)
        if status == 0:
            results.put((rank, _EXITED, pickle.dumps(None)))
        else:
            results.put((rank, False, f"rank {rank} exited with code {status} (sys.exit({exc.code!r}))\n"
                                      + traceback.format_exc()))
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        results.put((rank, False, traceback.format_exc()))
    # The answer goes out before the group is destroyed (whose destructor waits for gloo's
    # workers, so for a collective still stuck on a failed run) and before interpreter
    # teardown (extension destructors, CUDA and NCCL shutdown), so a crash there is reported
    # as such, not as a rank that never answered.
    _release_process_group()
    results.close()
    results.join_thread()
    if forked:  # Note [ranks forked from a server that imported torch]: no interpreter exit follows
        import atexit

        atexit._run_exitfuncs()


def _pickled_result(rank: int, fn, value) -> bytes:
    """``value`` pickled, or a RuntimeError naming the rank, the function and the result's type (the bare
    pickling error named neither)."""
    try:
        return pickle.dumps(value)
    except Exception as exc:
        raise RuntimeError(f"rank {rank}: {getattr(fn, '__qualname__', fn)!s} returned a {type(value).__name__} "
                           f"that cannot be pickled back to the caller ({exc}); return plain data (tensors, "
                           "numbers, strings, lists, dicts)") from exc


#: a rank's answer flag for a clean ``sys.exit`` (result None): its peers' failures name it (Note [a rank that calls
#: sys.exit])
_EXITED = "exited"


def _exit_status(code) -> int:
    """The process exit status ``sys.exit(code)`` stands for, as the interpreter computes it.

    Note [a rank that calls sys.exit]
        A rank function may end itself with ``sys.exit`` as a script run by torchrun would. The
        harness catches the SystemExit (the rank must still answer and release its group), so
        it decides as a launcher would from the status: 0 (``sys.exit()``, ``sys.exit(0)``) is
        a clean end whose result is None, as with ``torch.multiprocessing.spawn``; any other
        status (an int, or a message, which exits with 1) fails the run naming the rank and
        the code. A peer that then fails in a collective the exited rank never joined read only
        "Connection closed by peer"; its failure now says which rank had ended so, and where.
    """
    if code is None:
        return 0
    if isinstance(code, int):
        return int(code)  # (True is 1)
    return 1


def _describe_exit(exitcode: int) -> str:
    """How a rank's process ended, for the report: multiprocessing gives ``-N`` for a process
    killed by signal N (an OOM killer's SIGKILL, a segfault), which reads better named."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name} (exit code {exitcode})"
    return f"exited with code {exitcode}"


#: The signal on which a rank writes every thread's stack (Note [a hung rank's stacks]).
_STACKS_SIGNAL = signal.SIGUSR1
#: How long the harness gives hung ranks to write their stacks before it kills them.
_STACKS_WAIT_S = 0.5


def _ask_for_stacks(procs: list) -> dict:
    """Have each of ``procs`` (hung ranks, about to be killed) write every thread's stack to its fault file;
    return ``pid -> what its threads were doing`` (Note [a hung rank's threads] in thread_states.py).

    Note [a hung rank's stacks]
        A rank still running when the run ends (past its deadline, or after another rank failed) is
        killed, and the report said only that: where it hung -- a collective no peer joined, a lock, a
        join -- was lost, and a hang seen once in a loaded CI run could not be told apart from a slow rank.
        So each rank registers faulthandler for a signal, and the harness sends it to the hung ranks
        (one wait for all) before killing them: the stacks land in the rank's fault file (Note [a crashed
        rank's last words]) and in its failure."""
    before = {p.pid: thread_states(p.pid) for p in procs}
    asked = False
    for p in procs:
        try:
            os.kill(p.pid, _STACKS_SIGNAL)
            asked = True
        except OSError:  # (it ended meanwhile)
            pass
    if asked:
        time.sleep(_STACKS_WAIT_S)
    return {p.pid: describe_threads(before[p.pid], thread_states(p.pid), _STACKS_WAIT_S) for p in procs}


def _fault_file(init_file: str, rank: int) -> str:
    """Where rank ``rank`` of the run rendezvousing at ``init_file`` writes faulthandler's report.

    Note [a crashed rank's last words]
        A forked rank's stderr is the fork server's, which under pytest is the capture of
        whichever test started the server: the stack faulthandler prints when a rank dies in
        native code (a heap corruption's abort, a segfault) reached no report, and a failed
        run said only "killed by SIGABRT without reporting". So each rank writes that stack
        to a file of its own; the harness puts it in the rank's failure (the report a CI log
        shows) and on its own stderr (which pytest shows with the failure)."""
    return f"{init_file}.rank{rank}.faults"


def _last_words(init_file: str, rank: int, limit: int = 6000) -> str:
    """The end of rank ``rank``'s faulthandler report ('' when it wrote none)."""
    try:
        with open(_fault_file(init_file, rank), errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    return text if len(text) <= limit else "[...]\n" + text[-limit:]


def _decoded(rank: int, ok: bool, value):
    """A rank's answer as ``(ok, result or report)``. A result that pickled in the rank but
    cannot be rebuilt here (its class is importable only there, a ``__reduce__`` that raises)
    is that rank's failure, reported as such -- not an exception out of the harness that drops
    the other ranks' outcomes and ignores ``expect_failure``."""
    if not ok:
        return ok, value
    try:
        return True, pickle.loads(value)
    except Exception:  # noqa: BLE001 - whatever unpickling raises is the rank's failure
        return False, f"rank {rank} returned a result that cannot be unpickled here:\n{traceback.format_exc()}"


def _release_process_group() -> None:
    """Destroy the process groups, also those ``fn`` initialized itself, and let fusedist drop
    its references to them, so torch frees them (and joins gloo's worker threads) now rather
    than during interpreter shutdown, where that can abort the process (Note [releasing
    destroyed groups] in ``fusedist/comm/__init__.py``); collects only where a reference
    cycle still holds one (Note [a collection only for a group still held])."""
    import gc

    import torch.distributed as dist

    if not dist.is_initialized():
        return
    groups = _weak_groups(dist)
    time.sleep(0.05)  # Note [callbacks still holding the group]
    dist.destroy_process_group()
    comm = sys.modules.get("fusedist.comm")
    if comm is not None:  # (where the destroy's own release did not run: hooks uninstalled)
        comm.release_destroyed_groups(collect=False)
    if any(group() is not None for group in groups):
        gc.collect()


# Note [a collection only for a group still held]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A group that a reference cycle holds (a model and its communicator, a test's own objects) is
# freed by a collection, which must come before interpreter shutdown (Note [releasing destroyed
# groups]). fusedist releases a destroyed group's communicator inside the destroy itself, so the
# harness cannot learn from that release whether anything still holds the group; it used to
# collect at every rank's exit. It now takes weak references to the groups before the destroy and
# collects only where one of them is still alive after it. A forked rank's collection is cheap
# (Note [a frozen heap for forked ranks]: 0.4 ms after a fully_shard and a DDP model's steps), a
# spawned rank's is not: 0.12-0.40 s of a trivial two-rank launch's rank (gloo, CPU, 2026-12-07).
def _weak_groups(dist) -> list:
    """Weak references to every process group torch has now (the default one at least)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = list(getattr(world, "pg_map", None) or ()) or [dist.group.WORLD]
    refs = []
    for group in groups:
        try:
            refs.append(weakref.ref(group))
        except TypeError:  # (a group that takes no weak reference: collect, as before)
            refs.append(lambda: True)
    return refs


def _rank_env(rank: int, per_gpu: int | None, env: dict[str, str] | None) -> dict[str, str]:
    """The rank's whole environment: the caller's current one, then the rank's GPU sharing
    settings, then the caller's ``env`` (a test that sets one of the variables itself, a
    fault test say, means it)."""
    shared = rank_environment(rank, per_gpu) if per_gpu is not None else {}
    for name, value in (env or {}).items():
        # (checked here: in the rank, os.environ would refuse it before the rank could report,
        # and every rank would read as "exited with code 1 without reporting")
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(f"run_distributed(env=...): environment variables are strings, got "
                            f"{name!r}={value!r} ({type(value).__name__}); pass {name!r}: {str(value)!r}")
    return {**os.environ, **shared, **(env or {})}


def _grace_after_failure(pg_timeout: float, grace: float) -> float:
    """How long the other ranks may run on once one rank failed (Note [a failed rank ends the run])."""
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace >= 0:
        raise ValueError(f"run_distributed(grace_after_failure={grace!r}): give the seconds (a number >= 0) the "
                         f"other ranks may run past the group's timeout once a rank has failed; default 10.0")
    return pg_timeout + grace


def _wait_for_answers(procs, results, outcome: dict, timeout: float, grace: Optional[float], exited: set):
    """Fill ``outcome`` with each rank's answer until all answered, ``timeout`` passed, or the
    others ran ``grace`` seconds past a rank's failure (None: no such limit, as when ``fn`` makes
    its own group, whose timeout the harness does not know); return None, or ``(failed rank,
    grace)`` when that ended the wait.

    Note [a failed rank ends the run]
        The wait wakes on whichever comes first, an answer or a rank's process ending (its
        sentinel), rather than polling: a rank that died without reporting (``os._exit``, a
        signal) is recorded as soon as it died, not half a second and a second poll later --
        a rank's answer is in the pipe before its process ends (it joins the queue's feeder
        thread first), so what is not there by then never comes. Once a rank has failed, the
        others have the group's timeout and ``grace_after_failure`` more (10 s by default: a
        survivor's report and teardown on a loaded machine) to end on their own, as a survivor
        does that sees the failure (gloo fails its collectives at once; the store's waits and
        fusedist's own within the group's timeout); one still running then is killed and
        reported so, as torchrun's agent ends every worker once one failed, instead of holding
        the run to its whole ``timeout`` (120 s by default)."""
    from multiprocessing.connection import wait

    deadline = time.monotonic() + timeout
    failed = None  # (rank, when) of the first failure
    while len(outcome) < len(procs):
        limit = deadline if failed is None or grace is None else min(deadline, failed[1] + grace)
        remaining = limit - time.monotonic()
        if remaining <= 0:
            return None if failed is None or limit == deadline else (failed[0], grace)
        # (every rank without an answer, the ended ones too: one that ended since the last look
        # wakes the wait at once, rather than being missed until the deadline)
        wait([results._reader] + [p.sentinel for r, p in enumerate(procs) if r not in outcome], timeout=remaining)
        _take_answers(results, outcome, 0.0, exited)
        for rank, p in enumerate(procs):
            if rank not in outcome and not p.is_alive():
                _take_answers(results, outcome, 0.05, exited)  # (a last look: its answer cannot still be on the way)
                if rank not in outcome:
                    outcome[rank] = (False, f"rank {rank} {_describe_exit(p.exitcode)} without reporting")
        if failed is None:
            first = [r for r, (ok, _) in outcome.items() if not ok]
            if first:
                failed = (min(first), time.monotonic())
    return None


def _take_answers(results, outcome: dict, wait_s: float, exited: set) -> None:
    """Every answer already in the queue (the first waited for up to ``wait_s`` seconds); the ranks that
    ended with a clean ``sys.exit`` are added to ``exited``."""
    while True:
        try:
            rank, ok, value = results.get(timeout=wait_s) if wait_s else results.get_nowait()
        except queue_mod.Empty:
            return
        outcome[rank] = _decoded(rank, ok, value)
        if ok == _EXITED:
            exited.add(rank)
        wait_s = 0.0


#: ``FUSEDIST_TEST_START``'s values (the first is the default)
START_METHODS = ("forkserver", "spawn")


def _requested_start() -> str:
    """``FUSEDIST_TEST_START``, checked: a misspelt ``spawn`` would otherwise fork ranks from
    the server silently, the very thing the setting exists to rule out."""
    raw = os.environ.get("FUSEDIST_TEST_START", "")
    value = raw.strip().lower() or START_METHODS[0]
    if value not in START_METHODS:
        raise ValueError(f"FUSEDIST_TEST_START={raw!r} is not one of {', '.join(START_METHODS)}")
    return value


def _start_context():
    """Note [ranks forked from a server that imported torch]."""
    if _requested_start() == "spawn" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    preload = ["torch", "torch._dynamo"]
    import torch

    if not torch.cuda.is_available():  # (a server that touched CUDA could not fork ranks that use it)
        preload += _LIBRARY_MODULES
    # last: Note [a frozen heap for forked ranks]
    ctx.set_forkserver_preload(preload + ["fusedist.testing._frozen_heap"])
    return ctx


#: what nearly every rank imports, loaded once by the fork server (Note [ranks forked from a
#: server that imported torch])
_LIBRARY_MODULES = ["fusedist", "fusedist.ddp", "fusedist.fsdp", "fusedist.zero", "fusedist.optim", "fusedist.amp",
                    "fusedist.nn", "fusedist.checkpoint", "torch.distributed.checkpoint", "torch.distributed.fsdp",
                    "torch.distributed.tensor.parallel"]


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = "gloo",
    timeout: float = 120.0,
    pg_timeout: float = 30.0,
    grace_after_failure: float = 10.0,
    threads: int = 1,
    env: dict[str, str] | None = None,
    expect_failure: bool = False,
    ranks_per_gpu: int | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn`` on ``world_size`` spawned ranks; return results in rank order.

    Args:
        backend: process-group backend, or None to leave initialization to ``fn``.
        timeout: wall-clock limit for the whole run; ranks still running are killed.
        pg_timeout: the process group's collective timeout (seconds); once a rank has failed, the
            others have this and ``grace_after_failure`` more to end, then are killed (Note [a failed
            rank ends the run]).
        grace_after_failure: seconds past ``pg_timeout`` the other ranks have once a rank has failed
            (default 10, room for a survivor to report and tear down on a loaded machine); a test
            of that very kill can make it small. Unused with ``backend=None``.
        threads: torch intra-op threads per rank (1 keeps the ranks from oversubscribing the cores).
        env: extra environment variables for the children.
        expect_failure: return a list of ``("error", traceback)`` / ``("ok", value)`` pairs
            instead of raising when ranks fail (for tests of failure behaviour); a rank is
            ``"error"`` exactly when it would fail the run without this flag (a crash at exit
            after answering included).
        ranks_per_gpu: place this many consecutive ranks on each GPU, with the NCCL settings
            that allow it (:func:`fusedist.testing.shared_gpu.rank_environment`); default
            ``FUSEDIST_TEST_RANKS_PER_GPU``, else one rank per GPU. With backend ``"nccl"``
            each rank's device is made current before the group is created.

    A rank that ends with ``sys.exit(0)`` or ``sys.exit()`` returns None; any other status
    fails the run naming the rank and the code (Note [a rank that calls sys.exit]).
    """
    check_launch_arguments(world_size, timeout, pg_timeout)
    per_gpu = ranks_per_gpu if ranks_per_gpu is not None else ranks_per_gpu_setting()
    grace = _grace_after_failure(pg_timeout, grace_after_failure)  # (checked before any rank starts)
    if backend is None:
        grace = None  # (``fn`` makes the group: its timeout is not ``pg_timeout``)
    ctx = _start_context()
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="fusedist-rdzv-")
    os.close(fd)
    os.unlink(init_file)  # the file store creates it
    procs = []
    outcome: dict[int, tuple[bool, Any]] = {}
    exited: set = set()  # ranks that ended with sys.exit(0) (Note [a rank that calls sys.exit])
    ended = None
    hung_threads: dict = {}  # pid of a hung rank -> what its threads were doing (Note [a hung rank's threads])
    try:
        for rank in range(world_size):
            p = ctx.Process(
                target=_child,
                args=(rank, world_size, init_file, backend, pg_timeout, threads,
                      _rank_env(rank, per_gpu, env), fn, args, kwargs, results,
                      ctx.get_start_method() == "forkserver"),
                daemon=True,
            )
            p.start()
            procs.append(p)
        ended = _wait_for_answers(procs, results, outcome, timeout, grace, exited)
    finally:
        killed = set()
        hung_alive = [p for rank, p in enumerate(procs) if rank not in outcome and p.is_alive()]
        hung_threads = _ask_for_stacks(hung_alive)  # Note [a hung rank's stacks]
        for rank, p in enumerate(procs):
            if rank not in outcome and p.is_alive():  # past the deadline: nothing more will come
                p.kill()
                killed.add(rank)
        last = time.monotonic() + 5  # (one wait for all: each rank tears down at the same time)
        for p in procs:
            p.join(timeout=max(0.0, last - time.monotonic()))
        for rank, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
                killed.add(rank)
        words = {r: _last_words(init_file, r) for r in range(world_size)}
        for path in [init_file] + [_fault_file(init_file, r) for r in range(world_size)]:
            if os.path.exists(path):
                os.unlink(path)

    hung = [r for r in range(world_size) if r not in outcome]
    failures = {r: v for r, (ok, v) in outcome.items() if not ok}
    for r, p in enumerate(procs):
        # A rank that answered and then crashed while exiting (a destructor, NCCL or CUDA
        # teardown) fails the run: a crash at exit is a bug users meet too. One still exiting
        # after 5 s was killed here (destroying a group waits for a collective still stuck in
        # a failure test); that is not its own crash.
        if r in outcome and outcome[r][0] and r not in killed and p.exitcode not in (0, None):
            failures[r] = f"rank {r} returned its result, then {_describe_exit(p.exitcode)} while shutting down"
    for r in failures:
        if words[r] and r not in killed:  # Note [a crashed rank's last words]
            sys.stderr.write(f"--- rank {r}: faulthandler ---\n{words[r]}\n")
            failures[r] += f"\nits faulthandler report:\n{words[r]}"
    for r in hung:
        failures[r] = (f"rank {r} did not finish within {timeout:g} s (killed)" if ended is None else
                       f"rank {r} was still running {ended[1]:.0f} s after rank {ended[0]} failed (killed: a failed "
                       f"rank ends the run, as torchrun ends a job; the group's timeout was {pg_timeout:.0f} s)")
        if words[r]:  # Note [a hung rank's stacks]
            failures[r] += f"\nwhere its threads were when it was killed:\n{words[r]}"
        if hung_threads.get(procs[r].pid):  # Note [a hung rank's threads] in thread_states.py
            failures[r] += f"\n{hung_threads[procs[r].pid]}"
    for r in failures:
        if exited - {r}:  # Note [a rank that calls sys.exit]
            failures[r] += (f"\n(rank(s) {sorted(exited - {r})} had ended with sys.exit(0), result None: a collective "
                            "they did not join fails on their peers, e.g. with 'Connection closed by peer')")
    if expect_failure:
        return [("error", failures[r]) if r in failures else ("ok", outcome[r][1])
                for r in range(world_size)]
    if failures:
        lines = [f"{len(failures)} of {world_size} ranks failed" + (f"; hung: {hung}" if hung else "")]
        for r in sorted(failures):
            lines.append(f"--- rank {r} ---\n{failures[r]}")
        raise DistributedRunError("\n".join(lines), failures)
    return [outcome[r][1] for r in range(world_size)]
