/* The matmuls over tile-ordered weights: int16 (AVX-512 VNNI, AVX-512, AVX2, plain C) and AMX.
 * Part of the native CPU step, compiled as one unit by forward.c (see there). */

/* ---- the matmuls: y[b, n] = sum_k x[b, k] W[n, k] over layer_tiles ----
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
 * widened to a bf16 B tile (q * d + m in fp32, then rounded), tiles multiplied and accumulated in fp32.
 *
 * Many rows without AMX (AVX-512 VNNI), `matmul_int16` with int8 inputs (MM_INT8): a step of many rows
 * is bound by arithmetic, and `vpdpbusd` does 64 multiply-adds an instruction, twice `vpdpwssd`. Each
 * 32 inputs of a row (a weight group) are quantised to int8 with their own scale (dg = max|x| / 127, as
 * llama.cpp's Q8_0 activations; one scale per row would lose the small elements). Per 16 inputs cost
 * twice the float work per group and row (a third of the 4-bit matmul's instructions) for a mean KL
 * against the float reference of 0.0023 rather than 0.0034 (SmolLM2 Q4_K_M, codes centred below); the
 * weights are the unsigned operand: 4-bit codes as they are, int8 codes offset by 128 (w ^ 0x80), the
 * offset's 128 * sum(xq) taken back per half group. */

enum { MM_INT16 = 0, MM_AMX = 1, MM_INT8 = 2 }; /* how a step's matmuls take their inputs */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__BMI2__) /* (every CPU with VNNI has BMI2) */
#define HAVE_INT8 1
#else
#define HAVE_INT8 0
#endif
/* AVX2 without AVX-512 (an AVX2-only EPYC's build), MM_INT8 steps: the 4-bit tiles and the int8 ones
 * with codes in [-32, 32] (TILES_Q8G6) take int8 inputs (`vpmaddubsw`: the codes as the unsigned
 * operand, 32 multiply-adds an instruction into int16 pairs that cannot saturate: 2 * 15 * 127 = 3810
 * for 4-bit codes, four of them (a whole group's eight where one pass of rows decodes them in registers)
 * summed in int16 before one `vpmaddwd` widens them; 2 * 64 * 127 for the int8 codes offset by 32, two of
 * them; against `vpmaddwd`'s 16 on int16 inputs), the other formats their int16 inputs, both prepared
 * (quantize_x). Codes up to 127 (Q8_0's) would saturate the pairs. */
#if !HAVE_INT8 && !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_INT8_Q4 1
#else
#define HAVE_INT8_Q4 0
#endif
/* AVX-VNNI (`vpdpbusd` on 256-bit vectors without AVX-512: Alder Lake's and later client cores, Sierra Forest's
 * E-cores): the same unsigned-by-signed products, four to an int32 lane, in one instruction where AVX2 takes
 * `vpmaddubsw`, the int16 adds and `vpmaddwd` (three to four a vector of pairs). The lanes hold the same four
 * products in both (pairs 4i, 4i + 1 and 4i + 2, 4i + 3 of a `vpmaddubsw` summed by `vpmaddwd`), and neither
 * rounds or saturates, so the sums are bit-identical: PAIRS_ADD(s, w, x) adds w x's products into s (int16
 * pairs, or int32 quads with VNNI), PAIRS_WIDEN(s) makes s int32 quads. */
#if HAVE_INT8_Q4 && defined(__AVXVNNI__)
#define HAVE_AVXVNNI 1
#define PAIRS_ADD(s, w, x) _mm256_dpbusd_avx_epi32((s), (w), (x))
#define PAIRS_WIDEN(s) (s)
#else
#define HAVE_AVXVNNI 0
#define PAIRS_ADD(s, w, x) _mm256_add_epi16((s), _mm256_maddubs_epi16((w), (x)))
#define PAIRS_WIDEN(s) _mm256_madd_epi16((s), _mm256_set1_epi16(1))
#endif
/* MM_INT8 steps on F16/BF16 tiles (AVX-512 BF16): x rounded to bf16, `vdpbf16ps` over the tile rows, whose
 * 32 lanes are already its pairs (output row n, inputs 2r and 2r + 1): one instruction per tile row and
 * input row where fp32 FMAs take two and the pairs' sums after. The weights as AMX takes them: BF16 as they
 * are, F16 rounded to bf16. */
#if HAVE_INT8 && defined(__AVX512BF16__)
#define HAVE_BF16DOT 1
#else
#define HAVE_BF16DOT 0
#endif

#define ROWS_PER_PASS 8

typedef struct {
    int16_t *q; /* [B, K] */
    float *dx; /* [B]: each row's scale */
    float *sx; /* [B, G]: exact sums of each group's inputs, divided by the row's dx */
    uint16_t *bf; /* the rows in bf16: for the AMX path as A tiles ([rows rounded up to 32 / 16][K / 32][16 x 32]),
                   * for MM_INT8's F16/BF16 columns as rows [B, K] (HAVE_BF16DOT) */
    int8_t *q8; /* MM_INT8: [B, K] (sx then holds the exact sums themselves; HAVE_INT8_Q4: its own rows,
                 * beside the int16 ones, and sx as theirs) */
    float *dg; /* MM_INT8: [B, G], each group's scale (one per 32 inputs, as llama.cpp's q8_0) */
    int32_t *s8; /* MM_INT8: [B, G, 2], 128 * the sum of each half group's int8 inputs */
    float *ce; /* MM_INT8: [B, G, 2], the centring's correction for 4-bit and 5-bit codes (CODE_CENTRE c = 8,
                * 16): c * (the exact sum - dg * the sum of the int8 inputs) */
    float *o8; /* MM_INT8: [B, G], -128 dg * the sum of the group's int8 inputs (TILES_Q8's offset) */
} qx_t;

/* The int8 matmul's codes centred (4-bit ones on 8, 5-bit ones on 16): the int8 inputs' rounding errors
 * are multiplied by q - c rather than by q, all of one sign, whose sum of squares is four times larger
 * (SmolLM2 Q4_K_M's mean KL against the float path, int8 wide matmul on every step: 0.0085 uncentred,
 * against 0.0021 when its Q5_0 matrices were int8 tiles with signed codes). d dg sum (q - c) x8 + (m + c d) sx
 * (sx: the exact sum) is taken as d (dg sum q x8 + ce) + m sx, ce = c (sx - dg sum x8) per row and group
 * (set_int8_sums): one integer sum per group and three FMAs per row, the same to fp32's rounding. */
#define CODE_CENTRE(five) ((five) ? 16.0f : 8.0f)

#if HAVE_INT8 || HAVE_INT8_Q4
/* The buffer a decoded column fills (G * 512 bytes: a column's int8 codes, either ISA's order; 1024: its
 * bf16 weights): one per thread (the pool's threads live as long as the process). */
static void *decode_buffer(int G, int bytes_per_group) {
    static _Thread_local void *buf;
    static _Thread_local size_t size;
    const size_t want = (size_t)G * bytes_per_group;
    if (want > size) {
        free(buf);
        buf = aligned_alloc(64, want);
        size = buf ? want : 0;
    }
    return buf;
}
#endif

#if HAVE_INT8 || HAVE_INT8_Q4
/* Group i (of row b: b * G + g) of the int8 inputs: its scale, the offset's and the centring's sums. */
static inline void set_int8_sums(qx_t *qx, int i, float dg, const int sum_q[2], float exact) {
    qx->dg[i] = dg;
    qx->s8[2 * (size_t)i] = 128 * sum_q[0];
    qx->s8[2 * (size_t)i + 1] = 128 * sum_q[1];
    const float err = exact - dg * (float)(sum_q[0] + sum_q[1]); /* (the int8 inputs' error in the sum) */
    qx->ce[2 * (size_t)i] = CODE_CENTRE(0) * err;
    qx->ce[2 * (size_t)i + 1] = CODE_CENTRE(1) * err;
    qx->o8[i] = -128.0f * dg * (float)(sum_q[0] + sum_q[1]);
}
#endif

#if HAVE_INT8_Q4
/* Row b of x as int8 per group (scale dg = max|x| / 127), for the 4-bit tiles' MM_INT8 columns. */
static void quantize_q8_row(const float *row, int K, qx_t *qx, int b) {
    const int G = K / GROUP;
    int8_t *dst = qx->q8 + (size_t)b * K;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int g = 0; g < G; g++) {
        const float *p = row + g * GROUP;
        __m256 v[4], m = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(p + 8 * i);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
            sum = _mm256_add_ps(sum, v[i]);
        }
        const float amax = hmax8(m), exact = hsum8(sum), dg = amax / 127.0f;
        const __m256 s = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
        int sum_q[2];
        for (int h = 0; h < 2; h++) {
            const __m256i q16 = _mm256_permute4x64_epi64(
                _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[2 * h], s)),
                                   _mm256_cvtps_epi32(_mm256_mul_ps(v[2 * h + 1], s))), 0xD8);
            _mm_storeu_si128((__m128i *)(dst + g * GROUP + 16 * h),
                             _mm_packs_epi16(_mm256_castsi256_si128(q16), _mm256_extracti128_si256(q16, 1)));
            const __m128i s16 = _mm_madd_epi16(_mm_add_epi16(_mm256_castsi256_si128(q16), _mm256_extracti128_si256(q16, 1)),
                                               _mm_set1_epi16(1));
            const __m128i s2 = _mm_add_epi32(s16, _mm_shuffle_epi32(s16, 0x4E));
            sum_q[h] = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
        }
        set_int8_sums(qx, b * G + g, dg, sum_q, exact);
    }
}
#endif

/* Rows [b0, b1) of x [B, K] (threads prepare disjoint rows) as `mode` takes them: int16 for
 * matmul_int16, int8 groups for its MM_INT8 columns, or bf16 A tiles for matmul_amx. */
static void quantize_x(const float *x, int K, qx_t *qx, int b0, int b1, int mode) {
    const int G = K / GROUP;
    for (int b = b0; b < b1; b++) {
        const float *row = x + (size_t)b * K;
#if HAVE_INT8_Q4
        if (mode == MM_INT8) quantize_q8_row(row, K, qx, b); /* and the int16 rows below */
#endif
#if HAVE_INT8
        if (mode == MM_INT8) {
            int8_t *dst = qx->q8 + (size_t)b * K;
            for (int g = 0; g < G; g++) {
                const __m512 lo = _mm512_loadu_ps(row + g * GROUP), hi = _mm512_loadu_ps(row + g * GROUP + 16);
                const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
                const __m512 s = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
                const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, s)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, s));
                _mm_storeu_si128((__m128i *)(dst + g * GROUP), _mm512_cvtsepi32_epi8(qlo));
                _mm_storeu_si128((__m128i *)(dst + g * GROUP + 16), _mm512_cvtsepi32_epi8(qhi));
                const int sum_q[2] = {_mm512_reduce_add_epi32(qlo), _mm512_reduce_add_epi32(qhi)};
                const float exact = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
                set_int8_sums(qx, b * G + g, amax / 127.0f, sum_q, exact);
                qx->sx[(size_t)b * G + g] = exact;
            }
#if HAVE_BF16DOT
            for (int k = 0; k < K; k += 16)
                _mm256_storeu_si256((__m256i *)(qx->bf + (size_t)b * K + k),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + k)));
#endif
            continue;
        }
#endif
        if (mode == MM_AMX) { /* row b's group g at tile (b / 16, g), row b % 16: tiles of 16 rows x 32 contiguous */
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
#elif defined(__AVX2__) && defined(__FMA__)
            /* (the scalar loop below compiles to one vcvtss2si per input: 1.5-2 ms of a 16-row AVX2 step) */
            const __m256 idv = _mm256_set1_ps(id);
            __m256 sum = _mm256_setzero_ps();
            for (int h = 0; h < 2; h++) {
                const __m256 a = _mm256_loadu_ps(p + 16 * h), c = _mm256_loadu_ps(p + 16 * h + 8);
                sum = _mm256_add_ps(sum, _mm256_add_ps(a, c));
                const __m256i q = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(a, idv)),
                                                     _mm256_cvtps_epi32(_mm256_mul_ps(c, idv)));
                _mm256_storeu_si256((__m256i *)(dst + g * GROUP + 16 * h), _mm256_permute4x64_epi64(q, 0xD8));
            }
            qx->sx[(size_t)b * G + g] = hsum8(sum) * id;
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

/* How a step of B rows multiplies: from `amx_rows` rows on (0: never) on AMX tiles where this build and
 * the OS allow it; else from `wide_rows` rows on (0: never) in int8 dot products where this build has
 * them (AVX-512 VNNI, AVX2's 4-6 bit ones); else int16. On a CPU with both, int8 wins the middle sizes:
 * AMX widens each weight block to bf16 for every 32 rows, which a few rows cannot repay (Xeon, SmolLM2:
 * 8 rows 6.3 ms int8 vs 9.1 AMX, 32 rows 21.5 vs 17.1). */
