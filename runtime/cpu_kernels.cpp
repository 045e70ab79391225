// gqakit's CPU decode kernels (fp32): what a decode step must do, without what it need not.
//
// Built on first use by gqakit/eval/decode/kernels.py (torch.utils.cpp_extension, -O3
// -march=native, OpenMP through ATen's parallel_for), cached per machine. Two kernels, and
// whole decoder layers built on them (decode_layer: Llama-layout and kin; t5_decode_layer:
// T5's block of self-attention, cross-attention and MLP):
//
// * skinny_linear: y = x W^T for a few rows of x (a decode step: one row per sequence).
//   The BLAS packs W into its own layout on every call; oneDNN's once-packed weight avoids
//   that but still runs at 16 GB/s at 8 rows on a 2-core AMD EPYC (AVX-512), against 28 GB/s
//   for a matrix-vector product. Here W is packed once into panels of 48 output columns,
//   [ceil(N/48)][K][48], so each thread streams whole panels front to back while all rows
//   of x (at most 8 at a time) are multiplied into 8 x 3 vector accumulators: every weight
//   byte is read once per call, in order, with software prefetches ahead of the stream:
//   into L1 9 KB ahead, and into L2 36 KB ahead (the packed weights lie back to back in the
//   order a step reads them, so near a panel's end that reaches into the next matrix).
// * decode_attention: one new token's attention against a static KV cache, grouped. The
//   H/G query heads of a group read their K/V head once (scores, then the weighted sum of
//   values) over chunks of the cache; chunks are independent tasks merged with their
//   log-sum-exp, so batch 1 with one KV head still uses every thread. Positions the mask
//   excludes (-inf) are skipped, and a chunk with none left is never read. With many query
//   rows per K/V head (a GQA conversion's 9 at batch 8 is 9 rows per head and sequence) a
//   score per position and row with its horizontal sum is compute-bound, so from 6 rows on
//   (AVX-512) 16 key rows at a time are transposed in registers and each query element
//   becomes one broadcast multiply-add over 16 positions. Keys are prefetched into L2 64
//   positions ahead: nearer, or into L1, the transposes wait on memory. On that path a task
//   also asks for the next task's keys and values into L2 while it computes, so memory
//   streams under the arithmetic. An optional bias per query head and position (T5's
//   relative position bias) is added to the scores.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif
#include <cstdlib>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

typedef float v16 __attribute__((vector_size(64), aligned(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int v16i __attribute__((vector_size(64)));

constexpr int64_t NR = 48;       // panel width: 3 vectors of 16 floats
constexpr int64_t PREFETCH = 48;  // panel rows (of 192 bytes) ahead of the stream, into L1
constexpr int64_t FAR_PREFETCH = 192;  // and 36 KB ahead into L2 (more reads in flight)
constexpr int64_t KEY_AHEAD = 64;  // cache positions ahead that the scores prefetch into L2
constexpr int64_t VALUE_AHEAD = 128;  // value rows ahead that the first value pass prefetches into L2
constexpr int64_t CHUNK = 256;   // cache positions per attention task (a multiple of 16)
constexpr int64_t TRANSPOSED_FROM = 6;  // query rows per K/V head from which scores use transposed keys

inline float hsum(v16 a) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps((__m512)a);
#else
  float t[16];
  std::memcpy(t, &a, sizeof(t));
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += t[i];
  return s;
#endif
}

// f(std::integral_constant<int, R>{}) for the run-time row count r, 1 <= r <= MAX (below 1: 1,
// above MAX: MAX): the kernels are templates on their row count, so that accumulators stay
// in registers and inner loops have no row branches; this picks the instance.
template <int MAX, class F, int... I>
void with_rows_impl(int64_t r, F&& f, std::integer_sequence<int, I...>) {
  r = std::min<int64_t>(std::max<int64_t>(r, 1), MAX);
  ((r == I + 1 ? (f(std::integral_constant<int, I + 1>{}), 0) : 0), ...);
}

template <int MAX, class F>
void with_rows(int64_t r, F&& f) {
  with_rows_impl<MAX>(r, std::forward<F>(f), std::make_integer_sequence<int, MAX>{});
}

template <int MR>
void panel(const float* x, int64_t K, const float* wp, float* y, int64_t ldy, int64_t ncols) {
  v16 acc[MR][3];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 3; ++j) acc[m][j] = (v16){};
  for (int64_t k = 0; k < K; ++k) {
    __builtin_prefetch(wp + (k + PREFETCH) * NR, 0, 3);
    __builtin_prefetch(wp + (k + PREFETCH) * NR + 16, 0, 3);
    __builtin_prefetch(wp + (k + PREFETCH) * NR + 32, 0, 3);
    __builtin_prefetch(wp + (k + FAR_PREFETCH) * NR, 0, 1);
    __builtin_prefetch(wp + (k + FAR_PREFETCH) * NR + 16, 0, 1);
    __builtin_prefetch(wp + (k + FAR_PREFETCH) * NR + 32, 0, 1);
    const v16* w = reinterpret_cast<const v16*>(wp + k * NR);
    const v16 w0 = w[0], w1 = w[1], w2 = w[2];
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const float xv = x[m * K + k];
      acc[m][0] += xv * w0;
      acc[m][1] += xv * w1;
      acc[m][2] += xv * w2;
    }
  }
  for (int m = 0; m < MR; ++m) {
    float tmp[NR];
    *reinterpret_cast<v16u*>(tmp) = acc[m][0];
    *reinterpret_cast<v16u*>(tmp + 16) = acc[m][1];
    *reinterpret_cast<v16u*>(tmp + 32) = acc[m][2];
    std::memcpy(y + m * ldy, tmp, sizeof(float) * ncols);
  }
}

void run_panel(int64_t mr, const float* x, int64_t K, const float* wp, float* y, int64_t ldy, int64_t nc) {
  with_rows<8>(mr, [&](auto R) { panel<R.value>(x, K, wp, y, ldy, nc); });
}

