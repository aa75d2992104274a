"""`algo=sft` at NeMo RL's path (`nemo_rl.algorithms.sft`): its config, save state, setup and training loop.

The loop is the one SFT, DPO and reward-model training share (rlpost.algorithms.supervised); what makes it
SFT is the loss (`loss_fn`) and the rows (`data`) that conf/algo/sft.yaml chooses.
"""

from __future__ import annotations

from rlpost.algorithms.supervised import SupervisedComponents, setup, supervised_train, validate
from rlpost.config.schema.supervised import SFTConfig
from rlpost.config.schema.supervised import SupervisedSaveState as SFTSaveState
from rlpost.config.schema.supervised_master import SFTMasterConfig as MasterConfig

sft_train = supervised_train
"""Train until sft.max_num_steps or sft.max_num_epochs (rlpost.algorithms.supervised.supervised_train)."""

__all__ = ["SFTConfig", "SFTSaveState", "MasterConfig", "SupervisedComponents", "setup", "sft_train", "validate"]
