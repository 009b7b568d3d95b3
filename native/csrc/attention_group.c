/* Attention for the query heads that share one KV head, and the rows of one sequence, at once.
 *
 * attention.c's task reads a head's keys and values for each (row, head): with grouped-query
 * attention (three to eight query heads per KV head) and a prompt's rows, every key is read from
 * memory that many times — at a long context, where keys and values are megabytes per layer,
 * attention is then bound by memory, not arithmetic. Here a group of queries walks the keys
 * once: each key row is widened once and dotted with every query that sees it, each value row
 * added into every query's lanes. Each query's arithmetic is exactly attention.c's task — a
 * key's dot one FMA chain over the dimensions then hsum_avx, the softmax as ggml's, lane
 * (position mod 8) sums in position order, the lanes reduced alike — so the bits do not depend
 * on what else is in the group: batch-invariant as before. Plain caches (float32, fp16) with
 * D % 32 == 0; the others take attention.c's and kv_quant.c's tasks. */
#include "kiln.h"

#ifdef KILN_X86
/* the query, rounded as the cache's type rounds it (fp16: as ggml rounds it before its fp16 dot) */
AVX2 void attn_group_prepare(AttnQuery *qs, int nq, int D, int f16) {
    for (int j = 0; j < nq; j++)
        for (int i = 0; i < D; i++) qs[j].qr[i] = f16 ? _cvtsh_ss(_cvtss_sh(qs[j].q[i], 0)) : qs[j].q[i];
}

/* fp16 caches on AVX-512 CPUs: a prompt's value lanes in attention_avx512.c (the same bits) */
#define LANES_512(T) (sizeof(T) == 2 && g_avx512)

/* the bodies take the number of 8-wide pieces of a row (D / 8) as a constant where they can
 * (64 and 128 dimensions): a key then lives in registers and the loops unroll */
#define GROUP_PHASES(NAME, T, LD8)                                                                   \
AVX2 static inline __attribute__((always_inline)) void NAME##_scores_nv(                            \
        AttnQuery *qs, int nq, const T *K0, size_t ks, int nv, int s0, int s1, float scale) {     \
    __m256 kk[MAX_HEAD_DIM / 8];                                                                  \
    for (int s = s0; s < s1; s++) {                                                               \
        const T *k = K0 + (size_t)s * ks;                                                         \
        if (s + PREFETCH_ROWS < s1) prefetch_row(K0 + (size_t)(s + PREFETCH_ROWS) * ks, 8 * nv * sizeof(T)); \
        for (int i = 0; i < nv; i++) kk[i] = LD8(k + 8 * i);                                      \
        for (int j = 0; j < nq; j++) {                                                            \
            if (s >= qs[j].n) continue;                                                           \
            const float *q = qs[j].qr;                                                            \
            __m256 a = _mm256_setzero_ps();                                                       \
            for (int i = 0; i < nv; i++) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * i), kk[i], a); \
            qs[j].row[s] = hsum_avx(a) * scale;                                                   \
        }                                                                                         \
    }                                                                                             \
}                                                                                                 \
/* Four queries and two keys at a time, eight chains side by side (a chain of D / 8 FMAs waits   \
   on each FMA's latency; eight keep the unit busy, and no key is held across queries in          \
   registers AVX2 does not have): each (query, key) the same chain and hsum as _nv's */            \
