"""PyTorch Distributed Checkpoint (a `.metadata` file and `*.distcp` shards), Megatron-core's torch_dist among them.

The metadata (torch.distributed.checkpoint's FileSystemReader) lists every tensor's global shape, dtype and
the chunks each rank wrote; the byte range of every chunk is checked against its file before anything is
read. A tensor is read alone, through `dcp.load` of that one key into a tensor of its global shape, with no
process group.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from moebench.checkpoint_audit.experts import STACKED, locate
from moebench.checkpoint_audit.stream import (
    BUFFER,
    MISSING_FILE,
    PARAM,
    TRUNCATED,
    Checkpoint,
    Chunk,
    Problem,
    Stored,
)
from moebench.errors import UserError

METADATA = ".metadata"
OPTIMIZER_KEY = re.compile(r"(?:^|\.)state\.(?P<of>.+)\.(?P<q>exp_avg_sq|exp_avg|step)$")
"""An optimizer state's key, flattened (`optim.state.<param>.exp_avg`, torch's get_state_dict and torchtitan)."""
BUFFER_KEY = re.compile(r"(?:^|\.)(expert_bias|expert_bias_E|e_score_correction_bias|tokens_per_expert)$")
"""Persistent buffers MoE routers keep (a routing bias, a load counter)."""
MODEL_PREFIXES = ("model.", "module.", "app.model.")
PARTS = ("model", "optim")
"""NeMo Automodel's Checkpointer writes a step folder holding two DCP checkpoints: model/ (save_model) and optim/
(save_optimizer, its keys `optim.state.<model key>.exp_avg`); the step folder is read as one checkpoint."""


def detect(folder: Path) -> bool:
    return (folder / METADATA).is_file() or bool(parts(folder))


def parts(folder: Path) -> list[str]:
    """The DCP sub-folders of an Automodel step folder (model/ first), or [] where `folder` is none."""
    if (folder / METADATA).is_file() or not (folder / PARTS[0] / METADATA).is_file():
        return []
    return [name for name in PARTS if (folder / name / METADATA).is_file()]


def role_of(name: str) -> tuple[str, str | None]:
    """(role, the parameter it belongs to) of a flattened state-dict key."""
    m = OPTIMIZER_KEY.search(name)
    if m:
        return m.group("q"), m.group("of")
    return (BUFFER if BUFFER_KEY.search(name) else PARAM), None


def _loader(folder: Path, name: str, shape, dtype):
    def load():
        import warnings

        import torch
        import torch.distributed.checkpoint as dcp

        target = {name: torch.zeros(shape, dtype=dtype)}  # a gap reads as zeros, never as stale memory
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": one process is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(target, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
        return target[name]
    return load


def read(folder: Path) -> Checkpoint:
    """The folder's DCP checkpoint; an Automodel step folder's model/ and optim/ as one (their files named with
    their sub-folder)."""
    found = parts(folder)
    if not found:
        return _read(folder)
    read_parts = [_read(folder / name, f"{name}/") for name in found]
    model = read_parts[0]
    saved = {**model.saved, "ranks": max(c.saved.get("ranks", 0) for c in read_parts),
             "parts": " + ".join(f"{name}/" for name in found)}
    return Checkpoint(format=model.format, path=str(folder), tensors=[t for c in read_parts for t in c.tensors],
                      problems=[p for c in read_parts for p in c.problems], saved=saved, loads=model.loads)


def _read(folder: Path, label: str = "") -> Checkpoint:
    """One DCP folder; `label` goes before its files' names (an Automodel step folder's sub-folder)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - a metadata file that cannot be unpickled: not a checkpoint we read
        raise UserError(f"{folder / METADATA} cannot be read as DCP metadata ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:80] if str(exc) else ''}); give a checkpoint folder",
                        flag="PATH") from None
    problems: list[Problem] = []
    by_fqn: dict[str, list] = {}
    for index, info in (metadata.storage_data or {}).items():
        by_fqn.setdefault(index.fqn, []).append(info)
    sizes: dict[str, int | None] = {}
    lost: dict[str, list[str]] = {}
    rows: dict[str, set[int]] = {}
    for index, info in (metadata.storage_data or {}).items():
        file = str(info.relative_path)
        if file not in sizes:
            sizes[file] = os.path.getsize(folder / file) if (folder / file).is_file() else None
        size = sizes[file]
        if size is None or info.offset + info.length > size:
            lost.setdefault(file, []).append(index.fqn)
            if STACKED.match(index.fqn):  # a stacked expert tensor: the chunk's rows are the experts lost
                rows.setdefault(file, set()).update(_rows(metadata.state_dict_metadata.get(index.fqn), index.offset))
    for file, names in sorted(lost.items()):
        names = sorted(set(names), key=lambda n: ("_extra_state" in n or ".param_groups." in n, n))  # tensors first
        layer, experts = locate(names)
        experts = experts or sorted(rows.get(file, ()))
        if sizes[file] is None:
            problems.append(Problem(name=MISSING_FILE, tensor=names[0], layer=layer, experts=experts,
                                    sentence=f"{label}{file} is named by {label}{METADATA} and is not there: "
                                             f"{len(names)} tensor(s) lost ({_few(names)})"))
        else:
            problems.append(Problem(name=TRUNCATED, tensor=names[0], layer=layer, experts=experts,
                                    sentence=f"{label}{file} is {sizes[file]:,} bytes, shorter than {label}"
                                             f"{METADATA} says: {len(names)} tensor(s) past its end ({_few(names)})"))
    damaged = {n for names in lost.values() for n in names}
    tensors = []
    for name, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata) or name in damaged:
            continue
        shape = tuple(int(s) for s in meta.size)
        dtype = meta.properties.dtype
        role, of = role_of(name)
        files = [str(i.relative_path) for i in by_fqn.get(name, [])]
        tensors.append(Stored(name=name, shape=shape, dtype=str(dtype).removeprefix("torch."),
                              chunks=tuple(Chunk(tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes))
                                           for c in meta.chunks),
                              load=_loader(folder, name, shape, dtype), file=label + files[0] if files else "",
                              role=role, of=_param_name(of, metadata.state_dict_metadata) if of else None))
    megatron = _megatron(folder)
    writers = {fqn: {_writer(str(i.relative_path)) for i in infos} for fqn, infos in by_fqn.items()}
    saved = {"ranks": len(set().union(*writers.values()) - {None}) if writers else 0, **megatron}
    per_tensor = [len(w - {None}) for fqn, w in writers.items() if STACKED.match(fqn) and role_of(fqn)[0] == PARAM]
    if per_tensor:  # the ranks that wrote pieces of one expert stack: the EP degree (a replica is written once)
        saved["ep_size"] = max(per_tensor)
    loads = ["any world size and EP degree: DCP reshards each tensor to the chunks the loading ranks ask for"]
    if megatron:
        loads = ["any TP / EP / PP layout Megatron-core's dist_checkpointing builds (it reshards on load)"]
    return Checkpoint(format="megatron torch_dist" if megatron else "dcp", path=str(folder), tensors=tensors,
                      problems=problems, saved=saved, loads=loads)


