"""rpc_rl.py: the tutorial's code and the batched agent built on it (one RPC per observer step, one forward per step,
the same update), reproducibility, save/load, checkpoints and exact resume, torchrun across two nodes, --help, bad
input, failures (a killed or stopped process, a killed launcher, a full disk)."""

import concurrent.futures
import io
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
import types

import gymnasium as gym
import numpy as np
import psutil
import pytest
import torch

import common
import rpc_rl
from conftest import (
    REPO,
    assert_all_ended,
    assert_help_lists_every_flag,
    assert_usage_error,
    free_port,
    kill_all,
    last_json,
    run_script,
    spawned_workers,
    torchrun_command,
    tree,
    wait_for_line,
)


def start_rpc_rl(*args, env=None):
    """Start `python rpc_rl.py args...` from the repo root without waiting, with `env` added to the environment."""
    return subprocess.Popen([sys.executable, str(REPO / "rpc_rl.py"), *map(str, args)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})


def finish(proc, timeout=120):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, err[-3000:]
    assert err == "", err[-3000:]  # no warning the user can do nothing about
    return last_json(out)


# A sitecustomize module, which Python imports as every process of a run starts (on PYTHONPATH, so mp.spawn's and
# torchrun's workers too): it counts the calls of CartPole's own step method, one byte per call, in a file per process
# named by the RPC worker that steps ("observer1", "agent") and when it first stepped. os.write, unbuffered: the
# counts survive the workers' os._exit.
STEP_COUNTER = """
import os
import time

import gymnasium.envs.classic_control.cartpole as cartpole

step, counter = cartpole.CartPoleEnv.step, []


def counted_step(self, action):
    if not counter:
        from torch.distributed import rpc
        try:
            name = rpc.get_worker_info().name
        except RuntimeError:  # no RPC agent in this process
            name = "local"
        path = os.path.join(os.environ["STEP_COUNT_DIR"], f"{name}-{time.time_ns()}-{os.getpid()}")
        counter.append(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND))
    os.write(counter[0], b".")
    return step(self, action)


cartpole.CartPoleEnv.step = counted_step
"""


def with_sitecustomize(folder, source):
    """The environment of a run whose every process imports `source` as it starts (sitecustomize.py in `folder`)."""
    (folder / "sitecustomize.py").write_text(source)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


def step_counter(folder):
    """(the environment of a run whose CartPole steps are counted in `folder`, and a function that reads the counts:
    {RPC worker name: [steps of each process of that name, in the order they first stepped]})."""
    counts = folder / "counts"
    counts.mkdir(parents=True)
    env = {**with_sitecustomize(folder, STEP_COUNTER), "STEP_COUNT_DIR": str(counts)}

    def read():
        steps = {}
        for path in sorted(counts.iterdir(), key=lambda path: int(path.name.split("-")[1])):
            steps.setdefault(path.name.split("-")[0], []).append(path.stat().st_size)
        return steps
    return env, read


# `python rpc_rl.py --max-episodes 40 --seed 3 --eval-episodes 3` on a CPU (2026-11-29, torch 2.15.0): every run with
# this seed gives these episode rewards, running reward and greedy evaluation (the torchrun tests compare with them).
SEED_3 = [48.0, 24.0, 21.0, 13.0, 25.0, 14.0, 17.0, 19.0, 45.0, 17.0, 26.0, 41.0, 17.0, 43.0, 30.0, 30.0, 40.0, 53.0,
          19.0, 77.0, 43.0, 65.0, 43.0, 37.0, 32.0, 23.0, 51.0, 75.0, 146.0, 81.0, 33.0, 70.0, 59.0, 85.0, 65.0, 92.0,
          74.0, 92.0, 62.0, 57.0]
SEED_3_RUNNING_REWARD = 50.614
SEED_3_EVAL = [135.0, 107.0, 107.0]


@pytest.mark.parametrize("envs", [1, 3])
def test_two_observers_give_the_same_episodes_from_the_same_seed(tmp_path, envs):
    """Two observers with `envs` environments each, the same command twice at once (which also shows that runs at
    once do not collide): the batches of every step are formed in observer order, so a seed gives one run."""
    flags = ("--world-size", 3, "--max-episodes", 4, "--seed", 3, "--envs-per-observer", envs, "--eval-episodes", 2)
    counted = [step_counter(tmp_path / run) for run in ("first", "second")]
    first, second = (start_rpc_rl(*flags, env=env) for env, _ in counted)
    result, again = finish(first), finish(second)
    assert result["episode_rewards"] == again["episode_rewards"] and result["eval_rewards"] == again["eval_rewards"]
    assert result["episodes"] == 4
    assert all(len(rewards) == 2 * envs and min(rewards) > 0 for rewards in result["episode_rewards"])
    columns = list(zip(*result["episode_rewards"]))
    assert len(set(columns)) == 2 * envs  # every environment plays episodes of its own (seeds drawn by the agent)
    assert len(result["eval_rewards"]) == 2
    # env_steps is computed from the rewards that reached the agent (CartPole pays 1 per step); the observers'
    # environments counted their own steps (STEP_COUNTER). A reward lost or counted twice on its way to the agent,
    # an episode cut short or played on, or env_steps counted from anything else makes them differ. Observer k's
    # environments are columns (k - 1) * envs ... k * envs - 1 of each episode's rewards; the agent's own steps are
    # those of its greedy evaluation.
    for run, (_, counts) in zip((result, again), counted):
        steps = counts()
        for ob_id in (1, 2):
            assert steps[f"observer{ob_id}"] == [sum(sum(rewards[(ob_id - 1) * envs:ob_id * envs])
                                                     for rewards in run["episode_rewards"])], (steps, run)
        assert run["env_steps"] == steps["observer1"][0] + steps["observer2"][0], (steps, run)
        assert steps["agent"] == [sum(run["eval_rewards"])] and set(steps) == {"observer1", "observer2", "agent"}


