"""`algo=rm` at NeMo RL's path (`nemo_rl.algorithms.rm`): its config, save state, setup and training loop.

The loop is the one SFT, DPO and reward-model training share (rlpost.algorithms.supervised); what makes it
a reward model is the loss (`loss_fn`) and the rows (`data`) that conf/algo/rm.yaml chooses.
"""

from __future__ import annotations

from rlpost.algorithms.supervised import SupervisedComponents, setup, supervised_train, validate
from rlpost.config.schema.supervised import RMConfig
from rlpost.config.schema.supervised import SupervisedSaveState as RMSaveState
from rlpost.config.schema.supervised_master import RMMasterConfig as MasterConfig

rm_train = supervised_train
"""Train until rm.max_num_steps or rm.max_num_epochs (rlpost.algorithms.supervised.supervised_train)."""

__all__ = ["RMConfig", "RMSaveState", "MasterConfig", "SupervisedComponents", "setup", "rm_train", "validate"]
