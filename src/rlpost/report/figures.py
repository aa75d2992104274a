"""The report's plotly figures: one per curve panel (every run overlaid), the step time by phase as a stacked area
(one per run), resource metrics, and a sweep's swept parameter against its final metrics."""

from __future__ import annotations

import math
from dataclasses import dataclass

import plotly.graph_objects as go

from rlpost.report.runs import Run, advisory_steps
from rlpost.sweep_summary import SweepRow, swept_keys


@dataclass(frozen=True)
class Panel:
    """A curve panel: its title and the metrics it plots (those a run has)."""

    id: str
    title: str
    keys: tuple[str, ...]
    log_y: bool = False


CURVES: tuple[Panel, ...] = (
    Panel("reward", "Train reward", ("train/reward",)),
    Panel("validation", "Validation accuracy and reward", ("validation/accuracy", "validation/reward")),
    Panel("loss", "Loss", ("train/loss", "validation/loss")),
    Panel("kl", "KL", ("train/kl_penalty", "train/gen_kl_error", "train/policy_kl_error")),
    Panel("entropy", "Entropy", ("train/approx_entropy",)),
    Panel("token_mult_prob_error", "token_mult_prob_error (engine vs trainer; ~1.0 when healthy)",
          ("train/token_mult_prob_error",)),
    Panel("gen_length", "Generation length", ("train/mean_gen_length", "validation/avg_length")),
    Panel("lr", "Learning rate", ("train/lr",)),
    Panel("accuracy", "Accuracy (supervised)", ("train/token_accuracy", "validation/token_accuracy", "train/accuracy",
                                                "validation/accuracy_pairs")),
    Panel("grad_norm", "Gradient norm", ("train/grad_norm",)),
)
"""The curves, in the report's order; a panel no run has a metric of is left out."""

TOTAL = "timing/train/total_step_time"
_LAYOUT = dict(template="plotly_white", height=340, margin=dict(l=60, r=40, t=50, b=45),
               legend=dict(orientation="h", yanchor="top", y=-0.18, x=0), modebar=dict(orientation="v"))


def _step_axis(fig: go.Figure, runs: list[Run]) -> None:
    """Whole steps on the x axis of a short run (plotly would put ticks at 1.5, 2.5, ...)."""
    last = max((int(r.rows[-1]["step"]) for r in runs if r.rows), default=0)
    if last <= 20:
        fig.update_xaxes(dtick=1)


def _label(run: Run, key: str, keys: tuple[str, ...] | list[str], many_runs: bool) -> str:
    """A trace's name: the run's legend name, with the metric when the panel has several."""
    metric = key if len(keys) > 1 else ""
    if many_runs:
        return f"{run.name} · {metric}" if metric else run.name
    return metric or run.name


def curve_figure(panel: Panel, runs: list[Run]) -> go.Figure | None:
    """One panel with every run's metrics overlaid; None when no run has any of them."""
    fig = go.Figure()
    present = [k for k in panel.keys if any(k in r.keys() for r in runs)]
    for run in runs:
        for key in present:
            steps, values = run.series(key)
            if steps:
                fig.add_trace(go.Scatter(x=steps, y=values, mode="lines+markers", name=_label(run, key, present,
                                                                                              len(runs) > 1)))
    if not fig.data:
        return None
    fig.update_layout(title=panel.title, xaxis_title="step", showlegend=True, **_LAYOUT)
    _step_axis(fig, runs)
    _advisory_bands(fig, runs)
    if panel.log_y:
        fig.update_yaxes(type="log")
    else:
        _value_axis(fig, [v for trace in fig.data for v in trace.y if math.isfinite(v)])
    return fig


def _advisory_bands(fig: go.Figure, runs: list[Run]) -> None:
    """A shaded band over each stretch of steps where a run-health advisory fired (rlpost.algorithms.advisories)."""
    steps = sorted({s for r in runs for fired in advisory_steps(r.rows).values() for s in fired})
    start = prev = None
    for s in [*steps, None]:
        if s is not None and prev is not None and s == prev + 1:
            prev = s
            continue
        if start is not None and prev is not None:
            fig.add_vrect(x0=start - 0.5, x1=prev + 0.5, fillcolor="orange", opacity=0.15, line_width=0,
                          annotation_text="advisory", annotation_position="top left")
        start = prev = s