AVX2 static inline __attribute__((always_inline)) void NAME##_scores_tile(                          \
        AttnQuery *qs, int nq, const T *K0, size_t ks, int nv, int s0, int s1, float scale) {     \
    int s = s0;                                                                                   \
    for (; s + 2 <= s1; s += 2) {                                                                 \
        const T *k0 = K0 + (size_t)s * ks, *k1 = k0 + ks;                                         \
        if (s + PREFETCH_ROWS + 1 < s1) {                                                         \
            prefetch_row(K0 + (size_t)(s + PREFETCH_ROWS) * ks, 8 * nv * sizeof(T));              \
            prefetch_row(K0 + (size_t)(s + PREFETCH_ROWS + 1) * ks, 8 * nv * sizeof(T));          \
        }                                                                                         \
        for (int j = 0; j < nq; j += 4) {                                                         \
            const int m = nq - j < 4 ? nq - j : 4;                                                \
            const float *q0 = qs[j].qr, *q1 = qs[j + (m > 1)].qr, *q2 = qs[j + (m > 2 ? 2 : 0)].qr, \
                        *q3 = qs[j + (m > 3 ? 3 : 0)].qr;                                         \
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0; \
            for (int i = 0; i < nv; i++) {                                                        \
                const __m256 x = LD8(k0 + 8 * i), y = LD8(k1 + 8 * i);                            \
                __m256 q = _mm256_loadu_ps(q0 + 8 * i);                                           \
                a0 = _mm256_fmadd_ps(q, x, a0); b0 = _mm256_fmadd_ps(q, y, b0);                   \
                q = _mm256_loadu_ps(q1 + 8 * i);                                                  \
                a1 = _mm256_fmadd_ps(q, x, a1); b1 = _mm256_fmadd_ps(q, y, b1);                   \
                q = _mm256_loadu_ps(q2 + 8 * i);                                                  \
                a2 = _mm256_fmadd_ps(q, x, a2); b2 = _mm256_fmadd_ps(q, y, b2);                   \
                q = _mm256_loadu_ps(q3 + 8 * i);                                                  \
                a3 = _mm256_fmadd_ps(q, x, a3); b3 = _mm256_fmadd_ps(q, y, b3);                   \
            }                                                                                     \
            const __m256 A[4] = {a0, a1, a2, a3}, Bv[4] = {b0, b1, b2, b3};                      \
            for (int r = 0; r < m; r++) {                                                         \
                if (s < qs[j + r].n) qs[j + r].row[s] = hsum_avx(A[r]) * scale;                   \
                if (s + 1 < qs[j + r].n) qs[j + r].row[s + 1] = hsum_avx(Bv[r]) * scale;          \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    if (s < s1) NAME##_scores_nv(qs, nq, K0, ks, nv, s, s1, scale);                               \
}                                                                                                 \
AVX2 static void NAME##_scores(AttnQuery *qs, int nq, const T *K0, size_t ks, int D, int s0, int s1, \
                               float scale) {                                                     \
    if (nq >= 4) { NAME##_scores_tile(qs, nq, K0, ks, D / 8, s0, s1, scale); return; }           \
    if (D == 64) NAME##_scores_nv(qs, nq, K0, ks, 8, s0, s1, scale);                              \
    else if (D == 128) NAME##_scores_nv(qs, nq, K0, ks, 16, s0, s1, scale);                       \
    else NAME##_scores_nv(qs, nq, K0, ks, D / 8, s0, s1, scale);                                  \
}                                                                                                 \
/* Position after position, each value row read once into every query's lane (a decode step's:  \
   its values come from memory once, in order) */                                                   \
AVX2 static inline __attribute__((always_inline)) void NAME##_values_nv(                            \
        AttnQuery *qs, int nq, const T *V0, size_t ks, int D, int i0, int i1, int nmax) {         \
    for (int base = 0; base < nmax; base += 8)                                                    \
        for (int l = i0; l < i1 && base + l < nmax; l++) {                                        \
            int p = base + l;                                                                     \
            const T *v = V0 + (size_t)p * ks;                                                     \
            if (p + 8 < nmax) prefetch_row(v + 8 * ks, D * sizeof(T));                            \
            __m256 vv[MAX_HEAD_DIM / 8];                                                                        \
            for (int d = 0; d < D / 8; d++) vv[d] = LD8(v + 8 * d);                               \
            for (int j = 0; j < nq; j++) {                                                        \
                if (p >= qs[j].n) continue;                                                       \
                __m256 pr = _mm256_set1_ps(qs[j].row[p]);                                         \
                float *a = qs[j].acc + (size_t)l * D;                                             \
                for (int d = 0; d < D / 8; d++)                                                   \
                    _mm256_store_ps(a + 8 * d, _mm256_fmadd_ps(vv[d], pr, _mm256_load_ps(a + 8 * d))); \
            }                                                                                     \
        }                                                                                         \
}                                                                                                 \
/* A lane's chain (positions l, l + 8, ... in order) for two queries and 32 dimensions at a time, \
   the sums in registers the whole walk — where each position once loaded and stored every        \
   query's whole lane: the same FMAs in the same order, a fraction of the memory operations */   \
AVX2 static inline __attribute__((always_inline)) void NAME##_lanes_nv(                            \
        AttnQuery *qs, int nq, const T *V0, size_t ks, int D, int i0, int i1, int nmax) {         \
    (void)nmax;                                                                                   \
    for (int l = i0; l < i1; l++)                                                                 \
        for (int d0 = 0; d0 < D; d0 += 32)                                                        \
            for (int j = 0; j < nq; j += 2) {                                                     \
                const int two = j + 1 < nq, n0 = qs[j].n, n1 = two ? qs[j + 1].n : 0;             \
                const float *r0 = qs[j].row, *r1 = two ? qs[j + 1].row : r0;                      \
                float *a0 = qs[j].acc + (size_t)l * D + d0, *a1 = two ? qs[j + 1].acc + (size_t)l * D + d0 : a0; \
                __m256 x0 = _mm256_load_ps(a0), x1 = _mm256_load_ps(a0 + 8), x2 = _mm256_load_ps(a0 + 16), \
                       x3 = _mm256_load_ps(a0 + 24), y0 = _mm256_load_ps(a1), y1 = _mm256_load_ps(a1 + 8), \
                       y2 = _mm256_load_ps(a1 + 16), y3 = _mm256_load_ps(a1 + 24);               \
                const int nn = n0 > n1 ? n0 : n1;                                                 \
                for (int p = l; p < nn; p += 8) {                                                 \
                    const T *v = V0 + (size_t)p * ks + d0;                                        \
                    if (p + 32 < nn) prefetch_row(v + 32 * ks, 32 * sizeof(T));                   \
                    const __m256 v0 = LD8(v), v1 = LD8(v + 8), v2 = LD8(v + 16), v3 = LD8(v + 24); \
                    if (p < n0) {                                                                 \
                        const __m256 pr = _mm256_set1_ps(r0[p]);                                  \
                        x0 = _mm256_fmadd_ps(v0, pr, x0); x1 = _mm256_fmadd_ps(v1, pr, x1);       \
                        x2 = _mm256_fmadd_ps(v2, pr, x2); x3 = _mm256_fmadd_ps(v3, pr, x3);       \
                    }                                                                             \
                    if (p < n1) {                                                                 \
                        const __m256 pr = _mm256_set1_ps(r1[p]);                                  \
                        y0 = _mm256_fmadd_ps(v0, pr, y0); y1 = _mm256_fmadd_ps(v1, pr, y1);       \
                        y2 = _mm256_fmadd_ps(v2, pr, y2); y3 = _mm256_fmadd_ps(v3, pr, y3);       \
                    }                                                                             \
                }                                                                                 \
                _mm256_store_ps(a0, x0); _mm256_store_ps(a0 + 8, x1); _mm256_store_ps(a0 + 16, x2); _mm256_store_ps(a0 + 24, x3); \
                if (two) { _mm256_store_ps(a1, y0); _mm256_store_ps(a1 + 8, y1); _mm256_store_ps(a1 + 16, y2); _mm256_store_ps(a1 + 24, y3); } \
            }                                                                                     \
}                                                                                                 \
AVX2 static void NAME##_values(AttnQuery *qs, int nq, const T *V0, size_t ks, int D, int i0, int i1, int by_lane) { \
    int nmax = 0;                                                                                 \
    for (int j = 0; j < nq; j++) {                                                                \
        if (qs[j].n > nmax) nmax = qs[j].n;                                                       \
        for (int i = i0 * D; i < i1 * D; i += 8) _mm256_store_ps(qs[j].acc + i, _mm256_setzero_ps()); \
    }                                                                                             \
    if (by_lane && LANES_512(T) && D % 64 == 0) group_f16_lanes_avx512(qs, nq, (const uint16_t *)V0, ks, D, i0, i1); \
    else if (by_lane) NAME##_lanes_nv(qs, nq, V0, ks, D, i0, i1, nmax);                           \
    else if (D == 64) NAME##_values_nv(qs, nq, V0, ks, 64, i0, i1, nmax);                         \
    else if (D == 128) NAME##_values_nv(qs, nq, V0, ks, 128, i0, i1, nmax);                       \
    else NAME##_values_nv(qs, nq, V0, ks, D, i0, i1, nmax);                                       \
}
GROUP_PHASES(group_f32, float, LD8_F32)
GROUP_PHASES(group_f16, uint16_t, LD8_F16)

