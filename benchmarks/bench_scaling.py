"""How far each pattern scales: a cost model's inputs measured here, the model fitted, checked and extrapolated.

Measures, over gloo on loopback with one thread per process (a process stands for one device):
  - the round trip of a message between two processes, an exchange (both send at once, as a ring step does) and a
    sum, for sizes from 4 bytes to 64 MB;
  - each allreduce of multi_gpu.py (tutorial, ring, builtin) at 2 and 3 processes over the same sizes;
  - a LeNet training step without allreduce at the shard k devices get (256/k images), and the whole step
    (multi_gpu's train_batch with each allreduce) at 2 and 3 processes;
  - for rpc_rl.py's BatchAgent with 1, 2 and 4 observers of K = 1, 4 and 16 environments: the agent's answer to a
    step for N*K states (act: masks, forward, sampling), a CartPole step, the round trip of an RPC and its cost when
    many arrive at once, and whole steps end to end.
Then fits the model of docs/scaling.md, puts its value beside every measured point with the error, and predicts
k = 1..64 devices on four interconnects and N = 1..64 observers. Ends with one JSON line: the machine, every
measured point, the fitted constants, the check and the predictions. --render reads that line from a file, draws
the two figures and prints the tables of docs/scaling.md, each under the marker it replaces there.

    python benchmarks/bench_scaling.py --gpu-step-ms MS | tee scaling.txt    # measure: a few minutes, quiet machine
    python benchmarks/bench_scaling.py --render scaling.txt                    # figures and tables from that run
    python benchmarks/bench_scaling.py --tiny                                  # seconds: what the tests run

A measuring run prints one line per part, the check's summary, then the JSON line:
    compute: 8 shard sizes, S s
    2 processes: round trip, exchange, 3 allreduces at 10 sizes, 3 steps, S s
    ...
    check: P points, median error E % (E % over the Q not fitted), worst R x (...), M off by more than 2x
    {"script": "bench_scaling", "machine": {...}, "constants": {...}, "check": [...], "predictions": {...}, ...}
"""

import dataclasses
import functools
import json
import math
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import rpc

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

from bench_rpc_rl import machine  # noqa: E402

import common  # noqa: E402
import multi_gpu  # noqa: E402
import rpc_rl  # noqa: E402
from common import InFile, OutDir, Positive, PositiveFloat, check  # noqa: E402


@dataclasses.dataclass
class Args:
    # What to measure
    sizes: str = "1,8,64,512,4096,32768,129068,262144,2097152,16777216"
    """comma-separated message and buffer sizes in floats of 4 bytes (the default: 4 B to 64 MB, and LeNet's
    gradient)"""
    procs: str = "2,3"
    """comma-separated process counts at which the allreduces and the whole step are timed (2 must be there)"""
    devices: str = "1,2,3,4,8,16,32,64"
    """comma-separated device counts k: a LeNet step is timed on the shard each gets, 256/k images"""
    observers: str = "1,2,4"
    """comma-separated observer counts N of the agent's timings (1 must be there)"""
    envs: str = "1,4,16"
    """comma-separated environments per observer K of the agent's timings"""
    rounds: Positive = 9
    """timed rounds per point, interleaved with the other points of its group; a point is the fastest"""
    round_seconds: PositiveFloat = 0.1
    """how long a round times back-to-back calls (one call at least)"""
    tiny: bool = False
    """a few sizes, 2 processes, 1 observer, short rounds: seconds, for the tests"""
    # Predictions
    gpu_step_ms: Optional[PositiveFloat] = None
    """a LeNet training step (forward, backward, update) of 256 images on one GPU, in ms, for the predictions; not
    given: a device computes as one core of this machine does"""
    # Rendering
    render: Optional[InFile] = None
    """measure nothing: read the JSON line of a measuring run from this file, draw the figures and print the tables"""
    figures: OutDir = str(REPO / "docs" / "figures")
    """folder --render writes scaling_multi_gpu.png and scaling_rpc.png into"""


# ---------------------------------------------------------------------------------------------------------
# What the model knows of LeNet, of the training run and of the interconnects it predicts
# ---------------------------------------------------------------------------------------------------------

ALGORITHMS = tuple(multi_gpu.ALLREDUCES)  # tutorial, ring, builtin
GRADIENT_BYTES = 4 * multi_gpu.init_params(0).numel()  # LeNet's 129,068 float32 gradients
BATCH = 256  # the tutorial's global batch
STEPS_PER_EPOCH = math.ceil(common.FASHION_MNIST_TRAIN / BATCH)

# Interconnects of the predictions: (bandwidth each way in bytes/s, as its maker publishes it; time per message in s,
# which no maker publishes for a message sent by NCCL: an assumption). docs/scaling.md cites and explains each.
LINKS = {
    "NVLink 4": (450e9, 5e-6),  # H100/H200 SXM: 900 GB/s per GPU, both directions together
    "PCIe 5.0 x16": (64e9, 10e-6),  # 32 GT/s on 16 lanes: 128 GB/s, both directions together
    "InfiniBand NDR": (50e9, 10e-6),  # 400 Gb/s per port, each way
    "100 Gb Ethernet": (12.5e9, 30e-6),  # 100 Gb/s each way
}
FIGURE_LINKS = ("NVLink 4", "100 Gb Ethernet")
GPU_MEMORY_BANDWIDTH = 3.35e12  # H100 SXM's HBM3, bytes/s: a sum reads two bytes and writes one per byte summed
PREDICTED_DEVICES = range(1, 65)
PREDICTED_OBSERVERS = range(1, 65)
PREDICTED_ENVS = (1, 16)


