"""Distributed REINFORCE on CartPole-v1 with torch.distributed.rpc and RRef: one agent, N observers.

The agent (rank 0) owns the policy and learns; each observer (ranks 1..W-1) owns CartPole environments and
plays them. The agent creates the observers remotely (`rpc.remote`), keeps their RRefs, and starts one episode
on every observer at once (`rpc_async`), handing over its own RRef; an observer asks the agent for an action at
every step (`rpc_sync`), and when all episodes have ended the agent makes one REINFORCE update from all of them.
This is part 1 of PyTorch's tutorial "Getting started with the distributed RPC framework", made bounded,
reproducible and faster: one RPC per step instead of two, and (beyond the tutorial, at the end of this file)
one batched forward for all observers of a step, acting in numpy, several environments per observer,
checkpoints that resume exactly, and a run that ends cleanly when a process dies or hangs.

Commands:
    python rpc_rl.py                                  # agent + 1 observer on this machine, until solved
    python rpc_rl.py --world-size 5                   # agent + 4 observers
    python rpc_rl.py --envs-per-observer 16           # agent + 1 observer stepping 16 environments
    python rpc_rl.py --max-episodes 50 --save policy.pt --eval-episodes 5 --plot curve.png
    python rpc_rl.py --load policy.pt --max-episodes 0 --eval-episodes 10    # greedy evaluation only
    python rpc_rl.py --checkpoint-dir ckpt --resume   # the same command again continues where it stopped
    python rpc_rl.py --cuda                           # the agent's policy on GPU 0
    torchrun --standalone --nproc-per-node 3 rpc_rl.py
    # two machines, the agent (rank 0) on the first; run on both, NODE_RANK 0 and 1:
    torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 2 --master-addr $MASTER_ADDR \\
        --master-port 29500 rpc_rl.py

Last lines of `python rpc_rl.py` (seed 1: 354 episodes, 30-45 s of training on a 2-core CPU; seeds 1-5 solve
in 257-357 episodes):
    episode 350 | last reward 500 | running reward 469.9 | 1458 steps/s
    solved: running reward 475.5 > 475 after 354 episodes
    {"script": "rpc_rl", "solved": true, "episodes": 354, "updates": 354, "env_steps": 62957, ...}
"""

import contextlib
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import rpc
from torch.distributed.rpc import RRef
from torch.distributions import Categorical

from common import (
    RunFailed,
    UsageError,
    check,
    check_input_file,
    check_output_dir,
    check_output_file,
    cuda_device_count,
    emit_result,
    init_rpc,
    launch,
    launched_by_torchrun,
    load_checkpoint,
    parse_args,
    pick_device,
    pin_to_one_cpu,
    process_count,
    run_main,
    save_checkpoint,
    seed_everything,
)

AGENT_NAME = "agent"
OBSERVER_NAME = "observer{}"
ENV_ID = "CartPole-v1"


@dataclass
class Args:
    world_size: int = 2
    """processes: rank 0 is the agent, ranks 1..W-1 are observers (under torchrun, its WORLD_SIZE)"""
    envs_per_observer: int = 1
    """K: CartPole environments per observer, stepped together with one RPC per step"""
    max_episodes: int = 2000
    """stop after this many episodes per observer (a multiple of K) unless solved before"""
    gamma: float = 0.99
    """discount factor for future rewards"""
    truncation: Literal["bootstrap", "terminal"] = "bootstrap"
    """returns of an episode cut short by the 500-step limit: bootstrapped, or ended as a failure as in the
    tutorial (see discounted_returns)"""
    lr: float = 1e-2
    """Adam learning rate"""
    seed: int = 1
    """seed of the initial policy, of the environments and of the agent's random numbers"""
    batch: bool = True
    """answer all observers of a step with one policy forward (--no-batch: one forward per request)"""
    log_interval: int = 10
    """episodes (per observer) between two log lines"""
    save: Optional[str] = None
    """write the trained policy to this file"""
    load: Optional[str] = None
    """start from the policy in this file (written by --save, or a checkpoint)"""
    eval_episodes: int = 0
    """after training, play this many greedy episodes per observer (a multiple of K)"""
    plot: Optional[str] = None
    """write the learning curve to this PNG file"""
    checkpoint_dir: Optional[str] = None
    """write a checkpoint (rpc_rl.pt) into this folder every --checkpoint-interval episodes and at the end"""
    checkpoint_interval: int = 50
    """episodes (per observer) between two checkpoints"""
    resume: bool = False
    """continue from the checkpoint in --checkpoint-dir, if there is one (see resume_or_load)"""
    cuda: bool = False
    """put the agent's policy on GPU 0 (observers stay on the CPU)"""
    pin_cpus: bool = True
    """bind each process to a CPU of its own when there are enough (see set_up_process)"""
    rpc_timeout: float = 20.0
    """seconds after which an RPC to a silent process fails (it also bounds one episode)"""


