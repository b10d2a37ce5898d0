"""Only what pyproject.toml cannot say: the top-level experiments/ folder ships inside the wheel as
the package `moebench.experiments` (its presets are package data, read with importlib.resources)."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["moebench", "moebench.*"]) + ["moebench.experiments"],
    package_dir={"moebench.experiments": "experiments"},  # its presets: package-data in pyproject.toml
)
