/* Paged attention over the bf16 KV cache: the per-ISA kernels and the plan of jobs.
 * Part of the native CPU step, compiled as one unit by forward.c (see there). */

static inline void bf16_to_f32_row(const uint16_t *src, float *dst, int n) { /* vectorised by the compiler */
    uint32_t bits[256];
    for (int i = 0; i < n; i++) bits[i] = (uint32_t)src[i] << 16;
    memcpy(dst, bits, (size_t)n * 4);
}

/* Where a sequence's cached keys and values are: the layer's K and V at this kv head, the stride of a
 * cache slot, the block table and the block size. */
typedef struct {
    const uint16_t *k, *v;
    int64_t slot_stride;
    const int32_t *table;
    int block_size;
} kv_view;

/* The cache offsets (elements) of positions [t0, t0 + cnt): one division per chunk, not per key (an
 * integer division costs more than a key's dot products). */
static inline void chunk_slots(const kv_view *kv, int t0, int cnt, int64_t *slots) {
    int blk = t0 / kv->block_size, off = t0 - blk * kv->block_size;
    for (int j = 0; j < cnt; j++) {
        slots[j] = ((int64_t)kv->table[blk] * kv->block_size + off) * kv->slot_stride;
        if (++off == kv->block_size) off = 0, blk++;
    }
}

/* ---- attention ----
 *
 * One call: T consecutive rows of one sequence (positions p0 .. p0 + T - 1: rows of a prefill chunk, or
 * T = 1 for a decode) against one span of that sequence's cached keys and values (KEY_SPAN below), for kv
 * heads [kv0, kv1); row r attends to positions 0 .. p0 + r. Every query vector gets the same arithmetic whatever T is (its
 * scores as blocks of keys, lane-wise FMAs summed across lanes; a two-pass softmax; values added key
 * by key), so a row's attention is bit-identical in a decode step and in any prefill chunk: chunking
 * and batching change nothing. Tiles exist for speed: a block of keys (and of values) is widened to
 * fp32 once into L1 and read there by all T x group query vectors, instead of being fetched from the
 * cache and widened again for every row. */
typedef struct {
    const float *q; /* row r's query heads: q + r * q_stride, [heads, D] */
    float *out; /* row r's output: out + r * out_stride, [heads, D] */
    int q_stride, out_stride, T, p0;
    int ka, kb; /* these keys: positions [ka, kb) of each row's (a span of KEY_SPAN, see below) */
    float *part, *ml; /* a split row's partial output [heads, D] and (max, sum) per head [heads, 2]: row r's at
                       * part + r * part_stride, ml + r * ml_stride */
    int part_stride, ml_stride;
    int pf_end, cold; /* where the keys' far prefetch stops: the job's last span's end, so that the next
                       * span's first keys are in L2 when its turn comes; cold: the job's first span */
} att_rows;

/* A row's keys in spans of KEY_SPAN positions from position 0, each attended on its own (its scores'
 * maximum, the sum of their exponentials and the values they weight, not yet divided) and folded into
 * the row's running output in position order (fold_span): an online softmax over spans. A job takes all
 * its rows' spans in turn, folding each as it ends, so it holds one span's partial rows at a time (a
 * thread's TILE_Q rows). Where the rows' jobs are too few to keep every thread busy (a lone decode: one
 * SmolLM2 row is 3 kv heads' jobs for 2 threads, one thread doing two), each span is a job of its own;
 * the spans' partials are then kept ([rows, spans, heads, D]: at most 2 x threads runs of rows, 1/1000 of
 * their cache) and folded after the jobs, in the same order by the same function. The spans' bounds are
 * positions, not anything of the step or of how jobs are cut, so a row's arithmetic is the same in a
 * decode and in any prefill chunk or batch; a row of at most KEY_SPAN positions is one span, attended and
 * divided as before. */
#define KEY_SPAN 256

static inline int key_spans(int64_t n) { return (int)((n + KEY_SPAN - 1) / KEY_SPAN); }

/* Where row r of a call writes: its output row, or, split over spans, its partial row (see attention_job). */
static inline float *att_out(const att_rows *a, int r) {
    return a->p0 + r + 1 > KEY_SPAN ? a->part + (size_t)r * a->part_stride : a->out + (size_t)r * a->out_stride;
}

/* A row's keys in this call: [a->ka, *end); returns whether it has any. */
static inline int row_keys(const att_rows *a, int r, int *end) {
    const int n = a->p0 + r + 1;
    *end = n < a->kb ? n : a->kb;
    return *end > a->ka;
}

/* After a row's keys: its sums divided by their total (one span), or its (max, sum) kept for fold_span. */
static inline void att_finish(const att_rows *a, int r, int h, float mx, float sum, float *o, int D) {
    if (a->p0 + r + 1 > KEY_SPAN) {
        a->ml[(size_t)r * a->ml_stride + 2 * h] = mx, a->ml[(size_t)r * a->ml_stride + 2 * h + 1] = sum;
        return;
    }
    const float inv = 1.0f / sum;
    for (int i = 0; i < D; i++) o[i] *= inv;
}

