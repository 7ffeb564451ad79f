"""multi_gpu.py on one GPU against the tutorial's own training loop on the same GPU, side by side in one run.

    python benchmarks/bench_multi_gpu_tutorial.py --data-dir ../shared/data     # 10 epochs each (needs a GPU)

The tutorial's loop is D2L 13.5's `train(num_gpus=1, batch_size=256, lr=0.2)`, written out below without the
d2l package: a DataLoader with 4 worker processes that turns uint8 images into float tensors batch by batch (as
d2l.load_data_fashion_mnist does with ToTensor), a copy of each batch to the GPU, the per-parameter allreduce
over its one device, d2l.sgd, and torch.cuda.synchronize() after every batch. Both start from the same
parameters (multi_gpu.init_params) and train with the same recipe; each reports the median seconds per epoch
(the training loop only, as the tutorial times it) and the test accuracy after the last epoch.
"""

import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from common import (  # noqa: E402
    check,
    emit_result,
    fashion_mnist_dir,
    load_fashion_mnist,
    parse_args,
    run_main,
)
from multi_gpu import init_params, lenet, unflatten  # noqa: E402


@dataclasses.dataclass
class Args:
    epochs: int = 10
    """epochs of each run (the tutorial's 10)"""
    batch_size: int = 256
    """minibatch size (the tutorial's)"""
    lr: float = 0.2
    """learning rate (the tutorial's)"""
    seed: int = 0
    """seed of the initial parameters"""
    data_dir: Optional[str] = None
    """folder with Fashion-MNIST (or its parent)"""
    gpu: bool = True
    """compare on GPU 0 (--no-gpu: both on the CPU, one process, for a quick look at the code paths)"""


def to_float_batch(samples):
    """What ToTensor does to each image in the tutorial's loader: uint8 HxW -> float 1xHxW in [0, 1]."""
    images, labels = zip(*samples)
    return torch.stack(images).unsqueeze(1).float().div_(255), torch.stack(labels)


def tutorial_train(data, args, device):
    """D2L 13.5's train() and train_batch() for one GPU; returns (seconds per epoch, last test accuracy)."""
    train_x, train_y, test_x, test_y = data
    train_iter = DataLoader(TensorDataset(train_x, train_y), args.batch_size, shuffle=True, num_workers=4,
                            collate_fn=to_float_batch)
    test_iter = DataLoader(TensorDataset(test_x, test_y), args.batch_size, shuffle=False, num_workers=4,
                           collate_fn=to_float_batch)
    devices = [device]
    params = [p.to(device).requires_grad_() for p in unflatten(init_params(args.seed))]
    device_params = [params]
    loss = nn.CrossEntropyLoss(reduction="none")

    def allreduce(data):
        for i in range(1, len(data)):
            data[0][:] += data[i].to(data[0].device)
        for i in range(1, len(data)):
            data[i][:] = data[0].to(data[i].device)

    def sgd(params, lr, batch_size):
        with torch.no_grad():
            for param in params:
                param -= lr * param.grad / batch_size
                param.grad.zero_()

    def split_batch(X, y):
        if device.type == "cpu":  # nn.parallel.scatter takes GPUs only
            return [X], [y]
        return nn.parallel.scatter(X, devices), nn.parallel.scatter(y, devices)

    def train_batch(X, y):
        X_shards, y_shards = split_batch(X, y)
        ls = [loss(lenet(X_shard, device_W), y_shard).sum()
              for X_shard, y_shard, device_W in zip(X_shards, y_shards, device_params)]
        for l in ls:  # noqa: E741
            l.backward()
        with torch.no_grad():
            for i in range(len(device_params[0])):
                allreduce([device_params[c][i].grad for c in range(len(devices))])
        for param in device_params:
            sgd(param, args.lr, X.shape[0])

    def evaluate_accuracy_gpu():
        correct, total = 0, 0
        with torch.no_grad():
            for X, y in test_iter:
                X, y = X.to(device), y.to(device)
                correct += (lenet(X, params).argmax(1) == y).sum().item()
                total += y.numel()
        return correct / total

    for param in params:
        param.grad = torch.zeros_like(param)
    seconds, accuracy = [], None
    for _ in range(args.epochs):
        start = time.perf_counter()
        for X, y in train_iter:
            train_batch(X, y)
            if device.type == "cuda":
                torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        accuracy = evaluate_accuracy_gpu()
    return statistics.median(seconds), accuracy


def multi_gpu_run(args, folder):
    proc = subprocess.run([sys.executable, str(REPO / "multi_gpu.py"), "--gpus", str(int(args.gpu)),
                           "--epochs", str(args.epochs),
                           "--batch-size", str(args.batch_size), "--lr", str(args.lr), "--seed", str(args.seed),
                           "--data-dir", str(folder)], capture_output=True, text=True, timeout=1800, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"multi_gpu.py failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["s_per_epoch"], result["test_acc"]


def main():
    args = parse_args(Args)
    check(not args.gpu or torch.cuda.device_count() > 0, "no GPU found; pass --no-gpu to compare on the CPU")
    folder = fashion_mnist_dir(args.data_dir)
    device = torch.device("cuda", 0) if args.gpu else torch.device("cpu")
    if args.gpu:
        torch.cuda.set_device(device)
    tutorial = tutorial_train(load_fashion_mnist(folder), args, device)
    ours = multi_gpu_run(args, folder)
    name = torch.cuda.get_device_name(device) if args.gpu else "CPU"
    print(f"{name} | {args.epochs} epochs | batch {args.batch_size} | lr {args.lr}")
    print(f"tutorial loop          {tutorial[0]:7.3f} s/epoch | test acc {tutorial[1]:.4f}")
    print(f"multi_gpu.py           {ours[0]:7.3f} s/epoch | test acc {ours[1]:.4f} | "
          f"{tutorial[0] / ours[0]:.1f}x faster")
    emit_result("bench_multi_gpu_tutorial", gpu=name, epochs=args.epochs, tutorial_s_per_epoch=tutorial[0],
                tutorial_test_acc=tutorial[1], s_per_epoch=ours[0], test_acc=ours[1], speedup=tutorial[0] / ours[0])


if __name__ == "__main__":
    run_main(main)
