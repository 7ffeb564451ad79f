"""rpc_rl.py: the tutorial's code and the batched agent built on it (one RPC per observer step, one forward per step,
the same update), reproducibility, save/load, checkpoints and exact resume, torchrun across two nodes, --help, bad
input, failures (a killed or stopped process, a killed launcher, a full disk)."""

import copy
import io
import multiprocessing
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
    assert_help_follows_the_rules,
    assert_help_shows_every_default,
    assert_usage_error,
    free_port,
    kill_all,
    last_json,
    run_script,
    spawned_workers,
    torchrun_command,
    tree,
    unprivileged,
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


# `python rpc_rl.py --max-episodes 40 --seed 3 --eval-episodes 3` on this machine's CPU (2026-11-23): every run with
# this seed gives these episode rewards, running reward and greedy evaluation (the torchrun tests compare with them).
SEED_3 = [20.0, 17.0, 18.0, 21.0, 33.0, 15.0, 12.0, 93.0, 19.0, 25.0, 71.0, 98.0, 35.0, 29.0, 60.0, 52.0, 52.0, 47.0,
          15.0, 42.0, 60.0, 67.0, 44.0, 36.0, 59.0, 64.0, 80.0, 43.0, 77.0, 28.0, 46.0, 126.0, 41.0, 40.0, 110.0, 112.0,
          146.0, 136.0, 141.0, 58.0]
SEED_3_RUNNING_REWARD = 62.068
SEED_3_EVAL = [500.0, 500.0, 439.0]


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


def test_the_agent_answers_every_observer_of_a_step_with_one_forward():
    """BatchAgent.select_action: requests wait until every observer still playing has asked, then one forward (act)
    answers them all, in observer order; an observer whose environments have all ended asks once more, without
    states, and the others no longer wait for it."""
    agent = object.__new__(rpc_rl.BatchAgent)
    torch.manual_seed(0)
    agent.policy = rpc_rl.Policy()
    agent.parameters = [parameter.detach().numpy() for parameter in agent.policy.parameters()]
    agent.rng, agent.lock, agent.waiting, agent.playing = np.random.default_rng(0), threading.Lock(), {}, {1, 2}
    agent.rewards = {(ob_id, index): [] for ob_id in (1, 2) for index in range(2)}
    agent.rows, agent.trajectory = {env: row for row, env in enumerate(agent.rewards)}, []
    forwards = []
    act = agent.act
    agent.act = lambda requests: forwards.append([ob_id for ob_id, _ in requests]) or act(requests)
    state = [0.01, 0.02, 0.03, 0.04]
    one = agent.select_action(2, {0: state, 1: state}, {})
    assert not one.done() and forwards == []  # observer 1 has not asked yet
    two = agent.select_action(1, {1: state}, {0: 1.0})
    assert one.done() and two.done() and forwards == [[1, 2]]
    assert len(one.value()) == 2 and len(two.value()) == 1 and set(one.value() + two.value()) <= {0, 1}
    assert agent.rewards[1, 0] == [1.0] and agent.trajectory[0][0].tolist() == [1, 2, 3]  # (1, 1), (2, 0), (2, 1)
    last = agent.select_action(1, {}, {1: 1.0})  # observer 1's episodes have ended
    assert not last.done()
    three = agent.select_action(2, {1: state}, {0: 1.0, 1: 1.0})
    assert last.value() == [] and len(three.value()) == 1 and forwards == [[1, 2], [1, 2]] and agent.playing == {2}
    four = agent.select_action(2, {1: state}, {1: 1.0})  # now observer 2 alone
    assert four.done() and forwards[-1] == [2] and agent.rewards[2, 1] == [1.0, 1.0]


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
    # the agent's greedy evaluation in numpy equals a plain one in torch with the saved weights
    assert greedy_rewards(policy, 3, 3) == trained["eval_rewards"]
    torch.manual_seed(3)
    assert not torch.equal(rpc_rl.Policy().affine1.weight, policy.affine1.weight)  # the file holds trained weights


