"""Asynchronous random search with Syne Tune: D2L 19.3's search over LeNet on Fashion-MNIST (plus BO, ASHA, local
search, and trials on a Ray cluster).

A tuner process samples hyperparameter configurations (learning rate, batch size) and runs each one as a trial: this
file started again as a separate process, which trains LeNet and reports its validation error after every epoch.
`--n-workers` trials run at once. Asynchronous scheduling starts the next trial as soon as a worker is free, so no
worker waits for a slow trial; `--sync` is the synchronous baseline, which starts the next batch only when the whole
batch has finished, and the worker utilisation (busy trial time / (workers x wall time)) shows the difference. The
tutorial's code comes first; below it, Syne Tune's other schedulers (`--scheduler bo | gp | asha`), the tutorial's
exercises (`--model mlp`: DropoutMLP; `--scheduler local`: local search around the best configuration so far), GPUs,
trials on a Ray cluster (`--ray-address`) and the bookkeeping (a line per trial event, a table of every trial).

    python async_hpo.py                                   # the tutorial: random search, 2 workers, 720 s budget
    python async_hpo.py --scheduler asha --n-workers 4    # stop bad trials early
    python async_hpo.py --sync                            # synchronous baseline, same budget
    python async_hpo.py --model mlp --scheduler gp        # DropoutMLP, Gaussian-process BO
    python async_hpo.py --model mlp --scheduler local     # DropoutMLP, local search around the best so far
    python async_hpo.py --cuda                            # trials on GPUs, --trials-per-gpu of them on each
    python async_hpo.py --ray-address auto                # trials on the Ray cluster `ray start` began here
    python async_hpo.py --max-trials 6 --max-epochs 2 --limit-train 5000 --activation relu   # a quick look

Each run writes RESULTS_DIR/async-hpo-<scheduler>-<time>/ (--results-dir): Syne Tune's metadata.json and
results.csv.zip (read them with `syne_tune.experiments.load_experiment(name, local_path=RESULTS_DIR)`),
incumbent.png, learning_curves.png, and one folder per trial with its config.json, std.out and std.err. Syne Tune
prints a line per trial event; the run ends with a table of every trial and one JSON line:

     trial    status  learning_rate  batch_size  epochs  val_err  best_err  busy_s
         0 completed            0.1         128      10        E         E       S
    {"script": "async_hpo", "model": "lenet", "scheduler": "random", ..., "best_config": {"learning_rate": ...,
     "batch_size": ...}, "best_validation_error": ..., "trials_started": ..., "utilisation": ..., ...}
"""

import dataclasses
import functools
import io
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from datetime import datetime
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import pandas as pd
import torch
from syne_tune import Reporter, StoppingCriterion, Tuner
from syne_tune.backend import LocalBackend
from syne_tune.backend.trial_status import Status, Trial
from syne_tune.config_space import Domain, is_log_space, lograndint, loguniform, randint, uniform
from syne_tune.constants import ST_CHECKPOINT_DIR, ST_CONFIG_JSON_FNAME_ARG, ST_TUNER_TIME
from syne_tune.experiments import load_experiment
from syne_tune.optimizer.baselines import ASHA, TPE, BOTorch, RandomSearch
from syne_tune.optimizer.scheduler import SchedulerDecision
from syne_tune.optimizer.schedulers.searchers.random_searcher import RandomSearcher
from syne_tune.optimizer.schedulers.searchers.single_objective_searcher import SingleObjectiveBaseSearcher
from syne_tune.optimizer.schedulers.single_objective_scheduler import SingleObjectiveScheduler
from syne_tune.report import retrieve
from syne_tune.results_callback import StoreResultsCallback
from syne_tune.tuner_callback import TunerCallback
from syne_tune.tuner_logger import TunerLogger
from syne_tune.util import dump_json_with_numpy
from torch import nn

import common
from common import check


