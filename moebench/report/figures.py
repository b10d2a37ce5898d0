"""The report's figures, from results files: PNGs written atomically, None when there is nothing to draw.

The chapter's published values are drawn as hollow marks labelled "chapter (published)", never as a
measured line.
"""

from __future__ import annotations

import math
from pathlib import Path

from moebench.report import numbers
from moebench.report.numbers import finite, real

COLORS = {"measured": "#1f77b4", "chapter": "#d62728", "eval": "#2ca02c", "aux": "#9467bd", "drop": "#ff7f0e"}
PARAM_CATEGORIES = ("total", "moe", "attention", "norm")
"""The categories the chapter counts (params.json by_category keys; total first)."""
TOLERANCE_FLOOR = 1e-9
"""A difference of exactly 0 is drawn at this fraction of its tolerance (a log axis has no 0)."""


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    """Lay out, write atomically and close (bench's plots use it too)."""
    plt = pyplot()
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    try:
        fig.savefig(tmp, dpi=100)
        tmp.replace(path)  # atomic: a reader never sees half a PNG
    except BaseException:  # a full disk: no half PNG left behind filling it
        tmp.unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    return path


def _integer_steps(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_loss(metrics: list[dict], path: Path, *, title: str = "", steps_per_epoch: int | None = None,
              eval_loss: float | None = None, aux_coef: float | None = None,
              chapter_marks: list[tuple[float, float, str]] = ()) -> Path | None:
    """Per-step training loss (MSE), with epoch boundaries, the held-out eval loss, the chapter's
    published values (hollow marks at (step, value, label)) and the aux loss on its own axis."""
    if not metrics:
        return None
    plt = pyplot()
    eval_loss, aux_coef = real(eval_loss), real(aux_coef)
    steps = [m["step"] for m in metrics]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    ax.plot(steps, [m["loss"] for m in metrics], color=COLORS["measured"], lw=1.4, label="training loss (measured)")
    last = steps[-1]
    xlabel = "optimizer step"
    if steps_per_epoch and last > steps_per_epoch:
        for boundary in range(steps_per_epoch, last, steps_per_epoch):
            ax.axvline(boundary + 0.5, color="grey", ls=":", lw=0.8)
        # Named under the axis, where no mark's label inside the axes can cover it.
        xlabel += f" (dotted: epoch boundaries, every {steps_per_epoch} steps)"
        # The measured epoch means: what the chapter's per-epoch marks compare with.
        for i, start in enumerate(range(0, len(metrics), steps_per_epoch)):
            chunk = metrics[start:start + steps_per_epoch]
            mean = sum(m["loss"] for m in chunk) / len(chunk)
            ax.hlines(mean, chunk[0]["step"] - 0.5, chunk[-1]["step"] + 0.5, color="black", lw=1.6,
                      label="epoch mean (measured)" if i == 0 else None, zorder=3)
    if eval_loss is not None:
        ax.plot([last], [eval_loss], marker="D", color=COLORS["eval"], ls="none",
                label=f"eval loss, held-out batch ({numbers.text(eval_loss, '.3f')})")
    for i, (step, value, label) in enumerate(chapter_marks):
        ax.plot([step], [value], marker="o", mfc="none", mec=COLORS["chapter"], mew=1.8, ms=9, ls="none",
                label="chapter (published)" if i == 0 else None)
        right = step > 0.6 * last  # near the right edge the label goes left of its mark, inside the axes
        ax.annotate(label, (step, value), textcoords="offset points", xytext=(-8 if right else 8, -14), fontsize=8,
                    color=COLORS["chapter"], ha="right" if right else "left", zorder=5,
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85})
    ax.set_xlabel(xlabel)
    ax.set_ylabel("MSE loss")
    _integer_steps(ax)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    aux = [real(m.get("aux_loss")) or 0.0 for m in metrics]  # NaN stays NaN: a gap in the line
    if any(aux):
        ax2 = ax.twinx()  # its own axis: DeepSpeed's raw l_aux (~2) would dwarf the MSE
        ax2.plot(steps, aux, color=COLORS["aux"], lw=0.7, alpha=0.45)
        ax.set_zorder(ax2.get_zorder() + 1)  # the loss, its marks and the legend above the aux line
        ax.patch.set_visible(False)
        coef = f" (× {aux_coef:g} in the objective)" if aux_coef is not None else ""
        ax2.set_ylabel(f"aux loss, raw{coef}", color=COLORS["aux"])
        ax2.tick_params(axis="y", colors=COLORS["aux"])
        handles.append(plt.Line2D([], [], color=COLORS["aux"]))
        labels.append("aux (balance) loss, right axis")
    ax.legend(handles, labels, fontsize=8, loc="upper right", framealpha=1.0)
    ax.margins(y=0.12)  # room for the marks' labels inside the axes
    ax.set_title(title, fontsize=11)
    return save_figure(fig, path)


