"""``--prefix-attention auto|shared|off`` and the measured ``--flash-attn auto`` (issue 32):
the FA table at the bench's points and between them, how the two flags resolve with the
patch faked present or absent, the errors, the kernel's switch, the lookup of the patch's
symbol, the CLI flag, and real pools on the tiny model."""

from __future__ import annotations

import asyncio
import ctypes
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from mesh.cli.compose import apply_engine_flags
from mesh.engine import build as build_mod
from mesh.engine import llama as prefix_attn
from mesh.engine.config import (
    FLASH_ATTN_CONFLICT,
    PREFIX_ATTENTION_NOT_BUILT,
    EngineConfig,
    SamplingParams,
    fa_on_vs_off,
    resolve_flash_attn,
    resolve_prefix_attention,
)
from mesh.engine.pool import SharedKVPool
from tests.engine.flag_args import parse

RESULTS = (Path(__file__).resolve().parents[2] / "bench" / "prefix_attention" / "results"
           / "prefix_attention.json")
PREFIX = "The shared project prefix: tools, files and notes. " * 4


def measured() -> list[dict[str, object]]:
    """The bench's f16 "best" points (FA on and off both measured)."""
    best = json.loads(RESULTS.read_text())["best"]
    return [b for b in best if b["kv"] == "f16" and b["fa_on_vs_off"] is not None]


def cpu_f16(prefix: int, rows: int) -> str:
    return resolve_flash_attn("auto", "f16", on_gpu=False, prefix_tokens=prefix, rows=rows)


# ------------------------------------------------------------------ the FA table (pure)


def test_the_table_chooses_the_measured_best_at_every_measured_point() -> None:
    points = measured()
    assert len(points) == 12  # 1K-8K x rows 1, 8, 32
    for b in points:
        prefix, rows = int(str(b["prefix"])), int(str(b["rows"]))
        assert fa_on_vs_off(prefix, rows) == pytest.approx(float(str(b["fa_on_vs_off"])),
                                                           abs=6e-4), (prefix, rows)
        assert cpu_f16(prefix, rows) == b["best_fa"], (prefix, rows)


def test_fa_wins_short_prefixes_and_loses_long_ones_with_many_rows() -> None:
    assert cpu_f16(1904, 8) == "on"  # the 1.9K prefix: on at 1K-2K for all rows
    assert cpu_f16(2048, 32) == "on"
    assert cpu_f16(6014, 8) == "off"  # the 6K: off (crossover ~4.4K at 8 rows)
    assert cpu_f16(4096, 8) == "on" and cpu_f16(4800, 8) == "off"
    assert cpu_f16(3500, 32) == "off"  # crossover ~3K at 32 rows
    assert cpu_f16(8192, 16) == "off"  # between 8 and 32 rows: both off, so off
    for prefix in (100, 1024, 8192, 65536):
        assert cpu_f16(prefix, 1) == "on"  # one row: on at every prefix measured
    # Outside the measured range the nearest edge holds: no flip past 8K or 32 rows.
    assert cpu_f16(32768, 8) == "off" and cpu_f16(32768, 64) == "off"
    assert cpu_f16(512, 64) == "on"


def test_gpu_quantized_explicit_and_shared_prefix() -> None:
    for kv, on_gpu in (("q8_0", False), ("q4_0", False), ("f16", True)):
        assert resolve_flash_attn("auto", kv, on_gpu=on_gpu, prefix_tokens=8192,
                                  rows=32) == "auto"
    for mode in ("on", "off"):
        assert resolve_flash_attn(mode, "f16", on_gpu=False, prefix_tokens=1024, rows=1,
                                  shared_prefix=True) == mode
    # shared-prefix attention runs inside flash attention: auto = on, even where the
    # table alone would say off
    assert cpu_f16(8192, 32) == "off"
    assert resolve_flash_attn("auto", "f16", on_gpu=False, prefix_tokens=8192, rows=32,
                              shared_prefix=True) == "on"


# ------------------------------------------------------------------ --prefix-attention (pure)


def resolve(requested: str, *, available: bool = True, on_gpu: bool = False,
            flash_attn: str = "auto", prefix: int = 4096, env_off: bool = False) -> str:
    return resolve_prefix_attention(requested, available=available, on_gpu=on_gpu,
                                    flash_attn=flash_attn, prefix_tokens=prefix,
                                    min_prefix=256, disabled_by_env=env_off)