// exp of 16 floats (Cephes-style: 2^n times a degree-5 polynomial on [-ln2/2, ln2/2]; a few
// ulp). Below about -87.3 the result is 0 (so -inf, a masked score, gives 0).
inline v16 vexp(v16 x) {
  const v16 lo = x < -87.3f ? (v16){} + 1.f : (v16){};  // 1 where the result underflows
  x = x < -87.3f ? (v16){} - 87.3f : x;
  x = x > 88.3f ? (v16){} + 88.3f : x;
  const v16 fx = x * 1.44269504088896341f;
  const v16i n = __builtin_convertvector(fx + (fx < 0.f ? (v16){} - 0.5f : (v16){} + 0.5f), v16i);  // round
  const v16 nf = __builtin_convertvector(n, v16);
  const v16 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  v16 y = (v16){} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  const v16i bits = (n + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  y = y * scale;
  return lo > 0.f ? (v16){} : y;
}

// Which prefetches a pass over V issues per row j: V rows 8 ahead into L1 (`near`: the first
// pass over a chunk), VALUE_AHEAD ahead into L2 (`far`: the first pass over a chunk not
// already fetched), and two lines of `next` into L2 (a later task's data, 32 floats a row).
struct ValueFetch {
  bool near = false, far = false;
  const float* next = nullptr;
};

// The prefetches `f` asks for at row j of V [n][Dv] (vb).
__attribute__((always_inline)) inline void fetch_values(ValueFetch f, const float* vb, int64_t j, int64_t Dv) {
  for (int64_t d = 0; d < Dv && (f.near || f.far); d += 16) {
    if (f.near) __builtin_prefetch(vb + (j + 8) * Dv + d, 0, 3);
    if (f.far) __builtin_prefetch(vb + (j + VALUE_AHEAD) * Dv + d, 0, 1);
  }
  if (f.next) {
    __builtin_prefetch(f.next + j * 32, 0, 1);
    __builtin_prefetch(f.next + j * 32 + 16, 0, 1);
  }
}

// RR (a compile-time row count, so that the accumulators stay in registers and the inner
// loop has no branches) rows of p [RR][ldp] times V [n][Dv], value columns d0..d0+31 (all
// 32 present), written to out (row stride W). The generic `value_sums` below handles a
// last, narrower column block; this one is where the time goes.
template <int RR>
void value_rows(const float* vb, int64_t Dv, int64_t n, const float* p, int64_t ldp, int64_t d0, float* out,
                int64_t W, ValueFetch f) {
  v16 a[RR][2];
  for (int i = 0; i < RR; ++i) a[i][0] = a[i][1] = (v16){};
  for (int64_t j = 0; j < n; ++j) {
    fetch_values(f, vb, j, Dv);
    const float* vj = vb + j * Dv + d0;
    const v16 v0 = *reinterpret_cast<const v16u*>(vj), v1 = *reinterpret_cast<const v16u*>(vj + 16);
#pragma GCC unroll 12
    for (int i = 0; i < RR; ++i) {
      const float pv = p[i * ldp + j];
      a[i][0] += pv * v0;
      a[i][1] += pv * v1;
    }
  }
  for (int i = 0; i < RR; ++i) {
    *reinterpret_cast<v16u*>(out + i * W + d0) = a[i][0];
    *reinterpret_cast<v16u*>(out + i * W + d0 + 16) = a[i][1];
  }
}

// value_rows<1> ... value_rows<12>, by row count - 1 (a table of plain functions: in a scratch
// timing they ran a few percent faster than instances inlined behind `with_rows`)
using ValueRowsFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, float*, int64_t, ValueFetch);
template <int... I>
constexpr std::array<ValueRowsFn, sizeof...(I)> value_rows_table(std::integer_sequence<int, I...>) {
  return {&value_rows<I + 1>...};
}
constexpr auto kValueRows = value_rows_table(std::make_integer_sequence<int, 12>{});

// Rows 0..rr-1 (rr <= 12) of p [rr][ldp] times V [n][Dv], value columns d0..d0+31 (fewer
// at the end of a row), written to out (row stride W). Accumulators stay in registers over
// the n rows of V; `f` says what to prefetch as it goes (`ValueFetch`; VALUE_AHEAD past the
// chunk's end is the next chunk's V, read next).
void value_sums(const float* vb, int64_t Dv, int64_t n, const float* p, int64_t ldp, int64_t rr, int64_t d0,
                float* out, int64_t W, ValueFetch f) {
  if (Dv - d0 >= 32 && rr >= 1 && rr <= 12) return kValueRows[rr - 1](vb, Dv, n, p, ldp, d0, out, W, f);
  v16 a[12][2];
  for (int i = 0; i < 12; ++i) a[i][0] = a[i][1] = (v16){};
  const int64_t w0 = std::min<int64_t>(16, Dv - d0), w1 = std::max<int64_t>(0, std::min<int64_t>(16, Dv - d0 - 16));
  for (int64_t j = 0; j < n; ++j) {
    fetch_values(f, vb, j, Dv);
    const float* vj = vb + j * Dv + d0;
    v16 v0 = (v16){}, v1 = (v16){};
    if (w0 == 16) v0 = *reinterpret_cast<const v16u*>(vj);
    else for (int64_t d = 0; d < w0; ++d) v0[d] = vj[d];
    if (w1 == 16) v1 = *reinterpret_cast<const v16u*>(vj + 16);
    else for (int64_t d = 0; d < w1; ++d) v1[d] = vj[16 + d];
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) {
      if (i < rr) {
        const float pv = p[i * ldp + j];
        a[i][0] += pv * v0;
        a[i][1] += pv * v1;
      }
    }
  }
  for (int64_t i = 0; i < rr; ++i) {
    float* o = out + i * W + d0;
    for (int64_t d = 0; d < w0; ++d) o[d] = a[i][0][d];
    for (int64_t d = 0; d < w1; ++d) o[16 + d] = a[i][1][d];
  }
}

// Lane i of the result: the sum of the 16 lanes of p[i]. Four rounds of pairwise folds
// (two-source shuffles), 15 folds in all, instead of 16 horizontal sums.
inline v16 fold(v16 a, v16 b, v16i lo, v16i hi) { return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi); }

inline v16 reduce16(const v16* p) {
  const v16i l1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const v16i h1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const v16i l2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const v16i h2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const v16i l3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const v16i h3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const v16i l4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const v16i h4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  v16 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) b[i] = fold(p[2 * i], p[2 * i + 1], l1, h1);
  for (int i = 0; i < 4; ++i) c[i] = fold(b[2 * i], b[2 * i + 1], l2, h2);
  for (int i = 0; i < 2; ++i) d[i] = fold(c[2 * i], c[2 * i + 1], l3, h3);
  return fold(d[0], d[1], l4, h4);
}

