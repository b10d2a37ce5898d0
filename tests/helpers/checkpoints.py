"""Small safetensors checkpoints written directly (no model built, no child process: a fraction of a second), and
their audits by the real core (`moebench checkpoint` in process), for the tests that read audits back (the report's
checkpoint section). tests/checkpoint/ has the frameworks' own saves; these are the cheap stand-ins.

Keys are a Mixtral export's: `model.layers.<l>.block_sparse_moe.gate.weight` and
`model.layers.<l>.block_sparse_moe.experts.<e>.w1.weight` / `.w2.weight`. Write them outside a test's tmp_path:
its results files are checked against moebench's schemas after the test, by file name."""

from __future__ import annotations

from pathlib import Path

EXPERTS = 4
LAYERS = 2


def write_safetensors(folder: Path, *, drop: int | None = None, duplicate: tuple[int, int] | None = None,
                      order: list[int] | None = None) -> Path:
    """A checkpoint folder of LAYERS MoE layers of EXPERTS experts: `drop` leaves that expert out of every layer
    (missing-expert), `duplicate` (a, b) writes expert a's tensors as expert b's (duplicate-expert), `order` stores
    slot j's expert as order[j] (a permutation, for --against)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}.block_sparse_moe"
        tensors[f"{prefix}.gate.weight"] = torch.randn(EXPERTS, 8, generator=generator)
        experts = {e: {w: torch.randn(8, 8, generator=generator) for w in ("w1", "w2")} for e in range(EXPERTS)}
        if duplicate is not None:
            experts[duplicate[1]] = {w: t.clone() for w, t in experts[duplicate[0]].items()}
        for slot in range(EXPERTS):
            expert = slot if order is None else order[slot]
            if expert == drop:
                continue
            for w, t in experts[expert].items():
                tensors[f"{prefix}.experts.{slot}.{w}.weight"] = t
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def audited(folder: Path, root: Path, against: Path | None = None) -> tuple[dict, Path]:
    """(the audit's document, its run folder) of `moebench checkpoint FOLDER [--against]` into results root `root`."""
    from moebench.checkpoint_audit.run import audit_checkpoint

    document, _ = audit_checkpoint(str(folder), against=None if against is None else str(against),
                                   results_dir=str(root))
    return document, Path(document["results_path"]).parent
