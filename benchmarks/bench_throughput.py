"""Training throughput of multi_gpu.py on this machine's CPU: 1 process against 2 (and more) processes.

    python benchmarks/bench_throughput.py --data-dir ../shared/data
    python benchmarks/bench_throughput.py --procs 1,2 --limit-train 30000 --epochs 3 --rounds 2

Runs multi_gpu.py as a subprocess for each process count, alternating over rounds so that a change in the
machine's load hits every count alike, and reads samples/s (median epoch) from its JSON line. The total
thread count is the same for every run (common.worker gives each process usable CPUs // processes threads).
"""

import dataclasses
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from common import emit_result, parse_args, run_main  # noqa: E402


@dataclasses.dataclass
class Args:
    procs: str = "1,2"
    """comma-separated process counts to compare"""
    allreduce: str = "ring"
    """--allreduce of multi_gpu.py"""
    limit_train: int = 20000
    """training images per epoch"""
    epochs: int = 3
    """epochs per run (the median epoch is reported)"""
    rounds: int = 2
    """runs per process count"""
    data_dir: Optional[str] = None
    """--data-dir of multi_gpu.py"""


def main():
    args = parse_args(Args)
    counts = [int(p) for p in args.procs.split(",")]
    samples_per_s = {count: [] for count in counts}
    for _ in range(args.rounds):
        for count in counts:
            command = [sys.executable, str(REPO / "multi_gpu.py"), "--gpus", "0", "--procs", str(count),
                       "--allreduce", args.allreduce, "--limit-train", str(args.limit_train),
                       "--epochs", str(args.epochs)] + (["--data-dir", args.data_dir] if args.data_dir else [])
            proc = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=True)
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            samples_per_s[count].append(result["samples_per_s"])
    base = statistics.median(samples_per_s[counts[0]])
    rows = []
    for count in counts:
        median = statistics.median(samples_per_s[count])
        rows.append({"procs": count, "samples_per_s": median, "vs_first": median / base})
        print(f"{count} process(es) | {median:8.0f} samples/s | {median / base:.2f}x", flush=True)
    emit_result("bench_throughput", allreduce=args.allreduce, rows=rows)


if __name__ == "__main__":
    run_main(main)
