/* Sampling on the CPU, row by row (kernels/sampling.py's sample_tokens).
 * Part of the native CPU step, compiled as one unit by forward.c (see there). */

/* ---- sampling: kernels/sampling.py's `sample_tokens`, row by row on the CPU ----
 *
 * The same semantics and the same noise: temperature 0 is greedy (the first maximum); otherwise the
 * exponential race argmax p_i / q_i, q_i = -log(u_i), with u_i a counter-based hash of (row seed, row
 * offset, token index), over the tokens kept by top-k (k highest) and top-p (the sorted prefix whose
 * mass before each token is < top_p, the mass of the whole distribution). Where torch draws and sorts
 * 49k values per row, this keeps the few hundred best candidates of a row (all tokens only when the
 * nucleus is wider than that) and computes noise only for the tokens it races. */

static inline uint32_t mix32(uint32_t x) { /* lowbias32 (Chris Wellons) */
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    return x ^ (x >> 16);
}

static inline uint32_t noise_key(int64_t seed, int64_t offset) {
    uint32_t key = mix32((uint32_t)seed ^ 0x9E3779B9U);
    key = mix32(key ^ (uint32_t)((uint64_t)seed >> 32));
    key = mix32(key ^ (uint32_t)offset);
    return mix32(key ^ (uint32_t)((uint64_t)offset >> 32) ^ 0x85EBCA6BU);
}

static inline float noise_uniform(uint32_t key, uint32_t col) { /* in (0, 1), as uniform_noise: 23 bits, */
    uint32_t x = mix32(mix32(key ^ col) ^ 0x27D4EB2FU);     /* so the largest value stays below 1.0 */
    return ((float)(x >> 9) + 0.5f) * (1.0f / 8388608.0f);
}

#define SAMPLE_CANDIDATES 512 /* best tokens kept per row before falling back to all of them */

typedef struct {
    float v;
    int32_t i;
} scored;

static int by_value_desc(const void *a, const void *b) {
    const scored *x = a, *y = b;
    if (x->v != y->v) return x->v > y->v ? -1 : 1;
    return x->i < y->i ? -1 : x->i > y->i; /* equal values: the lower index first */
}

/* The `k` largest of s[0..n) into out (unordered), k <= SAMPLE_CANDIDATES: a min-heap of the best. */
static int best_k(const float *s, int n, int k, scored *out) {
    int m = 0;
    for (int i = 0; i < n; i++) {
        const float v = s[i];
        if (m < k) { /* sift up */
            int j = m++;
            while (j > 0 && out[(j - 1) / 2].v > v) out[j] = out[(j - 1) / 2], j = (j - 1) / 2;
            out[j] = (scored){v, i};
        } else if (v > out[0].v) { /* replace the smallest, sift down */
            int j = 0;
            for (;;) {
                int c = 2 * j + 1;
                if (c >= k) break;
                if (c + 1 < k && out[c + 1].v < out[c].v) c++;
                if (out[c].v >= v) break;
                out[j] = out[c], j = c;
            }
            out[j] = (scored){v, i};
        }
    }
    return m;
}

#if defined(__AVX512F__)
static inline __m512i mix32x16(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x7feb352dU));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x846ca68bU));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

