"""`rlpost report RUN_DIR [RUN_DIR ...] [-o FILE]`: one self-contained HTML page of one run, several runs overlaid,
or a sweep (its directory: every job, its table and its swept parameters), that opens offline.

A path that is neither a run nor a sweep directory ends the command with status 2 and one line naming it and the
rule; nothing is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPORT_FILE = "report.html"
"""The page's name, in the run or sweep directory when one is given, else in the working directory."""

USAGE = "rlpost report RUN_OR_SWEEP_DIR [RUN_OR_SWEEP_DIR ...] [-o FILE]"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"rlpost report: error: {message}\nusage: {USAGE}", file=sys.stderr)
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="rlpost report", usage=USAGE, description=(
        "Write one HTML page (plotly, opens offline) of runs: curves of reward, validation, loss, KL, entropy, "
        "token_mult_prob_error, generation length and learning rate, every run overlaid and named by its differing "
        "overrides; the step time by phase; resource metrics; a sweep's table and swept parameters; each run's "
        "config, failures and warnings."))
    p.add_argument("paths", nargs="+", type=Path, metavar="DIR",
                   help="a run directory (holds metrics.jsonl) or a sweep directory (numbered job directories)")
    p.add_argument("-o", "--output", type=Path, default=None,
                   help=f"the page to write (default: DIR/{REPORT_FILE} for one directory, ./{REPORT_FILE} for several)")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command's arguments; SystemExit (2, after one line) for a bad option."""
    return _parser().parse_args(argv)


def default_output(paths: list[Path]) -> Path:
    return paths[0] / REPORT_FILE if len(paths) == 1 else Path(REPORT_FILE)


def check_output(out: Path, paths: list[Path]) -> None:
    """ReportInputError when writing the page to `out` would replace what a run wrote: a file inside one of the run
    or sweep directories other than its page, or a directory."""
    from rlpost.report.runs import ReportInputError

    if out.is_dir():
        raise ReportInputError(out, f"-o is a directory; name the page's file (e.g. {out / REPORT_FILE})")
    if out.exists() and out.name != REPORT_FILE:
        where = out.resolve()
        for path in paths:
            if where.is_relative_to(path.resolve()):
                raise ReportInputError(out, f"-o would write over a file of the run in {path}; the page goes to "
                                            f"{path / REPORT_FILE} or a file outside the run")


def write_report(paths: list[Path], output: Path | None = None) -> Path:
    """Write the page for `paths`; returns where. ReportInputError for a path that is not a run or sweep dir."""
    from rlpost.report.html import render
    from rlpost.report.runs import load_runs

    out = output or default_output(paths)
    check_output(out, paths)
    runs, sweeps = load_runs(paths)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(render(runs, sweeps), encoding="utf-8")
    tmp.replace(out)
    return out


def report(argv: list[str]) -> int:
    """The `rlpost report` command: 0 when the page was written, 2 for a bad path or option."""
    from rlpost.report.runs import ReportInputError

    try:
        args = parse_args(argv)
    except SystemExit as exc:  # --help: 0; a bad option: 2, its line already printed
        return int(exc.code or 0)
    try:
        out = write_report(args.paths, args.output)
    except ReportInputError as err:
        print(f"rlpost report: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"rlpost report: error: cannot write {args.output or default_output(args.paths)}: "
              f"{err.strerror or err}", file=sys.stderr)
        return 2
    print(f"rlpost report: wrote {out} (open {out.resolve().as_uri()} in a browser; it needs no network)")
    return 0