/* One head's running output o [D] with its (max, sum) in ml[0..1], folded with the next span's partial
 * p [D] and (max, sum) pm[0..1]. The only merge of spans there is, so both job shapes round alike. */
static inline void fold_span(float *o, float *ml, const float *p, const float *pm, int D) {
    const float m = pm[0] > ml[0] ? pm[0] : ml[0], wa = fast_exp(ml[0] - m), wb = fast_exp(pm[0] - m);
    ml[0] = m, ml[1] = wa * ml[1] + wb * pm[1];
    for (int i = 0; i < D; i++) o[i] = wa * o[i] + wb * p[i];
}

/* One head's folded output divided by its total. */
static inline void fold_finish(float *o, const float *ml, int D) {
    const float inv = 1.0f / ml[1];
    for (int i = 0; i < D; i++) o[i] *= inv;
}

#define TILE_Q 16 /* rows of one prefill chunk per attention job */

/* Plain C: every head size and group (a row's keys widened once per position, read by its heads). */
static void attend_rows_generic(const att_rows *a, int group, int D, const kv_view *kv, int kv0, int kv1,
                                float *scores, float *kbuf) {
    const float scale = 1.0f / sqrtf((float)D);
    const int nh = (kv1 - kv0) * group, ka = a->ka, n_max = a->p0 + a->T < a->kb ? a->p0 + a->T : a->kb;
    const int span = n_max - ka; /* (scores of position t at t - ka) */
    int64_t slots[16];
    for (int r = 0; r < a->T; r++) {
        int n;
        if (!row_keys(a, r, &n)) continue;
        const float *q = a->q + (size_t)r * a->q_stride;
        float *out = att_out(a, r);
        for (int kvh = kv0; kvh < kv1; kvh++) {
            float mx[256], *s = scores + (size_t)(r * nh + (kvh - kv0) * group) * span;
            for (int h = 0; h < group; h++) mx[h] = -INFINITY;
            for (int t = ka; t < n; t++) {
                if ((t - ka) % 16 == 0) chunk_slots(kv, t, n - t < 16 ? n - t : 16, slots);
                bf16_to_f32_row(kv->k + slots[(t - ka) % 16] + kvh * D, kbuf, D);
                for (int h = 0; h < group; h++) {
                    const float *qh = q + (kvh * group + h) * D;
                    float acc = 0;
                    for (int i = 0; i < D; i++) acc += qh[i] * kbuf[i];
                    s[h * span + t - ka] = acc * scale;
                    mx[h] = s[h * span + t - ka] > mx[h] ? s[h * span + t - ka] : mx[h];
                }
            }
            float sum[256];
            for (int h = 0; h < group; h++) sum[h] = exp_shifted(s + h * span, n - ka, mx[h]);
            float *o = out + kvh * group * D;
            for (int i = 0; i < group * D; i++) o[i] = 0;
            for (int t = ka; t < n; t++) {
                if ((t - ka) % 16 == 0) chunk_slots(kv, t, n - t < 16 ? n - t : 16, slots);
                bf16_to_f32_row(kv->v + slots[(t - ka) % 16] + kvh * D, kbuf, D);
                for (int h = 0; h < group; h++) {
                    const float p = s[h * span + t - ka];
                    for (int i = 0; i < D; i++) o[h * D + i] += p * kbuf[i];
                }
            }
            for (int h = 0; h < group; h++) att_finish(a, r, kvh * group + h, mx[h], sum[h], o + h * D, D);
        }
    }
}

/* Asks for the cache rows at `slots` (heads from `off`, `bytes` of each) ahead of their use: a
 * sequence's blocks lie anywhere in the pool, so the hardware prefetcher starts cold at each one.
 * (Inline asm: GCC deletes loops whose only effect is `__builtin_prefetch`.) */
static inline void prefetch_rows(const uint16_t *base, const int64_t *slots, int cnt, int off, int bytes, int l1) {
#if defined(__x86_64__)
    for (int j = 0; j < cnt; j++) {
        const char *p = (const char *)(base + slots[j] + off);
        for (int b = 0; b < bytes; b += 64) {
            if (l1)
                __asm__ volatile("prefetcht0 (%0)" ::"r"(p + b));
            else
                __asm__ volatile("prefetcht1 (%0)" ::"r"(p + b));
        }
    }
#else
    (void)base, (void)slots, (void)cnt, (void)off, (void)bytes, (void)l1;
#endif
}

/* The rows of positions [t0 + PF_LEAD, t0 + PF_LEAD + step), to L2: a block's rows are contiguous but
 * the blocks lie anywhere, and one step of lead (the L1 prefetch of the next keys) is shorter than a
 * cache miss's latency at a decode's pace: the loads stalled on memory (18 GB/s from DRAM, against 44
 * GB/s for the same rows in cache; with this lead 25 GB/s, context 512, 16 sequences). */
