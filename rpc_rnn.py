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
    python rpc_rnn.py --checkpoint-dir ckpt --resume      # a checkpoint after each epoch; run it again to continue
    torchrun --standalone --nproc-per-node 2 rpc_rnn.py
    torchrun --standalone --nproc-per-node 2 --max-restarts 3 rpc_rnn.py --checkpoint-dir ckpt --resume
    # two nodes (node rank 0 is the ps, 1 the trainer); MASTER_ADDR = node 0's address on a trusted network:
    torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 1 --master-addr $MASTER_ADDR --master-port 29400 \\
        rpc_rnn.py

The trainer prints (the ps says nothing unless it fails); the last lines of a run have this shape:
    epoch 1 | batch 200/200 | lr 20.00 | <t> ms/batch | loss <loss> | ppl <perplexity>
    epoch 1 | valid loss <loss> | valid ppl <perplexity> | <t> s/epoch
    test loss <loss> | test ppl <perplexity>
    {"script": "rpc_rnn", "mode": "loss-on-ps", "ntoken": 33278, ..., "batches": 200, "losses": [...], ...}
"""

import dataclasses
import logging
import math
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed.autograd as dist_autograd
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed import rpc
from torch.distributed.optim import DistributedOptimizer

import common
from common import Positive, PositiveFloat, Seed, check

PS_NAME = "ps"
TRAINER_NAME = "trainer"
SCRIPT = "rpc_rnn"
EVAL_BATCH_SIZE = 10  # word_language_model's, for the valid and test sets
CHECKPOINT = "rpc_rnn.pt"  # the file in --checkpoint-dir


@dataclasses.dataclass
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
    max_batches: Positive | None = None
    """train only the first N batches of each epoch; not given: all (2 under --check-gradients)"""
    seed: Seed = 1111
    """random seed: the same seed gives the same weights in the distributed and the one-process model"""
    log_interval: Positive = 200
    """training batches between two log lines"""
    # Data
    data_dir: str | None = None
    """folder with train.txt, valid.txt and test.txt (or a wikitext-2 folder holding them), any text in that format;
    not given: WikiText-2, downloaded into the per-user cache on first use"""
    # Output and checkpoints
    save: str | None = None
    """write the model with the best valid loss to this file, for --generate or for one process; not given: not saved"""
    checkpoint_dir: str | None = None
    """write a checkpoint of the whole run (both processes) to rpc_rnn.pt in this folder after every epoch;
    not given: no checkpoints"""
    resume: bool = False
    """continue from the checkpoint in --checkpoint-dir, if there is one (else start from the beginning): from the
    start of the epoch after the last one it holds, exactly as if the run had never stopped"""
    # Sampling from a saved model
    generate: Positive | None = None
    """sample N words from the --load file in this process, then exit; not given: train"""
    load: str | None = None
    """the file --generate samples from: written by --save, or a --checkpoint-dir checkpoint"""
    temperature: PositiveFloat = 1.0
    """sampling temperature for --generate (lower: more conservative text)"""
    # Devices and launch
    cuda: bool = False
    """embedding and decoder on the ps's GPU, the LSTM on the trainer's; RPC device maps move the tensors"""
    rpc_timeout: PositiveFloat = 60.0
    """an RPC to a peer that is stuck or stopped fails after this long and ends the run (a dead peer is noticed
    at once)"""
    # Beyond the tutorial
    ship_logits: bool = False
    """the tutorial's path: the ps sends the decoder's logits back and the trainer computes the loss (otherwise the
    loss is computed on the ps)"""
    check_gradients: bool = False
    """run the first --max-batches batches (2 if not given) both distributed and in one process, report the largest
    differences of loss, gradient norm and updated weights, then exit; needs --dropout 0"""


def validate(args):
    """The rules that involve several flags or the launcher's variables (each flag's own rule is its type in Args),
    checked before any data is read: each broken rule is one line and exit status 2."""
    check(0 <= args.dropout < 1, f"--dropout {args.dropout}: not from 0 up to, not including, 1")
    check(args.temperature >= 1e-3, f"--temperature {args.temperature}: below word_language_model's floor, 1e-3")
    check(not args.cuda or torch.accelerator.device_count() > 0, "--cuda given but no GPU found; run without --cuda")
    check(bool(args.generate) == bool(args.load), "--generate N samples from the saved model that --load FILE names: "
          "pass both or neither (to continue an interrupted run: --checkpoint-dir DIR --resume)")
    check(not args.load or Path(args.load).is_file(), f"--load {args.load}: no such file")
    check(not args.check_gradients or args.dropout == 0, "--check-gradients needs --dropout 0 (dropout masks differ)")
    check(args.checkpoint_dir or not args.resume, "--resume needs --checkpoint-dir DIR (where the checkpoint is)")
    check(common.process_count(2) == 2, "rpc_rnn.py runs as exactly 2 processes (ps and trainer): pass "
                                        "--nproc-per-node 2 to torchrun, or run it on 2 nodes with --nproc-per-node 1")


# ---------------------------------------------------------------------------------------------------------
# The tutorial's model: the embedding table and the decoder live on the ps, the LSTM on the trainer
# ---------------------------------------------------------------------------------------------------------

def module_of(piece):
    """A piece of the model: a module, or an RRef to one that this process owns."""
    return piece if isinstance(piece, nn.Module) else piece.local_value()


def settle(*pieces):
    """Wait until the GPU work queued on the pieces' devices has finished, whatever stream it was queued on.

    TensorPipe runs every RPC on CUDA streams of its own, drawn from a pool (pytorch/pytorch#57960), and orders only
    the tensors a call receives or returns. A call that writes tensors it does not return (building a piece, clipping
    gradients, loading weights, DistributedOptimizer.step, which synchronises nothing) could otherwise return before
    its writes are done, and a call that reads what another call wrote (the gradients backward left in the autograd
    context, the weights a step updated) could read them early. Such calls settle the devices they touch: writers
    last, readers of others' writes first. Nothing to do on the CPU."""
    for device in {param.device for piece in pieces for param in module_of(piece).parameters() if param.is_cuda}:
        torch.cuda.synchronize(device)


def _call_method(method, rref, *args):
    return method(rref.local_value(), *args)


def _remote_method(method, rref, *args):
    """method(the object rref points to, *args), run by RPC where the object lives (the tutorial's helper), for what
    the RRef idiom `rref.rpc_sync().method(*args)` cannot do: call a function that is not a method of the object."""
    return rpc.rpc_sync(rref.owner(), _call_method, args=(method, rref, *args))


def _parameter_rrefs(module):
    return [rpc.RRef(param) for param in module.parameters()]


def _set_mode(module, mode):
    module.train(mode)  # by RPC, where nn.Module.train itself would send the whole module back


class EmbeddingTable(nn.Module):
    """Encoding layers of the RNNModel: token ids -> dropped-out embeddings. Lives on the ps."""

    def __init__(self, ntoken, ninp, dropout, seed, device="cpu"):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        # word_language_model's init, from a generator of its own: the ps builds this and the Decoder at once, in two
        # RPC threads, whose draws from one global generator would interleave differently on every run
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1, generator=torch.Generator().manual_seed(seed))
        settle(self.to(device))  # built in an RPC handler

    def forward(self, input):
        return self.drop(self.encoder(input))


