"""gpu-check's fastmoe build step (moebench.gpucheck.build) on CPU: the chapter's pitfalls judged by
env-check's own probes on a fake nvcc and CUDA_HOME, USE_NCCL chosen from what was found, pip's NCCL
made linkable, and the real pip install path on a stand-in fastmoe tree (pure Python, so no nvcc)."""

from __future__ import annotations

import dataclasses
import json
import os
import textwrap
from pathlib import Path

import pytest

from moebench.envcheck.torch_cuda import find_nvcc
from moebench.gpucheck import build

NVCC = """#!/bin/sh
echo "nvcc: NVIDIA (R) Cuda compiler driver"
echo "Cuda compilation tools, release {release}, V{release}.107"
"""
OK_TREE = {"status": "ok", "id": "fastmoe.tree", "found": "dm-tree 0.1.10", "hint": ""}


def _toolkit(tmp_path: Path, release: str = "12.3", headers: bool = True) -> Path:
    home = tmp_path / f"cuda-{release}"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(NVCC.format(release=release))
    nvcc.chmod(0o755)
    if headers:
        (home / "include").mkdir()
        (home / "include" / "cuda_runtime.h").write_text("/* fake */\n")
    return home


def _facts(tmp_path: Path, *, release="12.3", headers=True, torch_cuda="12.1", nccl="2.19.3", header=True,
           tree=OK_TREE, gpus=1) -> build.Facts:
    home = _toolkit(tmp_path, release, headers)
    env = {"CUDA_HOME": str(home), "PATH": "/usr/bin:/bin"}
    nccl_h = tmp_path / "nccl.h"
    nccl_h.write_text("#define NCCL_MAJOR 2\n#define NCCL_MINOR 19\n#define NCCL_PATCH 3\n")
    return build.Facts(torch_version="2.11.0+cu121", torch_cuda=torch_cuda, nvcc=dataclasses.asdict(find_nvcc(env)),
                       torch_nccl=nccl, nccl_header=str(nccl_h) if header else None, cxx="/usr/bin/c++", tree=tree,
                       gpu_count=gpus, arch="9.0" if gpus else None)


def test_a_matching_toolkit_is_no_pitfall_and_a_minor_difference_only_warns(tmp_path):
    facts = _facts(tmp_path)  # the chapter's own stack: cu121 wheel, CUDA 12.3 toolkit
    assert facts.nvcc["release"] == "12.3" and facts.nvcc["headers_ok"]
    assert build.pitfall(facts, use_nccl=True) is None


def test_another_cuda_major_stops_with_env_checks_fix(tmp_path):
    found = build.pitfall(_facts(tmp_path, release="11.8", torch_cuda="12.1"), use_nccl=True)
    assert found["id"] == "fastmoe.build" and "major differs" in found["found"]
    assert "install CUDA 12.1 and set CUDA_HOME" in found["hint"]


def test_a_cuda_home_without_headers_stops_with_the_missing_files_pitfall(tmp_path):
    found = build.pitfall(_facts(tmp_path, headers=False), use_nccl=False)
    assert "no include/cuda_runtime.h" in found["found"] and found["hint"].startswith("export CUDA_HOME=")


def test_a_cpu_torch_or_a_shadowed_tree_stops(tmp_path):
    assert "CPU build" in build.pitfall(_facts(tmp_path / "a", torch_cuda=None), use_nccl=False)["found"]
    shadow = {"status": "fail", "id": "fastmoe.tree", "found": "`tree` at x.py is not dm-tree", "hint": "pip ..."}
    assert build.pitfall(_facts(tmp_path / "b", tree=shadow), use_nccl=False)["id"] == "fastmoe.tree"


def test_the_refusal_is_one_line_naming_the_fix(tmp_path):
    code, doc = build.run(str(_stand_in_fastmoe(tmp_path)), tmp_path / "out", deadline_s=60, environ={},
                          facts=_facts(tmp_path, release="11.8", torch_cuda="12.1"))
    assert code == build.EXIT_REFUSED and doc["status"] == "refused"
    assert doc["reason"].startswith("fastmoe.build: no: nvcc 11.8 vs torch's CUDA 12.1") and "fix: " in doc["reason"]
    assert not (tmp_path / "out").exists()  # nothing built, nothing created


