/* The layer step: norms, RoPE, the matmuls, KV writes, attention, the MLP; sluice_forward.
 * Part of the native CPU step, compiled as one unit by forward.c (see there). */

static void rms_norm_rows(const float *x, const float *w, float *out, int rows, int n, float eps) {
    for (int b = 0; b < rows; b++) {
        const float *xb = x + (size_t)b * n;
        float inv = 1.0f / sqrtf(dot(xb, xb, n) / n + eps);
        for (int i = 0; i < n; i++) out[(size_t)b * n + i] = xb[i] * inv * w[i];
    }
}

static void rope(float *v, const float *c, const float *s, int half) {
    for (int i = 0; i < half; i++) {
        float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c[i] - x2 * s[i];
        v[i + half] = x2 * c[i] + x1 * s[i];
    }
}

/* ---- the step ---- */

typedef struct {
    const dims *dm;
    const layer_weights *layers;
    int B, nthreads, mode; /* B rows (tokens); mode: how this step's matmuls take their inputs (MM_*) */
    float *x; /* [B, hidden]: the residual stream */
    const int64_t *pos, *slots;
    const int32_t *tables, *row_seq; /* block tables [sequences, table_stride]; each row's sequence */
    int table_stride;
    uint16_t *kv;
    int64_t layer_stride, kv_stride;
    const float *cos, *sin;
    /* scratch (row buffers hold B rounded up to 32 rows: the AMX path writes whole tiles) */
    float *h, *qkv, *att, *gu, *act, *scores;
    qx_t qx; /* the current matmul's input, quantised */
    uint16_t *tile_scratch; /* per thread: one column pair of weights widened to bf16 */
    size_t tile_scratch_per_thread;
    const att_job *jobs; /* the attention jobs, the same for every layer */
    int njobs, spans; /* spans: a per-span plan's longest row's spans of keys, else 0 */
    float *part, *ml; /* a per-span plan's partial rows: [B, spans, heads, D] outputs, [.., heads, 2] (max, sum) */
    int *next_job; /* [layers]: the next attention job of each layer, taken in turn by the threads */
    size_t scores_per_thread, scores_n; /* floats per thread: att_scratch_floats(scores_n: a job's scores) */
} step_ctx;

static void prepare_x(step_ctx *c, const float *x, int K, int b0, int b1) { quantize_x(x, K, &c->qx, b0, b1, c->mode); }

/* y[:, :N] (rows ldy apart) = x W^T for one part of a matrix in one format. */
static void matmul_part(step_ctx *c, const uint8_t *blocks, int format, const float *x, int N, int ldy, int K, float *y,
                        int tid) {
#if HAVE_AMX
    if (c->mode == MM_AMX) {
        const tile_weights tw = {blocks, tile_bytes(format), NULL, format};
        matmul_amx(&tw, N, ldy, K, &c->qx, c->B, y, c->tile_scratch + (size_t)tid * c->tile_scratch_per_thread, tid,
                   c->nthreads);
        return;
    }
#endif
    const layer_tiles part = {blocks, format, 0, NULL, 0};
    matmul_int16(&part, N, ldy, K, &c->qx, x, c->B, y, tid, c->nthreads, c->mode);
}

/* y = x W^T for the step's rows; x (fp32, [B, K]) was prepared by prepare_x (the 16-bit tiles read it as is).
 * A matrix with a tail: its two parts one after the other (each thread its share of each; no barrier
 * between them, their outputs are apart). */
static void step_matmul(step_ctx *c, const layer_tiles *w, const float *x, int N, int K, float *y, int tid) {
    const int n1 = w->tail ? w->rows : N;
    matmul_part(c, w->blocks, w->format, x, n1, N, K, y, tid);
    if (w->tail) matmul_part(c, w->tail, w->tail_format, x, N - n1, N, K, y + n1, tid);
}

/* Every thread runs this; the phases between barriers split their work: matmul columns, attention by
 * (row, kv head), elementwise work by row or by group of 32. A row attends to its sequence's cache up
 * to its own position: the rows of a prefill chunk are written to the cache together, before any
 * of them attends, and each sees the keys before it and its own. */
