"""``fusedist.ZeroRedundancyOptimizer``: ZeRO stage 1 and 2 on flat, evenly sharded buffers.

This module is the class itself: construction, ``step()`` and the public methods. Its
concerns live in their own modules, as mixins where they are a few methods over the core state
(the partition, gradient shards, masters, pieces and inner optimizer) and as helper objects
where they keep state of their own:

* ``factory.py`` -- the optimizer class behind ``optimizer_class`` (a class, a partial, a lambda);
* ``param_checks.py`` -- parameter lists refused before anything is built (a parameter given
  twice, lists that differ between ranks); ``hyper_checks.py`` -- hyperparameters that differ
  between ranks;
* ``wiring.py`` -- finding the DDP model and communicator, installing stage 2;
* ``shards.py`` (mixin) -- building the shards, masters kept in step with the parameters;
* ``grads.py`` (mixin) -- which gradients the rank has, stage-1 collection;
* ``pieces.py`` (mixin) -- splitting the inner optimizer's pieces around skipped parameters;
* ``scaling.py`` (mixin) -- the GradScaler protocol, clipping and the inner step;
* ``gather.py`` (:class:`ParamGatherer`) -- parameter all-gathers and the hooks that wait;
* ``sharded_state.py`` (:class:`ShardedState`) -- state dicts: shard, consolidate, load;
* ``empty_params.py`` (:class:`EmptyParams`) -- the state of parameters with no elements, which
  no shard holds;
* ``step_refusals.py`` -- what ``step()`` refuses before anything runs (its step hooks included);
  ``step_flag.py`` -- what a step that applied nothing tells an LR scheduler; ``eager.py`` -- why
  the step and the clip run eagerly under ``torch.compile``; ``gradless_step.py`` -- a step in
  which no parameter has a gradient;
* ``grow.py`` -- parameters joining after construction (``trainable_check.py``: the ranks compare
  them first); ``grad_sync.py`` -- the stage-2 reduce-scatter; ``offload.py`` -- ZeRO-Offload;
  ``join.py`` -- uneven inputs (its join hook); ``grad_agreement.py`` -- gradients compared across
  ranks at the first step without a DDP model.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.optim import Optimizer

from .._rank import this_rank
from ..optim.elementwise import check_elementwise
from . import copies, deferred_stage2, grad_agreement, grad_sync, group_sync, grow, param_checks, param_labels
from . import gradless_step, step_flag, step_refusals, torch_partition, wiring
from .empty_params import EmptyParams
from .eager import eager_step
from .factory import default_optimizer_class, optimizer_type
from .gather import ParamGatherer
from .grads import GradientsMixin
from .join import JoinableOptimizer
from .shard_store import ShardStore
from .shared_state import MutableState, share_with_wrappers
from .offload import HostShardOffload, check_offload_isa
from .partition import FlatParams, FlatPartition
from .pieces import PieceSplittingMixin
from .scaling import ZeroScalerProtocol
from .sharded_state import ShardedState
from ..comm.held_group import HeldProcessGroup
from .shards import ShardsMixin

MiB = 1024 * 1024


class ZeroRedundancyOptimizer(ZeroScalerProtocol, GradientsMixin, PieceSplittingMixin, ShardsMixin, HeldProcessGroup,
                              Optimizer, JoinableOptimizer):
    """Shards FP32 master weights and optimizer state (stage 1), and gradients (stage 2),
    evenly over the data-parallel ranks.

    Drop-in for ``torch.distributed.optim.ZeroRedundancyOptimizer(params, optimizer_class,
    **defaults)``. Unlike torch's (whole parameters assigned greedily, then broadcast), every
    rank owns an equal contiguous slice of each bucket of the flat parameter space (Note [flat
    partition] in ``partition.py``): balanced to within padding, and synchronized with
    reduce-scatter / all-gather, the data-parallel volume.

    * With parameters of a :class:`fusedist.DistributedDataParallel` model the optimizer finds
      the wrapper itself (``fusedist.ownership``) and shards along its gradient buckets. Stage 1:
      DDP all-reduces, each rank updates its slice, the updated slices are all-gathered per
      bucket. Stage 2: DDP reduce-scatters each bucket as it becomes ready (Note [stage 2
      gradients] in ``grad_sync.py``); ``no_sync()`` works. Without DDP (stage 1 only) the
      gradients must already be synchronized (e.g. torch DDP, or a single process) -- the first step
      checks that they are, and refuses ones that differ across ranks (Note [gradients nobody averaged] in
      grad_agreement.py), and every later step compares their norms on a parameter all-gather, raising at
      its end (Note [gradients compared at every step] in carried_agreement.py) --; so are a DDP model's in
      stage 1 with a *subset* of its parameters (Note [a subset of a DDP model's parameters] in wiring.py).
    * The shards are built at construction (DDP's bucket layout is fixed from then on, Note
      [layout fixed by a sharded consumer] in ``fusedist/ddp/rebucket.py``); the first ``step()``
      (or a load) creates the optimizer state and re-points every parameter's storage into one
      flat buffer per dtype so the all-gather writes straight into the parameters. The inner
      ``optimizer_class`` steps FP32 views of the rank's flat shard, one per run of a param
      group, so any elementwise optimizer works (Note [elementwise optimizers only] in
      ``fusedist/optim/elementwise.py``: LAMB and LBFGS are refused) and per-group hyperparameters (and LR
      schedulers changing ``param_groups``) are honoured.
    * Parameter all-gathers are issued per bucket at the end of ``step()``, and by default
      ``step()`` returns once they have landed: the parameters are final, as with torch's,
      DeepSpeed's and Megatron's sharded optimizers, so code that reads them right after the
      step (an EMA or ``torch.optim.swa_utils.AveragedModel`` update, logging) sees the new
      values. ``overlap_param_gather=True`` (with DDP) returns without waiting: each bucket is
      waited for by a forward pre-hook of the modules owning its parameters, so the gather
      overlaps ``zero_grad``, data loading and the forward of earlier layers. The model's
      ``state_dict()`` / ``load_state_dict()``, this optimizer's ``state_dict()``, checkpoint
      saving and the next ``step()`` wait too, but any other read of the parameters before the
      next forward must call :meth:`wait_for_params` first -- it would otherwise see a mix of
      old and new values (Note [overlapped parameter gathers] in ``gather.py``).
    * What ``p.grad`` holds: stage 1 -- the full averaged gradient, as with DDP alone. Stage 2
      -- None after every synchronized backward (only the shard is kept; read it with
      :meth:`gradient_shards`). Stage-2 gradients accumulate over synchronized backward passes
      until ``step()``, which consumes them (so either ``optimizer.zero_grad()`` or
      ``model.zero_grad()`` works in the loop). Clip with :meth:`clip_grad_norm_` (any stage), which combines
      the shards' norms with one small all-reduce; ``torch.nn.utils.clip_grad_norm_``, called
      through the module, hands stage 2's parameters to it (Note [torch's clip on sharded
      gradients] in fusedist/optim/torch_clip.py).
    * GradScaler: ``fusedist.amp.GradScaler`` (Note [scaler protocol]): the found-inf flag and
      the gradient norm are combined across shards in one all-reduce of two numbers, and a
      fused inner optimizer skips an overflowing step on the device. A non-fused inner
      optimizer reads the flag on the host (as torch's GradScaler does for it).
    * ``offload="cpu"`` (ZeRO-Offload, Note [offload pipeline] in ``offload.py``): the master
      shard and the Adam state live in host memory (pinned with CUDA) and the C++ CPU Adam
      steps them bucket by bucket; gradient slices go down as their buckets are reduced
      (stage 2: during backward, as soon as each bucket's reduce-scatter has completed),
      updated parameter slices go up and are all-gathered as usual. Only
      ``FusedAdam``/``FusedAdamW`` and ``torch.optim.Adam``/``AdamW`` (same math) are supported,
      for float32, bfloat16, float16 and complex64 parameters (complex64 as its real pairs, as
      torch's Adam steps it). ``step()`` reads the GradScaler's found-inf flag on the host (the
      CPU update needs it there); state dicts and checkpoints are the same as without offload.
    * Parameters without a gradient behave as with torch's optimizers. Frozen parameters
      (``requires_grad=False`` when the optimizer is constructed) stay in ``param_groups``, so
      state dicts keep torch's indices, but are never sharded, stepped or given state; one that has a gradient at
      ``step()`` raises, naming it. A model frozen whole is taken, as torch's optimizers take it:
      its steps change nothing until parameters are unfrozen, which then join (Note [growing
      the partition] in ``grow.py``). A trainable parameter without a gradient in a step
      (stage 1: ``p.grad`` is None; stage 2: no synchronized backward since the last step gave
      it one, i.e. DDP found it unused on every rank) is skipped: its master, optimizer state
      and step count stay as they are (Note [piece splitting] in ``partition.py``). A step in
      which no parameter has a gradient still steps the inner optimizer, as torch's does (Note
      [a step without gradients] in ``gradless_step.py``).
    * Master weights are FP32 (FP64 for FP64 parameters): copies for half-precision
      parameters, the parameters' own storage for fp32/fp64 ones (Note [shards aliasing the
      parameters and gradients] in ``shard_store.py``). Parameters changed outside
      the optimizer between steps (``model.load_state_dict``, in-place ops under
      ``no_grad``) are taken into the masters by the next ``step()``, as torch's optimizers
      would use them (Note [parameters changed outside the optimizer] in ``shards.py``), and so
      are parameters whose storage was replaced (``p.set_(t)``, a parametrization's setter,
      ``p.data = t``: Note [parameters moved off the flat buffer]); after writing in place
      through ``p.data``, call :meth:`sync_master_from_params`.

    Args:
        params: parameters or param groups (of one fusedist DDP model, a subset in stage 1 -- in stage 2
            one that ``add_param_group`` completes before the first step --, or none).
        optimizer_class: the per-shard optimizer class, or a factory of one (a ``functools.partial``,
            a lambda; default ``fusedist.optim.FusedAdamW``); the ``optimizer_class`` attribute is
            the class (for a factory, the class of what it builds).
        stage: 1 (shard master weights and optimizer state) or 2 (also gradients; needs DDP).
        process_group: the data-parallel group when there is no DDP wrapper (with DDP its
            group is used).
        bucket_cap_mb: bucket size of the layout built without DDP.
        overlap_param_gather: return from ``step()`` before the parameter all-gathers have
            landed and wait for them in the next forward's pre-hooks (needs DDP); default False,
            every gather completes inside ``step()``.
        offload: None (everything on the parameters' device) or ``"cpu"`` (master weights and
            optimizer state on the host, stepped there; Adam/AdamW only).
        max_buckets_in_flight: stage 2: gradient buckets whose reduce-scatter may be in flight
            at once (default 2). Each holds its full gradients until it lands, so a backward
            holds at most this many buckets plus the one filling (Note [buckets in flight] in
            ``fusedist/ddp/in_flight.py``); more buys overlap on uneven networks, None lifts it.
        **defaults: hyperparameters for ``optimizer_class``.
    """


    def __init__(self, params, optimizer_class=None, process_group=None, *, stage: int = 1,
                 bucket_cap_mb: float = 25.0, overlap_param_gather: bool = False,
                 offload: Optional[str] = None,
                 max_buckets_in_flight: Optional[int] = grad_sync.DEFAULT_MAX_BUCKETS_IN_FLIGHT, **defaults):
        self._zero_mutable = MutableState(self)  # Note [state shared with wrappers] in shared_state.py
        overlap_with_ddp = defaults.pop("overlap_with_ddp", False)
        defaults.pop("parameters_as_bucket_view", None)  # always true here
        self.offload = "cpu" if offload == "cpu" else None
        # What constructs the inner optimizer (and the probes of it), and the class behind it:
        # optimizer_class may be a functools.partial (Hydra's `_partial_: true` configs make them).
        self._optimizer_factory = optimizer_class
        self.optimizer_class = None
        try:  # Note [refusals of one rank's own arguments] in param_checks.py: raised after the comparison
            param_checks.check_arguments(stage, offload, max_buckets_in_flight, overlap_with_ddp)
            # (the default class may be missing on one host only: refused after the comparison too)
            self._optimizer_factory = optimizer_class or default_optimizer_class()
            self.optimizer_class = optimizer_type(self._optimizer_factory, defaults)
            # Note [elementwise optimizers only] (fusedist/optim/elementwise.py)
            check_elementwise(self.optimizer_class, "ZeroRedundancyOptimizer", "flat slices of each rank's shard")
            refusal = None
        except (ValueError, TypeError) as exc:
            refusal = exc
        self.stage = stage
        # Stage 2 keeps no p.grad, which torch.amp.GradScaler unscales and checks: with this
        # flag torch's scaler hands itself to step() (its custom-optimizer protocol) instead of
        # failing with "No inf checks were recorded", and step() says what to use instead.
        self._step_supports_amp_scaling = stage == 2
        self._inner_defaults = dict(defaults)
        try:
            super().__init__(param_checks.check_param_groups_given(params), defaults)
        except (ValueError, TypeError) as exc:  # Note [torch's refusals before the communicator is known]
            param_checks.refuse_with_every_rank(self, exc, process_group, int(bucket_cap_mb * MiB))
        # Every parameter, in torch's order (state dicts index into it); frozen ones
        # (requires_grad=False now) are kept there but never sharded, stepped or given state.
        self._params: list[torch.nn.Parameter] = [p for g in self.param_groups for p in g["params"]]
        self._group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        self._trainable = [i for i, p in enumerate(self._params) if p.requires_grad]
        self._frozen = [i for i, p in enumerate(self._params) if not p.requires_grad]
        self._may_grow = bool(self._frozen)  # Note [parameters unfrozen on some ranks only] in trainable_check.py
        self._device = self._params[self._trainable[0] if self._trainable else 0].device
        # Note [refusals of one rank's own arguments] in param_checks.py: raised after the comparison
        refusal = refusal or param_checks.own_refusal(self)
        self._offload: Optional[HostShardOffload] = None
        self.ddp, self.comm, self.process_group, subset_refusal, subset_of = wiring.connect(
            self._trainable_params(), self._params, process_group, self._device)
        # Note [stage 2 completed by add_param_group] in deferred_stage2.py
        self._stage2_pending = None if stage != 2 or subset_of is None else deferred_stage2.record_pending(
            subset_of, self._params, max_buckets_in_flight, overlap_param_gather)
        # a subset of a DDP model's parameters: the model averages their gradients (Note [gradients nobody averaged])
        self._averaged_by_model = subset_of is not None
        self.rank = self.comm.rank if self.comm is not None else 0
        self.world_size = self.comm.world_size if self.comm is not None else 1
        self.bucket_cap_bytes = int(bucket_cap_mb * MiB)
        # Note [stage-2 refusals compared across ranks] in wiring.py
        stage2_refusal = wiring.stage2_refusal(self) if stage == 2 and self._stage2_pending is None else None
        param_checks.check_same_params_on_every_rank(  # Note [the same parameters on every rank]
            self, refusal=refusal or subset_refusal or stage2_refusal)
        if self.offload:
            check_offload_isa(self)
        self.overlap_param_gather = overlap_param_gather and self.ddp is not None
        self._gatherer = ParamGatherer(self.comm, self.world_size, self.overlap_param_gather)
        self._grads_present = False
        self._partition: FlatPartition = self._build_partition()
        if self.ddp is not None:  # Note [growing the partition]: parameters DDP appends join at once
            wiring.listen_to_layout(self)
        if stage == 2 and self._stage2_pending is None:
            wiring.install_stage2(self, max_buckets_in_flight)
        self._flat_params: Optional[FlatParams] = None
        self._masters: Optional[ShardStore] = None  # Note [shards aliasing the parameters and gradients]
        self._pieces: list[torch.Tensor] = []
        self.inner: Optional[Optimizer] = None
        self._sharded_state = ShardedState(self)  # state dicts and the consolidated copy
        self._empty = EmptyParams(self)  # Note [parameters with no elements] in empty_params.py
        # Note [parameters changed outside the optimizer]: index -> version after our last write.
        self._param_versions: Optional[dict] = None
        # Stage 2: trainable parameters some synchronized backward since the last step (or
        # zero_grad) gave a gradient; the others are skipped by the step (Note [piece splitting]).
        self._stage2_with_grad: set[int] = set()
        # Note [zero-filled gradients in stage 2]: the parameters zero_grad(set_to_none=False)
        # left with a zero gradient in torch's terms, and those the last step stepped.
        self._stage2_zero_filled: set[int] = set()
        self._stage2_stepped: set[int] = set()
        self._fusedist_clear_protocol()

    # ------------------------------------------------------------------ torch's attributes
    # What torch's ZeroRedundancyOptimizer exposes besides ``rank``, ``world_size`` and
    # ``process_group`` (set in __init__), for scripts and frameworks that read them.

    #: The shards are always views of flat buckets here, whatever the constructor was given.
    parameters_as_bucket_view = True

    @property
    def global_rank(self) -> int:
        """This process's rank in the default process group (torch's attribute)."""
        return this_rank()

    @property
    def optim(self) -> Optimizer:
        """The optimizer of this rank's shard, an ``optimizer_class`` over flat slices of the
        master weights (torch's attribute; each step gives its ``param_groups`` this optimizer's
        hyperparameters, as torch's does). Made at the first step; read earlier, from the current parameters."""
        self._ensure_state()
        return self.inner

    @property
    def _overlap_with_ddp(self) -> bool:
        """Read by torch's ``hook_with_zero_step`` / ``hook_with_zero_step_interleaved`` first:
        they drive torch's optimizer internals, which this one has not (it failed with a bare
        AttributeError); refused naming what overlaps the step with backward here."""
        raise param_checks.torch_zero_hook_refusal(self.rank)

    # ------------------------------------------------------------------ construction
    # Note [a sharded optimizer's groups in its inner optimizer's keys]
    #     torch's ZeroRedundancyOptimizer(params, AdamW, lr=...) gives its param groups (and so its
    #     state dict's) the inner optimizer's keys and values. Here the groups kept every keyword
    #     given, so ``FusedAdamW, master_weights=False`` wrote a ``master_weights`` group key that
    #     the inner FusedAdamW leaves out at its default (Note [param groups in torch's keys] in
    #     fusedist/optim/_base.py): a checkpoint saved from it did not load by the target's keys
    #     into torch's AdamW / ZeroRedundancyOptimizer (torch's distributed checkpoint), and one
    #     loaded from theirs wrote the key on in every save after. Each group now holds the keys
    #     an inner optimizer built from it holds, with its values.
    def _fill_group_defaults(self) -> None:
        """Fill each group's missing hyperparameters, and ``self.defaults``, with the inner
        optimizer's defaults now, so LR schedulers can read them before the (lazy) inner
        optimizer exists: OneCycleLR and CyclicLR look for ``betas`` / ``momentum`` in
        ``optimizer.defaults`` and cycle them in every group. Each group keeps the inner
        optimizer's keys, as torch's ZeroRedundancyOptimizer's do (Note [a sharded optimizer's
        groups in its inner optimizer's keys])."""
        for group in self.param_groups:
            probe_group = {k: v for k, v in group.items() if k != "params"}
            probe = self._optimizer_factory([{"params": [torch.zeros(1, requires_grad=True)], **probe_group}],
                                            **self._inner_defaults)
            kept = probe.param_groups[0]
            for k in [k for k in group if k not in kept]:
                del group[k]
            for k, v in kept.items():
                if k != "params":
                    group.setdefault(k, v)
            for k, v in probe.defaults.items():
                self.defaults.setdefault(k, v)

    def _trainable_params(self) -> list:
        return [self._params[i] for i in self._trainable]

    def _param_name(self, index: int) -> str:
        """``parameter <index> ('<name>', shape ...)`` for error messages: the name as the model's own
        code spells it (without torch.compile's ``_orig_mod.``), found in the DDP or ``fully_shard``
        model holding the parameter, or as given with it (``model.named_parameters()``; Note [naming
        a parameter given without its name] in param_labels.py)."""
        return param_labels.describe(self, index)

    def _on_layout_change(self, layout) -> None:
        """DDP's layout listener."""
        grow.on_layout_change(self, layout)  # Note [growing the partition]

    def wait_for_params(self) -> None:
        """Block until every parameter all-gather of the last step has landed."""
        self._gatherer.wait_all()

    # ------------------------------------------------------------------ step
    # Note [a compiled step runs eagerly]
    #     ``torch.compile(optimizer.step)`` (or a compiled training step that calls it) traced
    #     into the step's bookkeeping and its collectives; dynamo cannot trace the communicator,
    #     so the first compiled step failed on every rank inside the parameter all-gather
    #     ("Attempted to access unregistered member on an OpaqueObject"), where torch's
    #     ZeroRedundancyOptimizer steps. The step is disabled for dynamo: a compiled caller
    #     breaks its graph around it, and the step runs eagerly, with the same numbers; under
    #     fullgraph=True dynamo's refusal gives the reason (eager.py).
    @eager_step
    def step(self, closure: Optional[Callable[[], float]] = None, grad_scaler=None):
        """torch's ``step``: this optimizer's own refusals first, then the step hooks and the step
        (Note [a sharded optimizer's refusals before the step hooks] in step_refusals.py)."""
        mark = step_flag.take(self)  # Note [a refused or skipped sharded step and the LR scheduler]
        try:
            step_refusals.refuse_first(self, grad_scaler)
            loss = self._hooked_step() if closure is None else self._hooked_step(closure)
        except BaseException:
            step_flag.undo(self, mark)
            raise
        step_flag.redecide(self, mark)
        return loss

    step.hooked = True  # (torch's step hooks run in _hooked_step, after the refusals above)

    @torch.no_grad()
    def _step_body(self, closure: Optional[Callable[[], float]] = None):
        if step_refusals.all_rates_zero(self.param_groups):  # (torch's helper zeroes them first: no stack walk)
            step_refusals.refuse_torch_helpers("step", "_init_optim_state")  # Note [torch's state-dict helpers ...]
        if self._join_config.enable:
            self._join_before_step()  # uneven inputs (Note [joined ranks] in fusedist/ddp/join.py)
        self._sharded_state.invalidate()  # the state moves on: a gathered copy would be stale
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            self.wait_for_params()
            if self.stage == 2 and self.ddp.reducer.holds_gradients() and not self.ddp.reducer.in_backward:
                raise RuntimeError(
                    f"ZeroRedundancyOptimizer(stage=2).step() (rank {self.rank}): the last backward ran under "
                    "no_sync(), so its gradients were never reduced; run the last micro-batch's backward outside "
                    "no_sync()"
                )
            self._follow_model_buckets()  # Note [the buckets of a newer wrapper] in shards.py
            grow.join_pending(self, compare=True)  # Note [growing the partition]
            self._check_frozen_grads()
            grad_agreement.check(self)  # Note [gradients nobody averaged] (the first step without a DDP model)
            self._fusedist_settle_clip()  # Note [gradients changed after the clip]
            self._zero_fill_without_backward()  # Note [zero-filled gradients in stage 2]
            if not self._has_any_grad():
                gradless_step.step_without_grads(self)  # Note [a step without gradients]
                return loss
            self._ensure_state()
            written = self._params_written_outside()  # Note [parameters changed outside the optimizer]
            if written:
                self._sync_masters_of(written)
            self._sharded_state.unmatched.clear()  # Note [loaded masters that do not match the parameters]
            if self.stage == 1:
                self._collect_stage1_grads()
            group_sync.to_inner(self.param_groups, self.inner.param_groups)
            without_grad = self._params_without_grad()
            stepped = self._pieces_to_step(without_grad)
            if self._offload is not None:
                self._offload.step(stepped)
                if not self.overlap_param_gather:
                    self.wait_for_params()
            else:
                skipped = [t for t, s in zip(self._pieces, stepped) if not s]
                for t in skipped:
                    t.grad = None  # the inner optimizer skips it, as torch skips grad=None
                try:
                    self._inner_step()
                finally:
                    self._restore_piece_grads(skipped)
                self._gatherer.publish(self._partition, self._flat_params, self._masters)
            self._empty.step(without_grad)  # Note [parameters with no elements] in empty_params.py
            # Note [hyperparameters written back after the step] in group_sync.py
            group_sync.from_inner(self.param_groups, self.inner.param_groups)
            # Stage 2: step() consumes the gradient shard, so the next synchronized backward
            # starts from zero whichever zero_grad the loop calls (module.zero_grad() cannot
            # reach the shard). Several synchronized backward passes *before* a step still
            # accumulate, as in torch.
            self._forget_grads(set_to_none=False, stepped=True)
            self._record_param_versions()
            grad_agreement.raise_carried(self)  # Note [gradients compared at every step] (carried_agreement.py)
        finally:
            self._fusedist_clear_protocol()
        return loss

    _hooked_step = Optimizer.profile_hook_step(_step_body)  # (the global and own step hooks, then the body)

    def add_param_group(self, param_group: dict) -> None:
        """As torch's: the group's trainable parameters are sharded and stepped like the others
        (progressive unfreezing; Note [growing the partition] in ``grow.py``). Stage 2 over a
        subset of a DDP model's parameters starts once a group completes them (Note [stage 2
        completed by add_param_group] in ``deferred_stage2.py``)."""
        if hasattr(self, "_params"):
            return grow.add_param_group(self._zero_mutable.owner() or self, param_group)
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._forget_grads(set_to_none)

    # ------------------------------------------------------------------ introspection
    def memory_stats(self) -> dict:
        """Bytes this rank holds for master weights and optimizer state (≈ 12Ψ/N for Adam in
        FP32, plus padding), and for its gradient shard, and how they split between host and
        device memory (``host_bytes``/``device_bytes``). Zero before the first step."""
        master = self._masters.own_bytes() if self._masters is not None else 0
        opt_state = 0
        if self.inner is not None:
            for st in self.inner.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        opt_state += v.numel() * v.element_size()
        grads = sum(t.numel() * t.element_size() for t in self._grad_shards.values())
        part = self._partition
        if self._offload is not None:
            staging = self._offload.host_bytes()
            host = master + opt_state + staging["gradient_staging"] + staging["param_staging"]
            device = grads
        else:
            host, device = 0, master + opt_state + grads
        return {
            "master_bytes": master,
            "optimizer_state_bytes": opt_state,
            "total_bytes": master + opt_state,
            "gradient_shard_bytes": grads,
            # Where those bytes live: with offload="cpu", masters, optimizer state and the
            # pinned staging buffers for gradients (down) and half-precision parameters (up)
            # are host memory; the gradient shard stays on the device (stage 2 reduces into it).
            "offload": self.offload,
            "host_bytes": host,
            "device_bytes": device,
            "shard_elements": sum(part.shard_numel.values()) if part else 0,
            "padding_elements": part.padding_elements() if part else 0,
            "world_size": self.world_size,
            # Not in total_bytes: memory of the communicator (shared with DDP), e.g. the gloo
            # exchange's reduce-scatter landing buffers, (N-2)/N of a bucket at most in flight
            # per bucket; none with 2 ranks. Zero on NCCL.
            "communication_scratch_bytes": self.comm.scratch_bytes() if self.comm is not None else 0,
        }

    # ------------------------------------------------------------------ state dicts (sharded_state.py)
    def state_dict(self) -> dict:
        """This rank's shard (:meth:`shard_state_dict`) -- except right after
        :meth:`consolidate_state_dict` on its ``to`` rank, where it is the full state dict
        gathered there (with the current ``param_groups``) until the next ``step()`` or load,
        as with torch's ZeroRedundancyOptimizer. So torch's checkpoint recipe --
        ``consolidate_state_dict(to=0)``, then ``torch.save(optimizer.state_dict())`` on rank 0
        -- saves the whole optimizer state, not rank 0's shard of it. The hooks registered with
        ``register_state_dict_pre_hook`` / ``register_state_dict_post_hook`` run around it, as
        around torch's (whose ZeroRedundancyOptimizer builds its full state dict with
        ``Optimizer.state_dict``); a post hook's return value replaces the state dict."""
        step_refusals.refuse_torch_helpers("state_dict", "_get_optim_state_dict")  # (as in step())
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = self._sharded_state.state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def shard_state_dict(self) -> dict:
        """This rank's shard as per-parameter fragments (Note [fragments] in ``state.py``)
        plus metadata. Loading at another world size: :func:`fusedist.checkpoint.load`, or
        :meth:`load_state_dict` with the list of every rank's shard."""
        return self._sharded_state.shard()

    def consolidate_state_dict(self, to: int = 0) -> Optional[dict]:
        """Gather every rank's shard; rank ``to`` gets a full state dict in torch's format
        (``{"state", "param_groups"}``) loadable by the unsharded optimizer class (and from
        :meth:`state_dict` until the next step), other ranks get None. A collective: every
        rank must call it. ``to`` is a rank of the optimizer's process group, as torch's; another
        is refused on every rank, naming it."""
        return self._sharded_state.consolidate(to)

    def load_state_dict(self, state_dict) -> None:
        """Load a list of every rank's ``shard_state_dict()`` (any world size: resharded here), or
        a full torch-format state dict (from ``consolidate_state_dict``, ``state_dict()`` right
        after it, or an unsharded optimizer). Everything is validated before anything changes,
        what the inner optimizer would refuse included (another algorithm's state, hyperparameters
        it cannot run: ``StateDictError``, the groups and state untouched); an incomplete set of
        shards is refused. Master weights it carries (shards always; a full
        state dict as ``master_param`` of half-precision parameters) are written into the
        parameters at once, whole and on every rank (half precision rounded), so the model
        matches the loaded optimizer state before the next step -- except a master that does not
        round to the parameter the program holds (stale: Note [loaded masters that do not match
        the parameters] in ``sharded_state.py``), which is dropped for the parameter. As torch's, the hooks registered
        with ``register_load_state_dict_pre_hook`` see the state dict first (a return value
        replaces it; a dict is shallow-copied before, so a hook's edits stay out of the caller's)
        and those of ``register_load_state_dict_post_hook`` run after the load."""
        refusal = None
        try:  # raised after the ranks compared (Note [refusals of one rank's own arguments] in param_checks.py)
            step_refusals.refuse_torch_helpers("load_state_dict", "_load_optim_state_dict")  # (as in step())
            if isinstance(state_dict, dict):
                state_dict = state_dict.copy()
            for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
                result = pre_hook(self, state_dict)
                if result is not None:
                    state_dict = result
        except Exception as exc:  # noqa: BLE001 - a hook's error on one rank only fails every rank alike
            refusal = exc
        self._sharded_state.load(state_dict, refusal)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def prepare_load(self, state_dict, source: str = "state dict"):
        """Validate ``state_dict`` (see :meth:`load_state_dict`) and return what
        :meth:`_apply_assembled` needs; raises :class:`StateDictError` without changing anything."""
        return self._sharded_state.prepare_load(state_dict, source)

    def _apply_assembled(self, assembled: dict, hyper: list[dict]) -> None:
        """The second half of a load, after :meth:`prepare_load` (``fusedist.checkpoint.load``
        validates every part of a checkpoint before it applies any)."""
        self._sharded_state.apply(assembled, hyper)

    def __repr__(self) -> str:
        return (f"ZeroRedundancyOptimizer(stage={self.stage}, world_size={self.world_size}, "
                f"optimizer_class={self.optimizer_class.__name__}, groups={len(self.param_groups)}"
                + (f", offload={self.offload!r})" if self.offload else ")"))


share_with_wrappers(ZeroRedundancyOptimizer)  # Note [state shared with wrappers] in shared_state.py
copies.refuse_copies(ZeroRedundancyOptimizer)  # Note [copies of a sharded optimizer] in copies.py
torch_partition.refuse_partition_attributes(ZeroRedundancyOptimizer)  # Note [torch's whole-parameter partition]
