"""How far each pattern scales: a cost model's inputs measured here, the model fitted, checked and extrapolated.

Measures, over gloo on loopback with one thread per process (a process stands for one device):
  - the round trip of a message between two processes, an exchange (both send at once, as a ring step does) and a
    sum, for sizes from 4 bytes to 64 MB;
  - each allreduce of multi_gpu.py (tutorial, ring, builtin) at 2 and 3 processes over the same sizes;
  - a LeNet training step without allreduce at the shard k devices get (256/k images), and the whole step
    (multi_gpu's train_batch with each allreduce) at 2 and 3 processes;
  - rpc_rl.py's BatchAgent with 1, 2 and 4 observers of K = 1, 4 and 16 environments: its answer to a step for N*K
    states (act: one forward and the sampling), a CartPole step, the round trip of an RPC and its cost when many
    arrive at once, and whole steps end to end.
Then fits the model of docs/scaling.md, puts its value beside every measured point, and predicts k = 1..64 devices
on four interconnects and N = 1..64 observers.

    python benchmarks/bench_scaling.py --gpu-step-ms 1.18    # a few minutes on a quiet machine
    python benchmarks/bench_scaling.py --tiny --out DIR      # seconds, a few points: what the tests run

Writes results/scaling.json (its tables: the constants, the check, the predictions) and the figures
docs/figures/scaling_multi_gpu.png and scaling_rpc.png (with --out, all three into DIR).
"""

import argparse
import functools
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import rpc

import harness

sys.path.insert(0, str(harness.REPO))
import common  # noqa: E402
import multi_gpu  # noqa: E402
import rpc_rl  # noqa: E402

ALGORITHMS = tuple(multi_gpu.ALLREDUCES)  # tutorial, ring, builtin
GRADIENT_BYTES = 4 * multi_gpu.init_params(0).numel()  # LeNet's 129,068 float32 gradients
BATCH = 256  # the tutorial's global batch
STEPS_PER_EPOCH = math.ceil(common.FASHION_MNIST_TRAIN / BATCH)
# Interconnects of the predictions: (bandwidth each way in bytes/s, as its maker publishes it; time per message in s,
# which no maker publishes for a message sent by NCCL: an assumption). docs/scaling.md cites each.
LINKS = {"NVLink 4": (450e9, 5e-6), "PCIe 5.0 x16": (64e9, 10e-6), "InfiniBand NDR": (50e9, 10e-6),
         "100 Gb Ethernet": (12.5e9, 30e-6)}
GPU_MEMORY_BANDWIDTH = 3.35e12  # H100 SXM's HBM3, bytes/s: a sum reads two bytes and writes one per byte summed
COUNTS = (1, 2, 4, 8, 16, 32, 64)  # the k and N of the tables and figures (the predictions cover 1..64)
PREDICTED_ENVS = (1, 16)
FULL = {"sizes": [1, 8, 64, 512, 4096, 32768, 129068, 262144, 2097152, 16777216], "procs": [2, 3],
        "devices": [1, 2, 3, 4, 8, 16, 32, 64], "observers": [1, 2, 4], "envs": [1, 4, 16], "rounds": 9,
        "round_seconds": 0.1}
TINY = {"sizes": [1, 129068, 4194304], "procs": [2], "devices": [1, 64], "observers": [1], "envs": [1, 64],
        "rounds": 15, "round_seconds": 0.005}

# ---------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------


class Rounds(list):
    """The seconds of each round of one measurement; divided by n, each round's per-item seconds."""

    def __truediv__(self, n):
        return Rounds(value / n for value in self)

    def point(self):
        return {"seconds": min(self), "slowest": max(self)}


def seconds_per_call(operations, settings, group=False):
    """{name: Rounds of seconds per call of operations[name]()}, each round timing back-to-back calls for about
    round_seconds (one at least), the operations interleaved round by round. The model takes the fastest, because
    other work on the machine can only slow a round down; the tables show the slowest beside it. In a process group
    every rank makes the same calls: a round starts together and lasts until the slowest rank is done, and all ranks
    use the slowest's count of calls."""
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
        calls[name] = max(1, min(100_000, int(settings["round_seconds"] / timed(operation, 1))))
    times = {name: [] for name in operations}
    for _ in range(settings["rounds"]):
        for name, operation in operations.items():
            times[name].append(timed(operation, calls[name]))
    return {name: Rounds(values) for name, values in times.items()}


