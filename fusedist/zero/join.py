"""ZeroRedundancyOptimizer under uneven inputs: its side of ``model.join()`` / ``Join``.

A rank that ran out of data still takes part in every step of the ranks still training
(Note [joined ranks] in ``fusedist/ddp/join.py``): its optimizer steps its shard with the
averaged gradients -- the active ranks need its updated slice in the parameter all-gathers --
replaying the gradient-norm reductions of its own last step. Kept with ZeRO because the hook
drives the optimizer's step, clip and version tracking; the DDP side of the protocol needs
nothing from ZeRO.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms.join import JoinHook, Joinable

from ..ddp.join import DISABLED, notify


class ZeroJoinHook(JoinHook):
    """A joined rank's ZeroRedundancyOptimizer steps with its shard of the averaged
    gradients (the active ranks need its updated slice in the parameter all-gathers),
    replaying the gradient-norm reductions of its own last step (a clip with the same
    ``max_norm``)."""

    def __init__(self, zero):
        self.zero = zero
        zero._join_live = True

    def main_hook(self) -> None:
        zero = self.zero
        ddp = zero.ddp
        if ddp is not None and ddp._join_state is not None and not ddp._join_state.synced:
            return  # a no_sync() iteration elsewhere: no step follows it
        clip = zero._join_clip
        zero._join_shadowing = True
        try:
            for k in range(zero._join_norm_calls_last):
                if k == 0 and clip is not None:
                    zero.clip_grad_norm_(*clip)
                else:
                    zero._fusedist_check_and_norm(None)
            zero.step()
        finally:
            zero._join_shadowing = False

    def post_hook(self, is_last_joiner: bool) -> None:
        zero = self.zero
        zero.wait_for_params()
        zero._record_param_versions()  # the final broadcast wrote identical values
        zero._join_live = False
        zero._join_config = DISABLED


class JoinableOptimizer(Joinable):
    """The Joinable side of ZeroRedundancyOptimizer (Note [joined ranks])."""

    _join_config = DISABLED  # set by a join context
    _join_live = False
    _join_shadowing = False  # a joined rank's step, run by the hook
    _join_clip = None  # (max_norm, norm_type, error_if_nonfinite) of the last clip_grad_norm_
    _join_norm_calls = 0  # gradient-norm reductions since the last step
    _join_norm_calls_last = 0  # ... in the last step

    def join_hook(self, **kwargs) -> JoinHook:
        if self.ddp is None:
            # A joined rank's step needs the averaged gradients of the active ranks' backward
            # passes, which only a fusedist DDP model hands it (torch's DDP shadows them with
            # an all-reduce whose result it drops, and its p.grad is then stale). torch's
            # ZeroRedundancyOptimizer does not step a joined rank's shard at all: the parameters
            # it owns stop training while the others go on (measured: 2e-2 off DDP + AdamW
            # under the same Join). Refused here, before the first iteration, on every rank.
            raise ValueError(
                f"ZeroRedundancyOptimizer (rank {self.rank}) under Join needs the parameters of a "
                "fusedist.DistributedDataParallel model (the drop-in for torch's): a rank that ran out "
                "of inputs steps its shard with the gradients the other ranks average, which torch's "
                "DistributedDataParallel does not hand to it. Wrap the model in "
                "fusedist.DistributedDataParallel, or give every rank the same number of batches"
            )
        return ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.comm.device if self.comm is not None else self._device

    @property
    def join_process_group(self):
        return self.process_group

    def _join_before_step(self) -> None:
        """Called by step() while a join context is enabled."""
        if self._join_shadowing:
            return
        notify(self)
        if self.grad_scale is not None or self.step_context.inv_scale is not None:
            raise NotImplementedError(
                "ZeroRedundancyOptimizer under join (uneven inputs): a GradScaler is not supported yet "
                "(a joined rank cannot follow the loss scale); train without the scaler (bf16 or fp32) "
                "or give every rank the same number of batches"
            )
