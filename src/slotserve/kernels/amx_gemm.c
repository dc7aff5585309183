/* A float32 linear through AMX, Intel's tile units (Sapphire Rapids and later), with every product exact:
   out[M][N] = x[M][K] @ w[N][K]^T (+ bias[N]).

   AMX multiplies bfloat16 tiles and sums the products in float32. Two facts make that a float32 GEMM here:
   - Many float32 weights are, in each block of 32 along a row, one float32 scale times bfloat16 values: a
     GGUF's Q8_0 and Q5_0 blocks (an fp16 scale times small integers) and every bfloat16 checkpoint loaded
     in float32 (scale 1) are. `pack` finds each block's scale and keeps the bfloat16 values, or says the
     weight is not of that form (then the caller keeps its float32 path).
   - A float32 activation is exactly the sum of three bfloat16 parts (8 + 8 + 8 significant bits).
   So each block's sum is three tile products of exact bfloat16 x bfloat16 terms, summed in float32, then
   scaled and added up across blocks with fused multiply-adds: the same rounding, term by term, as a float32
   GEMM's sums, and measured closer to the float64 result than our FMA kernel (small_gemm.c) on the default
   model's shapes. The weights stream at 2 bytes a value instead of 4.

   A row's result depends on that row alone (the batch is cut into tiles of rows, padded with zero rows), so
   its bits are the same in any batch. They are not the bits of the float32 FMA kernels.

   Layout of a packed weight: rows in pairs of 16-row tiles; for each pair and each block of 32 along K, the
   two tiles' values as AMX wants them (bfloat16 pairs along K, [16 k-pairs][16 rows][2]), 1024 values; and
   the pair's 32 scales per block. Rows past N are zero. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32 /* k per block: one tile row of bfloat16 */
#define TILE 16  /* rows of a tile, and outputs of a weight tile */
#define PAIR 32  /* outputs of the two weight tiles multiplied together */

static uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static uint32_t gcd(uint32_t a, uint32_t b) {
    while (b) {
        const uint32_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* The scale s of one block of BLOCK weights such that every w[i] / s is a bfloat16 value and s times it gives
   w[i] back; 0 where there is none. The odd parts of the values' significands share their greatest common
   divisor g: w[i] / g is exact, and a bfloat16 where its odd part is below 2^8. */
static float block_scale(const float *w) {
    uint32_t g = 0;
    for (int i = 0; i < BLOCK; i++) {
        const uint32_t u = float_bits(w[i]), e = (u >> 23) & 0xff, m = u & 0x7fffff;
        if (e == 0 && m == 0)
            continue;
        if (e == 0 || e == 0xff) /* subnormal (AMX reads those as zero), infinite or NaN */
            return 0.0f;
        const uint32_t odd = (m | 0x800000) >> __builtin_ctz(m | 0x800000);
        if (!g || odd % g)
            g = gcd(g, odd);
    }
    if (!g)
        return 1.0f;
    const float s = (float)g;
    for (int i = 0; i < BLOCK; i++) {
        const float v = w[i] / s;
        const uint32_t e = (float_bits(v) >> 23) & 0xff;
        if ((float_bits(v) & 0xffff) || (v != 0.0f && e == 0) || v * s != w[i])
            return 0.0f;
    }
    return s;
}

/* Packs w [N][K] (K a multiple of BLOCK) into `values` (uint16, pairs * K * PAIR) and `scales` (float, pairs *
   K / BLOCK * PAIR), pairs = ceil(N / PAIR). Returns 0, or -1 where some block has no scale (nothing usable
   is left in the buffers then). */
int slotserve_amx_pack(const float *w, long N, long K, uint16_t *values, float *scales, int threads) {
    if (K % BLOCK)
        return -1;
    const long blocks = K / BLOCK, pairs = (N + PAIR - 1) / PAIR;
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads) reduction(| : bad)
    for (long p = 0; p < pairs; p++) {
        for (long b = 0; b < blocks && !bad; b++) {
            uint16_t *tile = values + (p * blocks + b) * 2 * TILE * BLOCK;
            float *scale = scales + (p * blocks + b) * PAIR;
            for (int r = 0; r < PAIR; r++) {
                const long n = p * PAIR + r;
                const int t = r / TILE, col = r % TILE;
                const float *row = w + n * K + b * BLOCK;
                const float s = n < N ? block_scale(row) : 1.0f;
                if (s == 0.0f) {
                    bad = 1;
                    break;
                }
                scale[r] = s;
                for (int k = 0; k < BLOCK; k++)
                    tile[t * TILE * BLOCK + ((k / 2) * TILE + col) * 2 + k % 2] =
                        n < N ? (uint16_t)(float_bits(row[k] / s) >> 16) : 0;
            }
        }
    }
    return bad ? -1 : 0;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Asks the kernel for the tile registers (Linux grants them per process). Returns 0 where AMX can run. */
int slotserve_amx_init(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) ? -1 : 0; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Tiles 0-3: float32 sums of (rows 0-15, 16-31) x (weight tile 0, 1); 4-5: weight tiles; 6-7: activations. */
static void configure_tiles(void) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.colsb[i] = 64;
        c.rows[i] = TILE;
    }
    _tile_loadconfig(&c);
}

