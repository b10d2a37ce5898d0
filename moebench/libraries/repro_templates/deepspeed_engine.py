"""Standalone reproduction: DeepSpeed MoE trained through deepspeed.initialize over W gloo ranks on CPU,
against the same mathematics on one process.

Needs only Python, torch and deepspeed. Run: `python THIS_FILE` (options: --deadline SECONDS).
Exit status: 1 the bug shows (the first diverging quantity is printed), 0 it does not, 2 setup error.

Model: Linear -> tanh -> deepspeed.moe.layer.MoE -> Linear. Every parameter is seeded by its GLOBAL name
(expert j of ep rank e is global expert e * local + j), so every ep_size builds the same model.
Engine: W ranks, `deepspeed.initialize` with torch's SGD (no compiled op), the settings below.
Reference: one process, the same weights, DeepSpeed's MoE at ep_size = 1 applied to each rank's slice
of the batch (capacity is per rank), gradients averaged over the W ranks and the accumulation
micro-steps, clipped by the global norm, plain SGD (p -= lr * g).
Compared at every optimizer step, in this order: each rank's loss, the gradient after the engine's
reduction (before clipping), the update the step applied (after - before = -lr x clipped gradient),
and each parameter after the step. The first quantity that differs is the bug; what follows it is
its consequence.
"""

import argparse
import datetime
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import zlib

SETTINGS = json.loads('{"zero_stage": 1, "ep_size": 2, "world_size": 2}')  # @SETTINGS@ (filled by moebench)

D_MODEL = 8
D_HIDDEN = 16
MICRO = (2, 4)  # (batch, sequence) per rank and micro-step
LR = 0.1
AUX_COEF = 0.01  # the MoE's load-balancing loss, as users add it
RTOL = 1e-5
"""Gradients, losses and parameters: fp32 sums in another order differ by ~1e-7 of their magnitude."""
UPDATE_ULPS = 4
"""An update is read as after - before of fp32 parameters: 4 ulps of the largest |parameter| bound the
rounding of both reads (a gradient 2 x too large is off by lr x |g| ~ 1e-3, 10^4 x more)."""
FLOOR = 1e-8
"""Absolute floor for a quantity whose reference is all zeros (an expert no token reached)."""
DEADLINE_S = 600.0
"""The whole run (every rank) ends within this; a process-group timeout of a fraction of it ends a
collective that never completes."""
GRACE_S = 10.0
"""After one rank fails, the others get this long to fail too before they are killed."""
PG_FRACTION = 0.5


def _env():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # no accelerator probe
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# ------------------------------------------------------------------------------------------- model


def _group_of(name):
    if ".deepspeed_experts." in name:
        return "expert"
    if ".gate.wg." in name:
        return "gate"
    if ".moe.mlp." in name or ".moe.coefficient." in name:
        return "residual"
    return "dense"


def _global_name(name, ep_rank, local):
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
            gname = _global_name(name, ep_rank, local)
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
    return torch.nn.functional.mse_loss(pred.float(), y) + AUX_COEF * aux.float()


# ------------------------------------------------------------------------------------------- ranks


def _watchdog(deadline):
    """Ends this process when the parent is gone or the deadline passed (never an orphan)."""
    parent = os.getppid()

    def watch():
        while True:
            if os.getppid() != parent or time.time() > deadline:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()


def _init(rank, world, store_path, deadline):
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=max(5.0, (deadline - time.time()) * PG_FRACTION))
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timeout)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of the shm comm op
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)


def _expert_groups(ep_size):
    """DeepSpeed's expert / expert-data groups for ep_size, created now (as deepspeed.initialize would,
    through the same private module `deepspeed.utils.groups` DeepSpeed's MoE layer calls) so that each
    expert is seeded by its global index BEFORE the engine copies the weights; this rank's ep rank."""
    from deepspeed.utils import groups

    name = f"ep_size_{ep_size}"
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size)
    return groups._get_expert_parallel_rank(name)


def _quiet():
    import logging
    import warnings

    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    warnings.simplefilter("ignore")


