/* Kiln's compiled kernels: what the parts share (types, activation rows, the dot products and
 * the pieces of a layer). Parts: quant.c (activation quantization and every weight type's dot
 * product, rows_dot/matmul_core), attention.c (causal attention over a KV cache), layer.c (norm,
 * RoPE, routing, and the one-call decode of a layer for B sequences), kv_quant.c (8- and 4-bit KV
 * caches and their attention), quantize.c (weights as llama.cpp's quantizer writes them);
 * ../_kernels.c and py_layer.c are the Python glue. No Python API is used outside the glue: the parts run without the GIL. */
#ifndef KILN_KERNELS_H
#define KILN_KERNELS_H
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KILN_X86 1
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

/* ggml type ids */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30, T_MXFP4 = 39 };

/* MXFP4 (gpt-oss experts): 32 e2m1 values as 4-bit codes, doubled to integers, with a shared
 * E8M0 exponent; ggml multiplies the doubled values and halves the scale. */
static const int8_t KVALUES_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static inline float e8m0_to_fp32_half(uint8_t x) {
    uint32_t bits = x < 2 ? 0x00200000u << x : (uint32_t)(x - 1) << 23;
    float f; memcpy(&f, &bits, 4); return f;
}
/* activation forms */
enum { A_F32, A_F16, A_BF16, A_Q8_0, A_Q8_1, A_Q8_K };

/* ---- fp16 / bf16 ---------------------------------------------------------------------------- */

static inline float fp16_to_fp32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) { bits = sign; }
        else {                                      /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            mant &= 0x3ff;
            bits = sign | (exp << 23) | (mant << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f; memcpy(&f, &bits, 4); return f;
}

static inline uint16_t fp32_to_fp16(float f) {     /* round to nearest even, as numpy */
    uint32_t x; memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000; int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    uint32_t mant = x & 0x7fffff;
    if (((x >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        mant |= 0x800000;
        uint32_t shift = (uint32_t)(14 - exp), half = 1u << (shift - 1);
        uint32_t r = mant >> shift, rem = mant & ((1u << shift) - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = mant >> 13, rem = mant & 0x1fff;
    uint32_t h = sign | ((uint32_t)exp << 10) | r;
    if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) h++;
    return (uint16_t)h;
}
static inline float round_fp16(float f) { return fp16_to_fp32(fp32_to_fp16(f)); }

static inline float bf16_to_fp32(uint16_t h) { uint32_t b = (uint32_t)h << 16; float f; memcpy(&f, &b, 4); return f; }
static inline float round_bf16(float f) {
    uint32_t b; memcpy(&b, &f, 4);
    b = (b + 0x7fff + ((b >> 16) & 1)) & 0xffff0000u;
    memcpy(&f, &b, 4); return f;
}

typedef struct { int block; int bytes; int act; } TypeInfo;

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* ---- activations ---------------------------------------------------------------------------- */

typedef struct {
    int kind;
    const float *xf;      /* A_F32: the input; A_F16/A_BF16: rounded copy */
    float *xr;
    int8_t *q;            /* quantized values */
    float *d;             /* per block scale (fp16-rounded for Q8_0/Q8_1) */
    float *s;             /* Q8_1: fp16(d * sum q) */
    int16_t *bs;          /* Q8_K: the sums of each 16 quantized values (ggml's bsums) */
    float *dT, *sT;       /* Q8_0/Q8_1: d and s again, block-major (block b of row t at b*ts + t),
                             so a multi-row kernel loads the rows' scales of a block as one vector */
    int ts;
    int16_t *kT;          /* Q8_K: each block's bsums summed in pairs (8 values, ggml's hadd of them),
                             block-major as dT is: several rows' minimum terms in one vector */
    uint8_t *qu;          /* Q8_0, batches on AVX-512: q + 128 (the unsigned side of vpdpbusd, so that a
                             weight block's sign work is done once for every row: dot_q8_avx512.c) */
    int32_t *ys;          /* Q8_0 on AVX-512: -8 × each four values' sum (a block's 8 lanes), so that a
                             one-row kernel takes the weights' side unsigned (dot1_q8_512) */
} Act;

#ifdef KILN_X86
/* exp of 8 floats exactly as ggml's AVX2 ggml_v_expf (adapted there from ARM's optimized
 * routines; max error 1.45 ulp + 0.5): the softmaxes and SiLU use it so that near-ties (MoE
 * routing) fall as they fall in llama.cpp. -inf gives 0. */
AVX2 static inline __m256 expf8(__m256 x) {
    const __m256 r = _mm256_set1_ps(0x1.8p23f);
    const __m256 z = _mm256_fmadd_ps(x, _mm256_set1_ps(0x1.715476p+0f), r);
    const __m256 n = _mm256_sub_ps(z, r);
    const __m256 b = _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.7f7d1cp-20f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0x1.62e4p-1f), x));
    const __m256i e = _mm256_slli_epi32(_mm256_castps_si256(z), 23);
    const __m256 k = _mm256_castsi256_ps(_mm256_add_epi32(e, _mm256_castps_si256(_mm256_set1_ps(1))));
    const __m256i c = _mm256_castps_si256(_mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), n), _mm256_set1_ps(126), _CMP_GT_OQ));
    const __m256 u = _mm256_mul_ps(b, b);
    const __m256 j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(_mm256_fmadd_ps(_mm256_set1_ps(0x1.0e4020p-7f), b, _mm256_set1_ps(0x1.573e2ep-5f)), u,
                        _mm256_fmadd_ps(_mm256_set1_ps(0x1.555e66p-3f), b, _mm256_set1_ps(0x1.fffdb6p-2f))),
        u, _mm256_mul_ps(_mm256_set1_ps(0x1.ffffecp-1f), b));
    if (!_mm256_movemask_ps(_mm256_castsi256_ps(c))) return _mm256_fmadd_ps(j, k, k);
    const __m256i g = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_LE_OQ)),
                                       _mm256_set1_epi32(0x82000000u));
    const __m256 s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7f000000u)));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
    const __m256i d = _mm256_castps_si256(_mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), n), _mm256_set1_ps(192), _CMP_GT_OQ));
    return _mm256_or_ps(
        _mm256_and_ps(_mm256_castsi256_ps(d), _mm256_mul_ps(s1, s1)),
        _mm256_andnot_ps(_mm256_castsi256_ps(d),
                         _mm256_or_ps(_mm256_and_ps(_mm256_castsi256_ps(c), _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                                      _mm256_andnot_ps(_mm256_castsi256_ps(c), _mm256_fmadd_ps(k, j, k)))));
}

