"""What a user reads when a run under torchrun ends early: torchrun's summary of a usage error names the rank that met
it, with the project's one line and none of its traceback; Ctrl-C is said once, and the run saves and says how to
resume before torchrun ends with code 1."""

import re
import signal
import socket

import pytest

from conftest import ROOT, make_image_folder, run_python, run_torchrun

HOST = socket.gethostname()
RECIPE = ["--recipe", "cls.yaml", "train.batch_size=4", "model.width=4", "data.workers=0"]


def project_frames(text):
    """The traceback frames in text that are of this repository's files (torch's own are elsewhere)."""
    files = re.findall(r'File "([^"<]+)"', text)
    return [f for f in files if (ROOT / f).resolve().is_relative_to(ROOT)]


def root_cause(stderr):
    """The Root Cause entry of torchrun's summary: {field: value}."""
    entry = stderr.split("Root Cause (first observed failure):\n", 1)[1].split("\n====", 1)[0]
    return dict(re.findall(r"^  (\w+) *: (.*)$", entry, flags=re.M))


@pytest.mark.slow
def test_a_usage_error_one_rank_meets_is_torchruns_root_cause_as_one_line(tmp_path):
    data = make_image_folder(tmp_path / "data", {"train": {"a": 6, "b": 6}, "val": {"a": 2, "b": 2}}, size=64)
    # Rank 1 alone sees a machine with 0.3 MiB available: its RAM cache of 12 64x64 images is over its budget. And it
    # is slow to say so, as on a loaded machine: rank 0, stopped by its failure, says its line and ends first.
    result = run_torchrun("tests/faults.py", "low-memory-on-rank:1:0.3,slow-to-say-on-rank:1:6", "train.py", *RECIPE,
                          "train.epochs=1",
                          f"data.name={data}", "data.cache=ram", "data.img_size=64", f"project={tmp_path / 'runs'}")
    said = f"train.py: error: rank 1 on {HOST}: data.cache=ram: the first "
    line = next((s for s in result.stderr.splitlines() if s.startswith(said)), None)
    assert line is not None and "more than this process's budget" in line, result.stderr[-3000:]
    cause = root_cause(result.stderr)
    assert cause["rank"] == "1 (local_rank: 1)" and cause["exitcode"].startswith("2 "), result.stderr[-3000:]
    assert cause["traceback"] == line
    # Every failure torchrun lists is one line (rank 0 repeats rank 1's), with no frame of this project's files.
    assert re.findall(r"^  traceback : (.*)\n(?!  )", result.stderr, flags=re.M) == [line, line]
    assert project_frames(result.stderr) == [], result.stderr[-3000:]
    assert result.returncode == 1  # torchrun's own code for a failed worker


@pytest.mark.slow
def test_a_rank_that_fails_while_the_others_wait_in_a_collective_that_never_breaks_ends_them_all(tmp_path):
    # Rank 0 waits for ever where rank 1 fails (as in a GPU collective with a rank that left); rank 1 is slow to say
    # its error, and val.py, unlike train.py, lets torchrun's SIGTERM end a rank at once.
    result = run_torchrun("tests/faults.py", "fail-while-others-wait:1,slow-to-say-on-rank:1:2", "val.py",
                          "--weights", tmp_path / "none.pt", "--project", tmp_path / "runs", timeout=120)
    line = f"val.py: error: rank 1 on {HOST}: injected: rank 1 alone meets this"
    # Rank 0 ends, saying rank 1's error, and torchrun lists it; rank 1 has said its own and exited first, not
    # killed by torchrun's SIGTERM for rank 0's end, and is the root cause.
    assert re.findall(f"^{re.escape(line)}$", result.stderr, flags=re.M) == [line, line], result.stderr[-3000:]
    assert re.findall(r"^  traceback : (.*)\n(?!  )", result.stderr, flags=re.M) == [line, line], result.stderr[-3000:]
    cause = root_cause(result.stderr)
    assert cause["rank"] == "1 (local_rank: 1)" and cause["exitcode"].startswith("2 "), result.stderr[-3000:]
    assert cause["traceback"] == line
    assert project_frames(result.stderr) == [] and result.returncode == 1, result.stderr[-3000:]


