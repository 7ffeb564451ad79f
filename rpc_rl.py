"""Distributed REINFORCE on CartPole-v1 with torch.distributed.rpc and RRef: one agent, N observers.

Rank 0 is the agent: it owns the policy and the optimizer and trains. Ranks 1..W-1 are observers, each with
its own gymnasium CartPole-v1 environment. The agent creates the observers remotely (`rpc.remote`), keeps
their RRefs and hands them its own RRef, then plays one episode on every observer at once with async RPCs
and learns from all of them when they are done. The tutorial this mirrors ("Getting started with the
distributed RPC framework", part 1) sends two RPCs per environment step (ask for an action, report the
reward) and runs one policy forward per request. Here an observer sends its new state together with the
reward of its previous action in ONE RPC, and the agent answers all observers of a step with ONE batched
forward (`@rpc.functions.async_execution` and futures), computed in numpy on a snapshot of the policy, which
is quicker than torch for one tiny forward. Returns are discounted per observer episode, and an episode that
CartPole's time limit cut short is bootstrapped instead of being treated as a failure (`--truncation`).

Commands:
    python rpc_rl.py                                  # agent + 1 observer on this machine, until solved
    python rpc_rl.py --world-size 5                   # agent + 4 observers
    python rpc_rl.py --max-episodes 50 --save policy.pt --eval-episodes 5 --plot curve.png
    python rpc_rl.py --load policy.pt --max-episodes 0 --eval-episodes 10    # greedy evaluation only
    python rpc_rl.py --cuda                           # the agent's policy on GPU 0
    torchrun --standalone --nproc_per_node=3 rpc_rl.py
    # two nodes (rank 0, the agent, on node 0):
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=2 --master_addr=HOST --master_port=29500 rpc_rl.py
    torchrun --nnodes=2 --node_rank=1 --nproc_per_node=2 --master_addr=HOST --master_port=29500 rpc_rl.py

Last lines of `python rpc_rl.py` (seed 1: 354 episodes, 30-45 s of training on a 2-core CPU; seeds 1-5
solve in 257-357 episodes, see README):
    episode 350 | last reward 500 | running reward 469.9 | 1458 steps/s
    solved: running reward 475.5 > 475 after 354 episodes
    {"script": "rpc_rl", "solved": true, "episodes": 354, "env_steps": 62957, "wall_time_s": 44.274, ...}
"""

import os
import threading
import time
from dataclasses import dataclass
from typing import Literal, Optional

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import rpc
from torch.distributed.rpc import RRef
from torch.distributions import Categorical

from common import (UsageError, check, check_output_file, cuda_device_count, emit_result, init_rpc, launch,
                    parse_args, pick_device, pin_to_one_cpu, process_count, run_main, save_atomic,
                    seed_everything)

AGENT_NAME = "agent"
OBSERVER_NAME = "observer{}"
ENV_ID = "CartPole-v1"


@dataclass
class Args:
    world_size: int = 2
    """processes: rank 0 is the agent, ranks 1..W-1 are observers (W >= 2; under torchrun its WORLD_SIZE)"""
    max_episodes: int = 2000
    """stop after this many episodes (one episode = one episode on every observer) unless solved before"""
    gamma: float = 0.99
    """discount factor for future rewards"""
    truncation: Literal["bootstrap", "terminal"] = "bootstrap"
    """returns of an episode the 500-step time limit cut short: continue them with the last reward forever,
    r / (1 - gamma) (bootstrap: solves in half the episodes, see benchmarks/bench_rpc_rl.py), or end them there
    as if the pole had fallen (terminal: the tutorial)"""
    lr: float = 1e-2
    """Adam learning rate"""
    seed: int = 1
    """seed of the policy's initialisation, of each observer's environment and of the agent's sampling"""
    batch: bool = True
    """answer all observers of a step with one policy forward (--no-batch: one forward per request)"""
    log_interval: int = 10
    """episodes between two log lines"""
    save: Optional[str] = None
    """write the trained policy's state_dict to this file"""
    load: Optional[str] = None
    """start from the policy saved in this file instead of a fresh one"""
    eval_episodes: int = 0
    """after training, play this many greedy episodes (argmax action, no dropout) on every observer"""
    plot: Optional[str] = None
    """write the learning curve (episode reward and running reward) to this PNG file"""
    cuda: bool = False
    """put the agent's policy on GPU 0 (observers stay on the CPU; only numbers cross the wire)"""
    pin_cpus: bool = True
    """bind each process to a CPU of its own when there are enough (--no-pin-cpus: leave placement to the OS);
    TensorPipe busy-polls in every process, and unpinned its pollers crowd out the Python threads (see the
    "unpinned" column of benchmarks/bench_rpc_rl.py)"""
    rpc_timeout: float = 20.0
    """seconds after which an RPC to a vanished process fails, ending the run instead of hanging (it also
    bounds one episode, which takes about a second)"""


