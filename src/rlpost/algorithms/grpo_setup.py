"""GRPO `setup`: builds, in order, seeds, the checkpoint manager (and resume state), the cluster(s), the engine (not
waited for), the logger, the resumable dataloader, the environments, the loss, the policy and the refit info."""

from __future__ import annotations

import dataclasses
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from omegaconf import OmegaConf

from rlpost.algorithms.checkpoint_io import restore_loader_and_rng, resume_info, saved_metrics_row
from rlpost.algorithms.units import RolloutUnit, Side, SideGroup, run_side_groups, unit_of
from rlpost.config.layout import Layout, layout_of
from rlpost.config.lora_params import adapter_config
from rlpost.config.schema.grpo import GRPOSaveState
from rlpost.config.schema.loss import ClippedPGLossConfig, LossConfig
from rlpost.config.schema.master import MasterConfig
from rlpost.data.dataloader import PromptLoader
from rlpost.data.datasets import DataError
from rlpost.data.prompts import PromptProcessor, load_prompt_rows, load_tokenizer, prompt_room
from rlpost.data.rows import PromptRow
from rlpost.distributed import placement
from rlpost.distributed.start_gate import StartGate
from rlpost.distributed.virtual_cluster import RayVirtualCluster, init_ray, resolve_device
from rlpost.distributed.worker_groups import WorkerGroupError
from rlpost.environments.interfaces import EnvironmentInterface
from rlpost.losses.interface import LossFunction
from rlpost.models.generation.interfaces import GenerationInterface
from rlpost.models.policy.interfaces import ColocatablePolicyInterface
from rlpost.runtime import console as say
from rlpost.runtime.build import build
from rlpost.runtime.checkpointing import (
    CheckpointError,
    CheckpointManager,
    model_fingerprint,
)
from rlpost.runtime.metrics_logger import MetricsLogger

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlpost.models.policy.lm_policy import Policy


@dataclass
class GRPOComponents:
    """Everything `grpo_train` runs on (NeMo RL's setup tuple, as one object)."""

    cfg: MasterConfig
    run_dir: Path
    policy: ColocatablePolicyInterface
    generation: GenerationInterface
    clusters: list[RayVirtualCluster]
    dataloader: PromptLoader[PromptRow]
    val_rows: list[PromptRow]
    loss_fn: LossFunction
    logger: MetricsLogger
    checkpointer: CheckpointManager
    save_state: GRPOSaveState
    tokenizer: PreTrainedTokenizerBase
    processor: PromptProcessor
    envs: dict[str, EnvironmentInterface]
    model_fp: str
    config_dict: dict[str, object]
    unit: RolloutUnit = field(default_factory=RolloutUnit)
    """The algorithm's code (rlpost.algorithms.units): its advantages, side groups and loop."""
    sides: list[Side] = field(default_factory=list)
    """Worker groups beside the policy (PPO's critic, a distillation teacher), in the order they were built."""
    colocated: bool = True
    overlap: bool = False
    """Synchronous steps overlap generation and training (rlpost.algorithms.overlap): where `Layout.overlap_chunk`
    applies (the engine on its own workers)."""
    started_at: float = field(default_factory=time.monotonic)
    """time.monotonic() when setup began: checkpointing.checkpoint_must_save_by counts from here."""
    closed: bool = False

    def close(self, graceful: bool = True) -> None:
        """Release engines, workers, clusters, verifier processes and the logger (idempotent); `graceful=False`
        (a failed or abandoned run) kills the workers without asking them first."""
        if not self.closed:
            self.closed = True
            close_all([lambda: self.generation.shutdown(graceful), lambda: self.policy.shutdown(graceful),
                       *[(lambda g=s.group: g.shutdown(graceful)) for s in self.sides],
                       *[c.shutdown for c in self.clusters], *[e.shutdown for e in self.envs.values()],
                       self.logger.close])

    def side(self, name: str) -> Policy:
        """The side group called `name` (KeyError when the run has none)."""
        for s in self.sides:
            if s.spec.name == name:
                return s.group
        raise KeyError(f"this run has no {name} worker group")


