"""Standalone reproduction: DeepSpeed MoE trained through deepspeed.initialize over W gloo ranks on CPU,
against the same mathematics on one process.

Needs only Python, torch and deepspeed. Run: `python THIS_FILE` (option: --deadline SECONDS).
Exit status: 1 the bug shows (the first diverging quantity is printed), 0 it does not, 2 setup error.

Model: Linear -> tanh -> deepspeed.moe.layer.MoE -> Linear. Every parameter is seeded by its GLOBAL name
(expert j of ep rank e is global expert e * local + j), so every ep_size builds the same model.
Engine: W ranks, `deepspeed.initialize` with torch's SGD (not Adam: Adam divides by the gradient's own
size, so a gradient scaled by k would move the weights almost as the right one does), the settings below.
DeepSpeed's CPU comm backend would JIT-build its shared-memory op; it is marked incompatible in
`deepspeed.ops.__compatible_ops__` (DeepSpeed's own switch) so gloo does the collectives.
Reference: one process, the same weights, DeepSpeed's MoE at ep_size = 1 applied to each rank's slice
of the batch (capacity is per rank), gradients averaged over the W ranks and the accumulation
micro-steps, clipped by the global norm, plain SGD (p -= lr * g).
Compared at every optimizer step, in this order: each rank's loss, the gradient after the engine's
reduction (before clipping), the update the step applied (after - before = -lr x clipped gradient),
and each parameter after the step. The first quantity that differs is the bug; what follows it is
its consequence.
"""

# ruff: noqa: F405
import math
import os
import sys
import zlib

from harness import *  # noqa: F403  @HARNESS@ (moebench pastes the shared harness here)

SETTINGS = json.loads('{"zero_stage": 1, "ep_size": 2, "world_size": 2}')  # @SETTINGS@ (filled by moebench)

D_MODEL = 8
D_HIDDEN = 16
MICRO = (2, 4)  # (batch, sequence) per rank and micro-step
LR = 0.1
AUX_COEF = 0.01  # the MoE's load-balancing loss, as users add it
KINDS = ("loss", "reduced gradient", "applied update", "parameter after the step")


def group_of(name):
    if ".deepspeed_experts." in name:
        return "expert"
    if ".gate.wg." in name:
        return "gate"
    if ".moe.mlp." in name or ".moe.coefficient." in name:
        return "residual"
    return "dense"


def global_name(name, ep_rank, local):
    """A local expert parameter's name -> the same expert's name at ep_size = 1."""
    parts = name.split(".")
    if "deepspeed_experts" in parts:
        i = parts.index("deepspeed_experts") + 1
        parts[i] = str(ep_rank * local + int(parts[i]))
    return ".".join(parts)


def build(ep_size, experts):
    import torch
    from deepspeed.moe.layer import MoE
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(D_MODEL, D_MODEL)
            expert = nn.Sequential(nn.Linear(D_MODEL, D_HIDDEN), nn.GELU(), nn.Linear(D_HIDDEN, D_MODEL))
            self.moe = MoE(hidden_size=D_MODEL, expert=expert, num_experts=experts, ep_size=ep_size,
                           k=SETTINGS.get("top_k", 1), capacity_factor=SETTINGS.get("capacity_factor", 1.0),
                           eval_capacity_factor=1.0, min_capacity=SETTINGS.get("min_capacity", 0),
                           use_residual=bool(SETTINGS.get("use_residual", False)), noisy_gate_policy=None,
                           drop_tokens=bool(SETTINGS.get("drop_tokens", False)), use_rts=False,
                           top2_2nd_expert_sampling=False)
            self.out = nn.Linear(D_MODEL, D_MODEL)

        def forward(self, x):
            y, aux, _counts = self.moe(torch.tanh(self.inp(x)))
            return self.out(y), aux

    return Net()


def seed_weights(model, ep_rank):
    """Every parameter from a generator keyed by its global name: the same model at every ep_size."""
    import torch

    local = model.moe.num_local_experts
    with torch.no_grad():
        for name, p in model.named_parameters():
            gname = global_name(name, ep_rank, local)
            gen = torch.Generator().manual_seed(SETTINGS.get("seed", 0) * 1_000_003 + zlib.crc32(gname.encode()))
            bound = 1.0 / math.sqrt(p.shape[-1] if p.dim() > 1 else D_MODEL)
            p.copy_(torch.rand(p.shape, generator=gen) * 2 * bound - bound)


