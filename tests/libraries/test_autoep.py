"""DeepSpeed AutoEP rows (moebench/libraries/autoep/): the matrix and its settings, the mapping of AutoEP's parameters
onto the model's own, the transformers release handling, --ds-config, a few rows on the pinned release (its findings
named), and each injected fault of tests/faults/autoep_faults.py caught and named. The whole matrix at W = 2 and 4,
five seeds and the repro script's figures are in the slow tier (the bottom of this file); other releases in
test_autoep_releases.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moebench.libraries import matrix
from moebench.libraries.autoep import ADAPTER, compat, rows
from moebench.libraries.autoep import rowmath as rm
from moebench.libraries.records import rows_of
from moebench.parity.runner import ParityConfig, run_checks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
import autoep_faults  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
FINDING = "zero0/ep=2/w2/clip"
"""DeepSpeed#8475 on the pinned release: ZeRO 0 clips by the mean of the ranks' own norms."""


def _run(world_size: int, keys: list[str], seed: int = 0) -> dict[str, dict]:
    """Run the named rows (keys without "autoep/<family>/" for Mixtral, else without "autoep/") -> rows_of by key."""
    wanted = {k if "/" in k.split("zero")[0] else f"mixtral/{k}" for k in keys}
    checks = [c for c in matrix.row_checks([ADAPTER], (world_size,)) if c.name.removeprefix("autoep/") in wanted]
    assert len(checks) == len(wanted), sorted(wanted - {c.name.removeprefix("autoep/") for c in checks})
    with matrix.registered(checks):
        summary = run_checks(ParityConfig(world_size=world_size, timeout_s=120.0, seed=seed,
                                          checks=tuple(c.name for c in checks)))
    return {r["check"].removeprefix("autoep/").removeprefix("mixtral/"): r for r in rows_of(summary)}


# ------------------------------------------------------------------ the matrix (no ranks)


def test_the_matrix_covers_each_axis_within_its_budget():
    for world, count in ((2, 54), (4, 51)):
        found = ADAPTER.rows(world)
        assert len(found) == count + (0 if compat.needs_shim(compat.transformers_version()) else -1)
        assert len({r.key() for r in found}) == len(found)
        settings = [r.settings for r in found]
        grid = {(s.zero_stage, s.autoep_size, s.features()) for s in settings if s.family == "mixtral"}
        for stage in (0, 1, 2):
            for ep in rows.ep_sizes(world):
                for feature in ((), ("clip",), ("grad-accum",)):
                    assert (stage, ep, tuple(f for f in feature)) in grid
        assert {(s.family, s.top_k) for s in settings} == {(f, k) for f in rm.FAMILIES for k in (1, 2)}
        assert {s.family for s in settings if s.precision == "bf16"} == set(rm.FAMILIES)
        assert {s.optimizer for s in settings} == set(rows.OPTIMIZERS)
        assert any(s.data_before_expert and (world == 2 or s.autoep_size < world) for s in settings)
        assert all(r.key().startswith(f"autoep/{r.settings.family}/zero{r.settings.zero_stage}/"
                                      f"ep={r.settings.autoep_size}/w{world}") for r in found)


def test_every_row_names_both_releases_and_the_shim_it_runs_with(monkeypatch):
    monkeypatch.setattr(compat, "transformers_version", lambda: "5.23.0")
    found = ADAPTER.rows(2)
    assert all(r.settings.transformers == "5.23.0" for r in found)
    shipped = [r for r in found if not r.settings.transformers_shim]
    assert [r.key() for r in shipped] == ["autoep/mixtral/zero0/ep=2/w2/as-shipped"]
    assert all("_CAN_RECORD_REGISTRY" in r.settings.transformers_shim for r in found if r not in shipped)
    assert {"transformers", "transformers_shim"} <= set(found[0].labels("0.19.8"))
    monkeypatch.setattr(compat, "transformers_version", lambda: "5.22.2")  # AutoEP runs as shipped: no shim
    assert all(not r.settings.transformers_shim and "as-shipped" not in r.key() for r in ADAPTER.rows(2))


def test_autoep_slots_map_to_the_models_experts_by_global_index():
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(rm.EXPERTS, 2 * rm.FFN, rm.HIDDEN, generator=g)
    down = torch.randn(rm.EXPERTS, rm.HIDDEN, rm.FFN, generator=g)
    ref = rm.reference_units({rm.MLP + "experts.gate_up_proj": gate_up, rm.MLP + "experts.down_proj": down,
                              rm.MLP + "gate.weight": torch.ones(1)})
    held = [6, 7]  # what ep rank 3 of 4 holds
    local = {rm.MLP + "experts.w1": gate_up[held, :rm.FFN], rm.MLP + "experts.w3": gate_up[held, rm.FFN:],
             rm.MLP + "experts.w2": down[held], rm.MLP + "router.gate.weight": torch.ones(1)}
    units = rm.autoep_units(local, held)
    assert set(units) == {f"{rm.MLP}experts.{p}[expert {e}]" for p in ("gate_proj", "up_proj", "down_proj")
                          for e in held} | {rm.MLP + "gate.weight"}
    assert all(torch.equal(t, ref[u]) for u, t in units.items())
    assert rm.group_of(rm.MLP + "gate.weight") == "router" and rm.group_of(rm.MLP + "shared_experts.x") == "dense"


