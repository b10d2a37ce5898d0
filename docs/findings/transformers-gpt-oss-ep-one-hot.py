"""transformers: GPT-OSS under expert parallelism raises in its eager experts (`one_hot` on the EP sentinel index).

A tiny GptOssForCausalLM (4 experts, top-2, random weights), loaded by `from_pretrained` with a DistributedConfig
that shards the experts over 2 ranks (router masking, outputs all-reduced), 2 processes on CPU (gloo). The same
tokens on both ranks; the logits are compared with the same model in one process. Exit 1 (printing what happened)
when a rank raises or the logits differ, 0 when they match, 2 when the experts did not get sharded (no EP to test).
Run: python transformers-gpt-oss-ep-one-hot.py
"""
import datetime
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from transformers import GptOssConfig, GptOssForCausalLM

WORLD = 2
CONFIG = dict(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
              layer_types=["full_attention"], tie_word_embeddings=False)


def parallel_kwargs():
    """from_pretrained's keywords: experts sharded over WORLD ranks, router masking, outputs all-reduced."""
    from transformers.distributed import DistributedConfig

    for kwargs in (dict(tp_size=WORLD, ep_size=WORLD, ep_implementation="all_reduce"),  # 5.23 and later
                   dict(tp_size=WORLD, enable_expert_parallel=True)):  # 5.17 - 5.19
        try:
            return dict(distributed_config=DistributedConfig(**kwargs))
        except TypeError:
            pass
    return dict(tp_plan="auto", tp_size=WORLD)  # 4.56 - 4.57: GPT-OSS's own plan shards the experts (and attention)


def load(path, **kwargs):
    try:  # the eager experts: GPT-OSS's own GptOssExperts.forward
        return GptOssForCausalLM.from_pretrained(path, experts_implementation="eager", **kwargs)
    except TypeError:  # 4.x: no choice of implementation; on CPU its experts run the same eager loop
        return GptOssForCausalLM.from_pretrained(path, **kwargs)


def rank_main(rank, folder):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    transformers.logging.set_verbosity_error()
    if rank == 0:
        torch.manual_seed(0)
        GptOssForCausalLM(GptOssConfig(**CONFIG)).save_pretrained(f"{folder}/model")
    dist.barrier()
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = load(f"{folder}/model")(tokens).logits
        parallel = load(f"{folder}/model", **parallel_kwargs())
        held = parallel.model.layers[0].mlp.experts.gate_up_proj
        held = (held.to_local() if hasattr(held, "to_local") else held).shape[0]
        if held != CONFIG["num_local_experts"] // WORLD:  # not expert-parallel: nothing to test
            line = f"SETUP: each rank holds {held} of the {CONFIG['num_local_experts']} experts: not expert-parallel"
        else:
            try:
                diff = (parallel(tokens).logits.float() - want.float()).abs().max().item()
                line = f"OK: the logits match the one-process model (max |diff| {diff:.2g})" if diff < 1e-5 else \
                    f"BUG: the expert-parallel logits differ from the one-process model's by up to {diff:.3g}"
            except Exception as e:  # noqa: BLE001 - what the user sees is the finding
                frames = traceback.extract_tb(e.__traceback__)
                frame = next((f for f in reversed(frames) if "gpt_oss" in f.filename), frames[-1])
                line = (f"BUG: the expert-parallel forward raises {type(e).__name__}: {e} "
                        f"(in {frame.name}, {os.path.basename(frame.filename)} line {frame.lineno})")
    with open(f"{folder}/rank{rank}.txt", "w") as f:
        f.write(line)
    dist.destroy_process_group()


def main():
    folder = tempfile.mkdtemp()
    mp.start_processes(rank_main, args=(folder,), nprocs=WORLD, start_method="fork")
    lines = [open(f"{folder}/rank{r}.txt").read() for r in range(WORLD)]
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {WORLD} ranks (gloo)")
    for r, line in enumerate(lines):
        print(f"rank {r}: {line}")
    if any(line.startswith("SETUP") for line in lines):
        return 2
    return 0 if all(line.startswith("OK") for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