static int wide_mode(int B, int wide_rows, int amx_rows) {
    if (amx_rows > 0 && B >= amx_rows && amx_usable()) return MM_AMX;
    if (wide_rows <= 0 || B < wide_rows) return MM_INT16;
    return HAVE_INT8 || HAVE_INT8_Q4 ? MM_INT8 : MM_INT16;
}

/* The int8 matmul this build gives steps of several rows: "int8" (its 16-bit tiles in fp32 FMAs),
 * "int8+bf16" (in bf16 dot products), "int8 4-6 bit" (AVX2: int8 inputs for the 4-bit, 5-bit, TILES_Q6 and
 * TILES_Q8G6 tiles only), "int8 avx-vnni" (AVX2 with AVX-VNNI: for the int8-range tiles and the output
 * layer's int8 copy too; the 16-bit tiles int16) or "" (none); AMX, where usable, is sluice_amx_available's. */
const char *sluice_wide_matmul(void) {
    return HAVE_BF16DOT ? "int8+bf16" : HAVE_INT8 ? "int8" : HAVE_AVXVNNI ? "int8 avx-vnni" : HAVE_INT8_Q4 ? "int8 4-6 bit" : "";
}

/* TILES_Q6 only in the AVX2 build (HAVE_INT8_Q4): elsewhere Q6_K's codes are TILES_Q8G6. */
int sluice_reads_tiles(int format) {
    return (format >= TILES_Q4 && format <= TILES_Q5K) || (HAVE_INT8_Q4 && format == TILES_Q6);
}

#if defined(__AVX2__)
/* Lane i (of 16) = 16 where bit i of `bits` is set, else 0: a TILES_Q5 code's fifth bit for 16-bit lanes. */
static inline __m256i fifth_bits_epi16(uint32_t bits) {
    const __m256i sel = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, -32768);
    return _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((short)bits), sel), sel),
                            _mm256_set1_epi16(16));
}
#endif

/* A 4-bit block's kind, a constant of each column function: Q_FIVE, its codes' fifth bits follow the
 * nibbles (TILES_Q5, TILES_Q5K); Q_KS, a K type's own scales (TILES_Q4K, TILES_Q5K): row n's d = D[n] sc[n]
 * and m = M[n] mn[n], sc and mn the block's 6-bit bytes, D and M (fp16, M = -dmin) its super-block's (the 8
 * blocks of 256 inputs): 8 bytes of them in each of its blocks, block 8s + i holding D of rows 4i..4i+3
 * for i < 4, M of rows 4(i - 4)..4(i - 4)+3 for i >= 4. 40 bytes a block where fp16 d and m take 64, and
 * the products exact (held as one fp16 they were rounded). Else each row's d and m as fp16. */
enum { Q_FIVE = 1, Q_KS = 2 };
#define Q_BYTES(kind) (256 + ((kind) & Q_FIVE ? 64 : 0) + ((kind) & Q_KS ? 40 : 64))
#define Q_D(blk, kind) ((blk) + ((kind) & Q_FIVE ? 320 : 256)) /* fp16 d[16], or (Q_KS) uint8 sc[16] */
#define Q_M(blk, kind) (Q_D(blk, kind) + ((kind) & Q_KS ? 16 : 32)) /* fp16 m[16], or uint8 mn[16] */
#define Q_SUP(blk, kind) (Q_D(blk, kind) + 32) /* Q_KS: the block's 8 bytes of its super-block's D and M */
static inline uint64_t fifth_bits(const uint8_t *blk, int p) {
    uint64_t hb;
    memcpy(&hb, blk + 256 + 8 * p, 8);
    return hb;
}

/* The 8 bytes of super-block scales that block g0 + i of a column holds (g0 a multiple of 8). */
static inline uint64_t ks_slice(const uint8_t *col, int g0, int i, int kind) {
    uint64_t v;
    memcpy(&v, Q_SUP(col + (size_t)(g0 + i) * Q_BYTES(kind), kind), 8);
    return v;
}

/* Q_KS: the super-block scales of the 8 blocks from g0 (D and M of the 16 rows), kept while a column's
 * blocks are read in order (gathered again only when g0 changes: once per 8 blocks). g0 -1: none yet. */
typedef struct {
    int g0;
    float D[TILE_N], M[TILE_N];
} ks_rows_t;

/* Block g's d and m of its 16 rows (plain C). */
static inline void q_dm_rows(const uint8_t *col, int g, int kind, ks_rows_t *ks, float *d, float *m) {
    const uint8_t *blk = col + (size_t)g * Q_BYTES(kind);
    if (!(kind & Q_KS)) {
        for (int n = 0; n < TILE_N; n++) {
            uint16_t dh, mh;
            memcpy(&dh, Q_D(blk, kind) + 2 * n, 2), memcpy(&mh, Q_M(blk, kind) + 2 * n, 2);
            d[n] = fp16_to_f32(dh), m[n] = fp16_to_f32(mh);
        }
        return;
    }
    if (ks->g0 != (g & ~7)) {
        uint16_t sup[32];
        for (int i = 0; i < 8; i++) {
            const uint64_t v = ks_slice(col, g & ~7, i, kind);
            memcpy(sup + 4 * i, &v, 8);
        }
        for (int n = 0; n < TILE_N; n++) ks->D[n] = fp16_to_f32(sup[n]), ks->M[n] = fp16_to_f32(sup[16 + n]);
        ks->g0 = g & ~7;
    }
    for (int n = 0; n < TILE_N; n++) d[n] = ks->D[n] * (float)Q_D(blk, kind)[n], m[n] = ks->M[n] * (float)Q_M(blk, kind)[n];
}

#if defined(__AVX512F__)
typedef struct { /* ks_rows_t's vectors */
    int g0;
    __m512 D, M;
} ks16_t;

/* Block g's d and m of its 16 rows. */
static inline __attribute__((always_inline)) void q_dm16(const uint8_t *col, int g, int kind, ks16_t *ks, __m512 *d,
                                                         __m512 *m) {
    const uint8_t *blk = col + (size_t)g * Q_BYTES(kind);
    if (!(kind & Q_KS)) {
        *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)Q_D(blk, kind)));
        *m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)Q_M(blk, kind)));
        return;
    }
    const int g0 = g & ~7;
    if (ks->g0 != g0) {
        const __m256i dh = _mm256_set_epi64x((long long)ks_slice(col, g0, 3, kind), (long long)ks_slice(col, g0, 2, kind),
                                             (long long)ks_slice(col, g0, 1, kind), (long long)ks_slice(col, g0, 0, kind));
        const __m256i mh = _mm256_set_epi64x((long long)ks_slice(col, g0, 7, kind), (long long)ks_slice(col, g0, 6, kind),
                                             (long long)ks_slice(col, g0, 5, kind), (long long)ks_slice(col, g0, 4, kind));
        ks->D = _mm512_cvtph_ps(dh), ks->M = _mm512_cvtph_ps(mh), ks->g0 = g0;
    }
    *d = _mm512_mul_ps(ks->D, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)Q_D(blk, kind)))));
    *m = _mm512_mul_ps(ks->M, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)Q_M(blk, kind)))));
}
#elif defined(__AVX2__) && defined(__F16C__)
typedef struct { /* ks_rows_t's vectors: rows 0-7 and 8-15 */
    int g0;
    __m256 D[2], M[2];
} ks8_t;

/* Block g's d and m of rows 8o..8o+7. */
static inline __attribute__((always_inline)) void q_dm8(const uint8_t *col, int g, int kind, int o, ks8_t *ks,
                                                        __m256 *d, __m256 *m) {
    const uint8_t *blk = col + (size_t)g * Q_BYTES(kind);
    if (!(kind & Q_KS)) {
        *d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(Q_D(blk, kind) + 16 * o)));
        *m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(Q_M(blk, kind) + 16 * o)));
        return;
    }
    const int g0 = g & ~7;
    if (ks->g0 != g0) {
        for (int h = 0; h < 2; h++) {
            ks->D[h] = _mm256_cvtph_ps(_mm_set_epi64x((long long)ks_slice(col, g0, 2 * h + 1, kind),
                                                      (long long)ks_slice(col, g0, 2 * h, kind)));
            ks->M[h] = _mm256_cvtph_ps(_mm_set_epi64x((long long)ks_slice(col, g0, 5 + 2 * h, kind),
                                                      (long long)ks_slice(col, g0, 4 + 2 * h, kind)));
        }
        ks->g0 = g0;
    }
    *d = _mm256_mul_ps(ks->D[o], _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(Q_D(blk, kind) + 8 * o)))));
    *m = _mm256_mul_ps(ks->M[o], _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(Q_M(blk, kind) + 8 * o)))));
}
#endif

#if HAVE_INT8
/* The int8 paths' order of a pair p's fifth bits: bit 4n + j for input 4p + j of output row n. */
static inline uint64_t fifth_bits_i8(uint64_t hb) {
    return _pdep_u64(hb & 0xffffffffu, 0x3333333333333333ull) | _pdep_u64(hb >> 32, 0xCCCCCCCCCCCCCCCCull);
}
#endif

#if defined(__AVX2__)
/* Byte i (of 32) = 16 where bit i of x is set, else 0. */
static inline __m256i fifth_bits_bytes(uint32_t x) {
    const __m256i shuf = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202,
                                            0x0303030303030303);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuf);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8(16));
}

/* The fifth bits (16 where set) of pair p's output rows 8o..8o+7 in the AVX2 int8 columns' lanes of four
 * codes (decode_q4_i8, q4_column_i8d): bytes 2n + j of the bits of inputs 4p + j (row 8o + n), 16 + 2n + j
 * of 4p + 2 + j, then their words n side by side, as the codes'. */
static inline __m256i fifth_bits_quads(const uint8_t *blk, int p, int o) {
    const uint64_t hb = fifth_bits(blk, p);
    const __m256i e = fifth_bits_bytes(((uint32_t)(hb >> (16 * o)) & 0xffff) | (uint32_t)(hb >> (32 + 16 * o)) << 16);
    const __m128i a = _mm256_castsi256_si128(e), c = _mm256_extracti128_si256(e, 1);
    return _mm256_set_m128i(_mm_unpackhi_epi16(a, c), _mm_unpacklo_epi16(a, c));
}
#endif

/* One column of blocks (16 output rows n0.., all K) for nb <= ROWS_PER_PASS input rows: y[b, n0 + n].
 * kind: Q_FIVE (the fifth bits or-ed into the codes) and Q_KS (K-type scales), a constant: a function each. */
static inline __attribute__((always_inline)) void q4_column(const uint8_t *col, int G, const qx_t *qx, int K,
                                                            int nb, float *y, int ldy, int kind) {
    const int five = kind & Q_FIVE;
    float out[ROWS_PER_PASS][TILE_N];
#if defined(__AVX512F__) && defined(__AVX512BW__)
    ks16_t ks = {-1, _mm512_setzero_ps(), _mm512_setzero_ps()};
    __m512 accf[ROWS_PER_PASS];
    for (int b = 0; b < nb; b++) accf[b] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi16(0xf), sixteen = _mm512_set1_epi16(16);
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = col + (size_t)g * Q_BYTES(kind);
        prefetch_l2(blk + PREFETCH_AHEAD, Q_BYTES(kind));
        __m512i acc[ROWS_PER_PASS];
        for (int b = 0; b < nb; b++) acc[b] = _mm512_setzero_si512();
        for (int p = 0; p < 8; p++) {
            __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 32 * p)));
            __m512i w0 = _mm512_and_si512(w, low), w1 = _mm512_srli_epi16(w, 4);
            if (five) {
                const uint64_t hb = fifth_bits(blk, p);
                w0 = _mm512_mask_add_epi16(w0, (__mmask32)hb, w0, sixteen);
                w1 = _mm512_mask_add_epi16(w1, (__mmask32)(hb >> 32), w1, sixteen);
            }
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
        __m512 d, m;
        q_dm16(col, g, kind, &ks, &d, &m);
        for (int b = 0; b < nb; b++) {
            accf[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[b]), d, accf[b]);
            accf[b] = _mm512_fmadd_ps(m, _mm512_set1_ps(qx->sx[(size_t)b * G + g]), accf[b]);
        }
    }
    for (int b = 0; b < nb; b++) _mm512_storeu_ps(out[b], accf[b]);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    ks8_t ks = {-1, {_mm256_setzero_ps(), _mm256_setzero_ps()}, {_mm256_setzero_ps(), _mm256_setzero_ps()}};
    for (int b = 0; b < nb; b++) memset(out[b], 0, sizeof out[b]);
    const __m256i low = _mm256_set1_epi16(0xf);
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = col + (size_t)g * Q_BYTES(kind);
        prefetch_l2(blk + PREFETCH_AHEAD, Q_BYTES(kind));
        __m256i acc[ROWS_PER_PASS][2];
        for (int b = 0; b < nb; b++) acc[b][0] = acc[b][1] = _mm256_setzero_si256();
        for (int p = 0; p < 8; p++) {
            /* bytes 0-15: output rows 0-7, bytes 16-31: rows 8-15 */
            __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 32 * p)));
            __m256i hi = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + 32 * p + 16)));
            __m256i lo0 = _mm256_and_si256(lo, low), lo1 = _mm256_srli_epi16(lo, 4);
            __m256i hi0 = _mm256_and_si256(hi, low), hi1 = _mm256_srli_epi16(hi, 4);
            if (five) {
                const uint64_t hb = fifth_bits(blk, p);
                lo0 = _mm256_or_si256(lo0, fifth_bits_epi16((uint32_t)hb & 0xffff));
                hi0 = _mm256_or_si256(hi0, fifth_bits_epi16((uint32_t)(hb >> 16) & 0xffff));
                lo1 = _mm256_or_si256(lo1, fifth_bits_epi16((uint32_t)(hb >> 32) & 0xffff));
                hi1 = _mm256_or_si256(hi1, fifth_bits_epi16((uint32_t)(hb >> 48)));
            }
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
            __m256 d, m;
            q_dm8(col, g, kind, h, &ks, &d, &m);
            for (int b = 0; b < nb; b++) {
                __m256 o = _mm256_loadu_ps(out[b] + 8 * h);
                o = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[b][h]), d, o);
                o = _mm256_fmadd_ps(m, _mm256_set1_ps(qx->sx[(size_t)b * G + g]), o);
                _mm256_storeu_ps(out[b] + 8 * h, o);
            }
        }
    }