def validate(args):
    """The rules of the flags, checked before any work starts: each broken rule is one line and exit status 2.
    Files are checked by the agent's process (rank 0), which alone reads and writes them."""
    processes = process_count(args.world_size)
    check(processes >= 2, f"world size {processes}: need at least 2 processes (one agent, one observer)")
    check(args.envs_per_observer >= 1, f"--envs-per-observer must be at least 1, not {args.envs_per_observer}")
    check(args.max_episodes >= 0, f"--max-episodes must be 0 or more, not {args.max_episodes}")
    check(args.eval_episodes >= 0, f"--eval-episodes must be 0 or more, not {args.eval_episodes}")
    check(args.max_episodes > 0 or args.eval_episodes > 0, "nothing to do: give --max-episodes or --eval-episodes")
    check(0 < args.gamma <= 1, f"--gamma must be in (0, 1], not {args.gamma}")
    check(args.gamma < 1 or args.truncation == "terminal",
          "--gamma 1 gives a truncated episode an infinite bootstrap value; use --truncation terminal")
    check(args.lr > 0, f"--lr must be positive, not {args.lr}")
    check(args.seed >= 0, f"--seed must be 0 or more, not {args.seed}")
    check(args.log_interval >= 1, f"--log-interval must be at least 1, not {args.log_interval}")
    check(args.checkpoint_interval >= 1, f"--checkpoint-interval must be at least 1, not {args.checkpoint_interval}")
    check(args.rpc_timeout > 0, f"--rpc-timeout must be positive, not {args.rpc_timeout}")
    check(not args.cuda or cuda_device_count() > 0, "--cuda: no CUDA GPU found; run without --cuda")
    check(not args.resume or args.checkpoint_dir, "--resume needs --checkpoint-dir DIR (where the checkpoint is)")
    if launched_by_torchrun() and int(os.environ["RANK"]) != 0:
        return
    if args.load:
        check_input_file("--load", args.load)
        read_policy(args.load, "--load")
    for flag, path in (("--save", args.save), ("--plot", args.plot)):
        if path:
            check_output_file(flag, path)
    if args.checkpoint_dir:
        check_output_dir("--checkpoint-dir", args.checkpoint_dir)
        path = checkpoint_path(args)
        check(not path.is_dir(), f"--checkpoint-dir {args.checkpoint_dir}: {path} is a folder; remove it or pass "
                                 f"another --checkpoint-dir")
        if args.resume and path.exists():
            check_input_file("--resume", path)
            check_resumable(read_checkpoint(args), args, processes)


# ---------------------------------------------------------------------------------------------------------
# The tutorial: the policy, the observer, the agent
# ---------------------------------------------------------------------------------------------------------

class Policy(nn.Module):
    """The tutorial's policy, 4 -> 128 -> 2 with dropout 0.6 on the hidden layer. Lives in the agent process.

    The dropout mask is an argument instead of being drawn inside forward: the update recomputes the
    probabilities the actions were sampled from, which needs the masks they were sampled with (see
    ActionSampler). keep_mask=None is evaluation (no dropout).
    """

    hidden = 128
    dropout = 0.6

    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, self.hidden)
        self.affine2 = nn.Linear(self.hidden, 2)

    def forward(self, states, keep_mask=None):
        hidden = self.affine1(states)
        if keep_mask is not None:
            hidden = hidden * keep_mask
        return F.softmax(self.affine2(F.relu(hidden)), dim=1)


