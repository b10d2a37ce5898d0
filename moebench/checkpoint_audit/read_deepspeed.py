"""DeepSpeed checkpoints, regular and universal, read with `torch.load(mmap=True, weights_only=True)`.

Regular (a tag folder): mp_rank_<tp>_model_states.pt (the dense module, persistent buffers, `num_experts`, the
ds_config), layer_<l>_expert_<e>_mp_rank_<tp>_model_states.pt (one file per global expert), and the optimizer:
expp_rank_<r>_mp_rank_<tp>_optim_states.pt without ZeRO (torch's optimizer state by position, one file per EP
rank), zero_pp_rank_<d>_mp_rank_<tp>_optim_states.pt with ZeRO (flat partitions: their files are checked, not
their contents, which need DeepSpeed's own classes to unpickle).
Universal (ds_to_universal's output): zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt, one folder per parameter,
and the model_states file, whose module tensors that have no zero/ folder are buffers a universal load skips.
"""

from __future__ import annotations

import re
from pathlib import Path

from moebench.checkpoint_audit import stream as s
from moebench.checkpoint_audit.experts import per_expert

MODEL_STATES = re.compile(r"^mp_rank_(?P<tp>\d+)_model_states\.pt$")
EXPERT_FILE = re.compile(r"^layer_(?P<layer>\d+)_expert_(?P<expert>\d+)_mp_rank_(?P<tp>\d+)_model_states\.pt$")
EXPERT_OPTIM = re.compile(r"^expp_rank_(?P<rank>\d+)_mp_rank_(?P<tp>\d+)_optim_states\.pt$")
ZERO_OPTIM = re.compile(r"^zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<tp>\d+)_optim_states\.pt$")
GLOBAL_EXPERT = re.compile(r"deepspeed_experts\.(\d+)\.")
EP_GROUP = re.compile(r"^ep_size_(\d+)$")

_cache: dict[str, object] = {}


def _load(path: Path):
    """One file, memory-mapped (a tensor's pages are read when touched); the last file read is kept, so the
    tensors of one file are read in one pass and memory holds one file's map at a time."""
    import torch

    key = str(path)
    if key not in _cache:
        _cache.clear()
        _cache[key] = torch.load(key, map_location="cpu", mmap=True, weights_only=True)
    return _cache[key]


def _readable(path: Path, problems: list[s.Problem], *, layer: int | None = None, expert: int | None = None):
    """One file's content, or None with the file named as unreadable (cut short, not a pickle torch reads)."""
    try:
        return _load(path)
    except Exception as exc:  # noqa: BLE001 - damage inside one file: named, and the others are still read
        size = path.stat().st_size
        what = f" (layer {layer}, expert {expert})" if expert is not None else ""
        problems.append(s.Problem(name=s.UNREADABLE, tensor=path.name, experts=[] if expert is None else [expert],
                                  layer="" if layer is None else f"MoE layer {layer}",
                                  sentence=f"{path.name}{what} cannot be read ({size:,} bytes; {type(exc).__name__}: "
                                           f"{str(exc).splitlines()[0][:100] if str(exc) else ''})"))
        return None


def _pick(path: Path, *keys):
    def load():
        value = _load(path)
        for k in keys:
            value = value[k]
        return value
    return load


def _stored(name: str, tensor, path: Path, folder: Path, load, **extra) -> s.Stored:
    shape = tuple(int(x) for x in tensor.shape)
    return s.Stored(name=name, shape=shape, dtype=str(tensor.dtype).removeprefix("torch."),
                    chunks=(s.Chunk((0,) * len(shape), shape),), load=load, file=str(path.relative_to(folder)),
                    **extra)


def _model_states(folder: Path) -> tuple[Path, dict]:
    files = sorted(p for p in folder.iterdir() if MODEL_STATES.match(p.name))
    return files[0], _load(files[0])


def _saved(state: dict, tp_files: int) -> dict:
    config = state.get("ds_config") or {}
    zero = (config.get("zero_optimization") or {}).get("stage", 0) if isinstance(config, dict) else None
    return {"zero_stage": zero, "dp_world_size": state.get("dp_world_size"), "tp_size": tp_files,
            "ds_version": state.get("ds_version")}


