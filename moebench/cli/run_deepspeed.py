"""`moebench run deepspeed` (placeholder until its issue lands)."""

import typer


def run_deepspeed() -> None:
    """Placeholder."""
    raise typer.Exit(1)
