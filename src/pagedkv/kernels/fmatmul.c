/* y = x W^T + b for float32, bfloat16 or float16 weights on the CPU, each output's bits
 * independent of the batch.
 *
 * BLAS (MKL under torch's F.linear) chooses its blocking, and with it the order of each sum,
 * by the matrix shape, so the same token's logits differ in their last bits depending on how
 * many rows were batched with it, and greedy decoding can diverge with the batch size. Here
 * every y[r][j] is summed one way only:
 *
 *   8 float32 lanes, lane l accumulating x[r][8c + l] * w[j][8c + l] by fma for c = 0, 1, ...
 *   in order (weights widened exactly to float32); the lanes summed by simd.h's tree; the
 *   k % 8 tail terms added by fma in order; then + bias[j].
 *
 * Tiling, the thread count (threads split rows and columns, never k) and the AVX2 or plain-C
 * path change only which outputs are computed together, never one output's arithmetic.
 *
 * AVX2 path: y is computed in blocks of 4 rows x 24 columns. A block is a row of register
 * tiles, 4 rows x 3 columns (3 x 4, 2 x 6 or 1 x 8 for the last rows of a batch): 12 (or 8)
 * independent accumulators hide the FMA latency, and with the smaller side's vectors held in
 * registers and the other side's loaded one at a time, rows x cols + min(rows, cols) + 1 <= 16
 * ymm registers, so nothing spills on plain AVX2. Each chunk of 8 weights is loaded (and
 * widened) once for all the tile's rows, each chunk of x once for all its columns. The block's
 * 96 accumulators are then reduced eight at a time by hsum8x8. Rows are taken a row tile at a
 * time (up to 256 rows, fewer when k is large so the tile's x stays within a few MiB of cache),
 * and each tile's column blocks are split over the threads, so every weight row streams from
 * memory once per tile; a decode batch of a few rows is one tile, its columns split over the
 * threads, bound by the weight stream. (Blocking k as well, to keep a tile's operands in L1,
 * measured slower: the shorter tile loops and the accumulators' save and restore cost more
 * than the L2 reads they saved.)
 */
#include <stddef.h>
#include <stdint.h>

#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FM_VECTOR 1
#endif

enum { W_F32 = 0, W_BF16 = 1, W_F16 = 2 };

/* Weight row j of w [n, k] with elements of type dtype. */
INLINE const void *weight_row(const void *w, int dtype, int64_t k, int64_t j) {
    return (const char *)w + j * k * (dtype == W_F32 ? 4 : 2);
}

