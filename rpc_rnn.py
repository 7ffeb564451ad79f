"""Model-parallel LSTM word language model over RPC: a parameter server and a trainer, trained on WikiText-2.

Part 2 of PyTorch's "Getting started with the distributed RPC framework", on real data. The model of
pytorch/examples' word_language_model (embedding -> 2-layer LSTM -> linear decoder) is cut in two processes.
Rank 0, the parameter server "ps", owns the embedding table and the decoder; rank 1, the "trainer", owns the LSTM
and drives training. The trainer creates the ps's modules with `rpc.remote` and calls them through their RRefs
(`rref.rpc_sync().forward(x)`) where a one-machine model-parallel version would call `.to(device)`. Backward
runs across both processes with `dist_autograd.backward` inside a `dist_autograd.context()`, and a distributed
optimizer applies SGD on each owner of parameters. Beyond the tutorial: the loss is computed on the ps (one number
comes back instead of the logits), gradients are clipped on their global norm over both processes,
--check-gradients compares everything with the same model in one process, and runs checkpoint and resume.

Commands (WikiText-2 is downloaded on first use; --data-dir DIR reads train/valid/test.txt from DIR instead):
    python rpc_rnn.py                                     # CPU, 2 processes, the classic recipe (40 epochs)
    python rpc_rnn.py --epochs 1 --max-batches 200 --emsize 64 --nhid 64      # about 2 minutes on 2 cores
    python rpc_rnn.py --cuda --epochs 6 --save lm.pt      # embedding + decoder on a GPU, LSTM on another (or the same)
    python rpc_rnn.py --generate 100 --load lm.pt         # sample 100 words in this process, no RPC
    python rpc_rnn.py --check-gradients --dropout 0 --clip 0.05 --emsize 32 --nhid 32    # distributed == 1 process
    python rpc_rnn.py --checkpoint-dir ckpt --resume      # checkpoints each epoch; run it again to continue
    torchrun --standalone --nproc-per-node 2 rpc_rnn.py
    torchrun --standalone --nproc-per-node 2 --max-restarts 3 rpc_rnn.py --checkpoint-dir ckpt --resume
    # two nodes (node rank 0 is the ps, 1 the trainer); MASTER_ADDR = node 0's address on a trusted network:
    torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 1 --master-addr $MASTER_ADDR --master-port 29400 \\
        rpc_rnn.py

Last lines of `python rpc_rnn.py --epochs 1 --max-batches 200 --emsize 64 --nhid 64` (1 min 49 s on 2 CPU cores,
more than half of it evaluating the full valid and test sets with the 33k-word decoder):
    epoch 1 | batch 200/200 | lr 20.00 | 226.7 ms/batch | loss 7.66 | ppl 2123.8 | 3.1k tokens/s
    epoch 1 | valid loss 7.27 | valid ppl 1439.7 | 45.4 s/epoch
    test loss 7.20 | test ppl 1339.1
    {"script": "rpc_rnn", "mode": "loss-on-ps", "ntoken": 33278, "batches": 200, "first_loss": 9.83, ...}
"""

import math
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn as nn
import torch.nn.functional as F
from torch import optim
from torch.distributed import rpc
from torch.nn.utils import skip_init

import common
from common import UsageError, check

PS_NAME = "ps"
TRAINER_NAME = "trainer"
SCRIPT = "rpc_rnn"


@dataclass
class Args:
    data_dir: Optional[str] = None
    """folder with train.txt, valid.txt, test.txt (or a wikitext-2/ subfolder holding them); downloaded when absent"""
    emsize: int = 200
    """size of the word embeddings"""
    nhid: int = 200
    """hidden units per LSTM layer"""
    nlayers: int = 2
    """number of LSTM layers"""
    dropout: float = 0.2
    """dropout on the embeddings, between LSTM layers and before the decoder"""
    batch_size: int = 20
    """training batch size (parallel text streams)"""
    eval_batch_size: int = 10
    """batch size for the valid and test sets"""
    bptt: int = 35
    """sequence length of one training window (backpropagation through time)"""
    lr: float = 20.0
    """initial SGD learning rate; divided by 4 after an epoch whose valid loss did not improve"""
    clip: float = 0.25
    """largest global gradient norm over all parameters, on both processes"""
    epochs: int = 40
    """number of passes over the training text"""
    max_batches: Optional[int] = None
    """stop each epoch after this many training batches (tiny runs)"""
    log_interval: int = 200
    """batches between two log lines of the trainer"""
    seed: int = 1111
    """random seed: the same seed gives the same weights in the distributed and the one-process model"""
    ship_logits: bool = False
    """tutorial's path: the ps returns the decoded logits and the trainer computes the loss"""
    save: Optional[str] = None
    """write the model with the best valid loss here: one file for the plain one-process RNNModel"""
    load: Optional[str] = None
    """checkpoint to sample from with --generate (written by --save, or a --checkpoint-dir checkpoint)"""
    generate: Optional[int] = None
    """sample this many words from the --load checkpoint in this process, then exit"""
    temperature: float = 1.0
    """sampling temperature for --generate (lower: more conservative text)"""
    check_gradients: bool = False
    """run --max-batches (default 2) batches both distributed and in one process and report the differences"""
    checkpoint_dir: Optional[str] = None
    """write a checkpoint of the whole run (both processes) here after every epoch, atomically"""
    checkpoint_interval: Optional[int] = None
    """also write that checkpoint every this many training batches within an epoch"""
    resume: bool = False
    """continue from the checkpoint in --checkpoint-dir, if there is one (else start from the beginning): on a CPU,
    exactly as if the run had never stopped"""
    cuda: bool = False
    """embedding and decoder on the ps's GPU, LSTM on the trainer's; RPC device maps move the tensors"""
    rpc_timeout: float = 60.0
    """seconds before an RPC to a stuck peer fails and ends the run (a dead peer is noticed at once); one decoder
    call on the full 33k-word vocabulary was seen to take 21 s on a 2-core machine under heavy load"""