#else
    ks_rows_t ks = {.g0 = -1};
    for (int b = 0; b < nb; b++) memset(out[b], 0, sizeof out[b]);
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = col + (size_t)g * Q_BYTES(kind);
        float dw[TILE_N], mw[TILE_N];
        q_dm_rows(col, g, kind, &ks, dw, mw);
        for (int b = 0; b < nb; b++) {
            const int16_t *xq = qx->q + (size_t)b * K + g * GROUP;
            int32_t s[TILE_N] = {0};
            for (int p = 0; p < 8; p++) {
                const uint64_t hb = five ? fifth_bits(blk, p) : 0;
                for (int i = 0; i < 32; i++) {
                    const uint8_t c = blk[32 * p + i];
                    const int n = i / 2, j = i % 2;
                    const int c0 = (c & 0xf) | (int)((hb >> i) & 1) << 4, c1 = (c >> 4) | (int)((hb >> (32 + i)) & 1) << 4;
                    s[n] += c0 * xq[4 * p + j] + c1 * xq[4 * p + 2 + j];
                }
            }
            const float sx = qx->sx[(size_t)b * G + g];
            for (int n = 0; n < TILE_N; n++) out[b][n] += (float)s[n] * dw[n] + mw[n] * sx;
        }
    }
#endif
    for (int b = 0; b < nb; b++)
        for (int n = 0; n < TILE_N; n++) y[(size_t)b * ldy + n] = out[b][n] * qx->dx[b];
}

/* The int32 dot products of tile rows [r0, r1) of an int8 block (Q8G's codes, the output layer's) with
 * nb input rows' int16 pairs, added to acc[b] (AVX-512: all 16 output rows; AVX2: rows 0-7 and 8-15). */
#if defined(__AVX512F__) && defined(__AVX512BW__)
static inline __attribute__((always_inline)) void q8_tile_rows(const uint8_t *blk, int r0, int r1, const qx_t *qx,
                                                               int K, int g, int nb, __m512i *acc) {
    for (int r = r0; r < r1; r++) {
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
}
#elif defined(__AVX2__) && defined(__FMA__)
/* (AVX2: output rows 8 (o0 + q)..8 (o0 + q) + 7 into acc[b][q] for q < no: AVX2's 16 registers hold both
 * halves' sums for up to 3 input rows, one half's for 8) */
static inline __attribute__((always_inline)) void q8_tile_rows(const uint8_t *blk, int r0, int r1, int o0, int no,
                                                               const qx_t *qx, int K, int g, int nb,
                                                               __m256i (*acc)[2]) {
    for (int r = r0; r < r1; r++) {
        __m256i w[2];
        for (int q = 0; q < no; q++)
            w[q] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 32 * r + 16 * (o0 + q))));
        for (int b = 0; b < nb; b++) {
            int32_t xp;
            memcpy(&xp, qx->q + (size_t)b * K + g * GROUP + 2 * r, 4);
            const __m256i xv = _mm256_set1_epi32(xp);
            for (int q = 0; q < no; q++) acc[b][q] = _mm256_add_epi32(acc[b][q], _mm256_madd_epi16(w[q], xv));
        }
    }
}
#endif

#define Q8_BYTES(one) ((one) ? Q80_BLOCK_BYTES : Q8G_BLOCK_BYTES)

/* One column of Q8G blocks (int8 codes, d per half group, m per group) for nb <= ROWS_PER_PASS input rows:
 * y[b, n0 + n]. Each half group's int32 sums (127 * 32767 * 16 < 2^31) take their own d; `one` (TILES_Q8:
 * one d per group, no min): the group's sums in one integer (127 * 32767 * 32 < 2^31), one d, no m. */
static inline __attribute__((always_inline)) void q8g_column(const uint8_t *col, int G, const qx_t *qx, int K,
                                                             int nb, float *y, int ldy, int one) {
    float out[ROWS_PER_PASS][TILE_N];
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 accf[ROWS_PER_PASS];
    for (int b = 0; b < nb; b++) accf[b] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = col + (size_t)g * Q8_BYTES(one);
        prefetch_l2(blk + PREFETCH_AHEAD, Q8_BYTES(one));
        for (int h = 0; h < (one ? 1 : 2); h++) {
            __m512i acc[ROWS_PER_PASS];
            for (int b = 0; b < nb; b++) acc[b] = _mm512_setzero_si512();
            q8_tile_rows(blk, one ? 0 : 8 * h, one ? 16 : 8 * h + 8, qx, K, g, nb, acc);
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 512 + 32 * h)));
            for (int b = 0; b < nb; b++) accf[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[b]), d, accf[b]);
        }
        if (one) continue;
        __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 576)));
        for (int b = 0; b < nb; b++) accf[b] = _mm512_fmadd_ps(m, _mm512_set1_ps(qx->sx[(size_t)b * G + g]), accf[b]);
    }
    for (int b = 0; b < nb; b++) _mm512_storeu_ps(out[b], accf[b]);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    /* output rows 8o..8o+7 at a time for many input rows, all 16 for up to 3 (q8_tile_rows) */
    const int O2 = nb <= 3 ? 2 : 1;
    for (int o0 = 0; o0 < 2; o0 += O2) {
        __m256 accf[ROWS_PER_PASS][2];
        for (int b = 0; b < nb; b++) accf[b][0] = accf[b][1] = _mm256_setzero_ps();
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = col + (size_t)g * Q8_BYTES(one);
            if (o0 == 0) prefetch_l2(blk + PREFETCH_AHEAD, Q8_BYTES(one));
            for (int h = 0; h < (one ? 1 : 2); h++) {
                __m256i acc[ROWS_PER_PASS][2];
                for (int b = 0; b < nb; b++) acc[b][0] = acc[b][1] = _mm256_setzero_si256();
                q8_tile_rows(blk, one ? 0 : 8 * h, one ? 16 : 8 * h + 8, o0, O2, qx, K, g, nb, acc);
                for (int q = 0; q < O2; q++) {
                    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 512 + 32 * h + 16 * (o0 + q))));
                    for (int b = 0; b < nb; b++) accf[b][q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[b][q]), d, accf[b][q]);
                }
            }
            if (one) continue;
            for (int q = 0; q < O2; q++) {
                const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 576 + 16 * (o0 + q))));
                for (int b = 0; b < nb; b++)
                    accf[b][q] = _mm256_fmadd_ps(m, _mm256_set1_ps(qx->sx[(size_t)b * G + g]), accf[b][q]);
            }
        }
        for (int b = 0; b < nb; b++)
            for (int q = 0; q < O2; q++) _mm256_storeu_ps(out[b] + 8 * (o0 + q), accf[b][q]);
    }
#else
    for (int b = 0; b < nb; b++) memset(out[b], 0, sizeof out[b]);
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = col + (size_t)g * Q8_BYTES(one);
        const int8_t *q = (const int8_t *)blk;
        const uint16_t *dw = (const uint16_t *)(blk + 512), *mw = (const uint16_t *)(blk + 576);
        const int d1 = one ? 0 : 16; /* (TILES_Q8: one d, no m) */
        for (int b = 0; b < nb; b++) {
            const int16_t *xq = qx->q + (size_t)b * K + g * GROUP;
            int32_t s[2][TILE_N] = {{0}};
            for (int r = 0; r < 16; r++)
                for (int i = 0; i < 32; i++) s[r / 8][i / 2] += (int32_t)q[32 * r + i] * xq[2 * r + i % 2];
            const float sx = qx->sx[(size_t)b * G + g];
            for (int n = 0; n < TILE_N; n++)
                out[b][n] += (float)s[0][n] * fp16_to_f32(dw[n]) + (float)s[1][n] * fp16_to_f32(dw[d1 + n]) +
                             (one ? 0.0f : fp16_to_f32(mw[n]) * sx);
        }
    }
#endif
    for (int b = 0; b < nb; b++)
        for (int n = 0; n < TILE_N; n++) y[(size_t)b * ldy + n] = out[b][n] * qx->dx[b];
}

/* 16 fp16 (bf16: `bf16` set) weights -> fp32; bf16 is fp32's high half, a widening and a shift. */
#if defined(__AVX512F__)
static inline __attribute__((always_inline)) __m512 half16_ps(const uint8_t *p, int bf16) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)) : _mm512_cvtph_ps(h);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
static inline __attribute__((always_inline)) __m256 half8_ps(const uint8_t *p, int bf16) { /* 8 of them */
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
}
#endif

/* One column of F16 or BF16 blocks (`bf16`) for nb <= ROWS_PER_PASS input rows: y[b, n0 + n] = sum_k x[b, k]
 * W[n0 + n, k] in fp32 from the fp32 inputs (xf, [nb, K]): 16-bit weights keep their 11 (8) bits, which
 * int16 dot products would not. A tile row's 32 lanes are 16 output rows by 2 inputs: the pairs are added
 * at the end. */
static inline __attribute__((always_inline)) void f16_column(const uint8_t *col, int G, const float *xf, int K, int nb,
                                                             float *y, int ldy, int bf16) {
    float out[ROWS_PER_PASS][TILE_N];
#if defined(__AVX512F__)
    __m512 acc[ROWS_PER_PASS][2];
    for (int b = 0; b < nb; b++) acc[b][0] = acc[b][1] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = col + (size_t)g * F16_BLOCK_BYTES;
        prefetch_l2(blk + PREFETCH_AHEAD, F16_BLOCK_BYTES);
        for (int r = 0; r < 16; r++) {
            const __m512 wa = half16_ps(blk + 64 * r, bf16);      /* rows 0-7 */
            const __m512 wb = half16_ps(blk + 64 * r + 32, bf16); /* rows 8-15 */
            for (int b = 0; b < nb; b++) {
                double pair;
                memcpy(&pair, xf + (size_t)b * K + g * GROUP + 2 * r, 8);
                const __m512 xv = _mm512_castpd_ps(_mm512_set1_pd(pair)); /* x[2r], x[2r + 1], x[2r], ... */
                acc[b][0] = _mm512_fmadd_ps(wa, xv, acc[b][0]);
                acc[b][1] = _mm512_fmadd_ps(wb, xv, acc[b][1]);
            }
        }
    }
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    for (int b = 0; b < nb; b++)
        _mm512_storeu_ps(out[b], _mm512_add_ps(_mm512_permutex2var_ps(acc[b][0], even, acc[b][1]),
                                               _mm512_permutex2var_ps(acc[b][0], odd, acc[b][1])));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    /* lanes of rows 0-3, 4-7, 8-11, 12-15 (pairs): QS of those quarters a pass, so that the nb * QS sums, the
     * QS weight vectors and an input pair fit AVX2's 16 registers (all four quarters for 8 rows spilled the
     * sums to the stack: a load and a store per FMA) */
    const int QS = nb <= 2 ? 4 : nb <= 5 ? 2 : 1;
    for (int q0 = 0; q0 < 4; q0 += QS) {
        __m256 acc[ROWS_PER_PASS][4];
        for (int b = 0; b < nb; b++)
            for (int q = 0; q < QS; q++) acc[b][q] = _mm256_setzero_ps();
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = col + (size_t)g * F16_BLOCK_BYTES;
            if (q0 == 0) prefetch_l2(blk + PREFETCH_AHEAD, F16_BLOCK_BYTES);
            for (int r = 0; r < 16; r++) {
                __m256 w[4];
                for (int q = 0; q < QS; q++) w[q] = half8_ps(blk + 64 * r + 16 * (q0 + q), bf16);
                for (int b = 0; b < nb; b++) {
                    double pair;
                    memcpy(&pair, xf + (size_t)b * K + g * GROUP + 2 * r, 8);
                    const __m256 xv = _mm256_castpd_ps(_mm256_set1_pd(pair));
                    for (int q = 0; q < QS; q++) acc[b][q] = _mm256_fmadd_ps(w[q], xv, acc[b][q]);
                }
            }
        }
        for (int b = 0; b < nb; b++)
            for (int q = 0; q < QS; q++) {
                float lanes[8];
                _mm256_storeu_ps(lanes, acc[b][q]);
                for (int n = 0; n < 4; n++) out[b][4 * (q0 + q) + n] = lanes[2 * n] + lanes[2 * n + 1];
            }
    }