def measure_here(settings):
    """In this process: multi_gpu's train_batch without allreduce on the shard of each device count (256/k images,
    rounded up as tensor_split gives rank 0), `total += part` for every size, and a CartPole step as an observer
    takes it."""
    model = multi_gpu.Replica(multi_gpu.init_params(0), torch.device("cpu"), 0, 1, sum_gradients=lambda *_: None)
    shards = {images: (torch.rand(images, 1, 28, 28), torch.randint(10, (images,)))
              for images in sorted({math.ceil(BATCH / k) for k in settings["devices"]})}
    compute = seconds_per_call({images: functools.partial(multi_gpu.train_batch, X, y, model, 0.0)
                                for images, (X, y) in shards.items()}, settings)
    sums = seconds_per_call({4 * floats: functools.partial(torch.zeros(floats).add_, torch.zeros(floats))
                             for floats in settings["sizes"]}, settings)
    env, chooser = gym.make(rpc_rl.ENV_ID), random.Random(0)
    env.reset(seed=0)

    def env_step():
        state, _, terminated, truncated, _ = env.step(chooser.randrange(2))
        if terminated or truncated:
            state, _ = env.reset()
        state.tolist()

    return ([{"series": "compute", "images": images, **s.point()} for images, s in compute.items()]
            + [{"series": "sum", "bytes": nbytes, **s.point()} for nbytes, s in sums.items()]
            + [{"series": "env step", **seconds_per_call({"step": env_step}, settings)["step"].point()}])


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
def group_worker(rank, world_size, store, settings, result_file):
    """One process of a group of k: every size's round trip and exchange (k = 2) and its three allreduces, then the
    whole training step with each allreduce; rank 0 writes the points to result_file."""
    torch.set_num_threads(1)  # a process stands for a device
    dist.init_process_group("gloo", init_method=common.init_method(store, "pg"), rank=rank, world_size=world_size)
    points = []
    for floats in settings["sizes"]:
        buffer, incoming = torch.zeros(floats), torch.zeros(floats)
        operations = {name: functools.partial(allreduce, buffer, rank, world_size)
                      for name, allreduce in multi_gpu.ALLREDUCES.items()}
        if world_size == 2:
            operations["round trip"] = functools.partial(round_trip, buffer, rank)
            operations["exchange"] = functools.partial(exchange, buffer, incoming, 1 - rank)
        for name, seconds in seconds_per_call(operations, settings, group=True).items():
            points.append({"series": name, "bytes": 4 * floats, **({"k": world_size} if name in ALGORITHMS else {}),
                           **seconds.point()})
    generator = torch.Generator().manual_seed(0)  # every rank draws the same global batch, and trains on its shard
    X, y = torch.rand(BATCH, 1, 28, 28, generator=generator), torch.randint(10, (BATCH,), generator=generator)
    steps = {name: functools.partial(multi_gpu.train_batch, X, y, multi_gpu.Replica(
        multi_gpu.init_params(0), torch.device("cpu"), rank, world_size, allreduce), 0.0)
        for name, allreduce in multi_gpu.ALLREDUCES.items()}
    for name, seconds in seconds_per_call(steps, settings, group=True).items():
        points.append({"series": "step", "algorithm": name, "k": world_size, **seconds.point()})
    if rank == 0:
        Path(result_file).write_text(json.dumps(points))
    dist.destroy_process_group()


STATE = [0.01, -0.02, 0.03, -0.04]  # a CartPole state: act's cost does not depend on the values
PINGS = 100  # RPCs per timed call of the round trip: the call that starts them counts for 1 %


