"""`policy=dtensor`: an HF causal LM parallelised with rlpost's own plans (TP -> AC -> FSDP2), built on the meta device
and loaded shard by shard (rlpost.models.dtensor.shard_loading): no rank ever holds the whole model."""

from __future__ import annotations

from torch import nn

from rlpost.models.dtensor.parallelize import parallelize
from rlpost.models.dtensor.shard_loading import build_sharded
from rlpost.models.policy.dtensor_worker_base import DTensorWorkerBase


class DTensorPolicyWorker(DTensorWorkerBase):
    """One rank of the DTensor (v1) policy."""

    def _build_model(self) -> nn.Module:
        d = self.cfg.dtensor_cfg
        assert d is not None

        def parallel(model: nn.Module) -> nn.Module:
            return parallelize(
                model,
                self.mesh,
                self.cfg.precision,
                activation_checkpointing=d.activation_checkpointing,
                cpu_offload=d.cpu_offload,
                custom_plan=d.custom_parallel_plan,
            )

        offloaded = d.cpu_offload and self.device.type == "cuda"  # FSDP2's CPUOffloadPolicy (parallelize.apply_fsdp)
        return build_sharded(self.cfg, self.lora, self.device, parallel, params_on_cpu=offloaded)