def test_auto_is_shared_only_where_the_kernel_can_run() -> None:
    assert resolve("auto") == "shared"
    assert resolve("auto", flash_attn="on") == "shared"
    assert resolve("auto", available=False) == "off"  # the unpatched wheel
    assert resolve("auto", on_gpu=True) == "off"  # a CPU kernel
    assert resolve("auto", flash_attn="off") == "off"  # the user chose the non-flash path
    assert resolve("auto", prefix=255) == "off" and resolve("auto", prefix=256) == "shared"
    assert resolve("auto", env_off=True) == "off"  # GGML_CPU_SHARED_PREFIX_ATTN=0
    assert resolve("off") == "off" and resolve("off", available=False) == "off"
    assert resolve("shared", prefix=16) == "shared"


@pytest.mark.parametrize(("available", "on_gpu", "flash_attn", "text"), [
    (False, False, "auto", "this llama.cpp was built without mesh's shared-prefix attention "
                           "patch; reinstall with scripts/install.sh or pass "
                           "--prefix-attention off"),
    (True, True, "auto", "pass --gpu-layers 0 or --prefix-attention off"),
    (True, False, "off", "drop --flash-attn off"),
])
def test_shared_that_cannot_run_names_the_fix(available: bool, on_gpu: bool, flash_attn: str,
                                              text: str) -> None:
    with pytest.raises(ValueError) as err:
        resolve("shared", available=available, on_gpu=on_gpu, flash_attn=flash_attn)
    assert text in str(err.value)
    assert PREFIX_ATTENTION_NOT_BUILT.startswith("this llama.cpp was built without")


def test_config_validates_the_flag_and_the_conflict() -> None:
    with pytest.raises(ValueError, match="prefix_attention must be one of auto, shared, off"):
        EngineConfig(model_path="m.gguf", prefix_attention="cascade").validate()
    with pytest.raises(ValueError) as err:
        EngineConfig(model_path="m.gguf", prefix_attention="shared",
                     flash_attn="off").validate()
    assert str(err.value) == FLASH_ATTN_CONFLICT
    for mode in ("auto", "shared", "off"):
        EngineConfig(model_path="m.gguf", prefix_attention=mode).validate()
    EngineConfig(model_path="m.gguf", prefix_attention="auto", flash_attn="off").validate()


# ------------------------------------------------------------------ resolution in build


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The kernel's variables unset now and restored after the test."""
    monkeypatch.delenv(prefix_attn.ENV_DISABLE, raising=False)
    monkeypatch.delenv(prefix_attn.ENV_MIN, raising=False)
    monkeypatch.setattr(prefix_attn, "_switched", None)
    return monkeypatch


def fake_patch(monkeypatch: pytest.MonkeyPatch, present: bool) -> None:
    monkeypatch.setattr(prefix_attn, "shared_prefix_attn_available", lambda: present)


def attention(mode: str, *, flash: str = "auto", sessions: int = 8, prefix: int = 6000,
              on_gpu: bool = False, share_prefix: bool = True) -> tuple[str, str]:
    cfg = EngineConfig(model_path="m.gguf", prefix_attention=mode, flash_attn=flash,
                       max_sessions=sessions, share_prefix=share_prefix)
    return build_mod.resolve_attention(cfg, on_gpu=on_gpu, prefix_tokens=prefix)


def test_resolution_with_the_patch_faked_present(clean_env: pytest.MonkeyPatch) -> None:
    fake_patch(clean_env, True)
    assert attention("auto") == ("shared", "on")  # the table alone says off at 6K x 8
    assert prefix_attn.switched_on() is True
    assert attention("shared", flash="on") == ("shared", "on")
    assert attention("auto", on_gpu=True) == ("off", "auto")
    assert attention("auto", prefix=100) == ("off", "on")  # below the kernel's minimum
    clean_env.setenv(prefix_attn.ENV_MIN, "64")
    assert attention("auto", prefix=100) == ("shared", "on")
    assert attention("auto", share_prefix=False) == ("off", "off")  # no shared prefix
    assert attention("off") == ("off", "off")  # the measured table: off at 6K x 8
    assert prefix_attn.switched_on() is False  # set before the context is built
    # ... and mesh wrote no environment variable for the off pool: a later auto pool is
    # shared again
    assert attention("auto") == ("shared", "on")


