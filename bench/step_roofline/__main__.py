"""The step roofline: where one mesh step's time goes against this machine's limits
(issue 44, item 1).

    .venv/bin/python -m bench.step_roofline            # SmolLM2-135M, N 1/8/32, P 1K/4K/8K
    .venv/bin/python -m bench.step_roofline --quick    # the tiny model, seconds

Writes a table to stdout, ``bench/step_roofline/results/step_roofline.json`` and a plot beside it
(``--quick``: under the temp folder, never over the committed result; or ``--out``).

**The machine's limits** come from micro-kernels compiled in the same run with the machine's
C compiler (``-O3 -march=native``), run on 1 thread and on every thread mesh uses, best of a
few tries: fp32 FMA (12 independent 8-wide chains), int8 dot products the way llama.cpp's
AVX2 quantized kernels do them (``maddubs`` u8×s8 → i16, ``madd`` → i32; AVX-VNNI ``dpbusd``
where the CPU has it; 1 multiply-add = 2 ops), bf16 dot products (``vdpbf16ps``; ``null``
where the CPU lacks them), and memory bandwidth over arrays 4× the last-level cache: a
triad ``a = b + s·c`` (STREAM's count, 12 bytes an element) and a plain read (what weights
and K/V are), plus a read of arrays that fit in the LLC (what freshly written logits are).

**The steps are mesh's own.** Each prefix P gets a real :class:`~mesh.engine.pool.SharedKVPool`
(its defaults: flash attention ``auto``, shared-prefix attention ``auto``, the native step
when built, weights as :class:`~mesh.engine.config.EngineConfig` loads them). N sessions
attach, each prefills S private tokens, then all N generate T greedy tokens in the same
steps (``held_steps(pool)``). The pool's counters give, per step: wall period, time inside
``llama_decode`` (``stats.decode_s``) and the native step's sampling (``sample_s``).

llama.cpp has no per-op timer in release builds. Its scheduler does call an *eval
callback* (``llama_context_params.cb_eval``) before each graph node, and computes the graph
in pieces where the callback asks to see a node. The bench compiles such a callback (the C
source below) and hands it to the pool's context by wrapping the bindings'
``llama_context_default_params`` while the pool is built (mesh exposes no hook for it):

* *light* mode asks only for the graph's last node (``result_output``): the graph runs as
  one piece, and the time from the first question to that answer is the **graph compute**
  of the step, at no cost to it;
* *per-op* mode (a few extra steps per point, not the timed ones) asks for every node, so
  each runs alone and is timed. A node that computes nothing (view, reshape, permute,
  transpose) then times the per-node dispatch; that median is taken off every node, and
  the parts are scaled to the light-mode compute (``profile_scale`` in the JSON says by
  how much; near 1 means the profile adds little).

**The parts of a decode step** (per step, ``ms``):

* ``weights``: matrix products whose first operand is a model weight (the 7 per layer and
  the output layer), from the per-op profile;
* ``attention``: ``FLASH_ATTN_EXT`` (or, without flash attention, the K·Q and V·softmax
  products and the softmax), from the per-op profile, split by differencing on the real
  engine: the graph compute at fixed N is a line over P (``P0`` = a short prefix, then the
  grid), and its slope is the prefix's cost per cell, so ``prefix_attn = slope · P``
  (clamped to the attention measured) and ``suffix_attn`` = attention − prefix_attn (the
  rows' own cells, the other rows' masked cells and the op's fixed cost). A longer suffix at
  ``P0`` (``probe``) gives the marginal cost of one private cell per row, as a check;
* ``other_ops``: every other node (norms, RoPE, SwiGLU, residual adds, the K/V store, the
  embedding lookup);
* ``sampling``: the native step's sampling inside the step (greedy: argmax per row);
* ``host_llama``: ``llama_decode`` minus the graph compute (building or reusing the graph,
  scheduling, inputs, copying the logits out);
* ``host_mesh``: the step's wall period minus ``llama_decode`` and sampling (planning,
  filling the batch, stop strings, the engine loop and posting to the consumers).

**Sampling and grammar on their own**, on the real logits rows of the last step of the
largest point: numpy argmax (the Python step's greedy), the native step's argmax, a
llama.cpp chain (top-k 40, top-p 0.95, temperature 0.8), and mesh's worker turn grammar
(``mesh.worker.grammar.turn_grammar``, JSON tool calls) checking each greedy draw, redrawing
where it rejects one — per token; its parse once per turn.

**Prefill** (the prefix decoded once when a pool starts, ``prefill_chunk`` tokens a call):
per chunk the wall (the pool's progress callback) and the graph compute (light mode). The
chunk's compute is a line over its start position p: the intercept is the work every chunk
does (weights, other ops, attention within the chunk), split by a per-op profile of the
first chunk; the slope is attention over the cells before the chunk. Host = wall − compute.

**Formulas** (model shape from the GGUF: L layers, d embedding, H heads, Hkv K/V heads of
dh, V vocabulary; ``W`` = elements of the 2-D weights in the blocks, ``Wout`` = d·V (the
tied embedding or ``output.weight``); ``B``, ``Bout`` their bytes as stored (quant types);
K/V f16, 2 bytes an element):

* weights, decode step of N rows: ``2·N·(W + Wout)`` ops (int8 multiply-adds after llama.cpp
  quantizes the activations), ``B + Bout`` bytes (each weight read once a step);
* weights, prefill chunk of C tokens (no logits asked): ``2·C·W`` ops, ``B`` bytes;
* attention of N rows over c cells each: ``4·N·c·L·H·dh`` FLOPs (q·k and p·v; fp32 FMA
  after llama.cpp converts K/V), ``4·c'·L·Hkv·dh`` bytes of K and V for c' distinct
  cells (read once). Prefix: c = c' = P. Suffix: c = each row's own cells
  (S + the mean generated), c' = N·c;
* prefill chunk at p: ``4·L·H·dh·C·(p + (C+1)/2)`` FLOPs (causal), K/V of ``p + C`` cells;
* sampling: ``4·N·V`` bytes of logits read.

Each part's **limit** is ``max(ops / peak ops, bytes / peak bandwidth)`` on every thread
mesh uses: weights against int8 dot products and the DRAM read; attention against fp32 FMA
and the DRAM read; sampling against the LLC read. ``x_limit`` = measured / limit (1.0: at the
limit). Host work has no roofline: it is reported as time and share of the step.

Also recorded: whether this llama.cpp was built with weight repacking (``REPACK`` in
``llama_print_system_info``), which buffer the weights load into with mesh's settings and
with llama.cpp's extra buffer types on (llama.cpp's load log: ``CPU`` or ``CPU_REPACK``),
one step timed each way (in a child process: a repacked path that uses an instruction the
CPU lacks would kill it), the flash-attention mode and shared-prefix attention each pool
resolved to, and the shared-prefix kernel's hit counter; plus the load average and the
busy processes, because on a shared machine the numbers are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import datetime
import hashlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.prefix_attention.__main__ import fit_line
from mesh.engine import llama as pa
from mesh.engine.config import EngineConfig, SamplingParams
from mesh.engine.interface import ModelError
from mesh.engine.llama import LlamaContext, LlamaModel, backend_init, ll
from mesh.engine.models import resolve_model
from mesh.engine.native import load as load_native
from mesh.engine.pool import SharedKVPool, held_steps
from mesh.engine.sampling import Sampler, make_sampler
from mesh.engine.session import PooledSession
from mesh.template.loader import ToolCallSyntax
from mesh.worker.grammar import TOOL_ARGS, turn_grammar

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = RESULTS / "step_roofline.json"
QUICK_OUT = Path(tempfile.gettempdir()) / "mesh-bench" / "step_roofline.json"
NOOP_OPS = frozenset({"NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"})
PARTS = ("weights", "prefix_attn", "suffix_attn", "other_ops", "sampling", "host_llama",
         "host_mesh")

# ---------------------------------------------------------------------------- native helper

C_SOURCE = r"""
/* step_roofline's helper: peak micro-kernels, and a ggml eval callback that times graph
   compute (whole graphs, or node by node). */
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include "ggml.h"

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* fp32 FMA: 12 independent 8-wide chains cover a 4-cycle latency on 2 pipes. */
typedef float v8f __attribute__((vector_size(32)));
#define FMA_CHAINS 12
static double fma_run(int64_t iters) {
    v8f acc[FMA_CHAINS];
    v8f m, a;
    for (int j = 0; j < 8; j++) { m[j] = 0.999999f; a[j] = 1e-6f; }
    for (int i = 0; i < FMA_CHAINS; i++) for (int j = 0; j < 8; j++) acc[i][j] = (float)(i + j);
    for (int64_t it = 0; it < iters; it++)
        for (int i = 0; i < FMA_CHAINS; i++) acc[i] = acc[i] * m + a;
    float s = 0;
    for (int i = 0; i < FMA_CHAINS; i++) for (int j = 0; j < 8; j++) s += acc[i][j];
    return (double)s;
}

/* int8 dot products as llama.cpp's AVX2 kernels do them (32 multiply-adds per 256-bit
   maddubs+madd pair; dpbusd with AVX-VNNI). The empty asm makes an operand look new each
   pass, so nothing is hoisted out of the loop. */
