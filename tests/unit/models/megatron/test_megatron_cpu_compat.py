"""The CPU compatibility layer: off by default, scoped, reference-counted, never active with CUDA."""

from __future__ import annotations

import pytest
import torch

from rlpost.models.megatron import cpu_compat

ORIGINAL_CURRENT_DEVICE = torch.cuda.current_device

needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")


def test_inactive_by_default() -> None:
    assert not cpu_compat.is_cpu_compat_active()
    assert torch.cuda.current_device is ORIGINAL_CURRENT_DEVICE


@needs_cpu_only
def test_context_redirects_cuda_to_cpu_and_restores() -> None:
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")
    with cpu_compat.cpu_compat() as active:
        assert active and cpu_compat.is_cpu_compat_active()
        assert torch.cuda.current_device() == "cpu"
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.empty(2, device=torch.device("cuda", 0)).device.type == "cpu"
        assert torch.ones(2, device=torch.cuda.current_device()).device.type == "cpu"
        t = torch.arange(3.0)
        assert t.cuda() is t
        assert t.to("cuda").device.type == "cpu"
        assert t.to(torch.float64).dtype == torch.float64  # other .to() calls are untouched
        with cpu_compat.cpu_compat():  # nested: still on after the inner exit
            pass
        assert cpu_compat.is_cpu_compat_active()
        assert cpu_compat.enable_cpu_compat()  # idempotent, reference-counted
        cpu_compat.disable_cpu_compat()
        assert cpu_compat.is_cpu_compat_active()
    assert not cpu_compat.is_cpu_compat_active()
    assert torch.cuda.current_device is ORIGINAL_CURRENT_DEVICE
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")
    cpu_compat.disable_cpu_compat()  # an extra disable is harmless
    assert not cpu_compat.is_cpu_compat_active()


def test_never_active_when_cuda_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not cpu_compat.cpu_compat_needed()
    assert cpu_compat.enable_cpu_compat() is False
    with cpu_compat.cpu_compat() as active:
        assert not active
        assert not cpu_compat.is_cpu_compat_active()
        assert torch.cuda.current_device is ORIGINAL_CURRENT_DEVICE
