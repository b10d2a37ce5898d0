"""The docs say what the CLI does (issue 18, item 5): every `--flag` README.md and docs/**/*.md name
exists on the command they name it for (read from the click command objects that `--help` prints,
no process started), the choices a doc lists are the flag's, and the numbers the docs quote for
defaults are the presets' and the config's."""

from __future__ import annotations

import enum
import functools
import json
import re
import types
import typing
from pathlib import Path

import pytest
import typer

# typer >= 0.29 vendors click (as moebench/cli/app.py notes): its command objects are these
import typer._click as click

from moebench import config as config_tree
from moebench import variants
from moebench.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(p for p in (ROOT / "docs").rglob("*.md") if "findings" not in p.relative_to(ROOT / "docs").parts)
"""Every doc but docs/findings/: those are upstream reports, whose flags are their scripts', never moebench's."""
LIBRARY_PAGES = ("README.md", "fairscale.md", "transformers.md", "deepspeed.md", "autoep.md", "automodel.md",
                 "torchtitan.md", "megatron.md")
DOC_COMMAND = {"run-fastmoe.md": "run fastmoe", "run-deepspeed.md": "run deepspeed",
               "verify-parity.md": "verify-parity", "env-check.md": "env-check", "report.md": "report",
               "bench.md": "bench", "gpu.md": "gpu-check",
               **{f"libraries/{page}": "verify-parity" for page in LIBRARY_PAGES}}
"""The command a doc is about (keyed by its path under docs/, so docs/libraries/README.md is not the repository's
README.md): a flag it names with no command before it is that command's."""


def doc_key(path: Path) -> str:
    """A doc's name in DOC_COMMAND and in messages: its path under docs/ (the repository's README.md: README.md)."""
    docs = ROOT / "docs"
    return path.relative_to(docs).as_posix() if path.is_relative_to(docs) else path.relative_to(ROOT).as_posix()
COMMANDS = ("env-check", "verify-parity", "report", "bench", "runs", "gpu-check", "run fastmoe", "run deepspeed",
            "run")
OTHER_PROGRAMS = ("make", "pip", "torchrun", "deepspeed", "python", "python3", "pytest", "nvcc", "git", "apt-get",
                  "script", "ss", "export", "ruff", "sudo", "docker", "srun", "uv", ".venv/bin/pip")
"""A code span that starts with one of these is that program's command line (its flags are not
moebench's), up to a `moebench <command>` inside it."""

FLAG = re.compile(r"(?<![\w/-])(--(?:\[no-\])?[A-Za-z][\w-]*)(?![\w.])((?:[ =])[a-z0-9]+(?:\|[a-z0-9]+)+)?")
"""A long flag, with an `a|b|c` list of choices after it if the doc gives one. A dotted option
(`--training.max_norm`) is another program's (torchtitan's), never moebench's."""
QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
"""A quoted argument (`--torchtitan-args '--module qwen3 ...'`): a value handed on, not moebench's flags."""
COMMAND_AT = re.compile(r"(?:(?:^|(?<=[\s(]))(?:python -m |\.venv/bin/)?moebench\s+(?:--debug\s+)?|^)"
                        r"(env-check|verify-parity|report|bench|runs|gpu-check|run\s+(?:fastmoe|deepspeed|<variant>)|run)"
                        r"(?![\w-])")
PLACEHOLDERS = {"--flag"}
"""Not a flag: how a doc writes "the flag at fault" (`error: --flag: ...`)."""


@functools.cache
def commands() -> dict[str, click.Command]:
    root = typer.main.get_command(app)
    ctx = click.Context(root)
    out: dict[str, click.Command] = {"": root}
    for name in root.list_commands(ctx):
        cmd = root.get_command(ctx, name)
        out[name] = cmd
        if hasattr(cmd, "list_commands"):  # a group: `run`
            for sub in cmd.list_commands(click.Context(cmd)):
                out[f"{name} {sub}"] = cmd.get_command(click.Context(cmd), sub)
    return out


