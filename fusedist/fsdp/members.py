"""What one ``fully_shard`` call shards: its modules (one, or the members of a list), the
modules under them that no earlier call took, and the parameters it refuses before anything
changes.

Note [a list of modules as one unit]
    ``fully_shard([model.norm, model.output])`` (torchtitan's grouping of the last layers; or
    ``[tok_embeddings, output]`` to keep a tied weight in one unit) makes one unit of the
    parameters of every listed module -- one flat buffer, one all-gather, one reduce-scatter --
    as torch's FSDP2 does. A listed module inside another listed one is part of the outer one
    (FSDP2 keeps the outermost too); one listed twice is refused, naming the items (FSDP2's second
    application to it fails). The members share one ``FullyShardState`` (``state_of`` of
    each returns it) and each gains the sharded class, so ``unshard()``, the ``set_*`` methods
    and the state-dict hooks work from any member, for the whole unit. One call of the group is
    the run of its members in one forward: the first member to start runs the pre-forward (the
    gather, the prefetch, the input cast) and the last to finish runs the post-forward (the
    reshard, the backward order, the output cast), as FSDP2's group hooks do; members between
    them run on the gathered unit untouched. Each member's outputs get the backward pre-hook
    that regathers a resharded unit. A group call some member of which did not run is closed
    when the root's forward ends (``IterationContext.end_forward``), so the unit is resharded
    and recorded for backward all the same -- where FSDP2 would keep waiting for that member.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parameter import UninitializedTensorMixin

from .extension import has_extension
from .owners import owner_of, slot_owner
from .registrations import Registrations
from .state import state_of


def members_of(module) -> list:
    """The modules one call makes a unit of: ``module``, or the outermost modules of a list
    (Note [a list of modules as one unit]); each must be an nn.Module."""
    if not isinstance(module, (list, tuple)):
        if not isinstance(module, nn.Module):
            raise TypeError(f"fusedist.fully_shard expects an nn.Module or a list of them, got {type(module).__name__}")
        _refuse_forwardless(module, "")
        return [module]
    if not module:
        raise ValueError("fusedist.fully_shard: the list of modules is empty")
    for i, m in enumerate(module):
        if not isinstance(m, nn.Module):
            raise TypeError(f"fusedist.fully_shard: item {i} of the list is a {type(m).__name__}, not an nn.Module")
    _refuse_repeated(module)
    members = list(module)
    inside = {id(sub) for m in members for sub in m.modules() if sub is not m}
    outermost = [m for m in members if id(m) not in inside]
    for m in outermost:
        _refuse_forwardless(m, f" (item {module.index(m)} of the list)")
    return outermost


def _refuse_repeated(modules) -> None:
    """A module listed more than once is refused, as torch's FSDP2 refuses it (its second
    application to the module fails). Taking it once hid a list built wrong -- a block meant
    beside it left out of the unit -- until memory or speed showed it."""
    at: dict = {}
    for i, m in enumerate(modules):
        at.setdefault(id(m), []).append(i)
    for i, m in enumerate(modules):
        if len(at[id(m)]) > 1:
            places = ", ".join(str(k) for k in at[id(m)])
            raise ValueError(
                f"fusedist.fully_shard: the list of modules holds the same {type(m).__name__} at items {places}: "
                "each module may be listed once (fully_shard is applied once per module). Remove the repeats, "
                "e.g. list(dict.fromkeys(modules)), or check that the list names the modules you meant.")


def _refuse_forwardless(module: nn.Module, where: str) -> None:
    """A ModuleList / ModuleDict without a forward of its own cannot be (the outermost member
    of) a unit, as with torch's FSDP2: the unit's gather hooks on forward, which never runs, so
    the modules inside computed on this rank's pieces (a shape error, or a silently wrong
    result where the shapes fit)."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward:
        raise ValueError(
            f"fusedist.fully_shard does not support containers that do not implement forward: "
            f"{type(module).__name__} of {len(module)} modules{where}. Shard each of its modules "
            "(for block in model.layers: fully_shard(block)), or pass list(container) to make them one unit")


def managed_modules_of(modules: list):
    """:func:`managed_modules` of each member, names prefixed by the member's index in a list."""
    if len(modules) == 1:
        yield from managed_modules(modules[0])
        return
    for i, m in enumerate(modules):
        for name, sub in managed_modules(m):
            yield (f"[{i}].{name}" if name else f"[{i}]"), sub


def check_params(module: nn.Module, ignored: set, shard_placement_fn, taken) -> dict:
    """Refuse, before anything changes, the parameters this call would shard and cannot:
    DTensors other than a 1-D tensor-parallel mesh's, other tensor subclasses (Note [tensor subclass
    parameters]), and what ``shard_placement_fn`` returns other than
    ``Shard(dim)`` or None, or a dim the parameter does not have (``placement.shard_dim``).
    Returns ``id(param) -> dim`` of the others: the function is called once per parameter,
    as FSDP2 calls it."""
    from torch.distributed.tensor import DTensor

    from .placement import shard_dim

    dims = {}
    for mod_name, sub in managed_modules(module):
        for attr, p in sub._parameters.items():
            if p is None or id(p) in ignored or p in taken or id(p) in dims:
                continue
            fqn = f"{mod_name}.{attr}" if mod_name else attr
            if isinstance(p, DTensor):
                if p.device_mesh.ndim != 1 or not all(pl.is_shard() or pl.is_replicate() for pl in p.placements):
                    raise NotImplementedError(
                        f"fusedist.fully_shard({type(module).__name__}): parameter '{fqn}' is a DTensor on a "
                        f"{p.device_mesh.ndim}-D mesh with placements {tuple(p.placements)}; fusedist shards "
                        "tensor-parallel parameters of a 1-D tensor-parallel mesh, placed Shard(dim) or Replicate() "
                        "(Note [tensor-parallel parameters] in fsdp/tensor_parallel.py). Use "
                        "torch.distributed.fsdp.fully_shard for that model.")
                if type(p._local_tensor) is not torch.Tensor and not has_extension(p._local_tensor):
                    raise NotImplementedError(_subclass_refusal(type(module).__name__, fqn, p._local_tensor,
                                                                " tensor-parallel (a DTensor) over"))
            elif type(p) not in (nn.Parameter, torch.Tensor) and not isinstance(p, UninitializedTensorMixin) \
                    and not has_extension(p):
                raise NotImplementedError(_subclass_refusal(type(module).__name__, fqn, p))
            dims[id(p)] = shard_dim(p, fqn, shard_placement_fn, type(module).__name__)
    return dims


