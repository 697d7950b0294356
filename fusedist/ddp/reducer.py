"""Gradient readiness tracking and bucket launches during backward.

Note [bucket readiness]
    Every trainable parameter has a post-accumulate-grad hook. When a parameter's gradient
    has been accumulated (into its view in the flat buffer) the hook decrements its bucket's
    pending count; a bucket whose count reaches zero is *ready*. Ready buckets are launched
    strictly in bucket-index order (bucket i only after buckets < i), because collectives must
    be issued in the same order on every rank: gloo and NCCL match them by issue order, and
    two ranks whose gradients become ready in a different order would otherwise pair up
    different buckets. The last step of backward (an autograd-engine callback queued by the
    first hook) launches what is left and finishes (waits for, and averages) every bucket not
    finished during backward yet (Note [finishing buckets during backward] in ``in_flight.py``,
    with the bound on the buckets in flight). So ``loss.backward()`` returns with synchronized
    gradients, like torch DDP.
"""

from __future__ import annotations

import time
import warnings
import weakref
from typing import Callable, Optional

import torch
from torch.autograd import Variable

from .._timeline import Timeline, now_us
from ..comm import CommHandle, Communicator
from .config import DDPConfig
from .grad_hook import ParamEntry, hooks_last, make_hook, remove_hooks
from .in_backward import step_in_backward_optimizers, take_in_backward_optimizers
from .in_flight import finish_bucket, finish_completed, launch_in_order
from .held_grads import detach_kept_slots, give_back_averages, grad_held_elsewhere
from .layout import Bucket, GradLayout, build_layout, sparse_gradient_error
from .prepared import refuse_compiled_autograd
from .rebucket import rebuild_from_observed, switch_layout
from .backward_stats import backward_stats
from .strategy import AllReduceAverage, GradSyncStrategy
from .trainable_rebucket import apply_change as apply_trainable_change
from .static_graph import ArrivalCounts, check_all_arrived
from .unused import keep_local_grads, mark_known_unused, raise_graph_changed, settle_unused, unused_without_find_unused
from .events import EngineObserver

_perf_counter = time.perf_counter