#define I8_CHAINS 4
static double i8_run(int64_t iters) {
#if defined(__AVX2__)
    __m256i acc[I8_CHAINS], va[I8_CHAINS];
    __m256i vb = _mm256_set1_epi8(3);
#if !defined(__AVXVNNI__)
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    for (int i = 0; i < I8_CHAINS; i++) {
        acc[i] = _mm256_setzero_si256();
        va[i] = _mm256_set1_epi8((char)(i + 1));
    }
    for (int64_t it = 0; it < iters; it++) {
        __asm__ volatile("" : "+x"(vb));
        for (int i = 0; i < I8_CHAINS; i++) {
#if defined(__AVXVNNI__)
            acc[i] = _mm256_dpbusd_avx_epi32(acc[i], va[i], vb);
#else
            __m256i prod = _mm256_maddubs_epi16(va[i], vb);
            acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(prod, ones));
#endif
        }
    }
    int32_t out[8];
    __m256i s = acc[0];
    for (int i = 1; i < I8_CHAINS; i++) s = _mm256_add_epi32(s, acc[i]);
    _mm256_storeu_si256((__m256i *)out, s);
    return (double)out[0];
#else
    (void)iters;
    return -1.0;
#endif
}

/* bf16 dot products: AVX512-BF16 vdpbf16ps, 16 lanes x 2 pairs per op. */
#define BF_CHAINS 8
static double bf16_run(int64_t iters) {
#if defined(__AVX512BF16__)
    __m512 acc[BF_CHAINS];
    __m512bh va[BF_CHAINS];
    __m512bh vb = (__m512bh)_mm512_set1_epi16(0x3f80);
    for (int i = 0; i < BF_CHAINS; i++) {
        acc[i] = _mm512_setzero_ps();
        va[i] = (__m512bh)_mm512_set1_epi16((short)(0x3f80 + i));
    }
    for (int64_t it = 0; it < iters; it++) {
        __asm__ volatile("" : "+v"(vb));
        for (int i = 0; i < BF_CHAINS; i++) acc[i] = _mm512_dpbf16_ps(acc[i], va[i], vb);
    }
    float out[16];
    __m512 s = acc[0];
    for (int i = 1; i < BF_CHAINS; i++) s = _mm512_add_ps(s, acc[i]);
    _mm512_storeu_ps(out, s);
    return (double)out[0];
#else
    (void)iters;
    return -1.0;
#endif
}

int mesh_rl_features(void) {
    int f = 0;
#if defined(__AVX2__)
    f |= 1;
#endif
#if defined(__AVXVNNI__)
    f |= 2;
#endif
#if defined(__AVX512BF16__)
    f |= 4;
#endif
    return f;
}

typedef struct {
    int kind; /* 0 fma, 1 int8, 2 bf16, 3 triad, 4 read */
    int64_t iters, n;
    int reps;
    float *a, *b, *c;
    double sink;
    pthread_barrier_t *bar;
    int64_t t0, t1;
} job_t;

static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    pthread_barrier_wait(j->bar);
    j->t0 = now_ns();
    if (j->kind == 0) j->sink = fma_run(j->iters);
    else if (j->kind == 1) j->sink = i8_run(j->iters);
    else if (j->kind == 2) j->sink = bf16_run(j->iters);
    else if (j->kind == 3) {
        for (int r = 0; r < j->reps; r++) {
            const float s = 1.0001f;
            for (int64_t i = 0; i < j->n; i++) j->a[i] = j->b[i] + s * j->c[i];
            __asm__ volatile("" ::: "memory");
        }
        j->sink = j->a[j->n / 2];
    } else {
        double tot = 0;
        for (int r = 0; r < j->reps; r++) {
            v8f s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
            const v8f *p = (const v8f *)j->b;
            for (int64_t i = 0; i + 3 < j->n / 8; i += 4) {
                s0 += p[i]; s1 += p[i + 1]; s2 += p[i + 2]; s3 += p[i + 3];
            }
            v8f s = s0 + s1 + s2 + s3;
            for (int k = 0; k < 8; k++) tot += s[k];
            __asm__ volatile("" ::: "memory");
        }
        j->sink = tot;
    }
    j->t1 = now_ns();
    return NULL;
}

/* `kind` on `threads` threads at once; wall seconds from the first start to the last end
   (-1: failed). Stream kinds: `n` floats per thread and array, `reps` passes. */
double mesh_rl_run(int kind, int threads, int64_t iters, int64_t n, int reps) {
    pthread_t th[256];
    job_t jobs[256];
    pthread_barrier_t bar;
    if (threads < 1 || threads > 256) return -1.0;
    pthread_barrier_init(&bar, NULL, (unsigned)threads);
    int ok = 1;
    for (int t = 0; t < threads; t++) {
        memset(&jobs[t], 0, sizeof jobs[t]);
        jobs[t].kind = kind; jobs[t].iters = iters; jobs[t].n = n; jobs[t].reps = reps;
        jobs[t].bar = &bar;
        if (kind >= 3) {
            size_t bytes = ((size_t)n * sizeof(float) + 63) / 64 * 64;
            jobs[t].a = aligned_alloc(64, bytes);
            jobs[t].b = aligned_alloc(64, bytes);
            jobs[t].c = aligned_alloc(64, bytes);
            if (!jobs[t].a || !jobs[t].b || !jobs[t].c) { ok = 0; continue; }
            for (int64_t i = 0; i < n; i++) {
                jobs[t].a[i] = 0.0f; jobs[t].b[i] = 1.0f; jobs[t].c[i] = 2.0f;
            }
        }
    }
    int64_t lo = INT64_MAX, hi = 0;
    if (ok) {
        for (int t = 0; t < threads; t++) pthread_create(&th[t], NULL, worker, &jobs[t]);
        for (int t = 0; t < threads; t++) {
            pthread_join(th[t], NULL);
            if (jobs[t].t0 < lo) lo = jobs[t].t0;
            if (jobs[t].t1 > hi) hi = jobs[t].t1;
        }
    }
    for (int t = 0; t < threads; t++) { free(jobs[t].a); free(jobs[t].b); free(jobs[t].c); }
    pthread_barrier_destroy(&bar);
    return ok ? (double)(hi - lo) * 1e-9 : -1.0;
}

/* The eval callback. Light mode answers "yes" only for result_output (the graph's last
   node): the graph runs as one piece, timed from the first question to that answer.
   Per-op mode answers "yes" for every node of the next `graphs` graphs: each node runs
   alone and is timed. Engine thread only (llama_decode's caller); read between steps. */
typedef struct {
    int64_t ns, graph;
    int64_t ne[4], s0ne[4], s1ne[4];
    int64_t s0bytes, s1bytes;
    char op[24];
    char name[64];
    char src0[64];
} mesh_rl_rec;

static mesh_rl_rec *g_recs;
static int64_t g_cap, g_n, g_perop_left;
static int g_open, g_cur_perop;
static int64_t g_t_graph, g_t_ask, g_graphs, g_compute_ns, g_nodes;
#define SPANS 16384
static int64_t g_spans[SPANS];

static int is_last(const struct ggml_tensor *t) { return strcmp(t->name, "result_output") == 0; }

bool mesh_rl_eval_cb(struct ggml_tensor *t, bool ask, void *user_data) {
    (void)user_data;
    int64_t now = now_ns();
    if (ask) {
        if (!g_open) {
            g_open = 1;
            g_t_graph = now;
            g_cur_perop = g_perop_left > 0;
            if (g_cur_perop) g_perop_left--;
        }
        g_nodes++;
        g_t_ask = now;
        return g_cur_perop || is_last(t);
    }
    if (g_cur_perop && g_n < g_cap) {
        mesh_rl_rec *r = &g_recs[g_n++];
        memset(r, 0, sizeof *r);
        r->ns = now - g_t_ask;
        r->graph = g_graphs;
        for (int k = 0; k < 4; k++) r->ne[k] = t->ne[k];
        strncpy(r->op, ggml_op_desc(t), sizeof r->op - 1);
        strncpy(r->name, t->name, sizeof r->name - 1);
        if (t->src[0]) {
            for (int k = 0; k < 4; k++) r->s0ne[k] = t->src[0]->ne[k];
            r->s0bytes = (int64_t)ggml_nbytes(t->src[0]);
            strncpy(r->src0, t->src[0]->name, sizeof r->src0 - 1);
        }
        if (t->src[1]) {
            for (int k = 0; k < 4; k++) r->s1ne[k] = t->src[1]->ne[k];
            r->s1bytes = (int64_t)ggml_nbytes(t->src[1]);
        }
    }
    if (is_last(t)) {
        int64_t span = now - g_t_graph;
        g_spans[g_graphs % SPANS] = span;
        g_compute_ns += span;
        g_graphs++;
        g_open = 0;
    }
    return true;
}

int64_t mesh_rl_rec_size(void) { return (int64_t)sizeof(mesh_rl_rec); }

int mesh_rl_perop(int64_t graphs, int64_t cap) {
    free(g_recs);
    g_recs = NULL;
    g_n = g_cap = g_perop_left = 0;
    if (graphs > 0 && cap > 0) {
        g_recs = calloc((size_t)cap, sizeof(mesh_rl_rec));
        if (!g_recs) return -1;
        g_cap = cap;
        g_perop_left = graphs;
    }
    return 0;
}

