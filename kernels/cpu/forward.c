/* A whole forward step of a Llama model in one call, for CPUs: every layer of a flat batch of tokens
 * (one-token decodes and prefill chunks alike): RMSNorm, matmuls over the model file's own 4-bit
 * weights, RoPE, KV-cache write, paged attention, SiLU-and-mul, residual adds. Built at first use by
 * kernels/cpu/build.py with the machine's own flags (-march=native: AMX, AVX-512, AVX2 or plain C,
 * chosen by the preprocessor below) and called via ctypes.
 *
 * Why it exists: a step of a small model in eager torch is ~60 ops per layer, each a few microseconds
 * of dispatch, torch's int4 matmul first widens the 4-bit codes to bf16, and its dense bf16 weights
 * cost four times the memory of the file's. Here a layer is a handful of loops over 4-bit blocks,
 * with the threads of a step kept awake only while the step runs (a spin barrier between phases;
 * they sleep between steps, so nothing busy-waits while the server is idle).
 *
 * Two matmuls read the same weights (`q4_tiles` below). Steps of few rows are bound by the bytes
 * they read: activations quantised to int16 against the 4-bit codes in integer multiply-adds. Steps
 * of many rows (prefill chunks, large decode batches) are bound by arithmetic: on CPUs with AMX each
 * block of weights is widened to bf16 once in L1 and multiplied by 16x32 tiles of bf16 activations
 * (the numbers the dense bf16 torch path computes, at a fraction of its memory).
 *
 * Numerics: activations, norms, RoPE, softmax and accumulations in fp32; the 4-bit weights are
 * dequantised exactly (q * d + m with the file's fp16 d and m; rounded to bf16 on the AMX path, as
 * the torch path's bf16 weights are); K/V are stored in the cache as bf16 (round to nearest even, as
 * torch's .to(bfloat16)). Only the order of summation differs from the torch path.
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#define GROUP 32
#define TILE_N 16 /* output rows of W per block */
#define BLOCK_BYTES 320 /* one block: 256 bytes of codes, 16 fp16 scales, 16 fp16 mins */

/* A 4-bit matrix W [N, K] (GGML Q4_1 values: w = q * d + m per group of 32 inputs, q in 0..15) in
 * blocks of 16 output rows by one group: [N / 16, K / 32] blocks of BLOCK_BYTES, block (nb, g) holding
 * rows n0 = 16 nb .. n0 + 15 and inputs k0 = 32 g .. k0 + 31. Its 256 bytes of codes are 8 pairs of
 * "tile rows"; tile row r covers inputs k0 + 2r and k0 + 2r + 1 of all 16 output rows, lane i = 2n + j
 * holding W[n0 + n, k0 + 2r + j] (the layout of an AMX bf16 B tile and of `vpdpwssd` pairs); byte i of
 * pair p (32 bytes) holds lane i of tile row 2p in its low nibble and of tile row 2p + 1 in its high
 * one. Then d[16] and m[16] (fp16) of the block's 16 rows. kernels/cpu/__init__.py packs it. */
typedef struct {
    const uint8_t *blocks;
} q4_tiles;

/* Any matrix in blocks of 16 output rows by 32 inputs, in tile order: the layers' Q4_1 blocks (q4_tiles),
 * or the output layer's int8 ones (row_scale set: w = q * row_scale[n], 512 bytes per block). */
typedef struct {
    const uint8_t *blocks;
    int block_bytes;
    const float *row_scale; /* [N] for int8 blocks, else NULL */
} tile_weights;

#define Q8_BLOCK_BYTES 512

typedef struct {
    const float *attn_norm, *mlp_norm; /* [hidden] */
    q4_tiles qkv, o, gate_up, down;
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

/* Asks for the bytes [p, p + n) into L2 ahead of a stream's reads: one core's line fill buffers alone
 * cap what it streams from memory well below the memory's bandwidth; L2 prefetches add to them.
 * (Inline asm: GCC deletes loops whose only effect is `__builtin_prefetch`.) */
static inline void prefetch_l2(const void *p, size_t n) {
#if defined(__x86_64__)
    for (size_t b = 0; b < n; b += 64) __asm__ volatile("prefetcht1 (%0)" ::"r"((const char *)p + b));
#else
    (void)p, (void)n;
#endif
}

#define PREFETCH_AHEAD 8192 /* bytes of weights ahead of the one being read */

/* ---- row helpers, vectorised by hand (the compiler keeps float reductions and the exp's bit tricks
 * scalar): the same numbers as the scalar code, 16 (AVX-512) or 8 (AVX2) lanes at a time ---- */

#if defined(__AVX512F__)
static inline __m512 exp16(__m512 x) { /* fast_exp, lane-wise */
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 q = _mm512_set1_ps(1.9875691500e-4f);
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.3981999507e-3f));
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(8.3334519073e-3f));
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(4.1665795894e-2f));
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.6666665459e-1f));
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(5.0000001201e-1f));
    q = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(q, r), r, r), _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(q, _mm512_castsi512_ps(e));
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 exp8(__m256 x) { /* fast_exp, lane-wise */
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
    __m256 q = _mm256_set1_ps(1.9875691500e-4f);
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.3981999507e-3f));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(8.3334519073e-3f));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(4.1665795894e-2f));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.6666665459e-1f));
    q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(5.0000001201e-1f));
    q = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(q, r), r, r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(q, _mm256_castsi256_ps(e));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

/* s[t] = exp(s[t] - m) for t < n; returns their sum (softmax numerators). */
static inline float exp_shifted(float *s, int n, float m) {
    int t = 0;
    float total = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps(), mv = _mm512_set1_ps(m);
    for (; t + 16 <= n; t += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), mv));
        _mm512_storeu_ps(s + t, e);
        acc = _mm512_add_ps(acc, e);
    }
    total = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps(), mv = _mm256_set1_ps(m);
    for (; t + 8 <= n; t += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    total = hsum8(acc);
#endif
    for (; t < n; t++) {
        s[t] = fast_exp(s[t] - m);
        total += s[t];
    }
    return total;
}

