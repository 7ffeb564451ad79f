"""Asynchronous random search over LeNet trials on Fashion-MNIST with Syne Tune (plus BO, ASHA and local search).

A tuner process samples hyperparameter configurations (learning rate, batch size) and runs each one as a
trial: a separate Python process that trains LeNet and reports its validation error after every epoch.
`--n-workers` trials run at the same time. Asynchronous scheduling starts a new trial as soon as any worker
is free, so no worker waits for a slow trial; `--sync` is the synchronous baseline, which starts the next
batch of n_workers trials only when the whole previous batch has finished. Worker utilisation (busy trial
time / (n_workers x wall time), from the trials' own timestamps) shows the difference. `--scheduler` picks
random search (the tutorial), `bo` (Syne Tune's TPE, a model-based searcher that learns from finished
trials), `gp` (Gaussian-process Bayesian optimisation; needs botorch), `asha` (asynchronous successive
halving, which stops trials that are worse than most others at the same epoch) or `local` (the tutorial's
exercise 4: sample near the best configuration so far). `--model mlp` searches the tutorial's exercise
objective instead of LeNet: DropoutMLP, over its hidden sizes, dropout rates, learning rate and batch size.
This file is both the tuner and the trial script: Syne Tune starts it again with `--st_config_json_filename`,
which makes it run one trial.

    python async_hpo.py                                   # the tutorial: random search, 2 workers, 12 min
    python async_hpo.py --scheduler asha --n-workers 4    # stop bad trials early
    python async_hpo.py --sync                            # synchronous baseline, same budget
    python async_hpo.py --model mlp --scheduler gp        # DropoutMLP, Gaussian-process BO
    python async_hpo.py --model mlp --scheduler local     # DropoutMLP, local search around the best so far
    python async_hpo.py --cuda                            # one GPU per trial when there are several
    python async_hpo.py --ray-address auto                # trials on the Ray cluster `ray start` began here
    python async_hpo.py --max-trials 6 --max-epochs 2 --limit-train 5000 --activation relu   # a quick look

Each run writes runs/async_hpo/<experiment>/ (--results-dir): Syne Tune's metadata.json and results.csv.zip
(read them with `syne_tune.experiments.load_experiment(experiment, local_path="runs/async_hpo")`), one
folder per trial with its std.out / std.err, tuner.log (Syne Tune's own messages), incumbent.png and
learning_curves.png. The default run (2 workers on a 2-core CPU machine shared with other work, 12 min 5 s)
ended with:

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
import errno
import importlib.util
import io
import json
import logging
import math
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
from syne_tune import Reporter, StoppingCriterion, Tuner
from syne_tune.backend import LocalBackend
from syne_tune.backend.trial_status import Status
from syne_tune.config_space import (
    Categorical,
    Domain,
    Float,
    Integer,
    is_log_space,
    lograndint,
    loguniform,
    randint,
    uniform,
)
from syne_tune.constants import ST_CONFIG_JSON_FNAME_ARG, ST_WORKER_TIMESTAMP
from syne_tune.experiments import load_experiment
from syne_tune.optimizer.baselines import ASHA, TPE, BOTorch, RandomSearch
from syne_tune.optimizer.scheduler import SchedulerDecision
from syne_tune.optimizer.schedulers.searchers.single_objective_searcher import SingleObjectiveBaseSearcher
from syne_tune.optimizer.schedulers.single_objective_scheduler import SingleObjectiveScheduler
from syne_tune.results_callback import StoreResultsCallback
from syne_tune.tuner_callback import TunerCallback
from syne_tune.tuner_logger import TunerLogger
from syne_tune.util import dump_json_with_numpy
from syne_tune.utils import add_config_json_to_argparse, load_config_json
from torch import nn

from common import (
    FASHION_MNIST_FILES,
    RunFailed,
    UsageError,
    check,
    check_output_dir,
    cuda_device_count,
    die_with_parent,
    emit_result,
    fashion_mnist_dir,
    load_fashion_mnist,
    parse_args,
    run_main,
    seed_everything,
    usable_cpus,
    write_atomic,
)


@dataclasses.dataclass
class Args:
    model: Literal["lenet", "mlp"] = "lenet"
    """lenet: the tutorial's LeNet, searched over learning rate and batch size; mlp: DropoutMLP (two hidden
    layers with dropout), searched over its hidden sizes and dropout rates too"""
    scheduler: Literal["random", "bo", "gp", "asha", "local"] = "random"
    """random: random search (the tutorial); bo: Syne Tune's TPE, a model-based (Bayesian) searcher; gp:
    Gaussian-process Bayesian optimisation (Syne Tune's BOTorch, needs botorch); asha: asynchronous successive
    halving over random configurations, stopping bad trials early; local: sample near the best configuration so far"""
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
    """failed trials tolerated (crashed, killed, or hung); one more stops the search with an error"""
    trial_threads: Optional[int] = None
    """CPU threads each trial trains with; default: this machine's cores / --n-workers (on a Ray cluster, the
    CPUs Ray reserves for each trial, always)"""
    trial_timeout: float = 120.0
    """a trial on this machine that uses no CPU time and writes no line for this many seconds (stopped or hung)
    is killed and counted as failed"""
    activation: Literal["sigmoid", "relu"] = "sigmoid"
    """LeNet's activation: sigmoid as in the tutorial; relu learns within the first hundred steps, where
    sigmoid sits on a plateau for several hundred (use it for short runs)"""
    cuda: bool = False
    """train trials on GPUs: one GPU per trial when there are several, else all share the one"""
    ray_address: Optional[str] = None
    """run the trials as Ray tasks on the cluster at HOST:PORT, or `auto` for the one that `ray start` began on
    this machine; --n-workers then counts trials at once across the cluster"""


def validate(args):
    """The rules of the flags, checked before anything starts: each broken rule is one line and exit status 2.
    (The data are checked next, in main; a Ray address when the search joins the cluster.)"""
    check(args.n_workers >= 1, f"--n-workers must be at least 1, got {args.n_workers}")
    check(args.max_wallclock_time > 0, f"--max-wallclock-time must be positive, got {args.max_wallclock_time}")
    check(args.max_trials is None or args.max_trials >= 1, f"--max-trials must be at least 1, got {args.max_trials}")
    check(args.max_epochs >= 1, f"--max-epochs must be at least 1, got {args.max_epochs}")
    check(0 <= args.seed < 2**32, f"--seed must be between 0 and 2**32 - 1 (numpy's seeds), got {args.seed}")
    check(args.limit_train is None or args.limit_train >= 1,
          f"--limit-train must be at least 1, got {args.limit_train}")
    check(args.max_failures >= 0, f"--max-failures must be 0 or more, got {args.max_failures}")
    check(args.trial_threads is None or args.trial_threads >= 1,
          f"--trial-threads must be at least 1, got {args.trial_threads}")
    check(args.trial_threads is None or not args.ray_address,
          "--trial-threads is for trials on this machine; on Ray each trial gets the CPUs Ray reserves for it")
    check(args.trial_timeout > 0, f"--trial-timeout must be positive, got {args.trial_timeout}")
    check(args.model == "lenet" or args.activation == "sigmoid",
          f"--activation {args.activation} is LeNet's; DropoutMLP uses ReLU: drop --activation or pass --model lenet")
    check(args.scheduler != "gp" or importlib.util.find_spec("botorch") is not None,
          "--scheduler gp needs botorch: pip install botorch==0.18.1 (or pick --scheduler bo, TPE)")
    check(not args.cuda or args.ray_address or cuda_device_count() > 0,
          "--cuda: no CUDA device on this machine; run without --cuda")
    check_output_dir("--results-dir", args.results_dir)
    # Syne Tune's local backend builds each trial's command line by joining paths with spaces
    check(not any(c.isspace() for c in str(Path(__file__).resolve()) + str(Path(args.results_dir).resolve())),
          "the script's path and --results-dir must not contain spaces; pick a folder without them")


METRIC = "validation_error"
RESOURCE = "epoch"
# Every search starts with the tutorial's configuration of the model
FIRST_CONFIGS = {"lenet": {"learning_rate": 0.1, "batch_size": 128},  # D2L 19.3
                 "mlp": {"learning_rate": 0.1, "batch_size": 256, "num_hiddens_1": 256, "num_hiddens_2": 256,
                         "dropout_1": 0.5, "dropout_2": 0.5}}  # D2L 5.6
SHORT_NAMES = {"learning_rate": "lr", "batch_size": "batch", "num_hiddens_1": "hidden1", "num_hiddens_2": "hidden2",
               "dropout_1": "dropout1", "dropout_2": "dropout2"}  # in the progress lines
LOCAL_STEP = 0.1  # --scheduler local: a step's scale, as a fraction of each hyperparameter's range
POLL_INTERVAL_S = 0.1  # how long the tuner sleeps when all workers are busy: the delay before a free worker is reused
HOLDOUT_SIZE = 10_000
TRIAL_FLAG = f"--{ST_CONFIG_JSON_FNAME_ARG}"  # Syne Tune starts each trial with this flag
TRIAL_INFO_FILE = "trial.json"  # written by each trial: its start time, device and machine
RAY_TRIAL_FILES = ("common.py",)  # what a trial needs beside the entry point: Ray ships them to every node
RAY_STOP_TIMEOUT_S = 30.0  # how long the tuner waits for the Ray tasks of stopped trials to end


# ---------------------------------------------------------------------------------------------------------
# The models: the tutorial's LeNet (sigmoid activations, average pooling, Xavier initialisation), and the
# DropoutMLP of its exercises
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


class DropoutMLP(nn.Module):
    """D2L 5.6's MLP: two ReLU hidden layers, each followed by dropout (PyTorch's default initialisation, as
    the tutorial's LazyLinear layers). Lives in a trial process."""

    def __init__(self, num_hiddens_1, num_hiddens_2, dropout_1, dropout_2, num_classes=10):
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(28 * 28, num_hiddens_1), nn.ReLU(), nn.Dropout(dropout_1),
            nn.Linear(num_hiddens_1, num_hiddens_2), nn.ReLU(), nn.Dropout(dropout_2),
            nn.Linear(num_hiddens_2, num_classes))

    def forward(self, images):
        return self.net(images)


