"""One self-contained HTML page from the runs: plotly.js inlined once in the head (the page opens offline), then
the runs, their failures and warnings, a sweep's table and its swept parameters, the curves, the step time by phase,
the resource metrics, and each run's overrides and resolved config."""

from __future__ import annotations

import datetime
import html
from pathlib import Path

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from rlpost.report.figures import CURVES, curve_figure, resource_figures, sweep_figures, timing_figure
from rlpost.report.runs import Run
from rlpost.sweep_summary import best_job, best_line, sweep_rows, swept_keys

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1400px; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 8px 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; }
th { background: #f3f3f3; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(620px, 1fr)); gap: 8px; }
.ok { color: #1a7f37; } .bad { color: #b42318; } .warn { color: #9a6700; }
pre { background: #f6f8fa; padding: 8px; overflow-x: auto; font-size: 0.8em; }
ul.messages li { font-family: monospace; font-size: 0.85em; }
"""


def _esc(text: object) -> str:
    return html.escape(str(text))


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


class _Figures:
    """Figure divs with unique ids; the page holds plotly.js once, so each div is written without it."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def div(self, fig: go.Figure, fid: str) -> str:
        fid = f"fig-{fid}"
        while fid in self.ids:
            fid += "-"
        self.ids.append(fid)
        body: str = fig.to_html(full_html=False, include_plotlyjs=False, div_id=fid,
                                config={"displaylogo": False, "responsive": True})
        return f'<div class="figure" data-title="{_esc(fig.layout.title.text or "")}">{body}</div>'


def _runs_table(runs: list[Run]) -> str:
    head = "<tr><th>run</th><th>directory</th><th>state</th><th>steps</th><th>final train/reward</th>" \
           "<th>validation/accuracy</th><th>train/loss</th></tr>"
    rows = []
    for r in runs:
        state = r.status.get("state", "(no run_status.json)")
        cls = "ok" if state == "finished" else "bad" if state == "failed" else "warn"
        steps = r.status.get("steps") or (int(r.rows[-1]["step"]) if r.rows else 0)
        rows.append(f"<tr><td>{_esc(r.name)}</td><td>{_esc(r.path)}</td><td class='{cls}'>{_esc(state)}</td>"
                    f"<td>{steps}</td><td>{_fmt(r.last('train/reward'))}</td>"
                    f"<td>{_fmt(r.last('validation/accuracy'))}</td><td>{_fmt(r.last('train/loss'))}</td></tr>")
    return f"<table id='runs'>{head}{''.join(rows)}</table>"


def _messages(runs: list[Run]) -> str:
    parts = []
    for r in runs:
        if not r.messages:
            parts.append(f"<p><b>{_esc(r.name)}</b>: <span class='ok'>no failure or warning</span></p>")
            continue
        items = "".join(f"<li class='{'bad' if m.startswith(('failed', 'error', 'stopped')) else 'warn'}'>"
                        f"{_esc(m)}</li>" for m in r.messages)
        parts.append(f"<p><b>{_esc(r.name)}</b>:</p><ul class='messages'>{items}</ul>")
    return "".join(parts)


def _sweep(sweep: Path, figs: _Figures) -> str:
    rows = sweep_rows(sweep)
    keys = swept_keys(rows)
    head = "<tr><th>job</th>" + "".join(f"<th>{_esc(k)}</th>" for k in keys) + \
        "<th>final train/reward</th><th>validation/accuracy</th><th>status</th></tr>"
    body = []
    for r in rows:
        status = "ok" if r["exit_status"] == 0 else f"failed (exit {r['exit_status']}): {r['error'] or ''}"
        body.append(f"<tr><td>{r['job']}</td>" + "".join(f"<td>{_esc(r['overrides'].get(k, ''))}</td>" for k in keys)
                    + f"<td>{_fmt(r['final_reward'])}</td><td>{_fmt(r['val_accuracy'])}</td>"
                    f"<td class='{'ok' if r['exit_status'] == 0 else 'bad'}'>{_esc(status)}</td></tr>")
    plots = "".join(figs.div(f, f"sweep-{i}") for i, f in enumerate(sweep_figures(rows)))
    return (f"<h3>{_esc(sweep)}</h3><table class='sweep'>{head}{''.join(body)}</table>"
            f"<p>{_esc(best_line(best_job(rows)))}</p><div class='grid'>{plots}</div>")


def _configs(runs: list[Run]) -> str:
    parts = []
    for r in runs:
        overrides = " ".join(r.overrides) or "(none)"
        parts.append(f"<details><summary>{_esc(r.name)}: overrides <code>{_esc(overrides)}</code></summary>"
                     f"<pre>{_esc(r.config_text or '(no resolved_config.yaml)')}</pre></details>")
    return "".join(parts)


def render(runs: list[Run], sweeps: list[Path]) -> str:
    """The page for `runs` (and the sweeps they came from)."""
    figs = _Figures()
    curves = [figs.div(f, p.id) for p in CURVES if (f := curve_figure(p, runs)) is not None]
    timing = [figs.div(f, f"timing-{i}") for i, r in enumerate(runs) if (f := timing_figure(r)) is not None]
    resources = [figs.div(f, f"resources-{fid}") for fid, f in resource_figures(runs)]
    sweep = "".join(_sweep(s, figs) for s in sweeps)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    title = "rlpost report: " + (", ".join(str(s) for s in sweeps) if sweeps else ", ".join(r.name for r in runs))
    sections = [
        f"<h1>{_esc(title)}</h1><p>{len(runs)} run(s), written {now}.</p>",
        f"<h2>Runs</h2>{_runs_table(runs)}",
        f"<h2>Failures and warnings</h2>{_messages(runs)}",
        f"<h2>Sweep</h2>{sweep}" if sweep else "",
        f"<h2>Curves</h2><div class='grid'>{''.join(curves)}</div>",
        f"<h2>Step time by phase</h2><div class='grid'>{''.join(timing)}</div>" if timing else "",
        f"<h2>Resources</h2><div class='grid'>{''.join(resources)}</div>" if resources else "",
        f"<h2>Config</h2>{_configs(runs)}",
    ]
    return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>{_esc(title)}</title>"
            f"<style>{_STYLE}</style><script type='text/javascript'>{get_plotlyjs()}</script></head>"
            f"<body>{''.join(sections)}</body></html>\n")
