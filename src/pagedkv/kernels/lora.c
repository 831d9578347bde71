/* LoRA products of a mixed batch, added to a projection's output, in one call per projection.
 *
 * A step's rows may each go through another adapter (or none). Each group is one adapter's rows
 * and its parts of the projection (a fused q/k/v projection has up to three):
 *
 *   out[row, offset .. offset + n) += ((x[row] A^T) B^T) * scaling     for each row of the group
 *
 * the segmented gather-matmul: the group's rows are gathered; t = x A^T by pagedkv_fmatmul for
 * every part at once (A stacked), whose result for a row never depends on the other rows, the
 * threads or the other parts; then t B^T from B kept transposed ([rank, n]): each output is t's
 * rank products with B^T's column, added in order, a multiply then an add each, vectorised
 * across the n outputs with no reduction; then a multiply by scaling and an add per element.
 * So a row's output does not depend on which adapters its neighbours use, and the bits are
 * those of model/lora.py's torch twin. One call replaces ~25 Python-level ops per adapter and
 * layer.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int pagedkv_fmatmul(const float *x, int64_t m, int64_t k, const void *w, int w_dtype, int64_t n,
                    const float *bias, float *y);

/* One adapted part of a projection, as native.LoRAPartArgs. */
typedef struct {
    const float *b_t; /* B transposed, [rank, n] */
    int64_t rank;
    int64_t rank_offset; /* where its columns start in the stacked A product */
    int64_t index;       /* which of the projection's parts */
    float scaling;
} LoRAPart;

/* One adapter's rows of the batch and its parts of this projection (a == NULL: none): six
 * int64s, as model/lora.py's per-step tables lay them out. */
typedef struct {
    const int64_t *rows;
    int64_t num_rows;
    const float *a; /* the parts' A matrices stacked, [total_rank, k] */
    int64_t total_rank;
    const LoRAPart *parts;
    int64_t num_parts;
} LoRAGroup;

/* One group's products added to out, with this thread's scratch (xs, t, d): x's rows gathered,
 * one matmul by the stacked A, then each part's B from its columns of t. The A product may run
 * over every thread (a big group's) or this one alone (inside the per-group loop). */
static int add_group(const float *x, int64_t k, const LoRAGroup *group, const int64_t *sizes,
                     const int64_t *offsets, float *xs, float *t, float *d, float *out,
                     int64_t out_stride) {
    int64_t total = group->total_rank;
    for (int64_t r = 0; r < group->num_rows; r++)
        memcpy(xs + r * k, x + group->rows[r] * k, sizeof(float) * (size_t)k);
    int status = pagedkv_fmatmul(xs, group->num_rows, k, group->a, 0, total, NULL, t);
    if (status != 0) return status;
    for (int64_t p = 0; p < group->num_parts; p++) {
        const LoRAPart *part = &group->parts[p];
        int64_t n = sizes[part->index], rank = part->rank;
        for (int64_t r = 0; r < group->num_rows; r++) {
            const float *tr = t + r * total + part->rank_offset;
            for (int64_t j = 0; j < n; j++) d[j] = tr[0] * part->b_t[j];
            for (int64_t q = 1; q < rank; q++) {
                const float *b_row = part->b_t + q * n;
                for (int64_t j = 0; j < n; j++) d[j] = d[j] + tr[q] * b_row[j];
            }
            float *row = out + group->rows[r] * out_stride + offsets[part->index];
            for (int64_t j = 0; j < n; j++) row[j] = row[j] + d[j] * part->scaling;
        }
    }
    return 0;
}

/* Groups of at least this many rows (prompt chunks) run one at a time, each matmul over every
 * thread; smaller ones (a decode step's few rows per adapter) run whole, one per thread. */
#define BIG_GROUP_ROWS 32

/* Scratch for up to `rows` rows: x rows, their A products, one row's B product. */
typedef struct {
    float *xs, *t, *d;
} Scratch;

static Scratch scratch(int64_t rows, int64_t k, int64_t rank, int64_t n) {
    Scratch s = {malloc(sizeof(float) * (size_t)(rows * k)),
                 malloc(sizeof(float) * (size_t)(rows * rank)), malloc(sizeof(float) * (size_t)n)};
    return s;
}

static void release(Scratch s) {
    free(s.xs);
    free(s.t);
    free(s.d);
}

/* out [*, out_stride] += each group's products of x [*, k], for a projection of `num_parts`
 * parts (`part_sizes` columns each, in order). Groups write disjoint rows of out (one adapter's
 * each), so small groups run in parallel, each thread taking whole groups. Returns 0, or -1 when
 * scratch memory cannot be allocated (out is then partly updated: the step fails). */
int pagedkv_lora_add(const float *x, int64_t k, int64_t num_groups, const LoRAGroup *groups,
                     int64_t num_parts, const int64_t *part_sizes, float *out,
                     int64_t out_stride) {
    int64_t offsets[16], most_rows = 0, most_rank = 0, most_n = 0;
    if (num_parts > 16) return -1;
    for (int64_t p = 0, at = 0; p < num_parts; at += part_sizes[p], p++) {
        offsets[p] = at;
        most_n = part_sizes[p] > most_n ? part_sizes[p] : most_n;
    }
    for (int64_t g = 0; g < num_groups; g++) {
        if (groups[g].a == NULL) continue;
        most_rows = groups[g].num_rows > most_rows ? groups[g].num_rows : most_rows;
        most_rank = groups[g].total_rank > most_rank ? groups[g].total_rank : most_rank;
    }
    int failed = 0;
    if (most_rows >= BIG_GROUP_ROWS) {
        Scratch s = scratch(most_rows, k, most_rank, most_n);
        failed = s.xs == NULL || s.t == NULL || s.d == NULL;
        for (int64_t g = 0; g < num_groups && !failed; g++)
            if (groups[g].a != NULL && groups[g].num_rows >= BIG_GROUP_ROWS)
                failed = add_group(x, k, &groups[g], part_sizes, offsets, s.xs, s.t, s.d, out,
                                   out_stride) != 0;
        release(s);
    }
    int64_t small = BIG_GROUP_ROWS - 1 < most_rows ? BIG_GROUP_ROWS - 1 : most_rows;
#pragma omp parallel reduction(| : failed)
    {
        Scratch s = scratch(small, k, most_rank, most_n);
        int mine = s.xs == NULL || s.t == NULL || s.d == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < num_groups; g++)
            if (!mine && groups[g].a != NULL && groups[g].num_rows < BIG_GROUP_ROWS)
                mine = add_group(x, k, &groups[g], part_sizes, offsets, s.xs, s.t, s.d, out,
                                 out_stride) != 0;
        release(s);
        failed |= mine;
    }
    return failed ? -1 : 0;
}
