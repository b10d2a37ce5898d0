"""The fastmoe variant: the chapter's fastmoe Transformer-MoE (sections 6.4.1, 6.4.3, 6.4.4).

The real `fmoe` runs where it can (CUDA with fastmoe's ops built); elsewhere moebench's port of
its algorithm (moebench/models/moe/) runs. Every console line and results file names which.
"""

from __future__ import annotations

import dataclasses

from moebench import published
from moebench.variants.fastmoe.config import FastMoERunConfig


class FastMoEVariant:
    name = "fastmoe"
    description = "Train the fastmoe Transformer-MoE (real fmoe on CUDA, else moebench's port)."
    requires = ("torch",)
    default_preset = "quick"
    config_cls = FastMoERunConfig
    published = published.FASTMOE

    def file_values(self, explicit: dict, config: FastMoERunConfig) -> dict:
        return {}  # fastmoe's config names no files

    def file_notes(self, values: dict, preset_config: FastMoERunConfig) -> list[str]:
        return []

    def prepare(self, config: FastMoERunConfig) -> FastMoERunConfig:
        from moebench.distributed.launch import resolve_placement
        from moebench.models.moe import resolve_moe_impl

        launch = config.launch
        device, comm = resolve_placement(launch.world_size, launch.device, launch.comm_backend)
        impl = resolve_moe_impl(config.moe.moe_impl, device=device, world_size=launch.world_size)
        return dataclasses.replace(config, moe=dataclasses.replace(config.moe, moe_impl=impl),
                                   launch=dataclasses.replace(launch, device=device, comm_backend=comm))

    def rank_fn(self):
        from moebench.variants.fastmoe.rank import train_rank

        return train_rank

    def step_parts(self, config):
        from moebench.variants.fastmoe.rank import step_parts

        return step_parts(config)

    def headline(self, config: FastMoERunConfig) -> str:
        moe, launch, train = config.moe, config.launch, config.train
        return (f"fastmoe: moe_impl {moe.moe_impl}, {moe.experts} experts, top-{moe.top_k} {moe.gate} gate; "
                f"{launch.device}, {launch.world_size} rank(s) over {launch.comm_backend}; "
                f"{train.total_steps} steps (preset {config.preset})")

    def report_lines(self, summary: dict) -> list[str]:
        routing = summary.get("routing")
        if not routing or not routing["dropped"]:
            return []
        return [f"dropped at capacity (training): {100 * routing['dropped_route_frac']:.2f} % of "
                f"{routing['routes']:,} routes ({len(routing['per_layer'])} layer(s) x "
                f"{routing['tokens_per_layer']:,} tokens x top-k)"]

    def capability(self, lookup) -> tuple[str, str, str]:
        from moebench.status import OK, WARN

        def status(check_id: str):
            found = lookup(check_id)
            return found.status if found else None

        fmoe_ok = status("fastmoe.fmoe") == OK
        cuda_ok = status("fastmoe.fmoe_cuda") in (OK, WARN)
        devices = lookup("cuda.devices")
        gpus = devices.data.get("torch_device_count", 0) if devices else 0
        if fmoe_ok and cuda_ok and gpus:
            return OK, f"yes: the real fmoe on {gpus} GPU(s), or the reference port", ""
        why = ("fmoe not installed" if status("fastmoe.fmoe") in ("skip", "warn")
               else "fmoe does not import" if not fmoe_ok else "fmoe_cuda unusable" if not cuda_ok else "no CUDA GPU")
        probe = lookup("probe.gloo")
        if probe is None or probe.status == "skip":
            ep = "expert parallelism over gloo untested (probe skipped)"
        elif probe.data.get("ops", {}).get("all_to_all_single_uneven", {}).get("ok"):
            ep = "expert parallelism over gloo: yes (uneven all_to_all_single works)"
        else:
            ep = "expert parallelism over gloo: no (the probe's all_to_all_single failed)"
        return OK, f"yes: moebench's reference port on {'cuda' if gpus else 'cpu'} ({why}); {ep}", ""


VARIANT = FastMoEVariant()
