/* Per-row float32 kernels of a decoder layer: RMSNorm and SwiGLU's silu(gate) * up.
 *
 * Each row's arithmetic is fixed (8 lanes in a set order, simd.h's tree, exp8 with its scalar
 * twin exp1 on the tail), so a row gives the same bits however many rows share the call and
 * however threads split them; torch's reductions and transcendental ops give no such promise
 * (a reduction may be split across threads when there are few rows, and a vectorised exp
 * differs from its scalar tail).
 */
#include <math.h>
#include <stdint.h>

#include "simd.h"

/* The sum of v[i]^2: lane i % 8 for whole groups of 8, the tree, then the tail in order. */
static float sum_of_squares(const float *v, int64_t n) {
    int64_t whole = n / 8 * 8;
    float total;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < whole; i += 8) {
        __m256 x = _mm256_loadu_ps(v + i);
        acc = _mm256_fmadd_ps(x, x, acc);
    }
    total = hsum8(acc);
#else
    float lanes[8] = {0};
    for (int64_t i = 0; i < whole; i += 8)
        for (int l = 0; l < 8; l++) lanes[l] = __builtin_fmaf(v[i + l], v[i + l], lanes[l]);
    total = hsum8_lanes(lanes);
#endif
    for (int64_t i = whole; i < n; i++) total = __builtin_fmaf(v[i], v[i], total);
    return total;
}

/* out [rows, cols] = x / sqrt(mean(x^2) + eps) * weight, row by row (rows of x `x_stride`
 * floats apart, out packed). With weight NULL, the normalised rows alone: a 16-bit model rounds
 * them to its dtype before scaling, as transformers does. */
void pagedkv_rms_norm(const float *x, int64_t x_stride, int64_t rows, int64_t cols,
                      const float *weight, float eps, float *out) {
#pragma omp parallel for schedule(static) if (rows > 64)
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * x_stride;
        float inverse = 1.0f / sqrtf(sum_of_squares(v, cols) / (float)cols + eps);
        float *o = out + r * cols;
        if (weight == NULL)
            for (int64_t i = 0; i < cols; i++) o[i] = v[i] * inverse;
        else
            for (int64_t i = 0; i < cols; i++) o[i] = v[i] * inverse * weight[i];
    }
}

/* out [rows, inter] = silu(gate) * up for gate_up [rows, 2 * inter] (gate, then up), with
 * silu(g) = g / (1 + exp(-g)). */
void pagedkv_silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out) {
#pragma omp parallel for schedule(static) if (rows * inter > 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * inter, *up = gate + inter;
        float *o = out + r * inter;
        int64_t i = 0;
#ifdef __AVX2__
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= inter; i += 8) {
            __m256 g = _mm256_loadu_ps(gate + i);
            __m256 e = exp8(_mm256_sub_ps(zero, g));
            __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
        }
#endif
        for (; i < inter; i++) o[i] = gate[i] / (1.0f + exp1(0.0f - gate[i])) * up[i];
    }
}

/* Which instructions this build computes with: 2 AVX2 with AVX-512 VNNI's 512-bit integer dot
 * products, 1 AVX2, 0 plain C. Every path gives the same bits (see each kernel's header). */
int pagedkv_vector_path(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}
