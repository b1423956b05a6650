/* A whole decode step of a Llama model in one call, for CPUs: every layer of B sequences that each
 * compute one new token (RMSNorm, Q4_1 matmuls, RoPE, KV-cache write, paged attention, SiLU-and-mul,
 * residual adds). Built at first use by kernels/cpu/build.py with the machine's own flags
 * (-march=native: AVX-512, AVX2 or plain C, chosen by the preprocessor below) and called via ctypes.
 *
 * Why it exists: a batch-1 decode step of a small model in eager torch is ~60 ops per layer, each a
 * few microseconds of dispatch, and torch's int4 matmul first widens the 4-bit codes to bf16. Here a
 * layer is a handful of loops over the GGUF's own 4-bit blocks, with the threads of a step kept
 * awake only while the step runs (a spin barrier between phases; they sleep between steps, so
 * nothing busy-waits while the server is idle).
 *
 * Numerics: activations, norms, RoPE, softmax and accumulations in fp32; the 4-bit weights are
 * dequantised exactly (q * d + m with the file's fp16 d and m); K/V are stored in the cache as bf16
 * (round to nearest even, as torch's .to(bfloat16)). Only the order of summation differs from the
 * torch path.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define GROUP 32

/* A Q4_1 matrix [N, K] as three arrays: per row, G = K / 32 groups of 16 bytes of codes (byte j of a
 * group: element j in the low nibble, element j + 16 in the high one), then each group's fp16 scale d
 * and min m (w = q * d + m), the GGUF's own values. */
typedef struct {
    const uint8_t *qs; /* [N, G, 16] */
    const uint16_t *d, *m; /* [N, G] */
} q4_matrix;

typedef struct {
    const float *attn_norm, *mlp_norm; /* [hidden] */
    q4_matrix qkv, o, gate_up, down;
    const float *qkv_bias; /* [q + 2 kv] or NULL */
} layer_weights;

typedef struct {
    int hidden, heads, kv_heads, head_dim, inter, layers, block_size;
    float eps;
} dims;

/* ---- scalar helpers ---- */

static inline float fp16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal */
            float f = (float)man * (1.0f / 16777216.0f);
            memcpy(&bits, &f, 4);
            bits |= sign;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* exp(x) for the softmax and SiLU: a range reduction and a degree-6 polynomial (about 2 ulp), written
 * so that the compiler vectorises the loops that call it. */
static inline float fast_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return p * scale;
}

/* ---- threads: a pool that wakes once per step and meets at spin barriers inside it ---- */

#define MAX_THREADS 64

typedef void (*job_fn)(void *arg, int tid);

typedef struct {
    pthread_mutex_t lock; /* guards generation, fn, arg */
    pthread_cond_t wake;
    int nthreads; /* workers started, plus the caller */
    int generation; /* bumped per job */
    job_fn fn;
    void *arg;
    atomic_int arrived, barrier_gen, done;
} pool_t;

static pool_t pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 1, 0, NULL, NULL, 0, 0, 0};
static pthread_t workers[MAX_THREADS];
static pthread_mutex_t step_lock = PTHREAD_MUTEX_INITIALIZER; /* one job at a time per process */
static int worker_ids[MAX_THREADS];

static void barrier(int n) {
    if (n <= 1) return;
    int gen = atomic_load_explicit(&pool.barrier_gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&pool.arrived, 1, memory_order_acq_rel) == n - 1) {
        atomic_store_explicit(&pool.arrived, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&pool.barrier_gen, 1, memory_order_acq_rel);
    } else {
        while (atomic_load_explicit(&pool.barrier_gen, memory_order_acquire) == gen) {
#if defined(__x86_64__)
            __builtin_ia32_pause();
#endif
        }
    }
}

static void *worker_main(void *arg) {
    int tid = *(int *)arg, seen = 0;
    for (;;) {
        pthread_mutex_lock(&pool.lock);
        while (pool.generation == seen) pthread_cond_wait(&pool.wake, &pool.lock);
        seen = pool.generation;
        job_fn fn = pool.fn;
        void *arg = pool.arg;
        pthread_mutex_unlock(&pool.lock);
        fn(arg, tid); /* returns at once for tids past the job's thread count */
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_acq_rel);
    }
    return NULL;
}

