/* Llama-family decoder layers for a step, in one call, on the CPU.
 *
 * A step is any mix of sequences, each a chunk of rows (`query_starts`): a decode's one token,
 * a speculative step's token and drafts, a prompt chunk. At batch 1 a layer's arithmetic is a
 * few hundred microseconds of matmuls, but run as ~20 PyTorch ops and 8 module calls it pays
 * 5-15 us of dispatch each: more than the arithmetic.
 * This runs the same steps, through the same kernels, with no Python in between, and runs a
 * whole stack of layers per call: with Python between layers, each layer's first matmul found
 * its weights out of the cores' caches and took ~2x as long (176 against 92 us a layer on
 * SmolLM2-135M, 2 threads):
 *
 *   x = rms_norm(h); qkv = x Wqkv^T (+ b); rope(q, k); write k, v to their slots;
 *   a = attention(q); h += a Wo^T; x = rms_norm(h); g, u = x Wgu^T; h += (silu(g) * u) Wd^T
 *
 * Every step is the kernel the unfused path calls: pagedkv_qmatmul over quantised weights,
 * rope and the K/V write of rope_kv.c, pagedkv_attention, and RMSNorm and silu(g) * u of
 * rowwise.c; the residual adds are float32 adds, as torch's; a step with LoRA adapters adds each
 * projection's products right after it, by lora.c, as the unfused path's `Linear` does. So the
 * floats are the unfused path's, bit for bit. The caches hold float32, or fp8 bytes when an Fp8Cache is given:
 * written and read by those same kernels.
 */
#include <stdint.h>
#include <stdlib.h>

/* A quantised projection as pagedkv_qmatmul takes it (see formats.py for the layout). */
typedef struct {
    const uint8_t *values;
    const void *scales; /* float16 when half_scales, else float32 */
    const void *mins;
    int64_t half_scales;
    int64_t has_mins;
    int64_t bits;
    int64_t group_size;
    int64_t out_features;
    int64_t in_features;
    const float *bias; /* NULL when none */
    int64_t panels;    /* 1: values, scales and mins in the panel layout (qmatmul.c) */
} QuantizedWeight;

/* An fp8 cache's format (pagedkv.attention.fp8) and scales, as native.Fp8CacheArgs. */
typedef struct {
    const float *table; /* the 256 bytes' values */
    int64_t mantissa_bits;
    int64_t exponent_bias;
    float max;
    float k_scale; /* a stored key byte is worth k_scale x its table value */
    float v_scale;
    float k_inverse_scale; /* 1 / k_scale as the writer multiplies by it (torch's float) */
    float v_inverse_scale;
} Fp8Cache;

int pagedkv_qmatmul(const float *x, int64_t m, int64_t k, const uint8_t *values,
                    const void *scales, const void *mins, int half, int has_mins, int bits,
                    int64_t g, int64_t n, const float *bias, float *y);
int pagedkv_qmatmul_panels(const float *x, int64_t m, int64_t k, const uint8_t *values,
                           const void *scales, const void *mins, int half, int has_mins, int bits,
                           int64_t n, const float *bias, float *y);
int pagedkv_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                      int cache_dtype, const float *fp8_table, float k_scale, float v_scale,
                      const int32_t *block_tables, int64_t table_stride,
                      const int64_t *query_starts, const int32_t *context_lens, int64_t num_seqs,
                      int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, float scale, int64_t window, float *out);
void pagedkv_rope(float *x, int64_t num_tokens, int64_t row_stride, int64_t num_heads,
                  int64_t head_dim, const float *cos, const float *sin);
void pagedkv_write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                      int64_t num_tokens, int64_t width, const int64_t *slots, float *k_cache,
                      float *v_cache);
void pagedkv_write_kv_fp8(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                          int64_t num_tokens, int64_t width, const int64_t *slots,
                          uint8_t *k_cache, uint8_t *v_cache, int64_t mantissa_bits,
                          int64_t bias, float max, float k_inverse_scale,
                          float v_inverse_scale);
void pagedkv_rms_norm(const float *x, int64_t x_stride, int64_t rows, int64_t cols,
                      const float *weight, float eps, float *out);
