"""`build_report`: read run folders, judge the chapter's claims, draw the figures, write the report.

Output: results/report/<id>/ with REPORT.md, report.html (self-contained), the PNGs and a
summary.json holding every verdict row (what `make all` prints at the end).
"""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path
from typing import Callable

from moebench import published, results, signals
from moebench.report import chapter, collect, figures
from moebench.report.claims import (
    DIFFERS,
    NOT_RUN,
    REPRODUCED,
    difference_text,
    format_number,
    format_published,
    verdicts,
)
from moebench.report.render import Block, Bullets, Figure, Heading, Para, Table, html_document, markdown

FIGURES = {"fastmoe": published.FASTMOE, "deepspeed": published.DEEPSPEED}
PARAMS_PUBLISHED = {
    kind: {fig.key.rsplit(".", 1)[-1]: fig.value for fig in figs if fig.key.startswith("params.")}
    for kind, figs in FIGURES.items()
}
"""The chapter's parameter counts per category ("total", "moe", ...), for the bar charts."""


@dataclasses.dataclass(kw_only=True)
class ReportResult:
    path: Path
    rows: list[dict]
    counts: dict[str, int]
    runs: dict[str, list[collect.Run]]
    primary: dict[str, collect.Run | None]
    """Per kind, the run its claims were judged on."""
    damaged: dict[str, collect.Run] = dataclasses.field(default_factory=dict)
    """Per kind (env, fastmoe, deepspeed, parity, bench), the damaged run the report would have
    read: its claims or section are not judged, and the report says so."""
    library: collect.Run | None = None
    """The `verify-parity --library` run shown in its own section (never the parity verdict's run)."""


def chapter_config(kind: str) -> dict:
    """The chapter preset's resolved config, in config.json's shape."""
    return chapter.chapter_config(kind)


def is_chapter_run(kind: str) -> Callable[[collect.Run], bool]:
    chapter = chapter_config(kind)
    return lambda run: not collect.chapter_deviations(run, chapter)


def variant_rows(kind: str, run: collect.Run | None, missing: str) -> list[dict]:
    """The verdict rows of one variant's claims from its primary run (`missing`: why there is none)."""
    figs = FIGURES[kind]
    if run is None:
        reason = missing
    elif not run.ok:
        reason = run.not_ok_reason()
    else:
        deviations = collect.chapter_deviations(run, chapter_config(kind))
        preset = (run.config or {}).get("preset")
        reason = chapter.not_comparable(kind, preset, deviations) if deviations else ""  # the run: its row's run_id
    rows = verdicts(run.summary if run else None, figs, not_run_reason=reason)
    for row in rows:
        row["variant"] = kind
        row["run_id"] = run.run_id if run else None
    return rows


def parity_row(run: collect.Run | None, missing: str) -> dict:
    base = {"variant": "parity", "key": "parity", "label": "parity vs one process", "unit": "checks",
            "section": "seeds 000-003 (allclose assertions) and 6.4.1", "published": "all pass",
            "difference": None, "ratio": None, "tolerance": "per check", "run_id": run.run_id if run else None}
    if run is None:
        return {**base, "measured": None, "verdict": NOT_RUN, "reason": missing}
    counts = run.summary.get("counts") or {}
    checks = run.summary.get("checks") or []
    passed, failed, skipped = counts.get("pass", 0), counts.get("fail", 0), counts.get("skip", 0)
    measured = f"{passed} pass, {failed} fail, {skipped} skip at world size {run.summary.get('world_size', '?')}"
    vacuous = run.summary.get("vacuous_total", 0)
    if failed:
        names = ", ".join(c["name"] for c in checks if c.get("status") == "fail")
        user = _user_code(run.summary)
        return {**base, "measured": measured, "verdict": DIFFERS,
                "reason": f"failed: {names}" + (f"; on user code: {user}" if user else "")}
    if not run.ok or not checks:
        why = run.not_ok_reason() if not run.ok else f"run {run.run_id} ran no check"
        return {**base, "measured": measured if checks else None, "verdict": NOT_RUN, "reason": why}
    missing = sorted(_registered_checks() - {c["name"] for c in checks})
    if missing:  # a --checks subset is not the chapter's parity claim
        return {**base, "measured": measured, "verdict": NOT_RUN,
                "reason": f"run {run.run_id} ran {len(checks)} of {len(missing) + len(checks)} checks (not "
                          f"{', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): run "
                          "`moebench verify-parity --world-size 4` without --checks"}
    if vacuous:
        return {**base, "measured": measured, "verdict": DIFFERS,
                "reason": f"{vacuous} vacuous assertion(s) compared nothing"}
    user = _user_code(run.summary)
    return {**base, "measured": measured, "verdict": REPRODUCED,
            "reason": f"{passed} checks pass" + (f"; {skipped} skipped (see the parity section)" if skipped else "")
            + (f"; on user code: {user}" if user else "")}


