"""Dataset config (`data=synthetic|jsonl`, placed at `data`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlpost.config.errors import require
from rlpost.config.fields import POSITIVE, SEED, Block, checked, options

TOO_LONG = ("truncate", "drop", "error")
"""What data.too_long may choose for an over-length prompt."""
SYNTHETIC_TASKS = ("next_letter", "copy_digit", "add_mod10", "arith_add1", "arith_add2", "arith_mixed", "lookup",
                   "guess_digit", "calc_mul")


@dataclass
class SyntheticTaskConfig(Block):
    """A verifiable task generated in-process (no files, no downloads)."""

    task: str = checked("copy_digit", options(*SYNTHETIC_TASKS))
    """'copy_digit' (repeat the digit), 'next_letter', 'add_mod10' (one-token answers, env=synthetic), or the
    arithmetic levels 'arith_add1' (single-digit addition), 'arith_add2' (two-digit), 'arith_mixed' (+, -, * on
    one and two digits) asking for a \\boxed{} answer (env=math); multi-turn: 'lookup' (env=lookup), 'guess_digit'
    (env=guess_game) and 'calc_mul' (env=calculator); see rlpost.data.synthetic_tasks."""
    num_train: int = checked(4096, POSITIVE)
    """Training prompts generated."""
    num_val: int = checked(64, POSITIVE)
    """Validation prompts generated."""
    seed: int = checked(1234, SEED)
    """Generator seed."""

@dataclass
class DatasetConfig(Block):
    """Base of every `data` option's schema: GRPO's prompts (DataConfig) or the rows of SFT / DPO / RM
    (rlpost.config.schema.supervised)."""


@dataclass
class DataConfig(DatasetConfig):
    """Where GRPO's prompts come from and how they are turned into token ids (`data=synthetic|arith|...`)."""

    dataset_name: str = checked("synthetic", options("synthetic", "jsonl", "parquet"))
    """'synthetic' (generated), 'jsonl' or 'parquet' (local files through `datasets`)."""
    train_data_path: str | None = None
    """Local training file (jsonl / parquet)."""
    val_data_paths: list[str] = field(default_factory=list)
    """Local validation files."""
    synthetic: SyntheticTaskConfig = field(default_factory=SyntheticTaskConfig)
    """The synthetic task (dataset_name=synthetic)."""
    input_key: str = "problem"
    """Row field holding the prompt text."""
    output_key: str = "expected_answer"
    """Row field holding the ground-truth answer."""
    env_name: str = "synthetic"
    """Environment (key of `env`) that scores these rows."""
    prompt_file: str | None = None
    """Prompt template file with one '{}' for the problem; None = the problem as is."""
    system_prompt_file: str | None = None
    """System prompt file; None = no system message."""
    max_input_seq_length: int = checked(256, POSITIVE)
    """Longest prompt in tokens (and at most policy.max_total_sequence_length - max_new_tokens, which leaves the answer
    its room); what happens to a longer one is data.too_long's choice."""
    too_long: str = checked("truncate", options(*TOO_LONG))
    """A prompt over max_input_seq_length tokens, found when the rows are loaded: 'truncate' (cut to it and masked
    out of the loss, as NeMo RL does), 'drop' (left out of the data set) or 'error' (exit 2 naming its file:line)."""
    add_generation_prompt: bool = True
    """Append the assistant turn opener of the chat template."""
    shuffle: bool = True
    """Shuffle the training set each epoch."""
    seed: int = checked(42, SEED)
    """Shuffle seed."""
    num_workers: int = 0
    """Dataloader worker processes: only 0 (rows are read once and tokenized in the driver, a few per step)."""

    def check(self, path: str) -> None:
        super().check(path)
        if self.dataset_name == "synthetic":
            self.synthetic.check(f"{path}.synthetic")
        else:
            require(
                bool(self.train_data_path),
                f"{path}.train_data_path",
                self.train_data_path,
                f"dataset_name={self.dataset_name} needs a local train_data_path",
            )
        require(
            self.num_workers == 0,
            f"{path}.num_workers",
            self.num_workers,
            "rlpost's prompt loader has no worker processes: the rows are read once at start and each step's "
            "prompts are tokenized in the driver",
            "leave it at 0; env.<name>.num_workers sets the reward workers",
        )
