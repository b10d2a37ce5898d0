"""AutoEP resume rows on real DeepSpeed releases (slow tier): 0.19.8 (pinned), 0.19.5, 0.19.4 and 0.19.2, each with
the transformers AutoEP runs with as shipped (5.22.2: compat.AS_SHIPPED; no shim), side-installed with `pip install
--target` into a cache folder (never the venv) and put first on PYTHONPATH of a CLI run. Every row's verdict and
finding is asserted; docs/libraries/autoep.md cites each finding's upstream issue."""

from __future__ import annotations

import os

import pytest
from helpers.releases import side_install
from test_autoep_resume import ROOT, cli_rows, expected, verdicts

from moebench.libraries.autoep import compat
from moebench.libraries.autoep import resume as ar

pytestmark = pytest.mark.slow

RELEASES = ("0.19.8", "0.19.5", "0.19.4", "0.19.2")


def on_release(row, version: str) -> str:
    """A resume row's verdict on `version` (what each older release lacks, in the order a row meets it):
    - DeepSeek-V3's routing bias is dropped by AutoEP's conversion before 0.19.7 (deepspeedai/DeepSpeed#8358, fixed by
      #8369): its rows fail first there, `routing-bias-dropped`;
    - 0.19.4's converter takes AutoEP's `layer_0_expert_*` files for pipeline-layer files and refuses every AutoEP
      checkpoint ("bogus DeepSpeed checkpoint folder"), 0.19.2's raises KeyError 'optimizer_state_dict': the universal
      ZeRO 1/2 rows are `checkpoint-refused` (deepspeedai/DeepSpeed#8147, fixed by #8198 in 0.19.5);
    - 0.19.2 cannot load its own ZeRO-0 AutoEP checkpoint (KeyError: 'optimizer'): `checkpoint-refused` at the same
      layout, refused at another (refused at its save layout too); it has no AutoEP ZeRO 3 (skipped with
      DeepSpeed's own message);
    - the rest as on 0.19.8 (test_autoep_resume.expected)."""
    s, old = row.settings, compat.release(version)
    if s.zero_stage == 3 and old < (0, 19, 4):
        return "skip"
    if s.family == "deepseek_v3" and old < (0, 19, 7):
        return "routing-bias-dropped"
    if s.universal and s.zero_stage in (1, 2) and old < (0, 19, 5):
        return "checkpoint-refused"
    if s.zero_stage == 0 and old < (0, 19, 4):
        return "checkpoint-refused" if s.load_ep_size == s.autoep_size else "refused"
    return expected(row)


@pytest.mark.parametrize("version", RELEASES)
def test_resume_rows_on_each_release(version, tmp_path):
    transformers = side_install(f"transformers-{compat.AS_SHIPPED}", [f"transformers=={compat.AS_SHIPPED}"],
                                "transformers/__init__.py")
    folders = [] if version == "0.19.8" else [side_install(f"deepspeed-{version}", [f"deepspeed=={version}"],
                                                            "deepspeed/__init__.py")]
    path = os.pathsep.join(str(f) for f in [*folders, transformers, ROOT])
    summary = cli_rows(2, tmp_path, env={"PYTHONPATH": path})
    assert {(r["version"], r["transformers"], r["transformers_shim"]) for r in summary["rows"]} == {
        (version, compat.AS_SHIPPED, "")}
    rows = ar.resume_rows(2, compat.AS_SHIPPED)
    assert verdicts(summary) == {r.key(): on_release(r, version) for r in rows}
    said = {r["check"]: r["diagnosis"] or "" for r in summary["rows"]}
    if compat.release(version) < (0, 19, 7):
        assert "(deepspeedai/DeepSpeed#8369)" in said["autoep/deepseek_v3/zero1/ep=2/w2/resume"]
    if version == "0.19.4":
        assert "seems a bogus DeepSpeed checkpoint folder: Cannot find layer_01* files" in \
            said["autoep/mixtral/zero1/ep=2/w2/resume+universal"]
    if version == "0.19.2":
        assert "KeyError: 'optimizer'" in said["autoep/mixtral/zero0/ep=2/w2/resume"]
        assert "refused at its save layout too" in said["autoep/mixtral/zero0/ep=2to1/w2/resume"]
        skipped = next(r for r in summary["checks"] if r["name"] == "autoep/mixtral/zero3/ep=2/w2/resume")
        assert "MoE not supported with Stage 3" in skipped["reason"]