static int ensure_workers(int n) {
    if (n > MAX_THREADS) n = MAX_THREADS;
    while (pool.nthreads < n) {
        int tid = pool.nthreads;
        worker_ids[tid] = tid;
        if (pthread_create(&workers[tid], NULL, worker_main, &worker_ids[tid]) != 0) break;
        pthread_detach(workers[tid]);
        pool.nthreads++;
    }
    return n < pool.nthreads ? n : pool.nthreads;
}

/* Runs fn(arg, tid) on the caller (tid 0) and the workers; returns once every worker has left it. */
static void run_parallel(job_fn fn, void *arg, int nthreads) {
    if (nthreads > 1) {
        atomic_store(&pool.done, 0);
        pthread_mutex_lock(&pool.lock);
        pool.fn = fn;
        pool.arg = arg;
        pool.generation++;
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    fn(arg, 0);
    if (nthreads > 1)
        while (atomic_load_explicit(&pool.done, memory_order_acquire) < pool.nthreads - 1) {
#if defined(__x86_64__)
            __builtin_ia32_pause();
#endif
        }
}

/* ---- the matmul: y[b, r] = sum_k x[b, k] W[r, k] over Q4_1 rows, in integer dot products ----
 *
 * Each input row is quantised to int16 with one scale (dx = max|x| / 32767: an element 100 times smaller
 * than the row's largest still keeps ~8 significant bits, what the bf16 the torch path rounds
 * activations to keeps for every element; int8, as llama.cpp does, flipped greedy near-ties of the
 * reference test). A group's dot product is then integer multiply-adds (`vpdpwssd` / `vpmaddwd`) over
 * the 4-bit codes scaled by the group's dw, and the row's dx applies once at the end:
 * sum_i (q_i dw + mw) x_i ~= dx (sum_g dw_g sum_i q_i xq_i + sum_g mw_g sx_g / dx), the min term with
 * the exact fp32 sums sx of each group's inputs. Dequantising every weight to fp32 instead made the
 * step compute-bound at a third of the memory bandwidth; a scale per group of 32 inputs cost one more
 * multiply per group and row. */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAIRED 1 /* x is laid out per pair of groups: [g0 0-15 | g1 0-15 | g0 16-31 | g1 16-31] */
#else
#define PAIRED 0
#endif

#define ROWS_PER_PASS 8

typedef struct {
    int16_t *q; /* [B, K], in the layout the kernel reads */
    float *dx; /* [B]: each row's scale */
    float *sx; /* [B, G]: exact sums of each group's inputs, divided by the row's dx */
} qx_t;

/* Rows [b0, b1) of x [B, K] (threads quantise disjoint rows). */
static void quantize_x(const float *x, int K, qx_t *qx, int b0, int b1) {
    const int G = K / GROUP;
    for (int b = b0; b < b1; b++) {
        const float *row = x + (size_t)b * K;
        float amax = 0;
        for (int i = 0; i < K; i++) {
            float a = fabsf(row[i]);
            amax = a > amax ? a : amax;
        }
        const float d = amax / 32767.0f, id = amax > 0 ? 32767.0f / amax : 0.0f;
        qx->dx[b] = d;
        int16_t *dst = qx->q + (size_t)b * K;
        for (int g = 0; g < G; g++) {
            const float *p = row + g * GROUP;
            float sum = 0;
            int16_t q[GROUP];
            for (int j = 0; j < GROUP; j++) {
                sum += p[j];
                q[j] = (int16_t)lrintf(p[j] * id);
            }
            qx->sx[(size_t)b * G + g] = sum * id;
#if PAIRED
            if (g == G - 1 && G % 2) { /* an odd last group: natural order, read by the scalar tail */
                memcpy(dst + g * GROUP, q, sizeof q);
                continue;
            }
            int16_t *pair = dst + (g / 2) * 2 * GROUP;
            memcpy(pair + (g % 2) * 16, q, 16 * sizeof(int16_t));
            memcpy(pair + 32 + (g % 2) * 16, q + 16, 16 * sizeof(int16_t));
#else
            memcpy(dst + g * GROUP, q, sizeof q);
#endif
        }
    }
}

static inline float q4_group_scalar(const uint8_t *qs, const int16_t *xq) { /* natural-order x */
    int32_t s = 0;
    for (int j = 0; j < 16; j++) s += (qs[j] & 0xf) * xq[j] + (qs[j] >> 4) * xq[j + 16];
    return (float)s;
}

/* Rows [r0, r1) of W for nb <= ROWS_PER_PASS input rows (each weight decoded once for all of them). */
static inline __attribute__((always_inline)) void q4_rows(const q4_matrix *w, int K, int r0, int r1,
                                                          const qx_t *qx, int nb, float *y, int ldy) {
    const int G = K / GROUP;
    for (int r = r0; r < r1; r++) {
        const uint8_t *qs = w->qs + (size_t)r * G * 16;
        const uint16_t *dw = w->d + (size_t)r * G, *mw = w->m + (size_t)r * G;
        float out[ROWS_PER_PASS] = {0};
#if PAIRED
        const int P = G / 2;
        __m512 acc[ROWS_PER_PASS];
        for (int b = 0; b < nb; b++) acc[b] = _mm512_setzero_ps();
        const __m256i low = _mm256_set1_epi8(0xf);
        const __m512i lanes = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        for (int p = 0; p < P; p++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(qs + p * 32)); /* [g0 | g1] codes */
            __m512i wlo = _mm512_cvtepu8_epi16(_mm256_and_si256(v, low));
            __m512i whi = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low));
            int32_t d2;
            memcpy(&d2, dw + 2 * p, 4);
            __m512 dwv = _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(d2))));
            for (int b = 0; b < nb; b++) {
                const int16_t *xq = qx->q + (size_t)b * K + p * 64;
#if defined(__AVX512VNNI__)
                __m512i s = _mm512_dpwssd_epi32(_mm512_setzero_si512(), wlo, _mm512_loadu_si512(xq));
                s = _mm512_dpwssd_epi32(s, whi, _mm512_loadu_si512(xq + 32));
#else
                __m512i s = _mm512_add_epi32(_mm512_madd_epi16(wlo, _mm512_loadu_si512(xq)),
                                             _mm512_madd_epi16(whi, _mm512_loadu_si512(xq + 32)));
#endif
                acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), dwv, acc[b]);
            }
        }
        for (int g = 0; g < G; g += 16) { /* the min term, sum_g mw[g] * sx[g], in the same accumulators */
            __mmask16 k = G - g >= 16 ? 0xffff : (__mmask16)((1u << (G - g)) - 1);
            __m512 m16 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mw + g));
            for (int b = 0; b < nb; b++)
                acc[b] = _mm512_fmadd_ps(m16, _mm512_maskz_loadu_ps(k, qx->sx + (size_t)b * G + g), acc[b]);
        }
        for (int b = 0; b < nb; b++) out[b] = _mm512_reduce_add_ps(acc[b]);
        if (G % 2)
            for (int b = 0; b < nb; b++)
                out[b] += q4_group_scalar(qs + (G - 1) * 16, qx->q + (size_t)b * K + (G - 1) * GROUP) *
                          fp16_to_f32(dw[G - 1]);
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 acc[ROWS_PER_PASS];
        for (int b = 0; b < nb; b++) acc[b] = _mm256_setzero_ps();
        const __m128i low = _mm_set1_epi8(0xf);
        for (int g = 0; g < G; g++) {
            __m128i v = _mm_loadu_si128((const __m128i *)(qs + g * 16));
            __m256i wlo = _mm256_cvtepu8_epi16(_mm_and_si128(v, low));
            __m256i whi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), low));
            float d = fp16_to_f32(dw[g]);
            for (int b = 0; b < nb; b++) {
                const int16_t *xq = qx->q + (size_t)b * K + g * GROUP;
                __m256i s = _mm256_add_epi32(_mm256_madd_epi16(wlo, _mm256_loadu_si256((const __m256i *)xq)),
                                             _mm256_madd_epi16(whi, _mm256_loadu_si256((const __m256i *)(xq + 16))));
                acc[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d), acc[b]);
            }
        }
        int g8 = 0;
        for (; g8 + 8 <= G; g8 += 8) { /* the min term, sum_g mw[g] * sx[g], in the same accumulators */
            __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mw + g8)));
            for (int b = 0; b < nb; b++)
                acc[b] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(qx->sx + (size_t)b * G + g8), acc[b]);
        }
        for (; g8 < G; g8++)
            for (int b = 0; b < nb; b++) out[b] += fp16_to_f32(mw[g8]) * qx->sx[(size_t)b * G + g8];
        for (int b = 0; b < nb; b++) {
            __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[b]), _mm256_extractf128_ps(acc[b], 1));
            s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            out[b] += _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
        }