def _user_code(summary: dict) -> str:
    """"user implementation X replaced moebench's for key K; ..." ("" when moebench's own code ran)."""
    return "; ".join(f"user implementation {target} replaced moebench's for key {key}"
                     for key, target in (summary.get("impls") or {}).items())


def _registered_checks() -> set[str]:
    from moebench.parity import registry

    return {check.name for check in registry.all_checks()}


def _measured_text(row: dict) -> str:
    return row["measured"] if isinstance(row["measured"], str) else format_number(row["measured"], row["unit"])


def _published_text(row: dict) -> str:
    return format_published(row["published"], row["unit"])


def verdict_table(rows: list[dict]) -> Table:
    return Table(
        headers=("claim", "variant", "measured", "chapter", "difference", "tolerance", "verdict", "why"),
        rows=tuple((r["label"], r["variant"], _measured_text(r), _published_text(r),
                    difference_text(r) if r["unit"] != "checks" else "—", r["tolerance"], r["verdict"],
                    _reason_text(rows, i)) for i, r in enumerate(rows)),
        classes=tuple(r["verdict"] for r in rows))


def _reason_text(rows: list[dict], i: int) -> str:
    """A row's reason, or "as above" when the row before gives the same one (a run that is not the
    chapter's says why once, not in every row)."""
    reason = rows[i]["reason"]
    return "as above" if i and reason and rows[i - 1]["reason"] == reason else reason


def _chapter_marks(kind: str, run: collect.Run) -> list[tuple[float, float, str]]:
    """Where the chapter's loss figures sit on a loss-per-step plot."""
    steps = run.summary.get("steps") or len(run.metrics)
    per_epoch = run.summary.get("steps_per_epoch") or steps
    marks = []
    for fig in FIGURES[kind]:
        if fig.key == "loss.first":
            marks.append((1, fig.value, f"chapter start {fig.value}"))
        elif fig.key == "loss.last":
            marks.append((steps, fig.value, f"chapter end {fig.value} (its step count is not published)"))
        elif fig.key.startswith("epoch_loss."):
            epoch = int(fig.key.split(".")[1])
            if epoch * per_epoch <= steps:
                marks.append(((epoch - 0.5) * per_epoch + 0.5, fig.value, f"chapter epoch {epoch} mean {fig.value}"))
    return marks


def _env_blocks(run: collect.Run | None) -> list[Block]:
    blocks: list[Block] = [Heading("Environment")]
    if run is None:
        return blocks + [Para("No env-check run found: run `moebench env-check`.")]
    counts = run.summary.get("counts") or {}
    blocks.append(Para(f"env-check {run.run_id}: " + ", ".join(f"{counts.get(s, 0)} {s}" for s in
                                                                 ("ok", "warn", "fail", "skip"))
                       + ("" if run.ok else f" ({run.not_ok_reason()})")))
    checks = (run.documents.get("envcheck.json") or {}).get("checks", [])
    order = {"fail": 0, "warn": 1, "ok": 2, "skip": 3}
    checks = sorted(checks, key=lambda c: order.get(c.get("status"), 4))
    if checks:
        blocks.append(Table(headers=("status", "item", "found", "how to fix"),
                            rows=tuple((c.get("status", ""), c.get("id", ""), c.get("found", ""),
                                        c.get("hint", "") if c.get("status") in ("fail", "warn") else "")
                                       for c in checks),
                            classes=tuple(c.get("status", "") for c in checks)))
    return blocks