class Decoder(nn.Module):
    """LSTM output -> logits over the vocabulary. Lives on the ps."""

    def __init__(self, ntoken, nhid, dropout, seed, device="cpu"):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1, generator=torch.Generator().manual_seed(seed))  # (see above)
        nn.init.zeros_(self.decoder.bias)
        settle(self.to(device))

    def forward(self, output):
        return self.decoder(self.drop(output))

    def loss(self, output, targets):
        """Beyond the tutorial: the mean cross-entropy of the logits, computed where they are made."""
        return nn.functional.cross_entropy(self(output).flatten(0, 1), targets.flatten())


def make_lstm(ninp, nhid, nlayers, dropout, seed):
    """The LSTM, initialised from its own seed: the trainer and a one-process model built with the same seed hold the
    same weights. (The global generator it reseeds is seeded again for dropout by seed_epoch.)"""
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
            return nn.functional.cross_entropy(decoded.flatten(0, 1), targets.flatten()), hidden
        output, hidden = self.rnn(self.emb_table_rref.rpc_sync().forward(input), hidden)
        return self.decoder_rref.rpc_sync().loss(output, targets), hidden

    def parameter_rrefs(self):
        """RRefs to the parameters of the embedding table (made on the ps), the LSTM (here) and the decoder (the ps)."""
        return (_remote_method(_parameter_rrefs, self.emb_table_rref) + _parameter_rrefs(self.rnn)
                + _remote_method(_parameter_rrefs, self.decoder_rref))

    def train(self, mode=True):
        """Beyond the tutorial: the ps's pieces switch too (their dropout); eval() calls this."""
        _remote_method(_set_mode, self.emb_table_rref, mode)
        _remote_method(_set_mode, self.decoder_rref, mode)
        return super().train(mode)


