"""Model-parallel LSTM language model over RPC: a parameter server and a trainer, trained on WikiText-2.

Part 2 of PyTorch's "Getting started with the distributed RPC framework" (a distributed RNN with distributed
autograd and the distributed optimizer), on real data. The model of pytorch/examples' word_language_model (embedding
-> LSTM -> linear decoder) is cut in two processes: rank 0, the parameter server "ps", owns the embedding table and
the decoder; rank 1, the "trainer", owns the LSTM, builds the ps's pieces with `rpc.remote`, calls them through their
RRefs, runs backward across both processes inside a `dist_autograd.context()` and steps torch's
DistributedOptimizer, which runs SGD on each owner of parameters. The tutorial's code comes first; below the
`Beyond the tutorial` banners: real data, the loss computed on the ps (one number comes back instead of the logits),
gradient clipping on the global norm over both processes, --check-gradients (distributed == one process),
checkpoints with exact resume, and sampling from a saved model.

Commands (WikiText-2 is downloaded on first use; --data-dir DIR reads train/valid/test.txt from DIR instead):
    python rpc_rnn.py                                     # CPU, 2 processes, word_language_model's recipe, 40 epochs
    python rpc_rnn.py --epochs 1 --max-batches 200 --emsize 64 --nhid 64                  # a short run
    python rpc_rnn.py --cuda --epochs 6 --save lm.pt      # embedding + decoder on a GPU, LSTM on another (or the same)
    python rpc_rnn.py --generate 100 --load lm.pt         # sample 100 words in this process, no RPC
    python rpc_rnn.py --check-gradients --dropout 0 --clip 0.05 --emsize 32 --nhid 32    # distributed == 1 process
    python rpc_rnn.py --checkpoint-dir ckpt --resume      # checkpoints each epoch; run it again to continue
    torchrun --standalone --nproc-per-node 2 rpc_rnn.py
    torchrun --standalone --nproc-per-node 2 --max-restarts 3 rpc_rnn.py --checkpoint-dir ckpt --resume
    # two nodes (node rank 0 is the ps, 1 the trainer); MASTER_ADDR = node 0's address on a trusted network:
    torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 1 --master-addr $MASTER_ADDR --master-port 29400 \\
        rpc_rnn.py

The trainer prints (the ps says nothing unless it fails); the last lines of a run have this shape:
    epoch 1 | batch 200/200 | lr 20.00 | <t> ms/batch | loss 7.66 | ppl 2123.8 | <n>k tokens/s
    epoch 1 | valid loss 7.27 | valid ppl 1439.7 | <t> s/epoch
    test loss 7.20 | test ppl 1339.1
    {"script": "rpc_rnn", "mode": "loss-on-ps", "ntoken": 33278, "batches": 200, "first_loss": 9.83, ...}
"""

import logging
import math
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn as nn
import torch.nn.functional as F
from torch import optim
from torch.distributed import rpc
from torch.distributed.optim import DistributedOptimizer
from torch.nn.utils import skip_init

import common
from common import DataDir, InFile, OutDir, OutFile, Positive, PositiveFloat, Seconds, Seed, check

PS_NAME = "ps"
TRAINER_NAME = "trainer"
SCRIPT = "rpc_rnn"