@dataclasses.dataclass
class Args:
    # The tutorial's settings
    n_workers: common.Positive = 2
    """trials running at the same time (on a Ray cluster: across the cluster)"""
    max_wallclock_time: common.PositiveFloat = 720.0
    """the search's budget in seconds: trials still running then are stopped"""
    max_epochs: common.Positive = 10
    """epochs per trial (ASHA's maximum resource)"""
    seed: common.Seed = 0
    """seed of the configuration sampling, of every trial's initial parameters and of its data order"""
    # Model and data
    model: Literal["lenet", "mlp"] = "lenet"
    """lenet: the tutorial's convolutional network, searched over learning rate and batch size; mlp: the exercises'
    multilayer perceptron with dropout (D2L 5.6), searched over its hidden sizes and dropout rates too"""
    activation: Literal["sigmoid", "relu"] = "sigmoid"
    """the convolutional network's activation: sigmoid as in the tutorial; relu learns sooner (for short runs)"""
    data_dir: Optional[str] = None
    """folder with the Fashion-MNIST .gz files (or its parent); not given: the download cache"""
    limit_train: Optional[common.Positive] = None
    """train every trial on the first N training images only; not given: all of them"""
    holdout: bool = False
    """validate on 10,000 images held out of the training set instead of the test set"""
    # Beyond the tutorial: the search
    scheduler: Literal["random", "bo", "gp", "asha", "local"] = "random"
    """random: random search (the tutorial); bo: Syne Tune's TPE, a model-based searcher; gp: Gaussian-process Bayesian
    optimisation (botorch); asha: random search that stops trials worse than most at the same epoch; local: steps
    from the best configuration so far"""
    sync: bool = False
    """synchronous baseline: start the next batch of n_workers trials only when the whole batch has finished"""
    max_trials: Optional[common.Positive] = None
    """start this many trials and let them finish (the budget still holds); not given: as many as the budget allows"""
    max_failures: common.NonNegative = 3
    """failed trials tolerated; one more stops the search with an error"""
    # Output
    results_dir: str = "runs/async_hpo"
    """folder that receives one folder per search (Syne Tune's SYNETUNE_FOLDER)"""
    # Devices and launch
    cuda: bool = False
    """train the trials on GPUs (the accelerator torch finds), each trial on one"""
    trials_per_gpu: common.Positive = 2
    """with --cuda, trials that may share one GPU (2: the tutorial's two workers on one): on this machine up to N
    running trials per GPU, on Ray each trial reserves 1/N of one"""
    trial_threads: Optional[common.Positive] = None
    """CPU threads per trial (on Ray, the CPUs it reserves for each); not given: this machine's cores / --n-workers (on
    Ray: the most that lets --n-workers trials run at once)"""
    ray_address: Optional[str] = None
    """run the trials as Ray tasks on the cluster at HOST:PORT, or auto for the one that `ray start` began on this
    machine; not given: trials run on this machine"""


def validate(args):
    """The rules that involve several flags or this machine: one line and exit status 2 each, before any data is
    read."""
    check(args.ray_address not in ("", "local") and "://" not in (args.ray_address or ""), f"--ray-address "
          f"{args.ray_address!r}: give a running cluster's HOST:PORT, or auto")
    gpus = torch.accelerator.device_count()
    check(not args.cuda or args.ray_address or gpus > 0, "--cuda: no GPU on this machine; run without --cuda")
    check(not args.cuda or args.ray_address or args.n_workers <= gpus * args.trials_per_gpu, f"--n-workers "
          f"{args.n_workers}: more trials at once than the {gpus} GPU(s) here hold at --trials-per-gpu "
          f"{args.trials_per_gpu}; pass a larger --trials-per-gpu, or fewer workers")


# --- The tutorial (D2L 19.3): the objective, the configuration space, the scheduler, the backend, the tuner ---

METRIC, RESOURCE = "validation_error", "epoch"  # what each trial reports after every epoch; Syne Tune minimises METRIC
HOLDOUT_SIZE = 10_000


def init_cnn(module):
    """The tutorial's initialisation: Xavier for the weights of every convolution and linear layer."""
    if type(module) in (nn.Conv2d, nn.Linear):
        nn.init.xavier_uniform_(module.weight)


def lenet(activation="sigmoid", num_classes=10):
    """The tutorial's LeNet-5 for 28x28 grey images (its `net`): sigmoid, average pooling, Xavier initialisation."""
    act = {"sigmoid": nn.Sigmoid, "relu": nn.ReLU}[activation]
    net = nn.Sequential(
        nn.Conv2d(1, 6, kernel_size=5, padding=2), act(), nn.AvgPool2d(kernel_size=2, stride=2),
        nn.Conv2d(6, 16, kernel_size=5), act(), nn.AvgPool2d(kernel_size=2, stride=2),
        nn.Flatten(), nn.Linear(16 * 5 * 5, 120), act(), nn.Linear(120, 84), act(), nn.Linear(84, num_classes))
    return net.apply(init_cnn)


def load_split(folder, holdout, train_size, seed):
    """(train images, train labels, validation images, validation labels), images uint8 [N, 28, 28]. Validation is
    the 10k test split, as in the tutorial, or with holdout 10k training images chosen with the seed (the same for
    every trial, so that trials compare on the same images)."""
    train_x, train_y, test_x, test_y = common.load_fashion_mnist(folder)
    if holdout:
        order = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(seed))
        val, train = order[:HOLDOUT_SIZE], order[HOLDOUT_SIZE:]
        return train_x[train][:train_size], train_y[train][:train_size], train_x[val], train_y[val]
    return train_x[:train_size], train_y[:train_size], test_x, test_y


