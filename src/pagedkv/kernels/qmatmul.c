/* y = x W^T + b with W a QuantizedTensor (see formats.py), on the CPU, one numeric path for
 * every row count: a row's result never depends on how many rows share the call.
 *
 * The activations are quantised first, per row and per group of the weight's group size, to
 * int8 with one float scale (amax / 127) and their integer sum, as llama.cpp does for prompts
 * and decode steps alike. Every group's product is then an integer dot product, exact in any
 * order, scaled once:
 *
 *   sum_i w_i x_i ~ scale_w * scale_x * sum_i q_i xq_i + min_w * (scale_x * sum_i xq_i)
 *
 * which is the dequantised weight (scale_w * q_i + min_w) times the quantised activations, as
 * llama.cpp's Q8_1 sum gives it. The min's term takes the quantised activations' sum, not their
 * exact one: the rounding errors of the activations then meet the weight itself, whose values
 * straddle 0, rather than scale_w * q_i, which are all of one sign and add them up. With the
 * exact sum a 4-bit product with mins had ~2.7x the error (relative 0.015 against 0.0055, as
 * with no mins), a 4-bit model's perplexity ~1% more.
 *
 * The float part is where order matters, and it is fixed per (row, column): whole blocks of 8
 * groups accumulate into 8 lanes (lane j: group j of each block, `fma(dot, scale, acc)` then
 * `fma(min, sum, acc)`, blocks in order), the lanes are summed by simd.h's tree, the groups past
 * the last whole block follow one by one, then the bias. The plain C twin below gives the same
 * bits, so a build without AVX2 agrees with one with it, and AVX-512 VNNI's integer dot products
 * (64 bytes, two of AVX2's vectors, per instruction) equal AVX2's two-instruction ones: integer
 * sums are exact in any order.
 *
 * Weight bytes are kept in "kernel order" (formats.py): within a whole block of 8 groups, 4-byte
 * unit u of group j is stored at unit u * 8 + j, so one 32-byte load holds a unit of each of the
 * 8 groups and the integer products of 8 groups accumulate in 8 lanes with no horizontal sums.
 * The activations are quantised into the same order. Groups past the last whole block keep
 * ggml's order (a 4-bit group's byte b holds value b in its low nibble, b + 16 in its high one).
 *
 * On AVX-512 VNNI builds a layer's weights come in the panel layout instead (quant/panels.py,
 * pagedkv_qmatmul_panels below): the same products and floats, fewer instructions.
 *
 * Threads split output columns (8 at a time) inside tiles of rows sized to stay in cache;
 * the library shares PyTorch's OpenMP pool, so torch.set_num_threads governs it too.
 *
 * AVX-512 builds (VNNI, BW, DQ) change how much one instruction does, never what a lane
 * computes: 8 rows (not 4) share each unpacked block, two columns share each 16-lane vector of
 * the float arithmetic (block_lanes_pair), and tail groups of 32 take VNNI's dot products over
 * 8 columns at once (tail_dots8). Several rows at once is the common case since speculative
 * decoding: a step verifies a sequence's token and its drafts, 2 to 9 rows, where it used to
 * take one. Measured on a 2-core Xeon (2 threads), 6 rows against the 4-row code before:
 * 1.3-1.5x faster where the input is 576 wide (SmolLM2-135M: two tail groups a row), 1.1-1.2x
 * at 1536 (no tail); end to end, prompts 1.2x and batches 1.15x (bench/before_after.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_max_threads(void) { return 1; }
#endif

#include "simd.h"

/* Bytes of activations one row tile keeps in cache while the weights stream past it. */
#define TILE_BYTES 16384

/* How far ahead of the block being computed its column's weight bytes are asked for (the
 * columns a thread takes are consecutive in memory, so this runs into the next ones), and its
 * scales and mins. Asking a block at a time, between the blocks' arithmetic, keeps the memory
 * busy while the cores compute: on a 2-core Xeon a 1B model's matmuls went from 72% to 85% of
 * the machine's read bandwidth (asking for a column group's 8 KiB at once, or relying on the
 * hardware's prefetcher alone, stalls the core on the stream, then computes with it idle). */
#define PREFETCH_VALUES 2048
#define PREFETCH_SCALES 512

/* Which 32-byte activation vector of a block (0 .. g/4 - 1) holds values 4u .. 4u + 3 of each
 * group: for 8 bits vector u, beside weight unit u; for 4 bits, per pair of weight units (w, w +
 * 1) the low nibbles of both (values 4w.., 4w + 4..), then the high ones (16 + 4w.., 20 + 4w..),
 * so one 64-byte load of weights (two units) meets 64 contiguous bytes of activations. */
static inline int64_t act_vector(int bits, int64_t u) {
    return bits == 8 ? u : 4 * ((u % 4) / 2) + 2 * (u / 4) + u % 2;
}

/* Where quantize_row puts values 4u .. 4u + 3 of `group` in its int8 row: in a block of 8
 * groups (groups before `blocked`) at act_vector's place, else in order. */
static inline int64_t unit_at(int bits, int64_t g, int64_t group, int64_t blocked, int64_t u) {
    return group < blocked ? (group / 8) * 8 * g + act_vector(bits, u) * 32 + (group % 8) * 4
                           : group * g + 4 * u;
}

/* int8 activations of one row [k] in kernel order (in natural order when `natural`, as the
 * panel layout takes them), with per-group scale, integer sum and the quantised values' sum
 * (scale x integer sum, one float product). A value's int8 is nearbyint(value x 127 / amax); the
 * AVX2 path rounds the same way (to nearest, ties to even), so both give the same bytes and
 * floats. */
static void quantize_row(const float *x, int64_t k, int64_t g, int bits, int natural, int8_t *xq,
                         float *xs, float *xsum, int32_t *xisum) {
    int64_t groups = k / g, blocked = natural ? 0 : groups / 8 * 8;
    for (int64_t group = 0; group < groups; group++) {
        const float *v = x + group * g;
        float amax = 0.0f, inverse;
        int32_t isum = 0;
#ifdef __AVX2__
        const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        __m256 most = _mm256_setzero_ps();
        for (int64_t i = 0; i < g; i += 8)
            most = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(v + i), magnitude), most);
        float most_lanes[8];
        _mm256_storeu_ps(most_lanes, most);
        for (int l = 0; l < 8; l++) amax = most_lanes[l] > amax ? most_lanes[l] : amax;
        inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        /* Each int32's low byte is its int8 (as the cast keeps it), the byte shuffle taking
         * them in order, two units of four per 8 values; the integer sum adds those bytes. */
        const __m256i low_bytes = _mm256_setr_epi8(
            0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
            0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
        __m256i isums = _mm256_setzero_si256();
        for (int64_t i = 0; i < g; i += 8) {
            __m256 scaled = _mm256_mul_ps(_mm256_loadu_ps(v + i), _mm256_set1_ps(inverse));
            __m256 rounded = _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m256i units = _mm256_cvtps_epi32(rounded);
            isums = _mm256_add_epi32(isums, _mm256_srai_epi32(_mm256_slli_epi32(units, 24), 24));
            __m256i packed = _mm256_shuffle_epi8(units, low_bytes);
            int32_t low = _mm_cvtsi128_si32(_mm256_castsi256_si128(packed));
            int32_t high = _mm_cvtsi128_si32(_mm256_extracti128_si256(packed, 1));
            memcpy(xq + unit_at(bits, g, group, blocked, i / 4), &low, 4);
            memcpy(xq + unit_at(bits, g, group, blocked, i / 4 + 1), &high, 4);
        }
        int32_t isum_lanes[8];
        _mm256_storeu_si256((__m256i *)isum_lanes, isums);
        for (int l = 0; l < 8; l++) isum += isum_lanes[l];
#else
        for (int64_t i = 0; i < g; i++) {
            float a = fabsf(v[i]);
            amax = a > amax ? a : amax;
        }
        inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int64_t u = 0; u < g / 4; u++) {
            int8_t unit[4];
            for (int e = 0; e < 4; e++) {
                unit[e] = (int8_t)(int32_t)nearbyintf(v[4 * u + e] * inverse);
                isum += unit[e];
            }
            memcpy(xq + unit_at(bits, g, group, blocked, u), unit, 4);
        }
