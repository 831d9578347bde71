/* Paged attention on the CPU, for prefill chunks and decode steps alike, batch invariant.
 *
 * Why: the engine promises that a token's output does not depend on how it was batched. A
 * query row must come out with the same bits whether it is computed in a decode step (one row
 * per sequence), inside a prefill chunk of any size, beside any other sequences, on any number
 * of threads, and with or without AVX2. So the arithmetic of one (query row, head) is a fixed
 * function of its q vector, its keys and values at positions lo..pos, and the scales:
 *   score_p = dot(q, k_p) * (scale * k_scale), dot = 8 lanes (lane l sums q[8c+l] * k[8c+l] by
 *             fma over c in order), the hsum8 tree, then the head_dim % 8 tail by fma in order;
 *   m = max of the scores; e_p = exp(score_p - m) by exp8 / exp1 (same bits either way);
 *   sum = e_p summed in 8 lanes by (p - lo) % 8, the hsum8 tree, then the tail in order;
 *   acc[d] = sum of e_p * v_p[d] over p = lo..pos increasing, one fma chain per d;
 *   out[d] = acc[d] / sum * v_scale.
 * No reduction is split across threads or tiles: threads split tasks, and a task's tiles let
 * several query vectors share each key and value row loaded, never reorder a row's sums. The
 * plain-C twins follow the same lanes and trees, so a build without AVX2 gives the same bits.
 *
 * Layout. q: global row i at q + i * q_stride, num_heads * head_dim floats (heads contiguous);
 * sequence s owns rows query_starts[s] .. query_starts[s + 1] - 1, the last of its
 * context_lens[s] positions. Caches [num_blocks, block_size, num_kv_heads, head_dim] of float32,
 * bfloat16, float16 or fp8 bytes (read through a 256-float table); position p of sequence s is
 * in slot block_tables[s * table_stride + p / block_size] * block_size + p % block_size. A
 * sliding window w > 0 keeps positions pos + 1 - w .. pos (Mistral). Query head hq reads KV
 * head hq / (num_heads / num_kv_heads). out: [total rows, num_heads, head_dim] float32.
 *
 * Tiling. A task is (sequence, KV head, tile of up to MAX_TILE_ROWS consecutive query rows);
 * its query vectors are the tile's rows times the group of query heads sharing the KV head,
 * listed row-major. Keys, then values, are taken a chunk of rows at a time, copied (float32)
 * or decoded (other dtypes) out of their blocks into one contiguous scratch buffer, and each
 * chunk serves every vector of the tile: scores are computed QK_QUERIES vectors by four keys
 * per step (groups of 8 dot products, one hsum8x8 each), values summed PV_QUERIES vectors by
 * up to four column vectors, the accumulators held in registers across the chunk.
 *
 * AVX-512 does the same arithmetic twice as wide without touching the rule: a 16-lane fma is
 * two 8-lane ones side by side. Scores take query vectors in pairs, packed per tile so each
 * 16 floats hold the two vectors' same 8 dimensions, against a key's 8 dimensions repeated in
 * both halves: each half is the 8-lane chain of one (vector, key) dot product, reduced by
 * hsum8x8's tree (hsum8x8_halves: both halves at once). Value columns go 16 at a time, a row's
 * last vector masked: each column is still its own fma chain in position order. The softmax
 * takes 16 scores at a time (exp16), their halves added into its 8 lanes in turn.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#else
static int omp_get_max_threads(void) { return 1; }
#endif

#include "simd.h"

enum {
    MAX_TILE_ROWS = 32,     /* query rows of one sequence per task, at most */
    MIN_TILE_VECTORS = 24,  /* query vectors per task, at least, while every thread has one */
    CHUNK_FLOATS = 4096,    /* floats of key or value rows taken at once (16 KiB) */
    MAX_CHUNK_KEYS = 64,    /* rows taken at once, at most (a multiple of 4) */
    PV_VECTORS = 4,         /* column vectors (Columns) per value block, at most */
    SCORE_BUDGET = 1 << 20, /* floats of scores per thread that tiles may use */
    PREFETCH_ROWS = 16,     /* rows ahead of the one being copied that are asked for */
};

/* Query vectors per score step and per value block: more where AVX-512 gives 32 vector
 * registers, and 16-float vectors (the shapes change the speed only, never a result). */
#ifdef __AVX512F__
#define QK_QUERIES 8 /* as 4 packed pairs */
#define PV_QUERIES 6
#else
#define QK_QUERIES 2
#define PV_QUERIES 3
#endif

enum { CACHE_F32 = 0, CACHE_BF16 = 1, CACHE_F16 = 2, CACHE_FP8 = 3 };

/* One call's arguments, shared by its tasks. */
typedef struct {
    const float *q;
    int64_t q_stride;
    const void *k_cache, *v_cache;
    int cache_dtype;
    const float *fp8_table;
    const int32_t *block_tables;
    int64_t table_stride;
    const int64_t *query_starts;
    const int32_t *context_lens;
    int64_t num_heads, num_kv_heads, head_dim, block_size, window, group;
    float key_scale, v_scale;
    float *out;
} Call;