def observe(observer_rref, agent_rref, envs, steps):
    """In an observer process: `steps` steps of the first `envs` environments of its rpc_rl.BatchObserver, one RPC
    per step as its run_episode sends, an episode that ends started again at once: every step asks for envs
    actions."""
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
    requests made up here, and an RPC that does nothing. The log-probabilities it keeps are dropped after each call,
    as the update after an episode drops them."""

    def ping(self):
        return None

    def answer(self, envs):
        """act as select_action calls it once every observer has asked: `envs` states from each."""
        self.saved_log_probs = {env: [] for env in self.rewards}
        self.act([(ob_id, (dict.fromkeys(range(envs), STATE), torch.futures.Future()))
                  for ob_id in sorted({ob_id for ob_id, _ in self.rewards})])

    def run_steps(self, envs, steps):
        """`steps` steps of `envs` environments on every observer, as run_episode starts an episode."""
        self.playing, self.saved_log_probs = {ob_id for ob_id, _ in self.rewards}, {env: [] for env in self.rewards}
        torch.futures.wait_all([rpc.rpc_async(ob_rref.owner(), observe, args=(ob_rref, self.agent_rref, envs, steps))
                                for ob_rref in self.ob_rrefs])


def measure_agent(observers, settings):
    """In the agent process: with one observer, the round trip of an RPC and what each RPC costs when many arrive
    together; for each K, act for N*K states, then whole steps, their number set so that a call lasts about a
    round."""
    agent = TimedAgent(observers + 1, rpc_rl.Args(world_size=observers + 1, envs_per_observer=max(settings["envs"]),
                                                  truncation="bootstrap"))
    points = []
    if observers == 1:
        pings = {series: functools.partial(rpc.rpc_sync, agent.ob_rrefs[0].owner(), ping_agent,
                                           args=(agent.agent_rref, PINGS, series == "rpc queued"))
                 for series in ("rpc round trip", "rpc queued")}
        points += [{"series": series, **(seconds / PINGS).point()}
                   for series, seconds in seconds_per_call(pings, settings).items()]
    acts = seconds_per_call({envs: functools.partial(agent.answer, envs) for envs in settings["envs"]}, settings)
    points += [{"series": "act", "states": observers * envs, "observers": observers, "envs": envs, **seconds.point()}
               for envs, seconds in acts.items()]
    steps = {}
    for envs in settings["envs"]:
        agent.run_steps(envs, 20)
        started = time.perf_counter()
        agent.run_steps(envs, 20)
        steps[envs] = max(20, int(settings["round_seconds"] * 20 / (time.perf_counter() - started)))
    runs = seconds_per_call({envs: functools.partial(agent.run_steps, envs, steps[envs]) for envs in settings["envs"]},
                            settings)
    return points + [{"series": "agent step", "observers": observers, "envs": envs,
                      **(seconds / steps[envs]).point()} for envs, seconds in runs.items()]


@common.worker
def agent_worker(rank, world_size, store, settings, result_file):
    """One process of an rpc_rl run: rank 0 is the agent, which measures and writes the points to result_file; the
    others are its observers. One thread each, as rpc_rl.py runs them."""
    torch.set_num_threads(1)
    options = rpc.TensorPipeRpcBackendOptions(init_method=common.init_method(store, "rpc"), rpc_timeout=600)
    rpc.init_rpc(rpc_rl.AGENT_NAME if rank == 0 else rpc_rl.OBSERVER_NAME.format(rank), rank=rank,
                 world_size=world_size, rpc_backend_options=options)
    if rank == 0:
        Path(result_file).write_text(json.dumps(measure_agent(world_size - 1, settings)))
    rpc.shutdown()


def in_processes(worker, world_size, settings):
    """The points that worker's rank 0 writes, started in world_size processes as the scripts start theirs."""
    with tempfile.TemporaryDirectory() as folder, common.rendezvous() as store:
        result_file = Path(folder, "points.json")
        common.join(mp.spawn(worker, args=(world_size, store, settings, result_file), nprocs=world_size, join=False))
        return json.loads(result_file.read_text())


def measure(settings):
    torch.set_num_threads(1)
    points = measure_here(settings)
    for k in settings["procs"]:
        points += in_processes(group_worker, k, settings)
        print(f"{k} processes measured", flush=True)
    for observers in settings["observers"]:
        points += in_processes(agent_worker, observers + 1, settings)
        print(f"the agent with {observers} observer(s) measured", flush=True)
    return points


# ---------------------------------------------------------------------------------------------------------
# The model (docs/scaling.md writes it out), its fit and its check
# ---------------------------------------------------------------------------------------------------------