def _counts(state: dict) -> dict[str, int]:
    counts = state.get("num_experts")
    if isinstance(counts, list) and counts and len(set(counts)) == 1 and isinstance(counts[0], int):
        return {"num_experts (model_states)": counts[0]}
    return {}


def read_regular(folder: Path) -> s.Checkpoint:
    _cache.clear()
    main, state = _model_states(folder)
    buffers = set(state.get("buffer_names") or [])
    tensors = [_stored(n, t, main, folder, _pick(main, "module", n), role=s.BUFFER if n in buffers else s.PARAM)
               for n, t in (state.get("module") or {}).items() if hasattr(t, "shape")]
    problems: list[s.Problem] = []
    for path in sorted(folder.iterdir(), key=lambda p: p.name):
        m = EXPERT_FILE.match(path.name)
        if not m or m.group("tp") != "00":
            continue
        expert = int(m.group("expert"))
        content = _readable(path, problems, layer=int(m.group("layer")), expert=expert)
        for name, t in (content or {}).items():
            held = per_expert(name)  # deepspeed_experts.<e>.w1.weight (native MoE), experts.w1.<e> (AutoEP)
            if held and int(held.group("index")) != expert:
                problems.append(s.Problem(name=s.PERMUTATION, tensor=name, experts=[expert, int(held.group("index"))],
                                          sentence=f"{path.name} holds {name} (expert {held.group('index')}'s), "
                                                   f"where expert {expert}'s belongs"))
            tensors.append(_stored(name, t, path, folder, _pick(path, name)))
    tp_files = sum(1 for p in folder.iterdir() if MODEL_STATES.match(p.name))
    saved = _saved(state, tp_files)
    optim, ep = _optimizer(folder, saved, problems)
    _zero_files(folder, saved, problems)
    ep = ep or _ep_from_shapes(state)
    tensors += optim
    autoep = state.get("ds_autoep_layers") or []
    if autoep and isinstance(autoep, list) and isinstance(autoep[0], dict):
        ep = autoep[0].get("ep_size", ep)
    saved = {"ep_size": ep, **saved}
    loads = [f"ZeRO stage {saved['zero_stage']} only (another stage is refused)",
             "the module weights at any ep_size (one file per global expert)"]
    if autoep:
        loads.append(f"trap: AutoEP at autoep_size {ep} only; DeepSpeed does not check the autoep_size it loads "
                     "at, and another one restores the wrong experts' state")
    elif ep is not None:
        loads.append(f"trap: with its optimizer state at ep_size {ep} only (the optimizer files are per EP rank, by "
                     "position)")
    if saved.get("zero_stage") in (1, 2):
        loads.append("ds_to_universal converts it for another DP degree; a universal load does not restore "
                     "persistent buffers")
    return s.Checkpoint(format="deepspeed", path=str(folder), tensors=tensors, problems=problems, saved=saved,
                        loads=loads, config_experts=_counts(state))


def _optimizer(folder: Path, saved: dict, problems: list[s.Problem]) -> tuple[list[s.Stored], int | None]:
    """The expp_rank optimizer files (no ZeRO): every parameter's state, by position, and the EP degree."""
    tensors, ep = [], None
    expp = sorted((p for p in folder.iterdir() if EXPERT_OPTIM.match(p.name)), key=lambda p: p.name)
    for path in expp:
        optimizer = (_readable(path, problems) or {}).get("optimizer") or {}
        state = optimizer.get("state") or {}
        for group in optimizer.get("param_groups") or []:
            m = EP_GROUP.match(str(group.get("name", "")))
            if m:
                ep = int(m.group(1))
            for index in group.get("params", []):
                of = f"{path.name} parameter #{index} (group {group.get('name', '?')})"
                entry = state.get(index)
                if not entry:
                    problems.append(s.Problem(name=s.MISSING_STATE, tensor=of, sentence=f"{of}: no optimizer state"))
                    continue
                for q, value in entry.items():
                    if q in s.OPTIMIZER_ROLES and hasattr(value, "shape"):
                        tensors.append(_stored(f"{of} {q}", value, path, folder,
                                               _pick(path, "optimizer", "state", index, q), role=q, of=of,
                                               group=f"{path.name}:{id(value)}" if q == s.STEP else ""))
    if expp and ep is None:
        ep = len(expp)
    return tensors, ep


