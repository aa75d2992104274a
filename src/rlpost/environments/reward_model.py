"""A trained reward model as GRPO's environment (`env=reward_model`): the reward of a response is the score the
model gives [user: the row's problem] + response + EOS, rendered as algo=rm rendered its training pairs (the
export's tokenizer with env.reward_model.chat_template), so the scores mean what they meant in training.

The model runs in one Ray actor (num_cpus from the config), started at the first step; a batch is bounded by
batch_timeout_s (past it every sample of the batch scores 0 and counts as a timeout, and the actor is replaced), and
a dead actor stops the run with its name. A stop asked for by a signal (rlpost.runtime.stop_request) gives the
batch GRACE_S more, as the verifier pool does. The row's prompt_file / system prompt are not shown to the reward
model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rlpost.config.errors import ConfigError
from rlpost.config.schema.env import RewardModelEnvConfig
from rlpost.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from rlpost.runtime import stop_request

if TYPE_CHECKING:
    from rlpost.distributed.worker_groups import ActorGroup


def check_reward_model_dir(path: str, key: str) -> None:
    """A local HF directory holding a one-label sequence classifier, or ConfigError naming `key`."""
    config = Path(path) / "config.json"
    if not config.is_file():
        raise ConfigError(key, path, "not a local HF model directory (no config.json)",
                          "use RUN/checkpoints/step_N/policy/weights/hf of an algo=rm run")
    hf = json.loads(config.read_text())
    archs = hf.get("architectures") or []
    labels = len(hf.get("id2label") or {}) or hf.get("num_labels", 2)
    if not any(a.endswith("ForSequenceClassification") for a in archs) or labels != 1:
        raise ConfigError(key, path, f"not a reward model: architectures {archs}, {labels} label(s); a reward model "
                          "is a one-label sequence classifier", "train one with algo=rm")


class _Scorer:
    """Ray actor: the reward model and its tokenizer."""

    def __init__(self, path: str, chat_template: str | None, batch_size: int) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        from rlpost.config.schema.policy import TokenizerConfig
        from rlpost.data.prompts import load_tokenizer
        from rlpost.data.supervised_rows import ConversationTokenizer

        torch.set_num_threads(1)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, use_safetensors=True).eval()
        tok = load_tokenizer(TokenizerConfig(name=path, chat_template=chat_template))
        self.pad = int(self.model.config.pad_token_id if self.model.config.pad_token_id is not None
                       else tok.pad_token_id)
        self.conv = ConversationTokenizer(tok, add_eos=True)
        self.batch_size = batch_size

    def ping(self) -> bool:
        return True

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        import torch

        seqs = [self.conv.prompt_and_response([{"role": "user", "content": p}], r).ids
                for p, r in zip(prompts, responses, strict=True)]
        out: list[float] = []
        with torch.no_grad():
            for start in range(0, len(seqs), self.batch_size):
                part = seqs[start : start + self.batch_size]
                ids = torch.full((len(part), max(len(s) for s in part)), self.pad, dtype=torch.long)
                for i, s in enumerate(part):
                    ids[i, : len(s)] = torch.tensor(s)
                out += self.model(input_ids=ids).logits[:, 0].float().tolist()
        return out


class RewardModelEnvironment(EnvironmentInterface):
    """Rewards from a trained reward model (single-turn)."""

    cfg: RewardModelEnvConfig

    def __init__(self, cfg: RewardModelEnvConfig) -> None:
        check_reward_model_dir(cfg.model_path, "env.reward_model.model_path")
        self.cfg = cfg
        self.group: ActorGroup | None = None

    def _actor(self) -> ActorGroup:
        if self.group is None:
            import ray

            from rlpost.distributed.worker_groups import ActorGroup

            actor = ray.remote(num_cpus=self.cfg.num_cpus)(_Scorer).remote(
                self.cfg.model_path, self.cfg.chat_template, self.cfg.batch_size)
            self.group = ActorGroup([actor], "reward model scorer", self.cfg.batch_timeout_s)
        return self.group

    def step(self, responses: list[str], metadata: Sequence[Mapping[str, object]]) -> EnvironmentReturn:
        import ray

        group = self._actor()
        prompts = [str(m["problem"]) for m in metadata]
        future = group.workers[0].score.remote(prompts, responses)
        deadline = stop_request.BatchDeadline(self.cfg.batch_timeout_s)  # a stop asked for: GRACE_S more
        while not ray.wait([future], timeout=deadline.wait_s())[0]:
            if deadline.passed():
                group.shutdown()
                self.group = None  # a fresh actor next time
                return EnvironmentReturn(rewards=[0.0] * len(responses), timeouts=len(responses),
                                         unfinished=len(responses))
        scores = group.get([future])[0]  # done: a dead actor's error names it
        return EnvironmentReturn(rewards=[float(s) for s in scores])

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None
