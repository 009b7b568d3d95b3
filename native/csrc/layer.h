/* The one-call decode of a layer (layer.c, ffn_rows.c, delta_net.c, layer_rows.c, moe_rows.c):
 * what a layer is made of as the compiled call sees it. Included by kiln.h. */
#ifndef KILN_LAYER_H
#define KILN_LAYER_H

/* ---- layer.c -------------------------------------------------------------------------------- */
void rms_row(const float *x, const float *w, float *o, int n, float eps);
void rope_row(float *x, const float *c, const float *s, int H, int D, int R, int neox);
void rope_table(int p0, int n, int half, float base, float freq_scale, const float *ff, float ext_factor,
                float corr0, float corr1, float mscale, float *c, float *s);
void swiglu_row(float *g, const float *u, size_t n);
/* Routing beyond softmax-then-top-k (ernie4.5-moe, deepseek2: llama.cpp's build_moe_ffn); all
 * zeros: the plain rule. */
typedef struct {
    const float *bias;        /* (E) added to the probabilities to choose by, not to weigh by; NULL: none */
    int sigmoid;              /* probabilities by sigmoid, not softmax (deepseek v3) */
    int groups, groups_used;  /* groups > 1: only the groups_used groups whose two best scores sum highest */
    float scale;              /* the chosen weights times this (after normalising); 0 or 1: none */
} RouteRule;
void route_row(const float *logits, int E, int k, int normalize, const RouteRule *rr, int *sel, float *w);
void sigmoid_row(float *x, size_t n);                       /* x = 1 / (1 + e^-x) */
void sigmoid_mul_row(float *x, const float *g, int n);      /* x *= sigmoid(g) */
void silu_row(float *x, int n);                             /* x *= sigmoid(x) */
void silu_gate_row(float *x, const float *g, int n);        /* x *= g * sigmoid(g) */

enum { FFN_NONE, FFN_DENSE, FFN_MOE };
#define MAX_EXPERTS 256
#define MAX_K 16

/* A LoRA on one projection of one row: scale * B (A x) added to its output, as the block path's
 * two F32 products, the scale and the add compute it. A (r, n_in), B (n_out, r), float32 — or
 * fp16 as the adapter's file holds them (`f16`; each value widened exactly before its FMA, so the
 * bits are those of the float32 copy, from half the bytes). */
enum { LORA_Q, LORA_K, LORA_V, LORA_O, LORA_GATE, LORA_UP, LORA_DOWN, LORA_TARGETS };
typedef struct { const void *a, *b; int32_t r; float scale; int32_t f16, unused; } LoraPair;

typedef struct {              /* one pre-norm llama layer, weights as stored */
    int n, H, Hkv, D, R, neox;
    float eps;
    const float *attn_norm;
    const uint8_t *wq, *wk, *wv, *wo;
    int qkv_t, v_t, wo_t;     /* q and k's type; v's (Q4_K_M files keep v in Q6_K on some layers) */
    int ffn;                  /* FFN_NONE: the caller runs it; FFN_DENSE; FFN_MOE (experts stacked) */
    const float *ffn_norm, *router;       /* router: F32 (E, n) */
    const uint8_t *wg, *wu, *wd;          /* (E, n_ff, n), (E, n_ff, n), (E, n, n_ff); E = 1 dense */
    int gu_t, wd_t, n_ff, E, k, normalize;
    RouteRule route;          /* FFN_MOE: how rows choose and weigh their experts beyond the plain rule */
    int kt, vt;               /* the K and V caches' ggml types (F32, F16, Q8_0, Q4_0) */
    float q_scale;            /* q multiplied by this after RoPE (phi3, gemma3); 0: not scaled */
    float kq_scale;           /* the attention scores' scale; 0: 1/sqrt(D) */
    const uint64_t *xtab;     /* FFN_MOE: per-expert addresses (gate, up, down) — experts streamed
                                 into a cache's slots — instead of wg/wu/wd; NULL: stacked */
    int32_t *chosen;          /* FFN_MOE: each row's k chosen experts written here, if not NULL */
    float *chosen_w;          /* and their weights, if not NULL */
    const float *q_norm, *k_norm;   /* per-head RMSNorm weights (D) of q and k before RoPE (qwen3); NULL: none */
    int qk_norm_full;         /* q_norm/k_norm are over the whole projection (H*D, Hkv*D: olmoe), not per head */
    const float *bq, *bk, *bv;      /* q, k and v biases (qwen2), added after the products; NULL: none */
    const LoraPair *lora;     /* NULL, or B x LORA_TARGETS: row b's adapter on each projection
                                 (a == NULL: none) — each sequence its own, as S-LoRA batches them */
    int win;                  /* > 0: a sliding-window layer (gemma3) — keys before pos - win + 1 masked */
    const float *post_attn_norm, *post_ffn_norm;   /* gemma3: each block's output RMS-normed before
                                                      the residual add; NULL: not */
    const float *gelu_table;  /* a dense FFN gated by ggml's fp16-table GELU (gemma3), not SwiGLU; NULL: SwiGLU */
    const float *bo;          /* the output projection's bias (gpt-oss), added after it (and any adapter); NULL: none */
    const float *sinks;       /* a sink logit per head in every softmax's denominator (gpt-oss); NULL: none */
    const float *router_b, *gate_b, *up_b, *down_b;   /* gpt-oss's routed FFN (moe_rows.c moe_oai_row) when
                                                         router_b is set: biased router, the top-k logits
                                                         softmaxed, biased experts, swiglu-oai; (E), (E, n_ff),
                                                         (E, n_ff), (E, n) */
    const uint8_t *sh_g, *sh_u, *sh_d;    /* FFN_MOE with a shared expert every row takes: its SwiGLU (sh_ff, n),
                                             (sh_ff, n), (n, sh_ff); sh_g NULL: none */
    const float *sh_gate;     /* its output gated by sigmoid(sh_gate · x) (qwen2moe, qwen35moe): F32 (n);
                                 NULL: ungated (ernie4.5-moe, deepseek2) */
    int sh_gu_t, sh_d_t, sh_ff;
    int q_gate;               /* wq gives per head D query rows then D gate rows; the attention's
                                 output x sigmoid(gate) before wo (qwen35) */
} LayerSpec;