def validate(args):
    """The rules of the flags and of the paths they name, checked before any work starts: each broken rule is one
    line on stderr and exit status 2. The data and a --resume checkpoint are checked once read (check_corpus,
    read_checkpoint), also before any process starts."""
    check(args.emsize > 0 and args.nhid > 0 and args.nlayers > 0, "--emsize, --nhid and --nlayers must be > 0")
    check(0.0 <= args.dropout < 1.0, f"--dropout must be in [0, 1), got {args.dropout}")
    for flag, value in (("--batch-size", args.batch_size), ("--eval-batch-size", args.eval_batch_size),
                        ("--bptt", args.bptt), ("--epochs", args.epochs), ("--log-interval", args.log_interval),
                        ("--max-batches", args.max_batches), ("--checkpoint-interval", args.checkpoint_interval),
                        ("--lr", args.lr), ("--clip", args.clip), ("--rpc-timeout", args.rpc_timeout)):
        check(value is None or value > 0, f"{flag} must be > 0, got {value}")
    check(not args.cuda or common.cuda_device_count() > 0, "--cuda given but no CUDA GPU found; run without --cuda")
    if args.generate is not None:
        check(args.generate > 0, f"--generate must be > 0, got {args.generate}")
        check(args.temperature > 0, f"--temperature must be > 0, got {args.temperature}")
        check(args.load is not None, "--generate needs a checkpoint: pass --load PATH (written by --save)")
        common.check_input_file("--load", args.load)
        check(not (args.save or args.checkpoint_dir or args.check_gradients),
              "--generate only samples from --load; drop --save, --checkpoint-dir and --check-gradients")
        return
    check(args.load is None, "--load is read by --generate only: pass --generate N to sample from it, or "
                             "--checkpoint-dir DIR --resume to continue an interrupted run")
    check(not args.check_gradients or args.dropout == 0, "--check-gradients needs --dropout 0 (masks differ)")
    check(not (args.check_gradients and (args.save or args.checkpoint_dir)),
          "--check-gradients writes nothing; drop --save and --checkpoint-dir")
    check(not args.resume or args.checkpoint_dir, "--resume needs --checkpoint-dir DIR (where the checkpoint is)")
    check(not args.checkpoint_interval or args.checkpoint_dir, "--checkpoint-interval needs --checkpoint-dir DIR")
    check(common.process_count(2) == 2,
          "rpc_rnn.py runs as exactly 2 processes (ps and trainer); pass --nproc-per-node 2 to torchrun, or run "
          "it on 2 nodes with --nproc-per-node 1")
    if args.save:
        common.check_output_file("--save", args.save)
    if args.checkpoint_dir:
        common.check_output_dir("--checkpoint-dir", args.checkpoint_dir)
        check(not checkpoint_path(args).is_dir(), f"--checkpoint-dir {args.checkpoint_dir}: {checkpoint_path(args)} "
                                                  f"is a folder; remove it or pass another --checkpoint-dir")


# ---------------------------------------------------------------------------------------------------------
# The model: three pieces, put together in one process (RNNModel) or over RPC (DistributedRNNModel)
# ---------------------------------------------------------------------------------------------------------

class EmbeddingTable(nn.Module):
    """Token ids -> dropped-out embeddings. Lives on the ps (distributed) or inside RNNModel (one process)."""

    def __init__(self, ntoken, ninp, dropout, seed, device="cpu"):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        # The ps builds the embedding and the decoder at the same time, in two RPC threads: drawn from the global
        # RNG, their weights would depend on how the threads interleave. A generator of their own, and no
        # default init (skip_init), keep them reproducible and leave the global RNG to dropout.
        self.encoder = skip_init(nn.Embedding, ntoken, ninp)
        self.encoder.weight.data.uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(seed))
        settle(self.to(device).parameters())  # built in an RPC handler on the ps: see settle

    def forward(self, input):
        return self.drop(self.encoder(input))


class Decoder(nn.Module):
    """LSTM output -> logits over the vocabulary, or straight to the loss. Lives on the ps or in RNNModel."""

    def __init__(self, ntoken, nhid, dropout, seed, device="cpu"):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = skip_init(nn.Linear, nhid, ntoken)  # see EmbeddingTable
        self.decoder.weight.data.uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(seed))
        self.decoder.bias.data.zero_()
        settle(self.to(device).parameters())

    def forward(self, output):
        return self.decoder(self.drop(output))

    def loss(self, output, targets):
        return lm_loss(self.forward(output), targets)