/* One tile's query vectors (vector i: tile row i / group, query head h * group + i % group) and
 * one thread's scratch for them: scores [vectors][width] and `chunk` key or value rows. */
typedef struct {
    int64_t count;   /* vectors: rows * group */
    const float **q; /* per vector: its query, */
    float **out;     /* its out row (its accumulator until the end), */
    int64_t *lo;     /* the first and last positions it attends, */
    int64_t *pos;
    float *sums;     /* its softmax denominator */
    float *scores;
    int64_t width;
    float *rows;     /* [chunk][head_dim] */
    int64_t chunk;
#ifdef __AVX512F__
    float *pairs; /* vectors 2i and 2i + 1 packed for score_pairs at pairs + 2i * head_dim */
#endif
} Tile;

/* The first position a query at `pos` attends. */
static int64_t window_start(int64_t pos, int64_t window) {
    return window > 0 && pos + 1 > window ? pos + 1 - window : 0;
}

/* Bytes of one cached value. */
static int64_t value_bytes(const Call *c) {
    return c->cache_dtype == CACHE_F32 ? 4 : (c->cache_dtype == CACHE_FP8 ? 1 : 2);
}

/* Consecutive positions' rows of one KV head, one address after another: the block and the
 * place in it counted along, so a row costs no division by the block size. */
typedef struct {
    const char *cache;
    const int32_t *entry; /* the block table entry of the current block */
    int64_t offset, block_size, slot_bytes, head_bytes;
} RowWalk;

/* A walk starting at position p. */
static RowWalk walk_from(const Call *c, const void *cache, const int32_t *table, int64_t h,
                         int64_t p) {
    int64_t row_bytes = c->head_dim * value_bytes(c);
    RowWalk w = {cache, table + p / c->block_size, p % c->block_size, c->block_size,
                 c->num_kv_heads * row_bytes, h * row_bytes};
    return w;
}

/* The walk's current row: position p's row for KV head h is in slot
 * block_tables[p / block_size] * block_size + p % block_size. Then one position on. */
static inline const char *walk_next(RowWalk *w) {
    const char *row =
        w->cache + ((int64_t)*w->entry * w->block_size + w->offset) * w->slot_bytes + w->head_bytes;
    if (++w->offset == w->block_size) {
        w->offset = 0;
        w->entry++;
    }
    return row;
}

#ifdef __AVX2__
/* f16_to_f32 of 8 halves at once, bit for bit (NaN payloads included): normal and infinite or
 * NaN halves by moving their fields, subnormal ones as mantissa * 2^-24. */
static __m256 f16x8_to_f32(const uint16_t *h) {
    __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h));
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x8000)), 16);
    __m256i exponent = _mm256_and_si256(x, _mm256_set1_epi32(0x7C00));
    __m256i mantissa = _mm256_and_si256(x, _mm256_set1_epi32(0x3FF));
    __m256i fields = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7FFF)), 13);
    __m256i normal = _mm256_add_epi32(fields, _mm256_set1_epi32(112 << 23));
    __m256i special = _mm256_or_si256(fields, _mm256_set1_epi32(0x7F800000));
    __m256i subnormal = _mm256_castps_si256(_mm256_mul_ps(
        _mm256_cvtepi32_ps(mantissa), _mm256_set1_ps(5.9604644775390625e-8f)));
    __m256i bits = _mm256_blendv_epi8(
        normal, special, _mm256_cmpeq_epi32(exponent, _mm256_set1_epi32(0x7C00)));
    bits = _mm256_blendv_epi8(bits, subnormal,
                              _mm256_cmpeq_epi32(exponent, _mm256_setzero_si256()));
    return _mm256_castsi256_ps(_mm256_or_si256(bits, sign));
}
#endif

/* Rows p0 .. p0 + n - 1 of KV head h, of the sequence whose block table is `table`, as
 * float32 into t->rows; positions past `last` repeat last's row (blocks of four keys may run
 * past the end). Copying float32 rows too keeps the tile's many reads of them contiguous,
 * clear of the cache-set conflicts of rows num_kv_heads * head_dim floats apart. */
