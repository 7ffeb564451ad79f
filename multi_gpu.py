"""Data-parallel training of LeNet on Fashion-MNIST (D2L 13.5), one process per device, with hand-written allreduce.

Every process holds a full copy of the model. Each global minibatch (256 images) is cut into one shard per process;
each process computes the loss and gradients of its shard, the gradients are summed across processes (allreduce),
and every process applies the same SGD update, so the copies stay identical and the run computes what one process
would on the same global batches. `--allreduce` picks how the gradients are summed: `tutorial` (everyone sends to
rank 0, which sums and sends back, as in the chapter), `ring` (reduce-scatter, then all-gather, around a ring: the
chapter's exercise 3), `builtin` (torch.distributed.all_reduce) or `ddp` (DistributedDataParallel). Every process
scores its share of the test set (exercise 4); `--batch-per-device` and `--lr-scaling` let the batch and the rate
grow with the number of devices (exercises 1 and 2).

    python multi_gpu.py --gpus 2                         # two GPUs, NCCL, one process each
    python multi_gpu.py --gpus 0 --procs 2               # two CPU processes, gloo (the default without GPUs)
    torchrun --standalone --nproc-per-node 2 multi_gpu.py --gpus 0
    # a failed process restarts the group (up to 3 times), which resumes from the last epoch's checkpoint:
    torchrun --standalone --nproc-per-node 2 --max-restarts 3 multi_gpu.py --gpus 0 --checkpoint-dir ckpt --resume
    # two nodes, two GPUs each (on both machines; NODE_RANK 0 and 1, MASTER_ADDR = node 0's address):
    torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 2 --master-addr $MASTER_ADDR --master-port 29400 \\
        multi_gpu.py --gpus 2

Rank 0 prints one line per epoch, then the result as one JSON line:

    epoch 10 | loss L | train acc A | test acc A | S s/epoch | Nk samples/s
    {"script": "multi_gpu", "allreduce": "ring", "world_size": 2, "device": "cpu", "batch_size": 256, "lr": 0.2,
     "epochs": 10, "loss": L, "train_acc": A, "test_acc": A, "s_per_epoch": S, "samples_per_s": N, "history": [...]}
"""

import dataclasses
import datetime
import math
import os
import time
from pathlib import Path
from typing import Literal, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import common


@dataclasses.dataclass
class Args:
    # The tutorial's settings
    gpus: Optional[common.NonNegative] = None
    """GPUs to train on, one process each (NCCL on CUDA); 0 trains on --procs CPU processes (gloo); not given: every
    GPU of this machine, or 0 if it has none"""
    batch_size: Optional[common.Positive] = None
    """global minibatch, split evenly across the processes; not given: 256 (the tutorial's), or --batch-per-device
    times the processes"""
    lr: common.PositiveFloat = 0.2
    """SGD learning rate (with --lr-scaling: the rate for a global batch of --lr-base-batch)"""
    epochs: common.Positive = 10
    """passes over the training set"""
    allreduce: Literal["tutorial", "ring", "builtin", "ddp"] = "ring"
    """how the gradients are summed across processes"""
    seed: common.Seed = 0
    """seed of the initial parameters and of the shuffling"""
    # Data
    limit_train: Optional[common.Positive] = None
    """train on the first N training images only (quick runs); not given: all 60,000"""
    limit_test: Optional[common.Positive] = None
    """score the test accuracy on the first N test images only (quick runs); not given: all 10,000"""
    data_dir: Optional[str] = None
    """folder with the Fashion-MNIST .gz files, or its parent; not given: downloaded once into
    ~/.cache/torch-distributed-patterns"""
    # Larger batches for more devices (exercises 1 and 2)
    batch_per_device: Optional[common.Positive] = None
    """minibatch of each process, instead of --batch-size: with k processes the global batch is k times this"""
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    """scale --lr to the global batch b: by b / --lr-base-batch (linear) or by its square root (sqrt)"""
    lr_base_batch: common.Positive = 256
    """the global batch that --lr is meant for when --lr-scaling scales it"""
    warmup_epochs: Optional[common.PositiveFloat] = None
    """with --lr-scaling, ramp the rate from --lr up to the scaled rate over this many epochs; not given: no warm-up"""
    # Output and checkpoints
    plot: Optional[str] = None
    """save the learning curve (training loss, training and test accuracy per epoch) to this .png, .pdf or .svg file;
    not given: no plot"""
    checkpoint_dir: Optional[str] = None
    """save a checkpoint (multi_gpu.pt) in this folder after every epoch; not given: no checkpoints"""
    resume: bool = False
    """continue from the checkpoint in --checkpoint-dir, if there is one"""
    # Devices and launch
    procs: common.Positive = 2
    """CPU processes when --gpus is 0"""
    timeout: common.PositiveFloat = 60.0
    """how long a collective waits for a peer before the run fails"""
    tf32: bool = True
    """on Ampere and newer GPUs, let convolutions and matrix products use TF32 (--no-tf32: IEEE float32, for results
    that match other devices within rounding)"""
    cuda_graphs: bool = True
    """on GPUs, replay each step's forward and backward as one CUDA graph (--no-cuda-graphs: one launch per kernel)"""