def make_lstm(ninp, nhid, nlayers, dropout, seed):
    """The LSTM, initialised from a seed of its own, so that the trainer and a one-process model built with the
    same seed hold the same weights. Only ever built by one thread at a time (the trainer's main thread), which
    makes the save/restore of the global RNG below safe."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.LSTM(ninp, nhid, nlayers, dropout=dropout if nlayers > 1 else 0.0)


class RNNModel(nn.Module):
    """The whole model in one process: what a checkpoint loads into, what --generate and --check-gradients use.
    Piece i is built from seed + i, like the distributed model's pieces, so both start from the same weights."""

    def __init__(self, ntoken, ninp, nhid, nlayers, dropout, seed=0):
        super().__init__()
        self.embedding = EmbeddingTable(ntoken, ninp, dropout, seed)
        self.rnn = make_lstm(ninp, nhid, nlayers, dropout, seed + 1)
        self.decoder = Decoder(ntoken, nhid, dropout, seed + 2)

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.embedding(input), hidden)
        return self.decoder(output), hidden

    def loss(self, input, targets, hidden):
        output, hidden = self.rnn(self.embedding(input), hidden)
        return self.decoder.loss(output, targets), hidden

    def init_hidden(self, batch_size, device="cpu"):
        return zero_hidden(self.rnn, batch_size, device)


def lm_loss(logits, targets):
    """Mean cross-entropy of next-word logits [rows, batch, ntoken] against target ids [rows, batch]."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def zero_hidden(lstm, batch_size, device="cpu"):
    """The LSTM's initial (h, c) state for batch_size streams."""
    shape = (lstm.num_layers, batch_size, lstm.hidden_size)
    return torch.zeros(shape, device=device), torch.zeros(shape, device=device)


# ---------------------------------------------------------------------------------------------------------
# The roles: the trainer holds the LSTM and RRefs to the ps's pieces, and drives everything; the ps answers RPCs
# ---------------------------------------------------------------------------------------------------------

class DistributedRNNModel(nn.Module):
    """Lives on the trainer: holds the LSTM, and RRefs to the embedding table and the decoder on the ps."""

    def __init__(self, ntoken, ninp, nhid, nlayers, dropout, seed, device, ps_device, ship_logits):
        super().__init__()
        self.ship_logits = ship_logits
        self.embedding_rref = rpc.remote(PS_NAME, EmbeddingTable, args=(ntoken, ninp, dropout, seed, ps_device))
        self.rnn = make_lstm(ninp, nhid, nlayers, dropout, seed + 1).to(device)
        self.decoder_rref = rpc.remote(PS_NAME, Decoder, args=(ntoken, nhid, dropout, seed + 2, ps_device))
        self.remote_pieces = {"embedding": self.embedding_rref, "decoder": self.decoder_rref}

    def loss(self, input, targets, hidden):
        """The forward pass across both processes. Inside a dist_autograd context each RPC records its send and
        receive, so that backward later flows back through the ps. The loss is computed where the decoder lives;
        --ship-logits brings the logits here instead, as the tutorial does."""
        embedded = self.embedding_rref.rpc_sync().forward(input)
        output, hidden = self.rnn(embedded, hidden)
        if self.ship_logits:
            return lm_loss(self.decoder_rref.rpc_sync().forward(output), targets), hidden
        return self.decoder_rref.rpc_sync().loss(output, targets), hidden

    def parameter_rrefs(self):
        """RRefs to every parameter of both processes, for the distributed optimizer (as in the tutorial)."""
        return (on_owner(self.embedding_rref, parameter_rrefs) + parameter_rrefs(self.rnn)
                + on_owner(self.decoder_rref, parameter_rrefs))

    def train(self, mode=True):
        super().train(mode)
        for rref in self.remote_pieces.values():
            on_owner(rref, nn.Module.train, mode)
        return self

    def init_hidden(self, batch_size, device):
        return zero_hidden(self.rnn, batch_size, device)


def on_owner(rref, function, *args):
    """function(the object rref points to, *args), run by RPC in the process that owns the object; returns the
    result. The tutorial's `_remote_method`, for what the RRef idiom `rref.rpc_sync().method(*args)` cannot do:
    call a function that is not a method of the object (parameter_rrefs, cpu_state_dict), or a method that returns
    the object itself (nn.Module.train would send the whole module back; None comes back instead)."""
    return rpc.rpc_sync(rref.owner(), _apply_to_local_value, args=(rref, function, *args))


def _apply_to_local_value(rref, function, *args):
    value = rref.local_value()
    result = function(value, *args)
    return None if result is value else result


def parameter_rrefs(module):
    """RRefs to a module's parameters, made where they live (the tutorial's `_parameter_rrefs`)."""
    return [rpc.RRef(param) for param in module.parameters()]


def train_step(model, optimizer, input, targets, hidden, clip):
    """One window: forward and backward across both processes, global clipping, one SGD step on every owner.
    No zero_grad: each step's gradients live in its own autograd context, dropped when the context ends."""
    with dist_autograd.context() as context_id:
        loss, hidden = model.loss(input, targets, hidden)
        dist_autograd.backward(context_id, [loss])
        optimizer.clip_grad_norm(context_id, clip)
        optimizer.step(context_id)
    return loss.item(), hidden


