"""Each probe's verdict against faked environments: nvcc scripts, fmoe / fmoe_cuda / tree modules injected
into sys.modules, NCCL versions and headers, FMOE_* variables, the JIT cache, DeepSpeed's import."""

import os
import stat
import sys
import types

import pytest

from moebench.distributed.launch import LaunchResult
from moebench.envcheck import comm, deepspeed_stack, fastmoe_stack, probe, torch_cuda
from moebench.envcheck.check import FAIL, OK, PLATFORM, SKIP, WARN, Check, Report

NVCC_12_3 = "nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 12.3, V12.3.103\n"


def _fake_nvcc(root, text=NVCC_12_3, exit_code=0, headers=True):
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(f"#!/bin/sh\ncat <<'EOF'\n{text}EOF\nexit {exit_code}\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    if headers:
        (root / "include").mkdir()
        (root / "include" / "cuda_runtime.h").write_text("/* fake */\n")
    return nvcc


@pytest.fixture
def driver(monkeypatch):
    """Pretend a CUDA driver library is (or is not) installed."""
    def set_driver(present: bool):
        monkeypatch.setattr(torch_cuda.ctypes.util, "find_library",
                            lambda name: "libcuda.so.1" if present and name == "cuda" else None)
    return set_driver


def test_nvcc_matching_torch_cuda_is_ok(tmp_path, driver):
    driver(True)
    _fake_nvcc(tmp_path / "cuda")
    info = torch_cuda.find_nvcc({"CUDA_HOME": str(tmp_path / "cuda"), "PATH": ""})
    assert (info.release, info.full_version, info.found_via) == ("12.3", "12.3.103", "CUDA_HOME")
    check = torch_cuda.nvcc_check(info, torch_cuda="12.1", gpu_count=1)
    assert check.status == OK, check.found


def test_nvcc_of_another_major_than_torch_fails_on_a_gpu_machine(tmp_path, driver):
    driver(True)
    _fake_nvcc(tmp_path / "cuda")
    info = torch_cuda.find_nvcc({"CUDA_HOME": str(tmp_path / "cuda")})
    check = torch_cuda.nvcc_check(info, torch_cuda="11.8", gpu_count=2)
    assert check.status == FAIL and "major version differs" in check.found


def test_nvcc_that_exists_but_cannot_work_is_reported_as_such(tmp_path, driver):
    # This machine's situation: nvcc runs, but there is no driver and torch is a CPU build. Nothing
    # here needs it, so it is a skip (a warning would fail `env-check --strict` on a healthy machine).
    driver(False)
    _fake_nvcc(tmp_path / "cuda")
    info = torch_cuda.find_nvcc({"CUDA_HOME": str(tmp_path / "cuda")})
    check = torch_cuda.nvcc_check(info, torch_cuda=None, gpu_count=0)
    assert check.status == SKIP
    assert "not needed on this CPU-only machine" in check.found
    assert "no CUDA driver" in check.found and "CPU build" in check.found


def test_nvcc_with_a_cpu_torch_on_a_gpu_machine_still_warns(tmp_path, driver):
    driver(True)
    _fake_nvcc(tmp_path / "cuda")
    info = torch_cuda.find_nvcc({"CUDA_HOME": str(tmp_path / "cuda")})
    check = torch_cuda.nvcc_check(info, torch_cuda=None, gpu_count=0)
    assert check.status == WARN and "CUDA 12.3 torch wheel" in check.hint


def test_nvcc_that_does_not_run_is_reported(tmp_path, driver):
    driver(True)
    _fake_nvcc(tmp_path / "cuda", text="nvcc fatal: libcudart missing\n", exit_code=1)
    info = torch_cuda.find_nvcc({"CUDA_HOME": str(tmp_path / "cuda")})
    assert info.release is None and "exited with 1" in info.run_error
    check = torch_cuda.nvcc_check(info, torch_cuda="12.1", gpu_count=1)
    assert check.status == FAIL and "does not work" in check.found


def test_nvcc_whose_cuda_home_lacks_headers_names_the_real_toolkit(tmp_path, driver, monkeypatch):
    # A wrapper on PATH (like /usr/local/bin/nvcc here): torch would take its parent's parent as CUDA_HOME.
    driver(True)
    toolkit = tmp_path / "cuda-12.3"
    dry = "#$ _HERE_=" + str(toolkit / "bin") + "\n"
    _fake_nvcc(tmp_path / "wrapper", text=NVCC_12_3 + dry, headers=False)
    monkeypatch.setenv("PATH", str(tmp_path / "wrapper" / "bin") + os.pathsep + os.environ["PATH"])
    info = torch_cuda.find_nvcc({})
    assert info.found_via == "PATH" and not info.headers_ok
    assert info.torch_cuda_home == str(tmp_path / "wrapper")
    assert info.toolkit_root == str(toolkit)
    check = torch_cuda.nvcc_check(info, torch_cuda="12.3", gpu_count=1)
    assert check.status == FAIL and "no include/cuda_runtime.h" in check.found
    assert f"CUDA_HOME={toolkit}" in check.hint


def test_no_nvcc_on_a_cpu_machine_is_a_skip():
    info = torch_cuda.Nvcc(path=None)
    assert torch_cuda.nvcc_check(info, torch_cuda=None, gpu_count=0).status == SKIP
    assert torch_cuda.nvcc_check(info, torch_cuda="12.1", gpu_count=1).status == WARN


BUILD_OK = dict(torch_cuda="12.1", nvcc_release="12.1", nvcc_error="", headers_ok=True, cuda_home="/usr/local/cuda",
                toolkit_root=None, cxx="/usr/bin/c++", nccl_header="/usr/include/nccl.h", torch_nccl="2.19.3",
                use_nccl=True)


@pytest.mark.parametrize("change, status, words", [
    ({}, OK, "yes"),
    ({"nvcc_release": "12.3"}, WARN, "minor differs"),            # the chapter's own cu121 torch + CUDA 12.3
    ({"nvcc_release": "11.8"}, FAIL, "major differs"),
    ({"torch_cuda": None}, SKIP, "CPU build"),
    ({"nvcc_release": None, "nvcc_error": "nvcc not found"}, FAIL, "no working nvcc"),
    ({"headers_ok": False}, FAIL, "missing files"),
    ({"cxx": None}, FAIL, "C++"),
    ({"nccl_header": None}, FAIL, "no nccl.h"),
    ({"torch_nccl": "2.7.4"}, FAIL, "< 2.7.5"),
    ({"nccl_header": None, "torch_nccl": None, "use_nccl": False}, OK, "USE_NCCL=0"),
])
def test_can_build_fastmoe_verdicts(change, status, words):
    check = fastmoe_stack.build_check(**{**BUILD_OK, **change})
    assert check.status == status and words in check.found, check.found


@pytest.mark.parametrize("change", [{"headers_ok": False}, {"nvcc_release": None, "nvcc_error": "not found"},
                                    {"nvcc_release": "11.8"}])
def test_a_build_that_cannot_work_without_a_gpu_is_a_warning(change):
    """A CUDA build of torch on a machine without a GPU (a laptop, a login node, CI): fmoe could not run there
    either, so the build's verdict warns instead of failing env-check; with a GPU the same is a failure."""
    without = fastmoe_stack.build_check(**{**BUILD_OK, **change}, gpus=False)
    assert without.status == WARN and "no GPU here" in without.found and without.found.startswith("no: ")
    assert fastmoe_stack.build_check(**{**BUILD_OK, **change}, gpus=True).status == FAIL
    assert fastmoe_stack.build_check(**BUILD_OK, gpus=False).status == OK


@pytest.mark.parametrize("version, raw, cuda_build, status", [
    ((2, 19, 3), "(2, 19, 3)", True, OK),
    ((2, 7, 5), "2705", True, OK),
    ((2, 7, 4), "2704", True, FAIL),
    (None, "unavailable", True, FAIL),
    (None, "unavailable", False, SKIP),
])
def test_nccl_version_against_fastmoe_minimum(version, raw, cuda_build, status):
    assert comm.nccl_version_check(version, raw, cuda_build).status == status


def test_nccl_header_found_from_nccl_home_and_compared(tmp_path):
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "nccl.h").write_text("#define NCCL_MAJOR 2\n#define NCCL_MINOR 18\n#define NCCL_PATCH 1\n")
    path, header = comm.find_nccl_header({"NCCL_HOME": str(tmp_path)})
    assert path == str(tmp_path / "include" / "nccl.h") and header == (2, 18, 1)
    assert comm.nccl_header_check(path, header, (2, 19, 3), True).status == WARN
    assert comm.nccl_header_check(path, header, (2, 18, 3), True).status == OK
    assert comm.nccl_header_check(None, None, (2, 19, 3), True).status == WARN
    assert comm.nccl_header_check(None, None, None, False).status == SKIP


