"""Benchmark rpc_rl.py --envs-per-observer K (one observer): env steps/s and wall time to solve CartPole.

Every run trains from scratch until solved (running reward > 475, counted over episodes per observer whatever
K: see rpc_rl.Agent.finish_episode) or until --max-episodes; wall times are the training loop's (process start
excluded), and runs are interleaved (each seed runs every variant in turn), so drift on the machine hits every
variant alike.

1. K = 1, 2, 4, 8, 16 (--envs) on each of --throughput-seeds; medians over the seeds:
   - steps/s over the first --early-episodes episodes (short episodes: an environment whose episode ended
     waits for the others of its update, so an RPC carries fewer than K states) and over the whole run;
   - envs per RPC over the whole run (1 / rpcs_per_step: K when the episodes of an update last as long);
   - episodes and wall time to solve: which K is best. These seeds are for choosing K; part 2 uses others.
2. Wall time to solve for each K of --solve-envs (the first is the reference) on every seed of --seeds, and,
   on the same seeds in the same run, the tutorial's protocol (pytorch/examples distributed/rpc/rl as
   implemented in bench_rpc_rl.py: two RPCs per step, a torch forward per request, the tutorial's running
   reward). Median and range, ratio of medians to the first K, and the greedy evaluation of every rpc_rl
   policy once solved (--eval-episodes, not timed), to show that the policies solved with each K are as good.
Ends with one JSON line holding every figure and the machine it ran on.

    python benchmarks/bench_rpc_rl_envs.py                    # both parts
    python benchmarks/bench_rpc_rl_envs.py --no-solve         # part 1 only
    python benchmarks/bench_rpc_rl_envs.py --no-throughput --seeds 1,2 --no-tutorial
"""

import json
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

from bench_rpc_rl import machine, run_tutorial  # noqa: E402

from common import check, parse_args, run_main  # noqa: E402


@dataclass
class Args:
    envs: str = "1,2,4,8,16"
    """comma-separated --envs-per-observer values for part 1 (1 must be there: the reference)"""
    throughput_seeds: str = "11,12,13"
    """seeds of part 1 (each K runs once per seed)"""
    early_episodes: int = 200
    """part 1 also reports steps/s over the first this many episodes (per observer) of each run"""
    solve_envs: str = "1,16"
    """comma-separated --envs-per-observer values timed to solve in part 2; ratios are to the first"""
    seeds: str = "1,2,3,4,5"
    """seeds of part 2, the same for every K and for the tutorial"""
    max_episodes: int = 2000
    """episode cap (per observer) of every run, the tutorial's included"""
    eval_episodes: int = 16
    """greedy episodes (per observer) played by each policy of part 2 once solved (not timed)"""
    throughput: bool = True
    """run part 1"""
    solve: bool = True
    """run part 2"""
    tutorial: bool = True
    """time the tutorial's protocol to solve too, in part 2 (the longest runs of the benchmark)"""


def integers(text):
    return [int(item) for item in text.split(",")]


def run_to_solve(envs, seed, args, log_interval, eval_episodes=0):
    """rpc_rl.py at world size 2 until solved; its JSON result plus early_steps_per_s, the steps/s its first log
    line reports (over the first log_interval episodes)."""
    command = [sys.executable, str(REPO / "rpc_rl.py"), "--envs-per-observer", str(envs), "--seed", str(seed),
               "--max-episodes", str(args.max_episodes), "--log-interval", str(log_interval),
               "--eval-episodes", str(eval_episodes)]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command[1:])} failed:\n{proc.stderr[-2000:]}")
    lines = proc.stdout.splitlines()
    result = json.loads(next(line for line in reversed(lines) if line.startswith("{")))
    early = next((re.search(r"\| (\d+) steps/s", line) for line in lines if line.startswith("episode ")), None)
    return {"seed": seed, **result, "early_steps_per_s": float(early.group(1)) if early else None}


def median(runs, key):
    values = [run[key] for run in runs if run[key] is not None]
    return statistics.median(values) if values else None


def with_ratio(row, reference, key, unit=""):
    if row[key] is None or not reference[key]:
        return "-"
    return f"{row[key]:.1f}{unit} ({row[key] / reference[key]:.2f}x K=1)"


