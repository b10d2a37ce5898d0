"""The findings of docs/findings/: each page's standalone script, run as a user runs it (torch and the library only: a
`moebench` that raises on import is first on PYTHONPATH), exits 1 with the finding's sentence on an affected
release, and 0 with the fix the page proposes (its ```diff block applied to the installed release's function in the
script's process: with_patch.py). Other releases are side-installed (tests/helpers/releases.py) for the slow tier.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.releases import side_install

REPO = Path(__file__).resolve().parents[2]
FINDINGS = REPO / "docs" / "findings"
WITH_PATCH = Path(__file__).with_name("with_patch.py")
SCRIPT_TIMEOUT_S = 600.0
"""A script takes 10-30 s on 2 shared cores; a fresh --target release compiles its .pyc files first (~1 min)."""


@dataclass(frozen=True)
class Finding:
    name: str
    patched: tuple[str, ...]
    """MODULE:QUALNAME of each function the page's diff changes."""

    @property
    def script(self) -> Path:
        return FINDINGS / f"{self.name}.py"

    @property
    def page(self) -> Path:
        return FINDINGS / f"{self.name}.md"


SHARED_STEP = Finding("deepspeed-zero3-universal-shared-step", (
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3",))

DROPPED_BUFFERS = Finding("deepspeed-universal-load-drops-buffers", (
    "deepspeed.runtime.engine:DeepSpeedEngine._load_checkpoint",))

GPT_OSS_ONE_HOT = Finding("transformers-gpt-oss-ep-one-hot", (
    "transformers.models.gpt_oss.modeling_gpt_oss:GptOssExperts.forward",))

OTHER_EP_SIZE = Finding("deepspeed-autoep-load-other-ep-size", (
    "deepspeed.runtime.engine:DeepSpeedEngine._load_checkpoint",))


def deepspeed_release(version: str) -> Path:
    return side_install(f"deepspeed-{version}", [f"deepspeed=={version}"], "deepspeed/__init__.py")


def transformers_release(version: str) -> Path:
    """As tests/libraries/test_transformers_releases.py installs 5.x (the same cache folder); 4.x with the
    huggingface-hub 0.x, tokenizers and requests it imports (the venv's are transformers 5's)."""
    if version.startswith("4."):
        deps = ["huggingface-hub<1.0", "tokenizers<0.23", "requests", "urllib3", "idna", "charset-normalizer",
                "certifi"]
    else:
        deps = ["huggingface-hub<2", "httpx==0.28.1", "httpcore==1.0.9", "certifi"] if version < "5.18" else []
    return side_install(f"transformers-{version}", [f"transformers=={version}", *deps], "transformers/__init__.py")


def run(finding: Finding, tmp_path: Path, *args: str, release: Path | None = None,
        patch: bool = False) -> subprocess.CompletedProcess:
    """The finding's script with `args` from an unrelated folder; `release` first on PYTHONPATH; `patch`: under
    with_patch.py with the page's diff."""
    poison = tmp_path / "poison" / "moebench"
    poison.mkdir(parents=True, exist_ok=True)
    (poison / "__init__.py").write_text("raise ImportError('a findings script must not import moebench')\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=os.pathsep.join(str(p) for p in (poison.parent, release) if p), DS_ACCELERATOR="cpu",
               OMP_NUM_THREADS="1")
    command = [str(finding.script), *args]
    if patch:
        command = [str(WITH_PATCH), str(finding.page), *finding.patched, "--", *command]
    return subprocess.run([sys.executable, *command], cwd=elsewhere, env=env, capture_output=True, text=True,
                          timeout=SCRIPT_TIMEOUT_S)


def verdict(done: subprocess.CompletedProcess) -> str:
    """The script's own lines from the BUG:/OK: line on (the library's logging is left out)."""
    lines = done.stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(("BUG:", "OK:"))), None)
    assert start is not None, f"exit {done.returncode}, no verdict\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return "\n".join(lines[start:])


# --- DeepSpeed ZeRO-3 universal load: one shared AdamW step tensor, group 0's hyperparameters on every group ---