void attn_group_scores(AttnQuery *qs, int nq, const void *K0, size_t ks, int D, int f16, int s0, int s1,
                       float scale) {
    if (f16) group_f16_scores(qs, nq, (const uint16_t *)K0, ks, D, s0, s1, scale);
    else group_f32_scores(qs, nq, (const float *)K0, ks, D, s0, s1, scale);
}

void attn_group_softmax(AttnQuery *qs, int nq, int f16, int win) {
    for (int j = 0; j < nq; j++) {
        if (f16) attn_f16_softmax(qs[j].row, qs[j].n, win, qs[j].sink);
        else attn_f32_softmax(qs[j].row, qs[j].n, win, qs[j].sink);
    }
}

/* by_lane: a prompt's group (its queries reuse each value row, which stays in cache) walks each
 * lane with its sums in registers; else position after position (a decode step's, whose values
 * come from memory: read once, in order). The same bits either way. */
void attn_group_values(AttnQuery *qs, int nq, const void *V0, size_t ks, int D, int f16, int i0, int i1, int by_lane) {
    if (f16) group_f16_values(qs, nq, (const uint16_t *)V0, ks, D, i0, i1, by_lane);
    else group_f32_values(qs, nq, (const float *)V0, ks, D, i0, i1, by_lane);
}