#endif
        xs[group] = amax / 127.0f;
        xsum[group] = xs[group] * (float)isum;
        xisum[group] = isum;
    }
}

/* One call's activations, quantised per row by quantize_row: int8 values [m][k], and per row
 * and group the scale, the quantised values' sum (scale x integer sum: the min's term) and the
 * integer sum [m][groups]. */
typedef struct {
    int8_t *q;
    float *scale, *sum;
    int32_t *isum;
} Activations;

/* Room for m rows of k values in groups of g; 0, or -1 when memory runs out. Freed by
 * activations_free either way. */
static int activations_alloc(Activations *a, int64_t m, int64_t k, int64_t g) {
    a->q = malloc((size_t)(m * k));
    a->scale = malloc(sizeof(float) * (size_t)(m * (k / g)));
    a->sum = malloc(sizeof(float) * (size_t)(m * (k / g)));
    a->isum = malloc(sizeof(int32_t) * (size_t)(m * (k / g)));
    return a->q == NULL || a->scale == NULL || a->sum == NULL || a->isum == NULL ? -1 : 0;
}

static void activations_free(Activations *a) {
    free(a->q);
    free(a->scale);
    free(a->sum);
    free(a->isum);
}

/* quantize_row for each of x's m rows, the rows shared among the threads of the enclosing
 * parallel region. */
static void quantize_rows(const float *x, int64_t m, int64_t k, int64_t g, int bits, int natural,
                          const Activations *a) {
    int64_t groups = k / g;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; r++)
        quantize_row(x + r * k, k, g, bits, natural, a->q + r * k, a->scale + r * groups,
                     a->sum + r * groups, a->isum + r * groups);
}

/* Value i of group j (0..7) of a whole block, from its kernel-order bytes. */
static inline int32_t block_value(const uint8_t *block, int bits, int64_t j, int64_t i) {
    if (bits == 8) return (int8_t)block[(i / 4) * 32 + j * 4 + i % 4];
    uint8_t byte = block[((i % 16) / 4) * 32 + j * 4 + i % 4];
    return i < 16 ? byte & 15 : byte >> 4;
}

/* Value i of a group past the whole blocks, from its ggml-order bytes. */
static inline int32_t tail_value(const uint8_t *group, int bits, int64_t i) {
    if (bits == 8) return (int8_t)group[i];
    return i < 16 ? group[i] & 15 : group[i - 16] >> 4;
}

/* The exact integer dot product of `g` weight values (ggml order) with activations, one by one.
 * GCC 12 vectorises this signed x signed byte product with VNNI's vpdpbusd, which reads the
 * weights as unsigned: wrong sums on AVX-512 VNNI builds. So the loop stays scalar. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-tree-vectorize")))
#endif
static int32_t scalar_dot(const uint8_t *w, const int8_t *a, int bits, int64_t g) {
    int32_t dot = 0;
    for (int64_t i = 0; i < g; i++) dot += tail_value(w, bits, i) * (int32_t)a[i];
    return dot;
}

#ifdef __AVX2__
/* Whether a tail group's products take the vector path (tail_weights, tail_product): 8-bit
 * groups of 16 and any group of 32; the rest go one by one (scalar_dot). */
INLINE int vector_tail(int bits, int64_t g) { return (bits == 8 && g == 16) || g == 32; }

/* A tail group's weights as maddubs takes them, unpacked once for every row: `u` the unsigned
 * factors (4 bits: the nibbles; 8 bits: |w|, the weight lending x its sign), `w` the raw bytes. */
typedef struct {
    __m256i u, w;
} TailWeights;

INLINE TailWeights tail_weights(const uint8_t *w, int bits, int64_t g) {
    TailWeights t;
    if (g == 16) {
        __m128i wv = _mm_loadu_si128((const __m128i *)w);
        t.w = _mm256_zextsi128_si256(wv);
        t.u = _mm256_zextsi128_si256(_mm_sign_epi8(wv, wv));
    } else if (bits == 8) {
        t.w = _mm256_loadu_si256((const __m256i *)w);
        t.u = _mm256_sign_epi8(t.w, t.w);
    } else {
        __m128i packed = _mm_loadu_si128((const __m128i *)w);
        t.w = t.u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed),
                                     _mm256_set1_epi8(0x0F));
    }
    return t;
}

/* A tail group's integer products with its (natural-order) activations as 8 int32 lanes whose
 * sum is the exact dot product (g = 16: 4 lanes, the rest zero). */
INLINE __m256i tail_product(TailWeights t, const int8_t *a, int bits, int64_t g) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (g == 16) {
        __m128i av = _mm_loadu_si128((const __m128i *)a);
        __m128i pairs = _mm_maddubs_epi16(_mm256_castsi256_si128(t.u),
                                          _mm_sign_epi8(av, _mm256_castsi256_si128(t.w)));
        return _mm256_zextsi128_si256(_mm_madd_epi16(pairs, _mm256_castsi256_si128(ones)));
    }
    __m256i av = _mm256_loadu_si256((const __m256i *)a);
    __m256i x = bits == 8 ? _mm256_sign_epi8(av, t.w) : av;
    return _mm256_madd_epi16(_mm256_maddubs_epi16(t.u, x), ones);
}

/* The lane sums of 8 vectors, lane c the sum of p[c]'s lanes (exact: integers). */
INLINE __m256i hsum8x8_epi32(const __m256i p[8]) {
    __m256i s01 = _mm256_hadd_epi32(p[0], p[1]), s23 = _mm256_hadd_epi32(p[2], p[3]);
    __m256i s45 = _mm256_hadd_epi32(p[4], p[5]), s67 = _mm256_hadd_epi32(p[6], p[7]);
    __m256i s0123 = _mm256_hadd_epi32(s01, s23), s4567 = _mm256_hadd_epi32(s45, s67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(s0123, s4567, 0x20),
                            _mm256_permute2x128_si256(s0123, s4567, 0x31));
}
#endif

/* The exact integer dot product of a tail group with its (natural-order) activations. */
static int32_t tail_dot(const uint8_t *w, const int8_t *a, int bits, int64_t g) {
#ifdef __AVX2__
    if (vector_tail(bits, g)) {
        __m256i d = tail_product(tail_weights(w, bits, g), a, bits, g);
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
        return _mm_cvtsi128_si32(h);
    }
#endif
    return scalar_dot(w, a, bits, g);
}

/* Rows of activations sharing each loaded (and unpacked) block of weights: 8 where AVX-512's
 * 32 vector registers hold their accumulators (a speculative step's 6 rows, or a prompt's,
 * then unpack each block once), else 4. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define ROWS 8
#else
#define ROWS 4
#endif

/* Scale or min `at` of an array of float32, or of float16 when `half` (formats.py: exact
 * either way, so the arithmetic after the load is the same). */
INLINE float scale_at(const void *p, int64_t at, int half) {
    if (!half) return ((const float *)p)[at];
#ifdef __F16C__
    return _cvtsh_ss(((const uint16_t *)p)[at]);
#else
    return f16_to_f32(((const uint16_t *)p)[at]);
#endif
}