TINY = {"sizes": "1,129068,4194304", "procs": "2", "devices": "1,64", "observers": "1", "envs": "1,64", "rounds": 15,
        "round_seconds": 0.005}
MEASURING = ("sizes", "procs", "devices", "observers", "envs", "rounds", "round_seconds", "tiny", "gpu_step_ms")


def counts(flag, text, low, high):
    """The whole numbers of a comma-separated flag, sorted, each from low to high."""
    try:
        values = sorted({int(value) for value in text.split(",")})
    except ValueError:
        values = []
    check(values and low <= values[0] and values[-1] <= high, f"{flag} {text}: want comma-separated whole numbers "
                                                              f"from {low} to {high}")
    return values


def validate(args):
    """With --render: no measuring flag. Otherwise --tiny's settings, and every list parsed into its numbers, checked
    to give the fits enough points."""
    if args.render:
        common.check_used(args, **dict.fromkeys(MEASURING, "when measuring, without --render"))
        return
    common.check_used(args, figures="with --render")
    if args.tiny:
        common.check_used(args, **dict.fromkeys(TINY, "without --tiny, which sets it"))
        for name, value in TINY.items():
            setattr(args, name, value)
    args.sizes = counts("--sizes", args.sizes, 1, 2**28)
    args.procs = counts("--procs", args.procs, 2, 4 * common.usable_cpus())
    args.devices = counts("--devices", args.devices, 1, BATCH)
    args.observers = counts("--observers", args.observers, 1, 4 * common.usable_cpus() - 1)
    args.envs = counts("--envs", args.envs, 1, 1024)
    check(len(args.sizes) >= 2, f"--sizes {args.sizes}: the fits need two sizes at least")
    check(args.procs[0] == 2, f"--procs {args.procs}: 2 must be there (the round trip and the exchange)")
    check(len({math.ceil(BATCH / k) for k in args.devices}) >= 2, f"--devices {args.devices}: the fit of a step's "
                                                                   f"compute needs two shard sizes at least")
    check(args.observers[0] == 1, f"--observers {args.observers}: 1 must be there (the RPC's costs)")
    common.check_memory("the buffers of the largest size", 8 * args.sizes[-1] * (args.procs[-1] + 1), "--sizes")


# ---------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------

MAX_CALLS = 100_000  # per round: a call that the probe times too fast to see must not run for ever


def seconds_per_call(operations, args, group=False):
    """{name: seconds per call of operations[name]()}: the fastest of --rounds rounds, each timing back-to-back calls
    for about --round-seconds (one at least), the operations interleaved round by round. The fastest, because other
    work on the machine can only slow a round down, and the model describes the machine undisturbed. After a warm-up
    call, one timed call sets the calls per round. In a process group (group=True) every rank runs the same calls:
    the ranks start each round together, a round lasts until the slowest is done, and all use the slowest's probe."""
    def timed(operation, calls):
        if group:
            dist.barrier()
        started = time.perf_counter()
        for _ in range(calls):
            operation()
        elapsed = torch.tensor((time.perf_counter() - started) / calls, dtype=torch.float64)
        if group:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return elapsed.item()

    calls = {}
    for name, operation in operations.items():
        operation()  # the first calls connect, allocate and fill caches
        calls[name] = max(1, min(MAX_CALLS, int(args.round_seconds / timed(operation, 1))))
    times = {name: [] for name in operations}
    for _ in range(args.rounds):
        for name, operation in operations.items():
            times[name].append(timed(operation, calls[name]))
    return {name: min(values) for name, values in times.items()}


def timed_part(what, part, *part_args):
    """The points of part(*part_args), after which one line says how long it took."""
    started = time.perf_counter()
    points = part(*part_args)
    print(f"{what}, {time.perf_counter() - started:.1f} s", flush=True)
    return points


# ---------------------------------------------------------------------------------------------------------
# Measured in this process: a LeNet step's compute, a sum, a CartPole step
# ---------------------------------------------------------------------------------------------------------

def measure_compute(args):
    """multi_gpu's train_batch in one process, with no allreduce (forward, loss, backward, update), on the shard of
    each device count: 256/k images, rounded up as tensor_split gives rank 0."""
    model = multi_gpu.Replica(multi_gpu.init_params(0), torch.device("cpu"), 0, 1, sum_gradients=lambda *_: None)
    operations = {}
    for images in sorted({math.ceil(BATCH / k) for k in args.devices}):
        X, y = torch.rand(images, 1, 28, 28), torch.randint(10, (images,))
        operations[images] = functools.partial(multi_gpu.train_batch, X, y, model, 0.0)  # rate 0: same cost
    return [{"series": "compute", "images": images, "seconds": seconds}
            for images, seconds in seconds_per_call(operations, args).items()]


def measure_sums(args):
    """`total += part`, as the allreduces add what arrives, for every size."""
    operations = {}
    for floats in args.sizes:
        total, part = torch.zeros(floats), torch.zeros(floats)  # zeros: no overflow or denormals over many calls
        operations[4 * floats] = functools.partial(total.add_, part)
    return [{"series": "sum", "bytes": nbytes, "seconds": seconds}
            for nbytes, seconds in seconds_per_call(operations, args).items()]


