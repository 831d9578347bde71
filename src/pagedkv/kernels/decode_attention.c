/* Decode attention over the paged KV cache, on the CPU, float32 or fp8 caches.
 *
 * One new token per sequence. Each (sequence, KV head) is one task: its query heads (the
 * group sharing that KV head) read the sequence's keys straight from their blocks through the
 * block table (no gather into a copy), keep their scores, take an exact softmax (maximum
 * first), then sum the values. In PyTorch the same step is ~15 small ops per layer whose
 * fixed cost dominates at small batches; here it is one call per layer.
 *
 * Cache layout [num_blocks, block_size, num_kv_heads, head_dim]: token p of a sequence is in
 * slot table[p / block_size] * block_size + p % block_size. A sliding window of w keeps the
 * last w positions (the token itself included), as in Mistral.
 *
 * An fp8 cache (one byte per value) is read through a table of the 256 bytes' float values,
 * the very floats torch's cast gives (pagedkv.attention.fp8.byte_values): each key or value
 * row is decoded into a head_dim scratch row, then used as a float32 row would be. The key
 * scale multiplies the scores and the value scale the output, once each.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

static float dot(const float *a, const float *b, int64_t n) {
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; i++) total += a[i] * b[i];
    return total;
}

#ifdef __AVX2__
/* exp(x) for x <= 0 (scores minus their maximum), 8 at a time: 2^n * p(r), where x = n ln 2 + r
 * and p is the degree-6 Taylor polynomial of exp on |r| <= ln 2 / 2 (relative error < 2e-7,
 * about one float32 ulp). Inputs below -87 give ~0, as their true values (< 1.7e-38) nearly
 * are. */
static inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}
#endif

/* scores[i] = exp(scores[i] - max) in place; returns their sum. */
static float softmax_numerators(float *scores, int64_t n, float max) {
    int64_t i = 0;
    float sum = 0.0f;
#ifdef __AVX2__
    __m256 acc = _mm256_setzero_ps(), vmax = _mm256_set1_ps(max);
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + i), vmax));
        _mm256_storeu_ps(scores + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int j = 0; j < 8; j++) sum += lanes[j];
#endif
    for (; i < n; i++) {
        scores[i] = expf(scores[i] - max);
        sum += scores[i];
    }
    return sum;
}

/* Row `row` of a cache of head_dim-value rows as float32: the row itself in a float32 cache
 * (fp8_table NULL), else its bytes decoded through fp8_table into `scratch`. */
static const float *cached_row(const void *cache, int64_t row, int64_t head_dim,
                               const float *fp8_table, float *scratch) {
    if (fp8_table == NULL) return (const float *)cache + row * head_dim;
    const uint8_t *bytes = (const uint8_t *)cache + row * head_dim;
    for (int64_t j = 0; j < head_dim; j++) scratch[j] = fp8_table[bytes[j]];
    return scratch;
}

/* out [num_seqs, num_heads, head_dim] = attention of q (rows `q_stride` floats apart, heads
 * contiguous) over each sequence's context_lens[s] cached positions; its block table is row
 * table_rows[s] of block_tables. The caches hold float32, or fp8 bytes when fp8_table (256
 * floats) is given, worth k_scale / v_scale times their table value. Returns 0, or -1 when
 * scratch memory cannot be allocated. */
int pagedkv_decode_attention(const float *q, int64_t q_stride, const void *k_cache,
                             const void *v_cache,
                             const int32_t *block_tables, int64_t table_stride,
                             const int64_t *table_rows, const int32_t *context_lens,
                             int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t block_size, float scale, int64_t window,
                             const float *fp8_table, float k_scale, float v_scale, float *out) {
    int64_t group = num_heads / num_kv_heads;
    float key_scale = scale * k_scale;
    int64_t longest = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        if (context_lens[s] > longest) longest = context_lens[s];
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * (longest > 0 ? longest : 1)));
        float *acc = malloc(sizeof(float) * (size_t)(group * head_dim));
        float *row = malloc(sizeof(float) * (size_t)head_dim);
        failed = scores == NULL || acc == NULL || row == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_seqs * num_kv_heads; task++) {
            if (failed) continue;
            int64_t s = task / num_kv_heads, h = task % num_kv_heads;
            int64_t ctx = context_lens[s];
            int64_t start = window > 0 && ctx > window ? ctx - window : 0;
            int64_t n = ctx - start;
            const int32_t *table = block_tables + table_rows[s] * table_stride;
            const float *qh = q + s * q_stride + h * group * head_dim;
            for (int64_t g = 0; g < group; g++) {
                float max = -INFINITY;
                for (int64_t p = start; p < ctx; p++) {
                    int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
                    const float *k =
                        cached_row(k_cache, slot * num_kv_heads + h, head_dim, fp8_table, row);
                    float score = dot(qh + g * head_dim, k, head_dim) * key_scale;
                    scores[g * n + (p - start)] = score;
                    max = score > max ? score : max;
                }
                float sum = softmax_numerators(scores + g * n, n, max);
                float *a = acc + g * head_dim;
                for (int64_t j = 0; j < head_dim; j++) a[j] = 0.0f;
                for (int64_t p = start; p < ctx; p++) {
                    int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
                    const float *v =
                        cached_row(v_cache, slot * num_kv_heads + h, head_dim, fp8_table, row);
                    float weight = scores[g * n + (p - start)];
#pragma omp simd
                    for (int64_t j = 0; j < head_dim; j++) a[j] += weight * v[j];
                }
                float *o = out + (s * num_heads + h * group + g) * head_dim;
                for (int64_t j = 0; j < head_dim; j++) o[j] = a[j] / sum * v_scale;
            }
        }
        free(scores);
        free(acc);
        free(row);
    }
    return failed ? -1 : 0;
}