def test_resolution_with_the_patch_faked_absent(clean_env: pytest.MonkeyPatch) -> None:
    fake_patch(clean_env, False)
    assert attention("auto") == ("off", "off")
    assert attention("auto", prefix=1904) == ("off", "on")
    assert prefix_attn.switched_on() is False
    with pytest.raises(ValueError, match=r"reinstall with scripts/install\.sh"):
        attention("shared")


def test_a_user_who_turned_the_kernel_off_keeps_it_off(clean_env: pytest.MonkeyPatch) -> None:
    fake_patch(clean_env, True)
    clean_env.setenv(prefix_attn.ENV_DISABLE, "0")
    assert attention("auto") == ("off", "off")
    assert attention("shared") == ("shared", "on")  # asked for by name: switched on
    assert prefix_attn.switched_on() is True


def test_the_warm_cache_key_holds_both_modes() -> None:
    keys = {build_mod._ctx_key(512, 3, True, fa, pa)
            for fa in ("on", "off", "auto") for pa in ("off", "shared")}
    assert len(keys) == 6
    assert build_mod._ctx_key(512, 3, True, "off", "off") == "512:3:True:unified:fa-off"


# ------------------------------------------------------------------ the symbol lookup


FAKE_CPU = f"""
int {prefix_attn.SYMBOL}(void) {{ return 1; }}
int enabled = -2; long long min_prefix = -2;
void {prefix_attn.SET_SYMBOL}(int e, long long m) {{ enabled = e; min_prefix = m; }}
int fake_enabled(void) {{ return enabled; }}
long long fake_min(void) {{ return min_prefix; }}
"""


