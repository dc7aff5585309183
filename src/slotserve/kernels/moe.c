/* A mixture-of-experts layer's routing and its weighted sum, as models/qwen3_moe.py computes them on the CPU and
   decode_layers.c's fused step does: both call these, so a row gets the same experts, weights and sums in each.

   Route: each row's softmax over its router logits (float32, its largest subtracted), its top_k experts by
   probability (the lower number first among equals), their probabilities, renormalized to sum to one where asked
   (every Qwen3-MoE release does). Combine: out[t] = sum over j of weights[t][j] * ys[slot[t][j]], j in order, each
   product rounded before it is added (-ffp-contract=off). */

#include <math.h>

#include "vector.h"

#define MAX_EXPERTS 1024 /* the widest router a row's probabilities are kept on the stack for */

int slotserve_moe_route(const float *logits, long rows, long experts, long top_k, int renormalize, float *weights,
                        long *chosen) {
    if (experts > MAX_EXPERTS || top_k > experts || top_k < 1) return -1;
    for (long r = 0; r < rows; r++) {
        const float *l = logits + r * experts;
        float p[MAX_EXPERTS], largest = -INFINITY, sum = 0.0f;
        unsigned char taken[MAX_EXPERTS] = {0};
        for (long e = 0; e < experts; e++) largest = l[e] > largest ? l[e] : largest;
        for (long e = 0; e < experts; e++) sum += p[e] = expf(l[e] - largest);
        for (long e = 0; e < experts; e++) p[e] /= sum;
        float *w = weights + r * top_k, picked = 0.0f;
        long *c = chosen + r * top_k;
        for (long j = 0; j < top_k; j++) {
            long best = -1;
            for (long e = 0; e < experts; e++)
                if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
            taken[best] = 1;
            c[j] = best;
            picked += w[j] = p[best];
        }
        if (renormalize)
            for (long j = 0; j < top_k; j++) w[j] /= picked;
    }
    return 0;
}

int slotserve_moe_combine(const float *ys, const float *weights, const long *slot, long rows, long top_k, long dim,
                          float *out) {
    for (long t = 0; t < rows; t++) {
        float *o = out + t * dim;
        for (long j = 0; j < top_k; j++) {
            const float *y = ys + slot[t * top_k + j] * dim;
            const float w = weights[t * top_k + j];
            long d = 0;
            if (j == 0) {
                for (; d + VW <= dim; d += VW) store(o + d, splat(w) * load(y + d));
                for (; d < dim; d++) o[d] = w * y[d];
            } else {
                for (; d + VW <= dim; d += VW) store(o + d, load(o + d) + splat(w) * load(y + d));
                for (; d < dim; d++) o[d] += w * y[d];
            }
        }
    }
    return 0;
}
