// The AVX-512 paths of the per-block attention arithmetic (attend_blocks.h has the portable ones).
#pragma once

#include "attend_blocks.h"

namespace kvserve_attention {

#if defined(__AVX512F__)
// The AVX-512 path for head_dim a multiple of 16 and blocks of whole 16-row tiles (every common shape).
// The scalar-loop kernel above reached ~2 MACs per cycle: each score was a dot product ending in a
// horizontal reduction, and each V row's update went through memory. Here a tile's 16 scores come out of
// one transposing reduction tree, the G heads' accumulators stay in registers over a block, and a 16-bit
// block is widened as it is loaded.
namespace avx512 {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const c10::BFloat16* p) {  // bf16 is fp32's top half
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// e^x for x <= 0 (scores less their running max; the masked sentinel gives 0): n = round(x / ln 2),
// r = x - n ln 2 in two parts (|r| <= 0.35), e^r by its degree-7 Taylor polynomial (error < 1e-8
// relative), scaled by 2^n. Relative error ~1 ulp, where the 2^(x log2 e) shortcut loses digits.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // e^-104 underflows to 0 anyway
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// 16 vectors -> one vector whose lane i is the sum of v[i]'s lanes: a transposing add tree
// (15 adds, 30 shuffles for 16 dot products, against ~8 dependent operations per product reduced alone),
// in two halves so that a caller can reduce four rows at a time.
inline __m512 sum_quad(__m512 a, __m512 b, __m512 c, __m512 d) {
  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3], then that lane's sums of a, b, c, d
  const __m512d ab = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)));
  const __m512d cd = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d)));
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab, cd)), _mm512_castpd_ps(_mm512_unpackhi_pd(ab, cd)));
}

