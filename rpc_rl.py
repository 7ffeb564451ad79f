"""Distributed REINFORCE on CartPole-v1 with torch.distributed.rpc and RRef: one agent, N observers.

Rank 0 is the agent: it owns the policy and the optimizer and trains. Ranks 1..W-1 are observers, each with
its own gymnasium CartPole-v1 environment (or K of them, --envs-per-observer). The agent creates the observers
remotely (`rpc.remote`), keeps their RRefs and hands them its own RRef, then plays one episode on every
observer at once with async RPCs and learns from all of them when they are done. The tutorial this mirrors
("Getting started with the distributed RPC framework", part 1) sends two RPCs per environment step (ask for an
action, report the reward) and runs one policy forward per request. Here an observer sends its new state
together with the reward of its previous action in ONE RPC, and the agent answers all observers of a step with
ONE batched forward (`@rpc.functions.async_execution` and futures), computed in numpy on a snapshot of the
policy, which is quicker than torch for one tiny forward. An RPC round trip costs far more than a CartPole step,
so an observer can step K environments and send the states of all those still playing in that one RPC
(rpcs_per_step 1/K when the K episodes last as long). Returns are discounted per environment episode, and an
episode that CartPole's time limit cut short is bootstrapped instead of being treated as a failure
(`--truncation`).

Commands:
    python rpc_rl.py                                  # agent + 1 observer on this machine, until solved
    python rpc_rl.py --world-size 5                   # agent + 4 observers
    python rpc_rl.py --envs-per-observer 16           # agent + 1 observer stepping 16 environments
                                                      # (see benchmarks/bench_rpc_rl_envs.py)
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
    {"script": "rpc_rl", "solved": true, "episodes": 354, "updates": 354, "env_steps": 62957, ...}
"""

import math
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
    envs_per_observer: int = 1
    """K: environments per observer, all stepped with one RPC per step; an update learns from one episode on each
    (how episodes are counted and the running reward defined: Agent.finish_episode)"""
    max_episodes: int = 2000
    """stop after this many episodes per observer (rounded up to a multiple of --envs-per-observer) unless solved
    before"""
    gamma: float = 0.99
    """discount factor for future rewards"""
    truncation: Literal["bootstrap", "terminal"] = "bootstrap"
    """returns of an episode the 500-step time limit cut short: continue them with the last reward forever,
    r / (1 - gamma) (bootstrap: solves in half the episodes, see benchmarks/bench_rpc_rl.py), or end them there
    as if the pole had fallen (terminal: the tutorial)"""
    lr: float = 1e-2
    """Adam learning rate"""
    seed: int = 1
    """seed of the policy's initialisation, of each environment and of the agent's sampling"""
    batch: bool = True
    """answer all observers of a step with one policy forward (--no-batch: one forward per request)"""
    log_interval: int = 10
    """episodes (per observer) between two log lines"""
    save: Optional[str] = None
    """write the trained policy's state_dict to this file"""
    load: Optional[str] = None
    """start from the policy saved in this file instead of a fresh one"""
    eval_episodes: int = 0
    """after training, play this many greedy episodes (argmax action, no dropout) on every observer (rounded up
    to a multiple of --envs-per-observer)"""
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


