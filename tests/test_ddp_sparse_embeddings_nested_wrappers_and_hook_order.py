"""fusedist.DistributedDataParallel against torch's DDP where a model uses sparse gradients
(Note [sparse gradients] in fusedist/ddp/sparse.py; a complex weight's, against torch's DDP on
its real twin: torch's DDP cannot reduce a complex sparse gradient on gloo), where the user's
gradient hooks change after wrapping or step an optimizer inside backward (Note [the user's
gradient hooks first] in fusedist/ddp/grad_hook.py), where a wrapper is nested inside another
(Note [a module wrapped again] in fusedist/ddp/wrapper.py) or inside torch's DDP (Note [torch's DDP
over a fusedist wrapper] in fusedist/ddp/torch_wrap.py), and where a Parameter or submodule is
assigned into a wrapped module inside a compiled function (Note [assignments inside a compiled
function] in fusedist/ddp/compiled_assignments.py). 2 gloo ranks.
The two-rank scenarios share one launch of the ranks (``launched``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.utils.hooks import RemovableHandle

import fusedist
import models
import test_ddp_module_changes_and_memory_format as module_changes
from shared_rank_launch import launch_for_selected, results_of


class _SparseNet(nn.Module):
    def __init__(self, dense: bool = True):
        super().__init__()
        self.emb = nn.Embedding(20, 6, sparse=True)
        self.bag = nn.EmbeddingBag(15, 6, sparse=True, mode="sum")
        self.lin = nn.Linear(6, 3) if dense else nn.Identity()

    def forward(self, ids, bag_ids):
        return self.lin(self.emb(ids).mean(1) + self.bag(bag_ids))


def _dense(grad):
    return None if grad is None else grad.to_dense().clone()


def _train_sparse(wrap, rank, dense: bool = True, freeze: bool = False):
    """Three SGD steps, the second with a no_sync backward before it; per-step gradients (dense).
    ``dense=False``: every trainable weight has sparse gradients; ``freeze``: the dense layer is
    frozen for the third step (find_unused_parameters=True)."""
    torch.manual_seed(0)
    net = _SparseNet(dense)
    model = wrap(net, find_unused_parameters=freeze)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    grads = []
    for step in range(3):
        if freeze:
            net.lin.requires_grad_(step != 2)
        gen = torch.Generator().manual_seed(100 * step + rank)
        ids, bag = torch.randint(0, 20, (4, 3), generator=gen), torch.randint(0, 15, (4, 2), generator=gen)
        if step == 1:
            with model.no_sync():
                model(ids, bag).pow(2).mean().backward()
        model(ids, bag).pow(2).mean().backward()
        grads.append([_dense(p.grad) for p in net.parameters()])
        opt.step()
        opt.zero_grad()
    return grads, [p.detach().clone() for p in net.parameters()]


class _GatherRows(nn.Embedding):
    """Rows of a complex weight by ``torch.gather(sparse_grad=True)`` (``F.embedding`` has no
    complex backward), or of its real twin (the real pairs side by side) viewed as complex."""

    def forward(self, ids):
        rows = torch.gather(self.weight, 0, ids[:, None].expand(-1, self.weight.shape[1]), sparse_grad=True)
        return rows if rows.is_complex() else torch.view_as_complex(rows.view(len(ids), rows.shape[1] // 2, 2))


def _train_complex_sparse(wrap, rank, complex_weight: bool):
    """Three SGD steps of a complex weight with sparse gradients, or of its real twin (torch's DDP
    cannot all-reduce a complex sparse gradient on gloo: "Invalid scalar type"); the second step
    accumulates a no_sync backward, and rank 1 has no rows in the third. Gradients and weights as
    real pairs."""
    torch.manual_seed(0)
    start = torch.randn(20, 3, dtype=torch.complex64)
    weight = start if complex_weight else torch.view_as_real(start).view(20, 6)
    net = _GatherRows(20, weight.shape[1], sparse=True, _weight=weight)
    model = wrap(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    grads = []
    for step in range(3):
        gen = torch.Generator().manual_seed(100 * step + rank)
        ids = torch.randint(0, 20, (0 if step == 2 and rank == 1 else 5,), generator=gen)
        if step == 1:
            with model.no_sync():
                model(ids * 0 + 7).abs().pow(2).sum().backward()
        model(ids).abs().pow(2).sum().backward()
        grads.append([_real_pairs(_dense(net.weight.grad))])
        opt.step()
        opt.zero_grad()
    return grads, [_real_pairs(net.weight.detach())]


def _real_pairs(t):
    return torch.view_as_real(t).reshape(len(t), -1) if t is not None and t.is_complex() else t


def _sparse_worker(rank, world_size):
    out = {"torch": _train_sparse(torch.nn.parallel.DistributedDataParallel, rank),
           "fusedist": _train_sparse(fusedist.DistributedDataParallel, rank),
           "torch, sparse only": _train_sparse(torch.nn.parallel.DistributedDataParallel, rank, dense=False),
           "fusedist, sparse only": _train_sparse(fusedist.DistributedDataParallel, rank, dense=False),
           "torch, frozen": _train_sparse(torch.nn.parallel.DistributedDataParallel, rank, freeze=True),
           "fusedist, frozen": _train_sparse(fusedist.DistributedDataParallel, rank, freeze=True),
           "torch, real twin": _train_complex_sparse(torch.nn.parallel.DistributedDataParallel, rank, False),
           "fusedist, complex": _train_complex_sparse(fusedist.DistributedDataParallel, rank, True)}
    model = fusedist.DistributedDataParallel(_SparseNet())
    out["join"] = models.error_text(lambda: model.join().__enter__(), RuntimeError)
    return out


def _sparse_compiled_worker(rank, world_size):
    """Compiled as a whole, the wrapper's outputs are not hooked: refused, not left local."""
    compiled = torch.compile(fusedist.DistributedDataParallel(_SparseNet()), backend="eager")
    return models.error_text(lambda: compiled(torch.tensor([[1, 2]]), torch.tensor([[3, 4]])), RuntimeError)


