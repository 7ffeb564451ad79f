"""common.py: downloads are checked and atomic, data loads with the published checksums, flags parse."""

import dataclasses
import functools
import http.server
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Literal, Optional

import pytest
import torch

import common
from conftest import (
    LOOPBACK_DIRECT,
    OFFLINE,
    REPO,
    assert_all_ended,
    data_root,
    spawned_workers,
    start_script,
    wait_for_line,
)

FASHION = data_root() / "fashion-mnist" if data_root() else None
WIKITEXT = data_root() / "wikitext-2" if data_root() else None
needs_data = pytest.mark.skipif(FASHION is None, reason="needs ../shared/data or DATA_DIR")


@pytest.fixture
def serve(monkeypatch):
    """serve(folder) -> base URL of an HTTP server on loopback that serves that folder (reached directly, even
    where the environment names a proxy)."""
    for name, value in LOOPBACK_DIRECT.items():
        monkeypatch.setenv(name, value)
    servers = []

    def start(folder):
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
        handler.log_message = lambda *args: None
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/"

    yield start
    for server in servers:
        server.shutdown()


@needs_data
def test_fashion_mnist_downloads_verifies_and_loads(serve, tmp_path):
    target = tmp_path / "data"
    folder = common.fashion_mnist_dir(target, mirrors=["http://127.0.0.1:9/", serve(FASHION)])  # first mirror is down
    assert folder == target
    assert sorted(p.name for p in target.iterdir()) == sorted(common.FASHION_MNIST_FILES)  # no temporary files left
    train_x, train_y, test_x, test_y = common.load_fashion_mnist(folder)
    assert train_x.shape == (60000, 28, 28) and train_x.dtype == torch.uint8
    assert test_x.shape == (10000, 28, 28)
    assert torch.bincount(train_y).tolist() == [6000] * 10 and torch.bincount(test_y).tolist() == [1000] * 10
    assert abs(train_x.float().mean().item() / 255 - 0.2860) < 1e-3
    # A second call finds the files and downloads nothing (the server is gone).
    assert common.fashion_mnist_dir(target, mirrors=[]) == target


@needs_data
def test_a_download_with_the_wrong_checksum_is_refused_and_not_kept(serve, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in common.WIKITEXT2_FILES:
        (bad / name).write_text("not wikitext\n")
    target = tmp_path / "data"
    with pytest.raises(common.UsageError, match="wrong checksum"):
        common.wikitext2_dir(target, mirrors=[serve(bad)])
    assert not target.exists()  # nothing written, not even the folder
    assert common.wikitext2_dir(target, mirrors=[serve(WIKITEXT)]) == target
    assert (target / "valid.txt").read_bytes() == (WIKITEXT / "valid.txt").read_bytes()


def test_no_network_and_no_data_says_which_files_and_which_flag(tmp_path, monkeypatch):
    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(common.UsageError, match=r"put train.txt, valid.txt, test.txt in a folder and pass --data-dir"):
        common.wikitext2_dir(tmp_path / "nothing", mirrors=["http://127.0.0.1:9/"])


@needs_data
def test_corrupt_file_is_detected_on_load(tmp_path):
    for name in common.FASHION_MNIST_FILES:
        (tmp_path / name).write_bytes((FASHION / name).read_bytes())
    import gzip
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(b"\0" * 10008))
    with pytest.raises(common.UsageError, match="corrupt"):
        common.load_fashion_mnist(tmp_path)


@dataclasses.dataclass
class Example:
    count: int = 3
    """how many"""
    mode: Literal["a", "b"] = "a"
    """which mode"""
    fast: bool = True
    """go fast"""
    path: Optional[str] = None
    """where to write"""


