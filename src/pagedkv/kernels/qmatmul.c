/* y = x W^T + b with W a QuantizedTensor (see formats.py), on the CPU.
 *
 * The activations are quantised first, per row and per group of the weight's group size, to
 * int8 with one float scale (amax / 127) and their exact float sum, as llama.cpp does for its
 * quantised dot products. Then every group's product is an integer dot product (AVX2's
 * maddubs: 32 byte products per instruction) scaled once:
 *
 *   sum_i w_i x_i = scale_w * scale_x * sum_i q_i xq_i + min_w * sum_i x_i   (per group)
 *
 * so no weight is ever widened to float. Work is split over output columns with OpenMP; the
 * library is linked against the OpenMP runtime PyTorch has already loaded, so both share one
 * thread pool and torch.set_num_threads governs this kernel too.
 *
 * Built at first use by native.py with -O3 -march=native; without AVX2 the plain C loops
 * below compute the same integers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* int8 groups of g values of each row of x [m, k]: xq, a scale and the exact sum per group. */
static void quantize_activations(const float *x, int64_t m, int64_t k, int64_t g, int8_t *xq,
                                 float *xs, float *xsum) {
    int64_t groups = m * (k / g);
#pragma omp parallel for schedule(static) if (groups > 256)
    for (int64_t group = 0; group < groups; group++) {
        const float *v = x + group * g;
        float amax = 0.0f, sum = 0.0f;
        for (int64_t i = 0; i < g; i++) {
            float a = fabsf(v[i]);
            amax = a > amax ? a : amax;
            sum += v[i];
        }
        float scale = amax / 127.0f;
        float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int64_t i = 0; i < g; i++) xq[group * g + i] = (int8_t)nearbyintf(v[i] * inverse);
        xs[group] = scale;
        xsum[group] = sum;
    }
}

#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Chunk `c` (32 values) of a weight row as 32 bytes: widened from 16 bytes when 4-bit. */
static inline __attribute__((always_inline)) __m256i load_chunk(const uint8_t *w, int bits, int64_t c) {
    if (bits == 8) return _mm256_loadu_si256((const __m256i *)(w + c * 32));
    __m128i packed = _mm_loadu_si128((const __m128i *)(w + c * 16));
    __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

/* Lane i: the sum of the products of bytes 4i..4i+3 (unsigned u times signed s). VNNI does
 * it in one instruction; plain AVX2 in two (maddubs to int16 pairs, madd to int32). */
static inline __attribute__((always_inline)) __m256i byte_dots(__m256i u, __m256i s,
                                                                __m256i ones) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    (void)ones;
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    (void)ones;
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones);
#endif
}

/* Each group's float scale on the lanes of a chunk's 8 int32 dot products. */
static inline __attribute__((always_inline)) __m256 chunk_scale(const float *w_scale, const float *a_scale, int64_t c,
                                 int64_t g) {
    if (g == 32) return _mm256_set1_ps(w_scale[c] * a_scale[c]);
    /* g == 16: lanes 0-3 sum bytes 0-15 (group 2c), lanes 4-7 bytes 16-31 (group 2c + 1) */
    float lo = w_scale[2 * c] * a_scale[2 * c];
    float hi = w_scale[2 * c + 1] * a_scale[2 * c + 1];
    return _mm256_setr_ps(lo, lo, lo, lo, hi, hi, hi, hi);
}
#endif

/* Dot products of `cols` (1..COLS) consecutive weight rows with `rows` (1..ROWS) quantised
 * activation rows, scaled, into out[col][row]. Each chunk of weights is loaded once for all
 * rows and each chunk of activations once for all columns; the COLS x ROWS accumulators are
 * independent chains, so the FMA latency is hidden even at batch 1. Called with constant
 * `cols` and `rows` so the compiler keeps the accumulators in registers. */
