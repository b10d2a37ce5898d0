"""The DeepSpeed variant: the chapter's DeepSpeed-MoE Transformer (sections 6.4.2-6.4.4), trained
through DeepSpeed's own engine (`deepspeed.initialize`), with no cold JIT compile by default."""

from __future__ import annotations

import dataclasses

from moebench import published
from moebench.variants.deepspeed.config import DeepSpeedRunConfig


class DeepSpeedVariant:
    name = "deepspeed"
    description = "Train the DeepSpeed-MoE Transformer through DeepSpeed's own engine."
    requires = ("torch", "deepspeed")
    default_preset = "chapter"
    config_cls = DeepSpeedRunConfig
    published = published.DEEPSPEED

    def file_values(self, explicit: dict, config: DeepSpeedRunConfig) -> dict:
        from moebench import config as config_tree
        from moebench.errors import UserError
        from moebench.variants.deepspeed.ds_config import FLAG_OWNED_KEYS, file_values

        path = config.engine.ds_config
        values = file_values(path, explicit, config.launch.world_size)
        try:
            config_tree.resolve(DeepSpeedRunConfig, self.name, config.preset, {**values, **explicit})
        except UserError as exc:
            # A bad value that came from the file is the file's fault: name the file's key, not the flag.
            key = next((".".join(key) for key, (field, name) in FLAG_OWNED_KEYS.items()
                        if name == exc.flag and field in values and field not in explicit), None)
            if key is None:
                raise
            raise UserError(f"{key} in {path}: {str(exc).split(': ', 1)[1]}", flag="--ds-config") from None
        return values

    def file_notes(self, values: dict, preset_config: DeepSpeedRunConfig) -> list[str]:
        from moebench.variants.deepspeed.ds_config import file_notes

        return file_notes(preset_config.engine.ds_config, values, preset_config)

    def prepare(self, config: DeepSpeedRunConfig) -> DeepSpeedRunConfig:
        from moebench.distributed.launch import resolve_placement
        from moebench.models.deepspeed_moe import set_accelerator_env
        from moebench.variants.deepspeed.ds_config import build_ds_config

        launch = config.launch
        device, comm = resolve_placement(launch.world_size, launch.device, launch.comm_backend)
        set_accelerator_env(device)  # before DeepSpeed is imported, here and in the forked ranks
        config = dataclasses.replace(config, launch=dataclasses.replace(launch, device=device, comm_backend=comm))
        build_ds_config(config)  # validates the merged DeepSpeed config before any folder exists
        return config

    def rank_fn(self):
        from moebench.variants.deepspeed.rank import train_rank

        return train_rank

    def step_parts(self, config):
        from moebench.variants.deepspeed.rank import step_parts

        return step_parts(config)

    def headline(self, config: DeepSpeedRunConfig) -> str:
        moe, launch, train = config.moe, config.launch, config.train
        return (f"deepspeed: experts {list(config.experts_per_layer)}, top-{moe.top_k}, ep_size {moe.ep_size}, "
                f"ZeRO {config.engine.zero_stage}; {launch.device}, {launch.world_size} rank(s) over "
                f"{launch.comm_backend}; batch {train.batch_size} ({config.batch_per_rank} per rank); {train.plan()} "
                f"(preset {config.preset})")

    def report_lines(self, summary: dict) -> list[str]:
        test, routing, t = summary["test"], summary["routing"], summary["timings"]
        per_layer = ", ".join(f"layer {r['layer']} {100 * r['dropped_route_frac']:.2f} % "
                              f"(capacity {r['capacity_per_expert']})" for r in routing["per_layer"])
        return [
            f"test batch: input {tuple(test['input_shape'])} -> output {tuple(test['output_shape'])}, "
            f"loss {test['loss']:.6f}",
            f"dropped at capacity (training): {100 * routing['dropped_route_frac']:.2f} % of {routing['routes']:,} "
            f"routes ({len(routing['per_layer'])} layer(s) x {routing['tokens_per_layer']:,} tokens x top-k); "
            f"{100 * routing['dropped_token_frac']:.2f} % of tokens lost every route [{per_layer}]",
            f"import deepspeed {t['import_deepspeed_s']:.1f} s, init_distributed {t['init_distributed_s']:.2f} s, "
            f"deepspeed.initialize {t['deepspeed_initialize_s']:.2f} s, training {t['train_s']:.1f} s",
        ]

    def capability(self, lookup) -> tuple[str, str, str]:
        from moebench.status import FAIL, OK

        imported = lookup("deepspeed.import")
        if imported is not None and imported.status == FAIL:
            return FAIL, f"no: {imported.found}", imported.hint
        data = imported.data if imported is not None else {}
        how = (f"accelerator {data['accelerator']}, comm {data.get('comm_backend', '?')}" if data.get("accelerator")
               else "import not tested (summary mode)")
        return OK, f"yes: {how}", ""


VARIANT = DeepSpeedVariant()
