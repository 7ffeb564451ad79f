"""Benchmark async_hpo.py: asynchronous against synchronous scheduling, and the tutorial's exercises.

    python benchmarks/bench_async_hpo.py      # both parts, about 30 minutes on 2 cores (data: DATA_DIR, or the cache)

- scheduling: the tuner with a trial that sleeps instead of training (this file, started by Syne Tune), so that the
  figures measure the scheduling, not the CPU: 10 "epochs" of 0.5 s x 128 / batch size each (2.5 s to 20 s a trial).
  The same random search (same seed, same configurations in the same order) for 60 s, asynchronous with 1 and 2
  workers and synchronous with 2, interleaved, 3 times: trials completed per minute, and the workers' utilisation,
  busy trial time / (workers x wall time), as async_hpo.py counts it; the median and the smallest and largest.
- exercises: D2L 19.3's exercises on DropoutMLP (`--model mlp --holdout --trial-threads 1`, 5,000 training images,
  4 epochs a trial, 75 s a search, seeds 0 to 2): random search against Bayesian optimisation (exercise 2), 1 and 2
  workers (exercise 3, which asks for 4 too, on at least 4 cores: this machine has 2), local search against random
  search (exercise 4). The best validation error at the end of each search, its trials, and the figure
  docs/figures/async_hpo_exercises.png (the best error so far against time, the mean of the seeds and their range).

Writes results/async_hpo_PART.json for each part.
"""

import argparse
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness import REPO, check_committed, data_flags, run_script, spread, write_result

TRIAL_FLAG = "--st_config_json_filename"  # how Syne Tune's local backend starts a trial


def sleeping_trial(argv):
    """A trial that sleeps for a configuration-dependent time per epoch and reports as syne_tune.Reporter does (its
    line written out, so that the trial pays for no import of syne_tune or torch), with async_hpo's trial protocol:
    it dies with the tuner, and says where it runs."""
    config = json.loads(Path(argv[argv.index(TRIAL_FLAG) + 1]).read_text())
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    print("[trial-info]: " + json.dumps({"device": "cpu", "pid": os.getpid()}), flush=True)
    final_error = 0.1 + 0.5 * (math.log10(config["learning_rate"]) + 0.7) ** 2
    for epoch in range(1, config["max_epochs"] + 1):
        time.sleep(0.5 * 128 / config["batch_size"])
        metrics = {"epoch": epoch, "validation_error": final_error + (0.9 - final_error) * 0.7 ** epoch}
        print(f"[tune-metric]: {json.dumps({**metrics, 'st_worker_timestamp': time.time()})}", flush=True)


def part_scheduling(budget=60.0, repeats=3):
    sys.path.insert(0, str(REPO))
    from syne_tune.config_space import loguniform, randint
    from syne_tune.results_callback import StoreResultsCallback

    import async_hpo
    space = {"learning_rate": loguniform(1e-2, 1), "batch_size": randint(32, 256), "max_epochs": 10}
    variants = {"asynchronous, 1 worker": (1, False), "asynchronous, 2 workers": (2, False),
                "synchronous, 2 workers": (2, True)}
    figures = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as folder:
        os.environ["SYNETUNE_FOLDER"] = folder
        for _ in range(repeats):
            for name, (workers, sync) in variants.items():
                args = async_hpo.Args(n_workers=workers, sync=sync, max_wallclock_time=budget, max_failures=0)
                search = async_hpo.Search(["learning_rate", "batch_size"])
                async_hpo.tune(args, async_hpo.make_scheduler(args, space), "bench", [search, StoreResultsCallback()],
                               async_hpo.LocalTrials, entry_point=__file__)
                rows, wall = list(search.rows.values()), search.ended_at - search.started_at
                completed = sum(row["status"] == "completed" for row in rows)
                figures[name].append((completed / wall * 60, sum(row["busy_s"] for row in rows) / (workers * wall)))
                print(f"{name}: {completed} trials completed in {wall:.0f} s", flush=True)
    rows = [[name, spread([per_minute for per_minute, _ in runs], 3), spread([busy for _, busy in runs], 3)]
            for name, runs in figures.items()]
    return {"Scheduling a search of sleeping trials": {"columns": ["scheduling", "trials/min", "utilisation"],
                                                        "rows": rows}}, \
        f"{repeats} searches of {budget:g} s each, interleaved: the median (smallest–largest)."


