"""Servers the user runs (`generation.urls`, grail/inference/external.py): a run against a
`grail-serve` started by hand gives the managed run's metrics and leaves the server running; each
start-up check fails in one line naming the URL; a fleet of such servers survives one dying."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.builtin_server import ServerProcess, side_by_side
from helpers.openai_stub import StubBehaviour, stub_server
from helpers.run_dirs import grail_train
from helpers.short_runs import SHORT_RUN, results, short_config, train_records
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from grail.core.config import Config
from grail.core.errors import ConfigError
from grail.core.validate import validate
from grail.inference.errors import ExternalServerError, ExternalServerGone
from grail.inference.external import external_server
from grail.rollouts.fleet import Fleet
from grail.train.cli import CONF_DIR
from grail.train.loop import run


@pytest.fixture(scope="module")
def by_hand(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """Two grail-serve processes started as a user would (`grail-serve --model tiny`)."""
    logs = tmp_path_factory.mktemp("by-hand")
    with side_by_side(logs, a=("tiny", ()), b=("tiny", ())) as servers:
        yield servers


@pytest.fixture
def managed(one_server_run: Path) -> list[dict[str, Any]]:
    """The same run with the server grail starts."""
    return results(one_server_run)


def test_a_run_against_a_grail_serve_started_by_hand_gives_the_managed_metrics(
    by_hand: dict[str, ServerProcess], managed: list[dict[str, Any]], tmp_path: Path
) -> None:
    # The command of docs/fleet.md. The server loads the run's initial weights before the first
    # batch and every sync's after it, so every iteration (and evaluation) is the managed run's,
    # bitwise; grail leaves the server running.
    server = by_hand["a"]
    done = grail_train(
        f"hydra.run.dir={tmp_path}", *SHORT_RUN, f"generation.urls=[{server.url}/v1]"
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert results(tmp_path) == managed
    assert all(r["weight_sync"]["transfer"] == "disk" for r in train_records(tmp_path))
    assert server.proc.poll() is None
    card = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
    assert card["weight_version"] == "iter_002"  # the last sync's weights
    assert not (tmp_path / "logs").exists()  # no server of grail's own


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


STUBS: dict[str, tuple[StubBehaviour, str]] = {
    "not an OpenAI server": (
        StubBehaviour(models_status=404),
        r"is not an OpenAI-compatible server: GET /v1/models answered HTTP 404",
    ),
    "wrong model": (
        StubBehaviour(models=["other"]),
        r"does not serve the model 'policy' \(generation.url_model\); it lists 'other'",
    ),
    "several models, none named": (
        StubBehaviour(models=["a", "b"]),
        r"lists 2 models \('a', 'b'\): name the one to request with generation.url_model",
    ),
    "no logprobs": (
        StubBehaviour(logprobs=False),
        r"gives completions grail cannot train on \(.*logprobs.*\)",
    ),
    "cannot read the weights path": (
        # What grail-serve answers for a path it does not see (no disk shared with the trainer).
        StubBehaviour(update_status=400, update_message="model_path /x is not a directory"),
        r"could not load the run's weights from .*weights \(.*is not a directory\); it must "
        r"read that directory",
    ),
    "no weight-reload route": (
        StubBehaviour(update_status=404),
        r"could not load the run's weights from .*HTTP 404",
    ),
}


@pytest.mark.parametrize("case", sorted(STUBS))
def test_each_start_up_check_fails_in_one_line_naming_the_url(case: str, tmp_path: Path) -> None:
    behaviour, message = STUBS[case]
    weights = tmp_path / "weights"
    weights.mkdir()
    model = None if case.startswith("several") else "policy"
    with stub_server(behaviour) as url:
        server = external_server("builtin", url, weights, model=model, log_dir=tmp_path)
        with pytest.raises(ExternalServerError) as failed:
            server.launch()
        server.stop()
    text = str(failed.value)
    assert text.startswith(f"generation.urls: the builtin server at {url} ")
    assert "\n" not in text
    assert failed.match(message)


def test_an_unreachable_url_fails_in_one_line(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{_free_port()}/v1"
    server = external_server("builtin", url, tmp_path, model=None, log_dir=tmp_path)
    with pytest.raises(ExternalServerError, match=rf"^generation.urls: .* at {url} refuses conn"):
        server.launch()


def test_a_server_that_stops_answering_is_never_restarted(tmp_path: Path) -> None:
    # recover() asks the server again: answering, it loads the newest weights; gone, it raises
    # what the run reports (one line) or a fleet keeps aside, and grail starts nothing.
    behaviour = StubBehaviour()
    with stub_server(behaviour) as url:
        server = external_server("builtin", url, tmp_path, model=None, log_dir=tmp_path)
        server.launch()
        assert server.model_name == "policy" and server.is_alive()
        server.recover()
        assert behaviour.loaded == [str(tmp_path.absolute())] * 2 and server.recoveries == 1
    assert not server.is_alive()
    with pytest.raises(ExternalServerGone, match=r"refuses connections .*cannot restart it"):
        server.check_alive()
    with pytest.raises(ExternalServerGone, match="cannot restart a server it did not start"):
        server.recover()
    with pytest.raises(ExternalServerGone, match=r"refuses connections .* when given new weights"):
        server.sync_weights(tmp_path)
    server.stop()
    assert server.pid is None


def test_grail_train_reports_a_server_that_cannot_take_the_weights_in_one_line(
    tmp_path: Path,
) -> None:
    behaviour = StubBehaviour(update_status=400, update_message="model_path /x is not a directory")
    with stub_server(behaviour) as url:
        done = grail_train(f"hydra.run.dir={tmp_path}", *SHORT_RUN, f"generation.urls=[{url}]")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert "Traceback" not in out
    errors = [line for line in out.splitlines() if "[ERROR]" in line]
    assert len(errors) == 1 and "could not load the run's weights from" in errors[0], out[-3000:]
    assert behaviour.loaded == [str((tmp_path / "weights").absolute())]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["generation.urls=[localhost:8000]"], r"generation.urls: 'localhost:8000' is not an http"),
        (["generation.urls=[http://h:1/v2]"], r"has the path '/v2'"),
        (["generation.urls=[http://h:1,http://H:1/v1/]"], r"names the server http://h:1 twice"),
        (["generation.urls=[http://h:1]", "generation.servers=2"], r"generation.servers=2"),
        (["generation.urls=[http://h:1]", "generation.weight_sync=restart"], "cannot restart"),
        (["generation.urls=[http://h:1]", "generation.weight_transfer=shared"], "from disk"),
    ],
)
def test_urls_are_checked_before_anything_loads(overrides: list[str], message: str) -> None:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="offline_grpo", overrides=overrides)
    typed: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=message):
        validate(typed)


def test_two_servers_one_killed_mid_run_the_run_completes_without_it(
    by_hand: dict[str, ServerProcess],
    managed: list[dict[str, Any]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Server b is killed after the first sync: iteration 1's requests to it fail and go to a,
    # it is set aside with a warning, and at the next sync (it still does not answer) it stays
    # aside, with a warning, instead of failing the sync. Every group is drawn once, by a.
    a, b = by_hand["a"], by_hand["b"]
    syncs: list[Fleet] = []
    sync = Fleet.sync

    def sync_then_kill(self: Fleet, weights: Any, weight_version: str) -> Any:
        result = sync(self, weights, weight_version)
        syncs.append(self)
        if len(syncs) == 1:
            b.proc.kill()
            b.proc.wait(timeout=10)
        return result

    monkeypatch.setattr(Fleet, "sync", sync_then_kill)
    caplog.set_level(logging.WARNING, logger="grail.rollouts.fleet")
    run(short_config(f"generation.urls=[{a.url},{b.url}/v1]"), tmp_path)
    assert results(tmp_path) == managed
    fleets = [r["fleet"] for r in train_records(tmp_path)]
    assert [s["requests"] > 0 for s in fleets[0]] == [True, True]
    assert fleets[1][1]["failures"] >= 1 and not fleets[1][1]["usable"]
    assert fleets[2][1]["requests"] == 0 and not fleets[2][1]["usable"]
    warnings = [r.getMessage() for r in caplog.records]
    assert any("server 1 of the fleet set aside" in w for w in warnings), warnings
    assert any(f"({b.url}/v1) is still set aside" in w for w in warnings), warnings
    assert a.proc.poll() is None