static void run_step(void *arg, int tid) {
    step_ctx *c = arg;
    const dims *dm = c->dm;
    const int B = c->B, H = dm->hidden, D = dm->head_dim, Hkv = dm->kv_heads, I = dm->inter, nt = c->nthreads;
    const int q_n = dm->heads * D, kv_n = Hkv * D, qkv_n = q_n + 2 * kv_n;
    if (tid >= nt) return;
#if defined(__SSE2__)
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040); /* flush denormals to zero (FTZ, DAZ): each one costs a microcode assist */
#endif
    const double t_step = profiling && tid == 0 ? now_s() : 0;
    float *scratch = c->scores + (size_t)tid * c->scores_per_thread;
    int b0, b1, gi0, gi1; /* my rows; my groups of the MLP's activations */
    span(B, tid, nt, &b0, &b1);
    span(I / GROUP, tid, nt, &gi0, &gi1);
    for (int l = 0; l < dm->layers; l++) {
        const layer_weights *lw = c->layers + l;
        for (int b = b0; b < b1; b++) { /* (the previous layer's MLP output joins the residual here) */
            float *xb = c->x + (size_t)b * H;
            if (l > 0)
                for (int i = 0; i < H; i++) xb[i] += c->h[(size_t)b * H + i];
            rms_norm_rows(xb, lw->attn_norm, c->h + (size_t)b * H, 1, H, dm->eps);
        }
        prepare_x(c, c->h, H, b0, b1);
        PHASE(tid, PH_WAIT, barrier(nt));
        PHASE(tid, PH_MATMUL, step_matmul(c, &lw->qkv, c->h, qkv_n, H, c->qkv, tid));
        PHASE(tid, PH_WAIT, barrier(nt));
        uint16_t *kc = c->kv + l * c->layer_stride, *vc = kc + c->kv_stride;
        for (int b = b0; b < b1; b++) {
            float *row = c->qkv + (size_t)b * qkv_n;
            if (lw->qkv_bias)
                for (int i = 0; i < qkv_n; i++) row[i] += lw->qkv_bias[i];
            const float *cs = c->cos + c->pos[b] * (D / 2), *sn = c->sin + c->pos[b] * (D / 2);
            for (int h = 0; h < dm->heads + Hkv; h++) rope(row + h * D, cs, sn, D / 2);
            for (int i = 0; i < kv_n; i++) {
                kc[c->slots[b] * kv_n + i] = f32_to_bf16(row[q_n + i]);
                vc[c->slots[b] * kv_n + i] = f32_to_bf16(row[q_n + kv_n + i]);
            }
        }
        PHASE(tid, PH_WAIT, barrier(nt));
        PHASE(tid, PH_ATTENTION, {
            for (int j; (j = __atomic_fetch_add(c->next_job + l, 1, __ATOMIC_RELAXED)) < c->njobs;) {
                const att_job *job = c->jobs + j;
                const int b = job->b;
                kv_view view = {kc, vc, kv_n, c->tables + (size_t)c->row_seq[b] * c->table_stride, dm->block_size};
                const att_rows rows = {c->qkv + (size_t)b * qkv_n, c->att + (size_t)b * q_n, qkv_n, q_n, job->T,
                                       (int)c->pos[b]};
                const size_t at = (size_t)b * c->spans; /* (row b's partials, in a per-span plan) */
                attention_job(job, &rows, dm->heads, Hkv, D, &view, c->spans ? c->part + at * q_n : NULL,
                              c->spans ? c->ml + at * 2 * dm->heads : NULL, c->spans, scratch, c->scores_n);
            }
        });
        PHASE(tid, PH_WAIT, barrier(nt));
        for (int b = b0; b < b1 && c->spans; b++) /* (a per-span plan: my rows' spans folded) */
            if (key_spans(c->pos[b] + 1) > 1)
                merge_row(dm->heads, D, key_spans(c->pos[b] + 1), c->part + (size_t)b * c->spans * q_n,
                          c->ml + (size_t)b * c->spans * 2 * dm->heads, c->att + (size_t)b * q_n);
        prepare_x(c, c->att, q_n, b0, b1);
        PHASE(tid, PH_WAIT, barrier(nt));
        PHASE(tid, PH_MATMUL, step_matmul(c, &lw->o, c->att, H, q_n, c->h, tid));
        PHASE(tid, PH_WAIT, barrier(nt));
        for (int b = b0; b < b1; b++) {
            float *xb = c->x + (size_t)b * H;
            for (int i = 0; i < H; i++) xb[i] += c->h[(size_t)b * H + i];
            rms_norm_rows(xb, lw->mlp_norm, c->h + (size_t)b * H, 1, H, dm->eps);
        }
        prepare_x(c, c->h, H, b0, b1);
        PHASE(tid, PH_WAIT, barrier(nt));
        PHASE(tid, PH_MATMUL, step_matmul(c, &lw->gate_up, c->h, 2 * I, H, c->gu, tid));
        PHASE(tid, PH_WAIT, barrier(nt));
        for (int b = 0; b < B; b++) {
            const float *g = c->gu + (size_t)b * 2 * I, *u = g + I;
            float *a = c->act + (size_t)b * I;
            silu_mul(g + gi0 * GROUP, u + gi0 * GROUP, a + gi0 * GROUP, (gi1 - gi0) * GROUP);
        }
        PHASE(tid, PH_WAIT, barrier(nt));
        prepare_x(c, c->act, I, b0, b1);
        PHASE(tid, PH_WAIT, barrier(nt));
        PHASE(tid, PH_MATMUL, step_matmul(c, &lw->down, c->act, H, I, c->h, tid));
        PHASE(tid, PH_WAIT, barrier(nt));
    }
    for (int b = b0; b < b1; b++)
        for (int i = 0; i < H; i++) c->x[(size_t)b * H + i] += c->h[(size_t)b * H + i];
