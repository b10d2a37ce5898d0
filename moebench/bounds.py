"""Bounds of every option, declared once beside its definition and checked before anything runs.

A bound says what a value may be: a number's range (and whether inf / nan are allowed), a name's
length and characters, a path's length and kind, a list's items. The config tree puts one in each
field's metadata (`config.flag(bound=...)`) and checks it in `__post_init__` (the Python API goes
through it too); the CLI parses every typed value through the same bound (`parser`), so a value out
of range is refused while the flags are read, before any folder, process or tensor exists:

    error: --timeout: must be at most 604800 (7 days: the longest deadline moebench sets), got 1e+10

A refusal names the flag as the user typed it (`-n` or `--world-size`), the bound and the reason.
`accepts(bound, text)` answers "would this text be refused?" for the generated hostile tests.

This module imports no torch and no Typer.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Callable

from moebench.errors import UserError

WEEK_S = 7 * 24 * 3600.0
"""The longest deadline moebench sets (every --timeout): a hang is caught within a week at worst."""
PATH_MAX_BYTES = 4096
"""Linux PATH_MAX: a longer path fails in the OS with errno 36 (File name too long)."""
NAME_MAX_BYTES = 255
"""Linux NAME_MAX: the longest single folder or file name."""
NAME_MAX_CHARS = 64
"""A preset, check or kind name: short words; a longer one is a mistake, not a name."""
LIST_MAX_ITEMS = 256
"""Most items a comma list (sweep values, check names) takes: each item is a run or a check."""
TEXT_MAX_CHARS = 512
"""Any other free text (an --impl target)."""

_argv: list[str] = []
"""The command line as typed (set by the root command): which spelling of a flag was used."""


def remember_argv(args: list[str]) -> None:
    _argv[:] = [str(a) for a in args]


def typed_flag(names: tuple[str, ...] | list[str]) -> str:
    """The flag as the user typed it: `--world-size`, or `-n/--world-size` when the short form was typed."""
    longs = [n for n in names if n.startswith("--")]
    long = (longs or list(names) or ["?"])[0]
    for token in _argv:
        for name in names:
            if token == name or (name.startswith("--") and token.startswith(name + "=")):
                return name if name == long else f"{name}/{long}"
    return long


def _shown(value: float) -> str:
    """A number as a refusal quotes it: whole, or compact when huge (1e+23, not 23 digits)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    if isinstance(value, int) and abs(value) >= 10**16:
        return f"{value:.3g}"
    return f"{value:g}" if isinstance(value, float) else str(value)


# --------------------------------------------------------------------------- the kinds of bound


