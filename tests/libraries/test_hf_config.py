"""--hf-config: a model's config.json read by transformers (moebench.libraries.hf_config), its routing kept, its sizes
shrunk, each one line; and every bad file refused through the real CLI: exit 2, one line naming the flag and the
file, nothing written under results/, before any rank starts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moebench.cli.app import app
from moebench.errors import UserError
from moebench.libraries import hf_config

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
QWEN3 = FIXTURES / "qwen3_30b_a3b.json"
DEEPSEEK = FIXTURES / "deepseek_v3.json"
MIXTRAL = FIXTURES / "mixtral_8x7b.json"


def _published(path: Path) -> dict:
    return json.loads(path.read_text())


def _file(tmp_path, doc, name="hf.json") -> str:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def _note(notes, start: str) -> str:
    found = [n for n in notes if n.startswith(start)]
    assert len(found) == 1, (start, notes)
    return found[0]


# ------------------------------------------------------------------ the published files (no ranks)


def test_qwen3_30b_a3b_keeps_its_routing_and_shrinks_its_sizes():
    setup = hf_config.read(str(QWEN3))
    assert (setup.model_type, setup.config_class, setup.num_experts, setup.top_k, setup.dtype) == (
        "qwen3_moe", "Qwen3MoeConfig", 128, 8, "bfloat16")
    kept = _note(setup.notes, "kept (Qwen3MoeConfig, read by transformers): ")
    assert "num_experts=128" in kept and "num_experts_per_tok=8" in kept and "norm_topk_prob=true" in kept
    shrunk = _note(setup.notes, "shrunk (only costs time): ")
    assert "hidden_size 2048 -> 32" in shrunk and "num_hidden_layers 48 -> 1" in shrunk
    assert "vocab_size 151936 -> 16" in shrunk and "moe_intermediate_size 768 -> 16" in shrunk
    assert "max_window_layers" in _note(setup.notes, "not declared by Qwen3MoeConfig")
    config = hf_config.build_config(setup.model_type, setup.kwargs_json())
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (128, 8, True)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (32, 1, 16)


def test_qwen2_moe_builds_with_its_per_layer_attention_types_cut_to_the_one_layer(tmp_path):
    """Qwen2MoeConfig derives layer_types from the file's layer count (one per layer): the shrunk copy keeps layer
    0's and builds (it once carried all 48 and every rank raised)."""
    doc = {**_published(QWEN3), "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"],
           "shared_expert_intermediate_size": 5632}
    setup = hf_config.read(_file(tmp_path, doc))
    config = hf_config.build_config(setup.model_type, setup.kwargs_json())
    assert (config.num_hidden_layers, len(config.layer_types), config.num_experts) == (1, 1, 128)
    assert "shared_expert_intermediate_size 5632 -> 16" in _note(setup.notes, "shrunk (only costs time): ")


def test_random_draws_in_training_are_turned_off_and_said(tmp_path):
    """router_jitter_noise and dropouts draw random numbers in training, which the one-process reference cannot
    repeat: the rows set them to 0 and say so; a file without them gets no such line."""
    doc = {**_published(MIXTRAL), "router_jitter_noise": 0.1, "attention_dropout": 0.2}
    setup = hf_config.read(_file(tmp_path, doc))
    line = _note(setup.notes, "not honoured: ")
    assert "router_jitter_noise=0.1" in line and "attention_dropout=0.2" in line and "-> 0" in line
    config = hf_config.build_config(setup.model_type, setup.kwargs_json())
    assert (config.router_jitter_noise, config.attention_dropout) == (0.0, 0.0)
    assert not [n for n in hf_config.read(str(MIXTRAL)).notes if n.startswith("not honoured: ")]


def test_the_digest_is_of_the_text_read(tmp_path):
    import hashlib

    path = _file(tmp_path, _published(MIXTRAL))
    setup = hf_config.read(path)
    assert setup.sha256 == hashlib.sha256(Path(path).read_bytes()).hexdigest()[:hf_config.DIGEST_CHARS]


def test_deepseek_v3_keeps_grouped_routing_and_names_what_it_cannot_honour():
    setup = hf_config.read(str(DEEPSEEK))
    kept = _note(setup.notes, "kept (DeepseekV3Config, read by transformers): ")
    for part in ("n_routed_experts=256", "num_experts_per_tok=8", "n_shared_experts=1", "n_group=8", "topk_group=4",
                 "routed_scaling_factor=2.5", "norm_topk_prob=true"):
        assert part in kept, part
    assert "fp8" not in json.dumps(setup.kwargs)  # the quantization section is not carried ...
    assert "CUDA" in _note(setup.notes, "quantization_config: not honoured")  # ... and says so
    assert "remote code" in _note(setup.notes, "auto_map: not honoured")
    assert _note(setup.notes, "first_k_dense_replace=3 -> 0")
    assert not [n for n in setup.notes if n.startswith("scoring_func=")]  # sigmoid: what transformers implements
    config = hf_config.build_config(setup.model_type, setup.kwargs)
    # the derived head sizes are rebuilt from the shrunk ones, not carried over from the file (192 and 64)
    assert (config.qk_head_dim, config.head_dim) == (16, 8)
    assert (config.n_group, config.topk_group, config.routed_scaling_factor, config.first_k_dense_replace) == (
        8, 4, 2.5, 0)


def test_a_softmax_deepseek_file_is_named_as_what_transformers_ignores(tmp_path):
    doc = {**_published(DEEPSEEK), "scoring_func": "softmax"}
    notes = hf_config.read(_file(tmp_path, doc)).notes
    assert "always uses sigmoid" in _note(notes, 'scoring_func="softmax"')