def _variant_blocks(kind: str, run: collect.Run | None, out: Path) -> list[Block]:
    blocks: list[Block] = [Heading(f"{kind}")]
    if run is None:
        return blocks + [Para(f"Not run: no {kind} run found (run `moebench run {kind} --preset chapter`).")]
    summary = run.summary
    config = run.config or {}
    facts = [f"run {run.run_id}, preset {config.get('preset', '?')}, status {run.status}"
             + ("" if run.ok else f": {run.not_ok_reason()}")]
    if summary.get("moe_impl"):
        facts.append(f"backend (moe_impl) {summary['moe_impl']}; device {summary.get('device')}; "
                     f"world size {summary.get('world_size')}, ep_size {summary.get('ep_size')}, "
                     f"comm {summary.get('comm_backend')}")
    if summary.get("steps"):
        steady = summary.get("tokens_per_s_steady")
        steps, epochs, per_epoch = summary["steps"], summary.get("epochs"), summary.get("steps_per_epoch")
        shape = (f"{epochs} epoch(s) of {per_epoch} steps" if epochs and per_epoch and steps == epochs * per_epoch
                 else f"stopped by --steps; an epoch is {per_epoch} steps")
        facts.append(f"{steps} steps ({shape}), training time {summary.get('train_time_s', 0):.1f} s of "
                     f"{summary.get('wall_time_s', 0):.1f} s wall; tokens/s steady "
                     + (f"{steady:,.0f}" if steady else "—") + f", overall {summary.get('tokens_per_s', 0):,.0f}")
    if (summary.get("test") or {}).get("loss") is not None:
        facts.append(f"eval loss on a held-out batch {summary['test']['loss']:.4f}; test shape "
                     f"{tuple(summary['test']['input_shape'])} -> {tuple(summary['test']['output_shape'])}")
    differs = collect.chapter_deviations(run, chapter_config(kind))
    comparable = not differs
    if differs:
        facts.append(f"not the chapter's experiment: {', '.join(differs)}; for a comparable run: "
                     f"`moebench run {kind} --preset {chapter.CHAPTER_PRESET}`")
    if config.get("description"):
        facts.append(f"preset: {config['description']}")
    elif config.get("preset") == "chapter":
        facts.append("assumptions: " + _preset_description(kind))
    blocks.append(Bullets(tuple(facts)))
    by_category = (summary.get("params") or {}).get("by_category")
    if not by_category:
        by_category = (run.documents.get("params.json") or {}).get("by_category")
    if by_category:
        published_counts = PARAMS_PUBLISHED.get(kind, {}) if comparable else {}
        png = figures.plot_params(by_category, published_counts, out / f"params-{kind}.png",
                                  title=f"{kind}: parameters by category")
        if png:
            blocks.append(Figure(png, f"{kind} parameter counts (params.json)"
                                 + (", beside the chapter's where it publishes one (hatched)." if published_counts
                                    else "; not the chapter's experiment, so the chapter's counts are not drawn.")))
    train = config.get("train") or {}
    png = figures.plot_loss(run.metrics, out / f"loss-{kind}.png", title=f"{kind}: training loss per step",
                            steps_per_epoch=summary.get("steps_per_epoch"),
                            eval_loss=(summary.get("test") or {}).get("loss"), aux_coef=train.get("aux_loss_coef"),
                            chapter_marks=_chapter_marks(kind, run) if run.ok and comparable else [])
    if png:
        blocks.append(Figure(png, f"{kind} loss (metrics.jsonl): the global-batch MSE per step"
                                  + ("; hollow red marks are the chapter's published values, not measurements."
                                     if run.ok and comparable else
                                     "; the chapter's values are not drawn (not its experiment)." if run.ok else ".")
                                  + ("" if run.ok else f" Run status: {run.status}; the curve shows what "
                                                       "metrics.jsonl holds.")))
    return blocks