def init_hidden(rnn, batch_size, device="cpu"):
    """The LSTM's initial (h, c) state: zeros for batch_size streams."""
    return tuple(torch.zeros(rnn.num_layers, batch_size, rnn.hidden_size, device=device) for _ in range(2))


def detach_hidden(hidden):
    """Keep the LSTM state across windows but cut the graph, so that backward stops at the window's start."""
    return tuple(h.detach() for h in hidden)


# ---------------------------------------------------------------------------------------------------------
# The tutorial's training loop: distributed autograd and torch's DistributedOptimizer
# ---------------------------------------------------------------------------------------------------------

class PlainSGD(torch.optim.SGD):
    """torch.optim.SGD under a name of its own. DistributedOptimizer swaps the optimizers it knows (optim.SGD among
    them) for TorchScript versions: TorchScript is deprecated, and every owner then prints a DeprecationWarning that
    no warnings filter silences (torch forces it). Any other class it builds on each owner as it is and steps with
    the context's gradients, and only logs that this may be slow under the GIL: see run_worker."""


def train_batches(model, opt, batches, hidden):
    """The tutorial's training loop over (input, targets) windows: in a distributed autograd context, the forward
    (the embedding and the decoder run on the ps), the loss, backward across both processes and one step of the
    DistributedOptimizer, which steps each owner's parameters with the gradients of this context. Yields each
    window's loss."""
    for input, targets in batches:
        # create distributed autograd context
        with dist_autograd.context() as context_id:
            loss, hidden = model.loss(input, targets, detach_hidden(hidden))
            # run distributed backward pass
            dist_autograd.backward(context_id, [loss])
            # run distributed optimizer; no zero_grad: the gradients live in this context, which ends here
            opt.step(context_id)
        yield loss.item()


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: real data (word_language_model's vocabulary, batchify and bptt windows)
# ---------------------------------------------------------------------------------------------------------

class Corpus:
    """Token ids of train/valid/test (each line's words, then <eos>), one vocabulary over all three, as
    word_language_model's Corpus. Read in the launching process, before any worker starts: a bad file is one line."""

    def __init__(self, folder):
        index = {}  # word -> id, in order of first appearance
        for split in ("train", "valid", "test"):
            path = Path(folder) / f"{split}.txt"
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as error:
                reason = getattr(error, "strerror", None) or "not UTF-8 text"
                raise common.UsageError(f"cannot read {path} ({reason}); pass a --data-dir with UTF-8 text") from None
            words = [word for line in text.splitlines() for word in line.split() + ["<eos>"]]
            setattr(self, split, torch.tensor([index.setdefault(word, len(index)) for word in words]))
        self.words = list(index)


WIKITEXT2_MIRRORS = ["https://raw.githubusercontent.com/pytorch/examples/main/word_language_model/data/wikitext-2/"]
WIKITEXT2_FILES = {"train.txt": "34a77ebe59551b3a3b3d8c0a2797c976", "valid.txt": "d756d22ab2310e7e60c094bea5c5a8eb",
                   "test.txt": "781c9418ab9414bd09e4aad825aae752"}


def wikitext2_dir(data_dir=None, mirrors=WIKITEXT2_MIRRORS):
    """Folder with train/valid/test.txt of WikiText-2. A --data-dir that already holds the three files is used
    as it is (any text in that format, unchecked); downloads are checked against the published md5s."""
    return common.fetch_dataset(data_dir, "wikitext-2", WIKITEXT2_FILES, mirrors)


def batchify(data, batch_size, device):
    """[tokens] -> [tokens // batch_size, batch_size]: column j is the j-th slice of the text, read top down."""
    return data[:data.size(0) // batch_size * batch_size].view(batch_size, -1).t().contiguous().to(device)


def get_batch(source, i, bptt):
    """Window of up to bptt rows starting at row i, and the same window shifted one word ahead as targets."""
    length = min(bptt, source.size(0) - 1 - i)
    return source[i:i + length], source[i + 1:i + 1 + length]


def windows(data, bptt, count=None):
    """The first `count` (all, if None) bptt windows of batchified data, as (input, targets)."""
    return [get_batch(data, i, bptt) for i in range(0, data.size(0) - 1, bptt)[:count]]


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: clipping on the global norm over both processes; the weights of both under one model's names
# ---------------------------------------------------------------------------------------------------------

def context_grads(context_id, *pieces):
    """The gradients of the pieces' parameters in the distributed autograd context: the context's own tensors, which
    DistributedOptimizer.step reads, so that scaling them in place reaches the step."""
    settle(*pieces)  # backward wrote them
    grads = dist_autograd.get_gradients(context_id)
    return [grads[param] for piece in pieces for param in module_of(piece).parameters()]


def squared_norm(context_id, *pieces):
    return sum(torch.linalg.vector_norm(grad) ** 2 for grad in context_grads(context_id, *pieces)).item()


def scale_grads(context_id, factor, *pieces):
    for grad in context_grads(context_id, *pieces):
        grad.mul_(factor)
    settle(*pieces)  # the step reads them


class ClippedOptimizer(DistributedOptimizer):
    """torch's DistributedOptimizer (SGD on each owner of parameters, PlainSGD) that first clips the gradients of the
    context on their global norm over both processes, as clip_grad_norm_ does in one process (up to rounding: the
    norm is summed in another order). One RPC brings the ps's squared norm, one scales its gradients where the norm
    exceeds --clip; on GPUs, one after the step waits until its writes are done (see settle)."""

    def __init__(self, model, lr, max_norm):
        super().__init__(PlainSGD, model.parameter_rrefs(), lr=lr)
        self.ps_pieces, self.rnn = (model.emb_table_rref, model.decoder_rref), model.rnn
        self.max_norm, self.norms = max_norm, []

    def step(self, context_id):
        total_norm = math.sqrt(rpc.rpc_sync(PS_NAME, squared_norm, args=(context_id, *self.ps_pieces))
                               + squared_norm(context_id, self.rnn))
        self.norms.append(total_norm)
        factor = self.max_norm / (total_norm + 1e-6)  # clip_grad_norm_'s
        if factor < 1:
            rpc.rpc_sync(PS_NAME, scale_grads, args=(context_id, factor, *self.ps_pieces))
            scale_grads(context_id, factor, self.rnn)
        super().step(context_id)
        if next(self.rnn.parameters()).is_cuda:  # the next window reads the weights the step wrote
            rpc.rpc_sync(PS_NAME, settle, args=self.ps_pieces)
            settle(self.rnn)


PIECES = ("embedding", "rnn", "decoder")  # LocalRNNModel's names of the RNNModel's pieces


def on_piece(piece, function, *args):
    """function(module, *args) where the piece lives: here for the LSTM, by RPC on the ps for an RRef."""
    return function(piece, *args) if isinstance(piece, nn.Module) else _remote_method(function, piece, *args)


def cpu_state_dict(module):
    """Copies of a module's weights on the CPU (a kept best state must not follow the live weights)."""
    settle(module)
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in module.state_dict().items()}


def load_weights(module, state):
    module.load_state_dict(state)
    settle(module)


def model_state(model):
    """The weights of the RNNModel's three pieces, on the CPU, under LocalRNNModel's names."""
    pieces = (model.emb_table_rref, model.rnn, model.decoder_rref)
    return {f"{name}.{key}": value for name, piece in zip(PIECES, pieces)
            for key, value in on_piece(piece, cpu_state_dict).items()}


def load_model_state(model, state):
    """Load weights under LocalRNNModel's names into the RNNModel's pieces, where each lives."""
    for name, piece in zip(PIECES, (model.emb_table_rref, model.rnn, model.decoder_rref)):
        on_piece(piece, load_weights, {key[len(name) + 1:]: value for key, value in state.items()
                                       if key.startswith(name + ".")})


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


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: word_language_model's recipe (epochs, validation, lr / 4, the best weights), checkpoints
# ---------------------------------------------------------------------------------------------------------

def perplexity(loss):
    """exp(loss), or inf (null in the result line) where that overflows, as after a run diverged."""
    return math.exp(loss) if loss < 700 else math.inf


def seed_epoch(seed, epoch):
    """Seed the generator that draws this process's dropout masks from --seed, the epoch and the rank (the RPC worker
    id): the trainer calls it on the ps by RPC, then on itself. A run resumed at an epoch's start draws the masks an
    uninterrupted run draws, with no RNG state in the checkpoint. Epoch 1 uses --seed on the ps and --seed + 1 on the
    trainer. On CUDA this reaches cuDNN's LSTM too: its dropout state, which torch does not expose, is drawn again
    from the CUDA generator once that is seeded. Returns nothing: torch.manual_seed returns a generator, which RPC
    cannot send."""
    torch.manual_seed(seed + 2 * (epoch - 1) + rpc.get_worker_info().id)


@torch.no_grad()
def evaluate(model, data, bptt):
    """Mean loss per word over a whole split, dropout off. Grad mode does not travel with an RPC: under this no_grad
    the ps still records the autograd graph of its forward, and drops it when the call returns."""
    model.eval()
    total, hidden = 0.0, init_hidden(model.rnn, data.size(1), data.device)
    for input, targets in windows(data, bptt):
        loss, hidden = model.loss(input, targets, hidden)
        total += input.size(0) * loss.item()
    return total / (data.size(0) - 1)


def save_model(path, args, words, **state):
    """A file that `LocalRNNModel(**ckpt["config"]).load_state_dict(ckpt["model"])` loads, with ckpt =
    torch.load(path), written atomically by common.save_checkpoint: a failed write keeps the previous file."""
    config = dict(ntoken=len(words), ninp=args.emsize, nhid=args.nhid, nlayers=args.nlayers, dropout=args.dropout)
    common.save_checkpoint(path, SCRIPT, {"vocab": words, "config": config, **state})


def recipe(args):
    """The flags that a resumed run must share with the run that wrote the checkpoint: they change the math."""
    return {name: getattr(args, name) for name in ("emsize", "nhid", "nlayers", "dropout", "batch_size", "bptt", "lr",
                                                   "clip", "seed", "max_batches")}


def read_checkpoint(args):
    """The checkpoint that --resume continues, or None when there is none yet (the run starts from the beginning):
    verified (common.load_checkpoint; a checkpoint of another version lacks a key), and checked against these flags
    and the model they build (its vocabulary, once the text is read: load_run)."""
    path = Path(args.checkpoint_dir, CHECKPOINT)
    if not path.exists():  # (validate has refused a link to nothing)
        return None
    saved = common.load_checkpoint(path, SCRIPT, "--resume", keys=("model", "vocab", "config", "recipe", "run"))
    differ = ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in saved["recipe"].items()
                       if recipe(args).get(name) != value)
    check(not differ, f"--resume {path}: written with {differ}; pass the same flags or another --checkpoint-dir")
    check(saved["run"]["epoch"] - 1 <= args.epochs, f"--resume {path}: holds {saved['run']['epoch'] - 1} epochs, more "
                                                    f"than --epochs {args.epochs}; pass a larger one")
    common.check_fits(LocalRNNModel(**saved["config"]), saved["model"], "--resume", path)
    return saved