def measure_env_step(args):
    """A CartPole step as an observer takes it (the new state as a list), with a reset when an episode ends."""
    env, chooser = gym.make(rpc_rl.ENV_ID), random.Random(0)
    env.reset(seed=0)

    def step():
        state, _, terminated, truncated, _ = env.step(chooser.randrange(2))
        if terminated or truncated:
            state, _ = env.reset()
        state.tolist()

    return [{"series": "env step", "seconds": seconds_per_call({"step": step}, args)["step"]}]


# ---------------------------------------------------------------------------------------------------------
# Measured in a process group: round trip, exchange, the allreduces, the whole step
# ---------------------------------------------------------------------------------------------------------

def round_trip(buffer, rank):
    """Rank 0 sends the buffer to rank 1, which sends it back: one message each way, one after the other."""
    if rank == 0:
        dist.send(buffer, 1)
        dist.recv(buffer, 1)
    else:
        dist.recv(buffer, 0)
        dist.send(buffer, 0)


def exchange(outgoing, incoming, peer):
    """Both ranks send and receive at once, as every step of the ring does (multi_gpu.exchange)."""
    for request in multi_gpu.exchange(outgoing, peer, incoming, peer):
        request.wait()


@common.worker
def group_worker(rank, world_size, store, args, result_file):
    """One process of a group of k: every size's round trip and exchange (k = 2), its three allreduces, then the whole
    training step with each allreduce; rank 0 writes the points to result_file. One thread: a process is a device."""
    torch.set_num_threads(1)
    common.init_process_group(store, rank, world_size, "gloo", 600)
    points = []
    for floats in args.sizes:
        buffer, incoming = torch.zeros(floats), torch.zeros(floats)
        operations = {name: functools.partial(allreduce, buffer, rank, world_size)
                      for name, allreduce in multi_gpu.ALLREDUCES.items()}
        if world_size == 2:
            operations["round trip"] = functools.partial(round_trip, buffer, rank)
            operations["exchange"] = functools.partial(exchange, buffer, incoming, 1 - rank)
        for name, seconds in seconds_per_call(operations, args, group=True).items():
            points.append({"series": name, "bytes": 4 * floats, **({"k": world_size} if name in ALGORITHMS else {}),
                           "seconds": seconds})
    # the whole step: every rank draws the same global batch, and trains on its shard of it
    generator = torch.Generator().manual_seed(0)
    X, y = torch.rand(BATCH, 1, 28, 28, generator=generator), torch.randint(10, (BATCH,), generator=generator)
    operations = {}
    for name, allreduce in multi_gpu.ALLREDUCES.items():
        model = multi_gpu.Replica(multi_gpu.init_params(0), torch.device("cpu"), rank, world_size, allreduce)
        operations[name] = functools.partial(multi_gpu.train_batch, X, y, model, 0.0)
    for name, seconds in seconds_per_call(operations, args, group=True).items():
        points.append({"series": "step", "algorithm": name, "k": world_size, "seconds": seconds})
    if rank == 0:
        Path(result_file).write_text(json.dumps(points))
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# Measured with RPC: rpc_rl's BatchAgent and its observers
# ---------------------------------------------------------------------------------------------------------

STATE = [0.01, -0.02, 0.03, -0.04]  # a CartPole state: act's cost does not depend on the values
PINGS = 100  # RPCs per timed call of the round trip: the call that starts them counts for 1 %


def observe(observer_rref, agent_rref, envs, steps):
    """In an observer process: `steps` steps of the first `envs` environments of its rpc_rl.BatchObserver, one RPC
    per step as its run_episode sends, except that an episode that ends starts again at once: every step asks for
    `envs` actions."""
    observer = observer_rref.local_value()
    states = {index: env.reset()[0].tolist() for index, env in enumerate(observer.envs[:envs])}
    for _ in range(steps):
        actions = agent_rref.rpc_sync().select_action(observer.id, states, {})
        for index, action in zip(states, actions):
            state, _, terminated, truncated, _ = observer.envs[index].step(action)
            if terminated or truncated:
                state, _ = observer.envs[index].reset()
            states[index] = state.tolist()


def ping_agent(agent_rref, count, together):
    """In an observer process: `count` RPCs to the agent that do nothing, one after the other, or all sent at once
    (together), so that they queue at the agent as the requests of N observers do."""
    if together:
        torch.futures.wait_all([agent_rref.rpc_async().ping() for _ in range(count)])
    else:
        for _ in range(count):
            agent_rref.rpc_sync().ping()


class TimedAgent(rpc_rl.BatchAgent):
    """Lives in the agent process: rpc_rl's BatchAgent, driven for a set number of steps (observe), answering act's
    requests made up here, and an RPC that does nothing."""

    def __init__(self, world_size, args):
        super().__init__(world_size, args)
        self.observer_ids = sorted({ob_id for ob_id, _ in self.rewards})

    def ping(self):
        return None

    def answer(self, envs):
        """act as select_action calls it once every observer has asked: `envs` states from each."""
        self.trajectory = []
        self.act([(ob_id, (dict.fromkeys(range(envs), STATE), torch.futures.Future())) for ob_id in self.observer_ids])

    def run_steps(self, envs, steps):
        """`steps` steps of `envs` environments on every observer, as run_episode starts an episode."""
        self.playing, self.trajectory = set(self.observer_ids), []
        torch.futures.wait_all([rpc.rpc_async(ob_rref.owner(), observe, args=(ob_rref, self.agent_rref, envs, steps))
                                for ob_rref in self.ob_rrefs])