class Observer:
    """Lives in an observer process, created there by the agent with rpc.remote: K CartPole environments
    (--envs-per-observer; the tutorial's observer has one), played with the actions the agent chooses."""

    def __init__(self, envs, batch):
        self.id = rpc.get_worker_info().id
        self.envs = [gym.make(ENV_ID) for _ in range(envs)]
        # the tutorial's protocol answers each request on its own (--no-batch); see select_action_batch
        self.select_action = select_action_batch if batch else Agent.select_action

    def run_episode(self, agent_rref, seeds=None):
        """Play one episode on each environment; returns, per environment, (last reward, env steps, whether the
        time limit cut the episode short rather than the pole falling).

        ONE RPC per step for all environments still playing (the tutorial sends two: select_action, then
        report_reward): the request carries their indices, their new states and the rewards of their previous
        actions; the reward of a final action travels back in this method's return value. An environment whose
        episode ended waits for the others: an update learns from one episode of each. States travel as tuples
        of 4 floats, which unpickle faster than numpy arrays.
        """
        seeds = seeds or [None] * len(self.envs)
        states = [tuple(env.reset(seed=seed)[0].tolist()) for env, seed in zip(self.envs, seeds)]
        playing, rewards = tuple(range(len(self.envs))), None
        endings = [None] * len(self.envs)
        agent = agent_rref.owner()
        for step in range(1, self.envs[0].spec.max_episode_steps + 1):
            # The agent's RRef travels with each request so that the agent finds its Agent object without a
            # process-global table; the RRef protocol acknowledges it with one more message per step.
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
    ending so, --truncation terminal). bootstrap=True (--truncation bootstrap, the default) is for an episode the
    time limit cut short (gymnasium's `truncated`): CartPole's 500-step limit is not part of the task, and ending
    the sum there would teach the policy that its last actions, which kept the pole up, were its worst ones;
    once it balances for the whole episode, every update would then push it away from what it does, and runs
    swing between 500 and a few hundred for hundreds of episodes. REINFORCE has no value function to bootstrap
    from, so the sum continues with the last reward forever, r / (1 - gamma): in CartPole, the pole stays up. A
    policy that balances to the limit then sees equal returns at every step, hence no update, and stays there.
    """
    discounted = rewards[-1] / (1 - gamma) if bootstrap else 0.0
    returns = []
    for reward in reversed(rewards):
        discounted = reward + gamma * discounted
        returns.append(discounted)
    return returns[::-1]


class Agent:
    """Lives in the agent process (rank 0): the policy and its optimizer, the observers' RRefs, the episodes
    being played, per environment (key: observer id, environment index), and the run's progress."""

    def __init__(self, args, world_size, device):
        self.args, self.device = args, device
        seed_everything(args.seed)  # the same initial policy for a given seed
        self.policy = Policy().to(device)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=args.lr)
        self.eps = np.finfo(np.float32).eps.item()
        self.reward_threshold = gym.spec(ENV_ID).reward_threshold
        self.agent_rref = RRef(self)
        self.observer_rrefs = {rank: rpc.remote(OBSERVER_NAME.format(rank), Observer,
                                                args=(args.envs_per_observer, args.batch))
                               for rank in range(1, world_size)}  # an observer's id (its RPC worker id) is its rank
        # every environment, observer by observer: the order of the episodes in an update
        self.envs = [(rank, index) for rank in self.observer_rrefs for index in range(args.envs_per_observer)]
        self.rewards = {env: [] for env in self.envs}
        self.truncated = {}  # environment -> whether the time limit cut its last episode short
        # the run's progress: what the log, the result and the checkpoints report
        self.running_reward, self.running_rewards, self.episode_rewards = 0.0, [], []
        self.updates = self.env_steps = self.truncated_episodes = 0
        # beyond the tutorial: how actions are chosen and batched
        self.sampler = ActionSampler(self.policy, self.envs, args.seed)
        self.batcher = ActionBatcher(self.sampler.act)

    @staticmethod
    def select_action(agent_rref, observer_id, envs, states, rewards):
        """Called by an observer at every step: the actions of its environments `envs` (indices) in `states`,
        whose previous actions earned `rewards` (None at the first step). This is the tutorial's protocol, one
        forward per request (--no-batch); select_action_batch answers all observers of a step at once."""
        self = agent_rref.local_value()
        self.record_rewards(observer_id, envs, rewards)
        return self.sampler.act([(observer_id, envs, states)])[0]

    def record_rewards(self, observer_id, envs, rewards):
        if rewards is not None:
            for index, reward in zip(envs, rewards):
                self.rewards[observer_id, index].append(reward)

    def run_episode(self, greedy=False, seeds=None):
        """One episode on every environment of every observer at once; returns ({(observer id, env index):
        episode reward}, env steps). seeds: {observer id: [seed of each of its environments]}, or None."""
        self.sampler.greedy = greedy
        self.batcher.expect(self.observer_rrefs)
        episodes = {}
        for ob_id, ob_rref in self.observer_rrefs.items():
            episode = ob_rref.rpc_async().run_episode(self.agent_rref, seeds and seeds[ob_id])
            episodes[ob_id] = self.batcher.watch(ob_id, episode)  # batching: see ActionBatcher
        env_steps = 0
        for ob_id, episode in episodes.items():
            for index, (last_reward, steps, truncated) in enumerate(episode.wait()):
                self.rewards[ob_id, index].append(last_reward)
                self.truncated[ob_id, index] = truncated
                env_steps += steps
        episode_rewards = {env: sum(rewards) for env, rewards in self.rewards.items()}
        if greedy:  # nothing to learn from
            for env in self.envs:
                self.rewards[env] = []
        return episode_rewards, env_steps

    def finish_episode(self):
        """REINFORCE update from the episode of every environment; returns the smallest episode reward."""
        returns, states, keep_masks, actions = [], [], [], []
        for env in self.envs:
            # discounted within this environment's own episode (the tutorial runs the sum across observers)
            self.truncated_episodes += self.truncated[env]
            bootstrap = self.truncated[env] and self.args.truncation == "bootstrap"
            returns.extend(discounted_returns(self.rewards[env], self.args.gamma, bootstrap))
            for state, keep_mask, action in self.sampler.take_trajectory(env):
                states.append(state)
                keep_masks.append(keep_mask)
                actions.append(action)
        episode_rewards = {env: sum(self.rewards[env]) for env in self.envs}
        self.update_running_reward(episode_rewards)
        returns = torch.tensor(returns, device=self.device)
        if len(returns) > 1:
            returns = (returns - returns.mean()) / (returns.std() + self.eps)
        # the probabilities the actions were sampled from: one forward for all the episodes, same dropout masks
        probs = self.policy(torch.from_numpy(np.stack(states)).to(self.device),
                            torch.from_numpy(np.stack(keep_masks)).to(self.device))
        log_probs = Categorical(probs=probs).log_prob(torch.tensor(actions, device=self.device))
        loss = -(log_probs * returns).sum()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.sampler.refresh(self.policy)
        for env in self.envs:
            self.rewards[env] = []
        return min(episode_rewards.values())

    def update_running_reward(self, episode_rewards):
        """The tutorial's running reward: 0.05 * (the smallest episode reward over the observers) + 0.95 *
        previous, after each episode; "solved" when it passes 475, CartPole-v1's threshold.

        It counts episodes per observer. An update with K environments per observer plays K rounds at once
        (round k: the episode of environment k on every observer), and each round enters the running reward as
        the tutorial's episode does, round 0 first. K = 1 is the tutorial's rule; for any K the running reward
        is the same function of the episodes played, so "solved" asks as much of them whatever K, and times to
        solve compare across K.
        """
        for round_index in range(self.args.envs_per_observer):
            smallest = min(reward for (_, index), reward in episode_rewards.items() if index == round_index)
            self.running_reward = 0.05 * smallest + (1 - 0.05) * self.running_reward
            self.running_rewards.append(self.running_reward)


