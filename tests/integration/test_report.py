"""`rlpost report` on real runs, opened in headless Chromium, and the trackers of those runs read back.

One 3-step default run with W&B (offline) and MLflow (its local store) enabled, and one 2-job sweep logging to a
real `mlflow server` on localhost; each report is rendered by Debian's Chromium: no console message (an uncaught
error or a console.error would be one), every expected series drawn (plotly's legend entries in the rendered
DOM). The sweep's page is also screenshot; with RLPOST_DOCS_SCREENSHOT=1 the screenshot replaces
docs/images/report.png (the picture docs/report.md shows), else it stays in the test's temporary directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests import wandb_records
from tests.integration import cli_runs

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOT = cli_runs.REPO / "docs" / "images" / "report.png"
needs_chromium = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                    reason="Debian's chromium is not installed (scripts/install.sh installs it as root)")

CURVES = ("fig-reward", "fig-validation", "fig-loss", "fig-kl", "fig-entropy", "fig-token_mult_prob_error",
          "fig-gen_length", "fig-lr")
PHASES = ("generation", "policy_training", "refit", "reward_calculation", "total_step_time")
LR = ("0.001", "0.003")


def _env(cache: Path, home: Path) -> dict[str, str]:
    env = cli_runs.env(cache)
    env.pop("WANDB_API_KEY", None)
    return {**env, "HOME": str(home), "WANDB_SILENT": "true"}  # no ~/.netrc key: W&B runs offline


def _rlpost(args: list[str], cache: Path, home: Path, cwd: Path, timeout: float = 600
            ) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([cli_runs.RLPOST, *args], env=_env(cache, home), cwd=cwd, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def run3(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A 3-step default run with both trackers on (MLflow to its default local store), and the health gate's warn
    threshold at its floor, 1.0: the engine's and the trainer's fp32 logprobs differ in the last bits, so its steps
    warn, and the page must show it. Two-token answers to the one-token task (every response cut at
    max_new_tokens) and the advisories' windows at 2 steps: the truncation, zero-variance and flat-reward advisories
    fire from step 2."""
    root = tmp_path_factory.mktemp("report-run")
    run_dir = root / "run"
    out = _rlpost(["train", f"hydra.run.dir={run_dir}", "grpo.max_num_steps=3", "logger.wandb_enabled=true",
                   "logger.mlflow_enabled=true", "logger.wandb.project=rlpost-test",
                   "grpo.token_mult_prob_error_warn_threshold=1.0", "+policy.hf_config_overrides.use_cache=true",
                   *ADVISED], cache, root, root)
    return run_dir, out


ADVISED = ["policy.generation.max_new_tokens=2", "logger.advisories.window=2",
           "logger.advisories.zero_variance_share=0.05", "logger.advisories.flat_reward_steps=2",
           "logger.advisories.flat_reward_tolerance=1.0"]
RULES = ("truncated", "zero_variance", "flat_reward")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real `mlflow server` on localhost (SQLite store), stopped at the end of the module."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    mlflow = str(Path(sys.executable).with_name("mlflow"))
    log = (root / "server.log").open("w")
    proc = subprocess.Popen([mlflow, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                             "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
                             "--default-artifact-root", (root / "artifacts").as_uri()],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (root / "server.log").read_text()[-3000:]
            time.sleep(0.25)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its uvicorn worker: the group this test started
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)
        log.close()