@dataclass
class Args:
    # Model (word_language_model's recipe)
    emsize: Positive = 200
    """size of the word embeddings"""
    nhid: Positive = 200
    """hidden units per LSTM layer"""
    nlayers: Positive = 2
    """number of LSTM layers"""
    dropout: float = 0.2
    """dropout on the embeddings, between LSTM layers and before the decoder: from 0 up to, not including, 1"""
    # Training
    epochs: Positive = 40
    """number of passes over the training text"""
    lr: PositiveFloat = 20.0
    """initial SGD learning rate; divided by 4 after an epoch whose valid loss did not improve"""
    clip: PositiveFloat = 0.25
    """largest global norm of the gradients, over the parameters of both processes"""
    batch_size: Positive = 20
    """training batch size (parallel text streams)"""
    bptt: Positive = 35
    """sequence length of one training window (backpropagation through time)"""
    eval_batch_size: Positive = 10
    """batch size for the valid and test sets"""
    max_batches: Optional[Positive] = None
    """train only the first N batches of each epoch (tiny runs); not given: every batch (--check-gradients: 2)"""
    seed: Seed = 1111
    """random seed: the same seed gives the same weights in the distributed and the one-process model"""
    log_interval: Positive = 200
    """training batches between two log lines"""
    # Data
    data_dir: Optional[DataDir] = None
    """folder with train.txt, valid.txt and test.txt (or a wikitext-2 folder holding them), any text in that format;
    not given: WikiText-2, downloaded into the per-user cache on first use"""
    # Output and checkpoints
    save: Optional[OutFile] = None
    """write the model with the best valid loss to this file, for --generate or for one process; not given: not saved"""
    checkpoint_dir: Optional[OutDir] = None
    """write a checkpoint of the whole run (both processes) to rpc_rnn.pt in this folder after every epoch;
    not given: no checkpoints"""
    checkpoint_interval: Optional[Positive] = None
    """also write that checkpoint every N training batches within an epoch; not given: after each epoch only"""
    resume: bool = False
    """continue from the checkpoint in --checkpoint-dir, if there is one (else start from the beginning): on a CPU,
    exactly as if the run had never stopped"""
    # Sampling from a saved model
    generate: Optional[Positive] = None
    """sample N words from the --load file in this process, then exit; not given: train"""
    load: Optional[InFile] = None
    """the file --generate samples from: written by --save, or a --checkpoint-dir checkpoint"""
    temperature: PositiveFloat = 1.0
    """sampling temperature for --generate (lower: more conservative text)"""
    # Devices and launch
    cuda: bool = False
    """embedding and decoder on the ps's GPU, the LSTM on the trainer's; RPC device maps move the tensors"""
    rpc_timeout: Seconds = 60.0
    """an RPC to a peer that is stuck fails after this long and ends the run (a dead peer is noticed at once); a
    spawned process stopped for half of it is named"""
    # Beyond the tutorial
    ship_logits: bool = False
    """the tutorial's path: the ps sends the decoder's logits back and the trainer computes the loss (otherwise the
    loss is computed on the ps)"""
    check_gradients: bool = False
    """run the first --max-batches batches both distributed and in one process, report the largest differences of
    loss, clipped gradients and updated weights, then exit; needs --dropout 0"""


def validate(args):
    """The rules that involve several flags, the machine or the launcher's variables (each flag's own rule is its
    type in Args), checked before any data is read: each broken rule is one line and exit status 2."""
    check(0 <= args.dropout < 1, f"--dropout {args.dropout}: not from 0 up to, not including, 1")
    check(not args.cuda or common.cuda_device_count() > 0, "--cuda given but no CUDA GPU found; run without --cuda")
    if args.generate:
        check(args.load, "--generate needs a saved model: pass --load FILE (written by --save or --checkpoint-dir)")
        check(not (args.save or args.checkpoint_dir or args.resume or args.check_gradients),
              "--generate only samples from --load; drop --save, --checkpoint-dir, --resume and --check-gradients")
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
    if args.checkpoint_dir and Path(args.checkpoint_dir).is_dir():
        common.output_file("--checkpoint-dir", str(checkpoint_path(args)))
        check(args.save is None or Path(args.save).resolve() != checkpoint_path(args).resolve(),
              f"--save {args.save} is the checkpoint of --checkpoint-dir; pass another file")


# ---------------------------------------------------------------------------------------------------------
# The tutorial's model: the embedding table and the decoder live on the ps, the LSTM on the trainer
# ---------------------------------------------------------------------------------------------------------

def settle(module):
    """Wait until the GPU work queued on the module's device has finished, whatever stream it was queued on.

    TensorPipe runs every RPC on CUDA streams of its own, drawn from a pool (pytorch/pytorch#57960), and orders only
    the tensors a call receives or returns. A call that writes tensors it does not return (building a piece, clipping
    gradients, loading weights, DistributedOptimizer.step, which synchronises nothing) could otherwise return before
    its writes are done, and a call that reads what another call wrote (the gradients backward left in the autograd
    context, the weights a step updated) could read them early. Such calls settle the device they touch: writers
    last, readers of others' writes first. Nothing to do on the CPU."""
    for device in {param.device for param in module.parameters() if param.is_cuda}:
        torch.cuda.synchronize(device)


class EmbeddingTable(nn.Module):
    """Encoding layers of the RNNModel: token ids -> dropped-out embeddings. Lives on the ps."""

    def __init__(self, ntoken, ninp, dropout, seed, device="cpu"):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        # The ps builds this and the Decoder at the same time, in two RPC threads: drawn from the global RNG, their
        # weights would depend on how the threads interleave. A generator of their own, and no default init
        # (skip_init), keep them reproducible and leave the global RNG to dropout.
        self.encoder = skip_init(nn.Embedding, ntoken, ninp)
        self.encoder.weight.data.uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(seed))
        settle(self.to(device))  # built in an RPC handler

    def forward(self, input):
        return self.drop(self.encoder(input))


