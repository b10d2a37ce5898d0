"""`moebench bench` output: plain-text tables at most 80 columns wide, and the plots."""

from __future__ import annotations

import os
from pathlib import Path

from moebench.report.figures import pyplot, save_figure


def format_table(result: dict) -> str:
    """Plain text, at most 80 columns."""
    lines = [f"{'layer':<19}{'E':>4}{'T':>6}{'k':>2}{'tok/s':>8}{'GFLOP/s':>8}{'xideal':>7}{'xdense':>7}"
             f"{'xDS1':>6}{'spr%':>5}{'MB':>6}"]
    for r in result["rows"]:
        head = f"{r['layer']:<19}{r['experts']:>4}{r['tokens']:>6}{r['top_k']:>2}"
        if r.get("skipped"):
            lines += wrapped(f"{head}  skipped: {r['skipped'].removeprefix('RuntimeError: ')}")
            continue
        lines.append(f"{head}{r['tokens_per_s']:>8.0f}{r['gflops']:>8.1f}{_num(r['vs_ideal'], 7)}"
                     f"{_num(r['vs_dense'], 7)}{_num(r['vs_deepspeed_cf1'], 6)}{spread_text(r, 5)}"
                     f"{_num(r['peak_rss_mb'], 6, 0)}")
    for b in result["breakdown"]:
        p = b["point"]
        s = b["share"]
        lines += wrapped(f"ref E={p['experts']} T={p['tokens']} k={p['top_k']}: "
                         f"non-GEMM {100 * b['outside_gemm']:.0f}% gate {100 * s['gate_topk']:.0f}"
                         f" sort {100 * s['sort_dispatch']:.0f}"
                         f" comb {100 * s['combine']:.0f} gelu {100 * s['activation']:.0f}"
                         f" other {100 * s['other']:.0f}")
    lines.append(f"threads {result['threads']}, torch {result['torch']}, MB: peak resident memory of a call")
    return "\n".join(lines)


def plot(result: dict, out_dir: os.PathLike) -> list[str]:
    """tokens/s vs experts and vs tokens, one line per layer (the other axes at their first value)."""
    plt = pyplot()
    rows = [r for r in result["rows"] if not r.get("skipped")]
    written = []
    if not rows:
        return written
    for axis, fixed in (("experts", "tokens"), ("tokens", "experts")):
        first = rows[0]
        fig, ax = plt.subplots(figsize=(6, 4))
        for layer in dict.fromkeys(r["layer"] for r in rows):
            pts = sorted((r[axis], r["tokens_per_s"]) for r in rows if r["layer"] == layer
                         and r[fixed] == first[fixed] and r["top_k"] == first["top_k"])
            if pts:
                ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=layer)
        _plain_log2_ticks(ax, sorted({r[axis] for r in rows}))
        ax.set_xlabel(axis)
        ax.set_ylabel("tokens/s (fwd+bwd)")
        ax.set_title(f"{fixed}={first[fixed]}, k={first['top_k']}, d={first['d_model']}/{first['d_hidden']}")
        ax.legend(fontsize=7)
        written.append(str(save_figure(fig, Path(out_dir) / f"tokens_per_s_vs_{axis}.png")))
    return written


def _plain_log2_ticks(ax, values: list[int]) -> None:
    """A log-2 axis labelled with the swept values themselves (4, 16, 64), not 2^2, 2^4, 2^6."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(values, [str(v) for v in values])
    ax.minorticks_off()


WIDTH = 80
"""bench's plain-text tables are laid out for 80 columns."""


def wrapped(line: str, indent: str = "    ") -> list[str]:
    """`line` in lines of at most WIDTH, broken between words (a number is never cut)."""
    import textwrap

    return textwrap.wrap(line, WIDTH, subsequent_indent=indent, break_long_words=False,
                         break_on_hyphens=False) or [""]


def spread_text(r: dict, width: int) -> str:
    """(max - min) / median in %, or "—" where one timing cannot show a spread (one repeat; rows
    written before `repeats` was recorded: min == max)."""
    if r.get("repeats", 2 if r["max_s"] != r["min_s"] else 1) < 2:
        return f"{'—':>{width}}"
    return f"{100 * (r['max_s'] - r['min_s']) / r['time_s']:>{width}.0f}"


def _num(v, width: int, digits: int = 2) -> str:
    return f"{v:>{width}.{digits}f}" if v is not None else f"{'-':>{width}}"


