"""Benchmark rpc_rl.py: environment steps/s against the tutorial's protocol, and time to solve CartPole.

1. Steps/s with 1, 2 and 4 observers, side by side in one run:
   - batched:   rpc_rl.py as it is (one RPC per step, one forward per step for all observers);
   - unpinned:  rpc_rl.py --no-pin-cpus (the same, processes not bound to CPUs; pinning only happens when
                there is a CPU for every process, so on 2 CPUs only with 1 observer);
   - no-batch:  rpc_rl.py --no-batch (one RPC per step, one forward per request);
   - tutorial:  the tutorial's protocol, implemented below: two RPCs per step through RRef proxies
                (select_action, then report_reward), one torch forward with autograd per request; its
                processes are pinned like rpc_rl.py's, so the ratio measures the code, not the placement.
   Every mode trains for the same number of episodes with the same seed; steps/s is measured over the training
   loop only (process start and RPC setup excluded) and all processes use one intra-op thread.
2. Episodes and wall time to solve (running reward > 475) at world size 2, for several seeds: median and range,
   with the returns of time-limited episodes bootstrapped (rpc_rl.py's default) and ended there (the tutorial).

    python benchmarks/bench_rpc_rl.py                         # both parts (about 15 min on 2 CPUs)
    python benchmarks/bench_rpc_rl.py --no-solve              # steps/s only
    python benchmarks/bench_rpc_rl.py --no-throughput --seeds 1,2
Ends with one JSON line holding every figure and the machine it ran on.
"""

import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import rpc
from torch.distributed.rpc import RRef
from torch.distributions import Categorical

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common import (  # noqa: E402
    check,
    init_rpc,
    launch,
    parse_args,
    pin_to_one_cpu,
    run_main,
    seed_everything,
    usable_cpus,
)
from rpc_rl import AGENT_NAME, ENV_ID, OBSERVER_NAME, observer_seed  # noqa: E402


@dataclass
class Args:
    observers: str = "1,2,4"
    """comma-separated observer counts for the steps/s comparison"""
    episodes: int = 40
    """training episodes per steps/s measurement"""
    seeds: str = "1,2,3,4,5"
    """comma-separated seeds for the time-to-solve runs (world size 2)"""
    max_episodes: int = 2000
    """episode cap of each time-to-solve run"""
    truncation: str = "bootstrap,terminal"
    """comma-separated --truncation modes of rpc_rl.py to time to solve"""
    throughput: bool = True
    """run part 1 (steps/s)"""
    solve: bool = True
    """run part 2 (time to solve)"""


# ----------------------------------------------------------------------------------------------------------
# The tutorial's protocol (baseline): two RPCs per step, one forward with autograd per request
# ----------------------------------------------------------------------------------------------------------

class TutorialPolicy(nn.Module):
    """The tutorial's policy, dropout inside forward. Lives in the agent process."""

    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 128)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(128, 2)

    def forward(self, x):
        return F.softmax(self.affine2(F.relu(self.dropout(self.affine1(x)))), dim=1)


class TutorialObserver:
    """Lives in an observer process: asks for an action, then reports the reward, in two RPCs per step."""

    def __init__(self, seed):
        self.id = rpc.get_worker_info().id
        self.env = gym.make(ENV_ID)
        self.seed = seed

    def run_episode(self, agent_rref):
        state, _ = self.env.reset(seed=self.seed)
        self.seed = None
        for step in range(1, self.env.spec.max_episode_steps + 1):
            action = agent_rref.rpc_sync().select_action(self.id, state)
            state, reward, terminated, truncated, _ = self.env.step(action)
            agent_rref.rpc_sync().report_reward(self.id, reward)
            if terminated or truncated:
                return step
        return self.env.spec.max_episode_steps


class TutorialAgent:
    """Lives in the agent process (rank 0), as in the tutorial (returns discounted per observer, as in rpc_rl)."""

    def __init__(self, world_size, seed):
        seed_everything(seed)
        self.policy = TutorialPolicy()
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=1e-2)
        self.agent_rref = RRef(self)
        self.ob_rrefs = [rpc.remote(OBSERVER_NAME.format(rank), TutorialObserver,
                                    args=(observer_seed(seed, rank, "env"),)) for rank in range(1, world_size)]
        self.rewards = {rank: [] for rank in range(1, world_size)}
        self.saved_log_probs = {rank: [] for rank in range(1, world_size)}

    def select_action(self, ob_id, state):
        probs = self.policy(torch.from_numpy(state).float().unsqueeze(0))
        m = Categorical(probs)
        action = m.sample()
        self.saved_log_probs[ob_id].append(m.log_prob(action))
        return action.item()

    def report_reward(self, ob_id, reward):
        self.rewards[ob_id].append(reward)

    def run_episode(self):
        """One episode on every observer; returns the observers' episode rewards (CartPole pays 1 per step)."""
        futures = [ob_rref.rpc_async().run_episode(self.agent_rref) for ob_rref in self.ob_rrefs]
        return [future.wait() for future in futures]

    def finish_episode(self):
        returns, log_probs = [], []
        for ob_id in self.rewards:
            discounted, observer_returns = 0.0, []
            for reward in reversed(self.rewards[ob_id]):
                discounted = reward + 0.99 * discounted
                observer_returns.insert(0, discounted)
            returns.extend(observer_returns)
            log_probs.extend(self.saved_log_probs[ob_id])
            self.rewards[ob_id], self.saved_log_probs[ob_id] = [], []
        returns = torch.tensor(returns)
        returns = (returns - returns.mean()) / (returns.std() + np.finfo(np.float32).eps.item())
        self.optimizer.zero_grad()
        (-(torch.cat(log_probs) * returns).sum()).backward()
        self.optimizer.step()