static void load_rows(const Call *c, const void *cache, const int32_t *table, int64_t h,
                      int64_t p0, int64_t n, int64_t last, Tile *t) {
    int64_t hd = c->head_dim;
    int64_t row_bytes = hd * value_bytes(c);
    /* One KV head's rows lie num_kv_heads x head_dim values apart within a block, and blocks
     * lie anywhere in the pool: the hardware prefetcher does not follow that, so each copy
     * waited for memory (a batch-1 decode at 500 tokens of context spent a third of its layers'
     * time in attention). Rows asked for 16 positions ahead arrive while earlier ones are
     * copied and scored: that third went down by a fifth (SmolLM2, 1.68 -> 1.33 ms a step). */
    RowWalk at = walk_from(c, cache, table, h, p0);
    /* (started at `last` when it is never taken, so no entry past the table is pointed at) */
    RowWalk ahead = walk_from(c, cache, table, h,
                              p0 + PREFETCH_ROWS <= last ? p0 + PREFETCH_ROWS : last);
    for (int64_t i = 0; i < n; i++) {
        float *row = t->rows + i * hd;
        int64_t p = p0 + i;
        if (p + PREFETCH_ROWS <= last) {
            const char *next = walk_next(&ahead);
            for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + b);
        }
        if (p > last) {
            memcpy(row, row - hd, sizeof(float) * (size_t)hd);
            continue;
        }
        const char *src = walk_next(&at);
        switch (c->cache_dtype) {
        case CACHE_F32:
            memcpy(row, src, sizeof(float) * (size_t)hd);
            break;
        case CACHE_BF16:
            for (int64_t d = 0; d < hd; d++) row[d] = bf16_to_f32(((const uint16_t *)src)[d]);
            break;
        case CACHE_F16: {
            const uint16_t *h16 = (const uint16_t *)src;
            int64_t d = 0;
#ifdef __AVX2__
            for (; d + 8 <= hd; d += 8) _mm256_storeu_ps(row + d, f16x8_to_f32(h16 + d));
#endif
            for (; d < hd; d++) row[d] = f16_to_f32(h16[d]);
            break;
        }
        default: {
            const uint8_t *bytes = (const uint8_t *)src;
            int64_t d = 0;
#ifdef __AVX2__
            for (; d + 8 <= hd; d += 8) {
                __m128i b8 = _mm_loadl_epi64((const __m128i *)(bytes + d));
                _mm256_storeu_ps(row + d, _mm256_i32gather_ps(c->fp8_table,
                                                              _mm256_cvtepu8_epi32(b8), 4));
            }
#endif
            for (; d < hd; d++) row[d] = c->fp8_table[bytes[d]];
            break;
        }
        }
    }
}

/* dot(q, k): `total` (the hsum8 of the lanes) plus the head_dim % 8 tail, in order. */
static float add_tail(float total, const float *q, const float *k, int64_t head_dim) {
    for (int64_t d = head_dim - head_dim % 8; d < head_dim; d++)
        total = __builtin_fmaf(q[d], k[d], total);
    return total;
}

#ifndef __AVX2__
/* dot(q, k) over the first head_dim / 8 * 8 dimensions by the rule: 8 lanes of fma chains,
 * then the hsum8 tree. */
static float dot_lanes(const float *q, const float *k, int64_t head_dim) {
    float lanes[8] = {0};
    for (int64_t d = 0; d + 8 <= head_dim; d += 8)
        for (int l = 0; l < 8; l++) lanes[l] = __builtin_fmaf(q[d + l], k[d + l], lanes[l]);
    return hsum8_lanes(lanes);
}
#endif

/* Each score s[i][j0 + j], i < nq, j < 4, plus its vector's and key's head_dim % 8 tail. */
static void add_tails(int nq, const float *const *q, const float *kr, int64_t head_dim,
                      int64_t j0, float *const *s) {
    if (head_dim % 8 == 0) return;
    for (int i = 0; i < nq; i++)
        for (int j = 0; j < 4; j++)
            s[i][j0 + j] = add_tail(s[i][j0 + j], q[i], kr + j * head_dim, head_dim);
}

/* s[i][j] = dot(q[i], k + j * head_dim) for nq (1 or 2) vectors i and keys j < n
 * (a multiple of 4), four keys at a time: 4 x nq accumulators, each key and query load held
 * in a register (the empty asm keeps the compiler from re-reading it per multiply). */
INLINE void score_keys(int nq, const float *const *q, const float *k, int64_t head_dim,
                       int64_t n, float *const *s) {
    for (int64_t j0 = 0; j0 < n; j0 += 4) {
        const float *kr = k + j0 * head_dim;
#ifdef __AVX2__
        __m256 a[2][4];
        for (int i = 0; i < nq; i++)
            for (int j = 0; j < 4; j++) a[i][j] = _mm256_setzero_ps();
        for (int64_t d = 0; d + 8 <= head_dim; d += 8) {
            __m256 x[2];
            for (int i = 0; i < nq; i++) {
                x[i] = _mm256_loadu_ps(q[i] + d);
                __asm__("" : "+v"(x[i]));
            }
            for (int j = 0; j < 4; j++) {
                __m256 kj = _mm256_loadu_ps(kr + j * head_dim + d);
                __asm__("" : "+v"(kj));
                for (int i = 0; i < nq; i++) a[i][j] = _mm256_fmadd_ps(x[i], kj, a[i][j]);
            }
        }
        if (nq == 1)
            for (int j = 0; j < 4; j++) s[0][j0 + j] = hsum8(a[0][j]);
        for (int i = 0; i + 1 < nq; i += 2) { /* two vectors' four keys: one hsum8x8 */
            __m256 pair[8] = {a[i][0], a[i][1], a[i][2], a[i][3],
                              a[i + 1][0], a[i + 1][1], a[i + 1][2], a[i + 1][3]};
            __m256 total = hsum8x8(pair);
            _mm_storeu_ps(s[i] + j0, _mm256_castps256_ps128(total));
            _mm_storeu_ps(s[i + 1] + j0, _mm256_extractf128_ps(total, 1));
        }
#else
        for (int i = 0; i < nq; i++)
            for (int j = 0; j < 4; j++) s[i][j0 + j] = dot_lanes(q[i], kr + j * head_dim, head_dim);
#endif
        add_tails(nq, q, kr, head_dim, j0, s);
    }
}

