"""rpc_rnn.py on a slice of WikiText-2: the loss falls and the learning rate decays, distributed gradients equal
one-process gradients to float32 rounding (with clipping), a checkpoint gathered from both processes loads into the
one-process model and generates text, the loss on the ps equals the tutorial's logits path, two torchrun nodes and a
torchrun group restarted after kills compute the losses of one uninterrupted run, bad input is one line and exit 2
before anything is read or written, and failures (a dead, stopped or orphaned process, a full disk) end the run
promptly with nothing left running."""

import contextlib
import io
import math
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
import zipfile
from statistics import mean

import psutil
import pytest
import torch
from torch import nn

import common
import rpc_rnn
from conftest import (
    OFFLINE,
    REPO,
    assert_all_ended,
    assert_help_lists_every_flag,
    assert_usage_error,
    data_folder,
    first_visible_gpu,
    free_port,
    kill_all,
    last_json,
    needs_gpus,
    run_script,
    spawned_workers,
    start_script,
    torchrun_command,
    tree,
    wait_for_line,
)

# Small enough for seconds per run on 2 cores, large enough that the loss has something to learn.
SMALL = ["--emsize", "48", "--nhid", "48", "--batch-size", "10", "--bptt", "20"]
TRAIN = ["--epochs", "2", "--max-batches", "20", "--log-interval", "10", *SMALL]


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    """The first lines of WikiText-2's train/valid/test.txt (vocabulary of a few thousand words), in a folder whose
    name has a space and a non-ASCII letter, as users name theirs."""
    source = data_folder("wikitext-2")
    folder = tmp_path_factory.mktemp("wikitext-slice") / "my text é"
    folder.mkdir()
    for name, lines in (("train.txt", 300), ("valid.txt", 40), ("test.txt", 40)):
        with open(source / name, encoding="utf-8") as handle:
            (folder / name).write_text("".join(line for _, line in zip(range(lines), handle)), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def trained(text_dir, tmp_path_factory):
    """One default (loss-on-ps) run that saves the model and checkpoints; several tests read them."""
    folder = tmp_path_factory.mktemp("trained")
    proc = run_script("rpc_rnn.py", "--data-dir", text_dir, *TRAIN, "--save", folder / "lm.pt",
                      "--checkpoint-dir", folder / "checkpoints", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"proc": proc, "result": last_json(proc.stdout), "save": folder / "lm.pt",
            "checkpoint": folder / "checkpoints" / "rpc_rnn.pt"}


def assert_same_weights(weights, expected):
    """Two state dicts hold the same names and, under each, equal tensors."""
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


def test_loss_falls_and_logs(trained):
    proc, result = trained["proc"], trained["result"]
    assert result["mode"] == "loss-on-ps" and result["batches"] == len(result["losses"]) == 40
    assert mean(result["losses"][-10:]) < mean(result["losses"][:10]) - 0.5, result
    # Better than guessing uniformly over the vocabulary, on held-out text.
    assert result["valid_ppl"] < result["ntoken"] / 2 and result["test_ppl"] < result["ntoken"] / 2, result
    lines = proc.stdout.splitlines()
    train_lines = [line for line in lines if "ms/batch" in line]
    assert len(train_lines) == 4, proc.stdout
    for field in ("batch 10/20", "lr 20.00", "ms/batch", "loss", "ppl"):
        assert field in train_lines[0], train_lines[0]
    assert sum("valid ppl" in line for line in lines) == 2
    assert any(line.startswith("test loss") and "test ppl" in line for line in lines)
    assert proc.stderr == "", proc.stderr  # no warnings, deprecations included


def test_checkpoint_loads_into_local_model_and_generates(trained, text_dir):
    saved = torch.load(trained["save"], map_location="cpu", weights_only=True)
    model = rpc_rnn.LocalRNNModel(**saved["config"])
    model.load_state_dict(saved["model"])  # strict: every parameter of both processes is there
    corpus = rpc_rnn.Corpus(text_dir)
    assert saved["vocab"] == corpus.words
    # The one-process model scores the test text exactly as the distributed run did at its end.
    test_data = rpc_rnn.batchify(corpus.test, rpc_rnn.EVAL_BATCH_SIZE, "cpu")
    local_test_loss = rpc_rnn.evaluate(model, test_data, 20)
    assert abs(local_test_loss - trained["result"]["test_loss"]) < 1e-4, (local_test_loss, trained["result"])

    proc = run_script("rpc_rnn.py", "--generate", 30, "--load", trained["save"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert last_json(proc.stdout)["words"] == 30
    words = " ".join(line for line in proc.stdout.splitlines() if not line.startswith("{")).split()
    assert len(words) == 30 and set(words) <= set(corpus.words)


def test_ship_logits_gives_the_same_losses(trained, text_dir):
    result = trained["result"]
    proc = run_script("rpc_rnn.py", "--data-dir", text_dir, *TRAIN, "--ship-logits", timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shipped = last_json(proc.stdout)
    assert shipped["mode"] == "ship-logits"
    # Same seed: same weights and dropout masks; only where the cross-entropy is computed differs.
    assert len(shipped["losses"]) == len(result["losses"]) == 40
    assert max(abs(a - b) for a, b in zip(shipped["losses"], result["losses"])) < 1e-4
    assert math.isclose(shipped["test_loss"], result["test_loss"], abs_tol=1e-4)


# One window per epoch, dropout 0, lr 20: the valid loss soon stops improving, and the lr falls.
ONE_WINDOW = ["--max-batches", "1", "--dropout", "0", "--lr", "20", *SMALL]


@pytest.fixture(scope="module")
def one_window_runs(text_dir, tmp_path_factory):
    """{epochs: (the run, its checkpoint)} of two uninterrupted runs of ONE_WINDOW, 3 and 4 epochs."""
    folder = tmp_path_factory.mktemp("one-window")
    runs = {}
    for epochs in (3, 4):
        proc = run_script("rpc_rnn.py", "--data-dir", text_dir, *ONE_WINDOW, "--epochs", epochs, "--checkpoint-dir",
                          folder / str(epochs), timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[epochs] = proc, folder / str(epochs) / "rpc_rnn.pt"
    return runs


def test_the_learning_rate_falls_by_4_after_an_epoch_that_did_not_improve_and_the_next_step_uses_it(one_window_runs,
                                                                                                    text_dir):
    """ONE_WINDOW. Each epoch steps with a new DistributedOptimizer at the epoch's lr (SGD keeps no state): the
    weights after epoch 4 are those after epoch 3 moved by the window's clipped gradient times epoch 4's lr, as one
    process computes it here."""
    saved = {epochs: torch.load(path, weights_only=True) for epochs, (_, path) in one_window_runs.items()}
    proc = one_window_runs[4][0]
    valid = [float(loss) for loss in re.findall(r"valid loss (\S+)", proc.stdout)]
    expected, best = [20.0], math.inf  # the lr of each epoch, then the last one
    for loss in valid:
        expected.append(expected[-1] if loss < best else expected[-1] / 4)
        best = min(best, loss)
    assert expected[3] < 20, valid  # a decay before epoch 4: the case this test is about
    assert re.findall(r"\| lr (\S+) \|", proc.stdout) == [f"{lr:.2f}" for lr in expected[:4]], proc.stdout
    assert last_json(proc.stdout)["lr"] == saved[4]["run"]["lr"] == expected[4]
    model = rpc_rnn.LocalRNNModel(**saved[3]["config"])
    model.load_state_dict(saved[3]["model"])
    input, targets = rpc_rnn.get_batch(rpc_rnn.batchify(rpc_rnn.Corpus(text_dir).train, 10, "cpu"), 0, 20)
    model.loss(input, targets, rpc_rnn.init_hidden(model.rnn, 10))[0].backward()
    nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    torch.optim.SGD(model.parameters(), lr=expected[3]).step()
    for name, weight in model.state_dict().items():
        torch.testing.assert_close(weight, saved[4]["model"][name], rtol=1e-5, atol=1e-6, msg=name)


def test_resume_of_a_finished_run_trains_nothing_and_more_epochs_continue_it_to_the_uninterrupted_end(
        one_window_runs, text_dir, tmp_path):
    """The finished 3-epoch run of one_window_runs, its command run again with --resume on a copy of its checkpoint:
    no batch, no validation, the same result line, the checkpoint untouched. Then with --epochs 4: exactly epoch 4
    more (at the lr the checkpoint holds, after a decay), ending where the uninterrupted 4-epoch run ended: its
    losses, figures and weights."""
    (finished, finished_checkpoint), (uninterrupted, uninterrupted_checkpoint) = one_window_runs[3], one_window_runs[4]
    shutil.copy(finished_checkpoint, tmp_path / "rpc_rnn.pt")
    command = ["--data-dir", text_dir, *ONE_WINDOW, "--checkpoint-dir", tmp_path, "--resume"]
    written = tree(tmp_path)
    again = run_script("rpc_rnn.py", *command, "--epochs", 3, timeout=120)
    assert again.returncode == 0 and again.stderr == "", again.stderr[-3000:]
    assert re.search(r"^resuming at epoch 4 from ", again.stdout, flags=re.M), again.stdout
    assert "ms/batch" not in again.stdout and "valid loss" not in again.stdout, again.stdout
    assert last_json(again.stdout) == last_json(finished.stdout)  # tokens_per_s too: the checkpoint's count and time
    assert tree(tmp_path) == written  # not written again

    more = run_script("rpc_rnn.py", *command, "--epochs", 4, timeout=120)
    assert more.returncode == 0 and more.stderr == "", more.stderr[-3000:]
    assert re.findall(r"^epoch (\d+) \| batch", more.stdout, flags=re.M) == ["4"], more.stdout
    assert re.findall(r"^epoch (\d+) \| valid loss", more.stdout, flags=re.M) == ["4"], more.stdout
    result, expected = last_json(more.stdout), last_json(uninterrupted.stdout)
    assert result["lr"] < 20 and len(result["losses"]) == 4, result  # a run whose lr fell, one loss per epoch
    assert {**result, "tokens_per_s": None} == {**expected, "tokens_per_s": None}  # a rate: timed, not computed
    ended, expected = (torch.load(path, weights_only=True) for path in (tmp_path / "rpc_rnn.pt",
                                                                        uninterrupted_checkpoint))
    assert {**ended["run"], "seconds": None, "best_state": None} == {**expected["run"], "seconds": None,
                                                                     "best_state": None}
    assert_same_weights(ended["model"], expected["model"])  # the weights it ended with
    assert_same_weights(ended["run"]["best_state"], expected["run"]["best_state"])  # the best, which it tested


def test_copied_alone_the_distributed_gradients_are_the_one_process_gradients(text_dir, tmp_path):
    """From a folder holding only rpc_rnn.py and common.py. --clip 0.05 is below the gradient norm, so the global
    clipping across both processes is exercised, and the weights after the distributed optimizer's step prove the
    step used the clipped gradients. Same kernels on the same CPU, but the global norm is summed in another order
    than clip_grad_norm_'s, so the two agree to float32 rounding. Tolerances: the norm within 1e-6 of it (about 1e-5
    relative; measured: 7e-9), the losses 1e-6, the weights (of size about 0.1) 1e-6 after 3 steps of lr 20 (measured:
    6e-8, one float32 step at 0.5). A step that missed the clipping ends more than 1e-3 away (the next test)."""
    for name in ("rpc_rnn.py", "common.py"):
        shutil.copy(REPO / name, tmp_path / name)
    proc = subprocess.run([sys.executable, "rpc_rnn.py", "--data-dir", str(text_dir), "--check-gradients",
                           "--dropout", "0", "--clip", "0.05", "--max-batches", "3", *SMALL],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = last_json(proc.stdout)
    assert result["batches"] == 3
    assert result["compared"] == len(list(rpc_rnn.LocalRNNModel(10, 4, 4, 2, 0.0).parameters()))
    assert min(result["grad_norms"]) > 0.05, result  # clipping was active on every batch
    assert result["norm_diff"] <= 1e-6 and result["loss_diff"] <= 1e-6 and result["max_param_diff"] <= 1e-6, result
    assert sorted(path.name for path in tmp_path.iterdir()) == ["common.py", "rpc_rnn.py"]  # wrote nothing


def test_a_few_distributed_steps_end_where_one_process_training_the_same_windows_ends(text_dir, tmp_path):
    """The weights a distributed run checkpoints after 3 windows (--dropout 0, --clip 0.05 below every gradient norm,
    lr 20) against the same 3 windows trained here, in this process, by plain torch: LocalRNNModel from the same seed,
    the LSTM state carried across windows and cut from the graph between them, the gradients clipped on their global
    norm by clip_grad_norm_, torch.optim.SGD. Nothing of the script's own comparison (--check-gradients) is used.

    Tolerance 1e-6 on the weights (of size about 0.1), 1e-5 on the losses (printed to 6 decimals): the same float32
    CPU kernels on both sides, but a reduction split over other threads may round a gradient differently in its
    last bit (about 1e-7 of it), which lr 20 carries into the weights over 3 steps. A step that missed the clipping
    ends more than 1e-3 away, as the unclipped steps below show."""
    windows, clip, lr, seed = 3, 0.05, 20.0, 1111
    proc = run_script("rpc_rnn.py", "--data-dir", text_dir, "--epochs", 1, "--max-batches", windows, "--dropout", 0,
                      "--clip", clip, "--lr", lr, "--seed", seed, "--checkpoint-dir", tmp_path, *SMALL, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    distributed = torch.load(tmp_path / "rpc_rnn.pt", weights_only=True)
    corpus = rpc_rnn.Corpus(text_dir)
    config = dict(ntoken=len(corpus.words), ninp=48, nhid=48, nlayers=2, dropout=0.0)
    assert distributed["config"] == config

    def train_here(max_norm):
        model = rpc_rnn.LocalRNNModel(**config, seed=seed)
        sgd = torch.optim.SGD(model.parameters(), lr=lr)
        data = rpc_rnn.batchify(corpus.train, 10, "cpu")  # --batch-size 10, --bptt 20 (SMALL)
        hidden = tuple(torch.zeros(2, 10, 48) for _ in range(2))
        losses, norms = [], []
        for start in range(0, 20 * windows, 20):
            input, targets = rpc_rnn.get_batch(data, start, 20)
            sgd.zero_grad()
            output, hidden = model.rnn(model.embedding(input), tuple(h.detach() for h in hidden))
            loss = nn.functional.cross_entropy(model.decoder(output).flatten(0, 1), targets.flatten())
            loss.backward()
            norms.append(nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
            sgd.step()
            losses.append(loss.item())
        return model.state_dict(), losses, norms

    weights, losses, norms = train_here(clip)
    assert min(norms) > clip, norms  # clipping was active on every window
    assert distributed["run"]["losses"] == pytest.approx(losses, abs=1e-5)
    assert last_json(proc.stdout)["losses"] == pytest.approx(losses, abs=1e-5)
    assert sorted(distributed["model"]) == sorted(weights)  # every weight of both processes
    for name, weight in weights.items():
        torch.testing.assert_close(distributed["model"][name], weight, rtol=0, atol=1e-6, msg=name)
    unclipped, _, _ = train_here(math.inf)
    assert max((unclipped[name] - weight).abs().max().item() for name, weight in weights.items()) > 1e-3


def test_help_lists_every_flag(capsys):
    assert_help_lists_every_flag(rpc_rnn, capsys)


def test_help_says_what_not_given_means_and_names_only_what_a_copy_has(capsys):
    with pytest.raises(SystemExit):
        rpc_rnn.main(["--help"])
    out = capsys.readouterr().out
    text = out + rpc_rnn.__doc__
    assert "--checkpoint-dir" in text and "torchrun" in text
    for elsewhere in ("benchmarks/", "tests/", "../shared", "README", "docs/"):
        assert elsewhere not in text, elsewhere
    helps = {entry.split()[0]: " ".join(entry.split()) for entry in re.split(r"\n  (?=--)", out)[1:]}
    # The flags that are off unless given say what "not given" means, and --max-batches and --check-gradients agree.
    for flag in ("--max-batches", "--save", "--data-dir", "--checkpoint-dir", "--generate"):
        assert "not given: " in helps[flag], helps[flag]
    assert "not given: all (2 under --check-gradients)" in helps["--max-batches"]
    assert "run the first --max-batches batches (2 if not given)" in helps["--check-gradients,"]
    # No measured times in the help or the docstring: they live on the docs page, with their command and machine.
    times = re.findall(r".*\d+(?:\.\d+)? ?(?:s|ms|min)\b(?!/).*", text)
    assert not times, times


# How long after a kill (or a failed write) the launcher must have ended: mp.spawn's join wakes as soon as a process
# dies, SIGTERMs the other, which has no handler for it and dies at once, and the launcher prints its line (1.2 to
# 1.9 s measured here with 4 test runs sharing the 2 cores); one that outlived the SIGTERM gets SIGKILL at once
# (common.join: no grace). A process left running would hold the run for its timeout; 10 s leaves 5 times the
# measured time for load.
ENDS_WITHIN_S = 10
EPOCH_BATCHES = 8  # --max-batches of the kill test: epochs of well under a second


def test_ps_killed_ends_the_run_in_one_line_keeps_the_last_epochs_checkpoint_and_listens_on_loopback_only(text_dir,
                                                                                                          tmp_path):
    """The ps SIGKILLed in epoch 2 of a run that checkpoints after every epoch: the launcher's one line naming
    process 0, exit status 1, every process ended at once, and the checkpoint of epoch 1 as it was saved. The trainer,
    which alone writes checkpoints, is stopped (SIGSTOP) for the moment of the kill, right after epoch 2's second
    batch: the file read then is what was saved last, and the trainer, continued the instant the kill is sent, cannot
    finish epoch 2 without the ps. Before the kill: every listening socket of both processes is on loopback."""
    checkpoint = tmp_path / "rpc_rnn.pt"
    launcher = start_script("rpc_rnn.py", "--data-dir", text_dir, "--epochs", 50, "--max-batches", EPOCH_BATCHES,
                            "--log-interval", 1, "--checkpoint-dir", tmp_path, *SMALL)
    try:
        wait_for_line(launcher, "ms/batch", timeout=90)  # the trainer is training
        workers = spawned_workers(launcher)
        assert len(workers) == 2, workers
        ps, trainer = workers  # ranks 0 and 1
        everyone = psutil.Process(launcher.pid).children(recursive=True)
        listening = [c.laddr.ip for w in workers for c in w.net_connections(kind="inet") if c.status == "LISTEN"]
        assert listening and all(ip in ("127.0.0.1", "::1") for ip in listening), listening  # TensorPipe's
        valid_loss = float(re.search(r"valid loss (\S+)", wait_for_line(launcher, "epoch 1 | valid loss", 90))[1])
        wait_for_line(launcher, f"epoch 2 | batch 2/{EPOCH_BATCHES} ", timeout=90)
        trainer.suspend()
        saved = checkpoint.read_bytes()
        killed_at = time.monotonic()
        ps.kill()
        trainer.resume()
        _, stderr = launcher.communicate(timeout=60)
        ended_after = time.monotonic() - killed_at
        assert launcher.returncode == 1, stderr
        assert stderr == ("rpc_rnn.py: error: process 0 terminated with signal SIGKILL; the other processes were "
                          "stopped\n")
        assert ended_after < ENDS_WITHIN_S, ended_after
        assert_all_ended(everyone, timeout=5)
    finally:
        kill_all(launcher)
    # byte for byte the checkpoint saved before the kill: epoch 1's, whose valid loss the run printed, ready to
    # continue at epoch 2, with weights that load into the one-process model
    assert checkpoint.read_bytes() == saved
    kept = common.load_checkpoint(checkpoint, "rpc_rnn", "--resume", keys=("model", "vocab", "config", "recipe", "run"))
    before = torch.load(io.BytesIO(saved), weights_only=True)
    assert {**kept["run"], "best_state": None} == {**before["run"], "best_state": None}
    assert kept["run"]["epoch"] == 2 and len(kept["run"]["losses"]) == EPOCH_BATCHES, kept["run"]
    assert f"{kept['run']['best_valid']:.2f}" == f"{valid_loss:.2f}"
    model = rpc_rnn.LocalRNNModel(**kept["config"])
    model.load_state_dict(kept["model"])
    assert_same_weights(model.state_dict(), before["model"])
    assert_same_weights(kept["run"]["best_state"], before["model"])  # epoch 1's weights are the best so far
    assert [path.name for path in tmp_path.iterdir()] == ["rpc_rnn.pt"]


def test_a_killed_launcher_leaves_nothing(text_dir):
    launcher = start_script("rpc_rnn.py", "--data-dir", text_dir, "--epochs", 50, "--log-interval", 1, *SMALL)
    try:
        wait_for_line(launcher, "ms/batch", timeout=90)
        workers = spawned_workers(launcher)
        assert len(workers) == 2, workers
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        assert_all_ended(workers, timeout=10)
    finally:
        kill_all(launcher)


def test_a_checkpoint_that_cannot_be_written_ends_the_run_and_keeps_the_last_one(text_dir, tmp_path):
    """The disk fills up mid-run: a file-size limit of 256 kB put on the trainer, which writes every file, after
    the first epoch's files stops the next one (the --save file or the checkpoint, 2.8 MB each) but not the few
    bytes the processes add to their rendezvous file as they shut down. The trainer's traceback ends in Python's
    error, exit status 1, and the last checkpoint and the saved model still load."""
    checkpoint_dir, save = tmp_path / "checkpoints", tmp_path / "lm.pt"
    launcher = start_script("rpc_rnn.py", "--data-dir", text_dir, "--epochs", 50, "--max-batches", 10,
                            "--log-interval", 1, "--checkpoint-dir", checkpoint_dir, "--save", save, *SMALL)
    try:
        wait_for_line(launcher, "ms/batch", timeout=90)
        epoch_start = time.monotonic()
        wait_for_line(launcher, "epoch 1 | valid loss", timeout=90)
        epoch_seconds = time.monotonic() - epoch_start  # 9 of its 10 batches and the validation
        deadline = time.monotonic() + 60
        while not (save.exists() and (checkpoint_dir / "rpc_rnn.pt").exists()) and time.monotonic() < deadline:
            time.sleep(0.1)  # both are written right after the valid line
        workers = spawned_workers(launcher)
        resource.prlimit(workers[1].pid, resource.RLIMIT_FSIZE, (256_000, 256_000))
        limited_at = time.monotonic()
        _, stderr = launcher.communicate(timeout=120)
        # the next write fails at the end of epoch 2 (twice epoch 1's time allows for a machine whose load varies),
        # and the run ends as after a kill
        ended_after = time.monotonic() - limited_at
        assert ended_after < 2 * epoch_seconds + ENDS_WITHIN_S, (ended_after, epoch_seconds)
        assert launcher.returncode == 1, stderr
        assert stderr.startswith("process 1 raised:\nTraceback") and stderr.count("Traceback") == 1, stderr
        assert stderr.strip().splitlines()[-1] == "OSError: [Errno 27] File too large", stderr
        saved = common.load_checkpoint(checkpoint_dir / "rpc_rnn.pt", "rpc_rnn", "--resume",
                                       keys=("model", "vocab", "config", "recipe", "run"))
        assert saved["run"]["epoch"] >= 2
        model = torch.load(save, weights_only=True)
        rpc_rnn.LocalRNNModel(**model["config"]).load_state_dict(model["model"])
        assert [path.name for path in checkpoint_dir.iterdir()] == ["rpc_rnn.pt"]  # no temporary file left
        assert_all_ended(workers, timeout=5)
    finally:
        kill_all(launcher)


# --- torchrun: two nodes, and a group restarted after its trainer is killed ---




def test_two_torchrun_nodes_compute_the_losses_of_the_spawned_run(trained, text_dir):
    port = free_port()
    nodes = [subprocess.Popen(torchrun_command("--nnodes", 2, "--node-rank", rank, "--nproc-per-node", 1,
                                               "--master-addr", "127.0.0.1", "--master-port", port, "rpc_rnn.py",
                                               "--data-dir", text_dir, *TRAIN),
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=180) for node in nodes]
    finally:
        kill_all(*nodes)
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in outputs]
    assert outputs[0][0] == ""  # node 0 is the ps: it says nothing
    result = last_json(outputs[1][0])
    assert result["losses"] == trained["result"]["losses"]
    assert result["test_loss"] == trained["result"]["test_loss"]


def test_a_frozen_trainer_node_ends_the_ps_node_within_the_rpc_timeout(text_dir):
    """Two torchrun nodes on loopback, the ps on node 0; once training runs, the trainer's node freezes (its agent and
    its worker stopped with SIGSTOP). The ps, which asks the trainer every half second whether it is done
    (common.serve), finds it silent after --rpc-timeout and ends with the script's one line, and node 0's torchrun
    reports the failure and exits: rpc.shutdown alone would have the ps wait for the trainer forever."""
    port = free_port()
    nodes = [subprocess.Popen(torchrun_command("--nnodes", 2, "--node-rank", rank, "--nproc-per-node", 1,
                                               "--master-addr", "127.0.0.1", "--master-port", port, "rpc_rnn.py",
                                               "--data-dir", text_dir, "--epochs", 50, "--log-interval", 1,
                                               "--rpc-timeout", 10, *SMALL),
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    frozen = []
    try:
        wait_for_line(nodes[1], "ms/batch", timeout=120)  # the trainer is training
        frozen = [psutil.Process(nodes[1].pid), *psutil.Process(nodes[1].pid).children(recursive=True)]
        for process in frozen:
            process.suspend()
        stopped_at = time.monotonic()
        _, stderr = nodes[0].communicate(timeout=120)
        ended_after = time.monotonic() - stopped_at
    finally:
        kill_all(*nodes, pids=[process.pid for process in frozen])
    assert nodes[0].returncode != 0, stderr[-3000:]
    lost = [line for line in stderr.splitlines() if "lost a peer" in line]
    assert len(lost) == 1 and lost[0].startswith("process 0 lost a peer (") and "RPC ran for more than" in lost[0], \
        stderr[-3000:]
    # the ping's 10 s, up to half a second to the next ping, then torchrun's report and exit; 20 s more leave room
    # for a loaded machine
    assert 10 <= ended_after < 10 + 0.5 + 20, ended_after


def test_a_diverged_run_reports_its_perplexity_as_null_not_a_capped_number(text_dir):
    """--lr 1e6 drives the loss to thousands, whose exp overflows a float: the result line's perplexities are null
    (strict JSON), the losses as they were."""
    proc = run_script("rpc_rnn.py", "--data-dir", text_dir, "--epochs", 1, "--max-batches", 5, "--lr", "1e6", *SMALL,
                      timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = last_json(proc.stdout)
    assert result["valid_loss"] > 700 and result["valid_ppl"] is None and result["test_ppl"] is None, result
    assert "ppl inf" in proc.stdout


def trainer_of(agent):
    """The torchrun worker with RANK 1 under the agent process, or None (between two groups, or once it has ended)."""
    for child in psutil.Process(agent.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == "1":
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return None


def test_torchrun_restarts_after_killed_trainers_end_with_the_uninterrupted_losses(trained, text_dir, tmp_path):
    """torchrun --max-restarts: the trainer is killed after the first batch of epoch 2, and again once the resumed
    epoch 2 trains; each time the group restarts, resumes from the last checkpoint, and the run ends with the losses
    of the uninterrupted one (with dropout: the masks of a resumed epoch are those of the uninterrupted run). The test
    reads the output while the run goes on, a line per batch (the losses do not depend on --log-interval), so on a
    loaded machine a kill can land after epoch 2's checkpoint: the group then resumes past the last epoch and trains
    nothing, and there is no second kill. After the first batch's line, 19 batches, the validation and the test are
    left before the trainer ends: time for a loaded machine to read the line."""
    agent = subprocess.Popen(torchrun_command("--standalone", "--nproc-per-node", 2, "--max-restarts", 3,
                                              "--monitor-interval", 0.1, "rpc_rnn.py", "--data-dir", text_dir, *TRAIN,
                                              "--log-interval", 1, "--checkpoint-dir", tmp_path, "--resume"),
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_line(agent, "epoch 2 | batch 1/20", timeout=120)
        trainer = trainer_of(agent)
        if trainer is None:  # what torchrun and the processes said says why
            kill_all(agent)
            pytest.fail(f"no trainer under torchrun after epoch 2's first batch; its stderr:\n"
                        f"{agent.stderr.read()[-3000:]}\nthe rest of its stdout:\n{agent.stdout.read()[-3000:]}")
        trainer.kill()
        resumes = [wait_for_line(agent, "resuming at", timeout=120)]
        if resumed_epoch(resumes[0]) == 2:
            wait_for_line(agent, "ms/batch", timeout=120)
            with contextlib.suppress(psutil.NoSuchProcess):  # unless the trainer has just ended
                if (trainer := trainer_of(agent)) is not None:
                    trainer.kill()
                    resumes.append(wait_for_line(agent, "resuming at", timeout=120))
        rest, stderr = agent.communicate(timeout=180)
    finally:
        kill_all(agent)
    assert agent.returncode == 0, stderr[-3000:]
    # each restarted group resumed from a checkpoint (epoch 1's, or epoch 2's): progress was kept, not started again
    assert all(2 <= resumed_epoch(line) <= 3 for line in resumes), resumes
    result = last_json(rest)
    assert result["losses"] == trained["result"]["losses"]
    assert result["test_loss"] == trained["result"]["test_loss"]


def resumed_epoch(line):
    """The epoch in rpc_rnn's `resuming at epoch E from PATH` line."""
    return int(re.search(r"resuming at epoch (\d+) from", line)[1])


# --- Bad input: one line, exit status 2, before the data are read, any process starts or anything is written ---

def write_text(folder, **texts):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (folder / f"{name}.txt").write_bytes(text if isinstance(text, bytes) else text.encode())
    return folder


def corpus_like(text_dir, folder, **replaced):
    """A copy of the text slice with some files replaced (bytes or str), or made folders (None)."""
    texts = {name: (text_dir / f"{name}.txt").read_bytes() for name in ("train", "valid", "test")}
    texts.update({name: text for name, text in replaced.items() if text is not None})
    write_text(folder, **texts)
    for name in (name for name, text in replaced.items() if text is None):
        (folder / f"{name}.txt").unlink()
        (folder / f"{name}.txt").mkdir()
    return folder


def damaged(source, target):
    """A copy of a checkpoint with one byte of its largest tensor flipped: the zip's CRC no longer matches, though
    torch.load would read the file happily."""
    data = bytearray(source.read_bytes())
    with zipfile.ZipFile(source) as archive:
        record = max(archive.infolist(), key=lambda info: info.file_size)
    name_length, extra_length = struct.unpack("<HH", data[record.header_offset + 26:record.header_offset + 30])
    data[record.header_offset + 30 + name_length + extra_length + record.file_size // 2] ^= 0xFF
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    return target


def resaved(source, target, change):
    """A copy of a checkpoint with change(contents) applied, written through common.save_checkpoint: verified as
    sound, with contents that do not fit."""
    saved = torch.load(source, weights_only=True)
    change(saved)
    target.parent.mkdir(parents=True, exist_ok=True)
    common.save_checkpoint(target, saved.pop("script"), saved)
    return target


def other_shape(state, name):
    state[name] = torch.zeros(state[name].shape[0] + 1, *state[name].shape[1:])


def bad(argv, fragment, env=None, reads_data=False):
    """One bad invocation: the flags, a fragment of the one line, the launcher variables set by hand, and whether
    its rule can only be checked once the text is read (every other rule holds before any data are read)."""
    return {"argv": [str(arg) for arg in argv], "fragment": fragment, "env": env or {}, "reads_data": reads_data}


TORCHRUN_ENV = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500"}


def bad_invocations(text_dir, trained, tmp):
    """{case: bad(...)}; every file a case needs is made under tmp."""
    data = ["--data-dir", text_dir]
    resume_dir = tmp / "resume"
    resume_dir.mkdir()
    shutil.copy(trained["checkpoint"], resume_dir / "rpc_rnn.pt")
    resume = [*data, *TRAIN, "--checkpoint-dir", resume_dir, "--resume"]
    in_dir = lambda name, change: [*data, *TRAIN, "--resume", "--checkpoint-dir", resaved(  # noqa: E731
        trained["checkpoint"], tmp / name / "rpc_rnn.pt", change).parent]
    truncated = tmp / "truncated.pt"
    truncated.write_bytes(trained["save"].read_bytes()[:5000])
    garbage = tmp / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    other_script = tmp / "multi_gpu.pt"
    common.save_checkpoint(other_script, "multi_gpu", {"model": {}, "vocab": [], "config": {}})
    (tmp / "a-file").write_text("x")
    (tmp / "empty-folder").mkdir()
    generate = ["--generate", "5", "--load"]
    return {
        # numbers out of range, or not numbers at all: argparse's own line
        "bptt-zero": bad([*data, "--bptt", "0"], "argument --bptt: '0' is not a whole number, 1 or more"),
        "batch-size-negative": bad([*data, "--batch-size", "-1"], "argument --batch-size: '-1' is not a whole number"),
        "lr-nan": bad([*data, "--lr", "nan"], "argument --lr: 'nan' is not a positive number"),
        "clip-inf": bad([*data, "--clip", "inf"], "argument --clip: 'inf' is not a positive number"),
        "rpc-timeout-with-a-unit": bad([*data, "--rpc-timeout", "10m"], "argument --rpc-timeout: '10m' is not a "
                                                                         "positive number"),
        "seed-negative": bad([*data, "--seed", "-1"], "argument --seed: '-1' is not a seed"),
        "max-batches-fraction": bad([*data, "--max-batches", "1.5"], "argument --max-batches: '1.5' is not a whole"),
        "generate-zero": bad([*generate, trained["save"], "--generate", "0"], "argument --generate: '0' is not a "
                                                                               "whole number"),
        "temperature-zero": bad([*generate, trained["save"], "--temperature", "0"], "argument --temperature: '0' is "
                                                                                     "not a positive number"),
        "temperature-below-the-floor": bad([*generate, trained["save"], "--temperature", "1e-320"],
                                           "--temperature 1e-320: below word_language_model's floor, 1e-3"),
        "dropout-one": bad([*data, "--dropout", "1"], "--dropout 1.0: not from 0 up to, not including, 1"),
        "dropout-negative": bad([*data, "--dropout", "-0.1"], "--dropout -0.1: not from 0"),
        # flags that do not go together, folders that cannot be made, files that are not there
        "resume-without-checkpoint-dir": bad([*data, "--resume"], "--resume needs --checkpoint-dir"),
        "load-without-generate": bad([*data, "--load", trained["save"]], "pass both or neither"),
        "generate-without-load": bad(["--generate", "5"], "pass both or neither"),
        "check-gradients-with-dropout": bad([*data, "--check-gradients"], "--check-gradients needs --dropout 0"),
        "cuda-without-gpu": bad([*data, "--cuda"], "no GPU found"),
        "checkpoint-dir-under-a-file": bad([*data, "--checkpoint-dir", tmp / "a-file" / "ckpt"],
                                           "cannot create this folder (Not a directory)"),
        "load-missing": bad([*generate, tmp / "nothing.pt"], "no such file"),
        "save-is-a-folder": bad([*data, "--save", tmp / "empty-folder"], f"--save {tmp}/empty-folder: is a folder; "
                                                                           f"name a file"),
        # launcher variables set by hand: checked whole, before the 2M-word corpus is read
        "rank-without-master-addr": bad(data, "MASTER_ADDR not set",
                                        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                         "MASTER_PORT": "29500"}),
        "rank-world-size-local-rank-only": bad(data, "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set",
                                               {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}),
        "rank-not-below-world-size": bad(data, "want ranks below their sizes", {**TORCHRUN_ENV, "RANK": "2"}),
        "three-processes": bad(data, "exactly 2 processes", {**TORCHRUN_ENV, "WORLD_SIZE": "3",
                                                               "LOCAL_WORLD_SIZE": "3"}),
        # files whose contents are not a checkpoint of this script, or do not fit the model they are loaded into
        "load-garbage": bad([*generate, garbage], "not a readable checkpoint"),
        "load-truncated": bad([*generate, truncated], "not a readable checkpoint"),
        "load-of-another-script": bad([*generate, other_script], "not written by rpc_rnn.py"),
        "load-damaged": bad([*generate, damaged(trained["save"], tmp / "damaged-save.pt")], "damaged"),
        "load-weights-that-do-not-fit-their-config": bad(
            [*generate, resaved(trained["save"], tmp / "other-config.pt", lambda saved: saved["config"].update(
                nhid=64))], "does not fit this model"),
        "resume-damaged": bad([*data, *TRAIN, "--resume", "--checkpoint-dir",
                               damaged(trained["checkpoint"], tmp / "damaged" / "rpc_rnn.pt").parent], "damaged"),
        "resume-another-recipe": bad([*resume, "--emsize", "64"], "written with --emsize 48"),
        "resume-fewer-epochs-than-done": bad([*resume, "--epochs", "1"], f"--resume {resume_dir}/rpc_rnn.pt: holds 2 "
                                             f"epochs, more than --epochs 1; pass a larger one"),
        "resume-another-version": bad(in_dir("old", lambda saved: saved.pop("run")), "lacks run"),
        "resume-weights-that-do-not-fit": bad(in_dir("misfit", lambda saved: other_shape(
            saved["model"], "rnn.weight_hh_l0")), "does not fit this model"),
        # data that are missing, unreadable or too short (these rules need the text)
        "no-data-offline": bad(["--data-dir", tmp / "empty-folder"], "cannot download train.txt", reads_data=True),
        "train-txt-is-a-folder": bad(["--data-dir", corpus_like(text_dir, tmp / "folder", train=None)],
                                     "cannot download train.txt", reads_data=True),
        "empty-corpus": bad(["--data-dir", corpus_like(text_dir, tmp / "empty", test="\n\n")],
                            "test.txt has 2 tokens, too few for 10 streams of 2 words or more; pass more text",
                            reads_data=True),
        "one-line-corpus": bad(["--data-dir", corpus_like(text_dir, tmp / "one-line", train="just one line\n")],
                               "train.txt has 4 tokens, too few for 20 streams of 2 words or more; pass more text "
                               "or a smaller --batch-size", reads_data=True),
        "not-utf8": bad(["--data-dir", corpus_like(text_dir, tmp / "latin1", valid=b"caf\xe9\n")], "not UTF-8 text",
                        reads_data=True),
        "resume-another-text": bad([*resume, "--data-dir", corpus_like(text_dir, tmp / "other", train="a b c\n" * 99)],
                                   "written for another text", reads_data=True),
    }


BAD_CASES = [
    "bptt-zero", "batch-size-negative", "lr-nan", "clip-inf", "rpc-timeout-with-a-unit", "seed-negative",
    "max-batches-fraction", "generate-zero", "temperature-zero", "temperature-below-the-floor", "dropout-one",
    "dropout-negative",
    "resume-without-checkpoint-dir", "load-without-generate", "generate-without-load", "check-gradients-with-dropout",
    "cuda-without-gpu", "checkpoint-dir-under-a-file", "load-missing", "save-is-a-folder", "rank-without-master-addr",
    "rank-world-size-local-rank-only", "rank-not-below-world-size", "three-processes", "load-garbage",
    "load-truncated", "load-of-another-script", "load-damaged", "load-weights-that-do-not-fit-their-config",
    "resume-damaged", "resume-another-recipe", "resume-fewer-epochs-than-done", "resume-another-version",
    "resume-weights-that-do-not-fit", "no-data-offline", "train-txt-is-a-folder", "empty-corpus", "one-line-corpus",
    "not-utf8", "resume-another-text",
]


@pytest.fixture(scope="module")
def bad_inputs(text_dir, trained, tmp_path_factory):
    """The folder holding every file the bad invocations name, made once, and the invocations."""
    folder = tmp_path_factory.mktemp("bad-inputs")
    cases = bad_invocations(text_dir, trained, folder)
    assert sorted(cases) == sorted(BAD_CASES)  # every case of the table is run
    return folder, cases


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_is_one_line_exit_2_before_anything_is_read_started_or_written(case, bad_inputs, monkeypatch,
                                                                                  capsys):
    """Through main() in this process (a subprocess per case would cost seconds of imports each; the next test runs
    cases end to end): the data are not read unless the rule needs them, no process is started, nothing is written
    and nothing is left running."""
    if case == "cuda-without-gpu":
        monkeypatch.setattr(torch.accelerator, "device_count", lambda: 0)  # on a GPU machine too
    folder, cases = bad_inputs
    invocation = cases[case]
    for name in common.TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in {**OFFLINE, **invocation["env"]}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.multiprocessing, "spawn", lambda *args, **kwargs: pytest.fail("a process was started"))
    if not invocation["reads_data"]:
        monkeypatch.setattr(rpc_rnn, "wikitext2_dir", lambda *args: pytest.fail("the data were read before the check"))
    running, before = psutil.Process().children(recursive=True), tree(folder)
    with pytest.raises(SystemExit) as exit_info:
        common.run_main(lambda: rpc_rnn.main(invocation["argv"]))
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and invocation["fragment"] in lines[0] and captured.out == "", (invocation, captured)
    assert tree(folder) == before
    assert psutil.Process().children(recursive=True) == running


@pytest.mark.parametrize("args, env, fragment", [
    (["--lr", "nan"], {}, "argument --lr: 'nan' is not a positive number"),
    (["--bptt", "0"], {}, "argument --bptt: '0' is not a whole number"),
    # set by hand, without MASTER_ADDR: said before the data are read (an empty --data-dir offline would say
    # "cannot download" first)
    ([], {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "29500"},
     "MASTER_ADDR not set"),
])
def test_bad_input_end_to_end(args, env, fragment, tmp_path):
    env = {**OFFLINE, **env, **({} if "MASTER_ADDR" in env else {"MASTER_ADDR": ""})}
    proc = run_script("rpc_rnn.py", "--data-dir", tmp_path, *args, timeout=60, env=env)
    assert_usage_error(proc, fragment)
    assert list(tmp_path.iterdir()) == []


# --- GPUs ---

@needs_gpus(1)
def test_distributed_gradients_on_gpus_equal_one_cpu_process(text_dir):
    """The ps and the trainer on GPUs (sharing one on a one-GPU machine), IEEE float32: the CUDA streams of the
    RPC handlers are ordered, so clipping and the optimizer see the finished gradients. The GPU's kernels round
    differently from the CPU's (gradients differ by ~3e-7); lr 1 keeps the weights' difference on that scale
    (with lr 20 it is 20 times the gradients'), while a clipping that missed the update would still show."""
    proc = run_script("rpc_rnn.py", "--data-dir", text_dir, "--cuda", "--check-gradients", "--dropout", "0",
                      "--clip", "0.05", "--lr", "1", "--max-batches", "3", *SMALL, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = last_json(proc.stdout)
    assert result["batches"] == 3 and min(result["grad_norms"]) > 0.05, result
    assert max(result["norm_diff"], result["max_param_diff"], result["loss_diff"]) <= 1e-5, result


@needs_gpus(1)
def test_two_processes_share_one_gpu_and_learn(text_dir):
    proc = run_script("rpc_rnn.py", "--data-dir", text_dir, *TRAIN, "--cuda", timeout=180,
                      env={"CUDA_VISIBLE_DEVICES": first_visible_gpu()})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = last_json(proc.stdout)
    assert result["devices"] == {"ps": "cuda:0", "trainer": "cuda:0"}, result
    assert mean(result["losses"][-10:]) < mean(result["losses"][:10]) - 0.5, result
