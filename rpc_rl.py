"""Distributed REINFORCE on CartPole-v1 with torch.distributed.rpc and RRef: one agent, N observers.

Part 1 of PyTorch's tutorial "Getting started with the distributed RPC framework", bounded and reproducible. The
agent (rank 0) owns the policy and learns; each observer (ranks 1..N-1) owns a CartPole environment and plays it.
The agent creates the observers remotely (`rpc.remote`), keeps their RRefs and starts an episode on every observer
at once (`rpc_async`), handing over its own RRef; an observer asks the agent for an action at every step
(`rpc_sync`), and once every episode has ended the agent makes one REINFORCE update from all of them. The
tutorial's code comes first, and `--tutorial` runs it alone. What runs by default builds on it below the banners:
one RPC per step instead of two, one forward for all observers of a step, several environments per observer, the
returns of time-limited episodes bootstrapped, checkpoints that resume exactly, a saved policy and its greedy
evaluation.

Commands:
    python rpc_rl.py                                  # agent + 1 observer on this machine, until solved
    python rpc_rl.py --tutorial                       # the tutorial's code alone
    python rpc_rl.py --world-size 5                   # agent + 4 observers
    python rpc_rl.py --envs-per-observer 16           # agent + 1 observer stepping 16 environments
    python rpc_rl.py --max-episodes 50 --save policy.pt --eval-episodes 5
    python rpc_rl.py --load policy.pt --max-episodes 0 --eval-episodes 10    # greedy evaluation only
    python rpc_rl.py --checkpoint-dir ckpt --resume   # the same command again continues where it stopped
    torchrun --standalone --nproc-per-node 3 rpc_rl.py
    # two machines, the agent (rank 0) on the first; run on both, NODE_RANK 0 and 1:
    torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 2 --master-addr $MASTER_ADDR \\
        --master-port 29500 rpc_rl.py

Last lines of `python rpc_rl.py`: a log line every --log-interval episodes (its steps/s count from the start of
training), the line that says it solved CartPole, then the result as one JSON line:
    episode E | last reward R | running reward 4xx.x | S steps/s
    solved: running reward 47x.x > 475 after E episodes
    {"script": "rpc_rl", "solved": true, "episodes": E, "env_steps": N, "wall_time_s": T, "steps_per_s": S, ...}
"""

import concurrent.futures
import os
import threading
import time
from dataclasses import dataclass
from typing import Literal, Optional

import gymnasium as gym
import numpy as np
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn, optim
from torch.distributed import rpc
from torch.distributed.rpc import RRef, remote
from torch.distributions import Categorical

import common
from common import NonNegative, Positive, PositiveFloat, Seed, check

AGENT_NAME = "agent"
OBSERVER_NAME = "observer{}"
ENV_ID = "CartPole-v1"


@dataclass
class Args:
    # The tutorial's settings
    world_size: Positive = 2
    """processes: rank 0 is the agent, the others are observers (under torchrun, its WORLD_SIZE)"""
    log_interval: Positive = 10
    """episodes between two log lines"""
    gamma: PositiveFloat = 0.99
    """discount factor for future rewards, at most 1"""
    seed: Seed = 1
    """seed of the initial policy, of the agent's random numbers and of the environments"""
    lr: PositiveFloat = 1e-2
    """Adam's learning rate"""
    max_episodes: NonNegative = 2000
    """stop after this many episodes unless solved before (in an episode, every environment plays one)"""
    tutorial: bool = False
    """run the tutorial's code alone: two RPCs per step, one forward per request, one environment per observer"""
    # Beyond the tutorial
    envs_per_observer: Positive = 1
    """environments each observer steps together, with one RPC per step for all of them"""
    truncation: Optional[Literal["bootstrap", "terminal"]] = None
    """returns of an episode that the 500-step limit cut short: bootstrapped with the last reward repeated forever
    (right for CartPole's constant reward only: change it for an environment whose rewards vary), or ended there as
    after a failure (the tutorial's way); not given: bootstrap, and terminal with --tutorial"""
    eval_episodes: NonNegative = 0
    """after training, play this many greedy episodes (the most probable action, no dropout)"""
    # Output and checkpoints
    save: Optional[str] = None
    """write the trained policy to this file; not given: not saved"""
    load: Optional[str] = None
    """start from the policy in this file (written by --save, or a checkpoint); not given: a new policy"""
    checkpoint_dir: Optional[str] = None
    """write a checkpoint (rpc_rl.pt) into this folder every --checkpoint-interval episodes and at the end; not
    given: no checkpoints"""
    checkpoint_interval: Positive = 50
    """episodes between two checkpoints"""
    resume: bool = False
    """continue from the checkpoint in --checkpoint-dir, if there is one, as if the run had not stopped"""
    # Launch
    rpc_timeout: PositiveFloat = 20.0
    """an RPC to a silent (stopped, hung) process fails after this long and ends the run; it also bounds an
    episode"""