class Decoder(nn.Module):
    """LSTM output -> logits over the vocabulary. Lives on the ps."""

    def __init__(self, ntoken, nhid, dropout, seed, device="cpu"):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = skip_init(nn.Linear, nhid, ntoken)  # see EmbeddingTable
        self.decoder.weight.data.uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(seed))
        self.decoder.bias.data.zero_()
        settle(self.to(device))

    def forward(self, output):
        return self.decoder(self.drop(output))

    def loss(self, output, targets):
        """Beyond the tutorial: the mean cross-entropy of the logits, computed where they are made."""
        return F.cross_entropy(self(output).flatten(0, 1), targets.flatten())


def make_lstm(ninp, nhid, nlayers, dropout, seed):
    """The LSTM, initialised from a seed of its own, so that the trainer and a one-process model built with the
    same seed hold the same weights. Built by one thread at a time, so saving and restoring the global RNG is safe."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.LSTM(ninp, nhid, nlayers, dropout=dropout if nlayers > 1 else 0.0)


class RNNModel(nn.Module):
    """Lives on the trainer: the LSTM, and RRefs to the EmbeddingTable and the Decoder that it builds on the ps.
    Piece i is initialised from seed + i."""

    def __init__(self, ps, ntoken, ninp, nhid, nlayers, dropout, seed, device, ps_device, ship_logits=False):
        super().__init__()
        # setup embedding table remotely
        self.emb_table_rref = rpc.remote(ps, EmbeddingTable, args=(ntoken, ninp, dropout, seed, ps_device))
        # setup LSTM locally
        self.rnn = make_lstm(ninp, nhid, nlayers, dropout, seed + 1).to(device)
        # setup decoder remotely
        self.decoder_rref = rpc.remote(ps, Decoder, args=(ntoken, nhid, dropout, seed + 2, ps_device))
        self.ship_logits = ship_logits

    def forward(self, input, hidden):
        # pass input to the remote embedding table and fetch emb tensor back
        emb = self.emb_table_rref.rpc_sync().forward(input)
        output, hidden = self.rnn(emb, hidden)
        # pass output to the remote decoder and get the decoded output back
        decoded = self.decoder_rref.rpc_sync().forward(output)
        return decoded, hidden

    def loss(self, input, targets, hidden):
        """The mean cross-entropy of a window: the tutorial's forward, then the loss here (--ship-logits), or, beyond
        the tutorial, the loss computed on the ps, where the decoder lives, so that one number comes back instead
        of the logits (and the gradient of one number goes out in backward)."""
        if self.ship_logits:
            decoded, hidden = self(input, hidden)
            return F.cross_entropy(decoded.flatten(0, 1), targets.flatten()), hidden
        output, hidden = self.rnn(self.emb_table_rref.rpc_sync().forward(input), hidden)
        return self.decoder_rref.rpc_sync().loss(output, targets), hidden

    def parameter_rrefs(self):
        remote_params = []
        # get RRefs of embedding table
        remote_params.extend(_remote_method(_parameter_rrefs, self.emb_table_rref))
        # create RRefs for local parameters
        remote_params.extend(_parameter_rrefs(self.rnn))
        # get RRefs of decoder
        remote_params.extend(_remote_method(_parameter_rrefs, self.decoder_rref))
        return remote_params

    def train(self, mode=True):
        """nn.Module.train, and the ps's pieces too (their dropout)."""
        super().train(mode)
        for rref in (self.emb_table_rref, self.decoder_rref):
            _remote_method(_set_train_mode, rref, mode)
        return self


def _call_method(method, rref, *args):
    return method(rref.local_value(), *args)


def _remote_method(method, rref, *args):
    """method(the object rref points to, *args), run by RPC where the object lives (the tutorial's helper), for what
    the RRef idiom `rref.rpc_sync().method(*args)` cannot do: call a function that is not a method of the object."""
    return rpc.rpc_sync(rref.owner(), _call_method, args=(method, rref, *args))


def _parameter_rrefs(module):
    return [rpc.RRef(param) for param in module.parameters()]


def _set_train_mode(module, mode):
    module.train(mode)  # and return None: nn.Module.train returns the module, which RPC would send back whole


def init_hidden(rnn, batch_size, device="cpu"):
    """The LSTM's initial (h, c) state: zeros for batch_size streams."""
    shape = (rnn.num_layers, batch_size, rnn.hidden_size)
    return torch.zeros(shape, device=device), torch.zeros(shape, device=device)


def detach_hidden(hidden):
    """Keep the LSTM state across windows but cut the graph, so that backward stops at the window's start."""
    return tuple(h.detach() for h in hidden)


# ---------------------------------------------------------------------------------------------------------
# The tutorial's training loop: distributed autograd and torch's DistributedOptimizer
# ---------------------------------------------------------------------------------------------------------

