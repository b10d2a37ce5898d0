"""The chapter's environment beside this one, as information (differences are expected, never a failure)."""

from __future__ import annotations

from typing import Callable

from moebench.envcheck.check import OK, REFERENCE, Check

# Chapter 6, "code verification" notes (shared/seeds/004): the environment its figures come from.
CHAPTER_TORCH = "2.2.2+cu121"
CHAPTER_CUDA = "12.3"
CHAPTER_NCCL = "2.19.3"
CHAPTER_HARDWARE = "Intel Xeon Gold 6142, NVIDIA RTX 3090"


def _row(check_id: str, title: str, chapter: str, here: str, same: bool) -> Check:
    return Check(id=check_id, section=REFERENCE, title=title, status=OK,
                 found=f"{here} (same as the chapter)" if same else f"{here} (differs)",
                 required=f"information only: the chapter used {chapter}",
                 data={"chapter": chapter, "here": here, "same": same})


def checks(lookup: Callable[[str], Check | None]) -> list[Check]:
    def data(check_id: str) -> dict:
        found = lookup(check_id)
        return found.data if found else {}

    torch_here = data("torch.version").get("version") or "?"
    nvcc = data("cuda.nvcc").get("release")
    torch_cuda = data("torch.cuda_build").get("torch_cuda")
    cuda_here = f"nvcc {nvcc or 'none'}, torch built for CUDA {torch_cuda or 'none (CPU)'}"
    nccl_here = data("comm.nccl_version").get("version") or "none"
    gpus = data("cuda.devices").get("nvidia_smi_gpus") or []
    cpu = data("platform.cpu").get("model", "?")
    hardware = f"{cpu}, " + (", ".join(g.get("name", "?") for g in gpus) or "no GPU")
    return [
        _row("reference.torch", "torch", CHAPTER_TORCH, torch_here, torch_here == CHAPTER_TORCH),
        _row("reference.cuda", "CUDA", CHAPTER_CUDA, cuda_here, nvcc == CHAPTER_CUDA),
        _row("reference.nccl", "NCCL", CHAPTER_NCCL, nccl_here, nccl_here == CHAPTER_NCCL),
        _row("reference.hardware", "hardware", CHAPTER_HARDWARE, hardware, False),
    ]
