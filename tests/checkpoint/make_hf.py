"""Real Hugging Face exports of a tiny Mixtral (a script: `python make_hf.py OUT`), through `save_pretrained`:

- contiguous/  the model as built (4 experts a layer, sharded into several safetensors files with their index);
- strided/     the same model whose experts were put in the strided order of ep_size 2 (slot j holds expert
               (j % 2) * 2 + j // 2: 0, 2, 1, 3) before the export, as an EP gather that assumes the wrong
               placement writes it.
"""

from __future__ import annotations

import sys

EXPERTS = 4


def main(out: str) -> None:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=EXPERTS,
                           num_experts_per_tok=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config)
    model.save_pretrained(f"{out}/contiguous", max_shard_size="20KB")
    order = [(j % 2) * 2 + j // 2 for j in range(EXPERTS)]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.copy_(p[order].clone())
    model.save_pretrained(f"{out}/strided", max_shard_size="20KB")


if __name__ == "__main__":
    main(sys.argv[1])
