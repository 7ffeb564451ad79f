"""Data-parallel training of LeNet on Fashion-MNIST, one process per device, with hand-written allreduce.

Every process holds a full copy of the model. Each global minibatch (256 images) is cut into one shard per
process; each process computes the loss and gradients of its shard, the gradients are summed across
processes (allreduce), and every process applies the same SGD update, so the copies stay identical and the
run computes exactly what one process would on the same global batches. The gradient sum is done four ways,
`--allreduce`: `tutorial` (everyone sends to rank 0, which sums and sends back, as in the D2L chapter),
`ring` (bandwidth-optimal ring: reduce-scatter then all-gather), `builtin` (torch.distributed.all_reduce)
and `ddp` (DistributedDataParallel). Test accuracy is computed by all processes, each on its shard.
`--batch-per-device` and `--lr-scaling` let the batch and the learning rate grow with the number of devices
instead (the chapter's exercises 1 and 2).

    python multi_gpu.py --gpus 2                         # two GPUs, NCCL, one process each
    python multi_gpu.py --gpus 0 --procs 2               # two CPU processes, gloo (default without GPUs)
    torchrun --standalone --nproc-per-node 2 multi_gpu.py --gpus 0
    # a failed process restarts the group (up to 3 times), which resumes from the last epoch's checkpoint:
    torchrun --standalone --nproc-per-node 2 --max-restarts 3 multi_gpu.py --gpus 0 --checkpoint-dir ckpt --resume
    # two nodes, two GPUs each (on both machines; NODE_RANK 0 and 1, MASTER_ADDR = node 0's address):
    torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 2 --master-addr $MASTER_ADDR --master-port 29400 \\
        multi_gpu.py --gpus 2

A CPU run (`--gpus 0 --procs 2`, the tutorial's recipe, 10 epochs) took 3 min on a 2-core machine and ended
with (the tutorial reports test acc 0.84 after 10 epochs):

    epoch 10 | loss 0.403 | train acc 0.849 | test acc 0.836 | 14.80 s/epoch | 4.1k samples/s
    {"script": "multi_gpu", "allreduce": "ring", "world_size": 2, "device": "cpu", "batch_size": 256, "lr": 0.2,
     "epochs": 10, "loss": 0.403, "train_acc": 0.849, "test_acc": 0.8357, "s_per_epoch": 15.64,
     "samples_per_s": 3836.2, "history": [...]}
"""

import dataclasses
import io
import math
import time
from pathlib import Path
from typing import Literal, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from common import (
    check,
    check_output_dir,
    check_output_file,
    cuda_device_count,
    emit_result,
    fashion_mnist_dir,
    gpu_per_process_problem,
    init_process_group,
    launch,
    launched_by_torchrun,
    load_checkpoint,
    load_fashion_mnist,
    local_gpu_index,
    local_process_count,
    parse_args,
    pick_device,
    process_count,
    run_main,
    save_checkpoint,
    set_tf32,
    write_or_fail,
)


@dataclasses.dataclass
class Args:
    gpus: Optional[int] = None
    """number of GPUs, one process each (NCCL); 0 trains on --procs CPU processes (gloo). Default: every GPU
    on this machine, 0 if there is none"""
    procs: int = 2
    """number of CPU processes when --gpus is 0"""
    batch_size: Optional[int] = None
    """global minibatch size, split evenly across the processes: 256 (the tutorial's) unless --batch-per-device"""
    batch_per_device: Optional[int] = None
    """minibatch size of each process instead: the global batch grows with the k processes to k*B (exercise 1)"""
    lr: float = 0.2
    """SGD learning rate (with --lr-scaling: the rate for a global batch of --lr-base-batch)"""
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    """scale --lr to the global batch b: by b/--lr-base-batch (Goyal et al. 2017) or its square root (Hoffer et al.
    2017)"""
    lr_base_batch: int = 256
    """the global batch that --lr is meant for when --lr-scaling scales it (256: the tutorial's)"""
    warmup_epochs: float = 0.0
    """with --lr-scaling, ramp the learning rate from --lr up to the scaled rate over this many epochs"""
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
    tf32: bool = True
    """let convolutions and matrix products on Ampere and newer GPUs use TF32 (--no-tf32: IEEE float32, for
    results that match other devices within rounding)"""
    cuda_graphs: bool = True
    """on GPUs, replay each step's forward and backward as one CUDA graph (--no-cuda-graphs: launch every kernel
    from Python)"""


