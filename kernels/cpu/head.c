/* The output layer: int8 weights (or a layer's tiles: 4-bit for large vocabularies) with each row's best
 * candidates made exact.
 * Part of the native CPU step, compiled as one unit by forward.c (see there). */

/* ---- the output layer: int8 weights (one scale per row), each row's best candidates made exact ----
 *
 * The output layer reads as many bytes as a third of the layers, and only each row's top candidates
 * matter to greedy, top-k and top-p; those are recomputed here against the exact weights, in the same
 * call. Its int8 copy (engine/model.py, Int8Weight) is held in tile order (tile_weights, 512-byte
 * blocks), so the same matmuls as the layers' read it: int16 activations in integer dot products
 * for few rows, AMX bf16 tiles or int8 activations for many. */

/* One column of int8 blocks (16 rows of W) for nb <= ROWS_PER_PASS input rows: y[b, n0 + n], before the
 * row scales. The int32 sums of a block (127 * 32767 * 32 < 2^31) are added up in fp32. */
static inline __attribute__((always_inline)) void q8_column(const uint8_t *col, int G, const qx_t *qx, int K, int nb,
                                                            float out[ROWS_PER_PASS][TILE_N]) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 accf[ROWS_PER_PASS];
    for (int b = 0; b < nb; b++) accf[b] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = col + (size_t)g * Q8_BLOCK_BYTES;
        prefetch_l2(blk + PREFETCH_AHEAD, Q8_BLOCK_BYTES);
        __m512i acc[ROWS_PER_PASS];
        for (int b = 0; b < nb; b++) acc[b] = _mm512_setzero_si512();
        q8_tile_rows(blk, 0, 16, qx, K, g, nb, acc);
        for (int b = 0; b < nb; b++) accf[b] = _mm512_add_ps(accf[b], _mm512_cvtepi32_ps(acc[b]));
    }
    for (int b = 0; b < nb; b++) _mm512_storeu_ps(out[b], accf[b]);
#elif defined(__AVX2__) && defined(__FMA__)
    /* output rows 8o..8o+7 at a time for many input rows, all 16 for up to 3 (as q8g_column) */
    const int O2 = nb <= 3 ? 2 : 1;
    for (int o0 = 0; o0 < 2; o0 += O2) {
        __m256 accf[ROWS_PER_PASS][2];
        for (int b = 0; b < nb; b++) accf[b][0] = accf[b][1] = _mm256_setzero_ps();
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = col + (size_t)g * Q8_BLOCK_BYTES;
            if (o0 == 0) prefetch_l2(blk + PREFETCH_AHEAD, Q8_BLOCK_BYTES);
            __m256i acc[ROWS_PER_PASS][2];
            for (int b = 0; b < nb; b++) acc[b][0] = acc[b][1] = _mm256_setzero_si256();
            q8_tile_rows(blk, 0, 16, o0, O2, qx, K, g, nb, acc);
            for (int b = 0; b < nb; b++)
                for (int q = 0; q < O2; q++) accf[b][q] = _mm256_add_ps(accf[b][q], _mm256_cvtepi32_ps(acc[b][q]));
        }
        for (int b = 0; b < nb; b++)
            for (int q = 0; q < O2; q++) _mm256_storeu_ps(out[b] + 8 * (o0 + q), accf[b][q]);
    }
#else
    for (int b = 0; b < nb; b++) memset(out[b], 0, sizeof out[b]);
    for (int g = 0; g < G; g++) {
        const int8_t *blk = (const int8_t *)(col + (size_t)g * Q8_BLOCK_BYTES);
        for (int b = 0; b < nb; b++) {
            const int16_t *xq = qx->q + (size_t)b * K + g * GROUP;
            int32_t acc[TILE_N] = {0};
            for (int r = 0; r < 16; r++)
                for (int i = 0; i < 32; i++) acc[i / 2] += (int32_t)blk[32 * r + i] * xq[2 * r + i % 2];
            for (int n = 0; n < TILE_N; n++) out[b][n] += (float)acc[n];
        }
    }
