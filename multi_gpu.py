"""Data-parallel training of LeNet on Fashion-MNIST, one process per device, with hand-written allreduce.

Every process holds a full copy of the model. Each global minibatch (256 images) is cut into one shard per
process; each process computes the loss and gradients of its shard, the gradients are summed across
processes (allreduce), and every process applies the same SGD update, so the copies stay identical and the
run computes exactly what one process would on the same global batches. The gradient sum is done four ways,
`--allreduce`: `tutorial` (everyone sends to rank 0, which sums and sends back, as in the D2L chapter),
`ring` (bandwidth-optimal ring: reduce-scatter then all-gather), `builtin` (torch.distributed.all_reduce)
and `ddp` (DistributedDataParallel). Test accuracy is computed by all processes, each on its shard.

    python multi_gpu.py --gpus 2                         # two GPUs, NCCL, one process each
    python multi_gpu.py --gpus 0 --procs 2               # two CPU processes, gloo (default without GPUs)
    torchrun --standalone --nproc_per_node 2 multi_gpu.py --gpus 0
    # two nodes, two GPUs each (run on both, with NODE_RANK 0 and 1; MASTER_ADDR = node 0's address):
    torchrun --nnodes 2 --node_rank $NODE_RANK --nproc_per_node 2 --master_addr $MASTER_ADDR \
        --master_port 29400 multi_gpu.py --gpus 2

A CPU run (`--gpus 0 --procs 2 --data-dir ../shared/data`, the tutorial's recipe, 10 epochs) took 3 min on
a 2-core machine and ended with (the tutorial reports test acc 0.84 after 10 epochs):

    epoch 10 | loss 0.403 | train acc 0.849 | test acc 0.836 | 14.80 s/epoch | 4.1k samples/s
    {"script": "multi_gpu", "allreduce": "ring", "world_size": 2, "device": "cpu", "epochs": 10, "loss": 0.403,
     "train_acc": 0.849, "test_acc": 0.8357, "s_per_epoch": 15.64, "samples_per_s": 3836.2, "history": [...]}
"""

import dataclasses
import math
import time
from pathlib import Path
from typing import Literal, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from common import (check, check_output_file, cuda_device_count, emit_result, fashion_mnist_dir, init_process_group,
                    launch, load_fashion_mnist, parse_args, pick_device, process_count, run_main, save_atomic)


@dataclasses.dataclass
class Args:
    gpus: Optional[int] = None
    """number of GPUs, one process each (NCCL); 0 trains on --procs CPU processes (gloo). Default: every GPU
    on this machine, 0 if there is none"""
    procs: int = 2
    """number of CPU processes when --gpus is 0"""
    batch_size: int = 256
    """global minibatch size, split evenly across the processes"""
    lr: float = 0.2
    """SGD learning rate"""
    epochs: int = 10
    """number of passes over the training set"""
    allreduce: Literal["tutorial", "ring", "builtin", "ddp"] = "ring"
    """how gradients are summed across processes"""
    seed: int = 0
    """seed of the initial parameters and of the shuffling"""
    limit_train: Optional[int] = None
    """train on the first N training images only (for quick runs)"""
    data_dir: Optional[str] = None
    """folder with the Fashion-MNIST .gz files (or its parent); downloaded into a cache when not given"""
    plot: Optional[str] = None
    """save the learning curve (test accuracy and training loss per epoch) to this PNG file"""
    checkpoint_dir: Optional[str] = None
    """save a checkpoint here after every epoch"""
    resume: bool = False
    """continue from the checkpoint in --checkpoint-dir, if there is one"""
    timeout: float = 60.0
    """seconds a collective may wait for a peer before the run fails"""


# ---------------------------------------------------------------------------------------------------------
# The model: LeNet as a parameter list and a functional forward, as in the tutorial
# ---------------------------------------------------------------------------------------------------------

PARAM_SHAPES = [(20, 1, 3, 3), (20,), (50, 20, 5, 5), (50,), (800, 128), (128,), (128, 10), (10,)]


def init_params(seed, scale=0.01):
    """The tutorial's initialisation: weights N(0, scale^2), biases zero, one flat tensor (float32, CPU)."""
    generator = torch.Generator().manual_seed(seed)
    pieces = [torch.randn(shape, generator=generator) * scale if len(shape) > 1 else torch.zeros(shape)
              for shape in PARAM_SHAPES]
    return torch.cat([piece.reshape(-1) for piece in pieces])


