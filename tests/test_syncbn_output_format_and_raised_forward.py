"""fusedist.nn.SyncBatchNorm's output memory format, and the state a raised forward leaves.

Oracle: nn.BatchNorm on CPU (torch.nn.SyncBatchNorm has no CPU kernel). fp32 against fp32 over
~10-40 values per channel: 1e-5 covers the difference in summation order.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fusedist.nn import SyncBatchNorm
from fusedist.nn import _bn_ops

TOL = dict(rtol=1e-5, atol=1e-5)
_BN = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


def _layouts(g):
    """Inputs of 3 channels in the layouts a model hands BatchNorm: name -> tensor."""
    return {
        "(N, C, L) stored as (N, L, C)": torch.randn(4, 5, 3, generator=g).permute(0, 2, 1),
        "(N, C) transposed": torch.randn(3, 6, generator=g).t(),
        "(N, C, L) strided slice": torch.randn(4, 3, 10, generator=g)[:, :, ::2],
        "(N, C, H, W) channels_last":
            torch.randn(2, 3, 4, 5, generator=g).contiguous(memory_format=torch.channels_last),
        "(N, C, H, W) H and W transposed": torch.randn(2, 3, 5, 4, generator=g).transpose(2, 3),
        "(N, C, D, H, W) channels_last_3d":
            torch.randn(2, 3, 2, 3, 2, generator=g).contiguous(memory_format=torch.channels_last_3d),
        "(N, C) contiguous": torch.randn(6, 3, generator=g),
    }


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_output_memory_format_is_torchs(train):
    """The output has the strides of torch's BatchNorm output on the same input (Note [the
    output's memory format] in fusedist/nn/_layout.py): an (N, C, L) input stored as (N, L, C)
    and a transposed (N, C) one gave outputs of the input's strides, where torch's are
    contiguous. Values and input gradients equal torch's."""
    g = torch.Generator().manual_seed(21)
    for name, x0 in _layouts(g).items():
        x0 = x0 * 2 + 1
        dy = torch.randn(x0.shape, generator=g)
        ours, ref = SyncBatchNorm(3).train(train), _BN[x0.dim()](3).train(train)
        results = []
        for layer in (ours, ref):
            x = x0.detach().clone(memory_format=torch.preserve_format).requires_grad_(True)
            assert x.stride() == x0.stride()
            y = layer(x)
            (y * dy).sum().backward()
            results.append((y, x.grad))
        (y, dx), (ref_y, ref_dx) = results
        assert y.stride() == ref_y.stride(), f"{name}: {y.stride()} vs torch's {ref_y.stride()}"
        torch.testing.assert_close(y, ref_y, **TOL, msg=name)
        torch.testing.assert_close(dx, ref_dx, **TOL, msg=name)
        torch.testing.assert_close(ours.running_var, ref.running_var, **TOL, msg=name)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_forward_raised_before_its_output_changes_nothing(monkeypatch, momentum):
    """A training forward that raises before the running statistics took the batch (here the
    statistics kernel out of memory; likewise a failed collective, or a warning turned into
    an error) leaves num_batches_tracked and the running statistics as they were (Note [a
    raised forward changes nothing]): only a ValueError used to be undone, so the count ran one
    ahead and a momentum=None layer's average was weighted wrongly from then on. The next steps
    equal nn.BatchNorm1d's, which never saw the failed one."""
    g = torch.Generator().manual_seed(22)
    ours, ref = SyncBatchNorm(3, momentum=momentum), nn.BatchNorm1d(3, momentum=momentum)
    ours(torch.randn(5, 3, 4, generator=g))  # a step first: the failure meets a counted layer
    before = {k: v.clone() for k, v in ours.state_dict().items()}

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory (stands for any failure before the statistics)")

    with monkeypatch.context() as patch:
        patch.setattr(_bn_ops, "stats_payload", out_of_memory)
        with pytest.raises(RuntimeError, match="out of memory"):
            ours(torch.randn(5, 3, 4, generator=g))
    for key, value in ours.state_dict().items():
        assert torch.equal(value, before[key]), key
    ref.load_state_dict(before)
    for _ in range(2):
        x = torch.randn(5, 3, 4, generator=g) * 3 + 1
        torch.testing.assert_close(ours(x), ref(x), **TOL)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(ours, name), getattr(ref, name), **TOL)