class Policy(nn.Module):
    """The tutorial's policy, 4 -> 128 -> 2 with dropout 0.6 on the hidden layer. Lives in the agent process.

    The dropout mask is an argument instead of being drawn inside forward: the agent acts without autograd
    and recomputes a whole episode's log-probabilities in one batched forward when it learns, which gives the
    probabilities the actions were sampled from only if both passes use the same mask. keep_mask=None is
    evaluation (no dropout).
    """

    hidden = 128
    dropout = 0.6

    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, self.hidden)
        self.affine2 = nn.Linear(self.hidden, 2)

    @classmethod
    def keep_mask(cls, uniform):
        """Inverted-dropout mask (float32 numpy) from uniform noise [n, hidden], scaled like nn.Dropout."""
        return (uniform >= cls.dropout).astype(np.float32) / np.float32(1 - cls.dropout)

    def forward(self, states, keep_mask=None):
        hidden = self.affine1(states)
        if keep_mask is not None:
            hidden = hidden * keep_mask
        return F.softmax(self.affine2(F.relu(hidden)), dim=1)

    def snapshot(self):
        """The parameters as numpy arrays, for acting: see numpy_probs."""
        return [parameter.detach().cpu().numpy().copy() for parameter in
                (self.affine1.weight, self.affine1.bias, self.affine2.weight, self.affine2.bias)]


def numpy_probs(snapshot, states, keep_mask=None):
    """Policy.forward in numpy, on a snapshot of the parameters (float32, equal to the torch forward within
    rounding; a test checks it).

    The agent acts with this and learns with Policy.forward. A step's forward is a 1-4 row, 4->128->2 product
    on the critical path of every environment step; torch's fixed cost per operator call, times the ~20 calls
    it takes, is several times what numpy needs for it. The policy learns on its own device (GPU with --cuda)
    and the agent refreshes the snapshot after every update: one copy per episode instead of a device round
    trip per step.
    """
    weight1, bias1, weight2, bias2 = snapshot
    hidden = states @ weight1.T + bias1
    if keep_mask is not None:
        hidden *= keep_mask
    logits = np.maximum(hidden, 0) @ weight2.T + bias2
    exp = np.exp(logits - logits.max(axis=1, keepdims=True))
    return exp / exp.sum(axis=1, keepdims=True)


def observer_seed(seed, rank, purpose):
    """Distinct seed per (run seed, observer rank, purpose): "env" (training episodes), "eval" (greedy
    episodes) or "agent" (the agent's random numbers for this observer)."""
    purpose_id = ("env", "eval", "agent").index(purpose)
    return int(np.random.SeedSequence([seed, rank, purpose_id]).generate_state(1)[0])


class Observer:
    """Lives in an observer process (created there by the agent with rpc.remote): one CartPole environment."""

    def __init__(self):
        self.id = rpc.get_worker_info().id
        self.env = gym.make(ENV_ID)

    def run_episode(self, agent_rref, seed=None):
        """Play one episode, asking the agent for every action; returns (last reward, env steps, whether the
        time limit cut the episode short rather than the pole falling).

        ONE RPC per step: the request carries the new state and the reward of the previous action. The reward
        of the final action travels back in this method's return value instead of in an extra RPC. The state
        travels as a tuple of 4 floats: unpickling a numpy array costs the agent more than the step's forward.
        """
        state, _ = self.env.reset(seed=seed)
        agent = agent_rref.owner()
        reward = None
        for step in range(1, self.env.spec.max_episode_steps + 1):
            # The agent's RRef travels with each request so that select_action finds the Agent object without a
            # process-global table; RRef bookkeeping adds an acknowledgement message per step, the price of
            # keeping all state in objects.
            action = rpc.rpc_sync(agent, Agent.select_action, args=(agent_rref, self.id, tuple(state.tolist()),
                                                                   reward))
            state, reward, terminated, truncated, _ = self.env.step(action)
            if terminated or truncated:
                break
        return float(reward), step, truncated and not terminated