def validate(args):
    """The rules of the flags, checked before any work starts: each broken rule is one line and exit status 2.
    Fills in --gpus and --batch-size when they were not given."""
    gpus_here = cuda_device_count()
    if launched_by_torchrun():  # one process per GPU, and torchrun decided how many run on this machine
        local = local_process_count(1)
        if args.gpus is None:
            args.gpus = local if gpus_here else 0
        check(args.gpus in (0, local), f"--gpus {args.gpus}: torchrun started {local} processes on this machine, "
                                       f"one per GPU; pass --gpus {local}, or --gpus 0 to train on CPUs")
        problem = gpu_per_process_problem(local) if args.gpus else None
        check(problem is None, f"--gpus {args.gpus}: {problem}; start fewer processes per machine or pass --gpus 0")
    elif args.gpus is None:
        args.gpus = gpus_here
    check(args.gpus >= 0, f"--gpus must be 0 or more, not {args.gpus}")
    check(args.gpus <= gpus_here, f"--gpus {args.gpus} asks for more GPUs than the {gpus_here} this machine has; "
                                  f"pass --gpus {gpus_here}" + (" to train on CPU processes" if not gpus_here else ""))
    check(args.procs >= 1, f"--procs must be at least 1, not {args.procs}")
    check(args.lr > 0, f"--lr must be positive, not {args.lr}")
    check(args.lr_base_batch > 0, f"--lr-base-batch must be positive, not {args.lr_base_batch}")
    check(args.warmup_epochs >= 0, f"--warmup-epochs must be 0 or more, not {args.warmup_epochs}")
    check(not args.warmup_epochs or args.lr_scaling != "none",
          "--warmup-epochs ramps --lr up to the scaled rate: pass --lr-scaling linear or sqrt too")
    check(args.epochs > 0, f"--epochs must be positive, not {args.epochs}")
    check(args.timeout > 0, f"--timeout must be positive, not {args.timeout}")
    check(args.limit_train is None or args.limit_train > 0, f"--limit-train must be positive, not {args.limit_train}")
    check(not args.resume or args.checkpoint_dir, "--resume needs --checkpoint-dir DIR (where the checkpoint is)")
    processes = process_count(args.gpus or args.procs)
    check(args.batch_size is None or args.batch_per_device is None,
          "--batch-size (global) and --batch-per-device exclude each other; pass one of them")
    check(args.batch_per_device is None or args.batch_per_device > 0,
          f"--batch-per-device must be positive, not {args.batch_per_device}")
    if args.batch_per_device is not None:
        args.batch_size = args.batch_per_device * processes
    elif args.batch_size is None:
        args.batch_size = 256
    check(args.batch_size >= processes,
          f"--batch-size {args.batch_size} is smaller than the {processes} processes; every process needs a shard")
    if args.plot:
        check_output_file("--plot", args.plot)
    if args.checkpoint_dir:
        check_output_dir("--checkpoint-dir", args.checkpoint_dir)
        check(not checkpoint_path(args).is_dir(), f"--checkpoint-dir {args.checkpoint_dir}: {checkpoint_path(args)} "
                                                  f"is a folder; remove it or pass another --checkpoint-dir")
        saved = read_checkpoint(args)
        check(saved is None or saved["recipe"] == recipe(args),
              f"{checkpoint_path(args)} was written with {saved and saved['recipe']}, not {recipe(args)}; pass the "
              f"same flags or another --checkpoint-dir")
        check(saved is None or len(saved["history"]) <= args.epochs,
              f"{checkpoint_path(args)} holds {len(saved['history']) if saved else 0} epochs, more than --epochs "
              f"{args.epochs}; pass a larger --epochs or another --checkpoint-dir")


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


