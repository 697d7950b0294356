"""copy.deepcopy of a fusedist.DistributedDataParallel model (Note [copies of the wrapper] in
fusedist/ddp/copies.py): torch.optim.swa_utils.AveragedModel(model) averages as with torch DDP,
a copy trains as a wrapper of its own with the original's options, a copy made on one rank only
issues no collective; a pickled model (``torch.save(model)``) loads into a model that trains as
torch DDP's loaded one, over the default group only, as torch's (Note [a pickled wrapper] in
fusedist/ddp/copies.py); copies keep the wrapper's own hooks, its buffer communication hook and
a subclass's attributes, without running the subclass's ``__init__`` (Note [what a copy keeps]). A copy of
the inner module under overlapped ZeRO gathers holds the final parameters; a buffer hook's futures are waited
for at the end of the backward; a forward after the group's destroy is refused at the forward.
Compared with torch DDP on 2 gloo ranks.
"""

from __future__ import annotations

import copy
import io
import os
import pickle

import pytest
import torch
from torch import nn
from torch.nn.parallel.distributed import _BufferCommHookLocation
from torch.optim.swa_utils import AveragedModel

import fusedist
from fusedist.testing import run_distributed


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


def _batches(rank, n):
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def _train(model, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _worker(rank, world):
    import fusedist

    out = {}
    for who, cls in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        model = cls(_net(), bucket_cap_mb=0.001, find_unused_parameters=True)
        averaged = AveragedModel(model)  # a deep copy of the wrapper
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in _batches(rank, 4):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            averaged.update_parameters(model)
        twin = copy.deepcopy(model)
        _train(twin, _batches(10 + rank, 3))  # the copy trains as a wrapper of its own
        out[who] = dict(
            averaged=[p.detach().clone() for p in averaged.module.parameters()],
            twin=[p.detach().clone() for p in twin.parameters()],
            shares=any(a.data_ptr() == b.data_ptr() for a, b in zip(twin.parameters(), model.parameters())),
            kind=type(averaged.module).__name__,
        )
    copied = copy.deepcopy(fusedist.DistributedDataParallel(_net(), bucket_cap_mb=0.001))
    out["options"] = (copied.config.bucket_cap_mb, copied.process_group is torch.distributed.group.WORLD)
    out["pickled"] = _pickled_models_train_as_torchs(rank)
    out["refused"] = _pickling_refused_as_torch_refuses_it()
    out["hooks"] = _or_error(_hooks_kept_as_torchs, rank)
    out["subclass"] = _or_error(_subclasses_copied_as_torchs, rank)
    out["compiled in place"] = _or_error(_copy_of_a_model_compiled_in_place)
    out["destroyed group"] = _or_error(_forwards_after_the_group_ended, "destroyed")
    out["aborted group"] = _or_error(_forwards_after_the_group_ended, "aborted")
    out["inner copies"] = _or_error(_inner_module_copied_under_overlapped_gathers, rank)
    out["buffer futures"] = _or_error(_buffer_hook_futures_waited_where_torch_waits, rank)
    return out


def _late_averaging_hook(events, named_buffers):
    """Averages the floating-point buffers asynchronously, and returns one more future, completed by a thread
    once the backward began (``events["begun"]``; after 3 s without it), ``events["delay"]`` s later."""
    import threading
    import time

    futures = [torch.distributed.all_reduce(b.div_(2), async_op=True).get_future()
               for b in named_buffers.values() if b.is_floating_point()]
    late = torch.futures.Future()

    def complete():
        began = events["begun"].wait(3.0)
        time.sleep(events.get("delay", 0.0))
        events["log"].append("future completed" if began else "future completed before any backward")
        late.set_result(None)

    threading.Thread(target=complete, daemon=True).start()
    return futures + [late]


def _buffer_hook_futures_waited_where_torch_waits(rank):
    """A POST_FORWARD buffer hook returning futures, one completed late by a thread: the order of the forward's
    return, the future's completion and the backward's return, and the buffers after two steps, as torch's."""
    import threading

    import fusedist

    found = {}
    for who, cls in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        model = cls(_net())
        events = {"log": [], "begun": threading.Event()}
        model._register_buffer_comm_hook(events, _late_averaging_hook)
        for x, y in _batches(rank, 2):
            events["begun"].clear()
            out = model(x)
            events["log"].append("forward returned")
            out.register_hook(lambda grad: events["begun"].set())
            nn.functional.mse_loss(out, y).backward()
            events["log"].append("backward returned")
        found[who] = dict(log=list(events["log"]), buffers=[b.clone() for b in model.module.buffers()])
    events["log"].clear()
    events["begun"].set()  # (the backward never comes: the thread completes the future 0.3 s after the hook)
    events["delay"] = 0.3
    x, _ = _batches(rank, 1)[0]
    model(x)
    model.require_forward_param_sync = False  # (the next forward runs no hook of its own)
    with torch.no_grad():
        model(x)
    events["log"].append("next forward returned")
    found["no backward"] = list(events["log"])
    return found


class _RootHeld(nn.Module):
    """A model whose root holds a parameter of its own (copied first, before any submodule)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.randn(6, 6))
        self.body = nn.Linear(6, 3)

    def forward(self, x):
        return self.body(x @ self.scale)


class _LandingLate:
    """Stands for the step's parameter all-gathers, still in flight: the parameters hold NaN until a wait
    writes their final values, deterministically late."""

    def __init__(self, params):
        self.params = params
        self.final = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p in params:
                p.fill_(float("nan"))

    def wait(self):
        with torch.no_grad():
            for p, final in zip(self.params, self.final):
                p.copy_(final)


def _inner_module_copied_under_overlapped_gathers(rank):
    """copy.deepcopy of the inner module (and of a submodule alone) right after an overlapped ZeRO step, against
    torch DDP + torch's ZeroRedundancyOptimizer (whose step gathers before it returns)."""
    import fusedist
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    found = {}
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    theirs = nn.parallel.DistributedDataParallel(_RootHeld())
    theirs_opt = TorchZero(theirs.parameters(), torch.optim.SGD, lr=0.1)
    theirs(x).sum().backward()
    theirs_opt.step()
    for stage in (1, 2):
        model = fusedist.DistributedDataParallel(_RootHeld(), bucket_cap_mb=0.0001)
        opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, stage=stage, lr=0.1,
                                               overlap_param_gather=True)
        model(x).sum().backward()
        attributes = sorted(vars(model.module))
        opt.step()
        for what, copied in (("inner", lambda: model.module), ("submodule", lambda: model.module.body)):
            gatherer = opt._gatherer
            gatherer.wait_all()
            late = _LandingLate(list(model.module.parameters()))
            gatherer.handles = {index: late for index in range(len(model.buckets))}
            copy_ = copy.deepcopy(copied())
            ref = dict((theirs.module if what == "inner" else theirs.module.body).named_parameters())
            found[stage, what] = max((p - ref[n]).abs().max().item() for n, p in copy_.named_parameters())
        found[stage, "attributes"] = sorted(vars(model.module)) == attributes  # (their order only changed)
    return found