def _shared_step_faults(text: str) -> tuple[list[tuple[int, int, int]], set[tuple[int, str]]]:
    steps = [tuple(map(int, m)) for m in re.findall(r"group (\d+): AdamW step (\d+) after the resume, (\d+) "
                                                    r"uninterrupted", text)]
    hyper = set(re.findall(r"group (\d+): (lr|weight_decay) \S+ after the resume, \S+ uninterrupted", text))
    return steps, {(int(g), k) for g, k in hyper}


def test_zero3_universal_load_shares_one_step_and_copies_group_0s_hyperparameters(tmp_path):
    done = run(SHARED_STEP, tmp_path)
    text = verdict(done)
    assert done.returncode == 1, text
    steps, hyper = _shared_step_faults(text)
    # every group steps past the uninterrupted run's step (one in-place increment per group on one shared tensor)
    assert [g for g, _, _ in steps] == [0, 1] and all(got > want for _, got, want in steps), text
    assert hyper == {(1, "lr"), (1, "weight_decay")}, text
    assert "group 1: parameters differ from the uninterrupted run" in text
    assert "group 0: parameters differ" not in text  # the first group steps with the right t and its own lr


def test_zero3_universal_load_with_the_pages_patch_resumes_exactly(tmp_path):
    done = run(SHARED_STEP, tmp_path, patch=True)
    assert done.returncode == 0, verdict(done)
    assert verdict(done) == "OK: the resumed run matches the uninterrupted run"


@pytest.mark.slow
def test_one_param_group_in_two_zero3_sub_groups_shares_the_step_too(tmp_path):
    """--one-group: every parameter in one param group, split by sub_group_size: the step alone is wrong (no
    hyperparameter to copy), and the page's patch fixes it too."""
    done = run(SHARED_STEP, tmp_path, "--one-group")
    text = verdict(done)
    assert done.returncode == 1, text
    steps, hyper = _shared_step_faults(text)
    assert [g for g, _, _ in steps] == [0, 1] and all(got > want for _, got, want in steps) and not hyper, text
    assert "group 1: parameters differ from the uninterrupted run" in text
    patched = run(SHARED_STEP, tmp_path, "--one-group", patch=True)
    assert patched.returncode == 0, verdict(patched)