# ---------------------------------------------------------------------------------------------------------
# The run: the agent's training loop, the processes, main
# ---------------------------------------------------------------------------------------------------------

def run_agent(args, world_size, device):
    """The agent's loop: an episode on every environment, an update, a log line every --log-interval episodes,
    until solved or --max-episodes; then the policy saved, the greedy evaluation and the result line."""
    agent = Agent(args, world_size, device)
    resumed_after = resume_or_load(agent, args)
    observers, rounds = list(agent.observer_rrefs), len(agent.envs) // len(agent.observer_rrefs)
    solved = agent.running_reward > agent.reward_threshold
    start = interval_start = time.perf_counter()
    steps_before, interval_steps = agent.env_steps, 0
    while not solved and len(agent.episode_rewards) < args.max_episodes:
        # only the first update seeds the environments; later ones continue their random streams
        seeds = first_seeds(args.seed, observers, rounds, "env") if agent.updates == 0 else None
        rewards, steps = agent.run_episode(seeds=seeds)
        last_reward = agent.finish_episode()
        agent.updates += 1
        agent.env_steps += steps
        interval_steps += steps
        # one row per round of episodes (see Agent.update_running_reward), one reward per observer
        agent.episode_rewards.extend([rewards[rank, index] for rank in observers] for index in range(rounds))
        episode = len(agent.episode_rewards)
        if passes_multiple(episode, rounds, args.log_interval):
            now = time.perf_counter()
            print(f"episode {episode} | last reward {last_reward:g} | running reward {agent.running_reward:.1f} | "
                  f"{interval_steps / (now - interval_start):.0f} steps/s", flush=True)
            interval_start, interval_steps = now, 0
        solved = agent.running_reward > agent.reward_threshold
        if solved:
            print(f"solved: running reward {agent.running_reward:.1f} > {agent.reward_threshold:g} "
                  f"after {episode} episodes", flush=True)
        if args.checkpoint_dir and (solved or episode >= args.max_episodes
                                    or passes_multiple(episode, rounds, args.checkpoint_interval)):
            write_checkpoint(agent, args)
    wall_time = time.perf_counter() - start
    counts = {"step_rpcs": agent.sampler.requests, "forwards": agent.sampler.forwards}  # before the evaluation
    if args.save:
        save_policy(agent.policy, args.save)
    eval_rewards = evaluate(agent, args.eval_episodes, observers, rounds)
    report(agent, args, device, solved, wall_time, agent.env_steps - steps_before, counts, eval_rewards,
           resumed_after)