def batch(step, micro, rank):
    """Rank `rank`'s slice of the global batch of optimizer step `step`, micro-step `micro`."""
    import torch

    g = torch.Generator().manual_seed(SETTINGS.get("seed", 0) * 100_003 + step * 1009 + micro * 101 + rank)
    return torch.randn(*MICRO, D_MODEL, generator=g), torch.randn(*MICRO, D_MODEL, generator=g)


def loss_of(model_out, y):
    import torch

    pred, aux = model_out
    multiplier = SETTINGS.get("loss_multiplier", 1.0)  # how a large gradient_clipping binds on this small model
    return (torch.nn.functional.mse_loss(pred.float(), y) + AUX_COEF * aux.float()) * multiplier


def init_deepspeed(rank, world, store_path, deadline):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no accelerator probe
    gloo(rank, world, store_path, deadline)
    import logging
    import warnings

    import deepspeed
    import deepspeed.ops
    from deepspeed.utils import logger

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of the shm comm op
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    logger.setLevel(logging.ERROR)
    warnings.simplefilter("ignore")


def expert_groups(ep_size):
    """DeepSpeed's expert / expert-data groups for ep_size, created now (as deepspeed.initialize would,
    through the same private module `deepspeed.utils.groups` DeepSpeed's MoE layer calls) so that each
    expert is seeded by its global index BEFORE the engine copies the weights; this rank's ep rank."""
    from deepspeed.utils import groups

    name = f"ep_size_{ep_size}"
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size)
    return groups._get_expert_parallel_rank(name)


def engine_rank(rank, world, store_path, out, deadline):
    """One of the W ranks: the engine as DeepSpeed's users run it; records what it did."""
    phase = SETUP
    try:
        watchdog(deadline)
        env_defaults()
        import torch

        init_deepspeed(rank, world, store_path, deadline)
        import deepspeed
        import deepspeed.comm as ds_dist
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
        from deepspeed.utils import safe_get_full_grad

        ep, experts, accum = SETTINGS["ep_size"], SETTINGS.get("experts", world), SETTINGS.get("grad_accum", 1)
        model = build(ep, experts)
        ep_rank = expert_groups(ep)
        seed_weights(model, ep_rank)
        local = model.moe.num_local_experts
        config = {"train_micro_batch_size_per_gpu": MICRO[0], "gradient_accumulation_steps": accum,
                  "train_batch_size": MICRO[0] * accum * world, "zero_optimization": {"stage": SETTINGS["zero_stage"]},
                  "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
                  "gradient_clipping": float(SETTINGS.get("clip", 0.0))}
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "parameters"})
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(groups, lr=LR), config=config)
        names = [(global_name(n, ep_rank, local), p) for n, p in engine.module.named_parameters()]
        records = []
        phase = TRAINING
        for step in range(SETTINGS.get("steps", 2)):
            for micro in range(accum):
                x, y = batch(step, micro, rank)
                loss = loss_of(engine(x), y)
                records.append((step, 0, f"loss (rank {rank}, micro-step {micro + 1})", "loss",
                                loss.detach().double().reshape(1)))
                engine.backward(loss)
                if micro == accum - 1:  # the boundary: gradients reduced, the step not yet taken
                    for gname, p in names:
                        grad = safe_get_full_grad(p)  # a collective at ZeRO 1/2: every rank, same order
                        if grad is not None:
                            records.append((step, 1, f"{gname} reduced gradient", group_of(gname),
                                            grad.detach().double().clone()))
                    before = {gname: p.detach().double().clone() for gname, p in names}
                engine.step()  # after every backward: DeepSpeed counts micro-steps here
            for gname, p in names:
                after = p.detach().double().clone()
                records.append((step, 2, f"{gname} update applied by the step", group_of(gname),
                                after - before[gname], before[gname]))
                records.append((step, 3, f"{gname} after the step", group_of(gname), after))
        save(out, rank, {"records": records})
        phase = "teardown"
        ds_dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent, which decides the exit status
        fail(out, rank, phase)
        os._exit(1)
    os._exit(0)


