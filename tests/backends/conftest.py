"""Fixtures of the OpenAI-backend tests: real OpenAI-compatible servers on loopback (``mesh
serve --model tiny``'s own ``/v1/completions``, ``llama_cpp.server``)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.backends.llama_server import LlamaServer, llama_server
from tests.reliability.serve_proc import ServeProc, running, serve_env, small_project


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_project(tmp_path_factory.mktemp("project"))


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory, cache: Path,
            project: Path) -> Iterator[ServeProc]:
    """A real OpenAI-compatible server: mesh's own ``/v1/completions`` on the tiny model
    (llama.cpp decoding), ungated (``--policy none``: the front's gate admits)."""
    root = tmp_path_factory.mktemp("backend")
    with running(root / "data", project, cache, "--policy", "none") as served:
        yield served


@pytest.fixture(scope="module")
def llama_backend(tmp_path_factory: pytest.TempPathFactory,
                  cache: Path) -> Iterator[LlamaServer]:
    """A real third-party OpenAI-compatible server: ``llama_cpp.server`` on the tiny model,
    with its default settings (one context, requests serialized, a stream interrupted when
    another request arrives)."""
    from mesh.engine.models import tiny_model_path

    model = tiny_model_path(cache / "mesh" / "models")  # the file `mesh serve` would use
    with llama_server(model, tmp_path_factory.mktemp("llama-server")) as served:
        yield served


@pytest.fixture(scope="module")
def llama_backend_serial(tmp_path_factory: pytest.TempPathFactory,
                         cache: Path) -> Iterator[LlamaServer]:
    """``llama_cpp.server`` as mesh's docs say to run it: ``--interrupt_requests False``
    (a request waits for the running one instead of cutting it); a small context (384
    tokens, less than a session may hold), so a long session overruns it."""
    from mesh.engine.models import tiny_model_path

    model = tiny_model_path(cache / "mesh" / "models")
    with llama_server(model, tmp_path_factory.mktemp("llama-server-serial"),
                      "--interrupt_requests", "False", n_ctx=384) as served:
        yield served


def tiny_path(cache: Path) -> Path:
    """The tiny GGUF the served processes wrote (same file, so the same tokenizer)."""
    from mesh.engine.models import TINY_FORMAT_VERSION

    path = cache / "mesh" / "models" / f"mesh-tiny-llama-v{TINY_FORMAT_VERSION}.gguf"
    assert path.is_file(), f"no tiny model at {path}"
    return path


def simulate(url: str, out: Path, cache: Path) -> int:
    """``mesh simulate --url`` (a few seeded scenario packages) against ``url``."""
    argv = [sys.executable, "-m", "mesh", "simulate", "--url", url, "--packages", "3",
            "--steps", "2", "--tokens-per-step", "6", "--no-progress", "--out", str(out)]
    done = subprocess.run(argv, env=serve_env(cache), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    assert report["summary"]["delivered"] == 3, report["summary"]
    return done.returncode