def _writer(file: str) -> int | None:
    """The rank that wrote a DCP file (`__<rank>_<thread>.distcp`)."""
    m = re.match(r"__(\d+)_\d+\.distcp$", file)
    return int(m.group(1)) if m else None


def _rows(meta, offset) -> range:
    """The rows (experts, for a stacked tensor) of the chunk stored at `offset`."""
    for chunk in getattr(meta, "chunks", ()):
        if offset is not None and tuple(chunk.offsets) == tuple(offset) and len(chunk.offsets):
            return range(int(chunk.offsets[0]), int(chunk.offsets[0] + chunk.sizes[0]))
    return range(0)


def _param_name(of: str, keys) -> str:
    """The model key an optimizer state's parameter name refers to (`optim.state.w` -> `model.w`)."""
    if of in keys:
        return of
    for prefix in MODEL_PREFIXES:
        if prefix + of in keys:
            return prefix + of
    return of


def _megatron(folder: Path) -> dict:
    """Megatron-core's metadata.json ({"sharded_backend": "torch_dist", ...}), when the folder has one."""
    path = folder / "metadata.json"
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8")[:65536])
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict) or "sharded_backend" not in raw:
        return {}
    return {"sharded_backend": str(raw["sharded_backend"])}


def _few(names) -> str:
    names = list(names)
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