/* a[i] = silu(g[i]) * u[i] for i < n (n: a multiple of 16). */
static inline void silu_mul(const float *g, const float *u, float *a, int n) {
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        __m512 gv = _mm512_loadu_ps(g + i);
        __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv)));
        _mm512_storeu_ps(a + i, _mm512_mul_ps(_mm512_div_ps(gv, den), _mm512_loadu_ps(u + i)));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i);
        __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
        _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) a[i] = g[i] / (1.0f + fast_exp(-g[i])) * u[i];
}

static inline float dot(const float *a, const float *b, int n) { /* n: a multiple of 16 */
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum8(acc);
#else
    float s = 0;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
#endif
}

static inline float abs_max(const float *x, int n) { /* n: a multiple of 16 */
#if defined(__AVX512F__)
    __m512 m = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    return _mm512_reduce_max_ps(m);
#else
    float m = 0;
    for (int i = 0; i < n; i++) m = fabsf(x[i]) > m ? fabsf(x[i]) : m;
    return m;
#endif
}

/* dst[i] = bf16(src[i]), round to nearest even (n: a multiple of 16). */
static inline void to_bf16_row(const float *src, uint16_t *dst, int n) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    for (int i = 0; i < n; i += 32)
        _mm512_storeu_si512(dst + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i)));
#else
    for (int i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
#endif
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

/* One round of waiting for another thread: a short spin (the other thread is normally a few
 * microseconds away), then yielding the core. Without the yield a waiting thread burns whole
 * scheduler slices while the thread it waits for is descheduled, which happens as soon as anything
 * else wants these cores (other processes, the event loop, a second engine): each barrier of a step
 * could then cost milliseconds, and one step a hundred times its time. */
#define SPIN_BEFORE_YIELD 4096
static inline void spin_wait(int *spins) {
    if (*spins < SPIN_BEFORE_YIELD) {
        ++*spins;
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
    } else {
        sched_yield();
    }
}

static void barrier(int n) {
    if (n <= 1) return;
    int gen = atomic_load_explicit(&pool.barrier_gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&pool.arrived, 1, memory_order_acq_rel) == n - 1) {
        atomic_store_explicit(&pool.arrived, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&pool.barrier_gen, 1, memory_order_acq_rel);
    } else {
        for (int spins = 0; atomic_load_explicit(&pool.barrier_gen, memory_order_acquire) == gen;) spin_wait(&spins);
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
        for (int spins = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < pool.nthreads - 1;)
            spin_wait(&spins);
}

/* ---- AMX: the process asks the kernel once for the tile state; each thread configures its tiles ---- */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_AMX 1
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct __attribute__((packed)) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static int amx_state; /* 0: not asked yet, 1: usable, -1: refused by the kernel */

static int amx_usable(void) {
    if (amx_state == 0) amx_state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return amx_state == 1;
}

static void amx_configure(void) { /* tiles 0-3: C (16 x 16 fp32), 4-5: A (16 x 32 bf16), 6-7: B (16 x 32 bf16) */
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}
#else
#define HAVE_AMX 0
static int amx_usable(void) { return 0; }
#endif

/* ---- the matmuls: y[b, n] = sum_k x[b, k] W[n, k] over q4_tiles ----
 *
 * Few rows, `matmul_int16`: each input row is quantised to int16 with one scale (dx = max|x| / 32767:
 * an element 100 times smaller than the row's largest still keeps ~8 significant bits, what the bf16
 * the torch path rounds activations to keeps for every element; int8, as llama.cpp does, flipped
 * greedy near-ties of the reference test). A block's dot products are then integer multiply-adds
 * (`vpdpwssd` / `vpmaddwd`: one instruction per tile row and input row, 16 output rows at once) over
 * the 4-bit codes; the block's dw scales them and the row's dx applies once at the end:
 * sum_i (q_i dw + mw) x_i ~= dx (sum_g dw_g sum_i q_i xq_i + sum_g mw_g sx_g / dx), the min term with
 * the exact fp32 sums sx of each group's inputs.
 *
 * Many rows, `matmul_amx`: x rounded to bf16 (as the torch path's bf16 matmul does), each block
 * widened to a bf16 B tile (q * d + m in fp32, then rounded), tiles multiplied and accumulated in fp32. */

#define ROWS_PER_PASS 8

typedef struct {
    int16_t *q; /* [B, K] */
    float *dx; /* [B]: each row's scale */
    float *sx; /* [B, G]: exact sums of each group's inputs, divided by the row's dx */
    uint16_t *bf; /* the rows in bf16 for the AMX path, as A tiles: [rows rounded up to 32 / 16][K / 32][16 x 32] */
} qx_t;

/* Rows [b0, b1) of x [B, K] (threads prepare disjoint rows): int16 for matmul_int16, or bf16. */
static void quantize_x(const float *x, int K, qx_t *qx, int b0, int b1, int to_bf16) {
    const int G = K / GROUP;
    for (int b = b0; b < b1; b++) {
        const float *row = x + (size_t)b * K;
        if (to_bf16) { /* row b's group g at tile (b / 16, g), row b % 16: tiles of 16 rows x 32 contiguous */
            uint16_t *tiles = qx->bf + (size_t)(b / 16) * 16 * K + (b % 16) * GROUP;
            for (int g = 0; g < G; g++) to_bf16_row(row + g * GROUP, tiles + (size_t)g * 16 * GROUP, GROUP);
            continue;
        }
        const float amax = abs_max(row, K);
        const float d = amax / 32767.0f, id = amax > 0 ? 32767.0f / amax : 0.0f;
        qx->dx[b] = d;
        int16_t *dst = qx->q + (size_t)b * K;
        for (int g = 0; g < G; g++) {
            const float *p = row + g * GROUP;
#if defined(__AVX512F__)
            __m512 lo = _mm512_loadu_ps(p), hi = _mm512_loadu_ps(p + 16), idv = _mm512_set1_ps(id);
            qx->sx[(size_t)b * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi)) * id;
            _mm256_storeu_si256((__m256i *)(dst + g * GROUP), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(lo, idv))));
            _mm256_storeu_si256((__m256i *)(dst + g * GROUP + 16), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(hi, idv))));
