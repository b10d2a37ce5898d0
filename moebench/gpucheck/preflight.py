"""The first thing `make gpu-check` and `moebench gpu-check` do: is there a CUDA GPU torch can use?

    python -m moebench.gpucheck.preflight          # exit 0 and one line of facts, or exit 2 and
                                                   # "error: no CUDA GPU: ..." (nothing is created)
    python -m moebench.gpucheck.preflight --make   # "ok ..." or the refusal, for the Makefile

Standard library only until torch itself is imported, so that the Makefile can run it with the
interpreter it is given (PYTHON=) before anything is installed: `PYTHONPATH=. python -m ...`.
"""

from __future__ import annotations

import dataclasses
import sys

REFUSAL = "no CUDA GPU"
"""How every refusal of a machine without a usable CUDA GPU starts (after `error: `)."""
EXIT_REFUSED = 2
"""The exit code of a refusal: like bad input, nothing ran and nothing was written."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gpus:
    """What torch says about CUDA on this interpreter."""

    python: str
    torch: str | None
    """torch.__version__, or None when torch does not import."""
    torch_cuda: str | None
    """torch.version.cuda (None for a CPU build)."""
    count: int
    names: tuple[str, ...] = ()
    import_error: str = ""


def probe() -> Gpus:
    """torch's view of CUDA: version, build, visible GPUs (imports torch; initialises no CUDA context
    beyond what `torch.cuda.is_available()` and the device names need)."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken install raising anything
        return Gpus(python=sys.executable, torch=None, torch_cuda=None, count=0,
                    import_error=f"{type(exc).__name__}: {exc}".splitlines()[0][:160])
    cuda = torch.version.cuda
    count = torch.cuda.device_count() if cuda and torch.cuda.is_available() else 0
    names = tuple(torch.cuda.get_device_name(i) for i in range(count))
    return Gpus(python=sys.executable, torch=torch.__version__, torch_cuda=cuda, count=count, names=names)


def refusal(gpus: Gpus) -> str | None:
    """The one-line refusal (without `error: `) when `gpus` has no CUDA GPU torch can use, else None."""
    if gpus.torch is None:
        return f"{REFUSAL}: {gpus.python} has no torch; pass PYTHON= one with a CUDA torch"
    if not gpus.torch_cuda:
        return f"{REFUSAL}: torch {gpus.torch} is a CPU build; pass PYTHON= one with a CUDA torch"
    if gpus.count == 0:
        return f"{REFUSAL}: torch {gpus.torch} (CUDA {gpus.torch_cuda}) sees none; check nvidia-smi"
    return None


def describe(gpus: Gpus) -> str:
    """One line of facts for a machine that has GPUs."""
    names = ", ".join(dict.fromkeys(gpus.names))
    return f"{gpus.count} CUDA GPU(s) ({names}); torch {gpus.torch}, CUDA {gpus.torch_cuda}"


def main(argv: list[str] | None = None) -> int:
    """`--make`: print "ok <facts>" or the bare refusal on stdout, always exit 0 (the Makefile reads
    it with $(shell) and refuses with $(error): one line, exit 2)."""
    args = argv if argv is not None else sys.argv[1:]
    gpus = probe()
    refused = refusal(gpus)
    if "--make" in args:
        print(refused if refused is not None else f"ok {describe(gpus)}")
        return 0
    if refused is not None:
        print(f"error: {refused}", file=sys.stderr)
        return EXIT_REFUSED
    print(describe(gpus))
    return 0


if __name__ == "__main__":
    sys.exit(main())