def test_a_near_tie_leaves_the_next_positions_label_out():
    ids = torch.arange(8).view(2, 4)
    gaps = torch.tensor([0.5, 0.001, 0.5, 0.5, 0.5, 0.5, 0.5, 0.019])
    labels = rm.tie_free_labels(ids, gaps)
    assert labels.tolist() == [[0, 1, -100, 3], [4, 5, 6, 7]]  # a tie at the last position predicts nothing


def test_the_incompatibility_is_one_line_naming_both_releases_and_the_fix():
    exc = TypeError("_CanRecordRegistry.get() takes 2 positional arguments but 3 were given")
    line = compat.incompatibility(exc, "deepspeed/module_inject/auto_ep_presets/base.py:326", "0.19.8", "5.23.0")
    assert "\n" not in line and "DeepSpeed 0.19.8" in line and "transformers 5.23.0" in line
    assert "base.py:326" in line and "transformers==5.22.2" in line
    assert compat.incompatibility(TypeError("something else"), "x.py:1", "0.19.8", "5.23.0") is None
    assert compat.needs_shim("5.23.0") and compat.needs_shim("5.24.0") and not compat.needs_shim("5.22.2")


def test_ds_config_gives_each_family_the_files_settings(tmp_path):
    from moebench.errors import UserError
    from moebench.libraries.autoep.user_config import read_user_config

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0,
                                "gradient_accumulation_steps": 2, "use_data_before_expert_parallelism": True,
                                "expert_parallel": {"enabled": True, "autoep_size": 2, "use_grouped_mm": True}}))
    settings, notes = read_user_config(str(path))
    assert {k: settings[k] for k in ("zero_stage", "clip", "grad_accum", "autoep_size", "data_before_expert",
                                     "loss_multiplier")} == {"zero_stage": 2, "clip": 1.0, "grad_accum": 2,
                                                             "autoep_size": 2, "data_before_expert": True,
                                                             "loss_multiplier": 2.0}
    assert any("expert_parallel.use_grouped_mm" in n for n in notes)
    assert not any("use_data_before_expert_parallelism" in n for n in notes)  # read, so not "not passed on"
    found = ADAPTER.rows(4, user_config=settings)
    assert [r.key() for r in found] == [f"autoep/{f}/zero2/ep=2/w4/ds-config" for f in rm.FAMILIES]
    path.write_text(json.dumps({"expert_parallel": {"autoep_size": "two"}}))
    with pytest.raises(UserError, match="expert_parallel.autoep_size"):
        read_user_config(str(path))


def test_list_says_which_transformers_the_rows_run_with():
    from moebench.libraries import registry

    status = registry.status("autoep")
    assert status.why_not is None and status.version == ADAPTER.version()
    if compat.needs_shim(compat.transformers_version()):
        assert "as shipped" in status.note and f"transformers=={compat.AS_SHIPPED}" in status.note
    else:
        assert status.note.startswith("AutoEP runs as shipped with transformers")


# ------------------------------------------------------------------ the pinned release (multirank)


@pytest.mark.multirank
def test_rows_on_the_pinned_release_and_its_findings():
    """A plain row passes; ZeRO 0 clipping at autoep_size > 1 is DeepSpeed#8475, named by mechanism; a client
    SGD at ZeRO 1 is refused with DeepSpeed's reason; AutoEP as shipped with transformers 5.23+ is one line."""
    shim = compat.needs_shim(compat.transformers_version())
    found = _run(2, ["zero1/ep=2/w2", FINDING, "zero1/ep=2/w2/client-optimizer"]
                 + (["zero0/ep=2/w2/as-shipped"] if shim else []))
    assert found["zero1/ep=2/w2"]["verdict"] == "pass", found["zero1/ep=2/w2"]["diagnosis"]
    finding = found[FINDING]
    assert finding["verdict"] == "fail" and finding["diagnosis_name"] == "global-norm"
    assert "first divergence at ZeRO 0, step 1, all groups, on ranks 0, 1" in finding["diagnosis"]
    assert "is the MEAN over ranks of each rank's own-parameter norm" in finding["diagnosis"]
    refused = found["zero1/ep=2/w2/client-optimizer"]
    assert refused["verdict"] == "refused" and "None of the param groups are marked as MoE" in refused["diagnosis"]
    if shim:
        shipped = found["zero0/ep=2/w2/as-shipped"]
        assert shipped["verdict"] == "fail" and shipped["diagnosis_name"] == "incompatible-release"
        assert "Traceback" not in shipped["diagnosis"] and "_CanRecordRegistry.get()" in shipped["diagnosis"]
    assert all(r["transformers"] == compat.transformers_version() for r in found.values())


# ------------------------------------------------------------------ injected faults (multirank)


def _with_fault(monkeypatch, name: str, keys: list[str]) -> dict[str, dict]:
    autoep_faults.FAULTS[name](monkeypatch.setattr)  # the ranks fork from this process: they inherit it
    return _run(2, keys)


