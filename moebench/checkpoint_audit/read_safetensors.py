"""Hugging Face safetensors (one file, or sharded with its `model.safetensors.index.json`).

Each file's header is parsed here (8 bytes of length, then JSON: name -> dtype, shape, byte range) so a
file cut short names the tensors past its end without reading a byte of data; a tensor is read through
safetensors' own `safe_open`, opened for that tensor alone (its map is released before the next one).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from moebench.checkpoint_audit.experts import locate
from moebench.checkpoint_audit.stream import MISSING_FILE, TRUNCATED, Checkpoint, Chunk, Problem, Stored

INDEX = "model.safetensors.index.json"
HEADER_MAX_BYTES = 100 * 2**20
"""safetensors refuses headers past 100 MB (its own limit): a larger length is damage."""
DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
          "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
          "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
CONFIG_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
"""config.json keys that hold the number of routed experts, across model families."""


def detect(folder: Path) -> bool:
    return (folder / INDEX).is_file() or any(folder.glob("*.safetensors"))


def read_header(path: Path) -> tuple[dict, int]:
    """(the header's tensors, where the data starts); ValueError naming why when it cannot be read."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{len(raw)} bytes, shorter than a safetensors header")
        (length,) = struct.unpack("<Q", raw)
        if length > HEADER_MAX_BYTES:
            raise ValueError(f"its header claims {length:,} bytes (safetensors allows {HEADER_MAX_BYTES:,})")
        text = f.read(length)
    if len(text) < length:
        raise ValueError(f"its header is cut at {len(text):,} of {length:,} bytes")
    try:
        header = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + length


def _loader(path: Path, name: str):
    def load():
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(name)
    return load


def read(folder: Path) -> Checkpoint:
    problems: list[Problem] = []
    files: dict[str, list[str] | None] = {}
    index = folder / INDEX
    if index.is_file():
        from moebench.userfiles import read_text

        try:
            weight_map = json.loads(read_text(str(index), flag="PATH", kind="a safetensors index",
                                              max_bytes=64 * 2**20))["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            from moebench.errors import UserError

            raise UserError(f"{index} is not a safetensors index ({type(exc).__name__}: {str(exc)[:80]}); give "
                            "a checkpoint folder", flag="PATH") from None
        for name, file in weight_map.items():
            files.setdefault(str(file), []).append(name)
    for path in sorted(folder.glob("*.safetensors")):
        files.setdefault(path.name, None)
    tensors: list[Stored] = []
    for file, listed in files.items():
        path = folder / file
        if not path.exists():
            layer, experts = locate(listed or [])
            problems.append(Problem(name=MISSING_FILE, tensor=(listed or [""])[0], layer=layer, experts=experts,
                                    sentence=f"{file} is named by {INDEX} and is not there: "
                                             f"{len(listed or [])} tensor(s) lost ({_few(listed)})"))
            continue
        try:
            header, start = read_header(path)
        except (OSError, ValueError) as exc:
            problems.append(Problem(name=TRUNCATED, sentence=f"{file} cannot be read: {exc}"))
            continue
        size = os.path.getsize(path)
        end = start + max((int(info.get("data_offsets", (0, 0))[1]) for info in header.values()), default=0)
        if end > size:  # safetensors refuses the whole file: every tensor of it is lost
            layer, experts = locate(header)
            problems.append(Problem(name=TRUNCATED, tensor=next(iter(header), ""), layer=layer, experts=experts,
                                    sentence=f"{file} is {size:,} bytes, shorter than its header says ({end:,}); "
                                             f"safetensors refuses it whole: {len(header)} tensor(s) lost "
                                             f"({_few(header)})"))
            continue
        for name, info in header.items():
            shape = tuple(int(s) for s in info.get("shape", ()))
            tensors.append(Stored(name=name, shape=shape, dtype=DTYPES.get(info.get("dtype"), str(info.get("dtype"))),
                                  chunks=(Chunk((0,) * len(shape), shape),), load=_loader(path, name), file=file))
        missing = sorted(set(listed or ()) - set(header))
        if missing:
            problems.append(Problem(name=MISSING_FILE, tensor=missing[0],
                                    sentence=f"{INDEX} places {len(missing)} tensor(s) in {file}, which does not "
                                             f"hold them ({_few(missing)})"))
    return Checkpoint(format="safetensors", path=str(folder), tensors=tensors, problems=problems,
                      config_experts=config_experts(folder / "config.json"),
                      loads=["any EP degree: from_pretrained reads whole tensors and each rank takes its experts"])


def config_experts(path: Path) -> dict[str, int]:
    """{"config.json num_local_experts": 8} from a model's config.json (its text config too), if there is one."""
    if not path.is_file():
        return {}
    try:
        from moebench.userfiles import read_text

        raw = json.loads(read_text(str(path), flag="PATH", kind="a model's config.json", max_bytes=2**20))
    except Exception:  # noqa: BLE001 - a checkpoint's own config that cannot be read is no count, not an error
        return {}
    found = {}
    for where in (raw, raw.get("text_config") if isinstance(raw, dict) else None):
        if isinstance(where, dict):
            for key in CONFIG_KEYS:
                if isinstance(where.get(key), int) and not isinstance(where.get(key), bool):
                    found[f"{path.name} {key}"] = where[key]
    return found


def _few(names) -> str:
    names = list(names or [])
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
