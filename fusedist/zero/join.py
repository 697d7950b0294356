"""ZeroRedundancyOptimizer under uneven inputs: its side of ``model.join()`` / ``Join``.

A rank that ran out of data still takes part in every step of the ranks still training
(Note [joined ranks] in ``fusedist/ddp/join.py``): its optimizer steps its shard with the
averaged gradients -- the active ranks need its updated slice in the parameter all-gathers --
and takes part in their gradient-norm reductions. Kept with ZeRO because the hook drives the
optimizer's step, clip and version tracking; the DDP side of the protocol needs nothing from ZeRO.

Note [the announce]
    Whether and how the active ranks clip before a step is known only to them, and may change
    from step to step (a rank with no batch at all never saw a clip). So while a join context
    is enabled, an active rank precedes each gradient-norm all-reduce and its step with a small
    all-reduce (MAX) of ``[kind, max_norm, norm_type, error_if_nonfinite]`` and their negations
    (a joined rank sends -inf): the joined ranks loop on it, doing the announced norm
    all-reduce with their own shard (the averaged gradients) and recording the clip, until the
    announced step. Disagreeing active ranks (one clips, another steps) raise on every rank.
    In stage 1 the step reads ``p.grad``, which the active ranks may have changed in place (torch's
    ``clip_grad_norm_`` on ``model.parameters()``): with the step's announce come the active ranks
    (a one-hot row), and while some rank is joined the lowest active rank broadcasts its gradients.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms.join import JoinHook, Joinable

from ..ddp.join import DISABLED, notify

# What an active rank announces (Note [the announce])
STEP, CLIP, NORM, REFUSE = 0, 1, 2, 3
_CALLS = {STEP: "step()", CLIP: "clip_grad_norm_()", NORM: "a GradScaler's inf/nan check",
          REFUSE: "a GradScaler's step()"}


def _scaler_refusal() -> NotImplementedError:
    return NotImplementedError(
        "ZeroRedundancyOptimizer under join (uneven inputs): a GradScaler is not supported yet "
        "(a joined rank cannot follow the loss scale); train without the scaler (bf16 or fp32) "
        "or give every rank the same number of batches"
    )


def exchange(zero, values) -> tuple[list, list]:
    """The announce all-reduce (Note [the announce]): ``values`` from an active rank, None from a
    joined one; returns what the active ranks announced, and which ranks they are."""
    sent = torch.full((8 + zero.world_size,), float("-inf"), dtype=torch.float64)
    sent[8:] = 0
    if values is not None:
        sent[:8] = torch.tensor(values + [-v for v in values], dtype=torch.float64)
        sent[8 + zero.rank] = 1
    sent = sent.to(zero.comm.device)
    zero.comm.all_reduce(sent, op="max", tag="zero join: announce clip or step")
    high, low = sent[:4].tolist(), (-sent[4:8]).tolist()
    if high[0] != low[0]:
        raise RuntimeError(
            f"ZeroRedundancyOptimizer (rank {zero.rank}) under join: the ranks still training called different "
            f"methods at the same point: some {_CALLS[int(low[0])]}, others {_CALLS[int(high[0])]}. Every rank "
            "still training must clip (or not) the same way before each step")
    return high, [r for r, a in enumerate(sent[8:].tolist()) if a]


def share_grads(zero, active: list) -> None:
    """Stage 1, at a step while some rank is joined: the gradients the step reads, from the lowest
    active rank (Note [the announce]); a joined rank's own hold the plain average."""
    if zero.stage != 1 or len(active) == zero.world_size:
        return
    grads = [p.grad for p in zero._trainable_params() if p.grad is not None]
    zero.ddp._broadcast_coalesced(grads, tag="zero join: gradients", src=min(active))


class ZeroJoinHook(JoinHook):
    """A joined rank's ZeroRedundancyOptimizer takes part in the gradient-norm reductions the
    active ranks announce (Note [the announce]) and steps with its shard of the averaged
    gradients (the active ranks need its updated slice in the parameter all-gathers)."""

    def __init__(self, zero):
        self.zero = zero

    @torch.compiler.disable  # Note [join under torch.compile] in ddp/join.py
    def main_hook(self) -> None:
        zero = self.zero
        ddp = zero.ddp
        if ddp is not None and ddp._join_state is not None and not ddp._join_state.synced:
            return  # a no_sync() iteration elsewhere: no step follows it
        zero._join_shadowing = True
        try:
            while True:
                (kind, max_norm, norm_type, error_if_nonfinite), active = exchange(zero, None)
                if kind == STEP:
                    share_grads(zero, active)
                    break
                if kind == REFUSE:
                    raise _scaler_refusal()
                if kind == CLIP:
                    zero.clip_grad_norm_(max_norm, norm_type, bool(error_if_nonfinite))
                else:
                    zero._fusedist_check_and_norm(None)
            zero.step()
        finally:
            zero._join_shadowing = False

    @torch.compiler.disable  # Note [join under torch.compile] in ddp/join.py
    def post_hook(self, is_last_joiner: bool) -> None:
        zero = self.zero
        zero.wait_for_params()
        zero._record_param_versions()  # the final broadcast wrote identical values
        zero._join_config = DISABLED


class JoinableOptimizer(Joinable):
    """The Joinable side of ZeroRedundancyOptimizer (Note [joined ranks])."""

    _join_config = DISABLED  # set by a join context
    _join_shadowing = False  # a joined rank's step, run by the hook
    _join_clip = None  # (max_norm, norm_type, error_if_nonfinite) of the clip in progress

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

    def _join_announce(self, kind=None) -> list:
        """An active rank's announce before its step, or (``kind`` None) before a gradient-norm
        all-reduce (Note [the announce]); nothing outside a join context, or on a joined rank.
        Returns the active ranks (none outside a join context)."""
        if not self._join_config.enable or self._join_shadowing or self.comm is None or self.world_size == 1:
            return []
        if kind is None:
            kind = NORM if self._join_clip is None else CLIP
        max_norm, norm_type, error_if_nonfinite = self._join_clip if kind == CLIP else (0.0, 0.0, False)
        return exchange(self, [kind, float(max_norm), float(norm_type), float(error_if_nonfinite)])[1]

    def _join_before_step(self) -> None:
        """Called by step() while a join context is enabled."""
        if self._join_shadowing:
            return
        notify(self)
        # A scaler's step sets found_inf (also after an unscale_ in place, which leaves no inv_scale)
        refuse = self.grad_scale is not None or self.step_context.inv_scale is not None or self.found_inf is not None
        active = self._join_announce(REFUSE if refuse else STEP)
        if refuse:
            raise _scaler_refusal()
        if active:
            share_grads(self, active)