void pagedkv_silu_mul(const float *gate_up, int64_t rows, int64_t inter, float *out);
int pagedkv_lora_add(const float *x, int64_t k, int64_t num_groups, const void *groups,
                     int64_t num_parts, const int64_t *part_sizes, float *out, int64_t out_stride);

/* A step's LoRA groups of one layer: per projection (qkv, o, gate_up, down) the address of its
 * groups (0: none), as model/lora.py lays them out; `num_groups` each. */
typedef struct {
    const int64_t *groups; /* [4], or NULL: no LoRA in this step */
    int64_t num_groups;
} LayerLoRA;

/* Add projection `which`'s LoRA products of x [*, k] to y [*, n] (parts of `sizes`). */
static int add_lora(LayerLoRA lora, int which, const float *x, int64_t k, const int64_t *sizes,
                    int64_t num_parts, float *y, int64_t n) {
    if (lora.groups == NULL || lora.groups[which] == 0) return 0;
    return pagedkv_lora_add(x, k, lora.num_groups, (const void *)lora.groups[which], num_parts,
                            sizes, y, n);
}

static int project(const float *x, int64_t m, const QuantizedWeight *w, float *y) {
    if (w->panels)
        return pagedkv_qmatmul_panels(x, m, w->in_features, w->values, w->scales, w->mins,
                                      (int)w->half_scales, (int)w->has_mins, (int)w->bits,
                                      w->out_features, w->bias, y);
    return pagedkv_qmatmul(x, m, w->in_features, w->values, w->scales, w->mins,
                           (int)w->half_scales, (int)w->has_mins, (int)w->bits, w->group_size,
                           w->out_features, w->bias, y);
}

/* The new tokens' keys and values (rows `stride` floats apart) into their slots. */
static void write_kv(const float *k, const float *v, int64_t stride, int64_t m, int64_t width,
                     const int64_t *slots, void *k_cache, void *v_cache, const Fp8Cache *fp8) {
    if (fp8 == NULL) {
        pagedkv_write_kv(k, stride, v, stride, m, width, slots, k_cache, v_cache);
        return;
    }
    pagedkv_write_kv_fp8(k, stride, v, stride, m, width, slots, k_cache, v_cache,
                         fp8->mantissa_bits, fp8->exponent_bias, fp8->max,
                         fp8->k_inverse_scale, fp8->v_inverse_scale);
}

/* One decoder layer as pagedkv_decode_layers takes it: its norms, its four projections (qkv,
 * o, gate_up, down), its caches (float32, or fp8 bytes when fp8 is not NULL), its window. */
typedef struct {
    const float *input_norm;
    const float *post_norm;
    float eps;
    QuantizedWeight weights[4];
    void *k_cache;
    void *v_cache;
    int64_t window;
    const Fp8Cache *fp8;
} DecodeLayer;

/* Per-step buffers, allocated once for every layer of the call. */
typedef struct {
    float *normed, *mixed, *attended, *projected, *gated, *activated;
} Scratch;

