/* Causal attention over a KV cache: one (query row, head) per task, keys in order, so a row's
 * result depends only on its position and the cache — batch-invariant. */
#include "kiln.h"


#ifdef KILN_X86
/* attention helpers */
AVX2 static void vaxpy_avx2(float *o, float p, const float *v, int n) {
    __m256 pp = _mm256_set1_ps(p); int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(o + i, _mm256_fmadd_ps(pp, _mm256_loadu_ps(v + i), _mm256_loadu_ps(o + i)));
    for (; i < n; i++) o[i] += p * v[i];
}

/* One (query row, head) task; sc holds n scores. Scores take four keys at a time (four
 * independent FMA chains, each reduced as a lone key's would be), so a decode step is not bound
 * by the latency of one long chain; the output row of D == 64 lives in eight registers. The arithmetic of a task
 * depends only on its row and position, never on how many rows run: batch-invariant.
 * One body for both KV element types: ATTN_TASK(name, element type, load 8 as floats, load 1,
 * round): with an fp16 cache the query and the probabilities are rounded to fp16 as well, as
 * ggml's attention rounds them before its fp16 dot products (KQ and KQV), so an fp16 cache
 * reproduces llama.cpp's arithmetic more closely than exact float32 operands would. */
#define RND_NONE(x) (x)
#define RND_F16(x) _cvtsh_ss(_cvtss_sh((x), 0))
#define RND8_NONE(x) (x)
#define RND8_F16(x) _mm256_cvtph_ps(_mm256_cvtps_ph((x), 0))
#define LD1_F32(x) (x)
#define LD1_F16(x) _cvtsh_ss(x)
/* The pieces of a task, each usable alone so that a long decode can deal one (row, head)
 * between the threads (attention_decode_split): scores of keys s0..s1-1 (four at a time, each
 * reduced as a lone key's: the bits do not depend on the grouping), the softmax, and the value
 * sums of lanes i0..i1-1 (lane i: positions i, i+8, …) with their final reduction. */
#define ATTN_PHASES(NAME, T, LD8, LD1, RND, RND8)                                                    \
AVX2 void NAME##_scores(const float *Q, const T *K0, size_t ks, int t, int h, int H, int D, int s0, \
                        int s1, float scale, float *row) {                                        \
    float q[MAX_HEAD_DIM];                         /* D <= MAX_HEAD_DIM, checked by the callers */ \
    for (int i = 0; i < D; i++) q[i] = RND(Q[((size_t)t * H + h) * D + i]);                       \
    int s = s0;                                                                                   \
    if (D % 8 == 0)                                                                               \
        for (; s + 4 <= s1; s += 4) {                                                             \
            const T *k0 = K0 + s * ks, *k1 = k0 + ks, *k2 = k1 + ks, *k3 = k2 + ks;               \
            if (s + PREFETCH_ROWS + 4 <= s1)                                                      \
                for (int r = 0; r < 4; r++) prefetch_row(k0 + (PREFETCH_ROWS + r) * ks, D * sizeof(T)); \
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                           \
            for (int i = 0; i < D; i += 8) {                                                      \
                __m256 qq = _mm256_loadu_ps(q + i);                                               \
                a0 = _mm256_fmadd_ps(qq, LD8(k0 + i), a0); a1 = _mm256_fmadd_ps(qq, LD8(k1 + i), a1); \
                a2 = _mm256_fmadd_ps(qq, LD8(k2 + i), a2); a3 = _mm256_fmadd_ps(qq, LD8(k3 + i), a3); \
            }                                                                                     \
            row[s] = hsum_avx(a0) * scale; row[s + 1] = hsum_avx(a1) * scale;                     \
            row[s + 2] = hsum_avx(a2) * scale; row[s + 3] = hsum_avx(a3) * scale;                 \
        }                                                                                         \
    for (; s < s1; s++) {                                                                         \
        const T *k = K0 + s * ks;                                                                 \
        __m256 acc = _mm256_setzero_ps(); int i = 0;                                              \
        for (; i + 8 <= D; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), LD8(k + i), acc); \
        float dot = hsum_avx(acc);                                                                \
        for (; i < D; i++) dot += q[i] * LD1(k[i]);                                               \
        row[s] = dot * scale;                                                                     \
    }                                                                                             \
}                                                                                                 \
/* softmax as ggml's soft_max: exp 8 at a time (expf8), each 8's sum added in double, scaled by   \
 * 1/sum computed in double; the cells past n are ggml's masked padding (exp -> 0); a sliding     \
 * window masks the keys before it with -inf, a sink logit joins the max and the denominator */  \
