"""rpc_rl.py: one RPC per step, batched forwards, reproducibility, save/load, failure behaviour."""

import math
import signal
import subprocess
import time

import gymnasium as gym
import numpy as np
import psutil
import pytest
import torch

from conftest import (assert_all_ended, assert_usage_error, last_json, needs_gpus, run_script, spawned_workers,
                      start_script, wait_for_line)

import rpc_rl


def start_rpc_rl(*args):
    return start_script("rpc_rl.py", *args)


def finish(proc, timeout=100):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, err[-3000:]
    return last_json(out)


# Episode rewards of runs made before --envs-per-observer existed (commit 134833c, this machine's CPU): the
# default, one environment per observer, must replay them exactly.
BEFORE_ENVS_PER_OBSERVER = {
    "--world-size 3 --max-episodes 6 --seed 3": [[17.0, 18.0], [13.0, 54.0], [16.0, 24.0], [22.0, 55.0],
                                                  [35.0, 47.0], [46.0, 46.0]],
    "--max-episodes 40 --seed 2": [30.0, 10.0, 17.0, 18.0, 30.0, 13.0, 26.0, 46.0, 19.0, 37.0, 13.0, 22.0, 26.0,
                                   18.0, 16.0, 35.0, 23.0, 29.0, 14.0, 51.0, 23.0, 17.0, 16.0, 21.0, 17.0, 28.0,
                                   84.0, 36.0, 57.0, 73.0, 42.0, 48.0, 59.0, 35.0, 56.0, 13.0, 13.0, 103.0, 87.0,
                                   111.0],
    "--max-episodes 40 --seed 2, greedy evaluation": [53.0, 37.0, 49.0],
}


def by_update(result):
    """A run's episode rewards as [update][environment index][observer]."""
    envs, rows = result["envs_per_observer"], result["episode_rewards"]
    return [rows[start:start + envs] for start in range(0, len(rows), envs)]


@pytest.mark.parametrize("envs", [1, 2])
def test_one_rpc_per_observer_step_one_forward_per_step_when_batched_and_the_same_rewards_without(tmp_path, envs):
    # two observers with `envs` environments each, batched and --no-batch side by side (also shows that runs
    # at once do not collide)
    plot = tmp_path / "curve.png"
    common = ("--world-size", 3, "--max-episodes", 6, "--seed", 3, "--envs-per-observer", envs,
              "--eval-episodes", 3)
    batched = start_rpc_rl(*common, "--plot", plot)
    unbatched = start_rpc_rl(*common, "--no-batch")
    batched, unbatched = finish(batched), finish(unbatched)
    for result in (batched, unbatched):
        assert result["episodes"] == 6 and result["updates"] == 6 // envs and result["observers"] == 2
        assert all(len(rewards) == 2 and min(rewards) > 0 for rewards in result["episode_rewards"])
        # CartPole pays 1 per step, so the rewards count the env steps the observers reported
        assert result["env_steps"] == sum(map(sum, result["episode_rewards"]))
        # one RPC per observer step for all its environments still playing: per update, as many as its longest
        # episode, so 1/K of the env steps when its K episodes are equally long
        longest = [max(rewards[observer] for rewards in update) for update in by_update(result)
                   for observer in range(2)]
        assert result["step_rpcs"] == sum(longest)
        assert result["rpcs_per_step"] == result["step_rpcs"] / result["env_steps"]
        # greedy evaluation: 3 episodes per observer, rounded up to a multiple of the environments
        assert len(result["eval_rewards"]) == 2 * envs * math.ceil(3 / envs)
    # batched: one forward per step of the update, however many environments are still playing
    assert batched["forwards"] == sum(max(map(max, update)) for update in by_update(batched))
    assert batched["forwards"] < batched["step_rpcs"] <= batched["env_steps"]
    assert unbatched["forwards"] == unbatched["step_rpcs"]
    # each observer draws from its own generator on the agent: batching changes nothing in the outcome
    assert batched["episode_rewards"] == unbatched["episode_rewards"]
    assert batched["eval_rewards"] == unbatched["eval_rewards"]
    # distinct environment seeds per observer and per environment
    assert [a for a, _ in batched["episode_rewards"]] != [b for _, b in batched["episode_rewards"]]
    assert len({rpc_rl.observer_seed(3, rank, "env", index) for rank in (1, 2) for index in range(envs)}) == 2 * envs
    if envs == 1:
        assert batched["episode_rewards"] == BEFORE_ENVS_PER_OBSERVER["--world-size 3 --max-episodes 6 --seed 3"]
        assert batched["rpcs_per_step"] == 1.0
    else:
        assert batched["rpcs_per_step"] < 1.0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def greedy_rewards(policy, seed, episodes):
    env = gym.make(rpc_rl.ENV_ID)
    rewards = []
    for episode in range(episodes):
        state, _ = env.reset(seed=rpc_rl.observer_seed(seed, 1, "eval") if episode == 0 else None)
        total, done = 0.0, False
        while not done:
            with torch.no_grad():
                action = policy(torch.from_numpy(state).float()[None]).argmax().item()
            state, reward, terminated, truncated, _ = env.step(action)
            total, done = total + reward, terminated or truncated
        rewards.append(total)
    return rewards


