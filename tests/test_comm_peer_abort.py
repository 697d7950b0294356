"""A peer that aborts its process groups, or whose process ends, fails a rank's collective at once, naming it.

* Rank 1 aborts its groups (``_abort_process_group()``, or one subgroup) while rank 0 waits in a fusedist all-reduce
  small enough for the exchange -- synchronous, ``async_op=True`` and waited for, and a DDP bucket in
  backward: rank 0 fails within seconds, naming rank 1 and its abort. Before, rank 0 waited out the
  group's timeout (30 s here): gloo's abort closes nothing, and fusedist's communicator kept rank 1's
  group, and its connections, alive (torch's own all-reduce failed at once: torch held no reference).
* The same while rank 0 waits in gloo's own all-reduce (a tensor over the exchange's size), its parts agreed
  first, and in one of a communicator made with ``gloo_collectives="builtin"``: rank 0's error names rank 1 and
  its abort, and the collective with its size (before: gloo's bare "Connection closed by peer [address]"; and
  under "builtin" rank 0 waited out the group's timeout, the group's connections kept open).
* Rank 0's own gloo all-reduce times out while rank 1 waits in an exchange on the same group: rank 1's error
  quotes rank 0's failure (before: "rank 0 closed the connection and left no error: its process may have
  ended").
* Rank 1 aborts all its groups while rank 0 polls the store, as a store wait (a save's I/O barrier) would: the
  abort's record there names rank 1 within seconds (before: nothing in the store changed); it is gone once
  rank 1 has made a communicator again.
* Rank 1's process is killed (SIGKILL) while rank 0 waits in an exchange and has gloo's own all-reduce in
  flight on three other groups: all fail within seconds, naming rank 1 and that its process may have ended,
  gloo's with the collective and its size -- and, on the two groups a monitor watches, with what rank 1
  published there before its end: a crash, an early exit (before: gloo's bare "Connection closed by peer
  [address]").
* Rank 1 aborts its groups (one subgroup, or all) while rank 0 waits in torch's ``dist.barrier`` (or in the work
  of one with ``async_op=True``, which returns a work that completes while the peers are alive), and its process
  is killed while rank 0's barrier waits on a group of its own: rank 0's error names rank 1 and its abort, or
  that its process may have ended (before: gloo's bare "Connection closed by peer [address]", as torch's own
  barrier, run for reference, still says -- as promptly).

One launch for all (the subgroup scenarios abort a subgroup of their own; the others rebuild the default
group after each abort; the kill scenario is last): each breaks its group, which a shared launch's scenarios
must not do.
"""

import datetime
import os
import signal
import time

import pytest
import torch

from fusedist.testing import run_distributed

#: the process group's timeout: a survivor that waited it out took at least this long
GROUP_TIMEOUT_S = 30.0
#: how soon a survivor must fail (well under the group's timeout, room for a loaded machine)
PROMPT_S = 8.0
#: (gloo's own: over the exchange's 256 bytes)
GLOO_NUMEL = 1 << 16
SCENARIOS = ("sync", "async", "ddp bucket", "gloo all_reduce", "builtin all_reduce", "store record",
             "builtin failure told", "barrier", "world barrier", "async barrier", "torch barrier", "process exit")
#: the scenarios on a subgroup of their own, which alone they break (the default group goes on)
SUBGROUP = ("sync", "gloo all_reduce", "builtin all_reduce", "builtin failure told", "barrier", "async barrier",
            "torch barrier")
#: the timeout of rank 0's collective in "builtin failure told"
SHORT_TIMEOUT_S = 1.0


def _meet(store, name: str, rank: int, world: int) -> None:
    """Both ranks reach ``name`` (through the store: no collective that could pair with another)."""
    store.set(f"peer-abort/{name}/{rank}", b"")
    store.wait([f"peer-abort/{name}/{r}" for r in range(world)], datetime.timedelta(seconds=60))


def _fresh_group(store, index: int, rank: int, world: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.PrefixStore(f"peer-abort/group/{index}/", store), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))