def y_range(values: list[float]) -> tuple[float, float] | None:
    """The y axis of a panel whose values are all one number (a constant learning rate): that number in the middle
    of its own scale, e.g. 0.0015-0.0045 for 3e-3 (plotly would draw it at 0 on a -1..1 axis); None otherwise."""
    if not values:
        return None
    lo, hi = min(values), max(values)
    if hi - lo > 1e-9 * max(abs(lo), abs(hi)):
        return None
    pad = abs(hi) / 2 if hi else 1.0
    return lo - pad, hi + pad


def _value_axis(fig: go.Figure, values: list[float]) -> None:
    """Each panel on its own scale, its ticks in significant digits (3e-3, not 0.00)."""
    fig.update_yaxes(tickformat=".3~g")
    if (span := y_range(values)) is not None:
        fig.update_yaxes(range=list(span))


def timing_figure(run: Run) -> go.Figure | None:
    """The step time by phase (timing/train/*) as a stacked area, with the total step time as a line."""
    phases = sorted(k for k in run.keys() if k.startswith("timing/train/") and k != TOTAL)
    if not phases:
        return None
    fig = go.Figure()
    for key in phases:
        steps, values = run.series(key)
        fig.add_trace(go.Scatter(x=steps, y=values, mode="lines", stackgroup="phases",
                                 name=key.removeprefix("timing/train/")))
    steps, values = run.series(TOTAL)
    if steps:
        fig.add_trace(go.Scatter(x=steps, y=values, mode="lines", name="total_step_time",
                                 line=dict(color="black", dash="dot")))
    fig.update_layout(title=f"Step time by phase (s): {run.name}", xaxis_title="step", **_LAYOUT)
    _step_axis(fig, [run])
    return fig


def resource_figures(runs: list[Run]) -> list[tuple[str, go.Figure]]:
    """(id, figure) of CPU %, RSS (GiB), GPU memory, GPU utilisation and tokens/s (resources/*): one figure each, every
    process of every run; the id is the metrics' last part (`cpu_percent`, ...)."""
    specs = (("cpu_percent", "CPU % per process (100 = one core)"), ("rss_gib", "Resident memory per process (GiB)"),
             ("gpu_memory_gib", "GPU memory per process (GiB)"), ("utilization_pct", "GPU utilisation (%)"),
             ("tokens_per_s", "Tokens/s"))
    figs = []
    for suffix, title in specs:
        fig = go.Figure()
        for run in runs:
            for key in sorted(k for k in run.keys() if k.startswith("resources/") and k.endswith(suffix)):
                steps, values = run.series(key)
                what = key.removeprefix("resources/").removesuffix(f"/{suffix}")
                fig.add_trace(go.Scatter(x=steps, y=values, mode="lines+markers",
                                         name=f"{run.name} · {what}" if len(runs) > 1 else what))
        if fig.data:
            fig.update_layout(title=title, xaxis_title="step", **_LAYOUT)
            _step_axis(fig, runs)
            figs.append((suffix, fig))
    return figs


def _number(text: str) -> float | None:
    try:
        v = float(text)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def sweep_figures(rows: list[SweepRow]) -> list[go.Figure]:
    """For each swept parameter: its value against each job's final train/reward and validation/accuracy (numbers on
    a numeric axis, logarithmic when they span more than a factor 20; other values as categories)."""
    figs = []
    ok = [r for r in rows if r["exit_status"] == 0]
    for key in swept_keys(rows):
        xs = [r["overrides"].get(key, "") for r in ok]
        nums = [_number(x) for x in xs]
        numeric = all(n is not None for n in nums) and len(xs) > 0
        order = sorted(range(len(ok)), key=lambda i: nums[i] if numeric else i)  # type: ignore[return-value,arg-type]
        fig = go.Figure()
        for field, metric in (("final_reward", "final train/reward"), ("val_accuracy", "final validation/accuracy")):
            pts = [(nums[i] if numeric else xs[i], ok[i][field]) for i in order  # type: ignore[literal-required]
                   if ok[i][field] is not None]  # type: ignore[literal-required]
            if pts:
                fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers",
                                         name=metric))
        if not fig.data:
            continue
        fig.update_layout(title=f"{key} against the final metrics", xaxis_title=key, **_LAYOUT)
        positive = [n for n in nums if n is not None and n > 0]
        if numeric and len(positive) == len(nums) and max(positive) / min(positive) > 20:
            fig.update_xaxes(type="log")
        if not numeric:
            fig.update_xaxes(type="category")
        figs.append(fig)
    return figs