def measure_agent(observers, args):
    """In the agent process: with one observer, the round trip of an RPC, and what each RPC costs when many arrive
    together (the observer has a core of its own: the agent's work, not the cores' sharing, sets it); for each K,
    act for N*K states, then whole steps, their number set so that a call lasts about --round-seconds."""
    agent = TimedAgent(observers + 1, rpc_rl.Args(world_size=observers + 1, envs_per_observer=max(args.envs)))
    points = []
    if observers == 1:
        pings = {series: functools.partial(rpc.rpc_sync, agent.ob_rrefs[0].owner(), ping_agent,
                                           args=(agent.agent_rref, PINGS, series == "rpc queued"))
                 for series in ("rpc round trip", "rpc queued")}
        points += [{"series": series, "seconds": seconds / PINGS}
                   for series, seconds in seconds_per_call(pings, args).items()]
    acts = seconds_per_call({envs: functools.partial(agent.answer, envs) for envs in args.envs}, args)
    points += [{"series": "act", "states": observers * envs, "observers": observers, "envs": envs, "seconds": seconds}
               for envs, seconds in acts.items()]
    steps = {}
    for envs in args.envs:
        agent.run_steps(envs, 20)
        started = time.perf_counter()
        agent.run_steps(envs, 20)
        steps[envs] = max(20, int(args.round_seconds * 20 / (time.perf_counter() - started)))
    runs = seconds_per_call({envs: functools.partial(agent.run_steps, envs, steps[envs]) for envs in args.envs}, args)
    points += [{"series": "agent step", "observers": observers, "envs": envs, "seconds": seconds / steps[envs]}
               for envs, seconds in runs.items()]
    return points


@common.worker
def agent_worker(rank, world_size, store, args, result_file):
    """One process of rpc_rl's run as `rpc_rl.py --pin-cpus` starts it (one thread, a CPU of its own where there is
    one for each): rank 0 is the agent, which measures and writes the points to result_file; the others are its
    observers."""
    torch.set_num_threads(1)
    rpc_rl.pin_to_one_cpu(rank, world_size)
    name = rpc_rl.AGENT_NAME if rank == 0 else rpc_rl.OBSERVER_NAME.format(rank)
    common.init_rpc(store, name, rank, world_size, 600)
    if rank == 0:
        Path(result_file).write_text(json.dumps(measure_agent(world_size - 1, args)))
    rpc.shutdown()


def in_processes(worker, world_size, args):
    """The points that worker's rank 0 writes, started in world_size processes as the scripts start theirs."""
    with tempfile.TemporaryDirectory(prefix="bench_scaling-") as folder, common.rendezvous(world_size) as store:
        result_file = str(Path(folder, "points.json"))
        mp.spawn(worker, args=(world_size, store, args, result_file), nprocs=world_size, join=True)
        return json.loads(Path(result_file).read_text())


def measure(args):
    """Every point, each part announced by one line. This process, too, computes with one thread."""
    torch.set_num_threads(1)
    points = timed_part(f"compute: {len({math.ceil(BATCH / k) for k in args.devices})} shard sizes",
                        measure_compute, args)
    points += timed_part(f"sums: {len(args.sizes)} sizes", measure_sums, args)
    points += timed_part("a CartPole step", measure_env_step, args)
    for k in args.procs:
        what = "round trip, exchange, " if k == 2 else ""
        points += timed_part(f"{k} processes: {what}3 allreduces at {len(args.sizes)} sizes, 3 steps", in_processes,
                             group_worker, k, args)
    for observers in args.observers:
        points += timed_part(f"agent and {observers} observer(s): K = {', '.join(map(str, args.envs))}",
                             in_processes, agent_worker, observers + 1, args)
    return points


# ---------------------------------------------------------------------------------------------------------
# The model (docs/scaling.md writes it out), its fit and its check
# ---------------------------------------------------------------------------------------------------------

def allreduce_seconds(algorithm, nbytes, k, c):
    """One allreduce of nbytes over k processes with constants c. The tutorial's rank 0 takes in k-1 buffers, adds
    each, and sends k-1 back, one message after another; the ring (and gloo's builtin, a ring too) makes 2(k-1)
    exchanges of a chunk of n/k, adding what arrives in the first k-1. The builtin's own loop, in C++, has its own
    cost per step."""
    if algorithm == "tutorial":
        return 2 * (k - 1) * (c["alpha"] + nbytes * c["beta"]) + (k - 1) * (c["delta"] + nbytes * c["gamma"])
    alpha = c["alpha_builtin"] if algorithm == "builtin" else c["alpha_exchange"]
    chunk = nbytes / k
    return 2 * (k - 1) * (alpha + chunk * c["beta_exchange"]) + (k - 1) * (c["delta"] + chunk * c["gamma"])


def compute_seconds(images, c):
    return c["compute_fixed"] + images * c["compute_per_image"]


