"""Tokens/s of the LSTM language model three ways, side by side in one run on the same text slice and settings:

  local        LocalRNNModel in this one process (all cores), SGD + clip_grad_norm_, the same math as rpc_rnn.py
  loss-on-ps   rpc_rnn.py: ps (embedding, decoder, loss) + trainer (LSTM), 2 processes
  ship-logits  rpc_rnn.py --ship-logits: the tutorial's path, the ps sends the logits back to the trainer

The model and vocabulary are smaller than the classic recipe so that a 2-core machine measures the RPC design
rather than a minute per configuration: the vocabulary is that of the first --lines lines of WikiText-2's
train.txt.

    python benchmarks/bench_rpc_rnn.py --data-dir DATA     # DATA: WikiText-2 or its parent; downloaded if absent
Each round measures the three one after the other; the best of --repeats rounds is reported.
Last line: one JSON object with the three figures and the two ratios.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import common  # noqa: E402
import rpc_rnn  # noqa: E402


def write_slice(source, target, lines):
    for name, count in (("train.txt", lines), ("valid.txt", max(20, lines // 10)), ("test.txt", max(20, lines // 10))):
        with open(source / name, encoding="utf-8") as handle:
            (target / name).write_text("".join(line for _, line in zip(range(count), handle)), encoding="utf-8")


def local_tokens_per_s(folder, args):
    """The training loop of rpc_rnn.py with every piece in this process; timed like the script times it."""
    torch.manual_seed(args.seed)
    corpus = rpc_rnn.Corpus(folder)
    model = rpc_rnn.LocalRNNModel(len(corpus.words), args.emsize, args.nhid, 2, 0.2, args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=20.0)
    data = rpc_rnn.batchify(corpus.train, args.batch_size, "cpu")
    hidden = rpc_rnn.init_hidden(model.rnn, args.batch_size)
    model.train()
    tokens, start = 0, time.perf_counter()
    for batch in range(args.batches):
        input, targets = rpc_rnn.get_batch(data, (batch * args.bptt) % (data.size(0) - args.bptt - 1), args.bptt)
        hidden = rpc_rnn.detach_hidden(hidden)
        optimizer.zero_grad()
        loss, hidden = model.loss(input, targets, hidden)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        optimizer.step()
        tokens += targets.numel()
    return tokens / (time.perf_counter() - start), len(corpus.words)


def distributed_tokens_per_s(folder, args, *extra):
    proc = subprocess.run(
        [sys.executable, str(REPO / "rpc_rnn.py"), "--data-dir", str(folder), "--epochs", "1",
         "--max-batches", str(args.batches), "--log-interval", str(args.batches), "--emsize", str(args.emsize),
         "--nhid", str(args.nhid), "--batch-size", str(args.batch_size), "--bptt", str(args.bptt),
         "--seed", str(args.seed), *extra], capture_output=True, text=True, timeout=600, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"rpc_rnn.py {' '.join(extra)} failed:\n{proc.stderr[-3000:]}")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)["tokens_per_s"]
    raise SystemExit(f"no result line from rpc_rnn.py:\n{proc.stdout[-2000:]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=None, help="folder holding WikiText-2 (or its parent)")
    parser.add_argument("--lines", type=int, default=2000, help="lines of train.txt to use (sets the vocabulary)")
    parser.add_argument("--batches", type=int, default=60, help="training batches per measurement")
    parser.add_argument("--emsize", type=int, default=128)
    parser.add_argument("--nhid", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--seed", type=int, default=1111)
    parser.add_argument("--repeats", type=int, default=2,
                        help="rounds of the three measurements, interleaved; the best of each is reported, the one "
                             "least disturbed by other work on the machine")
    args = parser.parse_args()
    source = rpc_rnn.wikitext2_dir(args.data_dir)
    with tempfile.TemporaryDirectory(prefix="bench-rpc-rnn-") as tmp:
        folder = Path(tmp)
        write_slice(source, folder, args.lines)
        rounds = []
        for _ in range(args.repeats):
            local, ntoken = local_tokens_per_s(folder, args)
            rounds.append((local, distributed_tokens_per_s(folder, args),
                           distributed_tokens_per_s(folder, args, "--ship-logits")))
            print("round: local {:.0f} | loss on ps {:.0f} | ship logits {:.0f} tokens/s".format(*rounds[-1]),
                  flush=True)
        local, loss_on_ps, ship_logits = (max(column) for column in zip(*rounds))
    print(f"vocab {ntoken} | emsize {args.emsize} | nhid {args.nhid} | batch {args.batch_size} x bptt {args.bptt} | "
          f"{args.batches} batches | best of {args.repeats} rounds | {common.usable_cpus()} CPUs")
    print(f"local (1 process)         {local:9.0f} tokens/s")
    print(f"loss on ps (2 processes)  {loss_on_ps:9.0f} tokens/s | {loss_on_ps / local:.2f}x local")
    print(f"ship logits (tutorial)    {ship_logits:9.0f} tokens/s | {ship_logits / local:.2f}x local | "
          f"loss on ps is {loss_on_ps / ship_logits:.2f}x ship logits")
    common.emit_result("bench_rpc_rnn", vocab=ntoken, local_tokens_per_s=local, loss_on_ps_tokens_per_s=loss_on_ps,
                       ship_logits_tokens_per_s=ship_logits, loss_on_ps_vs_local=loss_on_ps / local,
                       loss_on_ps_vs_ship_logits=loss_on_ps / ship_logits)


if __name__ == "__main__":
    main()