/* One layer: hidden [m, hidden_size] (the rows of `num_seqs` sequences) is updated in place. */
static int decode_layer(float *hidden, int64_t m, int64_t hidden_size, const DecodeLayer *layer,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                        const float *cos, const float *sin, const int64_t *slots,
                        const int32_t *block_tables, int64_t table_stride,
                        const int64_t *query_starts, const int32_t *context_lens,
                        int64_t num_seqs, int64_t block_size, float scale, const Scratch *s,
                        LayerLoRA lora) {
    const QuantizedWeight *qkv = &layer->weights[0], *o = &layer->weights[1],
                          *gate_up = &layer->weights[2], *down = &layer->weights[3];
    const Fp8Cache *fp8 = layer->fp8;
    int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    int64_t qkv_size = qkv->out_features, inter = gate_up->out_features / 2;
    const int64_t qkv_sizes[3] = {q_size, kv_size, kv_size}, o_sizes[1] = {hidden_size},
                  gate_up_sizes[2] = {inter, inter};
    pagedkv_rms_norm(hidden, hidden_size, m, hidden_size, layer->input_norm, layer->eps, s->normed);
    int status = project(s->normed, m, qkv, s->mixed);
    if (status == 0)
        status = add_lora(lora, 0, s->normed, hidden_size, qkv_sizes, 3, s->mixed, qkv_size);
    if (status != 0) return status;
    pagedkv_rope(s->mixed, m, qkv_size, num_heads, head_dim, cos, sin);
    pagedkv_rope(s->mixed + q_size, m, qkv_size, num_kv_heads, head_dim, cos, sin);
    write_kv(s->mixed + q_size, s->mixed + q_size + kv_size, qkv_size, m, kv_size, slots,
             layer->k_cache, layer->v_cache, fp8);
    status = pagedkv_attention(s->mixed, qkv_size, layer->k_cache, layer->v_cache, fp8 ? 3 : 0,
                               fp8 ? fp8->table : NULL, fp8 ? fp8->k_scale : 1.0f,
                               fp8 ? fp8->v_scale : 1.0f, block_tables, table_stride, query_starts,
                               context_lens, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                               scale, layer->window, s->attended);
    if (status == 0) status = project(s->attended, m, o, s->projected);
    if (status == 0)
        status = add_lora(lora, 1, s->attended, q_size, o_sizes, 1, s->projected, hidden_size);
    if (status != 0) return status;
    for (int64_t i = 0; i < m * hidden_size; i++) hidden[i] += s->projected[i];
    pagedkv_rms_norm(hidden, hidden_size, m, hidden_size, layer->post_norm, layer->eps, s->normed);
    status = project(s->normed, m, gate_up, s->gated);
    if (status == 0)
        status = add_lora(lora, 2, s->normed, hidden_size, gate_up_sizes, 2, s->gated, 2 * inter);
    if (status != 0) return status;
    pagedkv_silu_mul(s->gated, m, inter, s->activated);
    status = project(s->activated, m, down, s->projected);
    if (status == 0)
        status = add_lora(lora, 3, s->activated, inter, o_sizes, 1, s->projected, hidden_size);
    if (status == 0)
        for (int64_t i = 0; i < m * hidden_size; i++) hidden[i] += s->projected[i];
    return status;
}

static int64_t largest(int64_t a, int64_t b) { return a > b ? a : b; }

/* `num_layers` consecutive layers of one step in one call: hidden [m, hidden_size] is
 * updated in place. Every layer shares the attention shape, rope and the step's slots and
 * block tables. `lora_groups` (or NULL) holds, per layer, the addresses of its four projections'
 * LoRA groups (`lora_num_groups` each). Returns 0, or -1 when scratch memory cannot be
 * allocated. */
int pagedkv_decode_layers(float *hidden, int64_t m, int64_t hidden_size, int64_t num_layers,
                          const DecodeLayer *layers, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, const float *cos, const float *sin,
                          const int64_t *slots, const int32_t *block_tables,
                          int64_t table_stride, const int64_t *query_starts,
                          const int32_t *context_lens, int64_t num_seqs, int64_t block_size,
                          float scale, const int64_t *lora_groups, int64_t lora_num_groups) {
    int64_t qkv_size = 0, gate_up_size = 0;
    for (int64_t l = 0; l < num_layers; l++) {
        qkv_size = largest(qkv_size, layers[l].weights[0].out_features);
        gate_up_size = largest(gate_up_size, layers[l].weights[2].out_features);
    }
    Scratch s = {
        malloc(sizeof(float) * (size_t)(m * hidden_size)),
        malloc(sizeof(float) * (size_t)(m * qkv_size)),
        malloc(sizeof(float) * (size_t)(m * num_heads * head_dim)),
        malloc(sizeof(float) * (size_t)(m * hidden_size)),
        malloc(sizeof(float) * (size_t)(m * gate_up_size)),
        malloc(sizeof(float) * (size_t)(m * gate_up_size / 2)),
    };
    int status = -1;
    if (s.normed && s.mixed && s.attended && s.projected && s.gated && s.activated) {
        status = 0;
        for (int64_t l = 0; l < num_layers && status == 0; l++)
            status = decode_layer(hidden, m, hidden_size, &layers[l], num_heads, num_kv_heads,
                                  head_dim, cos, sin, slots, block_tables, table_stride,
                                  query_starts, context_lens, num_seqs, block_size, scale, &s,
                                  (LayerLoRA){lora_groups ? lora_groups + 4 * l : NULL,
                                              lora_num_groups});
    }
    free(s.normed);
    free(s.mixed);
    free(s.attended);
    free(s.projected);
    free(s.gated);
    free(s.activated);
    return status;
}
