// The gated delta rule (Gated DeltaNet: Qwen3.5's linear-attention layers), token by token. Per token t
// and value head h, with the head's state S [dk, dv]:
//   S *= exp(g[t, h]);  kv = S^T k_t;  delta = (v_t - kv) * beta[t, h];  S += k_t delta^T;  o_t = S^T q_t
// (transformers' torch_recurrent_gated_delta_rule; kv is computed as exp(g) (S^T k), so that a token writes
// S once: within 1e-5 of it). kvserve runs this sequential form for every token, prefill included: the
// chunked form's results depend on where chunks start, and "a cache hit changes the cost, never the
// answer" needs a token's bits to be the same however a prompt is chunked, cached (resumed from a
// snapshot), batched or drafted.
//
// How that holds: the columns of S (the dv axis) never mix, so a task is one (sequence, value head, tile
// of 2 vectors of columns); it walks its sequence's tokens with the tile in L1, copied out of the slot
// (dk x 32 fp32 = 16 KB on AVX-512). A column's operations are the same whatever the batch, the segment
// or the tile it sits in: each sum over dk runs in 4 partial sums (row i into partial i % 4, added
// (p0 + p1) + (p2 + p3)), fixed by dk alone; q and k are normalised from an aligned copy. A segment
// resumed from a state reads exactly the fp32 state the whole run held at that row. The thread count and
// the split of tasks among threads change nothing either.
//
// The states are slots of one tensor [slots, Hv, dk, dv] (kvserve/kv/state/storage.py), read in place:
// each sequence reads one slot (or starts from zeros) and writes its final state to another (or the same),
// and the state after given rows to snapshot slots, all in the one call.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int kPartials = 4;       // partial sums over dk per column (the latency of a chain of FMAs)
constexpr int kTileVectors = 2;    // vectors of columns per task
constexpr int64_t kMaxHeadDim = 512;
constexpr float kNormEps = 1e-6f;  // transformers' l2norm (the FLA library's)