typedef struct {              /* one sequence's row of a decode step */
    uint8_t *k, *v;           /* the layer's K/V cache: Hkv heads' rows of D values of type kt/vt, */
    size_t kps, khs, vps, vhs;  /* KV head h's row at position s at k + h * khs + s * kps (KvView) */
    int pos;                  /* the row's position: K/V written there, attention over 0..pos */
    const float *cos, *sin;   /* RoPE tables of that position (R/2) */
} DecodeRow;

/* attention_group.c: the fused layer's attention over plain caches, grouped (see there) */
#define GROUP_ROWS 4              /* a sequence's rows whose queries walk the keys together */
typedef struct { AttnQuery *qs; float *qr; int *run0; int nruns; } AttnGroupPlan;
AttnGroupPlan *attn_group_plan(const DecodeRow *rows, int B, int H, int D, int S, float *q, float *rowbuf,
                               float *accbuf, float *att, const float *sinks);
void attn_group_free(AttnGroupPlan *p);
#ifdef KILN_X86
void attn_group_rows(const AttnGroupPlan *p, const DecodeRow *rows, int B, int H, int Hkv, int D, int f16,
                     float scale, int split, int nt, int win);
#endif

int decode_layer_rows(const LayerSpec *L, float *x, int B, const DecodeRow *rows, int nt);

/* mla.c: deepseek2's multi-head latent attention (arch/deepseek2.py); the layer's LayerSpec gives
 * n, eps, attn_norm, wo (n, H*vd), the caches' types, kq_scale, neox and the FFN */
typedef struct {
    int H, C, R, nope, vd;    /* heads; kv_lora_rank; rope dimensions; a head's no-rope query; value width */
    const uint8_t *wq;        /* (H*(nope+R), n); NULL: wq_a (qr, n) -> RMS norm q_a_norm -> wq_b (H*(nope+R), qr) */
    const uint8_t *wq_a, *wq_b;
    const float *q_a_norm;
    int q_t, qa_t, qb_t, qr;
    const uint8_t *wkv_a;     /* (C + R, n): the compressed kv, then the key's rope part */
    const float *kv_a_norm;   /* (C) */
    const uint8_t *wk_b;      /* (H, C, nope): each head's no-rope query into the compressed space */
    const uint8_t *wv_b;      /* (H, vd, C): each head's compressed output to its values */
    int kva_t, kb_t, vb_t;
} MlaSpec;
int mla_layer_rows(const MlaSpec *m, const LayerSpec *L, float *x, int B, const DecodeRow *rows, int nt);

