"""Lazy loading of the optional compiled extensions.

``import fusedist`` never fails because an extension is missing: each loader records *why*
it could not load, and the reason (with build instructions) is raised only when a code path
that needs the extension is actually asked for.
"""

from __future__ import annotations

import importlib
import os
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

# Note [an extension's settings are checked when it is first asked for]
#     A setting that steers one extension (the CPU Adam's instruction-set path) is read only
#     where that extension's kernel runs, so a misspelt value was ignored whenever another
#     backend ran the step (``TRITON_INTERPRET=1``, ``FUSEDIST_KERNEL_BACKEND=torch``, CUDA
#     tensors) and the user never learned the setting did nothing. Asking whether the
#     extension is available -- which the optimizer step does first, whatever backend it then
#     picks, and whether or not the extension is built -- checks its settings, so the first
#     step raises. (``require`` does not: it hands the module to code that reads the setting
#     itself before its kernel runs, as ``fusedist.optim._cpu_adam.selected_isa`` does.)
#     (Not at ``import fusedist``: settings are read when used, so a rank's own environment
#     decides them.)
_SETTINGS = {
    # extension -> (variable, accepted values; the first is the default); the same list as
    # ``fusedist.optim._cpu_adam``'s ISA codes
    "_cpu_ops": ("FUSEDIST_CPU_ISA", ("auto", "scalar", "avx2", "avx512")),
}

_lock = threading.Lock()
_modules: dict[str, ModuleType | None] = {}
_errors: dict[str, str] = {}


def check_settings(name: str) -> None:
    """Raise ValueError naming the variable and its accepted values if a setting of
    ``fusedist.<name>`` has a value it does not know (Note [an extension's settings are
    checked when it is first asked for])."""
    setting = _SETTINGS.get(name)
    if setting is None:
        return
    variable, accepted = setting
    raw = os.environ.get(variable)
    value = (raw or "").strip().lower() or accepted[0]  # (empty is the default, as for the other settings)
    if value not in accepted:
        raise ValueError(f"{variable}={value!r} is not one of {', '.join(accepted)} "
                         f"(unset it, or use {accepted[0]!r}, for the default)")


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
    """True if the extension ``fusedist.<name>`` imported; raises ValueError for a misspelt
    setting of it (Note [an extension's settings are checked when it is first asked for])."""
    check_settings(name)
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