#else
        for (int g = 0; g < G; g++) {
            float d = fp16_to_f32(dw[g]);
            for (int b = 0; b < nb; b++)
                out[b] += q4_group_scalar(qs + g * 16, qx->q + (size_t)b * K + g * GROUP) * d;
        }
        for (int g = 0; g < G; g++) /* the min term */
            for (int b = 0; b < nb; b++) out[b] += fp16_to_f32(mw[g]) * qx->sx[(size_t)b * G + g];
#endif
        for (int b = 0; b < nb; b++) y[(size_t)b * ldy + r] = out[b] * qx->dx[b];
    }
}

/* This thread's share of y[B, N] = x[B, K] W^T (x quantised by quantize_x): rows split evenly. */
static void matmul(const q4_matrix *w, int N, int K, const qx_t *qx, int B, float *y, int tid, int nt) {
    int per = ((N + nt - 1) / nt + 15) / 16 * 16;
    int r0 = tid * per, r1 = r0 + per < N ? r0 + per : N;
    if (r0 >= r1) return;
    const int G = K / GROUP;
    for (int b0 = 0; b0 < B; b0 += ROWS_PER_PASS) {
        int nb = B - b0 < ROWS_PER_PASS ? B - b0 : ROWS_PER_PASS;
        qx_t part = {qx->q + (size_t)b0 * K, qx->dx + b0, qx->sx + (size_t)b0 * G};
        float *yb = y + (size_t)b0 * N;
        switch (nb) { /* a constant nb per call: the compiler keeps each row's accumulator in a register */
            case 1: q4_rows(w, K, r0, r1, &part, 1, yb, N); break;
            case 2: q4_rows(w, K, r0, r1, &part, 2, yb, N); break;
            case 3: q4_rows(w, K, r0, r1, &part, 3, yb, N); break;
            case 4: q4_rows(w, K, r0, r1, &part, 4, yb, N); break;
            case 5: q4_rows(w, K, r0, r1, &part, 5, yb, N); break;
            case 6: q4_rows(w, K, r0, r1, &part, 6, yb, N); break;
            case 7: q4_rows(w, K, r0, r1, &part, 7, yb, N); break;
            default: q4_rows(w, K, r0, r1, &part, 8, yb, N); break;
        }
    }
}