def _forwards_after_the_group_ended(how: str):
    """A training forward (with buffers to broadcast, and without) after one step and the group's end --
    ``"destroyed"`` (destroy_process_group) or ``"aborted"`` (torch.distributed's ``_abort_process_group``)
    on both ranks: torch's DDP goes on with the group it holds (gloo's abort ends nothing); fusedist's forward
    raises naming the end (or the evaluation forward of a model with nothing to broadcast runs, and gives the
    module's output)."""
    import fusedist
    from torch.distributed import distributed_c10d

    end = torch.distributed.destroy_process_group if how == "destroyed" else distributed_c10d._abort_process_group
    found = {}
    for who, cls in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        for buffers in (True, False):
            group = torch.distributed.new_group([0, 1])
            model = cls(_net() if buffers else nn.Linear(6, 3), process_group=group)
            x = torch.randn(8, 6)
            model(x).sum().backward()
            end(group)
            if not buffers:
                with torch.no_grad():
                    found[who, "evaluated"] = torch.equal(model(x), model.module(x))
            try:
                model(x).sum()
                found[who, buffers] = "trained"
            except RuntimeError as exc:
                found[who, buffers] = f"{type(exc).__name__}: {exc}"
    return found


def _copy_of_a_model_compiled_in_place():
    """The copy's forward with its own weights zeroed: the plain module's output is zero (torch's
    copy keeps the original's compiled call and gives the original's output)."""
    model = fusedist.DistributedDataParallel(nn.Linear(3, 2))
    model.compile(backend="eager")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.module.weight.zero_()
        twin.module.bias.zero_()
    return twin(torch.ones(1, 3)).abs().max().item()