#ifdef __AVX2__
/* Scales or mins at .. at + 7 as float32 lanes. */
INLINE __m256 scales8(const void *p, int64_t at, int half) {
    if (!half) return _mm256_loadu_ps((const float *)p + at);
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + at)));
#else
    float lanes[8];
    for (int j = 0; j < 8; j++) lanes[j] = scale_at(p, at + j, 1);
    return _mm256_loadu_ps(lanes);
#endif
}

/* Scales or mins at, at + stride, ..., at + 7 stride (one group of 8 columns) as float32
 * lanes, gathered in registers: eight scalar stores read back as one vector would stall on
 * store forwarding, once per row and tail group. A float16 is gathered as the high half of
 * the 32 bits ending with it, so nothing past the array is read (the first column's first
 * group, with nothing before it, takes the lanes one by one). */
INLINE __m256 scales8_strided(const void *p, int64_t at, int64_t stride, int half) {
    const __m256i index = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                             _mm256_set1_epi32((int)stride));
    if (!half) return _mm256_i32gather_ps((const float *)p + at, index, 4);
#ifdef __F16C__
    if (at > 0) {
        __m256i words = _mm256_srli_epi32(
            _mm256_i32gather_epi32((const int *)((const uint16_t *)p + at - 1), index, 2), 16);
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(words, words), 0x08);
        return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
    }
#endif
    return _mm256_set_ps(scale_at(p, at + 7 * stride, half), scale_at(p, at + 6 * stride, half),
                         scale_at(p, at + 5 * stride, half), scale_at(p, at + 4 * stride, half),
                         scale_at(p, at + 3 * stride, half), scale_at(p, at + 2 * stride, half),
                         scale_at(p, at + stride, half), scale_at(p, at, half));
}

/* Ask for a column's weight bytes PREFETCH_VALUES past whole block `b`, and every 64 bytes of
 * its scales (and mins) PREFETCH_SCALES past the block's: see PREFETCH_VALUES. */
INLINE void prefetch_block(const uint8_t *w, const void *ws, const void *wmin, int has_mins,
                           int64_t b, int64_t block_bytes, int64_t scale_bytes) {
    for (int64_t at = 0; at < block_bytes; at += 64)
        _mm_prefetch((const char *)w + b * block_bytes + PREFETCH_VALUES + at, _MM_HINT_T0);
    if (8 * b * scale_bytes % 64 == 0) {
        _mm_prefetch((const char *)ws + 8 * b * scale_bytes + PREFETCH_SCALES, _MM_HINT_T0);
        if (has_mins)
            _mm_prefetch((const char *)wmin + 8 * b * scale_bytes + PREFETCH_SCALES, _MM_HINT_T0);
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* A whole block's weights as its integer products take them, two 32-byte vectors to a 64-byte
 * one (vector t holds vectors 2t and 2t + 1 of the 256-bit form): 4 bits, nibbles (values
 * 0..15, unsigned); 8 bits, shifted to unsigned (w + 128). Half the instructions per block. */
typedef struct {
    __m512i v[4];
} Unpacked;

INLINE void unpack_block(const uint8_t *w, int bits, int64_t g, Unpacked *out) {
    if (bits == 4) {
        const __m512i mask = _mm512_set1_epi8(0x0F);
        for (int t = 0; t < 2; t++) {
            __m512i p = _mm512_loadu_si512((const void *)(w + 64 * t));
            out->v[2 * t] = _mm512_and_si512(p, mask);
            out->v[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(p, 4), mask);
        }
        return;
    }
    for (int t = 0; t < g / 8; t++)
        out->v[t] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(w + 64 * t)),
                                     _mm512_set1_epi8((char)0x80));
}

/* The 8 groups' exact integer dot products of one whole block with one row's activations, lane
 * j for group j: the two 256-bit halves hold parts of the same groups, and are added. */
INLINE __m256i block_dots(const Unpacked *wv, const int8_t *a, int bits, int64_t g,
                          const int32_t *isum) {
    int vectors = bits == 4 ? 4 : (int)(g / 8);
    __m512i acc = _mm512_setzero_si512(), acc2 = _mm512_setzero_si512();
    for (int t = 0; t < vectors; t += 2) {
        acc = _mm512_dpbusd_epi32(acc, wv->v[t], _mm512_loadu_si512((const void *)(a + 64 * t)));
        acc2 = _mm512_dpbusd_epi32(acc2, wv->v[t + 1],
                                   _mm512_loadu_si512((const void *)(a + 64 * t + 64)));
    }
    acc = _mm512_add_epi32(acc, acc2);
    __m256i dots = _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
    if (bits == 8) /* (w + 128) x summed, less 128 * sum(x) */
        dots = _mm256_sub_epi32(dots, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)isum), 7));
    return dots;
}
#else
/* One whole block's weights as the vectors its integer products take: 4 bits, 8 vectors of
 * nibbles (each unit's low and high nibbles, in act_vector's order: values 0..15, unsigned);
 * 8 bits, g / 4 vectors as stored. */
typedef struct {
    __m256i v[8];
} Unpacked;

INLINE void unpack_block(const uint8_t *w, int bits, int64_t g, Unpacked *out) {
    if (bits == 4) {
        const __m256i mask = _mm256_set1_epi8(0x0F);
        for (int u = 0; u < 4; u++) {
            __m256i p = _mm256_loadu_si256((const __m256i *)(w + 32 * u));
            out->v[act_vector(4, u)] = _mm256_and_si256(p, mask);
            out->v[act_vector(4, u + 4)] = _mm256_and_si256(_mm256_srli_epi16(p, 4), mask);
        }
        return;
    }
    for (int u = 0; u < g / 4; u++) out->v[u] = _mm256_loadu_si256((const __m256i *)(w + 32 * u));
}

/* The 8 groups' exact integer dot products of one whole block with one row's activations (g / 4
 * vectors, vector t beside weight vector t), lane j for group j. */
INLINE __m256i block_dots(const Unpacked *unpacked, const int8_t *a, int bits, int64_t g,
                          const int32_t *isum) {
    const __m256i *wv = unpacked->v;
    int vectors = (int)(g / 4);
    const __m256i ones = _mm256_set1_epi16(1);
    (void)isum;
    if (bits == 4) { /* 8 int16 sums of two 15 * 127 products stay below 2^15 */
        __m256i sum16 = _mm256_setzero_si256();
        for (int t = 0; t < 8; t++)
            sum16 = _mm256_add_epi16(
                sum16, _mm256_maddubs_epi16(wv[t], _mm256_loadu_si256((const __m256i *)(a + 32 * t))));
        return _mm256_madd_epi16(sum16, ones);
    }
    /* maddubs multiplies unsigned by signed bytes: the weight lends x its sign */
    __m256i acc = _mm256_setzero_si256();
    for (int t = 0; t < vectors; t++) {
        __m256i av = _mm256_loadu_si256((const __m256i *)(a + 32 * t));
        __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(wv[t], wv[t]), _mm256_sign_epi8(av, wv[t]));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
    }
    return acc;
}
#endif
#endif

/* The 8 accumulator lanes of one column with `rows` consecutive activation rows (k bytes
 * apart): whole blocks only, each block's weights loaded once for all rows. */
