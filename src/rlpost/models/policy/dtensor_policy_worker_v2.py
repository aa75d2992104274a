"""`policy=dtensor_v2`: the same worker, with loading and parallelism delegated to libraries.

- Loading: without TP, the model is built on the meta device, sharded there, and each rank loads only its shard
  (rlpost.models.dtensor.shard_loading); with TP, transformers loads each rank's TP shard itself.
- Tensor parallelism: transformers' own plan (`from_pretrained(tp_plan="auto", device_mesh=tp)`,
  the model's `base_model_tp_plan`); its lm_head plan gathers the logits, so the loss sees the full
  vocabulary.
- FSDP2: accelerate's `fsdp2_prepare_model` (transformer-layer auto-wrap, embedding/tail units,
  fp32 master weights under a MixedPrecisionPolicy); not applied where it has nothing to do (one rank, fp32:
  `rlpost.config.layout.fsdp_needed`).

accelerate 1.15 turns FSDP on only for accelerator devices; on CPU the worker hands the
Accelerator's state its FSDP plugin, device mesh and parallelism config itself (three assignments
in `_accelerator`), then uses accelerate's preparation unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from rlpost.config.layout import fsdp_needed
from rlpost.losses.interface import VocabParallelArgs
from rlpost.models.dtensor.parallelize import DTYPES, decoder_layers
from rlpost.models.dtensor.shard_loading import build_sharded
from rlpost.models.policy.dtensor_worker_base import DTensorWorkerBase

if TYPE_CHECKING:
    from accelerate import Accelerator


class DTensorPolicyWorkerV2(DTensorWorkerBase):
    """One rank of the library-parallelised DTensor policy."""

    DP_DIM = "dp_shard_cp"

    def _accelerator(self, layer_cls: str) -> Accelerator:
        from accelerate import Accelerator
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import FullyShardedDataParallelPlugin
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        d = self.cfg.dtensor_cfg
        assert d is not None
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=[layer_cls],
            reshard_after_forward=True,
            cpu_ram_efficient_loading=False,
            activation_checkpointing=d.activation_checkpointing,
            mixed_precision_policy=MixedPrecisionPolicy(
                param_dtype=DTYPES[self.cfg.precision], reduce_dtype=torch.float32, output_dtype=torch.float32
            ),
            cpu_offload=CPUOffloadPolicy() if (d.cpu_offload and self.device.type == "cuda") else None,
        )
        acc = Accelerator(cpu=self.device.type == "cpu")
        acc.state.fsdp_plugin = plugin
        acc.state.device_mesh = self.mesh
        acc.state.parallelism_config = ParallelismConfig(dp_shard_size=self.dp_size, tp_size=self.tp_size)
        return acc

    def _build_model(self) -> nn.Module:
        from accelerate.utils.fsdp_utils import fsdp2_apply_ac, fsdp2_prepare_model

        d = self.cfg.dtensor_cfg

        def parallel(model: nn.Module) -> nn.Module:
            acc = self._accelerator(type(decoder_layers(model)[0]).__name__)
            if d.activation_checkpointing:
                model = fsdp2_apply_ac(acc, model)
            if not fsdp_needed(self.dp_size, self.tp_size, self.cfg.precision, d.cpu_offload):
                return model
            return fsdp2_prepare_model(acc, model)

        if self.tp_size == 1:  # on the meta device, each rank loading its shard (rlpost.models.dtensor.shard_loading)
            offloaded = d.cpu_offload and self.device.type == "cuda"  # the plugin's CPUOffloadPolicy (_accelerator)
            return build_sharded(self.cfg, self.lora, self.device, parallel, params_on_cpu=offloaded)
        # (with TP, the config check refuses LoRA: transformers shards at load)
        from transformers import AutoConfig, AutoModelForCausalLM

        from rlpost.config.model_families import attention_implementation

        hf_cfg = AutoConfig.from_pretrained(self.cfg.model_name, trust_remote_code=self.cfg.trust_remote_code)
        model: nn.Module = AutoModelForCausalLM.from_pretrained(
            self.cfg.model_name,
            dtype=torch.float32,
            tp_plan="auto",
            device_mesh=self.mesh["tp"],
            trust_remote_code=self.cfg.trust_remote_code,
            use_safetensors=True,
            attn_implementation=attention_implementation(hf_cfg),
            **self.cfg.hf_config_overrides,
        )
        return parallel(model)

    def _vp_kwargs(self) -> VocabParallelArgs:
        return {}  # transformers' lm_head plan gathers the logits: the loss sees the full vocabulary
