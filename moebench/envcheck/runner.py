"""Run every section in order: `run_all()` for the command, `summary()` for training runs' env.json."""

from __future__ import annotations

import datetime
import socket
import time

from moebench.envcheck import (
    capabilities,
    comm,
    constraints,
    deepspeed_stack,
    fastmoe_stack,
    frameworks,
    host,
    reference_stack,
    torch_cuda,
)
from moebench.envcheck import probe as collective_probe
from moebench.envcheck.check import PLATFORM, Check, Report, require_probe_timeout
from moebench.version import __version__

DEFAULT_PROBE_TIMEOUT_S = 30.0
"""The probe takes ~0.1 s on gloo; 30 s leaves room for a slow NCCL init before a hang is declared."""


def run_all(probe: bool = True, probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S, *,
            import_deepspeed: bool = True, mode: str = "full") -> Report:
    """Every check. `probe` runs the live collective probe; `import_deepspeed` imports DeepSpeed (timed,
    output captured, checked to build nothing)."""
    if probe_timeout_s <= 0:
        raise ValueError(f"probe_timeout_s must be > 0, got {probe_timeout_s}")
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    start = time.monotonic()
    checks: list[Check] = []

    def lookup(check_id: str) -> Check | None:
        return next((c for c in checks if c.id == check_id), None)

    checks += host.checks()
    checks += constraints.checks()
    checks += torch_cuda.checks()
    checks += comm.checks()
    gpu_count = lookup("cuda.devices").data.get("torch_device_count", 0)
    checks += collective_probe.checks(enabled=probe, timeout_s=probe_timeout_s, gpu_count=gpu_count)
    ds_import = deepspeed_stack.import_deepspeed() if import_deepspeed and deepspeed_stack.installed() else None
    checks += deepspeed_stack.checks(ds_import)
    checks += fastmoe_stack.checks(lookup)
    if mode == "full":  # not in a training run's env.json: the frameworks are verify-parity's, not the run's
        checks += frameworks.checks((lookup("torch.version") or Check(id="-", section=PLATFORM, title="-",
                                                                      status="skip", found="")).data.get("version"))
    checks += reference_stack.checks(lookup)
    checks += capabilities.checks(lookup)
    return Report(checks=checks, mode=mode, created=created, elapsed_s=time.monotonic() - start,
                  probe={"enabled": probe, "timeout_s": probe_timeout_s}, moebench_version=__version__,
                  hostname=socket.gethostname())


REPORT_FILE = "envcheck.json"
"""The document env-check saves in its run folder (what `--json` prints)."""


def check_and_record(*, probe: bool = True, probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S, strict: bool = False,
                     results_dir: str | None = None) -> tuple[Report, dict, int]:
    """env-check for the CLI and the Python API alike: validate, run every check, save
    results/env/<run-id>/envcheck.json and its summary. Returns (report, the saved document,
    the exit code: 0, or 1 when something failed or, with `strict`, warned)."""
    from moebench import results

    require_probe_timeout(probe_timeout_s)
    results.check_root(results_dir, "env")
    from moebench import envcheck

    started = time.time()
    report = envcheck.run_all(probe=probe, probe_timeout_s=probe_timeout_s)  # through the package: tests patch it
    run = results.RunDir.create("env", root=results.results_root(results_dir), started=started)  # the checks' time
    report.results_path = str(run.path / REPORT_FILE)
    document = report.to_dict()
    run.write_json(REPORT_FILE, document)
    code = report.exit_code(strict)
    run.finish(results.STATUS_OK if report.status != "fail" else results.STATUS_FAILED,
               {"counts": document["counts"], "exit_code": code, "strict": strict, "report": REPORT_FILE})
    return report, document, code


def summary() -> dict:
    """The fast subset (no collective probe, no DeepSpeed import) as a JSON-ready dict, for env.json."""
    return run_all(probe=False, import_deepspeed=False, mode="summary").to_dict()