/* ffn_rows.c: a layer's FFN in the one call's parallel region, after its mixer */
typedef struct {
    float *f, *g, *u, *dn, *logits, *wsel;
    int *sel;
    Act ag, ad, ar;
    TypeInfo tg, td;
    float *shg, *shu, *shd, *shl;     /* the shared expert's gate, up, output (B rows) and gate logits */
    Act ash, ashd;
    TypeInfo tsh, tshd;
    float *ltmp;              /* the layer's adapters' A x (B x LORA_TARGETS x lrmax), its mixer's too */
    int lrmax;                /* the largest LoRA rank in the batch: A x's room per row */
} FfnWork;
void ffn_work_init(FfnWork *w, const LayerSpec *L, int B);
void ffn_work_free(FfnWork *w);
#ifdef KILN_X86
void ffn_rows(const LayerSpec *L, FfnWork *w, float *x, int B, int *missing);
/* x[b] += d[b] for B rows of n (an orphaned `omp for`): a mixer's output into the residual */
void residual_rows(float *x, const float *d, int B, int n);
/* lora_rows.c: each row's adapters on the projections ts that share the input in: lora_a (A x,
 * before the base projections: their barrier ends it), then lora_b (out[i][b] += scale * B (A x)).
 * tmp: B x LORA_TARGETS x rmax floats. */
void lora_a(const LayerSpec *L, const int *ts, int nts, const float *in, int K, int B, float *tmp, int rmax);
void lora_b(const LayerSpec *L, const int *ts, int nts, float *const *out, const int *Ns, int B,
            const float *tmp, int rmax);
/* A layer's adapter rows this thread's shares of lora_a / lora_b will read, queued (kiln.h
 * PfQueue) in the order read, with the marks each base product's end is due for (pf_due) — to
 * be fetched during the base products before them */
enum { PF_QKV, PF_O, PF_GU, PF_D };   /* the marks of lora_plan's groups */
void lora_plan(PfQueue *q, const LayerSpec *L, int B, int rmax, int qw, int kvn, int qn, size_t base_bytes);
#endif

/* delta_net.c: a gated delta net (qwen35's linear attention) for decode rows */
typedef struct {
    int Hk, Hv, dk, dv, K;    /* key heads, value heads (head h reads key head h mod Hk), their widths, the conv's kernel */
    float eps;
    const float *conv_w;      /* (C, K), C = 2 Hk dk + Hv dv channels: q | k | v */
    const float *dt, *a;      /* (Hv): the decay's softplus bias and its scale */
    const float *norm;        /* (dv): the output's RMSNorm per head */
    const uint8_t *wqkv, *wgate, *wbeta, *walpha, *wout;   /* the one call's projections, as stored */
    int qkv_t, gate_t, beta_t, alpha_t, out_t;
} DeltaSpec;
typedef struct {              /* a run of one sequence's rows: start..start+len-1 of the batch */
    float *conv, *S;          /* its last K-1 conv inputs (K-1, C) and its state (Hv, dk, dv), updated */
    int start, len;
} DeltaSeg;
#define DELTA_MAX_DV 1024
void delta_rows(const DeltaSpec *d, int nseg, const DeltaSeg *sg, int R, const float *mixed, const float *z,
                const float *bl, const float *al, float *conv, float *out);
int delta_layer_rows(const DeltaSpec *d, const LayerSpec *L, float *x, int B, const DeltaSeg *sg, int nt);
/* short_conv.c: LFM2's gated short convolution layer for decode rows */
typedef struct {
    const uint8_t *w_in, *w_out;  /* in_proj (3n, n): B | C | x rows; out_proj (n, n); as stored */
    int in_t, out_t;
    const float *conv_w;      /* (n, K): each channel's kernel, oldest position first */
    int K;
} ConvSpec;
int conv_layer_rows(const ConvSpec *s, const LayerSpec *L, float *x, int B, float *const *st, int nt);
int moe_stream_rows(const LayerSpec *L, float *x, int B, const int32_t *sel, const float *wsel,
                    const uint64_t *ptrs, uint8_t *done, float *dn, int nt);
/* moe_rows.c: a prompt's routed FFN (SwiGLU experts) in one call; gpt-oss's routed FFN of one decode row */
void moe_oai_row(const LayerSpec *L, float *x, const Act *ar, const Act *ag, Act *ad, float *logits, float *g,
                 float *u, float *dn, const TypeInfo *tg, const TypeInfo *td);
void moe_ffn_rows(const float *x, int T, int n, const int32_t *experts, const float *weights, int k,
                  const uint8_t *wg, const uint8_t *wu, int gu_t, const uint8_t *wd, int wd_t, int n_ff, int E,
                  float *out, int nt);
/* quantize.c: rows quantized as llama.cpp's quantizer writes them */
int64_t quantized_row_bytes(int type, int64_t n);
void quantize_rows(int type, const float *x, int64_t rows, int64_t n, uint8_t *out, int threads);

#endif
