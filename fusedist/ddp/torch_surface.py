"""What torch's DDP does around its reducer that scripts rely on: inputs copied to the
``device_ids`` GPU, the legacy ``to_kwargs``/``scatter``/``gather`` helpers, parameters and
buffers marked rank-local, and the private names scripts call (``_register_builtin_comm_hook``,
``_get_ddp_logging_data``, ``_set_ddp_sink_clone``).
A mixin of :class:`~fusedist.ddp.wrapper.DistributedDataParallel`, kept apart from the gradient engine it wraps.

Note [inputs moved to the module's device]
    torch's DDP given ``device_ids=[i]`` copies the forward's tensor inputs (in args and
    kwargs, through lists, tuples, dicts and dataclasses) to ``cuda:i`` before the module
    runs, on a side stream unless PYTORCH_DDP_USE_SIDE_STREAM=0; scripts that feed it batches
    straight from a CPU DataLoader rely on that. The same helpers do it here, under the same
    condition: without ``device_ids`` (and on CPU) inputs go through as given.

Note [parameters and buffers DDP ignores]
    torch's ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module,
    names)`` marks parameters and buffers (by their names in ``module``) as rank-local state:
    DDP neither broadcasts nor compares them, and an ignored parameter's gradient is this
    rank's own, never averaged (sharded embedding tables, per-rank statistics, parameters
    another parallelism synchronizes). Code written for torch's DDP calls it before wrapping;
    the wrapper reads the same ``module._ddp_params_and_buffers_to_ignore`` and leaves those
    tensors out of the buckets, the construction broadcast and check, the buffer sync at
    forwards and the trainable-set tracking. The list itself must be the same on every rank.

Note [ignored entries followed by identity]
    The names are resolved once, at construction, into (submodule, attribute) slots, and the
    slots are what stays ignored: a ``ModuleList.insert`` or a deletion that renumbers the
    ignored entry keeps its parameters and buffers rank-local (not broadcast at join or at a
    forward, a Parameter assigned into it not refused), and the entry now under its old name
    is not ignored. torch's DDP resolves the parameters once too, but its buffer broadcast
    matches the names at every forward: after such a renumbering it broadcasts the ignored
    entry's buffers and leaves those now under the old names out. A copy of the wrapper
    (``copy.deepcopy``) ignores the copies of the same slots.

Note [torch's settings as attributes]
    torch's DDP keeps its constructor's settings as attributes that code reads back: the bucket
    caps in bytes (``bucket_bytes_cap``, ``bucket_bytes_cap_list``, ``bucket_bytes_cap_default``:
    whether the first bucket gets torch's smaller default cap), ``broadcast_bucket_size``,
    ``mixed_precision``, ``skip_all_reduce_unused_params``, ``batched_grad_copy`` and
    ``is_multi_device_module``. The wrapper holds the same values under the same names, computed
    as torch computes them, for the logging and configuration code that reads them. Setting one
    afterwards changes nothing, in torch's either: the buckets are cut from the constructor's
    arguments.

Note [the process group, held weakly]
    ``model.process_group`` is torch's attribute: the group given, or the default group itself when
    none was (torch's DDP stores ``dist.group.WORLD``, not None), the same object, to pass on to
    ZeroRedundancyOptimizer or to collectives. torch's DDP holds it strongly, and held so it outlived
    ``destroy_process_group()``: a model kept at module scope (or anywhere past the end of main) kept
    the destroyed gloo group alive into the interpreter's finalization, where freeing a gloo group can
    abort the finished process ("terminate called without an active exception"); the communicator
    already lets go of it (Note [a released communicator lets go of its group] in
    fusedist/comm/released_group.py). So the wrapper holds the group by a weak reference: it reads as
    torch's attribute while torch.distributed has the group, and None once the group was destroyed --
    freed, or still held by the program but no longer usable. A copy of a wrapper whose group was
    destroyed is refused (None would build the copy on whatever the default group is by then). The
    attribute is ``fusedist.comm.held_group.HeldProcessGroup``'s, which the ZeroRedundancyOptimizer shares.
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.utils import _to_kwargs
from torch.nn.parallel.scatter_gather import gather, scatter_kwargs

from ..comm.held_group import HeldProcessGroup
from .arguments import device_attributes
from .ddp_logger import DDPLogger
from .logging_data import DEFAULT_SAMPLE_RATE, check_sample_rate, ddp_logging_data

__all__ = ["TorchDDPSurface"]


class TorchDDPSurface(HeldProcessGroup):
    """torch DDP's input placement and rank-local state; the wrapper sets ``module``,
    ``device`` and ``dim`` and calls :meth:`_init_surface` before using the rest."""

    def _init_surface(self, module: nn.Module, device_ids, output_device=None) -> None:
        # torch's attributes: device_ids only when given for a single-device accelerator module
        self.device_type = self.device.type
        self.device_ids, self.output_device = device_attributes(self.device, device_ids, output_device)
        self.use_side_stream_for_tensor_copies = os.environ.get("PYTORCH_DDP_USE_SIDE_STREAM", "1") == "1"
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()) or ())
        self._ignored_slots = ignored_slots(module, self.parameters_to_ignore)
        self._synced_forwards = 0  # torch's iteration count (Note [torch's DDP logging data])
        self._logging_sample_rate = DEFAULT_SAMPLE_RATE
        self._joined_once = False
        self.logger = DDPLogger(self)  # torch's dist.Logger (Note [the model's logger] in ddp_logger.py)
        self._ddp_sink_clone = True  # torch's; nothing here clones outputs (:meth:`_set_ddp_sink_clone`)

    # ------------------------------------------------------------ Note [torch's settings as attributes]
    def _init_torch_settings(self, bucket_cap_mb, bucket_cap_mb_list, mixed_precision,
                             skip_all_reduce_unused_params, batched_grad_copy) -> None:
        """torch's attributes for its constructor's settings (after :meth:`_init_surface`)."""
        self.broadcast_bucket_size = TORCH_BROADCAST_BUCKET_BYTES
        self.bucket_bytes_cap, self.bucket_bytes_cap_list, self.bucket_bytes_cap_default = \
            torch_bucket_caps(bucket_cap_mb, bucket_cap_mb_list)
        self.mixed_precision = mixed_precision
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        self.is_multi_device_module = len({p.device for _, p in self.synced_parameters()}) > 1

    # ------------------------------------------------------------ Note [inputs moved to the module's device]
    def _inputs_on_device(self, args, kwargs) -> tuple:
        """``(args, kwargs)`` as the module gets them."""
        if not self.device_ids:
            return args, kwargs
        (args,), (kwargs,) = self.to_kwargs(args, kwargs, self.device_ids[0])
        return args, kwargs

    def to_kwargs(self, inputs, kwargs, device_id):
        """``inputs`` and ``kwargs`` with their tensors on ``device_id``, each wrapped in a
        1-tuple (torch's ``DistributedDataParallel.to_kwargs``)."""
        return _to_kwargs(inputs, kwargs, torch.device(self.device_type, device_id),
                          self.use_side_stream_for_tensor_copies)

    def scatter(self, inputs, kwargs, device_ids):
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def gather(self, outputs, output_device):
        return gather(outputs, output_device, dim=self.dim)

    # ------------------------------------------------------------ torch's private names
    def _register_fused_optim(self, optim: type, *args, optim_params=None, **kwargs) -> None:
        """torch's (private): ``optim`` (a torch optimizer class with a functional form: SGD, Adam,
        AdamW, ...; ``args``/``kwargs`` its hyperparameters) steps each bucket's parameters in
        backward, as soon as that bucket is averaged, through a communication hook, so no
        ``optimizer.step()`` follows; ``optim_params``: the parameters it steps (default all).
        It takes the model's one communication hook (Note [communication hooks] in comm_hook.py)."""
        nn.parallel.DistributedDataParallel._register_fused_optim(
            self, optim, *args, optim_params=optim_params, **kwargs)

    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        """torch's name for ``register_builtin_comm_hook`` (torch's DDP has only this private one,
        and its docs show ``ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)``)."""
        self.register_builtin_comm_hook(comm_hook_type)

    # torch's: the parameters of ``module`` that a DDP unit synchronizes (the ones its
    # ``_set_params_and_buffers_to_ignore_for_model`` marked ``_ddp_ignored`` left out)
    _get_data_parallel_params = staticmethod(nn.parallel.DistributedDataParallel._get_data_parallel_params)

    def _update_process_group(self, new_process_group) -> None:
        """torch's (private) way to move a DDP model onto another group (an elastic job's shrunk or
        grown world). Refused: the buckets, their communicator and the cross-rank checks are built
        for the construction's group, so wrap the module again on the new group."""
        raise RuntimeError(
            f"fusedist.DistributedDataParallel (rank {self.rank}): _update_process_group is not supported; the "
            "buckets, their communicator and the cross-rank checks are built for the group given at construction. "
            "Wrap the module again on the new group, DistributedDataParallel(model.module, process_group=new_group), "
            "on every rank of that group: the new wrapper takes the parameters over from this one"
        )

    def _get_ddp_logging_data(self) -> dict:
        """torch's DDP logging dict: settings, group, environment, buckets (Note [torch's DDP
        logging data] in logging_data.py)."""
        return ddp_logging_data(self)

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """torch's (private): whether its ``_DDPSink`` clones the forward's output tensors, which torch
        does so that an in-place change of the output (the loss) is allowed; False saves the copies.
        Accepted, kept in ``_ddp_sink_clone``: fusedist returns the module's outputs themselves (its
        backward hooks sit on their autograd nodes), never copies, and in-place changes of them work
        as on the plain module either way."""
        self._ddp_sink_clone = bool(val)

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """torch's: after the first 10 iterations, ``iteration`` is recorded every ``sample_rate``."""
        self._logging_sample_rate = check_sample_rate(sample_rate)

    # ------------------------------------------------------------ Note [parameters and buffers DDP ignores]
    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module, params_and_buffers_to_ignore) -> None:
        """torch's: mark ``params_and_buffers_to_ignore`` (names in ``module``) as not
        synchronized by DDP; call before wrapping."""
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            module, params_and_buffers_to_ignore)

    def ignores(self, module: nn.Module, key: str) -> bool:
        """Whether ``module``'s parameter or buffer ``key`` is rank-local (Note [ignored entries
        followed by identity])."""
        keys = self._ignored_slots.get(module) if self._ignored_slots and module is not None else None
        return keys is not None and key in keys

    def synced_parameters(self) -> list:
        """``(name, parameter)`` of the module's parameters DDP synchronizes."""
        return self._named("_parameters", ignored=False)

    def synced_buffers(self) -> list:
        """``(name, buffer)`` of the module's buffers DDP synchronizes."""
        return self._named("_buffers", ignored=False)

    def ignored_parameters(self) -> list:
        """``(name, parameter)`` of the rank-local parameters."""
        return self._named("_parameters", ignored=True) if self._ignored_slots else []

    def ignored_names(self) -> list:
        """The current paths of the ignored slots (a copy of the wrapper resolves these: Note
        [ignored entries followed by identity])."""
        if not self._ignored_slots:
            return []
        return [f"{prefix}.{key}" if prefix else key for prefix, m in self.module.named_modules()
                for key in sorted(self._ignored_slots.get(m, ()))]

    def _ignored_keys(self, module: nn.Module) -> frozenset:
        """The attribute names of ``module`` that DDP ignores."""
        return self._ignored_slots.get(module, frozenset()) if self._ignored_slots else frozenset()

    def _named(self, kind: str, ignored: bool) -> list:
        """``(current name, tensor)`` of the ``kind`` (``_parameters`` or ``_buffers``) tensors
        whose slot is (or is not) ignored; each tensor once, under its first name, as
        ``named_parameters()`` gives it (so a tied tensor is ignored as torch's DDP decides)."""
        slots = self._ignored_slots
        if not slots:
            named = self.module.named_parameters() if kind == "_parameters" else self.module.named_buffers()
            return [] if ignored else list(named)
        out, seen = [], set()
        for prefix, m in self.module.named_modules():
            keys = slots.get(m, ())
            for key, t in getattr(m, kind).items():
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                if (key in keys) == ignored:
                    out.append((f"{prefix}.{key}" if prefix else key, t))
        return out


