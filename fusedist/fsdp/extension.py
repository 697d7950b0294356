"""Parameters that choose what is all-gathered: FSDP2's all-gather extension.

Note [all-gather extension]
---------------------------
torchao's float8 training keeps each Linear weight as a tensor subclass
(``WeightWithDynamicFloat8CastTensor``) over a high-precision tensor; with
``enable_fsdp_float8_all_gather`` the subclass tells FSDP2 what to gather in its place:
``fsdp_pre_all_gather`` turns this rank's shard into float8 bytes (and a scale, from the
amax all-reduced over the shard mesh), and ``fsdp_post_all_gather`` makes the gathered
bytes the unsharded parameter the matmul uses (a ``Float8TrainingTensor``). Half the gather
traffic of bf16, and the weight is cast once per gather instead of once per use.

A unit takes such a parameter when the subclass is a wrapper of *one* high-precision tensor
of its own shape and dtype (among the inner tensors ``__tensor_flatten__`` names; others, such
as a precomputed scale, are carried along: ``fusedist/_wrapper.py``): float8 training
weights, torchao's int8 mixed-precision and BitNet training weights. Then:

* The unit stores the inner tensor like any parameter's, in a section of its own laid out as
  FSDP2 lays out parameters (dim-0 chunks, each rank's chunk padded to chunk 0's rows: Note
  [dim-sharded sections] in chunk_layout.py), because the extension's contract is FSDP2's:
  every rank hands the all-gather inputs of the *padded* chunk's rows.
* The piece an optimizer steps is the subclass again, over the chunk on the shard storage
  (``ExtensionSpec.wrap``): the subclass unwraps in-place updates onto its inner tensor, so
  they land in the shard, and the parameter keeps its type at rest as under FSDP2.
* To gather, the unit calls ``fsdp_pre_all_gather`` on the piece, or where the rows do not
  divide evenly on the subclass over the padded chunk with the piece's attributes (FSDP2 calls
  it on the unpadded shard, which float8's does not pad, so FSDP2 refuses such shapes),
  lays every returned input of the section's parameters end to end as bytes, and runs one
  all-gather of those bytes (so inputs of several dtypes -- int8 data and fp32 scales -- go
  in one collective, and gloo, which has no float8 dtype, carries float8 too). Each input's
  rows from every rank are copied into an output of its own dtype (as FSDP2 does), and
  ``fsdp_post_all_gather`` makes them the unsharded parameter, viewed at the parameter's
  shape. The first gather creates that parameter; later ones refill its outputs in place
  and pass it back as ``out=`` -- the same object, so autograd's saved references stay
  valid across reshard and unshard. Resharding frees the outputs' storage.
* Gradients are plain tensors of the parameter's shape and reduce like any parameter's of
  the section; the pieces' ``.grad`` are plain too (FSDP2's are DTensors of plain tensors).
* With tensor parallelism (torchtitan's float8 with a column/row-wise plan) the wrapper is a
  DTensor's local tensor: the unit shards the local tensor's inner tensor (Note
  [tensor-parallel parameters] in tensor_parallel.py), gathers as above over the
  data-parallel mesh, and the modules hold a DTensor over the unsharded local parameter. The
  later gathers pass that DTensor as ``out=``, as FSDP2 does: a DTensor's local tensor is a
  view of the one it was made from, so refilling the latter would leave the former's scale
  stale.

With ``CPUOffloadPolicy`` the pieces live in host memory and each is moved to the compute
device before the extension is asked (FSDP2 does the same). Subclasses that hold several
inner tensors and none of the weight's shape -- quantized storage, NF4's -- are stored as
bytes instead (Note [quantized storage] in packed.py); the gathers here serve both. Refused
by name: an int ``reshard_after_forward`` (FSDP2 refuses it too), or a
``shard_placement_fn`` other than ``Shard(0)``. torchao's ``precompute_float8_dynamic_scale_for_fsdp`` looks for
DTensor weights and does nothing here; fusedist's (Note [precomputed float8 scales] in
float8.py) sets the scales on the pieces, which the gathers read.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Optional

import torch
from torch import nn

from .._wrapper import wrapped_name
from .layout import alias
from .memory import COUNTERS

__all__ = ["ExtensionGathers", "ExtensionSpec", "as_bytes", "extension_specs", "has_extension", "put_stand_ins",
           "take_stand_ins"]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements in order as a flat uint8 tensor (a view where ``t`` is contiguous). A
    contiguous tensor may carry any stride on a dim of size 1 -- NF4's ``quantization_factor``
    of a weight with one block of scales is ``(1,)`` with stride 256 -- which ``view(uint8)``
    refuses: the flat view is made with stride 1."""
    t = t.detach().contiguous()
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def has_extension(p) -> bool:
    """Whether ``p`` implements FSDP2's all-gather extension (either method)."""
    return hasattr(p, "fsdp_pre_all_gather") or hasattr(p, "fsdp_post_all_gather")


