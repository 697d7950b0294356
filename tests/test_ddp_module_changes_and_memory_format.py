"""Changes to a module after fusedist's DDP wrapped it, world size 2 on gloo, in one launch.

* ``model.to(memory_format=torch.channels_last)`` after wrapping converts each ``p.grad`` in place of
  its data; with gradient views that is the bucket view, which then no longer pointed into the
  bucket: the ranks stepped with local or stale gradients (Note [memory format changed after
  wrapping] in fusedist/ddp/memory_format.py). The reference is one process on the global batch
  (torch's DDP itself trains wrongly there, with and without gradient views).
* A submodule replaced or set to None after wrapping is refused at the next forward, naming its
  parameters (torch's DDP trains a replacement on each rank's own gradient with
  ``find_unused_parameters=True``); one deleted is named by the unused-parameter error.
* An optimizer step over a parameter added after wrapping (forward through ``model.module``) says so.
* A submodule inserted with ``ModuleList.insert`` / ``Sequential.insert`` (which register it without
  torch's registration hook) is refused at the next forward, naming it (torch's DDP leaves its
  gradients unaveraged, so the ranks drift apart); a module without parameters inserted trains on as
  torch's DDP does (Note [submodules inserted into a container] in fusedist/ddp/trainable.py).
* A submodule written into a module's ``_modules`` directly (``model._modules[name] = sub``, into the
  root, into a leaf, replacing an entry) is refused at the next forward naming its path, for the wrapper
  and for ``fusedist.replicate`` in its own words (torch's DDP leaves its gradients local); a
  parameterless one trains as torch's DDP does (Note [submodules written without the registration
  hook] in fusedist/ddp/module_tree.py).
* After a parameterless entry is inserted into or deleted from a ModuleList, messages name the later
  entries' parameters by their current paths, not by those they were wrapped under.
* ``model.module`` replaced after wrapping by a module of other Parameters is refused at the assignment
  (torch's DDP trains them on each rank's own gradients); one around the same Parameters trains as one
  process (Note [the wrapped module replaced] in fusedist/ddp/module_swap.py).
* A forward output whose tensors sit in a plain object, with ``find_unused_parameters=True``: the
  error says which containers the wrapper searches.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from shared_rank_launch import launch_for_selected, results_of


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3)
        self.proj = nn.Conv2d(4, 4, 1)  # laid out alike in both formats: never the bucket's probe
        self.head = nn.Conv2d(4, 2, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.proj(torch.tanh(self.conv(x))))).mean((2, 3))


def _batches(world, steps):
    gens = [torch.Generator().manual_seed(10 + r) for r in range(world)]
    return [[torch.randn(2, 3, 7, 7, generator=g) for g in gens] for _ in range(steps)]


def _loss(out):
    return out.square().sum()


def _reference(world, batches, convert_at, accumulate):
    m = ConvNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    for s, xs in enumerate(batches):
        if s == convert_at:
            m.to(memory_format=torch.channels_last)
        (sum(_loss(m(x)) for x in xs) / world).backward()
        if accumulate and s % 2 == 0:
            continue
        opt.step()
        opt.zero_grad(set_to_none=False)
    return [p.detach().clone() for p in m.parameters()]


def _memory_format(rank, world):
    """Conversion after wrapping: before the first backward and after the layout is final
    (step 2), gradient views on and off, and between a ``no_sync`` backward and the synchronized one."""
    import fusedist

    out = {}
    batches = _batches(world, 4)
    for convert_at, accumulate in ((0, False), (2, False), (3, True)):
        ref = _reference(world, batches, convert_at, accumulate)
        for as_view in (True, False):
            m = ConvNet()
            ddp = fusedist.DistributedDataParallel(m, gradient_as_bucket_view=as_view)
            opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for s, xs in enumerate(batches):
                    if s == convert_at:
                        m.to(memory_format=torch.channels_last)
                    if accumulate and s % 2 == 0:
                        with ddp.no_sync():
                            _loss(ddp(xs[rank])).backward()
                        continue
                    _loss(ddp(xs[rank])).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=False)
            error = max((p.detach() - r).abs().max().item() / (1 + r.abs().max().item())
                        for p, r in zip(m.parameters(), ref))
            ours = [str(w.message) for w in caught if "changed memory format" in str(w.message)]
            out[convert_at, accumulate, as_view] = (error, ours)
    return out


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        x = self.a(x)
        extra = getattr(self, "extra", None)
        if extra is not None:
            x = extra(x)
        return self.fc(x) if self.fc is not None else x


def _steps(ddp, opt, rank, change, steps=3):
    """Train; ``change(module)`` before the second step. The error's text, or the parameters."""
    try:
        for s in range(steps):
            if s == 1:
                change(ddp.module)
            ddp(torch.randn(3, 4) + rank).sum().backward()
            opt.step()
            opt.zero_grad()
    except (RuntimeError, ValueError) as exc:
        return str(exc)
    return [p.detach().clone() for p in ddp.module.parameters()]


