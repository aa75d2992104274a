"""Megatron policy workers on real Ray actors and gloo process groups, compared with the DTensor worker.

One DTensor reference (1 worker, fp32) gives logprobs, one SGD step's weights, loss and grad norm on fixed data;
the Megatron worker must match it for TP=1 (DP=2), TP=2 and PP=2. Then checkpoints (PP=2, Adam, clipping active)
and the clear errors for unsupported / GPU-only options.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from rlpost.config.errors import ConfigError
from rlpost.config.load import load_master_config
from rlpost.config.schema.loss import ClippedPGLossConfig
from rlpost.config.schema.policy import PolicyConfig, PytorchOptimizerConfig
from rlpost.distributed.batched_data_dict import BatchedDataDict
from rlpost.distributed.ports import free_port
from rlpost.distributed.virtual_cluster import RayVirtualCluster
from rlpost.distributed.worker_groups import WorkerGroupError
from rlpost.losses.clipped_pg import ClippedPGLossFn
from rlpost.models.policy.interfaces import TrainResult
from rlpost.models.policy.lm_policy import Policy
from tests.integration.exported import exported_weights

pytestmark = pytest.mark.slow

B, S = 16, 20
TOL = 1e-4
TEMPERATURE = 0.7
LOSS = ClippedPGLossFn(ClippedPGLossConfig(reference_policy_kl_penalty=0.0))
COMMON = [
    "grpo.num_prompts_per_step=2",
    "policy.train_global_batch_size=16",
    "policy.train_micro_batch_size=4",
    "policy.logprob_batch_size=4",
    f"policy.generation.temperature={TEMPERATURE}",
]
# The same plain SGD step in both backends: no momentum, no weight decay (megatron's scheduler owns it), no clipping
# (so a wrong gradient scale shows up in the weights and in the grad norm).
SGD_LR = 0.5
MEGATRON_SGD = [
    "policy.megatron_cfg.optimizer.optimizer=sgd",
    f"policy.optimizer.kwargs.lr={SGD_LR}",  # the lr path both backends share (the preset feeds megatron_cfg)
    "policy.megatron_cfg.optimizer.sgd_momentum=0.0",
    "policy.megatron_cfg.optimizer.weight_decay=0.0",
    "policy.megatron_cfg.scheduler.start_weight_decay=0.0",
    "policy.megatron_cfg.scheduler.end_weight_decay=0.0",
    "policy.max_grad_norm=null",
]
LAYOUTS = {
    "tp1_dp2": [],
    # the output layer read 5 tokens at a time (rlpost.models.megatron.output_head), its vocabulary sharded and padded
    "tp2": ["policy.megatron_cfg.tensor_model_parallel_size=2", "policy.logprob_chunk_size=5"],
    "pp2": ["policy.megatron_cfg.pipeline_model_parallel_size=2", "policy.logprob_chunk_size=5"],
    # two ranks split each sequence (rlpost.models.megatron.context_parallel)
    "cp2": ["policy.megatron_cfg.context_parallel_size=2", "policy.logprob_chunk_size=5"],
}
PARITY_EXTRA = {"pp2": ["policy.megatron_cfg.activation_checkpointing=true"],
                "cp2": ["policy.megatron_cfg.activation_checkpointing=true"]}
"""The parity test's PP=2 and CP=2 also recompute the layers in backward (rlpost.models.megatron.model
.checkpoint_layers; under CP through the keys' and values' gathers)."""


def policy_cfg(model_dir: Path, workers: int, *overrides: str, megatron: bool = True) -> PolicyConfig:
    backend = ["policy=megatron"] if megatron else []
    _, cfg = load_master_config([*backend, *COMMON, f"cluster.gpus_per_node={workers}", *overrides])
    p = dataclasses.replace(cfg.policy, model_name=str(model_dir))
    p.tokenizer.name = str(model_dir)
    return p


def make_batch(seed: int = 0, vocab: int = 380) -> BatchedDataDict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, S + 1, (B,), generator=g)
    ids = torch.randint(3, vocab, (B, S), generator=g)
    pos = torch.arange(S)[None, :]
    valid = pos < lengths[:, None]
    ids = torch.where(valid, ids, torch.zeros_like(ids))
    return BatchedDataDict(
        input_ids=ids,
        input_lengths=lengths,
        token_mask=(valid & (pos >= 4)).float(),  # the first 4 tokens are the "prompt"
        sample_mask=torch.ones(B),
        advantages=torch.randn(B, 1, generator=g).expand(B, S).clone(),
        generation_logprobs=torch.zeros(B, S),
    )


def valid_positions(data: BatchedDataDict) -> torch.Tensor:
    return torch.arange(S)[None, :] < data["input_lengths"][:, None]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


class Built:
    def __init__(self, cfg: PolicyConfig, workers: int, **kw: Any) -> None:
        self.cluster = RayVirtualCluster(f"mtest-{id(self)}", workers, cpus_per_bundle=0.5)
        self.policy = Policy(self.cluster, cfg, timeout_s=300.0, **kw)

    def close(self) -> None:
        self.policy.shutdown()
        self.cluster.shutdown()


def build(made: list[Built], cfg: PolicyConfig, workers: int, **kw: Any) -> Built:
    b = Built(cfg, workers, **kw)
    made.append(b)
    return b


def close(made: list[Built], b: Built) -> None:
    b.close()
    made.remove(b)


def hf_logprobs(model_dir: Path, data: BatchedDataDict, temperature: float) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(data["input_ids"]).logits.float() / temperature
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, data["input_ids"][:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(B, 1), lp], dim=1)


@pytest.fixture(scope="module")
def dtensor_reference(ray_local: None, tiny_model_dir: Path) -> dict[str, Any]:
    """DTensor worker (1 rank, fp32, SGD): logprobs, then one step on the same data -> loss, grad norm, weights."""
    cfg = policy_cfg(tiny_model_dir, 1, "policy.max_grad_norm=null", megatron=False)
    cfg.optimizer = PytorchOptimizerConfig(name="torch.optim.SGD", kwargs={"lr": SGD_LR})
    b = Built(cfg, 1)
    try:
        data = make_batch(seed=1)
        lp = b.policy.get_logprobs(data)["logprobs"]
        data["prev_logprobs"] = lp
        out = b.policy.train(data, LOSS)
        return {"data": data, "logprobs": lp, "train": out, "weights": exported_weights(b.policy)}
    finally:
        b.close()


@pytest.fixture(scope="module")
def dtensor_topk(ray_local: None, tiny_model_dir: Path) -> dict[str, Any]:
    """A DTensor teacher's top-8 logits (1 rank, no generation settings: untempered), on make_batch(seed=3)."""
    b = Built(dataclasses.replace(policy_cfg(tiny_model_dir, 1, megatron=False), generation=None), 1,
              init_optimizer=False, init_reference_model=False)
    try:
        return dict(b.policy.get_topk_logits(make_batch(seed=3), 8))
    finally:
        b.close()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parity_with_dtensor(
    layout: str, dtensor_reference: dict[str, Any], tiny_model_dir: Path, built: list[Built]
) -> None:
    ref = dtensor_reference
    data = ref["data"]
    b = build(built, policy_cfg(tiny_model_dir, 2, *LAYOUTS[layout], *PARITY_EXTRA.get(layout, []), *MEGATRON_SGD), 2)

    lp = b.policy.get_logprobs(data)["logprobs"]
    lp_err = float((lp - ref["logprobs"]).abs().max())
    assert torch.all(lp[:, 0] == 0)
    assert lp_err <= TOL, f"{layout}: logprobs differ from DTensor by {lp_err:.3g}"

    out = b.policy.train(data, LOSS)  # data carries the DTensor logprobs as prev_logprobs
    w = exported_weights(b.policy)
    print(f"\n[{layout}] logprob max|diff| {lp_err:.3g}")
    assert_same_step(layout, out, w, ref)
    assert out.all_mb_metrics.keys() == ref["train"].all_mb_metrics.keys()
    from safetensors.torch import load_file

    w0 = load_file(str(tiny_model_dir / "model.safetensors"))
    assert max(float((w[k] - w0[k]).abs().max()) for k in w0) > 1e-3  # the step is real

    # the reference policy is still the initial model
    ref_lp = b.policy.get_reference_policy_logprobs(data)["reference_logprobs"]
    assert torch.equal(ref_lp, lp)

    if layout == "tp2":
        check_refit(b.policy, w)
    if layout == "cp2":  # 19 tokens: the sequence is padded to a multiple of 2 x CP, and the padding cut off again
        cut = BatchedDataDict(input_ids=data["input_ids"][:, :19], input_lengths=data["input_lengths"].clamp(max=19))
        lp19 = b.policy.get_reference_policy_logprobs(cut)["reference_logprobs"]
        assert torch.allclose(lp19, lp[:, :19], atol=TOL)


