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
   Around them: x = embedding[ids] first (with each row's rotary tables looked up by position), and the
   final norm last, so x comes back as the model's final hidden states; and where the step asks, the output
   head after it: its logits, and their argmax (a greedy pick) while they are still in the caches. */

#include "amx_gemm.c"
#include "decode_attention.c"
#include "few_rows.c"
#include "norm_rotary_swiglu_argmax.c"
#include "small_gemm.c"

/* One layer's weights (row-major, float32), their packings (packed_linear.h; NULL values: not packed), and its
   KV cache ([entries][kv_heads][head_dim]). */
typedef struct {
    const float *input_norm, *qkv, *qkv_bias, *q_norm, *k_norm, *o, *post_norm, *gate_up, *down;
    float *k_cache, *v_cache;
    slotserve_packed_weight qkv_packed, o_packed, gate_up_packed, down_packed;
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

int slotserve_decode_scratch(long tokens, long hidden, long intermediate, long heads, long kv_heads,
                              long head_dim) {
    const long q = heads * head_dim, kv = kv_heads * head_dim;
    /* normed, qkv, q, k, attn, o, gate_up, act, cos, sin */
    return tokens * (hidden + (q + 2 * kv) + q + kv + q + hidden + 2 * intermediate + intermediate + head_dim);
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