def allreduce_seconds(algorithm, nbytes, k, c):
    """One allreduce of nbytes over k processes: the tutorial's rank 0 takes in k-1 buffers, adds each, and sends k-1
    back, one message after another; the ring (and gloo's builtin, a ring too, with its own cost per step) makes
    2(k-1) exchanges of a chunk of n/k, adding what arrives in the first k-1."""
    if algorithm == "tutorial":
        return 2 * (k - 1) * (c["alpha"] + nbytes * c["beta"]) + (k - 1) * (c["delta"] + nbytes * c["gamma"])
    alpha = c["alpha_builtin"] if algorithm == "builtin" else c["alpha_exchange"]
    chunk = nbytes / k
    return 2 * (k - 1) * (alpha + chunk * c["beta_exchange"]) + (k - 1) * (c["delta"] + chunk * c["gamma"])


def compute_seconds(images, c):
    return c["compute_fixed"] + images * c["compute_per_image"]


def agent_step_seconds(observers, envs, c):
    """A step of N observers of K environments: the first observer's RPC costs its round trip, every other one what
    an RPC costs the agent when it queues behind others; one act for N*K states; each observer steps its K
    environments on a core of its own."""
    return (c["rpc_round_trip"] + (observers - 1) * c["rpc_per_observer"] + envs * c["env_step"]
            + c["act_fixed"] + observers * envs * c["act_per_state"])


def model_seconds(point, c):
    """The model's time for a measured point."""
    series = point["series"]
    simple = {"round trip": lambda: 2 * (c["alpha"] + point["bytes"] * c["beta"]),
              "exchange": lambda: c["alpha_exchange"] + point["bytes"] * c["beta_exchange"],
              "sum": lambda: c["delta"] + point["bytes"] * c["gamma"],
              "compute": lambda: compute_seconds(point["images"], c),
              "act": lambda: c["act_fixed"] + point["states"] * c["act_per_state"],
              "env step": lambda: c["env_step"], "rpc round trip": lambda: c["rpc_round_trip"],
              "rpc queued": lambda: c["rpc_per_observer"]}
    if series in simple:
        return simple[series]()
    if series in ALGORITHMS:
        return allreduce_seconds(series, point["bytes"], point["k"], c)
    if series == "step":
        k = point["k"]
        return compute_seconds(math.ceil(BATCH / k), c) + allreduce_seconds(point["algorithm"], GRADIENT_BYTES, k, c)
    return agent_step_seconds(point["observers"], point["envs"], c)


def fit(columns, measured, known=0.0):
    """The non-negative coefficients x of known + sum(x[j] * columns[j]) with the least squared relative error over
    the points, so that 4 bytes and 64 MB weigh alike; a coefficient that comes out negative is 0, the others are
    fitted again."""
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
    """Every constant, each fitted on its own series: alpha, beta on the round trips (two messages each); the
    exchange's; delta, gamma on the sums; the builtin's cost per step on its times, with the rest of its model known;
    compute on the shards; act on its times; the env step and the RPC's costs as measured. The tutorial's and the
    ring's times, the whole training step and the agent's whole step are not fitted on: the check shows how well the
    model predicts them."""
    def series(name):
        return [point for point in points if point["series"] == name]

    def latency_and_rate(name, messages=1):
        """The line through the time of the smallest size that fits the other sizes best (not the best line through
        all: on loopback a byte costs more once the buffers leave the caches, and that line can pass below zero).
        Where no positive rate fits, the smallest size's time was disturbed in every round: the line then passes
        through the fastest time of the series."""
        smallest, *others = sorted(series(name), key=lambda point: point["bytes"])

        def rate_through(fixed):
            return fit([[point["bytes"] - smallest["bytes"] for point in others]],
                       [point["seconds"] / messages for point in others], fixed)[0]
        fixed = smallest["seconds"] / messages
        if (rate := rate_through(fixed)) == 0:
            fixed = min(point["seconds"] for point in [smallest, *others]) / messages
            rate = rate_through(fixed)
        return fixed - smallest["bytes"] * rate, rate

    def line(name, x):
        chosen = series(name)
        return fit([[1] * len(chosen), [point[x] for point in chosen]], [point["seconds"] for point in chosen])

    c = dict(zip(("alpha", "beta"), latency_and_rate("round trip", messages=2)))
    c.update(zip(("alpha_exchange", "beta_exchange"), latency_and_rate("exchange")))
    c.update(zip(("delta", "gamma"), latency_and_rate("sum")))
    c.update(zip(("compute_fixed", "compute_per_image"), line("compute", "images")))
    c.update(zip(("act_fixed", "act_per_state"), line("act", "states")))
    for name, key in (("env step", "env_step"), ("rpc round trip", "rpc_round_trip"),
                      ("rpc queued", "rpc_per_observer")):
        c[key] = statistics.median(point["seconds"] for point in series(name))
    builtin = series("builtin")
    c["alpha_builtin"] = fit([[2 * (point["k"] - 1) for point in builtin]], [point["seconds"] for point in builtin],
                             [allreduce_seconds("builtin", point["bytes"], point["k"], {**c, "alpha_builtin": 0})
                              for point in builtin])[0]
    return c