#define PF_LEAD 64
static inline void prefetch_far(const kv_view *kv, const uint16_t *base, int t0, int step, int n_max, int off,
                                int bytes) {
    const int tf = t0 + PF_LEAD;
    if (tf >= n_max || tf < 0) return;
    int64_t far[16];
    const int cnt = n_max - tf < step ? n_max - tf : step;
    chunk_slots(kv, tf, cnt, far);
    prefetch_rows(base, far, cnt, off, bytes, 0);
}

/* A job's first PF_LEAD positions from t0, to L2 at once (the far prefetch's lead for them). */
static inline void prefetch_start(const kv_view *kv, const uint16_t *base, int t0, int step, int n_max, int off,
                                  int bytes) {
    for (int t = t0 - PF_LEAD; t < t0; t += step) prefetch_far(kv, base, t, step, n_max, off, bytes);
}

#define FAST_GROUP 4 /* query heads per kv head on the vector paths */
#define MAX_HEADS 256

#if defined(__AVX512F__)
#define FAST_CHUNKS 8 /* head_dim / 16 */

static inline __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* r[j] = the sum of v[j]'s 16 lanes, for 16 vectors at once (a tree of lane permutes and adds: ~3 ops
 * per vector instead of a full horizontal sum each). */
static inline __m512 hsum16(const __m512 *v) {
    const __m512i a1 = _mm512_set_epi32(23, 22, 21, 20, 19, 18, 17, 16, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i b1 = _mm512_set_epi32(31, 30, 29, 28, 27, 26, 25, 24, 15, 14, 13, 12, 11, 10, 9, 8);
    const __m512i a2 = _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
    const __m512i b2 = _mm512_set_epi32(31, 30, 29, 28, 23, 22, 21, 20, 15, 14, 13, 12, 7, 6, 5, 4);
    const __m512i a3 = _mm512_set_epi32(29, 28, 25, 24, 21, 20, 17, 16, 13, 12, 9, 8, 5, 4, 1, 0);
    const __m512i b3 = _mm512_set_epi32(31, 30, 27, 26, 23, 22, 19, 18, 15, 14, 11, 10, 7, 6, 3, 2);
    const __m512i a4 = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i b4 = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++) /* [vector 2i: 8 partial sums | vector 2i+1: 8] */
        w[i] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * i], a1, v[2 * i + 1]),
                             _mm512_permutex2var_ps(v[2 * i], b1, v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* four vectors, 4 partial sums each */
        x[i] = _mm512_add_ps(_mm512_permutex2var_ps(w[2 * i], a2, w[2 * i + 1]),
                             _mm512_permutex2var_ps(w[2 * i], b2, w[2 * i + 1]));
    for (int i = 0; i < 2; i++) /* eight vectors, 2 each */
        y[i] = _mm512_add_ps(_mm512_permutex2var_ps(x[2 * i], a3, x[2 * i + 1]),
                             _mm512_permutex2var_ps(x[2 * i], b3, x[2 * i + 1]));
    return _mm512_add_ps(_mm512_permutex2var_ps(y[0], a4, y[1]), _mm512_permutex2var_ps(y[0], b4, y[1]));
}

/* AVX-512: keys in blocks of 16 positions; within a block every kv head in [kv0, kv1) in turn (a cache
 * slot holds all kv heads side by side, so a block's rows stay in L1 while its heads are read); each
 * key's 16 lanes of products for the group's query heads summed across lanes together (hsum16).
 * scores: [T * (kv1 - kv0) * group, p0 + T] of scratch; kbuf: [16, D] of scratch (tiles only). */
