"""Benchmark of async_hpo.py's search with its trials on Ray (--ray-address) against the local backend: trials
finished per minute and worker utilisation, same objective, same number of workers, one run of each.

The objective is bench_async_hpo.py's sleeping trial (10 "epochs" of 0.5 s x 128 / batch_size each, 2.5 to 20 s
per trial), so the figures measure how trials are started, watched and ended, not the CPU. The same search
(random, same seed: the same configurations in the same order) runs for --budget seconds with --n-workers
workers, first on the local backend (trials are child processes of the tuner), then on Ray (trials are Ray
tasks, their output streamed back to the tuner). Utilisation is busy trial time / (workers x wall time), as in
bench_async_hpo.py: a trial is busy from when the tuner started it to when it saw it end, so what Ray adds
(placing each task, starting a Ray worker for it, streaming its lines) counts as busy, and shows in the trials
completed per minute.

Without --ray-address the benchmark starts its own one-node cluster, `ray start --head --num-cpus N_WORKERS`,
and runs both searches in a network namespace of its own that has only a loopback interface (Ray listens on
every interface there is), as the tests do: it needs `unshare` and user namespaces.

    python benchmarks/bench_async_hpo_ray.py                                  # 2 workers, 2 x 120 s
    python benchmarks/bench_async_hpo_ray.py --budget 30                      # a quick look
    python benchmarks/bench_async_hpo_ray.py --ray-address auto --n-workers 8 # on a cluster started with ray start

It ends with a line comparing the two and one JSON line.
"""

import argparse
import contextlib
import fcntl
import functools
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
SLEEPING_TRIAL = BENCHMARKS / "bench_async_hpo.py"  # the objective, and the entry point of every trial
IN_NAMESPACE = "BENCH_ASYNC_HPO_RAY_IN_NAMESPACE"  # set when this process runs in its own network namespace


