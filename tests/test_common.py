"""common.py: downloads are checked and atomic, data loads with the published checksums, flags parse."""

import dataclasses
import functools
import http.server
import json
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
import rpc_rnn
from conftest import (
    LOOPBACK_DIRECT,
    OFFLINE,
    REPO,
    as_a_shells_job,
    assert_all_ended,
    data_folder,
    kill_all,
    spawned_workers,
    start_script,
    wait_for_line,
)


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


def test_fashion_mnist_downloads_verifies_and_loads(serve, tmp_path):
    target = tmp_path / "data"
    down = "http://127.0.0.1:9/"  # the first mirror is down
    folder = common.fashion_mnist_dir(target, mirrors=[down, serve(data_folder("fashion-mnist"))])
    assert folder == target
    assert sorted(p.name for p in target.iterdir()) == sorted(common.FASHION_MNIST_FILES)  # no temporary files left
    train_x, train_y, test_x, test_y = common.load_fashion_mnist(folder)
    assert train_x.shape == (60000, 28, 28) and train_x.dtype == torch.uint8
    assert test_x.shape == (10000, 28, 28)
    assert torch.bincount(train_y).tolist() == [6000] * 10 and torch.bincount(test_y).tolist() == [1000] * 10
    assert abs(train_x.float().mean().item() / 255 - 0.2860) < 1e-3
    # A second call finds the files and downloads nothing (the server is gone).
    assert common.fashion_mnist_dir(target, mirrors=[]) == target