INLINE void block_lanes(const uint8_t *w, const void *ws, const void *wmin, int half,
                        const int8_t *a, const float *xs, const float *xsum, const int32_t *xisum,
                        int bits, int64_t g, int64_t k, int64_t blocks, int has_mins, int rows,
                        float lanes[ROWS][8]) {
    int64_t block_bytes = 8 * g * bits / 8, groups = k / g;
#ifdef __AVX2__
    __m256 acc[ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    int64_t scale_bytes = half ? 2 : 4;
    for (int64_t b = 0; b < blocks; b++) {
        Unpacked wv;
        prefetch_block(w, ws, wmin, has_mins, b, block_bytes, scale_bytes);
        unpack_block(w + b * block_bytes, bits, g, &wv);
        __m256 scale = scales8(ws, 8 * b, half);
        __m256 wm = has_mins ? scales8(wmin, 8 * b, half) : _mm256_setzero_ps();
        for (int r = 0; r < rows; r++) {
            int64_t at = r * groups + 8 * b;
            __m256i dots = block_dots(&wv, a + r * k + b * 8 * g, bits, g, xisum + at);
            __m256 both = _mm256_mul_ps(scale, _mm256_loadu_ps(xs + at));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), both, acc[r]);
            if (has_mins) acc[r] = _mm256_fmadd_ps(wm, _mm256_loadu_ps(xsum + at), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm256_storeu_ps(lanes[r], acc[r]);
#else
    (void)xisum;
    for (int r = 0; r < rows; r++) {
        float *lane = lanes[r];
        for (int j = 0; j < 8; j++) lane[j] = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *block = w + b * block_bytes;
            const int8_t *ab = a + r * k + b * 8 * g;
            for (int64_t j = 0; j < 8; j++) {
                int32_t dot = 0;
                for (int64_t i = 0; i < g; i++) {
                    int64_t at = act_vector(bits, i / 4) * 32 + j * 4 + i % 4;
                    dot += block_value(block, bits, j, i) * (int32_t)ab[at];
                }
                int64_t at = r * groups + 8 * b + j;
                lane[j] = __builtin_fmaf((float)dot, scale_at(ws, 8 * b + j, half) * xs[at],
                                         lane[j]);
                if (has_mins)
                    lane[j] = __builtin_fmaf(scale_at(wmin, 8 * b + j, half), xsum[at], lane[j]);
            }
        }
    }
#endif
}

#if defined(__AVX2__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define PAIRED_COLUMNS 1
/* block_lanes for two adjacent columns at once (the second one's values `col_bytes`, its
 * scales and mins `groups` further on): each lane's arithmetic is block_lanes', bit for bit, on
 * 16-lane vectors (lanes 0..7 the first column's groups, 8..15 the second's), so the floats'
 * conversions, products and accumulations take half the instructions of two calls, and each
 * row's activations are loaded once for both columns. */
INLINE void block_lanes_pair(const uint8_t *w, const void *ws, const void *wmin, int half,
                             const int8_t *a, const float *xs, const float *xsum,
                             const int32_t *xisum, int bits, int64_t g, int64_t k, int64_t blocks,
                             int has_mins, int rows, float lanes0[ROWS][8],
                             float lanes1[ROWS][8]) {
    int64_t block_bytes = 8 * g * bits / 8, groups = k / g, col_bytes = k * bits / 8;
    int64_t scale_bytes = half ? 2 : 4;
    int vectors = bits == 4 ? 4 : (int)(g / 8);
    const uint8_t *w1 = w + col_bytes;
    const char *ws1 = (const char *)ws + groups * scale_bytes,
               *wmin1 = (const char *)wmin + groups * scale_bytes;
    __m512 acc[ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        Unpacked wv0, wv1;
        prefetch_block(w, ws, wmin, has_mins, b, block_bytes, scale_bytes);
        prefetch_block(w1, ws1, wmin1, has_mins, b, block_bytes, scale_bytes);
        unpack_block(w + b * block_bytes, bits, g, &wv0);
        unpack_block(w1 + b * block_bytes, bits, g, &wv1);
        __m512 scale = _mm512_insertf32x8(_mm512_castps256_ps512(scales8(ws, 8 * b, half)),
                                          scales8(ws1, 8 * b, half), 1);
        __m512 wm = has_mins ? _mm512_insertf32x8(
                                   _mm512_castps256_ps512(scales8(wmin, 8 * b, half)),
                                   scales8(wmin1, 8 * b, half), 1)
                             : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            int64_t at = r * groups + 8 * b;
            const int8_t *ab = a + r * k + b * 8 * g;
            __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
            for (int t = 0; t < vectors; t++) {
                __m512i av = _mm512_loadu_si512((const void *)(ab + 64 * t));
                d0 = _mm512_dpbusd_epi32(d0, wv0.v[t], av);
                d1 = _mm512_dpbusd_epi32(d1, wv1.v[t], av);
            }
            /* lane j + lane j + 8 of each column: its group j's exact sum */
            __m512i dots = _mm512_add_epi32(_mm512_shuffle_i64x2(d0, d1, 0x44),
                                            _mm512_shuffle_i64x2(d0, d1, 0xEE));
            if (bits == 8) /* (w + 128) x summed, less 128 * sum(x) */
                dots = _mm512_sub_epi32(
                    dots, _mm512_slli_epi32(_mm512_broadcast_i32x8(_mm256_loadu_si256(
                                                (const __m256i *)(xisum + at))),
                                            7));
            __m512 both = _mm512_mul_ps(scale, _mm512_broadcast_f32x8(_mm256_loadu_ps(xs + at)));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), both, acc[r]);
            if (has_mins)
                acc[r] = _mm512_fmadd_ps(wm, _mm512_broadcast_f32x8(_mm256_loadu_ps(xsum + at)),
                                         acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(lanes0[r], _mm512_castps512_ps256(acc[r]));
        _mm256_storeu_ps(lanes1[r], _mm512_extractf32x8_ps(acc[r], 1));
    }
}

/* One tail group of 32 values of 8 consecutive columns (`row_bytes` apart), as dpbusd takes
 * them: 8 bits, v[j] = [column 2j's values | column 2j + 1's], shifted to unsigned (w + 128,
 * which the caller corrects with 128 x the activations' integer sum); 4 bits, columns 4h ..
 * 4h + 3 a 128-bit lane each, v[2h] their low nibbles (ggml's values 0..15), v[2h + 1] their
 * high ones (16..31). */
typedef struct {
    __m512i v[4];
} TailColumns;

INLINE void tail_columns(const uint8_t *w, int64_t row_bytes, int bits, TailColumns *t) {
    if (bits == 8) {
        for (int j = 0; j < 4; j++) {
            const uint8_t *c = w + 2 * j * row_bytes;
            __m256i first = _mm256_loadu_si256((const __m256i *)c);
            __m256i second = _mm256_loadu_si256((const __m256i *)(c + row_bytes));
            t->v[j] = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1),
                                       _mm512_set1_epi8((char)0x80));
        }
        return;
    }
    const __m512i mask = _mm512_set1_epi8(0x0F);
    for (int h = 0; h < 2; h++) {
        const uint8_t *c = w + 4 * h * row_bytes, *c2 = c + 2 * row_bytes;
        __m512i packed = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)c));
        packed = _mm512_inserti32x4(packed, _mm_loadu_si128((const __m128i *)(c + row_bytes)), 1);
        packed = _mm512_inserti32x4(packed, _mm_loadu_si128((const __m128i *)c2), 2);
        packed = _mm512_inserti32x4(packed, _mm_loadu_si128((const __m128i *)(c2 + row_bytes)), 3);
        t->v[2 * h] = _mm512_and_si512(packed, mask);
        t->v[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), mask);
    }
}

/* The 8 columns' exact dot products with one row's tail group (natural order, 32 bytes), lane c
 * for column c, in place of 8 maddubs products and their horizontal sums: dpbusd, then each
 * column's partial lanes summed (exact: integers). */