#define H2F(p) _cvtsh_ss(rd16(p))      /* an fp16 in memory as a float (F16C) */

AVX2 static inline __m256i nibbles32(const uint8_t *qs) {   /* 16 bytes -> 32 values 0..15 */
    __m128i t = _mm_loadu_si128((const __m128i *)qs);
    __m256i b = _mm256_insertf128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
    return _mm256_and_si256(b, _mm256_set1_epi8(0x0f));
}
AVX2 static inline __m256 sum_i8_pairs(__m256i x, __m256i y) {  /* signed x · signed y -> 8 floats */
    __m256i ax = _mm256_sign_epi8(x, x), sy = _mm256_sign_epi8(y, x);
    __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1));
    return _mm256_cvtepi32_ps(dot);
}

AVX2 static inline float hsum_avx(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
/* float dot product: 8 lanes of FMAs, their sum, then the tail in order (tinyBLAS's F32 order) */
AVX2 static inline float dot_f32_avx2(const float *w, const float *x, int n) {
    __m256 acc = _mm256_setzero_ps(); int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), acc);
    float r = hsum_avx(acc);
    for (; i < n; i++) r += w[i] * x[i];
    return r;
}
#endif

/* ---- quant.c -------------------------------------------------------------------------------- */
/* A head's key (and value) rows are a cache's whole position apart (all KV heads' rows between
 * them: 2 KiB for 8 heads of 128 fp16), so walking one head's rows the hardware prefetcher, which
 * stops at 4 KiB pages, misses nearly every row and the walk waits on memory's latency. The
 * attention loops ask for the rows this far ahead (measured: decode at 2k positions 1.3-1.45x,
 * docs/engine.md). A prefetch changes no value. */
#define PREFETCH_ROWS 8
/* The widest attention head the kernels take (their per-row buffers live on the stack): DeepSeek's
 * latent attention keeps rows of kv_lora_rank + rope = 576 values (V2-Lite, V3, Kimi K2). */
#define MAX_HEAD_DIM 1024
/* A decode step streams every weight once from memory, a few rows at a time: its kernels ask for
 * the rows this far ahead, or each row's loads wait on memory's latency before the next row's
 * start (measured on a 1 B Q4_K_M decode: 12.3 -> 25.0 tok/s; a Q4_K matrix-vector product from
 * memory 11 -> 34 GB/s, docs/engine.md). A prefetch changes no value. */