#else
            float sum = 0;
            for (int j = 0; j < GROUP; j++) {
                sum += p[j];
                dst[g * GROUP + j] = (int16_t)lrintf(p[j] * id);
            }
            qx->sx[(size_t)b * G + g] = sum * id;
#endif
        }
    }
}

/* One column of blocks (16 output rows n0.., all K) for nb <= ROWS_PER_PASS input rows: y[b, n0 + n]. */
static inline __attribute__((always_inline)) void q4_column(const uint8_t *col, int G, const qx_t *qx, int K,
                                                            int nb, float *y, int ldy) {
    float out[ROWS_PER_PASS][TILE_N];
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 accf[ROWS_PER_PASS];
    for (int b = 0; b < nb; b++) accf[b] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi16(0xf);
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = col + (size_t)g * BLOCK_BYTES;
        prefetch_l2(blk + PREFETCH_AHEAD, BLOCK_BYTES);
        __m512i acc[ROWS_PER_PASS];
        for (int b = 0; b < nb; b++) acc[b] = _mm512_setzero_si512();
        for (int p = 0; p < 8; p++) {
            __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 32 * p)));
            __m512i w0 = _mm512_and_si512(w, low), w1 = _mm512_srli_epi16(w, 4);
            for (int b = 0; b < nb; b++) {
                const int16_t *xp = qx->q + (size_t)b * K + g * GROUP + 4 * p;
                int32_t x0, x1;
                memcpy(&x0, xp, 4);
                memcpy(&x1, xp + 2, 4);
#if defined(__AVX512VNNI__)
                acc[b] = _mm512_dpwssd_epi32(acc[b], w0, _mm512_set1_epi32(x0));
                acc[b] = _mm512_dpwssd_epi32(acc[b], w1, _mm512_set1_epi32(x1));
#else
                acc[b] = _mm512_add_epi32(acc[b], _mm512_add_epi32(_mm512_madd_epi16(w0, _mm512_set1_epi32(x0)),
                                                                   _mm512_madd_epi16(w1, _mm512_set1_epi32(x1))));
#endif
            }
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 256)));
        __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 288)));
        for (int b = 0; b < nb; b++) {
            accf[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[b]), d, accf[b]);
            accf[b] = _mm512_fmadd_ps(m, _mm512_set1_ps(qx->sx[(size_t)b * G + g]), accf[b]);
        }
    }
    for (int b = 0; b < nb; b++) _mm512_storeu_ps(out[b], accf[b]);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    for (int b = 0; b < nb; b++) memset(out[b], 0, sizeof out[b]);
    const __m256i low = _mm256_set1_epi16(0xf);
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = col + (size_t)g * BLOCK_BYTES;
        prefetch_l2(blk + PREFETCH_AHEAD, BLOCK_BYTES);
        __m256i acc[ROWS_PER_PASS][2];
        for (int b = 0; b < nb; b++) acc[b][0] = acc[b][1] = _mm256_setzero_si256();
        for (int p = 0; p < 8; p++) {
            /* bytes 0-15: output rows 0-7, bytes 16-31: rows 8-15 */
            __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 32 * p)));
            __m256i hi = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 32 * p + 16)));
            __m256i lo0 = _mm256_and_si256(lo, low), lo1 = _mm256_srli_epi16(lo, 4);
            __m256i hi0 = _mm256_and_si256(hi, low), hi1 = _mm256_srli_epi16(hi, 4);
            for (int b = 0; b < nb; b++) {
                const int16_t *xp = qx->q + (size_t)b * K + g * GROUP + 4 * p;
                int32_t x0i, x1i;
                memcpy(&x0i, xp, 4);
                memcpy(&x1i, xp + 2, 4);
                __m256i x0 = _mm256_set1_epi32(x0i), x1 = _mm256_set1_epi32(x1i);
                acc[b][0] = _mm256_add_epi32(acc[b][0], _mm256_add_epi32(_mm256_madd_epi16(lo0, x0),
                                                                         _mm256_madd_epi16(lo1, x1)));
                acc[b][1] = _mm256_add_epi32(acc[b][1], _mm256_add_epi32(_mm256_madd_epi16(hi0, x0),
                                                                         _mm256_madd_epi16(hi1, x1)));
            }
        }
        for (int h = 0; h < 2; h++) {
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 256 + 16 * h)));
            __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 288 + 16 * h)));
            for (int b = 0; b < nb; b++) {
                __m256 o = _mm256_loadu_ps(out[b] + 8 * h);
                o = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[b][h]), d, o);
                o = _mm256_fmadd_ps(m, _mm256_set1_ps(qx->sx[(size_t)b * G + g]), o);
                _mm256_storeu_ps(out[b] + 8 * h, o);
            }
        }
    }
#else
    for (int b = 0; b < nb; b++) memset(out[b], 0, sizeof out[b]);
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = col + (size_t)g * BLOCK_BYTES;
        const uint16_t *dw = (const uint16_t *)(blk + 256), *mw = (const uint16_t *)(blk + 288);
        for (int b = 0; b < nb; b++) {
            const int16_t *xq = qx->q + (size_t)b * K + g * GROUP;
            int32_t s[TILE_N] = {0};
            for (int p = 0; p < 8; p++)
                for (int i = 0; i < 32; i++) {
                    const uint8_t c = blk[32 * p + i];
                    const int n = i / 2, j = i % 2;
                    s[n] += (c & 0xf) * xq[4 * p + j] + (c >> 4) * xq[4 * p + 2 + j];
                }
            const float sx = qx->sx[(size_t)b * G + g];
            for (int n = 0; n < TILE_N; n++) out[b][n] += (float)s[n] * fp16_to_f32(dw[n]) + fp16_to_f32(mw[n]) * sx;
        }
    }