def close_all(closers: list[Callable[[], object]]) -> None:
    """Call every closer in order; one that raises does not stop the rest."""
    for closer in closers:
        try:
            closer()
        except Exception:  # noqa: BLE001 - keep closing the rest
            pass


def set_seed(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _prepare_model(cfg: MasterConfig) -> None:
    if cfg.model.tiny is not None:
        from rlpost.models.tiny import ensure_tiny_model

        ensure_tiny_model(cfg.model.tiny, cfg.model.path)


TOO_LONG_ACTION = {"truncate": "each is cut to it and masked out of the loss", "drop": "they are left out"}
"""What the warning about over-length prompts says data.too_long does with them."""


def load_prompts(cfg: MasterConfig, processor: PromptProcessor,
                 batch: int) -> tuple[list[PromptRow], list[PromptRow]]:
    """Training and validation rows, with the prompts over data.max_input_seq_length tokens handled as data.too_long
    says (one warning counts them); DataError when fewer rows than one step's `batch` are left."""
    d, g = cfg.data, cfg.grpo
    train, over = load_prompt_rows(d, processor, "train")
    val, val_over = load_prompt_rows(d, processor, "val") if (g.val_period > 0 or g.val_at_start) else ([], 0)
    if over or val_over:
        say.warn(f"{over} training and {val_over} validation prompts are longer than data.max_input_seq_length="
                 f"{d.max_input_seq_length} tokens; {TOO_LONG_ACTION[d.too_long]} (data.too_long={d.too_long})")
    if d.too_long == "drop" and len(train) < batch:
        raise DataError(f"one GRPO step takes {batch} prompts but only {len(train)} training rows are left after "
                        f"data.too_long=drop left out {over}; lower grpo.num_prompts_per_step, raise "
                        "data.max_input_seq_length or use more rows")
    return train, val


def setup(cfg: MasterConfig, run_dir: Path) -> GRPOComponents:
    """Build every component of a GRPO run (resuming from the latest checkpoint if one exists). The engines start
    first, as soon as Ray is up: their start is the longest part of a run's, and the driver's own work (logger,
    tokenizer, prompts, environments) happens beside it. The pre-flight checked the data, so nothing after the
    engines' start is a config or data error the user could have been told earlier."""
    started_at = time.monotonic()
    set_seed(cfg.grpo.seed)
    _prepare_model(cfg)
    config_dict = cast(dict[str, object], OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))
    checkpointer = CheckpointManager(cfg.checkpointing, run_dir)
    model_fp = model_fingerprint(cfg.policy.model_name)
    last = checkpointer.latest_verified()
    save_state = GRPOSaveState()
    if last is not None:
        save_state = GRPOSaveState.from_dict(resume_info(checkpointer, last, model_fp, config_dict))
    unit, side_specs = unit_of(cfg), run_side_groups(cfg)
    tokenizer = None
    if side_specs:  # their checks read the tokenizer: before Ray starts
        tokenizer = load_tokenizer(cfg.policy.tokenizer, cfg.policy.trust_remote_code)
        for spec in side_specs:
            spec.before_start(tokenizer)

    init_ray(cfg.cluster)
    device = resolve_device(cfg.cluster)
    colocated = cfg.generation.colocated.enabled
    lay = layout_of(cfg)
    clusters, train_cluster, gen_cluster, side_clusters = _clusters(cfg, lay, side_specs, device == "cuda")
    gen_cfg = cfg.generation
    if gen_cfg.model_name is None:
        gen_cfg.model_name = cfg.policy.model_name
    opened: list[Callable[[], object]] = [c.shutdown for c in clusters]
    try:
        # The engines first, asleep, then the worker groups on their devices (rlpost.distributed.start_gate): the
        # groups' processes start and import beside the engines, and build their models once the engines sleep.
        generation = _engines(cfg, gen_cluster)
        opened.insert(0, lambda: generation.shutdown(graceful=False))
        logger = MetricsLogger(cfg.logger, run_dir)
        opened.append(logger.close)
        logger.log_hyperparams(OmegaConf.to_yaml(OmegaConf.structured(cfg), resolve=True))
        logger.truncate_after(save_state.total_steps)  # rows the interrupted run logged after its checkpoint
        if last is not None:  # killed between the checkpoint and its metrics line: put the line back
            logger.restore_row(save_state.total_steps, saved_metrics_row(last))
        tokenizer = tokenizer or load_tokenizer(cfg.policy.tokenizer, cfg.policy.trust_remote_code)
        processor = PromptProcessor(cfg.data, tokenizer, cfg.policy.tokenizer.chat_template_kwargs,
                                    room=prompt_room(cfg))
        g = cfg.grpo
        batch = int(g.num_prompts_per_step * (g.batch_multiplier if g.use_dynamic_sampling else 1))
        train_rows, val_rows = load_prompts(cfg, processor, batch)
        dataloader = PromptLoader(train_rows, batch, cfg.data.shuffle, cfg.data.seed)
        if last is not None:
            restore_loader_and_rng(last, dataloader)
        envs = {name: build(env_cfg, key=f"env.{name}._target_") for name, env_cfg in cfg.env.items()}
        opened += [e.shutdown for e in envs.values()]
        weights = optim = None
        if last is not None:
            weights, optim = str(last / "policy" / "weights"), str(last / "policy" / "optimizer")
        loss_fn: LossFunction = build(_loss_config(cfg), key="loss_fn._target_")
        try:  # the workers load the checkpoint in their constructor; a failure shows on the first call
            gate = StartGate(generation.sleep_once_started(), cfg.cluster.call_timeout_s)
            policy = _policy(cfg, train_cluster, weights, optim, loss_fn, device, gate, unit.reference_needed(cfg))
            opened.insert(1, lambda: policy.shutdown(graceful=False))  # closed after the engines
            sides: list[Side] = []
            for spec, own in zip(side_specs, side_clusters, strict=True):
                sides.append(Side(spec, spec.build(own or train_cluster, last, device, gate)))
                opened.insert(2, partial(sides[-1].group.shutdown, graceful=False))
            generation.wait_started()
            if (placed := placement.summary()) is not None:
                say.info(f"placement: {placed}")
            if not colocated:
                from rlpost.algorithms.refit import init_refit_collective

                host, port = train_cluster.get_master_address_and_port()
                init_refit_collective(policy, generation, host, port)
            generation.prepare_refit_info(policy.prepare_refit_info(generation_dtype(cfg)))
        except WorkerGroupError as exc:
            why = _checkpoint_load_failure(exc) if last is not None else None
            if why is not None:
                raise CheckpointError(f"cannot load checkpoint {last}: {why}") from exc
            raise
    except BaseException:
        close_all(opened)
        raise
    return GRPOComponents(
        cfg=cfg, run_dir=run_dir, policy=policy, generation=generation, clusters=clusters, dataloader=dataloader,
        val_rows=val_rows, loss_fn=loss_fn, logger=logger, checkpointer=checkpointer, save_state=save_state,
        tokenizer=tokenizer, processor=processor, envs=envs, model_fp=model_fp, config_dict=config_dict,
        colocated=colocated, started_at=started_at, unit=unit, sides=sides,
        overlap=bool(lay.overlap_chunk),
    )


