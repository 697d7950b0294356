"""The CUDA/NCCL extension builds wherever nvcc is, imports without a GPU, and fails cleanly
without one; its dtype map and NCCL boundary are checked on any machine.

GPU behaviour (results equal torch's NCCL, stream overlap, timeouts) is in
tests/test_cuda_ext_gpu.py.
"""

import glob
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import fusedist
from fusedist.testing import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _nvcc():
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and os.path.exists(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    return shutil.which("nvcc")


NVCC = _nvcc()
HAS_DRIVER = torch.cuda.is_available()


def _C():
    """The extension, or a test failure that says why (nvcc is present, so it must exist)."""
    if NVCC is None:
        pytest.skip(
            "nvcc not found (PATH, CUDA_HOME): fusedist._C is NOT compiled on this machine, so "
            "the CUDA sources were not compile-checked by this run"
        )
    assert fusedist.cuda_ext_available(), (
        f"nvcc is installed ({NVCC}) but fusedist._C did not load: {fusedist.cuda_ext_error()}. "
        "Rebuild with `make install` (or FUSEDIST_BUILD_CUDA=1 pip install --no-build-isolation "
        "-e .) and read the compiler output."
    )
    import fusedist._C as C

    return C


# ----------------------------------------------------------------------------- build + import


def test_extension_built_with_this_machines_nvcc():
    C = _C()
    info = C.build_info()
    version = subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout
    major, minor = divmod(info["cuda_runtime"] // 10, 100)
    assert f"release {major}.{minor}" in version, (info, version)
    assert info["archs"] == os.environ.get("FUSEDIST_CUDA_ARCH_LIST", "8.0;9.0")
    assert C.NCCL_UNIQUE_ID_BYTES == 128


def test_extension_is_not_older_than_its_sources():
    C = _C()
    built = os.path.getmtime(C.__file__)
    sources = glob.glob(os.path.join(REPO, "csrc", "cuda", "*"))
    assert sources
    stale = [os.path.basename(s) for s in sources if os.path.getmtime(s) > built + 1]
    assert not stale, (
        f"fusedist._C ({C.__file__}) is older than {stale}: the tests would check an old build. "
        "Run `make install`."
    )


# ----------------------------------------------------------------------------- no driver

_NO_DRIVER_SCRIPT = textwrap.dedent(
    """
    import fusedist._C as C

    def expect(fn, *needles, kind=RuntimeError):
        try:
            fn()
        except kind as exc:
            msg = str(exc)
            assert all(n in msg for n in needles), msg
            print("ok", type(exc).__name__, msg.splitlines()[0][:100])
        else:
            raise AssertionError(f"{fn} did not raise")

    expect(C.device_count, "cudaErrorInsufficientDriver", "needs one at run time", kind=C.CudaError)
    expect(lambda: C.CommStream(0), "driver", kind=C.CudaError)
    expect(lambda: C.Event(0), "driver", kind=C.CudaError)
    expect(lambda: C.load_nccl("/nonexistent/libnccl.so.2"), "cannot dlopen", "/nonexistent/libnccl.so.2",
           "FUSEDIST_NCCL_LIBRARY")
    expect(C.get_unique_id, "NCCL is not loaded")
    expect(lambda: C.NcclComm(bytes(128), 1, 0, 0), "driver", kind=C.CudaError)
    expect(lambda: C.NcclComm(bytes(5), 1, 0, 0), "128 bytes", kind=ValueError)
    print("done")
    """
)


@pytest.mark.skipif(HAS_DRIVER, reason="checks the behaviour without a CUDA driver; one is present")
def test_device_calls_without_driver_raise_clear_errors():
    """Every entry point that needs the driver raises a Python error: no crash, no hang."""
    _C()
    proc = subprocess.run(
        [sys.executable, "-c", _NO_DRIVER_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.strip().endswith("done"), proc.stdout


@pytest.mark.skipif(HAS_DRIVER, reason="checks the behaviour without a CUDA driver; one is present")
def test_nccl_library_override_is_reported(monkeypatch):
    _C()
    from fusedist.comm.nccl_comm import NcclUnavailableError, load_nccl

    monkeypatch.setenv("FUSEDIST_NCCL_LIBRARY", "/nonexistent/libnccl-custom.so")
    with pytest.raises(NcclUnavailableError, match="FUSEDIST_NCCL_LIBRARY='/nonexistent/libnccl-custom.so'"):
        load_nccl()
    monkeypatch.delenv("FUSEDIST_NCCL_LIBRARY")
    with pytest.raises(NcclUnavailableError, match="libnccl.so.2"):
        load_nccl()


def _communicator_without_driver(rank, world_size):
    from fusedist.comm import TorchCommunicator, get_communicator
    from fusedist.comm import nccl_comm

    out = {}
    with pytest.raises(nccl_comm.NcclUnavailableError) as info:
        nccl_comm.NcclCommunicator()
    out["both_fail"] = str(info.value)
    # Rank 0 believes it is ready and gets as far as ncclGetUniqueId: the other ranks must
    # still learn about it (and rank 0 about theirs) instead of waiting in ncclCommInitRank.
    if rank == 0:
        original = nccl_comm.local_problem
        nccl_comm.local_problem = lambda: None
    try:
        with pytest.raises(nccl_comm.NcclUnavailableError) as info:
            nccl_comm.NcclCommunicator()
        out["rank0_ready"] = str(info.value)
    finally:
        if rank == 0:
            nccl_comm.local_problem = original
    # The registered factory falls back to torch.distributed on every rank together...
    comm = get_communicator(device="cuda")
    out["fallback"] = type(comm).__name__
    assert isinstance(comm, TorchCommunicator)
    t = torch.full((4,), float(rank + 1))
    comm.all_reduce(t)
    out["sum"] = t.tolist()
    # ...unless NCCL was asked for explicitly.
    os.environ["FUSEDIST_COMM"] = "nccl"
    try:
        with pytest.raises(nccl_comm.NcclUnavailableError, match="driver"):
            nccl_comm.make_nccl_communicator(None)
    finally:
        del os.environ["FUSEDIST_COMM"]
    return out


@pytest.mark.skipif(HAS_DRIVER, reason="checks the behaviour without a CUDA driver; one is present")
def test_nccl_communicator_fails_on_all_ranks_together_without_driver():
    _C()
    results = run_distributed(_communicator_without_driver, 2, timeout=90, pg_timeout=30)
    for res in results:
        # Every rank's reason is reported on every rank.
        assert "rank 0:" in res["both_fail"] and "rank 1:" in res["both_fail"]
        assert "driver" in res["both_fail"]
        assert "rank 0: ncclGetUniqueId failed" in res["rank0_ready"], res["rank0_ready"]
        assert "rank 1:" in res["rank0_ready"] and "driver" in res["rank0_ready"]
        assert res["fallback"] == "TorchCommunicator"
        assert res["sum"] == [3.0] * 4


def test_nccl_init_is_bounded_by_the_timeout():
    """Note [bounded NCCL init]: an init that never returns (a rank that died after the id
    exchange) becomes a CollectiveError naming the rank; one that fails or succeeds passes
    through unchanged."""
    import threading
    import time

    from fusedist.comm.base import CollectiveError
    from fusedist.comm.nccl_comm import create_within_timeout

    never = threading.Event()
    start = time.monotonic()
    with pytest.raises(CollectiveError, match=r"ncclCommInitRank on rank 1 of 4 did not complete within 0.2 s"):
        create_within_timeout(never.wait, 0.2, "ncclCommInitRank on rank 1 of 4")
    assert time.monotonic() - start < 5
    never.set()  # lets the parked helper thread end

    def fails():
        raise RuntimeError("ncclInvalidUsage")

    with pytest.raises(RuntimeError, match="ncclInvalidUsage"):
        create_within_timeout(fails, 5.0, "init")
    assert create_within_timeout(lambda: "comm", 5.0, "init") == "comm"


def test_communicator_without_process_group_explains_the_first_problem(monkeypatch):
    _C()
    from fusedist.comm import nccl_comm

    if not HAS_DRIVER:  # the missing driver is the first thing to fix
        with pytest.raises(nccl_comm.NcclUnavailableError, match="driver"):
            nccl_comm.NcclCommunicator()
    monkeypatch.setattr(nccl_comm, "local_problem", lambda: None)
    with pytest.raises(nccl_comm.NcclUnavailableError, match="torch.distributed is not initialized"):
        nccl_comm.NcclCommunicator()


# ----------------------------------------------------------------------------- dtype map


def test_dtype_map_matches_nccl_codes_and_rejects_the_rest():
    from fusedist.comm._nccl_types import nccl_dtype, nccl_op

    # ncclDataType_t values from nccl.h (NCCL 2.x ABI).
    assert [nccl_dtype(d) for d in (torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16,
                                    torch.float32, torch.float64, torch.bfloat16)] == [0, 1, 2, 4, 6, 7, 8, 9]
    assert [nccl_op(o) for o in ("sum", "prod", "max", "min", "avg")] == [0, 1, 2, 3, 4]
    with pytest.raises(TypeError, match=r"torch.bool.*torch.uint8"):
        nccl_dtype(torch.bool, "all_reduce")
    with pytest.raises(TypeError, match=r"complex64.*view_as_real"):
        nccl_dtype(torch.complex64)
    with pytest.raises(TypeError, match="int16.*int32"):
        nccl_dtype(torch.int16)
    with pytest.raises(ValueError, match="unknown reduce op 'mean'"):
        nccl_op("mean")


# ----------------------------------------------------------------------------- the NCCL boundary

_FAKE_NCCL = r"""
#include <stdlib.h>
#include <string.h>
typedef struct { char internal[128]; } ncclUniqueId;
typedef void* ncclComm_t;
int ncclGetVersion(int* v) { const char* e = getenv("FAKE_NCCL_VERSION"); *v = e ? atoi(e) : 22704; return 0; }
int ncclGetUniqueId(ncclUniqueId* id) {
  if (getenv("FAKE_NCCL_FAIL")) return 2;
  memset(id->internal, 7, sizeof(id->internal));
  return 0;
}
const char* ncclGetErrorString(int r) { return r == 2 ? "unhandled system error (fake)" : "fake"; }
int ncclCommInitRank(ncclComm_t* c, int n, ncclUniqueId id, int r) { return 0; }
int ncclCommDestroy(ncclComm_t c) { return 0; }
#ifndef OMIT_ABORT
int ncclCommAbort(ncclComm_t c) { return 0; }
#endif
int ncclCommGetAsyncError(ncclComm_t c, int* e) { *e = 0; return 0; }
int ncclAllReduce() { return 0; }
int ncclReduceScatter() { return 0; }
int ncclAllGather() { return 0; }
int ncclBroadcast() { return 0; }
"""

_FAKE_NCCL_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import fusedist._C as C
    from fusedist.comm.nccl_comm import load_nccl
    full, partial = sys.argv[1], sys.argv[2]

    def fails(fn, *needles, kind=RuntimeError):
        try:
            fn()
        except kind as exc:
            assert all(n in str(exc) for n in needles), str(exc)
        else:
            raise AssertionError("did not raise")

    fails(lambda: C.load_nccl(partial), "has no symbol ncclCommAbort")
    os.environ["FAKE_NCCL_VERSION"] = "20804"
    fails(lambda: C.load_nccl(full), "NCCL version 20804", "needs NCCL >= 2.10")
    del os.environ["FAKE_NCCL_VERSION"]
    assert C.nccl_library() == ""
    fails(C.get_unique_id, "NCCL is not loaded")
    os.environ["FUSEDIST_NCCL_LIBRARY"] = full
    assert load_nccl() == 22704 and C.nccl_library() == full
    assert C.load_nccl("/elsewhere/libnccl.so.2") == 22704  # first successful load wins
    assert C.get_unique_id() == bytes([7]) * C.NCCL_UNIQUE_ID_BYTES
    os.environ["FAKE_NCCL_FAIL"] = "1"
    fails(C.get_unique_id, "ncclGetUniqueId", "unhandled system error (fake)", "NCCL_DEBUG=WARN",
          kind=C.NcclError)
    print("done")
    """
)


def test_nccl_boundary_against_a_fake_library(tmp_path):
    """dlopen/dlsym, the version gate and NCCL_CHECK's message, with a stand-in libnccl."""
    _C()
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in NCCL library")
    src = tmp_path / "fake_nccl.c"
    src.write_text(_FAKE_NCCL)
    full, partial = tmp_path / "libfakenccl.so", tmp_path / "libfakenccl_partial.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(full), str(src)], check=True)
    subprocess.run([cc, "-shared", "-fPIC", "-DOMIT_ABORT", "-o", str(partial), str(src)], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_NCCL", "FUSEDIST_NCCL"))}
    proc = subprocess.run([sys.executable, "-c", _FAKE_NCCL_SCRIPT, str(full), str(partial)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.strip().endswith("done"), proc.stdout