# ---------------------------------------------------------------------------------------------------------
# The tutorial (D2L 13.5): LeNet as parameters, get_params, allreduce, split_batch, train_batch, train
# ---------------------------------------------------------------------------------------------------------

PARAM_SHAPES = [(20, 1, 3, 3), (20,), (50, 20, 5, 5), (50,), (800, 128), (128,), (128, 10), (10,)]


def init_params(seed, scale=0.01):
    """The tutorial's initialisation: weights N(0, scale^2), biases zero, one flat tensor (float32, CPU)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randn(math.prod(shape), generator=generator) * scale if len(shape) > 1
                      else torch.zeros(math.prod(shape)) for shape in PARAM_SHAPES])


def unflatten(flat):
    """Views of the flat buffer shaped like the parameters: writing one writes the other."""
    chunks = flat.split([math.prod(shape) for shape in PARAM_SHAPES])
    return [chunk.view(shape) for chunk, shape in zip(chunks, PARAM_SHAPES)]


def lenet(X, params):
    W1, b1, W2, b2, W3, b3, W4, b4 = params
    h1 = F.avg_pool2d(F.relu(F.conv2d(X, W1, b1)), kernel_size=2, stride=2)
    h2 = F.avg_pool2d(F.relu(F.conv2d(h1, W2, b2)), kernel_size=2, stride=2)
    h3 = F.relu(h2.flatten(1) @ W3 + b3)
    return h3 @ W4 + b4


def get_params(params, device):
    """The tutorial's get_params: the parameters (one flat tensor) copied to the device, as the list lenet takes,
    each with its gradient. Returns (that list, the flat parameters, the flat gradients): each parameter and its
    gradient are views into the two flat buffers, so that summing the gradients and the update are one call each."""
    flat_params = params.to(device)
    flat_grads = torch.zeros_like(flat_params)
    device_params = [nn.Parameter(param) for param in unflatten(flat_params)]
    for param, grad in zip(device_params, unflatten(flat_grads)):
        param.grad = grad
    return device_params, flat_params, flat_grads


def allreduce(data, rank, world_size):
    """The tutorial's allreduce between processes: rank 0 receives every gradient, sums, and sends the sum back to
    each rank. Rank 0 moves 2(k-1) full buffers while the others wait: its link is the bottleneck."""
    if rank == 0:
        incoming = torch.empty_like(data)
        for source in range(1, world_size):
            dist.recv(incoming, source)
            data += incoming
        for destination in range(1, world_size):
            dist.send(data, destination)
    else:
        dist.send(data, 0)
        dist.recv(data, 0)


class Replica:
    """This process's copy of LeNet (get_params), its forward in training (which the variants below replace), how its
    gradients are summed (`sum_gradients`, the tutorial's allreduce unless given another) and its update. Lives in
    every process."""

    def __init__(self, params, device, rank, world_size, sum_gradients=allreduce):
        self.device_params, self.flat_params, self.flat_grads = get_params(params, device)
        self.rank, self.world_size, self.sum_gradients = rank, world_size, sum_gradients

    def forward(self, X):
        return lenet(X, self.device_params)

    def sgd(self, lr):  # the tutorial's d2l.sgd (the loss is already divided by the batch size)
        self.flat_params.sub_(self.flat_grads, alpha=lr)
        self.flat_grads.zero_()


def split_batch(X, y, rank, world_size):
    """The tutorial's split_batch, for one process: its shard of the global batch."""
    return X.tensor_split(world_size)[rank], y.tensor_split(world_size)[rank]


def train_batch(X, y, model, lr):
    """The tutorial's train_batch in one process: the loss and gradients of this process's shard of the global
    batch (X, y), the gradients summed over every process, the same update everywhere. Returns the shard's [loss
    sum, correct predictions], on the device.

    The shard's loss sum is divided by the GLOBAL batch size (the tutorial divides in sgd): summed over the
    processes, the gradients are those of the mean loss of the whole batch, as one process would compute them."""
    X_shard, y_shard = split_batch(X, y, model.rank, model.world_size)
    logits = model.forward(X_shard)
    loss = F.cross_entropy(logits, y_shard, reduction="sum")
    (loss / len(X)).backward()
    model.sum_gradients(model.flat_grads, model.rank, model.world_size)
    model.sgd(lr)
    return torch.stack([loss.detach(), (logits.argmax(1) == y_shard).sum().to(loss.dtype)])


@torch.no_grad()
def evaluate_accuracy(model, images, labels, batch_size=256):
    """Test accuracy on every process (the chapter's exercise 4): each counts its share of the test set with lenet
    and the replica's parameters, as the tutorial scores lenet(x, device_params[0]); the counts are summed. In the
    tutorial's test batches of 256, whose activations stay in a CPU's cache where larger ones do not."""
    my_images, my_labels = split_batch(images, labels, model.rank, model.world_size)
    correct = sum((lenet(X, model.device_params).argmax(1) == y).sum()
                  for X, y in zip(my_images.split(batch_size), my_labels.split(batch_size)))
    dist.all_reduce(correct)
    return correct.item() / len(labels)


def train(model, data, args, history, learning_rate):
    """The tutorial's train() for this process's device, from the epoch after those in `history`: each epoch, the
    global batches in an order drawn from --seed and the epoch (every rank draws the same, so all agree on the
    batches without communicating), train_batch on each with the rate learning_rate(args, step, steps per epoch)
    gives, then the test accuracy. Rank 0 prints a line per epoch. Yields each epoch's record, added to history."""
    images, labels, test_images, test_labels = data
    for epoch in range(len(history), args.epochs):
        started = time.perf_counter()
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        batches = order.to(images.device).split(args.batch_size)
        totals = torch.zeros(2, device=images.device)
        for i, batch in enumerate(batches):
            totals += train_batch(images[batch], labels[batch], model, learning_rate(args, epoch * len(batches) + i,
                                                                                       len(batches)))
        dist.all_reduce(totals)
        loss, train_acc = (totals / len(images)).tolist()  # waits for the epoch's last step
        seconds = time.perf_counter() - started
        test_acc = evaluate_accuracy(model, test_images, test_labels)
        history.append(dict(epoch=epoch + 1, loss=loss, train_acc=train_acc, test_acc=test_acc, seconds=seconds))
        if model.rank == 0:
            print(f"epoch {epoch + 1} | loss {loss:.3f} | train acc {train_acc:.3f} | test acc {test_acc:.3f} | "
                  f"{seconds:.2f} s/epoch | {len(images) / seconds / 1000:.1f}k samples/s", flush=True)
        yield history[-1]


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: the ring (the chapter's exercise 3), torch's all_reduce and DistributedDataParallel
# ---------------------------------------------------------------------------------------------------------

def ring_allreduce(data, rank, world_size):
    """Bandwidth-optimal ring allreduce (the chapter's exercise 3). The buffer is cut into k chunks, and at step s
    every rank r sends chunk r-s to its right neighbour and receives chunk r-s-1 from its left. Reduce-scatter: in
    the first k-1 steps it adds what arrives to its own copy of that chunk, after which rank r holds the full sum of
    chunk r+1. All-gather: in the k-1 steps that follow it keeps what arrives, so the summed chunks go around the
    ring. Each rank sends and receives 2(k-1)/k of the buffer, whatever k is, where the tutorial's rank 0 moves
    2(k-1) whole buffers."""
    chunks = data.tensor_split(world_size)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    incoming = torch.empty_like(chunks[0])
    for step in range(2 * (world_size - 1)):
        send, receive = chunks[(rank - step) % world_size], chunks[(rank - step - 1) % world_size]
        reducing = step < world_size - 1  # reduce-scatter, then all-gather
        arriving = incoming[:receive.numel()] if reducing else receive
        for request in exchange(send, right, arriving, left):
            request.wait()
        if reducing:
            receive.add_(arriving)


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


# --allreduce: the function that sums the gradients (ddp: DistributedDataParallel, below)
ALLREDUCES = {"tutorial": allreduce, "ring": ring_allreduce, "builtin": lambda data, *_: dist.all_reduce(data)}


class LeNet(nn.Module):
    """The same parameters and forward as an nn.Module, which is what DistributedDataParallel wraps."""

    def __init__(self, params):
        super().__init__()
        self.params = nn.ParameterList(params)

    def forward(self, X):
        return lenet(X, self.params)


class DDPReplica(Replica):
    """The replica with DistributedDataParallel, which sums the gradients during backward, into the same flat buffer,
    and divides them by the k processes: what is left to do after backward is to multiply them by k, which gives the
    sum that the other variants compute. Without device_ids DDP takes the module and the inputs where they are."""

    def __init__(self, params, device, rank, world_size):
        super().__init__(params, device, rank, world_size, sum_gradients=lambda grads, _, k: grads.mul_(k))
        self.ddp = nn.parallel.DistributedDataParallel(LeNet(self.device_params))

    def forward(self, X):
        return self.ddp(X)


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: larger batches for more devices (the chapter's exercises 1 and 2)
# ---------------------------------------------------------------------------------------------------------

def scaled_lr(args):
    """The rate after the warm-up: --lr scaled to the global batch as --lr-scaling says (see learning_rate)."""
    growth = args.batch_size / args.lr_base_batch
    return args.lr * {"none": 1.0, "linear": growth, "sqrt": math.sqrt(growth)}[args.lr_scaling]


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
    scaled = scaled_lr(args)
    warmup_steps = (args.warmup_epochs or 0) * steps_per_epoch
    return scaled if step >= warmup_steps else args.lr + (scaled - args.lr) * step / warmup_steps


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: CUDA graphs
# ---------------------------------------------------------------------------------------------------------

class GraphedReplica(Replica):
    """The replica whose LeNet forward and backward run as CUDA graphs, captured once per shard shape by
    torch.cuda.make_graphed_callables and replayed at every step (evaluate_accuracy calls lenet itself, without
    graphs: its batches have other shapes and no backward). Lives in every GPU process.

    A LeNet step is about sixty small kernels, each launched from Python: on a GPU those launches, not the
    arithmetic, set the pace. A graph launches them all at once. The loss, the allreduce and the update run as they
    do without graphs, so every backend's collectives behave as usual, and the gradients still land in the flat
    buffer. DDP sums the gradients during backward, so it runs without graphs."""

    def __init__(self, *args):
        super().__init__(*args)
        self.graphed = {}  # shard shape: LeNet's forward and backward as graphs

    def forward(self, X):
        if X.shape not in self.graphed:
            self.graphed[X.shape] = torch.cuda.make_graphed_callables(LeNet(self.device_params), (X,))
        return self.graphed[X.shape](X)


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: checkpoints (resume with any process count) and the learning curve
# ---------------------------------------------------------------------------------------------------------

CHECKPOINT = "multi_gpu.pt"  # the file in --checkpoint-dir


def recipe(args):
    """What a resumed run must share with the run that wrote the checkpoint (the process count may differ). The
    shuffling of epoch e depends on the seed and e alone, so the parameters and the history are all a resumed run
    needs to continue as if it had never stopped."""
    names = ("batch_size", "lr", "seed", "limit_train", "limit_test", "lr_scaling", "lr_base_batch", "warmup_epochs")
    return {name: getattr(args, name) for name in names}


def read_checkpoint(args):
    """The checkpoint to resume from, checked against this run (its recipe, its parameters, its epochs), after a line
    on stdout that says so; None without --resume or before the first checkpoint is written."""
    path = Path(args.checkpoint_dir, CHECKPOINT)
    if not (args.resume and path.exists()):
        return None
    saved = common.load_checkpoint(path, "multi_gpu", "--resume", keys=("params", "history", "recipe"))
    common.check(saved["recipe"] == recipe(args), f"--resume {path}: written with {saved['recipe']}, not "
                                                  f"{recipe(args)}; pass the same flags or another --checkpoint-dir")
    common.check(torch.is_tensor(saved["params"]) and saved["params"].shape == init_params(0).shape,
                 f"--resume {path}: its parameters do not fit LeNet; pass another --checkpoint-dir")
    common.check(len(saved["history"]) <= args.epochs, f"--resume {path}: holds {len(saved['history'])} epochs, "
                                                       f"more than --epochs {args.epochs}; pass a larger --epochs")
    print(f"resuming after epoch {len(saved['history'])} from {path}", flush=True)
    return saved


def learning_curve(history):
    """Training loss, training and test accuracy per epoch, as D2L's Animator draws them."""
    from matplotlib.figure import Figure

    axis = Figure(figsize=(6, 4)).add_subplot(xlabel="epoch")
    axis.plot([h["epoch"] for h in history], [[h["loss"], h["train_acc"], h["test_acc"]] for h in history], "o-")
    axis.legend(["loss", "train acc", "test acc"])
    return axis.figure


# ---------------------------------------------------------------------------------------------------------
# The run: main checks every flag and reads the data and the checkpoint once; mp.spawn starts run_worker
# ---------------------------------------------------------------------------------------------------------

def validate(args):
    """The rules that involve several flags, the machine or the launcher, checked before any data is read: each broken
    rule is one line and exit status 2. Fills in --gpus and --batch-size; returns the checkpoint to resume from, read
    by rank 0 (the launcher, or torchrun's rank 0), else None."""
    torchrun, gpus_here = common.torchrun_env(), torch.accelerator.device_count()
    local = torchrun["LOCAL_WORLD_SIZE"] if torchrun else gpus_here  # processes on this machine, one per GPU
    if args.gpus is None:  # every GPU of this machine
        args.gpus = local if gpus_here else 0
    common.check(not torchrun or args.gpus in (0, local), f"--gpus {args.gpus}: torchrun started {local} processes on "
                 f"this machine, one per GPU; pass --gpus {local}, or --gpus 0 to train on CPUs")
    common.check(args.gpus <= gpus_here, f"--gpus {args.gpus}: this machine shows {gpus_here} GPUs, and NCCL needs one "
                 f"per process; pass --gpus 0 to train on CPUs")
    processes = torchrun["WORLD_SIZE"] if torchrun else args.gpus or args.procs
    common.check(not (args.batch_size and args.batch_per_device), "pass --batch-size or --batch-per-device, not both")
    args.batch_size = args.batch_per_device * processes if args.batch_per_device else args.batch_size or 256
    common.check(args.batch_size >= processes, f"--batch-size {args.batch_size}: smaller than the {processes} "
                                               f"processes, and every process needs a shard; pass a larger one")
    common.check(not args.resume or args.checkpoint_dir, "--resume needs --checkpoint-dir DIR, where the checkpoint is")
    common.check(not args.plot or Path(args.plot).suffix.lower() in (".png", ".pdf", ".svg"),
                 f"--plot {args.plot}: name a .png, .pdf or .svg file")
    if args.plot and (not torchrun or torchrun["RANK"] == 0):  # rank 0 draws it
        common.check_output_file("--plot", args.plot)
    if not args.checkpoint_dir or torchrun and torchrun["RANK"] != 0:  # rank 0 alone writes and reads checkpoints
        return None
    common.make_dir("--checkpoint-dir", args.checkpoint_dir)
    return read_checkpoint(args)


@common.worker
def run_worker(rank, world_size, store, args, data_folder, saved):
    """One process: its device, the process group, the data on the device, the start (rank 0's, broadcast), then
    train; rank 0 alone checkpoints after each epoch, then prints the JSON line and plots. Each process reads the
    data itself, already checked by main: sent with mp.spawn, they would travel through /dev/shm, which a container
    may keep too small for them."""
    # this process's share of the machine's cores for torch's threads
    torch.set_num_threads(max(1, common.usable_cpus() // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
    device = common.pick_device(args.gpus > 0, common.local_rank(rank))
    common.set_tf32(device, args.tf32)
    # the device's backend: gloo on CPUs, NCCL on CUDA, XCCL on XPU; a collective fails after --timeout, not hangs
    dist.init_process_group(dist.get_default_backend_for_device(device), init_method=common.init_method(store, "pg"),
                            rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=args.timeout),
                            device_id=device if args.gpus else None)
    # The whole data set on the device, the images as floats [N, 1, 28, 28] in [0, 1] (what the tutorial's ToTensor
    # gives): a step needs no loader and no host copy, only an index.
    train_x, train_y, test_x, test_y = (tensor.to(device) for tensor in common.load_fashion_mnist(data_folder))
    data = (train_x[:args.limit_train].unsqueeze(1).float() / 255, train_y[:args.limit_train],
            test_x[:args.limit_test].unsqueeze(1).float() / 255, test_y[:args.limit_test])
    # Rank 0's start wins on every rank: the checkpoint it read in main (so only rank 0 needs the file, also across
    # machines; the other ranks of a torchrun have None), or else the seed's parameters, the same on every rank.
    start = [saved or {"params": init_params(args.seed), "history": []}]
    dist.broadcast_object_list(start, src=0)
    history = start[0]["history"]
    if args.allreduce == "ddp":
        model = DDPReplica(start[0]["params"], device, rank, world_size)
    else:
        replica = GraphedReplica if device.type == "cuda" and args.cuda_graphs else Replica
        model = replica(start[0]["params"], device, rank, world_size, ALLREDUCES[args.allreduce])
    seconds = []  # of the epochs this run trains
    for record in train(model, data, args, history, learning_rate):
        seconds.append(record["seconds"])
        if rank == 0 and args.checkpoint_dir:  # atomically: a failed write keeps the previous checkpoint
            state = dict(epoch=len(history), params=model.flat_params.cpu(), history=history, recipe=recipe(args))
            common.save_checkpoint(Path(args.checkpoint_dir, CHECKPOINT), "multi_gpu", state)
    # s_per_epoch: the median epoch this run trained (the first includes warm-up); null when it trained none.
    median = sorted(seconds)[len(seconds) // 2] if seconds else None
    if rank == 0:
        common.emit_result("multi_gpu", allreduce=args.allreduce, world_size=world_size, device=device.type,
                           batch_size=args.batch_size, lr=scaled_lr(args), epochs=len(history),
                           **{key: history[-1][key] for key in ("loss", "train_acc", "test_acc")}, s_per_epoch=median,
                           samples_per_s=len(data[0]) / median if median else None, history=history)
        if args.plot:  # after the JSON line: a plot that cannot be written loses neither it nor a checkpoint
            common.save_figure(learning_curve(history), args.plot)
    dist.destroy_process_group()


def main(argv=None):
    args = common.parse_args(Args, argv)
    saved = validate(args)
    data_folder = common.fashion_mnist_dir(args.data_dir)  # downloaded once, checked before any process starts
    if torchrun := common.torchrun_env():  # started by torchrun (RANK set): this process's part
        return run_worker(torchrun["RANK"], torchrun["WORLD_SIZE"], "env://", args, data_folder, saved)
    world_size = args.gpus or args.procs
    with common.rendezvous() as store:
        common.join(mp.spawn(run_worker, args=(world_size, store, args, data_folder, saved), nprocs=world_size,
                             join=False))


if __name__ == "__main__":
    common.run_main(main)
