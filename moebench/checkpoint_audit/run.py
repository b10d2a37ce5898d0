"""`moebench checkpoint`: read a checkpoint folder through its format's reader, audit it, record the finding.

The one core function the CLI and the Python API call. Every input is checked before anything is read or
written (bad input: UserError, exit 2, nothing under results/); a completed audit is saved as
results/checkpoint/<run-id>/checkpoint.json (= `--json`) and summary.json.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from moebench.checkpoint_audit import stream as s
from moebench.checkpoint_audit.limits import EXPERTS_MAX
from moebench.errors import UserError

SCHEMA = "moebench.checkpoint/1"
REPORT_FILE = "checkpoint.json"
KIND = "checkpoint"
HF_CONFIG_MAX_BYTES = 1 << 20


def _reader(fmt: str):
    from moebench.checkpoint_audit import read_dcp, read_deepspeed, read_safetensors

    return {"dcp": read_dcp.read, "safetensors": read_safetensors.read, "deepspeed": read_deepspeed.read_regular,
            "deepspeed-universal": read_deepspeed.read_universal}[fmt]


def open_checkpoint(path: str, flag: str) -> s.Checkpoint:
    """The folder read through its format's reader (metadata only: no tensor data yet)."""
    from moebench.checkpoint_audit import detect

    root = detect.folder(path, flag)
    fmt, where = detect.kind(root, flag)
    try:
        return _reader(fmt)(where)
    except UserError as exc:  # a reader names PATH: the folder may be --against's
        if exc.flag == "PATH" and flag != "PATH":
            raise UserError(str(exc).removeprefix("PATH: "), flag=flag) from None
        raise
    except Exception as exc:  # noqa: BLE001 - a file the format's reader needs cannot be read (cut, not a pickle)
        raise UserError(f"{where} looks like {fmt} but cannot be read ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:100] if str(exc) else ''}); give a whole checkpoint folder",
                        flag=flag) from None


def given_counts(hf_config: str | None, experts: int | None) -> dict[str, int]:
    """The expert counts the user gave (--experts, or the routed experts of --hf-config)."""
    given = {}
    if experts is not None:
        if isinstance(experts, bool) or not isinstance(experts, int) or not 1 <= experts <= EXPERTS_MAX:
            raise UserError(f"{experts!r} is not a count of experts; give an integer from 1 to {EXPERTS_MAX}",
                            flag="--experts")
        given["--experts"] = experts
    if hf_config is not None:
        from moebench.checkpoint_audit.read_safetensors import CONFIG_KEYS
        from moebench.userfiles import read_text

        text = read_text(str(hf_config), flag="--hf-config", kind="a model's config.json",
                         max_bytes=HF_CONFIG_MAX_BYTES)
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise UserError(f"{hf_config} is not JSON ({exc}); give a model's config.json", flag="--hf-config") \
                from None
        found = {k: raw.get(k) for k in CONFIG_KEYS if isinstance(raw, dict)
                 and isinstance(raw.get(k), int) and not isinstance(raw.get(k), bool)}
        if not found:
            raise UserError(f"{hf_config} names no expert count ({', '.join(CONFIG_KEYS)}); give an MoE model's "
                            "config.json, or --experts N", flag="--hf-config")
        key, value = next(iter(found.items()))
        given[f"--hf-config {key}"] = value
    return given


def audit(checkpoint: s.Checkpoint, given: dict[str, int], progress=None) -> tuple[list[s.Problem], dict, dict]:
    """(problems, the layers' records, fingerprints) of one checkpoint."""
    from moebench.checkpoint_audit import audit as a
    from moebench.checkpoint_audit import optimizer

    layers = a.layers_of(checkpoint.tensors)
    counts = {**given, **checkpoint.config_experts}  # the user's count first: the one the others must match
    problems = [_with_experts(p) for p in checkpoint.problems]
    owner = {t.name: layer for layer in layers.values() for t in layer.stacked}
    for t in checkpoint.tensors:
        problems += a.check_chunks(t, owner.get(t.name))
    total = sum(t.nbytes for layer in layers.values() for t in layer.stacked) + \
        sum(x[0].nbytes for layer in layers.values() for by in layer.per_expert.values() for x in by.values())
    prints = a.fingerprints(layers, total, progress, problems)
    records = []
    for layer in a.layer_order(layers):
        problems += a.check_counts(layer, counts)
        problems += a.check_duplicates(layer, prints.get(layer.name, {}))
        want, sources = a.expected_count(layer, counts)
        records.append({"layer": layer.name, "experts": want, "counted_by": sources,
                        "stored": "stacked" if layer.stacked else "per-expert",
                        "tensors": len(layer.stacked) + sum(len(b) for b in layer.per_expert.values())})
    if not layers and counts:  # a count stated, and no tensor of the checkpoint read as an expert's
        said = "; ".join(f"{n} by {where}" for where, n in counts.items())
        problems.append(s.Problem(name=s.EXPERT_COUNT, experts=list(range(min(counts.values())))[:64],
                                  sentence=f"experts counted {said}; no tensor in the checkpoint is recognised "
                                           f"as an expert's (0 MoE layers read)"))
    state_problems, state = optimizer.check(checkpoint.tensors, layers)
    return problems + state_problems, {"layers": records, "optimizer": state}, prints