def test_a_download_with_the_wrong_checksum_is_refused_and_not_kept(serve, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in rpc_rnn.WIKITEXT2_FILES:
        (bad / name).write_text("not wikitext\n")
    target = tmp_path / "data"
    with pytest.raises(common.UsageError, match="wrong checksum"):
        rpc_rnn.wikitext2_dir(target, mirrors=[serve(bad)])
    assert not target.exists()  # nothing written, not even the folder
    assert rpc_rnn.wikitext2_dir(target, mirrors=[serve(data_folder("wikitext-2"))]) == target
    assert (target / "valid.txt").read_bytes() == (data_folder("wikitext-2") / "valid.txt").read_bytes()


def test_no_network_and_no_data_says_which_files_and_which_flag(tmp_path, monkeypatch):
    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(common.UsageError, match=r"put train.txt, valid.txt, test.txt in a folder and pass --data-dir"):
        rpc_rnn.wikitext2_dir(tmp_path / "nothing", mirrors=["http://127.0.0.1:9/"])


def test_corrupt_data_is_detected_before_the_run(tmp_path):
    for name in common.FASHION_MNIST_FILES:
        (tmp_path / name).write_bytes((data_folder("fashion-mnist") / name).read_bytes())
    import gzip
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(gzip.compress(b"\0" * 10008))
    with pytest.raises(common.UsageError, match="t10k-labels-idx1-ubyte.gz is corrupt"):
        common.fashion_mnist_dir(tmp_path, mirrors=[])
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(b"not gzip")
    with pytest.raises(common.UsageError, match="t10k-labels-idx1-ubyte.gz is corrupt"):
        common.fashion_mnist_dir(tmp_path, mirrors=[])


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
        common.parse_args(Example, ["--mode", "c"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --mode: invalid choice: 'c'" in err
    with pytest.raises(SystemExit):
        common.parse_args(Example, ["--help"])
    out = capsys.readouterr().out
    assert "how many (default: 3)" in out and "--fast, --no-fast" in out and "{a,b}" in out
    assert "where to write\n" in out and "(default: None)" not in out


@dataclasses.dataclass
class Kinds:
    count: common.Positive = 1
    """how many"""
    skip: common.NonNegative = 0
    """how many to skip"""
    seed: common.Seed = 0
    """seed"""
    rate: common.PositiveFloat = 0.1
    """a rate"""
    shift: float = 0.0
    """any number"""


BAD_VALUES = [("count", "0"), ("count", "1.5"), ("count", "many"), ("skip", "-1"), ("seed", "-1"),
              ("seed", str(2**32)), ("rate", "0"), ("rate", "-1"), ("rate", "nan"), ("rate", "inf"), ("shift", "x")]


@pytest.mark.parametrize("flag, value", BAD_VALUES, ids=[f"{flag}={value}" for flag, value in BAD_VALUES])
def test_every_kind_of_value_has_its_rule_checked_as_it_is_parsed(flag, value, capsys):
    """One line on stderr naming the flag and the value, exit status 2 (argparse's own error, in one line)."""
    with pytest.raises(SystemExit) as exit_info:
        common.parse_args(Kinds, [f"--{flag}={value}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"argument --{flag}: " in err and repr(value) in err, err


def test_good_values_pass_every_rule():
    args = common.parse_args(Kinds, ["--count", "3", "--skip", "0", "--seed", str(2**32 - 1), "--rate", "1e-9",
                                     "--shift", "-2.5"])
    assert args == Kinds(3, 0, 2**32 - 1, 1e-9, -2.5)


def test_an_output_folder_that_cannot_be_created_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    assert common.make_dir("--checkpoint-dir", tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert (tmp_path / "a" / "b").is_dir()
    with pytest.raises(common.UsageError, match=r"^--checkpoint-dir .*/file/sub: cannot create this folder \(Not a "
                                                r"directory\); pass another$"):
        common.make_dir("--checkpoint-dir", tmp_path / "file" / "sub")


TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29400"}
BAD_ENVIRONMENTS = [
    ({"MASTER_ADDR": None, "MASTER_PORT": None}, "MASTER_ADDR, MASTER_PORT not set"),
    ({"LOCAL_WORLD_SIZE": None}, "LOCAL_WORLD_SIZE not set"),
    ({"RANK": "2"}, "RANK=2 WORLD_SIZE=2"), ({"RANK": "-1"}, "RANK=-1"), ({"WORLD_SIZE": "two"}, "WORLD_SIZE=two"),
    ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2"), ({"LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE=3"),
    ({"MASTER_PORT": "port"}, "MASTER_PORT=port"),
]


@pytest.mark.parametrize("changes, message", BAD_ENVIRONMENTS)
def test_a_torchrun_environment_that_does_not_fit_together_is_one_line(changes, message, monkeypatch):
    for name, value in {**TORCHRUN, **changes}.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    with pytest.raises(common.UsageError, match=re.escape(message)) as error:
        common.torchrun_env()
    assert "\n" not in str(error.value) and "torchrun" in str(error.value)


def test_torchrun_environment(monkeypatch):
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "example.invalid")  # alone, it launches nothing: spawned runs ignore it
    assert common.torchrun_env() is None and common.process_count(3) == 3
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    env = common.torchrun_env()
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"], env["MASTER_ADDR"]) == (0, 2, "29400", "127.0.0.1")
    assert common.process_count(3) == 2


def test_weights_and_optimizer_states_that_do_not_fit_are_one_line():
    model = torch.nn.Linear(4, 2)
    assert common.check_fits(torch.nn.Linear(4, 2), model.state_dict(), "--load", "x.pt")
    with pytest.raises(common.UsageError, match=r"--load x.pt: does not fit this model \(.*size mismatch for weight"):
        common.check_fits(torch.nn.Linear(5, 2), model.state_dict(), "--load", "x.pt")
    with pytest.raises(common.UsageError, match=r"Missing key"):
        common.check_fits(torch.nn.Sequential(model), model.state_dict(), "--load", "x.pt")
    deeper = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(common.UsageError, match="--resume x.pt: does not fit this model .*size of optimizer's group"):
        common.check_fits(torch.optim.Adam(model.parameters()), torch.optim.Adam(deeper.parameters()).state_dict(),
                          "--resume", "x.pt")


def test_a_checkpoint_is_verified_when_loaded(tmp_path):
    common.save_checkpoint(tmp_path / "good.pt", "demo", {"weights": torch.arange(1000.0), "epoch": 3})
    assert torch.load(tmp_path / "good.pt")["epoch"] == 3
    assert common.load_checkpoint(tmp_path / "good.pt", "demo", "--load", keys=("weights",))["epoch"] == 3
    good = (tmp_path / "good.pt").read_bytes()
    damaged = bytearray(good)
    damaged[good.index(torch.arange(1000.0)[500:502].numpy().tobytes())] ^= 0xFF  # torch.load reads it
    (tmp_path / "damaged.pt").write_bytes(damaged)
    (tmp_path / "truncated.pt").write_bytes(good[:len(good) // 2])
    torch.save({"weights": torch.zeros(2)}, tmp_path / "plain.pt")
    for name, message in [("damaged", "damaged"), ("truncated", "not a readable checkpoint"),
                          ("plain", "not written by demo.py")]:
        with pytest.raises(common.UsageError, match=message):
            common.load_checkpoint(tmp_path / f"{name}.pt", "demo", "--load")
    with pytest.raises(common.UsageError, match="not written by other.py"):
        common.load_checkpoint(tmp_path / "good.pt", "other", "--load")
    with pytest.raises(common.UsageError, match="lacks optimizer"):
        common.load_checkpoint(tmp_path / "good.pt", "demo", "--load", keys=("optimizer",))


def test_a_write_that_fails_keeps_the_previous_file_whole(tmp_path, monkeypatch):
    """The disk fills up while the new file is written: the error is Python's (OSError), the previous file is
    intact and loadable, and no temporary file is left beside it."""
    common.save_checkpoint(tmp_path / "run.pt", "demo", {"epoch": 1})
    before = (tmp_path / "run.pt").read_bytes()

    def full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        common.save_checkpoint(tmp_path / "run.pt", "demo", {"epoch": 2, "weights": torch.zeros(10**5)})
    assert (tmp_path / "run.pt").read_bytes() == before
    assert common.load_checkpoint(tmp_path / "run.pt", "demo", "--load")["epoch"] == 1
    assert [path.name for path in tmp_path.iterdir()] == ["run.pt"]


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".pdf", b"%PDF"), (".svg", b"<?xml")])
def test_a_figure_is_written_in_the_format_its_name_says(tmp_path, suffix, magic):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots()
    axes.plot([1, 2, 3])
    common.save_figure(figure, tmp_path / f"curve{suffix.upper()}")
    assert (tmp_path / f"curve{suffix.upper()}").read_bytes().startswith(magic)
    assert [path.name for path in tmp_path.iterdir()] == [f"curve{suffix.upper()}"]  # no temporary file left


def test_the_result_line_is_strict_json_with_null_for_a_number_that_is_not_finite(capsys):
    """A diverged run's loss (NaN) or perplexity (inf): Python's json writes NaN and Infinity, which JSON has not, and
    strict parsers (JavaScript's JSON.parse) refuse the whole line. Text that spells them stays text."""
    def strict(constant):
        raise ValueError(f"{constant} is not JSON")
    common.emit_result("demo", loss=float("nan"), ppl=float("inf"), history=[{"loss": float("-inf"), "acc": 0.5}],
                       note="NaN Infinity")
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and line.endswith("\n"), line
    assert json.loads(line, parse_constant=strict) == {"script": "demo", "loss": None, "ppl": None,
                                                       "history": [{"loss": None, "acc": 0.5}], "note": "NaN Infinity"}


RAISING_WORKER = textwrap.dedent("""
    import sys, torch.distributed as dist, torch.multiprocessing as mp
    sys.path.insert(0, {repo!r})
    import common

    @common.worker
    def run_worker(rank, world_size, store):
        dist.init_process_group("gloo", init_method=store + ".pg", rank=rank, world_size=world_size)
        if rank == 1:
            print("raising", flush=True)  # (alone: process 0 prints nothing)
            raise ValueError("a bug in process 1")
        dist.barrier()  # process 0 waits for process 1, which never comes

    if __name__ == "__main__":
        with common.rendezvous() as store:
            common.run_main(lambda: common.join(mp.spawn(run_worker, args=(2, store), nprocs=2, join=False)))
""")


def test_a_process_that_raises_ends_the_run_with_its_traceback(tmp_path):
    """The process named, with its one traceback (common.worker); the peer that lost it adds nothing."""
    script = tmp_path / "raising.py"
    script.write_text(RAISING_WORKER.format(repo=str(REPO)))
    proc = start_script(script)
    try:
        wait_for_line(proc, "raising", timeout=60)
        raised_at = time.monotonic()
        proc.wait(timeout=60)
        ended_after = time.monotonic() - raised_at
        stderr = proc.stderr.read()
    finally:
        kill_all(proc)
    assert proc.returncode == 1, stderr
    # mp.spawn sees process 1 exit at once and stops process 0 (blocked in the barrier, whose default timeout is 30
    # minutes): well under a second here. A process 0 left running would hold the run for those 30 minutes; 10 s
    # leaves a loaded machine room for two exits.
    assert ended_after < 10, ended_after
    assert stderr.startswith("process 1 raised:\nTraceback"), stderr
    assert stderr.count("Traceback") == 1, stderr  # process 0's broken connection is not news
    assert stderr.strip().splitlines()[-1] == "ValueError: a bug in process 1"


LOST_PEER_WORKER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    import common

    @common.worker
    def run_worker(rank, world_size):
        raise RuntimeError({message!r})

    run_worker(0, 2)
""")
# gloo's message when a peer's connection drops, as a restart of multi_gpu.py under torchrun printed its first 200
# characters
GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:13191: "
              "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the applic")


def test_a_lost_peer_is_one_line_that_ends_torchs_reason_at_its_first_sentence(tmp_path):
    """A process whose peer is gone says so in one line, exit status 1, with torch's reason up to its first sentence's
    end: gloo's goes on to a second sentence, which a cut at a set length would end mid-word."""
    script = tmp_path / "lost.py"
    script.write_text(LOST_PEER_WORKER.format(repo=str(REPO), message=GLOO_RESET))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == ("process 0 lost a peer ([/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:"
                           "537] Read error [127.0.0.1]:13191: Connection reset by peer); the run ends, or under "
                           "torchrun restarts if --max-restarts allows\n")


KILLED_PEER = textwrap.dedent("""
    import datetime, os, signal, sys, tempfile, time
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    sys.path.insert(0, {repo!r})
    import common

    def join(rank, store):
        dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        dist.barrier()

    def peer(store):
        join(1, store)
        os.kill(os.getpid(), signal.SIGKILL)

    @common.worker
    def run_worker(rank, world_size, store):
        join(rank, store)
        while True:
            dist.all_reduce(torch.ones(10))
            time.sleep(0.01)

    if __name__ == "__main__":
        store = f"file://{{tempfile.mkdtemp()}}/store"
        mp.get_context("spawn").Process(target=peer, args=(store,)).start()
        run_worker(0, 2, store)
""")


def test_a_killed_peer_is_one_line_and_an_error_of_the_workers_own_that_mentions_one_keeps_its_traceback(tmp_path):
    """What gloo raises when the peer of a collective is killed ends the process in one line, exit status 1; a
    RuntimeError of the worker's own code whose words say "timed out" and "peer" is not a lost peer: its traceback."""
    script = tmp_path / "killed_peer.py"
    script.write_text(KILLED_PEER.format(repo=str(REPO)))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert re.fullmatch(r"process 0 lost a peer \(\[.*gloo/transport/tcp/.*\); the run ends, or under torchrun "
                        r"restarts if --max-restarts allows\n", proc.stderr), proc.stderr
    own = "the data loader timed out waiting for its peer, tensorpipe said: RPC ran for more than 60 s"
    script.write_text(LOST_PEER_WORKER.format(repo=str(REPO), message=own))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("process 0 raised:\nTraceback"), proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"RuntimeError: {own}"


SLEEPING_WORKERS = textwrap.dedent("""
    import sys, time, datetime, torch.distributed as dist, torch.multiprocessing as mp
    sys.path.insert(0, {repo!r})
    import common

    @common.worker
    def run_worker(rank, world_size, store):
        dist.init_process_group("gloo", init_method=store + ".pg", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=3))
        dist.barrier()
        if rank == 0:
            print("started", flush=True)  # (alone: unbuffered, two processes' prints would interleave)
        for _ in range(10000):
            dist.barrier()
            time.sleep(0.01)

    if __name__ == "__main__":
        with common.rendezvous() as store:
            common.run_main(lambda: common.join(mp.spawn(run_worker, args=(2, store), nprocs=2, join=False)))
""")


@pytest.fixture
def sleeping_run(tmp_path, monkeypatch):
    """A launcher whose two spawned processes meet in a barrier every 10 ms (a 3 s timeout), and its processes. Its
    temporary folder (TMPDIR, where common.rendezvous makes its folder) is tmp_path/tmp."""
    script = tmp_path / "sleeping.py"
    script.write_text(SLEEPING_WORKERS.format(repo=str(REPO)))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    proc = start_script(script)
    workers = []
    try:
        wait_for_line(proc, "started", timeout=60)
        workers = spawned_workers(proc)
        yield proc, workers
    finally:
        kill_all(proc, pids=[worker.pid for worker in workers])  # a stopped worker would outlive a failed test


def test_a_stopped_process_ends_the_run_when_its_peer_times_out(sleeping_run):
    """SIGSTOP on process 1: process 0's barrier times out after 3 s and it says so in one line; common.join has
    mp.spawn stop the others at once, the stopped one, deaf to SIGTERM, with SIGKILL."""
    proc, workers = sleeping_run
    stopped_at = time.monotonic()
    workers[1].send_signal(signal.SIGSTOP)
    proc.wait(timeout=60)
    # The mechanism: the barrier's 3 s timeout, then the 1 s that a spawned process waits before it says it lost a
    # peer (common.worker); no grace after it (mp.spawn's own would add 30 s). Process 0's barrier may have started up
    # to one 10 ms step before the stop (hence 0.1 s below); what follows the timer (one line, two exits, the
    # launcher's) takes well under a second, and 4 s above leaves room for a machine loaded by other tests.
    assert 3 + 1 - 0.1 <= time.monotonic() - stopped_at < 3 + 1 + 4
    stderr = proc.stderr.read()
    assert proc.returncode == 1
    assert re.fullmatch(r"process 0 lost a peer \(.*[Tt]imed out.*\); the run ends, or under torchrun restarts if "
                        r"--max-restarts allows", stderr.strip()), stderr
    assert_all_ended(workers, timeout=5)  # the stopped one included


def test_a_killed_launcher_takes_its_processes_with_it(sleeping_run, tmp_path):
    """The kernel sends each process SIGKILL as its parent dies (PR_SET_PDEATHSIG, common.worker): no timer is
    involved, so 3 s leaves a loaded machine room to tear the processes down; without it, they would go on meeting
    in their barriers for minutes. The rendezvous folder stays, as README says: nothing is left to remove it."""
    proc, workers = sleeping_run
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert_all_ended(workers, timeout=3)
    assert len(list((tmp_path / "tmp").glob("rendezvous-*"))) == 1


def test_a_terminated_launcher_stops_its_processes_and_removes_its_folder(sleeping_run, tmp_path):
    """SIGTERM on the launcher (a job scheduler's stop): exit status 143 without a line, as a shell reports that
    signal, every process stopped, and the rendezvous folder gone (common.rendezvous). Python's default for SIGTERM
    would end the launcher where it stands, killed by the signal, and leave the folder behind."""
    proc, workers = sleeping_run
    assert len(list((tmp_path / "tmp").glob("rendezvous-*"))) == 1
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=10)
    assert proc.returncode == 128 + signal.SIGTERM and proc.stderr.read() == ""
    assert_all_ended(workers, timeout=3)
    assert list((tmp_path / "tmp").glob("rendezvous-*")) == []


# --- run_main: the line and exit status of each way a run ends ---

MAIN = textwrap.dedent("""
    import sys, time, torch.multiprocessing as mp
    sys.path.insert(0, {repo!r})
    import common

    @common.worker
    def run_worker(rank, world_size, how):
        if how == "raise" and rank == 1:
            raise ValueError("a bug in process 1")
        if how == "kill" and rank == 1:
            import os, signal
            os.kill(os.getpid(), signal.SIGKILL)
        print("working", flush=True)
        time.sleep(60 if how != "ok" else 0)

    def main():
        how = sys.argv[1]
        if how == "usage":
            raise common.UsageError("--n 0: not a whole number, 1 or more")
        with common.rendezvous() as store:
            common.join(mp.spawn(run_worker, args=(2, how), nprocs=2, join=False))

    if __name__ == "__main__":
        common.run_main(main)
""")


@pytest.mark.parametrize("how, status, first, last", [
    ("ok", 0, None, None),
    ("usage", 2, "main.py: error: --n 0: not a whole number, 1 or more", None),
    ("raise", 1, "process 1 raised:", "ValueError: a bug in process 1"),
    ("kill", 1, "main.py: error: process 1 terminated with signal SIGKILL; the other processes were stopped", None)])
def test_run_main_ends_each_way_with_its_line_and_status(how, status, first, last, tmp_path):
    script = tmp_path / "main.py"
    script.write_text(MAIN.format(repo=str(REPO)))
    proc = subprocess.run([sys.executable, script, how], capture_output=True, text=True, timeout=120)
    assert proc.returncode == status, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[:1] == ([first] if first else []), proc.stderr
    if last:
        assert lines[-1] == last and proc.stderr.count("Traceback") == 1, proc.stderr
    else:
        assert len(lines) <= 1 and "Traceback" not in proc.stderr, proc.stderr


def test_ctrl_c_ends_the_run_with_status_130_and_every_process_stopped(tmp_path):
    """Ctrl-C sends SIGINT to the whole foreground process group: the launcher and its processes."""
    script = tmp_path / "main.py"
    script.write_text(MAIN.format(repo=str(REPO)))
    proc = subprocess.Popen([sys.executable, script, "sleep"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=as_a_shells_job)
    try:
        wait_for_line(proc, "working", timeout=60)
        wait_for_line(proc, "working", timeout=60)  # both processes run their worker
        workers = spawned_workers(proc)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        kill_all(proc)
    assert proc.returncode == 130
    assert proc.stderr.read().strip().splitlines()[-1] == "main.py: interrupted; every process was stopped"
    assert_all_ended(workers, timeout=5)