# ---------------------------------------------------------------------------------------------------------
# Summing the gradients: each function sums `flat` (one buffer holding every gradient) across processes
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
    """Bandwidth-optimal ring allreduce (the chapter's exercise 3). The buffer is cut into k chunks.
    Reduce-scatter: in k-1 steps every rank passes one chunk to its right neighbour and adds the chunk arriving
    from its left, after which rank r holds the full sum of chunk r+1. All-gather: k-1 more steps pass the
    summed chunks around the ring. Each rank sends and receives 2(k-1)/k of the buffer, whatever k is. Each
    chunk travels in a few segments, each exchanged on its own, so that adding one segment overlaps with
    receiving the next."""
    if world_size == 1:
        return
    chunks = flat.tensor_split(world_size)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    incoming = torch.empty_like(chunks[0])
    for step in range(world_size - 1):
        send, receive = (rank - step) % world_size, (rank - step - 1) % world_size
        arriving = incoming[:chunks[receive].numel()].tensor_split(segments)
        transfers = [exchange(part, right, into, left)
                     for part, into in zip(chunks[send].tensor_split(segments), arriving)]
        for requests, total, part in zip(transfers, chunks[receive].tensor_split(segments), arriving):
            wait_all(requests)
            total += part
    for step in range(world_size - 1):
        send, receive = (rank + 1 - step) % world_size, (rank - step) % world_size
        wait_all(exchange(chunks[send], right, chunks[receive], left))


def exchange(outgoing, destination, incoming, source):
    """Post a send and a receive together, so that neither waits for the other (NCCL's blocking point-to-point
    calls would deadlock around the ring); returns the requests to wait on before touching either tensor.

    What batch_isend_irecv returns depends on the backend: NCCL coalesces the batch into ONE request, gloo
    returns one per operation (torch/distributed/distributed_c10d.py). So the requests are never matched to
    operations by position: all of them are waited on. Empty pieces of a tiny buffer are not sent; the two
    ends of a transfer skip them alike.
    """
    operations = [dist.P2POp(dist.isend, outgoing, destination)] if outgoing.numel() else []
    operations += [dist.P2POp(dist.irecv, incoming, source)] if incoming.numel() else []
    return dist.batch_isend_irecv(operations) if operations else []


def wait_all(requests):
    for request in requests:
        request.wait()


def builtin_allreduce(flat, rank, world_size):
    dist.all_reduce(flat)


ALLREDUCE = {"tutorial": tutorial_allreduce, "ring": ring_allreduce, "builtin": builtin_allreduce}


class Replica:
    """This process's copy of LeNet, for the hand-written allreduces. Lives in every process.

    The parameters and their gradients are views into two flat buffers, so that summing the gradients and the
    SGD update are one call each on the whole model, with no packing or unpacking."""

    loss_scale = 1

    def __init__(self, flat_params, allreduce, rank, world_size):
        self.flat_params, self.flat_grads = flat_params, torch.zeros_like(flat_params)
        self.params = unflatten(flat_params)
        for param, grad in zip(self.params, unflatten(self.flat_grads)):
            param.requires_grad_()
            param.grad = grad
        self.allreduce, self.rank, self.world_size = ALLREDUCE[allreduce], rank, world_size

    def forward(self, X):
        return lenet(X, self.params)

    def sum_gradients(self):
        self.allreduce(self.flat_grads, self.rank, self.world_size)

    @torch.no_grad()
    def update(self, lr):
        self.flat_params.sub_(self.flat_grads, alpha=lr)
        self.flat_grads.zero_()

    def flat(self):
        return self.flat_params.detach()