def unflatten(flat):
    """Views of the flat buffer shaped like the parameters: writing one writes the other."""
    return [chunk.view(shape) for chunk, shape in
            zip(flat.split([math.prod(shape) for shape in PARAM_SHAPES]), PARAM_SHAPES)]


def lenet(X, params):
    W1, b1, W2, b2, W3, b3, W4, b4 = params
    h1 = F.avg_pool2d(F.relu(F.conv2d(X, W1, b1)), kernel_size=2, stride=2)
    h2 = F.avg_pool2d(F.relu(F.conv2d(h1, W2, b2)), kernel_size=2, stride=2)
    h3 = F.relu(h2.flatten(1) @ W3 + b3)
    return h3 @ W4 + b4


class LeNet(nn.Module):
    """The same LeNet as an nn.Module, for DistributedDataParallel. Lives in every process."""

    def __init__(self, flat):
        super().__init__()
        self.params = nn.ParameterList([nn.Parameter(p.clone()) for p in unflatten(flat)])

    def forward(self, X):
        return lenet(X, list(self.params))


# ---------------------------------------------------------------------------------------------------------
# Gradient synchronisation: each function sums `flat` (one buffer holding every gradient) across processes
# ---------------------------------------------------------------------------------------------------------

def tutorial_allreduce(flat, rank, world_size):
    """The tutorial's algorithm: rank 0 receives every gradient, sums, and sends the sum back to each rank.
    Rank 0 moves 2(k-1) full buffers while the others wait: its link is the bottleneck."""
    if rank == 0:
        incoming = torch.empty_like(flat)
        for source in range(1, world_size):
            dist.recv(incoming, source)
            flat += incoming
        for destination in range(1, world_size):
            dist.send(flat, destination)
    else:
        dist.send(flat, 0)
        dist.recv(flat, 0)


def ring_allreduce(flat, rank, world_size, segments=4):
    """Bandwidth-optimal ring allreduce. The buffer is cut into k chunks. Reduce-scatter: in k-1 steps every
    rank passes one chunk to its right neighbour and adds the chunk arriving from its left, after which rank r
    holds the full sum of chunk r+1. All-gather: k-1 more steps pass the summed chunks around the ring.
    Each rank sends and receives 2(k-1)/k of the buffer, whatever k is. Each chunk travels in a few segments,
    so that adding one segment overlaps with receiving the next."""
    if world_size == 1:
        return
    chunks = list(flat.tensor_split(world_size))
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    incoming = torch.empty_like(chunks[0])
    for step in range(world_size - 1):
        send, receive = (rank - step) % world_size, (rank - step - 1) % world_size
        buffer = incoming[:chunks[receive].numel()]
        sends, receives = exchange(chunks[send].tensor_split(segments), right, buffer.tensor_split(segments), left)
        for request, total, part in zip(receives, chunks[receive].tensor_split(segments),
                                        buffer.tensor_split(segments)):
            request.wait()
            total += part
        for request in sends:
            request.wait()
    for step in range(world_size - 1):
        send, receive = (rank + 1 - step) % world_size, (rank - step) % world_size
        for request in sum(exchange([chunks[send]], right, [chunks[receive]], left), []):
            request.wait()


def exchange(outgoing, destination, incoming, source):
    """Post the sends of `outgoing` and the receives into `incoming` together (NCCL's point-to-point calls
    would otherwise block each other); returns (send requests, receive requests) in the order given."""
    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, part, destination) for part in outgoing] +
                                      [dist.P2POp(dist.irecv, part, source) for part in incoming])
    return requests[:len(outgoing)], requests[len(outgoing):]


def builtin_allreduce(flat, rank, world_size):
    dist.all_reduce(flat)


ALLREDUCE = {"tutorial": tutorial_allreduce, "ring": ring_allreduce, "builtin": builtin_allreduce}


# ---------------------------------------------------------------------------------------------------------
# One process's training run
# ---------------------------------------------------------------------------------------------------------

