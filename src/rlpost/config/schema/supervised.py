"""Configs of the algorithms that train on fixed data (`algo=sft|dpo|rm`, placed at `sft` / `dpo` / `rm`), their
data blocks (`data=sft_*` / `data=preference_*`) and their resumable save state."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from rlpost.config.errors import require
from rlpost.config.fields import NON_NEGATIVE, POSITIVE, SEED, Block, check_fields, checked, options
from rlpost.config.schema.data import DatasetConfig

SFT_TASKS = ("copy_digit", "next_letter", "memorise", "calc_tool")
"""Generated SFT tasks: prompt -> answer pairs; 'memorise' pairs random keys with random values (nothing to
generalise, so the held-out rows are the training rows' keys); 'calc_tool' answers GRPO's calc_mul prompts with a
calculator transcript (`<call>a*b</call><result>v</result> The answer is \\boxed{v}.`), a warm-up for
env=calculator."""
PREFERENCE_TASKS = ("copy_digit", "next_letter")
"""Generated preference tasks: the right answer is chosen, a wrong one rejected."""


@dataclass
class SupervisedLoopConfig(Block):
    """The loop shared by SFT, DPO and reward-model training (NeMo RL's SFTConfig / DPOConfig fields)."""

    max_num_epochs: int = checked(1, POSITIVE)
    """Stop after this many passes over the training rows."""
    max_num_steps: int = checked(100, POSITIVE)
    """Stop after this many optimizer steps (one step = policy.train_global_batch_size rows)."""
    val_period: int = checked(10, NON_NEGATIVE)
    """Validate every this many steps and at the last step; 0 = never."""
    val_batches: int = checked(4, NON_NEGATIVE)
    """Validation batches per validation (each val_global_batch_size rows); 0 = every validation row."""
    val_global_batch_size: int = checked(32, POSITIVE)
    """Rows per validation batch (split into micro-batches of policy.train_micro_batch_size)."""
    val_at_start: bool = False
    """Validate the starting weights before step 1."""
    seed: int = checked(42, SEED)
    """Seed of Python and torch in the driver."""

@dataclass
class SFTConfig(SupervisedLoopConfig):
    """Supervised fine-tuning on chat rows or prompt/response pairs (`algo=sft`); the loss is `loss=nll`."""


@dataclass
class DPOConfig(SupervisedLoopConfig):
    """Direct preference optimisation on (prompt, chosen, rejected) rows (`algo=dpo`); the loss is `loss=dpo`.
    The reference policy is the policy as loaded; its logprobs are computed once per batch, before the update."""


@dataclass
class RMConfig(SupervisedLoopConfig):
    """Bradley-Terry reward-model training on preference pairs (`algo=rm`); the loss is `loss=preference` and
    the policy is built with policy.reward_model_cfg.enabled=true (a one-label sequence classifier)."""


@dataclass
class SupervisedTaskConfig:
    """A task generated in-process (no files, no downloads)."""

    task: str = "copy_digit"
    """SFT: 'copy_digit', 'next_letter', 'memorise' or 'calc_tool'; preference data: 'copy_digit' or
    'next_letter'."""
    num_train: int = checked(2048, POSITIVE)
    """Training rows generated."""
    num_val: int = checked(64, POSITIVE)
    """Validation rows generated."""
    seed: int = checked(1234, SEED)
    """Generator seed."""

    def check(self, path: str, tasks: tuple[str, ...]) -> None:
        options(*tasks)(f"{path}.task", self.task)
        check_fields(self, path)


@dataclass
class SupervisedDataConfig(DatasetConfig):
    """Rows read from local files or generated; what both SFT and preference data share."""

    dataset_name: str = checked("synthetic", options("synthetic", "jsonl", "parquet"))
    """'synthetic' (generated), 'jsonl' or 'parquet' (local files)."""
    train_data_path: str | None = None
    """Local training file."""
    val_data_paths: list[str] = field(default_factory=list)
    """Local validation files (none: no validation rows)."""
    synthetic: SupervisedTaskConfig = field(default_factory=SupervisedTaskConfig)
    """The generated task (dataset_name=synthetic)."""
    prompt_key: str = "prompt"
    """Row field holding the prompt: a string (sent as one user message) or a list of {role, content} messages."""
    add_eos: bool = True
    """Append the tokenizer's EOS (trained) after the response when the chat template did not end it with EOS,
    so the model learns to stop."""
    shuffle: bool = True
    """Shuffle the training rows each epoch."""
    seed: int = checked(42, SEED)
    """Shuffle seed."""

    TASKS: ClassVar[tuple[str, ...]] = SFT_TASKS
    """The generated tasks this data option offers."""

    def check(self, path: str) -> None:
        super().check(path)
        if self.dataset_name == "synthetic":
            self.synthetic.check(f"{path}.synthetic", self.TASKS)
        else:
            require(bool(self.train_data_path), f"{path}.train_data_path", self.train_data_path,
                    f"dataset_name={self.dataset_name} needs a local train_data_path")


@dataclass
class SFTDataConfig(SupervisedDataConfig):
    """SFT rows (`data=sft_synthetic|sft_jsonl`): `messages` chat rows, or prompt/response pairs.

    Only the assistant messages' tokens are trained (their chat-template header is not). A row that breaks the
    format (no messages and no prompt/response, an unknown role, no assistant message, an empty assistant
    message, a role order other than [system] user (assistant user)* assistant ...) stops the run with exit 2,
    naming file and line; a row longer than policy.max_total_sequence_length is skipped and counted
    (data/skipped_too_long)."""

    messages_key: str = "messages"
    """Row field holding a list of {role, content} messages (roles system / user / assistant)."""
    response_key: str = "response"
    """Row field holding the response of a prompt/response row (used when a row has no messages_key)."""


@dataclass
class PreferenceDataConfig(SupervisedDataConfig):
    """Preference pairs (`data=preference_synthetic|preference_jsonl`) for algo=dpo and algo=rm.

    A row missing prompt / chosen / rejected, or with an empty or identical chosen and rejected response, stops
    the run with exit 2 naming file and line; a pair whose longer side exceeds policy.max_total_sequence_length
    is skipped and counted (data/skipped_too_long)."""

    chosen_key: str = "chosen"
    """Row field holding the preferred response."""
    rejected_key: str = "rejected"
    """Row field holding the dispreferred response."""

    TASKS: ClassVar[tuple[str, ...]] = PREFERENCE_TASKS
    """The generated tasks this data option offers."""


@dataclass
class SupervisedSaveState:
    """What a checkpoint of SFT / DPO / RM training records of its progress (training_info.json)."""

    total_steps: int = 0
    """Optimizer steps done in all."""
    current_epoch: int = 0
    """Epoch index."""
    current_step: int = 0
    """Batch index within the current epoch."""
    consumed_samples: int = 0
    """Training rows (pairs, for DPO and RM) consumed so far."""
    extra: dict[str, float] = field(default_factory=dict)
    """Checkpoint metric values (e.g. 'val:loss') written at save time."""

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d.update(d.pop("extra"))
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SupervisedSaveState:
        known = {k for k in cls.__dataclass_fields__ if k != "extra"}
        return cls(**{k: v for k, v in d.items() if k in known}, extra={k: v for k, v in d.items() if k not in known})
