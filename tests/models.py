"""Small models shared by the distributed tests (deterministic given the seed)."""

import time

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in=16, hidden=32, d_out=4, layers=3):
        super().__init__()
        dims = [d_in] + [hidden] * (layers - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x

    @staticmethod
    def batch(gen, n=8):
        return torch.randn(n, 16, generator=gen), torch.randn(n, 4, generator=gen)


class ResidualBlock(nn.Module):
    """A transformer-style residual MLP: LayerNorm, Linear(d, width * d), GELU, Linear back."""

    def __init__(self, d: int, width: int = 2):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, width * d)
        self.fc2 = nn.Linear(width * d, d)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class BlockStack(nn.Module):
    """An input projection, residual blocks in a ModuleList (one ``fully_shard`` unit each), a
    head: the usual shape of a sharded model, tiny."""

    def __init__(self, d_in: int = 5, d: int = 6, d_out: int = 3, blocks: int = 2):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(ResidualBlock(d) for _ in range(blocks))
        self.head = nn.Linear(d, d_out)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class WholeModelLayers(nn.Module):
    """Layers ``ids`` of one model of ``count`` tanh-activated ``width``-wide linear layers, under
    the whole model's names in the child ``child`` (a pipeline stage as torchtitan splits a model:
    the whole model with the other layers removed); the same ``seed`` gives every split the
    whole model's values."""

    def __init__(self, ids, seed: int, *, width: int, count: int, child: str = "layers"):
        super().__init__()
        torch.manual_seed(seed)
        every = [nn.Linear(width, width) for _ in range(count)]
        setattr(self, child, nn.ModuleDict({str(i): every[i] for i in ids}))

    def forward(self, x):
        for layer in next(iter(self.children())).values():
            x = torch.tanh(layer(x))
        return x


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))

    @staticmethod
    def batch(gen, n=4):
        return torch.randn(n, 3, 8, 8, generator=gen), torch.randn(n, 4, generator=gen)


class TiedLM(nn.Module):
    """Embedding whose weight is tied to the output projection."""

    def __init__(self, vocab=50, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(self.norm(torch.tanh(self.mix(self.embed(tokens)))))

    @staticmethod
    def batch(gen, n=4):
        tokens = torch.randint(0, 50, (n, 6), generator=gen)
        return tokens, torch.randint(0, 50, (n, 6), generator=gen)


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(16, 4)
        self.unused = nn.Linear(16, 4)

    def forward(self, x):
        return self.used(x)

    @staticmethod
    def batch(gen, n=8):
        return MLP.batch(gen, n)


class LogitScaled(nn.Module):
    """A CLIP-like model: a 0-dim learnable scale (its ``logit_scale``) beside a Linear(4, out)."""

    def __init__(self, out: int = 4):
        super().__init__()
        self.lin = nn.Linear(4, out)
        self.logit_scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.lin(x) * self.logit_scale


class TwoLinearTanh(nn.Module):
    """Linear(4, 4) -> tanh -> Linear(4, 2), seeded; ``orthogonal=True`` parametrizes the first
    layer's weight (its setter replaces the parameter's storage)."""

    def __init__(self, orthogonal: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)
        if orthogonal:
            nn.utils.parametrizations.orthogonal(self.fc)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(x)))


def loss_fn(model_cls, out, target):
    if model_cls is TiedLM:
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    return nn.functional.mse_loss(out, target)


def rank_slice_of_global_batch(step, rank=None, world_size=1, *, seed, n, shape=(8,), out=2):
    """Step ``step``'s global batch (``n`` samples, fresh per step), or rank ``rank``'s equal
    slice of it: what a single process trains on, and what each DDP rank sees."""
    gen = torch.Generator().manual_seed(seed + step)
    x, y = torch.randn(n, *shape, generator=gen), torch.randn(n, out, generator=gen)
    if rank is None:
        return x, y
    chunk = n // world_size
    return x[rank * chunk:(rank + 1) * chunk], y[rank * chunk:(rank + 1) * chunk]