def _set(name, make):
    def change(module):
        setattr(module, name, make(module))
    return change


def _delete(module):
    del module.fc
    module.__dict__["fc"] = None  # (the forward reads it)


def _removed_submodules(rank, world):
    import fusedist

    out = {}
    cases = {"identity": _set("fc", lambda m: nn.Identity()), "none": _set("fc", lambda m: None),
             "other names": _set("fc", lambda m: nn.Sequential(nn.Linear(4, 2))),
             "same parameters": _set("fc", lambda m: nn.Sequential(m.fc)), "deleted": _delete}
    for case, change in cases.items():
        for find_unused in (False, True):
            results = []
            for impl in (fusedist.DistributedDataParallel, nn.parallel.DistributedDataParallel):
                trains = case == "same parameters" or (case == "deleted" and find_unused)
                if impl is not fusedist.DistributedDataParallel and not trains:
                    continue  # torch's DDP is the reference only where it trains correctly
                ddp = impl(Net(), find_unused_parameters=find_unused)
                torch.manual_seed(100 + rank)  # the batches: alike for both wrappers
                results.append(_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), rank, change))
            out[case, find_unused] = results
    ddp = fusedist.DistributedDataParallel(Net(), static_graph=True)
    out["deleted", "static_graph"] = [_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), rank, _delete)]
    return out


def _added_after_wrapping(rank, world):
    """Parameters added or replaced after wrapping, trained through ``model.module``."""
    import fusedist

    out = {}
    for case in ("added", "replaced"):
        m = Net()
        ddp = fusedist.DistributedDataParallel(m)
        if case == "added":
            m.extra = nn.Linear(4, 4)
        else:
            m.fc.weight = nn.Parameter(torch.randn(2, 4))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(torch.randn(3, 4)).sum().backward()
        try:
            opt.step()
            out[case] = "stepped"
        except ValueError as exc:
            out[case] = str(exc)
        del ddp
    return out


class Stacked(nn.Module):
    """Layers in a ModuleList, a Sequential head, and a container added later when present."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))

    def forward(self, x):
        for layer in [*self.layers, *getattr(self, "more", ())]:
            x = torch.tanh(layer(x))
        return self.head(x)


def _insert(where, index, make):
    def change(module):
        container = getattr(module, where)
        container.insert(index, make())
    return change


def _insert_and_delete(module):
    module.layers.insert(0, nn.Linear(4, 4))
    del module.layers[2]  # (the same length again, in a new dict)


def _local_grad_spread(rank, world, ddp, param):
    """How far ``param``'s gradient differs across ranks after one backward (0 when averaged)."""
    import torch.distributed as dist

    ddp(torch.randn(3, 4) + rank).sum().backward()
    grads = [torch.empty_like(param.grad) for _ in range(world)]
    dist.all_gather(grads, param.grad)
    return max((g - grads[0]).abs().max().item() for g in grads)


def _inserted_submodules(rank, world):
    import fusedist

    out = {}
    linear = lambda: nn.Linear(4, 4)  # noqa: E731
    cases = {"list": _insert("layers", 0, linear), "sequential": _insert("head", 1, linear),
             "insert and delete": _insert_and_delete, "parameterless": _insert("head", 1, nn.ReLU)}
    for case, change in cases.items():
        ddp = fusedist.DistributedDataParallel(Stacked())
        torch.manual_seed(100 + rank)
        out[case] = _steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), rank, change)
    torch_ddp = nn.parallel.DistributedDataParallel(Stacked())
    torch.manual_seed(100 + rank)
    out["parameterless", "torch"] = _steps(torch_ddp, torch.optim.SGD(torch_ddp.parameters(), lr=0.1), rank,
                                           cases["parameterless"])
    # into a container added after wrapping (followed through the registration hook), then inserted into
    ddp = fusedist.DistributedDataParallel(Stacked())
    ddp.module.more = nn.ModuleList()

    def into_added(module):
        module.more.insert(0, nn.Linear(4, 4))
    out["added container"] = _steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), rank, into_added)
    # the reference's behaviour: torch's DDP leaves the inserted layer's gradient local
    torch_ddp = nn.parallel.DistributedDataParallel(Stacked())
    torch_ddp.module.layers.insert(0, nn.Linear(4, 4))
    out["torch spread"] = _local_grad_spread(rank, world, torch_ddp, torch_ddp.module.layers[0].weight)
    return out