def run_trainer(args, corpus, model, device, saved):
    """word_language_model's recipe around the tutorial's loop (train_batches): epochs of bptt windows, a log line
    every --log-interval batches, validation after each epoch (lr / 4 when it did not improve, the best weights
    kept, --save), a checkpoint after each, then the test of the best weights and the JSON line."""
    batches = windows(batchify(corpus.train, args.batch_size, device), args.bptt, args.max_batches)
    valid_data, test_data = (batchify(data, EVAL_BATCH_SIZE, device) for data in (corpus.valid, corpus.test))
    # Where the run stands between two epochs. With the weights, it is all a checkpoint needs to continue exactly:
    # SGD keeps no state but lr, each epoch starts from a zero LSTM state, and seed_epoch seeds its dropout masks.
    # `epoch` is the next one, `best_state` the weights of the best valid loss, under LocalRNNModel's names; `losses`
    # has every batch's, and `tokens` were trained on in `seconds` of training.
    run = SimpleNamespace(lr=args.lr, epoch=1, best_valid=math.inf, best_state=None, losses=[], tokens=0, seconds=0.0)
    if saved:  # the weights of both processes back, and the run where the checkpoint was taken
        load_model_state(model, saved["model"])
        print(f"resuming at epoch {saved['run']['epoch']} from {Path(args.checkpoint_dir, CHECKPOINT)}", flush=True)
        run = SimpleNamespace(**saved["run"])
    while run.epoch <= args.epochs:
        # SGD keeps no state but lr: a new optimizer with this epoch's lr continues exactly where the last one was
        opt = ClippedOptimizer(model, run.lr, args.clip)
        model.train()
        rpc.rpc_sync(PS_NAME, seed_epoch, args=(args.seed, run.epoch))
        seed_epoch(args.seed, run.epoch)
        epoch_start = since = time.perf_counter()
        losses = train_batches(model, opt, batches, init_hidden(model.rnn, args.batch_size, device))
        for batch, loss in enumerate(losses, 1):
            run.losses.append(loss)
            run.tokens += batches[batch - 1][1].numel()
            if batch % args.log_interval == 0 or batch == len(batches):
                count, seconds = (batch - 1) % args.log_interval + 1, time.perf_counter() - since  # since the last line
                mean = sum(run.losses[-count:]) / count
                print(f"epoch {run.epoch} | batch {batch}/{len(batches)} | lr {run.lr:.2f} | "
                      f"{1000 * seconds / count:.1f} ms/batch | loss {mean:.2f} | ppl {perplexity(mean):.1f}",
                      flush=True)
                run.seconds, since = run.seconds + seconds, time.perf_counter()
        valid_loss = evaluate(model, valid_data, args.bptt)  # `since` is the end of training: the last batch is logged
        print(f"epoch {run.epoch} | valid loss {valid_loss:.2f} | valid ppl {perplexity(valid_loss):.1f} | "
              f"{since - epoch_start:.1f} s/epoch", flush=True)
        if valid_loss < run.best_valid:
            run.best_valid, run.best_state = valid_loss, model_state(model)
            if args.save:
                save_model(args.save, args, corpus.words, model=run.best_state, valid_loss=valid_loss)
        else:
            run.lr /= 4
        run.epoch += 1
        if args.checkpoint_dir:  # the whole run, from both processes: the weights and where the run stands
            save_model(Path(args.checkpoint_dir, CHECKPOINT), args, corpus.words,
                       model=model_state(model), recipe=recipe(args), run=vars(run))
    if run.best_state is not None:
        load_model_state(model, run.best_state)  # test the weights that were kept, as word_language_model does
    test_loss = evaluate(model, test_data, args.bptt)
    print(f"test loss {test_loss:.2f} | test ppl {perplexity(test_loss):.1f}", flush=True)
    common.emit_result(SCRIPT, mode="ship-logits" if args.ship_logits else "loss-on-ps", ntoken=len(corpus.words),
                       devices={PS_NAME: "cuda:0" if args.cuda else "cpu", TRAINER_NAME: str(device)},
                       batches=len(run.losses), losses=[round(x, 6) for x in run.losses[:200]],
                       valid_loss=run.best_valid, valid_ppl=perplexity(run.best_valid), test_loss=test_loss,
                       test_ppl=perplexity(test_loss), lr=run.lr, tokens_per_s=run.tokens / run.seconds)