/* Element i of a weight row as float32 (exact). */
INLINE float weight_at(const void *row, int dtype, int64_t i) {
    if (dtype == W_F32) return ((const float *)row)[i];
    uint16_t h = ((const uint16_t *)row)[i];
    return dtype == W_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

/* One output from its lane sum: the k % 8 tail terms by fma in order, then the bias. */
INLINE float finish(float sum, const float *x_row, const void *w_row, int dtype, int64_t k,
                    const float *bias, int64_t j) {
    for (int64_t i = k & ~(int64_t)7; i < k; i++)
        sum = __builtin_fmaf(x_row[i], weight_at(w_row, dtype, i), sum);
    return bias != NULL ? sum + bias[j] : sum;
}

#ifdef FM_VECTOR
#define BLOCK 24 /* columns per block: a multiple of 8 and of every tile width */

/* Weights i .. i+7 of a row as float32. */
INLINE __m256 load_weights(const void *row, int dtype, int64_t i) {
    if (dtype == W_F32) return _mm256_loadu_ps((const float *)row + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + i));
    if (dtype == W_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* The 8-lane accumulators of rows x cols outputs (x rows from x, weight rows from w, both
 * k apart) over the whole chunks of k, into acc[r * BLOCK + c]. Called with constant dtype,
 * rows and cols so the accumulators live in registers. The empty asm statements pin a vector
 * that is used more than once to a register: without them the compiler folds the load into
 * every FMA that uses it, and the loads, not the FMAs, bound the loop. */
INLINE void tile(const float *x, const void *w, int dtype, int64_t k, int rows, int cols,
                 __m256 *acc) {
    __m256 sum[4][8];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) sum[r][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i + 8 <= k; i += 8) {
        if (rows >= cols) { /* the weight vectors held, each x vector loaded as it is used */
            __m256 wv[4];
            for (int c = 0; c < cols; c++) {
                wv[c] = load_weights(weight_row(w, dtype, k, c), dtype, i);
                if (rows > 1) __asm__("" : "+x"(wv[c]));
            }
            for (int r = 0; r < rows; r++) {
                __m256 xv = _mm256_loadu_ps(x + r * k + i);
                if (cols > 1) __asm__("" : "+x"(xv));
                for (int c = 0; c < cols; c++) sum[r][c] = _mm256_fmadd_ps(xv, wv[c], sum[r][c]);
            }
        } else { /* the x vectors held, each weight vector loaded as it is used */
            __m256 xv[4];
            for (int r = 0; r < rows; r++) {
                xv[r] = _mm256_loadu_ps(x + r * k + i);
                __asm__("" : "+x"(xv[r]));
            }
            for (int c = 0; c < cols; c++) {
                __m256 wv = load_weights(weight_row(w, dtype, k, c), dtype, i);
                if (rows > 1) __asm__("" : "+x"(wv));
                for (int r = 0; r < rows; r++) sum[r][c] = _mm256_fmadd_ps(xv[r], wv, sum[r][c]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) acc[r * BLOCK + c] = sum[r][c];
}

/* tile with dtype, rows and cols as constants: one copy per shape used. */
static void tile_any(const float *x, const void *w, int dtype, int64_t k, int rows, int cols,
                     __m256 *acc) {
#define SHAPE(R, C)                                                                         \
    if (rows == R && cols == C) {                                                           \
        if (dtype == W_F32)                                                                 \
            tile(x, w, W_F32, k, R, C, acc);                                                \
        else if (dtype == W_BF16)                                                           \
            tile(x, w, W_BF16, k, R, C, acc);                                               \
        else                                                                                \
            tile(x, w, W_F16, k, R, C, acc);                                                \
        return;                                                                             \
    }
    SHAPE(4, 3) SHAPE(3, 4) SHAPE(2, 6) SHAPE(1, 8)
    SHAPE(4, 1) SHAPE(3, 1) SHAPE(2, 1) SHAPE(1, 1)
#undef SHAPE
}

/* y rows r0 .. r0+rows-1 (rows <= 4), columns j0 .. j0+cols-1 (cols <= BLOCK): the widest
 * tile for that many rows across the block, single columns for a short last block, then
 * the accumulators reduced eight at a time and finished. */
static void block(const float *x, int64_t k, const void *w, int dtype, int64_t n,
                  const float *bias, float *y, int64_t r0, int rows, int64_t j0, int cols) {
    static const int width[5] = {0, 8, 6, 4, 3};
    __m256 acc[4 * BLOCK];
    const float *xr = x + r0 * k;
    int c = 0;
    for (; c + width[rows] <= cols; c += width[rows])
        tile_any(xr, weight_row(w, dtype, k, j0 + c), dtype, k, rows, width[rows], acc + c);
    for (; c < cols; c++) tile_any(xr, weight_row(w, dtype, k, j0 + c), dtype, k, rows, 1, acc + c);
    int padded = (cols + 7) & ~7;
    for (int r = 0; r < rows; r++) {
        for (int p = cols; p < padded; p++) acc[r * BLOCK + p] = _mm256_setzero_ps();
        for (int g = 0; g < padded; g += 8) {
            __m256 sum = hsum8x8(acc + r * BLOCK + g);
            float *out = y + (r0 + r) * n + j0 + g;
            if (k % 8 == 0 && g + 8 <= cols) { /* no tail: eight outputs at once */
                if (bias != NULL) sum = _mm256_add_ps(sum, _mm256_loadu_ps(bias + j0 + g));
                _mm256_storeu_ps(out, sum);
                continue;
            }
            float sums[8];
            _mm256_storeu_ps(sums, sum);
            for (int i = 0; i < 8 && g + i < cols; i++) {
                int64_t j = j0 + g + i;
                out[i] = finish(sums[i], xr + r * k, weight_row(w, dtype, k, j), dtype, k, bias, j);
            }
        }
    }
}
#else
/* The 8 lanes of one output over the whole chunks of k, summed by the tree. */
static float lane_dot(const float *x_row, const void *w_row, int dtype, int64_t k) {
    float lanes[8] = {0};
    for (int64_t i = 0; i + 8 <= k; i += 8)
        for (int l = 0; l < 8; l++)
            lanes[l] = __builtin_fmaf(x_row[i + l], weight_at(w_row, dtype, i + l), lanes[l]);
    return hsum8_lanes(lanes);
}
#endif

/* y [m, n] = x [m, k] w^T (+ bias [n], or none when NULL), w [n, k] float32 (w_dtype 0),
 * bfloat16 (1) or float16 (2) bits; all contiguous. Any m, k, n >= 1. Returns 0. */
int pagedkv_fmatmul(const float *x, int64_t m, int64_t k, const void *w, int w_dtype, int64_t n,
                    const float *bias, float *y) {
#ifdef FM_VECTOR
    /* rows per tile: their x within 4 MiB (it is re-read from cache for every column block),
     * at most 256 (each weight row is streamed once per tile) */
    int64_t row_tile = ((4 << 20) / (4 * k)) & ~(int64_t)3;
    row_tile = row_tile < 16 ? 16 : (row_tile > 256 ? 256 : row_tile);
    int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel
    for (int64_t t0 = 0; t0 < m; t0 += row_tile) {
        int64_t t1 = t0 + row_tile < m ? t0 + row_tile : m;
#pragma omp for schedule(static) nowait
        for (int64_t b = 0; b < blocks; b++) {
            int64_t j0 = b * BLOCK;
            int cols = n - j0 < BLOCK ? (int)(n - j0) : BLOCK;
            for (int64_t r0 = t0; r0 < t1; r0 += 4)
                block(x, k, w, w_dtype, n, bias, y, r0, t1 - r0 < 4 ? (int)(t1 - r0) : 4, j0, cols);
        }
    }
#else
#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const void *w_row = weight_row(w, w_dtype, k, j);
        for (int64_t r = 0; r < m; r++)
            y[r * n + j] = finish(lane_dot(x + r * k, w_row, w_dtype, k), x + r * k, w_row,
                                  w_dtype, k, bias, j);
    }
#endif
    return 0;
}
