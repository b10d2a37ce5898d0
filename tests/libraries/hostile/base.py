"""What every hostile adapter here shares: a runner that passes and three rows (v0, v1, v2) at each world size."""

from __future__ import annotations

from moebench.libraries.spec import PARITY, Adapter, Row


def passing(ctx, row, opts) -> list:
    import torch

    from moebench.parity.compare import STRICT, compare

    return [compare("output", torch.ones(3), torch.ones(3), STRICT)]


def failing(ctx, row, opts) -> list:
    import torch

    from moebench.parity.compare import STRICT, compare

    return [compare("output", torch.ones(3), torch.zeros(3), STRICT)]


class Base(Adapter):
    import_name = "torch"
    runners = {PARITY: passing}

    def version(self) -> str:
        return "hostile"

    def rows(self, world_size, *, resume=False, user_config=None) -> list[Row]:
        return [Row(library=self.name, model="m", backend="-", ep_mode="-", world_size=world_size, variant=f"v{i}")
                for i in range(3)]