#endif
    for (int b = 0; b < nb; b++)
        for (int n = 0; n < TILE_N; n++) y[(size_t)b * ldy + n] = out[b][n] * qx->dx[b];
}

/* This thread's share of y[B, N] = x[B, K] W^T (x quantised by quantize_x): columns of blocks split evenly. */
static void matmul_int16(const q4_tiles *w, int N, int K, const qx_t *qx, int B, float *y, int tid, int nt) {
    const int G = K / GROUP, NB = N / TILE_N, per = (NB + nt - 1) / nt;
    const int c0 = tid * per, c1 = c0 + per < NB ? c0 + per : NB;
    for (int c = c0; c < c1; c++) {
        const uint8_t *col = w->blocks + (size_t)c * G * BLOCK_BYTES;
        for (int b0 = 0; b0 < B; b0 += ROWS_PER_PASS) {
            const int nb = B - b0 < ROWS_PER_PASS ? B - b0 : ROWS_PER_PASS;
            qx_t part = {qx->q + (size_t)b0 * K, qx->dx + b0, qx->sx + (size_t)b0 * G, NULL};
            float *yb = y + (size_t)b0 * N + c * TILE_N;
            switch (nb) { /* a constant nb per call: the compiler keeps each row's accumulator in a register */
                case 1: q4_column(col, G, &part, K, 1, yb, N); break;
                case 2: q4_column(col, G, &part, K, 2, yb, N); break;
                case 3: q4_column(col, G, &part, K, 3, yb, N); break;
                case 4: q4_column(col, G, &part, K, 4, yb, N); break;
                case 5: q4_column(col, G, &part, K, 5, yb, N); break;
                case 6: q4_column(col, G, &part, K, 6, yb, N); break;
                case 7: q4_column(col, G, &part, K, 7, yb, N); break;
                default: q4_column(col, G, &part, K, 8, yb, N); break;
            }
        }
    }
}

#if HAVE_AMX
/* Block -> a bf16 B tile: 16 rows (input pairs) of 32 bf16 (lane 2n + j), exactly the block's layout. */
static inline void widen_block(const uint8_t *blk, uint16_t *tile) {
    const __m512i lo_rows = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi_rows = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 256)));
    __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 288)));
    __m512 d0 = _mm512_permutexvar_ps(lo_rows, d), d1 = _mm512_permutexvar_ps(hi_rows, d);
    __m512 m0 = _mm512_permutexvar_ps(lo_rows, m), m1 = _mm512_permutexvar_ps(hi_rows, m);
    const __m512i low = _mm512_set1_epi32(0xf);
    for (int p = 0; p < 8; p++) {
        __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 32 * p))); /* lanes 0-15 */
        __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 32 * p + 16))); /* 16-31 */
        __m512 r0a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(a, low)), d0, m0);
        __m512 r0b = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, low)), d1, m1);
        __m512 r1a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(a, 4)), d0, m0);
        __m512 r1b = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), d1, m1);
        _mm512_storeu_si512(tile + (2 * p) * 32, (__m512i)_mm512_cvtne2ps_pbh(r0b, r0a));
        _mm512_storeu_si512(tile + (2 * p + 1) * 32, (__m512i)_mm512_cvtne2ps_pbh(r1b, r1a));
    }
}

/* An int8 block -> a bf16 B tile: tile row r's lane 2n + j is q[n, 2r + j] * scale[n] (q stored in
 * that order already). */
static inline void widen_q8_block(const uint8_t *blk, const float *scale, uint16_t *tile) {
    const __m512i lo_rows = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi_rows = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    const __m512 s = _mm512_loadu_ps(scale);
    const __m512 s0 = _mm512_permutexvar_ps(lo_rows, s), s1 = _mm512_permutexvar_ps(hi_rows, s);
    for (int r = 0; r < 16; r++) {
        __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 32 * r)))), s0);
        __m512 b = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 32 * r + 16)))), s1);
        _mm512_storeu_si512(tile + r * 32, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
}

static inline void widen(const tile_weights *w, int c, int G, int g, uint16_t *tile) {
    const uint8_t *blk = w->blocks + ((size_t)c * G + g) * w->block_bytes;
    if (w->row_scale)
        widen_q8_block(blk, w->row_scale + (size_t)c * TILE_N, tile);
    else
        widen_block(blk, tile);
}

/* Tile t (16 x 16 fp32) into rows [m, m + 16) of y, only those below M (a partial tile through a
 * scratch: y has exactly M rows). */
#define STORE_TILE(t, y, ldy, m, M)                                                    \
    do {                                                                               \
        if ((m) + 16 <= (M)) {                                                         \
            _tile_stored(t, y, (ldy) * 4);                                             \
        } else {                                                                       \
            float part[16 * 16];                                                       \
            _tile_stored(t, part, 64);                                                 \
            for (int i_ = 0; i_ < (M) - (m); i_++) memcpy((y) + (size_t)i_ * (ldy), part + 16 * i_, 64); \
        }                                                                              \
    } while (0)

/* This thread's share of y[M, N] = x[M, K] W^T with x in bf16 (qx->bf, A tiles with rows padded to a
 * multiple of 16): pairs of block columns (32 outputs) split evenly; each pair widened once into
 * `scratch` ([K / 32][2][512] bf16) and multiplied by every 32-row slice of x. */
