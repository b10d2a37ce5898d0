"""Bad input: one line naming the argument and the fix, exit 2, no traceback, nothing written under results/."""

from __future__ import annotations

import os

import pytest
from conftest import audit

pytestmark = pytest.mark.faults


def _refused(*args, name: str, said: str) -> None:
    results = os.environ["MOEBENCH_RESULTS"]
    code, out, err, seconds = audit(*args)
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert code == 2, (out, err)
    assert len(lines) == 1 and lines[0].startswith("error: ") and name in lines[0] and said in lines[0], lines
    assert "Traceback" not in out + err
    assert not os.path.exists(results), os.listdir(results)
    assert seconds < 30


def test_a_path_that_is_missing_a_file_a_fifo_or_a_link_loop(tmp_path):
    _refused(tmp_path / "absent", name="PATH", said="does not exist")
    (tmp_path / "file").write_text("x")
    _refused(tmp_path / "file", name="PATH", said="not a folder")
    os.mkfifo(tmp_path / "fifo")
    _refused(tmp_path / "fifo", name="PATH", said="not a folder")
    os.symlink(tmp_path / "loop-b", tmp_path / "loop-a")
    os.symlink(tmp_path / "loop-a", tmp_path / "loop-b")
    _refused(tmp_path / "loop-a", name="PATH", said="loop")


def test_a_folder_of_another_kind_says_what_it_found_and_what_it_reads(tmp_path):
    folder = tmp_path / "not-a-checkpoint"
    folder.mkdir()
    (folder / "notes.txt").write_text("x")
    (folder / "weights.bin").write_bytes(b"\0" * 16)
    _refused(folder, name="PATH", said="found 2 entries: notes.txt, weights.bin")
    _refused(folder, name="PATH", said="safetensors")


def test_dcp_metadata_that_is_not_dcp_is_refused(tmp_path):
    folder = tmp_path / "fake-dcp"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"not a pickle")
    _refused(folder, name="PATH", said="cannot be read as DCP metadata")


def test_a_cut_index_is_refused(tmp_path, dcp_folders):
    folder = tmp_path / "fake-hf"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"a": "x.safe')
    _refused(folder, name="PATH", said="not a safetensors index")
    _refused(dcp_folders / "sound", "--against", folder, name="--against", said="not a safetensors index")


def test_bad_flags(tmp_path, dcp_folders):
    _refused(dcp_folders / "sound", "--experts", "0", name="--experts", said="")
    _refused(dcp_folders / "sound", "--against", tmp_path / "absent", name="--against", said="does not exist")
    config = tmp_path / "model-config.json"
    config.write_text('{"hidden_size": 8}')
    _refused(dcp_folders / "sound", "--hf-config", config, name="--hf-config", said="names no expert count")
    config.write_text("{")
    _refused(dcp_folders / "sound", "--hf-config", config, name="--hf-config", said="not JSON")
    config.write_text('{"num_experts": 4}')
    _refused(dcp_folders / "sound", "--hf-config", config, "--experts", "4", name="--hf-config", said="--experts")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a folder whatever its permissions")
def test_an_unreadable_folder(tmp_path):
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0)
    try:
        _refused(folder, name="PATH", said="cannot")
    finally:
        folder.chmod(0o700)
