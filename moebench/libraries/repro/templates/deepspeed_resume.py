"""Reproduce a DeepSpeed resume row (named above): save -> load into a fresh engine -> compare every restored slot.

Standalone (stdlib, torch, deepspeed). Exit 1: a slot's restored state differs from the state at the save;
0: everything restored bit for bit; 2: setup error, refused load or deadline."""
import datetime
import json
import logging
import math
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import traceback

SETTINGS = json.loads('{"world": 2}')  # @SETTINGS@ (filled by moebench)
S = SETTINGS
os.environ.setdefault("DS_ACCELERATOR", "cpu")
PREFIX = "moe.deepspeed_moe.experts.deepspeed_experts."


def build(seed, ep, stage, universal=False):
    import deepspeed
    import torch
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import groups
    from torch import nn

    world, d, h = S["world"], S["d_model"], S["d_hidden"]
    experts = S["experts_per_rank"] * world
    if f"ep_size_{ep}" not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep, use_data_before_expert_parallel_=S["data_before_expert"])
    ep_rank = groups._get_expert_parallel_rank(f"ep_size_{ep}")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed)
            self.inp = nn.Linear(d, d)
            self.moe = MoE(hidden_size=d, expert=nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d)),
                           num_experts=experts, ep_size=ep, k=1, capacity_factor=1.0, eval_capacity_factor=1.0,
                           min_capacity=0, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
            local = self.moe.deepspeed_moe.experts.deepspeed_experts
            for j, expert in enumerate(local):  # every global expert seeded by its index (any ep_size)
                g = ep_rank * len(local) + j
                gen = torch.Generator().manual_seed((seed * 1_000_003 + g) % (2**63 - 1))
                with torch.no_grad():
                    for m in expert.modules():
                        if isinstance(m, nn.Linear):
                            nn.init.kaiming_uniform_(m.weight, a=math.sqrt(5), generator=gen)
                            bound = 1.0 / math.sqrt(m.in_features)
                            nn.init.uniform_(m.bias, -bound, bound, generator=gen)
            torch.manual_seed(seed + 1)
            self.out = nn.Linear(d, d)

        def forward(self, x):
            y, aux, _ = self.moe(torch.tanh(self.inp(x)))
            return self.out(y), aux

    class GroupStepAdam(torch.optim.Adam):
        """torch's Adam keeping `step` in its param groups too (DeepSpeed's elastic checkpoint reads it there)."""

        def step(self, closure=None):
            loss = super().step(closure)
            for group in self.param_groups:
                steps = [self.state[p]["step"] for p in group["params"] if "step" in self.state.get(p, {})]
                if steps:
                    group["step"] = int(steps[0])
            return loss

    model = Net()
    config = {"train_batch_size": S["micro"][0] * world, "train_micro_batch_size_per_gpu": S["micro"][0],
              "zero_optimization": {"stage": stage, "elastic_checkpoint": S["elastic"]},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
              "use_data_before_expert_parallelism": S["data_before_expert"],
              "checkpoint": {"load_universal": universal}}
    params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                   "name": "parameters"})
    adam = GroupStepAdam if S["elastic"] else torch.optim.Adam
    engine, *_ = deepspeed.initialize(model=model, optimizer=adam(params, lr=S["lr"]), config=config)
    return engine, ep_rank, experts // ep


def train(engine, steps, rank):
    import torch

    for step in steps:
        g = torch.Generator().manual_seed(S["seed"] * 10_000 + 9_000 + 10 * step + rank)
        x = torch.randn(*S["micro"], S["d_model"], generator=g)
        y = torch.randn(*S["micro"], S["d_model"], generator=g)
        pred, aux = engine(x)
        engine.backward(torch.nn.functional.mse_loss(pred, y) + 0.01 * aux)
        engine.step()


def full(engine, p, key):
    """ZeRO 1/2: p's fp32 master (key None) or optimizer state, from the flat partitions the optimizer steps."""
    import torch
    import torch.distributed as dist

    opt, buf = engine.optimizer, torch.zeros(p.numel())
    m = getattr(p, "_hp_mapping", None)
    if m is not None:
        flat = opt.single_partition_of_fp32_groups[m.param_group_index]
        src = flat if key is None else opt.optimizer.state.get(flat, {}).get(key)
        if src is not None:
            if key == "step":
                buf.fill_(float(src))
            else:
                lp, hp = m.lp_fragment_address, m.hp_fragment_address
                buf.narrow(0, lp.start, lp.numel).copy_(src.detach().reshape(-1).narrow(0, hp.start, hp.numel))
    dist.all_reduce(buf, op=dist.ReduceOp.MAX if key == "step" else dist.ReduceOp.SUM, group=p._dp_group)
    return buf[:1].double() if key == "step" else buf


def state(engine, stage, ep_rank, n_local):
    """{unit: {quantity: flat tensor}}: unit = global expert index or dense parameter name."""
    import torch

    units = {}
    for name, p in sorted(engine.module.named_parameters()):
        unit = name
        if name.startswith(PREFIX):
            unit = ep_rank * n_local + int(name[len(PREFIX):].split(".")[0])
        q = {"weights": p.detach().reshape(-1).float().clone()}
        if stage == 0:
            st = engine.optimizer.state.get(p, {})
            q["exp_avg"] = st.get("exp_avg", torch.zeros_like(p)).reshape(-1).float().clone()
            q["exp_avg_sq"] = st.get("exp_avg_sq", torch.zeros_like(p)).reshape(-1).float().clone()
            q["step"] = torch.tensor([float(st.get("step", 0))], dtype=torch.float64)
        else:
            q["fp32 master"] = full(engine, p, None)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                q[key] = full(engine, p, key)
        old = units.setdefault(unit, {k: [] for k in q})
        for k, v in q.items():
            old[k].append(v)
    return {u: {k: (torch.stack(v).max().reshape(1) if k == "step" else torch.cat(v)) for k, v in qs.items()}
            for u, qs in units.items()}


