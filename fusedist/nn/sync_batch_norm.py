"""``fusedist.nn.SyncBatchNorm``: BatchNorm over the global batch of all ranks.

A subclass of, and drop-in for, ``torch.nn.SyncBatchNorm`` (same constructor, buffers,
state_dict and ``convert_sync_batchnorm``; Note [a torch.nn.SyncBatchNorm]) that also runs on
CPU (gloo), reads channels_last inputs in place, and talks to the other ranks once per
forward and once per backward:

* forward: one all-gather of every rank's per-channel ``(count, mean, M2)``, merged with the
  parallel Welford formula, so per-rank batch sizes may differ (an empty batch included);
* backward: one all-reduce of the per-channel ``sum(dy)`` and ``sum(dy * x̂)`` together;
* eval mode: no communication at all (running statistics, or this rank's batch statistics
  when ``track_running_stats=False``, as torch does).

Without an initialized process group, with a group of one rank, or on a rank outside its
group (as torch's layer there; Note [a rank outside the layer's group]), it behaves exactly
like BatchNorm on the local batch (same kernels, no communication).
"""

from __future__ import annotations

import copy
import functools
import inspect
import os

import torch
import torch.autograd.forward_ad as _forward_ad
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.modules.batchnorm import _BatchNorm

from ..comm import Communicator, get_communicator
from ..ddp import join as _join
from ..reliability import attach_monitor
from . import _outside_group as outside_group
from . import _refusal as refusal
from ._convert import convert_tree
from ._dtype_rule import check_dtypes
from ._function import BatchStatsNorm, RunningStatsNorm
from ._sync_stats import IDENTITY_LEN, NO_BACKWARD, WANTS_INPUT_GRAD, check_channels_agree, gather_messages


# torch >= 2.13 can drop the additive bias of an affine BatchNorm (keyword-only ``bias``).
_BASE_TAKES_BIAS = "bias" in inspect.signature(torch.nn.SyncBatchNorm.__init__).parameters


def _rank_suffix() -> str:
    if dist.is_available() and dist.is_initialized():
        return f" on rank {dist.get_rank()}"
    return ""


# What dynamo reports where ``fullgraph=True`` or ``torch.export`` meets the graph break (Note
# [SyncBatchNorm under torch.compile]): without it, "Skip inlining `torch.compiler.disable()`d
# function ... Hint: Remove the `torch.compiler.disable` call", which names neither the cause nor
# a way out. (An older torch takes no reason.)
_GRAPH_BREAK_REASON = (
    "fusedist.nn.SyncBatchNorm: a training forward that synchronizes with other ranks runs eagerly "
    "(its collectives cannot be traced), so fullgraph=True and torch.export cannot capture it; "
    "capture the model in eval mode, or compile without fullgraph (a graph break around the layer)"
)
if "reason" in inspect.signature(torch.compiler.disable).parameters:
    _eager_under_compile = functools.partial(torch.compiler.disable, reason=_GRAPH_BREAK_REASON)
else:
    _eager_under_compile = torch.compiler.disable


def _torch_op_needed() -> bool:
    """Whether a forward that does not synchronize must be torch's ``F.batch_norm`` (Note
    [SyncBatchNorm under torch.func]): under a torch.func transform, or inside a forward-mode
    AD level (dual tensors: our Functions have no ``jvp``)."""
    return torch._C._are_functorch_transforms_active() or _forward_ad._current_level >= 0


# Note [SyncBatchNorm under torch.fx]
#     ``torch.fx.symbolic_trace`` keeps torch's own layers (torch.nn.SyncBatchNorm included)
#     as leaves, one ``call_module`` node each, and traces into every other module. Traced
#     into, this layer's input checks branch on the proxy ("symbolically traced variables
#     cannot be used as inputs to control flow"), so tracing a converted model failed where
#     torch's conversion traces -- and with it every fx tool: torchvision's
#     ``create_feature_extractor``, FX quantization, ``torch.fx.experimental.optimization``.
#     Inside a traced model the layer records itself as a leaf, as the tracer records
#     torch's: the graph calls the module, which still synchronizes when it runs. Traced as
#     the root (no call to record) it behaves as torch.nn.SyncBatchNorm does there.
def _as_fx_leaf(module: torch.nn.Module, input: torch.fx.Proxy):
    """The ``call_module`` node of ``module`` called on ``input`` under ``torch.fx`` symbolic
    tracing, or None where there is no module path to call (``module`` is the traced root)."""
    tracer = input.tracer
    path_of_module = getattr(tracer, "path_of_module", None)
    if path_of_module is None:
        return None
    try:
        path = path_of_module(module)
    except NameError:  # not a submodule of the traced root
        return None
    if not path:
        return None
    return tracer.create_proxy("call_module", path, (input,), {})


