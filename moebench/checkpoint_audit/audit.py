"""One audit over any reader's stream: per MoE layer and global expert, present once, counted alike, stored
whole, not a copy of another; chunks tile each tensor; optimizer state complete and its steps consistent.

Data is read one tensor at a time (`Stored.load`) and reduced at once to two digests per expert slice (its
values, and its values rounded to bfloat16), so memory stays at the largest tensor whatever the checkpoint's size.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from typing import Callable

from moebench.checkpoint_audit import stream as s
from moebench.checkpoint_audit.experts import Layer, layers_of, natural

Progress = Callable[[int, int, str], None]
"""progress(bytes read, bytes in all, the tensor being read)."""
ROUNDED = "bfloat16"
"""Two experts equal after rounding to bfloat16 (8 bits of mantissa) but not bit for bit are one expert written
twice through a lower precision (a bf16 copy of an fp32 replica): random distinct experts never agree there."""


def digests(t) -> tuple[str, str]:
    """(sha1 of the values as float32 with the shape, sha1 of the values rounded to bfloat16 with the shape)."""
    import torch

    head = repr(tuple(t.shape)).encode()
    exact = t.detach().contiguous().to(torch.float32) if t.is_floating_point() else t.detach().contiguous()
    rounded = t.detach().contiguous().to(torch.bfloat16) if t.is_floating_point() else exact
    return (hashlib.sha1(head + exact.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest(),
            hashlib.sha1(head + rounded.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest())


Prints = dict[str, dict[int, list[tuple[str, str, str]]]]
"""layer -> global expert -> [(tensor name's rest, exact digest, rounded digest)], in name order."""


def fingerprints(layers: dict[str, Layer], total: int, progress: Progress | None,
                 problems: list[s.Problem]) -> Prints:
    """Every expert's digests, reading each expert tensor once (a stacked one is sliced after its one read). A
    tensor whose data cannot be read is an `unreadable` problem; the others are still read."""
    out: Prints = {}
    done = 0
    for layer in layers.values():
        per = out.setdefault(layer.name, {})
        work = [(t, None, t.name.rsplit("experts.", 1)[-1]) for t in layer.stacked]
        work += [(stored[0], i, rest) for rest, by_index in layer.per_expert.items() for i, stored in by_index.items()]
        for t, index, rest in work:
            if progress:
                progress(done, total, t.name)
            try:
                value = t.load()
            except Exception as exc:  # noqa: BLE001 - damage inside a file: named, and the audit goes on
                problems.append(s.Problem(name=s.UNREADABLE, tensor=t.name, layer=layer.name,
                                          experts=[] if index is None else [index],
                                          sentence=f"{t.name} in {t.file} cannot be read: {type(exc).__name__}: "
                                                   f"{str(exc).splitlines()[0][:120] if str(exc) else ''}"))
                continue
            if index is None:
                for i in range(value.shape[0]):
                    per.setdefault(i, []).append((rest, *digests(value[i])))
            else:
                per.setdefault(index, []).append((rest, *digests(value)))
            done += t.nbytes
            del value
    if progress:
        progress(total, total, "")
    for per in out.values():
        for prints in per.values():
            prints.sort()
    return out


def expected_count(layer: Layer, given: dict[str, int]) -> tuple[int | None, dict[str, int]]:
    """(the count the layer should hold, every source's count)."""
    sources = dict(given)
    for t in layer.routers:
        sources[f"the router {t.name} {list(t.shape)}"] = t.shape[0]
    for t in layer.biases:
        sources[f"the routing bias {t.name} {list(t.shape)}"] = t.shape[0]
    for t in layer.stacked:
        sources[f"{t.name} {list(t.shape)}"] = t.shape[0]
    if layer.per_expert:
        sources["its per-expert tensors (highest index + 1)"] = max(layer.indices()) + 1
    for key in (*given, *(f"the router {t.name} {list(t.shape)}" for t in layer.routers)):
        return sources[key], sources
    return (max(sources.values()) if sources else None), sources


def check_counts(layer: Layer, given: dict[str, int]) -> list[s.Problem]:
    problems = []
    want, sources = expected_count(layer, given)
    if want is None:
        return problems
    if len(set(sources.values())) > 1:
        held = sorted(set(range(want)) - set(range(min(sources.values()))))
        said = "; ".join(f"{n} by {where}" for where, n in sources.items())
        problems.append(s.Problem(name=s.EXPERT_COUNT, layer=layer.name, experts=held[:64],
                                  tensor=next((t.name for t in layer.stacked if t.shape[0] != want), ""),
                                  sentence=f"layer {layer.name or '(top)'}: experts counted {said}"
                                           + (f"; experts {_span(held)} absent from the shorter"
                                              if held else "")))
    for rest, by_index in sorted(layer.per_expert.items()):
        missing = sorted(set(range(want)) - set(by_index))
        if missing:
            problems.append(s.Problem(name=s.MISSING_EXPERT, layer=layer.name, experts=missing,
                                      tensor=f"{layer.name}.experts.*.{rest}",
                                      sentence=f"layer {layer.name}: {rest} of expert{'s' if len(missing) > 1 else ''}"
                                               f" {_span(missing)} not in the checkpoint ({len(by_index)} of "
                                               f"{want} stored)"))
        for i, stored in sorted(by_index.items()):
            if len(stored) > 1:
                problems.append(s.Problem(name=s.DUPLICATE_EXPERT, layer=layer.name, experts=[i],
                                          tensor=stored[0].name,
                                          sentence=f"{stored[0].name}: expert {i} stored {len(stored)} times (in "
                                                   f"{', '.join(sorted({t.file for t in stored}))})"))
        kinds = {(t[0].shape, t[0].dtype) for t in by_index.values()}
        if len(kinds) > 1:
            problems.append(s.Problem(name=s.SHAPE, layer=layer.name, tensor=f"{layer.name}.experts.*.{rest}",
                                      sentence=f"layer {layer.name}: {rest} differs between experts: "
                                               + ", ".join(f"{list(sh)} {dt}" for sh, dt in sorted(kinds))))
    return problems


def check_duplicates(layer: Layer, prints: dict[int, list]) -> list[s.Problem]:
    """Two experts equal value for value (or after rounding): one rank's copy written for another."""
    problems = []
    by_exact: dict[tuple, list[int]] = {}
    by_rounded: dict[tuple, list[int]] = {}
    for i, p in sorted(prints.items()):
        by_exact.setdefault(tuple(d for _, d, _ in p), []).append(i)
        by_rounded.setdefault(tuple(r for _, _, r in p), []).append(i)
    exact_sets = [ids for ids in by_exact.values() if len(ids) > 1]
    for ids in exact_sets:
        problems.append(s.Problem(name=s.DUPLICATE_EXPERT, layer=layer.name, experts=ids, tensor=_first(layer),
                                  sentence=f"layer {layer.name}: experts {_span(ids)} are equal value for value "
                                           "(one rank's experts written for another's: a replica)"))
    for ids in by_rounded.values():
        if len(ids) > 1 and not any(set(ids) <= set(e) for e in exact_sets):
            problems.append(s.Problem(name=s.DUPLICATE_EXPERT, layer=layer.name, experts=ids, tensor=_first(layer),
                                      sentence=f"layer {layer.name}: experts {_span(ids)} are equal within "
                                               f"{ROUNDED} rounding (a replica written through a lower precision)"))
    return problems


def check_chunks(t: s.Stored, layer: Layer | None) -> list[s.Problem]:
    """The chunks tile the global shape: no element twice, none missing."""
    total = math.prod(t.shape)
    stored = sum(math.prod(c.sizes) for c in t.chunks)
    overlaps = [(a, b) for a, b in itertools.combinations(t.chunks, 2) if _intersect(a, b)] \
        if len(t.chunks) <= 512 else []
    problems = []
    where = {"tensor": t.name, "layer": layer.name if layer else ""}
    if overlaps:
        a, b = overlaps[0]
        problems.append(s.Problem(name=s.CHUNK_OVERLAP, **where, experts=_rows(a, b, t, layer),
                                  sentence=f"{t.name}: chunks at {list(a.offsets)} and {list(b.offsets)} overlap "
                                           f"({len(overlaps)} overlapping pair(s))"))
    elif stored != total:
        covered = _covered_rows(t) if layer and t in layer.stacked else set()
        held = sorted(set(range(t.shape[0])) - covered) if covered else []
        problems.append(s.Problem(name=s.CHUNK_GAP, **where, experts=held,
                                  sentence=f"{t.name}: chunks hold {stored:,} of {total:,} elements"
                                           + (f"; experts {_span(held)} are in no chunk" if held else "")))
    return problems


def _intersect(a: s.Chunk, b: s.Chunk) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes))


def _covered_rows(t: s.Stored) -> set[int]:
    return {r for c in t.chunks for r in range(c.offsets[0], c.offsets[0] + c.sizes[0])}


def _rows(a: s.Chunk, b: s.Chunk, t: s.Stored, layer: Layer | None) -> list[int]:
    if not (layer and t in layer.stacked):
        return []
    lo, hi = max(a.offsets[0], b.offsets[0]), min(a.offsets[0] + a.sizes[0], b.offsets[0] + b.sizes[0])
    return list(range(lo, hi))


def _first(layer: Layer) -> str:
    if layer.stacked:
        return layer.stacked[0].name
    rest = sorted(layer.per_expert)[0] if layer.per_expert else ""
    return f"{layer.name}.experts.*.{rest}"


def _span(ids) -> str:
    ids = sorted(ids)
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    shown = ", ".join(str(i) for i in ids[:8])
    return shown + (f" and {len(ids) - 8} more" if len(ids) > 8 else "")


def layer_order(layers: dict[str, Layer]) -> list[Layer]:
    return [layers[k] for k in sorted(layers, key=natural)]


__all__ = ["layers_of", "fingerprints", "check_counts", "check_duplicates", "check_chunks", "digests"]
