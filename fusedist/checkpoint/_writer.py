"""The persist half of an asynchronous save: one background thread, one save in flight.

Serialization, checksums, fsyncs and the manifest run on a daemon thread while training
goes on (the CheckFreq snapshot/persist split; torch DCP's ``async_save``). Its coordination
between ranks uses a process group of its own (:class:`Coordinator`), never the training
group: collectives on one group must be issued in the same order by every rank, and a
background thread's exchanges would interleave unpredictably with DDP's.

A save that fails records its error, raised in the training thread at the next
``wait()``. At interpreter exit an unfinished save is waited for (so a normal end never
loses the last checkpoint); a process killed mid-save leaves a directory without a manifest,
which the next start skips.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Callable, Optional

import torch.distributed as dist

from ..comm import get_communicator
from ..comm.objects import all_gather_object, broadcast_object
from ..distributed import collective_timeout
from .._process_hooks import at_exit


class Coordinator:
    """Rank, world size and object exchanges for checkpoint saves, on a dedicated gloo group
    (created collectively: every rank constructs it at the same point of the program). The
    exchanges go through the group's communicator: bounded by the collective timeout, and a
    rank missing from one is named in a StallError whose report says where each rank is."""

    NAME = "fusedist.checkpoint.Checkpointer"

    def __init__(self, process_group=None):
        self.comm = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.ranks, self.group = _checkpoint_group(process_group)
            self.rank, self.size = self.ranks.index(dist.get_rank()), len(self.ranks)
            if self.size > 1:
                self.comm = get_communicator(self.group)
        else:
            self.rank, self.size, self.group, self.ranks = 0, 1, None, [0]

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
        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the job in flight (if any) is done; raise its error, once."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


_live: "weakref.WeakSet[BackgroundWriter]" = weakref.WeakSet()


def _finish_at_exit() -> None:
    for writer in list(_live):
        try:
            writer.wait()
        except BaseException as exc:  # noqa: BLE001 - too late to raise; say what was lost
            print(f"{writer.name}: the checkpoint being written at exit was not completed: "
                  f"{type(exc).__name__}: {exc}", flush=True)