#ifdef __AVX512F__
// Scores of rr (<= 12) query rows against 16 cache positions, for a head size D (a multiple
// of 16): the 16 key rows (stride D) are transposed in registers, 16 x 16 floats at a time,
// into kt [D][16], so that each query element is one broadcast multiply-add over 16
// positions: no horizontal sums. Lane j of row i's result = q_i . k_j (unscaled).
inline void transpose16(const float* src, int64_t ld, float* dst) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ld);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + c]: rows 4i..4i+3 at column 4L + c of 128-bit lane L
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 v = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88), vp = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
    const __m512 w = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88), wp = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
    _mm512_store_ps(dst + c * 16, _mm512_shuffle_f32x4(v, w, 0x88));
    _mm512_store_ps(dst + (8 + c) * 16, _mm512_shuffle_f32x4(v, w, 0xDD));
    _mm512_store_ps(dst + (4 + c) * 16, _mm512_shuffle_f32x4(vp, wp, 0x88));
    _mm512_store_ps(dst + (12 + c) * 16, _mm512_shuffle_f32x4(vp, wp, 0xDD));
  }
}

// Rows 0..RR-1 of q [RR][D] times the transposed keys kt [D][16]: acc[i] lane j = q_i . k_j.
// RR is a compile-time constant so that the accumulators stay in registers. With `ahead`,
// the D lines from there on are asked into L2, one per step of the loop.
template <int RR>
void scores16(const float* kt, int64_t D, const float* q, v16* out, const float* ahead) {
  v16 acc[RR];
  for (int i = 0; i < RR; ++i) acc[i] = (v16){};
  for (int64_t d = 0; d < D; ++d) {
    if (ahead) __builtin_prefetch(ahead + d * 16, 0, 1);
    const v16 kv = *reinterpret_cast<const v16*>(kt + d * 16);
#pragma GCC unroll 12
    for (int i = 0; i < RR; ++i) acc[i] += q[i * D + d] * kv;
  }
  for (int i = 0; i < RR; ++i) out[i] = acc[i];
}

// m (<= 16) key rows from src (stride D) transposed into dst [D][16], zero past row m; a
// partial block is first copied into `tail` (16 x D floats) so no row past the cache is
// read. With `ahead`, the rows that many positions on are asked into L2 as it goes.
inline void transpose_keys16(const float* src, int64_t m, int64_t D, float* tail, float* dst, int64_t ahead) {
  if (m < 16) {
    std::memcpy(tail, src, sizeof(float) * m * D);
    std::fill(tail + m * D, tail + 16 * D, 0.f);
    src = tail;
  }
  for (int64_t d = 0; d < D; d += 16) {
    if (ahead)
      for (int64_t j = 0; j < 16; ++j) __builtin_prefetch(src + (j + ahead) * D + d, 0, 2);
    transpose16(src + d, D, dst + d * 16);
  }
}

void run_scores16(int64_t rr, const float* kt, int64_t D, const float* q, v16* out, const float* ahead) {
  with_rows<12>(rr, [&](auto R) { scores16<R.value>(kt, D, q, out, ahead); });
}
#endif

}  // namespace

// A zeroed fp32 buffer of n floats. From 2 MiB up it is aligned to 2 MiB and advised as
// huge pages (Linux; "madvise" is the common transparent-huge-page setting), so streaming a
// step's weights walks a few hundred TLB entries instead of a hundred thousand.
static torch::Tensor huge_zeros(int64_t n) {
  const size_t bytes = static_cast<size_t>(n) * sizeof(float), align = size_t(1) << 21;
#ifdef __linux__
  if (bytes >= align) {
    const size_t rounded = (bytes + align - 1) / align * align;
    void* p = nullptr;
    if (posix_memalign(&p, align, rounded) == 0) {
      madvise(p, rounded, MADV_HUGEPAGE);
      std::memset(p, 0, bytes);
      return torch::from_blob(p, {n}, [](void* q) { std::free(q); }, torch::TensorOptions().dtype(torch::kFloat32));
    }
  }
#endif
  return torch::zeros({n}, torch::TensorOptions().dtype(torch::kFloat32));
}

// W [N, K] (fp32) -> panels [ceil(N/48), K, 48], zero-padded past N, written into `out` (a
// zeroed, contiguous fp32 tensor of that many elements, e.g. a slice of one arena).
torch::Tensor pack_weight_into(torch::Tensor w, torch::Tensor out) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kFloat32 && w.dim() == 2, "pack_weight: a 2-D fp32 CPU tensor");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + NR - 1) / NR;
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.numel() == P * K * NR,
              "pack_weight_into: out must be a contiguous fp32 tensor of ", P * K * NR, " elements");
  out = out.view({P, K, NR});
  const float* s = w.data_ptr<float>();
  float* d = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < NR && p * NR + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) d[(p * K + k) * NR + j] = s[(p * NR + j) * K + k];
  });
  return out;
}

// Elements of W [N, K]'s packed panels.
int64_t packed_numel(int64_t N, int64_t K) { return (N + NR - 1) / NR * K * NR; }

// W [N, K] (fp32) -> panels [ceil(N/48), K, 48] in a buffer of their own (on huge pages from 2 MiB).
torch::Tensor pack_weight(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "pack_weight: a 2-D fp32 CPU tensor");
  return pack_weight_into(w, huge_zeros(packed_numel(w.size(0), w.size(1))));
}

// x [..., K] times a packed W (N outputs), plus an optional bias [N] -> [..., N].
torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor wp, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32, "skinny_linear: fp32 CPU input");
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == NR && wp.size(0) * NR >= N && wp.is_contiguous(), "skinny_linear: not a packed weight");
  const int64_t K = wp.size(1);
  TORCH_CHECK(x.size(-1) == K, "skinny_linear: input has ", x.size(-1), " features, the weight ", K);
  auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0), P = wp.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x2.data_ptr<float>();
  const float* w = wp.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t nc = std::min<int64_t>(NR, N - p * NR);
      for (int64_t m0 = 0; m0 < M; m0 += 8)
        run_panel(std::min<int64_t>(8, M - m0), xp + m0 * K, K, w + p * K * NR, yp + m0 * N + p * NR, N, nc);
    }
  });
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y.reshape(sizes);
}

