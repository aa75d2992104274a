"""One run per directory (rlpost.runtime.run_lock): a second run on a held directory is refused with the holder's
pid, a lock left by a killed process is taken over with a warning, and a run releases its lock when it ends.

Nothing here waits on a clock: the holder is this test process (or a child that says when it holds the lock), and
the training runs replace `rlpost.runner.run`, so no Ray starts."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlpost.config.errors import ConfigError
from rlpost.runtime.run_lock import LOCK_FILE, acquire
from tests.fault_table import Record

SRC = str(Path(__file__).resolve().parents[2] / "src")
TRAIN = ["train", "grpo.max_num_steps=2", "grpo.val_period=0", "checkpointing.metric_name=null"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}


def _python(code: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=_env())


def locked(directory: Path) -> bool:
    """Whether some open file holds the directory's lock (a fresh descriptor conflicts even in the same process)."""
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        assert exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
        return True
    finally:
        os.close(fd)
    return False


def test_a_held_directory_is_refused_to_another_process_with_the_holders_pid(tmp_path: Path) -> None:
    d = tmp_path / "run"
    with acquire(d, "hydra.run.dir"):
        out = _python(f"""
            from pathlib import Path
            from rlpost.config.errors import ConfigError
            from rlpost.runtime.run_lock import acquire
            try:
                acquire(Path({str(d)!r}), "hydra.run.dir")
            except ConfigError as err:
                print(err)
            """, timeout=120)
        assert f"in use by pid {os.getpid()} on host " in out.stdout, out.stdout + out.stderr
        assert "wait for it or choose another hydra.run.dir" in out.stdout
    assert not locked(d)
    assert (d / LOCK_FILE).read_text() == ""  # released cleanly: the next run takes it without a warning


def test_the_lock_is_reentrant_within_a_process_and_released_by_the_last_holder(tmp_path: Path) -> None:
    outer = acquire(tmp_path, "hydra.run.dir")
    inner = acquire(tmp_path, "hydra.run.dir")
    inner.release()
    assert locked(tmp_path)
    outer.release()
    outer.release()  # a second release of the same hold changes nothing
    assert not locked(tmp_path)


def test_a_lock_left_by_a_killed_process_is_taken_over_with_one_warning(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from rlpost.runtime.run_lock import acquire;"
         f"acquire(Path({str(tmp_path)!r}), 'hydra.run.dir'); print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        assert locked(tmp_path)
        with pytest.raises(ConfigError, match=f"in use by pid {child.pid} "):
            acquire(tmp_path, "hydra.run.dir")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    with acquire(tmp_path, "hydra.run.dir"):
        err = capsys.readouterr().err
        assert err.count("rlpost: warning:") == 1
        assert f"taking over the lock of pid {child.pid} on host " in err
        assert f'"pid": {os.getpid()}' in (tmp_path / LOCK_FILE).read_text()
    acquire(tmp_path, "hydra.run.dir").release()
    assert capsys.readouterr().err == ""


@pytest.mark.faults
def test_rlpost_train_on_a_held_directory_exits_2_before_writing(tmp_path: Path, fault: Record) -> None:
    d = tmp_path / "run"
    with acquire(d, "hydra.run.dir"):
        out = _python(f"""
            import sys
            from rlpost.cli import main
            sys.exit(main({[*TRAIN, f"hydra.run.dir={d}"]!r}))
            """)
    fault("a second run in a held hydra.run.dir", out.returncode, out.stdout + out.stderr,
          data_lost=sorted(p.name for p in d.iterdir()) != [LOCK_FILE])
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"rlpost: config error: hydra.run.dir='{d}': in use by pid {os.getpid()} on host " in out.stderr
    assert "Traceback" not in out.stderr
    assert sorted(p.name for p in d.iterdir()) == [LOCK_FILE]  # Hydra wrote nothing (.hydra/, train.log)



def test_a_job_refused_by_a_held_directory_leaves_the_holders_files(tmp_path: Path) -> None:
    """A directory named by an interpolation is locked by the job (two runs started in the same second share the
    default outputs/<date>/<time>): the refused job removes nothing of the holder's, though it holds only what Hydra
    writes at a run's start."""
    d = tmp_path / "run"
    with acquire(d, "hydra.run.dir"):
        (d / ".hydra").mkdir()
        out = subprocess.run([sys.executable, "-c", "import sys; from rlpost.cli import main; "
                              "sys.exit(main(sys.argv[1:]))", *TRAIN, "hydra.run.dir=${oc.env:RUN_DIR}"],
                             capture_output=True, text=True, timeout=300, env={**_env(), "RUN_DIR": str(d)})
        assert out.returncode == 2, out.stdout + out.stderr
        assert "in use by pid" in out.stderr
        assert (d / ".hydra").is_dir() and (d / LOCK_FILE).is_file()


# The job's run function replaced: it reports whether its run dir (and the sweep dir) are locked while it runs.
_FAKE_RUN = """
import errno, fcntl, os, sys
from pathlib import Path
import rlpost.runner

def held(d):
    fd = os.open(Path(d) / ".rlpost.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)

def fake_run(cfg, run_dir):
    print("run", Path(run_dir).name, "held" if held(run_dir) else "free", flush=True)
    if {fail!r}:
        raise RuntimeError("boom")
    return {{}}

rlpost.runner.run = fake_run
from rlpost.cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize("fail", [False, True], ids=["run ends", "run fails"])
def test_a_run_holds_its_directory_until_it_ends(tmp_path: Path, fail: bool) -> None:
    d = tmp_path / "run"
    out = _python(_FAKE_RUN.format(fail=fail, argv=[*TRAIN, f"hydra.run.dir={d}"]))
    assert out.returncode == (1 if fail else 0), out.stdout + out.stderr
    assert "run run held" in out.stdout
    assert not locked(d)
    assert (d / LOCK_FILE).read_text() == ""


def test_each_multirun_job_locks_its_own_directory(tmp_path: Path) -> None:
    s = tmp_path / "sweep"
    out = _python(_FAKE_RUN.format(fail=False, argv=["train", "-m", "grpo.max_num_steps=1,2",
                                                         *TRAIN[2:], f"hydra.sweep.dir={s}"]))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "run 0 held" in out.stdout and "run 1 held" in out.stdout
    assert not any(locked(p) for p in (s, s / "0", s / "1"))


@pytest.mark.faults
def test_an_outside_checkpoint_dir_is_locked_too(tmp_path: Path, fault: Record) -> None:
    ck = tmp_path / "ck"
    with acquire(ck, "checkpointing.checkpoint_dir"):
        out = _python(_FAKE_RUN.format(fail=False, argv=[*TRAIN, f"hydra.run.dir={tmp_path / 'run'}",
                                                         f"checkpointing.checkpoint_dir={ck}"]))
    fault("a second run on a held checkpointing.checkpoint_dir", out.returncode, out.stdout + out.stderr)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"checkpointing.checkpoint_dir='{ck}': in use by pid {os.getpid()}" in out.stderr
    assert "run run" not in out.stdout
    assert not (tmp_path / "run").exists()  # Hydra made it for the refused job: it is removed with the refusal


def test_plan_takes_no_lock(tmp_path: Path) -> None:
    from rlpost.cli import main

    assert main(["plan", f"hydra.run.dir={tmp_path / 'run'}"]) == 0
    assert not (tmp_path / "run").exists()