def bring_loopback_up():
    """A new network namespace has a loopback interface, down; `ip link set lo up` without needing iproute2."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        flags = struct.unpack("16sH14s", fcntl.ioctl(sock, siocgifflags, struct.pack("16sH14s", b"lo", 0, b"")))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sH14s", b"lo", flags | iff_up, b""))


def start_ray_head(cpus, folder):
    """`ray start --head` in the foreground (--block), so that this process owns it; returns once it runs."""
    os.environ.update({"RAY_TMPDIR": str(folder),  # its address file, found by `auto`, and its sessions
                       "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.urandom(16).hex(),
                       "RAY_USAGE_STATS_ENABLED": "0"})
    head = subprocess.Popen([str(Path(sys.executable).with_name("ray")), "start", "--head", "--num-cpus", str(cpus),
                             "--block", "--include-dashboard=false", "--disable-usage-stats"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(180, head.kill)  # a start that hangs ends the benchmark instead of blocking it
    timer.start()
    try:
        for line in head.stdout:
            if "Ray runtime started" in line:
                threading.Thread(target=head.stdout.read, daemon=True).start()
                return head
    finally:
        timer.cancel()
    raise SystemExit(f"ray start --head failed (exit status {head.wait()}); its logs are in {folder}")


def stop_ray_head(head):
    head.terminate()  # `ray start --block` stops its node on SIGTERM
    try:
        head.wait(60)
    except subprocess.TimeoutExpired:
        head.kill()
        head.wait()


def run_variant(async_hpo, args, backend, config_space, quiet):
    search = async_hpo.run_search(args, config_space, backend, entry_point=SLEEPING_TRIAL, out=quiet)
    summary = async_hpo.summarize(search, args.n_workers)
    return {"trials_completed": summary["trials_completed"], "wall_time_s": summary["wall_time_s"],
            "trials_per_min": round(summary["trials_completed"] / (summary["wall_time_s"] / 60), 2),
            "utilisation": summary["utilisation"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=120.0, help="seconds per search (default: %(default)s)")
    parser.add_argument("--n-workers", type=int, default=2, help="trials at once, in both (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the configuration sampling")
    parser.add_argument("--ray-address", help="a running cluster (HOST:PORT or auto); default: start a one-node "
                                              "cluster with --n-workers CPUs in a loopback-only namespace")
    options = parser.parse_args()
    if options.budget <= 0 or options.n_workers < 1:
        parser.error("--budget must be positive and --n-workers at least 1")
    if options.ray_address is None and not os.environ.get(IN_NAMESPACE):
        if not shutil.which("unshare"):
            parser.error("starting a loopback-only cluster needs unshare (util-linux); or pass --ray-address")
        os.execvpe("unshare", ["unshare", "--user", "--map-root-user", "--net", sys.executable, __file__,
                               *sys.argv[1:]], {**os.environ, IN_NAMESPACE: "1"})

    sys.path.insert(0, str(BENCHMARKS.parent))
    sys.path.insert(0, str(BENCHMARKS))
    from bench_async_hpo import EPOCHS
    from syne_tune.config_space import loguniform, randint

    import async_hpo

    config_space = {"learning_rate": loguniform(1e-2, 1), "batch_size": randint(32, 256),
                    "max_epochs": EPOCHS, "parent_pid": os.getpid()}
    folder = Path(tempfile.mkdtemp(prefix="ray-"))  # short: Ray's socket paths live under it
    head = None
    try:
        if options.ray_address is None:
            bring_loopback_up()
            head = start_ray_head(options.n_workers, folder)
        address = options.ray_address or "auto"
        figures = {}
        with open(os.devnull, "w") as quiet:
            for name, ray_address in (("local", None), ("ray", address)):
                args = async_hpo.Args(scheduler="random", n_workers=options.n_workers, max_epochs=EPOCHS,
                                      max_wallclock_time=options.budget, seed=options.seed, max_failures=0,
                                      results_dir=str(folder / "results"), ray_address=ray_address)
                if ray_address:
                    import ray
                    cpus = async_hpo.cpus_per_trial(async_hpo.connect_to_ray(ray_address, SLEEPING_TRIAL),
                                                    options.n_workers, 0)
                    if cpus < 1:
                        parser.error(f"the cluster at {ray_address} cannot run {options.n_workers} trials at once")
                    ray.cloudpickle.register_pickle_by_value(async_hpo)  # the task's code: the nodes lack the module
                    backend = functools.partial(async_hpo.RayTrials, cpus, 0)
                else:
                    backend = functools.partial(async_hpo.WatchedTrials, args.trial_timeout)
                figures[name] = run_variant(async_hpo, args, backend, config_space, quiet)
                print(f"{name:5s} | {figures[name]['trials_completed']:3d} trials completed in "
                      f"{figures[name]['wall_time_s']:.0f} s | {figures[name]['trials_per_min']:5.1f} trials/min | "
                      f"utilisation {figures[name]['utilisation']:.1%}", flush=True)
    except async_hpo.common.UsageError as error:
        parser.error(str(error))
    finally:
        if head is not None:
            with contextlib.suppress(Exception):
                import ray
                ray.shutdown()
            stop_ray_head(head)
        shutil.rmtree(folder, ignore_errors=True)
    on_ray, local = figures["ray"], figures["local"]
    ratio = round(on_ray["trials_per_min"] / local["trials_per_min"], 2) if local["trials_per_min"] else None
    print(f"{options.n_workers} workers, {options.budget:.0f} s each: trials/min on Ray {on_ray['trials_per_min']:.1f} "
          f"vs local {local['trials_per_min']:.1f} = {ratio}x | utilisation Ray {on_ray['utilisation']:.1%} vs "
          f"local {local['utilisation']:.1%}")
    print(json.dumps({"benchmark": "async_hpo_ray", "budget_s": options.budget, "n_workers": options.n_workers,
                      "ray_address": options.ray_address, "ray_vs_local_trials_per_min": ratio, **figures}))


if __name__ == "__main__":
    main()