// query [B, H, 1, D], key [B, G, T, D], value [B, G, T, Dv] (contiguous fp32), mask: an
// additive [B, T] fp32 mask or an empty tensor; head_bias: an additive [H, T] fp32 bias per
// query head (T5's relative position bias) or an empty tensor, added after the scale. Query
// head h uses K/V head h / (H / G). Returns [B, 1, H, Dv].
static torch::Tensor attention_impl(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor mask,
                                    torch::Tensor head_bias, double scale, torch::Tensor key_blocks = torch::Tensor()) {
  for (const auto& t : {query, key, value})
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.dim() == 4,
                "decode_attention: contiguous 4-D fp32 CPU tensors");
  const int64_t B = query.size(0), H = query.size(1), D = query.size(3);
  const int64_t G = key.size(1), T = key.size(2), Dv = value.size(3);
  TORCH_CHECK(query.size(2) == 1 && key.size(0) == B && value.size(0) == B && value.size(1) == G && value.size(2) == T &&
              key.size(3) == D && H % G == 0, "decode_attention: shapes do not match");
  const bool masked = mask.numel() > 0, biased = head_bias.numel() > 0;
  if (biased)
    TORCH_CHECK(head_bias.scalar_type() == torch::kFloat32 && head_bias.is_contiguous() && head_bias.numel() == H * T,
                "decode_attention: the head bias must be a contiguous [H, T] fp32 tensor");
  if (masked)
    TORCH_CHECK(mask.scalar_type() == torch::kFloat32 && mask.is_contiguous() && mask.numel() == B * T,
                "decode_attention: the mask must be a contiguous [B, T] fp32 tensor");
  // Chunks of CHUNK positions, shorter where that gives fewer than two tasks per thread (batch 1
  // with one KV head: the whole attention would otherwise be one or two tasks on one thread).
  const int64_t want = (2 * at::get_num_threads() + B * G - 1) / (B * G);
  const int64_t chunk = std::clamp<int64_t>(((T + want - 1) / want + 15) / 16 * 16, 16, CHUNK);
  const int64_t R = H / G, C = (T + chunk - 1) / chunk, tasks = B * G * C, W = Dv + 2;
  // partial results per task and query row: Dv weighted values, then the max and the sum
  std::vector<float> part(static_cast<size_t>(tasks * R * W));
  const float* q = query.data_ptr<float>();
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  const float* mk = masked ? mask.data_ptr<float>() : nullptr;
  const float* hbias = biased ? head_bias.data_ptr<float>() : nullptr;
  const float sc = static_cast<float>(scale);
  const float ninf = -std::numeric_limits<float>::infinity();
  const bool vec_d = D % 16 == 0, vec_dv = Dv % 16 == 0;
#ifdef __AVX512F__
  // from TRANSPOSED_FROM query rows per K/V head: 16 positions at a time, keys transposed
  const bool transposed = vec_d && D <= 256 && R >= TRANSPOSED_FROM;
  // the keys already in blocks of 16 transposed positions (`key_blocks`): no transposes here
  const int64_t NB = (T + 15) / 16;
  const float* kblk = transposed && key_blocks.numel() > 0 ? key_blocks.data_ptr<float>() : nullptr;
  if (kblk)
    TORCH_CHECK(key_blocks.is_contiguous() && key_blocks.scalar_type() == torch::kFloat32 &&
                key_blocks.numel() == B * G * NB * D * 16, "decode_attention: key blocks [B, G, ceil(T/16), D, 16]");
#else
  const bool transposed = false;  // (no transposed-key blocks without AVX-512)
  const int64_t NB = 0;
  const float* kblk = nullptr;
#endif
  // 6 to 16 query rows per K/V head: one reduction tree per position instead of R sums
  const bool tree = !transposed && vec_d && R >= 6 && R <= 16;
  // chunks with a position the mask leaves (the only ones read)
  std::vector<char> chunk_live(masked ? B * C : 0, 0);
  for (int64_t bc = 0; bc < static_cast<int64_t>(chunk_live.size()); ++bc) {
    const float* mrow = mk + (bc / C) * T;
    for (int64_t j = (bc % C) * chunk, e = std::min(T, j + chunk); j < e && !chunk_live[bc]; ++j)
      chunk_live[bc] = mrow[j] != ninf;
  }
  auto live_task = [&](int64_t task) { return !masked || chunk_live[(task / C / G) * C + task % C]; };
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(static_cast<size_t>(R * CHUNK));
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t c = task % C, bg = task / C, b = bg / G;
      const int64_t lo = c * chunk, hi = std::min(T, lo + chunk), n = hi - lo;
      const float* qb = q + (bg * R) * D;  // the R query rows of this group (B, H) = (B, G, R)
      const float* kb = k + (bg * T + lo) * D;
      const float* vb = v + (bg * T + lo) * Dv;
      const float* mb = masked ? mk + b * T + lo : nullptr;
      // the bias rows of this group's R query heads, from position lo (row stride T)
      const float* hb = biased ? hbias + ((bg % G) * R) * T + lo : nullptr;
      float* out = part.data() + task * R * W;
      bool any = false;
      // The transposed path computes more per byte than memory delivers to one core, so while
      // a task computes it asks for the next task's keys and values into L2 (one key line per
      // step of the score loop, two value lines per row of each value pass): memory keeps
      // streaming under the arithmetic, and the next task starts on data in L2. A thread's
      // first task fetches its own as it goes.
      const bool fetched = transposed && task > t0 && live_task(task - 1);
      const float* next_k = nullptr;
      const float* next_v = nullptr;
      int64_t next_n = 0;
      if (transposed && task + 1 < t1 && live_task(task + 1)) {
        const int64_t c2 = (task + 1) % C, bg2 = (task + 1) / C, lo2 = c2 * chunk;
        next_n = std::min(T, lo2 + chunk) - lo2;
        next_k = kblk ? kblk + (bg2 * NB + lo2 / 16) * D * 16 : k + (bg2 * T + lo2) * D;
        next_v = v + (bg2 * T + lo2) * Dv;
      }
