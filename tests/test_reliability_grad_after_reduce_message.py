"""A gradient changed on one rank after DDP averaged it (code between backward() and step()):
the ranks ran the same steps and collectives, only their parameters differ, and the error
says so -- it names gradients or weights changed on some ranks, not rank-dependent control
flow (Note [parameters that differ after the same steps] in fusedist/reliability/step_check_text.py)."""

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


def test_fields_without_details_say_what_differs_in_their_own_words():
    """The modes digest and the loss scale's bits are not shown as integer ranges (which say
    nothing), and their advice is not about control flow."""
    import struct

    def bits(scale):
        return struct.unpack("<I", struct.pack("<f", scale))[0]

    values = [3] * len(FIELDS)
    values[FIELDS.index("loss_scale")] = bits(1024.0)
    modes = render_bounds(_bounds({"modes": (11, 12)}), values, 0, {"buckets": 1}, None)
    assert "  modes: the ranks' modules ran in different train/eval modes -- " in modes, modes
    assert CONTROL_FLOW not in modes and "range" not in modes, modes
    scale = render_bounds(_bounds({"loss_scale": (bits(1024.0), bits(65536.0))}), values, 0, {"buckets": 1}, None)
    assert "  loss_scale: ranks range from 1024.0 to 65536.0 (rank 0: 1024.0) -- " in scale, scale
    assert CONTROL_FLOW not in scale, scale
