"""Expert parallelism on 2 and 4 gloo ranks trains exactly like one process on the global batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import fastmoe_config

from moebench.distributed import expert_parallel
from moebench.distributed.launch import RankContext, check, launch
from moebench.variants.fastmoe.model import build_rank_model

# float32 sums over a different grouping of slots (per rank, then all_reduce): a few ulps of O(1) values.
EP_ATOL = 2e-5
ADAM_STEPS = 3
ONE_PROCESS = RankContext(rank=0, world_size=1, local_rank=0, backend="none", device="cpu")


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def _ep_rank(ctx: RankContext, experts: int, top_k: int, scale_expert_grads: bool, skewed: bool) -> dict:
    torch.set_num_threads(1)
    config = fastmoe_config(layers=2, d_model=16, d_hidden=24, experts=experts, heads=2, top_k=top_k,
                            batch_size=8, samples=8, seq_len=5, world_size=ctx.world_size)
    full = build_rank_model(config, 0, 1, "cpu")
    local = build_rank_model(config, ctx.rank, ctx.world_size, "cpu")
    if skewed:  # every token to expert 0 (rank 0): the other ranks send and receive nothing
        for model in (full, local):
            with torch.no_grad():
                for block in model.layers:
                    block.mlp.gate.gate.bias[0] = 100.0
    gen = torch.Generator().manual_seed(1)
    shapes = (config.train.batch_size, config.train.seq_len, config.model.d_model)
    x, y = torch.randn(shapes, generator=gen), torch.randn(shapes, generator=gen)
    per_rank = config.train.batch_size // ctx.world_size
    rows = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
    num_local = config.num_local_experts
    diffs = {"output": 0.0, "input_grad": 0.0, "expert_grads": 0.0, "other_grads": 0.0, "loss_curve": 0.0}
    opt_full = torch.optim.Adam(full.parameters(), lr=1e-2)
    opt_local = torch.optim.Adam(local.parameters(), lr=1e-2)
    full_params = dict(full.named_parameters())
    for step in range(ADAM_STEPS):
        x_full, x_local = x.clone().requires_grad_(), x[rows].clone().requires_grad_()
        out_full, _ = full(x_full)
        out_local, _ = local(x_local)
        loss_full = F.mse_loss(out_full, y)
        loss_local = F.mse_loss(out_local, y[rows])
        opt_full.zero_grad()
        opt_local.zero_grad()
        loss_full.backward()
        loss_local.backward()
        expert_parallel.sync_gradients(local, scale_expert_grads=scale_expert_grads)
        global_loss = loss_local.detach().clone()
        dist.all_reduce(global_loss)
        global_loss /= ctx.world_size
        diffs["loss_curve"] = max(diffs["loss_curve"], abs(global_loss.item() - loss_full.item()))
        if step == 0:
            diffs["output"] = _max_diff(out_local, out_full[rows])
            # Each rank's loss is the mean over its 1/N of the batch: N x the global mean's input grad.
            diffs["input_grad"] = _max_diff(x_local.grad / ctx.world_size, x_full.grad[rows])
            for name, p in local.named_parameters():
                m = expert_parallel._EXPERT_KEY.search(name)
                if m is None:
                    diffs["other_grads"] = max(diffs["other_grads"], _max_diff(p.grad, full_params[name].grad))
                    continue
                g = ctx.rank * num_local + int(m.group(2))
                full_name = name[:m.start(2)] + str(g) + name[m.end(2):]
                diffs["expert_grads"] = max(diffs["expert_grads"], _max_diff(p.grad, full_params[full_name].grad))
        opt_full.step()
        opt_local.step()
    return diffs


def violations(per_rank: list[dict]) -> dict:
    """Every quantity that differs from one process by more than EP_ATOL on some rank."""
    worst = {k: max(d[k] for d in per_rank) for k in per_rank[0]}
    return {k: v for k, v in worst.items() if v > EP_ATOL}


def _run(world_size, *, experts=8, top_k=2, scale_expert_grads=True, skewed=False) -> list[dict]:
    result = launch(_ep_rank, world_size, args=(experts, top_k, scale_expert_grads, skewed),
                    backend="gloo", timeout_s=120, label="ep-equivalence")
    return check(result).returns


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,top_k", [(2, 2), (4, 3)])
def test_expert_parallel_matches_one_process(world_size, top_k):
    assert violations(_run(world_size, top_k=top_k)) == {}


@pytest.mark.multirank
def test_expert_parallel_with_empty_exchanges():
    assert violations(_run(4, top_k=1, skewed=True)) == {}


@pytest.mark.multirank
def test_equivalence_check_catches_unscaled_expert_grads():
    """fastmoe's DistributedGroupedDataParallel convention (expert grads summed) must FAIL the check."""
    found = violations(_run(2, scale_expert_grads=False))
    # Adam is nearly invariant to a constant gradient scale, so only the gradients show it.
    assert "expert_grads" in found


