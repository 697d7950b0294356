"""Pieces the tensor-parallel ranks hold alike: a ``Replicate()`` parameter of a tensor-parallel
unit, or every parameter of a plain unit beside tensor-parallel ones.

Note [checking what is held alike]
----------------------------------
That every tensor-parallel rank holds the same gradient for these pieces is an assumption about
the model: it fails where a plain module sees a sequence-sharded activation (each rank its own
tokens: the gradient is a partial sum, which ``SequenceParallel`` would reduce), where the ranks
of a tensor-parallel group were fed different batches, or where dropout draws differ. FSDP2
does not check it: each rank clips by a norm of its own copy's gradient and the copies drift
apart silently. The clip carries each tensor-parallel rank's figure of each such piece in slots
of its own in the all-reduce it makes anyway (no extra collective), and raises on every rank --
all see the same figures -- naming the parameters whose figures disagree beyond what summation
order explains. The clip of order inf carries each rank's max of each such piece in its max
all-reduce alike, and the per-parameter norms (``parameter_grad_norms``, Lightning's
``grad_norm``; the clip of order 0 or below, which is taken from them) each rank's figure of
each in theirs: every path that reads these gradients' norms checks them the same way.
Layouts that cut a ``Replicate()`` parameter differently on each rank, or a GPU's
non-deterministic kernels, differ by rounding: a few ulps, or for a bf16 gradient with every
element one ulp off at most 2^-6 of the sum of squares (under 2%); a different batch, a dropout
mask or a partial sum differ by far more. A gradient that is rounding noise (the bias of
a layer before a normalization) may differ in any digit, and moves no norm: a disagreement below
a millionth of the norm's sum of ``|g|^p`` is none. The check reads the figures on the host: one
synchronization per clip, as torch's ``error_if_nonfinite`` costs.

Note [a non-finite gradient held alike on one rank]
---------------------------------------------------
The check leaves non-finite figures alone: an overflow is for the scaler to skip and for
``error_if_nonfinite`` to refuse. But the norm takes the first tensor-parallel rank's figure of
the pieces held alike (Note [one norm on every tensor-parallel rank] in holder.py), so an inf or a
NaN in such a gradient on another tensor-parallel rank only was dropped from the norm: the clip's
total and the per-parameter norms stayed finite on every rank, ``error_if_nonfinite`` raised
nowhere, and the rank clipped its inf by a finite coefficient. Over FSDP2's DTensor gradients the
same clip finds the total non-finite on every rank (it raises on all of them under
``error_if_nonfinite``). So where some tensor-parallel rank's figure of a piece held alike is NaN,
the norm (the total, or that parameter's norm) is NaN on every rank; where one is +inf (and none
NaN), +inf -- what the rank holding that gradient measures -- from the figures every rank holds
after the all-reduce (no collective more). A NaN of a max all-reduce travels by its flag (Note [a
NaN through a max all-reduce] in optim/grad_norms.py), which every rank's figure of a piece held
alike sets.
"""

from __future__ import annotations

import math

import torch

__all__ = ["check_held_alike", "held_alike_flags", "share_tensor_parallel_holder", "with_nonfinite_figures"]

#: relative disagreement of the tensor-parallel ranks' figures taken for different gradients
#: (Note [checking what is held alike]): rounding stays well below it
HELD_ALIKE_RTOL = 5e-2
#: a disagreement below this share of the norm's sum of ``|g|^p`` is not one
HELD_ALIKE_NEGLIGIBLE = 1e-6


def held_alike_flags(unit, indices) -> list:
    """Whether the tensor-parallel ranks hold the ``indices``-th parameters of ``unit`` alike
    (a plain parameter or a ``Replicate()`` one), for the holder's registration."""
    return [unit.tp[i] is None or unit.tp[i].replicated for i in indices]


def share_tensor_parallel_holder(modules: list) -> None:
    """Move the plain units under ``modules`` to the gradient holder of the tensor-parallel ones
    (Note [plain units beside tensor-parallel ones] in holder.py); nothing where they hold no or
    several tensor-parallel holders."""
    from .state import state_of

    states = (state_of(m) for member in modules for m in member.modules())
    units = list({id(st.unit): st.unit for st in states if st is not None and st.unit is not None}.values())
    tp_holders = {id(u.holder): u.holder for u in units if u.holder is not None and u.holder.tp is not None}
    if len(tp_holders) != 1:
        return
    holder = next(iter(tp_holders.values()))
    for u in units:
        h = u.holder
        if h is None or h is holder or h.tp is not None:
            continue
        if h.comm is not holder.comm or h.replicate is not holder.replicate:
            continue  # (another data-parallel group: not held alike with these)
        holder.register(u.sharded, [True] * len(u.sharded))
        u.holder = holder


