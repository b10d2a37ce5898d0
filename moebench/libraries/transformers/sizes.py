"""The transformers rows' tiny shapes and the backends they cover (a module of constants: build and user_setup
both read them, and neither imports the other at module level)."""

MODELS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")
# The pure-torch expert backends (config `experts_implementation`); "deepgemm" and "sonicmoe" are
# CUDA kernels (listed as skipped rows where CUDA is absent).
BACKENDS = ("eager", "grouped_mm", "batched_mm")
CUDA_BACKENDS = ("deepgemm", "sonicmoe")
EP_MODES = ("all_to_all", "all_to_all+tp", "all_reduce")

# Tiny shapes: every family's block at hidden 32 with 8 experts (divisible by W = 2 and 4), top-2.
HIDDEN = 32
EXPERT_INTERMEDIATE = 16
NUM_EXPERTS = 8
TOP_K = 2
# Tokens: each rank's part of the global batch is SEQS_PER_RANK x SEQ_LEN = 32 tokens, so at W = 2
# the 8 experts share 128 routed slots: every expert gets tokens (no vacuous, all-zero gradients).
SEQS_PER_RANK = 2
SEQ_LEN = 16
# Three SGD steps: enough for a wrong gradient to bend the loss curve, cheap at this size.
STEPS = 3
LR = 0.1
BF16_BACKEND = "grouped_mm"
"""The experts implementation of the bf16 rows: transformers' default (`get_correct_experts_implementation`)."""
USER_BIAS_SCALE = 0.01
"""A --hf-config row's DeepSeek-V3 e_score_correction_bias, N(0, 0.01^2): with 128-256 experts the gap between a
token's k-th and (k+1)-th sigmoid score is ~0.006, so the bias moves many choices without deciding them all
(at the default rows' 0.1 it decides them: measured, 80 of 256 experts never chosen)."""