def format_expert_parallel(rows: list[dict]) -> str:
    """One line per (world size, point, layer); '*' marks an oversubscribed point."""
    lines = ["expert parallel (tokens per rank; tok/s of all ranks; * = oversubscribed)",
             f"{'layer':<17}{'W':>2}{'E':>4}{'T':>6}{'k':>2}{'tok/s':>8}{'xW=1':>6}{'comm%':>6}"
             f"{'nonGEMM%':>9}{'spread%':>8}{'MB':>6}"]
    for r in rows:
        head = f"{r['layer']:<17}{r['world_size']:>2}{r['experts']:>4}{r['tokens']:>6}{r['top_k']:>2}"
        if r.get("skipped"):
            lines += wrapped(f"{head}  skipped: {r['skipped']}")
            continue
        comm = 100 * r["comm_share"] if "comm_share" in r else None
        outside = 100 * r["outside_gemm"] if "outside_gemm" in r else None
        lines.append(f"{head}{r['tokens_per_s']:>8.0f}{_num(r['vs_world_1'], 6)}{_num(comm, 6, 0)}"
                     f"{_num(outside, 9, 0)}{spread_text(r, 8)}{_num(r.get('peak_rss_mb'), 6, 0)}"
                     f"{' *' if r['oversubscribed'] else ''}")
    return "\n".join(lines)


def format_comm(rows: list[dict]) -> str:
    lines = ["all-to-all alone (bytes leaving each rank / time; * = oversubscribed)",
             f"{'backend':<8}{'W':>3}{'MB/rank':>9}{'ms':>9}{'GB/s':>8}{'spread%':>8}"]
    for r in rows:
        lines.append(f"{r['backend']:<8}{r['world_size']:>3}{r['bytes_per_rank'] / 2**20:>9.1f}"
                     f"{1000 * r['time_s']:>9.2f}{r['bytes_per_s'] / 1e9:>8.2f}{spread_text(r, 8)}"
                     f"{' *' if r['oversubscribed'] else ''}")
    return "\n".join(lines)


def _work(amount: float, unit: str) -> str:
    if unit == "flop":
        return f"{amount / 1e9:.1f} GFLOP" if amount >= 1e8 else f"{amount / 1e6:.1f} MFLOP"
    return f"{amount / 2**20:.1f} MiB" if amount >= 2**19 else f"{amount / 2**10:.1f} KiB"


def format_train(result: dict) -> str:
    rates = result["rates"]
    lines = wrapped(f"training step, phase by phase (bounds: GEMM {rates['gemm_flop_per_s'] / 1e9:.0f} GFLOP/s, "
                    f"memory {rates['memory_bytes_per_s'] / 1e9:.1f} GB/s)")
    for v in result["variants"]:
        lines += wrapped(f"{v['variant']} --preset {v['preset']}: {v['trainable_params'] / 1e6:.1f} M trainable "
                         f"parameters, {v['tokens_per_step']} tokens, step {1000 * v['step_s']:.0f} ms")
        lines += wrapped(f"  optimizer: {v['optimizer']}")
        lines.append(f"  {'phase':<10}{'ms':>9}{'share':>7}{'work':>15}{'bound ms':>10}{'x bound':>9}")
        for p in v["phases"]:
            lines.append(f"  {p['phase']:<10}{1000 * p['time_s']:>9.1f}{100 * p['share']:>6.0f}%"
                         f"{_work(p['work'], p['unit']):>15}{1000 * p['bound_s']:>10.1f}{_num(p['x_bound'], 9, 1)}")
    return "\n".join(lines)


def plot_expert_parallel(rows: list[dict], out_dir: os.PathLike) -> list[str]:
    """tokens/s (all ranks) against the world size, one line per layer and expert count."""
    plt = pyplot()
    done = [r for r in rows if not r.get("skipped")]
    if not done:
        return []
    first = done[0]
    fig, ax = plt.subplots(figsize=(6, 4))
    for layer in dict.fromkeys(r["layer"] for r in done):
        for experts in sorted({r["experts"] for r in done}):
            pts = sorted((r["world_size"], r["tokens_per_s"], r["oversubscribed"]) for r in done
                         if r["layer"] == layer and r["experts"] == experts and r["tokens"] == first["tokens"]
                         and r["top_k"] == first["top_k"])
            if not pts:
                continue
            (line,) = ax.plot([w for w, _, _ in pts], [t for _, t, _ in pts], marker="o", label=f"{layer} E={experts}")
            over = [(w, t) for w, t, o in pts if o]
            if over:
                ax.scatter(*zip(*over), s=120, facecolors="none", edgecolors=line.get_color())
    _plain_log2_ticks(ax, sorted({r["world_size"] for r in done}))
    ax.set_xlabel("ranks (world size); open ring: oversubscribed")
    ax.set_ylabel("tokens/s, all ranks (fwd+bwd)")
    ax.set_title(f"expert parallel: T={first['tokens']}/rank, k={first['top_k']}, "
                 f"d={first['d_model']}/{first['d_hidden']}")
    ax.legend(fontsize=7)
    return [str(save_figure(fig, Path(out_dir) / "tokens_per_s_vs_world_size.png"))]
