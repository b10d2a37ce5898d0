"""Imported in the parent before a row's ranks fork (the adapter's `preload`): megatron-core's modules a row uses,
through standins.import_megatron (its import warnings silenced; the stand-in triton only while it imports, where
triton is missing and the release imports it). Importing it takes ~3 s; each forked rank inherits it."""

from __future__ import annotations

from moebench.libraries.megatron.api import MODULES
from moebench.libraries.megatron.standins import import_megatron

import_megatron(*MODULES)
