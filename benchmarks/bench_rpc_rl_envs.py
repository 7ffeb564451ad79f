"""Benchmark rpc_rl.py --envs-per-observer K (one observer): env steps/s and wall time to solve CartPole, and, with
--baseline DIR, the same runs of DIR/rpc_rl.py (another version of the script) interleaved with them.

Every run trains from scratch until solved (running reward > 475, counted over the episodes of each environment
whatever K: see rpc_rl.BatchAgent.update_running_reward) or until --max-episodes episodes per environment; wall times
are the training loop's (process start excluded), and runs are interleaved (each seed runs every variant in turn),
so drift on the machine hits every variant alike. Episodes are counted per environment (an observer with K
environments plays K at once), whichever version of rpc_rl.py ran.

1. K = 1, 2, 4, 8, 16 (--envs) on each of --throughput-seeds; medians over the seeds:
   - steps/s over the first --early-episodes episodes (short episodes: an environment whose episode ended
     waits for the others of its update) and over the whole run;
   - episodes and wall time to solve: which K is best. These seeds are for choosing K; part 2 uses others.
2. Wall time to solve for each K of --solve-envs (the first is the reference) on every seed of --seeds, and,
   on the same seeds in the same run, the tutorial's code (rpc_rl.py --tutorial: two RPCs per step, a torch forward
   per request, the tutorial's returns). Median and range, ratio of medians to the first K, and the greedy
   evaluation of every rpc_rl policy once solved (--eval-episodes, not timed), to show that the policies solved
   with each K are as good.
With --baseline DIR, every rpc_rl.py run of both parts also runs with DIR/rpc_rl.py right after it (same flags,
same seed), and the parts end with the ratios this / baseline of the medians: steps/s (higher is faster) and time
to solve (lower is faster). Ends with one JSON line holding every figure and the machine it ran on.

    python benchmarks/bench_rpc_rl_envs.py                    # both parts
    python benchmarks/bench_rpc_rl_envs.py --no-solve         # part 1 only
    python benchmarks/bench_rpc_rl_envs.py --no-throughput --seeds 1,2 --no-tutorial
    python benchmarks/bench_rpc_rl_envs.py --baseline ../baseline --envs 1,16 --no-tutorial   # against another version
"""

import json
import math
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))

from bench_rpc_rl import machine, run_rpc_rl, run_tutorial  # noqa: E402

from common import Positive, check, input_file, parse_args, run_main  # noqa: E402


@dataclass
class Args:
    # What to measure
    envs: str = "1,2,4,8,16"
    """comma-separated --envs-per-observer values for part 1 (1 must be there: the reference)"""
    throughput_seeds: str = "11,12,13"
    """seeds of part 1 (each K runs once per seed)"""
    early_episodes: Positive = 200
    """part 1 also reports steps/s over the first this many episodes (per environment) of each run"""
    solve_envs: str = "1,16"
    """comma-separated --envs-per-observer values timed to solve in part 2; ratios are to the first"""
    seeds: str = "1,2,3,4,5"
    """seeds of part 2, the same for every K and for the tutorial"""
    max_episodes: Positive = 2000
    """episode cap (per environment) of every run, the tutorial's included"""
    eval_episodes: Positive = 16
    """greedy episodes played by each policy of part 2 once solved (not timed)"""
    # Parts
    throughput: bool = True
    """run part 1"""
    solve: bool = True
    """run part 2"""
    tutorial: bool = True
    """time the tutorial's code to solve too, in part 2 (the longest runs of the benchmark)"""
    baseline: Optional[str] = None
    """a folder holding another version of rpc_rl.py and its common.py (a checkout of an earlier commit): run it
    after each run of this one, and print the ratios; not given: this checkout only"""


def integers(text):
    return [int(item) for item in text.split(",")]


@dataclass
class Script:
    """A version of rpc_rl.py, and how it counts episodes: this one counts the agent's (every environment plays one),
    versions before --tutorial counted them per observer (K per update)."""
    path: Path
    per_agent_episode: bool

    @classmethod
    def at(cls, folder):
        path = Path(folder, "rpc_rl.py")
        usage = subprocess.run([sys.executable, str(path), "--help"], cwd=folder, capture_output=True, text=True,
                               timeout=120).stdout
        return cls(path, "--tutorial" in usage)

    def episodes(self, per_environment, envs):
        """The flag value for `per_environment` episodes of each environment."""
        return math.ceil(per_environment / envs) if self.per_agent_episode else per_environment


def run_to_solve(script, envs, seed, args, log_interval, eval_episodes=0):
    """rpc_rl.py at world size 2 until solved; its JSON result with episodes per environment, the mean greedy
    reward, and early_steps_per_s, the steps/s of its first log line (after log_interval episodes per environment)."""
    result = run_rpc_rl("--envs-per-observer", envs, "--seed", seed, "--eval-episodes", eval_episodes,
                        "--max-episodes", script.episodes(args.max_episodes, envs),
                        "--log-interval", script.episodes(log_interval, envs), script=script.path)
    early = next((re.search(r"\| (\d+) steps/s", line) for line in result.pop("log") if line.startswith("episode ")),
                 None)
    episodes = result["episodes"] * envs if script.per_agent_episode else result["episodes"]
    eval_rewards = result.get("eval_rewards") or []
    return {**result, "seed": seed, "episodes": episodes, "early_steps_per_s": float(early.group(1)) if early else None,
            "eval_mean_reward": statistics.mean(eval_rewards) if eval_rewards else None}


def median(runs, key):
    values = [run[key] for run in runs if run[key] is not None]
    return statistics.median(values) if values else None