/* ---- the step ---- */

typedef struct step_ctx step_ctx;
struct step_ctx {
    const dims *dm;
    const layer_weights *layers;
    int B, nthreads;
    float *x; /* [B, hidden]: the residual stream */
    const int64_t *pos, *slots;
    const int32_t *tables, *seq_lens;
    int table_stride;
    uint16_t *kv;
    int64_t layer_stride, kv_stride;
    const float *cos, *sin;
    /* scratch */
    float *h, *qkv, *att, *gu, *act, *scores;
    qx_t qx; /* the current matmul's input, quantised */
    int max_ctx;
};

static void rms_norm_rows(const float *x, const float *w, float *out, int rows, int n, float eps) {
    for (int b = 0; b < rows; b++) {
        const float *xb = x + (size_t)b * n;
        float ss = 0;
        for (int i = 0; i < n; i++) ss += xb[i] * xb[i];
        float inv = 1.0f / sqrtf(ss / n + eps);
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

static inline float dot(const float *a, const float *b, int n) { /* n: a multiple of 16 */
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
#else
    float s = 0;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
#endif
}

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

static inline int64_t slot_of(const kv_view *kv, int t) {
    return ((int64_t)kv->table[t / kv->block_size] * kv->block_size + t % kv->block_size) * kv->slot_stride;
}

/* Plain C: every head size and group. */
static void attend_generic(const float *q, int group, int D, const kv_view *kv, int n, float *scores, float *out) {
    const float scale = 1.0f / sqrtf((float)D);
    float row[256], mx[256], sum[256];
    for (int h = 0; h < group; h++) mx[h] = -INFINITY, sum[h] = 0;
    for (int t = 0; t < n; t++) {
        bf16_to_f32_row(kv->k + slot_of(kv, t), row, D);
        for (int h = 0; h < group; h++) {
            float s = dot(q + h * D, row, D) * scale;
            scores[h * n + t] = s;
            mx[h] = s > mx[h] ? s : mx[h];
        }
    }
    for (int h = 0; h < group; h++) {
        float *sc = scores + h * n, m = mx[h], total = 0;
        for (int t = 0; t < n; t++) {
            sc[t] = fast_exp(sc[t] - m);
            total += sc[t];
        }
        sum[h] = total;
    }
    for (int i = 0; i < group * D; i++) out[i] = 0;
    for (int t = 0; t < n; t++) {
        bf16_to_f32_row(kv->v + slot_of(kv, t), row, D);
        for (int h = 0; h < group; h++) {
            float p = scores[h * n + t], *o = out + h * D;
            for (int i = 0; i < D; i++) o[i] += p * row[i];
        }
    }
    for (int h = 0; h < group; h++) {
        float inv = 1.0f / sum[h], *o = out + h * D;
        for (int i = 0; i < D; i++) o[i] *= inv;
    }
}

#if defined(__AVX512F__)
#define FAST_GROUP 4 /* query heads per kv head */
#define MAX_HEADS 256
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

/* AVX-512: keys in chunks of 16 positions; within a chunk every kv head in [kv0, kv1) in turn (a
 * cache slot holds all kv heads side by side, so a chunk's rows stay in L1 while its heads are read);
 * each key widened once for the group's query heads, and their 16 dot products summed across lanes
 * together (hsum16). q: the sequence's [heads, D]; scores [(kv1 - kv0) * group, n]; out [heads, D]. */
static void attend_avx512(const float *q, int group, int D, const kv_view *kv, int kv0, int kv1, int n,
                          float *scores, float *out) {
    const int C = D / 16, nh = (kv1 - kv0) * group;
    const float scale = 1.0f / sqrtf((float)D);
    float mx[MAX_HEADS], sum[MAX_HEADS];
    int64_t slots[16];
    for (int h = 0; h < nh; h++) mx[h] = -INFINITY;
    __m512 part[FAST_GROUP][16];
    for (int t0 = 0; t0 < n; t0 += 16) {
        const int cnt = n - t0 < 16 ? n - t0 : 16;
        const __mmask16 valid = (__mmask16)((1u << cnt) - 1);
        for (int j = 0; j < cnt; j++) slots[j] = slot_of(kv, t0 + j);
        for (int kvh = kv0; kvh < kv1; kvh++) {
            __m512 qv[FAST_GROUP][FAST_CHUNKS];
            for (int h = 0; h < group; h++)
                for (int c = 0; c < C; c++)
                    qv[h][c] = _mm512_mul_ps(_mm512_loadu_ps(q + (kvh * group + h) * D + c * 16), _mm512_set1_ps(scale));
            for (int j = 0; j < 16; j++) {
                if (j >= cnt) {
                    for (int h = 0; h < group; h++) part[h][j] = _mm512_setzero_ps();
                    continue;
                }
                const uint16_t *k = kv->k + slots[j] + kvh * D;
                __m512 kf[FAST_CHUNKS] = {_mm512_setzero_ps()};
                for (int c = 0; c < C; c++) kf[c] = bf16x16(k + c * 16);
                for (int h = 0; h < group; h++) {
                    __m512 acc = _mm512_mul_ps(qv[h][0], kf[0]);
                    for (int c = 1; c < C; c++) acc = _mm512_fmadd_ps(qv[h][c], kf[c], acc);
                    part[h][j] = acc;
                }
            }
            for (int h = 0; h < group; h++) {
                const int r = (kvh - kv0) * group + h;
                __m512 sc = hsum16(part[h]);
                _mm512_mask_storeu_ps(scores + (size_t)r * n + t0, valid, sc);
                float m = _mm512_mask_reduce_max_ps(valid, sc);
                mx[r] = m > mx[r] ? m : mx[r];
            }
        }
    }
    for (int r = 0; r < nh; r++) {
        float *sc = scores + (size_t)r * n, m = mx[r], total = 0;
        for (int t = 0; t < n; t++) {
            sc[t] = fast_exp(sc[t] - m);
            total += sc[t];
        }
        sum[r] = total;
    }
    float *o = out + kv0 * group * D;
    for (int i = 0; i < nh * D; i++) o[i] = 0;
    for (int t0 = 0; t0 < n; t0 += 16) {
        const int cnt = n - t0 < 16 ? n - t0 : 16;
        for (int j = 0; j < cnt; j++) slots[j] = slot_of(kv, t0 + j);
        for (int kvh = kv0; kvh < kv1; kvh++) {
            const int r0 = (kvh - kv0) * group;
            __m512 acc[FAST_GROUP][FAST_CHUNKS];
            for (int h = 0; h < group; h++)
                for (int c = 0; c < C; c++) acc[h][c] = _mm512_loadu_ps(o + (r0 + h) * D + c * 16);
            for (int j = 0; j < cnt; j++) {
                const uint16_t *v = kv->v + slots[j] + kvh * D;
                __m512 vf[FAST_CHUNKS];
                for (int c = 0; c < C; c++) vf[c] = bf16x16(v + c * 16);
                for (int h = 0; h < group; h++) {
                    __m512 p = _mm512_set1_ps(scores[(size_t)(r0 + h) * n + t0 + j]);
                    for (int c = 0; c < C; c++) acc[h][c] = _mm512_fmadd_ps(p, vf[c], acc[h][c]);
                }
            }
            for (int h = 0; h < group; h++)
                for (int c = 0; c < C; c++) _mm512_storeu_ps(o + (r0 + h) * D + c * 16, acc[h][c]);
        }
    }
    for (int r = 0; r < nh; r++) {
        __m512 inv = _mm512_set1_ps(1.0f / sum[r]);
        for (int c = 0; c < C; c++)
            _mm512_storeu_ps(o + r * D + c * 16, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + c * 16), inv));
    }
}
#endif