#else
    for (int b = 0; b < nb; b++) memset(out[b], 0, sizeof out[b]);
    for (int g = 0; g < G; g++) {
        const uint16_t *blk = (const uint16_t *)(col + (size_t)g * F16_BLOCK_BYTES);
        for (int b = 0; b < nb; b++) {
            const float *xp = xf + (size_t)b * K + g * GROUP;
            for (int r = 0; r < 16; r++)
                for (int i = 0; i < 32; i++)
                    out[b][i / 2] += (bf16 ? bf16_to_f32(blk[32 * r + i]) : fp16_to_f32(blk[32 * r + i])) * xp[2 * r + i % 2];
        }
    }
#endif
    for (int b = 0; b < nb; b++)
        for (int n = 0; n < TILE_N; n++) y[(size_t)b * ldy + n] = out[b][n];
}

#if HAVE_INT8
/* One column of Q4 blocks for nb <= ROWS_PER_PASS rows of int8 inputs (MM_INT8): y[b, n0 + n]. A pair
 * of tile rows (32 bytes: inputs 4p..4p+3 of the 16 output rows, two to a byte) becomes one vector of 16
 * lanes of 4 codes each, in input order: word n (bytes 2n, 2n + 1) widened to lane n, its high nibbles
 * moved up by 12 bits, every byte masked to its low nibble. */
static inline __attribute__((always_inline)) __m512i q4_codes_i8(const uint8_t *blk, int p, int five) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(blk + 32 * p)));
    __m512i w = _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), _mm512_set1_epi8(0x0f), 0xA8); /* (v | v << 12) & 0x0f.. */
    if (five) /* byte 4n + j: the fifth bit of input 4p + j, row n (2n + j, or 32 + 2n + j - 2) */
        w = _mm512_mask_add_epi8(w, fifth_bits_i8(fifth_bits(blk, p)), w, _mm512_set1_epi8(16));
    return w;
}

/* (wv: the column's codes already decoded, wv[8 g + p] = q4_codes_i8 of group g, pair p: decode_q4_i8) */
static inline __attribute__((always_inline)) void q4_column_i8(const uint8_t *col, int G, const qx_t *qx, int K,
                                                               int nb, float *y, int ldy, int kind,
                                                               const __m512i *wv) {
    const int five = kind & Q_FIVE;
    ks16_t ks = {-1, _mm512_setzero_ps(), _mm512_setzero_ps()};
    __m512 accf[ROWS_PER_PASS];
    for (int b = 0; b < nb; b++) accf[b] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = col + (size_t)g * Q_BYTES(kind);
        if (!wv) prefetch_l2(blk + PREFETCH_AHEAD, Q_BYTES(kind));
        const int8_t *xg = qx->q8 + g * GROUP;
        __m512i acc[ROWS_PER_PASS];
        for (int b = 0; b < nb; b++) acc[b] = _mm512_setzero_si512();
        for (int p = 0; p < 8; p++) {
            const __m512i w = wv ? _mm512_load_si512(wv + 8 * (size_t)g + p) : q4_codes_i8(blk, p, five);
            for (int b = 0; b < nb; b++) {
                int32_t xv;
                memcpy(&xv, xg + (size_t)b * K + 4 * p, 4);
                acc[b] = _mm512_dpbusd_epi32(acc[b], w, _mm512_set1_epi32(xv));
            }
        }
        /* d (dg (codes . inputs) + ce) + m sx: the codes' products centred on CODE_CENTRE in ce */
        __m512 d, m;
        q_dm16(col, g, kind, &ks, &d, &m);
        for (int b = 0; b < nb; b++) {
            const size_t i = (size_t)b * G + g;
            const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[b]), _mm512_set1_ps(qx->dg[i]),
                                             _mm512_set1_ps(qx->ce[2 * i + (five ? 1 : 0)]));
            accf[b] = _mm512_fmadd_ps(m, _mm512_set1_ps(qx->sx[i]), _mm512_fmadd_ps(d, t, accf[b]));
        }
    }
    for (int b = 0; b < nb; b++) _mm512_storeu_ps(y + (size_t)b * ldy, accf[b]);
}

/* A column's 4-bit (five: 5-bit) codes as q4_column_i8 multiplies them, decoded once into a thread's
 * buffer (L1/L2-resident) for every pass of 8 rows over the column. */
static void decode_q4_i8(const uint8_t *col, int G, int kind, __m512i *wv) {
    const int five = kind & Q_FIVE;
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = col + (size_t)g * Q_BYTES(kind);
        prefetch_l2(blk + PREFETCH_AHEAD, Q_BYTES(kind));
        for (int p = 0; p < 8; p++) _mm512_store_si512(wv + 8 * (size_t)g + p, q4_codes_i8(blk, p, five));
    }
}

/* Tile rows r and r + 1 of an int8 block (inputs 2r..2r+3) as 16 lanes of 4 unsigned bytes in input
 * order (words n and 16 + n side by side), offset by 128. */
static inline __m512i q8_pair_u8(const uint8_t *blk, int r) {
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_xor_si512(_mm512_permutexvar_epi16(pairs, _mm512_loadu_si512(blk + 32 * r)),
                            _mm512_set1_epi8((char)0x80));
}

/* acc[b] += the int32 dot products of tile rows [r0, r1) (r0, r1 even) of an int8 block with nb rows'
 * int8 inputs, each still holding 128 * the sum of its inputs (the weights' offset). wv: the block's pairs
 * already as q8_pair_u8 gives them (decode_q8_i8), or NULL. */
static inline __attribute__((always_inline)) void q8_tile_rows_i8(const uint8_t *blk, int r0, int r1, const qx_t *qx,
                                                                  int K, int g, int nb, __m512i *acc,
                                                                  const __m512i *wv) {
    for (int r = r0; r < r1; r += 2) {
        const __m512i w = wv ? _mm512_load_si512(wv + r / 2) : q8_pair_u8(blk, r);
        for (int b = 0; b < nb; b++) {
            int32_t xv;
            memcpy(&xv, qx->q8 + (size_t)b * K + g * GROUP + 2 * r, 4);
            acc[b] = _mm512_dpbusd_epi32(acc[b], w, _mm512_set1_epi32(xv));
        }
    }
}

/* accf[b] += group g of an int8 block (the tile rows of both halves) dotted with nb rows' int8 inputs, less
 * the weights' offset, times the group's input scale dg and (`d`: a Q8G block's) each half's weight scales;
 * the output layer's blocks (no `d`) take theirs per row after. */
static inline __attribute__((always_inline)) void q8_group_i8(const uint8_t *blk, const qx_t *qx, int K, int G, int g,
                                                              int nb, int d, __m512 *accf, const __m512i *wv) {
    __m512i acc[ROWS_PER_PASS];
    if (!d) { /* one scale for the group: both halves in one sum */
        for (int b = 0; b < nb; b++) acc[b] = _mm512_setzero_si512();
        q8_tile_rows_i8(blk, 0, 16, qx, K, g, nb, acc, wv);
        for (int b = 0; b < nb; b++) {
            const size_t i = (size_t)b * G + g;
            const __m512i s = _mm512_sub_epi32(acc[b], _mm512_set1_epi32(qx->s8[2 * i] + qx->s8[2 * i + 1]));
            accf[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(qx->dg[i]), accf[b]);
        }
        return;
    }
    __m512 t[ROWS_PER_PASS];
    for (int h = 0; h < 2; h++) {
        for (int b = 0; b < nb; b++) acc[b] = _mm512_setzero_si512();
        q8_tile_rows_i8(blk, 8 * h, 8 * h + 8, qx, K, g, nb, acc, wv);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 512 + 32 * h)));
        for (int b = 0; b < nb; b++) {
            const __m512 s = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[b], _mm512_set1_epi32(qx->s8[2 * ((size_t)b * G + g) + h])));
            t[b] = h ? _mm512_fmadd_ps(s, dw, t[b]) : _mm512_mul_ps(s, dw);
        }
    }
    for (int b = 0; b < nb; b++) accf[b] = _mm512_fmadd_ps(t[b], _mm512_set1_ps(qx->dg[(size_t)b * G + g]), accf[b]);
}

/* One column of TILES_Q8 blocks (Q8G's with one d per group and no min) for nb <= ROWS_PER_PASS rows of
 * int8 inputs: y[b, n0 + n] = d (dg sum (q + 128) x8 + o8), both halves in one integer sum. */
static inline __attribute__((always_inline)) void q8_0_column_i8(const uint8_t *col, int G, const qx_t *qx, int K,
                                                                 int nb, float *y, int ldy, const __m512i *wv) {
    __m512 accf[ROWS_PER_PASS];
    for (int b = 0; b < nb; b++) accf[b] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = col + (size_t)g * Q80_BLOCK_BYTES;
        if (!wv) prefetch_l2(blk + PREFETCH_AHEAD, Q80_BLOCK_BYTES);
        __m512i acc[ROWS_PER_PASS];
        for (int b = 0; b < nb; b++) acc[b] = _mm512_setzero_si512();
        q8_tile_rows_i8(blk, 0, 16, qx, K, g, nb, acc, wv ? wv + 8 * (size_t)g : NULL);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 512)));
        for (int b = 0; b < nb; b++) {
            const size_t i = (size_t)b * G + g;
            const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[b]), _mm512_set1_ps(qx->dg[i]), _mm512_set1_ps(qx->o8[i]));
            accf[b] = _mm512_fmadd_ps(d, t, accf[b]);
        }
    }
    for (int b = 0; b < nb; b++) _mm512_storeu_ps(y + (size_t)b * ldy, accf[b]);
}

/* One column of Q8G blocks for nb <= ROWS_PER_PASS rows of int8 inputs: y[b, n0 + n]. */
static inline __attribute__((always_inline)) void q8g_column_i8(const uint8_t *col, int G, const qx_t *qx, int K,
                                                                int nb, float *y, int ldy, const __m512i *wv) {
    __m512 accf[ROWS_PER_PASS];
    for (int b = 0; b < nb; b++) accf[b] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = col + (size_t)g * Q8G_BLOCK_BYTES;
        if (!wv) prefetch_l2(blk + PREFETCH_AHEAD, Q8G_BLOCK_BYTES);
        q8_group_i8(blk, qx, K, G, g, nb, 1, accf, wv ? wv + 8 * (size_t)g : NULL);
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 576)));
        for (int b = 0; b < nb; b++) accf[b] = _mm512_fmadd_ps(m, _mm512_set1_ps(qx->sx[(size_t)b * G + g]), accf[b]);
    }
    for (int b = 0; b < nb; b++) _mm512_storeu_ps(y + (size_t)b * ldy, accf[b]);
}

/* A column of int8 tiles' pairs of tile rows as q8_tile_rows_i8 multiplies them (q8_pair_u8), once for
 * every pass of rows: wv[8 g + r / 2]. */
static void decode_q8_i8(const uint8_t *col, int G, int bytes, __m512i *wv) {
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = col + (size_t)g * bytes;
        prefetch_l2(blk + PREFETCH_AHEAD, bytes);
        for (int i = 0; i < 8; i++) _mm512_store_si512(wv + 8 * (size_t)g + i, q8_pair_u8(blk, 2 * i));
    }
}
#endif

#if HAVE_INT8_Q4
/* A column of Q4 (five: Q5) blocks as AVX2's int8 matmul multiplies them: for output rows 8o..8o+7 (bytes
 * 16o..16o+15 of each tile row), group g, half h, tile row pair 4h + i, 8 lanes of the 4 codes of inputs
 * 4p..4p+3 (as the AVX-512 q4_column_i8 above) at wv[((o G + g) 2 + h) 4 + i]: decoded once per column
 * into a thread's buffer (L1/L2-resident), for every pass of 8 rows over it. */