@pytest.mark.parametrize("nccl, header, environ, expected", [
    ("2.19.3", True, {}, True),
    ("2.7.4", True, {}, False),     # P2P needs >= 2.7.5 (the chapter's pitfall 1)
    ("2.19.3", False, {}, False),   # no nccl.h to compile against
    (None, False, {}, False),
    ("2.19.3", True, {"USE_NCCL": "0"}, False),  # the user's choice wins
    ("2.7.4", True, {"USE_NCCL": "1"}, True),
])
def test_use_nccl_is_chosen_from_what_env_check_found(tmp_path, nccl, header, environ, expected):
    use, why = build.choose_use_nccl(_facts(tmp_path, nccl=nccl, header=header), environ)
    assert use is expected and why


def test_a_forced_use_nccl_with_an_old_nccl_is_a_pitfall(tmp_path):
    found = build.pitfall(_facts(tmp_path, nccl="2.7.4"), use_nccl=True)
    assert "< 2.7.5" in found["found"] and "USE_NCCL=0" in found["hint"]


def test_pip_nccl_is_made_linkable_and_the_build_env_says_so(tmp_path):
    site = tmp_path / "site-packages" / "nvidia" / "nccl"
    (site / "include").mkdir(parents=True)
    (site / "lib").mkdir()
    (site / "include" / "nccl.h").write_text("")
    (site / "lib" / "libnccl.so.2").write_text("")
    facts = dataclasses.replace(_facts(tmp_path), nccl_header=str(site / "include" / "nccl.h"))
    env = build.build_env(facts, True, tmp_path / "out", {"PATH": "/bin"})
    link = tmp_path / "out" / "nccl-link" / "libnccl.so"
    assert link.is_symlink() and os.readlink(link).endswith("libnccl.so.2")
    assert env["LIBRARY_PATH"].split(os.pathsep)[:2] == [str(link.parent), str(site / "lib")]
    assert env["CPATH"] == str(site / "include")
    assert env["USE_NCCL"] == "1" and env["TORCH_CUDA_ARCH_LIST"] == "9.0"
    assert env["CUDA_HOME"] == facts.nvcc["torch_cuda_home"]
    assert build.build_env(facts, False, tmp_path / "out2", {})["USE_NCCL"] == "0"


def test_a_folder_that_is_not_fastmoe_is_named(tmp_path):
    assert "is not a fastmoe source tree (no setup.py, cuda/fmoe_cuda.cpp" in build.source_problem(str(tmp_path))


SETUP = """
import os
from setuptools import setup
if os.environ.get("USE_NCCL") == "1" and os.environ.get("FAKE_NCCL_BUILD_FAILS"):
    raise SystemExit("cuda/global_exchange.cpp:118:9: error: 'broadcastUniqueNCCLID' was not declared")
with open("fmoe_cuda.py", "w") as f:
    f.write("def global_scatter(): pass\\n" if os.environ.get("USE_NCCL") == "1" else "")
setup(name="fastmoe", version="1.1.0", packages=["fmoe"], py_modules=["fmoe_cuda"])
"""


def _stand_in_fastmoe(tmp_path: Path) -> Path:
    """A tree with fastmoe's layout whose setup.py builds pure Python (no nvcc here)."""
    src = tmp_path / "fastmoe"
    (src / "cuda").mkdir(parents=True)
    (src / "fmoe").mkdir()
    (src / "cuda" / "fmoe_cuda.cpp").write_text("// stand-in\n")
    (src / "fmoe" / "__init__.py").write_text("__version__ = '1.1.0'\n")
    (src / "setup.py").write_text(textwrap.dedent(SETUP))
    (src / ".git").mkdir()  # left behind by the copy
    return src


def test_the_build_installs_into_its_own_folder_then_reuses_it(tmp_path):
    src = _stand_in_fastmoe(tmp_path)
    facts = _facts(tmp_path)
    out = tmp_path / "out"
    code, doc = build.run(str(src), out, deadline_s=120, environ=dict(os.environ), facts=facts)
    assert code == 0, doc
    assert doc["status"] == "pass" and doc["use_nccl"] and not doc["reused"]
    assert doc["import"]["nccl_functions"] == ["global_scatter"]
    assert (out / "site" / "fmoe" / "__init__.py").exists() and not (src / "build").exists()  # the tree untouched
    assert not (out / "src" / ".git").exists()
    again_code, again = build.run(str(src), out, deadline_s=120, environ=dict(os.environ), facts=facts)
    assert again_code == 0 and again["reused"] and again["attempts"] == []


