"""The part every reproduction script shares (moebench pastes it into each script: see repro.py `fill`).

Parent: spawns the W library ranks and one reference process (each with its own gloo group on a
FileStore: no port), waits under an overall deadline, kills every child on every way out (Ctrl-C and
SIGTERM included), then compares each rank's records with the reference's and prints the first that
differs. A record is (step, kind, name, group, tensor[, value before the step]); kinds are compared in
the order of KINDS, the first differing one is the bug, later ones its consequences.
Exit: 1 the bug shows (or a rank raised while training, or hung), 0 it does not, 2 setup error.
"""

import argparse
import datetime
import json
import math
import os
import signal
import sys
import tempfile
import textwrap
import threading
import time
import traceback

DEADLINE_S = 600.0
"""The whole run (every process) ends within this (--deadline); a process-group timeout of PG_FRACTION of
what is left ends a collective that never completes."""
PG_FRACTION = 0.5
GRACE_S = 10.0
"""After one process fails, the others get this long to fail too before they are killed."""
RTOL = 1e-5
"""Relative to the largest |value| of the reference quantity: fp32 sums in another order differ by ~1e-7."""
UPDATE_ULPS = 4
"""An update is read as after - before of fp32 parameters: 4 ulps of the largest |parameter| bound the
rounding of both reads (a gradient 2 x too large is off by lr x |g|, orders of magnitude more)."""
FLOOR = 1e-8
"""Absolute floor for a quantity whose reference is all zeros (an expert no token reached)."""
COMMON = 1e-3
"""Ratios within this relative spread are one common factor."""
SETUP, TRAINING = "setup", "training"


def env_defaults():
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def watchdog(deadline):
    """Ends this process when its parent is gone or the deadline passed (never an orphan)."""
    parent = os.getppid()

    def watch():
        while True:
            if os.getppid() != parent or time.time() > deadline:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()