def run_trainer(args, corpus, device, ps_device, resume_from):
    """The trainer's run: epochs of bptt windows, validation after each (lr / 4 when it did not improve, the best
    model kept), then the test of the best model. The ps only answers the RPCs this makes."""
    model = DistributedRNNModel(len(corpus.words), args.emsize, args.nhid, args.nlayers, args.dropout, args.seed,
                                device, ps_device, args.ship_logits)
    if args.check_gradients:
        return check_gradients(args, corpus, model, device)
    train_data = batchify(corpus.train, args.batch_size, device)
    valid_data, test_data = (batchify(data, args.eval_batch_size, device) for data in (corpus.valid, corpus.test))
    batches = batches_per_epoch(train_data, args)
    run = resume(args, model, resume_from, device, ps_device) if resume_from else Progress(lr=args.lr)
    optimizer = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=run.lr)
    for epoch in range(run.epoch, args.epochs + 1):
        epoch_start = time.perf_counter()
        model.train()
        first_batch, hidden = run.start_epoch()
        hidden = hidden or model.init_hidden(args.batch_size, device)
        for batch in range(first_batch, batches):
            input, targets = get_batch(train_data, batch * args.bptt, args.bptt)
            loss, hidden = train_step(model, optimizer, input, targets, detach_hidden(hidden), args.clip)
            run.record(loss, targets.numel())
            if (batch + 1) % args.log_interval == 0 or batch + 1 == batches:
                print(f"epoch {epoch} | batch {batch + 1}/{batches} | lr {run.lr:.2f} | {run.interval_line()}",
                      flush=True)
            if args.checkpoint_interval and (batch + 1) % args.checkpoint_interval == 0 and batch + 1 < batches:
                write_checkpoint(args, corpus, model, run.at(epoch, batch + 1, hidden), device, ps_device)
        epoch_seconds = time.perf_counter() - epoch_start
        run.valid_loss = evaluate(model, valid_data, args.bptt, args.eval_batch_size, device)
        print(f"epoch {epoch} | valid loss {run.valid_loss:.2f} | valid ppl {math.exp(min(run.valid_loss, 50)):.1f} | "
              f"{epoch_seconds:.1f} s/epoch", flush=True)
        if run.valid_loss < run.best_valid:
            run.best_valid, run.best_state = run.valid_loss, gathered_state_dict(model)
            if args.save:
                save_model(args, corpus, run.best_state, run.valid_loss)
        else:
            run.lr /= 4
            optimizer.set_lr(run.lr)
        write_checkpoint(args, corpus, model, run.at(epoch + 1, 0, None), device, ps_device)
    if run.best_state is not None and run.valid_loss > run.best_valid:
        load_gathered_state_dict(model, run.best_state)  # test the model that was kept, as pytorch/examples does
    test_loss = evaluate(model, test_data, args.bptt, args.eval_batch_size, device)
    print(f"test loss {test_loss:.2f} | test ppl {math.exp(min(test_loss, 50)):.1f}", flush=True)
    report(args, run, len(corpus.words), test_loss, device, ps_device)


def evaluate(model, data, bptt, batch_size, device):
    """Mean loss per word over a whole split. Grad mode does not travel with an RPC: under this torch.no_grad() the
    ps still records the autograd graph of its forward, and drops it when the call returns. That costs no time that
    shows (the decoder's loss on 350 x 33k logits took 119-131 ms either way) and less memory than a training
    step, so no helper carries the mode across and the calls keep the RRef idiom."""
    model.eval()
    total, hidden = 0.0, model.init_hidden(batch_size, device)
    with torch.no_grad():
        for i in range(0, data.size(0) - 1, bptt):
            input, targets = get_batch(data, i, bptt)
            loss, hidden = model.loss(input, targets, hidden)
            total += input.size(0) * loss.item()
    return total / (data.size(0) - 1)


def run_worker(info, args, corpus, resume_from):
    """Rank 0 becomes the ps and answers RPCs until the trainer is done; rank 1 becomes the trainer."""
    # The ps and the trainer take turns (embedding, LSTM, decoder, then backward in reverse), never computing at
    # the same time: each may use every core of the machine while the other waits.
    torch.set_num_threads(common.usable_cpus())
    common.seed_everything(args.seed + info.rank)  # dropout masks differ per process; initial weights do not
    ps_device = torch.device("cuda", 0) if args.cuda else torch.device("cpu")
    if args.cuda and args.check_gradients:
        common.set_tf32(False)  # the check compares with the CPU: IEEE float32 on both sides
    if info.rank == 0:
        common.init_rpc(info, PS_NAME, args.rpc_timeout, devices=[ps_device] if args.cuda else None)
    else:
        device = torch.device("cpu")
        device_maps = None
        if args.cuda:
            # On one machine with 2 GPUs the trainer takes the second; tensors sent to the ps land on its GPU and
            # the replies come back to the trainer's, by the map instead of .to() calls in the model.
            device = torch.device("cuda", info.local_rank % common.cuda_device_count())
            torch.cuda.set_device(device)
            device_maps = {PS_NAME: {device: ps_device}}
        common.init_rpc(info, TRAINER_NAME, args.rpc_timeout, device_maps=device_maps,
                        devices=[device] if args.cuda else None)
        try:
            run_trainer(args, corpus, device, ps_device, resume_from)
        except common.RunFailed:  # a full disk, said in one line: end the ps in order, so that it adds nothing
            shut_down_in_order()
            raise
    rpc.shutdown()  # the ps waits here, answering RPCs, until the trainer is done too