#define COLS 2
#define ROWS 4
static inline __attribute__((always_inline)) void tile_dot(const uint8_t *w, int64_t w_stride, int bits, const float *w_scale,
                            const int8_t *a, const float *a_scale, int64_t k, int64_t g,
                            int cols, int rows, float out[COLS][ROWS]) {
    int64_t groups = k / g;
#ifdef __AVX2__
    __m256 acc[COLS][ROWS];
    for (int j = 0; j < cols; j++)
        for (int r = 0; r < rows; r++) acc[j][r] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t c = 0; c < k / 32; c++) {
        __m256i wv[COLS], wu[COLS];
        for (int j = 0; j < cols; j++) {
            wv[j] = load_chunk(w + j * w_stride, bits, c);
            /* maddubs multiplies unsigned by signed bytes: signed weights lend x their sign */
            wu[j] = bits == 4 ? wv[j] : _mm256_sign_epi8(wv[j], wv[j]);
        }
        for (int r = 0; r < rows; r++) {
            __m256i av = _mm256_loadu_si256((const __m256i *)(a + r * k + c * 32));
            for (int j = 0; j < cols; j++) {
                __m256i signed_a = bits == 8 ? _mm256_sign_epi8(av, wv[j]) : av;
                __m256i dots = byte_dots(wu[j], signed_a, ones);
                __m256 scale = chunk_scale(w_scale + j * groups, a_scale + r * groups, c, g);
                acc[j][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), scale, acc[j][r]);
            }
        }
    }
    for (int j = 0; j < cols; j++)
        for (int r = 0; r < rows; r++) out[j][r] = hsum(acc[j][r]);
#else
    for (int j = 0; j < cols; j++) {
        const uint8_t *wj = w + j * w_stride;
        for (int r = 0; r < rows; r++) {
            float total = 0.0f;
            for (int64_t group = 0; group < groups; group++) {
                int32_t dot = 0;
                for (int64_t i = group * g; i < (group + 1) * g; i++) {
                    int32_t q = bits == 8 ? (int32_t)(int8_t)wj[i]
                                          : (wj[(i / 32) * 16 + i % 16] >> (i % 32 < 16 ? 0 : 4)) & 15;
                    dot += q * (int32_t)a[r * k + i];
                }
                total += (float)dot * w_scale[j * groups + group] * a_scale[r * groups + group];
            }
            out[j][r] = total;
        }
    }
#endif
}

/* tile_dot with its tile shape as compile-time constants (one copy per shape). */
static void tile_dot_any(const uint8_t *w, int64_t w_stride, int bits, const float *w_scale,
                         const int8_t *a, const float *a_scale, int64_t k, int64_t g, int cols,
                         int rows, float out[COLS][ROWS]) {
/* bits and g become constants too, so the inner loop has no branch on the layout. */
#define SHAPE(C, R)                                                                         \
    if (cols == C && rows == R) {                                                           \
        if (bits == 4)                                                                      \
            tile_dot(w, w_stride, 4, w_scale, a, a_scale, k, 32, C, R, out);                \
        else if (g == 32)                                                                   \
            tile_dot(w, w_stride, 8, w_scale, a, a_scale, k, 32, C, R, out);                \
        else                                                                                \
            tile_dot(w, w_stride, 8, w_scale, a, a_scale, k, 16, C, R, out);                \
        return;                                                                             \
    }
    SHAPE(2, 4) SHAPE(2, 1) SHAPE(2, 2) SHAPE(2, 3) SHAPE(1, 4) SHAPE(1, 1) SHAPE(1, 2)
    SHAPE(1, 3)
#undef SHAPE
}

#ifdef __AVX2__
/* [sum(v[0]), ..., sum(v[7])]: the lanes of eight int32 vectors, each summed. */
static inline __attribute__((always_inline)) __m256i sum_lanes8(const __m256i v[8]) {
    __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
    __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
    __m256i low = _mm256_hadd_epi32(h01, h23), high = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(low, high, 0x20),
                            _mm256_permute2x128_si256(low, high, 0x31));
}

