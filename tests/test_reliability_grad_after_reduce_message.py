"""A gradient changed on one rank after DDP averaged it (code between backward() and step()):
the ranks ran the same steps and collectives, only their parameters differ, and the error
says so -- it names gradients or weights changed on some ranks, not rank-dependent control
flow (Note [parameters that differ after the same steps] in fusedist/reliability/step_check.py)."""

from fusedist.reliability.step_check import FIELDS, render_bounds

AFTER_REDUCE = "drifted apart after the reduce"
CONTROL_FLOW = "rank-dependent control flow"

# The two-rank case (a gradient edited on one rank after the average, under a torch and a fused
# optimizer): test_grad_changed_after_reduce_is_named_on_both_ranks, in the shared launch of
# test_reliability_parameter_digest_and_sparse_freeze.py.


def _bounds(differing: dict) -> list:
    """The reduced ``[max(v), max(-v)]`` of two ranks at the same point but for ``differing``."""
    k = len(FIELDS)
    high, low = [3] * k, [3] * k
    for field, (a, b) in differing.items():
        i = FIELDS.index(field)
        high[i], low[i] = max(a, b), min(a, b)
    return high + [-v for v in low]


def test_advice_without_details_follows_what_differs():
    """The verdict read without the all-gather (a rank left) gives the same advice by what
    differs: parameters alone -> changed after the reduce; a step count too -> control flow."""
    values = [3] * len(FIELDS)
    only_params = render_bounds(_bounds({"params": (11, 12)}), values, 0, {"buckets": 1}, None)
    assert AFTER_REDUCE in only_params and CONTROL_FLOW not in only_params
    skipped = render_bounds(_bounds({"sync_step": (3, 4), "params": (11, 12)}), values, 0, {"buckets": 1}, None)
    assert CONTROL_FLOW in skipped and AFTER_REDUCE not in skipped
    counted = render_bounds(_bounds({"optimizer_steps": (2, 3), "params": (11, 12)}), values, 0,
                            {"buckets": 1}, None)
    assert CONTROL_FLOW in counted and AFTER_REDUCE not in counted