AVX2 void NAME##_softmax(float *row, int n, int win, const float *sink) {                         \
    int s = 0;                                                                                    \
    if (win > 0 && n > win) for (; s < n - win; s++) row[s] = -INFINITY;                          \
    float mx = -INFINITY;                                                                         \
    for (; s < n; s++) if (row[s] > mx) mx = row[s];                                              \
    int n8 = (n + 7) & ~7;                                                                        \
    for (int j = n; j < n8; j++) row[j] = -INFINITY;                                              \
    if (sink && *sink > mx) mx = *sink;                                                           \
    __m256 vmx = _mm256_set1_ps(mx); double dsum = 0.0;                                           \
    for (s = 0; s < n8; s += 8) {                                                                 \
        __m256 e = expf8(_mm256_sub_ps(_mm256_loadu_ps(row + s), vmx));                           \
        _mm256_storeu_ps(row + s, e);                                                             \
        dsum += (double)hsum_avx(e);                                                              \
    }                                                                                             \
    if (sink) dsum += (double)expf(*sink - mx);                                                   \
    float inv = (float)(1.0 / dsum);                                                              \
    __m256 vinv = _mm256_set1_ps(inv);             /* the same product and rounding per element */\
    for (s = 0; s + 8 <= n; s += 8)                                                               \
        _mm256_storeu_ps(row + s, RND8(_mm256_mul_ps(_mm256_loadu_ps(row + s), vinv)));           \
    for (; s < n; s++) row[s] = RND(row[s] * inv);                                                \
}                                                                                                 \
/* out[d] = sum over positions of p * v[d], as ggml's prompt-batch (tinyBLAS) dot over the       \
 * positions: lane i accumulates positions i (mod 8) in order, 64 dimensions in registers, into   \
 * acc (8 lanes x D); reduce adds the lanes as hsum_avx does. D % 64 == 0. */                     \
AVX2 void NAME##_vlanes(const float *row, const T *V0, size_t ks, int D, int n, int i0, int i1,     \
                        float *acc) {                                                             \
    for (int g = 0; g < D; g += 64)                                                               \
        for (int i = i0; i < i1; i++) {                                                           \
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0; \
            for (int j = i; j < n; j += 8) {                                                      \
                __m256 p = _mm256_set1_ps(row[j]);                                                \
                const T *vr = V0 + (size_t)j * ks + g;                                            \
                if (j + 8 * PREFETCH_ROWS < n) prefetch_row(vr + 8 * PREFETCH_ROWS * ks, 64 * sizeof(T)); \
                a0 = _mm256_fmadd_ps(LD8(vr), p, a0); a1 = _mm256_fmadd_ps(LD8(vr + 8), p, a1);   \
                a2 = _mm256_fmadd_ps(LD8(vr + 16), p, a2); a3 = _mm256_fmadd_ps(LD8(vr + 24), p, a3); \
                a4 = _mm256_fmadd_ps(LD8(vr + 32), p, a4); a5 = _mm256_fmadd_ps(LD8(vr + 40), p, a5); \
                a6 = _mm256_fmadd_ps(LD8(vr + 48), p, a6); a7 = _mm256_fmadd_ps(LD8(vr + 56), p, a7); \
            }                                                                                     \
            float *d = acc + (size_t)i * D + g;                                                   \
            _mm256_storeu_ps(d, a0); _mm256_storeu_ps(d + 8, a1); _mm256_storeu_ps(d + 16, a2);   \
            _mm256_storeu_ps(d + 24, a3); _mm256_storeu_ps(d + 32, a4); _mm256_storeu_ps(d + 40, a5); \
            _mm256_storeu_ps(d + 48, a6); _mm256_storeu_ps(d + 56, a7);                           \
        }                                                                                         \
}
ATTN_PHASES(attn_f32, float, LD8_F32, LD1_F32, RND_NONE, RND8_NONE)
ATTN_PHASES(attn_f16, uint16_t, LD8_F16, LD1_F16, RND_F16, RND8_F16)