#define KILN_PF_ROWS 4
#ifdef KILN_X86
/* the two K-quant weight rows KILN_PF_ROWS ahead, at this block */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *block, size_t row_bytes, int bytes) {
    const char *p = (const char *)block + KILN_PF_ROWS * row_bytes;
    for (int o = 0; o < 2 * bytes; o += 64) _mm_prefetch(p + o % bytes + (o >= bytes) * row_bytes, _MM_HINT_T0);
}
/* A one-row kernel (a decode step) streams its weight row block by block, and consecutive rows
 * of a thread's share lie end to end: it asks for the bytes KILN_PF_DIST ahead of each block, every
 * 64-byte line once (the lines that start within the block's bytes moved that far). On the 2-vCPU
 * Intel VMs here the hardware prefetcher alone streamed a Qwen3-1.7B Q4_K GEMV at 8 GB/s; 1 KiB
 * ahead, 16 (512 B: 13, 4 KiB: 15). A prefetch changes no value. */
#define KILN_PF_DIST 1024
static inline __attribute__((always_inline)) void prefetch_stream(const uint8_t *block, int bytes) {
    const uintptr_t p = (uintptr_t)block + KILN_PF_DIST;
    for (uintptr_t l = (p + 63) & ~(uintptr_t)63; l < p + (uintptr_t)bytes; l += 64) _mm_prefetch((const char *)l, _MM_HINT_T0);
}
static inline __attribute__((always_inline)) void prefetch_row(const void *p, size_t bytes) {
    for (size_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T0);
}
#endif
/* Bytes a thread reads between a layer's base products (its adapters' rows, beside a decode
 * step), fetched into L2 during those products so that the fetch overlaps their arithmetic — the
 * base products of a few sequences' step compute at about half the memory's rate. A thread
 * queues, at the layer's start, the lines it will read, in the order it reads them (lora_rows.c
 * shares its loops by thread_share so a thread knows its own), with a mark after each group that
 * must have arrived by the end of a given product; rows_dot then asks for a few lines with each
 * step of its share: at the layer's even rate (lines per base byte), more when a mark is due. */
