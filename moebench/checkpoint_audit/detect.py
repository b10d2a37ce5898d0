"""Which format a folder holds, and the refusals of what is no checkpoint folder (one line each, exit 2).

Refused before anything is read: a path that does not exist, a link loop, a FIFO or a file where the folder
belongs, a folder that cannot be listed, a folder of no format moebench reads (the line says what it found).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from moebench.errors import UserError

FORMATS = ("DCP (.metadata + *.distcp; Megatron torch_dist too)", "DeepSpeed regular (mp_rank_*_model_states.pt)",
           "DeepSpeed universal (zero/<param>/fp32.pt)", "safetensors (*.safetensors, model.safetensors.index.json)")
LISTED = 6
"""Names a refusal shows of what it found."""


def folder(path: str | os.PathLike, flag: str) -> Path:
    """`path` as a readable folder, else a UserError naming `flag` and the fix."""
    text = str(path)
    try:
        info = os.stat(text)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UserError(f"{text} is a link loop; give the checkpoint folder itself", flag=flag) from None
        if exc.errno == errno.ENOENT:
            raise UserError(f"{text} does not exist; give the folder the checkpoint was saved to",
                            flag=flag) from None
        raise UserError(f"cannot read {text}: {exc.strerror or exc}; give a readable folder", flag=flag) from None
    if not stat.S_ISDIR(info.st_mode):
        what = "a FIFO" if stat.S_ISFIFO(info.st_mode) else "a file" if stat.S_ISREG(info.st_mode) else \
            "not a regular file or folder"
        raise UserError(f"{text} is {what}; give the checkpoint's folder (the one holding its files)", flag=flag)
    try:
        os.listdir(text)
    except OSError as exc:
        raise UserError(f"cannot list {text}: {exc.strerror or exc}; give a readable folder", flag=flag) from None
    return Path(text)


def _follow_tag(root: Path, latest: str) -> Path | None:
    """DeepSpeed's save folder: its `latest` (or `latest_universal`) file names the tag folder."""
    marker = root / latest
    if not marker.is_file() or marker.stat().st_size > 4096:
        return None
    try:
        tag = marker.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    target = root / tag
    return target if tag and "/" not in tag and target.is_dir() else None


def kind(root: Path, flag: str) -> tuple[str, Path]:
    """(format, the folder its files are in): "deepspeed-universal", "deepspeed", "dcp" or "safetensors"."""
    from moebench.checkpoint_audit import read_dcp, read_safetensors

    for candidate in (root, _follow_tag(root, "latest_universal"), _follow_tag(root, "latest")):
        if candidate is None:
            continue
        if (candidate / "zero").is_dir() and any((candidate / "zero").iterdir()):
            return "deepspeed-universal", candidate
        if any(candidate.glob("mp_rank_*_model_states.pt")):
            return "deepspeed", candidate
    if read_dcp.detect(root):
        return "dcp", root
    if read_safetensors.detect(root):
        return "safetensors", root
    try:
        names = sorted(os.listdir(root))
    except OSError:
        names = []
    found = (f"{len(names)} entr{'y' if len(names) == 1 else 'ies'}: " + ", ".join(names[:LISTED])
             + (", ..." if len(names) > LISTED else "")) if names else "an empty folder"
    raise UserError(f"{root} holds no checkpoint moebench reads (found {found}); it reads "
                    + "; ".join(FORMATS), flag=flag)
