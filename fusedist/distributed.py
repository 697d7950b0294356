"""Process-group initialization from ``torchrun``'s environment, and the timeout policy.

fusedist never ships a launcher or rendezvous of its own: ``torchrun`` sets the environment,
``torch.distributed`` does the rest. This module only adds the checks and defaults a user
would otherwise get wrong (device binding, a finite default timeout, a readable error when the
environment is incomplete).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import math
import numbers
import os
import sys
import types
import weakref

import torch
import torch.distributed as dist

from . import _group_table

# Note [binding torch.distributed.nn early]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch.distributed.nn.functional writes ``group=group.WORLD`` as default arguments, which
# Python evaluates once, when the module is first imported. Imported after
# init_process_group -- torch.optim's first optimizer imports it, through torch._dynamo --
# those ten defaults hold the default process group for the rest of the process:
# destroy_process_group() can no longer free it, and it is left to interpreter shutdown,
# where freeing a gloo group can abort the process (Note [releasing destroyed groups] in
# fusedist/comm/__init__.py); after a new init_process_group() those functions still run on
# the destroyed group. Imported here, before fusedist can have created a group, they hold
# None: the default group current at each call. (3 ms.) Two cases remain: fusedist imported
# after init_process_group -- ``import fusedist`` inside a function torchrun's program calls
# after its init -- where this import is the one that captured the group: its defaults are
# set back to None at once, as an import before the init leaves them; and the module
# imported by the program (or torch) after the init, before fusedist: there the captured
# group is torch's behaviour while it lives, and is replaced by None when torch destroys or
# aborts it (a callback of fusedist's one wrapper of torch's unregister calls, beside the release of Note [when
# torch forgets a group] in fusedist/comm/group_ends.py: Note [one wrapper of torch's group-unregister functions]
# in fusedist/_group_table.py), never later used nor held. Those wrappers follow the rule of
# fusedist's other process-wide hooks: ``_process_hooks.uninstall()`` removes them, and the next
# communicator lookup puts them back while a default still holds a live group (first dropping one
# destroyed meanwhile): before, they were installed at import only, so after ``uninstall()`` a
# destroyed group stayed held by those defaults for good, and was used by their next call.
_NN_DEFAULTS_KEY = "torch.distributed.nn defaults: forget a destroyed group"
#: Whether a default of torch.distributed.nn held a group the program's own import captured, at the last look.
_nn_defaults_followed = False


def _bind_nn_defaults() -> None:
    """Import torch.distributed.nn, leaving its ``group`` defaults as an import before init_process_group
    would (Note [binding torch.distributed.nn early])."""
    if not dist.is_available():
        return
    first_import = "torch.distributed.nn.functional" not in sys.modules
    importlib.import_module("torch.distributed.nn")

    if first_import:
        _forget_captured_groups(lambda group: True)
    else:
        follow_nn_defaults(start=True)


def follow_nn_defaults(start: bool = False) -> None:
    """Where torch.distributed.nn's defaults hold a group the program's import captured, drop any destroyed one
    and wrap torch's unregister calls to drop the rest at their destroy; once at import (``start``), again at
    each communicator lookup where ``_process_hooks.uninstall()`` removed the wrappers (Note [binding
    torch.distributed.nn early]). Costs one flag read where no default held a group."""
    global _nn_defaults_followed
    if not (start or _nn_defaults_followed):
        return
    if not start and _group_table.watching(_NN_DEFAULTS_KEY):
        return
    _nn_defaults_followed = _forget_captured_groups(_destroyed) > 0  # (one destroyed meanwhile: dropped now)
    if _nn_defaults_followed:  # (one wrapper of torch's: Note [one wrapper of torch's group-unregister functions])
        _group_table.after_groups_forgotten(_NN_DEFAULTS_KEY, _forget_destroyed)


def _forget_captured_groups(forget) -> int:
    """Set each process group held as a default argument of torch.distributed.nn.functional's functions to None
    where ``forget(group)``; returns how many such defaults still hold a group."""
    functional = sys.modules.get("torch.distributed.nn.functional")
    held = 0
    for fn in list(vars(functional).values()) if functional is not None else ():
        if not isinstance(fn, types.FunctionType) or fn.__module__ != functional.__name__:
            continue
        if fn.__defaults__:
            fn.__defaults__ = tuple(None if isinstance(value, dist.ProcessGroup) and forget(value) else value
                                    for value in fn.__defaults__)
            held += sum(isinstance(value, dist.ProcessGroup) for value in fn.__defaults__)
        if fn.__kwdefaults__:
            fn.__kwdefaults__ = {name: None if isinstance(value, dist.ProcessGroup) and forget(value) else value
                                 for name, value in fn.__kwdefaults__.items()}
            held += sum(isinstance(value, dist.ProcessGroup) for value in fn.__kwdefaults__.values())
    return held


def _destroyed(group) -> bool:
    """Whether torch no longer has ``group`` (destroyed or aborted)."""
    return not _group_table.is_alive(group)


def _forget_destroyed() -> None:
    """Drop the destroyed groups from torch.distributed.nn's defaults (torch has just forgotten groups)."""
    _forget_captured_groups(_destroyed)


