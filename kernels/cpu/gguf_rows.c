/* Rows of a GGUF matrix decoded from the file's own blocks: the token embedding and the exact weights of
 * the output layer's candidates (engine/token_rows.py).
 * Part of the native CPU step, compiled as one unit by forward.c (see there).
 *
 * Why: the vocabulary matrix is the largest one a small model has (a Llama-3.2-1B shape's 128k x 2048
 * is 215 MB as the file's Q6_K, 1 GiB as fp32), and besides the output layer's int8 copy, which a step
 * reads whole, only a few rows of it are ever needed at a time: the tokens a step embeds, each output
 * row's best candidates. So those rows are decoded from the memory-mapped file when they are needed,
 * and the matrix is never copied: at most its file pages are resident, once read.
 *
 * Numerics: each value as ggml's dequantize_row_* computes it in fp32 (the same products and sums in the
 * same order, none fused: the function is compiled without contraction), so a row is the dequantised
 * weights bit for bit, as gguf-py's dequantisation gives them. */

enum { GGML_F16 = 1, GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8,
       GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14, GGML_BF16 = 30 };

/* Bytes of one row of K values of a type (0: a type or K this file does not decode). */
static size_t gguf_row_bytes(int type, int K) {
    switch (type) {
        case GGML_F16: case GGML_BF16: return (size_t)K * 2;
        case GGML_Q4_0: return K % 32 ? 0 : (size_t)K / 32 * 18;
        case GGML_Q4_1: return K % 32 ? 0 : (size_t)K / 32 * 20;
        case GGML_Q5_0: return K % 32 ? 0 : (size_t)K / 32 * 22;
        case GGML_Q5_1: return K % 32 ? 0 : (size_t)K / 32 * 24;
        case GGML_Q8_0: return K % 32 ? 0 : (size_t)K / 32 * 34;
        case GGML_Q4_K: return K % 256 ? 0 : (size_t)K / 256 * 144;
        case GGML_Q5_K: return K % 256 ? 0 : (size_t)K / 256 * 176;
        case GGML_Q6_K: return K % 256 ? 0 : (size_t)K / 256 * 210;
        default: return 0;
    }
}