@functools.cache
def options(command: str, hidden: bool = False) -> dict:
    """--flag -> its option, as `moebench <command> --help` lists it (hidden aliases only if asked)."""
    out = {}
    for param in commands()[command].params:
        if param.param_type_name == "option" and (hidden or not param.hidden):
            for name in (*param.opts, *param.secondary_opts):
                out[name] = param
    if not hidden:
        out["--help"] = None
    return out


def choices(option) -> tuple[str, ...]:
    """The values an option accepts when it is a choice (a Literal or an Enum), else ()."""
    annotation = option.type_descriptor.annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is typing.Literal:
        return tuple(str(a) for a in typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return tuple(str(e.value) for e in annotation)
    return ()


def _expand(flag: str) -> list[str]:
    return [flag.replace("[no-]", ""), flag.replace("[no-]", "no-")] if "[no-]" in flag else [flag]


def _spans(text: str) -> list[tuple[int, str]]:
    """(line number, code) for every inline code span and every line of a fenced block."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            out.append((number, line.strip().lstrip("$ ")))
        else:  # in a table cell a choice list's | is escaped
            out += [(number, m.group(1).replace("\\|", "|")) for m in re.finditer(r"`([^`]+)`", line)]
    return out


def mentions(path: Path) -> list[tuple[str, int, str, str | None, str, bool]]:
    """(doc, line, flag, command or None for "any command", listed choices, named as an old spelling)
    for each flag the doc names."""
    text = path.read_text()
    lines = text.splitlines()
    default = DOC_COMMAND.get(doc_key(path))
    found = []
    for number, code in _spans(text):
        words = code.split()
        if not words:
            continue
        pieces: list[tuple[str | None, str]] = []  # (command, text)
        starts = list(COMMAND_AT.finditer(code))
        if starts:
            for i, m in enumerate(starts):
                end = starts[i + 1].start() if i + 1 < len(starts) else len(code)
                pieces.append((re.sub(r"\s+", " ", m.group(1)), code[m.end():end]))
        elif words[0] in OTHER_PROGRAMS or "=" in words[0] or words[0].endswith(".py"):
            continue  # another program's command line (or a make variable, a script)
        else:
            pieces.append((default, code))
        for command, whole in pieces:
            # a shell list (`a && pip install --no-deps x`): another program's part is not ours to check
            piece = " ".join(p for p in re.split(r"&&|\|\||;", QUOTED.sub("", whole))
                             if not p.split() or p.split()[0] not in OTHER_PROGRAMS)
            for m in FLAG.finditer(piece):
                for flag in _expand(m.group(1)):
                    if flag not in PLACEHOLDERS:
                        old = "old spelling" in lines[number - 1]  # a hidden alias, named as such
                        found.append((doc_key(path), number, flag, command, (m.group(2) or "").strip(" ="), old))
    return found


ALL_DOCS = [ROOT / "README.md", *DOCS]


def _owner(command: str | None) -> list[str]:
    """The commands that must have a flag: the one named (`run <variant>`: every variant), or any."""
    if command == "run <variant>":
        return [f"run {v.name}" for v in variants.VARIANTS]
    return [command] if command else list(commands())


@pytest.mark.parametrize("doc", ALL_DOCS, ids=doc_key)
def test_every_flag_a_doc_names_exists_on_its_command(doc):
    wrong = []
    for name, line, flag, command, _, old in mentions(doc):
        owners = _owner(command)
        has = [flag in options(c, hidden=old) for c in owners]
        if not (all(has) if command == "run <variant>" else any(has)):
            wrong.append(f"{name}:{line}: {flag} is not a flag of `moebench {command or '<any command>'}`")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("doc", ALL_DOCS, ids=doc_key)
def test_the_choices_a_doc_lists_are_the_flags(doc):
    wrong = []
    for name, line, flag, command, listed, _ in mentions(doc):
        if not listed:
            continue
        for c in _owner(command):
            option = options(c).get(flag)
            if option is not None and choices(option):
                if set(listed.split("|")) != {c.lower() for c in choices(option)}:  # case-insensitive (README)
                    wrong.append(f"{name}:{line}: {flag} {listed}, but its choices are {'|'.join(choices(option))}")
                break
    assert not wrong, "\n".join(wrong)


def _readme_run_table() -> list[tuple[list[str], str, str, str]]:
    """README's `moebench run <variant>` table: (flags, fastmoe cell, deepspeed cell, meaning)."""
    rows, inside = [], False
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("| flag | fastmoe | deepspeed |"):
            inside = True
            continue
        if inside and not line.startswith("|"):
            break
        if inside and not line.startswith("|---"):
            cells = [c.strip() for c in line.replace("\\|", "/").strip("|").split("|")]
            flag_cell = cells[0]
            flags = [f for m in FLAG.finditer(flag_cell) for f in _expand(m.group(1))]
            rows.append((flags, cells[-3], cells[-2], cells[-1]))
    assert rows, "README's run flag table was not found"
    return rows


def test_readme_run_table_marks_each_flag_on_the_variants_that_have_it():
    wrong = []
    for flags, fastmoe, deepspeed, meaning in _readme_run_table():
        for variant, cell in (("fastmoe", fastmoe), ("deepspeed", deepspeed)):
            has = cell.startswith("✓") or cell in ("quick", "chapter")
            for flag in flags:
                if has != (flag in options(f"run {variant}")):
                    wrong.append(f"{flag}: README says {'✓' if has else '—'} for {variant}")
        also = re.search(r"also on `([\w-]+)`", meaning)
        if also:
            wrong += [f"{flag}: README says it is also on {also.group(1)}" for flag in flags
                      if flag not in options(also.group(1))]
        if "on every command" in meaning:
            for flag in re.findall(r"`(--[\w-]+)`[^`]*on every command", meaning):
                wrong += [f"{flag}: README says every command has it; {c} has not" for c in commands()
                          if c not in ("", "run") and flag not in options(c)]
    assert not wrong, "\n".join(wrong)


def test_readme_names_each_variants_default_preset():
    (row,) = [r for r in _readme_run_table() if "--preset" in r[0]]
    for variant, cell in (("fastmoe", row[1]), ("deepspeed", row[2])):
        assert cell == variants.by_name(variant).default_preset, f"README: {variant} defaults to {cell}"


def _preset(variant: str, name: str) -> dict:
    return json.loads((ROOT / "experiments" / variant / f"{name}.json").read_text())


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def test_deepspeed_chapter_defaults_quoted_in_its_doc_are_the_presets():
    doc = (ROOT / "docs" / "run-deepspeed.md").read_text()
    block = doc.split("Chapter defaults (preset `chapter`):", 1)[1].split("\n\n", 1)[0]
    p = _preset("deepspeed", "chapter")
    m, moe, t = p["model"], p["moe"], p["train"]
    quoted = {
        r"hidden size (\d+)": m["d_model"], r"expert hidden size (\d+)": moe["d_hidden"], r"(\d+) heads": m["heads"],
        r"(\d+) MoE layers": m["layers"], r"layers of (\d+) experts": moe["experts"][0],
        r"top-(\d+) gating": moe["top_k"], r"capacity factor ([\d.]+)": moe["capacity_factor"],
        r"minimum capacity (\d+)": moe["min_capacity"], r"(\d+) epochs": t["epochs"], r"batch (\d+)": t["batch_size"],
        r"sequence (\d+)": t["seq_len"], r"lr ([\d.e-]+)": t["lr"], r"([\d,]+) random sequences": t["samples"],
        r"one epoch is (\d+) steps": t["samples"] // t["batch_size"],
    }
    for pattern, value in quoted.items():
        found = re.search(pattern, block)
        assert found, f"run-deepspeed.md no longer says {pattern!r}"
        assert _number(found.group(1)) == value, f"run-deepspeed.md: {found.group(0)!r}, the preset has {value}"
    assert "per rank" not in block, "--batch-size is the global batch (README), not per rank"


SEED_RANGE = re.compile(r"0 ?(?:\.\.|to) ?2(?:\*\*|\^)(\d+) ?- ?1")
"""How the docs write a seed range: 0..2**63-1, 0 to 2^63-1."""


def test_the_seed_range_the_docs_quote_is_the_enforced_one():
    """Every doc that gives --seed a range gives the one config.require_seed enforces."""
    quoted = []
    for doc in ALL_DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            if "seed" in line:
                quoted += [(doc_key(doc), number, int(m.group(1))) for m in SEED_RANGE.finditer(line)]
    assert any(name == "verify-parity.md" for name, _, _ in quoted), "verify-parity.md no longer gives the range"
    wrong = [f"{name}:{number}: 0..2**{power}-1" for name, number, power in quoted
             if 2**power != config_tree.SEED_LIMIT]
    assert not wrong, f"seeds range over 0..{config_tree.SEED_LIMIT - 1}: " + "; ".join(wrong)


def test_run_fastmoe_doc_names_the_comm_backend_config_json_records():
    """config.json records the backend resolved for the device (gloo on CPU) even for one process;
    the doc once said `none` there."""
    variant = variants.by_name("fastmoe")
    resolved = variants.resolve_config(variant, "quick", {("launch", "device"): "cpu"}).launch.comm_backend
    text = (ROOT / "docs" / "run-fastmoe.md").read_text()
    bullet = text.split("- `config.json`:", 1)[1].split("\n- ", 1)[0]
    said = re.search(r"`comm_backend`: `(\w+)`", bullet)
    assert said and said.group(1) == resolved, f"run-fastmoe.md: config.json's comm_backend is {resolved!r}"
    assert "`comm none`" not in text


@pytest.mark.parametrize("doc", ALL_DOCS, ids=doc_key)
def test_no_table_is_cut_by_a_blank_line(doc):
    """A blank line inside a table ends it: the rows after it render as a paragraph of pipes."""
    lines = doc.read_text().splitlines()
    cut = [i + 1 for i in range(1, len(lines) - 1)
           if not lines[i].strip() and lines[i - 1].startswith("|") and lines[i + 1].startswith("|")
           and lines[i - 1].count("|") == lines[i + 1].count("|")]
    assert not cut, f"{doc_key(doc)}: table cut by a blank line at line(s) {cut}"


def _record_keys(variant: str) -> set[str]:
    """Every key a variant's config.json and summary.json can hold (the schemas and the config tree)."""
    schema = json.loads((ROOT / "moebench" / "schemas" / "summary.schema.json").read_text())
    keys = set(schema["properties"])
    for block in schema["allOf"]:
        keys |= set(block.get("then", {}).get("properties", {}))
    cls = variants.by_name(variant).config_cls
    for spec in config_tree.leaves(cls):
        keys |= set(spec.path)
    return keys


@pytest.mark.parametrize("variant", ["fastmoe", "deepspeed"])
def test_the_record_fields_a_run_doc_names_exist(variant):
    """A run doc's sentences about config.json / summary.json name fields those files have."""
    doc = ROOT / "docs" / f"run-{variant}.md"
    keys = _record_keys(variant) | {"kind", "schema", "preset", "description"}
    wrong = []
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if "config.json" not in line and "summary.json" not in line:
            continue
        for name in re.findall(r"`([a-z]+(?:_[a-z]+)+|backend|device)`", line):
            if name not in keys:
                wrong.append(f"{doc.name}:{number}: `{name}` is no field of config.json or summary.json")
    assert not wrong, "\n".join(wrong)


LEAF_COMMANDS = [c for c in ("env-check", "verify-parity", "report", "bench", "runs", "gpu-check", "run fastmoe",
                             "run deepspeed")]
BARE_TYPES = re.compile(r"<str>|<(?:int|float) range>")
"""Typer's placeholders for an option without a metavar: they say nothing about the value."""


def _help(command: str) -> str:
    from typer.testing import CliRunner

    out = CliRunner().invoke(app, [*command.split(), "--help"], terminal_width=80, env={"COLUMNS": "80"})
    assert out.exit_code == 0, out.output
    return out.output


@pytest.mark.parametrize("command", LEAF_COMMANDS)
def test_every_option_says_what_it_takes(command):
    text = _help(command)
    assert not BARE_TYPES.search(text), f"moebench {command} --help: {BARE_TYPES.findall(text)}"
    silent = [p.opts[0] for p in commands()[command].params
              if p.param_type_name == "option" and not p.hidden and not (p.help or "").strip()]
    assert not silent, f"moebench {command}: no help for {silent}"


def test_tolerance_lists_its_choices():
    from moebench.parity.compare import TOLERANCE_MODES

    option = options("verify-parity")["--tolerance"]
    assert option.metavar == "|".join(TOLERANCE_MODES), option.metavar


def test_bench_layer_kinds_is_not_runs_layers():
    """`run --layers N` counts Transformer blocks; bench's list of layer kinds has its own name
    (the old spelling still works, hidden)."""
    bench = options("bench")
    assert "--layer-kinds" in bench and "--ep-layer-kinds" in bench and "--layers" not in bench
    assert "--layers" in options("bench", hidden=True)
    assert "--layers" in options("run fastmoe") and "Transformer blocks" in options("run fastmoe")["--layers"].help


def _examples(command: str) -> list[str]:
    """The example command lines of a command's help (a trailing backslash continues a line)."""
    epilog = commands()[command].epilog or ""
    assert epilog.startswith("Examples:"), f"moebench {command} --help has no examples"
    lines, pending = [], ""
    for line in epilog.splitlines():
        line = pending + line.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1]
            continue
        if line.startswith("moebench "):
            lines.append(line)
    assert lines, epilog
    return lines


