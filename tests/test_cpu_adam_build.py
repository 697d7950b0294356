"""The CPU extension is built, dispatches safely, and its hot loop really is vectorized."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from fusedist import _extension

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_SRC = os.path.join(REPO, "csrc", "cpu")
# bf16 gradient, fp32 master, bf16 copy-out, decoupled decay: the mixed-precision hot loop.
HOT_LOOP = "adam_span_typed<1, 0, 1, 2, true>"


def _compiler():
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def test_cpu_extension_is_built_when_a_compiler_exists():
    if os.environ.get("FUSEDIST_BUILD_CPU", "auto") == "0":
        pytest.skip("FUSEDIST_BUILD_CPU=0 disables the CPU extension on purpose")
    if not _compiler():
        pytest.skip("no C++ compiler on this machine: the pure-PyTorch path is expected")
    # A compiler is present, so a missing module is a build bug, not an environment choice.
    assert _extension.is_available("_cpu_ops"), (
        f"fusedist._cpu_ops failed to load although {_compiler()} exists: "
        f"{_extension.load_error('_cpu_ops')}"
    )
    ops = _extension.require("_cpu_ops")
    assert "scalar" in ops.available_isas()
    assert set(ops.available_isas()) <= set(ops.compiled_isas())


def _disassembly_of(path: str) -> str:
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump not installed")
    return subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", path], check=True,
                          capture_output=True, text=True).stdout


def _function_bodies(disassembly: str, name: str) -> list[str]:
    bodies, current = [], None
    for line in disassembly.splitlines():
        if re.match(r"^[0-9a-f]+ <", line):
            current = [] if name in line else None
            if current is not None:
                bodies.append(current)
        elif current is not None:
            current.append(line)
    return ["\n".join(b) for b in bodies]


def test_hot_loop_uses_wide_registers_per_path():
    """Each compiled path's copy of the hot loop uses its register width (objdump check)."""
    if not _extension.is_available("_cpu_ops"):
        pytest.skip("extension not built")
    ops = _extension.require("_cpu_ops")
    bodies = _function_bodies(_disassembly_of(ops.__file__), HOT_LOOP)
    assert len(bodies) == len(ops.compiled_isas()), (
        f"expected one copy of {HOT_LOOP} per compiled path {ops.compiled_isas()}, found {len(bodies)}"
    )
    kinds = set()
    for body in bodies:
        if re.search(r"vdivps\s+%zmm", body) and re.search(r"vsqrtps\s+%zmm", body):
            kinds.add("avx512")
            assert "vpmovdw" in body  # the bf16 pack of the copy-out
        elif re.search(r"vdivps\s+%ymm", body) and "zmm" not in body:
            kinds.add("avx2")
            assert "vpackusdw" in body
        elif re.search(r"\bdivss\b", body) and "ymm" not in body and "zmm" not in body:
            kinds.add("scalar")
    assert kinds == set(ops.compiled_isas()), f"found paths {kinds}, compiled {ops.compiled_isas()}"


def test_narrow_compiler_fallback_builds_without_wide_code(tmp_path):
    """With the wide paths switched off (what setup.py does when the compiler rejects their
    target attributes), the sources still compile and contain no 256/512-bit code."""
    cxx = _compiler()
    if not cxx:
        pytest.skip("no C++ compiler")
    for name in ("adam_avx2.cpp", "adam_avx512.cpp"):
        obj = tmp_path / (name + ".o")
        subprocess.run(
            [cxx, "-std=c++17", "-O1", "-c", os.path.join(CPU_SRC, name), "-I", CPU_SRC, "-o", str(obj),
             "-DFUSEDIST_CPU_NO_AVX2", "-DFUSEDIST_CPU_NO_AVX512"],
            check=True, capture_output=True,
        )
        text = _disassembly_of(str(obj))
        assert "ymm" not in text and "zmm" not in text, f"{name} emitted wide code when disabled"