def main():
    args = common.parse_args(Args)
    validate(args)
    if args.generate:
        generate(args)
        return
    corpus = Corpus(common.wikitext2_dir(args.data_dir))
    check_corpus(args, corpus)
    resume_from = read_checkpoint(args, corpus)
    common.launch(run_worker, 2, args, corpus, resume_from, timeout=args.rpc_timeout)


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: real data (word_language_model's vocabulary, batchify and bptt windows)
# ---------------------------------------------------------------------------------------------------------

class Corpus:
    """Token ids of train/valid/test, one vocabulary over all three (as pytorch/examples does). Built in the
    launching process, before any worker starts, so that a bad file is a one-line error."""

    def __init__(self, folder):
        self.words = []
        self.index = {}
        self.train, self.valid, self.test = (self.tokenize(Path(folder) / name)
                                             for name in ("train.txt", "valid.txt", "test.txt"))

    def tokenize(self, path):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
            raise UsageError(f"cannot read {path} ({reason}); pass a --data-dir with UTF-8 text files") from None
        ids = []
        for line in text.splitlines():
            for word in line.split() + ["<eos>"]:
                if word not in self.index:
                    self.index[word] = len(self.words)
                    self.words.append(word)
                ids.append(self.index[word])
        check(len(text.split()) > 0, f"{path} holds no words; pass a --data-dir with train/valid/test.txt text")
        return torch.tensor(ids, dtype=torch.long)


def check_corpus(args, corpus):
    """Each split must give every stream of its batch at least one window of two words."""
    for name, batch_size, flag in (("train", args.batch_size, "--batch-size"),
                                   ("valid", args.eval_batch_size, "--eval-batch-size"),
                                   ("test", args.eval_batch_size, "--eval-batch-size")):
        tokens = getattr(corpus, name).numel()
        check(tokens // batch_size >= 2, f"{name}.txt has {tokens} tokens, too few for {flag} {batch_size}; pass "
                                         f"a smaller {flag} or more text")


def batchify(data, batch_size, device):
    """[tokens] -> [tokens // batch_size, batch_size]: column j is the j-th slice of the text, read top down."""
    rows = data.size(0) // batch_size
    return data[:rows * batch_size].view(batch_size, rows).t().contiguous().to(device)


def get_batch(source, i, bptt):
    """Window of up to bptt rows starting at row i, and the same window shifted one word ahead as targets."""
    length = min(bptt, source.size(0) - 1 - i)
    return source[i:i + length], source[i + 1:i + 1 + length]


def batches_per_epoch(train_data, args):
    batches = math.ceil((train_data.size(0) - 1) / args.bptt)
    return min(batches, args.max_batches) if args.max_batches else batches


def detach_hidden(hidden):
    """Keep the LSTM state across windows but cut the graph, so backward stops at the window's start."""
    return tuple(h.detach() for h in hidden)


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: torch's DistributedOptimizer without TorchScript, and clipping on the global norm
# ---------------------------------------------------------------------------------------------------------

def settle(tensors):
    """Wait until the GPU work queued on these tensors' devices has finished, whatever stream it was queued on.

    TensorPipe runs every RPC on CUDA streams of its own (pytorch/pytorch#57960) and orders only the tensors a call
    receives or returns. A call that writes tensors it does not return (building a module, an optimizer step,
    scaling gradients, loading weights) could otherwise return before its writes are done, and a call that reads
    what another call wrote (the gradients that backward left in the autograd context, the weights a step updated)
    could read them early. Such calls settle the devices they touch: writers last, readers of others' writes
    first. Nothing to do on the CPU.
    """
    for device in {tensor.device for tensor in tensors if tensor.is_cuda}:
        torch.cuda.synchronize(device)


class LocalOptimizer:
    """Lives on every process that owns parameters (the ps and the trainer): a plain torch.optim optimizer over
    them, stepped by RPC with the gradients of one distributed autograd context. It is what
    torch.distributed.optim.DistributedOptimizer keeps on each owner, without TorchScript (deprecated), plus the
    owner's two halves of global gradient clipping. Each method settles the device first and last."""

    def __init__(self, optimizer_class, param_rrefs, **options):
        self.params = [rref.local_value() for rref in param_rrefs]
        self.optimizer = optimizer_class(self.params, **options)

    def context_grads(self, context_id):
        grads = dist_autograd.get_gradients(context_id)
        return [grads[param] for param in self.params if param in grads]

    def grad_norms(self, context_id):
        """The norm of each of this owner's gradients in the context, on the CPU (None for a parameter without)."""
        grads = dist_autograd.get_gradients(context_id)
        settle(grads.values())
        return [torch.linalg.vector_norm(grads[param]).cpu() if param in grads else None for param in self.params]

    def scale_grads(self, context_id, factor):
        # get_gradients hands out the context's own tensors, the ones step() reads: scaling them in place is what
        # makes the clipping reach the update.
        grads = self.context_grads(context_id)
        settle(grads)
        for grad in grads:
            grad.mul_(factor.to(grad.device))
        settle(grads)

    def step(self, context_id):
        grads = dist_autograd.get_gradients(context_id)
        settle(self.params)
        for param in self.params:
            param.grad = grads.get(param)
        self.optimizer.step()
        settle(self.params)

    def set_lr(self, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr


class DistributedOptimizer:
    """Lives on the trainer: a LocalOptimizer on each owner of the parameters in param_rrefs (as
    torch.distributed.optim.DistributedOptimizer(optimizer_class, param_rrefs, **options) would create), and
    gradient clipping on the global norm over all of them."""

    def __init__(self, optimizer_class, param_rrefs, **options):
        by_owner = {}
        self.order = []  # (owner's index, index among that owner's parameters) of each parameter, in given order
        for rref in param_rrefs:
            owned = by_owner.setdefault(rref.owner(), [])
            self.order.append((list(by_owner).index(rref.owner()), len(owned)))
            owned.append(rref)
        self.local_optimizers = [rpc.remote(owner, LocalOptimizer, args=(optimizer_class, rrefs), kwargs=options)
                                 for owner, rrefs in by_owner.items()]

    def _on_every_owner(self, method, *args):
        return torch.futures.wait_all([getattr(rref.rpc_async(), method)(*args) for rref in self.local_optimizers])

    def clip_grad_norm(self, context_id, max_norm):
        """torch.nn.utils.clip_grad_norm_ over parameters spread on several processes, to the bit: each owner
        reports the norm of each of its gradients in the context, the trainer takes the norm of those norms in the
        parameters' order, in float32 as clip_grad_norm_ does, and every owner scales its gradients by the same
        factor. Returns the norm before clipping."""
        norms = self._on_every_owner("grad_norms", context_id)
        total_norm = torch.linalg.vector_norm(torch.stack([norms[owner][index] for owner, index in self.order
                                                           if norms[owner][index] is not None]))
        factor = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        if factor < 1.0:
            self._on_every_owner("scale_grads", context_id, factor)
        return total_norm.item()

    def step(self, context_id):
        self._on_every_owner("step", context_id)

    def set_lr(self, lr):
        self._on_every_owner("set_lr", lr)


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: the weights and gradients of both processes under RNNModel's names
# ---------------------------------------------------------------------------------------------------------

def cpu_state_dict(module):
    """Copies of a module's weights on the CPU (a kept best state must not follow the live weights). Settles
    first: the last optimizer step may have written them on another stream."""
    state = module.state_dict()
    settle(state.values())
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in state.items()}


def load_weights(module, state):
    module.load_state_dict(state)
    settle(module.parameters())


def context_grads(module, context_id):
    """The gradients of a module's parameters in one distributed autograd context, on the CPU."""
    grads = dist_autograd.get_gradients(context_id)
    settle(grads.values())
    return {name: grads[param].cpu() for name, param in module.named_parameters() if param in grads}


def gathered_state_dict(model):
    """The weights of both processes under RNNModel's names, on the CPU: a checkpoint RNNModel loads."""
    state = {f"rnn.{name}": tensor for name, tensor in cpu_state_dict(model.rnn).items()}
    for piece, rref in model.remote_pieces.items():
        state.update({f"{piece}.{name}": tensor for name, tensor in on_owner(rref, cpu_state_dict).items()})
    return state


def load_gathered_state_dict(model, state):
    load_weights(model.rnn, {name[4:]: tensor for name, tensor in state.items() if name.startswith("rnn.")})
    for piece, rref in model.remote_pieces.items():
        on_owner(rref, load_weights, {name[len(piece) + 1:]: tensor for name, tensor in state.items()
                                      if name.startswith(piece + ".")})


def gathered_context_grads(model, context_id):
    """The gradients of one autograd context, from both processes, under RNNModel's names."""
    grads = {f"rnn.{name}": grad for name, grad in context_grads(model.rnn, context_id).items()}
    for piece, rref in model.remote_pieces.items():
        grads.update({f"{piece}.{name}": grad for name, grad in on_owner(rref, context_grads, context_id).items()})
    return grads


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: proof that the distributed math is the one-process math
# ---------------------------------------------------------------------------------------------------------

def check_gradients(args, corpus, model, device):
    """Same weights, same batches, in one process and over RPC: report the largest differences of loss, clipped
    gradients and updated weights. Needs --dropout 0: the two runs draw their dropout masks differently."""
    local = RNNModel(len(corpus.words), args.emsize, args.nhid, args.nlayers, args.dropout, args.seed)
    local_optimizer = optim.SGD(local.parameters(), lr=args.lr)
    optimizer = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=args.lr)
    train_data = batchify(corpus.train, args.batch_size, "cpu")
    hidden, local_hidden = model.init_hidden(args.batch_size, device), local.init_hidden(args.batch_size)
    worst = {"loss_diff": 0.0, "max_grad_diff": 0.0, "max_param_diff": 0.0}
    norms = []
    for batch in range(min(args.max_batches or 2, math.ceil((train_data.size(0) - 1) / args.bptt))):
        input, targets = get_batch(train_data, batch * args.bptt, args.bptt)
        hidden, local_hidden = detach_hidden(hidden), detach_hidden(local_hidden)
        with dist_autograd.context() as context_id:
            loss, hidden = model.loss(input.to(device), targets.to(device), hidden)
            dist_autograd.backward(context_id, [loss])
            norms.append(optimizer.clip_grad_norm(context_id, args.clip))
            grads = gathered_context_grads(model, context_id)
            optimizer.step(context_id)
        local_optimizer.zero_grad()
        local_loss, local_hidden = local.loss(input, targets, local_hidden)
        local_loss.backward()
        local_norm = nn.utils.clip_grad_norm_(local.parameters(), args.clip).item()
        local_optimizer.step()
        params = gathered_state_dict(model)
        worst["loss_diff"] = max(worst["loss_diff"], abs(loss.item() - local_loss.item()))
        worst["max_grad_diff"] = max([worst["max_grad_diff"]] + [(grads[name] - param.grad).abs().max().item()
                                                                for name, param in local.named_parameters()])
        worst["max_param_diff"] = max([worst["max_param_diff"]] + [(params[name] - param).abs().max().item()
                                                                  for name, param in local.state_dict().items()])
        print(f"batch {batch + 1} | loss {loss.item():.6f} vs {local_loss.item():.6f} | grad norm {norms[-1]:.5f} "
              f"vs {local_norm:.5f} | max grad diff {worst['max_grad_diff']:.2e} | "
              f"max weight diff {worst['max_param_diff']:.2e}", flush=True)
    common.emit_result(SCRIPT, mode="check-gradients", batches=len(norms), grad_norms=norms, clip=args.clip,
                       compared=len(grads), **worst)


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: progress, reporting, checkpoints and exact resume, sampling
# ---------------------------------------------------------------------------------------------------------