static inline __m512 log16(__m512 x) { /* natural log for x > 0 (Cephes logf: about 1 ulp) */
    const __m512i bits = _mm512_castps_si512(x);
    __m512 e = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(126)));
    __m512 m = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(bits, _mm512_set1_epi32(0x007fffff)),
                                                   _mm512_set1_epi32(0x3f000000))); /* [0.5, 1) */
    const __mmask16 small = _mm512_cmp_ps_mask(m, _mm512_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
    e = _mm512_mask_sub_ps(e, small, e, _mm512_set1_ps(1.0f));
    m = _mm512_sub_ps(_mm512_mask_add_ps(m, small, m, m), _mm512_set1_ps(1.0f));
    const __m512 z = _mm512_mul_ps(m, m);
    __m512 y = _mm512_set1_ps(7.0376836292e-2f);
    y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(-1.1514610310e-1f));
    y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(1.1676998740e-1f));
    y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(-1.2420140846e-1f));
    y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(1.4249322787e-1f));
    y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(-1.6668057665e-1f));
    y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(2.0000714765e-1f));
    y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(-2.4999993993e-1f));
    y = _mm512_fmadd_ps(y, m, _mm512_set1_ps(3.3333331174e-1f));
    y = _mm512_mul_ps(_mm512_mul_ps(y, m), z);
    y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
    y = _mm512_fnmadd_ps(z, _mm512_set1_ps(0.5f), y);
    return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), _mm512_add_ps(m, y));
}
#endif

/* work[i] = logits[i] * inv_t; returns their maximum. */
static float scale_row(const float *logits, int V, float inv_t, float *work) {
    int i = 0;
    float mx = -INFINITY;
#if defined(__AVX512F__)
    __m512 m = _mm512_set1_ps(-INFINITY), it = _mm512_set1_ps(inv_t);
    for (; i + 16 <= V; i += 16) {
        __m512 w = _mm512_mul_ps(_mm512_loadu_ps(logits + i), it);
        _mm512_storeu_ps(work + i, w);
        m = _mm512_max_ps(m, w);
    }
    mx = _mm512_reduce_max_ps(m);
#endif
    for (; i < V; i++) {
        work[i] = logits[i] * inv_t;
        mx = work[i] > mx ? work[i] : mx;
    }
    return mx;
}

/* sum_i exp(work[i] - mx): the distribution's mass before normalisation. */
static double row_mass(const float *work, int V, float mx) {
    int i = 0;
    double total = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps(), mv = _mm512_set1_ps(mx);
    for (; i + 16 <= V; i += 16) acc = _mm512_add_ps(acc, exp16(_mm512_sub_ps(_mm512_loadu_ps(work + i), mv)));
    total = _mm512_reduce_add_ps(acc);
#endif
    for (; i < V; i++) total += fast_exp(work[i] - mx);
    return total;
}

/* The race over every token: argmax exp(work[i] - mx) / -log(u_i) (the first, on equal scores). */
static int race_all(const float *work, int V, float mx, uint32_t key) {
    int i = 0, best = 0;
    float best_score = -1;
#if defined(__AVX512F__)
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512 top = _mm512_set1_ps(-1.0f);
    __m512i top_i = _mm512_set1_epi32(-1);
    const __m512 mv = _mm512_set1_ps(mx);
    for (; i + 16 <= V; i += 16) {
        const __m512i col = _mm512_add_epi32(_mm512_set1_epi32(i), lanes);
        __m512i x = mix32x16(_mm512_xor_si512(mix32x16(_mm512_xor_si512(_mm512_set1_epi32((int)key), col)),
                                              _mm512_set1_epi32(0x27D4EB2F)));
        __m512 u = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(x, 9)), _mm512_set1_ps(0.5f)),
                                 _mm512_set1_ps(1.0f / 8388608.0f));
        __m512 score = _mm512_div_ps(exp16(_mm512_sub_ps(_mm512_loadu_ps(work + i), mv)),
                                     _mm512_sub_ps(_mm512_setzero_ps(), log16(u)));
        const __mmask16 better = _mm512_cmp_ps_mask(score, top, _CMP_GT_OQ);
        top = _mm512_mask_mov_ps(top, better, score);
        top_i = _mm512_mask_mov_epi32(top_i, better, col);
    }
    float tv[16];
    int32_t ti[16];
    _mm512_storeu_ps(tv, top);
    _mm512_storeu_si512(ti, top_i);
    for (int l = 0; l < 16; l++)
        if (ti[l] >= 0 && (tv[l] > best_score || (tv[l] == best_score && ti[l] < best))) best_score = tv[l], best = ti[l];
