"""Benchmark multi_gpu.py: against the tutorial's loop, the allreduce variants on CPU processes, and the tutorial's
exercises 1 and 2 (larger batches for more devices).

    python benchmarks/bench_multi_gpu.py --data-dir ../shared/data                    # every part
    python benchmarks/bench_multi_gpu.py --parts tutorial --device cuda --epochs 10   # one GPU

- tutorial: D2L 13.5's own training loop, written out without the d2l package (a DataLoader with 4 workers that
  turns uint8 images into floats batch by batch, as ToTensor does, a copy of each batch to the device, the
  per-parameter allreduce, d2l.sgd, a synchronisation after every batch), against `multi_gpu.py` with one process on
  the same device, the same recipe (batch 256, lr 0.2) and the same initial parameters: seconds per epoch (median,
  training only, as the tutorial times it) and the test accuracy after the last epoch.
- allreduce: `multi_gpu.py --gpus 0 --procs K` for K = 1 and 2, every --allreduce, rounds interleaved (a change in
  the machine's load hits them alike): seconds per epoch, median of the rounds.
- exercises: test accuracy after 3 epochs on 24,000 images against the process count k and the learning rate, the
  global batch k x 64 (exercise 1: a k-fold batch; exercise 2: the best rate for each k), and the rate 0.1 of k = 1
  scaled linearly with k, with and without a warm-up epoch (Goyal et al. 2017); two seeds each. Also the figure
  docs/figures/multi_gpu_exercises.png.

Writes results/multi_gpu_PART.json for each part (multi_gpu_tutorial_cuda.json with --device cuda).
"""

import argparse
import statistics
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from harness import REPO, run_script, write_result

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


def part_tutorial(args, flags):
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    tutorial = tutorial_loop(load_fashion_mnist(fashion_mnist_dir(args.data_dir)), args.epochs, device)
    ours, _ = run_script(["multi_gpu.py", "--gpus", int(args.device == "cuda"), "--procs", 1, "--epochs", args.epochs,
                          *flags], timeout=7200)
    return {f"multi_gpu.py against the tutorial's loop ({args.device})": {
        "columns": ["loop", "s/epoch", "test acc", "speed-up"],
        "rows": [["the tutorial's", round(tutorial[0], 3), tutorial[1], 1.0],
                 ["multi_gpu.py", round(ours["s_per_epoch"], 3), ours["test_acc"],
                  round(tutorial[0] / ours["s_per_epoch"], 2)]]}}


def part_allreduce(args, flags):
    seconds = {}
    for _ in range(args.rounds):
        for procs in (1, 2):
            for allreduce in ("tutorial", "ring", "builtin", "ddp"):
                result, _ = run_script(["multi_gpu.py", "--gpus", 0, "--procs", procs, "--allreduce", allreduce,
                                        "--limit-train", 20_000, "--epochs", 3, *flags], timeout=3600)
                seconds.setdefault((procs, allreduce), []).append(result["s_per_epoch"])
    rows = [[allreduce, *(round(statistics.median(seconds[procs, allreduce]), 3) for procs in (1, 2))]
            for allreduce in ("tutorial", "ring", "builtin", "ddp")]
    return {"Seconds per epoch of 20,000 images on CPU processes": {
        "columns": ["--allreduce", "1 process", "2 processes"], "rows": rows}}


def part_exercises(args, flags, counts=(1, 2, 4), grid=(0.05, 0.1, 0.2, 0.4, 0.8), seeds=(0, 1), per_device=64):
    configurations = [(f"lr {lr:g}", k, lr, []) for k in counts for lr in grid]
    scaling = ["--lr-scaling", "linear", "--lr-base-batch", per_device]
    configurations += [(name, k, 0.1, extra) for k in counts[1:] for name, extra in
                       (("linear", scaling), ("linear + warm-up", [*scaling, "--warmup-epochs", 1]))]
    accuracy = {}
    for seed in seeds:  # every configuration once per seed: a change in the machine's load hits all alike
        for name, k, lr, extra in configurations:
            result, _ = run_script(["multi_gpu.py", "--gpus", 0, "--procs", k, "--batch-per-device", per_device,
                                    "--lr", lr, "--seed", seed, "--limit-train", 24_000, "--epochs", 3, *extra,
                                    *flags], timeout=3600)
            accuracy.setdefault((name, k), []).append(result["test_acc"])
            print(f"{name} k={k} seed {seed}: test acc {result['test_acc']:.4f}", flush=True)
    names = list(dict.fromkeys(name for name, *_ in configurations))
    mean = {key: round(statistics.mean(values), 3) for key, values in accuracy.items()}
    plot_exercises(counts, grid, mean, per_device)
    return {"Test accuracy after 3 epochs, batch 64 per process (mean of 2 seeds)": {
        "columns": ["k", "global batch", *names], "rows": [[k, k * per_device, *(mean.get((name, k)) for name in names)]
                                                          for k in counts]}}


def plot_exercises(counts, grid, mean, per_device):
    from matplotlib.figure import Figure
    figure = Figure(figsize=(10, 4))
    by_lr, by_k = figure.subplots(1, 2)
    for k in counts:
        by_lr.plot(grid, [mean["lr " + f"{lr:g}", k] for lr in grid], "o-", label=f"k = {k} (batch {k * per_device})")
    by_lr.set(xscale="log", xlabel="learning rate", ylabel="test accuracy", title="exercise 2: accuracy against rate")
    by_lr.set_xticks(grid, [f"{lr:g}" for lr in grid])
    by_lr.minorticks_off()
    for name in ("lr 0.1", "linear", "linear + warm-up"):
        by_k.plot(counts, [mean.get((name, k), mean["lr 0.1", 1]) for k in counts], "o-",
                  label="same rate 0.1" if name == "lr 0.1" else f"0.1 x k, {name}")
    by_k.plot(counts, [max(mean["lr " + f"{lr:g}", k] for lr in grid) for k in counts], "o--", label="best of grid")
    by_k.set(xscale="log", xlabel="processes k", title=f"exercise 1: batch k x {per_device}")
    by_k.set_xticks(counts, [str(k) for k in counts])
    by_k.minorticks_off()
    for axes in (by_lr, by_k):
        axes.set_ylim(0, 1)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(REPO / "docs" / "figures" / "multi_gpu_exercises.png", dpi=90)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="tutorial,allreduce,exercises", help="comma-separated parts to run")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="the tutorial part's device")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of the tutorial part (the tutorial's: 10)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the allreduce part")
    parser.add_argument("--data-dir", help="--data-dir of multi_gpu.py")
    args = parser.parse_args()
    flags = ["--data-dir", args.data_dir] if args.data_dir else []
    parts = {"tutorial": part_tutorial, "allreduce": part_allreduce, "exercises": part_exercises}
    for name in args.parts.split(","):
        suffix = "_cuda" if name == "tutorial" and args.device == "cuda" else ""
        write_result(f"multi_gpu_{name}{suffix}", parts[name](args, flags))


if __name__ == "__main__":
    main()