def _preset_description(kind: str) -> str:
    from moebench import config as config_mod

    try:
        return config_mod.preset_description(kind, "chapter")
    except Exception:  # noqa: BLE001 - a description is a nicety
        return ""


def _expert_blocks(chosen: dict[str, list[collect.Run]], out: Path) -> list[Block]:
    blocks: list[Block] = [Heading("Expert load")]
    drawn = False
    for kind in collect.VARIANT_KINDS:
        for run in chosen[kind][:1]:
            png = figures.plot_expert_load(run.metrics, out / f"experts-{kind}.png",
                                           title=f"{kind}: tokens per expert over training")
            routing = run.summary.get("routing") or {}
            if routing:
                blocks.append(Para(f"{kind}: {100 * routing.get('dropped_route_frac', 0):.2f} % of "
                                   f"{routing.get('routes', 0):,} routes dropped at capacity over training."))
            if png:
                drawn = True
                dropped = any(m.get("dropped_route_frac") for m in run.metrics)
                blocks.append(Figure(png, f"{kind}: share of each layer's kept routes per expert and step "
                                          "(metrics.jsonl tokens_per_expert), one colour scale for every layer"
                                          + ("; below, routes dropped at capacity." if dropped else
                                             "; no route was dropped, so there is no drop panel.")))
    if not drawn:
        blocks.append(Para("No run recorded tokens per expert."))
    return blocks


def _parity_blocks(run: collect.Run | None, out: Path) -> list[Block]:
    blocks: list[Block] = [Heading("Parity")]
    if run is None:
        return blocks + [Para("Not run: no parity run found (run `moebench verify-parity --world-size 4`).")]
    checks = run.summary.get("checks") or []
    blocks.append(Para(f"verify-parity {run.run_id}: world size {run.summary.get('world_size')}, "
                       f"{run.summary.get('comm_backend')}, tolerance {run.summary.get('tolerance')}; status "
                       f"{run.status}" + ("" if run.ok else f" ({run.not_ok_reason()})")
                       + (f". Tested: {_user_code(run.summary)}." if run.summary.get("impls") else "")))
    rows = []
    for check in checks:
        ratio = figures.check_ratio(check)
        vacuous = check.get("vacuous", 0)
        rows.append((check["name"], check.get("status", ""),
                     "— (none with a tolerance)" if ratio is None else "exact" if ratio == 0 else f"{ratio:.2e}",
                     f"{check.get('comparisons_total', 0)}" + (f" ({vacuous} VACUOUS)" if vacuous else ""),
                     check.get("catches") or check.get("description", ""),
                     check.get("reason") or ""))
    if rows:
        blocks.append(Table(headers=("check", "status", "largest diff / tolerance", "comparisons", "would catch",
                                     "note"), rows=tuple(rows), classes=tuple(c.get("status", "") for c in checks)))
    png = figures.plot_parity(checks, out / "parity.png", title="parity: largest difference over its tolerance")
    if png:
        blocks.append(Figure(png, "Per check, the largest |difference| over its allowed difference (log scale); "
                                  "a check passes below 1. Exactly equal results are a stub at 1e-9, labelled exact. "
                                  "Assertions that two things must differ, or that a call raises, have no tolerance "
                                  "and are not drawn."))
    return blocks