static void matmul_amx(const tile_weights *w, int N, int K, const qx_t *qx, int M, float *y, uint16_t *scratch,
                       int tid, int nt) {
    const int G = K / GROUP, NB = N / TILE_N, NP = (NB + 1) / 2, per = (NP + nt - 1) / nt;
    const int p0 = tid * per, p1 = p0 + per < NP ? p0 + per : NP;
    if (p0 >= p1) return;
    amx_configure();
    const uint16_t *x = qx->bf;
    for (int pc = p0; pc < p1; pc++) {
        const int c = 2 * pc, two_cols = c + 1 < NB;
        for (int g = 0; g < G; g++) {
            widen(w, c, G, g, scratch + (size_t)g * 1024);
            if (two_cols) widen(w, c + 1, G, g, scratch + (size_t)g * 1024 + 512);
        }
        for (int m0 = 0; m0 < M; m0 += 32) {
            const int two_rows = m0 + 16 < M;
            const uint16_t *xa = x + (size_t)m0 * K, *xb = xa + (size_t)16 * K; /* tiles [rows / 16][G][16 x 32] */
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int g = 0; g < G; g++) {
                const uint16_t *bt = scratch + (size_t)g * 1024;
                _tile_loadd(4, xa + (size_t)g * 16 * GROUP, 64);
                _tile_loadd(6, bt, 64);
                _tile_dpbf16ps(0, 4, 6);
                if (two_cols) {
                    _tile_loadd(7, bt + 512, 64);
                    _tile_dpbf16ps(1, 4, 7);
                }
                if (two_rows) {
                    _tile_loadd(5, xb + (size_t)g * 16 * GROUP, 64);
                    _tile_dpbf16ps(2, 5, 6);
                    if (two_cols) _tile_dpbf16ps(3, 5, 7);
                }
            }
            float *ya = y + (size_t)m0 * N + c * TILE_N, *yb = ya + (size_t)16 * N;
            STORE_TILE(0, ya, N, m0, M);
            if (two_cols) STORE_TILE(1, ya + TILE_N, N, m0, M);
            if (two_rows) {
                STORE_TILE(2, yb, N, m0 + 16, M);
                if (two_cols) STORE_TILE(3, yb + TILE_N, N, m0 + 16, M);
            }
        }
    }
}
#endif

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
    chunk_slots(kv, 0, n_max < 16 ? n_max : 16, next);
    for (int t0 = 0; t0 < n_max; t0 += 16) {
        const int cnt = n_max - t0 < 16 ? n_max - t0 : 16, cnt_next = n_max - t0 - 16 < 16 ? n_max - t0 - 16 : 16;
        memcpy(slots, next, sizeof slots);
        if (cnt_next > 0) {
            chunk_slots(kv, t0 + 16, cnt_next, next);
            prefetch_rows(kv->k, next, cnt_next, kv0 * D, row_bytes, 1); /* the next keys, to L1 */
        }
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
    chunk_slots(kv, 0, n_max < 8 ? n_max : 8, next);
    for (int t0 = 0; t0 < n_max; t0 += 8) {
        const int cnt = n_max - t0 < 8 ? n_max - t0 : 8, cnt_next = n_max - t0 - 8 < 8 ? n_max - t0 - 8 : 8;
        memcpy(slots, next, 8 * sizeof *slots);
        if (cnt_next > 0) {
            chunk_slots(kv, t0 + 8, cnt_next, next);
            prefetch_rows(kv->k, next, cnt_next, kv0 * D, row_bytes, 1);
        }
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

/* [lo, hi): this thread's share of n items. */
static inline void span(int n, int tid, int nt, int *lo, int *hi) {
    int per = (n + nt - 1) / nt;
    *lo = tid * per < n ? tid * per : n;
    *hi = *lo + per < n ? *lo + per : n;
}

/* ---- where a step's time goes, as thread 0 sees it (bench/decode_roofline.py; off unless asked) ---- */

enum { PH_MATMUL, PH_ATTENTION, PH_WAIT, PH_STEP, PH_COUNT };
static int profiling;
static double phase_s[PH_COUNT];

static inline double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

#define PHASE(tid, ph, ...)                           \
    do {                                              \
        if (profiling && (tid) == 0) {                \
            const double t0_ = now_s();               \
            __VA_ARGS__;                              \
            phase_s[ph] += now_s() - t0_;             \
        } else {                                      \
            __VA_ARGS__;                              \
        }                                             \
    } while (0)

void sluice_profile(int on) { profiling = on; }

/* Seconds since the last read in matmuls, attention, waits at barriers, and whole steps; then zeroed. */
void sluice_profile_read(double *out) {
    for (int i = 0; i < PH_COUNT; i++) out[i] = phase_s[i], phase_s[i] = 0;
}

/* ---- the step ---- */

typedef struct {
    const dims *dm;
    const layer_weights *layers;
    int B, nthreads, amx; /* B rows (tokens); amx: this step's matmuls take the AMX path */
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
    int njobs;
    int *next_job; /* [layers]: the next attention job of each layer, taken in turn by the threads */
    size_t scores_per_thread; /* floats: a job's scores, then a block of widened keys */
} step_ctx;

static void prepare_x(step_ctx *c, const float *x, int K, int b0, int b1) { quantize_x(x, K, &c->qx, b0, b1, c->amx); }

static void step_matmul(step_ctx *c, const q4_tiles *w, int N, int K, float *y, int tid) {
#if HAVE_AMX
    if (c->amx) {
        const tile_weights tw = {w->blocks, BLOCK_BYTES, NULL};
        matmul_amx(&tw, N, K, &c->qx, c->B, y, c->tile_scratch + (size_t)tid * c->tile_scratch_per_thread, tid,
                   c->nthreads);
        return;
    }
#endif
    matmul_int16(w, N, K, &c->qx, c->B, y, tid, c->nthreads);
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
    float *scores = c->scores + (size_t)tid * c->scores_per_thread, *kbuf = scores + c->scores_per_thread - 16 * D;
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
        PHASE(tid, PH_MATMUL, step_matmul(c, &lw->qkv, qkv_n, H, c->qkv, tid));
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
                att_rows rows = {c->qkv + (size_t)b * qkv_n, c->att + (size_t)b * q_n, qkv_n, q_n, job->T,
                                 (int)c->pos[b]};
                attend(&rows, dm->heads, Hkv, D, &view, job->kv0, job->kv1, scores, kbuf);
            }
        });
        PHASE(tid, PH_WAIT, barrier(nt));
        prepare_x(c, c->att, q_n, b0, b1);
        PHASE(tid, PH_WAIT, barrier(nt));
        PHASE(tid, PH_MATMUL, step_matmul(c, &lw->o, H, q_n, c->h, tid));
        PHASE(tid, PH_WAIT, barrier(nt));
        for (int b = b0; b < b1; b++) {
            float *xb = c->x + (size_t)b * H;
            for (int i = 0; i < H; i++) xb[i] += c->h[(size_t)b * H + i];
            rms_norm_rows(xb, lw->mlp_norm, c->h + (size_t)b * H, 1, H, dm->eps);
        }
        prepare_x(c, c->h, H, b0, b1);
        PHASE(tid, PH_WAIT, barrier(nt));
        PHASE(tid, PH_MATMUL, step_matmul(c, &lw->gate_up, 2 * I, H, c->gu, tid));
        PHASE(tid, PH_WAIT, barrier(nt));
        for (int b = 0; b < B; b++) {
            const float *g = c->gu + (size_t)b * 2 * I, *u = g + I;
            float *a = c->act + (size_t)b * I;
            silu_mul(g + gi0 * GROUP, u + gi0 * GROUP, a + gi0 * GROUP, (gi1 - gi0) * GROUP);
        }
        PHASE(tid, PH_WAIT, barrier(nt));
        prepare_x(c, c->act, I, b0, b1);
        PHASE(tid, PH_WAIT, barrier(nt));
        PHASE(tid, PH_MATMUL, step_matmul(c, &lw->down, H, I, c->h, tid));
        PHASE(tid, PH_WAIT, barrier(nt));
    }
    for (int b = b0; b < b1; b++)
        for (int i = 0; i < H; i++) c->x[(size_t)b * H + i] += c->h[(size_t)b * H + i];
