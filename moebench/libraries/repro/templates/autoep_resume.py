"""Standalone reproduction: a DeepSpeed AutoEP checkpoint (a Hugging Face MoE model made expert-parallel inside
deepspeed.initialize) saved, loaded into a fresh model and continued over W gloo ranks on CPU: the resume row of
`moebench verify-parity --library autoep --resume` named on the first line, with its settings and seed.

Needs only Python, torch, deepspeed and transformers. Run: `python THIS_FILE` (option: --deadline SECONDS).
Exit status: 1 the bug shows (what is wrong is printed), 0 it does not, 2 setup error.

Each rank, as DeepSpeed's users resume: engine A (the row's family from its tiny config, seeded weights, nothing
downloaded; AdamW as torch's own optimizer through the config's `torch_adam`) trains, `save_checkpoint`s (for a
universal row DeepSpeed's `ds_to_universal` converts it on rank 0) and trains on: the run that never stopped. Then
DeepSpeed's expert groups are forgotten (a resumed job's fresh processes have none), engine B is built from ANOTHER
seed in the row's load layout and `load_checkpoint`s. Right after the load every expert slot of every rank and every
other parameter is matched against every global expert's state at the save (weights, fp32 master, exp_avg,
exp_avg_sq, step) and the routing bias of every rank, and the verdict is the tool's own sentence ("rank 1, local
slot 0 holds global expert 4's exp_avg; it should hold expert 2"). Then B continues and is compared with A step by
step (bit for bit in the same layout), and A with the same model on one process (torch AdamW on every rank's slice).
The model, the data, the reading of each slot and the matching are the tool's own, pasted below from moebench.
DeepSpeed's CPU comm backend would JIT-build its shared-memory op; it is marked incompatible in
`deepspeed.ops.__compatible_ops__` (DeepSpeed's own switch) so gloo does the collectives.
"""

from __future__ import annotations  # the pasted files' annotations name types this script never builds

# ruff: noqa: F405
import os
import sys

from autoep_shape import *  # noqa: F403  @AUTOEPSHAPE@ (moebench pastes moebench/libraries/autoep/shape.py here)
from harness import *  # noqa: F403  @HARNESS@ (moebench pastes the shared harness here)
from restore import *  # noqa: F403  @RESTORE@ (moebench pastes moebench/parity/restore.py here)
from resumemath import *  # noqa: F403  @AUTOEPRESUME@ (moebench pastes moebench/libraries/autoep/resumemath.py)
from rowmath import *  # noqa: F403  @AUTOEPMATH@ (moebench pastes moebench/libraries/autoep/rowmath.py here)

SETTINGS = json.loads('{"family": "mixtral", "zero_stage": 1, "autoep_size": 2, "world_size": 2}')  # @SETTINGS@
S = SETTINGS
SAME_LAYOUT = (S["load_ep_size"], S["load_zero_stage"], S["load_ep_mode"]) == (S["autoep_size"], S["zero_stage"], "")
OTHER_LAYOUT = (1e-5, 1e-4)
"""(rtol, atol) of the continued run in another layout and of A against one process: the tool's ONE_PROCESS."""


def gathered(obj):
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def mean(loss):
    import torch.distributed as dist

    total = loss.detach().double().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def weights_and_steps(engine, stage, merge):
    own = {u: (q[WEIGHTS], q[STEP]) for u, q in unit_state(engine, stage, (STEP,)).items()}
    if not merge:
        return own
    merged = {}
    for part in gathered(own):
        for u, v in part.items():
            merged.setdefault(u, v)
    return merged


def close(a, e, rtol, atol):
    return a.shape == e.shape and bool(((a.double() - e.double()).abs() <= atol + rtol * e.double().abs()).all())