/* One weight row times `rows` activation rows, groups of 32: decode steps. Each block of
 * eight weight chunks is loaded (and widened) once and reused for every row; per row, the
 * eight chunks' integer dot products are summed to one int32 each, then converted and scaled
 * as one vector (eight group scales at once) instead of one float op chain per chunk. */
#define MAX_DOT_ROWS 64
static inline __attribute__((always_inline)) void rows_dot32(
    const uint8_t *w, int bits, const float *w_scale, const int8_t *a, const float *a_scale,
    int64_t k, int64_t rows, float *out) {
    const __m256i ones = _mm256_set1_epi16(1);
    int64_t chunks = k / 32, groups = k / 32, c = 0;
    __m256 acc[MAX_DOT_ROWS];
    for (int64_t r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (; c + 8 <= chunks; c += 8) {
        __m256i wv[8], wu[8];
        for (int j = 0; j < 8; j++) {
            wv[j] = load_chunk(w, bits, c + j);
            wu[j] = bits == 4 ? wv[j] : _mm256_sign_epi8(wv[j], wv[j]);
        }
        __m256 ws = _mm256_loadu_ps(w_scale + c);
        for (int64_t r = 0; r < rows; r++) {
            const int8_t *ar = a + r * k;
            __m256i dots[8];
            for (int j = 0; j < 8; j++) {
                __m256i av = _mm256_loadu_si256((const __m256i *)(ar + (c + j) * 32));
                dots[j] = byte_dots(wu[j], bits == 4 ? av : _mm256_sign_epi8(av, wv[j]), ones);
            }
            __m256 scale = _mm256_mul_ps(ws, _mm256_loadu_ps(a_scale + r * groups + c));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_lanes8(dots)), scale, acc[r]);
        }
    }
    for (; c < chunks; c++) {
        __m256i wv = load_chunk(w, bits, c);
        __m256i wu = bits == 4 ? wv : _mm256_sign_epi8(wv, wv);
        for (int64_t r = 0; r < rows; r++) {
            __m256i av = _mm256_loadu_si256((const __m256i *)(a + r * k + c * 32));
            __m256i dots = byte_dots(wu, bits == 4 ? av : _mm256_sign_epi8(av, wv), ones);
            __m256 scale = _mm256_set1_ps(w_scale[c] * a_scale[r * groups + c]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), scale, acc[r]);
        }
    }
    for (int64_t r = 0; r < rows; r++) out[r] = hsum(acc[r]);
}
#endif

