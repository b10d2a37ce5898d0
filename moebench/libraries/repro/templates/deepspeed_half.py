"""Standalone reproduction: DeepSpeed MoE trained through deepspeed.initialize in half precision (fp16 or bf16) over W
gloo ranks on CPU, against the same mathematics on one process: the row of `moebench verify-parity --library
deepspeed` named on the first line, with its settings, seed and data.

Needs only Python, torch and deepspeed. Run: `python THIS_FILE` (option: --deadline SECONDS).
Exit status: 1 the bug shows (the first diverging step and its mechanism are printed), 0 it does not, 2 setup error.

fp16 on CPU: DeepSpeed refuses fp16 where its CPU accelerator says this CPU has no fp16 (`is_fp16_supported()`,
asked by `engine._do_sanity_check` and for its all-reduce dtypes); this script overrides that one answer in its rank
processes only (no DeepSpeed file changes). It is not a GPU run.

The model, its data, the loss scale over the steps and the one-process reference are the tool's own (pasted below
from moebench), and so is the judgement, so this script and the tool print the same figures:
- per step, the gradient DeepSpeed reports (`safe_get_full_grad`, divided by the step's loss scale: fp16 holds the
  gradient of the scaled loss until the step) and the update its optimizer applied to the fp32 master weights are
  compared with the float32 reference as one relative L2 distance over the whole model, which may be at most
  BF16_NOISE_RATIO x the same distance of the same mathematics in the same precision on one process (the noise);
- a step whose scaled fp16 gradients overflow on one process must be skipped (dynamic loss scaling's design);
- where a step fails, one common factor is fitted per parameter group (experts, gate, dense) before anything is
  called noise: the loss scale never applied or applied twice, a clip norm that leaves a group out, a loss scale
  left in the reported gradient.
"""

# ruff: noqa: F405
import os
import sys
import textwrap
import types

from halfmath import *  # noqa: F403  @HALFMATH@ (moebench pastes moebench/libraries/deepspeed/halfmath.py here)
from harness import *  # noqa: F403  @HARNESS@ (moebench pastes the shared harness here)
from noisemath import *  # noqa: F403  @NOISEMATH@ (moebench pastes moebench/parity/noisemath.py here)
from rowmath import *  # noqa: F403  @ROWMATH@ (moebench pastes moebench/libraries/deepspeed/rowmath.py here)
from tinymoe import *  # noqa: F403  @TINYMOE@ (moebench pastes moebench/models/deepspeed_moe.py here)

SETTINGS = json.loads('{"zero_stage": 0, "ep_size": 2, "world_size": 2, "precision": "bf16"}')  # @SETTINGS@
ROW = types.SimpleNamespace(**{"grad_accum": 1, "clip": 0.0, "precision": "bf16", "top_k": 1, "drop_tokens": False,
                               "use_residual": False, "steps": STEPS, "loss_multiplier": 1.0, "loss_scale": 0.0,
                               "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                               "consecutive_hysteresis": False, "min_loss_scale": 1, "overflow_step": 0,
                               **SETTINGS})
PREFIX = "moe.moe.deepspeed_moe.experts.deepspeed_experts."


def global_name(name, ep_rank, local):
    """A local expert parameter's name -> the same expert's name at ep_size = 1 (contiguous layout)."""
    if not name.startswith(PREFIX):
        return name
    slot, rest = name[len(PREFIX):].split(".", 1)
    return f"{PREFIX}{ep_rank * local + int(slot)}.{rest}"