@pytest.mark.parametrize("layout", ["tp1_dp2", "pp2"])
def test_a_batch_trained_in_parts_equals_dtensor_trained_whole(
    layout: str, dtensor_reference: dict[str, Any], tiny_model_dir: Path, built: list[Built]
) -> None:
    # Overlapped synchronous GRPO sends a one-step batch in parts before its global counts are known
    # (rlpost.models.policy.train_parts): two parts of 8 rows, each with both normalisers 1, then one scaled,
    # reduced step. DP=2 reduces the counts and gradients once at the end; PP=2 shares the last stage's metrics and
    # the tied embedding's gradient across stages there. The step must be the DTensor reference's whole-batch step.
    ref = dtensor_reference
    data, dt = ref["data"], ref["train"]
    b = build(built, policy_cfg(tiny_model_dir, 2, *LAYOUTS[layout], *MEGATRON_SGD), 2)
    for a in (0, 8):
        b.policy.train_part(data.slice(a, a + 8), LOSS)
    out = b.policy.finish_parts(LOSS)
    assert_same_step(f"{layout} in parts", out, exported_weights(b.policy), ref)
    assert out.metrics.keys() == dt.metrics.keys()
    for k, v in dt.metrics.items():
        assert out.metrics[k] == pytest.approx(v, rel=TOL, abs=TOL), k