class PlainSGD(optim.SGD):
    """torch.optim.SGD under a name of its own. DistributedOptimizer swaps the optimizers it knows (optim.SGD among
    them) for TorchScript versions: TorchScript is deprecated, and every owner then prints a DeprecationWarning that
    no warnings filter silences (torch forces it). Any other class it builds on each owner as it is and steps with
    the context's gradients, and only logs that this may be slow under the GIL: see run_trainer."""


def train_step(model, opt, input, targets, hidden, clip):
    """One bptt window: forward and backward across both processes, then one SGD step on each owner. No zero_grad:
    the gradients live in the window's own autograd context, dropped when it ends."""
    with dist_autograd.context() as context_id:
        loss, hidden = model.loss(input, targets, detach_hidden(hidden))
        dist_autograd.backward(context_id, [loss])
        clip_grad_norm(model, context_id, clip)  # beyond the tutorial: the recipe clips
        opt.step(context_id)
        for piece in pieces(model).values():
            run_on(piece, settle)  # the step's writes done before the next window reads the weights (GPU)
    return loss.item(), hidden


def run_trainer(args, corpus, device, ps_device, saved):
    """The trainer's run: epochs of bptt windows, validation after each (lr / 4 when it did not improve, the best
    weights kept), then the test of the best weights. The ps only answers the RPCs this makes."""
    # An optimizer without TorchScript (PlainSGD) makes DistributedOptimizer log a warning about the GIL, which
    # concerns threads training in one process: here each owner of parameters is a process of its own.
    logging.getLogger("torch.distributed.optim.optimizer").setLevel(logging.ERROR)
    model = RNNModel(PS_NAME, len(corpus.words), args.emsize, args.nhid, args.nlayers, args.dropout, args.seed,
                     device, ps_device, args.ship_logits)
    if args.check_gradients:
        return check_gradients(args, corpus, model, device)
    train_data = batchify(corpus.train, args.batch_size, device)
    valid_data, test_data = (batchify(data, args.eval_batch_size, device) for data in (corpus.valid, corpus.test))
    batches = min(math.ceil((train_data.size(0) - 1) / args.bptt), args.max_batches or math.inf)
    run = resume(args, model, saved, device, ps_device) if saved else Progress(lr=args.lr)
    param_rrefs = model.parameter_rrefs()
    while run.epoch <= args.epochs:
        # SGD keeps no state but lr: a new optimizer with this epoch's lr continues exactly where the last one was
        opt = DistributedOptimizer(PlainSGD, param_rrefs, lr=run.lr)
        model.train()
        hidden = run.hidden or init_hidden(model.rnn, args.batch_size, device)
        epoch_start = since = time.perf_counter()
        epoch_tokens = count = tokens = 0
        for batch in range(run.batch, batches):
            input, targets = get_batch(train_data, batch * args.bptt, args.bptt)
            loss, hidden = train_step(model, opt, input, targets, hidden, args.clip)
            run.losses.append(loss)
            count, tokens = count + 1, tokens + targets.numel()
            if (batch + 1) % args.log_interval == 0 or batch + 1 == batches:
                mean = sum(run.losses[-(batch % args.log_interval + 1):]) / (batch % args.log_interval + 1)
                seconds = time.perf_counter() - since
                print(f"epoch {run.epoch} | batch {batch + 1}/{batches} | lr {run.lr:.2f} | "
                      f"{1000 * seconds / count:.1f} ms/batch | loss {mean:.2f} | ppl {math.exp(min(mean, 50)):.1f} | "
                      f"{tokens / seconds / 1000:.1f}k tokens/s", flush=True)
                since, epoch_tokens, count, tokens = time.perf_counter(), epoch_tokens + tokens, 0, 0
            if args.checkpoint_interval and (batch + 1) % args.checkpoint_interval == 0 and batch + 1 < batches:
                write_checkpoint(args, corpus, model, replace(run, batch=batch + 1, hidden=hidden), device, ps_device)
        epoch_seconds = time.perf_counter() - epoch_start
        run.tokens, run.seconds = run.tokens + epoch_tokens, run.seconds + epoch_seconds
        valid_loss = evaluate(model, valid_data, args.bptt, args.eval_batch_size, device)
        print(f"epoch {run.epoch} | valid loss {valid_loss:.2f} | valid ppl {math.exp(min(valid_loss, 50)):.1f} | "
              f"{epoch_seconds:.1f} s/epoch", flush=True)
        if valid_loss < run.best_valid:
            run.best_valid, run.best_state = valid_loss, gathered(model, cpu_state_dict)
            if args.save:
                save_model(args, corpus, run.best_state, valid_loss)
        else:
            run.lr /= 4
        run.epoch, run.batch, run.hidden = run.epoch + 1, 0, None
        write_checkpoint(args, corpus, model, run, device, ps_device)
    if run.best_state is not None:
        load_gathered(model, run.best_state)  # test the weights that were kept, as word_language_model does
    test_loss = evaluate(model, test_data, args.bptt, args.eval_batch_size, device)
    print(f"test loss {test_loss:.2f} | test ppl {math.exp(min(test_loss, 50)):.1f}", flush=True)
    report(args, run, len(corpus.words), test_loss, device, ps_device)