#endif
}

#if HAVE_INT8
/* The same column for nb rows of int8 inputs (MM_INT8), each half group's sums scaled by its dg. */
static inline __attribute__((always_inline)) void q8_column_i8(const uint8_t *col, int G, const qx_t *qx, int K,
                                                               int nb, float out[ROWS_PER_PASS][TILE_N]) {
    __m512 accf[ROWS_PER_PASS];
    for (int b = 0; b < nb; b++) accf[b] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = col + (size_t)g * Q8_BLOCK_BYTES;
        prefetch_l2(blk + PREFETCH_AHEAD, Q8_BLOCK_BYTES);
        q8_group_i8(blk, qx, K, G, g, nb, 0, accf, NULL);
    }
    for (int b = 0; b < nb; b++) _mm512_storeu_ps(out[b], accf[b]);
}
#define Q8_COLUMN(int8, blocks, G, part, K, nb, out) \
    ((int8) ? q8_column_i8(blocks, G, part, K, nb, out) : q8_column(blocks, G, part, K, nb, out))
#elif HAVE_AVXVNNI
/* AVX2 with AVX-VNNI: the same column for nb rows of int8 inputs, output rows 8o..8o+7 at a time, the codes
 * offset by 128 (q8_pair_u8x8; `vpdpbusd` sums in int32, no int16 pairs to saturate), the whole group in one
 * sum less 128 * the sum of its int8 inputs, times its dg. */
static inline __attribute__((always_inline)) void q8_column_i8(const uint8_t *col, int G, const qx_t *qx, int K,
                                                               int nb, float out[ROWS_PER_PASS][TILE_N]) {
    const __m256i offset = _mm256_set1_epi8((char)0x80);
    for (int o = 0; o < 2; o++) {
        __m256 accf[ROWS_PER_PASS];
        for (int b = 0; b < nb; b++) accf[b] = _mm256_setzero_ps();
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = col + (size_t)g * Q8_BLOCK_BYTES;
            if (o == 0) prefetch_l2(blk + PREFETCH_AHEAD, Q8_BLOCK_BYTES);
            __m256i w[8]; /* tile rows 2p and 2p + 1 (inputs 4p..4p+3) of output rows 8o..8o+7 */
            for (int p = 0; p < 8; p++) w[p] = q8_pair_u8x8(blk, 2 * p, o, offset);
            for (int b = 0; b < nb; b++) {
                const size_t i = (size_t)b * G + g;
                const int8_t *xg = qx->q8 + (size_t)b * K + g * GROUP;
                __m256i s = _mm256_set1_epi32(-(qx->s8[2 * i] + qx->s8[2 * i + 1]));
                for (int p = 0; p < 8; p++) {
                    int32_t xv;
                    memcpy(&xv, xg + 4 * p, 4);
                    s = PAIRS_ADD(s, w[p], _mm256_set1_epi32(xv));
                }
                accf[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(qx->dg[i]), accf[b]);
            }
        }
        for (int b = 0; b < nb; b++) _mm256_storeu_ps(out[b] + 8 * o, accf[b]);
    }
}
#define Q8_COLUMN(int8, blocks, G, part, K, nb, out) \
    ((int8) ? q8_column_i8(blocks, G, part, K, nb, out) : q8_column(blocks, G, part, K, nb, out))
#else
#define Q8_COLUMN(int8, blocks, G, part, K, nb, out) q8_column(blocks, G, part, K, nb, out)
#endif

#define MAX_REFINE 64

typedef struct {
    int B, K, V, nthreads, refine, mode; /* mode: how the matmul takes its inputs (MM_*) */
    const float *x;
    tile_weights w;
    const float *exact; /* [V, K] fp32 or NULL */
    gguf_matrix exact_rows; /* or the exact weights as the file's rows (data NULL: none) */
    float *row_scratch; /* per thread: K floats, a row of exact_rows decoded */
    float *out;
    qx_t qx;
    uint16_t *tile_scratch; /* per thread: a widened column pair (AMX) */
    size_t tile_scratch_per_thread;
    int32_t *cand; /* [threads, B, refine]: each thread's best rows of each input row */
} head_ctx;

