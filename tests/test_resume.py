"""resume=true continues a run with its own saved config: the command line may change only a short
list of keys (recorded per part), any other change is refused in one line (exit 2), and the
record of how the run started (.hydra/overrides.yaml) is kept. Beside: Hydra's own configuration
errors are one line with exit code 2 too, and a single run that fails writes its summary."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from helpers.grail_process import SMALL
from helpers.run_dirs import grail_train
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from grail.core.errors import ConfigError
from grail.core.records import read_metrics, validate_metrics
from grail.train import cli
from grail.train.resume import Resume, plan_resume

CHOICES = {"env": "copy_digits", "model": "tiny", "generation": "builtin"}


def _compose(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=cli.CONF_DIR, version_base="1.3"):
        return compose(config_name="offline_grpo", overrides=list(overrides))


def _saved_run(run_dir: Path, *overrides: str) -> Path:
    """A run directory as grail-train leaves it after starting with `overrides`."""
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True)
    (hydra_dir / "config.yaml").write_text(OmegaConf.to_yaml(_compose(*overrides)))
    hydra = {"hydra": {"runtime": {"choices": CHOICES}}}
    (hydra_dir / "hydra.yaml").write_text(yaml.safe_dump(hydra))
    (hydra_dir / "overrides.yaml").write_text(yaml.safe_dump(list(overrides)))
    return run_dir


def _plan(run_dir: Path, *overrides: str, choices: dict[str, str] = CHOICES) -> Resume | None:
    return plan_resume(_compose(*overrides), run_dir, list(overrides), choices)


def test_a_resume_without_overrides_runs_with_the_saved_config(tmp_path: Path) -> None:
    run_dir = _saved_run(tmp_path, "train.iterations=3", "train.lr=0.01", "model.lora.enabled=true")
    resume = _plan(run_dir, "resume=true")
    assert resume is not None and resume.changes == {}
    config = resume.config
    assert (config.train.iterations, config.train.lr, config.model.lora.enabled) == (3, 0.01, True)
    assert config.resume is True
    # The same overrides as the start are no change either (a sweep's rerun).
    same = _plan(run_dir, "train.iterations=3", "train.lr=0.01", "model.lora.enabled=true")
    assert same is not None and same.changes == {}
    assert _plan(tmp_path / "fresh", "resume=true") is None  # a sweep's job not started yet


def test_resume_true_in_a_directory_without_a_run_is_refused_naming_it(tmp_path: Path) -> None:
    # In-process: a single run's resume needs a run; a sweep with runs below is named.
    sweep = tmp_path / "sweep"
    _saved_run(sweep / "0")
    with pytest.raises(ConfigError) as err:
        plan_resume(_compose("resume=true"), sweep, ["resume=true"], CHOICES, require_run=True)
    message = str(err.value)
    assert f"{sweep} holds no run to resume" in message and "\n" not in message
    assert f"hydra.run.dir={sweep}/0" in message  # the sweep's run it could have meant
    # Through grail-train: one line, exit 2, nothing started, and the directory stays runless.
    empty = tmp_path / "empty"
    result = grail_train(f"hydra.run.dir={empty}", "resume=true", timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-3000:]
    errors = [line for line in out.splitlines() if "holds no run to resume" in line]
    assert len(errors) == 1 and str(empty) in errors[0], out[-3000:]
    assert "Traceback" not in out
    assert not (empty / ".hydra").exists() and not (empty / "summary.json").exists()


def test_a_resume_refuses_every_change_that_alters_the_run_in_one_message(tmp_path: Path) -> None:
    run_dir = _saved_run(tmp_path, "train.iterations=3")
    with pytest.raises(ConfigError) as err:
        _plan(
            run_dir,
            "train.lr=0.5",
            "data.rollouts_per_problem=8",
            "model.lora.r=4",
            "model.lora.enabled=true",
            "env=sat",
            choices={**CHOICES, "env": "sat"},
        )
    message = str(err.value)
    for change in (
        "train.lr: 0.005 -> 0.5",
        "data.rollouts_per_problem: 16 -> 8",
        "model.lora.r: 16 -> 4",
        "model.lora.enabled: false -> true",
        "env: copy_digits -> sat",
    ):
        assert change in message, change
    assert "\n" not in message


def test_a_resume_applies_and_records_the_keys_it_may_change(tmp_path: Path) -> None:
    run_dir = _saved_run(tmp_path, "train.iterations=3")
    resume = _plan(run_dir, "train.iterations=5", "logging.tensorboard=true", "study_dir=/s")
    assert resume is not None
    assert resume.changes == {
        "train.iterations": (3, 5),
        "logging.tensorboard": (False, True),
        "study_dir": (None, "/s"),  # a sweep's run (null: the sweep's directory) resumed alone
    }
    assert (resume.config.train.iterations, resume.saved.train.iterations) == (5, 3)
    resume.record(run_dir)  # when it starts training: the next resume continues from it
    again = _plan(run_dir, "resume=true")
    assert again is not None and again.config.train.iterations == 5
    assert yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()) == [
        "train.iterations=3"
    ]
    with pytest.raises(ConfigError, match="study_dir: /s -> /t"):  # a study_dir once set stays
        _plan(run_dir, "study_dir=/t")


# --- end to end: a run stopped after 2 of its 3 iterations, resumed ---------------------------


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-iteration run as SIGKILL after its second checkpoint leaves it."""
    run_dir = tmp_path_factory.mktemp("stopped")
    result = grail_train(
        *SMALL, "train.iterations=3", "train.lr=0.01", f"hydra.run.dir={run_dir}", timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    shutil.rmtree(run_dir / "checkpoints" / "iter_002")
    for name in ("train_iter_002.json", "eval_iter_002.json"):
        (run_dir / "metrics" / name).unlink(missing_ok=True)
    (run_dir / "summary.json").unlink()
    parts = json.loads((run_dir / "parts.json").read_text())
    parts["parts"][0]["iterations"] = 2
    (run_dir / "parts.json").write_text(json.dumps(parts))
    return run_dir


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns(".grail.lock"))
    return copy