def test_every_routing_key_changed_in_the_file_changes_the_built_config(tmp_path):
    base = _published(QWEN3)
    for key, value in (("norm_topk_prob", False), ("num_experts", 64), ("num_experts_per_tok", 4),
                       ("router_aux_loss_coef", 0.01)):
        setup = hf_config.read(_file(tmp_path, {**base, key: value}, name=f"{key}.json"))
        assert getattr(hf_config.build_config(setup.model_type, setup.kwargs), key) == value, key


# ------------------------------------------------------------------ refused in the reader


@pytest.mark.parametrize("change, needle", [
    ({"norm_topk_probs": True}, "norm_topk_probs in"),
    ({"num_experts": 100_000}, "num_experts=100000 in"),
    ({"num_experts_per_tok": 200}, "num_experts_per_tok=200 in"),
    ({"num_experts": True}, "num_experts"),  # a bool is not a count (transformers' own validator or ours)
    ({"hidden_size": 10**9}, "hidden_size=1000000000 in"),
    ({"router_aux_loss_coef": 1e30}, "router_aux_loss_coef=1e+30 in"),
    ({"norm_topk_prob": "yes"}, "transformers refuses"),  # its strict dataclass: "expected bool, got str"
    ({"model_type": "llama"}, "is a 'llama' model"),
])
def test_a_bad_value_is_refused_naming_the_key(tmp_path, change, needle):
    with pytest.raises(UserError) as err:
        hf_config.read(_file(tmp_path, {**_published(QWEN3), **change}))
    assert err.value.flag == "--hf-config" and needle in str(err.value), str(err.value)


def test_deepseek_groups_are_bounded(tmp_path):
    for change, needle in (({"n_group": 7}, "does not divide n_routed_experts=256"),
                           ({"topk_group": 9}, "topk_group=9"),
                           ({"n_group": 64, "topk_group": 1}, "more than the 1 group(s) of 4 experts")):
        with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            hf_config.read(_file(tmp_path, {**_published(DEEPSEEK), **change}))


# ------------------------------------------------------------------ through the real CLI: exit 2, one line


def _invoke(*args):
    return CliRunner().invoke(app, ["verify-parity", *args])


def _nothing_written() -> bool:
    return not os.path.exists(os.environ["MOEBENCH_RESULTS"]) or not os.listdir(os.environ["MOEBENCH_RESULTS"])


def _refused(result, needle: str, flag: str = "--hf-config") -> None:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag}: ") and needle in lines[0], lines
    assert "Traceback" not in result.output and _nothing_written()


RECIPE = """# an NeMo Automodel recipe, handed to the wrong flag
step_scheduler:
  global_batch_size: 32
model:
  _target_: nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained
  pretrained_model_name_or_path: Qwen/Qwen3-30B-A3B
"""


@pytest.mark.parametrize("doc, needle", [
    ({"zero_optimization": {"stage": 2}, "train_batch_size": 8}, "a DeepSpeed config? give it to --ds-config"),
    (RECIPE, "is not valid JSON"),
    ('{"model_type": "qwen3_moe", "num_experts": NaN}', "is not valid JSON"),
    ("[1, 2]", "holds a JSON list, not an object"),
    ({**{"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2}, "norm_topk_probs": True},
     "did you mean norm_topk_prob?"),
    ({"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "torch_dtype": "float77"},
     "transformers refuses"),
    ({"model_type": "gpt_oss", "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2,
      "layer_types": ["bogus"]}, "transformers refuses"),
    ({"model_type": "qwen3_moe", "num_experts": 5000, "num_experts_per_tok": 2}, "num_experts=5000"),
])
def test_a_bad_file_on_the_cli_is_one_line_exit_2_and_nothing_written(tmp_path, doc, needle):
    _refused(_invoke("--hf-config", _file(tmp_path, doc), "-n", "2"), needle)


def test_special_and_huge_files_are_refused_before_reading_them(tmp_path):
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    _refused(_invoke("--hf-config", str(fifo), "-n", "2"), "is not a regular file")
    _refused(_invoke("--hf-config", "/dev/zero", "-n", "2"), "is not a regular file")
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:  # sparse: 200 MB on paper, nothing on disk
        f.truncate(200 * 1024 * 1024)
    _refused(_invoke("--hf-config", str(huge), "-n", "2"), "209,715,200 bytes")
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe{}")
    _refused(_invoke("--hf-config", str(binary), "-n", "2"), "is not UTF-8 text")


def test_a_config_the_library_does_not_build_is_refused_per_library(tmp_path):
    olmoe = {"model_type": "olmoe", "num_experts": 8, "num_experts_per_tok": 2}
    # AutoEP has no OLMoE preset here: its rows refuse it (transformers' take it)
    _refused(_invoke("--library", "autoep", "--hf-config", _file(tmp_path, olmoe), "-n", "2"),
             "the rows build mixtral, qwen3_moe, qwen2_moe, deepseek_v3")
    _refused(_invoke("--library", "fairscale", "--hf-config", str(MIXTRAL), "-n", "2"),
             "add transformers or autoep or automodel to --library")


def test_list_shows_the_rows_of_the_users_config_without_running_them():
    result = _invoke("--hf-config", str(QWEN3), "--list", "-n", "2")
    assert result.exit_code == 0, result.output
    assert "transformers/qwen3_moe/grouped_mm/all_to_all/w2/hf-config" in result.output
    assert "transformers/qwen3_moe/grouped_mm/all_reduce/w2/hf-config+bf16" in result.output
    assert _nothing_written()