#ifdef __AVX512F__
/* Vectors a and b packed for score_pairs: per 8 dimensions of the first head_dim / 8 * 8, a's
 * then b's, 16 floats. */
static void pack_pair(const float *a, const float *b, int64_t head_dim, float *pair) {
    for (int64_t d = 0; d + 8 <= head_dim; d += 8) {
        memcpy(pair + 2 * d, a + d, sizeof(float) * 8);
        memcpy(pair + 2 * d + 8, b + d, sizeof(float) * 8);
    }
}

/* score_keys for np pairs of vectors (vectors 2i and 2i + 1 packed at pairs[i]): a 16-lane fma
 * of pair i with key j's 8 dimensions in both halves is the 8-lane fmas of both vectors with
 * key j, and the halves go through the same hsum8x8, so every score has score_keys' bits. */
INLINE void score_pairs(int np, const float *const *q, const float *const *pairs,
                        const float *k, int64_t head_dim, int64_t n, float *const *s) {
    for (int64_t j0 = 0; j0 < n; j0 += 4) {
        const float *kr = k + j0 * head_dim;
        __m512 a[QK_QUERIES / 2][4];
        for (int i = 0; i < np; i++)
            for (int j = 0; j < 4; j++) a[i][j] = _mm512_setzero_ps();
        for (int64_t d = 0; d + 8 <= head_dim; d += 8) {
            __m512 x[QK_QUERIES / 2];
            for (int i = 0; i < np; i++) {
                x[i] = _mm512_loadu_ps(pairs[i] + 2 * d);
                __asm__("" : "+v"(x[i]));
            }
            for (int j = 0; j < 4; j++) {
                __m256d key = _mm256_loadu_pd((const double *)(kr + j * head_dim + d));
                __m512 kj = _mm512_castpd_ps(_mm512_broadcast_f64x4(key));
                __asm__("" : "+v"(kj));
                for (int i = 0; i < np; i++) a[i][j] = _mm512_fmadd_ps(x[i], kj, a[i][j]);
            }
        }
        for (int i = 0; i < np; i += 2) { /* pairs i and i + 1 (a lone last one twice) */
            int other = i + 1 < np ? i + 1 : i;
            __m512 sums[8] = {a[i][0],     a[i][1],     a[i][2],     a[i][3],
                              a[other][0], a[other][1], a[other][2], a[other][3]};
            __m512 total = hsum8x8_halves(sums); /* vectors 2i, 2 other, 2i + 1, 2 other + 1 */
            _mm_storeu_ps(s[2 * i] + j0, _mm512_extractf32x4_ps(total, 0));
            _mm_storeu_ps(s[2 * i + 1] + j0, _mm512_extractf32x4_ps(total, 2));
            if (other != i) {
                _mm_storeu_ps(s[2 * other] + j0, _mm512_extractf32x4_ps(total, 1));
                _mm_storeu_ps(s[2 * other + 1] + j0, _mm512_extractf32x4_ps(total, 3));
            }
        }
        add_tails(2 * np, q, kr, head_dim, j0, s);
    }
}

/* score_keys or score_pairs with the count as a constant, so that its arrays live in
 * registers: nq is 1 or even. */
static void score_dispatch(int nq, const float *const *q, const float *const *pairs,
                           const float *k, int64_t head_dim, int64_t n, float *const *s) {
    switch (nq) {
    case 1: score_keys(1, q, k, head_dim, n, s); break;
    case 2: score_pairs(1, q, pairs, k, head_dim, n, s); break;
    case 4: score_pairs(2, q, pairs, k, head_dim, n, s); break;
    case 6: score_pairs(3, q, pairs, k, head_dim, n, s); break;
    default: score_pairs(4, q, pairs, k, head_dim, n, s); break;
    }
}
#else
/* score_keys with nq as a constant, so that its arrays live in registers. */
static void score_dispatch(int nq, const float *const *q, const float *k, int64_t head_dim,
                           int64_t n, float *const *s) {
    switch (nq) {
    case 1: score_keys(1, q, k, head_dim, n, s); break;
    default: score_keys(2, q, k, head_dim, n, s); break;
    }
}
#endif

/* Scores, raw dot products, of every tile vector with the keys of positions
 * first + c0 .. first + c0 + n - 1 (t->rows), into score columns c0 .. c0 + n - 1 (column c is
 * position first + c). Vectors go up to QK_QUERIES at a time, an even number, then the last
 * one alone; each step skips the blocks of four keys none of its vectors attends. */
