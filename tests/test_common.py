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
    assert_all_ended,
    assert_usage_error,
    data_root,
    kill_all,
    spawned_workers,
    start_script,
    tree,
    unprivileged,
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
    for name in rpc_rnn.WIKITEXT2_FILES:
        (bad / name).write_text("not wikitext\n")
    target = tmp_path / "data"
    with pytest.raises(common.UsageError, match="wrong checksum"):
        rpc_rnn.wikitext2_dir(target, mirrors=[serve(bad)])
    assert not target.exists()  # nothing written, not even the folder
    assert rpc_rnn.wikitext2_dir(target, mirrors=[serve(WIKITEXT)]) == target
    assert (target / "valid.txt").read_bytes() == (WIKITEXT / "valid.txt").read_bytes()


def test_no_network_and_no_data_says_which_files_and_which_flag(tmp_path, monkeypatch):
    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(common.UsageError, match=r"put train.txt, valid.txt, test.txt in a folder and pass --data-dir"):
        rpc_rnn.wikitext2_dir(tmp_path / "nothing", mirrors=["http://127.0.0.1:9/"])


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
    with pytest.raises(common.UsageError, match=r"^--count many: not a whole number"):
        common.parse_args(Example, ["--count", "many"])
    with pytest.raises(SystemExit) as exit_info:
        common.parse_args(Example, ["--mode", "c"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --mode: invalid choice: 'c'" in err
    with pytest.raises(SystemExit):
        common.parse_args(Example, ["--help"])
    out = capsys.readouterr().out
    assert "how many (default: 3)" in out and "--fast, --no-fast" in out and "{a,b}" in out
    assert "--count N" in out and "--path TEXT" in out and "(default: None)" not in out


@dataclasses.dataclass
class Kinds:
    # Numbers
    count: common.Positive = 1
    """how many"""
    skip: common.NonNegative = 0
    """how many to skip"""
    seed: common.Seed = 0
    """seed"""
    rate: common.PositiveFloat = 0.1
    """a rate"""
    wait: common.Seconds = 1.0
    """a timeout"""
    shift: float = 0.0
    """any finite number"""
    big: int = 0
    """any whole number"""
    # Files
    load: Optional[common.InFile] = None
    """read"""
    save: Optional[common.OutFile] = None
    """written"""
    out: Optional[common.OutDir] = None
    """a folder written into"""
    data: Optional[common.DataDir] = None
    """data"""
    name: Optional[str] = None
    """text"""


LONG = "x" * 300
BAD_VALUES = [  # (flag, value, the start of the message after "--flag value: ")
    ("count", "0", "not a whole number, 1 or more"), ("count", "1.5", "not a whole number"),
    ("count", str(2**63), "not a whole number, 1 or more"), ("skip", "-1", "not a whole number, 0 or more"),
    ("seed", "-1", "not a seed"), ("seed", str(2**32), "not a seed"), ("seed", "1e3", "not a seed"),
    ("rate", "0", "not a positive number"), ("rate", "nan", "not a positive number"),
    ("rate", "inf", "not a positive number"), ("wait", "10m", "not a number of seconds from 0.001 to 2147483"),
    ("wait", "-5", "not a number of seconds from 0.001 to 2147483"),
    ("wait", "0.0009", "not a number of seconds from 0.001 to 2147483"),  # under 1 ms: no timeout
    ("wait", "2147484", "not a number of seconds from 0.001 to 2147483"),  # beyond 32-bit milliseconds
    ("shift", "nan", "not a finite number"),
    ("shift", "-inf", "not a finite number"), ("big", str(-2**63 - 1), "not a whole number that fits"),
    ("name", "", "an empty value"), ("load", "", "an empty value"), ("save", "", "an empty value"),
    ("out", "", "an empty value"), ("data", "", "an empty value"),
    ("load", "{tmp}/missing", "no such file"), ("load", "{tmp}", "not a regular file"),
    ("load", "/dev/null", "not a regular file"), ("load", "{tmp}/fifo", "not a regular file"),
    ("load", "{tmp}/file/below", "Not a directory"), ("load", LONG, "File name too long"),
    ("save", "/dev/null", "not a regular file"), ("save", "{tmp}/fifo", "not a regular file"),
    ("save", "{tmp}", "not a regular file"), ("save", "{tmp}/missing/x.pt", "folder {tmp}/missing does not exist"),
    ("save", "{tmp}/file/x.pt", "Not a directory"), ("save", "{tmp}/" + LONG, "File name too long"),
    ("save", "{tmp}/dangling", "a link to nothing"),
    ("out", "/dev/null", "/dev/null is not a folder"), ("out", "{tmp}/file", "{tmp}/file is not a folder"),
    ("out", "{tmp}/file/below", "Not a directory"), ("out", "{tmp}/" + LONG, "File name too long"),
    ("data", "{tmp}/file", "not a folder; pass the folder"), ("data", "/dev/null", "not a folder"),
]


@pytest.mark.parametrize("flag, value, message", BAD_VALUES, ids=[f"{f}={v[:20]}" for f, v, _ in BAD_VALUES])
def test_every_kind_of_value_has_one_rule_checked_as_it_is_parsed(flag, value, message, tmp_path):
    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    before = sorted(tmp_path.iterdir())
    value = value.format(tmp=tmp_path)
    with pytest.raises(common.UsageError) as error:
        common.parse_args(Kinds, [f"--{flag}={value}"])
    assert str(error.value).startswith(f"--{flag} {value if value else repr(value)}: {message.format(tmp=tmp_path)}"), \
        str(error.value)
    assert "\n" not in str(error.value)
    assert sorted(tmp_path.iterdir()) == before  # nothing written, nothing created


def test_good_values_pass_every_rule(tmp_path):
    (tmp_path / "file").write_text("x")
    args = common.parse_args(Kinds, ["--count", "3", "--skip", "0", "--seed", str(2**32 - 1), "--rate", "1e-9",
                                     "--wait", "2147483", "--shift", "-2", "--big", str(-2**63), "--load",
                                     str(tmp_path / "file"), "--save", str(tmp_path / "file"), "--out",
                                     str(tmp_path / "a" / "b"), "--data",
                                     str(tmp_path / "new"), "--name", "x"])
    assert (args.count, args.seed, args.big, args.out) == (3, 2**32 - 1, -2**63, str(tmp_path / "a" / "b"))
    assert args.wait == 2147483
    assert sorted(path.name for path in tmp_path.iterdir()) == ["file"]  # folders are made by the run, not here


PATHS = textwrap.dedent("""
    import dataclasses, sys
    from typing import Optional
    sys.path.insert(0, {repo!r})
    import common

    @dataclasses.dataclass
    class Paths:
        load: Optional[common.InFile] = None
        save: Optional[common.OutFile] = None
        out: Optional[common.OutDir] = None
        data: Optional[common.DataDir] = None

    common.run_main(lambda: print(common.parse_args(Paths, sys.argv[1:])))
""")


def test_paths_the_run_may_not_use_are_refused_as_it_would_find_them(tmp_path):
    """Files and folders the run may not read or write, found by trying as the run will (root in a user namespace
    is held to the permission bits): one line, exit status 2, nothing written."""
    script = tmp_path / "paths.py"
    script.write_text(PATHS.format(repo=str(REPO)))
    (tmp_path / "locked").mkdir(mode=0o500)
    (tmp_path / "closed").mkdir(mode=0o000)
    (tmp_path / "secret").write_text("x")
    (tmp_path / "secret").chmod(0)
    before = tree(tmp_path)
    for flag, value, message in [("save", "locked/x.pt", "cannot write in"), ("out", "locked/sub", "cannot write in"),
                                 ("load", "secret", "cannot be read"), ("data", "closed", "cannot be read"),
                                 ("save", "closed/x.pt", "Permission denied")]:
        proc = subprocess.run(unprivileged([sys.executable, script, f"--{flag}", tmp_path / value]),
                              capture_output=True, text=True, timeout=60)
        assert_usage_error(proc, f"--{flag} {tmp_path / value}: ", message)
    assert tree(tmp_path) == before
    proc = subprocess.run(unprivileged([sys.executable, script, "--save", tmp_path / "x.pt", "--out", tmp_path / "o"]),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "save=" in proc.stdout, proc.stderr  # the same paths elsewhere pass


TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29400"}
BAD_ENVIRONMENTS = [
    ({"MASTER_ADDR": None, "MASTER_PORT": None}, "MASTER_PORT, MASTER_ADDR not set"),
    ({"LOCAL_WORLD_SIZE": None}, "LOCAL_WORLD_SIZE not set"),
    ({"RANK": "2"}, "RANK=2 WORLD_SIZE=2"), ({"RANK": "-1"}, "RANK=-1"), ({"WORLD_SIZE": "two"}, "WORLD_SIZE=two"),
    ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2"), ({"LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE=3"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT=0"), ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
    ({"WORLD_SIZE": "9" * 30}, "WORLD_SIZE=999"), ({"MASTER_ADDR": "no-such-host.invalid"}, "MASTER_ADDR=no-such"),
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
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"], env["MASTER_ADDR"]) == (0, 2, 29400, "127.0.0.1")
    assert common.process_count(3) == 2


def test_process_counts_are_bounded_by_the_machine_unless_oversubscribed():
    limit = 4 * common.usable_cpus()
    common.check_processes("--procs", limit, oversubscribe=False)
    with pytest.raises(common.UsageError, match=rf"--procs {limit + 1}: more than {limit}, 4 per CPU.*--oversubscribe"):
        common.check_processes("--procs", limit + 1, oversubscribe=False)
    common.check_processes("--procs", 10 * limit, oversubscribe=True)


def test_weights_and_optimizer_states_that_do_not_fit_are_one_line():
    model = torch.nn.Linear(4, 2)
    assert common.check_fits(torch.nn.Linear(4, 2), model.state_dict(), "--load", "x.pt")
    with pytest.raises(common.UsageError, match=r"--load x.pt: does not fit this model \(size mismatch for weight"):
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
                          ("plain", "written by another program, not by demo.py")]:
        with pytest.raises(common.UsageError, match=message):
            common.load_checkpoint(tmp_path / f"{name}.pt", "demo", "--load")
    with pytest.raises(common.UsageError, match="written by demo, not by other.py"):
        common.load_checkpoint(tmp_path / "good.pt", "other", "--load")
    with pytest.raises(common.UsageError, match="lacks optimizer"):
        common.load_checkpoint(tmp_path / "good.pt", "demo", "--load", keys=("optimizer",))


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
        with common.rendezvous(2) as store:
            common.run_main(lambda: common.join(mp.spawn(run_worker, args=(2, store), nprocs=2, join=False)))
""")


def test_a_process_that_raises_ends_the_run_with_its_traceback(tmp_path):
    """mp.spawn's report, printed whole: the process named, its one traceback; the peer that lost it adds nothing."""
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
    assert stderr.startswith("-- Process 1 terminated with the following error:\nTraceback"), stderr
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
# characters on 2026-11-27 (docs/walkthrough.md tells of it)
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
        with common.rendezvous(2) as store:
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


# --- The shared layer's rules, one by one: one_line, check_used, check_memory, check_machine, listen_on_loopback ---

def spawn_report(*last_lines):
    """What mp.spawn raises in the launcher for a process that raised: its message holds the process's traceback."""
    message = ("\n\n-- Process 1 terminated with the following error:\nTraceback (most recent call last):\n"
               '  File "/x/script.py", line 3, in run_worker\n    step()\n' + "\n".join(last_lines) + "\n")
    return torch.multiprocessing.ProcessRaisedException(message, 1, 4242)


CUDA_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of "
            "79.19 GiB of which 1.06 GiB is free.")
CPU_OOM = ("RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you tried "
           "to allocate 3221225472 bytes.")
NUMPY_OOM = "numpy.core._exceptions._ArrayMemoryError: Unable to allocate 4.00 GiB for an array with shape (2, 2)"
SIZES = "--batch-size or --batch-per-device"
# (the error, sizes, the line one_line gives without the "demo.py: error: " of the ones that have it, the status)
ONE_LINES = [
    (common.UsageError("--n 0: not a whole number, 1 or more"), None, "--n 0: not a whole number, 1 or more", 2),
    (common.RunFailed("cannot write x.pt (File too large); ..."), None, "cannot write x.pt (File too large); ...", 1),
    (BrokenPipeError(32, "Broken pipe"), None, None, 141),  # the reader went away: quiet, as a SIGPIPE would be
    (OSError(28, "No space left on device"), None,
     "cannot write the output (No space left on device); send it elsewhere", 1),
    (OSError(5, "Input/output error"), None, "cannot write the output (Input/output error); send it elsewhere", 1),
    (spawn_report(CUDA_OOM), SIZES, f"out of memory: 2.50 GiB did not fit; pass a smaller {SIZES}", 1),
    (spawn_report(CPU_OOM), SIZES, f"out of memory: 3.0 GiB did not fit; pass a smaller {SIZES}", 1),
    (spawn_report(NUMPY_OOM), SIZES, f"out of memory: 4.00 GiB did not fit; pass a smaller {SIZES}", 1),
    (spawn_report("MemoryError"), SIZES, f"out of memory: an allocation did not fit; pass a smaller {SIZES}", 1),
    (RuntimeError(CPU_OOM.split(": ", 1)[1]), "--emsize", "out of memory: 3.0 GiB did not fit; pass a smaller "
                                                          "--emsize", 1),  # in the launcher itself
    (MemoryError(), "--emsize", "out of memory: an allocation did not fit; pass a smaller --emsize", 1),
]


@pytest.mark.parametrize("error, sizes, line, status", ONE_LINES, ids=[f"{type(case[0]).__name__}-{i}"
                                                                       for i, case in enumerate(ONE_LINES)])
def test_one_line_gives_each_kind_of_error_its_line_and_status(error, sizes, line, status, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["demo.py"])
    assert common.one_line(error, sizes) == ("" if line is None else f"demo.py: error: {line}", status)


def test_one_line_leaves_a_bug_to_its_traceback_and_a_raising_process_to_mp_spawns_report(monkeypatch):
    """A bug (None: run_main lets its traceback show), here or in a spawned process (mp.spawn's report, whole);
    an allocation that failed is out of memory only where the run says which flags set its sizes; a full disk
    under a file's name is that file's error (write_or_fail names it), not the output's."""
    monkeypatch.setattr(sys, "argv", ["demo.py"])
    for bug in (ValueError("a bug"), KeyError("params"), RuntimeError(CPU_OOM), OSError(28, "No space", "/x/y.pt")):
        assert common.one_line(bug) is None, bug
    raised = spawn_report("ValueError: a bug in process 1")
    assert common.one_line(raised, SIZES) == (raised.msg.strip(), 1)
    assert common.one_line(spawn_report(CUDA_OOM)) == (spawn_report(CUDA_OOM).msg.strip(), 1)
    assert raised.msg.strip().startswith("-- Process 1 terminated with the following error:\nTraceback")


@dataclasses.dataclass
class Tuning:
    lr_base_batch: int = 256
    warmup_epochs: Optional[float] = None
    procs: int = 2


def test_check_used_refuses_a_flag_the_run_would_drop(monkeypatch):
    """A value other than the default, for a flag this run does not use: one line naming the flag, its value and when
    it is used. The default itself passes (given or not, it changes nothing), and so does every flag not named."""
    rules = {"lr_base_batch": "with --lr-scaling", "warmup_epochs": "with --lr-scaling linear or sqrt"}
    common.check_used(Tuning(), **rules)
    common.check_used(Tuning(lr_base_batch=256, procs=8), **rules)
    with pytest.raises(common.UsageError) as error:
        common.check_used(Tuning(lr_base_batch=512), **rules)
    assert str(error.value) == "--lr-base-batch 512: used only with --lr-scaling; drop it"
    with pytest.raises(common.UsageError, match=r"^--warmup-epochs 2.0: used only with --lr-scaling linear or sqrt; "):
        common.check_used(Tuning(warmup_epochs=2.0), **rules)
    with pytest.raises(common.UsageError, match=r"^--procs 3: used only for CPU processes; drop it$"):
        common.check_used(Tuning(procs=3), procs="for CPU processes")


def test_check_memory_compares_what_must_fit_with_the_memory_free_now(monkeypatch):
    """psutil's available memory (what can be had without swapping), faked at 1 GiB."""
    import psutil
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": 2**30})())
    common.check_memory("the model", 2**30, "--emsize")  # exactly what is free fits
    with pytest.raises(common.UsageError) as error:
        common.check_memory("the model and a window's logits", 2**30 + 2**29, "--emsize, --nhid or --bptt")
    assert str(error.value) == ("the model and a window's logits need about 1.5 GiB, and this machine has 1.0 GiB "
                                "free; pass a smaller --emsize, --nhid or --bptt")


@pytest.fixture
def machine(monkeypatch):
    """check_machine on a machine faked by the test: machine(soft, hard, interfaces) -> the setrlimit calls made."""
    import resource
    import socket

    def fake(soft, hard, interfaces=("lo", "eth0")):
        calls = []
        monkeypatch.setattr(resource, "getrlimit", lambda which: (soft, hard) if which == resource.RLIMIT_NOFILE
                            else pytest.fail(f"getrlimit({which})"))
        monkeypatch.setattr(resource, "setrlimit", lambda which, limits: calls.append((which, limits)))
        monkeypatch.setattr(socket, "if_nameindex", lambda: list(enumerate(interfaces, 1)))
        return calls

    for variable in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME"):
        monkeypatch.delenv(variable, raising=False)
    return fake


def test_check_machine_raises_a_low_open_file_limit_within_the_hard_one(machine):
    """128 + 80 per process open files: 288 for 2 processes, 928 for 10."""
    import resource
    infinity, nofile = resource.RLIM_INFINITY, resource.RLIMIT_NOFILE
    for soft, hard, processes, raised in [(64, 4096, 2, (288, 4096)), (64, infinity, 10, (928, infinity)),
                                          (287, 288, 2, (288, 288))]:
        calls = machine(soft, hard)
        common.check_machine(processes)
        assert calls == [(nofile, raised)], (soft, hard, processes)
    for soft, hard in [(1024, 4096), (infinity, infinity), (288, 288)]:
        calls = machine(soft, hard)
        common.check_machine(2)
        assert calls == [], (soft, hard)


def test_check_machine_refuses_a_hard_open_file_limit_below_the_need(machine):
    calls = machine(64, 287)
    with pytest.raises(common.UsageError) as error:
        common.check_machine(2)
    assert str(error.value) == ("the open-file limit is 287, and 2 processes need about 288; raise it (ulimit -n 288) "
                                "or start fewer processes")
    assert calls == []


@pytest.mark.parametrize("variable, value, missing", [
    ("GLOO_SOCKET_IFNAME", "eth9", "eth9"), ("TP_SOCKET_IFNAME", "wlan0", "wlan0"),
    ("GLOO_SOCKET_IFNAME", "lo,eth9,eth8", "eth9, eth8"),  # gloo takes a list: every name that is not there
])
def test_check_machine_refuses_an_interface_the_machine_lacks(variable, value, missing, machine, monkeypatch):
    machine(1024, 4096, interfaces=("lo", "eth0"))
    monkeypatch.setenv(variable, value)
    with pytest.raises(common.UsageError) as error:
        common.check_machine(2)
    assert str(error.value) == (f"{variable}={value}: this machine has no network interface {missing} (it has eth0, "
                                f"lo); unset it or name one of them")


def test_check_machine_passes_interfaces_the_machine_has(machine, monkeypatch):
    machine(1024, 4096, interfaces=("lo", "eth0", "ib0"))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0,ib0")
    monkeypatch.setenv("TP_SOCKET_IFNAME", "lo")
    common.check_machine(2)


def test_listen_on_loopback_names_the_loopback_interface_for_every_backend_unless_set(monkeypatch):
    """gloo, TensorPipe and NCCL each read their variable; one the user set is kept. The loopback interface is found
    by name (lo on Linux, lo0 elsewhere)."""
    import socket
    variables = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
    for interfaces, expected in [(("eth0", "lo"), "lo"), (("en0", "lo0"), "lo0")]:
        for variable in variables:
            monkeypatch.delenv(variable, raising=False)
        monkeypatch.setattr(socket, "if_nameindex", lambda names=interfaces: list(enumerate(names, 1)))
        common.listen_on_loopback()
        assert [os.environ[variable] for variable in variables] == [expected] * 3
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    monkeypatch.delenv("TP_SOCKET_IFNAME")
    common.listen_on_loopback()
    assert (os.environ["GLOO_SOCKET_IFNAME"], os.environ["TP_SOCKET_IFNAME"]) == ("eth0", "lo0")


def test_loopback_addresses_are_told_from_others():
    assert all(common.loopback(host) for host in ("127.0.0.1", "127.0.1.1", "::1", "localhost"))
    assert not any(common.loopback(host) for host in ("192.0.2.1", "2001:db8::1", "0.0.0.0"))


def test_tf32_is_set_on_cuda_devices_only_and_every_getter_still_reads_it(monkeypatch):
    """On the CPU nothing changes; on a CUDA device TF32 goes on or off through the allow_tf32 flags, after which
    torch's getters, the legacy ones and the fp32_precision ones, all read it back (setting fp32_precision instead
    makes torch.backends.cuda.matmul.allow_tf32 raise "mix of the legacy and new APIs")."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        common.set_tf32(torch.device("cpu"), True)
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == saved
        for allowed, precision in ((True, "tf32"), (False, "ieee")):
            common.set_tf32(torch.device("cuda", 0), allowed)  # a device object: no GPU is touched
            assert torch.backends.cuda.matmul.allow_tf32 is allowed and torch.backends.cudnn.allow_tf32 is allowed
            assert torch.backends.cuda.matmul.fp32_precision == precision
            assert torch.get_float32_matmul_precision() == ("high" if allowed else "highest")
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
