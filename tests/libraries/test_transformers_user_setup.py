"""--hf-config for the transformers rows (moebench/libraries/transformers/user_setup.py): a published config.json
runs as rows at W = 2 and 4 and passes on the pinned transformers; each kept setting family changed in the file
changes the rows and what they compare, and a wrong implementation of it (made here by wrapping transformers' own
objects in the test process, inherited by the forked ranks) fails the row; GPT-OSS's eager experts raising under
all-reduce expert parallelism (transformers 5.23.0) is a finding with its verdict asserted. The whole user matrix of
every published config is in the slow tier (the bottom of this file)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moebench.libraries.transformers import ADAPTER, skip_reason
from moebench.libraries.transformers.user_setup import FAMILIES, fit_experts, read

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (pip install 'moebench[transformers]')")

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
QWEN3 = FIXTURES / "qwen3_30b_a3b.json"
DEEPSEEK = FIXTURES / "deepseek_v3.json"
MIXTRAL = FIXTURES / "mixtral_8x7b.json"
GPT_OSS = {  # written here (no verbatim copy of GPT-OSS-20B's config.json was found: fixtures/hf/README.md)
    "model_type": "gpt_oss", "num_local_experts": 32, "num_experts_per_tok": 4, "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "vocab_size": 201088, "swiglu_limit": 7.0, "router_aux_loss_coef": 0.9,
    "torch_dtype": "bfloat16"}


def _edited(tmp_path, source: Path | dict, name: str, **changes) -> str:
    doc = json.loads(source.read_text()) if isinstance(source, Path) else dict(source)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({**doc, **changes}))
    return str(path)


def _rows(path, world_size: int, *keys: str):
    settings, _ = read(str(path))
    found = {r.key().split("/", 1)[1]: r for r in ADAPTER.rows(world_size, user_config=settings)}
    return [found[k] for k in keys] if keys else list(found.values())


def _run(rows, world_size: int):
    from libraries.hf_launch import run_rows

    return run_rows(rows, world_size)


def _passes(result) -> None:
    assert result.skipped is None and result.passed, result.describe()
    assert not [c for c in result.comparisons if c.vacuous], f"{result.row.key()}: vacuous comparisons"
    premise = [c for c in result.comparisons if c.name.startswith("every expert gets tokens")]
    assert premise and all(c.passed for c in premise), result.describe()


# ------------------------------------------------------------------ rows (no ranks)


def test_each_published_config_gives_rows_at_2_and_4():
    for path, family, experts, top_k in ((QWEN3, "qwen3_moe", 128, 8), (DEEPSEEK, "deepseek_v3", 256, 8),
                                         (MIXTRAL, "mixtral", 8, 2)):
        for world in (2, 4):
            rows = _rows(path, world)
            # every backend x EP mode in float32, and (torch_dtype bfloat16) the bf16 row of each mode
            assert len(rows) == 12 and sum(r.kind == "bf16" for r in rows) == 3, [r.key() for r in rows]
            assert {r.model for r in rows} == {family} and all(skip_reason(r) is None for r in rows)
            s = rows[0].settings
            assert (s.num_experts, s.file_experts, s.top_k, s.dtype) == (experts, experts, top_k, "bfloat16")
            # the batch grows with the experts: 16 routes per expert on average over the global batch
            assert world * s.seqs_per_rank * s.seq_len * top_k >= 16 * experts
            assert s.hf_config == str(path.resolve()) and len(s.hf_sha256) == 16


def test_precision_float32_file_has_no_bf16_rows(tmp_path):
    rows = _rows(_edited(tmp_path, QWEN3, "f32", torch_dtype="float32"), 2)
    assert len(rows) == 9 and not [r for r in rows if r.kind == "bf16"]
    _, notes = read(_edited(tmp_path, QWEN3, "f32", torch_dtype="float32"))
    assert any(n.startswith("torch_dtype=float32: float32 rows only") for n in notes)


def test_ep_degree_experts_shrink_only_where_they_must_saying_so(tmp_path):
    six = _edited(tmp_path, MIXTRAL, "six", num_local_experts=6)
    at2, at4 = _rows(six, 2)[0], _rows(six, 4)[0]
    assert (at2.settings.num_experts, at2.note) == (6, "")  # 6 split over 2 ranks
    assert at4.settings.num_experts == 4 and at4.note == "experts 6 -> 4: 6 do not split over 4 ranks"
    # DeepSeek-V3's groups must still split, and top-k stay reachable
    assert fit_experts({"num_experts": 6, "top_k": 2, "n_group": 3, "topk_group": 1}, 4) is None
    assert fit_experts({"num_experts": 18, "top_k": 2, "n_group": 3, "topk_group": 1}, 4) == 12
    assert fit_experts({"num_experts": 18, "top_k": 5, "n_group": 3, "topk_group": 1}, 4) is None  # 5 > 12 / 3
    three = _rows(_edited(tmp_path, MIXTRAL, "three", num_local_experts=3), 4)[0]
    assert skip_reason(three) == "no count of experts up to the file's 3 splits over 4 ranks with top-2 reachable"


def test_every_family_transformers_has_is_read():
    assert set(FAMILIES) == {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"}


# ------------------------------------------------------------------ the published configs pass (multirank)


@pytest.mark.multirank
def test_deepseek_v3_passes_at_world_2_every_expert_compared():
    rows = _rows(DEEPSEEK, 2, "deepseek_v3/grouped_mm/all_to_all/w2/hf-config",
                 "deepseek_v3/eager/all_reduce/w2/hf-config", "deepseek_v3/grouped_mm/all_to_all/w2/hf-config+bf16")
    results = _run(rows, 2)
    for result in results:
        _passes(result)
    names = {c.name for c in results[0].comparisons}
    assert {f"grad experts.gate_up_proj[expert {e}]" for e in range(256)} <= names  # all 256, by global index
    assert {"grad gate.weight", "grad shared_experts.down_proj.weight", "output", "input grad"} <= names


@pytest.mark.multirank
def test_qwen3_30b_a3b_passes_at_world_4():
    (result,) = _run(_rows(QWEN3, 4, "qwen3_moe/grouped_mm/all_to_all+tp/w4/hf-config"), 4)
    _passes(result)
    assert {f"grad experts.down_proj[expert {e}]" for e in range(128)} <= {c.name for c in result.comparisons}


# ------------------------------------------------------------------ each kept setting, and a wrong implementation


def _ep_implementation(monkeypatch, name: str, cls) -> None:
    from transformers.distributed.expert_parallel import EPImplementationInterface

    monkeypatch.setitem(EPImplementationInterface._global_mapping, name, cls)


def _renormalizing_exchange(monkeypatch) -> None:
    """An all-to-all exchange that renormalizes each token's top-k weights to sum to 1 (as if norm_topk_prob were
    always true and there were no routed_scaling_factor)."""
    from transformers.distributed import expert_parallel as ep

    class Renormalized(ep.AllToAllEP):
        def __call__(self, hidden_states, top_k_index, top_k_weights):
            return super().__call__(hidden_states, top_k_index, top_k_weights / top_k_weights.sum(-1, keepdim=True))

    _ep_implementation(monkeypatch, "all_to_all", Renormalized)


@pytest.mark.multirank
def test_normalisation_and_scaling_are_checked_as_the_file_sets_them(tmp_path, monkeypatch):
    """norm_topk_prob true (the published Qwen3) vs false: the rows build what the file says, and an exchange that
    renormalizes the weights passes the first (nothing to change) and fails the second; with DeepSeek-V3's
    routed_scaling_factor 2.5 it fails, and with 1.0 it passes."""
    unnormalized = _edited(tmp_path, QWEN3, "no_norm", norm_topk_prob=False)
    unscaled = _edited(tmp_path, DEEPSEEK, "no_scale", routed_scaling_factor=1.0)
    key = "{}/grouped_mm/all_to_all+tp/w2/hf-config"
    rows = [*_rows(QWEN3, 2, key.format("qwen3_moe")), *_rows(unnormalized, 2, key.format("qwen3_moe")),
            *_rows(DEEPSEEK, 2, key.format("deepseek_v3")), *_rows(unscaled, 2, key.format("deepseek_v3"))]
    assert len({r.settings.hf_sha256 for r in rows}) == 4  # four files, four rows
    _renormalizing_exchange(monkeypatch)
    normalized, bare, scaled, one = _run(rows, 2)
    _passes(normalized)
    _passes(one)
    for result in (bare, scaled):
        assert not result.passed and result.failed[0].name == "output", result.describe()


def _in_the_parallel_model(monkeypatch, change) -> None:
    """`change(block)` applied to the MoE block of every model loaded with a DistributedConfig (the expert-parallel
    model; the one-process reference is loaded without one and stays right)."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        model = original(cls, *args, **kwargs)
        if kwargs.get("distributed_config") is not None:
            change(model.get_submodule("model.layers.0.mlp"))
        return model

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(from_pretrained))