def compare_gradients(args, corpus, model, device, saved=None):
    """--check-gradients: the same weights and batches in one process and through the tutorial's loop over RPC
    (train_batches, with the recipe's ClippedOptimizer); reports the largest differences of loss, gradient norm
    (before clipping) and weights after each step. Needs --dropout 0: the two runs draw their dropout masks
    differently."""
    local = LocalRNNModel(len(corpus.words), args.emsize, args.nhid, args.nlayers, args.dropout, args.seed)
    local_opt, opt = PlainSGD(local.parameters(), lr=args.lr), ClippedOptimizer(model, args.lr, args.clip)
    batches = windows(batchify(corpus.train, args.batch_size, device), args.bptt, args.max_batches or 2)
    hidden, local_hidden = init_hidden(model.rnn, args.batch_size, device), init_hidden(local.rnn, args.batch_size)
    worst = [0.0, 0.0, 0.0]  # the largest differences of loss, gradient norm and weights
    # Each window's distributed step (the generator runs one at a time), then the same window in one process
    for (input, targets), loss in zip(batches, train_batches(model, opt, batches, hidden)):
        weights = model_state(model)
        local_opt.zero_grad()
        local_loss, local_hidden = local.loss(input.cpu(), targets.cpu(), detach_hidden(local_hidden))
        local_loss.backward()
        local_norm = nn.utils.clip_grad_norm_(local.parameters(), args.clip).item()
        local_opt.step()
        worst = [max(worst[0], abs(loss - local_loss.item())), max(worst[1], abs(opt.norms[-1] - local_norm)),
                 max([worst[2]] + [(weights[name] - p).abs().max().item() for name, p in local.named_parameters()])]
    common.emit_result(SCRIPT, mode="check-gradients", batches=len(opt.norms), grad_norms=opt.norms, clip=args.clip,
                       compared=len(weights), loss_diff=worst[0], norm_diff=worst[1], max_param_diff=worst[2])