def _no_module() -> None:
    """The module of a spec detached from it (``packed_entry.detached_spec``)."""
    return None


class ExtensionSpec:
    """How a unit holds one extension parameter (Note [all-gather extension]): the subclass,
    the name of its inner tensor, and the context ``__tensor_unflatten__`` rebuilds it from."""

    packed = False  # quantized storage (packed.py) is held as bytes instead

    def __init__(self, param, module):
        self.ctx = param.__tensor_flatten__()[1]
        self.cls, self.name = type(param), wrapped_name(param)
        self.module = module
        fn = type(param).fsdp_pre_all_gather
        self.full_signature = len(inspect.signature(fn).parameters) == 6  # self + 5 (FSDP2's new form)
        #: the inputs' shapes and dtypes, fixed at the first gather
        self.inputs: Optional[list[tuple[torch.Size, torch.dtype]]] = None

    @property
    def module(self) -> Optional[nn.Module]:
        """The module holding the parameter, handed to ``fsdp_pre_all_gather``; None once freed."""
        return self._module_ref()

    @module.setter
    def module(self, module: Optional[nn.Module]) -> None:
        # weakly: it may be the module given to fully_shard, whose unit holds this spec (Note [a dropped
        # model freed at once] in state.py)
        self._module_ref = weakref.ref(module) if module is not None else _no_module

    def inner(self, p) -> torch.Tensor:
        """The high-precision tensor the subclass wraps (what the unit shards)."""
        return getattr(p, self.name)

    def wrap(self, inner: torch.Tensor, like=None) -> torch.Tensor:
        """The subclass over ``inner`` (same storage); ``like``: a piece whose context and
        attributes to keep (say, a scale set on it) -- over its padded chunk, what
        ``fsdp_pre_all_gather`` is asked where the rows do not divide evenly."""
        ctx = like.__tensor_flatten__()[1] if like is not None else self.ctx
        out = self.cls.__tensor_unflatten__({self.name: inner}, ctx, inner.size(), inner.stride())
        if like is not None:
            out.__dict__.update({k: v for k, v in like.__dict__.items() if k not in (self.name, "_is_param")})
        return out

    def set_inner(self, piece, inner: torch.Tensor) -> None:
        """Point ``piece`` (the subclass) at ``inner``: ``repack``'s ``piece.data = view``."""
        setattr(piece, self.name, inner)

    def pre_all_gather(self, source, mesh, whole_shape: tuple, mp_policy, fqn: str, padded_rows: int):
        """``(inputs, metadata)`` of ``source`` (the piece, or the subclass over its padded chunk), the inputs
        checked to keep the first gather's shapes and dtypes and, where the shards are padded
        (the rows do not divide evenly), to have the padded chunk's rows: FSDP2's contract,
        without which the gathered rows would not be the parameter's."""
        if self.full_signature:
            stride = torch.empty(whole_shape, device="meta").stride()
            inputs, meta = source.fsdp_pre_all_gather(mesh, torch.Size(whole_shape), stride, self.module, mp_policy)
        else:
            inputs, meta = source.fsdp_pre_all_gather(mesh)
        got = [(t.size(), t.dtype) for t in inputs]
        padded = padded_rows * mesh.size() != whole_shape[0]
        bad = [s for s, _ in got if padded and (len(s) == 0 or s[0] != padded_rows)]
        if bad:
            raise RuntimeError(
                f"fusedist.fully_shard: {self.cls.__name__}.fsdp_pre_all_gather of '{fqn}' returned inputs of shapes "
                f"{[tuple(s) for s, _ in got]}; its {whole_shape[0]} rows do not divide evenly over "
                f"{mesh.size()} ranks, "
                f"so each input must have the padded shard's {padded_rows} rows on dim 0 (FSDP2's contract), for "
                "the gathered rows to be the parameter's.")
        if self.inputs is None:
            self.inputs = got
        elif got != self.inputs:
            raise RuntimeError(
                f"fusedist.fully_shard: {self.cls.__name__}.fsdp_pre_all_gather of '{fqn}' returned "
                f"{[(tuple(s), d) for s, d in got]}, the first gather {[(tuple(s), d) for s, d in self.inputs]}; "
                "the gathered buffers are reused, so the inputs must keep their shapes and dtypes.")
        return inputs, meta


