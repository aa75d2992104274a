"""params_finite: the post-update weight check (train/params_finite) is exact, fast path or not."""

from __future__ import annotations

import torch

from rlpost.models.policy.weight_export import params_finite


def _params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(64, 32, generator=g), torch.randn(32, generator=g).to(torch.bfloat16),
            torch.zeros(0), torch.arange(5)]  # an empty tensor and an integer buffer are skipped


def test_finite_weights_pass() -> None:
    assert params_finite(_params())


def test_one_nan_or_inf_anywhere_fails() -> None:
    for bad in (float("nan"), float("inf"), float("-inf")):
        for which in (0, 1):
            ps = _params()
            ps[which].view(-1)[7] = bad
            assert not params_finite(ps), (bad, which)


def test_huge_finite_weights_whose_norm_overflows_still_pass() -> None:
    ps = _params()
    ps[0].fill_(3e38)  # finite, but the sum of squares overflows fp32: the exact check decides
    assert params_finite(ps)
