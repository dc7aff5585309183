/* A packed linear weight: what packed_linear.c's slotserve_pack_weight writes, and what the kernels that
   multiply by it read (amx_gemm.c's tile GEMM on AMX; few_rows.c's few-row kernel on the vector units).

   Each block of BLOCK weights along a row is w = scale * v (+ offset): v bfloat16 values, or, in a `narrow`
   packing, integers in [-128, 127] kept in a byte each; in a packing in `halves`, each half block of 16 has
   its own scale (and offset). Layout: rows in pairs of 16-row tiles; for each pair and each block along K,
   the two tiles' values as AMX wants them (pairs along K, [16 k-pairs][16 rows][2]), 1024 values, and the
   pair's 32 scales (and offsets) per block ([pair][block][half][PAIR] with halves). Rows past N are zero.
   Narrow values go in k-quads instead ([8 k-quads][16 rows][4]), each plus 128 as an unsigned byte: what
   few_rows.c's byte products take; amx_gemm.c turns each quad back into its two pairs as it widens them.

   A narrow packing keeps `bits` a value (its values' range decides): 8, each value plus `zero` (128) a byte, as
   above, 1024 bytes a pair's block; or 4, each value plus `zero` a nibble, two k-quads' lines in one (k-quad 2i
   in the low nibbles, 2i + 1 in the high ones), 512 bytes; or 5, those nibbles and then each value's fifth bit,
   a bit a value in the byte order of the 8-bit layout (bit i of the plane: byte i), 640 bytes; or 6, those
   nibbles, the fifth bits' plane and then the sixth bits' one, 768 bytes (GGUF's Q6_K). quad_line reads any of
   them back as the 8-bit layout's line. */

#ifndef SLOTSERVE_PACKED_LINEAR_H
#define SLOTSERVE_PACKED_LINEAR_H

#include <stdint.h>
#include <string.h>

#include "vector.h"

#define BLOCK 32 /* k per block: one tile row of bfloat16 */
#define TILE 16  /* rows of a tile, and outputs of a weight tile */
#define PAIR 32  /* outputs of the two weight tiles multiplied together */
#define FEW 4    /* the most rows few_rows.c takes: its accumulators stay in registers */

/* A packed weight's buffers; offsets NULL where the blocks have none. */
typedef struct {
    const void *values; /* bfloat16 bits (uint16), or where `narrow` int8 values plus 128 (uint8, in k-quads) */
    const void *scales, *offsets; /* float32, or float16 codes where their factors are not NULL */
    int narrow;
    int halves; /* each block's two halves of 16 have their own scale (and offset): GGUF's Q6_K; few rows only */
    /* The rows it takes (the caller's choice, kept here): a narrow packing's 1..max_rows, on AMX from min_rows
       on (few_rows.c below); a bfloat16 packing's min_rows..max_rows on AMX. The float32 path takes the rest. */
    long min_rows, max_rows;
    int bits; /* a narrow packing's bits a value: 8, 6, 5 or 4 (above) */
    int zero; /* a narrow value v is kept as v + zero */
    /* Where not NULL, scales (offsets) are float16 codes (int8 ones where their code_bytes are 1), and each is its
       code times the factor of its row and its group of SCALE_GROUP blocks: [pair][group][PAIR], float32. */
    const float *scale_factors, *offset_factors;
    int scale_code_bytes, offset_code_bytes;
    /* From how many rows on few_rows.c takes a narrow packing's products on AMX's int8 tiles (the same bits as on
       the vector units); 0: never (no AMX here, or the caller turned it off). */
    long tile_rows;
} slotserve_packed_weight;

/* One product of slotserve_few_rows_jobs: out [M][N] = x [M][K] @ w^T. */
typedef struct {
    const float *x;
    const slotserve_packed_weight *w;
    float *out;
    long M, N, K;
} slotserve_few_rows_job;

#define SCALE_GROUP 8 /* blocks under one factor: a GGUF K-quant's super-block of 256 */

/* VW float16 bits at p as floats (exactly). */
static inline __attribute__((always_inline)) vf halves_to_floats(const uint16_t *p) {
#if VW == 16
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vf v;
    for (int i = 0; i < VW; i++) {
        _Float16 h;
        memcpy(&h, p + i, sizeof h);
        v[i] = (float)h;
    }
    return v;
#endif
}

/* VW int8 values at p as floats. */
static inline __attribute__((always_inline)) vf bytes_to_floats(const int8_t *p) {
#if VW == 16
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    vf v;
    for (int i = 0; i < VW; i++) v[i] = (float)p[i];
    return v;
#endif
}

