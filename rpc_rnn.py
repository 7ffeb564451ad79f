"""Model-parallel LSTM word language model over RPC: a parameter server and a trainer, trained on WikiText-2.

The model of pytorch/examples' word_language_model (embedding -> 2-layer LSTM -> linear decoder) is cut in
two processes. Rank 0, the parameter server "ps", owns the embedding table and the decoder; rank 1, the
"trainer", owns the LSTM and drives training. The trainer creates the ps's modules with `rpc.remote` and runs
the forward pass as if the model were local: an RPC stands where a single-machine model-parallel version would
call `.to(device)`. Backward runs across both processes with `dist_autograd.backward` inside a
`dist_autograd.context()`, gradients are clipped on their global norm over the parameters of both processes,
and a `DistributedOptimizer` applies SGD on each owner. The loss is computed where the decoder lives: the
trainer sends the LSTM output and the targets to the ps and receives one number, instead of the tutorial's
logits (35 x 20 x 33k floats, about 93 MB per batch on WikiText-2); `--ship-logits` keeps the tutorial's path.
`--check-gradients` proves the distributed math: it runs the same batches through the same model in one
process and reports the largest difference of the (clipped) gradients and of the weights after each step.

Commands:
    python rpc_rnn.py --data-dir ../shared/data                   # CPU, 2 processes, classic recipe
    python rpc_rnn.py --data-dir ../shared/data --epochs 1 --max-batches 200 --emsize 64 --nhid 64
    python rpc_rnn.py --cuda --epochs 6 --save lm.pt              # embedding + decoder on a GPU, LSTM on another
    python rpc_rnn.py --generate 100 --load lm.pt                 # sample 100 words, one process, no RPC
    python rpc_rnn.py --check-gradients --dropout 0 --clip 0.05   # distributed vs one-process gradients
    torchrun --standalone --nproc_per_node=2 rpc_rnn.py --data-dir ../shared/data
    torchrun --nnodes=2 --nproc_per_node=1 --node_rank=R --master_addr=HOST --master_port=PORT rpc_rnn.py
      (node_rank 0 becomes the ps, node_rank 1 the trainer)

Last lines of `python rpc_rnn.py --data-dir ../shared/data --epochs 1 --max-batches 200 --emsize 64 --nhid 64`
(2-core CPU shared with other work, 4 min 46 s, more than half of it evaluating the full valid and test sets
with the 33k-word decoder):
    epoch 1 | batch 200/200 | lr 20.00 | 560.5 ms/batch | loss 7.66 | ppl 2123.5 | 1.2k tokens/s
    epoch 1 | valid loss 7.04 | valid ppl 1143.5 | 112.1 s/epoch
    test loss 6.97 | test ppl 1065.6
    {"script": "rpc_rnn", "mode": "loss-on-ps", "ntoken": 33278, "batches": 200, "first_loss": 9.83, ...}
"""

import math
import time
from dataclasses import dataclass
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
    """checkpoint to sample from with --generate"""
    generate: Optional[int] = None
    """sample this many words from the --load checkpoint in this process, then exit"""
    temperature: float = 1.0
    """sampling temperature for --generate (lower: more conservative text)"""
    check_gradients: bool = False
    """run --max-batches (default 2) batches both distributed and in one process and report the differences"""
    cuda: bool = False
    """embedding and decoder on the ps's GPU, LSTM on the trainer's; RPC device maps move the tensors"""
    rpc_timeout: float = 60.0
    """seconds before an RPC to a stuck peer fails and ends the run (a dead peer is noticed at once); one decoder
    call on the full 33k-word vocabulary was seen to take 21 s on a 2-core machine under heavy load"""