@dataclass
class Progress:
    """Lives on the trainer: where the run stands and what it has measured. With the weights of both processes
    and the RNG states that draw their dropout masks, it is all a checkpoint needs to continue exactly (SGD
    keeps no state besides lr)."""
    lr: float
    epoch: int = 1
    batch: int = 0  # the next training batch of `epoch`
    hidden: Optional[tuple] = None  # the LSTM state after `batch` batches, when a checkpoint cut an epoch
    best_valid: float = math.inf
    best_state: Optional[dict] = None
    valid_loss: float = math.nan
    losses: list = field(default_factory=list)
    tokens: int = 0  # trained on, and the seconds it took, over the whole run (tokens_per_s)
    seconds: float = 0.0
    interval_loss: float = 0.0  # since the last log line
    interval_batches: int = 0
    interval_tokens: int = 0
    interval_seconds: float = 0.0

    def start_epoch(self):
        """Start the clock of the log interval; returns the batch to start from (0 unless resuming within the epoch)
        and the LSTM state to start with (None: zeros)."""
        self.interval_start = time.perf_counter() - self.interval_seconds
        (batch, self.batch), (hidden, self.hidden) = (self.batch, 0), (self.hidden, None)
        return batch, hidden

    def record(self, loss, tokens):
        self.losses.append(loss)
        self.interval_loss += loss
        self.interval_batches += 1
        self.interval_tokens += tokens

    def interval_line(self):
        """The log line's figures over the interval since the last one; starts the next interval."""
        seconds = time.perf_counter() - self.interval_start
        mean = self.interval_loss / self.interval_batches
        line = (f"{1000 * seconds / self.interval_batches:.1f} ms/batch | loss {mean:.2f} | "
                f"ppl {math.exp(min(mean, 50)):.1f} | {self.interval_tokens / seconds / 1000:.1f}k tokens/s")
        self.tokens += self.interval_tokens
        self.seconds += seconds
        self.interval_loss, self.interval_batches, self.interval_tokens = 0.0, 0, 0
        self.interval_start, self.interval_seconds = time.perf_counter(), 0.0
        return line

    def at(self, epoch, batch, hidden):
        """This progress as a checkpoint stores it, placed before batch `batch` of epoch `epoch`."""
        state = {item.name: getattr(self, item.name) for item in fields(self)}
        state.update(epoch=epoch, batch=batch, losses=torch.tensor(self.losses, dtype=torch.float64),
                     hidden=None if hidden is None else tuple(h.detach().cpu() for h in hidden),
                     interval_seconds=time.perf_counter() - self.interval_start if batch else 0.0)
        return state