EXERCISES = {"random-1": "random search, 1 worker", "random-2": "random search, 2 workers",
             "gp-2": "GP (BOTorch), 2 workers", "local-2": "local search, 2 workers"}
PANELS = [("exercise 2: random search vs BO", ["random-2", "gp-2"]),
          ("exercise 3: 1 and 2 workers", ["random-1", "random-2"]),
          ("exercise 4: local vs random search", ["random-2", "local-2"])]


def incumbent(result, budget):
    """The best validation error reported by t = 0, 1, ..., budget s after the tuner started (nan before any)."""
    import numpy as np
    from syne_tune.experiments import load_experiment
    experiment = load_experiment(result["experiment"], local_path=result["results_dir"])
    reports = experiment.results.sort_values("st_worker_timestamp")
    times = reports["st_worker_timestamp"].to_numpy() - experiment.metadata["st_tuner_start_timestamp"]
    best = np.minimum.accumulate(reports["validation_error"].to_numpy())
    index = np.searchsorted(times, np.arange(budget + 1), side="right") - 1
    return np.where(index >= 0, best[np.clip(index, 0, None)], np.nan)


def part_exercises(budget=75, seeds=(0, 1, 2)):
    runs, curves = {variant: [] for variant in EXERCISES}, {variant: [] for variant in EXERCISES}
    with tempfile.TemporaryDirectory() as folder:
        for seed in seeds:  # every variant once per seed: a change in the machine's load hits all alike
            for variant in EXERCISES:
                scheduler, workers = variant.split("-")
                result, _ = run_script(["async_hpo.py", "--model", "mlp", "--holdout", "--scheduler", scheduler,
                                        "--n-workers", workers, "--trial-threads", 1, "--seed", seed,
                                        "--max-wallclock-time", budget, "--max-epochs", 4, "--limit-train", 5000,
                                        "--results-dir", folder, "--max-failures", 0, *data_flags()],
                                       timeout=budget + 600)
                runs[variant].append(result)
                curves[variant].append(incumbent(result, budget))
                print(f"{variant} seed {seed}: best {result['best_validation_error']:.4f}", flush=True)
    plot_exercises(curves, budget)
    def cell(values, digits):
        return f"{statistics.mean(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"
    rows = [[EXERCISES[variant], cell([r["trials_completed"] for r in results], 1),
             cell([r["best_validation_error"] for r in results], 4)] for variant, results in runs.items()]
    return {f"The exercises: DropoutMLP, {budget} s a search": {
        "columns": ["search", "trials completed", "best validation error"], "rows": rows}}, \
        f"Seeds {', '.join(map(str, seeds))}: the mean (smallest–largest); validation on 10,000 training images " \
        f"held out; one CPU thread a trial."


def plot_exercises(curves, budget):
    import numpy as np
    from matplotlib.figure import Figure
    figure = Figure(figsize=(12, 4.8))
    seconds = np.arange(budget + 1)
    for axes, (title, variants) in zip(figure.subplots(1, len(PANELS), sharey=True), PANELS):
        for variant in variants:
            runs = np.array(curves[variant])
            every = ~np.isnan(runs).any(axis=0)  # where every seed has reported
            line, = axes.plot(seconds[every], runs[:, every].mean(axis=0),
                              label=f"{EXERCISES[variant]}: mean of {len(runs)} seeds")
            axes.fill_between(seconds[every], runs[:, every].min(axis=0), runs[:, every].max(axis=0),
                              color=line.get_color(), alpha=0.2, linewidth=0, label="its smallest to largest")
        axes.set(title=title, xlabel="wall-clock time (s)", ylabel="best validation error so far")
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(REPO / "docs" / "figures" / "async_hpo_exercises.png", dpi=90)


def main():
    if TRIAL_FLAG in sys.argv:
        return sleeping_trial(sys.argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="scheduling,exercises", help="comma-separated parts to run")
    options = parser.parse_args()
    check_committed()
    parts = {"scheduling": part_scheduling, "exercises": part_exercises}
    for name in options.parts.split(","):
        write_result(f"async_hpo_{name}", *parts[name]())


if __name__ == "__main__":
    main()
