"""The layer-speed section: the latest `moebench bench` sweep and `--train` breakdown (any date: a layer's speed does
not depend on this session's runs)."""

from __future__ import annotations

from pathlib import Path

from moebench.report import collect
from moebench.report.numbers import real, text
from moebench.report.render import Block, Figure, Heading, Para, Table


def blocks(sweep: collect.Run | None, train: collect.Run | None, out: Path) -> list[Block]:
    """The latest `moebench bench` layer sweep and the latest `--train` breakdown (any date: a
    layer's speed does not depend on this session's runs)."""
    if sweep is None and train is None:
        return []
    blocks: list[Block] = [Heading("Layer speed (moebench bench)")]
    if sweep is not None:
        blocks += _bench_sweep_blocks(sweep, out)
    if train is not None:
        blocks += _bench_train_blocks(train)
    return blocks


def _timing_words(rows: list[dict]) -> str:
    """What a bench row's time is: a median of interleaved repeats, or one timing (no spread)."""
    counts = {r.get("repeats") for r in rows if not r.get("skipped")}
    if counts == {1}:
        return "one timing per layer and point (a single repeat: no median, and no spread can be measured)"
    if len(counts) == 1 and None not in counts:
        return f"median of {counts.pop()} interleaved repeats"
    return "median of interleaved repeats"


def _bench_sweep_blocks(run: collect.Run, out: Path) -> list[Block]:
    if run.damage:
        return [Para(f"Not shown: {run.not_ok_reason()}.")]
    summary = run.summary
    blocks: list[Block] = [Para(f"bench {run.run_id} (started {summary.get('started_at', '?')}, status {run.status}, "
                                f"{summary.get('threads', '?')} threads): forward + backward of one MoE layer, "
                                f"{_timing_words(summary.get('rows') or [])}; ratios measured in the same "
                                "process.")]
    rows = []
    for r in summary.get("rows") or []:
        point = (r.get("layer", "?"), str(r.get("experts")), str(r.get("tokens")), str(r.get("top_k")))
        if r.get("skipped"):
            rows.append((*point, "skipped", "", "", "", str(r["skipped"])[:80]))
            continue
        rows.append((*point, _fmt(r.get("tokens_per_s"), ",.0f"), _fmt(r.get("gflops"), ".1f"),
                     _fmt(r.get("vs_ideal"), ".2f"), _fmt(r.get("vs_deepspeed_cf1"), ".2f"), ""))
    if rows:
        blocks.append(Table(headers=("layer", "experts", "tokens", "k", "tokens/s", "GFLOP/s", "× ideal",
                                     "× DeepSpeed cf 1", "note"), rows=tuple(rows)))
    parallel = [r for r in summary.get("expert_parallel") or [] if not r.get("skipped")]
    if parallel:
        blocks.append(Para("Expert parallel: tokens per rank, tokens/s of all ranks; `*` marks an oversubscribed "
                           "point (more rank threads than cores)."))
        blocks.append(Table(headers=("layer", "ranks", "experts", "tokens/rank", "k", "tokens/s", "× 1 rank",
                                     "comm share"),
                            rows=tuple((r["layer"], f"{r['world_size']}{' *' if r.get('oversubscribed') else ''}",
                                        str(r["experts"]), str(r["tokens"]), str(r["top_k"]),
                                        _fmt(r.get("tokens_per_s"), ",.0f"), _fmt(r.get("vs_world_1"), ".2f"),
                                        _fmt(r.get("comm_share"), ".0%")) for r in parallel)))
    for png in sorted(run.path.glob("*.png")):
        copy = out / f"bench-{png.name}"
        copy.write_bytes(png.read_bytes())
        blocks.append(Figure(copy, f"bench {run.run_id}: {png.stem.replace('_', ' ')}"))
    return blocks


def _bench_train_blocks(run: collect.Run) -> list[Block]:
    if run.damage:
        return []  # said once, by the sweep's blocks (the same newest run)
    train = run.summary.get("train") or {}
    rates = train.get("rates") or {}
    blocks: list[Block] = [Para(
        f"bench {run.run_id} (`--train`, status {run.status}): one training step of each preset, phase by phase. "
        f"Bounds: matmul FLOPs at {_fmt(_scaled(rates.get('gemm_flop_per_s'), 1e-9), '.0f')} GFLOP/s, bytes at "
        f"{_fmt(_scaled(rates.get('memory_bytes_per_s'), 1e-9), '.1f')} GB/s (both measured here); "
        "× bound = time / bound.")]
    rows = []
    for v in train.get("variants") or []:
        for p in v.get("phases") or []:
            rows.append((f"{v['variant']} ({v['preset']})", p["phase"], _fmt(_scaled(p.get("time_s"), 1000), ".1f"),
                         _fmt(p.get("share"), ".0%"), _fmt(_scaled(p.get("bound_s"), 1000), ".1f"),
                         _fmt(p.get("x_bound"), ".1f")))
    if rows:
        blocks.append(Table(headers=("preset", "phase", "ms", "share", "bound ms", "× bound"), rows=tuple(rows)))
    return blocks


def latest(root: Path, section: str) -> collect.Run | None:
    """The newest bench run whose summary has `section` (a sweep's rows, or --train's breakdown)."""
    run = collect.latest(root, "bench", prefer=lambda r: bool(r.summary.get(section)))
    return run if run is not None and (run.damage or run.summary.get(section)) else None




def _fmt(value, spec: str = ".4f") -> str:
    return text(value, spec)


def _scaled(value, factor: float) -> float | None:
    number = real(value)
    return None if number is None else number * factor
