"""async_hpo.py: tiny searches (2 workers, 2,000 training images, 1-2 epochs, 30-40 s budgets) run as
subprocesses; the tests read the final JSON line and the results folder the way a user would."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from syne_tune.experiments import load_experiment

from conftest import REPO, assert_usage_error, last_json, run_script

QUICK = ["--limit-train", "2000", "--activation", "relu"]
OFFLINE = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "no_proxy": ""}


def trial_processes(results_dir, trial_id=None):
    """Live trial processes of the run writing to results_dir (their command line names their config file)."""
    suffix = f"/{trial_id}/config.json" if trial_id is not None else "/config.json"
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if any(str(results_dir) in part and part.endswith(suffix) for part in cmdline):
            found.append(proc)
    return found


def wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def start_search(*args):
    return subprocess.Popen([sys.executable, str(REPO / "async_hpo.py"), *map(str, args)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, timeout):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, out, err


def experiment_results(result):
    """The run's results as Syne Tune's load_experiment reads them back."""
    experiment = load_experiment(result["experiment"], local_path=result["results_dir"])
    assert experiment.results is not None and experiment.metadata is not None
    return experiment.results


def test_random_search_goes_on_after_a_crashed_trial(tmp_path, data_dir_args):
    """The tutorial's search: first trial lr 0.1 / batch 128; trial 1 is killed (as the OOM killer would)
    and is recorded as failed while the others finish; results, figures and utilisation are reported."""
    proc = start_search(*data_dir_args, *QUICK, "--max-epochs", "1", "--max-wallclock-time", "35",
                        "--max-failures", "1", "--results-dir", tmp_path)
    try:
        victim = wait_for(lambda: trial_processes(tmp_path, 1), 40, "trial 1 to start")
        for process in victim:
            process.send_signal(signal.SIGKILL)
    finally:
        code, out, err = finish(proc, 90)
    assert code == 0, err
    result = last_json(out)
    assert result["trials_failed"] == 1, out
    assert "trial 1 failed" in out
    assert result["trials_completed"] >= 2, out  # trial 0 and at least one started after the crash
    assert result["trials_started"] >= 3
    assert result["best_validation_error"] < 0.8, result  # chance is 0.9
    assert 0.032 < result["best_config"]["learning_rate"] < 1 and 32 <= result["best_config"]["batch_size"] <= 256
    assert 0.3 < result["utilisation"] <= 1.0, result
    results = experiment_results(result)
    first = results[results.trial_id == 0]
    assert (first.config_learning_rate.iloc[0], first.config_batch_size.iloc[0]) == (0.1, 128)
    assert list(first.epoch) == [1]
    assert len(results.trial_id.unique()) >= 2
    for figure in result["figures"].values():
        assert Path(figure).stat().st_size > 5000
    assert not trial_processes(tmp_path)


def test_too_many_crashes_stop_the_search_with_a_clear_error(tmp_path, data_dir_args):
    proc = start_search(*data_dir_args, *QUICK, "--max-epochs", "1", "--max-wallclock-time", "60",
                        "--max-failures", "0", "--results-dir", tmp_path)
    try:
        for process in wait_for(lambda: trial_processes(tmp_path, 0), 40, "trial 0 to start"):
            process.send_signal(signal.SIGKILL)
    finally:
        code, out, err = finish(proc, 60)
    lines = err.strip().splitlines()
    assert code == 1, (code, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "--max-failures 0" in lines[0] and "std.err" in lines[0], lines
    assert not trial_processes(tmp_path)


def test_sync_bo_starts_a_batch_only_after_the_previous_one_finished(tmp_path, data_dir_args):
    code_out = run_script("async_hpo.py", *data_dir_args, *QUICK, "--max-epochs", "1", "--max-wallclock-time",
                          "30", "--sync", "--scheduler", "bo", "--results-dir", tmp_path, timeout=90)
    assert code_out.returncode == 0, code_out.stderr
    result = last_json(code_out.stdout)
    assert result["sync"] is True and result["scheduler"] == "bo"
    assert result["trials_completed"] >= 2 and result["trials_started"] >= 3, result
    assert result["best_validation_error"] < 0.9
    trial_dir = Path(result["results_dir"]) / result["experiment"]
    results = experiment_results(result)
    first_batch_end = results[results.trial_id.isin([0, 1])].st_worker_timestamp.max()
    for trial_id in range(2, result["trials_started"]):
        scheduled = (trial_dir / str(trial_id) / "config.json").stat().st_mtime  # written just before its start
        assert scheduled > first_batch_end, (trial_id, scheduled, first_batch_end)


def test_asha_stops_bad_trials_early(tmp_path, data_dir_args):
    """One worker makes the order of reports fixed: trial 0 (lr 0.1, batch 128) finishes first; trial 1 (lr
    0.125, batch 149) is worse at the rung (epoch 1), so ASHA stops it there."""
    code_out = run_script("async_hpo.py", *data_dir_args, *QUICK, "--n-workers", "1", "--max-epochs", "2",
                          "--max-wallclock-time", "40", "--scheduler", "asha", "--results-dir", tmp_path, timeout=100)
    assert code_out.returncode == 0, code_out.stderr
    result = last_json(code_out.stdout)
    assert result["scheduler"] == "asha"
    assert result["trials_stopped_early"] >= 1, code_out.stdout
    assert "trial 1 stopped early | epoch 1" in code_out.stdout
    assert result["best_validation_error"] < 0.8
    results = experiment_results(result)
    assert list(results[results.trial_id == 0].epoch) == [1, 2]
    assert list(results[results.trial_id == 1].epoch) == [1]
    assert list(results[results.trial_id == 1].st_decision) == ["STOP"]


def test_sigterm_stops_the_tuner_and_every_trial(tmp_path, data_dir_args):
    proc = start_search(*data_dir_args, *QUICK, "--max-epochs", "2", "--max-wallclock-time", "300",
                        "--results-dir", tmp_path)
    try:
        wait_for(lambda: len(trial_processes(tmp_path)) == 2, 40, "two trials to start")
        proc.send_signal(signal.SIGTERM)
    finally:
        code, out, err = finish(proc, 30)
    assert code == 128 + signal.SIGTERM, (code, err)
    assert "SIGTERM" in err and "Traceback" not in err
    time.sleep(0.5)
    assert not trial_processes(tmp_path)
    (experiment,) = [path for path in tmp_path.iterdir() if path.is_dir()]
    assert (experiment / "metadata.json").is_file() and (experiment / "0" / "std.out").is_file()


def test_bad_input_is_one_line_exit_2(tmp_path, data_dir_args):
    cases = [
        (["--n-workers", "0"], ["--n-workers"]),
        (["--max-wallclock-time", "0"], ["--max-wallclock-time"]),
        (["--scheduler", "hyperband"], ["--scheduler", "invalid choice"]),
        (["--data-dir", tmp_path / "empty"], ["--data-dir"]),  # no data and no network
    ]
    (tmp_path / "empty").mkdir()
    procs = [subprocess.Popen([sys.executable, str(REPO / "async_hpo.py"), *data_dir_args, *map(str, args),
                               "--results-dir", tmp_path / "results"],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **OFFLINE})
             for args, _ in cases]  # concurrently: each spends its few seconds importing torch and syne_tune
    for proc, (args, fragments) in zip(procs, cases):
        out, err = proc.communicate(timeout=60)
        assert_usage_error(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), *fragments)
    assert not (tmp_path / "results").exists()  # nothing was started
