"""Asynchronous random search over LeNet trials on Fashion-MNIST with Syne Tune (plus BO and ASHA schedulers).

A tuner process samples hyperparameter configurations (learning rate, batch size) and runs each one as a
trial: a separate Python process that trains LeNet and reports its validation error after every epoch.
`--n-workers` trials run at the same time. Asynchronous scheduling starts a new trial as soon as any worker
is free, so no worker waits for a slow trial; `--sync` is the synchronous baseline, which starts the next
batch of n_workers trials only when the whole previous batch has finished. Worker utilisation (busy trial
time / (n_workers x wall time), from the trials' own timestamps) shows the difference. `--scheduler` picks
random search (the tutorial), `bo` (Syne Tune's TPE, a model-based searcher that learns from finished
trials) or `asha` (asynchronous successive halving, which stops trials that are worse than most others at
the same epoch). This file is both the tuner and the trial script: Syne Tune starts it again with
`--st_config_json_filename`, which makes it run one trial.

    python async_hpo.py                                   # the tutorial: random search, 2 workers, 12 min
    python async_hpo.py --scheduler asha --n-workers 4    # stop bad trials early
    python async_hpo.py --sync                            # synchronous baseline, same budget
    python async_hpo.py --cuda                            # one GPU per trial when there are several
    python async_hpo.py --max-trials 6 --max-epochs 2 --limit-train 5000 --activation relu   # a quick look

Each run writes runs/async_hpo/<experiment>/ (--results-dir): Syne Tune's metadata.json and results.csv.zip
(read them with `syne_tune.experiments.load_experiment(experiment, local_path="runs/async_hpo")`), one
folder per trial with its std.out / std.err, tuner.log (Syne Tune's own messages), incumbent.png and
learning_curves.png. The default run (`--data-dir ../shared/data`, 2 workers on a 2-core CPU machine shared
with other work, 12 min 5 s) ended with:

    trial 7 completed | epoch 10 | val err 0.2383 | best 0.1378
    trial 9 started | lr 0.06103 | batch 57
    trial | status    | learning_rate | batch_size | epochs | val err | best err | busy s
        0 | completed |        0.1000 |        128 |     10 |  0.2622 |   0.2622 |  199.4
      ...
        6 | completed |        0.8459 |         90 |     10 |  0.1378 |   0.1378 |  169.0
        7 | completed |        0.0902 |         71 |     10 |  0.2383 |   0.2383 |  171.0
        8 | cut off   |        0.1142 |        120 |      5 |  0.3127 |   0.3127 |   44.2
        9 | cut off   |        0.0610 |         57 |      3 |  0.4188 |   0.4188 |   31.7
    {"script": "async_hpo", "scheduler": "random", "sync": false, "n_workers": 2, "best_config": {"learning_rate":
     0.8459, "batch_size": 90}, "best_validation_error": 0.1378, "best_trial": 6, "trials_started": 10,
     "trials_finished": 8, ..., "utilisation": 0.9907, "wall_time_s": 720.1, ...}
"""

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from syne_tune import Reporter, StoppingCriterion, Tuner
from syne_tune.backend import LocalBackend
from syne_tune.backend.trial_status import Status
from syne_tune.config_space import loguniform, randint
from syne_tune.constants import ST_CONFIG_JSON_FNAME_ARG, ST_WORKER_TIMESTAMP
from syne_tune.experiments import load_experiment
from syne_tune.optimizer.baselines import ASHA, TPE, RandomSearch
from syne_tune.optimizer.scheduler import SchedulerDecision
from syne_tune.results_callback import StoreResultsCallback
from syne_tune.tuner_callback import TunerCallback
from syne_tune.tuner_logger import TunerLogger
from syne_tune.utils import add_config_json_to_argparse, load_config_json

from common import (UsageError, check, cuda_device_count, die_with_parent, emit_result, fashion_mnist_dir,
                    load_fashion_mnist, parse_args, run_main, seed_everything, usable_cpus)