def _figure_words(norm_type: float) -> str:
    """What a figure of ``check_held_alike`` is, for the message."""
    norm_type = float(norm_type)
    if norm_type == float("inf"):
        return "max |g|"
    if norm_type == -float("inf"):
        return "min |g| (negated)"
    return "counts of nonzero elements" if norm_type == 0.0 else "sums of |g|^p"


def with_nonfinite_figures(values: torch.Tensor, figures: torch.Tensor, dim=None) -> torch.Tensor:
    """``values`` (taken from the first tensor-parallel rank's figures), NaN where some rank's
    figure (of ``figures``, reduced over ``dim``: all of them by default) is NaN, else +inf where
    one is +inf (Note [a non-finite gradient held alike on one rank]); the same on every rank."""
    if figures.numel() == 0:
        return values
    nan = figures.isnan().any() if dim is None else figures.isnan().any(dim)
    inf = (figures == float("inf")).any() if dim is None else (figures == float("inf")).any(dim)
    return torch.where(nan, float("nan"), torch.where(inf, float("inf"), values))


def check_held_alike(figures: torch.Tensor, params: list, norm_type: float, total: torch.Tensor) -> None:
    """Raise where the tensor-parallel ranks' figures (row r: rank r's sums of ``|g|^p`` over the
    data-parallel group -- the max of ``|g|`` for ``p = inf``, the count of nonzeros for ``p = 0`` --
    one column per piece of ``params``, pieces they should hold alike) disagree by a share of
    ``total`` (the sum, or max, the norm is taken from) that moves the norm (Note [checking
    what is held alike]); the same figures, so the same verdict, on every
    rank."""
    if figures.numel() == 0:
        return
    size = figures.shape[0]
    *flat, whole = torch.cat([figures.reshape(-1), total.reshape(1).to(figures.dtype)]).tolist()  # (one sync)
    rows = [flat[r * len(params):(r + 1) * len(params)] for r in range(size)]
    first = rows[0]
    # (a gradient that is rounding noise -- a bias before a normalization -- may differ in any
    # digit where kernels are not deterministic, and moves no norm)
    floor = HELD_ALIKE_NEGLIGIBLE * abs(whole)
    bad = [j for j in range(len(first))
           if all(math.isfinite(row[j]) for row in rows)  # (non-finite: the scaler skips, error_if_nonfinite raises)
           and any(abs(row[j] - first[j]) > max(HELD_ALIKE_RTOL * max(abs(row[j]), abs(first[j])), floor)
                   for row in rows)]
    if not bad:
        return
    from .owners import owner_of
    from .param_view import param_name

    named = []
    for j in bad[:3]:
        owned = owner_of(params[j])
        unit = owned[0] if owned is not None else None
        where = "?" if unit is None else param_name(unit, owned[1], with_unit=True)
        if unit is not None and unit.tp_comm is None:
            where += ", a unit with no tensor-parallel parameters"
        figures_j = ", ".join(f"{row[j]:.6g} on tensor-parallel rank {r}" for r, row in enumerate(rows))
        named.append(f"{where} ({figures_j})")
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    raise RuntimeError(
        f"gradient norm of order {float(norm_type)}: the gradients of parameters every tensor-parallel rank "
        "should hold alike (a plain module or a Replicate() parameter) differ between the ranks of a "
        f"tensor-parallel group; their {_figure_words(norm_type)} over the data-parallel group: "
        f"{'; '.join(named)}{more}. "
        "Each rank would clip and update its own copy by its own gradient and the copies would drift apart. "
        "Give every rank of a tensor-parallel group the same batch (seed the data by the data-parallel rank), "
        "give a module outside the tensor-parallel plan replicated inputs (a norm on a sequence-sharded "
        "activation needs SequenceParallel, whose gradient is summed over the group), and the same dropout "
        "seed on the ranks of the group.")
