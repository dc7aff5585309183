/* The per-row operations of a decoder layer, one call each where torch takes six to nine small ops:
   RMSNorm (with the residual add before it), rotary embedding, and SwiGLU's silu(gate) * up; and the
   greedy sampler's argmax over each row of logits. At batch 1 and in decode steps these tensors are a few
   KB, and the cost of each torch op is its dispatch; a prefill's rows are split over the threads.

   Row by row, so a row's result does not depend on the others in the batch. */

#include <math.h>

#include "vector.h"

#define PARALLEL_ROWS 64 /* fewer rows than this run on the calling thread: a thread hand-off costs more */

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, over rows of dim floats. With a residual stream,
   first residual[r] += x[r] (in place), and the sum is what gets normalized: the decoder layer's
   residual add and the next norm in one pass. */
int slotserve_rms_norm(const float *x, float *residual, const float *weight, float *out, long rows, long dim,
                       float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= PARALLEL_ROWS)
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        if (residual) {
            float *res = residual + r * dim;
            long d = 0;
            for (; d + VW <= dim; d += VW) store(res + d, load(res + d) + load(xr + d));
            for (; d < dim; d++) res[d] += xr[d];
            xr = res;
        }
        vf acc = {0};
        long d = 0;
        for (; d + VW <= dim; d += VW) {
            const vf v = load(xr + d);
            acc = fmadd(v, v, acc);
        }
        float sum = hsum(acc);
        for (; d < dim; d++) sum += xr[d] * xr[d];
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (d = 0; d + VW <= dim; d += VW) store(o + d, load(xr + d) * splat(inv) * load(weight + d));
        for (; d < dim; d++) o[d] = xr[d] * inv * weight[d];
    }
    return 0;
}

/* out[r][i] = silu(x[r][i]) * x[r][inner + i] for x [rows][2 * inner] (a SwiGLU's gate and up
   projections side by side): silu(g) = g * sigmoid(g), with sigmoid from e = exp(-|g|) so that exp never
   overflows: 1 / (1 + e) for g >= 0, e / (1 + e) below. */
int slotserve_silu_mul(const float *x, float *out, long rows, long inner, int threads) {
    /* rows are long here (the MLP's inner width): split them once there is a norm's worth of work */
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * inner >= PARALLEL_ROWS * 1024)
    for (long r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * inner, *up = gate + inner;
        float *o = out + r * inner;
        long i = 0;
        for (; i + VW <= inner; i += VW) {
            const vf g = load(gate + i);
            const vi negative = g < splat(0.0f);
            const vf e = vexp((vf)((vi)g | (vi)splat(-0.0f))); /* exp(-|g|): the sign bit set */
            const vf numerator = (vf)(((vi)splat(1.0f) & ~negative) | ((vi)e & negative));
            store(o + i, g * (numerator / (splat(1.0f) + e)) * load(up + i));
        }
        for (; i < inner; i++) {
            const float g = gate[i], e = expf(-fabsf(g));
            o[i] = g * ((g >= 0.0f ? 1.0f : e) / (1.0f + e)) * up[i];
        }
    }
    return 0;
}

/* Rotates each head of x [tokens][heads][head_dim] into out (dense), pairing element j with j + head_dim / 2,
   by the token's cos and sin [tokens][head_dim / 2]. x's tokens lie x_stride floats apart: it may be a
   column slice of a wider row (q and k within a merged q/k/v projection's output). */
int slotserve_rotary(const float *x, long x_stride, const float *cos, const float *sin, float *out, long tokens,
                     long heads, long head_dim, int threads) {
    const long half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (tokens >= PARALLEL_ROWS)
    for (long t = 0; t < tokens; t++) {
        const float *c = cos + t * half, *s = sin + t * half;
        for (long h = 0; h < heads; h++) {
            const float *x1 = x + t * x_stride + h * head_dim, *x2 = x1 + half;
            float *o1 = out + (t * heads + h) * head_dim, *o2 = o1 + half;
            long j = 0;
            for (; j + VW <= half; j += VW) {
                const vf a = load(x1 + j), b = load(x2 + j), cv = load(c + j), sv = load(s + j);
                store(o1 + j, a * cv - b * sv);
                store(o2 + j, b * cv + a * sv);
            }
            for (; j < half; j++) {
                o1[j] = x1[j] * c[j] - x2[j] * s[j];
                o2[j] = x2[j] * c[j] + x1[j] * s[j];
            }
        }
    }
    return 0;
}

/* out[r] = the index of row r's largest value, the first among equals (torch's argmax), for rows of n > 0
   floats; a row holding NaN answers its first NaN, which torch's max takes as the largest. One pass: each
   lane keeps its largest value and where it first saw it, then the lanes are compared. torch's reduction
   took 5.6 ms for a decode step's 32 x 151,936 logits here. */
int slotserve_argmax(const float *x, long rows, long n, long *out, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * n >= PARALLEL_ROWS * 1024)
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        vf best = splat(-INFINITY);
        vi at = {0}, lane = {0}, nan = {0};
        for (int l = 0; l < VW; l++) lane[l] = l;
        long i = 0;
        for (; i + VW <= n; i += VW, lane += VW) {
            const vf v = load(xr + i);
            const vi gt = v > best;
            best = (vf)(((vi)best & ~gt) | ((vi)v & gt));
            at = (at & ~gt) | (lane & gt);
            nan |= v != v;
        }
        float top = -INFINITY;
        long where = 0;
        int has_nan = 0;
        for (int l = 0; l < VW; l++) {
            has_nan |= nan[l];
            if (i > 0 && (best[l] > top || (best[l] == top && at[l] < where))) top = best[l], where = at[l];
        }
        for (; i < n; i++) {
            has_nan |= xr[i] != xr[i];
            if (xr[i] > top) top = xr[i], where = i;
        }
        if (has_nan)
            for (where = 0; xr[where] == xr[where]; where++) {}
        out[r] = where;
    }
    return 0;
}
