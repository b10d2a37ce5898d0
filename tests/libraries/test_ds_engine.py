"""DeepSpeed's engine rows (moebench/libraries/deepspeed/engine.py): the matrix, the rows on the pinned release
(a fast subset here, the whole W = 4 matrix in the slow tier), the finding on it, and every injected
fault of tests/faults/ds_faults.py caught and named by mechanism at the stage, step and group it hits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import library_checks

from moebench.libraries import matrix
from moebench.libraries.deepspeed import engine as ds_engine
from moebench.libraries.deepspeed import mechanisms as ds_mechanisms
from moebench.libraries.records import rows_of
from moebench.parity.runner import ParityConfig, run_checks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
import ds_faults  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DS_API_PARAMS = ("zero_stage", "ep_size", "grad_accum", "clip", "precision", "top_k", "drop_tokens",
                 "use_residual", "steps", "loss_multiplier", "loss_scale", "initial_scale_power", "loss_scale_window",
                 "hysteresis", "consecutive_hysteresis", "min_loss_scale", "overflow_step")


def _rows(world_size: int, keys: list[str]) -> dict[str, dict]:
    """Run the named engine rows (keys without the "deepspeed/engine/" prefix) -> rows_of by key."""
    checks = [c for c in library_checks(["deepspeed"], (world_size,))
              if c.name.removeprefix("deepspeed/engine/") in keys]
    assert len(checks) == len(keys), [c.name for c in checks]
    with matrix.registered(checks):
        summary = run_checks(ParityConfig(world_size=world_size, timeout_s=120.0,
                                          checks=tuple(c.name for c in checks)))
    return {r["check"].removeprefix("deepspeed/engine/"): r for r in rows_of(summary)}


# ------------------------------------------------------------------ the matrix (no ranks)


def test_the_w4_matrix_has_every_stage_ep_size_and_feature_once():
    from moebench.libraries.deepspeed import ADAPTER

    rows = [r for r in ADAPTER.rows(4) if r.model == "engine"]
    assert len(rows) == 3 * 3 * 8 + 3 * 5 == 87
    assert len({r.key() for r in rows}) == len(rows)
    for r in rows:
        params = r.settings.fields()
        assert tuple(params) == DS_API_PARAMS
        assert (r.backend, r.ep_mode) == (f"zero{params['zero_stage']}", f"ep={params['ep_size']}")
        assert r.variant == "+".join(r.features)
        assert bool(r.note) == (params["precision"] == "fp16")  # "fp16 on CPU (...): not a GPU run"
    combos = {(r.settings.zero_stage, r.settings.ep_size, r.features) for r in rows}
    for stage in (0, 1, 2):
        for ep in (4, 2, 1):
            for feature in ((), ("grad-accum",), ("clip",), ("bf16",), ("clip", "bf16"), ("fp16",),
                            ("clip", "fp16"), ("grad-accum", "fp16")):
                assert (stage, ep, feature) in combos
        for option in (("top-2",), ("drops",), ("residual",), ("fp16", "static-scale"), ("fp16", "overflow")):
            assert (stage, 4, option) in combos
    clip = next(r for r in rows if r.features == ("clip",))
    assert clip.settings.clip == ds_engine.CLIP and clip.settings.grad_accum == 1
    static = next(r for r in rows if "static-scale" in r.features)
    assert static.settings.loss_scale == ds_engine.STATIC_SCALE and static.settings.precision == "fp16"
    overflow = next(r for r in rows if "overflow" in r.features)
    assert (overflow.settings.overflow_step, overflow.settings.hysteresis, overflow.settings.loss_scale) == (1, 1, 0)


def test_a_user_config_gives_one_plain_row_per_ep_size():
    from moebench.libraries.deepspeed import ADAPTER

    rows = ADAPTER.rows(4, user_config={"zero_stage": 2, "clip": 1.0, "grad_accum": 4, "precision": "fp32"})
    assert [r.settings.ep_size for r in rows] == [4, 2, 1]
    assert all(r.settings.zero_stage == 2 and r.settings.grad_accum == 4 for r in rows)
    assert all(r.settings.loss_multiplier == 20 for r in rows)  # clip 1.0 binds on the small model
    small = ADAPTER.rows(2, user_config={"zero_stage": 0, "clip": 0.05, "grad_accum": 1, "precision": "fp32"})
    assert all(r.settings.loss_multiplier == 1 for r in small)
    assert [r.key() for r in rows][0] == "deepspeed/engine/zero2/ep=4/w4/ds-config"


def test_group_sizes_name_what_gives_a_scale():
    sizes = ds_mechanisms.GroupSizes(world=4, dp=4, ep=2, edp=2, grad_accum=1)
    assert sizes.explain(2.0) == ["divided by ep = 2 instead of dp = 4", "divided by edp = 2 instead of dp = 4"]
    assert sizes.explain(0.5) == ["divided by ep = 2 once too often", "divided by edp = 2 once too often"]
    assert sizes.explain(1.5) == []


def test_a_clip_that_does_not_bind_is_named_as_such_not_as_a_wrong_step():
    from moebench.parity.compare import assertion

    sizes = ds_mechanisms.GroupSizes(world=2, dp=2, ep=2, edp=1, grad_accum=1)
    failed = assertion("ZeRO 1, step 1: clip binds (reference's unclipped global norm 0.2 > gradient_clipping 9)",
                       False, note="the clip does not bind: the row would be vacuous")
    view = ds_mechanisms.StepView(settings={"clip": 9.0}, sizes=sizes, step=1, rank=0, comparisons=[failed],
                                  grads={}, updates={}, afters={}, wrong=set(), norm=None, per_slice=[], ref_grad={})
    finding = ds_mechanisms.combine([ds_mechanisms.analyse(view), None], sizes=sizes, zero_stage=1, step=1)
    assert finding["name"] == "vacuous-row"
    assert finding["sentence"].endswith("the clip does not bind: the row would be vacuous")


def _bf16_view(grad_scale: dict[str, float], update_passed: bool | None) -> ds_mechanisms.StepView:
    """A bf16 row's first failing step: each group's reported gradient is the reference's x its factor (plus
    bf16-sized noise); the noise model's gradient judgement failed, its applied-update judgement as given (the
    update then right, or x 65536 like the gradient)."""
    import torch

    from moebench.parity import noisemath
    from moebench.parity.compare import assertion

    g = torch.Generator().manual_seed(0)

    def sums(factor: float) -> list[float]:
        e = torch.randn(8, 8, generator=g, dtype=torch.float64)
        return noisemath.sums([(factor * e * (1 + 1e-3 * torch.randn(8, 8, generator=g, dtype=torch.float64)),
                                e)]).tolist()

    comparisons = [assertion("ZeRO 0, step 1: bf16 noise model: reduced gradient's distance from fp32 6.55e+04 <= "
                             "4 x bf16 on one process (0.00377)", False, note="ratio 1.74e+07")]
    half = {"precision": "bf16", "scale": 1.0, "clip": 0.0, "update": {}, "update_base": {},
            "grad": {group: sums(factor) for group, factor in grad_scale.items()},
            "grad_base": {group: sums(1.0) for group in grad_scale},
            "group_norms": {group: 1.0 for group in grad_scale}}
    if update_passed is not None:
        comparisons.append(assertion("ZeRO 0, step 1: bf16 noise model: applied update (fp32 masters)'s distance "
                                     "from fp32 0.005 <= 4 x bf16 on one process (0.004)", update_passed))
        half.update(update={group: sums(1.0 if update_passed else 65536.0) for group in grad_scale},
                    update_base={group: sums(1.0) for group in grad_scale})
    sizes = ds_mechanisms.GroupSizes(world=2, dp=2, ep=2, edp=1, grad_accum=1)
    return ds_mechanisms.StepView(settings={}, sizes=sizes, step=1, rank=0, comparisons=comparisons, grads={},
                                  updates={}, afters={}, wrong=set(), norm=None, per_slice=[], ref_grad={}, half=half)


def test_a_bf16_loss_scale_left_in_the_reported_gradient_is_named_and_says_whether_training_is_right():
    """DeepSpeed 0.17.6-0.18.0 at ZeRO 0 in bf16 report every gradient x 65536 (a loss scale of 2^16 that
    their backward applies and their step undoes: deepspeedai/DeepSpeed#7837, fixed by #7839). The groups'
    factors differ by bf16 noise (65439 to 65570): one factor within noise.GROUP_FIT_RTOL of each other, relatively."""
    view = _bf16_view({"experts": 65438.9, "gate": 65531.2, "dense": 65569.8}, update_passed=True)
    finding = ds_mechanisms.analyse(view)
    assert finding["name"] == "loss-scale", finding
    assert "every reported gradient is 6.55" in finding["sentence"] and "x the reference's (bf16)" \
        in finding["sentence"]
    assert finding["sentence"].endswith("so the training is right and only the gradient DeepSpeed reports "
                                        "(safe_get_full_grad) is wrong")
    wrong_update = ds_mechanisms.analyse(_bf16_view({"experts": 65536.0, "gate": 65536.0, "dense": 65536.0}, False))
    assert wrong_update["name"] == "loss-scale" and "training is right" not in wrong_update["sentence"]
    experts_only = ds_mechanisms.analyse(_bf16_view({"experts": 2.0, "gate": 1.0, "dense": 1.0}, None))
    assert experts_only["name"] == "expert-grad-scale" and "scaled by 2" in experts_only["sentence"]


# ------------------------------------------------------------------ the pinned release (multirank)


@pytest.mark.multirank
def test_engine_rows_on_the_pinned_release_and_its_finding():
    """The unbroken rows pass; ZeRO 0 with clipping at ep_size < W is DeepSpeed's own finding (its
    clip_grad_norm_ averages per-rank norms: deepspeedai/DeepSpeed#8475), named by mechanism."""
    pytest.importorskip("deepspeed")
    rows = _rows(2, ["zero1/ep=2/w2", "zero2/ep=1/w2/grad-accum", "zero2/ep=2/w2/bf16", "zero1/ep=2/w2/drops",
                     "zero0/ep=1/w2/clip", "zero0/ep=2/w2/clip"])
    for key in ("zero1/ep=2/w2", "zero2/ep=1/w2/grad-accum", "zero2/ep=2/w2/bf16", "zero1/ep=2/w2/drops",
                "zero0/ep=1/w2/clip"):
        assert rows[key]["verdict"] == "pass", (key, rows[key]["diagnosis"])
    finding = rows["zero0/ep=2/w2/clip"]
    assert finding["verdict"] == "fail" and finding["diagnosis_name"] == "global-norm"
    assert "first divergence at ZeRO 0, step 1" in finding["diagnosis"]
    assert "MEAN over ranks of each rank's own-parameter norm" in finding["diagnosis"]
    assert "consequences, not causes" in finding["diagnosis"]
    assert {k: finding[k] for k in ("library", "zero_stage", "ep_size", "world_size", "features", "clip")} == {
        "library": "deepspeed", "zero_stage": 0, "ep_size": 2, "world_size": 2, "features": ["clip"], "clip": 0.05}


# ------------------------------------------------------------------ injected faults (multirank)


def _with_fault(monkeypatch, name: str, world_size: int, keys: list[str]) -> dict[str, dict]:
    ds_faults.FAULTS[name](monkeypatch.setattr)  # the ranks fork from this process: they inherit it
    return _rows(world_size, keys)


@pytest.mark.multirank
@pytest.mark.faults
def test_expert_grads_divided_by_the_wrong_group_are_named_at_zero_1_and_2_only(monkeypatch):
    pytest.importorskip("deepspeed")
    rows = _with_fault(monkeypatch, "expert-grad-wrong-group", 2, ["zero0/ep=2/w2", "zero2/ep=2/w2"])
    assert rows["zero0/ep=2/w2"]["verdict"] == "pass"  # the fault is in the ZeRO optimizer's reduction
    row = rows["zero2/ep=2/w2"]
    assert row["verdict"] == "fail" and row["diagnosis_name"] == "expert-grad-scale"
    assert "first divergence at ZeRO 2, step 1, experts" in row["diagnosis"]
    assert "expert gradients scaled by 2 (dense and gate right): divided by edp = 1 instead of dp = 2" \
        in row["diagnosis"]


@pytest.mark.multirank
@pytest.mark.faults
def test_a_rank_local_global_norm_is_named(monkeypatch):
    pytest.importorskip("deepspeed")
    row = _with_fault(monkeypatch, "local-global-norm", 2, ["zero1/ep=1/w2/clip"])["zero1/ep=1/w2/clip"]
    assert row["verdict"] == "fail" and row["diagnosis_name"] == "global-norm"
    assert "first divergence at ZeRO 1, step 1, all groups" in row["diagnosis"]
    assert "reduced gradients right; the engine's global gradient norm is" in row["diagnosis"]
    assert "the ranks disagree on the global norm" in row["diagnosis"]


@pytest.mark.multirank
@pytest.mark.faults
def test_a_skipped_reduction_at_the_accumulation_boundary_is_named(monkeypatch):
    pytest.importorskip("deepspeed")
    rows = _with_fault(monkeypatch, "accum-boundary-skip", 2, ["zero0/ep=2/w2/grad-accum", "zero0/ep=2/w2"])
    assert rows["zero0/ep=2/w2"]["verdict"] == "pass"  # one micro-step: the fault never fires
    row = rows["zero0/ep=2/w2/grad-accum"]
    assert row["verdict"] == "fail" and row["diagnosis_name"] == "accum-boundary"
    assert "first divergence at ZeRO 0, step 1" in row["diagnosis"]
    assert "this rank's own micro-steps, never reduced at the boundary" in row["diagnosis"]


@pytest.mark.multirank
@pytest.mark.faults
def test_a_partition_copied_back_to_the_wrong_parameter_is_named(monkeypatch):
    pytest.importorskip("deepspeed")
    row = _with_fault(monkeypatch, "copy-back-wrong-param", 2, ["zero2/ep=1/w2"])["zero2/ep=1/w2"]
    assert row["verdict"] == "fail" and row["diagnosis_name"] == "partition-copy-back"
    assert "first divergence at ZeRO 2, step 1, dense (inp.weight)" in row["diagnosis"]
    assert "reduced gradients right, applied step wrong in inp.weight (inp.weight holds the updated values " \
           "of out.weight)" in row["diagnosis"]


# ------------------------------------------------------------------ slow: the whole W = 4 matrix


FINDINGS_W4 = {
    **{f"zero0/ep={ep}/w4/clip": "global-norm" for ep in (4, 2)},  # its ZeRO 0 clip norm: DeepSpeed#8475
    **{f"zero0/ep={ep}/w4/clip+bf16": "clip-norm-without-group" for ep in (4, 2, 1)},  # PR #8613
    **{f"zero0/ep={ep}/w4/{f}": "loss-scale-never-applied" for ep in (4, 2, 1)  # PR #8393
       for f in ("fp16", "clip+fp16", "grad-accum+fp16")},
    "zero0/ep=4/w4/fp16+static-scale": "loss-scale-never-applied", "zero0/ep=4/w4/fp16+overflow":
        "loss-scale-never-applied"}
"""The rows DeepSpeed 0.19.8 fails here, and their diagnoses."""


@pytest.mark.slow
@pytest.mark.multirank
def test_the_w4_matrix_through_the_cli_json(tmp_path):
    pytest.importorskip("deepspeed")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "moebench", "verify-parity", "--library", "deepspeed",
                           "--world-size", "4", "--json", "--results-dir", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)
    rows = {r["check"].removeprefix("deepspeed/engine/"): r for r in json.loads(proc.stdout)["rows"]}
    engine = {k: r for k, r in rows.items() if "/" in k and k.startswith("zero")}
    assert len(engine) == 87
    for key, row in engine.items():
        for field in ("library", "version", "zero_stage", "ep_size", "world_size", "features", "verdict",
                      "diagnosis"):
            assert field in row
        if key in FINDINGS_W4:
            assert row["verdict"] == "fail" and row["diagnosis_name"] == FINDINGS_W4[key], (key, row["diagnosis"])
            assert "first divergence at ZeRO 0, step 1" in row["diagnosis"], key
        else:
            assert row["verdict"] == "pass", (key, row["diagnosis"])