@dataclasses.dataclass(frozen=True, kw_only=True)
class Number:
    """An int or float option: min <= value <= max (min exclusive when `above` is set)."""

    integer: bool
    """Only whole numbers (`1.5` and `1e3` are refused for an int)."""
    min: float
    """Smallest value allowed (0 here declares that 0 is accepted)."""
    max: float | None
    """Largest value allowed; None only with `why` saying why none is needed."""
    above: bool = False
    """min is exclusive: the value must be > min (a positive float)."""
    allow_inf: bool = False
    """inf is a valid value (no option allows it today)."""
    allow_nan: bool = False
    """nan is a valid value (no option allows it today)."""
    why: str = ""
    """Where the maximum comes from: printed in the refusal."""
    refusal: str = ""
    """The refusal of a value out of range, when a plain "must be from a to b" would say too little
    ("{value}" is replaced by the value)."""
    kind = "number"

    def __post_init__(self) -> None:
        if self.max is None and not self.why:
            raise ValueError("a Number bound with no maximum must say why")

    def parse(self, text: str) -> int | float:
        """The value of `text`, or ValueError with the reason."""
        text = text.strip()
        if self.integer:
            try:
                return int(text)
            except ValueError:
                raise ValueError(f"must be a whole number, got {text!r}") from None
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"must be a number, got {text!r}") from None

    def problem(self, value: Any) -> str:
        """Why `value` is out of bounds ("" when it is in)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a {'whole number' if self.integer else 'number'}, got {value!r}"
        if self.integer and not isinstance(value, int):
            return f"must be a whole number, got {value!r}"
        if isinstance(value, float):
            if math.isnan(value):
                return "" if self.allow_nan else "must be finite, got nan"
            if math.isinf(value) and not self.allow_inf:
                return f"must be finite, got {value}"
        low = _shown(self.min)
        high = "" if self.max is None else _shown(self.max)
        out_of_range = (value <= self.min if self.above else value < self.min) or (
            self.max is not None and value > self.max)
        if out_of_range and self.refusal:
            return self.refusal.format(value=_shown(value))
        span = f"from {low} to {high}" if high else f"at least {low}"
        if self.above and not value > self.min:
            return f"must be > {low}{f' and <= {high}' if high else ''}, got {_shown(value)}"
        if not self.above and value < self.min:
            return f"must be {span}, got {_shown(value)}"
        if self.max is not None and value > self.max:
            why = f" ({self.why})" if self.why else ""
            return f"must be at most {high}{why}, got {_shown(value)}"
        return ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Text:
    """Free text with a format checked later (an --impl KEY=module:attr): bounded, one line."""

    max_chars: int = TEXT_MAX_CHARS
    pattern: str = r"[^\x00-\x1f\x7f]+"
    """Characters allowed (no control characters, no newline)."""
    what: str = "value"
    hint: str = ""
    """What `pattern` allows, in words (said in the refusal when given)."""
    kind = "text"

    def parse(self, text: str) -> str:
        return text

    def problem(self, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            return f"must be a {self.what}, got {value!r}"
        if len(value) > self.max_chars:
            return f"must be at most {self.max_chars} characters, got {len(value)}"
        if not re.fullmatch(self.pattern, value):
            return f"{value[:40]!r} is not a {self.what}" + (f" ({self.hint})" if self.hint else "")
        return ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Name(Text):
    """A short name (a preset, a kind, a time stamp): non-empty, bounded length, plain characters."""

    max_chars: int = NAME_MAX_CHARS
    """Longest name accepted."""
    pattern: str = r"[A-Za-z0-9][A-Za-z0-9_.-]*"
    """Characters allowed (no '/', no spaces, no control characters)."""
    choices: Callable[[], list[str]] | None = None
    """The names that exist, when they are known before the command runs (else any name)."""
    what: str = "name"
    """What the name is, for the refusal."""
    listed_by: str = ""
    """The command that lists the choices, named instead of a long list of them."""
    hint: str = "letters, digits, '_', '.', '-'"
    kind = "name"

    def problem(self, value: Any) -> str:
        found = super().problem(value)
        if found or self.choices is None:
            return found
        known = self.choices()
        if value in known:
            return ""
        choices = ", ".join(known) or "none"
        if self.listed_by and len(choices) > 40:
            return f"unknown {self.what} {value!r}; `{self.listed_by}` lists them"
        return f"unknown {self.what} {value!r}; use one of {choices}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Path:
    """A file or folder path: non-empty, one line, within the OS's length limits, of the right kind."""

    folder: bool
    """A folder (results root, a run) rather than a file."""
    must_exist: bool = False
    """It has to exist already (a file to read, a run to report)."""
    writable: bool = False
    """moebench writes under it: its first existing part must be a writable folder."""
    kind = "path"

    def parse(self, text: str) -> str:
        return text

    def problem(self, value: Any) -> str:
        if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
            return "is empty; pass a path"
        text = str(value)
        if any(ord(c) < 32 or ord(c) == 127 for c in text):
            return f"{text[:40]!r} holds a control character (a newline?)"
        encoded = os.fsencode(text)
        if len(encoded) > PATH_MAX_BYTES:
            return f"is {len(encoded)} bytes long; a path is at most {PATH_MAX_BYTES} (PATH_MAX)"
        longest = max((len(part) for part in encoded.split(b"/")), default=0)
        if longest > NAME_MAX_BYTES:
            return f"has a {longest}-byte name; a name is at most {NAME_MAX_BYTES} bytes (NAME_MAX)"
        target = os.path.abspath(text)
        if os.path.exists(target):
            if self.folder and not os.path.isdir(target):
                return f"{text} is not a folder; pass a folder"
            if not self.folder and os.path.isdir(target):
                return f"{text} is a folder; pass a file"
        elif self.must_exist:
            return f"{text} does not exist"
        folder = target
        while not os.path.exists(folder) and folder != os.path.dirname(folder):
            folder = os.path.dirname(folder)
        if folder != target and not os.path.isdir(folder):
            return f"cannot exist: {folder} is a file"
        if self.writable:
            if not os.access(folder, os.W_OK | os.X_OK):
                return f"cannot create {text}: {folder} is not writable; pass a writable folder"
        return ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Items:
    """A comma list ("4,16,64"): each item within `item`, at least one, at most `max_items`, no repeats."""

    item: Number | Name
    """The bound of each item."""
    max_items: int = LIST_MAX_ITEMS
    example: str
    """One valid item (documentation, and the hostile tests' duplicate)."""
    keywords: tuple[str, ...] = ()
    """Whole values that are not lists ("none")."""
    unique: bool = True
    """An item given twice is refused (False where a repeat means something: 8,8 = two layers of 8)."""
    kind = "list"

    def parse(self, text: str) -> str:
        return text

    def values(self, text: str) -> list:
        return [self.item.parse(part) for part in str(text).split(",")]

    def problem(self, value: Any) -> str:
        if isinstance(value, (list, tuple)):
            parts = [str(v) for v in value]
        elif isinstance(value, (str, int)) and not isinstance(value, bool):
            if str(value).strip().lower() in self.keywords:
                return ""
            parts = str(value).split(",")
        else:
            return f"must be a comma list like {self.example}, got {value!r}"
        parts = [p.strip() for p in parts]
        if not any(parts):
            return f"is empty; give a comma list like {self.example}"
        if len(parts) > self.max_items:
            return f"has {len(parts)} items; at most {self.max_items}"
        seen: set = set()
        for part in parts:
            if not part:
                return f"has an empty item in {','.join(parts)[:60]!r}"
            try:
                item = self.item.parse(part)
            except ValueError as exc:
                return f"{exc}; give a comma list like {self.example}"
            reason = self.item.problem(item)
            if reason:
                return reason if isinstance(self.item, Name) else f"{reason} (in a comma list like {self.example})"
            key = item.lower() if isinstance(item, str) else item
            if self.unique and key in seen:
                return f"gives {part} twice; give each once"
            seen.add(key)
        return ""