class Reducer:
    """Owns the gradient layout, the hooks and the per-backward state of one DDP module."""

    def __init__(
        self,
        params: list,
        names: list,
        comm: Communicator,
        config: DDPConfig,
        device: torch.device,
        timeline: Timeline,
    ):
        self.params = params
        self.names = names
        self.index_of = {p: i for i, p in enumerate(params)}
        self.comm = comm
        self.world_size = comm.world_size
        # Gradients are averaged over this many ranks: the world size, or the ranks still
        # training under join(divide_by_initial_world_size=False) (Note [joined ranks] in join.py).
        self.grad_divisor = self.world_size
        self.defer_launch = False  # launch every bucket at the end of backward (join + SyncBatchNorm)
        self.joined = False  # this rank ran out of inputs and shadows the others' collectives
        self.shadowing = False  # the backward in progress is a joined rank's shadow
        self.config = config
        # Note [gradients that arrive twice] (static_graph.py): None unless static_graph=True.
        self.arrivals: Optional[ArrivalCounts] = ArrivalCounts() if config.static_graph else None
        self._defer_saved: Optional[bool] = None  # defer_launch outside the backward that learns
        self.device = device
        self.timeline = timeline
        self.strategy: GradSyncStrategy = AllReduceAverage()
        self.bucket_scratch: dict[int, torch.Tensor] = {}
        self.layout_listeners: list[Callable[[GradLayout], None]] = []
        # Expected readiness order before anything is observed: reverse registration order
        # (the last layers' gradients are produced first), like torch DDP.
        self._layout = self.build_in_order(list(reversed(range(len(params)))))
        self.layout_final = False  # becomes True after the rebuild from observed order
        self.provisional_layout = False  # Note [a hook's first buckets] (comm_hook.py)
        for p in params:
            self._attach_grad(p)
        # Note [trainable set changes] (trainable.py): the module's requires_grad flags, layout
        # parameters that are frozen now (inactive: no gradient expected, slot sent as zeros),
        # ones frozen since the last forward, and whether the layout may only grow (ZeRO).
        self.tracker = None
        self._inactive: set = set()
        self.frozen_now: set = set()
        # The hooks reach the reducer through a weak reference: torch keeps a tensor's hooks
        # where the garbage collector cannot see them, so a bound method there would keep the
        # reducer, the wrapper and the whole model alive after the user dropped the wrapper
        # (measured: never freed). Once the reducer is gone its hooks are removed.
        # Note [per-parameter cost] (grad_hook.py): one entry per hooked parameter, found by its key.
        self._ref = weakref.ref(self)
        self._entry_of: dict = {}
        self._hook_entries: list = []
        self._hooks: list = []
        # Note [the user's gradient hooks first] (grad_hook.py): the hooked parameters' hook
        # dicts, aligned with _hooks, and their total size when last put in order (-1: unchecked).
        self._hook_dicts: list = []
        self._hooks_ordered = -1
        self.generation = 0  # numbers the backwards (the entries' readiness stamps)
        self.synced_generation = 0  # the number of the last synchronized backward
        self.as_view = config.gradient_as_bucket_view
        # Note [gradients the user holds] (held_grads.py): this backward's gradients held by the
        # user that stay p.grad under gradient views, given the average after the buckets.
        self.own_grads: list = []
        for p in params:
            self.ensure_hook(p)
        weakref.finalize(self, remove_hooks, self._hooks)
        self._refresh_entries()
        self.append_only = False
        self.caught_up: list = []  # parameters averaged outside the buckets in the last backward
        self.caught_up_now: set = set()

        self.next_backward_sync = True
        self.prepared = False  # Note [a backward no DDP forward prepared] in prepared.py
        self._finish_queued = False  # Note [the end of a backward with nested ones] in prepared.py
        self.in_backward = False
        self._observed_order: Optional[list[int]] = None
        self.warned_unused = False  # settle_unused's one warning (unused.py)
        # Note [unused parameters known after the forward] in unused.py: those the forwards since
        # the last backward did not reach (None: no forward noted them), and those counted unused
        # as this backward began, less any that got a gradient after all (late ones, in launched buckets).
        self.known_unused: Optional[set] = None
        self.marked_unused: set = set()
        self.late_arrivals: list = []
        self.last_used_map: list = []  # Note [a joined rank's used map] in unused.py
        self.last_stats: dict = {}
        # Note [optimizers applied in backward] (in_backward.py): taken at the first training forward.
        self.in_backward_params: Optional[list] = None
        # Parameters whose grad is None after the last synchronized backward (unused by every
        # rank, or by this one without find_unused_parameters) -- for consumers that release
        # the gradients themselves and so cannot ask p.grad (ZeRO stage 2).
        self.params_without_grad: list = []
        self.iteration = 0
        self.handles: list[Optional[CommHandle]] = []  # this backward's bucket collectives

        # Watchers of the engine's events (events.py): the reliability layer's StepWatch.
        self.observers: list[EngineObserver] = []
        # What carries its values in the last bucket's message (the StepWatch), or None (Note [the
        # check carried by the last bucket] in fusedist/reliability/carried_check.py).
        self.check_carrier = None

    # ------------------------------------------------------------------ layout
    def build_in_order(self, order: list[int], bucket_storage: bool = False) -> GradLayout:
        """A layout of this model's parameters, bucketed in ``order`` (indices into ``params``)."""
        return build_layout(
            [self.params[i] for i in order],
            [self.names[i] for i in order],
            caps=self.config.bucket_caps_bytes(),
            world_size=self.world_size,
            device=self.device,
            bucket_storage=bucket_storage,
        )

    @property
    def layout(self) -> GradLayout:
        return self._layout

    @layout.setter
    def layout(self, layout: GradLayout) -> None:
        self._layout = layout
        self._refresh_entries()

    @property
    def inactive(self) -> set:
        """Layout parameters frozen now: no gradient expected, their slots sent as zeros
        (Note [trainable set changes]). Assign a new set to change it."""
        return self._inactive

    @inactive.setter
    def inactive(self, params: set) -> None:
        self._inactive = params
        self._refresh_entries()
        if self.arrivals is not None:
            self.arrivals.forget_used()

    def ensure_hook(self, p) -> None:
        """Register ``p``'s gradient hook once. Its entry has no slot until
        ``_refresh_entries`` places it (a parameter outside the layout is not reduced)."""
        if p not in self._entry_of:
            entry = self._entry_of[p] = ParamEntry()
            self._hook_entries.append(entry)
            self._hooks.append(p.register_post_accumulate_grad_hook(
                make_hook(self._ref, len(self._hook_entries) - 1)))
            self._hook_dicts.append(p._post_accumulate_grad_hooks)
            self._hooks_ordered = -1

    def _refresh_entries(self) -> None:
        """Point every hooked parameter's entry at its current slot and position (Note
        [per-parameter cost]): called whenever the layout, the parameters or the inactive
        set change. Parameters the buckets do not reduce get no slot."""
        for entry in self._hook_entries:
            entry.slot, entry.index = None, -1
        slots, inactive = self._layout.slots, self._inactive
        self.entries = [self._entry_of[p] for p in self.params]  # aligned with self.params
        for i, (p, entry) in enumerate(zip(self.params, self.entries)):
            entry.index = i
            entry.slot = None if p in inactive else slots.get(p)
        if self.arrivals is not None and self.arrivals.learned:
            self.arrivals.refresh(self)

    def is_active(self, p) -> bool:
        """Whether ``p``'s gradient is reduced by the buckets (Note [trainable set changes])."""
        return p in self.index_of and p not in self._inactive

    def set_params(self, params: list, names: list) -> None:
        self.params, self.names = list(params), list(names)
        self.index_of = {p: i for i, p in enumerate(self.params)}
        self._observed_order = None
        for p in self.params:
            self.ensure_hook(p)
        self._refresh_entries()
        if self.arrivals is not None:
            self.arrivals.forget_used()

    def add_params(self, params: list, names: list) -> None:
        self.set_params(self.params + list(params), self.names + list(names))

    def _attach_grad(self, p) -> None:
        """Make ``p.grad`` the buffer view (keeping any existing gradient value)."""
        if p.grad is None:
            return
        view = self.layout.grad_view(p)
        grad = p.grad
        view.copy_(grad)
        if self.config.gradient_as_bucket_view and not grad_held_elsewhere(grad):
            p.grad = view  # (one the user holds stays theirs: Note [gradients the user holds])

    def use_strategy(self, strategy: GradSyncStrategy) -> None:
        """Choose how buckets are synchronized: all-reduce and average (the default), or a
        consumer's own (ZeRO stage 2 reduce-scatters into its gradient shards). Chosen once,
        between backward passes; the layout is fixed with it."""
        if not isinstance(self.strategy, AllReduceAverage):
            raise ValueError(f"this DDP model's gradients are already synchronized by "
                             f"{self.strategy.description} (one gradient synchronization per model: "
                             "one stage-2 optimizer, or a communication hook)")
        if self.in_backward:
            raise RuntimeError("fusedist DDP: the gradient synchronization cannot change during a backward pass")
        self.fix_layout()
        self.strategy = strategy

    def release_strategy(self, strategy: GradSyncStrategy) -> None:
        """Back to all-reduce and average from ``strategy``, whose consumer is replaced by another
        about to install its own (Note [an optimizer built again] in fusedist/zero/wiring.py)."""
        if self.in_backward:
            raise RuntimeError("fusedist DDP: the gradient synchronization cannot change during a backward pass")
        if self.strategy is strategy:
            self.strategy = AllReduceAverage()

    # ---- for a strategy that moves gradients out of the buffer (ZeRO stage 2)
    def release_bucket(self, bucket: Bucket) -> None:
        """Drop one bucket's full gradients (its consumer has stored what it needs). An
        inactive parameter's gradient is its own, not a view of the bucket: one trainable again
        is averaged after the buckets (Note [trainable set changes]), so it is kept."""
        inactive = self.inactive
        for p in bucket.params:
            if not inactive or p not in inactive:
                p.grad = None  # views of the bucket: they would keep its memory alive
        self.layout.release(bucket)

    def release_gradients(self) -> None:
        """Drop every full gradient: ``p.grad = None`` and each bucket's storage released
        (the layout switches to per-bucket storage first if it is still flat, Note [bucket
        storage] in layout.py)."""
        for p in self.params:
            p.grad = None
        if self.layout.bucket_storage:
            self.layout.release_all()
        else:
            self.layout.use_bucket_storage()

    def take_caught_up(self) -> list:
        """The parameters taken on in the last backward, averaged outside the buckets (Note
        [trainable set changes]), handed over once."""
        caught, self.caught_up = self.caught_up, []
        return caught

    def holds_gradients(self) -> bool:
        """Whether any bucket holds gradients (e.g. a no_sync backward's, never reduced)."""
        return self.layout.allocated_bytes > 0

    def adopt_layout(self, layout: GradLayout, fixed: bool) -> None:
        """Take ``layout`` (the buckets of a wrapper this one retires, Note [an optimizer over a
        module wrapped again] in succession.py) in place of the one built at construction, fixed
        from now on when the consumers following it fixed it there."""
        switch_layout(self, layout, notify=False)
        if fixed:
            self.append_only = True  # (its slot orders were recorded when the older one was fixed)
            self.layout_final = True
            self._observed_order = None

    def fix_layout(self) -> None:
        """Note [layout fixed by a sharded consumer] (rebucket.py): no re-bucketing from now on; the
        layout grows only by appending."""
        if self.in_backward:
            raise RuntimeError("fusedist DDP: the bucket layout cannot be fixed during a backward pass")
        if self.provisional_layout and not self.layout_final:
            # A hook's first buckets (torch's before its rebuild) would stay for good: the usual ones instead.
            switch_layout(self, self.build_in_order(list(reversed(range(len(self.params))))), notify=False)
        if not self.append_only:  # the consumer lays out its storage by the parameters as they are now
            self.layout.record_orders()
        self.append_only = True
        self.layout_final = True
        self._observed_order = None

    # ------------------------------------------------------------------ backward
    def check_previous_backward(self) -> None:
        """Note [interrupted backward]: called first thing in a training forward.

        An exception raised during backward (in the model's backward, a gradient hook, or a
        launch) skips the end-of-backward callback, so this rank's per-backward state is left
        half-way. If no gradient collective was launched yet, nothing is out of step with the
        other ranks: the state is reset (the gradients accumulated before the exception stay;
        a warning says so). Otherwise the ranks' collective sequences have diverged and the
        next collective could pair with the wrong partner: raise, every time, as torch DDP does.
        """
        if not self.in_backward:
            return
        launched = self.next_launch if self.sync else 0
        if launched:
            raise RuntimeError(
                f"fusedist DDP (rank {self.comm.rank}): the previous backward did not complete (an "
                f"exception was raised during it) after launching {launched} of "
                f"{len(self.layout.buckets)} gradient bucket collectives; this rank's collectives are "
                "now out of step with the other ranks. Fix the cause and restart the job (a new "
                "process group and DistributedDataParallel wrapper)."
            )
        self.in_backward = False
        self.bucket_scratch.clear()
        self._observed_order = None  # a partial readiness order; the next backward observes anew
        warnings.warn(
            f"fusedist DDP (rank {self.comm.rank}): the previous backward was interrupted by an exception "
            "before any gradient collective; its partial gradients are still accumulated in .grad "
            "(call zero_grad() before the next backward)",
            stacklevel=3,
        )

    def prepare_forward(self, sync: bool) -> None:
        """A training forward begins (before its first collective)."""
        self.next_backward_sync = sync
        self.prepared = True
        if torch._C._current_graph_task_id() == -1:  # (one an exception interrupted queued nothing more)
            self._finish_queued = False
        # Note [the user's gradient hooks first] in grad_hook.py
        self._hooks_ordered = hooks_last(self._hooks, self._hook_dicts, self._hooks_ordered)
        if self.in_backward_params is None:
            self.in_backward_params = take_in_backward_optimizers(self.params)
        for observer in self.observers:
            observer.forward_begins(self)

    def _begin_backward(self, shadow: bool = False) -> None:
        # compiled autograd enabled around the backward alone (the forward refuses it otherwise):
        # the end-of-backward callback never ran, and the step then said no backward had run
        refuse_compiled_autograd("DistributedDataParallel")
        self.in_backward = True
        if not self.prepared:  # Note [a backward no DDP forward prepared] in prepared.py
            self.next_backward_sync = False
        self.sync = self.next_backward_sync
        inactive = self.inactive
        self.pending = [len(b.params) - (sum(p in inactive for p in b.params) if inactive else 0)
                        for b in self.layout.buckets]
        arrivals = self.arrivals  # Note [gradients that arrive twice]
        learning = arrivals is not None and not shadow and arrivals.begin(self.next_backward_sync)
        repeated = arrivals.extra_per_bucket if arrivals is not None and not shadow else {}
        for index, extra in repeated.items():
            self.pending[index] += extra
        if learning:
            self._defer_saved, self.defer_launch = self.defer_launch, True
        self.handles = [None] * len(self.layout.buckets)
        self.generation += 1  # entries stamped with it received their gradient in this backward
        self.next_launch = 0
        self.holding_last = False  # the last bucket is ready, held back for the check's values (in_flight.py)
        self.next_finish = 0  # Note [finishing buckets during backward]
        self.finished_in_hooks = 0
        self._early_finish_stopped = False
        self.t_begin = now_us()
        self.t_launch: dict[int, float] = {}
        self.t_done: dict[int, float] = {}
        self.t_last_grad = _perf_counter()  # raw perf_counter seconds (cheap in the hook)
        self.layout.reset_peak()
        strategy = self.strategy
        fold = self.sync and not shadow and not learning
        for bucket in self.layout.buckets:  # Note [division folded into the copy]
            bucket.fold = strategy.fold_factor(self, bucket) if fold and bucket.index not in repeated else None
            bucket.unfolded = []
        self.own_grads = []
        if self.as_view:  # Note [gradients the user holds] (held_grads.py)
            detach_kept_slots(self)
        # A static graph's first backward, which learns it, observes nothing for a hook's buckets:
        # torch's rebuild follows its second (Note [a hook's first buckets] in comm_hook.py).
        observe = not (learning and self.provisional_layout)
        if self._observed_order is None and self.sync and not self.layout_final and observe:
            self._observed_order = []
        if not shadow and not self._finish_queued:  # Note [the end of a backward with nested ones]
            Variable._execution_engine.queue_callback(self._finish_backward)
        for observer in self.observers:
            observer.backward_begins(self)
        self.timeline.instant("backward begins", sync=self.sync)
        known, self.known_unused = self.known_unused, None
        self.marked_unused, self.late_arrivals = set(), []
        if known and fold and self.arrivals is None:  # Note [unused parameters known after the forward]
            mark_known_unused(self, known)
            if not self.defer_launch:
                self._launch_in_order(in_hook=False)

    # The gradient hook itself is ``grad_hook.make_hook``'s closure (Note [per-parameter cost]
    # in grad_hook.py); these are its rare paths.
    def _bucket_ready(self, index: int) -> None:
        if self.timeline.path:
            self.timeline.instant(f"bucket {index} ready")
        self._launch_in_order()

    def _sparse_gradient(self, entry: ParamEntry) -> RuntimeError:
        return sparse_gradient_error(self.comm.rank, self.names[entry.index])

    def remove_hooks(self) -> None:
        """Stop receiving gradients (Note [a module wrapped again] in wrapper.py)."""
        remove_hooks(self._hooks)
        self._hooks.clear()
        self._hook_dicts.clear()

    def converted_after_wrapping(self, name: str, p: torch.Tensor, dtype: torch.dtype,
                                 device: torch.device) -> RuntimeError:
        """Note [parameters replaced after wrapping] in trainable.py: the conversions."""
        return RuntimeError(
            f"fusedist DDP (rank {self.comm.rank}): parameter '{name}' is now {p.dtype} on {p.device}, "
            f"but the model was wrapped with it as {dtype} on {device}: the module was converted "
            "after wrapping (e.g. model.half(), model.to(dtype or device)). The gradient buffers keep "
            "the dtype and device of the wrapping; convert the module first, then wrap it"
        )

    # Note [finishing buckets during backward] in in_flight.py
    _launch_in_order = launch_in_order
    _finish_completed = finish_completed
    _finish_bucket = finish_bucket

    def finish_with_this_graph_task(self) -> None:
        """Queue the end of the next backward in the running graph task, not in the nested one
        its first gradient may arrive in (Note [the end of a backward with nested ones])."""
        refuse_compiled_autograd("DistributedDataParallel")  # (its traced hooks cannot queue callbacks)
        if not self._finish_queued:
            self._finish_queued = True
            Variable._execution_engine.queue_callback(self._finish_if_begun)

    @torch.compiler.disable
    def _finish_if_begun(self) -> None:
        self._finish_queued = False
        if self.in_backward:
            self._finish_backward()

    @torch.compiler.disable  # Note [gradient hooks under a compiled caller] in grad_hook.py
    def _finish_backward(self) -> None:
        try:
            if self.sync:
                self._synchronize()
            elif self._observed_order is not None and not self.layout_final:
                self._observed_order = None  # only a synchronized backward defines the order
        finally:
            if self._defer_saved is not None:  # the backward that learned the arrivals
                self.defer_launch, self._defer_saved = self._defer_saved, None
            if self.sync:
                self.synced_generation = self.generation
            self.in_backward = False
            self.next_backward_sync = True
            self.prepared = False
            self.iteration += 1
            for observer in self.observers:
                observer.backward_ends(self)
        if self.sync and self.in_backward_params:  # after backward_ends: the step guard counts this backward
            step_in_backward_optimizers(self.in_backward_params)

    def _synchronize(self) -> None:
        t_compute_end = now_us()
        arrivals = self.arrivals  # Note [gradients that arrive twice]
        if arrivals is not None and not self.shadowing:
            if arrivals.learning:
                arrivals.finish_learning(self)
            elif arrivals.expected:
                check_all_arrived(self)
        generation = self.generation
        # Every reduced parameter's gradient counts down its bucket: none missing if all are 0.
        missing = [p for p, e in zip(self.params, self.entries)
                   if e.ready != generation and e.slot is not None] if any(self.pending) else []
        if self.tracker is not None and any(not p.requires_grad for p in missing):
            # Frozen after the forward (Lightning's toggle_optimizer after the loss): autograd
            # accumulated nothing; the change is taken now, as at a forward, not as unused.
            self.tracker.observe(self)
        # Frozen since the layout was built: no gradient expected (Note [trainable set changes]).
        frozen = self.frozen_now
        unused = [p for p in missing if p not in frozen] if frozen else missing
        had_grad = {p: p.grad is not None for p in missing}
        if self.marked_unused:  # counted as the backward began (unused.py)
            unused = unused + [p for p in self.params if p in self.marked_unused]
            had_grad.update(dict.fromkeys(self.marked_unused, False))
        kept = keep_local_grads(self, unused)  # Note [a gradient no rank produced]
        shadow = self.shadowing
        if shadow:  # Note [joined ranks]: this rank contributes zeros, whatever it holds
            had_grad = dict.fromkeys(missing, False)
            for bucket in self.layout.buckets:
                if bucket.data is not None:
                    bucket.data.zero_()
        for p in missing:
            bucket = self.layout.slots[p].bucket
            if bucket.data is None:
                if shadow or p.grad is None:  # a zero slot: the launch allocates it zeroed
                    self.pending[bucket.index] -= 1  # (Note [buckets allocated at launch])
                    continue
                self.layout.allocate(bucket)  # zeroed
            view = self.layout.grad_view(p)
            if p.grad is None:
                view.zero_()  # the slot may hold a stale gradient
            elif not shadow:  # an earlier gradient (no_sync, or kept by zero_grad(set_to_none=False))
                if p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)  # gradient views off: the slot holds the last average, not p.grad
                    if self.as_view:
                        self.own_grads.append(p)  # Note [gradients the user holds]
                if bucket.fold is not None:
                    bucket.unfolded.append(view)  # undivided
            self.pending[bucket.index] -= 1
        # Parameters whose grad stays None after this backward (refined by settle_unused).
        self.params_without_grad = ([] if shadow else [p for p in unused if not had_grad[p]]) + list(
            self.inactive) + list(frozen)
        carrier = self.check_carrier
        if carrier is not None and carrier.carries(self):  # the last bucket carries the step check
            carrier.prepare_carry(self, unused)
            self._launch_in_order(in_hook=False, final=True)
        elif missing or self.defer_launch:
            self._launch_in_order(in_hook=False)
        if self._early_finish_stopped and self.next_launch < len(self.layout.buckets):
            self.handles[self.next_finish].wait()  # the failed collective's own error (it raises)
        assert self.next_launch == len(self.layout.buckets), "every bucket is launched once per backward"
        self.strategy.quiesce(self)  # Note [one hook at a time] in comm_hook.py
        # After the last bucket: the same place in every rank's collective order.
        for observer in self.observers:
            observer.buckets_launched(self, unused)
        for bucket in self.layout.buckets[self.next_finish:]:
            self._finish_bucket(bucket)
        if self.own_grads:
            give_back_averages(self)  # Note [gradients the user holds] (held_grads.py)
        if shadow and not self.config.tolerates_unused:
            self.expose_grads(unused)  # the average of the active ranks' gradients
        changed = []
        if self.config.tolerates_unused:
            # Every rank, every synchronized iteration: a rank with nothing unused must still
            # take part in the used-map all-reduce (Note [unused parameters] in unused.py).
            changed = settle_unused(self, unused, had_grad, kept)
        t_end = now_us()
        self.last_stats, first_launch = backward_stats(self, t_compute_end, t_end)
        self.timeline.span("exposed communication", max(t_compute_end, first_launch), t_end, tid=2)
        if self._observed_order is not None and not self.layout_final:
            observed, self._observed_order = self._observed_order, None
            rebuild_from_observed(self, observed)
        if self.tracker is not None and self.tracker.target is not None:
            apply_trainable_change(self)  # Note [trainable set changes]
        self.strategy.after_sync(self)
        if changed:
            raise_graph_changed(self, changed)  # Note [the used map of a static graph]
        if unused and not self.config.tolerates_unused and not shadow:
            for observer in self.observers:
                observer.agreement_point(self)
            raise unused_without_find_unused(self, unused)

    def shadow_backward(self) -> None:
        """A joined rank's synchronized backward (Note [joined ranks] in join.py): every
        bucket collective of a backward, in order, with zero gradients; the buffers receive
        the active ranks' average (a ZeroRedundancyOptimizer steps its shard with it)."""
        self.check_previous_backward()
        self.next_backward_sync = self.prepared = True
        self._begin_backward(shadow=True)
        if self._observed_order is not None:
            self._observed_order = []  # rank 0's order rules the rebuild (if it ran one)
        self.shadowing = True
        try:
            self._finish_backward()
        finally:
            self.shadowing = False

    def expose_grads(self, params: list) -> None:
        """Give ``params`` without a gradient their (averaged) slot as ``.grad``, where the
        bucket is allocated."""
        for p in params:
            if p.grad is None and self.layout.is_allocated(self.layout.slots[p].bucket):
                view = self.layout.grad_view(p)
                p.grad = view if self.config.gradient_as_bucket_view else view.clone()

