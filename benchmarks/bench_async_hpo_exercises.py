"""The exercises of D2L 19.3 ("Asynchronous random search"), run with async_hpo.py on DropoutMLP.

Each search is `python async_hpo.py --model mlp --holdout --trial-threads 1 ...` with a wall-clock budget
(--budget seconds), on a training subset (--limit-train images, --max-epochs epochs per trial; validation on
10,000 images held out of the training set), run as a subprocess exactly as a user would run it. Every trial
trains with one thread, so that a worker is the same resource whatever their number (by default a trial gets
cores / n_workers threads: with one worker, two threads, which on a machine busy with other work ran 10x
slower per epoch than one). The variants:

    exercise 2  random search against Bayesian optimisation: --scheduler random | gp, 2 workers
    exercise 3  random search with --n-workers 1, 2, 4 (the tutorial expects about linear scaling)
    exercise 4  --scheduler local (search near the incumbent) against random search, 2 workers

Every variant runs --repeats times, repeat r with --seed r for all of them (so the random searches of
repeat r propose the same configurations in the same order, whatever the number of workers); the repeats are
interleaved so that load from other work on the machine does not hit one variant only. From each search's
results (Syne Tune's results.csv.zip) it takes the incumbent trajectory: the best validation error reported
so far against wall-clock time since the tuner started. It prints a table (mean and spread across repeats of
the final incumbent, trials completed, and for exercise 3 the time each number of workers took to reach the
1-worker final incumbent), writes a figure of the mean incumbent trajectories with their min-max band across
repeats, and ends with one JSON line.

    python benchmarks/bench_async_hpo_exercises.py --data-dir DATA          # 5 variants x 3 x 75 s, ~21 min
    python benchmarks/bench_async_hpo_exercises.py --data-dir DATA --budget 20 --repeats 1   # a quick look
    python benchmarks/bench_async_hpo_exercises.py --variants random-1 random-2 bo-2       # TPE too
"""

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ["random-1", "random-2", "random-4", "gp-2", "local-2"]  # SCHEDULER-WORKERS; bo-2 (TPE) also works
PANELS = [  # (title, variants): one panel of the figure per exercise
    ("exercise 2: random search vs BO (2 workers)", ["random-2", "gp-2", "bo-2"]),
    ("exercise 3: random search, 1 / 2 / 4 workers", ["random-1", "random-2", "random-4"]),
    ("exercise 4: local search vs random (2 workers)", ["random-2", "local-2"]),
]
LABELS = {"random": "random search", "gp": "GP (BOTorch)", "bo": "TPE", "local": "local search"}
COLORS = {"random-1": "tab:blue", "random-2": "tab:orange", "random-4": "tab:green", "gp-2": "tab:red",
          "bo-2": "tab:purple", "local-2": "tab:brown"}  # the same variant in the same colour in every panel


def run_search(options, variant, seed, results_dir):
    """One search as a subprocess; returns its JSON line, and its incumbent trajectory on a 1-second grid."""
    scheduler, workers = variant.rsplit("-", 1)
    command = [sys.executable, str(REPO / "async_hpo.py"), "--model", "mlp", "--holdout", "--scheduler", scheduler,
               "--n-workers", workers, "--trial-threads", "1", "--seed", str(seed),
               "--max-wallclock-time", str(options.budget), "--max-epochs", str(options.max_epochs),
               "--limit-train", str(options.limit_train), "--results-dir", str(results_dir), "--max-failures", "0"]
    if options.data_dir:
        command += ["--data-dir", options.data_dir]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=options.budget + 600)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} seed {seed} failed (exit status {proc.returncode}): {proc.stderr.strip()}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result, incumbent_trajectory(result, options.budget)


def incumbent_trajectory(result, budget):
    """Best validation error reported so far at t = 0, 1, ..., budget s after the tuner started (NaN before the
    first report), from the trials' own report timestamps."""
    from syne_tune.constants import ST_TUNER_START_TIMESTAMP, ST_WORKER_TIMESTAMP
    from syne_tune.experiments import load_experiment
    experiment = load_experiment(result["experiment"], local_path=result["results_dir"])
    started = experiment.metadata[ST_TUNER_START_TIMESTAMP]
    reports = experiment.results.sort_values(ST_WORKER_TIMESTAMP)
    times = reports[ST_WORKER_TIMESTAMP].to_numpy() - started
    best = np.minimum.accumulate(reports["validation_error"].to_numpy())
    grid = np.arange(0, math.floor(budget) + 1)
    index = np.searchsorted(times, grid, side="right") - 1
    return np.where(index >= 0, best[np.clip(index, 0, None)], np.nan)


def time_to_reach(trajectory, target):
    """First second at which the trajectory is at or below target, or None."""
    reached = np.nonzero(trajectory <= target + 1e-12)[0]
    return int(reached[0]) if len(reached) else None