def _module(name, **attrs):
    m = types.ModuleType(name)
    m.__file__ = f"/elsewhere/{name}.py"
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


def test_fmoe_cuda_without_nccl_functions_means_built_with_use_nccl_0(monkeypatch):
    monkeypatch.setitem(sys.modules, "fmoe_cuda", _module("fmoe_cuda", ensure_nccl=print, expert_count=print))
    check = fastmoe_stack.fmoe_cuda_check(cuda_usable=True)
    assert check.status == WARN and "USE_NCCL=0" in check.found
    assert check.data["missing"] == ["global_scatter", "global_gather"]


def test_fmoe_cuda_with_nccl_functions_is_ok(monkeypatch):
    monkeypatch.setitem(sys.modules, "fmoe_cuda",
                        _module("fmoe_cuda", ensure_nccl=print, global_scatter=print, global_gather=print))
    assert fastmoe_stack.fmoe_cuda_check(cuda_usable=True).status == OK


def test_fmoe_without_its_extension_fails(monkeypatch):
    monkeypatch.setitem(sys.modules, "fmoe", _module("fmoe"))
    monkeypatch.setitem(sys.modules, "fmoe_cuda", None)  # None in sys.modules: `import fmoe_cuda` raises
    check = fastmoe_stack.fmoe_cuda_check(cuda_usable=True)
    assert check.status == FAIL and "although fmoe is installed" in check.found
    assert fastmoe_stack.fmoe_check(cuda_usable=True).status == OK


