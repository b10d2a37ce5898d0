"""--recipe and --hf-config for the Automodel rows: the recipe YAML a user launches (`automodel finetune llm -c
recipe.yaml`, or `examples/llm_finetune/finetune.py --config recipe.yaml`) read by Automodel's own config loader, and
the model's config.json the recipe names (nothing is downloaded here), read by transformers (libraries/hf_config.py).

Reading a recipe, in order, each refusal one line naming the flag and the file, before anything of the recipe is
imported and before any rank starts:
1. moebench.userfiles.read_text bounds the file (a FIFO, /dev/zero, 200 MB, binary: refused);
2. the text is parsed as Automodel's loader parses it (`yaml.safe_load`, load_yaml_config's body) and must be a
   mapping with a `recipe:` target, as Automodel's `automodel` CLI requires; a DeepSpeed config or a config.json is
   named as such;
3. every `_target_` and `*_fn` value (Automodel's ConfigNode imports each one as it loads: `_resolve_target` at
   construction) is checked as text: a module outside Automodel's own allow-list (loader.ALLOWED_IMPORT_PREFIXES:
   nemo_automodel, torch, transformers, torchdata, torchao, liger_kernel) is refused unless `--allow-import` names it
   (then Automodel imports it as it would); a `path/file.py:attr` target (which Automodel executes) is refused;
4. the sections the rows use are loaded by Automodel's own objects: `ConfigNode` (the loader; env interpolation,
   `_target_` resolution), `RecipeConfig` (the recipe's typed view: StepSchedulerConfig, the optimizer config),
   `parse_distributed_section` (the `distributed:` parser: the strategy config, its MoE and pipeline sections),
   `BackendConfig` (`model.backend`), `MoEConfig` (`model.moe_overrides`): what they refuse is refused, with their
   message. The model section's `_target_` (NeMoAutoModelForCausalLM) is named, never imported: the rows build the
   model class it picks for the config's model_type, as moebench's Automodel rows always do (api.py);
5. keys Automodel would ignore are refused by name (top-level, `clip_grad_norm`, `model`), values are bounded.

Then the rows' settings (plain data: summary.json's "setup") and one note per thing kept, shrunk or not honoured.
`--hf-config` alone (no recipe) is Automodel's HF model built from that config.json with the training step's defaults
(max_norm 1.0, one micro-batch) and expert parallelism over every rank.

Over 400 lines: one reader for a whole recipe (the file's bounds, its imports, each section through Automodel's own
object, every count's bound, the notes); each refusal sits beside the section it guards.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from moebench.errors import UserError

RECIPE = "--recipe"
HF = "--hf-config"
MAX_BYTES = 1024 * 1024
"""A recipe is a few KiB (Automodel's largest published: ~6 KiB); past 1 MiB it is not one."""
KIND = "an NeMo Automodel recipe YAML"
FAMILIES = ("qwen3_moe", "deepseek_v3")
"""The model types whose Automodel classes the rows build (components/models/qwen3_moe, deepseek_v3)."""
RECIPE_CLASS = "nemo_automodel.recipes.llm.train_ft.TrainFinetuneRecipeForNextTokenPrediction"
"""The recipe whose training step the rows verify (Automodel's LLM fine-tune / pretrain recipe)."""
MODEL_TARGETS = tuple(f"{m}.NeMoAutoModelForCausalLM.{f}" for m in ("nemo_automodel",
                                                                    "nemo_automodel._transformers.auto_model")
                      for f in ("from_pretrained", "from_config"))
"""The model factories a recipe names (NeMoAutoModelForCausalLM picks Automodel's own class for the config)."""

TOP_LEVEL = {
    # read by recipes/llm/train_ft.py (0.7.0) and its typed view recipes/_typed_config.py
    "recipe", "model", "distributed", "step_scheduler", "optimizer", "lr_scheduler", "clip_grad_norm", "loss_fn",
    "dataset", "dataloader", "validation_dataset", "validation_dataloader", "packed_sequence", "checkpoint", "peft",
    "dist_env", "seed", "compile", "qat", "quantization", "fp8", "freeze_config", "moe_metrics", "neftune", "nvtx",
    "tool_call_eval", "wandb", "mlflow", "comet", "prewarm", "mfu", "embedding_row_repair", "domain_mixture",
    "tokenizer", "benchmark",
    # read by the `automodel` CLI (cli/app.py): the launchers
    "skypilot", "nemo_run", "slurm",
    # carried by Automodel's own published recipes, read by its CI or by older releases
    "ci", "rng",
}
"""Top-level keys Automodel reads (any `validation_dataset*` / `validation_dataloader*` too): another is ignored by
it, so refused by name."""
SECTIONS_READ = ("model", "distributed", "step_scheduler", "optimizer", "clip_grad_norm", "loss_fn")
"""The sections the rows take settings from (loaded by Automodel's objects here)."""
NOT_USED = ("dataset", "dataloader", "validation_dataset", "validation_dataloader", "packed_sequence", "checkpoint",
            "lr_scheduler", "tokenizer")
"""Sections the rows do not use (named in one note): they train on moebench's random tokens, a few fixed-lr steps."""
NOT_HONOURED_SECTIONS = {
    "peft": "the rows train every parameter (no LoRA adapters are built)",
    "qat": "quantization-aware training needs torchao's fake-quant kernels; the rows train float weights",
    "quantization": "quantized weights need their kernels; the rows train float weights",
    "fp8": "FP8 needs Transformer Engine / torchao on a GPU; the rows train float32 and bf16",
    "compile": "torch.compile: the rows run eager (the same mathematics)",
    "freeze_config": "the rows train every parameter",
    "neftune": "NEFTune's embedding noise is left out (the rows' inputs are random tokens)",
    "domain_mixture": "the rows' loss is one domain's",
}
CLIP_KEYS = ("max_norm", "backend")
"""`clip_grad_norm` keys train_ft reads (clip_grad_norm.max_norm, clip_grad_norm.backend)."""
MODEL_KEYS_READ = ("_target_", "pretrained_model_name_or_path", "config", "backend", "torch_dtype", "dtype",
                   "moe_overrides", "trust_remote_code")
MODEL_KEYS_NOT_HONOURED = {
    "use_liger_kernel": "Liger's fused kernels (Triton, CUDA)",
    "use_sdpa_patching": "attention kernels: the rows use torch's sdpa",
    "sdpa_method": "attention kernels: the rows use torch's sdpa",
    "attn_implementation": "attention kernels: the rows use torch's sdpa",
    "quantization_config": "quantized weights need their kernels",
    "force_hf": "the rows build Automodel's own model class for the config",
    "qat_config": "torchao's fake-quant kernels", "fp8_config": "Transformer Engine / torchao FP8 on a GPU",
    "compile_config": "the rows run eager (the same mathematics)", "peft_config": "the rows train every parameter",
    "has_packed_sequence": "the rows' batches are not packed", "cache_dir": "nothing is downloaded",
    "revision": "nothing is downloaded", "local_files_only": "nothing is downloaded",
    "subfolder": "nothing is downloaded", "force_download": "nothing is downloaded", "token": "nothing is downloaded",
    "use_cache": "training: no KV cache",
}
"""NeMoAutoModelForCausalLM.from_pretrained's other parameters (0.7.0, _transformers/auto_model.py), not taken by
the rows (a note each); any other model key that is not a config field of the model is refused."""
DISTRIBUTED_SIZES = ("tp_size", "pp_size", "cp_size", "ep_size", "dp_size", "dp_replicate_size")
MAX_DEGREE = 1 << 16
"""A parallel degree (the largest MoE runs use a few thousand ranks)."""
MAX_BATCH = 1 << 24
MAX_NORM = 1e6
MAX_FACTOR = 1e4
BINDING_NORM = 0.2
"""A max_norm the small models' step-1 gradient norm exceeds at every seed (the clip rows of the default matrix use
it): a user's larger max_norm is reached by multiplying the loss by max_norm / BINDING_NORM, reference alike (the row
asserts that the clip binds)."""
MAX_ACCUM = 4
"""Micro-batches a row accumulates: a recipe's count above it is shrunk to it (accumulation over 4 micro-batches
exercises the same path as over 400, and each costs a forward and backward)."""
BACKEND_CPU = {"attn": "sdpa", "linear": "torch", "rope_fusion": False, "enable_hf_state_dict_adapter": False}
"""BackendConfig fields every row sets on CPU (attention, linear layers: kernels, not MoE mathematics)."""
CUDA_DISPATCHERS = ("deepep", "hybridep", "uccl_ep", "mok")
CUDA_RMS_NORMS = ("te", "quack")
MOE_RECORDED = ("n_routed_experts", "n_activated_experts", "score_func", "norm_topk_prob", "softmax_before_topk",
                "n_expert_groups", "n_limited_groups", "n_shared_experts", "route_scale", "gate_bias_update_factor",
                "aux_loss_coeff", "train_gate", "router_bias", "expert_bias", "expert_activation",
                "router_weights_fp32")
"""The MoEConfig fields a row records (as Automodel's model class resolves them); the others the recipe overrides
travel in the row's `moe_overrides`."""
OPTIMIZER_WHY = ("Adam divides each step by the gradient's own running size, so a gradient scaled "
                 "uniformly by k would step the same and a mis-scaled reduction would pass")


# ------------------------------------------------------------------ the request


def read_setup(request) -> tuple[dict[str, Any], list[str]]:
    """The Automodel rows' reader of a verify-parity request (libraries/setups.py): its --recipe and --hf-config
    (either or both). Returns (settings, notes)."""
    from moebench.libraries.matrix import DEFAULT_WORLD_SIZES

    sizes = (request.world_size,) if request.world_size else DEFAULT_WORLD_SIZES
    allow = tuple(request.allow_imports or ())
    if request.recipe is not None:
        return read_recipe(request.recipe, hf_config=request.hf_config, allow_imports=allow, world_sizes=sizes)
    return read_hf_only(request.hf_config, world_sizes=sizes)


def read_hf_only(path: str, *, world_sizes: tuple[int, ...]) -> tuple[dict[str, Any], list[str]]:
    """--hf-config with no recipe: Automodel's model for that config.json, the training step's defaults."""
    from moebench.libraries import hf_config

    with _quiet():
        hf = hf_config.read(path, flag=HF, families=FAMILIES)
    model = _resolve_model(hf, {}, {}, flag=HF, path=path)
    settings = _settings(hf, model, recipe=None, hf_path=os.path.abspath(path), ep_size=None, dp_replicate=None,
                         ac=False, max_norm=DEFAULT_MAX_NORM, grad_acc=1, precision=_precision(hf.dtype, None),
                         optimizer=None, lr=None, backend=_backend({}, [], flag=HF, path=path))
    notes = [f"no --recipe: Automodel's {hf.model_type} model for this config.json, its training step's defaults "
             f"(clip_grad_norm.max_norm {DEFAULT_MAX_NORM:g}, one micro-batch a step, experts torch_mm, the torch "
             "dispatcher), expert parallelism over every rank"]
    notes += _model_notes(hf, model, settings)
    notes += _row_notes(settings, world_sizes)
    notes.append(_clip_line(DEFAULT_MAX_NORM, default=True))
    notes.append(f"optimizer: SGD: {OPTIMIZER_WHY}")
    return settings, notes


DEFAULT_MAX_NORM = 1.0
"""train_ft's clip when the recipe sets no clip_grad_norm.max_norm ("using default value of 1.0")."""


def read_recipe(path: str, *, hf_config: str | None = None, allow_imports: tuple[str, ...] = (),
                world_sizes: tuple[int, ...] = (2, 4)) -> tuple[dict[str, Any], list[str]]:
    """(settings, notes) from a recipe (and the model's config.json: --hf-config, or a local folder the recipe
    names); UserError naming the flag for anything wrong."""
    from moebench.userfiles import read_text

    text = read_text(path, flag=RECIPE, kind=KIND, max_bytes=MAX_BYTES)
    raw = _parse(path, text)
    _check_recipe_target(path, raw)
    _check_targets(path, raw, allow_imports)
    later: list[str] = []  # what is not honoured or not used: after what the rows keep
    _check_top_level(path, raw, later)
    nodes = _load_sections(path, raw)
    model_raw = raw.get("model")
    if not isinstance(model_raw, dict):
        raise UserError(f"{path} has no model section (Automodel's recipe builds its model from `model:`); fix the "
                        "file", flag=RECIPE)
    named, local = _model_named(path, model_raw)
    hf_path, hf_flag = _config_json(path, named, local, hf_config)
    from moebench.libraries import hf_config as hfc

    with _quiet():
        hf = hfc.read(hf_path, flag=hf_flag, families=FAMILIES)
    notes = [f"model: {named} ({hf.model_type}), its config.json from "
             + (os.path.basename(hf_path) if hf_config else f"the recipe's folder {local}")]
    overrides, moe_overrides = _model_keys(path, model_raw, hf, later)
    backend = _backend(nodes.get("model.backend"), later, flag=RECIPE, path=path)
    model = _resolve_model(hf, overrides, moe_overrides, flag=RECIPE, path=path)
    dist = _distributed(path, raw.get("distributed") or {}, nodes, model, later)
    steps: list[str] = []
    grad_acc = _accumulation(path, nodes, dist, steps)
    max_norm = _clip(path, raw.get("clip_grad_norm"), steps, later)
    precision = _precision(hf.dtype, _model_dtype(path, model_raw))
    if precision not in ("fp32", "bf16"):
        later.append(f"precision {precision}: not honoured; the rows run float32, compared exactly")
        precision = "fp32"
    optimizer, lr = _optimizer(nodes, steps)
    _loss(raw, later)
    settings = _settings(hf, model, recipe=os.path.abspath(path),
                         hf_path=os.path.abspath(hf_path), ep_size=dist["ep_size"],
                         dp_replicate=dist["dp_replicate_size"], ac=dist["activation_checkpointing"],
                         max_norm=max_norm, grad_acc=grad_acc, precision=precision, optimizer=optimizer, lr=lr,
                         backend=backend)
    notes += _model_notes(hf, model, settings)
    notes += _row_notes(settings, world_sizes) + steps
    unused = [k for k in raw if k in NOT_USED or k.startswith(("validation_dataset", "validation_dataloader"))]
    if unused:
        later.append(f"not used: {', '.join(unused)} (the rows train on moebench's random tokens, a few steps at "
                     "one learning rate)")
    return settings, notes + later


def _quiet():
    """transformers' config warnings off the console (hf_config.quiet)."""
    from moebench.libraries.hf_config import quiet

    return quiet()


# ------------------------------------------------------------------ parsing and the loader


def _parse(path: str, text: str) -> dict:
    import yaml

    try:
        raw = yaml.safe_load(text)  # what Automodel's load_yaml_config parses the file with
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" (line {where.line + 1})" if where is not None else ""
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{path} is not YAML: {what}{at}; give {KIND}", flag=RECIPE) from None
    except RecursionError:
        raise UserError(f"{path} nests too deep to be a recipe; give {KIND}", flag=RECIPE) from None
    if not isinstance(raw, dict):
        raise UserError(f"{path} holds a YAML {type(raw).__name__}, not a mapping; give {KIND} (recipe:, model:, "
                        "distributed:, ...)", flag=RECIPE)
    if "recipe" not in raw:
        hint = (" (a DeepSpeed config? give it to --ds-config)" if "zero_optimization" in raw or
                "train_batch_size" in raw or "train_micro_batch_size_per_gpu" in raw else
                " (a model's config.json? give it to --hf-config)" if "model_type" in raw else "")
        raise UserError(f"{path} names no recipe, so it is not an Automodel recipe{hint}: Automodel's CLI requires "
                        f"`recipe: TrainFinetuneRecipeForNextTokenPrediction`; give {KIND}", flag=RECIPE)
    for key in raw:
        if not isinstance(key, str):
            raise UserError(f"{path}: key {key!r} is not a name; fix the file", flag=RECIPE)
    return raw


def _check_recipe_target(path: str, raw: dict) -> None:
    """`recipe:` as Automodel's CLI reads it (cli/app.py): a class name, a dotted path, or {_target_: ...}; the rows
    verify TrainFinetuneRecipeForNextTokenPrediction's training step."""
    try:
        from nemo_automodel.cli.utils import resolve_recipe_name
    except ImportError:  # a release without the `automodel` CLI's resolver: its two spellings of the class
        def resolve_recipe_name(raw_name: str) -> str:
            return RECIPE_CLASS if raw_name == RECIPE_CLASS.rsplit(".", 1)[1] else raw_name

    section = raw["recipe"]
    target = section.get("_target_") if isinstance(section, dict) else section
    if not isinstance(target, str) or not target.strip():
        raise UserError(f"recipe in {path} must name a recipe class (Automodel's CLI requires a recipe target); fix "
                        "the file", flag=RECIPE)
    try:
        resolved = resolve_recipe_name(target.strip())
    except ValueError as exc:
        raise UserError(f"Automodel refuses recipe {target.strip()!r} in {path}: {str(exc).splitlines()[0]}; fix the "
                        "file", flag=RECIPE) from None
    if resolved != RECIPE_CLASS:
        raise UserError(f"recipe {target.strip()!r} in {path}: the Automodel rows verify the training step of "
                        "TrainFinetuneRecipeForNextTokenPrediction (recipes/llm/train_ft.py); give a recipe of it",
                        flag=RECIPE)


def _targets(node: Any, where: str = ""):
    """(dotted key, value) for every `_target_` and `*_fn` in the raw YAML (what ConfigNode resolves by importing)."""
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{where}.{key}" if where else str(key)
            if isinstance(key, str) and (key == "_target_" or key.endswith("_fn")) and isinstance(value, str):
                yield here, value
            else:
                yield from _targets(value, here)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _targets(value, f"{where}.{i}")


def _check_targets(path: str, raw: dict, allow_imports: tuple[str, ...]) -> None:
    """Every target a loader would import is Automodel's own allow-list or consented to; checked before any import
    (Automodel's loader imports anything importable from sys.path, and executes `file.py:attr` targets)."""
    from nemo_automodel.components.config.loader import ALLOWED_IMPORT_PREFIXES

    recipe = raw["recipe"].get("_target_") if isinstance(raw["recipe"], dict) else raw["recipe"]
    found = list(_targets(raw)) + ([("recipe", recipe)] if isinstance(recipe, str) and "." in recipe else [])
    for where, target in found:
        if ":" in target:
            raise UserError(f"{where}: {target!r} in {path} names a Python file, which Automodel's loader executes; "
                            "moebench runs no file a recipe names: put it in a module and pass --allow-import "
                            "MODULE, or fix the file", flag=RECIPE)
        top = target.split(".")[0]
        if top in ALLOWED_IMPORT_PREFIXES:
            continue
        if any(target == a or target.startswith(a + ".") for a in allow_imports):
            continue
        raise UserError(f"{where}: {target!r} in {path} is code outside Automodel's own modules "
                        f"({', '.join(ALLOWED_IMPORT_PREFIXES)}); nothing of it is imported: pass --allow-import "
                        f"{target.rsplit('.', 1)[0] if '.' in target else target} to let it be, or fix the file",
                        flag=RECIPE)


def _check_top_level(path: str, raw: dict, notes: list[str]) -> None:
    import difflib

    unknown = [k for k in raw if k not in TOP_LEVEL and not k.startswith(("validation_dataset",
                                                                          "validation_dataloader", "_"))]
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(TOP_LEVEL), n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UserError(f"{', '.join(unknown)} in {path}: not a section Automodel's recipe reads{hint}, so "
                        "Automodel would ignore it; fix the file", flag=RECIPE)
    private = [k for k in raw if k.startswith("_")]
    if private:
        notes.append(f"{', '.join(private)}: a leading underscore, read by nothing (Automodel's recipes park "
                     "sections so)")
    for key, why in NOT_HONOURED_SECTIONS.items():
        if raw.get(key) not in (None, False, {}):
            notes.append(f"{key}: not honoured; {why}")
    if "rng" in raw:
        notes.append("rng: Automodel's train_ft (0.7.0) does not read it (its seed is `seed`); moebench's --seed "
                     "seeds the rows")


def _loader_refuses(path: str, exc: BaseException, where: str) -> UserError:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    return UserError(f"Automodel's config loader refuses {where} in {path}: {type(exc).__name__}: {first}; fix the "
                     "file", flag=RECIPE)


def _load_sections(path: str, raw: dict) -> dict[str, Any]:
    """The sections the rows use, loaded by Automodel's ConfigNode and typed by its RecipeConfig; what they refuse
    is refused. The model's own `_target_` is left out (named, not imported: see the module docstring)."""
    from nemo_automodel.components.config.loader import ConfigNode

    nodes: dict[str, Any] = {}
    subset: dict[str, Any] = {}
    for key in SECTIONS_READ:
        value = raw.get(key)
        if value is None:
            continue
        if key == "model":
            if not isinstance(value, dict):
                raise UserError(f"model in {path} must be a mapping, got {type(value).__name__}; fix the file",
                                flag=RECIPE)
            value = {k: v for k, v in value.items() if k != "_target_"}
        elif not isinstance(value, dict):
            raise UserError(f"{key} in {path} must be a mapping, got {type(value).__name__}; fix the file",
                            flag=RECIPE)
        subset[key] = value
    try:
        node = ConfigNode(subset)
    except (Exception, RecursionError) as exc:  # noqa: BLE001 - the loader's refusal, in one line
        raise _loader_refuses(path, exc, "it") from None
    nodes["root"] = node
    try:
        from nemo_automodel.recipes._typed_config import RecipeConfig
    except ImportError:  # a release without the typed view
        RecipeConfig = None  # noqa: N806
    if RecipeConfig is not None:
        typed = RecipeConfig(node)
        for section in ("step_scheduler", "optimizer"):
            try:
                nodes[section] = getattr(typed, section)
            except (Exception, RecursionError) as exc:  # noqa: BLE001
                raise _loader_refuses(path, exc, section) from None
    backend = node.get("model.backend", None)
    if backend is not None:
        _only_backend_config(path, backend)
        try:
            nodes["model.backend"] = backend.instantiate() if hasattr(backend, "_target_") else backend.to_dict()
        except (Exception, RecursionError) as exc:  # noqa: BLE001
            raise _loader_refuses(path, exc, "model.backend") from None
    return nodes


def _only_backend_config(path: str, backend) -> None:
    """model.backend is instantiated by Automodel's loader: only its BackendConfig, with no target nested in it (an
    allowed module's other callables, torch.save say, would run with the file's arguments)."""
    if not hasattr(backend, "get_as_string"):  # a plain value: BackendConfig's fields, nothing to call
        return
    target = backend.get_as_string("_target_", default=None)  # as written (the node holds the imported class)
    nested = [k for k, v in vars(backend).items() if not k.startswith("_") and hasattr(v, "_target_")]
    if (target is not None and not (isinstance(target, str) and target.startswith("nemo_automodel.")
                                    and target.rsplit(".", 1)[-1] == "BackendConfig")) or nested:
        what = f"_target_ {_show(target)}" if not nested else f"a _target_ nested in {nested[0]}"
        raise UserError(f"model.backend in {path}: {what}; model.backend must be Automodel's BackendConfig (its "
                        "_target_ nemo_automodel...BackendConfig, plain fields); fix the file", flag=RECIPE)


# ------------------------------------------------------------------ the model


def _model_named(path: str, model: dict) -> tuple[str, str | None]:
    """(the model the recipe names, a local folder holding its config.json or None)."""
    target = model.get("_target_")
    if target is not None and target not in MODEL_TARGETS:
        raise UserError(f"model._target_ {target!r} in {path}: the Automodel rows build the model "
                        "NeMoAutoModelForCausalLM.from_pretrained / from_config picks (Automodel's own class for the "
                        "config); for a Hugging Face model use --library transformers --hf-config", flag=RECIPE)
    named = model.get("pretrained_model_name_or_path")
    config = model.get("config")
    if named is None and isinstance(config, str):
        named = config
    elif named is None and isinstance(config, dict):
        named = config.get("pretrained_model_name_or_path")
    if named is None:
        raise UserError(f"model in {path} names no model (pretrained_model_name_or_path, or config:); fix the file",
                        flag=RECIPE)
    if not isinstance(named, str) or not named.strip() or len(named) > 1024:
        raise UserError(f"model.pretrained_model_name_or_path={named!r:.60} in {path} must be a model name or a "
                        "folder; fix the file", flag=RECIPE)
    local = named if os.path.isdir(named) else None
    return named, local


def _config_json(path: str, named: str, local: str | None, given: str | None) -> tuple[str, str]:
    if given is not None:
        return given, HF
    if local is not None:
        candidate = os.path.join(local, "config.json")
        if os.path.isfile(candidate):
            return candidate, RECIPE
        raise UserError(f"the model folder {local} named in {path} holds no config.json; pass the model's "
                        "config.json with --hf-config", flag=RECIPE)
    raise UserError(f"{path} names the model {named!r}, which moebench does not download: pass its config.json with "
                    "--hf-config FILE (docs/libraries.md, \"verify your own launch\")", flag=RECIPE)


def _config_fields(hf) -> set[str]:
    from moebench.libraries.hf_config import build_config

    return set(build_config(hf.model_type, hf.kwargs).to_dict()) | {"torch_dtype", "dtype"}


def _model_keys(path: str, model: dict, hf, notes: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config overrides of routing keys, moe_overrides) from the model section; a note per key not taken; an
    unknown key refused (NeMoAutoModelForCausalLM hands it to AutoConfig, whose class does not declare it)."""
    from moebench.libraries.hf_config import FAMILIES as HF_FAMILIES

    family = HF_FAMILIES[hf.model_type]
    fields = _config_fields(hf)
    overrides: dict[str, Any] = {}
    sized: list[str] = []
    for key, value in model.items():
        if key in MODEL_KEYS_READ:
            continue
        if key == "moe_config":
            raise UserError(f"model.moe_config in {path}: Automodel's NeMoAutoModelForCausalLM refuses it "
                            "(\"Distributed settings must be passed with distributed_setup\"); set MoE fields with "
                            "model.moe_overrides; fix the file", flag=RECIPE)
        if key in MODEL_KEYS_NOT_HONOURED:
            if value not in (None, False):
                notes.append(f"model.{key}={_show(value)}: not honoured; {MODEL_KEYS_NOT_HONOURED[key]}")
            continue
        if key in fields:
            if key in family.routing:
                overrides[key] = value
            else:
                sized.append(f"model.{key}")
            continue
        raise UserError(f"model.{key} in {path} is neither a {hf.config_class} field nor an argument of "
                        "NeMoAutoModelForCausalLM (Automodel would pass it to AutoConfig, which ignores it); fix "
                        "the file", flag=RECIPE)
    if sized:
        notes.append(f"{', '.join(sized)}: config overrides of keys that only size or position the model; the rows' "
                     "small model has its own")
    if model.get("trust_remote_code"):
        notes.append("model.trust_remote_code=true: no remote code runs; Automodel's own class for "
                     f"{hf.model_type} is built")
    moe = model.get("moe_overrides") or {}
    if not isinstance(moe, dict):
        raise UserError(f"model.moe_overrides in {path} must be a mapping of MoEConfig fields; fix the file",
                        flag=RECIPE)
    from moebench.libraries.automodel.api import MOE_DTYPES, MOE_SIZES

    sized = [k for k in moe if k in MOE_SIZES or k in MOE_DTYPES]  # the rows' small model has its own
    if sized:
        notes.append(f"{', '.join(f'model.moe_overrides.{k}' for k in sized)}: MoEConfig sizes and dtypes; the "
                     "rows' small model has its own (shrunk), its precision the row's")
    return overrides, {k: v for k, v in moe.items() if k not in sized}


def _model_dtype(path: str, model: dict) -> str | None:
    value = model.get("dtype", model.get("torch_dtype"))
    if value in (None, "auto"):
        return None
    known = ("float32", "float", "bfloat16", "bf16", "float16", "half", "fp16")
    if not isinstance(value, str) or value.replace("torch.", "") not in known:
        raise UserError(f"model.torch_dtype={_show(value)} in {path} must be a dtype name ({', '.join(known)}, "
                        "auto); fix the file", flag=RECIPE)
    return value


def _precision(config_dtype: str | None, model_dtype: str | None) -> str:
    """"bf16" or "fp32": what Automodel builds the model in (model.torch_dtype, else the config's; Automodel's
    default bfloat16)."""
    name = (model_dtype or config_dtype or "bfloat16").replace("torch.", "")
    return "fp32" if name in ("float32", "float") else "bf16" if name in ("bfloat16", "bf16") else "fp16"


def _bounded(path: str, flag: str, key: str, value: Any, low: float, high: float, *, whole: bool = True) -> Any:
    ok = not isinstance(value, bool) and (isinstance(value, int) if whole else isinstance(value, (int, float)))
    if not ok or not (math.isfinite(value) and low <= value <= high):
        kind = "a whole number" if whole else "a finite number"
        raise UserError(f"{key}={value!r} in {path}: must be {kind} from {low:g} to {high:g}; fix the file",
                        flag=flag)
    return value


def _resolve_model(hf, overrides: dict[str, Any], moe_overrides: dict[str, Any], *, flag: str,
                   path: str) -> dict[str, Any]:
    """Automodel's model class for the config, built small with the recipe's overrides (as its
    NeMoAutoModelForCausalLM would: config fields onto the config, moe_overrides onto the MoEConfig its class maps
    from the config): {"routing": the config's routing keys, "moe": the resolved MoEConfig fields (JSON),
    "moe_overrides": what the recipe overrides, "update_bias": whether the class updates its gate bias}."""
    from moebench.libraries.automodel import api
    from moebench.libraries.hf_config import FAMILIES as HF_FAMILIES

    family = HF_FAMILIES[hf.model_type]
    routing = {k: v for k, v in hf.routing.items() if v is not None}
    routing.update(overrides)
    for key, value in routing.items():
        if key in ("hidden_act",) or isinstance(value, bool):
            continue
        if isinstance(value, int):
            _bounded(path, flag, key, value, 0, 4096)
        elif isinstance(value, float):
            _bounded(path, flag, key, value, 0, MAX_FACTOR, whole=False)
    experts = _bounded(path, flag, family.experts, routing.get(family.experts), 1, 4096)
    _bounded(path, flag, "num_experts_per_tok", routing.get("num_experts_per_tok"), 1, experts)
    fields = api.moe_fields()
    for key, value in moe_overrides.items():
        if key not in fields:
            raise UserError(f"model.moe_overrides.{key} in {path}: MoEConfig has no field {key!r} (Automodel's "
                            "MoEConfig refuses it); fix the file", flag=flag)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            _bounded(path, flag, f"model.moe_overrides.{key}", value, 0, MAX_FACTOR if isinstance(value, float)
                     else 4096, whole=isinstance(value, int))
        elif not isinstance(value, (str, bool, type(None))):
            raise UserError(f"model.moe_overrides.{key}={_show(value)} in {path}: must be a number, a name or "
                            "true/false; fix the file", flag=flag)
    try:
        with _quiet():
            moe, update_bias, supports_tp = api.resolved_moe(hf.model_type, routing, moe_overrides)
    except Exception as exc:  # noqa: BLE001 - what Automodel's classes raise (huggingface_hub's strict-dataclass
        # validators raise their own error class, not a ValueError) is its refusal, in one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise UserError(f"Automodel refuses the model of {path}: {type(exc).__name__}: {first}; fix the file",
                        flag=flag) from None
    if moe["n_routed_experts"] < 1 or not 1 <= moe["n_activated_experts"] <= moe["n_routed_experts"]:
        raise UserError(f"{path}: {moe['n_activated_experts']} experts a token of {moe['n_routed_experts']}: "
                        "top-k must be from 1 to the number of experts; fix the file", flag=flag)
    groups = moe["n_expert_groups"]
    if groups > 1 and (moe["n_routed_experts"] % groups or not 1 <= moe["n_limited_groups"] <= groups):
        raise UserError(f"{path}: {groups} expert groups of {moe['n_routed_experts']} experts, "
                        f"{moe['n_limited_groups']} kept: the groups must divide the experts and the kept groups be "
                        "from 1 to their number; fix the file", flag=flag)
    return {"family": hf.model_type, "routing": routing, "moe": moe, "moe_overrides": moe_overrides,
            "update_bias": update_bias, "supports_tp": supports_tp}


def _backend(loaded: Any, notes: list[str], *, flag: str, path: str) -> dict[str, Any]:
    """The row's BackendConfig fields: the recipe's experts (Automodel's own BackendConfig resolves te / gmm with the
    torch dispatcher to torch_mm), the torch dispatcher, CPU attention and linear layers; a note per field not
    honoured."""
    from moebench.libraries.automodel import api

    given: dict[str, Any] = {}
    if loaded is not None:
        given = {f: getattr(loaded, f) for f in api.backend_fields() if hasattr(loaded, f)} \
            if not isinstance(loaded, dict) else dict(loaded)
    wanted = {"experts": given.get("experts", "torch_mm"), "dispatcher": "torch",
              "rms_norm": given.get("rms_norm", "torch"), "fake_balanced_gate": bool(given.get("fake_balanced_gate")),
              "gate_precision": given.get("gate_precision")}
    dispatcher = given.get("dispatcher", "torch")
    if dispatcher in CUDA_DISPATCHERS:
        notes.append(f"model.backend.dispatcher={dispatcher}: not honoured; its kernels need CUDA: verified with "
                     "Automodel's torch dispatcher (all-gather / all-reduce over the EP ranks)")
    if wanted["experts"] in ("te", "gmm"):
        notes.append(f"model.backend.experts={wanted['experts']}: not honoured; "
                     + ("Transformer Engine's grouped experts need CUDA: " if wanted["experts"] == "te" else "")
                     + "with the torch dispatcher Automodel's BackendConfig runs torch_mm (torch._grouped_mm)")
    elif wanted["experts"] == "torch_mm_mxfp8":
        notes.append("model.backend.experts=torch_mm_mxfp8: not honoured; MXFP8 needs torchao and sm_100: verified "
                     "with torch_mm, what it falls back to")
        wanted["experts"] = "torch_mm"
    if wanted["rms_norm"] in CUDA_RMS_NORMS:
        notes.append(f"model.backend.rms_norm={wanted['rms_norm']}: not honoured; its kernels need CUDA: torch's "
                     "RMSNorm")
        wanted["rms_norm"] = "torch"
    for key in ("attn", "linear"):
        if given.get(key) not in (None, BACKEND_CPU[key]):
            notes.append(f"model.backend.{key}={given[key]}: not honoured; CUDA kernels: {BACKEND_CPU[key]}")
    if wanted["gate_precision"] is not None:
        wanted["gate_precision"] = str(wanted["gate_precision"]).replace("torch.", "")
    resolved = api.backend_of(wanted)  # Automodel's own BackendConfig: te / gmm with the torch dispatcher -> torch_mm
    wanted["experts"] = resolved.experts
    return wanted


# ------------------------------------------------------------------ distributed, steps, clip, optimizer


def _distributed(path: str, section: Any, nodes: dict, model: dict, notes: list[str]) -> dict[str, Any]:
    """The sizes and layout from `distributed:`, parsed by Automodel's parse_distributed_section (its refusals are
    the loader's); TP / PP / CP as Automodel would take them with this model."""
    if not isinstance(section, dict):
        raise UserError(f"distributed in {path} must be a mapping; fix the file", flag=RECIPE)
    for key in DISTRIBUTED_SIZES:
        value = section.get(key)
        if value is not None:
            _bounded(path, RECIPE, f"distributed.{key}", value, 1, MAX_DEGREE)
    node = nodes["root"].get("distributed", None)
    parsed: dict[str, Any] = {}
    try:
        from nemo_automodel.recipes._dist_utils import parse_distributed_section

        parsed = parse_distributed_section(node.to_dict() if node is not None else {})
    except ImportError:
        pass
    except (Exception, RecursionError) as exc:  # noqa: BLE001 - Automodel's refusal, in one line
        raise _loader_refuses(path, exc, "distributed") from None
    get = (lambda k, d: parsed.get(k, d)) if parsed else (lambda k, d: section.get(k) or d)
    tp, pp, cp, ep = get("tp_size", 1), get("pp_size", 1), get("cp_size", 1), get("ep_size", 1)
    if tp > 1:
        cls = {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}[model["family"]]
        if not model["supports_tp"]:
            raise UserError(f"distributed.tp_size={tp} in {path}: Automodel refuses tensor parallelism for {cls} "
                            f"(\"Tensor parallelism (tp_size={tp}) requested but {cls} has no TP plan\"); fix the "
                            "file", flag=RECIPE)
    if pp > 1:
        notes.append(f"distributed.pp_size={pp}: not honoured; the rows' one-layer model is one pipeline stage")
    if cp > 1:
        notes.append(f"distributed.cp_size={cp}: not honoured; the rows' sequences are not split over ranks")
    strategy = str(section.get("strategy", "fsdp2")).lower()
    if strategy != "fsdp2":
        notes.append(f"distributed.strategy={strategy}: not honoured; verified with fsdp2 (the strategy Automodel's "
                     "MoE parallelizer applies)")
    dp = get("dp_size", None)
    if dp is not None:
        notes.append(f"distributed.dp_size={dp}: the rows' data parallelism is the world size (an FSDP degree larger "
                     "than the ranks here cannot be)")
    replicate = get("dp_replicate_size", None)
    if replicate:
        notes.append(f"distributed.dp_replicate_size={replicate}: HSDP kept where it fits the ranks (replicas x "
                     "shards = W, both > 1), else FSDP over every rank")
    ac = get("activation_checkpointing", False)
    if ac:
        notes.append(f"distributed.activation_checkpointing={_show(ac)}: kept (Automodel's apply_ac; the recompute "
                     "runs the router again)")
    moe = section.get("moe")
    if isinstance(moe, dict) and moe:
        notes.append(f"distributed.moe ({', '.join(map(str, moe))}): not passed on; Automodel's MoE parallelizer "
                     "defaults")
    others = [k for k in section if k not in (*DISTRIBUTED_SIZES, "strategy", "activation_checkpointing", "moe",
                                              "pipeline", "sequence_parallel")]
    if others:
        notes.append(f"distributed: {', '.join(map(str, others))}: not passed on (FSDP2Config's defaults)")
    return {"ep_size": ep, "dp_size": dp, "dp_replicate_size": replicate, "cp_size": cp, "tp_size": tp,
            "activation_checkpointing": ac if isinstance(ac, (bool, str)) else bool(ac)}


def _accumulation(path: str, nodes: dict, dist: dict, notes: list[str]) -> int:
    """The recipe's micro-batches a step: global_batch_size / (local_batch_size x dp), as Automodel's StepScheduler
    computes it, at the recipe's data-parallel size (dp_size, else the smallest world its ep_size runs on)."""
    section = nodes["root"].get("step_scheduler", None)
    raw = section.to_dict() if section is not None else {}
    global_bs = raw.get("global_batch_size", 32)  # StepSchedulerConfig's default
    local_bs = raw.get("local_batch_size", 1)  # train_ft's cfg.get("step_scheduler.local_batch_size", 1)
    _bounded(path, RECIPE, "step_scheduler.global_batch_size", global_bs, 1, MAX_BATCH)
    _bounded(path, RECIPE, "step_scheduler.local_batch_size", local_bs, 1, MAX_BATCH)
    for key in ("max_steps", "num_epochs", "ckpt_every_steps", "val_every_steps"):
        if raw.get(key) is not None:
            _bounded(path, RECIPE, f"step_scheduler.{key}", raw[key], 1, 1 << 40)
    tpcp = dist["tp_size"] * dist["cp_size"]
    dp = dist["dp_size"] or max(1, dist["ep_size"] // math.gcd(dist["ep_size"], tpcp))
    where = (f"dp_size {dp}" if dist["dp_size"]
             else f"dp {dp}, the smallest world its ep_size {dist['ep_size']} runs on")
    if global_bs % (local_bs * dp):  # StepScheduler's own rule
        raise UserError(f"step_scheduler in {path}: Automodel refuses it: global_batch_size ({global_bs}) must be "
                        f"divisible by local_batch_size * dp_size ({local_bs} * {dp}, {where}); fix the file",
                        flag=RECIPE)
    acc = global_bs // (local_bs * dp)
    line = (f"step_scheduler: global_batch_size {global_bs} / (local_batch_size {local_bs} x {where}) = {acc} "
            f"micro-batch(es) a step")
    if acc > MAX_ACCUM:
        line += f"; shrunk: the rows accumulate {MAX_ACCUM} (the same path; each costs a forward and backward)"
    else:
        line += "; kept"
    notes.append(line + "; each micro-batch shrunk to a few sequences of 8 tokens a rank")
    return acc


def _clip_line(max_norm: float, *, default: bool) -> str:
    head = (f"clip_grad_norm.max_norm not set: Automodel's trainer clips at {max_norm:g} (its default)" if default
            else f"clip_grad_norm.max_norm {max_norm:g}")
    if max_norm <= 0:
        return head + ": no clip"
    if max_norm <= BINDING_NORM:
        return head + ": kept (the small model's gradient norm exceeds it: the clip binds as it is; asserted)"
    return (head + f": kept; the small model's gradient norm is below it, so each row multiplies its loss (and the "
            f"aux-loss scale) by max_norm / {BINDING_NORM:g}, reference alike, and your clip binds (the row records "
            "the factor and asserts that it binds)")


def _clip(path: str, section: Any, notes: list[str], later: list[str]) -> float:
    if section is None:
        notes.append(_clip_line(DEFAULT_MAX_NORM, default=True))
        return DEFAULT_MAX_NORM
    if not isinstance(section, dict):
        raise UserError(f"clip_grad_norm in {path} must be a mapping (max_norm:, backend:); fix the file",
                        flag=RECIPE)
    unknown = [k for k in section if k not in CLIP_KEYS]
    if unknown:
        raise UserError(f"clip_grad_norm.{unknown[0]} in {path}: Automodel's trainer reads only "
                        f"clip_grad_norm.max_norm and .backend and would ignore it; fix the file", flag=RECIPE)
    value = section.get("max_norm")
    if value is None:
        notes.append(_clip_line(DEFAULT_MAX_NORM, default=True))
        return DEFAULT_MAX_NORM
    value = float(_bounded(path, RECIPE, "clip_grad_norm.max_norm", value, 0, MAX_NORM, whole=False))
    notes.append(_clip_line(value, default=False))
    backend = section.get("backend")
    if backend not in (None, "torch"):
        later.append(f"clip_grad_norm.backend={_show(backend)}: not honoured; its Triton kernel needs CUDA: "
                     "Automodel's torch norm")
    return value


def _optimizer(nodes: dict, notes: list[str]) -> tuple[str | None, float | None]:
    raw = nodes["root"].get("optimizer", None)
    if raw is None:
        notes.append(f"optimizer: none in the recipe; the rows step with SGD: {OPTIMIZER_WHY}")
        return None, None
    target = raw.get_as_string("_target_", default="?") if hasattr(raw, "get_as_string") else "?"
    name = target.rsplit(".", 1)[-1]
    lr = raw.get("lr", None)
    lr = float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) and math.isfinite(lr) else None
    notes.append(f"optimizer: your {name}" + (f" (lr {lr:g})" if lr is not None else "")
                 + f" is replaced by SGD: {OPTIMIZER_WHY}")
    return name, lr


def _loss(raw: dict, notes: list[str]) -> None:
    loss = raw.get("loss_fn")
    target = loss.get("_target_") if isinstance(loss, dict) else None
    if target is None or target.endswith(("MaskedCrossEntropy", "FusedLinearCrossEntropy", "ChunkedCrossEntropy")):
        return
    notes.append(f"loss_fn {target.rsplit('.', 1)[-1]}: not honoured; the rows' loss is cross-entropy summed over "
                 "the label tokens / their global count (MaskedCrossEntropy's, as train_ft normalises it)")


# ------------------------------------------------------------------ the settings and their notes


def _settings(hf, model: dict, *, recipe: str | None, hf_path: str, ep_size: int | None,
              dp_replicate: int | None, ac: Any, max_norm: float, grad_acc: int, precision: str,
              optimizer: str | None, lr: float | None, backend: dict[str, Any]) -> dict[str, Any]:
    return {"recipe": recipe, "hf_config": hf_path, "family": hf.model_type, "routing": model["routing"],
            "q_lora_rank": hf.kwargs.get("q_lora_rank") if hf.model_type == "deepseek_v3" else None,
            "moe": model["moe"], "moe_overrides": model["moe_overrides"], "update_bias": model["update_bias"],
            "backend": backend, "ep_size": ep_size, "dp_replicate_size": dp_replicate,
            "activation_checkpointing": ac, "max_norm": max_norm, "grad_acc": grad_acc,
            "precision": precision, "optimizer": optimizer, "lr": lr}


def _model_notes(hf, model: dict, settings: dict) -> list[str]:
    """The config.json's notes (kept, shrunk, not declared, ...), what Automodel's class resolves them to, the
    precision."""
    moe = model["moe"]
    kept = ", ".join(f"{k}={json.dumps(moe[k])}" for k in MOE_RECORDED if k in moe)
    out = list(hf.notes)
    out.insert(1, f"kept (Automodel's MoEConfig for {settings['family']}, as its model class maps the config"
               + (" and model.moe_overrides" if model["moe_overrides"] else "") + f"): {kept}")
    from moebench.libraries.automodel.api import USER_VOCAB

    out.insert(3, f"vocab_size -> {USER_VOCAB} for these rows (each token id's embedding is much of a router input) "
               "and every expert's router row drawn at one norm, so that every expert gets tokens at step 1 (each "
               "row asserts it)")
    if moe.get("gate_bias_update_factor", 0) > 0 and not model["update_bias"]:
        out.append(f"gate_bias_update_factor {moe['gate_bias_update_factor']:g}: Automodel's {settings['family']} "
                   "class has no update_moe_gate_bias, so its trainer never updates the gate bias; the rows do as "
                   "the trainer does")
    out.append(f"precision: {'bfloat16' if settings['precision'] == 'bf16' else 'float32'}"
               + (": kept in a bf16 row judged by the noise model; the float32 row compares exactly"
                  if settings["precision"] == "bf16" else ": the row compares exactly"))
    return out


def fit_ep(ep_size: int | None, world: int, experts: int) -> int:
    """The EP degree a row verifies: the recipe's (None: every rank), else the largest that fits `world` ranks and
    splits the experts (Automodel needs ep | world and ep | experts)."""
    want = world if ep_size is None else ep_size
    return max(e for e in range(1, min(want, world) + 1) if world % e == 0 and experts % e == 0)


def _row_notes(settings: dict, world_sizes: tuple[int, ...]) -> list[str]:
    experts = settings["moe"]["n_routed_experts"]
    want = settings["ep_size"]
    fits = {w: fit_ep(want, w, experts) for w in world_sizes}
    if want is None:
        return [f"expert parallelism over every rank (ep_size = W: {', '.join(str(e) for e in fits.values())})"]
    if all(e == want for e in fits.values()):
        return [f"distributed.ep_size={want}: kept"]
    shown = ", ".join(f"{e} at -n {w}" for w, e in fits.items())
    return [f"distributed.ep_size={want}: more than the ranks here; verified at the largest EP degree that fits "
            f"({shown}; each rank holds {experts} / ep experts)"]


def _show(value: Any) -> str:
    return json.dumps(value, default=str)[:40]
