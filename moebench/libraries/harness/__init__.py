"""Your own expert-parallel MoE layer, verified in a few lines: `Layer(...)` is an adapter (moebench.libraries.spec)
built from the layer's factory; moebench owns everything else.

    from moebench.testing import Layer
    ADAPTER = Layer(name="my-moe", build=lambda rank, world_size, experts: MyMoE(64, experts, rank, world_size),
                    d_model=64, experts="experts", sync=my_sync)

You give: `build(rank, world_size, num_experts)`, the layer for rank `rank` of `world_size` ranks holding
`num_experts` experts in all (`build(0, 1, E)` is the same layer on one process, holding every expert); where the
experts' parameters live (`experts`: the ModuleList's name, or {parameter name: the dimension its experts are
stacked along}); which global expert a local slot holds (`layout`: "contiguous", "strided" or a function
(rank, slot, world_size, num_experts) -> expert); optionally your gradient sync, optimizers and clip.

moebench does the rest (run.py): every expert seeded by its GLOBAL index on both sides (the router and every other
parameter by its name), the data (a seeded global batch, each rank its slice), the one-process reference, SGD and
Adam steps (and your clip), every comparison by global index (output, input gradient, router, experts, weights
after each step), a save -> load -> continue round trip of the layer's state dict (at the same world size, slot by
slot, and consolidated onto one process), `--seed` and `--tolerance`; and, because it owns the reference, the
known-wrong answers that name a failure without a hint from you (known.py): a router gradient from this rank's
tokens alone (rank-local), gradients through this rank's own experts only (gather-backward-unreduced; an
all-to-all whose backward keeps its own slots: missing-backward-exchange), a router gradient that is exactly zero
(router-detached), a dispatch whose local -> global map is not the weights' (permutation, slot by slot), x W and
/ W. The rows run through `--adapter`, an entry point, `moebench.testing` and pytest alike.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Any, Callable, Mapping, Sequence

from moebench.libraries.harness import run
from moebench.libraries.harness.common import SYNC_NONE, SYNC_STANDARD
from moebench.libraries.spec import RESUME, Adapter, Row, Settings

LAYER = "layer"
"""Row kind: the layer over the ranks against the one-process layer, through its steps."""
OPTIMIZERS = ("sgd", "adam")
"""The optimizers a Layer's rows step with (each on both sides)."""
STEPS = 2
TOKENS_PER_RANK = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerSettings(Settings):
    """What a harness row runs with (its --json record's fields)."""

    experts_per_rank: int
    optimizer: str
    clip: bool = False
    layout: str = "contiguous"
    steps: int = STEPS
    tokens_per_rank: int = TOKENS_PER_RANK


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToOneProcess(LayerSettings):
    """A resume row whose checkpoints (every rank's) are loaded into the one-process layer."""

    load_ep_size: int = 1