#if HAVE_AMX
    if (c->mode == MM_AMX) _tile_release();
#endif
#if defined(__SSE2__)
    _mm_setcsr(csr);
#endif
    if (profiling && tid == 0) phase_s[PH_STEP] += now_s() - t_step;
}

static int forward_locked(const dims *dm, const layer_weights *layers, int B, float *x, const int64_t *positions,
                          const int64_t *slots, const int32_t *tables, int table_stride, const int32_t *row_seq,
                          uint16_t *kv, int64_t layer_stride, int64_t kv_stride, const float *cos, const float *sin,
                          int nthreads, int wide_min_rows, int amx_min_rows) {
    const int H = dm->hidden, I = dm->inter, q_n = dm->heads * dm->head_dim;
    const int qkv_n = q_n + 2 * dm->kv_heads * dm->head_dim;
    nthreads = nthreads < 1 ? 1 : ensure_workers(nthreads);
    const int per_span = attention_per_span(B, positions, row_seq, dm->kv_heads, nthreads);
    const int spans = per_span ? most_spans(B, positions) : 0;
    att_job *jobs = malloc((size_t)B * dm->kv_heads * (per_span ? spans : 1) * sizeof *jobs);
    int *next_job = calloc((size_t)dm->layers, sizeof *next_job);
    if (!jobs || !next_job) {
        free(jobs), free(next_job);
        return -1;
    }
    size_t scores_n;
    const int njobs = attention_plan(B, positions, row_seq, dm->kv_heads, dm->heads / dm->kv_heads, nthreads, per_span,
                                     jobs, &scores_n);
    const size_t scores_per_thread = att_scratch_floats(scores_n, dm->heads, dm->head_dim);
    const int mode = wide_mode(B, wide_min_rows, amx_min_rows), amx = mode == MM_AMX;
    const int R = (B + 31) / 32 * 32; /* rows of the row buffers */
    const int kmax = H > q_n ? (H > I ? H : I) : (q_n > I ? q_n : I), gmax = kmax / GROUP;
    const size_t per_thread = (size_t)gmax * 1024; /* bf16 elements: a widened column pair of the widest K */
    size_t floats = (size_t)R * (H + qkv_n + q_n + 2 * I + I + 1 + gmax + kmax / 2 + kmax / 2 + 6 * gmax) +
                    (size_t)nthreads * scores_per_thread + (amx ? (size_t)nthreads * per_thread / 2 : 0) + 16 +
                    (size_t)B * spans * (q_n + 2 * dm->heads); /* (a per-span plan's partial rows) */
    float *buf = calloc(floats, sizeof(float));
    if (!buf) {
        free(jobs), free(next_job);
        return -1;
    }
    step_ctx c = {.dm = dm, .layers = layers, .B = B, .nthreads = nthreads, .mode = mode, .x = x, .pos = positions,
                  .slots = slots, .tables = tables, .row_seq = row_seq, .table_stride = table_stride, .kv = kv,
                  .layer_stride = layer_stride, .kv_stride = kv_stride, .cos = cos, .sin = sin};
    float *p = buf;
    c.h = p, p += (size_t)R * H;
    c.qkv = p, p += (size_t)R * qkv_n;
    c.att = p, p += (size_t)R * q_n;
    c.gu = p, p += (size_t)R * 2 * I;
    c.act = p, p += (size_t)R * I;
    c.qx.dx = p, p += (size_t)R;
    c.qx.sx = p, p += (size_t)R * gmax;
    c.qx.q = (int16_t *)p, p += (size_t)R * kmax / 2;
    c.qx.bf = (uint16_t *)p, p += (size_t)R * kmax / 2;
    c.qx.q8 = HAVE_INT8_Q4 ? (int8_t *)c.qx.bf : (int8_t *)c.qx.q; /* (MM_INT8 has no int16 rows but with
                                                                 * HAVE_INT8_Q4, which has no bf16 ones) */
    c.qx.dg = p, p += (size_t)R * gmax;
    c.qx.s8 = (int32_t *)p, p += (size_t)R * 2 * gmax;
    c.qx.ce = p, p += (size_t)R * 2 * gmax;
    c.qx.o8 = p, p += (size_t)R * gmax;
    c.scores = p, p += (size_t)nthreads * scores_per_thread;
    c.spans = spans;
    c.part = p, p += (size_t)B * spans * q_n;
    c.ml = p, p += (size_t)B * spans * 2 * dm->heads;
    p = (float *)(((uintptr_t)p + 63) & ~(uintptr_t)63); /* (the 16 spare floats) */
    c.tile_scratch = (uint16_t *)p;
    c.tile_scratch_per_thread = per_thread;
    c.jobs = jobs, c.njobs = njobs, c.next_job = next_job, c.scores_per_thread = scores_per_thread;
    c.scores_n = scores_n;
    run_parallel(run_step, &c, nthreads);
    free(buf), free(jobs), free(next_job);
    return 0;
}

