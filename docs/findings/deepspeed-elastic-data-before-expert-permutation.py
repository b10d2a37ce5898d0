"""DeepSpeed: an elastic ZeRO 1/2 load with use_data_before_expert_parallelism swaps expert optimizer state.

A DeepSpeed MoE layer (8 experts, ep_size 2) on 4 processes on CPU (gloo), ZeRO stage 1 and 2 with
zero_optimization.elastic_checkpoint and use_data_before_expert_parallelism (the D + E layout: expert-data-parallel
groups [0, 1] and [2, 3]), an Adam that keeps its step in the param group as DeepSpeed's FusedAdam does. Train 2
steps, save_checkpoint, load into a fresh engine at the same layout, and compare each rank's ZeRO partition of the
experts' fp32 master and Adam moments with the one it saved. Exit 1 (printing whose experts' state each rank got)
when one differs, 0 when every partition comes back. --default-layout: the E + D layout instead (the control).
Run: DS_ACCELERATOR=cpu python deepspeed-elastic-data-before-expert-permutation.py
"""
import datetime
import multiprocessing as mp
import os
import sys
import tempfile
import time

os.environ.update(DS_ACCELERATOR="cpu")
import deepspeed  # noqa: E402
import deepspeed.ops  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.moe.layer import MoE  # noqa: E402
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: E402

WORLD, EP, EXPERTS, D = 4, 2, 8, 8
QUANTITIES = ("fp32 master", "exp_avg", "exp_avg_sq")


class GroupStepAdam(torch.optim.Optimizer):
    """Adam with its step in the param group, as FusedAdam (no op build; the elastic checkpoint saves that step)."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            g["step"] = t = g.get("step", 0) + 1
            for p in (p for p in g["params"] if p.grad is not None):
                s = self.state[p]
                if not s:
                    s["exp_avg"], s["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                s["exp_avg"].lerp_(p.grad, 1 - g["betas"][0])
                s["exp_avg_sq"].mul_(g["betas"][1]).addcmul_(p.grad, p.grad, value=1 - g["betas"][1])
                denom = (s["exp_avg_sq"] / (1 - g["betas"][1] ** t)).sqrt_().add_(g["eps"])
                p.addcdiv_(s["exp_avg"], denom, value=-g["lr"] / (1 - g["betas"][0] ** t))


def engine(seed, stage, dbe):
    torch.manual_seed(seed * 10 + dist.get_rank())  # each rank's experts differ; the engine syncs the replicas
    moe = MoE(hidden_size=D, expert=torch.nn.Linear(D, D), num_experts=EXPERTS, ep_size=EP, k=1)
    for expert in moe.deepspeed_moe.experts.deepspeed_experts:
        expert.reset_parameters()  # the local experts start as copies of one module: make each its own
    config = {"train_batch_size": 4 * WORLD, "zero_optimization": {"stage": stage, "elastic_checkpoint": True},
              "use_data_before_expert_parallelism": dbe, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9}
    params = split_params_into_different_moe_groups_for_optimizer({"params": list(moe.parameters()), "name": "p"})
    model = torch.nn.Sequential(moe)  # the MoE layer inside a model (a checkpoint's expert names need a prefix)
    return deepspeed.initialize(model=model, optimizer=GroupStepAdam(params), config=config)[0], moe


def expert_partition(e, moe):
    """This rank's ZeRO partition of the experts' param group: (experts it covers, {quantity: tensor})."""
    opt = e.optimizer
    i = next(i for i, g in enumerate(opt.optimizer.param_groups) if g.get("moe"))
    flat = opt.single_partition_of_fp32_groups[i]
    local = moe.deepspeed_moe.experts.deepspeed_experts
    first = dist.get_rank(group=moe.deepspeed_moe.ep_group) * len(local)
    held = [first + j for j, x in enumerate(local) if getattr(x.weight, "_hp_mapping", None) is not None]
    state = opt.optimizer.state[flat]
    return held, {"fp32 master": flat.clone(), "exp_avg": state["exp_avg"].clone(),
                  "exp_avg_sq": state["exp_avg_sq"].clone()}


def gathered(e, moe):
    parts = [None] * WORLD
    dist.all_gather_object(parts, expert_partition(e, moe))
    return parts


def check(stage, folder, dbe):
    a, moe = engine(0, stage, dbe)
    for step in range(2):
        x = torch.randn(16, D, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        out, aux, _ = a(x)
        a.backward(out.square().mean() + 0.01 * aux)
        a.step()
    saved = gathered(a, moe)
    a.save_checkpoint(folder, tag="step2")
    b, moe = engine(1, stage, dbe)  # another seed: whatever the load misses stays visibly fresh
    b.load_checkpoint(folder, tag="step2")
    loaded, bugs = gathered(b, moe), []
    for rank, (held, got) in enumerate(loaded):
        wrong = [q for q in QUANTITIES if not torch.equal(got[q], saved[rank][1][q])]
        if wrong:
            source = [r for r, (_, want) in enumerate(saved) if all(torch.equal(got[q], want[q]) for q in wrong)]
            whose = f"experts {saved[source[0]][0]} (rank {source[0]}'s saved partition)" if source else "no expert"
            diff = max((got[q] - saved[rank][1][q]).abs().max().item() for q in wrong)
            bugs.append(f"ZeRO {stage}: rank {rank} holds the {', '.join(wrong)} of {whose} after the load, not of "
                        f"its experts {held} (max |diff| {diff:.3g})")
    return bugs


def rank_main(rank, folder, dbe):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of DeepSpeed's shm comm op
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    deepspeed.utils.logger.setLevel("ERROR")
    lines = [line for stage in (1, 2) for line in check(stage, f"{folder}/zero{stage}", dbe)]
    if rank == 0:
        with open(f"{folder}/result.txt", "w") as f:
            f.write("\n".join(lines))


def main():
    dbe = "--default-layout" not in sys.argv
    folder = tempfile.mkdtemp()
    procs = [mp.get_context("fork").Process(target=rank_main, args=(r, folder, dbe)) for r in range(WORLD)]
    end = time.monotonic() + 300
    for p in procs:
        p.start()
    for p in procs:  # the ranks get 300 s in all; a rank still running then is killed, never waited on
        p.join(timeout=max(1.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
    if any(p.exitcode != 0 for p in procs) or not os.path.exists(f"{folder}/result.txt"):
        print(f"ERROR: a rank failed or timed out (exit codes {[p.exitcode for p in procs]})")
        return 2
    bugs = open(f"{folder}/result.txt").read().splitlines()
    layout = "use_data_before_expert_parallelism (D + E)" if dbe else "the default layout (E + D)"
    print(f"deepspeed {deepspeed.__version__}: {WORLD} ranks (gloo), ep_size {EP}, {layout}, elastic_checkpoint")
    print("\n".join(["BUG: an elastic ZeRO load gives ranks another expert-data-parallel group's expert state:",
                     *bugs] if bugs else ["OK: every rank's expert partition comes back after the elastic load"]))
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