static inline __attribute__((always_inline)) void attend_avx512(const att_rows *a, int group, int D,
                                                                const kv_view *kv, int kv0, int kv1, float *scores,
                                                                float *kbuf) {
    const int C = D / 16, nh = (kv1 - kv0) * group, T = a->T, ka = a->ka;
    const int n_max = a->p0 + T < a->kb ? a->p0 + T : a->kb, span = n_max - ka; /* (position t's score at t - ka) */
    const float scale = 1.0f / sqrtf((float)D);
    float mx[MAX_HEADS], sum[MAX_HEADS]; /* T * nh of them: T = 1, or one kv head of a tile */
    const int row_bytes = (kv1 - kv0) * D * 2; /* of one position's keys (or values) that we read */
    int64_t slots[16], next[16];
    for (int i = 0; i < T * nh; i++) mx[i] = -INFINITY;
    __m512 part[FAST_GROUP][16];
    const int pf_end = a->pf_end < a->p0 + T ? a->pf_end : a->p0 + T;
    if (a->cold) prefetch_start(kv, kv->k, ka, 16, pf_end, kv0 * D, row_bytes);
    chunk_slots(kv, ka, span < 16 ? span : 16, next);
    for (int t0 = ka; t0 < n_max; t0 += 16) {
        const int cnt = n_max - t0 < 16 ? n_max - t0 : 16, cnt_next = n_max - t0 - 16 < 16 ? n_max - t0 - 16 : 16;
        memcpy(slots, next, sizeof slots);
        if (cnt_next > 0) {
            chunk_slots(kv, t0 + 16, cnt_next, next);
            prefetch_rows(kv->k, next, cnt_next, kv0 * D, row_bytes, 1); /* the next keys, to L1 */
        }
        prefetch_far(kv, kv->k, t0, 16, pf_end, kv0 * D, row_bytes);
        prefetch_rows(kv->v, slots, cnt, kv0 * D, row_bytes, 0); /* these values, to L2 */
        for (int kvh = kv0; kvh < kv1; kvh++) {
            if (T > 1) /* widen the block's keys once for all the tile's rows */
                for (int j = 0; j < cnt; j++)
                    for (int c = 0; c < C; c++)
                        _mm512_storeu_ps(kbuf + j * D + c * 16, bf16x16(kv->k + slots[j] + kvh * D + c * 16));
            for (int r = 0; r < T; r++) {
                const int n = a->p0 + r + 1 < a->kb ? a->p0 + r + 1 : a->kb; /* (its keys' end here) */
                if (t0 >= n) continue; /* (this row has no keys in the block) */
                const int cnt_r = n - t0 < 16 ? n - t0 : 16;
                const __mmask16 valid = (__mmask16)((1u << cnt_r) - 1);
                const float *q = a->q + (size_t)r * a->q_stride;
                __m512 qv[FAST_GROUP][FAST_CHUNKS];
                for (int h = 0; h < group; h++)
                    for (int c = 0; c < C; c++)
                        qv[h][c] = _mm512_mul_ps(_mm512_loadu_ps(q + (kvh * group + h) * D + c * 16),
                                                 _mm512_set1_ps(scale));
                for (int j = 0; j < 16; j++) {
                    if (j >= cnt_r) {
                        for (int h = 0; h < group; h++) part[h][j] = _mm512_setzero_ps();
                        continue;
                    }
                    __m512 kf[FAST_CHUNKS] = {_mm512_setzero_ps()};
                    if (T > 1)
                        for (int c = 0; c < C; c++) kf[c] = _mm512_loadu_ps(kbuf + j * D + c * 16);
                    else
                        for (int c = 0; c < C; c++) kf[c] = bf16x16(kv->k + slots[j] + kvh * D + c * 16);
                    for (int h = 0; h < group; h++) {
                        __m512 acc = _mm512_mul_ps(qv[h][0], kf[0]);
                        for (int c = 1; c < C; c++) acc = _mm512_fmadd_ps(qv[h][c], kf[c], acc);
                        part[h][j] = acc;
                    }
                }
                for (int h = 0; h < group; h++) {
                    const int i = r * nh + (kvh - kv0) * group + h;
                    __m512 sc = hsum16(part[h]);
                    _mm512_mask_storeu_ps(scores + (size_t)i * span + (t0 - ka), valid, sc);
                    float m = _mm512_mask_reduce_max_ps(valid, sc);
                    mx[i] = m > mx[i] ? m : mx[i];
                }
            }
        }
    }
    for (int i = 0; i < T * nh; i++) {
        int end;
        sum[i] = row_keys(a, i / nh, &end) ? exp_shifted(scores + (size_t)i * span, end - ka, mx[i]) : 0;
    }
    for (int r = 0; r < T; r++) {
        int end;
        if (!row_keys(a, r, &end)) continue;
        float *o = att_out(a, r) + kv0 * group * D;
        for (int i = 0; i < nh * D; i++) o[i] = 0;
    }
    chunk_slots(kv, ka, span < 16 ? span : 16, next);
    for (int t0 = ka; t0 < n_max; t0 += 16) {
        const int cnt = n_max - t0 < 16 ? n_max - t0 : 16, cnt_next = n_max - t0 - 16 < 16 ? n_max - t0 - 16 : 16;
        memcpy(slots, next, sizeof slots);
        if (cnt_next > 0) {
            chunk_slots(kv, t0 + 16, cnt_next, next);
            prefetch_rows(kv->v, next, cnt_next, kv0 * D, row_bytes, 1);
        }
        prefetch_far(kv, kv->v, t0, 16, n_max, kv0 * D, row_bytes);
        for (int kvh = kv0; kvh < kv1; kvh++) {
            const int h0 = (kvh - kv0) * group;
            if (T > 1)
                for (int j = 0; j < cnt; j++)
                    for (int c = 0; c < C; c++)
                        _mm512_storeu_ps(kbuf + j * D + c * 16, bf16x16(kv->v + slots[j] + kvh * D + c * 16));
            for (int r = 0; r < T; r++) {
                const int n = a->p0 + r + 1 < a->kb ? a->p0 + r + 1 : a->kb; /* (its keys' end here) */
                if (t0 >= n) continue;
                const int cnt_r = n - t0 < 16 ? n - t0 : 16;
                float *o = att_out(a, r) + kv0 * group * D;
                const float *s = scores + (size_t)(r * nh + h0) * span + (t0 - ka);
                __m512 acc[FAST_GROUP][FAST_CHUNKS];
                for (int h = 0; h < group; h++)
                    for (int c = 0; c < C; c++) acc[h][c] = _mm512_loadu_ps(o + (h0 + h) * D + c * 16);
                for (int j = 0; j < cnt_r; j++) {
                    __m512 vf[FAST_CHUNKS];
                    if (T > 1)
                        for (int c = 0; c < C; c++) vf[c] = _mm512_loadu_ps(kbuf + j * D + c * 16);
                    else
                        for (int c = 0; c < C; c++) vf[c] = bf16x16(kv->v + slots[j] + kvh * D + c * 16);
                    for (int h = 0; h < group; h++) {
                        __m512 p = _mm512_set1_ps(s[(size_t)h * span + j]);
                        for (int c = 0; c < C; c++) acc[h][c] = _mm512_fmadd_ps(p, vf[c], acc[h][c]);
                    }
                }
                for (int h = 0; h < group; h++)
                    for (int c = 0; c < C; c++) _mm512_storeu_ps(o + (h0 + h) * D + c * 16, acc[h][c]);
            }
        }
    }
    for (int r = 0; r < T; r++) {
        int end;
        if (!row_keys(a, r, &end)) continue;
        float *o = att_out(a, r) + kv0 * group * D;
        for (int i = 0; i < nh; i++) att_finish(a, r, kv0 * group + i, mx[r * nh + i], sum[r * nh + i], o + i * D, D);
    }
}
#define ATTEND_VEC attend_avx512
#define VEC_DIM_OK(D) ((D) % 16 == 0 && (D) / 16 <= FAST_CHUNKS)