# ---------------------------------------------------------------------------------------------------------
# Data: word vocabulary with <eos>, streams of token ids, bptt windows
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
            raise UsageError(f"cannot read {path} ({error}); pass a --data-dir with UTF-8 text files") from None
        ids = []
        for line in text.splitlines():
            for word in line.split() + ["<eos>"]:
                if word not in self.index:
                    self.index[word] = len(self.words)
                    self.words.append(word)
                ids.append(self.index[word])
        check(len(text.split()) > 0, f"{path} holds no words; pass a --data-dir with train/valid/test.txt text")
        return torch.tensor(ids, dtype=torch.long)


def batchify(data, batch_size, device):
    """[tokens] -> [tokens // batch_size, batch_size]: column j is the j-th slice of the text, read top down."""
    rows = data.size(0) // batch_size
    return data[:rows * batch_size].view(batch_size, rows).t().contiguous().to(device)


def get_batch(source, i, bptt):
    """Window of up to bptt rows starting at row i, and the same window shifted one word ahead as targets."""
    length = min(bptt, source.size(0) - 1 - i)
    return source[i:i + length], source[i + 1:i + 1 + length]


def zero_hidden(lstm, batch_size, device="cpu"):
    """The LSTM's initial (h, c) state for batch_size streams."""
    shape = (lstm.num_layers, batch_size, lstm.hidden_size)
    return torch.zeros(shape, device=device), torch.zeros(shape, device=device)


def lm_loss(logits, targets):
    """Mean cross-entropy of next-word logits [rows, batch, ntoken] against target ids [rows, batch]."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def detach_hidden(hidden):
    """Keep the LSTM state across windows but cut the graph, so backward stops at the window's start."""
    return tuple(h.detach() for h in hidden)


# ---------------------------------------------------------------------------------------------------------
# Model: three pieces, put together in one process (RNNModel) or over RPC (DistributedRNNModel)
# ---------------------------------------------------------------------------------------------------------

