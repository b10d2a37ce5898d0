"""--ds-config against the preset and the flags (docs/run-deepspeed.md, `--ds-config`): a
flag-owned key of the file wins over the preset with one line saying so, conflicts with a flag
(or train_batch_size with the run's batch) are refused naming both, and the printed plan is the
run that happens."""

from __future__ import annotations

import json
import re
from pathlib import Path

from typer.testing import CliRunner

from moebench.cli.app import app

runner = CliRunner()


def _cfg(tmp_path: Path, doc: dict) -> str:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_the_files_micro_batch_replaces_the_presets_said_once_and_the_plan_is_what_runs(tmp_path):
    root = tmp_path / "r"
    done = runner.invoke(app, ["run", "deepspeed", "--preset", "quick", "--steps", "3", "--json",
                               "--ds-config", _cfg(tmp_path, {"train_micro_batch_size_per_gpu": 4}),
                               "--results-dir", str(root)])
    assert done.exit_code == 0, done.output
    note = ("--ds-config: train_micro_batch_size_per_gpu=4 in cfg.json replaces preset\n"
            "  quick's --batch-size 8: the run uses --batch-size 4 (4 per rank x 1 rank)")
    assert done.stderr.count(note) == 1, done.stderr
    summary = json.loads(done.stdout)
    (run,) = (root / "deepspeed").iterdir()
    config = json.loads((run / "config.json").read_text())
    assert config["train"]["batch_size"] == 4 and summary["ds_config"]["train_micro_batch_size_per_gpu"] == 4
    assert summary["tokens_per_step"] == 4 * config["train"]["seq_len"] and summary["steps"] == 3


def test_the_plan_line_says_the_batch_and_the_steps_that_run(tmp_path):
    from moebench import variants

    variant = variants.by_name("deepspeed")
    cfg = _cfg(tmp_path, {"train_micro_batch_size_per_gpu": 4})
    stopped = variant.headline(variants.resolve_config(variant, "quick", {("train", "steps"): 4,
                                                                          ("engine", "ds_config"): cfg}))
    assert re.search(r"; batch 4 \(4 per rank\); 4 steps, epochs of 16 steps \(preset quick\)$", stopped)
    whole = variant.headline(variants.resolve_config(variant, "quick", {}))
    assert whole.endswith("; batch 8 (8 per rank); 2 epochs x 8 steps (preset quick)"), whole


def test_train_batch_size_against_the_runs_batch_names_both_and_creates_nothing(tmp_path):
    root = tmp_path / "r"
    cfg = _cfg(tmp_path, {"train_batch_size": 16})
    done = runner.invoke(app, ["run", "deepspeed", "--preset", "quick", "--ds-config", cfg,
                               "--results-dir", str(root)])
    assert done.exit_code == 2 and not root.exists(), done.output
    assert done.output.startswith("error: --ds-config: train_batch_size=16 conflicts with --batch-size 8 "), \
        done.output
    assert "pass --batch-size 16" in done.output and len(done.output.strip().splitlines()) == 1
    agreed = runner.invoke(app, ["run", "deepspeed", "--preset", "quick", "--ds-config", cfg, "--batch-size", "16",
                                 "--show-config", "--results-dir", str(root)])
    assert agreed.exit_code == 0 and json.loads(agreed.stdout)["train"]["batch_size"] == 16, agreed.output


def test_a_file_value_equal_to_the_presets_says_nothing(tmp_path):
    done = runner.invoke(app, ["run", "deepspeed", "--preset", "quick", "--show-config", "-n", "2",
                               "--ds-config", _cfg(tmp_path, {"train_micro_batch_size_per_gpu": 4})])
    assert done.exit_code == 0 and done.stderr == "", done.stderr  # 4 per rank x 2 ranks = the preset's 8
