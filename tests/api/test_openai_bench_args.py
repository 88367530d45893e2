"""bench/openai/'s argument handling and the side-by-side's sizing, with no server:
P and N lists, mesh's ARGS per (P, N), the session estimate, llama-server's argv (slots
pinned, -c N×(P+S), --cache-ram on) and vLLM's environment (KV space in whole GiB)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import pytest

from bench.common.servers import llama_server_argv, stop, vllm_blocks, vllm_env
from bench.openai import __main__ as ob


def test_lists_of_p_and_n_parse_and_bad_ones_are_refused() -> None:
    a = ob.parse(["--spawn-mesh", "--model tiny", "--prefix-tokens", "1024,4096",
                  "--agents", "8,32", "--turns", "2", "--tokens", "16"])
    assert a.prefix_tokens == [1024, 4096] and a.agents == [8, 32]
    assert a.session_tokens == ob.session_tokens(2, 16) == 64 + 2 * (16 + 96)
    assert ob.parse(["--mesh", "http://x", "--agents", "4"]).agents == [4]  # one N still works
    for bad in ("8,x", "0", ","):
        with pytest.raises(SystemExit):
            ob.parse(["--agents", bad])


def test_spawn_vllm_takes_an_optional_gguf_and_defaults_the_model() -> None:
    a = ob.parse(["--spawn-vllm", "--system-file", "s.txt"])
    assert a.spawn_vllm == "" and a.model  # --model defaults to SmolLM2's GGUF path
    assert ob.parse(["--spawn-vllm", "m.gguf"]).spawn_vllm == "m.gguf"
    assert ob.parse(["--mesh", "http://x"]).model is None  # nothing spawned: no model read


def test_the_model_defaults_to_the_one_mesh_is_started_with() -> None:
    from mesh.engine.models import resolve_model

    a = ob.parse(["--spawn-mesh", "--model tiny --policy none", "--spawn-vllm"])
    assert a.model == str(resolve_model("tiny").path)
    assert ob.parse(["--spawn-mesh", "--policy none"]).model == str(resolve_model(None).path)


def test_spawn_mesh_and_mesh_together_are_refused() -> None:
    with pytest.raises(SystemExit, match="not both"):
        ob.parse(["--spawn-mesh", "", "--mesh", "http://x"])


def test_a_running_server_cannot_take_several_prefix_sizes() -> None:
    a = ob.parse(["--mesh", "http://127.0.0.1:9", "--prefix-tokens", "1024,4096"])
    with pytest.raises(SystemExit, match="one prefix"):
        import asyncio
        asyncio.run(ob.amain(a))


def test_mesh_args_add_p_and_n_unless_given() -> None:
    assert ob.mesh_args("--model tiny", 1024, 8) == (
        "--model tiny --prefix-tokens 1024 --max-sessions 8")
    assert ob.mesh_args("--max-sessions 16 --prefix-tokens 512", 1024, 8) == (
        "--max-sessions 16 --prefix-tokens 512")
    assert ob.mesh_args("", None, 2) == "--max-sessions 2"


def test_llama_server_argv_pins_slots_and_turns_the_ram_cache_on() -> None:
    argv = llama_server_argv("/bin/llama-server", "m.gguf", 8080, slots=8, ctx=8 * 1500)
    joined = " ".join(argv)
    assert "-np 8" in joined and "-c 12000" in joined and "--cache-ram 8192" in joined
    assert "--metrics" in argv and argv[argv.index("-m") + 1] == "m.gguf"


def test_vllm_env_sizes_kv_space_in_whole_gib() -> None:
    assert vllm_env(4352, 1) == {"MAX_MODEL_LEN": "4352", "VLLM_CPU_KVCACHE_SPACE": "1"}
    assert vllm_env(4096, 5 * 2**30 + 1)["VLLM_CPU_KVCACHE_SPACE"] == "6"


def test_vllm_blocks_hold_n_sequences_in_whole_blocks() -> None:
    assert vllm_blocks(8, 1200) == 8 * 10 + 1  # 1200 tokens take 10 blocks of 128
    assert vllm_blocks(2, 128) == 3


def test_stop_group_ends_a_launchers_children() -> None:
    """A launcher script runs the server as its child; stopping the group stops both."""
    proc = subprocess.Popen(["bash", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE,
                            start_new_session=True)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    stop(proc, timeout_s=5, group=True)
    proc.stdout.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{child}/stat") as f:
                if f.read().split()[2] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"child {child} of the launcher still runs")


def test_table_shows_p_n_startup_and_kv_bytes() -> None:
    t = ob.Target("vLLM", "http://x", kv_cells=1000, startup_s=95.0, prefix_tokens=1024,
                  agents=8, kv_bytes=3 * 2**20, waves=[ob.Wave(wall_s=2.0), ob.Wave(wall_s=1.0)])
    rows = ob.table([t]).splitlines()
    assert rows[2].startswith("| vLLM | 1024 | 8 | 1 | 2.0 | 95.0 |") and "| 3 |" in rows[2]
    assert "| 2 | 1.0 |  |" in rows[3]  # start-up only beside the cold wave


def test_processed_reads_llama_cpp_timings_or_cached_tokens() -> None:
    assert ob.processed({"timings": {"prompt_n": 7}, "usage": {"prompt_tokens": 99}}) == 7
    assert ob.processed({"usage": {"prompt_tokens": 100,
                                   "prompt_tokens_details": {"cached_tokens": 96}}}) == 4
    assert ob.processed({"usage": {"prompt_tokens": 5, "prompt_tokens_details": None}}) == 5


def test_argparse_type_error_names_the_value() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="'8;32'"):
        ob.int_list("8;32")
    assert sys.modules["bench.openai.__main__"] is ob


def test_ratios_compare_each_system_with_mesh_at_the_same_p_and_n() -> None:
    def target(name: str, p: int, start: float, w1: float, w2: float) -> ob.Target:
        return ob.Target(name, "http://x", startup_s=start, prefix_tokens=p, agents=8,
                         kv_bytes=100, waves=[ob.Wave(wall_s=w1), ob.Wave(wall_s=w2)])

    rows = ob.ratios([target("mesh", 4096, 5.0, 5.0, 4.0),
                      target("llama-server", 4096, 2.0, 78.0, 5.2),
                      target("llama-server", 1024, 2.0, 9.0, 9.0)])  # no mesh at P=1024
    assert rows == [{"system": "llama-server", "prefix_tokens": 4096, "agents": 8,
                     "wave1_with_startup": 8.0, "wave1": 15.6, "wave2": 1.3,
                     "kv_bytes": 1.0}]
    assert "wave 1 + start-up 8.00x" in ob.ratio_lines(rows)