static void score_chunk(const Call *c, Tile *t, int64_t first, int64_t c0, int64_t n) {
    for (int64_t i0 = 0; i0 < t->count;) {
        int64_t left = t->count - i0;
        int nq = left < 2 ? 1 : (left >= QK_QUERIES ? QK_QUERIES : (int)(left & ~(int64_t)1));
        const float *q[QK_QUERIES];
        float *s[QK_QUERIES];
        int64_t begin = t->lo[i0] - first - c0, end = t->pos[i0 + nq - 1] - first - c0 + 1;
        begin = begin < 0 ? 0 : begin & ~(int64_t)3;
        end = end > n ? n : end;
        for (int i = 0; i < nq; i++) {
            q[i] = t->q[i0 + i];
            s[i] = t->scores + (i0 + i) * t->width + c0 + begin;
        }
        if (end > begin) {
#ifdef __AVX512F__
            const float *pairs[QK_QUERIES / 2];
            for (int i = 0; 2 * i < nq; i++) pairs[i] = t->pairs + (i0 + 2 * i) * c->head_dim;
            score_dispatch(nq, q, pairs, t->rows + begin * c->head_dim, c->head_dim,
                           (end - begin + 3) & ~(int64_t)3, s);
#else
            score_dispatch(nq, q, t->rows + begin * c->head_dim, c->head_dim,
                           (end - begin + 3) & ~(int64_t)3, s);
#endif
        }
        i0 += nq;
    }
}

/* One query vector's softmax numerators in place: x[j] = raw dot j, j < n (the positions lo
 * onward), becomes exp(x[j] * key_scale - max); returns their sum by the rule (8 lanes by j % 8,
 * the hsum8 tree, then the tail in order). */
static float softmax_numerators(float *x, int64_t n, float key_scale) {
    float max = -INFINITY, sum;
    int64_t j = 0;
#ifdef __AVX512F__
    __m512 scale16 = _mm512_set1_ps(key_scale), vmax16 = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= n; j += 16) {
        __m512 score = _mm512_mul_ps(_mm512_loadu_ps(x + j), scale16);
        _mm512_storeu_ps(x + j, score);
        vmax16 = _mm512_max_ps(score, vmax16); /* a NaN score is passed over, as below */
    }
    max = _mm512_reduce_max_ps(vmax16); /* the largest score, whichever lanes held it */
#endif
#ifdef __AVX2__
    __m256 scale = _mm256_set1_ps(key_scale), vmax = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= n; j += 8) {
        __m256 score = _mm256_mul_ps(_mm256_loadu_ps(x + j), scale);
        _mm256_storeu_ps(x + j, score);
        vmax = _mm256_max_ps(score, vmax); /* maxps takes the second operand past a NaN */
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vmax);
    for (int l = 0; l < 8; l++) max = lanes[l] > max ? lanes[l] : max;
#endif
    for (; j < n; j++) {
        x[j] *= key_scale;
        max = x[j] > max ? x[j] : max;
    }
    j = 0;
#ifdef __AVX2__
    __m256 vm = _mm256_set1_ps(max), total = _mm256_setzero_ps();
#ifdef __AVX512F__
    __m512 vm16 = _mm512_set1_ps(max);
    for (; j + 16 <= n; j += 16) { /* its two halves into the lanes in turn, as below */
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + j), vm16));
        _mm512_storeu_ps(x + j, e);
        total = _mm256_add_ps(total, _mm512_castps512_ps256(e));
        total = _mm256_add_ps(total, high_half(e));
    }
#endif
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm));
        _mm256_storeu_ps(x + j, e);
        total = _mm256_add_ps(total, e);
    }
    sum = hsum8(total);
#else
    float lanes[8] = {0};
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) {
            x[j + l] = exp1(x[j + l] - max);
            lanes[l] += x[j + l];
        }
    sum = hsum8_lanes(lanes);
#endif
    for (; j < n; j++) {
        x[j] = exp1(x[j] - max);
        sum += x[j];
    }
    return sum;
}

/* acc[d] += e[p] * v[p * head_dim + d] for p in lo .. hi - 1 in order, columns d0 .. d1 - 1. */
static void accumulate_columns(float *acc, const float *e, const float *v, int64_t head_dim,
                               int64_t lo, int64_t hi, int64_t d0, int64_t d1) {
    for (int64_t p = lo; p < hi; p++)
        for (int64_t d = d0; d < d1; d++)
            acc[d] = __builtin_fmaf(e[p], v[p * head_dim + d], acc[d]);
}

#ifdef __AVX2__
/* A vector of value columns, each its own fma chain: 16 with AVX-512, where a row's last
 * vector is masked to the columns it has (`tail`); 8 with AVX2, whole vectors only (the
 * head_dim % 8 rest goes to accumulate_columns), so its "mask" is never looked at. */
