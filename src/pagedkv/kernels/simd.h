/* Shared helpers of the C kernels, each in a vector form and a plain-C twin that gives the
 * very same float bits: a kernel uses the vector form on whole groups of 8 (or 16, where
 * AVX-512 runs two groups' lanes side by side, or masks a group's missing lanes) and the twin
 * on what is left, so a value's arithmetic never depends on where it falls in a batch.
 *
 * Sums of 8 lanes always take one tree, ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)),
 * whether one vector is reduced (`hsum8`) or eight at once (`hsum8x8`).
 */
#ifndef PAGEDKV_SIMD_H
#define PAGEDKV_SIMD_H

#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))

/* The tree sum of 8 floats, in plain C. */
INLINE float hsum8_lanes(const float l[8]) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* exp(x) in plain C, the twin of exp8: x clamped to [-87, 88], x = n ln 2 + r with |r| <=
 * ln 2 / 2, exp(r) by its degree-6 Taylor polynomial (relative error < 2e-7, about one float32
 * ulp), 2^n applied as two exact powers of two so n = 128 does not overflow the exponent. */
INLINE float exp1(float x) {
    x = !(x >= -87.0f) ? -87.0f : (x > 88.0f ? 88.0f : x); /* NaN to -87, as maxps does */
    float n = __builtin_rintf(x * 1.44269504f);
    float r = __builtin_fmaf(-n, 0.693145752f, x);
    r = __builtin_fmaf(-n, 1.42860677e-6f, r);
    float p = 1.0f / 720;
    p = __builtin_fmaf(p, r, 1.0f / 120);
    p = __builtin_fmaf(p, r, 1.0f / 24);
    p = __builtin_fmaf(p, r, 1.0f / 6);
    p = __builtin_fmaf(p, r, 0.5f);
    p = __builtin_fmaf(p, r, 1.0f);
    p = __builtin_fmaf(p, r, 1.0f);
    int32_t half = (int32_t)n >> 1, rest = (int32_t)n - half;
    uint32_t a = (uint32_t)(half + 127) << 23, b = (uint32_t)(rest + 127) << 23;
    float fa, fb;
    memcpy(&fa, &a, 4);
    memcpy(&fb, &b, 4);
    return p * fa * fb;
}

/* bfloat16 and float16 bits as float32 (both exact). */
INLINE float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

INLINE float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: value = mantissa * 2^-24, exact in float32 */
        float f = (float)mantissa * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#ifdef __AVX2__
/* The tree sum of v's 8 lanes. */
INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* [hsum8(v[0]), ..., hsum8(v[7])] as one vector, by the same tree. */
INLINE __m256 hsum8x8(const __m256 v[8]) {
    __m256 pair[4];
    for (int i = 0; i < 4; i++) { /* lane j < 4: v[2i] lanes j + (j+4); j >= 4: v[2i+1] */
        __m256 a = v[2 * i], b = v[2 * i + 1];
        pair[i] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20),
                                _mm256_permute2f128_ps(a, b, 0x31));
    }
    /* per 128-bit half [s0 s1 s2 s3] of pair i: (s0 + s2), (s1 + s3), then their sum */
    __m256 q[4];
    for (int i = 0; i < 4; i++)
        q[i] = _mm256_add_ps(pair[i], _mm256_permute_ps(pair[i], 0x4E)); /* lanes 2,3,0,1 */
    for (int i = 0; i < 4; i++)
        q[i] = _mm256_add_ps(q[i], _mm256_permute_ps(q[i], 0xB1)); /* lanes 1,0,3,2 */
    /* q[i] lane 0 holds hsum(v[2i]), lane 4 hsum(v[2i+1]); gather lanes 0 and 4 of each */
    __m256 ab = _mm256_shuffle_ps(q[0], q[1], 0x00); /* v0 v0 v2 v2 | v1 v1 v3 v3 */
    __m256 cd = _mm256_shuffle_ps(q[2], q[3], 0x00); /* v4 v4 v6 v6 | v5 v5 v7 v7 */
    __m256 mixed = _mm256_shuffle_ps(ab, cd, 0x88);  /* v0 v2 v4 v6 | v1 v3 v5 v7 */
    __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    return _mm256_permutevar8x32_ps(mixed, order);
}

