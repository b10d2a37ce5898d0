"""Verify the MoE libraries people train with: one conformance row per library version x model x
expert backend x expert-parallel mode x world size (`moebench verify-parity --library NAME`).

base.py: Row and the Adapter protocol (docs/adding-a-library.md); registry.py: which
adapters exist, whether each can run here; runner.py: rows -> parity checks -> the parity runner.
Importing this package never imports a library: adapters import theirs inside their functions.
"""
