"""Help text as wide as the terminal, and command lists that do not cut a sentence."""

from __future__ import annotations

from typer.core import TyperGroup

HELP_MAX_WIDTH = 1_000
"""click caps help text at 80 columns (its max_content_width); above that the terminal's width (or
$COLUMNS) decides, so this only lifts the cap."""
CONTEXT_SETTINGS = {"max_content_width": HELP_MAX_WIDTH}


class WholeSentenceGroup(TyperGroup):
    """A command group whose list of commands shows each command's first sentence whole, wrapped to the
    terminal (click cuts it to fit one line, mid-sentence, with "...")."""

    def format_commands(self, ctx, formatter) -> None:
        rows = [(name, cmd.get_short_help_str(limit=HELP_MAX_WIDTH)) for name in self.list_commands(ctx)
                if (cmd := self.get_command(ctx, name)) is not None and not cmd.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)
