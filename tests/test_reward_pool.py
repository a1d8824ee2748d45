"""A user's reward function in worker processes (``megarl.rewards.worker_pool``): a hang, ``sys.exit``, ``os._exit``, a
segfault or a NaN on some samples costs exactly those samples; workers are replaced, ignore stop signals, die with
their rank and take what they started with them (on a timeout and when the rank dies); the batch has a time budget;
load failures name their cause."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from megarl.config import ConfigError, load_config
from megarl.config.schema import RewardConfig
from megarl.rewards import RewardFailure, RewardLoadError, score_batch
from megarl.rewards import worker_pool as pool_module
from megarl.rewards.results import CANCELLED, ERROR, TIMEOUT
from megarl.rewards.scorer import InProcess, open_rewards, stop_if_broken
from megarl.rewards.worker_pool import RewardPool, RewardWorkerError, default_num_workers
from tests import misbehaving_rewards

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
FILE = os.path.join(HERE, "misbehaving_rewards.py")
PROMPTS = [f"copy {i % 10}:" for i in range(20)]
RESPONSES = [str(i % 3) * (1 + i % 4) for i in range(20)]
BAD = [i for i, p in enumerate(PROMPTS) if "7" in p]  # samples 7 and 17: one in each of two workers' chunks


def _score(rewards, n=20):
    return rewards.score(PROMPTS[:n], RESPONSES[:n], [None] * n, [{} for _ in range(n)])


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize(
    "fn, kind, cause",
    [
        ("hang", TIMEOUT, "timed out after 1 s (reward.timeout_s)"),
        ("exits", ERROR, "raised:\nTraceback (most recent call last):"),
        ("dies", ERROR, "killed its reward worker (exit status 1)"),
        ("segfault", ERROR, "killed its reward worker (killed by SIGSEGV)"),
        ("nan", ERROR, "returned nan; a reward must be a finite number"),
    ],
)
def test_only_the_offending_samples_fail(fn, kind, cause):
    with RewardPool(f"{FILE}:{fn}", num_workers=2, timeout_s=1) as pool:
        started = time.monotonic()
        result = _score(pool)
        seconds = time.monotonic() - started
        assert result.scores == [0.0 if i in BAD else 1.0 for i in range(20)]
        assert result.failed == [kind if i in BAD else "" for i in range(20)]
        assert result.errors == 2 and result.timeouts == (2 if kind == TIMEOUT else 0)
        assert result.first_error.startswith(f"the sample of prompt 'copy 7:' {cause}"), result.first_error
        assert pool.restarts == (0 if fn == "nan" else 4)  # each chunk's worker, then each offending sample's
        assert _score(pool) == result  # the replaced workers score the same
    if fn == "exits":
        assert result.first_error.endswith("SystemExit: 0") and "misbehaving_rewards.py" in result.first_error
        assert "megarl/rewards" not in result.first_error  # the user's frames only
    if fn == "hang":  # both chunks time out together, then their samples one by one, two at a time
        assert seconds < 6, seconds


def test_workers_give_what_the_trainer_s_process_gives():
    """A well-behaved function: the same ScoreResult in this process and in 1 or 3 workers (by file or module)."""
    expected = _score(InProcess("tests.misbehaving_rewards:graded"))
    assert expected.errors == 0 and sorted(expected.extra) == ["digit", "format"]
    for spec, workers in ((f"{FILE}:graded", 1), ("tests.misbehaving_rewards:graded", 3)):
        with RewardPool(spec, num_workers=workers, timeout_s=30) as pool:
            assert _score(pool) == expected
    assert score_batch(misbehaving_rewards.graded, PROMPTS, RESPONSES, [None] * 20, [{}] * 20) == expected


def test_workers_get_no_credentials_but_those_passed_and_a_memory_limit(monkeypatch):
    """Credential-looking variables (W&B's, HF's, cloud keys) never reach a worker unless ``reward.pass_env`` names
    them; ordinary ones do. ``reward.max_memory_gb``: a call that allocates past it fails alone (MemoryError), the
    others score."""
    from megarl.rewards.worker_pool import CREDENTIAL_NAME, WorkerLimits

    assert all(CREDENTIAL_NAME.search(k) for k in ("WANDB_API_KEY", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY",
                                                    "GITHUB_TOKEN", "DB_PASSWORD", "OPENAI_API_KEY", "SSH_KEY"))
    assert not any(CREDENTIAL_NAME.search(k) for k in ("PATH", "HOME", "PYTHONPATH", "OMP_NUM_THREADS", "KEYBOARD",
                                                        "TOKENIZERS_PARALLELISM", "MONKEY_PATCH"))
    monkeypatch.setenv("MEGARL_TEST_API_KEY", "secret")
    monkeypatch.setenv("MEGARL_TEST_PLAIN", "x")
    with RewardPool(f"{FILE}:reads_credentials", num_workers=1, timeout_s=30) as pool:
        assert set(_score(pool, 4).scores) == {0.5}
        assert "without " in pool.describe() and "MEGARL_TEST_API_KEY" in pool.describe()  # said at start-up
    limits = WorkerLimits(pass_env=("MEGARL_TEST_API_KEY",))
    with RewardPool(f"{FILE}:reads_credentials", num_workers=1, timeout_s=30, limits=limits) as pool:
        assert set(_score(pool, 4).scores) == {1.0}
    with RewardPool(f"{FILE}:allocates", num_workers=2, timeout_s=30, limits=WorkerLimits(max_memory_gb=1)) as pool:
        result = _score(pool)
        assert result.scores == [0.0 if i in BAD else 1.0 for i in range(20)]
        assert result.errors == 2 and "MemoryError" in result.first_error, result.first_error
    cfg = load_config(None, ["model.path=x", "reward.pass_env=[HF_TOKEN]", "reward.max_memory_gb=2",
                             "env.max_memory_gb=3"])  # fmt: skip
    assert WorkerLimits.of(cfg.reward) == WorkerLimits(("HF_TOKEN",), 2.0)
    assert WorkerLimits.of(cfg.env).max_memory_gb == 3.0


def test_groups_submitted_as_they_finish_are_scored_while_the_caller_goes_on(tmp_path, monkeypatch):
    """``submit`` (one prompt group of 4 samples at a time, as the engine finishes them) returns at once while the
    workers score (a call has started before ``finish`` is called); ``finish`` gives each group's result, and the
    groups merged equal the whole batch scored in one call, failures included."""
    from megarl.rewards.results import merge

    marker = tmp_path / "calls"
    monkeypatch.setenv("MEGARL_TEST_MARKER", str(marker))
    monkeypatch.setenv("MEGARL_TEST_SLOW_S", "0.5")
    expected = _score(InProcess("tests.misbehaving_rewards:graded"))
    with RewardPool(f"{FILE}:slow_graded", num_workers=2, timeout_s=30) as pool:
        pool.submit(PROMPTS[:4], RESPONSES[:4], [None] * 4, [{}] * 4)
        deadline = time.monotonic() + 20
        while not marker.exists() and time.monotonic() < deadline:  # the caller goes on; the worker has started
            time.sleep(0.01)
        assert marker.exists() and pool.run is not None and any(w.task for w in pool.workers)
        for g in range(1, 5):
            pool.submit(PROMPTS[4 * g : 4 * g + 4], RESPONSES[4 * g : 4 * g + 4], [None] * 4, [{}] * 4)
        parts = pool.finish()
        assert len(parts) == 5 and merge(parts) == expected and pool.run is None
        assert len(marker.read_text().splitlines()) == 5  # one call per group
    with RewardPool(f"{FILE}:nan", num_workers=2, timeout_s=30) as pool:  # samples 7 and 17 fail, alone
        for g in range(5):
            pool.submit(PROMPTS[4 * g : 4 * g + 4], RESPONSES[4 * g : 4 * g + 4], [None] * 4, [{}] * 4)
        merged = merge(pool.finish())
        assert merged.failed == [ERROR if i in BAD else "" for i in range(20)] and merged == _score(pool)
        pool.submit(PROMPTS[:4], RESPONSES[:4], [None] * 4, [{}] * 4)  # a round that failed before its finish
        assert _score(pool) == merged and pool.run is None  # never answers into the next batch


def test_a_reward_that_always_fails_stops_the_run_with_its_first_error():
    with RewardPool(f"{FILE}:always_raises", num_workers=2, timeout_s=5) as pool:
        result = _score(pool)
    assert result.errors == 20 and result.scores == [0.0] * 20
    cfg = RewardConfig(function="x.py:f")
    with pytest.raises(RewardFailure) as e:
        stop_if_broken(cfg, result.errors, 20, result.first_error, "in step 1")
    message = str(e.value)
    assert message.startswith("the reward function failed on 20 of 20 samples in step 1")
    assert "KeyError: \"no judge for 'copy 0:': the reward is broken\"" in message
    assert message.count("Traceback") == 1
    stop_if_broken(cfg, 19, 20, "x", "in step 1")  # below the default fraction (1.0): trains on
    with pytest.raises(RewardFailure, match="failed on 10 of 20"):
        stop_if_broken(RewardConfig(function="x.py:f", stop_on_error_fraction=0.5), 10, 20, "x", "in step 1")
    stop_if_broken(RewardConfig(function="x.py:f", stop_on_error_fraction=None), 20, 20, "x", "in step 1")


def test_a_timeout_kills_what_the_call_started(tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    monkeypatch.setenv("MEGARL_TEST_MARKER", str(marker))
    with RewardPool(f"{FILE}:hang_with_child", num_workers=1, timeout_s=1) as pool:
        result = _score(pool, n=8)
        assert result.failed == [TIMEOUT if i == 7 else "" for i in range(8)]
    children = [int(line.split()[-1]) for line in marker.read_text().splitlines()]
    assert len(children) == 2  # the chunk's call, then sample 7's own
    time.sleep(0.2)
    assert not [pid for pid in children if _alive(pid)]


def test_an_idle_worker_that_died_is_replaced():
    with RewardPool(f"{FILE}:graded", num_workers=2, timeout_s=30) as pool:
        first = _score(pool)
        os.kill(pool.workers[0].proc.pid, signal.SIGKILL)
        time.sleep(0.2)
        assert _score(pool) == first and pool.restarts == 1


def test_the_batch_ends_within_its_budget():
    """Every sample hangs: the chunk times out after 1 s, the samples one by one would take 10 s more; the budget
    (1.5 s) ends it while the first of them runs."""
    prompts = ["say 7:"] * 10
    with RewardPool(f"{FILE}:hang", num_workers=1, timeout_s=1, budget_s=1.5) as pool:
        started = time.monotonic()
        result = pool.score(prompts, ["r"] * 10, [None] * 10, [{}] * 10)
        assert time.monotonic() - started < 3
    assert result.failed == [TIMEOUT] * 10
    assert "was not scored within this rank's 1.5 s for the batch" in result.first_error


def test_a_stop_request_cancels_the_calls_in_flight_instead_of_waiting_for_them():
    """A call that would hang for an hour (reward.timeout_s=600): once ``should_stop`` holds, ``finish`` returns
    within a poll, its samples failed as cancelled (never trained on), the busy worker replaced by a fresh one."""
    prompts = ["say 7:"] * 4
    with RewardPool(f"{FILE}:hang", num_workers=1, timeout_s=600, budget_s=600) as pool:
        busy = pool.workers[0].proc.pid
        pool.submit(prompts, ["r"] * 4, [None] * 4, [{}] * 4)
        started = time.monotonic()
        pool.should_stop = lambda: time.monotonic() - started > 0.5
        (result,) = pool.finish()
        took = time.monotonic() - started
        assert took < 0.5 + 2 * pool_module.STOP_POLL_S + 1, took
        assert result.failed == [CANCELLED] * 4 and "the run is stopping" in result.first_error
        assert pool.workers[0].proc.pid != busy and not _alive(busy)
        pool.should_stop = None
        assert pool.score(["copy 1:"], ["1"], [None], [{}]).failed == [""]  # the fresh worker scores


def test_load_failures_name_their_cause(tmp_path, monkeypatch):
    with pytest.raises(RewardLoadError, match=r"has no attribute 'nope'.*'always_raises'"):
        RewardPool(f"{FILE}:nope", num_workers=2, timeout_s=5)
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\ndef f(p, r, g, e):\n    return [1.0]\n")
    with pytest.raises(RewardLoadError, match=r"(?s)exits.py.*SystemExit: 3"):
        RewardPool(f"{tmp_path / 'exits.py'}:f", num_workers=1, timeout_s=5)
    (tmp_path / "stuck.py").write_text("import time\ntime.sleep(600)\n")
    monkeypatch.setattr(pool_module, "START_TIMEOUT_S", 1.0)
    with pytest.raises(RewardWorkerError, match="did not load .*stuck.py:f' within 1 s"):
        RewardPool(f"{tmp_path / 'stuck.py'}:f", num_workers=1, timeout_s=5)


POOL_IN_A_CHILD = """
import sys, time
from megarl.rewards.worker_pool import RewardPool
pool = RewardPool(sys.argv[1], num_workers=2, timeout_s=5)
print(*[w.proc.pid for w in pool.workers], flush=True)
time.sleep(600)
"""


def test_workers_ignore_stop_signals_and_die_with_their_rank():
    rank = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(POOL_IN_A_CHILD), f"{FILE}:graded"], stdout=subprocess.PIPE, text=True,
        cwd=REPO,
    )  # fmt: skip
    try:
        workers = [int(pid) for pid in rank.stdout.readline().split()]
        assert len(workers) == 2
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):  # SLURM signals every process of the job
            for pid in workers:
                os.kill(pid, sig)
        time.sleep(0.3)
        assert all(_alive(pid) for pid in workers)
        rank.kill()
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in workers if _alive(pid)]
    finally:
        rank.kill()
        rank.wait()


SCORING_IN_A_CHILD = """
import sys
from megarl.rewards.worker_pool import RewardPool
pool = RewardPool(sys.argv[1], num_workers=1, timeout_s=600)
pool.score(["say 7:"], ["r"], [None], [{}])
"""


def test_what_a_reward_started_dies_with_its_rank(tmp_path):
    """The rank SIGKILLed while its reward runs a child process: the worker dies with the rank, and the watchdog
    of the worker's process group kills the child (no supervisor needed)."""
    marker = tmp_path / "marker"
    rank = subprocess.Popen(
        [sys.executable, "-c", SCORING_IN_A_CHILD, f"{FILE}:hang_with_child"], cwd=REPO,
        env={**os.environ, "MEGARL_TEST_MARKER": str(marker)},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        child = int(marker.read_text().split()[-1])
        assert _alive(child)
    finally:
        rank.kill()
        rank.wait()
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_a_pool_scores_only_on_the_thread_that_made_it():
    import threading

    errors = []

    def score_elsewhere(pool):
        try:
            _score(pool, n=2)
        except RuntimeError as e:
            errors.append(str(e))

    with RewardPool(f"{FILE}:graded", num_workers=1, timeout_s=30) as pool:
        thread = threading.Thread(target=score_elsewhere, args=(pool,))
        thread.start()
        thread.join()
        assert errors and "on the thread that created it" in errors[0]
        assert _score(pool, n=2).errors == 0


def test_closing_leaves_no_worker_and_builtins_stay_in_process():
    with open_rewards(RewardConfig(function=f"{FILE}:graded", num_workers=2)) as rewards:
        pids = [w.proc.pid for w in rewards.workers]
        assert all(_alive(pid) for pid in pids)
    assert not [pid for pid in pids if _alive(pid)]
    assert isinstance(open_rewards(RewardConfig(function="toy_digits", num_workers=4)), InProcess)
    assert isinstance(open_rewards(RewardConfig(function=f"{FILE}:graded", num_workers=0)), InProcess)
    assert 1 <= default_num_workers() <= pool_module.MAX_DEFAULT_WORKERS


@pytest.mark.parametrize(
    "override, message",
    [
        ("reward.num_workers=-1", "reward.num_workers: must be >= 0"),
        ("reward.timeout_s=0", "reward.timeout_s: must be > 0"),
        ("reward.timeout_s=inf", "reward.timeout_s: must be a finite number"),
        ("reward.stop_on_error_fraction=0", "reward.stop_on_error_fraction: must be in (0, 1] or null"),
        ("reward.stop_on_error_fraction=1.5", "reward.stop_on_error_fraction: must be in (0, 1] or null"),
    ],
)
def test_reward_fields_are_checked(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(os.path.join(REPO, "configs/quickstart.yaml"), [override])
    assert message in str(e.value)


def test_the_collective_timeout_must_outlast_a_reward_call_and_its_retries(tiny_llama_dir):
    from megarl.config import validate

    base = os.path.join(REPO, "configs/quickstart.yaml")
    user = [f"model.path={tiny_llama_dir}", "reward.timeout_s=590", f"reward.function={FILE}:nan"]
    with pytest.raises(ConfigError) as e:
        validate(load_config(base, user))
    assert "trainer.collective_timeout_s=600 must be >= 2 x reward.timeout_s + 60 = 1240" in str(e.value)
    validate(load_config(base, [*user, "trainer.collective_timeout_s=1240"]))
    validate(load_config(base, [*user, "reward.num_workers=0"]))  # in the trainer's process: no timeout
    assert load_config(base, ["reward.stop_on_error_fraction=null"]).reward.stop_on_error_fraction is None


def test_the_step_scoring_budget_is_explicit_and_bounded_by_the_collective_timeout(tiny_llama_dir):
    """reward.step_timeout_s: null is today's collective_timeout_s - 60; more than that, or less than one call's
    timeout, is refused in one line."""
    base = os.path.join(REPO, "configs/quickstart.yaml")
    assert load_config(base).reward.step_timeout_s == 540
    assert load_config(base, ["trainer.collective_timeout_s=900"]).reward.step_timeout_s == 840
    assert load_config(base, ["reward.timeout_s=30", "reward.step_timeout_s=60"]).reward.step_timeout_s == 60
    with pytest.raises(ConfigError, match=r"^reward.step_timeout_s: 700 must be <= trainer.collective_timeout_s - 60 "
                                          r"= 540 \(the other ranks"):  # fmt: skip
        load_config(base, ["reward.step_timeout_s=700"])
    with pytest.raises(ConfigError, match="reward.step_timeout_s: 10 is below reward.timeout_s=30"):
        load_config(base, ["reward.timeout_s=30", "reward.step_timeout_s=10"])
    user = [f"model.path={tiny_llama_dir}", "reward.timeout_s=590", f"reward.function={FILE}:nan"]
    validate_ok = load_config(base, [*user, "trainer.collective_timeout_s=1300", "reward.step_timeout_s=600"])
    assert validate_ok.reward.step_timeout_s == 600