def _library_blocks(run: collect.Run | None, out: Path) -> list[Block]:
    """The latest `verify-parity --library` run: its conformance table and a figure (its own section:
    the chapter's parity verdict stays the whole suite's)."""
    if run is None:
        return []
    summary = run.summary
    rows = summary.get("rows") or []
    names = ", ".join(dict.fromkeys(r["library"] for r in rows)) or "no row"
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("pass", "fail", "skip", "refused")}
    refused = f", {counts['refused']} refused by the library" if counts["refused"] else ""
    blocks: list[Block] = [Heading("Library conformance (verify-parity --library)"), Para(
        f"verify-parity --library {run.run_id} ({names}): status {run.status}"
        + ("" if run.ok else f" ({run.not_ok_reason()})") + f", {summary.get('comm_backend')}, tolerance "
        f"{summary.get('tolerance')}; {len(rows)} row(s): {counts['pass']} pass, {counts['fail']} fail, "
        f"{counts['skip']} skip{refused}. Each row is one library version x model x expert backend x EP mode x world "
        "size, compared with the same block on one process with identical weights (docs/libraries.md). "
        "It does not judge the chapter's parity claim, which comes from the latest whole-suite run.")]
    checks = {c["name"]: c for c in summary.get("checks") or []}
    # a features column (as on the console) when some row has features: it tells the DeepSpeed engine rows apart
    with_features = any(r.get("features") for r in rows)
    cells = []
    for r in rows:
        ratio = figures.check_ratio(checks.get(r.get("check"), {}))
        features = ("+".join(r.get("features") or ()) or "-",) if with_features else ()
        cells.append((r["library"], r["version"], r["model"], r["backend"], r["ep_mode"], *features,
                      str(r["world_size"]), r["verdict"],
                      "—" if ratio is None else "exact" if ratio == 0 else f"{ratio:.2e}", r.get("diagnosis") or ""))
    if cells:
        headers = ("library", "version", "model", "backend", "EP mode", *(("features",) if with_features else ()),
                   "world", "verdict", "largest diff / tolerance", "diagnosis")
        blocks.append(Table(headers=headers, rows=tuple(cells), classes=tuple(r["verdict"] for r in rows)))
    png = figures.plot_library(rows, list(checks.values()), out / "library.png",
                               title=f"verify-parity --library {names}: largest difference / tolerance per row")
    if png:
        blocks.append(Figure(png, "Per row (library/model/backend/EP mode/world size), the largest |difference| "
                                  "over its allowed difference (log scale), coloured by verdict: blue passed, red "
                                  "failed; a row passes below 1; inf: a difference where equality was required. "
                                  "Not drawn: skipped and refused rows (nothing compared) and bf16 rows (judged by "
                                  "a noise model, not a tolerance)."))
    return blocks


def _comparison_blocks(chosen: dict[str, list[collect.Run]], out: Path) -> list[Block]:
    blocks: list[Block] = []
    for kind in collect.VARIANT_KINDS:
        runs = chosen[kind]
        if len(runs) < 2:
            continue
        blocks.append(Heading(f"Comparison: {len(runs)} {kind} runs"))
        flat = [_flatten(r.config or {}) for r in runs]
        keys = sorted({k for f in flat for k in f
                       if not k.startswith(("schema", "description")) and k != "launch.timeout_s"})
        differing = [k for k in keys if len({repr(f.get(k)) for f in flat}) > 1]
        headers = ("setting", *(r.run_id for r in runs))
        rows = [(k, *("—" if f.get(k) is None else str(f[k]) for f in flat)) for k in differing]
        for label, get in (("status", lambda r: r.status), ("backend", lambda r: r.summary.get("moe_impl", "—")),
                           ("final loss", lambda r: _fmt(r.summary.get("loss", {}).get("last"))),
                           ("eval loss", lambda r: _fmt((r.summary.get("test") or {}).get("loss"))),
                           ("tokens/s steady", lambda r: _fmt(r.summary.get("tokens_per_s_steady"), ",.0f"))):
            rows.append((label, *(get(r) for r in runs)))
        blocks.append(Table(headers=headers, rows=tuple(rows)))
        png = figures.plot_overlay([(r.run_id, r.metrics) for r in runs], out / f"compare-{kind}.png",
                                   title=f"{kind}: loss per step, {len(runs)} runs")
        if png:
            blocks.append(Figure(png, f"{kind} runs overlaid; the settings that differ are in the table above."))
    return blocks


