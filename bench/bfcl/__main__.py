"""BFCL's AST categories through an OpenAI-compatible ``/v1/chat/completions``, from outside.

Everything that decides a score is the ``bfcl-eval`` package's own: its data files and
ground truths (``bfcl_eval.utils.load_dataset_entry`` / ``load_ground_truth_entry``), its
OpenAI chat handler (``OpenAICompletionsHandler``: tool conversion, first-turn messages,
reply parsing, ``decode_ast``) and its AST checker (``ast_checker``), called in the order of
its evaluator's ``_evaluate_single_ast_entry``. The only change to the handler is the request
itself: ``tool_choice`` (``auto`` or ``required``) is sent (and ``max_tokens`` when given;
BFCL sends none, so the server's default applies), and the client
does not retry, so every HTTP error is counted.

bfcl-eval is installed without its dependencies (they pull torch, vLLM's extras, a dozen
vendor SDKs); the checker's module table (``bfcl_eval.constants.model_config``, which imports
every vendor's handler) is replaced by one entry for this bench, the setting an OpenAI
function-calling model has there (``underscore_to_dot``: tool names had '.' turned into '_').
See docs/bfcl.md.

    python -m bench.bfcl --spawn-mesh "--model smollm2" --sample 20 --seed 1
    python -m bench.bfcl --url http://127.0.0.1:8080 --categories simple_python

Per category and ``tool_choice``: accuracy, share of replies with a call, p50 latency, HTTP
errors, the checker's error types. Table to stdout, JSON to
``bench/bfcl/results/bfcl_<label>.json``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib
import json
import os
import platform
import random
import re
import shlex
import signal
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import httpx

from bench.common.servers import stop
from bench.openai.__main__ import spawn_mesh

BFCL_VERSION = "2026.3.23"
CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "live_simple")
TOOL_CHOICES = ("auto", "required")
# This bench's name in the checker's model table; no '_' (the checker reads the table under
# the name with '_' turned into '/').
REGISTRY = "mesh-bfcl-FC"
INSTALL = ("pip install --no-deps bfcl-eval==2026.3.23 tree-sitter==0.21.3 "
           "tree-sitter-java==0.21.0 tree-sitter-javascript==0.21.4 overrides filelock "
           "tenacity openai")
# Published, not measured here. Overall figures over all of a BFCL version's categories
# (multi-turn, irrelevance, ... included), not the five AST categories this bench runs; the
# closest things in print to a small model's BFCL score. Found with a search, copied as given.
_WHATMODEL = "https://raw.githubusercontent.com/jakemanger/whatmodel/main/pages/model/"
PUBLISHED: list[dict[str, str]] = [
    {"model": "Qwen3 1.7B", "figure": "54.7 % BFCL v3; 28.4 % BFCL V4 (December 2025 archive)",
     "source": _WHATMODEL + "qwen3-1-7b.md", "kind": "aggregator (whatmodel.sh)"},
    {"model": "Qwen3 0.6B", "figure": "47.3 % BFCL v3; 23.9 % BFCL V4 (December 2025 archive)",
     "source": _WHATMODEL + "qwen3-0-6b.md", "kind": "aggregator (whatmodel.sh)"},
    {"model": "Falcon3 1B Instruct",
     "figure": "19.7 % BFCL v3; 11.1 % BFCL V4 (December 2025 archive)",
     "source": _WHATMODEL + "falcon3-1b.md", "kind": "aggregator (whatmodel.sh)"},
    {"model": "Llama 3.2 3B Instruct", "figure": "67.0 % BFCL v2",
     "source": "https://wikibench.ai/benchmarks/bfcl-v2/",
     "kind": "self-reported by Meta, listed by llm-stats"},
]


@dataclasses.dataclass(frozen=True)
class CheckerConfig:
    """What the AST checker reads of a model's entry in bfcl-eval's model table."""

    underscore_to_dot: bool = True
    is_fc_model: bool = True


@dataclasses.dataclass(frozen=True)
class Bfcl:
    """The parts of bfcl-eval this bench calls (all of them bfcl-eval's own code)."""

    handler_class: type
    load_entries: Callable[..., list[dict[str, Any]]]
    load_answers: Callable[[str], list[dict[str, Any]]]
    is_call_format: Callable[[Any], bool]
    ast_checker: Callable[..., dict[str, Any]]
    language: Any
    return_format: Any


def load_bfcl() -> Bfcl:
    """Import bfcl-eval's data loaders, OpenAI handler and AST checker, nothing heavier.

    bfcl-eval writes result/score/lock folders under ``BFCL_PROJECT_ROOT`` at import; unless
    the caller set it, that is a folder under the temp dir, not site-packages."""
    os.environ.setdefault("BFCL_PROJECT_ROOT",
                          str(Path(tempfile.gettempdir()) / "mesh-bfcl-project"))
    table = "bfcl_eval.constants.model_config"
    if table not in sys.modules:
        try:
            importlib.import_module("bfcl_eval.constants")
        except ImportError:
            raise SystemExit(f"bfcl-eval is not installed; run `bash scripts/install.sh test` "
                             f"or `{INSTALL}`") from None
        stub = types.ModuleType(table)
        stub.MODEL_CONFIG_MAPPING = {}  # type: ignore[attr-defined]
        sys.modules[table] = stub
    sys.modules[table].MODEL_CONFIG_MAPPING.setdefault(REGISTRY, CheckerConfig())
    try:
        checker = importlib.import_module("bfcl_eval.eval_checker.ast_eval.ast_checker")
        handler = importlib.import_module(
            "bfcl_eval.model_handler.api_inference.openai_completion")
        utils = importlib.import_module("bfcl_eval.utils")
        enums = importlib.import_module("bfcl_eval.constants.enums")
    except ImportError as exc:
        raise SystemExit(f"bfcl-eval needs {exc.name!r} to load its checker; run "
                         f"`{INSTALL}`") from None
    return Bfcl(handler.OpenAICompletionsHandler, utils.load_dataset_entry,
                utils.load_ground_truth_entry, utils.is_function_calling_format_output,
                checker.ast_checker, enums.Language.PYTHON, enums.ReturnFormat.PYTHON)


def make_handler(bfcl: Bfcl, client: Any, model: str, *, tool_choice: str,
                 max_tokens: int | None, temperature: float) -> Any:
    """bfcl-eval's OpenAI chat handler, its request sending ``tool_choice`` and
    ``max_tokens`` (unless None) through ``client`` (an ``openai.OpenAI`` that does not
    retry)."""

    class Handler(bfcl.handler_class):  # type: ignore[misc,name-defined]
        def _query_FC(self, inference_data: dict[str, Any]) -> tuple[Any, float]:
            kwargs: dict[str, Any] = {
                "messages": inference_data["message"], "model": self.model_name,
                "temperature": self.temperature, "tool_choice": tool_choice}
            if max_tokens is not None:
                kwargs["max_tokens"] = max_tokens
            if inference_data["tools"]:
                kwargs["tools"] = inference_data["tools"]
            t0 = time.perf_counter()
            response = self.client.chat.completions.create(**kwargs)
            return response, time.perf_counter() - t0

    # The handler builds its own client from these variables; it is replaced right after.
    with mock.patch.dict(os.environ, {"OPENAI_API_KEY": str(client.api_key),
                                      "OPENAI_BASE_URL": str(client.base_url)}):
        handler = Handler(model_name=model, temperature=temperature, registry_name=REGISTRY,
                          is_fc_model=True)
    handler.client = client
    return handler


def sample_entries(entries: list[dict[str, Any]], size: int | None, seed: int,
                   category: str) -> list[dict[str, Any]]:
    """All entries, or ``size`` of them drawn with a generator seeded by (seed, category),
    so a category's sample does not depend on which other categories run; file order kept."""
    if size is None or size >= len(entries):
        return entries
    picked = set(random.Random(f"{seed}:{category}").sample(range(len(entries)), size))
    return [e for i, e in enumerate(entries) if i in picked]


def check_entry(bfcl: Bfcl, handler: Any, entry: dict[str, Any], plain: dict[str, Any],
                answer: dict[str, Any], category: str) -> dict[str, Any]:
    """One entry: bfcl-eval's inference, then its evaluator's steps (decode_ast, format
    check, ast_checker against the function docs without the language hint)."""
    import openai

    verdict: dict[str, Any] = {"id": entry["id"], "valid": False, "http_error": None,
                               "calls": 0, "latency_s": None, "error_type": None}
    try:
        result, meta = handler.inference(entry, include_input_log=False,
                                         exclude_state_log=True)
    except openai.APIStatusError as exc:
        verdict.update(http_error=exc.status_code, error_type="http_error",
                       message=str(exc)[:300])
        return verdict
    except openai.APIConnectionError as exc:
        verdict.update(http_error=type(exc).__name__, error_type="http_error",
                       message=str(exc)[:300])
        return verdict
    except Exception as exc:  # bfcl-eval's generation records any other failure, goes on
        verdict.update(error_type="inference_error", message=f"{type(exc).__name__}: {exc}"[:300])
        return verdict
    verdict["latency_s"] = round(float(meta["latency"]), 4)
    verdict["completion_tokens"] = meta.get("output_token_count")
    verdict["calls"] = len(result) if isinstance(result, list) else 0
    try:
        decoded = handler.decode_ast(result, bfcl.return_format, False)
    except Exception:  # bfcl-eval's evaluator: any decode failure is this error type
        verdict["error_type"] = "ast_decoder:decoder_failed"
        verdict["reply"] = str(result)[:200]
        return verdict
    if not bfcl.is_call_format(decoded):
        verdict["error_type"] = "ast_decoder:decoder_wrong_output_format"
        return verdict
    checked = bfcl.ast_checker(plain["function"], decoded, answer["ground_truth"],
                               bfcl.language, category, REGISTRY)
    verdict["valid"] = bool(checked["valid"])
    verdict["error_type"] = None if checked["valid"] else checked.get("error_type")
    if not checked["valid"]:
        verdict["decoded"] = json.dumps(decoded)[:300]
    return verdict


def summarize(verdicts: list[dict[str, Any]], available: int) -> dict[str, Any]:
    n = len(verdicts)
    latencies = [v["latency_s"] for v in verdicts if v["latency_s"] is not None]
    errors = collections.Counter(str(v["http_error"]) for v in verdicts if v["http_error"])
    return {
        "entries": n, "available": available,
        "correct": sum(v["valid"] for v in verdicts),
        "accuracy": round(sum(v["valid"] for v in verdicts) / n, 4) if n else None,
        "call_share": round(sum(v["calls"] > 0 for v in verdicts) / n, 4) if n else None,
        "p50_latency_s": round(statistics.median(latencies), 3) if latencies else None,
        "http_errors": sum(errors.values()), "http_errors_by_status": dict(errors),
        "error_types": dict(collections.Counter(
            v["error_type"] for v in verdicts if v["error_type"])),
    }


def run(bfcl: Bfcl, client: Any, model: str, *, categories: Sequence[str],
        tool_choices: Sequence[str], sample: int | None, seed: int, max_tokens: int | None,
        temperature: float, progress: Callable[[str], None] = lambda _: None,
        checkpoint: Callable[[dict[str, dict[str, Any]]], None] = lambda _: None,
        ) -> dict[str, dict[str, Any]]:
    """{tool_choice: {category: summary + per-entry verdicts}}; entries one at a time."""
    results: dict[str, dict[str, Any]] = {c: {} for c in tool_choices}
    for category in categories:
        entries = bfcl.load_entries(category, include_prereq=False)
        plain = {e["id"]: e for e in bfcl.load_entries(
            category, include_prereq=False, include_language_specific_hint=False)}
        answers = {a["id"]: a for a in bfcl.load_answers(category)}
        chosen = sample_entries(entries, sample, seed, category)
        for choice in tool_choices:
            handler = make_handler(bfcl, client, model, tool_choice=choice,
                                   max_tokens=max_tokens, temperature=temperature)
            verdicts = []
            for entry in chosen:
                verdicts.append(check_entry(bfcl, handler, entry, plain[entry["id"]],
                                            answers[entry["id"]], category))
                progress(f"{choice} {entry['id']}: {verdicts[-1]['error_type'] or 'valid'}")
            results[choice][category] = {**summarize(verdicts, len(entries)),
                                         "verdicts": verdicts}
            checkpoint(results)
    return results


def overall(results: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Per tool_choice, the unweighted mean of the categories' accuracies (how BFCL's
    overall figure is formed from its sub-categories; here only the AST ones run)."""
    means: dict[str, float | None] = {}
    for choice, cats in results.items():
        accs = [s["accuracy"] for s in cats.values() if s["accuracy"] is not None]
        means[choice] = round(statistics.fmean(accs), 4) if accs else None
    return means


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = ["| tool_choice | category | entries | accuracy | with a call | p50 s | HTTP errors |",
            "|---|---|---|---|---|---|---|"]
    for choice, cats in results.items():
        for cat, s in cats.items():
            acc = "-" if s["accuracy"] is None else f"{100 * s['accuracy']:.0f} %"
            calls = "-" if s["call_share"] is None else f"{100 * s['call_share']:.0f} %"
            p50 = "-" if s["p50_latency_s"] is None else f"{s['p50_latency_s']:.2f}"
            rows.append(f"| {choice} | {cat} | {s['entries']} of {s['available']} | {acc} "
                        f"| {calls} | {p50} | {s['http_errors']} |")
        mean = overall(results)[choice]
        if mean is not None and len(cats) > 1:
            rows.append(f"| {choice} | mean of the {len(cats)} | | {100 * mean:.0f} % | | | |")
    return "\n".join(rows)


def served_model(url: str) -> str:
    """The first model ``/v1/models`` lists (mesh: the GGUF's name, not the strict one)."""
    try:
        data = httpx.get(url + "/v1/models", timeout=30).json()["data"]
        return str(data[0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise SystemExit(f"{url}/v1/models did not name a model ({exc}); pass --model-name"
                         ) from None


def default_label(mesh_args: str | None, model: str) -> str:
    if mesh_args:
        argv = shlex.split(mesh_args)
        if "--model" in argv[:-1]:
            return Path(argv[argv.index("--model") + 1]).stem
        return "smollm2"  # mesh serve's default model
    return re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-") or "model"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {__package__}", description=__doc__.split("\n")[0])
    p.add_argument("--spawn-mesh", metavar="ARGS", default=None,
                   help='start "mesh serve ARGS" on a free port (e.g. "--model smollm2")')
    p.add_argument("--url", default=None, help="a running OpenAI-compatible server "
                   "(mesh serve, llama-server, ...), without /v1")
    p.add_argument("--model-name", default=None, help="model to ask for (default: the "
                   "first of /v1/models)")
    p.add_argument("--categories", default=",".join(CATEGORIES))
    p.add_argument("--tool-choice", default=",".join(TOOL_CHOICES),
                   help="comma-separated: auto, required")
    p.add_argument("--sample", type=int, default=None,
                   help="entries per category, drawn with --seed (default: all)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=None,
                   help="default: not sent, as BFCL's handler does (mesh: 128)")
    p.add_argument("--temperature", type=float, default=0.001, help="bfcl-eval's default")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--label", default=None, help="names the result file (default: the "
                   "--model of --spawn-mesh, else the served model's name)")
    p.add_argument("--out", default=None, help="default: bench/bfcl/results/bfcl_<label>.json")
    p.add_argument("--quiet", action="store_true", help="no line per entry on stderr")
    a = p.parse_args(argv)
    if (a.spawn_mesh is None) == (a.url is None):
        p.error("give exactly one of --spawn-mesh ARGS or --url URL")
    categories = [c for c in a.categories.split(",") if c]
    choices = [c for c in a.tool_choice.split(",") if c]
    if unknown := sorted(set(choices) - {"auto", "required", "none"}):
        p.error(f"--tool-choice {','.join(unknown)}: use auto, required (or none)")
    bfcl = load_bfcl()
    import openai

    if a.spawn_mesh is not None:
        # A SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the server is stopped.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    proc, startup = None, None
    log = Path(tempfile.mkdtemp(prefix="bfcl-bench-")) / "mesh.log"
    try:
        if a.spawn_mesh is not None:
            proc, url, startup = spawn_mesh(a.spawn_mesh, log)
        else:
            url = a.url.rstrip("/")
        model = a.model_name or served_model(url)
        prefix: dict[str, Any] = {}  # mesh's pool prefix; other servers have none
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
            prefix = {"prefix_tokens": httpx.get(url + "/v1/prefix", timeout=30)
                      .json()["prefix_tokens"]}
        client = openai.OpenAI(base_url=url + "/v1", api_key=os.environ.get(
            "MESH_AUTH_TOKEN", "unused"), timeout=a.timeout, max_retries=0)
        label = a.label or default_label(a.spawn_mesh, model)
        out = Path(a.out or f"bench/bfcl/results/bfcl_{label}.json")
        doc: dict[str, Any] = {
            "bench": "bench/bfcl/", "bfcl_eval": BFCL_VERSION, "model": model,
            "server": {"mesh_args": a.spawn_mesh, "url": a.url, "startup_s": startup,
                       **prefix},
            "request": {"max_tokens": a.max_tokens or "server default",
                        "temperature": a.temperature,
                        "parallel_tool_calls": "server default", "one at a time": True},
            "sample": {"per_category": a.sample, "seed": a.seed},
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "cpus": os.cpu_count(), "load_before": os.getloadavg()[0]},
            "published_not_measured": PUBLISHED,
        }
        t0 = time.monotonic()

        def write(results: dict[str, dict[str, Any]], complete: bool) -> None:
            # Written after every category, so a run cut short keeps what it measured.
            doc.update(complete=complete, wall_s=round(time.monotonic() - t0, 1),
                       accuracy_mean=overall(results), results=results)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(doc, indent=1) + "\n")

        results = run(bfcl, client, model, categories=categories, tool_choices=choices,
                      sample=a.sample, seed=a.seed, max_tokens=a.max_tokens,
                      temperature=a.temperature, checkpoint=lambda r: write(r, False),
                      progress=(lambda _: None) if a.quiet else
                      (lambda line: print(line, file=sys.stderr, flush=True)))
        write(results, True)
    finally:
        if proc is not None:
            stop(proc)
    print(table(results))
    print(f"wrote {out}")
    errors = sum(s["http_errors"] for cats in results.values() for s in cats.values())
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
