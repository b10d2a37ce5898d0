"""DeepSpeed AutoEP: a regular checkpoint load at another `autoep_size` is accepted and scrambles the experts' state.

A tiny Mixtral (8 experts, transformers) made expert-parallel by AutoEP at autoep_size 2, ZeRO stage 1 and 2, torch
AdamW, 2 processes on CPU (gloo). Train 2 steps, save_checkpoint, then load into a fresh engine at autoep_size 1 and
compare every expert's weights, fp32 master and AdamW moments with what was saved. Exit 1 (printing what differs)
when the load is accepted and something differs; 0 when everything comes back or the load is refused.
Run: DS_ACCELERATOR=cpu python deepspeed-autoep-load-other-ep-size.py
"""
import datetime
import os
import sys
import tempfile

os.environ.update(DS_ACCELERATOR="cpu")
import deepspeed  # noqa: E402
import deepspeed.ops  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import transformers  # noqa: E402

WORLD, EXPERTS = 2, 8


def registry_shim():
    """transformers >= 5.23 keys its output-capture registry by model; DeepSpeed 0.19's AutoEP passes a class name."""
    from transformers.utils import output_capturing

    cls = type(getattr(output_capturing, "_CAN_RECORD_REGISTRY", {}))
    if cls is not dict:
        get, set_ = cls.get, cls.__setitem__
        cls.get = lambda self, k, *d: dict.get(self, k, *d) if isinstance(k, str) else get(self, k)
        cls.__setitem__ = lambda self, k, v: dict.__setitem__(self, k, v) if isinstance(k, str) else set_(self, k, v)


def engine(seed, stage, ep_size):
    config = transformers.MixtralConfig(vocab_size=32, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
                                        num_experts_per_tok=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(config)
    ds = {"train_batch_size": 2 * WORLD, "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
          "expert_parallel": {"enabled": True, "autoep_size": ep_size}}
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)[0]


def full(e, p, key):
    """ZeRO 1/2: p's fp32 master (key None) or AdamW state, read from the flat partitions the optimizer steps."""
    opt, buf, m = e.optimizer, torch.zeros(p.numel()), getattr(p, "_hp_mapping", None)
    if m is not None:
        flat = opt.single_partition_of_fp32_groups[m.param_group_index]
        src = flat if key is None else opt.optimizer.state[flat][key]
        lp, hp = m.lp_fragment_address, m.hp_fragment_address
        buf.narrow(0, lp.start, lp.numel).copy_(src.detach().reshape(-1).narrow(0, hp.start, hp.numel))
    dist.all_reduce(buf, group=p._dp_group)  # each rank holds a fragment of p's partition
    return buf.view_as(p)


def experts_state(e):
    """{(parameter, global expert): {quantity: tensor}} of the experts this rank holds (every rank calls it)."""
    out = {}
    for name, p in sorted(e.module.named_parameters()):
        if ".experts." not in name:
            continue
        moe = e.module.get_submodule(name.split(".experts.")[0])
        first = moe.ep_rank * moe.num_local_experts
        q = {"weights": p.detach(), "fp32 master": full(e, p, None), "exp_avg": full(e, p, "exp_avg"),
             "exp_avg_sq": full(e, p, "exp_avg_sq")}
        for slot in range(p.shape[0]):
            out[(name, first + slot)] = {k: v[slot].clone() for k, v in q.items()}
    return out


def gathered(e):
    parts = [None] * WORLD
    dist.all_gather_object(parts, experts_state(e))
    return {k: v for part in parts for k, v in part.items()}


def check(stage, folder, rank):
    a = engine(0, stage, ep_size=2)
    for step in range(2):
        ids = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))
        a.backward(a(ids, labels=ids).loss)
        a.step()
    saved = gathered(a)
    a.save_checkpoint(folder, tag="step2")
    bugs = []
    for load_ep in (2, 1):  # the save's own autoep_size first: the control, every quantity must come back
        b = engine(1, stage, ep_size=load_ep)  # another seed: whatever the load misses stays visibly fresh
        try:
            b.load_checkpoint(folder, tag="step2")
        except Exception as err:  # noqa: BLE001 - refusing another autoep_size is a right answer
            said = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            refused = load_ep != 2 and "autoep_size" in said
            bugs.append(f"ZeRO {stage}, load at autoep_size {load_ep}: {'refused' if refused else 'raises'}: {said}")
            continue
        loaded = gathered(b)
        for q in ("weights", "fp32 master", "exp_avg", "exp_avg_sq"):
            diffs = {k: (loaded[k][q] - saved[k][q]).abs().max().item() for k in saved}
            wrong = sorted({k[1] for k, d in diffs.items() if d > 0})
            if wrong:
                bugs.append(f"ZeRO {stage}, load at autoep_size {load_ep}: {q} of experts {wrong} wrong after the "
                            f"load (max |diff| {max(diffs.values()):.3g})")
    return bugs


def rank_main(rank, folder):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no JIT build of DeepSpeed's shm comm op
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    transformers.logging.set_verbosity_error()
    registry_shim()
    lines = [line for stage in (1, 2) for line in check(stage, f"{folder}/zero{stage}", rank)]
    if rank == 0:
        with open(f"{folder}/result.txt", "w") as f:
            f.write("\n".join(lines))


def main():
    folder = tempfile.mkdtemp()
    mp.start_processes(rank_main, args=(folder,), nprocs=WORLD, start_method="fork")
    lines = open(f"{folder}/result.txt").read().splitlines()
    bugs = [line for line in lines if ": refused: " not in line]
    print(f"deepspeed {deepspeed.__version__}, transformers {transformers.__version__}: saved at autoep_size 2, "
          f"loaded at autoep_size 2 and 1, {WORLD} ranks (gloo)")
    print("\n".join(["BUG: a regular AutoEP load neither restores the experts' state nor refuses the load:", *bugs]
                    if bugs else ["OK: the saved autoep_size restores every expert; another autoep_size is refused:",
                                  *lines]))
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