#ifdef __AVX512F__
/* The high 256 bits of x (AVX-512F alone has no float form of this). */
INLINE __m256 high_half(__m512 x) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
}

/* hsum8x8 of v's low 256-bit halves in the low half of the result, of their high halves in
 * the high half: the same tree (each step works within 128-bit lanes or pairs them as
 * hsum8x8 does), sixteen sums for the instructions of eight. */
INLINE __m512 hsum8x8_halves(const __m512 v[8]) {
    const __m512i low = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(4));
    __m512 pair[4];
    for (int i = 0; i < 4; i++) { /* per half, as hsum8x8's permute2f128 pair */
        __m512 a = v[2 * i], b = v[2 * i + 1];
        pair[i] = _mm512_add_ps(_mm512_permutex2var_ps(a, low, b),
                                _mm512_permutex2var_ps(a, high, b));
    }
    __m512 q[4];
    for (int i = 0; i < 4; i++) q[i] = _mm512_add_ps(pair[i], _mm512_permute_ps(pair[i], 0x4E));
    for (int i = 0; i < 4; i++) q[i] = _mm512_add_ps(q[i], _mm512_permute_ps(q[i], 0xB1));
    __m512 ab = _mm512_shuffle_ps(q[0], q[1], 0x00);
    __m512 cd = _mm512_shuffle_ps(q[2], q[3], 0x00);
    __m512 mixed = _mm512_shuffle_ps(ab, cd, 0x88);
    __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    return _mm512_permutexvar_ps(order, mixed);
}
#endif

/* exp of a vector of W / 32 floats, lane for lane the bits of exp1: one body for the 8-lane
 * exp8 and the 16-lane exp16, so that the two cannot take different steps. ROUND rounds to
 * the nearest integer (AVX-512 names it roundscale). */
#define DEFINE_EXP(NAME, W, ROUND)                                                             \
    INLINE __m##W NAME(__m##W x) {                                                             \
        x = _mm##W##_min_ps(_mm##W##_max_ps(x, _mm##W##_set1_ps(-87.0f)),                     \
                            _mm##W##_set1_ps(88.0f));                                          \
        __m##W n = ROUND(_mm##W##_mul_ps(x, _mm##W##_set1_ps(1.44269504f)),                    \
                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                       \
        __m##W r = _mm##W##_fnmadd_ps(n, _mm##W##_set1_ps(0.693145752f), x);                   \
        r = _mm##W##_fnmadd_ps(n, _mm##W##_set1_ps(1.42860677e-6f), r);                        \
        __m##W p = _mm##W##_set1_ps(1.0f / 720);                                               \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.0f / 120));                             \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.0f / 24));                              \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.0f / 6));                               \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(0.5f));                                   \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.0f));                                   \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.0f));                                   \
        __m##W##i ni = _mm##W##_cvtps_epi32(n);                                                \
        __m##W##i half = _mm##W##_srai_epi32(ni, 1), rest = _mm##W##_sub_epi32(ni, half);      \
        __m##W##i bias = _mm##W##_set1_epi32(127);                                             \
        __m##W##i a_bits = _mm##W##_slli_epi32(_mm##W##_add_epi32(half, bias), 23);           \
        __m##W##i b_bits = _mm##W##_slli_epi32(_mm##W##_add_epi32(rest, bias), 23);           \
        __m##W fa = _mm##W##_castsi##W##_ps(a_bits), fb = _mm##W##_castsi##W##_ps(b_bits);     \
        return _mm##W##_mul_ps(_mm##W##_mul_ps(p, fa), fb);                                    \
    }

DEFINE_EXP(exp8, 256, _mm256_round_ps)
#ifdef __AVX512F__
DEFINE_EXP(exp16, 512, _mm512_roundscale_ps)
#endif
#endif

#endif