def test_parse_args_from_a_dataclass(capsys):
    assert common.parse_args(Example, []) == Example()
    assert common.parse_args(Example, ["--count", "5", "--mode", "b", "--no-fast", "--path", "x"]) == \
        Example(5, "b", False, "x")
    with pytest.raises(SystemExit) as exit_info:
        common.parse_args(Example, ["--count", "many"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--count: invalid int value: 'many'" in err
    with pytest.raises(SystemExit):
        common.parse_args(Example, ["--help"])
    out = capsys.readouterr().out
    assert "how many (default: 3)" in out and "--fast, --no-fast" in out and "{a,b}" in out


def _pinned_cpus(local_rank, local_world_size, queue):
    info = common.DistInfo(local_rank, local_world_size, local_rank, local_world_size, "env://")
    queue.put((common.pin_to_one_cpu(info), sorted(os.sched_getaffinity(0))))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity (Linux)")
def test_pin_to_one_cpu_only_when_there_is_a_cpu_for_every_local_process():
    cpus = sorted(os.sched_getaffinity(0))
    context = multiprocessing.get_context("spawn")  # in children: pinning this test process would slow the rest

    def pinned(local_rank, local_world_size):
        queue = context.Queue()
        child = context.Process(target=_pinned_cpus, args=(local_rank, local_world_size, queue))
        child.start()
        result = queue.get(timeout=60)
        child.join(timeout=60)
        return result

    assert pinned(0, len(cpus)) == (cpus[0], [cpus[0]])
    assert pinned(len(cpus) - 1, len(cpus)) == (cpus[-1], [cpus[-1]])
    assert pinned(0, len(cpus) + 1) == (None, cpus)  # too few CPUs: placement is left to the OS


RAISING_WORKER = textwrap.dedent("""
    import sys, time, torch, torch.distributed as dist
    sys.path.insert(0, {repo!r})
    from common import init_process_group, launch

    def worker(info):
        init_process_group(info, "gloo", 60)
        if info.rank == 1:
            raise ValueError("a bug in process 1")
        dist.barrier()  # process 0 waits for process 1, which never comes

    if __name__ == "__main__":
        launch(worker, 2, timeout=60)
""")


def test_a_process_that_raises_ends_the_run_with_its_traceback(tmp_path):
    script = tmp_path / "raising.py"
    script.write_text(RAISING_WORKER.format(repo=str(REPO)))
    started = time.monotonic()
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert time.monotonic() - started < 30  # not the 60 s the barrier would wait
    assert proc.stderr.startswith("process 1 failed:\nTraceback"), proc.stderr
    assert proc.stderr.count("Traceback") == 1, proc.stderr  # process 0's broken connection is not news
    assert proc.stderr.strip().splitlines()[-1] == "ValueError: a bug in process 1"


SLEEPING_WORKERS = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from common import launch

    def worker(info):
        print("started", info.rank, flush=True)
        time.sleep(120)

    if __name__ == "__main__":
        launch(worker, 2, timeout=6)
""")


@pytest.fixture
def sleeping_run(tmp_path):
    """A launcher with two spawned processes that do nothing for two minutes, and its processes."""
    script = tmp_path / "sleeping.py"
    script.write_text(SLEEPING_WORKERS.format(repo=str(REPO)))
    proc = start_script(script)
    try:
        for _ in range(2):
            wait_for_line(proc, "started", timeout=60)
        yield proc, spawned_workers(proc)
    finally:
        proc.kill()
        proc.wait()


def test_a_stopped_process_ends_the_run_named_within_the_timeout(sleeping_run):
    proc, workers = sleeping_run
    stopped_at = time.monotonic()
    workers[1].send_signal(signal.SIGSTOP)
    proc.wait(timeout=30)
    assert 3 - common.HEARTBEAT_S <= time.monotonic() - stopped_at < 6 + 5  # silent 3 s since its last heartbeat
    assert proc.returncode == 1
    assert re.fullmatch(rf"error: process 1 \(pid {workers[1].pid}\) sent no sign of life for [3-9] s \(stopped\); "
                        r"the other processes were stopped", proc.stderr.read().strip())
    assert_all_ended(workers, timeout=5)  # the stopped one included


def test_a_killed_launcher_takes_its_processes_with_it(sleeping_run):
    proc, workers = sleeping_run
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert_all_ended(workers, timeout=5)