/* top_k's kept values after out[r + j] for each bit j of `hit` (the ones a vector compare found above the
 * kept minimum val[lo]), each taken where it still beats the minimum; returns the new minimum's place. */
static inline int keep_hits(const float *out, int r, unsigned hit, int k, float *val, int32_t *idx, int lo) {
    while (hit) {
        const int j = r + __builtin_ctz(hit);
        hit &= hit - 1;
        if (out[j] > val[lo]) {
            val[lo] = out[j], idx[lo] = j;
            for (int i = 0; i < k; i++) lo = val[i] < val[lo] ? i : lo;
        }
    }
    return lo;
}

/* The `k` largest of out[r0..r1) into idx (unordered): a running minimum among the kept ones, and
 * 16 (AVX-512) or 8 (AVX2) values at a time compared with it, so only the few that beat it are looked at. */
static void top_k(const float *out, int r0, int r1, int k, int32_t *idx) {
    float val[MAX_REFINE];
    int n = 0, lo = 0, r = r0;
    for (; r < r1 && n < k; r++) val[n] = out[r], idx[n] = r, n++;
    for (int i = 1; i < n; i++) lo = val[i] < val[lo] ? i : lo;
    if (n == k) {
#if defined(__AVX512F__)
        for (; r + 16 <= r1; r += 16)
            lo = keep_hits(out, r, _mm512_cmp_ps_mask(_mm512_loadu_ps(out + r), _mm512_set1_ps(val[lo]), _CMP_GT_OQ),
                           k, val, idx, lo);
#elif defined(__AVX2__)
        for (; r + 8 <= r1; r += 8)
            lo = keep_hits(out, r, (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(out + r),
                                                                              _mm256_set1_ps(val[lo]), _CMP_GT_OQ)),
                           k, val, idx, lo);
#endif
        for (; r < r1; r++)
            if (out[r] > val[lo]) {
                val[lo] = out[r], idx[lo] = r;
                for (int i = 0; i < k; i++) lo = val[i] < val[lo] ? i : lo;
            }
    }
    for (; n < k; n++) idx[n] = -1;
}

/* This thread's columns of blocks for every input row (int16 or int8 inputs), row scales and dx applied. */
static void head_int16(const head_ctx *c, int tid) {
    const int K = c->K, G = K / GROUP, NB = c->V / TILE_N, per = (NB + c->nthreads - 1) / c->nthreads;
    const int c0 = tid * per, c1 = c0 + per < NB ? c0 + per : NB, int8 = (HAVE_INT8 || HAVE_AVXVNNI) && c->mode == MM_INT8;
    /* (AVX2 without VNNI: int16 rows, its int8 pairs would saturate on the int8 range) */
    float out[ROWS_PER_PASS][TILE_N];
    for (int col = c0; col < c1; col++) {
        const uint8_t *blocks = c->w.blocks + (size_t)col * G * Q8_BLOCK_BYTES;
        const float *scale = c->w.row_scale + (size_t)col * TILE_N;
        for (int b0 = 0; b0 < c->B; b0 += ROWS_PER_PASS) {
            const int nb = c->B - b0 < ROWS_PER_PASS ? c->B - b0 : ROWS_PER_PASS;
            qx_t part = {c->qx.q + (size_t)b0 * K, c->qx.dx + b0, NULL, NULL,
                         int8 ? c->qx.q8 + (size_t)b0 * K : NULL, int8 ? c->qx.dg + (size_t)b0 * G : NULL,
                         int8 ? c->qx.s8 + (size_t)b0 * G * 2 : NULL, NULL, NULL};
            switch (nb) { /* a constant nb per call: the accumulators stay in registers */
                case 1: Q8_COLUMN(int8, blocks, G, &part, K, 1, out); break;
                case 2: Q8_COLUMN(int8, blocks, G, &part, K, 2, out); break;
                case 3: Q8_COLUMN(int8, blocks, G, &part, K, 3, out); break;
                case 4: Q8_COLUMN(int8, blocks, G, &part, K, 4, out); break;
                case 5: Q8_COLUMN(int8, blocks, G, &part, K, 5, out); break;
                case 6: Q8_COLUMN(int8, blocks, G, &part, K, 6, out); break;
                case 7: Q8_COLUMN(int8, blocks, G, &part, K, 7, out); break;
                default: Q8_COLUMN(int8, blocks, G, &part, K, 8, out); break;
            }
            for (int b = 0; b < nb; b++) {
                float *y = c->out + (size_t)(b0 + b) * c->V + (size_t)col * TILE_N;
                const float dx = int8 ? 1.0f : part.dx[b]; /* (int8: the scales are in) */
                for (int n = 0; n < TILE_N; n++) y[n] = out[b][n] * scale[n] * dx;
            }
        }
    }
}

