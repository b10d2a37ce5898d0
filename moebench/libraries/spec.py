"""The library protocol, whole: a conformance row, its settings, and what an adapter declares.

An adapter verifies one MoE library (or a user's own MoE layer) under expert parallelism against the same
mathematics on one process. It subclasses `Adapter` and declares, as data and plain functions:
- identity: `name`, `import_name`, `dist_name`, `extra`, `catches`;
- `rows(world_size, *, resume=False, user_config=None) -> list[Row]`: the matrix at one world size;
- `runners`: row kind -> the function every rank runs for a row of that kind, `fn(ctx, row, opts)` returning
  comparisons (moebench.parity.compare), each with its `group` set where it is made;
- a row's settings may declare the pieces of the framework it emulates (`Settings.emulated()`, `Emulated`): a
  failure one of them could cause is named `emulated-piece`, a question;
- optional, with defaults: `skip_reason(row)` (asked in the parent, before any rank starts),
  `repro_script(row, seed)`, `preload` (modules imported before the ranks fork; only those the installed
  release has are imported), `timeout_s`, `version()`, `unavailable()`, `install_hint()`, `releases()`,
  `note()`.
Nothing else is read from an adapter: no attribute is probed, no signature inspected. A row's configuration
is data in the row (`kind` picks the runner, `settings` holds the rest), so the console, `--json`, the
report and `--repro` read the same thing. docs/adding-a-library.md walks through an adapter.

Importing this module imports neither torch nor any library.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import math
import re
from typing import TYPE_CHECKING, Any, Callable, Mapping, Union

if TYPE_CHECKING:
    from moebench.distributed.launch import RankContext
    from moebench.parity.compare import Comparison
    from moebench.parity.registry import CheckOptions

PARITY = "parity"
"""Row kind: the expert-parallel model against one process in float32 (outputs, gradients, steps)."""
BF16 = "bf16"
"""Row kind: the same in bf16, judged by the noise model (moebench.parity.noise)."""
RESUME = "resume"
"""Row kind: save, load into a fresh model at the same or another layout, continue; vs the uninterrupted run."""
DEFAULT_CATCHES = "an expert-parallel path whose outputs or gradients differ from one process"
NAME_PATTERN = r"[a-z][a-z0-9_-]*"
"""What an adapter's name (its --library value) may be."""

RankFn = Callable[["RankContext", "Row", "CheckOptions"], "list[Comparison]"]
Runner = Union[RankFn, str]
"""A runner: the function itself, or "package.module:function" (imported on first use, so that importing an
adapter does not import its runners' dependencies)."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a row runs with beyond its labels. Subclass it as a frozen dataclass whose fields are JSON scalars
    (str, int, float, bool or None): each field becomes a field of the row's JSON record, in field order, and the
    runner reads them back as attributes - never from the row's labels or features."""

    def fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def emulated(self) -> tuple["Emulated", ...]:
        """The pieces of the framework this row runs in moebench's code instead of the framework's (override it where
        a row emulates one): recorded in the row's record, and a failure one of them could produce is named
        `emulated-piece` (a question), never the library's bug (moebench.parity.final.on_emulated)."""
        return ()


@dataclasses.dataclass(frozen=True)
class Emulated:
    """A piece of the framework a row emulates (an FSDP reduction the framework's trainer would run, say): what it
    stands for, the check groups its result feeds (moebench.parity.diagnosis.GROUPS) and the diagnoses it could
    produce there if it were not what the framework does (a reduction: a partial sum, a scale, rank-local, noise;
    never a gradient the framework's backward never produced)."""

    piece: str
    groups: tuple[str, ...]
    mechanisms: tuple[str, ...]

    def record(self) -> dict[str, Any]:
        return {"piece": self.piece, "groups": list(self.groups), "mechanisms": list(self.mechanisms)}


NO_SETTINGS = Settings()


LABEL_PATTERN = r"[A-Za-z0-9_.+=,:@%()-]{1,64}"
"""What a row's label (library, model, backend, ep_mode, variant, each feature) may be: one printable word of at
most 64 characters, without "/" (the row key's separator) or a glob's "*?[]" (--row matches keys as globs), so that
keys, the console, file names and the report show it as it is."""
SETTING_MAX_CHARS = 200
"""A settings string's (and a note's) most characters: a row's record is a line of a table, not a document."""


