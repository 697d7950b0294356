"""A bool is refused wherever fusedist takes a timeout, naming the argument (Note [bool timeouts] in
fusedist/distributed.py): ``True`` is the number 1 to Python, so ``init_distributed(timeout=True)`` gave
every collective a one-second deadline, where torch's ``init_process_group`` raises a TypeError."""

from __future__ import annotations

import datetime
import os
import tempfile

import pytest
import torch.distributed as dist

from fusedist.distributed import bounded_timeout, wait_timeout

_ENV = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "LOCAL_RANK": "0"}


def _torch_error(timeout) -> type:
    """What torch's own init_process_group raises for ``timeout`` (before any rendezvous)."""
    path = os.path.join(tempfile.mkdtemp(prefix="fusedist-bool-timeout-"), "rdzv")
    try:
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - the type is the answer
        return type(exc)
    dist.destroy_process_group()
    raise AssertionError(f"torch accepted timeout={timeout!r}")


@pytest.mark.parametrize("value", [True, False])
def test_init_distributed_refuses_a_bool_timeout_as_torch_does(monkeypatch, value):
    import fusedist
    import fusedist.distributed as fd

    assert not dist.is_initialized()
    expected = _torch_error(value)
    assert expected is TypeError and not dist.is_initialized()
    reached = []
    monkeypatch.setattr(fd.dist, "init_process_group", lambda *a, **k: reached.append(k))
    for name, v in _ENV.items():
        monkeypatch.setenv(name, v)
    # Before: timeout=True reached init_process_group as timedelta(seconds=1), and bounded every collective
    with pytest.raises(expected, match=r"init_distributed\(timeout=\.\.\.\) must be a number of seconds or a "
                                       rf"datetime.timedelta, got the bool {value}"):
        fusedist.init_distributed(timeout=value)
    assert reached == [], reached


def test_a_communicators_timeout_and_a_wait_refuse_a_bool():
    # (the communicator's timeout setter goes through bounded_timeout with its own name)
    with pytest.raises(TypeError, match="the torch communicator's timeout must be .* got the bool True"):
        bounded_timeout(True, "the torch communicator's timeout")
    with pytest.raises(TypeError, match=r"all_reduce \(collective #3\): wait\(timeout\) must be .* got the bool True"):
        wait_timeout(True, datetime.timedelta(seconds=60), lambda: "all_reduce (collective #3)")
    # numbers and timedeltas still work
    assert bounded_timeout(1, "t") == datetime.timedelta(seconds=1)
    assert wait_timeout(2.5, datetime.timedelta(seconds=60), lambda: "x") == datetime.timedelta(seconds=2.5)