def test_the_patch_wrapper_refuses_a_diff_that_does_not_fit(tmp_path):
    """with_patch.py applies a hunk only where its text is found exactly once: a page whose diff no longer fits the
    release fails (exit 3) instead of running the script unpatched."""
    page = tmp_path / "page.md"
    page.write_text(SHARED_STEP.page.read_text().replace(
        "-                    self.optimizer.state[fp32_param]['step'] = state_step",
        "-                    self.optimizer.state[fp32_param]['step'] = state_step  # a line the release lacks"))
    done = subprocess.run([sys.executable, str(WITH_PATCH), str(page), *SHARED_STEP.patched, "--", "unused.py"],
                          env={**os.environ, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.18.0", "0.19.5"])
def test_zero3_universal_shared_step_on_older_releases(version, tmp_path):
    """0.18.0 is the first release with the loop (#7585); 0.19.5 one in between."""
    done = run(SHARED_STEP, tmp_path, release=deepspeed_release(version))
    text = verdict(done)
    assert done.returncode == 1 and _shared_step_faults(text)[1] == {(1, "lr"), (1, "weight_decay")}, text
    patched = run(SHARED_STEP, tmp_path, release=deepspeed_release(version), patch=True)
    assert patched.returncode == 0, verdict(patched)


@pytest.mark.slow
def test_before_the_loop_a_two_group_zero3_checkpoint_does_not_convert(tmp_path):
    """0.17.6, the last release before #7585: no release resumed this model right; before 0.18.0 ds_to_universal
    raises on a ZeRO-3 checkpoint of two param groups (deepspeedai/DeepSpeed#7584)."""
    done = run(SHARED_STEP, tmp_path, release=deepspeed_release("0.17.6"))
    assert done.returncode == 1
    assert "BUG:" not in done.stdout and "OK:" not in done.stdout
    assert re.search(r"RuntimeError: start \(\d+\) \+ length \(\d+\) exceeds dimension size", done.stderr), \
        done.stderr[-3000:]


# --- DeepSpeed universal load: the module's buffers are never restored ---

BATCHNORM_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def _dropped_buffers(text: str) -> set[tuple[int, str]]:
    return {(int(z), b) for z, b in re.findall(r"ZeRO (\d): buffer 1\.(\w+) is .* after the load, .* saved", text)}


def test_universal_load_leaves_batchnorm_statistics_fresh(tmp_path):
    done = run(DROPPED_BUFFERS, tmp_path)
    text = verdict(done)
    assert done.returncode == 1, text
    assert _dropped_buffers(text) == {(z, b) for z in (1, 3) for b in BATCHNORM_BUFFERS}, text
    for z in (1, 3):
        assert f"ZeRO {z}: buffer 1.num_batches_tracked is [0]... after the load, [3]... saved" in text
        assert f"ZeRO {z}: the loaded model's eval output differs from the saved model's" in text


def test_universal_load_with_the_pages_patch_restores_every_buffer(tmp_path):
    done = run(DROPPED_BUFFERS, tmp_path, patch=True)
    assert done.returncode == 0, verdict(done)
    assert verdict(done) == "OK: every buffer restored, the loaded model's eval output is the saved model's"


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.16.9", "0.18.0"])
def test_universal_load_drops_buffers_on_older_releases(version, tmp_path):
    """No release restores them: the skip is from #1953 (0.7.0); 0.16.9 is the oldest release measured here."""
    done = run(DROPPED_BUFFERS, tmp_path, release=deepspeed_release(version))
    text = verdict(done)
    assert done.returncode == 1 and _dropped_buffers(text) == {(z, b) for z in (1, 3) for b in BATCHNORM_BUFFERS}, \
        text


# --- transformers GPT-OSS under expert parallelism: one_hot without the sentinel class ---

ONE_HOT = re.compile(r"^rank (\d): BUG: the expert-parallel forward raises RuntimeError: Class values must be smaller "
                     r"than num_classes\. \(in forward, modeling_gpt_oss\.py line \d+\)$", re.M)


def test_gpt_oss_eager_experts_raise_on_the_ep_sentinel(tmp_path):
    done = run(GPT_OSS_ONE_HOT, tmp_path)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    assert sorted(ONE_HOT.findall(done.stdout)) == ["0", "1"], done.stdout[-2000:]


def test_gpt_oss_with_the_pages_patch_matches_one_process(tmp_path):
    done = run(GPT_OSS_ONE_HOT, tmp_path, patch=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert re.findall(r"^rank (\d): OK: the logits match the one-process model", done.stdout, re.M) == ["0", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("version", ["5.17.0", "5.24.0"])
def test_gpt_oss_one_hot_on_other_releases(version, tmp_path):
    """5.17.0, the oldest release whose expert parallelism the script drives; 5.24.0, the newest measured."""
    folder = transformers_release(version)
    done = run(GPT_OSS_ONE_HOT, tmp_path, release=folder)
    assert done.returncode == 1 and sorted(ONE_HOT.findall(done.stdout)) == ["0", "1"], \
        done.stdout[-2000:] + done.stderr[-3000:]
    assert f"transformers {version}," in done.stdout
    assert run(GPT_OSS_ONE_HOT, tmp_path, release=folder, patch=True).returncode == 0


# --- DeepSpeed AutoEP: a regular load at another autoep_size is accepted, the experts' ZeRO state wrong ---

EXPERT_STATE = re.compile(r"^ZeRO (\d), load at autoep_size (\d): (fp32 master|exp_avg|exp_avg_sq|weights) of experts "
                          r"\[([\d, ]+)\] wrong after the load", re.M)


def _other_ep_size_faults(text: str) -> set[tuple[int, int, str, int]]:
    """(ZeRO stage, load autoep_size, quantity, number of experts wrong)."""
    return {(int(z), int(ep), q, len(experts.split(","))) for z, ep, q, experts in EXPERT_STATE.findall(text)}


# the fp32 masters and both moments of all 8 experts, at ZeRO 1 and 2; never the weights, never the control load
OTHER_EP_SIZE_FAULTS = {(z, 1, q, 8) for z in (1, 2) for q in ("fp32 master", "exp_avg", "exp_avg_sq")}


@pytest.mark.slow
def test_autoep_load_at_another_ep_size_is_accepted_with_the_experts_state_wrong(tmp_path):
    """40-50 s: two ZeRO stages, three engines each, on 2 ranks."""
    done = run(OTHER_EP_SIZE, tmp_path)
    text = verdict(done)
    assert done.returncode == 1, text
    assert _other_ep_size_faults(text) == OTHER_EP_SIZE_FAULTS, text
    assert "refused" not in text and "raises" not in text


@pytest.mark.slow
def test_autoep_load_with_the_pages_patch_is_refused_and_the_control_restores_everything(tmp_path):
    done = run(OTHER_EP_SIZE, tmp_path, patch=True)
    text = verdict(done)
    assert done.returncode == 0, text
    assert [int(z) for z in re.findall(r"^ZeRO (\d), load at autoep_size 1: refused: RuntimeError: This AutoEP "
                                       r"checkpoint was saved at autoep_size \[2\]", text, re.M)] == [1, 2], text


@pytest.mark.slow
def test_autoep_load_at_another_ep_size_on_the_first_autoep_release(tmp_path):
    """0.19.2, AutoEP's first release: the same experts' state wrong."""
    done = run(OTHER_EP_SIZE, tmp_path, release=deepspeed_release("0.19.2"))
    text = verdict(done)
    assert done.returncode == 1 and _other_ep_size_faults(text) == OTHER_EP_SIZE_FAULTS, text


@pytest.mark.slow
def test_gpt_oss_under_ep_is_right_on_the_last_release_with_the_sentinel_class(tmp_path):
    """4.57.6: `num_classes=num_experts + 1` (#40545); its own plan shards the experts (2 of 4 a rank)."""
    done = run(GPT_OSS_ONE_HOT, tmp_path, release=transformers_release("4.57.6"))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "transformers 4.57.6," in done.stdout
    assert re.findall(r"^rank (\d): OK: the logits match the one-process model", done.stdout, re.M) == ["0", "1"]


# --- DeepSpeed elastic ZeRO 1/2 load with use_data_before_expert_parallelism: another group's expert state ---

ELASTIC_DBE = Finding("deepspeed-elastic-data-before-expert-permutation", (
    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.get_ep_ranks",))

SWAPPED = re.compile(r"^ZeRO (\d): rank (\d) holds the fp32 master, exp_avg, exp_avg_sq of experts \[([\d, ]+)\] "
                     r"\(rank (\d)'s saved partition\) after the load, not of its experts \[([\d, ]+)\]", re.M)

# ranks 1 and 2 (one in each expert-data-parallel group [0, 1], [2, 3]) swap their expert partitions at both stages;
# ranks 0 and 3 get their own back (their slice of the wrong merge is their own partition)
ELASTIC_DBE_FAULTS = {(z, "1", "4, 5", "2", "2, 3") for z in ("1", "2")} | \
                     {(z, "2", "2, 3", "1", "4, 5") for z in ("1", "2")}


def test_elastic_load_with_data_before_expert_swaps_two_ranks_expert_state(tmp_path):
    """20-35 s: two ZeRO stages, two engines each, on 4 ranks."""
    done = run(ELASTIC_DBE, tmp_path)
    text = verdict(done)
    assert done.returncode == 1, text
    assert set(SWAPPED.findall(text)) == ELASTIC_DBE_FAULTS and len(text.splitlines()) == 5, text
    assert "use_data_before_expert_parallelism (D + E)" in done.stdout


def test_elastic_load_with_data_before_expert_with_the_pages_patch_restores_every_partition(tmp_path):
    done = run(ELASTIC_DBE, tmp_path, patch=True)
    assert done.returncode == 0, verdict(done)
    assert verdict(done) == "OK: every rank's expert partition comes back after the elastic load"


@pytest.mark.slow
def test_elastic_load_in_the_default_layout_is_right_with_and_without_the_patch(tmp_path):
    """The control: E + D, where get_ep_ranks' range is the expert-data-parallel group; the patch keeps it right."""
    for patch in (False, True):
        done = run(ELASTIC_DBE, tmp_path, "--default-layout", patch=patch)
        assert done.returncode == 0 and "the default layout (E + D)" in done.stdout, verdict(done)


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.16.9", "0.18.0"])
def test_elastic_load_with_data_before_expert_on_older_releases(version, tmp_path):
    """The same get_ep_ranks since the layout came (#4695, 0.12.4); 0.16.9 the oldest release measured (0.14.4 - 0.15.4
    refuse the load under torch 2.13's weights_only default). The patch's getter is from 0.19.2: not run here."""
    done = run(ELASTIC_DBE, tmp_path, release=deepspeed_release(version))
    text = verdict(done)
    assert done.returncode == 1 and set(SWAPPED.findall(text)) == ELASTIC_DBE_FAULTS, text
    assert f"deepspeed {version}:" in done.stdout


# --- DeepSpeed AutoEP with transformers >= 5.23: deepspeed.initialize raises on the output-capture registry ---

REGISTRY = Finding("deepspeed-autoep-transformers-registry", (
    "deepspeed.module_inject.auto_ep_presets.base:_restore_transformers_output_capture_registry",
    "deepspeed.module_inject.auto_ep_presets.base:_install_instance_transformers_output_recorders",
    "deepspeed.module_inject.auto_ep_presets.base:_retarget_transformers_output_recorders_for_modules"))
"""In this order: each patched function is compiled in a copy of the module's globals, which then holds the ones
patched before it (_install calls _restore, _retarget calls _install)."""

REGISTRY_BUG = re.compile(r"^BUG: deepspeed\.initialize with AutoEP raises TypeError: _CanRecordRegistry\.get\(\) "
                          r"takes 2 positional arguments but 3 were given \(deepspeed/module_inject/auto_ep_presets/"
                          r"base\.py:(\d+), in _install_instance_transformers_output_recorders: ", re.M)
REGISTRY_OK = "OK: AutoEP initializes, the router logits are recorded, the registry is restored"


def test_autoep_initialize_raises_on_the_transformers_registry(tmp_path):
    """10-15 s: one process, the installed DeepSpeed 0.19.8 and transformers 5.23.0."""
    done = run(REGISTRY, tmp_path)
    assert done.returncode == 1, verdict(done)
    found = REGISTRY_BUG.search(done.stdout)
    assert found and found.group(1) == "326", verdict(done)
    assert "the registry is a _CanRecordRegistry" in done.stdout


def test_autoep_with_the_pages_patch_initializes_and_restores_the_registry(tmp_path):
    done = run(REGISTRY, tmp_path, patch=True)
    assert done.returncode == 0, verdict(done)
    assert verdict(done) == REGISTRY_OK


@pytest.mark.slow
def test_autoep_initializes_with_the_last_transformers_before_the_registry_class(tmp_path):
    """5.22.2: the registry a plain dict keyed by the class name; AutoEP as shipped converts the model, and the
    page's patch (dict's own methods) keeps it right."""
    folder = transformers_release("5.22.2")
    for patch in (False, True):
        done = run(REGISTRY, tmp_path, release=folder, patch=patch)
        assert done.returncode == 0 and verdict(done) == REGISTRY_OK, verdict(done)
        assert "transformers 5.22.2:" in done.stdout and "the registry is a dict" in done.stdout


@pytest.mark.slow
def test_autoep_registry_type_error_on_the_first_autoep_release(tmp_path):
    """0.19.2, AutoEP's first release: the same call (base.py:302)."""
    done = run(REGISTRY, tmp_path, release=deepspeed_release("0.19.2"))
    found = REGISTRY_BUG.search(done.stdout)
    assert done.returncode == 1 and found and found.group(1) == "302", verdict(done)
