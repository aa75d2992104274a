"""The distillation KL (rlpost.losses.distillation) against a plain-Python computation, and GRPO's add-on
term (loss_fn.distillation_kl_coef)."""

from __future__ import annotations

import math

import pytest
import torch

from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.losses.clipped_pg import ClippedPGLossFn
from rlpost.losses.distillation import DistillationLossFn
from rlpost.losses.teacher_kl import topk_kl


def _reference(student_logits: list[float], indices: list[int], teacher_lp: list[float], kl_type: str,
               w: float) -> tuple[float, float]:
    """One position in plain Python: the KL on the k tokens plus the rest outcome, and the student's top-k mass."""
    z = max(student_logits)
    norm = math.log(sum(math.exp(x - z) for x in student_logits)) + z
    s = [student_logits[i] - norm for i in indices]
    s_rest = max(1.0 - sum(math.exp(x) for x in s), 1e-12)
    t_rest = max(1.0 - sum(math.exp(x) for x in teacher_lp), 1e-12)
    ps = [math.exp(x) for x in s] + [s_rest]
    pt = [math.exp(x) for x in teacher_lp] + [t_rest]
    reverse = sum(a * (math.log(a) - math.log(b)) for a, b in zip(ps, pt, strict=True))
    forward = sum(b * (math.log(b) - math.log(a)) for a, b in zip(ps, pt, strict=True))
    kl = {"reverse": reverse, "forward": forward, "mixed": w * forward + (1 - w) * reverse}[kl_type]
    return kl, sum(ps[:-1])


def _teacher(b: int, t: int, v: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(b, t, v, generator=g, dtype=torch.float64) * 2
    teacher_lp = torch.log_softmax(torch.randn(b, t, v, generator=g, dtype=torch.float64) * 3, dim=-1)
    top = teacher_lp.topk(k, dim=-1)
    return student, top.indices, top.values


@pytest.mark.parametrize("kl_type", ["reverse", "forward", "mixed"])
@pytest.mark.parametrize("k", [1, 5, 17])
def test_topk_kl_equals_the_reference(kl_type: str, k: int) -> None:
    student, idx, t_lp = _teacher(2, 3, 17, k, seed=k)
    kl, mass = topk_kl(student, idx, t_lp, kl_type, 0.3)
    for b in range(2):
        for t in range(3):
            ref, ref_mass = _reference(student[b, t].tolist(), idx[b, t].tolist(), t_lp[b, t].tolist(), kl_type, 0.3)
            assert float(kl[b, t]) == pytest.approx(ref, abs=1e-6)
            assert float(mass[b, t]) == pytest.approx(ref_mass, abs=1e-6)
    assert bool((kl >= -1e-6).all())


def test_the_whole_vocabulary_gives_the_exact_kl() -> None:
    student, idx, t_lp = _teacher(3, 4, 11, 11, seed=9)
    kl, mass = topk_kl(student, idx, t_lp, "reverse")
    s = torch.log_softmax(student, dim=-1)
    t = torch.empty_like(s).scatter_(-1, idx, t_lp)
    exact = (s.exp() * (s - t)).sum(-1)
    assert torch.allclose(kl.double(), exact, atol=1e-6) and torch.allclose(mass.double(), torch.ones(3, 4, dtype=torch.float64), atol=1e-6)
    same, _ = topk_kl(t, idx, t_lp, "reverse")  # a student equal to its teacher: no divergence
    assert float(same.abs().max()) < 1e-6


def _batch(seed: int) -> tuple[torch.Tensor, BatchedDataDict]:
    student, idx, t_lp = _teacher(4, 6, 13, 4, seed)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 0, 0], [0, 1, 1, 0, 0, 0]]).float()
    shift = (0, 0, 1, 0)  # position t holds the distribution emitting token t (the logits at t - 1)
    data = BatchedDataDict(
        input_ids=torch.zeros(4, 6, dtype=torch.long), token_mask=mask, sample_mask=torch.tensor([1.0, 1, 0, 1]),
        teacher_topk_indices=torch.nn.functional.pad(idx[:, :-1], shift),
        teacher_topk_logprobs=torch.nn.functional.pad(t_lp[:, :-1], shift),
        advantages=torch.randn(4, 6, generator=torch.Generator().manual_seed(seed)) * mask,
        generation_logprobs=torch.zeros(4, 6), prev_logprobs=torch.zeros(4, 6))
    return student.float(), data


def test_distillation_loss_is_the_token_mean_of_the_kl_and_sums_over_micro_batches() -> None:
    logits, data = _batch(4)
    m = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    n = m.sum()
    fn = DistillationLossFn({"kl_type": "reverse"})
    loss, metrics = fn(logits, data, torch.tensor(3.0), n)
    kl, _ = topk_kl(logits[:, :-1], data["teacher_topk_indices"][:, 1:], data["teacher_topk_logprobs"][:, 1:])
    assert float(loss) == pytest.approx(float((kl * m).sum() / n), abs=1e-6)
    assert metrics["kl_to_teacher"] == pytest.approx(float(loss), abs=1e-6)
    assert 0 < metrics["teacher_topk_mass"] <= 1 and 0 < metrics["student_topk_mass"] <= 1
    parts = sum(float(fn(logits[i:i + 2], data.slice(i, i + 2), torch.tensor(3.0), n)[0]) for i in (0, 2))
    assert parts == pytest.approx(float(loss), abs=1e-6)


def test_grpo_loss_adds_the_teacher_kl_times_its_coefficient() -> None:
    logits, data = _batch(5)
    n = (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    base = {"reference_policy_kl_penalty": 0.0, "force_on_policy_ratio": True}
    plain, _ = ClippedPGLossFn(base)(logits, data, torch.tensor(3.0), n)
    added, metrics = ClippedPGLossFn({**base, "distillation_kl_coef": 0.25})(logits, data, torch.tensor(3.0), n)
    kl, _ = DistillationLossFn()(logits, data, torch.tensor(3.0), n)
    assert float(added - plain) == pytest.approx(0.25 * float(kl), abs=1e-6)
    assert metrics["kl_to_teacher"] == pytest.approx(float(kl), abs=1e-6)


@pytest.mark.parametrize("kl_type", ["reverse", "forward", "mixed"])
def test_the_kl_through_the_chunked_output_layer_equals_the_whole_logits(kl_type: str) -> None:
    """The student's side read a few tokens at a time (HeadLogits.logprobs_at): the KL, the student's top-k mass
    and the gradients of the hidden states and the output layer equal those of the whole logits."""
    from rlpost.ops.chunked_head import HeadLogits

    g = torch.Generator().manual_seed(4)
    b, t, h, v, k = 2, 7, 6, 23, 5
    hidden = torch.randn(b, t, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    _, indices, teacher_lp = _teacher(b, t, v, k, seed=5)
    whole_kl, whole_mass = topk_kl(hidden @ weight.T / 0.8, indices, teacher_lp, kl_type, 0.3)
    want = torch.autograd.grad(whole_kl.sum(), (hidden, weight))
    chunked_kl, chunked_mass = topk_kl(HeadLogits(hidden, weight, 0.8, 3), indices, teacher_lp, kl_type, 0.3)
    got = torch.autograd.grad(chunked_kl.sum(), (hidden, weight))
    torch.testing.assert_close(chunked_kl, whole_kl, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chunked_mass, whole_mass, rtol=1e-12, atol=1e-12)
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-10)
