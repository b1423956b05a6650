/* The native CPU step's public interface: what kernels/cpu/__init__.py calls through ctypes, and the
 * structs it mirrors there (`_Dims`, `_Layer`; their sizes are checked at load, sluice_abi_sizes). */
#pragma once

#include <stdint.h>

/* A layer's matrix in blocks of 16 output rows by 32 inputs, tile order (common.h), in one of ten formats:
 * TILES_Q4: 4-bit codes with fp16 d and m per row and group (GGML Q4_0, Q4_1, Q4_K values), BLOCK_BYTES;
 * TILES_Q8G: int8 codes with fp16 d per row and half group (16 inputs) and fp16 m per row and group
 * (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0 values), Q8G_BLOCK_BYTES;
 * TILES_F16: the weights themselves as fp16 (F16 files), F16_BLOCK_BYTES;
 * TILES_BF16: the weights themselves as bf16 (BF16 files), F16_BLOCK_BYTES: a block is an AMX bf16 B
 * tile as it stands;
 * TILES_Q8G6: TILES_Q8G whose codes all lie in [-32, 32] (the Q5 and Q6 types'), read as TILES_Q8G but by
 * AVX2's int8 matmul, whose `vpmaddubsw` would saturate on larger codes;
 * TILES_Q5: 5-bit codes (0..31) with fp16 d and m per row and group (GGML Q5_0, Q5_1, Q5_K values, and
 * 4-bit ones beside them), Q5_BLOCK_BYTES: TILES_Q4's low nibbles, then each code's fifth bit (8 bytes
 * per pair p of tile rows: bit 2n + j for input 4p + j of output row n, bit 32 + 2n + j for 4p + 2 + j),
 * then d and m. 0.75 bytes a weight where TILES_Q8G takes 1.19;
 * TILES_Q8: TILES_Q8G's codes whose two half-group scales are equal and whose mins are zero (Q8_0's),
 * with one d per row and group and no m, Q80_BLOCK_BYTES: a group's halves summed in one integer;
 * TILES_Q4K / TILES_Q5K: TILES_Q4 / TILES_Q5 with a K type's own scales (Q4_K, Q5_K): in place of fp16 d
 * and m, each row's 6-bit scale and min as bytes, then 8 bytes of the super-block's fp16 D and M (M =
 * -dmin; block 8s + i: D of rows 4i..4i+3 for i < 4, M of rows 4(i - 4).. for i >= 4), d = D sc and m =
 * M mn, exact: 296 (360) bytes a block, 0.58 (0.70) bytes a weight. K a multiple of 256;
 * TILES_Q6: 6-bit codes u = q + 32 (q in [-32, 31]: Q6_K's, or any TILES_Q8G6 with no m) with fp16 d per
 * row and half group, w = (u - 32) d, Q6_BLOCK_BYTES: TILES_Q4's low nibbles; then bits 4-5 of the
 * codes, 32 bytes for tile rows 4v..4v+3 (v < 4): bits 2k..2k+1 of byte i those of row 4v + k's lane i
 * (the byte of its nibble); then d[2][16] as TILES_Q8G's. 0.875 bytes a weight where TILES_Q8G6 takes
 * 1.19. Read by the AVX2 build only (sluice_reads_tiles): its int8 matmul decodes the codes in registers,
 * where the bytes a weight decide a decode step's time. */
enum { TILES_Q4 = 0, TILES_Q8G = 1, TILES_F16 = 2, TILES_BF16 = 3, TILES_Q8G6 = 4, TILES_Q5 = 5, TILES_Q8 = 6,
       TILES_Q4K = 7, TILES_Q5K = 8, TILES_Q6 = 9 };

/* A layer's matrix: its blocks in one format, or (`tail` set) its first `rows` output rows in `format` and
 * the rest in `tail_format`: a fused matrix whose last part is another type (a Q4_K_M file's Q6_K attn_v
 * under Q4_K q and k) keeps each part in its own tiles instead of all in the wider ones. */
typedef struct {
    const uint8_t *blocks;
    int format;
    int rows; /* with `tail`: the rows in `blocks` */
    const uint8_t *tail;
    int tail_format;
} layer_tiles;

