"""init_distributed after torch made the default group with its own backend choice.

torch's ``init_process_group()`` without a backend (its documented default) makes one backend
per device type, ``"cpu:gloo"`` here (``"cpu:gloo,cuda:nccl"`` with GPUs), and
``dist.get_backend()`` then says ``"undefined"``: init_distributed reported that as the backend
(so a GPU run got ``device=cpu``) and refused ``backend="gloo"`` -- the backend the group does
use -- as "cannot change it"; likewise after ``init_process_group("cpu:gloo")``.
"""

import os
import socket

import pytest

from fusedist.testing import run_distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _after_torch(rank, world_size):
    import torch
    import torch.distributed as dist

    import fusedist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    seen = []
    for torch_backend in (None, "cpu:gloo"):
        dist.init_process_group(torch_backend)
        used = dict(part.split(":") for part in dist.get_backend_config().split(","))["cpu"]  # torch's own word
        info = fusedist.init_distributed()
        again = fusedist.init_distributed(backend="gloo")
        with pytest.raises(RuntimeError, match="already initialized with backend 'cpu:gloo'.*cannot change it"):
            fusedist.init_distributed(backend="mpi")
        t = torch.ones(2, device=info.device)
        dist.all_reduce(t)  # the group works on the device init_distributed reported
        seen.append((used, info.backend, info.device.type, again == info, t.tolist()))
        dist.destroy_process_group()
    info = fusedist.init_distributed(backend="cpu:gloo")  # a spec given to init_distributed itself
    seen.append((dist.get_backend_config(), info.backend, info.device.type, fusedist.init_distributed() == info))
    dist.destroy_process_group()
    return seen


def test_init_distributed_reads_the_backend_of_a_group_torch_made():
    out = run_distributed(_after_torch, 1, backend=None, env={"MASTER_PORT": str(_free_port())})
    assert out == [[("gloo", "gloo", "cpu", True, [1.0, 1.0]), ("gloo", "gloo", "cpu", True, [1.0, 1.0]),
                    ("cpu:gloo", "gloo", "cpu", True)]]