def validate(args):
    """The rules that involve several flags or the launcher (each flag's own rule is checked as it is parsed)."""
    processes = common.process_count(args.world_size)
    check(processes >= 2, f"world size {processes}: need at least 2 processes (one agent, one observer)")
    check(args.max_episodes or args.eval_episodes, "nothing to do: give --max-episodes or --eval-episodes")
    args.truncation = args.truncation or ("terminal" if args.tutorial else "bootstrap")
    check(args.gamma < 1 or args.gamma == 1 and args.truncation == "terminal", f"--gamma {args.gamma}: pass a "
          f"discount factor below 1, or 1 with --truncation terminal (a bootstrapped return would be infinite)")
    check(not args.resume or args.checkpoint_dir, "--resume needs --checkpoint-dir DIR (where the checkpoint is)")
    check(not args.load or os.path.isfile(args.load), f"--load {args.load}: no such file")


class Policy(nn.Module):
    """The tutorial's policy: 4 -> 128 -> 2 with dropout 0.6 on the hidden layer. Lives in the agent process."""

    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)

    def forward(self, x):
        x = self.affine1(x)
        x = self.dropout(x)
        x = F.relu(x)
        action_scores = self.affine2(x)
        return F.softmax(action_scores, dim=1)


class Observer:
    """Lives in an observer process, created there by the agent with rpc.remote: one CartPole environment,
    played with the actions the agent chooses."""

    def __init__(self, args):
        self.id = rpc.get_worker_info().id
        self.env = gym.make(ENV_ID)
        self.env.reset(seed=args.seed + self.id)  # gymnasium's env.seed: each observer its own episodes

    def run_episode(self, agent_rref):
        state, _ = self.env.reset()
        for _ in range(self.env.spec.max_episode_steps):
            # send the state to the agent to get an action
            action = agent_rref.rpc_sync().select_action(self.id, state)
            # apply the action to the environment, and get the reward
            state, reward, terminated, truncated, _ = self.env.step(action)
            # report the reward to the agent for training purpose
            agent_rref.rpc_sync().report_reward(self.id, reward)
            if terminated or truncated:
                break


def env_steps(agent, first=0):
    """The environment steps of the episodes from `first` on: CartPole pays a reward of 1 per step."""
    return int(sum(map(sum, agent.episode_rewards[first:])))