def gloo(rank, world, store_path, deadline):
    """This process's gloo group over a FileStore, with a timeout within the deadline."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=max(5.0, (deadline - time.time()) * PG_FRACTION))
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timeout)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))


def init_deepspeed(rank, world, store_path, deadline, *, quiet_transformers=False):
    """This process's gloo group (`gloo`), then DeepSpeed's distributed state on it, on its CPU accelerator, with no
    JIT build and its (and, `quiet_transformers`, transformers') logging and warnings off the console."""
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
    if quiet_transformers:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    warnings.simplefilter("ignore")


def save(out, who, data):
    import torch

    path = os.path.join(out, f"{who}.pt")
    torch.save(data, path + ".tmp")
    os.replace(path + ".tmp", path)


def fail(out, who, phase):
    with open(os.path.join(out, f"{who}.err"), "w") as f:
        json.dump({"phase": phase, "traceback": traceback.format_exc()}, f)


def judge(actual, expected, before=None):
    """(agrees, max abs diff, allowed, ratio actual/expected by least squares)."""
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


def compare(results, world):
    """Every rank's records against the reference's, in (step, kind, rank) order."""
    reference = {(s, k, n): rest for s, k, n, *rest in results["reference"]["records"]}
    rows = []
    for rank in range(world):
        for s, k, n, group, tensor, *before in results[rank]["records"]:
            ref = reference.get((s, k, n))
            if ref is None:
                rows.append((s, k, rank, n, group, False, float("inf"), 0.0, float("nan"), tensor, None))
                continue
            ok, diff, allowed, ratio = judge(tensor, ref[1], before[0] if before else None)
            rows.append((s, k, rank, n, group, ok, diff, allowed, ratio, tensor, ref[1]))
    rows.sort(key=lambda r: (r[0], r[1], r[2]))
    return rows


def rows_factor(rows):
    """The one ratio every row shares (None when they do not)."""
    ratios = [r[8] for r in rows]
    if all(math.isfinite(x) for x in ratios) and max(ratios) - min(ratios) <= COMMON * abs(max(ratios)):
        return ratios[0]
    return None


def layer_mechanism(forward, backward):
    """`mechanism(kind, rows)` for a layer compared output, gradients, step (kinds 0-1, 2, 3): `forward` and
    `backward` name what the first wrong forward / gradient points at."""
    def mechanism(kind, rows):
        if kind in (0, 1):
            return f"The forward pass differs: {forward}."
        if kind == 2:
            k = rows_factor(rows)
            factor = "varying factors" if k is None else f"{k:.4g}"
            groups = ", ".join(sorted({r[4] for r in rows}))
            return (f"The forward agrees, the gradients of the {groups} group(s) do not (scaled by {factor}): "
                    f"{backward}.")
        return "The gradients agree, the parameters after the step do not."
    return mechanism


def report(rows, kinds, where, mechanism):
    """Prints the verdict; the exit status. `where` names the run ("ZeRO 1"), `mechanism(kind, rows)` says
    in one sentence what the first divergence points at."""
    bad = [r for r in rows if not r[5]]
    if not bad:
        print(f"OK: {len(rows)} quantities agree with the one-process reference (exit 0).")
        return 0
    s, k, rank, name, group, _, diff, allowed, ratio, actual, expected = bad[0]
    print(textwrap.fill(f"BUG: first divergence{where}, step {s + 1}, {kinds[k]} of the {group} group "
                        f"(rank {rank}):", 79, subsequent_indent="  "))
    print(f"  {name}")
    print(f"  max abs diff {diff:.3e} (allowed {allowed:.1e}); actual/expected ratio {ratio:.4g}")
    if expected is not None:
        print(f"  expected {head(expected)}")
    print(f"  actual   {head(actual)}")
    if expected is not None and expected.shape == actual.shape and actual.numel() > 1:
        flat = int((actual - expected).abs().flatten().argmax())
        where_max = list(divmod_all(flat, list(actual.shape)))
        print(f"  largest difference at {where_max}: expected {float(expected.flatten()[flat]):.6g}, "
              f"actual {float(actual.flatten()[flat]):.6g}")
    first = [r for r in bad if (r[0], r[1]) == (s, k)]
    groups = ", ".join(sorted({r[4] for r in first}))
    print(textwrap.fill(f"{len(first)} {kinds[k]} quantities differ at that step, in group(s): {groups}", 79,
                        initial_indent="  ", subsequent_indent="  "))
    print(textwrap.fill(mechanism(k, first), 79, initial_indent="  ", subsequent_indent="  "))
    print(f"  {len(bad) - len(first)} later quantities differ as well: consequences of the first.")
    print(f"{len(bad)} of {len(rows)} quantities differ (exit 1).")
    return 1


def divmod_all(flat, shape):
    """A flat index as one index per dimension."""
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return reversed(index)


def head(t, width=68):
    """The first values of `t` and its shape, within `width` characters (the line fits 80 columns)."""
    values, shown = t.flatten()[:8].tolist(), ""
    for n in range(len(values), 0, -1):
        more = ", ..." if t.numel() > n else ""
        shown = f"[{', '.join(f'{v:.6g}' for v in values[:n])}{more}] (shape {list(t.shape)})"
        if len(shown) <= width:
            break
    return shown


def main(*, world, library_rank, reference_rank, describe, kinds=(), where="", mechanism=None, notes=None,
         judge_results=None, argv=None):
    """Runs the W library ranks and the reference; prints and returns the exit status. `judge_results(results)`,
    when given, judges the records itself (a half-precision row's noise model) instead of comparing them
    element by element."""
    parser = argparse.ArgumentParser(description="Standalone reproduction (see the top of this file).")
    parser.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds for the whole run")
    args = parser.parse_args(argv)
    env_defaults()
    try:
        import torch
        import torch.multiprocessing as mp

        header = describe()
    except Exception as exc:  # noqa: BLE001 - the library does not import here
        print(f"setup error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(textwrap.fill(f"{header}; torch {torch.__version__}", 79))
    start = time.time()
    deadline = start + args.deadline
    ctx = mp.get_context("spawn")
    procs = []

    def stop(signum, _frame):
        raise KeyboardInterrupt(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    with tempfile.TemporaryDirectory(prefix="moe-repro-") as out:
        try:
            procs = [ctx.Process(target=library_rank, args=(r, world, os.path.join(out, "store"), out, deadline),
                                 daemon=True) for r in range(world)]
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
            hung = ["reference" if i == world else f"rank {i}" for i, p in enumerate(procs) if p.is_alive()]
            kill(procs)
            if hung:
                print(f"{', '.join(hung)} did not finish: killed after {time.time() - start:.0f} s")
            errors = _errors(out, world)
            if errors:
                who, err = errors[0]
                print(f"{who} failed during {err['phase']}:", file=sys.stderr)
                print(err["traceback"].rstrip(), file=sys.stderr)
                if err["phase"] == SETUP:
                    print(f"setup error: {who}: {err['traceback'].strip().splitlines()[-1]} (exit 2)")
                    return 2
                print(f"BUG: {who} raised during {err['phase']}: {err['traceback'].strip().splitlines()[-1]}")
                print("(exit 1)")
                return 1
            if hung:
                print(f"BUG: {', '.join(hung)} hung: no result within the {args.deadline:g} s deadline (exit 1).")
                return 1
            if any(p.exitcode != 0 for p in procs):
                print(f"setup error: exit statuses {[p.exitcode for p in procs]} and no report (exit 2)")
                return 2
            results = {r: torch.load(os.path.join(out, f"{r}.pt"), weights_only=False) for r in range(world)}
            results["reference"] = torch.load(os.path.join(out, "reference.pt"), weights_only=False)
            for line in (notes(results) if notes else ()):
                print(textwrap.fill(line, 79, subsequent_indent="  "))
            if judge_results is not None:
                return judge_results(results)
            return report(compare(results, world), kinds, where, mechanism)
        except KeyboardInterrupt:
            print("interrupted: every process of the run killed", file=sys.stderr)
            return 130
        finally:
            kill(procs)
            signal.signal(signal.SIGTERM, previous)


def kill(procs):
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