_bind_nn_defaults()

#: Default timeout of every collective fusedist waits on. Finite on purpose: a rank that dies or
#: diverges must turn into an error on the others, not a hang. Override with
#: ``FUSEDIST_TIMEOUT_S`` or ``init_distributed(timeout=...)``.
DEFAULT_TIMEOUT_S = 600.0

#: Longest timeout kept as a deadline (about 31.7 years); a longer one -- ``datetime.timedelta.max`` or
#: ``inf``, which programs pass for "no timeout" -- is used as this, i.e. no deadline in practice (Note
#: [unbounded timeouts]). The same bound as the CUDA extension's waits (Note [wait timeouts] in
#: csrc/cuda/wait_deadline.h).
LONGEST_TIMEOUT_S = 1e9

# Note [unbounded timeouts]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# ``datetime.timedelta.max`` (8.6e13 s) is finite, but deadline arithmetic on it breaks almost
# everywhere: ``timedelta(seconds=launch + timeout - now)`` overflows timedelta's range,
# ``threading.Event.wait`` refuses anything over ``threading.TIMEOUT_MAX`` (9.2e9 s), and gloo
# converts timeouts to nanoseconds, where it overflows to a negative count: torch's
# ``init_process_group("gloo", timeout=timedelta.max)`` fails with "[enforce fail at
# gloo/context.cc] timeout.count() >= 0. Invalid timeout", and a gloo work's
# ``wait(timeout=timedelta.max)`` raises "Operation timed out!" at once. So a timeout longer than
# LONGEST_TIMEOUT_S is replaced by LONGEST_TIMEOUT_S where it enters fusedist (here, and a
# communicator's ``timeout``), and everything downstream computes with a value every layer takes.
# ``inf`` means the same wherever a timeout is taken -- ``FUSEDIST_TIMEOUT_S=inf``,
# ``init_distributed(timeout=float("inf"))``, a communicator's ``timeout``, ``handle.wait(float("inf"))``
# and the CUDA extension's wait -- so no spelling of "no deadline" works in one place and fails in another.

_REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# init_distributed(timeout=...): (a weak reference to the default group it created, the timeout).
# Held while that group is the default one, so that fusedist's own collectives on it and on
# its subgroups time out with it (not at FUSEDIST_TIMEOUT_S's 600 s while gloo's would at the
# given timeout), and a default group made later by init_process_group is not affected.
_init_timeout: tuple[weakref.ref, datetime.timedelta] | None = None