class Agent:
    """Lives in the agent process (rank 0): the policy and its optimizer, the observers' RRefs, per observer the
    log-probabilities of its actions and its rewards in the episode being played, and every episode's rewards.
    saved: a policy to start from (--load); observer: the class of the observers it creates."""

    def __init__(self, world_size, args, saved=None, observer=Observer):
        self.ob_rrefs = []
        self.agent_rref = RRef(self)
        self.rewards = {}
        self.saved_log_probs = {}
        torch.manual_seed(args.seed)  # the same initial policy for a seed
        self.policy = Policy()
        if saved:
            self.policy.load_state_dict(saved["policy"])
        self.optimizer = optim.Adam(self.policy.parameters(), lr=args.lr)
        self.eps = np.finfo(np.float32).eps.item()
        self.args = args
        self.running_reward = 0
        self.reward_threshold = gym.spec(ENV_ID).reward_threshold
        self.episode_rewards = []
        for ob_rank in range(1, world_size):
            ob_info = rpc.get_worker_info(OBSERVER_NAME.format(ob_rank))
            self.ob_rrefs.append(remote(ob_info, observer, args=(args,)))
            self.rewards[ob_info.id] = []
            self.saved_log_probs[ob_info.id] = []

    def select_action(self, ob_id, state):
        state = torch.from_numpy(state).float().unsqueeze(0)
        probs = self.policy(state)
        m = Categorical(probs)
        action = m.sample()
        self.saved_log_probs[ob_id].append(m.log_prob(action))
        return action.item()

    def report_reward(self, ob_id, reward):
        self.rewards[ob_id].append(reward)

    def run_episode(self):
        futs = []
        for ob_rref in self.ob_rrefs:
            # make async RPC to kick off an episode on all observers
            futs.append(ob_rref.rpc_async().run_episode(self.agent_rref))
        # wait until all observers have finished this episode
        for fut in futs:
            fut.wait()

    def finish_episode(self):
        """The REINFORCE update from the episodes just played: returns discounted within each episode and normalised
        together, loss = -sum(log_prob * R), one optimizer step. Returns the smallest episode reward."""
        # joins probs and returns from different observers into lists
        probs, returns = [], []
        for ob_id in self.rewards:
            probs.extend(self.saved_log_probs[ob_id])
            returns.extend(self.discounted_returns(ob_id))
        # use the minimum observer reward to calculate the running reward
        self.episode_rewards.append([sum(rewards) for rewards in self.rewards.values()])
        min_reward = min(self.episode_rewards[-1])
        self.update_running_reward(self.episode_rewards[-1])
        # clear saved probs and rewards
        for ob_id in self.rewards:
            self.rewards[ob_id] = []
            self.saved_log_probs[ob_id] = []
        returns = torch.tensor(returns)
        returns = (returns - returns.mean()) / (returns.std() + self.eps)
        policy_loss = -(torch.cat(probs) * returns).sum()
        self.optimizer.zero_grad()
        policy_loss.backward()
        self.optimizer.step()
        return min_reward

    def discounted_returns(self, ob_id, R=0.0):
        """G_t = r_t + gamma * G_{t+1} over one observer's episode, ended at its last step (the tutorial runs one
        sum over the rewards of all observers, so that one episode's return leaks into another's)."""
        returns = []
        for r in self.rewards[ob_id][::-1]:
            R = r + self.args.gamma * R
            returns.insert(0, R)
        return returns

    def update_running_reward(self, episode_rewards):
        """The tutorial's running reward, 0.05 * the smallest episode reward + 0.95 * the previous one; "solved"
        once it passes CartPole-v1's threshold, 475."""
        self.running_reward = 0.05 * min(episode_rewards) + (1 - 0.05) * self.running_reward

    def report(self, solved, wall_time, steps, **figures):
        """Print the run's last line, one JSON object: times cover this process's training loop, counts the whole
        run."""
        common.emit_result("rpc_rl", solved=solved, episodes=len(self.episode_rewards), env_steps=env_steps(self),
                           wall_time_s=round(wall_time, 3), steps_per_s=round(steps / wall_time, 1), **figures,
                           running_reward=round(self.running_reward, 3), episode_rewards=self.episode_rewards)


def run_agent(agent, args):
    """The agent's loop: an episode on every observer, an update, a log line every --log-interval episodes, until
    the running reward passes the threshold or --max-episodes. Returns whether it solved CartPole, the loop's
    seconds and its environment steps."""
    start, first = time.perf_counter(), len(agent.episode_rewards)  # a resumed run starts after `first` episodes
    solved = agent.running_reward > agent.reward_threshold
    while not solved and len(agent.episode_rewards) < args.max_episodes:
        agent.run_episode()
        last_reward = agent.finish_episode()
        i_episode, solved = len(agent.episode_rewards), agent.running_reward > agent.reward_threshold
        if i_episode % args.log_interval == 0:
            print(f"episode {i_episode} | last reward {last_reward:g} | running reward {agent.running_reward:.1f} | "
                  f"{env_steps(agent, first) / (time.perf_counter() - start):.0f} steps/s", flush=True)
        if solved:
            print(f"solved: running reward {agent.running_reward:.1f} > {agent.reward_threshold:g} after {i_episode} "
                  f"episodes", flush=True)
    return solved, time.perf_counter() - start, env_steps(agent, first)