FITTED_ON = {"round trip", "exchange", "sum", "compute", "act", "env step", "rpc round trip", "rpc queued", "builtin"}


def check_model(points, c):
    """Each measured point with the model's value, the relative error (model - measured) / measured and whether a
    constant was fitted on it; and the summary over all points and over those not fitted on."""
    rows = [{**point, "model": model_seconds(point, c), "fitted": point["series"] in FITTED_ON} for point in points]
    for row in rows:
        row["error"] = (row["model"] - row["seconds"]) / row["seconds"]
    ratio = [max(row["model"], row["seconds"]) / max(min(row["model"], row["seconds"]), 1e-12) for row in rows]
    predicted = [abs(row["error"]) for row in rows if not row["fitted"]]
    summary = {"points": len(rows), "median_error": statistics.median(abs(row["error"]) for row in rows),
               "worst_ratio": max(ratio), "off_by_2x": sum(r > 2 for r in ratio), "predicted_points": len(predicted),
               "predicted_median_error": statistics.median(predicted)}
    return rows, summary


# ---------------------------------------------------------------------------------------------------------
# Predictions: k = 1..64 devices on each interconnect, N = 1..64 observers
# ---------------------------------------------------------------------------------------------------------

def predict(c, gpu_step_ms):
    """Per link and algorithm, for k = 1..64: the allreduce of LeNet's gradient (a link's constants: its latency
    per message whatever sends it, NCCL's builtin modelled as the ring, its bandwidth each way, sums at an H100's
    memory speed), the epoch with the tutorial's global batch (235 steps, each device computing its shard), the epoch
    with 256 images per device, and the smallest k at which the allreduce outlasts a device's step. A GPU's step
    (--gpu-step-ms) costs the same whatever its shard: a LeNet step of 256 images or fewer is kernel launches, not
    arithmetic. Then rpc_rl's steps/s for N = 1..64 observers with K = 1 and 16, and its ceiling."""
    def device_step(k):
        return gpu_step_ms / 1000 if gpu_step_ms else compute_seconds(math.ceil(BATCH / k), c)

    ks = range(1, 65)
    result = {"allreduce": {}, "epoch": {}, "epoch_per_device": {}, "exceeds_at": {},
              "device_step": [device_step(k) for k in ks]}
    for link, (bandwidth, latency) in LINKS.items():
        net = {"alpha": latency, "beta": 1 / bandwidth, "alpha_exchange": latency, "beta_exchange": 1 / bandwidth,
               "alpha_builtin": latency, "delta": 0.0, "gamma": 3 / GPU_MEMORY_BANDWIDTH}
        for name in ALGORITHMS:
            times = [allreduce_seconds(name, GRADIENT_BYTES, k, net) for k in ks]
            result["allreduce"][link, name] = times
            result["epoch"][link, name] = [STEPS_PER_EPOCH * (device_step(k) + t) for k, t in zip(ks, times)]
            result["epoch_per_device"][link, name] = [
                math.ceil(common.FASHION_MNIST_TRAIN / (BATCH * k)) * (device_step(1) + t) for k, t in zip(ks, times)]
            result["exceeds_at"][link, name] = next((k for k, t in zip(ks, times) if k > 1 and t > device_step(k)),
                                                    None)
    for envs in PREDICTED_ENVS:
        per_observer = c["rpc_per_observer"] + envs * c["act_per_state"]  # what each observer adds to a step
        result["rpc", envs] = [n * envs / agent_step_seconds(n, envs, c) for n in range(1, 65)]
        result["ceiling", envs] = envs / per_observer
    return result


