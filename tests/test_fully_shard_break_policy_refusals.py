"""``fully_shard``'s ``mp_policy`` is checked at the call. torch's FSDP2 takes any object and
fails inside the first forward: FSDP1's ``MixedPrecision`` (a common leftover of a migration: no
``output_dtype``, and inputs are not cast by default) as "mat1 and mat2 must have the same dtype",
a dtype written as text (``"bfloat16"`` from a config file) at the first cast. fusedist did the
same; now every rank refuses at ``fully_shard`` with a ``TypeError`` naming the argument, the
type it got and what to pass, before any process group is touched (so these tests need none).
torch's and fusedist's own ``MixedPrecisionPolicy`` are still taken as they are. FSDP1's
``CPUOffload(offload_params=True)`` as ``offload_policy``, which torch's FSDP2 silently ignores
(nothing is offloaded), was refused already; the refusal now says which policy to pass.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fusedist


def _refusal(mp_policy) -> str:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(TypeError) as caught:
        fusedist.fully_shard(model, mp_policy=mp_policy)
    assert not isinstance(model, fusedist.FSDPModule), "a refused call must leave the module as it was"
    return str(caught.value)


def test_fsdp1_mixed_precision_is_refused_naming_fsdp2s_policy():
    from torch.distributed.fsdp import MixedPrecision

    text = _refusal(MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16))
    assert "mp_policy must be a MixedPrecisionPolicy, got MixedPrecision" in text, text
    assert "no output_dtype" in text and "FSDP1's MixedPrecision" in text, text
    assert "MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...)" in text, text


def test_other_objects_are_refused_naming_the_missing_fields():
    text = _refusal({"param_dtype": torch.bfloat16})
    assert "got dict (it has no param_dtype, reduce_dtype, output_dtype, cast_forward_inputs)" in text, text
    assert "FSDP1" not in text, text


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype", "output_dtype"])
@pytest.mark.parametrize("policy_class", ["torch", "fusedist"])
def test_a_dtype_given_as_text_is_refused_naming_the_field(field, policy_class):
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    cls = TorchMP if policy_class == "torch" else fusedist.MixedPrecisionPolicy
    text = _refusal(cls(**{field: "bfloat16"}))
    assert f"mp_policy.{field} must be a torch.dtype or None, got str 'bfloat16'" in text, text


def test_cast_forward_inputs_must_be_a_bool():
    text = _refusal(fusedist.MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs="no"))
    assert "mp_policy.cast_forward_inputs must be a bool, got str 'no'" in text, text


def test_fsdp1_cpu_offload_refusal_names_the_fsdp2_policy():
    from torch.distributed.fsdp import CPUOffload

    model = nn.Linear(4, 4)
    with pytest.raises(TypeError) as caught:
        fusedist.fully_shard(model, offload_policy=CPUOffload(offload_params=True))
    text = str(caught.value)
    assert "offload_policy must be an OffloadPolicy or CPUOffloadPolicy, got CPUOffload" in text, text
    assert "FSDP1's CPUOffload: pass CPUOffloadPolicy()" in text and "offload_params=True" in text, text