# --- Beyond the tutorial: K environments per observer, one RPC per step, one forward for all observers; checkpoints
# that resume exactly, the greedy evaluation ---

class BatchObserver(Observer):
    """Lives in an observer process: K CartPole environments (--envs-per-observer), played together."""

    def __init__(self, args):
        super().__init__(args)
        self.envs = [self.env] + [gym.make(ENV_ID) for _ in range(args.envs_per_observer - 1)]

    def run_episode(self, agent_rref, seeds):
        """One episode on each environment, started from its seed; returns {(observer id, environment index):
        whether the time limit, not a failure, ended it}. ONE RPC per step for all environments still playing (the
        tutorial sends two per environment): it carries their states and the rewards of their previous actions. An
        environment whose episode has ended waits for the others; a last RPC without states brings the last
        rewards."""
        states = {index: env.reset(seed=seed)[0].tolist() for index, (env, seed) in enumerate(zip(self.envs, seeds))}
        rewards, truncated = {}, {}
        for _ in range(self.env.spec.max_episode_steps + 1):
            actions = agent_rref.rpc_sync().select_action(self.id, states, rewards)
            if not states:
                return truncated
            rewards, playing, states = {}, states, {}
            for index, action in zip(playing, actions):
                state, rewards[index], terminated, cut_short, _ = self.envs[index].step(action)
                truncated[self.id, index] = cut_short and not terminated
                if not (terminated or cut_short):
                    states[index] = state.tolist()


CHECKPOINT = "rpc_rl.pt"  # the file in --checkpoint-dir
CHECKPOINT_KEYS = ("recipe", "policy", "optimizer", "episode_rewards", "running_reward", "rng")


def recipe(args):
    """What a resumed run must share with the run that wrote the checkpoint."""
    return {"observers": common.process_count(args.world_size) - 1, "envs_per_observer": args.envs_per_observer,
            "seed": args.seed, "gamma": args.gamma, "lr": args.lr, "truncation": args.truncation}


def read_checkpoint(args):
    """What the agent starts from: with --resume, the checkpoint in --checkpoint-dir if there is one (after a line
    that says so; --load is then not read), else the policy of --load, else None (a new policy). Read once, before any
    process starts, and checked to fit the policy."""
    path = os.path.join(args.checkpoint_dir or "", CHECKPOINT)
    if args.checkpoint_dir:
        common.make_dir("--checkpoint-dir", args.checkpoint_dir)
    if args.resume and os.path.exists(path):  # (validate: --resume comes with --checkpoint-dir)
        saved = common.load_checkpoint(path, "rpc_rl", "--resume", keys=CHECKPOINT_KEYS)
        check(saved["recipe"] == recipe(args), f"--resume: {path} was written with {saved['recipe']}, not "
              f"{recipe(args)}; pass the same flags or another --checkpoint-dir")
        policy = common.check_fits(Policy(), saved["policy"], "--resume", path)
        common.check_fits(optim.Adam(policy.parameters()), saved["optimizer"], "--resume", path)
        print(f"resuming after episode {len(saved['episode_rewards'])} from {path}", flush=True)
        return saved
    if args.load:
        saved = common.load_checkpoint(args.load, "rpc_rl", "--load", keys=("policy",))
        return {"policy": common.check_fits(Policy(), saved["policy"], "--load", args.load).state_dict()}


