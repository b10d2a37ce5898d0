"""Your own training setup, as you launch it: the flags that hand verify-parity a framework's own file or arguments,
and which library's rows take each (a registry: the CLI, the Python API, --help and the docs read it).

Each flag names the thing its framework's users already have, in the words of that framework:
- `--ds-config FILE`: the DeepSpeed config (DeepSpeed's own name for it, `ds_config`);
- `--hf-config FILE`: a model's `config.json` (what `from_pretrained` reads; transformers, AutoEP and Automodel's
  Hugging Face models build from it);
- `--recipe FILE`: an NeMo Automodel recipe YAML (what `automodel ... -c` / `--config` launches);
- `--torchtitan-args ARGS`: the arguments given to `torchtitan.train` (`--module`, `--config` and the overrides),
  one string, as typed after `-m torchtitan.train`.
Each implies its library when --library is not given; with --library, each flag must be read by one of them.

A library's reader takes the request (whichever of these flags it reads are set on it) and returns
(settings, notes): the settings its `Adapter.rows(user_config=...)` builds rows from, and one line per thing of the
setup kept, shrunk to fit this machine, or not honoured here. The framework's own parser reads the file; a file or
value it refuses is a UserError naming the flag, before anything is written or any rank starts.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class SetupFlag:
    flag: str
    field: str
    """The LibraryRequest field and Python API argument of the same flag."""
    what: str
    """What the flag takes, as --help and the refusals say it."""
    readers: Mapping[str, str]
    """library -> "module:function" reading the request into that library's (settings, notes)."""
    implies: str
    """The library run when --library is not given."""
    is_path: bool = True


SETUP_FLAGS = (
    SetupFlag("--ds-config", "ds_config", "a DeepSpeed config file",
              {"deepspeed": "moebench.libraries.deepspeed.user_config:read_setup",
               "autoep": "moebench.libraries.autoep.user_config:read_setup"}, "deepspeed"),
    SetupFlag("--hf-config", "hf_config", "a model's config.json",
              {"transformers": "moebench.libraries.transformers.user_setup:read_setup",
               "autoep": "moebench.libraries.autoep.user_config:read_setup",
               "automodel": "moebench.libraries.automodel.user_setup:read_setup"}, "transformers"),
    SetupFlag("--recipe", "recipe", "an NeMo Automodel recipe YAML",
              {"automodel": "moebench.libraries.automodel.user_setup:read_setup"}, "automodel"),
    SetupFlag("--torchtitan-args", "torchtitan_args", "the arguments given to torchtitan.train",
              {"torchtitan": "moebench.libraries.torchtitan.user_setup:read_setup"}, "torchtitan", is_path=False),
)
"""Every setup flag, in the order the console prints their notes."""

BY_FLAG = {s.flag: s for s in SETUP_FLAGS}


def given(request) -> dict[str, Any]:
    """flag -> value, for each setup flag the request sets."""
    return {s.flag: getattr(request, s.field) for s in SETUP_FLAGS if getattr(request, s.field, None) is not None}


def readers_of(library: str) -> list[SetupFlag]:
    return [s for s in SETUP_FLAGS if library in s.readers]


def libraries_for(request) -> tuple[str, ...]:
    """The libraries a request runs: --library as given (each setup flag must be read by one of them, else a
    UserError naming the flag), or the libraries the setup flags imply."""
    from moebench.errors import UserError

    flags = given(request)
    if not request.libraries:
        if request.adapter is not None:
            for flag in flags:
                raise UserError(f"is read by {' or '.join(BY_FLAG[flag].readers)}'s rows, not an adapter's; drop "
                                f"{flag} or run --library {BY_FLAG[flag].implies}", flag=flag)
        implied = {flag: BY_FLAG[flag].implies for flag in flags}
        # a flag read by a library another flag implies goes to that library (--recipe with --hf-config: the
        # recipe's model, automodel only), else it brings its own
        return tuple(dict.fromkeys(lib for flag, lib in implied.items()
                                   if not any(other in BY_FLAG[flag].readers for f, other in implied.items()
                                              if f != flag)))
    for flag in flags:
        takers = [n for n in BY_FLAG[flag].readers if n in request.libraries]
        if not takers:
            raise UserError(f"is read by {' or '.join(BY_FLAG[flag].readers)}'s rows; add "
                            f"{' or '.join(BY_FLAG[flag].readers)} to --library or drop {flag}", flag=flag)
    return request.libraries


def read(request, libraries: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(user_configs: library -> its settings, summary_extra) for the setup flags the request sets: each library
    that reads one of them reads them all through its reader, once."""
    flags = given(request)
    user_configs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    if not flags:
        return user_configs, extra
    notes: list[str] = []
    for name in libraries:
        paths = {s.readers[name] for s in readers_of(name) if s.flag in flags}
        if not paths:
            continue
        (path,) = paths  # one reader a library, whichever of its flags are set
        module, _, attr = path.partition(":")
        user_configs[name], more = getattr(importlib.import_module(module), attr)(request)
        notes += [n for n in more if n not in notes]
    shown = {flag: os.path.abspath(v) if BY_FLAG[flag].is_path else v for flag, v in flags.items()}
    extra["setup"] = {"given": shown, "settings": user_configs, "notes": notes}
    if "--ds-config" in flags:  # the record --ds-config has always written (the report reads it)
        taker = next(n for n in libraries if n in BY_FLAG["--ds-config"].readers)
        extra["ds_config"] = {"path": shown["--ds-config"], "settings": user_configs[taker], "notes": notes}
    return user_configs, extra


def rerun_words(request, library: str | None = None) -> list[str]:
    """The setup flags of a row's rerun command (those its library reads; every one given when None)."""
    import shlex

    flags = given(request)
    chosen = readers_of(library) if library is not None else SETUP_FLAGS
    return [f"{s.flag} {shlex.quote(os.path.abspath(flags[s.flag]) if s.is_path else flags[s.flag])}"
            for s in chosen if s.flag in flags]
