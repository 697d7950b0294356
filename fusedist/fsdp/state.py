"""When a unit gathers, reshards and reduces: the forward/backward hooks of one ``fully_shard``
module. What the modules under one root share for an iteration is in ``iteration.py``, the
check at a root's first forward that the ranks wrapped the model alike in ``wrapping_check.py``.

Note [unit schedule]
    forward   pre-hook: (a forward's first unit: wait for a ``set_post_optim_event`` event)
              gather (or wait for the prefetched gather), then prefetch the unit that
              came next in the previous forward (or the explicit ``set_modules_to_forward_prefetch``
              list), so its all-gather runs while this unit computes. post-hook: reshard when
              ``reshard_after_forward`` (under ``no_grad`` too: Note [forward without
              gradients]; to a smaller group when it is an int: Note [resharding to a smaller
              group after forward] in post_forward.py), and hook the outputs for backward.
              The root's post-hook ends the forward: a prefetched unit nobody ran is
              resharded (when it would have been).
    backward  a hook on each output of a unit call: gather the unit again if it was resharded,
              and prefetch the unit that ran before this call (reverse order of this
              iteration's post-forwards, or the explicit backward list); a unit set
              ``set_unshard_in_backward(False)`` is neither gathered nor prefetched here
              (its backward reads no parameter values, e.g. an embedding's). The unit's
              gradient hooks count its parameters' accumulations; when all trainable ones
              are in, the gradients go to a reduce-scatter (Note [unit gradients]) and the
              unit reshards.
              A unit with frozen parameters also waits for the gradients of its calls' inputs
              (Note [frozen parameters in backward]).
              A callback queued on the autograd engine ends the backward: units whose
              parameters were not all reached are reduced now, every reduce-scatter is
              finished, and per-backward state is reset.
    recompute a forward during backward (activation checkpointing) gathers the unit if needed
              and changes nothing else (but for routing the inputs of a unit with frozen
              parameters: Note [frozen parameters in backward]).
    recovery  ``reset_iter_state`` after an exception in forward or backward: the collectives
              in flight are waited for, every unit reshards, and the iteration's gradients and
              bookkeeping are dropped (``IterationContext.reset_iteration`` in iteration.py);
              without it, the next forward does the same (Notes [aborted forward] and [aborted
              backward] in ``recovery.py``). A unit's own call outside the root's forward that
              raises reshards at once (Note [aborted standalone call] there).

    Every rank must run the same units in the same order (the collectives pair up by order);
    the first forward of a root checks that the ranks wrapped the model alike (wrapping_check.py).

Note [forward without gradients]
    A unit reshards after a forward exactly when ``reshard_after_forward`` says so, with or
    without gradients, as torch's FSDP2 does. The flag is the user's trade of memory for
    gathers, and a forward under ``no_grad`` or ``inference_mode`` is where keeping the
    parameters pays most: an evaluation loop, RL rollouts or token-by-token sampling with
    ``reshard_after_forward=False`` (``set_reshard_after_forward(False)``, an explicit
    ``unshard()`` of such a unit, the root under the default ``None``) gathers each unit once
    per loop, not once per forward. (fusedist used to reshard every unit after a forward without
    gradients -- "no backward will need it" -- and paid an all-gather per unit per forward.)
    Such a unit stays gathered until something frees it: the end of a backward
    (``reshard_after_backward``), ``reshard()`` (not recursive, as FSDP2's), ``reset_iter_state()``,
    a state-dict save or load of its module (FSDP2's state-dict pre-hooks reshard too; ``state_dict_hooks.py``),
    or an optimizer step over its pieces. The last is where fusedist departs from FSDP2 on
    purpose: FSDP2 keeps serving a gathered copy after ``optimizer.step()`` wrote the shards
    (an evaluation between a backward and the step leaves the root gathered, and the next forward,
    training or not, runs the pre-step parameters); fusedist reshards such a unit at the step
    (Note [gathered copies and the optimizer step] in ``stale.py``) and gathers the stepped
    values. A forward that raises leaves what it gathered for the next root forward to drop
    (Note [aborted forward] in ``recovery.py``); an optimizer step before that reshards it,
    since a forward an exception ended is not running (``recovery.is_running``).

Note [hooks outside compiled graphs]
    ``block.compile()``, ``torch.compile(block)`` and ``torch.compile(model)`` trace a module's
    ``_call_impl`` with its hooks. Traced, our hooks would put collectives, the parameter swap
    on the module and Python bookkeeping into a graph (dynamo cannot trace the communicator,
    and a graph would replay a swap decided once). So the forward pre/post hooks and the
    backward pre-hook are ``torch.compiler.disable``-d: dynamo breaks the graph around them
    and calls them eagerly, every time. The graph in between sees the module holding the
    *unsharded* parameters -- the same persistent ``nn.Parameter`` objects every step (Note
    [sharded parameters]), so its guards hold and it is compiled once; their storage being
    freed and regathered between steps changes no guarded property (shape, dtype, strides).
    AOTAutograd's saved tensors alias that storage like eager autograd's do, and the
    backward pre-hook regathers it before the compiled backward runs. The gradient hooks are
    post-accumulate hooks on the unsharded leaves, fired by the autograd engine after the
    compiled backward, as in eager. tests/test_fully_shard_compile.py: exact parity.
    They, the inputs' backward and the end-of-backward callback are disabled too: a
    ``loss.backward()`` inside a compiled function (a compiled training step) runs eagerly
    but under dynamo's frame hook, which compiled each of them as a frame of its own and
    traced into the communicator -- the first step failed on every rank, where FSDP2 trains.

Note [compiled autograd refused]
    Under compiled autograd (``torch._dynamo.compiled_autograd``, torchtitan's
    ``enable_compiled_autograd``) the gradient hooks are traced into the compiled backward
    and the end-of-backward callback never runs: the backward failed inside dynamo tracing
    the communicator, or (hooks disabled for dynamo) finished without the unit's last
    reduction, and the step then refused "before any backward pass". So a training forward
    of the root and every backward pre-hook raise at once, naming it, as DDP's forward does
    (``fusedist/ddp/prepared.py``); ``torch.compile`` of the model and of a whole training
    step work. Under ``torch._dynamo.config.compiled_autograd`` the forward leaves it to the
    backward pre-hook (Note [compiled autograd enabled by a compiled frame] in
    ``fusedist/ddp/compiled_autograd.py``).

Note [frozen parameters in backward]
    Counting gradient accumulations tells when a unit's backward is over only if every
    parameter backward still reads has a gradient: a trainable weight is read by the same
    backward node that produces its gradient. A frozen one is not: ``base(x)`` of a LoRA
    layer needs the frozen ``base.weight`` for the gradient of ``x`` after the adapters'
    gradients may all be in, and resharding then would free it under autograd. So a unit
    holding a frozen parameter routes each call's inputs that require gradients through an
    identity autograd function (as torch's FSDP2 does for every unit); its backward runs once
    the gradients of those inputs -- the last use of the unit's parameters -- are computed,
    and the unit is reduced and resharded only when that has happened for every call and all
    trainable gradients are in (a fully frozen unit thus reshards during backward too).
    The open calls are kept across backwards, not reset at a backward's end: with two forwards
    before their backwards (``l0 = m(x0); l1 = m(x1); l0.backward(); l1.backward()``, a
    pipeline's micro-batches) the first backward's end used to forget the second call, so the
    second backward resharded the unit once its trainable gradients were in and autograd then
    read the frozen weight from freed storage ("setStorage: ... storage of size 0"; FSDP2
    trains). Each open call is a token its autograd node holds, opened when a backward reaches
    it: a forward whose backward never runs (a validation loss computed with gradients, a
    forward an exception ended) is never waited for (Note [calls a backward does not reach]).
    A recompute under reentrant activation checkpointing routes its inputs too: the original
    forward ran without gradients, and the recompute's own backward is where the frozen weight
    gives the input's gradient (the unit resharded before it; FSDP2 trains). A repeated
    backward through one forward (Note [repeated backward]) reaches calls the first closed: the
    backward pre-hook on a call's outputs opens its calls again (they crashed likewise).

Note [calls a backward does not reach]
    A call is waited for once a backward reaches it -- the pre-hook on its outputs opens it --
    not from its forward on. A forward with gradients whose backward never runs (a validation
    loss kept for logging without ``.item()``/``detach()``, an output kept as it was) keeps its
    autograd node, and with it its token, alive; opened at its forward, such a call held every
    unit with frozen parameters gathered through each later backward, until that backward's
    end: all of them at once (FSDP2 reshards each unit after its own post-backward). A call
    the running backward does reach has its outputs' gradients computed before its inputs',
    so it is opened before any of its parameters can be read again.

Note [frozen parameters of a call without input gradients]
    A call none of whose inputs requires a gradient (the root, fed token ids or data) has no
    input gradient to wait for, yet a frozen parameter of it may still be read for the
    gradient of an activation inside it: a frozen layer of the root after a block with its own
    trainable unit (``fully_shard(model.block); fully_shard(model)``, ``model.frozen`` between
    them). Counting only the trainable gradients, the unit resharded once those were in --
    the root's head, first in backward -- and autograd then read the frozen weight from freed
    storage ("setStorage: ... storage of size 0"; FSDP2 trains). Such a call gets a token that
    no input gradient closes: opened when backward reaches its outputs, it holds the unit
    gathered until the backward's end, where ``finish_backward`` reduces and reshards it --
    FSDP2's post-backward of a module whose inputs need no gradient (its final callback). A
    unit without frozen parameters is unaffected: the node that reads a trainable weight gives
    its gradient.

Note [accumulated units a synchronized backward does not reach]
    Accumulating over micro-batches (``set_requires_gradient_sync(False)``, a pipeline stage's
    micro-batches), a unit may run in some micro-batches and not in the last one, whose
    backward is the synchronized one: a block the model runs only in some micro-batches, a
    pipeline schedule's weight pass that reaches no weight of the unit. Its sum is then in the
    accumulator and nothing of that backward reaches it. So a synchronized backward also
    completes every unit that ran forward with gradients since its gradients were last reduced
    (``forward_since_reduce``): its accumulated sum is reduced and it reshards, as torch's
    pipeline schedules do for FSDP2 at the end of a step. Which units ran forward is the same
    on every rank (their gathers pair up by order), so the reductions are too.

Note [gradients after the unit's reduction]
    A unit called twice in one forward, each call under reentrant activation checkpointing
    (inside the unit or around its call), is recomputed and differentiated in two nested
    backwards: its parameters' gradients accumulate once per call, so the count of
    accumulations is complete after the first call's and the unit reduces then. A gradient
    that arrives after that reduction, in the same backward, starts another count: the unit's
    next reduction adds the later calls' gradients (as FSDP2 reduces once per call); they used
    to be left in the unsharded parameters and lost.

Note [repeated backward]
    ``loss1.backward(retain_graph=True); loss2.backward()`` runs two backwards through one
    forward. The first ends as any; the second meets units whose forward bookkeeping is
    gone. A unit reached by it -- its output's hook or a gradient hook fires -- counts as
    pending for that backward, so the final callback completes it (reduces the gradients
    not all reached, reshards) and the step watch counts a synchronized backward, as for
    the first; its reductions run in the units' registration order (no forward order was
    recorded for it), the same on every rank.

Note [a dropped model freed at once]
    A model the program drops (with its optimizer) is freed by reference counting, at once, without
    waiting for the garbage collector: its shards and gathered buffers leave memory at ``del model``.
    So everything hangs off the modules in one direction -- a module's hooks hold its state, the
    state its unit, the unit its parameters and buffers; the root's modules hold the iteration
    context (``CONTEXT_ATTRIBUTE``), which holds the states, the tree (tree_names.py) and the step
    watch -- and every reference back up is weak: a state's modules and context, the unit's
    callbacks into its state, the extension gathers' unit, the tree's and the watch's root modules
    (what is below the root does not lead back to it), the step check's report callbacks; and where
    a module given to fully_shard holds a parameter itself, the unit's registrations of it
    (registrations.py) and an all-gather extension's spec (``ExtensionSpec.module``); between units,
    a lender's borrowers (``lent_to``: the borrower holds its lender, Note [lent parameters] in
    unit.py). torch's FSDP2 model stays until the next collection (its hooks and states form
    cycles). A block kept by the program outlives its dropped root and becomes a root of its own at
    its next forward.

"""

