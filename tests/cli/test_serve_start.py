"""``mesh serve``'s start-up as an operator meets it (issue 27 holes 6 and 7, issue 25
item 4): each mistake is one line naming the flag, exit 2, before any slow work; a
corrupt cache says so and is rebuilt; ``none``/``static:N`` seed nothing.

Real ``mesh serve --model tiny`` processes (see :mod:`tests.reliability.serve_proc`).
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from mesh.cli import serve as serve_cli
from mesh.cli.compose import preflight
from tests.reliability.serve_proc import free_port, serve_argv, serve_env, small_project, start


def _serve(tmp_path: Path, *extra: str, port: int | None = None,
           data_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
    argv = serve_argv(data_dir or tmp_path / "data", small_project(tmp_path / "project"),
                      port or free_port(), *extra)
    return subprocess.run(argv, capture_output=True, text=True, env=serve_env(tmp_path / "cache"),
                          timeout=120, check=False)


def _one_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The process failed with exactly one line (no start-up progress, no traceback)."""
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 2, (proc.returncode, lines)
    assert len(lines) == 1, lines
    assert lines[0].startswith("mesh serve: ")
    return lines[0]


def test_port_in_use_fails_before_the_prefix_is_built(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = _serve(tmp_path, port=port)
    line = _one_line(proc)
    assert "--port" in line and str(port) in line and "in use" in line, line
    # Failed fast: nothing of the slow start-up ran (no model, prefix or gate lines).
    for word in ("model:", "prefix:", "gate:", "Errno"):
        assert word not in proc.stderr, proc.stderr


def test_data_dir_that_is_a_file_names_the_flag(tmp_path: Path) -> None:
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    line = _one_line(_serve(tmp_path, data_dir=a_file))
    assert "--data-dir" in line and str(a_file) in line and "is a file" in line, line
    line = _one_line(_serve(tmp_path, data_dir=a_file / "sub"))
    assert "--data-dir" in line and "Errno" not in line, line


def test_unknown_template_lists_the_valid_names(tmp_path: Path) -> None:
    line = _one_line(_serve(tmp_path, "--template", "lite"))
    assert "--template" in line and "'lite'" in line, line
    assert "light" in line.split("'lite'")[1] and "heavy" in line, line
    broken = tmp_path / "tpl"
    broken.mkdir()
    line = _one_line(_serve(tmp_path, "--template", str(broken)))
    assert "--template" in line and "template.toml" in line and "light or heavy" in line, line


def test_max_body_bytes_is_a_flag(tmp_path: Path) -> None:
    line = _one_line(_serve(tmp_path, "--max-body-bytes", "10"))
    assert "--max-body-bytes" in line, line
    with_limit = start(tmp_path / "data", small_project(tmp_path / "project"),
                       tmp_path / "cache", "--max-body-bytes", "2048", "--policy", "none")
    try:
        body = {"jsonrpc": "2.0", "id": 1, "method": "SendMessage",
                "params": {"message": {"messageId": "m", "role": "ROLE_USER",
                                       "parts": [{"text": "x" * 5000}]}}}
        r = httpx.post(with_limit.url + "/", content=json.dumps(body),
                       headers=with_limit.headers, timeout=30)
        small = httpx.post(with_limit.url + "/", json={**body, "params": {}},
                           headers=with_limit.headers, timeout=30)
    finally:
        with_limit.stop()
    assert r.status_code == 413
    message = r.json()["error"]["message"]
    assert "2048 bytes" in message and "--max-body-bytes" in message, message
    assert small.status_code == 200  # served on the socket bound before the start-up


def _cache_files(data: Path) -> tuple[Path, Path]:
    (snap,) = (data / "prefix-cache").glob("prefix-*.kv")
    (seed,) = (data / "prefix-cache" / "gate").glob("gate-seed-*.json")
    return snap, seed


def test_corrupt_snapshot_and_seed_say_so_and_are_rebuilt(tmp_path: Path) -> None:
    data, project, cache = tmp_path / "data", small_project(tmp_path / "project"), tmp_path / "c"
    first = start(data, project, cache)
    first.stop()
    assert "first start with this model" in first.stderr()
    snap, seed = _cache_files(data)
    snap.write_bytes(b"not a snapshot")
    seed.write_text("{not json")
    second = start(data, project, cache)
    second.stop()
    err = second.stderr()
    assert f"prefix snapshot at {snap} is corrupt (llama.cpp could not load it); " \
           "rebuilding it" in err.splitlines(), err
    (seed_line,) = [line for line in err.splitlines() if line.startswith("gate: seed at ")]
    assert seed_line.startswith(f"gate: seed at {seed} is corrupt (not valid: ")
    assert seed_line.endswith("; rebuilding it")
    assert "first start" not in err, err
    third = start(data, project, cache)
    third.stop()
    err = third.stderr()
    assert "warm-started from cache" in err and "seeded from cache" in err, err
    assert "is corrupt (" not in err


@pytest.mark.parametrize("policy", ["none", "static:2"])
def test_policies_that_project_nothing_do_not_seed(tmp_path: Path, policy: str) -> None:
    served = start(tmp_path / "data", small_project(tmp_path / "project"), tmp_path / "cache",
                   "--policy", policy)
    served.stop(signal.SIGTERM)
    err = served.stderr()
    assert "timing" not in err and "needs no seed" in err, err
    assert not list((tmp_path / "data").rglob("gate-seed-*.json"))


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--floor-tps", "-1"], "--floor-tps"),
        (["--policy", "fastest"], "--policy"),
        (["--max-queue", "-3"], "--max-queue"),
        (["--public-url", "ftp://x"], "--public-url"),
        (["--max-hops", "0"], "--max-hops"),
        (["--max-body-bytes", "5"], "--max-body-bytes"),
        (["--port", "70000"], "--port"),
    ],
)
def test_config_mistakes_name_the_flag_before_anything_starts(
    tmp_path: Path, argv: list[str], flag: str
) -> None:
    parser = argparse.ArgumentParser(prog="mesh")
    serve_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--data-dir", str(tmp_path / "data"), *argv])
    with pytest.raises(ValueError, match=f"^[^;]*{flag}"):
        preflight(args)
    assert not (tmp_path / "data").exists(), "nothing was created for a bad flag"


@pytest.mark.parametrize(
    ("tokens", "line"),
    [(None, "auth: off (anyone who can reach 127.0.0.1:{port} may call; --auth-token T or "
            "MESH_AUTH_TOKEN turns it on)"),
     ("secret-one-1234", "auth: on (1 bearer token; "),
     ("secret-one-1234,secret-two-5678", "auth: on (2 bearer tokens; ")],
    ids=["off", "one", "two"],
)
def test_the_start_up_log_says_whether_auth_is_on(tmp_path: Path, tokens: str | None,
                                                  line: str) -> None:
    extra = ("--auth-token", tokens) if tokens else ()
    served = start(tmp_path / "data", small_project(tmp_path / "project"), tmp_path / "cache",
                   "--policy", "none", *extra)
    served.stop()
    port = served.url.rsplit(":", 1)[1]
    err = served.stderr()
    (auth,) = [x for x in err.splitlines() if x.startswith("auth: ")]
    assert auth.startswith(line.format(port=port)), auth
    for token in (tokens or "").split(","):
        assert not token or token not in err, "a token was printed"