def discounted_returns(rewards, gamma, bootstrap=False):
    """Return G_t = r_t + gamma * G_{t+1} at every step of one episode.

    bootstrap=False ends the sum at the last step: the episode ended in a failure (the tutorial treats every
    ending so). bootstrap=True is for an episode the time limit cut short (gymnasium's `truncated`): CartPole's
    500-step limit is not part of the task, and ending the sum there would teach the policy that its last
    actions, which kept the pole up, were its worst ones; once it balances for the whole episode, every update
    would then push it away from what it does. REINFORCE has no value function to bootstrap from, so the sum
    continues with the last reward forever, r / (1 - gamma): in CartPole, the pole stays up. A policy that
    balances to the limit then sees equal returns at every step, hence no update, and stays where it is.
    """
    discounted = rewards[-1] / (1 - gamma) if bootstrap else 0.0
    returns = []
    for reward in reversed(rewards):
        discounted = reward + gamma * discounted
        returns.append(discounted)
    return returns[::-1]


class Agent:
    """Lives in the agent process (rank 0): the policy, the optimizer, the observers' RRefs, the episode data.

    select_action runs on RPC threads, several at once; everything it shares is guarded by self.lock.
    """

    def __init__(self, args, world_size, device):
        self.args = args
        self.device = device
        seed_everything(args.seed)  # same initial policy for a given seed
        self.policy = Policy()
        if args.load:
            self.policy.load_state_dict(torch.load(args.load, weights_only=True))
        self.policy.to(device)
        self.snapshot = self.policy.snapshot()  # what the agent acts with; refreshed after every update
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=args.lr)
        self.eps = np.finfo(np.float32).eps.item()
        self.reward_threshold = gym.spec(ENV_ID).reward_threshold
        self.running_reward = 0.0
        self.agent_rref = RRef(self)
        self.observer_rrefs = {}
        # One generator per observer: an observer's dropout masks and actions do not depend on the order in
        # which the requests of other observers arrive, so a seed gives the same run with or without batching.
        self.generators = {}
        for rank in range(1, world_size):  # an observer's id (its RPC worker id) is its rank
            self.observer_rrefs[rank] = rpc.remote(OBSERVER_NAME.format(rank), Observer)
            self.generators[rank] = np.random.default_rng(observer_seed(args.seed, rank, "agent"))
        self.lock = threading.Lock()
        self.waiting = {}       # observer id -> (state, future of its action), requests not answered yet
        self.playing = set()    # observers whose current episode has not ended
        self.greedy = False
        self.step_rpcs = 0      # select_action calls received (the test checks: one per env step)
        self.forwards = 0       # policy forwards spent on acting
        self.trajectory = {ob_id: [] for ob_id in self.observer_rrefs}   # (state, keep_mask, action) per step
        self.rewards = {ob_id: [] for ob_id in self.observer_rrefs}
        self.truncated = {}     # observer id -> whether its last episode hit the time limit
        self.truncated_episodes = 0  # training episodes (of one observer) the time limit cut short

    @staticmethod
    @rpc.functions.async_execution
    def select_action(agent_rref, observer_id, state, reward):
        """Called by an observer once per step; returns a future that completes with its action.

        Batched, the agent answers only when every observer still playing has asked, in one forward ordered
        by observer id: each step of the episode costs one forward whatever the arrival timing, and the
        batch, hence every floating-point result, is the same on every run.
        """
        self = agent_rref.local_value()
        action = torch.futures.Future()
        with self.lock:
            self.step_rpcs += 1
            if reward is not None:
                self.rewards[observer_id].append(reward)
            self.waiting[observer_id] = (state, action)
            ready = self._take_ready_requests()
        if ready:
            self._act(ready)
        return action

    def _take_ready_requests(self):
        """Under self.lock: the requests to answer now, sorted by observer id, removed from self.waiting."""
        if not self.waiting or (self.args.batch and self.waiting.keys() != self.playing):
            return []
        ready = sorted(self.waiting.items())
        self.waiting = {}
        return ready

    def _act(self, requests):
        ids = [ob_id for ob_id, _ in requests]
        states = np.array([state for _, (state, _) in requests], dtype=np.float32)
        if self.greedy:
            actions = numpy_probs(self.snapshot, states).argmax(axis=1)
        else:
            noise = np.stack([self.generators[ob_id].random(Policy.hidden + 1) for ob_id in ids])
            keep_masks = Policy.keep_mask(noise[:, :-1])
            probs = numpy_probs(self.snapshot, states, keep_masks)
            # inverse-CDF sampling with the observer's own uniform number (Categorical.sample would draw from
            # the global generator, shared by all observers)
            actions = (noise[:, -1:] > probs.cumsum(axis=1)).sum(axis=1).clip(max=probs.shape[1] - 1)
        actions = actions.tolist()
        with self.lock:
            self.forwards += 1
            if not self.greedy:
                for ob_id, state, keep_mask, action in zip(ids, states, keep_masks, actions):
                    self.trajectory[ob_id].append((state, keep_mask, action))
        for (_, (_, future)), action in zip(requests, actions):
            future.set_result(action)

    def _observer_finished(self, observer_id, episode):
        # An observer whose episode ended asks no more: the others may now be all there is to wait for.
        with self.lock:
            self.playing.discard(observer_id)
            ready = self._take_ready_requests()
        if ready:
            self._act(ready)
        return episode.value()  # re-raises an observer's failure in the agent's main loop

    def run_episode(self, greedy=False, seeds=None):
        """One episode on every observer at once; returns ({observer id: episode reward}, env steps)."""
        self.greedy = greedy
        with self.lock:
            self.playing = set(self.observer_rrefs)
        episodes = {}
        for ob_id, ob_rref in self.observer_rrefs.items():
            seed = seeds[ob_id] if seeds else None
            episode = ob_rref.rpc_async().run_episode(self.agent_rref, seed)
            # then(): waiting on the chained future also waits for the callback, so it cannot run late and
            # touch the next episode's bookkeeping
            episodes[ob_id] = episode.then(lambda episode, ob_id=ob_id: self._observer_finished(ob_id, episode))
        env_steps = 0
        for ob_id, episode in episodes.items():
            last_reward, steps, self.truncated[ob_id] = episode.wait()
            self.rewards[ob_id].append(last_reward)
            env_steps += steps
        episode_rewards = {ob_id: sum(rewards) for ob_id, rewards in self.rewards.items()}
        if greedy:
            for rewards in self.rewards.values():
                rewards.clear()
        return episode_rewards, env_steps

    def finish_episode(self):
        """REINFORCE update from every observer's episode; returns the smallest observer episode reward."""
        returns, states, keep_masks, actions = [], [], [], []
        for ob_id in self.observer_rrefs:
            # discounted returns within this observer's own episode, never across observers
            self.truncated_episodes += self.truncated[ob_id]
            bootstrap = self.truncated[ob_id] and self.args.truncation == "bootstrap"
            returns.extend(discounted_returns(self.rewards[ob_id], self.args.gamma, bootstrap))
            for state, keep_mask, action in self.trajectory[ob_id]:
                states.append(state)
                keep_masks.append(keep_mask)
                actions.append(action)
        min_reward = min(sum(self.rewards[ob_id]) for ob_id in self.observer_rrefs)
        self.running_reward = 0.05 * min_reward + (1 - 0.05) * self.running_reward
        returns = torch.tensor(returns, device=self.device)
        if len(returns) > 1:
            returns = (returns - returns.mean()) / (returns.std() + self.eps)
        # one forward for the whole episode, with the dropout masks the actions were sampled with
        probs = self.policy(torch.from_numpy(np.stack(states)).to(self.device),
                            torch.from_numpy(np.stack(keep_masks)).to(self.device))
        log_probs = Categorical(probs=probs).log_prob(torch.tensor(actions, device=self.device))
        loss = -(log_probs * returns).sum()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.snapshot = self.policy.snapshot()
        for ob_id in self.observer_rrefs:
            self.trajectory[ob_id] = []
            self.rewards[ob_id] = []
        return min_reward