/* The same, for the ctypes side's shape checks. */
int64_t sluice_gguf_row_bytes(int type, int K) { return (int64_t)gguf_row_bytes(type, K); }

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j (ggml's get_scale_min_k4). */
static inline void k4_scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63, *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* y [K] = one row of `type` blocks at src, as ggml dequantises it. */
__attribute__((optimize("fp-contract=off"))) static void gguf_row(const uint8_t *src, int type, int K, float *y) {
    switch (type) {
        case GGML_F16:
            for (int i = 0; i < K; i++) y[i] = fp16_to_f32(rd16(src + 2 * i));
            return;
        case GGML_BF16:
            for (int i = 0; i < K; i++) y[i] = bf16_to_f32(rd16(src + 2 * i));
            return;
        case GGML_Q4_0: case GGML_Q4_1:
            for (int b = 0; b < K / 32; b++, y += 32) {
                const uint8_t *blk = src + (size_t)b * (type == GGML_Q4_0 ? 18 : 20), *qs = blk + (type == GGML_Q4_0 ? 2 : 4);
                const float d = fp16_to_f32(rd16(blk));
                if (type == GGML_Q4_0) {
                    for (int j = 0; j < 16; j++) y[j] = (float)((qs[j] & 0xF) - 8) * d, y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
                } else {
                    const float m = fp16_to_f32(rd16(blk + 2));
                    for (int j = 0; j < 16; j++) y[j] = (float)(qs[j] & 0xF) * d + m, y[j + 16] = (float)(qs[j] >> 4) * d + m;
                }
            }
            return;
        case GGML_Q5_0: case GGML_Q5_1:
            for (int b = 0; b < K / 32; b++, y += 32) {
                const int one = type == GGML_Q5_1;
                const uint8_t *blk = src + (size_t)b * (one ? 24 : 22), *qh8 = blk + (one ? 4 : 2), *qs = qh8 + 4;
                const float d = fp16_to_f32(rd16(blk)), m = one ? fp16_to_f32(rd16(blk + 2)) : 0.0f;
                const uint32_t qh = (uint32_t)qh8[0] | (uint32_t)qh8[1] << 8 | (uint32_t)qh8[2] << 16 | (uint32_t)qh8[3] << 24;
                for (int j = 0; j < 16; j++) {
                    const int x0 = (qs[j] & 0xF) | (int)(((qh >> j) << 4) & 0x10);
                    const int x1 = (qs[j] >> 4) | (int)((qh >> (j + 12)) & 0x10);
                    if (one) {
                        y[j] = (float)x0 * d + m, y[j + 16] = (float)x1 * d + m;
                    } else {
                        y[j] = (float)(x0 - 16) * d, y[j + 16] = (float)(x1 - 16) * d;
                    }
                }
            }
            return;
        case GGML_Q8_0:
            for (int b = 0; b < K / 32; b++, y += 32) {
                const uint8_t *blk = src + (size_t)b * 34;
                const float d = fp16_to_f32(rd16(blk));
                for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)blk[2 + j] * d;
            }
            return;
        case GGML_Q4_K: case GGML_Q5_K:
            for (int b = 0; b < K / 256; b++) {
                const int five = type == GGML_Q5_K;
                const uint8_t *blk = src + (size_t)b * (five ? 176 : 144), *scales = blk + 4;
                const uint8_t *qh = blk + 16, *q = blk + (five ? 48 : 16);
                const float d = fp16_to_f32(rd16(blk)), dmin = fp16_to_f32(rd16(blk + 2));
                int u1 = 1, u2 = 2;
                for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32, u1 <<= 2, u2 <<= 2) {
                    int sc, mm;
                    k4_scale_min(is, scales, &sc, &mm);
                    const float d1 = d * (float)sc, m1 = dmin * (float)mm;
                    k4_scale_min(is + 1, scales, &sc, &mm);
                    const float d2 = d * (float)sc, m2 = dmin * (float)mm;
                    for (int l = 0; l < 32; l++) {
                        const int h1 = five && (qh[l] & u1) ? 16 : 0, h2 = five && (qh[l] & u2) ? 16 : 0;
                        y[l] = d1 * (float)((q[l] & 0xF) + h1) - m1;
                        y[l + 32] = d2 * (float)((q[l] >> 4) + h2) - m2;
                    }
                    y += 64;
                }
            }
            return;
        case GGML_Q6_K:
            for (int b = 0; b < K / 256; b++) {
                const uint8_t *blk = src + (size_t)b * 210, *ql = blk, *qh = blk + 128;
                const int8_t *sc = (const int8_t *)(blk + 192);
                const float d = fp16_to_f32(rd16(blk + 208));
                for (int n = 0; n < 256; n += 128, y += 128, ql += 64, qh += 32, sc += 8)
                    for (int l = 0; l < 32; l++) {
                        const int is = l / 16;
                        const int q1 = (int)((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32;
                        const int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                        const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                        const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                        y[l] = d * (float)sc[is] * (float)q1;
                        y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                        y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                        y[l + 96] = d * (float)sc[is + 6] * (float)q4;
                    }
            }
            return;
        default:
            return;
    }
}

/* A matrix of GGUF rows as the kernels here read it: [V] rows of row_bytes bytes each. */
typedef struct {
    const uint8_t *data;
    int type, K;
    size_t row_bytes;
} gguf_matrix;

static inline void gguf_matrix_row(const gguf_matrix *m, int64_t r, float *y) {
    gguf_row(m->data + (size_t)r * m->row_bytes, m->type, m->K, y);
}

typedef struct {
    gguf_matrix m;
    const int64_t *ids;
    int n, nthreads;
    float *out;
} rows_ctx;

static void run_rows(void *arg, int tid) {
    rows_ctx *c = arg;
    if (tid >= c->nthreads) return;
    int r0, r1;
    span(c->n, tid, c->nthreads, &r0, &r1);
    for (int r = r0; r < r1; r++) gguf_matrix_row(&c->m, c->ids[r], c->out + (size_t)r * c->m.K);
}

/* out [n, K] = rows ids [n] of the GGUF matrix `data` ([V] rows of `type`, K values each), decoded as
 * ggml dequantises them. Returns 0, -2 for a type it does not decode, -3 for an id outside [0, V). */
int sluice_gguf_rows(const uint8_t *data, int type, int K, int V, const int64_t *ids, int n, float *out, int nthreads) {
    const size_t row_bytes = gguf_row_bytes(type, K);
    if (!row_bytes || K % GROUP || n < 0) return -2;
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= V) return -3;
    if (n == 0) return 0;
    rows_ctx c = {{data, type, K, row_bytes}, ids, n, 1, out};
    if ((size_t)n * K < 65536 || nthreads <= 1) { /* a decode step's few rows: not worth waking threads */
        run_rows(&c, 0);
        return 0;
    }
    pthread_mutex_lock(&step_lock);
    c.nthreads = ensure_workers(nthreads);
    run_parallel(run_rows, &c, c.nthreads);
    pthread_mutex_unlock(&step_lock);
    return 0;
}

typedef struct {
    int B, V, nthreads;
    gguf_matrix m;
    const float *x;
    float *out, *scratch; /* scratch: K floats per thread */
} product_ctx;

/* This thread's share of the rows: each decoded once, then multiplied with every input row. */
static void run_product(void *arg, int tid) {
    product_ctx *c = arg;
    if (tid >= c->nthreads) return;
    const int K = c->m.K;
    float *w = c->scratch + (size_t)tid * K;
    int r0, r1;
    span(c->V, tid, c->nthreads, &r0, &r1);
    for (int r = r0; r < r1; r++) {
        gguf_matrix_row(&c->m, r, w);
        for (int b = 0; b < c->B; b++) c->out[(size_t)b * c->V + r] = dot(c->x + (size_t)b * K, w, K);
    }
}

/* out [B, V] = x [B, K] W^T at full precision for W the GGUF matrix `data` ([V] rows of `type`): the
 * output layer's exact logits (logprobs) straight from the file's blocks, each row decoded once; for a few
 * rows of x (a GEMM over decoded slices does many better). Returns 0, -1 when out of memory, -2 for a type
 * or shape it does not take. */
int sluice_gguf_rows_product(int B, int K, const float *x, const uint8_t *data, int type, int V, float *out,
                             int nthreads) {
    const size_t row_bytes = gguf_row_bytes(type, K);
    if (B < 0 || V < 0 || !row_bytes || K % GROUP) return -2;
    if (B == 0 || V == 0) return 0;
    pthread_mutex_lock(&step_lock);
    nthreads = nthreads < 1 ? 1 : ensure_workers(nthreads);
    float *scratch = malloc((size_t)nthreads * K * sizeof(float));
    if (!scratch) {
        pthread_mutex_unlock(&step_lock);
        return -1;
    }
    product_ctx c = {B, V, nthreads, {data, type, K, row_bytes}, x, out, scratch};
    run_parallel(run_product, &c, nthreads);
    free(scratch);
    pthread_mutex_unlock(&step_lock);
    return 0;
}
