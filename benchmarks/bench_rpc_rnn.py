"""Benchmark rpc_rnn.py: tokens/s of the model split over the ps and the trainer, against the same model in one
process, on the same text, settings and device.

    python benchmarks/bench_rpc_rnn.py                                    # a slice of WikiText-2, CPU
    python benchmarks/bench_rpc_rnn.py --cuda --lines 0 --emsize 200 --nhid 200   # the recipe, GPU

The data come from DATA_DIR where it is set, else from the download cache. Three ways, one after the other in each
round; the median of --rounds rounds (3), with the smallest and the largest:
- one process: LocalRNNModel, word_language_model's loop (SGD, clip_grad_norm_), every core, the same math;
- loss on the ps: `rpc_rnn.py` (the ps holds the embedding, the decoder and the loss; the trainer the LSTM);
- ship logits: `rpc_rnn.py --ship-logits`, the tutorial's path (the ps sends the logits back to the trainer).
With --lines N the vocabulary is that of the first N lines of train.txt, so that a 2-core machine measures the RPC
design rather than a 33,278-word softmax (--lines 0: the whole text).

Writes results/rpc_rnn.json (rpc_rnn_cuda.json with --cuda).
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from harness import REPO, check_committed, run_script, spread, write_result

sys.path.insert(0, str(REPO))
import rpc_rnn  # noqa: E402


def one_process(folder, args, device):
    """rpc_rnn.py's training loop with every piece in this process, timed as the script times it."""
    corpus = rpc_rnn.Corpus(folder)
    model = rpc_rnn.LocalRNNModel(len(corpus.words), args.emsize, args.nhid, 2, 0.2, 1111).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=20.0)
    windows = rpc_rnn.windows(rpc_rnn.batchify(corpus.train, 20, device), 35, args.batches)
    hidden = rpc_rnn.init_hidden(model.rnn, 20, device)
    started, tokens = time.perf_counter(), 0
    for input, targets in windows:
        optimizer.zero_grad()
        loss, hidden = model.loss(input, targets, rpc_rnn.detach_hidden(hidden))
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        optimizer.step()
        loss.item()  # as the script does: the loss of every batch, which waits for the step on a GPU
        tokens += targets.numel()
    return tokens / (time.perf_counter() - started), len(corpus.words)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=2000, help="lines of train.txt (0: all)")
    parser.add_argument("--batches", type=int, default=60, help="training batches per measurement")
    parser.add_argument("--emsize", type=int, default=128)
    parser.add_argument("--nhid", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cuda", action="store_true", help="on GPU 0 (rpc_rnn.py --cuda)")
    args = parser.parse_args()
    check_committed()
    source = rpc_rnn.wikitext2_dir(os.environ.get("DATA_DIR"))
    device = torch.device("cuda", 0) if args.cuda else torch.device("cpu")
    with tempfile.TemporaryDirectory() as folder:
        for name in rpc_rnn.WIKITEXT2_FILES:
            lines = Path(source, name).read_text(encoding="utf-8").splitlines(keepends=True)
            count = args.lines if name == "train.txt" else max(20, args.lines // 10)
            Path(folder, name).write_text("".join(lines[:count] if args.lines else lines), encoding="utf-8")
        flags = ["rpc_rnn.py", "--data-dir", folder, "--epochs", 1, "--max-batches", args.batches, "--log-interval",
                 args.batches, "--emsize", args.emsize, "--nhid", args.nhid, *(["--cuda"] if args.cuda else [])]
        rounds = []
        for _ in range(args.rounds):
            local, ntoken = one_process(folder, args, device)
            rounds.append([local, run_script(flags, 1800)[0]["tokens_per_s"],
                           run_script([*flags, "--ship-logits"], 1800)[0]["tokens_per_s"]])
            print("one process {:.0f} | loss on the ps {:.0f} | ship logits {:.0f} tokens/s".format(*rounds[-1]))
    ways = ("one process", "ps + trainer, loss on the ps", "ps + trainer, logits shipped (the tutorial's)")
    rows = [[way, spread([run[index] for run in rounds]), spread([run[index] / run[0] for run in rounds], 3)]
            for index, way in enumerate(ways)]
    write_result("rpc_rnn_cuda" if args.cuda else "rpc_rnn", {f"Tokens/s ({device.type})": {
        "columns": ["model", "tokens/s", "vs one process (per round)"], "rows": rows}},
        f"Vocabulary {ntoken} words, emsize {args.emsize}, nhid {args.nhid}, batch 20 x bptt 35, {args.batches} "
        f"batches; {args.rounds} rounds: median (smallest–largest).")


if __name__ == "__main__":
    main()