def evaluate(model, data, bptt, batch_size, device):
    """Mean loss per word over a whole split, dropout off. Grad mode does not travel with an RPC: under this no_grad
    the ps still records the autograd graph of its forward, and drops it when the call returns."""
    model.eval()
    total, hidden = 0.0, init_hidden(model.rnn, batch_size, device)
    with torch.no_grad():
        for i in range(0, data.size(0) - 1, bptt):
            input, targets = get_batch(data, i, bptt)
            loss, hidden = model.loss(input, targets, hidden)
            total += input.size(0) * loss.item()
    return total / (data.size(0) - 1)


def run_worker(info, args, corpus, saved):
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
        device, device_maps = torch.device("cpu"), None
        if args.cuda:
            # On one machine with 2 GPUs the trainer takes the second; tensors sent to the ps land on its GPU and
            # the replies come back to the trainer's, by the map instead of .to() calls in the model.
            device = torch.device("cuda", info.local_rank % common.cuda_device_count())
            torch.cuda.set_device(device)
            device_maps = {PS_NAME: {device: ps_device}}
        common.init_rpc(info, TRAINER_NAME, args.rpc_timeout, device_maps=device_maps,
                        devices=[device] if args.cuda else None)
        try:
            run_trainer(args, corpus, device, ps_device, saved)
        except common.RunFailed:  # a full disk, said in one line: end the ps in order, so that it adds nothing
            shut_down_in_order()
            raise
    rpc.shutdown()  # the ps waits here, answering RPCs, until the trainer is done too


