"""DeepSpeed's engine rows in half precision (fp16, bf16): the loss scale the reference follows, DeepSpeed's CPU fp16
check overridden in the rank alone, the reading of a failing step by one common factor per group, the findings on the
pinned release (DeepSpeed PR #8393, PR #8613), the half-precision faults of tests/faults/ds_half_faults.py each caught
and named, and no false alarm over 5 seeds (slow)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from helpers import library_checks

from moebench.libraries import matrix
from moebench.libraries.deepspeed import half, halfmath, rowmath
from moebench.libraries.records import rows_of
from moebench.parity import noisemath
from moebench.parity.runner import ParityConfig, run_checks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
import ds_half_faults  # noqa: E402

ENGINE = "deepspeed/engine/"


def _run(world_size: int, keys: list[str], seed: int = 0) -> tuple[dict[str, dict], dict[str, list]]:
    """Run the named engine rows (keys without "deepspeed/engine/"): (row records, comparisons by row)."""
    checks = library_checks(["deepspeed"], (world_size,), patterns=tuple(ENGINE + k for k in keys))
    with matrix.registered(checks):
        summary = run_checks(ParityConfig(world_size=world_size, timeout_s=120.0, seed=seed,
                                          checks=tuple(c.name for c in checks)))
    rows = {r["check"].removeprefix(ENGINE): r for r in rows_of(summary)}
    comparisons = {c["name"].removeprefix(ENGINE): c.get("comparisons", []) for c in summary["checks"]}
    return rows, comparisons


def _settings(**fields):
    from moebench.libraries.deepspeed.engine import EngineSettings

    return EngineSettings(**{"zero_stage": 1, "ep_size": 2, "precision": "fp16", **fields})


# ------------------------------------------------------------------ the loss scale (no ranks)


@pytest.mark.parametrize("hysteresis,window,consecutive,min_scale", [
    (2, 1000, False, 1), (1, 2, False, 1), (3, 1, True, 1), (2, 3, False, 2**10), (1, 1, True, 2**12)])
def test_the_reference_loss_scale_is_deepspeeds_own(monkeypatch, hysteresis, window, consecutive, min_scale):
    """halfmath.LossScaler (the reference's, never read from the engine) against DeepSpeed's DynamicLossScaler over
    random overflow sequences: the same scale after every step."""
    from deepspeed.runtime.fp16 import loss_scaler

    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda *a, **k: 0)  # it only logs on rank 0
    ours = halfmath.LossScaler(_settings(initial_scale_power=16, hysteresis=hysteresis, loss_scale_window=window,
                                        consecutive_hysteresis=consecutive, min_loss_scale=min_scale))
    theirs = loss_scaler.DynamicLossScaler(init_scale=2.0**16, scale_window=window, min_scale=min_scale,
                                           delayed_shift=hysteresis, consecutive_hysteresis=consecutive,
                                           raise_error_at_min_scale=False)
    draw = random.Random(hysteresis * 1000 + window)
    for _ in range(200):
        overflow = draw.random() < 0.3
        ours.update(overflow)
        theirs.update_scale(overflow)
        assert ours.scale == theirs.cur_scale
    static = halfmath.LossScaler(_settings(loss_scale=128.0))
    static.update(True)
    assert static.scale == 128.0 and halfmath.LossScaler(_settings(precision="bf16")).scale == 1.0


# ------------------------------------------------------------------ DeepSpeed's CPU fp16 check (no ranks)


class _Reached(Exception):
    """The sanity check got past its fp16 line."""


class _Engine:
    def fp16_enabled(self):
        return True

    def bfloat16_enabled(self):  # the check's next line: reaching it means fp16 was accepted
        raise _Reached


def test_cpu_fp16_allowed_overrides_the_accelerators_answer_in_the_block_alone(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.engine import DeepSpeedEngine

    accelerator = get_accelerator()
    monkeypatch.setattr(accelerator, "is_fp16_supported", lambda: False)  # a CPU without mkldnn fp16
    with pytest.raises(ValueError, match="Type fp16 is not supported on your device"):
        DeepSpeedEngine._do_sanity_check(_Engine())
    assert torch.float16 not in accelerator.supported_dtypes()  # ZeRO 0's all-reduce would refuse fp16 too
    with half.cpu_fp16_allowed():
        with pytest.raises(_Reached):
            DeepSpeedEngine._do_sanity_check(_Engine())
        assert torch.float16 in accelerator.supported_dtypes()
    assert accelerator.is_fp16_supported() is False  # the answer set before is back
    with half.cpu_fp16_allowed(enabled=False):
        assert accelerator.is_fp16_supported() is False


# ------------------------------------------------------------------ reading a failing step (no ranks)


def _groups(factors: dict[str, float], noise: float = 1e-3, seed: int = 0) -> tuple[dict, dict]:
    """(sums of actual = factor x (expected + noise), sums of a one-process run's noise) per group."""
    g = torch.Generator().manual_seed(seed)
    run, base = {}, {}
    for group in rowmath.GROUPS:
        e = torch.randn(64, generator=g, dtype=torch.float64)
        jitter = noise * torch.randn(64, generator=g, dtype=torch.float64)
        run[group] = noisemath.sums([(factors.get(group, 1.0) * (e + jitter), e)])
        base[group] = noisemath.sums([(e + noise * torch.randn(64, generator=g, dtype=torch.float64), e)])
    return run, base


NORMS = {"experts": 0.12, "gate": 0.02, "dense": 0.19}


def _read(grad: dict, update: dict, precision="fp16", scale=128.0, clip=0.0) -> dict | None:
    g, gb = _groups(grad)
    u, ub = _groups(update, seed=1)
    return halfmath.half_reading(precision=precision, scale=scale, clip=clip, grad=g, grad_base=gb, update=u,
                                update_base=ub, group_norms=NORMS)


def test_one_common_factor_names_the_mechanism_before_anything_is_noise():
    never = _read({g: 1 / 128 for g in rowmath.GROUPS}, {g: 1 / 128 for g in rowmath.GROUPS})
    assert never["name"] == "loss-scale-never-applied" and "= 1/128" in never["sentence"]
    assert "measured: every update x 0.00781" in never["sentence"]
    twice = _read({g: 128.0 for g in rowmath.GROUPS}, {g: 128.0 for g in rowmath.GROUPS})
    assert twice["name"] == "loss-scale-twice"
    full = (sum(n * n for n in NORMS.values())) ** 0.5
    without = (full ** 2 - NORMS["experts"] ** 2) ** 0.5
    clip = _read({}, {g: full / without for g in rowmath.GROUPS}, precision="bf16", scale=1.0, clip=0.05)
    assert clip["name"] == "clip-norm-without-group" and clip["group"] == "experts"
    assert f"predicts x {full / without:.4g}: the clip norm leaves out the expert gradients" in clip["sentence"]
    other = _read({}, {g: 1.5 for g in rowmath.GROUPS}, precision="bf16", scale=1.0, clip=0.05)
    assert other["name"] == "global-norm" and "clipped as if the global norm were" in other["sentence"]
    left_in = _read({g: 65536.0 for g in rowmath.GROUPS}, {}, precision="bf16", scale=1.0)
    assert left_in["name"] == "loss-scale" and "the training is right" in left_in["sentence"]
    assert _read({}, {}) is None  # noise only: the noise model's own verdict stands
    assert _read({"experts": 1.3}, {"experts": 1.3})["name"] == "expert-grad-scale"


# ------------------------------------------------------------------ the pinned release (multirank)


@pytest.mark.multirank
def test_half_rows_on_the_pinned_release_and_their_findings(monkeypatch):
    """ZeRO 0 fp16: the loss scale never applied (DeepSpeed PR #8393); ZeRO 0 bf16 with clipping: a clip norm
    without the expert gradients (PR #8613), with the factor; ZeRO 1 / 2 fp16 pass, an overflowing step skipped
    by design. DeepSpeed's accelerator is made to refuse fp16 here: the rows run because the ranks override it."""
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: False)  # the ranks fork with it
    rows, comparisons = _run(2, ["zero0/ep=2/w2/fp16+static-scale", "zero0/ep=2/w2/clip+bf16",
                                 "zero1/ep=2/w2/fp16+overflow", "zero2/ep=1/w2/clip+fp16"])
    never = rows["zero0/ep=2/w2/fp16+static-scale"]
    assert never["verdict"] == "fail" and never["diagnosis_name"] == "loss-scale-never-applied", never
    assert "first divergence at ZeRO 0, step 1" in never["diagnosis"]
    assert "every reported gradient is 0.007814 x the reference's (x loss scale 128) = 1/128" in never["diagnosis"]
    assert "measured: every update x 0.007814" in never["diagnosis"]
    clip = rows["zero0/ep=2/w2/clip+bf16"]
    assert clip["verdict"] == "fail" and clip["diagnosis_name"] == "clip-norm-without-group"
    assert "first divergence at ZeRO 0, step 1" in clip["diagnosis"]
    assert "every update is 1.18" in clip["diagnosis"] and "predicts x 1.185" in clip["diagnosis"]
    assert "the clip norm leaves out the expert gradients" in clip["diagnosis"]
    for key in ("zero1/ep=2/w2/fp16+overflow", "zero2/ep=1/w2/clip+fp16"):
        assert rows[key]["verdict"] == "pass", (key, rows[key]["diagnosis"])
        assert rows[key]["note"] == half.CPU_FP16_NOTE
    assert "note" not in clip
    skipped = [c for c in comparisons["zero1/ep=2/w2/fp16+overflow"] if "skipped on overflow" in c["name"]]
    assert skipped and all(c["passed"] for c in skipped)
    assert skipped[0]["note"] == "skipped by design: loss scale 65536 -> 32768"


# ------------------------------------------------------------------ injected faults (multirank)


FAULT_ROWS = {
    # fault: {row: (diagnosis name, text it must hold) or None (passes under it)}
    "loss-scale-never-applied": {
        "zero1/ep=2/w2/fp16": ("loss-scale-never-applied", "= 1/65536: the loss was never multiplied"),
        "zero2/ep=2/w2/fp16+static-scale": ("loss-scale-never-applied", "measured: every update x 0.007814"),
        "zero1/ep=2/w2/clip+bf16": None},
    "clip-norm-without-experts": {
        "zero1/ep=2/w2/clip+bf16": ("clip-norm-without-group", "the clip norm leaves out the expert gradients"),
        "zero2/ep=1/w2/clip": ("clip-norm-without-group", "the clip norm leaves out the expert gradients"),
        "zero1/ep=2/w2/fp16": None},
    "loss-scale-twice": {
        "zero2/ep=2/w2/fp16+static-scale": ("loss-scale-twice", "= 128: the loss was multiplied by the loss scale "
                                                                "twice"),
        "zero1/ep=2/w2/fp16": ("overflow-skip", "not: a loss scale applied twice overflows this way"),
        "zero1/ep=2/w2/clip+bf16": None},
    "pr8393-applied": {  # PR #8393's fix in-process: ZeRO 0 fp16 then shows PR #8613
        "zero0/ep=2/w2/clip+fp16": ("clip-norm-without-group", "the clip norm leaves out the expert gradients"),
        "zero0/ep=2/w2/fp16": None},
}
DEFAULT_FAULTS = ("loss-scale-never-applied",)
"""One fault in the default tier (~8 s); the others in the slow tier."""


@pytest.mark.multirank
@pytest.mark.faults
@pytest.mark.parametrize("fault", [pytest.param(f, marks=[] if f in DEFAULT_FAULTS else [pytest.mark.slow])
                                   for f in FAULT_ROWS])
def test_every_half_precision_fault_is_caught_and_named(monkeypatch, fault):
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    ds_half_faults.FAULTS[fault](monkeypatch.setattr)  # the ranks fork from this process: they inherit it
    expected = FAULT_ROWS[fault]
    rows, _ = _run(2, list(expected))
    for key, want in expected.items():
        row = rows[key]
        if want is None:
            assert row["verdict"] == "pass", (key, row["diagnosis"])
            continue
        assert row["verdict"] == "fail" and row["diagnosis_name"] == want[0], (key, row["diagnosis"])
        assert want[1] in " ".join(row["diagnosis"].split()) and "first divergence" in row["diagnosis"], key


# ------------------------------------------------------------------ slow: no false alarm over 5 seeds

RIGHT = ("zero[12]/*/*bf16*", "zero[12]/*/*fp16*")
"""The half-precision rows DeepSpeed 0.19.8 gets right: every fp16 and bf16 row at ZeRO 1 and 2."""
SEEDS = (0, 1, 2, 3, 4)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_no_false_alarm_over_five_seeds(world_size, capsys):
    pytest.importorskip("deepspeed")
    ratios = []
    for seed in SEEDS:
        checks = library_checks(["deepspeed"], (world_size,), patterns=tuple(ENGINE + p for p in RIGHT))
        with matrix.registered(checks):
            summary = run_checks(ParityConfig(world_size=world_size, timeout_s=120.0, seed=seed,
                                              checks=tuple(c.name for c in checks)))
        for row in rows_of(summary):
            assert row["verdict"] == "pass", (seed, row["check"], row["diagnosis"])
        ratios += [float(c["note"].split()[-1]) for check in summary["checks"] for c in check["comparisons"]
                   if "noise model" in c["name"] and c["note"].startswith("ratio")]
    with capsys.disabled():
        print(f"\nW={world_size}: {len(checks)} rows x {len(SEEDS)} seeds pass; noise ratios "
              f"{min(ratios):.3g}-{max(ratios):.3g} (at most {noisemath.BF16_NOISE_RATIO:g})")