def test_the_tutorials_code_runs_alone_and_learns(tmp_path):
    """--tutorial: the story's Agent and Observer, two RPCs per step, one forward with autograd per request."""
    env, counts = step_counter(tmp_path)
    result = finish(start_rpc_rl("--tutorial", "--max-episodes", 40, "--seed", 3, "--log-interval", 40, env=env))
    rewards = [reward for (reward,) in result["episode_rewards"]]
    assert result["episodes"] == 40 and "eval_rewards" not in result
    # the steps the observer's environment made (STEP_COUNTER), not the rewards env_steps is computed from: a reward
    # report_reward lost or recorded twice makes them differ
    assert counts() == {"observer1": [result["env_steps"]]}, (counts(), result["env_steps"])
    assert sum(rewards[-10:]) > 1.5 * sum(rewards[:10]), rewards


def tutorial_step(policy, state, seed):
    """Agent.select_action's forward and sample, with the dropout mask nn.Dropout drew (torch's CPU dropout draws
    bernoulli(1 - p) noise scaled by 1 / (1 - p): the same draw from the same seed gives the mask)."""
    torch.manual_seed(seed)
    probs = policy(torch.from_numpy(state)[None])
    torch.manual_seed(seed)
    mask = torch.empty(1, 128).bernoulli_(0.4) / 0.4
    action = torch.distributions.Categorical(probs).sample()
    return probs, mask[0].numpy(), int(action)


def test_the_batched_agent_samples_from_the_tutorials_policy_and_makes_the_tutorials_update():
    """What BatchAgent changes is where the numbers are computed, not the math: numpy_probs with a dropout mask is
    Policy.forward with that mask, and its update (log-probabilities computed again in one forward, with the masks
    the actions were sampled with) is the story's Agent.finish_episode from the saved log-probabilities."""
    torch.manual_seed(0)
    policy = rpc_rl.Policy()
    rng = np.random.default_rng(0)
    states = rng.normal(size=(30, 4)).astype(np.float32)
    steps = [tutorial_step(policy, state, seed) for seed, state in enumerate(states)]
    parameters = [parameter.detach().numpy() for parameter in policy.parameters()]
    for state, (probs, mask, _) in zip(states, steps):
        np.testing.assert_allclose(rpc_rl.numpy_probs(parameters, state[None], mask), probs.detach().numpy(),
                                   rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rpc_rl.numpy_probs(parameters, states), policy.eval()(torch.from_numpy(states))
                               .detach().numpy(), rtol=1e-5, atol=1e-6)
    policy.train()

    def agent(cls, rewards, **fields):
        made = object.__new__(cls)
        made.policy = copy.deepcopy(policy)
        made.optimizer = torch.optim.SGD(made.policy.parameters(), lr=1.0)  # the step is the gradient
        vars(made).update(eps=np.finfo(np.float32).eps.item(), running_reward=0, episode_rewards=[],
                          rewards=copy.deepcopy(rewards),
                          args=types.SimpleNamespace(gamma=0.99, truncation="terminal", envs_per_observer=2,
                                                     checkpoint_dir=None), **fields)
        return made

    # two episodes of 10 and 20 steps: of one observer each for the tutorial, of one observer's 2 environments here
    lengths, episodes = [10, 20], [[1.0] * 10, [1.0] * 20]
    tutorial = agent(rpc_rl.Agent, {1: episodes[0], 2: episodes[1]}, saved_log_probs={1: [], 2: []})
    for ob_id, (start, stop) in zip((1, 2), ((0, 10), (10, 30))):
        for seed in range(start, stop):  # Agent.select_action, with the dropout of step `seed` and its action
            torch.manual_seed(seed)
            probs = tutorial.policy(torch.from_numpy(states[seed])[None])
            action = torch.tensor([steps[seed][2]])
            tutorial.saved_log_probs[ob_id].append(torch.distributions.Categorical(probs).log_prob(action))
    # as BatchAgent.act records them, step by step: environment 1 alone after environment 0's 10 steps
    trajectory = [(np.array(rows), states[list(indices)], np.stack([steps[i][1] for i in indices]),
                   np.array([steps[i][2] for i in indices])) for rows, indices in
                  [([0, 1], (t, 10 + t)) for t in range(10)] + [([1], (10 + t,)) for t in range(10, 20)]]
    batched = agent(rpc_rl.BatchAgent, {(1, 0): episodes[0], (1, 1): episodes[1]}, trajectory=trajectory,
                    rows={(1, 0): 0, (1, 1): 1}, saved_log_probs={(1, 0): [], (1, 1): []},
                    truncated={(1, 0): False, (1, 1): False})
    assert tutorial.finish_episode() == batched.finish_episode() == min(lengths)
    for expected, parameter in zip(tutorial.policy.parameters(), batched.policy.parameters()):
        torch.testing.assert_close(parameter, expected, rtol=1e-5, atol=1e-6)
    assert not torch.equal(tutorial.policy.affine1.weight, policy.affine1.weight)  # one step was made
    # K = 2 environments: two rounds enter the running reward, as two episodes of the tutorial would
    assert batched.running_reward == pytest.approx(0.05 * 20 + 0.95 * 0.05 * 10)


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
    assert kept.keys() == before.keys() and kept["rng"] == before["rng"]
    for name, tensor in before["policy"].items():
        assert torch.equal(kept["policy"][name], tensor), name
    assert len(kept["episode_rewards"]) == CHECKPOINT_EVERY and all(len(rewards) == 2 and min(rewards) > 0
                                                                     for rewards in kept["episode_rewards"])
    assert [state["step"].item() for state in kept["optimizer"]["state"].values()] == [CHECKPOINT_EVERY] * 4
    torch.manual_seed(1)  # --seed's initial policy
    assert not torch.equal(rpc_rl.Policy().affine1.weight, kept["policy"]["affine1.weight"])
    assert [path.name for path in tmp_path.iterdir()] == ["rpc_rl.pt"]