def main(argv=None):
    args = common.parse_args(Args, argv)
    validate(args)
    if args.generate:
        return generate(args)
    saved = read_checkpoint(args)
    corpus = Corpus(common.wikitext2_dir(args.data_dir))
    check_corpus(args, corpus, saved)
    common.launch(run_worker, 2, args, corpus, saved, timeout=args.rpc_timeout)


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: real data (word_language_model's vocabulary, batchify and bptt windows)
# ---------------------------------------------------------------------------------------------------------

class Corpus:
    """Token ids of train/valid/test, one vocabulary over all three (as word_language_model does). Built in the
    launching process, before any worker starts, so that a bad file is a one-line error."""

    def __init__(self, folder):
        self.words, self.index = [], {}
        self.train, self.valid, self.test = (self.tokenize(Path(folder) / name)
                                             for name in ("train.txt", "valid.txt", "test.txt"))

    def tokenize(self, path):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
            raise common.UsageError(f"cannot read {path} ({reason}); pass a --data-dir with UTF-8 text files") from None
        check(text.split(), f"{path} holds no words; pass a --data-dir with train/valid/test.txt text")
        ids = []
        for line in text.splitlines():
            for word in line.split() + ["<eos>"]:
                if word not in self.index:
                    self.index[word] = len(self.words)
                    self.words.append(word)
                ids.append(self.index[word])
        return torch.tensor(ids, dtype=torch.long)


def check_corpus(args, corpus, saved):
    """Each split must give every stream of its batch at least one window of two words; a --resume checkpoint must
    have been written for this text."""
    for name, batch_size, flag in (("train", args.batch_size, "--batch-size"),
                                   ("valid", args.eval_batch_size, "--eval-batch-size"),
                                   ("test", args.eval_batch_size, "--eval-batch-size")):
        tokens = getattr(corpus, name).numel()
        check(tokens // batch_size >= 2, f"{name}.txt has {tokens} tokens, too few for {flag} {batch_size}; pass "
                                         f"a smaller {flag} or more text")
    if saved:
        check(saved["vocab"] == corpus.words, f"--resume {checkpoint_path(args)}: written for another text (its "
                                              f"vocabulary differs); pass the same --data-dir or another --checkpoint-dir")


def batchify(data, batch_size, device):
    """[tokens] -> [tokens // batch_size, batch_size]: column j is the j-th slice of the text, read top down."""
    rows = data.size(0) // batch_size
    return data[:rows * batch_size].view(batch_size, rows).t().contiguous().to(device)


def get_batch(source, i, bptt):
    """Window of up to bptt rows starting at row i, and the same window shifted one word ahead as targets."""
    length = min(bptt, source.size(0) - 1 - i)
    return source[i:i + length], source[i + 1:i + 1 + length]


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: clipping on the global norm over both processes, and the pieces where they live
# ---------------------------------------------------------------------------------------------------------

def pieces(model):
    """The model's three pieces under LocalRNNModel's names: RRefs to the ps's two, and the LSTM, which lives here."""
    return {"embedding": model.emb_table_rref, "rnn": model.rnn, "decoder": model.decoder_rref}


def run_on(piece, function, *args):
    """function(piece, *args), run where the piece lives: by RPC for an RRef, here for a module."""
    return function(piece, *args) if isinstance(piece, nn.Module) else _remote_method(function, piece, *args)


def clip_grad_norm(model, context_id, max_norm):
    """torch.nn.utils.clip_grad_norm_ over the gradients of one distributed autograd context, on both processes, to
    the bit: each piece's owner returns the norm of each of its gradients; the trainer takes the norm of these norms
    in the parameters' order (get_total_norm, as clip_grad_norm_ does); each owner scales its gradients in place by
    torch's clip_grads_with_norm_. Returns the norm before clipping."""
    norms = [norm for piece in pieces(model).values() for norm in run_on(piece, grad_norms, context_id)]
    total_norm = nn.utils.get_total_norm(norms)
    for piece in pieces(model).values():
        run_on(piece, clip_grads, context_id, max_norm, total_norm)
    return total_norm.item()


def grad_norms(module, context_id):
    """Where module lives: the norm of each of its gradients in the context, on the CPU."""
    grads = dist_autograd.get_gradients(context_id)
    settle(module)  # backward wrote them
    return [torch.linalg.vector_norm(grads[param]).cpu() for param in module.parameters()]


def clip_grads(module, context_id, max_norm, total_norm):
    """Where module lives: scale its gradients in the context. get_gradients hands out the context's own tensors,
    the ones DistributedOptimizer.step reads, so scaling them in place is what makes the clipping reach the step."""
    grads = dist_autograd.get_gradients(context_id)
    for param in module.parameters():
        param.grad = grads[param]
    nn.utils.clip_grads_with_norm_(module.parameters(), max_norm, total_norm)
    settle(module)


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: the same model in one process, and proof that the distributed math is its math
# ---------------------------------------------------------------------------------------------------------

class LocalRNNModel(nn.Module):
    """The whole model in one process (word_language_model's RNNModel): what --save writes and --generate loads,
    and the reference of --check-gradients. Built from the same seed, it holds the distributed model's weights."""

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


def cpu_state_dict(module):
    """Copies of a module's weights on the CPU (a kept best state must not follow the live weights)."""
    settle(module)  # the last step wrote them
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in module.state_dict().items()}


def context_grads(module, context_id):
    """The gradients of a module's parameters in one distributed autograd context, on the CPU."""
    grads = dist_autograd.get_gradients(context_id)
    settle(module)
    return {name: grads[param].cpu() for name, param in module.named_parameters()}


def load_weights(module, state):
    module.load_state_dict(state)
    settle(module)


def gathered(model, function, *args):
    """function(piece, *args) -> {name: tensor}, run where each piece lives, merged under LocalRNNModel's names."""
    return {f"{piece}.{name}": tensor for piece, module in pieces(model).items()
            for name, tensor in run_on(module, function, *args).items()}


def load_gathered(model, state):
    """Load weights under LocalRNNModel's names into the pieces, where each lives."""
    for piece, module in pieces(model).items():
        run_on(module, load_weights, {name.split(".", 1)[1]: tensor for name, tensor in state.items()
                                      if name.split(".", 1)[0] == piece})