class BatchAgent(Agent):
    """Lives in the agent process: the tutorial's Agent, answering every observer of a step with one forward of the
    policy, sampled as the tutorial samples; rewards and log-probabilities are kept per environment, (observer id,
    environment index). It continues from a checkpoint (--resume) and writes checkpoints."""

    def __init__(self, world_size, args, saved=None):
        super().__init__(world_size, args, saved, BatchObserver)
        self.rewards = {(ob_id, index): [] for ob_id in self.rewards for index in range(args.envs_per_observer)}
        self.saved_log_probs = {env: [] for env in self.rewards}
        self.lock, self.waiting = threading.Lock(), {}  # the requests of this step so far
        self.acting = concurrent.futures.ThreadPoolExecutor(max_workers=1)  # the one thread that acts: see act
        if saved and "optimizer" in saved:  # a checkpoint, checked by read_checkpoint
            self.optimizer.load_state_dict(saved["optimizer"])
            self.episode_rewards, self.running_reward = saved["episode_rewards"], saved["running_reward"]
            torch.set_rng_state(saved["rng"])

    def run_episode(self):
        """The tutorial's run_episode, with the seed of every environment's episode drawn by the agent."""
        self.playing = {ob_id for ob_id, _ in self.rewards}  # observers still playing
        seeds = torch.randint(2**31, (len(self.ob_rrefs), self.args.envs_per_observer)).tolist()
        futs = [ob_rref.rpc_async().run_episode(self.agent_rref, ob_seeds)
                for ob_rref, ob_seeds in zip(self.ob_rrefs, seeds)]
        self.truncated = {env: cut for fut in futs for env, cut in fut.wait().items()}

    @rpc.functions.async_execution
    def select_action(self, ob_id, states, rewards):
        """An observer's request of a step: {environment index: state} of its environments still playing (none once
        all have ended) and {index: reward} of their previous actions. Returns a future of the actions, answered
        once every observer still playing has asked. Requests arrive on several RPC threads: hence the lock, under
        which act answers too (the next step's requests can only follow its answers)."""
        actions = torch.futures.Future()
        with self.lock:
            for index, reward in rewards.items():
                self.rewards[ob_id, index].append(reward)
            self.waiting[ob_id] = (states, actions)
            if self.waiting.keys() >= self.playing:
                requests, self.waiting = sorted(self.waiting.items()), {}
                self.playing = {ob_id for ob_id, (ob_states, _) in requests if ob_states}
                self.acting.submit(self.act, requests)
        return actions

    def act(self, requests):
        """Answers [(observer id, (states, future))] from one forward of all their states, in observer order (the
        same batches, hence the same random numbers, on every run), as the tutorial's select_action does for one.
        Always in the same thread (self.acting): autograd orders the backward of the steps' graphs by counters of
        the threads that recorded them, and graphs recorded by whichever RPC thread asked last would sum the
        gradients in another order, to other bits, on every run."""
        envs = [(ob_id, index) for ob_id, (ob_states, _) in requests for index in ob_states]
        states = torch.tensor([state for _, (ob_states, _) in requests for state in ob_states.values()]).view(-1, 4)
        m = Categorical(self.policy(states))
        action = m.sample()
        for env, log_prob in zip(envs, m.log_prob(action).split(1)):
            self.saved_log_probs[env].append(log_prob)
        answers = iter(action.tolist())
        for _, (ob_states, future) in requests:
            future.set_result([next(answers) for _ in ob_states])

    def finish_episode(self):
        """The tutorial's update, then a checkpoint every --checkpoint-interval episodes, once solved and at
        --max-episodes: all the run needs to continue as if it had not stopped (the policy, Adam's state, the records
        and torch's generator, the only random state still to be used)."""
        min_reward = super().finish_episode()
        episode, args = len(self.episode_rewards), self.args
        if args.checkpoint_dir and (episode % args.checkpoint_interval == 0 or episode >= args.max_episodes
                                    or self.running_reward > self.reward_threshold):
            common.save_checkpoint(os.path.join(args.checkpoint_dir, CHECKPOINT), "rpc_rl", {
                "recipe": recipe(args), "policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
                "episode_rewards": self.episode_rewards, "running_reward": self.running_reward,
                "rng": torch.get_rng_state()})
        return min_reward

    def discounted_returns(self, env):
        """With --truncation bootstrap, the return of an episode that CartPole's 500-step limit cut short (gymnasium's
        `truncated`) goes on past the limit. The limit is not part of the task: ending the sum there teaches the
        policy that its last actions, which kept the pole up, were its worst, and once it balances for a whole
        episode, every update pushes it away from what it does. REINFORCE has no value function to bootstrap from:
        the sum goes on with the last reward forever, r / (1 - gamma), so that a policy that balances to the limit
        sees equal returns at every step, hence no update. That is the value of the episode's future only where every
        step pays the same reward, as CartPole's +1 does: for an environment whose rewards vary, bootstrap from a
        learned value function instead (actor-critic), or pass --truncation terminal."""
        bootstrap = self.truncated[env] and self.args.truncation == "bootstrap"
        return super().discounted_returns(env, self.rewards[env][-1] / (1 - self.args.gamma) if bootstrap else 0.0)

    def update_running_reward(self, episode_rewards):
        """K environments per observer play K rounds of episodes at once (round k: environment k of every observer);
        each round enters the running reward as the tutorial's episode does, so "solved" asks as much whatever K."""
        for index in range(self.args.envs_per_observer):
            super().update_running_reward(episode_rewards[index::self.args.envs_per_observer])