def assert_same_step(label: str, out: TrainResult, w: dict[str, torch.Tensor], ref: dict[str, Any]) -> None:
    """A Megatron training result and its weights equal the DTensor reference's SGD step (to TOL)."""
    dt = ref["train"]
    print(f"\n[{label}] loss {out.loss:.6g} vs {dt.loss:.6g}, grad_norm {out.grad_norm:.6g} vs "
          f"{dt.grad_norm:.6g}, weights max|diff| {max_diff(w, ref['weights']):.3g}")
    assert out.loss == pytest.approx(dt.loss, abs=TOL)
    assert out.grad_norm == pytest.approx(dt.grad_norm, rel=TOL)
    assert out.lr == pytest.approx(SGD_LR)
    assert max_diff(w, ref["weights"]) <= TOL


def check_refit(policy: Policy, weights: dict[str, torch.Tensor]) -> None:
    """Refit exports: HF names, the tied lm_head not apart from the embedding (the engine derives it), bounded
    buckets, fingerprints; object store and collective."""

    import ray

    from rlpost.distributed.collective import StatelessGroup
    from rlpost.distributed.shm_buckets import read_bucket
    from rlpost.models.fingerprint import weight_fingerprint

    info = policy.prepare_refit_info()
    buckets = policy.export_weight_buckets("float32", 64 * 1024)
    got: dict[str, torch.Tensor] = {}
    for box in buckets:  # one node: every rank writes each bucket into its own segment, for the engine beside it
        parts = [read_bucket(d) for d in box["per_rank"]]
        assert len(parts) == policy.worker_group.world_size
        assert all(max_diff(dict(p), dict(parts[0])) == 0.0 for p in parts[1:])
        got.update({k: v.clone() for k, v in parts[0]})
    assert buckets.count > 1  # the bound split the export
    assert set(info) == set(got) == set(weights) - {"lm_head.weight"}
    assert all(info[k] == (tuple(v.shape), v.dtype) for k, v in got.items())
    exported = {k: weights[k] for k in got}
    assert max_diff(got, exported) == 0.0
    assert buckets.fingerprint == weight_fingerprint(got)

    port = free_port("127.0.0.1")
    joins = policy.init_refit_collective_async("127.0.0.1", port, 2)
    with StatelessGroup("127.0.0.1", port, 1, 2, backend="gloo", timeout_s=60) as engine:
        assert ray.get(joins, timeout=60) == [True, True]
        sent = policy.broadcast_weights_collective_async("float32")
        received = dict(engine.broadcast_tensors(None, src=0))
        fingerprints = ray.get(sent, timeout=60)
    assert max_diff(received, exported) == 0.0
    assert fingerprints[0] == weight_fingerprint(received)