#ifdef __AVX512F__
      if (transposed) {
        alignas(64) float kt[16 * 256];  // D <= 256
        alignas(64) float tail[16 * 256];
        v16 acc[12];
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
          const int64_t m = std::min<int64_t>(16, n - j0);
          v16 mv = (v16){};
          bool live = !mb;
          if (mb) {
            for (int64_t j = 0; j < 16; ++j) {
              mv[j] = j < m ? mb[j0 + j] : ninf;
              live = live || mv[j] != ninf;
            }
          } else {
            for (int64_t j = m; j < 16; ++j) mv[j] = ninf;
          }
          if (!live) {
            for (int64_t r = 0; r < R; ++r)
              for (int64_t j = 0; j < 16; ++j) s[r * CHUNK + j0 + j] = ninf;
            continue;
          }
          any = true;
          const float* ktp = kt;
          if (kblk) {  // this block's transposed keys, read in place (not yet fetched: the block KEY_AHEAD positions on asked for)
            ktp = kblk + (bg * NB + (lo + j0) / 16) * D * 16;
            if (!fetched)
              for (int64_t l = 0; l < D * 16; l += 16) __builtin_prefetch(ktp + KEY_AHEAD * D + l, 0, 2);
          } else {
            transpose_keys16(kb + j0 * D, m, D, tail, kt, fetched ? 0 : KEY_AHEAD);
          }
          for (int64_t r0 = 0; r0 < R; r0 += 12) {
            const int64_t rr = std::min<int64_t>(12, R - r0);
            // the next task's keys at this block's place (16 positions = D lines)
            run_scores16(rr, ktp, D, qb + r0 * D, acc, next_k && r0 == 0 && j0 < next_n ? next_k + j0 * D : nullptr);
            for (int64_t i = 0; i < rr; ++i) {
              v16 x = acc[i] * sc + mv;
              if (hb) {
                const float* hr = hb + (r0 + i) * T + j0;
                if (m == 16) x += *reinterpret_cast<const v16u*>(hr);
                else for (int64_t j = 0; j < m; ++j) x[j] += hr[j];
              }
              *reinterpret_cast<v16u*>(s.data() + (r0 + i) * CHUNK + j0) = mv == ninf ? (v16){} + ninf : x;
            }
          }
        }
      }
      for (int64_t j = 0; j < n && !transposed; ++j) {
#else
      for (int64_t j = 0; j < n; ++j) {
#endif
        const bool skip = mb && mb[j] == ninf;
        any = any || !skip;
        for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(kb + (j + KEY_AHEAD) * D + d, 0, 2);  // ask early
        if (tree && !skip) {  // R partial vectors, one reduction tree: lane r = score of row r
          const float* kj = kb + j * D;
          v16 part[16];
          for (int i = 0; i < 16; ++i) part[i] = (v16){};
          for (int64_t d = 0; d < D; d += 16) {
            const v16 kv = *reinterpret_cast<const v16u*>(kj + d);
            for (int64_t r = 0; r < R; ++r) part[r] += *reinterpret_cast<const v16u*>(qb + r * D + d) * kv;
          }
          const v16 dots = reduce16(part) * sc + (mb ? mb[j] : 0.f);
          for (int64_t r = 0; r < R; ++r) s[r * CHUNK + j] = dots[r] + (hb ? hb[r * T + j] : 0.f);
          continue;
        }
        for (int64_t r = 0; r < R; ++r) {
          float dot = 0.f;
          if (!skip) {
            const float* qr = qb + r * D;
            const float* kj = kb + j * D;
            if (vec_d) {
              v16 a = (v16){};
              for (int64_t d = 0; d < D; d += 16)
                a += *reinterpret_cast<const v16u*>(qr + d) * *reinterpret_cast<const v16u*>(kj + d);
              dot = hsum(a);
            } else {
              for (int64_t d = 0; d < D; ++d) dot += qr[d] * kj[d];
            }
          }
          s[r * CHUNK + j] = skip ? ninf : dot * sc + (mb ? mb[j] : 0.f) + (hb ? hb[r * T + j] : 0.f);
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        float* o = out + r * W;
        std::fill(o, o + Dv, 0.f);
        o[Dv] = ninf;
        o[Dv + 1] = 0.f;
        if (!any) continue;
        float* sr = s.data() + r * CHUNK;
        for (int64_t j = n; j < (n + 15) / 16 * 16; ++j) sr[j] = ninf;  // pad to whole vectors
        v16 vmx = (v16){} + ninf;
        for (int64_t j = 0; j < n; j += 16) {
          const v16 x = *reinterpret_cast<v16u*>(sr + j);
          vmx = x > vmx ? x : vmx;
        }
        float mx = ninf;
        for (int i = 0; i < 16; ++i) mx = std::max(mx, vmx[i]);
        if (mx == ninf) continue;
        v16 acc = (v16){};
        for (int64_t j = 0; j < n; j += 16) {
          v16 e = vexp(*reinterpret_cast<v16u*>(sr + j) - mx);
          *reinterpret_cast<v16u*>(sr + j) = e;
          acc += e;
        }
        const float sum = hsum(acc);
        o[Dv] = mx;
        o[Dv + 1] = sum;
      }
      if (!any) continue;
      int64_t last = n;
      while (mb && last > 0 && mb[last - 1] == ninf) --last;
      // weighted values: each V row read once from memory for all R query rows of the group;
      // up to 12 query rows x 32 value columns accumulate in registers per pass over the
      // chunk (masked rows have p = 0), so a head size of 64 takes 2 passes; the passes share
      // the next task's values out (32 floats per row each)
      for (int64_t d0 = 0; d0 < Dv; d0 += 32)
        for (int64_t r0 = 0; r0 < R; r0 += 12) {
          ValueFetch f;
          f.near = d0 == 0 && r0 == 0;
          f.far = f.near && !fetched;
          f.next = next_v && r0 == 0 && (d0 / 32) * last < next_n * (Dv / 32) ? next_v + (d0 / 32) * last * 32 : nullptr;
          value_sums(vb, Dv, last, s.data() + r0 * CHUNK, CHUNK, std::min<int64_t>(12, R - r0), d0,
                     out + r0 * W, W, f);
        }
    }
  });
  auto result = torch::empty({B, 1, H, Dv}, query.options());
  float* res = result.data_ptr<float>();
  at::parallel_for(0, B * G * R, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {  // i = (b*G + g)*R + r = b*H + h
      const int64_t bg = i / R, r = i % R;
      float mx = ninf;
      for (int64_t c = 0; c < C; ++c) mx = std::max(mx, part[((bg * C + c) * R + r) * W + Dv]);
      float* o = res + i * Dv;
      std::fill(o, o + Dv, 0.f);
      if (mx == ninf) continue;  // nothing to attend to: zeros
      float den = 0.f;
      for (int64_t c = 0; c < C; ++c) {
        const float* pc = part.data() + ((bg * C + c) * R + r) * W;
        if (pc[Dv] == ninf) continue;
        const float f = std::exp(pc[Dv] - mx);
        den += f * pc[Dv + 1];
        for (int64_t d = 0; d < Dv; ++d) o[d] += f * pc[d];
      }
      for (int64_t d = 0; d < Dv; ++d) o[d] /= den;
    }
  });
  return result;
}

