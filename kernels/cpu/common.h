/* Includes, the constants of the weight layouts, and scalar helpers.
 * Part of the native CPU step, compiled as one unit by forward.c (see there). */
#pragma once

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

#include "sluice_forward.h"

#define GROUP 32
#define TILE_N 16 /* output rows of W per block */
#define BLOCK_BYTES 320 /* one block: 256 bytes of codes, 16 fp16 scales, 16 fp16 mins */
#define Q5_BLOCK_BYTES 384 /* TILES_Q5: 256 bytes of low nibbles as BLOCK_BYTES, 64 of fifth bits, d, m */

/* A 4-bit matrix W [N, K] (GGML Q4_1 values: w = q * d + m per group of 32 inputs, q in 0..15) in
 * blocks of 16 output rows by one group: [N / 16, K / 32] blocks of BLOCK_BYTES, block (nb, g) holding
 * rows n0 = 16 nb .. n0 + 15 and inputs k0 = 32 g .. k0 + 31. Its 256 bytes of codes are 8 pairs of
 * "tile rows"; tile row r covers inputs k0 + 2r and k0 + 2r + 1 of all 16 output rows, lane i = 2n + j
 * holding W[n0 + n, k0 + 2r + j] (the layout of an AMX bf16 B tile and of `vpdpwssd` pairs); byte i of
 * pair p (32 bytes) holds lane i of tile row 2p in its low nibble and of tile row 2p + 1 in its high
 * one. Then d[16] and m[16] (fp16) of the block's 16 rows. kernels/cpu/__init__.py packs it. */

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

