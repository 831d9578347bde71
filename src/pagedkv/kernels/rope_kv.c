/* Small per-layer steps of a forward pass, each one call instead of a handful of ops: the
 * rotary embedding's cos/sin tables, the rotation of q and k in place, and the copy of the new
 * keys and values into their cache slots (float32 rows, or fp8 bytes rounded here). Built with -ffp-contract=off, so
 * `x * cos + rotated * sin` rounds exactly as PyTorch's three separate ops do: the results are
 * the same floats, and the fp8 bytes those of torch's cast. */
#include <stdint.h>
#include <math.h>
#include <string.h>

/* Rotate x [num_tokens, num_heads, head_dim] in place (rows `row_stride` floats apart, heads
 * contiguous within a row) by cos/sin [num_tokens, head_dim]: half-split pairs, as Llama. */
void pagedkv_rope(float *x, int64_t num_tokens, int64_t row_stride, int64_t num_heads,
                  int64_t head_dim, const float *cos, const float *sin) {
    int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (num_tokens > 64)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < num_heads; h++) {
            float *v = x + t * row_stride + h * head_dim;
            for (int64_t i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * c[i] + (-b) * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* Copy each token's key and value row (`width` floats; rows `k_stride` / `v_stride` apart)
 * into flat cache slot slots[t] of k_cache / v_cache ([slots, width]). */
void pagedkv_write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                      int64_t num_tokens, int64_t width, const int64_t *slots, float *k_cache,
                      float *v_cache) {
    for (int64_t t = 0; t < num_tokens; t++) {
        memcpy(k_cache + slots[t] * width, k + t * k_stride, sizeof(float) * (size_t)width);
        memcpy(v_cache + slots[t] * width, v + t * v_stride, sizeof(float) * (size_t)width);
    }
}

/* The fp8 byte nearest x (ties to even), saturated at +-max, of a format with `mantissa_bits`
 * and exponent `bias`: the byte torch's float8 cast of clamp(x, -max, max) gives. NaN stays
 * NaN (0x7F). A normal result keeps float32's exponent, rebiased, and its top mantissa bits,
 * rounded on the whole bit pattern so a carry moves into the exponent; a subnormal result is
 * the count of its fixed steps of 2^(1 - bias - mantissa_bits). */
static uint8_t to_fp8(float x, int64_t mantissa_bits, int64_t bias, float max) {
    if (isnan(x)) return 0x7F;
    uint8_t sign = signbit(x) ? 0x80 : 0;
    float magnitude = fminf(fabsf(x), max);
    uint32_t bits;
    memcpy(&bits, &magnitude, sizeof bits);
    int64_t exponent = (int64_t)(bits >> 23) - 127;
    uint32_t rounded;
    if (exponent >= 1 - bias) {
        int64_t shift = 23 - mantissa_bits;
        uint32_t half = (1u << (shift - 1)) - 1 + ((bits >> shift) & 1);
        rounded = ((bits + half) >> shift) - ((uint32_t)(127 - bias) << mantissa_bits);
    } else {
        int64_t shift = 24 - bias - mantissa_bits - exponent;
        if (shift > 31) shift = 31; /* below half the smallest step: rounds to 0 */
        uint32_t significand = (bits & 0x7FFFFF) | 0x800000;
        uint32_t half = (1u << (shift - 1)) - 1 + ((significand >> shift) & 1);
        rounded = (significand + half) >> shift;
    }
    return sign | (uint8_t)rounded;
}

/* As pagedkv_write_kv, into caches of fp8 bytes: each value times k_inverse_scale (keys) or
 * v_inverse_scale (values), rounded by to_fp8. */
void pagedkv_write_kv_fp8(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                          int64_t num_tokens, int64_t width, const int64_t *slots,
                          uint8_t *k_cache, uint8_t *v_cache, int64_t mantissa_bits,
                          int64_t bias, float max, float k_inverse_scale,
                          float v_inverse_scale) {
    for (int64_t t = 0; t < num_tokens; t++) {
        uint8_t *k_row = k_cache + slots[t] * width, *v_row = v_cache + slots[t] * width;
        for (int64_t i = 0; i < width; i++) {
            k_row[i] = to_fp8(k[t * k_stride + i] * k_inverse_scale, mantissa_bits, bias, max);
            v_row[i] = to_fp8(v[t * v_stride + i] * v_inverse_scale, mantissa_bits, bias, max);
        }
    }
}

/* cos and sin [n, 2 * half] of each position times each frequency, both halves alike (the
 * half-split rotation's layout). The angle is rounded to float32 as torch's `positions.float() *
 * inv_freq` is, then libm's cosf and sinf take it: one scalar function per value, so a
 * position's table never depends on which other positions share the call. */
void pagedkv_rope_tables(const int64_t *positions, int64_t n, const float *inv_freq, int64_t half,
                         float *cos_out, float *sin_out) {
#pragma omp parallel for schedule(static) if (n * half > 65536)
    for (int64_t t = 0; t < n; t++) {
        float position = (float)positions[t];
        for (int64_t i = 0; i < half; i++) {
            float angle = position * inv_freq[i];
            float c = cosf(angle), s = sinf(angle);
            cos_out[t * 2 * half + i] = cos_out[t * 2 * half + half + i] = c;
            sin_out[t * 2 * half + i] = sin_out[t * 2 * half + half + i] = s;
        }
    }
}
