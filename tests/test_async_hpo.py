"""async_hpo.py: tiny searches (2,000 training images, 1-2 epochs, ended by --max-trials so that a loaded machine
makes them slower, not different) run as subprocesses; the tests read the final JSON line, the console's event lines
and the results folder the way a user would."""

import contextlib
import gzip
import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import psutil
import pytest

from conftest import (
    OFFLINE,
    REPO,
    as_a_shells_job,
    assert_all_ended,
    assert_help_lists_every_flag,
    assert_usage_error,
    data_folder,
    first_visible_gpu,
    free_port,
    last_json,
    needs_gpus,
    start_script,
    tree,
)

TRIAL_FLAG = "--st_config_json_filename"


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
# What QUICK's runs reach, measured here: the tutorial's first configuration (lr 0.1, batch 128), trial 0 of every
# search, with the same initial parameters and data order in every run (all seeded), errs 0.620 on the 10,000 test
# images after one epoch and 0.511 after two; 2 torch threads instead of 1 moved the third decimal only (0.508).
# D2L 5.6's DropoutMLP, trial 0 of --model mlp, errs 0.587 after one epoch. Ten classes make 0.9 chance, which is also
# what a network that learns nothing scores (the tutorial's sigmoid LeNet, slower to start, after one such epoch:
# 0.900). Each bound is the measured error plus 0.08, room for other torch versions' rounding; a run that gains less
# than about 70% of the measured gain over chance fails it. A search's best error is at most its trial 0's.
BEST_AFTER_ONE_EPOCH = 0.70  # measured 0.620
BEST_AFTER_TWO_EPOCHS = 0.59  # measured 0.511
BEST_MLP_AFTER_ONE_EPOCH = 0.67  # measured 0.587


