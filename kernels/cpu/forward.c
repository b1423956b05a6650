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
 * Two matmuls read the same weights (`layer_tiles`). Steps of few rows are bound by the bytes
 * they read: activations quantised to int16 against the 4-bit codes in integer multiply-adds. Steps
 * of many rows (prefill chunks, large decode batches) are bound by arithmetic: on CPUs with AMX each
 * block of weights is widened to bf16 once in L1 and multiplied by 16x32 tiles of bf16 activations
 * (the numbers the dense bf16 torch path computes, at a fraction of its memory).
 *
 * Numerics: activations, norms, RoPE, softmax and accumulations in fp32; the 4-bit weights are
 * dequantised exactly (q * d + m with the file's fp16 d and m; rounded to bf16 on the AMX path, as
 * the torch path's bf16 weights are); K/V are stored in the cache as bf16 (round to nearest even, as
 * torch's .to(bfloat16)). Only the order of summation differs from the torch path.
 *
 * The source is split by concern, as ggml-cpu's is, and compiled as this one translation unit (a
 * "unity build": the parts' `static inline` helpers inline across them exactly as before the split,
 * with no link-time optimisation needed); kernels/cpu/build.py keys its cache on every part:
 *   sluice_forward.h   the public interface: the structs the ctypes code mirrors and the entry points
 *   common.h, vec.h    includes and layout constants, scalar helpers, row helpers per ISA
 *   threads.c, amx.c   the step's thread pool; AMX tile state
 *   matmul.c           int16 matmuls (AVX-512 VNNI, AVX-512, AVX2, plain C) and the AMX one
 *   attention.c        paged attention per ISA and its plan of jobs
 *   profile.c          where a step's time goes
 *   step.c             the layer step (sluice_forward)
 *   gguf_rows.c        rows decoded from the file's own blocks (embedding, exact candidates)
 *   head.c             the output layer (sluice_head_logits)
 *   sampler.c          sampling (sluice_sample, sluice_sample_masked)
 *   decode_attention.c attention alone for the torch path (sluice_decode_attention)
 */
#define _GNU_SOURCE
#include <stddef.h>

#include "common.h"
#include "vec.h"

#include "threads.c"
#include "amx.c"
#include "matmul.c"
#include "attention.c"
#include "profile.c"
#include "step.c"
#include "gguf_rows.c"
#include "head.c"
#include "sampler.c"
#include "decode_attention.c"

/* Which of the int16 matmul's code paths this build took (for the log and the tests). */
const char *sluice_forward_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return "avx512-vnni";
#elif defined(__AVX512F__) && defined(__AVX512BW__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && defined(__AVXVNNI__)
    return "avx2+avx-vnni";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return "avx2";
#else
    return "scalar";
#endif
}


/* sizeof and field offsets of the structs kernels/cpu/__init__.py mirrors with ctypes, so a mismatch
 * between the two is found at load instead of as wrong memory reads. Writes up to n values; returns how
 * many it has. */
int sluice_abi_sizes(int64_t *out, int n) {
    const int64_t v[] = {(int64_t)sizeof(dims), (int64_t)offsetof(dims, eps), (int64_t)sizeof(layer_weights),
                         (int64_t)offsetof(layer_weights, qkv), (int64_t)offsetof(layer_weights, qkv_bias),
                         (int64_t)sizeof(layer_tiles), (int64_t)offsetof(layer_tiles, format),
                         (int64_t)offsetof(layer_tiles, tail)};
    const int have = (int)(sizeof v / sizeof v[0]);
    for (int i = 0; i < n && i < have; i++) out[i] = v[i];
    return have;
}