def _collective(scenario: str, group, rank: int, torch_barrier):
    """What rank 0 runs, rank 1 leaves (both run theirs in "builtin failure told"); built on both ranks (as a
    program holds its communicator and model). ``torch_barrier``: torch's own, without fusedist's wrapper."""
    import torch.distributed as dist

    from fusedist.comm import get_communicator

    if scenario == "ddp bucket":
        from fusedist.ddp import DistributedDataParallel

        model = DistributedDataParallel(torch.nn.Linear(4, 8))  # (40 gradients: one small bucket)
        loss = model(torch.ones(2, 4)).sum()

        def run():
            loss.backward()
            return model  # (held to the end: a DDP model dropped before backward does not reduce)
        run.model = model  # (its forward after the failure: "ddp forward after")
    elif scenario == "store record":
        from fusedist.checkpoint._writer import io_barrier

        barrier = io_barrier("peer-abort/store record", rank, [0, 1])

        def run():  # (a save's I/O barrier, which rank 1 never reaches: it polls the store)
            barrier.wait("a test save")
    elif scenario == "builtin failure told":
        from fusedist.comm.torch_comm import TorchCommunicator

        # rank 0 in gloo's own all-reduce, which rank 1 never launches, until its short timeout; rank 1 in an
        # exchange's all-reduce meanwhile, which rank 0 never launches
        if rank == 0:
            comm = TorchCommunicator(group, timeout=datetime.timedelta(seconds=SHORT_TIMEOUT_S),
                                     gloo_collectives="builtin")
            comm.agree_parts = False  # (gloo's all-reduce itself times out, not the parts' messages first)
            x = torch.ones(GLOO_NUMEL)
        else:
            comm = get_communicator(group)
            x = torch.ones(32)

        def run():
            comm.all_reduce(x)
    elif scenario.endswith("barrier"):
        comm = get_communicator(group if group is not None else dist.group.WORLD)
        comm.all_reduce(torch.ones(32))  # (an exchange on the group: rank 1's abort closes its connections)
        # (the reference: torch's own, fusedist's wrapper left out: Note [a peer gone under torch's barrier])
        barrier = torch_barrier if scenario == "torch barrier" else dist.barrier

        def run():
            if scenario == "async barrier":  # (returns at once: its work's wait fails)
                barrier(group=group, async_op=True).wait()
            else:
                barrier(group=group)
    elif scenario in ("gloo all_reduce", "builtin all_reduce"):
        from fusedist.comm.torch_comm import TorchCommunicator

        comm = TorchCommunicator(group, gloo_collectives="builtin" if scenario.startswith("builtin") else "p2p")
        x = torch.ones(GLOO_NUMEL)
        comm.all_reduce(x)  # (one that pairs)

        def run():
            comm.all_reduce(x)
    else:
        comm = get_communicator(group if group is not None else dist.group.WORLD)
        x = torch.ones(32)
        comm.all_reduce(x)  # (one that pairs: the exchange is set up on both ranks)
        if scenario == "async":
            def run():
                comm.all_reduce(x, async_op=True).wait()
        else:
            def run():
                comm.all_reduce(x)
    return run


