"""rpc_rl.py: one RPC per step, batched forwards, reproducibility, save/load, checkpoints and resume, torchrun
across two nodes, bad input, failures (a killed or stopped process, a killed launcher, a full disk)."""

import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

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
    free_port,
    kill_all,
    last_json,
    needs_gpus,
    spawned_workers,
    start_script,
    torchrun_command,
    tree,
    wait_for_line,
)


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
    assert err == "", err[-3000:]  # no warning the user can do nothing about
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


def test_same_seed_same_rewards_it_learns_and_the_saved_policy_evaluates_the_same_in_a_copy_of_the_script(tmp_path):
    saved = tmp_path / "policy.pt"
    trained = finish(start_rpc_rl("--max-episodes", 40, "--seed", 2, "--save", saved, "--eval-episodes", 3))
    rewards = [reward for (reward,) in trained["episode_rewards"]]
    assert rewards == BEFORE_ENVS_PER_OBSERVER["--max-episodes 40 --seed 2"]  # as every run with seed 2 before
    assert trained["running_reward"] == 39.287  # the tutorial's running reward, as before
    assert trained["eval_rewards"] == BEFORE_ENVS_PER_OBSERVER["--max-episodes 40 --seed 2, greedy evaluation"]
    assert sum(rewards[-10:]) > 1.5 * sum(rewards[:10]), rewards

    # evaluated by the script copied alone with common.py into an empty folder, as a user would take it
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("rpc_rl.py", "common.py"):
        shutil.copy(REPO / name, copy / name)
    proc = subprocess.run([sys.executable, "rpc_rl.py", *map(str, ("--load", saved, "--max-episodes", 0,
                                                                   "--eval-episodes", 3, "--seed", 2))],
                          cwd=copy, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    evaluated = last_json(proc.stdout)
    assert evaluated["episodes"] == 0 and evaluated["env_steps"] == 0
    assert len(trained["eval_rewards"]) == 3
    assert evaluated["eval_rewards"] == trained["eval_rewards"]
    policy = rpc_rl.Policy()
    policy.load_state_dict(torch.load(saved, weights_only=True)["policy"])
    # the distributed greedy evaluation equals a plain local one with the saved weights
    assert greedy_rewards(policy, 2, 3) == trained["eval_rewards"]
    torch.manual_seed(2)
    assert not torch.equal(rpc_rl.Policy().affine1.weight, policy.affine1.weight)  # the file holds trained weights


def test_killed_observer_ends_the_run_without_orphans_and_every_socket_is_on_loopback():
    proc = start_rpc_rl("--world-size", 3, "--max-episodes", 5000, "--log-interval", 1)
    try:
        wait_for_line(proc, "episode 1 |", timeout=100)  # training is under way
        processes = psutil.Process(proc.pid).children(recursive=True)
        workers = spawned_workers(proc)  # ranks 0, 1, 2: the youngest is an observer
        assert len(workers) == 3
        listening = [c.laddr.ip for w in workers for c in w.net_connections(kind="inet") if c.status == "LISTEN"]
        assert listening and all(ip in ("127.0.0.1", "::1") for ip in listening), listening  # TensorPipe's
        killed_at = time.monotonic()
        workers[-1].send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        assert time.monotonic() - killed_at < 60
        assert proc.returncode == 1, err[-3000:]
        # the launcher's line names it (the agent may have reported the lost connection first)
        assert "error: process 2 terminated with signal SIGKILL; the other processes were stopped" in err, err
        assert_all_ended(processes, timeout=5)
    finally:
        kill_all(proc)


def test_the_numpy_forward_the_agent_acts_with_equals_the_policy_it_learns_with():
    torch.manual_seed(0)
    policy = rpc_rl.Policy()
    states = torch.randn(5, 4)
    keep_mask = rpc_rl.dropout_keep_mask(np.random.default_rng(0).random((5, rpc_rl.Policy.hidden)))
    assert set(np.unique(keep_mask)) == {0.0, np.float32(1 / 0.4)}  # inverted dropout, as nn.Dropout(0.6)
    for mask in (None, keep_mask):
        expected = policy(states, None if mask is None else torch.from_numpy(mask))
        probs = rpc_rl.numpy_probs(rpc_rl.numpy_parameters(policy), states.numpy(), mask)
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


# --- Checkpoints and resume; torchrun on two nodes; a copied script ---

SEED_2 = BEFORE_ENVS_PER_OBSERVER["--max-episodes 40 --seed 2"]


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



# TensorPipe and gloo on loopback (torchrun's defaults otherwise: a restarted round meets in torchrun's shared
# store under keys of its own, see common.round_store)
TORCHRUN_ENV = {**os.environ, "TP_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}


def test_torchrun_restarts_a_killed_worker_and_the_resumed_run_equals_an_uninterrupted_one(tmp_path):
    """`torchrun --max-restarts 1 ... --checkpoint-dir DIR --resume`, an observer SIGKILLed after the first
    checkpoint: torchrun starts the processes again, the agent resumes from the last checkpoint, and the run ends
    with, episode for episode, the rewards, running reward and greedy evaluation of a run that never stopped."""
    checkpoint = tmp_path / "rpc_rl.pt"
    proc = subprocess.Popen(torchrun_command("--standalone", "--nproc-per-node", 2, "--max-restarts", 1, "rpc_rl.py",
                                             "--seed", 2, "--max-episodes", 40, "--eval-episodes", 3, "--log-interval",
                                             1, "--checkpoint-dir", tmp_path, "--checkpoint-interval", 5, "--resume"),
                            cwd=REPO, env=TORCHRUN_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_line(proc, "episode 5 |", timeout=100)
        deadline = time.monotonic() + 60
        while not checkpoint.exists() and time.monotonic() < deadline:
            time.sleep(0.02)  # written right after the log line
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
    assert result["resumed_after_episodes"] == int(resumed.group(1))
    assert [reward for (reward,) in result["episode_rewards"]] == SEED_2
    assert result["running_reward"] == 39.287 and result["updates"] == 40
    assert result["env_steps"] == sum(SEED_2) == result["step_rpcs"]
    assert result["eval_rewards"] == BEFORE_ENVS_PER_OBSERVER["--max-episodes 40 --seed 2, greedy evaluation"]
    assert common.load_checkpoint(checkpoint, "rpc_rl", "--resume")["updates"] == 40  # the last one, at the end



def test_two_torchrun_nodes_on_loopback_give_the_rewards_of_the_spawned_run():
    """`torchrun --nnodes 2`, one process per node (the agent on node 0, an observer on node 1), as two machines
    would run it: the episode rewards of the spawned run with the same seed (SEED_2, which the spawned runs above
    give). Both "nodes" share this machine's CPUs, so --no-pin-cpus (pinning binds local rank 0 to the first)."""
    port = free_port()
    nodes = [subprocess.Popen(torchrun_command("--nnodes", 2, "--node-rank", node, "--nproc-per-node", 1,
                                               "--master-addr", "127.0.0.1", "--master-port", port, "rpc_rl.py",
                                               "--max-episodes", 10, "--seed", 2, "--no-pin-cpus"),
                              cwd=REPO, env=TORCHRUN_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in (1, 0)]
    try:
        outputs = [node.communicate(timeout=120) for node in nodes]
    finally:
        kill_all(*nodes)
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-3000:]
    assert outputs[0][0] == ""  # node 1 holds an observer, which prints nothing
    result = last_json(outputs[1][0])
    assert result["observers"] == 1
    assert [reward for (reward,) in result["episode_rewards"]] == SEED_2[:10]


def test_the_help_and_the_docstring_name_only_what_a_copy_of_the_script_has(capsys):
    """A user takes rpc_rl.py and common.py (a copy runs: see the test of the saved policy above)."""
    with pytest.raises(SystemExit) as exit_info:
        rpc_rl.main(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "--checkpoint-dir" in help_text and rpc_rl.__doc__.splitlines()[0] in help_text
    for elsewhere in ("benchmarks", "README", "docs/", "tests/", "shared/", "bench_"):
        assert elsewhere not in help_text, elsewhere


# --- Bad input: one line, exit status 2, nothing run, nothing written ---

def write_checkpoint_file(path, script="rpc_rl", **changes):
    """A checkpoint as the agent writes it (a fresh policy and optimizer, no progress), with `changes`."""
    torch.manual_seed(0)
    policy = rpc_rl.Policy()
    state = {**dict.fromkeys(rpc_rl.CHECKPOINT_KEYS, 0), "recipe": rpc_rl.recipe(rpc_rl.Args(), 2),
             "policy": policy.state_dict(),
             "optimizer": torch.optim.Adam(policy.parameters(), lr=rpc_rl.Args.lr).state_dict(), **changes}
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
    write_checkpoint_file(tmp_path / "wide.pt", policy={**rpc_rl.Policy().state_dict(),
                                                        "affine1.weight": torch.zeros(64, 4)})
    (tmp_path / "unreadable.pt").write_bytes(good)
    (tmp_path / "unreadable.pt").chmod(0)
    (tmp_path / "ckpt_text").mkdir()
    (tmp_path / "ckpt_text" / "rpc_rl.pt").write_text("garbage")
    write_checkpoint_file(tmp_path / "ckpt_lr" / "rpc_rl.pt")  # written with --lr 0.01
    rpc_rl.save_policy(rpc_rl.Policy(), tmp_path / "ckpt_policy_only" / "rpc_rl.pt")  # a --save file
    (tmp_path / "ckpt_folder" / "rpc_rl.pt").mkdir(parents=True)
    write_checkpoint_file(tmp_path / "ckpt_optimizer" / "rpc_rl.pt",
                          optimizer={"state": {}, "param_groups": [{"params": [0]}]})
    yield tmp_path
    (tmp_path / "unreadable.pt").chmod(0o600)


ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
BAD_INVOCATIONS = [
    ("--world-size 1", "world size 1: need at least 2 processes"),
    ("--world-size 0", "world size 0"),
    ("--world-size two", "invalid int value: 'two'"),
    ("--envs-per-observer 0", "--envs-per-observer must be at least 1, not 0"),
    ("--envs-per-observer -2", "--envs-per-observer must be at least 1, not -2"),
    ("--max-episodes -1", "--max-episodes must be 0 or more"),
    ("--max-episodes 0", "nothing to do"),
    ("--eval-episodes -3", "--eval-episodes must be 0 or more"),
    ("--gamma nan", "'nan' is not a finite number"),
    ("--gamma inf", "'inf' is not a finite number"),
    ("--gamma 0", "--gamma must be in (0, 1], not 0.0"),
    ("--gamma 1", "use --truncation terminal"),
    ("--lr 0", "--lr must be positive"),
    ("--lr -0.001", "--lr must be positive, not -0.001"),
    ("--rpc-timeout 0", "--rpc-timeout must be positive"),
    ("--rpc-timeout=-inf", "'-inf' is not a finite number"),
    ("--log-interval 0", "--log-interval must be at least 1"),
    ("--checkpoint-interval 0", "--checkpoint-interval must be at least 1"),
    ("--seed -1", "--seed must be 0 or more"),
    ("--truncation never", "invalid choice: 'never'"),
    ("--load {tmp}/missing.pt", "--load {tmp}/missing.pt: no such file"),
    ("--load {tmp}/folder", "is a folder, not a file"),
    ("--load {tmp}/empty.pt", "not a readable checkpoint"),
    ("--load {tmp}/text.pt", "not a readable checkpoint"),
    ("--load {tmp}/truncated.pt", "not a readable checkpoint"),
    ("--load {tmp}/damaged.pt", "damaged (its contents do not match the checksum"),
    ("--load {tmp}/multi_gpu.pt", "a checkpoint of multi_gpu.py, not of rpc_rl.py"),
    ("--load {tmp}/bare_state_dict.pt", "not a checkpoint written by rpc_rl.py"),
    ("--load {tmp}/wide.pt", "its policy does not fit this script's (size mismatch for affine1.weight"),
    pytest.param("--load {tmp}/unreadable.pt", "cannot be read",
                 marks=pytest.mark.skipif(ROOT, reason="root reads files whatever their permissions")),
    ("--save {tmp}/folder", "--save {tmp}/folder: is a folder; pass a file name"),
    ("--save {tmp}/missing/policy.pt", "folder {tmp}/missing does not exist"),
    ("--plot {tmp}/good.pt/curve.png", "folder {tmp}/good.pt does not exist"),
    ("--checkpoint-dir {tmp}/good.pt", "is a file; pass a folder"),
    ("--resume", "--resume needs --checkpoint-dir"),
    ("--resume --checkpoint-dir {tmp}/ckpt_text", "--resume {tmp}/ckpt_text/rpc_rl.pt: not a readable checkpoint"),
    ("--resume --checkpoint-dir {tmp}/ckpt_lr --lr 0.02", "'lr': 0.01, 'truncation': 'bootstrap'}}, not {{"),
    ("--resume --checkpoint-dir {tmp}/ckpt_lr --world-size 3", "pass the same flags or another --checkpoint-dir"),
    ("--resume --checkpoint-dir {tmp}/ckpt_policy_only", "lacks recipe, optimizer"),
    ("--resume --checkpoint-dir {tmp}/ckpt_folder", "ckpt_folder/rpc_rl.pt is a folder"),
    ("--resume --checkpoint-dir {tmp}/ckpt_optimizer", "its optimizer state does not fit the policy"),
    pytest.param("--cuda", "--cuda: no CUDA GPU found",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
]



@pytest.mark.parametrize("argv, message", BAD_INVOCATIONS)
def test_bad_input_is_one_line_exit_2_before_any_work_and_nothing_is_written(argv, message, bad_files, capsys,
                                                                             monkeypatch):
    """main() in this process, as `python rpc_rl.py ARGV` runs it (common.run_main): no process is launched."""
    monkeypatch.setattr(rpc_rl, "launch", lambda *args, **kwargs: pytest.fail("the run was launched"))
    before = tree(bad_files)
    with pytest.raises(SystemExit) as exit_info:
        common.run_main(lambda: rpc_rl.main(argv.format(tmp=bad_files).split()))
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr, stderr
    assert message.format(tmp=bad_files) in stderr, stderr
    assert tree(bad_files) == before


def test_a_resumable_checkpoint_passes_the_checks(bad_files, monkeypatch):
    """The other side of the table: the checkpoints made for it fail for the reason given, not for any reason."""
    launched = []
    monkeypatch.setattr(rpc_rl, "launch", lambda *args, **kwargs: launched.append(args))
    rpc_rl.main(["--resume", "--checkpoint-dir", str(bad_files / "ckpt_lr"), "--load", str(bad_files / "good.pt")])
    assert len(launched) == 1


# --- Failures during the run ---

def test_a_stopped_observer_is_named_and_every_process_ends():
    """SIGSTOP of an observer: the launcher names it after --rpc-timeout / 2 s of silence (before any RPC times
    out and blames nobody in particular) and ends every process, the stopped one included."""
    proc = start_rpc_rl("--max-episodes", 5000, "--log-interval", 1, "--rpc-timeout", 8)
    try:
        wait_for_line(proc, "episode 1 |", timeout=100)
        workers = spawned_workers(proc)
        assert len(workers) == 2
        stopped_at = time.monotonic()
        workers[1].send_signal(signal.SIGSTOP)
        _, err = proc.communicate(timeout=60)
        assert 4 - common.HEARTBEAT_S <= time.monotonic() - stopped_at < 8 + 5  # silent since its last heartbeat
        assert proc.returncode == 1, err
        assert "Traceback" not in err, err
        assert re.fullmatch(rf"error: process 1 \(pid {workers[1].pid}\) sent no sign of life for \d+ s \(stopped\); "
                            r"the other processes were stopped", err.strip().splitlines()[-1]), err
        assert_all_ended(workers, timeout=5)
    finally:
        kill_all(proc)


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
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 1, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert f"cannot write {checkpoint}" in err and "free space" in err and "--checkpoint-dir" in err, err
        assert_all_ended(workers, timeout=5)
    finally:
        kill_all(proc)
    saved = common.load_checkpoint(checkpoint, "rpc_rl", "--resume", keys=rpc_rl.CHECKPOINT_KEYS)
    assert saved["updates"] >= 1 and [path.name for path in tmp_path.iterdir()] == ["rpc_rl.pt"]


def test_a_save_that_cannot_be_written_keeps_the_previous_file(tmp_path):
    """--save through the same atomic write (here in this process, under a file-size limit): RunFailed, which
    the run prints as its one line, and the previous policy file still loads."""
    path = tmp_path / "policy.pt"
    torch.manual_seed(0)
    previous = rpc_rl.Policy()
    rpc_rl.save_policy(previous, path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))
    try:
        with pytest.raises(common.RunFailed) as error:
            rpc_rl.save_policy(rpc_rl.Policy(), path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert f"cannot write {path}" in str(error.value) and "pass another --save" in str(error.value)
    assert "\n" not in str(error.value)
    kept = rpc_rl.read_policy(path, "--load")
    assert all(torch.equal(kept[name], value) for name, value in previous.state_dict().items())
    assert [item.name for item in tmp_path.iterdir()] == ["policy.pt"]