#endif
    for (; i < V; i++) {
        const float score = fast_exp(work[i] - mx) / -logf(noise_uniform(key, (uint32_t)i));
        if (score > best_score) best_score = score, best = i;
    }
    return best;
}

/* The index of the first maximum of x[0..n) (greedy decoding). */
static int argmax_row(const float *x, int n) {
    float mx = -INFINITY;
    int i = 0;
#if defined(__AVX512F__)
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
    mx = _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
    /* (the scalar loop: 0.15 ms of a 128k vocabulary's greedy row, 0.4% of the 1B shape's AVX2 decode step) */
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4E));
    mx = _mm_cvtss_f32(_mm256_castps256_ps128(_mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xB1))));
#endif
    for (; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    i = 0;
#if defined(__AVX512F__)
    const __m512 mv = _mm512_set1_ps(mx);
    for (; i + 16 <= n; i += 16) {
        __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), mv, _CMP_EQ_OQ);
        if (eq) return i + __builtin_ctz(eq);
    }
#elif defined(__AVX2__)
    const __m256 mv = _mm256_set1_ps(mx);
    for (; i + 8 <= n; i += 8) {
        const int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), mv, _CMP_EQ_OQ));
        if (eq) return i + __builtin_ctz((unsigned)eq);
    }
#endif
    for (; i < n; i++)
        if (x[i] == mx) return i;
    return 0; /* (every value NaN) */
}

/* A monotone integer image of a float (larger float, larger key), to search values by bisection. */
static inline uint32_t order_key(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u & 0x80000000U ? ~u : u | 0x80000000U;
}

/* Over the tokens with order_key(work[i]) > kappa: their count, and their mass sum e[i] (e: exp(work - mx)). */
static double mass_above(const float *work, const float *e, int V, uint32_t kappa, int *count) {
    int i = 0, n = 0;
    double total = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    const __m512i kv = _mm512_set1_epi32((int)kappa), sign = _mm512_set1_epi32((int)0x80000000U);
    for (; i + 16 <= V; i += 16) {
        __m512i u = _mm512_loadu_si512(work + i);
        __m512i key = _mm512_xor_si512(u, _mm512_or_si512(_mm512_srai_epi32(u, 31), sign));
        __mmask16 m = _mm512_cmpgt_epu32_mask(key, kv);
        acc = _mm512_mask_add_ps(acc, m, acc, _mm512_loadu_ps(e + i));
        n += __builtin_popcount(m);
    }
    total = _mm512_reduce_add_ps(acc);
#endif
    for (; i < V; i++)
        if (order_key(work[i]) > kappa) total += e[i], n++;
    *count = n;
    return total;
}

/* Top-p (and top-k) over every token, for nuclei wider than SAMPLE_CANDIDATES: the boundary value found
 * by bisection on the values' keys (32 passes over the row) instead of a sort. Kept, as in sorted order
 * with equal values by index: every token above the boundary, then tokens at it while the mass before
 * stays below `mass` and the rank below k. Then the race over the kept tokens. e: V floats of scratch. */
static int64_t wide_nucleus(const float *work, int V, float mx, int k, double mass, uint32_t key, float *e) {
    for (int i = 0; i < V; i++) e[i] = fast_exp(work[i] - mx);
    /* the smallest kappa whose tokens above weigh < mass (top-p), or number < k (top-k) */
    uint32_t lo = 0, hi = 0xFFFFFFFFU;
    while (lo < hi) {
        const uint32_t mid = lo + (hi - lo) / 2;
        int n;
        const double above = mass_above(work, e, V, mid, &n);
        if (above < mass && n < k)
            hi = mid;
        else
            lo = mid + 1;
    }
    int rank;
    double before = mass_above(work, e, V, lo, &rank);
    int best = -1;
    float best_score = -1;
    for (int i = 0; i < V; i++) {
        const uint32_t kk = order_key(work[i]);
        int keep = kk > lo;
        if (kk == lo && rank < k && (rank == 0 || before < mass)) keep = 1, before += e[i], rank++;
        if (!keep) continue;
        const float score = e[i] / -logf(noise_uniform(key, (uint32_t)i));
        if (score > best_score) best_score = score, best = i;
    }
    return best;
}