def test_checkpoint_resume_and_hf_export(ray_local: None, tiny_model_dir: Path, built: list[Built],
                                          tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    cfg = policy_cfg(tiny_model_dir, 2, *LAYOUTS["pp2"])  # Adam, max_grad_norm 1.0 (clipping is active)
    first, later = make_batch(seed=0), make_batch(seed=11)
    a = build(built, cfg, 2)
    lp_initial = a.policy.get_logprobs(later)["logprobs"]
    first["prev_logprobs"] = a.policy.get_logprobs(first)["logprobs"]
    assert a.policy.train(first, LOSS).grad_norm > 1.0
    a.policy.save_checkpoint(str(tmp_path / "weights"), str(tmp_path / "optim"))
    lp_saved = a.policy.get_logprobs(later)["logprobs"]
    later["prev_logprobs"] = lp_saved
    a.policy.train(later, LOSS)
    w_next = exported_weights(a.policy)
    close(built, a)

    hf_dir = tmp_path / "weights" / "hf"
    assert (hf_dir / "tokenizer.json").is_file()
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir)
    assert hf_model.config.tie_word_embeddings
    valid = valid_positions(later)
    hf_err = float((lp_saved - hf_logprobs(hf_dir, later, TEMPERATURE))[valid].abs().max())
    print(f"\n[checkpoint] HF export vs megatron logprobs max|diff| {hf_err:.3g}")
    assert hf_err <= TOL

    b = build(built, cfg, 2, weights_path=str(tmp_path / "weights"), optimizer_path=str(tmp_path / "optim"))
    assert torch.equal(b.policy.get_logprobs(later)["logprobs"], lp_saved)
    # the reference is the initial HF model, not the checkpoint
    ref = b.policy.get_reference_policy_logprobs(later)["reference_logprobs"]
    assert float((ref - lp_initial).abs().max()) <= 1e-6
    b.policy.train(later, LOSS)
    assert max_diff(w_next, exported_weights(b.policy)) == 0.0


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ("policy.megatron_cfg.optimizer.use_distributed_optimizer=true",
         r"ConfigError: policy\.megatron_cfg\.optimizer\.use_distributed_optimizer=True: the distributed optimizer "
         r"is GPU-only"),
    ],
    ids=["gpu_only_on_cpu"],
)
def test_unsupported_options_fail_clearly(
    override: str, pattern: str, ray_local: None, tiny_model_dir: Path, built: list[Built]
) -> None:
    b = build(built, policy_cfg(tiny_model_dir, 1, override), 1)
    with pytest.raises(WorkerGroupError, match=pattern):
        b.policy.get_logprobs(make_batch())


