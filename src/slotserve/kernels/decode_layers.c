/* A decode step's decoder layers in one call: the Qwen2/Qwen3 dense layer of models/qwen.py, run with
   the same kernels in the same order, so every row gets the same bits as the layer-by-layer path.

   Why: at batch 1 the weights stream at the machine's read rate, and what is left is the Python and
   dispatch between the kernels, ~10 calls per layer. Each of them runs after a multi-MB weight stream
   has pushed the interpreter's data out of the caches, at 2.5-5x its warm cost. Here the 24 layers cost
   one call, and what remains between two weight streams is a few microseconds of C.

   Per layer, for tokens decode rows (one new token each, tokens <= 64: the small GEMM's rows):
     normed = rms_norm(residual += x)          (layer 0: residual = x, normed = rms_norm(x))
     qkv = normed @ Wqkv^T + b;  [Qwen3: rms_norm over each q and k head]
     q, k = rotary(q), rotary(k);  cache[index] = k, v
     attn = decode_attention(q, cache);  x = attn @ Wo^T
     normed = rms_norm(residual += x);  x = down(silu(gate) * up)
   or, in a mixture-of-experts layer (Qwen3-MoE), each row routed to its top_k experts by the router
   (moe.c), the rows of each chosen expert gathered and run through its SwiGLU, and x = each row's
   weighted sum of its experts' outputs: models/qwen3_moe.py's steps, expert by expert in the same order.
   Around them: x = embedding[ids] first (with each row's rotary tables looked up by position), and the
   final norm last, so x comes back as the model's final hidden states; and where the step asks, the output
   head after it: its logits, and their argmax (a greedy pick) while they are still in the caches. */

#include "amx_gemm.c"
#include "decode_attention.c"
#include "few_rows.c"
#include "moe.c"
#include "norm_rotary_swiglu_argmax.c"
#include "small_gemm.c"

/* One layer's weights (row-major, float32), their packings (packed_linear.h; NULL values: not packed), and its
   KV cache ([entries][kv_heads][head_dim]). A mixture-of-experts layer (experts > 0) has no gate_up or down but a
   router [experts][hidden] and each expert's gate/up and down weights and packings ([experts] arrays each), of
   expert_intermediate columns. */
typedef struct {
    const float *input_norm, *qkv, *qkv_bias, *q_norm, *k_norm, *o, *post_norm, *gate_up, *down;
    float *k_cache, *v_cache;
    slotserve_packed_weight qkv_packed, o_packed, gate_up_packed, down_packed;
    long experts, top_k, expert_intermediate;
    int renormalize;
    const float *router;
    const float *const *expert_gate_up, *const *expert_down;
    const slotserve_packed_weight *expert_gate_up_packed, *expert_down_packed;
} slotserve_layer;

/* The step: shapes, the rows' token ids, positions and cache indices, the model's embedding, rotary tables and
   final norm, the attention's paged tables (as for slotserve_decode_attention) and the scratch it may use
   (slotserve_decode_scratch floats). */
typedef struct {
    long tokens, hidden, intermediate, heads, kv_heads, head_dim, cache_entries; /* each cache's */
    long vocab, max_position;
    float eps, scale;
    const long *ids, *positions, *cache_indices; /* [tokens] */
    const float *embedding;               /* [vocab][hidden]; NULL: x holds the rows' embeddings */
    const float *cos_table, *sin_table;   /* [max_position][head_dim / 2] */
    const float *final_norm;
    const long *rows;
    const int *block_tables, *lens;
    long seqs, table_width, block_size;
    float *scratch;
    int threads;
    /* The output head, where the step computes logits ([tokens][head_rows]; NULL: none), and each row's
       argmax (torch's: the first index among equals; NULL: none). */
    const float *head, *head_bias;
    slotserve_packed_weight head_packed;
    long head_rows;
    float *logits;
    long *argmax;
} slotserve_decode_step;

/* out = in @ w^T + bias through the packed weight where it is packed and takes the step's rows (as
   PackedWeight.runs decides for layers/linear.py: a narrow packing's rows below min_rows on few_rows.c, the rest
   on AMX), else the small GEMM (w is NULL only where the packing takes every row count). */
static int linear(const float *in, const float *w, slotserve_packed_weight packed, const float *bias, float *out,
                  long T, long N, long K, const slotserve_decode_step *s) {
    if (packed.values && T <= packed.max_rows && (T >= packed.min_rows || packed.narrow))
        return packed.narrow && T < packed.min_rows ? slotserve_few_rows_gemm(in, &packed, bias, out, T, N, K, s->threads)
                                         : slotserve_amx_gemm(in, &packed, bias, out, T, N, K, s->threads);
    return slotserve_small_gemm(in, w, bias, out, T, N, K, s->threads);
}