def plot(figure_path, trajectories, budget):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [(title, [v for v in variants if v in trajectories]) for title, variants in PANELS]
    panels = [(title, variants) for title, variants in panels if len(variants) > 1]
    if not panels:  # no two variants that a panel compares
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2), sharey=True, squeeze=False)
    grid = np.arange(0, math.floor(budget) + 1)
    for ax, (title, variants) in zip(axes[0], panels):
        for variant in variants:
            runs = np.array(trajectories[variant])
            complete = ~np.isnan(runs).any(axis=0)  # where every repeat has reported
            scheduler, workers = variant.rsplit("-", 1)
            label = f"{LABELS[scheduler]}, {workers} worker{'s' if workers != '1' else ''}"
            line, = ax.plot(grid[complete], runs[:, complete].mean(axis=0), label=label, color=COLORS.get(variant))
            ax.fill_between(grid[complete], runs[:, complete].min(axis=0), runs[:, complete].max(axis=0),
                            color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set(title=title, xlabel="wall-clock time (s)")
        ax.title.set_fontsize(9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("best validation error so far")
    fig.tight_layout()
    figure_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure_path, dpi=80)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", help="folder with the Fashion-MNIST .gz files (default: the download cache)")
    parser.add_argument("--budget", type=float, default=75.0, help="seconds per search (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="searches per variant, seeds 0.. (default: %(default)s)")
    parser.add_argument("--limit-train", type=int, default=5000, help="training images per trial (default: "
                                                                      "%(default)s)")
    parser.add_argument("--max-epochs", type=int, default=4, help="epochs per trial (default: %(default)s)")
    parser.add_argument("--variants", nargs="+", default=VARIANTS, help="SCHEDULER-WORKERS, e.g. random-2 gp-2 "
                                                                        "bo-2 (default: %(default)s)")
    parser.add_argument("--figure", type=Path, default=REPO / "docs" / "figures" / "async_hpo_exercises.png",
                        help="where the figure goes (default: %(default)s)")
    options = parser.parse_args()
    if not (options.budget > 0 and math.isfinite(options.budget)) or options.repeats < 1:
        parser.error("--budget must be a positive number of seconds and --repeats at least 1")
    for variant in options.variants:
        scheduler, _, workers = variant.rpartition("-")
        if scheduler not in LABELS or not workers.isdigit() or int(workers) < 1:
            parser.error(f"{variant}: a variant is SCHEDULER-WORKERS with SCHEDULER one of {', '.join(LABELS)}")

    runs = {variant: [] for variant in options.variants}
    trajectories = {variant: [] for variant in options.variants}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-async-hpo-exercises-") as results_dir:
        for seed in range(options.repeats):
            for variant in options.variants:
                result, trajectory = run_search(options, variant, seed, results_dir)
                runs[variant].append(result)
                trajectories[variant].append(trajectory)
                print(f"{variant:8s} | seed {seed} | {result['trials_completed']:3d} trials completed | best "
                      f"{result['best_validation_error']:.4f} | utilisation {result['utilisation']:.1%}", flush=True)
    # Exercise 3's yardstick: the 1-worker random search's final incumbent, averaged over the repeats
    target = (float(np.nanmean([t[-1] for t in trajectories["random-1"]])) if "random-1" in trajectories else None)
    summary = {}
    for variant in options.variants:
        finals = np.array([t[-1] for t in trajectories[variant]])
        mean_trajectory = np.array(trajectories[variant]).mean(axis=0)
        summary[variant] = {
            "final_mean": round(float(np.mean(finals)), 4), "final_std": round(float(np.std(finals)), 4),
            "final_min": round(float(np.min(finals)), 4), "final_max": round(float(np.max(finals)), 4),
            "trials_completed_mean": round(float(np.mean([r["trials_completed"] for r in runs[variant]])), 1),
            "utilisation_mean": round(float(np.mean([r["utilisation"] for r in runs[variant]])), 3),
            "seconds_to_target": time_to_reach(mean_trajectory, target) if target is not None else None,
        }
    print(f"\n{options.repeats} repeats x {options.budget:g} s per search; DropoutMLP, {options.limit_train} training "
          f"images, {options.max_epochs} epochs per trial; validation error on 10,000 held-out images")
    reach = "-" if target is None else f"s to reach {target:.4f} (random-1's final incumbent)"
    print(f"| variant | trials completed (mean) | final incumbent, mean ± sd | min – max | utilisation | {reach} |")
    print("|---|---|---|---|---|---|")
    for variant, row in summary.items():
        reached = row["seconds_to_target"]
        print(f"| {variant} | {row['trials_completed_mean']:.1f} | {row['final_mean']:.4f} ± {row['final_std']:.4f} "
              f"| {row['final_min']:.4f} – {row['final_max']:.4f} | {row['utilisation_mean']:.1%} | "
              f"{'-' if reached is None else reached} |")
    plot(options.figure, trajectories, options.budget)
    print(f"figure: {options.figure} | {time.monotonic() - started:.0f} s in all")
    print(json.dumps({"benchmark": "async_hpo_exercises", "budget_s": options.budget, "repeats": options.repeats,
                      "limit_train": options.limit_train, "max_epochs": options.max_epochs,
                      "target": None if target is None else round(target, 4), "variants": summary}))


if __name__ == "__main__":
    main()
