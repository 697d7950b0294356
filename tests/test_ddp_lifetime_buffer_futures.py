"""The wait for a buffer communication hook's futures is bounded (Note [a buffer hook's futures] in
fusedist/ddp/buffer_futures.py): a future nobody completes raises, naming the hook and the rank, instead of
holding the training; a future that failed raises its error, naming the hook."""

from __future__ import annotations

import datetime

import pytest
import torch

from fusedist.comm.base import CollectiveError
from fusedist.ddp.buffer_futures import PendingBufferFutures


def test_a_future_never_completed_raises_at_the_collective_timeout_naming_the_hook():
    done, never = torch.futures.Future(), torch.futures.Future()
    done.set_result(None)
    pending = PendingBufferFutures([done, never], "_counting_hook", 3, datetime.timedelta(seconds=0.2))
    with pytest.raises(CollectiveError, match=r"rank 3\).*_counting_hook did not complete within 0.2 s"):
        pending.wait()
    pending.wait()  # (waited once: a second call does not wait again)


def test_a_failed_future_raises_its_error_naming_the_hook():
    failed = torch.futures.Future()
    failed.set_exception(RuntimeError("connection reset"))
    pending = PendingBufferFutures([failed], "_counting_hook", 1, datetime.timedelta(seconds=5))
    with pytest.raises(CollectiveError, match="_counting_hook failed: .*connection reset"):
        pending.wait()
