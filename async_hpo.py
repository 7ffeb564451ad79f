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
    python async_hpo.py --ray-address auto                # trials on a Ray cluster (docs/async_hpo_ray.md)
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
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
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
from syne_tune.util import dump_json_with_numpy
from syne_tune.utils import add_config_json_to_argparse, load_config_json

from common import (FASHION_MNIST_FILES, UsageError, check, cuda_device_count, die_with_parent, emit_result,
                    fashion_mnist_dir, load_fashion_mnist, parse_args, run_main, seed_everything, usable_cpus)


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
    ray_address: Optional[str] = None
    """run the trials as Ray tasks on the cluster at HOST:PORT, or `auto` for the one that `ray start` began on
    this machine; --n-workers then counts trials at once across the cluster (docs/async_hpo_ray.md)"""


METRIC = "validation_error"
RESOURCE = "epoch"
FIRST_CONFIG = {"learning_rate": 0.1, "batch_size": 128}  # the tutorial's initial configuration
POLL_INTERVAL_S = 0.1  # how long the tuner sleeps when all workers are busy: the delay before a free worker is reused
HOLDOUT_SIZE = 10_000
TRIAL_FLAG = f"--{ST_CONFIG_JSON_FNAME_ARG}"  # Syne Tune starts each trial with this flag
TRIAL_INFO_FILE = "trial.json"  # written by each trial: its start time, device and machine
RAY_TRIAL_FILES = ("common.py",)  # what a trial needs beside the entry point: Ray ships them to every node
RAY_STOP_TIMEOUT_S = 30.0  # how long the tuner waits for the Ray tasks of stopped trials to end


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


def trial_data_folder(data_folder):
    """The tuner's data folder when this machine has it, else (a trial on another machine of a Ray cluster,
    where the tuner's path does not exist) the download cache, filled and verified there once."""
    if all((Path(data_folder) / name).is_file() for name in FASHION_MNIST_FILES):
        return data_folder
    return fashion_mnist_dir(None)


def run_trial(config, trial_dir):
    """Train LeNet with config's learning rate and batch size; report validation_error after every epoch."""
    die_with_parent(config["tuner_pid"])  # the tuner; on Ray, the Ray worker that started this trial
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
        trial_data_folder(config["data_folder"]), config["holdout"], config["train_size"], config["seed"]))
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
    """Run Syne Tune's tuning loop here; every trial is `python entry_point` in a child process (or, with
    --ray-address, in a Ray task on the cluster: connect_to_ray first)."""
    results_dir = Path(args.results_dir).resolve()
    results_dir.mkdir(parents=True, exist_ok=True)
    os.environ["SYNETUNE_FOLDER"] = str(results_dir)  # Syne Tune's way to say where experiments are written
    if args.ray_address:
        backend = RayTrials(str(entry_point), cpus=config_space.get("threads", 1), gpus=1 if args.cuda else 0)
    else:
        backend = TrialProcesses(entry_point=str(entry_point), pass_args_as_json=True, rotate_gpus=args.cuda)
    tuner = Tuner(
        trial_backend=backend,
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
            **({"node": info["node"]} if "node" in info else {}),  # the Ray node's ID, on a Ray cluster
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
                results_dir=str(Path(args.results_dir).resolve()), figures={k: str(v) for k, v in figures.items()},
                **({"ray_address": args.ray_address} if args.ray_address else {}))


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: trials on a Ray cluster (--ray-address); Syne Tune still decides, Ray places and runs
# ---------------------------------------------------------------------------------------------------------

