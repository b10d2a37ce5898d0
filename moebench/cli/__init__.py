"""Thin Typer front-ends: parse flags, build a config, call one core function, map errors to exit codes."""
