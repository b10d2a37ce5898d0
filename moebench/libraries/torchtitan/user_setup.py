"""verify-parity --torchtitan-args: a user's torchtitan launch, as typed after `-m torchtitan.train`, read by
torchtitan's own `ConfigManager` into its `Trainer.Config`, and the settings the user rows (rows.py) take from it.

The string is split as a shell splits it (shlex); `--module` / `--config` are read the way ConfigManager reads them
(both forms, `--module X` and `--module=X`). `--module` must be one of torchtitan's own (its `_supported_models` /
`_supported_experiments`); a dotted module path is the user's code, imported by ConfigManager: refused unless
`--allow-import` names it (or a package above it). Then `ConfigManager().parse_args(argv)`: the `--config` registry
function builds the `Trainer.Config`, tyro applies the overrides (it refuses an unknown key or a bad value, printing
usage: that message, condensed to one line, is the refusal). torchtitan's config registries import its trainer,
data and metrics modules, which import datasets, torchdata and tensorboard (torchtitan's declared dependencies;
moebench installs none of them): where one is missing the parse runs with an import stand-in for the names those
modules take from it (imports.py, DATA_MODULES; nothing of them is used by a parse), and a note says so.

From the parsed config: the MoE of its model (every MoE layer's config must agree), the parallelism degrees and
backend, clipping, batch sizes (gradient accumulation), precision and the optimizer its `OptimizersContainer`
builds. Every count is bounded (BOUNDS); a model with no torchtitan MoE (llama3) or another MoE class (gpt_oss's) is
refused saying so. torchtitan 0.2.x configures with TOML files and a JobConfig, not this config manager: the flag is
refused there, naming the pinned release.

Over 400 lines: one reader for a whole training launch (its parse, the bounds of every count, the MoE, the
parallelism, batch sizes, precision and optimizer) and one line for each setting not honoured here; each a short
function.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import shlex
from typing import Any

from moebench.errors import UserError

FLAG = "--torchtitan-args"
PINNED = "0.3.0"
MAX_ROW_EXPERTS = 256
"""The most experts a row builds (each a 32 x 32 SwiGLU: 256 of them are ~0.8 M parameters, a fraction of a second);
a model with more is verified with this many, its expert groups kept (saying so)."""
MAX_ROW_ACCUM = 4
"""The most gradient-accumulation micro-steps a row takes: accumulating 4 is the same mathematics as 64, and every
micro-step is a forward and backward over the ranks."""
MAX_DEGREE = 1 << 16
MAX_COUNT = 1 << 30
BOUNDS: dict[str, tuple[float, float]] = {
    "parallelism.expert_parallel_degree": (1, MAX_DEGREE),
    "parallelism.tensor_parallel_degree": (1, MAX_DEGREE),
    "parallelism.data_parallel_replicate_degree": (1, MAX_DEGREE),
    "parallelism.context_parallel_degree": (1, MAX_DEGREE),
    "parallelism.pipeline_parallel_degree": (1, MAX_DEGREE),
    "training.local_batch_size": (1, MAX_COUNT),
    "training.seq_len": (1, MAX_COUNT),
    "training.steps": (1, MAX_COUNT),
    "training.max_norm": (1e-12, 1e12),
    "moe.num_experts": (1, 1 << 14),
    "moe.router.top_k": (1, 1 << 14),
    "moe.router.route_scale": (1e-6, 1e6),
    "moe.load_balance_coeff": (0, 1e3),
    "optimizer.lr": (0, 1e3),
    "optimizer.eps": (0, 1),
    "optimizer.weight_decay": (0, 1e3),
}
"""Every number the rows read, with its bounds (inclusive); outside them: one line, exit 2."""
DP_SHARD_BOUNDS = (1, MAX_DEGREE)
"""parallelism.data_parallel_shard_degree: -1 (the ranks left over) or within these."""
GLOBAL_BATCH_BOUNDS = (1, MAX_COUNT)
"""training.global_batch_size: -1 (one accumulation step) or within these."""
KERNEL_BACKENDS = {"deepep": "DeepEP", "hybridep": "HybridEP", "minimal_async_ep": "minimal async EP (Triton)"}


def read_setup(request) -> tuple[dict[str, Any], list[str]]:
    """The torchtitan rows' reader of a verify-parity request (libraries/setups.py): its --torchtitan-args."""
    return read(request.torchtitan_args, allow_imports=tuple(request.allow_imports or ()))


