/* RMSNorm on CPU in one pass per row, as the Llama reference computes it:
 *     out = weight * to_dtype(x_f32 * rsqrt(mean(x_f32^2) + eps))
 * in float32 whatever the storage dtype, with the two roundings to bfloat16 that the reference
 * makes for bfloat16 models (after normalising, and after the weight multiply). In torch this is
 * eight ops per norm, two norms per layer; at decode sizes each op costs more in dispatch than in
 * arithmetic, so the engine's norms come here (kernels/cpu_native.py), the torch formula elsewhere.
 *
 * x, out [rows, hidden]; weight [hidden]; dtype codes: 0 = float32, 1 = bfloat16. */

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

static void norm_row_f32(const float *x, const float *w, float *out, int64_t hidden, float eps) {
    float ss = 0.0f;
    for (int64_t i = 0; i < hidden; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)hidden + eps);
    for (int64_t i = 0; i < hidden; i++) out[i] = w[i] * (x[i] * r);
}

static void norm_row_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t hidden, float eps) {
    float ss = 0.0f;
    for (int64_t i = 0; i < hidden; i++) {
        const float v = bf16_to_f32(x[i]);
        ss += v * v;
    }
    const float r = 1.0f / sqrtf(ss / (float)hidden + eps);
    for (int64_t i = 0; i < hidden; i++)
        out[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(x[i]) * r));
}

int ferry_rms_norm(const void *x, const void *weight, void *out, int dtype, int64_t rows, int64_t hidden, float eps,
                   int num_threads) {
    if (hidden < 1 || rows < 0 || (dtype != 0 && dtype != 1)) return -1;
    const int threads = rows >= 64 ? num_threads : 1; /* a few rows are not worth waking a team */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (dtype == 0)
            norm_row_f32((const float *)x + r * hidden, (const float *)weight, (float *)out + r * hidden, hidden, eps);
        else
            norm_row_bf16((const uint16_t *)x + r * hidden, (const uint16_t *)weight, (uint16_t *)out + r * hidden,
                          hidden, eps);
    }
    return 0;
}
