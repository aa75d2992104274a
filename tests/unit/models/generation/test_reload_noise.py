"""vLLM's reload warnings that every refit bucket sets off are dropped at their loggers, and only those, and only
while rlpost loads (rlpost.models.generation.vllm_extension.quiet_reload)."""

from __future__ import annotations

import logging

import pytest

from rlpost.models.generation.vllm_extension import RELOAD_NOISE, quiet_reload

LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"
INPLACE = "vllm.model_executor.model_loader.reload.inplace"


def test_only_the_bucket_noise_is_dropped_and_only_while_loading(caplog: pytest.LogCaptureFixture) -> None:
    assert set(RELOAD_NOISE) == {LAYERWISE, INPLACE}
    layerwise, inplace = logging.getLogger(LAYERWISE), logging.getLogger(INPLACE)
    with caplog.at_level(logging.DEBUG):
        with quiet_reload():
            layerwise.warning("%s: Failed to load weights", "RMSNorm")
            inplace.warning("Following weights were not loaded from checkpoint: %s", {"model.norm.weight"})
            layerwise.warning("%s: Delayed processing", "RMSNorm")  # another message of the same logger
            logging.getLogger("vllm.other").warning("%s: Failed to load weights", "X")  # another logger
        layerwise.warning("%s: Failed to load weights", "after")  # outside a load: vLLM's warning stands
    assert [r.getMessage() for r in caplog.records] == [
        "RMSNorm: Delayed processing", "X: Failed to load weights", "after: Failed to load weights"]
    assert not layerwise.filters and not inplace.filters
