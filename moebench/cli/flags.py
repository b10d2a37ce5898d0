"""Every flag of every command, derived from the config dataclasses or defined once here.

A run config field becomes `--<field-name>` with its docstring as help and its default shown from
the variant's default preset (moebench.config.leaves); flags every command shares (--results-dir,
--json, --list, --seed, --world-size/-n, --comm-backend, --timeout) come from `shared_option`.
Nothing here is written per variant: a new config field is a new flag on every command that has it.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Literal, Optional

import typer

from moebench import bounds
from moebench import config as config_tree

KEYWORD = inspect.Parameter.KEYWORD_ONLY


def _param(name: str, annotation, option) -> inspect.Parameter:
    return inspect.Parameter(name, KEYWORD, default=option, annotation=annotation)


def _shown(value: Any) -> str | bool:
    if value is None:
        return False
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


PANELS = {"preset": "The preset", "model": "Model", "moe": "MoE layer", "engine": "DeepSpeed engine",
          "train": "Training"}
"""The help panel of a run flag, by its config section (the launch section's flags go with the output options)."""


def leaf_option(spec: config_tree.FieldSpec, *, value: Any = None, shown: Any = None, hidden: bool = False,
                name: str | None = None, panel: str | None = None):
    """The Typer option of one config field. `value` None means "not given" (the preset decides);
    `shown` is the default --help shows."""
    flag = name or spec.name
    names = [f"{flag}/--no-{flag[2:]}"] if spec.kind is bool else [flag]
    if spec.meta.get("short") and not hidden:
        names.append(spec.meta["short"])
    extra: dict[str, Any] = {}
    if spec.meta.get("choices"):
        extra["case_sensitive"] = False  # the annotation is a Literal of the choices (see `annotation`)
        extra["metavar"] = "|".join(c.lower() for c in spec.meta["choices"])  # as the docs spell them
    elif spec.meta.get("metavar"):
        extra["metavar"] = spec.meta["metavar"]
    if spec.meta.get("bound") is not None:  # read through the field's bound: refused before any work
        spellings = [n for n in names if "/" not in n] + [n for n in (spec.name, *spec.meta.get("aliases", ()))
                                                            if n not in names]
        spellings.sort(key=lambda n: n != spec.name)  # the field's own name first: the one a refusal shows
        extra["parser"] = bounds.Parser(spec.meta["bound"], tuple(spellings))
    help_text = f"Old spelling of {spec.name}." if hidden else spec.help
    return typer.Option(value, *names, help=help_text, show_default=_shown(shown if value is None else value),
                        hidden=hidden, rich_help_panel=panel, **extra)


def bounded_option(default: Any, *names: str, bound: bounds.Bound, **kwargs) -> Any:
    """A Typer option of a command (not of a config) whose value is read through `bound`."""
    return typer.Option(default, *names, parser=bounds.Parser(bound, names), **kwargs)


def annotation(spec: config_tree.FieldSpec):
    return Optional[Literal[spec.meta["choices"]]] if spec.meta.get("choices") else Optional[spec.kind]


def config_parameters(config_cls: type, defaults: dict) -> tuple[list[inspect.Parameter], Callable]:
    """Signature parameters for every leaf of `config_cls` (defaults shown from `defaults`, the
    default preset), and a function turning the parsed values into {field path: value}."""
    params, names = [], {}
    for spec in config_tree.leaves(config_cls):
        if spec.path == ("preset",):
            continue
        default = defaults
        for key in spec.path:
            default = default.get(key) if isinstance(default, dict) else None
        param = "_".join(spec.path)
        names[param] = spec.path
        panel = PANELS.get(spec.path[0])
        params.append(_param(param, annotation(spec), leaf_option(spec, shown=default, panel=panel)))
        for i, alias in enumerate(spec.meta.get("aliases", ())):
            names[f"{param}__alias{i}"] = spec.path
            params.append(_param(f"{param}__alias{i}", annotation(spec), leaf_option(spec, hidden=True, name=alias)))

    def overrides(values: dict) -> dict[tuple[str, ...], Any]:
        out: dict[tuple[str, ...], Any] = {}
        for param, path in names.items():  # the real flag first: it wins over an old spelling
            if values.get(param) is not None and path not in out:
                out[path] = values[param]
        return out

    return params, overrides


SHARED_FIELDS = {spec.path[-1]: spec for spec in config_tree.leaves(config_tree.LaunchConfig)
                 + config_tree.leaves(config_tree.TrainConfig) if spec.path[-1] in
                 ("world_size", "device", "comm_backend", "timeout_s", "seed")}
"""Config fields other commands (verify-parity) take too: the same flag, help and checks."""
RESULTS_DIR_BOUND = bounds.Path(folder=True)
"""--results-dir: a folder (or one to create) within PATH_MAX; writers check it is writable (check_root)."""
OUTPUT_OPTIONS = {
    "results_dir": lambda: bounded_option(None, "--results-dir", bound=RESULTS_DIR_BOUND, metavar="DIR",
                                          help="Results root (default: $MOEBENCH_RESULTS or ./results)."),
    "as_json": lambda: typer.Option(False, "--json", help="Print one JSON document on stdout instead of tables."),
    "list_names": lambda: typer.Option(False, "--list", help="List what is registered and exit."),
}
"""Options of the commands themselves, not of a config: spelled once, used by every command."""


def shared_option(name: str, value: Any = None) -> Any:
    """A flag every command spells the same way: a shared config field, or an output option."""
    if name in SHARED_FIELDS:
        return leaf_option(SHARED_FIELDS[name], value=value)
    return OUTPUT_OPTIONS[name]()


def with_signature(fn: Callable, params: list[inspect.Parameter]) -> Callable:
    """`fn(**values)` presented to Typer with `params` as its signature."""
    fn.__signature__ = inspect.Signature(params)
    fn.__annotations__ = {p.name: p.annotation for p in params}
    return fn
