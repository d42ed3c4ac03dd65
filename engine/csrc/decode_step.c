/* A decode step's decoder layers in one native call: the same kernels in the same order as
 * engine/model.py's DecoderLayer.forward (so the same bits), driven from C instead of Python.
 *
 * Why: a batch-1 decode step of the 50M benchmark model spent ~4.5 ms in its kernels and ~1.6 ms
 * in the Python between them (8 layers x ~10 kernel calls, each through nn.Module dispatch,
 * tensor views and ctypes). The kernels are reached through function pointers the loader took
 * from their own libraries (engine/decode_step.py), so each is built and cached once; this file
 * only sequences them over buffers it is handed. The GIL is released for the whole call.
 *
 * Only what every layer of a plain Llama-style decode step needs: RMSNorm, QKV, rotary over
 * the whole head, the KV write, paged decode attention, o_proj + residual, RMSNorm, gate/up,
 * SiLU-and-multiply, down + residual; the final norm. Anything else (qk norms, partial rotary,
 * other activations, prompt rows, rows a layer skips, weights routed to a library GEMM) runs
 * through torch as before. */
#include <stdint.h>
#include <string.h>

typedef void (*rms_fn)(const float *, int64_t, const float *, int64_t, int64_t, float, float *, int64_t);
typedef void (*gemm_fn)(const float *, int64_t, int64_t, int64_t, const float *, int64_t, const float *,
                        const float *, int64_t, float *, int64_t);
typedef void (*rotary_fn)(float *, int64_t, int64_t, int, int, const float *, const float *, int64_t);
typedef void (*silu_fn)(const float *, int64_t, int64_t, int64_t, float *, int64_t);
typedef void (*write_kv_fn)(const char *, int64_t, const char *, int64_t, int64_t, int64_t, char *, char *,
                            int64_t, int64_t, const int64_t *, const int64_t *);
typedef void (*attn_fn)(const float *, int64_t, const float *, const float *, int64_t, int64_t, int64_t,
                        const int64_t *, int64_t, const int64_t *, int, int, int, int, int, int64_t, float,
                        float *);

typedef struct {
    const float *in_norm, *post_norm;                 /* [hidden] */
    const float *qkv, *o, *gate_up, *down;            /* packed panels (panel_gemm.c) */
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias; /* or NULL */
    float *k_cache, *v_cache;                          /* the layer's pools */
} step_layer;

/* engine/decode_step.py's StepPlan mirrors this layout. */
typedef struct {
    int64_t hidden, inter, heads, kv_heads, head_dim, layers, block_size, window;
    int64_t block_stride, token_stride, head_stride; /* the pools', in floats */
    rms_fn rms;
    gemm_fn gemm;
    rotary_fn rotary;
    silu_fn silu;
    write_kv_fn write_kv;
    attn_fn attn;
    const float *embed;      /* [vocab, hidden] */
    const float *cos, *sin;  /* [positions, head_dim] */
    const float *final_norm; /* [hidden] */
    const step_layer *layer; /* [layers] */
    float eps, scale;
} step_plan;

/* Floats of `work` a step of `rows` needs. */
int64_t decode_step_work(const step_plan *p, int64_t rows) {
    const int64_t qkv = (p->heads + 2 * p->kv_heads) * p->head_dim, q = p->heads * p->head_dim;
    const int64_t mlp = 3 * p->inter; /* gate/up, then the activation */
    return rows * (2 * p->hidden + qkv + q + mlp + 2 * p->head_dim);
}

/* ids, pos: the rows' tokens and positions; slot_blocks/offsets: where each row's K and V go;
 * tables, lens: the rows' block tables and context lengths (the new token included). `out`
 * (rows x hidden) gets the final norm's output. */
void decode_step(const step_plan *p, int64_t rows, const int64_t *ids, const int64_t *pos,
                 const int64_t *slot_blocks, const int64_t *slot_offsets, const int64_t *tables,
                 int64_t table_stride, const int64_t *lens, float *work, float *out) {
    const int64_t h = p->hidden, d = p->head_dim, q = p->heads * d, kv = p->kv_heads * d;
    const int64_t qkvw = q + 2 * kv, inter = p->inter;
    float *x = work, *y = x + rows * h, *qkv = y + rows * h, *attn = qkv + rows * qkvw;
    float *gu = attn + rows * q, *act = gu + rows * 2 * inter, *cosb = act + rows * inter, *sinb = cosb + rows * d;
    for (int64_t r = 0; r < rows; ++r) {
        memcpy(x + r * h, p->embed + ids[r] * h, sizeof(float) * h);
        memcpy(cosb + r * d, p->cos + pos[r] * d, sizeof(float) * d);
        memcpy(sinb + r * d, p->sin + pos[r] * d, sizeof(float) * d);
    }
    for (int64_t i = 0; i < p->layers; ++i) {
        const step_layer *L = &p->layer[i];
        p->rms(x, h, L->in_norm, rows, h, p->eps, y, h);
        p->gemm(y, h, rows, h, L->qkv, qkvw, L->qkv_bias, NULL, 0, qkv, qkvw);
        p->rotary(qkv, qkvw, rows, (int)(p->heads + p->kv_heads), (int)d, cosb, sinb, d);
        p->write_kv((const char *)(qkv + q), qkvw * 4, (const char *)(qkv + q + kv), qkvw * 4, rows, kv * 4,
                    (char *)L->k_cache, (char *)L->v_cache, p->block_stride * 4, p->token_stride * 4, slot_blocks,
                    slot_offsets);
        p->attn(qkv, qkvw, L->k_cache, L->v_cache, p->block_stride, p->token_stride, p->head_stride, tables,
                table_stride, lens, (int)rows, (int)p->heads, (int)p->kv_heads, (int)d, (int)p->block_size,
                p->window, p->scale, attn);
        p->gemm(attn, q, rows, q, L->o, h, L->o_bias, x, h, x, h); /* + residual, in place */
        p->rms(x, h, L->post_norm, rows, h, p->eps, y, h);
        p->gemm(y, h, rows, h, L->gate_up, 2 * inter, L->gate_up_bias, NULL, 0, gu, 2 * inter);
        p->silu(gu, 2 * inter, rows, inter, act, inter);
        p->gemm(act, inter, rows, inter, L->down, h, L->down_bias, x, h, x, h);
    }
    p->rms(x, h, p->final_norm, rows, h, p->eps, out, h);
}