from __future__ import annotations

import functools
import weakref
from typing import Optional

import torch

from ..ddp.compiled_autograd import refuse_compiled_autograd_at_forward
from ..ddp.prepared import refuse_compiled_autograd
from . import recovery
from .aliased_outputs import copy_views_of_gathered
from .containers import grad_tensors as _grad_tensors
from .containers import map_tensors as _map_tensors
from .early_grad import refuse_grad_before_forward
from .iteration import IterationContext
from .owners import register_pieces
from .root_setup import check_materialized, set_up_root
from .routed_inputs import InputsBackward as _InputsBackward
from .routed_inputs import OpenCall as _OpenCall
from .routed_inputs import replace_tensors as _replace_tensors
from .tensor_parallel import drop_pending_grads, settle_pending_grads

# a module -> a weak reference to its state: the state holds the module (its hooks hold the state), so a
# strong value would keep both alive for good
_STATES: "weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def state_of(module: torch.nn.Module) -> Optional["FullyShardState"]:
    ref = _STATES.get(module)
    return ref() if ref is not None else None


def _cast(dtype, obj):
    if dtype is None:
        return obj
    return _map_tensors(lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t, obj)


_WITH_COMPILED_AUTOGRAD = ("torch's fully_shard (FSDP2) where it supports compiled autograd (check its gradients: on a "
                           "CPU mesh with torch 2.13 its first unit's were left unreduced)")