static void decode_q4_i8(const uint8_t *col, int G, int kind, __m256i *wv) {
    const int five = kind & Q_FIVE;
    const __m256i nibbles = _mm256_set1_epi8(0x0f);
    for (int o = 0; o < 2; o++)
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = col + (size_t)g * Q_BYTES(kind);
            if (o == 0) prefetch_l2(blk + PREFETCH_AHEAD, Q_BYTES(kind));
            for (int p = 0; p < 8; p++) {
                const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(blk + 32 * p + 16 * o)));
                __m256i w = _mm256_and_si256(_mm256_or_si256(v, _mm256_slli_epi32(v, 12)), nibbles);
                if (five) w = _mm256_or_si256(w, fifth_bits_quads(blk, p, o)); /* (5 bits x 127, 4 summed: still within int16) */
                _mm256_store_si256(wv + ((size_t)o * G + g) * 8 + p, w);
            }
        }
}

/* One column of Q4 (five: Q5) blocks for nb <= ROWS_PER_PASS rows of int8 inputs (AVX2, MM_INT8), its
 * codes decoded in wv (decode_q4_i8): y[b, n0 + n]. Eight output rows at a time; each row's four
 * `vpmaddubsw` summed in int16 (4 * 31 * 127 * 2 < 2^15), then widened. */
static inline __attribute__((always_inline)) void q4_column_i8(const uint8_t *col, int G, const qx_t *qx, int K,
                                                               int nb, float *y, int ldy, int kind,
                                                               const __m256i *wv) {
    const int five = kind & Q_FIVE;
    ks8_t ks = {-1, {_mm256_setzero_ps(), _mm256_setzero_ps()}, {_mm256_setzero_ps(), _mm256_setzero_ps()}};
    for (int o = 0; o < 2; o++) { /* output rows 8o..8o+7: their sums stay in registers over all groups */
        __m256 accf[ROWS_PER_PASS];
        for (int b = 0; b < nb; b++) accf[b] = _mm256_setzero_ps();
        for (int g = 0; g < G; g++) {
            __m256 d, m;
            q_dm8(col, g, kind, o, &ks, &d, &m);
            const __m256i *w = wv + ((size_t)o * G + g) * 8;
            for (int b = 0; b < nb; b++) {
                const int8_t *xg = qx->q8 + (size_t)b * K + g * GROUP;
                __m256i acc = _mm256_setzero_si256();
                for (int h = 0; h < 2; h++) {
                    int32_t x0, x1, x2, x3;
                    memcpy(&x0, xg + 16 * h, 4), memcpy(&x1, xg + 16 * h + 4, 4);
                    memcpy(&x2, xg + 16 * h + 8, 4), memcpy(&x3, xg + 16 * h + 12, 4);
#if HAVE_AVXVNNI
                    acc = PAIRS_ADD(acc, w[4 * h], _mm256_set1_epi32(x0));
                    acc = PAIRS_ADD(acc, w[4 * h + 1], _mm256_set1_epi32(x1));
                    acc = PAIRS_ADD(acc, w[4 * h + 2], _mm256_set1_epi32(x2));
                    acc = PAIRS_ADD(acc, w[4 * h + 3], _mm256_set1_epi32(x3));
#else
                    __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(w[4 * h], _mm256_set1_epi32(x0)),
                                                 _mm256_maddubs_epi16(w[4 * h + 1], _mm256_set1_epi32(x1)));
                    s = _mm256_add_epi16(s, _mm256_add_epi16(_mm256_maddubs_epi16(w[4 * h + 2], _mm256_set1_epi32(x2)),
                                                             _mm256_maddubs_epi16(w[4 * h + 3], _mm256_set1_epi32(x3))));
                    acc = _mm256_add_epi32(acc, PAIRS_WIDEN(s));
#endif
                }
                /* d (dg (codes . inputs) + ce) + m sx, as the AVX-512 q4_column_i8 (sx is the int16 rows', / dx) */
                const size_t i = (size_t)b * G + g;
                const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(qx->dg[i]),
                                                 _mm256_set1_ps(qx->ce[2 * i + (five ? 1 : 0)]));
                accf[b] = _mm256_fmadd_ps(m, _mm256_set1_ps(qx->sx[i] * qx->dx[b]), _mm256_fmadd_ps(d, t, accf[b]));
            }
        }
        for (int b = 0; b < nb; b++) _mm256_storeu_ps(y + (size_t)b * ldy + 8 * o, accf[b]);
    }
}
#endif

#if HAVE_INT8_Q4
/* One column of Q4 (five: Q5) blocks for nb <= DIRECT_ROWS rows of int8 inputs (AVX2, MM_INT8), its codes
 * decoded in registers, group by group: for one pass of rows, storing decoded codes and loading them again
 * (decode_q4_i8) cost more than decoding them in registers, and at 1-4 rows made int8 inputs lose to int16
 * ones (the 1B shape's batch-1 step 51.1 / 47.5 ms int16, 45.9 / 44.8 ms here; 4 rows 105-109 ms through
 * the buffer, 79-92 here; 8 rows a tie). 32 bytes of a pair p (16 output rows, inputs 4p..4p+3) go to two
 * vectors of 8 lanes of four codes: quarters 0 2 1 3 (`vpermq`), then each word's low and high nibbles
 * interleaved by words: lanes [low 2n, low 2n+1, high 2n, high 2n+1] of output row n, rows 0-7 and 8-15,
 * as decode_q4_i8 would leave them. Four-bit codes: the whole group's `vpmaddubsw`
 * summed in int16 (8 * 2 * 15 * 127 < 2^15) before one `vpmaddwd`; five-bit ones each half's. */
#define DIRECT_ROWS ROWS_PER_PASS
static inline __attribute__((always_inline)) void q4_column_i8d(const uint8_t *col, int G, const qx_t *qx, int K,
                                                                int nb, float *y, int ldy, int kind) {
    const int five = kind & Q_FIVE;
    const __m256i nibbles = _mm256_set1_epi8(0x0f);
    ks8_t ks = {-1, {_mm256_setzero_ps(), _mm256_setzero_ps()}, {_mm256_setzero_ps(), _mm256_setzero_ps()}};
    __m256 accf[DIRECT_ROWS][2];
    for (int b = 0; b < nb; b++) accf[b][0] = accf[b][1] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = col + (size_t)g * Q_BYTES(kind);
        prefetch_l2(blk + PREFETCH_AHEAD, Q_BYTES(kind));
        __m256i acc[DIRECT_ROWS][2], s[DIRECT_ROWS][2];
        for (int b = 0; b < nb; b++) acc[b][0] = acc[b][1] = s[b][0] = s[b][1] = _mm256_setzero_si256();
        for (int p = 0; p < 8; p++) {
            const __m256i v = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)(blk + 32 * p)), 0xD8);
            const __m256i lo = _mm256_and_si256(v, nibbles), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibbles);
            __m256i w[2] = {_mm256_unpacklo_epi16(lo, hi), _mm256_unpackhi_epi16(lo, hi)};
            if (five)
                for (int o = 0; o < 2; o++) w[o] = _mm256_or_si256(w[o], fifth_bits_quads(blk, p, o));
            for (int b = 0; b < nb; b++) {
                int32_t x4;
                memcpy(&x4, qx->q8 + (size_t)b * K + g * GROUP + 4 * p, 4);
                const __m256i xb = _mm256_set1_epi32(x4);
                s[b][0] = PAIRS_ADD(s[b][0], w[0], xb);
                s[b][1] = PAIRS_ADD(s[b][1], w[1], xb);
            }
            if (five && !HAVE_AVXVNNI && (p & 3) == 3) /* (five-bit codes: four pairs' sums at most in int16) */
                for (int b = 0; b < nb; b++)
                    for (int o = 0; o < 2; o++) {
                        acc[b][o] = _mm256_add_epi32(acc[b][o], PAIRS_WIDEN(s[b][o]));
                        s[b][o] = _mm256_setzero_si256();
                    }
        }
        if (!five || HAVE_AVXVNNI) /* (VNNI: the int32 sums themselves) */
            for (int b = 0; b < nb; b++)
                for (int o = 0; o < 2; o++) acc[b][o] = PAIRS_WIDEN(s[b][o]);
        for (int o = 0; o < 2; o++) {
            __m256 d, m;
            q_dm8(col, g, kind, o, &ks, &d, &m);
            for (int b = 0; b < nb; b++) { /* as q4_column_i8 */
                const size_t i = (size_t)b * G + g;
                const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[b][o]), _mm256_set1_ps(qx->dg[i]),
                                                 _mm256_set1_ps(qx->ce[2 * i + (five ? 1 : 0)]));
                accf[b][o] = _mm256_fmadd_ps(m, _mm256_set1_ps(qx->sx[i] * qx->dx[b]), _mm256_fmadd_ps(d, t, accf[b][o]));
            }
        }
    }
    for (int b = 0; b < nb; b++)
        for (int o = 0; o < 2; o++) _mm256_storeu_ps(y + (size_t)b * ldy + 8 * o, accf[b][o]);
}

/* One column of int8 group blocks for nb <= ROWS_PER_PASS rows of int8 inputs (AVX2, MM_INT8): y[b, n0 + n].
 * `kind`: I8_G6, TILES_Q8G6 (codes in [-32, 32]); with AVX-VNNI also I8_G, TILES_Q8G (the int8 range), and
 * I8_Q80, TILES_Q8 (Q8_0's: one d per group, no m). Eight output rows at a time: tile rows r and r + 1
 * (inputs 2r..2r+3) interleaved by words into 8 lanes of 4 codes, offset to be unsigned (by 32: 0..64; by
 * 128 for the int8 range), a half group's four decoded once for all rows; each row's sums less the offset's
 * share of the half group's int8 input sum (s8 = 128 * it). AVX2 sums `vpmaddubsw` two by two in int16
 * (2 * 2 * 64 * 127 < 2^15, which the int8 range's codes would overflow: those take int16 inputs there);
 * AVX-VNNI's `vpdpbusd` sums in int32 and takes any code. */
enum { I8_G6 = 0, I8_G = 1, I8_Q80 = 2 };

/* Tile rows r and r + 1 of an int8 block (inputs 2r..2r+3) for output rows 8o..8o+7: interleaved by words
 * into 8 lanes of 4 codes, plus `offset` (32, or 128 for the int8 range) to be unsigned. */
static inline __m256i q8_pair_u8x8(const uint8_t *blk, int r, int o, __m256i offset) {
    const __m128i a = _mm_loadu_si128((const __m128i *)(blk + 32 * r + 16 * o));
    const __m128i c = _mm_loadu_si128((const __m128i *)(blk + 32 * (r + 1) + 16 * o));
    return _mm256_add_epi8(_mm256_set_m128i(_mm_unpackhi_epi16(a, c), _mm_unpacklo_epi16(a, c)), offset);
}

static inline __attribute__((always_inline)) void q8g_column_i8v(const uint8_t *col, int G, const qx_t *qx, int K,
                                                                 int nb, float *y, int ldy, int kind) {
    const int one = kind == I8_Q80, div = kind == I8_G6 ? 4 : 1; /* (the offset: 128 / div) */
    const __m256i offset = _mm256_set1_epi8(kind == I8_G6 ? 32 : (char)0x80);
    for (int o = 0; o < 2; o++) {
        __m256 accf[ROWS_PER_PASS];
        for (int b = 0; b < nb; b++) accf[b] = _mm256_setzero_ps();
        for (int g = 0; g < G; g++) {
            const uint8_t *blk = col + (size_t)g * Q8_BYTES(one);
            if (o == 0) prefetch_l2(blk + PREFETCH_AHEAD, Q8_BYTES(one));
            __m256i sum[ROWS_PER_PASS]; /* (I8_Q80: the whole group's) */
            for (int h = 0; h < 2; h++) {
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 512 + (one ? 0 : 32 * h) + 16 * o)));
                __m256i w[4];
                for (int i = 0; i < 4; i++) w[i] = q8_pair_u8x8(blk, 8 * h + 2 * i, o, offset);
                for (int b = 0; b < nb; b++) {
                    const int8_t *xg = qx->q8 + (size_t)b * K + g * GROUP + 16 * h;
                    int32_t x0, x1, x2, x3;
                    memcpy(&x0, xg, 4), memcpy(&x1, xg + 4, 4), memcpy(&x2, xg + 8, 4), memcpy(&x3, xg + 12, 4);
                    const size_t i = ((size_t)b * G + g) * 2 + h;
#if HAVE_AVXVNNI
                    __m256i s = PAIRS_ADD(_mm256_setzero_si256(), w[0], _mm256_set1_epi32(x0));
                    s = PAIRS_ADD(s, w[1], _mm256_set1_epi32(x1));
                    s = PAIRS_ADD(s, w[2], _mm256_set1_epi32(x2));
                    s = PAIRS_ADD(s, w[3], _mm256_set1_epi32(x3));
                    s = _mm256_sub_epi32(s, _mm256_set1_epi32(qx->s8[i] / div));
#else
                    const __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(w[0], _mm256_set1_epi32(x0)),
                                                         _mm256_maddubs_epi16(w[1], _mm256_set1_epi32(x1)));
                    const __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(w[2], _mm256_set1_epi32(x2)),
                                                         _mm256_maddubs_epi16(w[3], _mm256_set1_epi32(x3)));
                    __m256i s = _mm256_sub_epi32(_mm256_add_epi32(PAIRS_WIDEN(s01), PAIRS_WIDEN(s23)),
                                                 _mm256_set1_epi32(qx->s8[i] / div));