#elif defined(__AVX2__) && defined(__FMA__)
#define FAST_CHUNKS8 16 /* head_dim / 8 */

static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* r[j] = the sum of v[j]'s 8 lanes, for 8 vectors at once. */
static inline __m256 hsum8x8(const __m256 *v) {
    const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 s03 = _mm256_hadd_ps(s01, s23), s47 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s03, s47, 0x20), _mm256_permute2f128_ps(s03, s47, 0x31));
}

static inline float hmax8_masked(__m256 v, int cnt) {
    float t[8], m = -INFINITY;
    _mm256_storeu_ps(t, v);
    for (int i = 0; i < cnt; i++) m = t[i] > m ? t[i] : m;
    return m;
}

/* AVX2: attend_avx512's algorithm in blocks of 8 keys; keys and values always widened into kbuf first
 * (with 16 registers a key's D / 8 vectors do not stay in registers across the group's heads).
 * kbuf: [16, D] floats. */
static inline __attribute__((always_inline)) void attend_avx2(const att_rows *a, int group, int D, const kv_view *kv,
                                                              int kv0, int kv1, float *scores, float *kbuf) {
    const int C = D / 8, nh = (kv1 - kv0) * group, T = a->T, ka = a->ka;
    const int n_max = a->p0 + T < a->kb ? a->p0 + T : a->kb, span = n_max - ka; /* (position t's score at t - ka) */
    const float scale = 1.0f / sqrtf((float)D);
    float mx[MAX_HEADS], sum[MAX_HEADS];
    const int row_bytes = (kv1 - kv0) * D * 2;
    int64_t slots[16], next[16];
    for (int i = 0; i < T * nh; i++) mx[i] = -INFINITY;
    __m256 part[FAST_GROUP][8];
    const int pf_end = a->pf_end < a->p0 + T ? a->pf_end : a->p0 + T;
    if (a->cold) prefetch_start(kv, kv->k, ka, 8, pf_end, kv0 * D, row_bytes);
    chunk_slots(kv, ka, span < 8 ? span : 8, next);
    for (int t0 = ka; t0 < n_max; t0 += 8) {
        const int cnt = n_max - t0 < 8 ? n_max - t0 : 8, cnt_next = n_max - t0 - 8 < 8 ? n_max - t0 - 8 : 8;
        memcpy(slots, next, 8 * sizeof *slots);
        if (cnt_next > 0) {
            chunk_slots(kv, t0 + 8, cnt_next, next);
            prefetch_rows(kv->k, next, cnt_next, kv0 * D, row_bytes, 1);
        }
        prefetch_far(kv, kv->k, t0, 8, pf_end, kv0 * D, row_bytes);
        prefetch_rows(kv->v, slots, cnt, kv0 * D, row_bytes, 0);
        for (int kvh = kv0; kvh < kv1; kvh++) {
            for (int j = 0; j < cnt; j++)
                for (int c = 0; c < C; c++)
                    _mm256_storeu_ps(kbuf + j * D + c * 8, bf16x8(kv->k + slots[j] + kvh * D + c * 8));
            for (int r = 0; r < T; r++) {
                const int n = a->p0 + r + 1 < a->kb ? a->p0 + r + 1 : a->kb; /* (its keys' end here) */
                if (t0 >= n) continue;
                const int cnt_r = n - t0 < 8 ? n - t0 : 8;
                const float *q = a->q + (size_t)r * a->q_stride;
                for (int h = 0; h < group; h++) {
                    __m256 qv[FAST_CHUNKS8];
                    const float *qh = q + (kvh * group + h) * D;
                    for (int c = 0; c < C; c++) qv[c] = _mm256_mul_ps(_mm256_loadu_ps(qh + c * 8), _mm256_set1_ps(scale));
                    for (int j = 0; j < 8; j++) {
                        if (j >= cnt_r) {
                            part[h][j] = _mm256_setzero_ps();
                            continue;
                        }
                        __m256 acc = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kbuf + j * D));
                        for (int c = 1; c < C; c++) acc = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(kbuf + j * D + c * 8), acc);
                        part[h][j] = acc;
                    }
                    const int i = r * nh + (kvh - kv0) * group + h;
                    __m256 sc = hsum8x8(part[h]);
                    float tmp[8];
                    _mm256_storeu_ps(tmp, sc);
                    memcpy(scores + (size_t)i * span + (t0 - ka), tmp, (size_t)cnt_r * sizeof(float));
                    float m = hmax8_masked(sc, cnt_r);
                    mx[i] = m > mx[i] ? m : mx[i];
                }
            }
        }
    }
    for (int i = 0; i < T * nh; i++) {
        int end;
        sum[i] = row_keys(a, i / nh, &end) ? exp_shifted(scores + (size_t)i * span, end - ka, mx[i]) : 0;
    }
    for (int r = 0; r < T; r++) {
        int end;
        if (!row_keys(a, r, &end)) continue;
        float *o = att_out(a, r) + kv0 * group * D;
        for (int i = 0; i < nh * D; i++) o[i] = 0;
    }
    chunk_slots(kv, ka, span < 8 ? span : 8, next);
    for (int t0 = ka; t0 < n_max; t0 += 8) {
        const int cnt = n_max - t0 < 8 ? n_max - t0 : 8, cnt_next = n_max - t0 - 8 < 8 ? n_max - t0 - 8 : 8;
        memcpy(slots, next, 8 * sizeof *slots);
        if (cnt_next > 0) {
            chunk_slots(kv, t0 + 8, cnt_next, next);
            prefetch_rows(kv->v, next, cnt_next, kv0 * D, row_bytes, 1);
        }
        prefetch_far(kv, kv->v, t0, 8, n_max, kv0 * D, row_bytes);
        for (int kvh = kv0; kvh < kv1; kvh++) {
            const int h0 = (kvh - kv0) * group;
            for (int j = 0; j < cnt; j++)
                for (int c = 0; c < C; c++)
                    _mm256_storeu_ps(kbuf + j * D + c * 8, bf16x8(kv->v + slots[j] + kvh * D + c * 8));
            for (int r = 0; r < T; r++) {
                const int n = a->p0 + r + 1 < a->kb ? a->p0 + r + 1 : a->kb; /* (its keys' end here) */
                if (t0 >= n) continue;
                const int cnt_r = n - t0 < 8 ? n - t0 : 8;
                float *o = att_out(a, r) + kv0 * group * D;
                const float *s = scores + (size_t)(r * nh + h0) * span + (t0 - ka);
                for (int h = 0; h < group; h++) {
                    __m256 acc[FAST_CHUNKS8];
                    for (int c = 0; c < C; c++) acc[c] = _mm256_loadu_ps(o + (h0 + h) * D + c * 8);
                    for (int j = 0; j < cnt_r; j++) {
                        __m256 p = _mm256_set1_ps(s[(size_t)h * span + j]);
                        for (int c = 0; c < C; c++) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(kbuf + j * D + c * 8), acc[c]);
                    }
                    for (int c = 0; c < C; c++) _mm256_storeu_ps(o + (h0 + h) * D + c * 8, acc[c]);
                }
            }
        }
    }
    for (int r = 0; r < T; r++) {
        int end;
        if (!row_keys(a, r, &end)) continue;
        float *o = att_out(a, r) + kv0 * group * D;
        for (int i = 0; i < nh; i++) att_finish(a, r, kv0 * group + i, mx[r * nh + i], sum[r * nh + i], o + i * D, D);
    }
}
#define ATTEND_VEC attend_avx2
#define VEC_DIM_OK(D) ((D) % 8 == 0 && (D) / 8 <= FAST_CHUNKS8)
#endif