@pytest.mark.multirank
@pytest.mark.faults
def test_a_per_rank_clip_norm_is_named(monkeypatch):
    row = _with_fault(monkeypatch, "per-rank-clip-norm", ["zero1/ep=2/w2/clip"])["zero1/ep=2/w2/clip"]
    assert row["verdict"] == "fail" and row["diagnosis_name"] == "global-norm", row["diagnosis"]
    assert "first divergence at ZeRO 1, step 1, all groups" in row["diagnosis"]
    assert "the ranks disagree on the global norm" in row["diagnosis"]


@pytest.mark.multirank
@pytest.mark.faults
def test_expert_gradients_summed_are_named_at_zero_0_and_2(monkeypatch):
    found = _with_fault(monkeypatch, "expert-grads-summed", ["zero0/ep=2/w2", "zero2/ep=2/w2"])
    for stage in (0, 2):
        row = found[f"zero{stage}/ep=2/w2"]
        assert row["verdict"] == "fail" and row["diagnosis_name"] == "expert-grad-scale", row["diagnosis"]
        assert f"first divergence at ZeRO {stage}, step 1, experts" in row["diagnosis"]
        assert "expert gradients scaled by 2 (dense and router right)" in row["diagnosis"]
        assert "summed over dp = world = 2 instead of averaged" in row["diagnosis"]


@pytest.mark.multirank
@pytest.mark.faults
def test_a_detached_router_is_named(monkeypatch):
    row = _with_fault(monkeypatch, "router-detached", ["zero1/ep=2/w2"])["zero1/ep=2/w2"]
    assert row["verdict"] == "fail" and row["diagnosis_name"] == "router-detached", row["diagnosis"]
    assert "first divergence at ZeRO 1, step 1, router (mlp.gate.weight)" in row["diagnosis"]
    assert "is exactly zero while the loss is right" in row["diagnosis"]


# ------------------------------------------------------------------ slow tier: the whole matrix, seeds, the script


def expected(row) -> str:
    """A row's verdict on DeepSpeed 0.19.8 (with the venv's transformers, or 5.22.2): "pass", or its finding."""
    s = row.settings
    if compat.needs_shim(s.transformers) and not s.transformers_shim:
        return "incompatible-release"
    if s.optimizer == "client" and s.zero_stage > 0:
        return "refused"
    if s.clip > 0 and s.zero_stage == 0 and s.autoep_size > 1:
        return "global-norm"
    return "pass"


def cli_rows(world_size: int, tmp_path: Path, *args: str, env: dict | None = None) -> dict:
    """`verify-parity --library autoep -n W --json ARGS` as a user runs it: the summary."""
    done = subprocess.run([sys.executable, "-m", "moebench", "verify-parity", "--library", "autoep", "-n",
                           str(world_size), "--json", *args], text=True, capture_output=True, timeout=900,
                          env={**os.environ, "MOEBENCH_RESULTS": str(tmp_path / "results"), **(env or {})})
    assert done.returncode in (0, 1), done.stderr[-3000:]
    return json.loads(done.stdout)


def verdicts(summary: dict) -> dict[str, str]:
    return {r["check"]: r["diagnosis_name"] if r["verdict"] == "fail" else r["verdict"] for r in summary["rows"]}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_whole_matrix_on_the_pinned_release(world_size, tmp_path):
    """Every row passes but the findings (DeepSpeed#8475; the refused client optimizer; AutoEP as shipped with
    transformers 5.23+), with no vacuous comparison; 51 s (W = 2), 80 s (W = 4) here (docs/libraries/autoep.md)."""
    summary = cli_rows(world_size, tmp_path)
    assert verdicts(summary) == {r.key(): expected(r) for r in ADAPTER.rows(world_size)}
    assert summary["vacuous_total"] == 0
    print(f"W = {world_size}: {len(summary['rows'])} rows in {summary['wall_time_s']:.1f} s")


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_no_false_alarm_over_five_seeds(world_size, tmp_path):
    """Seeds 1-5 (other weights, data and near-ties): the same verdicts on every row."""
    want = {r.key(): expected(r) for r in ADAPTER.rows(world_size)}
    for seed in range(1, 6):
        assert verdicts(cli_rows(world_size, tmp_path, "--seed", str(seed))) == want, seed


@pytest.mark.slow
@pytest.mark.multirank
def test_the_tool_and_its_script_print_the_same_figures(tmp_path):
    """`--row KEY --repro DIR` on the finding, and the script it writes run standalone (no moebench importable):
    the same common factor and norms, to 4 digits."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_repro import _figures, _survivors, run_script

    key = f"autoep/mixtral/{FINDING}"
    summary = cli_rows(2, tmp_path, "--row", key, "--repro", str(tmp_path / "scripts"))
    (row,) = summary["rows"]
    assert row["diagnosis_name"] == "global-norm"
    done, tag = run_script(tmp_path / "scripts" / f"{key.replace('/', '__')}.py", tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    assert _figures(row["diagnosis"]) == _figures(done.stdout) and len(_figures(done.stdout)) >= 3, done.stdout
    assert not _survivors(tag)