FAULT_ROWS_W4 = {
    # fault: {row: (diagnosis name, text it must hold)}; rows not named in a fault's dict pass under it
    "expert-grad-wrong-group": {
        "zero1/ep=4/w4": ("expert-grad-scale", "ZeRO 1, step 1, experts"),
        "zero2/ep=2/w4": ("expert-grad-scale", "divided by edp = 2 instead of dp = 4"),
        "zero2/ep=4/w4/bf16": ("expert-grad-scale", "expert gradients scaled by 4 (bf16"),
        "zero0/ep=4/w4": None, "zero1/ep=1/w4": None},
    "local-global-norm": {
        "zero1/ep=1/w4/clip": ("global-norm", "ZeRO 1, step 1, all groups"),
        "zero2/ep=1/w4/clip": ("global-norm", "the ranks disagree on the global norm"),
        "zero2/ep=4/w4/clip": ("global-norm", "the ranks disagree on the global norm"),
        "zero1/ep=1/w4": None},
    "accum-boundary-skip": {
        "zero0/ep=4/w4/grad-accum": ("accum-boundary", "never reduced at the boundary"),
        "zero0/ep=1/w4/grad-accum": ("accum-boundary", "ZeRO 0, step 1"),
        "zero0/ep=2/w4": None},
    "copy-back-wrong-param": {
        "zero1/ep=2/w4": ("partition-copy-back", "holds the updated values of out.weight"),
        "zero2/ep=4/w4/grad-accum": ("partition-copy-back", "ZeRO 2, step 1"),
        "zero0/ep=4/w4": None},
}


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.faults
@pytest.mark.parametrize("fault", sorted(FAULT_ROWS_W4))
def test_every_fault_at_w4(monkeypatch, fault):
    pytest.importorskip("deepspeed")
    expected = FAULT_ROWS_W4[fault]
    rows = _with_fault(monkeypatch, fault, 4, list(expected))
    for key, want in expected.items():
        row = rows[key]
        if want is None:
            assert row["verdict"] == "pass", (key, row["diagnosis"])
            continue
        name, text = want
        assert row["verdict"] == "fail" and row["diagnosis_name"] == name, (key, row["diagnosis"])
        assert text in row["diagnosis"], (key, row["diagnosis"])
        assert "first divergence" in row["diagnosis"]


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.faults
def test_the_old_engine_check_is_blind_to_the_norm_and_accumulation_faults(monkeypatch):
    """Why the rows exist: deepspeed-engine-ep (no clipping, no accumulation) passes under both faults."""
    pytest.importorskip("deepspeed")
    ds_faults.FAULTS["local-global-norm"](monkeypatch.setattr)
    ds_faults.FAULTS["accum-boundary-skip"](monkeypatch.setattr)
    record = run_checks(ParityConfig(world_size=2, checks=("deepspeed-engine-ep",), timeout_s=120.0))["checks"][0]
    assert record["status"] == "pass"


