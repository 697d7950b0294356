"""The optimizer kernels compile for a real GPU target (sm_90) even on a machine without one.

The interpreter (how the other kernel tests run on CPU) accepts things the compiler rejects
and ignores compiler hints, so this test lowers every kernel through Triton's CUDA backend to
PTX and SASS (ptxas ships with Triton; no GPU or driver is needed) in a subprocess without
``TRITON_INTERPRET``. It also checks that aligned full chunks get 128-bit vector memory
accesses (Note [full and tail chunks] in triton_kernels/multi_tensor_helpers.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r'''
import json, re
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fusedist.triton_kernels import multi_tensor as mt

TABLE = {"ptrs", "numels", "chunk_t", "chunk_start"}

def signature(fn, constexprs):
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in TABLE:
            sig[name] = "*i64"
        elif name.endswith("_ptr") or name.startswith("partial_"):
            sig[name] = "*fp32"
        elif name == "n_tensors":
            sig[name] = "i32"
        else:
            sig[name] = "fp32"
    return sig

def compile_ptx(fn, **constexprs):
    sig = signature(fn, constexprs)
    names = list(sig)
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]

base = dict(HAS_INV_SCALE=True, HAS_CLIP=True, HAS_FOUND_INF=True, ALIGNED=True, BLOCK=1024, ITERS=4)
out = {}
for pd, gd, master in [(tl.float32, tl.float32, False), (tl.bfloat16, tl.bfloat16, True),
                       (tl.float16, tl.float32, True)]:
    key = f"{pd}-{gd}-{master}"
    out["adam " + key] = compile_ptx(mt._adam_kernel, GRAD_DTYPE=gd, PARAM_DTYPE=pd, HAS_MASTER=master, STEP_ROLE=5,
                                     ADAMW=True, BIAS_CORRECTION=True, MAXIMIZE=False, **base)
    out["sgd " + key] = compile_ptx(mt._sgd_kernel, GRAD_DTYPE=gd, PARAM_DTYPE=pd, HAS_MASTER=master, STEP_ROLE=4,
                                    HAS_MOMENTUM=True, NESTEROV=True, MAXIMIZE=True, **base)
    out["lamb1 " + key] = compile_ptx(mt._lamb_stage1_kernel, GRAD_DTYPE=gd, PARAM_DTYPE=pd, HAS_MASTER=master,
                                      STEP_ROLE=6, ADAMW=False, BIAS_CORRECTION=True, **base)
    out["lamb2 " + key] = compile_ptx(mt._lamb_stage2_kernel, PARAM_DTYPE=pd, HAS_MASTER=master, HAS_FOUND_INF=True,
                                      ALIGNED=True, BLOCK=1024, ITERS=4)
    out["check " + key] = compile_ptx(mt._check_and_norm_kernel, GRAD_DTYPE=gd, HAS_INV_SCALE=True, ALIGNED=True,
                                      BLOCK=1024, ITERS=4)
out["adam unaligned, no scaler"] = compile_ptx(
    mt._adam_kernel, GRAD_DTYPE=tl.float32, PARAM_DTYPE=tl.float32, HAS_MASTER=False, STEP_ROLE=-1, ADAMW=False,
    BIAS_CORRECTION=False, MAXIMIZE=False, HAS_INV_SCALE=False, HAS_CLIP=False, HAS_FOUND_INF=False, ALIGNED=False,
    BLOCK=1024, ITERS=4)
print(json.dumps({k: {"v4_loads": len(re.findall(r"ld\.global(\.\w+)*\.v4", ptx)),
                      "v4_stores": len(re.findall(r"st\.global(\.\w+)*\.v4", ptx))} for k, ptx in out.items()}))
'''


def _nvidia_backend_present() -> bool:
    try:
        import triton.backends.nvidia as nv
    except Exception:  # noqa: BLE001
        return False
    return os.path.exists(os.path.join(os.path.dirname(nv.__file__), "bin", "ptxas"))


@pytest.mark.skipif(not _nvidia_backend_present(), reason="Triton's CUDA backend (ptxas) is not installed")
def test_kernels_compile_for_sm90_with_vector_access():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(counts) == 16
    # fp32 Adam with aligned addresses: full chunks load grad/param/m/v and store m/v/param as float4.
    assert counts["adam fp32-fp32-False"]["v4_loads"] > 0 and counts["adam fp32-fp32-False"]["v4_stores"] > 0
    assert counts["check fp32-fp32-False"]["v4_loads"] > 0