#define PF_REGIONS 64
typedef struct {
    const char *p[PF_REGIONS]; size_t n[PF_REGIONS];
    int count, at, due;               /* regions queued; the cursor's; those due by this product's end */
    int mark[4];                      /* regions queued before each of a layer's groups of products' ends */
    size_t off, per;                  /* the cursor's byte in its region; lines a step */
    double rate;                      /* lines per byte of base weights this thread reads */
} PfQueue;
PfQueue *pf_mine(void);               /* this thread's (a thread-local: look it up once a call) */
void pf_queue(PfQueue *q, const void *p, size_t bytes);
static inline void pf_mark(PfQueue *q, int k) { q->mark[k] = q->count; }
static inline void pf_due(PfQueue *q, int k) { if (q->count) q->due = q->mark[k]; }
void pf_begin(PfQueue *q, size_t base_bytes);   /* after queuing: the layer's base bytes this thread reads */
void pf_plan(PfQueue *q, size_t steps, size_t step_bytes);   /* the product about to run: its steps here */
static inline void pf_clear(PfQueue *q) { q->count = q->at = q->due = 0; q->off = q->per = 0; q->rate = 0; }
#ifdef KILN_X86
static inline __attribute__((always_inline)) void pf_pump(PfQueue *q) {   /* one step's share of lines */
    for (size_t k = 0; k < q->per && q->at < q->count; k++) {
        _mm_prefetch(q->p[q->at] + q->off, _MM_HINT_T1);
        if ((q->off += 64) >= q->n[q->at]) { q->at++; q->off = 0; }
    }
}
#else
static inline void pf_pump(PfQueue *q) { (void)q; }
#endif
/* this thread's share [*c0, *c1) of n tasks: contiguous, in thread order (matmul.c's rule) */
static inline void thread_share(int n, int *c0, int *c1) {
    int nth = 1, me = 0;
#ifdef _OPENMP
    nth = omp_get_num_threads(); me = omp_get_thread_num();
#endif
    *c0 = (int)((long)n * me / nth); *c1 = (int)((long)n * (me + 1) / nth);
}
extern int g_avx2;            /* the AVX2/FMA/F16C paths are on (CPU detection; tests may turn them off) */
extern int g_avx512;          /* the AVX-512 VNNI K-quant kernels are on (needs g_avx2; KILN_SIMD=avx2 turns it off) */
extern int default_threads;   /* 0: OpenMP's default */
int pick_threads(int requested);
int type_info(int t, TypeInfo *ti);
float dot_row(int type, const TypeInfo *ti, const uint8_t *w, const Act *a, int t, int K);
#ifdef KILN_X86
/* ---- dot_avx2.c ------------------------------------------------------------------------------ */
int dot_row_avx2(int type, const uint8_t *w, const Act *a, int t, int K, int nb, float *out);
int has_dot4_avx2(int type, int K);
float dot_mxfp4_avx2(const uint8_t *w, const Act *a, int t, int nb);                   /* dot_mxfp4_avx2.c */
void dotR_mxfp4_avx2(const uint8_t *w, const Act *a, int t, int nb, int R, float *res);
void dot4_avx2(int type, const uint8_t *w, const Act *a, int t, int K, int nb, float *res);
int dotR_avx2(int type, const uint8_t *w, const Act *a, int t, int nb, int R, float *res);
int dotW2_avx2(int type, const uint8_t *w, size_t row_bytes, const Act *a, int t, int nb, float *res);
int dotRW2_avx2(int type, const uint8_t *w, size_t row_bytes, const Act *a, int t, int nb, int R, float *res);
int quantize_q8_block_avx2(const float *x, int8_t *q, float *amax);
/* dot_kquants_avx512.c */
int dotR_kquant_avx512(int type, const uint8_t *w, const Act *a, int t, int nb, int R, float *res);
int dotR_q8_avx512(int type, const uint8_t *w, const Act *a, int t, int nb, int R, float *res);   /* dot_q8_avx512.c */
int dotRW_q8_avx512(int type, const uint8_t *const *w, int nw, const Act *a, int t, int nb, int R, float *res);
int dot_row_avx512(int type, const uint8_t *w, const Act *a, int t, int nb, float *out);
/* dot_kquants_avx2.c */
float dot_q2_K_avx2(const uint8_t *w, const Act *a, int t, int nb);
float dot_q3_K_avx2(const uint8_t *w, const Act *a, int t, int nb);
float dot_q4_K_avx2(const uint8_t *w, const Act *a, int t, int nb);
float dot_q5_K_avx2(const uint8_t *w, const Act *a, int t, int nb);
float dot_q6_K_avx2(const uint8_t *w, const Act *a, int t, int nb);
void dot4_q4_K_avx2(const uint8_t *w, const Act *a, int t, int nb, float *res);
void dot8_q4_K_avx2(const uint8_t *w, const Act *a, int t, int nb, float *res);
void dot4_q5_K_avx2(const uint8_t *w, const Act *a, int t, int nb, float *res);
void dot4_q6_K_avx2(const uint8_t *w, const Act *a, int t, int nb, float *res);
#endif
void act_alloc(Act *a, const TypeInfo *ti, const float *x, int T, int K);
void act_row(Act *a, int t, int K);
void act_free(Act *a);
Act act_view(const Act *a, int t, int K);
void rows_dot(const Act *a, int T, int K, int type, const TypeInfo *ti, int nw,
              const uint8_t **W, const int *N, float **out);
void matmul_core(const float *x, int T, int K, int type, const TypeInfo *ti, int nw,
                 const uint8_t **W, const int *N, float **out, int nt);

/* ---- encoder_attention.c ------------------------------------------------------------------- */
int encoder_attention(const float *q, const float *k, const float *v, float *out, int n, int H, int D,
                      float scale, int nt, const float *slopes, int window, const int *blocks);
void layer_norm_rows(const float *x, const float *w, const float *b, float *out, int T, int n, float eps);
void gelu_rows(float *x, size_t n, const float *table);

/* ---- attention.c ---------------------------------------------------------------------------- */
/* A KV cache as attention reads it: KV head h's row at position s starts at p + h * hs + s * ps
 * (bytes); any positive strides are read. kv_cache.py keeps each head's positions together (ps =
 * one row): a head's walk is one sequential stream, where position-major rows put the next
 * position's row of that head a whole position away (2 KiB on Qwen3-0.6B; 28 layers' attention
 * at 2,048 positions 20 -> 15 ms). */
typedef struct { const uint8_t *p; size_t ps, hs; } KvView;
void attention_rows(const float *Q, KvView K, KvView V, float *O, int T, int H, int Hkv, int D,
                    int start, int kt, int vt, int nt, int S, float kq_scale, int win, const float *sinks);
#ifdef KILN_X86
/* the typed kernels take one KV head: K0/V0 its position 0, ks/vs the stride between positions
   in elements */