class Layer(Adapter):
    """An adapter built from a layer's factory (see the module docstring)."""

    def __init__(self, name: str, build: Callable[[int, int, int], Any], *, d_model: int,
                 experts: str | Mapping[str, int] = "experts", layout: str | Callable[[int, int, int, int], int] =
                 "contiguous", experts_per_rank: Sequence[int] = (1, 2), sync: str | Callable[[Any], None] =
                 SYNC_STANDARD, optimizers: Sequence[str] = OPTIMIZERS, clip: Callable[[Any, float], Any] | None =
                 None, resume: bool = True, version: str | None = None, import_name: str | None = None,
                 steps: int = STEPS, tokens_per_rank: int = TOKENS_PER_RANK, catches: str | None = None) -> None:
        problem = _problem(build=build, d_model=d_model, experts=experts, layout=layout,
                           experts_per_rank=experts_per_rank, sync=sync, optimizers=optimizers, clip=clip,
                           steps=steps, tokens_per_rank=tokens_per_rank)
        if problem:
            raise TypeError(f"Layer {name!r}: {problem}")
        self.name = name
        self.build = build
        self.d_model = d_model
        self.experts = experts if isinstance(experts, str) else dict(experts)
        self.layout = layout
        self.experts_per_rank = tuple(experts_per_rank)
        self.sync = sync
        self.optimizers = tuple(optimizers)
        self.clip = clip
        self.with_resume = resume
        self._version = version
        module = (getattr(build, "__module__", None) or "torch").split(".")[0]
        self.import_name = import_name or ("torch" if module == "__main__" else module)
        self.steps = steps
        self.tokens_per_rank = tokens_per_rank
        self.catches = catches or ("an expert-parallel layer whose outputs, gradients, steps or state dict differ "
                                   "from the same layer on one process")
        self.runners = {LAYER: lambda ctx, row, opts: run.parity(self, ctx, row, opts),
                        RESUME: lambda ctx, row, opts: run.resume(self, ctx, row, opts)}

    @property
    def layout_label(self) -> str:
        return self.layout if isinstance(self.layout, str) else "custom"

    def version(self) -> str | None:
        if self._version is not None:
            return self._version
        try:
            return importlib.metadata.version(self.import_name)
        except importlib.metadata.PackageNotFoundError:
            return "-"

    def rows(self, world_size: int, *, resume: bool = False, user_config=None) -> list[Row]:
        if world_size < 2:
            return []
        out = []
        backends = [*self.optimizers, *(["sgd-clip"] if self.clip is not None else [])]
        for k in self.experts_per_rank:
            for backend in backends:
                settings = LayerSettings(experts_per_rank=k, optimizer=backend.split("-")[0], clip="clip" in backend,
                                         layout=self.layout_label, steps=self.steps,
                                         tokens_per_rank=self.tokens_per_rank)
                out.append(Row(library=self.name, model="layer", backend=backend, ep_mode=_ep_mode(self, k),
                               world_size=world_size, kind=LAYER, settings=settings))
        if self.with_resume or resume:
            k = max(self.experts_per_rank)
            for variant, optimizer, kind in (("resume", "adam", LayerSettings), ("resume-to-1", "sgd", ToOneProcess)):
                settings = kind(experts_per_rank=k, optimizer=optimizer, layout=self.layout_label, steps=self.steps,
                                tokens_per_rank=self.tokens_per_rank)
                out.append(Row(library=self.name, model="layer", backend=optimizer, ep_mode=_ep_mode(self, k),
                               world_size=world_size, kind=RESUME, settings=settings, variant=variant,
                               features=("resume",)))
        return out


def _ep_mode(spec: Layer, k: int) -> str:
    return f"E={k if k > 1 else ''}W"  # the layout is in the row's settings (one per Layer)


def _problem(*, build, d_model, experts, layout, experts_per_rank, sync, optimizers, clip, steps,
             tokens_per_rank) -> str:
    """Why these arguments cannot make a Layer ("" when they can)."""

    def positive_int(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 1

    if not callable(build):
        return "build must be a function (rank, world_size, num_experts) -> the layer"
    if not positive_int(d_model):
        return f"d_model must be a positive int, got {d_model!r}"
    if isinstance(experts, str):
        if not experts:
            return "experts must name the ModuleList holding the experts, or map stacked parameters to a dim"
    elif not (isinstance(experts, Mapping) and experts and all(isinstance(k, str) and isinstance(v, int)
                                                                 for k, v in experts.items())):
        return "experts must be a ModuleList's name, or {parameter name: the dim its experts are stacked along}"
    if not (layout in ("contiguous", "strided") or callable(layout)):
        return f"layout must be 'contiguous', 'strided' or a function (rank, slot, world_size, E), got {layout!r}"
    if not (isinstance(experts_per_rank, (list, tuple)) and experts_per_rank
            and all(positive_int(k) and k <= 16 for k in experts_per_rank)):
        return "experts_per_rank must be a list of ints from 1 to 16"
    if not (sync in (SYNC_STANDARD, SYNC_NONE) or callable(sync)):
        return f"sync must be {SYNC_STANDARD!r}, {SYNC_NONE!r} or a function (layer) -> None"
    if not (isinstance(optimizers, (list, tuple)) and optimizers and all(o in OPTIMIZERS for o in optimizers)):
        return f"optimizers must be a list from {OPTIMIZERS}"
    if clip is not None and not callable(clip):
        return "clip must be a function (layer, max_norm) that clips the layer's gradients in place"
    if not (positive_int(steps) and steps <= 10 and positive_int(tokens_per_rank) and tokens_per_rank <= 4096):
        return "steps must be 1 to 10 and tokens_per_rank 1 to 4096"
    return ""
