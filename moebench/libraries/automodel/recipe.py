"""Reading a user's NeMo Automodel recipe YAML (--recipe): the file bounded, parsed as Automodel's loader parses it,
its imports checked, its top-level sections and the sections the rows use loaded by Automodel's own objects, and the
model's config.json it names found (user_setup.py is the reader; fit.py fits what is read to the rows).

In order, each refusal one line naming the flag and the file, before anything of the recipe is imported and before
any rank starts:
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
   `BackendConfig` (`model.backend`): what they refuse is refused, with their message. The model section's
   `_target_` (NeMoAutoModelForCausalLM) is named, never imported: the rows build the model class it picks for the
   config's model_type, as moebench's Automodel rows always do (api.py);
5. top-level keys Automodel would ignore are refused by name; `bounded` and `show` are the bound on a value and its
   short display every refusal here and in fit.py uses.
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


def load(path: str, allow_imports: tuple[str, ...]) -> tuple[dict, dict[str, Any], list[str]]:
    """(the raw YAML, the sections Automodel's objects loaded, the notes of what is not honoured or not used) of the
    recipe at `path`: the module docstring's steps, in order."""
    from moebench.userfiles import read_text

    text = read_text(path, flag=RECIPE, kind=KIND, max_bytes=MAX_BYTES)
    raw = parse(path, text)
    check_recipe_target(path, raw)
    check_targets(path, raw, allow_imports)
    later: list[str] = []  # what is not honoured or not used: after what the rows keep
    check_top_level(path, raw, later)
    return raw, load_sections(path, raw), later


# ------------------------------------------------------------------ parsing and the loader


def parse(path: str, text: str) -> dict:
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


def check_recipe_target(path: str, raw: dict) -> None:
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


def check_targets(path: str, raw: dict, allow_imports: tuple[str, ...]) -> None:
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


def check_top_level(path: str, raw: dict, notes: list[str]) -> None:
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


def loader_refuses(path: str, exc: BaseException, where: str) -> UserError:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    return UserError(f"Automodel's config loader refuses {where} in {path}: {type(exc).__name__}: {first}; fix the "
                     "file", flag=RECIPE)


def load_sections(path: str, raw: dict) -> dict[str, Any]:
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
        raise loader_refuses(path, exc, "it") from None
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
                raise loader_refuses(path, exc, section) from None
    backend = node.get("model.backend", None)
    if backend is not None:
        _only_backend_config(path, backend)
        try:
            nodes["model.backend"] = backend.instantiate() if hasattr(backend, "_target_") else backend.to_dict()
        except (Exception, RecursionError) as exc:  # noqa: BLE001
            raise loader_refuses(path, exc, "model.backend") from None
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
        what = f"_target_ {show(target)}" if not nested else f"a _target_ nested in {nested[0]}"
        raise UserError(f"model.backend in {path}: {what}; model.backend must be Automodel's BackendConfig (its "
                        "_target_ nemo_automodel...BackendConfig, plain fields); fix the file", flag=RECIPE)


# ------------------------------------------------------------------ the model


def model_named(path: str, model: dict) -> tuple[str, str | None]:
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


def config_json(path: str, named: str, local: str | None, given: str | None) -> tuple[str, str]:
    if given is not None:
        return given, HF
    if local is not None:
        candidate = os.path.join(local, "config.json")
        if os.path.isfile(candidate):
            return candidate, RECIPE
        raise UserError(f"the model folder {local} named in {path} holds no config.json; pass the model's "
                        "config.json with --hf-config", flag=RECIPE)
    raise UserError(f"{path} names the model {named!r}, which moebench does not download: pass its config.json with "
                    "--hf-config FILE (docs/libraries/automodel.md, \"Your launch\")", flag=RECIPE)


# ------------------------------------------------------------------ a value's bound and display (fit.py's too)


def bounded(path: str, flag: str, key: str, value: Any, low: float, high: float, *, whole: bool = True) -> Any:
    ok = not isinstance(value, bool) and (isinstance(value, int) if whole else isinstance(value, (int, float)))
    if not ok or not (math.isfinite(value) and low <= value <= high):
        kind = "a whole number" if whole else "a finite number"
        raise UserError(f"{key}={value!r} in {path}: must be {kind} from {low:g} to {high:g}; fix the file",
                        flag=flag)
    return value


def show(value: Any) -> str:
    return json.dumps(value, default=str)[:40]
