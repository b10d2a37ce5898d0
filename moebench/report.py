"""Figures and comparison tables, built from files (never from live objects).

`plot_loss` reads metrics records; `compare` lines measured values up against the chapter's
published figures with the difference shown. Works on results copied from another machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from moebench.published import PublishedFigure


def plot_loss(metrics: list[dict], path: Path, *, title: str = "") -> Path | None:
    """Per-step loss (and aux loss when non-zero) to a PNG; None when there is nothing to plot."""
    if not metrics:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [m["loss"] for m in metrics], label="loss")
    aux = [m.get("aux_loss", 0.0) for m in metrics]
    if any(aux):
        ax.plot(steps, aux, label="aux loss", alpha=0.7)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path


def lookup(measured: dict, dotted_key: str):
    """measured["params"]["total"] for "params.total"; list indices are 1-based ("epoch_loss.5")."""
    value = measured
    for part in dotted_key.split("."):
        if isinstance(value, list):
            idx = int(part) - 1
            value = value[idx] if 0 <= idx < len(value) else None
        elif isinstance(value, dict):
            value = value.get(part)
        else:
            return None
        if value is None:
            return None
    return value


def compare(measured: dict, figures: Iterable[PublishedFigure]) -> list[dict]:
    """One row per published figure: measured, published, difference and ratio (None if not measured)."""
    rows = []
    for fig in figures:
        value = lookup(measured, fig.key)
        diff = None if value is None else value - fig.value
        rows.append({
            "key": fig.key, "label": fig.label, "unit": fig.unit, "section": fig.section,
            "measured": value, "published": fig.value, "difference": diff,
            "ratio": None if value is None or not fig.value else value / fig.value,
        })
    return rows


def format_number(value, unit: str = "") -> str:
    if value is None:
        return "—"
    if unit == "params":
        return f"{value / 1e6:,.3f} M"
    if unit == "%":
        return f"{value:.1f} %"
    return f"{value:.6g}"


def comparison_table(rows: list[dict], title: str):
    """A rich Table of `compare` rows (differences shown, never hidden)."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("figure", "measured", "chapter", "difference", "chapter section"):
        table.add_column(col, justify="right" if col in ("measured", "chapter", "difference") else "left")
    for r in rows:
        diff = r["difference"]
        if diff is None:
            diff_text = "—"
        elif r["unit"] == "%":  # a difference of percentages is in percentage points
            diff_text = f"{diff:+.1f} pp"
        else:
            diff_text = ("+" if diff >= 0 else "") + format_number(diff, r["unit"]) + (
                f" ({100 * (r['ratio'] - 1):+.1f} %)" if r["ratio"] is not None else "")
        table.add_row(r["label"], format_number(r["measured"], r["unit"]),
                      format_number(r["published"], r["unit"]), diff_text, r["section"])
    return table