def run_worker(info, args):
    """Every process: rank 0 becomes the agent and trains; the others serve the agent's RPCs as observers."""
    set_up_process(info, args)
    if info.rank == 0:
        init_rpc(info, AGENT_NAME, timeout_s=args.rpc_timeout)
        try:
            # the GPU after the rendezvous: its first call can take seconds, which the observers would spend waiting
            run_agent(args, info.world_size, pick_device(args.cuda))
        except (UsageError, RunFailed):
            # said in one line by common.launch; the observers are fine: they end with the agent, so that none
            # reports a lost connection (should even that fail, the launcher ends them)
            with contextlib.suppress(Exception):
                rpc.shutdown()
            raise
    else:
        init_rpc(info, OBSERVER_NAME.format(info.rank), timeout_s=args.rpc_timeout)
    # observers serve the agent's RPCs until the agent is done and reaches this point too
    rpc.shutdown()


def main(argv=None):
    args = parse_args(Args, argv)
    validate(args)
    launch(run_worker, process_count(args.world_size), args, timeout=args.rpc_timeout)


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: acting in numpy, each observer with its own random numbers
# ---------------------------------------------------------------------------------------------------------

class ActionSampler:
    """Lives in the agent process: chooses the actions from a numpy copy of the policy and records every step
    (state, dropout mask, action) for the update; counts the requests (step_rpcs) and forwards.

    Each observer's dropout masks and action samples come from its own generator, drawn in the order of its
    environments: its actions do not depend on when the other observers' requests arrive, so a seed gives the
    same run with or without batching. (Categorical.sample would draw from torch's global generator, shared by
    all observers.) Several RPC threads may call act at once (--no-batch); each observer has one request in
    flight, so only the shared records need the lock.
    """

    def __init__(self, policy, envs, seed):
        self.lock = threading.Lock()
        self.parameters = numpy_parameters(policy)
        observers = sorted({rank for rank, _ in envs})
        self.generators = {rank: np.random.default_rng(observer_seed(seed, rank, "agent")) for rank in observers}
        self.trajectory = {env: [] for env in envs}
        self.greedy = False  # argmax, no dropout (the greedy evaluation)
        self.requests = self.forwards = 0

    def refresh(self, policy):
        """After every update: acting uses the new parameters (one copy per update, not a device trip per step)."""
        self.parameters = numpy_parameters(policy)

    def act(self, requests):
        """The actions for requests [(observer id, env indices, states)], from one forward of all their states."""
        states = np.array([state for _, _, request_states in requests for state in request_states],
                          dtype=np.float32)
        if self.greedy:
            actions = numpy_probs(self.parameters, states).argmax(axis=1)
        else:
            noise = np.concatenate([self.generators[ob_id].random((len(envs), Policy.hidden + 1))
                                    for ob_id, envs, _ in requests])
            keep_masks = dropout_keep_mask(noise[:, :-1])
            probs = numpy_probs(self.parameters, states, keep_masks)
            # inverse-CDF sampling with the observer's own uniform number
            actions = (noise[:, -1:] > probs.cumsum(axis=1)).sum(axis=1).clip(max=probs.shape[1] - 1)
        actions = actions.tolist()
        with self.lock:
            self.requests += len(requests)
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

    def take_trajectory(self, env):
        """The steps of env's episode since the last update, [(state, keep_mask, action)], and forget them."""
        with self.lock:
            steps, self.trajectory[env] = self.trajectory[env], []
        return steps


def numpy_parameters(policy):
    """The policy's parameters as numpy arrays (float32, on the CPU), for numpy_probs."""
    return [parameter.detach().cpu().numpy().copy() for parameter in
            (policy.affine1.weight, policy.affine1.bias, policy.affine2.weight, policy.affine2.bias)]


