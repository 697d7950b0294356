"""The C++ CPU Adam on a CPU without AVX-512: the dispatch must pick the AVX2 path (an AVX-512
instruction there is a SIGILL), refuse an explicit request for AVX-512 with a clear error, give
bitwise the results of the AVX-512 path at lengths that are not multiples of any vector width,
and touch no memory outside the tensors.

Valgrind's CPU reports AVX2 but not AVX-512 to the program it runs, so running the extension
under valgrind (memcheck) is such a CPU, with out-of-bounds checking on top. The child loads
the module file directly, without torch (torch under valgrind takes minutes), and passes
plain buffers by address.
"""

from __future__ import annotations

import array
import json
import random
import shutil
import subprocess
import sys
import textwrap

import pytest

from fusedist import _extension

pytestmark = pytest.mark.skipif(
    not _extension.is_available("_cpu_ops"), reason=f"fusedist._cpu_ops not built ({_extension.load_error('_cpu_ops')})"
)

LENGTHS = (1, 7, 15, 17, 63, 65)

# Shared by the child and this process: one fp32 AdamW step and one step writing a bf16 copy
# of an FP32 master, for each length, from seeded inputs; returns the bytes written, in hex.
_STEPS = textwrap.dedent(
    """
    def run_steps(ops, isa_code, lengths):
        out = []
        for n in lengths:
            rng = random.Random(n)
            p, g = (array.array("f", [rng.uniform(-2, 2) for _ in range(n)]) for _ in range(2))
            m, v = array.array("f", [0.0] * n), array.array("f", [0.0] * n)
            copy = array.array("H", [0] * n)
            addr = lambda a: [a.buffer_info()[0]]
            for step, copies, copy_code in ((1, [], -1), (2, addr(copy), 1)):
                ops.adam_step(addr(p), addr(g), addr(m), addr(v), copies, [n], 0, 0, copy_code, 1e-3, 0.9,
                              0.999, 1e-8, 0.01, True, step, True, False, 0, 0, 0, isa_code, 1)
            out.append((p.tobytes() + m.tobytes() + v.tobytes() + copy.tobytes()).hex())
        return out
    """
)

_CHILD = textwrap.dedent(
    """
    import array, importlib.util, json, random, sys
    spec = importlib.util.spec_from_file_location("_cpu_ops", sys.argv[1])
    ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ops)
    """
) + _STEPS + textwrap.dedent(
    """
    report = {"available": ops.available_isas(), "best": ops.best_isa(), "results": {}}
    try:
        ops.adam_step([], [], [], [], [], [], 0, 0, -1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, 1, True, False,
                      0, 0, 0, ops.ISA_CODES["avx512"], 1)
        report["avx512_request"] = "accepted"
    except ValueError as exc:
        report["avx512_request"] = str(exc)
    for isa in ops.available_isas():
        report["results"][isa] = run_steps(ops, ops.ISA_CODES[isa], json.loads(sys.argv[2]))
    print("REPORT " + json.dumps(report))
    """
)


def test_no_avx512_cpu_takes_avx2_with_identical_results():
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        pytest.skip("valgrind not installed: no CPU without AVX-512 to run the extension on")
    ops = _extension.require("_cpu_ops")
    if "avx2" not in ops.compiled_isas():
        pytest.skip("this build has no AVX2 path")
    proc = subprocess.run(
        [valgrind, "--tool=memcheck", "-q", sys.executable, "-c", _CHILD, ops.__file__, json.dumps(LENGTHS)],
        capture_output=True, text=True, timeout=300, env={"PYTHONMALLOC": "malloc", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, proc.stdout[-3000:]
    report = json.loads(lines[-1][len("REPORT "):])
    if "avx512" in report["available"]:
        pytest.skip("this valgrind reports AVX-512 to its program: not a CPU without it")
    assert report["available"] == ["scalar", "avx2"] and report["best"] == "avx2", report
    assert "avx512 path is not available here (this CPU lacks the instructions)" in report["avx512_request"]
    assert "the widest available path is avx2" in report["avx512_request"]
    # No out-of-bounds access by the tails (memcheck names every invalid read or write).
    assert "Invalid read" not in proc.stderr and "Invalid write" not in proc.stderr, proc.stderr[-6000:]
    # Bitwise the results of this process's widest path (AVX-512 where the CPU has it).
    scope: dict = {"array": array, "random": random}
    exec(_STEPS, scope)
    here = scope["run_steps"](ops, ops.ISA_CODES[ops.best_isa()], LENGTHS)
    for isa in ("scalar", "avx2"):
        assert report["results"][isa] == here, f"{isa} under valgrind differs from {ops.best_isa()} here"
