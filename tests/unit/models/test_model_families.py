"""Each family `model.tiny.architecture` builds, on the DTensor worker (one rank, in-process): its logprobs equal
transformers' own forward of the same checkpoint. The Megatron side of each family (conversion both ways, TP/PP
parity with transformers, a training step): tests/unit/models/megatron/; through the CLI on both backends, with the
refit into vLLM: tests/integration/test_grpo.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

FAMILIES = ("qwen2", "qwen3", "llama", "mistral", "gemma2", "gemma3_text", "phi3", "olmo2", "qwen3_moe", "mixtral")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from rlpost.config.schema.model import TinyModelConfig
    from rlpost.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("families")  # built in this process (a run's driver builds in a child of its own)
    return {a: build_tiny_model(TinyModelConfig(architecture=a, num_key_value_heads=1, tie_word_embeddings=a != "llama",
                                                seed=3), root / a) for a in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_worker_scores_each_family_as_transformers_does(family: str, family_dirs: dict[str, Path],
                                                           one_rank: Any) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlpost.distributed.batched_data_dict import BatchedDataDict

    model_dir = family_dirs[family]
    assert AutoConfig.from_pretrained(model_dir).model_type == family
    ids = torch.randint(3, 380, (3, 10), generator=torch.Generator().manual_seed(5))
    data = BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([10, 7, 9]))
    worker = one_rank(model=model_dir)
    got = worker.get_logprobs(data)["logprobs"]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(hf(input_ids=ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    for row, n in enumerate([10, 7, 9]):  # position 0 has no logprob; padding past a row's length is not scored
        assert (got[row, 1:n] - lp[row, : n - 1]).abs().max() <= 1e-5, family


def test_gemma2s_attention_scores_are_soft_capped(family_dirs: dict[str, Path], one_rank: Any,
                                                 tmp_path: Path) -> None:
    """With a cap that bends the scores (0.05), the worker's logprobs are transformers' eager attention's, which caps
    them as vLLM does; its SDPA attention would leave the cap out."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    from rlpost.distributed.batched_data_dict import BatchedDataDict

    model_dir = tmp_path / "gemma2"
    shutil.copytree(family_dirs["gemma2"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "attn_logit_softcapping": 0.05}))
    ids = torch.randint(3, 380, (2, 10), generator=torch.Generator().manual_seed(5))
    got = one_rank(model=model_dir).get_logprobs(
        BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([10, 10])))["logprobs"][:, 1:]
    ref = {}
    for attention in ("eager", "sdpa"):
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attention).eval()
        with torch.no_grad():
            ref[attention] = torch.log_softmax(hf(input_ids=ids).logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    assert (got - ref["eager"]).abs().max() <= 1e-5
    assert (got - ref["sdpa"]).abs().max() > 2e-4  # 1.4e-3 for this model


@pytest.mark.parametrize("family", FAMILIES)
def test_the_hf_export_of_each_family_is_its_checkpoint(family: str, family_dirs: dict[str, Path], one_rank: Any,
                                                        tmp_path: Path) -> None:
    """An untrained worker's HF export holds exactly the checkpoint it loaded: the same names (a MoE layer's experts
    one matrix each, as the hub's checkpoints and vLLM have them, though transformers fuses them in memory) and the
    same values; transformers loads it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model_dir = family_dirs[family]
    worker = one_rank(model=model_dir)
    worker.save_checkpoint(str(tmp_path / "weights"), None, hf_export=True)
    exported = load_file(tmp_path / "weights" / "hf" / "model.safetensors")
    original = load_file(model_dir / "model.safetensors")
    assert exported.keys() == original.keys(), family
    assert all(torch.equal(exported[k], original[k]) for k in original), family
    AutoModelForCausalLM.from_pretrained(tmp_path / "weights" / "hf")