def _text_problem(what: str, value: Any, limit: int) -> str:
    if not isinstance(value, str):
        return f"{what} must be a string, got {type(value).__name__}"
    if len(value) > limit:
        return f"{what} has {len(value)} characters; at most {limit}"
    if not value.isprintable():
        return f"{what} {ascii(value[:40])} has control characters (escape sequences, newlines)"
    return ""


def label_problem(what: str, value: Any) -> str:
    """Why `value` cannot be a row label ("" when it can)."""
    problem = _text_problem(what, value, 64)
    if problem:
        return problem
    if value in (".", "..") or not re.fullmatch(LABEL_PATTERN, value):
        return (f"{what} {ascii(value)} must be one word of letters, digits and _.+=,:@%()- (no '/', no spaces), "
                "at most 64 characters")
    return ""


def settings_problem(settings: Any) -> str:
    """Why `settings` cannot be a row's settings ("" when it can)."""
    if not isinstance(settings, Settings) or not dataclasses.is_dataclass(settings):
        return f"settings must be a moebench.libraries.spec.Settings dataclass, got {type(settings).__name__}"
    if not settings.__dataclass_params__.frozen:
        return f"settings {type(settings).__name__} must be a frozen dataclass"
    for name, value in settings.fields().items():
        if not isinstance(value, (str, int, float, bool, type(None))):
            return f"settings field {name} must be a JSON scalar, got {type(value).__name__}"
        if isinstance(value, float) and not math.isfinite(value):
            return f"settings field {name} must be finite, got {value}"
        if isinstance(value, str):
            problem = _text_problem(f"settings field {name}", value, SETTING_MAX_CHARS)
            if problem:
                return problem
    return ""