def plot_params(by_category: dict, published: dict, path: Path, *, title: str) -> Path | None:
    """Parameter counts per category, measured beside the chapter's (log scale: 273 M next to 4 k)."""
    by_category = {c: finite(v) for c, v in by_category.items() if finite(v) is not None}
    published = {c: v for c, v in published.items() if finite(v) is not None}
    cats = [c for c in PARAM_CATEGORIES if c in by_category]
    if not cats:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(cats) + 1.6))
    ys = range(len(cats))
    height = 0.38 if published else 0.6
    measured = [by_category[c] for c in cats]
    ax.barh([y - (height / 2 if published else 0) for y in ys], measured, height, color=COLORS["measured"],
            label="measured")
    for y, value in zip(ys, measured):
        ax.text(value, y - (height / 2 if published else 0), f" {value:,}", va="center", fontsize=8)
    if published:
        pub_y = [y + height / 2 for y, c in zip(ys, cats) if c in published]
        pub_v = [published[c] for c in cats if c in published]
        ax.barh(pub_y, pub_v, height, color="none", edgecolor=COLORS["chapter"], hatch="//",
                label="chapter (published)")
        for y, value in zip(pub_y, pub_v):
            ax.text(value, y, f" ≈ {value / 1e6:g} M", va="center", fontsize=8, color=COLORS["chapter"])
    ax.set_yticks(list(ys), cats)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(right=max([1, *measured, *published.values()]) * 20)
    ax.set_xlabel("parameters (log scale)")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title, fontsize=11)
    return save_figure(fig, path)


def plot_expert_load(metrics: list[dict], path: Path, *, title: str) -> Path | None:
    """Tokens per expert over training, a heatmap per MoE layer (share of the layer's kept routes),
    and the fraction of routes dropped at capacity per step."""
    rows = [m for m in metrics if isinstance(m.get("tokens_per_expert"), list)]
    if not rows:
        return None
    layers = len(rows[0]["tokens_per_expert"])
    drops = [(m["step"], finite(m.get("dropped_route_frac"))) for m in metrics
             if finite(m.get("dropped_route_frac")) is not None]
    if not any(f for _, f in drops):  # a gate without capacity (naive): the text says 0 %, no empty panel
        drops = []
    plt = pyplot()
    n_axes = layers + (1 if drops else 0)
    fig, axes = plt.subplots(n_axes, 1, figsize=(8, 2.4 * layers + (1.8 if drops else 0) + 0.6), squeeze=False,
                             gridspec_kw={"height_ratios": [3] * layers + ([1.6] if drops else [])})
    steps = [m["step"] for m in rows]
    shares = [[[(c[e] / sum(c) if c and sum(c) else 0.0) for e in range(len(c or []))]
               for c in (m["tokens_per_expert"][layer] for m in rows)] for layer in range(layers)]
    vmax = max((v for layer in shares for step in layer for v in step), default=1.0) or 1.0  # one scale for all
    for layer in range(layers):
        ax = axes[layer][0]
        counts = [m["tokens_per_expert"][layer] or [] for m in rows]
        experts = max((len(c) for c in counts), default=0)
        if not experts:
            ax.set_axis_off()
            continue
        grid = [[(c[e] / sum(c) if c and sum(c) else 0.0) for c in counts] for e in range(experts)]
        image = ax.imshow(grid, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest",
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, experts - 0.5), vmin=0.0, vmax=vmax)
        ax.set_ylabel(f"layer {layer}\nexpert")
        fig.colorbar(image, ax=ax, label="share of kept routes", pad=0.01)
        _integer_steps(ax)
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("optimizer step" if layer == layers - 1 and not drops else "")
    if drops:
        ax = axes[layers][0]
        ax.plot([s for s, _ in drops], [100 * f for _, f in drops], color=COLORS["drop"], lw=1.2)
        ax.set_ylabel("dropped at\ncapacity (%)")
        ax.set_xlabel("optimizer step")
        ax.set_ylim(bottom=0, top=max(1.0, 110 * max(f for _, f in drops)))
        ax.set_xlim(steps[0] - 0.5, steps[-1] + 0.5)
        _integer_steps(ax)
        ax.grid(alpha=0.3)
    axes[0][0].set_title(title, fontsize=11)
    return save_figure(fig, path)