def test_the_lookup_finds_the_symbols_in_a_linked_ggml_cpu(
        tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    """A fake patched build: libllama linking a ggml-cpu that exports the patch's functions
    (names of their own: the process has the real sonames loaded already)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    sym = prefix_attn.SYMBOL
    (tmp_path / "cpu.c").write_text(FAKE_CPU)
    (tmp_path / "llama.c").write_text(f"int {sym}(void);\nint x(void) {{ return {sym}(); }}\n")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain.c").write_text("int y(void) { return 0; }\n")
    cpu = "libggml-cpu-fake.so.0"
    for args in (["-o", cpu, f"-Wl,-soname,{cpu}", "cpu.c"],
                 ["-o", "libllama-fake.so", "llama.c", "-L.", f"-l:{cpu}",
                  "-Wl,-rpath,$ORIGIN"],
                 ["-o", "plain/libllama.so", "plain.c"]):  # an unpatched build
        subprocess.run([cc, "-shared", "-fPIC", *args], cwd=tmp_path, check=True,
                       capture_output=True, timeout=60)
    llama = ctypes.CDLL(str(tmp_path / "libllama-fake.so"))
    found = prefix_attn._candidates(llama)
    assert [Path(str(lib._name)).name for lib in found] == ["libllama-fake.so", cpu]
    assert prefix_attn.version_in(llama) == 1
    assert prefix_attn.version_in(ctypes.CDLL(str(tmp_path / "plain" / "libllama.so"))) == 0
    # The switch also reaches a kernel that already read the environment, through the
    # patch's setter (min_prefix 0: re-read GGML_CPU_SHARED_PREFIX_MIN).
    clean_env.setattr(prefix_attn, "llama_library", lambda: llama)
    fake_patch(clean_env, True)
    cpu_lib = found[1]
    cpu_lib.fake_min.restype = ctypes.c_longlong
    prefix_attn.set_shared_prefix_attn(False)
    assert (cpu_lib.fake_enabled(), cpu_lib.fake_min()) == (0, 0)
    assert prefix_attn.switched_on() is False
    prefix_attn.set_shared_prefix_attn(True)
    assert (cpu_lib.fake_enabled(), cpu_lib.fake_min()) == (1, 0)
    assert prefix_attn.switched_on() is True


def test_the_environment_is_read_as_the_kernel_reads_it(clean_env: pytest.MonkeyPatch) -> None:
    assert prefix_attn.min_prefix() == 256
    for value, expected in (("64", 64), (" 512x", 512), ("0", 1), ("-3", 1), ("abc", 1)):
        clean_env.setenv(prefix_attn.ENV_MIN, value)
        assert prefix_attn.min_prefix() == expected, value
    assert not prefix_attn.disabled_by_env()
    for value, off in (("0", True), ("1", False), (" 0", False), ("00", False)):
        clean_env.setenv(prefix_attn.ENV_DISABLE, value)
        assert prefix_attn.disabled_by_env() is off, value


def test_the_loaded_wheel_is_asked_through_its_ggml_cpu() -> None:
    llama = prefix_attn.llama_library()
    names = [Path(str(lib._name)).name for lib in prefix_attn._candidates(llama)]
    assert names[0].startswith("libllama") and any("ggml-cpu" in n for n in names[1:])
    assert prefix_attn.shared_prefix_attn_version() in (0, 1)


# ------------------------------------------------------------------ mesh serve's flag


def test_the_cli_flag_reaches_the_config() -> None:
    base = EngineConfig(model_path="m.gguf")
    assert apply_engine_flags(base, parse(), PREFIX).prefix_attention == "auto"
    for mode in ("shared", "off", "auto"):
        cfg = apply_engine_flags(base, parse("--prefix-attention", mode), PREFIX)
        assert cfg.prefix_attention == mode
    with pytest.raises(SystemExit):
        parse("--prefix-attention", "cascade")
    cfg = apply_engine_flags(base, parse("--prefix-attention", "shared", "--flash-attn", "off"),
                             PREFIX)
    with pytest.raises(ValueError, match="drop --flash-attn off"):
        cfg.validate()


# ------------------------------------------------------------------ real pools (tiny model)


def decode(path: Path, mode: str, flash_attn: str = "auto") -> tuple[list[int], str, str]:
    """Greedy tokens of one turn, and the (flash, prefix) attention the pool resolved."""
    async def body() -> tuple[list[int], str, str]:
        pool = SharedKVPool(EngineConfig(model_path=str(path), max_sessions=2,
                                         session_budget=64, n_threads=1, flash_attn=flash_attn,
                                         prefix_attention=mode), PREFIX)
        info = await pool.start()
        try:
            s = await pool.attach()
            s.append("hello")
            params = SamplingParams(max_tokens=8, stop_at_eos=False)
            return [p.token async for p in s.generate(params)], info.flash_attn, \
                info.prefix_attention
        finally:
            await pool.aclose()

    return asyncio.run(body())


def test_real_pools_with_off_and_auto_decode(tiny_model_path: Path,
                                             clean_env: pytest.MonkeyPatch) -> None:
    off = decode(tiny_model_path, "off")
    assert off[1:] == ("on", "off")  # a short prefix x 2 rows: the table says on
    assert prefix_attn.switched_on() is False
    auto = decode(tiny_model_path, "auto")
    # the tiny prefix is below the kernel's minimum: off with or without the patch
    assert auto[1:] == ("on", "off")
    assert len(off[0]) == 8 and auto[0] == off[0]


def test_a_real_pool_with_the_patch_faked_present(tiny_model_path: Path,
                                                  clean_env: pytest.MonkeyPatch) -> None:
    # The plumbing end to end: shared forces flash attention on and switches the kernel on
    # (the unpatched kernel ignores the switch, so the tokens equal flash attention's).
    fake_patch(clean_env, True)
    clean_env.setenv(prefix_attn.ENV_MIN, "1")
    shared = decode(tiny_model_path, "auto")
    assert shared[1:] == ("on", "shared")
    assert prefix_attn.switched_on() is True
    plain = decode(tiny_model_path, "off", flash_attn="on")
    if prefix_attn.shared_prefix_attn_version() == 0:  # patched: its own exactness tests
        assert shared[0] == plain[0]


def test_the_patched_kernel_runs_for_auto_and_not_for_off(
        tiny_model_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    """With a patched llama.cpp loaded (e.g. LLAMA_CPP_LIB_PATH=native/build/patched-lib):
    auto takes the shared path (the kernel's hit counter grows), off does not, in one
    process in either order."""
    if not prefix_attn.shared_prefix_attn_available():
        pytest.skip("this llama.cpp has no shared-prefix attention patch")
    hits = prefix_attn._function(prefix_attn.llama_library(), "ggml_cpu_shared_prefix_attn_hits")
    assert hits is not None
    hits.restype = ctypes.c_int64
    clean_env.setenv(prefix_attn.ENV_MIN, "16")  # the tiny prefix is ~50 tokens
    for mode, taken in (("off", False), ("auto", True), ("off", False)):
        before = int(hits())
        _, flash, sharing = decode(tiny_model_path, mode)
        assert (sharing == "shared") is taken and flash == "on"
        assert (int(hits()) > before) is taken, mode
