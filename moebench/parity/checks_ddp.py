"""Checks 1-2, DistributedDataParallel vs a local copy.

1 `ddp-adam` (seed 003 test_c10d_spawn_gloo): Adam lr 1e-3, 10 iterations, parameters equal
  before and after, for Linear(2, 2) on (30, 2) rows per rank and a 3-layer LSTM net at CPU sizes.
  Each rank initialises its model with seed + rank: "before" holds only if the wrapper broadcast
  rank 0's parameters at construction, as DDP does.
  Unlike the seed (world size 1, one input), every rank gets its own rows and the local copy
  trains on all of them, so a wrapper that does not communicate cannot pass. Adam is nearly
  invariant to a constant gradient scale: summed-instead-of-averaged gradients show here only
  through eps on small gradients (the LSTM); `ddp-sgd` is the check that catches them squarely.
2 `ddp-sgd` (seed 001 test_replicate `_compare_module`): a global batch split by rank, 2 plain
  SGD steps (param -= grad) with a reshuffle between them, vs the local module on the whole batch.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from moebench.parity.compare import EXACT, SEED_ALLCLOSE_DEFAULT, SEED_REPLICATE, STRICT, STRICT_ADAM, compare, pick
from moebench.parity.registry import Check, CheckOptions, impl_or_default, register

ADAM_LR = 1e-3
ADAM_ITERS = 10
LINEAR_ROWS = 30  # per rank, as the seed's (30, 2)
# The seed's LSTM (256 wide, 100 steps, batch 12, GPU) at CPU size: same structure, tiny dims.
LSTM_DIM, LSTM_LAYERS, LSTM_SEQ, LSTM_BATCH = 8, 3, 5, 2


class LSTMNet(nn.Module):
    """3-layer LSTM + linear head returning an MSE loss (the seed's test_rnn net)."""

    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(dim, dim, layers, batch_first=True)
        self.h2o = nn.Linear(dim, dim)

    def forward(self, x, y):
        self.lstm.flatten_parameters()
        h, _ = self.lstm(x)
        return F.mse_loss(self.h2o(h), y)


class Net(nn.Module):
    """Three Linear(2, 2) in a row (seed 001's Net)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x):
        return self.fc3(self.fc2(self.fc1(x)))


def default_ddp(module: nn.Module) -> nn.Module:
    return DistributedDataParallel(module)


def _params(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    inner = getattr(module, "module", module)
    return list(inner.named_parameters())


def _compare_params(prefix, dist_mod, local_mod, tol, asserted, rank) -> list:
    return [compare(f"{prefix}: {name}", p, q, tol, asserted=asserted, rank=rank)
            for (name, p), (_, q) in zip(_params(dist_mod), _params(local_mod))]


def _adam_case(ctx, opts, wrap, label, model_name, make_model, make_batch, loss_fn) -> list:
    tol, asserted = pick(opts.tolerance, strict=STRICT_ADAM, seed=SEED_ALLCLOSE_DEFAULT)
    # Every rank initialises its own model differently (seed + rank); the wrapper must broadcast
    # rank 0's parameters at construction, so "before" compares against rank 0's initial model.
    torch.manual_seed(opts.seed)
    local = make_model()  # rank 0's initial parameters, rebuilt on every rank
    torch.manual_seed(opts.seed + ctx.rank)
    ddp = wrap(make_model())
    results = _compare_params(f"{model_name} before (rank 0's initial parameters)", ddp, local, EXACT, True,
                              ctx.rank)
    local_opt = torch.optim.Adam(local.parameters(), lr=ADAM_LR)
    ddp_opt = torch.optim.Adam(ddp.parameters(), lr=ADAM_LR)
    for it in range(ADAM_ITERS):
        batches = [make_batch(opts.seed * 1000 + it * 100 + s) for s in range(ctx.world_size)]
        whole = [torch.cat(parts) for parts in zip(*batches)]
        # DDP averages rank gradients: the local copy descends the mean of the ranks' losses.
        (loss_fn(local, whole, ctx.world_size)).backward()
        loss_fn(ddp, batches[ctx.rank], 1).backward()
        local_opt.step()
        ddp_opt.step()
        local_opt.zero_grad()
        ddp_opt.zero_grad()
    results += _compare_params(f"{model_name} after {ADAM_ITERS} Adam steps", ddp, local, tol, asserted, ctx.rank)
    results[0].note = f"wrapper {label}"
    return results


def _rank_adam(ctx, opts: CheckOptions) -> list:
    wrap, label = impl_or_default(opts, "ddp", default_ddp)

    def linear_batch(seed):
        return (torch.randn(LINEAR_ROWS, 2, generator=torch.Generator().manual_seed(seed)),)

    def linear_loss(model, batch, ranks):
        # The seed's out.sum(); over all ranks' rows, / ranks to match DDP's average.
        return model(*batch).sum() / ranks

    def lstm_batch(seed):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(LSTM_BATCH, LSTM_SEQ, LSTM_DIM, generator=g),
                torch.rand(LSTM_BATCH, LSTM_SEQ, LSTM_DIM, generator=g))

    def lstm_loss(model, batch, ranks):
        return model(*batch)  # MSE mean over equal-size rank batches == mean of the rank means

    return (_adam_case(ctx, opts, wrap, label, "Linear(2,2)", lambda: nn.Linear(2, 2), linear_batch, linear_loss)
            + _adam_case(ctx, opts, wrap, label, "LSTM net", lambda: LSTMNet(LSTM_DIM, LSTM_LAYERS),
                         lstm_batch, lstm_loss))


def sgd_compare(ctx, opts, local: nn.Module, dist_mod: nn.Module, prefix: str, label: str) -> list:
    """Seed 001's _compare_module: rank slices of a global batch, 2 steps of param -= grad."""
    tol, asserted = pick(opts.tolerance, strict=STRICT, seed=SEED_REPLICATE)
    local_batch = 1
    global_batch = ctx.world_size * local_batch
    g = torch.Generator().manual_seed(opts.seed)
    inputs, target = torch.randn(global_batch, 2, generator=g), torch.randn(global_batch, 2, generator=g)
    rows = slice(ctx.rank * local_batch, (ctx.rank + 1) * local_batch)

    def step(model, x, y):
        F.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= p.grad
                p.grad = None

    results = []
    for it in range(2):
        step(local, inputs, target)
        step(dist_mod, inputs[rows], target[rows])
        results += _compare_params(f"{prefix}, step {it + 1}", dist_mod, local, tol, asserted, ctx.rank)
        inputs = inputs[torch.randperm(global_batch, generator=torch.Generator().manual_seed(it))]
    results[0].note = f"impl {label}"
    return results


def _rank_sgd(ctx, opts: CheckOptions) -> list:
    wrap, label = impl_or_default(opts, "ddp", default_ddp)
    torch.manual_seed(opts.seed)
    local = Net()
    return sgd_compare(ctx, opts, local, wrap(copy.deepcopy(local)), "DDP(Net)", label)


register(Check(
    name="ddp-adam", order=10, seed_source="003 test_c10d_spawn_gloo",
    description="DDP vs local copy, Adam lr 1e-3, 10 iterations (Linear(2,2) on (30,2), 3-layer LSTM)",
    catches="a DDP wrapper that does not broadcast rank 0's initial parameters, or never all-reduces gradients",
    preload=("torch._dynamo",), rank_fn=_rank_adam, impl_keys=("ddp",),
))
register(Check(
    name="ddp-sgd", order=20, seed_source="001 test_replicate _compare_module",
    description="DDP on rank slices of a global batch, 2 SGD steps with a reshuffle vs local",
    catches="a DDP wrapper that skips or double-counts the gradient all-reduce, or averages over the wrong world size",
    preload=("torch._dynamo",), rank_fn=_rank_sgd, impl_keys=("ddp",),
))
