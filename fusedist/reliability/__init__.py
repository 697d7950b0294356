"""Reliability: no silent hangs, consistent errors on every rank.

* :mod:`.monitor` -- the always-on collective monitor (history ring, stall reports through
  the torch.distributed store, crash entries for ranks that die of an exception);
* :mod:`.engine_watch` -- the observer of a DDP model's gradient engine: step counters, the
  per-step check at the point of the collective order the engine announces, stall-report context;
* :mod:`.step_check` -- DDP's per-step cross-rank agreement check;
* :mod:`.param_check` -- the digest of DDP's replicated parameters that check compares every
  ``FUSEDIST_PARAM_CHECK_EVERY`` steps and at ``check_consistency()``;
* :mod:`.optimizer_guard` -- ``optimizer.step()`` misuse checks;
* :mod:`.stall_report` -- the store protocol and the report text.

``FUSEDIST_CHECKS=0`` turns the per-step parts off (see :func:`checks_enabled`).
"""

from .config import checks_enabled
from .monitor import CollectiveMonitor, StallError, attach_monitor, monitor_of, publish_crash

__all__ = [
    "CollectiveMonitor",
    "StallError",
    "attach_monitor",
    "checks_enabled",
    "monitor_of",
    "publish_crash",
]
