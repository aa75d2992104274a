"""Multi-turn rollouts on a scripted environment: exact token masks (the environment's tokens are never
trained), rewards summed over turns, per-turn seeds and stop strings, the sequence budget, and the loss
blind to environment tokens. The engine here is a deterministic stand-in (token arithmetic), so every id
and mask can be written down; tests/integration/test_multi_turn.py runs the same loop on real vLLM."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from rlpost.algorithms.multi_turn import (
    TurnSettings,
    run_async_multi_turn_rollout,
    run_multi_turn_rollout,
    run_rollouts,
    turn_seed,
)
from rlpost.algorithms.train_data import build_train_data
from rlpost.config.schema.loss import ClippedPGLossConfig
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from rlpost.losses.clipped_pg import ClippedPGLossFn

PAD = 0


class _Tokenizer:
    """Token id t (1..99) decodes to chr(ord('a') + t % 26); encode maps each character back to one id."""

    pad_token_id = PAD

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids if t != PAD)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [50 + (ord(c) - ord("a")) % 26 for c in text]


class _CountingEngine:
    """Each row generates `n` tokens: (last + k) % 40 + 1 for k = 0.. (logprob -0.1 * (k + 1)); records requests."""

    def __init__(self, n: int = 2) -> None:
        self.n = n
        self.requests: list[dict[str, Any]] = []

    def generate(self, data: Any, greedy: bool = False) -> BatchedDataDict:
        self.requests.append({k: data[k] for k in ("input_lengths", "seeds", "stop_strings") if k in data})
        ids, lens = data["input_ids"], data["input_lengths"]
        b, p = ids.shape
        out = torch.full((b, p + self.n), PAD, dtype=torch.long)
        lps = torch.zeros((b, p + self.n))
        for i in range(b):
            n_in = int(lens[i])
            out[i, :n_in] = ids[i, :n_in]
            for k in range(self.n):
                out[i, n_in + k] = (int(ids[i, n_in - 1]) + k) % 40 + 1
                lps[i, n_in + k] = -0.1 * (k + 1)
        return BatchedDataDict(output_ids=out, logprobs=lps, generation_lengths=torch.full((b,), self.n),
                               unpadded_sequence_lengths=lens + self.n, truncated=torch.ones(b, dtype=torch.bool))

    async def generate_async(self, data: Any, greedy: bool = False) -> BatchedDataDict:
        await asyncio.sleep(0)
        return self.generate(data, greedy)


class _ScriptedEnv(EnvironmentInterface):
    """Answers turn t with the observation 'xy' (2 tokens) and reward 0.25; ends after `turns` turns of a row
    (row 'turns' overrides), counting turns in the metadata it hands back."""

    def __init__(self, turns: int = 3) -> None:
        self.turns = turns
        self.seen: list[tuple[str, int]] = []

    def step(self, responses: list[str], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        done, nxt = [], []
        for r, m in zip(responses, metadata, strict=True):
            t = int(m.get("turn", 0)) + 1
            self.seen.append((r, t))
            done.append(t >= int(m.get("turns", self.turns)))
            nxt.append({"turn": t})
        return EnvironmentReturn([0.25] * len(responses), observations=["xy"] * len(responses), terminateds=done,
                                 next_stop_strings=[["</call>"]] * len(responses), next_metadata=nxt)

    def shutdown(self, graceful: bool = True) -> None:
        pass


def _rows(prompts: list[list[int]], **extra: Any) -> list[dict[str, Any]]:
    return [{"prompt_ids": p, "env_name": "s", "loss_multiplier": 1.0, **extra} for p in prompts]


def test_masks_cover_exactly_the_model_tokens_and_rewards_add_up() -> None:
    engine, env = _CountingEngine(n=2), _ScriptedEnv(turns=3)
    rows = _rows([[5, 6, 7], [9]])
    rows[1]["turns"] = 1  # this episode ends after its first turn
    batch = run_multi_turn_rollout(rows, torch.tensor([0, 1]), engine, _Tokenizer(), {"s": env},  # type: ignore[arg-type]
                                   TurnSettings(max_turns=4, max_seq_len=64), seeds=[100, 200])
    xy = _Tokenizer().encode("xy")
    # row 0: prompt, 3 model turns of 2 tokens, the env's 'xy' after turns 1 and 2 (not after the last)
    assert batch.gen["output_ids"][0].tolist() == [5, 6, 7, 8, 9, *xy, 35, 36, *xy, 35, 36]
    assert batch.gen["token_mask"][0].tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1]
    assert batch.gen["logprobs"][0].tolist() == torch.tensor([0, 0, 0, -0.1, -0.2, 0, 0, -0.1, -0.2, 0, 0, -0.1, -0.2]).tolist()
    assert batch.gen["output_ids"][1].tolist()[:3] == [9, 10, 11] and batch.gen["token_mask"][1, :3].tolist() == [0, 1, 1]
    assert batch.gen["token_mask"][1, 3:].sum() == 0  # padding
    assert batch.rewards.tolist() == [0.75, 0.25]  # summed over turns
    assert batch.gen["generation_lengths"].tolist() == [6, 2]
    assert batch.gen["unpadded_sequence_lengths"].tolist() == [13, 3]
    assert batch.metrics["rollout/mean_turns"] == 2.0 and batch.metrics["rollout/mean_env_tokens"] == 2.0
    # turn t of a sample samples with turn_seed(seed, t); only running episodes are sent; stops from the env
    assert [r["seeds"].tolist() for r in engine.requests] == [[100, 200], [turn_seed(100, 1)], [turn_seed(100, 2)]]
    assert "stop_strings" not in engine.requests[0] and engine.requests[1]["stop_strings"] == [["</call>"]]
    # the env saw the model's turn text and its own turn counter
    assert env.seen[0] == (_Tokenizer().decode([8, 9]), 1) and [t for _, t in env.seen] == [1, 1, 2, 3]


def test_the_trainer_sees_the_rollouts_mask_and_the_loss_ignores_environment_tokens() -> None:
    batch = run_multi_turn_rollout(_rows([[5, 6, 7]] * 2), torch.tensor([0, 0]), _CountingEngine(), _Tokenizer(),  # type: ignore[arg-type]
                                   {"s": _ScriptedEnv(turns=2)}, TurnSettings(max_turns=2, max_seq_len=64))
    data = build_train_data(batch, torch.tensor([1.0, -1.0]), torch.ones(2), PAD, multiple=4)
    s = data["input_ids"].shape[1]
    assert s % 4 == 0 and torch.equal(data["token_mask"][:, : batch.gen["token_mask"].shape[1]], batch.gen["token_mask"])
    assert data["token_mask"].sum() == 8 and torch.all(data["advantages"][data["token_mask"] == 0] == 0)
    loss_fn = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0, force_on_policy_ratio=True))
    logits = torch.randn(2, s, 100, requires_grad=True)
    valid = torch.tensor(2.0), data["token_mask"][:, 1:].sum()
    loss, _ = loss_fn(logits, data, *valid)
    loss.backward()
    assert logits.grad is not None
    # position j's logits predict token j+1: no gradient flows from an environment (or prompt) token
    predicts_env = data["token_mask"][:, 1:] == 0
    assert torch.all(logits.grad[:, :-1][predicts_env] == 0)
    assert torch.all(logits.grad[:, :-1][~predicts_env].abs().sum(-1) > 0)


def test_an_episode_over_the_sequence_budget_is_cut_and_counted() -> None:
    batch = run_multi_turn_rollout(_rows([[5, 6, 7], [1]]), torch.tensor([0, 1]), _CountingEngine(n=2), _Tokenizer(),  # type: ignore[arg-type]
                                   {"s": _ScriptedEnv(turns=9)}, TurnSettings(max_turns=9, max_seq_len=8))
    lengths = batch.gen["unpadded_sequence_lengths"].tolist()
    assert lengths == [8, 8]
    assert batch.gen["truncated"].tolist() == [True, True] and batch.metrics["rollout/budget_truncated"] == 2.0
    assert batch.gen["output_ids"].shape[1] == 8  # nothing past the budget, the mask cut with it
    assert batch.gen["token_mask"].shape == batch.gen["output_ids"].shape


def test_async_driver_gives_the_lock_step_episodes() -> None:
    def play(driver: Any) -> Any:
        rows = _rows([[5, 6, 7], [9], [3, 4]])
        rows[1]["turns"] = 1
        return driver(rows, torch.arange(3), _CountingEngine(), _Tokenizer(), {"s": _ScriptedEnv(turns=3)},
                      TurnSettings(max_turns=3, max_seq_len=64), seeds=[1, 2, 3])

    sync, asyn = play(run_multi_turn_rollout), play(run_async_multi_turn_rollout)
    for key in ("output_ids", "token_mask", "logprobs", "generation_lengths", "truncated"):
        assert torch.equal(sync.gen[key], asyn.gen[key]), key
    assert torch.equal(sync.rewards, asyn.rewards) and sync.responses == asyn.responses


def test_one_turn_is_the_single_turn_rollout() -> None:
    engine = _CountingEngine(n=1)
    batch = run_rollouts(_rows([[5, 6, 7]]), torch.tensor([0]), engine, _Tokenizer(), {"s": _ScriptedEnv(turns=5)},  # type: ignore[arg-type]
                         TurnSettings(max_turns=1, max_seq_len=64), seeds=[7])
    assert "token_mask" not in batch.gen and batch.gen["output_ids"][0].tolist() == [5, 6, 7, 8]
    assert batch.rewards.tolist() == [0.25] and engine.requests[0]["seeds"].tolist() == [7]