#ifdef __AVX512F__
#define COLUMNS 16
typedef __m512 Columns;
INLINE __mmask16 columns_mask(int64_t count) { return (__mmask16)((1u << count) - 1); }
INLINE Columns columns_load(const float *x, __mmask16 m) { return _mm512_maskz_loadu_ps(m, x); }
INLINE void columns_store(float *x, __mmask16 m, Columns y) { _mm512_mask_storeu_ps(x, m, y); }
INLINE Columns columns_broadcast(const float *x) { return _mm512_set1_ps(*x); }
INLINE Columns columns_fma(Columns a, Columns b, Columns c) { return _mm512_fmadd_ps(a, b, c); }
#else
#define COLUMNS 8
typedef __m256 Columns;
INLINE int columns_mask(int64_t count) { return (int)count; }
INLINE Columns columns_load(const float *x, int m) { return (void)m, _mm256_loadu_ps(x); }
INLINE void columns_store(float *x, int m, Columns y) { (void)m, _mm256_storeu_ps(x, y); }
INLINE Columns columns_broadcast(const float *x) { return _mm256_broadcast_ss(x); }
INLINE Columns columns_fma(Columns a, Columns b, Columns c) { return _mm256_fmadd_ps(a, b, c); }
#endif

/* accumulate_columns for nq <= PV_QUERIES vectors i at once, columns d0 .. d0 + COLUMNS nd,
 * the last vector's first `tail` only, the accumulators held in registers over the keys. The
 * ranges lo[i] .. hi[i] - 1 rise with i (both ends non-decreasing), so keys lo[nq - 1] ..
 * hi[0] - 1 are every vector's; those before and after are checked per vector. */
INLINE void accumulate_block(int nq, int nd, float *const *acc, const float *const *e,
                             const int64_t *lo, const int64_t *hi, const float *v,
                             int64_t head_dim, int64_t d0, int64_t tail) {
    Columns a[PV_QUERIES][PV_VECTORS];
    __typeof__(columns_mask(0)) mask[PV_VECTORS];
#pragma GCC unroll 4
    for (int j = 0; j < nd; j++) mask[j] = columns_mask(j + 1 < nd ? COLUMNS : tail);
#pragma GCC unroll 8
    for (int i = 0; i < nq; i++)
#pragma GCC unroll 4
        for (int j = 0; j < nd; j++) a[i][j] = columns_load(acc[i] + d0 + COLUMNS * j, mask[j]);
    int64_t end = hi[nq - 1], common = lo[nq - 1], common_end = hi[0] > common ? hi[0] : common;
#define PV_STEP(CHECKED)                                                                     \
    do {                                                                                     \
        Columns vj[PV_VECTORS];                                                              \
        _Pragma("GCC unroll 4") for (int j = 0; j < nd; j++)                                 \
            vj[j] = columns_load(v + p * head_dim + d0 + COLUMNS * j, mask[j]);              \
        _Pragma("GCC unroll 8") for (int i = 0; i < nq; i++) {                               \
            if (CHECKED && (p < lo[i] || p >= hi[i])) continue;                              \
            Columns w = columns_broadcast(e[i] + p);                                         \
            _Pragma("GCC unroll 4") for (int j = 0; j < nd; j++)                             \
                a[i][j] = columns_fma(w, vj[j], a[i][j]);                                    \
        }                                                                                    \
    } while (0)
    int64_t p = lo[0];
    for (; p < common; p++) PV_STEP(1);
    for (; p < common_end; p++) PV_STEP(0);
    for (; p < end; p++) PV_STEP(1);
#undef PV_STEP
#pragma GCC unroll 8
    for (int i = 0; i < nq; i++)
#pragma GCC unroll 4
        for (int j = 0; j < nd; j++) columns_store(acc[i] + d0 + COLUMNS * j, mask[j], a[i][j]);
}

/* accumulate_block with nq constant, nd dispatched. */
INLINE void accumulate_vectors(int nq, int nd, float *const *acc, const float *const *e,
                               const int64_t *lo, const int64_t *hi, const float *v,
                               int64_t head_dim, int64_t d0, int64_t tail) {
    switch (nd) {
    case 1: accumulate_block(nq, 1, acc, e, lo, hi, v, head_dim, d0, tail); break;
    case 2: accumulate_block(nq, 2, acc, e, lo, hi, v, head_dim, d0, tail); break;
    case 3: accumulate_block(nq, 3, acc, e, lo, hi, v, head_dim, d0, tail); break;
    default: accumulate_block(nq, 4, acc, e, lo, hi, v, head_dim, d0, tail); break;
    }
}

/* accumulate_block with nq and nd as constants, so that its arrays live in registers. */
static void accumulate_dispatch(int nq, int nd, float *const *acc, const float *const *e,
                                const int64_t *lo, const int64_t *hi, const float *v,
                                int64_t head_dim, int64_t d0, int64_t tail) {
    switch (nq) {
    case 1: accumulate_vectors(1, nd, acc, e, lo, hi, v, head_dim, d0, tail); break;
    case 2: accumulate_vectors(2, nd, acc, e, lo, hi, v, head_dim, d0, tail); break;
    case 3: accumulate_vectors(3, nd, acc, e, lo, hi, v, head_dim, d0, tail); break;
#if PV_QUERIES > 3
    case 4: accumulate_vectors(4, nd, acc, e, lo, hi, v, head_dim, d0, tail); break;
    case 5: accumulate_vectors(5, nd, acc, e, lo, hi, v, head_dim, d0, tail); break;
    case 6: accumulate_vectors(6, nd, acc, e, lo, hi, v, head_dim, d0, tail); break;
#endif
    }
}
#endif