/* The floats of scratch a step needs: intermediate is the dense layers' MLP width (at least an expert's); experts
   and top_k are 0 without mixture-of-experts layers. */
int slotserve_decode_scratch(long tokens, long hidden, long intermediate, long heads, long kv_heads, long head_dim,
                             long experts, long top_k) {
    const long q = heads * head_dim, kv = kv_heads * head_dim;
    /* normed, qkv, q, k, attn, o, gate_up, act, cos, sin, one float to align what follows for longs; a MoE layer's
       chosen experts, slots, experts run and their first rows (longs, two floats each), router logits and weights,
       gathered rows, their outputs, and their gate/up and activations */
    return tokens * (hidden + (q + 2 * kv) + q + kv + q + hidden + 2 * intermediate + intermediate + head_dim) + 1
           + tokens * (8 * top_k + experts + top_k + 2 * top_k * hidden + 3 * top_k * intermediate);
}

/* Whether each chosen expert's products take the few-row kernel on the vector units (as linear() would pick for
   its c rows), so that slotserve_few_rows_jobs can run them all in one region. */
static int few_rows_alone(const slotserve_packed_weight *p, long c) {
    return p->values && p->narrow && c < p->min_rows && c <= p->max_rows && !(p->tile_rows > 0 && c >= p->tile_rows);
}

/* x = the MoE layer's output for the normed rows: each row's top_k experts (moe.c's routing), the rows of each
   chosen expert gathered (experts in order, rows in order within each: a stable sort of the pairs by expert)
   and run through its SwiGLU, then each row's weighted sum (moe.c's). Where every chosen expert's products take
   the few-row kernel, all of a projection's run in one call. -1: a kernel's scratch failed. */
static int mixture(const slotserve_layer *L, const float *normed, float *x, float *moe_scratch, long T, long H,
                   const slotserve_decode_step *s) {
    const long E = L->experts, k = L->top_k, I = L->expert_intermediate, pairs = T * k;
    long *chosen = (long *)moe_scratch, *slot = chosen + pairs, *expert = slot + pairs, *first = expert + pairs;
    float *logits = (float *)(first + pairs), *weights = logits + T * E, *rows = weights + pairs;
    float *ys = rows + pairs * H, *gate_up = ys + pairs * H, *act = gate_up + pairs * 2 * I;
    if (linear(normed, L->router, (slotserve_packed_weight){0}, NULL, logits, T, E, H, s)) return -1;
    if (slotserve_moe_route(logits, T, E, k, L->renormalize, weights, chosen)) return -1;
    long n = 0, used = 0; /* rows gathered; experts chosen: expert[u]'s rows from first[u] */
    int alone = 1;
    for (long e = 0; e < E; e++) {
        const long start = n;
        for (long p = 0; p < pairs; p++)
            if (chosen[p] == e) {
                memcpy(rows + n * H, normed + p / k * H, (size_t)H * sizeof(float));
                slot[p] = n++;
            }
        if (n == start) continue;
        expert[used] = e, first[used++] = start;
        alone &= few_rows_alone(L->expert_gate_up_packed + e, n - start)
                 && few_rows_alone(L->expert_down_packed + e, n - start);
    }
    if (alone) {
        slotserve_few_rows_job jobs[used];
        for (long u = 0; u < used; u++) {
            const long c = (u + 1 < used ? first[u + 1] : n) - first[u];
            jobs[u] = (slotserve_few_rows_job){rows + first[u] * H, L->expert_gate_up_packed + expert[u],
                                               gate_up + first[u] * 2 * I, c, 2 * I, H};
        }
        if (slotserve_few_rows_jobs(jobs, used, s->threads)) return -1;
        slotserve_silu_mul(gate_up, act, n, I, s->threads);
        for (long u = 0; u < used; u++)
            jobs[u] = (slotserve_few_rows_job){act + first[u] * I, L->expert_down_packed + expert[u],
                                               ys + first[u] * H, jobs[u].M, H, I};
        if (slotserve_few_rows_jobs(jobs, used, s->threads)) return -1;
    } else {
        for (long u = 0; u < used; u++) {
            const long e = expert[u], at = first[u], c = (u + 1 < used ? first[u + 1] : n) - at;
            if (linear(rows + at * H, L->expert_gate_up[e], L->expert_gate_up_packed[e], NULL, gate_up + at * 2 * I, c,
                       2 * I, H, s))
                return -1;
            slotserve_silu_mul(gate_up + at * 2 * I, act + at * I, c, I, s->threads);
            if (linear(act + at * I, L->expert_down[e], L->expert_down_packed[e], NULL, ys + at * H, c, H, I, s))
                return -1;
        }
    }
    return slotserve_moe_combine(ys, weights, slot, T, k, H, x);
}