def tolerance_ratio(comparison: dict) -> float | None:
    """Largest difference over its tolerance (allclose: atol + rtol x the largest expected value); NaN when a
    number it needs is NaN (the files write it "nan": numbers.real), None when one is missing."""
    diff, atol, rtol = (real(comparison.get(key)) for key in ("max_abs_diff", "atol", "rtol"))
    if diff is None or atol is None or rtol is None:
        return None
    allowed = atol + rtol * abs(real(comparison.get("magnitude")) or 0.0)
    if math.isnan(diff) or math.isnan(allowed):
        return math.nan
    if math.isinf(diff):
        return math.inf
    return diff / allowed if allowed > 0 else (0.0 if diff == 0 else math.inf)


CLOSENESS_KINDS = ("allclose", "equal")
"""Comparisons with a tolerance to be under; "differ" (must NOT match) and "raises" have none."""


def check_ratio(check: dict) -> float | None:
    """The largest share of its allowance over a check's judged comparisons: a tolerance's (closeness
    comparisons) or the noise model's (`used`); None when it has neither (assertions only, or nothing ran);
    NaN when any of them is NaN (a NaN is larger than nothing and smaller than nothing: the check's share is
    not a number, shown as non-finite, never as a pass)."""
    comparisons = [c for c in check.get("comparisons") or [] if isinstance(c, dict)]
    ratios = [r for r in (tolerance_ratio(c) for c in comparisons
                          if c.get("kind", "allclose") in CLOSENESS_KINDS) if r is not None]
    ratios += [used for used in (real(c.get("used")) for c in comparisons) if used is not None]
    if any(math.isnan(r) for r in ratios):
        return math.nan
    return max(ratios) if ratios else None


def by_noise_model(check: dict) -> bool:
    """Whether the check is judged by the noise model (low precision, moebench.parity.noise)."""
    return any(real(c.get("used")) is not None for c in check.get("comparisons") or [] if isinstance(c, dict))


def ratio_text(ratio: float | None, *, missing: str = "—") -> str:
    """A check's share of its allowance in a table: "exact" (0), "non-finite (nan)", "inf", or 1.2e-03."""
    if ratio is None:
        return missing
    if ratio == 0:
        return "exact"
    if math.isnan(ratio):
        return NONFINITE_RATIO
    return "inf" if math.isinf(ratio) else f"{ratio:.2e}"


NONFINITE_RATIO = "non-finite (nan)"
"""A ratio that is NaN (a difference, a tolerance or a noise-model ratio recorded as NaN): no bar, this text."""


BAR_CAP = 1e3
"""Where a ratio bar stops (1000 x the tolerance): beyond it only the label's number grows."""