#endif
                    if (one && !h) { /* (I8_Q80: one d for both halves, one sum) */
                        sum[b] = s;
                        continue;
                    }
                    if (one) s = _mm256_add_epi32(s, sum[b]);
                    accf[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(qx->dg[i / 2])), accf[b]);
                }
            }
            if (one) continue;
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 576 + 16 * o)));
            for (int b = 0; b < nb; b++) /* the min term with the exact sum (sx is the int16 rows', / dx) */
                accf[b] = _mm256_fmadd_ps(m, _mm256_set1_ps(qx->sx[(size_t)b * G + g] * qx->dx[b]), accf[b]);
        }
        for (int b = 0; b < nb; b++) _mm256_storeu_ps(y + (size_t)b * ldy + 8 * o, accf[b]);
    }
}

/* ---- TILES_Q6 (AVX2 only): 6-bit codes in 0.875 bytes a weight where TILES_Q8G6 takes 1.19 ----
 * A Q4_K_M file's Q6_K matrices (half its layers' ffn_down, their attn_v) held as TILES_Q8G6 made the
 * 1B shape's layer tiles 619 MiB against the file's 557; its AVX2 batch-1 step reads them all. A code's
 * bits 4-5 lie in the byte of its nibble's position, two bits per tile row: 32 bytes of them for four
 * tile rows, so one load, shift and mask put them in place (in a layout of bit planes, as TILES_Q5's fifth
 * bits, expanding each bit to a byte cost more than the bytes saved: the 1B batch-1 step 41.6 / 44.1 ms
 * against 41.2 / 41.1 with TILES_Q8G6). */

/* Bits 4-5 (as 0x10, 0x20) of tile row 4v + k's codes from c, tile rows 4v..4v+3's crumbs (the block's
 * 32 bytes at 256 + 32v, or those bytes in any order of whole bytes). */
static inline __m256i q6_tops(__m256i c, int k) {
    const __m256i mask = _mm256_set1_epi8(0x30);
    return _mm256_and_si256(k == 0 ? _mm256_slli_epi16(c, 4) : k == 1 ? _mm256_slli_epi16(c, 2)
                            : k == 2 ? c : _mm256_srli_epi16(c, 2), mask);
}

/* A column of TILES_Q6 blocks as the TILES_Q8G6 blocks they hold (codes u - 32, the same d, m zero), into
 * out (G * Q8G_BLOCK_BYTES): for more than one pass of rows, and for int16 inputs (q8g_column). */
static void decode_q6_q8g(const uint8_t *col, int G, uint8_t *out) {
    const __m256i nibbles = _mm256_set1_epi8(0x0f), offset = _mm256_set1_epi8(32);
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = col + (size_t)g * Q6_BLOCK_BYTES;
        uint8_t *ob = out + (size_t)g * Q8G_BLOCK_BYTES;
        prefetch_l2(blk + PREFETCH_AHEAD, Q6_BLOCK_BYTES);
        for (int p = 0; p < 8; p++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 32 * p));
            const __m256i c = _mm256_loadu_si256((const __m256i *)(blk + 256 + 32 * (p >> 1)));
            const int k = 2 * (p & 1);
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, nibbles), q6_tops(c, k));
            const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), nibbles), q6_tops(c, k + 1));
            _mm256_storeu_si256((__m256i *)(ob + 64 * p), _mm256_sub_epi8(lo, offset));
            _mm256_storeu_si256((__m256i *)(ob + 64 * p + 32), _mm256_sub_epi8(hi, offset));
        }
        memcpy(ob + 512, blk + 384, 64);
        memset(ob + 576, 0, 32);
    }
}

/* One column of TILES_Q6 blocks for nb <= DIRECT_ROWS rows of int8 inputs, its codes decoded in registers as
 * q4_column_i8d's (the crumbs permuted as the nibbles, or-ed in before the unpacks): each half group's
 * `vpmaddubsw` sums two pairs at a time in int16 (2 * 2 * 63 * 127 < 2^15), widened, less the offset's
 * 32 * the half's int8 input sum (s8 / 4), times its own d (Q6_K's scale per 16 inputs). */
static inline __attribute__((always_inline)) void q6_column_i8d(const uint8_t *col, int G, const qx_t *qx, int K,
                                                                int nb, float *y, int ldy) {
    const __m256i nibbles = _mm256_set1_epi8(0x0f);
    __m256 accf[DIRECT_ROWS][2];
    for (int b = 0; b < nb; b++) accf[b][0] = accf[b][1] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = col + (size_t)g * Q6_BLOCK_BYTES;
        prefetch_l2(blk + PREFETCH_AHEAD, Q6_BLOCK_BYTES);
        for (int h = 0; h < 2; h++) {
            __m256i acc[DIRECT_ROWS][2];
            for (int b = 0; b < nb; b++) acc[b][0] = acc[b][1] = _mm256_setzero_si256();
            for (int p = 4 * h; p < 4 * h + 4; p += 2) {
                const __m256i c = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)(blk + 256 + 16 * p)), 0xD8);
                __m256i s[DIRECT_ROWS][2];
                for (int b = 0; b < nb; b++) s[b][0] = s[b][1] = _mm256_setzero_si256();
                for (int q = p; q < p + 2; q++) {
                    const int k = 2 * (q - p);
                    const __m256i v = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)(blk + 32 * q)), 0xD8);
                    const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, nibbles), q6_tops(c, k));
                    const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), nibbles), q6_tops(c, k + 1));
                    const __m256i w[2] = {_mm256_unpacklo_epi16(lo, hi), _mm256_unpackhi_epi16(lo, hi)};
                    for (int b = 0; b < nb; b++) {
                        int32_t x4;
                        memcpy(&x4, qx->q8 + (size_t)b * K + g * GROUP + 4 * q, 4);
                        const __m256i xb = _mm256_set1_epi32(x4);
                        s[b][0] = PAIRS_ADD(s[b][0], w[0], xb);
                        s[b][1] = PAIRS_ADD(s[b][1], w[1], xb);
                    }
                }
                for (int b = 0; b < nb; b++)
                    for (int o = 0; o < 2; o++) acc[b][o] = _mm256_add_epi32(acc[b][o], PAIRS_WIDEN(s[b][o]));
            }
            for (int o = 0; o < 2; o++) {
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 384 + 32 * h + 16 * o)));
                for (int b = 0; b < nb; b++) {
                    const size_t i = ((size_t)b * G + g) * 2 + h;
                    const __m256i t = _mm256_sub_epi32(acc[b][o], _mm256_set1_epi32(qx->s8[i] / 4));
                    accf[b][o] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(d, _mm256_set1_ps(qx->dg[i / 2])),
                                                 accf[b][o]);
                }
            }
        }
    }
    for (int b = 0; b < nb; b++)
        for (int o = 0; o < 2; o++) _mm256_storeu_ps(y + (size_t)b * ldy + 8 * o, accf[b][o]);
}
#endif

#if HAVE_BF16DOT
/* One column of F16 or BF16 blocks (`bf16`) for nb <= BF_ROWS_PER_PASS rows of bf16 inputs (xb: rows [nb, K],
 * MM_INT8's), in bf16 dot products with fp32 sums: y[b, n0 + n]. Passes of 16 rows (16 accumulators, the
 * weights and an input pair in 18 of the 32 registers): an F16 tile row is rounded to bf16 once for them. */
#define BF_ROWS_PER_PASS 16
static inline __attribute__((always_inline)) void f16_column_bf(const uint8_t *col, int G, const uint16_t *xb, int K,
                                                                int nb, float *y, int ldy, int bf16) {
    __m512 acc[BF_ROWS_PER_PASS];
    for (int b = 0; b < nb; b++) acc[b] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = col + (size_t)g * F16_BLOCK_BYTES;
        prefetch_l2(blk + PREFETCH_AHEAD, F16_BLOCK_BYTES);
        for (int r = 0; r < 16; r++) {
            const uint8_t *p = blk + 64 * r;
            const __m512bh w = bf16 ? (__m512bh)_mm512_loadu_si512(p)
                                    : _mm512_cvtne2ps_pbh(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32))),
                                                          _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)));
            for (int b = 0; b < nb; b++) {
                uint32_t pair; /* x[2r], x[2r + 1] in bf16 */
                memcpy(&pair, xb + (size_t)b * K + g * GROUP + 2 * r, 4);
                acc[b] = _mm512_dpbf16_ps(acc[b], w, (__m512bh)_mm512_set1_epi32((int)pair));
            }
        }
    }
    for (int b = 0; b < nb; b++) _mm512_storeu_ps(y + (size_t)b * ldy, acc[b]);
}
#endif

static inline int tile_bytes(int format) {
    return format == TILES_Q8G || format == TILES_Q8G6 ? Q8G_BLOCK_BYTES
           : format == TILES_Q8 ? Q80_BLOCK_BYTES
           : format == TILES_F16 || format == TILES_BF16 ? F16_BLOCK_BYTES
           : format == TILES_Q5                          ? Q5_BLOCK_BYTES
           : format == TILES_Q4K                         ? Q_BYTES(Q_KS)
           : format == TILES_Q5K                         ? Q_BYTES(Q_KS | Q_FIVE)
           : format == TILES_Q6                          ? Q6_BLOCK_BYTES
                                                         : BLOCK_BYTES;
}

/* The 4-bit block kind (Q_FIVE, Q_KS) of a 4-bit or 5-bit tile format. */
static inline int q_kind(int format) {
    return (format == TILES_Q5 || format == TILES_Q5K ? Q_FIVE : 0) | (format == TILES_Q4K || format == TILES_Q5K ? Q_KS : 0);
}

/* The columns [c0, c1) of one format, taken by one column function CALL(nb) for each pass of up to
 * ROWS_PER_PASS rows (a constant nb per call: the accumulators stay in registers). One function per format
 * and input kind: GCC allocates registers per function, and all of them in one function made AVX2's int8
 * columns of 4-bit and 6-bit tiles a third slower. int8: the inputs are MM_INT8's (the 16-bit formats
 * read the fp32 rows). */
/* Column col's passes of up to ROWS_PER_PASS rows, CALL(nb) for each (int8: the MM_INT8 inputs are set in
 * `part`); COLUMNS_FN's and DECODED_FN's body. */
#define ROW_PASSES(CALL, int8)                                                                              \
    for (int b0 = 0; b0 < B; b0 += ROWS_PER_PASS) {                                                         \
        const int nb = B - b0 < ROWS_PER_PASS ? B - b0 : ROWS_PER_PASS;                                     \
        qx_t part = {qx->q + (size_t)b0 * K, qx->dx + b0, qx->sx + (size_t)b0 * G, NULL,                    \
                     (int8) ? qx->q8 + (size_t)b0 * K : NULL, (int8) ? qx->dg + (size_t)b0 * G : NULL,      \
                     (int8) ? qx->s8 + (size_t)b0 * G * 2 : NULL, (int8) ? qx->ce + (size_t)b0 * G * 2 : NULL, \
                     (int8) ? qx->o8 + (size_t)b0 * G : NULL};                                            \
        float *yb = y + (size_t)b0 * N + c * TILE_N;                                                        \
        (void)part;                                                                                         \
        switch (nb) {                                                                                       \
            case 1: CALL(1); break;                                                                         \
            case 2: CALL(2); break;                                                                         \
            case 3: CALL(3); break;                                                                         \
            case 4: CALL(4); break;                                                                         \
            case 5: CALL(5); break;                                                                         \
            case 6: CALL(6); break;                                                                         \
            case 7: CALL(7); break;                                                                         \
            default: CALL(8); break;                                                                        \
        }                                                                                                   \
    }