TORCH_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024  # torch DDP's broadcast_bucket_size
TORCH_BUCKET_CAP_MB = 25


def torch_bucket_caps(bucket_cap_mb, bucket_cap_mb_list) -> tuple:
    """torch DDP's ``(bucket_bytes_cap, bucket_bytes_cap_list, bucket_bytes_cap_default)`` for
    these arguments: a list's largest cap is the cap, and only the default cap gives the first
    bucket torch's smaller one (Note [torch's settings as attributes])."""
    mib = 1024 * 1024
    caps = [int(cap * mib) for cap in bucket_cap_mb_list] if bucket_cap_mb_list else []
    default = bucket_cap_mb is None and not caps
    cap_mb = max(bucket_cap_mb_list) if caps else (TORCH_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb)
    cap = int(cap_mb * mib)
    first = dist._DEFAULT_FIRST_BUCKET_BYTES if default else cap
    return cap, caps, first < cap


def ignored_slots(module: nn.Module, names) -> "weakref.WeakKeyDictionary":
    """{submodule: the attribute names ignored in it} for ``names`` (paths in ``module``, a
    submodule reached by several paths under any of them); weak: a submodule removed from the
    model later is not kept alive (Note [ignored entries followed by identity])."""
    slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    if not names:
        return slots
    by_parent: dict = {}
    for name in names:
        parent, _, key = name.rpartition(".")
        by_parent.setdefault(parent, set()).add(key)
    for prefix, m in module.named_modules(remove_duplicate=False):
        keys = by_parent.get(prefix)
        if keys:
            slots[m] = frozenset(keys) | slots.get(m, frozenset())
    return slots
