"""Rollout engines end to end: real Ray actors, real vLLM (CPU) and transformers, the tiny model.

One engine of each kind is started per module (vLLM: 2 data-parallel replicas; HF: 1 worker; vLLM
async: 1 replica) and every test first loads the weights it needs, so tests don't depend on order.
Logprob checks compare against a plain HF model holding the same weights, computed here.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlpost.distributed.ports import free_port

pytestmark = pytest.mark.slow

TEMPERATURE = 0.8
PROMPTS = [
    "What is 3 + 4 mod 10?",
    "Next letter after c?",
    "Copy the digit 7:",
    "The quick brown fox",
    "Hello, world!",
    "What letter comes after q? The answer is",
    "Solve the problem",
]


# ---------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def ref_model(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _perturbed(ref_model: Any, seed: int, scale: float = 0.3, mlp_factor: float = 1.0) -> dict[str, torch.Tensor]:
    """The tiny model's weights plus seeded noise (sharper, more varied outputs); tied weights stay tied."""
    g = torch.Generator().manual_seed(seed)
    base = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    for n, p in base.items():
        if p.dim() >= 2:
            p.add_(torch.randn(p.shape, generator=g) * scale)
            if "mlp.down_proj" in n:
                p.mul_(mlp_factor)
    sd = {}
    for n in ref_model.state_dict():
        src = "model.embed_tokens.weight" if n == "lm_head.weight" and n not in base else n
        sd[n] = base[src].clone()
    return sd


@pytest.fixture(scope="module")
def weights_a(ref_model: Any) -> dict[str, torch.Tensor]:
    return _perturbed(ref_model, seed=1)


@pytest.fixture(scope="module")
def weights_b(ref_model: Any) -> dict[str, torch.Tensor]:
    return _perturbed(ref_model, seed=2, mlp_factor=1.5)


def _vllm_cfg(async_engine: bool = False, precision: str = "float32") -> Any:
    from rlpost.config.schema.generation import VllmConfig

    cfg = VllmConfig(max_new_tokens=12, temperature=TEMPERATURE)
    cfg.vllm_cfg.precision = precision
    cfg.vllm_cfg.kv_cache_space_gb = 0.125
    cfg.vllm_cfg.max_model_len = 128
    cfg.vllm_cfg.async_engine = async_engine
    return cfg


@pytest.fixture(scope="module")
def vllm_engine(ray_local: None, tiny_model_dir: Path) -> Iterator[Any]:
    from rlpost.distributed.virtual_cluster import RayVirtualCluster
    from rlpost.models.generation.vllm_generation import VllmGeneration

    cluster = RayVirtualCluster("test-vllm", workers_per_node=2, cpus_per_bundle=0.25, placement_timeout_s=60)
    engine = VllmGeneration(_vllm_cfg(), cluster, str(tiny_model_dir), timeout_s=240)
    yield engine
    engine.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def hf_engine(ray_local: None, tiny_model_dir: Path) -> Iterator[Any]:
    from rlpost.config.schema.generation import HFGenerationConfig
    from rlpost.distributed.virtual_cluster import RayVirtualCluster
    from rlpost.models.generation.hf_generation import HFGeneration

    cluster = RayVirtualCluster("test-hf", workers_per_node=1, cpus_per_bundle=0.25, placement_timeout_s=60)
    cfg = HFGenerationConfig(max_new_tokens=12, temperature=TEMPERATURE, generation_batch_size=4)
    engine = HFGeneration(cfg, cluster, str(tiny_model_dir), timeout_s=240)
    yield engine
    engine.shutdown()
    cluster.shutdown()


