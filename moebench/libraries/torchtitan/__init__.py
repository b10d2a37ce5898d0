"""torchtitan: listed with an honest why-not where its MoE cannot run here (no rows yet).

torchtitan 0.3.0's `MoE` (AllToAllTokenDispatcher) computes its experts in bf16 through
`torch._grouped_mm`, and `import torchtitan.models.common.moe` needs triton, which the package does
not declare. moebench never injects stand-in modules to make a library import.
"""

from __future__ import annotations

import importlib.util

from moebench.libraries.spec import Adapter, Row
from moebench.parity.registry import import_problem

MEASURED = "0.3.0"
"""The release the why-not lines describe (downloaded and read, not installed: see docs/libraries.md)."""
MOE_MODULE = "torchtitan.models.common.moe:MoE"
"""What an adapter would build on."""
PROBE_TIMEOUT_S = 60.0
"""How long the import probe may take (torch alone takes ~2 s here)."""


class TorchTitan(Adapter):
    name = "torchtitan"
    import_name = "torchtitan"
    extra = "torchtitan"
    dist_name = "torchtitan"

    def unavailable(self) -> str | None:
        if importlib.util.find_spec(self.import_name) is None:
            return (f"not installed (pip install torchtitan=={MEASURED}); no rows yet: its MoE imports triton "
                    "(undeclared) and runs experts in bf16 via torch._grouped_mm")
        # Installed: try its MoE module in a child process (never here), and say what stops it.
        problem = import_problem(MOE_MODULE, PROBE_TIMEOUT_S)
        if problem:
            return f"{MOE_MODULE.partition(':')[0]} {problem}"
        return "no adapter rows yet (its experts compute in bf16 via torch._grouped_mm)"

    runners = {}  # no rows yet

    def rows(self, world_size: int, *, resume: bool = False, user_config=None) -> list[Row]:
        return []


ADAPTER = TorchTitan()
