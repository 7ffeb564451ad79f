"""Allreduce on CPU (gloo): the tutorial's gather-to-rank-0, the hand-written ring, and torch's builtin.

    python benchmarks/bench_allreduce.py                 # 2 processes, 1e4 ... 1e7 floats
    python benchmarks/bench_allreduce.py --procs 4 --repeats 20

Each size is timed in interleaved rounds (tutorial, ring, builtin, tutorial, ...), so that a change in the
machine's load hits all three alike; a round times enough back-to-back calls (3e6 floats' worth) that the
processes' skew when leaving the barrier does not count; the figure is the median of the rounds. Prints one table row
per size with milliseconds per call and the ratio to builtin, then one JSON line.
"""

import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import emit_result, init_process_group, join, parse_args, rendezvous, run_main, worker  # noqa: E402
from multi_gpu import ALLREDUCES  # noqa: E402


@dataclasses.dataclass
class Args:
    procs: int = 2
    """number of processes"""
    sizes: str = "1e4,1e5,1e6,1e7"
    """comma-separated buffer sizes, in floats"""
    repeats: int = 20
    """timed rounds per size (after one warm-up round)"""


@worker
def run_worker(rank, world_size, store, args):
    init_process_group(store, rank, world_size, "gloo", 120)
    rows = []
    for size in [int(float(s)) for s in args.sizes.split(",")]:
        buffer = torch.randn(size)
        times = {name: [] for name in ALLREDUCES}
        calls = max(1, int(3e6 // size))  # back-to-back calls per timing: the barrier's skew is amortised
        for round_ in range(args.repeats + 1):
            for name, allreduce in ALLREDUCES.items():
                dist.barrier()
                started = time.perf_counter()
                for _ in range(calls):
                    allreduce(buffer, rank, world_size)
                    buffer.div_(world_size)  # keep the values bounded
                elapsed = torch.tensor((time.perf_counter() - started) / calls)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a call ends when its slowest rank is done
                if round_:
                    times[name].append(elapsed.item())
        medians = {name: statistics.median(t) * 1000 for name, t in times.items()}
        rows.append({"floats": size, **{f"{name}_ms": ms for name, ms in medians.items()},
                     **{f"{name}_vs_builtin": ms / medians["builtin"] for name, ms in medians.items()}})
        if rank == 0:
            row = rows[-1]
            print(f"{size:>10,} floats | tutorial {medians['tutorial']:8.2f} ms ({row['tutorial_vs_builtin']:.2f}x)"
                  f" | ring {medians['ring']:8.2f} ms ({row['ring_vs_builtin']:.2f}x)"
                  f" | builtin {medians['builtin']:8.2f} ms", flush=True)
    if rank == 0:
        emit_result("bench_allreduce", procs=world_size, rows=rows)
    dist.destroy_process_group()


def main():
    args = parse_args(Args)
    with rendezvous(args.procs) as store:
        join(mp.spawn(run_worker, args=(args.procs, store, args), nprocs=args.procs, join=False))


if __name__ == "__main__":
    run_main(main)