@dataclasses.dataclass
class Args:
    scheduler: Literal["random", "bo", "asha"] = "random"
    """random: random search (the tutorial); bo: Syne Tune's TPE, a model-based (Bayesian) searcher;
    asha: asynchronous successive halving over random configurations, stopping bad trials early"""
    sync: bool = False
    """synchronous baseline: start the next batch of n_workers trials only when the whole batch has finished"""
    n_workers: int = 2
    """number of trials running at the same time"""
    max_wallclock_time: float = 720.0
    """tuning budget in seconds; trials still running then are stopped"""
    max_trials: Optional[int] = None
    """also stop once this many trials have finished (completed, stopped early or failed)"""
    max_epochs: int = 10
    """epochs per trial (ASHA's maximum resource)"""
    seed: int = 0
    """seed of the configuration sampling, of every trial's initial parameters and of its data order"""
    results_dir: str = "runs/async_hpo"
    """folder that receives one experiment folder per run (Syne Tune's SYNETUNE_FOLDER)"""
    data_dir: Optional[str] = None
    """folder with the Fashion-MNIST .gz files (or its parent); downloaded into a cache when not given"""
    limit_train: Optional[int] = None
    """train every trial on the first N training images only (for quick runs)"""
    holdout: bool = False
    """validate on 10,000 images held out from the training set instead of the test set"""
    max_failures: int = 3
    """crashed trials tolerated; one more stops the search with an error"""
    activation: Literal["sigmoid", "relu"] = "sigmoid"
    """LeNet's activation: sigmoid as in the tutorial; relu learns within the first hundred steps, where
    sigmoid sits on a plateau for several hundred (use it for short runs)"""
    cuda: bool = False
    """train trials on GPUs: one GPU per trial when there are several, else all share the one"""


METRIC = "validation_error"
RESOURCE = "epoch"
FIRST_CONFIG = {"learning_rate": 0.1, "batch_size": 128}  # the tutorial's initial configuration
POLL_INTERVAL_S = 0.1  # how long the tuner sleeps when all workers are busy: the delay before a free worker is reused
HOLDOUT_SIZE = 10_000
TRIAL_FLAG = f"--{ST_CONFIG_JSON_FNAME_ARG}"  # Syne Tune starts each trial with this flag
TRIAL_INFO_FILE = "trial.json"  # written by each trial: its start time, device and machine


# ---------------------------------------------------------------------------------------------------------
# The model: the tutorial's LeNet (sigmoid activations, average pooling, Xavier initialisation)
# ---------------------------------------------------------------------------------------------------------

class LeNet(nn.Module):
    """LeNet-5 for 28x28 grey images. Lives in a trial process."""

    def __init__(self, activation="sigmoid", num_classes=10):
        super().__init__()
        act = {"sigmoid": nn.Sigmoid, "relu": nn.ReLU}[activation]
        self.net = nn.Sequential(
            nn.Conv2d(1, 6, kernel_size=5, padding=2), act(), nn.AvgPool2d(kernel_size=2, stride=2),
            nn.Conv2d(6, 16, kernel_size=5), act(), nn.AvgPool2d(kernel_size=2, stride=2),
            nn.Flatten(),
            nn.Linear(16 * 5 * 5, 120), act(),
            nn.Linear(120, 84), act(),
            nn.Linear(84, num_classes))
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.xavier_uniform_(module.weight)

    def forward(self, images):
        return self.net(images)


# ---------------------------------------------------------------------------------------------------------
# A trial: one process started by the tuner, trains one configuration and reports after every epoch
# ---------------------------------------------------------------------------------------------------------

def process_start_time():
    """Wall-clock time at which this process was created, so a trial's busy time includes its start-up."""
    try:
        # /proc/self/stat field 22 is the start time in clock ticks after boot; /proc/uptime is now after boot
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


def load_split(folder, holdout, train_size, seed):
    """(train images, train labels, validation images, validation labels), images uint8 [N, 28, 28].

    Validation is the 10k test split, as in the tutorial, or with holdout 10k training images chosen with
    the seed (the same for every trial, so trials compare on the same images)."""
    train_x, train_y, test_x, test_y = load_fashion_mnist(folder)
    if holdout:
        order = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(seed))
        val_index, train_index = order[:HOLDOUT_SIZE], order[HOLDOUT_SIZE:]
        train_x, train_y, test_x, test_y = train_x[train_index], train_y[train_index], train_x[val_index], \
            train_y[val_index]
    return train_x[:train_size], train_y[:train_size], test_x, test_y


def as_input(images):
    return images.unsqueeze(1).float().div_(255)


@torch.no_grad()
def validation_error(model, images, labels, batch_size=2000):
    model.eval()
    wrong = sum((model(as_input(x)).argmax(1) != y).sum() for x, y in zip(images.split(batch_size), labels.split(batch_size)))
    return wrong.item() / len(labels)


