"""Lazy loading of the optional compiled extensions.

``import fusedist`` never fails because an extension is missing: each loader records *why*
it could not load, and the reason (with build instructions) is raised only when a code path
that needs the extension is actually asked for.
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType

_BUILD_HINT = {
    "_C": (
        "Rebuild on a machine with the CUDA toolkit: "
        "`FUSEDIST_BUILD_CUDA=1 pip install --no-build-isolation -e .` "
        "(set CUDA_HOME if nvcc is a wrapper outside the toolkit)."
    ),
    "_cpu_ops": (
        "Rebuild with a C++17 compiler that supports OpenMP: "
        "`FUSEDIST_BUILD_CPU=1 pip install --no-build-isolation -e .`."
    ),
}

_lock = threading.Lock()
_modules: dict[str, ModuleType | None] = {}
_errors: dict[str, str] = {}


def _load(name: str) -> ModuleType | None:
    with _lock:
        if name not in _modules:
            try:
                _modules[name] = importlib.import_module(f"fusedist.{name}")
            except ImportError as exc:
                _modules[name] = None
                _errors[name] = f"{type(exc).__name__}: {exc}"
        return _modules[name]


def is_available(name: str) -> bool:
    """True if the extension ``fusedist.<name>`` imported."""
    return _load(name) is not None


def load_error(name: str) -> str | None:
    """Why ``fusedist.<name>`` did not load (None if it did)."""
    _load(name)
    return _errors.get(name)


def require(name: str) -> ModuleType:
    """Return the extension module or raise the recorded reason with build instructions."""
    module = _load(name)
    if module is None:
        raise RuntimeError(
            f"fusedist.{name} is not available ({_errors[name]}). {_BUILD_HINT.get(name, '')}"
        )
    return module


def cuda_ext_available() -> bool:
    """Whether the CUDA/NCCL extension ``fusedist._C`` is built and importable."""
    return is_available("_C")


def cuda_ext_error() -> str | None:
    """Why ``fusedist._C`` could not be loaded, or None when it loaded."""
    return load_error("_C")