#if HAVE_AMX
    if (c->amx) _tile_release();
#endif
#if defined(__SSE2__)
    _mm_setcsr(csr);
#endif
    if (profiling && tid == 0) phase_s[PH_STEP] += now_s() - t_step;
}

static int forward_locked(const dims *dm, const layer_weights *layers, int B, float *x, const int64_t *positions,
                          const int64_t *slots, const int32_t *tables, int table_stride, const int32_t *row_seq,
                          uint16_t *kv, int64_t layer_stride, int64_t kv_stride, const float *cos, const float *sin,
                          int nthreads, int amx_min_rows) {
    const int H = dm->hidden, I = dm->inter, q_n = dm->heads * dm->head_dim;
    const int qkv_n = q_n + 2 * dm->kv_heads * dm->head_dim;
    nthreads = nthreads < 1 ? 1 : ensure_workers(nthreads);
    att_job *jobs = malloc((size_t)B * dm->kv_heads * sizeof *jobs);
    int *next_job = calloc((size_t)dm->layers, sizeof *next_job);
    if (!jobs || !next_job) {
        free(jobs), free(next_job);
        return -1;
    }
    size_t scores_per_thread;
    const int njobs = attention_plan(B, positions, row_seq, dm->kv_heads, dm->heads / dm->kv_heads, nthreads, jobs,
                                     &scores_per_thread);
    scores_per_thread += 16 * (size_t)dm->head_dim + 16; /* + a block of widened keys */
    scores_per_thread = (scores_per_thread + 15) / 16 * 16;
    const int amx = amx_min_rows > 0 && B >= amx_min_rows && amx_usable();
    const int R = (B + 31) / 32 * 32; /* rows of the row buffers */
    const int kmax = H > q_n ? (H > I ? H : I) : (q_n > I ? q_n : I), gmax = kmax / GROUP;
    const size_t per_thread = (size_t)gmax * 1024; /* bf16 elements: a widened column pair of the widest K */
    size_t floats = (size_t)R * (H + qkv_n + q_n + 2 * I + I + 1 + gmax + kmax / 2 + kmax / 2) +
                    (size_t)nthreads * scores_per_thread + (amx ? (size_t)nthreads * per_thread / 2 : 0) + 16;
    float *buf = calloc(floats, sizeof(float));
    if (!buf) {
        free(jobs), free(next_job);
        return -1;
    }
    step_ctx c = {.dm = dm, .layers = layers, .B = B, .nthreads = nthreads, .amx = amx, .x = x, .pos = positions,
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
    c.scores = p, p += (size_t)nthreads * scores_per_thread;
    p = (float *)(((uintptr_t)p + 63) & ~(uintptr_t)63); /* (the 16 spare floats) */
    c.tile_scratch = (uint16_t *)p;
    c.tile_scratch_per_thread = per_thread;
    c.jobs = jobs, c.njobs = njobs, c.next_job = next_job, c.scores_per_thread = scores_per_thread;
    run_parallel(run_step, &c, nthreads);
    free(buf), free(jobs), free(next_job);
    return 0;
}

/* x [B, hidden]: each row's token embedding in, its residual stream after the last layer out (the
 * caller applies the final norm). Rows are tokens: decodes and prefill chunks in any order.
 * positions, slots: each token's position and cache slot; row_seq[b]: the row of `tables`
 * [sequences, table_stride] (block tables) of its sequence. A row attends to positions 0..positions[b]
 * of its sequence. kv: the bf16 cache [layers, 2, slots, kv_heads, head_dim] with its layer and K-to-V
 * strides in elements. cos/sin [max_pos, head_dim / 2]. amx_min_rows: steps of at least this many
 * rows multiply on AMX tiles where this build and the OS allow it (0: never).
 * Returns 0, -1 when out of memory, -2 for shapes this kernel does not take. */
int sluice_forward(const dims *dm, const layer_weights *layers, int B, float *x, const int64_t *positions,
                   const int64_t *slots, const int32_t *tables, int table_stride, const int32_t *row_seq,
                   uint16_t *kv, int64_t layer_stride, int64_t kv_stride, const float *cos, const float *sin,
                   int nthreads, int amx_min_rows) {
    const int q_n = dm->heads * dm->head_dim, qkv_n = q_n + 2 * dm->kv_heads * dm->head_dim;
    if (dm->head_dim > 256 || dm->head_dim % 16 || dm->heads % dm->kv_heads || dm->heads > 256 ||
        dm->hidden % GROUP || dm->inter % GROUP || q_n % GROUP || qkv_n % TILE_N || dm->hidden % TILE_N)
        return -2;
    if (B <= 0) return 0;
    pthread_mutex_lock(&step_lock);
    int rc = forward_locked(dm, layers, B, x, positions, slots, tables, table_stride, row_seq, kv, layer_stride,
                            kv_stride, cos, sin, nthreads, amx_min_rows);
    pthread_mutex_unlock(&step_lock);
    return rc;
}

/* Whether this build has the AMX path and the OS lets this process use it. */
int sluice_amx_available(void) { return amx_usable(); }

/* ---- the output layer: int8 weights (one scale per row), each row's best candidates made exact ----
 *
 * The output layer reads as many bytes as a third of the layers, and only each row's top candidates
 * matter to greedy, top-k and top-p; those are recomputed here against the exact weights, in the same
 * call. Its int8 copy (engine/model.py, Int8Weight) is held in tile order (tile_weights, 512-byte
 * blocks), so the same two matmuls as the layers' read it: int16 activations in integer dot products
 * for few rows, AMX bf16 tiles for many. */

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
        for (int r = 0; r < 16; r++) {
            __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 32 * r)));
            for (int b = 0; b < nb; b++) {
                int32_t xp;
                memcpy(&xp, qx->q + (size_t)b * K + g * GROUP + 2 * r, 4);
#if defined(__AVX512VNNI__)
                acc[b] = _mm512_dpwssd_epi32(acc[b], w, _mm512_set1_epi32(xp));
#else
                acc[b] = _mm512_add_epi32(acc[b], _mm512_madd_epi16(w, _mm512_set1_epi32(xp)));
#endif
            }
        }
        for (int b = 0; b < nb; b++) accf[b] = _mm512_add_ps(accf[b], _mm512_cvtepi32_ps(acc[b]));
    }
    for (int b = 0; b < nb; b++) _mm512_storeu_ps(out[b], accf[b]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 accf[ROWS_PER_PASS][2];
    for (int b = 0; b < nb; b++) accf[b][0] = accf[b][1] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = col + (size_t)g * Q8_BLOCK_BYTES;
        prefetch_l2(blk + PREFETCH_AHEAD, Q8_BLOCK_BYTES);
        __m256i acc[ROWS_PER_PASS][2];
        for (int b = 0; b < nb; b++) acc[b][0] = acc[b][1] = _mm256_setzero_si256();
        for (int r = 0; r < 16; r++) {
            __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 32 * r))); /* rows 0-7 */
            __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 32 * r + 16))); /* 8-15 */
            for (int b = 0; b < nb; b++) {
                int32_t xp;
                memcpy(&xp, qx->q + (size_t)b * K + g * GROUP + 2 * r, 4);
                const __m256i xv = _mm256_set1_epi32(xp);
                acc[b][0] = _mm256_add_epi32(acc[b][0], _mm256_madd_epi16(lo, xv));
                acc[b][1] = _mm256_add_epi32(acc[b][1], _mm256_madd_epi16(hi, xv));
            }
        }
        for (int b = 0; b < nb; b++)
            for (int h = 0; h < 2; h++) accf[b][h] = _mm256_add_ps(accf[b][h], _mm256_cvtepi32_ps(acc[b][h]));
    }
    for (int b = 0; b < nb; b++) {
        _mm256_storeu_ps(out[b], accf[b][0]);
        _mm256_storeu_ps(out[b] + 8, accf[b][1]);
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

#define MAX_REFINE 64

typedef struct {
    int B, K, V, nthreads, refine, amx;
    const float *x;
    tile_weights w;
    const float *exact; /* [V, K] fp32 or NULL */
    float *out;
    qx_t qx;
    uint16_t *tile_scratch; /* per thread: a widened column pair (AMX) */
    size_t tile_scratch_per_thread;
    int32_t *cand; /* [threads, B, refine]: each thread's best rows of each input row */
} head_ctx;

/* The `k` largest of out[r0..r1) into idx (unordered): a running minimum among the kept ones, and
 * (AVX-512) 16 values at a time compared with it, so only the few that beat it are looked at. */
static void top_k(const float *out, int r0, int r1, int k, int32_t *idx) {
    float val[MAX_REFINE];
    int n = 0, lo = 0, r = r0;
    for (; r < r1 && n < k; r++) val[n] = out[r], idx[n] = r, n++;
    for (int i = 1; i < n; i++) lo = val[i] < val[lo] ? i : lo;
    if (n == k) {
#if defined(__AVX512F__)
        for (; r + 16 <= r1; r += 16) {
            __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(out + r), _mm512_set1_ps(val[lo]), _CMP_GT_OQ);
            while (hit) {
                const int j = r + __builtin_ctz(hit);
                hit &= hit - 1;
                if (out[j] > val[lo]) {
                    val[lo] = out[j], idx[lo] = j;
                    for (int i = 0; i < k; i++) lo = val[i] < val[lo] ? i : lo;
                }
            }
        }
#endif
        for (; r < r1; r++)
            if (out[r] > val[lo]) {
                val[lo] = out[r], idx[lo] = r;
                for (int i = 0; i < k; i++) lo = val[i] < val[lo] ? i : lo;
            }
    }
    for (; n < k; n++) idx[n] = -1;
}

