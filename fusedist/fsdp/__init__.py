"""ZeRO stage 3 as ``fully_shard``, with torch FSDP2's signature (``from fusedist import fully_shard``).

Modules, one job each: ``policy`` (MixedPrecisionPolicy, CPUOffloadPolicy), ``layout`` (where
a parameter lives in its unit's flat buffer), ``unit`` (the parameter swap and its schedule),
``buffers`` (the flat shard and gathered buffer behind it), ``grads`` (gradients to shards),
``mesh`` (the shard and replicate groups of a mesh),
``replicate`` (HSDP's all-reduce across replicas), ``tensor_parallel`` (DTensor parameters of a
tensor-parallel mesh: their local tensors sharded), ``extension`` (parameters that choose
what is gathered: FSDP2's all-gather extension, torchao's float8 weights), ``packed`` (frozen
quantized storage, QLoRA's NF4 weights, held as bytes), ``float8`` (their
scales for the next gathers in one all-reduce), ``post_forward`` (an int
``reshard_after_forward``: the smaller groups units reshard to after forward), ``state`` (when
to gather, reshard and reduce), ``root_setup`` (a root's set-up at its first forward),
``recovery`` (forwards and backwards an exception ended midway),
``containers`` (the tensors in a unit's inputs and outputs), ``stale`` (gathered copies
an optimizer step outdated), ``holder``
(global norm and inf checks over shards), ``state_dict`` (whole-parameter export/import),
``dcp`` (state-dict entries torch's distributed checkpoint can save and load), ``whole_entry`` (an
entry's ``full_tensor()`` and ``to_local()``, as FSDP2's DTensor entries have), ``packed_entry`` (the
same two of an NF4 weight's entry: torchao's class, whole or this rank's chunk), ``dtensor_view`` (what
else an entry answers as FSDP2's DTensor: ``placements``, ``device_mesh``, which shard is its own),
``param_view`` (the same names on the parameters, the pieces -- an ``nn.Parameter`` subclass -- where
FSDP2's are DTensors), ``extension_names`` (the same names on torchao's float8 and NF4 pieces, through a
subclass of their own class), ``grad_view`` (and on the pieces' gradients), ``tree_names`` (units' paths that
follow a renumbering), ``replaced_modules`` (a module the units hold replaced after the first forward:
refused),
``state_dict_hooks`` (the hooks that put those entries in ``state_dict()`` and take them back),
``optim_state`` (the same for an optimizer's state over the pieces),
``memory`` (what is held), ``param_init`` (initializing a model built on the meta device as
the unsharded one), ``module_apply`` (``model.apply(fn)`` with whole parameters, through it),
``params_on_read`` (parameter tables that tell it when ``fn`` first reads one),
``api`` (``fully_shard`` and the methods a module gains), ``functions``
(FSDP2's functions over sharded modules: ``register_fsdp_forward_method``, ``share_comm_ctx``).
"""

import torch.distributed.fsdp as _torch_fsdp

from .api import FullyShardedModule, UnshardHandle, fully_shard
from .float8 import precompute_float8_dynamic_scale_for_fsdp
from .functions import register_fsdp_forward_method, share_comm_ctx
from .memory import reset_peak_memory_stats
from .optim_state import track_optimizer
from .param_init import init_parameters
from .policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .state_dict import full_state_dict, load_full_state_dict

#: torch FSDP2's name for the class every module sharded by ``fully_shard`` joins.
FSDPModule = FullyShardedModule

__all__ = [
    "fully_shard", "register_fsdp_forward_method", "share_comm_ctx", "FullyShardedModule", "FSDPModule",
    "UnshardHandle",
    "MixedPrecisionPolicy", "CPUOffloadPolicy", "OffloadPolicy",
    "full_state_dict", "load_full_state_dict", "reset_peak_memory_stats", "track_optimizer", "init_parameters",
    "precompute_float8_dynamic_scale_for_fsdp",
]

# torch's own class (newer torch only), so its import moves with the others; fully_shard refuses
# ``dp_mesh_dims`` by name
if hasattr(_torch_fsdp, "DataParallelMeshDims"):
    DataParallelMeshDims = _torch_fsdp.DataParallelMeshDims
    __all__.append("DataParallelMeshDims")

#: ``torch.distributed.fsdp``'s FSDP1 names: the ``FullyShardedDataParallel`` wrapper and its settings.
_FSDP1_NAMES = frozenset((
    "BackwardPrefetch", "CPUOffload", "FullOptimStateDictConfig", "FullStateDictConfig", "FullyShardedDataParallel",
    "LocalOptimStateDictConfig", "LocalStateDictConfig", "MixedPrecision", "OptimStateDictConfig",
    "OptimStateKeyType", "ShardedOptimStateDictConfig", "ShardedStateDictConfig", "ShardingStrategy",
    "StateDictConfig", "StateDictSettings", "StateDictType"))


def __getattr__(name: str):
    """An FSDP1 name is refused naming the reason, also in ``from fusedist.fsdp import ...`` (an
    ImportError: the import statement replaces an AttributeError's message with its own)."""
    if name in _FSDP1_NAMES:
        raise ImportError(
            f"fusedist.fsdp has no {name}: it belongs to torch's FSDP1 API (the FullyShardedDataParallel wrapper "
            "and its settings), and fusedist implements FSDP2's per-module fully_shard. Shard each block, then "
            "the root, with fusedist.fully_shard (MixedPrecisionPolicy and CPUOffloadPolicy in place of "
            "MixedPrecision and CPUOffload; fusedist.fsdp.full_state_dict for a full state dict), or keep "
            f"torch.distributed.fsdp.{name}.", name=name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