static void run_head(void *arg, int tid) {
    head_ctx *c = arg;
    if (tid >= c->nthreads) return;
    int b0, b1, r0, r1;
    span(c->B, tid, c->nthreads, &b0, &b1);
    quantize_x(c->x, c->K, &c->qx, b0, b1, c->mode);
    barrier(c->nthreads);
#if HAVE_AMX
    if (c->mode == MM_AMX) {
        matmul_amx(&c->w, c->V, c->V, c->K, &c->qx, c->B, c->out,
                   c->tile_scratch + (size_t)tid * c->tile_scratch_per_thread, tid, c->nthreads);
        _tile_release();
    } else
#endif
    if (c->w.row_scale) {
        head_int16(c, tid);
    } else { /* a layer's tiles (engine/weights.py, native_head: 4-bit for a large vocabulary) */
        const layer_tiles lt = {c->w.blocks, c->w.format, 0, NULL, 0};
        matmul_int16(&lt, c->V, c->V, c->K, &c->qx, c->x, c->B, c->out, tid, c->nthreads, c->mode);
    }
    if ((!c->exact && !c->exact_rows.data) || c->refine <= 0) return;
    /* Each row's best candidates at full precision: every thread's best of a share of the outputs,
     * then the best of those, each recomputed as an fp32 dot product with the exact weights. */
    barrier(c->nthreads);
    const int k = c->refine;
    span(c->V, tid, c->nthreads, &r0, &r1);
    for (int b = 0; b < c->B; b++) top_k(c->out + (size_t)b * c->V, r0, r1, k, c->cand + ((size_t)tid * c->B + b) * k);
    barrier(c->nthreads);
    for (int b = b0; b < b1; b++) {
        float *row = c->out + (size_t)b * c->V;
        float val[MAX_REFINE * MAX_THREADS];
        int32_t all[MAX_REFINE * MAX_THREADS], best[MAX_REFINE];
        int n = 0;
        for (int t = 0; t < c->nthreads; t++)
            for (int i = 0; i < k; i++) {
                const int32_t r = c->cand[((size_t)t * c->B + b) * k + i];
                if (r >= 0) val[n] = row[r], all[n++] = r;
            }
        /* the k best of the n candidates: plain selection (n = threads * k is small) */
        int kept = n < k ? n : k;
        for (int i = 0; i < kept; i++) {
            int m = i;
            for (int j = i + 1; j < n; j++) m = val[j] > val[m] ? j : m;
            float tv = val[i];
            int32_t ti = all[i];
            val[i] = val[m], all[i] = all[m], val[m] = tv, all[m] = ti;
            best[i] = all[i];
        }
        const float *xb = c->x + (size_t)b * c->K;
        for (int i = 0; i < kept; i++) {
            const size_t r = (size_t)best[i], K = (size_t)c->K;
            const float *w;
            if (c->exact) {
                w = c->exact + r * K;
            } else {
                float *e = c->row_scratch + (size_t)tid * K;
                gguf_matrix_row(&c->exact_rows, (int64_t)r, e);
                w = e;
            }
            row[r] = dot(xb, w, c->K);
        }
    }
}

