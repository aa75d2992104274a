"""benchmarks.suite: the standard set's configurations are valid, a model that is not prepared is skipped, and the
table shows each latest result beside its limit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks import grpo, harness, start, suite


def _run_configs(bench: suite.Bench) -> list[list[str]]:
    """The Hydra overrides of each training run the benchmark composes (none for the generation benchmark)."""
    args = suite.module(bench).parse_args(list(bench.argv))
    if bench.module == "grpo":
        return list(grpo.runs(args).values())
    if bench.module == "start":
        return [[*start.JOB, *args.overrides]]
    return [args.overrides] if hasattr(args, "overrides") else []


@pytest.mark.parametrize("bench", suite.STANDARD, ids=[b.name for b in suite.STANDARD])
def test_every_configuration_of_the_set_is_valid(bench: suite.Bench) -> None:
    """Composed and checked as a run would (batch divisibility, layout, ...), without starting anything."""
    from rlpost.config.load import load_master_config

    for overrides in _run_configs(bench):
        load_master_config(overrides)


def test_a_model_that_is_not_prepared_is_skipped_until_it_is(tmp_path: Path) -> None:
    bench = suite.Bench("refit/smollm2", "refit", ("model=smollm2_135m", f"model.cache_dir={tmp_path}"))
    why = suite.not_ready(bench)
    assert str(tmp_path / "smollm2-135m-instruct") in why and "make smollm2" in why
    (tmp_path / "smollm2-135m-instruct").mkdir()
    (tmp_path / "smollm2-135m-instruct" / "config.json").write_text("{}")
    assert suite.not_ready(bench) == ""
    assert suite.not_ready(suite.Bench("grpo/tiny", "grpo", ("--steps", "2"))) == ""


def test_the_list_names_each_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert suite.main(["--list", "--only", "grpo/17.9M", "--only", "start/tiny"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["grpo/17.9M", "start/tiny"]
    assert "-m benchmarks.grpo --steps 8 --warmup 1 model.tiny.hidden_size=512" in lines[0]
    assert lines[1].endswith("-m benchmarks.start --rounds 3")


GRPO = {"date": "2025-01-02T03:04:05", "step_s": 0.1, "step_median_s": 0.09, "step_over_bare": 1.25,
        "median_step_over_median_bare": 1.125, "median_step_over_median_bare_alternating": 0.9, "refit_gbps": 0.5,
        "step_cpu_floor_s": 0.05,
        "limits": {"bare_generation_s": 0.03, "bare_training_s": 0.05, "bare_generation_median_s": 0.03,
                   "bare_training_median_s": 0.05, "bare_alternating_median_s": 0.1, "memcpy_gbps": 5.0}}
ASYNC = {"date": "2025-01-02T03:04:06", "async_compare": {
    "sync": {"step_s": 0.12, "generation_s": 0.05, "training_s": 0.05, "step_over_sum": 1.2},
    "async": {"step_s": 0.066, "generation_s": 0.05, "training_s": 0.06, "step_over_max": 1.1}}}
REFIT = {"date": "", "refit_s": {"median": 0.3}, "refit_gbps_median": 1.5,
         "limits": {"bare_load_s": 0.25, "memcpy_gbps": 6.0}}
START = {"date": "", "first_step_median_s": 13.0, "bare_engine_median_s": 8.0, "ratio_median": 1.6}
GENERATION = {"date": "", "engines": {"vllm_rlpost": {"tokens_per_s": 900.0}, "vllm_bare": {"tokens_per_s": 1000.0},
                                      "hf_rlpost": {"tokens_per_s": 300.0}, "hf_bare": {"tokens_per_s": 400.0}}}


def _ratios(rows: list[harness.Row]) -> dict[str, float | None]:
    return {f"{r.measure} / {r.limit}": None if r.ratio is None else round(r.ratio, 3) for r in rows}


def test_each_latest_result_is_shown_beside_its_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Results saved under each benchmark's key come back as rows with their ratios; another configuration's
    result in the same file is not shown; a benchmark without a result for its configuration says so; nothing
    runs."""
    saved: dict[str, dict[str, Any]] = {"grpo/tiny": GRPO, "grpo-async/tiny": ASYNC, "refit/tiny": REFIT,
                                        "start/tiny": START, "generation/tiny": GENERATION}
    benches = {b.name: b for b in suite.STANDARD}
    for name, result in saved.items():
        args = suite.arguments(benches[name], tmp_path)
        harness.save_latest(args.out, harness.run_key(args), result)
    harness.save_latest(tmp_path / "bench_grpo.json", "another configuration", {**GRPO, "step_over_bare": 9.87})

    date, rows = suite.result_rows(benches["grpo/tiny"], tmp_path)
    assert date == "2025-01-02T03:04:05"
    assert _ratios(rows) == {"step (mean) / 0.080 s bare gen + train": 1.25,
                             "step (median) / 0.080 s median bare gen + train": 1.125,
                             "step (median) / 0.100 s bare gen then train, one process": 0.9,
                             "step (mean) / 0.050 s CPU floor": 2.0,
                             "refit / 5.00 GB/s memcpy": 0.1}
    assert _ratios(suite.result_rows(benches["grpo-async/tiny"], tmp_path)[1]) == {
        "sync step / 0.100 s gen + train": 1.2, "async step / 0.060 s max(gen, train)": 1.1}
    assert _ratios(suite.result_rows(benches["refit/tiny"], tmp_path)[1]) == {
        "refit (median) / 0.250 s bare in-place load": 1.2, "refit (median) / 6.00 GB/s memcpy": 0.25}
    assert _ratios(suite.result_rows(benches["start/tiny"], tmp_path)[1]) == {
        "time to first step (median) / 8.00 s bare engine start": 1.6}
    assert _ratios(suite.result_rows(benches["generation/tiny"], tmp_path)[1]) == {
        "vllm generation / 1000 tok/s bare vLLM": 0.9, "hf generation / 400 tok/s bare HF generate": 0.75}
    assert suite.result_rows(benches["grpo/17.9M"], tmp_path)[1][0].measure == "no result"

    capsys.readouterr()
    assert suite.main(["--report", "--results", str(tmp_path), "--only", "grpo/tiny", "--only", "grpo/17.9M"]) == 0
    table = capsys.readouterr().out.strip().splitlines()
    assert table[0].split() == ["benchmark", "measure", "result", "limit", "result/limit", "target", "measured", "at"]
    assert [line.split()[0] for line in table[2:]] == ["grpo/tiny"] * 5 + ["grpo/17.9M"]
    assert "9.87" not in "\n".join(table) and "<= 1.15" in table[2]
