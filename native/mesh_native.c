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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "llama.h"

#define MESH_NATIVE_ABI 1

/* A reusable batch of up to `capacity` tokens, one sequence id each. */
typedef struct mesh_stepper {
    struct llama_batch batch;
    int32_t capacity;
} mesh_stepper;

int32_t mesh_native_abi(void) { return MESH_NATIVE_ABI; }

mesh_stepper *mesh_stepper_new(int32_t capacity) {
    if (capacity <= 0) return NULL;
    mesh_stepper *s = (mesh_stepper *)calloc(1, sizeof(mesh_stepper));
    if (s == NULL) return NULL;
    s->batch = llama_batch_init(capacity, 0, 1);
    s->capacity = capacity;
    return s;
}

void mesh_stepper_free(mesh_stepper *s) {
    if (s == NULL) return;
    llama_batch_free(s->batch);
    free(s);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* First index of the largest logit (numpy.argmax's tie rule). */
static int32_t argmax(const float *x, int32_t n) {
    int32_t best = 0;
    float v = x[0];
    for (int32_t i = 1; i < n; i++) {
        if (x[i] > v) {
            v = x[i];
            best = i;
        }
    }
    return best;
}

/*
 * One engine step.
 *
 * tokens/pos/seq/logits: n_tokens entries each (the batch, in order).
 * rows: n_rows batch indices to sample (each must have logits[row] != 0);
 * samplers: n_rows llama_sampler chains, NULL for greedy argmax.
 * out: n_rows sampled tokens. timing[0] = seconds in llama_decode, timing[1] = sampling.
 *
 * Returns llama_decode's status (0 = ok; then `out` holds every row's token), or
 * -1000 when the arrays do not fit the stepper (Python checks this first), or
 * -1001 when llama.cpp gave no logits for a row.
 */
int32_t mesh_step(mesh_stepper *s, struct llama_context *ctx, int32_t n_tokens,
                  const int32_t *tokens, const int32_t *pos, const int32_t *seq,
                  const int8_t *logits, int32_t n_rows, const int32_t *rows,
                  struct llama_sampler **samplers, int32_t *out, double *timing) {
    if (s == NULL || n_tokens <= 0 || n_tokens > s->capacity) return -1000;
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
    if (rc != 0) return rc;
    const struct llama_model *model = llama_get_model(ctx);
    const int32_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    for (int32_t r = 0; r < n_rows; r++) {
        if (samplers[r] != NULL) {
            out[r] = llama_sampler_sample(samplers[r], ctx, rows[r]);
        } else {
            const float *row = llama_get_logits_ith(ctx, rows[r]);
            if (row == NULL) return -1001;
            out[r] = argmax(row, n_vocab);
        }
    }
    timing[1] = now_s() - t1;
    return 0;
}