#define COLUMNS_FN(name, CALL)                                                                                  \
    static __attribute__((noinline)) void name(const uint8_t *blocks, int bytes, int N, int K, const qx_t *qx,  \
                                               const float *x, int B, float *y, int c0, int c1, int int8) {     \
        const int G = K / GROUP;                                                                                \
        for (int c = c0; c < c1; c++) {                                                                         \
            const uint8_t *col = blocks + (size_t)c * G * bytes;                                                \
            ROW_PASSES(CALL, int8)                                                                              \
        }                                                                                                       \
    }
typedef void (*columns_fn)(const uint8_t *, int, int, int, const qx_t *, const float *, int, float *, int, int, int);

#define CALL_Q4(n) q4_column(col, G, &part, K, n, yb, N, 0)
#define CALL_Q5(n) q4_column(col, G, &part, K, n, yb, N, Q_FIVE)
#define CALL_Q4K(n) q4_column(col, G, &part, K, n, yb, N, Q_KS)
#define CALL_Q5K(n) q4_column(col, G, &part, K, n, yb, N, Q_KS | Q_FIVE)
#define CALL_Q8G(n) q8g_column(col, G, &part, K, n, yb, N, 0)
#define CALL_Q8(n) q8g_column(col, G, &part, K, n, yb, N, 1)
#define CALL_F16(n) f16_column(col, G, x + (size_t)b0 * K, K, n, yb, N, 0)
#define CALL_BF16(n) f16_column(col, G, x + (size_t)b0 * K, K, n, yb, N, 1)
COLUMNS_FN(columns_q4, CALL_Q4)
COLUMNS_FN(columns_q5, CALL_Q5)
COLUMNS_FN(columns_q4k, CALL_Q4K)
COLUMNS_FN(columns_q5k, CALL_Q5K)
COLUMNS_FN(columns_q8g, CALL_Q8G)
COLUMNS_FN(columns_q8, CALL_Q8)
COLUMNS_FN(columns_f16, CALL_F16)
COLUMNS_FN(columns_bf16, CALL_BF16)
#if HAVE_INT8
#define CALL_Q4_I8(n) q4_column_i8(col, G, &part, K, n, yb, N, 0, NULL)
#define CALL_Q5_I8(n) q4_column_i8(col, G, &part, K, n, yb, N, Q_FIVE, NULL)
#define CALL_Q4K_I8(n) q4_column_i8(col, G, &part, K, n, yb, N, Q_KS, NULL)
#define CALL_Q5K_I8(n) q4_column_i8(col, G, &part, K, n, yb, N, Q_KS | Q_FIVE, NULL)
#define CALL_Q8G_I8(n) q8g_column_i8(col, G, &part, K, n, yb, N, NULL)
#define CALL_Q8_I8(n) q8_0_column_i8(col, G, &part, K, n, yb, N, NULL)
COLUMNS_FN(columns_q4_i8, CALL_Q4_I8)
COLUMNS_FN(columns_q5_i8, CALL_Q5_I8)
COLUMNS_FN(columns_q4k_i8, CALL_Q4K_I8)
COLUMNS_FN(columns_q5k_i8, CALL_Q5K_I8)
COLUMNS_FN(columns_q8g_i8, CALL_Q8G_I8)
COLUMNS_FN(columns_q8_i8, CALL_Q8_I8)
#elif HAVE_INT8_Q4
#define CALL_Q8G6_I8(n) q8g_column_i8v(col, G, &part, K, n, yb, N, I8_G6)
COLUMNS_FN(columns_q8g6_i8, CALL_Q8G6_I8)
#if HAVE_AVXVNNI
#define CALL_Q8G_I8V(n) q8g_column_i8v(col, G, &part, K, n, yb, N, I8_G)
#define CALL_Q8_I8V(n) q8g_column_i8v(col, G, &part, K, n, yb, N, I8_Q80)
COLUMNS_FN(columns_q8g_i8v, CALL_Q8G_I8V)
COLUMNS_FN(columns_q8_i8v, CALL_Q8_I8V)
#endif
/* TILES_Q6 for int16 inputs: each column decoded to TILES_Q8G6 blocks in the thread's buffer (or, without
 * one, NaN: a step never reads wrong weights quietly). */
#define CALL_Q6(n) q8g_column(dcol, G, &part, K, n, yb, N, 0)
static __attribute__((noinline)) void columns_q6(const uint8_t *blocks, int bytes, int N, int K, const qx_t *qx,
                                                 const float *x, int B, float *y, int c0, int c1, int int8) {
    const int G = K / GROUP;
    uint8_t *dcol = decode_buffer(G, Q8G_BLOCK_BYTES);
    (void)x, (void)int8;
    for (int c = c0; c < c1; c++) {
        if (!dcol) {
            for (int b = 0; b < B; b++)
                for (int n = 0; n < TILE_N; n++) y[(size_t)b * N + c * TILE_N + n] = NAN;
            continue;
        }
        decode_q6_q8g(blocks + (size_t)c * G * bytes, G, dcol);
        ROW_PASSES(CALL_Q6, 0)
    }
}
#endif

/* The column function of `fmt` for int8 (MM_INT8) or int16 inputs (AVX2's 4-bit and 5-bit int8 columns
 * are direct_for's and decoded_for's only). */
static columns_fn columns_for(int fmt, int int8) {
#if HAVE_INT8
    if (int8)
        return fmt == TILES_Q4 ? columns_q4_i8 : fmt == TILES_Q5 ? columns_q5_i8 : fmt == TILES_Q4K ? columns_q4k_i8
             : fmt == TILES_Q5K ? columns_q5k_i8 : fmt == TILES_Q8 ? columns_q8_i8
             : fmt == TILES_Q8G || fmt == TILES_Q8G6 ? columns_q8g_i8 : fmt == TILES_F16 ? columns_f16 : columns_bf16;
#elif HAVE_INT8_Q4
    if (int8 && fmt == TILES_Q8G6) return columns_q8g6_i8;
#if HAVE_AVXVNNI
    if (int8 && fmt == TILES_Q8G) return columns_q8g_i8v;
    if (int8 && fmt == TILES_Q8) return columns_q8_i8v;
#endif /* (else the int8 range's tiles take the int16 rows) */
    if (fmt == TILES_Q6) return columns_q6; /* (int8 inputs: direct_for's and decoded_for's) */
#endif
    return fmt == TILES_Q4 ? columns_q4 : fmt == TILES_Q5 ? columns_q5 : fmt == TILES_Q4K ? columns_q4k
         : fmt == TILES_Q5K ? columns_q5k : fmt == TILES_Q8 ? columns_q8
         : fmt == TILES_Q8G || fmt == TILES_Q8G6 ? columns_q8g : fmt == TILES_F16 ? columns_f16 : columns_bf16;
}

#if HAVE_INT8 || HAVE_INT8_Q4
/* matmul_int16's columns [c0, c1) with int8 inputs, each column decoded once (DECODE, into the thread's
 * buffer wv) and then multiplied by each pass of 8 rows (CALL(nb)); one function per format, as COLUMNS_FN. */
#define DECODED_FN(name, DECODE, CALL)                                                                        \
    static __attribute__((noinline)) void name(const layer_tiles *w, int N, int K, const qx_t *qx, int B,     \
                                               float *y, int c0, int c1, void *wv) {                          \
        const int G = K / GROUP, bytes = tile_bytes(w->format);                                               \
        for (int c = c0; c < c1; c++) {                                                                       \
            const uint8_t *col = w->blocks + (size_t)c * G * bytes;                                           \
            DECODE;                                                                                           \
            ROW_PASSES(CALL, 1)                                                                               \
        }                                                                                                     \
    }
typedef void (*decoded_fn)(const layer_tiles *, int, int, const qx_t *, int, float *, int, int, void *);
#define DEC_CALL_Q4(n) q4_column_i8(col, G, &part, K, n, yb, N, 0, wv)
#define DEC_CALL_Q5(n) q4_column_i8(col, G, &part, K, n, yb, N, Q_FIVE, wv)
#define DEC_CALL_Q4K(n) q4_column_i8(col, G, &part, K, n, yb, N, Q_KS, wv)
#define DEC_CALL_Q5K(n) q4_column_i8(col, G, &part, K, n, yb, N, Q_KS | Q_FIVE, wv)
#if HAVE_INT8_Q4 /* (VNNI decodes 4-bit codes again per pass: decoded_for) */
DECODED_FN(decoded_q4_i8, decode_q4_i8(col, G, 0, wv), DEC_CALL_Q4)
DECODED_FN(decoded_q4k_i8, decode_q4_i8(col, G, Q_KS, wv), DEC_CALL_Q4K)
#define DEC_CALL_Q6(n) q8g_column_i8v((const uint8_t *)wv, G, &part, K, n, yb, N, I8_G6)
DECODED_FN(decoded_q6_i8, decode_q6_q8g(col, G, wv), DEC_CALL_Q6)
#endif
DECODED_FN(decoded_q5_i8, decode_q4_i8(col, G, Q_FIVE, wv), DEC_CALL_Q5)
DECODED_FN(decoded_q5k_i8, decode_q4_i8(col, G, Q_KS | Q_FIVE, wv), DEC_CALL_Q5K)
#if HAVE_INT8
#define DEC_CALL_Q8(n) q8_0_column_i8(col, G, &part, K, n, yb, N, wv)
#define DEC_CALL_Q8G(n) q8g_column_i8(col, G, &part, K, n, yb, N, wv)
DECODED_FN(decoded_q8_i8, decode_q8_i8(col, G, bytes, wv), DEC_CALL_Q8)
DECODED_FN(decoded_q8g_i8, decode_q8_i8(col, G, bytes, wv), DEC_CALL_Q8G)
#endif

#if HAVE_INT8_Q4
/* matmul_int16's columns [c0, c1) of 4-bit, 5-bit or 6-bit tiles for B <= DIRECT_ROWS rows of int8 inputs,
 * each group's codes decoded in registers (q4_column_i8d, q6_column_i8d); one function per format, as
 * COLUMNS_FN. */
#define DIRECT_FN(name, COLUMN)                                                                               \
    static __attribute__((noinline)) void name(const uint8_t *blocks, int bytes, int N, int K, const qx_t *qx,\
                                               int B, float *y, int c0, int c1) {                             \
        const int G = K / GROUP;                                                                              \
        for (int c = c0; c < c1; c++) {                                                                       \
            const uint8_t *col = blocks + (size_t)c * G * bytes;                                              \
            float *yc = y + (size_t)c * TILE_N;                                                               \
            switch (B) { /* a constant nb per call: the accumulators stay in registers */                     \
                case 1: COLUMN(1); break;                                                                     \
                case 2: COLUMN(2); break;                                                                     \
                case 3: COLUMN(3); break;                                                                     \
                case 4: COLUMN(4); break;                                                                     \
                case 5: COLUMN(5); break;                                                                     \
                case 6: COLUMN(6); break;                                                                     \
                case 7: COLUMN(7); break;                                                                     \
                default: COLUMN(DIRECT_ROWS); break;                                                          \
            }                                                                                                 \
        }                                                                                                     \
    }
typedef void (*direct_fn)(const uint8_t *, int, int, int, const qx_t *, int, float *, int, int);
#define DIRECT_Q4(n) q4_column_i8d(col, G, qx, K, n, yc, N, 0)
#define DIRECT_Q5(n) q4_column_i8d(col, G, qx, K, n, yc, N, Q_FIVE)
#define DIRECT_Q4K(n) q4_column_i8d(col, G, qx, K, n, yc, N, Q_KS)
#define DIRECT_Q5K(n) q4_column_i8d(col, G, qx, K, n, yc, N, Q_KS | Q_FIVE)
#define DIRECT_Q6(n) q6_column_i8d(col, G, qx, K, n, yc, N)
DIRECT_FN(direct_q4_i8, DIRECT_Q4)
DIRECT_FN(direct_q5_i8, DIRECT_Q5)
DIRECT_FN(direct_q4k_i8, DIRECT_Q4K)
DIRECT_FN(direct_q5k_i8, DIRECT_Q5K)
DIRECT_FN(direct_q6_i8, DIRECT_Q6)

/* The in-register int8 columns of a 4-bit, 5-bit or 6-bit format, NULL for the others. */
static direct_fn direct_for(int fmt) {
    return fmt == TILES_Q4 ? direct_q4_i8 : fmt == TILES_Q5 ? direct_q5_i8 : fmt == TILES_Q4K ? direct_q4k_i8
         : fmt == TILES_Q5K ? direct_q5k_i8 : fmt == TILES_Q6 ? direct_q6_i8 : NULL;
}
#endif

/* The decoded-column matmul for int8 inputs and this many rows, or NULL for the direct columns. AVX2: its
 * 4-bit and 5-bit int8 columns of more than one pass of rows (direct_for takes one pass). VNNI: from
 * three passes of rows on, for the 5-bit and int8 tiles (SmolLM2 Q4_K_M prefill matmuls 120-125 ->
 * 106-114 ms); at two passes, and for 4-bit codes (three ops to decode), storing and reloading them cost
 * as much as decoding them again. */