def resume_rank(rank, world, store_path, out, deadline):
    """One of the W ranks: train, save, (convert), load into a fresh engine, match every slot, continue."""
    phase = SETUP
    try:
        watchdog(deadline)
        env_defaults()
        import torch
        import torch.distributed as dist

        init_deepspeed(rank, world, store_path, deadline, quiet_transformers=True)
        if S["transformers_shim"] and registry_needs_shim():
            install_registry_shim()
        phase = TRAINING
        folder, k, m = os.path.join(out, "checkpoint"), S["save_steps"], S["continue_steps"]
        seed, stage, load_stage = S["seed"], S["zero_stage"], S["load_zero_stage"]
        report = {"findings": [], "continued": None, "one": None, "kept": None, "apart": None}
        model = build(S["family"], 2, seed)
        kept_names = {id(p): n for n, p in model.named_parameters()}
        _, model_bias = routing_bias(model)
        a = initialize(model, resume_config(stage, S["autoep_size"], world))
        bias_name, a_bias = routing_bias(a.module)
        if model_bias is not None:
            report["kept"] = a_bias is not None and bool(torch.equal(a_bias, model_bias))
        losses = []
        for step in range(k):
            losses += train(a, seed, range(step, step + 1), rank)
            bias = routing_bias(a.module)[1]
            everyone = gathered(bias)
            if bias is not None and report["apart"] is None:
                apart = [q for q, b in enumerate(everyone) if not torch.equal(b, everyone[0])]
                report["apart"] = (step + 1, apart) if apart else None
        want = {}
        for part in gathered(unit_state(a, stage)):
            for u, q in part.items():
                want.setdefault(u, q)
        saved_bias = gathered(routing_bias(a.module)[1])
        a.save_checkpoint(folder, tag=TAG)
        if S["universal"] and rank == 0:
            convert_universal(folder)
        dist.barrier()
        with torch.no_grad():
            a_first = mean(loss_of(a, batch(seed, k, 0, rank)))
        a_after = []
        for step in range(k, k + m):
            losses += train(a, seed, range(step, step + 1), rank)
            a_after.append((mean(losses[-1]), weights_and_steps(a, stage, not SAME_LAYOUT)))
        held = experts_held(a.module.get_submodule(MLP[:-1]))
        named = {n: q[WEIGHTS].double() for n, q in param_state(a, stage, ()).items()}
        report["a"] = {"losses": [float(mean(x)) for x in losses], "params": units_of(named, kept_names, held, a),
                       "bias": routing_bias(a.module)[1]}
        if hasattr(a, "destroy"):
            a.destroy()
        del a
        forget_expert_groups()
        b = initialize(build(S["family"], 2, seed + S["fresh_offset"]),
                       resume_config(load_stage, S["load_ep_size"], world, universal=S["universal"],
                                     expert_parallel=not S["load_ep_mode"]))
        fresh, (_, fresh_bias) = unit_state(b, load_stage), routing_bias(b.module)
        phase = "load_checkpoint"
        load(b, folder, S["universal"])
        phase = TRAINING
        got, where = unit_state(b, load_stage), slots(b)
        for unit in sorted(got, key=lambda u: (isinstance(u, str), u)):
            if unit not in want:
                continue
            slot = Slot(rank=rank, local=where.get(unit) if isinstance(unit, int) else None, unit=unit)
            for q in [q for q in QUANTITIES if q in got[unit] and q in want[unit]]:
                candidates = {u: st[q] for u, st in want.items() if q in st}
                report["findings"].append(identify(slot, q, got[unit][q], candidates, fresh[unit][q]))
        b_bias = routing_bias(b.module)[1]
        if saved_bias[rank] is not None and b_bias is not None:
            name = label(bias_name)
            candidates = {name: saved_bias[rank], **{f"rank {q}'s {name}": t for q, t in enumerate(saved_bias)
                                                      if q != rank and not torch.equal(t, saved_bias[rank])}}
            report["findings"].append(identify(Slot(rank=rank, local=None, unit=name), WEIGHTS, b_bias,
                                               candidates, fresh_bias))
        report["shared"] = shared_step_tensors(b)
        rtol, atol = (0.0, 0.0) if SAME_LAYOUT else OTHER_LAYOUT
        with torch.no_grad():
            b_first = mean(loss_of(b, batch(seed, k, 0, rank)))
        if not close(b_first, a_first, rtol, atol):
            report["continued"] = ("first resumed loss (forward only)", float(b_first), float(a_first))
        for i, (a_loss, a_units) in enumerate(a_after):
            if report["continued"] is not None:
                break
            try:
                b_loss = mean(train(b, seed, range(k + i, k + i + 1), rank)[0])
            except Exception as exc:  # noqa: BLE001 - a resumed run that cannot train is the finding
                report["continued"] = (f"continued step {i + 1}: training raised {type(exc).__name__}: "
                                       f"{' '.join(str(exc).split())[:200]}", None, None)
                break
            for unit, (t, step) in weights_and_steps(b, load_stage, not SAME_LAYOUT).items():
                if unit in a_units and not torch.equal(step, a_units[unit][1]):
                    report["continued"] = (f"continued step {i + 1}: AdamW step of {named_unit(unit)}", float(step),
                                           float(a_units[unit][1]))
                    break
            if report["continued"] is None and not close(b_loss, a_loss, rtol, atol):
                report["continued"] = (f"continued step {i + 1}: loss", float(b_loss), float(a_loss))
            for unit, (t, _) in weights_and_steps(b, load_stage, not SAME_LAYOUT).items():
                if report["continued"] is None and unit in a_units and not close(t, a_units[unit][0], rtol, atol):
                    diff = float((t.double() - a_units[unit][0].double()).abs().max())
                    report["continued"] = (f"continued step {i + 1}: {named_unit(unit)} (max |diff| {diff:.3g})",
                                           None, None)
        save(out, rank, report)
        phase = "teardown"
        dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent, which decides the exit status
        fail(out, rank, phase)
        os._exit(1)
    os._exit(0)


