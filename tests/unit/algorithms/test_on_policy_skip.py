"""Skipping the prev-logprobs pass (force_on_policy_ratio) gives today's loss and gradients to 1e-6
when the rollout batch is one optimizer step, and `rlpost plan` says when the pass is skipped."""

from __future__ import annotations

import pytest
import torch

from rlpost.config.layout import prev_logprobs_pass
from rlpost.config.load import load_master_config
from rlpost.config.schema.loss import ClippedPGLossConfig
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.losses.clipped_pg import ClippedPGLossFn, NLLLoss
from rlpost.plan import plan_rows

B, S, V, H = 6, 10, 17, 16


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(V, H)
        self.mix = torch.nn.Linear(H, H)
        self.head = torch.nn.Linear(H, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mix(self.emb(ids)))
        return self.head(torch.cumsum(h, dim=1) / torch.arange(1, ids.shape[1] + 1).view(1, -1, 1))


def _batch() -> BatchedDataDict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, S), generator=g)
    pos = torch.arange(S).unsqueeze(0)
    token_mask = (pos >= 3).double().expand(B, S).clone()
    token_mask[2, 7:] = 0
    sample_mask = torch.ones(B, dtype=torch.float64)
    sample_mask[4] = 0
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, S).clone() * token_mask
    gen_lp = -torch.rand(B, S, generator=g, dtype=torch.float64) * token_mask
    return BatchedDataDict(input_ids=ids, token_mask=token_mask, sample_mask=sample_mask, advantages=adv,
                           generation_logprobs=gen_lp, reference_policy_logprobs=gen_lp - 0.05)


def _prev_logprobs(model: TinyLM, data: BatchedDataDict, chunk: int) -> torch.Tensor:
    """What the separate pass computes: the same weights, in its own micro-batches, without grad."""
    out = torch.zeros(B, S, dtype=torch.float64)
    with torch.no_grad():
        for i in range(0, B, chunk):
            ids = data["input_ids"][i : i + chunk]
            lp = torch.log_softmax(model(ids).double()[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            out[i : i + chunk, 1:] = lp
    return out


def _loss_and_grads(loss_fn: object, model: TinyLM, data: BatchedDataDict) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad()
    gvs = data["sample_mask"].sum()
    gvt = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    loss = torch.zeros((), dtype=torch.float64)
    for i in range(0, B, 2):  # the training pass in micro-batches of 2
        mb = data.slice(i, i + 2)
        part, _ = loss_fn(model(mb["input_ids"]).double(), mb, gvs, gvt)  # type: ignore[operator]
        part.backward()
        loss = loss + part.detach()
    return float(loss), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"use_importance_sampling_correction": True},
        {"reference_policy_kl_penalty": 0.1, "use_on_policy_kl_approximation": True},
        {"token_level_loss": False, "sequence_level_importance_ratios": True},
        {"ratio_clip_c": 3.0},
    ],
)
def test_skipped_pass_gives_the_same_loss_and_gradients(extra: dict) -> None:
    model, data = TinyLM(), _batch()
    data["prev_logprobs"] = _prev_logprobs(model, data, chunk=4)
    today = ClippedPGLossFn(ClippedPGLossConfig(**extra))
    forced = ClippedPGLossFn(ClippedPGLossConfig(force_on_policy_ratio=True, **extra))
    assert today.needs_prev_logprobs and not forced.needs_prev_logprobs
    loss_a, grads_a = _loss_and_grads(today, model, data)
    skipped = BatchedDataDict({k: v for k, v in data.items() if k != "prev_logprobs"})
    loss_b, grads_b = _loss_and_grads(forced, model, skipped)  # no prev_logprobs in the data at all
    assert abs(loss_a - loss_b) <= 1e-6
    for ga, gb in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(ga, gb, rtol=0, atol=1e-6)


def test_after_an_update_the_ratio_is_no_longer_one() -> None:
    """The skip is exact only while the weights are the rollout's: one step later it would not be."""
    model, data = TinyLM(), _batch()
    data["prev_logprobs"] = _prev_logprobs(model, data, chunk=6)
    with torch.no_grad():
        model.head.weight.add_(0.5)
    _, m = ClippedPGLossFn(ClippedPGLossConfig())(model(data["input_ids"]).double(), data,
                                                    data["sample_mask"].sum(), data["token_mask"].sum())
    assert abs(m["probs_ratio"] - 1.0) > 1e-3


def test_the_loop_asks_the_loss_what_it_needs() -> None:
    assert not NLLLoss().needs_prev_logprobs and not NLLLoss().needs_reference_logprobs
    assert ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.1)).needs_reference_logprobs
    assert not ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0)).needs_reference_logprobs


def test_plan_tells_when_the_pass_is_skipped() -> None:
    _, default = load_master_config([])  # 16 x 16 completions = one global batch of 256
    assert prev_logprobs_pass(default) == "on-policy"
    assert dict(plan_rows(default))["prev-logprobs pass"].startswith("skipped: one optimizer step")
    _, two_steps = load_master_config(["policy.train_global_batch_size=128"])
    assert prev_logprobs_pass(two_steps) == "computed"
    _, forced = load_master_config(["policy.train_global_batch_size=128", "loss_fn.force_on_policy_ratio=true"])
    assert prev_logprobs_pass(forced) == "forced"
    _, distil = load_master_config(["algo=distillation", "distillation.teacher.model_path=/teacher"])
    assert prev_logprobs_pass(distil) == "not needed"  # a loss without a ratio


def test_async_grpo_with_one_step_batches_skips_the_pass_too() -> None:
    """lp_old is the trainer's own logprobs before the update, in async GRPO as in sync; a batch of older weights
    differs in lp_gen, which the importance-sampling weights read (the `use_importance_sampling_correction` case of
    test_skipped_pass_gives_the_same_loss_and_gradients: lp_gen there is not the model's)."""
    from rlpost.algorithms.grpo_setup import _loss_config

    split = ["grpo.async_grpo.enabled=true", "cluster.gpus_per_node=2", "policy.generation.colocated.enabled=false",
             "policy.generation.colocated.resources.gpus_per_node=1", "loss_fn.use_importance_sampling_correction=true"]
    _, one_step = load_master_config(split)
    assert prev_logprobs_pass(one_step) == "one-step async" and _loss_config(one_step).force_on_policy_ratio
    _, two_steps = load_master_config([*split, "policy.train_global_batch_size=128"])
    assert prev_logprobs_pass(two_steps) == "computed" and not _loss_config(two_steps).force_on_policy_ratio