def engine_rank(rank, world, store_path, out, deadline):
    """One of the W ranks: the engine as DeepSpeed's users run it; records what it did."""
    phase = "setup"
    try:
        _watchdog(deadline)
        _env()
        import torch

        _init(rank, world, store_path, deadline)
        import deepspeed
        import deepspeed.comm as ds_dist
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
        from deepspeed.utils import safe_get_full_grad

        _quiet()
        ep, experts, accum = SETTINGS["ep_size"], SETTINGS.get("experts", world), SETTINGS.get("grad_accum", 1)
        model = build(ep, experts)
        ep_rank = _expert_groups(ep)
        seed_weights(model, ep_rank)
        local = model.moe.num_local_experts
        config = {"train_micro_batch_size_per_gpu": MICRO[0], "gradient_accumulation_steps": accum,
                  "train_batch_size": MICRO[0] * accum * world, "zero_optimization": {"stage": SETTINGS["zero_stage"]},
                  "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
                  "gradient_clipping": float(SETTINGS.get("clip", 0.0))}
        if SETTINGS.get("precision", "fp32") == "bf16":
            config["bf16"] = {"enabled": True}
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "parameters"})
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(groups, lr=LR), config=config)
        names = [(n, _global_name(n, ep_rank, local), p) for n, p in engine.module.named_parameters()]
        records = []
        phase = "training"
        for step in range(SETTINGS.get("steps", 2)):
            for micro in range(accum):
                x, y = batch(step, micro, rank)
                dtype = next(engine.module.parameters()).dtype
                loss = loss_of(engine(x.to(dtype)), y)
                records.append((step, 0, f"loss (rank {rank}, micro-step {micro + 1})", "loss",
                                loss.detach().double().reshape(1)))
                engine.backward(loss)
                if micro == accum - 1:  # the boundary: gradients reduced, the step not yet taken
                    for _, gname, p in names:
                        grad = safe_get_full_grad(p)  # a collective at ZeRO 1/2: every rank, same order
                        if grad is not None:
                            records.append((step, 1, f"{gname} reduced gradient", _group_of(gname),
                                            grad.detach().double().clone()))
                    before = {gname: p.detach().double().clone() for _, gname, p in names}
                engine.step()  # after every backward: DeepSpeed counts micro-steps here
            for _, gname, p in names:
                after = p.detach().double().clone()
                records.append((step, 2, f"{gname} update applied by the step", _group_of(gname),
                                after - before[gname], before[gname]))
                records.append((step, 3, f"{gname} after the step", _group_of(gname), after))
        _save(out, rank, {"records": records, "ep_rank": ep_rank})
        phase = "teardown"
        ds_dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent, which decides the exit status
        _fail(out, rank, phase)
        os._exit(1)
    os._exit(0)


def reference_rank(world, store_path, out, deadline):
    """The reference: one process, ep_size = 1, each rank's slice through the same layer, plain math."""
    phase = "setup"
    try:
        _watchdog(deadline)
        _env()
        import torch

        _init(0, 1, store_path, deadline)
        _quiet()
        experts, accum = SETTINGS.get("experts", world), SETTINGS.get("grad_accum", 1)
        clip = float(SETTINGS.get("clip", 0.0))
        model = build(1, experts)
        _expert_groups(1)
        model.moe.set_deepspeed_parallelism()
        seed_weights(model, 0)
        params = list(model.named_parameters())
        records, norms = [], []
        phase = "training"
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
                records.append((step, 1, f"{n} reduced gradient", _group_of(n), grads[n].clone()))
            norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
            scale = clip / (norm + 1e-6) if clip > 0 and norm > clip else 1.0
            norms.append(norm)
            with torch.no_grad():
                for n, p in params:
                    before = p.detach().double().clone()
                    p.sub_((LR * scale * grads[n]).to(p.dtype))
                    records.append((step, 2, f"{n} update applied by the step", _group_of(n),
                                    -LR * scale * grads[n], before))
                    records.append((step, 3, f"{n} after the step", _group_of(n), p.detach().double().clone()))
        _save(out, "reference", {"records": records, "norms": norms})
    except BaseException:  # noqa: BLE001
        _fail(out, "reference", phase)
        os._exit(1)
    os._exit(0)