VERIFIED = "verified"
"""A release's rows run here and their verdicts are moebench's (passes, or findings named and asserted)."""
REFUSED = "refused"
"""moebench does not run the release's rows (it could not be honest about them): the reason says why."""
SKIPPED = "skipped"
"""The release, or some of its rows, cannot run here (it does not install or import on this torch / CPU, or its own
code needs what this torch lacks): the reason says which and why."""
RELEASE_STATUSES = (VERIFIED, REFUSED, SKIPPED)
MEASURED_TORCH = "2.13.0"
"""The torch every release below was measured on unless its entry says otherwise (CPU build, gloo)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Release:
    """One release, or a range of releases that gave the same, as measured: a line of the compatibility table."""

    versions: str
    """"0.19.8", a range "0.13.1-0.16.0", or "<= 0.14.0"."""
    status: str
    """One of RELEASE_STATUSES."""
    result: str
    """What its rows give (VERIFIED: "passes", or the findings with their upstream numbers), or why not."""
    pinned: bool = False
    """The release moebench/constraints.txt installs."""
    torch: str = MEASURED_TORCH
    """The torch it was measured on."""
    measured_by: str = ""
    """The test that asserts it (a path under tests/; the slow tier for side-installed releases); "" when it was
    measured once by hand."""
    torch_floor: str = ""
    """The torch some of its rows need ("2.14"), where an older one makes them refuse: env-check warns below it."""
    floor_for: str = ""
    """What needs torch_floor, in a few words ("its default spmd_types backend: its trainer's fully_shard")."""

    def __post_init__(self) -> None:
        if self.status not in RELEASE_STATUSES:
            raise ValueError(f"release {self.versions}: status {self.status!r} not in {RELEASE_STATUSES}")

    def line(self) -> str:
        pinned = " (pinned)" if self.pinned else ""
        return f"{self.versions}{pinned}: {self.result}" if self.status == VERIFIED else \
            f"{self.versions}{pinned}: {self.status}, {self.result}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One row of the conformance matrix: what to build and how to run it (picklable; data only)."""

    library: str
    """The adapter's name: "transformers", "fairscale", "deepspeed", ..."""
    model: str
    """The block or model family, e.g. "mixtral", "top2gate", "engine"."""
    backend: str
    """Expert backend or engine setting: "eager", "grouped_mm", "zero1"; "-" when the library has no choice."""
    ep_mode: str
    """How the experts are spread: "all_to_all", "ep=2", "a2a-E=W"; "-" when none."""
    world_size: int
    """Ranks this row runs on."""
    kind: str = PARITY
    """Which of the adapter's runners runs it (PARITY, BF16, RESUME or the adapter's own)."""
    settings: Settings = NO_SETTINGS
    """The row's settings (a frozen Settings dataclass of JSON scalars): its JSON record's extra fields."""
    features: tuple[str, ...] = ()
    """What else the row verifies, for people ("loss-curve", "clip"): shown, never dispatched on."""
    variant: str = ""
    """What tells this row from its siblings with the same model/backend/ep_mode; appended to key()."""
    note: str = ""
    """One line said under the row whatever its verdict: how it ran, where a reader could mistake it (DeepSpeed's
    fp16 rows: its CPU fp16 check overridden, not a GPU run). Its JSON record's "note" when given."""

    def __post_init__(self) -> None:
        labels = [("library", self.library), ("model", self.model), ("backend", self.backend),
                  ("ep_mode", self.ep_mode), *((("variant", self.variant),) if self.variant != "" else ())]
        if not isinstance(self.features, tuple):
            raise TypeError(f"row features must be a tuple of labels, got {type(self.features).__name__}")
        labels += [("feature", f) for f in self.features]
        problem = next(filter(None, (label_problem(what, value) for what, value in labels)), "")
        if not problem and not (isinstance(self.world_size, int) and not isinstance(self.world_size, bool)
                                and self.world_size >= 1):
            problem = f"world_size must be a positive int, got {self.world_size!r}"
        if not problem and not isinstance(self.kind, str):
            problem = f"kind must be a string, got {type(self.kind).__name__}"
        problem = problem or settings_problem(self.settings) or (
            _text_problem("note", self.note, 2 * SETTING_MAX_CHARS) if self.note else "")
        if problem:
            raise TypeError(f"row {ascii(self._key_parts())[1:-1][:120]}: {problem}")

    def _key_parts(self) -> str:
        return "/".join(str(x) for x in (self.library, self.model, self.backend, self.ep_mode, self.world_size))

    def key(self) -> str:
        """The row's stable id, also its parity check's name: library/model/backend/ep_mode/wN[/variant]."""
        base = f"{self.library}/{self.model}/{self.backend}/{self.ep_mode}/w{self.world_size}"
        return f"{base}/{self.variant}" if self.variant else base

    def labels(self, version: str) -> dict[str, Any]:
        """The row's JSON record fields: its labels, then its settings' fields."""
        return {"library": self.library, "version": version, "model": self.model, "backend": self.backend,
                "ep_mode": self.ep_mode, "world_size": self.world_size, "features": tuple(self.features),
                **self.settings.fields(), **({"note": self.note} if self.note else {}),
                **({"emulated": [e.record() for e in self.settings.emulated()]} if self.settings.emulated() else {})}


def install_hint(extra: str) -> str:
    """The one command that installs a library's moebench extra."""
    return f"pip install 'moebench[{extra}]'"