def _peer_abort(rank, world):
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    from fusedist.comm import aborted_groups, get_communicator

    measured = {}
    torch_barrier = dist.barrier  # (before this process's first exchange wraps it)
    measured.update(_refused_after_own_abort(store, rank, world))
    for index, scenario in enumerate(SCENARIOS, start=1):
        if scenario == "store record":
            recorded_in = dist.distributed_c10d._get_default_store()
        # (the subgroup scenarios on a group of their own, which alone is aborted: the default group goes on)
        group = dist.new_group([0, 1]) if scenario in SUBGROUP else None
        run = _collective(scenario, group, rank, torch_barrier)
        if scenario == "async barrier":  # (ones that pair, on both ranks: fusedist's work in torch's place)
            from fusedist.comm.barrier_closed import _ExplainedWork
            from fusedist.comm.torch_comm import TorchCommunicator

            work = dist.barrier(group=group, async_op=True)
            alive = (isinstance(work, dist.Work), work.wait(), work.is_completed(), work.is_success())
            measured.setdefault("async barrier alive", alive)
            # (fusedist's own barrier on gloo's keeps torch's work: its handle tells its failure)
            own = TorchCommunicator(group, gloo_collectives="builtin")._barrier(torch.zeros(1))
            own.wait()
            measured.setdefault("fusedist's own barrier wrapped", isinstance(own, _ExplainedWork))
        if scenario == "process exit":  # (gloo's own all-reduce in flight on groups of their own)
            in_flight = {told: _in_flight(dist.new_group([0, 1]), rank, told) for told in (None, "crash", "exit")}
            barrier_group = dist.new_group([0, 1])
            get_communicator(barrier_group).all_reduce(torch.ones(4))  # (one that pairs)
        _meet(store, f"{scenario}/ready", rank, world)
        if scenario == "process exit" and rank == 0:  # (rank 1 has made communicators since its abort)
            measured["record after the next communicator"] = aborted_groups.aborted_peers(recorded_in, [1])
        if scenario == "builtin failure told":
            # (what rank 1's wait says, its connection to rank 0 closed when rank 0's collective failed)
            _, error = _waited(run)
            key = f"peer-abort/{scenario}/rank 1"
            if rank == 1:
                store.set(key, error.encode())
            else:
                store.wait([key], datetime.timedelta(seconds=60))
                measured[scenario] = store.get(key).decode()
            del run
            dist.distributed_c10d._abort_process_group(group)
            continue
        if rank == 1:
            time.sleep(0.3)  # (rank 0 is waiting by then)
            if scenario == "process exit":
                # (what an uncaught exception, and a rank leaving early, publish in their groups)
                in_flight["crash"].publish("crash", "ValueError: injected failure")
                in_flight["exit"].publish("exit", "")
                os.kill(os.getpid(), signal.SIGKILL)
            dist.distributed_c10d._abort_process_group(group)
            del run
            # stays alive (its communicator cached, its groups aborted) until rank 0 is done
            store.wait([f"peer-abort/{scenario}/done"], datetime.timedelta(seconds=120))
        else:
            if scenario == "process exit":  # (torch's barrier in flight on a group of its own)
                barrier_waited = _in_thread(lambda: dist.barrier(group=barrier_group))
            start = time.monotonic()
            try:
                run()
                measured[scenario] = (time.monotonic() - start, "completed")
            except Exception as exc:  # noqa: BLE001 - the failure under test
                measured[scenario] = (time.monotonic() - start, str(exc))
            if scenario == "sync":  # (its next collective, once rank 0 aborted the group too: below)
                run_again = run
            if scenario == "ddp bucket":  # (Note [a forward after its group was aborted] in fusedist/ddp)
                measured["ddp forward after"] = _waited(lambda: run.model(torch.ones(2, 4)))
            if scenario == "process exit":
                for told, handle in in_flight.items():
                    measured[f"gloo all_reduce in flight, {told} told"] = _waited(handle.wait)
                measured["barrier in flight"] = barrier_waited()
            del run
            dist.distributed_c10d._abort_process_group(group)
            if scenario == "sync":  # (Note [a refusal names the abort] in fusedist/comm/released_group.py)
                measured["sync refused after own abort"] = _waited(run_again)
                del run_again
            store.set(f"peer-abort/{scenario}/done", b"")
        if group is None and scenario != SCENARIOS[-1]:
            _fresh_group(store, index, rank, world)
    return measured


def _refused_after_own_abort(store, rank: int, world: int) -> dict:
    """Both ranks abort a group of their own, its communicator used once; then its next collective (refused: no
    peer involved), the same once the next lookup released it, and torch's own all-reduce there (the reference)."""
    import torch.distributed as dist

    from fusedist.comm import get_communicator

    group = dist.new_group([0, 1])
    comm = get_communicator(group)
    x = torch.ones(32)
    comm.all_reduce(x)  # (one that pairs)
    _meet(store, "own abort/ready", rank, world)
    dist.distributed_c10d._abort_process_group(group)
    refused = {"own abort refused": _waited(lambda: comm.all_reduce(x)),
               "own abort torch's all_reduce": _waited(lambda: dist.all_reduce(x, group=group))}
    get_communicator()  # (releases the aborted group's communicator: Note [when torch forgets a group])
    refused["own abort refused once released"] = _waited(lambda: comm.all_reduce(x))
    _meet(store, "own abort/done", rank, world)
    return refused


def _in_flight(group, rank: int, told):
    """On rank 0, gloo's own all-reduce launched (``async_op=True``: at once) on ``group``, which rank 1 never
    launches; on rank 1 (which makes the group and its communicator alike), where ``told`` ("crash", "exit")
    names what it will publish there, the monitor DDP attaches (None: no monitor)."""
    from fusedist.comm import get_communicator
    from fusedist.reliability import attach_monitor

    comm = get_communicator(group)
    monitor = attach_monitor(comm) if told is not None else None
    comm.all_reduce(torch.ones(4))  # (one that pairs)
    return comm.all_reduce(torch.ones(GLOO_NUMEL), async_op=True) if rank == 0 else monitor


def _in_thread(wait):
    """``wait()`` started on a thread of its own; returns what to call for its ``_waited`` result."""
    import threading

    result = []
    thread = threading.Thread(target=lambda: result.append(_waited(wait)), daemon=True)
    thread.start()

    def joined():
        thread.join(timeout=60)
        return result[0] if result else (60.0, "still waiting")
    return joined