void attn_group_reduce(AttnQuery *qs, int nq, int D) {
    for (int j = 0; j < nq; j++) attn_reduce_lanes(qs[j].acc, qs[j].out, D);
}

/* the whole of it, for one thread (by_lane: as attn_group_values) */
void attn_group(AttnQuery *qs, int nq, const void *K0, size_t ks, const void *V0, size_t vs, int D, int f16,
                float scale, int win, int by_lane) {
    int nmax = 0;
    for (int j = 0; j < nq; j++) if (qs[j].n > nmax) nmax = qs[j].n;
    attn_group_prepare(qs, nq, D, f16);
    attn_group_scores(qs, nq, K0, ks, D, f16, 0, nmax, scale);
    attn_group_softmax(qs, nq, f16, win);
    attn_group_values(qs, nq, V0, vs, D, f16, 0, 8, by_lane);
    attn_group_reduce(qs, nq, D);
}

/* The fused decode layer's attention over plain caches (layer.c): rows b of B, each of the
 * sequence whose cache rows[b] is; queries q (B, H, D) -> att. A sequence's consecutive rows
 * (GROUP_ROWS at most) and a KV head's query heads walk the keys together. */
AttnGroupPlan *attn_group_plan(const DecodeRow *rows, int B, int H, int D, int S, float *q, float *rowbuf,
                               float *accbuf, float *att, const float *sinks) {
    AttnGroupPlan *p = malloc(sizeof(AttnGroupPlan));
    p->qs = malloc((size_t)B * H * sizeof(AttnQuery));
    p->qr = malloc((size_t)B * H * D * sizeof(float));
    p->run0 = malloc((size_t)B * sizeof(int));
    p->nruns = 0;
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < H; h++) {
            size_t i = (size_t)b * H + h;
            p->qs[i] = (AttnQuery){q + i * D, p->qr + i * D, rows[b].pos + 1, rowbuf + i * (S + 8), accbuf + i * 8 * D,
                                   att + i * D, sinks ? sinks + h : NULL};
        }
        /* a run shares one cache: its first row's view is every row's */
        int same = b > 0 && rows[b].k == rows[b - 1].k && rows[b].v == rows[b - 1].v && rows[b].kps == rows[b - 1].kps &&
                   rows[b].khs == rows[b - 1].khs && rows[b].vps == rows[b - 1].vps && rows[b].vhs == rows[b - 1].vhs;
        if (!same || b - p->run0[p->nruns - 1] >= GROUP_ROWS) p->run0[p->nruns++] = b;
    }
    return p;
}