INLINE __m256i tail_dots8(const TailColumns *t, const int8_t *a, int bits) {
    if (bits == 4) {
        __m512i low = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)a));
        __m512i high = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(a + 16)));
        __m512i p0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), t->v[0], low);
        __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), t->v[2], low);
        p0 = _mm512_dpbusd_epi32(p0, t->v[1], high); /* 128-bit lane c: column c's partials */
        p1 = _mm512_dpbusd_epi32(p1, t->v[3], high); /* and column 4 + c's */
        __m512i q = _mm512_add_epi32(_mm512_unpacklo_epi32(p0, p1), _mm512_unpackhi_epi32(p0, p1));
        q = _mm512_add_epi32(q, _mm512_shuffle_epi32(q, 0x4E)); /* lane c: [c, 4 + c, c, 4 + c] */
        return _mm512_castsi512_si256(_mm512_permutexvar_epi32(
            _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), q));
    }
    __m512i x = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)a)), p[4];
    for (int j = 0; j < 4; j++) p[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), t->v[j], x);
    /* p[j]: column 2j in lanes 0..7, 2j + 1 in 8..15 */
    __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(p[0], p[1]),
                                  _mm512_unpackhi_epi32(p[0], p[1]));
    __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2], p[3]),
                                  _mm512_unpackhi_epi32(p[2], p[3]));
    /* per 128-bit lane: the sums of its 4 lanes of p[0], p[1], p[2], p[3] */
    __m512i q = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
    /* 128-bit lanes 0 + 1: columns 0, 2, 4, 6; lanes 2 + 3: columns 1, 3, 5, 7 */
    q = _mm512_add_epi32(q, _mm512_shuffle_i64x2(q, q, 0xB1));
    return _mm512_castsi512_si256(_mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0), q));
}
#else
#define PAIRED_COLUMNS 0
#endif

/* CALL(R, H, BITS, G) with the row count `rows`, the scale width `half` and the layout (`bits`,
 * `g`) as constants, one copy per case, then return. */
#define LAYOUT(CALL, R, H)                                                                     \
    if (bits == 4)                                                                             \
        CALL(R, H, 4, 32)                                                                      \
    else if (g == 32)                                                                          \
        CALL(R, H, 8, 32)                                                                      \
    else                                                                                       \
        CALL(R, H, 8, 16)
#define CASE(CALL, R)                                                                          \
    if (rows == R) {                                                                           \
        if (half) {                                                                            \
            LAYOUT(CALL, R, 1)                                                                 \
        } else {                                                                               \
            LAYOUT(CALL, R, 0)                                                                 \
        }                                                                                      \
        return;                                                                                \
    }
#if ROWS == 8
#define SPECIALISED(CALL)                                                                      \
    CASE(CALL, 4) CASE(CALL, 1) CASE(CALL, 2) CASE(CALL, 3)                                    \
    CASE(CALL, 8) CASE(CALL, 5) CASE(CALL, 6) CASE(CALL, 7)
#else
#define SPECIALISED(CALL) CASE(CALL, 4) CASE(CALL, 1) CASE(CALL, 2) CASE(CALL, 3)
#endif

/* block_lanes, specialised. */
static void block_lanes_any(const uint8_t *w, const void *ws, const void *wmin, int half,
                            const int8_t *a, const float *xs, const float *xsum,
                            const int32_t *xisum, int bits, int64_t g, int64_t k, int64_t blocks,
                            int has_mins, int rows, float lanes[ROWS][8]) {
#define CALL(R, H, BITS, G)                                                                    \
    block_lanes(w, ws, wmin, H, a, xs, xsum, xisum, BITS, G, k, blocks, has_mins, R, lanes);
    SPECIALISED(CALL)
#undef CALL
}

#if PAIRED_COLUMNS
/* block_lanes_pair, specialised. */
static void block_lanes_pair_any(const uint8_t *w, const void *ws, const void *wmin, int half,
                                 const int8_t *a, const float *xs, const float *xsum,
                                 const int32_t *xisum, int bits, int64_t g, int64_t k,
                                 int64_t blocks, int has_mins, int rows, float lanes0[ROWS][8],
                                 float lanes1[ROWS][8]) {
#define CALL(R, H, BITS, G)                                                                    \
    block_lanes_pair(w, ws, wmin, H, a, xs, xsum, xisum, BITS, G, k, blocks, has_mins, R,     \
                     lanes0, lanes1);
    SPECIALISED(CALL)
#undef CALL
}
#endif

/* Rows row0 .. row0 + rows - 1's outputs for columns col0 .. col0 + cols - 1: each column's
 * lanes summed by the tree, then its tail groups one by one, then the bias. With 8 columns the
 * same operations run on 8 lanes at once (lane c: column col0 + c), and each tail group's
 * weights and scales are unpacked once for all the rows. */
static void finish_rows(float lanes[8][ROWS][8], int rows, int64_t row0, int64_t col0,
                        int64_t cols, const uint8_t *values, const void *scales, const void *mins,
                        int half, int has_mins, int bits, int64_t g, int64_t k, int64_t n,
                        const int8_t *xq, const float *xs, const float *xsum,
                        const int32_t *xisum, const float *bias, float *y) {
    int64_t groups = k / g, blocks = groups / 8, row_bytes = k * bits / 8;
    int64_t tail_bytes = g * bits / 8;
    const uint8_t *tails = values + col0 * row_bytes + blocks * 8 * tail_bytes;
    (void)xisum; /* read by the AVX-512 tail path only */
#ifdef __AVX2__
    if (cols == 8 && vector_tail(bits, g)) {
        __m256 total[ROWS];
        for (int r = 0; r < rows; r++) {
            __m256 v[8];
            for (int c = 0; c < 8; c++) v[c] = _mm256_loadu_ps(lanes[c][r]);
            total[r] = hsum8x8(v);
        }
        for (int64_t group = blocks * 8; group < groups; group++) {
            const uint8_t *w = tails + (group - blocks * 8) * tail_bytes;
            __m256i dots[ROWS];
#if PAIRED_COLUMNS
            if (g == 32) {
                TailColumns columns;
                tail_columns(w, row_bytes, bits, &columns);
                for (int r = 0; r < rows; r++) {
                    int64_t row = row0 + r;
                    dots[r] = tail_dots8(&columns, xq + row * k + group * g, bits);
                    if (bits == 8) /* (w + 128) x summed, less 128 * sum(x) */
                        dots[r] = _mm256_sub_epi32(
                            dots[r], _mm256_set1_epi32(xisum[row * groups + group] * 128));
                }
            } else
#endif
            {
                __m256i partial[ROWS][8];
                for (int c = 0; c < 8; c++) {
                    TailWeights t = tail_weights(w + c * row_bytes, bits, g);
                    for (int r = 0; r < rows; r++)
                        partial[r][c] = tail_product(t, xq + (row0 + r) * k + group * g, bits, g);
                }
                for (int r = 0; r < rows; r++) dots[r] = hsum8x8_epi32(partial[r]);
            }
            int64_t at = col0 * groups + group;
            __m256 scale = scales8_strided(scales, at, groups, half);
            __m256 min = has_mins ? scales8_strided(mins, at, groups, half) : _mm256_setzero_ps();
            for (int r = 0; r < rows; r++) {
                int64_t x_at = (row0 + r) * groups + group;
                __m256 dot = _mm256_cvtepi32_ps(dots[r]);
                total[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, _mm256_set1_ps(xs[x_at])),
                                           total[r]);
                if (has_mins)
                    total[r] = _mm256_fmadd_ps(min, _mm256_set1_ps(xsum[x_at]), total[r]);
            }
        }
        for (int r = 0; r < rows; r++) {
            if (bias != NULL) total[r] = _mm256_add_ps(total[r], _mm256_loadu_ps(bias + col0));
            _mm256_storeu_ps(y + (row0 + r) * n + col0, total[r]);
        }
        return;
    }
