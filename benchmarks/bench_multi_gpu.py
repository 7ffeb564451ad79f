"""Benchmark multi_gpu.py: against the tutorial's loop, the allreduce variants on CPU processes, and the tutorial's
exercises 1 and 2 (larger batches for more devices).

    python benchmarks/bench_multi_gpu.py                                              # every part
    python benchmarks/bench_multi_gpu.py --parts tutorial --device cuda --epochs 10   # one GPU

The data come from DATA_DIR where it is set, else from the scripts' download cache. Timings are the median of
--rounds rounds (3), interleaved so that a change in the machine's load hits every variant alike, with the smallest
and largest round.
- tutorial: D2L 13.5's own training loop, written out without the d2l package (a DataLoader with 4 workers that
  turns uint8 images into floats batch by batch, as ToTensor does, a copy of each batch to the device, the
  per-parameter allreduce, d2l.sgd, a synchronisation after every batch), against `multi_gpu.py` with one process on
  the same device, the same recipe (batch 256, lr 0.2) and the same initial parameters: seconds per epoch (each
  round's median epoch, training only, as the tutorial times it) and the test accuracy after the last epoch.
- allreduce: `multi_gpu.py --gpus 0 --procs K` for K = 1 and 2, every --allreduce: seconds per epoch.
- exercises: test accuracy after the tutorial's 10 epochs on 16,000 training images against the process count k and
  the learning rate, the global batch k x 64 (exercise 1: a k-fold batch; exercise 2: the best rate for each k);
  seeds 0, 1, 2. Also the figure docs/figures/multi_gpu_exercises.png.

Writes results/multi_gpu_PART.json for each part (multi_gpu_tutorial_cuda.json with --device cuda).
"""

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from harness import REPO, check_committed, data_flags, run_script, spread, write_result

sys.path.insert(0, str(REPO))
from common import fashion_mnist_dir, load_fashion_mnist  # noqa: E402
from multi_gpu import init_params, lenet, unflatten  # noqa: E402


def tutorial_loop(data, epochs, device, batch_size=256, lr=0.2):
    """D2L 13.5's train() and train_batch() on one device; returns (median seconds per epoch, last test accuracy)."""
    def to_float(samples):  # what ToTensor does to each image in the tutorial's loader
        images, labels = zip(*samples)
        return torch.stack(images).unsqueeze(1).float().div_(255), torch.stack(labels)

    train_x, train_y, test_x, test_y = data
    train_iter = DataLoader(TensorDataset(train_x, train_y), batch_size, shuffle=True, num_workers=4,
                            collate_fn=to_float)
    test_iter = DataLoader(TensorDataset(test_x, test_y), batch_size, num_workers=4, collate_fn=to_float)
    params = [p.to(device).requires_grad_() for p in unflatten(init_params(0))]
    loss = nn.CrossEntropyLoss(reduction="none")
    seconds, correct = [], 0
    for _ in range(epochs):
        start = time.perf_counter()
        for X, y in train_iter:
            X, y = X.to(device), y.to(device)  # the tutorial's split_batch for one device
            loss(lenet(X, params), y).sum().backward()
            with torch.no_grad():  # (the tutorial's allreduce has nothing to sum over one device), then d2l.sgd
                for param in params:
                    param -= lr * param.grad / X.shape[0]
                    param.grad.zero_()
            if device.type == "cuda":
                torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        with torch.no_grad():
            correct = sum((lenet(X.to(device), params).argmax(1) == y.to(device)).sum().item() for X, y in test_iter)
    return statistics.median(seconds), correct / len(test_y)


def part_tutorial(args):
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    data = load_fashion_mnist(fashion_mnist_dir(os.environ.get("DATA_DIR")))
    seconds, accuracy = {"tutorial": [], "ours": []}, {"tutorial": [], "ours": []}
    for _ in range(args.rounds):
        tutorial = tutorial_loop(data, args.epochs, device)
        ours, _ = run_script(["multi_gpu.py", "--gpus", int(args.device == "cuda"), "--procs", 1, "--epochs",
                              args.epochs, *data_flags()], timeout=7200)
        for name, (epoch, test_acc) in (("tutorial", tutorial), ("ours", (ours["s_per_epoch"], ours["test_acc"]))):
            seconds[name].append(epoch)
            accuracy[name].append(test_acc)
        print(f"tutorial {tutorial[0]:.3f} s/epoch, multi_gpu.py {ours['s_per_epoch']:.3f} s/epoch", flush=True)
    ratios = [tutorial / ours for tutorial, ours in zip(seconds["tutorial"], seconds["ours"])]
    return {f"multi_gpu.py against the tutorial's loop ({args.device})": {
        "columns": ["loop", "s/epoch", "test acc", "speed-up (per round)"],
        "rows": [["the tutorial's", spread(seconds["tutorial"]), spread(accuracy["tutorial"]), "1"],
                 ["multi_gpu.py", spread(seconds["ours"]), spread(accuracy["ours"]), spread(ratios, 3)]]}}, \
        f"{args.epochs} epochs a round, {args.rounds} rounds: median (smallest–largest)."