def numpy_probs(parameters, states, keep_mask=None):
    """Policy.forward in numpy (float32, equal to the torch forward within rounding; a test checks it).

    A step's forward is a small 4->128->2 product (a row per environment still playing) on the critical path of
    every environment step; torch's fixed cost per operator call, times the ~20 calls it takes, is several
    times what numpy needs for it. The policy learns in torch, on its own device (GPU with --cuda).
    """
    weight1, bias1, weight2, bias2 = parameters
    hidden = states @ weight1.T + bias1
    if keep_mask is not None:
        hidden *= keep_mask
    logits = np.maximum(hidden, 0) @ weight2.T + bias2
    exp = np.exp(logits - logits.max(axis=1, keepdims=True))
    return exp / exp.sum(axis=1, keepdims=True)


def dropout_keep_mask(uniform):
    """Inverted-dropout mask (float32) from uniform noise [n, hidden], scaled like nn.Dropout(Policy.dropout)."""
    return (uniform >= Policy.dropout).astype(np.float32) / np.float32(1 - Policy.dropout)


def observer_seed(seed, rank, purpose, env_index=0):
    """Distinct seed per (run seed, observer rank, purpose, environment index); purpose "env" (training
    episodes), "eval" (greedy episodes) or "agent" (the agent's random numbers for this observer). Environment
    0 keeps the seed an observer with one environment has, so --envs-per-observer 1 replays runs made before
    the flag existed."""
    purpose_id = ("env", "eval", "agent").index(purpose)
    entropy = [seed, rank, purpose_id] + ([env_index] if env_index else [])
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def first_seeds(seed, observers, rounds, purpose):
    """{observer id: [the seed of each of its environments]} for the first episode of training or evaluation."""
    return {rank: [observer_seed(seed, rank, purpose, index) for index in range(rounds)] for rank in observers}


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: batched action selection (one forward for all observers of a step)
# ---------------------------------------------------------------------------------------------------------

@rpc.functions.async_execution
def select_action_batch(agent_rref, observer_id, envs, states, rewards):
    """Agent.select_action, batched: returns at once a future that ActionBatcher completes with the actions."""
    agent = agent_rref.local_value()
    agent.record_rewards(observer_id, envs, rewards)
    return agent.batcher.request(observer_id, envs, states)


class ActionBatcher:
    """Lives in the agent process: holds each observer's request of a step until every observer still playing
    has asked, then answers them all with one forward, ordered by observer id. Each step of an episode then
    costs one forward whatever the arrival timing, and the batch, hence every floating-point result, is the same
    on every run. Requests arrive on RPC threads, several at once: the lock guards the waiting requests.
    """

    def __init__(self, act):
        self.act = act
        self.lock = threading.Lock()
        self.waiting = {}     # observer id -> (env indices, states, future of the actions), not answered yet
        self.playing = set()  # observers with an environment whose current episode has not ended

    def expect(self, observers):
        """At the start of an episode: requests will come from all these observers."""
        with self.lock:
            self.playing = set(observers)

    def request(self, observer_id, envs, states):
        actions = torch.futures.Future()
        with self.lock:
            self.waiting[observer_id] = (envs, states, actions)
            ready = self._take_ready_requests()
        self._answer(ready)
        return actions

    def watch(self, observer_id, episode):
        """The future of an observer's run_episode, chained: once it completes, that observer asks no more, and
        the others may be all there is to wait for. Waiting on the chained future also waits for the callback,
        so it cannot run late and touch the next episode's bookkeeping."""
        return episode.then(lambda done: self._observer_finished(observer_id, done))

    def _observer_finished(self, observer_id, episode):
        with self.lock:
            self.playing.discard(observer_id)
            ready = self._take_ready_requests()
        self._answer(ready)
        return episode.value()  # re-raises an observer's failure in the agent's loop

    def _take_ready_requests(self):
        """Under self.lock: the requests to answer now, sorted by observer id, removed from self.waiting."""
        if not self.waiting or self.waiting.keys() != self.playing:
            return []
        ready = sorted(self.waiting.items())
        self.waiting = {}
        return ready

    def _answer(self, ready):
        if ready:
            answers = self.act([(ob_id, envs, states) for ob_id, (envs, states, _) in ready])
            for (_, (_, _, future)), actions in zip(ready, answers):
                future.set_result(actions)


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: process placement, greedy evaluation, plot, result line
# ---------------------------------------------------------------------------------------------------------

def set_up_process(info, args):
    """One intra-op thread per process (the policy is tiny: more threads only add synchronisation to every
    step) and, with --pin-cpus, the process bound to a CPU of its own when this machine has one for each of its
    processes (common.pin_to_one_cpu says why: TensorPipe's busy-polling threads; `top -H` shows a TP_SHM_reactor
    thread at 100 % in every process). On 2 CPUs with one observer, pinning nearly doubled the env steps per second.
    """
    torch.set_num_threads(1)
    if args.pin_cpus:
        pin_to_one_cpu(info)


