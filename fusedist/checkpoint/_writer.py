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

    def __init__(self):
        self.comm = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
            self.group = dist.new_group(backend="gloo", timeout=collective_timeout())
            self.comm = get_communicator(self.group)
        else:
            self.rank, self.size, self.group = 0, 1, None

    def all_gather(self, obj, what: str = "exchange") -> list:
        if self.comm is None:
            return [obj]
        return all_gather_object(self.comm, obj, tag=f"{self.NAME} {what}")

    def broadcast(self, obj, what: str = "broadcast from rank 0"):
        """Rank 0's ``obj`` on every rank."""
        if self.comm is None:
            return obj
        return broadcast_object(self.comm, obj, 0, tag=f"{self.NAME} {what}")


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