def test_shard_state_dict_renumbers_local_experts():
    full = {"layers.0.mlp.experts.5.htoh4.weight": 5, "layers.0.mlp.experts.2.h4toh.bias": 2,
            "layers.0.mlp.gate.gate.weight": "g", "layers.0.attn.in_proj_weight": "a"}
    shard = expert_parallel.shard_state_dict(full, rank=1, num_local_experts=4)
    assert shard == {"layers.0.mlp.experts.1.htoh4.weight": 5, "layers.0.mlp.gate.gate.weight": "g",
                     "layers.0.attn.in_proj_weight": "a"}
    assert expert_parallel.owner_rank(5, 4) == 1


def _exchange_rank(ctx):
    # Rank r sends r+1 rows to every rank j (a zero-size split included via rank 0's row for rank 1).
    splits = [ctx.rank + 1 if j != 1 or ctx.rank != 0 else 0 for j in range(ctx.world_size)]
    x = (torch.arange(sum(splits), dtype=torch.float32) + 100 * ctx.rank).unsqueeze(1).requires_grad_()
    counts = torch.empty(ctx.world_size, dtype=torch.long)
    dist.all_to_all_single(counts, torch.tensor(splits))
    out = expert_parallel.all_to_all(x, counts.tolist(), splits)
    (out * (torch.arange(out.shape[0]).unsqueeze(1) + 1)).sum().backward()
    return out.squeeze(1).tolist(), x.grad.squeeze(1).tolist(), counts.tolist()


@pytest.mark.multirank
def test_all_to_all_backward_is_the_reverse_exchange():
    returns = check(launch(_exchange_rank, 3, backend="gloo", timeout_s=60)).returns
    outs = [r[0] for r in returns]
    # What rank j received from rank r, in order, is exactly r's chunk for j.
    for r in range(3):
        splits = [r + 1 if j != 1 or r != 0 else 0 for j in range(3)]
        start = 0
        for j in range(3):
            chunk = [float(v + 100 * r) for v in range(start, start + splits[j])]
            recv_counts = returns[j][2]
            offset = sum(recv_counts[:r])
            assert outs[j][offset:offset + splits[j]] == chunk
            # The gradient of a row is the weight (position + 1) it got on its receiver.
            assert returns[r][1][start:start + splits[j]] == [float(offset + i + 1) for i in range(splits[j])]
            start += splits[j]


def _switch_capacity_rank(ctx: RankContext, per_rank_capacity: bool = False) -> dict:
    torch.set_num_threads(1)
    if per_rank_capacity:  # broken on purpose: each rank fills the capacity on its own
        from moebench.models.moe import gates

        shared = gates.limit_by_capacity
        gates.limit_by_capacity = lambda idx, tot, cap, world_size, group: shared(idx, tot, cap, 1, None)
    config = fastmoe_config(layers=1, d_model=16, d_hidden=24, experts=4, heads=2, top_k=1, gate="switch",
                            batch_size=8, samples=8, seq_len=5, world_size=ctx.world_size)
    models = [build_rank_model(config, 0, 1, "cpu").eval(),
              build_rank_model(config, ctx.rank, ctx.world_size, "cpu").eval()]
    for model in models:  # every token wants expert 0: its capacity (shared by the ranks) overflows
        with torch.no_grad():
            model.layers[0].mlp.gate.gate.bias[0] = 100.0
    x = torch.randn(
        (config.train.batch_size, config.train.seq_len, config.model.d_model),
        generator=torch.Generator().manual_seed(1),
    )
    rows = slice(ctx.rank * 4, (ctx.rank + 1) * 4)
    with torch.no_grad():
        out_full, _ = models[0](x)
        out_local, _ = models[1](x[rows])
    kept = torch.tensor(int(models[1].layers[0].mlp.tokens_per_expert.sum()))
    dist.all_reduce(kept)
    return {"output": _max_diff(out_local, out_full[rows]), "kept": int(kept),
            "kept_one_process": int(models[0].layers[0].mlp.tokens_per_expert.sum())}


@pytest.mark.multirank
def test_switch_capacity_is_shared_across_ranks_like_one_process():
    returns = check(launch(_switch_capacity_rank, 2, backend="gloo", timeout_s=60)).returns
    assert all(r["output"] <= EP_ATOL for r in returns)
    # 40 tokens, capacity ceil(2.4 * 40 / 4) = 24 for expert 0: both runs keep exactly 24.
    assert all(r["kept"] == r["kept_one_process"] == 24 for r in returns)


@pytest.mark.multirank
def test_switch_capacity_check_catches_per_rank_capacity():
    returns = check(launch(_switch_capacity_rank, 2, args=(True,), backend="gloo", timeout_s=60)).returns
    assert any(r["output"] > EP_ATOL for r in returns) and returns[0]["kept"] != 24