def tutorial_worker(info, episodes, seed, result_path, until_solved=False):
    """Train for `episodes` episodes, or with until_solved, stop as soon as the tutorial's running reward,
    0.05 * (smallest observer reward) + 0.95 * previous, passes 475 (CartPole-v1's threshold)."""
    torch.set_num_threads(1)  # same as rpc_rl.py, so the comparison is about the protocol
    pin_to_one_cpu(info)
    if info.rank == 0:
        init_rpc(info, AGENT_NAME)
        agent = TutorialAgent(info.world_size, seed)
        env_steps, running_reward, solved, episode, start = 0, 0.0, False, 0, time.perf_counter()
        while episode < episodes and not solved:
            episode += 1
            rewards = agent.run_episode()
            agent.finish_episode()
            env_steps += sum(rewards)
            running_reward = 0.05 * min(rewards) + (1 - 0.05) * running_reward
            solved = until_solved and running_reward > gym.spec(ENV_ID).reward_threshold
        wall_time = time.perf_counter() - start
        Path(result_path).write_text(json.dumps({"env_steps": env_steps, "wall_time_s": wall_time,
                                                 "steps_per_s": env_steps / wall_time, "episodes": episode,
                                                 "solved": solved}))
    else:
        init_rpc(info, OBSERVER_NAME.format(info.rank))
    rpc.shutdown()


# ----------------------------------------------------------------------------------------------------------
# Measurements
# ----------------------------------------------------------------------------------------------------------

def run_rpc_rl(*args, timeout=900):
    proc = subprocess.run([sys.executable, str(REPO / "rpc_rl.py"), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"rpc_rl.py {' '.join(map(str, args))} failed:\n{proc.stderr[-2000:]}")
    return json.loads(next(line for line in reversed(proc.stdout.splitlines()) if line.startswith("{")))


def run_tutorial(observers, episodes, seed, until_solved=False):
    with tempfile.TemporaryDirectory() as folder:
        result_path = Path(folder) / "result.json"
        launch(tutorial_worker, observers + 1, episodes, seed, str(result_path), until_solved)
        return json.loads(result_path.read_text())


def throughput(args):
    print(f"steps/s over {args.episodes} training episodes, seed 1 (higher is better)", flush=True)
    print(f"{'observers':>9} | {'batched':>8} | {'unpinned':>8} | {'no-batch':>8} | {'tutorial':>8} | "
          f"batched / tutorial", flush=True)
    rows = {}
    for observers in [int(n) for n in args.observers.split(",")]:
        common = ("--world-size", observers + 1, "--max-episodes", args.episodes, "--seed", 1,
                  "--log-interval", args.episodes)
        batched = run_rpc_rl(*common)["steps_per_s"]
        unpinned = run_rpc_rl(*common, "--no-pin-cpus")["steps_per_s"]
        unbatched = run_rpc_rl(*common, "--no-batch")["steps_per_s"]
        tutorial = run_tutorial(observers, args.episodes, 1)["steps_per_s"]
        print(f"{observers:>9} | {batched:>8.0f} | {unpinned:>8.0f} | {unbatched:>8.0f} | {tutorial:>8.0f} | "
              f"{batched / tutorial:.2f}x", flush=True)
        rows[observers] = {"batched": batched, "unpinned": unpinned, "no_batch": unbatched, "tutorial": tutorial,
                           "batched_over_tutorial": batched / tutorial}
    return rows


def time_to_solve(args):
    modes = {}
    for truncation in args.truncation.split(","):
        print(f"time to solve at world size 2, --truncation {truncation} (cap {args.max_episodes} episodes)",
              flush=True)
        episodes, times, solved = [], [], 0
        for seed in [int(s) for s in args.seeds.split(",")]:
            start = time.perf_counter()
            result = run_rpc_rl("--seed", seed, "--max-episodes", args.max_episodes, "--log-interval", 100,
                                "--truncation", truncation)
            total = time.perf_counter() - start
            solved += result["solved"]
            episodes.append(result["episodes"])
            times.append(result["wall_time_s"])
            print(f"seed {seed}: {'solved' if result['solved'] else 'NOT solved'} after {result['episodes']} "
                  f"episodes, {result['env_steps']} env steps, {result['wall_time_s']:.1f} s training "
                  f"({total:.1f} s with process start), {result['steps_per_s']:.0f} steps/s", flush=True)
        print(f"--truncation {truncation}: solved {solved}/{len(episodes)} | episodes median "
              f"{statistics.median(episodes):g} (range {min(episodes)}-{max(episodes)}) | wall time median "
              f"{statistics.median(times):.1f} s (range {min(times):.1f}-{max(times):.1f} s)", flush=True)
        modes[truncation] = {"solved": solved, "runs": len(episodes), "episodes": episodes, "wall_time_s": times,
                             "median_episodes": statistics.median(episodes),
                             "median_wall_time_s": statistics.median(times)}
    return modes


def machine():
    """Where the figures were measured, for the JSON line."""
    cpuinfo = Path("/proc/cpuinfo")
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
              if line.startswith("model name")] if cpuinfo.exists() else []
    return {"date": time.strftime("%Y-%m-%d"), "cpus": usable_cpus(),
            "cpu": models[0] if models else platform.processor() or platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__}


def main():
    args = parse_args(Args)
    check(args.episodes >= 1 and args.max_episodes >= 1, "--episodes and --max-episodes must be >= 1")
    figures = {"bench": "rpc_rl", "machine": machine()}
    if args.throughput:
        figures["steps_per_s"] = throughput(args)
    if args.solve:
        figures["time_to_solve"] = time_to_solve(args)
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    run_main(main)