/* x [M][K] float32 into three bfloat16 planes [3][Mp][K] whose sum is x exactly (rows past M zero). */
static void split_bf16(const float *x, long M, long Mp, long K, uint16_t *parts, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long m = 0; m < Mp; m++)
        for (long k = 0; k < K; k += 16) {
            const __mmask16 lanes = K - k >= 16 ? 0xffff : (__mmask16)((1u << (K - k)) - 1);
            __m512 v = m < M ? _mm512_maskz_loadu_ps(lanes, x + m * K + k) : _mm512_setzero_ps();
            for (int p = 0; p < 3; p++) {
                const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
                _mm256_mask_storeu_epi16(parts + (p * Mp + m) * K + k, lanes, h);
                v = _mm512_sub_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
            }
        }
}

/* Rows m0..m0+31 against the weight pair p, all blocks; written to out where m < M and n < N. */
static void pair_rows(const uint16_t *parts, const uint16_t *values, const float *scales, const float *bias,
                      float *out, long M, long Mp, long N, long K, long p, long m0) {
    const long blocks = K / BLOCK;
    float sums[4 * TILE * TILE] __attribute__((aligned(64)));
    __m512 acc[2 * PAIR];
#pragma GCC unroll 64
    for (int i = 0; i < 2 * PAIR; i++) acc[i] = _mm512_setzero_ps();
    for (long b = 0; b < blocks; b++) {
        const uint16_t *w = values + (p * blocks + b) * 2 * TILE * BLOCK;
        for (int line = 0; line < 2 * TILE * BLOCK * 2; line += 64) /* two blocks on: tile loads stall on memory */
            _mm_prefetch((const char *)(w + 2 * 2 * TILE * BLOCK) + line, _MM_HINT_T0);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(4, w, 64);
        _tile_loadd(5, w + TILE * BLOCK, 64);
        for (int part = 0; part < 3; part++) {
            const uint16_t *a = parts + (part * Mp + m0) * K + b * BLOCK;
            _tile_loadd(6, a, K * 2);
            _tile_loadd(7, a + TILE * K, K * 2);
            _tile_dpbf16ps(0, 6, 4);
            _tile_dpbf16ps(1, 7, 4);
            _tile_dpbf16ps(2, 6, 5);
            _tile_dpbf16ps(3, 7, 5);
        }
        _tile_stored(0, sums, 64);
        _tile_stored(1, sums + TILE * TILE, 64);
        _tile_stored(2, sums + 2 * TILE * TILE, 64);
        _tile_stored(3, sums + 3 * TILE * TILE, 64);
        const float *s = scales + (p * blocks + b) * PAIR;
        const __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + TILE);
#pragma GCC unroll 32
        for (int m = 0; m < PAIR; m++) {
            acc[m] = _mm512_fmadd_ps(_mm512_load_ps(sums + m * TILE), s0, acc[m]);
            acc[PAIR + m] = _mm512_fmadd_ps(_mm512_load_ps(sums + 2 * TILE * TILE + m * TILE), s1, acc[PAIR + m]);
        }
    }
    for (int t = 0; t < 2; t++) {
        const long n0 = p * PAIR + t * TILE;
        if (n0 >= N)
            break;
        const __mmask16 lanes = N - n0 >= TILE ? 0xffff : (__mmask16)((1u << (N - n0)) - 1);
        const __m512 add = bias ? _mm512_maskz_loadu_ps(lanes, bias + n0) : _mm512_setzero_ps();
        for (int m = 0; m < PAIR && m0 + m < M; m++)
            _mm512_mask_storeu_ps(out + (m0 + m) * N + n0, lanes, _mm512_add_ps(acc[t * PAIR + m], add));
    }
}

/* out = x @ w^T + bias with w packed by slotserve_amx_pack; bias may be NULL. Returns 0, or -1 where the
   scratch buffer could not be allocated. */
int slotserve_amx_gemm(const float *x, const uint16_t *values, const float *scales, const float *bias, float *out,
                       long M, long N, long K, int threads) {
    const long Mp = (M + PAIR - 1) / PAIR * PAIR, pairs = (N + PAIR - 1) / PAIR;
    uint16_t *parts = aligned_alloc(64, ((size_t)(3 * Mp * K) * sizeof(uint16_t) + 63) / 64 * 64);
    if (!parts)
        return -1;
    split_bf16(x, M, Mp, K, parts, threads);
#pragma omp parallel num_threads(threads)
    {
        configure_tiles();
#pragma omp for schedule(dynamic, 2) collapse(2)
        for (long p = 0; p < pairs; p++)
            for (long m0 = 0; m0 < Mp; m0 += PAIR) pair_rows(parts, values, scales, bias, out, M, Mp, N, K, p, m0);
        _tile_release();
    }
    free(parts);
    return 0;
}
#else
int slotserve_amx_init(void) { return -1; }

int slotserve_amx_gemm(const float *x, const uint16_t *values, const float *scales, const float *bias, float *out,
                       long M, long N, long K, int threads) {
    (void)x, (void)values, (void)scales, (void)bias, (void)out, (void)M, (void)N, (void)K, (void)threads;
    return -2;
}
#endif
