"""multi_gpu.py: every allreduce learns and equals one process; resume; torchrun; failures end the run."""

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from multi_gpu import init_params
from conftest import (REPO, assert_all_ended, assert_usage_error, data_root, last_json, run_script, spawned_workers,
                      start_script, wait_for_line)

# Small enough for seconds on 2 cores, large enough that LeNet leaves chance level (0.1) within 2 epochs.
TINY = ["--batch-size", 64, "--lr", 0.5, "--limit-train", 8192, "--epochs", 2, "--seed", 3]
# The tutorial's recipe for a few steps. Leaving chance level is a symmetry-breaking phase in which rounding
# differences grow exponentially, so parameter equality is checked on a short run, learning on TINY.
SHORT = ["--batch-size", 256, "--lr", 0.2, "--limit-train", 2000, "--epochs", 2, "--seed", 5]


def data_args():
    root = data_root()
    return ["--data-dir", root] if root else []


def final_params(checkpoint_dir):
    return torch.load(Path(checkpoint_dir) / "multi_gpu.pt", weights_only=True)["params"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process on the same global batches (also writes the plot)."""
    folder = tmp_path_factory.mktemp("one")
    proc = run_script("multi_gpu.py", "--gpus", 0, "--procs", 1, *TINY, *data_args(), "--checkpoint-dir", folder,
                      "--plot", folder / "curve.png", timeout=180)
    assert proc.returncode == 0, proc.stderr
    return {"result": last_json(proc.stdout), "params": final_params(folder), "dir": folder, "stdout": proc.stdout}


@pytest.fixture(scope="module")
def one_process_short(tmp_path_factory):
    folder = tmp_path_factory.mktemp("short")
    proc = run_script("multi_gpu.py", "--gpus", 0, "--procs", 1, *SHORT, *data_args(), "--checkpoint-dir", folder,
                      timeout=180)
    assert proc.returncode == 0, proc.stderr
    return {"result": last_json(proc.stdout), "params": final_params(folder)}


ALLREDUCES = ["tutorial", "ring", "builtin", "ddp"]


@pytest.mark.parametrize("allreduce", ALLREDUCES)
def test_two_processes_learn(allreduce, one_process, tmp_path):
    proc = run_script("multi_gpu.py", "--gpus", 0, "--procs", 2, "--allreduce", allreduce, *TINY, *data_args(),
                      timeout=180)
    assert proc.returncode == 0, proc.stderr
    result = last_json(proc.stdout)
    assert result["world_size"] == 2 and result["allreduce"] == allreduce
    assert result["test_acc"] > 0.3, result  # chance is 0.1
    assert result["history"][-1]["loss"] < result["history"][0]["loss"] - 0.05
    assert sum(line.startswith("epoch ") for line in proc.stdout.splitlines()) == 2  # rank 0 only, per epoch


@pytest.mark.parametrize("procs, allreduce", [(2, name) for name in ALLREDUCES] + [(3, "tutorial"), (3, "ring")])
def test_k_processes_give_the_parameters_of_one_process(allreduce, procs, one_process_short, tmp_path):
    """2000 images in batches of 256: the last batch (208) and, with 3 processes, the shards are uneven."""
    proc = run_script("multi_gpu.py", "--gpus", 0, "--procs", procs, "--allreduce", allreduce, *SHORT,
                      *data_args(), "--checkpoint-dir", tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr
    params, reference = final_params(tmp_path), one_process_short["params"]
    initial = init_params(5)
    assert (reference - initial).abs().max() > 1e-3  # training moved the parameters: the comparison means something
    torch.testing.assert_close(params, reference, rtol=1e-5, atol=1e-6)


def test_plot_is_a_png_of_the_learning_curve(one_process):
    png = (one_process["dir"] / "curve.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


ALLREDUCE_CHECK = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    sys.path.insert(0, {repo!r})
    from common import init_process_group, launch
    from multi_gpu import ring_allreduce, tutorial_allreduce

    def worker(info):
        init_process_group(info, "gloo", 30)
        for size in (1, 2, 7, 1000, 12345):
            for allreduce in (ring_allreduce, tutorial_allreduce):
                data = torch.arange(size, dtype=torch.float64) * (info.rank + 1) + info.rank
                expected = data.clone()
                dist.all_reduce(expected)
                allreduce(data, info.rank, info.world_size)
                assert torch.equal(data, expected), (allreduce.__name__, size, info.rank)
        if info.rank == 0:
            print("allreduce ok", info.world_size)

    if __name__ == "__main__":
        launch(worker, int(sys.argv[1]))
""")