/* This thread's columns of blocks for every input row (int16 matmul), row scales and dx applied. */
static void head_int16(const head_ctx *c, int tid) {
    const int K = c->K, G = K / GROUP, NB = c->V / TILE_N, per = (NB + c->nthreads - 1) / c->nthreads;
    const int c0 = tid * per, c1 = c0 + per < NB ? c0 + per : NB;
    float out[ROWS_PER_PASS][TILE_N];
    for (int col = c0; col < c1; col++) {
        const uint8_t *blocks = c->w.blocks + (size_t)col * G * Q8_BLOCK_BYTES;
        const float *scale = c->w.row_scale + (size_t)col * TILE_N;
        for (int b0 = 0; b0 < c->B; b0 += ROWS_PER_PASS) {
            const int nb = c->B - b0 < ROWS_PER_PASS ? c->B - b0 : ROWS_PER_PASS;
            qx_t part = {c->qx.q + (size_t)b0 * K, c->qx.dx + b0, NULL, NULL};
            switch (nb) { /* a constant nb per call: the accumulators stay in registers */
                case 1: q8_column(blocks, G, &part, K, 1, out); break;
                case 2: q8_column(blocks, G, &part, K, 2, out); break;
                case 3: q8_column(blocks, G, &part, K, 3, out); break;
                case 4: q8_column(blocks, G, &part, K, 4, out); break;
                case 5: q8_column(blocks, G, &part, K, 5, out); break;
                case 6: q8_column(blocks, G, &part, K, 6, out); break;
                case 7: q8_column(blocks, G, &part, K, 7, out); break;
                default: q8_column(blocks, G, &part, K, 8, out); break;
            }
            for (int b = 0; b < nb; b++) {
                float *y = c->out + (size_t)(b0 + b) * c->V + (size_t)col * TILE_N;
                for (int n = 0; n < TILE_N; n++) y[n] = out[b][n] * scale[n] * part.dx[b];
            }
        }
    }
}