def agent_step_seconds(observers, envs, c):
    """A step of N observers with K environments each: the first observer's RPC costs its round trip, every other
    one what an RPC costs the agent when it queues behind others; the agent answers all with one act for N*K states;
    every observer steps its K environments, on a core of its own."""
    return (c["rpc_round_trip"] + (observers - 1) * c["rpc_per_observer"] + envs * c["env_step"]
            + c["act_fixed"] + observers * envs * c["act_per_state"])


def model_seconds(point, c):
    """The model's time for a measured point."""
    series = point["series"]
    if series == "round trip":
        return 2 * (c["alpha"] + point["bytes"] * c["beta"])
    if series == "exchange":
        return c["alpha_exchange"] + point["bytes"] * c["beta_exchange"]
    if series == "sum":
        return c["delta"] + point["bytes"] * c["gamma"]
    if series in ALGORITHMS:
        return allreduce_seconds(series, point["bytes"], point["k"], c)
    if series == "compute":
        return compute_seconds(point["images"], c)
    if series == "step":
        k = point["k"]
        return compute_seconds(math.ceil(BATCH / k), c) + allreduce_seconds(point["algorithm"], GRADIENT_BYTES, k, c)
    if series == "act":
        return c["act_fixed"] + point["states"] * c["act_per_state"]
    if series == "env step":
        return c["env_step"]
    if series == "rpc round trip":
        return c["rpc_round_trip"]
    if series == "rpc queued":
        return c["rpc_per_observer"]
    return agent_step_seconds(point["observers"], point["envs"], c)


def fit(columns, measured, known=0.0):
    """The non-negative coefficients x of the model known + sum(x[j] * columns[j]) with the least squared relative
    error over the points, so that 4 bytes and 64 MB weigh alike. A coefficient that comes out negative is 0 and the
    others are fitted again."""
    measured = np.array(measured, float)
    design = np.array(columns, float).T / measured[:, None]
    target = (measured - known) / measured
    coefficients, free = np.zeros(len(columns)), list(range(len(columns)))
    while free:
        solution = np.linalg.lstsq(design[:, free], target, rcond=None)[0]
        if (solution >= 0).all():
            coefficients[free] = solution
            break
        free.pop(int(np.argmin(solution)))
    return coefficients.tolist()


def fit_model(points):
    """Every constant of the model, in seconds and seconds per byte, image or state. Each is fitted on its own
    series: alpha, beta on the round trips (two messages each); the exchange's; delta, gamma on the sums; the
    builtin's cost per step on the builtin's times, with the rest of its model known; compute on the shards; act on
    its times; the env step and the RPC's costs as measured. The tutorial's and the ring's times, the whole training
    step and the agent's whole step are not fitted on: the check shows how well the model predicts them."""
    def series(name):
        return [point for point in points if point["series"] == name]

    def line(name, x):  # intercept and slope of a straight line through a series
        chosen = series(name)
        return fit([[1] * len(chosen), [point[x] for point in chosen]], [point["seconds"] for point in chosen])

    def latency_and_rate(name, messages=1):
        """The line through the time of the smallest size (whose few bytes cost next to nothing) that fits the other
        sizes best. Not the best line through all: on loopback a byte costs more once the buffers leave the caches,
        and that line can pass below zero at the smallest size. Where no positive rate fits, larger sizes were
        measured so much faster than the smallest that its time was disturbed (other work took its cores in every
        round): the line then passes through the fastest time of the series."""
        smallest, *others = sorted(series(name), key=lambda point: point["bytes"])

        def rate_through(fixed):
            return fit([[point["bytes"] - smallest["bytes"] for point in others]],
                       [point["seconds"] / messages for point in others], fixed)[0]
        fixed = smallest["seconds"] / messages
        rate = rate_through(fixed)
        if rate == 0:
            fixed = min(point["seconds"] for point in [smallest, *others]) / messages
            rate = rate_through(fixed)
        return fixed - smallest["bytes"] * rate, rate

    c = {}
    c["alpha"], c["beta"] = latency_and_rate("round trip", messages=2)
    c["alpha_exchange"], c["beta_exchange"] = latency_and_rate("exchange")
    c["delta"], c["gamma"] = latency_and_rate("sum")
    c["compute_fixed"], c["compute_per_image"] = line("compute", "images")
    c["act_fixed"], c["act_per_state"] = line("act", "states")
    c["env_step"] = statistics.median(point["seconds"] for point in series("env step"))
    c["rpc_round_trip"] = statistics.median(point["seconds"] for point in series("rpc round trip"))
    builtin = series("builtin")
    c["alpha_builtin"] = fit([[2 * (point["k"] - 1) for point in builtin]], [point["seconds"] for point in builtin],
                             [allreduce_seconds("builtin", point["bytes"], point["k"], {**c, "alpha_builtin": 0})
                              for point in builtin])[0]
    c["rpc_per_observer"] = statistics.median(point["seconds"] for point in series("rpc queued"))
    return c


FITTED_ON = {"round trip", "exchange", "sum", "compute", "act", "env step", "rpc round trip", "rpc queued", "builtin"}


def describe(point):
    """The series and where it was measured: "ring, bytes 516272, k 3"."""
    where = [f"{key} {value}" for key, value in point.items() if key not in ("series", "seconds", "model", "error",
                                                                             "fitted")]
    return ", ".join([point["series"], *where])