def test_a_killed_launcher_leaves_nothing():
    """SIGKILL of `python rpc_rl.py --pin-cpus` itself (not a worker): its processes end within seconds. Until then,
    each ran on a CPU of its own, where this machine has one for each (a default run's are not pinned: see the
    torchrun restart test)."""
    proc = start_rpc_rl("--max-episodes", 5000, "--log-interval", 1, "--pin-cpus")
    try:
        wait_for_line(proc, "episode 1 |", timeout=100)
        processes = psutil.Process(proc.pid).children(recursive=True)
        workers = spawned_workers(proc)
        assert len(workers) == 2
        cpus = sorted(os.sched_getaffinity(0))
        pinned = [{cpus[0]}, {cpus[1]}] if len(cpus) >= 2 else [set(cpus)] * 2
        assert [set(worker.cpu_affinity()) for worker in workers] == pinned
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert_all_ended(processes, timeout=10)
    finally:
        kill_all(proc)
        proc.communicate()


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
        assert [set(worker.cpu_affinity()) for worker in workers] == [os.sched_getaffinity(0)] * 2  # not pinned
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


def test_the_help_follows_the_rules(capsys):
    assert_help_follows_the_rules(rpc_rl, capsys)
    assert_help_shows_every_default(rpc_rl, capsys)


def test_the_help_is_grouped_and_names_only_what_a_copy_of_the_script_has(capsys):
    """Grouped, a placeholder by kind, no "(default: None)", no measured figure; and nothing that a user who took
    rpc_rl.py and common.py alone does not have (a copy runs: see the saved policy's test above)."""
    with pytest.raises(SystemExit) as exit_info:
        rpc_rl.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for group in ("The tutorial's settings:", "Beyond the tutorial:", "Output and checkpoints:", "Devices and launch:"):
        assert f"\n{group}\n" in text, group
    assert "(default: None)" not in text and max(map(len, text.splitlines())) <= common.HELP_WIDTH
    placeholders = dict(re.findall(r"^  (--[a-z-]+) ([A-Z]+)\b", text, flags=re.M))
    assert placeholders["--save"] == placeholders["--load"] == "FILE"
    assert placeholders["--checkpoint-dir"] == "DIR" and placeholders["--rpc-timeout"] == "SECONDS"
    assert placeholders["--seed"] == "N"
    for elsewhere in ("benchmarks", "README", "docs/", "tests/", "shared/", "bench_", "see ", "multiple of K"):
        assert elsewhere not in text, elsewhere
    assert re.search(r"\d (s|ms|µs|seconds)\b|\d+ steps/s|\d\.\d+x", text) is None, "a measured figure in --help"


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
    (tmp_path / "folder").mkdir()
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
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "ckpt_text").mkdir()
    (tmp_path / "ckpt_text" / "rpc_rl.pt").write_text("garbage")
    write_checkpoint_file(tmp_path / "ckpt_lr" / "rpc_rl.pt")  # written with --lr 0.01
    write_checkpoint_file(tmp_path / "ckpt_30" / "rpc_rl.pt", episode_rewards=[[20.0]] * 30)
    common.save_checkpoint(tmp_path / "ckpt_policy_only" / "rpc_rl.pt", "rpc_rl", {"policy": wide})  # a --save file
    (tmp_path / "ckpt_folder" / "rpc_rl.pt").mkdir(parents=True)
    (tmp_path / "ckpt_fifo").mkdir()
    os.mkfifo(tmp_path / "ckpt_fifo" / "rpc_rl.pt")
    write_checkpoint_file(tmp_path / "ckpt_optimizer" / "rpc_rl.pt",
                          optimizer={"state": {}, "param_groups": [{"params": [0]}]})
    write_checkpoint_file(tmp_path / "ckpt_wide" / "rpc_rl.pt", policy=wide)
    (tmp_path / "ckpt_link").mkdir()
    (tmp_path / "ckpt_link" / "rpc_rl.pt").symlink_to(tmp_path / "gone.pt")  # a link to nothing
    (tmp_path / "ckpt_none").mkdir()  # no checkpoint yet
    return tmp_path


TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}
BAD_INVOCATIONS = [
    # numbers out of range: each flag's kind
    ("--world-size 1", "world size 1: need at least 2 processes"),
    ("--world-size 0", "--world-size 0: not a whole number, 1 or more"),
    ("--world-size two", "--world-size two: not a whole number"),
    ("--world-size 100000", "--world-size 100000: more than"),  # new: 4 processes per CPU at most
    ("--envs-per-observer 0", "--envs-per-observer 0: not a whole number, 1 or more"),
    ("--envs-per-observer -2", "--envs-per-observer -2: not a whole number, 1 or more"),
    ("--max-episodes -1", "--max-episodes -1: not a whole number, 0 or more"),
    ("--max-episodes 1e3", "--max-episodes 1e3: not a whole number"),  # new
    ("--max-episodes 0", "nothing to do"),
    ("--eval-episodes -3", "--eval-episodes -3: not a whole number, 0 or more"),
    ("--eval-episodes 99999999999999999999", "--eval-episodes 99999999999999999999: not a whole number"),  # new
    ("--gamma nan", "--gamma nan: not a positive number"),
    ("--gamma inf", "--gamma inf: not a positive number"),
    ("--gamma 0", "--gamma 0: not a positive number"),
    ("--gamma 1", "--gamma 1.0: pass a discount factor below 1, or 1 with --truncation terminal"),
    ("--gamma 1.5 --truncation terminal", "--gamma 1.5: pass a discount factor below 1"),  # new
    ("--lr 0", "--lr 0: not a positive number"),
    ("--lr -0.001", "--lr -0.001: not a positive number"),
    ("--rpc-timeout 0", "--rpc-timeout 0: not a number of seconds from 0.001"),
    ("--rpc-timeout 0.0009", "--rpc-timeout 0.0009: not a number of seconds from"),  # new: RPC would take it as none
    ("--rpc-timeout 3e6", "--rpc-timeout 3e6: not a number of seconds from"),  # new: 35 days, beyond 32-bit ms
    ("--rpc-timeout=-inf", "--rpc-timeout -inf: not a number of seconds from 0.001"),
    ("--rpc-timeout 10m", "--rpc-timeout 10m: not a number of seconds from 0.001"),  # new
    ("--log-interval 0", "--log-interval 0: not a whole number, 1 or more"),
    ("--checkpoint-interval 0", "--checkpoint-interval 0: not a whole number, 1 or more"),
    ("--seed -1", "--seed -1: not a seed from 0 to 2**32 - 1"),
    ("--seed 12345678901234567890", "--seed 12345678901234567890: not a seed from 0 to 2**32 - 1"),  # new
    ("--truncation never", "argument --truncation: invalid choice: 'never'"),
    # flags that do not fit together
    ("--tutorial --envs-per-observer 4", "--tutorial runs the tutorial's code alone: leave out --envs-per-observer, "
     "--truncation bootstrap, --eval-episodes, --save and --checkpoint-dir"),  # new
    ("--tutorial --truncation bootstrap", "--tutorial runs the tutorial's code alone: leave out"),  # new
    ("--tutorial --eval-episodes 2 --save {tmp}/p.pt", "--tutorial runs the tutorial's code alone: leave out"),  # new
    ("--tutorial --checkpoint-dir {tmp}/ck --resume", "--tutorial runs the tutorial's code alone: leave out"),  # new
    ("--resume", "--resume needs --checkpoint-dir"),
    # flags the run would drop without a word
    ("--resume --checkpoint-dir {tmp}/ckpt_lr --load {tmp}/good.pt", "--load {tmp}/good.pt: --resume continues the "
     "checkpoint in {tmp}/ckpt_lr instead; drop --load, or pass another --checkpoint-dir"),
    ("--checkpoint-interval 5", "--checkpoint-interval 5: used only with --checkpoint-dir; drop it"),
    ("--tutorial --checkpoint-interval 5", "--checkpoint-interval 5: used only with --checkpoint-dir; drop it"),
    ("--world-size 3", "--world-size 3: used only without torchrun (its WORLD_SIZE is the world size); drop it",
     TORCHRUN),
    # a resumed run continues the checkpoint's generator: another --seed would be dropped
    ("--resume --checkpoint-dir {tmp}/ckpt_lr --seed 7", "'seed': 7, 'gamma': 0.99, 'lr': 0.01, 'truncation': "
                                                       "'bootstrap'}}; pass the same flags"),
    # empty values: never "not given"
    ("--checkpoint-dir=", "--checkpoint-dir '': an empty value"),  # new
    ("--load=", "--load '': an empty value"),  # new
    ("--save=", "--save '': an empty value"),  # new
    # paths the file system refuses, outputs that are not regular files, formats this script does not write
    ("--load {tmp}/missing.pt", "--load {tmp}/missing.pt: no such file"),
    ("--load {tmp}/folder", "--load {tmp}/folder: not a regular file; pass a file"),
    ("--load /dev/null", "--load /dev/null: not a regular file"),  # new
    ("--load {tmp}/fifo", "--load {tmp}/fifo: not a regular file"),  # new
    ("--save {tmp}/folder", "--save {tmp}/folder: not a regular file; pass a file name"),
    ("--save /dev/null", "--save /dev/null: not a regular file"),  # new: the rename would replace the device
    ("--save {tmp}/fifo", "--save {tmp}/fifo: not a regular file"),  # new
    ("--save {tmp}/missing/policy.pt", "folder {tmp}/missing does not exist"),
    ("--save {tmp}/" + "p" * 300 + ".pt", "File name too long"),  # new
    ("--save {tmp}/good.pt/policy.pt", "--save {tmp}/good.pt/policy.pt: Not a directory; pass another path"),
    ("--checkpoint-dir {tmp}/good.pt", "{tmp}/good.pt is not a folder; pass a folder"),
    ("--checkpoint-dir /dev/null", "--checkpoint-dir /dev/null: /dev/null is not a folder"),  # new
    ("--checkpoint-dir {tmp}/" + "c" * 300, "File name too long"),  # new
    ("--checkpoint-dir {tmp}/ckpt_folder --resume", "--checkpoint-dir {tmp}/ckpt_folder/rpc_rl.pt: not a regular "
                                                    "file"),
    ("--checkpoint-dir {tmp}/ckpt_folder", "--checkpoint-dir {tmp}/ckpt_folder/rpc_rl.pt: not a regular file"),
    # two outputs on one file: the policy of --save would replace the last checkpoint, and --resume would refuse it
    ("--checkpoint-dir {tmp}/ckpt_lr --save {tmp}/ckpt_lr/rpc_rl.pt", "--save {tmp}/ckpt_lr/rpc_rl.pt: the checkpoint "
                                                                     "that --checkpoint-dir writes; pass another file"),
    ("--checkpoint-dir {tmp}/ckpt_lr --save {tmp}/folder/../ckpt_lr/rpc_rl.pt", "the checkpoint that --checkpoint-dir"),
    ("--checkpoint-dir {tmp}/ckpt_fifo --resume", "--checkpoint-dir {tmp}/ckpt_fifo/rpc_rl.pt: not a regular file"),
    ("--checkpoint-dir {tmp}/ckpt_link --resume", "--checkpoint-dir {tmp}/ckpt_link/rpc_rl.pt: a link to nothing; pass "
                                                 "a file name"),  # left as it is: tree() reads links, not targets
    # files that are not this script's, or whose contents do not fit
    ("--load {tmp}/empty.pt", "--load {tmp}/empty.pt: not a readable checkpoint"),
    ("--load {tmp}/text.pt", "not a readable checkpoint"),
    ("--load {tmp}/truncated.pt", "not a readable checkpoint"),
    ("--load {tmp}/damaged.pt", "damaged ("),
    ("--load {tmp}/multi_gpu.pt", "written by multi_gpu, not by rpc_rl.py"),
    ("--load {tmp}/bare_state_dict.pt", "written by another program, not by rpc_rl.py"),
    ("--load {tmp}/no_policy.pt", "--load {tmp}/no_policy.pt: lacks policy"),  # new
    ("--load {tmp}/wide.pt", "--load {tmp}/wide.pt: does not fit this model (size mismatch for affine1.weight"),
    ("--resume --checkpoint-dir {tmp}/ckpt_text", "--resume {tmp}/ckpt_text/rpc_rl.pt: not a readable checkpoint"),
    ("--resume --checkpoint-dir {tmp}/ckpt_lr --lr 0.02", "'lr': 0.01, 'truncation': 'bootstrap'}}, not {{"),
    ("--resume --checkpoint-dir {tmp}/ckpt_lr --world-size 3", "pass the same flags or another --checkpoint-dir"),
    ("--resume --checkpoint-dir {tmp}/ckpt_lr --truncation terminal", "pass the same flags"),  # new
    # a --max-episodes the run would not use: it would stop at once and report the checkpoint's 30
    ("--resume --checkpoint-dir {tmp}/ckpt_30 --max-episodes 20",
     "--resume {tmp}/ckpt_30/rpc_rl.pt: holds 30 episodes, more than --max-episodes 20; pass a larger one"),
    ("--resume --checkpoint-dir {tmp}/ckpt_policy_only", "lacks recipe, optimizer, episode_rewards, running_reward, "
                                                         "rng"),
    ("--resume --checkpoint-dir {tmp}/ckpt_wide", "--resume {tmp}/ckpt_wide/rpc_rl.pt: does not fit this model (size "
                                                   "mismatch for affine1.weight"),  # new
    ("--resume --checkpoint-dir {tmp}/ckpt_optimizer", "--resume {tmp}/ckpt_optimizer/rpc_rl.pt: does not fit this "
                                                       "model"),
    # launcher variables set by hand: checked before any file is read
    ("", "LOCAL_WORLD_SIZE, MASTER_PORT, MASTER_ADDR not set", {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}),
    ("", "MASTER_ADDR not set", {**TORCHRUN, "MASTER_ADDR": ""}),  # new
    ("--load {tmp}/wide.pt", "RANK=2 WORLD_SIZE=2 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2 MASTER_PORT=29500: want ranks below "
                             "their sizes", {**TORCHRUN, "RANK": "2"}),  # new
    ("", "MASTER_PORT=http: want ranks below", {**TORCHRUN, "MASTER_PORT": "http"}),  # new
    ("", "world size 1: need at least 2 processes", {**TORCHRUN, "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}),  # new
]
BAD_INVOCATIONS = [row if isinstance(row, tuple) and len(row) == 3 or not isinstance(row, tuple) else (*row, {})
                   for row in BAD_INVOCATIONS]


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
    proc = run_script("rpc_rl.py", "--save", tmp_path / "missing" / "policy.pt", timeout=60)
    assert_usage_error(proc, f"rpc_rl.py: error: --save {tmp_path}/missing/policy.pt: folder {tmp_path}/missing "
                             f"does not exist")
    assert list(tmp_path.iterdir()) == [] and proc.stdout == ""


def test_an_unreadable_load_file_is_one_line_exit_2_also_for_root(tmp_path):
    """A --load file of mode 000, read by a process held to the permission bits (conftest.unprivileged: as root, in
    a user namespace of its own): the one line of the bad-input table, before any process starts."""
    path = tmp_path / "unreadable.pt"
    write_checkpoint_file(path)
    path.chmod(0)
    before = tree(tmp_path)
    proc = subprocess.run(unprivileged([sys.executable, REPO / "rpc_rl.py", "--load", path]), cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert_usage_error(proc, f"rpc_rl.py: error: --load {path}: cannot be read (Permission denied); fix that or pass "
                             f"another path")
    assert proc.stdout == "" and tree(tmp_path) == before


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
    rpc_rl.main(["--world-size", "40", "--oversubscribe", "--tutorial", "--load", str(bad_files / "good.pt")])
    assert launched[1][1] == 40 and launched[1][3] is rpc_rl.Agent and launched[1][2].truncation == "terminal"
    assert set(launched[1][4]) == {"policy"}
    # --load beside a --resume that finds no checkpoint yet: the run starts from the --load policy
    rpc_rl.main(["--resume", "--checkpoint-dir", str(bad_files / "ckpt_none"), "--load", str(bad_files / "good.pt")])
    good = torch.load(bad_files / "good.pt", weights_only=True)["policy"]
    assert set(launched[2][4]) == {"policy"} and all(torch.equal(launched[2][4]["policy"][name], tensor)
                                                      for name, tensor in good.items())


# --- Failures during the run ---

def _pinned_cpus(local_rank, local_world_size, queue):
    rpc_rl.pin_to_one_cpu(local_rank, local_world_size)
    queue.put(sorted(os.sched_getaffinity(0)))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity (Linux)")
def test_pin_to_one_cpu_only_when_there_is_a_cpu_for_every_local_process():
    cpus = sorted(os.sched_getaffinity(0))
    context = multiprocessing.get_context("spawn")  # in children: pinning this test process would slow the rest

    def pinned(local_rank, local_world_size):
        queue = context.Queue()
        child = context.Process(target=_pinned_cpus, args=(local_rank, local_world_size, queue))
        child.start()
        result = queue.get(timeout=60)
        child.join(timeout=60)
        return result

    assert pinned(0, len(cpus)) == [cpus[0]]
    assert pinned(len(cpus) - 1, len(cpus)) == [cpus[-1]]
    assert pinned(0, len(cpus) + 1) == cpus  # too few CPUs: placement is left to the OS


def test_a_checkpoint_that_cannot_be_written_ends_the_run_in_one_line_and_keeps_the_previous_one(tmp_path):
    """The disk fills up after the first checkpoint (a file-size limit on the agent's process, below a
    checkpoint's size and above the rendezvous file's): one line that says what to do, exit status 1, every
    process ended, and the previous checkpoint intact."""
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
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert f"cannot write {checkpoint}" in err and "free space" in err and "--checkpoint-dir" in err, err
        assert_all_ended(workers, timeout=5)
    finally:
        kill_all(proc)
    saved = common.load_checkpoint(checkpoint, "rpc_rl", "--resume", keys=rpc_rl.CHECKPOINT_KEYS)
    assert len(saved["episode_rewards"]) >= 1
    assert [path.name for path in tmp_path.iterdir()] == ["rpc_rl.pt"]


def test_a_save_that_cannot_be_written_keeps_the_previous_file(tmp_path, capsys):
    """--save at the end of a run (BatchAgent.report, here in this process under a file-size limit): the run's one
    line (RunFailed) names --save, nothing is evaluated or reported after it, and the previous policy file still
    loads."""
    path = tmp_path / "policy.pt"
    torch.manual_seed(0)
    previous = rpc_rl.Policy().state_dict()
    common.save_checkpoint(path, "rpc_rl", {"policy": previous}, "--save")
    agent = object.__new__(rpc_rl.BatchAgent)
    vars(agent).update(policy=rpc_rl.Policy(), args=types.SimpleNamespace(save=str(path), eval_episodes=2, seed=0))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))
    try:
        with pytest.raises(common.RunFailed) as error:
            agent.report(False, 1.0, 0)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert f"cannot write {path}" in str(error.value) and "pass another --save" in str(error.value)
    assert "\n" not in str(error.value) and capsys.readouterr().out == ""
    kept = common.load_checkpoint(path, "rpc_rl", "--load", keys=("policy",))["policy"]
    assert all(torch.equal(kept[name], value) for name, value in previous.items())
    assert [item.name for item in tmp_path.iterdir()] == ["policy.pt"]
