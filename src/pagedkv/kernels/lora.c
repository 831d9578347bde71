/* LoRA products of a mixed batch, added to a projection's output, in one call per projection.
 *
 * A step's rows may each go through another adapter (or none). Each group is one adapter's
 * rows and one of its modules (a fused q/k/v projection has a group per part it adapts):
 *
 *   out[row, offset .. offset + n) += ((x[row] A^T) B^T) * scaling     for each row of the group
 *
 * the segmented gather-matmul: the group's rows are gathered, then two pagedkv_fmatmul calls,
 * whose result for a row never depends on the other rows or the threads, then a multiply and an
 * add per element. So a row's output does not depend
 * on which adapters its neighbours use, and the bits are those of model/lora.py's torch twin
 * (`float_linear` twice, `* scaling`, `+`). One call replaces ~25 Python-level ops per adapter
 * and layer.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int pagedkv_fmatmul(const float *x, int64_t m, int64_t k, const void *w, int w_dtype, int64_t n,
                    const float *bias, float *y);

/* One adapter's module over its rows, as native.LoRAGroupArgs. */
typedef struct {
    const int64_t *rows; /* the batch rows it adds to */
    int64_t num_rows;
    const float *a; /* [rank, k] */
    const float *b; /* [n, rank] */
    int64_t rank;
    int64_t n;
    int64_t offset; /* its first column of out */
    float scaling;
} LoRAGroup;

/* One group's products added to out, with this thread's scratch (xs, t, d). */
static int add_group(const float *x, int64_t k, const LoRAGroup *group, float *xs, float *t,
                     float *d, float *out, int64_t out_stride) {
    for (int64_t r = 0; r < group->num_rows; r++)
        memcpy(xs + r * k, x + group->rows[r] * k, sizeof(float) * (size_t)k);
    int status = pagedkv_fmatmul(xs, group->num_rows, k, group->a, 0, group->rank, NULL, t);
    if (status == 0)
        status = pagedkv_fmatmul(t, group->num_rows, group->rank, group->b, 0, group->n, NULL, d);
    if (status != 0) return status;
    for (int64_t r = 0; r < group->num_rows; r++) {
        float *row = out + group->rows[r] * out_stride + group->offset;
        const float *delta = d + r * group->n;
        for (int64_t j = 0; j < group->n; j++) row[j] = row[j] + delta[j] * group->scaling;
    }
    return 0;
}

/* Groups of at least this many rows (prompt chunks) run one at a time, each matmul over every
 * thread; smaller ones (a decode step's few rows per adapter) run whole, one per thread. */
#define BIG_GROUP_ROWS 32

/* Scratch for groups of up to `rows` rows: x rows, their A products and their B products. */
typedef struct {
    float *xs, *t, *d;
} Scratch;

static Scratch scratch(int64_t rows, int64_t k, int64_t rank, int64_t n) {
    Scratch s = {malloc(sizeof(float) * (size_t)(rows * k)),
                 malloc(sizeof(float) * (size_t)(rows * rank)),
                 malloc(sizeof(float) * (size_t)(rows * n))};
    return s;
}

static void release(Scratch s) {
    free(s.xs);
    free(s.t);
    free(s.d);
}

/* out [*, out_stride] += each group's products of x [*, k]. Groups write disjoint parts of out
 * (another adapter's rows, or another part's columns), so small groups run in parallel, each
 * thread taking whole groups. Returns 0, or -1 when scratch memory cannot be allocated (out is
 * then partly updated: the step fails). */
int pagedkv_lora_add(const float *x, int64_t k, int64_t num_groups, const LoRAGroup *groups,
                     float *out, int64_t out_stride) {
    int64_t most_rows = 0, most_rank = 0, most_n = 0;
    for (int64_t g = 0; g < num_groups; g++) {
        most_rows = groups[g].num_rows > most_rows ? groups[g].num_rows : most_rows;
        most_rank = groups[g].rank > most_rank ? groups[g].rank : most_rank;
        most_n = groups[g].n > most_n ? groups[g].n : most_n;
    }
    int failed = 0;
    if (most_rows >= BIG_GROUP_ROWS) {
        Scratch s = scratch(most_rows, k, most_rank, most_n);
        failed = s.xs == NULL || s.t == NULL || s.d == NULL;
        for (int64_t g = 0; g < num_groups && !failed; g++)
            if (groups[g].num_rows >= BIG_GROUP_ROWS)
                failed = add_group(x, k, &groups[g], s.xs, s.t, s.d, out, out_stride) != 0;
        release(s);
    }
    int64_t small = BIG_GROUP_ROWS - 1 < most_rows ? BIG_GROUP_ROWS - 1 : most_rows;
#pragma omp parallel reduction(| : failed)
    {
        Scratch s = scratch(small, k, most_rank, most_n);
        int mine = s.xs == NULL || s.t == NULL || s.d == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < num_groups; g++)
            if (!mine && groups[g].num_rows < BIG_GROUP_ROWS)
                mine = add_group(x, k, &groups[g], s.xs, s.t, s.d, out, out_stride) != 0;
        release(s);
        failed |= mine;
    }
    return failed ? -1 : 0;
}