def _softmax_router(block) -> None:
    """DeepSeek-V3's router scoring with softmax instead of sigmoid (its grouped top-k, bias and scaling kept)."""
    import torch

    gate = block.gate

    def forward(hidden_states):
        logits = torch.nn.functional.linear(hidden_states.view(-1, gate.hidden_dim).float(), gate.weight.float())
        scores = logits.softmax(-1)
        choice = (scores + gate.e_score_correction_bias).view(-1, gate.num_group, gate.num_experts // gate.num_group)
        groups = choice.topk(2, dim=-1)[0].sum(-1).topk(gate.topk_group, dim=-1)[1]
        mask = torch.zeros_like(choice[..., 0]).scatter_(1, groups, 1).unsqueeze(-1).expand_as(choice)
        index = choice.masked_fill(mask == 0, 0.0).view(-1, gate.num_experts).topk(gate.top_k, dim=-1)[1]
        weights = scores.gather(1, index)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * gate.routed_scaling_factor
        return logits, weights, index

    gate.forward = forward


def _bias_dropped(block) -> None:
    """The e_score_correction_bias (a buffer, not a parameter) lost on the way into the expert-parallel model."""
    block.gate.e_score_correction_bias.zero_()


def _shared_expert_dropped(block) -> None:
    """The shared expert's output left out of the block's sum."""
    block.shared_experts.register_forward_hook(lambda module, args, output: output * 0)


@pytest.mark.multirank
@pytest.mark.parametrize("change, first", [(_softmax_router, "output"), (_bias_dropped, "output"),
                                           (_shared_expert_dropped, "output")],
                         ids=["scoring", "bias", "shared-expert"])
def test_a_wrong_deepseek_routing_in_the_parallel_model_fails_the_published_configs_row(monkeypatch, change, first):
    """Sigmoid scoring, the score-correction bias and the shared expert are kept from the file, so an expert-parallel
    model that gets one of them wrong fails the row (the reference is transformers' own block on one process)."""
    (row,) = _rows(DEEPSEEK, 2, "deepseek_v3/grouped_mm/all_to_all/w2/hf-config")
    _in_the_parallel_model(monkeypatch, change)
    (result,) = _run([row], 2)
    assert not result.passed and result.failed[0].name == first, result.describe()


def test_shared_experts_and_groups_changed_in_the_file_change_what_is_built(tmp_path):
    from moebench.libraries.transformers.build import shape_of

    two = _edited(tmp_path, DEEPSEEK, "two_shared", n_shared_experts=2, n_group=4, topk_group=2)
    (row,) = _rows(two, 2, "deepseek_v3/grouped_mm/all_to_all/w2/hf-config")
    config = shape_of(row).config()
    assert (config.n_shared_experts, config.n_group, config.topk_group) == (2, 4, 2)
    block = shape_of(row).model_cls(config).get_submodule("model.layers.0.mlp")
    assert block.shared_experts.down_proj.weight.shape == (32, 32)  # 2 x the shrunk moe_intermediate_size 16


@pytest.mark.multirank
def test_precision_the_bf16_row_of_a_bfloat16_file_catches_expert_gradients_times_w(monkeypatch):
    """torch_dtype bfloat16 adds the bf16 rows; one fails, named, when the experts' gradients are summed."""
    from test_transformers_broken import _experts_summed_over_ranks

    _experts_summed_over_ranks(monkeypatch)
    (result,) = _run(_rows(QWEN3, 2, "qwen3_moe/grouped_mm/all_to_all/w2/hf-config+bf16"), 2)
    failed = [c for c in result.failed if c.diagnosis]
    assert failed and failed[0].diagnosis["name"] == "uniform-scale", result.describe()
    assert "summed instead of averaged over 2 ranks" in failed[0].diagnosis["sentence"]


# ------------------------------------------------------------------ GPT-OSS, and its finding on 5.23.0


@pytest.mark.multirank
def test_gpt_oss_rows_pass_and_its_eager_experts_raise_under_all_reduce(tmp_path):
    """GPT-OSS (its block's router is `router`, its experts have biases): the grouped_mm rows pass; its eager experts
    cannot take the EP sentinel index (one_hot with num_classes = the local experts; transformers#40545 had made it
    + 1), so the all_reduce row raises in transformers: a finding on the pinned 5.23.0."""
    path = _edited(tmp_path, GPT_OSS, "gpt_oss")
    rows = _rows(path, 2, "gpt_oss/grouped_mm/all_to_all/w2/hf-config", "gpt_oss/grouped_mm/all_reduce/w2/hf-config")
    for result in _run(rows, 2):
        _passes(result)
        assert "grad router.weight" in {c.name for c in result.comparisons}
    summary = _cli(tmp_path, "--hf-config", path, "-n", "2", "--row", "transformers/gpt_oss/eager/all_reduce/w2/*")
    (row,) = summary["rows"]
    assert row["verdict"] == "fail" and row["diagnosis_name"] == "rank-raised", row
    assert "Class values must be smaller than num_classes" in row["diagnosis"]
    assert "transformers/models/gpt_oss/modeling_gpt_oss.py" in row["diagnosis"]


# ------------------------------------------------------------------ the CLI, and the whole user matrix (slow)


def _cli(tmp_path, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "moebench", "verify-parity", "--json", *args], text=True,
                          capture_output=True, timeout=900,
                          env={**os.environ, "MOEBENCH_RESULTS": str(tmp_path / "results"), "COLUMNS": "80"})
    assert done.returncode in (0, 1), done.stderr[-3000:]
    return json.loads(done.stdout)


