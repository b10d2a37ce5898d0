"""`moebench verify-parity` (placeholder until issue 4 lands)."""

import typer

app = typer.Typer(help="Multi-rank parity checks against single-process references.")


@app.callback(invoke_without_command=True)
def verify_parity() -> None:
    """Run the parity checks."""
    raise typer.Exit(1)
