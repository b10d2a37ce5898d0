"""moebench's version (one place: the package, the results files and the reproduction scripts read it here)."""

__version__ = "0.1.0"