AVX2 void attn_reduce_lanes(const float *acc, float *o, int D) {
    for (int d = 0; d < D; d += 8) {
        const float *a = acc + d;
        __m256 r = _mm256_add_ps(
            _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(a + 4 * D)),
                          _mm256_add_ps(_mm256_loadu_ps(a + 2 * D), _mm256_loadu_ps(a + 6 * D))),
            _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(a + D), _mm256_loadu_ps(a + 5 * D)),
                          _mm256_add_ps(_mm256_loadu_ps(a + 3 * D), _mm256_loadu_ps(a + 7 * D))));
        _mm256_storeu_ps(o + d, r);
    }
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"      /* acc: filled by _vlanes */
#define ATTN_TASK(NAME, P, T, LD8, LD1)                                                              \
AVX2 void NAME(const float *Q, const T *K0, size_t ks, const T *V0, size_t vs, float *O, int t,    \
               int h, int H, int D, int n, float scale, float *row, int win, const float *sinks) {  \
    P##_scores(Q, K0, ks, t, h, H, D, 0, n, scale, row);                                           \
    P##_softmax(row, n, win, sinks ? sinks + h : NULL);                                           \
    float *o = O + ((size_t)t * H + h) * D;                                                       \
    int d0 = 0;                                                                                   \
    if (D % 8 == 0) {                                                                             \
        /* the same lanes kept in L1 instead of registers, so each value row is read once,      \
           not once per eight dimensions (the position loop outside, dimensions inside) */      \
        float acc[8 * MAX_HEAD_DIM] __attribute__((aligned(32)));                                 \
        if (D % 64 == 0) P##_vlanes(row, V0, vs, D, n, 0, 8, acc);                                \
        else {                                                                                    \
            for (int i = 0; i < 8 * D; i += 8) _mm256_store_ps(acc + i, _mm256_setzero_ps());     \
            for (int j = 0; j < n; j++) {                                                         \
                float *a = acc + (size_t)(j & 7) * D;                                             \
                __m256 p = _mm256_set1_ps(row[j]);                                                \
                const T *vr = V0 + (size_t)j * vs;                                                \
                if (j + PREFETCH_ROWS < n) prefetch_row(vr + PREFETCH_ROWS * vs, D * sizeof(T));  \
                for (int d = 0; d < D; d += 8)                                                    \
                    _mm256_store_ps(a + d, _mm256_fmadd_ps(LD8(vr + d), p, _mm256_load_ps(a + d))); \
            }                                                                                     \
        }                                                                                         \
        attn_reduce_lanes(acc, o, D);                                                             \
        d0 = D;                                                                                   \
    }                                                                                             \
    for (; d0 + 8 <= D; d0 += 8) {                                                                \
        __m256 l[8];                                                                              \
        for (int i = 0; i < 8; i++) l[i] = _mm256_setzero_ps();                                   \
        int j = 0;                                                                                \
        for (; j + 8 <= n; j += 8)                                                                \
            for (int i = 0; i < 8; i++)                                                           \
                l[i] = _mm256_fmadd_ps(LD8(V0 + (size_t)(j + i) * vs + d0), _mm256_set1_ps(row[j + i]), l[i]); \
        for (int i = 0; j + i < n; i++)                                                           \
            l[i] = _mm256_fmadd_ps(LD8(V0 + (size_t)(j + i) * vs + d0), _mm256_set1_ps(row[j + i]), l[i]); \
        __m256 r = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(l[0], l[4]), _mm256_add_ps(l[2], l[6])),  \
                                 _mm256_add_ps(_mm256_add_ps(l[1], l[5]), _mm256_add_ps(l[3], l[7]))); \
        _mm256_storeu_ps(o + d0, r);                                                              \
    }                                                                                             \
    for (; d0 < D; d0++) {                         /* a head_dim that is not a multiple of 8 */  \
        float l[8] = {0};                                                                         \
        for (int j = 0; j < n; j++)                                                               \
            l[j & 7] = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(LD1(V0[(size_t)j * vs + d0])),     \
                                                  _mm_set_ss(row[j]), _mm_set_ss(l[j & 7])));     \
        o[d0] = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));                \
    }                                                                                             \
}
ATTN_TASK(attn_task_avx2, attn_f32, float, LD8_F32, LD1_F32)
ATTN_TASK(attn_task_avx2_h, attn_f16, uint16_t, LD8_F16, LD1_F16)
#pragma GCC diagnostic pop
#endif