def _or_error(fn, *args):
    """``fn(*args)``, or its traceback: a failure fails its own test, not the shared launch."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - reported by the test
        import traceback

        return traceback.format_exc()


_CALLS = []  # the hooks' calls, in order


def _pre_hook(module, args):
    _CALLS.append("forward pre")
    return (args[0] + 1,)


def _kwargs_pre_hook(module, args, kwargs):
    _CALLS.append("forward pre (kwargs)")


def _post_hook(module, args, out):
    _CALLS.append("forward")
    return out * 2


def _backward_hook(module, grad_input, grad_output):
    _CALLS.append("backward")


def _state_dict_hook(module, state_dict, prefix, local_metadata):
    _CALLS.append("state_dict")
    state_dict["step"] = torch.tensor(7)


def _load_pre_hook(module, state_dict, prefix, *args):
    _CALLS.append("load_state_dict pre")
    state_dict.pop("step")


def _load_post_hook(module, incompatible_keys):
    _CALLS.append("load_state_dict post")


def _averaging_buffer_hook(state, named_buffers):
    """Averages the floating-point buffers instead of broadcasting rank 0's; counts its calls in ``state``."""
    state.append(sorted(named_buffers))
    _CALLS.append("buffer hook")
    for buffer in named_buffers.values():
        if buffer.is_floating_point():
            torch.distributed.all_reduce(buffer)
            buffer /= torch.distributed.get_world_size()


def _hooked(cls):
    model = cls(_net(), bucket_cap_mb=0.001)
    model.register_forward_pre_hook(_pre_hook)
    model.register_forward_pre_hook(_kwargs_pre_hook, with_kwargs=True)
    model.register_forward_hook(_post_hook)
    model.register_full_backward_hook(_backward_hook)
    model.register_state_dict_post_hook(_state_dict_hook)
    model.register_load_state_dict_pre_hook(_load_pre_hook)
    model.register_load_state_dict_post_hook(_load_post_hook)
    model.hook_state = []
    model._register_buffer_comm_hook(model.hook_state, _averaging_buffer_hook, _BufferCommHookLocation.PRE_FORWARD)
    model.note = "kept"
    return model


def _hooks_kept_as_torchs(rank):
    """The wrapper's own hooks, its buffer hook and attributes, on a deep copy and on a loaded pickle."""
    out = {}
    for who, cls in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        for how in ("deepcopy", "pickle"):
            original = _hooked(cls)
            _train(original, _batches(rank, 1))
            original.require_backward_grad_sync = False
            copied = copy.deepcopy(original) if how == "deepcopy" else _saved_and_loaded(original)
            _CALLS.clear()
            grad_sync = copied.require_backward_grad_sync
            copied.require_backward_grad_sync = True
            x, y = _batches(40 + rank, 1)[0]
            loss = nn.functional.mse_loss(copied(x), y)
            loss.backward()
            state = copied.state_dict()
            calls = list(_CALLS)
            _CALLS.clear()
            copied.load_state_dict(state)
            # (fusedist's load_state_dict reads the wrapper's state_dict keys first, which runs its hook)
            calls += [call for call in _CALLS if call != "state_dict"]
            hook = copied.__dict__.get("buffer_hook")
            out[who, how] = dict(
                calls=calls, loss=loss.item(), grads=[p.grad.clone() for p in copied.parameters()],
                buffers=[b.clone() for b in copied.buffers()], step=state["step"].item(), grad_sync=grad_sync,
                attributes=(getattr(copied, "note", None), len(copied.hook_state) if hook else None,
                            hook is not None and hook.buffer_comm_hook_state is copied.hook_state,
                            copied.__dict__.get("hook_state") is not original.hook_state))
    return out


class _TorchSubclass(nn.parallel.DistributedDataParallel):
    """A subclass whose ``__init__`` takes other arguments, adds attributes and a submodule."""

    def __init__(self, module, tag, *, scale):
        super().__init__(module, bucket_cap_mb=0.001)
        self.tag, self.scale = tag, scale
        self.extra = nn.Linear(3, 1)

    def forward(self, x):
        return self.extra(super().forward(x) * self.scale)


class _Subclass(fusedist.DistributedDataParallel):
    """:class:`_TorchSubclass` over fusedist's wrapper."""

    def __init__(self, module, tag, *, scale):
        super().__init__(module, bucket_cap_mb=0.001)
        self.tag, self.scale = tag, scale
        self.extra = nn.Linear(3, 1)

    def forward(self, x):
        return self.extra(super().forward(x) * self.scale)