class Adapter:
    """One library under expert parallelism: subclass it (see the module docstring and
    docs/adding-a-library.md). The defaults below serve a library installed as a distribution."""

    name: str = ""
    """The library's name on the command line (--library NAME); NAME_PATTERN."""
    import_name: str = ""
    """The module whose presence means the library is installed."""
    dist_name: str = ""
    """Its distribution on PyPI, for its version (default: import_name)."""
    extra: str = ""
    """The moebench extra that installs it ("" : `pip install <dist_name>`)."""
    catches: str = DEFAULT_CATCHES
    """One line: the defect a failing row of this library points at."""
    runners: Mapping[str, Runner] = {}
    """Row kind -> what every rank runs for a row of that kind: fn(ctx, row, opts) -> comparisons."""
    preload: tuple[str, ...] = ()
    """Modules imported in the parent before a row's ranks fork (those this release has: moebench.preload)."""
    timeout_s: float | None = None
    """Each row's deadline in seconds (None: --timeout)."""

    def rows(self, world_size: int, *, resume: bool = False,
             user_config: Mapping[str, Any] | None = None) -> list[Row]:
        """The rows at `world_size` (none where the library cannot run at it); `resume` adds the resume rows;
        `user_config` (--ds-config for DeepSpeed) replaces the default matrix by the user's settings."""
        raise NotImplementedError(f"{type(self).__name__}.rows")

    def version(self) -> str | None:
        """The installed version (None: not installed); read from the distribution, never by importing."""
        try:
            return importlib.metadata.version(self.dist_name or self.import_name)
        except importlib.metadata.PackageNotFoundError:
            return None

    def install_hint(self) -> str:
        """The one command that installs the library (shown when it is missing)."""
        return install_hint(self.extra) if self.extra else f"pip install {self.dist_name or self.import_name}"

    compatibility: tuple["Release", ...] = ()
    """Every release range of the library as moebench measured it, newest first (moebench.libraries.compatibility
    makes --list's, env-check's and the docs' table from it)."""

    def releases(self) -> str | None:
        """One line on which releases of the library run here and why the others do not, as measured (shown by
        --list); None: nothing said (a built-in adapter declares `compatibility` instead: --list's table)."""
        return None

    def unavailable(self) -> str | None:
        """One line why the library cannot run here, or None (must not import the library)."""
        if importlib.util.find_spec(self.import_name) is None:
            return f"not installed: {self.install_hint()}"
        return None

    def note(self) -> str | None:
        """One line `--list` shows beside a library that runs here: a caveat a user should know (which release of a
        library it builds on its rows run with, and how to get another), or None."""
        return None

    def skip_reason(self, row: Row) -> str | None:
        """One line why `row` cannot run here (asked in the parent, before its ranks start), or None."""
        return None

    def repro_script(self, row: Row, seed: int) -> str | None:
        """The whole source of a standalone script reproducing `row` (libraries/repro), or None."""
        return None

    def runner(self, kind: str) -> RankFn:
        """The function for rows of `kind` (a "module:function" runner imported now)."""
        found = self.runners[kind]
        if isinstance(found, str):
            module, _, attr = found.partition(":")
            found = getattr(importlib.import_module(module), attr)
        return found


def problems(adapter: Any, world_size: int = 2) -> list[str]:
    """What keeps `adapter` from meeting the protocol, checked without running a rank: its type and identity,
    its runners, and its rows at 1 and `world_size` ranks (unique keys, its own name, a runner for every kind).
    Empty: it meets it."""
    if not isinstance(adapter, Adapter):
        return [f"is a {type(adapter).__name__}, not a moebench.libraries.spec.Adapter"]
    out = []
    if not isinstance(adapter.name, str) or not re.fullmatch(NAME_PATTERN, adapter.name):
        out.append(f"name {adapter.name!r} must match {NAME_PATTERN}")
    if not isinstance(adapter.import_name, str) or not adapter.import_name:
        out.append("import_name must name the module that means the library is installed")
    if not isinstance(adapter.runners, Mapping):
        out.append("runners must map each row kind to the function its ranks run")
        return out
    for kind, fn in adapter.runners.items():
        if not (callable(fn) or (isinstance(fn, str) and re.fullmatch(r"[\w.]+:[\w.]+", fn))):
            out.append(f"runners[{kind!r}] must be a function or 'package.module:function'")
    if not isinstance(adapter.preload, tuple) or not all(isinstance(m, str) for m in adapter.preload):
        out.append("preload must be a tuple of module names")
    if adapter.timeout_s is not None and not (isinstance(adapter.timeout_s, (int, float)) and adapter.timeout_s > 0):
        out.append(f"timeout_s must be a positive number of seconds or None, got {adapter.timeout_s!r}")
    for w in (world_size, 1):
        try:
            rows = adapter.rows(w)
        except Exception as exc:  # noqa: BLE001 - the user's code: its error is the finding
            out.append(f"rows({w}) raised {type(exc).__name__}: {exc}")
            continue
        if not isinstance(rows, list) or not all(isinstance(r, Row) for r in rows):
            out.append(f"rows({w}) must return a list of Row")
            continue
        keys = [r.key() for r in rows]
        dupes = sorted({k for k in keys if keys.count(k) > 1})
        if dupes:
            out.append(f"rows({w}) has duplicate keys: {', '.join(dupes[:3])}")
        for r in rows:
            if r.library != adapter.name or r.world_size != w:
                out.append(f"row {r.key()} must have library {adapter.name!r} and world_size {w}")
            elif r.kind not in adapter.runners:
                out.append(f"row {r.key()} is of kind {r.kind!r}, which no runner runs")
    return out
