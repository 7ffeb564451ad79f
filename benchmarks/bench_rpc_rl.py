"""Benchmark rpc_rl.py: wall time to solve CartPole-v1 (running reward > 475) over several seeds, for the default run
and --envs-per-observer 16 against the tutorial's code (--tutorial), all with one agent and one observer.

Time to solve is a distribution, not a number: the same code solves in 100 episodes on one seed and 800 on another,
so every variant runs on every seed, and the table gives the median, the fastest and the slowest. Each seed runs every
variant in turn, so that drift on the machine hits them alike. Times are the training loop's (rpc_rl's wall_time_s:
process start and RPC set-up excluded).

    python benchmarks/bench_rpc_rl.py                          # 5 seeds, about 40 minutes on 2 cores
    python benchmarks/bench_rpc_rl.py --seeds 1,2 --max-episodes 50   # a quick look

Writes results/rpc_rl.json.
"""

import argparse
import statistics

from harness import REPO, check_committed, run_script, write_result

VARIANTS = {"default": [], "K=16": ["--envs-per-observer", "16"], "tutorial": ["--tutorial"]}


def summary(runs):
    """solved, runs, the median, fastest and slowest wall time to solve (an unsolved run counts as its whole time),
    the median episodes and steps/s."""
    times = [run["wall_time_s"] for run in runs]
    return [sum(run["solved"] for run in runs), len(runs), round(statistics.median(times), 1), round(min(times), 1),
            round(max(times), 1), statistics.median(run["episodes"] for run in runs),
            round(statistics.median(run["steps_per_s"] for run in runs))]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="1,2,3,4,5", help="comma-separated seeds")
    parser.add_argument("--max-episodes", type=int, default=2000, help="rpc_rl's bound on a run that does not solve")
    args = parser.parse_args()
    check_committed()
    runs = {}
    for seed in [int(seed) for seed in args.seeds.split(",")]:
        for variant, flags in VARIANTS.items():
            result, _ = run_script([REPO / "rpc_rl.py", "--seed", seed, "--max-episodes", args.max_episodes,
                                    "--log-interval", 10**6, *flags], timeout=3600)
            runs.setdefault(variant, []).append(result)
            print(f"seed {seed} {variant}: solved {result['solved']} after {result['episodes']} episodes in "
                  f"{result['wall_time_s']:.1f} s, {result['steps_per_s']:.0f} steps/s", flush=True)
    rows = [[name, *summary(results)] for name, results in runs.items()]
    write_result("rpc_rl", {"Time to solve CartPole-v1": {
        "columns": ["variant", "solved", "runs", "median s", "fastest s", "slowest s", "median episodes",
                    "median steps/s"], "rows": rows}},
        f"Seeds {args.seeds}; one agent and one observer; at most {args.max_episodes} episodes a run.")


if __name__ == "__main__":
    main()