def _bench_blocks(sweep: collect.Run | None, train: collect.Run | None, out: Path) -> list[Block]:
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
        rows.append((*point, f"{r.get('tokens_per_s', 0):,.0f}", f"{r.get('gflops', 0):.1f}",
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
                                        f"{r['tokens_per_s']:,.0f}", _fmt(r.get("vs_world_1"), ".2f"),
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
        f"Bounds: matmul FLOPs at {rates.get('gemm_flop_per_s', 0) / 1e9:.0f} GFLOP/s, bytes at "
        f"{rates.get('memory_bytes_per_s', 0) / 1e9:.1f} GB/s (both measured here); × bound = time / bound.")]
    rows = []
    for v in train.get("variants") or []:
        for p in v.get("phases") or []:
            rows.append((f"{v['variant']} ({v['preset']})", p["phase"], f"{1000 * p['time_s']:.1f}",
                         f"{p['share']:.0%}", f"{1000 * p['bound_s']:.1f}", _fmt(p.get("x_bound"), ".1f")))
    if rows:
        blocks.append(Table(headers=("preset", "phase", "ms", "share", "bound ms", "× bound"), rows=tuple(rows)))
    return blocks


def _latest_bench(root: Path, section: str) -> collect.Run | None:
    """The newest bench run whose summary has `section` (a sweep's rows, or --train's breakdown)."""
    run = collect.latest(root, "bench", prefer=lambda r: bool(r.summary.get(section)))
    return run if run is not None and (run.damage or run.summary.get(section)) else None


def _fmt(value, spec: str = ".4f") -> str:
    return "—" if value is None else format(value, spec)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def build_report(paths: list[str], *, root: str | None = None, since: str | None = None) -> ReportResult:
    """Read the runs (the given folders, or the latest of each kind, started at or after `since`),
    write the report folder."""
    from moebench.errors import Interrupted, UserError

    root_path = results.results_root(root)
    if since is not None and paths:
        raise UserError("applies to the latest runs only; drop it, or the RUN folders", flag="--since")
    since_time = collect.parse_since(since) if since is not None else None  # a bad flag before a missing folder
    if not paths and root_path.exists() and not root_path.is_dir():
        raise UserError(f"{root_path} is a file, not a results folder; pass the folder that holds "
                        "<kind>/<run-id> folders (default ./results)", flag="--results-dir")
    if not paths and not root_path.is_dir():
        raise UserError(f"{root_path} does not exist; point it at a results folder (default ./results)",
                        flag="--results-dir")
    prefer = {kind: is_chapter_run(kind) for kind in collect.VARIANT_KINDS}
    prefer["parity"] = lambda run: not collect.is_library_run(run)  # a --library run has its own section
    chosen = collect.select(paths, root_path, since_time, prefer)
    library = _library_run(chosen["parity"], paths, root_path, since_time)
    chosen["parity"] = [r for r in chosen["parity"] if not collect.is_library_run(r)]
    run_dir = results.RunDir.create("report", root=root)
    run_dir.start({"inputs": [str(r.path) for kind in collect.KINDS for r in chosen[kind]]
                   + ([str(library.path)] if library else [])})
    out = run_dir.path
    try:
        primary = {kind: _primary(kind, chosen[kind], prefer.get(kind)) for kind in collect.KINDS}
        rows = [row for kind in collect.VARIANT_KINDS
                for row in variant_rows(kind, primary[kind], _missing(kind, paths, since_time, root_path))]
        rows.append(parity_row(primary["parity"], _missing("parity", paths, since_time, root_path)))
        counts = {v: sum(r["verdict"] == v for r in rows) for v in (REPRODUCED, DIFFERS, NOT_RUN)}
        listed = [(kind, r) for kind in collect.KINDS for r in chosen[kind]] + ([("library", library)] if library
                                                                                else [])

        blocks: list[Block] = [
            Heading("moebench report: did chapter 6 reproduce?", 1),
            Para(f"Compared with {published.CHAPTER}, sections 6.4.1-6.4.4. Built "
                 f"{datetime.datetime.now().isoformat(timespec='seconds')} from results files only."),
            Table(headers=("kind", "run", "status", "folder"),
                  rows=tuple((kind, r.run_id, r.error if r.damage else r.status, str(r.path))
                             for kind, r in listed),
                  classes=tuple(r.status for _, r in listed)),
            Heading("Verdicts"),
            Para(f"{counts[REPRODUCED]} reproduced, {counts[DIFFERS]} differ, {counts[NOT_RUN]} not run. "
                 "Tolerances are fixed in moebench/published.py, each with its reason; a claim outside its "
                 "tolerance is reported as `differs` with the likely cause, never hidden."),
            verdict_table(rows),
            *_env_blocks(primary["env"]),
        ]
        for kind in collect.VARIANT_KINDS:
            signals.check()  # safe points between the report's steps (each draws a figure or two)
            blocks += _variant_blocks(kind, primary[kind], out)
        signals.check()
        blocks += _expert_blocks(chosen, out)
        signals.check()
        blocks += _parity_blocks(primary["parity"], out)
        signals.check()
        blocks += _library_blocks(library, out)
        signals.check()
        blocks += _comparison_blocks(chosen, out)
        signals.check()
        sweep, train = _latest_bench(root_path, "rows"), _latest_bench(root_path, "train")
        blocks += _bench_blocks(sweep, train, out)
        signals.check()
        from moebench.report import gpu  # the GPU section: its own module (files only)

        gpu_run = gpu.latest_run(root_path, since_time)
        blocks += gpu.blocks(gpu_run, root_path)
        damaged = {kind: run for kind, run in [*primary.items(), ("bench", sweep or train), (gpu.KIND, gpu_run)]
                   if run is not None and run.damage}

        results.write_text_atomic(out / "REPORT.md", markdown(blocks))
        results.write_text_atomic(out / "report.html", html_document(blocks, title="moebench report"))
        run_dir.finish(results.STATUS_OK, {"verdicts": rows, "counts": counts, "report": "REPORT.md",
                                           "html": "report.html",
                                           **({"not_judged": {kind: f"{run.path}: {run.damage}" for kind, run
                                                              in damaged.items()}} if damaged else {}),
                                           "figures": sorted(p.name for p in out.glob("*.png"))})
    except BaseException as exc:  # the folder says how it ended, then the error goes on
        if run_dir.ended is None:  # (`finish` itself records an interruption it acts on)
            status = results.STATUS_INTERRUPTED if isinstance(exc, KeyboardInterrupt) else results.STATUS_FAILED
            run_dir.finish(status, {"error": f"{type(exc).__name__}: {exc}"})
        if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, Interrupted):
            raise Interrupted(out) from exc  # the CLI names the folder it marked
        raise
    return ReportResult(path=out, rows=rows, counts=counts, runs=chosen, primary=primary, damaged=damaged,
                        library=library)