def choose_k(args):
    envs, seeds = integers(args.envs), integers(args.throughput_seeds)
    print(f"part 1: 1 observer, K environments, until solved, seeds {seeds} (medians)", flush=True)
    runs = {k: [] for k in envs}
    for seed in seeds:
        for k in envs:
            run = run_to_solve(k, seed, args, log_interval=args.early_episodes)
            run["envs_per_rpc"] = 1 / run["rpcs_per_step"]
            runs[k].append(run)
            print(f"  seed {seed} K {k}: {'solved' if run['solved'] else 'NOT solved'} after {run['episodes']} "
                  f"episodes, {run['env_steps']} env steps, {run['wall_time_s']:.1f} s, {run['steps_per_s']:.0f} "
                  f"steps/s ({run['early_steps_per_s'] or '-'} over the first {args.early_episodes} episodes), "
                  f"{run['envs_per_rpc']:.2f} envs per RPC", flush=True)
    reference = {key: median(runs[1], key) for key in ("early_steps_per_s", "steps_per_s", "wall_time_s")}
    print(f"{'K':>3} | steps/s, first {args.early_episodes} episodes | steps/s, whole run | envs per RPC | "
          f"episodes to solve | time to solve", flush=True)
    table = {}
    for k in envs:
        row = {key: median(runs[k], key) for key in ("early_steps_per_s", "steps_per_s", "envs_per_rpc",
                                                     "episodes", "wall_time_s")}
        row["solved"] = sum(run["solved"] for run in runs[k])
        row["runs"] = [{key: run[key] for key in ("seed", "solved", "episodes", "env_steps", "wall_time_s",
                                                   "steps_per_s", "early_steps_per_s", "envs_per_rpc")}
                       for run in runs[k]]
        table[k] = row
        print(f"{k:>3} | {with_ratio(row, reference, 'early_steps_per_s')} | "
              f"{with_ratio(row, reference, 'steps_per_s')} | {row['envs_per_rpc']:.2f} | {row['episodes']:g} "
              f"({row['solved']}/{len(seeds)} solved) | {with_ratio(row, reference, 'wall_time_s', ' s')}",
              flush=True)
    return table


def summary(label, runs, reference=None):
    times = [run["wall_time_s"] for run in runs]
    episodes = [run["episodes"] for run in runs]
    middle = statistics.median(times)
    ratio = f" | {middle / reference:.2f}x the first K's" if reference else ""
    print(f"{label}: solved {sum(run['solved'] for run in runs)}/{len(runs)} | episodes median "
          f"{statistics.median(episodes):g} (range {min(episodes)}-{max(episodes)}) | wall time median "
          f"{middle:.1f} s (range {min(times):.1f}-{max(times):.1f} s){ratio}", flush=True)
    return {"solved": sum(run["solved"] for run in runs), "wall_time_median_s": middle,
            "wall_time_range_s": [min(times), max(times)], "episodes_median": statistics.median(episodes),
            "ratio_to_first": middle / reference if reference else None,
            "runs": [{key: run[key] for key in ("seed", "solved", "episodes", "env_steps", "wall_time_s",
                                                  "steps_per_s")} for run in runs]}


def time_to_solve(args):
    envs, seeds = integers(args.solve_envs), integers(args.seeds)
    print(f"part 2: time to solve, 1 observer, seeds {seeds}, cap {args.max_episodes} episodes", flush=True)
    runs = {k: [] for k in envs}
    tutorial = []
    for seed in seeds:
        for k in envs:
            run = run_to_solve(k, seed, args, log_interval=args.max_episodes, eval_episodes=args.eval_episodes)
            runs[k].append(run)
            print(f"  seed {seed} K {k}: {'solved' if run['solved'] else 'NOT solved'} after {run['episodes']} "
                  f"episodes ({run['updates']} updates), {run['env_steps']} env steps, {run['wall_time_s']:.1f} s, "
                  f"{run['steps_per_s']:.0f} steps/s, greedy evaluation {run['eval_mean_reward']:.1f}", flush=True)
        if args.tutorial:
            run = {"seed": seed, **run_tutorial(1, args.max_episodes, seed, until_solved=True)}
            tutorial.append(run)
            print(f"  seed {seed} tutorial: {'solved' if run['solved'] else 'NOT solved'} after {run['episodes']} "
                  f"episodes, {run['env_steps']} env steps, {run['wall_time_s']:.1f} s, {run['steps_per_s']:.0f} "
                  f"steps/s", flush=True)
    reference = statistics.median(run["wall_time_s"] for run in runs[envs[0]])
    results = {}
    for k in envs:
        results[k] = summary(f"K {k}", runs[k], reference if k != envs[0] else None)
        results[k]["eval_mean_reward"] = statistics.mean(run["eval_mean_reward"] for run in runs[k])
        print(f"  K {k}: greedy evaluation of the final policies, mean reward {results[k]['eval_mean_reward']:.1f}",
              flush=True)
    if tutorial:
        results["tutorial"] = summary("tutorial", tutorial, reference)
    return results


def main():
    args = parse_args(Args)
    try:
        envs, solve_envs = integers(args.envs), integers(args.solve_envs)
        integers(args.seeds), integers(args.throughput_seeds)
    except ValueError:
        check(False, "--envs, --solve-envs, --seeds and --throughput-seeds take comma-separated integers")
    check(1 in envs and min(envs + solve_envs) >= 1, "--envs must include 1, and every K must be >= 1")
    check(args.early_episodes >= 1 and args.max_episodes >= 1, "--early-episodes and --max-episodes must be >= 1")
    check(args.eval_episodes >= 1, "--eval-episodes must be >= 1")
    figures = {"bench": "rpc_rl_envs", "machine": machine()}
    if args.throughput:
        figures["choose_k"] = choose_k(args)
    if args.solve:
        figures["time_to_solve"] = time_to_solve(args)
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    run_main(main)