def connect_to_ray(address, entry_point):
    """Join the Ray cluster at address as its driver; returns its alive nodes as (CPUs, GPUs) pairs.

    The trials' code travels with the job: Ray's runtime_env working_dir, here a folder holding only the entry
    point and RAY_TRIAL_FILES (never the repo or its .venv), is uploaded once and becomes the working folder of
    every trial task on every node. An address nothing answers at is a UsageError, before anything is written
    (ray.init itself would retry for minutes)."""
    import ray
    from ray._private.services import canonicalize_bootstrap_address  # ray.init's own reading of the address
    check("://" not in address, f"--ray-address {address}: give the cluster's HOST:PORT (the address `ray start "
                                f"--head` printed) or auto; Ray Client addresses are not supported")
    try:
        host, port = canonicalize_bootstrap_address(address).rsplit(":", 1)  # `auto` fails here without a cluster
        socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
    except (ConnectionError, OSError, ValueError) as error:
        reason = "none is running on this machine" if address == "auto" else str(error).splitlines()[0]
        raise UsageError(f"--ray-address {address}: no Ray cluster answers ({reason}); start one with `ray start "
                         f"--head` (docs/async_hpo_ray.md) or fix the address") from None
    code = Path(tempfile.mkdtemp(prefix="async-hpo-code-"))
    try:
        for path in (Path(entry_point), *(Path(__file__).resolve().with_name(name) for name in RAY_TRIAL_FILES)):
            shutil.copy(path, code)
        ray.init(address=address, runtime_env={"working_dir": str(code)}, logging_level=logging.WARNING,
                 log_to_driver=False)
    except (ConnectionError, RuntimeError, ray.exceptions.RayError) as error:  # e.g. a token that does not match
        raise UsageError(f"--ray-address {address}: {str(error).splitlines()[0]}") from None
    finally:
        shutil.rmtree(code)
    return [(int(node["Resources"].get("CPU", 0)), int(node["Resources"].get("GPU", 0)))
            for node in ray.nodes() if node["Alive"]]


