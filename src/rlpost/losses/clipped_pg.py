"""Policy losses: `ClippedPGLossFn` (GRPO/PPO/GSPO/REINFORCE) and `NLLLoss` (SFT), NeMo RL v0.4 semantics.

Every per-token tensor is shifted by one (logits[:, :-1] predict input_ids[:, 1:]) and masked by
m = token_mask * sample_mask. Losses and metrics are normalised by the GLOBAL counts the worker passes in
(valid tokens Gt or sequences Gs of the whole global batch, all data-parallel ranks), so the global value is
the SUM over micro-batches and ranks. `ClippedPGLossFn.__call__` computes, in numbered steps: the KL penalty
to the reference (k1/k2/k3, clamped), the ratio and its clipped version (per token, or per sequence for GSPO),
the pessimistic surrogate with optional dual clip, the train/inference importance weights (optionally
truncated), then loss = reduce(w * surrogate) + KL. tests/unit/losses/test_loss_functions.py holds the
formulas term by term and checks them against NeMo RL's to 1e-7.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, TypeAlias, TypeVar

import torch
import torch.distributed as dist

from rlpost.config.errors import ConfigError
from rlpost.config.schema.loss import ClippedPGLossConfig, LossConfig, NLLLossConfig
from rlpost.losses.interface import LossType
from rlpost.losses.teacher_kl import teacher_kl
from rlpost.ops.chunked_head import HeadLogits
from rlpost.ops.logprobs import next_token_logprobs, vocab_max_and_logsumexp

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from rlpost.distributed.batched_data_dict import BatchedDataDict

_EPS = 1e-8
_CfgT = TypeVar("_CfgT", bound=LossConfig)

LossConfigLike: TypeAlias = "LossConfig | Mapping[str, object] | DictConfig"
"""What a loss is built from: its config dataclass, or a mapping / DictConfig of the same fields."""


def masked_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    dim: int | None = None,
    global_normalization_factor: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """sum(values * mask, dim) / (N + 1e-8), N = global_normalization_factor or sum(mask, dim)."""
    num = (values * mask).sum() if dim is None else (values * mask).sum(dim=dim)
    den: torch.Tensor | float
    if global_normalization_factor is None:
        den = mask.sum() if dim is None else mask.sum(dim=dim)
    else:
        den = global_normalization_factor
    return num / (den + _EPS)


def calculate_kl(
    logprobs: torch.Tensor,
    logprobs_reference: torch.Tensor,
    kl_type: str = "k3",
    input_clamp_value: float | None = 20.0,
    output_clamp_value: float | None = 10.0,
    importance_sampling_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from samples of pi (Schulman 2020), elementwise.

    logr = clamp(logprobs_reference - logprobs, +-input_clamp); k1 = -logr; k2 = logr^2 / 2;
    k3 = exp(logr) - 1 - logr; times importance_sampling_weights if given; clamp(+-output_clamp).
    """
    logr = logprobs_reference - logprobs
    if input_clamp_value is not None:
        logr = logr.clamp(-input_clamp_value, input_clamp_value)
    if kl_type == "k1":
        kl = -logr
    elif kl_type == "k2":
        kl = 0.5 * logr.square()
    elif kl_type == "k3":
        kl = torch.exp(logr) - 1.0 - logr
    else:
        raise ValueError(f"unknown kl_type {kl_type!r} (expected k1, k2 or k3)")
    if importance_sampling_weights is not None:
        kl = kl * importance_sampling_weights
    if output_clamp_value is not None:
        kl = kl.clamp(-output_clamp_value, output_clamp_value)
    return kl


def _coerce_config(cfg: object, cls: type[_CfgT]) -> _CfgT:
    """Accept the dataclass itself, a Mapping or an OmegaConf DictConfig; reject unknown keys."""
    if isinstance(cfg, cls):
        return cfg
    if isinstance(cfg, LossConfig):
        cfg = dataclasses.asdict(cfg)
    elif not isinstance(cfg, Mapping):
        try:
            from omegaconf import DictConfig, OmegaConf
        except ImportError:  # pragma: no cover - omegaconf is a dependency
            DictConfig = None  # type: ignore[assignment,misc]
        if DictConfig is None or not isinstance(cfg, DictConfig):
            raise ConfigError("loss_fn", cfg, f"must be a {cls.__name__}, a mapping or a DictConfig")
        cfg = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(cfg, Mapping)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(cfg) - fields)
    if unknown:
        raise ConfigError(f"loss_fn.{unknown[0]}", cfg[unknown[0]], f"unknown key for {cls.__name__}")
    return cls(**{str(k): v for k, v in cfg.items()})