def check_gradients(args, corpus, model, device):
    """Same weights, same batches, in one process and over RPC: report the largest differences of loss, clipped
    gradients and updated weights. Needs --dropout 0: the two runs draw their dropout masks differently."""
    local = LocalRNNModel(len(corpus.words), args.emsize, args.nhid, args.nlayers, args.dropout, args.seed)
    local_opt = PlainSGD(local.parameters(), lr=args.lr)
    opt = DistributedOptimizer(PlainSGD, model.parameter_rrefs(), lr=args.lr)
    train_data = batchify(corpus.train, args.batch_size, "cpu")
    hidden, local_hidden = init_hidden(model.rnn, args.batch_size, device), init_hidden(local.rnn, args.batch_size)
    worst, norms = dict.fromkeys(("loss_diff", "max_grad_diff", "max_param_diff"), 0.0), []
    for batch in range(min(args.max_batches or 2, math.ceil((train_data.size(0) - 1) / args.bptt))):
        input, targets = get_batch(train_data, batch * args.bptt, args.bptt)
        with dist_autograd.context() as context_id:  # train_step, the gradients gathered before the step
            loss, hidden = model.loss(input.to(device), targets.to(device), detach_hidden(hidden))
            dist_autograd.backward(context_id, [loss])
            norms.append(clip_grad_norm(model, context_id, args.clip))
            grads = gathered(model, context_grads, context_id)
            opt.step(context_id)
        local_opt.zero_grad()
        local_loss, local_hidden = local.loss(input, targets, detach_hidden(local_hidden))
        local_loss.backward()
        local_norm = nn.utils.clip_grad_norm_(local.parameters(), args.clip).item()
        local_opt.step()
        weights = gathered(model, cpu_state_dict)
        worst["loss_diff"] = max(worst["loss_diff"], abs(loss.item() - local_loss.item()))
        worst["max_grad_diff"] = max([worst["max_grad_diff"]] + [(grads[name] - param.grad).abs().max().item()
                                                                for name, param in local.named_parameters()])
        worst["max_param_diff"] = max([worst["max_param_diff"]] + [(weights[name] - param).abs().max().item()
                                                                  for name, param in local.state_dict().items()])
        print(f"batch {batch + 1} | loss {loss.item():.6f} vs {local_loss.item():.6f} | grad norm {norms[-1]:.5f} "
              f"vs {local_norm:.5f} | max grad diff {worst['max_grad_diff']:.2e} | "
              f"max weight diff {worst['max_param_diff']:.2e}", flush=True)
    common.emit_result(SCRIPT, mode="check-gradients", batches=len(norms), grad_norms=norms, clip=args.clip,
                       compared=len(grads), **worst)


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: reporting, checkpoints and exact resume, sampling
# ---------------------------------------------------------------------------------------------------------

@dataclass
class Progress:
    """Lives on the trainer: where the run stands. With the weights of both processes and the RNG states that draw
    their dropout masks, it is all a checkpoint needs to continue exactly (SGD keeps no state but lr)."""
    lr: float
    epoch: int = 1
    batch: int = 0  # the next training batch of `epoch`
    hidden: Optional[tuple] = None  # the LSTM state before `batch`, when a checkpoint cut an epoch (None: zeros)
    best_valid: float = math.inf
    best_state: Optional[dict] = None  # the weights with the best valid loss, under LocalRNNModel's names
    losses: list = field(default_factory=list)  # of every training batch
    tokens: int = 0  # trained on in `seconds` of training, over the whole run
    seconds: float = 0.0