class RecordingAgent:
    """Stands for the agent's RRef in BatchObserver.run_episode: records each select_action request and answers
    action 0 for environment 0, action 1 for the others (so that their episodes last differently)."""

    def __init__(self):
        self.requests = []

    def rpc_sync(self):
        return self

    def select_action(self, ob_id, states, rewards):
        self.requests.append((ob_id, dict(states), dict(rewards)))
        return [int(index > 0) for index in states]


def test_an_observer_sends_one_rpc_per_step_for_all_its_environments():
    """BatchObserver.run_episode with 3 environments: one request per step with the states of the environments
    still playing and the rewards of their previous actions, and a last one without states; the tutorial sends two
    per step and environment."""
    observer = object.__new__(rpc_rl.BatchObserver)
    observer.id, observer.envs = 7, [gym.make(rpc_rl.ENV_ID) for _ in range(3)]
    observer.env = observer.envs[0]
    agent = RecordingAgent()
    truncated = observer.run_episode(agent, [11, 12, 13])
    assert truncated == {(7, 0): False, (7, 1): False, (7, 2): False}  # pushed one way, the pole falls
    lengths = [sum(index in states for _, states, _ in agent.requests) for index in range(3)]
    assert len(agent.requests) == max(lengths) + 1 and agent.requests[-1][1] == {}
    assert all(ob_id == 7 for ob_id, _, _ in agent.requests) and agent.requests[0][2] == {}
    for (_, before, _), (_, _, rewards) in zip(agent.requests, agent.requests[1:]):
        assert set(rewards) == set(before) and set(rewards.values()) == {1.0}  # the previous actions' rewards
    again = RecordingAgent()  # the same seeds, the same episodes
    observer.run_episode(again, [11, 12, 13])
    assert again.requests == agent.requests


def batch_agent(observers, envs):
    """A BatchAgent as __init__ leaves it for `observers` observers of `envs` environments, without RPC."""
    agent = object.__new__(rpc_rl.BatchAgent)
    torch.manual_seed(0)
    agent.policy, agent.lock, agent.waiting = rpc_rl.Policy(), threading.Lock(), {}
    agent.acting = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    agent.rewards = {(ob_id, index): [] for ob_id in range(1, observers + 1) for index in range(envs)}
    agent.saved_log_probs, agent.playing = {env: [] for env in agent.rewards}, set(range(1, observers + 1))
    return agent


def test_the_agent_answers_every_observer_of_a_step_with_one_forward():
    """BatchAgent.select_action: requests wait until every observer still playing has asked, then one forward (act)
    answers them all, in observer order; an observer whose environments have all ended asks once more, without
    states, and the others no longer wait for it."""
    agent = batch_agent(2, 2)
    forwards = []
    act = agent.act
    agent.act = lambda requests: forwards.append([ob_id for ob_id, _ in requests]) or act(requests)
    state = [0.01, 0.02, 0.03, 0.04]
    one = agent.select_action(2, {0: state, 1: state}, {})
    time.sleep(0.1)
    assert not one.done() and forwards == []  # observer 1 has not asked yet
    two = agent.select_action(1, {1: state}, {0: 1.0})
    assert len(one.wait()) == 2 and len(two.wait()) == 1 and set(one.value() + two.value()) <= {0, 1}
    assert forwards == [[1, 2]] and agent.rewards[1, 0] == [1.0]
    assert [len(agent.saved_log_probs[env]) for env in agent.rewards] == [0, 1, 1, 1]
    last = agent.select_action(1, {}, {1: 1.0})  # observer 1's episodes have ended
    time.sleep(0.1)
    assert not last.done()
    three = agent.select_action(2, {1: state}, {0: 1.0, 1: 1.0})
    assert last.wait() == [] and len(three.wait()) == 1 and forwards == [[1, 2], [1, 2]] and agent.playing == {2}
    four = agent.select_action(2, {1: state}, {1: 1.0})  # now observer 2 alone
    assert len(four.wait()) == 1 and forwards[-1] == [2] and agent.rewards[2, 1] == [1.0, 1.0]


def test_each_environment_keeps_the_log_probability_of_the_action_it_was_answered():
    """act samples every state of a step at once, from the tutorial's policy with its dropout, in observer order: the
    action each environment gets, and the log-probability saved for it, are those of its own row, as the tutorial's
    select_action computes them for one state (here replayed from the same seed, for the whole batch at once)."""
    agent = batch_agent(2, 2)
    states = {1: {0: [0.1, 0.2, 0.3, 0.4]}, 2: {0: [0.0, -0.5, 0.1, 0.9], 1: [-0.2, 0.4, -0.1, -0.3]}}
    futures = {ob_id: torch.futures.Future() for ob_id in states}
    torch.manual_seed(7)
    agent.act([(ob_id, (states[ob_id], futures[ob_id])) for ob_id in (1, 2)])
    torch.manual_seed(7)
    probs = agent.policy(torch.tensor([states[1][0], states[2][0], states[2][1]]))
    actions = torch.distributions.Categorical(probs).sample()
    assert futures[1].wait() == actions[:1].tolist() and futures[2].wait() == actions[1:].tolist()
    for row, env in enumerate([(1, 0), (2, 0), (2, 1)]):
        (log_prob,) = agent.saved_log_probs[env]
        torch.testing.assert_close(log_prob, probs[row, actions[row]].log()[None])
        assert log_prob.grad_fn is not None  # the update's backward reaches the policy through it
    assert agent.saved_log_probs[1, 1] == []