def test_fmoe_absent_is_skip_on_cpu_and_warn_with_gpus(monkeypatch):
    monkeypatch.setitem(sys.modules, "fmoe", None)
    assert fastmoe_stack.fmoe_check(cuda_usable=False).status == SKIP
    assert fastmoe_stack.fmoe_check(cuda_usable=True).status == WARN


def test_shadowing_tree_module_without_map_structure_fails(monkeypatch):
    monkeypatch.setitem(sys.modules, "tree", _module("tree", flatten=list))
    check = fastmoe_stack.tree_check()
    assert check.status == FAIL and "shadows" in check.found and check.data["missing"] == ["map_structure"]


def test_tree_with_the_functions_but_not_from_dm_tree_warns(monkeypatch):
    monkeypatch.setitem(sys.modules, "tree", _module("tree", flatten=list, map_structure=map))
    check = fastmoe_stack.tree_check()
    assert check.status == WARN and "not dm-tree's" in check.found


def test_real_dm_tree_is_ok():
    check = fastmoe_stack.tree_check()
    assert check.status == OK and check.data["from_dm_tree"], check.found


@pytest.mark.parametrize("environ, status, words", [
    ({}, OK, "default code path"),
    ({"FMOE_FASTER_SCHEDULE_ENABLE": "1"}, WARN, "FasterMoE"),
    ({"FMOE_FASTER_SHADOW_ENABLE": "ON"}, WARN, "FasterMoE"),
    ({"FMOE_FASTER_SCHEDULE_ENABLE": "true"}, WARN, "ignored by fastmoe"),
    ({"FMOE_FASTER_GROUP_SIZE": "4"}, OK, "FMOE_FASTER_GROUP_SIZE=4"),
])
def test_fmoe_faster_variables(environ, status, words):
    check = fastmoe_stack.env_check(environ)
    assert check.status == status and words in check.found


def test_jit_cache_lists_built_ops(tmp_path, monkeypatch):
    (tmp_path / "cpu_adam").mkdir()
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")
    (tmp_path / "half_built").mkdir()  # a folder without its .so is not a cached op
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert deepspeed_stack.extensions_root() == str(tmp_path)
    assert deepspeed_stack.cached_ops(str(tmp_path)) == ["cpu_adam"]


