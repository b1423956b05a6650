/* Row helpers, vectorised by hand per ISA (AVX-512, AVX2, plain C).
 * Part of the native CPU step, compiled as one unit by forward.c (see there). */
#pragma once

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

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
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
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    return hmax8(m);
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

