"""Test perplexity of rpc_rnn.py's default recipe against the same model trained in one process.

    python benchmarks/bench_rpc_rnn_recipe.py --data-dir DATA --cuda          # 6 epochs each
    python benchmarks/bench_rpc_rnn_recipe.py --data-dir DATA --cuda --at-once

The one-process run is pytorch/examples' word_language_model loop (main.py: train, evaluate, keep the model
with the best valid loss, divide lr by 4 when it did not improve, test the kept model) on rpc_rnn.LocalRNNModel, the
same LSTM model with the same initial weights and recipe (emsize 200, nhid 200, 2 layers, dropout 0.2, batch 20,
bptt 35, lr 20, clip 0.25). The distributed run is `rpc_rnn.py --epochs N`. --at-once runs both at the same time
(their perplexities are unaffected; their times are then not comparable). Prints test perplexity and seconds
per epoch of each and their ratio, then one JSON line.
"""

import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import common  # noqa: E402
import rpc_rnn  # noqa: E402


@dataclasses.dataclass
class Args:
    epochs: int = 6
    """epochs of each run"""
    cuda: bool = False
    """train on GPU 0 (the distributed run: ps and trainer on the machine's GPUs)"""
    at_once: bool = False
    """run the two at the same time (saves time; their seconds per epoch then disturb each other)"""
    data_dir: Optional[str] = None
    """folder with WikiText-2 (or its parent)"""
    seed: int = 1111
    """seed of both runs"""


RECIPE = rpc_rnn.Args()  # the script's defaults are the classic recipe


def one_process(corpus, args, device):
    """word_language_model's training loop; returns (test perplexity, seconds per epoch)."""
    torch.manual_seed(args.seed)
    model = rpc_rnn.LocalRNNModel(len(corpus.words), RECIPE.emsize, RECIPE.nhid, RECIPE.nlayers, RECIPE.dropout,
                             args.seed).to(device)
    train_data = rpc_rnn.batchify(corpus.train, RECIPE.batch_size, device)
    valid_data = rpc_rnn.batchify(corpus.valid, rpc_rnn.EVAL_BATCH_SIZE, device)
    test_data = rpc_rnn.batchify(corpus.test, rpc_rnn.EVAL_BATCH_SIZE, device)
    lr, best_valid, best_state, seconds = RECIPE.lr, math.inf, None, []
    for _ in range(args.epochs):
        start = time.perf_counter()
        model.train()
        hidden = rpc_rnn.init_hidden(model.rnn, RECIPE.batch_size, device)
        for i in range(0, train_data.size(0) - 1, RECIPE.bptt):
            input, targets = rpc_rnn.get_batch(train_data, i, RECIPE.bptt)
            hidden = rpc_rnn.detach_hidden(hidden)
            model.zero_grad()
            loss, hidden = model.loss(input, targets, hidden)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), RECIPE.clip)
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(param.grad, alpha=-lr)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        valid_loss = rpc_rnn.evaluate(model, valid_data, RECIPE.bptt)
        if valid_loss < best_valid:
            best_valid, best_state = valid_loss, {k: v.clone() for k, v in model.state_dict().items()}
        else:
            lr /= 4
    model.load_state_dict(best_state)
    test_loss = rpc_rnn.evaluate(model, test_data, RECIPE.bptt)
    return math.exp(test_loss), sorted(seconds)[len(seconds) // 2]


def start_distributed(args, folder):
    command = [sys.executable, str(REPO / "rpc_rnn.py"), "--data-dir", str(folder), "--epochs", str(args.epochs),
               "--seed", str(args.seed)] + (["--cuda"] if args.cuda else [])
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


def distributed_result(proc):
    out, err = proc.communicate(timeout=6 * 3600)
    if proc.returncode != 0:
        raise SystemExit(f"rpc_rnn.py failed:\n{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    epoch_seconds = sorted(float(line.split("|")[-1].split()[0]) for line in out.splitlines()
                           if "valid ppl" in line)
    return result["test_ppl"], epoch_seconds[len(epoch_seconds) // 2]


def main():
    args = common.parse_args(Args)
    common.check(args.epochs > 0, "--epochs must be positive")
    common.check(not args.cuda or torch.cuda.device_count() > 0, "--cuda: no GPU found; run without --cuda")
    folder = rpc_rnn.wikitext2_dir(args.data_dir)
    corpus = rpc_rnn.Corpus(folder)
    device = torch.device("cuda", 0) if args.cuda else torch.device("cpu")
    if args.at_once:
        proc = start_distributed(args, folder)
        local = one_process(corpus, args, device)
        distributed = distributed_result(proc)
    else:
        local = one_process(corpus, args, device)
        distributed = distributed_result(start_distributed(args, folder))
    where = torch.cuda.get_device_name(device) if args.cuda else f"CPU ({common.usable_cpus()} cores)"
    print(f"{where} | {args.epochs} epochs of the default recipe | vocabulary {len(corpus.words)}"
          + (" | both at once" if args.at_once else ""))
    print(f"one process (word_language_model loop) | test ppl {local[0]:7.1f} | {local[1]:6.1f} s/epoch")
    print(f"rpc_rnn.py, ps + trainer               | test ppl {distributed[0]:7.1f} | {distributed[1]:6.1f} s/epoch | "
          f"{distributed[1] / local[1]:.2f}x the one process's time" + (" (not comparable: at once)" if args.at_once
                                                                       else ""))
    common.emit_result("bench_rpc_rnn_recipe", device=where, epochs=args.epochs, at_once=args.at_once,
                       local_test_ppl=local[0], local_s_per_epoch=local[1], test_ppl=distributed[0],
                       s_per_epoch=distributed[1], s_per_epoch_vs_local=distributed[1] / local[1])


if __name__ == "__main__":
    common.run_main(main)
