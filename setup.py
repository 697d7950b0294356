"""Build script for fusedist.

Two optional native extensions, neither of which links against torch's C++ ABI
(so one build serves every torch version, and building never imports torch):

* ``fusedist._C``       -- CUDA + NCCL (csrc/cuda/). Needs nvcc. NCCL is not linked:
                           it is loaded with dlopen at run time.
* ``fusedist._cpu_ops`` -- C++/OpenMP CPU kernels (csrc/cpu/). Needs a C++ compiler.

Switches (environment variables):

* ``FUSEDIST_BUILD_CUDA=auto|0|1`` -- ``auto`` (default) builds ``_C`` when nvcc is found
  and skips it otherwise; ``0`` never builds it; ``1`` requires it and fails with a message
  naming what is missing.
* ``FUSEDIST_BUILD_CPU=auto|0|1``  -- ``auto`` (default) tries ``_cpu_ops`` and, if the
  compiler refuses, installs without it (the pure-PyTorch path is used instead);
  ``1`` makes a failure fatal; ``0`` skips it.
* ``FUSEDIST_CUDA_ARCH_LIST``      -- e.g. ``"8.0;9.0"`` (default ``"8.0;9.0"``). Explicit,
  because arch auto-detection needs a visible GPU.
* ``CUDA_HOME``                    -- the CUDA toolkit root, when it cannot be found from nvcc.

The Triton kernels live in the top-level source folder ``triton_kernels/`` but install as
``fusedist.triton_kernels``: Triton itself ships a top-level package called
``triton_kernels`` that ours must never shadow.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def _switch(name: str) -> str:
    value = os.environ.get(name, "auto").strip().lower()
    if value not in ("auto", "0", "1"):
        sys.exit(f"{name} must be one of auto, 0, 1 (got {value!r})")
    return value


# ----------------------------------------------------------------------------- CUDA discovery


def find_cuda_home() -> str | None:
    """Return the CUDA toolkit root, or None.

    ``nvcc`` on the PATH may be a wrapper script living outside the toolkit, so the root is
    taken from nvcc's own dry-run report (``#$ TOP=...``) before falling back to guesses.
    """
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and os.path.exists(os.path.join(root, "bin", "nvcc")):
            return root
    nvcc = shutil.which("nvcc")
    if nvcc:
        try:
            # A dry run of a (never executed) compile prints nvcc's settings, TOP among them;
            # ``--version`` alone does not.
            out = subprocess.run(
                [nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                capture_output=True, text=True, timeout=60,
            )
            match = re.search(r"^#\$ TOP=(.+)$", out.stderr + out.stdout, re.M)
            if match:
                top = os.path.realpath(match.group(1).strip())
                if os.path.exists(os.path.join(top, "include", "cuda_runtime.h")):
                    return top
        except (OSError, subprocess.SubprocessError):
            pass
        root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        if os.path.exists(os.path.join(root, "include", "cuda_runtime.h")):
            return root
    for root in ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True):
        if os.path.exists(os.path.join(root, "bin", "nvcc")):
            return root
    return None


def cuda_arch_list() -> str:
    return os.environ.get("FUSEDIST_CUDA_ARCH_LIST", "8.0;9.0")


def cuda_gencode_flags() -> list[str]:
    arch_list = cuda_arch_list()
    flags = []
    for arch in re.split(r"[;, ]+", arch_list.strip()):
        if not arch:
            continue
        ptx = arch.endswith("+PTX")
        num = arch.replace("+PTX", "").replace(".", "")
        flags += ["-gencode", f"arch=compute_{num},code=sm_{num}"]
        if ptx:
            flags += ["-gencode", f"arch=compute_{num},code=compute_{num}"]
    return flags


# ----------------------------------------------------------------------------- extensions


def _pybind11_include() -> str:
    import pybind11

    return pybind11.get_include()


def cuda_extension(cuda_home: str) -> Extension | None:
    sources = sorted(glob.glob("csrc/cuda/*.cpp") + glob.glob("csrc/cuda/*.cu"))
    if not sources:
        return None
    ext = Extension(
        "fusedist._C",
        sources=sources,
        include_dirs=["csrc/cuda", "csrc/common", os.path.join(cuda_home, "include")],
        library_dirs=[os.path.join(cuda_home, "lib64"), os.path.join(cuda_home, "lib")],
        # cudart is linked statically so the module imports without a CUDA runtime on the
        # library path; NCCL is dlopen'ed (see csrc/cuda/nccl_loader.cpp).
        libraries=["cudart_static", "dl", "rt", "pthread"],
        extra_compile_args={
            "cxx": ["-O3", "-std=c++17", "-fvisibility=hidden",
                    f'-DFUSEDIST_CUDA_ARCHS="{cuda_arch_list()}"'],
            "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC,-fvisibility=hidden"]
            + cuda_gencode_flags(),
        },
        language="c++",
    )
    ext._fusedist_cuda_home = cuda_home  # type: ignore[attr-defined]
    ext._fusedist_required = _switch("FUSEDIST_BUILD_CUDA") == "1"  # type: ignore[attr-defined]
    return ext


# Each wide path is compiled with a function-level target attribute (never a global -m flag,
# so the module still loads on CPUs without it; CPUID picks the path at run time). A compiler
# that rejects an attribute -- old GCC/Clang, or a non-x86 target -- just drops that path.
_CPU_ISA_PROBES = {
    "FUSEDIST_CPU_NO_AVX2": ("avx,avx2,fma,f16c", "__m256 x = _mm256_set1_ps(1.f); "
                             "__m128i h = _mm256_cvtps_ph(_mm256_fmadd_ps(x, x, x), 0); "
                             "return _mm_cvtsi128_si32(h);"),
    "FUSEDIST_CPU_NO_AVX512": ("avx,avx2,fma,f16c,avx512f", "__m512 x = _mm512_set1_ps(1.f); "
                               "__m256i h = _mm512_cvtps_ph(_mm512_sqrt_ps(x), 0); "
                               "return _mm256_extract_epi32(h, 0);"),
}


def _cxx_command() -> list[str]:
    import shlex

    cxx = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    return shlex.split(cxx)


def _compiler_accepts(target: str, body: str) -> bool:
    import tempfile

    source = (
        "#include <immintrin.h>\n"
        f'__attribute__((target("{target}"))) int probe() {{ {body} }}\n'
        "int main() { return 0; }\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.cpp")
        with open(src, "w") as f:
            f.write(source)
        cmd = _cxx_command() + ["-std=c++17", "-O2", "-c", src, "-o", os.path.join(tmp, "probe.o")]
        try:
            return subprocess.run(cmd, capture_output=True, timeout=120).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False


def cpu_extension() -> Extension | None:
    sources = sorted(glob.glob("csrc/cpu/*.cpp"))
    if not sources:
        return None
    macros = []
    for macro, (target, body) in _CPU_ISA_PROBES.items():
        if not _compiler_accepts(target, body):
            print(f"fusedist: the C++ compiler rejects target('{target}'); defining {macro}")
            macros.append((macro, "1"))
    ext = Extension(
        "fusedist._cpu_ops",
        sources=sources,
        include_dirs=["csrc/cpu", "csrc/common"],
        define_macros=macros,
        # -ffp-contract=off: no implicit FMA contraction, so every ISA path rounds the same
        # way (see csrc/cpu/adam_impl.h, Note [operation order]). -fno-math-errno: sqrt need
        # not set errno, which lets the compiler vectorize the portable path; it changes no
        # value.
        extra_compile_args={
            "cxx": ["-O3", "-std=c++17", "-fvisibility=hidden", "-fopenmp", "-ffp-contract=off",
                    "-fno-math-errno"]
        },
        extra_link_args=["-fopenmp"],
        depends=sorted(glob.glob("csrc/cpu/*.h")),
        language="c++",
    )
    ext._fusedist_required = _switch("FUSEDIST_BUILD_CPU") == "1"  # type: ignore[attr-defined]
    return ext


class BuildExt(build_ext):
    """build_ext that builds the CUDA extension itself (nvcc for any ``.cu`` file, g++ for the
    host code) and tolerates optional failures."""

    def build_extension(self, ext: Extension) -> None:
        ext.include_dirs.append(_pybind11_include())
        ext.include_dirs.append(sysconfig.get_paths()["include"])
        try:
            if getattr(ext, "_fusedist_cuda_home", None):
                self._build_with_nvcc(ext)
            else:
                flags = ext.extra_compile_args
                if isinstance(flags, dict):
                    ext.extra_compile_args = flags.get("cxx", [])
                super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - any compiler failure
            if getattr(ext, "_fusedist_required", False):
                raise RuntimeError(f"building {ext.name} failed (required by the build switch): {exc}")
            self.warn(
                f"fusedist: optional extension {ext.name} failed to build and is skipped "
                f"({exc}); the pure-PyTorch/Triton paths will be used instead."
            )

    def _build_with_nvcc(self, ext: Extension) -> None:
        cuda_home = ext._fusedist_cuda_home  # type: ignore[attr-defined]
        nvcc = os.path.join(cuda_home, "bin", "nvcc")
        flags = ext.extra_compile_args
        build_temp = os.path.join(self.build_temp, ext.name)
        os.makedirs(build_temp, exist_ok=True)
        includes = [f"-I{d}" for d in ext.include_dirs]
        commands, objects = [], []
        for src in ext.sources:
            obj = os.path.join(build_temp, os.path.basename(src) + ".o")
            if src.endswith(".cu"):
                cmd = [nvcc, "-c", src, "-o", obj, *includes, *flags["nvcc"]]
            else:
                cxx = os.environ.get("CXX", "g++")
                cmd = [cxx, "-c", src, "-o", obj, "-fPIC", *includes, *flags["cxx"]]
            self.announce(" ".join(cmd), level=2)
            commands.append(cmd)
            objects.append(obj)
        # The translation units are independent: compile them concurrently (the pybind11
        # bindings dominate the build time).
        from concurrent.futures import ThreadPoolExecutor

        jobs = max(1, min(len(commands), os.cpu_count() or 1))
        with ThreadPoolExecutor(jobs) as pool:
            for future in [pool.submit(subprocess.check_call, cmd) for cmd in commands]:
                future.result()
        out = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        cxx = os.environ.get("CXX", "g++")
        link = [cxx, "-shared", "-o", out, *objects]
        link += [f"-L{d}" for d in ext.library_dirs]
        link += [f"-l{lib}" for lib in ext.libraries]
        subprocess.check_call(link)


def extensions() -> list[Extension]:
    exts = []
    cuda_mode = _switch("FUSEDIST_BUILD_CUDA")
    if cuda_mode != "0":
        cuda_home = find_cuda_home()
        if cuda_home is None:
            if cuda_mode == "1":
                sys.exit(
                    "FUSEDIST_BUILD_CUDA=1 but no CUDA toolkit was found: put nvcc on the PATH "
                    "or set CUDA_HOME to the toolkit root (the folder holding bin/nvcc and "
                    "include/cuda_runtime.h)."
                )
        else:
            ext = cuda_extension(cuda_home)
            if ext is not None:
                exts.append(ext)
    if _switch("FUSEDIST_BUILD_CPU") != "0":
        ext = cpu_extension()
        if ext is not None:
            exts.append(ext)
    return exts


packages = find_packages(include=["fusedist", "fusedist.*"]) + ["fusedist.triton_kernels"]

setup(
    name="fusedist",
    version="0.1.0",
    description="Fused distributed-training ops for PyTorch: DDP, ZeRO, fused optimizers, GradScaler, SyncBatchNorm",
    long_description=open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    if os.path.exists(os.path.join(ROOT, "README.md"))
    else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=packages,
    package_dir={"fusedist.triton_kernels": "triton_kernels"},
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExt},
    install_requires=["torch>=2.4", "numpy", "triton>=3.0; platform_system == 'Linux'"],
    extras_require={"test": ["pytest>=7", "hypothesis>=6"], "lightning": ["lightning>=2.4"],
                    "plot": ["matplotlib"]},
    zip_safe=False,
)
