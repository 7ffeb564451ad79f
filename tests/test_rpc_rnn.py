"""rpc_rnn.py on a slice of WikiText-2: the loss falls, distributed gradients equal one-process gradients (with
clipping), a checkpoint gathered from both processes loads into the plain model and generates text, the loss on
the ps equals the tutorial's logits path, and failures end the run promptly with the right exit status."""

import math
import sys
import time

import psutil
import pytest
import torch

import common
import rpc_rnn
from conftest import (
    assert_all_ended,
    assert_usage_error,
    data_root,
    first_visible_gpu,
    last_json,
    needs_gpus,
    run_script,
    spawned_workers,
    start_script,
    wait_for_line,
)

# Small enough for seconds per run on 2 cores, large enough that the loss has something to learn.
SMALL = ["--emsize", "48", "--nhid", "48", "--batch-size", "10", "--bptt", "20"]


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    """The first lines of WikiText-2's train/valid/test.txt (vocabulary of a few thousand words)."""
    source = common.wikitext2_dir(data_root())
    folder = tmp_path_factory.mktemp("wikitext-slice")
    for name, lines in (("train.txt", 300), ("valid.txt", 40), ("test.txt", 40)):
        with open(source / name, encoding="utf-8") as handle:
            (folder / name).write_text("".join(line for _, line in zip(range(lines), handle)), encoding="utf-8")
    return folder


TRAIN = ["--epochs", "2", "--max-batches", "20", "--log-interval", "10", *SMALL]