/* The VW scales (or offsets, with their factors and code bytes) of pair p's block b, segment seg, from row col of
   the pair on: float32 ones, or their codes times their factors (an exact product: the packing checked it). */
static inline __attribute__((always_inline)) vf block_scales(const void *scales, const float *factors, int code_bytes,
                                                             long p, long blocks, long b, int segments, int seg,
                                                             int col) {
    const long at = ((p * blocks + b) * segments + seg) * PAIR + col;
    if (!factors)
        return load((const float *)scales + at);
    const long groups = (blocks + SCALE_GROUP - 1) / SCALE_GROUP;
    const vf codes = code_bytes == 1 ? bytes_to_floats((const int8_t *)scales + at)
                                     : halves_to_floats((const uint16_t *)scales + at);
    return codes * load(factors + (p * groups + b / SCALE_GROUP) * PAIR + col);
}

/* A packed weight's scales (offsets) as block_scales gives them. */
static inline __attribute__((always_inline)) vf weight_scales(const slotserve_packed_weight *w, long p,
                                                              long blocks, long b, int segments, int seg, int col) {
    return block_scales(w->scales, w->scale_factors, w->scale_code_bytes, p, blocks, b, segments, seg, col);
}

static inline __attribute__((always_inline)) vf weight_offsets(const slotserve_packed_weight *w, long p,
                                                               long blocks, long b, int segments, int seg, int col) {
    return block_scales(w->offsets, w->offset_factors, w->offset_code_bytes, p, blocks, b, segments, seg, col);
}

/* One of those scales. */
static inline float block_scale(const void *scales, const float *factors, int code_bytes, long p, long blocks, long b,
                                int segments, int seg, int col) {
    const long at = ((p * blocks + b) * segments + seg) * PAIR + col;
    if (!factors)
        return ((const float *)scales)[at];
    const long groups = (blocks + SCALE_GROUP - 1) / SCALE_GROUP;
    _Float16 h = 0;
    if (code_bytes == 2)
        memcpy(&h, (const uint16_t *)scales + at, sizeof h);
    const float code = code_bytes == 1 ? (float)((const int8_t *)scales)[at] : (float)h;
    return code * factors[(p * groups + b / SCALE_GROUP) * PAIR + col];
}

/* Bytes of a pair's block of narrow values, `bits` a value. */
static inline long chunk_bytes(int bits) {
    return bits == 8 ? 2 * TILE * BLOCK : TILE * BLOCK + (bits - 4) * (2 * TILE * BLOCK / 8); /* a plane a bit past 4 */
}

/* 4 * VW bits at p, each as a byte of 0x10 (set) or 0 (clear), bit i as byte i. */
static inline __attribute__((always_inline)) vi fifth_bits(const uint8_t *p) {
#if VW == 16 && defined(__AVX512BW__)
    uint64_t m;
    memcpy(&m, p, sizeof m);
    return (vi)_mm512_maskz_mov_epi8(m, _mm512_set1_epi8(0x10));
#elif VW == 8 && defined(__AVX2__)
    uint32_t m;
    memcpy(&m, p, sizeof m);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m), /* byte i: the bits' byte i / 8 */
                                               _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2,
                                                                2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    return (vi)_mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
#else
    uint8_t bytes[4 * VW];
    for (int i = 0; i < 4 * VW; i++) bytes[i] = (uint8_t)((p[i / 8] >> (i % 8) & 1) << 4);
    vi v;
    memcpy(&v, bytes, sizeof v);
    return v;
#endif
}

/* Line (t, kq) of a pair's block of narrow values (`chunk`), its VW rows from o * VW on, as the 8-bit layout
   has it: each lane one row's 4 values at k = 4 kq .. 4 kq + 3, each plus zero, a byte. */
static inline __attribute__((always_inline)) vi quad_line(const uint8_t *chunk, const int bits, int t, int kq, int o) {
    vi u;
    if (bits == 8) {
        memcpy(&u, chunk + t * TILE * BLOCK + (kq * TILE + o * VW) * 4, sizeof u);
        return u;
    }
    memcpy(&u, chunk + t * TILE * BLOCK / 2 + (kq / 2 * TILE + o * VW) * 4, sizeof u);
    u = (kq % 2 ? u >> 4 : u) & 0x0f0f0f0f;
    if (bits == 4)
        return u;
    const uint8_t *plane = chunk + TILE * BLOCK + (t * BLOCK / 4 + kq) * 8 + o * VW / 2;
    u |= fifth_bits(plane);
    return bits == 6 ? u | fifth_bits(plane + 2 * TILE * BLOCK / 8) << 1 : u;
}

#endif