torch::Tensor decode_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor mask,
                               double scale) {
  return attention_impl(query, key, value, mask, torch::Tensor(), scale);
}

// A static cache's keys [B, G, T, D] (contiguous fp32) in the layout the grouped attention's
// transposed-keys path reads, [B, G, ceil(T/16), D, 16] (position blocks of 16, zero-padded),
// made once where the cache is written once (a cross-attention cache): the step then reads
// them in place instead of transposing 16 x 16 tiles in registers. An empty tensor where H
// query heads would not take that path (fewer than TRANSPOSED_FROM per K/V head, a head size
// not a multiple of 16 or over 256, no AVX-512).
torch::Tensor key_blocks(torch::Tensor key, int64_t H) {
  TORCH_CHECK(key.device().is_cpu() && key.scalar_type() == torch::kFloat32 && key.is_contiguous() && key.dim() == 4,
              "key_blocks: a contiguous [B, G, T, D] fp32 CPU tensor");
  const int64_t B = key.size(0), G = key.size(1), T = key.size(2), D = key.size(3);
  TORCH_CHECK(G > 0 && H % G == 0, "key_blocks: query heads must be a multiple of the K/V heads");
#ifdef __AVX512F__
  if (D % 16 != 0 || D > 256 || H / G < TRANSPOSED_FROM) return torch::empty({0}, key.options());
  const int64_t NB = (T + 15) / 16;
  auto out = huge_zeros(B * G * NB * D * 16);
  const float* k = key.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, B * G * NB, 16, [&](int64_t i0, int64_t i1) {
    alignas(64) float tail[16 * 256];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t bg = i / NB, j0 = (i % NB) * 16;
      transpose_keys16(k + (bg * T + j0) * D, std::min<int64_t>(16, T - j0), D, tail, o + i * D * 16, 0);
    }
  });
  return out.view({B, G, NB, D, 16});
#else
  return torch::empty({0}, key.options());
#endif
}

// x [B, N] -> x / rms(x) * w, row by row (fp32; LlamaRMSNorm's arithmetic).
static torch::Tensor rms_rows(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  const int64_t B = x.size(0), N = x.size(1);
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const float* r = xp + b * N;
    v16 acc = (v16){};
    int64_t i = 0;
    for (; i + 16 <= N; i += 16) {
      const v16 v = *reinterpret_cast<const v16u*>(r + i);
      acc += v * v;
    }
    float ss = hsum(acc);
    for (; i < N; ++i) ss += r[i] * r[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(N) + static_cast<float>(eps));
    for (int64_t i = 0; i < N; ++i) yp[b * N + i] = wp[i] * (r[i] * inv);
  }
  return y;
}

// x [B, N] -> (x - mean) / sqrt(var + eps), row by row, then times w plus bias where given
// (F.layer_norm's arithmetic: the biased variance; OLMo's has no weight or bias).
static torch::Tensor layer_norm_rows(const torch::Tensor& x, double eps, const float* w = nullptr,
                                     const float* bias = nullptr) {
  const int64_t B = x.size(0), N = x.size(1);
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const float* r = xp + b * N;
    float sum = 0.f;
    for (int64_t i = 0; i < N; ++i) sum += r[i];
    const float mean = sum / static_cast<float>(N);
    float ss = 0.f;
    for (int64_t i = 0; i < N; ++i) ss += (r[i] - mean) * (r[i] - mean);
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(N) + static_cast<float>(eps));
    for (int64_t i = 0; i < N; ++i) yp[b * N + i] = (r[i] - mean) * inv;
    if (w)
      for (int64_t i = 0; i < N; ++i) yp[b * N + i] = yp[b * N + i] * w[i] + bias[i];
  }
  return y;
}

// A decoder layer's norm: RMSNorm with weight w (norm_kind 0), LayerNorm without parameters (1)
// or LayerNorm with weight w and bias (2).
static torch::Tensor norm_rows(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                               double eps, int64_t norm_kind) {
  if (norm_kind == 0) return rms_rows(x, w, eps);
  if (norm_kind == 1) return layer_norm_rows(x, eps);
  return layer_norm_rows(x, eps, w.data_ptr<float>(), bias->data_ptr<float>());
}

// The MLP of a decode step on normed rows h [B, hidden]: mlp_kind 0: SiLU(gate) * up with wgu =
// gate and up stacked and packed (N = 2I), 1: GELU(up) with wgu = up (N = I), 2: the same with
// GELU's tanh approximation, 3: ReLU(up), 4: GELU-tanh(gate) * up with wgu as for 0; biases
// bup/bdown where given; wd: the packed down projection. Returns [B, hidden].
static torch::Tensor mlp_rows(const torch::Tensor& h2, const torch::Tensor& wgu, const torch::Tensor& wd, int64_t I,
                              int64_t mlp_kind, const c10::optional<torch::Tensor>& bup,
                              const c10::optional<torch::Tensor>& bdown) {
  const int64_t B = h2.size(0), hidden = h2.size(1);
  torch::Tensor act;
  if (mlp_kind == 4) {  // GELU(gate, tanh) * up: Gemma
    auto gu = skinny_linear(h2, wgu, 2 * I, c10::nullopt);
    act = torch::gelu(gu.narrow(1, 0, I), "tanh") * gu.narrow(1, I, I);
  } else if (mlp_kind == 3) {  // ReLU, no gate: OPT
    act = torch::relu(skinny_linear(h2, wgu, I, bup));
  } else if (mlp_kind > 0) {  // GELU, no gate: GPT-NeoX (erf), GPT-2 (tanh approximation)
    act = torch::gelu(skinny_linear(h2, wgu, I, bup), mlp_kind == 2 ? "tanh" : "none");
  } else {
    auto gu = skinny_linear(h2, wgu, 2 * I, c10::nullopt);  // [B, 2I]: gate, then up
    act = torch::empty({B, I}, h2.options());
    const float* g = gu.data_ptr<float>();
    float* a = act.data_ptr<float>();
    // SiLU(gate) * up, 16 at a time
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const float* gr = g + b * 2 * I;
        float* ar = a + b * I;
        int64_t i = 0;
        for (; i + 16 <= I; i += 16) {
          const v16 gv = *reinterpret_cast<const v16u*>(gr + i), uv = *reinterpret_cast<const v16u*>(gr + I + i);
          *reinterpret_cast<v16u*>(ar + i) = gv / (1.f + vexp(-gv)) * uv;
        }
        for (; i < I; ++i) ar[i] = gr[i] / (1.f + std::exp(-gr[i])) * gr[I + i];
      }
    });
  }
  return skinny_linear(act, wd, hidden, bdown);
}