class DDPReplica:
    """The same LeNet as an nn.Module inside DistributedDataParallel, which sums the gradients during backward.
    Lives in every process."""

    class LeNet(nn.Module):
        def __init__(self, flat):
            super().__init__()
            self.params = nn.ParameterList([nn.Parameter(p.clone()) for p in unflatten(flat)])

        def forward(self, X):
            return lenet(X, list(self.params))

    def __init__(self, flat_params, world_size):
        device = flat_params.device
        self.module = DistributedDataParallel(self.LeNet(flat_params),
                                              device_ids=[device] if device.type == "cuda" else None)
        # DDP averages gradients over processes; scaling its loss by k keeps every variant's update identical.
        self.loss_scale = world_size

    def forward(self, X):
        return self.module(X)

    def sum_gradients(self):
        pass  # done by DDP during backward

    @torch.no_grad()
    def update(self, lr):
        for param in self.module.parameters():
            param -= lr * param.grad
            param.grad = None

    def flat(self):
        return torch.cat([param.detach().reshape(-1) for param in self.module.parameters()])


# ---------------------------------------------------------------------------------------------------------
# Training: every process runs run_worker; rank 0 alone prints, plots and checkpoints
# ---------------------------------------------------------------------------------------------------------

def shard_step(model, images, labels, index, batch_size):
    """Forward, loss and backward of this process's shard of one global batch (images[index]); returns the
    shard's [loss sum, correct predictions], on the device."""
    X, y = images.index_select(0, index), labels.index_select(0, index)
    logits = model.forward(X)
    losses = F.cross_entropy(logits, y, reduction="none")
    # Sum over the shard, divided by the GLOBAL batch size: summed over ranks, this is the mean loss of the
    # whole batch, as one process would compute it.
    (losses.sum() * (model.loss_scale / batch_size)).backward()
    correct = (logits.detach().argmax(1) == y).sum()
    return torch.stack([losses.detach().sum(), correct.to(losses.dtype)])