/* x [B, hidden]: each row's token embedding in, its residual stream after the last layer out (the
 * caller applies the final norm). Rows are tokens: decodes and prefill chunks in any order.
 * positions, slots: each token's position and cache slot; row_seq[b]: the row of `tables`
 * [sequences, table_stride] (block tables) of its sequence. A row attends to positions 0..positions[b]
 * of its sequence. kv: the bf16 cache [layers, 2, slots, kv_heads, head_dim] with its layer and K-to-V
 * strides in elements. cos/sin [max_pos, head_dim / 2]. Steps of at least amx_min_rows rows multiply on AMX
 * tiles, else of at least wide_min_rows rows in int8 dot products (wide_mode; 0: never).
 * Returns 0, -1 when out of memory, -2 for shapes or tile formats this build does not take. */
int sluice_forward(const dims *dm, const layer_weights *layers, int B, float *x, const int64_t *positions,
                   const int64_t *slots, const int32_t *tables, int table_stride, const int32_t *row_seq,
                   uint16_t *kv, int64_t layer_stride, int64_t kv_stride, const float *cos, const float *sin,
                   int nthreads, int wide_min_rows, int amx_min_rows) {
    const int q_n = dm->heads * dm->head_dim, qkv_n = q_n + 2 * dm->kv_heads * dm->head_dim;
    if (dm->head_dim > 256 || dm->head_dim % 16 || dm->heads % dm->kv_heads || dm->heads > 256 ||
        dm->hidden % GROUP || dm->inter % GROUP || q_n % GROUP || qkv_n % TILE_N || dm->hidden % TILE_N)
        return -2;
    for (int l = 0; l < dm->layers; l++) { /* (a format this build does not read: nothing computed) */
        const layer_tiles *m[4] = {&layers[l].qkv, &layers[l].o, &layers[l].gate_up, &layers[l].down};
        for (int i = 0; i < 4; i++)
            if (!sluice_reads_tiles(m[i]->format) || (m[i]->tail && !sluice_reads_tiles(m[i]->tail_format))) return -2;
    }
    if (B <= 0) return 0;
    pthread_mutex_lock(&step_lock);
    int rc = forward_locked(dm, layers, B, x, positions, slots, tables, table_stride, row_seq, kv, layer_stride,
                            kv_stride, cos, sin, nthreads, wide_min_rows, amx_min_rows);
    pthread_mutex_unlock(&step_lock);
    return rc;
}

/* out[r] = rms_norm(x[rows[r]]) * w for r < n (rows NULL: the first n rows) of x [nx, H]: the model's
 * final norm of the rows that sample, the step's own arithmetic, one call where torch takes five ops and
 * an index. -2 for a row outside x (nothing written) or H not a multiple of 16. */
int sluice_rms_norm(const float *x, int nx, const int64_t *rows, int n, int H, const float *w, float eps,
                    float *out) {
    if (H % 16 || (!rows && n > nx)) return -2;
    for (int r = 0; rows && r < n; r++)
        if (rows[r] < 0 || rows[r] >= nx) return -2;
    for (int r = 0; r < n; r++)
        rms_norm_rows(x + (size_t)(rows ? rows[r] : r) * H, w, out + (size_t)r * H, 1, H, eps);
    return 0;
}

/* Whether this build has the AMX path and the OS lets this process use it. */
int sluice_amx_available(void) { return amx_usable(); }

