"""fairscale: `MOELayer` with `Top2Gate` and its `_AllToAll`, experts spread over the ranks, vs one
process with identical weights.

What runs on each of the W ranks is what fairscale's users write: `MOELayer(Top2Gate(d_model, E),
ModuleList(this rank's experts))` over the default group (gloo), each rank on its own tokens.
fairscale leaves gradient synchronisation to the user, and marks expert parameters `p.expert = True`
so a data-parallel wrapper can skip them; `sync_gradients` below is that wrapper: parameters not
marked are averaged over the ranks (DDP's convention), marked ones already hold the sum over every
rank's tokens (the backward all-to-all brought them) and are divided by W. W ranks then train like
one process on the global batch.

The reference is plain math on one process, written independently of fairscale: softmax gate, top-1
by argmax, top-2 by argmax over the logits plus the same Gumbel noise (drawn from the same seed),
GShard's capacity 2S/E with first-come slots and kept gates renormalised, every expert on every token,
the kept ones mixed. fairscale's capacity is PER RANK (S is the rank's token count; its queue order
is the rank's), so the reference gates each rank's tokens separately, exactly as that rank does, and
sums over ranks for the loss: the one-process model of W ranks, not of one rank holding the whole
batch (that would keep other tokens).

Compared on every rank, for STEPS plain SGD steps from identical weights: the loss, the output,
the input gradient, the gate's gradient, every expert's gradient by its GLOBAL expert index and
fairscale's own parameter name, and the weights after each step (each step then restarts from the
reference's weights, so a wrong gradient is named as itself, not as everything wrong after it).
The auxiliary loss `l_aux` is not part of the loss.

The package's files: __init__.py the adapter; parity.py the rows' model, reference and rank code; resume.py the
resume row (a state_dict round trip).
"""

from __future__ import annotations

import dataclasses

from moebench.libraries.fairscale.releases import COMPATIBILITY
from moebench.libraries.spec import PARITY, RESUME, Adapter, Row, Settings

EXPERTS_PER_RANK = (1, 2)
"""The rows: one expert per rank (E = W), two (E = 2W)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerSettings(Settings):
    experts_per_rank: int
    """Experts each rank holds: E = experts_per_rank x W."""


def ep_mode(per_rank: int) -> str:
    """"a2a-E=W" (one expert per rank), "a2a-E=2W" (two): MOELayer's all-to-all over E experts."""
    return f"a2a-E={'' if per_rank == 1 else per_rank}W"


class Fairscale(Adapter):
    name = "fairscale"
    compatibility = COMPATIBILITY
    import_name = "fairscale"
    extra = "fairscale"
    dist_name = "fairscale"
    catches = ("a fairscale MOELayer whose all-to-all, gate or gradient sync leaves outputs or "
               "gate/expert gradients different from one process")
    runners = {PARITY: "moebench.libraries.fairscale.parity:run", RESUME: "moebench.libraries.fairscale.resume:run"}

    def rows(self, world_size: int, *, resume: bool = False, user_config=None) -> list[Row]:
        if world_size < 2:  # one rank exchanges with nobody: nothing expert-parallel to verify
            return []
        rows = [Row(library=self.name, model="top2gate", backend="-", ep_mode=ep_mode(n), world_size=world_size,
                    features=("loss-curve",), settings=LayerSettings(experts_per_rank=n)) for n in EXPERTS_PER_RANK]
        if resume:  # a state_dict round trip (resume.py)
            from moebench.libraries.fairscale.resume import PER_RANK, resume_row

            rows.append(resume_row(world_size, ep_mode(PER_RANK)))
        return rows

    def repro_script(self, row: Row, seed: int) -> str | None:
        """A standalone script reproducing a float32 row over gloo vs one process (libraries/repro)."""
        if row.kind != PARITY:
            return None
        from moebench.libraries.fairscale.parity import STEPS
        from moebench.libraries.repro import fill

        return fill("fairscale_moe", {"experts_per_rank": row.settings.experts_per_rank, "world_size": row.world_size,
                                      "seed": seed, "steps": STEPS}, key=row.key())


ADAPTER = Fairscale()