def test_a_failed_nccl_build_is_retried_without_nccl_on_one_gpu(tmp_path):
    src = _stand_in_fastmoe(tmp_path)
    environ = {**os.environ, "FAKE_NCCL_BUILD_FAILS": "1"}
    code, doc = build.run(str(src), tmp_path / "out", deadline_s=200, environ=environ, facts=_facts(tmp_path))
    assert code == 0, doc
    assert [a["use_nccl"] for a in doc["attempts"]] == [True, False]
    assert "broadcastUniqueNCCLID" in doc["attempts"][0]["error"]
    assert doc["use_nccl"] is False and "without NCCL after the NCCL build failed" in doc["reason"]
    assert doc["import"]["nccl_functions"] == []


def test_a_build_that_does_not_import_is_retried_too(tmp_path):
    src = _stand_in_fastmoe(tmp_path)
    setup = (src / "setup.py").read_text().replace(
        'f.write("def global_scatter(): pass\\n" if', 'f.write("import ncclUndefinedSymbol\\n" if')
    (src / "setup.py").write_text(setup)
    code, doc = build.run(str(src), tmp_path / "out", deadline_s=200, environ=dict(os.environ), facts=_facts(tmp_path))
    assert code == 0 and [a["ok"] for a in doc["attempts"]] == [False, True]
    assert doc["attempts"][0]["error"].startswith("built, but it does not import:")


def test_with_two_gpus_a_failed_nccl_build_fails(tmp_path):
    src = _stand_in_fastmoe(tmp_path)
    environ = {**os.environ, "FAKE_NCCL_BUILD_FAILS": "1"}
    code, doc = build.run(str(src), tmp_path / "out", deadline_s=120, environ=environ,
                          facts=_facts(tmp_path, gpus=2))
    assert code == 1 and doc["status"] == "fail" and len(doc["attempts"]) == 1
    assert "broadcastUniqueNCCLID" in doc["reason"] and "build.log" in doc["reason"]


def test_the_module_prints_one_json_document(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(build, "gather", lambda environ=None: _facts(tmp_path, torch_cuda=None))
    code = build.main(["--out", str(tmp_path / "o"), "--src", str(_stand_in_fastmoe(tmp_path))])
    doc = json.loads(capsys.readouterr().out)
    assert code == 2 and doc["status"] == "refused" and "CPU build" in doc["reason"]


def test_without_a_source_an_installed_fmoe_is_used_else_it_says_how(tmp_path, monkeypatch):
    code, doc = build.run(None, tmp_path / "o", deadline_s=30, environ={}, facts=_facts(tmp_path))
    assert code == 2 and doc["reason"].startswith("no fastmoe: pass FASTMOE_SRC=")
    site = tmp_path / "installed"
    (site / "fmoe").mkdir(parents=True)
    (site / "fmoe" / "__init__.py").write_text("")
    (site / "fmoe_cuda.py").write_text("def global_scatter(): pass\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    code, doc = build.run(None, tmp_path / "o", deadline_s=30, environ={}, facts=_facts(tmp_path, release="11.8"))
    assert code == 0 and doc["reason"].startswith("no FASTMOE_SRC: the installed fmoe")  # no build: no pitfall
    assert not (tmp_path / "o").exists()


def test_nccl_h_is_found_in_the_site_packages_a_venv_sees(tmp_path, monkeypatch):
    """A venv made by make gpu-check sees its interpreter's nvidia-nccl through site.getsitepackages()."""
    import site

    from moebench.envcheck import comm

    header = tmp_path / "base-site" / "nvidia" / "nccl" / "include" / "nccl.h"
    header.parent.mkdir(parents=True)
    header.write_text("#define NCCL_MAJOR 2\n#define NCCL_MINOR 27\n#define NCCL_PATCH 7\n")
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(tmp_path / "base-site")])
    assert str(header) in comm.nccl_header_candidates({})