def refuse(message: str) -> UserError:
    return UserError(message, flag=FLAG)


def split(args: str) -> list[str]:
    try:
        argv = shlex.split(args)
    except ValueError as exc:
        raise refuse(f"{args[:60]!r} does not split as a shell would split it ({exc}); quote it as you would "
                     "after -m torchtitan.train") from None
    if not argv:
        raise refuse("is empty; give the arguments you pass to torchtitan.train, e.g. "
                     "'--module deepseek_v3 --config deepseek_v3_16b'")
    return argv


def module_and_config(argv: list[str]) -> tuple[str, str]:
    """`--module` and `--config` as ConfigManager._load_config reads them (both forms); a missing one refused."""
    found: dict[str, str] = {}
    for i, arg in enumerate(argv):
        for key in ("--module", "--config"):
            if arg.startswith(key + "="):
                found[key] = arg.split("=", 1)[1]
            elif arg == key:
                if i + 1 >= len(argv):
                    raise refuse(f"{key} has no value; e.g. --module deepseek_v3 --config deepseek_v3_16b")
                found[key] = argv[i + 1]
    if "-h" in argv or "--help" in argv:
        raise refuse("asks for torchtitan's help; run python -m torchtitan.config.manager --module M --config C "
                     "--help to read it, then give moebench the arguments you launch with")
    for key in ("--module", "--config"):
        if not found.get(key):
            raise refuse(f"names no {key}; torchtitan.train needs both, e.g. --module deepseek_v3 --config "
                         "deepseek_v3_16b")
    return found["--module"], found["--config"]


def require_release() -> str:
    """The installed torchtitan's version, when its config manager is the one this reader drives; else a refusal."""
    from moebench.libraries.torchtitan import api

    version = api.tt_version()
    if version is None:
        raise refuse("needs torchtitan: pip install 'moebench[torchtitan]' && pip install --no-deps "
                     f"torchtitan=={PINNED}")
    if api.generation() != "common" or not _has("torchtitan.config.manager"):
        raise refuse(f"reads torchtitan {PINNED}'s ConfigManager (--module / --config and its overrides); torchtitan "
                     f"{version} configures its runs with TOML files and a JobConfig instead: install torchtitan=="
                     f"{PINNED} (pinned) to verify your launch, or run --library torchtitan for {version}'s own rows")
    missing = [m for m in ("spmd_types", "tyro", "docstring_parser") if not _has(m)]
    if missing:
        raise refuse(f"torchtitan imports {', '.join(missing)}, which it does not declare: pip install "
                     "'moebench[torchtitan]'")
    return version


def _has(name: str) -> bool:
    from moebench.preload import has_module

    return has_module(name)


def check_module(module: str, allow_imports: tuple[str, ...]) -> str:
    """"torchtitan" for one of torchtitan's own modules, "user" for a dotted path --allow-import consents to;
    anything else refused (ConfigManager would import it)."""
    from moebench.libraries.torchtitan.imports import import_torchtitan

    import_torchtitan("torchtitan.models", "torchtitan.experiments")
    from torchtitan.experiments import _supported_experiments
    from torchtitan.models import _supported_models

    if module in _supported_models | _supported_experiments:
        return "torchtitan"
    if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", module):
        raise refuse(f"--module {module[:60]!r} is neither one of torchtitan's modules ("
                     f"{', '.join(sorted(_supported_models))}) nor a dotted module path")
    if module.split(".")[0] == "torchtitan":
        return "torchtitan"
    if any(module == a or module.startswith(a + ".") for a in allow_imports):
        return "user"
    raise refuse(f"--module {module} is not one of torchtitan's ({', '.join(sorted(_supported_models))}): it names "
                 f"your code, which torchtitan's ConfigManager imports; add --allow-import {module} to let it")