void attn_group_free(AttnGroupPlan *p) {
    if (!p) return;
    free(p->qs); free(p->qr); free(p->run0); free(p);
}

/* Called by every thread of the layer's parallel region (orphaned `omp for`s). `split`: a long
 * decode whose KV heads do not divide among the threads — each (row, KV head) in phases: scores
 * by positions, the softmax, the value lanes by halves (every piece a whole task's arithmetic). */
void attn_group_rows(const AttnGroupPlan *p, const DecodeRow *rows, int B, int H, int Hkv, int D, int f16,
                     float scale, int split, int nt, int win) {
    int G = H / Hkv;
    size_t esz = f16 ? 2 : 4;
    AttnQuery *qs = p->qs;
    #pragma omp for schedule(static)
    for (int i = 0; i < B * H; i += G) attn_group_prepare(qs + i, G, D, f16);
    if (split) {
        #pragma omp for schedule(static)
        for (int c = 0; c < B * Hkv * nt; c++) {
            int grp = c / nt, part = c % nt, b = grp / Hkv, kh = grp % Hkv, m = rows[b].pos + 1;
            int s0 = (int)((long)m * part / nt) & ~3, s1 = part == nt - 1 ? m : (int)((long)m * (part + 1) / nt) & ~3;
            attn_group_scores(qs + (size_t)grp * G, G, rows[b].k + kh * rows[b].khs, rows[b].kps / esz, D, f16, s0,
                              s1, scale);
        }
        #pragma omp for schedule(static)
        for (int grp = 0; grp < B * Hkv; grp++) attn_group_softmax(qs + (size_t)grp * G, G, f16, win);
        #pragma omp for schedule(static)
        for (int c = 0; c < B * Hkv * 2; c++) {
            int grp = c / 2, b = grp / Hkv, kh = grp % Hkv, i0 = 4 * (c % 2);
            attn_group_values(qs + (size_t)grp * G, G, rows[b].v + kh * rows[b].vhs, rows[b].vps / esz, D, f16, i0,
                              i0 + 4, 0);
        }
        #pragma omp for schedule(static)
        for (int grp = 0; grp < B * Hkv; grp++) attn_group_reduce(qs + (size_t)grp * G, G, D);
        return;
    }
    #pragma omp for schedule(static, 1)
    for (int task = 0; task < p->nruns * Hkv; task++) {
        int r = task / Hkv, kh = task % Hkv, b0 = p->run0[r], b1 = r + 1 < p->nruns ? p->run0[r + 1] : B, nq = 0;
        AttnQuery grp[GROUP_ROWS * 64];
        for (int b = b0; b < b1; b++)
            for (int g = 0; g < G; g++) grp[nq++] = qs[(size_t)b * H + kh * G + g];
        attn_group_scores(grp, nq, rows[b0].k + kh * rows[b0].khs, rows[b0].kps / esz, D, f16, 0, rows[b1 - 1].pos + 1,
                          scale);
        attn_group_softmax(grp, nq, f16, win);
        attn_group_values(grp, nq, rows[b0].v + kh * rows[b0].vhs, rows[b0].vps / esz, D, f16, 0, 8, 0);
        attn_group_reduce(grp, nq, D);
    }
}
#endif