/* One row: the token, given its logits, parameters and noise key. `work`: V floats and V scored of scratch. */
static int64_t sample_row(const float *logits, int V, float temperature, int64_t top_k, float top_p, uint32_t key,
                          float *work, scored *cand) {
    if (temperature == 0) return argmax_row(logits, V);
    const float mx = scale_row(logits, V, 1.0f / (temperature > 1e-5f ? temperature : 1e-5f), work);
    const int k = top_k > 0 && top_k < V ? (int)top_k : V;
    if (k == V && !(top_p < 1.0f)) return race_all(work, V, mx, key); /* no filter: race every token */
    /* the distribution's mass, for top-p: over every token (as torch's softmax of the sorted logits) */
    const double total = row_mass(work, V, mx);
    int n = k < SAMPLE_CANDIDATES ? k : SAMPLE_CANDIDATES;
    n = best_k(work, V, n, cand);
    qsort(cand, n, sizeof *cand, by_value_desc);
    int kept = 0;
    double before = 0;
    for (; kept < n; kept++) {
        if (kept > 0 && before / total >= top_p) break;
        before += fast_exp(cand[kept].v - mx);
    }
    if (kept == n && n < k && before / total < top_p) /* a nucleus wider than the candidates */
        return wide_nucleus(work, V, mx, k, top_p * total, key, (float *)cand);
    int best = cand[0].i;
    float best_score = -1;
    for (int j = 0; j < kept; j++) {
        const float score = fast_exp(cand[j].v - mx) / -logf(noise_uniform(key, (uint32_t)cand[j].i));
        if (score > best_score) best_score = score, best = cand[j].i;
    }
    return best;
}

typedef struct {
    int B, V, nthreads;
    const float *logits, *temperature, *top_p;
    const int64_t *top_k, *seeds, *offsets;
    int64_t *out;
    float *work;
    scored *cand;
} sample_ctx;

static void run_sample(void *arg, int tid) {
    sample_ctx *c = arg;
    if (tid >= c->nthreads) return;
    float *work = c->work + (size_t)tid * c->V;
    scored *cand = c->cand + (size_t)tid * c->V;
    for (int b = tid; b < c->B; b += c->nthreads)
        c->out[b] = sample_row(c->logits + (size_t)b * c->V, c->V, c->temperature[b], c->top_k[b], c->top_p[b],
                               noise_key(c->seeds[b], c->offsets[b]), work, cand);
}

/* out[b]: the token of row b of logits [B, V] (see above). Returns 0, or -1 when out of memory. */
int sluice_sample(int B, int V, const float *logits, const float *temperature, const int64_t *top_k,
                  const float *top_p, const int64_t *seeds, const int64_t *offsets, int64_t *out, int nthreads) {
    if (B <= 0) return 0;
    pthread_mutex_lock(&step_lock);
    nthreads = nthreads < 1 ? 1 : ensure_workers(nthreads < B ? nthreads : B);
    float *work = malloc((size_t)nthreads * V * (sizeof(float) + sizeof(scored)));
    if (!work) {
        pthread_mutex_unlock(&step_lock);
        return -1;
    }
    sample_ctx c = {B, V, nthreads, logits, temperature, top_p, top_k, seeds, offsets, out, work,
                    (scored *)(work + (size_t)nthreads * V)};
    run_parallel(run_sample, &c, nthreads);
    free(work);
    pthread_mutex_unlock(&step_lock);
    return 0;
}