class Observer:
    """Lives in an observer process (created there by the agent with rpc.remote): K CartPole environments
    (--envs-per-observer; the tutorial's observer has one)."""

    def __init__(self, envs, batch):
        self.id = rpc.get_worker_info().id
        self.envs = [gym.make(ENV_ID) for _ in range(envs)]
        # --no-batch: the tutorial's protocol, each request answered on its own; batched, the agent waits for
        # every observer's request of the step (see Agent.select_action_batch)
        self.select_action = Agent.select_action_batch if batch else Agent.select_action

    def run_episode(self, agent_rref, seeds=None):
        """Play one episode on each environment, asking the agent for the actions; returns, per environment,
        (last reward, env steps, whether the time limit cut the episode short rather than the pole falling).

        ONE RPC per step for all environments still playing: the request carries their indices, their new
        states and the rewards of their previous actions. An environment whose episode ended waits for the
        others (one episode per environment per update); the reward of its final action travels back in this
        method's return value instead of in an extra RPC. States travel as tuples of 4 floats: unpickling numpy
        arrays costs the agent more than the step's forward.
        """
        seeds = seeds or [None] * len(self.envs)
        states = [tuple(env.reset(seed=seed)[0].tolist()) for env, seed in zip(self.envs, seeds)]
        playing, rewards = tuple(range(len(self.envs))), None
        endings = [None] * len(self.envs)
        agent = agent_rref.owner()
        for step in range(1, self.envs[0].spec.max_episode_steps + 1):
            # The agent's RRef travels with each request so that select_action finds the Agent object without a
            # process-global table; RRef bookkeeping adds an acknowledgement message per step, the price of
            # keeping all state in objects.
            actions = rpc.rpc_sync(agent, self.select_action, args=(agent_rref, self.id, playing, states, rewards))
            still_playing, states, rewards = [], [], []
            for index, action in zip(playing, actions):
                state, reward, terminated, truncated, _ = self.envs[index].step(action)
                if terminated or truncated:
                    endings[index] = (float(reward), step, truncated and not terminated)
                else:
                    still_playing.append(index)
                    states.append(tuple(state.tolist()))
                    rewards.append(reward)
            playing = tuple(still_playing)
            if not playing:
                break
        return endings


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
    """Lives in the agent process (rank 0): the policy, the optimizer, the observers' RRefs, the episode data,
    kept per environment: keys (observer id, environment index).

    select_action runs on RPC threads, several at once; everything they share is guarded by self.lock.
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
        self.running_rewards = []  # after every round of episodes (see finish_episode), for the plot
        self.agent_rref = RRef(self)
        self.observer_rrefs = {}
        self.generators = {}  # one per observer: see _act
        for rank in range(1, world_size):  # an observer's id (its RPC worker id) is its rank
            self.observer_rrefs[rank] = rpc.remote(OBSERVER_NAME.format(rank), Observer,
                                                   args=(args.envs_per_observer, args.batch))
            self.generators[rank] = np.random.default_rng(observer_seed(args.seed, rank, "agent"))
        # every environment, observer by observer: the order of the episodes in an update
        self.envs = [(rank, index) for rank in self.observer_rrefs for index in range(args.envs_per_observer)]
        self.lock = threading.Lock()
        self.waiting = {}       # observer id -> (env indices, states, future of the actions), not answered yet
        self.playing = set()    # observers with an environment whose current episode has not ended
        self.greedy = False
        self.step_rpcs = 0      # select_action calls received (the test checks: one per observer step)
        self.forwards = 0       # policy forwards spent on acting
        self.trajectory = {env: [] for env in self.envs}   # (state, keep_mask, action) per step
        self.rewards = {env: [] for env in self.envs}
        self.truncated = {}     # environment -> whether its last episode hit the time limit
        self.truncated_episodes = 0  # training episodes (of one environment) the time limit cut short

    @staticmethod
    def select_action(agent_rref, observer_id, envs, states, rewards):
        """Called by an observer once per step (--no-batch: the tutorial's one forward per request); returns the
        actions of its environments `envs` (indices), in states `states`, whose previous actions earned
        `rewards` (None at the first step)."""
        self = agent_rref.local_value()
        with self.lock:
            self.step_rpcs += 1
            self._record_rewards(observer_id, envs, rewards)
        return self._act([(observer_id, envs, states)])[0]

    def _record_rewards(self, observer_id, envs, rewards):
        if rewards is not None:
            for index, reward in zip(envs, rewards):
                self.rewards[observer_id, index].append(reward)

    def run_episode(self, greedy=False, seeds=None):
        """One episode on every environment of every observer at once; returns ({(observer id, env index):
        episode reward}, env steps). seeds: {observer id: [seed of each of its environments]}, or None."""
        self.greedy = greedy
        with self.lock:
            self.playing = set(self.observer_rrefs)
        episodes = {}
        for ob_id, ob_rref in self.observer_rrefs.items():
            episode = ob_rref.rpc_async().run_episode(self.agent_rref, seeds[ob_id] if seeds else None)
            # then(): waiting on the chained future also waits for the callback, so it cannot run late and
            # touch the next episode's bookkeeping
            episodes[ob_id] = episode.then(lambda episode, ob_id=ob_id: self._observer_finished(ob_id, episode))
        env_steps = 0
        for ob_id, episode in episodes.items():
            for index, (last_reward, steps, truncated) in enumerate(episode.wait()):
                self.rewards[ob_id, index].append(last_reward)
                self.truncated[ob_id, index] = truncated
                env_steps += steps
        episode_rewards = {env: sum(rewards) for env, rewards in self.rewards.items()}
        if greedy:
            for rewards in self.rewards.values():
                rewards.clear()
        return episode_rewards, env_steps

    def finish_episode(self):
        """REINFORCE update from the episode of every environment; returns the smallest episode reward.

        The running reward counts episodes per observer, as the tutorial's does. An update with K environments
        per observer plays K rounds at once (round k: the episode of environment k on every observer), and each
        round enters the running reward as the tutorial's episode does: 0.05 * (the round's smallest episode
        reward) + 0.95 * previous, round 0 first. K = 1 is the tutorial's rule; for any K the running reward is
        the same function of the episodes played, so "solved" (running reward > 475, checked after each update)
        asks as much of them whatever K, and times to solve compare across K.
        """
        returns, states, keep_masks, actions = [], [], [], []
        for env in self.envs:
            # discounted returns within this environment's own episode, never across environments
            self.truncated_episodes += self.truncated[env]
            bootstrap = self.truncated[env] and self.args.truncation == "bootstrap"
            returns.extend(discounted_returns(self.rewards[env], self.args.gamma, bootstrap))
            for state, keep_mask, action in self.trajectory[env]:
                states.append(state)
                keep_masks.append(keep_mask)
                actions.append(action)
        episode_rewards = {env: sum(self.rewards[env]) for env in self.envs}
        for round_index in range(self.args.envs_per_observer):
            smallest = min(reward for (_, index), reward in episode_rewards.items() if index == round_index)
            self.running_reward = 0.05 * smallest + (1 - 0.05) * self.running_reward
            self.running_rewards.append(self.running_reward)
        returns = torch.tensor(returns, device=self.device)
        if len(returns) > 1:
            returns = (returns - returns.mean()) / (returns.std() + self.eps)
        # one forward for all the episodes, with the dropout masks the actions were sampled with
        probs = self.policy(torch.from_numpy(np.stack(states)).to(self.device),
                            torch.from_numpy(np.stack(keep_masks)).to(self.device))
        log_probs = Categorical(probs=probs).log_prob(torch.tensor(actions, device=self.device))
        loss = -(log_probs * returns).sum()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.snapshot = self.policy.snapshot()
        for env in self.envs:
            self.trajectory[env] = []
            self.rewards[env] = []
        return min(episode_rewards.values())

    # --- Beyond the tutorial: batched action selection (one forward for all observers of a step) ---

    @staticmethod
    @rpc.functions.async_execution
    def select_action_batch(agent_rref, observer_id, envs, states, rewards):
        """select_action, batched: returns at once a future that completes with the actions.

        The agent answers only when every observer still playing has asked, in one forward ordered by observer
        id and environment index: each step of the episode costs one forward whatever the arrival timing, and
        the batch, hence every floating-point result, is the same on every run.
        """
        self = agent_rref.local_value()
        actions = torch.futures.Future()
        with self.lock:
            self.step_rpcs += 1
            self._record_rewards(observer_id, envs, rewards)
            self.waiting[observer_id] = (envs, states, actions)
            ready = self._take_ready_requests()
        self._answer(ready)
        return actions

    def _take_ready_requests(self):
        """Under self.lock: the requests to answer now, sorted by observer id, removed from self.waiting."""
        if not self.waiting or self.waiting.keys() != self.playing:
            return []
        ready = sorted(self.waiting.items())
        self.waiting = {}
        return ready

    def _answer(self, ready):
        if ready:
            answers = self._act([(ob_id, envs, states) for ob_id, (envs, states, _) in ready])
            for (_, (_, _, future)), actions in zip(ready, answers):
                future.set_result(actions)

    def _observer_finished(self, observer_id, episode):
        # An observer whose episodes all ended asks no more: the others may now be all there is to wait for.
        with self.lock:
            self.playing.discard(observer_id)
            ready = self._take_ready_requests()
        self._answer(ready)
        return episode.value()  # re-raises an observer's failure in the agent's main loop

    # --- Beyond the tutorial: acting in numpy, each observer with its own random numbers ---

    def _act(self, requests):
        """The actions for requests [(observer id, env indices, states)], from one numpy forward of all their
        states (see numpy_probs); records each step for the update.

        An observer's dropout masks and action samples come from its own generator, drawn in the order of its
        environments: its actions do not depend on when the other observers' requests arrive, so a seed gives
        the same run with or without batching.
        """
        states = np.array([state for _, _, request_states in requests for state in request_states],
                          dtype=np.float32)
        if self.greedy:
            actions = numpy_probs(self.snapshot, states).argmax(axis=1)
        else:
            noise = np.concatenate([self.generators[ob_id].random((len(envs), Policy.hidden + 1))
                                    for ob_id, envs, _ in requests])
            keep_masks = Policy.keep_mask(noise[:, :-1])
            probs = numpy_probs(self.snapshot, states, keep_masks)
            # inverse-CDF sampling with the observer's own uniform number (Categorical.sample would draw from
            # the global generator, shared by all observers)
            actions = (noise[:, -1:] > probs.cumsum(axis=1)).sum(axis=1).clip(max=probs.shape[1] - 1)
        actions = actions.tolist()
        with self.lock:
            self.forwards += 1
            if not self.greedy:
                rows = [(ob_id, index) for ob_id, envs, _ in requests for index in envs]
                for env, state, keep_mask, action in zip(rows, states, keep_masks, actions):
                    self.trajectory[env].append((state, keep_mask, action))
        answers, start = [], 0
        for _, envs, _ in requests:
            answers.append(actions[start:start + len(envs)])
            start += len(envs)
        return answers


def numpy_probs(snapshot, states, keep_mask=None):
    """Policy.forward in numpy, on a snapshot of the parameters (float32, equal to the torch forward within
    rounding; a test checks it).

    The agent acts with this and learns with Policy.forward. A step's forward is a small 4->128->2 product
    (a row per environment still playing) on the critical path of every environment step; torch's fixed cost
    per operator call, times the ~20 calls it takes, is several times what numpy needs for it. The policy
    learns on its own device (GPU with --cuda) and the agent refreshes the snapshot after every update: one
    copy per update instead of a device round trip per step.
    """
    weight1, bias1, weight2, bias2 = snapshot
    hidden = states @ weight1.T + bias1
    if keep_mask is not None:
        hidden *= keep_mask
    logits = np.maximum(hidden, 0) @ weight2.T + bias2
    exp = np.exp(logits - logits.max(axis=1, keepdims=True))
    return exp / exp.sum(axis=1, keepdims=True)


def observer_seed(seed, rank, purpose, env_index=0):
    """Distinct seed per (run seed, observer rank, purpose, environment index); purpose "env" (training
    episodes), "eval" (greedy episodes) or "agent" (the agent's random numbers for this observer). Environment
    0 keeps the seed an observer with one environment has, so --envs-per-observer 1 replays runs made before
    the flag existed."""
    purpose_id = ("env", "eval", "agent").index(purpose)
    entropy = [seed, rank, purpose_id] + ([env_index] if env_index else [])
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


# --- The run: the agent's training loop, the processes ---

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
    observers, envs = range(1, world_size), range(args.envs_per_observer)
    # one row per episode (per observer), one reward per observer: an update adds a row per environment index
    episode_rewards, env_steps, solved = [], 0, False
    start = interval_start = time.perf_counter()
    interval_steps = updates = 0
    while len(episode_rewards) < args.max_episodes:
        # only the first update seeds the environments; later ones continue their random streams
        seeds = ({rank: [observer_seed(args.seed, rank, "env", index) for index in envs] for rank in observers}
                 if updates == 0 else None)
        rewards, steps = agent.run_episode(seeds=seeds)
        last_reward = agent.finish_episode()
        updates += 1
        env_steps += steps
        interval_steps += steps
        episode_rewards.extend([rewards[rank, index] for rank in observers] for index in envs)
        episode = len(episode_rewards)
        if episode // args.log_interval > (episode - len(envs)) // args.log_interval:
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
    for run in range(math.ceil(args.eval_episodes / len(envs))):
        seeds = ({rank: [observer_seed(args.seed, rank, "eval", index) for index in envs] for rank in observers}
                 if run == 0 else None)
        rewards, _ = agent.run_episode(greedy=True, seeds=seeds)
        eval_rewards.extend(rewards[rank, index] for index in envs for rank in observers)
    if eval_rewards:
        print(f"greedy evaluation: mean reward {np.mean(eval_rewards):.1f} over {len(eval_rewards)} episodes",
              flush=True)
    if args.plot:
        plot_learning_curve(args.plot, [min(rewards) for rewards in episode_rewards], agent.running_rewards,
                            agent.reward_threshold)
    emit_result("rpc_rl", solved=solved, episodes=len(episode_rewards), updates=updates, env_steps=env_steps,
                wall_time_s=round(wall_time, 3), steps_per_s=round(env_steps / max(wall_time, 1e-9), 1),
                running_reward=round(agent.running_reward, 3), observers=world_size - 1,
                envs_per_observer=args.envs_per_observer, batch=args.batch,
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
    check(args.envs_per_observer >= 1, "--envs-per-observer must be >= 1")
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