def with_ratio(row, reference, key, unit=""):
    if row[key] is None or not reference[key]:
        return "-"
    return f"{row[key]:.1f}{unit} ({row[key] / reference[key]:.2f}x K=1)"


def describe(run):
    return (f"{'solved' if run['solved'] else 'NOT solved'} after {run['episodes']} episodes, {run['env_steps']} env "
            f"steps, {run['wall_time_s']:.1f} s, {run['steps_per_s']:.0f} steps/s")


def compare(label, runs, baseline_runs, keys=("early_steps_per_s", "steps_per_s", "wall_time_s")):
    """Ratios this / baseline of the medians over the seeds, printed and returned."""
    ratios = {}
    for key in keys:
        this, other = median(runs, key), median(baseline_runs, key)
        ratios[key] = this / other if this is not None and other else None
    print(f"  {label}, this / baseline: " + ", ".join(f"{key} {ratio:.2f}x" for key, ratio in ratios.items()
                                                      if ratio is not None), flush=True)
    return ratios


def choose_k(args, scripts):
    envs, seeds = integers(args.envs), integers(args.throughput_seeds)
    print(f"part 1: 1 observer, K environments, until solved, seeds {seeds} (medians)", flush=True)
    runs = {(name, k): [] for name in scripts for k in envs}
    for seed in seeds:
        for k in envs:
            for name, script in scripts.items():
                run = run_to_solve(script, k, seed, args, log_interval=args.early_episodes)
                runs[name, k].append(run)
                print(f"  seed {seed} K {k} {name}: {describe(run)} ({run['early_steps_per_s'] or '-'} over the "
                      f"first {args.early_episodes} episodes)", flush=True)
    table = {}
    for name in scripts:
        reference = {key: median(runs[name, 1], key) for key in ("early_steps_per_s", "steps_per_s", "wall_time_s")}
        print(f"{name}:\n{'K':>3} | steps/s, first {args.early_episodes} episodes | steps/s, whole run | "
              f"episodes to solve | time to solve", flush=True)
        for k in envs:
            row = {key: median(runs[name, k], key) for key in ("early_steps_per_s", "steps_per_s", "episodes",
                                                                "wall_time_s")}
            row["solved"] = sum(run["solved"] for run in runs[name, k])
            row["runs"] = [{key: run[key] for key in ("seed", "solved", "episodes", "env_steps", "wall_time_s",
                                                       "steps_per_s", "early_steps_per_s")} for run in runs[name, k]]
            table.setdefault(name, {})[k] = row
            print(f"{k:>3} | {with_ratio(row, reference, 'early_steps_per_s')} | "
                  f"{with_ratio(row, reference, 'steps_per_s')} | {row['episodes']:g} "
                  f"({row['solved']}/{len(seeds)} solved) | {with_ratio(row, reference, 'wall_time_s', ' s')}",
                  flush=True)
            if name == "baseline":
                row["this_over_baseline"] = compare(f"K {k}", runs["this", k], runs["baseline", k])
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


def time_to_solve(args, scripts):
    envs, seeds = integers(args.solve_envs), integers(args.seeds)
    print(f"part 2: time to solve, 1 observer, seeds {seeds}, cap {args.max_episodes} episodes", flush=True)
    runs = {(name, k): [] for name in scripts for k in envs}
    tutorial = []
    for seed in seeds:
        for k in envs:
            for name, script in scripts.items():
                run = run_to_solve(script, k, seed, args, log_interval=args.max_episodes,
                                   eval_episodes=args.eval_episodes)
                runs[name, k].append(run)
                print(f"  seed {seed} K {k} {name}: {describe(run)}, greedy evaluation {run['eval_mean_reward']:.1f}",
                      flush=True)
        if args.tutorial:
            run = {"seed": seed, **run_tutorial(1, args.max_episodes, seed)}
            tutorial.append(run)
            print(f"  seed {seed} tutorial: {describe(run)}", flush=True)
    results = {}
    for name in scripts:
        reference = statistics.median(run["wall_time_s"] for run in runs[name, envs[0]])
        for k in envs:
            row = results.setdefault(name, {})[k] = summary(f"K {k} {name}", runs[name, k],
                                                            reference if k != envs[0] else None)
            row["eval_mean_reward"] = statistics.mean(run["eval_mean_reward"] for run in runs[name, k])
            print(f"  K {k} {name}: greedy evaluation of the final policies, mean reward {row['eval_mean_reward']:.1f}",
                  flush=True)
            if name == "baseline":
                row["this_over_baseline"] = compare(f"K {k}", runs["this", k], runs["baseline", k],
                                                    keys=("steps_per_s", "wall_time_s", "episodes"))
    if tutorial:
        results["tutorial"] = summary("tutorial", tutorial,
                                      statistics.median(run["wall_time_s"] for run in runs["this", envs[0]]))
    return results


def main():
    args = parse_args(Args)
    try:
        envs, solve_envs = integers(args.envs), integers(args.solve_envs)
        integers(args.seeds), integers(args.throughput_seeds)
    except ValueError:
        check(False, "--envs, --solve-envs, --seeds and --throughput-seeds take comma-separated integers")
    check(1 in envs and min(envs + solve_envs) >= 1, "--envs must include 1, and every K must be >= 1")
    scripts = {"this": Script.at(REPO)}
    if args.baseline:
        scripts["baseline"] = Script.at(Path(input_file("--baseline", str(Path(args.baseline, "rpc_rl.py")))).parent)
    figures = {"bench": "rpc_rl_envs", "machine": machine(), "baseline": args.baseline}
    if args.throughput:
        figures["choose_k"] = choose_k(args, scripts)
    if args.solve:
        figures["time_to_solve"] = time_to_solve(args, scripts)
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    run_main(main)