/* ggml_vec_dot_f32's order (encoder_attention.c): what ggml runs for F32 weights against a permuted view */
float vdot_ggml(const float *x, const float *y, int n);
void attn_task_avx2(const float *Q, const float *K0, size_t ks, const float *V0, size_t vs, float *O, int t,
                    int h, int H, int D, int n, float scale, float *row, int win, const float *sinks);
void attn_task_avx2_h(const float *Q, const uint16_t *K0, size_t ks, const uint16_t *V0, size_t vs, float *O,
                      int t, int h, int H, int D, int n, float scale, float *row, int win, const float *sinks);
void attn_f32_scores(const float *Q, const float *K0, size_t ks, int t, int h, int H, int D, int s0, int s1,
                     float scale, float *row);
void attn_f16_scores(const float *Q, const uint16_t *K0, size_t ks, int t, int h, int H, int D, int s0, int s1,
                     float scale, float *row);
void attn_f32_softmax(float *row, int n, int win, const float *sink);
void attn_f16_softmax(float *row, int n, int win, const float *sink);
void attn_f32_vlanes(const float *row, const float *V0, size_t vs, int D, int n, int i0, int i1, float *acc);
void attn_f16_vlanes(const float *row, const uint16_t *V0, size_t vs, int D, int n, int i0, int i1, float *acc);
void attn_reduce_lanes(const float *acc, float *o, int D);
#define LD8_F32(p) _mm256_loadu_ps(p)
#define LD8_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#endif

/* ---- attention_group.c: the query heads of one KV head, and a sequence's rows, at once -------- */
typedef struct {
    const float *q;       /* the query (D values) */
    float *qr;            /* scratch: it rounded as the cache's type (attn_group_prepare) */
    int n;                /* the keys it sees: positions 0..n-1 */
    float *row;           /* its scores (n + 8) */
    float *acc;           /* 8 lanes x D */
    float *out;           /* its output (D) */
    const float *sink;    /* its head's sink logit, or NULL */
} AttnQuery;
#ifdef KILN_X86
void attn_group_prepare(AttnQuery *qs, int nq, int D, int f16);
void attn_group_scores(AttnQuery *qs, int nq, const void *K0, size_t ks, int D, int f16, int s0, int s1, float scale);
void attn_group_softmax(AttnQuery *qs, int nq, int f16, int win);
void attn_group_values(AttnQuery *qs, int nq, const void *V0, size_t ks, int D, int f16, int i0, int i1, int by_lane);
void attn_group_reduce(AttnQuery *qs, int nq, int D);
void group_f16_lanes_avx512(AttnQuery *qs, int nq, const uint16_t *V0, size_t ks, int D, int i0, int i1);
void attn_group(AttnQuery *qs, int nq, const void *K0, size_t ks, const void *V0, size_t vs, int D, int f16,
                float scale, int win, int by_lane);
#endif

/* ---- kv_quant.c ----------------------------------------------------------------------------- */
int kv_row_bytes(int type, int D);          /* bytes of a cache row of D values; 0: not a KV type */
int kv_rot(int type, int D, int keys);     /* the Hadamard rotation of a quantized cache's rows; 0: none */
void kv_fwht(float *x, int D, int n);
void kv_store_row(int type, const float *x, uint8_t *y, int D, int rot);
void kv_load_row(int type, const uint8_t *x, float *y, int D, int rot);
/* a (query row, head) task over caches of any types, whole or in the split phases (as attention.c's);
   K0/V0: the KV head's position 0, ks/vs: bytes between positions */
void attn_task_kv(const float *Q, const uint8_t *K0, size_t ks, const uint8_t *V0, size_t vs, int kt, int vt,
                  float *O, int t, int h, int H, int D, int n, float scale, float *row, int win, const float *sinks);
void attn_kv_scores(const float *Q, const uint8_t *K0, size_t ks, int kt, int t, int h, int H, int D,
                    int s0, int s1, float scale, float *row);
void attn_kv_softmax(float *row, int n, int win, const float *sink, int vt);
void attn_kv_vlanes(const float *row, const uint8_t *V0, size_t vs, int vt, int D, int n, int i0, int i1,
                    float *acc);
void attn_kv_reduce(const float *acc, float *o, int D, int vt);
void attn_kv_fa_pass(float *row, const uint8_t *V0, size_t vs, int vt, int D, int n, int win, const float *sink,
                     float *o);

#include "layer.h"          /* the one-call decode of a layer: its specs and pieces */

#endif