def make_model(config):
    if config["model"] == "mlp":
        return DropoutMLP(config["num_hiddens_1"], config["num_hiddens_2"], config["dropout_1"], config["dropout_2"])
    return LeNet(config["activation"])


# ---------------------------------------------------------------------------------------------------------
# A trial: one process started by the tuner, trains one configuration and reports after every epoch
# ---------------------------------------------------------------------------------------------------------

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
    wrong = sum((model(as_input(x)).argmax(1) != y).sum()
                for x, y in zip(images.split(batch_size), labels.split(batch_size)))
    return wrong.item() / len(labels)


def run_trial(config, trial_dir):
    """Train config's model with its hyperparameters; report validation_error after every epoch (Syne Tune's
    Reporter prints it, and the tuner reads it from the trial's output)."""
    device = start_trial(config, trial_dir)  # beyond the tutorial: cores, device, die with the tuner, trial.json
    seed_everything(config["seed"])
    train_x, train_y, val_x, val_y = (t.to(device) for t in load_split(
        trial_data_folder(config["data_folder"]), config["holdout"], config["train_size"], config["seed"]))
    model = make_model(config).to(device)
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
# The tuner: configuration space, scheduler, Tuner, run, best configuration (tuner process)
# ---------------------------------------------------------------------------------------------------------