def rank_step_batch(rank: int, step: int, n: int = 6, *, seed: int = 0):
    """Rank ``rank``'s own batch at step ``step`` (8 features in, 4 targets): fresh per rank
    and step, as each data-parallel rank draws different samples."""
    g = torch.Generator().manual_seed(seed + 1000 * step + rank)
    return torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)


def assert_same_steps(reference, got):
    """Two runs, each (per-step gradients, None where a parameter had none; final parameters),
    agree: the same gradients present, equal within fp32 tolerance, and the same weights."""
    (ref_grads, ref_params), (got_grads, got_params) = reference, got
    for step, (want, have) in enumerate(zip(ref_grads, got_grads)):
        assert [g is None for g in have] == [g is None for g in want], f"step {step}: gradients present"
        for a, b in zip(want, have):
            if a is not None:
                torch.testing.assert_close(b, a, msg=lambda m: f"step {step}: {m}")
    for a, b in zip(ref_params, got_params):
        torch.testing.assert_close(b, a)


def flat_params(model):
    """Every parameter, flattened and concatenated (to compare two models at once)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def max_param_diff(m1, m2) -> float:
    """The largest absolute difference between two models' corresponding parameters (those with
    elements; 0.0 where none has any)."""
    return max((float((p - q).abs().max()) for p, q in zip(m1.parameters(), m2.parameters()) if p.numel()),
               default=0.0)


def shard_both(ref, ours, mesh, units=lambda model: model.blocks):
    """``ref`` sharded by torch's ``fully_shard`` and ``ours`` by fusedist's, alike: each of
    ``units(model)``, then the root, over ``mesh``. Returns ``(ref, ours)``."""
    import fusedist
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    for shard, model in ((torch_fully_shard, ref), (fusedist.fully_shard, ours)):
        for unit in units(model):
            shard(unit, mesh=mesh)
        shard(model, mesh=mesh)
    return ref, ours


def error_text(fn, exc_type=Exception):
    """``str`` of the ``exc_type`` that ``fn()`` raises, or None when it returns (other
    exceptions propagate): what a worker reports back for the test to read."""
    try:
        fn()
    except exc_type as exc:
        return str(exc)
    return None


def raised(fn) -> str:
    """``"Type: text"`` of whatever ``fn()`` raises, or ``"no error"``: for scenarios whose
    worker reports several refusals (and non-refusals) back in one result."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def raised_timed(fn) -> tuple:
    """(``"Type: text"`` of whatever ``fn()`` raises, or None; the seconds it took): for scenarios
    that check a refusal reaches every rank promptly, not at a timeout."""
    start = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return f"{type(exc).__name__}: {exc}", time.perf_counter() - start
    return None, time.perf_counter() - start


def fp16_sum_overflow_case(rank: int, limit: float):
    """A small model and rank ``rank``'s input, scaled so that every rank's largest gradient is
    ``limit`` and the ranks' gradients are nearly equal: their fp16 sum overflows where their
    average fits (a collective). Returns ``(model, x, scale, local, total)``: the unscaled
    model, the input, the loss scale, this rank's scaled gradients and their sum over ranks
    (fp32, flat, in ``parameters()`` order)."""
    import copy

    import torch.distributed as dist

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    x = x + 0.01 * torch.randn(6, 8, generator=torch.Generator().manual_seed(1 + rank))
    plain = copy.deepcopy(base)
    plain(x).sum().backward()
    local = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
    biggest = local.abs().max().clone()
    dist.all_reduce(biggest, op=dist.ReduceOp.MAX)
    scale = limit / biggest.item()
    total = local * scale
    dist.all_reduce(total)
    return base, x, scale, local * scale, total


def mismatch_or(fn, *args):
    """The text of the ``RankMismatchError`` that ``fn(*args)`` raises, else what it returns
    (``"no error"`` for None): what each case of a per-step check scenario reports back."""
    from fusedist._consistency import RankMismatchError

    try:
        result = fn(*args)
    except RankMismatchError as exc:
        return str(exc)
    return "no error" if result is None else result