#if defined(ATTEND_VEC)
/* The vector path built for the common (query heads per kv head, head size) pairs: with both constant
 * the accumulators live in registers (with them known only at run time they live on the stack, and
 * attention took ~2x as long). */
typedef void (*attend_fn)(const att_rows *, const kv_view *, int, int, float *, float *);
#define ATTEND_FIXED(G, DD)                                                                                          \
    static void attend_g##G##_d##DD(const att_rows *a, const kv_view *kv, int kv0, int kv1, float *s, float *kb) { \
        ATTEND_VEC(a, G, DD, kv, kv0, kv1, s, kb);                                                                   \
    }
ATTEND_FIXED(1, 64)
ATTEND_FIXED(2, 64)
ATTEND_FIXED(3, 64)
ATTEND_FIXED(4, 64)
ATTEND_FIXED(1, 128)
ATTEND_FIXED(2, 128)
ATTEND_FIXED(3, 128)
ATTEND_FIXED(4, 128)
#endif

/* Attention of `a`'s rows for kv heads [kv0, kv1) (kv: the layer's cache at kv head 0); scratch:
 * scores [a->T * (kv1 - kv0) * group, the keys of its span: at most KEY_SPAN] and kbuf [16, D] floats. */
static void attend(const att_rows *a, int heads, int kv_heads, int D, const kv_view *kv, int kv0, int kv1,
                   float *scores, float *kbuf) {
    const int group = heads / kv_heads;
#if defined(ATTEND_VEC)
    if (VEC_DIM_OK(D) && group <= FAST_GROUP) {
        static const attend_fn d64[] = {attend_g1_d64, attend_g2_d64, attend_g3_d64, attend_g4_d64};
        static const attend_fn d128[] = {attend_g1_d128, attend_g2_d128, attend_g3_d128, attend_g4_d128};
        if (D == 64 || D == 128)
            (D == 64 ? d64 : d128)[group - 1](a, kv, kv0, kv1, scores, kbuf);
        else
            ATTEND_VEC(a, group, D, kv, kv0, kv1, scores, kbuf);
        return;
    }
#endif
    attend_rows_generic(a, group, D, kv, kv0, kv1, scores, kbuf);
}

