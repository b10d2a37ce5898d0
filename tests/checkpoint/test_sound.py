"""Sound checkpoints, saved by the frameworks themselves, pass: exit 0, every expert counted, the saved layout read
from the format, the finding saved under results/checkpoint/<run-id>/ and valid against its schema."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import audit, audit_json

from moebench import results

pytestmark = pytest.mark.multirank


def _saved_folder(document: dict) -> Path:
    folder = Path(document["results_path"]).parent
    assert results.read_back(folder / "checkpoint.json")["format"] == document["format"]
    summary = results.read_back(folder / "summary.json")
    assert summary["kind"] == "checkpoint" and summary["exit_code"] == (1 if document["problems"] else 0)
    return folder


def test_dcp_of_dtensor_sharded_experts_is_sound(dcp_folders):
    code, doc = audit_json(dcp_folders / "sound")
    assert code == 0 and doc["problems"] == [] and doc["format"] == "dcp"
    (layer,) = doc["layers"]
    assert layer["experts"] == 4 and layer["stored"] == "stacked"
    assert doc["saved"]["ep_size"] == 2  # two chunks along the expert dimension: one a rank
    assert doc["optimizer"]["present"] and doc["optimizer"]["steps"] == [1.0]
    _saved_folder(doc)


def test_hf_export_is_sound_and_counts_agree_with_its_config(hf_folders):
    code, doc = audit_json(hf_folders / "contiguous", "--hf-config", hf_folders / "contiguous" / "config.json")
    assert code == 0, doc["lines"]
    assert doc["format"] == "safetensors" and len(doc["layers"]) == 2
    for layer in doc["layers"]:
        assert layer["experts"] == 4 and layer["stored"] == "per-expert"
        assert set(layer["counted_by"].values()) == {4} and len(layer["counted_by"]) >= 3
    _saved_folder(doc)


def test_deepspeed_regular_is_sound_and_names_its_ep_size_trap(ds_folders):
    code, doc = audit_json(ds_folders / "regular")
    assert code == 0, doc["lines"]
    assert doc["format"] == "deepspeed" and doc["saved"]["ep_size"] == 2 and doc["saved"]["zero_stage"] == 0
    assert doc["layers"][0]["experts"] == 4
    assert doc["optimizer"]["present"] and doc["optimizer"]["steps"] == [2.0]
    assert any(line.startswith("trap:") and "ep_size 2 only" in line for line in doc["loads"])


def test_deepspeed_regular_zero1_reads_its_ep_size_from_the_parameter_shapes(ds_folders):
    code, doc = audit_json(ds_folders / "zero1" / "step2")
    assert code == 0, doc["lines"]
    assert doc["saved"]["ep_size"] == 1 and doc["saved"]["zero_stage"] == 1
    assert not doc["optimizer"]["present"]  # ZeRO's flat partitions: their files are checked, not their contents


def test_deepspeed_universal_is_sound(ds_folders):
    code, doc = audit_json(ds_folders / "zero1")
    assert code == 0, doc["lines"]
    assert doc["format"] == "deepspeed-universal" and doc["saved"]["zero_stage"] == 1
    assert doc["layers"][0]["experts"] == 4 and doc["optimizer"]["parameters"] > 8


def test_megatron_dist_checkpointing_is_sound(megatron_folders):
    code, doc = audit_json(megatron_folders / "sound")
    assert code == 0, doc["lines"]
    assert doc["format"] == "megatron torch_dist" and doc["saved"]["ep_size"] == 2
    (layer,) = doc["layers"]
    assert layer["experts"] == 8 and len(layer["counted_by"]) == 3  # the router and both expert stacks


def test_console_fits_80_columns_and_names_the_folder(dcp_folders):
    code, out, _, _ = audit(dcp_folders / "sound")
    assert code == 0
    assert all(len(line) <= 80 for line in out.splitlines() if not line.startswith("saved "))
    assert "4 experts" in out and out.splitlines()[-1].startswith("saved ")


def test_the_python_api_returns_the_document(dcp_folders, tmp_path):
    import moebench
    from moebench.errors import UserError

    doc = moebench.checkpoint(str(dcp_folders / "sound"), experts=4)
    assert doc["status"] == "sound" and doc["layers"][0]["counted_by"]["--experts"] == 4
    with pytest.raises(UserError, match="--experts"):
        moebench.checkpoint(str(dcp_folders / "sound"), experts=0)
    with pytest.raises(UserError, match="PATH"):
        moebench.checkpoint(str(tmp_path / "nothing-here"))
    assert not (Path(os.environ["MOEBENCH_RESULTS"]) / "checkpoint").exists() or \
        len(os.listdir(Path(os.environ["MOEBENCH_RESULTS"]) / "checkpoint")) == 1


def test_a_progress_line_on_a_terminal_only(monkeypatch, capsys):
    import io

    from moebench.cli import checkpoint as command

    monkeypatch.setattr(command, "PROGRESS_AFTER_S", 0.0)
    assert command._progress() is None  # pytest's stderr is no terminal
    monkeypatch.setattr(command.sys, "stderr", type("Tty", (io.StringIO,), {"isatty": lambda self: True})())
    show = command._progress()
    show(3 * 2**20, 8 * 2**20, "model.layers.0.moe.experts.w1")
    line = command.sys.stderr.getvalue()
    assert "reading 3 / 8 MiB  model.layers.0.moe.experts.w1" in line and len(line) <= 81


def test_importing_the_audit_package_keeps_the_api_function():
    """The package is moebench.checkpoint_audit, so `moebench.checkpoint` stays the API's function once it is
    imported (a package of the same name would replace the function by a module)."""
    import moebench.checkpoint_audit.run  # noqa: F401 - the import is the test
    from moebench import api

    assert moebench.checkpoint is api.checkpoint