def test_same_seed_same_rewards_it_learns_and_the_saved_policy_evaluates_the_same(tmp_path):
    saved = tmp_path / "policy.pt"
    runs = [start_rpc_rl("--max-episodes", 40, "--seed", 2, "--save", saved, "--eval-episodes", 3),
            start_rpc_rl("--max-episodes", 40, "--seed", 2)]  # at the same time: no collision
    trained, again = (finish(run) for run in runs)
    assert trained["episode_rewards"] == again["episode_rewards"]
    rewards = [reward for (reward,) in trained["episode_rewards"]]
    assert rewards == BEFORE_ENVS_PER_OBSERVER["--max-episodes 40 --seed 2"]
    assert trained["running_reward"] == 39.287  # the tutorial's running reward, as before
    assert trained["eval_rewards"] == BEFORE_ENVS_PER_OBSERVER["--max-episodes 40 --seed 2, greedy evaluation"]
    assert sum(rewards[-10:]) > 1.5 * sum(rewards[:10]), rewards

    evaluated = finish(start_rpc_rl("--load", saved, "--max-episodes", 0, "--eval-episodes", 3, "--seed", 2))
    assert evaluated["episodes"] == 0 and evaluated["env_steps"] == 0
    assert len(trained["eval_rewards"]) == 3
    assert evaluated["eval_rewards"] == trained["eval_rewards"]
    policy = rpc_rl.Policy()
    policy.load_state_dict(torch.load(saved, weights_only=True))
    # the distributed greedy evaluation equals a plain local one with the saved weights
    assert greedy_rewards(policy, 2, 3) == trained["eval_rewards"]
    torch.manual_seed(2)
    assert not torch.equal(rpc_rl.Policy().affine1.weight, policy.affine1.weight)  # the file holds trained weights


def test_bad_input_is_one_line(tmp_path):
    assert_usage_error(run_script("rpc_rl.py", "--world-size", 1, timeout=60), "world size 1")
    assert_usage_error(run_script("rpc_rl.py", "--load", tmp_path / "missing.pt", timeout=60), "--load")
    assert_usage_error(run_script("rpc_rl.py", "--gamma", 1, timeout=60), "--truncation terminal")
    assert_usage_error(run_script("rpc_rl.py", "--truncation", "never", timeout=60), "--truncation")
    assert_usage_error(run_script("rpc_rl.py", "--envs-per-observer", 0, timeout=60), "--envs-per-observer")
    if not torch.cuda.is_available():
        assert_usage_error(run_script("rpc_rl.py", "--cuda", timeout=60), "--cuda")


def test_killed_observer_ends_the_run_without_orphans():
    proc = start_rpc_rl("--world-size", 3, "--max-episodes", 5000, "--log-interval", 1)
    try:
        wait_for_line(proc, "episode 1 |", timeout=100)  # training is under way
        processes = psutil.Process(proc.pid).children(recursive=True)
        workers = spawned_workers(proc)  # ranks 0, 1, 2: the youngest is an observer
        assert len(workers) == 3
        killed_at = time.monotonic()
        workers[-1].send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - killed_at < 60
        assert proc.returncode != 0, err[-3000:]
        assert_all_ended(processes, timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_the_numpy_forward_the_agent_acts_with_equals_the_policy_it_learns_with():
    torch.manual_seed(0)
    policy = rpc_rl.Policy()
    states = torch.randn(5, 4)
    keep_mask = rpc_rl.Policy.keep_mask(np.random.default_rng(0).random((5, rpc_rl.Policy.hidden)))
    assert set(np.unique(keep_mask)) == {0.0, np.float32(1 / 0.4)}  # inverted dropout, as nn.Dropout(0.6)
    for mask in (None, keep_mask):
        expected = policy(states, None if mask is None else torch.from_numpy(mask))
        probs = rpc_rl.numpy_probs(policy.snapshot(), states.numpy(), mask)
        assert probs.dtype == np.float32
        np.testing.assert_allclose(probs, expected.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_discounted_returns_end_at_a_failure_and_continue_past_the_time_limit():
    gamma = 0.9
    np.testing.assert_allclose(rpc_rl.discounted_returns([1.0, 1.0, 1.0], gamma), [2.71, 1.9, 1.0])
    np.testing.assert_allclose(rpc_rl.discounted_returns([1.0, 0.0, 2.0], gamma), [1 + 0.81 * 2, 1.8, 2.0])
    # truncated: the last reward goes on forever, so a policy that kept the pole up sees equal returns
    np.testing.assert_allclose(rpc_rl.discounted_returns([1.0] * 5, gamma, bootstrap=True), [10.0] * 5)
    np.testing.assert_allclose(rpc_rl.discounted_returns([0.0, 1.0], gamma, bootstrap=True), [9.0, 10.0])


def test_the_first_episode_that_reaches_the_time_limit_is_learned_from_differently_when_bootstrapped():
    terminal = finish(start_rpc_rl("--seed", 6, "--max-episodes", 140, "--truncation", "terminal"))
    rewards = [reward for (reward,) in terminal["episode_rewards"]]
    assert 500.0 in rewards, "seed 6 no longer reaches the time limit within 140 episodes: pick another seed"
    first = rewards.index(500.0)
    assert terminal["truncated_episodes"] == rewards.count(500.0)
    bootstrap = finish(start_rpc_rl("--seed", 6, "--max-episodes", first + 5))
    assert bootstrap["truncation"] == "bootstrap" and bootstrap["truncated_episodes"] >= 1
    bootstrapped = [reward for (reward,) in bootstrap["episode_rewards"]]
    # identical until the update after that episode, which only the returns' treatment of it changes
    assert bootstrapped[:first + 1] == rewards[:first + 1]
    assert bootstrapped[first + 1:] != rewards[first + 1:first + 5]


@needs_gpus(1)
def test_the_policy_learns_on_a_gpu():
    result = finish(start_rpc_rl("--cuda", "--max-episodes", 40, "--seed", 2))
    assert result["device"] == "cuda:0"
    rewards = [reward for (reward,) in result["episode_rewards"]]
    assert sum(rewards[-10:]) > 1.5 * sum(rewards[:10]), rewards
