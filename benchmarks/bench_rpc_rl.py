"""Benchmark rpc_rl.py: wall time to solve CartPole-v1 (running reward > 475) over several seeds, for the default run
and --envs-per-observer 16 against the tutorial's code (--tutorial), all with one agent and one observer.

Time to solve is a distribution, not a number: the same code solves in 100 episodes on one seed and 800 on another,
so every variant runs on every seed, and the table gives the median and the worst. Each seed runs every variant in
turn, so that drift on the machine hits them alike. Times are the training loop's (rpc_rl's wall_time_s: process
start and RPC set-up excluded). With --baseline COMMIT, the default and K=16 runs of that commit's rpc_rl.py (with its
common.py, from git) run in the same rounds, and the table ends with the ratio of the medians.

    python benchmarks/bench_rpc_rl.py                          # 8 seeds, about 40 minutes on 2 cores
    python benchmarks/bench_rpc_rl.py --baseline f0f4cc4       # and f0f4cc4's numpy agent, side by side
    python benchmarks/bench_rpc_rl.py --seeds 1,2 --max-episodes 50   # a quick look

Writes results/rpc_rl.json.
"""

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

from harness import REPO, run_script, write_result

VARIANTS = {"default": [], "K=16": ["--envs-per-observer", "16"], "tutorial": ["--tutorial"]}


def baseline_folder(commit, folder):
    """rpc_rl.py and common.py as they were at `commit`, in folder."""
    for name in ("rpc_rl.py", "common.py"):
        text = subprocess.run(["git", "show", f"{commit}:{name}"], cwd=REPO, capture_output=True, text=True, check=True)
        (Path(folder) / name).write_text(text.stdout)
    return Path(folder)


def summary(runs):
    """median and worst wall time to solve, median episodes and steps/s; an unsolved run counts as its whole time."""
    times = [run["wall_time_s"] for run in runs]
    return [sum(run["solved"] for run in runs), len(runs), round(statistics.median(times), 1), round(max(times), 1),
            statistics.median(run["episodes"] for run in runs), round(statistics.median(run["steps_per_s"]
                                                                                        for run in runs))]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1,2,3,4,5,6,7,8", help="comma-separated seeds")
    parser.add_argument("--max-episodes", type=int, default=2000, help="rpc_rl's bound on a run that does not solve")
    parser.add_argument("--baseline", help="a commit whose rpc_rl.py runs beside this one's (default and K=16)")
    args = parser.parse_args()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        scripts = {"": REPO / "rpc_rl.py"}
        if args.baseline:
            scripts[f"{args.baseline} "] = baseline_folder(args.baseline, folder) / "rpc_rl.py"
        runs = {}
        for seed in seeds:
            for prefix, script in scripts.items():
                for variant, flags in VARIANTS.items():
                    if prefix and variant == "tutorial":  # the tutorial's code is the same in both
                        continue
                    result, _ = run_script([script, "--seed", seed, "--max-episodes", args.max_episodes,
                                            "--log-interval", 10**6, *flags], timeout=3600, cwd=script.parent)
                    runs.setdefault(prefix + variant, []).append(result)
                    print(f"seed {seed} {prefix + variant}: solved {result['solved']} after {result['episodes']} "
                          f"episodes in {result['wall_time_s']:.1f} s, {result['steps_per_s']:.0f} steps/s",
                          flush=True)
    rows = [[name, *summary(results)] for name, results in runs.items()]
    notes = f"Seeds {args.seeds}; one agent and one observer; at most {args.max_episodes} episodes a run."
    if args.baseline:
        for variant in ("default", "K=16"):
            ratio = summary(runs[f"{args.baseline} {variant}"])[2] / summary(runs[variant])[2]
            notes += f" Median time to solve, {args.baseline} / this code, {variant}: {ratio:.2f}."
    write_result("rpc_rl", {"Time to solve CartPole-v1": {
        "columns": ["variant", "solved", "runs", "median s", "worst s", "median episodes", "median steps/s"],
        "rows": rows}}, notes)


if __name__ == "__main__":
    main()