def search_space(model):
    """The hyperparameters the scheduler searches: the tutorial's two for LeNet; for DropoutMLP (exercise 1)
    its hidden sizes and dropout rates too."""
    space = {"learning_rate": loguniform(1e-2, 1), "batch_size": randint(32, 256)}
    if model == "mlp":
        space.update(num_hiddens_1=lograndint(32, 1024), num_hiddens_2=lograndint(32, 1024),
                     dropout_1=uniform(0.0, 0.8), dropout_2=uniform(0.0, 0.8))
    return space


def make_scheduler(args, config_space):
    """The scheduler proposes each trial's configuration, the model's FIRST_CONFIGS first, and (ASHA) stops
    trials early."""
    np.random.seed(args.seed)  # random search, ASHA and the GP's first samples draw from numpy's global generator
    options = dict(do_minimize=True, random_seed=args.seed, points_to_evaluate=[FIRST_CONFIGS[args.model]])
    if args.scheduler == "random":
        return RandomSearch(config_space, metrics=[METRIC], **options)
    if args.scheduler == "bo":  # Tree-structured Parzen estimator: needs nothing beyond Syne Tune
        return TPE(config_space, metric=METRIC, **options)
    if args.scheduler == "gp":  # expected improvement on a GP fitted to the finished trials (botorch)
        return BOTorch(config_space, metric=METRIC, **options)
    if args.scheduler == "local":
        searcher = LocalSearcher(config_space, options["points_to_evaluate"], random_seed=args.seed)
        return SingleObjectiveScheduler(config_space, metric=METRIC, do_minimize=True, searcher=searcher,
                                        random_seed=args.seed)
    return ASHA(config_space, metric=METRIC, time_attr=RESOURCE, max_t=args.max_epochs, **options)


@dataclasses.dataclass
class Search:
    """What a finished (or interrupted) search leaves: the tuner, its folder, the names of the searched
    hyperparameters and its wall-clock span."""
    tuner: Tuner
    path: Path
    hyperparameters: list
    started_at: float
    ended_at: float