class Adapted(Net):
    """``Net`` that also runs an adapter written into ``a``'s ``_modules`` and an activation and a layer
    written into its own, when present."""

    def forward(self, x):
        adapter = self.a._modules.get("adapter")
        act, extra = self._modules.get("act"), self._modules.get("extra")
        x = self.a(x) if adapter is None else adapter(self.a(x))
        x = x if act is None else act(x)
        x = x if extra is None else extra(x)
        return self.fc(x)


def _write(parent, name, make):
    def change(module):
        target = module if parent is None else getattr(module, parent)
        target._modules[name] = make()  # (no registration hook runs)
    return change


def _written_submodules(rank, world):
    """Submodules written into a module's ``_modules`` directly after wrapping."""
    import fusedist

    out = {}
    linear = lambda: nn.Linear(4, 4)  # noqa: E731
    cases = {"into the root": _write(None, "extra", linear), "into a leaf": _write("a", "adapter", linear),
             "replacing": _write(None, "fc", lambda: nn.Linear(4, 2)), "parameterless": _write(None, "act", nn.ReLU)}
    for case, change in cases.items():
        ddp = fusedist.DistributedDataParallel(Adapted(), find_unused_parameters=case == "replacing")
        torch.manual_seed(100 + rank)
        out[case] = _steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), rank, change)
    torch_ddp = nn.parallel.DistributedDataParallel(Adapted())
    torch.manual_seed(100 + rank)
    out["parameterless", "torch"] = _steps(torch_ddp, torch.optim.SGD(torch_ddp.parameters(), lr=0.1), rank,
                                           cases["parameterless"])
    # a replicated module, after its first forward (its engine is built there)
    model = fusedist.replicate(Adapted())
    model(torch.randn(3, 4)).sum().backward()
    _write(None, "extra", linear)(model)
    try:
        model(torch.randn(3, 4))
        out["replicated"] = None
    except RuntimeError as exc:
        out["replicated"] = str(exc)
    # the reference's behaviour: torch's DDP leaves the written layer's gradient local
    torch_ddp = nn.parallel.DistributedDataParallel(Adapted())
    torch_ddp.module._modules["extra"] = nn.Linear(4, 4)
    out["torch spread"] = _local_grad_spread(rank, world, torch_ddp, torch_ddp.module.extra.weight)
    return out


class Skipping(nn.Module):
    """Layers in a ModuleList, one of them skipped by index (an unused parameter's error names it)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 2)
        self.skip = None

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i != self.skip:
                x = layer(x)
        return self.head(x)


def _current_names(rank, world):
    """After a parameterless entry is inserted into, or deleted from, a ModuleList, the wrapper's
    messages name the later entries' parameters by their current paths: the unused-parameter error
    for the layer skipped, which was ``layers.2`` when wrapped, against the module's own names; and
    a Parameter assigned into it after the insertion, before a forward."""
    import fusedist

    def inserted(module):
        module.layers.insert(0, nn.Tanh())
        module.skip = 3

    def deleted(module):
        del module.layers[0]
        module.skip = 1

    out = {}
    for case, change in (("inserted", inserted), ("deleted", deleted)):
        ddp = fusedist.DistributedDataParallel(Skipping())
        skipped = ddp.module.layers[2]
        message = _steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), rank, change)
        names = [n for n, p in ddp.module.named_parameters() if any(p is q for q in skipped.parameters())]
        out[case] = (message, names)

    def assigned(module):  # before any forward sees the insertion: noted under the current path
        module.layers.insert(0, nn.Tanh())
        module.layers[3].weight = nn.Parameter(torch.randn(4, 4))

    ddp = fusedist.DistributedDataParallel(Skipping())
    out["assigned"] = _steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), rank, assigned)
    return out


class Box:
    """A forward's output in an object DDP does not look into (neither torch's nor fusedist's)."""

    def __init__(self, logits):
        self.logits = logits


class BoxedNet(Net):
    def forward(self, x):
        return Box(super().forward(x))


def _boxed_output(rank, world):
    """find_unused_parameters=True with the output's tensors inside a plain object: refused, as
    by torch's DDP (whose error blames parameters used outside the forward); the error says where
    the wrapper looks for the output's tensors."""
    import fusedist

    ddp = fusedist.DistributedDataParallel(BoxedNet(), find_unused_parameters=True)
    try:
        ddp(torch.randn(3, 4)).logits.sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return "trained"