@pytest.mark.parametrize(
    ("override", "change"),
    [
        ("train.lr=0.5", "train.lr: 0.01 -> 0.5"),
        ("data.rollouts_per_problem=8", "data.rollouts_per_problem: 4 -> 8"),
        ("model.lora.r=4", "model.lora.r: 16 -> 4"),
        ("model.lora.enabled=true", "model.lora.enabled: false -> true"),
    ],
)
def test_a_changed_setting_on_resume_exits_2_naming_it(
    stopped_run: Path, tmp_path: Path, override: str, change: str
) -> None:
    run_dir = _copy(stopped_run, tmp_path)
    before = {p: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}
    result = grail_train(f"hydra.run.dir={run_dir}", "resume=true", override)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-3000:]
    assert change in out and "Traceback" not in out, out[-3000:]
    assert {p: p.read_bytes() for p in (run_dir / ".hydra").iterdir()} == before
    assert not (run_dir / "summary.json").exists()  # a refused resume is no failure of the run
    assert "started builtin server" not in out


def test_the_short_resume_command_continues_the_run_as_it_was_configured(
    stopped_run: Path, tmp_path: Path
) -> None:
    run_dir = _copy(stopped_run, tmp_path)
    overrides = (run_dir / ".hydra" / "overrides.yaml").read_text()
    result = grail_train(f"hydra.run.dir={run_dir}", "resume=true", timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "resuming after iteration 1" in out
    summary = read_metrics(run_dir / "summary.json")
    assert summary["iterations"] == 3 and summary["config"]["train"]["iterations"] == 3
    assert summary["config"]["train"]["lr"] == 0.01
    assert not (run_dir / "metrics" / "train_iter_003.json").exists()
    assert (run_dir / ".hydra" / "overrides.yaml").read_text() == overrides  # the start's record
    resumed = summary["parts"][1]
    assert resumed["first_iteration"] == 2 and resumed["iterations"] == 1
    assert resumed["overrides"] == ["resume=true"] and resumed["changed"] == {}

    # Raised iterations train further, and the part records from which iteration they applied.
    result = grail_train(f"hydra.run.dir={run_dir}", "resume=true", "train.iterations=4")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    summary = read_metrics(run_dir / "summary.json")
    validate_metrics(summary, "summary")
    assert summary["iterations"] == 4 and summary["config"]["train"]["iterations"] == 4
    last = summary["parts"][-1]
    assert last["first_iteration"] == 3 and last["iterations"] == 1
    assert last["changed"] == {"train.iterations": {"from": 3, "to": 4}}
    assert (
        yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())["train"]["iterations"] == 4
    )
    assert (run_dir / ".hydra" / "overrides.yaml").read_text() == overrides


# --- configuration errors: one line, exit code 2; a failed run's summary -----------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.lr=abc", "train.lr=abc (Value 'abc' of type 'str' could not be converted"),
        ("env=doesnotexist", "Could not find 'env/doesnotexist'; the options are: copy_digits"),
        ("model=nonexistent", "Could not find 'model/nonexistent'; the options are: "),
        ("data.env_kwargs.num_digit=2", "To append to your config use +data.env_kwargs.num_digit"),
    ],
)
def test_hydras_own_configuration_errors_are_one_line_with_exit_code_2(
    tmp_path: Path, override: str, message: str
) -> None:
    result = grail_train(override, f"hydra.run.dir={tmp_path}")
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert out.startswith("invalid configuration: ")
    assert message in out and len(out.strip().splitlines()) == 1, out


def test_a_single_run_that_fails_writes_its_summary_with_the_error(tmp_path: Path) -> None:
    result = grail_train(
        *SMALL,
        "train.iterations=2",
        "data.rewards=[tests.reward_plugins:raises]",
        f"hydra.run.dir={tmp_path}",
        timeout=300,
    )
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    summary = read_metrics(tmp_path / "summary.json")
    validate_metrics(summary, "summary")
    assert summary["status"] == "failed", summary
    assert "raises" in summary["error"]["message"]
    assert summary["config"]["data"]["rewards"] == ["tests.reward_plugins:raises"]
