"""Is a run the chapter's experiment? One answer, one wording, for `run`'s closing lines, its
summary.json and `report`'s verdicts (a run that is not says so once, and how to get one that is)."""

from __future__ import annotations

import json
from typing import Any

CHAPTER_PRESET = "chapter"
NAMED_DEVIATIONS = 2
"""The one-line note names this many differing settings (the report's variant section lists all):
enough to show why, short enough for one line at 80 columns."""

IGNORED_FOR_CHAPTER = {
    ("moe", "moe_impl"): "which implementation computes the layer is what a run compares, not its experiment",
    ("moe", "ep_size"): "expert parallelism changes where experts live, not the model (parity-checked)",
    ("train", "seed"): "another seed is another draw of the same experiment",
    ("engine", "compiled_ops"): "the compiled and torch ops compute the same update",
}
"""Config fields in which a run may differ from the chapter preset and still be the chapter's
experiment; every other field (and every launch field, ignored) must equal the preset's."""


def chapter_config(kind: str) -> dict:
    """The chapter preset's validated config, in config.json's shape: the preset's values, not
    resolved for this machine or launcher (a torchrun rank of 3 judging its run must not fail on
    the chapter's 32 experts; the placement it would resolve is ignored anyway)."""
    from moebench import config, variants

    variant = variants.by_name(kind)
    return config.as_dict(config.resolve(variant.config_cls, variant.name, CHAPTER_PRESET, {}))


def deviations(config: dict | None, chapter: dict) -> list[str]:
    """How a config (config.json's shape) differs from the chapter preset's, as "field value (chapter value)"."""
    if config is None:
        return ["config.json is missing"]
    out = []
    for section, fields in chapter.items():
        if section in ("launch", "schema", "kind", "preset", "description") or not isinstance(fields, dict):
            continue
        mine = config.get(section) or {}
        for name, want in fields.items():
            if (section, name) in IGNORED_FOR_CHAPTER:
                continue
            got = mine.get(name)
            if got != want:
                out.append(f"{name} {_short(got)} (chapter {_short(want)})")
    return out


def _short(value: Any) -> str:
    if value is None:
        return "unset"
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


HOW = "for a comparable run: "


def not_comparable(kind: str, preset: str | None, differs: list[str]) -> str:
    """The one line saying a run is not the chapter's experiment, why, and how to make one that is."""
    named = ", ".join(differs[:NAMED_DEVIATIONS])
    more = len(differs) - NAMED_DEVIATIONS
    return (f"not comparable with chapter 6: preset {preset or '?'} differs ({named}"
            + (f", +{more} more" if more > 0 else "") + f"); {HOW}moebench run {kind} --preset {CHAPTER_PRESET}")


def note_lines(note: str) -> list[str]:
    """A `not_comparable` note as the console shows it: why, then the command on its own line (a
    command folded at the terminal's width could not be copied)."""
    why, sep, how = note.partition("; " + HOW)
    return [why, HOW + how] if sep else [note]
