"""moebench: reproduce and verify the Mixture-of-Experts experiments of "chapter 6".

The Python API (docs/api.md), each returning what its command prints with `--json`:
`moebench.run(variant, preset=None, **settings)`, `moebench.verify_parity(...)`,
`moebench.env_check(...)`, `moebench.checkpoint(path, ...)`. They are imported on first use:
`import moebench` loads no torch.
"""

from moebench.version import __version__

_API = ("run", "verify_parity", "env_check", "checkpoint")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        from moebench import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