# ------------------------------------------------------------------ speed: what a row's ranks import

_COUNT_ROW_IMPORTS = """
import os, sys
from moebench.libraries.deepspeed import engine as ds_engine, resume as ds_resume
def counted(ctx, row, opts, _run=ds_engine.run):
    before = set(sys.modules)
    try:
        return _run(ctx, row, opts)
    finally:
        if ctx.rank == 0:
            open(os.environ["COUNT_FILE"], "w").write("\\n".join(sorted(set(sys.modules) - before)))
ds_engine.run = counted
ds_engine.matrix = lambda w: [ds_engine.EngineSettings(zero_stage=1, ep_size=w)]
universal = [r for r in ds_resume.resume_rows(2) if r.key() == "deepspeed/resume+universal/zero1/ep=1to2/w2/resume"]
ds_resume.resume_rows = lambda w: universal
from moebench.entry import main
sys.argv = ["moebench", "verify-parity", "--library", "deepspeed", "--resume", "-n", "2", "--json",
            "--results-dir", sys.argv[1]]
main()
"""
MAX_ROW_IMPORTS = 300
"""Modules a rank of an engine row may import on its own: ~100 remain (setuptools, for DeepSpeed's op
probe); without the adapter's preload each rank imported ~1,500 at every row (torch._dynamo, inductor,
DeepSpeed's Muon and AutoEP), 4.1 of a 4.4 s row at W = 4 (the W = 4 matrix: 199 s -> 45 s)."""