@torch.no_grad()
def generate_words(args):
    """--generate: load a saved model into LocalRNNModel, checked to fit, and sample words from it one at a time,
    in this process (no RPC)."""
    saved = common.load_checkpoint(args.load, SCRIPT, "--load", keys=("model", "vocab", "config"))
    words = saved["vocab"]
    model = common.check_fits(LocalRNNModel(**saved["config"]), saved["model"], "--load", args.load).eval()
    torch.manual_seed(args.seed)
    input, hidden = torch.randint(len(words), (1, 1)), init_hidden(model.rnn, 1)
    for i in range(args.generate):
        logits, hidden = model(input, hidden)
        input.fill_(torch.multinomial(torch.softmax(logits.view(-1) / args.temperature, dim=0), 1).item())
        print(words[input.item()], end="\n" if i % 20 == 19 or i + 1 == args.generate else " ")
    common.emit_result(SCRIPT, mode="generate", words=args.generate, vocab=len(words))


# ---------------------------------------------------------------------------------------------------------
# The processes: the ps and the trainer, started by mp.spawn or torchrun
# ---------------------------------------------------------------------------------------------------------

def load_run(args):
    """The text and the checkpoint to continue (or None), read and checked once, before the training starts: each
    split must give every stream of its batch at least one window of two words, and a --resume checkpoint must have
    been written for this text."""
    if args.checkpoint_dir:  # (the trainer writes them)
        common.make_dir("--checkpoint-dir", args.checkpoint_dir)
    if args.save:
        common.check_output_file("--save", args.save)
    saved = read_checkpoint(args) if args.resume else None
    corpus = Corpus(wikitext2_dir(args.data_dir))
    for split, size in (("train", args.batch_size), ("valid", EVAL_BATCH_SIZE), ("test", EVAL_BATCH_SIZE)):
        tokens = getattr(corpus, split).numel()
        check(tokens // size >= 2, f"{split}.txt has {tokens} tokens, too few for {size} streams of 2 words or more; "
                                   f"pass more text" + (" or a smaller --batch-size" if split == "train" else ""))
    check(not saved or saved["vocab"] == corpus.words, f"--resume {args.checkpoint_dir}: written for another text "
          f"(its vocabulary differs); pass the same --data-dir or another --checkpoint-dir")
    return corpus, saved