@pytest.mark.parametrize(
    ("overrides", "device", "key"),
    [
        (["policy.megatron_cfg.tensor_model_parallel_size=2", "policy.megatron_cfg.sequence_parallel=true"], "cpu",
         "policy.megatron_cfg.sequence_parallel"),
        (["policy.precision=bfloat16"], "cpu", "policy.precision"),
        (["policy.megatron_cfg.distributed_data_parallel_config.use_custom_fsdp=true"], "cpu",
         "policy.megatron_cfg.distributed_data_parallel_config.use_custom_fsdp"),
        (["policy.precision=bfloat16", "policy.megatron_cfg.optimizer.bf16=false"], "cuda",
         "policy.megatron_cfg.optimizer.bf16"),
        (["policy.precision=float32", "policy.megatron_cfg.optimizer.fp16=true"], "cuda",
         "policy.megatron_cfg.optimizer.fp16"),
    ],
    ids=["sequence_parallel", "bf16_training", "megatron_fsdp", "bf16_flag",
         "fp16_flag"],
)
def test_config_checks_name_the_key(overrides: list[str], device: str, key: str, tmp_path: Path) -> None:
    """In-process: the worker's up-front checks (no Ray); the errors survive pickling with their key."""
    workers = 2 if any("size=2" in o for o in overrides) else 1
    cfg = policy_cfg(tmp_path, workers, *overrides)
    with pytest.raises((ConfigError, NotImplementedError), match=re.escape(key)) as info:
        _worker_checks(cfg, device)
    assert key in str(pickle.loads(pickle.dumps(info.value)))  # Ray pickles it to the driver
    if key in ("policy.precision", "policy.megatron_cfg.optimizer.bf16", "policy.megatron_cfg.optimizer.fp16"):
        _worker_checks(cfg, device, init_optimizer=False)  # bf16 logprobs alone are fine


def _worker_checks(cfg: PolicyConfig, device: str, init_optimizer: bool = True) -> None:
    """What MegatronPolicyWorker.__init__ checks before it builds anything."""
    cfg.check("policy")
    cfg.check_device("policy", device, init_optimizer)


@pytest.mark.parametrize(
    ("overrides", "device", "dp", "expected"),
    [
        (["policy.precision=bfloat16"], "cuda", 2, (True, False, "bfloat16", True)),
        (["policy.precision=bfloat16"], "cuda", 1, (True, False, "bfloat16", False)),
        (["policy.precision=float16"], "cuda", 4, (False, True, "float16", True)),
        (["policy.precision=float32"], "cpu", 2, (False, False, "float32", False)),
        (["policy.precision=bfloat16", "policy.megatron_cfg.optimizer.use_distributed_optimizer=false",
          "policy.megatron_cfg.optimizer.params_dtype=float32"], "cuda", 2, (True, False, "float32", False)),
    ],
    ids=["cuda_bf16_dp2", "cuda_bf16_dp1", "cuda_fp16_dp4", "cpu_fp32", "user_values_kept"],
)
def test_optimizer_defaults_follow_precision_device_and_dp(overrides: list[str], device: str, dp: int,
                                                           expected: tuple[bool, bool, str, bool],
                                                           tmp_path: Path) -> None:
    """Left null, megatron's mixed-precision flags follow policy.precision and the distributed optimizer is on with
    CUDA and DP > 1 (what the worker builds its optimizer from); a value the user set is kept. Such a config passes
    the worker's device checks."""
    cfg = policy_cfg(tmp_path, dp, *overrides)
    _worker_checks(cfg, device)
    assert cfg.megatron_cfg is not None
    o = cfg.megatron_cfg.optimizer.resolved(cfg.precision, device, dp)
    assert (o.bf16, o.fp16, o.params_dtype, o.use_distributed_optimizer) == expected


def test_cpu_defaults_build_the_same_optimizer(tmp_path: Path) -> None:
    """On CPU the defaults resolve to what megatron-core can run there: fp32, no distributed optimizer."""
    cfg = policy_cfg(tmp_path, 2, "cluster.device=cpu")
    assert cfg.precision == "float32" and cfg.megatron_cfg is not None
    o = cfg.megatron_cfg.optimizer.resolved(cfg.precision, "cpu", 2)
    assert (o.bf16, o.fp16, o.params_dtype, o.use_distributed_optimizer) == (False, False, "float32", False)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("policy.dynamic_batching.enabled=true", "policy.dynamic_batching.enabled"),
        ("policy.sequence_packing.enabled=true", "policy.sequence_packing.enabled"),
    ],
    ids=["dynamic_batching", "packing"],
)
def test_what_the_worker_cannot_run_fails_validation(override: str, key: str, tmp_path: Path) -> None:
    """Device-independent limits of the Megatron worker are config errors (exit 2, `rlpost plan` shows them)."""
    with pytest.raises(ConfigError, match=re.escape(key)):
        policy_cfg(tmp_path, 1, override)