def engine_rank(rank, world, store_path, out, deadline):
    """One of the W ranks: the engine as DeepSpeed's users run it; records what it did at every step."""
    phase = SETUP
    try:
        watchdog(deadline)
        env_defaults()
        import torch

        init_deepspeed(rank, world, store_path, deadline)
        import deepspeed
        import deepspeed.comm as ds_dist
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
        from deepspeed.utils import groups as ds_groups
        from deepspeed.utils import safe_get_full_grad

        ep, experts, dtype = ROW.ep_size, EXPERTS_PER_RANK * world, HALF_DTYPES[ROW.precision]
        create_expert_groups(ep)
        ep_rank = ds_groups._get_expert_parallel_rank(f"ep_size_{ep}")
        model = TinyMoENet(moe_fields(ROW, ep), experts, ROW.seed, ep_rank, d_model=D_MODEL)
        local = model.moe.num_local_experts
        param_groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "parameters"})
        # this rank process only, until it ends: held in a local, since a context manager nobody references is
        # collected at once, and its generator's cleanup would undo the answer before DeepSpeed asks
        fp16_allowed = cpu_fp16_allowed(ROW.precision == "fp16")
        fp16_allowed.__enter__()
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(param_groups, lr=LR),
                                          config=engine_config(ROW, world))
        names = {global_name(n, ep_rank, local): p for n, p in engine.module.named_parameters()}
        steps = []
        phase = TRAINING
        for step in range(ROW.steps):
            masters = fp32_masters(names, engine)
            before = {g: p.detach().double().clone() for g, p in names.items()}
            grads = {}
            for micro in range(ROW.grad_accum):
                x, y = batch(ROW.seed, ROW.zero_stage, step, micro, rank, ROW)
                engine.backward(loss_of(engine, x.to(dtype), y, ROW.loss_multiplier))
                if micro == ROW.grad_accum - 1:  # the boundary: gradients reduced, the step not yet taken
                    for g, p in names.items():
                        grad = safe_get_full_grad(p)  # a collective at ZeRO 1/2: every rank, same order
                        if grad is not None:
                            grads[g] = grad.detach().double().clone()
                engine.step()  # after every backward: DeepSpeed counts micro-steps here
            after = fp32_masters(names, engine) if masters is not None else None
            moved = ({g: after[g] - masters[g] for g in after} if after is not None else
                     {g: p.detach().double() - before[g] for g, p in names.items()})
            steps.append({"grads": grads, "moved": moved, "masters": after is not None,
                          "applied": bool(getattr(engine, "was_step_applied", lambda: True)())})
        save(out, rank, {"steps": steps})
        phase = "teardown"
        ds_dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent, which decides the exit status
        fail(out, rank, phase)
        os._exit(1)
    os._exit(0)


def reference_rank(world, store_path, out, deadline):
    """The reference: one process, ep_size = 1, in float32 (rowmath.reference_step), and the same mathematics in
    the row's precision (the noise), the loss scale following fp16's rules (halfmath.LossScaler)."""
    phase = SETUP
    try:
        watchdog(deadline)
        env_defaults()
        init_deepspeed(0, 1, store_path, deadline)
        experts, dtype = EXPERTS_PER_RANK * world, HALF_DTYPES[ROW.precision]
        create_expert_groups(1)
        ref, master, half = (TinyMoENet(moe_fields(ROW, 1), experts, ROW.seed, 0, d_model=D_MODEL) for _ in range(3))
        half = half.to(dtype)
        for model in (ref, master, half):
            model.moe.moe.set_deepspeed_parallelism()
        scaler, steps = LossScaler(ROW), []
        phase = TRAINING
        for step in range(ROW.steps):
            scale = scaler.scale
            base = reference_step(master, ROW, world, ROW.seed, step, compute=half, loss_scale=scale)
            done = reference_step(ref, ROW, world, ROW.seed, step, skip=base.skipped)
            scaler.update(base.overflow)
            steps.append({"scale": scale, "next_scale": scaler.scale, "overflow": base.overflow,
                          "skipped": done.skipped, "norm": done.norm, "grad": done.grad, "update": done.update,
                          "base_grad": base.grad, "base_update": base.update})
        save(out, "reference", {"steps": steps})
    except BaseException:  # noqa: BLE001
        fail(out, "reference", phase)
        os._exit(1)
    os._exit(0)


def describe():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    keys = ("zero_stage", "ep_size", "grad_accum", "clip", "precision", "top_k", "drop_tokens", "use_residual",
            "steps", "seed")
    fp16 = FP16_KEYS + ("overflow_step",) if ROW.precision == "fp16" else ()
    shown = ", ".join(f"{k}={SETTINGS[k]}" for k in keys + fp16 if k in SETTINGS)
    if ROW.loss_multiplier != 1.0:
        shown += f", loss x {ROW.loss_multiplier:g} (so that the clip binds on this small model)"
    cpu = "; fp16 on CPU (DeepSpeed's fp16 check overridden in each rank): not a GPU run" \
        if ROW.precision == "fp16" else ""
    return f"DeepSpeed {deepspeed.__version__} engine, {SETTINGS['world_size']} gloo ranks: {shown}{cpu}"


def sums_by_group(pairs, weight=lambda name: 1.0):
    """Per group (rowmath.GROUPS), noisemath.sums of (actual, expected) pairs by global name, each weighted."""
    import torch

    out = {g: torch.zeros(3, dtype=torch.float64) for g in GROUPS}
    for name, (a, e) in pairs:
        out[param_group(name)] += sums([(a, e)], weight(name))
    return out