/* Attention of one sequence's query heads of kv heads [kv0, kv1) (q, out: the sequence's [heads, D];
 * kv: the layer's cache at kv head 0) over its n cached keys and values; scores: [heads, n] of scratch. */
static void attend(const float *q, int heads, int kv_heads, int D, const kv_view *kv, int kv0, int kv1, int n,
                   float *scores, float *out) {
    const int group = heads / kv_heads;
#if defined(__AVX512F__)
    if (D % 16 == 0 && D >= 16 && D / 16 <= FAST_CHUNKS && group <= FAST_GROUP) {
        attend_avx512(q, group, D, kv, kv0, kv1, n, scores, out);
        return;
    }
#endif
    for (int kvh = kv0; kvh < kv1; kvh++) {
        kv_view at = *kv;
        at.k += kvh * D, at.v += kvh * D;
        attend_generic(q + kvh * group * D, group, D, &at, n, scores, out + kvh * group * D);
    }
}

/* Attention jobs: whole sequences when there are enough of them for every thread (each reads its
 * cache rows once, all kv heads together), else one (sequence, kv head) pair each. */
static inline int attention_jobs(int B, int kv_heads, int nt) { return B >= nt ? B : B * kv_heads; }

static inline void attention_job(int job, int B, int kv_heads, int nt, int *b, int *kv0, int *kv1) {
    if (B >= nt) {
        *b = job, *kv0 = 0, *kv1 = kv_heads;
    } else {
        *b = job / kv_heads, *kv0 = job % kv_heads, *kv1 = *kv0 + 1;
    }
}