# Note [inputs without data]
#     A meta-device input (shape inference, a model built on ``device="meta"``) or a fake tensor
#     (torch's FakeTensorMode: memory and runtime estimators such as torch.distributed's
#     FSDPMemTracker) has shapes and dtypes but no values. torch's BatchNorm computes its output's
#     metadata there; our kernels and the statistics exchange need values (the forward failed
#     with "Cannot copy out of meta tensor" / "Attempted to set the storage of a tensor on device
#     meta"). Such an input takes torch's op on this rank's batch, in every mode: there is
#     nothing to exchange, and the result's shape, dtype and memory format are the global
#     batch's all the same. (Not under torch.compile, whose own fake tensors are the compiled
#     forward's business: Note [SyncBatchNorm under torch.compile].) It exchanges nothing, in
#     synchronized training too: shape inference or a memory estimate on one rank alone must not
#     wait for the others, and that rank cannot tell whether they are in a real forward meanwhile
#     (where they wait in the statistics gather, named by the stall monitor at the timeout).
def _holds_no_data(input: torch.Tensor) -> bool:
    return isinstance(input, FakeTensor) or (isinstance(input, torch.Tensor) and input.device.type == "meta")


# Note [a rank outside the layer's group]: in _outside_group.py.


# Note [checks that a pickle does not carry]
#     A layer runs the channel agreement check (and attaches the stall monitor) once per
#     communicator, and remembers which. Communicator uids count from 0 in every process, so a
#     layer saved whole (``torch.save(model)``, a checkpoint holding the model object) and loaded
#     in a new job named the new job's first communicator as already checked: ranks whose
#     models disagree on the width then met in a statistics gather of different sizes, which
#     hangs past the collective timeout instead of raising. The entries carry a token of the
#     process that made them; ``copy.deepcopy`` in the same process (an EMA copy) keeps them.
_PROCESS_TOKEN = int.from_bytes(os.urandom(8), "little")