#endif
    for (int r = 0; r < rows; r++) {
        int64_t row = row0 + r;
        const int8_t *a = xq + row * k;
        const float *rs = xs + row * groups, *rsum = xsum + row * groups;
        for (int64_t c = 0; c < cols; c++) {
            int64_t col = col0 + c;
            float total = hsum8_lanes(lanes[c][r]);
            for (int64_t group = blocks * 8; group < groups; group++) {
                const uint8_t *w = tails + c * row_bytes + (group - blocks * 8) * tail_bytes;
                int32_t dot = tail_dot(w, a + group * g, bits, g);
                float scale = scale_at(scales, col * groups + group, half);
                total = __builtin_fmaf((float)dot, scale * rs[group], total);
                if (has_mins)
                    total = __builtin_fmaf(scale_at(mins, col * groups + group, half),
                                           rsum[group], total);
            }
            y[row * n + col] = bias != NULL ? total + bias[col] : total;
        }
    }
}

/* y [m, n] = x [m, k] W^T (+ bias), W given by kernel-order values, scales and mins (bits 4 or
 * 8, groups of g; scales and mins float16 when `half`, else float32). k must be a multiple of
 * 32. `has_mins` is 0 when every min is zero. Returns 0, or -1 when scratch memory cannot be
 * allocated. */
int pagedkv_qmatmul(const float *x, int64_t m, int64_t k, const uint8_t *values,
                    const void *scales, const void *mins, int half, int has_mins, int bits,
                    int64_t g, int64_t n, const float *bias, float *y) {
    int64_t scale_bytes = half ? 2 : 4;
    int64_t groups = k / g, blocks = groups / 8, row_bytes = k * bits / 8;
    Activations a;
    int failed = activations_alloc(&a, m, k, g) != 0;
    int64_t tile = TILE_BYTES / k;
    tile = tile < 4 ? 4 : (tile > 64 ? 64 : tile);
    int64_t col_groups = (n + 7) / 8;
    if (!failed) {
#pragma omp parallel
        {
            quantize_rows(x, m, k, g, bits, 0, &a);
            for (int64_t r0 = 0; r0 < m; r0 += tile) {
                int64_t r1 = r0 + tile < m ? r0 + tile : m;
#pragma omp for schedule(static) nowait
                for (int64_t cg = 0; cg < col_groups; cg++) {
                    int64_t col0 = cg * 8, cols = n - col0 < 8 ? n - col0 : 8;
                    for (int64_t rr = r0; rr < r1; rr += ROWS) {
                        int rows = r1 - rr < ROWS ? (int)(r1 - rr) : ROWS;
                        float lanes[8][ROWS][8];
                        int64_t c = 0;
#if PAIRED_COLUMNS
                        for (; c + 1 < cols; c += 2) {
                            int64_t col = col0 + c;
                            block_lanes_pair_any(
                                values + col * row_bytes,
                                (const char *)scales + col * groups * scale_bytes,
                                (const char *)mins + col * groups * scale_bytes, half,
                                a.q + rr * k, a.scale + rr * groups, a.sum + rr * groups,
                                a.isum + rr * groups, bits, g, k, blocks, has_mins, rows, lanes[c],
                                lanes[c + 1]);
                        }
#endif
                        for (; c < cols; c++) {
                            int64_t col = col0 + c;
                            block_lanes_any(values + col * row_bytes,
                                            (const char *)scales + col * groups * scale_bytes,
                                            (const char *)mins + col * groups * scale_bytes, half,
                                            a.q + rr * k, a.scale + rr * groups,
                                            a.sum + rr * groups, a.isum + rr * groups, bits, g, k,
                                            blocks, has_mins, rows, lanes[c]);
                        }
                        finish_rows(lanes, rows, rr, col0, cols, values, scales, mins, half,
                                    has_mins, bits, g, k, n, a.q, a.scale, a.sum, a.isum, bias, y);
                    }
                }
            }
        }
    }
    activations_free(&a);
    return failed ? -1 : 0;
}

/* The panel layout (quant/panels.py), read on AVX-512 VNNI builds: the weight's columns in
 * panels of 16, each panel's groups of 32 one after another, a group as the 16 columns' values
 * side by side (row q of a group: values 4q .. 4q + 3 of each column, 4 bytes a column, so one
 * 64-byte vector of weights meets one broadcast 4-byte unit of a row's activations in vpdpbusd).
 * 4 bits: byte b of a group's 256 holds its byte b in the low nibble and byte 256 + b in the
 * high one; 8 bits: 512 bytes, each value + 128 (unsigned, as vpdpbusd takes it; the product is
 * corrected by 128 x the activations' integer sum, as in kernel order). Groups come in the
 * order the float part visits them: lane j of each whole block first for j = 0..7 (group j,
 * 8 + j, 16 + j, ...), then the tail groups. Scales and mins are column-major, [groups][n]
 * (quant/formats.py keeps them as a transposed view, so they are still [n, groups] to Python):
 * a panel's 16 of one group are one load.
 *
 * Why: a row's every 16 columns are one stream of bytes and one vector of scales, with no tail
 * groups done apart and no lanes to add across, so the same products take fewer instructions
 * than kernel order (two threads, a 3072 x 576 matmul: 1.7x at one row, 1.5x at 6). The float
 * arithmetic is kernel order's, lane for lane: lane j accumulates group 8b + j over whole blocks
 * b, `fma(dot, scale x x_scale, acc)` then `fma(min, x_sum, acc)`; the 8 lanes are added by
 * simd.h's tree; the tail groups follow in order; then the bias. So both layouts give the same
 * bits, and a build without AVX-512 VNNI (kernel order) the same as one with it (panels). */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PANELS 1
/* Columns of a panel; rows of activations one pass over a panel takes (their accumulators
 * stay in registers); groups ahead whose scales are asked for. */
enum { PANEL_COLUMNS = 16, PASS_ROWS = 8, PREFETCH_GROUPS = 8 };

/* A weight of at least STREAM_BYTES and STREAM_K inputs, multiplied by at most STREAM_M rows,
 * is read several panels at a time, each panel's group v beside the others', so a thread keeps
 * that many streams of weight bytes in flight rather than one: STREAMS panels for up to
 * STREAMS rows, STREAMS - 1 for more (PASS_ROWS rows a pass), so that a pass's accumulators,
 * panels x rows (16 or 24), stay in registers.
 * Why: a weight that big comes from main memory, and one sequential stream a core leaves the
 * memory idle part of the time. On a 2-core Xeon (2 threads, weights cycled through 400 MB),
 * 11264 x 2048 (a 1B model's gate and up) took, one panel at a time / several: 1 row 881 / 553
 * us, 3 rows 936 / 622, 6 rows 1144 / 913, 8 rows 1424 / 1025, 12 rows 2155 / 1786 (kernel
 * order: 583-645, 649, 784-856, 960-1068, 1632); 2048 x 2048 at one row 141 / 65 us, 4096 x
 * 14336 2.6 / 1.5 ms. Four panels for 6-8 rows in passes of 4 were 10-20% slower than three in
 * one pass; two panels gained nothing anywhere; software prefetches further ahead in the one
 * stream, into L1 or L2, gained nothing. Past 16 rows the products bound it: nothing to gain.
 * 576 inputs (SmolLM2's 49152 x 576 output layer) gained 6% at one row and lost 12% at 3;
 * weights that stay in cache (a 135M model's layers) lost 0-20%. A column's arithmetic is the
 * same either way. STREAM_SHARE: a weight with fewer panels than that many reads of STREAMS per
 * thread keeps one panel at a time, so that no thread is left idle (a tall, narrow weight on a
 * many-core machine). */
#define STREAM_BYTES (2 << 20)
enum { STREAMS = 4, STREAM_K = 1024, STREAM_M = 16, STREAM_SHARE = 4 };