enum Isa : int64_t { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

// The vector operations the scan is written in, one struct per instruction set.
template <int L>
struct PortableOps {
  static constexpr int kLanes = L;
  struct V { float x[L]; };
  static V load(const float* p) { V r; for (int l = 0; l < L; ++l) r.x[l] = p[l]; return r; }
  static void store(float* p, const V& a) { for (int l = 0; l < L; ++l) p[l] = a.x[l]; }
  static V set1(float s) { V r; for (int l = 0; l < L; ++l) r.x[l] = s; return r; }
  static V add(const V& a, const V& b) { V r; for (int l = 0; l < L; ++l) r.x[l] = a.x[l] + b.x[l]; return r; }
  static V sub(const V& a, const V& b) { V r; for (int l = 0; l < L; ++l) r.x[l] = a.x[l] - b.x[l]; return r; }
  static V mul(const V& a, const V& b) { V r; for (int l = 0; l < L; ++l) r.x[l] = a.x[l] * b.x[l]; return r; }
  static V fmadd(const V& a, const V& b, const V& c) {
    V r;
    for (int l = 0; l < L; ++l) r.x[l] = a.x[l] * b.x[l] + c.x[l];
    return r;
  }
};

#if defined(__AVX2__) && defined(__FMA__)
struct Avx2Ops {
  static constexpr int kLanes = 8;
  using V = __m256;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V a) { _mm256_storeu_ps(p, a); }
  static V set1(float s) { return _mm256_set1_ps(s); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
};
#endif

#if defined(__AVX512F__)
struct Avx512Ops {
  static constexpr int kLanes = 16;
  using V = __m512;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V a) { _mm512_storeu_ps(p, a); }
  static V set1(float s) { return _mm512_set1_ps(s); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
};
#endif

// The best instruction set this build has (built with -march=native for this CPU: kernels/build.py).
Isa compiled_isa() {
#if defined(__AVX512F__)
  return kAvx512;
#elif defined(__AVX2__) && defined(__FMA__)
  return kAvx2;
#else
  return kPortable;
#endif
}

struct Problem {
  const float *q, *k, *v, *g, *beta;
  int64_t q_t, q_h, k_t, k_h, v_t, v_h, g_t, g_h, beta_t, beta_h;  // strides (the last dims are contiguous)
  float* out;                                                     // [N, Hv, dv], contiguous
  const float* read;                                              // [read slots, Hv, dk, dv]
  float* write;                                                   // [write slots, Hv, dk, dv]
  const int64_t *row_starts, *read_slots, *write_slots, *snapshots, *snapshot_first;
  int64_t Hv, dk, dv, group;
  bool normalize;
  float scale;
};

// dst = src (dk floats) / |src| * scale (or src * scale): the norm summed from an aligned copy, so the
// sum's order does not depend on where the row lies.
inline void prepare_row(const float* src, float* dst, int64_t dk, bool normalize, float scale) {
  std::memcpy(dst, src, dk * sizeof(float));
  float factor = scale;
  if (normalize) {
    float squares = 0.f;
    for (int64_t i = 0; i < dk; ++i) squares += dst[i] * dst[i];
    factor = scale / std::sqrt(squares + kNormEps);
  }
  for (int64_t i = 0; i < dk; ++i) dst[i] *= factor;
}

// Rows i = 0..dk-1, row i into partial i % kPartials, the same split for every dk of one call. The
// partial's index is a constant at every call of `body` (a variable one would keep the partial sums in
// memory, not in registers).
template <typename Body>
inline void over_rows(int64_t dk, Body body) {
  static_assert(kPartials == 4, "over_rows unrolls 4 partial sums");
  int64_t i = 0;
  for (; i + kPartials <= dk; i += kPartials) {
    body(i, 0);
    body(i + 1, 1);
    body(i + 2, 2);
    body(i + 3, 3);
  }
  if (i < dk) body(i, 0);
  if (i + 1 < dk) body(i + 1, 1);
  if (i + 2 < dk) body(i + 2, 2);
}

// dk rows of NV vectors from src (rows `from` floats apart) to dst (rows `to` floats apart).
template <class Ops, int NV>
void copy_tile(const float* src, int64_t from, float* dst, int64_t to, int64_t dk) {
  for (int64_t i = 0; i < dk; ++i) {
    for (int j = 0; j < NV; ++j) Ops::store(dst + i * to + j * Ops::kLanes, Ops::load(src + i * from + j * Ops::kLanes));
  }
}

// One task: sequence b, value head h, columns col0 .. col0 + NV * lanes of its state, over all its rows.
template <class Ops, int NV>
void scan_task(const Problem& p, int64_t b, int64_t h, int64_t col0) {
  using V = typename Ops::V;
  constexpr int L = Ops::kLanes;
  const int64_t dk = p.dk, dv = p.dv, head = p.dk * p.dv;
  // The tile is worked on in a contiguous copy: in the state's own rows (dv floats apart) its lines
  // would fall in a few L1 sets and be evicted between the passes.
  constexpr int64_t W = NV * L;
  alignas(64) float S[kMaxHeadDim * W];
  if (p.read_slots[b] < 0) {
    std::fill(S, S + dk * W, 0.f);
  } else {
    copy_tile<Ops, NV>(p.read + (p.read_slots[b] * p.Hv + h) * head + col0, dv, S, W, dk);
  }
  int64_t snap = p.snapshot_first[b];
  const int64_t snap_end = p.snapshot_first[b + 1];
  auto take_snapshots = [&](int64_t done) {
    for (; snap < snap_end && p.snapshots[3 * snap + 1] == done; ++snap) {
      copy_tile<Ops, NV>(S, W, p.write + (p.snapshots[3 * snap + 2] * p.Hv + h) * head + col0, dv, dk);
    }
  };
  take_snapshots(0);
  alignas(64) float kn[kMaxHeadDim];
  alignas(64) float qn[kMaxHeadDim];
  const int64_t hk = h / p.group, first = p.row_starts[b], last = p.row_starts[b + 1];
  for (int64_t t = first; t < last; ++t) {
    prepare_row(p.k + t * p.k_t + hk * p.k_h, kn, dk, p.normalize, 1.f);
    prepare_row(p.q + t * p.q_t + hk * p.q_h, qn, dk, p.normalize, p.scale);
    const V decay = Ops::set1(std::exp(p.g[t * p.g_t + h * p.g_h]));
    V acc[kPartials][NV];
    for (int a = 0; a < kPartials; ++a) {
      for (int j = 0; j < NV; ++j) acc[a][j] = Ops::set1(0.f);
    }
    // kv = (decay S)^T k, as decay (S^T k): this pass only reads S
    over_rows(dk, [&](int64_t i, int part) {
      const V ki = Ops::set1(kn[i]);
      for (int j = 0; j < NV; ++j) acc[part][j] = Ops::fmadd(ki, Ops::load(S + i * W + j * L), acc[part][j]);
    });
    const V beta = Ops::set1(p.beta[t * p.beta_t + h * p.beta_h]);
    const float* vt = p.v + t * p.v_t + h * p.v_h + col0;
    V delta[NV];
    for (int j = 0; j < NV; ++j) {
      const V kv = Ops::mul(Ops::add(Ops::add(acc[0][j], acc[1][j]), Ops::add(acc[2][j], acc[3][j])), decay);
      delta[j] = Ops::mul(Ops::sub(Ops::load(vt + j * L), kv), beta);
      for (int a = 0; a < kPartials; ++a) acc[a][j] = Ops::set1(0.f);
    }
    // S = decay S + k delta^T; o = S^T q: one store of S per token
    over_rows(dk, [&](int64_t i, int part) {
      const V ki = Ops::set1(kn[i]), qi = Ops::set1(qn[i]);
      for (int j = 0; j < NV; ++j) {
        float* cell = S + i * W + j * L;
        const V s = Ops::fmadd(ki, delta[j], Ops::mul(Ops::load(cell), decay));
        Ops::store(cell, s);
        acc[part][j] = Ops::fmadd(qi, s, acc[part][j]);
      }
    });
    float* ot = p.out + (t * p.Hv + h) * dv + col0;
    for (int j = 0; j < NV; ++j) {
      Ops::store(ot + j * L, Ops::add(Ops::add(acc[0][j], acc[1][j]), Ops::add(acc[2][j], acc[3][j])));
    }
    take_snapshots(t - first + 1);
  }
  copy_tile<Ops, NV>(S, W, p.write + (p.write_slots[b] * p.Hv + h) * head + col0, dv, dk);
}

template <class Ops>
void run(const Problem& p, int64_t sequences) {
  constexpr int L = Ops::kLanes;
  const int64_t vectors = p.dv / L, tiles = (vectors + kTileVectors - 1) / kTileVectors, per_seq = p.Hv * tiles;
  // Tasks of a few hundred thousand FMAs: a decode step's heads share threads, a prefill's spread out.
  const int64_t rows = std::max<int64_t>(1, p.row_starts[sequences] / std::max<int64_t>(sequences, 1));
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / (rows * p.dk * kTileVectors * L));
  at::parallel_for(0, sequences * per_seq, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / per_seq, h = (task % per_seq) / tiles, tile = task % tiles;
      const int64_t col0 = tile * kTileVectors * L;
      if (col0 + kTileVectors * L <= p.dv) {
        scan_task<Ops, kTileVectors>(p, b, h, col0);
      } else {
        scan_task<Ops, 1>(p, b, h, col0);
      }
    }
  });
}

