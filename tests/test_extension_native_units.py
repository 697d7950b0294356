"""Pieces of the CUDA extension's C++ that run without a GPU, compiled here with the host compiler:
the NCCL loader's publication of its function table to other threads (Note [publishing the NCCL
table] in csrc/cuda/nccl_loader.cpp), checked under ThreadSanitizer against a stand-in libnccl, and
the conversion of a wait's timeout to a deadline (Note [wait timeouts] in csrc/cuda/wait_deadline.h),
checked under UndefinedBehaviorSanitizer. The extension itself needs a GPU to construct a
communicator, so these are the parts of it a CPU machine can run."""

from __future__ import annotations

import functools
import math
import os
import shutil
import subprocess

import pytest

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "cuda")
CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")

pytestmark = pytest.mark.skipif(CXX is None, reason="needs a C++ compiler")

# Every symbol the loader binds, returning success; the version is one the loader accepts.
_STAND_IN_NCCL = r"""
int ncclGetVersion(int* v) { *v = 22000; return 0; }
int ncclGetUniqueId(void* id) { return 0; }
int ncclCommInitRank(void* c, int n, char id[128], int r) { return 0; }
int ncclCommDestroy(void* c) { return 0; }
int ncclCommAbort(void* c) { return 0; }
int ncclCommGetAsyncError(void* c, int* e) { *e = 0; return 0; }
const char* ncclGetErrorString(int r) { return "stand-in"; }
int ncclAllReduce(void) { return 0; }
int ncclReduceScatter(void) { return 0; }
int ncclAllGather(void) { return 0; }
int ncclBroadcast(void) { return 0; }
"""

# Threads that poll nccl() (as launching and polling threads do, without the loader's lock) while
# the main thread loads NCCL; each reader must see a complete table once it sees one at all.
_LOADER_RACE = r"""
#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "nccl_api.h"

int main(int argc, char** argv) {
  std::atomic<int> complete{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 3; ++t) {
    readers.emplace_back([&] {
      for (;;) {
        try {
          int version = 0;
          fusedist::nccl().GetVersion(&version);
          if (version == 22000) complete++;
          return;
        } catch (const std::exception&) {  // not loaded yet
        }
        std::this_thread::yield();
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  fusedist::load_nccl(argv[1]);
  for (auto& t : readers) t.join();
  std::printf("complete tables: %d\n", complete.load());
  return complete.load() == 3 ? 0 : 1;
}
"""

# One line per timeout on the command line: "none" (no deadline), "after <seconds>" or
# "refused: <message>".
_DEADLINES = r"""
#include <cstdio>
#include <cstdlib>

#include "wait_deadline.h"

int main(int argc, char** argv) {
  const auto start = std::chrono::steady_clock::now();
  for (int i = 1; i < argc; ++i) {
    try {
      const auto deadline = fusedist::wait_deadline(std::strtod(argv[i], nullptr), start, "all_reduce");
      if (!deadline) {
        std::printf("none\n");
      } else {
        std::printf("after %.9g\n", std::chrono::duration<double>(*deadline - start).count());
      }
    } catch (const std::invalid_argument& e) {
      std::printf("refused: %s\n", e.what());
    }
  }
  return 0;
}
"""


def _build(tmp, name: str, source: str, *flags: str, sources=()) -> str:
    src = os.path.join(tmp, f"{name}.cpp")
    with open(src, "w") as f:
        f.write(source)
    exe = os.path.join(tmp, name)
    subprocess.run([CXX, "-std=c++17", "-O1", "-g", *flags, f"-I{CSRC}", f"-I{tmp}", src, *sources, "-o", exe,
                    "-ldl", "-pthread"], check=True, capture_output=True, text=True)
    return exe


_UBSAN = ("-fsanitize=float-cast-overflow,signed-integer-overflow", "-fno-sanitize-recover=all")


@functools.lru_cache(maxsize=None)
def _sanitizer_works(*flags: str) -> bool:
    """Whether this compiler builds and runs a program with ``flags`` (the sanitizer's runtime
    library may be missing, or the kernel may refuse its memory layout)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        try:
            exe = _build(tmp, "probe", "int main() { return 0; }\n", *flags)
            return subprocess.run([exe], capture_output=True, timeout=60).returncode == 0
        except (subprocess.SubprocessError, OSError):
            return False


def test_threads_polling_nccl_while_it_loads_see_the_whole_table_without_a_data_race(tmp_path):
    if not _sanitizer_works("-fsanitize=thread"):
        pytest.skip("ThreadSanitizer does not run here")
    tmp = str(tmp_path)
    # nccl_api.h needs only cudaStream_t from the CUDA headers
    with open(os.path.join(tmp, "cuda_runtime_api.h"), "w") as f:
        f.write("typedef struct CUstream_st* cudaStream_t;\n")
    with open(os.path.join(tmp, "stand_in_nccl.c"), "w") as f:
        f.write(_STAND_IN_NCCL)
    lib = os.path.join(tmp, "libstandin_nccl.so")
    subprocess.run(["gcc" if shutil.which("gcc") else CXX, "-x", "c", "-shared", "-fPIC",
                    os.path.join(tmp, "stand_in_nccl.c"), "-o", lib], check=True, capture_output=True)
    exe = _build(tmp, "loader_race", _LOADER_RACE, "-fsanitize=thread",
                 sources=(os.path.join(CSRC, "nccl_loader.cpp"),))
    run = subprocess.run([exe, lib], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TSAN_OPTIONS": "halt_on_error=1 exitcode=66"})
    # (before: "WARNING: ThreadSanitizer: data race ... g_loaded", exit status 66)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "complete tables: 3" in run.stdout, run.stdout


def test_wait_timeouts_infinite_means_no_deadline_and_nan_or_negative_are_refused(tmp_path):
    # UBSan aborts on a float -> integer conversion that does not fit (the old conversion did that
    # for inf, NaN and timedelta.max), and on a signed overflow of the deadline.
    if not _sanitizer_works(*_UBSAN):
        pytest.skip("UndefinedBehaviorSanitizer does not run here")
    exe = _build(str(tmp_path), "deadlines", _DEADLINES, *_UBSAN)
    huge = 86399999999999.999  # datetime.timedelta.max.total_seconds()
    cases = ["0", "0.25", "1800", "1e9", "1.5e9", str(huge), "inf", "nan", "-1", "-inf"]
    run = subprocess.run([exe, *cases], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    got = dict(zip(cases, run.stdout.splitlines()))
    for finite in ("0", "0.25", "1800", "1e9"):
        kind, seconds = got[finite].split()
        # (one nanosecond is the clock's resolution)
        assert kind == "after" and math.isclose(float(seconds), float(finite), abs_tol=1e-9), (finite, got[finite])
    for endless in ("1.5e9", str(huge), "inf"):
        assert got[endless] == "none", (endless, got[endless])
    for refused in ("nan", "-1", "-inf"):
        assert got[refused].startswith("refused: fusedist: all_reduce: the wait's timeout must be a number of "
                                       "seconds >= 0, got "), (refused, got[refused])
        assert "pass inf to wait until the collective completes" in got[refused], got[refused]
