"""After a ModuleList insert or del renumbers its entries, the parameter check names a parameter that
differs across ranks by its current path, not by the one it had when the model was wrapped
(Note [names follow the module] in fusedist/ddp/module_tree.py)."""

import torch
from torch import nn

from fusedist.testing import run_distributed

ENV = {"FUSEDIST_PARAM_CHECK_EVERY": "1", "FUSEDIST_TIMEOUT_S": "5"}


class _Stack(nn.Module):
    def __init__(self, head=()):
        super().__init__()
        self.layers = nn.ModuleList([*head, nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 2)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _diverge_after(change, rank, head=()):
    """Train, check, ``change`` the wrapped model's tree, train, make rank 1's copy of the middle
    Linear's weight differ, check again: (its current path, the check's message or None)."""
    import fusedist

    torch.manual_seed(0)
    net = _Stack(head)
    model = fusedist.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(10 + rank)

    def step():
        model(torch.randn(4, 6, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    model.check_consistency()  # the digest exists before the tree changes (built under wrap-time names)
    target = net.layers[len(head) + 1].weight
    change(net.layers)
    step()
    current = next(n for n, p in net.named_parameters() if p is target)
    if rank == 1:
        with torch.no_grad():
            target.add_(torch.randn(target.shape, generator=gen))
    try:
        model.check_consistency()
    except Exception as e:  # noqa: BLE001 -- the message is what is checked
        return current, str(e)
    return current, None


def _worker(rank, world):
    return {
        # every Linear moves up one index: the middle one was wrapped as 'layers.1', is 'layers.2' now
        "insert": _diverge_after(lambda layers: layers.insert(0, nn.Identity()), rank),
        # every Linear moves down one index: the middle one was wrapped as 'layers.2', is 'layers.1' now
        "del": _diverge_after(lambda layers: layers.__delitem__(0), rank, head=[nn.ReLU()]),
    }


def test_parameter_check_names_current_path_after_renumbering():
    for rank, out in enumerate(run_distributed(_worker, 2, env=ENV, timeout=60)):
        for case, expected, stale in (("insert", "layers.2.weight", "layers.1.weight"),
                                      ("del", "layers.1.weight", "layers.2.weight")):
            current, message = out[case]
            assert current == expected, (case, out)
            assert message is not None, f"rank {rank}, {case}: a weight changed on rank 1 went unnoticed"
            assert f"parameter '{current}' (shape (6, 6)) differs across ranks: ranks [0] | ranks [1]" in message, \
                (rank, case, message)
            assert f"'{stale}'" not in message, (rank, case, message)  # the wrap-time path: another Linear now
