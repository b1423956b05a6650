/* Attention alone, for the torch path's decode rows.
 * Part of the native CPU step, compiled as one unit by forward.c (see there). */

/* ---- attention alone, for the torch path's decode rows (the torch path) ---- */

typedef struct {
    int heads, kv_heads, head_dim, block_size, table_stride, njobs, nthreads;
    const att_job *jobs;
    int *next_job;
    size_t scores_per_thread, scores_n; /* floats per thread: att_scratch_floats(scores_n: a job's scores) */
    const float *q;
    int64_t q_stride;
    float *out, *scores;
    const uint16_t *k, *v;
    const int32_t *tables, *seq_lens;
    int spans; /* a per-span plan's longest row's spans of keys, else 0 */
    float *part, *ml; /* a per-span plan's partial rows: [B, spans, heads, D] outputs, [.., heads, 2] (max, sum) */
} attn_ctx;

static void run_attention(void *arg, int tid) {
    attn_ctx *a = arg;
    if (tid >= a->nthreads) return;
    const int D = a->head_dim, kv_n = a->kv_heads * D, q_n = a->heads * D;
    float *scratch = a->scores + (size_t)tid * a->scores_per_thread;
    for (int j; (j = __atomic_fetch_add(a->next_job, 1, __ATOMIC_RELAXED)) < a->njobs;) {
        const att_job *job = a->jobs + j;
        const int b = job->b;
        kv_view view = {a->k, a->v, kv_n, a->tables + (size_t)b * a->table_stride, a->block_size};
        const att_rows rows = {a->q + b * a->q_stride, a->out + (size_t)b * q_n, 0, 0, 1, a->seq_lens[b] - 1};
        const size_t at = (size_t)b * a->spans; /* (row b's partials, in a per-span plan) */
        attention_job(job, &rows, a->heads, a->kv_heads, D, &view, a->spans ? a->part + at * q_n : NULL,
                      a->spans ? a->ml + at * 2 * a->heads : NULL, a->spans, scratch, a->scores_n);
    }
}

/* q: B rows of [heads, head_dim] fp32, rows q_stride elements apart (a slice of a fused QKV output);
 * out [B, heads, head_dim]; k, v: one layer's bf16 cache [slots, kv_heads, head_dim], this step's keys
 * and values already written. Returns 0, -1 out of memory, -2 bad shapes. */
int sluice_decode_attention(int B, int heads, int kv_heads, int head_dim, const float *q, int64_t q_stride,
                            float *out, const uint16_t *k, const uint16_t *v, int block_size, const int32_t *tables,
                            int table_stride, const int32_t *seq_lens, int nthreads) {
    if (head_dim > 256 || head_dim % 16 || heads % kv_heads || heads > 256) return -2;
    if (B <= 0) return 0;
    pthread_mutex_lock(&step_lock);
    nthreads = nthreads < 1 ? 1 : ensure_workers(nthreads);
    /* Decode rows: every row its own sequence (row_seq 0..B-1), so no tiles. */
    int64_t *pos = malloc((size_t)B * sizeof *pos);
    int32_t *row_seq = malloc((size_t)B * sizeof *row_seq);
    int rc = -1, next_job = 0;
    if (pos && row_seq) {
        for (int b = 0; b < B; b++) pos[b] = seq_lens[b] - 1, row_seq[b] = b;
        const int per_span = attention_per_span(B, pos, row_seq, kv_heads, nthreads);
        const int spans = per_span ? most_spans(B, pos) : 0;
        const size_t q_n = (size_t)heads * head_dim;
        att_job *jobs = malloc((size_t)B * kv_heads * (per_span ? spans : 1) * sizeof *jobs);
        float *part = per_span ? malloc((size_t)B * spans * (q_n + 2 * heads) * sizeof(float)) : NULL;
        size_t scores_n;
        const int njobs = jobs ? attention_plan(B, pos, row_seq, kv_heads, heads / kv_heads, nthreads, per_span, jobs,
                                                &scores_n) : 0;
        const size_t per_thread = jobs ? att_scratch_floats(scores_n, heads, head_dim) : 0;
        float *scores = jobs ? malloc((size_t)nthreads * per_thread * sizeof(float)) : NULL;
        if (scores && (part || !per_span)) {
            float *ml = part ? part + (size_t)B * spans * q_n : NULL;
            attn_ctx a = {heads, kv_heads, head_dim, block_size, table_stride, njobs, nthreads, jobs, &next_job, per_thread,
                          scores_n, q, q_stride, out, scores, k, v, tables, seq_lens, spans, part, ml};
            run_parallel(run_attention, &a, nthreads);
            for (int b = 0; b < B && part; b++) /* (a per-span plan: the rows' spans folded) */
                if (key_spans(seq_lens[b]) > 1)
                    merge_row(heads, head_dim, key_spans(seq_lens[b]), part + (size_t)b * spans * q_n,
                              ml + (size_t)b * spans * 2 * heads, out + (size_t)b * q_n);
            rc = 0;
        }
        free(jobs), free(part), free(scores);
    }
    free(pos), free(row_seq);
    pthread_mutex_unlock(&step_lock);
    return rc;
}
