"""DeepSpeed AutoEP: deepspeed.initialize raises TypeError with transformers >= 5.23 (its output-capture registry).

A tiny Mixtral (4 experts, transformers) handed to deepspeed.initialize with AutoEP on ("expert_parallel": enabled,
autoep_size 1), one process on CPU (gloo). Exit 1 (printing the error and the line that raised it) when initialize
raises; 0 when it initializes, a forward returns the router logits AutoEP's router records, and transformers'
output-capture registry holds what it held before (AutoEP retargets it for the conversion, then restores it).
Run: DS_ACCELERATOR=cpu python deepspeed-autoep-transformers-registry.py
"""
import faulthandler
import os
import re
import sys
import tempfile
import traceback

os.environ.update(DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
import deepspeed  # noqa: E402
import deepspeed.ops  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from transformers.utils import output_capturing  # noqa: E402

EXPERTS = 4


def short(key):
    """"<class 'transformers.models.mixtral.modeling_mixtral.MixtralModel'>" -> "MixtralModel"."""
    return key.split("'")[1].rsplit(".", 1)[-1] if str(key).startswith("<class '") else repr(key)


def main():
    faulthandler.dump_traceback_later(300, exit=True)  # never hangs: a traceback and exit after 300 s
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of DeepSpeed's shm comm op
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    deepspeed.utils.logger.setLevel("ERROR")
    config = transformers.MixtralConfig(vocab_size=32, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
                                        num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config)
    registry = output_capturing._CAN_RECORD_REGISTRY
    before = dict(registry)
    ds = {"train_batch_size": 1, "steps_per_print": 10**9, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
          "expert_parallel": {"enabled": True, "autoep_size": 1}}
    print(f"deepspeed {deepspeed.__version__}, transformers {transformers.__version__}: a tiny Mixtral, AutoEP "
          f"(autoep_size 1), 1 process (gloo); the registry is a {type(registry).__name__}")
    try:
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)[0]
    except Exception as exc:  # noqa: BLE001 - what initialize raised is the finding
        frames = traceback.extract_tb(exc.__traceback__)
        frame, name = frames[-1], next(f.name for f in reversed(frames) if not f.name.startswith("<"))
        path = re.sub(r".*/(?=(deepspeed|transformers)/)", "", frame.filename)
        where = f"{path}:{frame.lineno}, in {name}: {frame.line}"
        print(f"BUG: deepspeed.initialize with AutoEP raises {type(exc).__name__}: {exc} ({where})")
        return 1
    logits = engine(torch.tensor([[1, 2, 3, 4, 5]]), output_router_logits=True).router_logits
    bugs = [] if logits and logits[0].shape == (5, EXPERTS) else [f"router logits {logits!r}, not 1 of (5, 4)"]
    after = dict(registry)
    added = sorted(short(k) for k in after.keys() - before.keys())
    changed = sorted(short(k) for k in before if after.get(k, before) is not before[k])
    if added or changed:
        bugs.append(f"transformers' output-capture registry is not restored: keys {added} added, the entries of "
                    f"{changed} changed or gone")
    print("\n".join(["BUG: AutoEP initializes, but:", *bugs] if bugs else
                    ["OK: AutoEP initializes, the router logits are recorded, the registry is restored"]))
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
