"""A policy's weights as the driver sees them: through the refit export, the path every run takes to its engines."""

from __future__ import annotations

import torch

from rlpost.distributed.shm_buckets import read_bucket
from rlpost.models.policy.interfaces import ColocatablePolicyInterface


def exported_weights(policy: ColocatablePolicyInterface, dtype: str = "float32") -> dict[str, torch.Tensor]:
    """Every tensor a refit sends (HF names, a tied head included, LoRA merged in), copied out of its bucket."""
    out: dict[str, torch.Tensor] = {}
    for box in policy.export_weight_buckets(dtype, 2**40):  # one bucket: the whole model
        if isinstance(box, dict) and "per_rank" in box:  # one node: each rank wrote it into its own buffer
            box = box["per_rank"][0]
        out.update({name: t.clone() for name, t in read_bucket(box)})
    return out