def _slice_inputs(
    next_token_logits: torch.Tensor | HeadLogits,
    data: BatchedDataDict,
    vocab_parallel_group: dist.ProcessGroup | None,
    vocab_parallel_rank: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (lp [B, S-1], token_mask [B, S-1], sample_mask [B], mask [B, S-1]), all in lp's dtype (fp32/fp64)."""
    ids = data["input_ids"]  # [B, S]
    lp = next_token_logprobs(next_token_logits, ids, vocab_parallel_group, vocab_parallel_rank)[:, 1:]  # [B, S-1]
    token_mask = data["token_mask"][:, 1:].to(lp.dtype)  # [B, S-1]
    sample_mask = data["sample_mask"].to(lp.dtype)  # [B]
    mask = token_mask * sample_mask.unsqueeze(-1)  # [B, S-1]
    return lp, token_mask, sample_mask, mask


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


class ClippedPGLossFn:
    """Clipped policy-gradient loss with optional KL penalty, dual clip, IS correction, GSPO, REINFORCE.

    Built from a ClippedPGLossConfig (or an equivalent mapping /
    DictConfig); invalid option combinations raise ConfigError here, at build time.
    """

    config_class: type[ClippedPGLossConfig] = ClippedPGLossConfig
    """The config it is built from (a subclass's own subclass of it)."""

    def __init__(self, cfg: LossConfigLike) -> None:
        self.cfg: ClippedPGLossConfig = _coerce_config(cfg, self.config_class)
        self.cfg.check("loss_fn")
        c = self.cfg
        self.reference_policy_kl_penalty = float(c.reference_policy_kl_penalty)
        self.reference_policy_kl_type = c.reference_policy_kl_type
        self.kl_input_clamp_value = c.kl_input_clamp_value
        self.kl_output_clamp_value = c.kl_output_clamp_value
        self.ratio_clip_min = float(c.ratio_clip_min)
        self.ratio_clip_max = float(c.ratio_clip_max)
        self.ratio_clip_c = None if c.ratio_clip_c is None else float(c.ratio_clip_c)
        self.use_on_policy_kl_approximation = bool(c.use_on_policy_kl_approximation)
        self.use_importance_sampling_correction = bool(c.use_importance_sampling_correction)
        self.truncated_importance_sampling_ratio = c.truncated_importance_sampling_ratio
        self.sequence_level_importance_ratios = bool(c.sequence_level_importance_ratios)
        self.disable_ppo_ratio = bool(c.disable_ppo_ratio)
        self.force_on_policy_ratio = bool(c.force_on_policy_ratio)
        self.loss_type = LossType.TOKEN_LEVEL if c.token_level_loss else LossType.SEQUENCE_LEVEL
        self.distillation_kl_coef = float(c.distillation_kl_coef)

    @property
    def needs_prev_logprobs(self) -> bool:
        """False when lp_old is the training pass's own detached logprobs (force_on_policy_ratio)."""
        return not self.force_on_policy_ratio

    @property
    def needs_reference_logprobs(self) -> bool:
        """True when the KL penalty needs the reference model's logprobs."""
        return self.reference_policy_kl_penalty != 0.0

    chunked_logits = True
    """The logits are read through logprobs only, the teacher's top-k KL included: HeadLogits will do."""

    TOKEN_MEAN_METRICS = frozenset({"probs_ratio", "probs_ratio_clamped", "token_mult_prob_error", "gen_kl_error",
                                    "policy_kl_error", "js_divergence_error", "sampling_importance_ratio",
                                    "approx_entropy", "kl_to_teacher", "teacher_topk_mass", "student_topk_mass"})
    """Metrics that are token means over the global batch (divided by global_valid_toks) whatever the loss type."""

    def accumulated_scales(self, global_valid_seqs: float, global_valid_toks: float) -> tuple[float, dict[str, float]]:
        """For a batch trained in parts before its global counts were known (rlpost.algorithms.overlap): each part
        ran with both normalisers 1, so its loss and metrics are sums. Returns what turns them into this loss's
        global means: the factor for the loss (and its gradients) and for each metric (absent: unchanged)."""
        loss_scale = 1.0 / ((global_valid_toks if self.loss_type == LossType.TOKEN_LEVEL else global_valid_seqs) + _EPS)
        token_scale = 1.0 / (global_valid_toks + _EPS)
        return loss_scale, {"loss": loss_scale, "kl_penalty": loss_scale,
                            **{k: token_scale for k in self.TOKEN_MEAN_METRICS}}

    def _reduce(
        self,
        x: torch.Tensor,  # [B, S-1]
        mask: torch.Tensor,  # [B, S-1]
        token_mask: torch.Tensor,  # [B, S-1]
        sample_mask: torch.Tensor,  # [B]
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> torch.Tensor:
        if self.loss_type == LossType.TOKEN_LEVEL:
            return masked_mean(x, mask, global_normalization_factor=global_valid_toks)
        per_seq = masked_mean(x, token_mask, dim=-1)  # [B]
        return masked_mean(per_seq, sample_mask, global_normalization_factor=global_valid_seqs)

    def surrogate(self, lp: torch.Tensor, lp_old: torch.Tensor, adv: torch.Tensor,
                  token_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-token policy loss [B, S-1] from the logprobs, the pre-update ones and the advantages, with the ratio
        and its clipped version (for the metrics): the ratio (per sequence for GSPO) clipped to
        [1 - ratio_clip_min, 1 + ratio_clip_max], the pessimistic max(-A r, -A clip(r)), the dual clip; REINFORCE
        (disable_ppo_ratio): -A lp."""
        if not self.disable_ppo_ratio:
            log_ratio = lp - lp_old  # [B, S-1]
            if self.sequence_level_importance_ratios:
                seq_log_ratio = masked_mean(log_ratio, token_mask, dim=-1)  # [B]
                ratios = torch.exp(seq_log_ratio).unsqueeze(-1).expand_as(log_ratio)  # [B, S-1]
            else:
                ratios = torch.exp(log_ratio)
            ratios_clamped = ratios.clamp(1.0 - self.ratio_clip_min, 1.0 + self.ratio_clip_max)
        else:
            ratios = lp
            ratios_clamped = lp
        clip_loss = torch.max(-adv * ratios, -adv * ratios_clamped)  # [B, S-1]
        if self.ratio_clip_c is not None:
            clip_loss = torch.where(adv < 0, torch.min(clip_loss, -adv * self.ratio_clip_c), clip_loss)
        return clip_loss, ratios, ratios_clamped

    def __call__(
        self,
        next_token_logits: torch.Tensor | HeadLogits,
        data: BatchedDataDict,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        vocab_parallel_rank: int | None = None,
        vocab_parallel_group: dist.ProcessGroup | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        lp, token_mask, sample_mask, mask = _slice_inputs(
            next_token_logits, data, vocab_parallel_group, vocab_parallel_rank
        )
        adv = data["advantages"][:, 1:].to(lp.dtype)  # [B, S-1]
        if self.force_on_policy_ratio:  # the weights that generated lp_old are the ones computing lp
            lp_old = lp.detach()  # [B, S-1]
        else:
            lp_old = data["prev_logprobs"][:, 1:].to(lp.dtype)  # [B, S-1]
        lp_gen = data["generation_logprobs"][:, 1:].to(lp.dtype)  # [B, S-1]
        gvt = global_valid_toks

        with torch.no_grad():
            diag = _diagnostics(lp_old, lp_gen, mask, gvt)

        # 1. KL penalty to the reference policy: the estimator times the (detached) on-policy weights, then the
        #    output clamp, in that order (NeMo RL HEAD's order with v0.4's detached weights).
        beta = self.reference_policy_kl_penalty
        if beta != 0:
            lp_ref = data["reference_policy_logprobs"][:, 1:].to(lp.dtype)  # [B, S-1]
            if self.use_on_policy_kl_approximation:
                w_kl = _finite(torch.exp(lp - lp_gen).detach())  # [B, S-1]
            else:
                w_kl = None
            kl_t = beta * calculate_kl(
                lp,
                lp_ref,
                self.reference_policy_kl_type,
                self.kl_input_clamp_value,
                self.kl_output_clamp_value,
                importance_sampling_weights=w_kl,
            )  # [B, S-1]
            kl = self._reduce(kl_t, mask, token_mask, sample_mask, global_valid_seqs, gvt)
        else:
            kl = torch.zeros((), dtype=lp.dtype, device=lp.device)

        # 2-3. The surrogate: the ratio, clipped, in the pessimistic surrogate (a subclass's own, e.g. CISPO's).
        clip_loss, ratios, ratios_clamped = self.surrogate(lp, lp_old, adv, token_mask)

        # 4. Importance-sampling weights between the training and the inference engine.
        if self.sequence_level_importance_ratios:
            seq_diff = ((lp_old - lp_gen) * mask).sum(dim=-1)  # [B]
            is_w = _finite(torch.exp(seq_diff)).unsqueeze(-1).expand_as(lp_old)  # [B, S-1]
        else:
            is_w = _finite(torch.exp(lp_old - lp_gen))  # [B, S-1]
        if self.truncated_importance_sampling_ratio is not None:
            is_w = is_w.clamp(max=float(self.truncated_importance_sampling_ratio))
        weights = is_w if self.use_importance_sampling_correction else torch.ones_like(lp_old)

        # 5. Actor loss + KL (+ the KL to a distillation teacher, a token mean).
        actor_loss = self._reduce(weights * clip_loss, mask, token_mask, sample_mask, global_valid_seqs, gvt)
        loss = actor_loss + kl
        teacher: dict[str, float] = {}
        if self.distillation_kl_coef:
            to_teacher, teacher = teacher_kl(next_token_logits, data, mask, gvt)
            loss = loss + self.distillation_kl_coef * to_teacher

        with torch.no_grad():
            metrics: dict[str, float] = {
                "loss": float(loss.item()),
                "probs_ratio": float(masked_mean(ratios.detach(), mask, global_normalization_factor=gvt).item()),
                "probs_ratio_clamped": float(
                    masked_mean(ratios_clamped.detach(), mask, global_normalization_factor=gvt).item()
                ),
                "kl_penalty": float(kl.item()) / beta if beta != 0 else 0.0,
                **diag,
                "sampling_importance_ratio": float(masked_mean(is_w, mask, global_normalization_factor=gvt).item()),
                **teacher,
                "num_valid_samples": float(sample_mask.sum().item()),
                "approx_entropy": float(
                    -masked_mean(
                        torch.exp(lp.detach() - lp_gen) * lp.detach(), mask, global_normalization_factor=gvt
                    ).item()
                ),
            }
        return loss, metrics


def _diagnostics(lp_old: torch.Tensor, lp_gen: torch.Tensor, mask: torch.Tensor, gvt: torch.Tensor) -> dict[str, float]:
    """Train/inference mismatch metrics: the trainer's prev logprobs vs the engine's (token means, global Gt).

    The KLs use k3 whatever the configured estimator, and are token means even for a sequence-level loss (v0.4).
    """

    def tmean(x: torch.Tensor) -> float:
        return float(masked_mean(x, mask, global_normalization_factor=gvt).item())

    def k3(logr: torch.Tensor) -> torch.Tensor:
        return torch.exp(logr) - logr - 1.0

    log_mix = torch.log(0.5 * torch.exp(lp_old) + 0.5 * torch.exp(lp_gen))  # [B, S-1]
    js = 0.5 * k3(lp_old - log_mix) + 0.5 * k3(lp_gen - log_mix)
    return {
        "token_mult_prob_error": tmean(torch.exp(torch.abs(lp_gen - lp_old) * mask)),
        "gen_kl_error": tmean(k3(lp_old - lp_gen)),
        "policy_kl_error": tmean(k3(lp_gen - lp_old)),
        "js_divergence_error": tmean(js),
    }


class NLLLoss:
    """Token-level negative log-likelihood (SFT): loss = -sum(lp * m) / (Gt + 1e-8).

    Metrics: loss, num_unmasked_tokens (sum of m in this micro-batch), num_valid_samples (sum of sample_mask);
    all sum over micro-batches to the global value.
    """

    loss_type = LossType.TOKEN_LEVEL
    needs_prev_logprobs = False
    needs_reference_logprobs = False
    chunked_logits = True

    def __init__(self, cfg: LossConfigLike | None = None) -> None:
        self.cfg: NLLLossConfig = NLLLossConfig() if cfg is None else _coerce_config(cfg, NLLLossConfig)
        self.cfg.check("loss_fn")

    def __call__(
        self,
        next_token_logits: torch.Tensor | HeadLogits,
        data: BatchedDataDict,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
        vocab_parallel_rank: int | None = None,
        vocab_parallel_group: dist.ProcessGroup | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        del global_valid_seqs
        lp, _, sample_mask, mask = _slice_inputs(next_token_logits, data, vocab_parallel_group, vocab_parallel_rank)
        loss = -masked_mean(lp, mask, global_normalization_factor=global_valid_toks)
        with torch.no_grad():
            correct = _is_argmax(next_token_logits[:, :-1], lp.detach(), vocab_parallel_group).to(lp.dtype)
            accuracy = masked_mean(correct, mask, global_normalization_factor=global_valid_toks)
        return loss, {
            "loss": float(loss.item()),
            "token_accuracy": float(accuracy.item()),
            "num_unmasked_tokens": float(mask.sum().item()),
            "num_valid_samples": float(sample_mask.sum().item()),
        }


def _is_argmax(logits: torch.Tensor | HeadLogits, target_lp: torch.Tensor, group: dist.ProcessGroup | None
               ) -> torch.Tensor:
    """[B, S-1] bool: the target token has the highest logit (greedy decoding would emit it).

    logits [B, S-1, V] (or this rank's vocabulary slice under tensor parallelism); target_lp the target's
    logprob. The target's logit is target_lp + logsumexp, compared with the (global) max logit.
    """
    if isinstance(logits, torch.Tensor):
        top, lse = vocab_max_and_logsumexp(logits.detach().float(), group)  # [B, S-1] each
    else:
        top, lse = logits.max_and_logsumexp()
    return target_lp.to(lse.dtype) + lse >= top - 1e-4