def total(groups):
    return sum(groups.values())


def say(line):
    print(textwrap.fill(line, 79, subsequent_indent="  "))


def bug(tag, sentence):
    say(f"BUG: first divergence at {tag}, all groups: {sentence}")
    print("(exit 1)")
    return 1


def judge_results(results):
    """Every step as the tool judges it (the noise model, then one common factor per group); the exit status."""
    import torch

    world, steps = SETTINGS["world_size"], results["reference"]["steps"]
    weight = lambda name: (ROW.ep_size if param_group(name) == "experts" else 1) / world  # noqa: E731 - held by W/ep
    if ROW.clip > 0:
        norms = ", ".join(f"{s['norm']:.4g}" for s in steps)
        say(f"clip {ROW.clip:g} binds {'at every step' if all(s['norm'] > ROW.clip for s in steps) else 'NOT always'}"
            f" (reference global gradient norms {norms})")
    for step, ref in enumerate(steps):
        tag = f"ZeRO {ROW.zero_stage}, step {step + 1}"
        ranks = [results[k]["steps"][step] for k in range(world)]
        applied = all(m["applied"] for m in ranks)
        finite = all(bool(torch.isfinite(g).all()) for m in ranks for g in m["grads"].values())
        scale, norms = ref["scale"], group_norms(ref["grad"])
        grad = sums_by_group([(n, (g / scale, ref["grad"][n])) for m in ranks for n, g in m["grads"].items()], weight)
        read = dict(precision=ROW.precision, scale=scale, clip=ROW.clip, group_norms=norms)
        if ref["skipped"] and not applied:
            say(f"{tag}: skipped on overflow (the one-process fp16 run's scaled gradients overflow at loss scale "
                f"{scale:g}), as dynamic loss scaling does by design: loss scale {scale:g} -> {ref['next_scale']:g}")
            continue
        if ref["skipped"]:
            exact = sums_by_group([(n, (e, e)) for n, e in ref["grad"].items()])
            why = half_reading(grad=grad, grad_base=exact, update={}, update_base={}, **read)
            if why is not None and why["name"] in (NEVER_APPLIED, APPLIED_TWICE):
                return bug(tag, why["sentence"])
            return bug(tag, "the engine applied an update where the one-process fp16 run's scaled gradients "
                            f"overflow at loss scale {scale:g}")
        if not applied:
            held = "finite" if finite else "not: a loss scale applied twice overflows this way"
            return bug(tag, f"the engine skipped the step: an overflow at loss scale {scale:g} that one process does "
                            f"not see (the scaled gradients it holds are {held})")
        grad_base = sums_by_group([(n, (ref["base_grad"][n], e)) for n, e in ref["grad"].items()])
        judged = [("reduced gradient", grad, grad_base)]
        update = update_base = {}
        if all(m["masters"] for m in ranks):
            update = sums_by_group([(n, (u, ref["update"][n])) for m in ranks for n, u in m["moved"].items()], weight)
            update_base = sums_by_group([(n, (ref["base_update"][n], e)) for n, e in ref["update"].items()])
            judged.append(("applied update (fp32 masters)", update, update_base))
        ratios = []
        for what, run, base in judged:
            d_run, d_base = distance(total(run)), distance(total(base))
            ratios.append(f"{what} {d_run / d_base:.3g}")
            if not d_run <= BF16_NOISE_RATIO * d_base:
                why = half_reading(grad=grad, grad_base=grad_base, update=update, update_base=update_base, **read)
                return bug(tag, why["sentence"] if why is not None else
                           f"{ROW.precision} noise model: {what}'s distance from fp32 {d_run:.3g} > "
                           f"{BF16_NOISE_RATIO:g} x {ROW.precision} on one process ({d_base:.3g}), and no one "
                           f"factor explains it ({ROW.precision}-noise)")
        say(f"{tag}: within the noise model (distance from fp32 / the one-process {ROW.precision} run's: "
            f"{', '.join(ratios)}; at most {BF16_NOISE_RATIO:g})")
    if all(s["skipped"] for s in steps):
        print("VACUOUS: every step overflowed on one process and was skipped; nothing compared (exit 1).")
        return 1
    print(f"OK: every step agrees with the one-process reference within the {ROW.precision} noise model (exit 0).")
    return 0


if __name__ == "__main__":
    sys.exit(main(world=int(SETTINGS["world_size"]), library_rank=engine_rank, reference_rank=reference_rank,
                  describe=describe, judge_results=judge_results))