static float dot_floats(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float total = 0.0f;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    total = hsum(acc);
#endif
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

/* y [m, n] = x [m, k] W^T (+ bias), W given by values/scales/mins (bits 4 or 8, groups of g).
 * k must be a multiple of 32. `has_mins` is 0 when every min is zero (skips that term).
 * Returns 0, or -1 when scratch memory cannot be allocated. */
int pagedkv_qmatmul(const float *x, int64_t m, int64_t k, const uint8_t *values,
                    const float *scales, const float *mins, int has_mins, int bits, int64_t g,
                    int64_t n, const float *bias, float *y) {
    int64_t groups = k / g;
    int8_t *xq = malloc((size_t)(m * k));
    float *xs = malloc(sizeof(float) * (size_t)(m * groups));
    float *xsum = malloc(sizeof(float) * (size_t)(m * groups));
    int failed = xq == NULL || xs == NULL || xsum == NULL;
    if (!failed) {
        quantize_activations(x, m, k, g, xq, xs, xsum);
        int64_t row_bytes = bits == 4 ? k / 2 : k;
#ifdef __AVX2__
        if (g == 32 && m <= MAX_DOT_ROWS) {
#pragma omp parallel for schedule(static)
            for (int64_t col = 0; col < n; col++) {
                const uint8_t *w = values + col * row_bytes;
                float dots[MAX_DOT_ROWS];
                if (bits == 4)
                    rows_dot32(w, 4, scales + col * groups, xq, xs, k, m, dots);
                else
                    rows_dot32(w, 8, scales + col * groups, xq, xs, k, m, dots);
                for (int64_t r = 0; r < m; r++) {
                    float total = dots[r];
                    if (has_mins) total += dot_floats(mins + col * groups, xsum + r * groups, groups);
                    if (bias != NULL) total += bias[col];
                    y[r * n + col] = total;
                }
            }
            goto done;
        }
#endif
#pragma omp parallel for schedule(static)
        for (int64_t col0 = 0; col0 < n; col0 += COLS) {
            int cols = n - col0 < COLS ? (int)(n - col0) : COLS;
            float dots[COLS][ROWS];
            for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
                int rows = m - r0 < ROWS ? (int)(m - r0) : ROWS;
                tile_dot_any(values + col0 * row_bytes, row_bytes, bits, scales + col0 * groups,
                             xq + r0 * k, xs + r0 * groups, k, g, cols, rows, dots);
                for (int j = 0; j < cols; j++) {
                    int64_t col = col0 + j;
                    for (int r = 0; r < rows; r++) {
                        float total = dots[j][r];
                        if (has_mins)
                            total += dot_floats(mins + col * groups, xsum + (r0 + r) * groups,
                                                groups);
                        if (bias != NULL) total += bias[col];
                        y[(r0 + r) * n + col] = total;
                    }
                }
            }
        }
    }
#ifdef __AVX2__
done:
#endif
    free(xq);
    free(xs);
    free(xsum);
    return failed ? -1 : 0;
}

/* out [n, k] float32 = the weight dequantised: scale * q + min per group. For a large batch
 * one float32 matmul over this (BLAS, compute-bound) beats integer dot products per pair;
 * the caller reuses `out` across layers, so the float copy never stays resident. */
void pagedkv_dequantize(const uint8_t *values, const float *scales, const float *mins, int bits,
                        int64_t g, int64_t n, int64_t k, float *out) {
    int64_t groups = k / g;
    int64_t row_bytes = bits == 4 ? k / 2 : k;
#pragma omp parallel for schedule(static)
    for (int64_t col = 0; col < n; col++) {
        const uint8_t *w = values + col * row_bytes;
        float *dst = out + col * k;
        for (int64_t group = 0; group < groups; group++) {
            float scale = scales[col * groups + group], min = mins[col * groups + group];
            float *d = dst + group * g;
            if (bits == 8) {
                const int8_t *q = (const int8_t *)w + group * g;
                for (int64_t i = 0; i < g; i++) d[i] = scale * (float)q[i] + min;
            } else { /* g == 32: byte j holds values j (low nibble) and j + 16 (high) */
#ifdef __AVX2__
                __m256i q = load_chunk(w, 4, group);
                __m256 vs = _mm256_set1_ps(scale), vm = _mm256_set1_ps(min);
                __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
                for (int h = 0; h < 2; h++) {
                    __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(halves[h]));
                    __m256 b = _mm256_cvtepi32_ps(
                        _mm256_cvtepu8_epi32(_mm_srli_si128(halves[h], 8)));
                    /* multiply, then add: rounded twice, as torch's q * scale + min is */
                    _mm256_storeu_ps(d + 16 * h, _mm256_add_ps(_mm256_mul_ps(a, vs), vm));
                    _mm256_storeu_ps(d + 16 * h + 8, _mm256_add_ps(_mm256_mul_ps(b, vs), vm));
                }
#else
                const uint8_t *q = w + group * 16;
                for (int i = 0; i < 16; i++) d[i] = scale * (float)(q[i] & 15) + min;
                for (int i = 0; i < 16; i++) d[i + 16] = scale * (float)(q[i] >> 4) + min;
#endif
            }
        }
    }
}