// One decode step of a Llama-layout decoder layer (pre-norm RMSNorm, rotary on the two halves
// of each head, grouped attention over a static cache, SiLU-gated MLP) in one call: what
// transformers runs as ~60 small ops and module calls per layer, with their per-op cost.
// x [B, hidden]; wqkv: q, k and v weights stacked and packed (N = (H + 2G) D), wgu: gate and
// up stacked and packed (N = 2I); cos/sin [D] or [B, D]; caches [B, G, T, D], written at
// `slot`; mask: additive [B, T]; qnorm/knorm: per-head RMSNorm weights [D] applied to q and k
// before rotary (Qwen3), or none; norm_kind: 0 RMSNorm (ln1/ln2 its weights), 1 LayerNorm without
// parameters (OLMo; ln1/ln2 unused); clip_qkv: q, k and v clamped to +-clip_qkv after the
// projection where > 0 (OLMo); norm_kind 2: LayerNorm with weights ln1/ln2 and biases ln1b/ln2b;
// mlp_kind 0: SiLU(gate) * up with wgu = gate and up stacked (N = 2I), 1: GELU(up) with wgu = up
// (N = I), 2: the same with GELU's tanh approximation, 3: ReLU(up), 4: GELU-tanh(gate) * up with
// wgu as for 0; biases bup/bdown where given; parallel: x + attention(norm1(x)) + MLP(norm2(x))
// (GPT-NeoX) instead of the sequential residuals. cos/sin [1 or B, rot]: rotary on the first rot
// dims of each head, the rest passes through (rot 0: no rotary, GPT-2). Returns the layer's output [B, hidden].
torch::Tensor decode_layer(torch::Tensor x, torch::Tensor ln1, double eps1, torch::Tensor wqkv,
                           c10::optional<torch::Tensor> bqkv, torch::Tensor wo, c10::optional<torch::Tensor> bo,
                           torch::Tensor ln2, double eps2, torch::Tensor wgu, torch::Tensor wd, torch::Tensor cos,
                           torch::Tensor sin, torch::Tensor kcache, torch::Tensor vcache, int64_t slot,
                           torch::Tensor mask, double scale, int64_t H, int64_t I,
                           c10::optional<torch::Tensor> qnorm, c10::optional<torch::Tensor> knorm, double qk_eps,
                           int64_t norm_kind, double clip_qkv, c10::optional<torch::Tensor> ln1b,
                           c10::optional<torch::Tensor> ln2b, int64_t mlp_kind, c10::optional<torch::Tensor> bup,
                           c10::optional<torch::Tensor> bdown, bool parallel) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "decode_layer: x [B, hidden] fp32");
  const int64_t B = x.size(0), hidden = x.size(1);
  const int64_t G = kcache.size(1), T = kcache.size(2), D = kcache.size(3);
  TORCH_CHECK(kcache.is_contiguous() && vcache.is_contiguous() && kcache.size(0) == B && vcache.sizes() == kcache.sizes() &&
              slot >= 0 && slot < T && H % G == 0 && D % 2 == 0, "decode_layer: caches [B, G, T, D] and a slot inside them");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 2 &&
              (cos.size(0) == 1 || cos.size(0) == B) && cos.size(1) % 2 == 0 && cos.size(1) <= D,
              "decode_layer: cos/sin [1 or B, rotary dims <= D]");
  const int64_t rot = cos.size(1);  // rotary on the first rot dims of each head (GPT-NeoX: a quarter), the rest passes
  const bool qk_norms = qnorm.has_value() && qnorm->defined();
  TORCH_CHECK(qk_norms == (knorm.has_value() && knorm->defined()) &&
              (!qk_norms || (qnorm->is_contiguous() && knorm->is_contiguous() && qnorm->numel() == D && knorm->numel() == D)),
              "decode_layer: per-head q and k norm weights [D], both or neither");
  TORCH_CHECK(norm_kind >= 0 && norm_kind <= 2 && (norm_kind < 2 || (ln1b.has_value() && ln2b.has_value())),
              "decode_layer: norm_kind 0 (RMSNorm), 1 (LayerNorm without parameters) or 2 (LayerNorm, with biases)");
  TORCH_CHECK(mlp_kind >= 0 && mlp_kind <= 4,
              "decode_layer: mlp_kind 0 (SiLU-gated), 1 (GELU), 2 (GELU, tanh), 3 (ReLU) or 4 (GELU-tanh-gated)");
  auto h = norm_rows(x, ln1, ln1b, eps1, norm_kind);
  auto qkv = skinny_linear(h, wqkv, (H + 2 * G) * D, bqkv);  // [B, (H + 2G) D]
  if (clip_qkv > 0) qkv.clamp_(-clip_qkv, clip_qkv);  // OLMo's clip_qkv
  auto q = torch::empty({B, H, 1, D}, x.options());
  {
    const float* src = qkv.data_ptr<float>();
    float* qp = q.data_ptr<float>();
    float* kc = kcache.data_ptr<float>();
    float* vc = vcache.data_ptr<float>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    const int64_t half = rot / 2, row = (H + 2 * G) * D;
    for (int64_t b = 0; b < B; ++b) {
      const float* c = cp + (cos.size(0) == 1 ? 0 : b * rot);
      const float* sn = sp + (sin.size(0) == 1 ? 0 : b * rot);
      const float* r = src + b * row;
      std::vector<float> normed(qk_norms ? D : 0);
      auto rope = [&](const float* in, float* out, const float* nw) {  // x cos + rotate_half(x) sin
        if (nw) {  // per-head RMSNorm first (Qwen3's q_norm / k_norm)
          float ss = 0.f;
          for (int64_t d = 0; d < D; ++d) ss += in[d] * in[d];
          const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + static_cast<float>(qk_eps));
          for (int64_t d = 0; d < D; ++d) normed[d] = nw[d] * (in[d] * inv);
          in = normed.data();
        }
        for (int64_t d = 0; d < half; ++d) {
          out[d] = in[d] * c[d] - in[d + half] * sn[d];
          out[d + half] = in[d + half] * c[d + half] + in[d] * sn[d + half];
        }
        for (int64_t d = rot; d < D; ++d) out[d] = in[d];
      };
      const float* qn = qk_norms ? qnorm->data_ptr<float>() : nullptr;
      const float* kn = qk_norms ? knorm->data_ptr<float>() : nullptr;
      for (int64_t hh = 0; hh < H; ++hh) rope(r + hh * D, qp + (b * H + hh) * D, qn);
      for (int64_t g = 0; g < G; ++g) {
        rope(r + (H + g) * D, kc + ((b * G + g) * T + slot) * D, kn);
        std::memcpy(vc + ((b * G + g) * T + slot) * D, r + (H + G + g) * D, sizeof(float) * D);
      }
    }
  }
  auto att = decode_attention(q, kcache, vcache, mask, scale).reshape({B, H * D});
  auto x2 = skinny_linear(att, wo, hidden, bo);  // the attention's output
  if (!parallel) x2.add_(x);  // sequential: the MLP sees x + attention
  auto h2 = norm_rows(parallel ? x : x2, ln2, ln2b, eps2, norm_kind);
  auto out = mlp_rows(h2, wgu, wd, I, mlp_kind, bup, bdown);
  out.add_(x2);
  if (parallel) out.add_(x);  // parallel: x + attention + MLP(norm(x))
  return out;
}

