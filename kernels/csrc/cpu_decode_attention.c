/* Paged decode attention on CPU: one new query token per sequence against its paged K/V cache.
 *
 * The torch reference (kernels/reference.py) gathers every sequence's blocks into a padded float32
 * copy and runs SDPA over it: correct, but at decode sizes the gather, the conversion and the
 * kernel's per-call costs dwarf the arithmetic (measured: 16 sequences x 300 tokens, SmolLM2's
 * heads, one thread, ~2 ms per layer for ~1.9 MB of K/V). This kernel reads K/V rows straight from
 * the cache blocks, in the cache's dtype, once per (sequence, KV head): the G query heads that share
 * a KV head are scored together, so each K and V row is loaded once for all of them.
 *
 * Per (sequence, KV head), exact two-pass softmax in float32: scores for every position, their max,
 * exp and sum, then the probability-weighted sum of V rows. Work is split over (sequence, KV head)
 * pairs with OpenMP; the library links the libgomp.so.1 torch has already loaded, so its threads
 * are torch's threads. Built at first use by kernels/cpu_native.py with the host's C compiler.
 *
 * Layouts: q, out [S, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables
 * [S, max_blocks] int32; seq_lens [S] int32. dtype codes: 0 = float32, 1 = bfloat16. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F32 = 0, BF16 = 1 };
#define MAX_HEAD_DIM 256
#define MAX_HEADS 256

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Row `offset` of a float32 or bfloat16 array as float32: in place for float32, else converted into `tmp`. */
static inline const float *row_f32(const void *base, int64_t offset, int dtype, int64_t d, float *tmp) {
    if (dtype == F32) return (const float *)base + offset;
    const uint16_t *p = (const uint16_t *)base + offset;
    for (int64_t i = 0; i < d; i++) tmp[i] = bf16_to_f32(p[i]);
    return tmp;
}

static inline float dot(const float *a, const float *b, int64_t d) {
    float s = 0.0f;
    for (int64_t i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

/* Returns 0, or -1 for shapes the kernel does not take (the caller falls back to the reference). */
int ferry_paged_decode_attention(const void *q, void *out, int q_dtype, const void *k_cache, const void *v_cache,
                                 int cache_dtype, const int32_t *block_tables, int64_t max_blocks,
                                 const int32_t *seq_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                 int64_t head_dim, int64_t block_size, float scale, int num_threads) {
    if (head_dim < 1 || head_dim > MAX_HEAD_DIM || num_kv_heads < 1 || num_heads % num_kv_heads) return -1;
    if (num_heads > MAX_HEADS || block_size < 1 || num_threads < 1) return -1;
    const int64_t group = num_heads / num_kv_heads;
    int64_t longest = 1;
    for (int64_t s = 0; s < num_seqs; s++) {
        if (seq_lens[s] < 1 || seq_lens[s] > max_blocks * block_size) return -1;
        if (seq_lens[s] > longest) longest = seq_lens[s];
    }
    /* A task is one sequence and a run of its KV heads. With enough sequences to share out, a task
     * takes all of a sequence's heads, so each token's K (and V) row, all heads side by side in the
     * cache, is read once, front to back: the cache blocks come from memory cold (a decode step
     * streams all the weights between two visits to a layer), and whole rows read in order are what
     * the prefetchers serve best. With fewer sequences than threads, tasks split the heads instead. */
    const int64_t heads_per_task = num_seqs >= num_threads ? num_kv_heads : 1;
    const int64_t tasks_per_seq = num_kv_heads / heads_per_task;
    const int64_t row_len = num_kv_heads * head_dim;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc((size_t)(heads_per_task * group * longest) * sizeof(float)); /* [heads, G, L] */
        float *qf = malloc((size_t)(heads_per_task * group * head_dim) * sizeof(float));
        float *acc = malloc((size_t)(heads_per_task * group * head_dim) * sizeof(float));
        float *row = malloc((size_t)row_len * sizeof(float));
        float denom[MAX_HEADS];
        if (!scores || !qf || !acc || !row) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_seqs * tasks_per_seq; task++) {
            if (failed) continue;
            const int64_t s = task / tasks_per_seq, h0 = (task % tasks_per_seq) * heads_per_task;
            const int64_t len = seq_lens[s], nq = heads_per_task * group; /* query heads of this task */
            const int32_t *table = block_tables + s * max_blocks;
            const int64_t q0 = s * num_heads + h0 * group; /* first query head of this task */
            for (int64_t j = 0; j < nq; j++) {
                const float *qr = row_f32(q, (q0 + j) * head_dim, q_dtype, head_dim, qf + j * head_dim);
                if (qr != qf + j * head_dim) memcpy(qf + j * head_dim, qr, (size_t)head_dim * sizeof(float));
            }
            /* pass 1: scores; the table is walked block by block (no division per token) */
            for (int64_t b = 0, t = 0; t < len; b++) {
                const int64_t first = (int64_t)table[b] * block_size, n = len - t < block_size ? len - t : block_size;
                for (int64_t i = 0; i < n; i++, t++) {
                    const float *kr = row_f32(k_cache, (first + i) * row_len + h0 * head_dim, cache_dtype,
                                              heads_per_task * head_dim, row);
                    for (int64_t j = 0; j < nq; j++)
                        scores[j * len + t] = dot(qf + j * head_dim, kr + (j / group) * head_dim, head_dim) * scale;
                }
            }
            /* softmax, exact: max, exp, sum */
            for (int64_t j = 0; j < nq; j++) {
                float *sc = scores + j * len, m = sc[0], sum = 0.0f;
                for (int64_t t = 1; t < len; t++) m = sc[t] > m ? sc[t] : m;
                for (int64_t t = 0; t < len; t++) {
                    sc[t] = expf(sc[t] - m);
                    sum += sc[t];
                }
                denom[j] = sum;
            }
            memset(acc, 0, (size_t)(nq * head_dim) * sizeof(float));
            /* pass 2: probability-weighted sum of the V rows */
            for (int64_t b = 0, t = 0; t < len; b++) {
                const int64_t first = (int64_t)table[b] * block_size, n = len - t < block_size ? len - t : block_size;
                for (int64_t i = 0; i < n; i++, t++) {
                    const float *vr = row_f32(v_cache, (first + i) * row_len + h0 * head_dim, cache_dtype,
                                              heads_per_task * head_dim, row);
                    for (int64_t j = 0; j < nq; j++) {
                        const float p = scores[j * len + t], *v = vr + (j / group) * head_dim;
                        float *a = acc + j * head_dim;
                        for (int64_t d = 0; d < head_dim; d++) a[d] += p * v[d];
                    }
                }
            }
            for (int64_t j = 0; j < nq; j++) {
                const int64_t o = (q0 + j) * head_dim;
                const float inv = 1.0f / denom[j], *a = acc + j * head_dim;
                if (q_dtype == F32) {
                    for (int64_t d = 0; d < head_dim; d++) ((float *)out)[o + d] = a[d] * inv;
                } else {
                    for (int64_t d = 0; d < head_dim; d++) ((uint16_t *)out)[o + d] = f32_to_bf16(a[d] * inv);
                }
            }
        }
        free(scores);
        free(qf);
        free(acc);
        free(row);
    }
    return failed ? -2 : 0;
}