def cpus_per_trial(nodes, n_workers, gpus_per_trial):
    """The most CPUs each trial can have with n_workers trials running at once on the cluster's nodes ((CPUs,
    GPUs) pairs), every trial on one node, with gpus_per_trial GPUs each; 0 when n_workers trials never fit."""
    for cpus in range(max((node_cpus for node_cpus, _ in nodes), default=0), 0, -1):
        fit = sum(min(node_cpus // cpus, node_gpus // gpus_per_trial if gpus_per_trial else node_cpus)
                  for node_cpus, node_gpus in nodes)
        if fit >= n_workers:
            return cpus
    return 0


def run_trial_on_node(entry_point, trial_id, config_text):
    """A Ray task: run one trial on the node Ray placed it on, as the local backend would run it here.

    It starts `python entry_point --st_config_json_filename ...` (from the job's working folder, see
    connect_to_ray) with this task's share of the node (Ray sets CUDA_VISIBLE_DEVICES and OMP_NUM_THREADS for
    it), and yields what the trial writes as it writes it: ("std.out" | "std.err", line), once
    (TRIAL_INFO_FILE, its text plus this node's Ray ID and IP), then ("exit", exit status). Its config says
    this worker's pid as `tuner_pid`, so die_with_parent ties the trial to this worker: when the tuner cancels
    the task, or goes away, Ray kills the worker and the trial with it. The trial's folder on this node (in its
    temporary folder) is removed once the trial has read its config and written TRIAL_INFO_FILE: a trial killed
    before that leaves its config.json behind."""
    import ray
    folder = Path(tempfile.mkdtemp(prefix=f"async-hpo-trial-{trial_id}-"))
    (folder / "config.json").write_text(json.dumps({**json.loads(config_text), "tuner_pid": os.getpid()}))
    node = {"node": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address()}
    process = subprocess.Popen([sys.executable, entry_point, TRIAL_FLAG, str(folder / "config.json"),
                                "--st_checkpoint_dir", str(folder / "checkpoints")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = queue.SimpleQueue()

    def forward(stream, name):
        for line in stream:
            lines.put((name, line))
        lines.put((name, None))

    for stream, name in ((process.stdout, "std.out"), (process.stderr, "std.err")):
        threading.Thread(target=forward, args=(stream, name), daemon=True).start()
    try:
        open_streams, info = 2, None
        while open_streams:
            name, line = lines.get()
            if info is None and name == "std.out":  # the trial writes its info file before its first line
                with contextlib.suppress(OSError, ValueError):
                    info = {**json.loads((folder / TRIAL_INFO_FILE).read_text()), **node}
                if info is not None:
                    shutil.rmtree(folder, ignore_errors=True)
                    yield TRIAL_INFO_FILE, json.dumps(info)
            if line is None:
                open_streams -= 1
            else:
                yield name, line
        yield "exit", process.wait()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        shutil.rmtree(folder, ignore_errors=True)


class RayTrial:
    """The tuner's handle on one trial running as a Ray task, with the two methods of subprocess.Popen that the
    local backend calls: poll() and kill(). Lives in the tuner process."""

    def __init__(self, stream, trial_path):
        self.stream, self.trial_path = stream, trial_path
        self.returncode, self.killed = None, False

    def poll(self):
        """Append what the trial wrote since the last call to the files of its folder here; return its exit
        status once it has ended, 1 (with the reason in std.err) when Ray lost it: its node died, its worker
        was killed."""
        import ray
        while self.returncode is None and self.stream.next_ready():
            try:
                name, text = ray.get(next(self.stream))
            except ray.exceptions.RayError as error:
                name, text = "std.err", "" if self.killed else f"ray: {str(error).splitlines()[0]}\n"
                self.returncode = 1
            if name == "exit":
                self.returncode = text  # the trial process's exit status
            elif name == TRIAL_INFO_FILE:
                (self.trial_path / name).write_text(text)
            else:
                with open(self.trial_path / name, "a") as log:
                    log.write(text)
        return self.returncode

    def kill(self):
        import ray
        self.killed = True
        ray.cancel(self.stream, force=True)  # kills the Ray worker, and so the trial process it started


class RayTrials(LocalBackend):
    """Syne Tune's local backend with each trial a Ray task somewhere on the cluster instead of a child process
    here; the rest is the local backend's: each trial's folder here gets its config.json, and std.out, std.err
    and TRIAL_INFO_FILE as the trial writes them on its node (RayTrial.poll), results are parsed from std.out,
    and stopping a trial (ASHA, the budget, Ctrl-C) kills it. Lives in the tuner process."""

    def __init__(self, entry_point, cpus, gpus):
        import ray
        super().__init__(entry_point=entry_point, pass_args_as_json=True, rotate_gpus=False)
        if run_trial_on_node.__module__ != "__main__":  # imported (the benchmark): send the function itself, so
            ray.cloudpickle.register_pickle_by_value(sys.modules[run_trial_on_node.__module__])  # no torch import
        # SPREAD: trials on different nodes while there are free ones. No retries: a trial whose node died has
        # failed, and Syne Tune decides what runs next.
        self.task = ray.remote(run_trial_on_node).options(
            num_returns="streaming", num_cpus=cpus, num_gpus=gpus, max_retries=0, scheduling_strategy="SPREAD")

    def _schedule(self, trial_id, config):
        trial_path = self.trial_path(trial_id)
        trial_path.mkdir(parents=True, exist_ok=True)
        for name in ("std.out", "std.err"):
            (trial_path / name).touch()
        config_text = dump_json_with_numpy(config)
        (trial_path / "config.json").write_text(config_text)
        stream = self.task.remote(Path(self.entry_point).name, trial_id, config_text)
        self.trial_subprocess[trial_id] = RayTrial(stream, trial_path)
        self._busy_trial_id_candidates.add(trial_id)

    def _kill_process(self, trial_id):
        self.trial_subprocess[trial_id].kill()

    def stop_all(self):
        """Stop every running trial, then wait (a bounded time) until Ray reports each of their tasks ended."""
        import ray
        super().stop_all()
        ended = [trial.stream.completed() for trial in self.trial_subprocess.values()]
        if ended:
            ray.wait(ended, num_returns=len(ended), timeout=RAY_STOP_TIMEOUT_S, fetch_local=False)


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
    check(not args.cuda or args.ray_address or cuda_device_count() > 0,
          "--cuda: no CUDA device on this machine; run without --cuda")
    script = Path(__file__).resolve()
    # Syne Tune's local backend builds each trial's command line by joining paths with spaces
    check(not any(c.isspace() for c in str(script) + str(Path(args.results_dir).resolve())),
          "the script's path and --results-dir must not contain spaces; pick a folder without them")
    threads = max(1, usable_cpus() // args.n_workers)  # each trial's share of this machine's cores
    if args.ray_address:
        nodes = connect_to_ray(args.ray_address, script)
        threads = cpus_per_trial(nodes, args.n_workers, 1 if args.cuda else 0)  # the CPUs Ray reserves per trial
        check(threads >= 1, f"--n-workers {args.n_workers}: the Ray cluster at {args.ray_address} cannot run that "
                            f"many trials at once ({sum(c for c, _ in nodes)} CPUs, {sum(g for _, g in nodes)} GPUs "
                            f"on {len(nodes)} nodes{'; one GPU per trial' if args.cuda else ''}); lower --n-workers")
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
        "threads": threads,
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
