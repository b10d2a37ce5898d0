"""The AutoEP matrix's shape: what the rows are built over, importable without torch (--list reads it; the repro
script pastes it above rowmath.py)."""

FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3")
"""The Hugging Face MoE families AutoEP has a preset for that are built here (Qwen2-MoE: Qwen3-MoE's preset)."""
EXPERTS = 8
"""Routed experts: divisible by every autoep_size the rows use (2 and 4)."""
STEPS = 2
"""Optimizer steps per row: the second shows whether the first step's weights were right everywhere."""