def describe_device(device):
    """What the trial ran on, in its own words: 'cpu', or the GPU's index, name and UUID as CUDA reports them."""
    if device.type != "cuda":
        return device.type
    properties = torch.cuda.get_device_properties(device)
    return f"{device} {properties.name} GPU-{properties.uuid}"


def run_trial(config, trial_dir):
    """Train LeNet with config's learning rate and batch size; report validation_error after every epoch."""
    die_with_parent(config["tuner_pid"])
    started_at = process_start_time()
    torch.set_num_threads(config["threads"])
    seed_everything(config["seed"])
    # With several GPUs, Syne Tune's backend has set CUDA_VISIBLE_DEVICES to this trial's GPU, so "cuda" is it
    device = torch.device(config["device"])
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    # The start of the trial's busy interval (Syne Tune stamps its end), and where it ran
    info = {"started_at": started_at, "device": describe_device(device), "host": socket.gethostname()}
    (trial_dir / TRIAL_INFO_FILE).write_text(json.dumps(info))
    print(f"trial on {info['device']} | host {info['host']}", flush=True)
    train_x, train_y, val_x, val_y = (t.to(device) for t in load_split(
        config["data_folder"], config["holdout"], config["train_size"], config["seed"]))
    model = LeNet(config["activation"]).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["learning_rate"])
    report = Reporter()
    order = torch.Generator().manual_seed(config["seed"])
    for epoch in range(1, config["max_epochs"] + 1):
        start, total_loss = time.perf_counter(), torch.zeros((), device=device)
        model.train()
        for index in torch.randperm(len(train_x), generator=order).to(device).split(config["batch_size"]):
            loss = F.cross_entropy(model(as_input(train_x[index])), train_y[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total_loss += loss.detach() * len(index)  # summed on the device: no host synchronisation per step
        error = validation_error(model, val_x, val_y)
        print(f"epoch {epoch} | loss {total_loss.item() / len(train_x):.3f} | val err {error:.4f} | "
              f"{time.perf_counter() - start:.1f} s/epoch", flush=True)
        report(**{RESOURCE: epoch, METRIC: error})


def trial_main(argv):
    """Entry point of a trial process: Syne Tune passes the configuration as a JSON file."""
    parser = argparse.ArgumentParser()
    add_config_json_to_argparse(parser)
    parser.add_argument("--st_checkpoint_dir")  # always passed by Syne Tune; these trials do not checkpoint
    options = vars(parser.parse_args(argv))
    run_trial(load_config_json(options), Path(options[ST_CONFIG_JSON_FNAME_ARG]).parent)


# ---------------------------------------------------------------------------------------------------------
# The tuner: scheduler, backend, progress lines, signal handling, summary and figures (tuner process)
# ---------------------------------------------------------------------------------------------------------

class SearchFailed(Exception):
    """Too many trials crashed; the message says where their logs are."""


def make_scheduler(args, config_space):
    np.random.seed(args.seed)  # random search and ASHA draw configurations from numpy's global generator
    first = [FIRST_CONFIG]
    if args.scheduler == "random":
        return RandomSearch(config_space, metrics=[METRIC], do_minimize=True, random_seed=args.seed,
                            points_to_evaluate=first)
    if args.scheduler == "bo":
        # 0.16 ships Gaussian-process BO only through the optional botorch package; TPE needs nothing extra
        return TPE(config_space, metric=METRIC, do_minimize=True, random_seed=args.seed, points_to_evaluate=first)
    return ASHA(config_space, metric=METRIC, time_attr=RESOURCE, max_t=args.max_epochs, do_minimize=True,
                random_seed=args.seed, points_to_evaluate=first)


class TrialProcesses(LocalBackend):
    """Syne Tune's local backend (trials are child processes of the tuner). Lives in the tuner process."""

    def _prepare_for_schedule(self, num_gpus=None):
        # Syne Tune would count GPUs by running nvidia-smi and writing its output to ./std.out
        super()._prepare_for_schedule(num_gpus=cuda_device_count())

    def _allocate_gpu(self, trial_id, env):
        """Syne Tune gives a trial GPU i as CUDA_VISIBLE_DEVICES=i, an index among the tuner's visible GPUs; when
        the tuner itself sees a subset (a cluster scheduler's allocation, GPU UUIDs, MIG instances), that is
        entry i of the tuner's own CUDA_VISIBLE_DEVICES, not physical GPU i."""
        super()._allocate_gpu(trial_id, env)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if self.rotate_gpus and visible:
            entries = [entry.strip() for entry in visible.split(",")]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(entries[gpu] for gpu in self.trial_gpu[trial_id])


class ProgressLog(TunerCallback):
    """One line per trial event (started, finished, stopped early, failed). Lives in the tuner process."""

    def __init__(self, out, max_epochs):
        self.out, self.max_epochs = out, max_epochs
        self.best, self.ended = float("inf"), set()
        self.backend = None

    def on_tuning_start(self, tuner):
        self.backend = tuner.trial_backend

    def _line(self, text):
        print(text, file=self.out, flush=True)

    def on_start_trial(self, trial):
        self._line(f"trial {trial.trial_id} started | "
                   + " | ".join(f"{short} {trial.config[name]:.4g}" for name, short in
                                (("learning_rate", "lr"), ("batch_size", "batch")) if name in trial.config))

    def _ended(self, trial, result, how):
        if trial.trial_id in self.ended:
            return
        self.ended.add(trial.trial_id)
        self._line(f"trial {trial.trial_id} {how} | epoch {result[RESOURCE]} | val err {result[METRIC]:.4f} | "
                   f"best {self.best:.4f}")

    def on_trial_result(self, trial, status, result, decision):
        self.best = min(self.best, result[METRIC])
        if decision == SchedulerDecision.STOP:
            self._ended(trial, result, "completed" if result[RESOURCE] >= self.max_epochs else "stopped early")

    def on_trial_complete(self, trial, result):
        self._ended(trial, result, "completed")

    def on_fetch_status_results(self, trial_status_dict, new_results):
        for trial_id, (_, status) in trial_status_dict.items():
            if status == Status.failed and trial_id not in self.ended:
                self.ended.add(trial_id)
                self._line(f"trial {trial_id} failed | log {self.backend.trial_path(trial_id) / 'std.err'}")


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; a KeyboardInterrupt so that Tuner.run's cleanup stops every trial."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_on_signals():
    """Syne Tune stops its trials on KeyboardInterrupt only; a plain SIGTERM would leave them running."""
    def handler(signum, frame):
        for other in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the cleanup short
            signal.signal(other, signal.SIG_IGN)
        raise Interrupted(signum)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handler)


@dataclasses.dataclass
class Search:
    """What a finished (or interrupted) search leaves: the tuner, its folder and its wall-clock span."""
    tuner: Tuner
    path: Path
    started_at: float
    ended_at: float


def run_search(args, entry_point, config_space, out=sys.stdout):
    """Run Syne Tune's tuning loop here; every trial is `python entry_point` in a child process."""
    results_dir = Path(args.results_dir).resolve()
    results_dir.mkdir(parents=True, exist_ok=True)
    os.environ["SYNETUNE_FOLDER"] = str(results_dir)  # Syne Tune's way to say where experiments are written
    tuner = Tuner(
        trial_backend=TrialProcesses(entry_point=str(entry_point), pass_args_as_json=True, rotate_gpus=args.cuda),
        scheduler=make_scheduler(args, config_space),
        # Syne Tune stops when *more than* max_num_trials_finished trials have finished
        stop_criterion=StoppingCriterion(max_wallclock_time=args.max_wallclock_time,
                                         max_num_trials_finished=args.max_trials - 1 if args.max_trials else None),
        n_workers=args.n_workers,
        sleep_time=POLL_INTERVAL_S,
        max_failures=args.max_failures,
        tuner_name=f"async-hpo-{args.scheduler}{'-sync' if args.sync else ''}",
        asynchronous_scheduling=not args.sync,
        callbacks=[StoreResultsCallback(), ProgressLog(out, args.max_epochs)],
        save_tuner=False,
        output_logger=TunerLogger(use_colors=False, use_emojis=False),
    )
    tuner.tuner_path.mkdir(parents=True, exist_ok=True)
    # Syne Tune's banners, status tables and warnings go to tuner.log; the console gets ProgressLog's lines
    log_file = open(tuner.tuner_path / "tuner.log", "a")
    handler = logging.StreamHandler(log_file)
    syne_tune_logger = logging.getLogger("syne_tune")
    syne_tune_logger.addHandler(handler)
    syne_tune_logger.setLevel(logging.INFO)
    syne_tune_logger.propagate = False
    started_at = time.time()
    try:
        with contextlib.redirect_stdout(log_file):
            tuner.run()
    except ValueError:
        failed = tuner.tuning_status.num_trials_failed
        if failed <= args.max_failures:
            raise
        first = min(trial_id for trial_id, status in tuner.tuning_status.last_trial_status_seen.items()
                    if status == Status.failed)
        raise SearchFailed(f"{failed} trials crashed (more than --max-failures {args.max_failures}); the search "
                           f"stopped. First crash: {tuner.tuner_path / str(first) / 'std.err'}") from None
    finally:
        syne_tune_logger.removeHandler(handler)
        log_file.close()
    return Search(tuner, tuner.tuner_path, started_at, time.time())


def trial_outcomes(search, results, max_epochs):
    """One row per trial started: status, configuration, epochs, last and best validation error, busy time.

    A trial is busy from its process start (its own clock) to its last report (its own timestamp); a trial
    still running when the budget ran out is busy until the tuner stopped it."""
    statuses = search.tuner.tuning_status.last_trial_status_seen
    stopped_by_scheduler = search.tuner.trials_scheduler_stopped
    rows = []
    for trial_id in sorted(statuses):
        reports = results[results.trial_id == trial_id] if results is not None else []  # None: nobody reported
        reports = reports if len(reports) else None
        epochs = int(reports[RESOURCE].max()) if reports is not None else 0
        if statuses[trial_id] == Status.failed:
            status = "failed"
        elif epochs >= max_epochs:
            status = "completed"
        elif trial_id in stopped_by_scheduler:
            status = "stopped"  # early, by ASHA
        else:
            status = "cut off"  # still running when the budget ran out (or the run was interrupted)
        info_file = search.path / str(trial_id) / TRIAL_INFO_FILE
        info = json.loads(info_file.read_text()) if info_file.exists() else {}
        busy_from = info.get("started_at")
        if status == "cut off":
            busy_to = search.ended_at
        else:
            busy_to = float(reports[ST_WORKER_TIMESTAMP].max()) if reports is not None else busy_from
        config = search.tuner.tuning_status.trial_rows[trial_id]  # the trial's configuration and last metrics
        rows.append({
            "trial": trial_id, "status": status,
            "learning_rate": config.get("learning_rate"), "batch_size": config.get("batch_size"), "epochs": epochs,
            "val_err": float(reports[METRIC].iloc[-1]) if reports is not None else None,
            "best_err": float(reports[METRIC].min()) if reports is not None else None,
            "busy_s": busy_to - busy_from if busy_from is not None else 0.0,
            "device": info.get("device"), "host": info.get("host"),
        })
    return rows


def summarize(search, rows, n_workers):
    """The run's figures: best configuration and error, trial counts, worker utilisation."""
    reported = [row for row in rows if row["best_err"] is not None]
    best = min(reported, key=lambda row: row["best_err"]) if reported else None
    wall = search.ended_at - search.started_at
    count = {status: sum(row["status"] == status for row in rows) for status in
             ("completed", "stopped", "failed", "cut off")}
    return {
        "best_config": {name: best[name] for name in ("learning_rate", "batch_size")} if best else None,
        "best_validation_error": best["best_err"] if best else None,
        "best_trial": best["trial"] if best else None,
        "trials_started": len(rows),
        "trials_finished": count["completed"] + count["stopped"] + count["failed"],
        "trials_completed": count["completed"],
        "trials_stopped_early": count["stopped"],
        "trials_failed": count["failed"],
        "utilisation": round(sum(row["busy_s"] for row in rows) / (n_workers * wall), 4),
        "wall_time_s": round(wall, 1),
    }


def print_table(rows):
    def number(value, spec):
        return "-" if value is None else format(value, spec)
    print("trial | status    | learning_rate | batch_size | epochs | val err | best err | busy s")
    for row in rows:
        print(f"{row['trial']:5d} | {row['status']:9s} | {number(row['learning_rate'], '.4f'):>13s} | "
              f"{number(row['batch_size'], 'd'):>10s} | {row['epochs']:6d} | {number(row['val_err'], '.4f'):>7s} | "
              f"{number(row['best_err'], '.4f'):>8s} | {row['busy_s']:6.1f}")


def plot_figures(results, started_at, path):
    """The tutorial's two figures: the incumbent (best validation error so far) and every trial's learning
    curve, both over wall-clock time since the tuner started (from the trials' report timestamps)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    results = results.assign(wall=results[ST_WORKER_TIMESTAMP] - started_at).sort_values("wall")
    figures = {"incumbent": path / "incumbent.png", "learning_curves": path / "learning_curves.png"}
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.step(results["wall"], results[METRIC].cummin(), where="post")
    ax.set(xlabel="wall-clock time (s)", ylabel=f"best {METRIC}", title="incumbent")
    fig.tight_layout()
    fig.savefig(figures["incumbent"], dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 2.5))
    for _, trial in results.groupby("trial_id"):
        ax.plot(trial["wall"], trial[METRIC], marker="o", markersize=3)
    ax.set(xlabel="wall-clock time (s)", ylabel=METRIC, title="learning curve of every trial")
    fig.tight_layout()
    fig.savefig(figures["learning_curves"], dpi=100)
    plt.close(fig)
    return figures


def report_search(args, search):
    """Summary table, the two figures and the final JSON line, all from the results as Syne Tune stored them."""
    experiment = load_experiment(search.tuner.name, local_path=str(Path(args.results_dir).resolve()))
    if experiment.results is None:
        raise UsageError(f"no trial reported a result within --max-wallclock-time {args.max_wallclock_time}; "
                         f"give it more time (trial logs: {search.path})")
    rows = trial_outcomes(search, experiment.results, args.max_epochs)
    print_table(rows)
    figures = plot_figures(experiment.results, search.started_at, search.path)
    emit_result("async_hpo", scheduler=args.scheduler, sync=args.sync, n_workers=args.n_workers,
                **summarize(search, rows, args.n_workers), trials=rows, experiment=search.tuner.name,
                results_dir=str(Path(args.results_dir).resolve()), figures={k: str(v) for k, v in figures.items()})


def main():
    if TRIAL_FLAG in sys.argv[1:]:  # started by Syne Tune as one trial, the way torchrun's RANK marks a worker
        trial_main(sys.argv[1:])
        return
    args = parse_args(Args)
    check(args.n_workers >= 1, f"--n-workers must be at least 1, got {args.n_workers}")
    check(args.max_wallclock_time > 0, f"--max-wallclock-time must be positive, got {args.max_wallclock_time}")
    check(args.max_trials is None or args.max_trials >= 1, f"--max-trials must be at least 1, got {args.max_trials}")
    check(args.max_epochs >= 1, f"--max-epochs must be at least 1, got {args.max_epochs}")
    check(args.limit_train is None or args.limit_train >= 1, "--limit-train must be at least 1")
    check(args.max_failures >= 0, f"--max-failures must be 0 or more, got {args.max_failures}")
    check(not args.cuda or cuda_device_count() > 0, "--cuda: no CUDA device on this machine; run without --cuda")
    script = Path(__file__).resolve()
    # Syne Tune's local backend builds each trial's command line by joining paths with spaces
    check(not any(c.isspace() for c in str(script) + str(Path(args.results_dir).resolve())),
          "the script's path and --results-dir must not contain spaces; pick a folder without them")
    # Find (or download) and verify the data once here, so a problem is one line before any trial starts
    folder = fashion_mnist_dir(args.data_dir)
    train_size = len(load_split(folder, args.holdout, None, args.seed)[0])
    check(args.limit_train is None or args.limit_train <= train_size,
          f"--limit-train {args.limit_train} is more than the {train_size} training images")
    config_space = {
        "learning_rate": loguniform(1e-2, 1),
        "batch_size": randint(32, 256),
        "max_epochs": args.max_epochs,
        # constants travel to every trial with its configuration (and are recorded with its results)
        "train_size": args.limit_train or train_size,
        "holdout": args.holdout,
        "activation": args.activation,
        "data_folder": str(Path(folder).resolve()),
        "seed": args.seed,
        "threads": max(1, usable_cpus() // args.n_workers),
        "device": "cuda" if args.cuda else "cpu",
        "tuner_pid": os.getpid(),
    }
    stop_on_signals()
    try:
        search = run_search(args, script, config_space)
        report_search(args, search)
    except Interrupted as interrupt:
        print(f"{script.name}: {interrupt} received; all trials stopped, results so far are in "
              f"{Path(args.results_dir).resolve()}", file=sys.stderr, flush=True)
        sys.exit(128 + interrupt.signum)
    except SearchFailed as error:
        print(f"{script.name}: error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    run_main(main)