/* The group visited `v`-th in a panel of `groups` groups. */
INLINE int64_t panel_group(int64_t v, int64_t groups) {
    int64_t blocks = groups / 8;
    return v < blocks * 8 ? (v % blocks) * 8 + v / blocks : v;
}

/* 16 columns' scales or mins of one group from column-major ones (`at` the first), float16
 * when `half`, as float32 lanes (exact); lanes past `inside` zero. */
INLINE __m512 scales16(const void *p, int64_t at, int half, __mmask16 inside) {
    if (!half) return _mm512_maskz_loadu_ps(inside, (const float *)p + at);
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(inside, (const uint16_t *)p + at));
}

/* `rows` rows (natural-order activations `a`, `k` bytes apart) by `streams` consecutive panels
 * (the first at `w`, `panel_bytes` apart): y's columns col0 .. col0 + 16 x streams - 1 (those
 * below n). */
INLINE void panel_rows(const uint8_t *w, int64_t panel_bytes, int streams, const void *ps,
                       const void *pm, int half, int has_mins, int bits, int64_t groups, int64_t k,
                       const int8_t *a, const float *xs, const float *xsum, const int32_t *xisum,
                       int rows, const float *bias, int64_t col0, int64_t n, float *y) {
    int64_t blocks = groups / 8, group_bytes = bits == 4 ? 256 : 512;
    __mmask16 inside[STREAMS];
    for (int s = 0; s < streams; s++) {
        int64_t cols = n - (col0 + PANEL_COLUMNS * s);
        cols = cols < 0 ? 0 : (cols < PANEL_COLUMNS ? cols : PANEL_COLUMNS);
        inside[s] = (__mmask16)((1u << cols) - 1);
    }
    const __m512i mask = _mm512_set1_epi8(0x0F);
    __m512 acc[STREAMS][PASS_ROWS], lanes[8][STREAMS][PASS_ROWS];
    for (int s = 0; s < streams; s++)
        for (int r = 0; r < rows; r++) acc[s][r] = _mm512_setzero_ps();
    for (int64_t v = 0; v < groups; v++) {
        int64_t group = panel_group(v, groups);
        if (v < blocks * 8 && v % blocks == 0)
            for (int s = 0; s < streams; s++)
                for (int r = 0; r < rows; r++) acc[s][r] = _mm512_setzero_ps();
        /* a column of scales is no stream the core foresees: ask for group `ahead`'s */
        int64_t ahead = v + PREFETCH_GROUPS < groups ? panel_group(v + PREFETCH_GROUPS, groups)
                                                      : -1;
        for (int s = 0; s < streams; s++) {
            const uint8_t *src = w + s * panel_bytes + v * group_bytes;
            int64_t col = col0 + PANEL_COLUMNS * s;
            for (int64_t at = 0; at < group_bytes; at += 64)
                _mm_prefetch((const char *)src + PREFETCH_VALUES + at, _MM_HINT_T0);
            if (ahead >= 0) {
                int64_t at = ahead * n + col;
                _mm_prefetch((const char *)ps + at * (half ? 2 : 4), _MM_HINT_T0);
                if (has_mins) _mm_prefetch((const char *)pm + at * (half ? 2 : 4), _MM_HINT_T0);
            }
            __m512i wv[8];
            if (bits == 4) {
                for (int q = 0; q < 4; q++) {
                    __m512i p = _mm512_loadu_si512((const void *)(src + 64 * q));
                    wv[q] = _mm512_and_si512(p, mask);
                    wv[q + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), mask);
                }
            } else {
                for (int q = 0; q < 8; q++)
                    wv[q] = _mm512_loadu_si512((const void *)(src + 64 * q));
            }
            __m512 scale = scales16(ps, group * n + col, half, inside[s]);
            __m512 wm = has_mins ? scales16(pm, group * n + col, half, inside[s])
                                 : _mm512_setzero_ps();
            for (int r = 0; r < rows; r++) {
                const int8_t *unit = a + r * k + group * 32;
                __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
                for (int q = 0; q < 8; q += 2) {
                    int32_t u0, u1;
                    memcpy(&u0, unit + 4 * q, 4);
                    memcpy(&u1, unit + 4 * q + 4, 4);
                    d0 = _mm512_dpbusd_epi32(d0, wv[q], _mm512_set1_epi32(u0));
                    d1 = _mm512_dpbusd_epi32(d1, wv[q + 1], _mm512_set1_epi32(u1));
                }
                __m512i dots = _mm512_add_epi32(d0, d1);
                int64_t at = r * groups + group;
                if (bits == 8) /* (w + 128) x summed, less 128 * sum(x) */
                    dots = _mm512_sub_epi32(dots, _mm512_set1_epi32(xisum[at] * 128));
                __m512 both = _mm512_mul_ps(scale, _mm512_set1_ps(xs[at]));
                acc[s][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), both, acc[s][r]);
                if (has_mins)
                    acc[s][r] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xsum[at]), acc[s][r]);
            }
        }
        if (v < blocks * 8 && v % blocks == blocks - 1) { /* lane j's last block */
            int64_t j = v / blocks;
            for (int s = 0; s < streams; s++)
                for (int r = 0; r < rows; r++) lanes[j][s][r] = acc[s][r];
            if (j == 7) /* simd.h's tree: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) */
                for (int s = 0; s < streams; s++)
                    for (int r = 0; r < rows; r++)
                        acc[s][r] = _mm512_add_ps(
                            _mm512_add_ps(_mm512_add_ps(lanes[0][s][r], lanes[4][s][r]),
                                          _mm512_add_ps(lanes[2][s][r], lanes[6][s][r])),
                            _mm512_add_ps(_mm512_add_ps(lanes[1][s][r], lanes[5][s][r]),
                                          _mm512_add_ps(lanes[3][s][r], lanes[7][s][r])));
        }
    }
    for (int s = 0; s < streams; s++) {
        int64_t col = col0 + PANEL_COLUMNS * s;
        for (int r = 0; r < rows; r++) {
            __m512 total = acc[s][r];
            if (bias != NULL)
                total = _mm512_add_ps(total, _mm512_maskz_loadu_ps(inside[s], bias + col));
            _mm512_mask_storeu_ps(y + r * n + col, inside[s], total);
        }
    }
}

/* panel_rows with the row count, panels at once and width as constants, one copy per case:
 * one panel in panel_rows_any, several in panel_streams_any. Two functions, not one: with all
 * the cases in one, the one-panel ones ran 8-10% slower (a 256-row prompt). */
#define PANEL_CASE(R, S)                                                                       \
    if (rows == R && streams == S) {                                                           \
        if (bits == 4)                                                                         \
            panel_rows(w, panel_bytes, S, ps, pm, half, has_mins, 4, groups, k, a, xs, xsum,   \
                       xisum, R, bias, col0, n, y);                                            \
        else                                                                                   \
            panel_rows(w, panel_bytes, S, ps, pm, half, has_mins, 8, groups, k, a, xs, xsum,   \
                       xisum, R, bias, col0, n, y);                                            \
        return;                                                                                \
    }
#define PANEL_ARGS                                                                             \
    const uint8_t *w, int64_t panel_bytes, const void *ps, const void *pm, int half,           \
        int has_mins, int bits, int64_t groups, int64_t k, const int8_t *a, const float *xs,   \
        const float *xsum, const int32_t *xisum, int rows, const float *bias, int64_t col0,    \
        int64_t n, float *y, int streams
