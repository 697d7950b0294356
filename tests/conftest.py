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