def _ep_from_shapes(state: dict) -> int | None:
    """ZeRO saves rank 0's parameter shapes: its local expert slots and the global count give the EP degree."""
    local = {int(m.group(1)) for group in state.get("param_shapes") or [] if hasattr(group, "keys")
             for name in group.keys() for m in [GLOBAL_EXPERT.search(str(name))] if m}
    counts = _counts(state)
    return next(iter(counts.values())) // len(local) if local and counts else None


def _zero_files(folder: Path, saved: dict, problems: list[s.Problem]) -> None:
    """ZeRO's optimizer files: one per DP rank (their flat partitions need DeepSpeed's classes to unpickle)."""
    zero = sorted(int(m.group("rank")) for p in folder.iterdir() for m in [ZERO_OPTIM.match(p.name)] if m
                  and m.group("tp") == "00")
    world = saved.get("dp_world_size")
    if saved.get("zero_stage") and isinstance(world, int):
        absent = sorted(set(range(world)) - set(zero))
        if absent:
            first = f"zero_pp_rank_{absent[0]}_mp_rank_00_optim_states.pt"
            problems.append(s.Problem(name=s.MISSING_FILE, tensor=first,
                                      sentence=f"ZeRO optimizer partitions of DP rank(s) {absent} are not there "
                                               f"({len(zero)} of {world}): their share of every parameter's "
                                               "optimizer state is lost"))


def read_universal(folder: Path) -> s.Checkpoint:
    _cache.clear()
    main, state = _model_states(folder)
    buffers = set(state.get("buffer_names") or [])
    module = {n: v for n, v in (state.get("module") or {}).items() if hasattr(v, "shape")}
    tensors, problems, params = [], [], set()
    for param_dir in sorted((p for p in (folder / "zero").iterdir() if p.is_dir()), key=lambda p: p.name):
        name = param_dir.name
        params.add(name)
        if not (param_dir / "fp32.pt").is_file():
            problems.append(s.Problem(name=s.MISSING_FILE, tensor=name,
                                      sentence=f"zero/{name}/fp32.pt is not there: the parameter is lost"))
        for q, role in (("fp32", s.PARAM), (s.EXP_AVG, s.EXP_AVG), (s.EXP_AVG_SQ, s.EXP_AVG_SQ), (s.STEP, s.STEP)):
            path = param_dir / f"{q}.pt"
            if not path.is_file() or (name in buffers and role != s.PARAM):
                continue
            value = _load(path)
            keys = ("param",) if isinstance(value, dict) else ()
            tensor = value["param"] if keys else value
            role = s.BUFFER if name in buffers and role == s.PARAM else role
            tensors.append(_stored(name if role in (s.PARAM, s.BUFFER) else f"{name} {q}", tensor, path, folder,
                                   _pick(path, *keys), role=role, of=name if role in s.OPTIMIZER_ROLES else None))
    for n in sorted(buffers):
        where = f"zero/{n}/fp32.pt holds its value, but" if n in params else f"it is only in {main.name}:"
        problems.append(s.Problem(name=s.NOT_RESTORED, tensor=n,
                                  sentence=f"persistent buffer {n}: {where} a universal load restores the "
                                           "optimizer's parameters only, so it comes back as its initial value"))
        if n not in params and n in module:
            tensors.append(_stored(n, module[n], main, folder, _pick(main, "module", n), role=s.BUFFER))
    saved = _saved(state, sum(1 for p in folder.iterdir() if MODEL_STATES.match(p.name)))
    loads = ["any DP degree and ZeRO stage 1 or 2 (load_universal: true): parameters and optimizer state from zero/",
             "trap: persistent buffers are not restored by a universal load"]
    return s.Checkpoint(format="deepspeed-universal", path=str(folder), tensors=tensors, problems=problems,
                        saved=saved, loads=loads, config_experts=_counts(state))