def make_lstm(ninp, nhid, nlayers, dropout, seed):
    """The LSTM, initialised from a seed of its own, so that the trainer and a one-process model built with the
    same seed hold the same weights. Only ever built by one thread at a time (the trainer's main thread), which
    makes the save/restore of the global RNG below safe."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.LSTM(ninp, nhid, nlayers, dropout=dropout if nlayers > 1 else 0.0)


class EmbeddingTable(nn.Module):
    """Token ids -> dropped-out embeddings. Lives on the ps (distributed) or inside RNNModel (one process)."""

    def __init__(self, ntoken, ninp, dropout, seed):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        # The ps builds the embedding and the decoder at the same time, in two RPC threads: drawn from the global
        # RNG, their weights would depend on how the threads interleave. A generator of their own, and no
        # default init (skip_init), keep them reproducible and leave the global RNG to dropout.
        self.encoder = skip_init(nn.Embedding, ntoken, ninp)
        self.encoder.weight.data.uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(seed))

    def forward(self, input):
        return self.drop(self.encoder(input))


class Decoder(nn.Module):
    """LSTM output -> logits over the vocabulary, or straight to the loss. Lives on the ps or in RNNModel."""

    def __init__(self, ntoken, nhid, dropout, seed):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = skip_init(nn.Linear, nhid, ntoken)  # see EmbeddingTable
        self.decoder.weight.data.uniform_(-0.1, 0.1, generator=torch.Generator().manual_seed(seed))
        self.decoder.bias.data.zero_()

    def forward(self, output):
        return self.decoder(self.drop(output))

    def loss(self, output, targets):
        return lm_loss(self.forward(output), targets)


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


# Functions the trainer runs on the ps by RPC. Each receives an RRef that the ps owns.

def settle(tensors):
    """Wait until the GPU work queued on these tensors' devices has finished, whatever stream it was queued on.

    TensorPipe runs every RPC on CUDA streams of its own (pytorch/pytorch#57960) and orders only the tensors a call
    receives or returns. A call that writes tensors it does not return (an optimizer step, scaling gradients,
    loading weights) could otherwise return before its writes are done, and a call that reads what another call
    wrote (the gradients that backward left in the autograd context, the weights a step updated) could read them
    early. Such calls settle the devices they touch first and last. Nothing to do on the CPU.
    """
    for device in {tensor.device for tensor in tensors if tensor.is_cuda}:
        torch.cuda.synchronize(device)


def build_on_owner(module_class, device, *args):
    return module_class(*args).to(device)


def call_on_owner(module_rref, method, grad_enabled, *args):
    # The caller's grad mode travels along: evaluation under no_grad builds no autograd graph on the ps either.
    with torch.set_grad_enabled(grad_enabled):
        return getattr(module_rref.local_value(), method)(*args)


def parameter_rrefs_on_owner(module_rref):
    return [rpc.RRef(param) for param in module_rref.local_value().parameters()]


def set_training_on_owner(module_rref, mode):
    module_rref.local_value().train(mode)


def state_dict_on_owner(module_rref):
    state = module_rref.local_value().state_dict()
    settle(state.values())
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in state.items()}


def load_state_dict_on_owner(module_rref, state):
    module = module_rref.local_value()
    module.load_state_dict(state)
    settle(module.parameters())


def context_grads_on_owner(module_rref, context_id):
    grads = dist_autograd.get_gradients(context_id)
    settle(grads.values())
    return {name: grads[param].cpu() for name, param in module_rref.local_value().named_parameters()
            if param in grads}


def call_remote(module_rref, method, *args):
    return rpc.rpc_sync(module_rref.owner(), call_on_owner, args=(module_rref, method, torch.is_grad_enabled(), *args))


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

    def grad_square_sum(self, context_id):
        """Sum of the squared norms of this owner's gradients in the context."""
        grads = self.context_grads(context_id)
        settle(grads)
        return sum(torch.linalg.vector_norm(grad).item() ** 2 for grad in grads)

    def scale_grads(self, context_id, factor):
        # get_gradients hands out the context's own tensors, the ones step() reads: scaling them in place is what
        # makes the clipping reach the update.
        grads = self.context_grads(context_id)
        settle(grads)
        for grad in grads:
            grad.mul_(factor)
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
        for rref in param_rrefs:
            by_owner.setdefault(rref.owner(), []).append(rref)
        self.local_optimizers = [rpc.remote(owner, LocalOptimizer, args=(optimizer_class, rrefs), kwargs=options)
                                 for owner, rrefs in by_owner.items()]

    def _on_every_owner(self, method, *args):
        return torch.futures.wait_all([getattr(rref.rpc_async(), method)(*args) for rref in self.local_optimizers])

    def clip_grad_norm(self, context_id, max_norm):
        """clip_grad_norm_ over parameters spread on several processes: each owner reports the squared norm of
        its gradients in the context, the trainer adds them up, and every owner scales its gradients by the same
        factor. Returns the norm before clipping."""
        total_norm = math.sqrt(sum(self._on_every_owner("grad_square_sum", context_id)))
        factor = max_norm / (total_norm + 1e-6)  # the same formula as torch.nn.utils.clip_grad_norm_
        if factor < 1.0:
            self._on_every_owner("scale_grads", context_id, factor)
        return total_norm

    def step(self, context_id):
        self._on_every_owner("step", context_id)

    def set_lr(self, lr):
        self._on_every_owner("set_lr", lr)


class DistributedRNNModel(nn.Module):
    """Lives on the trainer: holds the LSTM, and RRefs to the embedding table and the decoder on the ps."""

    def __init__(self, ntoken, ninp, nhid, nlayers, dropout, seed, device, ps_device, ship_logits):
        super().__init__()
        self.ship_logits = ship_logits
        self.embedding_rref = rpc.remote(PS_NAME, build_on_owner,
                                         args=(EmbeddingTable, ps_device, ntoken, ninp, dropout, seed))
        self.rnn = make_lstm(ninp, nhid, nlayers, dropout, seed + 1).to(device)
        self.decoder_rref = rpc.remote(PS_NAME, build_on_owner,
                                       args=(Decoder, ps_device, ntoken, nhid, dropout, seed + 2))
        self.remote_pieces = {"embedding": self.embedding_rref, "decoder": self.decoder_rref}

    def loss(self, input, targets, hidden):
        embedded = call_remote(self.embedding_rref, "forward", input)
        output, hidden = self.rnn(embedded, hidden)
        if self.ship_logits:
            loss = lm_loss(call_remote(self.decoder_rref, "forward", output), targets)
        else:
            loss = call_remote(self.decoder_rref, "loss", output, targets)
        return loss, hidden

    def init_hidden(self, batch_size, device):
        return zero_hidden(self.rnn, batch_size, device)

    def parameter_rrefs(self):
        rrefs = rpc.rpc_sync(PS_NAME, parameter_rrefs_on_owner, args=(self.embedding_rref,))
        rrefs += [rpc.RRef(param) for param in self.rnn.parameters()]
        rrefs += rpc.rpc_sync(PS_NAME, parameter_rrefs_on_owner, args=(self.decoder_rref,))
        return rrefs

    def train(self, mode=True):
        super().train(mode)
        for rref in self.remote_pieces.values():
            rpc.rpc_sync(rref.owner(), set_training_on_owner, args=(rref, mode))
        return self

    def gathered_state_dict(self):
        """The weights of both processes under RNNModel's names, on the CPU: a checkpoint RNNModel loads."""
        # Copies: a kept best state must not follow the live weights as training goes on.
        state = {f"rnn.{name}": tensor.detach().to("cpu", copy=True) for name, tensor in self.rnn.state_dict().items()}
        for piece, rref in self.remote_pieces.items():
            state.update({f"{piece}.{name}": tensor
                          for name, tensor in rpc.rpc_sync(rref.owner(), state_dict_on_owner, args=(rref,)).items()})
        return state

    def load_gathered_state_dict(self, state):
        self.rnn.load_state_dict({name[4:]: tensor for name, tensor in state.items() if name.startswith("rnn.")})
        for piece, rref in self.remote_pieces.items():
            part = {name[len(piece) + 1:]: tensor for name, tensor in state.items() if name.startswith(piece + ".")}
            rpc.rpc_sync(rref.owner(), load_state_dict_on_owner, args=(rref, part))

    def context_grads(self, context_id):
        """The gradients of one autograd context, from both processes, under RNNModel's names."""
        local = dist_autograd.get_gradients(context_id)
        settle(local.values())
        grads = {f"rnn.{name}": local[param].cpu() for name, param in self.rnn.named_parameters() if param in local}
        for piece, rref in self.remote_pieces.items():
            grads.update({f"{piece}.{name}": grad for name, grad in
                          rpc.rpc_sync(rref.owner(), context_grads_on_owner, args=(rref, context_id)).items()})
        return grads


# ---------------------------------------------------------------------------------------------------------
# Roles: the trainer drives everything; the ps only answers RPCs
# ---------------------------------------------------------------------------------------------------------

def train_step(model, optimizer, input, targets, hidden, clip):
    """One window: forward and backward across both processes, global clipping, one SGD step on every owner.
    No zero_grad: each step's gradients live in its own autograd context, dropped when the context ends."""
    with dist_autograd.context() as context_id:
        loss, hidden = model.loss(input, targets, hidden)
        dist_autograd.backward(context_id, [loss])
        optimizer.clip_grad_norm(context_id, clip)
        optimizer.step(context_id)
    return loss.item(), hidden


def evaluate(model, data, bptt, batch_size, device):
    model.eval()
    total, hidden = 0.0, model.init_hidden(batch_size, device)
    with torch.no_grad():
        for i in range(0, data.size(0) - 1, bptt):
            input, targets = get_batch(data, i, bptt)
            loss, hidden = model.loss(input, targets, hidden)
            total += input.size(0) * loss.item()
    return total / (data.size(0) - 1)


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
            grads = model.context_grads(context_id)
            optimizer.step(context_id)
        local_optimizer.zero_grad()
        local_loss, local_hidden = local.loss(input, targets, local_hidden)
        local_loss.backward()
        local_norm = nn.utils.clip_grad_norm_(local.parameters(), args.clip).item()
        local_optimizer.step()
        params = model.gathered_state_dict()
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


def run_trainer(args, corpus, device, ps_device):
    ntoken = len(corpus.words)
    model = DistributedRNNModel(ntoken, args.emsize, args.nhid, args.nlayers, args.dropout, args.seed, device,
                                ps_device, args.ship_logits)
    if args.check_gradients:
        check_gradients(args, corpus, model, device)
        return
    train_data = batchify(corpus.train, args.batch_size, device)
    valid_data = batchify(corpus.valid, args.eval_batch_size, device)
    test_data = batchify(corpus.test, args.eval_batch_size, device)
    lr, best_valid, best_state = args.lr, math.inf, None
    optimizer = DistributedOptimizer(optim.SGD, model.parameter_rrefs(), lr=lr)
    batches_per_epoch = math.ceil((train_data.size(0) - 1) / args.bptt)
    if args.max_batches:
        batches_per_epoch = min(batches_per_epoch, args.max_batches)
    losses, train_tokens, train_seconds, valid_loss = [], 0, 0.0, math.nan
    for epoch in range(1, args.epochs + 1):
        epoch_start = time.perf_counter()
        model.train()
        hidden = model.init_hidden(args.batch_size, device)
        interval_loss, interval_start, interval_tokens = 0.0, time.perf_counter(), 0
        for batch in range(batches_per_epoch):
            input, targets = get_batch(train_data, batch * args.bptt, args.bptt)
            loss, hidden = train_step(model, optimizer, input, targets, detach_hidden(hidden), args.clip)
            losses.append(loss)
            interval_loss += loss
            interval_tokens += targets.numel()
            if (batch + 1) % args.log_interval == 0 or batch + 1 == batches_per_epoch:
                seconds = time.perf_counter() - interval_start
                steps = (batch % args.log_interval) + 1
                mean = interval_loss / steps
                print(f"epoch {epoch} | batch {batch + 1}/{batches_per_epoch} | lr {lr:.2f} | "
                      f"{1000 * seconds / steps:.1f} ms/batch | loss {mean:.2f} | ppl {math.exp(min(mean, 50)):.1f} | "
                      f"{interval_tokens / seconds / 1000:.1f}k tokens/s", flush=True)
                train_tokens += interval_tokens
                train_seconds += seconds
                interval_loss, interval_start, interval_tokens = 0.0, time.perf_counter(), 0
        train_time = time.perf_counter() - epoch_start
        valid_loss = evaluate(model, valid_data, args.bptt, args.eval_batch_size, device)
        print(f"epoch {epoch} | valid loss {valid_loss:.2f} | valid ppl {math.exp(min(valid_loss, 50)):.1f} | "
              f"{train_time:.1f} s/epoch", flush=True)
        if valid_loss < best_valid:
            best_valid, best_state = valid_loss, model.gathered_state_dict()
            if args.save:
                save_checkpoint(args, corpus, best_state, valid_loss)
        else:
            lr /= 4
            optimizer.set_lr(lr)
    if best_state is not None and valid_loss > best_valid:
        model.load_gathered_state_dict(best_state)  # test the model that was kept, as pytorch/examples does
    test_loss = evaluate(model, test_data, args.bptt, args.eval_batch_size, device)
    print(f"test loss {test_loss:.2f} | test ppl {math.exp(min(test_loss, 50)):.1f}", flush=True)
    window = max(1, min(10, len(losses) // 4))
    common.emit_result(SCRIPT, mode="ship-logits" if args.ship_logits else "loss-on-ps", ntoken=ntoken,
                       devices={PS_NAME: str(ps_device), TRAINER_NAME: str(device)},
                       batches=len(losses), first_loss=sum(losses[:window]) / window,
                       last_loss=sum(losses[-window:]) / window, losses=[round(x, 6) for x in losses[:200]],
                       valid_loss=best_valid, valid_ppl=math.exp(min(best_valid, 50)), test_loss=test_loss,
                       test_ppl=math.exp(min(test_loss, 50)), lr=lr,
                       tokens_per_s=train_tokens / train_seconds if train_seconds else 0.0)


def save_checkpoint(args, corpus, state, valid_loss):
    common.save_atomic({"model": state, "vocab": corpus.words, "valid_loss": valid_loss,
                        "config": {"ntoken": len(corpus.words), "ninp": args.emsize, "nhid": args.nhid,
                                   "nlayers": args.nlayers, "dropout": args.dropout}}, args.save)


def generate(args):
    """Load a checkpoint into the plain RNNModel and sample words from it, one at a time."""
    try:
        checkpoint = torch.load(args.load, map_location="cpu", weights_only=True)
        model = RNNModel(**checkpoint["config"])
        model.load_state_dict(checkpoint["model"])
        words = checkpoint["vocab"]
    except Exception as error:  # whatever is wrong with a file the user named is theirs to fix
        raise UsageError(f"cannot load checkpoint {args.load} ({str(error).splitlines()[0]}); pass a file "
                         f"written by --save") from None
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


def run_worker(info, args, corpus):
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
        run_trainer(args, corpus, device, ps_device)
    # The ps waits here, answering RPCs, until the trainer is done too.
    rpc.shutdown()


def main():
    args = common.parse_args(Args)
    check(args.emsize > 0 and args.nhid > 0 and args.nlayers > 0, "--emsize, --nhid and --nlayers must be > 0")
    check(0.0 <= args.dropout < 1.0, f"--dropout must be in [0, 1), got {args.dropout}")
    check(args.batch_size > 0, f"--batch-size must be > 0, got {args.batch_size}")
    check(args.eval_batch_size > 0, f"--eval-batch-size must be > 0, got {args.eval_batch_size}")
    check(args.bptt > 0, f"--bptt must be > 0, got {args.bptt}")
    check(args.lr > 0 and args.clip > 0, "--lr and --clip must be > 0")
    check(args.epochs > 0, f"--epochs must be > 0, got {args.epochs}")
    check(args.max_batches is None or args.max_batches > 0, "--max-batches must be > 0")
    check(args.log_interval > 0, f"--log-interval must be > 0, got {args.log_interval}")
    check(args.rpc_timeout > 0, "--rpc-timeout must be > 0")
    check(not args.cuda or common.cuda_device_count() > 0, "--cuda given but no CUDA GPU found; run without --cuda")
    if args.generate is not None:
        check(args.generate > 0, f"--generate must be > 0, got {args.generate}")
        check(args.temperature > 0, f"--temperature must be > 0, got {args.temperature}")
        check(args.load is not None, "--generate needs a checkpoint: pass --load PATH (written by --save)")
        check(Path(args.load).is_file(), f"--load {args.load} is not a file; pass a checkpoint written by --save")
        generate(args)
        return
    check(not args.check_gradients or args.dropout == 0, "--check-gradients needs --dropout 0 (masks differ)")
    check(common.process_count(2) == 2,
          "rpc_rnn.py runs as exactly 2 processes (ps and trainer); pass --nproc_per_node=2 to torchrun")
    if args.save:
        common.check_output_file("--save", args.save)
    corpus = Corpus(common.wikitext2_dir(args.data_dir))
    check(corpus.train.numel() // args.batch_size >= 2,
          f"train.txt has {corpus.train.numel()} tokens, too few for --batch-size {args.batch_size}")
    for name in ("valid", "test"):
        check(getattr(corpus, name).numel() // args.eval_batch_size >= 2,
              f"{name}.txt has {getattr(corpus, name).numel()} tokens, too few for "
              f"--eval-batch-size {args.eval_batch_size}")
    common.launch(run_worker, 2, args, corpus, timeout=args.rpc_timeout)


if __name__ == "__main__":
    common.run_main(main)