Bound = Number | Name | Text | Path | Items


# --------------------------------------------------------------------------- checking


def check(bound: Bound, value: Any, flag: str) -> Any:
    """`value` (a Python value, or text to parse) if it is within `bound`, else UserError naming `flag`."""
    if isinstance(value, str) and not isinstance(bound, (Name, Text, Path, Items)):
        try:
            value = bound.parse(value)
        except ValueError as exc:
            raise UserError(str(exc), flag=flag) from None
    reason = bound.problem(value)
    if reason:
        raise UserError(reason, flag=flag)
    return value


def accepts(bound: Bound, text: str) -> bool:
    """Would `text`, typed for an option with this bound, get past it?"""
    try:
        check(bound, text, "--x")
    except UserError:
        return False
    return True


def check_fields(obj: Any) -> None:
    """Every field of config dataclass `obj` whose metadata declares a bound: within it (None passes
    for an optional field)."""
    for f in dataclasses.fields(obj):
        bound = f.metadata.get("bound")
        value = getattr(obj, f.name)
        if bound is None or value is None:
            continue
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        check(bound, value, flag)


_spellings: dict[str, tuple[str, ...]] = {}
"""Every spelling of each bounded option, by its long name (filled as the options are defined)."""


def as_typed(flag: str | None) -> str | None:
    """`flag` (a long name a refusal names) as the user typed it: `-n/--world-size` after `-n 3`."""
    return typed_flag(_spellings[flag]) if flag in _spellings else flag


@dataclasses.dataclass(frozen=True)
class Parser:
    """The CLI side of a bound: Typer's `parser=` for one option, naming the spelling typed."""

    bound: Bound
    names: tuple[str, ...]

    def __post_init__(self) -> None:
        longs = [n for n in self.names if n.startswith("--")]
        if longs:
            _spellings.setdefault(longs[0], self.names)

    def __call__(self, value: Any) -> Any:
        return check(self.bound, value, typed_flag(self.names))
