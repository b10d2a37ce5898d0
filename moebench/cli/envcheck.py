"""`moebench env-check` (placeholder until issue 2 lands)."""

import typer

app = typer.Typer(help="Probe torch / CUDA / NCCL / gloo / DeepSpeed / fastmoe and say how to fix what is wrong.")


@app.callback(invoke_without_command=True)
def env_check() -> None:
    """Probe the environment."""
    raise typer.Exit(1)