def _clusters(cfg: MasterConfig, lay: Layout, side_specs: list[SideGroup], use_gpus: bool) -> tuple[
        list[RayVirtualCluster], RayVirtualCluster, RayVirtualCluster, list[RayVirtualCluster | None]]:
    """(every cluster, the policy's, the engines', each side group's own or None) on the layout `lay`: one shared
    cluster when the engines are colocated, else one for training and one for generation."""
    cpus, timeout = cfg.cluster.worker_num_cpus, cfg.cluster.placement_timeout_s
    shared = 1 + sum(s.colocated for s in side_specs)  # a colocated side group is one more on these bundles
    if cfg.generation.colocated.enabled:
        train_cluster = RayVirtualCluster("grpo_policy_cluster", lay.train_workers_per_node, lay.train_nodes,
                                          use_gpus, cpus * (shared + 1), shared + 1, timeout)
        gen_cluster, clusters = train_cluster, [train_cluster]
    else:
        train_cluster = RayVirtualCluster("grpo_train_cluster", lay.train_workers_per_node, lay.train_nodes,
                                          use_gpus, cpus * shared, shared, timeout)
        gen_cluster = RayVirtualCluster("grpo_inference_cluster", lay.gen_workers_per_node, lay.gen_nodes,
                                        use_gpus, cpus, 1, timeout)
        clusters = [train_cluster, gen_cluster]
    side_clusters = [spec.cluster(train_cluster) for spec in side_specs]
    return [*clusters, *[c for c in side_clusters if c is not None]], train_cluster, gen_cluster, side_clusters