def _waited(wait) -> tuple:
    """(seconds, "completed" or the error) of ``wait()``."""
    start = time.monotonic()
    try:
        wait()
        return time.monotonic() - start, "completed"
    except Exception as exc:  # noqa: BLE001 - the failure under test
        return time.monotonic() - start, str(exc)


@pytest.fixture(scope="module")
def measured():
    # (a short stall-report window: the report waits for the ranks that can answer, and rank 1 cannot)
    results = run_distributed(_peer_abort, 2, timeout=240, expect_failure=True, pg_timeout=GROUP_TIMEOUT_S,
                              env={"FUSEDIST_STALL_REPORT_S": "0.5"})
    (status0, value0), (status1, value1) = results
    assert status0 == "ok", value0
    assert status1 == "error" and "SIGKILL" in value1, value1  # (its kill, nothing before)
    return value0


@pytest.mark.parametrize("scenario", SCENARIOS[:3])
def test_peer_abort_fails_the_survivor_at_once_naming_the_peer(measured, scenario):
    seconds, error = measured[scenario]
    assert seconds < PROMPT_S, (f"{scenario}: rank 0 failed after {seconds:.1f} s (group timeout "
                                f"{GROUP_TIMEOUT_S} s): {error}")
    assert "rank 1 closed the connection: it aborted its process groups" in error, error


@pytest.mark.parametrize("scenario", ["gloo all_reduce", "builtin all_reduce"])
def test_peer_abort_under_gloos_own_all_reduce_names_the_peer_and_the_collective(measured, scenario):
    seconds, error = measured[scenario]
    assert seconds < PROMPT_S, (f"{scenario}: rank 0 failed after {seconds:.1f} s (group timeout "
                                f"{GROUP_TIMEOUT_S} s): {error}")
    assert (f"all_reduce (tag '', collective #1) failed on rank 0 of 2: gloo's own all_reduce [{GLOO_NUMEL} x "
            "torch.float32 per rank]: rank 1 closed the connection: it aborted its process groups") in error, error


def test_peer_abort_of_all_groups_ends_a_save_barrier_in_the_store_at_once(measured):
    """Note [an abort told to waits in the store] (fusedist/comm/aborted_groups.py): a save's I/O barrier
    polls the store, which no closed connection reaches; it took the aborted rank for a silent process once
    its beat's silence ran out (10 s), now it fails at its next poll naming the abort."""
    seconds, error = measured["store record"]
    assert seconds < PROMPT_S, f"no record of rank 1's abort after {seconds:.1f} s: {error}"
    assert ("rank 0: waiting for the other ranks to be done with a test save, rank 1 aborted all its process "
            "groups (torch.distributed's _abort_process_group): it will not arrive") in error, error


def test_peer_finding_its_connection_closed_reads_why_gloos_own_collective_failed(measured):
    error = measured["builtin failure told"]
    assert ("rank 0 closed the connection because its side of a collective failed first (all_reduce (tag '', "
            "collective #0) failed on rank 0 of 2: timed out") in error, error
    assert f"(fusedist's collective timeout, {SHORT_TIMEOUT_S:g} s)" in error, error


def test_abort_record_withdrawn_once_the_peer_makes_a_communicator_again(measured):
    assert measured["record after the next communicator"] == {}


def test_peer_process_exit_fails_the_survivor_at_once_naming_the_peer(measured):
    seconds, error = measured["process exit"]
    assert seconds < PROMPT_S, f"rank 0 failed after {seconds:.1f} s: {error}"
    assert "rank 1 closed the connection and left no error: its process may have ended" in error, error


@pytest.mark.parametrize("told, why", [
    (None, "rank 1 closed the connection and left no error: its process may have ended"),
    ("crash", "rank 1 closed the connection: its process crashed with ValueError: injected failure (on "),
    ("exit", "rank 1 closed the connection: it left the group without an error (its program ended, or destroyed "
             "the group) while this rank still ran collectives there")])
def test_peer_killed_under_gloos_own_all_reduce_names_the_peer_and_the_collective(measured, told, why):
    seconds, error = measured[f"gloo all_reduce in flight, {told} told"]
    assert seconds < PROMPT_S, f"rank 0 failed after {seconds:.1f} s: {error}"
    assert (f"all_reduce (tag '', collective #1) failed on rank 0 of 2: gloo's own all_reduce [{GLOO_NUMEL} x "
            f"torch.float32 per rank]: {why}") in error, error