@pytest.mark.slow
def test_ctrl_c_under_torchrun_is_said_once_saves_and_ends_with_code_1(tmp_path):
    data = make_image_folder(tmp_path / "data", {"train": {"a": 6, "b": 6}, "val": {"a": 2, "b": 2}})
    # Ctrl-C in the terminal reaches torchrun alone (its workers run in sessions of their own); it passes SIGINT on.
    result = run_torchrun("tests/faults.py", "signal-torchrun-at-step:1:SIGINT", "train.py", *RECIPE,
                          "train.epochs=20", f"data.name={data}", f"project={tmp_path / 'runs'}")
    output = result.stdout + result.stderr
    assert output.count("SIGINT: stopping after the current step to save a checkpoint") == 1, output[-3000:]
    stopped = re.findall(r"^Stopped at epoch \d+, step \d+/3; saved (.+)\. Resume with:$", result.stdout, re.M)
    assert stopped == [str(tmp_path / "runs" / "exp" / "weights" / "last.pt")], output[-3000:]
    assert f"torchrun --nproc_per_node=2 train.py --resume {tmp_path / 'runs' / 'exp'}" in result.stdout
    # torchrun raises its SignalException on receiving the signal, whatever its workers do: its own frames only.
    assert "SignalException: Process" in result.stderr and project_frames(result.stderr) == []
    # torchrun's code 1, or, rarely, CPython's abort when a daemon thread of torchrun's still writes to stderr as its
    # interpreter shuts down (a race in the launcher's process, after the run has saved and said all the above).
    shutdown_race = result.returncode == -signal.SIGABRT and "Fatal Python error: _enter_buffered_busy" in result.stderr
    assert result.returncode == 1 or shutdown_race, result.stderr[-3000:]


STARTUP_LINE = "SIGINT: stopped while starting, before any training; nothing was saved"


@pytest.mark.slow
@pytest.mark.parametrize("point", ["import", "setup"])
def test_ctrl_c_while_the_workers_start_is_said_once_without_tracebacks(tmp_path, point):
    data = make_image_folder(tmp_path / "data", {"train": {"a": 4, "b": 4}, "val": {"a": 2, "b": 2}}, size=8)
    (tmp_path / "meet").mkdir()
    # Both workers reach the point (torch's import in train.py, or joining the process group), then rank 0 presses
    # Ctrl-C: torchrun passes SIGINT to each worker.
    result = run_torchrun("tests/startup_signal.py", point, tmp_path / "meet", "train.py", *RECIPE,
                          f"data.name={data}", f"project={tmp_path / 'runs'}", timeout=120)
    output = result.stdout + result.stderr
    assert output.count(STARTUP_LINE) == 1 and "KeyboardInterrupt" not in output, output[-3000:]
    assert "SignalException: Process" in result.stderr and project_frames(result.stderr) == []  # torchrun's own
    assert not (tmp_path / "runs").exists()
    shutdown_race = result.returncode == -signal.SIGABRT and "Fatal Python error: _enter_buffered_busy" in result.stderr
    assert result.returncode == 1 or shutdown_race, result.stderr[-3000:]


def test_ctrl_c_while_one_process_starts_ends_it_with_code_130_and_one_line(tmp_path):
    (tmp_path / "meet").mkdir()
    result = run_python("tests/startup_signal.py", "import", tmp_path / "meet", "train.py", *RECIPE,
                        f"project={tmp_path / 'runs'}", timeout=120)
    assert result.returncode == 128 + signal.SIGINT
    assert result.stderr == f"\n{STARTUP_LINE}\n" and result.stdout == ""
