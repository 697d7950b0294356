"""Where a ZeroRedundancyOptimizer keeps what changes after construction, so that methods run
through a framework's optimizer wrapper change the optimizer's own state (Note [state shared
with wrappers])."""

from __future__ import annotations

import weakref

from .join import JoinableOptimizer


# Note [state shared with wrappers]
#     Frameworks wrap an optimizer in an instance of a class made on the fly with the
#     optimizer's class as a second base, so that isinstance holds, and forward the attributes
#     the wrapper lacks to the optimizer (Lightning's LightningOptimizer and Fabric's
#     _FabricOptimizer, through ``__getattr__``; earlier versions of them copied the optimizer's
#     ``__dict__`` instead). A method the wrapper class does not define itself -- zero_grad,
#     add_param_group, clip_grad_norm_, the GradScaler protocol's -- is found on this class and
#     runs with the wrapper as ``self``: what it reads is the optimizer's, but what it assigns
#     lands on the wrapper, and the optimizer's own methods (its step, which wrappers forward)
#     never see it. zero_grad marks stage 2's gradient shard stale by an assignment, so
#     ``optimizer.zero_grad()`` through Fabric's wrapper left the shard in place and the next
#     backward added to the gradients it was to clear (a GAN loop's discriminator stepped with
#     the generator step's gradients too); ``optim`` read through a wrapper built a second inner
#     optimizer; a GradScaler given the wrapper set its found-inf flag there, so an overflowing
#     step was taken; a Join given the wrapper configured the wrapper, and the ranks hung. So
#     every attribute that changes after construction lives in one :class:`MutableState`, held
#     by the optimizer and reached through it by any wrapper, behind a property of the same name
#     (``_MUTABLE_ATTRIBUTES``): an assignment through the optimizer or any wrapper changes the
#     one state, and every reader sees it. An attribute assigned after construction must be
#     listed there.
class MutableState:
    """The attributes of a ZeroRedundancyOptimizer that change after construction (Note [state
    shared with wrappers]); the class attributes are the values before the first assignment."""

    def __init__(self, owner):
        self.owner = weakref.ref(owner)  # the optimizer itself, for what must act on it, not a wrapper

    _join_config = JoinableOptimizer._join_config
    _join_shadowing = JoinableOptimizer._join_shadowing
    _join_clip = JoinableOptimizer._join_clip
    _replaced = None  # why a stage-2 optimizer may not step any more (Note [an optimizer built again])
    _sharded_compared = False  # Note [one comparison a step] in trainable_check.py
    _trainable_verdict = None  # Note [the comparison read without a synchronization] in trainable_check.py
    _grads_agreed = False  # Note [gradients nobody averaged] in grad_agreement.py
    _stage2_pending = None  # Note [stage 2 completed by add_param_group] in deferred_stage2.py
    overlap_param_gather = False
    _zero_flag_mark = None  # Note [a refused or skipped sharded step and the LR scheduler] in step_flag.py
    ddp = None  # the DDP model followed (a newer wrapper of the module takes over: fusedist/ddp/succession.py)


# What the optimizer, its mixins and helpers, DDP's join and the GradScaler assign after
# construction: the gradient bookkeeping (grads.py), the shards and the inner optimizer
# (shards.py, grow.py, pieces.py), the join state (join.py, fusedist/ddp/join.py) and the
# scaler protocol's attributes, and the DDP model, which a newer wrapper of the module replaces
# (Note [an optimizer over a module wrapped again] in fusedist/ddp/succession.py).
_MUTABLE_ATTRIBUTES = (
    "_grads_present", "_stage2_with_grad", "_stage2_zero_filled", "_stage2_stepped",
    "_trainable", "_frozen", "_partition", "_grad_shards", "_grad_store", "_flat_params", "_masters",
    "_piece_grads", "_pieces", "_offload", "inner", "_param_versions",
    "_join_config", "_join_shadowing", "_join_clip", "_fusedist_join_config",
    "grad_scale", "found_inf", "step_context", "_replaced", "_may_grow",
    "_sharded_compared", "_trainable_verdict", "ddp", "_stage2_pending", "overlap_param_gather",
    "_zero_flag_mark", "_grads_agreed",
)


def _mutable_attribute(name: str) -> property:
    """``name`` as a property over the optimizer's :class:`MutableState` (Note [state shared
    with wrappers])."""

    def get(self):
        return getattr(self._zero_mutable, name)

    def set(self, value) -> None:
        setattr(self._zero_mutable, name, value)

    return property(get, set, doc=f"``{name}``, kept where wrappers share it (Note [state shared with wrappers]).")


def share_with_wrappers(cls: type) -> None:
    """Make each of ``_MUTABLE_ATTRIBUTES`` a property of ``cls`` over its instances'
    ``_zero_mutable`` (a :class:`MutableState` set first thing in ``__init__``)."""
    for name in _MUTABLE_ATTRIBUTES:
        setattr(cls, name, _mutable_attribute(name))