/* x and residual: [tokens][hidden] each; x comes back as the final norm's output. Returns 0; -1 when a kernel's
   scratch memory could not be allocated, -2 when a cache index is outside the cache, -3 when a token id or a position
   is outside its table (both checked before anything is written). */
int slotserve_decode_layers(const slotserve_layer *layers, long num_layers, const slotserve_decode_step *s,
                            float *x, float *residual) {
    const long T = s->tokens, H = s->hidden, I = s->intermediate, hd = s->head_dim, half = hd / 2;
    for (long t = 0; t < T; t++) {
        if (s->cache_indices[t] < 0 || s->cache_indices[t] >= s->cache_entries) return -2;
        if (s->ids[t] < 0 || s->ids[t] >= s->vocab || s->positions[t] < 0 || s->positions[t] >= s->max_position)
            return -3;
    }
    const long q_size = s->heads * hd, kv_size = s->kv_heads * hd, qkv_n = q_size + 2 * kv_size;
    const int threads = s->threads;
    float *normed = s->scratch, *qkv = normed + T * H, *q = qkv + T * qkv_n, *k = q + T * q_size;
    float *attn = k + T * kv_size, *o = attn + T * q_size, *gate_up = o + T * H, *act = gate_up + T * 2 * I;
    float *cos = act + T * I, *sin = cos + T * half;
    float *moe_scratch = s->scratch + (sin + T * half - s->scratch + 1) / 2 * 2; /* even: longs aligned */
    for (long t = 0; t < T; t++) {
        if (s->embedding)
            memcpy(x + t * H, s->embedding + s->ids[t] * H, (size_t)H * sizeof(float));
        memcpy(cos + t * half, s->cos_table + s->positions[t] * half, (size_t)half * sizeof(float));
        memcpy(sin + t * half, s->sin_table + s->positions[t] * half, (size_t)half * sizeof(float));
    }
    for (long i = 0; i < num_layers; i++) {
        const slotserve_layer *L = layers + i;
        if (i == 0) {
            memcpy(residual, x, (size_t)(T * H) * sizeof(float));
            slotserve_rms_norm(x, NULL, L->input_norm, normed, T, H, s->eps, threads);
        } else {
            slotserve_rms_norm(x, residual, L->input_norm, normed, T, H, s->eps, threads);
        }
        if (linear(normed, L->qkv, L->qkv_packed, L->qkv_bias, qkv, T, qkv_n, H, s)) return -1;
        if (L->q_norm)
            for (long t = 0; t < T; t++) {
                float *row = qkv + t * qkv_n;
                slotserve_rms_norm(row, NULL, L->q_norm, row, s->heads, hd, s->eps, 1);
                slotserve_rms_norm(row + q_size, NULL, L->k_norm, row + q_size, s->kv_heads, hd, s->eps, 1);
            }
        slotserve_rotary(qkv, qkv_n, cos, sin, q, T, s->heads, hd, threads);
        slotserve_rotary(qkv + q_size, qkv_n, cos, sin, k, T, s->kv_heads, hd, threads);
        for (long t = 0; t < T; t++) {
            memcpy(L->k_cache + s->cache_indices[t] * kv_size, k + t * kv_size, (size_t)kv_size * sizeof(float));
            memcpy(L->v_cache + s->cache_indices[t] * kv_size, qkv + t * qkv_n + q_size + kv_size,
                   (size_t)kv_size * sizeof(float));
        }
        if (slotserve_decode_attention(q, attn, s->rows, L->k_cache, L->v_cache, s->block_tables, s->table_width,
                                       s->lens, s->seqs, s->heads, s->kv_heads, hd, s->block_size, s->scale,
                                       threads))
            return -1;
        if (linear(attn, L->o, L->o_packed, NULL, o, T, H, q_size, s)) return -1;
        slotserve_rms_norm(o, residual, L->post_norm, normed, T, H, s->eps, threads);
        if (L->experts) {
            if (mixture(L, normed, x, moe_scratch, T, H, s)) return -1;
            continue;
        }
        if (linear(normed, L->gate_up, L->gate_up_packed, NULL, gate_up, T, 2 * I, H, s)) return -1;
        slotserve_silu_mul(gate_up, act, T, I, threads);
        if (linear(act, L->down, L->down_packed, NULL, x, T, H, I, s)) return -1;
    }
    /* Row by row the residual add reads all of x's row before the norm writes it: in place is safe. */
    slotserve_rms_norm(x, residual, s->final_norm, x, T, H, s->eps, threads);
    if (!s->logits) return 0;
    if (linear(x, s->head, s->head_packed, s->head_bias, s->logits, T, s->head_rows, H, s)) return -1;
    if (s->argmax) slotserve_argmax(s->logits, T, s->head_rows, s->argmax, threads);
    return 0;
}