/* [lo, hi): this thread's share of n items. */
static inline void span(int n, int tid, int nt, int *lo, int *hi) {
    int per = (n + nt - 1) / nt;
    *lo = tid * per < n ? tid * per : n;
    *hi = *lo + per < n ? *lo + per : n;
}

/* Every thread runs this; the phases between barriers split their work: matmul rows, attention by
 * (sequence, kv head), elementwise work by sequence or by group of 32. */
static void run_step(void *arg, int tid) {
    step_ctx *c = arg;
    const dims *dm = c->dm;
    const int B = c->B, H = dm->hidden, D = dm->head_dim, Hkv = dm->kv_heads, I = dm->inter, nt = c->nthreads;
    const int q_n = dm->heads * D, kv_n = Hkv * D, qkv_n = q_n + 2 * kv_n;
    if (tid >= nt) return;
    float *scores = c->scores + (size_t)tid * c->max_ctx * dm->heads;
    int b0, b1, gi0, gi1; /* my sequences; my groups of the MLP's activations */
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
        quantize_x(c->h, H, &c->qx, b0, b1);
        barrier(nt);
        matmul(&lw->qkv, qkv_n, H, &c->qx, B, c->qkv, tid, nt);
        barrier(nt);
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
        barrier(nt);
        for (int job = tid; job < attention_jobs(B, Hkv, nt); job += nt) {
            int b, kv0, kv1;
            attention_job(job, B, Hkv, nt, &b, &kv0, &kv1);
            kv_view view = {kc, vc, kv_n, c->tables + (size_t)b * c->table_stride, dm->block_size};
            attend(c->qkv + (size_t)b * qkv_n, dm->heads, Hkv, D, &view, kv0, kv1, c->seq_lens[b], scores,
                   c->att + (size_t)b * q_n);
        }
        barrier(nt);
        quantize_x(c->att, q_n, &c->qx, b0, b1);
        barrier(nt);
        matmul(&lw->o, H, q_n, &c->qx, B, c->h, tid, nt);
        barrier(nt);
        for (int b = b0; b < b1; b++) {
            float *xb = c->x + (size_t)b * H;
            for (int i = 0; i < H; i++) xb[i] += c->h[(size_t)b * H + i];
            rms_norm_rows(xb, lw->mlp_norm, c->h + (size_t)b * H, 1, H, dm->eps);
        }
        quantize_x(c->h, H, &c->qx, b0, b1);
        barrier(nt);
        matmul(&lw->gate_up, 2 * I, H, &c->qx, B, c->gu, tid, nt);
        barrier(nt);
        for (int b = 0; b < B; b++) {
            const float *g = c->gu + (size_t)b * 2 * I, *u = g + I;
            float *a = c->act + (size_t)b * I;
            for (int i = gi0 * GROUP; i < gi1 * GROUP; i++) a[i] = g[i] / (1.0f + fast_exp(-g[i])) * u[i];
        }
        barrier(nt);
        quantize_x(c->act, I, &c->qx, b0, b1);
        barrier(nt);
        matmul(&lw->down, H, I, &c->qx, B, c->h, tid, nt);
        barrier(nt);
    }
    for (int b = b0; b < b1; b++)
        for (int i = 0; i < H; i++) c->x[(size_t)b * H + i] += c->h[(size_t)b * H + i];
}