def _save(out, who, data):
    import torch

    path = os.path.join(out, f"{who}.pt")
    torch.save(data, path + ".tmp")
    os.replace(path + ".tmp", path)


def _fail(out, who, phase):
    with open(os.path.join(out, f"{who}.err"), "w") as f:
        json.dump({"phase": phase, "traceback": traceback.format_exc()}, f)


# ------------------------------------------------------------------------------------------- parent


def _judge(name, actual, expected, before=None):
    """(ok, max abs diff, allowed, ratio actual/expected by least squares)."""
    import torch

    if actual.shape != expected.shape:
        return False, float("inf"), 0.0, float("nan")
    diff = float((actual - expected).abs().max()) if actual.numel() else 0.0
    magnitude = float(expected.abs().max()) if expected.numel() else 0.0
    allowed = max(RTOL * magnitude, FLOOR)
    if before is not None:  # an update read from fp32 parameters
        allowed += UPDATE_ULPS * torch.finfo(torch.float32).eps * float(before.abs().max())
    denom = float((expected * expected).sum())
    ratio = float((actual * expected).sum()) / denom if denom > 0 else float("nan")
    return diff <= allowed, diff, allowed, ratio


KINDS = ("loss", "reduced gradient", "applied update", "parameter after the step")


def compare(results, world):
    """Every rank's records against the reference's, in (step, kind) order: the first that differs."""
    reference = {(s, k, n): rest for s, k, n, *rest in results["reference"]["records"]}
    rows = []
    for rank in range(world):
        for s, k, n, group, tensor, *before in results[rank]["records"]:
            ref = reference.get((s, k, n))
            if ref is None:
                rows.append((s, k, rank, n, group, False, float("inf"), 0.0, float("nan"), tensor, None))
                continue
            ok, diff, allowed, ratio = _judge(n, tensor, ref[1], before[0] if before else None)
            rows.append((s, k, rank, n, group, ok, diff, allowed, ratio, tensor, ref[1]))
    rows.sort(key=lambda r: (r[0], r[1], r[2]))
    return rows


def report(rows):
    bad = [r for r in rows if not r[5]]
    compared = len(rows)
    if not bad:
        print(f"OK: {compared} quantities agree with the one-process reference (exit 0).")
        return 0
    s, k, rank, name, group, _, diff, allowed, ratio, actual, expected = bad[0]
    zero = SETTINGS["zero_stage"]
    print(f"BUG: first divergence at ZeRO {zero}, step {s + 1}, {KINDS[k]} of the {group} group (rank {rank}):")
    print(f"  {name}")
    print(f"  max abs diff {diff:.3e} (allowed {allowed:.1e}); actual/expected ratio {ratio:.4g}")
    if expected is not None:
        print(f"  expected {_head(expected)}")
    print(f"  actual   {_head(actual)}")
    same_kind = [r for r in bad if (r[0], r[1]) == (s, k)]
    groups = sorted({r[4] for r in same_kind})
    print(f"  at that step and kind {len(same_kind)} quantities differ, in group(s): {', '.join(groups)}")
    print(f"  {_mechanism(k, same_kind)}")
    later = len(bad) - len(same_kind)
    print(f"  {later} later quantities differ as well: consequences of the first.")
    print(f"{len(bad)} of {compared} quantities differ (exit 1).")
    return 1


COMMON = 1e-3
"""Ratios within this relative spread are one common factor."""


def _mechanism(kind, rows):
    """One sentence: what the first divergence says about its mechanism."""
    ratios = [r[8] for r in rows]
    common = all(math.isfinite(x) for x in ratios) and max(ratios) - min(ratios) <= COMMON * abs(max(ratios))
    factor = f"{ratios[0]:.4g}" if common else "varying factors"
    groups = ", ".join(sorted({r[4] for r in rows}))
    if kind == 0:
        return "the forward pass differs (the gate, the experts' exchange or the model itself)."
    if kind == 1:
        return f"the reduced gradients of the {groups} group(s) differ (scaled by {factor})."
    if kind == 2 and common:
        return (f"reduced gradients agree, every differing update is scaled by one factor ({factor}): "
                "the global gradient norm or the clip coefficient differs.")
    if kind == 2:
        return "reduced gradients agree, the applied step does not: partitioning or the copy back."
    return "the update agrees, the parameter does not: the updated partition was copied back wrongly."


