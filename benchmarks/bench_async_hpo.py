"""Benchmark of async_hpo.py's tuner with a cheap objective: throughput with 1 and 2 workers, and worker
utilisation of asynchronous vs synchronous scheduling when trial lengths vary.

The objective is a trial that sleeps instead of training (so the figures measure the scheduling, not the
CPU): 10 "epochs" of 0.5 s x 128 / batch_size each, i.e. 2.5 s (batch 256) to 20 s (batch 32) per trial,
reporting a made-up validation error after each. The same search (random, same seed, same configurations
in the same order) runs for --budget seconds as async with 1 worker, async with 2 workers and sync with 2
workers, the three interleaved, --repeats times; the figures are means over the repeats. Trials finished
per minute give the 2-worker speedup; busy trial time / (workers x wall time) gives the utilisation (a trial is
busy from when the tuner started it to when the tuner saw it end, as async_hpo.py's summary counts it).

    python benchmarks/bench_async_hpo.py                           # 2 repeats x 3 variants x 60 s
    python benchmarks/bench_async_hpo.py --budget 30 --repeats 1   # a quick look

It ends with a line of this shape, then one JSON line (the figures measured are in docs/async_hpo.md):

    mean of 2: trials/min A (1 worker) vs B (2 workers) = B/Ax speedup | utilisation async U% vs sync V%

This file is also the sleeping trial: Syne Tune starts it with --st_config_json_filename.
"""

import argparse
import functools
import json
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

TRIAL_FLAG = "--st_config_json_filename"  # how Syne Tune's local backend starts a trial (pass_args_as_json)
EPOCHS = 10


def report(**metrics):
    """The line syne_tune.Reporter prints (and the tuner parses from the trial's stdout). Written out here
    because importing syne_tune (pandas) would cost every trial CPU time that this benchmark would measure
    as scheduling."""
    print(f"[tune-metric]: {json.dumps({**metrics, 'st_worker_timestamp': time.time()})}", flush=True)


def sleeping_trial(argv):
    """A trial process: sleep for a config-dependent time per epoch and report, like a training run. It follows
    async_hpo.py's trial protocol, repeated here so that a trial does not pay for importing torch: its configuration
    from the file after the flag (on Ray, /dev/stdin), die with the process that started it, a first line saying
    where it runs."""
    config = json.loads(Path(argv[argv.index(TRIAL_FLAG) + 1]).read_text())
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the tuner
    if os.getppid() != config["parent_pid"]:
        raise SystemExit("the process that started this trial is gone")
    print("[trial-info]: " + json.dumps({"device": "cpu", "pid": os.getpid()}), flush=True)
    final_error = 0.1 + 0.5 * (math.log10(config["learning_rate"]) + 0.7) ** 2
    for epoch in range(1, config["max_epochs"] + 1):
        time.sleep(0.5 * 128 / config["batch_size"])
        report(epoch=epoch, validation_error=final_error + (0.9 - final_error) * 0.7 ** epoch)


def main():
    if TRIAL_FLAG in sys.argv[1:]:
        sleeping_trial(sys.argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=60.0, help="seconds per search (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each variant (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the configuration sampling")
    options = parser.parse_args()
    if options.budget <= 0 or options.repeats < 1:
        parser.error("--budget must be positive and --repeats at least 1")

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from syne_tune.config_space import loguniform, randint

    import async_hpo

    config_space = {"learning_rate": loguniform(1e-2, 1), "batch_size": randint(32, 256), "max_epochs": EPOCHS,
                    "parent_pid": os.getpid()}
    variants = (("async_1", 1, False), ("async_2", 2, False), ("sync_2", 2, True))
    runs = {name: [] for name, _, _ in variants}
    with tempfile.TemporaryDirectory(prefix="bench-async-hpo-") as results_dir, open(os.devnull, "w") as quiet:
        # Interleaved repeats, so that a burst of load from other work on the machine does not hit one variant only
        for repeat in range(options.repeats):
            for name, n_workers, sync in variants:
                args = async_hpo.Args(scheduler="random", sync=sync, n_workers=n_workers,
                                      max_wallclock_time=options.budget, max_epochs=EPOCHS, seed=options.seed,
                                      results_dir=results_dir, max_failures=0)
                backend = functools.partial(async_hpo.WatchedTrials, args.trial_timeout)
                search = async_hpo.run_search(args, config_space, backend, entry_point=__file__, out=quiet)
                summary = async_hpo.summarize(search, n_workers)
                per_minute = summary["trials_completed"] / (summary["wall_time_s"] / 60)
                runs[name].append((per_minute, summary["utilisation"]))
                print(f"{name:8s} | run {repeat + 1} | {summary['trials_completed']:3d} trials completed in "
                      f"{summary['wall_time_s']:.0f} s | {per_minute:5.1f} trials/min | "
                      f"utilisation {summary['utilisation']:.1%}", flush=True)
    figures = {name: {"trials_per_min": round(sum(r[0] for r in values) / len(values), 2),
                      "utilisation": round(sum(r[1] for r in values) / len(values), 4)}
               for name, values in runs.items()}
    speedup = figures["async_2"]["trials_per_min"] / figures["async_1"]["trials_per_min"]
    print(f"mean of {options.repeats}: trials/min {figures['async_1']['trials_per_min']:.1f} (1 worker) vs "
          f"{figures['async_2']['trials_per_min']:.1f} (2 workers) = {speedup:.2f}x speedup | "
          f"utilisation async {figures['async_2']['utilisation']:.1%} vs sync {figures['sync_2']['utilisation']:.1%}")
    print(json.dumps({"benchmark": "async_hpo", "budget_s": options.budget, "repeats": options.repeats,
                      "speedup_2_workers": round(speedup, 2), **figures}))

if __name__ == "__main__":
    main()
