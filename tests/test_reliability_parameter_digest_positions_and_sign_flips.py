"""The parameter digest sees where each element lies (Note [a digest that sees positions] in
fusedist/reliability/param_check.py): swapped, moved and sign-flipped elements are found. (The
two-rank case, a weight swapped or sign-flipped on one rank named on every rank, is
test_swapped_or_sign_flipped_weight_on_one_rank_is_named_on_every_rank in the shared launch of
test_reliability_parameter_digest_and_sparse_freeze.py.)"""


import torch


def _reference_digest(t: torch.Tensor) -> int:
    """Note [a digest that sees positions] in Python integers, modulo 2**64."""
    from fusedist.reliability.param_check import CHUNK, _position_tables, _row_weight

    w, u, _, rows = _position_tables(torch.device("cpu"))
    w, u = w.tolist(), u.tolist()
    words = t.reshape(-1).view(torch.int64).tolist()
    total = 0
    for i, x in enumerate(words):
        c, k = divmod(i, CHUNK)
        total += _row_weight(c, rows) * (x * w[k] + (x >> 32) * u[k])
    return total % (1 << 64)


def _perturbed(t: torch.Tensor, gen: torch.Generator) -> dict:
    """Copies of ``t`` (2-D) with two elements swapped, two rows swapped, one row permuted and
    one element's sign flipped: the same multiset of values (but the last), other positions."""
    rows, cols = t.shape
    i, j = torch.randperm(t.numel(), generator=gen)[:2].tolist()
    swap = t.clone().view(-1)
    swap[i], swap[j] = t.view(-1)[j].item(), t.view(-1)[i].item()
    a, b = torch.randperm(rows, generator=gen)[:2].tolist()
    row_swap = t.clone()
    row_swap[[a, b]] = t[[b, a]]
    permuted = t.clone()
    permuted[a] = t[a][torch.roll(torch.arange(cols), 1)]
    flip = t.clone().view(-1)
    flip[2 * (i // 2) + 1] = -flip[2 * (i // 2) + 1]  # the upper half of a word: its top bit
    return {"swap": swap.view_as(t), "row swap": row_swap, "permuted row": permuted, "sign": flip.view_as(t)}


def test_parameter_digest_sees_swapped_moved_and_sign_flipped_elements():
    from fusedist.reliability.param_check import CHUNK, ParamDigest, tensor_digest

    gen = torch.Generator().manual_seed(7)
    cpu = torch.device("cpu")
    # (the largest spans a row of CHUNK words and a tail)
    for shape, dtype in (((6, 8), torch.float32), ((2 * CHUNK // 512 + 3, 512), torch.float32),
                         ((5, 12), torch.bfloat16), ((4, 6), torch.float64)):
        t = torch.randn(shape, generator=gen).to(dtype)
        before = ParamDigest([("bias", torch.randn(3, generator=gen)), ("weight", t)])
        reference = before.compute(cpu).item()
        for what, changed in _perturbed(t, gen).items():
            assert not torch.equal(changed, t), what
            after = ParamDigest([("bias", before.params[0]), ("weight", changed)]).compute(cpu).item()
            assert after != reference, (what, shape, dtype)
            assert tensor_digest(changed).item() != tensor_digest(t).item(), (what, shape, dtype)
        if dtype == torch.float32:
            assert tensor_digest(t).item() % (1 << 64) == _reference_digest(t)  # exact integer arithmetic
        # small parameters are weighed in one batch: the same digests as one by one
        many = [torch.randn(n, generator=gen) for n in (5, 8, 2, 300, 64)] + [t, flat_view(t)]
        digest = ParamDigest([(str(i), p) for i, p in enumerate(many)])
        digest.compute(cpu)
        assert digest.per_param.tolist() == [tensor_digest(p).item() for p in many]
        # the same bits, wherever they lie (a view into a flat buffer at an odd offset: ZeRO's)
        assert tensor_digest(flat_view(t)).item() == tensor_digest(t).item()


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` that is a view into a flat buffer at an odd offset."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype)
    flat[1:].copy_(t.reshape(-1))
    return flat[1:].view(t.shape)