static int decode_locked(const dims *dm, const layer_weights *layers, int B, float *x, const int64_t *positions,
                         const int64_t *slots, const int32_t *tables, int table_stride, const int32_t *seq_lens,
                         uint16_t *kv, int64_t layer_stride, int64_t kv_stride, const float *cos, const float *sin,
                         int nthreads);

/* x [B, hidden]: each sequence's token embedding in, its residual stream after the last layer out (the
 * caller applies the final norm). positions, slots: the new token's position and cache slot per
 * sequence; tables [B, table_stride]: block tables; seq_lens: context length including the new token.
 * kv: the bf16 cache [layers, 2, slots, kv_heads, head_dim] with its layer and K-to-V strides in
 * elements. cos/sin [max_pos, head_dim / 2]. Returns 0, or -1 when out of memory. */
int sluice_decode_step(const dims *dm, const layer_weights *layers, int B, float *x, const int64_t *positions,
                       const int64_t *slots, const int32_t *tables, int table_stride, const int32_t *seq_lens,
                       uint16_t *kv, int64_t layer_stride, int64_t kv_stride, const float *cos, const float *sin,
                       int nthreads) {
    if (dm->head_dim > 256 || dm->head_dim % 16 || dm->heads % dm->kv_heads || dm->heads > 256 || dm->hidden % GROUP || dm->inter % GROUP || (dm->heads * dm->head_dim) % GROUP)
        return -2;
    pthread_mutex_lock(&step_lock);
    int rc = decode_locked(dm, layers, B, x, positions, slots, tables, table_stride, seq_lens, kv, layer_stride,
                           kv_stride, cos, sin, nthreads);
    pthread_mutex_unlock(&step_lock);
    return rc;
}