@dataclasses.dataclass(frozen=True)
class DistributedInfo:
    """What ``init_distributed`` set up."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


def collective_timeout() -> datetime.timedelta:
    """The timeout applied to each collective wait: ``init_distributed(timeout=...)``'s for the
    group it created, else ``FUSEDIST_TIMEOUT_S``, else :data:`DEFAULT_TIMEOUT_S`."""
    if _init_timeout is not None and dist.is_available() and dist.is_initialized():
        group, timeout = _init_timeout
        if group() is dist.group.WORLD:
            return timeout
    value = os.environ.get("FUSEDIST_TIMEOUT_S")
    if value is None:
        return datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
    return bounded_timeout(value, "FUSEDIST_TIMEOUT_S")


def bounded_timeout(value, name: str) -> datetime.timedelta:
    """``value`` (seconds or a timedelta) as a positive timedelta of at most LONGEST_TIMEOUT_S: ``inf``,
    ``timedelta.max`` and anything longer mean no deadline and are stored as the bound (Note [unbounded
    timeouts]), the same as ``handle.wait(float("inf"))``. NaN, zero (or under a microsecond), negative
    values and non-numbers raise a ValueError naming ``name``; a bool, a TypeError (Note [bool timeouts])."""
    _refuse_bool(value, name)
    longest = datetime.timedelta(seconds=LONGEST_TIMEOUT_S)
    if isinstance(value, datetime.timedelta):
        timeout = min(value, longest)
    else:
        try:
            seconds = float(value)
        except OverflowError:  # an int (or Fraction) past float's range: its sign still says which
            seconds = math.inf if value > 0 else -math.inf
        except (TypeError, ValueError):
            seconds = math.nan
        timeout = datetime.timedelta(seconds=min(seconds, LONGEST_TIMEOUT_S)) if seconds > 0 else None
    if timeout is None or timeout <= datetime.timedelta(0):  # (NaN compares False: None here)
        raise ValueError(f"{name} must be a positive number of seconds or a datetime.timedelta (inf, "
                         f"timedelta.max or anything over {LONGEST_TIMEOUT_S:g} s: no deadline), got {value!r}")
    return timeout


# Note [bool timeouts]
# ~~~~~~~~~~~~~~~~~~~~
# A bool is a number to Python (``True == 1``), so ``init_distributed(timeout=True)`` meant a one-second
# deadline on every collective and ``timeout=False`` the "must be positive" error. Neither is what a caller
# writing a bool means ("use a timeout", "no timeout"?), and torch's ``init_process_group`` takes only a
# timedelta (a bool is a TypeError there). So a bool is refused wherever fusedist takes a timeout, naming
# the argument, before it becomes a deadline.
def _refuse_bool(value, name: str) -> None:
    if isinstance(value, bool):
        raise TypeError(f"fusedist: {name} must be a number of seconds or a datetime.timedelta, got the bool "
                        f"{value!r}; pass e.g. 600 or datetime.timedelta(minutes=10) (inf for no deadline)")


def wait_timeout(timeout, default: datetime.timedelta, what) -> datetime.timedelta:
    """A collective handle's ``wait(timeout)`` (a timedelta, seconds or None) as torch's works read it:
    they count whole milliseconds and take 0 for "no timeout", so None, zero and anything under a
    millisecond wait ``default``, the collective's own timeout (waiting that out is a handle's "no
    timeout"; bounded already: a communicator's ``timeout``), where the gloo exchange would otherwise
    give up at once on what torch's gloo work waits for. What it returns is at most LONGEST_TIMEOUT_S
    (Note [unbounded timeouts]), a number or a timedelta alike, so callers compute with it as it is.
    ``what()``: the collective, for an error.

    Note [negative wait timeouts]
        A negative (or NaN) timeout is refused with a ValueError before anything is waited for, on
        every communicator, and the collective goes on (a later ``wait()`` returns its result). It
        is a caller's bug with no common meaning: torch's gloo work fails the wait at once ("Operation
        timed out!", torch 2.13), and such a wait can leave gloo's pairs closed; the gloo exchange
        gave up at once (and called it a timeout); the direct-NCCL communicator
        moved its watchdog's deadline into the past, failing a collective that was running fine
        (with FUSEDIST_NCCL_WATCHDOG=exit, ending the process). The CUDA extension's own wait
        refuses it the same way (Note [wait timeouts] in csrc/cuda/wait_deadline.h)."""
    if isinstance(timeout, bool):
        _refuse_bool(timeout, f"{what()}: wait(timeout)")
    if isinstance(timeout, numbers.Real):
        seconds = float(timeout)
        got = f"{seconds:g} s"
        timeout = datetime.timedelta(seconds=min(seconds, LONGEST_TIMEOUT_S)) if seconds >= 0 else None
    elif timeout is not None and not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"fusedist: {what()}: wait(timeout) takes a datetime.timedelta, a number of seconds or "
                        f"None, got {type(timeout).__name__}")
    else:
        got = f"{timeout.total_seconds():g} s" if timeout is not None else ""
    if got and (timeout is None or timeout < datetime.timedelta(0)):  # (a NaN is None here)
        raise ValueError(f"fusedist: {what()}: wait(timeout) must be >= 0 seconds, got {got}; pass None to wait "
                         "up to the communicator's timeout. The collective goes on: wait() again for its result")
    if timeout is None or timeout < datetime.timedelta(milliseconds=1):
        return default
    return min(timeout, datetime.timedelta(seconds=LONGEST_TIMEOUT_S))


def _as_timedelta(timeout) -> datetime.timedelta:
    if timeout is None:
        return collective_timeout()
    return bounded_timeout(timeout, "init_distributed(timeout=...)")


def _backends_by_device(spec: str) -> dict:
    """torch's backend spec (``"gloo"``, ``"cpu:gloo,cuda:nccl"``) as {device type: backend}."""
    spec = spec.lower()
    if ":" not in spec:
        return {"cpu": spec, "cuda": spec}
    return dict(part.strip().split(":", 1) for part in spec.split(",") if part.strip())


def _compute_backend(by_device: dict) -> str:
    """The backend of the device this process computes on: NCCL's GPU where a spec gives CUDA
    tensors to NCCL and CUDA is here, else the CPU's (what ``init_distributed`` reports)."""
    cuda = by_device.get("cuda") if torch.cuda.is_available() else None
    return cuda if cuda == "nccl" else by_device.get("cpu", next(iter(by_device.values())))


def _current_info(backend: str | None = None) -> DistributedInfo:
    """The setup of the group torch already initialized. Its backend is read from the group's
    per-device configuration: ``dist.get_backend()`` says ``"undefined"`` for a group made with
    several backends -- torch's own default, ``init_process_group()`` without one -- or names
    the spec (``"cpu:gloo"``), which no requested ``backend`` would equal."""
    by_device = _backends_by_device(dist.get_backend_config())
    if backend is not None and backend.lower() not in by_device.values():
        raise RuntimeError(
            f"torch.distributed is already initialized with backend {dist.get_backend_config()!r}; "
            f"init_distributed(backend={backend!r}) cannot change it"
        )
    backend = _compute_backend(by_device) if backend is None else backend.lower()
    local_rank = _env_int("LOCAL_RANK", dist.get_rank())
    if backend == "nccl" and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    return DistributedInfo(dist.get_rank(), dist.get_world_size(), local_rank, backend, device)


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None and default is not None:
        return default
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"fusedist.init_distributed: malformed launch environment: {name}={value!r} is not "
                           "an integer") from None