def test_sparse_embedding_gradients_are_averaged_as_torch_ddp_does(launched):
    for rank, out in enumerate(results_of(launched, "sparse")):
        models.assert_same_steps(out["torch"], out["fusedist"])
        models.assert_same_steps(out["torch, sparse only"], out["fusedist, sparse only"])
        models.assert_same_steps(out["torch, frozen"], out["fusedist, frozen"])
        models.assert_same_steps(out["torch, real twin"], out["fusedist, complex"])
        text = out["join"]
        assert text is not None and f"rank {rank}" in text and "'emb.weight'" in text, text


def test_sparse_gradients_under_compile_of_the_wrapper_are_refused(launched):
    for rank, text in enumerate(results_of(launched, "sparse compiled")):
        assert text is not None and f"rank {rank}" in text and "'emb.weight'" in text, text


def _scale(p):
    p.grad.mul_(3.0)


def _noop(p):
    pass


def _run_swapped_hook(wrap, rank):
    """A hook registered before wrapping is removed after it and another one registered (the
    same number of hooks): the new one's change is part of what is averaged, as with torch's."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    old = [p.register_post_accumulate_grad_hook(_noop) for p in net.parameters()]
    model = wrap(net)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()  # one step with the old hooks: the order was checked
    for p in net.parameters():
        p.grad = None
    for handle in old:
        handle.remove()
    for p in net.parameters():
        p.register_post_accumulate_grad_hook(_scale)
    model(x).sum().backward()
    return [p.grad.clone() for p in net.parameters()]


def _swapped_hook_worker(rank, world_size):
    out = {"torch": _run_swapped_hook(torch.nn.parallel.DistributedDataParallel, rank),
           "fusedist": _run_swapped_hook(fusedist.DistributedDataParallel, rank)}
    # nothing registered since the last forward: the next one checks the order at no per-parameter cost
    model = fusedist.DistributedDataParallel(nn.Linear(3, 2))
    model(torch.randn(2, 3)).sum().backward()
    out["mark current"] = model.reducer._hooks_ordered == RemovableHandle.next_id
    out["optimizer in backward"] = models.error_text(lambda: _optimizer_in_backward(rank), RuntimeError)
    out["first backward"] = models.error_text(lambda: _optimizer_in_backward(rank, first=True), RuntimeError)
    return out


def _optimizer_in_backward(rank, first=False):
    """A step, then an optimizer per parameter stepped (and zeroed) from a post-accumulate-grad
    hook: the hook runs before the average, so the step would use the local gradient. ``first``:
    the hooks step in the very first backward (the step guard speaks; it said "before any
    backward pass")."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model = fusedist.DistributedDataParallel(net)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    if not first:
        model(x).sum().backward()
    opts = {p: torch.optim.SGD([p], lr=0.1) for p in net.parameters()}

    def step(p):
        opts[p].step()
        opts[p].zero_grad()

    for p in net.parameters():
        p.register_post_accumulate_grad_hook(step)
    model(x).sum().backward()


def test_hook_swapped_after_wrapping_is_averaged_as_torch_ddp_does(launched):
    for out in results_of(launched, "swapped hook"):
        for want, got in zip(out["torch"], out["fusedist"]):
            torch.testing.assert_close(got, want)
        assert out["mark current"]
        text = out["optimizer in backward"]
        assert text is not None and "'1.bias'" in text and "optimizer.step() after loss.backward()" in text, text
        text = out["first backward"]
        assert text is not None and "from inside a backward pass" in text and "after loss.backward()" in text, text


def _train_nested(wrap, rank, double: bool, outer=None):
    """A wrapper nested inside another (``DDP(Sequential(DDP(a), tanh, b))``, or ``DDP(DDP(m))``;
    ``outer`` wraps the outside when given): three SGD steps with momentum; per-step gradients and
    the final weights."""
    outer = outer or wrap
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    if double:
        model = outer(wrap(net))
    else:
        net[0] = wrap(net[0])
        model = outer(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for step in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).pow(2).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return (grads, [p.detach().clone() for p in model.parameters()]), sorted(get_model_state_dict(model))


def _nested_worker(rank, world_size):
    torch_ddp = torch.nn.parallel.DistributedDataParallel
    return {double: (_train_nested(torch_ddp, rank, double),
                     _train_nested(fusedist.DistributedDataParallel, rank, double)) for double in (False, True)}


def test_wrapper_nested_inside_another_trains_as_torch_ddp(launched):
    for out in results_of(launched, "nested"):
        for (want, want_names), (got, got_names) in out.values():
            models.assert_same_steps(want, got)
            assert got_names == want_names  # checkpoint names: every wrapper's "module." dropped


def _torch_and_fusedist_worker(rank, world_size):
    """torch's DDP built over a fusedist wrapper (``TorchDDP(DDP(m))``, ``TorchDDP(Sequential(DDP(a),
    tanh, b))``), over the module of one (``TorchDDP(m)`` after ``DDP(m)``), and inside one
    (``DDP(TorchDDP(m))``, ``DDP(Sequential(TorchDDP(a), tanh, b))``): against torch's DDP alone
    (Note [torch's DDP over a fusedist wrapper], Note [torch's DDP inside a fusedist wrapper] in
    fusedist/ddp/torch_wrap.py)."""
    torch_ddp, ours = torch.nn.parallel.DistributedDataParallel, fusedist.DistributedDataParallel
    out = {}
    for double in (False, True):
        want = _train_nested(torch_ddp, rank, double)[0]
        out["torch over fusedist", double] = (want, _train_nested(ours, rank, double, outer=torch_ddp)[0])
        out["fusedist over torch", double] = (want, _train_nested(torch_ddp, rank, double, outer=ours)[0])
    out["fusedist over torch, unused"] = (
        _train_nested(lambda m: torch_ddp(m, find_unused_parameters=True), rank, True)[0],
        _train_nested(lambda m: torch_ddp(m, find_unused_parameters=True), rank, True, outer=ours)[0])
    refusals = []
    for inner in (lambda m: torch_ddp(m, static_graph=True), _with_fp16_hook):
        refusals.append(models.error_text(lambda: ours(nn.Sequential(inner(nn.Linear(2, 2)))), RuntimeError))
    torch.manual_seed(0)
    wrapper = ours(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)))
    out["torch over the module"] = (_train_nested(torch_ddp, rank, True, outer=lambda m: m)[0],
                                    _train_nested(lambda m: wrapper.module, rank, True, outer=torch_ddp)[0])
    forward = models.error_text(lambda: wrapper(torch.randn(2, 4)), RuntimeError)
    return out, forward, refusals