@pytest.mark.multirank
def test_a_rows_ranks_inherit_what_the_engine_imports_and_the_console_stays_moebenchs(tmp_path):
    """Each row forks fresh ranks from the command's process: a module the row imports lazily is imported
    again at every row, on every rank, unless the adapter's preload imported it in the parent. That preload
    must not import DeepSpeed before the run names its accelerator (DeepSpeed would log its probe), and
    DeepSpeed's universal-checkpoint converter (a resume row) prints a banner and progress bars: neither
    reaches the console."""
    pytest.importorskip("deepspeed")
    count = tmp_path / "imported.txt"
    done = subprocess.run([sys.executable, "-c", _COUNT_ROW_IMPORTS, str(tmp_path / "results")], cwd=tmp_path,
                          env={**os.environ, "COUNT_FILE": str(count), "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]  # the universal row's finding
    imported = count.read_text().split()
    assert len(imported) <= MAX_ROW_IMPORTS, imported[:50]
    assert "torch._dynamo" not in imported and "torch._inductor.compile_fx" not in imported
    verdicts = {r["check"]: r["verdict"] for r in json.loads(done.stdout)["rows"]}
    assert verdicts == {"deepspeed/moe.layer.MoE/-/ep=2/w2": "pass", "deepspeed/engine/zero1/ep=2/w2": "pass",
                        "deepspeed/resume+universal/zero1/ep=1to2/w2/resume": "fail"}
    for noise in ("Setting accelerator", "Universal", "Extracting ZeRO fragments", "it/s"):
        assert noise not in done.stderr, done.stderr[-3000:]