# ---------------------------------------------------------------------------------------------------------
# The tables of results/scaling.json and the figures
# ---------------------------------------------------------------------------------------------------------

def duration(seconds):
    for unit, scale in (("s", 1), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale or unit == "µs":
            return f"{seconds / scale:.3g} {unit}"


def size(nbytes):
    for unit, scale in (("MB", 1e6), ("kB", 1e3), ("B", 1)):
        if nbytes >= scale or unit == "B":
            return f"{nbytes / scale:.4g} {unit}"


def tables(c, rows, summary, p, gpu_step_ms, settings):
    def cell(row):  # measured (slowest round) / model (error), a star where a constant was fitted on the point
        star = "*" if row["fitted"] else ""
        return (f"{duration(row['seconds'])} ({duration(row['slowest'])}) / {duration(row['model'])} "
                f"({row['error']:+.0%}){star}")

    def find(**match):
        return next(row for row in rows if all(row.get(key) == value for key, value in match.items()))

    rate = {"beta", "beta_exchange", "gamma"}
    constants = [[name, f"{1 / value / 1e9:.3g} GB/s" if name in rate and value else duration(value)]
                 for name, value in c.items()]
    sizes = sorted({row["bytes"] for row in rows if "bytes" in row})
    procs = sorted({row["k"] for row in rows if row["series"] in ALGORITHMS})
    messages = [[size(n), *(cell(find(series=name, bytes=n)) for name in ("round trip", "exchange", "sum")),
                 *(cell(find(series=name, bytes=n, k=k)) for k in procs for name in ALGORITHMS)] for n in sizes]
    steps = [[f"{row['images']} images, no allreduce", cell(row)] for row in rows if row["series"] == "compute"]
    steps += [[f"{row['algorithm']}, k = {row['k']}", cell(row)] for row in rows if row["series"] == "step"]
    agent = [[row["observers"], row["envs"], round(row["observers"] * row["envs"] / row["seconds"]),
              cell(find(series="act", observers=row["observers"], envs=row["envs"])), cell(row)]
             for row in rows if row["series"] == "agent step"]
    index = [k - 1 for k in COUNTS]
    predicted = {"tutorial": "tutorial", "ring": "ring = builtin"}  # one row: NCCL's builtin is modelled as the ring
    allreduce = [[link, label, *(duration(p["allreduce"][link, name][i]) for i in index[1:]),
                  p["exceeds_at"][link, name] or "> 64"] for link in LINKS for name, label in predicted.items()]
    epochs = [[link, label, *(f"{p['epoch'][link, name][i]:.3g}" for i in index)]
              for link in LINKS for name, label in predicted.items()]
    observers = [[n, *(round(p["rpc", envs][n - 1]) for envs in PREDICTED_ENVS)] for n in COUNTS]
    observers.append(["ceiling", *(round(p["ceiling", envs]) for envs in PREDICTED_ENVS)])
    step = f"{gpu_step_ms} ms (--gpu-step-ms)" if gpu_step_ms else "as one core here computes its shard"
    return {
        "The fitted constants": {"columns": ["constant", "value"], "rows": constants},
        "Check: messages, sums and allreduces (measured / model)": {
            "columns": ["size", "round trip", "exchange", "sum", *(f"{name}, k = {k}" for k in procs
                                                                    for name in ALGORITHMS)], "rows": messages},
        "Check: LeNet's step (measured / model)": {"columns": ["step", "time"], "rows": steps},
        "Check: the agent's step (measured / model)": {
            "columns": ["N", "K", "env steps/s", "act for N·K states", "whole step"], "rows": agent},
        f"Predicted allreduce of LeNet's gradient; a device's step: {step}": {
            "columns": ["link", "allreduce", *(f"k = {k}" for k in COUNTS[1:]), "outlasts the step from k"],
            "rows": allreduce},
        "Predicted epoch, global batch 256, in seconds": {
            "columns": ["link", "allreduce", *(f"k = {k}" for k in COUNTS)], "rows": epochs},
        "Predicted env steps/s of rpc_rl, N observers": {
            "columns": ["N", *(f"K = {envs}" for envs in PREDICTED_ENVS)], "rows": observers},
    }, (f"Measured: the fastest of {settings['rounds']} interleaved rounds (the slowest in brackets). "
        f"{summary['points']} points checked: median error {summary['median_error']:.0%} "
        f"({summary['predicted_median_error']:.0%} over the {summary['predicted_points']} no constant was fitted on, "
        f"marked * otherwise), worst {summary['worst_ratio']:.2f}x, {summary['off_by_2x']} off by more than 2x.")


def figures(p, rows, folder):
    """The predictions for NVLink and Ethernet (ring and builtin are one line there: NCCL's builtin is modelled as the
    ring), and rpc_rl's steps/s, model and measured; every axis ticked at the counts of the tables; the epochs' times
    (a narrow range) on a linear axis from 0, the others on log axes."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    def ticked(axes, ylabel, yscale="log"):
        axes.set(xscale="log", yscale=yscale, ylabel=ylabel)
        axes.set_xticks(COUNTS, [str(k) for k in COUNTS])
        axes.xaxis.set_minor_locator(NullLocator())
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)

    figure = Figure(figsize=(11, 8))
    ks = list(range(1, 65))
    for column, link in enumerate(("NVLink 4", "100 Gb Ethernet")):
        top, bottom = figure.add_subplot(2, 2, 1 + column), figure.add_subplot(2, 2, 3 + column)
        for name, label in (("tutorial", "tutorial"), ("ring", "ring = builtin")):
            top.plot(ks[1:], [t * 1e3 for t in p["allreduce"][link, name][1:]], label=label)
            bottom.plot(ks, p["epoch"][link, name], label=label)
        top.plot(ks[1:], [t * 1e3 for t in p["device_step"][1:]], color="gray", label="a device's step")
        top.set(title=f"{link}: allreduce of LeNet's gradient", xlabel="devices k")
        bottom.set(title=f"{link}: epoch, global batch 256", xlabel="devices k")
        ticked(top, "time (ms)")
        ticked(bottom, "time per epoch (s)", "linear")
        bottom.set_ylim(bottom=0)
    figure.tight_layout()
    common.save_figure(figure, Path(folder, "scaling_multi_gpu.png"))
    figure = Figure(figsize=(6.5, 4.5))
    axes = figure.subplots()
    for envs in PREDICTED_ENVS:
        line, = axes.plot(range(1, 65), p["rpc", envs], label=f"K = {envs}, model")
        axes.axhline(p["ceiling", envs], color=line.get_color(), linestyle=":", linewidth=1,
                     label=f"K = {envs}, the model's ceiling")
        measured = [row for row in rows if row["series"] == "agent step" and row["envs"] == envs]
        axes.plot([row["observers"] for row in measured], [row["observers"] * envs / row["seconds"] for row in
                                                            measured], "o", color=line.get_color(),
                  label=f"K = {envs}, measured")
    axes.set(xlabel="observers N", title="rpc_rl: one agent, N observers of K environments")
    ticked(axes, "environment steps/s")
    figure.tight_layout()
    common.save_figure(figure, Path(folder, "scaling_rpc.png"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu-step-ms", type=float, help="a LeNet step of 256 images on one GPU, in ms, for the "
                        "predictions; not given: a device computes as one core here does")
    parser.add_argument("--tiny", action="store_true", help="a few points and short rounds: seconds")
    parser.add_argument("--out", help="write the result file and the figures into this folder instead")
    args = parser.parse_args()
    if not args.out:
        harness.check_committed()
    settings = TINY if args.tiny else FULL
    points = measure(settings)
    constants = fit_model(points)
    rows, summary = check_model(points, constants)
    predictions = predict(constants, args.gpu_step_ms)
    results, notes = tables(constants, rows, summary, predictions, args.gpu_step_ms, settings)
    print(notes, flush=True)
    harness.write_result("scaling", results, notes, folder=args.out)
    figures(predictions, rows, args.out or harness.REPO / "docs" / "figures")


if __name__ == "__main__":
    main()
