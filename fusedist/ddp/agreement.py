"""What every rank's ``fusedist.DistributedDataParallel`` must agree on, checked across ranks:
the model and the constructor's settings (at construction), the gradient reduction (at the
first synchronized forward) and the bucket layout (whenever it is built). Each check is one
small exchange and a ``RankMismatchError`` naming the difference on every rank, instead of
collectives that pair up wrongly later."""

from __future__ import annotations

from .._consistency import check_same_across_ranks
from ..reliability.settings_agreement import must_agree_readings
from .layout import slot_order

__all__ = ["check_layout_agrees", "check_model_agrees", "check_reduction_agrees"]


def check_model_agrees(ddp) -> None:
    """Parameters, buffers, the ignored names and the construction settings of ``ddp``."""
    # ignored tensors are rank-local (Note [parameters and buffers DDP ignores]); the list
    # comes first, so that a list differing between ranks is the difference named
    entries = [("setting", "params_and_buffers_to_ignore", tuple(sorted(ddp.parameters_to_ignore)), "", True)]
    entries += [("param", n, tuple(p.shape), str(p.dtype), p.requires_grad, slot_order(p))
                for n, p in ddp.synced_parameters()]
    entries += [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in ddp.synced_buffers()]
    entries += [("setting", name, value, "", True) for name, value in _construction_settings(ddp.config)]
    # (a group made by torch's init_process_group skipped init_distributed's check of these)
    entries += [("setting", name, value, "", True) for name, value in must_agree_readings()]
    check_same_across_ranks(
        entries,
        "the model (parameters and buffers)",  # and the settings: the entry names one
        label=_entry_label,
        comm=ddp.comm, op="DistributedDataParallel construction: model check",
        hint="Every rank must build the same model (in the same memory format) and wrap it in "
             "DistributedDataParallel with the same settings.",
    )


# Note [reduction settings across ranks]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Settings that decide which collectives a backward issues must be the same on every rank,
# or the ranks' collectives pair up with others of another kind or size: with
# find_unused_parameters on one rank only, one rank all-reduces its used-parameter map
# while the other reduces a bucket (a stall at the first backward); with an fp16 hook on
# one rank only, the ranks all-reduce buckets of different byte sizes, and gloo terminates
# the process ("Received data size doesn't match"). The construction check compares the
# constructor's settings with the model; a communication hook (or ZeRO stage 2's
# reduce-scatter) is set after construction, so the first synchronized training forward
# compares the reduction once more, before any bucket collective: one small exchange,
# once, and a RankMismatchError naming the setting on every rank.
def _construction_settings(c) -> list:
    return [("find_unused_parameters", bool(c.find_unused_parameters)), ("static_graph", bool(c.static_graph)),
            ("broadcast_buffers", bool(c.broadcast_buffers)),
            ("gradient_as_bucket_view", bool(c.gradient_as_bucket_view)),
            ("reduce_dtype", str(c.reduce_dtype))]


def check_reduction_agrees(ddp) -> None:
    """The communication hook, the reduction strategy (ZeRO stage 2's or the all-reduce) and
    the settings a backward's collectives depend on."""
    settings = [("communication hook", ddp._comm_hook or "none"),
                ("gradient reduction", ddp.reducer.strategy.description),
                ("reduce_dtype", str(ddp.config.reduce_dtype)),
                ("broadcast_buffers", bool(ddp.config.broadcast_buffers))]
    check_same_across_ranks(
        [("setting", name, value, "", True) for name, value in settings],
        "the gradient reduction of DistributedDataParallel", label=_entry_label,
        comm=ddp.comm, op="DistributedDataParallel: reduction settings check",
        hint="Register the same communication hook (or none) on every rank, and shard with the same "
             "ZeroRedundancyOptimizer stage, before the first training forward.",
    )


class LayoutAgreementCheck:
    """A wrapper's own listener for rebuilt bucket layouts (:func:`check_layout_agrees` over its
    communicator). It holds the communicator only, not the wrapper: held by the wrapper's engine,
    a bound method of the wrapper made the wrapper reach itself, so a wrapper the program dropped
    lived on until a garbage collection, whose timing differs from rank to rank (Note [a dropped
    wrapper goes at once] in wrapper.py)."""

    def __init__(self, comm):
        self.comm = comm

    def __call__(self, layout) -> None:
        check_layout_agrees(self.comm, layout)


def check_layout_agrees(comm, layout) -> None:
    """Every rank must bucket the gradients identically, or the bucket collectives pair
    up tensors of different sizes (a gloo error or an NCCL hang). Differences come from
    per-rank bucket_cap_mb / first_bucket_cap_mb / reduce settings."""
    if comm.world_size == 1:
        return
    check_same_across_ranks(
        layout.fingerprint(),
        "the gradient bucket layout",
        label=lambda b: f"bucket {b[0]} ({b[1]}, {b[2]} elements, params {[n for n, _ in b[3]][:4]}...)",
        comm=comm, op="DistributedDataParallel: bucket layout check",
        hint="Pass the same bucket_cap_mb, first_bucket_cap_mb and gradient_as_bucket_view on every rank.",
    )


def _entry_label(e) -> str:
    """How a check's entry reads in an error: a parameter, a buffer, a setting."""
    if e[0] == "setting":
        return f"{e[1]}={e[2]}"
    order = f" in the memory order of strides {e[5]}" if len(e) > 5 and e[5] else ""
    return f"{e[0]} '{e[1]}' shape {e[2]} dtype {e[3]}{order}" + ("" if e[4] or e[0] == "buffer" else " (frozen)")
