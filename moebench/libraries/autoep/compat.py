"""Which DeepSpeed and transformers an AutoEP row runs with, read without importing either, and what AutoEP needs of
them: DeepSpeed 0.19.2+ (the first release with `deepspeed/module_inject/auto_ep.py`), transformers 5.x (its presets'
fused-expert layout), and, from transformers 5.23 on, an in-process shim (rowmath.install_registry_shim).

transformers 5.23 made `transformers.utils.output_capturing._CAN_RECORD_REGISTRY` a dict subclass whose `get(model)`
and `registry[model] = ...` take a model and key it by `str(model.__class__)`; DeepSpeed's AutoEP (0.19.2-0.19.8,
`module_inject/auto_ep_presets/base.py`) calls `registry.get(key, default)` and `registry[key] = value` with that
string itself, so `deepspeed.initialize` raises TypeError before any training. The matrix rows run with the shim
and name it; one row runs AutoEP as shipped, so the incompatibility stays a finding of its own.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path

FIRST_AUTOEP_RELEASE = "0.19.2"
"""The first DeepSpeed release that ships AutoEP (module_inject/auto_ep.py; PR deepspeedai/DeepSpeed#7938)."""
AUTOEP_MODULE = "deepspeed.module_inject.auto_ep"
MIN_TRANSFORMERS = (5, 0)
"""AutoEP's presets require the transformers 5 fused experts (min_transformers_version "5.0.0")."""
SHIM_FROM = (5, 23)
"""The first transformers whose output-capture registry DeepSpeed 0.19's AutoEP cannot use (5.23.0, 5.24.0 seen)."""
AS_SHIPPED = "5.22.2"
"""The newest transformers with which AutoEP runs as shipped (5.20.0-5.22.2 measured)."""
SIDE_INSTALL = (f"pip install --target DIR --no-deps transformers=={AS_SHIPPED}, then put DIR first on PYTHONPATH "
                "for the run")
"""How a user runs the AutoEP rows with a transformers AutoEP runs with as shipped, beside the venv's own."""
REGISTRY_ERROR = "_CanRecordRegistry"
"""What names the 5.23+ registry in the TypeError DeepSpeed's AutoEP raises."""


def installed_version(import_name: str, dist_name: str) -> str | None:
    """The version of the copy `import import_name` loads (a `pip install --target` copy first on PYTHONPATH carries
    its own dist-info beside it), never importing it; None when it is not installed."""
    spec = importlib.util.find_spec(import_name)
    if spec is None or not spec.origin:
        return None
    origin = Path(spec.origin).resolve()
    try:
        dist = importlib.metadata.distribution(dist_name)
        if Path(dist.locate_file(f"{import_name}/__init__.py")).resolve() == origin:
            return dist.version
    except importlib.metadata.PackageNotFoundError:
        pass
    for info in sorted(origin.parent.parent.glob(f"{dist_name}-*.dist-info")):
        found = re.search(r"^Version:\s*(\S+)", (info / "METADATA").read_text(errors="replace"), re.MULTILINE)
        if found:
            return found.group(1)
    return None


def transformers_version() -> str | None:
    return installed_version("transformers", "transformers")


def release(version: str | None) -> tuple[int, ...]:
    """"5.23.0" -> (5, 23, 0); what cannot be read -> ()."""
    return tuple(int(p) for p in re.findall(r"\d+", version or "")[:3])


def needs_shim(version: str | None) -> bool:
    """Whether AutoEP needs the registry shim with this transformers (5.23+)."""
    return release(version) >= SHIM_FROM


def shim_line(version: str | None) -> str:
    """The one line every row that runs with the shim names (its `transformers_shim` field)."""
    return (f"moebench's in-process shim: transformers {version}'s _CAN_RECORD_REGISTRY also takes the class-name "
            f"strings DeepSpeed's AutoEP passes (as shipped, AutoEP runs with transformers <= {AS_SHIPPED})")


def incompatibility(exc: BaseException, where: str, ds_version: str | None, tf_version: str | None) -> str | None:
    """The one-line finding when deepspeed.initialize raised the registry TypeError (None for anything else)."""
    if not isinstance(exc, TypeError) or REGISTRY_ERROR not in str(exc):
        return None
    return (f"DeepSpeed {ds_version}'s AutoEP cannot convert the model with transformers {tf_version}: "
            f"deepspeed.initialize raised TypeError: {exc} ({where}): transformers {SHIM_FROM[0]}.{SHIM_FROM[1]} keys "
            "its output-capture registry by model, AutoEP passes class-name strings; AutoEP runs as shipped with "
            f"transformers <= {AS_SHIPPED} ({SIDE_INSTALL})")


def raised_at(tb) -> str:
    """"deepspeed/module_inject/auto_ep_presets/base.py:326": the innermost frame of a traceback, from its package."""
    while tb.tb_next is not None:
        tb = tb.tb_next
    path = Path(tb.tb_frame.f_code.co_filename)
    parts = path.parts
    top = next((i for i, p in enumerate(parts) if p in ("deepspeed", "transformers", "torch")), len(parts) - 1)
    return f"{'/'.join(parts[top:])}:{tb.tb_lineno}"
