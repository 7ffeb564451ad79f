"""D2L 13.5's exercises 1 and 2 on CPU processes: test accuracy against the process count k and the learning rate.

    python benchmarks/bench_multi_gpu_exercises.py --data-dir ../shared/data      # 38 runs of about 30 s each

Exercise 1 (with k devices, scale the minibatch from b to k*b) and exercise 2 (how does the best learning rate
scale with k?). Every run is `multi_gpu.py --gpus 0 --procs k --batch-per-device B`: k CPU processes stand in for k
devices (they compute what k devices would, up to rounding), each with B images a step, so the global batch is k*B.
For every k and every --lr of the grid, and for each seed, the run trains --epochs epochs on the first
--limit-train training images and reports its test accuracy (all 10,000 test images). Two more configurations per
k>1 follow Goyal et al. 2017: --base-lr scaled linearly to the batch, with and without --warmup-epochs 1. The
tutorial's own way of using k devices (a global batch of B split k ways) computes the k=1 run on any k (the tests
check that the parameters are equal), so the k=1 row stands for it.

Prints one line per run, then a table (mean test accuracy over the seeds, with min and max), the best rate per k,
and one JSON line; writes the figure (--figure). On a 2-core VM under other load (load average 10-14) the 38 runs took
40 min; a run takes about 30 s on the quiet machine.
"""

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from common import emit_result, parse_args, run_main  # noqa: E402


@dataclasses.dataclass
class Args:
    procs: str = "1,2,4"
    """comma-separated process counts k"""
    lrs: str = "0.05,0.1,0.2,0.4,0.8"
    """comma-separated learning rates of the grid (the same for every k)"""
    base_lr: float = 0.1
    """the k=1 rate that the linear-scaling configurations scale by k"""
    batch_per_device: int = 64
    """images per process and step (global batch k times this)"""
    limit_train: int = 24000
    """training images"""
    epochs: int = 3
    """epochs per run"""
    seeds: str = "0,1"
    """comma-separated seeds: each configuration runs once per seed"""
    threads: int = 1
    """torch threads per process, set through the CPUs the run may use (results do not depend on it; on a machine
    shared with other work, more than one thread per process can make a run many times slower); 0: as many as
    multi_gpu.py picks"""
    data_dir: Optional[str] = None
    """--data-dir of multi_gpu.py"""
    figure: str = str(REPO / "docs" / "figures" / "multi_gpu_exercises.png")
    """where to write the figure"""


def run(args, procs, lr, seed, extra=()):
    command = [sys.executable, str(REPO / "multi_gpu.py"), "--gpus", "0", "--procs", str(procs),
               "--batch-per-device", str(args.batch_per_device), "--lr", repr(lr), "--seed", str(seed),
               "--limit-train", str(args.limit_train), "--epochs", str(args.epochs), *extra]
    command += ["--data-dir", args.data_dir] if args.data_dir else []
    cpus = sorted(os.sched_getaffinity(0))
    # common.worker gives each of the k processes (usable CPUs // k) threads, at least one
    allowed = cpus[:max(1, procs * args.threads)] if args.threads else cpus
    started = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=3600, cwd=REPO,
                          preexec_fn=lambda: os.sched_setaffinity(0, allowed))
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"test_acc": result["test_acc"], "loss": result["loss"], "lr": result["lr"],
            "batch_size": result["batch_size"], "seconds": time.monotonic() - started}


def configurations(args, counts, grid):
    """(name, k, --lr, extra flags): the grid, then linear scaling of --base-lr without and with warm-up."""
    for k in counts:
        for lr in grid:
            yield "grid", k, lr, ()
    scaling = ("--lr-scaling", "linear", "--lr-base-batch", str(args.batch_per_device))  # k=1 keeps --base-lr
    for k in counts:
        if k > 1:
            yield "linear", k, args.base_lr, scaling
            yield "linear+warmup", k, args.base_lr, (*scaling, "--warmup-epochs", "1")


def summarise(accuracies):
    return {"mean": statistics.mean(accuracies), "min": min(accuracies), "max": max(accuracies), "runs": accuracies}