def _call_weakly(state_ref, fn, *args):
    """``fn(state, *args)`` while the state lives (its unit's callbacks: a dropped state answers False)."""
    state = state_ref()
    return fn(state, *args) if state is not None else False


class FullyShardState:
    """The hooks of one ``fully_shard`` module (Note [unit schedule]); ``unit`` is None when
    every parameter of the module belongs to units below it."""

    def __init__(self, modules: list, unit, unit_grads, mp_policy, reshard_after_forward_auto: bool):
        # Note [a list of modules as one unit] in members.py: several members share this state and its unit.
        # Held weakly (Note [a dropped model freed at once]): each module holds this state through its hooks
        self._module_refs = tuple(weakref.ref(m) for m in modules)
        self.grouped = len(self._module_refs) > 1
        self._group_pending: set = set()  # ids of the members yet to run in this call of the group
        self.unit, self.grads = unit, unit_grads
        self.mp_policy = mp_policy
        self.auto_reshard = reshard_after_forward_auto
        self.is_root: Optional[bool] = None
        self._ctx_ref: Optional[weakref.ref] = None  # the root's IterationContext, once set up (weakly: its root
        # module holds it, Note [a dropped model freed at once])
        self.forward_prefetch: Optional[list] = None
        self.removed = False  # left the root's tree (Note [a sharded unit removed] in tree_names.py)
        self.backward_prefetch: Optional[list] = None
        self.backward_pending = False  # ran forward with grad, or backward, since the last backward ended
        # ran forward with grad since its gradients were last reduced (Note [accumulated units
        # a synchronized backward does not reach])
        self.forward_since_reduce = False
        self.unshard_in_backward = True  # set_unshard_in_backward
        self.is_last_backward = True  # set_is_last_backward (recorded; every backward finishes)
        self.requires_all_reduce = True  # set_requires_all_reduce (HSDP: also on the unit's grads; 1-D: recorded)
        self.unshard_async_op = False  # _set_unshard_async_op
        self.post_optim_event = None  # set_post_optim_event before the first forward (then: ctx's)
        self.max_input_buffers: Optional[int] = None  # set_reduce_scatter_max_input_buffers
        self.comm_hints: dict = {}  # FSDP2's performance-only settings, recorded (api.py)
        self._post_forward_indices: list[int] = []
        self._in_backward = False
        self._grads_seen = 0
        # calls a backward reached (their outputs' pre-hook ran) whose input gradients are not done yet,
        # across backwards (Notes [frozen parameters in backward] and [calls a backward does not reach])
        self._open_calls: "weakref.WeakSet[_OpenCall]" = weakref.WeakSet()
        self._call_opened: list = []  # those of the call running forward (its outputs' hooks reopen them)
        self._post_backward_done = False
        self.forward_running = False  # between this module's pre- and post-forward (FSDP2's FORWARD state)
        # its calls running, nested ones included (Note [a unit called inside its own call] in functions.py)
        self._depth = 0
        self._call_closed = False  # the post-forward of the call ending now ran (Note [aborted standalone call])
        me = weakref.ref(self)
        if unit is not None:  # (through a weak reference: Note [a dropped model freed at once])
            unit.on_grad = functools.partial(_call_weakly, me, FullyShardState._on_grad)
            unit.busy = functools.partial(_call_weakly, me, FullyShardState._busy)
            unit.on_adopted = functools.partial(_call_weakly, me, register_pieces)
        for module in modules:
            _STATES[module] = me
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            module.register_forward_hook(self._post_forward)
            module.register_forward_hook(self._after_call, always_call=True)  # Note [aborted standalone call]

    @property
    def modules(self) -> list:
        """The modules of this state (several for a group); None for one already freed."""
        return [ref() for ref in self._module_refs]

    @property
    def module(self) -> Optional[torch.nn.Module]:
        return self._module_refs[0]()

    @property
    def ctx(self) -> Optional[IterationContext]:
        ref = self._ctx_ref
        return ref() if ref is not None else None

    @ctx.setter
    def ctx(self, ctx: Optional[IterationContext]) -> None:
        self._ctx_ref = weakref.ref(ctx) if ctx is not None else None

    def _busy(self) -> bool:
        """Whether a forward or backward under this module's root is running (one an exception
        ended is not: Note [aborted forward])."""
        ctx = self.ctx
        return ctx is not None and recovery.is_running(ctx)

    def in_own_forward(self) -> bool:
        """Whether this module's forward is running now (``reshard()`` waits for its end): begun
        and not ended, unless an exception ended the root's forward midway (Note [aborted
        forward]), which leaves the flag set until the next forward drops it."""
        ctx = self.ctx
        return self.forward_running and not (ctx is not None and ctx.in_forward and not recovery.is_running(ctx))

    def in_own_backward(self) -> bool:
        """Whether this unit's backward is running now: its outputs' gradients arrived, its own
        are not all in (``reshard()`` waits for its end too; the rest of it reads the parameters)."""
        return self._in_backward and not self._post_backward_done and recovery.in_autograd_backward()

    # ------------------------------------------------------------------ root
    def lazy_init(self) -> None:
        """The first state to run forward is the root of the states below it (root_setup.py)."""
        if self.ctx is None:
            set_up_root(self)

    def path_in(self, names: dict) -> Optional[str]:
        """This state's module path in ``names`` (module id -> path); a group's is its members'."""
        if not self.grouped:
            return names.get(id(self.module))
        return "[" + ", ".join(names.get(id(m)) or "?" for m in self.modules) + "]"

    # ------------------------------------------------------------------ forward
    @torch.compiler.disable  # Note [hooks outside compiled graphs]
    def _pre_forward(self, module, args, kwargs):
        if self.ctx is None:
            check_materialized(self)
            set_up_root(self)
        ctx, unit = self.ctx, self.unit
        if (self._in_backward or ctx.backward_running) and not recovery.in_autograd_backward():
            recovery.recover_aborted_backward(ctx, module)  # Note [aborted backward]
        if self._in_backward or ctx.backward_running:  # recompute (activation checkpointing)
            if unit is not None:
                unit.unshard(async_op=False)
                if torch.is_grad_enabled():
                    self.backward_pending = True
                    if not all(sp.requires_grad for sp in unit.sharded):  # Note [frozen parameters in backward]
                        args, kwargs = self._route_inputs(args, kwargs, recompute=True)
            return _cast(self.mp_policy.param_dtype if self.mp_policy.cast_forward_inputs else None, (args, kwargs))
        if self.is_root and ctx.in_forward and not recovery.forward_is_live(ctx) \
                and not recovery.later_group_member(self, module):
            recovery.recover_aborted_forward(ctx, module)  # Note [aborted forward]
        if self.is_root and torch.is_grad_enabled():
            # Note [compiled autograd refused]
            refuse_compiled_autograd_at_forward("fully_shard", _WITH_COMPILED_AUTOGRAD)
        if self.grouped:  # Note [a list of modules as one unit] in members.py
            if self._group_pending:  # a later member of this call: the unit is gathered already
                if unit is not None and torch.is_grad_enabled() and not all(sp.requires_grad for sp in unit.sharded):
                    args, kwargs = self._route_inputs(args, kwargs)  # Note [frozen parameters in backward]
                return args, kwargs
            self._group_pending = {id(m) for m in self.modules}
        self.forward_running = True
        self._depth += 1
        if not ctx.in_forward:  # a forward begins (the root's, or a submodule run alone)
            ctx.wait_post_optim_event()
        if self.is_root and not ctx.in_forward:
            ctx.begin_forward(recovery.hook_caller())
            if ctx.watch is not None and torch.is_grad_enabled():
                ctx.watch.forward_begins()  # the last step's check, before this step's first gather
        if self.mp_policy.cast_forward_inputs:
            args, kwargs = _cast(self.mp_policy.param_dtype, (args, kwargs))
        if unit is not None:
            with torch.profiler.record_function("fusedist::fully_shard::unshard"):
                unit.unshard(async_op=self.unshard_async_op)
                if self.unshard_async_op:  # the wait unshard(async_op=False) makes inside
                    unit.wait_for_unshard()
            if torch.is_grad_enabled():
                self.backward_pending = self.forward_since_reduce = True
                if not all(sp.requires_grad for sp in unit.sharded):  # Note [frozen parameters in backward]
                    args, kwargs = self._route_inputs(args, kwargs)
        nxt = ctx.next_in_forward(self) if unit is not None else None
        targets = self.forward_prefetch if self.forward_prefetch is not None else ([nxt] if nxt else [])
        for st in targets:
            if st is not self and st.unit is not None and not st.removed:  # Note [a sharded unit removed]
                st.unit.unshard(async_op=True)
        return args, kwargs

    @torch.compiler.disable  # Note [hooks outside compiled graphs]
    def _post_forward(self, module, args, output):
        output = self._end_call(module, output)
        self._call_closed = True
        return output

    @torch.compiler.disable  # Note [hooks outside compiled graphs]
    def _after_call(self, module, args, output):
        """After every call, one an exception ended too (``always_call``)."""
        closed, self._call_closed = self._call_closed, False
        if not closed:
            recovery.unwind_aborted_call(self)

    def _end_call(self, module, output):
        ctx, unit = self.ctx, self.unit
        if self._in_backward or ctx.backward_running:
            return _cast(self.mp_policy.output_dtype, output)
        grad = torch.is_grad_enabled()
        if self.grouped:  # Note [a list of modules as one unit] in members.py
            self._group_pending.discard(id(module))
            if self._group_pending:  # members still to run: this call's post-forward waits for them
                if unit is not None and unit.reshard_after_forward:  # (freed at the group's post-forward:
                    output = copy_views_of_gathered(unit, output)  # Note [outputs that are views of the gathered
                    # parameters] in aliased_outputs.py)
                if grad:  # the entry the group's post-forward will record
                    self._hook_outputs(output, len(self._post_forward_indices))
                return output
        self._depth = max(self._depth - 1, 0)
        self.forward_running = self._depth > 0  # an outer call of this unit still runs
        if unit is not None:
            if grad:
                self._record_post_forward()
            # with or without grad (Note [forward without gradients]); after the outermost call only
            # (Note [a unit called inside its own call] in functions.py)
            if unit.reshard_after_forward and not self._depth:
                # Note [outputs that are views of the gathered parameters] in aliased_outputs.py
                output = copy_views_of_gathered(unit, output)
                unit.reshard_post_forward()  # (an int: Note [resharding to a smaller group after forward])
        if grad:
            self._hook_outputs(output, len(self._post_forward_indices) - 1)
        self._call_opened = []
        if self.is_root:
            ctx.end_forward()
        return _cast(self.mp_policy.output_dtype, output)

    def _record_post_forward(self) -> None:
        """This call's entry in the iteration's post-forward order (backward prefetches by it)."""
        order = self.ctx.post_forward_order
        self._post_forward_indices.append(len(order))
        order.append(self)

    def _hook_outputs(self, output, call: int) -> None:
        """The backward pre-hook of call ``call`` on each output that requires a gradient."""
        hook = functools.partial(self._pre_backward, call, tuple(self._call_opened))
        for t in _grad_tensors(output, []):
            t.register_hook(hook)

    # ------------------------------------------------------------------ backward
    @torch.compiler.disable  # Note [hooks outside compiled graphs]
    def _pre_backward(self, call: int, opened: tuple, grad):
        refuse_compiled_autograd("fully_shard", _WITH_COMPILED_AUTOGRAD)  # Note [compiled autograd refused]
        ctx, unit = self.ctx, self.unit
        if ctx.backward_hooks_off:  # Note [zero-bubble passes of fusedist stages] in fusedist/pipelining/passes.py
            return grad
        self._open_calls.update(opened)  # (open again in a repeated backward: Note [frozen parameters in backward])
        ctx.ensure_final_callback()
        self._in_backward = True
        self.backward_pending = True  # (a second backward through the same graph: Note [repeated backward])
        if unit is None or call in self._calls_started:
            return grad
        self._calls_started.add(call)
        with torch.profiler.record_function("fusedist::fully_shard::pre_backward"):
            if self.unshard_in_backward:
                unit.unshard(async_op=True)  # the prefetch below goes out before we wait
            if self.backward_prefetch is not None:
                targets = self.backward_prefetch if len(self._calls_started) == 1 else []
            else:
                index = self._post_forward_indices[call] if 0 <= call < len(self._post_forward_indices) else 0
                targets = [ctx.post_forward_order[index - 1]] if index > 0 else []
            for st in targets:
                if st is not self and st.unit is not None and st.backward_pending and st.unshard_in_backward:
                    st.unit.unshard(async_op=True)
            if self.unshard_in_backward:
                unit.wait_for_unshard()
        return grad

    @functools.cached_property
    def _calls_started(self) -> set:
        return set()

    def _route_inputs(self, args, kwargs, recompute: bool = False):
        tensors = _grad_tensors((args, kwargs), [])
        if not tensors:
            if not recompute:  # Note [frozen parameters of a call without input gradients]
                self._call_opened.append(_OpenCall())
            return args, kwargs
        call = _OpenCall()
        routed = _InputsBackward.apply(self, call, *tensors)
        if recompute:  # (a recompute's outputs are not hooked: it is part of the running backward)
            self._open_calls.add(call)
        else:  # opened by its outputs' backward pre-hook (Note [calls a backward does not reach])
            self._call_opened.append(call)
        return _replace_tensors((args, kwargs), {id(t): r for t, r in zip(tensors, routed)})

    @torch.compiler.disable  # Note [hooks outside compiled graphs]
    def _on_inputs_grad(self, call: "_OpenCall") -> None:
        self.ctx.ensure_final_callback()
        self._open_calls.discard(call)
        self._maybe_post_backward()

    def _on_grad(self, index: int) -> None:
        ctx = self.ctx
        if ctx is None:  # Note [a gradient before the first forward] in early_grad.py
            refuse_grad_before_forward(self.unit, index)
        ctx.ensure_final_callback()
        self.backward_pending = True
        if self._post_backward_done:  # Note [gradients after the unit's reduction]
            self._post_backward_done, self._grads_seen = False, 0
        self._grads_seen += 1
        self._maybe_post_backward()

    def _maybe_post_backward(self) -> None:
        expected = sum(1 for u in self.unit.unsharded if u.requires_grad)
        if self._grads_seen >= expected and not self._open_calls:
            self.post_backward()

    def post_backward(self) -> None:
        """The unit's gradients go to its reduce-scatter (or accumulator); the unit reshards."""
        if self._post_backward_done:
            return
        self._post_backward_done = True
        unit, ctx = self.unit, self.ctx
        grads = [u.grad for u in unit.unsharded]
        if unit.tp_comm is not None:  # Note [tensor-parallel gradients across micro-batches] in tensor_parallel.py
            settle_pending_grads(unit, grads, self.grads.reduce_grads, self.grads.policy_reduce_dtype)
        for u in unit.unsharded:
            u.grad = None
        with torch.profiler.record_function("fusedist::fully_shard::post_backward"):
            if self.grads.reduce_grads:
                ctx.reduce_in_order(self, grads)
                self.forward_since_reduce = False
            else:
                self.grads.accumulate(grads)
        del grads
        if unit.reshard_after_backward:
            unit.reshard()

    def reduces_unused_unit(self) -> bool:
        """Whether this unit, which did not run forward with gradients in this backward, is
        reduced anyway: under ``set_reduce_scatter_unused_params(True)``, its trainable
        parameters then get zero-sum ``.grad``, as FSDP2's -- which does so once the unit has
        been gathered (before that it holds no unsharded parameters to take zeros from), a
        condition the same on every rank."""
        unit, grads = self.unit, self.grads
        return unit is not None and grads.reduce_unused and grads.reduce_grads and unit.gathered_once

    def close_group_call(self) -> None:
        """End a group call some member of which did not run (the root's forward is over):
        record it as the post-forward that member's would have recorded (its outputs' backward
        hooks point at that entry); ``end_forward`` reshards the unit as for any unit."""
        self._group_pending.clear()
        self.forward_running = False
        if self.unit is not None and torch.is_grad_enabled():
            self._record_post_forward()

    def reset_iteration(self) -> None:
        """This module's part of ``IterationContext.reset_iteration``."""
        self.reset_backward()
        self.forward_since_reduce = False
        self._open_calls = weakref.WeakSet()  # the aborted iteration's calls get no backward
        self._call_opened = []
        unit = self.unit
        if unit is None:
            return
        unit.reshard()
        for u in unit.unsharded:
            u.grad = None
        self.grads.drop_accumulator()
        drop_pending_grads(unit)

    def reset_backward(self) -> None:
        self._group_pending.clear()  # a group call an exception ended (Note [aborted forward])
        self.forward_running = False
        self._depth = 0
        self._in_backward = False
        self._grads_seen = 0
        self._post_backward_done = False
        self.backward_pending = False
        self._post_forward_indices.clear()
        self._calls_started.clear()
        if self.unit is not None and self.unit.reshard_after_backward:
            self.unit.reshard()
