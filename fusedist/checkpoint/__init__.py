"""Checkpoints: per-rank atomic files, a manifest written last, resharding at load.

``save(directory, model, optimizer=None, scaler=None, extra=None)`` and
``load(directory, model, optimizer=None, scaler=None) -> extra`` (with ``strict=False`` a
``LoadResult``: torch's missing/unexpected keys, and ``.extra``); see :mod:`.api` (and
:mod:`._checks` for what both verify before anything is written or changed).
``Checkpointer`` (:mod:`.periodic`): periodic asynchronous saves, retention, automatic resume.
``FusedOptimizerLoadPlanner`` (:mod:`.dcp_planner`): torch's distributed checkpoint of torch's
optimizer into a fused optimizer with master weights.
``record_param_groups`` (:mod:`._group_record`): a flattened optimizer state for ``dcp.save``
that keeps which parameters each param group held, for ``load``'s check of the groups.
"""

from ._files import CheckpointError
from .api import LoadResult, load, load_per_rank, save
from ._group_record import record_param_groups
from .dcp_planner import FusedOptimizerLoadPlanner
from .periodic import Checkpointer
from .sampler import ElasticDistributedSampler

__all__ = ["save", "load", "load_per_rank", "LoadResult", "CheckpointError", "Checkpointer",
           "ElasticDistributedSampler", "FusedOptimizerLoadPlanner", "record_param_groups"]  # [resume] load_per_rank
