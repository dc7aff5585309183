/* A packed linear weight: what packed_linear.c's slotserve_pack_weight writes, and what the kernels that
   multiply by it read (amx_gemm.c's tile GEMM on AMX; few_rows.c's few-row kernel on the vector units).

   Each block of BLOCK weights along a row is w = scale * v (+ offset): v bfloat16 values, or, in a `narrow`
   packing, integers in [-128, 127] kept in a byte each; in a packing in `halves`, each half block of 16 has
   its own scale (and offset). Layout: rows in pairs of 16-row tiles; for each pair and each block along K,
   the two tiles' values as AMX wants them (pairs along K, [16 k-pairs][16 rows][2]), 1024 values, and the
   pair's 32 scales (and offsets) per block ([pair][block][half][PAIR] with halves). Rows past N are zero.
   Narrow values go in k-quads instead ([8 k-quads][16 rows][4]), each plus 128 as an unsigned byte: what
   few_rows.c's byte products take; amx_gemm.c turns each quad back into its two pairs as it widens them. */

#ifndef SLOTSERVE_PACKED_LINEAR_H
#define SLOTSERVE_PACKED_LINEAR_H

#define BLOCK 32 /* k per block: one tile row of bfloat16 */
#define TILE 16  /* rows of a tile, and outputs of a weight tile */
#define PAIR 32  /* outputs of the two weight tiles multiplied together */
#define FEW 4    /* the most rows few_rows.c takes: its accumulators stay in registers */

/* A packed weight's buffers; offsets NULL where the blocks have none. */
typedef struct {
    const void *values; /* bfloat16 bits (uint16), or where `narrow` int8 values plus 128 (uint8, in k-quads) */
    const float *scales, *offsets;
    int narrow;
    int halves; /* each block's two halves of 16 have their own scale (and offset): GGUF's Q6_K; few rows only */
    /* The rows it takes (the caller's choice, kept here): a narrow packing's 1..max_rows, on AMX from min_rows
       on (few_rows.c below); a bfloat16 packing's min_rows..max_rows on AMX. The float32 path takes the rest. */
    long min_rows, max_rows;
} slotserve_packed_weight;

#endif