def test_hand_written_allreduce_sums_exactly(tmp_path, world_size=3):
    """Uneven chunks (sizes smaller than, or not divisible by, the world size) included."""
    script = tmp_path / "check_allreduce.py"
    script.write_text(ALLREDUCE_CHECK.format(repo=str(REPO)))
    proc = subprocess.run([sys.executable, script, str(world_size)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"allreduce ok {world_size}" in proc.stdout


def test_resume_ends_with_the_same_parameters(one_process, tmp_path):
    first = run_script("multi_gpu.py", "--gpus", 0, "--procs", 1, *TINY[:-4], "--epochs", 1, "--seed", 3,
                       *data_args(), "--checkpoint-dir", tmp_path, timeout=180)
    assert first.returncode == 0, first.stderr
    assert torch.load(tmp_path / "multi_gpu.pt", weights_only=True)["epoch"] == 1
    resumed = run_script("multi_gpu.py", "--gpus", 0, "--procs", 1, *TINY, *data_args(), "--checkpoint-dir", tmp_path,
                         "--resume", timeout=180)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming after epoch 1" in resumed.stdout
    assert resumed.stdout.count("epoch 2 |") == 1 and "epoch 1 |" not in resumed.stdout
    curve = [(h["loss"], h["test_acc"]) for h in last_json(resumed.stdout)["history"]]
    reference = [(h["loss"], h["test_acc"]) for h in one_process["result"]["history"]]
    assert sum(curve, ()) == pytest.approx(sum(reference, ()), rel=1e-5)
    torch.testing.assert_close(final_params(tmp_path), one_process["params"], rtol=0, atol=1e-6)


def test_resume_refuses_a_checkpoint_of_another_recipe(one_process):
    proc = run_script("multi_gpu.py", "--procs", 1, *TINY[:2], "--lr", 0.1, *TINY[4:], *data_args(),
                      "--checkpoint-dir", one_process["dir"], "--resume", timeout=60)
    assert_usage_error(proc, "multi_gpu.pt was written with", "--checkpoint-dir")


def test_torchrun_launch_equals_one_process(one_process_short, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "multi_gpu.py", "--gpus", "0", *map(str, SHORT), *map(str, data_args()),
                           "--checkpoint-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert last_json(proc.stdout)["world_size"] == 2
    torch.testing.assert_close(final_params(tmp_path), one_process_short["params"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("flags, fragments", [
    (["--gpus", 2], ["--gpus 2 asks for more GPUs", "--gpus 0"]),
    (["--procs", 3, "--batch-size", 2], ["--batch-size 2 is smaller than the 3 processes"]),
    (["--lr", 0], ["--lr must be positive"]),
    (["--epochs", -1], ["--epochs must be positive"]),
    (["--resume"], ["--resume needs --checkpoint-dir"]),
    (["--allreduce", "tree"], ["invalid choice: 'tree'"]),
])
def test_bad_flags_are_one_line_and_exit_2(flags, fragments):
    assert_usage_error(run_script("multi_gpu.py", *flags, timeout=60), *fragments)


def test_data_dir_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    assert_usage_error(run_script("multi_gpu.py", "--data-dir", tmp_path / "file", timeout=60), "is not a folder")


def test_missing_data_offline_names_the_files_and_the_flag(tmp_path):
    # This machine has no internet: the download fails fast and the error says what to do.
    proc = run_script("multi_gpu.py", "--data-dir", tmp_path / "empty", timeout=120)
    assert_usage_error(proc, "train-images-idx3-ubyte.gz", "--data-dir FOLDER")


def start_long_run(*extra):
    return start_script("multi_gpu.py", "--gpus", 0, "--procs", 2, "--batch-size", 64, "--limit-train", 4096,
                        "--epochs", 100, *data_args(), *extra)


def test_killed_worker_ends_the_run_and_leaves_no_orphans_and_sockets_are_loopback(tmp_path):
    proc = start_long_run()
    try:
        wait_for_line(proc, "epoch 1 |")
        workers = spawned_workers(proc)
        assert len(workers) == 2
        listening = [c.laddr.ip for w in workers for c in w.net_connections(kind="inet") if c.status == "LISTEN"]
        assert listening and all(ip in ("127.0.0.1", "::1") for ip in listening), listening
        started = time.monotonic()
        workers[1].send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        assert time.monotonic() - started < 60
        assert proc.returncode != 0
        assert "terminated with signal SIGKILL" in proc.stderr.read()
        assert_all_ended(workers, timeout=1)
    finally:
        proc.kill()


def test_worker_raising_ends_the_run(tmp_path):
    checkpoint_dir = tmp_path / "checkpoints"
    proc = start_long_run("--checkpoint-dir", checkpoint_dir)
    try:
        wait_for_line(proc, "epoch 1 |")
        workers = spawned_workers(proc)
        # Rank 0 saves a checkpoint after every epoch: turning its folder into a file makes the next save raise.
        for path in checkpoint_dir.iterdir():
            path.unlink()
        checkpoint_dir.rmdir()
        checkpoint_dir.write_text("not a folder")
        proc.wait(timeout=60)
        assert proc.returncode == 1
        stderr = proc.stderr.read()
        # rank 0's error is shown (FileExistsError or NotADirectoryError, depending on where the save was)
        assert "Traceback" in stderr and f"'{checkpoint_dir}" in stderr, stderr
        assert_all_ended(workers, timeout=1)
    finally:
        proc.kill()


def test_two_runs_at_once_both_succeed():
    runs = [start_script("multi_gpu.py", "--procs", 2, "--limit-train", 1024, "--epochs", 1, *data_args())
            for _ in range(2)]
    for run in runs:
        stdout, stderr = run.communicate(timeout=180)
        assert run.returncode == 0, stderr
        assert last_json(stdout)["world_size"] == 2