@torch.no_grad()
def greedy_evaluation(policy, args):
    """--eval-episodes episodes with the most probable action and no dropout, on an environment of the agent's own,
    seeded with --seed as no observer's is (gymnasium's RecordEpisodeStatistics sums their rewards): their rewards."""
    env = gym.wrappers.RecordEpisodeStatistics(gym.make(ENV_ID), buffer_length=args.eval_episodes)
    policy.eval()
    for episode in range(args.eval_episodes):
        state, _ = env.reset(seed=args.seed if episode == 0 else None)
        terminated = truncated = False
        while not (terminated or truncated):  # CartPole-v1's time limit ends every episode
            action = policy(torch.from_numpy(state)[None]).argmax().item()
            state, _, terminated, truncated, _ = env.step(action)
    if env.return_queue:
        print(f"greedy evaluation: mean reward {np.mean(env.return_queue):.1f} over {len(env.return_queue)} "
              f"episodes", flush=True)
    return list(env.return_queue)


# --- The processes: the agent and its observers, started by mp.spawn or torchrun ---

@common.worker
def run_worker(rank, world_size, store, args, agent_class, saved):
    """Every process: rank 0 is the agent and trains (the tutorial's agent_class, Agent, or the BatchAgent that
    builds on it), then evaluates the policy, prints the result line and writes --save; the others serve the agent's
    RPCs as observers. One thread per process: the policy is tiny."""
    torch.set_num_threads(1)
    # an RPC to a peer that is gone or silent fails after --rpc-timeout instead of hanging
    options = rpc.TensorPipeRpcBackendOptions(init_method=common.init_method(store, "rpc"),
                                              rpc_timeout=args.rpc_timeout)
    rpc.init_rpc(AGENT_NAME if rank == 0 else OBSERVER_NAME.format(rank), rank=rank, world_size=world_size,
                 rpc_backend_options=options)
    if rank == 0:
        agent = agent_class(world_size, args, saved)
        solved, wall_time, steps = run_agent(agent, args)
        agent.report(solved, wall_time, steps, eval_rewards=greedy_evaluation(agent.policy, args))
        if args.save:  # after the result line: a write that fails loses neither it nor a checkpoint
            common.save_checkpoint(args.save, "rpc_rl", {"policy": agent.policy.state_dict()})
        common.FINISHED.set()
    else:  # observers passively waiting for instructions from the agent, which they ask whether it is done
        common.serve(AGENT_NAME, args.rpc_timeout)
    # block until all rpcs finish, and shutdown the RPC instance
    rpc.shutdown()


def main(argv=None):
    """Check the flags and read what the agent starts from (in the agent's process, rank 0, which alone reads and
    writes files), then start the processes: mp.spawn on this machine, or this one process under torchrun."""
    args = common.parse_args(Args, argv)
    validate(args)
    torchrun = common.torchrun_env()
    saved = None
    if not torchrun or torchrun["RANK"] == 0:  # the agent's process
        if args.save:
            common.check_output_file("--save", args.save)
        saved = read_checkpoint(args)
    agent_class = Agent if args.tutorial else BatchAgent
    if torchrun:  # started by torchrun (RANK set): this process's part
        return run_worker(torchrun["RANK"], torchrun["WORLD_SIZE"], "env://", args, agent_class, saved)
    with common.rendezvous() as store:
        common.join(mp.spawn(run_worker, args=(args.world_size, store, args, agent_class, saved),
                             nprocs=args.world_size, join=False))


if __name__ == "__main__":
    common.run_main(main)
