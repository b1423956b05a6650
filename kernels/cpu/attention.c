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
 * One job: T consecutive rows of one sequence (positions p0 .. p0 + T - 1: rows of a prefill chunk, or
 * T = 1 for a decode) against that sequence's cached keys and values, for kv heads [kv0, kv1); row r
 * attends to positions 0 .. p0 + r. Every query vector gets the same arithmetic whatever T is (its
 * scores as blocks of keys, lane-wise FMAs summed across lanes; a two-pass softmax; values added key
 * by key), so a row's attention is bit-identical in a decode step and in any prefill chunk: chunking
 * and batching change nothing. Tiles exist for speed: a block of keys (and of values) is widened to
 * fp32 once into L1 and read there by all T x group query vectors, instead of being fetched from the
 * cache and widened again for every row. */
typedef struct {
    const float *q; /* row r's query heads: q + r * q_stride, [heads, D] */
    float *out; /* row r's output: out + r * out_stride, [heads, D] */
    int q_stride, out_stride, T, p0;
} att_rows;

#define TILE_Q 16 /* rows of one prefill chunk per attention job */

/* Plain C: every head size and group (a row's keys widened once per position, read by its heads). */
static void attend_rows_generic(const att_rows *a, int group, int D, const kv_view *kv, int kv0, int kv1,
                                float *scores, float *kbuf) {
    const float scale = 1.0f / sqrtf((float)D);
    const int nh = (kv1 - kv0) * group, n_max = a->p0 + a->T;
    int64_t slots[16];
    for (int r = 0; r < a->T; r++) {
        const int n = a->p0 + r + 1;
        const float *q = a->q + (size_t)r * a->q_stride;
        float *out = a->out + (size_t)r * a->out_stride;
        for (int kvh = kv0; kvh < kv1; kvh++) {
            float mx[256], *s = scores + (size_t)(r * nh + (kvh - kv0) * group) * n_max;
            for (int h = 0; h < group; h++) mx[h] = -INFINITY;
            for (int t = 0; t < n; t++) {
                if (t % 16 == 0) chunk_slots(kv, t, n - t < 16 ? n - t : 16, slots);
                bf16_to_f32_row(kv->k + slots[t % 16] + kvh * D, kbuf, D);
                for (int h = 0; h < group; h++) {
                    const float *qh = q + (kvh * group + h) * D;
                    float acc = 0;
                    for (int i = 0; i < D; i++) acc += qh[i] * kbuf[i];
                    s[h * n_max + t] = acc * scale;
                    mx[h] = s[h * n_max + t] > mx[h] ? s[h * n_max + t] : mx[h];
                }
            }
            float sum[256];
            for (int h = 0; h < group; h++) sum[h] = exp_shifted(s + h * n_max, n, mx[h]);
            float *o = out + kvh * group * D;
            for (int i = 0; i < group * D; i++) o[i] = 0;
            for (int t = 0; t < n; t++) {
                if (t % 16 == 0) chunk_slots(kv, t, n - t < 16 ? n - t : 16, slots);
                bf16_to_f32_row(kv->v + slots[t % 16] + kvh * D, kbuf, D);
                for (int h = 0; h < group; h++) {
                    const float p = s[h * n_max + t];
                    for (int i = 0; i < D; i++) o[h * D + i] += p * kbuf[i];
                }
            }
            for (int h = 0; h < group; h++)
                for (int i = 0; i < D; i++) o[h * D + i] *= 1.0f / sum[h];
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

/* A job's first PF_LEAD positions, to L2 at once (the far prefetch's lead for them). */
static inline void prefetch_start(const kv_view *kv, const uint16_t *base, int step, int n_max, int off, int bytes) {
    for (int t = -PF_LEAD; t < 0; t += step) prefetch_far(kv, base, t, step, n_max, off, bytes);
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
    const int C = D / 16, nh = (kv1 - kv0) * group, T = a->T, n_max = a->p0 + T;
    const float scale = 1.0f / sqrtf((float)D);
    float mx[MAX_HEADS], sum[MAX_HEADS]; /* T * nh of them: T = 1, or one kv head of a tile */
    const int row_bytes = (kv1 - kv0) * D * 2; /* of one position's keys (or values) that we read */
    int64_t slots[16], next[16];
    for (int i = 0; i < T * nh; i++) mx[i] = -INFINITY;
    __m512 part[FAST_GROUP][16];
    prefetch_start(kv, kv->k, 16, n_max, kv0 * D, row_bytes);
    chunk_slots(kv, 0, n_max < 16 ? n_max : 16, next);
    for (int t0 = 0; t0 < n_max; t0 += 16) {
        const int cnt = n_max - t0 < 16 ? n_max - t0 : 16, cnt_next = n_max - t0 - 16 < 16 ? n_max - t0 - 16 : 16;
        memcpy(slots, next, sizeof slots);
        if (cnt_next > 0) {
            chunk_slots(kv, t0 + 16, cnt_next, next);
            prefetch_rows(kv->k, next, cnt_next, kv0 * D, row_bytes, 1); /* the next keys, to L1 */
        }
        prefetch_far(kv, kv->k, t0, 16, n_max, kv0 * D, row_bytes);
        prefetch_rows(kv->v, slots, cnt, kv0 * D, row_bytes, 0); /* these values, to L2 */
        for (int kvh = kv0; kvh < kv1; kvh++) {
            if (T > 1) /* widen the block's keys once for all the tile's rows */
                for (int j = 0; j < cnt; j++)
                    for (int c = 0; c < C; c++)
                        _mm512_storeu_ps(kbuf + j * D + c * 16, bf16x16(kv->k + slots[j] + kvh * D + c * 16));
            for (int r = 0; r < T; r++) {
                const int n = a->p0 + r + 1;
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
                    _mm512_mask_storeu_ps(scores + (size_t)i * n_max + t0, valid, sc);
                    float m = _mm512_mask_reduce_max_ps(valid, sc);
                    mx[i] = m > mx[i] ? m : mx[i];
                }
            }
        }
    }
    for (int i = 0; i < T * nh; i++) sum[i] = exp_shifted(scores + (size_t)i * n_max, a->p0 + i / nh + 1, mx[i]);
    for (int r = 0; r < T; r++) {
        float *o = a->out + (size_t)r * a->out_stride + kv0 * group * D;
        for (int i = 0; i < nh * D; i++) o[i] = 0;
    }
    chunk_slots(kv, 0, n_max < 16 ? n_max : 16, next);
    for (int t0 = 0; t0 < n_max; t0 += 16) {
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
                const int n = a->p0 + r + 1;
                if (t0 >= n) continue;
                const int cnt_r = n - t0 < 16 ? n - t0 : 16;
                float *o = a->out + (size_t)r * a->out_stride + kv0 * group * D;
                const float *s = scores + (size_t)(r * nh + h0) * n_max + t0;
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
                        __m512 p = _mm512_set1_ps(s[(size_t)h * n_max + j]);
                        for (int c = 0; c < C; c++) acc[h][c] = _mm512_fmadd_ps(p, vf[c], acc[h][c]);
                    }
                }
                for (int h = 0; h < group; h++)
                    for (int c = 0; c < C; c++) _mm512_storeu_ps(o + (h0 + h) * D + c * 16, acc[h][c]);
            }
        }
    }
    for (int r = 0; r < T; r++) {
        float *o = a->out + (size_t)r * a->out_stride + kv0 * group * D;
        for (int i = 0; i < nh; i++) {
            __m512 inv = _mm512_set1_ps(1.0f / sum[r * nh + i]);
            for (int c = 0; c < C; c++)
                _mm512_storeu_ps(o + i * D + c * 16, _mm512_mul_ps(_mm512_loadu_ps(o + i * D + c * 16), inv));
        }
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
    const int C = D / 8, nh = (kv1 - kv0) * group, T = a->T, n_max = a->p0 + T;
    const float scale = 1.0f / sqrtf((float)D);
    float mx[MAX_HEADS], sum[MAX_HEADS];
    const int row_bytes = (kv1 - kv0) * D * 2;
    int64_t slots[16], next[16];
    for (int i = 0; i < T * nh; i++) mx[i] = -INFINITY;
    __m256 part[FAST_GROUP][8];
    prefetch_start(kv, kv->k, 8, n_max, kv0 * D, row_bytes);
    chunk_slots(kv, 0, n_max < 8 ? n_max : 8, next);
    for (int t0 = 0; t0 < n_max; t0 += 8) {
        const int cnt = n_max - t0 < 8 ? n_max - t0 : 8, cnt_next = n_max - t0 - 8 < 8 ? n_max - t0 - 8 : 8;
        memcpy(slots, next, 8 * sizeof *slots);
        if (cnt_next > 0) {
            chunk_slots(kv, t0 + 8, cnt_next, next);
            prefetch_rows(kv->k, next, cnt_next, kv0 * D, row_bytes, 1);
        }
        prefetch_far(kv, kv->k, t0, 8, n_max, kv0 * D, row_bytes);
        prefetch_rows(kv->v, slots, cnt, kv0 * D, row_bytes, 0);
        for (int kvh = kv0; kvh < kv1; kvh++) {
            for (int j = 0; j < cnt; j++)
                for (int c = 0; c < C; c++)
                    _mm256_storeu_ps(kbuf + j * D + c * 8, bf16x8(kv->k + slots[j] + kvh * D + c * 8));
            for (int r = 0; r < T; r++) {
                const int n = a->p0 + r + 1;
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
                    memcpy(scores + (size_t)i * n_max + t0, tmp, (size_t)cnt_r * sizeof(float));
                    float m = hmax8_masked(sc, cnt_r);
                    mx[i] = m > mx[i] ? m : mx[i];
                }
            }
        }
    }
    for (int i = 0; i < T * nh; i++) sum[i] = exp_shifted(scores + (size_t)i * n_max, a->p0 + i / nh + 1, mx[i]);
    for (int r = 0; r < T; r++) {
        float *o = a->out + (size_t)r * a->out_stride + kv0 * group * D;
        for (int i = 0; i < nh * D; i++) o[i] = 0;
    }
    chunk_slots(kv, 0, n_max < 8 ? n_max : 8, next);
    for (int t0 = 0; t0 < n_max; t0 += 8) {
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
                const int n = a->p0 + r + 1;
                if (t0 >= n) continue;
                const int cnt_r = n - t0 < 8 ? n - t0 : 8;
                float *o = a->out + (size_t)r * a->out_stride + kv0 * group * D;
                const float *s = scores + (size_t)(r * nh + h0) * n_max + t0;
                for (int h = 0; h < group; h++) {
                    __m256 acc[FAST_CHUNKS8];
                    for (int c = 0; c < C; c++) acc[c] = _mm256_loadu_ps(o + (h0 + h) * D + c * 8);
                    for (int j = 0; j < cnt_r; j++) {
                        __m256 p = _mm256_set1_ps(s[(size_t)h * n_max + j]);
                        for (int c = 0; c < C; c++) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(kbuf + j * D + c * 8), acc[c]);
                    }
                    for (int c = 0; c < C; c++) _mm256_storeu_ps(o + (h0 + h) * D + c * 8, acc[c]);
                }
            }
        }
    }
    for (int r = 0; r < T; r++) {
        float *o = a->out + (size_t)r * a->out_stride + kv0 * group * D;
        for (int i = 0; i < nh; i++) {
            __m256 inv = _mm256_set1_ps(1.0f / sum[r * nh + i]);
            for (int c = 0; c < C; c++)
                _mm256_storeu_ps(o + i * D + c * 8, _mm256_mul_ps(_mm256_loadu_ps(o + i * D + c * 8), inv));
        }
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
 * scores [a->T * (kv1 - kv0) * group, a->p0 + a->T] and kbuf [16, D] floats. */
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
 * Ordered by cost, the costliest first, for the threads to take in turn. */
typedef struct {
    int b, T, kv0, kv1;
    int64_t cost;
} att_job;

static int by_cost_desc(const void *x, const void *y) {
    const int64_t a = ((const att_job *)x)->cost, b = ((const att_job *)y)->cost;
    return a < b ? 1 : a > b ? -1 : 0;
}

/* Fills jobs (room for B * kv_heads); returns how many, and in *scratch the floats of scores one job needs. */
static int attention_plan(int B, const int64_t *pos, const int32_t *row_seq, int kv_heads, int group, int nt,
                          att_job *jobs, size_t *scratch) {
    int nj = 0, singles = 0;
    for (int b = 0; b < B;) {
        int T = 1;
        while (b + T < B && T < TILE_Q && row_seq[b + T] == row_seq[b] && pos[b + T] == pos[b] + T) T++;
        singles += T == 1;
        b += T;
    }
    *scratch = 0;
    for (int b = 0; b < B;) {
        int T = 1;
        while (b + T < B && T < TILE_Q && row_seq[b + T] == row_seq[b] && pos[b + T] == pos[b] + T) T++;
        const int64_t n = pos[b] + T;
        if (T == 1 && singles >= nt) {
            jobs[nj++] = (att_job){b, 1, 0, kv_heads, n * kv_heads};
            *scratch = (size_t)n * kv_heads * group > *scratch ? (size_t)n * kv_heads * group : *scratch;
        } else {
            for (int h = 0; h < kv_heads; h++) jobs[nj++] = (att_job){b, T, h, h + 1, n * T};
            *scratch = (size_t)n * T * group > *scratch ? (size_t)n * T * group : *scratch;
        }
        b += T;
    }
    qsort(jobs, (size_t)nj, sizeof *jobs, by_cost_desc);
    return nj;
}