# Note [tensor subclass parameters]
# A parameter that is a tensor subclass -- torchao's float8 training weights, its NF4 weights
# for QLoRA -- carries behaviour in its type: a cast to float8 in each matmul, a dequantization.
# FSDP2 keeps the subclass on every shard and lets it choose what is all-gathered through its
# ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` methods (float8 bytes, say, instead of
# bf16). fusedist's units take the subclasses that implement those methods: wrappers of one
# high-precision tensor (Note [all-gather extension] in extension.py) and frozen quantized
# storage such as NF4 (Note [quantized storage] in packed.py). Any other subclass would have
# its values copied into a flat buffer and the module given back a plain Parameter -- the
# float8 casts, the quantization dropped without a word -- so it is refused by name.
def _subclass_refusal(module_name: str, fqn: str, p, how: str = "") -> str:
    kind = type(p)
    return (f"fusedist.fully_shard({module_name}): parameter '{fqn}' is{how} a tensor subclass, "
            f"{kind.__module__}.{kind.__qualname__}; fusedist shards plain tensors and would hand the "
            "module a plain parameter, dropping what the subclass does (a float8 cast, a quantization). Use "
            "torch.distributed.fsdp.fully_shard for this model, or keep such parameters out of the units "
            "(ignored_params).")


def take_params(module, modules: list, ignored: set) -> tuple:
    """The parameters one ``fully_shard`` call shards: ``(params, registrations, names, borrowed)``
    -- each parameter once, with every ``(module, attribute)`` holding it (``Registrations``:
    ``modules`` themselves held weakly) and its first name under ``modules``; and ``(owner,
    index, (module, attribute), name)`` for each one tied to a parameter another unit holds
    (Note [lent parameters] in unit.py). Refuses a module sharded after one containing it, and a
    unit every parameter of which another unit holds."""
    params, regs, fqns, borrowed = [], [], [], []
    index_of: dict[int, int] = {}
    for mod_name, sub in managed_modules_of(modules):
        for attr, p in sub._parameters.items():
            if p is None or id(p) in ignored:
                continue
            fqn = f"{mod_name}.{attr}" if mod_name else attr
            # (None also where a dropped model's unit is gone; the slot's owner where it holds a gathered parameter)
            owned = owner_of(p) or slot_owner(sub, attr)
            if owned is not None:  # tied with a parameter another unit holds
                owner, idx = owned
                if any(m is sub and a == attr for m, a in owner.registrations[idx]):
                    raise sharded_by_parent(module, fqn, owner, idx)
                borrowed.append((owner, idx, (sub, attr), fqn))
            elif id(p) in index_of:
                regs[index_of[id(p)]].append((sub, attr))
            else:
                index_of[id(p)] = len(params)
                params.append(p)
                regs.append([(sub, attr)])
                fqns.append(fqn)
    if borrowed and not params:
        from .tree_names import unit_owner

        owner, idx, _, fqn = borrowed[0]
        raise NotImplementedError(
            f"fusedist.fully_shard({describe(modules)}): every parameter of this module is tied to a parameter "
            f"another unit holds ('{fqn}' is '{owner.names[idx]}' of {unit_owner(owner)}), and a unit "
            "needs a parameter of its own. Leave this module to a parent's fully_shard call, or do not shard "
            f"{owner.name} on its own, so that this call takes the tied weight with the rest (torch's FSDP2 refuses "
            "weights tied across units).")
    return params, [Registrations(r, modules) for r in regs], fqns, borrowed


def sharded_by_parent(module, fqn, owner, idx) -> ValueError:
    """The error for a module sharded after a module containing it. Why not borrow, as for a
    weight tied across units: here the parent's unit swaps this very attribute, and two units
    swapping one slot would each put back their own tensor."""
    from .tree_names import unit_owner

    return ValueError(
        f"fusedist.fully_shard({type(module).__name__}): its parameter '{fqn}' is already sharded by "
        f"{unit_owner(owner)} (as '{owner.names[idx]}'), called earlier on a module containing "
        "this one. Apply fully_shard bottom-up: each submodule before the modules that contain it.")


def managed_modules(root: nn.Module):
    """``root`` and its submodules, minus the subtrees of modules already sharded."""
    stack = [("", root)]
    while stack:
        name, m = stack.pop()
        yield name, m
        for child_name, child in reversed(list(m._modules.items())):
            if child is not None and state_of(child) is None:
                stack.append((f"{name}.{child_name}" if name else child_name, child))


def describe(modules: list) -> str:
    if len(modules) == 1:
        return type(modules[0]).__name__
    return "[" + ", ".join(type(m).__name__ for m in modules) + "]"