def trial_threads(n_workers):
    """The torch threads of a trial without --trial-threads: this machine's usable CPUs // --n-workers, at least 1."""
    return max(1, len(os.sched_getaffinity(0)) // n_workers)


def assert_trials_ran_with_threads(result, threads):
    """Every trial that reported ran with `threads` torch threads, as it said itself (torch.get_num_threads() in the
    trial, its row's "threads"). Syne Tune starts each trial with OMP_NUM_THREADS=1, so torch's own default there is
    1: wherever `threads` is more, a trial that does not set its threads fails this."""
    reported = [row for row in result["trials"] if row["epochs"] >= 1]
    assert reported and [row["threads"] for row in reported] == [threads] * len(reported), result["trials"]


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


def wait_for(condition, timeout, what, every=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def started(results_dir, count):
    """The first `count` trials have started and tied themselves to the tuner (their first line, printed after
    die_with_parent, is in their std.out)."""
    return all("[trial-info]: " in path.read_text() for path in Path(results_dir).glob("*/[0-9]*/std.out")) and \
        len(list(Path(results_dir).glob("*/[0-9]*/std.out"))) >= count


def trial_info(results_dir, trial_id):
    """What trial trial_id says of itself in its first line (device, host, pid, threads), once that is in its std.out
    (printed after die_with_parent, before it reads its data); else None."""
    for path in Path(results_dir).glob(f"*/{trial_id}/std.out"):
        for line in path.read_text().split("\n")[:-1]:  # whole lines only
            if line.startswith("[trial-info]: "):
                return json.loads(line[len("[trial-info]: "):])
    return None


def read_as_it_comes(proc):
    """proc's stdout read in a thread as it comes: a list of (time.monotonic() it arrived, line), and the thread."""
    lines = []

    def read():
        for line in proc.stdout:
            lines.append((time.monotonic(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return lines, reader


def arrival(lines, text):
    """When the first line containing text arrived (read_as_it_comes)."""
    return next(at for at, line in lines if text in line)


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


def events(out):
    """{event: sorted trial ids} from Syne Tune's console lines ("... Trial 3 completed!")."""
    found = {}
    for trial, event in re.findall(r"\bTrial (\d+) (started|completed|failed)", out):
        found.setdefault(event, []).append(int(trial))
    return {event: sorted(trials) for event, trials in found.items()}


def assert_every_event_once(out, result):
    """Every trial of the JSON's table started once and each failed one failed once, as Syne Tune's lines say; a
    trial Syne Tune says completed is completed in the table; and the counts agree."""
    found = events(out)
    rows = {row["trial"]: row["status"] for row in result["trials"]}
    assert found["started"] == sorted(rows), (found, rows)
    assert found.get("failed", []) == sorted(trial for trial, how in rows.items() if how == "failed"), (found, rows)
    assert set(found.get("completed", [])) <= {trial for trial, how in rows.items() if how == "completed"}, found
    assert result["trials_started"] == len(rows)
    assert result["trials_finished"] == sum(how != "cut off" for how in rows.values())


def test_help_lists_every_flag(capsys):
    assert_help_lists_every_flag(import_keeping_environment("async_hpo"), capsys)


def test_random_search_goes_on_after_a_crashed_and_a_raising_trial(tmp_path, data_dir_args):
    """The tutorial's search: first trial lr 0.1 / batch 128; trial 1 is killed (as the OOM killer would) and trial 2
    raises (out of memory: its address space is held to about what it has when it starts, so its data do not fit);
    both are recorded as failed while the search goes on and completes trial 3; exactly --max-trials trials start
    (the later ones as workers free up), and the two that complete run every epoch; each event is printed once;
    results, figures and utilisation are reported."""
    proc = start_search(*data_dir_args, *QUICK, "--max-epochs", "2", "--max-trials", "4", "--max-failures", "2",
                        "--results-dir", tmp_path)
    try:
        for process in wait_for(lambda: trial_processes(tmp_path, 1), 60, "trial 1 to start"):
            process.send_signal(signal.SIGKILL)
        # As soon as it says it started (every 20 ms: reading its data takes longer), before it holds its data: 16 MiB
        # more than it holds now, room for the error's own handling, but not for the data
        raising = psutil.Process(wait_for(lambda: trial_info(tmp_path, 2), 120, "trial 2 to start", every=0.02)["pid"])
        limit = raising.memory_info().vms + 16 * 2**20
        resource.prlimit(raising.pid, resource.RLIMIT_AS, (limit, limit))
    finally:
        code, out, err = finish(proc, 480)
    assert code == 0, err
    result = last_json(out)
    statuses = {row["trial"]: row["status"] for row in result["trials"]}
    assert statuses == {0: "completed", 1: "failed", 2: "failed", 3: "completed"}, out
    trial_2_log = next(tmp_path.glob("*/2/std.err")).read_text()
    assert "memory" in trial_2_log.lower(), trial_2_log  # what it raised
    assert (result["trials_started"], result["trials_failed"], result["trials_completed"]) == (4, 2, 2), out
    assert_every_event_once(out, result)
    assert [row["epochs"] for row in result["trials"] if row["status"] == "completed"] == [2, 2], result["trials"]
    assert sorted(path.name for path in Path(result["results_dir"], result["experiment"]).iterdir() if
                  path.is_dir()) == ["0", "1", "2", "3"]
    assert result["best_validation_error"] < BEST_AFTER_TWO_EPOCHS, result
    assert 0.01 <= result["best_config"]["learning_rate"] <= 1 and 32 <= result["best_config"]["batch_size"] <= 256
    best = min((row for row in result["trials"] if row["best_err"] is not None), key=lambda row: row["best_err"])
    assert result["best_config"] == {"learning_rate": best["learning_rate"], "batch_size": best["batch_size"]}
    assert 0.2 < result["utilisation"] <= 1.0, result
    results = experiment_results(result)
    first = results[results.trial_id == 0]
    assert (first.config_learning_rate.iloc[0], first.config_batch_size.iloc[0]) == (0.1, 128)
    assert list(first.epoch) == [1, 2]
    assert (results.config_threads == trial_threads(2)).all()  # what the tuner asked for ...
    assert_trials_ran_with_threads(result, trial_threads(2))  # ... and what the trials ran with
    assert set(results.trial_id) == {0, 3}  # trial 3 started after both failures and reported
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
    assert code == 1 and "Traceback" not in err, (code, err)
    assert err.strip().splitlines()[-1] == (f"async_hpo.py: error: 1 trials failed, more than --max-failures 0: the "
                                            f"search stopped (the first, trial 0: no error output; the trials' logs: "
                                            f"{next(tmp_path.glob('*/0')).parent})")
    assert "Trial 0 failed" in out and "STDERR:" in out  # Syne Tune shows its log
    assert not trial_processes(tmp_path)


def test_a_results_folder_with_spaces_and_accents_works_and_failed_trials_say_why(tmp_path, data_dir_args):
    """--results-dir as users type it: a space (Syne Tune's local backend splits its trial command at spaces) and
    non-ASCII letters. The trial completes. Then the same folder with data that every trial fails to read: the error
    says the trials failed and shows the first one's last line, not "give it more time"."""
    results = tmp_path / "my results é"
    code, out, err = finish(start_search(*data_dir_args, *QUICK, "--max-epochs", "1", "--max-trials", "1",
                                         "--results-dir", results), 240)
    assert code == 0, err
    result = last_json(out)
    assert [row["status"] for row in result["trials"]] == ["completed"] and result["results_dir"] == str(results)
    data = Path(data_dir_args[1])
    data = data if (data / "train-images-idx3-ubyte.gz").exists() else data / "fashion-mnist"
    broken = tmp_path / "broken data ü"
    shutil.copytree(data, broken)
    results = tmp_path / "other results ü"
    # offline: a trial that finds no data where the tuner had them falls back to the download cache
    proc = subprocess.Popen([sys.executable, REPO / "async_hpo.py", "--data-dir", broken, *QUICK, "--max-epochs", "1",
                             "--max-trials", "2", "--results-dir", results], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **OFFLINE})
    # the tuner checks the data before any trial starts; the trials read them again, after they are gone
    wait_for(lambda: list(results.glob("*/0/config.json")) or None, 120, "trial 0 to be scheduled")
    shutil.rmtree(broken)
    code, out, err = finish(proc, 240)
    assert code == 1 and "Traceback" not in err.strip().splitlines()[-1], err
    assert re.fullmatch(r"async_hpo\.py: error: no trial reported a result, and 2 failed \(the first, trial 0: "
                        r"async_hpo\.py: error: cannot download train-images-idx3-ubyte\.gz .*; the trials' logs: "
                        + re.escape(str(results)) + r"/.*\)", err.strip().splitlines()[-1]), err


def test_the_budget_still_ends_a_search_with_max_trials(tmp_path, data_dir_args):
    """--max-wallclock-time is a hard budget: trials far from done are cut off at it (and say so, once each)."""
    # time for the trials to start and report (7-13 epochs each in 20 s here; with 12 s, a machine loaded by another
    # run of the suite once saw none report), far from their 1000 epochs
    budget = 20
    proc = start_search(*data_dir_args, "--limit-train", "500", "--activation", "relu", "--max-wallclock-time", budget,
                        "--max-epochs", "1000", "--max-trials", "3", "--results-dir", tmp_path)
    code, out, err = finish(proc, 300)
    assert code == 0, err
    result = last_json(out)
    # the tuner checks the budget at every look (each 0.1 s, plus reading the trials' output): 3 s is room for looks
    # slowed by a loaded machine (measured here: 20.0-20.1 s for 20)
    assert budget <= result["wall_time_s"] < budget + 3, result["wall_time_s"]
    assert [row["status"] for row in result["trials"]] == ["cut off", "cut off"], out
    assert all(row["epochs"] >= 1 for row in result["trials"])
    assert_every_event_once(out, result)
    assert not trial_processes(tmp_path)


def test_sync_bo_starts_a_batch_only_after_the_previous_one_finished(tmp_path, data_dir_args):
    proc = start_search(*data_dir_args, *QUICK, "--max-epochs", "1", "--max-trials", "4", "--sync",
                        "--scheduler", "bo", "--results-dir", tmp_path)
    code, out, err = finish(proc, 480)
    assert code == 0, err
    result = last_json(out)
    assert result["sync"] is True and result["scheduler"] == "bo"
    assert (result["trials_started"], result["trials_completed"]) == (4, 4), result
    assert result["best_validation_error"] < BEST_AFTER_ONE_EPOCH, result
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
    assert [(row["status"], row["epochs"]) for row in result["trials"]] == [("completed", 2), ("stopped early", 1)]
    assert_every_event_once(out, result)
    assert result["best_validation_error"] < BEST_AFTER_TWO_EPOCHS, result  # trial 0 ran both epochs
    # without --trial-threads: 2 here (this machine's 2 CPUs, one worker), where a trial that set no threads would run
    # with 1 (Syne Tune starts trials with OMP_NUM_THREADS=1)
    assert_trials_ran_with_threads(result, trial_threads(1))
    results = experiment_results(result)
    assert list(results[results.trial_id == 0].epoch) == [1, 2]
    assert list(results[results.trial_id == 1].epoch) == [1]
    assert list(results[results.trial_id == 1].st_decision) == ["STOP"]
    assert (Path(result["results_dir"], result["experiment"], "1", "stop")).exists()  # the backend's own mark


def test_sigterm_stops_the_tuner_and_every_trial(tmp_path, data_dir_args):
    """SIGTERM (a job scheduler's stop) ends the tuner where it stands, and the kernel ends each trial with it
    (trial_main: PR_SET_PDEATHSIG), as it would after a SIGKILL."""
    proc = start_search(*data_dir_args, *QUICK, "--max-epochs", "2", "--results-dir", tmp_path)
    try:
        wait_for(lambda: started(tmp_path, 2), 60, "two trials to start")
        trials = trial_processes(tmp_path)
        proc.send_signal(signal.SIGTERM)
    finally:
        code, out, err = finish(proc, 60)
    assert code == -signal.SIGTERM, (code, err)
    assert_all_ended(trials, timeout=5)
    assert not trial_processes(tmp_path)
    (experiment,) = [path for path in tmp_path.iterdir() if path.is_dir()]
    assert (experiment / "metadata.json").is_file() and (experiment / "0" / "std.out").is_file()


def test_ctrl_c_stops_the_search_and_every_trial(tmp_path, data_dir_args):
    """Ctrl-C in a terminal is SIGINT to the whole foreground process group, the tuner and its trials: the search
    ends with its one line and exit status 130, and no process of the search is left."""
    proc = subprocess.Popen([sys.executable, REPO / "async_hpo.py", *data_dir_args, *QUICK, "--max-epochs", "2",
                             "--results-dir", tmp_path], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=as_a_shells_job)
    try:
        wait_for(lambda: started(tmp_path, 2), 60, "two trials to start")
        trials = trial_processes(tmp_path)
        group = psutil.Process(proc.pid).children(recursive=True)  # the trials, and whatever else it started
        os.killpg(proc.pid, signal.SIGINT)
    finally:
        code, out, err = finish(proc, 60)
    assert code == 130, (code, err)
    assert err.strip().splitlines()[-1] == "async_hpo.py: interrupted; every process was stopped", err
    assert len(trials) == 2 and set(trials) <= set(group)
    assert_all_ended(group, timeout=5)
    assert not trial_processes(tmp_path)
    (experiment,) = [path for path in tmp_path.iterdir() if path.is_dir()]
    assert (experiment / "metadata.json").is_file() and (experiment / "0" / "std.out").is_file()


# ---------------------------------------------------------------------------------------------------------
# Bad input: one line, exit status 2, before anything is written
# ---------------------------------------------------------------------------------------------------------

BAD_INPUT = [  # (what, flags, words the one line must hold); {tmp}: a fresh folder, {file}: a file in it
    # numbers out of range, or not numbers: argparse's own line
    ("no workers", ["--n-workers", "0"], ["argument --n-workers: '0' is not a whole number, 1 or more"]),
    ("workers not a whole number", ["--n-workers", "1.5"], ["argument --n-workers: '1.5'"]),
    ("zero budget", ["--max-wallclock-time", "0"], ["argument --max-wallclock-time: '0' is not a positive number"]),
    ("NaN budget", ["--max-wallclock-time", "nan"], ["argument --max-wallclock-time: 'nan'"]),
    ("infinite budget", ["--max-wallclock-time", "inf"], ["argument --max-wallclock-time: 'inf'"]),
    ("budget with a unit", ["--max-wallclock-time", "10m"], ["argument --max-wallclock-time: '10m'"]),
    ("no trials", ["--max-trials", "0"], ["argument --max-trials: '0'"]),
    ("fractional epochs", ["--max-epochs", "1.5"], ["argument --max-epochs: '1.5'"]),
    ("seed of 2**32", ["--seed", "4294967296"], ["argument --seed: '4294967296' is not a seed"]),
    ("negative failures", ["--max-failures", "-1"], ["argument --max-failures: '-1' is not a whole number, 0 or more"]),
    ("zero trial threads", ["--trial-threads", "0"], ["argument --trial-threads: '0'"]),
    # choices and flags that do not go together
    ("unknown scheduler", ["--scheduler", "hyperband"], ["--scheduler", "invalid choice"]),
    ("unknown model", ["--model", "resnet"], ["--model", "invalid choice"]),
    ("unknown flag", ["--max-trial", "3", "--workers", "2"], ["unrecognized arguments"]),
    ("results folder that cannot be created", ["--results-dir", "{file}/results"], ["--results-dir", "cannot create "
                                                                                     "this folder (Not a directory)"]),
    # values another library accepts
    ("empty Ray address", ["--ray-address", ""], ["--ray-address ''"]),
    ("Ray's own local cluster", ["--ray-address", "local"], ["--ray-address 'local'", "HOST:PORT"]),
    ("a Ray Client address", ["--ray-address", "ray://127.0.0.1:10001"], ["--ray-address 'ray://127.0.0.1:10001'"]),
    ("a Ray port out of range", ["--ray-address", "127.0.0.1:99999"], ["--ray-address 127.0.0.1:99999", "ray start"]),
    ("a Ray address without a port", ["--ray-address", "127.0.0.1"], ["--ray-address 127.0.0.1", "ray start"]),
    ("a Ray port nothing listens on", ["--ray-address", "127.0.0.1:{port}"], ["nothing answers", "ray start"]),
    # data that is missing or damaged
    ("data folder without the data, offline", ["--data-dir", "{tmp}/empty"], ["cannot download", "--data-dir"]),
    ("truncated data file", ["--data-dir", "{tmp}/truncated"], ["train-images-idx3-ubyte.gz is corrupt"]),
    ("data file that is not gzip", ["--data-dir", "{tmp}/garbage"], ["train-labels-idx1-ubyte.gz is corrupt"]),
    ("data file with other contents", ["--data-dir", "{tmp}/other"], ["t10k-labels-idx1-ubyte.gz is corrupt"]),
    ("folder where a data file belongs", ["--data-dir", "{tmp}/folder-for-file"],
     ["t10k-images-idx3-ubyte.gz", "--data-dir"]),
]


def bad_input_folder(folder, data):
    """The files and folders the BAD_INPUT cases name: data folders with one damaged file each (the others are
    links to the real data in `data`), a plain file and an empty folder."""
    from common import FASHION_MNIST_FILES
    damaged = {"truncated": ("train-images-idx3-ubyte.gz", (data / "train-images-idx3-ubyte.gz").read_bytes()[:2000]),
               "garbage": ("train-labels-idx1-ubyte.gz", b"not gzip at all"),
               "other": ("t10k-labels-idx1-ubyte.gz", gzip.compress(b"\0" * 10_008)),
               "folder-for-file": ("t10k-images-idx3-ubyte.gz", None)}
    for name, (bad_file, contents) in damaged.items():
        (folder / name).mkdir()
        for file in FASHION_MNIST_FILES:
            if file != bad_file:
                (folder / name / file).symlink_to(data / file)
        if contents is None:
            (folder / name / bad_file).mkdir()
        else:
            (folder / name / bad_file).write_bytes(contents)
    (folder / "file").write_text("not a folder")
    (folder / "empty").mkdir()


@pytest.mark.parametrize("what, args, fragments", BAD_INPUT, ids=[case[0] for case in BAD_INPUT])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(what, args, fragments, monkeypatch, capsys, tmp_path):
    """In this process through main() (which checks flags, data and the Ray address before a trial starts), to save
    a torch import per case; a case that got past the checks would reach run_search, which fails the test. Nothing is
    written but the results folder (no download, no data file touched), and Ray is never imported."""
    data = Path(data_folder())
    bad_input_folder(tmp_path, data)
    args = [arg.format(tmp=tmp_path, file=tmp_path / "file", port=free_port()) for arg in args]
    defaults = {"--results-dir": str(tmp_path / "results"), "--data-dir": str(data)}
    argv = [*args, *(part for flag, value in defaults.items() if flag not in args for part in (flag, value))]
    before = tree(tmp_path)
    async_hpo = import_keeping_environment("async_hpo")
    from common import run_main
    monkeypatch.setattr(sys, "argv", ["async_hpo.py", *argv])
    monkeypatch.setattr(async_hpo, "run_search", lambda *_, **__: pytest.fail("a search started"))
    for name, value in OFFLINE.items():  # a download fails at once, as without a network
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(urllib.request, "_opener", None)  # urlopen builds its opener (and proxies) anew
    ray_before = "ray" in sys.modules
    with pytest.raises(SystemExit) as exit_info:
        run_main(async_hpo.main)
    captured = capsys.readouterr()
    assert_usage_error(subprocess.CompletedProcess(argv, exit_info.value.code, captured.out, captured.err), *fragments)
    assert captured.out == "" and "Traceback" not in captured.err
    assert {path for path in tree(tmp_path) if path.name != "results"} == set(before)
    assert ("ray" in sys.modules) == ray_before


def test_no_cuda_device_is_one_line_exit_2(monkeypatch, capsys, tmp_path):
    async_hpo = import_keeping_environment("async_hpo")
    import torch

    import common
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 0)
    monkeypatch.setattr(sys, "argv", ["async_hpo.py", "--cuda", "--results-dir", str(tmp_path / "results")])
    with pytest.raises(SystemExit) as exit_info:
        common.run_main(async_hpo.main)
    captured = capsys.readouterr()
    assert_usage_error(subprocess.CompletedProcess([], exit_info.value.code, captured.out, captured.err), "--cuda")
    assert not (tmp_path / "results").exists()


def test_seed_fixes_the_sequence_of_configurations():
    async_hpo = import_keeping_environment("async_hpo")
    from syne_tune.config_space import loguniform, randint
    space = {"learning_rate": loguniform(1e-2, 1), "batch_size": randint(32, 256), "max_epochs": 10}

    def configs(scheduler, seed):
        search = async_hpo.make_scheduler(async_hpo.Args(scheduler=scheduler, seed=seed), space)
        return [search.suggest().config for _ in range(5)]

    for scheduler in ("random", "bo", "gp", "asha", "local"):
        first = configs(scheduler, 0)
        assert first[0] == {"learning_rate": 0.1, "batch_size": 128, "max_epochs": 10}  # the tutorial's start
        assert configs(scheduler, 0) == first
        assert configs(scheduler, 1)[1:] != first[1:]


def test_max_trials_makes_the_scheduler_propose_that_many():
    """--max-trials: the scheduler proposes N configurations, then None, Syne Tune's "nothing left to try"."""
    async_hpo = import_keeping_environment("async_hpo")
    space = async_hpo.make_config_space(async_hpo.Args(), "data")
    for name in ("random", "bo", "asha", "local"):
        scheduler = async_hpo.make_scheduler(async_hpo.Args(scheduler=name), space)
        scheduler.searcher = async_hpo.AtMost(scheduler.searcher, 3)
        assert [scheduler.suggest() is not None for _ in range(5)] == [True, True, True, False, False], name


def test_holdout_validates_on_training_images_unseen_in_training():
    load_split = import_keeping_environment("async_hpo").load_split
    from common import load_fashion_mnist
    folder = data_folder()
    all_train_x, _, test_x, _ = load_fashion_mnist(folder)
    train_x, _, val_x, _ = load_split(folder, True, None, seed=0)
    assert (len(train_x), len(val_x)) == (50_000, 10_000)

    def images(x):
        return Counter(image.tobytes() for image in x.numpy())
    assert images(train_x) + images(val_x) == images(all_train_x)  # a partition of the training set
    assert len(load_split(folder, True, 1000, seed=0)[0]) == 1000
    assert not load_split(folder, True, None, seed=1)[2].equal(val_x)  # the split follows the seed
    assert load_split(folder, False, None, seed=0)[2].equal(test_x)  # default: the 10k test split


# ---------------------------------------------------------------------------------------------------------
# The tutorial's exercises: DropoutMLP, Gaussian-process BO, local search
# ---------------------------------------------------------------------------------------------------------

def report(scheduler, trial_id, config, error):
    """What Syne Tune's tuner does with a trial's report: tell the scheduler (and through it the searcher)."""
    from syne_tune.backend.trial_status import Trial
    trial = Trial(trial_id=trial_id, config=config, creation_time=None)
    scheduler.on_trial_result(trial, {"epoch": 1, "validation_error": error})
    scheduler.on_trial_complete(trial, {"epoch": 1, "validation_error": error})


def test_local_searcher_samples_around_the_incumbent():
    """Through the Syne Tune scheduler that --scheduler local builds: random configurations until a trial
    reports, then steps of about 10% of each range around the best configuration reported so far."""
    async_hpo = import_keeping_environment("async_hpo")
    import numpy as np
    space = {**async_hpo.make_config_space(async_hpo.Args(), "data"), **async_hpo.MLP_SPACE}
    scheduler = async_hpo.make_scheduler(async_hpo.Args(model="mlp", scheduler="local", seed=0), space)

    def suggestions(count):
        return [scheduler.suggest().config for _ in range(count)]

    def log_lr(configs):
        return np.log([config["learning_rate"] for config in configs])

    first = scheduler.suggest().config
    assert {name: first[name] for name in async_hpo.MLP_INITIAL_CONFIG} == async_hpo.MLP_INITIAL_CONFIG
    random = suggestions(300)  # nobody has reported yet: the whole space
    assert np.std(log_lr(random)) > 1.1  # uniform over log(0.01)..log(1): 1.33
    worse, best, later_worse = random[:3]
    report(scheduler, 1, worse, 0.5)
    report(scheduler, 2, best, 0.3)
    report(scheduler, 3, later_worse, 0.4)  # reported last, but not better
    near = suggestions(300)
    step = 0.1 * math.log(100)  # 10% of the log range of the learning rate
    assert abs(np.median(log_lr(near)) - math.log(best["learning_rate"])) < step / 2
    assert 0.7 * step < np.std(log_lr(near)) < 1.3 * step or best["learning_rate"] in (0.01, 1.0)
    from syne_tune.config_space import Domain
    for name, domain in ((name, domain) for name, domain in space.items() if isinstance(domain, Domain)):
        values = np.array([config[name] for config in near])
        assert ((domain.lower <= values) & (values <= domain.upper)).all(), name
        assert abs(np.median(values) - best[name]) <= 0.1 * (domain.upper - domain.lower), (name, best[name])
        assert all(type(config[name]) is type(best[name]) for config in near), name  # int stays int
    report(scheduler, 4, near[0], 0.1)  # a better one: the search moves there
    moved = suggestions(100)
    assert abs(np.median(log_lr(moved)) - math.log(near[0]["learning_rate"])) < step / 2


def test_gp_scheduler_fits_its_model_and_closes_in_on_the_minimum(caplog):
    """--scheduler gp is Syne Tune's BOTorch searcher: after 3 observations (the first configuration and two
    random ones) it proposes the maximum of expected improvement under a GP fitted to them. It falls back to a
    random configuration (with a warning) whenever botorch fails, so the test checks that it never did, and that
    its proposals close in on the minimum of a smooth objective, where random ones average about 0.7."""
    async_hpo = import_keeping_environment("async_hpo")
    space = async_hpo.make_config_space(async_hpo.Args(), "data")
    scheduler = async_hpo.make_scheduler(async_hpo.Args(scheduler="gp", seed=0), space)

    def objective(config):  # smallest at learning rate 10**-0.5, batch 100
        return (math.log10(config["learning_rate"]) + 0.5) ** 2 + ((config["batch_size"] - 100) / 224) ** 2

    errors = []
    with caplog.at_level("WARNING"):
        for trial_id in range(8):
            config = scheduler.suggest().config
            errors.append(objective(config))
            report(scheduler, trial_id, config, errors[-1])
    assert not [record for record in caplog.records if "sampling randomly" in record.getMessage()]
    proposed = errors[3:]
    assert min(proposed) < 0.05 and sum(proposed[-3:]) / 3 < 0.2, errors


def test_dropout_mlp_local_search_from_a_copied_folder(tmp_path, data_dir_args):
    """The script and common.py alone in an empty folder (what a user copies) search DropoutMLP locally. One
    worker: trial 1 is proposed after trial 0 (the tutorial's configuration) has reported, so it is the local
    searcher's step from trial 0, exactly as the seeded searcher draws it here. --trial-threads 1 reaches the trials,
    where one worker gives them this machine's 2 CPUs by default (test_asha_stops_bad_trials_early: 2 threads, where
    a trial that sets none runs with Syne Tune's OMP_NUM_THREADS=1)."""
    for name in ("async_hpo.py", "common.py"):
        shutil.copy(REPO / name, tmp_path)
    proc = subprocess.Popen([sys.executable, "async_hpo.py", *data_dir_args, "--model", "mlp", "--scheduler", "local",
                             "--n-workers", "1", "--limit-train", "2000", "--max-epochs", "1", "--max-trials", "2",
                             "--trial-threads", "1", "--max-wallclock-time", "400"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    code, out, err = finish(proc, 480)
    assert code == 0, err
    result = last_json(out)
    assert Path(result["results_dir"]) == tmp_path / "runs" / "async_hpo"  # the default, beside the copy
    trials = {row["trial"]: row for row in result["trials"]}
    assert (result["model"], result["scheduler"], trials[1]["status"]) == ("mlp", "local", "completed"), out
    async_hpo = import_keeping_environment("async_hpo")
    first = async_hpo.MLP_INITIAL_CONFIG
    assert {name: trials[0][name] for name in first} == first
    assert set(result["best_config"]) == set(first), result
    assert result["best_validation_error"] < BEST_MLP_AFTER_ONE_EPOCH, result
    assert_trials_ran_with_threads(result, 1)
    space = {**async_hpo.make_config_space(async_hpo.Args(), "data"), **async_hpo.MLP_SPACE}
    scheduler = async_hpo.make_scheduler(async_hpo.Args(model="mlp", scheduler="local"), space)
    report(scheduler, 0, scheduler.suggest().config, trials[0]["val_err"])
    step = scheduler.suggest().config
    assert {name: trials[1][name] for name in first} == pytest.approx({name: step[name] for name in first})
    assert trials[1]["learning_rate"] != first["learning_rate"]


def test_gp_search_proposes_from_its_model(tmp_path, data_dir_args):
    """One worker, four trials: the fourth proposal comes once three trials have finished, from the GP (botorch did
    not fail, which would fall back to a random proposal and say so). Nothing on stderr: no warning a user cannot act
    on (torch 2.15's FutureWarning for torch.jit.script, which botorch's linear_operator calls, is filtered)."""
    proc = start_search(*data_dir_args, *QUICK, "--scheduler", "gp", "--max-epochs", "1", "--max-trials", "4",
                        "--n-workers", "1", "--results-dir", tmp_path)
    code, out, err = finish(proc, 480)
    assert code == 0 and err == "", err
    result = last_json(out)
    assert result["scheduler"] == "gp" and (result["trials_started"], result["trials_completed"]) == (4, 4), out
    assert result["best_validation_error"] < BEST_AFTER_ONE_EPOCH, result
    assert_trials_ran_with_threads(result, trial_threads(1))
    assert "Scheduler: BOTorch" in out and "sampling randomly" not in out


# ---------------------------------------------------------------------------------------------------------
# Faults: a stopped trial, a killed tuner, results that cannot be written
# ---------------------------------------------------------------------------------------------------------

def test_a_killed_tuner_takes_its_trials_with_it(tmp_path, data_dir_args):
    """(And --trial-threads reaches the trials: each says so in its first line, torch.get_num_threads() in it.)"""
    proc = start_search(*data_dir_args, *QUICK, "--max-epochs", "3", "--trial-threads", "3", "--results-dir", tmp_path)
    try:
        wait_for(lambda: started(tmp_path, 2), 60, "two trials to start")
        trials = trial_processes(tmp_path)
        assert len(trials) == 2
        proc.kill()
    finally:
        finish(proc, 30)
    assert_all_ended(trials, timeout=5)
    said = [trial_info(tmp_path, trial_id) for trial_id in (0, 1)]
    assert sorted(info["pid"] for info in said) == sorted(trial.pid for trial in trials), said
    assert [info["threads"] for info in said] == [3, 3], said


def test_results_that_cannot_be_written_end_the_run_and_keep_what_was_written(tmp_path, data_dir_args):
    """The disk fills up mid-search (a file-size limit on the tuner of the results file's size, which the file's next
    write, with more rows, exceeds; a fixed limit would let a few rows more still fit, zipped, in a slow run): the
    tuner ends with Python's error, exit status 1, no trial left, and results.csv.zip as last written loads, with no
    partial file beside it."""
    proc = start_search(*data_dir_args, *QUICK, "--max-epochs", "1", "--results-dir", tmp_path)
    try:
        results = wait_for(lambda: next(tmp_path.glob("*/results.csv.zip"), None), 120, "the first results")
        written = results.read_bytes()
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (len(written), len(written)))
    finally:
        code, out, err = finish(proc, 120)
    assert code == 1 and err.strip().splitlines()[-1] == "OSError: [Errno 27] File too large", err
    wait_for(lambda: not trial_processes(tmp_path), 10, "the trials to end with the tuner")  # (die_with_parent)
    import io

    import pandas as pd
    experiment = import_keeping_environment("syne_tune.experiments").load_experiment(
        results.parent.name, local_path=str(tmp_path))
    assert len(experiment.results) >= len(pd.read_csv(io.BytesIO(written), compression="zip")) >= 1
    assert not list(results.parent.glob(".results.csv.zip.*"))  # no partial file left beside it


def test_figures_that_cannot_be_written_keep_the_previous_ones(tmp_path):
    """plot_figures writes each PNG through common.save_figure: under a file-size limit (a full disk) Python's error,
    and the figures written before are whole."""
    async_hpo = import_keeping_environment("async_hpo")
    import pandas as pd
    results = pd.DataFrame({"trial_id": [0, 0, 1], "st_tuner_time": [1.0, 2.0, 3.0],
                            "validation_error": [0.5, 0.3, 0.4]})
    figures = async_hpo.plot_figures(results, tmp_path)
    written = {name: path.read_bytes() for name, path in figures.items()}
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, limits[1]))
    try:
        with pytest.raises(OSError, match="File too large"):
            async_hpo.plot_figures(results.assign(validation_error=[0.6, 0.2, 0.1]), tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert {name: path.read_bytes() for name, path in figures.items()} == written
    assert sorted(path.name for path in tmp_path.iterdir()) == ["incumbent.png", "learning_curves.png"]


def test_each_trial_gets_the_gpu_fewest_running_trials_use(monkeypatch, tmp_path):
    """As an index among the GPUs the tuner sees (the trial sees the same ones): with 2 GPUs, two running trials
    get one each; the third, once the first has ended, gets the first's GPU."""
    async_hpo = import_keeping_environment("async_hpo")
    import torch
    from syne_tune.backend import LocalBackend

    class Process:
        def __init__(self):
            self.running = True

        def poll(self):
            return None if self.running else 0

    scheduled = {}

    def schedule(backend, trial_id, config):
        scheduled[trial_id] = config["gpu"]
        backend.trial_subprocess[trial_id] = Process()

    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 2)
    monkeypatch.setattr(LocalBackend, "_schedule", schedule)
    backend = async_hpo.LocalTrials(entry_point=str(REPO / "async_hpo.py"))
    backend._schedule(0, {"device": "cuda"})
    backend._schedule(1, {"device": "cuda"})
    backend.trial_subprocess[0].running = False
    backend._schedule(2, {"device": "cuda"})
    backend._schedule(3, {"device": "cpu"})
    assert scheduled == {0: 0, 1: 1, 2: 0, 3: 0}


@needs_gpus(1)
def test_cuda_trials_run_on_gpus(tmp_path, data_dir_args):
    """Two trials at once, by default (on a one-GPU machine, two processes sharing it, the default --trials-per-gpu).
    Where each ran is what the trial itself reported."""
    proc = start_search(*data_dir_args, *QUICK, "--max-epochs", "1", "--max-trials", "2", "--cuda",
                        "--results-dir", tmp_path)
    code, out, err = finish(proc, 300)
    assert code == 0, err
    result = last_json(out)
    devices = [trial["device"] for trial in result["trials"] if trial["status"] == "completed"]
    assert len(devices) == 2 and all(device.startswith("cuda:") and "GPU-" in device for device in devices), devices
    assert result["best_validation_error"] < BEST_AFTER_ONE_EPOCH, result


def test_trials_per_gpu_is_checked_against_the_gpus_and_places_the_trials(monkeypatch, capsys, tmp_path):
    """Locally, --n-workers trials must fit the GPUs at --trials-per-gpu (one line, exit 2, else), and the backend
    puts each trial on the GPU the fewest running trials use, so that 4 workers on 2 GPUs at 2 per GPU share them
    2 and 2; on Ray each trial reserves 1/N of a GPU, and a node of 1 GPU and 8 CPUs runs 4 of them at once."""
    async_hpo = import_keeping_environment("async_hpo")
    import torch

    import common
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 2)
    for argv, fragment in [(["--cuda", "--n-workers", "5", "--trials-per-gpu", "2"], "--n-workers 5: more trials at "
                            "once than the 2 GPU(s) here hold at --trials-per-gpu 2; pass a larger --trials-per-gpu")]:
        monkeypatch.setattr(sys, "argv", ["async_hpo.py", *argv, "--results-dir", str(tmp_path / "r")])
        with pytest.raises(SystemExit) as exited:
            common.run_main(async_hpo.main)
        stderr = capsys.readouterr().err
        assert exited.value.code == 2 and stderr.count("\n") == 1 and fragment in stderr, stderr
    async_hpo.validate(async_hpo.Args(cuda=True, n_workers=4, trials_per_gpu=2))
    assert async_hpo.cpus_per_trial([(8, 1)], 4, 1 / 4) == 2
    assert async_hpo.cpus_per_trial([(8, 1)], 5, 1 / 4) == 0  # a fifth quarter of the one GPU does not exist

    class Process:
        def poll(self):
            return None  # still running

    from syne_tune.backend import LocalBackend
    placed = []
    monkeypatch.setattr(LocalBackend, "_schedule", lambda backend, trial_id, config: (
        placed.append(config["gpu"]), backend.trial_subprocess.__setitem__(trial_id, Process())))
    backend = async_hpo.LocalTrials(entry_point=str(REPO / "async_hpo.py"))
    for trial_id in range(4):
        backend._schedule(trial_id, {"cuda": True})
    assert sorted(placed) == [0, 0, 1, 1]


@needs_gpus(1)
def test_four_trials_share_one_gpu(tmp_path, data_dir_args):
    """--trials-per-gpu 4 on one GPU: four trials at once, every one on that GPU (as each trial reported it), all
    completed, and running together (the workers busy for most of the search)."""
    flags = [*data_dir_args, *QUICK, "--max-epochs", "2", "--max-trials", "4", "--n-workers", "4", "--cuda",
             "--trials-per-gpu", "4", "--results-dir", tmp_path]
    proc = subprocess.Popen([sys.executable, REPO / "async_hpo.py", *map(str, flags)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": first_visible_gpu()})  # one GPU, even of several
    code, out, err = finish(proc, 300)
    assert code == 0, err
    result = last_json(out)
    devices = {trial["device"] for trial in result["trials"] if trial["status"] == "completed"}
    assert result["trials_completed"] == 4 and len(devices) == 1 and "GPU-" in devices.pop(), result["trials"]
    assert result["utilisation"] > 0.5, result  # one trial at a time would keep 4 workers busy 25 % of the time


def test_ray_is_imported_only_for_ray_address():
    """Local runs and every trial process import this file; none of them pays for importing Ray."""
    code = "import sys, async_hpo; print(sorted(m for m in sys.modules if m.split('.')[0] == 'ray'))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", (proc.stdout, proc.stderr)


@pytest.mark.parametrize("address", ["127.0.0.1:{free_port}", "auto"])
def test_unreachable_ray_address_is_one_line_exit_2(address, tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, str(REPO / "async_hpo.py"), "--ray-address",
                           address.format(free_port=free_port()), "--results-dir", str(tmp_path / "results"),
                           "--data-dir", str(data_folder())],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**env, "RAY_TMPDIR": str(tmp_path)})  # auto: no cluster started here
    assert_usage_error(proc, "--ray-address", "ray start --head")
    assert not (tmp_path / "results").exists()


def test_ray_trials_get_an_equal_share_of_cpus_that_fits_every_trial_on_one_node():
    cpus_per_trial = import_keeping_environment("async_hpo").cpus_per_trial
    assert cpus_per_trial([(1, 0), (1, 0)], 2, 0) == 1
    assert cpus_per_trial([(8, 0), (8, 0)], 4, 0) == 4
    assert cpus_per_trial([(3, 0), (3, 0)], 3, 0) == 1  # 2 each would fit only 2 trials
    assert cpus_per_trial([(16, 0), (4, 0)], 2, 0) == 8
    assert cpus_per_trial([(8, 2), (16, 0)], 2, 1) == 4  # one GPU each: both on the GPU node
    assert cpus_per_trial([(8, 2), (16, 0)], 3, 1) == 0  # 3 trials, 2 GPUs
    assert cpus_per_trial([(2, 0)], 3, 0) == 0


def test_a_trial_on_another_machine_falls_back_to_the_download_cache(monkeypatch, tmp_path):
    """The tuner's --data-dir exists on the tuner's machine only; a trial elsewhere uses (or fills) its cache."""
    async_hpo = import_keeping_environment("async_hpo")
    from common import FASHION_MNIST_FILES
    data = data_folder()
    cache = tmp_path / "cache" / "torch-distributed-patterns" / "fashion-mnist"
    cache.mkdir(parents=True)
    for name in FASHION_MNIST_FILES:
        (cache / name).symlink_to(Path(data) / name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert Path(async_hpo.trial_data_folder(str(data))) == Path(data)
    assert Path(async_hpo.trial_data_folder(str(tmp_path / "only-on-the-head-node"))) == cache


# ---------------------------------------------------------------------------------------------------------
# On a Ray cluster (--ray-address): two `ray start` nodes on this machine, reachable on loopback only
# ---------------------------------------------------------------------------------------------------------

RAY_CLI = Path(sys.executable).with_name("ray")
# Run inside a new user + network namespace: brings its loopback interface up, says where Ray would say this
# machine is, then waits until the test closes its stdin.
NAMESPACE_HOLDER = """
import fcntl, socket, struct, sys
from ray._common.network_utils import node_ip_address_from_perspective  # how Ray picks a node's address
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    flags = struct.unpack("16sH14s", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH14s", b"lo", 0, b"")))[1]
    fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | IFF_UP, b""))
print(node_ip_address_from_perspective(), flush=True)
sys.stdin.read()
"""


class LoopbackRayCluster:
    """A Ray cluster of two nodes with one CPU each, started as `ray start --head` and `ray start --address`
    (the recipe of docs/async_hpo.md) in a network namespace that has nothing but a loopback interface:
    Ray's GCS and raylets listen on every interface there is, and there, loopback is the only one. Commands
    run in the namespace with `in_namespace`. Lives in the pytest process."""

    def __init__(self, folder):
        self.folder = folder
        self.holder = subprocess.Popen(["unshare", "--user", "--map-root-user", "--net", sys.executable, "-c",
                                        NAMESPACE_HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.address = self.holder.stdout.readline().strip()
        self.env = {**os.environ, "RAY_TMPDIR": str(folder),  # `auto` finds this cluster, and only this one
                    "TMPDIR": str(folder),  # each node's temporary folder: what a trial leaves there shows
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.urandom(16).hex(),
                    "RAY_USAGE_STATS_ENABLED": "0",
                    # a dead node is noticed within seconds; a slow start on a loaded machine is not fatal
                    "RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3",
                    "RAY_agent_register_timeout_ms": "120000",
                    # Ray runs its workers, so the trials, at nice 15: beside the other tests (CI runs two at once)
                    # a trial could wait a minute for its first report, and a budget of 20 s cut it off unreported
                    "RAY_worker_niceness": "0"}
        self.head = self.worker = None

    def in_namespace(self, *command):
        return ["nsenter", "--target", str(self.holder.pid), "--user", "--net", "--preserve-credentials",
                *map(str, command)]

    def start_node(self, *args, timeout=120):
        """`ray start ... --block`, returned once it says the node runs; its output is read on, to the end."""
        node = subprocess.Popen(self.in_namespace(RAY_CLI, "start", "--num-cpus", "1", "--block", *args),
                                env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output, started = [], threading.Event()

        def read():
            for line in node.stdout:
                output.append(line)
                if "Ray runtime started" in line:
                    started.set()

        threading.Thread(target=read, daemon=True).start()
        if not started.wait(timeout):
            for process in reversed(self.processes(node)):  # its agents too, which would outlive it
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
            raise AssertionError(f"ray start {' '.join(args)} did not start in {timeout} s:\n{''.join(output)[-3000:]}")
        return node

    def start(self):
        self.head = self.start_node("--head", "--include-dashboard=false", "--disable-usage-stats")
        self.ensure_worker_node()

    def ensure_worker_node(self):
        if self.worker is None or self.worker.poll() is not None:
            self.worker = self.start_node("--address", "127.0.0.1:6379")

    def processes(self, node):
        """The node's processes: its `ray start`, the raylet and Ray's agents, the Ray workers, their trials."""
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(node.pid)
            return [root, *root.children(recursive=True)]
        return []

    def kill_worker_node(self):
        """What a machine that dies does to its Ray node: every process of it ends at once."""
        for process in self.processes(self.worker):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        self.worker.wait(10)

    def stop(self):
        for node in (self.worker, self.head):
            if node is not None and node.poll() is None:
                node.terminate()  # `ray start --block` stops its node's processes on SIGTERM
                with contextlib.suppress(subprocess.TimeoutExpired):
                    node.wait(30)
            for process in self.processes(node) if node is not None else []:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
        self.holder.stdin.close()
        self.holder.wait(10)


def namespaces_available():
    return shutil.which("unshare") and shutil.which("nsenter") and subprocess.run(
        ["unshare", "--user", "--map-root-user", "--net", "true"], capture_output=True, timeout=30).returncode == 0


@pytest.fixture(scope="module")
def ray_cluster():
    if not namespaces_available():
        pytest.skip("needs unshare/nsenter and user + network namespaces (the test cluster must be loopback-only)")
    folder = Path(tempfile.mkdtemp(prefix="ray-"))  # short: Ray's socket paths live under it
    cluster = LoopbackRayCluster(folder)
    try:
        if not cluster.address.startswith("127."):
            pytest.skip(f"Ray takes this machine to be {cluster.address}, which a loopback-only namespace lacks")
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(folder, ignore_errors=True)


def start_search_on_ray(cluster, *args):
    return subprocess.Popen(cluster.in_namespace(sys.executable, REPO / "async_hpo.py", "--ray-address", "auto", *args),
                            cwd=REPO, env=cluster.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def ray_trial_processes(cluster, node):
    """Live trial processes on the node (a Ray task started them with the trial flag)."""
    found = []
    for process in cluster.processes(node):
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.status() != psutil.STATUS_ZOMBIE and TRIAL_FLAG in process.cmdline():
                found.append(process)
    return found


def ray_tasks_running(cluster):
    """Ray workers of the cluster that are running a trial task (Ray names a worker after the task it runs)."""
    running = []
    for node in (cluster.head, cluster.worker):
        for process in cluster.processes(node):
            with contextlib.suppress(psutil.NoSuchProcess):
                if "run_trial_on_node" in " ".join(process.cmdline()):
                    running.append(process)
    return running


def trial_of(process, results_dir):
    """The id of the trial a process on a Ray node runs: the trial whose [trial-info] line here gives its pid."""
    for path in Path(results_dir).glob("*/[0-9]*/std.out"):
        if f'"pid": {process.pid}' in path.read_text():
            return int(path.parent.name)
    return None


def nothing_of_the_trials_left(cluster):
    return not ray_tasks_running(cluster) and not any(
        ray_trial_processes(cluster, node) for node in (cluster.head, cluster.worker))


def temporary_files(cluster):
    """What is in the nodes' temporary folder (TMPDIR of both nodes) but Ray's own folder and torch's compile cache
    (`torchinductor_<user>`, which torch keeps there by design)."""
    return {path.name for path in cluster.folder.iterdir() if path.name != "ray" and
            not path.name.startswith("torchinductor_")}


def test_ray_more_trials_than_the_cluster_runs_at_once_is_one_line_exit_2(ray_cluster, tmp_path, data_dir_args):
    """The cluster has two nodes of one CPU each: three trials at once, or two of two CPUs each, do not fit."""
    ray_cluster.ensure_worker_node()
    for flags in (["--n-workers", "3"], ["--trial-threads", "2"]):
        proc = start_search_on_ray(ray_cluster, *data_dir_args, *flags, "--results-dir", tmp_path / "results")
        code, out, err = finish(proc, 120)
        lines = err.strip().splitlines()
        assert code == 2 and "Traceback" not in err, err
        assert "more than the cluster can run at once" in lines[-1] and "[(1, 0), (1, 0)]" in lines[-1], err
        assert not (tmp_path / "results").exists()


def test_ray_sigterm_stops_every_trial_on_every_node(ray_cluster, tmp_path, data_dir_args):
    ray_cluster.ensure_worker_node()
    left_before = temporary_files(ray_cluster)
    proc = start_search_on_ray(ray_cluster, *data_dir_args, *QUICK, "--max-epochs", "3", "--results-dir", tmp_path)
    try:
        wait_for(lambda: all(ray_trial_processes(ray_cluster, node) for node in (ray_cluster.head, ray_cluster.worker)),
                 120, "a trial on each node")
        assert len(ray_tasks_running(ray_cluster)) == 2
        # each trial runs from the code Ray shipped to its node: the entry point and common.py, nothing else
        for process in ray_trial_processes(ray_cluster, ray_cluster.worker):
            assert sorted(os.listdir(process.cwd())) == ["async_hpo.py", "common.py"]
        proc.send_signal(signal.SIGTERM)
    finally:
        code, out, err = finish(proc, 60)
    # Ray's handler exits with the signal's number, without the stack dump and the abort 3 s on of Ray's C++ core
    assert code == signal.SIGTERM and "SIGTERM received" not in err, (code, err)
    wait_for(lambda: nothing_of_the_trials_left(ray_cluster), 60, "Ray to end the cancelled trials")
    (experiment,) = [path for path in tmp_path.iterdir() if path.is_dir()]
    assert (experiment / "metadata.json").is_file() and (experiment / "0" / "std.out").is_file()
    assert temporary_files(ray_cluster) == left_before  # the trials cut off left nothing on their nodes


def test_ray_a_killed_tuner_takes_its_trials_with_it(ray_cluster, tmp_path, data_dir_args):
    """No die_with_parent against the tuner on other machines: Ray ends the tasks of a driver that is gone."""
    ray_cluster.ensure_worker_node()
    left_before = temporary_files(ray_cluster)
    proc = start_search_on_ray(ray_cluster, *data_dir_args, *QUICK, "--max-epochs", "3", "--results-dir", tmp_path)
    try:
        wait_for(lambda: len(ray_tasks_running(ray_cluster)) == 2, 120, "two trial tasks")
        proc.kill()  # nsenter has become the tuner: this is the tuner's pid
    finally:
        finish(proc, 60)
    wait_for(lambda: nothing_of_the_trials_left(ray_cluster), 60, "the trials of the killed tuner to end")
    assert temporary_files(ray_cluster) == left_before


def test_ray_max_trials_finishes_that_many_and_prints_every_event(ray_cluster, tmp_path, data_dir_args):
    """On the cluster as locally: exactly --max-trials trials start, all of them finish, each event is printed once
    and the counts agree; each trial says which node ran it."""
    ray_cluster.ensure_worker_node()
    left_before = temporary_files(ray_cluster)
    proc = start_search_on_ray(ray_cluster, *data_dir_args, *QUICK, "--max-epochs", "1", "--max-trials", "3",
                               "--results-dir", tmp_path)
    code, out, err = finish(proc, 300)
    assert code == 0, err
    result = last_json(out)
    assert (result["trials_started"], result["trials_finished"], result["trials_completed"]) == (3, 3, 3), out
    assert_every_event_once(out, result)
    assert all(row["epochs"] == 1 and row["node"] and row["node_ip"] for row in result["trials"]), result["trials"]
    assert_trials_ran_with_threads(result, 1)  # the most CPUs per trial that fit two at once on two 1-CPU nodes
    assert nothing_of_the_trials_left(ray_cluster)
    assert temporary_files(ray_cluster) == left_before


def test_ray_a_trial_cut_off_by_the_budget_leaves_nothing_on_its_node(ray_cluster, tmp_path, data_dir_args):
    """--max-wallclock-time shorter than the trial: it is cut off at the budget and says so; its task and its process
    are gone afterwards, and it left no file on its node."""
    ray_cluster.ensure_worker_node()
    left_before = temporary_files(ray_cluster)
    # time for Ray to start a worker for the trial and for the trial to report (in CI, beside the other tests, 20 s
    # were not enough: the trial's first line came 7 s in), far from its 1000 epochs (each validates on 10,000 images)
    budget = 45
    proc = start_search_on_ray(ray_cluster, *data_dir_args, "--limit-train", "500", "--activation", "relu",
                               "--max-wallclock-time", budget, "--max-epochs", "1000", "--max-trials", "1",
                               "--n-workers", "1", "--results-dir", tmp_path)
    code, out, err = finish(proc, 240)
    assert code == 0, err
    result = last_json(out)
    (row,) = result["trials"]
    assert row["status"] == "cut off", out
    assert row["epochs"] >= 1 and row["node"] and row["pid"], row  # it ran, on a node of the cluster
    assert budget <= result["wall_time_s"] < budget + 3, result["wall_time_s"]  # (as locally)
    assert_every_event_once(out, result)
    wait_for(lambda: nothing_of_the_trials_left(ray_cluster), 60, "Ray to end the trial cut off")  # its task too
    with contextlib.suppress(psutil.NoSuchProcess):  # its process, by the pid it gave
        assert TRIAL_FLAG not in psutil.Process(row["pid"]).cmdline()
    assert temporary_files(ray_cluster) == left_before


def test_ray_asha_stops_the_same_trial_as_locally(ray_cluster, tmp_path, data_dir_args):
    """test_asha_stops_bad_trials_early on the cluster: Syne Tune's decisions, applied to Ray tasks."""
    ray_cluster.ensure_worker_node()
    proc = start_search_on_ray(ray_cluster, *data_dir_args, *QUICK, "--n-workers", "1", "--max-epochs", "2",
                               "--max-trials", "2", "--scheduler", "asha", "--results-dir", tmp_path)
    code, out, err = finish(proc, 240)
    assert code == 0, err
    result = last_json(out)
    assert (result["trials_completed"], result["trials_stopped_early"]) == (1, 1), out
    assert [(row["status"], row["epochs"]) for row in result["trials"]] == [("completed", 2), ("stopped early", 1)]
    assert_every_event_once(out, result)
    results = experiment_results(result)
    assert list(results[results.trial_id == 0].epoch) == [1, 2]
    assert list(results[results.trial_id == 1].epoch) == [1]
    assert list(results[results.trial_id == 1].st_decision) == ["STOP"]
    wait_for(lambda: nothing_of_the_trials_left(ray_cluster), 60, "Ray to end the stopped trial")


def test_ray_trials_run_on_both_nodes_and_a_dead_node_fails_only_its_trial(ray_cluster, tmp_path, data_dir_args):
    """Two trials at once, one per node (one CPU each). Once the worker node has finished a trial and started
    the next, all of its processes are killed: that trial is failed, and the search goes on on the head node."""
    ray_cluster.ensure_worker_node()
    proc = start_search_on_ray(ray_cluster, *data_dir_args, *QUICK, "--max-epochs", "1", "--max-trials", "5",
                               "--max-failures", "1", "--results-dir", tmp_path)

    def second_trial_on_worker_node_frozen():
        """The worker node's first trial has finished, and a later one's first line has reached the tuner: freeze
        that trial, so that it is still running when its node dies."""
        for process in ray_trial_processes(ray_cluster, ray_cluster.worker):
            with contextlib.suppress(psutil.NoSuchProcess):
                trial_id = trial_of(process, tmp_path)
                if trial_id is not None and trial_id >= 2:
                    process.suspend()
                    return trial_id
        return None

    try:
        frozen = wait_for(second_trial_on_worker_node_frozen, 240, "a second trial on the worker node")
        ray_cluster.kill_worker_node()
    finally:
        code, out, err = finish(proc, 240)
    assert code == 0, err
    result = last_json(out)
    assert result["ray_address"] == "auto" and result["trials_failed"] == 1, out
    (failed,) = [row for row in result["trials"] if row["status"] == "failed"]
    assert failed["trial"] == frozen and f"Trial {frozen} failed" in out
    completed = [row for row in result["trials"] if row["status"] == "completed"]
    worker_node = failed["node"]
    assert any(row["node"] == worker_node for row in completed), result["trials"]  # ran trials before it died
    assert any(row["node"] != worker_node and row["trial"] > failed["trial"] for row in completed), result["trials"]
    assert len({row["node"] for row in completed}) == 2  # from the trials' own reports: both nodes ran trials
    std_err = Path(result["results_dir"]) / result["experiment"] / str(failed["trial"]) / "std.err"
    assert std_err.read_text().startswith("ray: ")  # why Ray lost it
    assert_every_event_once(out, result)
    assert result["best_validation_error"] < BEST_AFTER_ONE_EPOCH, result
    assert not ray_trial_processes(ray_cluster, ray_cluster.head) and not ray_tasks_running(ray_cluster)