def check_model(points, c):
    """Each measured point with the model's value, the relative error (model - measured) / measured, and whether the
    point was fitted on; and the summary: median error, worst ratio, points off by more than 2x, over all points and
    over those not fitted on."""
    rows = []
    for point in points:
        model = model_seconds(point, c)
        rows.append({**point, "model": model, "error": (model - point["seconds"]) / point["seconds"],
                     "fitted": point["series"] in FITTED_ON})

    def ratio(row):
        return max(row["model"], row["seconds"]) / max(min(row["model"], row["seconds"]), 1e-12)

    worst = max(rows, key=ratio)
    predicted = [row for row in rows if not row["fitted"]]
    summary = {"points": len(rows), "median_error": statistics.median(abs(row["error"]) for row in rows),
               "worst_ratio": ratio(worst), "worst": describe(worst),
               "off_by_2x": sum(ratio(row) > 2 for row in rows), "predicted_points": len(predicted),
               "predicted_median_error": statistics.median(abs(row["error"]) for row in predicted)}
    return rows, summary


# ---------------------------------------------------------------------------------------------------------
# Predictions: k = 1..64 devices on each interconnect, N = 1..64 observers
# ---------------------------------------------------------------------------------------------------------

def link_constants(bandwidth, latency):
    """The model's communication constants for devices joined by a link: `latency` per message whatever sends it
    (NCCL's builtin modelled as the ring), the link's bandwidth each way whether or not the other way is busy, and the
    sums at the speed of an H100's memory."""
    return {"alpha": latency, "beta": 1 / bandwidth, "alpha_exchange": latency, "beta_exchange": 1 / bandwidth,
            "alpha_builtin": latency, "delta": 0.0, "gamma": 3 / GPU_MEMORY_BANDWIDTH}


def predict(c, gpu_step_ms):
    """Per link and algorithm, for k = 1..64: the allreduce of LeNet's gradient, the epoch (235 steps of the global
    batch of 256, each device computing its shard), the epoch with 256 images per device (the batch grows with k, the
    steps shrink), and the smallest k at which the allreduce takes longer than a device's step (None: not up to 64).
    A GPU's step (--gpu-step-ms) is taken to cost the same whatever its shard: a LeNet step of 256 images or fewer
    is kernel launches, not arithmetic. Then rpc_rl's steps/s for N = 1..64 observers with K = 1 and 16, the ceiling
    that N approaches, and the N that reaches 90 % of it."""
    def device_step(k):
        return gpu_step_ms / 1000 if gpu_step_ms else compute_seconds(math.ceil(BATCH / k), c)

    ks = list(PREDICTED_DEVICES)
    result = {"k": ks, "compute": "--gpu-step-ms" if gpu_step_ms else "measured here, one core",
              "device_step": [device_step(k) for k in ks], "allreduce": {}, "epoch": {}, "epoch_per_device_batch": {},
              "communication_exceeds_compute_at": {}}
    for link, (bandwidth, latency) in LINKS.items():
        net = link_constants(bandwidth, latency)
        times = {name: [allreduce_seconds(name, GRADIENT_BYTES, k, net) for k in ks] for name in ALGORITHMS}
        result["allreduce"][link] = times
        result["epoch"][link] = {name: [STEPS_PER_EPOCH * (device_step(k) + seconds) for k, seconds in zip(ks, t)]
                                 for name, t in times.items()}
        result["epoch_per_device_batch"][link] = {
            name: [math.ceil(common.FASHION_MNIST_TRAIN / (BATCH * k)) * (device_step(1) + seconds)
                   for k, seconds in zip(ks, t)] for name, t in times.items()}
        result["communication_exceeds_compute_at"][link] = {
            name: next((k for k, seconds in zip(ks, t) if k > 1 and seconds > device_step(k)), None)
            for name, t in times.items()}
    ns = list(PREDICTED_OBSERVERS)
    result["rpc"] = {"observers": ns}
    for envs in PREDICTED_ENVS:
        per_observer = c["rpc_per_observer"] + envs * c["act_per_state"]  # what each observer adds to a step
        fixed = agent_step_seconds(1, envs, c) - per_observer  # the rest of a step, whatever N
        result["rpc"][str(envs)] = {"steps_per_s": [n * envs / agent_step_seconds(n, envs, c) for n in ns],
                                    "ceiling": envs / per_observer,
                                    "observers_at_90_percent": max(1, math.ceil(9 * fixed / per_observer))}
    return result


# ---------------------------------------------------------------------------------------------------------
# Rendering: the figures and the tables of docs/scaling.md, from a measuring run's JSON line
# ---------------------------------------------------------------------------------------------------------

def duration(seconds):
    for unit, scale in (("s", 1), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale or unit == "µs":
            return f"{seconds / scale:.3g} {unit}"


def rate(seconds_per_byte):
    return f"{1 / seconds_per_byte / 1e9:.3g} GB/s" if seconds_per_byte else "∞"


def size(nbytes):
    for unit, scale in (("MB", 1e6), ("kB", 1e3), ("B", 1)):
        if nbytes >= scale or unit == "B":
            return f"{nbytes / scale:.4g} {unit}"


def markdown(header, rows):
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" if i == 0 else "---:" for i in
                                                                   range(len(header))) + " |"]
    return "\n".join(lines + ["| " + " | ".join(map(str, row)) + " |" for row in rows])


def cell(row):
    """measured / model (error), a star where the point was fitted on."""
    star = "*" if row["fitted"] else ""
    return f"{duration(row['seconds'])} / {duration(row['model'])} ({row['error']:+.0%}){star}"


