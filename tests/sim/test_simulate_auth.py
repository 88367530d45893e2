"""``mesh simulate --url`` against a real ``mesh serve --model tiny --auth-token T``: the
token is sent (``--token``/``--auth-token``, else ``$MESH_TOKEN``, else ``$MESH_AUTH_TOKEN``)
and never written to the report; without it the run stops at once with one line naming the
fix. ``mesh sweep`` takes no ``--url`` (it starts a coordinator per floor)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from mesh.cli import simulate
from mesh.sim.scenario import SimConfig
from tests.reliability.serve_proc import ServeProc, running, small_project

TOKEN = "sim-token-7f3a"


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="mesh")
    simulate.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return int(args.func(args))


def _scenario(url: str, out: Path) -> list[str]:
    return ["simulate", "--url", url, "--template", "light", "--packages", "2", "--steps",
            "1", "--tokens-per-step", "4", "--seed", "3", "--no-progress", "--out", str(out)]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProc]:
    tmp = tmp_path_factory.mktemp("auth-serve")
    with running(tmp / "data", small_project(tmp / "project"), tmp / "cache",
                 "--simulation", "--auth-token", f"{TOKEN},another-caller") as proc:
        yield proc


@pytest.fixture(autouse=True)
def _no_tokens_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESH_TOKEN", raising=False)
    monkeypatch.delenv("MESH_AUTH_TOKEN", raising=False)


@pytest.mark.parametrize("flag", ["--token", "--auth-token"])
def test_the_token_flag_is_sent_and_not_reported(served: ServeProc, tmp_path: Path,
                                                flag: str) -> None:
    out = tmp_path / "report"
    assert _main([*_scenario(served.url, out), flag, TOKEN]) == 0
    text = (out / "report.json").read_text(encoding="utf-8")
    doc = json.loads(text)
    assert doc["summary"]["submitted"] == doc["summary"]["delivered"] == 2
    assert doc["samples"], "the /capacity samples were refused"
    assert TOKEN not in text and "token" not in doc["config"]


@pytest.mark.parametrize("var", ["MESH_TOKEN", "MESH_AUTH_TOKEN"])
def test_the_token_comes_from_the_environment(served: ServeProc, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch, var: str) -> None:
    # MESH_AUTH_TOKEN is the server's list: the first token is sent.
    monkeypatch.setenv(var, f"{TOKEN},another-caller" if var == "MESH_AUTH_TOKEN" else TOKEN)
    out = tmp_path / "report"
    assert _main(_scenario(served.url, out)) == 0
    assert json.loads((out / "report.json").read_text())["summary"]["delivered"] == 2


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_without_the_token_one_line_names_the_fix(served: ServeProc, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 token: str | None) -> None:
    out = tmp_path / "report"
    argv = _scenario(served.url, out) + (["--token", token] if token else [])
    assert _main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "401" in err and "--token" in err and "MESH_TOKEN" in err, err
    assert not out.exists()  # stopped before any package was sent


def test_a_token_in_serve_args_is_masked_in_the_report() -> None:
    config = SimConfig(token=TOKEN, serve_args=("--auth-token", TOKEN, f"--auth-token={TOKEN}",
                                                "--threads", "1"))
    doc = json.dumps(config.to_json())
    assert TOKEN not in doc and TOKEN not in repr(SimConfig(token=TOKEN))
    assert config.to_json()["serve_args"] == ["--auth-token", "***", "--auth-token=***",
                                              "--threads", "1"]


def test_sweep_takes_no_url(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="mesh")
    simulate.register(parser.add_subparsers())
    with pytest.raises(SystemExit):
        parser.parse_args(["sweep", "--help"])
    usage = capsys.readouterr().out
    assert "[--url" not in usage and "--url URL" not in usage, usage
    assert _main(["sweep", "--url", "http://127.0.0.1:9", "--floors", "2"]) == 1
    err = capsys.readouterr().err
    assert "starts its own coordinator for each floor" in err and "drop --url" in err, err