@pytest.fixture(scope="module")
def sweep(cache: Path, mlflow_server: str, tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A 2-job learning-rate sweep, both jobs logging to the MLflow server."""
    root = tmp_path_factory.mktemp("report-sweep")
    sweep_dir = root / "sweep"
    out = _rlpost(["train", "-m", f"hydra.sweep.dir={sweep_dir}", "grpo.max_num_steps=3",
                   f"policy.optimizer.kwargs.lr={','.join(LR)}", "logger.mlflow_enabled=true",
                   f"logger.mlflow.tracking_uri={mlflow_server}", "logger.mlflow.experiment_name=lr-sweep"],
                  cache, root, root)
    return sweep_dir, out


def render(page: Path, tmp: Path, screenshot: Path | None = None) -> tuple[str, list[str]]:
    """(the DOM after the page's scripts ran, the console messages) of `page` in headless Chromium."""
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
             f"--user-data-dir={tmp / 'chromium-profile'}", "--enable-logging=stderr", "--v=0",
             "--virtual-time-budget=10000", "--window-size=1300,1700"]
    out = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    console = [line for line in out.stderr.splitlines() if ":CONSOLE" in line]
    if screenshot is not None:
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        shot = subprocess.run([*flags, f"--screenshot={screenshot}", page.as_uri()], capture_output=True, text=True,
                              timeout=120)
        assert shot.returncode == 0 and screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", shot.stderr[-3000:]
        assert screenshot.stat().st_size > 20_000  # a page, not a blank
    return out.stdout, console


def figure(dom: str, fid: str) -> str:
    """The rendered markup of one figure (its div up to the next figure)."""
    start = dom.index(f'id="{fid}"')
    end = dom.find('class="figure"', start)
    return dom[start:end if end > 0 else len(dom)]


def legend(dom: str, fid: str) -> list[str]:
    """The names plotly drew in a figure's legend."""
    return re.findall(r'class="legendtext"[^>]*>([^<]*)<', figure(dom, fid))


def test_train_prints_the_report_command(run3: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    run_dir, out = run3
    assert f"report:      rlpost report {run_dir}" in out.stderr
    assert "rlpost: warning: logger." not in out.stderr  # both trackers started


def test_the_run_directory_holds_the_resolved_config(run3: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    run_dir, _ = run3
    resolved = yaml.safe_load((run_dir / "resolved_config.yaml").read_text())
    assert resolved["grpo"]["max_num_steps"] == 3
    assert resolved["policy"]["hf_config_overrides"] == {"use_cache": True}
    assert resolved["policy"]["model_name"] == resolved["model"]["path"]


def test_each_advisory_warns_once_and_counts_every_step_it_holds(
        run3: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    run_dir, out = run3
    rows = cli_runs.metrics(run_dir)
    for rule in RULES:
        lines = [line for line in out.stderr.splitlines() if f"counted as advisories/{rule})" in line]
        assert len(lines) == 1 and lines[0].startswith("rlpost: warning: step 2: "), (rule, out.stderr[-3000:])
        assert [r["step"] for r in rows if r.get(f"advisories/{rule}")] == [2, 3], rule


@needs_chromium
def test_the_report_of_a_run_renders_every_series(run3: tuple[Path, subprocess.CompletedProcess[str]],
                                                  cache: Path, tmp_path: Path) -> None:
    run_dir, _ = run3
    _rlpost(["report", str(run_dir)], cache, tmp_path, tmp_path)
    dom, console = render(run_dir / "report.html", tmp_path)
    assert console == [], console
    for fid in CURVES:
        assert 'class="main-svg"' in figure(dom, fid), fid  # plotly drew it
    for fid in ("fig-reward", "fig-entropy", "fig-token_mult_prob_error", "fig-lr"):
        assert legend(dom, fid) == ["run"], fid
    assert legend(dom, "fig-validation") == ["validation/accuracy", "validation/reward"]
    assert legend(dom, "fig-kl")[0] == "train/kl_penalty"
    assert legend(dom, "fig-gen_length")[0] == "train/mean_gen_length"
    assert set(PHASES) <= set(legend(dom, "fig-timing-0"))
    cpu = legend(dom, "fig-resources-cpu_percent")
    assert {"driver", "policy-0", "vllm-replica0"} <= set(cpu), cpu
    assert {"driver", "policy-0", "vllm-replica0"} <= set(legend(dom, "fig-resources-rss_gib"))
    tokens = legend(dom, "fig-resources-tokens_per_s")
    assert {"generation_tokens_per_s", "training_tokens_per_s"} <= set(tokens), tokens
    warned = [r["step"] for r in cli_runs.metrics(run_dir) if r.get("train/health_warnings")]
    assert warned, "no step passed token_mult_prob_error_warn_threshold=1.0: the run's warnings are not exercised"
    assert f"warning: step {warned[0]}: train/token_mult_prob_error=" in dom  # rlpost's line, from train.log
    assert f"warning: steps passed the health gate's warn threshold (steps {', '.join(map(str, warned))};" in dom
    assert "grpo.max_num_steps=3" in dom and "max_num_steps: 3" in dom  # its overrides and its config
    for rule in RULES:
        assert f"warning: advisory {rule} at 2 step(s) (from step 2; advisories/{rule})" in dom, rule
    assert "advisory" in figure(dom, "fig-reward")  # the band over steps 2-3


def test_the_run_logs_its_resources_every_step(run3: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    rows = cli_runs.metrics(run3[0])
    assert [r["step"] for r in rows if "train/reward" in r] == [1, 2, 3]
    for r in rows:
        if "train/reward" not in r:
            continue
        assert 0.05 < r["resources/driver/rss_gib"] < 16, r
        assert 0.05 < r["resources/policy-0/rss_gib"] < 16 and r["resources/policy-0/cpu_percent"] >= 0, r
        assert 0.05 < r["resources/vllm-replica0/rss_gib"] < 16, r
        assert r["resources/generation_tokens_per_s"] == pytest.approx(
            r["performance/generation_tokens_per_sec"], rel=1e-6)
        assert r["resources/training_tokens_per_s"] > r["performance/tokens_per_sec"]  # over training, not the step


def test_wandb_offline_run_holds_the_metrics(run3: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    run_dir, _ = run3
    rows = {r["step"]: r for r in cli_runs.metrics(run_dir)}
    path = wandb_records.run_file(run_dir)  # wandb/offline-run-*/run-*.wandb: what `wandb sync` uploads
    hist = wandb_records.history(path)
    assert [h["_step"] for h in hist] == sorted(rows)
    for h in hist:
        row = rows[h["_step"]]
        assert {k for k in h if not k.startswith("_")} == set(row) - {"step"}
        assert h["train/reward" if "train/reward" in row else "validation/accuracy"] == pytest.approx(
            row["train/reward" if "train/reward" in row else "validation/accuracy"])
    config = wandb_records.config(path)
    assert config["grpo"]["max_num_steps"] == 3 and config["logger"]["wandb_enabled"] is True
    # what `wandb sync` would upload once a key is configured (--dry-run: no server here)
    sync = subprocess.run([str(Path(sys.executable).with_name("wandb")), "sync", "--dry-run", str(path.parent)],
                          cwd=run_dir, env=_env(run_dir, run_dir), capture_output=True, text=True, timeout=120)
    assert sync.returncode == 0 and "Would sync 1 run(s)" in sync.stdout + sync.stderr, sync.stdout + sync.stderr
    assert path.name in sync.stdout + sync.stderr


def test_mlflow_local_store_holds_the_metrics(run3: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    import mlflow

    run_dir, _ = run3
    rows = [r for r in cli_runs.metrics(run_dir) if "train/reward" in r]
    mlflow.set_tracking_uri(f"sqlite:///{run_dir / 'mlflow.db'}")
    df = mlflow.search_runs(experiment_names=["rlpost"])
    assert len(df) == 1 and df.loc[0, "status"] == "FINISHED" and df.loc[0, "tags.mlflow.runName"] == "run"
    assert df.loc[0, "metrics.train/reward"] == pytest.approx(rows[-1]["train/reward"])
    assert df.loc[0, "params.grpo.max_num_steps"] == "3"
    history = mlflow.MlflowClient().get_metric_history(df.loc[0, "run_id"], "train/loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["train/loss"])) for r in rows]


def test_a_sweep_logs_to_a_real_mlflow_server(sweep: tuple[Path, subprocess.CompletedProcess[str]],
                                              mlflow_server: str) -> None:
    import mlflow

    sweep_dir, out = sweep
    mlflow.set_tracking_uri(mlflow_server)
    df = mlflow.search_runs(experiment_names=["lr-sweep"], order_by=["attributes.run_name"])
    assert list(df["tags.mlflow.runName"]) == [f"{sweep_dir.name}/0", f"{sweep_dir.name}/1"]
    assert sorted(df["params.policy.optimizer.kwargs.lr"].astype(float)) == [1e-3, 3e-3]
    for job, final in zip((0, 1), df["metrics.train/reward"], strict=True):
        rows = [r for r in cli_runs.metrics(sweep_dir / str(job)) if "train/reward" in r]
        assert final == pytest.approx(rows[-1]["train/reward"])
    assert not list(sweep_dir.glob("*/mlflow.db"))  # nothing went to the local store
    assert f"report: rlpost report {sweep_dir}" in out.stdout


@needs_chromium
def test_the_report_of_a_sweep_overlays_its_jobs(sweep: tuple[Path, subprocess.CompletedProcess[str]],
                                                 cache: Path, tmp_path: Path) -> None:
    sweep_dir, _ = sweep
    _rlpost(["report", str(sweep_dir)], cache, tmp_path, tmp_path)
    shot = SCREENSHOT if os.environ.get("RLPOST_DOCS_SCREENSHOT") == "1" else tmp_path / "report.png"
    dom, console = render(sweep_dir / "report.html", tmp_path, screenshot=shot)
    assert console == [], console
    names = [f"lr={lr}" for lr in LR]
    for fid in ("fig-reward", "fig-loss", "fig-entropy", "fig-token_mult_prob_error", "fig-lr"):
        assert legend(dom, fid) == names, fid
    assert legend(dom, "fig-sweep-0") == ["final train/reward", "final validation/accuracy"]
    for job in (0, 1):  # one breakdown per job
        assert set(PHASES) <= set(legend(dom, f"fig-timing-{job}"))
    assert f"lr={LR[0]} · policy-0" in legend(dom, "fig-resources-cpu_percent")
    table = dom[dom.index('class="sweep"'):]
    table = table[:table.index("</table>")]
    summary = json.loads((sweep_dir / "sweep_summary.json").read_text())
    for row in summary["jobs"]:
        assert f"<td>{row['overrides']['policy.optimizer.kwargs.lr']}</td>" in table
        assert f"{row['final_reward']:.4g}" in table
    assert "best: policy.optimizer.kwargs.lr=" in dom