static void run_head(void *arg, int tid) {
    head_ctx *c = arg;
    if (tid >= c->nthreads) return;
    int b0, b1, r0, r1;
    span(c->B, tid, c->nthreads, &b0, &b1);
    quantize_x(c->x, c->K, &c->qx, b0, b1, c->amx);
    barrier(c->nthreads);
#if HAVE_AMX
    if (c->amx) {
        matmul_amx(&c->w, c->V, c->K, &c->qx, c->B, c->out,
                   c->tile_scratch + (size_t)tid * c->tile_scratch_per_thread, tid, c->nthreads);
        _tile_release();
    } else
#endif
        head_int16(c, tid);
    if (!c->exact || c->refine <= 0) return;
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
        for (int i = 0; i < kept; i++) row[best[i]] = dot(c->x + (size_t)b * c->K, c->exact + (size_t)best[i] * c->K, c->K);
    }
}

/* out [B, V] = x [B, K] (fp32) W^T for W int8 in tile order (blocks [V / 16, K / 32, 512], w = q *
 * scale[n]), V a multiple of 16 and K of 32. `exact` [V, K] fp32 (or NULL): each row's `refine`
 * largest outputs are then recomputed against it at full precision. Steps of at least amx_min_rows
 * rows multiply on AMX tiles where this build and the OS allow it (0: never). Returns 0, -1 when out
 * of memory, -2 for shapes it does not take. */
int sluice_int8_logits(int B, int K, const float *x, const uint8_t *blocks, const float *scale, int V, float *out,
                       const float *exact, int refine, int nthreads, int amx_min_rows) {
    if (B < 0 || K % GROUP || V % TILE_N || refine > MAX_REFINE || refine > V) return -2;
    if (B == 0) return 0; /* a step that samples nothing (a prefill chunk) */
    pthread_mutex_lock(&step_lock);
    nthreads = nthreads < 1 ? 1 : ensure_workers(nthreads);
    const int amx = amx_min_rows > 0 && B >= amx_min_rows && amx_usable();
    const size_t R = (size_t)(B + 31) / 32 * 32, per_thread = (size_t)(K / GROUP) * 1024;
    const size_t floats = R * (1 + K / GROUP) + R * K / 2 + R * K / 2 + (size_t)nthreads * B * MAX_REFINE +
                          (amx ? (size_t)nthreads * per_thread / 2 : 0) + 16;
    float *buf = calloc(floats, sizeof(float));
    if (!buf) {
        pthread_mutex_unlock(&step_lock);
        return -1;
    }
    head_ctx c = {B, K, V, nthreads, refine, amx, x, {blocks, Q8_BLOCK_BYTES, scale}, exact, out,
                  {NULL, NULL, NULL, NULL}, NULL, per_thread, NULL};
    float *p = buf;
    c.qx.dx = p, p += R;
    c.qx.sx = p, p += R * (K / GROUP);
    c.qx.q = (int16_t *)p, p += R * K / 2;
    c.qx.bf = (uint16_t *)p, p += R * K / 2;
    c.cand = (int32_t *)p, p += (size_t)nthreads * B * MAX_REFINE;
    c.tile_scratch = (uint16_t *)(((uintptr_t)p + 63) & ~(uintptr_t)63);
    run_parallel(run_head, &c, nthreads);
    free(buf);
    pthread_mutex_unlock(&step_lock);
    return 0;
}

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
#endif
    for (; i < n; i++) mx = x[i] > mx ? x[i] : mx;
    i = 0;
#if defined(__AVX512F__)
    const __m512 mv = _mm512_set1_ps(mx);
    for (; i + 16 <= n; i += 16) {
        __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), mv, _CMP_EQ_OQ);
        if (eq) return i + __builtin_ctz(eq);
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

/* Which of the code paths above this build took (for the log and the tests). */

/* Which of the int16 matmul's code paths this build took (for the log and the tests). */
const char *sluice_forward_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return "avx512-vnni";
#elif defined(__AVX512F__) && defined(__AVX512BW__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return "avx2";
#else
    return "scalar";
#endif
}