def as_input(images):
    return images.unsqueeze(1).float().div_(255)


@torch.no_grad()
def validation_error(model, images, labels, batch_size=256):
    """The share of the images the model gets wrong, in batches whose activations stay in a CPU's cache."""
    model.eval()
    batches = zip(images.split(batch_size), labels.split(batch_size))
    return sum((model(as_input(x)).argmax(1) != y).sum() for x, y in batches).item() / len(labels)


def hpo_objective_lenet_synetune(config, model=None, device="cpu"):
    """The objective: train LeNet (or the given model) with the configuration's learning rate and batch size, and
    report the validation error after every epoch with Syne Tune's Reporter, which prints it for the tuner to read."""
    model = (lenet(config["activation"]) if model is None else model).to(device)
    train_x, train_y, val_x, val_y = (tensor.to(device) for tensor in load_split(
        config["data_folder"], config["holdout"], config["train_size"], config["seed"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["learning_rate"])
    order = torch.Generator().manual_seed(config["seed"])
    report = Reporter()
    for epoch in range(1, config["max_epochs"] + 1):
        model.train()
        for index in torch.randperm(len(train_x), generator=order).to(device).split(config["batch_size"]):
            loss = nn.functional.cross_entropy(model(as_input(train_x[index])), train_y[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        report(**{RESOURCE: epoch, METRIC: validation_error(model, val_x, val_y)})


def make_config_space(args, data_folder):
    """The tutorial's configuration space: learning rate and batch size are searched; the other entries are
    constants, which Syne Tune hands to every trial with its configuration."""
    return {"learning_rate": loguniform(1e-2, 1), "batch_size": randint(32, 256), "max_epochs": args.max_epochs,
            "activation": args.activation, "data_folder": str(data_folder), "holdout": args.holdout, "seed": args.seed,
            "train_size": args.limit_train or common.FASHION_MNIST_TRAIN - HOLDOUT_SIZE * args.holdout}


INITIAL_CONFIG = {"learning_rate": 0.1, "batch_size": 128}  # the tutorial's first configuration


def random_search(args, config_space, initial_config=INITIAL_CONFIG):
    """The tutorial's scheduler: a random configuration for every free worker, the tutorial's one first."""
    return RandomSearch(config_space, metrics=[METRIC], do_minimize=True, points_to_evaluate=[initial_config],
                        random_seed=args.seed)


def tune(args, scheduler, tuner_name, callbacks=None, backend=LocalBackend, entry_point=__file__):
    """The tutorial's backend and tuner. The backend runs each trial as entry_point (this script) started again as a
    child process of this one, which reads its configuration from a JSON file. The tuner, whenever one of the
    n_workers workers is free, asks the scheduler for a configuration and starts it as a trial on the backend, hands
    the trials' reports to the scheduler, and stops at the budget. (Beyond the tutorial, backend is a subclass.)"""
    trial_backend = backend(entry_point=str(Path(entry_point).resolve()), pass_args_as_json=True)
    stop_criterion = StoppingCriterion(max_wallclock_time=args.max_wallclock_time)
    Tuner(trial_backend=trial_backend, scheduler=scheduler, stop_criterion=stop_criterion, n_workers=args.n_workers,
          # beyond the tutorial: --sync, --max-failures, bookkeeping, and a free worker reused within 0.1 s
          asynchronous_scheduling=not args.sync, max_failures=args.max_failures, callbacks=callbacks,
          tuner_name=tuner_name, sleep_time=0.1, save_tuner=False,
          output_logger=TunerLogger(use_colors=False, use_emojis=False)).run()


FIGURES = {"incumbent": "incumbent.png", "learning_curves": "learning_curves.png"}  # in the search's folder


def plot_figures(results, folder):
    """The tutorial's two figures from the results, written into folder as FIGURES names them: the incumbent (the
    best validation error so far) and every trial's learning curve, over the tuner's wall-clock time. Returns their
    paths."""
    from matplotlib.figure import Figure
    incumbent = Figure(figsize=(6, 3.5)).add_subplot(xlabel="wall-clock time (s)", ylabel=f"best {METRIC}",
                                                     title="incumbent")
    incumbent.plot(results[ST_TUNER_TIME], results[METRIC].cummin())
    curves = Figure(figsize=(6, 3.5)).add_subplot(xlabel="wall-clock time (s)", ylabel="objective function",
                                                  title="learning curve of every trial")
    for _, trial in results.groupby("trial_id"):
        curves.plot(trial[ST_TUNER_TIME], trial[METRIC], marker="o", markersize=3)
    paths = {name: folder / file for name, file in FIGURES.items()}
    for axes, path in zip((incumbent, curves), paths.values()):
        common.save_figure(axes.figure, path)
    return paths


# --- Beyond the tutorial: other schedulers, --max-trials, and the exercises' model and local searcher ---

def dropout_mlp(num_hiddens_1, num_hiddens_2, dropout_1, dropout_2, num_classes=10):
    """D2L 5.6's DropoutMLP: two ReLU hidden layers, each followed by dropout (PyTorch's default initialisation, as
    the tutorial's LazyLinear layers)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, num_hiddens_1), nn.ReLU(), nn.Dropout(dropout_1),
                         nn.Linear(num_hiddens_1, num_hiddens_2), nn.ReLU(), nn.Dropout(dropout_2),
                         nn.Linear(num_hiddens_2, num_classes))


MLP_SPACE = {"num_hiddens_1": lograndint(32, 1024), "num_hiddens_2": lograndint(32, 1024),
             "dropout_1": uniform(0.0, 0.8), "dropout_2": uniform(0.0, 0.8)}  # and the tutorial's two
MLP_INITIAL_CONFIG = {"learning_rate": 0.1, "batch_size": 256, "num_hiddens_1": 256, "num_hiddens_2": 256,
                      "dropout_1": 0.5, "dropout_2": 0.5}  # D2L 5.6's


class LocalSearcher(RandomSearcher):
    """The tutorial's exercise 4 (--scheduler local): propose configurations near the best one seen so far (the
    incumbent). Lives in the tuner process.

    Each hyperparameter of the incumbent (a float or an integer) moves by a Gaussian step of standard deviation
    `step` x its range (on the log scale when it is searched on one: learning rate, hidden sizes), clipped to the
    range and rounded for integers; the steps are drawn from a generator seeded with random_seed. Until a trial has
    reported, it proposes what random search does: points_to_evaluate, then random configurations. The incumbent is
    the configuration with the lowest metric in any report, so the search moves as soon as a trial reports a better
    epoch."""

    def __init__(self, config_space, points_to_evaluate=None, random_seed=None, step=0.1):
        super().__init__(config_space, points_to_evaluate=points_to_evaluate, random_seed=random_seed)
        self.step, self.random_state = step, np.random.RandomState(self.random_seed)
        self.incumbent, self.incumbent_metric = None, float("inf")

    def on_trial_result(self, trial_id, config, metric):
        if metric < self.incumbent_metric:
            self.incumbent, self.incumbent_metric = dict(config), metric

    def suggest(self):
        if self.incumbent is None:
            return super().suggest()  # random search's: points_to_evaluate, then random configurations
        return {name: self.near(self.config_space[name], value) for name, value in self.incumbent.items()}

    def near(self, domain, value):
        """A random value of domain near value."""
        scale, unscale = (np.log, np.exp) if is_log_space(domain) else (float, float)
        spread = self.step * (scale(domain.upper) - scale(domain.lower))
        moved = unscale(scale(value) + self.random_state.normal(0.0, spread))
        return domain.cast(np.clip(moved, domain.lower, domain.upper))  # an int for an integer domain, rounded


def make_scheduler(args, config_space):
    """The scheduler of --scheduler, each starting with the tutorial's configuration of the model."""
    np.random.seed(args.seed)  # random search, ASHA and the GP's first samples draw from numpy's global generator
    first = MLP_INITIAL_CONFIG if args.model == "mlp" else INITIAL_CONFIG
    if args.scheduler == "random":
        return random_search(args, config_space, first)
    options = dict(metric=METRIC, do_minimize=True, random_seed=args.seed)
    if args.scheduler == "local":
        searcher = LocalSearcher(config_space, points_to_evaluate=[first], random_seed=args.seed)
        return SingleObjectiveScheduler(config_space, searcher=searcher, **options)
    if args.scheduler == "asha":
        return ASHA(config_space, time_attr=RESOURCE, max_t=args.max_epochs, points_to_evaluate=[first], **options)
    # bo: a tree-structured Parzen estimator, which needs nothing beyond Syne Tune; gp: expected improvement on a
    # Gaussian process fitted to the finished trials (botorch)
    # botorch imports linear_operator, whose functions use torch.jit.script, deprecated (a FutureWarning) in torch 2.15;
    # gpytorch says when it rounds the GP's noise up (a NumericalWarning). Nothing for a user to act on.
    warnings.filterwarnings("ignore", message="`torch.jit.script` is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message="Very small noise values detected")
    return {"bo": TPE, "gp": BOTorch}[args.scheduler](config_space, points_to_evaluate=[first], **options)


class AtMost(SingleObjectiveBaseSearcher):
    """--max-trials: the scheduler's searcher, proposing max_trials configurations, then None, Syne Tune's "nothing
    left to try": the Tuner lets the running trials finish and ends (the budget still holds). Stopping once N trials
    have finished instead would let the free workers start more meanwhile, only to cut them off."""

    def __init__(self, searcher, max_trials):
        super().__init__(searcher.config_space, random_seed=searcher.random_seed)
        self.searcher, self.left = searcher, max_trials

    def suggest(self, **kwargs):
        self.left -= 1
        return self.searcher.suggest(**kwargs) if self.left >= 0 else None

    def on_trial_result(self, *args, **kwargs):
        self.searcher.on_trial_result(*args, **kwargs)

    def on_trial_complete(self, *args, **kwargs):
        self.searcher.on_trial_complete(*args, **kwargs)


# --- Beyond the tutorial: the trial process, and each local trial's GPU ---

TRIAL_FLAG = f"--{ST_CONFIG_JSON_FNAME_ARG}"  # a backend starts each trial with this flag and its config file
CHECKPOINT_FLAG = f"--{ST_CHECKPOINT_DIR}"  # and the local backend adds this one, with the trial's checkpoint folder
TRIAL_INFO = "[trial-info]: "  # starts a line of a trial's output: JSON of where it runs


def trial_data_folder(data_folder):
    """The tuner's data folder when this machine has it, else (a trial on another machine of a Ray cluster) this
    machine's download cache, filled and checked there once."""
    return data_folder if Path(data_folder).is_dir() else common.fashion_mnist_dir(None)


def trial_main(argv):
    """A trial process: die with the process that started it (the tuner, or the Ray task), take its share of the
    cores and its device, print where it runs (a TRIAL_INFO line, which the table reads), then run the objective.

    Syne Tune's LocalBackend (0.16) splits the trial's command line at every space, so a configuration file whose
    path has spaces arrives in pieces, up to the checkpoint flag that follows it: joined again here."""
    after = argv[argv.index(TRIAL_FLAG) + 1:]
    end = after.index(CHECKPOINT_FLAG) if CHECKPOINT_FLAG in after else len(after)
    config = json.loads(Path(" ".join(after[:end])).read_text())
    common.die_with_parent()
    if os.getppid() != config["parent_pid"]:  # the parent died before the line above took effect
        raise SystemExit("the process that started this trial is gone")
    torch.set_num_threads(config["threads"])
    device = common.pick_device(config["cuda"], config.get("gpu", 0))
    where = {"device": str(device), "host": socket.gethostname(), "pid": os.getpid(), "threads": config["threads"]}
    if device.type == "cuda":  # which GPU, whatever its index (CUDA_VISIBLE_DEVICES may differ between nodes)
        where["gpu"] = f"{torch.cuda.get_device_name(device)} GPU-{torch.cuda.get_device_properties(device).uuid}"
    print(TRIAL_INFO + json.dumps(where), flush=True)
    torch.manual_seed(config["seed"])
    model = dropout_mlp(*(config[name] for name in MLP_SPACE)) if config["model"] == "mlp" else None
    hpo_objective_lenet_synetune({**config, "data_folder": trial_data_folder(config["data_folder"])}, model, device)


class LocalTrials(LocalBackend):
    """Syne Tune's local backend (each trial a child process of the tuner) giving each trial the GPU that the fewest
    running trials use (config["gpu"]), as an index among the GPUs this process sees, which the trial sees too: with
    more trials than GPUs, Syne Tune's own rotation puts every extra trial on the first busy GPU. Lives in the tuner."""

    def __init__(self, **options):
        super().__init__(rotate_gpus=False, **options)
        self.gpus = {}

    def _schedule(self, trial_id, config):  # TrialBackend's documented extension point
        busy = [self.gpus[trial] for trial, process in self.trial_subprocess.items() if process.poll() is None]
        self.gpus[trial_id] = min(range(max(1, torch.accelerator.device_count())), key=busy.count)
        super()._schedule(trial_id, {**config, "gpu": self.gpus[trial_id]})


# --- Beyond the tutorial: a line per trial event, the table of every trial, results kept whole, the summary ---

class Search(TunerCallback):
    """A row per trial for the table and the summary (Syne Tune prints a line per trial event itself): how it ended,
    its configuration, epochs, last and best validation error, busy time (from when the tuner started it to when the
    tuner saw it end, on the tuner's clock whatever machine ran it) and where it ran (its TRIAL_INFO lines). Lives in
    the tuner process."""

    def __init__(self, hyperparameters):
        self.hyperparameters, self.rows, self.errors = hyperparameters, {}, {}

    def on_tuning_start(self, tuner):
        self.path, self.backend, self.started_at = tuner.tuner_path, tuner.trial_backend, time.time()

    def on_start_trial(self, trial):
        self.errors[trial.trial_id] = []
        self.rows[trial.trial_id] = {"trial": trial.trial_id, "status": None, "busy_s": time.time(),
                                     **{name: trial.config[name] for name in self.hyperparameters}}

    def end(self, trial_id, how):
        row, errors = self.rows[trial_id], self.errors[trial_id]
        if row["status"] is None:
            info = dict(item for line in self.backend.stdout(trial_id) if line.startswith(TRIAL_INFO)
                        for item in json.loads(line[len(TRIAL_INFO):]).items())
            row.update(status=how, epochs=len(errors), val_err=errors[-1] if errors else None,
                       best_err=min(errors, default=None), busy_s=round(time.time() - row["busy_s"], 3), **info)

    def on_trial_result(self, trial, status, result, decision):
        self.errors[trial.trial_id].append(result[METRIC])
        if decision == SchedulerDecision.STOP:  # ASHA's, or its last rung
            self.end(trial.trial_id, "completed" if result[RESOURCE] >= trial.config["max_epochs"] else "stopped early")

    def on_trial_complete(self, trial, result):
        self.end(trial.trial_id, "completed")

    def on_fetch_status_results(self, trial_status_dict, new_results):
        for trial_id, (_, status) in trial_status_dict.items():
            if status == Status.failed:
                self.end(trial_id, "failed")

    def on_tuning_end(self):
        for trial_id in self.rows:
            self.end(trial_id, "cut off")  # still running when the search ended
        self.ended_at = time.time()

    def failures(self):
        """How many trials failed, and the first one's last line of error output."""
        failed = [trial_id for trial_id, row in self.rows.items() if row["status"] == "failed"]
        if not failed:
            return 0, None
        lines = [line.strip() for line in self.backend.stderr(failed[0]) if line.strip()] or ["no error output"]
        return len(failed), f"trial {failed[0]}: {lines[-1]}"


class AtomicResults(StoreResultsCallback):
    """Syne Tune's record of every report (results.csv.zip, which load_experiment reads), written atomically: a write
    that fails keeps the previous file whole."""

    def store_results(self):
        if self.csv_file is not None:
            data = io.BytesIO()
            self.dataframe().to_csv(data, index=False, compression={"method": "zip", "archive_name": "results.csv"})
            common.atomic_write(self.csv_file, data.getvalue())


def run_search(args, config_space, backend):
    """tune() on backend (a subclass of LocalBackend) with the scheduler of --scheduler (and --max-trials), the rows
    of the table and results written atomically. More failed trials than --max-failures end it in one line, after
    the log of the first that Syne Tune prints. Returns the Search."""
    os.environ["SYNETUNE_FOLDER"] = str(Path(args.results_dir).resolve())  # where Syne Tune puts experiments
    scheduler = make_scheduler(args, config_space)
    if args.max_trials:
        scheduler.searcher = AtMost(scheduler.searcher, args.max_trials)
    search = Search([key for key, value in config_space.items() if isinstance(value, Domain)])
    name = f"async-hpo-{args.scheduler}{'-sync' if args.sync else ''}"  # Syne Tune adds the time
    try:
        tune(args, scheduler, name, [search, AtomicResults()], backend)
    except ValueError:  # Syne Tune's way to say that more than max_failures trials failed
        failed, first = search.failures()
        if failed <= args.max_failures:
            raise
        sys.exit(f"{Path(sys.argv[0]).name}: error: {failed} trials failed, more than --max-failures "
                 f"{args.max_failures}: the search stopped (the first, {first}; the trials' logs: {search.path})")
    return search


def report(args, search):
    """The tutorial's ending: the best configuration (as load_experiment reads the results back); the table of every
    trial; the JSON line with the counts and the worker utilisation, busy trial time / (n_workers x wall time); then
    the tutorial's two figures."""
    experiment = load_experiment(search.path.name, local_path=str(search.path.parent))
    failed, first = search.failures()
    if experiment.results is None and failed:
        sys.exit(f"{Path(sys.argv[0]).name}: error: no trial reported a result, and {failed} failed (the first, "
                 f"{first}; the trials' logs: {search.path})")
    check(experiment.results is not None, f"no trial reported a result within --max-wallclock-time "
                                          f"{args.max_wallclock_time:g}; give it more time (the trials' logs: "
                                          f"{search.path})")
    best = search.rows[int(experiment.best_config()["trial_id"])]  # the trial of the lowest validation error
    rows, wall = pd.DataFrame(search.rows.values()), search.ended_at - search.started_at
    print(rows[["trial", "status", *search.hyperparameters, "epochs", "val_err", "best_err", "busy_s"]].to_string(
        index=False, na_rep="-", float_format="{:.5g}".format))
    count = {how: int((rows["status"] == how).sum()) for how in ("completed", "stopped early", "failed")}
    common.emit_result(
        "async_hpo", model=args.model, scheduler=args.scheduler, sync=args.sync, n_workers=args.n_workers,
        ray_address=args.ray_address, best_config={name: best[name] for name in search.hyperparameters},
        best_validation_error=best["best_err"], best_trial=best["trial"], trials_started=len(rows),
        trials_finished=sum(count.values()), trials_completed=count["completed"],
        trials_stopped_early=count["stopped early"], trials_failed=count["failed"], wall_time_s=round(wall, 1),
        utilisation=round(rows["busy_s"].sum() / (args.n_workers * wall), 4), trials=list(search.rows.values()),
        experiment=search.path.name, results_dir=str(search.path.parent),
        figures={name: str(search.path / file) for name, file in FIGURES.items()})
    plot_figures(experiment.results, search.path)  # after the result line: a failed write loses neither it nor results


# --- Beyond the tutorial: trials on a Ray cluster (--ray-address); Syne Tune still decides, Ray places and runs ---

def connect_to_ray(address, entry_point):
    """Join the Ray cluster at address as its driver; returns its alive nodes as (CPUs, GPUs) pairs.

    HOST:PORT is tried with a TCP connection first: nothing answering is one line at once, where ray.init would keep
    retrying. The trials' code travels with the job: Ray's runtime_env working_dir, the entry point's folder with
    everything excluded but the entry point and common.py (never the project's data or its .venv), uploaded once, is
    the working folder of every trial task on every node. SIGTERM then goes to Ray's own handler (sys.exit, so the
    search ends gracefully) without the crash reporter Ray's C++ core puts before it, which dumps a stack and aborts
    the driver when that end takes over 3 s (ray-project/ray#37288)."""
    target = (os.environ.get("RAY_ADDRESS") or address) if address == "auto" else address
    fix = "start one with `ray start --head`, or fix the address"
    if target != "auto":
        host, _, port = target.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
        except (OSError, ValueError, OverflowError) as error:
            raise common.UsageError(f"--ray-address {address}: nothing answers at {target} ({error}); {fix}") from None
    import ray
    try:  # "[!.]*" and ".?*" exclude every file and folder in it, but not the folder itself, as "*" would
        ray.init(address=address, runtime_env={"working_dir": str(entry_point.parent), "excludes": [
            "[!.]*", ".?*", f"!/{entry_point.name}", "!/common.py"]}, logging_level=logging.ERROR, log_to_driver=False)
    except (ConnectionError, RuntimeError, ray.exceptions.RayError) as error:  # no cluster, a token that differs
        raise common.UsageError(f"--ray-address {address}: {common.brief(error)}; {fix}") from None
    signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGTERM))  # Python's hook back in place of the reporter
    return [(int(node["Resources"].get("CPU", 0)), int(node["Resources"].get("GPU", 0)))
            for node in ray.nodes() if node["Alive"]]


def cpus_per_trial(nodes, n_workers, gpus_per_trial):
    """The most CPUs each trial can have with n_workers trials running at once on the cluster's nodes ((CPUs, GPUs)
    pairs), every trial on one node, with gpus_per_trial GPUs each; 0 when n_workers trials never fit."""
    for cpus in range(max((node_cpus for node_cpus, _ in nodes), default=0), 0, -1):
        if sum(min(node_cpus // cpus, node_gpus // gpus_per_trial if gpus_per_trial else node_cpus)
               for node_cpus, node_gpus in nodes) >= n_workers:
            return cpus
    return 0


def run_trial_on_node(entry_point, config_text):
    """A Ray task: run one trial on the node Ray placed it on, as the local backend runs it here, with this task's
    share of the node (Ray sets CUDA_VISIBLE_DEVICES and OMP_NUM_THREADS for it). Yields the trial's output (stdout
    and stderr in one stream) line by line, then its exit status. The trial reads its configuration from a pipe, so
    it leaves no file on the node; the configuration names this Ray worker as the trial's parent, so when the tuner
    cancels the task, or goes away, Ray kills the worker and the trial dies with it (trial_main). A TRIAL_INFO line
    names the node first."""
    import ray
    node = {"node": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address()}
    yield TRIAL_INFO + json.dumps(node) + "\n"
    with subprocess.Popen([sys.executable, entry_point, TRIAL_FLAG, "/dev/stdin"], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as trial:
        trial.stdin.write(json.dumps({**json.loads(config_text), "parent_pid": os.getpid()}))
        trial.stdin.close()  # (a few hundred bytes: the pipe holds them until the trial reads)
        for line in trial.stdout:  # (not `yield from`: Ray drives the task with send())
            yield line
    yield trial.returncode


class RayTrials(LocalBackend):
    """Syne Tune's local backend with each trial a Ray task (run_trial_on_node) on a node of the cluster instead of
    a child process here. Each trial's folder here gets its config.json, its output in std.out as it arrives, why
    Ray lost it (if it did) in std.err, and a `stop` file if the tuner stopped it; its reports are read from std.out,
    as the local backend does; stopping a trial cancels its task. Lives in the tuner process."""

    def __init__(self, cpus, gpus, **options):
        import ray
        super().__init__(rotate_gpus=False, **options)
        self.trials, self.streams, self.exit_codes = {}, {}, {}  # by trial id
        # SPREAD: trials on different nodes while there are free ones. No retries: a trial whose node died has
        # failed, and Syne Tune decides what runs next.
        self.task = ray.remote(run_trial_on_node).options(
            num_returns="streaming", num_cpus=cpus, num_gpus=gpus, max_retries=0, scheduling_strategy="SPREAD")

    # _schedule, _all_trial_results and _stop_trial are TrialBackend's documented extension points; this class
    # implements them anew, and inherits only LocalBackend's public methods (trial_path, stdout, stderr, ...)
    def _schedule(self, trial_id, config):
        self.trial_path(trial_id).mkdir(parents=True, exist_ok=True)
        for name, text in (("config.json", dump_json_with_numpy(config)), ("std.out", ""), ("std.err", "")):
            (self.trial_path(trial_id) / name).write_text(text)
        self.trials[trial_id] = Trial(trial_id, config, datetime.now())
        self.streams[trial_id] = self.task.remote(Path(self.entry_point).name, dump_json_with_numpy(config))

    def _all_trial_results(self, trial_ids):
        import ray
        results = []
        for trial_id in trial_ids:
            with open(self.trial_path(trial_id) / "std.out", "a") as out:
                while trial_id not in self.exit_codes and self.streams[trial_id].next_ready():
                    try:
                        item = ray.get(next(self.streams[trial_id]))
                    except ray.exceptions.RayError as error:  # its node died, its worker was killed, or cancelled
                        (self.trial_path(trial_id) / "std.err").write_text(f"ray: {common.brief(error)}\n")
                        item = 1
                    if isinstance(item, int):
                        self.exit_codes[trial_id] = item
                    else:
                        out.write(item)
            status = {None: Status.in_progress, 0: Status.completed}.get(self.exit_codes.get(trial_id), Status.failed)
            status = Status.stopped if (self.trial_path(trial_id) / "stop").exists() else status
            results.append(self.trials[trial_id].add_results(retrieve(self.stdout(trial_id)), status, None))
        return results

    def _stop_trial(self, trial_id, result):
        import ray
        ray.cancel(self.streams[trial_id], force=True)  # Ray kills the task's worker, and the trial with it
        (self.trial_path(trial_id) / "stop").touch()  # as the local backend marks a trial it stopped


# --- main: flags, data, the backend, the search, the report ---

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if TRIAL_FLAG in argv:  # started by a backend as one trial, the way torchrun's RANK marks a worker
        return trial_main(argv)
    args = common.parse_args(Args, argv)
    validate(args)
    data_folder = Path(common.fashion_mnist_dir(args.data_dir)).resolve()  # downloaded once, checked before any trial
    if args.ray_address:
        nodes = connect_to_ray(args.ray_address, Path(__file__).resolve())
        gpus_per_trial = 1 / args.trials_per_gpu if args.cuda else 0
        fit = cpus_per_trial(nodes, args.n_workers, gpus_per_trial)
        threads = args.trial_threads or fit
        check(1 <= threads <= fit, f"--n-workers {args.n_workers} with {max(threads, 1)} CPUs each: more than the "
                                   f"cluster can run at once (CPUs, GPUs of its nodes: {nodes})")
        backend = functools.partial(RayTrials, threads, gpus_per_trial)
    else:
        threads, backend = args.trial_threads or max(1, common.usable_cpus() // args.n_workers), LocalTrials
    config_space = {**make_config_space(args, data_folder), **(MLP_SPACE if args.model == "mlp" else {}),
                    "model": args.model, "threads": threads, "cuda": args.cuda, "parent_pid": os.getpid()}
    common.make_dir("--results-dir", args.results_dir)
    report(args, run_search(args, config_space, backend))


if __name__ == "__main__":
    common.run_main(main)