@pytest.mark.parametrize("command", LEAF_COMMANDS)
def test_every_command_has_examples_that_parse(command, tmp_path, monkeypatch):
    import shlex

    cmd = commands()[command]
    monkeypatch.chdir(tmp_path)  # run folders an example names exist here (RUN is checked while parsing)
    for example in _examples(command):
        code = re.split(r"\s{2,}", example)[0].split(" > ")[0]  # without its description or a redirect
        words = shlex.split(code)
        for word in words:
            if word.startswith("results/"):
                (tmp_path / word).mkdir(parents=True, exist_ok=True)
        assert " ".join(words[1:]).startswith(command), example
        cmd.make_context(command, words[1 + len(command.split()):])  # a bad flag or value raises
    examples = _help(command).split("Examples:", 1)[1].splitlines()
    wide = [line for line in examples if len(line) > 80]
    assert not wide, f"moebench {command} --help: examples wider than 80 columns: {wide}"


def test_run_fastmoe_deadlines_quoted_are_the_configs():
    """run-fastmoe.md: "max(1800, steps x weights x 6e-7) seconds: 1800 s for the quick preset, 4.5
    hours for the chapter preset's 100 steps, ... 1000 steps of the chapter model get 45 hours"."""
    from moebench.variants.fastmoe import config as fastmoe_config

    text = " ".join((ROOT / "docs" / "run-fastmoe.md").read_text().split())
    formula = re.search(r"max\((\d+), steps x weights x ([\d.e-]+)\) seconds: (\d+) s for the quick preset, "
                        r"([\d.]+) hours for the chapter preset's (\d+) steps", text)
    assert formula, "run-fastmoe.md no longer states the deadline formula"
    floor, rate, quick_s, chapter_h, chapter_steps = formula.groups()
    assert float(floor) == fastmoe_config.HANG_DEADLINE_FLOOR_S
    assert float(rate) == fastmoe_config.DEADLINE_S_PER_WEIGHT_STEP
    variant = variants.by_name("fastmoe")
    quick = variants.resolve_config(variant, "quick", {})
    chapter = variants.resolve_config(variant, "chapter", {})
    assert quick.default_timeout_s == float(quick_s)
    assert chapter.train.total_steps == int(chapter_steps)
    assert round(chapter.default_timeout_s / 3600, 1) == float(chapter_h)
    longer = re.search(r"(\d+) steps of the chapter model get (\d+) hours", text)
    assert longer, "run-fastmoe.md no longer gives the longer run's deadline"
    steps, hours = map(int, longer.groups())
    long_run = variants.resolve_config(variant, "chapter", {("train", "steps"): steps})
    assert round(long_run.default_timeout_s / 3600) == hours
