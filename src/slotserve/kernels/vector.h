/* What the C kernels share: one vector type as wide as the instruction set the file is compiled for
   (-march=native: 16 floats with AVX-512, else 8, which GCC's generic vectors also map onto other
   machines), and the few operations on it that need care. */

#ifndef SLOTSERVE_VECTOR_H
#define SLOTSERVE_VECTOR_H

#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif

typedef float vf __attribute__((vector_size(VW * sizeof(float))));
typedef int vi __attribute__((vector_size(VW * sizeof(int))));
typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
typedef float v4 __attribute__((vector_size(4 * sizeof(float))));

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* A vector of copies of s, as one broadcast (from memory where s comes from there): GCC's generic form
   `(vf){0} + s` compiles to an add and a shuffle, which share a port with the multiply-adds. */
static inline __attribute__((always_inline)) vf splat(float s) {
#if defined(__AVX512F__)
    return (vf)_mm512_set1_ps(s);
#elif defined(__AVX__)
    return (vf)_mm256_set1_ps(s);
#else
    return (vf){0} + s;
#endif
}

/* a * b + c with one rounding. The kernels build with -ffp-contract=off, so that the compiler never
   decides by itself, differently in differently shaped copies of one loop, which products to fuse: a
   row's bits would then depend on the tile it fell in (seen on AVX2: the last, narrower tile of rows). */
static inline __attribute__((always_inline)) vf fmadd(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* The sum of a vector's lanes, folded in halves (a fixed order, so the same bits every time). */
static inline float hsum(vf v) {
#if VW == 16
    const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    const v8 a = v;
#endif
    const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* exp(x) for x <= 0 (scores less their maximum), to ~1 ulp: 2^n * e^r with |r| <= ln2/2 and a degree-6
   polynomial for e^r (Cephes' coefficients); 0 below -87, where e^x is under float's smallest normal. */
static inline vf vexp(vf x) {
    const vi low = x < splat(-87.0f); /* all ones where true */
    x = (vf)(((vi)x & ~low) | ((vi)splat(-87.0f) & low));
    const vf magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    vf t = fmadd(x, splat(1.44269504088896341f), magic);
    const vf n = t - magic;
    vf r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
    vf p = splat(1.9875691500e-4f);
    p = fmadd(p, r, splat(1.3981999507e-3f));
    p = fmadd(p, r, splat(8.3334519073e-3f));
    p = fmadd(p, r, splat(4.1665795894e-2f));
    p = fmadd(p, r, splat(1.6666665459e-1f));
    p = fmadd(p, r, splat(5.0000001201e-1f));
    p = p * r * r + r + splat(1.0f);
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)((vi)(p * (vf)bits) & ~low);
}

#endif
