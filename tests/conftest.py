"""Shared fixtures and markers.

Kernel tests that use Triton's interpreter set ``TRITON_INTERPRET=1`` here, before any test
module imports triton: the variable must be set before the ``@triton.jit`` decorators run.
Set ``FUSEDIST_TEST_NO_INTERPRET=1`` on a GPU machine to test the compiled kernels instead.
"""

import os

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("FUSEDIST_TEST_NO_INTERPRET") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def requires_gpus(n: int = 1):
    """Marker: skip unless ``n`` CUDA devices are visible."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(count < n, reason=f"needs {n} CUDA device(s), found {count}")


def rank_slot_count() -> int:
    """How many ranks this machine holds (0 without CUDA): one per GPU, or
    ``FUSEDIST_TEST_RANKS_PER_GPU`` per GPU (Note [several ranks on one GPU] in
    fusedist/testing/shared_gpu.py)."""
    from fusedist.testing import rank_slots, ranks_per_gpu_setting

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return rank_slots(count, ranks_per_gpu_setting())


def requires_rank_slots(n: int = 2):
    """Marker: skip unless this machine holds ``n`` ranks (:func:`rank_slot_count`). Tests under
    it bind rank ``r`` to ``fusedist.testing.device_for_rank(r)``, not to ``cuda:r``."""
    from fusedist.testing import RANKS_PER_GPU_ENV

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    slots = rank_slot_count()
    return pytest.mark.skipif(
        slots < n,
        reason=f"needs room for {n} ranks: {n} CUDA devices, or ranks sharing a GPU through "
               f"{RANKS_PER_GPU_ENV} (found {count} CUDA device(s), room for {slots} rank(s))")


@pytest.fixture(scope="module")
def tp_mesh(request):
    """A 1-D mesh of the test module's ``TP`` ranks in this process, this process rank 0 (torch's
    fake process group): tensor-parallel placements measured without launching ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    size = request.module.TP
    assert not dist.is_initialized(), "a process group is already up in this process"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()
