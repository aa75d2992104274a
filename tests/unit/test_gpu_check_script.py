"""scripts/gpu_check.sh: its parts, each under one device call, cover every gpu- and gpu2-marked test file."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
MARKER = re.compile(r"pytest\.mark\.(gpu2?)\b")


def marked(marker: str) -> set[str]:
    """The test files (relative to the repo) that hold `@pytest.mark.<marker>` or list it in `pytestmark`."""
    out = set()
    for path in [*ROOT.joinpath("tests").rglob("test_*.py"), *ROOT.joinpath("benchmarks").rglob("test_*.py")]:
        if marker in MARKER.findall(path.read_text()):
            out.add(str(path.relative_to(ROOT)))
    return out


def parts() -> dict[str, tuple[str, set[str]]]:
    """part -> (what `list` says it runs, the files it names)."""
    out = subprocess.run(["bash", str(SCRIPT), "list"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    found: dict[str, tuple[str, set[str]]] = {}
    for line in out.stdout.splitlines():
        if m := re.match(r"^(part\d+): (.+)$", line):
            current = m.group(1)
            found[current] = (m.group(2), set())
        elif line.strip().startswith("files:"):
            found[current][1].update(line.split(":", 1)[1].split())
    return found


def test_list_names_six_parts_each_saying_what_it_runs() -> None:
    listed = parts()
    assert list(listed) == [f"part{i}" for i in range(1, 7)]
    assert "device line" in listed["part1"][0]
    assert "-m gpu2" in listed["part5"][0]
    assert "benchmarks.refit" in listed["part6"][0] and "benchmarks.grpo" in listed["part6"][0]


def test_every_gpu_and_gpu2_marked_file_is_run_by_a_part_under_its_marker() -> None:
    listed = parts()
    gpu2_parts = {p for p, (what, _) in listed.items() if "-m gpu2" in what}
    gpu_parts = {p for p, (what, _) in listed.items() if "'gpu and not gpu2'" in what}
    assert gpu2_parts and gpu_parts
    gpu_files, gpu2_files = marked("gpu"), marked("gpu2")
    assert "tests/integration/test_gpu.py" in gpu_files  # the scan finds what the script must cover
    for path in gpu_files:
        assert any(path in listed[p][1] for p in gpu_parts), f"{path} holds gpu tests no part runs"
    for path in gpu2_files:
        assert any(path in listed[p][1] for p in gpu2_parts), f"{path} holds gpu2 tests no part runs"


def test_it_runs_the_projects_venv_and_says_so() -> None:
    out = subprocess.run(["bash", str(SCRIPT), "part0"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2 and "unknown part 'part0'" in out.stderr
    python = ".venv/bin/python" if (ROOT / ".venv" / "bin" / "python").exists() else "python3"
    assert out.stdout.startswith(f"gpu_check: python {python} (")
