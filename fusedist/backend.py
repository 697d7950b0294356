"""One place that decides which implementation runs a kernel.

Fallback chain, chosen per device type and logged once:

* CUDA tensors: compiled Triton kernels (``triton``) -> pure PyTorch (``torch``).
* CPU tensors: the C++ CPU extension where an op has one (``cpu_ext``) -> pure PyTorch
  (``torch``); with ``TRITON_INTERPRET=1`` set, the Triton kernels run under the
  interpreter (``triton``), which is how CI tests them.

``FUSEDIST_KERNEL_BACKEND=auto|triton|torch|cpu_ext`` overrides the choice (``auto`` is the
default). The pure-PyTorch path computes the same math and doubles as the test oracle.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger("fusedist")

BACKENDS = ("triton", "torch", "cpu_ext")
_logged: set[tuple[str, str]] = set()


def triton_interpreting() -> bool:
    """Whether Triton runs its kernels in the interpreter (``TRITON_INTERPRET`` set, which only
    takes effect when set before triton is imported). The one test of it: the backend choice
    here and the launch sizes in ``triton_kernels/`` both read it."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken triton install is "not available"
        return False
    return True


def requested_backend() -> str:
    # (an empty value is the default, as for FUSEDIST_COMM and the other settings)
    value = os.environ.get("FUSEDIST_KERNEL_BACKEND", "").strip().lower() or "auto"
    if value not in BACKENDS + ("auto",):
        raise ValueError(
            f"FUSEDIST_KERNEL_BACKEND={value!r} is not one of auto, {', '.join(BACKENDS)}"
        )
    return value


# The choice for each (op, device type, has_cpu_ext, the two environment variables as set):
# asked at every kernel call -- several per BatchNorm layer and per optimizer step -- where
# deciding afresh cost about 4 us of host time each. The environment is part of the key, so a
# program (or a test) that changes FUSEDIST_KERNEL_BACKEND between calls gets the new choice.
_CHOICES: dict[tuple, str] = {}


def select_backend(op: str, device: torch.device | str, *, has_cpu_ext: bool = False) -> str:
    """Return the backend that runs ``op`` on ``device``: 'triton', 'cpu_ext' or 'torch'.

    ``has_cpu_ext`` says whether ``op`` has a C++ CPU implementation that is built.
    """
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    environ = os.environ
    key = (op, device_type, has_cpu_ext, environ.get("FUSEDIST_KERNEL_BACKEND"), environ.get("TRITON_INTERPRET"))
    choice = _CHOICES.get(key)
    if choice is None:
        choice = _CHOICES[key] = _choose_backend(op, torch.device(device_type), has_cpu_ext)
    return choice


def _choose_backend(op: str, device: torch.device, has_cpu_ext: bool) -> str:
    """:func:`select_backend`'s decision (raising on a request that cannot be met)."""
    requested = requested_backend()
    if requested == "auto":
        if device.type == "cuda":
            choice = "triton" if triton_available() else "torch"
        elif triton_interpreting() and triton_available():
            choice = "triton"
        elif has_cpu_ext:
            choice = "cpu_ext"
        else:
            choice = "torch"
    else:
        choice = requested
        if choice == "triton" and not triton_available():
            raise RuntimeError("FUSEDIST_KERNEL_BACKEND=triton but triton cannot be imported")
        if choice == "triton" and device.type == "cpu" and not triton_interpreting():
            raise RuntimeError(
                "FUSEDIST_KERNEL_BACKEND=triton on CPU tensors needs TRITON_INTERPRET=1 "
                "(set before triton is imported)"
            )
        if choice == "cpu_ext" and (device.type != "cpu" or not has_cpu_ext):
            from ._extension import is_available, load_error

            if device.type != "cpu" or not is_available("_cpu_ops"):
                raise RuntimeError(
                    f"FUSEDIST_KERNEL_BACKEND=cpu_ext but {op} cannot use the C++ CPU extension on "
                    f"{device.type} tensors ({load_error('_cpu_ops') or 'CPU tensors only'})"
                )
            choice = "torch"  # the extension is built but has no kernel for this op
    key = (op, f"{device.type}:{choice}")
    if key not in _logged:
        _logged.add(key)
        logger.info("fusedist: %s on %s tensors uses the %s backend", op, device.type, choice)
    return choice
