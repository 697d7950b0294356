"""What one synchronized backward measured: how much of its communication the backward's
compute hid, and how many gradient bytes it held (``DistributedDataParallel.last_stats``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .._timeline import now_us

if TYPE_CHECKING:
    from .reducer import Reducer


def backward_stats(reducer: "Reducer", t_compute_end: float, t_end: float) -> tuple[dict, float]:
    """``(stats, first_launch)`` of the backward that just synchronized: timestamps are the
    timeline's microseconds (``now_us``); ``first_launch`` is its first bucket launch
    (``t_compute_end`` when none launched before the end)."""
    first_launch = min(reducer.t_launch.values()) if reducer.t_launch else t_compute_end
    span = max(t_end - first_launch, 1e-9)
    exposed = max(t_end - max(t_compute_end, first_launch), 0.0)
    stats = {
        "backward_us": t_compute_end - reducer.t_begin,
        "comm_span_us": span,
        "exposed_comm_us": exposed,
        "hidden_fraction": max(0.0, 1.0 - exposed / span),
        "first_launch_before_last_grad": first_launch < _us(reducer.t_last_grad),
        "buckets": len(reducer.layout.buckets),
        # Note [finishing buckets during backward]: finished by gradient hooks, i.e.
        # before the last gradient's hook returned (the rest at the end of backward).
        "buckets_finished_in_backward": reducer.finished_in_hooks,
        # Note [bucket storage]: full-gradient bytes held at most during this backward
        # (the bucket storage; a reduce_dtype conversion in flight is extra), and all of them.
        "peak_grad_bytes": reducer.layout.peak_bytes,
        "grad_bytes": reducer.layout.total_bytes,
    }
    return stats, first_launch


def _us(t: float) -> float:
    """A raw ``perf_counter`` reading on the timeline's microsecond clock (``now_us``)."""
    return now_us() - (time.perf_counter() - t) * 1e6
