"""Reading a file the user hands moebench (a DeepSpeed config, a model's config.json, a recipe YAML): refused in one
line, naming the flag, when it is not a regular file (a FIFO, /dev/zero, a folder), larger than such a file can be,
unreadable, or not UTF-8 text. Nothing is read past the bound, so a 200 MB file or an endless device costs nothing.

This module imports no torch and no Typer.
"""

from __future__ import annotations

import os
import stat

from moebench.errors import UserError


def read_text(path: str, *, flag: str, kind: str, max_bytes: int) -> str:
    """The file's text. `kind` names what the flag takes ("a DeepSpeed JSON file") in the fix of a refusal."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            what = "a folder" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise UserError(f"{path} is {what}; give {kind}", flag=flag)
        if info.st_size > max_bytes:
            raise UserError(f"{path} is {info.st_size:,} bytes, more than {kind} holds ({max_bytes:,}); give the "
                            "right file", flag=flag)
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}; give a readable file ({kind})",
                        flag=flag) from None
    if len(raw) > max_bytes:  # it grew while being read
        raise UserError(f"{path} is more than {max_bytes:,} bytes; give {kind}", flag=flag)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path} is not UTF-8 text (at byte offset {exc.start}); give {kind}", flag=flag) from None
