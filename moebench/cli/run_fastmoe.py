"""`moebench run fastmoe` (placeholder until its issue lands)."""

import typer


def run_fastmoe() -> None:
    """Placeholder."""
    raise typer.Exit(1)
