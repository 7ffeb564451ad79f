"""Benchmark rpc_rl.py: environment steps/s against the tutorial's code, and time to solve CartPole.

1. Steps/s with 1, 2 and 4 observers, side by side in one run:
   - default:   rpc_rl.py as it is (one RPC per step, one forward per step for all observers, in numpy);
   - pinned:    rpc_rl.py --pin-cpus (the same, each process bound to a CPU of its own; pinning only happens when
                there is a CPU for every process, so on 2 CPUs only with 1 observer);
   - tutorial:  rpc_rl.py --tutorial, the tutorial's code: two RPCs per step (select_action, then report_reward),
                one torch forward with autograd per request, placed like the default's, so the ratio measures the
                code, not the placement.
   Every mode trains for the same number of episodes with the same seed; steps/s is measured over the training
   loop only (process start and RPC setup excluded) and all processes use one intra-op thread. With --busy N, N
   processes that loop in pure Python run beside every measurement, as other work sharing the CPUs would.
2. Episodes and wall time to solve (running reward > 475) at world size 2, for several seeds: median and range,
   with the returns of time-limited episodes bootstrapped (rpc_rl.py's default) and ended there (the tutorial).

    python benchmarks/bench_rpc_rl.py                         # both parts
    python benchmarks/bench_rpc_rl.py --no-solve              # steps/s only
    python benchmarks/bench_rpc_rl.py --no-solve --busy 1     # steps/s beside one busy process
    python benchmarks/bench_rpc_rl.py --no-throughput --seeds 1,2
Ends with one JSON line holding every figure and the machine it ran on.
"""

import contextlib
import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common import NonNegative, Positive, parse_args, run_main, usable_cpus  # noqa: E402


@dataclass
class Args:
    # What to measure
    observers: str = "1,2,4"
    """comma-separated observer counts for the steps/s comparison"""
    episodes: Positive = 40
    """training episodes per steps/s measurement"""
    seeds: str = "1,2,3,4,5"
    """comma-separated seeds for the time-to-solve runs (world size 2)"""
    max_episodes: Positive = 2000
    """episode cap of each time-to-solve run"""
    truncation: str = "bootstrap,terminal"
    """comma-separated --truncation modes of rpc_rl.py to time to solve"""
    busy: NonNegative = 0
    """processes looping in pure Python beside every steps/s measurement (other work sharing the CPUs)"""
    # Parts
    throughput: bool = True
    """run part 1 (steps/s)"""
    solve: bool = True
    """run part 2 (time to solve)"""


def run_rpc_rl(*args, script=REPO / "rpc_rl.py", timeout=3600):
    """`python SCRIPT ARGS` from the script's folder; its JSON result, and its stdout as "log"."""
    proc = subprocess.run([sys.executable, str(script), *map(str, args)], cwd=Path(script).parent,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} {' '.join(map(str, args))} failed:\n{proc.stderr[-2000:]}")
    lines = proc.stdout.splitlines()
    return {**json.loads(next(line for line in reversed(lines) if line.startswith("{"))), "log": lines}


def run_tutorial(observers, episodes, seed):
    """rpc_rl.py --tutorial, until solved or `episodes`: the tutorial's code (its protocol, its update, returns
    ended at the time limit)."""
    return run_rpc_rl("--tutorial", "--world-size", observers + 1, "--max-episodes", episodes, "--seed", seed,
                      "--log-interval", episodes)


@contextlib.contextmanager
def busy_processes(count):
    """`count` processes that loop in pure Python until the block ends."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def throughput(args):
    print(f"steps/s over {args.episodes} training episodes, seed 1, beside {args.busy} busy process(es) (higher is "
          f"better)", flush=True)
    print(f"{'observers':>9} | {'default':>8} | {'pinned':>8} | {'tutorial':>8} | default / tutorial", flush=True)
    rows = {}
    for observers in [int(n) for n in args.observers.split(",")]:
        flags = ("--world-size", observers + 1, "--max-episodes", args.episodes, "--seed", 1,
                 "--log-interval", args.episodes)
        with busy_processes(args.busy):
            default = run_rpc_rl(*flags)["steps_per_s"]
            pinned = run_rpc_rl(*flags, "--pin-cpus")["steps_per_s"]
            tutorial = run_tutorial(observers, args.episodes, 1)["steps_per_s"]
        print(f"{observers:>9} | {default:>8.0f} | {pinned:>8.0f} | {tutorial:>8.0f} | {default / tutorial:.2f}x",
              flush=True)
        rows[observers] = {"default": default, "pinned": pinned, "tutorial": tutorial,
                           "default_over_tutorial": default / tutorial}
    return {"busy_processes": args.busy, "rows": rows}


def time_to_solve(args):
    modes = {}
    for truncation in args.truncation.split(","):
        print(f"time to solve at world size 2, --truncation {truncation} (cap {args.max_episodes} episodes)",
              flush=True)
        episodes, times, solved = [], [], 0
        for seed in [int(s) for s in args.seeds.split(",")]:
            start = time.perf_counter()
            result = run_rpc_rl("--seed", seed, "--max-episodes", args.max_episodes, "--log-interval", 100,
                                "--truncation", truncation)
            total = time.perf_counter() - start
            solved += result["solved"]
            episodes.append(result["episodes"])
            times.append(result["wall_time_s"])
            print(f"seed {seed}: {'solved' if result['solved'] else 'NOT solved'} after {result['episodes']} "
                  f"episodes, {result['env_steps']} env steps, {result['wall_time_s']:.1f} s training "
                  f"({total:.1f} s with process start), {result['steps_per_s']:.0f} steps/s", flush=True)
        print(f"--truncation {truncation}: solved {solved}/{len(episodes)} | episodes median "
              f"{statistics.median(episodes):g} (range {min(episodes)}-{max(episodes)}) | wall time median "
              f"{statistics.median(times):.1f} s (range {min(times):.1f}-{max(times):.1f} s)", flush=True)
        modes[truncation] = {"solved": solved, "runs": len(episodes), "episodes": episodes, "wall_time_s": times,
                             "median_episodes": statistics.median(episodes),
                             "median_wall_time_s": statistics.median(times)}
    return modes


def machine():
    """Where the figures were measured, for the JSON line."""
    cpuinfo = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
              if line.startswith("model name")] if cpuinfo.exists() else []
    return {"date": time.strftime("%Y-%m-%d"), "cpus": usable_cpus(),
            "cpu": models[0] if models else platform.processor() or platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__}


def main():
    args = parse_args(Args)
    figures = {"bench": "rpc_rl", "machine": machine()}
    if args.throughput:
        figures["steps_per_s"] = throughput(args)
    if args.solve:
        figures["time_to_solve"] = time_to_solve(args)
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    run_main(main)