static inline float vdot(const float *a, const float *b, int n) {
#ifdef KILN_X86
    if (g_avx2) return dot_f32_avx2(a, b, n);
#endif
    float r = 0.f;
    for (int i = 0; i < n; i++) r += a[i] * b[i];
    return r;
}
static inline void vaxpy(float *o, float p, const float *v, int n) {
#ifdef KILN_X86
    if (g_avx2) { vaxpy_avx2(o, p, v, n); return; }
#endif
    for (int i = 0; i < n; i++) o[i] += p * v[i];
}

/* D values of a float32 or fp16 cache's row at `p`, as float32 (fp16 widened into buf) */
static inline const float *kv_row(const uint8_t *p, int f16, int D, float *buf) {
    if (!f16) return (const float *)p;
    const uint16_t *h = (const uint16_t *)p;
    for (int i = 0; i < D; i++) buf[i] = fp16_to_fp32(h[i]);
    return buf;
}

/* attention over T query rows (T, H, D) at positions start..start+T-1 of a cache of S positions
 * whose keys are of ggml type kt and values of vt (F32, F16, Q8_0, Q4_0); head h reads KV head
 * h / (H/Hkv); out (T, H*D). */
void attention_rows(const float *Q, KvView K, KvView V, float *O, int T, int H, int Hkv, int D,
                    int start, int kt, int vt, int nt, int S, float kq_scale, int win, const float *sinks) {
    int G = H / Hkv, f16 = kt == T_F16;
    size_t esz = f16 ? 2 : 4;              /* a plain cache's element */
    float scale = kq_scale > 0.f ? kq_scale : 1.0f / sqrtf((float)D);   /* 0: ggml's default 1/sqrt(D) */
    if (kt != vt || (kt != T_F32 && kt != T_F16)) {     /* a quantized or mixed cache (kv_quant.c) */
        #pragma omp parallel num_threads(nt) if(T * H > 1)
        {
            float *sc = malloc(((size_t)S + 8) * sizeof(float));
            #pragma omp for schedule(static, 1)
            for (int task = 0; task < T * H; task++) {
                int h = task / T, t = task % T;
                attn_task_kv(Q, K.p + (size_t)(h / G) * K.hs, K.ps, V.p + (size_t)(h / G) * V.hs, V.ps, kt, vt, O,
                             t, h, H, D, start + t + 1, scale, sc, win, sinks);
            }
            free(sc);
        }
        return;
    }
#ifdef KILN_X86
    /* 96 dimensions (Phi-3) too, for a prompt: its groups of rows keep four queries' chains in
       flight; a single query (a decode step, G = 1) is faster through its task below */
    if (g_avx2 && (D % 64 == 0 || (D % 32 == 0 && T > 1)) && D <= MAX_HEAD_DIM && G <= 64) {
        /* a KV head's query heads and GROUP_ROWS rows at once (attention_group.c): each key and
           value row read once for all of them; head-major blocks dealt round-robin */
        int nb = (T + GROUP_ROWS - 1) / GROUP_ROWS, nqm = GROUP_ROWS * G;
        #pragma omp parallel num_threads(nt) if(T * Hkv > 1)
        {
            float *rows = malloc((size_t)nqm * ((size_t)S + 8) * sizeof(float));
            float *acc = aligned_alloc(32, (size_t)nqm * 8 * D * sizeof(float));
            float *qr = malloc((size_t)nqm * D * sizeof(float));
            AttnQuery qs[GROUP_ROWS * 64];
            #pragma omp for schedule(static, 1)
            for (int task = 0; task < Hkv * nb; task++) {
                int kh = task / nb, t0 = (task % nb) * GROUP_ROWS, t1 = t0 + GROUP_ROWS < T ? t0 + GROUP_ROWS : T, nq = 0;
                for (int t = t0; t < t1; t++)
                    for (int g = 0; g < G; g++, nq++) {
                        int h = kh * G + g;
                        qs[nq] = (AttnQuery){Q + ((size_t)t * H + h) * D, qr + (size_t)nq * D, start + t + 1,
                                             rows + (size_t)nq * ((size_t)S + 8), acc + (size_t)nq * 8 * D,
                                             O + ((size_t)t * H + h) * D, sinks ? sinks + h : NULL};
                    }
                attn_group(qs, nq, K.p + (size_t)kh * K.hs, K.ps / esz, V.p + (size_t)kh * V.hs, V.ps / esz, D, f16,
                           scale, win, T > 1);      /* a prompt's rows reuse each value row: by lane */
            }
            free(rows); free(acc); free(qr);
        }
        return;
    }
    if (g_avx2) {
        #pragma omp parallel num_threads(nt) if(T * H > 1)
        {
            float *sc = malloc(((size_t)S + 8) * sizeof(float));     /* + the softmax padding */
            /* head-major, rows dealt round-robin: the threads work on one head at a time, whose
               keys and values stay in L2 (fp16, 2k positions, D 64: 512 KB), and share the causal
               triangle evenly — a static block of rows gave the last thread 3/4 of a prompt's
               work. A task's arithmetic does not depend on who runs it: the same bits. */
            #pragma omp for schedule(static, 1)
            for (int task = 0; task < T * H; task++) {
                int h = task / T, t = task % T;
                const uint8_t *K0 = K.p + (size_t)(h / G) * K.hs, *V0 = V.p + (size_t)(h / G) * V.hs;
                if (f16) attn_task_avx2_h(Q, (const uint16_t *)K0, K.ps / 2, (const uint16_t *)V0, V.ps / 2, O, t, h, H,
                                          D, start + t + 1, scale, sc, win, sinks);
                else attn_task_avx2(Q, (const float *)K0, K.ps / 4, (const float *)V0, V.ps / 4, O, t, h, H, D,
                                    start + t + 1, scale, sc, win, sinks);
            }
            free(sc);
        }
        return;
    }
#endif
    #pragma omp parallel num_threads(nt)
    {
        float *sc = malloc(((size_t)S + 8) * sizeof(float));     /* + the softmax padding */
        #pragma omp for schedule(static)
        for (int task = 0; task < T * H; task++) {
            int t = task / H, h = task % H, n = start + t + 1;
            size_t kh = (size_t)(h / G);
            float q[MAX_HEAD_DIM];         /* with an fp16 cache, rounded as the AVX2 task does */
            for (int i = 0; i < D; i++) q[i] = f16 ? round_fp16(Q[((size_t)t * H + h) * D + i]) : Q[((size_t)t * H + h) * D + i];
            float mx = -INFINITY;
            int lo = win > 0 && n > win ? n - win : 0;     /* sliding window: keys before lo masked */
            for (int s = 0; s < n; s++) {
                float kt[MAX_HEAD_DIM];
                sc[s] = s < lo ? -INFINITY : vdot(q, kv_row(K.p + kh * K.hs + s * K.ps, f16, D, kt), D) * scale;
                if (sc[s] > mx) mx = sc[s];
            }
            if (sinks && sinks[h] > mx) mx = sinks[h];
            float sum = 0.f;
            for (int s = 0; s < n; s++) { sc[s] = expf(sc[s] - mx); sum += sc[s]; }
            if (sinks) sum += expf(sinks[h] - mx);
            float inv = 1.0f / sum, *o = O + ((size_t)t * H + h) * D;
            for (int i = 0; i < D; i++) o[i] = 0.f;
            for (int s = 0; s < n; s++) {
                float vt[MAX_HEAD_DIM];
                vaxpy(o, f16 ? round_fp16(sc[s] * inv) : sc[s] * inv, kv_row(V.p + kh * V.hs + s * V.ps, f16, D, vt), D);
            }
        }
        free(sc);
    }
}