def run_search(args, entry_point, config_space, out=sys.stdout):
    """Run Syne Tune's tuning loop here: the scheduler proposes configurations, the backend runs each as a
    trial (`python entry_point` in a child process, or with --ray-address a Ray task on the cluster: call
    connect_to_ray first), and the Tuner starts a trial whenever a worker is free (with --sync, a batch when all
    are) until the budget is spent. Files that cannot be written, and too many failed trials, end the search
    with a RunFailed."""
    results_dir = Path(args.results_dir).resolve()
    results_dir.mkdir(parents=True, exist_ok=True)
    os.environ["SYNETUNE_FOLDER"] = str(results_dir)  # Syne Tune's way to say where experiments are written
    if args.ray_address:
        backend = RayTrials(str(entry_point), cpus=config_space.get("threads", 1), gpus=1 if args.cuda else 0)
    else:
        backend = TrialProcesses(str(entry_point), rotate_gpus=args.cuda, trial_timeout=args.trial_timeout)
    hyperparameters = [name for name, domain in config_space.items() if isinstance(domain, Domain)]
    write_failures = []  # files of the results that could not be written (KeptResults, LogFile)
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
        callbacks=[KeptResults(write_failures), ProgressLog(out, hyperparameters, args.max_epochs)],
        save_tuner=False,
        output_logger=TunerLogger(use_colors=False, use_emojis=False),
    )
    started_at = time.time()
    try:
        with messages_to_log(tuner.tuner_path, write_failures):
            tuner.run()
    except ValueError:  # Syne Tune's way to say that more than max_failures trials failed
        if tuner.tuning_status.num_trials_failed <= args.max_failures:
            raise
        raise RunFailed(too_many_failures(tuner, args.max_failures)) from None
    except (CannotWrite, OSError) as error:
        raise RunFailed(cannot_write(error, tuner.tuner_path)) from None
    if write_failures:  # the last write of the results, after the loop
        raise RunFailed(cannot_write(write_failures[0], tuner.tuner_path))
    return Search(tuner, tuner.tuner_path, hyperparameters, started_at, time.time())


def report_search(args, search):
    """Summary table, the two figures and the final JSON line (best configuration and its validation error),
    all from the results as Syne Tune stored them."""
    experiment = load_experiment(search.tuner.name, local_path=str(Path(args.results_dir).resolve()))
    if experiment.results is None:
        raise UsageError(f"no trial reported a result within --max-wallclock-time {args.max_wallclock_time}; "
                         f"give it more time (trial logs: {search.path})")
    rows = trial_outcomes(search, experiment.results, args.max_epochs)
    print_table(rows, search.hyperparameters)
    try:
        figures = plot_figures(experiment.results, search.started_at, search.path)
    except CannotWrite as error:
        raise RunFailed(cannot_write(error, search.path)) from None
    emit_result("async_hpo", model=args.model, scheduler=args.scheduler, sync=args.sync, n_workers=args.n_workers,
                **summarize(search, rows, args.n_workers), trials=rows, experiment=search.tuner.name,
                results_dir=str(Path(args.results_dir).resolve()), figures={k: str(v) for k, v in figures.items()},
                **({"ray_address": args.ray_address} if args.ray_address else {}))