@pytest.fixture(scope="module")
def trained(text_dir, tmp_path_factory):
    """One default (loss-on-ps) run that saves a checkpoint; several tests read it."""
    checkpoint = tmp_path_factory.mktemp("checkpoint") / "lm.pt"
    proc = run_script("rpc_rnn.py", "--data-dir", text_dir, *TRAIN, "--save", checkpoint, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, last_json(proc.stdout), checkpoint


def test_loss_falls_and_logs(trained):
    proc, result, _ = trained
    assert result["mode"] == "loss-on-ps" and result["batches"] == 40
    assert result["last_loss"] < result["first_loss"] - 0.5, result
    # Better than guessing uniformly over the vocabulary, on held-out text.
    assert result["valid_ppl"] < result["ntoken"] / 2 and result["test_ppl"] < result["ntoken"] / 2, result
    lines = proc.stdout.splitlines()
    train_lines = [line for line in lines if "ms/batch" in line]
    assert len(train_lines) == 4, proc.stdout
    for field in ("batch 10/20", "lr 20.00", "loss", "ppl", "tokens/s"):
        assert field in train_lines[0], train_lines[0]
    assert sum("valid ppl" in line for line in lines) == 2
    assert any(line.startswith("test loss") and "test ppl" in line for line in lines)


def test_checkpoint_loads_into_local_model_and_generates(trained, text_dir):
    _, result, checkpoint = trained
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    model = rpc_rnn.RNNModel(**saved["config"])
    model.load_state_dict(saved["model"])  # strict: every parameter of both processes is there
    corpus = rpc_rnn.Corpus(text_dir)
    assert saved["vocab"] == corpus.words
    # The one-process model scores the test text exactly as the distributed run did at its end.
    test_data = rpc_rnn.batchify(corpus.test, 10, "cpu")
    local_test_loss = rpc_rnn.evaluate(model, test_data, 20, 10, "cpu")
    assert abs(local_test_loss - result["test_loss"]) < 1e-4, (local_test_loss, result["test_loss"])

    proc = run_script("rpc_rnn.py", "--generate", 30, "--load", checkpoint, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert last_json(proc.stdout)["words"] == 30
    words = " ".join(line for line in proc.stdout.splitlines() if not line.startswith("{")).split()
    assert len(words) == 30 and set(words) <= set(corpus.words)


def test_ship_logits_gives_the_same_losses(trained, text_dir):
    _, result, _ = trained
    proc = run_script("rpc_rnn.py", "--data-dir", text_dir, *TRAIN, "--ship-logits", timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shipped = last_json(proc.stdout)
    assert shipped["mode"] == "ship-logits"
    # Same seed: same weights and dropout masks; only where the cross-entropy is computed differs.
    assert len(shipped["losses"]) == len(result["losses"]) == 40
    assert max(abs(a - b) for a, b in zip(shipped["losses"], result["losses"])) < 1e-4
    assert math.isclose(shipped["test_loss"], result["test_loss"], abs_tol=1e-4)


def test_distributed_gradients_equal_one_process_gradients(text_dir):
    # --clip 0.05 is below the gradient norm, so the global clipping across both processes is exercised, and
    # the weights after DistributedOptimizer's step prove the optimizer used the clipped gradients.
    proc = run_script("rpc_rnn.py", "--data-dir", text_dir, "--check-gradients", "--dropout", "0", "--clip", "0.05",
                      "--max-batches", "3", *SMALL, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = last_json(proc.stdout)
    assert result["batches"] == 3
    assert result["compared"] == len(list(rpc_rnn.RNNModel(10, 4, 4, 2, 0.0).parameters()))
    assert min(result["grad_norms"]) > 0.05, result  # clipping was active on every batch
    assert result["max_grad_diff"] <= 1e-5, result
    assert result["max_param_diff"] <= 1e-5, result
    assert result["loss_diff"] <= 1e-5, result


def test_ps_death_ends_the_run(text_dir):
    launcher = start_script("rpc_rnn.py", "--data-dir", text_dir, "--epochs", 50, "--log-interval", 1, *SMALL)
    try:
        wait_for_line(launcher, "ms/batch", timeout=90)  # the trainer is training
        workers = spawned_workers(launcher)
        assert len(workers) == 2, workers
        ps = workers[0]  # rank 0
        everyone = psutil.Process(launcher.pid).children(recursive=True)
        killed_at = time.monotonic()
        ps.kill()
        _, stderr = launcher.communicate(timeout=60)
        assert time.monotonic() - killed_at < 60
        assert launcher.returncode != 0
        # The launcher saw the ps (process 0) die, or the trainer's RPC to it failed first: either way the ps
        # was the process killed, and the trainer did not outlive it.
        assert ("process 0 terminated with signal SIGKILL" in stderr
                or ("process 1 failed" in stderr and "RPC" in stderr)), stderr[-2000:]
        assert_all_ended(everyone, timeout=10)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


@pytest.fixture
def empty_test_dir(text_dir, tmp_path):
    for name in ("train.txt", "valid.txt"):
        (tmp_path / name).write_text((text_dir / name).read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / "test.txt").write_text("\n\n", encoding="utf-8")
    return tmp_path


def bad_input_cases(text_dir, empty_test_dir, tmp_path):
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"not a checkpoint")
    return {
        "bptt": (["--data-dir", text_dir, "--bptt", "0"], "--bptt must be > 0"),
        "batch": (["--data-dir", text_dir, "--batch-size", "-1"], "--batch-size must be > 0"),
        "not-a-folder": (["--data-dir", text_dir / "train.txt"], "is not a folder"),
        "empty-file": (["--data-dir", empty_test_dir], "holds no words"),
        "no-load": (["--generate", "5"], "--load PATH"),
        "missing-load": (["--generate", "5", "--load", tmp_path / "nothing.pt"], "is not a file"),
        "corrupt-load": (["--generate", "5", "--load", corrupt], "cannot load checkpoint"),
        "check-dropout": (["--data-dir", text_dir, "--check-gradients"], "--dropout 0"),
        "cuda": (["--data-dir", text_dir, "--cuda"], "no CUDA GPU"),
    }


@pytest.mark.parametrize("case", ["bptt", "corrupt-load"])
def test_bad_input_is_one_line_exit_2(case, text_dir, empty_test_dir, tmp_path):
    args, fragment = bad_input_cases(text_dir, empty_test_dir, tmp_path)[case]
    assert_usage_error(run_script("rpc_rnn.py", *args, timeout=60), fragment)


@pytest.mark.parametrize("case", ["batch", "not-a-folder", "empty-file", "no-load", "missing-load", "check-dropout",
                                  "cuda"])
def test_bad_input_in_process(case, text_dir, empty_test_dir, tmp_path, monkeypatch, capsys):
    """The same checks, through main() in this process: every one of them fires before any worker starts, and
    a subprocess per case would cost seconds of torch imports each."""
    if case == "cuda" and common.cuda_device_count() > 0:
        pytest.skip("this machine has a GPU")
    args, fragment = bad_input_cases(text_dir, empty_test_dir, tmp_path)[case]
    monkeypatch.setattr(sys, "argv", ["rpc_rnn.py", *map(str, args)])
    with pytest.raises(SystemExit) as exit_info:
        common.run_main(rpc_rnn.main)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], lines


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
    assert max(result["max_grad_diff"], result["max_param_diff"], result["loss_diff"]) <= 1e-5, result


@needs_gpus(1)
def test_two_processes_share_one_gpu_and_learn(text_dir):
    proc = run_script("rpc_rnn.py", "--data-dir", text_dir, *TRAIN, "--cuda", timeout=180,
                      env={"CUDA_VISIBLE_DEVICES": first_visible_gpu()})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = last_json(proc.stdout)
    assert result["devices"] == {"ps": "cuda:0", "trainer": "cuda:0"}, result
    assert result["last_loss"] < result["first_loss"] - 0.5, result