def test_default_jit_cache_folder_is_per_python_and_accelerator(monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    import torch

    root = deepspeed_stack.extensions_root()
    accelerator = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"  # a CUDA build: cu132
    assert os.path.basename(root) == f"py{sys.version_info.major}{sys.version_info.minor}_{accelerator}"
    assert "torch_extensions" in root


def test_importing_deepspeed_builds_nothing_and_keeps_stdout_clean(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    result = deepspeed_stack.import_deepspeed()
    assert "error" not in result, result
    assert result["built_during_import"] == [] and list(tmp_path.iterdir()) == []
    assert result["accelerator"] == "cpu" and result["comm_backend"] == "gloo"
    assert capsys.readouterr().out == ""
    assert deepspeed_stack.import_check(result).status == OK


def test_an_import_that_built_something_fails():
    check = deepspeed_stack.import_check({"import_s": 70.0, "built_during_import": ["cpu_adam/cpu_adam.so"]})
    assert check.status == FAIL and "cpu_adam" in check.found
    assert deepspeed_stack.import_check({"error": "ImportError: x"}).status == FAIL


def _launch_result(returns, status="ok", errors=None):
    return LaunchResult(status=status, world_size=2, backend="gloo", returns=returns, errors=errors or {},
                        stacks={}, stuck_ranks=[], elapsed_s=0.1)


def test_probe_verdict_names_an_unsupported_collective():
    good = {"ok": True, "ms": 1.0}
    bad = {"ok": False, "error": "RuntimeError: ProcessGroupGloo does not support alltoall_base"}
    ranks = [{"all_reduce": good, "all_gather_variable": good, "all_to_all_single_uneven": bad}] * 2
    check = probe.probe_check("gloo", 30, _launch_result(ranks))
    assert check.status == FAIL and "2/3 collectives ok" in check.found and "all_to_all_single_uneven" in check.found
    assert "lacks all_to_all_single_uneven" in check.hint


def test_probe_verdict_for_a_rank_that_raised():
    check = probe.probe_check("gloo", 30, _launch_result([None, None], status="failed",
                                                          errors={1: "Traceback\nRuntimeError: boom\n"}))
    assert check.status == FAIL and "rank 1 failed: RuntimeError: boom" in check.found


def test_probe_verdict_names_the_rank_that_failed_first_not_the_peer_that_lost_it():
    lost = "Traceback\nRuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:4567\n"
    check = probe.probe_check("gloo", 30, _launch_result([None, None], status="failed",
                                                          errors={0: lost, 1: "Traceback\nRuntimeError: boom\n"}))
    assert check.status == FAIL and "rank 1 failed: RuntimeError: boom" in check.found, check.found


def test_check_rejects_unknown_status_and_section():
    with pytest.raises(ValueError):
        Check(id="x", section=PLATFORM, title="x", status="fine", found="")
    with pytest.raises(ValueError):
        Check(id="x", section="Elsewhere", title="x", status=OK, found="")


@pytest.mark.parametrize("statuses, strict, code", [
    ([OK, SKIP], False, 0), ([OK, SKIP], True, 0), ([OK, WARN], False, 0), ([OK, WARN], True, 1),
    ([OK, FAIL], False, 1), ([WARN, FAIL], True, 1),
])
def test_report_exit_codes(statuses, strict, code):
    report = Report(checks=[Check(id=f"c{i}", section=PLATFORM, title="t", status=s, found="")
                            for i, s in enumerate(statuses)],
                    mode="full", created="", elapsed_s=0.0, probe={}, moebench_version="0", hostname="h")
    assert report.exit_code(strict) == code


def test_half_set_launcher_variables_warn(monkeypatch):
    from moebench.envcheck import host

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("RANK", "1")
    check = host._env_check()
    assert check.status == WARN and "RANK=1" in check.found and "only one of RANK / WORLD_SIZE" in check.found


def test_gloo_socket_ifname_naming_no_interface_fails(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no_such_nic0")
    check = next(c for c in comm.checks() if c.id == "comm.gloo")
    assert check.status == FAIL and "names no network interface" in check.found


@pytest.fixture(scope="module")
def summary_lookup():
    from moebench.envcheck import run_all

    report = run_all(probe=False, import_deepspeed=False, mode="summary")
    return report.get


def test_variant_with_a_missing_module_cannot_run(monkeypatch, summary_lookup):
    from moebench import variants
    from moebench.envcheck import capabilities

    class Ghost(type(variants.VARIANTS[0])):
        name, requires = "ghost", ("torch", "no_such_module_xyz")

    fake = Ghost()
    monkeypatch.setattr(variants, "VARIANTS", variants.VARIANTS + (fake,))
    checks = {c.id: c for c in capabilities.checks(summary_lookup)}
    assert checks["can_run.ghost"].status == FAIL and "no_such_module_xyz" in checks["can_run.ghost"].found
    assert {f"can_run.{v.name}" for v in variants.VARIANTS} <= set(checks)


def test_verify_parity_reports_a_registry_that_does_not_load(monkeypatch, summary_lookup):
    from moebench.envcheck import capabilities

    monkeypatch.setattr(capabilities, "_parity_registry", lambda: (None, {}, "ImportError: broken"))
    check = next(c for c in capabilities.checks(summary_lookup) if c.id == "can_run.verify_parity")
    assert check.status == WARN and "ImportError: broken" in check.found
    assert check.data["gloo_max_local_world_size"] >= 1
