/* A prompt's attention values with AVX-512 (g_avx512): attention_group.c's by-lane walk, four
 * queries and 64 dimensions a pass, sixteen 16-wide sums in registers.
 *
 * The value pass's sums run along positions, one per dimension: a dimension's chain is its own
 * FMAs (positions l, l + 8, ... in order, from its lane's stored sum) whatever the vector width,
 * so 16-wide registers give the AVX2 walk's bits — they only carry twice the dimensions per
 * instruction, and AVX-512's 32 registers hold four queries' sums where AVX2's 16 hold two. */
#include "kiln.h"

#ifdef KILN_X86
#define AVX512F __attribute__((target("avx2,fma,f16c,avx512f,avx512vl")))
#define LD16_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))

/* query k's four 16-dimension sums += the position's values × its probability, if it sees p */
#define LANE_FMAS(k, s0, s1, s2, s3) do {                                                           \
        if (p < n[k]) {                                                                           \
            const __m512 pr = _mm512_set1_ps(r[k][p]);                                            \
            s0 = _mm512_fmadd_ps(v0, pr, s0); s1 = _mm512_fmadd_ps(v1, pr, s1);                   \
            s2 = _mm512_fmadd_ps(v2, pr, s2); s3 = _mm512_fmadd_ps(v3, pr, s3);                   \
        }                                                                                         \
    } while (0)

/* lanes i0..i1 of each query's sums (acc: 8 x D, zeroed by the caller) over values V0 (rows ks
 * apart); D % 64 == 0 */
AVX512F void group_f16_lanes_avx512(AttnQuery *qs, int nq, const uint16_t *V0, size_t ks, int D, int i0, int i1) {
    for (int l = i0; l < i1; l++)
        for (int d0 = 0; d0 < D; d0 += 64)
            for (int j = 0; j < nq; j += 4) {
                const int m = nq - j < 4 ? nq - j : 4;
                int n[4], nn = 0;
                const float *r[4];
                float *a[4];
                for (int k = 0; k < 4; k++) {        /* past the group's end: query j again, never added */
                    const AttnQuery *qk = &qs[j + (k < m ? k : 0)];
                    n[k] = k < m ? qk->n : 0; r[k] = qk->row; a[k] = qk->acc + (size_t)l * D + d0;
                    if (n[k] > nn) nn = n[k];
                }
                __m512 x0 = _mm512_loadu_ps(a[0]), x1 = _mm512_loadu_ps(a[0] + 16), x2 = _mm512_loadu_ps(a[0] + 32),
                       x3 = _mm512_loadu_ps(a[0] + 48), y0 = _mm512_loadu_ps(a[1]), y1 = _mm512_loadu_ps(a[1] + 16),
                       y2 = _mm512_loadu_ps(a[1] + 32), y3 = _mm512_loadu_ps(a[1] + 48), z0 = _mm512_loadu_ps(a[2]),
                       z1 = _mm512_loadu_ps(a[2] + 16), z2 = _mm512_loadu_ps(a[2] + 32), z3 = _mm512_loadu_ps(a[2] + 48),
                       w0 = _mm512_loadu_ps(a[3]), w1 = _mm512_loadu_ps(a[3] + 16), w2 = _mm512_loadu_ps(a[3] + 32),
                       w3 = _mm512_loadu_ps(a[3] + 48);
                for (int p = l; p < nn; p += 8) {
                    const uint16_t *v = V0 + (size_t)p * ks + d0;
                    if (p + 32 < nn) prefetch_row(v + 32 * ks, 64 * sizeof(uint16_t));
                    const __m512 v0 = LD16_F16(v), v1 = LD16_F16(v + 16), v2 = LD16_F16(v + 32), v3 = LD16_F16(v + 48);
                    LANE_FMAS(0, x0, x1, x2, x3); LANE_FMAS(1, y0, y1, y2, y3);
                    LANE_FMAS(2, z0, z1, z2, z3); LANE_FMAS(3, w0, w1, w2, w3);
                }
                _mm512_storeu_ps(a[0], x0); _mm512_storeu_ps(a[0] + 16, x1);
                _mm512_storeu_ps(a[0] + 32, x2); _mm512_storeu_ps(a[0] + 48, x3);
                if (m > 1) { _mm512_storeu_ps(a[1], y0); _mm512_storeu_ps(a[1] + 16, y1);
                             _mm512_storeu_ps(a[1] + 32, y2); _mm512_storeu_ps(a[1] + 48, y3); }
                if (m > 2) { _mm512_storeu_ps(a[2], z0); _mm512_storeu_ps(a[2] + 16, z1);
                             _mm512_storeu_ps(a[2] + 32, z2); _mm512_storeu_ps(a[2] + 48, z3); }
                if (m > 3) { _mm512_storeu_ps(a[3], w0); _mm512_storeu_ps(a[3] + 16, w1);
                             _mm512_storeu_ps(a[3] + 32, w2); _mm512_storeu_ps(a[3] + 48, w3); }
            }
}
#endif