def plot_learning_curve(path, episode_rewards, running_rewards, threshold):
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(7, 4))
    episodes = range(1, len(episode_rewards) + 1)
    axes.plot(episodes, episode_rewards, alpha=0.4, label="episode reward (smallest over observers)")
    axes.plot(episodes, running_rewards, label="running reward")
    axes.axhline(threshold, color="gray", linestyle="--", label=f"solved ({threshold:g})")
    axes.set_xlabel("episode")
    axes.set_ylabel("reward")
    axes.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def run_agent(args, world_size, device):
    agent = Agent(args, world_size, device)
    observers = range(1, world_size)
    episode_rewards, running_rewards, env_steps, solved = [], [], 0, False
    start = interval_start = time.perf_counter()
    interval_steps = 0
    for episode in range(1, args.max_episodes + 1):
        # only the first episode seeds the environments; later ones continue their random streams
        seeds = {rank: observer_seed(args.seed, rank, "env") for rank in observers} if episode == 1 else None
        rewards, steps = agent.run_episode(seeds=seeds)
        last_reward = agent.finish_episode()
        env_steps += steps
        interval_steps += steps
        episode_rewards.append([rewards[rank] for rank in observers])
        running_rewards.append(agent.running_reward)
        if episode % args.log_interval == 0:
            now = time.perf_counter()
            print(f"episode {episode} | last reward {last_reward:g} | running reward {agent.running_reward:.1f} | "
                  f"{interval_steps / (now - interval_start):.0f} steps/s", flush=True)
            interval_start, interval_steps = now, 0
        if agent.running_reward > agent.reward_threshold:
            solved = True
            print(f"solved: running reward {agent.running_reward:.1f} > {agent.reward_threshold:g} "
                  f"after {episode} episodes", flush=True)
            break
    wall_time = time.perf_counter() - start
    step_rpcs, forwards, truncated_episodes = agent.step_rpcs, agent.forwards, agent.truncated_episodes
    if args.save:
        save_atomic({name: tensor.cpu() for name, tensor in agent.policy.state_dict().items()}, args.save)
    eval_rewards = []
    for episode in range(args.eval_episodes):
        seeds = {rank: observer_seed(args.seed, rank, "eval") for rank in observers} if episode == 0 else None
        rewards, _ = agent.run_episode(greedy=True, seeds=seeds)
        eval_rewards.extend(rewards[rank] for rank in observers)
    if eval_rewards:
        print(f"greedy evaluation: mean reward {np.mean(eval_rewards):.1f} over {len(eval_rewards)} episodes",
              flush=True)
    if args.plot:
        plot_learning_curve(args.plot, [min(rewards) for rewards in episode_rewards], running_rewards,
                            agent.reward_threshold)
    emit_result("rpc_rl", solved=solved, episodes=len(episode_rewards), env_steps=env_steps,
                wall_time_s=round(wall_time, 3), steps_per_s=round(env_steps / max(wall_time, 1e-9), 1),
                running_reward=round(agent.running_reward, 3), observers=world_size - 1, batch=args.batch,
                step_rpcs=step_rpcs, rpcs_per_step=step_rpcs / max(env_steps, 1), forwards=forwards,
                truncation=args.truncation, truncated_episodes=truncated_episodes,
                device=str(device), eval_rewards=eval_rewards,
                eval_mean_reward=float(np.mean(eval_rewards)) if eval_rewards else None,
                episode_rewards=episode_rewards)