def passes_multiple(episode, rounds, interval):
    """Whether the update that brought the episode count to `episode` (rounds episodes per observer) passed a
    multiple of interval."""
    return episode // interval > (episode - rounds) // interval


def evaluate(agent, episodes, observers, rounds):
    """Greedy evaluation (argmax action, no dropout): `episodes` per observer, rounded up to a multiple of the
    environments per observer; its own environment seeds, apart from training's. Returns the episode rewards."""
    eval_rewards = []
    for run in range(math.ceil(episodes / rounds)):
        seeds = first_seeds(agent.args.seed, observers, rounds, "eval") if run == 0 else None
        rewards, _ = agent.run_episode(greedy=True, seeds=seeds)
        eval_rewards.extend(rewards[rank, index] for index in range(rounds) for rank in observers)
    if eval_rewards:
        print(f"greedy evaluation: mean reward {np.mean(eval_rewards):.1f} over {len(eval_rewards)} episodes",
              flush=True)
    return eval_rewards


def report(agent, args, device, solved, wall_time, steps_run, counts, eval_rewards, resumed_after):
    """The plot (--plot) and the result line. Counts cover the whole run, a resumed one included; wall time and
    steps/s the training loop of this process only."""
    if args.plot:
        plot_learning_curve(args.plot, [min(rewards) for rewards in agent.episode_rewards], agent.running_rewards,
                            agent.reward_threshold)
    steps = agent.env_steps
    emit_result("rpc_rl", solved=solved, episodes=len(agent.episode_rewards), updates=agent.updates, env_steps=steps,
                wall_time_s=round(wall_time, 3), steps_per_s=round(steps_run / max(wall_time, 1e-9), 1),
                running_reward=round(agent.running_reward, 3), observers=len(agent.observer_rrefs),
                envs_per_observer=args.envs_per_observer, batch=args.batch, step_rpcs=counts["step_rpcs"],
                rpcs_per_step=counts["step_rpcs"] / max(steps, 1), forwards=counts["forwards"],
                truncation=args.truncation, truncated_episodes=agent.truncated_episodes, device=str(device),
                eval_rewards=eval_rewards, eval_mean_reward=float(np.mean(eval_rewards)) if eval_rewards else None,
                resumed_after_episodes=resumed_after, episode_rewards=agent.episode_rewards)


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


# ---------------------------------------------------------------------------------------------------------
# Beyond the tutorial: --save and --load, checkpoints (--checkpoint-dir, --resume)
# ---------------------------------------------------------------------------------------------------------

CHECKPOINT_KEYS = ("recipe", "policy", "optimizer", "running_reward", "running_rewards", "episode_rewards",
                   "updates", "env_steps", "truncated_episodes", "step_rpcs", "forwards", "agent_random_states",
                   "environment_random_states")


def save_policy(policy, path):
    """--save: the policy's state_dict, as a verified file (common.save_checkpoint): torch.load(path)["policy"]
    reads it. A write that fails keeps the previous file and ends the run with one line."""
    save_checkpoint(path, "rpc_rl", {"policy": {name: value.cpu() for name, value in policy.state_dict().items()}},
                    "--save")


def read_policy(path, flag):
    """The policy state_dict in a file that --save or --checkpoint-dir wrote, verified: a truncated, damaged or
    foreign file, or a policy of another shape, is a one-line UsageError."""
    return check_policy(load_checkpoint(path, "rpc_rl", flag, keys=("policy",))["policy"], flag, path)


def check_policy(policy_state, flag, path):
    try:
        Policy().load_state_dict(policy_state)
    except Exception as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        reason = lines[1] if len(lines) > 1 else (lines[0] if lines else type(error).__name__)
        raise UsageError(f"{flag} {path}: its policy does not fit this script's ({reason}); pass a file written "
                         f"by --save") from None
    return policy_state


def checkpoint_path(args):
    return Path(args.checkpoint_dir) / "rpc_rl.pt"


def recipe(args, world_size):
    """What a resumed run must share with the run that wrote the checkpoint to continue it."""
    return {"observers": world_size - 1, "envs_per_observer": args.envs_per_observer, "seed": args.seed,
            "gamma": args.gamma, "lr": args.lr, "truncation": args.truncation}


