"""Help text as wide as the terminal, command lists that do not cut a sentence, and options grouped in panels."""

from __future__ import annotations

import re

from typer.core import TyperCommand, TyperGroup

HELP_MAX_WIDTH = 1_000
"""click caps help text at 80 columns (its max_content_width); above that the terminal's width (or
$COLUMNS) decides, so this only lifts the cap."""
CONTEXT_SETTINGS = {"max_content_width": HELP_MAX_WIDTH}

OUTPUT = "Output and limits"
"""The panel of the options every command shares (--json, --results-dir, --help, ...), printed last."""
LISTS = ("A list-valued flag takes comma-separated values (a,b) and may also be repeated (--flag a --flag b); "
         "both mean the same.")
"""The one convention of every list-valued flag, said at the end of each help that has one."""
_PAREN_DEFAULT = re.compile(r"\[default: \((.*?)\)\]", re.S)


class WholeSentenceGroup(TyperGroup):
    """A command group whose list of commands shows each command's first sentence whole, wrapped to the
    terminal (click cuts it to fit one line, mid-sentence, with "...")."""

    def format_commands(self, ctx, formatter) -> None:
        rows = [(name, cmd.get_short_help_str(limit=HELP_MAX_WIDTH)) for name in self.list_commands(ctx)
                if (cmd := self.get_command(ctx, name)) is not None and not cmd.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


class PanelCommand(TyperCommand):
    """A command whose options are listed in panels, by what the reader is doing (each option's
    `rich_help_panel`, in the order the panels first appear; options without one go to OUTPUT), in plain
    click text: it wraps at any width, as the rest of moebench's help does. Every default reads
    `[default: X]` (click puts a default given as text in parentheses, a computed one not)."""

    def parse_args(self, ctx, args):
        return super().parse_args(ctx, join_repeated(args, _comma_lists(self)))

    def format_options(self, ctx, formatter) -> None:
        panels: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            name, text = record
            if param.param_type_name == "argument":  # its name, without typer's "<str>": the help says what it takes
                name = name.split(" ")[0]
            panel = "Arguments" if param.param_type_name == "argument" else (
                getattr(param, "rich_help_panel", None) or OUTPUT)
            panels.setdefault(panel, []).append((name, _PAREN_DEFAULT.sub(r"[default: \1]", text)))
        if OUTPUT in panels:  # the shared options close the list, whatever order they were declared in
            panels[OUTPUT if len(panels) > 1 else "Options"] = panels.pop(OUTPUT)  # no panels: click's one list
        for panel, records in panels.items():
            with formatter.section(panel):
                formatter.write_dl(records)


def _comma_lists(command) -> dict[str, str]:
    """Every spelling of the command's single-valued comma-list options (bound by moebench.bounds.Items) -> the
    option's first long spelling."""
    from moebench.bounds import Items

    out = {}
    for param in command.params:
        parser = getattr(getattr(param, "type_descriptor", None), "parameter_info", None)
        bound = getattr(getattr(parser, "parser", None), "bound", None)
        if param.param_type_name == "option" and not param.multiple and isinstance(bound, Items):
            for name in param.opts:
                out[name] = param.opts[0]
    return out


def join_repeated(args: list[str], lists: dict[str, str]) -> list[str]:
    """`--experts 4 --experts 8` as `--experts 4,8` (the list convention, LISTS): click would keep the last value
    of an option given twice. Spellings of one option (-n, --world-size) join too; `--` ends the options."""
    values: dict[str, list[str]] = {}
    kept: list[str | tuple[str]] = []  # a tuple marks where a joined option's value goes
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            kept += args[i:]
            break
        name, eq, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if name in lists and (eq or i + 1 < len(args)):
            if not eq:
                value, i = args[i + 1], i + 1
            owner = lists[name]
            if owner not in values:
                kept.append((owner,))
            values.setdefault(owner, []).append(value)
        else:
            kept.append(arg)
        i += 1
    out: list[str] = []
    for item in kept:
        if isinstance(item, tuple):
            out += [item[0], ",".join(values[item[0]])]
        else:
            out.append(item)
    return out