def run_worker(info, args):
    # The policy is tiny: extra intra-op threads only add synchronisation to every step.
    torch.set_num_threads(1)
    if args.pin_cpus:
        pin_to_one_cpu(info)
    if info.rank == 0:
        init_rpc(info, AGENT_NAME, timeout_s=args.rpc_timeout)
        # after the rendezvous: the first CUDA call can take seconds, which the observers would spend waiting
        run_agent(args, info.world_size, pick_device(args.cuda))
    else:
        init_rpc(info, OBSERVER_NAME.format(info.rank), timeout_s=args.rpc_timeout)
    # observers serve the agent's RPCs until the agent is done and reaches this point too
    rpc.shutdown()


def main():
    args = parse_args(Args)
    processes = process_count(args.world_size)
    check(processes >= 2, f"world size {processes}: need at least 2 processes (one agent, one observer)")
    check(args.max_episodes >= 0, "--max-episodes must be >= 0")
    check(args.eval_episodes >= 0, "--eval-episodes must be >= 0")
    check(args.max_episodes > 0 or args.eval_episodes > 0, "nothing to do: give --max-episodes or --eval-episodes")
    check(args.log_interval >= 1, "--log-interval must be >= 1")
    check(0 < args.gamma <= 1, "--gamma must be in (0, 1]")
    check(args.gamma < 1 or args.truncation == "terminal",
          "--gamma 1 gives a truncated episode an infinite bootstrap value; use --truncation terminal")
    check(args.lr > 0, "--lr must be > 0")
    check(args.rpc_timeout > 0, "--rpc-timeout must be > 0 seconds")
    check(not args.cuda or cuda_device_count() > 0, "--cuda: no CUDA GPU found; run without --cuda")
    if args.load:
        check(os.path.isfile(args.load), f"--load {args.load}: no such file")
        try:
            Policy().load_state_dict(torch.load(args.load, weights_only=True))
        except Exception as error:
            raise UsageError(f"--load {args.load}: not a policy saved by --save ({type(error).__name__})") from None
    for flag, path in (("--save", args.save), ("--plot", args.plot)):
        if path:
            check_output_file(flag, path)
    launch(run_worker, processes, args, timeout=args.rpc_timeout)


if __name__ == "__main__":
    run_main(main)