def reference_rank(world, store_path, out, deadline):
    """The reference: one process, ep_size = 1, each rank's slice through the same layer, plain math."""
    phase = SETUP
    try:
        watchdog(deadline)
        env_defaults()
        import torch

        init_deepspeed(0, 1, store_path, deadline)
        experts, accum = SETTINGS.get("experts", world), SETTINGS.get("grad_accum", 1)
        clip = float(SETTINGS.get("clip", 0.0))
        model = build(1, experts)
        expert_groups(1)
        model.moe.set_deepspeed_parallelism()
        seed_weights(model, 0)
        params = list(model.named_parameters())
        records, norms = [], []
        phase = TRAINING
        for step in range(SETTINGS.get("steps", 2)):
            model.zero_grad(set_to_none=True)
            for micro in range(accum):
                for rank in range(world):
                    x, y = batch(step, micro, rank)
                    loss = loss_of(model(x), y)
                    records.append((step, 0, f"loss (rank {rank}, micro-step {micro + 1})", "loss",
                                    loss.detach().double().reshape(1)))
                    (loss / (world * accum)).backward()
            grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().double() for n, p in params}
            for n, _ in params:
                records.append((step, 1, f"{n} reduced gradient", group_of(n), grads[n].clone()))
            norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
            scale = clip / (norm + 1e-6) if clip > 0 and norm > clip else 1.0
            norms.append(norm)
            with torch.no_grad():
                for n, p in params:
                    before = p.detach().double().clone()
                    p.sub_((LR * scale * grads[n]).to(p.dtype))
                    records.append((step, 2, f"{n} update applied by the step", group_of(n),
                                    -LR * scale * grads[n], before))
                    records.append((step, 3, f"{n} after the step", group_of(n), p.detach().double().clone()))
        save(out, "reference", {"records": records, "norms": norms})
    except BaseException:  # noqa: BLE001
        fail(out, "reference", phase)
        os._exit(1)
    os._exit(0)


def describe():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    keys = ("zero_stage", "ep_size", "grad_accum", "clip", "precision", "top_k", "drop_tokens", "use_residual",
            "steps", "seed")
    shown = ", ".join(f"{k}={SETTINGS[k]}" for k in keys if k in SETTINGS)
    if SETTINGS.get("loss_multiplier", 1.0) != 1.0:
        shown += f", loss x {SETTINGS['loss_multiplier']:g} (so that the clip binds on this small model)"
    return f"DeepSpeed {deepspeed.__version__} engine, {SETTINGS['world_size']} gloo ranks: {shown}"


NORMS = []
"""The reference's global gradient norm per step (set by `notes`, read by `mechanism`)."""


def notes(results):
    clip = float(SETTINGS.get("clip", 0.0))
    NORMS[:] = results["reference"]["norms"]
    if clip <= 0:
        return []
    norms = NORMS
    binds = [i + 1 for i, n in enumerate(norms) if n > clip]
    where = "at every step" if len(binds) == len(norms) else f"at steps {binds}" if binds else "never"
    shown = ", ".join(f"{n:.3g}" for n in norms)
    return [f"clip {clip:g} binds {where} (reference global gradient norms {shown})"]


def mechanism(kind, rows):
    """One sentence: what the first divergence says about its mechanism."""
    k = common_factor(rows)
    factor = "varying factors" if k is None else f"{k:.4g}"
    groups = ", ".join(sorted({r[4] for r in rows}))
    if kind == 0:
        return "The forward pass differs (the gate, the experts' exchange or the model itself)."
    if kind == 1:
        return f"The reduced gradients of the {groups} group(s) differ (scaled by {factor})."
    if kind == 2 and k is not None:
        said = (f"Reduced gradients agree, every differing update is scaled by one factor ({factor}): "
                "the global gradient norm or the clip coefficient differs.")
        step, clip = rows[0][0], float(SETTINGS.get("clip", 0.0))
        if clip > 0 and step < len(NORMS) and NORMS[step] > clip and k > 0:  # the update is lr * clip / norm * g
            said += (f" The engine clipped as if the global norm were {NORMS[step] / k:.4g}; the reference's "
                     f"is {NORMS[step]:.4g}.")
        return said
    if kind == 2:
        return "Reduced gradients agree, the applied step does not: partitioning or the copy back."
    return "The update agrees, the parameter does not: the updated partition was copied back wrongly."


if __name__ == "__main__":
    sys.exit(main(world=int(SETTINGS["world_size"]), library_rank=engine_rank, reference_rank=reference_rank,
                  describe=describe, kinds=KINDS, where=f" at ZeRO {SETTINGS['zero_stage']}", mechanism=mechanism,
                  notes=notes))
