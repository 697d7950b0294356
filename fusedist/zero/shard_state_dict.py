"""What ``ZeroRedundancyOptimizer.state_dict()`` returns on a rank without a consolidated state:
the rank's shard, which reads ``["state"]`` with an error saying what to call (Note [a shard read
as the full state])."""

from __future__ import annotations

import collections
import copy


# Note [a shard read as the full state]
#     ``state_dict()`` returns the rank's shard unless ``consolidate_state_dict`` has just gathered
#     the full state there (the shard is what every rank can save and load at any world size).
#     torch's ZeroRedundancyOptimizer raises a RuntimeError there instead, asking for
#     ``consolidate_state_dict(to=...)``; code written for it -- or for torch's optimizers --
#     reads ``["state"]``, which the shard does not have: a bare ``KeyError: 'state'``. So the
#     shard ``state_dict()`` returns is a :class:`ShardStateDict`, whose missing ``"state"``
#     raises :class:`NotConsolidatedError` (a KeyError and a RuntimeError, so either handler
#     catches it) saying what to call. It pickles as an ``OrderedDict``, so a saved shard loads
#     anywhere -- ``torch.load(weights_only=True)`` included, in a process that never imported
#     fusedist -- and comes back a plain dict (whose missing ``"state"`` is a plain KeyError):
#     a file that only loads where a class was allowlisted first costs more than the message.
class NotConsolidatedError(KeyError, RuntimeError):
    """``state_dict()["state"]`` read from a shard (Note [a shard read as the full state])."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ShardStateDict(dict):
    """A rank's shard as ``state_dict()`` returns it (Note [a shard read as the full state])."""

    def __missing__(self, key):
        if key == "state":
            raise NotConsolidatedError(
                f"ZeroRedundancyOptimizer.state_dict() (rank {self.get('rank')} of {self.get('world_size')}) is this "
                "rank's shard, which has no 'state': the full optimizer state has not been consolidated on this "
                "rank. Call consolidate_state_dict(to=0) on every rank first, then state_dict() on rank 0 (as "
                "with torch's ZeroRedundancyOptimizer); or save the shard as it is and load the list of every "
                "rank's shards, or use fusedist.checkpoint.save")
        raise KeyError(key)

    def __reduce_ex__(self, protocol):
        return collections.OrderedDict, (), None, None, iter(self.items())

    def __copy__(self):
        return ShardStateDict(self)

    def __deepcopy__(self, memo):
        return ShardStateDict(copy.deepcopy(dict(self), memo))