inline __m512 sum_lanes(__m512 y0, __m512 y1, __m512 y2, __m512 y3) {  // four sum_quad results -> 16 sums
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(y2, y3, 0x88), _mm512_shuffle_f32x4(y2, y3, 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

inline __m512 sum_each(const __m512* v) {
  return sum_lanes(sum_quad(v[0], v[1], v[2], v[3]), sum_quad(v[4], v[5], v[6], v[7]),
                   sum_quad(v[8], v[9], v[10], v[11]), sum_quad(v[12], v[13], v[14], v[15]));
}

inline __mmask16 visible_rows(const bool* valid) {
  __mmask16 mask = 0;
  for (int r = 0; r < 16; ++r) mask |= static_cast<__mmask16>(valid[r] ? 1 : 0) << r;
  return mask;
}

// Each 16-row tile's visible rows of one block (`valid`: its BS flags); false when none is visible.
inline bool visible_tiles(const bool* valid, int64_t tiles, __mmask16* visible) {
  bool any_visible = false;
  for (int64_t t = 0; t < tiles; ++t) {
    visible[t] = visible_rows(valid + t * 16);
    any_visible |= visible[t] != 0;
  }
  return any_visible;
}

constexpr int64_t kMaxTiles = kMaxBlock / 16;  // 16-row tiles of K/V whose scores one rescale covers

// The next run of blocks from `idx` (advanced past it) for KV head h: whole blocks, up to kMaxTiles 16-row
// tiles (at least one block), blocks with no visible row left out; each tile's K and V rows and visible
// rows into k_tile, v_tile, visible. Returns the run's tiles (0: none visible).
template <typename scalar_t, int64_t D>
int64_t next_run(const scalar_t* kp, const scalar_t* vp, const int64_t* blocks, const bool* valid, int64_t& idx,
                 int64_t hi, int64_t KVH, int64_t h, int64_t BS, __mmask16* visible, const scalar_t** k_tile,
                 const scalar_t** v_tile) {
  const int64_t tiles_per_block = BS / 16;
  int64_t tiles = 0;
  for (; idx < hi && (tiles == 0 || tiles + tiles_per_block <= kMaxTiles); ++idx) {
    __mmask16 block_visible[kMaxTiles];
    if (!visible_tiles(valid + idx * BS, tiles_per_block, block_visible)) continue;
    const int64_t base = (blocks[idx] * KVH + h) * BS * D;
    for (int64_t t = 0; t < tiles_per_block; ++t, ++tiles) {
      visible[tiles] = block_visible[t];
      k_tile[tiles] = kp + base + t * 16 * D;
      v_tile[tiles] = vp + base + t * 16 * D;
    }
  }
  return tiles;
}

// As attend_blocks, for D = 16 * NC and BS a multiple of 16; the softmax state rescaled once per run of
// blocks given (next_run), as attend_blocks_grouped below says why.
template <typename scalar_t, int NC>
void attend_blocks(const float* qh, int64_t G, const scalar_t* kp, const scalar_t* vp, const int64_t* blocks,
                   const bool* valid, int64_t lo, int64_t hi, int64_t KVH, int64_t h, int64_t BS, float scale,
                   float* m, float* l, float* acc) {
  constexpr int64_t D = 16 * NC;
  alignas(64) float probs[kMaxBlock];
  __mmask16 visible[kMaxTiles];
  const scalar_t* k_tile[kMaxTiles];
  const scalar_t* v_tile[kMaxTiles];
  for (int64_t idx = lo; idx < hi;) {
    const int64_t tiles = next_run<scalar_t, D>(kp, vp, blocks, valid, idx, hi, KVH, h, BS, visible, k_tile, v_tile);
    if (tiles == 0) continue;
    for (int64_t g = 0; g < G; ++g) {
      __m512 q[NC];
      for (int c = 0; c < NC; ++c) q[c] = _mm512_mul_ps(_mm512_loadu_ps(qh + g * D + 16 * c), _mm512_set1_ps(scale));
      __m512 tile_max = _mm512_set1_ps(kEmpty);
      for (int64_t t = 0; t < tiles; ++t) {
        __m512 dots[16];
        for (int r = 0; r < 16; ++r) {
          const scalar_t* row = k_tile[t] + r * D;
          __m512 d = _mm512_mul_ps(q[0], load16(row));
          for (int c = 1; c < NC; ++c) d = _mm512_fmadd_ps(q[c], load16(row + 16 * c), d);
          dots[r] = d;
        }
        // Hidden rows (possibly never written: any bits at all) become the sentinel.
        const __m512 s = _mm512_mask_blend_ps(visible[t], _mm512_set1_ps(kEmpty), sum_each(dots));
        _mm512_store_ps(probs + t * 16, s);
        tile_max = _mm512_max_ps(tile_max, s);
      }
      const float new_max = std::max(m[g], _mm512_reduce_max_ps(tile_max));
      const float correction = std::exp(m[g] - new_max);
      __m512 sums = _mm512_setzero_ps();
      for (int64_t t = 0; t < tiles; ++t) {
        const __m512 p = exp16(_mm512_sub_ps(_mm512_load_ps(probs + t * 16), _mm512_set1_ps(new_max)));
        _mm512_store_ps(probs + t * 16, p);
        sums = _mm512_add_ps(sums, p);
      }
      l[g] = l[g] * correction + _mm512_reduce_add_ps(sums);
      m[g] = new_max;
      float* ag = acc + g * D;
      __m512 a[NC];
      for (int c = 0; c < NC; ++c) a[c] = _mm512_mul_ps(_mm512_loadu_ps(ag + 16 * c), _mm512_set1_ps(correction));
      for (int64_t t = 0; t < tiles; ++t) {
        const bool all_visible = visible[t] == 0xFFFF;
        for (int r = 0; r < 16; ++r) {
          // A hidden row's weight is 0, but its V may be NaN (never written): skip it, do not multiply.
          if (!all_visible && !((visible[t] >> r) & 1)) continue;
          const __m512 p = _mm512_set1_ps(probs[t * 16 + r]);
          const scalar_t* row = v_tile[t] + r * D;
          for (int c = 0; c < NC; ++c) a[c] = _mm512_fmadd_ps(p, load16(row + 16 * c), a[c]);
        }
      }
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(ag + 16 * c, a[c]);
    }
  }
}

// The same for a group size G known at compile time with G * NC <= 16: every K and V row is loaded
// (and widened) once for all G heads instead of once per head, the heads' queries and accumulators
// staying in registers (G * NC each). Zen 4 issues one 512-bit load per cycle, so the per-head path
// was bound by its loads. The softmax state is rescaled once per run of blocks given (up to kMaxBlock rows:
// a decode's or prefill tile's run of 4 blocks of 16), not once per block: its scalar max, exp and sums and
// the accumulators' rescaling came to ~1/6 of a block's work (G = 4, D = 64: 59 -> 50 cycles a key, one
// core, warm). A row's result therefore depends on how its blocks come in runs, which decode_splits.h fixes
// by the row's own block count.
template <typename scalar_t, int NC, int G>
void attend_blocks_grouped(const float* qh, const scalar_t* kp, const scalar_t* vp, const int64_t* blocks,
                           const bool* valid, int64_t lo, int64_t hi, int64_t KVH, int64_t h, int64_t BS,
                           float scale, float* m, float* l, float* acc) {
  constexpr int64_t D = 16 * NC;
  alignas(64) float probs[G][kMaxBlock];
  __mmask16 visible[kMaxTiles];
  const scalar_t* k_tile[kMaxTiles];  // the run's visible blocks' 16-row tiles, in order
  const scalar_t* v_tile[kMaxTiles];
  __m512 q[G][NC];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < NC; ++c) q[g][c] = _mm512_mul_ps(_mm512_loadu_ps(qh + g * D + 16 * c), _mm512_set1_ps(scale));
  }
  for (int64_t idx = lo; idx < hi;) {
    const int64_t tiles = next_run<scalar_t, D>(kp, vp, blocks, valid, idx, hi, KVH, h, BS, visible, k_tile, v_tile);
    if (tiles == 0) continue;
    __m512 run_max[G];
    for (int g = 0; g < G; ++g) run_max[g] = _mm512_set1_ps(kEmpty);
    for (int64_t t = 0; t < tiles; ++t) {
      __m512 quads[G][4];
      for (int quad = 0; quad < 4; ++quad) {
        __m512 dots[G][4];
        for (int r = 0; r < 4; ++r) {
          const scalar_t* row = k_tile[t] + (quad * 4 + r) * D;
          for (int c = 0; c < NC; ++c) {
            const __m512 k = load16(row + 16 * c);
            for (int g = 0; g < G; ++g) dots[g][r] = c ? _mm512_fmadd_ps(q[g][c], k, dots[g][r]) : _mm512_mul_ps(q[g][c], k);
          }
        }
        for (int g = 0; g < G; ++g) quads[g][quad] = sum_quad(dots[g][0], dots[g][1], dots[g][2], dots[g][3]);
      }
      for (int g = 0; g < G; ++g) {
        // Hidden rows (possibly never written: any bits at all) become the sentinel.
        const __m512 s = _mm512_mask_blend_ps(visible[t], _mm512_set1_ps(kEmpty),
                                              sum_lanes(quads[g][0], quads[g][1], quads[g][2], quads[g][3]));
        _mm512_store_ps(probs[g] + t * 16, s);
        run_max[g] = _mm512_max_ps(run_max[g], s);
      }
    }
    __m512 a[G][NC];
    for (int g = 0; g < G; ++g) {
      const float new_max = std::max(m[g], _mm512_reduce_max_ps(run_max[g]));
      const float correction = std::exp(m[g] - new_max);
      __m512 sums = _mm512_setzero_ps();
      for (int64_t t = 0; t < tiles; ++t) {
        const __m512 p = exp16(_mm512_sub_ps(_mm512_load_ps(probs[g] + t * 16), _mm512_set1_ps(new_max)));
        _mm512_store_ps(probs[g] + t * 16, p);
        sums = _mm512_add_ps(sums, p);
      }
      l[g] = l[g] * correction + _mm512_reduce_add_ps(sums);
      m[g] = new_max;
      for (int c = 0; c < NC; ++c) a[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * c), _mm512_set1_ps(correction));
    }
    for (int64_t t = 0; t < tiles; ++t) {
      const bool all_visible = visible[t] == 0xFFFF;
      for (int r = 0; r < 16; ++r) {
        // A hidden row's weight is 0, but its V may be NaN (never written): skip it, do not multiply.
        if (!all_visible && !((visible[t] >> r) & 1)) continue;
        const scalar_t* row = v_tile[t] + r * D;
        for (int c = 0; c < NC; ++c) {
          const __m512 v = load16(row + 16 * c);
          for (int g = 0; g < G; ++g) a[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(probs[g][t * 16 + r]), v, a[g][c]);
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, a[g][c]);
    }
  }
}

}  // namespace avx512
#endif

}  // namespace kvserve_attention
