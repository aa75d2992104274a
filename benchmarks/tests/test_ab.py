"""benchmarks.ab: the figures it reads from a GRPO benchmark result, its paired summary, and the code it runs for
an arm (the working tree's, or a git revision's, in either layout the GRPO benchmark has had)."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from benchmarks import ab


def _sync(step: float, gen: float, train: float) -> dict[str, object]:
    return {"step_s": step, "step_over_bare": step / (gen + train), "median_step_over_median_bare": 1.0,
            "limits": {"bare_generation_s": gen, "bare_training_s": train}}


def test_the_comparison_is_paired_within_each_round() -> None:
    """Round 2 runs on a host twice as slow: B's steps are 0.9x A's in both rounds, so the paired ratio is 0.9
    exactly, while the arms' own medians straddle each other."""
    runs = [
        {"round": 1, "label": "a", "figures": ab.figures(_sync(0.100, 0.04, 0.04))},
        {"round": 1, "label": "b", "figures": ab.figures(_sync(0.090, 0.04, 0.04))},
        {"round": 2, "label": "a", "figures": ab.figures(_sync(0.200, 0.08, 0.08))},
        {"round": 2, "label": "b", "figures": ab.figures(_sync(0.180, 0.08, 0.08))},
    ]
    s = ab.summarize(runs, ["a", "b"])
    assert s["b"]["step_vs_first"]["median"] == pytest.approx(0.9)
    assert s["b"]["step_vs_first"]["max"] == pytest.approx(0.9)
    assert s["a"]["step_s"]["min"] == pytest.approx(0.100) and s["a"]["step_s"]["max"] == pytest.approx(0.200)
    assert s["b"]["ratio"]["median"] == pytest.approx(1.125)  # 0.090 / 0.080 and 0.180 / 0.160
    assert s["a"]["step_vs_first"]["median"] == 1.0 and s["b"]["runs"] == 2


def test_a_round_missing_an_arm_is_left_out_of_the_paired_ratio() -> None:
    runs = [
        {"round": 1, "label": "a", "figures": ab.figures(_sync(0.100, 0.04, 0.04))},
        {"round": 1, "label": "b", "figures": ab.figures(_sync(0.120, 0.04, 0.04))},
        {"round": 2, "label": "b", "figures": ab.figures(_sync(0.500, 0.04, 0.04))},
    ]
    s = ab.summarize(runs, ["a", "b"])
    assert s["b"]["step_vs_first"]["median"] == pytest.approx(1.2)
    assert s["b"]["runs"] == 2 and s["b"]["step_s"]["max"] == pytest.approx(0.5)


def test_async_results_are_compared_by_the_async_step() -> None:
    result = {"async_compare": {"sync": {"step_s": 0.1}, "async": {"step_s": 0.06, "step_over_max": 1.12},
                                "async_speedup": 1.67}}
    assert ab.figures(result) == {"step_s": 0.06, "ratio": 1.12, "sync_step_s": 0.1, "speedup": 1.67}


@pytest.mark.parametrize("spec", ["noequals", "=x", "a b=c"])
def test_a_malformed_arm_is_refused(spec: str) -> None:
    with pytest.raises(SystemExit, match="LABEL=OVERRIDES"):
        ab.parse_arm(spec)


def test_an_arm_keeps_its_overrides() -> None:
    assert ab.parse_arm("mb16=policy.train_micro_batch_size=16 a=b") == (
        "mb16", ["policy.train_micro_batch_size=16", "a=b"], None)
    assert ab.parse_arm("default=") == ("default", [], None)
    assert ab.parse_arm("old@HEAD~1=a=b") == ("old", ["a=b"], "HEAD~1")


def test_an_arm_at_an_empty_revision_is_refused() -> None:
    with pytest.raises(SystemExit, match="LABEL@REV=OVERRIDES"):
        ab.parse_arm("old@=")


def test_an_arm_at_a_revision_runs_that_commits_code(tmp_path: Path) -> None:
    """The worktree holds the revision's files (here HEAD's, which git knows in any clone), its GRPO benchmark among
    them, and is gone afterwards; a revision git does not know is refused by name."""
    head = subprocess.run(["git", "-C", str(ab.REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    with ab.code_at("HEAD", tmp_path) as code:
        assert ab.bench_command(code) and (code / "src" / "rlpost").is_dir()
        assert subprocess.run(["git", "-C", str(code), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip() == head
    assert not code.exists()
    with pytest.raises(SystemExit, match="no commit 'no-such-rev'"):
        with ab.code_at("no-such-rev", tmp_path):
            pass


NEW = """import json, sys
out = sys.argv[sys.argv.index("--out") + 1]
json.dump({"older": {"ran": "older"}, "--steps=3 x=1": {"ran": __file__, "argv": sys.argv[1:]}}, open(out, "w"))
"""
"""A checkout's benchmarks/grpo.py: its results file keyed by configuration, the newest last."""

OLD = """import json, sys
out = sys.argv[sys.argv.index("--out") + 1]
json.dump([{"ran": "older"}, {"ran": __file__, "argv": sys.argv[1:]}], open(out, "w"))
"""
"""A checkout's scripts/bench_grpo.py, from before the benchmarks package: its results file a list of runs."""


@pytest.mark.parametrize(("layout", "source"), [("benchmarks/grpo.py", NEW), ("scripts/bench_grpo.py", OLD)])
def test_an_arm_runs_the_grpo_benchmark_of_its_checkout(tmp_path: Path, layout: str, source: str) -> None:
    """In either layout, the checkout's own benchmark runs (not this repository's, which is the working directory),
    with the arm's arguments, and its newest result is the arm's."""
    code = tmp_path / "checkout"
    (code / layout).parent.mkdir(parents=True)
    (code / layout).write_text(source)
    (code / layout).with_name("__init__.py").write_text("")
    args = argparse.Namespace(dir=str(tmp_path), steps=3, warmup=None, async_compare=False, timeout_s=600.0)
    result = ab.run_one("arm", ["x=1"], ["c=2"], args, 1, code)
    assert result == {"ran": str(code / layout), "argv": ["--steps", "3", "--out", str(tmp_path / "arm.1.json"),
                                                          "c=2", "x=1"]}


def test_a_checkout_without_a_grpo_benchmark_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no GRPO benchmark"):
        ab.bench_command(tmp_path)