def plot(figure_path, counts, grid, cells, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_lr, by_k) = plt.subplots(1, 2, figsize=(9, 3.6))
    for index, k in enumerate(counts):
        means = [cells[("grid", k, lr)]["mean"] for lr in grid]
        low = [cells[("grid", k, lr)]["min"] for lr in grid]
        high = [cells[("grid", k, lr)]["max"] for lr in grid]
        by_lr.plot(grid, means, "o-", color=f"C{index}", label=f"k={k} (batch {k * args.batch_per_device})")
        by_lr.fill_between(grid, low, high, color=f"C{index}", alpha=0.15)
    by_lr.set_xscale("log", base=2)
    by_lr.set_xlabel("learning rate")
    by_lr.set_ylabel("test accuracy")
    by_lr.set_title("exercise 2: accuracy vs learning rate")
    by_lr.legend(fontsize=8)
    rows = [("same rate", lambda k: cells[("grid", k, args.base_lr)]),
            ("linear scaling", lambda k: cells[("grid", 1, args.base_lr)] if k == 1 else cells[("linear", k, None)]),
            ("linear + warm-up", lambda k: cells[("grid", 1, args.base_lr)] if k == 1
             else cells[("linear+warmup", k, None)]),
            ("best rate of the grid", lambda k: max((cells[("grid", k, lr)] for lr in grid), key=lambda c: c["mean"]))]
    for index, (name, cell) in enumerate(rows):
        means = [cell(k)["mean"] for k in counts]
        errors = [[cell(k)["mean"] - cell(k)["min"] for k in counts],
                  [cell(k)["max"] - cell(k)["mean"] for k in counts]]
        by_k.errorbar([k * (1 + 0.04 * (index - 1.5)) for k in counts], means, yerr=errors, fmt="o-", capsize=3,
                      label=name)
    by_k.set_xscale("log", base=2)
    by_k.set_xticks(counts, [str(k) for k in counts])
    by_k.set_xlabel(f"processes k (batch {args.batch_per_device} each)")
    by_k.set_title(f"exercise 1: batch k*{args.batch_per_device}, k=1 rate {args.base_lr:g}")
    by_k.legend(fontsize=8)
    for axis in (by_lr, by_k):
        axis.set_ylim(0, 1)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    Path(figure_path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(figure_path, dpi=80)
    plt.close(figure)


def main():
    args = parse_args(Args)
    counts = [int(k) for k in args.procs.split(",")]
    grid = [float(lr) for lr in args.lrs.split(",")]
    seeds = [int(seed) for seed in args.seeds.split(",")]
    runs = {}
    started = time.monotonic()
    for seed in seeds:  # every configuration once per seed, so that a change in the machine's load hits all alike
        for name, k, lr, extra in configurations(args, counts, grid):
            result = run(args, k, lr, seed, extra)
            runs.setdefault((name, k, lr if name == "grid" else None), []).append(result)
            print(f"{name:14} k={k} batch {result['batch_size']:4} lr {result['lr']:.3f} seed {seed} | "
                  f"test acc {result['test_acc']:.4f} | {result['seconds']:.0f} s", flush=True)
    cells = {key: summarise([r["test_acc"] for r in results]) for key, results in runs.items()}

    print(f"\ntest accuracy after {args.epochs} epochs on {args.limit_train} images, mean (min-max) of "
          f"{len(seeds)} seeds; batch {args.batch_per_device} per process\n")
    print("| k | global batch | " + " | ".join(f"lr {lr:g}" for lr in grid) + " | linear | linear + warm-up |")
    print("| ---: | ---: | " + " | ".join("---:" for _ in grid) + " | ---: | ---: |")
    for k in counts:
        def text(key):
            cell = cells.get(key)
            return f"{cell['mean']:.3f} ({cell['min']:.2f}-{cell['max']:.2f})" if cell else "="
        print(f"| {k} | {k * args.batch_per_device} | " + " | ".join(text(("grid", k, lr)) for lr in grid)
              + f" | {text(('linear', k, None))} | {text(('linear+warmup', k, None))} |")
    best = {k: max(grid, key=lambda lr: cells[("grid", k, lr)]["mean"]) for k in counts}
    print("\nbest rate of the grid: " + ", ".join(f"k={k}: {lr:g}" for k, lr in best.items()))
    plot(args.figure, counts, grid, cells, args)
    minutes = (time.monotonic() - started) / 60
    print(f"{len(seeds) * sum(1 for _ in configurations(args, counts, grid))} runs in {minutes:.1f} min; "
          f"figure: {args.figure}")
    emit_result("bench_multi_gpu_exercises", batch_per_device=args.batch_per_device, limit_train=args.limit_train,
                epochs=args.epochs, seeds=seeds, base_lr=args.base_lr, best_lr=best, minutes=minutes,
                cells=[{"config": name, "k": k, "lr": lr, **cell} for (name, k, lr), cell in cells.items()])


if __name__ == "__main__":
    run_main(main)