/* One row sampled under its grammar's token mask (bit i % 32 of mask[i / 32] set: token i allowed), for
 * rows that race every token (no top-k or top-p) or are greedy: exactly sample_row over the row with the
 * forbidden tokens at -inf (the same maximum, the same scores lane for lane, the lowest index on equal
 * scores), but only the 16-token groups holding an allowed token are computed. A mask is often a handful
 * of tokens (the grammar forces the next bytes), so this skips copying, masking and racing the vocabulary.
 * Returns -1 when the mask allows nothing. */
static int64_t sample_row_masked(const float *logits, int V, float temperature, const uint32_t *mask, uint32_t key) {
    const int groups = (V + 15) / 16;
    const float inv_t = 1.0f / (temperature > 1e-5f ? temperature : 1e-5f);
    float mx = -INFINITY;
    int best = -1;
    for (int g = 0; g < groups; g++) { /* greedy: the first maximum of the logits; else the scaled maximum */
        uint32_t bits = (mask[g / 2] >> (16 * (g % 2))) & 0xFFFFU;
        while (bits) {
            const int i = 16 * g + __builtin_ctz(bits);
            bits &= bits - 1;
            if (i >= V) break;
            const float w = temperature == 0 ? logits[i] : logits[i] * inv_t;
            if (best < 0 || w > mx) mx = w, best = i;
        }
    }
    if (temperature == 0 || best < 0) return best;
    float best_score = -1;
    best = -1;
    for (int g = 0; g < groups; g++) {
        uint32_t bits = (mask[g / 2] >> (16 * (g % 2))) & 0xFFFFU;
        if (!bits) continue;
        const int i0 = 16 * g;
        float score[16];
#if defined(__AVX512F__)
        if (i0 + 16 <= V) { /* race_all's vector body, for these 16 tokens */
            const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
            const __m512i col = _mm512_add_epi32(_mm512_set1_epi32(i0), lanes);
            __m512i x = mix32x16(_mm512_xor_si512(mix32x16(_mm512_xor_si512(_mm512_set1_epi32((int)key), col)),
                                                  _mm512_set1_epi32(0x27D4EB2F)));
            __m512 u = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(x, 9)), _mm512_set1_ps(0.5f)),
                                     _mm512_set1_ps(1.0f / 8388608.0f));
            const __m512 w = _mm512_mul_ps(_mm512_loadu_ps(logits + i0), _mm512_set1_ps(inv_t));
            _mm512_storeu_ps(score, _mm512_div_ps(exp16(_mm512_sub_ps(w, _mm512_set1_ps(mx))),
                                                  _mm512_sub_ps(_mm512_setzero_ps(), log16(u))));
        } else
#endif
        {
            for (int l = 0; l < 16 && i0 + l < V; l++)
                score[l] = fast_exp(logits[i0 + l] * inv_t - mx) / -logf(noise_uniform(key, (uint32_t)(i0 + l)));
        }
        while (bits) {
            const int l = __builtin_ctz(bits);
            bits &= bits - 1;
            if (i0 + l >= V) break;
            if (score[l] > best_score) best_score = score[l], best = i0 + l;
        }
    }
    return best;
}

/* out[r]: the token of logits row rows[r] under mask r (masks: [R, ceil(V / 32)] int32), as sluice_sample
 * would sample that row with its forbidden tokens at -inf; top-k and top-p must be off (the caller's rows
 * are greedy or plain temperature). On the calling thread: a step has a few such rows. Returns 0, or -1
 * when a mask allows no token. */
int sluice_sample_masked(int R, int V, const float *logits, const int64_t *rows, const int32_t *masks,
                         const float *temperature, const int64_t *seeds, const int64_t *offsets, int64_t *out) {
    const int words = (V + 31) / 32;
    for (int r = 0; r < R; r++) {
        out[r] = sample_row_masked(logits + (size_t)rows[r] * V, V, temperature[r],
                                   (const uint32_t *)masks + (size_t)r * words, noise_key(seeds[r], offsets[r]));
        if (out[r] < 0) return -1;
    }
    return 0;
}

