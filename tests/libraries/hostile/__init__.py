"""Hostile adapters (issue 37): each breaks the adapter protocol, or the user's trust, one way. Used by
tests/libraries/test_hostile_adapters.py through --adapter, the Python API and moebench.testing."""