/* Adds the values of positions first + c0 .. first + c0 + n - 1 (t->rows), weighted by the
 * softmax numerators in score columns c0 .., to every tile vector's accumulator (its out
 * row), PV_QUERIES vectors at a time. */
static void value_chunk(const Call *c, Tile *t, int64_t first, int64_t c0, int64_t n) {
    int64_t hd = c->head_dim;
    for (int64_t i0 = 0; i0 < t->count; i0 += PV_QUERIES) {
        int nq = t->count - i0 < PV_QUERIES ? (int)(t->count - i0) : PV_QUERIES;
        float *acc[PV_QUERIES];
        const float *e[PV_QUERIES];
        int64_t lo[PV_QUERIES], hi[PV_QUERIES];
        for (int i = 0; i < nq; i++) { /* each range clipped to the chunk, kept rising */
            acc[i] = t->out[i0 + i];
            e[i] = t->scores + (i0 + i) * t->width + c0;
            int64_t a = t->lo[i0 + i] - first - c0, b = t->pos[i0 + i] - first - c0 + 1;
            a = a < 0 ? 0 : (a > n ? n : a);
            b = b < 0 ? 0 : (b > n ? n : b);
            lo[i] = a;
            hi[i] = b > a ? b : a;
        }
        int64_t columns = 0;
#ifdef __AVX2__
        columns = COLUMNS == 16 ? hd : hd - hd % 8; /* what vectors take: see Columns */
        for (int64_t d0 = 0; d0 < columns; d0 += COLUMNS * PV_VECTORS) {
            int64_t vectors = (columns - d0 + COLUMNS - 1) / COLUMNS;
            int nd = vectors < PV_VECTORS ? (int)vectors : PV_VECTORS;
            int64_t tail = columns - d0 - COLUMNS * (nd - 1);
            accumulate_dispatch(nq, nd, acc, e, lo, hi, t->rows, hd, d0,
                                tail < COLUMNS ? tail : COLUMNS);
        }
#endif
        if (columns < hd)
            for (int i = 0; i < nq; i++)
                accumulate_columns(acc[i], e[i], t->rows, hd, lo[i], hi[i], columns, hd);
    }
}

/* One task: rows r0 .. r1 - 1 (sequence-local) of sequence seq, for KV head h. */
static void attend_tile(const Call *c, Tile *t, int64_t seq, int64_t h, int64_t r0,
                        int64_t r1) {
    int64_t g = c->group, hd = c->head_dim;
    int64_t n_rows = c->query_starts[seq + 1] - c->query_starts[seq];
    int64_t first_pos = c->context_lens[seq] - n_rows; /* of the sequence's row 0 */
    const int32_t *table = c->block_tables + seq * c->table_stride;
    t->count = (r1 - r0) * g;
    for (int64_t i = 0; i < t->count; i++) {
        int64_t row = c->query_starts[seq] + r0 + i / g, head = h * g + i % g;
        t->q[i] = c->q + row * c->q_stride + head * hd;
        t->out[i] = c->out + (row * c->num_heads + head) * hd;
        t->pos[i] = first_pos + r0 + i / g;
        t->lo[i] = window_start(t->pos[i], c->window);
        for (int64_t d = 0; d < hd; d++) t->out[i][d] = 0.0f;
    }
#ifdef __AVX512F__
    for (int64_t i = 0; i + 1 < t->count; i += 2)
        pack_pair(t->q[i], t->q[i + 1], hd, t->pairs + i * hd);
#endif
    int64_t first = t->lo[0], last = t->pos[t->count - 1], width = last - first + 1;
    for (int64_t c0 = 0; c0 < width; c0 += t->chunk) {
        int64_t n = width - c0 < t->chunk ? width - c0 : t->chunk;
        load_rows(c, c->k_cache, table, h, first + c0, (n + 3) & ~(int64_t)3, last, t);
        score_chunk(c, t, first, c0, n);
    }
    for (int64_t i = 0; i < t->count; i++)
        t->sums[i] = softmax_numerators(t->scores + i * t->width + (t->lo[i] - first),
                                        t->pos[i] - t->lo[i] + 1, c->key_scale);
    for (int64_t c0 = 0; c0 < width; c0 += t->chunk) {
        int64_t n = width - c0 < t->chunk ? width - c0 : t->chunk;
        load_rows(c, c->v_cache, table, h, first + c0, n, last, t);
        value_chunk(c, t, first, c0, n);
    }
    for (int64_t i = 0; i < t->count; i++)
        for (int64_t d = 0; d < hd; d++) t->out[i][d] = t->out[i][d] / t->sums[i] * c->v_scale;
}

/* out = attention of each query row over its sequence's paged keys and values (see the header
 * for the layout and the rule); returns 0, or -1 when scratch memory cannot be allocated. */
