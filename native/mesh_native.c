/*
 * mesh_native: the engine step's hot path (fill the batch, llama_decode, sample every
 * output row) in one foreign call, so Python crosses into C once a step instead of once
 * per token, and the GIL is released for the whole step (ctypes drops it for the call).
 *
 * Built against the llama.cpp that llama-cpp-python ships (its include/llama.h and
 * llama_cpp/lib/libllama.so) by native/build.py; loaded by mesh/engine/native.py.
 * Python keeps every piece of bookkeeping; this file only moves arrays.
 */
#define _POSIX_C_SOURCE 199309L
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "llama.h"

#define MESH_NATIVE_ABI 2
#define MESH_MAX_THREADS 64
/* Below this many logits (rows x vocabulary) a step samples on the calling thread. */
#define MESH_PARALLEL_MIN (1 << 22)

struct mesh_stepper;

/* One sampling job: rows first, first + step, ... of the step's output rows. */
typedef struct work {
    struct mesh_stepper *s;
    const float **rows;
    struct llama_sampler **samplers;
    int32_t *out;
    int32_t n_rows, first, step, tid;
} work;

/* A reusable batch of up to `capacity` tokens, one sequence id each, per-thread
 * candidate buffers for sampler chains, and the sampling threads: started on the first
 * step that needs them and kept (creating threads every step cost more than the
 * sampling they did, under gVisor most of all). Worker i (1-based) runs jobs[i] each
 * time `gen` moves while i < active; the caller runs jobs[0] and waits for `pending`. */
typedef struct mesh_stepper {
    struct llama_batch batch;
    int32_t capacity;
    int32_t n_vocab;
    llama_token_data *cand[MESH_MAX_THREADS];
    int32_t cand_cap[MESH_MAX_THREADS];
    pthread_mutex_t mu;
    pthread_cond_t go, done;
    pthread_t th[MESH_MAX_THREADS];
    int32_t n_workers; /* threads started: workers 1..n_workers */
    int32_t active, pending, quit;
    uint32_t gen;
    work jobs[MESH_MAX_THREADS];
} mesh_stepper;

typedef struct worker_arg {
    mesh_stepper *s;
    int32_t idx;
    uint32_t seen; /* gen when the worker was created: a job posted after that is its */
} worker_arg;

static void *sample_rows(void *arg);

static void *worker_main(void *arg) {
    worker_arg a = *(worker_arg *)arg;
    free(arg);
    mesh_stepper *s = a.s;
    uint32_t seen = a.seen;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (s->gen == seen && !s->quit) pthread_cond_wait(&s->go, &s->mu);
        if (s->quit) break;
        seen = s->gen;
        if (a.idx < s->active) {
            work job = s->jobs[a.idx];
            pthread_mutex_unlock(&s->mu);
            sample_rows(&job);
            pthread_mutex_lock(&s->mu);
            if (--s->pending == 0) pthread_cond_signal(&s->done);
        }
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* Start workers up to `want` - 1 (the caller is the first); returns how many threads,
 * the caller included, can run jobs now. */
static int32_t ensure_workers(mesh_stepper *s, int32_t want) {
    while (s->n_workers + 1 < want) {
        worker_arg *a = (worker_arg *)malloc(sizeof(worker_arg));
        if (a == NULL) break;
        a->s = s;
        a->idx = s->n_workers + 1;
        a->seen = s->gen; /* only this (the stepping) thread moves gen */
        if (pthread_create(&s->th[s->n_workers + 1], NULL, worker_main, a) != 0) {
            free(a);
            break;
        }
        s->n_workers++;
    }
    return s->n_workers + 1;
}

int32_t mesh_native_abi(void) { return MESH_NATIVE_ABI; }

mesh_stepper *mesh_stepper_new(int32_t capacity) {
    if (capacity <= 0) return NULL;
    mesh_stepper *s = (mesh_stepper *)calloc(1, sizeof(mesh_stepper));
    if (s == NULL) return NULL;
    s->batch = llama_batch_init(capacity, 0, 1);
    s->capacity = capacity;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->go, NULL);
    pthread_cond_init(&s->done, NULL);
    return s;
}

