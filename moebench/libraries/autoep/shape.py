"""The AutoEP matrix's shape: what the rows are built over, importable without torch (--list reads it; the repro
script pastes it above rowmath.py)."""

FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3")
"""The Hugging Face MoE families AutoEP has a preset for that are built here (Qwen2-MoE: Qwen3-MoE's preset)."""
EXPERTS = 8
"""Routed experts: divisible by every autoep_size the rows use (2 and 4)."""
SEQS = 4
"""Sequences in one rank's micro-batch of the default rows (rowmath.SEQS, of SEQ_LEN tokens)."""
STEPS = 2
"""Optimizer steps per row: the second shows whether the first step's weights were right everywhere."""
CLIP = 0.5
"""gradient_clipping of a clip row: the reference's unclipped global norm is 1.4-2.6 on these models and data
(measured, every family, both steps), so the clip binds at every step (asserted in the row)."""