def main():
    if TRIAL_FLAG in sys.argv[1:]:  # started by Syne Tune as one trial, the way torchrun's RANK marks a worker
        trial_main(sys.argv[1:])
        return
    args = parse_args(Args)
    validate(args)
    script = Path(__file__).resolve()
    threads = threads_per_trial(args, script)  # with --ray-address, this joins the cluster (or says it cannot)
    # Find (or download) and verify the data once here, so a problem is one line before any trial starts
    folder = fashion_mnist_dir(args.data_dir)
    train_size = len(load_split(folder, args.holdout, None, args.seed)[0])
    check(args.limit_train is None or args.limit_train <= train_size,
          f"--limit-train {args.limit_train} is more than the {train_size} training images")
    config_space = {
        **search_space(args.model),
        # constants travel to every trial with its configuration (and are recorded with its results)
        "model": args.model,
        "max_epochs": args.max_epochs,
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


# ---------------------------------------------------------------------------------------------------------
# The tutorial's exercise 4: local search, written as a Syne Tune searcher (--scheduler local)
# ---------------------------------------------------------------------------------------------------------

class LocalSearcher(SingleObjectiveBaseSearcher):
    """Proposes configurations near the best one seen so far (the incumbent). Lives in the tuner process.

    Each hyperparameter of the incumbent takes a random step: a float or integer one moves by a Gaussian step
    of standard deviation `step` x its range (on the log scale when it is searched on one: learning rate,
    hidden sizes), clipped to the range and rounded for integers; a categorical one is replaced by another
    category with probability `step`. Before any trial has reported, it proposes points_to_evaluate and then
    random configurations, as random search does. The incumbent is the configuration with the lowest metric
    in any report (Syne Tune passes the metric to minimise), so the search moves as soon as a trial reports a
    better epoch, without waiting for it to finish. All draws come from one generator seeded with random_seed.
    """

    def __init__(self, config_space, points_to_evaluate=None, random_seed=None, step=LOCAL_STEP):
        super().__init__(config_space, points_to_evaluate=points_to_evaluate, random_seed=random_seed)
        self.step = step
        self.random_state = np.random.RandomState(self.random_seed)
        self.incumbent, self.incumbent_metric = None, math.inf

    def on_trial_result(self, trial_id, config, metric):
        if metric < self.incumbent_metric:
            self.incumbent, self.incumbent_metric = dict(config), metric

    def on_trial_complete(self, trial_id, config, metric):
        self.on_trial_result(trial_id, config, metric)

    def suggest(self):
        config = self._next_points_to_evaluate()
        if config is not None:
            return config
        domains = {name: domain for name, domain in self.config_space.items() if isinstance(domain, Domain)}
        if self.incumbent is None:
            return {name: domain.sample(random_state=self.random_state) for name, domain in domains.items()}
        return {name: self.near(domain, self.incumbent[name]) for name, domain in domains.items()}

    def near(self, domain, value):
        """A random value of domain near value."""
        if isinstance(domain, Categorical):
            others = [category for category in domain.categories if category != value]
            if others and self.random_state.rand() < self.step:
                return others[self.random_state.randint(len(others))]
            return value
        assert isinstance(domain, (Float, Integer)), f"local search cannot step in a {type(domain).__name__}"
        scale = np.log if is_log_space(domain) else (lambda x: x)
        low, high = scale(domain.lower), scale(domain.upper)
        moved = np.clip(scale(value) + self.random_state.normal(0.0, self.step * (high - low)), low, high)
        moved = np.exp(moved) if is_log_space(domain) else moved
        if isinstance(domain, Integer):
            return int(np.clip(round(moved), domain.lower, domain.upper))
        return float(np.clip(moved, domain.lower, domain.upper))


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: trial bookkeeping. Each trial records when it started, where it ran and on which
# machine; it dies with the tuner; a trial that is stopped or hung is killed and counted as failed.
# ---------------------------------------------------------------------------------------------------------

def start_trial(config, trial_dir):
    """What a trial does before training: die with the tuner (on Ray, with the Ray worker that started it), take
    its share of the cores, find its device, and write TRIAL_INFO_FILE: the start of its busy interval (its
    process's start time; Syne Tune stamps the end), its device and its machine. Returns the device."""
    die_with_parent(config["tuner_pid"])
    started_at = process_start_time()
    torch.set_num_threads(config["threads"])
    # With several GPUs, Syne Tune's backend has set CUDA_VISIBLE_DEVICES to this trial's GPU, so "cuda" is it
    device = torch.device(config["device"])
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    info = {"started_at": started_at, "device": describe_device(device), "host": socket.gethostname()}
    (trial_dir / TRIAL_INFO_FILE).write_text(json.dumps(info))
    print(f"trial on {info['device']} | host {info['host']}", flush=True)
    return device


def process_start_time():
    """Wall-clock time at which this process was created, so a trial's busy time includes its start-up."""
    try:
        # /proc/self/stat field 22 is the start time in clock ticks after boot; /proc/uptime is now after boot
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


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


def process_activity(pid):
    """(state letter, CPU clock ticks used so far) of a process, from /proc/PID/stat; None where it cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[11]) + int(fields[12])  # state, user + system time of all its threads
    except (OSError, IndexError, ValueError):
        return None


def describe_exit(returncode):
    return f"killed by {signal.Signals(-returncode).name}" if returncode < 0 else f"exit status {returncode}"


class WatchedTrial:
    """A trial's child process as the local backend sees it (poll, kill, returncode), watched for signs of life.

    A trial that uses no CPU time and writes no line to its std.out or std.err for `timeout` seconds is killed
    (SIGKILL: a stopped process would never act on SIGTERM) and ends as failed, with the reason in `reason` and
    at the end of its std.err: stopped (SIGSTOP, Ctrl-Z) or hung (blocked, waiting on nothing that comes).
    Without this, a stopped trial would hold its worker until the budget ran out. The check runs at most once
    a second, from poll(), which the tuner calls every loop. Lives in the tuner process."""

    def __init__(self, process, trial_path, timeout):
        self.process, self.trial_path, self.timeout = process, trial_path, timeout
        self.pid, self.returncode, self.reason, self.killed = process.pid, None, None, False
        self.last_seen, self.last_change, self.next_check = None, time.monotonic(), 0.0

    def poll(self):
        if self.returncode is None:
            self.returncode = self.process.poll()
            if self.returncode is None and self.timeout:
                self.watch()
        return self.returncode

    def watch(self):
        now = time.monotonic()
        if now < self.next_check:
            return
        self.next_check = now + 1.0
        activity = process_activity(self.pid)
        if activity is None:  # not Linux, or just ended: nothing to judge
            return
        state, cpu_ticks = activity
        seen = (cpu_ticks, *(self.output_size(name) for name in ("std.out", "std.err")))
        if seen != self.last_seen:
            self.last_seen, self.last_change = seen, now
            return
        silent = now - self.last_change
        if silent > self.timeout:
            how = "stopped" if state in "Tt" else "hung"
            self.reason = (f"pid {self.pid} {how}: used no CPU time and wrote nothing for {silent:.0f} s "
                           f"(--trial-timeout {self.timeout:g}), killed")
            self.kill()
            self.returncode = self.process.wait()
            with contextlib.suppress(OSError), open(self.trial_path / "std.err", "a") as log:
                log.write(f"async_hpo: {self.reason}\n")

    def output_size(self, name):
        with contextlib.suppress(OSError):
            return (self.trial_path / name).stat().st_size
        return None

    def kill(self):
        """Kill the trial and any processes it started, if it still runs."""
        if self.killed or self.process.poll() is not None:
            return
        self.killed = True
        import psutil
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.pid).children(recursive=True):
                child.kill()
        self.process.kill()


class TrialProcesses(LocalBackend):
    """Syne Tune's local backend (trials are child processes of the tuner), with each trial a WatchedTrial, and
    stopping that kills first and writes after, so that a full disk cannot leave a trial running. Lives in the
    tuner process."""

    def __init__(self, entry_point, rotate_gpus=False, trial_timeout=None):
        super().__init__(entry_point=entry_point, pass_args_as_json=True, rotate_gpus=rotate_gpus)
        self.trial_timeout = trial_timeout

    def _schedule(self, trial_id, config):
        super()._schedule(trial_id, config)
        process = self.trial_subprocess[trial_id]
        self.trial_subprocess[trial_id] = WatchedTrial(process, self.trial_path(trial_id), self.trial_timeout)

    def _kill_process(self, trial_id):
        self.trial_subprocess[trial_id].kill()

    def _stop_trial(self, trial_id, result):
        self._kill_process(trial_id)
        super()._stop_trial(trial_id, result)  # writes its `stop` mark, which a full disk may refuse

    def stop_all(self):
        """Stop every running trial; whatever fails on the way (a file that cannot be written), none is left."""
        try:
            super().stop_all()
        finally:
            for trial in self.trial_subprocess.values():
                trial.kill()

    def failure_reason(self, trial_id):
        trial = self.trial_subprocess[trial_id]
        return trial.reason or describe_exit(trial.returncode)

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


def threads_per_trial(args, script):
    """--trial-threads, or each trial's share of this machine's cores; with --ray-address, join the cluster and
    take the CPUs Ray reserves for each trial (cpus_per_trial)."""
    if not args.ray_address:
        return args.trial_threads or max(1, usable_cpus() // args.n_workers)
    nodes = connect_to_ray(args.ray_address, script)
    threads = cpus_per_trial(nodes, args.n_workers, 1 if args.cuda else 0)
    check(threads >= 1, f"--n-workers {args.n_workers}: the Ray cluster at {args.ray_address} cannot run that "
                        f"many trials at once ({sum(c for c, _ in nodes)} CPUs, {sum(g for _, g in nodes)} GPUs "
                        f"on {len(nodes)} nodes{'; one GPU per trial' if args.cuda else ''}); lower --n-workers")
    return threads


def too_many_failures(tuner, max_failures):
    """The one line for a search that stopped because more than max_failures trials failed: the first failed
    trial, why, and where its log is."""
    failed = [trial_id for trial_id, status in tuner.tuning_status.last_trial_status_seen.items()
              if status == Status.failed]
    first = min(failed)
    return (f"trial {first} failed ({tuner.trial_backend.failure_reason(first)}; its log: "
            f"{tuner.tuner_path / str(first) / 'std.err'}); {len(failed)} failed trial{'s' * (len(failed) > 1)}, "
            f"more than --max-failures {max_failures}: the search stopped")


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: the tuner's console, its log and its results files. One line per trial event on the
# console; Syne Tune's messages in tuner.log; results written atomically, and a run that cannot write them
# ends with one line; SIGINT and SIGTERM stop every trial.
# ---------------------------------------------------------------------------------------------------------

class ProgressLog(TunerCallback):
    """One line per trial event (started, finished, stopped early, failed). Lives in the tuner process."""

    def __init__(self, out, hyperparameters, max_epochs):
        self.out, self.hyperparameters, self.max_epochs = out, hyperparameters, max_epochs
        self.best, self.ended = float("inf"), set()
        self.backend = None

    def on_tuning_start(self, tuner):
        self.backend = tuner.trial_backend

    def _line(self, text):
        print(text, file=self.out, flush=True)

    def on_start_trial(self, trial):
        self._line(f"trial {trial.trial_id} started | " + " | ".join(
            f"{SHORT_NAMES.get(name, name)} {trial.config[name]:.4g}" for name in self.hyperparameters))

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
                self._line(f"trial {trial_id} failed | {self.backend.failure_reason(trial_id)} | "
                           f"log {self.backend.trial_path(trial_id) / 'std.err'}")


class CannotWrite(Exception):
    """A file of the results could not be written (full disk, file-size limit, read-only folder)."""

    def __init__(self, path, error):
        super().__init__(f"{path}: {error.strerror or error}")
        self.path, self.error = path, error


WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM)


def cannot_write(error, experiment):
    """The one line for results that could not be written: which file, why, what to do, what is kept. Other
    errors than a failed write are not this function's to explain: they are raised again."""
    if isinstance(error, OSError):
        if error.errno not in WRITE_ERRORS:
            raise error
        error = CannotWrite(error.filename or experiment, error)
    return (f"cannot write {error.path} ({error.error.strerror or error.error}): free space on that disk, lift the "
            f"file-size limit or pass another --results-dir; every trial was stopped, and what was written "
            f"before is intact in {experiment}")


class KeptResults(StoreResultsCallback):
    """Syne Tune's record of every report (results.csv.zip, what load_experiment reads), written atomically: a
    write that fails keeps the previous file whole, is added to `failures`, and ends the search at the end of
    the tuner's loop (every callback's on_loop_end runs there) rather than letting it run on unrecorded. A
    failure that another writer (LogFile) added ends it the same way. Lives in the tuner process."""

    def __init__(self, failures):
        super().__init__()
        self.failures = failures

    def store_results(self):
        if self.csv_file is None:
            return
        packed = io.BytesIO()
        self.dataframe().to_csv(packed, index=False, compression={"method": "zip", "archive_name": "results.csv"})
        try:
            write_atomic(self.csv_file, packed.getvalue())
        except OSError as error:
            self.failures.append(CannotWrite(self.csv_file, error))

    def on_loop_end(self):
        if self.failures:
            raise self.failures[0]


class LogFile(io.TextIOBase):
    """tuner.log as a text stream that never raises: a write that fails (full disk) is added to `failures` and
    later writes are dropped, so that Syne Tune's clean-up, which prints as it stops the trials, runs to the end.
    Lives in the tuner process."""

    def __init__(self, path, failures):
        self.path, self.failures = path, failures
        self.file = open(path, "a")

    def write(self, text):
        if self.file is not None:
            try:
                self.file.write(text)
                self.file.flush()
            except OSError as error:
                self.failures.append(CannotWrite(self.path, error))
                self.close()
        return len(text)

    def close(self):
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()
            self.file = None


@contextlib.contextmanager
def messages_to_log(experiment, failures):
    """Syne Tune's banners, status tables and log messages, and Python warnings (e.g. botorch's), go to
    experiment/tuner.log while the search runs; the console keeps ProgressLog's lines."""
    experiment.mkdir(parents=True, exist_ok=True)
    log = LogFile(experiment / "tuner.log", failures)
    root = logging.getLogger()  # where Syne Tune's loggers, botorch's messages and captured warnings end up
    saved = root.handlers, root.level
    root.handlers = [logging.StreamHandler(log)]  # for the run only: syne_tune.report gave root a stderr handler
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    try:
        with contextlib.redirect_stdout(log):
            yield
    finally:
        logging.captureWarnings(False)
        root.handlers, level = saved
        root.setLevel(level)
        log.close()


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


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: the summary. A table of every trial, worker utilisation, the tutorial's two figures
# ---------------------------------------------------------------------------------------------------------

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
            "trial": trial_id, "status": status, **{name: config.get(name) for name in search.hyperparameters},
            "epochs": epochs,
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
        "best_config": {name: best[name] for name in search.hyperparameters} if best else None,
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


def print_table(rows, hyperparameters):
    def number(value, spec):
        return "-" if value is None else format(value, spec)

    def spec(name):
        return "d" if any(isinstance(row[name], int) and not isinstance(row[name], bool) for row in rows) else ".4f"
    widths = {name: max(len(name), 6) for name in hyperparameters}
    print("trial | status    | " + " | ".join(hyperparameters) + " | epochs | val err | best err | busy s")
    for row in rows:
        print(f"{row['trial']:5d} | {row['status']:9s} | "
              + " | ".join(f"{number(row[name], spec(name)):>{widths[name]}s}" for name in hyperparameters)
              + f" | {row['epochs']:6d} | {number(row['val_err'], '.4f'):>7s} | "
              f"{number(row['best_err'], '.4f'):>8s} | {row['busy_s']:6.1f}")


def plot_figures(results, started_at, path):
    """The tutorial's two figures: the incumbent (best validation error so far) and every trial's learning
    curve, both over wall-clock time since the tuner started (from the trials' report timestamps). Each is
    written atomically; one that cannot be written raises CannotWrite."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    results = results.assign(wall=results[ST_WORKER_TIMESTAMP] - started_at).sort_values("wall")
    figures = {"incumbent": path / "incumbent.png", "learning_curves": path / "learning_curves.png"}
    incumbent, ax = plt.subplots(figsize=(6, 3.5))
    ax.step(results["wall"], results[METRIC].cummin(), where="post")
    ax.set(xlabel="wall-clock time (s)", ylabel=f"best {METRIC}", title="incumbent")
    curves, ax = plt.subplots(figsize=(6, 2.5))
    for _, trial in results.groupby("trial_id"):
        ax.plot(trial["wall"], trial[METRIC], marker="o", markersize=3)
    ax.set(xlabel="wall-clock time (s)", ylabel=METRIC, title="learning curve of every trial")
    for name, fig in (("incumbent", incumbent), ("learning_curves", curves)):
        png = io.BytesIO()
        fig.tight_layout()
        fig.savefig(png, format="png", dpi=100)
        plt.close(fig)
        try:
            write_atomic(figures[name], png.getvalue())
        except OSError as error:
            raise CannotWrite(figures[name], error) from None
    return figures


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
                         f"--head` or fix the address") from None
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
    """The tuner's handle on one trial running as a Ray task, with what the local backend uses of a process:
    poll(), kill(), returncode (and `reason` when Ray lost it). Lives in the tuner process."""

    def __init__(self, stream, trial_path):
        self.stream, self.trial_path = stream, trial_path
        self.returncode, self.reason, self.killed = None, None, False

    def poll(self):
        """Append what the trial wrote since the last call to the files of its folder here; return its exit
        status once it has ended, 1 (with the reason in std.err) when Ray lost it: its node died, its worker
        was killed."""
        import ray
        while self.returncode is None and self.stream.next_ready():
            try:
                name, text = ray.get(next(self.stream))
            except ray.exceptions.RayError as error:
                self.reason = None if self.killed else f"ray: {str(error).splitlines()[0]}"
                name, text = "std.err", f"{self.reason}\n" if self.reason else ""
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
        if not self.killed and self.returncode is None:
            self.killed = True
            ray.cancel(self.stream, force=True)  # kills the Ray worker, and so the trial process it started


class RayTrials(TrialProcesses):
    """The local backend with each trial a Ray task somewhere on the cluster instead of a child process here;
    the rest is the local backend's: each trial's folder here gets its config.json, and std.out, std.err
    and TRIAL_INFO_FILE as the trial writes them on its node (RayTrial.poll), results are parsed from std.out,
    and stopping a trial (ASHA, the budget, Ctrl-C) kills it. Lives in the tuner process."""

    def __init__(self, entry_point, cpus, gpus):
        import ray
        super().__init__(entry_point)
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

    def stop_all(self):
        """Stop every running trial, then wait (a bounded time) until Ray reports each of their tasks ended."""
        import ray
        super().stop_all()
        ended = [trial.stream.completed() for trial in self.trial_subprocess.values()]
        if ended:
            ray.wait(ended, num_returns=len(ended), timeout=RAY_STOP_TIMEOUT_S, fetch_local=False)


if __name__ == "__main__":
    run_main(main)