def parse(argv: list[str]):
    """torchtitan's own ConfigManager().parse_args(argv), its refusals (tyro's usage on stderr and SystemExit, a
    ValueError of the registry or a config's __post_init__) as one line."""
    import logging

    from moebench.libraries.torchtitan.imports import standing_in

    err, out = io.StringIO(), io.StringIO()
    titan_log = logging.getLogger("torchtitan")
    level = titan_log.level
    titan_log.setLevel(logging.ERROR)  # "HF assets path ... does not exist!": the rows load no tokenizer
    try:
        with standing_in(data=True), contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            from torchtitan.config.manager import ConfigManager

            return ConfigManager().parse_args(list(argv))
    except SystemExit:
        raise refuse(f"torchtitan's parser refused it: {condense(err.getvalue() or out.getvalue())}") from None
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - the registry's or a config's own refusal, in its words
        text = " ".join(str(exc).split())
        raise refuse(f"torchtitan refused it: {type(exc).__name__}: {text[:300]}") from None
    finally:
        titan_log.setLevel(level)


def condense(usage: str) -> str:
    """tyro's boxed usage message as one line: its error lines, and its "Perhaps you meant" suggestion."""
    lines = [line.strip() for line in usage.splitlines()]
    blocks: list[list[str]] = [[]]
    for line in lines:
        if set(line) <= set("-─ ") and line:
            blocks.append([])
        elif line:
            blocks[-1].append(line)
    blocks = [b for b in blocks if b]
    if not blocks:
        return "(no message)"
    body = blocks[1] if len(blocks) > 1 else blocks[0]
    text = " ".join(body)
    for block in blocks:
        if block and block[0].startswith("Perhaps you meant"):
            text += f"; perhaps you meant {block[1].split()[0]}"
    return " ".join(text.split())[:300]


def _bounded(what: str, value, *, allow: tuple = ()) -> None:
    if value in allow:
        return
    low, high = BOUNDS[what] if what in BOUNDS else (DP_SHARD_BOUNDS if what.endswith("shard_degree") else
                                                      GLOBAL_BATCH_BOUNDS)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and (
        low <= value <= high)
    if not ok:
        extra = f" or {', '.join(map(str, allow))}" if allow else ""
        raise refuse(f"{what}={value!r} is out of bounds: it must be between {low:g} and {high:g}{extra}; fix the "
                     "arguments")


def moe_configs(config) -> list:
    """The MoE configs of the model (torchtitan's own `traverse` of its config tree)."""
    from torchtitan.models.common.moe import MoE

    model = config.model_spec.model
    return [found[1] if isinstance(found, tuple) else found for found in model.traverse(MoE.Config)]


def _moe(config, module: str, name: str) -> tuple[Any, list[str]]:
    """The model's MoE config (every MoE layer's must agree on what the rows read) and notes."""
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts

    moes = moe_configs(config)
    if not moes:
        raise refuse(f"--module {module} --config {name} builds a model with no MoE layer "
                     f"({type(config.model_spec.model).__qualname__}): there is no expert parallelism to verify; "
                     "give a MoE config, e.g. --module deepseek_v3 --config deepseek_v3_16b")
    first = moes[0]
    odd = [type(m).__qualname__ for m in moes if type(m) is not MoE.Config or type(m.routed_experts) is not
           RoutedExperts.Config or type(m.routed_experts.inner_experts) is not GroupedExperts.Config]
    if odd:
        raise refuse(f"--module {module}'s MoE is {odd[0]}, not torchtitan's common MoE (models/common/moe.py: "
                     "router, grouped SwiGLU experts, token dispatcher) that these rows build; its own MoE is not "
                     "verified here")
    differ = [m for m in moes if _moe_fields(m) != _moe_fields(first)]
    notes = []
    if differ:
        notes.append(f"not honoured here: {len(differ)} of the {len(moes)} MoE layers differ from the first; the rows "
                     "build the first layer's MoE")
    return first, notes


def _moe_fields(m) -> tuple:
    r = m.router
    shared = None if m.shared_experts is None else m.shared_experts.w1.out_features
    return (m.num_experts, r.top_k, r.score_func, r.route_norm, r.route_scale, r.num_expert_groups,
            r.num_limited_groups, m.load_balance_coeff, m.routed_experts.inner_experts.hidden_dim, shared)


def read(args: str, *, allow_imports: tuple[str, ...] = ()) -> tuple[dict[str, Any], list[str]]:
    """(settings, notes) of a torchtitan launch (the module docstring); bad input is a UserError naming the flag."""
    argv = split(args)
    version = require_release()
    module, name = module_and_config(argv)
    origin = check_module(module, allow_imports)
    config = parse(argv)
    for target in getattr(config.override, "imports", []) or []:
        target = target if isinstance(target, str) else target[0]
        if target.split(".")[0] != "torchtitan" and not any(target == a or target.startswith(a + ".")
                                                            for a in allow_imports):
            raise refuse(f"--override.imports {target} names your code, which torchtitan imports at launch; add "
                         f"--allow-import {target.rsplit('.', 1)[0]} to let it (the rows still run torchtitan's own "
                         "modules)")
    moe, notes = _moe(config, module, name)
    settings = _settings(config, moe, version, module, name, notes)
    notes = _front_notes(settings, config, moe, origin, module) + notes
    return settings, notes