def greedy_rewards(policy, seed, episodes):
    """A plain local greedy evaluation, in torch: the environment seeded with --seed at its first episode."""
    env, rewards = gym.make(rpc_rl.ENV_ID), []
    policy.eval()
    for episode in range(episodes):
        state, _ = env.reset(seed=seed if episode == 0 else None)
        total, done = 0.0, False
        while not done:
            with torch.no_grad():
                action = policy(torch.from_numpy(state)[None]).argmax().item()
            state, reward, terminated, truncated, _ = env.step(action)
            total, done = total + reward, terminated or truncated
        rewards.append(total)
    return rewards


def test_same_seed_same_rewards_it_learns_and_the_saved_policy_evaluates_the_same_in_a_copy_of_the_script(tmp_path):
    saved = tmp_path / "policy.pt"
    trained = finish(start_rpc_rl("--max-episodes", 40, "--seed", 3, "--save", saved, "--eval-episodes", 3))
    rewards = [reward for (reward,) in trained["episode_rewards"]]
    assert rewards == SEED_3 and trained["running_reward"] == SEED_3_RUNNING_REWARD
    assert trained["eval_rewards"] == SEED_3_EVAL
    assert sum(rewards[-10:]) > 2 * sum(rewards[:10]), rewards  # it learns

    # evaluated by the script copied alone with common.py into an empty folder, as a user would take it
    folder = tmp_path / "copy"
    folder.mkdir()
    for name in ("rpc_rl.py", "common.py"):
        shutil.copy(REPO / name, folder / name)
    # with --resume in a checkpoint folder that has no checkpoint yet: --load is what the run starts from
    (tmp_path / "checkpoints").mkdir()
    proc = subprocess.run([sys.executable, "rpc_rl.py", *map(str, ("--load", saved, "--max-episodes", 0,
                                                                   "--eval-episodes", 3, "--seed", 3, "--resume",
                                                                   "--checkpoint-dir", tmp_path / "checkpoints"))],
                          cwd=folder, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    assert "resuming" not in proc.stdout and list((tmp_path / "checkpoints").iterdir()) == []
    evaluated = last_json(proc.stdout)
    assert evaluated["episodes"] == 0 and evaluated["env_steps"] == 0
    assert evaluated["eval_rewards"] == trained["eval_rewards"]
    policy = rpc_rl.Policy()
    policy.load_state_dict(torch.load(saved, weights_only=True)["policy"])
    # the agent's greedy evaluation equals a plain one with the saved weights
    assert greedy_rewards(policy, 3, 3) == trained["eval_rewards"]
    torch.manual_seed(3)
    assert not torch.equal(rpc_rl.Policy().affine1.weight, policy.affine1.weight)  # the file holds trained weights


def test_the_tutorials_code_runs_alone_and_learns(tmp_path):
    """--tutorial: the story's Agent and Observer, two RPCs per step, one forward with autograd per request."""
    env, counts = step_counter(tmp_path)
    result = finish(start_rpc_rl("--tutorial", "--max-episodes", 40, "--seed", 3, "--log-interval", 40, env=env))
    rewards = [reward for (reward,) in result["episode_rewards"]]
    assert result["episodes"] == 40 and result["eval_rewards"] == []
    # the steps the observer's environment made (STEP_COUNTER), not the rewards env_steps is computed from: a reward
    # report_reward lost or recorded twice makes them differ
    assert counts() == {"observer1": [result["env_steps"]]}, (counts(), result["env_steps"])
    assert sum(rewards[-10:]) > 1.5 * sum(rewards[:10]), rewards


def test_returns_end_at_a_failure_and_go_on_past_the_time_limit():
    gamma = 0.9
    tutorial = types.SimpleNamespace(args=types.SimpleNamespace(gamma=gamma),
                                     rewards={1: [1.0, 1.0, 1.0], 2: [1.0, 0.0, 2.0]})
    np.testing.assert_allclose(rpc_rl.Agent.discounted_returns(tutorial, 1), [2.71, 1.9, 1.0])
    np.testing.assert_allclose(rpc_rl.Agent.discounted_returns(tutorial, 2), [1 + 0.81 * 2, 1.8, 2.0])
    batched = object.__new__(rpc_rl.BatchAgent)
    vars(batched).update(rewards={(1, 0): [1.0] * 5, (1, 1): [0.0, 1.0], (2, 0): [1.0, 1.0]},
                         truncated={(1, 0): True, (1, 1): True, (2, 0): False},
                         args=types.SimpleNamespace(gamma=gamma, truncation="bootstrap"))
    # truncated: the last reward goes on forever, so a policy that kept the pole up sees equal returns
    np.testing.assert_allclose(batched.discounted_returns((1, 0)), [10.0] * 5)
    np.testing.assert_allclose(batched.discounted_returns((1, 1)), [9.0, 10.0])
    np.testing.assert_allclose(batched.discounted_returns((2, 0)), [1.9, 1.0])  # ended by a failure
    batched.args.truncation = "terminal"
    np.testing.assert_allclose(batched.discounted_returns((1, 0)), [4.0951, 3.439, 2.71, 1.9, 1.0])


# A sitecustomize module (as STEP_COUNTER) that cuts CartPole's time limit from 500 steps to TIME_LIMIT in every
# process of a run: gym.make reads it from the registry. An untrained policy reaches 50 within a few episodes, where it
# takes thousands of steps of training to reach 500.
TIME_LIMIT = 50
SHORT_TIME_LIMIT = f"""
import gymnasium

gymnasium.envs.registry["CartPole-v1"].max_episode_steps = {TIME_LIMIT}
"""


def test_the_first_episode_that_reaches_the_time_limit_is_learned_from_differently_when_bootstrapped(tmp_path):
    env = with_sitecustomize(tmp_path, SHORT_TIME_LIMIT)
    terminal = finish(start_rpc_rl("--seed", 4, "--max-episodes", 10, "--truncation", "terminal", env=env))
    rewards = [reward for (reward,) in terminal["episode_rewards"]]
    assert max(rewards) == TIME_LIMIT, f"seed 4 no longer reaches {TIME_LIMIT} steps within 10 episodes: pick another"
    first = rewards.index(TIME_LIMIT)
    bootstrap = finish(start_rpc_rl("--seed", 4, "--max-episodes", first + 5, env=env))
    bootstrapped = [reward for (reward,) in bootstrap["episode_rewards"]]
    # identical until the update after that episode, which only the returns' treatment of it changes
    assert bootstrapped[:first + 1] == rewards[:first + 1]
    assert bootstrapped[first + 1:] != rewards[first + 1:first + 5]


# How long after a kill (or a failed write) the launcher must have ended: mp.spawn's join wakes as soon as a process
# dies, SIGTERMs the others, which have no handler for it and die at once, and the launcher prints its line (0.7 to
# 1.2 s measured here with 4 test runs sharing the 2 cores); one that outlived the SIGTERM gets SIGKILL at once
# (common.join: no grace). A process left running would hold the run for its timeout; 10 s leaves 8 times the
# measured time for load.
ENDS_WITHIN_S = 10
CHECKPOINT_EVERY = 10  # episodes between checkpoints in the kill test: a few seconds to the first


def test_killed_observer_ends_the_run_in_one_line_keeps_the_last_checkpoint_and_every_socket_is_on_loopback(tmp_path):
    """An observer SIGKILLed while the agent writes a checkpoint every CHECKPOINT_EVERY episodes: the launcher's one
    line naming process 2, exit status 1, every process ended at once, and the checkpoint from before the kill as it
    was saved. The agent, which alone writes checkpoints, is stopped (SIGSTOP) for the moment of the kill, right after
    episode CHECKPOINT_EVERY + 1, when the next checkpoint is CHECKPOINT_EVERY - 1 episodes away: the file read then is
    what was saved last, and no later one can replace it (the agent continues the instant the kill is sent)."""
    checkpoint = tmp_path / "rpc_rl.pt"
    proc = start_rpc_rl("--world-size", 3, "--max-episodes", 5000, "--log-interval", 1, "--checkpoint-dir", tmp_path,
                        "--checkpoint-interval", CHECKPOINT_EVERY)
    try:
        wait_for_line(proc, "episode 1 |", timeout=100)  # training is under way
        processes = psutil.Process(proc.pid).children(recursive=True)
        workers = spawned_workers(proc)  # ranks 0, 1, 2: the youngest is an observer
        assert len(workers) == 3
        listening = [c.laddr.ip for w in workers for c in w.net_connections(kind="inet") if c.status == "LISTEN"]
        assert listening and all(ip in ("127.0.0.1", "::1") for ip in listening), listening  # TensorPipe's
        wait_for_line(proc, f"episode {CHECKPOINT_EVERY + 1} |", timeout=100)
        workers[0].suspend()
        saved = checkpoint.read_bytes()
        killed_at = time.monotonic()
        workers[-1].send_signal(signal.SIGKILL)
        workers[0].resume()
        _, err = proc.communicate(timeout=60)
        ended_after = time.monotonic() - killed_at
        assert proc.returncode == 1, err[-3000:]
        assert err == "rpc_rl.py: error: process 2 terminated with signal SIGKILL; the other processes were stopped\n"
        assert ended_after < ENDS_WITHIN_S, ended_after
        assert_all_ended(processes, timeout=5)
    finally:
        kill_all(proc)
    # the checkpoint is the one saved before the kill, byte for byte, and it holds the first CHECKPOINT_EVERY episodes
    # (Adam counted as many updates) of a trained policy; no temporary file is left beside it
    assert checkpoint.read_bytes() == saved
    kept = common.load_checkpoint(checkpoint, "rpc_rl", "--resume", keys=rpc_rl.CHECKPOINT_KEYS)
    before = torch.load(io.BytesIO(saved), weights_only=True)
    assert kept.keys() == before.keys() and torch.equal(kept["rng"], before["rng"])
    for name, tensor in before["policy"].items():
        assert torch.equal(kept["policy"][name], tensor), name
    assert len(kept["episode_rewards"]) == CHECKPOINT_EVERY and all(len(rewards) == 2 and min(rewards) > 0
                                                                     for rewards in kept["episode_rewards"])
    assert [state["step"].item() for state in kept["optimizer"]["state"].values()] == [CHECKPOINT_EVERY] * 4
    torch.manual_seed(1)  # --seed's initial policy
    assert not torch.equal(rpc_rl.Policy().affine1.weight, kept["policy"]["affine1.weight"])
    assert [path.name for path in tmp_path.iterdir()] == ["rpc_rl.pt"]


def test_a_killed_launcher_leaves_nothing():
    """SIGKILL of `python rpc_rl.py` itself (not a worker): its processes end within seconds."""
    proc = start_rpc_rl("--max-episodes", 5000, "--log-interval", 1)
    try:
        wait_for_line(proc, "episode 1 |", timeout=100)
        processes = psutil.Process(proc.pid).children(recursive=True)
        assert len(spawned_workers(proc)) == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert_all_ended(processes, timeout=10)
    finally:
        kill_all(proc)
        proc.communicate()


def test_a_stopped_agent_ends_the_run_within_the_rpc_timeout():
    """SIGSTOP on the agent (a hung process, or a frozen machine): the observers, which ask it every half second
    whether it is done (common.serve), find it silent after --rpc-timeout and end in one line; the launcher then
    stops every process, the stopped one with SIGKILL."""
    proc = start_rpc_rl("--max-episodes", 5000, "--log-interval", 1, "--rpc-timeout", 3, "--world-size", 3)
    try:
        wait_for_line(proc, "episode 1 |", timeout=100)
        processes = psutil.Process(proc.pid).children(recursive=True)
        workers = spawned_workers(proc)
        workers[0].suspend()
        stopped_at = time.monotonic()
        _, err = proc.communicate(timeout=60)
        ended_after = time.monotonic() - stopped_at
    finally:
        kill_all(proc, pids=[process.pid for process in processes])
    # (before it, torch prints the error of the observer's own request to the agent, which timed out too)
    assert proc.returncode == 1, err
    assert re.fullmatch(r"process [12] lost a peer \(.*RPC ran for more than.*\); the run ends, or under torchrun "
                        r"restarts if --max-restarts allows", err.strip().splitlines()[-1]), err
    # the ping's 3 s timeout, up to half a second until the next ping, the second a spawned process waits before it
    # says so (common.worker); 5 s more leave room for a loaded machine
    assert 3 <= ended_after < 3 + 0.5 + 1 + 5, ended_after
    assert_all_ended(processes, timeout=5)


# --- Checkpoints and resume; torchrun on two nodes ---

# TensorPipe and gloo on loopback (torchrun's defaults otherwise: a restarted round meets in torchrun's shared
# store under keys of its own, see common.round_store)
LOOPBACK = {"TP_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}


def test_torchrun_restarts_a_killed_worker_and_the_resumed_run_equals_an_uninterrupted_one(tmp_path):
    """`torchrun --max-restarts 1 ... --checkpoint-dir DIR --resume`, an observer SIGKILLed after the first
    checkpoint: torchrun starts the processes again, the agent resumes from the last checkpoint, and the run ends
    with, episode for episode, the rewards, running reward and greedy evaluation of a run that never stopped."""
    checkpoint = tmp_path / "rpc_rl.pt"
    counting, counts = step_counter(tmp_path / "steps")
    proc = subprocess.Popen(torchrun_command("--standalone", "--nproc-per-node", 2, "--max-restarts", 1, "rpc_rl.py",
                                             "--seed", 3, "--max-episodes", 40, "--eval-episodes", 3, "--log-interval",
                                             1, "--checkpoint-dir", tmp_path, "--checkpoint-interval", 5, "--resume"),
                            cwd=REPO, env={**os.environ, **LOOPBACK, **counting}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for_line(proc, "episode 5 |", timeout=100)
        deadline = time.monotonic() + 60
        while not checkpoint.exists() and time.monotonic() < deadline:
            time.sleep(0.02)  # written right after the update, before the log line
        workers = [child for child in psutil.Process(proc.pid).children(recursive=True)
                   if "rpc_rl.py" in " ".join(child.cmdline())]
        assert len(workers) == 2
        max(workers, key=lambda worker: worker.pid).send_signal(signal.SIGKILL)  # rank 1, started last
        out, err = proc.communicate(timeout=150)
    finally:
        kill_all(proc)
    assert proc.returncode == 0, err[-3000:]
    resumed = re.search(r"resuming after episode (\d+) from", out)
    assert resumed and 5 <= int(resumed.group(1)) < 40, out[-3000:]
    result = last_json(out)
    assert [reward for (reward,) in result["episode_rewards"]] == SEED_3
    assert result["running_reward"] == SEED_3_RUNNING_REWARD and result["eval_rewards"] == SEED_3_EVAL
    # The steps the observers' environments made in each round (STEP_COUNTER), not the rewards env_steps is computed
    # from: the restarted observer played exactly the episodes the checkpoint lacked, the killed one at least those
    # the checkpoint holds, and env_steps counts the whole run, the episodes of the checkpoint with the resumed ones.
    steps, episodes = counts(), int(resumed.group(1))
    assert len(steps["observer1"]) == 2 and steps["agent"] == [sum(SEED_3_EVAL)], steps
    assert steps["observer1"][1] == sum(SEED_3[episodes:]) and steps["observer1"][0] >= sum(SEED_3[:episodes]), steps
    assert result["env_steps"] == sum(SEED_3[:episodes]) + steps["observer1"][1]
    assert common.load_checkpoint(checkpoint, "rpc_rl", "--resume")["episode_rewards"] == [
        [reward] for reward in SEED_3]  # the last one, at the end


def test_two_torchrun_nodes_on_loopback_give_the_rewards_of_the_spawned_run():
    """`torchrun --nnodes 2`, one process per node (the agent on node 0, an observer on node 1), as two machines
    would run it: the episode rewards of the spawned run with the same seed (SEED_3, which the spawned runs above
    give)."""
    port = free_port()
    nodes = [subprocess.Popen(torchrun_command("--nnodes", 2, "--node-rank", node, "--nproc-per-node", 1,
                                               "--master-addr", "127.0.0.1", "--master-port", port, "rpc_rl.py",
                                               "--max-episodes", 10, "--seed", 3),
                              cwd=REPO, env={**os.environ, **LOOPBACK}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
             for node in (1, 0)]
    try:
        outputs = [node.communicate(timeout=120) for node in nodes]
    finally:
        kill_all(*nodes)
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-3000:]
    assert outputs[0][0] == ""  # node 1 holds an observer, which prints nothing
    result = last_json(outputs[1][0])
    assert [reward for (reward,) in result["episode_rewards"]] == SEED_3[:10]  # one observer


def test_the_help_lists_every_flag(capsys):
    assert_help_lists_every_flag(rpc_rl, capsys)


# --- Bad input: one line, exit status 2, nothing run, nothing written ---

def write_checkpoint_file(path, script="rpc_rl", **changes):
    """A checkpoint as the agent writes it (a new policy and optimizer, no progress), with `changes`."""
    torch.manual_seed(0)
    policy = rpc_rl.Policy()
    args = rpc_rl.Args(truncation="bootstrap")
    state = {"recipe": rpc_rl.recipe(args), "policy": policy.state_dict(),
             "optimizer": torch.optim.Adam(policy.parameters(), lr=args.lr).state_dict(), "rng": {},
             "episode_rewards": [], "running_reward": 0, **changes}
    path.parent.mkdir(parents=True, exist_ok=True)
    common.save_checkpoint(path, script, state)


@pytest.fixture
def bad_files(tmp_path):
    """tmp_path holding every kind of wrong file a flag may be given."""
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "text.pt").write_text("not a checkpoint\n")
    write_checkpoint_file(tmp_path / "good.pt")
    good = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "truncated.pt").write_bytes(good[:len(good) // 2])
    torch.manual_seed(0)
    bias = rpc_rl.Policy().affine1.bias.detach().numpy().tobytes()
    damaged = bytearray(good)
    damaged[good.index(bias)] ^= 0xFF  # one byte of a tensor: still a valid zip, which torch.load reads
    (tmp_path / "damaged.pt").write_bytes(damaged)
    write_checkpoint_file(tmp_path / "multi_gpu.pt", script="multi_gpu")
    torch.save(rpc_rl.Policy().state_dict(), tmp_path / "bare_state_dict.pt")  # not through save_checkpoint
    wide = {**rpc_rl.Policy().state_dict(), "affine1.weight": torch.zeros(64, 4)}
    write_checkpoint_file(tmp_path / "wide.pt", policy=wide)
    common.save_checkpoint(tmp_path / "no_policy.pt", "rpc_rl", {"weights": wide})
    (tmp_path / "ckpt_text").mkdir()
    (tmp_path / "ckpt_text" / "rpc_rl.pt").write_text("garbage")
    write_checkpoint_file(tmp_path / "ckpt_lr" / "rpc_rl.pt")  # written with --lr 0.01
    common.save_checkpoint(tmp_path / "ckpt_policy_only" / "rpc_rl.pt", "rpc_rl", {"policy": wide})  # a --save file
    write_checkpoint_file(tmp_path / "ckpt_optimizer" / "rpc_rl.pt",
                          optimizer={"state": {}, "param_groups": [{"params": [0]}]})
    write_checkpoint_file(tmp_path / "ckpt_wide" / "rpc_rl.pt", policy=wide)
    (tmp_path / "ckpt_none").mkdir()  # no checkpoint yet
    return tmp_path


TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}
BAD_INVOCATIONS = [
    # numbers out of range, choices: argparse's own line
    ("--world-size 0", "argument --world-size: '0' is not a whole number, 1 or more"),
    ("--world-size two", "argument --world-size: 'two' is not a whole number"),
    ("--envs-per-observer 0", "argument --envs-per-observer: '0' is not a whole number, 1 or more"),
    ("--max-episodes -1", "argument --max-episodes: '-1' is not a whole number, 0 or more"),
    ("--gamma nan", "argument --gamma: 'nan' is not a positive number"),
    ("--gamma 0", "argument --gamma: '0' is not a positive number"),
    ("--lr -0.001", "argument --lr: '-0.001' is not a positive number"),
    ("--rpc-timeout 0", "argument --rpc-timeout: '0' is not a positive number"),
    ("--rpc-timeout 10m", "argument --rpc-timeout: '10m' is not a positive number"),
    ("--log-interval 0", "argument --log-interval: '0' is not a whole number, 1 or more"),
    ("--seed 12345678901234567890", "argument --seed: '12345678901234567890' is not a seed from 0 to 2**32 - 1"),
    ("--truncation never", "argument --truncation: invalid choice: 'never'"),
    # values or flags that do not fit together
    ("--world-size 1", "world size 1: need at least 2 processes"),
    ("--max-episodes 0", "nothing to do"),
    ("--gamma 1", "--gamma 1.0: pass a discount factor below 1, or 1 with --truncation terminal"),
    ("--gamma 1.5 --truncation terminal", "--gamma 1.5: pass a discount factor below 1"),
    ("--resume", "--resume needs --checkpoint-dir"),
    ("--checkpoint-dir {tmp}/good.pt/ck", "--checkpoint-dir {tmp}/good.pt/ck: cannot create this folder"),
    ("--save {tmp}/ckpt_none", "--save {tmp}/ckpt_none: is a folder; name a file"),
    ("--save {tmp}/good.pt/policy.pt", "--save {tmp}/good.pt: cannot create this folder"),
    # a resumed run continues the checkpoint's generator: another --seed would be dropped
    ("--resume --checkpoint-dir {tmp}/ckpt_lr --seed 7", "'seed': 7, 'gamma': 0.99, 'lr': 0.01, 'truncation': "
                                                       "'bootstrap'}}; pass the same flags"),
    # files that are not there, not this script's, or whose contents do not fit
    ("--load {tmp}/missing.pt", "--load {tmp}/missing.pt: no such file"),
    ("--load {tmp}/empty.pt", "--load {tmp}/empty.pt: not a readable checkpoint"),
    ("--load {tmp}/text.pt", "not a readable checkpoint"),
    ("--load {tmp}/truncated.pt", "not a readable checkpoint"),
    ("--load {tmp}/damaged.pt", "damaged ("),
    ("--load {tmp}/multi_gpu.pt", "not written by rpc_rl.py"),
    ("--load {tmp}/bare_state_dict.pt", "not written by rpc_rl.py"),
    ("--load {tmp}/no_policy.pt", "--load {tmp}/no_policy.pt: lacks policy"),
    ("--load {tmp}/wide.pt", "--load {tmp}/wide.pt: does not fit this model (Error(s) in loading state_dict for "
                             "Policy: size mismatch for affine1.weight"),
    ("--resume --checkpoint-dir {tmp}/ckpt_text", "--resume {tmp}/ckpt_text/rpc_rl.pt: not a readable checkpoint"),
    ("--resume --checkpoint-dir {tmp}/ckpt_lr --lr 0.02", "'lr': 0.01, 'truncation': 'bootstrap'}}, not {{"),
    ("--resume --checkpoint-dir {tmp}/ckpt_lr --world-size 3", "pass the same flags or another --checkpoint-dir"),
    ("--resume --checkpoint-dir {tmp}/ckpt_lr --truncation terminal", "pass the same flags"),
    ("--resume --checkpoint-dir {tmp}/ckpt_policy_only", "lacks recipe, optimizer, episode_rewards, running_reward, "
                                                         "rng"),
    ("--resume --checkpoint-dir {tmp}/ckpt_wide", "--resume {tmp}/ckpt_wide/rpc_rl.pt: does not fit this model"),
    ("--resume --checkpoint-dir {tmp}/ckpt_optimizer", "--resume {tmp}/ckpt_optimizer/rpc_rl.pt: does not fit this "
                                                       "model"),
    # launcher variables set by hand: checked before any file is read
    ("", "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set", {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}),
    ("", "MASTER_ADDR not set", {**TORCHRUN, "MASTER_ADDR": ""}),
    ("--load {tmp}/wide.pt", "RANK=2 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 "
                             "MASTER_PORT=29500: want ranks below their sizes", {**TORCHRUN, "RANK": "2"}),
    ("", "MASTER_PORT=http: want ranks below", {**TORCHRUN, "MASTER_PORT": "http"}),
    ("", "world size 1: need at least 2 processes", {**TORCHRUN, "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}),
]
BAD_INVOCATIONS = [row if len(row) == 3 else (*row, {}) for row in BAD_INVOCATIONS]


@pytest.mark.parametrize("argv, message, env", BAD_INVOCATIONS)
def test_bad_input_is_one_line_exit_2_before_any_work_and_nothing_is_written(argv, message, env, bad_files, capsys,
                                                                             monkeypatch):
    """main() in this process, as `python rpc_rl.py ARGV` runs it (common.run_main): no process is launched."""
    monkeypatch.setattr(torch.multiprocessing, "spawn", lambda *args, **kwargs: pytest.fail("processes started"))
    for name in common.TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    before = tree(bad_files)
    with pytest.raises(SystemExit) as exit_info:
        common.run_main(lambda: rpc_rl.main(argv.format(tmp=bad_files).split()))
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr, stderr
    assert message.format(tmp=bad_files) in stderr, stderr
    assert tree(bad_files) == before


def test_the_command_line_refuses_bad_input_in_one_line_before_starting_anything(tmp_path):
    """The same through `python rpc_rl.py` itself (its entry point): exit 2, one line, no process started."""
    proc = run_script("rpc_rl.py", "--load", tmp_path / "missing.pt", timeout=60)
    assert_usage_error(proc, f"rpc_rl.py: error: --load {tmp_path}/missing.pt: no such file")
    assert list(tmp_path.iterdir()) == [] and proc.stdout == ""


def test_a_resumable_checkpoint_passes_the_checks_and_is_read_once(bad_files, monkeypatch):
    """The other side of the table: the checkpoints made for it fail for the reason given, not for any reason; the
    one that fits is read once, in main, and handed to the agent."""
    launched, reads = [], []

    def spawn(run_worker, args, nprocs, join):
        launched.append((run_worker, nprocs, args[2], args[3], args[4]))
        return types.SimpleNamespace(join=lambda **_: True)  # mp.spawn(..., join=False)'s context, its processes done

    monkeypatch.setattr(torch.multiprocessing, "spawn", spawn)
    load = common.load_checkpoint
    monkeypatch.setattr(common, "load_checkpoint", lambda *args, **kwargs: reads.append(args) or load(*args, **kwargs))
    rpc_rl.main(["--resume", "--checkpoint-dir", str(bad_files / "ckpt_lr")])
    (_, world_size, args, agent_class, saved), = launched
    assert world_size == 2 and agent_class is rpc_rl.BatchAgent and args.truncation == "bootstrap"
    assert len(reads) == 1 and set(saved) >= set(rpc_rl.CHECKPOINT_KEYS)
    rpc_rl.main(["--world-size", "40", "--tutorial", "--load", str(bad_files / "good.pt")])
    assert launched[1][1] == 40 and launched[1][3] is rpc_rl.Agent and launched[1][2].truncation == "terminal"
    assert set(launched[1][4]) == {"policy"}
    # --load beside a --resume that finds no checkpoint yet: the run starts from the --load policy
    rpc_rl.main(["--resume", "--checkpoint-dir", str(bad_files / "ckpt_none"), "--load", str(bad_files / "good.pt")])
    good = torch.load(bad_files / "good.pt", weights_only=True)["policy"]
    assert set(launched[2][4]) == {"policy"} and all(torch.equal(launched[2][4]["policy"][name], tensor)
                                                      for name, tensor in good.items())


# --- Failures during the run ---

def test_a_checkpoint_that_cannot_be_written_ends_the_run_and_keeps_the_previous_one(tmp_path):
    """The disk fills up after the first checkpoint (a file-size limit on the agent's process, below a
    checkpoint's size and above the rendezvous file's): the agent's traceback ends in Python's error, exit status 1,
    every process ended, and the previous checkpoint intact, with no temporary file beside it."""
    checkpoint = tmp_path / "rpc_rl.pt"
    proc = start_rpc_rl("--max-episodes", 5000, "--log-interval", 1, "--checkpoint-dir", tmp_path,
                        "--checkpoint-interval", 1)
    try:
        wait_for_line(proc, "episode 1 |", timeout=100)
        deadline = time.monotonic() + 60
        while not checkpoint.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        workers = spawned_workers(proc)
        resource.prlimit(workers[0].pid, resource.RLIMIT_FSIZE, (8000, 8000))
        limited_at = time.monotonic()
        _, err = proc.communicate(timeout=60)
        # the next checkpoint fails one short early episode later, and the run ends as after a kill
        ended_after = time.monotonic() - limited_at
        assert ended_after < ENDS_WITHIN_S, ended_after
        assert proc.returncode == 1, err
        assert err.startswith("process 0 raised:\nTraceback") and err.count("Traceback") == 1, err
        assert err.strip().splitlines()[-1] == "OSError: [Errno 27] File too large", err
        assert_all_ended(workers, timeout=5)
    finally:
        kill_all(proc)
    saved = common.load_checkpoint(checkpoint, "rpc_rl", "--resume", keys=rpc_rl.CHECKPOINT_KEYS)
    assert len(saved["episode_rewards"]) >= 1
    assert [path.name for path in tmp_path.iterdir()] == ["rpc_rl.pt"]


def test_a_save_that_cannot_be_written_at_the_end_loses_neither_the_result_line_nor_the_checkpoint(tmp_path):
    """--save's folder replaced by a file while the run trains (the check before the run passed): the run still
    prints its evaluation and result line, then fails on --save with Python's error, exit status 1, and the final
    checkpoint is whole. Paths with a space and non-ASCII letters, as users type them."""
    out, checkpoints = tmp_path / "my policies é", tmp_path / "my checkpoints ü"
    proc = start_rpc_rl("--max-episodes", 30, "--log-interval", 1, "--seed", 3, "--eval-episodes", 2, "--save",
                        out / "policy.pt", "--checkpoint-dir", checkpoints)
    try:
        wait_for_line(proc, "episode 1 |", timeout=100)
        out.rmdir()  # made by the check before the run
        out.write_text("not a folder")
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        kill_all(proc)
    assert proc.returncode == 1, stderr
    assert "greedy evaluation: mean reward" in stdout and last_json(stdout)["episodes"] == 30, stdout[-2000:]
    assert stderr.startswith("process 0 raised:\nTraceback"), stderr
    assert stderr.splitlines()[-1] == f"FileExistsError: [Errno 17] File exists: '{out}'", stderr
    saved = common.load_checkpoint(checkpoints / "rpc_rl.pt", "rpc_rl", "--resume", keys=rpc_rl.CHECKPOINT_KEYS)
    assert len(saved["episode_rewards"]) == 30