def evaluate(forward, images, labels, rank, world_size, batch_size=2048):
    """Test accuracy on all processes: each counts its shard of the test set, the counts are summed."""
    correct = torch.zeros((), device=images.device)
    with torch.no_grad():
        for X, y in zip(images.tensor_split(world_size)[rank].split(batch_size),
                        labels.tensor_split(world_size)[rank].split(batch_size)):
            correct += (forward(X).argmax(1) == y).sum()
    dist.all_reduce(correct)
    return correct.item() / len(labels)


def load_checkpoint(path, rank):
    """Rank 0 reads the checkpoint and broadcasts it, so only rank 0 needs the file (also across nodes)."""
    state = [torch.load(path, weights_only=True) if rank == 0 and path.exists() else None]
    dist.broadcast_object_list(state, src=0)
    return state[0]


def recipe(args):
    """What a resumed run must share with the run that wrote the checkpoint (the process count may differ)."""
    return {"batch_size": args.batch_size, "lr": args.lr, "seed": args.seed, "limit_train": args.limit_train}


def run_worker(info, args, data_folder):
    rank, world_size = info.rank, info.world_size
    device = pick_device(args.gpus > 0, info.local_rank)
    init_process_group(info, "nccl" if device.type == "cuda" else "gloo", args.timeout,
                       device_id=device if device.type == "cuda" else None)

    # The whole data set lives on the device as floats: no loader, no per-batch copies or conversions.
    train_x, train_y, test_x, test_y = load_fashion_mnist(data_folder)
    if args.limit_train:
        train_x, train_y = train_x[:args.limit_train], train_y[:args.limit_train]
    train_x = train_x.to(device).unsqueeze(1).float().div_(255)
    test_x = test_x.to(device).unsqueeze(1).float().div_(255)
    train_y, test_y = train_y.to(device), test_y.to(device)

    flat_params = init_params(args.seed).to(device)  # same seed on every rank: identical starting copies
    checkpoint_path = Path(args.checkpoint_dir) / "multi_gpu.pt" if args.checkpoint_dir else None
    state = load_checkpoint(checkpoint_path, rank) if args.resume else None
    if state is not None:
        flat_params.copy_(state["params"])
    start_epoch = state["epoch"] if state else 0
    history = state["history"] if state else []

    if args.allreduce == "ddp":
        model = DistributedDataParallel(LeNet(flat_params), device_ids=[device] if device.type == "cuda" else None)
        params = list(model.parameters())
        forward = model
    else:
        # Parameters and gradients are views into two flat buffers: the allreduce and the SGD update are then
        # one call each on the whole model, with no packing or unpacking.
        flat_grads = torch.zeros_like(flat_params)
        params = unflatten(flat_params)
        for param, grad in zip(params, unflatten(flat_grads)):
            param.requires_grad_()
            param.grad = grad
        forward = lambda X: lenet(X, params)  # noqa: E731
        allreduce = ALLREDUCE[args.allreduce]

    n_train = len(train_x)
    # DDP averages gradients over processes; scaling its loss by k keeps every variant's update identical.
    loss_scale = world_size if args.allreduce == "ddp" else 1
    if rank == 0 and start_epoch:
        print(f"resuming after epoch {start_epoch} from {checkpoint_path}", flush=True)
    for epoch in range(start_epoch, args.epochs):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        # Every rank draws the same permutation, so all agree on the global batches without communicating.
        order = torch.randperm(n_train, generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        order = order.to(device)
        loss_sum = torch.zeros((), device=device)
        correct = torch.zeros((), device=device)
        for start in range(0, n_train, args.batch_size):
            batch = order[start:start + args.batch_size]
            shard = batch.tensor_split(world_size)[rank]
            X, y = train_x[shard], train_y[shard]
            logits = forward(X)
            losses = F.cross_entropy(logits, y, reduction="none")
            # Sum over the shard, divided by the GLOBAL batch size: summed over ranks, this is the mean loss
            # of the whole batch, as one process would compute it.
            (losses.sum() * (loss_scale / len(batch))).backward()
            with torch.no_grad():
                if args.allreduce == "ddp":
                    for param in params:
                        param -= args.lr * param.grad
                        param.grad = None
                else:
                    allreduce(flat_grads, rank, world_size)
                    flat_params.sub_(flat_grads, alpha=args.lr)
                    flat_grads.zero_()
                loss_sum += losses.detach().sum()
                correct += (logits.argmax(1) == y).sum()
        totals = torch.stack([loss_sum, correct])
        dist.all_reduce(totals)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        test_acc = evaluate(forward, test_x, test_y, rank, world_size)
        loss, train_acc = (totals / n_train).tolist()
        history.append({"epoch": epoch + 1, "loss": loss, "train_acc": train_acc, "test_acc": test_acc,
                        "seconds": seconds})
        if rank == 0:
            print(f"epoch {epoch + 1} | loss {loss:.3f} | train acc {train_acc:.3f} | test acc {test_acc:.3f} | "
                  f"{seconds:.2f} s/epoch | {n_train / seconds / 1000:.1f}k samples/s", flush=True)
            if checkpoint_path:
                final = torch.cat([p.detach().reshape(-1) for p in params]).cpu()
                save_atomic({"epoch": epoch + 1, "params": final, "history": history, "recipe": recipe(args)},
                            checkpoint_path)

    if rank == 0:
        if args.plot:
            plot_learning_curve(history, args.plot)
        ran = history[start_epoch:] or history
        seconds = sorted(h["seconds"] for h in ran)[len(ran) // 2]  # median: the first epoch includes warm-up
        last = history[-1] if history else {}
        emit_result("multi_gpu", allreduce=args.allreduce, world_size=world_size, device=device.type,
                    epochs=len(history), loss=last.get("loss"), train_acc=last.get("train_acc"),
                    test_acc=last.get("test_acc"), s_per_epoch=seconds, samples_per_s=n_train / seconds,
                    history=history)
    dist.destroy_process_group()


def plot_learning_curve(history, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    figure, loss_axis = plt.subplots(figsize=(6, 4))
    loss_axis.plot(epochs, [h["loss"] for h in history], "C0-o", label="train loss")
    loss_axis.set_xlabel("epoch")
    loss_axis.set_ylabel("train loss", color="C0")
    acc_axis = loss_axis.twinx()
    acc_axis.plot(epochs, [h["test_acc"] for h in history], "C1-s", label="test acc")
    acc_axis.set_ylabel("test accuracy", color="C1")
    acc_axis.set_ylim(0, 1)
    figure.legend(loc="center right")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main():
    args = parse_args(Args)
    gpus_here = cuda_device_count()
    if args.gpus is None:
        args.gpus = gpus_here
    check(args.gpus >= 0, f"--gpus must be 0 or more, not {args.gpus}")
    check(args.gpus <= gpus_here, f"--gpus {args.gpus} asks for more GPUs than the {gpus_here} this machine has; "
                                  f"pass --gpus {gpus_here}" + (" to train on CPU processes" if not gpus_here else ""))
    check(args.procs >= 1, f"--procs must be at least 1, not {args.procs}")
    check(args.lr > 0, f"--lr must be positive, not {args.lr}")
    check(args.epochs > 0, f"--epochs must be positive, not {args.epochs}")
    check(args.timeout > 0, f"--timeout must be positive, not {args.timeout}")
    check(args.limit_train is None or args.limit_train > 0, f"--limit-train must be positive, not {args.limit_train}")
    check(not args.resume or args.checkpoint_dir, "--resume needs --checkpoint-dir DIR (where the checkpoint is)")
    if args.plot:
        check_output_file("--plot", args.plot)
    if args.checkpoint_dir:
        checkpoint_dir = Path(args.checkpoint_dir)
        check(not checkpoint_dir.exists() or checkpoint_dir.is_dir(),
              f"--checkpoint-dir {checkpoint_dir} is a file; pass a folder")
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        checkpoint = checkpoint_dir / "multi_gpu.pt"
        if args.resume and checkpoint.exists():
            saved = torch.load(checkpoint, weights_only=True)["recipe"]
            check(saved == recipe(args), f"{checkpoint} was written with {saved}, not {recipe(args)}; "
                                         f"pass the same flags or another --checkpoint-dir")
    processes = process_count(args.gpus or args.procs)
    check(args.batch_size >= processes,
          f"--batch-size {args.batch_size} is smaller than the {processes} processes; every process needs a shard")
    data_folder = fashion_mnist_dir(args.data_dir)  # download (once) before the workers start
    launch(run_worker, processes, args, data_folder)


if __name__ == "__main__":
    run_main(main)