static decoded_fn decoded_for(int fmt, int B) {
#if HAVE_INT8
    if (B <= 2 * ROWS_PER_PASS) return NULL;
    return fmt == TILES_Q5 ? decoded_q5_i8 : fmt == TILES_Q5K ? decoded_q5k_i8 : fmt == TILES_Q8 ? decoded_q8_i8
         : fmt == TILES_Q8G || fmt == TILES_Q8G6 ? decoded_q8g_i8 : NULL;
#else
    (void)B;
    return fmt == TILES_Q4 ? decoded_q4_i8 : fmt == TILES_Q5 ? decoded_q5_i8 : fmt == TILES_Q4K ? decoded_q4k_i8
         : fmt == TILES_Q5K ? decoded_q5k_i8 : fmt == TILES_Q6 ? decoded_q6_i8 : NULL;
#endif
}
#endif

/* This thread's share of y[B, N] = x[B, K] W^T (x quantised by quantize_x as `mode`, MM_INT16 or
 * MM_INT8; y's rows ldy apart): columns of blocks split evenly; w->blocks in w->format only (step_matmul
 * takes a tail). */
static void matmul_int16(const layer_tiles *w, int N, int ldy, int K, const qx_t *qx, const float *x, int B, float *y,
                         int tid, int nt, int mode) {
    const int G = K / GROUP, NB = N / TILE_N, per = (NB + nt - 1) / nt;
    const int c0 = tid * per, c1 = c0 + per < NB ? c0 + per : NB;
    const int fmt = w->format, bytes = tile_bytes(fmt);
    int int8 = (HAVE_INT8 || HAVE_INT8_Q4) && mode == MM_INT8;
    (void)G; /* (the plain build's columns_for takes K) */
#if HAVE_BF16DOT
    if (int8 && (fmt == TILES_F16 || fmt == TILES_BF16)) {
        /* F16 from three passes of rows on: each column rounded to bf16 once, into the thread's buffer */
        uint8_t *wb = fmt == TILES_F16 && B > 2 * BF_ROWS_PER_PASS ? decode_buffer(G, F16_BLOCK_BYTES) : NULL;
        const int bf16 = fmt == TILES_BF16 || wb;
        for (int c = c0; c < c1; c++) {
            const uint8_t *col = w->blocks + (size_t)c * G * bytes;
            if (wb) {
                for (int g = 0; g < G; g++) {
                    const uint8_t *blk = col + (size_t)g * F16_BLOCK_BYTES;
                    prefetch_l2(blk + PREFETCH_AHEAD, F16_BLOCK_BYTES);
                    for (int r = 0; r < 16; r++)
                        _mm512_store_si512(wb + (size_t)g * F16_BLOCK_BYTES + 64 * r,
                                           (__m512i)_mm512_cvtne2ps_pbh(
                                               _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 64 * r + 32))),
                                               _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 64 * r)))));
                }
                col = wb;
            }
            for (int b0 = 0; b0 < B; b0 += BF_ROWS_PER_PASS) {
                const int nb = B - b0 < BF_ROWS_PER_PASS ? B - b0 : BF_ROWS_PER_PASS;
                const uint16_t *xb = qx->bf + (size_t)b0 * K;
                float *yb = y + (size_t)b0 * ldy + c * TILE_N;
                switch (nb) { /* a constant nb: the accumulators stay in registers */
#define BF_CASE(n) case n: f16_column_bf(col, G, xb, K, n, yb, ldy, bf16); break;
                    BF_CASE(1) BF_CASE(2) BF_CASE(3) BF_CASE(4) BF_CASE(5) BF_CASE(6) BF_CASE(7) BF_CASE(8)
                    BF_CASE(9) BF_CASE(10) BF_CASE(11) BF_CASE(12) BF_CASE(13) BF_CASE(14) BF_CASE(15)
                    default: f16_column_bf(col, G, xb, K, 16, yb, ldy, bf16); break;
#undef BF_CASE
                }
            }
        }
        return;
    }
#endif
#if HAVE_INT8_Q4
    if (int8 && B <= DIRECT_ROWS && direct_for(fmt)) {
        direct_for(fmt)(w->blocks, bytes, ldy, K, qx, B, y, c0, c1);
        return;
    }
#endif
#if HAVE_INT8 || HAVE_INT8_Q4
    const decoded_fn dfn = int8 ? decoded_for(fmt, B) : NULL;
    void *wv = dfn ? decode_buffer(G, fmt == TILES_Q6 ? Q8G_BLOCK_BYTES : 512) : NULL;
    if (wv) {
        dfn(w, ldy, K, qx, B, y, c0, c1, wv); /* (N: y's row stride, in the column functions) */
        return;
    }
#endif
#if HAVE_INT8_Q4
    if (int8 && direct_for(fmt)) int8 = 0; /* (no buffer: the int16 rows, also prepared) */
#endif
    columns_for(fmt, int8)(w->blocks, bytes, ldy, K, qx, x, B, y, c0, c1, int8);
}

#if HAVE_AMX
/* Block -> a bf16 B tile: 16 rows (input pairs) of 32 bf16 (lane 2n + j), exactly the block's layout;
 * five: a Q5 block, the codes with their fifth bits (lanes 0-15 of tile row 2p: bits 0-15 of pair p's,
 * 16-31: 16-31; row 2p + 1: 32-63). */
static inline void widen_block(const uint8_t *col, int g, uint16_t *tile, int kind, ks16_t *ks) {
    const __m512i lo_rows = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi_rows = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    const int five = kind & Q_FIVE;
    const uint8_t *blk = col + (size_t)g * Q_BYTES(kind);
    __m512 d, m;
    q_dm16(col, g, kind, ks, &d, &m);
    __m512 d0 = _mm512_permutexvar_ps(lo_rows, d), d1 = _mm512_permutexvar_ps(hi_rows, d);
    __m512 m0 = _mm512_permutexvar_ps(lo_rows, m), m1 = _mm512_permutexvar_ps(hi_rows, m);
    const __m512i low = _mm512_set1_epi32(0xf), sixteen = _mm512_set1_epi32(16);
    for (int p = 0; p < 8; p++) {
        __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 32 * p))); /* lanes 0-15 */
        __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + 32 * p + 16))); /* 16-31 */
        __m512i a0 = _mm512_and_si512(a, low), b0 = _mm512_and_si512(b, low);
        __m512i a1 = _mm512_srli_epi32(a, 4), b1 = _mm512_srli_epi32(b, 4);
        if (five) {
            const uint64_t hb = fifth_bits(blk, p);
            a0 = _mm512_mask_or_epi32(a0, (__mmask16)hb, a0, sixteen);
            b0 = _mm512_mask_or_epi32(b0, (__mmask16)(hb >> 16), b0, sixteen);
            a1 = _mm512_mask_or_epi32(a1, (__mmask16)(hb >> 32), a1, sixteen);
            b1 = _mm512_mask_or_epi32(b1, (__mmask16)(hb >> 48), b1, sixteen);
        }
        __m512 r0a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a0), d0, m0), r0b = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b0), d1, m1);
        __m512 r1a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1), d0, m0), r1b = _mm512_fmadd_ps(_mm512_cvtepi32_ps(b1), d1, m1);
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

/* A Q8G block -> a bf16 B tile: tile row r's lane 2n + j is q[n, 2r + j] * d[r / 8][n] + m[n] (one: a TILES_Q8
 * block, q * d[n]). */
static inline void widen_q8g_block(const uint8_t *blk, uint16_t *tile, int one) {
    const __m512i lo_rows = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi_rows = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    const __m512 m = one ? _mm512_setzero_ps() : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 576)));
    const __m512 m0 = _mm512_permutexvar_ps(lo_rows, m), m1 = _mm512_permutexvar_ps(hi_rows, m);
    for (int h = 0; h < 2; h++) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 512 + (one ? 0 : 32 * h))));
        const __m512 d0 = _mm512_permutexvar_ps(lo_rows, d), d1 = _mm512_permutexvar_ps(hi_rows, d);
        for (int r = 8 * h; r < 8 * h + 8; r++) {
            __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 32 * r))));
            __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 32 * r + 16))));
            _mm512_storeu_si512(tile + r * 32, (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(b, d1, m1),
                                                                            _mm512_fmadd_ps(a, d0, m0)));
        }
    }
}

/* An F16 block -> a bf16 B tile (the same lanes, rounded). */
static inline void widen_f16_block(const uint8_t *blk, uint16_t *tile) {
    for (int r = 0; r < 16; r++) {
        __m512 a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 64 * r)));
        __m512 b = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 64 * r + 32)));
        _mm512_storeu_si512(tile + r * 32, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
}

static inline void widen(const tile_weights *w, int c, int G, int g, uint16_t *tile, ks16_t *ks) {
    const uint8_t *blk = w->blocks + ((size_t)c * G + g) * w->block_bytes;
    prefetch_l2(blk + PREFETCH_AHEAD, w->block_bytes); /* as the int16 path: widening does not wait on memory */
    if (w->row_scale)
        widen_q8_block(blk, w->row_scale + (size_t)c * TILE_N, tile);
    else if (w->block_bytes == Q8G_BLOCK_BYTES)
        widen_q8g_block(blk, tile, 0);
    else if (w->format == TILES_Q8)
        widen_q8g_block(blk, tile, 1);
    else if (w->format == TILES_BF16)
        memcpy(tile, blk, F16_BLOCK_BYTES); /* already a bf16 B tile */
    else if (w->block_bytes == F16_BLOCK_BYTES)
        widen_f16_block(blk, tile);
    else
        switch (q_kind(w->format)) { /* (a constant kind for each) */
            case 0: widen_block(w->blocks + (size_t)c * G * w->block_bytes, g, tile, 0, ks); break;
            case Q_FIVE: widen_block(w->blocks + (size_t)c * G * w->block_bytes, g, tile, Q_FIVE, ks); break;
            case Q_KS: widen_block(w->blocks + (size_t)c * G * w->block_bytes, g, tile, Q_KS, ks); break;
            default: widen_block(w->blocks + (size_t)c * G * w->block_bytes, g, tile, Q_KS | Q_FIVE, ks); break;
        }
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
 * `scratch` ([K / 32][2][512] bf16) and multiplied by every 32-row slice of x (with one slice, group by
 * group as it is multiplied). */
static void matmul_amx(const tile_weights *w, int N, int ldy, int K, const qx_t *qx, int M, float *y, uint16_t *scratch,
                       int tid, int nt) {
    const int G = K / GROUP, NB = N / TILE_N, NP = (NB + 1) / 2, per = (NP + nt - 1) / nt;
    const int p0 = tid * per, p1 = p0 + per < NP ? p0 + per : NP;
    if (p0 >= p1) return;
    amx_configure();
    const uint16_t *x = qx->bf;
    for (int pc = p0; pc < p1; pc++) {
        const int c = 2 * pc, two_cols = c + 1 < NB;
        ks16_t ks[2] = {{-1, _mm512_setzero_ps(), _mm512_setzero_ps()}, {-1, _mm512_setzero_ps(), _mm512_setzero_ps()}};
        /* One slice of rows (up to 32): each group is widened just before it is multiplied, so the weight
         * stream keeps flowing while the tiles multiply (widening the whole pair first left memory idle
         * during the multiplies); more rows: the pair is widened once, for every slice. */
        const int at_once = M <= 32;
        for (int g = 0; g < G && !at_once; g++) {
            widen(w, c, G, g, scratch + (size_t)g * 1024, &ks[0]);
            if (two_cols) widen(w, c + 1, G, g, scratch + (size_t)g * 1024 + 512, &ks[1]);
        }
        for (int m0 = 0; m0 < M; m0 += 32) {
            const int two_rows = m0 + 16 < M;
            const uint16_t *xa = x + (size_t)m0 * K, *xb = xa + (size_t)16 * K; /* tiles [rows / 16][G][16 x 32] */
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int g = 0; g < G; g++) {
                uint16_t *bt = scratch + (size_t)g * 1024;
                if (at_once) {
                    widen(w, c, G, g, bt, &ks[0]);
                    if (two_cols) widen(w, c + 1, G, g, bt + 512, &ks[1]);
                }
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
            float *ya = y + (size_t)m0 * ldy + c * TILE_N, *yb = ya + (size_t)16 * ldy;
            STORE_TILE(0, ya, ldy, m0, M);
            if (two_cols) STORE_TILE(1, ya + TILE_N, ldy, m0, M);
            if (two_rows) {
                STORE_TILE(2, yb, ldy, m0 + 16, M);
                if (two_cols) STORE_TILE(3, yb + TILE_N, ldy, m0 + 16, M);
            }
        }
    }
}
#endif

