"""The package installs and imports cleanly, and triton_kernels/ maps to fusedist.triton_kernels."""

import os
import subprocess
import sys
import sysconfig
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_is_cheap_and_safe():
    import fusedist

    assert fusedist.__version__
    # The CUDA extension may or may not be built; either way the query answers, never raises.
    available = fusedist.cuda_ext_available()
    assert isinstance(available, bool)
    if not available:
        assert fusedist.cuda_ext_error()


def test_triton_kernels_maps_under_fusedist_in_this_install(tmp_path):
    """In the installed environment (editable or not), from a neutral working directory."""
    code = (
        "import fusedist.triton_kernels as tk, importlib.util as u; print(tk.__file__); "
        "s = u.find_spec('triton_kernels'); print(s.origin if s else None)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    tk_file, top_level = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, check=True, capture_output=True, text=True
    ).stdout.split("\n")[:2]
    assert tk_file.endswith(os.path.join("triton_kernels", "__init__.py"))
    ours = os.path.realpath(os.path.join(REPO, "triton_kernels"))
    in_site = os.path.join("fusedist", "triton_kernels") in tk_file
    assert os.path.realpath(tk_file).startswith(ours) or in_site, tk_file
    # Our folder must never be importable under the top-level name Triton uses.
    assert top_level == "None" or not os.path.realpath(top_level).startswith(ours), top_level


def test_unknown_attribute_is_an_attribute_error():
    import fusedist

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        fusedist.nope


def test_regular_install_maps_triton_kernels(tmp_path):
    """Build a wheel (no native extensions) and install it into a clean target folder."""
    env = dict(os.environ, FUSEDIST_BUILD_CUDA="0", FUSEDIST_BUILD_CPU="0")
    wheel_dir = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--disable-pip-version-check",
         "-w", str(wheel_dir), REPO],
        check=True, env=env, cwd=tmp_path, capture_output=True,
    )
    (wheel,) = list(wheel_dir.glob("fusedist-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "fusedist/triton_kernels/__init__.py" in names
    assert not [n for n in names if n.startswith("triton_kernels/")], "top-level triton_kernels shipped"
    target = tmp_path / "site"
    # --no-compile: the layout is what is checked, and the import below compiles the few modules it runs
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--disable-pip-version-check",
         "--target", str(target), str(wheel)],
        check=True, capture_output=True,
    )
    # -S: no site processing, so the editable install's finder cannot answer for us.
    site_packages = sysconfig.get_paths()["purelib"]
    code = (
        "import fusedist.triton_kernels as tk, importlib.util as u; print(tk.__file__); "
        "s = u.find_spec('triton_kernels'); print(s.origin if s else None)"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", code],
        env=dict(os.environ, PYTHONPATH=f"{target}{os.pathsep}{site_packages}"),
        check=True, capture_output=True, text=True, cwd=tmp_path,
    ).stdout.split("\n")
    assert out[0].startswith(str(target / "fusedist" / "triton_kernels"))
    assert not out[1].startswith(str(target))


# Each first import runs a fresh copy of about a hundred of fusedist's modules: without bytecode
# on disk (PYTHONDONTWRITEBYTECODE, no ``make test`` compile step) every one of them was compiled
# from source again, ~200 times over. Each source file is compiled once here and its code object
# run afresh by every import (module execution, and so the order, is unchanged).
_FIRST_IMPORT_OF_EACH = r'''
import importlib, os, pkgutil, sys
from importlib.machinery import SourceFileLoader

codes, get_code = {}, SourceFileLoader.get_code

def cached_get_code(loader, fullname):
    if fullname.split(".")[0] != "fusedist":
        return get_code(loader, fullname)
    key = (loader.get_filename(fullname), os.stat(loader.get_filename(fullname)).st_mtime_ns)
    if key not in codes:
        codes[key] = get_code(loader, fullname)
    return codes[key]

SourceFileLoader.get_code = cached_get_code
import fusedist
names = sorted(m.name for m in pkgutil.walk_packages(fusedist.__path__, "fusedist."))
compiled = {n for n in sys.modules if n.startswith(("fusedist._C", "fusedist._cpu_ops"))}
failed = []
for name in names[int(sys.argv[1])::int(sys.argv[2])]:
    if name.rsplit(".", 1)[-1] in ("_C", "_cpu_ops", "__main__"):
        continue  # compiled extensions cannot be imported twice; __main__ runs a command line
    for loaded in [n for n in sys.modules if n.split(".")[0] == "fusedist" and n not in compiled]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except BaseException as exc:
        failed.append(f"{name}: {exc!r}")
print(len(names))
print("\n".join(failed))
'''


def test_every_module_imports_first():
    """Whatever module a program (or a tool) imports first must load: an import cycle only
    shows in one order (importing fusedist.reliability.engine_watch before fusedist.ddp failed
    with a partially initialized module)."""
    # Two interpreters, each taking every other module, run at once (one a CPU core): every module
    # still comes first in a fresh set of fusedist's modules.
    procs = [subprocess.Popen([sys.executable, "-c", _FIRST_IMPORT_OF_EACH, str(part), "2"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for part in range(2)]
    try:
        outputs = [proc.communicate(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, (stdout, stderr) in zip(procs, outputs):
        assert proc.returncode == 0, stderr[-3000:]
        count, *failed = stdout.strip().split("\n")
        assert int(count) > 50 and not [f for f in failed if f], "\n".join(failed)