def train_epoch(model, step, data, args, epoch, rank, world_size):
    """One pass over the training set in global batches; returns this process's [loss sum, correct]."""
    train_x = data[0]
    # Every rank draws the same permutation, so all agree on the global batches without communicating.
    order = torch.randperm(len(train_x), generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
    batches = order.to(train_x.device).split(args.batch_size)
    totals = torch.zeros(2, device=train_x.device)
    for i, batch in enumerate(batches):
        totals += step(batch.tensor_split(world_size)[rank], len(batch))  # forward, loss, backward
        model.sum_gradients()
        model.update(learning_rate(args, epoch * len(batches) + i, len(batches)))  # --lr unless --lr-scaling
    return totals


def evaluate(forward, images, labels, rank, world_size, batch_size=2048):
    """Test accuracy on all processes: each counts its shard of the test set, the counts are summed."""
    correct = torch.zeros((), device=images.device)
    with torch.no_grad():
        for X, y in zip(images.tensor_split(world_size)[rank].split(batch_size),
                        labels.tensor_split(world_size)[rank].split(batch_size)):
            correct += (forward(X).argmax(1) == y).sum()
    dist.all_reduce(correct)
    return correct.item() / len(labels)


def run_worker(info, args, data):
    rank, world_size = info.rank, info.world_size
    device = pick_device(args.gpus > 0, local_gpu_index(info.local_rank))
    if device.type == "cuda":
        set_tf32(args.tf32)
    init_process_group(info, "nccl" if device.type == "cuda" else "gloo", args.timeout,
                       device_id=device if device.type == "cuda" else None)
    data = to_device(data, args.limit_train, device)

    flat_params = init_params(args.seed).to(device)  # same seed on every rank: identical starting copies
    state = broadcast_checkpoint(args, rank)
    if state is not None:
        flat_params.copy_(state["params"])
    history = state["history"] if state else []
    model = (DDPReplica(flat_params, world_size) if args.allreduce == "ddp"
             else Replica(flat_params, args.allreduce, rank, world_size))
    step = make_step(model, data, args, device)

    if rank == 0 and history:
        print(f"resuming after epoch {len(history)} from {checkpoint_path(args)}", flush=True)
    for epoch in range(len(history), args.epochs):
        started = time.perf_counter()
        totals = train_epoch(model, step, data, args, epoch, rank, world_size)
        dist.all_reduce(totals)
        loss, train_acc = (totals / len(data[0])).tolist()  # waits for the epoch's last step
        seconds = time.perf_counter() - started
        test_acc = evaluate(model.forward, data[2], data[3], rank, world_size)
        history.append({"epoch": epoch + 1, "loss": loss, "train_acc": train_acc, "test_acc": test_acc,
                        "seconds": seconds})
        if rank == 0:
            print(f"epoch {epoch + 1} | loss {loss:.3f} | train acc {train_acc:.3f} | test acc {test_acc:.3f} | "
                  f"{seconds:.2f} s/epoch | {len(data[0]) / seconds / 1000:.1f}k samples/s", flush=True)
            write_checkpoint(args, model.flat(), history)
    if rank == 0:
        report(args, history, world_size, device, len(data[0]), resumed_after=len(state["history"]) if state else 0)
    dist.destroy_process_group()


def main():
    args = parse_args(Args)
    validate(args)
    data = load_fashion_mnist(fashion_mnist_dir(args.data_dir))  # downloaded once and verified, before any worker
    launch(run_worker, process_count(args.gpus or args.procs), args, data, timeout=args.timeout)


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: larger batches for more devices (the chapter's exercises 1 and 2)
# ---------------------------------------------------------------------------------------------------------

def learning_rate(args, step, steps_per_epoch):
    """The learning rate of the run's step `step` (counted from its first epoch): --lr, unless --lr-scaling.

    With k devices the tutorial keeps the global batch at 256, so each device gets 256/k images and computes less as
    k grows; --batch-per-device B keeps each device's batch instead, and the global batch grows to kB. A larger batch
    takes fewer steps per epoch, each with a less noisy gradient, and so wants a larger learning rate.
    `linear` is the linear scaling rule of Goyal et al. 2017 ("Accurate, Large Minibatch SGD: Training ImageNet in
    1 Hour", arXiv:1706.02677, sec. 2.1): when the batch grows from n (--lr-base-batch, the batch that --lr suits)
    to b, multiply the rate by b/n, so that one step of b images moves the parameters about as far as b/n steps of
    n would, which holds while the gradient changes little over those steps. Early in training it changes fast,
    hence their gradual warm-up (sec. 2.2): start at --lr and add a constant each step to reach the scaled rate
    after --warmup-epochs epochs (they use 5). `sqrt` multiplies by sqrt(b/n) instead, which keeps the covariance
    of the updates' noise the same (Hoffer et al. 2017, "Train longer, generalize better", arXiv:1705.08741).
    """
    growth = args.batch_size / args.lr_base_batch
    scale = {"none": 1.0, "linear": growth, "sqrt": math.sqrt(growth)}[args.lr_scaling]
    warmup_steps = args.warmup_epochs * steps_per_epoch
    if step >= warmup_steps:
        return args.lr * scale
    return args.lr + (args.lr * scale - args.lr) * step / warmup_steps


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: the data on the device, CUDA graphs
# ---------------------------------------------------------------------------------------------------------

def to_device(data, limit_train, device):
    """(train images, train labels, test images, test labels), all on the device, images as floats [N, 1, 28, 28]
    in [0, 1]: a step then needs no loader, no host copy and no conversion, only an index."""
    train_x, train_y, test_x, test_y = data
    if limit_train:
        train_x, train_y = train_x[:limit_train], train_y[:limit_train]
    return (train_x.to(device).unsqueeze(1).float().div_(255), train_y.to(device),
            test_x.to(device).unsqueeze(1).float().div_(255), test_y.to(device))


def make_step(model, data, args, device):
    """step(index, batch_size) -> [loss sum, correct]: shard_step, or its CUDA-graph replay."""
    images, labels = data[0], data[1]
    if device.type == "cuda" and args.cuda_graphs and args.allreduce != "ddp":
        return GraphedSteps(model, images, labels)
    return lambda index, batch_size: shard_step(model, images, labels, index, batch_size)


class GraphedSteps:
    """shard_step captured as a CUDA graph, one per shard shape, then replayed. Lives in every GPU process.

    A LeNet step is about sixty small kernels, each launched from Python: on a GPU those launches, not the
    arithmetic, set the pace. A graph launches them all at once. Only forward, loss and backward are captured;
    the allreduce and the update run as they do without graphs, so every backend's collectives behave as usual.
    The gradients land in the model's flat buffer (captured as in-place additions to it).
    """

    def __init__(self, model, images, labels):
        self.model, self.images, self.labels = model, images, labels
        self.graphs = {}  # (shard size, batch size) -> (index buffer, graph, its output)

    def __call__(self, index, batch_size):
        key = (len(index), batch_size)
        if key not in self.graphs:
            self.graphs[key] = self.capture(*key)
        static_index, graph, output = self.graphs[key]
        static_index.copy_(index)
        graph.replay()
        return output.clone()  # the next replay overwrites the output

    def capture(self, shard_size, batch_size):
        static_index = torch.zeros(shard_size, dtype=torch.long, device=self.images.device)
        def step(): return shard_step(self.model, self.images, self.labels, static_index, batch_size)  # noqa: E731
        # Warm-up on a side stream, as torch.cuda.graphs asks: libraries pick their kernels outside the capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        self.model.flat_grads.zero_()  # the warm-up's gradients
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = step()
        return static_index, graph, output


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: checkpoints (resume with any process count) and reporting
# ---------------------------------------------------------------------------------------------------------

def recipe(args):
    """What a resumed run must share with the run that wrote the checkpoint (the process count may differ)."""
    schedule = ({"lr_scaling": args.lr_scaling, "lr_base_batch": args.lr_base_batch,
                 "warmup_epochs": args.warmup_epochs} if args.lr_scaling != "none" else {})
    return {"batch_size": args.batch_size, "lr": args.lr, "seed": args.seed, "limit_train": args.limit_train,
            **schedule}


def checkpoint_path(args):
    return Path(args.checkpoint_dir) / "multi_gpu.pt" if args.checkpoint_dir else None


def read_checkpoint(args):
    """The checkpoint in --checkpoint-dir when resuming and there is one, verified (see common.load_checkpoint)."""
    path = checkpoint_path(args)
    if not (args.resume and path.exists()):
        return None
    return load_checkpoint(path, "multi_gpu", "--resume", keys=("params", "history", "recipe"))


def broadcast_checkpoint(args, rank):
    """Rank 0 reads the checkpoint and broadcasts it, so only rank 0 needs the file (also across nodes).
    The shuffling of epoch e depends on the seed and e alone, so the parameters and the history are all a
    resumed run needs to continue as if it had never stopped."""
    state = [read_checkpoint(args) if rank == 0 else None]
    dist.broadcast_object_list(state, src=0)
    return state[0]


def write_checkpoint(args, flat_params, history):
    """After every epoch, by rank 0, atomically: a failed write keeps the previous checkpoint."""
    if args.checkpoint_dir:
        save_checkpoint(checkpoint_path(args), "multi_gpu", {"epoch": len(history), "params": flat_params.cpu(),
                                                             "history": history, "recipe": recipe(args)},
                        "--checkpoint-dir")


def report(args, history, world_size, device, n_train, resumed_after):
    """The JSON line, then the plot: a plot that cannot be written loses neither the figures nor the checkpoint."""
    ran = history[resumed_after:] or history
    seconds = sorted(h["seconds"] for h in ran)[len(ran) // 2]  # median: the first epoch includes warm-up
    last = history[-1] if history else {}
    emit_result("multi_gpu", allreduce=args.allreduce, world_size=world_size, device=device.type,
                batch_size=args.batch_size, lr=learning_rate(args, math.inf, 1), epochs=len(history),
                loss=last.get("loss"), train_acc=last.get("train_acc"), test_acc=last.get("test_acc"),
                s_per_epoch=seconds, samples_per_s=n_train / seconds, history=history)
    if args.plot:
        plot_learning_curve(history, args.plot)


def plot_learning_curve(history, path):
    """Test accuracy and training loss per epoch as a PNG, written atomically: a failed write keeps the old file."""
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
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=100)
    plt.close(figure)
    write_or_fail(path, png.getvalue(), "--plot", kept="the JSON result and the checkpoints are kept")


if __name__ == "__main__":
    run_main(main)
