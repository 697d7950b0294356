"""``model.logger``: the counterpart of torch DDP's ``dist.Logger`` on fusedist's wrapper.

Note [the model's logger]
    torch's DDP keeps a C++ ``dist.Logger`` as ``model.logger``; code written for it reads the
    logging data through it (``model.logger._get_ddp_logging_data()``, whose ``strs_map`` and
    ``ints_map`` split the dict ``model._get_ddp_logging_data()`` gives) and records into it what
    the logging data should show: an error (``set_error_and_log``: ``has_error`` 1 and ``error``
    the text), a communication hook's name, that uneven inputs were joined, a static graph. The
    same methods here record the same fields into fusedist's logging dict (Note [torch's DDP
    logging data] in logging_data.py). torch's reducer timings have no counterpart:
    ``set_runtime_stats_and_log`` records nothing (fusedist times the last synchronized backward
    in ``model.comm_stats()``), and ``set_construction_data_and_log``, which torch's constructor
    calls once, is refused. The logger holds its model weakly (Note [a dropped wrapper goes at
    once] in wrapper.py).
"""

from __future__ import annotations

import weakref

__all__ = ["DDPLogger", "LoggingData"]


class LoggingData:
    """torch's ``DDPLoggingData``: the logging dict's string values and integer values."""

    def __init__(self, data: dict):
        self.strs_map = {k: v for k, v in data.items() if isinstance(v, str)}
        self.ints_map = {k: v for k, v in data.items() if not isinstance(v, str)}


class DDPLogger:
    """``model.logger`` (Note [the model's logger]); ``recorded`` holds what was logged into it."""

    def __init__(self, model):
        self._model = weakref.ref(model)
        self.recorded: dict = {}

    def _owner(self):
        model = self._model()
        if model is None:
            raise RuntimeError("fusedist.DistributedDataParallel.logger: its model was freed")
        return model

    def _get_ddp_logging_data(self) -> LoggingData:
        return LoggingData(self._owner()._get_ddp_logging_data())

    def set_error_and_log(self, error: str) -> None:
        self.recorded.update(has_error=1, error=str(error))

    def _set_comm_hook_name(self, comm_hook: str) -> None:
        self.recorded["comm_hook"] = str(comm_hook)

    def _set_uneven_input_join(self) -> None:
        self.recorded["join_uneven_inputs"] = 1

    def _set_static_graph(self) -> None:
        """Logs a static graph, as torch's logger does; the model's own ``_set_static_graph()``
        makes it one."""
        self.recorded["static_graph"] = 1

    def set_runtime_stats_and_log(self) -> None:
        """Nothing to record: the reducer timings torch's logger samples are ``model.comm_stats()`` here."""

    def set_construction_data_and_log(self, *args, **kwargs) -> None:
        raise RuntimeError(
            "fusedist.DistributedDataParallel.logger.set_construction_data_and_log is not supported: torch's "
            "DistributedDataParallel calls it once from its constructor, and fusedist's wrapper records its "
            "construction settings itself; read them with model._get_ddp_logging_data()")