def _library_run(runs: list[collect.Run], paths: list[str], root: Path, since) -> collect.Run | None:
    """The `verify-parity --library` run to show: the first among the given folders, else the latest."""
    if paths:
        return next((r for r in runs if collect.is_library_run(r)), None)
    run = collect.latest(root, "parity", since, prefer=collect.is_library_run)
    return run if run is not None and collect.is_library_run(run) else None


def _primary(kind: str, runs: list[collect.Run], prefer: Callable[[collect.Run], bool] | None):
    """The run a kind's claims are judged on: the first that is the chapter's experiment, else the first."""
    if not runs:
        return None
    return next((r for r in runs if prefer is not None and prefer(r)), runs[0])


COMMANDS = {"fastmoe": "moebench run fastmoe --preset chapter", "deepspeed": "moebench run deepspeed --preset chapter",
            "parity": "moebench verify-parity --world-size 4"}


def _missing(kind: str, paths: list[str], since, root: Path) -> str:
    """Why a kind has no run, in the words of how runs were chosen."""
    if paths:
        return f"no {kind} run among the RUN folders given (add one, or give no RUN for the latest)"
    if since is not None:
        return f"no {kind} run started since {since.isoformat(timespec='seconds')}: run `{COMMANDS[kind]}`"
    return f"no {kind} run under {root}: run `{COMMANDS[kind]}`"