def read_checkpoint(args):
    return load_checkpoint(checkpoint_path(args), "rpc_rl", "--resume", keys=CHECKPOINT_KEYS)


def check_resumable(saved, args, world_size):
    """The checkpoint was written with this recipe, and its policy and optimizer state fit: else one line."""
    path = checkpoint_path(args)
    check(saved["recipe"] == recipe(args, world_size),
          f"--resume: {path} was written with {saved['recipe']}, not {recipe(args, world_size)}; pass the same "
          f"flags or another --checkpoint-dir")
    policy = Policy()
    policy.load_state_dict(check_policy(saved["policy"], "--resume", path))
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    try:
        optimizer.load_state_dict(saved["optimizer"])
        shapes_fit = all(value.shape == parameter.shape for parameter in policy.parameters()
                         for value in optimizer.state.get(parameter, {}).values() if value.dim())
    except Exception:
        shapes_fit = False
    check(shapes_fit, f"--resume: {path}: its optimizer state does not fit the policy; pass another --checkpoint-dir")


def write_checkpoint(agent, args):
    """Everything the run needs to continue as if it had not stopped, after an update: the policy, the
    optimizer's state, the progress (running reward, episode rewards, counters) and every random state still
    to be used, the agent's generators and each observer's environments (gymnasium draws an episode's start
    from its environment's generator). Written atomically by the agent (common.save_checkpoint): a failed write
    keeps the previous checkpoint and ends the run with one line."""
    environment_states = {rank: rpc.rpc_sync(rref.owner(), environment_random_states, args=(rref,))
                          for rank, rref in agent.observer_rrefs.items()}
    state = {
        "recipe": recipe(args, len(agent.observer_rrefs) + 1),
        "policy": {name: value.cpu() for name, value in agent.policy.state_dict().items()},
        "optimizer": agent.optimizer.state_dict(),
        "running_reward": agent.running_reward, "running_rewards": agent.running_rewards,
        "episode_rewards": agent.episode_rewards, "updates": agent.updates, "env_steps": agent.env_steps,
        "truncated_episodes": agent.truncated_episodes, "step_rpcs": agent.sampler.requests,
        "forwards": agent.sampler.forwards,
        "agent_random_states": {rank: generator.bit_generator.state
                                for rank, generator in agent.sampler.generators.items()},
        "environment_random_states": environment_states,
    }
    save_checkpoint(checkpoint_path(args), "rpc_rl", state, "--checkpoint-dir")


def resume_or_load(agent, args):
    """--resume with a checkpoint in --checkpoint-dir: continue from it (see write_checkpoint), whatever --load
    says; else --load: start from that policy. Returns the episodes per observer already played.

    A resumed run gives the episode rewards and the policy of a run that never stopped (tested), on the same
    kind of device: only the timings (wall time, steps/s) cover the resumed part alone. The checkpoint says
    nothing about --batch or --cuda, which a resumed run may change (the policy then continues on the other
    device, where rounding can differ).
    """
    if args.resume and checkpoint_path(args).exists():
        saved = read_checkpoint(args)
        agent.policy.load_state_dict(saved["policy"])
        agent.optimizer.load_state_dict(saved["optimizer"])
        agent.sampler.refresh(agent.policy)
        agent.running_reward, agent.running_rewards = saved["running_reward"], saved["running_rewards"]
        agent.episode_rewards, agent.updates = saved["episode_rewards"], saved["updates"]
        agent.env_steps, agent.truncated_episodes = saved["env_steps"], saved["truncated_episodes"]
        agent.sampler.requests, agent.sampler.forwards = saved["step_rpcs"], saved["forwards"]
        for rank, generator in agent.sampler.generators.items():
            generator.bit_generator.state = saved["agent_random_states"][rank]
        for rank, rref in agent.observer_rrefs.items():
            rpc.rpc_sync(rref.owner(), set_environment_random_states,
                         args=(rref, saved["environment_random_states"][rank]))
        print(f"resuming after episode {len(agent.episode_rewards)} from {checkpoint_path(args)}", flush=True)
        return len(agent.episode_rewards)
    if args.load:
        agent.policy.load_state_dict(read_policy(args.load, "--load"))
        agent.sampler.refresh(agent.policy)
    return 0


def environment_random_states(observer_rref):
    """Runs in an observer's process: the state of each of its environments' random generators."""
    return [env.np_random.bit_generator.state for env in observer_rref.local_value().envs]


def set_environment_random_states(observer_rref, states):
    for env, state in zip(observer_rref.local_value().envs, states):
        env.np_random.bit_generator.state = state


if __name__ == "__main__":
    run_main(main)
