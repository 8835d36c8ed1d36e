"""`grail-train` as a user meets it: its help, the errors it gives for a bad command line or bad
input (one line naming the bad thing, before anything starts), and Ctrl-C.

Each test runs the real command in a subprocess; all but the Ctrl-C test end before any model
loads, within seconds.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import forked
from helpers.grail_process import servers_of
from helpers.run_dirs import grail_train
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from grail.core.errors import UserError
from grail.train import cli, launch

REPO = Path(__file__).resolve().parents[1]
# Small enough that a run reaches its first iteration fast (tests/test_train_loop.py's SMALL).
SMALL = [
    "data.problems_per_iteration=4",
    "data.rollouts_per_problem=4",
    "eval.enabled=false",
]


def _output(result: subprocess.CompletedProcess[str]) -> str:
    return result.stdout + result.stderr


def _log_file(run_dir: Path) -> Path:
    """The run's own log file, which Hydra names after the job (`cli.log` under `python -m`)."""
    logs = list(run_dir.glob("*.log"))
    assert len(logs) == 1, logs
    return logs[0]


def _nothing_started(run_dir: Path) -> bool:
    # The model's weights are written for the server before it starts; the server logs to logs/.
    return not (run_dir / "weights").exists() and not (run_dir / "logs").exists()


# --- 18: --help ------------------------------------------------------------------------------


def test_help_says_what_the_program_does_its_groups_and_first_commands() -> None:
    result = grail_train("--help")
    out = _output(result)
    assert result.returncode == 0, out
    assert "GRPO" in out and "powered by Hydra" not in out
    # the config groups with their options, from conf/ itself
    assert (
        "env: copy_digits, copy_turns, countdown, dataset, gsm8k, ifeval, lookup, math, openenv, "
        "sat, trl, verifiers" in out
    )
    assert "generation: builtin, sglang, vllm" in out
    assert "model: qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, tiny" in out
    # the three commands a user needs first
    assert "uv run grail-train\n" in out or "uv run grail-train " in out
    assert "uv run grail-train -m " in out
    assert "uv run grail-report " in out
    assert len(out.splitlines()) < 80, "help should fit a screen or two, not list every key"


# --- 9: keys outside the schema --------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "key", "hint"),
    [
        ("+train.lrr=1e-3", "train.lrr", "train.lr"),
        ("++train.lrr=1e-3", "train.lrr", "train.lr"),
        ("+seeed=1", "seeed", "seed"),
        ("+generation.temprature=0.5", "generation.temprature", "generation.temperature"),
    ],
)
def test_a_key_added_with_plus_is_rejected_naming_it_and_the_closest_key(
    tmp_path: Path, override: str, key: str, hint: str
) -> None:
    result = grail_train(*SMALL, override, f"hydra.run.dir={tmp_path}")
    out = _output(result)
    assert result.returncode == 2, out[-3000:]
    assert f"unknown config key {key}" in out, out[-3000:]
    assert f"did you mean {hint}?" in out, out[-3000:]
    assert "Traceback" not in out
    assert _nothing_started(tmp_path)


def test_a_mistyped_key_without_plus_names_the_key_it_resembles_at_once(tmp_path: Path) -> None:
    """Hydra's own answer to `train.lrr=1e-3` is to add the key with `+`, which is then refused:
    the first answer names the key meant, in one line."""
    result = grail_train(*SMALL, "train.lrr=1e-3", f"hydra.run.dir={tmp_path}")
    out = _output(result)
    assert result.returncode == 2, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("invalid configuration")]
    assert errors == [
        "invalid configuration: unknown config key train.lrr (did you mean train.lr?)"
    ]
    assert "+train.lrr" not in out and "Traceback" not in out


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            "generation.temprature=0.5",
            "generation.temprature (did you mean generation.temperature?)",
        ),
        ("modl=tiny", "modl (did you mean model?)"),
        ("train.lora.r=4", "train.lora.r (did you mean model.lora.r?)"),  # another section's
        ("temperature=0.5", "temperature (did you mean generation.temperature?)"),
        ("lrr=3", "lrr (the top level has: seed, reproducible, "),
    ],
)
def test_hydra_unknown_key_errors_name_the_closest_schema_key(override: str, line: str) -> None:
    with pytest.raises(HydraException) as err:
        _compose(override)
    assert cli.hydra_error_line(err.value).startswith(f"unknown config key {line}")


@pytest.mark.parametrize("override", ["data.env_kwargs.pth=1", "hydra.foo=1"])
def test_keys_outside_the_schemas_sections_keep_hydras_advice(override: str) -> None:
    """data.env_kwargs takes the environment's arguments with `+` (checked against them then);
    hydra.* is Hydra's own config."""
    with pytest.raises(HydraException) as err:
        _compose(override)
    assert cli.hydra_error_line(err.value).startswith(f"Could not override '{override[:-2]}'")


# --- 10: environment arguments ---------------------------------------------------------------