# Note [a torch.nn.SyncBatchNorm]
#     The layer is a subclass of torch.nn.SyncBatchNorm (and so of BatchNorm's ``_BatchNorm``)
#     with torch's constructor, buffers, state_dict keys and ``process_group`` attribute: code
#     that recognizes the layer by ``isinstance`` -- Lightning's ``TorchSyncBatchNorm.revert``,
#     weight-decay exclusion lists naming ``nn.SyncBatchNorm`` (detectron2, YOLO recipes),
#     torch DDP's logging -- treats it as torch's, where it skipped it silently (its
#     parameters decayed, the layer never reverted). The one place torch refuses its own
#     layer refuses this one too: torch's DistributedDataParallel on CPU modules ("SyncBatchNorm
#     layers only work with GPU modules"); fusedist.DistributedDataParallel runs it on CPU.
#     Only the constructor, the input checks, ``forward`` and ``convert_sync_batchnorm`` are
#     ours; a compiled non-synchronizing forward is ``_BatchNorm.forward`` (torch's
#     SyncBatchNorm.forward refuses CPU inputs in training once a process group is initialized).
class SyncBatchNorm(torch.nn.SyncBatchNorm):
    """Batch normalization with statistics over all ranks of ``process_group``.

    Args mirror ``torch.nn.SyncBatchNorm``: ``num_features`` (C of an ``(N, C, ...)``
    input), ``eps``, ``momentum`` (None: cumulative average), ``affine``,
    ``track_running_stats``, ``process_group`` (None: the default group), ``device``,
    ``dtype`` and, where torch has it (>= 2.13), the keyword-only ``bias``.

    Inputs may be 2-D to 5-D (any ``(N, C, *)``), fp32/fp16/bf16 (statistics in fp32) or
    fp64 (statistics in fp64, pure-PyTorch path), contiguous or channels_last. Every rank
    must call the layer in the same order; the first synchronized call of each layer
    checks that all ranks agree on ``num_features``.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_group=None,
                 device=None, dtype=None, *, bias: bool = True):
        extra = {}
        if not bias:
            if not _BASE_TAKES_BIAS:
                raise ValueError(
                    f"SyncBatchNorm(bias=False) needs torch >= 2.13 (this is {torch.__version__}); "
                    "use affine=False, or keep the bias"
                )
            extra["bias"] = False
        super().__init__(num_features, eps, momentum, affine, track_running_stats, process_group,
                         device=device, dtype=dtype, **extra)
        # Communicators this layer has run the channel agreement check on (Note [checks that
        # a pickle does not carry]).
        self._channels_checked: set[tuple[int, int]] = set()
        outside_group.remember(self)  # Note [a rank outside the layer's group]
        self._watch_group()

    # Note [the stall monitor from construction]
    #     The monitor of the layer's communicator was attached at the first training forward. A rank
    #     that went another way before it -- its model in eval() where the others train, a branch that
    #     skipped the layer -- and waits in a collective of the same communicator had none: it
    #     published nothing, so the others, waiting in the statistics gather, could not tell it from a
    #     slow rank and waited out the collective timeout (Note [divergence probe] in
    #     fusedist/reliability/divergence.py). A layer on CPU over a gloo group now attaches it when it
    #     is built (converted layers too): making the communicator issues no collective. Not on other
    #     devices or backends (there the first training forward attaches it, as before): making a CUDA
    #     communicator is a collective of every rank of the group (an all_gather_object: Note [one decision
    #     on every rank] in fusedist/comm/__init__.py), which a constructor must not issue -- a layer built on
    #     some ranks only (an evaluation copy on rank 0) would pair it with the others' next collective, where
    #     torch's layer issues nothing -- and a layer is mostly built before its model moves to the device it
    #     runs on, which the communicator is bound to. Nothing here asks CUDA anything.
    def _watch_group(self) -> None:
        try:
            if not self._synchronizes() or "gloo" not in str(dist.get_backend(self.process_group)):
                return
            held = next(iter(self.parameters()), None)
            held = held if held is not None else next(iter(self.buffers()), None)
            if held is None or held.device.type == "cpu":
                attach_monitor(get_communicator(self.process_group, "cpu"))
        except Exception:  # noqa: BLE001 - a layer is never refused for its monitor: the forward attaches it
            pass

    # Note [copies share the process group]
    #     ``copy.deepcopy`` of a model -- an EMA or SWA copy (torch.optim.swa_utils.AveragedModel,
    #     timm's and YOLO's ModelEMA, torchvision's reference scripts) -- copied every attribute,
    #     the ``process_group`` too, and a ProcessGroup cannot be copied: a model converted with
    #     a subgroup (per-node groups from new_subgroups) failed with "cannot pickle
    #     'ProcessGroup' object", as torch.nn.SyncBatchNorm does. A group is a handle on the
    #     ranks' shared communicator, not state of the layer: the copy shares it, and
    #     synchronizes over the same ranks (fusedist's DDP copies share their group alike).
    #     Everything else is copied as before. (Pickling to a file still refuses a group: it
    #     means nothing in another process.)
    def __deepcopy__(self, memo):
        group = self.__dict__.get("process_group")
        if group is not None:
            memo.setdefault(id(group), group)
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        outside_group.remember(copied, outside_group.path_of(self))
        return copied

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm: expected at least 2D input (N, C, ...), got {input.dim()}D input "
                f"of shape {tuple(input.shape)}{_rank_suffix()}"
            )
        if not input.is_floating_point():
            # BatchNorm has no integer/bool/complex form; the kernels would cast the
            # normalized values back to the input dtype and return garbage silently.
            raise TypeError(
                f"SyncBatchNorm: expected a floating-point input, got {input.dtype} of shape "
                f"{tuple(input.shape)}{_rank_suffix()}; convert it (e.g. input.float()) first"
            )
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm(num_features={self.num_features}): expected {self.num_features} "
                f"channels in dim 1, got {input.shape[1]} (input shape {tuple(input.shape)})"
                f"{_rank_suffix()}"
            )
        if input.shape[1] == 0:  # as torch.nn.SyncBatchNorm refuses it (no channel to normalize)
            raise ValueError(
                f"SyncBatchNorm: the number of input channels must be non-zero (input shape "
                f"{tuple(input.shape)}){_rank_suffix()}"
            )
        check_dtypes(self, input, _rank_suffix())  # Note [input and parameter dtypes]
        if self.weight is not None and self.weight.device != input.device:
            raise ValueError(
                f"SyncBatchNorm: input is on {input.device} but the layer's parameters are on "
                f"{self.weight.device}{_rank_suffix()}; move the module or the input"
            )

    def _synchronizes(self) -> bool:
        """Whether a training forward talks to other ranks: a process group of more than one
        rank that includes this one (Note [a rank outside the layer's group])."""
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1

    def _communicator(self, device: torch.device) -> Communicator | None:
        """The communicator to synchronize over, or None when there is nobody to talk to."""
        if not self._synchronizes():
            if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) < 0:
                outside_group.warn_once(self)
            return None
        comm = get_communicator(self.process_group, device)
        key = (_PROCESS_TOKEN, comm.uid)  # Note [checks that a pickle does not carry]
        if key not in self._channels_checked:
            attach_monitor(comm)  # [reliability] a missing rank is named in a stall report
            check_channels_agree(comm, self.num_features, device, outside_group.path_of(self))
            self._channels_checked.add(key)
        return comm

    # Note [SyncBatchNorm under torch.compile]
    #     The layer runs eagerly inside a compiled model (``torch.compile(model)`` in a DDP
    #     wrapper, or of the wrapper): a graph break around it, its neighbours still compiled.
    #     In training it talks to the other ranks through fusedist's communicator
    #     (process-group objects, the gloo exchange's send/recv, the reliability monitor),
    #     none of which dynamo can trace -- the first training forward failed on every rank.
    #     Both modes launch fusedist's own kernels (Triton, C++ or the reference, chosen at
    #     run time), which dynamo would have to trace through their launchers: eval under the
    #     Triton interpreter failed in dynamo's fake-tensor pass. Where the layer does not
    #     synchronize (eval, or training without other ranks) a compiled forward is torch's
    #     ``_BatchNorm.forward`` instead, as torch.nn.SyncBatchNorm is there: inside the graph,
    #     so ``fullgraph=True`` and ``torch.export`` of a model holding the layer work (they
    #     failed on the graph break, even in eval), at the compiled op's rounding (an ulp or
    #     so from the eager kernel's).
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if isinstance(input, torch.fx.Proxy):  # Note [SyncBatchNorm under torch.fx]
            traced = _as_fx_leaf(self, input)
            if traced is not None:
                return traced
        compiling = torch.compiler.is_compiling()
        if not compiling and _holds_no_data(input):  # Note [inputs without data]
            self._check_input_dim(input)
            return _BatchNorm.forward(self, input)
        tracing = torch.jit.is_tracing()  # Note [SyncBatchNorm under torch.jit.trace]
        if (compiling or tracing) and not (self.training and self._synchronizes()):
            self._check_input_dim(input)
            return _BatchNorm.forward(self, input)  # Note [a torch.nn.SyncBatchNorm]
        if tracing:  # refused here alone: Note [a traced forward refuses on its own rank]
            raise RuntimeError(
                f"SyncBatchNorm({self.num_features}): torch.jit.trace cannot record a synchronized training "
                f"forward (its statistics come from a collective with the other ranks of its group){_rank_suffix()}; "
                "trace the model in eval mode (model.eval()), where the layer is torch's batch_norm"
            )
        return self._eager_forward(input)

    # Note [SyncBatchNorm under torch.jit.trace]
    #     ``torch.jit.trace`` (TorchScript deployment, and the TorchScript-based ONNX export) of a
    #     model holding the layer failed, in eval too: the tracer hands the kernel launchers
    #     tensors where they compute sizes (Triton: "'Tensor' object has no attribute
    #     'bit_length'"), and cannot record our autograd Functions' arguments (the reference
    #     path: "Found an unsupported argument type in the JIT tracer"). torch.nn.SyncBatchNorm
    #     traces there: it is ``F.batch_norm`` wherever it does not synchronize. Under the tracer
    #     this layer is torch's op in the same places (as under torch.compile, Note [SyncBatchNorm
    #     under torch.compile]); a synchronized training forward, whose collectives a trace could
    #     not replay, is refused by name before anything is counted.

    # Note [a traced forward refuses on its own rank]
    #     Unlike the input checks' refusals and a torch.func transform's (Note [a refusal on one rank
    #     reaches every rank] in _refusal.py), the tracer's refusal does not join the group's
    #     statistics gather. Tracing is export, which a job runs on one rank alone (``if rank == 0:
    #     torch.jit.trace(model, x)``, then a barrier): a marker there would wait for group-mates
    #     that never come, turning the immediate "trace in eval mode" error into a wait until the
    #     collective timeout, or meet their next training forward and fail it. Ranks that all trace
    #     are all refused at once without it.

    @_eager_under_compile  # Note [SyncBatchNorm under torch.compile]
    def _eager_forward(self, input: torch.Tensor) -> torch.Tensor:
        try:
            self._check_input_dim(input)
        except Exception as exc:
            self._share_refusal(input, exc)  # Note [a refusal on one rank reaches every rank]
            raise
        if self.training and torch._C._are_functorch_transforms_active():
            self._refuse_synchronized_transform(input)
        if not self.training and self.running_mean is not None and self.running_var is not None:
            if _torch_op_needed():  # Note [SyncBatchNorm under torch.func]
                return self._torch_batch_norm(input, 0.0)
            return RunningStatsNorm.apply(input, self.weight, self.bias, self.running_mean,
                                          self.running_var, self.eps)
        average_factor = 0.0 if self.momentum is None else self.momentum
        counted = self.training and self.track_running_stats and self.num_batches_tracked is not None
        if counted:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                average_factor = 1.0 / float(self.num_batches_tracked)
        committed: list = []  # Note [a raised forward changes nothing]
        try:
            return self._batch_stats_forward(input, average_factor, committed)
        except BaseException:
            if counted and not committed:
                self.num_batches_tracked.sub_(1)
            raise

    # Note [a raised forward changes nothing]
    #     A training forward that raises before the running statistics took the batch counts no
    #     batch, whatever it raised: a refusal the ranks share (channels, a batch of one value,
    #     layers mixed up), a collective that failed, a kernel out of memory, a warning turned
    #     into an error (``warnings.simplefilter("error")`` and the outside-group warning, which
    #     is raised after the count was taken). The count is part of the layer's identity (Note
    #     [the same layer on every rank] in _sync_stats.py): a count left behind by a raised
    #     forward on some ranks only would refuse every later forward. The forward marks the
    #     moment the running statistics take the batch (``committed``); from there the count
    #     stays with them, whatever is raised later (the output's kernel failing, activation
    #     checkpointing stopping a recomputation early), as torch's BatchNorm keeps both. (torch's
    #     BatchNorm counts before ``F.batch_norm`` and keeps the count when that refuses the
    #     batch, e.g. one value per channel: there this layer differs, on purpose.)

    def _share_refusal(self, input, exc: Exception, reason: tuple | None = None) -> None:
        """Where this forward would synchronize, join the other ranks' statistics gather with a
        refusal marker, so they raise too (Note [a refusal on one rank reaches every rank] in
        _refusal.py); ``exc`` (this rank's refusal) is raised by the caller all the same.
        ``reason``: what the others are told (default: the input check ``input`` fails)."""
        if not (self.training and self._synchronizes()):
            return
        try:
            reason = refusal.reason_of(self, input) if reason is None else reason
            device = refusal.layer_device(self, input)
            # Plain tensors, under a torch.func transform too: it wraps the tensors made here, and a
            # wrapped message did not reach the others as a refusal.
            with torch._C._DisableFuncTorch():
                comm = self._communicator(device)
                length = 2 * self.num_features + 1 + IDENTITY_LEN  # the others' message
                gather_messages(refusal.refusal_message(reason, length, device), comm)
        except Exception as failed:  # noqa: BLE001 - this rank's own refusal is the error to raise
            exc.add_note(f"(telling the other ranks of the layer's group failed too: {failed!r})")

    # Note [SyncBatchNorm under torch.func]
    #     torch.nn.SyncBatchNorm is ``F.batch_norm`` wherever it does not synchronize (eval, or
    #     training without other ranks), so torch.func's transforms (grad, vmap, jvp, jacrev;
    #     functional_call with the buffers passed in) work there. Our autograd Functions have
    #     no functorch rules (their kernels could not be vmapped): the same calls failed with
    #     "must override the setup_context staticmethod". Under a transform those forwards are
    #     torch's op, as in torch's layer; synchronized training is refused by name, before
    #     anything is counted (torch's layer has no functorch rule there either), and on every rank
    #     of the group where only some run the transform (Note [a refusal on one rank reaches every
    #     rank] in _refusal.py): the others waited in the statistics gather until the timeout.
    #     Forward-mode AD (``torch.autograd.forward_ad``'s dual tensors) is no functorch
    #     transform, and our Functions have no ``jvp``: inside a dual level those forwards failed
    #     with "You must implement the jvp function", where torch's layer gives the tangent. They
    #     are torch's op there too.
    def _refuse_synchronized_transform(self, input) -> None:
        """Raise, before anything is counted, when a torch.func transform runs a training forward
        that synchronizes (Note [SyncBatchNorm under torch.func]): the Function's error ("must
        override the setup_context staticmethod") names neither the layer nor a way out, and
        ``vmap`` had already counted the batch. The other ranks are told through the statistics
        gather (Note [a refusal on one rank reaches every rank]), where they would wait otherwise."""
        if not self._synchronizes():  # (a rank outside the group too: Note [a rank outside the layer's group])
            return
        size = dist.get_world_size(self.process_group)
        refused = RuntimeError(
            f"SyncBatchNorm({self.num_features}): torch.func transforms (vmap, grad, jvp, jacrev, ...) "
            f"cannot run a synchronized training forward (a process group of {size} ranks){_rank_suffix()}: "
            "its statistics come from a collective, which has no functorch rule (nor has "
            "torch.nn.SyncBatchNorm's). Run the transform in eval mode, or with a process_group of "
            "this rank alone, or call the layer outside the transform"
        )
        self._share_refusal(input, refused, (refusal.TRANSFORM, 0.0, 0.0))
        raise refused

    def _torch_batch_norm(self, input: torch.Tensor, average_factor: float) -> torch.Tensor:
        use_running = not self.training or self.track_running_stats
        return torch.nn.functional.batch_norm(
            input, self.running_mean if use_running else None, self.running_var if use_running else None,
            self.weight, self.bias, self.training or self.running_mean is None, average_factor, self.eps)

    def _batch_stats_forward(self, input: torch.Tensor, average_factor: float, committed: list) -> torch.Tensor:
        # Batch statistics. Only training synchronizes: eval with track_running_stats=False
        # normalizes each rank's batch on its own, like torch.nn.SyncBatchNorm.
        update_running = self.training and self.track_running_stats
        comm = self._communicator(input.device) if self.training else None
        if comm is None and _torch_op_needed():  # Note [SyncBatchNorm under torch.func]
            output = self._torch_batch_norm(input, average_factor)
            committed.append(True)
            return output
        if comm is not None and _join._sync_bn_trace is not None:
            _join.record_sync_bn(self, input)  # replayed by ranks that ran out of inputs
        return BatchStatsNorm.apply(
            input, self.weight, self.bias,
            self.running_mean if update_running else None,
            self.running_var if update_running else None,
            self.eps, average_factor, comm,
            self.num_batches_tracked if update_running else None,
            self._backward_plan(input) if comm is not None else 0.0, committed,
        )

    def _backward_plan(self, input: torch.Tensor) -> float:
        """What this rank's backward will do, sent to the others with the statistics (Note [one
        backward decision for all ranks] in _sync_stats.py)."""
        if not torch.is_grad_enabled():
            return NO_BACKWARD
        if input.requires_grad:
            return WANTS_INPUT_GRAD
        trained = any(p is not None and p.requires_grad for p in (self.weight, self.bias))
        return 0.0 if trained else NO_BACKWARD

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_group=None) -> torch.nn.Module:
        """Replace every BatchNorm*D (and SyncBatchNorm, torch's or ours) in ``module`` with
        ``fusedist.nn.SyncBatchNorm``, keeping the very same parameter and buffer tensors (so
        an optimizer built on them stays valid) and the training flag. Returns the new root
        (the module itself unless it is a BatchNorm). A BatchNorm subclass whose own behaviour
        the plain layer drops is converted all the same, as torch converts it, with a warning
        naming it (Note [converting BatchNorm subclasses]). A BatchNorm the model holds under
        several names (applied twice, shared by branches) becomes one SyncBatchNorm under all of
        them (Note [a layer held under several names] in _convert.py)."""
        return convert_tree(cls, module, process_group)