def report(args, run, ntoken, test_loss, device, ps_device):
    window = max(1, min(10, len(run.losses) // 4))
    common.emit_result(SCRIPT, mode="ship-logits" if args.ship_logits else "loss-on-ps", ntoken=ntoken,
                       devices={PS_NAME: str(ps_device), TRAINER_NAME: str(device)},
                       batches=len(run.losses), first_loss=sum(run.losses[:window]) / window,
                       last_loss=sum(run.losses[-window:]) / window, losses=[round(x, 6) for x in run.losses[:200]],
                       valid_loss=run.best_valid, valid_ppl=math.exp(min(run.best_valid, 50)), test_loss=test_loss,
                       test_ppl=math.exp(min(test_loss, 50)), lr=run.lr,
                       tokens_per_s=run.tokens / run.seconds if run.seconds else 0.0)


def model_config(args, ntoken):
    """LocalRNNModel's arguments: LocalRNNModel(**config) builds the model a checkpoint's weights load into."""
    return {"ntoken": ntoken, "ninp": args.emsize, "nhid": args.nhid, "nlayers": args.nlayers, "dropout": args.dropout}


def save_model(args, corpus, state, valid_loss):
    """--save: the best weights so far, for LocalRNNModel: `LocalRNNModel(**ckpt["config"]).load_state_dict(
    ckpt["model"])`, with ckpt = torch.load(path). A failed write keeps the previous file (common.save_checkpoint)."""
    common.save_checkpoint(args.save, SCRIPT, {"model": state, "vocab": corpus.words, "valid_loss": valid_loss,
                                               "config": model_config(args, len(corpus.words))}, "--save")


CHECKPOINT_KEYS = ("model", "vocab", "config", "recipe", "progress", "rng")


def checkpoint_path(args):
    return Path(args.checkpoint_dir) / "rpc_rnn.pt"


def recipe(args):
    """The flags that a resumed run must share with the run that wrote the checkpoint: they change the math."""
    names = ("emsize", "nhid", "nlayers", "dropout", "batch_size", "eval_batch_size", "bptt", "lr", "clip", "seed",
             "max_batches")
    return {name: getattr(args, name) for name in names}


def write_checkpoint(args, corpus, model, run, device, ps_device):
    """The whole run, from both processes, in one file in --checkpoint-dir, written by the trainer through
    common.save_checkpoint (atomic): the weights (also loadable by --generate), the progress, and the RNG states of
    both processes, which draw the dropout masks."""
    if args.checkpoint_dir:
        progress = {**vars(run), "hidden": run.hidden and tuple(h.detach().cpu() for h in run.hidden)}
        rng = {TRAINER_NAME: rng_state(device), PS_NAME: rpc.rpc_sync(PS_NAME, rng_state, args=(ps_device,))}
        common.save_checkpoint(checkpoint_path(args), SCRIPT, {
            "model": gathered(model, cpu_state_dict), "vocab": corpus.words, "recipe": recipe(args),
            "config": model_config(args, len(corpus.words)), "progress": progress, "rng": rng}, "--checkpoint-dir")


def read_checkpoint(args):
    """The checkpoint that --resume continues, or None when there is none yet (the run starts from the beginning).
    Read once, before the data and before any process starts; verified (common.load_checkpoint) and checked against
    these flags and the model they build (its vocabulary is checked against the text once that is read)."""
    path = checkpoint_path(args) if args.resume else None
    if path is None or not path.exists():
        return None
    saved = common.load_checkpoint(path, SCRIPT, "--resume", keys=CHECKPOINT_KEYS)
    differ = [f"--{name.replace('_', '-')} {value}" for name, value in saved["recipe"].items()
              if recipe(args).get(name) != value]
    check(not differ, f"--resume {path}: written with {', '.join(differ)}; pass the same flags or another "
                      f"--checkpoint-dir")
    check(set(saved["progress"]) == {item.name for item in fields(Progress)},
          f"--resume {path}: written by another version of rpc_rnn.py; pass another --checkpoint-dir")
    done = saved["progress"]["epoch"] - 1
    check(done <= args.epochs, f"--resume {path}: holds {done} finished epochs, more than --epochs {args.epochs}; "
                               f"pass a larger --epochs or another --checkpoint-dir")
    model = LocalRNNModel(**model_config(args, len(saved["vocab"])))
    for weights in filter(None, (saved["model"], saved["progress"]["best_state"])):
        common.check_fits(model, weights, "--resume", path)
    return saved


def resume(args, model, saved, device, ps_device):
    """Put both processes back where the checkpoint was taken: weights, RNG states, progress."""
    load_gathered(model, saved["model"])
    set_rng_state(saved["rng"][TRAINER_NAME], device)
    rpc.rpc_sync(PS_NAME, set_rng_state, args=(saved["rng"][PS_NAME], ps_device))
    run = Progress(**saved["progress"])
    run.hidden = run.hidden and tuple(h.to(device) for h in run.hidden)
    print(f"resuming at epoch {run.epoch} batch {run.batch} from {checkpoint_path(args)}", flush=True)
    return run


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
    shutdown, then ends cleanly instead of logging TensorPipe's warning about a pipe its peer closed. If the
    rendezvous store cannot be written either (a file store on a full disk), that warning may follow the line."""
    try:
        rpc.shutdown()
    except (RuntimeError, OSError):  # torch's store errors (DistStoreError) are RuntimeErrors
        pass


def generate(args):
    """Load a saved model into LocalRNNModel, checked to fit, and sample words from it one at a time."""
    saved = common.load_checkpoint(args.load, SCRIPT, "--load", keys=("model", "vocab", "config"))
    words = saved["vocab"]
    check(len(words) == saved["config"].get("ntoken"), f"--load {args.load}: its vocabulary does not fit its "
                                                       f"model; pass a file written by rpc_rnn.py")
    model = common.check_fits(LocalRNNModel(**saved["config"]), saved["model"], "--load", args.load).eval()
    common.seed_everything(args.seed)
    input, hidden = torch.randint(len(words), (1, 1)), init_hidden(model.rnn, 1)
    sampled = []
    with torch.no_grad():
        for _ in range(args.generate):
            logits, hidden = model(input, hidden)
            input.fill_(torch.multinomial(F.softmax(logits.view(-1) / args.temperature, dim=0), 1).item())
            sampled.append(words[input.item()])
    for start in range(0, len(sampled), 20):
        print(" ".join(sampled[start:start + 20]), flush=True)
    common.emit_result(SCRIPT, mode="generate", words=len(sampled), vocab=len(words))


if __name__ == "__main__":
    common.run_main(main)
