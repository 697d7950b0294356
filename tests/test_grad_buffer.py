"""The gradient buffer on its own: bucket layout logic without a process group, and the one
re-bucketing rule (Note [layout fixed by a sharded consumer] in fusedist/ddp/rebucket.py)."""

import random

import torch
from torch import nn

from fusedist.ddp.layout import SHARD_ALIGN, append_buckets, build_layout

CPU = torch.device("cpu")


def _random_params(rng: random.Random, n: int) -> list:
    dtypes = [torch.float32, torch.bfloat16, torch.float64]
    return [nn.Parameter(torch.zeros(*[rng.randint(1, 9) for _ in range(rng.randint(1, 3))],
                                     dtype=rng.choice(dtypes))) for _ in range(n)]


def _torch_assignment(params, caps) -> list:
    """torch DDP's bucket assignment of ``params`` (indices per bucket), from its own function, in
    the order the buckets become ready (torch lists those left open at the end in no set order)."""
    buckets, _ = torch.distributed._compute_bucket_assignment_by_size(
        [p.detach() for p in params], caps, [False] * len(params), list(range(len(params))))
    return sorted((list(b) for b in buckets), key=max)


def _check_layout(layout, params, cap, first_cap, world_size):
    # Every parameter exactly once, in one bucket of its dtype, at its own offset.
    seen = [p for b in layout.buckets for p in b.params]
    assert len(seen) == len(params) and {id(p) for p in seen} == {id(p) for p in params}
    for b in layout.buckets:
        assert all(p.dtype == b.dtype for p in b.params)
        assert b.numel % (world_size * SHARD_ALIGN) == 0  # every rank's shard equal and aligned
        used = sum(p.numel() for p in b.params)
        assert used <= b.numel < used + world_size * SHARD_ALIGN  # padding under one alignment unit
        for p, off, nxt in zip(b.params, b.offsets, b.offsets[1:] + [b.start + used]):
            assert nxt - off == p.numel()
    # Per dtype: buckets are contiguous ranges of one flat buffer, in readiness order, each
    # closed once it reached its cap, the crossing parameter included (Note [buckets close as
    # torch's do]) -- exactly torch DDP's assignment.
    by_dtype: dict = {}
    for b in layout.buckets:
        by_dtype.setdefault(b.dtype, []).append(b)
    for dtype, buckets in by_dtype.items():
        assert buckets[0].start == 0
        assert all(a.end == b.start for a, b in zip(buckets, buckets[1:]))
        for k, a in enumerate(buckets[:-1]):
            size = sum(p.numel() for p in a.params) * a.params[0].element_size()
            before_last = size - a.params[-1].numel() * a.params[-1].element_size()
            assert size >= (first_cap if k == 0 else cap) > before_last
    # (numbered as they become ready, as torch's rebuilt buckets)
    index = {id(p): i for i, p in enumerate(params)}
    assert [[index[id(p)] for p in b.params] for b in layout.buckets] == _torch_assignment(params, [first_cap, cap])
    # Readiness order is kept within each dtype.
    for dtype in by_dtype:
        expected = [id(p) for p in params if p.dtype == dtype]
        assert [id(p) for b in by_dtype[dtype] for p in b.params] == expected


def test_layout_invariants_on_random_parameter_sets():
    rng = random.Random(torch.initial_seed() % 2**32)
    for trial in range(25):
        params = _random_params(rng, rng.randint(1, 40))
        names = [f"p{i}" for i in range(len(params))]
        cap, first_cap = rng.randint(16, 600), rng.randint(8, 300)
        world_size = rng.randint(1, 5)
        layout = build_layout(params, names, caps=[first_cap, cap], world_size=world_size, device=CPU)
        _check_layout(layout, params, cap, first_cap, world_size)
        # Gradient views alias the flat storage, shaped like their parameters.
        for p in params:
            view = layout.grad_view(p)
            assert view.shape == p.shape and view.dtype == p.dtype
            view.fill_(1.0)
        total = sum(t.count_nonzero().item() for t in {id(b.data): b.data for b in layout.buckets}.values())
        assert total == sum(p.numel() for p in params)
        # The same inputs give the same layout (ranks build identical ones independently).
        again = build_layout(params, names, caps=[first_cap, cap], world_size=world_size, device=CPU)
        assert again.fingerprint() == layout.fingerprint()


def test_appending_keeps_every_existing_bucket_in_place():
    rng = random.Random(1)
    params = _random_params(rng, 12)
    names = [f"p{i}" for i in range(12)]
    layout = build_layout(params[:8], names[:8], caps=[100, 200], world_size=2, device=CPU)
    grown = append_buckets(layout.buckets, params[8:], names[8:], bucket_cap_bytes=200, world_size=2)
    old = layout.buckets
    assert len(grown) > len(old)
    for a, b in zip(old, grown):
        assert (a.dtype, a.start, a.end, a.offsets) == (b.dtype, b.start, b.end, b.offsets)
        assert all(x is y for x, y in zip(a.params, b.params))
    assert {id(p) for b in grown[len(old):] for p in b.params} == {id(p) for p in params[8:]}


class _ReversedUse(nn.Module):
    """Uses its layers in the opposite order of registration, so gradients become ready in
    registration order: the observed order differs from the expected one."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x


def test_plain_engine_rebuckets_inside_itself_and_a_fixed_one_never_does():
    from test_ddp_overlap import _scripted_reducer

    torch.manual_seed(0)
    x = torch.randn(4, 8)
    plain_model, fixed_model = _ReversedUse(), _ReversedUse()
    fixed_model.load_state_dict(plain_model.state_dict())
    plain, _ = _scripted_reducer(plain_model)
    fixed, _ = _scripted_reducer(fixed_model)
    fixed.fix_layout()
    before_plain, before_fixed = plain.layout, fixed.layout
    assert before_plain.fingerprint() == before_fixed.fingerprint()
    for _ in range(2):
        plain_model(x).sum().backward()
        fixed_model(x).sum().backward()
    # The plain engine re-bucketed by the observed order; its gradients moved with it.
    assert plain.layout is not before_plain and plain.layout_final
    assert plain.layout.fingerprint() != before_plain.fingerprint()
    # The fixed engine kept its layout object: a consumer's shards of it stay valid.
    assert fixed.layout is before_fixed
    for p, q in zip(plain_model.parameters(), fixed_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
        assert p.grad.data_ptr() == plain.layout.grad_view(p).data_ptr()