def report(args, run, ntoken, test_loss, device, ps_device):
    window = max(1, min(10, len(run.losses) // 4))
    common.emit_result(SCRIPT, mode="ship-logits" if args.ship_logits else "loss-on-ps", ntoken=ntoken,
                       devices={PS_NAME: str(ps_device), TRAINER_NAME: str(device)},
                       batches=len(run.losses), first_loss=sum(run.losses[:window]) / window,
                       last_loss=sum(run.losses[-window:]) / window, losses=[round(x, 6) for x in run.losses[:200]],
                       valid_loss=run.best_valid, valid_ppl=math.exp(min(run.best_valid, 50)), test_loss=test_loss,
                       test_ppl=math.exp(min(test_loss, 50)), lr=run.lr,
                       tokens_per_s=run.tokens / run.seconds if run.seconds else 0.0)


def model_config(args, corpus):
    """RNNModel's arguments: RNNModel(**config) builds the model a checkpoint's weights load into."""
    return {"ntoken": len(corpus.words), "ninp": args.emsize, "nhid": args.nhid, "nlayers": args.nlayers,
            "dropout": args.dropout}


def save_model(args, corpus, state, valid_loss):
    """--save: the best model so far, for the plain RNNModel, written atomically by common.save_checkpoint (a
    failed write keeps the previous file and ends the run in one line):
    `RNNModel(**ckpt["config"]).load_state_dict(ckpt["model"])`, with ckpt = torch.load(path)."""
    common.save_checkpoint(args.save, SCRIPT, {"model": state, "vocab": corpus.words, "valid_loss": valid_loss,
                                               "config": model_config(args, corpus)}, "--save")


CHECKPOINT_KEYS = ("model", "vocab", "config", "recipe", "progress", "rng")


def checkpoint_path(args):
    return Path(args.checkpoint_dir) / "rpc_rnn.pt"


def recipe(args):
    """The flags that a resumed run must share with the run that wrote the checkpoint: they change the math."""
    names = ("emsize", "nhid", "nlayers", "dropout", "batch_size", "eval_batch_size", "bptt", "lr", "clip", "seed",
             "max_batches")
    return {name: getattr(args, name) for name in names}


def write_checkpoint(args, corpus, model, progress, device, ps_device):
    """The whole run, from both processes, in one file in --checkpoint-dir, written atomically by the trainer
    (common.save_checkpoint): the current weights (also loadable by --generate), the progress, and the RNG states
    of both processes, which draw the dropout masks."""
    if args.checkpoint_dir:
        rng = {TRAINER_NAME: rng_state(device), PS_NAME: rpc.rpc_sync(PS_NAME, rng_state, args=(ps_device,))}
        common.save_checkpoint(checkpoint_path(args), SCRIPT, {
            "model": gathered_state_dict(model), "vocab": corpus.words, "config": model_config(args, corpus),
            "recipe": recipe(args), "progress": progress, "rng": rng}, "--checkpoint-dir")


def read_checkpoint(args, corpus):
    """The checkpoint that --resume continues, verified (common.load_checkpoint) and checked against these flags
    and this text; None when there is none yet (the run starts from the beginning). Read in the launcher, before
    any process starts; under torchrun, in each process."""
    path = checkpoint_path(args) if args.resume else None
    if path is None or not path.exists():
        return None
    saved = common.load_checkpoint(path, SCRIPT, "--resume", keys=CHECKPOINT_KEYS)
    differ = [f"--{name.replace('_', '-')} {value}" for name, value in saved["recipe"].items()
              if recipe(args).get(name) != value]
    check(not differ, f"--resume {path}: written with {', '.join(differ)}; pass the same flags or another "
                      f"--checkpoint-dir")
    check(saved["vocab"] == corpus.words, f"--resume {path}: written for another text (its vocabulary differs); "
                                          f"pass the same --data-dir or another --checkpoint-dir")
    done = saved["progress"]["epoch"] - 1
    check(done <= args.epochs, f"--resume {path}: holds {done} finished epochs, more than --epochs {args.epochs}; "
                               f"pass a larger --epochs or another --checkpoint-dir")
    return saved


def resume(args, model, saved, device, ps_device):
    """Put both processes back where the checkpoint was taken: weights, RNG states, progress."""
    load_gathered_state_dict(model, saved["model"])
    set_rng_state(saved["rng"][TRAINER_NAME], device)
    rpc.rpc_sync(PS_NAME, set_rng_state, args=(saved["rng"][PS_NAME], ps_device))
    progress = dict(saved["progress"], losses=saved["progress"]["losses"].tolist())
    if progress["hidden"] is not None:
        progress["hidden"] = tuple(h.to(device) for h in progress["hidden"])
    print(f"resuming at epoch {progress['epoch']} batch {progress['batch']} from {checkpoint_path(args)}",
          flush=True)
    return Progress(**progress)


def rng_state(device):
    """The states of this process's generators that draw dropout masks on `device`."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    """Restore rng_state's states. On CUDA, cuDNN's LSTM keeps a dropout state of its own, which torch does not
    expose and re-seeds from the CUDA generator once that is set: a resumed --cuda run with LSTM dropout draws
    other masks between the LSTM's layers than an uninterrupted run would."""
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def shut_down_in_order():
    """The graceful rpc.shutdown() that ends a run, for a trainer that is about to fail: the ps, waiting in its own
    shutdown, then ends cleanly, instead of logging TensorPipe's warning about a pipe its peer closed. The
    shutdown meets through the rendezvous store; if that cannot be written either (a file store on a full disk),
    the run still ends with the trainer's line first, and the ps's warning may follow it."""
    try:
        rpc.shutdown()
    except (RuntimeError, OSError):  # torch's store errors (DistStoreError) are RuntimeErrors
        pass


def generate(args):
    """Load a checkpoint into the plain RNNModel and sample words from it, one at a time."""
    saved = common.load_checkpoint(args.load, SCRIPT, "--load", keys=("model", "vocab", "config"))
    model = RNNModel(**saved["config"])
    model.load_state_dict(saved["model"])
    words = saved["vocab"]
    common.seed_everything(args.seed)
    model.eval()
    input, hidden = torch.randint(len(words), (1, 1)), model.init_hidden(1)
    sampled = []
    with torch.no_grad():
        for _ in range(args.generate):
            logits, hidden = model(input, hidden)
            index = torch.multinomial(F.softmax(logits.view(-1) / args.temperature, dim=0), 1).item()
            input.fill_(index)
            sampled.append(words[index])
    for start in range(0, len(sampled), 20):
        print(" ".join(sampled[start:start + 20]), flush=True)
    common.emit_result(SCRIPT, mode="generate", words=len(sampled), vocab=len(words))


if __name__ == "__main__":
    common.run_main(main)
