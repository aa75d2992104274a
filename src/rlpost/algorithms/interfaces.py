"""Loss interfaces at NeMo RL's path (`nemo_rl.algorithms.interfaces`): `LossType`, `LossFunction`.

They live in `rlpost.losses.interface`, below the workers that call them; this module re-exports them.
"""

from rlpost.losses.interface import LossFunction, LossType

__all__ = ["LossFunction", "LossType"]