def expected(key: str) -> str:
    """A --hf-config row's verdict on transformers 5.23.0: GPT-OSS's eager experts raise under all_reduce."""
    return "rank-raised" if key.startswith("transformers/gpt_oss/eager/all_reduce/") else "pass"


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_the_whole_user_matrix_of_every_published_config(tmp_path, world_size):
    """Every row of every published config (and the GPT-OSS config written here) as a user runs them, no vacuous
    comparison; times in docs/libraries/transformers.md."""
    for path in (QWEN3, DEEPSEEK, MIXTRAL, Path(_edited(tmp_path, GPT_OSS, "gpt_oss"))):
        summary = _cli(tmp_path, "--hf-config", str(path), "-n", str(world_size))
        verdicts = {r["check"]: r["diagnosis_name"] if r["verdict"] == "fail" else r["verdict"]
                    for r in summary["rows"]}
        assert verdicts == {k: expected(k) for k in verdicts} and len(verdicts) == 12, verdicts
        assert summary["vacuous_total"] == 0
        print(f"{path.name} W = {world_size}: {len(verdicts)} rows in {summary['wall_time_s']:.1f} s")


def test_the_every_expert_premise_fails_where_an_expert_gets_no_token():
    """The premise a --hf-config row asserts on the one-process block (never the library's): an expert no token
    reaches would compare zero with zero, so the row fails naming it."""
    import types

    import torch

    from moebench.libraries.transformers.parity import every_expert_routed

    class Router(torch.nn.Module):
        def __init__(self, index):
            super().__init__()
            self.index = index

        def forward(self, x):
            return None, None, self.index

    block, x = torch.nn.Module(), torch.zeros(3, 4)
    shape = types.SimpleNamespace(router="gate", hidden=4, num_experts=4)
    block.gate = Router(torch.tensor([[0, 1], [1, 2], [2, 0]]))
    missing = every_expert_routed(block, shape, x, 0)
    assert not missing.passed and "experts [3] get none" in missing.note
    block.gate = Router(torch.tensor([[0, 1], [2, 3], [3, 0]]))
    assert every_expert_routed(block, shape, x, 0).passed