def _with_fp16_hook(module):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    wrapped = torch.nn.parallel.DistributedDataParallel(module)
    wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return wrapped


def test_torch_ddp_and_a_fusedist_wrapper_nested_train_as_torch_ddp_alone(launched):
    for rank, (out, forward, refusals) in enumerate(results_of(launched, "torch and fusedist")):
        for case, (want, got) in out.items():
            try:
                models.assert_same_steps(want, got)
            except AssertionError as error:
                raise AssertionError(f"rank {rank}, {case}: {error}") from None
        assert forward is not None and f"DistributedDataParallel (rank {rank}): this wrapper no longer reduces" \
            in forward and "torch's DistributedDataParallel wrapped its module (of type Sequential)" in forward, forward
        for text, why in zip(refusals, ("with static_graph=True", "with a communication hook registered")):
            assert text is not None and f"(rank {rank}): the module holds torch's DistributedDataParallel at '0' " \
                f"{why}" in text, text


def _assign_compiled(path: str, make):
    """A change that assigns ``make(module)`` to ``module.<path>`` inside a compiled function."""
    owner_path, _, name = path.rpartition(".")

    def change(module):
        value = make(module)
        owner = module.get_submodule(owner_path)

        @torch.compile(backend="eager", fullgraph=True)
        def assign(owner, x):
            setattr(owner, name, value)
            return x + 1

        assign(owner, torch.zeros(1))
    return change