int pagedkv_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                      int cache_dtype, const float *fp8_table, float k_scale, float v_scale,
                      const int32_t *block_tables, int64_t table_stride,
                      const int64_t *query_starts, const int32_t *context_lens, int64_t num_seqs,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, float scale, int64_t window, float *out) {
    Call c = {q, q_stride, k_cache, v_cache, cache_dtype, fp8_table, block_tables, table_stride,
              query_starts, context_lens, num_heads, num_kv_heads, head_dim, block_size, window,
              num_heads / num_kv_heads, scale * k_scale, v_scale, out};
    /* Tile rows. A task copies its KV head's rows out of their blocks once for all its query
     * vectors, so a tile of few vectors pays that copy for little arithmetic (a speculative
     * step's few rows of one sequence in tiles of 1-2 rows copied every key and value 3-6
     * times, and spent more time copying than computing). So: four tasks per thread when the
     * call has the rows for it, but at least MIN_TILE_VECTORS query vectors a tile as long as
     * every thread still gets a task; at most MAX_TILE_ROWS, the longest chunk cut into tiles
     * of equal size (a 32-row and a 16-row tile per KV head left one thread twice the work);
     * few enough that their scores fit SCORE_BUDGET; at least one (a context too long for
     * the budget gets one row per task). */
    int64_t longest = 1, most_rows = 1;
    for (int64_t s = 0; s < num_seqs; s++) {
        if (context_lens[s] > longest) longest = context_lens[s];
        if (query_starts[s + 1] - query_starts[s] > most_rows)
            most_rows = query_starts[s + 1] - query_starts[s];
    }
    int64_t threads = omp_get_max_threads(), units = query_starts[num_seqs] * num_kv_heads;
    int64_t rows = units / (4 * threads), per_thread = units / threads;
    int64_t group = c.group > 0 ? c.group : 1;
    int64_t enough = (MIN_TILE_VECTORS + group - 1) / group;
    enough = enough < per_thread ? enough : per_thread;
    rows = rows > enough ? rows : enough;
    rows = rows < most_rows ? rows : most_rows;
    rows = rows < MAX_TILE_ROWS ? (rows > 1 ? rows : 1) : MAX_TILE_ROWS;
    int64_t width;
    for (;; rows--) {
        width = window > 0 && window + rows - 1 < longest ? window + rows - 1 : longest;
        width = (width + 3) & ~(int64_t)3;
        if (rows == 1 || rows * c.group * width <= SCORE_BUDGET) break;
    }
    int64_t cuts = (most_rows + rows - 1) / rows; /* the same rows in tiles of equal size, */
    rows = (most_rows + cuts - 1) / cuts;        /* as few rows or fewer: the width holds */
    int64_t *tile_starts = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));
    if (tile_starts == NULL) return -1;
    tile_starts[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        tile_starts[s + 1] =
            tile_starts[s] + (query_starts[s + 1] - query_starts[s] + rows - 1) / rows;
    int64_t tasks = tile_starts[num_seqs] * num_kv_heads, vectors = rows * c.group;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        Tile t = {0};
        t.q = malloc(sizeof(float *) * (size_t)vectors);
        t.out = malloc(sizeof(float *) * (size_t)vectors);
        t.lo = malloc(sizeof(int64_t) * (size_t)vectors);
        t.pos = malloc(sizeof(int64_t) * (size_t)vectors);
        t.sums = malloc(sizeof(float) * (size_t)vectors);
        t.width = width;
        t.scores = malloc(sizeof(float) * (size_t)(vectors * width));
        t.chunk = (CHUNK_FLOATS / head_dim) & ~(int64_t)3;
        t.chunk = t.chunk < 4 ? 4 : (t.chunk > MAX_CHUNK_KEYS ? MAX_CHUNK_KEYS : t.chunk);
        t.rows = malloc(sizeof(float) * (size_t)(t.chunk * head_dim));
        failed = !t.q || !t.out || !t.lo || !t.pos || !t.sums || !t.scores || !t.rows;
#ifdef __AVX512F__
        t.pairs = malloc(sizeof(float) * (size_t)(vectors * head_dim));
        failed |= !t.pairs;
#endif
        /* KV head by KV head, so that the tiles running together share their keys and values
         * in the caches; the last tiles first, as in a prefill they are the longest */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = tasks - 1; task >= 0; task--) {
            if (failed) continue;
            int64_t tile = task % tile_starts[num_seqs], h = task / tile_starts[num_seqs];
            int64_t lo = 0, hi = num_seqs;
            while (hi - lo > 1) { /* the sequence s with tile_starts[s] <= tile < [s + 1] */
                int64_t mid = (lo + hi) / 2;
                if (tile_starts[mid] <= tile) lo = mid; else hi = mid;
            }
            int64_t r0 = (tile - tile_starts[lo]) * rows;
            int64_t n = query_starts[lo + 1] - query_starts[lo];
            attend_tile(&c, &t, lo, h, r0, r0 + rows < n ? r0 + rows : n);
        }
        free(t.q);
        free(t.out);
        free(t.lo);
        free(t.pos);
        free(t.sums);
        free(t.scores);
        free(t.rows);
#ifdef __AVX512F__
        free(t.pairs);
#endif
    }
    free(tile_starts);
    return failed ? -1 : 0;
}
