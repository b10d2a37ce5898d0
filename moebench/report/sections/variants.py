"""The variant sections: each variant's run (facts, parameter counts, loss curve with the chapter's marks), the
expert load over training, and the comparison of several runs of one variant."""

from __future__ import annotations

from pathlib import Path

from moebench.report import chapter, collect, figures
from moebench.report.numbers import real, text
from moebench.report.render import Block, Bullets, Figure, Heading, Para, Table
from moebench.report.verdict_rows import FIGURES, PARAMS_PUBLISHED, chapter_config


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


def blocks(kind: str, run: collect.Run | None, out: Path) -> list[Block]:
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
        steps, epochs, per_epoch = summary["steps"], summary.get("epochs"), summary.get("steps_per_epoch")
        shape = (f"{epochs} epoch(s) of {per_epoch} steps" if epochs and per_epoch and steps == epochs * per_epoch
                 else f"stopped by --steps; an epoch is {per_epoch} steps")
        facts.append(f"{steps} steps ({shape}), training time {text(summary.get('train_time_s'), '.1f')} s of "
                     f"{text(summary.get('wall_time_s'), '.1f')} s wall; tokens/s steady "
                     + (text(summary.get("tokens_per_s_steady"), ",.0f") if summary.get("tokens_per_s_steady")
                        else "—") + f", overall {text(summary.get('tokens_per_s'), ',.0f')}")
    test = summary.get("test") or {}
    if real(test.get("loss")) is not None:
        facts.append(f"eval loss on a held-out batch {text(test['loss'], '.4f')}; test shape "
                     f"{_shape(test.get('input_shape'))} -> {_shape(test.get('output_shape'))}")
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


def expert_blocks(chosen: dict[str, list[collect.Run]], out: Path) -> list[Block]:
    blocks: list[Block] = [Heading("Expert load")]
    drawn = False
    for kind in collect.VARIANT_KINDS:
        for run in chosen[kind][:1]:
            png = figures.plot_expert_load(run.metrics, out / f"experts-{kind}.png",
                                           title=f"{kind}: tokens per expert over training")
            routing = run.summary.get("routing") or {}
            if routing:
                blocks.append(Para(f"{kind}: {text(100 * (real(routing.get('dropped_route_frac')) or 0), '.2f')} % of "
                                   f"{text(routing.get('routes'), ',', missing='?')} routes dropped at capacity over "
                                   "training."))
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


def comparison_blocks(chosen: dict[str, list[collect.Run]], out: Path) -> list[Block]:
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
                           ("final loss", lambda r: _fmt((r.summary.get("loss") or {}).get("last"))),
                           ("eval loss", lambda r: _fmt((r.summary.get("test") or {}).get("loss"))),
                           ("tokens/s steady", lambda r: _fmt(r.summary.get("tokens_per_s_steady"), ",.0f"))):
            rows.append((label, *(get(r) for r in runs)))
        blocks.append(Table(headers=headers, rows=tuple(rows)))
        png = figures.plot_overlay([(r.run_id, r.metrics) for r in runs], out / f"compare-{kind}.png",
                                   title=f"{kind}: loss per step, {len(runs)} runs")
        if png:
            blocks.append(Figure(png, f"{kind} runs overlaid; the settings that differ are in the table above."))
    return blocks


def _fmt(value, spec: str = ".4f") -> str:
    return text(value, spec)


def _shape(value) -> str:
    return str(tuple(value)) if isinstance(value, list) else "?"


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