def _engines(cfg: MasterConfig, cluster: RayVirtualCluster) -> GenerationInterface:
    """The rollout engine built from `policy.generation._target_` (not waited for); with LoRA served as an adapter
    (`lora_cfg.refit=adapter`) it is told the adapter's config."""
    key, lora = cfg.policy.lora_settings("policy")
    served = {"lora_adapter": adapter_config(key, lora, cfg.policy.model_name)} \
        if lora.enabled and lora.refit == "adapter" else {}
    return cast(GenerationInterface, build(
        cfg.generation, cluster, model_path=cfg.policy.model_name, timeout_s=cfg.cluster.call_timeout_s,
        key="policy.generation._target_", hf_overrides=dict(cfg.policy.hf_config_overrides), **served))


def _policy(cfg: MasterConfig, cluster: RayVirtualCluster, weights: str | None, optim: str | None,
            loss_fn: LossFunction, device: str, gate: StartGate, reference: bool) -> ColocatablePolicyInterface:
    """The policy's workers (not waited for), loading the checkpoint at `weights` / `optim` when resuming; each
    builds its model once `gate` is ready. The reference model is kept when the loss reads it or `reference`."""
    from rlpost.models.policy.lm_policy import Policy

    return Policy(cluster, cfg.policy, weights_path=weights, optimizer_path=optim,
                  init_reference_model=loss_fn.needs_reference_logprobs or reference, device=device,
                  timeout_s=cfg.cluster.call_timeout_s, start_after=gate)


def _checkpoint_load_failure(exc: BaseException) -> str | None:
    """When a worker error (or the Ray error it was raised from) carries a remote traceback through a
    policy backend's checkpoint `load` (DCP, safetensors, torch.load): its final 'Type: message' line."""
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 8:
        text = str(e)
        if re.search(r'_checkpoint\.py", line \d+, in load', text):
            last = [ln.strip() for ln in text.splitlines() if ln.strip()][-1]
            first_sentence = re.match(r"(.{40,}?[.!])\s", last)
            return (first_sentence.group(1) if first_sentence else last)[:300]
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def _loss_config(cfg: MasterConfig) -> LossConfig:
    """The loss config, with force_on_policy_ratio on when the batch is one optimizer step (exact, skips a pass)."""
    from rlpost.config.layout import prev_logprobs_pass

    if prev_logprobs_pass(cfg) in ("on-policy", "one-step async"):
        assert isinstance(cfg.loss_fn, ClippedPGLossConfig)  # only a ratio loss has an on-policy pass
        return dataclasses.replace(cfg.loss_fn, force_on_policy_ratio=True)
    return cfg.loss_fn


def generation_dtype(cfg: MasterConfig) -> str:
    """The dtype weights are cast to for the engine."""
    return cfg.generation.weight_dtype()