class _Around(nn.Module):
    """A module around the wrapped one (its Parameters), with a buffer of its own."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x):
        return self.inner(x) * self.scale


def _module_swapped(rank, world):
    """``model.module = other`` after wrapping: torch's DDP trains the new Parameters on each rank's
    gradients (the ranks drift apart); fusedist refuses a module of other Parameters at the assignment
    and takes one around the same Parameters, training as one process on the global batch (its own
    buffer broadcast from rank 0, as the module's)."""
    import copy

    import fusedist

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    batches = [torch.randn(6, 4, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    out = {}

    def train(model, rows=slice(3 * rank, 3 * rank + 3)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in batches:
            model(x[rows]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def ranks_equal(flat):
        everyone = [torch.empty_like(flat) for _ in range(world)]
        torch.distributed.all_gather(everyone, flat)
        return all(torch.equal(everyone[0], f) for f in everyone)

    theirs = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    theirs.module = copy.deepcopy(theirs.module)
    out["torch ranks equal"] = ranks_equal(train(theirs))
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base))
    try:
        ours.module = copy.deepcopy(ours.module)
        out["refused"] = "taken"
    except ValueError as exc:
        out["refused"] = str(exc)
    ours = fusedist.DistributedDataParallel(copy.deepcopy(base))
    ours.module = _Around(ours.module)
    ours.module.scale.fill_(1.0 + rank)  # rank 0's value is the model's
    flat = train(ours)
    out["ours ranks equal"] = ranks_equal(flat)
    out["error"] = (flat - train(_Around(copy.deepcopy(base)), rows=slice(None))).abs().max().item()
    return out


def test_wrapped_module_replaced_by_other_parameters_is_refused(shared_launch):
    for out in results_of(shared_launch, "module swapped"):
        assert not out["torch ranks equal"]  # (why it is refused)
        msg = out["refused"]
        assert "model.module was replaced after wrapping by a Sequential" in msg, msg
        assert "4 parameter(s) the wrapper was not built with: ['0.weight'" in msg, msg
        assert "4 of the wrapped parameters missing" in msg and "torch.compile(model.module)" in msg, msg
        assert out["ours ranks equal"] and out["error"] < 1e-6, out


@pytest.fixture(scope="module")
def shared_launch(request):
    return launch_for_selected(request, {
        "test_memory_format_changed_after_wrapping_trains_as_one_process": {"format": (_memory_format, ())},
        "test_submodule_removed_after_wrapping_is_refused_naming_it": {"removed": (_removed_submodules, ())},
        "test_step_over_parameter_added_after_wrapping_says_so": {"added": (_added_after_wrapping, ())},
        "test_output_in_an_unsearched_object_says_where_tensors_are_found": {"boxed": (_boxed_output, ())},
        "test_submodule_inserted_into_a_container_is_refused_naming_it": {"inserted": (_inserted_submodules, ())},
        "test_submodule_written_into_modules_directly_is_refused_naming_it": {
            "written": (_written_submodules, ())},
        "test_messages_name_parameters_by_their_current_paths": {"current names": (_current_names, ())},
        "test_wrapped_module_replaced_by_other_parameters_is_refused": {"module swapped": (_module_swapped, ())},
    }, world=2, timeout=180)


def test_memory_format_changed_after_wrapping_trains_as_one_process(shared_launch):
    for out in results_of(shared_launch, "format"):
        for (convert_at, accumulate, as_view), (error, warned) in out.items():
            case = f"converted at step {convert_at}, no_sync={accumulate}, gradient_as_bucket_view={as_view}"
            # fp32, 4 SGD steps: the averages differ from the one-process sum by rounding only
            assert error < 1e-5, (case, error)
            # the copies between layouts are reported once, only where the layout was already final
            assert len(warned) == (1 if convert_at > 0 else 0), (case, warned)
            if warned:
                assert "'conv.weight'" in warned[0] or "'head.weight'" in warned[0], warned


def test_submodule_removed_after_wrapping_is_refused_naming_it(shared_launch):
    for out in results_of(shared_launch, "removed"):
        for find_unused in (False, True):
            for case in ("identity", "none"):
                (msg,) = out[case, find_unused]
                assert "removed with the submodule(s) ['fc']" in msg and "'fc.weight', 'fc.bias'" in msg, msg
            (msg,) = out["other names", find_unused]
            assert "added: ['fc.0.weight', 'fc.0.bias']" in msg and "'fc.weight', 'fc.bias'" in msg, msg
            ours, torch_ddp = out["same parameters", find_unused]
            assert not isinstance(ours, str), ours  # the same Parameters under other names train on
            for a, b in zip(ours, torch_ddp):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        for setting in (False, "static_graph"):  # the unused-parameter and the changed-graph errors
            (msg,) = out["deleted", setting]
            assert "no longer in the module: ['fc.weight', 'fc.bias']" in msg, (setting, msg)
        ours, torch_ddp = out["deleted", True]  # unused parameters, reduced as zeros: nothing changes
        assert not isinstance(ours, str), ours
        for a, b in zip(ours, torch_ddp):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_step_over_parameter_added_after_wrapping_says_so(shared_launch):
    for out in results_of(shared_launch, "added"):
        assert "'extra.weight'" in out["added"] and "was added" in out["added"], out["added"]
        assert "'fc.weight'" in out["replaced"] and "replaced by a new Parameter" in out["replaced"], out["replaced"]
        for msg in out.values():
            assert "requires_grad=False" not in msg and "wrap the module again" in msg, msg


def test_output_in_an_unsearched_object_says_where_tensors_are_found(shared_launch):
    for msg in results_of(shared_launch, "boxed"):
        assert "'a.weight'" in msg and "tuples, lists, dicts, namedtuples and dataclasses" in msg, msg


def test_submodule_inserted_into_a_container_is_refused_naming_it(shared_launch):
    for out in results_of(shared_launch, "inserted"):
        assert out["torch spread"] > 0  # torch's DDP: the inserted layer trains on local gradients
        expected = {"list": ("layers.0 (Linear)", "'layers.0.weight', 'layers.0.bias'"),
                    "sequential": ("head.1 (Linear)", "'head.1.weight', 'head.1.bias'"),
                    "insert and delete": ("layers.0 (Linear)", "'layers.0.weight', 'layers.0.bias'"),
                    "added container": ("more.0 (Linear)", "'more.0.weight', 'more.0.bias'")}
        for case, (module, params) in expected.items():
            msg = out[case]
            assert isinstance(msg, str), (case, "trained without an error")
            assert f"['{module}'] registered without torch's registration hook" in msg and params in msg, (case, msg)
            assert "replaced by new Parameter objects" not in msg, (case, msg)
        ours, reference = out["parameterless"], out["parameterless", "torch"]
        assert not isinstance(ours, str), ours
        for a, b in zip(ours, reference):  # fp32, 3 SGD steps of the same averaged gradients
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_submodule_written_into_modules_directly_is_refused_naming_it(shared_launch):
    for out in results_of(shared_launch, "written"):
        assert out["torch spread"] > 0  # torch's DDP: the written layer trains on local gradients
        expected = {"into the root": ("extra (Linear)", "'extra.weight', 'extra.bias'"),
                    "into a leaf": ("a.adapter (Linear)", "'a.adapter.weight', 'a.adapter.bias'"),
                    "replacing": ("fc (Linear)", "'fc.weight', 'fc.bias'")}
        for case, (module, params) in expected.items():
            msg = out[case]
            assert isinstance(msg, str), (case, "trained without an error")
            assert f"['{module}'] registered without torch's registration hook" in msg and params in msg, (case, msg)
            assert "module._modules[name] = ..." in msg and "before wrapping" in msg, (case, msg)
        msg = out["replicated"]
        assert isinstance(msg, str) and "fusedist.replicate(Adapted)" in msg, msg
        assert "['extra (Linear)'] registered without" in msg and "'extra.weight', 'extra.bias'" in msg, msg
        assert "before the first forward of the replicated Adapted" in msg and "Distributed" not in msg, msg
        ours, reference = out["parameterless"], out["parameterless", "torch"]
        assert not isinstance(ours, str), ours
        for a, b in zip(ours, reference):  # fp32, 3 SGD steps of the same averaged gradients
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_messages_name_parameters_by_their_current_paths(shared_launch):
    for out in results_of(shared_launch, "current names"):
        msg = out.pop("assigned")
        assert "replaced by new Parameter objects: ['layers.3.weight']" in msg, msg
        for case, (msg, names) in out.items():
            assert isinstance(msg, str), (case, "trained without an error")
            assert names == [f"layers.{3 if case == 'inserted' else 1}.{n}" for n in ("weight", "bias")], names
            assert all(f"'{n}'" in msg for n in names), (case, msg)
            assert "layers.2" not in msg, (case, msg)  # the skipped layer's name when wrapped