class ExtensionGathers:
    """The gathers of one unit's extension sections (Note [all-gather extension]): the bytes
    each rank sends, the outputs they are copied into, and the unsharded parameters
    ``fsdp_post_all_gather`` makes of them. The unit calls :meth:`start` where it starts its
    sections' gathers, :meth:`finish` where it copies its chunked sections out, and
    :meth:`free` where it frees its gathered buffers."""

    def __init__(self, unit, mesh, mp_policy):
        # weakly: the unit holds these gathers (Note [a dropped model freed at once] in state.py)
        self._unit_ref = weakref.ref(unit)
        self.mesh, self.mp_policy = mesh, mp_policy  # what fsdp_pre_all_gather is handed
        #: per parameter, once gathered: its outputs (flat, world size times each input) and the
        #: inner tensors fsdp_post_all_gather returned (their storage freed on reshard)
        self.outputs: dict[int, tuple[list, list]] = {}
        self.meta: dict[int, object] = {}  # the metadata of the gather in flight

    @property
    def unit(self):
        return self._unit_ref()

    def forget(self, i: int) -> None:
        """Parameter ``i``'s unsharded parameter is a placeholder again (``_new_full``): the next
        gather makes it anew."""
        self.outputs.pop(i, None)
        self.unit.ext[i].inputs = None

    def free(self) -> None:
        for outputs, inner in self.outputs.values():
            for t in outputs + inner:
                t.untyped_storage().resize_(0)

    @property
    def output_bytes(self) -> int:
        """Bytes of the outputs of the parameters gathered at least once (unknown before)."""
        return sum(t.numel() * t.element_size() for outputs, _ in self.outputs.values() for t in outputs)

    @torch.no_grad()
    def start(self, k: int, tag: str):
        """Start section ``k``'s gather: each parameter's ``fsdp_pre_all_gather`` (of its piece,
        or of the piece's padded chunk), every input laid end to end as bytes, one all-gather
        of them into ``unit.fulls[k]``. Returns (the bytes sent, handle)."""
        unit = self.unit
        sec = unit.layout.sections[k]
        parts = []
        for j, i in enumerate(sec.indices):
            spec, shape = unit.ext[i], sec.layout.slots[j].shape
            if spec.packed:  # the piece is the subclass's own chunk (Note [quantized storage] in packed.py)
                shape = spec.outer_shape
            rows = -(-shape[0] // unit.world_size)
            if unit.sharded[i].shape[0] == rows:  # the piece is the padded chunk: asked itself, as FSDP2 asks it
                source = unit.sharded[i]
            else:
                source = spec.wrap(alias(unit.shards[k], sec.layout.slots[j].offset, (rows,) + tuple(shape[1:])),
                                   like=unit.sharded[i])
            if source.device != unit.device:  # CPUOffloadPolicy: asked on the compute device, as FSDP2 asks
                source = spec.wrap(spec.inner(source).to(unit.device, non_blocking=True)) if spec.packed \
                    else source.to(unit.device, non_blocking=True)  # (quantized storage: its row, one copy)
            inputs, self.meta[i] = spec.pre_all_gather(source, self.mesh, shape, self.mp_policy, unit.fqns[i], rows)
            parts.extend(as_bytes(t) for t in inputs)
        send = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=unit.device)
        if send.device != unit.device:
            send = send.to(unit.device)
        needed = send.numel() * unit.world_size
        if unit.fulls[k].numel() != needed:
            unit.fulls[k] = torch.empty(needed, dtype=torch.uint8, device=unit.device)
        else:
            unit.fulls[k].untyped_storage().resize_(needed)
        # the bytes gathered, then the outputs they are copied into (the bytes are freed then)
        COUNTERS.add_gathered(2 * needed, unit)  # (the unit: its bytes leave the count if it is dropped gathered)
        unit._gathered_bytes += 2 * needed
        return send, unit.comm.all_gather(unit.fulls[k], send, async_op=True, tag=tag)

    @torch.no_grad()
    def finish(self, k: int) -> None:
        """Section ``k``'s gathered bytes into each input's output, and
        ``fsdp_post_all_gather``: the unsharded parameter made at the first gather, refilled in
        place (``out=``) at the later ones. The bytes are freed."""
        unit = self.unit
        sec = unit.layout.sections[k]
        gathered = unit.fulls[k]
        if not sec.indices or gathered.untyped_storage().nbytes() == 0:
            return
        gathered = gathered.view(unit.world_size, -1)
        offset = 0
        for j, i in enumerate(sec.indices):
            spec, shape = unit.ext[i], sec.layout.slots[j].shape
            held = self.outputs.get(i)
            if held is None:
                outputs = [torch.empty(unit.world_size * size.numel(), dtype=dtype, device=unit.device)
                           for size, dtype in spec.inputs]
            else:
                outputs, inner = held
                for t in outputs + inner:
                    if t.untyped_storage().nbytes() == 0:
                        t.untyped_storage().resize_((t.storage_offset() + t.numel()) * t.element_size())
            for out, (size, dtype) in zip(outputs, spec.inputs):
                nbytes = size.numel() * dtype.itemsize
                out.view(torch.uint8).view(unit.world_size, nbytes).copy_(gathered[:, offset:offset + nbytes])
                offset += nbytes
            views = tuple(out.view(-1, *size[1:]) for out, (size, _) in zip(outputs, spec.inputs))
            meta, param_dtype = self.meta.pop(i), unit.section_param_dtype(k)
            if held is not None:  # (out: what the modules hold, a DTensor over it with tensor parallelism, as FSDP2's)
                unit.sharded[i].fsdp_post_all_gather(views, meta, param_dtype, out=unit.visible[i])
                continue
            tensor, inner = unit.sharded[i].fsdp_post_all_gather(views, meta, param_dtype)
            if spec.packed:  # (the subclass of the parameter's shape; its table's slot is bytes)
                whole = tensor
            else:
                whole = torch.as_strided(tensor, shape, torch.empty(shape, device="meta").stride(), storage_offset=0)
            unit.unsharded[i] = unit.visible[i] = nn.Parameter(whole, requires_grad=unit.sharded[i].requires_grad)
            unit._make_visible(i)
            self.outputs[i] = (outputs, list(inner))
        nbytes = unit.fulls[k].numel()
        unit.fulls[k].untyped_storage().resize_(0)
        COUNTERS.add_gathered(-nbytes, unit)
        unit._gathered_bytes -= nbytes


