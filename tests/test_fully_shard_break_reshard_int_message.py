"""The refusal of an int ``reshard_after_forward`` that does not divide the shard group's size
says what the valid ints mean. On a one-rank shard group (HSDP with one shard per replica, a
``(R, 1)`` mesh) the only factor is 1, and it keeps the parameters whole; the message used to
read "k = 1 is True, k = 1 is False". The rule itself is torch FSDP2's (``_fsdp_init``: a factor
of the shard mesh's size), checked against FSDP2 in tests/test_fully_shard_reshard_int.py; this
file checks the text only, with no process group (the check reads the group's size alone).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest


def _refusal(value, size: int) -> str:
    from fusedist.fsdp.post_forward import resolve_reshard_after_forward

    with pytest.raises(ValueError) as caught:
        resolve_reshard_after_forward(value, SimpleNamespace(world_size=size, rank=0), None, "cpu")
    return str(caught.value)


@pytest.mark.parametrize("value", [2, 3, 0, -1])
def test_one_rank_shard_group_refusal_names_its_single_factor(value):
    text = _refusal(value, 1)
    assert f"factor of the shard group's size 1, not {value}" in text, text
    assert "single factor 1" in text and "as False" in text, text
    assert "is True" not in text, text  # 1 cannot be both True and False


def test_larger_group_refusal_names_both_ends():
    text = _refusal(3, 4)
    assert "factor of the shard group's size 4, not 3" in text, text
    assert "k = 4 is True, k = 1 is False" in text, text
