"""async_hpo.py: tiny searches (2,000 training images, 1-2 epochs, ended by --max-trials so that a loaded
machine makes them slower, not different) run as subprocesses; the tests read the final JSON line and the
results folder the way a user would."""

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from conftest import OFFLINE, REPO, assert_usage_error, data_root, last_json, needs_gpus, start_script


def import_keeping_environment(module):
    """Import a module that imports Syne Tune without its side effect on this (shared) pytest process:
    syne_tune.backend sets OMP_NUM_THREADS=1 in os.environ, which every later subprocess would inherit."""
    import importlib
    saved = dict(os.environ)
    try:
        return importlib.import_module(module)
    finally:
        os.environ.clear()
        os.environ.update(saved)

QUICK = ["--limit-train", "2000", "--activation", "relu", "--max-wallclock-time", "400"]


def trial_processes(results_dir, trial_id=None):
    """Live trial processes of the run writing to results_dir (their command line names their config file)."""
    suffix = f"/{trial_id}/config.json" if trial_id is not None else "/config.json"
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["status"] != psutil.STATUS_ZOMBIE and any(
                str(results_dir) in part and part.endswith(suffix) for part in cmdline):
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
    return start_script("async_hpo.py", *args)


def finish(proc, timeout):
    """(exit status, stdout, stderr); on timeout the tuner is SIGTERMed, which also stops its trials."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        proc.communicate(timeout=30)
        raise
    return proc.returncode, out, err


def experiment_results(result):
    """The run's results as Syne Tune's load_experiment reads them back."""
    experiment = import_keeping_environment("syne_tune.experiments").load_experiment(
        result["experiment"], local_path=result["results_dir"])
    assert experiment.results is not None and experiment.metadata is not None
    return experiment.results


def test_random_search_goes_on_after_a_crashed_trial(tmp_path, data_dir_args):
    """The tutorial's search: first trial lr 0.1 / batch 128; trial 1 is killed (as the OOM killer would)
    and is recorded as failed while the search goes on; results, figures and utilisation are reported."""
    proc = start_search(*data_dir_args, *QUICK, "--max-epochs", "1", "--max-trials", "3", "--max-failures", "1",
                        "--results-dir", tmp_path)
    try:
        for process in wait_for(lambda: trial_processes(tmp_path, 1), 60, "trial 1 to start"):
            process.send_signal(signal.SIGKILL)
    finally:
        code, out, err = finish(proc, 480)
    assert code == 0, err
    result = last_json(out)
    assert "trial 1 failed" in out
    assert result["trials_failed"] == 1 and result["trials_completed"] >= 2, out
    assert result["best_validation_error"] < 0.8, result  # chance is 0.9
    assert 0.01 <= result["best_config"]["learning_rate"] <= 1 and 32 <= result["best_config"]["batch_size"] <= 256
    assert 0.2 < result["utilisation"] <= 1.0, result
    results = experiment_results(result)
    first = results[results.trial_id == 0]
    assert (first.config_learning_rate.iloc[0], first.config_batch_size.iloc[0], list(first.epoch)) == (0.1, 128, [1])
    assert (results.config_threads == max(1, len(os.sched_getaffinity(0)) // 2)).all()  # cores / n_workers
    assert set(results.trial_id) >= {0, 2}  # trial 2 started after the crash and reported
    for figure in result["figures"].values():
        assert Path(figure).stat().st_size > 5000
    assert not trial_processes(tmp_path)


def test_too_many_crashes_stop_the_search_with_a_clear_error(tmp_path, data_dir_args):
    proc = start_search(*data_dir_args, *QUICK, "--max-epochs", "1", "--max-failures", "0", "--results-dir", tmp_path)
    try:
        for process in wait_for(lambda: trial_processes(tmp_path, 0), 60, "trial 0 to start"):
            process.send_signal(signal.SIGKILL)
    finally:
        code, out, err = finish(proc, 120)
    lines = err.strip().splitlines()
    assert code == 1, (code, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "--max-failures 0" in lines[0] and "std.err" in lines[0], lines
    assert not trial_processes(tmp_path)


def test_sync_bo_starts_a_batch_only_after_the_previous_one_finished(tmp_path, data_dir_args):
    proc = start_search(*data_dir_args, *QUICK, "--max-epochs", "1", "--max-trials", "3", "--sync",
                        "--scheduler", "bo", "--results-dir", tmp_path)
    code, out, err = finish(proc, 480)
    assert code == 0, err
    result = last_json(out)
    assert result["sync"] is True and result["scheduler"] == "bo"
    # whole batches of 2; the stop is checked after the tuner's scheduling step, so a third batch may have begun
    assert result["trials_completed"] >= 3 and result["trials_started"] in (4, 6), result
    assert result["best_validation_error"] < 0.9
    trial_dir = Path(result["results_dir"]) / result["experiment"]
    results = experiment_results(result)
    first_batch_end = results[results.trial_id.isin([0, 1])].st_worker_timestamp.max()
    for trial_id in (2, 3):
        scheduled = (trial_dir / str(trial_id) / "config.json").stat().st_mtime  # written just before its start
        assert scheduled > first_batch_end, (trial_id, scheduled, first_batch_end)


def test_asha_stops_bad_trials_early(tmp_path, data_dir_args):
    """One worker makes the order of reports fixed: trial 0 (lr 0.1, batch 128) finishes first; trial 1 (lr
    0.125, batch 149) is worse at the rung (epoch 1), so ASHA stops it there."""
    proc = start_search(*data_dir_args, *QUICK, "--n-workers", "1", "--max-epochs", "2", "--max-trials", "2",
                        "--scheduler", "asha", "--results-dir", tmp_path)
    code, out, err = finish(proc, 480)
    assert code == 0, err
    result = last_json(out)
    assert result["scheduler"] == "asha"
    assert (result["trials_completed"], result["trials_stopped_early"]) == (1, 1), out
    assert "trial 1 stopped early | epoch 1" in out
    assert result["best_validation_error"] < 0.8
    results = experiment_results(result)
    assert list(results[results.trial_id == 0].epoch) == [1, 2]
    assert list(results[results.trial_id == 1].epoch) == [1]
    assert list(results[results.trial_id == 1].st_decision) == ["STOP"]


def test_sigterm_stops_the_tuner_and_every_trial(tmp_path, data_dir_args):
    proc = start_search(*data_dir_args, *QUICK, "--max-epochs", "2", "--results-dir", tmp_path)
    try:
        wait_for(lambda: len(trial_processes(tmp_path)) == 2, 60, "two trials to start")
        proc.send_signal(signal.SIGTERM)
    finally:
        code, out, err = finish(proc, 60)
    assert code == 128 + signal.SIGTERM, (code, err)
    assert "SIGTERM" in err and "Traceback" not in err
    assert not trial_processes(tmp_path)
    (experiment,) = [path for path in tmp_path.iterdir() if path.is_dir()]
    assert (experiment / "metadata.json").is_file() and (experiment / "0" / "std.out").is_file()


@pytest.mark.parametrize("args, fragments", [
    (["--n-workers", "0"], ["--n-workers"]),
    (["--max-wallclock-time", "0"], ["--max-wallclock-time"]),
    (["--max-trials", "0"], ["--max-trials"]),
    (["--scheduler", "hyperband"], ["--scheduler", "invalid choice"]),
])
def test_bad_flags_are_one_line_exit_2(args, fragments, monkeypatch, capsys, tmp_path):
    """In this process (main() checks flags before anything starts), to save a torch import per case."""
    main = import_keeping_environment("async_hpo").main
    from common import run_main
    monkeypatch.setattr(sys, "argv", ["async_hpo.py", *args, "--results-dir", str(tmp_path / "results")])
    with pytest.raises(SystemExit) as exit_info:
        run_main(main)
    captured = capsys.readouterr()
    assert_usage_error(subprocess.CompletedProcess(args, exit_info.value.code, captured.out, captured.err), *fragments)
    assert not (tmp_path / "results").exists()  # nothing was started


def test_no_data_offline_is_one_line_exit_2(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = subprocess.run([sys.executable, str(REPO / "async_hpo.py"), "--data-dir", str(tmp_path / "empty"),
                           "--results-dir", str(tmp_path / "results")], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **OFFLINE})
    assert_usage_error(proc, "--data-dir")
    assert not (tmp_path / "results").exists()


def test_seed_fixes_the_sequence_of_configurations():
    async_hpo = import_keeping_environment("async_hpo")
    from syne_tune.config_space import loguniform, randint
    space = {"learning_rate": loguniform(1e-2, 1), "batch_size": randint(32, 256), "max_epochs": 10}

    def configs(scheduler, seed):
        search = async_hpo.make_scheduler(async_hpo.Args(scheduler=scheduler, seed=seed), space)
        return [search.suggest().config for _ in range(5)]

    for scheduler in ("random", "bo", "asha"):
        first = configs(scheduler, 0)
        assert first[0] == {"learning_rate": 0.1, "batch_size": 128, "max_epochs": 10}  # the tutorial's start
        assert configs(scheduler, 0) == first
        assert configs(scheduler, 1)[1:] != first[1:]


def test_holdout_validates_on_training_images_unseen_in_training():
    load_split = import_keeping_environment("async_hpo").load_split
    from common import fashion_mnist_dir, load_fashion_mnist
    folder = fashion_mnist_dir(data_root())
    all_train_x, _, test_x, _ = load_fashion_mnist(folder)
    train_x, _, val_x, _ = load_split(folder, True, None, seed=0)
    assert (len(train_x), len(val_x)) == (50_000, 10_000)

    def images(x):
        return Counter(image.tobytes() for image in x.numpy())
    assert images(train_x) + images(val_x) == images(all_train_x)  # a partition of the training set
    assert len(load_split(folder, True, 1000, seed=0)[0]) == 1000
    assert not load_split(folder, True, None, seed=1)[2].equal(val_x)  # the split follows the seed
    assert load_split(folder, False, None, seed=0)[2].equal(test_x)  # default: the 10k test split


def test_a_trial_gets_the_tuners_gpu_not_the_physical_gpu_of_that_index(monkeypatch, tmp_path):
    """Syne Tune numbers the GPUs it sees 0..n-1; under a scheduler that gave the tuner GPUs 5 and 7 (or UUIDs,
    or MIG instances), trial GPU i must be entry i of the tuner's own CUDA_VISIBLE_DEVICES."""
    async_hpo = import_keeping_environment("async_hpo")
    monkeypatch.setattr(async_hpo, "cuda_device_count", lambda: 2)
    for visible, expected in (("5,7", ["5", "7", "5"]), ("GPU-aa1,MIG-bb2", ["GPU-aa1", "MIG-bb2", "GPU-aa1"]),
                              (None, ["0", "1", "0"])):
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        backend = async_hpo.TrialProcesses(entry_point=str(REPO / "async_hpo.py"), rotate_gpus=True)
        backend._prepare_for_schedule()
        given = []
        for trial_id in range(3):  # a third trial shares a GPU with one of the first two
            env = dict(os.environ)
            backend._allocate_gpu(trial_id, env)
            given.append(env["CUDA_VISIBLE_DEVICES"])
        assert given[:2] == expected[:2] and given[2] in expected[:2], (visible, given)


@needs_gpus(1)
def test_cuda_trials_run_on_gpus(tmp_path, data_dir_args):
    """Two trials at once (on a one-GPU machine, two processes sharing it). Where each ran is what the trial
    itself reported."""
    proc = start_search(*data_dir_args, *QUICK, "--max-epochs", "1", "--max-trials", "2", "--cuda",
                        "--results-dir", tmp_path)
    code, out, err = finish(proc, 300)
    assert code == 0, err
    result = last_json(out)
    devices = [trial["device"] for trial in result["trials"] if trial["status"] == "completed"]
    assert len(devices) >= 2 and all(device.startswith("cuda:") and "GPU-" in device for device in devices), devices
    assert result["best_validation_error"] < 0.8, result
