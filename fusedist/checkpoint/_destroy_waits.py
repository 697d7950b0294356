"""A ``Checkpointer`` save still in flight is finished before torch destroys the process groups.

Note [a destroy waits for the save in flight]
    An asynchronous save ends with exchanges between the ranks (the files each wrote, the
    manifest's go-ahead) over process groups of the job. A script that ends with
    ``torch.distributed.destroy_process_group()`` and no ``close()`` took those groups away from
    the save's writer thread: the checkpoint it had asked for was lost -- an empty step
    directory, a message at exit, and the process still exited with status 0. So the destroy
    first waits for every save in flight of this process, as ``close()`` would (the writers
    never wait for the training thread: every rank's writer goes on while its training thread
    waits here, and a peer that died ends the save by the save's own deadlines). The save's error,
    if any, stays with its writer for ``wait()`` / ``close()`` / the exit to report: a destroy
    never fails for it. Reached through ``torch.distributed.destroy_process_group`` and
    ``torch.distributed.distributed_c10d.destroy_process_group`` as looked up when called; a
    script that imported the function by name before fusedist installed this calls torch's own.
"""

from __future__ import annotations

import functools
from typing import Callable

from .._process_hooks import chain_module_function

_KEYS = ("finish checkpoint writes before destroy_process_group: torch.distributed",
         "finish checkpoint writes before destroy_process_group: distributed_c10d")


def install(finish_writes: Callable[[], None]) -> None:
    """Run ``finish_writes()`` at the start of every ``destroy_process_group`` call (once per process)."""
    import torch.distributed as dist

    if not dist.is_available():
        return
    from torch.distributed import distributed_c10d

    def waiting_first(destroy):
        @functools.wraps(destroy)
        def destroy_process_group(*args, **kwargs):
            finish_writes()
            return destroy(*args, **kwargs)
        return destroy_process_group

    chain_module_function(_KEYS[0], dist, "destroy_process_group", waiting_first)
    chain_module_function(_KEYS[1], distributed_c10d, "destroy_process_group", waiting_first)
