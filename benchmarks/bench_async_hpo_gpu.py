"""Many trials on one GPU: async_hpo.py's random search over the tutorial's LeNet with W workers sharing one GPU
(--cuda --trials-per-gpu W), for W = 2, 4, 8 and 16, each for the same wall-clock budget.

Each search is `async_hpo.py --cuda --n-workers W --trials-per-gpu W --max-wallclock-time SECONDS --seed 0` (random
search, the tutorial's LeNet with sigmoid, 10 epochs, the whole training set) on the first GPU this process sees,
one after the other. While each runs, this process reads the GPU's utilisation every half second (NVML, through
torch.cuda.utilization). A row per W: trials completed, the best validation error, the workers' utilisation (busy trial
time / (W x wall time), from async_hpo's JSON line) and the GPU's mean utilisation; then one JSON line, and with
--figure a PNG of trials completed and GPU utilisation against W.

    python benchmarks/bench_async_hpo_gpu.py --data-dir ../shared/data                  # 4 searches x 360 s
    python benchmarks/bench_async_hpo_gpu.py --data-dir DATA --workers 2,4 --seconds 60  # a quick look
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def search(workers, seconds, data_dir, results_dir):
    """One search of `workers` trials at once on GPU 0; returns (async_hpo's JSON result, GPU utilisation samples)."""
    samples, done = [], threading.Event()

    def sample():
        while not done.wait(0.5):
            samples.append(torch.cuda.utilization(0))

    command = [sys.executable, str(REPO / "async_hpo.py"), "--cuda", "--n-workers", str(workers), "--trials-per-gpu",
               str(workers), "--max-wallclock-time", str(seconds), "--seed", "0", "--results-dir", str(results_dir),
               "--oversubscribe", *(["--data-dir", data_dir] if data_dir else [])]
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 300)
    finally:
        done.set()
    if proc.returncode != 0:
        raise SystemExit(f"the search with {workers} workers failed:\n{proc.stderr[-3000:]}")
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    return result, samples


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="2,4,8,16", help="worker counts, comma-separated (default: 2,4,8,16)")
    parser.add_argument("--seconds", type=float, default=360.0, help="budget of each search (default: 360)")
    parser.add_argument("--data-dir", help="folder with Fashion-MNIST (default: the download cache)")
    parser.add_argument("--figure", help="write trials completed and GPU utilisation against workers to this PNG")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_async_hpo_gpu.py: needs a CUDA GPU")
    os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]  # one GPU
    rows = []
    with tempfile.TemporaryDirectory() as results:
        for workers in [int(w) for w in args.workers.split(",")]:
            result, samples = search(workers, args.seconds, args.data_dir, Path(results, str(workers)))
            rows.append({"workers": workers, "trials_completed": result["trials_completed"],
                         "trials_started": result["trials_started"],
                         "best_validation_error": result["best_validation_error"],
                         "worker_utilisation": result["utilisation"],
                         "gpu_utilisation": statistics.mean(samples) / 100 if samples else None,
                         "gpus": sorted({trial["device"] for trial in result["trials"] if trial.get("device")})})
            row = rows[-1]
            print(f"{workers:>3} workers | {row['trials_completed']} completed of {row['trials_started']} started | "
                  f"best val err {row['best_validation_error']:.4f} | workers {row['worker_utilisation']:.0%} busy | "
                  f"GPU {row['gpu_utilisation']:.0%} busy", flush=True)
    print(json.dumps({"script": "bench_async_hpo_gpu", "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                      "seconds": args.seconds, "rows": rows}), flush=True)
    if args.figure:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        figure, left = plt.subplots(figsize=(6, 3.5))
        workers = [row["workers"] for row in rows]
        left.plot(workers, [row["trials_completed"] for row in rows], "o-", label="trials completed")
        left.set(xlabel="workers sharing one GPU", ylabel="trials completed", xscale="log", xticks=workers)
        left.set_xticklabels([str(w) for w in workers])
        right = left.twinx()
        right.plot(workers, [100 * (row["gpu_utilisation"] or 0) for row in rows], "s--", color="tab:orange",
                   label="GPU utilisation")
        right.set(ylabel="GPU utilisation (%)", ylim=(0, 100))
        figure.legend(loc="lower right")
        figure.tight_layout()
        figure.savefig(args.figure, dpi=100)


if __name__ == "__main__":
    main()