@pytest.fixture(params=["vllm", "hf"])
def engine(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_engine")


# ---------------------------------------------------------------------------------------- helpers
def _batch(tokenizer: Any, prompts: list[str] = PROMPTS) -> dict[str, torch.Tensor]:
    rows = [tokenizer(p)["input_ids"] for p in prompts]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    return {"input_ids": ids, "input_lengths": torch.tensor([len(r) for r in rows])}


@contextlib.contextmanager
def _cfg(engine: Any, **overrides: Any) -> Iterator[None]:
    old = {k: getattr(engine.cfg, k) for k in overrides}
    for k, v in overrides.items():
        setattr(engine.cfg, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(engine.cfg, k, v)


def _generated(out: Any, i: int, batch: dict[str, torch.Tensor]) -> list[int]:
    start = int(batch["input_lengths"][i])
    return out["output_ids"][i, start : start + int(out["generation_lengths"][i])].tolist()


def _ref_logprobs(ref_model: Any, weights: dict[str, torch.Tensor], out: Any, batch: dict, temp: float) -> tuple:
    """(engine, reference) logprobs of every generated token; reference = log_softmax(logits / T) of plain HF."""
    ref_model.load_state_dict(weights)
    eng, ref = [], []
    with torch.no_grad():
        for i in range(out["output_ids"].shape[0]):
            n_in, n = int(batch["input_lengths"][i]), int(out["unpadded_sequence_lengths"][i])
            seq = out["output_ids"][i, :n]
            logits = ref_model(seq[None]).logits[0].float() / temp
            lp = logits.log_softmax(-1)[n_in - 1 : n - 1].gather(-1, seq[n_in:n, None])[:, 0]
            ref.append(lp)
            eng.append(out["logprobs"][i, n_in:n])
    return torch.cat(eng), torch.cat(ref)


def _mult_prob_error(eng: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.exp((eng - ref).abs()).mean())


def _greedy_ref(ref_model: Any, weights: dict[str, torch.Tensor], prompt: list[int], n: int) -> list[int]:
    ref_model.load_state_dict(weights)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(ref_model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


# ---------------------------------------------------------------------------------------- tests
def test_generate_contract_and_data_parallel_order(
    vllm_engine: Any, ref_model: Any, weights_a: dict, tokenizer: Any
) -> None:
    """2 replicas (fractional CPUs) return one row per prompt, in order; rows match an independent greedy decode."""
    from rlpost.models.generation.interfaces import OUTPUT_KEYS

    assert vllm_engine.num_replicas == 2
    vllm_engine.update_weights(weights_a.items())
    batch = _batch(tokenizer)
    with _cfg(vllm_engine, stop_token_ids=[]):
        out = vllm_engine.generate(batch, greedy=True)
    b, p = batch["input_ids"].shape
    assert set(OUTPUT_KEYS) <= set(out) and out["output_ids"].shape == (b, p + 12)
    assert out["generation_lengths"].tolist() == [12] * b and out["truncated"].all()
    assert torch.equal(out["unpadded_sequence_lengths"], batch["input_lengths"] + 12)
    for i in range(b):
        n_in = int(batch["input_lengths"][i])
        assert torch.equal(out["output_ids"][i, :n_in], batch["input_ids"][i, :n_in])
        assert (out["logprobs"][i, :n_in] == 0).all() and (out["logprobs"][i, n_in : n_in + 12] < 0).all()
        assert _generated(out, i, batch) == _greedy_ref(ref_model, weights_a, batch["input_ids"][i, :n_in].tolist(), 12)
    assert (out["output_ids"][0, int(out["unpadded_sequence_lengths"][0]) :] == tokenizer.pad_token_id).all()


def test_stop_token_ids_are_honoured(engine: Any, weights_a: dict, tokenizer: Any) -> None:
    engine.update_weights(weights_a.items())
    batch = _batch(tokenizer)
    with _cfg(engine, stop_token_ids=[]):
        free = engine.generate(batch, greedy=True)
    row0 = _generated(free, 0, batch)
    stop = row0[3]
    with _cfg(engine, stop_token_ids=[stop]):
        out = engine.generate(batch, greedy=True)
    for i in range(batch["input_ids"].shape[0]):
        full = _generated(free, i, batch)
        got = _generated(out, i, batch)
        if stop in full:
            k = full.index(stop) + 1
            assert got == full[:k] and not bool(out["truncated"][i])
        else:
            assert got == full and bool(out["truncated"][i])
    assert _generated(out, 0, batch)[-1] == stop


def test_stop_strings_are_honoured(engine: Any, weights_a: dict, tokenizer: Any) -> None:
    engine.update_weights(weights_a.items())
    batch = _batch(tokenizer, PROMPTS[:3])
    with _cfg(engine, stop_token_ids=[]):
        free = engine.generate(batch, greedy=True)
    row0 = _generated(free, 0, batch)
    # a stop string that is first completed by generated token k of row 0
    k, stop = next(
        (k, tokenizer.decode(row0[k - 1 : k + 1])[-2:])
        for k in range(3, len(row0))
        if len(tokenizer.decode(row0[k - 1 : k + 1])) >= 2
        and tokenizer.decode(row0[k - 1 : k + 1])[-2:] not in tokenizer.decode(row0[:k])
        and "\ufffd" not in tokenizer.decode(row0[k - 1 : k + 1])
    )
    with _cfg(engine, stop_token_ids=[], stop_strings=[stop]):
        out = engine.generate(batch, greedy=True)
    got = _generated(out, 0, batch)
    assert got == row0[: k + 1], (stop, got, row0)
    assert stop in tokenizer.decode(got) and not bool(out["truncated"][0])


def test_greedy_vllm_and_hf_agree(vllm_engine: Any, hf_engine: Any, weights_a: dict, tokenizer: Any) -> None:
    batch = _batch(tokenizer)
    outs = []
    for eng in (vllm_engine, hf_engine):
        eng.update_weights(weights_a.items())
        with _cfg(eng, stop_token_ids=[]):
            outs.append(eng.generate(batch, greedy=True))
    assert torch.equal(outs[0]["output_ids"], outs[1]["output_ids"])
    assert torch.allclose(outs[0]["logprobs"], outs[1]["logprobs"], atol=1e-4)


def test_refit_logprobs_match_plain_hf(engine: Any, ref_model: Any, weights_b: dict, tokenizer: Any) -> None:
    """After update_weights, sampled-token logprobs (T=0.8) match an HF model holding the same weights."""
    from rlpost.models.fingerprint import weight_fingerprint

    fp = engine.update_weights(weights_b.items())
    assert fp == weight_fingerprint(weights_b)
    batch = _batch(tokenizer)
    out = engine.generate(batch)
    eng, ref = _ref_logprobs(ref_model, weights_b, out, batch, TEMPERATURE)
    err = _mult_prob_error(eng, ref)
    print(f"\n{type(engine).__name__} fp32 token_mult_prob_error = {err:.8f} over {eng.numel()} tokens")
    assert eng.numel() >= 7 and err <= 1.0001


def test_refit_really_changes_the_engine(
    vllm_engine: Any, ref_model: Any, weights_a: dict, weights_b: dict, tokenizer: Any
) -> None:
    """Control for the parity test: logprobs under weights_b do NOT match a model holding weights_a."""
    vllm_engine.update_weights(weights_b.items())
    batch = _batch(tokenizer)
    out = vllm_engine.generate(batch)
    eng, ref_a = _ref_logprobs(ref_model, weights_a, out, batch, TEMPERATURE)
    assert _mult_prob_error(eng, ref_a) > 1.01


def test_corrupted_refit_is_caught(vllm_engine: Any, weights_a: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlpost.models.fingerprint import FingerprintMismatch

    monkeypatch.setenv("RLPOST_FAULT_CORRUPT_REFIT", "model.layers.0.mlp.down_proj.weight")
    monkeypatch.setenv("RLPOST_FAULT_CORRUPT_REFIT_REPLICA", "1")
    with pytest.raises(FingerprintMismatch, match="replica 1"):
        vllm_engine.update_weights(weights_a.items())
    monkeypatch.delenv("RLPOST_FAULT_CORRUPT_REFIT")
    vllm_engine.update_weights(weights_a.items())  # healthy again


def test_corrupted_refit_is_caught_hf(hf_engine: Any, weights_a: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlpost.models.fingerprint import FingerprintMismatch

    monkeypatch.setenv("RLPOST_FAULT_CORRUPT_REFIT", "model.norm.weight")
    with pytest.raises(FingerprintMismatch, match="worker 0"):
        hf_engine.update_weights(weights_a.items())
    monkeypatch.delenv("RLPOST_FAULT_CORRUPT_REFIT")
    hf_engine.update_weights(weights_a.items())


def test_refit_through_collective(vllm_engine: Any, ref_model: Any, weights_b: dict, tokenizer: Any) -> None:
    """Trainer rank 0 (this process) broadcasts over a StatelessGroup to the 2 replicas (3 processes in all)."""
    from rlpost.distributed.collective import StatelessGroup
    from rlpost.models.fingerprint import weight_fingerprint

    vllm_engine.prepare_refit_info({n: (tuple(t.shape), t.dtype) for n, t in weights_b.items()})
    port = free_port("127.0.0.1")
    joins = vllm_engine.init_collective_async("127.0.0.1", port, 1, 3, timeout_s=120)
    sender = StatelessGroup("127.0.0.1", port, 0, 3, backend="gloo", timeout_s=120, chunk_bytes=16 * 1024)
    try:
        assert sorted(r for ranks in vllm_engine._get(joins, "join") for r in ranks) == [1, 2]
        pending = vllm_engine.update_weights_from_collective_async()
        sender.broadcast_tensors(list(weights_b.items()))
        assert sender.last_stats.chunks > 1
        fp = vllm_engine.wait_collective_update(pending, expected=weight_fingerprint(weights_b))
        assert fp == weight_fingerprint(weights_b)
    finally:
        sender.close()
    batch = _batch(tokenizer)
    out = vllm_engine.generate(batch)
    eng, ref = _ref_logprobs(ref_model, weights_b, out, batch, TEMPERATURE)
    assert _mult_prob_error(eng, ref) <= 1.0001
    vllm_engine.prepare_refit_info({})


def test_async_engine_same_contract(
    ray_local: None,
    tiny_model_dir: Path,
    vllm_engine: Any,
    ref_model: Any,
    weights_a: dict,
    weights_b: dict,
    tokenizer: Any,
) -> None:
    """AsyncLLM (one coroutine per prompt): greedy equals the sync engine; refit + logprob parity hold."""
    from rlpost.distributed.virtual_cluster import RayVirtualCluster
    from rlpost.models.generation.vllm_generation import VllmGeneration

    batch = _batch(tokenizer)
    vllm_engine.update_weights(weights_a.items())
    with _cfg(vllm_engine, stop_token_ids=[]):
        sync_out = vllm_engine.generate(batch, greedy=True)
    cluster = RayVirtualCluster("test-vllm-async", workers_per_node=1, cpus_per_bundle=0.25, placement_timeout_s=60)
    engine = VllmGeneration(_vllm_cfg(async_engine=True), cluster, str(tiny_model_dir), timeout_s=240)
    try:
        engine.update_weights(weights_a.items())
        with _cfg(engine, stop_token_ids=[]):
            out = engine.generate(batch, greedy=True)
        assert torch.equal(out["output_ids"], sync_out["output_ids"])
        engine.update_weights(weights_b.items())
        out = engine.generate(batch)
        eng, ref = _ref_logprobs(ref_model, weights_b, out, batch, TEMPERATURE)
        assert _mult_prob_error(eng, ref) <= 1.0001
        _in_flight_refit_keeps_requests(engine, weights_b)
        _fanned_out_equals_one_request_per_row(engine, weights_b, tokenizer)
        _multi_turn_sync_and_async_agree(vllm_engine, engine, weights_a, tokenizer)
    finally:
        engine.shutdown()
        cluster.shutdown()


def _fanned_out_equals_one_request_per_row(engine: Any, weights: dict, tokenizer: Any) -> None:
    """GRPO's groups (a prompt repeated, consecutive seeds) go to vLLM as one request for n samples; each sample is
    exactly what its row gets as a request of its own (the rows interleaved, so no two neighbours merge)."""
    from rlpost.models.generation.vllm_worker import fan_out_runs

    engine.update_weights(weights.items())
    one = _batch(tokenizer, PROMPTS[:4])
    n, width = 4 * 5, one["input_ids"].shape[1]
    rows = torch.arange(4).repeat_interleave(5)  # each prompt 5 times in a row
    grouped = {"input_ids": one["input_ids"][rows], "input_lengths": one["input_lengths"][rows],
               "seeds": torch.arange(n) + 40}
    order = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])  # neighbours' seeds 2 apart
    spread = {k: v[order] for k, v in grouped.items()}
    ids = [r[: int(k)].tolist() for r, k in zip(grouped["input_ids"], grouped["input_lengths"], strict=True)]
    assert len(fan_out_runs(ids, grouped["seeds"].tolist(), None, False)) == 4
    assert len(fan_out_runs([ids[i] for i in order], spread["seeds"].tolist(), None, False)) == n
    with _cfg(engine, stop_token_ids=[]):
        a = engine.generate(grouped)
        b = engine.generate(spread)
    back = torch.empty_like(order)
    back[order] = torch.arange(n)
    assert a["output_ids"].shape == (n, width + 12)
    assert len({tuple(r.tolist()) for r in a["output_ids"][:5]}) > 1, "a group's samples must differ"
    for key in ("output_ids", "logprobs", "generation_lengths"):
        assert torch.equal(a[key], b[key][back]), key


def test_fanned_out_groups_equal_one_request_per_row(vllm_engine: Any, weights_a: dict, tokenizer: Any) -> None:
    _fanned_out_equals_one_request_per_row(vllm_engine, weights_a, tokenizer)


def test_generated_chunks_equal_the_whole_batch(vllm_engine: Any, weights_a: dict, tokenizer: Any) -> None:
    """generate_chunks (overlapped synchronous GRPO): one streaming call per replica, chunks 0 and 2 on replica 0, 1
    and 3 on replica 1, handed back in order, each exactly the rows generate() gives for the whole batch."""
    vllm_engine.update_weights(weights_a.items())
    one = _batch(tokenizer, PROMPTS[:4])
    rows = torch.arange(4).repeat_interleave(5)
    batch = {"input_ids": one["input_ids"][rows], "input_lengths": one["input_lengths"][rows],
             "seeds": torch.arange(20) + 70}
    bounds = [(0, 5), (5, 10), (10, 15), (15, 20)]
    with _cfg(vllm_engine, stop_token_ids=[]):
        whole = vllm_engine.generate(batch)
        chunks = list(vllm_engine.generate_chunks(batch, bounds))
    assert len(chunks) == 4
    for (a, b), part in zip(bounds, chunks, strict=True):
        for key in ("output_ids", "logprobs", "generation_lengths", "truncated"):
            assert torch.equal(part[key], whole[key][a:b]), (a, key)
    assert not torch.equal(chunks[0]["output_ids"], chunks[1]["output_ids"])


def _in_flight_refit_keeps_requests(engine: Any, weights: dict) -> None:
    """Async GRPO's in-flight weight update: requests frozen mid-generation (pause), weights loaded, resumed.
    With the same weights reloaded, every request finishes exactly as an uninterrupted run does."""
    import threading

    g = torch.Generator().manual_seed(1)
    n, width = 128, 40
    batch = {"input_ids": torch.randint(3, 300, (n, width), generator=g), "input_lengths": torch.full((n,), width),
             "seeds": torch.arange(n) + 1000}
    with _cfg(engine, stop_token_ids=[], max_new_tokens=80):
        t0 = time.perf_counter()
        straight = engine.generate(batch)
        took = time.perf_counter() - t0
        got: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: got.update(out=engine.generate(batch)))
        worker.start()
        time.sleep(took / 3)
        in_flight = worker.is_alive()
        engine.pause_for_refit()
        engine.update_weights(weights.items())
        engine.resume_after_refit()
        worker.join(timeout=240)
    assert in_flight, "the batch finished before the refit: the test needs a longer generation"
    assert torch.equal(got["out"]["output_ids"], straight["output_ids"])
    assert torch.allclose(got["out"]["logprobs"], straight["logprobs"], atol=1e-5)


def _multi_turn_sync_and_async_agree(sync_engine: Any, async_engine: Any, weights: dict, tokenizer: Any) -> None:
    """The lookup tool's two-turn episodes: lock-step turns on the sync engine and one coroutine per episode
    on the async engine give the same tokens, masks and rewards for the same seeds."""
    from rlpost.algorithms.multi_turn import TurnSettings, run_async_multi_turn_rollout, run_multi_turn_rollout
    from rlpost.config.schema.env import LookupEnvConfig
    from rlpost.data.synthetic_tasks import make_rows
    from rlpost.environments.lookup import LookupEnvironment

    rows = [{**r, "prompt_ids": tokenizer(r["problem"])["input_ids"], "env_name": "lookup", "loss_multiplier": 1.0}
            for r in make_rows("lookup", 12, seed=5)]
    env = LookupEnvironment(LookupEnvConfig())
    try:
        sync_engine.update_weights(weights.items())
        async_engine.update_weights(weights.items())
        settings = TurnSettings(max_turns=2, max_seq_len=64)
        args = (torch.arange(12), tokenizer, {"lookup": env}, settings)
        with _cfg(sync_engine, max_new_tokens=2), _cfg(async_engine, max_new_tokens=2):
            a = run_multi_turn_rollout(rows, args[0], sync_engine, *args[1:], seeds=list(range(12)))
            b = run_async_multi_turn_rollout(rows, args[0], async_engine, *args[1:], seeds=list(range(12)))
    finally:
        env.shutdown()
    for key in ("output_ids", "token_mask", "generation_lengths"):
        assert torch.equal(a.gen[key], b.gen[key]), key
    assert torch.equal(a.rewards, b.rewards) and a.metrics["rollout/mean_turns"] == 2.0
    # exactly the engine's tokens are marked: two turns of 2 tokens, the tool's answer between them unmarked
    assert a.gen["token_mask"].sum(dim=1).tolist() == [4.0] * 12


def test_many_seeded_prompts_larger_than_one_step_generate(vllm_engine: Any, weights_a: dict) -> None:
    """More seeded prompt tokens than one engine step takes (rlpost eval's 32 prompts x 4 samples on a real
    model): vLLM's chunked prefill rewound the seeded CPU generators and failed; whole prompts only on CPU."""
    vllm_engine.update_weights(weights_a.items())
    g = torch.Generator().manual_seed(0)
    n, width = 160, 100
    batch = {"input_ids": torch.randint(3, 300, (n, width), generator=g), "input_lengths": torch.full((n,), width),
             "seeds": torch.arange(n)}
    with _cfg(vllm_engine, stop_token_ids=[]):
        out = vllm_engine.generate(batch)
    assert out["output_ids"].shape == (n, width + 12) and out["generation_lengths"].tolist() == [12] * n


def test_an_engine_that_fails_to_start_is_named_when_waited_for(ray_local: None, tiny_model_dir: Path,
                                                                tmp_path: Path) -> None:
    """The constructor does not wait for the engines (the policy's actors start beside them); `wait_started` does,
    and a replica that could not start is named there, with its cause."""
    import shutil

    from rlpost.distributed.virtual_cluster import RayVirtualCluster
    from rlpost.distributed.worker_groups import WorkerGroupError
    from rlpost.models.generation.vllm_generation import VllmGeneration

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    cluster = RayVirtualCluster("test-vllm-broken", workers_per_node=1, cpus_per_bundle=0.25, placement_timeout_s=60)
    try:
        engine = VllmGeneration(_vllm_cfg(), cluster, str(broken), timeout_s=240)  # returns before the engine starts
        with pytest.raises(WorkerGroupError, match="replica 0"):
            engine.wait_started()
        engine.shutdown()
    finally:
        cluster.shutdown()


def test_a_sleeping_engine_refuses_to_generate_at_once_naming_its_state(engine: Any, tokenizer: Any) -> None:
    """One sleep/wake state machine on every device: a colocated engine sleeps after generating, and a generate call
    before it is woken (weights and KV cache) fails at once with a line naming the engine and its state, on the CPU as
    it must on a GPU, where a sleeping vLLM would wait forever."""
    from rlpost.models.generation.sleep_state import EngineAsleep

    batch = _batch(tokenizer, PROMPTS[:2])
    name = "vLLM replica" if "Vllm" in type(engine).__name__ else "HF engine rank"
    assert engine.cfg.colocated.enabled and not engine.asleep
    try:
        engine.finish_generation()
        assert engine.asleep and set(engine.state()) == {"asleep"}
        for state in ("asleep", "weights awake, KV cache asleep"):
            t0 = time.monotonic()
            with pytest.raises(Exception, match=f"{name} \\d is {state}: generation was asked of a sleeping engine"
                               ) as err:
                engine.generate(batch)
            assert time.monotonic() - t0 < 10 and EngineAsleep.__name__ in str(err.value)
            engine.prepare_for_generation(tags=["weights"])
        assert set(engine.state()) == {"weights awake, KV cache asleep"}
        engine.prepare_for_generation(tags=["kv_cache"])
        assert set(engine.state()) == {"awake"} and not engine.asleep
        assert engine.generate(batch)["output_ids"].shape[0] == 2
    finally:
        engine.prepare_for_generation()