def test_checkpoint_layout_mismatch_is_clear(tmp_path: Path) -> None:
    """In-process: a checkpoint restores only into its own TP x PP layout, and says so."""
    from types import SimpleNamespace

    from rlpost.models.policy import megatron_checkpoint as mc

    saved = SimpleNamespace(cfg=policy_cfg(tmp_path, 2, *LAYOUTS["pp2"]), dp_size=1)
    (tmp_path / mc.LAYOUT_FILE).write_text(json.dumps(mc._layout(saved)))
    mc._check_layout(saved, tmp_path)  # type: ignore[arg-type]
    other = SimpleNamespace(cfg=policy_cfg(tmp_path, 2, *LAYOUTS["tp2"]), dp_size=1)
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size: saved 2, now 1.*same layout"):
        mc._check_layout(other, tmp_path)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", ["tp1_dp2", "pp2"])
def test_teacher_topk_equals_dtensor_and_the_critic_learns(layout: str, dtensor_topk: dict[str, Any],
                                                           tiny_model_dir: Path, built: list[Built]) -> None:
    """A distillation teacher on Megatron scores as the DTensor one does; a Megatron critic (value head in place of
    the output layer) gives [B, S] values and fits fixed returns."""
    from rlpost.algorithms.side_groups import with_lr
    from rlpost.losses.value import ClippedValueLossFn

    data, ref = make_batch(seed=3), dtensor_topk
    mg_cfg = dataclasses.replace(policy_cfg(tiny_model_dir, 2, *LAYOUTS[layout]), generation=None)
    mg = build(built, mg_cfg, 2, init_optimizer=False, init_reference_model=False)
    got = mg.policy.get_topk_logits(data, 8)
    close(built, mg)
    valid = valid_positions(data)
    assert got["teacher_topk_logprobs"].shape == (B, S, 8)
    assert torch.equal(got["teacher_topk_indices"][valid], ref["teacher_topk_indices"][valid])
    assert float((got["teacher_topk_logprobs"] - ref["teacher_topk_logprobs"])[valid].abs().max()) <= TOL

    critic = build(built, with_lr(dataclasses.replace(mg_cfg, value_head=True), 1e-3), 2, init_reference_model=False)
    values = critic.policy.get_values(data)["values"]
    assert values.shape == (B, S) and torch.all(values[:, 0] == 0)
    data["values"] = values
    data["returns"] = torch.rand(B, generator=torch.Generator().manual_seed(4))[:, None].expand(B, S).clone()
    losses = [critic.policy.train(data, ClippedValueLossFn(None)).loss for _ in range(10)]
    assert losses[-1] < 0.5 * losses[0], losses


def test_a_bf16_critic_scores_in_the_models_dtype(ray_local: None, tiny_model_dir: Path, built: list[Built]) -> None:
    """A bf16 Megatron critic (Float16Module): the value head takes the model's dtype, so it reads the bf16 hidden
    states, and its values are the fp32 critic's within bf16's precision (the same seed builds the same head)."""
    data = make_batch(seed=5)
    values = {}
    for precision in ("float32", "bfloat16"):
        cfg = dataclasses.replace(policy_cfg(tiny_model_dir, 1, f"policy.precision={precision}"), generation=None,
                                  value_head=True)
        b = build(built, cfg, 1, init_optimizer=False, init_reference_model=False)  # bf16 training is GPU-only
        values[precision] = b.policy.get_values(data)["values"]
        close(built, b)
    valid = valid_positions(data)
    assert values["bfloat16"].dtype == torch.float32 and values["bfloat16"].shape == (B, S)
    assert torch.isfinite(values["bfloat16"]).all()
    scale = float(values["float32"][valid].abs().max())
    assert float((values["bfloat16"] - values["float32"])[valid].abs().max()) <= 0.05 * scale + 1e-3