def _ratio_bars(rows: list[tuple[str, float | None, str]], *, size: tuple[float, float], with_status: bool,
                notes: list[str] | None = None):
    """One horizontal bar per (label, largest |difference| / allowance, status) on a log axis, pass in the
    measured colour and anything else in the chapter's; a row without a ratio (skipped, refused, assertions
    only) gets no bar, only its note at the left, so every row is on the figure. A NaN ratio gets no bar either:
    "non-finite (nan)" and its status at the left, in the chapter's colour whatever its status (a NaN is never
    drawn as a pass); an infinite one a bar to BAR_CAP labelled inf, never in the pass colour. Returns (fig, ax)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=size)
    notes = notes or [""] * len(rows)
    # a bar ends at BAR_CAP at most, so its label (the true ratio) stays inside the axis
    values = [None if r is None or math.isnan(r) else min(max(r, TOLERANCE_FLOOR), BAR_CAP) for _, r, _ in rows]
    colors = [COLORS["measured"] if status == "pass" and r is not None and math.isfinite(r) else COLORS["chapter"]
              for _, r, status in rows]
    for y, ((_, ratio, status), value, color, note) in enumerate(zip(rows, values, colors, notes)):
        if ratio is not None and math.isnan(ratio):  # a NaN difference or ratio: said, in the failing colour
            ax.text(TOLERANCE_FLOOR / 10, y, f" {NONFINITE_RATIO}: {status}" + (f" ({note})" if note else ""),
                    va="center", fontsize=8, color=COLORS["chapter"])
            continue
        if value is None:  # nothing with an allowance was compared: its status (and why), in grey
            ax.text(TOLERANCE_FLOOR / 10, y, f" {status}" + (f": {note}" if note else ""), va="center",
                    fontsize=8, color="#555555" if status in ("skip", "refused", "pass") else color)
            continue
        ax.barh(y, value, color=color, left=TOLERANCE_FLOOR / 10)
        # inf: a difference over a zero tolerance (an exact comparison), or an infinite difference
        text = "exact (0)" if ratio == 0 else "inf" if not math.isfinite(ratio) else f"{ratio:.1e}"
        text = f" {text} {status}" if with_status else f" {text}"
        ax.text(value, y, text + (f" ({note})" if note else ""), va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [name for name, _, _ in rows], fontsize=8 if with_status else None)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # first row on top
    ax.set_xscale("log")
    ax.set_xlabel("largest |difference| / allowance (log scale; below 1 passes)")
    return fig, ax


def _why_no_bar(status: str, reason: str) -> str:
    """The note of a row without a bar: why nothing with an allowance was compared."""
    if status in ("skip", "refused"):
        first = reason.splitlines()[0] if reason else ""
        return first.removeprefix(f"{status}: ")[:60]  # a diagnosis starts with its name: said once
    return "assertions only, no tolerance"


def plot_parity(checks: list[dict], path: Path, *, title: str) -> Path | None:
    """Every check: its largest difference over its tolerance, log scale (1 is the tolerance); a check
    with nothing to draw a bar for is listed with its status and why."""
    if not checks:
        return None
    rows = [(c["name"], check_ratio(c), c.get("status") or "") for c in checks]
    notes = ["" if ratio is not None else _why_no_bar(status, c.get("reason") or "")
             for c, (_, ratio, status) in zip(checks, rows)]
    fig, ax = _ratio_bars(rows, size=(9, 0.38 * len(rows) + 1.5), with_status=False, notes=notes)
    ax.axvline(1.0, color=COLORS["chapter"], ls="--", lw=1)
    ax.text(1.0, 0.02, " tolerance", color=COLORS["chapter"], fontsize=8, va="bottom",
            transform=ax.get_xaxis_transform())
    ax.set_xlim(TOLERANCE_FLOOR / 10, 1e4)
    ax.set_title(title, fontsize=11)
    return save_figure(fig, path)


def plot_library(rows: list[dict], checks: list[dict], path: Path, *, title: str) -> Path | None:
    """Every conformance row (its check, by name): the largest difference over its allowance, log scale,
    coloured by the row's verdict; low-precision rows are judged by the noise model (their distance over the
    allowed multiple of the one-process baseline's) and say so; skipped and refused rows are listed without
    a bar, with their reason."""
    from matplotlib.patches import Patch

    if not rows:
        return None
    by_name = {c["name"]: c for c in checks}
    drawn, notes = [], []
    for r in rows:
        check = by_name.get(r.get("check"), {})
        ratio = check_ratio(check)
        verdict = str(r.get("verdict") or "?")
        drawn.append((r.get("check") or r.get("key") or "?", ratio, verdict))
        notes.append(("noise model" if by_noise_model(check) else "") if ratio is not None
                     else _why_no_bar(verdict, r.get("diagnosis") or check.get("reason") or ""))
    fig, ax = _ratio_bars(drawn, size=(11, 0.3 * len(drawn) + 1.6), with_status=True, notes=notes)
    line = ax.axvline(1.0, color=COLORS["chapter"], ls="--", lw=1, label="allowance")
    ax.legend(handles=[line, Patch(color=COLORS["measured"], label="pass"),
                       Patch(color=COLORS["chapter"], label="fail")], fontsize=8,
              loc="lower left", bbox_to_anchor=(1.0, 0.0))  # beside the axis: never over a row's label
    ax.set_xlim(TOLERANCE_FLOOR / 10, 1e6)  # room for a failing row's label
    ax.set_title(title, fontsize=10)
    return save_figure(fig, path)


def plot_overlay(runs: list[tuple[str, list[dict]]], path: Path, *, title: str) -> Path | None:
    """Loss curves of several runs of one kind on one axis."""
    runs = [(label, metrics) for label, metrics in runs if metrics]
    if len(runs) < 2:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for label, metrics in runs:
        ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], lw=1.2, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("MSE loss")
    _integer_steps(ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=11)
    return save_figure(fig, path)