// One decode step of a T5-layout decoder block (T5 1.0 / 1.1, mT5; gqakit's grouped T5) in one
// call: RMS norm, self-attention (q, k and v stacked in wqkv, N = (H + 2G) D; the new K/V
// written into the self-attention caches [B, G, T, D] at `slot`; scores unscaled, plus the
// mask [B, T] and T5's relative position bias per query head, head_bias [H, T]), output
// projection wo and residual; RMS norm, cross-attention (query projection wcq, N = H D, against
// the filled cross-attention caches [B, G, S, D], unscaled, no mask), output projection wco
// and residual; RMS norm and the MLP (`mlp_rows`: kind 3 ReLU, 4 gated GELU-tanh, 0 gated
// SiLU) and residual. x [B, hidden]; ln0/ln1/ln2: the three norms' weights, eps their
// epsilon. Returns the block's output [B, hidden].
torch::Tensor t5_decode_layer(torch::Tensor x, torch::Tensor ln0, torch::Tensor ln1, torch::Tensor ln2, double eps,
                              torch::Tensor wqkv, torch::Tensor wo, torch::Tensor kcache, torch::Tensor vcache,
                              int64_t slot, torch::Tensor mask, torch::Tensor head_bias, torch::Tensor wcq,
                              torch::Tensor wco, torch::Tensor ckeys, torch::Tensor cvalues, torch::Tensor wgu,
                              torch::Tensor wd, int64_t H, int64_t I, int64_t mlp_kind, torch::Tensor ckey_blocks) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "t5_decode_layer: x [B, hidden] fp32");
  const int64_t B = x.size(0), hidden = x.size(1);
  const int64_t G = kcache.size(1), T = kcache.size(2), D = kcache.size(3);
  TORCH_CHECK(kcache.dim() == 4 && kcache.is_contiguous() && vcache.is_contiguous() && kcache.size(0) == B &&
              vcache.sizes() == kcache.sizes() && slot >= 0 && slot < T && H % G == 0,
              "t5_decode_layer: self-attention caches [B, G, T, D] and a slot inside them");
  TORCH_CHECK(ckeys.dim() == 4 && ckeys.size(0) == B && ckeys.size(3) == D && H % ckeys.size(1) == 0,
              "t5_decode_layer: cross-attention caches [B, G, S, D]");
  TORCH_CHECK(mlp_kind == 0 || mlp_kind == 3 || mlp_kind == 4, "t5_decode_layer: mlp_kind 0, 3 or 4");
  const c10::optional<torch::Tensor> none;
  auto qkv = skinny_linear(rms_rows(x, ln0, eps), wqkv, (H + 2 * G) * D, none);  // [B, (H + 2G) D]
  {
    const float* src = qkv.data_ptr<float>();
    float* kc = kcache.data_ptr<float>();
    float* vc = vcache.data_ptr<float>();
    const int64_t row = (H + 2 * G) * D;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < G; ++g) {
        std::memcpy(kc + ((b * G + g) * T + slot) * D, src + b * row + (H + g) * D, sizeof(float) * D);
        std::memcpy(vc + ((b * G + g) * T + slot) * D, src + b * row + (H + G + g) * D, sizeof(float) * D);
      }
  }
  auto q = qkv.narrow(1, 0, H * D).contiguous().view({B, H, 1, D});
  auto att = attention_impl(q, kcache, vcache, mask, head_bias, 1.0).reshape({B, H * D});
  auto x1 = skinny_linear(att, wo, hidden, none);
  x1.add_(x);
  auto cq = skinny_linear(rms_rows(x1, ln1, eps), wcq, H * D, none).view({B, H, 1, D});
  auto cross = attention_impl(cq, ckeys.contiguous(), cvalues.contiguous(), torch::Tensor(), torch::Tensor(), 1.0,
                              ckey_blocks);
  auto x2 = skinny_linear(cross.reshape({B, H * D}), wco, hidden, none);
  x2.add_(x1);
  auto out = mlp_rows(rms_rows(x2, ln2, eps), wgu, wd, I, mlp_kind, none, none);
  out.add_(x2);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("t5_decode_layer", &t5_decode_layer, "one decode step of a T5-layout decoder block");
  m.def("decode_layer", &decode_layer, "one decode step of a Llama-layout decoder layer");
  m.def("pack_weight", &pack_weight, "pack a [N, K] fp32 weight into 48-column panels");
  m.def("pack_weight_into", &pack_weight_into, "pack a [N, K] fp32 weight into a given zeroed buffer");
  m.def("packed_numel", &packed_numel, "elements of an [N, K] weight's packed panels");
  m.def("huge_zeros", &huge_zeros, "a zeroed fp32 buffer, 2 MiB-aligned and advised as huge pages from 2 MiB");
  m.def("skinny_linear", &skinny_linear, "x W^T (+ bias) for a few rows of x, W packed");
  m.def("decode_attention", &decode_attention, "grouped one-token attention against a KV cache");
  m.def("key_blocks", &key_blocks, "a static cache's keys in the transposed blocks the grouped attention reads");
}