def extension_specs(name: str, params: list, fqns: list, regs: list, dims: list, post_forward, world_size: int,
                    rank: int, tp: Optional[list] = None) -> Optional[list]:
    """Each parameter's spec (None for a plain one), or None when the unit has no extension
    parameter; what is not supported with them is refused naming the parameter. ``params``:
    the local tensors of tensor-parallel parameters (Note [tensor-parallel parameters] in
    tensor_parallel.py), which may be extension wrappers too."""
    from .packed import PackedSpec, is_packed_candidate  # (packed.py builds on ExtensionSpec)

    found = [(i, p) for i, p in enumerate(params) if has_extension(p)]
    if not found:
        return None
    for i, p in found:
        where = f"fusedist.fully_shard({name}): parameter '{fqns[i]}' ({type(p).__name__}) implements FSDP2's " \
                "all-gather extension"
        if not (hasattr(p, "fsdp_pre_all_gather") and hasattr(p, "fsdp_post_all_gather")):
            raise ValueError(f"{where} only in part: both fsdp_pre_all_gather and fsdp_post_all_gather must be "
                             "defined (FSDP2 requires both too)")
        if wrapped_name(p) is None and not is_packed_candidate(p):
            raise NotImplementedError(
                f"{where}, but it is neither a wrapper of one high-precision tensor of its own shape and dtype nor "
                "a traceable tensor subclass (__tensor_flatten__) fusedist could store as bytes. Use "
                "torch.distributed.fsdp.fully_shard for this model, or keep the parameter out of the units "
                "(ignored_params).")
        if wrapped_name(p) is None and tp is not None and tp[i] is not None:
            raise NotImplementedError(
                f"{where} and holds quantized storage (Note [quantized storage] in packed.py); with tensor "
                "parallelism such parameters are not supported. Use torch.distributed.fsdp.fully_shard for this "
                "model, or keep the parameter out of the units (ignored_params).")
        if p.dim() == 0:
            raise NotImplementedError(f"{where}, and it has no dims; fusedist shards such parameters on dim 0")
        arity = len(inspect.signature(type(p).fsdp_pre_all_gather).parameters)
        if arity not in (2, 6):
            raise TypeError(f"{where} with fsdp_pre_all_gather{inspect.signature(type(p).fsdp_pre_all_gather)}; FSDP2 "
                            "calls it as fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy) "
                            "or, in its older form, fsdp_pre_all_gather(self, mesh)")
        for reason, bad in (("reshard_after_forward as an int", post_forward is not None),
                            (f"shard_placement_fn's Shard({dims[i]})", dims[i] != 0)):
            if bad:
                raise NotImplementedError(f"{where}; with {reason} such parameters are not supported. Shard them on "
                                          "dim 0 of a data-parallel mesh, with reshard_after_forward True or False.")
    specs = []
    for i, p in enumerate(params):
        if not has_extension(p):
            specs.append(None)
        elif wrapped_name(p) is not None:
            specs.append(ExtensionSpec(p, regs[i][0][0]))
        else:  # Note [quantized storage] in packed.py
            where = f"fusedist.fully_shard({name}): parameter '{fqns[i]}' ({type(p).__name__})"
            specs.append(PackedSpec(p, regs[i][0][0], world_size, rank, where))
    return specs


