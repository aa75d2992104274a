"""`algo=dpo` at NeMo RL's path (`nemo_rl.algorithms.dpo`): its config, save state, setup and training loop.

The loop is the one SFT, DPO and reward-model training share (rlpost.algorithms.supervised); what makes it
DPO is the loss (`loss_fn`) and the rows (`data`) that conf/algo/dpo.yaml chooses.
"""

from __future__ import annotations

from rlpost.algorithms.supervised import SupervisedComponents, setup, supervised_train, validate
from rlpost.config.schema.supervised import DPOConfig
from rlpost.config.schema.supervised import SupervisedSaveState as DPOSaveState
from rlpost.config.schema.supervised_master import DPOMasterConfig as MasterConfig

dpo_train = supervised_train
"""Train until dpo.max_num_steps or dpo.max_num_epochs (rlpost.algorithms.supervised.supervised_train)."""

__all__ = ["DPOConfig", "DPOSaveState", "MasterConfig", "SupervisedComponents", "setup", "dpo_train", "validate"]