def named_unit(unit):
    return f"global expert {unit}" if isinstance(unit, int) else label(unit)


def units_of(named, kept_names, held, engine):
    """AutoEP's parameters under the Hugging Face model's units (experts by global index, the router as `gate`,
    every kept parameter under the model's own name, found by identity)."""
    params = dict(engine.module.named_parameters())
    out = {}
    for n, t in named.items():
        if expert_param(n) or n.startswith(MLP + "router.gate."):
            out.update(autoep_units({n: t}, held))
        elif id(params[n]) in kept_names:
            out[kept_names[id(params[n])]] = t
    return out


def reference_rank(world, store_path, out, deadline):
    """The same model on one process (torch AdamW on every rank's slice): the tool's own reference_run."""
    phase = SETUP
    try:
        watchdog(deadline)
        env_defaults()
        if S["transformers_shim"] and registry_needs_shim():
            install_registry_shim()
        phase = TRAINING
        steps = S["save_steps"] + S["continue_steps"]
        ref = reference_run(build(S["family"], 2, S["seed"]), S["seed"], world, steps)
        save(out, "reference", {"losses": ref["losses"], "params": reference_units(ref["params"][-1]),
                                "bias": ref["bias"][-1]})
    except BaseException:  # noqa: BLE001
        fail(out, "reference", phase)
        os._exit(1)
    os._exit(0)


def verdict(results):
    """The findings in the tool's order: AutoEP's conversion, the ranks' routing bias, the restore, the continued
    run, one process. Prints what is wrong; the exit status."""
    reports = [results[r] for r in range(int(S["world_size"]))]
    lines = []
    if reports[0]["kept"] is False:
        lines.append(f"routing-bias-dropped: after deepspeed.initialize AutoEP's layer does not hold the model's "
                     f"{BIAS} (its value): AutoEP routes without it")
    if reports[0]["apart"]:
        step, ranks = reports[0]["apart"]
        lines.append(f"routing-state-diverged: at step {step}, before any save, rank(s) {ranks} hold another {BIAS} "
                     "than rank 0")
    diagnosis = diagnose_restore([f for rep in reports for f in rep["findings"]])
    if diagnosis is not None:
        lines.append(f"{diagnosis['name']}: {diagnosis['sentence']}")
    shared = max(rep["shared"] for rep in reports)
    continued = next((rep["continued"] for rep in reports if rep["continued"]), None)
    if shared:
        lines.append(f"resume-diverges: after the load {shared} optimizer state entries share one AdamW step tensor "
                     "with another: torch's AdamW increments it in place once per entry")
    if continued:
        what, got, want = continued
        lines.append(f"resume-diverges: {what}" + (f": {got:.6g} after the resume, {want:.6g} uninterrupted"
                                                   if got is not None else "") + " (the first difference)")
    ref, a = results["reference"], reports[0]["a"]
    one = [i for i, (x, y) in enumerate(zip(a["losses"], ref["losses"])) if abs(x - y) > 1e-4 + 1e-5 * abs(y)]
    for rep in reports:
        for unit, t in rep["a"]["params"].items():
            if not close(t, ref["params"][unit], *OTHER_LAYOUT):
                one.append(unit)
    if one:
        lines.append(f"one-process-differs: the run that never stopped differs from one process first at {one[0]}")
    if not lines:
        print("OK: every slot restored bit for bit, and the resumed run continues as the one that never stopped "
              "(exit 0).")
        return 0
    for line in lines:
        print(textwrap.fill(f"BUG: {line}", 79, subsequent_indent="  "))
    print("(exit 1)")
    return 1


def describe():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import transformers

    keys = ("family", "zero_stage", "autoep_size", "load_zero_stage", "load_ep_size", "load_ep_mode", "universal",
            "save_steps", "continue_steps", "seed")
    shown = ", ".join(f"{key}={S[key]}" for key in keys if S.get(key) not in ("", None))
    return (f"DeepSpeed {deepspeed.__version__} AutoEP, transformers {transformers.__version__}, "
            f"{S['world_size']} gloo ranks: {shown}")


if __name__ == "__main__":
    sys.exit(main(world=int(S["world_size"]), library_rank=resume_rank, reference_rank=reference_rank,
                  describe=describe, judge_results=verdict))