# Note [converting extension pieces]
#     ``model.to(...)``, ``to_empty(...)`` (a model built on the meta device), ``double()``:
#     torch's ``Module._apply`` converts a tensor-subclass parameter by ``swap_tensors`` of the
#     old object with the converted one, always, and ``swap_tensors`` refuses a tensor with
#     weak references -- which every piece has (the registries of Note [conversions under
#     swap_module_params_on_conversion] in api.py). So while a sharded module converts, each
#     extension piece of its unit (and each one its unit borrows) is replaced on the modules by
#     a plain parameter over its inner tensor, converted as any plain piece is; afterwards the
#     piece takes the converted tensor back (``set_inner``) when it kept its device and dtype,
#     or is made anew over it (``wrap``, the same subclass and context) when it did not -- a
#     wrapper's device and dtype are fixed at its creation -- and ``repack`` adopts the new
#     piece as it adopts a plain one from the meta device. The borrowed ones get their owner's
#     piece back from ``relink_borrowed``.
def put_stand_ins(unit) -> list:
    """Replace ``unit``'s extension pieces on its modules by plain parameters over their inner
    tensors (Note [converting extension pieces]); returns ``(index, stand-in)`` pairs."""
    out = []
    for i, spec in enumerate(unit.ext):
        if spec is not None:
            piece = unit.sharded[i]
            stand = torch.nn.Parameter(spec.inner(piece).detach(), requires_grad=piece.requires_grad)
            for module, attr in unit.registrations[i]:
                module._parameters[attr] = stand
            out.append((i, stand))
    for owner, index, regs in unit.borrowed:
        spec = owner.ext[index]
        if spec is not None:
            piece = owner.sharded[index]
            stand = torch.nn.Parameter(spec.inner(piece).detach(), requires_grad=piece.requires_grad)
            for module, attr in regs:
                module._parameters[attr] = stand
    return out


def take_stand_ins(unit, stand_ins: list) -> None:
    """The pieces back on ``unit``'s modules over the converted stand-ins' tensors (Note
    [converting extension pieces])."""
    for i, _ in stand_ins:
        module, attr = unit.registrations[i][0]
        converted = module._parameters[attr].detach()
        piece, spec = unit.sharded[i], unit.ext[i]
        if converted.device == piece.device and converted.dtype == unit.piece_data(i).dtype:
            spec.set_inner(piece, converted)
        else:
            piece = torch.nn.Parameter(spec.wrap(converted, like=piece), requires_grad=piece.requires_grad)
        for module, attr in unit.registrations[i]:
            module._parameters[attr] = piece