def part_allreduce(args):
    seconds = {}
    for _ in range(args.rounds):
        for procs in (1, 2):
            for allreduce in ("tutorial", "ring", "builtin", "ddp"):
                result, _ = run_script(["multi_gpu.py", "--gpus", 0, "--procs", procs, "--allreduce", allreduce,
                                        "--limit-train", 20_000, "--epochs", 3, *data_flags()], timeout=3600)
                seconds.setdefault((procs, allreduce), []).append(result["s_per_epoch"])
    rows = [[allreduce, *(spread(seconds[procs, allreduce]) for procs in (1, 2))]
            for allreduce in ("tutorial", "ring", "builtin", "ddp")]
    return {"Seconds per epoch of 20,000 images on CPU processes": {
        "columns": ["--allreduce", "1 process", "2 processes"], "rows": rows}}, \
        f"3 epochs a run, each run's median epoch; {args.rounds} rounds: median (smallest–largest)."


def part_exercises(args, counts=(1, 2, 4), grid=(0.1, 0.2, 0.4, 0.8), seeds=(0, 1, 2), per_device=64,
                   epochs=10):
    configurations = [(f"lr {lr:g}", k, lr) for k in counts for lr in grid]
    accuracy = {}
    for seed in seeds:  # every configuration once per seed: a change in the machine's load hits all alike
        for name, k, lr in configurations:
            result, _ = run_script(["multi_gpu.py", "--gpus", 0, "--procs", k, "--batch-per-device", per_device,
                                    "--lr", lr, "--seed", seed, "--limit-train", 16_000, "--epochs", epochs,
                                    "--timeout", 600, *data_flags()], timeout=3600)
            accuracy.setdefault((name, k), []).append(result["test_acc"])
            print(f"{name} k={k} seed {seed}: test acc {result['test_acc']:.4f}", flush=True)
    plot_exercises(counts, grid, accuracy, per_device, epochs)
    names = list(dict.fromkeys(name for name, *_ in configurations))

    def cell(values):
        return f"{statistics.mean(values):.3f} ({min(values):.3f}–{max(values):.3f})" if values else None
    return {f"Test accuracy after {epochs} epochs, batch {per_device} per process": {
        "columns": ["k", "global batch", *names],
        "rows": [[k, k * per_device, *(cell(accuracy.get((name, k))) for name in names)] for k in counts]}}, \
        f"16,000 training images; seeds {', '.join(map(str, seeds))}: the mean (smallest–largest); chance is 0.1."


def plot_exercises(counts, grid, accuracy, per_device, epochs):
    """Left: accuracy against the rate, a line per k; right: against k, at the rate 0.1, at 0.1 k (the linear
    scaling rule of Goyal et al. 2017) and at the best rate of the grid for each k. Markers at the mean of the seeds,
    bars from the smallest to the largest."""
    from matplotlib.figure import Figure

    def errorbar(axes, xs, runs, **style):
        means = [statistics.mean(values) for values in runs]
        below = [mean - min(values) for mean, values in zip(means, runs)]
        above = [max(values) - mean for mean, values in zip(means, runs)]
        axes.errorbar(xs, means, yerr=[below, above], marker="o", capsize=3, **style)

    figure = Figure(figsize=(10, 4))
    by_lr, by_k = figure.subplots(1, 2)
    for k in counts:
        errorbar(by_lr, grid, [accuracy[f"lr {lr:g}", k] for lr in grid], label=f"k = {k} (global batch "
                                                                                 f"{k * per_device})")
    by_lr.set(xscale="log", xlabel="learning rate", ylabel=f"test accuracy after {epochs} epochs",
              title="exercise 2: accuracy against the rate")
    by_lr.set_xticks(grid, [f"{lr:g}" for lr in grid])
    by_lr.minorticks_off()
    best = [max(grid, key=lambda lr: statistics.mean(accuracy[f"lr {lr:g}", k])) for k in counts]
    errorbar(by_k, counts, [accuracy["lr 0.1", k] for k in counts], label="rate 0.1")
    errorbar(by_k, counts, [accuracy[f"lr {0.1 * k:g}", k] for k in counts], label="rate 0.1 k (linear scaling)")
    errorbar(by_k, counts, [accuracy[f"lr {lr:g}", k] for lr, k in zip(best, counts)], linestyle="--",
             label="the grid's best rate (" + ", ".join(f"{lr:g}" for lr in best) + ")")
    by_k.set(xlabel="processes k (global batch 64 k)", ylabel=f"test accuracy after {epochs} epochs",
             title="exercise 1: a k-fold batch")
    by_k.set_xticks(counts, [str(k) for k in counts])
    for axes in (by_lr, by_k):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(REPO / "docs" / "figures" / "multi_gpu_exercises.png", dpi=90)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="tutorial,allreduce,exercises", help="comma-separated parts to run")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="the tutorial part's device")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of the tutorial part (the tutorial's: 10)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the timed parts")
    args = parser.parse_args()
    check_committed()
    parts = {"tutorial": part_tutorial, "allreduce": part_allreduce, "exercises": part_exercises}
    for name in args.parts.split(","):
        suffix = "_cuda" if name == "tutorial" and args.device == "cuda" else ""
        write_result(f"multi_gpu_{name}{suffix}", *parts[name](args))


if __name__ == "__main__":
    main()