/* The attention jobs of a step: a run of consecutive rows of one sequence at consecutive positions (a
 * prefill chunk) is cut into tiles of TILE_Q rows, one job per (tile, kv head); a single row (a decode)
 * is one job for all its kv heads when there are enough rows for every thread, else one per kv head.
 * A job takes all its rows' spans of keys in turn, or, in a plan "per span" (attention_per_span), each
 * span is a job of its own. Ordered by cost, the costliest first, for the threads to take in turn. */
typedef struct {
    int b, T, kv0, kv1, span0, span1; /* its keys: positions [span0, span1) x KEY_SPAN, a span at a time */
    int64_t cost;
} att_job;

static int by_cost_desc(const void *x, const void *y) {
    const int64_t a = ((const att_job *)x)->cost, b = ((const att_job *)y)->cost;
    return a < b ? 1 : a > b ? -1 : 0;
}

/* The next run of rows from b: consecutive rows of one sequence at consecutive positions, at most TILE_Q. */
static inline int row_run(int B, const int64_t *pos, const int32_t *row_seq, int b) {
    int T = 1;
    while (b + T < B && T < TILE_Q && row_seq[b + T] == row_seq[b] && pos[b + T] == pos[b] + T) T++;
    return T;
}

/* Whether a step's attention is planned a job per span of keys: only where its rows' jobs are fewer than
 * two per thread (each job's first keys are a cold start, so spans as jobs cost where jobs abound). */
static int attention_per_span(int B, const int64_t *pos, const int32_t *row_seq, int kv_heads, int nt) {
    int singles = 0, runs = 0;
    for (int b = 0, T; b < B; b += T) T = row_run(B, pos, row_seq, b), singles += T == 1, runs++;
    return (singles >= nt ? runs : runs * kv_heads) < 2 * nt;
}

/* Fills jobs (room for B * kv_heads, times the longest row's spans when per_span); returns how many, and in
 * *scratch the floats of scores one span of one job needs. */
static int attention_plan(int B, const int64_t *pos, const int32_t *row_seq, int kv_heads, int group, int nt,
                          int per_span, att_job *jobs, size_t *scratch) {
    int nj = 0, singles = 0;
    for (int b = 0, T; b < B; b += T) T = row_run(B, pos, row_seq, b), singles += T == 1;
    *scratch = 0;
    for (int b = 0, T; b < B; b += T) {
        T = row_run(B, pos, row_seq, b);
        const int64_t n = pos[b] + T, keys = n < KEY_SPAN ? n : KEY_SPAN; /* (the most of one span: the scores' room) */
        const int spans = key_spans(n), step = per_span ? 1 : spans;
        for (int c = 0; c < spans; c += step) {
            const int64_t left = n - (int64_t)c * KEY_SPAN, cost = per_span ? (left < KEY_SPAN ? left : KEY_SPAN) : n;
            if (T == 1 && singles >= nt) {
                jobs[nj++] = (att_job){b, 1, 0, kv_heads, c, c + step, cost * kv_heads};
                *scratch = (size_t)keys * kv_heads * group > *scratch ? (size_t)keys * kv_heads * group : *scratch;
            } else {
                for (int h = 0; h < kv_heads; h++) jobs[nj++] = (att_job){b, T, h, h + 1, c, c + step, cost * T};
                *scratch = (size_t)keys * T * group > *scratch ? (size_t)keys * T * group : *scratch;
            }
        }
    }
    qsort(jobs, (size_t)nj, sizeof *jobs, by_cost_desc);
    return nj;
}

