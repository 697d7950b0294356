"""Which (input dtype, parameter dtype) pairs SyncBatchNorm takes: BatchNorm's rule.

Note [input and parameter dtypes]
    torch's BatchNorm takes an input with a weight and bias of its own dtype, or -- mixed
    precision: an fp16/bf16 activation under autocast, or a model whose norm layers stayed
    fp32 -- a float16/bfloat16 input with float32 ones (the output is the input's dtype, the
    parameter gradients the parameters'). Every other pair is refused on CPU ("mixed dtype
    (CPU): expect parameter to have scalar type of Float"), autocast or not, and on CUDA by
    cuDNN and by torch's native kernels for contiguous and channels_last inputs (they read
    the parameters as the input's accumulation type). This layer used to take any pair: an
    fp32 input to a ``model.half()`` layer came back fp32 with fp16 parameter gradients, where
    the same model under torch's layer stops at its first step with an error. It now refuses
    the same pairs, on every device, naming the tensors and what to do.

    The running statistics may have any floating dtype: they are only read (eval) and blended
    into (training) with one rounding to their own dtype. torch's native CUDA kernels and its
    SyncBatchNorm on CUDA take them so -- FSDP2's MixedPrecisionPolicy(param_dtype=bf16) casts
    a BatchNorm's parameters and leaves its fp32 buffers -- while torch's CPU op and cuDNN
    refuse buffers of another dtype than the parameters'; this layer takes them everywhere.
"""

from __future__ import annotations

import torch

_HALF = (torch.float16, torch.bfloat16)


def check_dtypes(layer: torch.nn.Module, input: torch.Tensor, where: str = "") -> None:
    """Raise RuntimeError (torch's error type for it) when ``layer``'s weight and bias do not
    fit ``input``'s dtype (Note [input and parameter dtypes]). ``where``: appended to the
    message (" on rank r")."""
    named = [(n, t) for n, t in (("weight", layer.weight), ("bias", layer.bias)) if t is not None]
    if not named:
        return
    wanted = input.dtype
    if input.dtype in _HALF and all(t.dtype == torch.float32 for _, t in named):
        wanted = torch.float32
    odd = [(n, t.dtype) for n, t in named if t.dtype != wanted]
    if not odd:
        return
    listed = ", ".join(f"{n} is {d}" for n, d in odd)
    own = {t.dtype for _, t in named}
    if len(own) == 1:
        fix = f"Cast the input (input.to({own.pop()})) or the layer (layer.to({input.dtype})) so that they agree"
    else:
        fix = f"Give the weight and bias one dtype (layer.to({input.dtype}))"
    raise RuntimeError(
        f"SyncBatchNorm({layer.num_features}): the input is {input.dtype} but the layer's {listed}{where}. "
        "BatchNorm (torch's too) takes a weight and bias of the input's dtype, or float32 ones with a "
        f"float16/bfloat16 input. {fix}"
    )