def test_documented_env_kwargs_spelling_works_and_a_wrong_key_lists_the_accepted_ones(
    tmp_path: Path,
) -> None:
    # README: `uv run grail-train env=gsm8k data.env_kwargs.path=...` (no `+`). A missing file
    # proves the key reached the environment (it tried to read it).
    missing = tmp_path / "no_such_gsm8k.jsonl"
    result = grail_train(
        *SMALL, "env=gsm8k", f"data.env_kwargs.path={missing}", f"hydra.run.dir={tmp_path}"
    )
    out = _output(result)
    assert "not in struct" not in out, out[-3000:]
    assert str(missing) in out and result.returncode != 0, out[-3000:]

    result = grail_train(*SMALL, "env=gsm8k", "+data.env_kwargs.pth=x", f"hydra.run.dir={tmp_path}")
    out = _output(result)
    assert result.returncode == 2, out[-3000:]
    assert "environment 'gsm8k' has no argument 'pth'" in out, out[-3000:]
    assert "did you mean 'path'?" in out
    assert "path, split, test_path, holdout_fraction" in out  # the accepted ones, in order
    assert _nothing_started(tmp_path)


# --- 11: reward plugins ------------------------------------------------------------------------


def test_a_plugin_named_like_an_env_component_fails_before_anything_starts(tmp_path: Path) -> None:
    # The default environment (copy_digits) scores `correct`, `found` and `brevity`.
    result = grail_train(
        *SMALL, "data.rewards=[tests.cli_plugins:brevity]", f"hydra.run.dir={tmp_path}"
    )
    out = _output(result)
    assert result.returncode == 2, out[-3000:]  # a name the config gave: a configuration error
    assert "'brevity' is already a component of environment 'copy_digits'" in out, out[-3000:]
    assert "name:" in out  # says how to rename it
    assert _nothing_started(tmp_path)
    # Named otherwise, the same plugin is accepted (checked without training: --cfg job).
    renamed = "data.rewards=[{fn: tests.cli_plugins:brevity, name: short}]"
    assert grail_train(renamed, "--cfg", "job").returncode == 0


# --- 14: known errors in one line, unknown ones with their traceback, Ctrl-C -----------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["data.rewards=[no_such_pkg_xyz.rewards:f]"],
            "module 'no_such_pkg_xyz.rewards' not found",
        ),
        (
            ["env=gsm8k", "data.env_kwargs.path=/nonexistent/gsm8k.jsonl"],
            "data file not found: /nonexistent/gsm8k.jsonl",
        ),
        (["model.train_id=/nonexistent/model"], "model.train_id: model path '/nonexistent/model'"),
        (["data.rollouts_per_problem=1"], "data.rollouts_per_problem must be >= 2"),
        (["env=sat", "data.env_kwargs.difficulty=2"], "difficulty must be a number in [0, 1]"),
    ],
    ids=["bad-plugin", "missing-data-file", "bad-model-path", "invalid-config", "bad-env-value"],
)
def test_known_user_errors_print_one_line_and_log_the_traceback(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    result = grail_train(*SMALL, *overrides, f"hydra.run.dir={tmp_path}")
    out = _output(result)
    assert result.returncode in (1, 2), out[-3000:]
    assert message in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if "ERROR" in line or message in line]
    assert len(errors) == 1, out[-3000:]
    assert len(out.splitlines()) <= 4, out[-3000:]
    log = _log_file(tmp_path).read_text()
    assert message in log and "Traceback" in log  # the details stay in the run's log file