/* out [B, V] = x [B, K] (fp32) W^T for W in tile order: int8 (blocks [V / 16, K / 32, 512], w = q *
 * scale[n]) with `scale` set, else a layer's tiles of `format` (TILES_*: 4-bit for a large vocabulary,
 * whose int8 copy would read as many bytes as the layers); V a multiple of 16 and K of 32. `exact`
 * [V, K] fp32 (or NULL): each row's `refine` largest outputs are then recomputed against it at full
 * precision; or, with `exact` NULL, against the rows of `exact_rows` (gguf_rows.c: V rows of GGML type
 * `exact_type`, NULL for none), the file's own. Steps of at least amx_min_rows rows multiply on AMX
 * tiles, else of at least wide_min_rows in int8 (wide_mode; 0: never). Returns 0, -1 when out of memory,
 * -2 for shapes or a format it does not take. */
int sluice_head_logits(int B, int K, const float *x, const uint8_t *blocks, const float *scale, int format, int V,
                       float *out, const float *exact, const uint8_t *exact_rows, int exact_type, int refine,
                       int nthreads, int wide_min_rows, int amx_min_rows) {
    const size_t exact_row_bytes = exact_rows ? gguf_row_bytes(exact_type, K) : 0;
    if (B < 0 || K % GROUP || V % TILE_N || refine > MAX_REFINE || refine > V || (exact_rows && !exact_row_bytes) ||
        (!scale && !sluice_reads_tiles(format)))
        return -2;
    if (B == 0) return 0; /* a step that samples nothing (a prefill chunk) */
    pthread_mutex_lock(&step_lock);
    nthreads = nthreads < 1 ? 1 : ensure_workers(nthreads);
    const int mode = wide_mode(B, wide_min_rows, amx_min_rows), amx = mode == MM_AMX;
    const size_t R = (size_t)(B + 31) / 32 * 32, per_thread = (size_t)(K / GROUP) * 1024;
    const size_t rows_scratch = exact || !exact_rows ? 0 : (size_t)nthreads * K;
    const size_t floats = R * (1 + 7 * (K / GROUP)) + R * K / 2 + R * K / 2 + (size_t)nthreads * B * MAX_REFINE +
                          rows_scratch + (amx ? (size_t)nthreads * per_thread / 2 : 0) + 16;
    float *buf = calloc(floats, sizeof(float));
    if (!buf) {
        pthread_mutex_unlock(&step_lock);
        return -1;
    }
    head_ctx c = {B, K, V, nthreads, refine, mode, x, {blocks, scale ? Q8_BLOCK_BYTES : tile_bytes(format), scale, scale ? TILES_Q8G : format}, exact,
                  {exact_rows, exact_type, K, exact_row_bytes}, NULL, out,
                  {NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL}, NULL, per_thread, NULL};
    float *p = buf;
    c.qx.dx = p, p += R;
    c.qx.sx = p, p += R * (K / GROUP);
    c.qx.q = (int16_t *)p, p += R * K / 2;
    c.qx.bf = (uint16_t *)p, p += R * K / 2;
    c.qx.q8 = HAVE_INT8_Q4 ? (int8_t *)c.qx.bf : (int8_t *)c.qx.q; /* (MM_INT8 has no int16 rows but with
                                                                 * HAVE_INT8_Q4, which has no bf16 ones) */
    c.qx.dg = p, p += R * (K / GROUP);
    c.qx.s8 = (int32_t *)p, p += R * 2 * (K / GROUP);
    c.qx.ce = p, p += R * 2 * (K / GROUP);
    c.qx.o8 = p, p += R * (K / GROUP);
    c.cand = (int32_t *)p, p += (size_t)nthreads * B * MAX_REFINE;
    c.row_scratch = p, p += rows_scratch;
    c.tile_scratch = (uint16_t *)(((uintptr_t)p + 63) & ~(uintptr_t)63);
    run_parallel(run_head, &c, nthreads);
    free(buf);
    pthread_mutex_unlock(&step_lock);
    return 0;
}

