"""Megatron-Core on CPU over gloo: logprob parity with HF, export round trip and one training step.

One spawned job of two ranks (megatron_test_helpers.worker) runs five phases: TP=1 with DP=2, TP=2, expert
parallelism EP=2 (with DP=2), context parallelism CP=2 and PP=2;
the tests compare its results here against plain HF / PyTorch.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from rlpost.distributed.ports import free_port
from tests.unit.models.megatron import megatron_test_helpers as h

pytestmark = pytest.mark.slow

TOL = 1e-4
PHASES: dict[str, dict[str, Any]] = {
    "tp1_dp2": {
        "tp": 1,
        "pp": 1,
        "logprobs": ["qwen2_tied", "qwen2_untied", "llama", "qwen3", "mistral", "phi3", "olmo2", "qwen3_moe",
                     "mixtral", "gemma2", "gemma3"],
        "logprobs_bf16": ["qwen2_tied"],
        "export": ["qwen2_untied", "olmo2"],
        "train": {
            "qwen_sgd": ("qwen2_tied", "sgd", 0.5, 0.0),
            "olmo2_adam": ("olmo2", "adam", 1e-2, 0.0),
            "qwen_adam": ("qwen2_untied", "adam", 1e-3, 0.0),
            "llama_sgd_clip": ("llama", "sgd", 0.5, 0.05),
            "qwen3_moe_sgd": ("qwen3_moe", "sgd", 0.5, 0.0),  # at TP > 1 megatron trains experts with SP alone
            "gemma2_adam": ("gemma2", "adam", 1e-2, 0.0),
        },
    },
    "tp2": {
        "tp": 2,
        "pp": 1,
        "logprobs": ["qwen2_tied", "llama", "qwen3", "mistral", "phi3", "olmo2", "qwen3_moe", "mixtral", "gemma2",
                     "gemma3"],
        "export": ["qwen2_tied", "llama", "qwen3", "mistral", "phi3", "olmo2", "qwen3_moe", "mixtral", "gemma2",
                   "gemma3"],
        "train": {"qwen_sgd": ("qwen2_tied", "sgd", 0.5, 0.0), "llama_adam": ("llama", "adam", 1e-3, 0.0),
                  "qwen3_sgd": ("qwen3", "sgd", 0.5, 0.0), "phi3_sgd": ("phi3", "sgd", 0.5, 0.0),
                  "olmo2_sgd": ("olmo2", "sgd", 0.5, 0.0),  # the q/k norms' mean of squares over TP
                  "gemma3_sgd": ("gemma3", "sgd", 0.5, 0.0)},  # sandwich norms, per-head q/k norms, split heads
    },
    "ep2": {  # expert parallelism: each rank holds two of the four experts, over DP=2
        "tp": 1,
        "pp": 1,
        "ep": 2,
        "logprobs": ["qwen3_moe", "mixtral"],
        "export": ["qwen3_moe", "mixtral"],
        "train": {"qwen3_moe_sgd": ("qwen3_moe", "sgd", 0.5, 0.0), "mixtral_adam_clip": ("mixtral", "adam", 1e-2, 0.05)},
    },
    "cp2": {  # context parallelism: each rank reads half of every sequence (rlpost.models.megatron.context_parallel)
        "tp": 1,
        "pp": 1,
        "cp": 2,
        "logprobs": ["qwen2_tied", "llama", "qwen3"],
        "export": ["qwen2_tied"],
        "train": {"llama_sgd": ("llama", "sgd", 0.5, 0.0), "qwen_adam_clip": ("qwen2_tied", "adam", 1e-2, 0.05)},
    },
    "pp2": {
        "tp": 1,
        "pp": 2,
        # every family; Gemma 3: each stage's layers keep their own window and RoPE base
        "logprobs": ["qwen2_tied", "llama", "qwen3", "mistral", "phi3", "olmo2", "qwen3_moe", "mixtral", "gemma3"],
        "export": ["qwen2_tied", "llama", "qwen3", "mistral", "phi3", "olmo2", "qwen3_moe", "mixtral", "gemma3"],
        "train": {"qwen_sgd": ("qwen2_tied", "sgd", 0.5, 0.0), "llama_sgd": ("llama", "sgd", 0.5, 0.0),
                  "gemma2_sgd": ("gemma2", "sgd", 0.5, 0.0), "qwen3_moe_sgd": ("qwen3_moe", "sgd", 0.5, 0.0),
                  "olmo2_adam": ("olmo2", "adam", 1e-2, 0.05)},
    },
}


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("hf_models"))
    vocab = {name: make().vocab_size for name, make in h.MODEL_CONFIGS.items()}
    return {
        "files": {name: os.path.join(h.save_hf_model(name, root), "model.safetensors") for name in vocab},
        "inputs": {name: h.batch(v, 4, seed=7) for name, v in vocab.items()},
        "train_batches": {name: h.train_microbatches(v) for name, v in vocab.items()},
    }


@pytest.fixture(scope="module")
def results(shared: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out_dir = str(tmp_path_factory.mktemp("megatron_results"))
    h.spawn(h.worker, 2, (2, free_port("127.0.0.1"), {"shared": shared, **PHASES}, out_dir), timeout_s=180)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def hf_models() -> dict[str, Any]:
    return {name: h.make_hf_model(name) for name in h.MODEL_CONFIGS}


@pytest.mark.parametrize("phase", list(PHASES))
def test_logprob_parity(phase: str, results: list[dict[str, Any]], shared: dict[str, Any], hf_models: dict) -> None:
    for name in PHASES[phase]["logprobs"]:
        ids, mask = shared["inputs"][name]
        with torch.no_grad():
            ref = h.hf_logprobs(hf_models[name], ids, mask, h.TEMPERATURE)
        for res in results:  # every rank returns the full result
            got = torch.from_numpy(res[phase]["logprobs"][name])
            assert got.shape == ids.shape
            assert torch.all(got[:, 0] == 0)
            diff = (got - ref)[mask.bool()].abs().max().item()
            assert diff <= TOL, f"{phase}/{name}: max |megatron - hf| logprob = {diff}"


def test_context_parallel_ranks_read_half_of_each_sequence(results: list[dict[str, Any]]) -> None:
    """Under CP=2 each rank's model reads SEQ / 2 positions (its two chunks), and the logprobs above still equal HF's
    over the whole sequence; without CP it reads all SEQ."""
    for res in results:
        assert res["cp2"]["positions_in"] == [h.SEQ // 2] * 2 * len(PHASES["cp2"]["logprobs"])  # two micro-batches
        assert set(res["tp1_dp2"]["positions_in"]) == {h.SEQ}


def test_bf16_forward_runs_on_cpu(results: list[dict[str, Any]], shared: dict[str, Any], hf_models: dict) -> None:
    """bf16 params (Float16Module) forward on CPU: logprobs close to the fp32 HF ones (bf16 rounding only)."""
    ids, mask = shared["inputs"]["qwen2_tied"]
    with torch.no_grad():
        ref = h.hf_logprobs(hf_models["qwen2_tied"], ids, mask, h.TEMPERATURE)
    for res in results:
        got = torch.from_numpy(res["tp1_dp2"]["logprobs_bf16"]["qwen2_tied"])
        assert got.dtype == torch.float32
        assert (got - ref)[mask.bool()].abs().max().item() < 0.1


@pytest.mark.parametrize("phase", list(PHASES))
def test_export_round_trip(phase: str, results: list[dict[str, Any]], hf_models: dict) -> None:
    for name in PHASES[phase]["export"]:
        ref = h.checkpoint_state(hf_models[name])
        for res in results:  # every rank yields every weight
            got = res[phase]["export"][name]
            assert list(got) == list(results[0][phase]["export"][name])  # same order on every rank
            assert set(got) == set(ref), sorted(set(got) ^ set(ref))
            for k, v in ref.items():
                assert torch.equal(got[k], v), f"{phase}/{name}: {k}"


@pytest.mark.parametrize("phase", list(PHASES))
def test_train_step_matches_pytorch(
    phase: str, results: list[dict[str, Any]], shared: dict[str, Any], hf_models: dict
) -> None:
    for key, (name, optim, lr, clip) in PHASES[phase]["train"].items():
        mbs = shared["train_batches"][name]
        ref_sd, ref_norm, ref_loss = h.torch_reference_step(name, mbs, optim, lr, clip)
        before = h.checkpoint_state(hf_models[name])
        for res in results:
            out = res[phase]["train"][key]
            assert out["loss"] == pytest.approx(ref_loss, rel=1e-5)
            assert out["metrics"]["nll"] == pytest.approx(ref_loss, rel=1e-5)
            assert out["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
            assert out["lr"] == pytest.approx(lr)
            assert set(out["weights"]) == set(ref_sd)
            moved = 0.0
            for k, v in ref_sd.items():
                diff = (out["weights"][k] - v).abs().max().item()
                assert diff <= TOL, f"{phase}/{key}: {k} differs from the PyTorch step by {diff}"
                moved = max(moved, (v - before[k]).abs().max().item())
            assert moved > 10 * TOL, f"{phase}/{key}: the step barely moved the weights ({moved})"


def test_package_imports_do_not_import_megatron(results: list[dict[str, Any]]) -> None:
    """In the fresh worker processes, importing every rlpost.models.megatron module left megatron unimported."""
    assert all(res["imports_are_lazy"] for res in results)