def _subclasses_copied_as_torchs(rank):
    """A deep copy and a loaded pickle of a subclass keep its class, attributes and submodule, and train."""
    out = {}
    for who, cls in (("torch", _TorchSubclass), ("fusedist", _Subclass)):
        for how in ("deepcopy", "pickle"):
            torch.manual_seed(1)
            original = cls(_net(), "tagged", scale=0.5)
            copied = copy.deepcopy(original) if how == "deepcopy" else _saved_and_loaded(original)
            g = torch.Generator().manual_seed(50 + rank)
            opt = torch.optim.SGD(copied.module.parameters(), lr=0.1)  # (extra's weights: rank-local, fixed)
            for _ in range(2):
                opt.zero_grad()
                copied(torch.randn(8, 6, generator=g)).square().mean().backward()
                opt.step()
            kept = (type(copied).__name__, copied.tag, copied.scale, copied.extra is not original.extra,
                    sorted(copied.state_dict())[:2])
            out[who, how] = dict(kept=kept,
                                 params=[p.detach().clone() for p in copied.parameters()])
    return out


def _saved_and_loaded(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _pickled_models_train_as_torchs(rank):
    """torch.save(model) after some steps, then the loaded model trains on (both ranks)."""
    import fusedist

    out = {}
    for who, cls in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        model = cls(_net(), bucket_cap_mb=0.001)
        _train(model, _batches(rank, 2))
        model.require_backward_grad_sync = False
        loaded = _saved_and_loaded(model)
        flags = (loaded.require_backward_grad_sync, loaded.training,
                 loaded.process_group is torch.distributed.group.WORLD,
                 all(p.grad is None for p in loaded.parameters()), type(loaded) is cls)
        loaded.require_backward_grad_sync = True
        x, y = _batches(20 + rank, 1)[0]
        nn.functional.mse_loss(loaded(x), y).backward()
        grads = [p.grad.clone() for p in loaded.parameters()]
        _train(loaded, _batches(30 + rank, 2))
        out[who] = dict(flags=flags, grads=grads, trained=[p.detach().clone() for p in loaded.parameters()],
                        shares=any(a.data_ptr() == b.data_ptr() for a, b in zip(loaded.parameters(),
                                                                                 model.parameters())))
    out["static graph"] = _pickled_static_graph_model_averages(rank)
    return out


def _pickled_static_graph_model_averages(rank):
    """A loaded ``static_graph=True`` model keeps the setting and averages its first backward's
    gradients. (torch 2.13's loaded one leaves that backward's gradients rank-local: its pickle
    keeps the flag saying the delayed all-reduce was queued. So the reference is the average of
    the plain module's gradients.)"""
    import fusedist

    model = fusedist.DistributedDataParallel(_net(), bucket_cap_mb=0.001, static_graph=True)
    _train(model, _batches(rank, 2))
    loaded = _saved_and_loaded(model)
    plain = copy.deepcopy(loaded.module)
    x, y = _batches(20 + rank, 1)[0]
    nn.functional.mse_loss(loaded(x), y).backward()
    nn.functional.mse_loss(plain(x), y).backward()
    average = torch.cat([p.grad.flatten() for p in plain.parameters()])
    torch.distributed.all_reduce(average)
    average /= 2
    got = torch.cat([p.grad.flatten() for p in loaded.parameters()])
    return loaded.static_graph, (got - average).abs().max().item()


def _pickling_refused_as_torch_refuses_it():
    """Over another group (torch refuses it too), over a destroyed group, and copy.copy."""
    import fusedist

    group = torch.distributed.new_group([0, 1])
    errors = {}
    for who, cls in (("torch", nn.parallel.DistributedDataParallel), ("fusedist", fusedist.DistributedDataParallel)):
        model = cls(_net(), process_group=group)
        try:
            pickle.dumps(model)
        except RuntimeError as exc:
            errors[who] = str(exc)
    model = fusedist.DistributedDataParallel(_net())
    try:
        copy.copy(model)
    except TypeError as exc:
        errors["shallow"] = str(exc)
    model = fusedist.DistributedDataParallel(_net(), process_group=group)
    torch.distributed.destroy_process_group(group)
    try:
        pickle.dumps(model)
    except RuntimeError as exc:
        errors["destroyed"] = str(exc)
    return errors


@pytest.fixture(scope="module")
def copies_launched():
    """The copies' and the pickled models' scenarios share one launch of the ranks."""
    return run_distributed(_worker, 2, timeout=120)


def test_copies_average_and_train_as_torch_ddp_copies(copies_launched):
    """SGD, averages and BatchNorm in fp32 with the same reduction order: equal to 1e-6."""
    for out in copies_launched:
        ref, ours = out["torch"], out["fusedist"]
        for what in ("averaged", "twin"):
            diff = max((a - b).abs().max().item() for a, b in zip(ref[what], ours[what]))
            assert diff <= 1e-6, (what, diff)
        assert not ours["shares"] and ours["kind"] == "DistributedDataParallel"
        assert out["options"] == (0.001, True)



def test_a_pickled_model_loads_and_trains_as_torch_ddps_and_over_another_group_is_refused_as_torch_refuses(
        copies_launched):
    for out in copies_launched:
        ref, ours = out["pickled"]["torch"], out["pickled"]["fusedist"]
        # no_sync's flag and train mode kept; the default group; no gradients pickled
        assert ours["flags"] == ref["flags"] == (False, True, True, True, True)
        for what in ("grads", "trained"):
            diff = max((a - b).abs().max().item() for a, b in zip(ref[what], ours[what]))
            assert diff <= 1e-6, (what, diff)
        assert not ours["shares"]
        static_graph, diff = out["pickled"]["static graph"]
        assert static_graph and diff <= 1e-6, diff
        refused = out["refused"]
        assert "only supported when using DDP with the default process group" in refused["torch"]
        assert "other than the default one (ranks [0, 1])" in refused["fusedist"], refused["fusedist"]
        assert "save model.module" in refused["fusedist"]
        assert "its process group was destroyed" in refused["destroyed"]
        assert "copy.copy(model)" in refused["shallow"] and "copy.deepcopy(model)" in refused["shallow"]


def test_copies_keep_the_wrappers_hooks_and_attributes_as_torch_ddps(copies_launched):
    """Forward pre/post, backward, state_dict and load_state_dict hooks registered on the wrapper,
    the buffer hook (its state deep-copied or pickled with the model), no_sync's flag and an
    attribute: kept by a deep copy and a pickle, as torch's DDP keeps them (its __dict__)."""
    for out in copies_launched:
        assert not isinstance(out["hooks"], str), out["hooks"]
        for how in ("deepcopy", "pickle"):
            ref, ours = out["hooks"]["torch", how], out["hooks"]["fusedist", how]
            assert ours["calls"] == ref["calls"], (how, ours["calls"], ref["calls"])
            assert "buffer hook" in ref["calls"] and "forward" in ref["calls"]
            assert ours["attributes"] == ref["attributes"] == ("kept", 2, True, True), how  # (a call before the copy)
            assert ours["step"] == ref["step"] == 7 and ours["grad_sync"] is ref["grad_sync"] is False
            assert abs(ours["loss"] - ref["loss"]) <= 1e-6, how
            for what in ("grads", "buffers"):
                diff = max((a - b).abs().max().item() for a, b in zip(ref[what], ours[what]))
                assert diff <= 1e-6, (how, what, diff)


def test_a_subclass_with_its_own_init_copies_and_pickles_as_torch_ddps(copies_launched):
    """torch builds a copy without the subclass's __init__ (its signature differs here); the class,
    the attributes and the added submodule are kept, and the copy trains as torch's."""
    for out in copies_launched:
        assert not isinstance(out["subclass"], str), out["subclass"]
        for how in ("deepcopy", "pickle"):
            ref, ours = out["subclass"]["torch", how], out["subclass"]["fusedist", how]
            assert ref["kept"][1:] == ours["kept"][1:] == ("tagged", 0.5, True, ["extra.bias", "extra.weight"]), how
            assert (ref["kept"][0], ours["kept"][0]) == ("_TorchSubclass", "_Subclass")
            diff = max((a - b).abs().max().item() for a, b in zip(ref["params"], ours["params"]))
            assert diff <= 1e-6, (how, diff)


def test_a_copy_of_a_model_compiled_in_place_runs_its_own_weights(copies_launched):
    for out in copies_launched:
        assert out["compiled in place"] == 0.0, out["compiled in place"]


def test_a_forward_after_the_group_was_destroyed_is_refused_naming_the_group_and_the_way_on(copies_launched):
    """torch's DDP keeps using the group it holds; fusedist's communicator refuses a destroyed group, and the
    refusal comes at the forward, from the wrapper (without buffers it came at the backward's first bucket,
    naming a bucket of a communicator), on every rank; a forward that communicates nothing runs."""
    for rank, out in enumerate(copies_launched):
        found = out["destroyed group"]
        assert not isinstance(found, str), found
        assert found["torch", True] == found["torch", False] == "trained", found
        assert found["torch", "evaluated"] is found["fusedist", "evaluated"] is True, found
        for buffers in (True, False):
            message = found["fusedist", buffers]
            assert message.startswith(f"RuntimeError: fusedist.DistributedDataParallel (rank {rank} of 2): forward "
                                      "refused"), message
            assert "process group was destroyed" in message and "model.module" in message, message


def test_a_forward_after_the_group_was_aborted_is_refused_naming_the_abort(copies_launched):
    """Note [a forward after its group was aborted] (fusedist/ddp/destroyed_group.py): torch's DDP trains on over
    its aborted gloo group; fusedist's forward ran, and the first collective was refused naming a destroy (the
    buffers' broadcast, or the backward's first bucket); now the forward is refused naming the abort."""
    for rank, out in enumerate(copies_launched):
        found = out["aborted group"]
        assert not isinstance(found, str), found
        assert found["torch", True] == found["torch", False] == "trained", found
        assert found["torch", "evaluated"] is found["fusedist", "evaluated"] is True, found
        for buffers in (True, False):
            message = found["fusedist", buffers]
            assert message.startswith(f"CollectiveError: fusedist.DistributedDataParallel (rank {rank} of 2): forward "
                                      "refused: this model's process group can no longer run collectives: it was "
                                      "aborted on this rank (torch.distributed's _abort_process_group)"), message
            assert "destroyed" not in message.split(";")[0] and "model.module" in message, message


def test_a_copy_of_the_inner_module_under_overlapped_gathers_holds_the_final_parameters(copies_launched):
    """copy.deepcopy(model.module) right after a ZeroRedundancyOptimizer(overlap_param_gather=True) step copied
    the root's parameters before any wait (here NaN, the gathers landing late): now the waits come first, as
    under torch's ZeroRedundancyOptimizer, for the inner module and for a submodule copied alone."""
    for rank, out in enumerate(copies_launched):
        found = out["inner copies"]
        assert not isinstance(found, str), found
        for stage in (1, 2):
            assert found[stage, "inner"] <= 1e-6 and found[stage, "submodule"] <= 1e-6, (rank, found)
            assert found[stage, "attributes"] is True, (rank, found)


def test_a_buffer_hooks_futures_are_waited_for_at_the_end_of_the_backward_as_torch_waits(copies_launched):
    """torch's DDP waits for a POST_FORWARD buffer hook's futures at the end of the backward (their collectives
    overlap it); fusedist waited as the hook returned, so a future completed only once the backward began held
    the forward until the thread gave up. Now the same order of events, and the same buffers, as torch's."""
    for rank, out in enumerate(copies_launched):
        found = out["buffer futures"]
        assert not isinstance(found, str), found
        ref, ours = found["torch"], found["fusedist"]
        assert ref["log"] == ["forward returned", "future completed", "backward returned"] * 2, ref["log"]
        assert ours["log"] == ref["log"], (rank, ours["log"])
        for a, b in zip(ref["buffers"], ours["buffers"]):
            assert torch.allclose(a.float(), b.float(), atol=1e-6), (rank, a, b)
        # a training forward whose backward never comes: its futures are waited for before the next forward
        # (torch waits at the next backward's end only)
        assert found["no backward"] == ["future completed", "next forward returned"], (rank, found["no backward"])


def _one_rank_copy_worker(rank, world):
    import fusedist

    model = fusedist.DistributedDataParallel(_net())
    batches = _batches(rank, 3)
    _train(model, batches[:1])
    if rank == 0:
        # e.g. to save a snapshot: no collective may happen here. (A forward of the copy is a
        # DDP forward, which broadcasts buffers, as torch's copy's does.)
        snapshot = copy.deepcopy(model)
        torch.save(snapshot.module.state_dict(), os.devnull)
        _saved_and_loaded(model)  # (Note [a pickled wrapper]: no collective at saving nor at loading)
    _train(model, batches[1:])  # the ranks' collectives still pair
    return [p.detach().clone() for p in model.parameters()]


def test_a_copy_on_one_rank_issues_no_collective():
    r0, r1 = run_distributed(_one_rank_copy_worker, 2, timeout=60, env={"FUSEDIST_TIMEOUT_S": "10"})
    assert all(torch.equal(a, b) for a, b in zip(r0, r1))