void check_rows(const at::Tensor& x, int64_t dims, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == dims && x.stride(dims - 1) == 1, "gated_delta_rule_: ",
              name, " must be fp32 with ", dims, " dims, its last contiguous");
}

void check_index(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kLong && x.is_contiguous(), "gated_delta_rule_: ", name, " must be contiguous int64");
}

}  // namespace

std::string gated_delta_isa() {
  switch (compiled_isa()) {
    case kAvx512: return "avx512";
    case kAvx2: return "avx2";
    default: return "portable";
  }
}

void gated_delta_rule_(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g, at::Tensor beta,
                       at::Tensor out, at::Tensor read_states, at::Tensor write_states,
                       at::Tensor row_starts, at::Tensor read_slots, at::Tensor write_slots,
                       at::Tensor snapshots, bool normalize_qk, double scale, int64_t isa) {
  check_rows(q, 3, "q");
  check_rows(k, 3, "k");
  check_rows(v, 3, "v");
  check_rows(g, 2, "g");
  check_rows(beta, 2, "beta");
  for (auto* index : {&row_starts, &read_slots, &write_slots, &snapshots}) check_index(*index, "an index tensor");
  const int64_t N = v.size(0), Hv = v.size(1), dv = v.size(2), Hk = k.size(1), dk = k.size(2);
  TORCH_CHECK(q.sizes() == k.sizes() && k.size(0) == N && Hk > 0 && Hv % Hk == 0,
              "gated_delta_rule_: q and k [N, Hk, dk], v [N, Hv, dv] with Hv a multiple of Hk");
  TORCH_CHECK(g.size(0) == N && g.size(1) == Hv && beta.size(0) == N && beta.size(1) == Hv,
              "gated_delta_rule_: g and beta must be [N, Hv]");
  TORCH_CHECK(dk > 0 && dk <= kMaxHeadDim && dv > 0, "gated_delta_rule_: head dims 1..", kMaxHeadDim);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 3 && out.size(0) == N &&
                  out.size(1) == Hv && out.size(2) == dv, "gated_delta_rule_: out must be contiguous fp32 [N, Hv, dv]");
  for (auto* states : {&read_states, &write_states}) {
    TORCH_CHECK(states->scalar_type() == at::kFloat && states->is_contiguous() && states->dim() == 4 &&
                    states->size(1) == Hv && states->size(2) == dk && states->size(3) == dv,
                "gated_delta_rule_: states must be contiguous fp32 [slots, Hv, dk, dv]");
  }
  const int64_t B = read_slots.numel(), S = snapshots.numel() / 3;
  TORCH_CHECK(row_starts.numel() == B + 1 && write_slots.numel() == B && snapshots.numel() == 3 * S,
              "gated_delta_rule_: row_starts [B + 1], read_slots and write_slots [B], snapshots [S, 3]");
  const int64_t* starts = row_starts.data_ptr<int64_t>();
  const int64_t* reads = read_slots.data_ptr<int64_t>();
  const int64_t* writes = write_slots.data_ptr<int64_t>();
  const int64_t* snaps = snapshots.data_ptr<int64_t>();
  const int64_t read_count = read_states.size(0), write_count = write_states.size(0);
  TORCH_CHECK(starts[0] == 0 && starts[B] == N, "gated_delta_rule_: row_starts must run from 0 to N");
  // Who writes each slot: a slot written by two sequences, or read by one and written by another, would
  // race between the threads (a sequence may read and write its own slot: in place).
  std::vector<int64_t> writer(write_count, -1);
  auto claim = [&](int64_t slot, int64_t b) {
    TORCH_CHECK(slot >= 0 && slot < write_count, "gated_delta_rule_: write slot ", slot, " out of range");
    TORCH_CHECK(writer[slot] < 0 || writer[slot] == b, "gated_delta_rule_: slot ", slot, " written by two sequences");
    writer[slot] = b;
  };
  std::vector<int64_t> snapshot_first(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(starts[b + 1] >= starts[b], "gated_delta_rule_: row_starts must not decrease");
    TORCH_CHECK(reads[b] < read_count, "gated_delta_rule_: read slot ", reads[b], " out of range");
    claim(writes[b], b);
  }
  for (int64_t s = 0; s < S; ++s) {
    const int64_t b = snaps[3 * s], done = snaps[3 * s + 1];
    TORCH_CHECK(b >= 0 && b < B && (s == 0 || b > snaps[3 * s - 3] || (b == snaps[3 * s - 3] && done >= snaps[3 * s - 2])),
                "gated_delta_rule_: snapshots must be sorted by (sequence, rows)");
    TORCH_CHECK(done >= 0 && done <= starts[b + 1] - starts[b], "gated_delta_rule_: a snapshot after ", done,
                " rows of a sequence of ", starts[b + 1] - starts[b]);
    claim(snaps[3 * s + 2], b);
    ++snapshot_first[b + 1];
  }
  for (int64_t b = 0; b < B; ++b) snapshot_first[b + 1] += snapshot_first[b];
  if (read_states.data_ptr() == write_states.data_ptr()) {
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(reads[b] < 0 || writer[reads[b]] < 0 || writer[reads[b]] == b, "gated_delta_rule_: slot ",
                  reads[b], " is read by one sequence and written by another");
    }
  }
  const Problem p{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), g.data_ptr<float>(),
                  beta.data_ptr<float>(), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                  g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), out.data_ptr<float>(),
                  read_states.data_ptr<float>(), write_states.data_ptr<float>(), starts, reads, writes, snaps,
                  snapshot_first.data(), Hv, dk, dv, Hv / Hk, normalize_qk, static_cast<float>(scale)};
  const int64_t chosen = isa < 0 ? compiled_isa() : std::min<int64_t>(isa, compiled_isa());
#if defined(__AVX512F__)
  if (chosen >= kAvx512 && dv % Avx512Ops::kLanes == 0) return run<Avx512Ops>(p, B);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (chosen >= kAvx2 && dv % Avx2Ops::kLanes == 0) return run<Avx2Ops>(p, B);
#endif
  if (dv % 8 == 0) return run<PortableOps<8>>(p, B);
  run<PortableOps<1>>(p, B);
}
