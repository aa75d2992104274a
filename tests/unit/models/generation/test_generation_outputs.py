"""Pure parts of the rollout engines: prompt unpacking, sharding, output assembly, sampling settings, RPC packing."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlpost.config.schema.generation import HFGenerationConfig, VllmConfig
from rlpost.models.generation.hf_generation import hf_sampling_spec
from rlpost.models.generation.interfaces import OUTPUT_KEYS
from rlpost.models.generation.outputs import (
    GeneratedBatch,
    GeneratedSample,
    assemble_outputs,
    contiguous_splits,
    unpack_prompts,
)
from rlpost.models.generation.vllm_extension import check_against_info, pack_for_rpc, unpack_rpc
from rlpost.models.generation.vllm_generation import engine_kwargs, sampling_spec

PAD = 0


def test_unpack_prompts_and_validation() -> None:
    ids = torch.tensor([[5, 6, 7, PAD], [9, PAD, PAD, PAD]])
    assert unpack_prompts({"input_ids": ids, "input_lengths": torch.tensor([3, 1])}) == [[5, 6, 7], [9]]
    with pytest.raises(ValueError, match="input_lengths"):
        unpack_prompts({"input_ids": ids, "input_lengths": torch.tensor([5, 1])})
    with pytest.raises(ValueError, match="input_lengths"):
        unpack_prompts({"input_ids": ids, "input_lengths": torch.tensor([0, 1])})
    with pytest.raises(ValueError, match=r"\[B, P\]"):
        unpack_prompts({"input_ids": ids[0], "input_lengths": torch.tensor([3])})


@pytest.mark.parametrize("n,parts", [(7, 2), (2, 3), (0, 2), (64, 4), (5, 1)])
def test_contiguous_splits_cover_in_order(n: int, parts: int) -> None:
    splits = contiguous_splits(n, parts)
    assert len(splits) == parts
    assert [i for a, b in splits for i in range(a, b)] == list(range(n))
    sizes = [b - a for a, b in splits]
    assert max(sizes) - min(sizes) <= 1


def test_assemble_outputs_contract() -> None:
    ids = torch.tensor([[5, 6, 7], [9, PAD, PAD]])
    lens = torch.tensor([3, 1])
    samples = [
        GeneratedSample([11, 12], [-0.5, -1.5], truncated=False),
        GeneratedSample([21, 22, 23, 24], [-1.0, -2.0, -3.0, -4.0], truncated=True),
    ]
    out = assemble_outputs(ids, lens, samples, PAD)
    assert set(OUTPUT_KEYS) <= set(out)
    assert out["output_ids"].shape == (2, 3 + 4)
    assert out["output_ids"].tolist() == [[5, 6, 7, 11, 12, PAD, PAD], [9, 21, 22, 23, 24, PAD, PAD]]
    assert out["logprobs"].tolist() == [[0, 0, 0, -0.5, -1.5, 0, 0], [0, -1.0, -2.0, -3.0, -4.0, 0, 0]]
    assert out["generation_lengths"].tolist() == [2, 4]
    assert out["unpadded_sequence_lengths"].tolist() == [5, 5]
    assert out["truncated"].tolist() == [False, True]
    assert out["truncated"].dtype == torch.bool and out["logprobs"].dtype == torch.float32
    with pytest.raises(ValueError):
        assemble_outputs(ids, lens, samples[:1], PAD)


def _rowwise(ids: torch.Tensor, lens: torch.Tensor, samples: list[GeneratedSample], pad: int) -> list[list[int]]:
    """The rows assemble_outputs must build, one Python list each (what it did before it scattered)."""
    width = ids.shape[1] + max(len(s.token_ids) for s in samples)
    rows = []
    for row, n, s in zip(ids.tolist(), lens.tolist(), samples, strict=True):
        rows.append(row[:n] + s.token_ids + [pad] * (width - n - len(s.token_ids)))
    return rows


def test_packed_batch_assembles_like_samples() -> None:
    """Replica parts (packed) and loose samples give the same tensors, row by row, ragged prompts and answers;
    the padding of a prompt row never leaks into the output."""
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 6, (9,), generator=g)
    ids = torch.randint(1, 50, (9, 6), generator=g)
    ids[torch.arange(6) >= lens[:, None]] = 99  # prompt padding, not pad_id: must not be copied
    samples = []
    for i in range(9):
        n = int(torch.randint(0, 5, (1,), generator=g))
        toks = torch.randint(100, 200, (n,), generator=g).tolist()
        samples.append(GeneratedSample(toks, [-0.25 * (k + 1) - i for k in range(n)], truncated=n == 4))
    parts = [GeneratedBatch.of(samples[:4]), GeneratedBatch.of(samples[4:])]
    packed = assemble_outputs(ids, lens, parts, PAD)
    loose = assemble_outputs(ids, lens, samples, PAD)
    for k in OUTPUT_KEYS:
        assert torch.equal(packed[k], loose[k]), k
    assert packed["output_ids"].tolist() == _rowwise(ids, lens, samples, PAD)
    for i, s in enumerate(samples):
        a = int(lens[i])
        assert packed["logprobs"][i, a : a + len(s.logprobs)].tolist() == s.logprobs
        assert float(packed["logprobs"][i].abs().sum()) == pytest.approx(sum(abs(x) for x in s.logprobs))
    assert GeneratedBatch.of(parts).samples() == samples
    with pytest.raises(ValueError, match="logprobs"):
        GeneratedBatch().add([1, 2], [0.0], False)


def test_sampling_spec_from_config() -> None:
    cfg = VllmConfig(max_new_tokens=16, temperature=0.7, top_p=0.9, top_k=None)
    s = sampling_spec(cfg, greedy=False, eos_token_id=2)
    assert s["temperature"] == 0.7 and s["top_p"] == 0.9 and s["top_k"] == -1 and s["max_tokens"] == 16
    assert s["stop_token_ids"] == [2] and s["ignore_eos"] and s["logprobs"] == 0 and s["stop"] is None
    g = sampling_spec(cfg, greedy=True, eos_token_id=2)
    assert g["temperature"] == 0.0 and g["top_p"] == 1.0
    cfg.stop_token_ids, cfg.stop_strings, cfg.top_k = [], ["</a>"], 5
    s = sampling_spec(cfg, greedy=False, eos_token_id=2)
    assert s["stop_token_ids"] == [] and s["stop"] == ["</a>"] and s["top_k"] == 5 and s["detokenize"]
    h = hf_sampling_spec(HFGenerationConfig(top_k=None, stop_token_ids=[3, 4]), greedy=False, eos_token_id=2)
    assert h["top_k"] == 0 and h["stop_token_ids"] == [3, 4] and h["stop_strings"] == []


def test_engine_kwargs_cpu_and_gpu() -> None:
    cfg = VllmConfig()
    cfg.vllm_cfg.precision, cfg.vllm_cfg.seed, cfg.vllm_cfg.kv_cache_space_gb = "bfloat16", 7, 0.5
    cfg.vllm_kwargs = {"max_num_seqs": 8}
    cpu = engine_kwargs(cfg, replica=1, use_gpus=False)
    assert cpu["dtype"] == "bfloat16" and cpu["seed"] == 8 and cpu["kv_cache_memory_bytes"] == 2**29
    assert cpu["logprobs_mode"] == "processed_logprobs" and cpu["max_num_seqs"] == 8
    assert "enable_sleep_mode" not in cpu and cpu["distributed_executor_backend"] == "uni"
    cfg.vllm_cfg.tensor_parallel_size = 2
    gpu = engine_kwargs(cfg, replica=0, use_gpus=True)
    assert gpu["enable_sleep_mode"] and gpu["distributed_executor_backend"] == "ray"
    assert gpu["gpu_memory_utilization"] == cfg.vllm_cfg.gpu_memory_utilization


def test_rpc_packing_round_trip_and_info_check() -> None:
    named = [
        ("a", torch.randn(3, 4)),
        ("b", torch.randn(5).to(torch.bfloat16)),
        ("c", torch.arange(6).reshape(2, 3)),
        ("e", torch.zeros(0)),
    ]
    back = unpack_rpc(pack_for_rpc(named))
    assert [n for n, _ in back] == ["a", "b", "c", "e"]
    for (_, x), (_, y) in zip(named, back, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)
    info = {n: (tuple(t.shape), str(t.dtype)) for n, t in named}
    check_against_info(back, info)
    with pytest.raises(ValueError, match="missing"):
        check_against_info(back[:2], info)
    with pytest.raises(ValueError, match="expected"):
        check_against_info([("a", torch.randn(4, 3))] + back[1:], info)


def test_interface_is_abstract() -> None:
    from rlpost.models.generation.interfaces import GenerationInterface

    with pytest.raises(TypeError):
        GenerationInterface()  # type: ignore[abstract]
    assert SimpleNamespace  # keep import used


def test_auto_kv_cache_is_sized_from_the_model(tmp_path: Path) -> None:
    from rlpost.models.generation.vllm_generation import AUTO_KV_MAX_BYTES, AUTO_KV_MIN_BYTES, auto_kv_cache_bytes

    def model(**cfg: int) -> str:
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        return str(d)

    mid = model(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, hidden_size=512)
    # K and V x 4 layers x 2 kv heads x 64 dims x 4 bytes, 256 sequences of 128 tokens
    assert auto_kv_cache_bytes(mid, 128, "float32") == 2 * 4 * 2 * 64 * 4 * 128 * 256
    assert auto_kv_cache_bytes(mid, 128, "bfloat16") == 2 * 4 * 2 * 64 * 2 * 128 * 256
    tiny = model(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    assert auto_kv_cache_bytes(tiny, 64, "float32") == AUTO_KV_MIN_BYTES
    big = model(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    assert auto_kv_cache_bytes(big, 2048, "float32") == AUTO_KV_MAX_BYTES
    assert auto_kv_cache_bytes(str(tmp_path / "missing"), 64, "float32") == AUTO_KV_MAX_BYTES
    cfg = VllmConfig()
    cfg.vllm_cfg.max_model_len = 128
    assert engine_kwargs(cfg, 0, use_gpus=False, model_path=mid)["kv_cache_memory_bytes"] == 2 * 4 * 2 * 64 * 4 * 128 * 256