def run_block(result):
    m = result["machine"]
    return (f"Measured with `{result['command']}` on {m['date']}: {m['cpu']}, {m['cpus']} CPUs, torch {m['torch']}, "
            f"Python {m['python']}; the measurement took {result['wall_time_s'] / 60:.1f} min.")


def constants_block(c):
    rows = [
        ("per message, send or receive", "α", duration(c["alpha"]), "round trips"),
        ("bandwidth, one way at a time", "1/β", rate(c["beta"]), "round trips"),
        ("per exchange (both ways at once)", "α_x", duration(c["alpha_exchange"]), "exchanges"),
        ("bandwidth each way, both ways at once", "1/β_x", rate(c["beta_exchange"]), "exchanges"),
        ("a sum, fixed", "δ", duration(c["delta"]), "sums"),
        ("a sum, rate", "1/γ", rate(c["gamma"]), "sums"),
        ("builtin, per step", "α_b", duration(c["alpha_builtin"]), "builtin's times"),
        ("LeNet step, fixed", "c₀", duration(c["compute_fixed"]), "compute"),
        ("LeNet step, per image", "c₁", duration(c["compute_per_image"]), "compute"),
        ("act, fixed", "f₀", duration(c["act_fixed"]), "act"),
        ("act, per state", "f₁", duration(c["act_per_state"]), "act"),
        ("CartPole step", "e", duration(c["env_step"]), "measured"),
        ("RPC round trip", "t_rpc", duration(c["rpc_round_trip"]), "RPCs one after the other"),
        ("an RPC queued behind others", "r", duration(c["rpc_per_observer"]), f"{PINGS} RPCs sent at once"),
    ]
    return markdown(["constant", "symbol", "value", "fitted on"], rows)


def check_block(rows, summary):
    """Four tables, each cell "measured / model (error)": point to point and sums by size; the allreduces by size and
    process count; the LeNet step; the agent's step, split into act, the CartPole steps (K times the one measured)
    and the rest, the RPCs."""
    def find(**match):
        return next((row for row in rows if all(row.get(key) == value for key, value in match.items())), None)

    blocks = []
    sizes = sorted({row["bytes"] for row in rows if "bytes" in row})
    blocks.append(markdown(["size", "round trip", "exchange", "sum"], [
        [size(n)] + [cell(find(series=name, bytes=n)) for name in ("round trip", "exchange", "sum")] for n in sizes]))
    procs = sorted({row["k"] for row in rows if row["series"] in ALGORITHMS})
    blocks.append(markdown(["size", *(f"{name}, k = {k}" for k in procs for name in ALGORITHMS)], [
        [size(n)] + [cell(find(series=name, bytes=n, k=k)) for k in procs for name in ALGORITHMS] for n in sizes]))
    compute = [[f"compute, {row['images']} images", cell(row)] for row in rows if row["series"] == "compute"]
    steps = [[f"whole step, {row['algorithm']}, k = {row['k']} ({math.ceil(BATCH / row['k'])} images)", cell(row)]
             for row in rows if row["series"] == "step"]
    blocks.append(markdown(["LeNet step", "measured / model (error)"], compute + steps))
    agent = []
    for row in rows:
        if row["series"] == "agent step":
            act = find(series="act", observers=row["observers"], envs=row["envs"])
            envs = row["envs"] * find(series="env step")["seconds"]
            agent.append([row["observers"], row["envs"], f"{row['observers'] * row['envs'] / row['seconds']:,.0f}",
                          cell(act), duration(envs), duration(row["seconds"] - act["seconds"] - envs), cell(row)])
    blocks.append(markdown(["N", "K", "env steps/s", "act for N·K states", "K CartPole steps", "the rest: RPCs",
                            "whole step"], agent))
    blocks.append(f"{summary['points']} points; median error {summary['median_error']:.0%} "
                  f"({summary['predicted_median_error']:.0%} over the {summary['predicted_points']} points no constant "
                  f"was fitted on); worst {summary['worst_ratio']:.2f}x ({summary['worst']}); "
                  f"{summary['off_by_2x']} off by more than 2x. * marks a point a constant was fitted on.")
    return "\n\n".join(blocks)


TABLE_COUNTS = (1, 2, 4, 8, 16, 32, 64)


def multi_gpu_block(p, gpu_step_ms):
    index = {k: i for i, k in enumerate(p["k"])}
    compute = (f"{gpu_step_ms} ms (--gpu-step-ms), whatever the shard" if gpu_step_ms else
               f"as one core here computes its shard: {duration(p['device_step'][0])} for 256 images, "
               f"{duration(p['device_step'][-1])} for 4")
    allreduce = [[link, name] + [duration(p["allreduce"][link][name][index[k]]) for k in TABLE_COUNTS[1:]]
                 + [p["communication_exceeds_compute_at"][link][name] or "> 64"]
                 for link in LINKS for name in ALGORITHMS]
    blocks = [f"A device's step: {compute}.",
              markdown(["link", "allreduce", *(f"k = {k}" for k in TABLE_COUNTS[1:]), "allreduce > step from k"],
                       allreduce)]
    for key, what in (("epoch", "Epoch, global batch 256 (the tutorial's)"),
                      ("epoch_per_device_batch", "Epoch, 256 images per device (`--batch-per-device 256`)")):
        rows = [[link, name] + [f"{p[key][link][name][index[k]]:.3g} s" for k in TABLE_COUNTS]
                for link in LINKS for name in ALGORITHMS]
        blocks.append(f"{what}:\n\n" + markdown(["link", "allreduce", *(f"k = {k}" for k in TABLE_COUNTS)], rows))
    return "\n\n".join(blocks)


