"""policy.hf_config_overrides reaches the trainer, the HF engine and vLLM alike (issue #11 §4), so the engine
never samples from a model config the trainer does not train."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from rlpost.config.schema.generation import HFGenerationConfig, VllmConfig, VllmSpecificArgs
from rlpost.config.schema.policy import DTensorPolicyConfig

OVERRIDES = {"rms_norm_eps": 0.5}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Path) -> Path:
    return tiny_model_dir


def _logprobs(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]


def _trainer_model(model_dir: Path, overrides: dict[str, Any]) -> Any:
    from rlpost.models.policy.hf_loading import load_hf_causal_lm

    cfg = DTensorPolicyConfig(model_name=str(model_dir), hf_config_overrides=dict(overrides))
    return load_hf_causal_lm(cfg, torch.float32).eval()


def test_trainer_and_hf_engine_run_the_same_overridden_model(model_dir: Path) -> None:
    from rlpost.models.generation.hf_generation import HFGenerationWorker

    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])
    trainer = _trainer_model(model_dir, OVERRIDES)
    engine = HFGenerationWorker(str(model_dir), hf_overrides=dict(OVERRIDES))
    plain = HFGenerationWorker(str(model_dir))
    assert trainer.config.rms_norm_eps == engine.model.config.rms_norm_eps == 0.5
    assert plain.model.config.rms_norm_eps != 0.5
    lp_trainer, lp_engine, lp_plain = (_logprobs(m, ids) for m in (trainer, engine.model, plain.model))
    torch.testing.assert_close(lp_trainer, lp_engine)
    assert (lp_engine - lp_plain).abs().max() > 1e-3  # the override changes the model


def test_hf_generation_hands_the_overrides_to_its_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlpost.models.generation import hf_generation

    seen: list[Any] = []

    class Group:
        def __init__(self, cluster: Any, cls: Any, *args: Any, **kwargs: Any) -> None:
            seen.extend(args)

        def run_rank0(self, method: str) -> dict[str, int]:
            return {"eos_token_id": 2, "pad_token_id": 0}

    monkeypatch.setattr(hf_generation, "RayWorkerGroup", Group)
    cluster = type("C", (), {"world_size": 1})()
    hf_generation.HFGeneration(HFGenerationConfig(), cluster, model_path="m", hf_overrides=OVERRIDES)  # type: ignore[arg-type]
    assert seen[-1] == OVERRIDES


def test_vllm_engine_kwargs_carry_the_overrides_and_expert_parallelism() -> None:
    from rlpost.models.generation.vllm_generation import engine_kwargs

    cfg = VllmConfig()
    assert "hf_overrides" not in engine_kwargs(cfg, 0, False) and "enable_expert_parallel" not in engine_kwargs(cfg, 0, True)
    assert engine_kwargs(cfg, 0, False, OVERRIDES)["hf_overrides"] == OVERRIDES
    ep = dataclasses.replace(cfg, vllm_cfg=VllmSpecificArgs(tensor_parallel_size=2, expert_parallel_size=2))
    assert engine_kwargs(ep, 0, True)["enable_expert_parallel"] is True


def test_vllm_builds_its_model_config_with_the_overrides(model_dir: Path) -> None:
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import EngineArgs

    from rlpost.models.generation.vllm_generation import engine_kwargs

    kwargs = engine_kwargs(VllmConfig(), 0, False, OVERRIDES)
    hf_config = EngineArgs(model=str(model_dir), **kwargs).create_engine_config().model_config.hf_config
    assert hf_config.rms_norm_eps == 0.5
    assert hf_config.rms_norm_eps == _trainer_model(model_dir, OVERRIDES).config.rms_norm_eps