static int decode_locked(const dims *dm, const layer_weights *layers, int B, float *x, const int64_t *positions,
                         const int64_t *slots, const int32_t *tables, int table_stride, const int32_t *seq_lens,
                         uint16_t *kv, int64_t layer_stride, int64_t kv_stride, const float *cos, const float *sin,
                         int nthreads) {
    const int H = dm->hidden, I = dm->inter, q_n = dm->heads * dm->head_dim;
    const int qkv_n = q_n + 2 * dm->kv_heads * dm->head_dim;
    int max_ctx = 1;
    for (int b = 0; b < B; b++) max_ctx = seq_lens[b] > max_ctx ? seq_lens[b] : max_ctx;
    nthreads = nthreads < 1 ? 1 : ensure_workers(nthreads);
    const int kmax = H > q_n ? (H > I ? H : I) : (q_n > I ? q_n : I), gmax = kmax / GROUP;
    size_t floats = (size_t)B * (H + qkv_n + q_n + 2 * I + I + 1 + gmax + kmax / 2) +
                    (size_t)nthreads * max_ctx * dm->heads;
    float *buf = malloc(floats * sizeof(float));
    if (!buf) return -1;
    step_ctx c = {.dm = dm, .layers = layers, .B = B, .nthreads = nthreads, .x = x, .pos = positions,
                  .slots = slots, .tables = tables, .seq_lens = seq_lens, .table_stride = table_stride, .kv = kv,
                  .layer_stride = layer_stride, .kv_stride = kv_stride, .cos = cos, .sin = sin};
    float *p = buf;
    c.h = p, p += (size_t)B * H;
    c.qkv = p, p += (size_t)B * qkv_n;
    c.att = p, p += (size_t)B * q_n;
    c.gu = p, p += (size_t)B * 2 * I;
    c.act = p, p += (size_t)B * I;
    c.qx.dx = p, p += (size_t)B;
    c.qx.sx = p, p += (size_t)B * gmax;
    c.qx.q = (int16_t *)p, p += (size_t)B * kmax / 2;
    c.scores = p;
    c.max_ctx = max_ctx;
    run_parallel(run_step, &c, nthreads);
    free(buf);
    return 0;
}

/* ---- attention alone, for the torch path's decode rows (steps too large for the fused step) ---- */

typedef struct {
    int B, heads, kv_heads, head_dim, block_size, table_stride, nthreads, max_ctx;
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
    float *scores = a->scores + (size_t)tid * a->max_ctx * a->heads;
    for (int job = tid; job < attention_jobs(a->B, a->kv_heads, a->nthreads); job += a->nthreads) {
        int b, kv0, kv1;
        attention_job(job, a->B, a->kv_heads, a->nthreads, &b, &kv0, &kv1);
        kv_view view = {a->k, a->v, kv_n, a->tables + (size_t)b * a->table_stride, a->block_size};
        attend(a->q + b * a->q_stride, a->heads, a->kv_heads, D, &view, kv0, kv1, a->seq_lens[b], scores,
               a->out + (size_t)b * a->heads * D);
    }
}

/* q: B rows of [heads, head_dim] fp32, rows q_stride elements apart (a slice of a fused QKV output);
 * out [B, heads, head_dim]; k, v: one layer's bf16 cache [slots, kv_heads, head_dim], this step's keys
 * and values already written. Returns 0, -1 out of memory, -2 bad shapes. */
int sluice_decode_attention(int B, int heads, int kv_heads, int head_dim, const float *q, int64_t q_stride,
                            float *out, const uint16_t *k, const uint16_t *v, int block_size, const int32_t *tables,
                            int table_stride, const int32_t *seq_lens, int nthreads) {
    if (head_dim > 256 || head_dim % 16 || heads % kv_heads || heads > 256) return -2;
    int max_ctx = 1;
    for (int b = 0; b < B; b++) max_ctx = seq_lens[b] > max_ctx ? seq_lens[b] : max_ctx;
    pthread_mutex_lock(&step_lock);
    nthreads = nthreads < 1 ? 1 : ensure_workers(nthreads);
    float *scores = malloc((size_t)nthreads * max_ctx * heads * sizeof(float));
    if (!scores) {
        pthread_mutex_unlock(&step_lock);
        return -1;
    }
    attn_ctx a = {B, heads, kv_heads, head_dim, block_size, table_stride, nthreads, max_ctx, q, q_stride, out,
                  scores, k, v, tables, seq_lens};
    run_parallel(run_attention, &a, nthreads);
    free(scores);
    pthread_mutex_unlock(&step_lock);
    return 0;
}

/* Which of the code paths above this build took (for the log and the tests). */
const char *sluice_decode_isa(void) {
#if PAIRED && defined(__AVX512VNNI__)
    return "avx512-vnni";
#elif PAIRED
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "scalar";
#endif
}