@pytest.mark.parametrize("scenario", ["barrier", "world barrier", "async barrier"])
def test_peer_abort_under_torchs_barrier_names_the_peer(measured, scenario):
    """Note [a peer gone under torch's barrier] (fusedist/comm/barrier_closed.py): torch's barrier failed as
    promptly, with gloo's bare "Connection closed by peer [address]" (the "torch barrier" reference); with
    ``async_op=True``, in its work's ``wait()`` (before: the bare words there, as torch's own async barrier
    still says)."""
    seconds, error = measured[scenario]
    assert seconds < PROMPT_S, f"{scenario}: rank 0 failed after {seconds:.1f} s: {error}"
    assert ("fusedist: torch.distributed's barrier failed on rank 0 of 2: rank 1 closed the connection: it aborted "
            "its process groups (torch.distributed's _abort_process_group)") in error, error
    assert "Connection closed by peer" in error, error  # (gloo's words kept)


def test_an_async_barrier_whose_peers_are_alive_returns_a_work_that_completes(measured):
    assert measured["async barrier alive"] == (True, True, True, True), measured["async barrier alive"]
    assert measured["fusedist's own barrier wrapped"] is False


def test_torchs_own_barrier_fails_as_promptly_naming_no_rank(measured):
    seconds, error = measured["torch barrier"]
    assert seconds < PROMPT_S, f"torch's barrier failed after {seconds:.1f} s: {error}"
    assert "Connection closed by peer" in error and "rank 1" not in error, error


def test_peer_killed_under_torchs_barrier_names_the_peer(measured):
    seconds, error = measured["barrier in flight"]
    assert seconds < PROMPT_S, f"rank 0's barrier failed after {seconds:.1f} s: {error}"
    assert ("fusedist: torch.distributed's barrier failed on rank 0 of 2: rank 1 closed the connection and left no "
            "error: its process may have ended") in error, error


def test_a_ddp_forward_after_a_peers_abort_failed_a_bucket_is_refused_naming_the_peer(measured):
    """Note [a forward after its group was aborted] (fusedist/ddp/destroyed_group.py): rank 0's backward failed at
    once, rank 1 having aborted its groups; its next training forward ran, and only the backward's first bucket
    was refused. Now the forward is refused, naming rank 1's abort and what to do."""
    seconds, error = measured["ddp forward after"]
    assert seconds < PROMPT_S, f"rank 0's forward took {seconds:.1f} s: {error}"
    assert error.startswith("fusedist.DistributedDataParallel (rank 0 of 2): forward refused: this model's default "
                            "process group can no longer run collectives: an earlier collective of it failed ("), error
    assert "rank 1 closed the connection: it aborted its process groups" in error, error
    assert "Re-create the process group on every rank" in error and "model.module" in error, error


_ABORTED_HERE = "it was aborted on this rank (torch.distributed's _abort_process_group)"


@pytest.mark.parametrize("key", ["own abort refused", "own abort refused once released"])
def test_a_collective_on_a_group_aborted_here_is_refused_naming_the_abort(measured, key):
    """Note [a refusal names the abort] (fusedist/comm/released_group.py): the refusal said the group "was
    destroyed (torch.distributed.destroy_process_group())", a call the program never made; torch's own all-reduce
    there is refused at once as well (ValueError: not in the world group map)."""
    seconds, error = measured[key]
    assert seconds < PROMPT_S, f"{key}: took {seconds:.1f} s: {error}"
    assert error.startswith("fusedist all_reduce on rank 0 of 2: not launched: the process group of this "
                            f"communicator can no longer run collectives: {_ABORTED_HERE}. Re-create the process "
                            "group on every rank"), error
    assert "was destroyed" not in error, error
    torch_seconds, torch_error = measured["own abort torch's all_reduce"]
    assert torch_seconds < PROMPT_S and "not initialized in the world group map" in torch_error, torch_error


def test_a_collective_on_a_group_aborted_after_a_peers_abort_names_both(measured):
    """Note [a refusal names the abort]: rank 1 aborted the group, rank 0's collective failed naming it, and rank 0
    aborted the group too; its next collective was refused as on a destroyed group. Now it names this rank's
    abort and the failure before it, with the peer."""
    seconds, error = measured["sync refused after own abort"]
    assert seconds < PROMPT_S, f"took {seconds:.1f} s: {error}"
    assert error.startswith("fusedist all_reduce on rank 0 of 2: not launched: the process group of this "
                            f"communicator can no longer run collectives: {_ABORTED_HERE}, after an earlier "
                            "collective of it failed ("), error
    assert "rank 1 closed the connection: it aborted its process groups" in error, error
    assert "was destroyed" not in error, error
