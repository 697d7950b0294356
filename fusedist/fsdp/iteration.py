"""The bookkeeping the ``fully_shard`` states under one root share for an iteration: the last
forward's unit order (each unit prefetches the next), this iteration's post-forward order
(backward prefetches by it), the order and flight of the reduce-scatters, and the end of a
backward (Note [unit schedule] in ``state.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch.autograd import Variable

from . import grads as grads_mod
from . import stale
from .tree_names import RootTree, unit_listed

if TYPE_CHECKING:
    from .state import FullyShardState

__all__ = ["CONTEXT_ATTRIBUTE", "IterationContext"]

#: the attribute of a root's module that holds its context (the states hold it weakly)
CONTEXT_ATTRIBUTE = "_fully_shard_iteration_context"


class IterationContext:
    """Shared by the states under one root: their order, the reduce-scatters in flight."""

    def __init__(self, states: list, root_modules: list = ()):
        self.states = states
        self.tree = RootTree(root_modules)  # Note [unit paths follow the module] in tree_names.py
        self.forward_order: list = []  # states in pre-forward order, last forward
        self._current_order: list = []
        self._pos = 0
        self.in_forward = False
        self.post_forward_order: list = []  # this iteration's post-forwards (with grad)
        self.pending: list = []  # grads.PendingReduce in flight
        self.reduce_log: list = []  # this backward's reductions (Note [rank-independent reductions])
        self.reduce_order: list = []  # states in the order their reduce-scatters are issued
        self.next_reduce = 0
        self.deferred: dict = {}  # state -> its unsharded gradients, waiting for its turn
        self.backward_running = False
        # a pipeline stage's weight pass computing its gradients with autograd.grad: the units'
        # backward pre-hooks stay out of it (Note [zero-bubble passes of fusedist stages])
        self.backward_hooks_off = False
        self._forward_frame = None  # the frame that called the root's pre-forward hook
        self.post_optim_event = None  # set_post_optim_event: waited for before the next gather
        # [reliability] the root's observer (Note [stage-3 step check]); None without units.
        self.watch = None

    # ---- forward
    def begin_forward(self, frame=None) -> None:
        self.follow_tree()
        self.in_forward = True
        self._current_order, self._pos = [], 0
        self._forward_frame = frame

    def follow_tree(self, full: bool = False) -> None:
        """The units' paths and the watch's names as the root's tree is now (Note [unit paths
        follow the module] in tree_names.py); compared in full only where ``full`` or the tree's
        fingerprint changed (Note [the tree's fingerprint] there)."""
        self.tree.refresh(self.states, self.watch, full)

    def next_in_forward(self, state) -> Optional["FullyShardState"]:
        """The state that followed ``state`` in the last forward (None once the order differs)."""
        self._current_order.append(state)
        order, pos = self.forward_order, self._pos
        if pos < 0 or pos >= len(order) or order[pos] is not state:
            self._pos = -1
            return None
        self._pos += 1
        return order[pos + 1] if pos + 1 < len(order) else None

    def reduce_in_order(self, state, grads) -> None:
        """``state``'s gradients are ready: issue every reduce-scatter whose turn has come
        (Note [rank-independent reductions] in ``grads.py``). ``state=None``: the end of
        backward, issue the rest in order (then any unit outside the order, in registration
        order)."""
        if state is not None:
            if state in self.deferred:  # later gradients while the first wait their turn: add them
                # (Note [gradients after the unit's reduction] in state.py)
                grads = [a if b is None else b if a is None else a + b for a, b in zip(self.deferred[state], grads)]
            self.deferred[state] = grads
        order, deferred = self.reduce_order, self.deferred
        while self.next_reduce < len(order) and (state is None or order[self.next_reduce] in deferred):
            st = order[self.next_reduce]
            self.next_reduce += 1
            if st in deferred:
                st.grads.reduce(deferred.pop(st), self.pending, self.reduce_log, self.max_in_flight())
        if state is None:
            for st in [st for st in self.states if st in deferred]:
                st.grads.reduce(deferred.pop(st), self.pending, self.reduce_log, self.max_in_flight())

    def max_in_flight(self) -> int:
        """The reduce-scatters allowed in flight: the largest ``set_reduce_scatter_max_input_buffers``
        value under this root (as FSDP2, the most aggressive wins: the reductions share one
        queue), else ``grads.MAX_IN_FLIGHT``."""
        caps = [st.max_input_buffers for st in self.states if st.max_input_buffers is not None]
        return max(caps) if caps else grads_mod.MAX_IN_FLIGHT

    def wait_post_optim_event(self) -> None:
        """Order the next all-gather after the event ``set_post_optim_event`` gave, once.
        fusedist's gathers follow the current stream anyway, so on CUDA the current stream
        waits for the event (an optimizer stepped on another stream is then seen); on CPU
        the step has finished before forward begins and there is nothing to wait for."""
        event, self.post_optim_event = self.post_optim_event, None
        if event is None:
            return
        device = next((st.unit.device for st in self.states if st.unit is not None), None)
        if device is not None and device.type == "cuda":
            torch.cuda.current_stream(device).wait_event(event)

    def end_forward(self) -> None:
        self.in_forward, self._forward_frame = False, None
        self.forward_order = self._current_order
        for st in self.states:
            st.forward_running = False  # (one whose forward raised, caught inside the root's, ended too)
            st._depth = 0
            if st._group_pending:  # Note [a list of modules as one unit] in members.py: a member did not run
                st.close_group_call()
        for st in self.states:  # Note [unit schedule]: prefetched but never run
            unit = st.unit
            if unit is not None and not st.is_root and (unit.is_unsharded or unit.gather_in_flight) \
                    and unit.reshard_after_forward:
                unit.reshard()

    # ---- backward
    def ensure_final_callback(self) -> None:
        if not self.backward_running:
            self.backward_running = True
            # Note [rank-independent reductions]: reverse order of each unit's first forward
            # call (a unit reduces after its first call's backward, its last).
            first = list(dict.fromkeys(self.post_forward_order))
            self.reduce_order, self.next_reduce, self.deferred = first[::-1], 0, {}
            if self.watch is not None:
                self.watch.backward_begins()
            Variable._execution_engine.queue_callback(self.finish_backward)

    def reset_iteration(self) -> None:
        """After an exception aborted a forward or backward: wait for the collectives in flight,
        reshard every unit and forget the iteration (its gradients are lost: reductions in
        flight or waiting their turn, no-sync accumulators, unsharded gradients)."""
        try:
            grads_mod.discard_all(self.pending)
        finally:
            if self.watch is not None:
                self.watch.backward_aborted()
            self.in_forward, self._forward_frame = False, None
            self._current_order, self._pos = [], 0
            self.reduce_log, self.deferred, self.reduce_order, self.next_reduce = [], {}, [], 0
            self.post_forward_order.clear()
            self.backward_running = False
            for st in self.states:
                st.reset_iteration()

    @torch.compiler.disable  # Note [hooks outside compiled graphs] in state.py
    def finish_backward(self) -> None:
        try:
            # Note [accumulated units a synchronized backward does not reach] in state.py
            ran = [st for st in self.states if st.unit is not None
                   and (st.backward_pending or (st.forward_since_reduce and st.grads.reduce_grads))]
            for st in reversed(ran):
                st.post_backward()
            for st in self.states:
                if st not in ran and st.reduces_unused_unit():
                    self.deferred[st] = [None] * len(st.unit.unsharded)  # zeros, after the units that ran
            self.reduce_in_order(None, None)
            grads_mod.finish_all(self.pending)
            for st in self.states:  # Note [offloaded gradients land before backward returns]
                if st.unit is not None:
                    grads_mod.wait_host_copies(st.unit)
            if self.watch is not None:  # after the last reduce-scatter: the same point on every rank
                self.watch.backward_ends(synced=any(st.grads.reduce_grads for st in ran), reductions=self.reduce_log,
                                         units=[unit_listed(st.unit) for st in self.post_forward_order])
            # (stepped from a gradient hook: Note [gathered copies and the optimizer step] in stale.py)
            stale.reshard_stepped([st.unit for st in self.states if st.unit is not None])
        finally:
            self.reduce_log, self.deferred = [], {}
            self.post_forward_order.clear()
            self.backward_running = False
            for st in self.states:
                st.reset_backward()
