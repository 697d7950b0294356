"""ZeroRedundancyOptimizer(offload="cpu"): parameters the host Adam cannot step are refused by
their index in the optimizer's parameters, and a refused step changes nothing (README: "A failed
call changes nothing"), also for parameters that joined after construction."""

import pytest
import torch
from torch import nn


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


@pytest.mark.parametrize("how", ["unfrozen", "add_param_group"])
def test_a_float64_parameter_joining_is_refused_before_any_update(how):
    """A float64 parameter that joins before the first step (unfrozen, or added with
    ``add_param_group``) is refused naming it, as at construction; before the fix the kernel
    call failed on it ('params[0] has dtype torch.float64') after the float32 buckets had been
    stepped, so each failed step moved the other parameters."""
    import fusedist

    seed = int(torch.randint(0, 10_000, ()).item())
    model = _model(seed)
    extra = nn.Parameter(torch.randn(4, dtype=torch.float64), requires_grad=how == "add_param_group")
    if how == "unfrozen":
        opt = fusedist.ZeroRedundancyOptimizer([*model.parameters(), extra], torch.optim.AdamW, lr=1e-2,
                                               offload="cpu")
        extra.requires_grad_(True)
    else:
        opt = fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, offload="cpu")
        opt.add_param_group({"params": [extra]})
    before = [p.detach().clone() for p in [*model.parameters(), extra]]
    for _ in range(2):  # a retry is refused the same way
        opt.zero_grad()
        (model(torch.randn(4, 6)).pow(2).sum() + extra.pow(2).sum()).backward()
        with pytest.raises(TypeError, match=r"offload='cpu'\): parameter 4 has dtype torch.float64"):
            opt.step()
        for p, b in zip([*model.parameters(), extra], before):
            assert torch.equal(p.detach(), b)


def test_the_dtype_error_names_the_parameter_by_its_index_in_the_optimizer():
    """With a frozen parameter before it, the float64 parameter is parameter 2 of the
    optimizer (torch's numbering, as every other ZeRO error), not the 2nd trainable one."""
    import fusedist

    model = _model(0)
    model[0].weight.requires_grad_(False)
    model[2].double()
    with pytest.raises(TypeError, match=r"parameter 2 has dtype torch.float64"):
        fusedist.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, offload="cpu")