def test_ctrl_c_says_in_one_line_how_to_resume(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [*SMALL, "train.iterations=50", "train.lr=2e-3", f"hydra.run.dir={run_dir}"]
    proc = forked.popen(
        [sys.executable, "-m", "grail.train.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        deadline = time.monotonic() + 240
        while not any((run_dir / "metrics").glob("train_iter_*.json")):
            assert proc.poll() is None and time.monotonic() < deadline, "no iteration finished"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, out[-3000:]
    # The metrics file is written just before the iteration's line: Ctrl-C may come between.
    tail = out[max(out.rfind("iter 000"), 0) :]
    assert "Traceback" not in tail, tail
    lines = [line for line in tail.splitlines() if "resume=true" in line]
    assert len(lines) == 1, tail
    command = lines[0][lines[0].index("uv run grail-train") :]
    # A resume takes the run's saved config (train.lr=2e-3 included): no override is needed.
    assert command == shlex.join(
        ["uv", "run", "grail-train", "resume=true", f"hydra.run.dir={run_dir}"]
    )
    assert "KeyboardInterrupt" in _log_file(run_dir).read_text()
    # The command it prints composes (checked without training).
    argv = shlex.split(command)[3:]
    again = grail_train(*argv, "--cfg", "job")
    assert again.returncode == 0 and "resume: true" in again.stdout, _output(again)


# --- a run that never hangs --------------------------------------------------------------------


def _stuck_run(
    run_dir: Path, reward: str, start: Callable[..., subprocess.Popen[str]] = subprocess.Popen
) -> subprocess.Popen[str]:
    """grail-train with the reward plugin `reward` (from tests/cli_plugins.py, one that never
    returns), once it is stuck in it: generation done, scoring never ends. A new interpreter
    unless `start` says otherwise: how a run ends with a thread still stuck depends on the
    interpreter's own exit (the threads it waits for), which a grail-train forked from the
    test runner (helpers/forked.py) skips."""
    marker = run_dir.parent / "stuck"
    proc = start(
        [
            sys.executable,
            "-m",
            "grail.train.cli",
            *SMALL,
            f"data.rewards=[{reward}]",
            f"hydra.run.dir={run_dir}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "GRAIL_TEST_STUCK_MARKER": str(marker)},
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    deadline = time.monotonic() + 240
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run never reached the plugin:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.1)
    return proc


def _ends_within(proc: subprocess.Popen[str], seconds: float) -> str:
    try:
        out, _ = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"grail-train still running {seconds} s later:\n{out[-3000:]}")
    return out


def test_a_plugin_that_never_returns_fails_the_run_at_its_deadline_naming_it(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    # Forked: the deadline ends this run; how the interpreter itself ends is the next test's.
    reward = "{fn: tests.cli_plugins:never_returns, timeout_s: 2}"
    proc = _stuck_run(run_dir, reward, forked.popen)
    out = _ends_within(proc, 2 + 15)  # the deadline, then stopping the server
    assert proc.returncode == 1, out[-3000:]
    errors = [line for line in out.splitlines() if "ERROR" in line]
    assert len(errors) == 1, out[-3000:]
    assert (
        "reward 'tests.cli_plugins:never_returns': did not return within timeout_s=2 s" in errors[0]
    )
    assert "Traceback" not in out, out[-3000:]
    assert servers_of(run_dir) == []


@pytest.mark.parametrize(
    ("sig", "reward", "code", "message"),
    [
        (signal.SIGINT, "tests.cli_plugins:never_returns", 130, "interrupted"),
        # A thread the interpreter waits for at exit (a pool's worker): the process ends anyway.
        (signal.SIGTERM, "tests.cli_plugins:never_returns_in_a_pool", 143, "stopped by SIGTERM"),
    ],
    ids=["sigint", "sigterm"],
)
def test_sigint_and_sigterm_end_a_run_stuck_in_a_plugin_within_seconds(
    tmp_path: Path, sig: signal.Signals, reward: str, code: int, message: str
) -> None:
    run_dir = tmp_path / "run"
    proc = _stuck_run(run_dir, reward)
    t0 = time.monotonic()
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # Ctrl-C in a terminal: the whole foreground group
    else:
        proc.send_signal(sig)  # `timeout`, `kill`: grail-train alone, which stops its server
    out = _ends_within(proc, 30)
    assert time.monotonic() - t0 < cli.EXIT_GRACE_S + 7, out[-3000:]
    assert proc.returncode == code, out[-3000:]
    hint = [line for line in out.splitlines() if "resume=true" in line]
    assert len(hint) == 1 and message in hint[0], out[-3000:]
    assert f"hydra.run.dir={run_dir}" in hint[0]
    assert "Traceback" not in out, out[-3000:]
    assert servers_of(run_dir) == []
    # A plugin stuck in grail's daemon thread lets the process end by itself; one stuck in a
    # thread the interpreter waits for is left behind after EXIT_GRACE_S, named.
    forced = "ending it without waiting for threads still running" in out
    assert forced == (reward.endswith("in_a_pool")), out[-3000:]


def _compose(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=cli.CONF_DIR, version_base="1.3"):
        return compose(config_name="offline_grpo", overrides=list(overrides))


# What _single_run reads of Hydra's runtime config.
HYDRA = OmegaConf.create(
    {"overrides": {"task": []}, "runtime": {"choices": {"env": "copy_digits"}}}
)


def test_an_unknown_error_keeps_its_traceback_and_a_known_one_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def crash(config: object, run_dir: Path, resume: object, plan: object = None) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(launch, "train", crash)
    with pytest.raises(RuntimeError, match="a bug"):  # not caught: Python prints its traceback
        cli._single_run(_compose(), tmp_path, HYDRA, None)

    class DirectoryInUse(UserError):
        pass

    def refuse(config: object, run_dir: Path, resume: object, plan: object = None) -> None:
        raise DirectoryInUse(f"{run_dir} is in use by pid 123")

    monkeypatch.setattr(launch, "train", refuse)
    with pytest.raises(SystemExit) as info:
        cli._single_run(_compose(), tmp_path, HYDRA, None)
    assert info.value.code == 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == [f"{tmp_path} is in use by pid 123"]
    assert errors[0].exc_info is None  # the traceback goes to the log file only


def test_resume_command_names_the_run_directory_quoted() -> None:
    command = cli.resume_command(Path("/r/x y"))
    assert command == "uv run grail-train resume=true 'hydra.run.dir=/r/x y'"


@pytest.mark.parametrize(("given", "expected"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_the_trainer_asks_for_sleeping_openmp_threads_before_torch_loads(
    given: str | None, expected: str
) -> None:
    # libgomp reads OMP_WAIT_POLICY once, when torch loads it: the entrypoint must set it first.
    # A user's own setting wins.
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    probe = "import os, sys, grail.train.cli\n"
    probe += "print('torch' in sys.modules, os.environ['OMP_WAIT_POLICY'])"
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.split() == ["False", expected], out.stderr[-2000:]