def rank_main(rank, store, folder, out):
    import torch
    import torch.distributed as dist

    try:
        import deepspeed
        import deepspeed.ops
        from deepspeed.utils import logger

        logger.setLevel(logging.ERROR)  # "ZeRO with an untested optimizer": torch's Adam is the point
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of the shm op
        os.environ["LOCAL_RANK"] = str(rank)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=S["world"],
                                timeout=datetime.timedelta(seconds=60))
        deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
        a, a_rank, a_local = build(S["seed"], S["ep_size"], S["zero_stage"])
        train(a, range(S["save_steps"]), rank)
        want = {}
        parts = [None] * S["world"]
        dist.all_gather_object(parts, state(a, S["zero_stage"], a_rank, a_local))
        for part in parts:
            for u, qs in part.items():
                want.setdefault(u, qs)
        if S["universal"]:
            setattr(a.module, "universal_checkpoint_info", {})
        a.save_checkpoint(folder, tag="resume")
        if S["universal"] and rank == 0:
            import argparse

            from deepspeed.checkpoint import ds_to_universal

            ds_to_universal.main(argparse.Namespace(
                input_folder=os.path.join(folder, "resume"), output_folder=os.path.join(folder, "resume_universal"),
                num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                inject_missing_state=False))
            with open(os.path.join(folder, "latest_universal"), "w") as f:
                f.write("resume_universal")
        dist.barrier()
        b, b_rank, b_local = build(S["seed"] + S["fresh_offset"], S["load_ep_size"], S["load_zero_stage"],
                                   S["universal"])
        fresh = state(b, S["load_zero_stage"], b_rank, b_local)
        b.load_checkpoint(folder, tag=None if S["universal"] else "resume",
                          load_optimizer_states=S["load_optimizer_states"])
        got = state(b, S["load_zero_stage"], b_rank, b_local)
        quantities = ["weights"] + (["fp32 master"] if S["load_zero_stage"] else [])
        if S["load_optimizer_states"]:
            quantities += ["exp_avg", "exp_avg_sq", "step"]
        wrong = []
        for u in sorted(got, key=lambda u: (isinstance(u, str), u)):
            for q in quantities:
                if not torch.equal(got[u][q].double(), want[u][q].double()):
                    holds = [v for v, qs in want.items() if v != u and torch.equal(got[u][q].double(),
                                                                                   qs[q].double())]
                    is_fresh = torch.equal(got[u][q].double(), fresh[u][q].double())
                    wrong.append({"rank": rank, "unit": u, "quantity": q,
                                  "expected": [f"{v:.6g}" for v in want[u][q][:4].tolist()],
                                  "actual": [f"{v:.6g}" for v in got[u][q][:4].tolist()],
                                  "holds": holds[0] if holds else None,
                                  "fresh": is_fresh})
        out.put((rank, {"wrong": wrong}))
    except Exception:  # noqa: BLE001 - reported by the parent
        out.put((rank, {"error": traceback.format_exc()}))


def main():
    import deepspeed  # noqa: F401 - imported once, before the ranks fork

    folder = tempfile.mkdtemp(prefix="ds-resume-repro-")
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, os.path.join(folder, "store"), folder, out))
             for r in range(S["world"])]
    for p in procs:
        p.start()
    results, deadline = {}, S["deadline_s"]
    try:
        import queue
        import time

        end = time.monotonic() + deadline
        while len(results) < S["world"]:
            try:
                rank, res = out.get(timeout=max(0.1, end - time.monotonic()))
            except queue.Empty:
                print(f"setup error: ranks did not finish within {deadline} s", file=sys.stderr)
                return 2
            results[rank] = res
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        shutil.rmtree(folder, ignore_errors=True)
    errors = [(r, res["error"]) for r, res in sorted(results.items()) if "error" in res]
    if errors:
        rank, error = errors[0]
        print(f"setup error or refused load on rank {rank}:\n{error}", file=sys.stderr)
        return 2
    wrong = [w for r in sorted(results) for w in results[r]["wrong"]]
    print(S["key"])
    print(f"DeepSpeed {S['version']}, seed {S['seed']}: {len(wrong)} restored slot(s) differ")
    if not wrong:
        return 0
    w = wrong[0]
    what = f"global expert {w['unit']}" if isinstance(w["unit"], int) else w["unit"]
    print(f"first: rank {w['rank']}, {what}, {w['quantity']} after the load")
    print(f"  expected (at the save): {', '.join(w['expected'])}, ...")
    print(f"  actual (after the load): {', '.join(w['actual'])}, ...")
    if w["holds"] is not None:
        print(f"  it holds {'global expert ' if isinstance(w['holds'], int) else ''}{w['holds']}'s {w['quantity']}")
    elif w["fresh"]:
        print("  it is the fresh initialisation: never restored")
    return 1


if __name__ == "__main__":
    sys.exit(main())