@common.worker
def run_worker(rank, world_size, store, args, trainer, corpus, saved):
    """Rank 0 becomes the ps and answers RPCs until the trainer is done; rank 1 becomes the trainer and runs
    `trainer` (run_trainer, or compare_gradients for --check-gradients) on the tutorial's RNNModel."""
    # The ps and the trainer take turns (embedding, LSTM, decoder, then backward in reverse), never computing at
    # the same time: each may use every core of the machine while the other waits.
    torch.set_num_threads(common.usable_cpus())
    # The GIL warning of an optimizer without TorchScript (PlainSGD) concerns threads training in one process: here
    # each owner of parameters is a process of its own.
    logging.getLogger("torch.distributed.optim.optimizer").setLevel(logging.ERROR)
    # The ps takes GPU 0 of its machine; the trainer takes the second GPU of a machine it shares with the ps, if
    # there is one. Tensors sent to the ps land on its GPU and the replies come back, by the map, not .to() calls.
    device = common.pick_device(args.cuda, min(common.local_rank(rank), torch.accelerator.device_count() - 1))
    common.set_tf32(device, not args.check_gradients)  # the check compares with the CPU: IEEE float32 on both sides
    ps_device = torch.device("cuda", 0) if args.cuda else torch.device("cpu")
    # an RPC to a peer that is gone or silent fails after --rpc-timeout instead of hanging
    maps, devices = ({PS_NAME: {device: ps_device}} if rank else None, [device]) if args.cuda else (None, None)
    options = rpc.TensorPipeRpcBackendOptions(init_method=common.init_method(store, "rpc"), device_maps=maps,
                                              devices=devices, rpc_timeout=args.rpc_timeout)
    rpc.init_rpc(TRAINER_NAME if rank else PS_NAME, rank=rank, world_size=world_size, rpc_backend_options=options)
    if rank == 1:
        model = RNNModel(PS_NAME, len(corpus.words), args.emsize, args.nhid, args.nlayers, args.dropout, args.seed,
                         device, ps_device, args.ship_logits)
        trainer(args, corpus, model, device, saved)
        common.FINISHED.set()
    else:  # the ps answers RPCs in its RPC threads meanwhile
        common.serve(TRAINER_NAME, args.rpc_timeout)
    rpc.shutdown()


def main(argv=None):
    args = common.parse_args(Args, argv)
    validate(args)
    if args.generate:  # sampling from a saved model: one process, no RPC
        return generate_words(args)
    trainer = compare_gradients if args.check_gradients else run_trainer
    torchrun = common.torchrun_env()
    # the trainer's text and checkpoint, read once, before any process starts (the ps needs neither)
    corpus, saved = load_run(args) if not torchrun or torchrun["RANK"] == 1 else (None, None)
    if torchrun:  # started by torchrun (RANK set): this process's part
        return run_worker(torchrun["RANK"], 2, "env://", args, trainer, corpus, saved)
    with common.rendezvous() as store:
        common.join(mp.spawn(run_worker, args=(2, store, args, trainer, corpus, saved), nprocs=2, join=False))


if __name__ == "__main__":
    common.run_main(main)