/* Any matrix in blocks of 16 output rows by 32 inputs, in tile order: a layer's (layer_tiles; `format`
 * one of TILES_*, block_bytes its size), or the output layer's int8 ones (row_scale set: w = q *
 * row_scale[n], 512 bytes per block, format unused). */
typedef struct {
    const uint8_t *blocks;
    int block_bytes;
    const float *row_scale; /* [N] for int8 blocks, else NULL */
    int format;
} tile_weights;

#define Q8_BLOCK_BYTES 512
#define Q8G_BLOCK_BYTES 608 /* 512 bytes of int8 codes as Q8_BLOCK_BYTES, d[2][16], m[16] (fp16) */
#define Q80_BLOCK_BYTES 544 /* TILES_Q8: 512 bytes of int8 codes, d[16] (fp16): Q8_0's 1.0625 bytes a weight */
#define Q6_BLOCK_BYTES 448 /* TILES_Q6: 256 bytes of low nibbles, 128 of bits 4-5, d[2][16] (fp16) */
#define F16_BLOCK_BYTES 1024 /* tile row r (inputs 2r, 2r + 1): lane 2n + j = W[n, 2r + j], fp16 or bf16 */

typedef struct {
    const float *attn_norm, *mlp_norm; /* [hidden] */
    layer_tiles qkv, o, gate_up, down;
    const float *qkv_bias; /* [q + 2 kv] or NULL */
} layer_weights;

typedef struct {
    int hidden, heads, kv_heads, head_dim, inter, layers, block_size;
    float eps;
} dims;

/* A whole forward step over B rows (see step.c). Returns 0, or < 0 on bad shapes or no memory. */
int sluice_forward(const dims *dm, const layer_weights *layers, int B, float *x, const int64_t *positions,
                   const int64_t *slots, const int32_t *tables, int table_stride, const int32_t *row_seq,
                   uint16_t *kv, int64_t layer_stride, int64_t kv_stride, const float *cos, const float *sin,
                   int nthreads, int wide_min_rows, int amx_min_rows);
int sluice_amx_available(void);
int sluice_reads_tiles(int format); /* 1 where this build's matmuls read layer tiles of `format` (TILES_*) */
/* out[r] = the RMS norm of row rows[r] of x [*, H] times w (rows NULL: row r), for r < n (step.c). */
int sluice_rms_norm(const float *x, int nx, const int64_t *rows, int n, int H, const float *w, float eps,
                    float *out);
/* The output layer's logits from int8 blocks (scale set) or a layer's tiles of `format`, each row's best
 * `refine` candidates made exact (head.c). */
int sluice_head_logits(int B, int K, const float *x, const uint8_t *blocks, const float *scale, int format, int V,
                       float *out, const float *exact, const uint8_t *exact_rows, int exact_type, int refine,
                       int nthreads, int wide_min_rows, int amx_min_rows);
/* Rows of a GGUF matrix decoded from its blocks, and x W^T at full precision from them (gguf_rows.c). */
int64_t sluice_gguf_row_bytes(int type, int K);
int sluice_gguf_rows(const uint8_t *data, int type, int K, int V, const int64_t *ids, int n, float *out, int nthreads);
int sluice_gguf_rows_product(int B, int K, const float *x, const uint8_t *data, int type, int V, float *out,
                             int nthreads);
/* Sampling (sampler.c). */
int sluice_sample(int B, int V, const float *logits, const float *temperature, const int64_t *top_k,
                  const float *top_p, const int64_t *seeds, const int64_t *offsets, int64_t *out, int nthreads);
int sluice_sample_masked(int R, int V, const float *logits, const int64_t *rows, const int32_t *masks,
                         const float *temperature, const int64_t *seeds, const int64_t *offsets, int64_t *out);
/* Attention alone for the torch path's decode rows (decode_attention.c). */
int sluice_decode_attention(int B, int heads, int kv_heads, int head_dim, const float *q, int64_t q_stride,
                            float *out, const uint16_t *k, const uint16_t *v, int block_size, const int32_t *tables,
                            int table_stride, const int32_t *seq_lens, int nthreads);
/* Profiling (profile.c), the build's ISA, and the structs' sizes and offsets for the ctypes mirrors. */
void sluice_profile(int on);
void sluice_profile_read(double *out);
const char *sluice_forward_isa(void);
int sluice_abi_sizes(int64_t *out, int n);