typedef void (*PanelPass)(PANEL_ARGS);
static void panel_rows_any(PANEL_ARGS) {
    PANEL_CASE(1, 1) PANEL_CASE(2, 1) PANEL_CASE(3, 1) PANEL_CASE(4, 1)
    PANEL_CASE(5, 1) PANEL_CASE(6, 1) PANEL_CASE(7, 1) PANEL_CASE(8, 1)
}
static void panel_streams_any(PANEL_ARGS) {
    PANEL_CASE(1, STREAMS) PANEL_CASE(2, STREAMS) PANEL_CASE(3, STREAMS) PANEL_CASE(4, STREAMS)
    PANEL_CASE(1, STREAMS - 1) PANEL_CASE(2, STREAMS - 1) PANEL_CASE(3, STREAMS - 1)
    PANEL_CASE(4, STREAMS - 1) PANEL_CASE(5, STREAMS - 1) PANEL_CASE(6, STREAMS - 1)
    PANEL_CASE(7, STREAMS - 1) PANEL_CASE(8, STREAMS - 1)
}
#undef PANEL_ARGS
#undef PANEL_CASE
#endif

/* y [m, n] = x [m, k] W^T (+ bias), W in the panel layout (above): `values` the panels' bytes,
 * `scales` and `mins` column-major [groups][n] (float16 when `half`), groups of 32, 4 or 8
 * bits. Returns 0; -1 when scratch memory cannot be allocated; -2 on a build without AVX-512
 * VNNI, which never lays a weight out in panels. */
int pagedkv_qmatmul_panels(const float *x, int64_t m, int64_t k, const uint8_t *values,
                           const void *scales, const void *mins, int half, int has_mins, int bits,
                           int64_t n, const float *bias, float *y) {
#ifdef PANELS
    int64_t groups = k / 32, panels = (n + PANEL_COLUMNS - 1) / PANEL_COLUMNS;
    int64_t panel_bytes = groups * (bits == 4 ? 256 : 512);
    int streams = 1;
    if (panels * panel_bytes >= STREAM_BYTES && k >= STREAM_K && m <= STREAM_M &&
        panels >= STREAM_SHARE * STREAMS * omp_get_max_threads())
        streams = m <= STREAMS ? STREAMS : STREAMS - 1;
    int64_t units = (panels + streams - 1) / streams; /* the last may hold fewer panels */
    Activations a;
    int failed = activations_alloc(&a, m, k, 32) != 0;
    int64_t tile = TILE_BYTES / k;
    tile = tile < PASS_ROWS ? PASS_ROWS : (tile > 64 ? 64 : tile);
    if (!failed) {
#pragma omp parallel
        {
            quantize_rows(x, m, k, 32, bits, 1, &a);
            for (int64_t r0 = 0; r0 < m; r0 += tile) {
                int64_t r1 = r0 + tile < m ? r0 + tile : m;
#pragma omp for schedule(static) nowait
                for (int64_t u = 0; u < units; u++)
                    for (int64_t rr = r0; rr < r1; rr += PASS_ROWS) {
                        int rows = r1 - rr < PASS_ROWS ? (int)(r1 - rr) : PASS_ROWS;
                        int64_t p0 = u * streams;
                        int64_t count = panels - p0 < streams ? panels - p0 : streams;
                        int at_once = count == streams ? streams : 1;
                        PanelPass pass = at_once == 1 ? panel_rows_any : panel_streams_any;
                        for (int64_t p = p0; p < p0 + count; p += at_once)
                            pass(values + p * panel_bytes, panel_bytes, scales, mins, half,
                                 has_mins, bits, groups, k, a.q + rr * k, a.scale + rr * groups,
                                 a.sum + rr * groups, a.isum + rr * groups, rows, bias,
                                 p * PANEL_COLUMNS, n, y + rr * n, at_once);
                    }
            }
        }
    }
    activations_free(&a);
    return failed ? -1 : 0;
#else
    (void)x, (void)m, (void)k, (void)values, (void)scales, (void)mins, (void)half;
    (void)has_mins, (void)bits, (void)n, (void)bias, (void)y;
    return -2;
#endif
}

/* Value i of `group` of a row in kernel order (`row`: its bytes, groups of g, `blocked` of them
 * in whole blocks of 8). */
static inline int32_t kernel_order_value(const uint8_t *row, int bits, int64_t g, int64_t blocked,
                                         int64_t group, int64_t i) {
    if (group < blocked) return block_value(row + (group / 8) * 8 * g * bits / 8, bits, group % 8, i);
    return tail_value(row + blocked * g * bits / 8 + (group - blocked) * g * bits / 8, bits, i);
}

/* Value i of row c (0..15) of a panel's group (`group`: its 256 or 512 bytes, panels.py). */
static inline int32_t panel_value(const uint8_t *group, int bits, int64_t c, int64_t i) {
    if (bits == 8) return (int8_t)(group[64 * (i / 4) + 4 * c + i % 4] ^ 0x80);
    uint8_t byte = group[64 * ((i % 16) / 4) + 4 * c + i % 4];
    return i < 16 ? byte & 15 : byte >> 4;
}

/* Row `row` of an [n, k] weight into out [k]: scale * q + min per group, multiplied then added
 * (two roundings, as QuantizedTensor.dequantize in torch). The values are in kernel order, or in
 * the panel layout when `panels` (g = 32; its visit order of groups, panels.py); the scale and
 * min of row r, group j sit at r * row_stride + j * group_stride (row-major in kernel order,
 * column-major in panels). */
static void dequantize_row(const uint8_t *values, const void *scales, const void *mins, int half,
                           int bits, int64_t g, int64_t k, int panels, int64_t row_stride,
                           int64_t group_stride, int64_t row, float *out) {
    int64_t groups = k / g, blocked = groups / 8 * 8, blocks = groups / 8;
    int64_t group_bytes = 16 * g * bits / 8; /* a panel's group: 16 rows of it */
    const uint8_t *bytes = panels ? values + (row / 16) * groups * group_bytes
                                  : values + row * (k * bits / 8);
    for (int64_t group = 0; group < groups; group++) {
        int64_t at = row * row_stride + group * group_stride;
        float scale = scale_at(scales, at, half), min = scale_at(mins, at, half);
        int64_t visit = group < blocked ? (group % 8) * blocks + group / 8 : group;
        float *d = out + group * g;
        for (int64_t i = 0; i < g; i++) {
            int32_t q = panels ? panel_value(bytes + visit * group_bytes, bits, row % 16, i)
                               : kernel_order_value(bytes, bits, g, blocked, group, i);
            d[i] = scale * (float)q + min;
        }
    }
}

/* out [n, k] float32 = the weight dequantised from kernel order (dequantize_row). */
void pagedkv_dequantize(const uint8_t *values, const void *scales, const void *mins, int half,
                        int bits, int64_t g, int64_t n, int64_t k, float *out) {
#pragma omp parallel for schedule(static)
    for (int64_t col = 0; col < n; col++)
        dequantize_row(values, scales, mins, half, bits, g, k, 0, k / g, 1, col, out + col * k);
}

/* out [count, k] float32 = rows `index` of an [n, k] weight (dequantize_row, either layout),
 * reading those rows' bytes alone: an embedding lookup. Returns 0, or -1 (nothing written)
 * when an index is not a row. */
int pagedkv_dequantize_rows(const uint8_t *values, const void *scales, const void *mins, int half,
                            int bits, int64_t g, int64_t n, int64_t k, int panels,
                            int64_t row_stride, int64_t group_stride, const int64_t *index,
                            int64_t count, float *out) {
    for (int64_t t = 0; t < count; t++)
        if (index[t] < 0 || index[t] >= n) return -1;
    for (int64_t t = 0; t < count; t++)
        dequantize_row(values, scales, mins, half, bits, g, k, panels, row_stride, group_stride,
                       index[t], out + t * k);
    return 0;
}