/* The longest row's spans of keys (for a per-span plan's and its partial rows' room). */
static int most_spans(int B, const int64_t *pos) {
    int64_t n = 1;
    for (int b = 0; b < B; b++) n = pos[b] + 1 > n ? pos[b] + 1 : n;
    return key_spans(n);
}

/* One thread's floats for jobs whose scores need `scores`: the scores, a block of widened keys, then a
 * span's partial rows [TILE_Q, heads, D] with their (max, sum) [TILE_Q, heads, 2] and the rows' running
 * (max, sum), for whole-row jobs' rows split over spans. */
static size_t att_scratch_floats(size_t scores, int heads, int D) {
    return (scores + 16 * (size_t)D + (size_t)TILE_Q * heads * (D + 4) + 15) / 16 * 16;
}

/* Runs one job. rows: its T rows' queries and outputs (q, out, strides, T, p0; the rest is set here).
 * part, ml: in a per-span plan, the job's first row's partial outputs [spans, heads, D] and (max, sum)
 * [spans, heads, 2], rows `spans` of them apart (merge_row folds them after every job); NULL: a whole-row
 * job, which folds each span into its rows' outputs as it ends and divides them at the end.
 * scr: the thread's att_scratch_floats(n_scores, ...). */
static void attention_job(const att_job *job, const att_rows *rows, int heads, int kv_heads, int D, const kv_view *kv,
                          float *part, float *ml, int spans, float *scr, size_t n_scores) {
    const int q_n = heads * D, group = heads / kv_heads, h0 = job->kv0 * group, h1 = job->kv1 * group;
    float *scores = scr, *kbuf = scr + n_scores, *tpart = kbuf + 16 * D, *tml = tpart + (size_t)TILE_Q * q_n;
    float *run = tml + (size_t)TILE_Q * 2 * heads; /* the rows' running (max, sum) per head */
    for (int sp = job->span0; sp < job->span1; sp++) {
        att_rows a = *rows;
        a.ka = sp * KEY_SPAN, a.kb = a.ka + KEY_SPAN, a.pf_end = job->span1 * KEY_SPAN, a.cold = sp == job->span0;
        if (part) /* (kept for merge_row) */
            a.part = part + (size_t)sp * q_n, a.part_stride = spans * q_n, a.ml = ml + (size_t)sp * 2 * heads,
            a.ml_stride = spans * 2 * heads;
        else if (sp == 0) /* (the first span's partial is the running output) */
            a.part = a.out, a.part_stride = a.out_stride, a.ml = run, a.ml_stride = 2 * heads;
        else
            a.part = tpart, a.part_stride = q_n, a.ml = tml, a.ml_stride = 2 * heads;
        attend(&a, heads, kv_heads, D, kv, job->kv0, job->kv1, scores, kbuf);
        if (part || sp == 0) continue;
        for (int r = 0; r < a.T; r++)
            for (int h = h0; h < h1 && a.p0 + r + 1 > a.ka; h++) /* (rows with keys in this span) */
                fold_span(a.out + (size_t)r * a.out_stride + h * D, run + (size_t)r * 2 * heads + 2 * h,
                          tpart + (size_t)r * q_n + h * D, tml + (size_t)r * 2 * heads + 2 * h, D);
    }
    if (part) return;
    for (int r = 0; r < rows->T; r++)
        if (rows->p0 + r + 1 > KEY_SPAN)
            for (int h = h0; h < h1; h++)
                fold_finish(rows->out + (size_t)r * rows->out_stride + h * D, run + (size_t)r * 2 * heads + 2 * h, D);
}

/* A row's output out [heads, D] from its n_spans partials part [spans, heads, D] and (max, sum)
 * ml [spans, heads, 2] (a per-span plan's), folded in order as a whole-row job folds them. */
static void merge_row(int heads, int D, int n_spans, const float *part, const float *ml, float *out) {
    const size_t q_n = (size_t)heads * D;
    for (int h = 0; h < heads; h++) {
        float run[2] = {ml[2 * h], ml[2 * h + 1]}, *o = out + (size_t)h * D;
        memcpy(o, part + (size_t)h * D, (size_t)D * sizeof *o);
        for (int c = 1; c < n_spans; c++) fold_span(o, run, part + c * q_n + (size_t)h * D, ml + ((size_t)c * heads + h) * 2, D);
        fold_finish(o, run, D);
    }
}
