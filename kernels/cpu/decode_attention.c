/* Attention alone, for the torch path's decode rows.
 * Part of the native CPU step, compiled as one unit by forward.c (see there). */

/* ---- attention alone, for the torch path's decode rows (the torch path) ---- */

typedef struct {
    int heads, kv_heads, head_dim, block_size, table_stride, njobs, nthreads;
    const att_job *jobs;
    int *next_job;
    size_t scores_per_thread;
    const float *q;
    int64_t q_stride;
    float *out, *scores;
    const uint16_t *k, *v;
    const int32_t *tables, *seq_lens;
} attn_ctx;

static void run_attention(void *arg, int tid) {
    attn_ctx *a = arg;
    if (tid >= a->nthreads) return;
    const int D = a->head_dim, kv_n = a->kv_heads * D;
    float *scores = a->scores + (size_t)tid * a->scores_per_thread, *kbuf = scores + a->scores_per_thread - 16 * D;
    for (int j; (j = __atomic_fetch_add(a->next_job, 1, __ATOMIC_RELAXED)) < a->njobs;) {
        const int b = a->jobs[j].b;
        kv_view view = {a->k, a->v, kv_n, a->tables + (size_t)b * a->table_stride, a->block_size};
        att_rows rows = {a->q + b * a->q_stride, a->out + (size_t)b * a->heads * D, 0, 0, 1, a->seq_lens[b] - 1};
        attend(&rows, a->heads, a->kv_heads, D, &view, a->jobs[j].kv0, a->jobs[j].kv1, scores, kbuf);
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
    att_job *jobs = malloc((size_t)B * kv_heads * sizeof *jobs);
    int next_job = 0, rc = -1;
    if (pos && row_seq && jobs) {
        for (int b = 0; b < B; b++) pos[b] = seq_lens[b] - 1, row_seq[b] = b;
        size_t per_thread;
        const int njobs = attention_plan(B, pos, row_seq, kv_heads, heads / kv_heads, nthreads, jobs, &per_thread);
        per_thread = (per_thread + 16 * (size_t)head_dim + 31) / 16 * 16;
        float *scores = malloc((size_t)nthreads * per_thread * sizeof(float));
        if (scores) {
            attn_ctx a = {heads, kv_heads, head_dim, block_size, table_stride, njobs, nthreads, jobs, &next_job, per_thread,
                          q, q_stride, out, scores, k, v, tables, seq_lens};
            run_parallel(run_attention, &a, nthreads);
            free(scores);
            rc = 0;
        }
    }
    free(pos), free(row_seq), free(jobs);
    pthread_mutex_unlock(&step_lock);
    return rc;
}
