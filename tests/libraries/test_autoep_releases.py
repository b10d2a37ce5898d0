"""Real releases around the pinned ones, side-installed (slow tier): older DeepSpeed releases that ship AutoEP
(0.19.2, its first; 0.19.5) with the venv's transformers, and transformers 5.22.2 (the newest AutoEP runs with as
shipped) with the pinned DeepSpeed. Each is `pip install --target` into a cache folder (never the venv) and put first
on PYTHONPATH of a CLI run; the test asserts every row's verdict and finding (docs/libraries/autoep.md gives each
finding with its upstream issue)."""

from __future__ import annotations

import os

import pytest
from helpers.releases import side_install
from test_autoep import REPO, cli_rows, expected, verdicts

from moebench.libraries.autoep import ADAPTER, compat

pytestmark = pytest.mark.slow


def older_release(row) -> str:
    """A row's verdict on DeepSpeed 0.19.2 and 0.19.5 (what they lack that 0.19.8 has, in the order a row meets it):
    - AutoEP as shipped fails with transformers 5.23+ as on 0.19.8 (the same registry calls);
    - no remap of a client optimizer, and a config-built one from a parameter list made before initialize, after
      AutoEP replaced the router and experts: at ZeRO 0 they never train (not-stepped), ZeRO 1/2 refuse them;
    - DeepSeek-V3's score-correction bias is dropped (copied only when it is an nn.Parameter; transformers keeps a
      buffer): its routing differs (deepspeedai/DeepSpeed#8369);
    - with gradient accumulation the engine's output hooks scale the logits' gradient by 1/grad_accum on top of the
      loss's: every gradient halved (deepspeedai/DeepSpeed#8245, issue #8224);
    - ZeRO 0 clipping at autoep_size > 1: DeepSpeed#8475, as on 0.19.8."""
    s = row.settings
    if compat.needs_shim(s.transformers) and not s.transformers_shim:
        return "incompatible-release"
    if s.optimizer in ("client", "config-list"):
        return "not-stepped" if s.zero_stage == 0 else "refused"
    if s.family == "deepseek_v3":
        return "bf16-noise" if s.precision == "bf16" else "forward-differs"
    if s.grad_accum > 1:
        return "accum-boundary"
    return expected(row)


@pytest.mark.parametrize("version", ["0.19.2", "0.19.5"])
def test_older_deepspeed_releases_with_autoep(version, tmp_path):
    folder = side_install(f"deepspeed-{version}", [f"deepspeed=={version}"], "deepspeed/__init__.py")
    summary = cli_rows(2, tmp_path, env={"PYTHONPATH": f"{folder}{os.pathsep}{REPO}"})
    assert {r["version"] for r in summary["rows"]} == {version}
    assert verdicts(summary) == {r.key(): older_release(r) for r in ADAPTER.rows(2)}
    halved = next(r for r in summary["rows"] if r["check"] == "autoep/mixtral/zero0/ep=2/w2/grad-accum")
    assert "divided by grad_accum = 2 twice" in halved["diagnosis"]


def test_transformers_5_22_runs_autoep_as_shipped(tmp_path, monkeypatch):
    folder = side_install("transformers-5.22.2", ["transformers==5.22.2"], "transformers/__init__.py")
    summary = cli_rows(2, tmp_path, env={"PYTHONPATH": f"{folder}{os.pathsep}{REPO}"})
    assert {(r["transformers"], r["transformers_shim"]) for r in summary["rows"]} == {("5.22.2", "")}
    monkeypatch.setattr(compat, "transformers_version", lambda: "5.22.2")
    assert verdicts(summary) == {r.key(): expected(r) for r in ADAPTER.rows(2)}