def rpc_block(p):
    rpc_p = p["rpc"]
    rows = [[n] + [f"{rpc_p[str(envs)]['steps_per_s'][n - 1]:,.0f}" for envs in PREDICTED_ENVS]
            for n in TABLE_COUNTS]
    rows.append(["ceiling (N → ∞)"] + [f"{rpc_p[str(envs)]['ceiling']:,.0f}" for envs in PREDICTED_ENVS])
    rows.append(["90 % of it from N ="] + [rpc_p[str(envs)]["observers_at_90_percent"] for envs in PREDICTED_ENVS])
    return markdown(["observers N", *(f"K = {envs}: env steps/s" for envs in PREDICTED_ENVS)], rows)


def multi_gpu_figure(p):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 7))
    axes = figure.subplots(2, len(FIGURE_LINKS), sharex=True)
    ks = p["k"]
    for column, link in enumerate(FIGURE_LINKS):
        top, bottom = axes[0, column], axes[1, column]
        for name, style in zip(ALGORITHMS, ("-", "--", ":")):
            top.plot(ks[1:], [t * 1e3 for t in p["allreduce"][link][name][1:]], style, label=name)
            line, = bottom.plot(ks, p["epoch"][link][name], style, label=f"{name}, global batch 256")
            bottom.plot(ks, p["epoch_per_device_batch"][link][name], style, color=line.get_color(), alpha=0.45,
                        label=f"{name}, 256 per device")
        top.plot(ks[1:], [t * 1e3 for t in p["device_step"][1:]], color="gray", label="a device's step")
        top.set(title=f"{link}: allreduce of LeNet's gradient", ylabel="ms", xscale="log", yscale="log")
        bottom.set(title=f"{link}: epoch (60,000 images)", xlabel="devices k", ylabel="s", xscale="log",
                   yscale="log")
        top.legend(fontsize=8)
        bottom.legend(fontsize=7)
    return figure


def rpc_figure(p, rows):
    from matplotlib.figure import Figure

    axis = Figure(figsize=(6, 4)).subplots()
    for envs in PREDICTED_ENVS:
        predicted = p["rpc"][str(envs)]
        line, = axis.plot(p["rpc"]["observers"], predicted["steps_per_s"], label=f"K = {envs}, model")
        axis.axhline(predicted["ceiling"], color=line.get_color(), linestyle=":", linewidth=1)
        measured = [row for row in rows if row["series"] == "agent step" and row["envs"] == envs]
        axis.plot([row["observers"] for row in measured],
                  [row["observers"] * envs / row["seconds"] for row in measured], "o", color=line.get_color(),
                  label=f"K = {envs}, measured")
    axis.set(xscale="log", yscale="log", xlabel="observers N", ylabel="environment steps/s",
             title="rpc_rl: one agent, N observers of K environments")
    axis.legend(fontsize=8)
    return axis.figure


def render(args):
    """The figures into --figures, and each table of docs/scaling.md under the marker it replaces there."""
    lines = [line for line in Path(args.render).read_text().splitlines() if line.startswith("{")]
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        result = {}
    check(result.get("script") == "bench_scaling", f"--render {args.render}: no result line of bench_scaling.py in "
                                                   f"it; pass the output of a measuring run")
    p, rows = result["predictions"], result["check"]
    common.save_figure(multi_gpu_figure(p), Path(args.figures, "scaling_multi_gpu.png"), "--figures")
    common.save_figure(rpc_figure(p, rows), Path(args.figures, "scaling_rpc.png"), "--figures")
    blocks = {"run": run_block(result), "constants": constants_block(result["constants"]),
              "check": check_block(rows, result["summary"]),
              "predictions-multi-gpu": multi_gpu_block(p, result["settings"]["gpu_step_ms"]),
              "predictions-rpc": rpc_block(p)}
    for name, text in blocks.items():
        print(f"<!-- paste: {name} -->\n{text}\n", flush=True)


def main(argv=None):
    args = common.parse_args(Args, argv)
    validate(args)
    if args.render:
        return render(args)
    started = time.perf_counter()
    points = measure(args)
    constants = fit_model(points)
    rows, summary = check_model(points, constants)
    print(f"check: {summary['points']} points, median error {summary['median_error']:.0%} "
          f"({summary['predicted_median_error']:.0%} over the {summary['predicted_points']} not fitted), worst "
          f"{summary['worst_ratio']:.2f}x ({summary['worst']}), {summary['off_by_2x']} off by more than 2x", flush=True)
    settings = {name: getattr(args, name) for name in MEASURING}
    common.emit_result("bench_scaling", machine=machine(), command=shlex.join(["python", "benchmarks/bench_scaling.py",
                                                                               *(argv or sys.argv[1:])]),
                       wall_time_s=time.perf_counter() - started, settings=settings, measured=points,
                       constants=constants, check=rows, summary=summary,
                       predictions=predict(constants, args.gpu_step_ms))


if __name__ == "__main__":
    common.run_main(main)
