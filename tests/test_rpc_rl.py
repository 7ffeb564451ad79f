"""rpc_rl.py: one RPC per step, batched forwards, reproducibility, save/load, failure behaviour."""

import signal
import subprocess
import time

import gymnasium as gym
import numpy as np
import psutil
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


def test_one_rpc_per_step_and_one_forward_per_step_when_batched(tmp_path):
    # two observers, batched and --no-batch side by side (also shows that runs at once do not collide)
    plot = tmp_path / "curve.png"
    batched = start_rpc_rl("--world-size", 3, "--max-episodes", 6, "--seed", 3, "--plot", plot)
    unbatched = start_rpc_rl("--world-size", 3, "--max-episodes", 6, "--seed", 3, "--no-batch")
    batched, unbatched = finish(batched), finish(unbatched)
    for result in (batched, unbatched):
        assert result["episodes"] == 6 and result["observers"] == 2
        assert all(len(rewards) == 2 and min(rewards) > 0 for rewards in result["episode_rewards"])
        # CartPole pays 1 per step, so the rewards count the env steps the observers reported
        assert result["env_steps"] == sum(map(sum, result["episode_rewards"]))
        assert result["step_rpcs"] == result["env_steps"] and result["rpcs_per_step"] == 1.0
    # batched: one forward per step of the episode, however many observers are still playing
    assert batched["forwards"] == sum(map(max, batched["episode_rewards"]))
    assert batched["forwards"] < batched["env_steps"]
    assert unbatched["forwards"] == unbatched["env_steps"]
    # each observer draws from its own generator on the agent: batching changes nothing in the outcome
    assert batched["episode_rewards"] == unbatched["episode_rewards"]
    # distinct environment seeds per observer
    assert [a for a, _ in batched["episode_rewards"]] != [b for _, b in batched["episode_rewards"]]
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