const mesh_rl_rec *mesh_rl_records(int64_t *n) { *n = g_n; return g_recs; }
void mesh_rl_counters(int64_t *out3) {
    out3[0] = g_graphs; out3[1] = g_compute_ns; out3[2] = g_nodes;
}
int64_t mesh_rl_span(int64_t graph) {
    if (graph < 0 || graph >= g_graphs || g_graphs - graph > SPANS) return -1;
    return g_spans[graph % SPANS];
}
"""


class Record(ctypes.Structure):
    """One node of a per-op profile (``mesh_rl_rec`` above)."""

    _fields_ = [("ns", ctypes.c_int64), ("graph", ctypes.c_int64),
                ("ne", ctypes.c_int64 * 4), ("s0ne", ctypes.c_int64 * 4),
                ("s1ne", ctypes.c_int64 * 4), ("s0bytes", ctypes.c_int64),
                ("s1bytes", ctypes.c_int64), ("op", ctypes.c_char * 24),
                ("name", ctypes.c_char * 64), ("src0", ctypes.c_char * 64)]


def llama_lib_dir() -> Path:
    """The folder of the ``libllama`` (and ggml) this process loaded."""
    return Path(pa.llama_library()._name).resolve().parent


def build_helper(work: Path, cc: str | None = None) -> ctypes.CDLL:
    """Compile :data:`C_SOURCE` (cached by its hash and the compiler flags) and load it."""
    from native.build import llama_paths

    inc, _ = llama_paths()
    lib_dir = llama_lib_dir()
    compiler = cc or os.environ.get("CC") or "cc"
    flags = ["-O3", "-march=native", "-std=gnu11", "-fPIC", "-shared", "-pthread", "-Wall"]
    key = hashlib.sha256((C_SOURCE + " ".join(flags) + str(lib_dir)).encode()).hexdigest()[:16]
    target = work / f"step_roofline_{key}.so"
    if not target.is_file():
        work.mkdir(parents=True, exist_ok=True)
        src = work / f"step_roofline_{key}.c"
        src.write_text(C_SOURCE)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        cmd = [compiler, *flags, f"-I{inc}", str(src), "-o", str(tmp), f"-L{lib_dir}",
               "-lggml-base", f"-Wl,-rpath,{lib_dir}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling the roofline helper failed:\n{' '.join(cmd)}\n"
                               f"{proc.stderr}")
        os.replace(tmp, target)
    lib = ctypes.CDLL(str(target))
    lib.mesh_rl_run.restype = ctypes.c_double
    lib.mesh_rl_run.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                ctypes.c_int]
    lib.mesh_rl_features.restype = ctypes.c_int
    lib.mesh_rl_rec_size.restype = ctypes.c_int64
    lib.mesh_rl_perop.argtypes = [ctypes.c_int64, ctypes.c_int64]
    lib.mesh_rl_perop.restype = ctypes.c_int
    lib.mesh_rl_records.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.mesh_rl_records.restype = ctypes.POINTER(Record)
    lib.mesh_rl_counters.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    lib.mesh_rl_counters.restype = None
    lib.mesh_rl_span.argtypes = [ctypes.c_int64]
    lib.mesh_rl_span.restype = ctypes.c_int64
    if lib.mesh_rl_rec_size() != ctypes.sizeof(Record):
        raise RuntimeError("the helper's record layout differs from Record")
    return lib


class Profiler:
    """The helper's eval callback, handed to every llama.cpp context created inside
    :meth:`installed` (the pool's included), and its counters."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        addr = ctypes.cast(lib.mesh_rl_eval_cb, ctypes.c_void_p).value or 0
        self._cb = ll.ggml_backend_sched_eval_callback(addr)  # kept alive with the profiler

    def installed(self) -> _Installed:
        return _Installed(self)

    def counters(self) -> tuple[int, int]:
        """(graphs computed, their summed compute ns) since the process started."""
        out = (ctypes.c_int64 * 3)()
        self.lib.mesh_rl_counters(out)
        return int(out[0]), int(out[1])

    def span_ms(self, graph: int) -> float | None:
        ns = int(self.lib.mesh_rl_span(graph))
        return None if ns < 0 else ns / 1e6

    def per_op(self, graphs: int, cap: int = 200_000) -> None:
        """Time every node of the next ``graphs`` graphs (engine thread, between steps)."""
        if self.lib.mesh_rl_perop(graphs, cap) != 0:
            raise MemoryError("the roofline helper could not allocate its records")

    def records(self) -> list[dict[str, Any]]:
        n = ctypes.c_int64(0)
        ptr = self.lib.mesh_rl_records(ctypes.byref(n))
        out = []
        for i in range(n.value):
            r = ptr[i]
            out.append({"ns": int(r.ns), "graph": int(r.graph), "op": r.op.decode(),
                        "name": r.name.decode(errors="replace"),
                        "src0": r.src0.decode(errors="replace"), "ne": list(r.ne),
                        "s0ne": list(r.s0ne), "s1ne": list(r.s1ne),
                        "s0bytes": int(r.s0bytes), "s1bytes": int(r.s1bytes)})
        self.lib.mesh_rl_perop(0, 0)
        return out


class _Installed:
    """While entered, llama.cpp contexts get the profiler's callback: the bindings'
    ``llama_context_default_params`` (which :class:`~mesh.engine.llama.LlamaContext`
    calls) is wrapped to set ``cb_eval``."""

    def __init__(self, prof: Profiler) -> None:
        self._prof = prof
        self._orig: Callable[[], Any] | None = None

    def __enter__(self) -> None:
        orig = ll.llama_context_default_params
        cb = self._prof._cb

        def with_callback() -> Any:
            params = orig()
            params.cb_eval = cb
            params.cb_eval_user_data = None
            return params

        self._orig = orig
        ll.llama_context_default_params = with_callback

    def __exit__(self, *exc: object) -> None:
        if self._orig is not None:
            ll.llama_context_default_params = self._orig


# ---------------------------------------------------------------------------- peaks


def llc_bytes() -> int:
    """The last-level cache (sysfs; 32 MiB when unknown)."""
    best = 0
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (idx / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        best = max(best, int(text.rstrip("KMG")) * mult)
    return best or 32 << 20


def measure_peaks(lib: ctypes.CDLL, threads: int, *, seconds: float = 0.25,
                  tries: int = 3, stream_bytes: int | None = None) -> dict[str, Any]:
    """Best-of-``tries`` throughput of each micro-kernel on 1 thread and ``threads``.

    Compute kernels run ~``seconds`` each (calibrated from a short run); streams pass over
    ``stream_bytes`` per array (default 4x the LLC; per thread: divided among them), and the
    LLC read over a quarter of the LLC."""
    feats = int(lib.mesh_rl_features())
    llc = llc_bytes()
    stream = stream_bytes or 4 * llc
    # ops per loop pass: fma 12 chains x 8 lanes x 2; int8 4 x 32 MACs x 2; bf16 8 x 32 x 2
    per_iter = {0: 12 * 8 * 2, 1: 4 * 32 * 2, 2: 8 * 32 * 2}

    def compute(kind: int, th: int) -> float | None:
        if (kind == 1 and not feats & 1) or (kind == 2 and not feats & 4):
            return None
        probe = 1_000_000
        dt = lib.mesh_rl_run(kind, 1, probe, 0, 0)
        iters = max(int(probe * seconds / max(dt, 1e-6)), probe)
        best = 0.0
        for _ in range(tries):
            dt = lib.mesh_rl_run(kind, th, iters, 0, 0)
            if dt > 0:
                best = max(best, per_iter[kind] * iters * th / dt)
        return best / 1e9

    def bandwidth(kind: int, th: int, total: int, reps: int) -> float:
        n = max(total // 4 // th // 64 * 64, 1024)
        best = 0.0
        for _ in range(tries):
            dt = lib.mesh_rl_run(kind, th, 0, n, reps)
            if dt > 0:
                moved = (12 if kind == 3 else 4) * n * reps * th
                best = max(best, moved / dt)
        return best / 1e9

    out: dict[str, Any] = {"threads": threads, "llc_bytes": llc, "stream_bytes": stream,
                           "has_avx2_int8": bool(feats & 1), "has_avx_vnni": bool(feats & 2),
                           "has_avx512_bf16": bool(feats & 4)}
    for label, th in (("core", 1), ("all", threads)):
        out[f"fma_gflops_{label}"] = compute(0, th)
        out[f"int8_gops_{label}"] = compute(1, th)
        out[f"bf16_gflops_{label}"] = compute(2, th)
        out[f"triad_gbs_{label}"] = bandwidth(3, th, stream, 2)
        out[f"read_gbs_{label}"] = bandwidth(4, th, stream, 2)
        out[f"llc_read_gbs_{label}"] = bandwidth(4, th, llc // 4, 64)
    return out


# ---------------------------------------------------------------------------- the model


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the formulas need of a model (GGUF metadata and tensor table)."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    block_weights: int  # W: elements of the blocks' 2-D weights
    block_bytes: int  # B
    out_weights: int  # Wout = n_embd * n_vocab
    out_bytes: int  # Bout
    tied_output: bool
    types: dict[str, int]  # bytes by quant type

    def kv_bytes_per_cell(self, elem_bytes: float = 2.0) -> float:
        return 2 * self.n_layer * self.n_head_kv * self.head_dim * elem_bytes


def read_shape(path: Path, model: LlamaModel) -> Shape:
    """The model's shape: scalars from llama.cpp's view of the metadata, the weights from
    the GGUF tensor table (``gguf`` package)."""
    from gguf import GGMLQuantizationType, GGUFReader

    arch = model.meta("general.architecture") or "llama"

    def num(key: str, default: int | None = None) -> int:
        value = model.meta(f"{arch}.{key}")
        if value is None:
            if default is None:
                raise ValueError(f"{path.name} has no {arch}.{key}")
            return default
        return int(float(value))

    n_embd, n_head = num("embedding_length"), num("attention.head_count")
    reader = GGUFReader(str(path))
    block_w = block_b = out_w = out_b = 0
    embd_w = embd_b = 0
    types: dict[str, int] = {}
    has_output = False
    for t in reader.tensors:
        name = t.name
        qtype = GGMLQuantizationType(int(t.tensor_type)).name
        types[qtype] = types.get(qtype, 0) + int(t.n_bytes)
        if name.startswith("blk.") and len([d for d in t.shape if d > 1]) == 2:
            block_w += int(t.n_elements)
            block_b += int(t.n_bytes)
        elif name == "output.weight":
            out_w, out_b, has_output = int(t.n_elements), int(t.n_bytes), True
        elif name == "token_embd.weight":
            embd_w, embd_b = int(t.n_elements), int(t.n_bytes)
    if not has_output:
        out_w, out_b = embd_w, embd_b
    return Shape(arch=arch, n_layer=num("block_count"), n_embd=n_embd, n_head=n_head,
                 n_head_kv=num("attention.head_count_kv", n_head),
                 head_dim=num("attention.key_length", n_embd // n_head),
                 n_ff=num("feed_forward_length"), n_vocab=model.n_vocab,
                 block_weights=block_w, block_bytes=block_b, out_weights=out_w,
                 out_bytes=out_b, tied_output=not has_output, types=types)


# ---------------------------------------------------------------------------- formulas


def weights_work(shape: Shape, rows: int, *, output_rows: int | None = None) -> tuple[float, float]:
    """(ops, bytes) of the weight products for ``rows`` tokens, ``output_rows`` of which ask
    for logits (default: all): ``2·rows·W + 2·output_rows·Wout``; each weight read once."""
    out = rows if output_rows is None else output_rows
    ops = 2.0 * rows * shape.block_weights + 2.0 * out * shape.out_weights
    return ops, float(shape.block_bytes + (shape.out_bytes if out else 0))


def attention_work(shape: Shape, rows: int, cells: float, distinct: float,
                   elem_bytes: float = 2.0) -> tuple[float, float]:
    """(FLOPs, bytes) of ``rows`` queries over ``cells`` cells each, ``distinct`` cells read
    once: ``4·rows·cells·L·H·dh`` and ``distinct`` × the K/V bytes of a cell."""
    flops = 4.0 * rows * cells * shape.n_layer * shape.n_head * shape.head_dim
    return flops, distinct * shape.kv_bytes_per_cell(elem_bytes)


def prefill_attention_work(shape: Shape, start: int, chunk: int) -> tuple[float, float]:
    """(FLOPs, bytes) of a causal chunk of ``chunk`` tokens after ``start`` cells."""
    flops = 4.0 * shape.n_layer * shape.n_head * shape.head_dim * chunk * (start + (chunk + 1) / 2)
    return flops, (start + chunk) * shape.kv_bytes_per_cell()


def limit_ms(ops: float, nbytes: float, peak_ops: float | None,
             peak_bw: float | None) -> tuple[float | None, str]:
    """The roofline time ``max(ops/peak_ops, bytes/peak_bw)`` in ms (peaks in G/s) and which
    bound it is ("compute" or "memory"); (None, "") without peaks."""
    t_ops = ops / (peak_ops * 1e9) if peak_ops else 0.0
    t_bw = nbytes / (peak_bw * 1e9) if peak_bw else 0.0
    if not t_ops and not t_bw:
        return None, ""
    return 1e3 * max(t_ops, t_bw), "compute" if t_ops >= t_bw else "memory"


def rated(ms: float, ops: float, nbytes: float, peak_ops: float | None,
          peak_bw: float | None) -> dict[str, Any]:
    """One part with its work, achieved rates, limit and distance from it."""
    lim, bound = limit_ms(ops, nbytes, peak_ops, peak_bw)
    sec = ms / 1e3
    return {"ms": ms, "gops": ops / 1e9, "gbytes": nbytes / 1e9,
            "achieved_gops_s": ops / sec / 1e9 if sec > 0 else None,
            "achieved_gb_s": nbytes / sec / 1e9 if sec > 0 else None,
            "peak_gops_s": peak_ops, "peak_gb_s": peak_bw, "limit_ms": lim, "bound": bound,
            "x_limit": ms / lim if lim and ms > 0 else None}


# ---------------------------------------------------------------------------- per-op profile


def classify(rec: dict[str, Any]) -> str:
    """weights, attention, other or noop, by the node's op and first operand."""
    op = rec["op"]
    if op in NOOP_OPS:
        return "noop"
    if op in ("MUL_MAT", "MUL_MAT_ID"):
        return "weights" if rec["src0"].endswith(".weight") else "attention"
    if op in ("FLASH_ATTN_EXT", "SOFT_MAX"):
        return "attention"
    return "other"


def profile_parts(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-graph mean ms of weights, attention and other nodes, each node less the median
    no-op node (the per-node dispatch the profile adds), and what the weights' shapes say
    they computed (ops, bytes) — a check of :func:`weights_work`."""
    if not records:
        return {"graphs": 0}
    noop = [r["ns"] for r in records if classify(r) == "noop"]
    overhead = statistics.median(noop) if noop else 0.0
    graphs = len({r["graph"] for r in records})
    sums = {"weights": 0.0, "attention": 0.0, "other": 0.0}
    raw = 0.0
    w_ops = w_bytes = 0.0
    by_op: dict[str, float] = {}
    for r in records:
        kind = classify(r)
        raw += r["ns"]
        if kind == "noop":
            continue
        ns = max(r["ns"] - overhead, 0.0)
        sums[kind] += ns
        by_op[r["op"]] = by_op.get(r["op"], 0.0) + ns
        if kind == "weights":
            rows = r["s1ne"][1] * r["s1ne"][2] * r["s1ne"][3]
            w_ops += 2.0 * r["s0ne"][0] * r["s0ne"][1] * rows
            w_bytes += r["s0bytes"]
    return {"graphs": graphs, "nodes": len(records) // max(graphs, 1),
            "node_overhead_us": overhead / 1e3, "raw_ms": raw / graphs / 1e6,
            **{f"{k}_ms": v / graphs / 1e6 for k, v in sums.items()},
            "by_op_ms": {k: v / graphs / 1e6 for k, v in sorted(by_op.items())},
            "weights_gops": w_ops / graphs / 1e9, "weights_gbytes": w_bytes / graphs / 1e9}


def scaled(profile: dict[str, Any], compute_ms: float) -> dict[str, float]:
    """The profile's weights/attention/other, scaled to sum to the unprofiled compute."""
    parts = {k: profile.get(f"{k}_ms", 0.0) for k in ("weights", "attention", "other")}
    total = sum(parts.values())
    if total <= 0:
        return {**{k: 0.0 for k in parts}, "scale": 0.0}
    f = compute_ms / total
    return {**{k: v * f for k, v in parts.items()}, "scale": f}


# ---------------------------------------------------------------------------- the machine


def busy_processes(window_s: float = 1.0, min_pct: float = 10.0) -> dict[str, Any]:
    """The load average and the processes (not this one) using at least ``min_pct`` of a core
    over ``window_s`` (from /proc; empty where there is none)."""

    def ticks() -> dict[int, tuple[str, int]]:
        out = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                text = stat.read_text()
            except OSError:
                continue
            name = text[text.index("(") + 1:text.rindex(")")]
            fields = text[text.rindex(")") + 2:].split()
            out[int(stat.parent.name)] = (name, int(fields[11]) + int(fields[12]))
        return out

    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    if not Path("/proc/self/stat").is_file():
        return {"loadavg": list(load), "busy": []}
    hz = os.sysconf("SC_CLK_TCK")
    a = ticks()
    time.sleep(window_s)
    b = ticks()
    busy = []
    for pid, (name, t1) in b.items():
        if pid == os.getpid() or pid not in a:
            continue
        pct = 100.0 * (t1 - a[pid][1]) / hz / window_s
        if pct >= min_pct:
            busy.append({"pid": pid, "name": name, "cpu_pct": round(pct)})
    return {"loadavg": [round(x, 2) for x in load],
            "busy": sorted(busy, key=lambda p: -p["cpu_pct"])}


def system_info() -> str:
    backend_init()
    return bytes(ll.llama_print_system_info() or b"").decode(errors="replace").strip()


def shared_prefix_hits() -> int | None:
    """The shared-prefix kernel's count of ops that took its path (None: not exported)."""
    fn = None
    libs = [pa.llama_library()]
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 0)
    for path in sorted(llama_lib_dir().glob("libggml-cpu*.so*")):
        try:
            libs.append(ctypes.CDLL(str(path), mode=mode))
        except OSError:
            continue
    for lib in libs:
        fn = getattr(lib, "ggml_cpu_shared_prefix_attn_hits", None)
        if fn is not None:
            break
    if fn is None:
        return None
    fn.argtypes = []
    fn.restype = ctypes.c_int64
    return int(fn())


# ---------------------------------------------------------------------------- repacking


_LOG_LINES: list[str] = []


def _log_line(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    _LOG_LINES.append(text.decode(errors="replace"))


_LOG_CB = ll.llama_log_callback(_log_line)


def repack_probe(path: Path, threads: int, prefix: int, rows: int, steps: int) -> dict[str, Any]:
    """In this (child) process: load the model as mesh does (``extra_buffers`` off) and with
    llama.cpp's extra buffer types on; per load, the weight buffers llama.cpp names in its
    log and the median decode step of ``rows`` rows after a shared ``prefix``."""
    backend_init()
    ll.llama_log_set(_LOG_CB, ctypes.c_void_p(0))
    out: dict[str, Any] = {}
    rng = random.Random(1)
    for extra in (False, True):
        _LOG_LINES.clear()
        model = LlamaModel(path, extra_buffers=extra)
        buffers = sorted({ln.split(":", 1)[1].strip() for ln in _LOG_LINES
                          if "model buffer size" in ln and ":" in ln})
        ctx = LlamaContext(model, n_ctx=prefix + rows * (steps + 4) + 256, n_seq_max=rows + 1,
                           n_batch=512, n_outputs_max=rows + 1, n_threads=threads,
                           swa_full=True, flash_attn="on")
        from mesh.engine.llama import Batch

        batch = Batch(512)
        try:
            toks = [rng.randrange(16, model.n_vocab) for _ in range(prefix)]
            for i in range(0, prefix, 256):
                batch.clear()
                for j, tok in enumerate(toks[i:i + 256]):
                    batch.add(tok, i + j, 0, False)
                if ctx.decode(batch) != 0:
                    raise RuntimeError("prefix decode failed")
            for r in range(1, rows + 1):
                ctx.seq_copy(0, r)
            times = []
            for t in range(steps + 1):
                batch.clear()
                for r in range(rows):
                    batch.add(rng.randrange(16, model.n_vocab), prefix + t, r + 1, True)
                t0 = time.perf_counter()
                if ctx.decode(batch) != 0:
                    raise RuntimeError("decode step failed")
                if t:
                    times.append((time.perf_counter() - t0) * 1e3)
        finally:
            batch.close()
            ctx.close()
            model.close()
        out["extra_buffers" if extra else "mesh_default"] = {
            "weight_buffers": buffers, "step_ms": statistics.median(times),
            "repacked": any("REPACK" in b for b in buffers)}
    return out


def run_repack_probe(path: Path, threads: int, quick: bool) -> dict[str, Any]:
    """:func:`repack_probe` in a child process (a repacked path that uses an instruction the
    CPU lacks kills its process with SIGILL)."""
    args = [sys.executable, str(Path(__file__).resolve()), "--repack-probe", str(path),
            "--threads", str(threads)] + (["--quick"] if quick else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        why = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        return {"error": why, "stderr_tail": proc.stderr[-800:]}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# ---------------------------------------------------------------------------- the engine


@dataclasses.dataclass(frozen=True)
class Plan:
    """What to measure: the prefix grid (plus ``base_prefix``, the P → 0 point, where the
    suffix probe runs), decoding rows, private suffix, timed and profiled steps."""

    prefixes: tuple[int, ...]
    base_prefix: int
    rows: tuple[int, ...]
    suffix: int
    probe_suffix: int  # 0: no probe
    probe_rows: tuple[int, ...]
    steps: int
    profile_steps: int
    threads: int
    seed: int = 0

    @property
    def budget(self) -> int:
        """Each session's private cells: the longest suffix, the turns, a margin."""
        need = max(self.suffix, self.probe_suffix) + 1 + self.steps + self.profile_steps + 8
        return max(16, -(-need // 16) * 16)

    @property
    def max_rows(self) -> int:
        return max((*self.rows, *self.probe_rows))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, stop_at_eos=False)


async def run_turns(sessions: Sequence[PooledSession], pool: SharedKVPool, n: int) -> float:
    """One greedy turn of ``n`` tokens per session, all started in the same step; wall s."""
    gens = [s.generate(greedy(n)) for s in sessions]
    async with held_steps(pool):
        for g in gens:
            await g.start()
        t0 = time.perf_counter()

    async def drain(g: Any) -> None:
        async for _ in g:
            pass

    await asyncio.gather(*(drain(g) for g in gens))
    return time.perf_counter() - t0


class Engine:
    """One pool (one prefix) with the profiler's callback in its context."""

    def __init__(self, pool: SharedKVPool, prof: Profiler, plan: Plan) -> None:
        self.pool = pool
        self.prof = prof
        self.plan = plan

    def _counters(self) -> dict[str, float]:
        st = self.pool.stats
        stepper = self.pool.parts.runner.stepper
        graphs, ns = self.prof.counters()
        return {"steps": st.num_steps, "decode_s": st.decode_s, "host_s": st.host_s,
                "sample_s": stepper.sample_s if stepper is not None else float("nan"),
                "graphs": graphs, "compute_ns": ns, "hits": shared_prefix_hits() or 0}

    async def counters(self) -> dict[str, float]:
        return await self.pool.call(self._counters)

    async def point(self, rows: int, suffix: int, rng: random.Random,
                    keep_logits: bool = False) -> dict[str, Any]:
        """``rows`` sessions with ``suffix`` private tokens each: timed steps, then profiled
        ones (and the last step's logits rows when ``keep_logits``)."""
        pool, plan = self.pool, self.plan
        vocab = pool.info.n_vocab
        sessions = [await pool.attach() for _ in range(rows)]
        try:
            for s in sessions:
                s.append_tokens([rng.randrange(16, vocab) for _ in range(suffix)])
            await run_turns(sessions, pool, 1)  # prefill the suffixes (not timed)
            c0 = await self.counters()
            wall = await run_turns(sessions, pool, plan.steps)
            c1 = await self.counters()
            await pool.call(lambda: self.prof.per_op(plan.profile_steps))
            await run_turns(sessions, pool, plan.profile_steps)
            records = await pool.call(self.prof.records)
            logits = None
            if keep_logits:
                ctx = pool.parts.built.ctx
                logits = await pool.call(
                    lambda: np.array([ctx.logits_row(i) for i in range(rows)]))
        finally:
            for s in sessions:
                await s.detach()
        d = {k: c1[k] - c0[k] for k in c0}
        steps = max(int(d["steps"]), 1)
        graphs = max(int(d["graphs"]), 1)
        sample = d["sample_s"]
        point: dict[str, Any] = {
            "prefix": pool.info.prefix_tokens, "rows": rows, "suffix": suffix,
            "own_cells": suffix + 1 + (plan.steps - 1) / 2,  # mean private cells a row reads
            "steps": int(d["steps"]), "graphs": int(d["graphs"]),
            "period_ms": 1e3 * wall / steps,
            "step_ms": 1e3 * (d["decode_s"] + d["host_s"]) / steps,
            "decode_ms": 1e3 * d["decode_s"] / steps,
            "compute_ms": d["compute_ns"] / graphs / 1e6,
            "sample_ms": None if sample != sample else 1e3 * sample / steps,
            "shared_prefix_hits": int(d["hits"]),
            "profile": profile_parts(records),
        }
        if logits is not None:
            point["_logits"] = logits
        return point


async def open_engine(path: Path, prefix: list[int], prof: Profiler, plan: Plan,
                      extra: dict[str, Any] | None = None) -> tuple[Engine, dict[str, Any]]:
    """Build a pool for ``prefix`` (its prefill timed chunk by chunk, the second chunk
    profiled per op) and return it with the prefill record."""
    cfg = EngineConfig(model_path=str(path), max_sessions=plan.max_rows,
                       session_budget=plan.budget, n_threads=plan.threads, cache_dir=None,
                       seed=plan.seed, **(extra or {}))
    marks: list[tuple[float, int, int]] = []  # (time, tokens done, graphs so far)

    def progress(done: int, total: int) -> None:
        marks.append((time.perf_counter(), done, prof.counters()[0]))
        if len(marks) == 1 and done < total:
            prof.per_op(1)  # the next chunk (this runs on the thread that decodes)

    g0 = prof.counters()[0]
    pool = SharedKVPool(cfg, prefix)
    t0 = time.perf_counter()
    with prof.installed():
        info = await pool.start(progress)
    start_s = time.perf_counter() - t0
    records = prof.records()
    chunks = []
    prev_t, prev_done, prev_g = None, 0, g0
    for i, (t, done, g) in enumerate(marks):
        spans = [prof.span_ms(x) for x in range(prev_g, g)]
        chunks.append({"start": prev_done, "tokens": done - prev_done,
                       "wall_ms": None if prev_t is None else 1e3 * (t - prev_t),
                       "compute_ms": sum(s for s in spans if s is not None) if spans else None,
                       "graphs": g - prev_g, "profiled": i == 1})
        prev_t, prev_done, prev_g = t, done, g
    prefill = {"prefix": len(prefix), "chunk": cfg.prefill_chunk, "start_s": start_s,
               "chunks": chunks, "profile": profile_parts(records),
               "flash_attn": info.flash_attn, "prefix_attention": info.prefix_attention,
               "native_step": pool.parts.runner.stepper is not None}
    return Engine(pool, prof, plan), prefill


async def measure_engine(path: Path, prof: Profiler, plan: Plan, n_ctx_train: int,
                         log: Callable[[str], None]) -> dict[str, Any]:
    """Every pool and point of ``plan``; returns points, prefills and the logits rows."""
    rng = random.Random(plan.seed)
    limit = n_ctx_train - plan.budget if n_ctx_train > 0 else None
    prefixes = sorted({min(p, limit) if limit else p for p in plan.prefixes})
    model_vocab = LlamaModel(path, vocab_only=True)
    vocab = model_vocab.n_vocab
    model_vocab.close()
    longest = [rng.randrange(16, vocab) for _ in range(max(prefixes))]
    points: list[dict[str, Any]] = []
    prefills: list[dict[str, Any]] = []
    logits = None
    for p in [plan.base_prefix, *prefixes]:
        engine, prefill = await open_engine(path, longest[:p], prof, plan)
        try:
            log(f"P={p}: pool started in {prefill['start_s']:.1f} s (flash attention "
                f"{prefill['flash_attn']}, prefix attention {prefill['prefix_attention']})")
            if p != plan.base_prefix:
                prefills.append(prefill)
            for n in plan.rows:
                keep = p == max(prefixes) and n == max(plan.rows)
                pt = await engine.point(n, plan.suffix, rng, keep_logits=keep)
                if keep:
                    logits = pt.pop("_logits")
                pt.update(flash_attn=prefill["flash_attn"],
                          prefix_attention=prefill["prefix_attention"])
                points.append(pt)
                log(f"P={p} N={n}: period {pt['period_ms']:.1f} ms, compute "
                    f"{pt['compute_ms']:.1f} ms")
            if p == plan.base_prefix and plan.probe_suffix:
                for n in plan.probe_rows:
                    pt = await engine.point(n, plan.probe_suffix, rng)
                    pt.update(flash_attn=prefill["flash_attn"],
                              prefix_attention=prefill["prefix_attention"], probe=True)
                    points.append(pt)
                    log(f"P={p} N={n} S={plan.probe_suffix} (probe): compute "
                        f"{pt['compute_ms']:.1f} ms")
        finally:
            await engine.pool.aclose()
    return {"points": points, "prefills": prefills, "logits": logits, "prefixes": prefixes}


# ---------------------------------------------------------------------------- sampling


class RowsView:
    """Logits rows held by the bench, as a sampler reads a context (``ContextView``)."""

    def __init__(self, rows: np.ndarray) -> None:
        self._rows = rows
        self.handle = None

    def logits_row(self, index: int) -> Any:
        return self._rows[index]


def measure_sampling(model: LlamaModel, rows: np.ndarray, reps: int) -> dict[str, Any]:
    """Per-row (per-token) cost of each way mesh samples, on real logits ``rows``."""
    n = len(rows)

    def per_row(fn: Callable[[int], Any]) -> float:
        t0 = time.perf_counter()
        for i in range(reps):
            fn(i % n)
        return 1e6 * (time.perf_counter() - t0) / reps

    out: dict[str, Any] = {"rows": n, "n_vocab": int(rows.shape[1])}
    out["argmax_numpy_us"] = per_row(lambda i: int(np.argmax(rows[i])))
    lib, _ = load_native()
    if lib is not None:
        ptrs = [rows[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float)) for i in range(n)]
        out["argmax_native_us"] = per_row(lambda i: lib.mesh_argmax(ptrs[i], rows.shape[1]))
    else:
        out["argmax_native_us"] = None
    chain = make_sampler(temperature=0.8, top_k=40, top_p=0.95, seed=0, model=model)
    assert isinstance(chain, Sampler)
    try:
        out["chain_topk_topp_temp_us"] = per_row(lambda i: chain.draw_row(rows[i]))
    finally:
        chain.close()
    grammar = turn_grammar(ToolCallSyntax(style="json"), list(TOOL_ARGS), 256)
    t0 = time.perf_counter()
    gram = Sampler(model, temperature=0.0, top_k=0, top_p=1.0, seed=0, grammar=grammar)
    out["grammar_init_ms"] = 1e3 * (time.perf_counter() - t0)
    view = RowsView(rows)
    tokens = min(reps, 64)
    try:
        t0 = time.perf_counter()
        for i in range(tokens):
            gram.constrain(view, i % n, int(np.argmax(rows[i % n])))
        out["grammar_check_us"] = 1e6 * (time.perf_counter() - t0) / tokens
        out["grammar_tokens"] = tokens
        out["grammar_redraws"] = gram.num_redraws
        out["grammar_full_redraws"] = gram.num_full_redraws
    finally:
        gram.close()
    return out


# ---------------------------------------------------------------------------- analysis


def _attention_ms(point: dict[str, Any]) -> float:
    return scaled(point["profile"], point["compute_ms"])["attention"]


def prefix_slopes(points: Sequence[dict[str, Any]], suffix: int) -> dict[int, dict[str, Any]]:
    """Per row count: the attention (per-op profile, scaled to the step's compute) as a line
    over the prefix, ms per prefix cell; the whole graph compute's line beside it as a
    check (the same slope where nothing else grows with P)."""
    out: dict[int, dict[str, Any]] = {}
    by: dict[int, list[dict[str, Any]]] = {}
    for p in points:
        if p["suffix"] == suffix and not p.get("probe"):
            by.setdefault(p["rows"], []).append(p)
    for rows, pts in sorted(by.items()):
        xs = [p["prefix"] for p in pts]
        b0, b1, r2 = fit_line(xs, [_attention_ms(p) for p in pts])
        _, c1, cr2 = fit_line(xs, [p["compute_ms"] for p in pts])
        out[rows] = {"intercept_ms": b0, "ms_per_cell": b1, "ms_per_1k": 1e3 * b1, "r2": r2,
                     "compute_ms_per_1k": 1e3 * c1, "compute_r2": cr2, "prefixes": xs}
    return out


def suffix_probes(points: Sequence[dict[str, Any]], suffix: int) -> dict[int, dict[str, float]]:
    """Per row count at the base prefix: the marginal attention of one private cell per
    row, from the base suffix and the probe (ms per row-cell)."""
    out = {}
    for probe in (p for p in points if p.get("probe")):
        base = [p for p in points if not p.get("probe") and p["rows"] == probe["rows"]
                and p["prefix"] == probe["prefix"] and p["suffix"] == suffix]
        if not base:
            continue
        extra = probe["rows"] * (probe["suffix"] - suffix)
        if extra > 0:
            per = (_attention_ms(probe) - _attention_ms(base[0])) / extra
            whole = (probe["compute_ms"] - base[0]["compute_ms"]) / extra
            out[probe["rows"]] = {"ms_per_row_cell": per, "us_per_row_cell": 1e3 * per,
                                  "compute_us_per_row_cell": 1e3 * whole,
                                  "long_suffix": probe["suffix"]}
    return out


def decode_parts(point: dict[str, Any], slope: dict[str, Any] | None, shape: Shape,
                 peaks: dict[str, Any], probe: dict[str, float] | None = None) -> dict[str, Any]:
    """The parts of one decode point (see the module docstring), each rated against its
    limit where it has one."""
    sc = scaled(point["profile"], point["compute_ms"])
    attention = sc["attention"]
    pre = slope["ms_per_cell"] * point["prefix"] if slope else 0.0
    pre = min(max(pre, 0.0), attention)
    suf = attention - pre
    sampling = point["sample_ms"] or 0.0
    host_llama = max(point["decode_ms"] - point["compute_ms"], 0.0)
    host_mesh = max(point["period_ms"] - point["decode_ms"] - sampling, 0.0)
    n, own = point["rows"], point["own_cells"]
    w_ops, w_bytes = weights_work(shape, n)
    pa_flops, pa_bytes = attention_work(shape, n, point["prefix"], point["prefix"])
    sa_flops, sa_bytes = attention_work(shape, n, own, n * own)
    dram, fma = peaks.get("read_gbs_all"), peaks.get("fma_gflops_all")
    parts = {
        "weights": rated(sc["weights"], w_ops, w_bytes, peaks.get("int8_gops_all"), dram),
        "prefix_attn": rated(pre, pa_flops, pa_bytes, fma, dram),
        "suffix_attn": rated(suf, sa_flops, sa_bytes, fma, dram),
        "other_ops": {"ms": sc["other"]},
        "sampling": rated(sampling, 0.0, 4.0 * n * shape.n_vocab, None,
                          peaks.get("llc_read_gbs_all")),
        "host_llama": {"ms": host_llama},
        "host_mesh": {"ms": host_mesh},
    }
    total = sum(p["ms"] for p in parts.values())
    for p in parts.values():
        p["share"] = p["ms"] / total if total > 0 else 0.0
    out = {"prefix": point["prefix"], "rows": n, "suffix": point["suffix"],
           "period_ms": point["period_ms"], "compute_ms": point["compute_ms"],
           "tok_s": 1e3 * n / point["period_ms"], "profile_scale": sc["scale"],
           "parts": parts}
    if probe:
        out["suffix_attn_probe_ms"] = probe["ms_per_row_cell"] * n * own
    limits = [p.get("limit_ms") or 0.0 for p in parts.values()]
    out["limit_ms"] = sum(limits)
    out["x_limit"] = point["period_ms"] / out["limit_ms"] if out["limit_ms"] else None
    return out


def prefill_parts(prefill: dict[str, Any], shape: Shape,
                  peaks: dict[str, Any]) -> dict[str, Any] | None:
    """The parts of building one prefix (see the module docstring); None when it was one
    chunk (nothing to fit)."""
    chunks = prefill["chunks"]
    size = prefill["chunk"]
    # The first chunk is the context's first graph (weights paged in, threads started):
    # measured, but left out of the line; the profiled chunk is replaced by the line.
    full = [c for c in chunks[1:] if c["tokens"] == size and not c["profiled"]
            and c["compute_ms"] is not None]
    if len(full) < 2:
        return None
    a, b, r2 = fit_line([c["start"] for c in full], [c["compute_ms"] for c in full])
    gaps = [c["wall_ms"] - c["compute_ms"] for c in chunks
            if c["wall_ms"] is not None and c["compute_ms"] is not None and not c["profiled"]]
    gap = statistics.median(gaps) if gaps else 0.0
    compute = wall = 0.0
    for c in chunks:
        fit = a + b * c["start"]
        cm = fit * c["tokens"] / size if c["profiled"] or c["compute_ms"] is None \
            else c["compute_ms"]
        compute += cm
        wall += c["wall_ms"] if c["wall_ms"] is not None and not c["profiled"] else cm + gap
    prof_chunk = next((c for c in chunks if c["profiled"]), None)
    sc = scaled(prefill["profile"], a + b * (prof_chunk["start"] if prof_chunk else 0))
    per_token_fixed = (sc["weights"] + sc["other"]) / size
    tokens = prefill["prefix"]
    weights = sc["weights"] / size * tokens
    other = sc["other"] / size * tokens
    attention = max(compute - per_token_fixed * tokens, 0.0)
    w_ops, w_bytes = weights_work(shape, tokens, output_rows=0)
    w_bytes *= len(chunks)  # the weights are read once per chunk
    at_flops = at_bytes = 0.0
    for c in chunks:
        f, by = prefill_attention_work(shape, c["start"], c["tokens"])
        at_flops += f
        at_bytes += by
    dram = peaks.get("read_gbs_all")
    parts = {
        "weights": rated(weights, w_ops, w_bytes, peaks.get("int8_gops_all"), dram),
        "attention": rated(attention, at_flops, at_bytes, peaks.get("fma_gflops_all"), dram),
        "other_ops": {"ms": other},
        "host": {"ms": max(wall - compute, 0.0)},
    }
    for p in parts.values():
        p["share"] = p["ms"] / wall if wall > 0 else 0.0
    first = chunks[0]["compute_ms"]
    return {"prefix": tokens, "chunk": size, "chunks": len(chunks), "wall_ms": wall,
            "first_chunk_extra_ms": None if first is None else first - a,
            "tok_s": 1e3 * tokens / wall if wall > 0 else None, "compute_ms": compute,
            "chunk_fit": {"intercept_ms": a, "ms_per_cell": b, "r2": r2},
            "start_s": prefill["start_s"], "profile_scale": sc["scale"], "parts": parts}


def farthest(decode: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per roofline part, the point where it is farthest from its limit, farthest first,
    with the time it costs there (a part far from its limit but tiny matters less)."""
    best: dict[str, dict[str, Any]] = {}
    for d in decode:
        for name, part in d["parts"].items():
            x = part.get("x_limit")
            if x is None:
                continue
            if name not in best or x > best[name]["x_limit"]:
                best[name] = {"part": name, "x_limit": x, "ms": part["ms"],
                              "share": part["share"], "prefix": d["prefix"], "rows": d["rows"]}
    return sorted(best.values(), key=lambda b: -b["x_limit"])


def analyse(run: dict[str, Any], shape: Shape, peaks: dict[str, Any], plan: Plan) -> dict[str, Any]:
    slopes = prefix_slopes(run["points"], plan.suffix)
    probes = suffix_probes(run["points"], plan.suffix)
    decode = [decode_parts(p, slopes.get(p["rows"]), shape, peaks, probes.get(p["rows"]))
              for p in run["points"] if not p.get("probe") and p["prefix"] != plan.base_prefix]
    prefill = [x for x in (prefill_parts(p, shape, peaks) for p in run["prefills"]) if x]
    return {"prefix_slopes": {str(k): v for k, v in slopes.items()},
            "suffix_probes": {str(k): v for k, v in probes.items()},
            "decode": decode, "prefill": prefill, "farthest": farthest(decode)}


# ---------------------------------------------------------------------------- reporting


def _x(part: dict[str, Any]) -> str:
    x = part.get("x_limit")
    return "   -" if x is None else f"{x:5.1f}x"


def _rate(value: float | None, width: int = 6) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.1f}"


def table(doc: dict[str, Any]) -> str:
    peaks, an = doc["peaks"], doc["analysis"]
    lines = ["machine limits (best of tries; 1 thread / all "
             f"{peaks['threads']} threads):",
             f"  fp32 FMA {_rate(peaks['fma_gflops_core'])} / {_rate(peaks['fma_gflops_all'])}"
             f" GFLOP/s   int8 dot {_rate(peaks['int8_gops_core'])} / "
             f"{_rate(peaks['int8_gops_all'])} GOP/s   bf16 dot "
             f"{_rate(peaks['bf16_gflops_core'])} / {_rate(peaks['bf16_gflops_all'])}",
             f"  DRAM read {_rate(peaks['read_gbs_core'])} / {_rate(peaks['read_gbs_all'])} "
             f"GB/s   triad {_rate(peaks['triad_gbs_core'])} / {_rate(peaks['triad_gbs_all'])}"
             f"   LLC read {_rate(peaks['llc_read_gbs_core'])} / "
             f"{_rate(peaks['llc_read_gbs_all'])}", ""]
    head = (f"{'P':>5} {'N':>3} {'step ms':>8} {'tok/s':>6} | {'weights':>8} {'pre-att':>8} "
            f"{'suf-att':>8} {'other':>7} {'sample':>7} {'llama':>7} {'mesh':>7}  (ms)")
    lines += ["decode step: where the time goes", head, "-" * len(head)]
    for d in an["decode"]:
        p = d["parts"]
        lines.append(f"{d['prefix']:>5} {d['rows']:>3} {d['period_ms']:>8.1f} "
                     f"{d['tok_s']:>6.1f} | " + " ".join(
                         f"{p[k]['ms']:>{8 if i < 3 else 7}.2f}" for i, k in enumerate(PARTS)))
    head = (f"{'P':>5} {'N':>3} | {'weights GOP/s':>13} {'GB/s':>5} {'x':>6} | "
            f"{'pre-att GFLOP/s':>15} {'x':>6} | {'suf-att GFLOP/s':>15} {'x':>6} | "
            f"{'sample GB/s':>11} {'x':>6} | {'step x':>6}")
    lines += ["", "decode step: achieved against the measured limit (x = time / limit)", head,
              "-" * len(head)]
    for d in an["decode"]:
        p = d["parts"]
        w, pr, su, sa = p["weights"], p["prefix_attn"], p["suffix_attn"], p["sampling"]
        lines.append(
            f"{d['prefix']:>5} {d['rows']:>3} | {_rate(w['achieved_gops_s'], 13)} "
            f"{_rate(w['achieved_gb_s'], 5)} {_x(w)} | {_rate(pr['achieved_gops_s'], 15)} "
            f"{_x(pr)} | {_rate(su['achieved_gops_s'], 15)} {_x(su)} | "
            f"{_rate(sa['achieved_gb_s'], 11)} {_x(sa)} | "
            f"{'-' if d['x_limit'] is None else format(d['x_limit'], '5.1f') + 'x':>6}")
    lines += ["", "prefix term (least squares over P): ms per 1K prefix cells"]
    for rows, s in an["prefix_slopes"].items():
        lines.append(f"  N={rows:>3}: attention {s['ms_per_1k']:8.3f} ms/1K "
                     f"(+{s['intercept_ms']:.2f} ms, r² {s['r2']:.3f}); whole graph "
                     f"{s['compute_ms_per_1k']:8.3f} ms/1K (r² {s['compute_r2']:.3f})")
    for rows, s in an["suffix_probes"].items():
        lines.append(f"  suffix probe N={rows:>3}: {s['us_per_row_cell']:.3f} µs per private "
                     f"cell per row (S {doc['plan']['suffix']} -> {s['long_suffix']})")
    head = (f"{'P':>5} {'tok/s':>6} {'wall s':>7} | {'weights ms':>10} {'GOP/s':>6} {'x':>6} | "
            f"{'attn ms':>8} {'GFLOP/s':>7} {'x':>6} | {'other':>7} {'host':>7}")
    lines += ["", "prefill (the prefix decoded once, by chunks)", head, "-" * len(head)]
    for f in an["prefill"]:
        p = f["parts"]
        lines.append(f"{f['prefix']:>5} {f['tok_s']:>6.1f} {f['wall_ms'] / 1e3:>7.2f} | "
                     f"{p['weights']['ms']:>10.1f} {_rate(p['weights']['achieved_gops_s'])} "
                     f"{_x(p['weights'])} | {p['attention']['ms']:>8.1f} "
                     f"{_rate(p['attention']['achieved_gops_s'], 7)} {_x(p['attention'])} | "
                     f"{p['other_ops']['ms']:>7.1f} {p['host']['ms']:>7.1f}")
    s = doc["sampling"]
    if s:
        lines += ["", f"sampling on real logits (µs per token, vocabulary {s['n_vocab']}): "
                  f"argmax numpy {s['argmax_numpy_us']:.1f}, native "
                  f"{_rate(s['argmax_native_us'], 1)}, top-k/top-p chain "
                  f"{s['chain_topk_topp_temp_us']:.1f}, grammar check "
                  f"{s['grammar_check_us']:.1f} ({s['grammar_redraws']}/{s['grammar_tokens']}"
                  f" redrawn; parse {s['grammar_init_ms']:.1f} ms a turn)"]
    lines += ["", "farthest from its limit (worst point per part):"]
    for f in an["farthest"]:
        lines.append(f"  {f['part']:<12} {f['x_limit']:6.1f}x at P={f['prefix']} N={f['rows']}"
                     f" ({f['ms']:.2f} ms, {100 * f['share']:.0f}% of the step)")
    b = doc["build"]
    lines += ["", f"llama.cpp: {b['system_info']}",
              f"weights: {b['weight_buffers']}; flash attention {b['flash_attn']}; "
              f"prefix attention {b['prefix_attention']}; native step {b['native_step']}"]
    for name, r in b["repack"].items():
        if "error" in r:
            lines.append(f"repack probe {name}: {r['error']}")
            continue
        m, e = r["mesh_default"], r["extra_buffers"]
        lines.append(f"repack probe {r['model']}: mesh's load {m['weight_buffers']} "
                     f"{m['step_ms']:.1f} ms a step; extra buffer types "
                     f"{e['weight_buffers']} {e['step_ms']:.1f} ms")
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Left: each decode point's time by part (stacked). Right: each rated part's distance
    from its limit (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decode = doc["analysis"]["decode"]
    if not decode:
        return
    labels = [f"P{d['prefix']}\nN{d['rows']}" for d in decode]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.5))
    bottom = np.zeros(len(decode))
    for part in PARTS:
        vals = np.array([d["parts"][part]["ms"] for d in decode])
        ax1.bar(labels, vals, bottom=bottom, label=part)
        bottom += vals
    ax1.set_ylabel("ms per decode step")
    ax1.set_title("one decode step by part")
    ax1.legend(fontsize=8)
    rated_parts = ("weights", "prefix_attn", "suffix_attn", "sampling")
    width = 0.8 / len(rated_parts)
    xs = np.arange(len(decode))
    for i, part in enumerate(rated_parts):
        xl = [d["parts"][part].get("x_limit") or 0.0 for d in decode]
        ax2.bar(xs + i * width - 0.4 + width / 2, xl, width, label=part)
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.axhline(2.0, color="k", lw=0.8, ls="--")
    ax2.set_xticks(xs)
    ax2.set_xticklabels(labels)
    ax2.set_yscale("log")
    ax2.set_ylabel("time / measured limit (log; 1 = at the limit, dashed: 2x)")
    ax2.set_title("distance from this machine's limit")
    ax2.legend(fontsize=8)
    fig.suptitle(f"{doc['meta']['model']} on {doc['meta']['cpu']}, {doc['peaks']['threads']} "
                 "threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- main


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _strip(obj: Any) -> Any:
    """JSON-ready: numpy scalars to Python, floats rounded."""
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_strip(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float):
        return round(obj, 6)
    return obj


def run(a: argparse.Namespace) -> dict[str, Any]:
    def log(text: str) -> None:
        print(f"... {text}", file=sys.stderr, flush=True)

    t_start = time.monotonic()
    before = busy_processes()
    resolved = resolve_model(a.model)
    path = Path(resolved.path)
    lib = build_helper(a.work_dir)
    prof = Profiler(lib)
    log("measuring this machine's limits")
    peaks = measure_peaks(lib, a.threads, seconds=0.05 if a.quick else 0.25,
                          tries=2 if a.quick else 3,
                          stream_bytes=(64 << 20) if a.quick else None)
    model = LlamaModel(path)
    try:
        shape = read_shape(path, model)
        n_ctx_train = model.n_ctx_train
    finally:
        model.close()
    plan = Plan(prefixes=_ints(a.prefixes), base_prefix=a.base_prefix, rows=_ints(a.rows),
                suffix=a.suffix, probe_suffix=a.probe_suffix, probe_rows=_ints(a.probe_rows),
                steps=a.steps, profile_steps=a.profile_steps, threads=a.threads, seed=a.seed)
    measured = asyncio.run(measure_engine(path, prof, plan, n_ctx_train, log))
    sampling = None
    if measured["logits"] is not None:
        model = LlamaModel(path, vocab_only=True)
        try:
            sampling = measure_sampling(model, measured["logits"], 64 if a.quick else 512)
        finally:
            model.close()
    repack: dict[str, Any] = {}
    for name in [x for x in a.repack_models.split(",") if x.strip()]:
        log(f"weight repacking ({name}): loading it both ways in a child process")
        try:
            probe_path = path if name == "self" else Path(resolve_model(name).path)
        except ModelError as exc:
            repack[name] = {"error": str(exc)}
            continue
        repack[name] = {"model": probe_path.name,
                        **run_repack_probe(probe_path, a.threads, a.quick)}
    first = measured["prefills"][0] if measured["prefills"] else {}
    info = system_info()
    build = {"system_info": info, "repack_compiled": "REPACK = 1" in info,
             "extra_buffers_default": EngineConfig(model_path="x").extra_buffers,
             "weight_buffers": (repack.get("self", {}).get("mesh_default") or {}).get(
                 "weight_buffers"),
             "repack": repack, "flash_attn": first.get("flash_attn"),
             "prefix_attention": first.get("prefix_attention"),
             "flash_attn_by_prefix": {str(p["prefix"]): p["flash_attn"]
                                      for p in measured["prefills"]},
             "shared_prefix_attn_version": pa.shared_prefix_attn_version(),
             "native_step": first.get("native_step"),
             "llama_lib": str(llama_lib_dir())}
    doc: dict[str, Any] = {
        "meta": {"when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                 "model": resolved.name, "model_path": str(path), "cpu": cpu_name(),
                 "cpus": os.cpu_count(), "threads": a.threads, "argv": sys.argv[1:],
                 "quick": a.quick, "machine_before": before},
        "plan": dataclasses.asdict(plan) | {"budget": plan.budget,
                                            "prefixes_run": measured["prefixes"]},
        "shape": dataclasses.asdict(shape), "peaks": peaks, "build": build,
        "points": measured["points"], "prefills": measured["prefills"],
        "sampling": sampling,
    }
    doc["analysis"] = analyse(measured, shape, peaks, plan)
    doc["meta"]["machine_after"] = busy_processes()
    doc["meta"]["wall_s"] = round(time.monotonic() - t_start, 1)
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {__package__}",
                                 description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, tiny, gemma or a GGUF path")
    ap.add_argument("--prefixes", default="1024,4096,8192",
                    help="prefix grid P (clamped to the model's context less a session)")
    ap.add_argument("--base-prefix", type=int, default=256,
                    help="the short prefix of the P -> 0 point and the suffix probe")
    ap.add_argument("--rows", default="1,8,32", help="decoding rows N")
    ap.add_argument("--suffix", type=int, default=64, help="private tokens per row S")
    ap.add_argument("--probe-suffix", type=int, default=128,
                    help="a longer S at the base prefix (suffix cost; 0: none)")
    ap.add_argument("--probe-rows", default="8,32")
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per point")
    ap.add_argument("--profile-steps", type=int, default=2, help="per-op profiled steps")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/mesh-step-roofline"),
                    help="where the helper is compiled")
    ap.add_argument("--quick", action="store_true",
                    help="the tiny model, small P and N, short micro-benchmarks: seconds")
    ap.add_argument("--out", type=Path, default=None, help="the JSON (the plot goes beside)")
    ap.add_argument("--repack-models", default="self,gemma",
                    help="models loaded with and without weight repacking (self: --model)")
    ap.add_argument("--repack-probe", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.repack_probe is not None:
        q = (64, 4, 3) if a.quick else (256, 8, 6)
        print(json.dumps(repack_probe(a.repack_probe, a.threads, *q)))
        return 0
    if a.quick:
        a.model = "tiny" if a.model == "smollm2" else a.model
        a.prefixes, a.base_prefix, a.rows, a.probe_rows = "256,512,1024", 64, "1,4,8", "4,8"
        a.suffix, a.probe_suffix, a.steps, a.profile_steps = 8, 16, 3, 1
        a.repack_models = "self"
    out = a.out or (QUICK_OUT if a.quick else DEFAULT_OUT)
    doc = run(a)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_strip(doc), indent=1) + "\n")
    plot(doc, out.with_suffix(".png"))
    print(table(doc))
    print(f"\nwritten to {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