def _settings(config, moe, version: str, module: str, name: str, notes: list[str]) -> dict[str, Any]:
    router = moe.router
    inner = moe.routed_experts.inner_experts
    experts, top_k = moe.num_experts, router.top_k
    _bounded("moe.num_experts", experts)
    _bounded("moe.router.top_k", top_k)
    _bounded("moe.router.route_scale", float(router.route_scale))
    if top_k > experts:
        raise refuse(f"--config {name}: top_k {top_k} is more than its {experts} experts")
    groups, limited = router.num_expert_groups, router.num_limited_groups
    if groups is not None:
        if not (isinstance(groups, int) and 1 <= groups <= experts and experts % groups == 0 and experts // groups
                >= 2 and isinstance(limited, int) and 1 <= limited <= groups and limited * (experts // groups)
                >= top_k):
            raise refuse(f"--config {name}: num_expert_groups={groups} / num_limited_groups={limited} do not fit "
                         f"{experts} experts and top-{top_k} (groups must divide the experts, at least 2 each, and "
                         "the kept groups hold at least top_k experts)")
    coeff = moe.load_balance_coeff
    if coeff is not None:
        _bounded("moe.load_balance_coeff", float(coeff))
    shared_mult = 0
    if moe.shared_experts is not None:
        out = moe.shared_experts.w1.out_features
        shared_mult = max(1, round(out / inner.hidden_dim))
    training, par = config.training, config.parallelism
    for key in ("expert_parallel_degree", "tensor_parallel_degree", "data_parallel_replicate_degree",
                "context_parallel_degree", "pipeline_parallel_degree"):
        _bounded(f"parallelism.{key}", getattr(par, key))
    _bounded("parallelism.data_parallel_shard_degree", par.data_parallel_shard_degree, allow=(-1,))
    for key in ("local_batch_size", "seq_len", "steps"):
        _bounded(f"training.{key}", getattr(training, key))
    _bounded("training.max_norm", training.max_norm)
    _bounded("training.global_batch_size", training.global_batch_size, allow=(-1,))
    optimizer = _optimizer(config, notes)
    row_experts = experts
    if experts > MAX_ROW_EXPERTS:
        per_group = (experts // groups) if groups else None
        row_experts = groups * max(2, MAX_ROW_EXPERTS // groups) if groups else MAX_ROW_EXPERTS
        row_experts = max(row_experts, top_k)
        notes.append(f"shrunk: num_experts {experts} -> {row_experts} (a row builds at most {MAX_ROW_EXPERTS}"
                     + (f"; {groups} groups of {row_experts // groups} instead of {per_group}" if groups else "")
                     + f"; top_k {top_k} kept)")
    accum, accum_note = _accumulation(training, par)
    if accum_note:
        notes.append(accum_note)
    return {
        "release": version, "module": module, "config": name, "flavor": str(config.model_spec.flavor),
        "experts": row_experts, "experts_user": experts, "top_k": top_k, "score_func": router.score_func,
        "route_norm": bool(router.route_norm), "route_scale": float(router.route_scale), "groups": groups,
        "limited_groups": limited if groups is not None else None, "shared_mult": shared_mult,
        "load_balance_coeff": None if coeff is None else float(coeff),
        "ep": par.expert_parallel_degree, "tp": par.tensor_parallel_degree,
        "dp_shard": par.data_parallel_shard_degree, "dp_replicate": par.data_parallel_replicate_degree,
        "sequence_parallel": bool(par.enable_sequence_parallel), "backend": par.spmd_backend,
        "max_norm": float(training.max_norm), "local_batch": training.local_batch_size,
        "global_batch": training.global_batch_size, "accum": accum, "dtype": training.dtype,
        "mp_param": training.mixed_precision_param, **optimizer,
        "dispatcher": type(moe.routed_experts.token_dispatcher).__qualname__,
        "comm_backend": _comm_backend(moe),
        "parallelize_fn": _function_path(config.model_spec.parallelize_fn),
        "reshard_after_forward": str(par.fsdp_reshard_after_forward),
    }


def _function_path(fn) -> str:
    """"module:function" of the parallelize function the user's model spec hands torchtitan's trainer."""
    return f"{fn.__module__}:{fn.__qualname__}" if callable(fn) else ""


def _comm_backend(moe) -> str:
    name = type(moe.routed_experts.token_dispatcher).__qualname__.lower()
    for key in KERNEL_BACKENDS:
        if key.replace("_", "") in name.replace("_", ""):
            return key
    return "standard"


def _optimizer(config, notes: list[str]) -> dict[str, Any]:
    """The optimizer torchtitan's OptimizersContainer builds from the config: one param group (the catch-all) of
    Adam or AdamW, its kwargs bounded; more groups, or another optimizer, are refused or noted."""
    groups = config.optimizer.param_groups
    if not groups:
        raise refuse("builds no optimizer (optimizer.param_groups is empty)")
    group = groups[-1]
    if group.optimizer_name not in ("Adam", "AdamW"):
        raise refuse(f"builds {group.optimizer_name}, which the rows do not run (Adam and AdamW, what torchtitan's "
                     "OptimizersContainer builds by name)")
    if len(groups) > 1:
        notes.append(f"not honoured here: {len(groups) - 1} parameter group(s) before the catch-all "
                     f"({', '.join(g.pattern for g in groups[:-1])[:80]}): every parameter takes the last group's "
                     f"{group.optimizer_name}")
    kwargs = dict(group.optimizer_kwargs)
    lr = kwargs.pop("lr", None)
    if lr is None:
        raise refuse(f"its {group.optimizer_name} group has no lr (torchtitan requires one)")
    betas = tuple(kwargs.pop("betas", (0.9, 0.999)))
    eps = kwargs.pop("eps", 1e-8)
    wd = kwargs.pop("weight_decay", 0.01 if group.optimizer_name == "AdamW" else 0.0)
    for what, value in (("optimizer.lr", lr), ("optimizer.eps", eps), ("optimizer.weight_decay", wd)):
        _bounded(what, value)
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
        raise refuse(f"optimizer betas {betas!r} out of bounds: two numbers in [0, 1)")
    for key in ("fused", "foreach", "capturable", "differentiable"):
        kwargs.pop(key, None)
    if kwargs:
        notes.append(f"not honoured here: optimizer kwargs {', '.join(sorted(kwargs))} (torch's defaults)")
    implementation = config.optimizer.implementation
    if implementation != "for-loop":
        notes.append(f"not honoured here: optimizer.implementation={implementation} (fused / foreach kernels); the "
                     "rows step torch's for-loop implementation, the same update")
    return {"optimizer": group.optimizer_name, "lr": float(lr), "beta1": float(betas[0]), "beta2": float(betas[1]),
            "eps": float(eps), "weight_decay": float(wd)}


def _accumulation(training, par) -> tuple[int | None, str]:
    """torchtitan's gradient accumulation steps (trainer.py: global_batch_size / (local_batch_size x the batch
    degree)); None when it depends on the world size (data_parallel_shard_degree -1 with a global batch given)."""
    if training.global_batch_size < 0:
        return 1, ""
    if par.data_parallel_shard_degree < 0:
        return None, (f"kept: global_batch_size {training.global_batch_size} with data_parallel_shard_degree -1: "
                      "the accumulation steps depend on your world size; each row takes them at its own ranks")
    degree = par.data_parallel_replicate_degree * par.data_parallel_shard_degree
    if training.global_batch_size % (training.local_batch_size * degree):
        raise refuse(f"training.global_batch_size {training.global_batch_size} is not a multiple of "
                     f"local_batch_size {training.local_batch_size} x data-parallel degree {degree} (torchtitan's "
                     "trainer asserts it)")
    return training.global_batch_size // (training.local_batch_size * degree), ""


def _front_notes(s: dict[str, Any], config, moe, origin: str, module: str) -> list[str]:
    """kept / shrunk / not honoured, one line each (the console prints them before the table)."""
    from moebench.libraries.torchtitan import api
    from moebench.libraries.torchtitan.imports import missing_data_packages

    groups = (f", {s['groups']} expert groups keeping {s['limited_groups']}" if s["groups"] else "")
    lbc = (f", load_balance_coeff {s['load_balance_coeff']:g} (the expert bias and its update)"
           if s["load_balance_coeff"] is not None else ", no load balancing bias")
    shared = f", {s['shared_mult']} shared expert(s)" if s["shared_mult"] else ", no shared expert"
    accum = "taken at each row's ranks" if s["accum"] is None else str(s["accum"])
    model = config.model_spec.model
    notes = [
        f"kept: {s['experts_user']} experts top-{s['top_k']}, {s['score_func']}, route_norm {s['route_norm']}, "
        f"route_scale {s['route_scale']:g}{groups}{shared}{lbc}",
        f"kept: EP {s['ep']}, TP {s['tp']} (spmd_backend {s['backend']}), max_norm {s['max_norm']:g}, gradient "
        f"accumulation {accum}, training.dtype {s['dtype']} with mixed_precision_param {s['mp_param']}, "
        f"{s['optimizer']} (lr {s['lr']:g}, betas {s['beta1']:g}/{s['beta2']:g}, eps {s['eps']:g}, weight_decay "
        f"{s['weight_decay']:g})",
        f"shrunk: dim {getattr(model, 'dim', '?')} -> {api.HIDDEN}, expert hidden "
        f"{moe.routed_experts.inner_experts.hidden_dim} -> {api.EXPERT_HIDDEN}, {len(model.layers)} layers -> one "
        f"MoE layer, vocab {getattr(model, 'vocab_size', '?')} -> none (the rows feed hidden states), seq_len "
        f"{config.training.seq_len} -> {api.SEQ_LEN}, local_batch_size {config.training.local_batch_size} -> "
        f"{api.SEQS_PER_DP_RANK}",
        f"kept: EP / TP degrees larger than the world size are verified at the largest that fits it (each row's "
        f"ep_mode); data_parallel_shard_degree {s['dp_shard']} -> the ranks left over",
    ]
    if s["comm_backend"] != "standard":
        notes.append(f"not honoured here: the {KERNEL_BACKENDS[s['comm_backend']]} token dispatcher (CUDA kernels); "
                     "the rows exchange tokens with torchtitan's standard all-to-all dispatcher")
    if s["dp_replicate"] > 1:
        notes.append(f"not honoured here: data_parallel_replicate_degree {s['dp_replicate']} (HSDP): the rows "
                     "shard data parallelism only (dp_shard)")
    par = config.parallelism
    for key, what in (("context_parallel_degree", "context parallelism"),
                      ("pipeline_parallel_degree", "pipeline parallelism")):
        if getattr(par, key) > 1:
            notes.append(f"not honoured here: {key} {getattr(par, key)} ({what}): the rows run one MoE layer")
    if config.compile.enable:
        notes.append(f"not honoured here: compile ({', '.join(config.compile.components)}): the rows run eager")
    ac = type(config.activation_checkpoint).__qualname__.split(".")[0]
    if ac not in ("NoAC", "NoneType"):
        notes.append(f"not honoured here: activation checkpointing ({ac}): recomputation gives the same gradients; "
                     "the rows do not recompute")
    converters = getattr(config.model_spec.model, "converters", None) or []
    if converters or "float8" in s["config"] or "fp8" in s["config"] or "nvfp4" in s["config"]:
        notes.append("not honoured here: float8 / MX / NV quantization converters (CUDA kernels): the rows run bf16")
    imports = list(getattr(config.override, "imports", []) or [])
    if imports:
        shown = ", ".join(i if isinstance(i, str) else i[0] for i in imports)[:100]
        notes.append(f"not honoured here: override.imports ({shown}): kernel overrides replace torchtitan's modules; "
                     "the rows run torchtitan's own")
    if config.training.enable_cpu_offload:
        notes.append("not honoured here: training.enable_cpu_offload (FSDP's CPU offload): nothing is offloaded")
    if origin == "user":
        notes.append(f"--module {module}: your config registry, imported by torchtitan's ConfigManager "
                     "(--allow-import)")
    missing = missing_data_packages()
    if missing:
        notes.append(f"parsed by torchtitan {s['release']}'s ConfigManager with import stand-ins for "
                     f"{', '.join(missing)} (its trainer, data and metrics modules import them; a parse uses "
                     "none): pip install "
                     f"{' '.join(missing)} to parse with them")
    return notes