def _assigned_in_compiled(rank, world):
    """Note [assignments inside a compiled function] in fusedist/ddp/compiled_assignments.py (after the
    sparse scenario's compile: dynamo is warm)."""
    torch._dynamo.reset()
    out = {}
    cases = {("parameter", True): ("fc.weight", lambda m: nn.Parameter(torch.ones(2, 4))),  # trained silently
             ("parameter", False): ("fc.weight", lambda m: nn.Parameter(torch.ones(2, 4))),  # "a submodule deleted"
             ("other names", False): (".fc", lambda m: nn.Sequential(nn.Linear(4, 2))),
             ("identity", True): (".fc", lambda m: nn.Identity()),
             ("set to None", False): ("fc.bias", lambda m: None)}  # (no registration hook runs, eager or traced)
    for (case, find_unused), (path, make) in cases.items():
        ddp = fusedist.DistributedDataParallel(module_changes.Net(), find_unused_parameters=find_unused)
        torch.manual_seed(100 + rank)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
        out[case, find_unused] = module_changes._steps(ddp, optimizer, rank, _assign_compiled(path, make))
    # torch's DDP over the same change: the new Parameter trains on each rank's own gradient
    ddp = nn.parallel.DistributedDataParallel(module_changes.Net(), find_unused_parameters=True)
    _assign_compiled("fc.weight", lambda m: nn.Parameter(torch.ones(2, 4)))(ddp.module)
    out["torch spread"] = module_changes._local_grad_spread(rank, world, ddp, ddp.module.fc.weight)
    return out


def test_assignment_inside_a_compiled_function_is_refused_naming_it(launched):
    for rank, out in enumerate(results_of(launched, "assigned while compiled")):
        assert out.pop("torch spread") > 0  # torch's DDP trains the new Parameter unsynchronized, silently
        none = out.pop(("set to None", False))
        assert isinstance(none, str) and f"(rank {rank}): 1 parameter(s) of the model as it was wrapped were set to " \
            "None after wrapping, which runs no registration hook (module.fc.bias = None, eagerly or inside a " \
            "torch.compile'd function): ['fc.bias']" in none and "deleted" not in none, none
        for (case, find_unused), text in out.items():
            assert isinstance(text, str), (case, find_unused, "trained on")
            assert f"(rank {rank}): parameters of the wrapped module were assigned after it was wrapped, inside a " \
                "torch.compile'd function" in text, (case, find_unused, text)
            named = {"parameter": "replaced by new Parameter objects: ['fc.weight']",
                     "other names": "added: ['fc.0.weight', 'fc.0.bias']",
                     "identity": "removed with the submodule(s) ['fc'] replaced or set to None: "
                                 "['fc.weight', 'fc.bias']"}
            assert named[case] in text, (case, find_unused, text)


# ---------------------------------------------------------------- the shared launch
@pytest.fixture(scope="module")
def launched(request):
    # (the compiled scenario last: nothing after it meets dynamo's caches)
    return launch_for_selected(request, {
        "test_sparse_embedding_gradients_are_averaged_as_torch_ddp_does": {"sparse": (_sparse_worker, ())},
        "test_hook_swapped_after_wrapping_is_averaged_as_torch_ddp_does": {"swapped hook": (_swapped_hook_worker, ())},
        "test_wrapper_nested_inside_another_trains_as_torch_ddp": {"nested": (_nested_worker, ())},
        "test_torch_ddp_and_a_fusedist_wrapper_nested_train_as_torch_ddp_alone": {
            "torch and fusedist": (_torch_and_fusedist_worker, ())},
        "test_sparse_gradients_under_compile_of_the_wrapper_are_refused": {
            "sparse compiled": (_sparse_compiled_worker, ())},
        "test_assignment_inside_a_compiled_function_is_refused_naming_it": {
            "assigned while compiled": (_assigned_in_compiled, ())},
    }, 2, timeout=300)
