"""rlpost.report: reading run and sweep directories, naming runs by their differing overrides, the page's parts and
the command's answers to bad paths. The directories are written here the way a run writes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlpost import cli
from rlpost.report.command import REPORT_FILE, write_report
from rlpost.report.html import render
from rlpost.report.runs import ReportInputError, Run, legend_names, load_run, load_runs


def make_run(path: Path, overrides: list[str], rows: list[dict[str, float]], status: dict | None = None,
             log: str = "") -> Path:
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "resolved_config.yaml").write_text("grpo:\n  max_num_steps: 3\n")
    (path / "run_status.json").write_text(json.dumps(status or {"state": "finished", "exit_status": 0, "steps": 3,
                                                                "error": None}))
    (path / "train.log").write_text(log)
    return path


def rows(n: int = 3, reward: float = 0.1) -> list[dict[str, float]]:
    return [{"step": s, "train/reward": reward * s, "train/loss": 1.0 / s, "train/lr": 1e-3,
             "timing/train/generation": 0.2, "timing/train/policy_training": 0.3, "timing/train/total_step_time": 0.6,
             "resources/policy-0/cpu_percent": 90.0, "resources/driver/rss_gib": 1.5} for s in range(1, n + 1)]


def test_a_run_is_read_with_its_overrides_status_and_warnings(tmp_path: Path) -> None:
    log = ("[2026-01-01 12:00:00,000][rlpost][WARNING] - step 2: train/token_mult_prob_error=1.2 > warn threshold\n"
           "[2026-01-01 12:00:00,000][vllm][WARNING] - not rlpost's\n"
           "[2026-01-01 12:00:01,000][rlpost][INFO] - a notice\n")
    r = rows()
    r[1]["train/reward_timeouts"] = 2.0
    run = load_run(make_run(tmp_path / "run", ["grpo.max_num_steps=3", "hydra.verbose=true"], r, log=log))
    assert run.overrides == ["grpo.max_num_steps=3"]
    assert run.series("train/reward") == ([1, 2, 3], pytest.approx([0.1, 0.2, 0.3]))
    assert run.last("train/loss") == pytest.approx(1 / 3)
    assert run.messages == ["warning: step 2: train/token_mult_prob_error=1.2 > warn threshold",
                            "warning: 2 reward calls timed out (steps 2; train/reward_timeouts)"]


def test_a_resumed_run_shows_each_step_once_and_a_partial_last_line_is_skipped(tmp_path: Path) -> None:
    path = make_run(tmp_path / "run", [], rows(2))
    with (path / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 2, "train/reward": 9.0}) + "\n" + '{"step": 3, "train/rew')
    run = load_run(path)
    assert run.series("train/reward") == ([1, 2], [0.1, 9.0])


def test_a_failed_run_names_its_error(tmp_path: Path) -> None:
    status = {"state": "failed", "exit_status": 4, "steps": 1, "error": "rlpost: error: step 2: train/loss=nan"}
    run = load_run(make_run(tmp_path / "run", [], rows(1), status=status))
    assert run.messages == ["failed (exit 4): rlpost: error: step 2: train/loss=nan"]


def test_legend_names_are_the_differing_overrides(tmp_path: Path) -> None:
    a = load_run(make_run(tmp_path / "a", ["grpo.max_num_steps=3", "policy.optimizer.kwargs.lr=1e-3"], rows()))
    b = load_run(make_run(tmp_path / "b", ["grpo.max_num_steps=3", "policy.optimizer.kwargs.lr=3e-3"], rows()))
    assert legend_names([a, b]) == ["lr=1e-3", "lr=3e-3"]
    c = load_run(make_run(tmp_path / "c", ["grpo.max_num_steps=3", "policy.optimizer.kwargs.lr=3e-3", "seed=2"],
                          rows()))
    assert legend_names([a, b, c]) == ["lr=1e-3", "lr=3e-3", "lr=3e-3 seed=2"]
    same = load_run(make_run(tmp_path / "d", ["grpo.max_num_steps=3", "policy.optimizer.kwargs.lr=1e-3"], rows()))
    assert legend_names([a, same]) == ["a", "d"]  # no differing override: the directories
    assert legend_names([a]) == ["a"]


def test_a_sweep_directory_gives_its_jobs_and_its_table(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    for job, lr in enumerate(("1e-3", "3e-3")):
        make_run(sweep / str(job), [f"policy.optimizer.kwargs.lr={lr}"], rows(reward=0.1 * (job + 1)))
    runs, sweeps = load_runs([sweep])
    assert [r.name for r in runs] == ["lr=1e-3", "lr=3e-3"] and sweeps == [sweep]
    page = render(runs, sweeps)
    assert page.count("<script type='text/javascript'>") == 1  # plotly.js inlined once
    assert "<th>policy.optimizer.kwargs.lr</th>" in page and "fig-sweep-0" in page
    assert "best: policy.optimizer.kwargs.lr=3e-3 (job 1, train/reward 0.600)" in page
    for fid in ("fig-reward", "fig-loss", "fig-lr", "fig-timing-0", "fig-timing-1", "fig-resources-cpu_percent",
                "fig-resources-rss_gib"):
        assert f'id="{fid}"' in page, fid
    out = write_report([sweep])
    assert out == sweep / REPORT_FILE and out.stat().st_size > 1_000_000  # plotly.js is in it


@pytest.mark.parametrize("argv, rule", [
    (["/nonexistent/run"], "/nonexistent/run: no such directory"),
    (["{tmp}/empty"], "{tmp}/empty: not a run directory (no metrics.jsonl) nor a sweep directory"),
    (["{tmp}/file.txt"], "{tmp}/file.txt: not a directory"),
    (["--bogus", "{tmp}"], "unrecognized arguments: --bogus"),
    ([], "the following arguments are required: DIR"),
])
def test_bad_paths_end_with_status_2_and_one_line(argv: list[str], rule: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.txt").write_text("x")
    rc = cli.main(["report", *[a.format(tmp=tmp_path) for a in argv]])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("rlpost report: error: ") and rule.format(tmp=tmp_path) in err, err
    assert "Traceback" not in err
    assert not list(tmp_path.rglob(REPORT_FILE))


def test_the_input_error_names_path_and_rule(tmp_path: Path) -> None:
    with pytest.raises(ReportInputError) as err:
        load_runs([tmp_path])
    assert err.value.path == tmp_path and "metrics.jsonl" in err.value.rule


def test_a_sweep_job_that_failed_before_its_first_step_is_in_the_table(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    make_run(sweep / "0", ["policy.optimizer.kwargs.lr=1e-3"], rows())
    failed = sweep / "1"
    (failed / ".hydra").mkdir(parents=True)
    (failed / ".hydra" / "overrides.yaml").write_text("- policy.optimizer.kwargs.lr=3e-3\n")
    (failed / "failure.json").write_text(json.dumps({"exit_status": 4, "error": "rlpost: error: out of memory"}))
    (sweep / "sweep_summary.json").write_text("{}")
    runs, sweeps = load_runs([sweep])
    assert [r.path.name for r in runs] == ["0"]  # no metrics: no curves
    page = render(runs, sweeps)
    assert "failed (exit 4): rlpost: error: out of memory" in page
    assert "<td>3e-3</td>" in page


def test_the_page_never_writes_over_what_the_run_wrote(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    make_run(run, [], rows())
    metrics = (run / "metrics.jsonl").read_text()
    assert cli.main(["report", str(run), "-o", str(run / "metrics.jsonl")]) == 2
    assert "would write over a file of the run" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_text() == metrics  # untouched
    assert cli.main(["report", str(run), "-o", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert cli.main(["report", str(run)]) == 0 and (run / REPORT_FILE).is_file()
    assert cli.main(["report", str(run)]) == 0  # its own page is replaced
    assert cli.main(["report", str(run), "-o", str(tmp_path / "elsewhere.html")]) == 0


def test_a_text_value_in_the_metrics_is_left_out_of_the_charts(tmp_path: Path) -> None:
    run = tmp_path / "run"
    make_run(run, [], rows())
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 4, "train/reward": "high", "train/loss": 0.5, "note": [1, 2], "flag": True}) + "\n")
    loaded = load_run(run)
    assert loaded.rows[-1] == {"step": 4.0, "train/loss": 0.5}
    assert "fig-reward" in render([loaded], [])


def test_a_constant_learning_rate_is_drawn_on_its_own_scale() -> None:
    from rlpost.report.figures import CURVES, curve_figure, y_range

    assert y_range([3e-3, 3e-3]) == pytest.approx((1.5e-3, 4.5e-3))
    assert y_range([0.0, 0.0]) == (-1.0, 1.0) and y_range([1e-3, 2e-3]) is None and y_range([]) is None
    run = load_run_rows([{"step": 1, "train/lr": 3e-3}, {"step": 2, "train/lr": 3e-3}])
    fig = curve_figure(next(p for p in CURVES if p.id == "lr"), [run])
    assert fig is not None
    assert tuple(fig.layout.yaxis.range) == pytest.approx((1.5e-3, 4.5e-3))
    assert fig.layout.yaxis.tickformat == ".3~g"


def load_run_rows(rows: list[dict[str, float]]) -> Run:
    return Run(path=Path("run"), rows=rows, overrides=[], config_text="", status={}, messages=[])