def _with_experts(problem: s.Problem) -> s.Problem:
    """A lost file's line names the layer and the experts it took with it."""
    if problem.name in (s.MISSING_FILE, s.TRUNCATED) and problem.experts:
        from moebench.checkpoint_audit.audit import _span

        problem.sentence += f"; layer {problem.layer}: experts {_span(problem.experts)} lost"
    return problem


def audit_checkpoint(path: str, *, hf_config: str | None = None, experts: int | None = None,
                     against: str | None = None, results_dir: str | None = None, progress=None) -> tuple[dict, int]:
    """Audit `path` (and compare it with `against`); save the finding. Returns (the document, the exit code:
    0 sound, 1 a problem found). Bad input raises UserError before anything is written."""
    from moebench import results

    given = given_counts(hf_config, experts)
    results.check_root(results_dir, KIND)
    started = time.time()
    checkpoint = open_checkpoint(path, "PATH")
    other = open_checkpoint(against, "--against") if against is not None else None
    problems, found, prints = audit(checkpoint, given, progress)
    document = {"schema": SCHEMA, "path": str(Path(path).absolute()), "format": checkpoint.format,
                "saved": checkpoint.saved, "loads": checkpoint.loads,
                "tensors": len(checkpoint.tensors), "bytes": sum(t.nbytes for t in checkpoint.tensors), **found}
    if other is not None:
        from moebench.checkpoint_audit import against as vs

        other_problems, _, other_prints = audit(other, given, progress)
        pairs_problems, pairs = vs.compare(prints, other_prints, "PATH", "--against")
        problems += pairs_problems
        document["against"] = {"path": str(Path(against).absolute()), "format": other.format, "layers": pairs,
                               "problems": [p.to_dict() for p in other_problems]}
        problems += [s.Problem(name=p.name, sentence=f"--against: {p.sentence}", tensor=p.tensor, layer=p.layer,
                               experts=p.experts) for p in other_problems]
    document["problems"] = [p.to_dict() for p in problems]
    document["lines"] = [p.line() for p in problems]
    code = 1 if problems else 0
    document["status"] = "problems" if problems else "sound"
    document["elapsed_s"] = round(time.time() - started, 3)
    run = results.RunDir.create(KIND, root=results.results_root(results_dir), started=started)
    document["results_path"] = str(run.path / REPORT_FILE)
    run.write_json(REPORT_FILE, document)
    run.finish(results.STATUS_OK if not problems else results.STATUS_FAILED,
               {"format": checkpoint.format, "problems": len(problems), "exit_code": code, "report": REPORT_FILE})
    return document, code


_PATH = (str, os.PathLike)
API_TYPES: dict[str, tuple[tuple[type, ...], str, bool]] = {
    "path": (_PATH, "a path", False),
    "hf_config": (_PATH, "a path", True),
    "experts": ((int,), "an int", True),
    "against": (_PATH, "a path", True),
    "results_dir": (_PATH, "a path", True),
}
"""The Python API's arguments and the types each takes: anything else is a UserError naming its flag."""


def checked_audit(path, *, hf_config=None, experts=None, against=None, results_dir=None) -> dict:
    """`moebench.checkpoint(...)`: the arguments checked as the CLI checks its flags, then the audit's document."""
    from moebench import bounds, results
    from moebench.checkpoint_audit.limits import BOUNDS, FLAGS

    given = dict(path=path, hf_config=hf_config, experts=experts, against=against, results_dir=results_dir)
    for name, value in given.items():
        types, words, none_ok = API_TYPES[name]
        flag = FLAGS.get(name, "--results-dir")
        if value is None and none_ok:
            continue
        if not isinstance(value, types) or isinstance(value, bool):
            raise UserError(f"{name}= takes {words}, got {type(value).__name__}", flag=flag)
    if hf_config is not None and experts is not None:
        raise UserError("cannot be combined with --experts (pick one source of the count)", flag="--hf-config")
    for name, value in given.items():
        if value is not None and name in BOUNDS:
            bounds.check(BOUNDS[name], value if name == "experts" else str(value), FLAGS[name])
    document, _ = audit_checkpoint(str(path), hf_config=None if hf_config is None else str(hf_config),
                                   experts=experts, against=None if against is None else str(against),
                                   results_dir=None if results_dir is None else str(results_dir))
    return results.to_jsonable(document)