def _head(t, n=4):
    values = ", ".join(f"{v:.6g}" for v in t.flatten()[:n].tolist())
    return f"[{values}{', ...' if t.numel() > n else ''}] (shape {list(t.shape)})"


def _describe():
    keys = ("zero_stage", "ep_size", "grad_accum", "clip", "precision", "top_k", "drop_tokens", "use_residual",
            "steps", "seed")
    shown = ", ".join(f"{k}={SETTINGS[k]}" for k in keys if k in SETTINGS)
    return f"DeepSpeed engine, {SETTINGS['world_size']} gloo ranks: {shown}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds for the whole run")
    args = parser.parse_args(argv)
    _env()
    try:
        import deepspeed  # noqa: F401
        import torch
        import torch.multiprocessing as mp
    except Exception as exc:  # noqa: BLE001
        print(f"setup error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    world = int(SETTINGS["world_size"])
    import textwrap

    print(textwrap.fill(f"{_describe()}; deepspeed {deepspeed.__version__}, torch {torch.__version__}", 79))
    deadline = time.time() + args.deadline
    ctx = mp.get_context("spawn")
    procs = []

    def stop(signum, _frame):
        raise KeyboardInterrupt(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    with tempfile.TemporaryDirectory(prefix="ds-repro-") as out:
        try:
            store = os.path.join(out, "store")
            procs = [ctx.Process(target=engine_rank, args=(r, world, store, out, deadline), daemon=True)
                     for r in range(world)]
            procs.append(ctx.Process(target=reference_rank, args=(world, os.path.join(out, "ref-store"), out,
                                                                  deadline), daemon=True))
            for p in procs:
                p.start()
            failed_at = None
            while any(p.is_alive() for p in procs):
                now = time.time()
                if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                    failed_at = now
                if now > deadline or (failed_at is not None and now > failed_at + GRACE_S):
                    break
                time.sleep(0.2)
            hung = [i for i, p in enumerate(procs) if p.is_alive()]
            _kill(procs)
            errors = _errors(out, world)
            if errors:
                who, err = errors[0]
                print(f"{who} failed during {err['phase']}:", file=sys.stderr)
                print(err["traceback"].rstrip(), file=sys.stderr)
                if err["phase"] == "setup":
                    return 2
                print(f"BUG: {who} raised during {err['phase']} (exit 1).")
                return 1
            if hung:
                names = ", ".join("reference" if i == world else f"rank {i}" for i in hung)
                print(f"BUG: {names} did not finish within {args.deadline:g} s (a hang); killed (exit 1).")
                return 1
            if any(p.exitcode != 0 for p in procs):
                print(f"error: a rank exited with {[p.exitcode for p in procs]} and no report", file=sys.stderr)
                return 2
            results = {r: torch.load(os.path.join(out, f"{r}.pt"), weights_only=False) for r in range(world)}
            results["reference"] = torch.load(os.path.join(out, "reference.pt"), weights_only=False)
            clip = float(SETTINGS.get("clip", 0.0))
            if clip > 0:
                norms = ", ".join(f"{n:.3g}" for n in results["reference"]["norms"])
                print(f"reference global gradient norm per step: {norms}; clip {clip:g} binds where it is smaller")
            return report(compare(results, world))
        except KeyboardInterrupt:
            print("interrupted: ranks killed", file=sys.stderr)
            return 130
        finally:
            _kill(procs)
            signal.signal(signal.SIGTERM, previous)


def _kill(procs):
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.kill()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=5)


def _errors(out, world):
    found = []
    for who in [*range(world), "reference"]:
        path = os.path.join(out, f"{who}.err")
        if os.path.exists(path):
            with open(path) as f:
                found.append(("reference" if who == "reference" else f"rank {who}", json.load(f)))
    return found


if __name__ == "__main__":
    sys.exit(main())
