"""`policy=dtensor`: an HF causal LM parallelised with rlpost's own plans (TP -> AC -> FSDP2)."""

from __future__ import annotations

import torch
from torch import nn

from rlpost.models.dtensor import lora
from rlpost.models.dtensor.parallelize import parallelize
from rlpost.models.policy.dtensor_worker_base import DTensorWorkerBase
from rlpost.models.policy.hf_loading import load_hf_causal_lm


class DTensorPolicyWorker(DTensorWorkerBase):
    """One rank of the DTensor (v1) policy."""

    def _build_model(self) -> nn.Module:
        d = self.cfg.dtensor_cfg
        assert d is not None
        model = load_hf_causal_lm(self.cfg, torch.float32)
        if self.lora is not None:
            model = lora.inject(model, self.lora)
        model.to(self.device)
        return parallelize(
            model,
            self.mesh,
            self.cfg.precision,
            activation_checkpointing=d.activation_checkpointing,
            cpu_offload=d.cpu_offload,
            custom_plan=d.custom_parallel_plan,
        )