def init_distributed(backend: str | None = None, timeout=None) -> DistributedInfo:
    """Initialize ``torch.distributed`` from the environment ``torchrun`` provides.

    Picks ``nccl`` when CUDA is available and ``gloo`` otherwise, binds this process to GPU
    ``LOCAL_RANK``, and applies ``timeout`` (seconds or timedelta; default
    :func:`collective_timeout`; ``inf``, ``datetime.timedelta.max`` or anything over :data:`LONGEST_TIMEOUT_S`
    is no deadline: the group and fusedist's collectives get LONGEST_TIMEOUT_S, as gloo refuses
    timedelta.max itself). Calling it again, or after ``torch.distributed`` was initialized
    elsewhere, returns the existing setup; a ``timeout`` given then bounds fusedist's collectives
    on that group from then on (torch's own collectives keep the timeout the group was made with).

    A new group is checked at once: every FUSEDIST_* setting a rank set is valid, and those deciding which
    collectives a step runs are alike on every rank (Note [settings that must agree] in
    reliability/settings_agreement.py).

    Raises:
        fusedist.reliability.settings_agreement.SettingsError: (a ValueError) a setting is refused or
            differs across ranks, on every rank alike; the group is destroyed again.
        RuntimeError: the launch environment is incomplete (names the missing variables) or
            malformed (names the variable: RANK outside WORLD_SIZE, LOCAL_RANK negative or outside
            LOCAL_WORLD_SIZE, MASTER_PORT not a port), or LOCAL_RANK names a GPU this machine does not have.
    """
    if dist.is_available() and dist.is_initialized():
        info = _current_info(backend)
        if timeout is not None:
            _remember_timeout(_as_timedelta(timeout))
        return info

    missing = [name for name in _REQUIRED_ENV if name not in os.environ]
    if missing:
        raise RuntimeError(
            "fusedist.init_distributed: the launch environment is incomplete, missing "
            + ", ".join(missing)
            + ". Launch with torchrun (e.g. `torchrun --nproc_per_node=2 train.py`), which sets "
            "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, or set them yourself."
        )
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK", rank)
    if not 0 <= rank < world_size:
        raise RuntimeError(f"fusedist.init_distributed: RANK={rank} is outside WORLD_SIZE={world_size}")
    # torch's env:// rendezvous reads MASTER_PORT with a bare int(), whose error names no variable
    port = _env_int("MASTER_PORT")
    if not 0 <= port <= 65535:
        raise RuntimeError(f"fusedist.init_distributed: malformed launch environment: MASTER_PORT={port} is "
                           "not a port (0-65535)")
    if local_rank < 0:
        raise RuntimeError(f"fusedist.init_distributed: malformed launch environment: LOCAL_RANK={local_rank} "
                           "is negative")
    # torchrun sets both; a hand-written launch where they disagree would bind a GPU no local process should use
    if "LOCAL_RANK" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        local_world = _env_int("LOCAL_WORLD_SIZE")
        if local_rank >= local_world:
            raise RuntimeError(
                f"fusedist.init_distributed: malformed launch environment: LOCAL_RANK={local_rank} is outside "
                f"LOCAL_WORLD_SIZE={local_world} (rank {rank}): LOCAL_RANK must be below the number of processes "
                "on this node; launch with torchrun, or set LOCAL_RANK in 0..LOCAL_WORLD_SIZE-1")

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    backend = backend.lower()  # torch's spelling: "NCCL" is nccl, and binds the GPU as nccl does
    explicit, timeout = timeout is not None, _as_timedelta(timeout)
    device = torch.device("cpu")
    kwargs = {}
    reported = _compute_backend(_backends_by_device(backend))  # "cpu:gloo,cuda:nccl" binds the GPU too
    if reported == "nccl":
        count = torch.cuda.device_count()
        if count == 0:  # ("use --nproc_per_node <= 0" said nothing of the cause)
            raise RuntimeError(
                f"fusedist.init_distributed: backend {backend!r} needs a GPU, and rank {rank} sees none "
                "(torch.cuda.device_count() is 0); use backend='gloo', the default without CUDA")
        if local_rank >= count:
            unset = "" if "LOCAL_RANK" in os.environ else f" (LOCAL_RANK is not set: RANK={rank} was taken for it)"
            raise RuntimeError(
                f"fusedist.init_distributed: rank {rank} has LOCAL_RANK={local_rank}{unset} but this "
                f"node has {count} GPU(s); use --nproc_per_node <= {count}"
                + ("; torchrun sets LOCAL_RANK on every node" if unset else "")
            )
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        kwargs["device_id"] = device
    dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
    _check_settings_or_destroy()
    _remember_timeout(timeout if explicit else None)
    return DistributedInfo(rank, world_size, local_rank, reported, device)


def _check_settings_or_destroy() -> None:
    """The FUSEDIST_* settings, valid and alike on every rank (Note [settings that must agree] in
    reliability/settings_agreement.py); on a refusal the group just made is destroyed, so a retry after fixing
    the environment creates a new one instead of returning the unchecked one."""
    from .reliability.settings_agreement import check_settings_agree

    try:
        check_settings_agree()
    except BaseException:
        dist.destroy_process_group()
        raise


def _remember_timeout(timeout: datetime.timedelta | None) -> None:
    """``timeout`` bounds fusedist's collectives on the default group (None: the default)."""
    global _init_timeout
    _init_timeout = (weakref.ref(dist.group.WORLD), timeout) if timeout is not None else None