void mesh_stepper_free(mesh_stepper *s) {
    if (s == NULL) return;
    pthread_mutex_lock(&s->mu);
    s->quit = 1;
    pthread_cond_broadcast(&s->go);
    pthread_mutex_unlock(&s->mu);
    for (int32_t t = 1; t <= s->n_workers; t++) pthread_join(s->th[t], NULL);
    pthread_cond_destroy(&s->go);
    pthread_cond_destroy(&s->done);
    pthread_mutex_destroy(&s->mu);
    llama_batch_free(s->batch);
    for (int i = 0; i < MESH_MAX_THREADS; i++) free(s->cand[i]);
    free(s);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* First index of the largest logit (numpy.argmax's tie rule): the maximum, then the
 * first index holding it. AVX2 where the CPU has it (checked at run time). */
static float row_max_scalar(const float *x, int32_t n) {
    float m = x[0];
    for (int32_t i = 1; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

static int32_t first_equal_scalar(const float *x, int32_t n, int32_t from, float v) {
    for (int32_t i = from; i < n; i++) {
        if (x[i] == v) return i;
    }
    return -1;
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

/* The end of a SIMD argmax: the largest of the ``count`` lane maxima (the smallest index
 * among equals, numpy.argmax's rule), then the scalar tail ``x[from..n)`` (strict >: a
 * later equal value never wins). */
static int32_t merge_lanes(const float *x, int32_t n, int32_t from, const float *lanes,
                           const int32_t *idx, int count) {
    float best = x[0];
    int32_t at = 0;
    for (int k = 0; k < count; k++) {
        if (lanes[k] > best || (lanes[k] == best && idx[k] < at)) {
            best = lanes[k];
            at = idx[k];
        }
    }
    for (int32_t i = from; i < n; i++) {
        if (x[i] > best) {
            best = x[i];
            at = i;
        }
    }
    return at;
}

/* One pass: per lane the largest value and the first index holding it (strict >), four
 * independent accumulators; then the largest over lanes, the smallest index among
 * equals (numpy.argmax's rule). */
__attribute__((target("avx2"))) static int32_t argmax_avx2(const float *x, int32_t n) {
    if (n < 64) {
        int32_t at = first_equal_scalar(x, n, 0, row_max_scalar(x, n));
        return at < 0 ? 0 : at;
    }
    __m256 m[4];
    __m256i id[4], cur[4];
    for (int a = 0; a < 4; a++) {
        m[a] = _mm256_loadu_ps(x + 8 * a);
        id[a] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                 _mm256_set1_epi32(8 * a));
        cur[a] = id[a];
    }
    const __m256i step = _mm256_set1_epi32(32);
    int32_t i = 32;
    for (; i + 32 <= n; i += 32) {
        for (int a = 0; a < 4; a++) {
            cur[a] = _mm256_add_epi32(cur[a], step);
            __m256 v = _mm256_loadu_ps(x + i + 8 * a);
            __m256 gt = _mm256_cmp_ps(v, m[a], _CMP_GT_OQ);
            m[a] = _mm256_blendv_ps(m[a], v, gt);
            id[a] = _mm256_blendv_epi8(id[a], cur[a], _mm256_castps_si256(gt));
        }
    }
    float lanes[32];
    int32_t idx[32];
    for (int a = 0; a < 4; a++) {
        _mm256_storeu_ps(lanes + 8 * a, m[a]);
        _mm256_storeu_si256((__m256i *)(idx + 8 * a), id[a]);
    }
    return merge_lanes(x, n, i, lanes, idx, 32);
}
#endif

#if defined(__x86_64__) || defined(__i386__)
/* The same with sixteen lanes. */
__attribute__((target("avx512f"))) static int32_t argmax_avx512(const float *x, int32_t n) {
    if (n < 128) return argmax_avx2(x, n);
    __m512 m[4];
    __m512i id[4], cur[4];
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
                                           15);
    for (int a = 0; a < 4; a++) {
        m[a] = _mm512_loadu_ps(x + 16 * a);
        id[a] = _mm512_add_epi32(lane, _mm512_set1_epi32(16 * a));
        cur[a] = id[a];
    }
    const __m512i step = _mm512_set1_epi32(64);
    int32_t i = 64;
    for (; i + 64 <= n; i += 64) {
        for (int a = 0; a < 4; a++) {
            cur[a] = _mm512_add_epi32(cur[a], step);
            __m512 v = _mm512_loadu_ps(x + i + 16 * a);
            __mmask16 gt = _mm512_cmp_ps_mask(v, m[a], _CMP_GT_OQ);
            m[a] = _mm512_mask_blend_ps(gt, m[a], v);
            id[a] = _mm512_mask_blend_epi32(gt, id[a], cur[a]);
        }
    }
    float lanes[64];
    int32_t idx[64];
    for (int a = 0; a < 4; a++) {
        _mm512_storeu_ps(lanes + 16 * a, m[a]);
        _mm512_storeu_si512((void *)(idx + 16 * a), id[a]);
    }
    return merge_lanes(x, n, i, lanes, idx, 64);
}
#endif

static int32_t argmax(const float *x, int32_t n) {
#if defined(__x86_64__) || defined(__i386__)
    if (__builtin_cpu_supports("avx512f")) return argmax_avx512(x, n);
    if (__builtin_cpu_supports("avx2")) return argmax_avx2(x, n);
#endif
    int32_t at = first_equal_scalar(x, n, 0, row_max_scalar(x, n));
    return at < 0 ? 0 : at; /* NaN everywhere */
}

/* The greedy pick, exported for tests (numpy.argmax must agree). */
int32_t mesh_argmax(const float *x, int32_t n) { return n > 0 ? argmax(x, n) : -1; }

/* What llama_sampler_sample does, on a logits row we already hold (so rows can be
 * sampled on several threads: each row has its own sampler and candidate buffer). */
static llama_token sample_chain(struct llama_sampler *smpl, const float *row, int32_t n,
                                llama_token_data *cand) {
    for (int32_t i = 0; i < n; i++) {
        cand[i].id = i;
        cand[i].logit = row[i];
        cand[i].p = 0.0f;
    }
    llama_token_data_array cur = {cand, (size_t)n, -1, false};
    llama_sampler_apply(smpl, &cur);
    llama_token tok = cur.data[cur.selected].id;
    llama_sampler_accept(smpl, tok);
    return tok;
}

static void *sample_rows(void *arg) {
    work *w = (work *)arg;
    for (int32_t r = w->first; r < w->n_rows; r += w->step) {
        if (w->samplers[r] == NULL) {
            w->out[r] = argmax(w->rows[r], w->s->n_vocab);
        } else {
            w->out[r] = sample_chain(w->samplers[r], w->rows[r], w->s->n_vocab,
                                     w->s->cand[w->tid]);
        }
    }
    return NULL;
}

/*
 * One engine step.
 *
 * tokens/pos/seq/logits: n_tokens entries each (the batch, in order).
 * rows: n_rows batch indices to sample (each must have logits[row] != 0);
 * samplers: n_rows llama_sampler chains, NULL for greedy argmax.
 * out: n_rows sampled tokens. timing[0] = seconds in llama_decode, timing[1] = sampling,
 * timing[2] = CLOCK_MONOTONIC seconds when the call returns, timing[3] when it began
 * (Python measures, against its own monotonic clock, how long the GIL hand-offs around the
 * call took).
 * n_threads: threads that may sample rows (1: the calling thread only); they are used
 * only when rows x vocabulary >= MESH_PARALLEL_MIN; negative: always -n_threads.
 *
 * Returns llama_decode's status (0 = ok; then `out` holds every row's token), or
 * -1000 when the arrays do not fit the stepper (Python checks this first),
 * -1001 when llama.cpp gave no logits for a row, -1002 when out of memory.
 */
int32_t mesh_step(mesh_stepper *s, struct llama_context *ctx, int32_t n_tokens,
                  const int32_t *tokens, const int32_t *pos, const int32_t *seq,
                  const int8_t *logits, int32_t n_rows, const int32_t *rows,
                  struct llama_sampler **samplers, int32_t *out, double *timing,
                  int32_t n_threads) {
    timing[3] = now_s();
    if (s == NULL || n_tokens <= 0 || n_tokens > s->capacity || n_rows > s->capacity)
        return -1000;
    struct llama_batch *b = &s->batch;
    for (int32_t i = 0; i < n_tokens; i++) {
        b->token[i] = tokens[i];
        b->pos[i] = pos[i];
        b->n_seq_id[i] = 1;
        b->seq_id[i][0] = seq[i];
        b->logits[i] = logits[i];
    }
    b->n_tokens = n_tokens;
    double t0 = now_s();
    int32_t rc = llama_decode(ctx, *b);
    double t1 = now_s();
    timing[0] = t1 - t0;
    timing[1] = 0.0;
    timing[2] = t1;
    if (rc != 0 || n_rows == 0) return rc;
    s->n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(llama_get_model(ctx)));
    const float **row_ptr = (const float **)malloc(sizeof(float *) * (size_t)n_rows);
    if (row_ptr == NULL) return -1002;
    for (int32_t r = 0; r < n_rows; r++) { /* llama.cpp's own lookup: on this thread */
        row_ptr[r] = llama_get_logits_ith(ctx, rows[r]);
        if (row_ptr[r] == NULL) {
            free(row_ptr);
            return -1001;
        }
    }
    /* n_threads < 0: always -n_threads threads (tests exercise the threaded path) */
    int32_t nt = n_threads < 0 ? -n_threads : n_threads;
    if (n_threads > 0 && (int64_t)n_rows * s->n_vocab < MESH_PARALLEL_MIN) nt = 1;
    if (nt < 1) nt = 1;
    if (nt > MESH_MAX_THREADS) nt = MESH_MAX_THREADS;
    if (nt > n_rows) nt = n_rows;
    int any_chain = 0;
    for (int32_t r = 0; r < n_rows; r++) any_chain |= samplers[r] != NULL;
    for (int32_t t = 0; any_chain && t < nt; t++) {
        if (s->cand_cap[t] < s->n_vocab) {
            free(s->cand[t]);
            s->cand[t] = (llama_token_data *)malloc(sizeof(llama_token_data) *
                                                    (size_t)s->n_vocab);
            s->cand_cap[t] = s->cand[t] != NULL ? s->n_vocab : 0;
            if (s->cand[t] == NULL) {
                free(row_ptr);
                return -1002;
            }
        }
    }
    if (nt > 1) nt = ensure_workers(s, nt); /* fewer if a thread could not start */
    if (nt == 1) {
        work w = {s, row_ptr, samplers, out, n_rows, 0, 1, 0};
        sample_rows(&w);
    } else {
        pthread_mutex_lock(&s->mu);
        for (int32_t t = 0; t < nt; t++) {
            s->jobs[t] = (work){s, row_ptr, samplers, out, n_rows, t, nt, t};
        }
        s->active = nt;
        s->pending = nt - 1;
        s->gen++;
        pthread_cond_broadcast(&s->go);
        pthread_mutex_unlock(&s->mu);
        work mine = s->jobs[0];
        sample_rows(&mine);
        pthread_mutex_lock(&s->mu);
        while (s->pending > 0) pthread_cond_wait(&s->done, &s->mu);
        s->active = 0;
        pthread_mutex_unlock(&s->mu);
    }
    free(row_ptr);
    timing[2] = now_s();
    timing[1] = timing[2] - t1;
    return 0;
}
