// Fused CPU kernels for the small per-layer ops of a decode or verify step (norms, rotary + cache write, row-wise
// attention, SiLU gate). In eager torch each of these is 3-15 tiny kernels of a few microseconds; here each is one
// pass over data already in cache. Every row is computed by one thread in a fixed order, so a row's bits never depend
// on how many rows run with it: a token verified in an EAGLE tree gets the bits it gets when decoded alone.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <cstring>
#include <type_traits>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <map>
#include <string>
#include <vector>

#include "qlinear_int8act.h"

namespace {

constexpr int LANES = 16;  // partial sums kept in 16 lanes: the compiler vectorises the loop, the order stays fixed
// Rows of a row-wise elementwise kernel (norms, SiLU gate, rotary) one thread takes before a second joins: a row is
// well under a microsecond, less than waking the other thread costs, so decode and verify steps run them inline
// (measured in real steps: with every row count parallel, the norms cost 0.9 ms of a four-row verify)
constexpr int64_t ROW_GRAIN = 32;

// bfloat16 <-> float32 by bit operations (round to nearest even, NaN kept), which the compiler vectorises; c10's
// conversions give the same bits but keep loops scalar.
inline float to_f(float v) { return v; }
inline float to_f(double v) { return static_cast<float>(v); }
inline float to_f(c10::BFloat16 v) {
  uint32_t b = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

template <typename T>
inline T from_f(float v) {
  return static_cast<T>(v);
}
template <>
inline c10::BFloat16 from_f<c10::BFloat16>(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  uint32_t r = (b & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(r), c10::BFloat16::from_bits());
}

// e^x by Cephes' expf polynomial, in plain arithmetic the compiler vectorises (std::exp is a scalar call); within
// 2 ulp of std::exp over the range softmax and SiLU use.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// A fixed pairwise fold of the 16 lanes: shuffles and 4 vector adds, where a running sum is 16 dependent adds.
inline float reduce_lanes(float* acc) {
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  return acc[0];
}

template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  float acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int j = 0; j < LANES; ++j) {
      float v = to_f(x[i + j]);
      acc[j] += v * v;
    }
  for (; i < n; ++i) {
    float v = to_f(x[i]);
    acc[0] += v * v;
  }
  return reduce_lanes(acc);
}

inline float lane_sum(const float* x, int64_t n) {
  float acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int j = 0; j < LANES; ++j) acc[j] += x[i + j];
  for (; i < n; ++i) acc[0] += x[i];
  return reduce_lanes(acc);
}

template <typename C>
inline float dot(const float* a, const C* b, int64_t n) {
  float acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int j = 0; j < LANES; ++j) acc[j] += a[i + j] * to_f(b[i + j]);
  for (; i < n; ++i) acc[0] += a[i] * to_f(b[i]);
  return reduce_lanes(acc);
}

template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t c, float eps) {
  float inv = 1.0f / std::sqrt(sum_squares(x, c) / static_cast<float>(c) + eps);
  for (int64_t i = 0; i < c; ++i) out[i] = from_f<T>(to_f(x[i]) * inv * to_f(w[i]));
}

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be [rows, features] with contiguous features");
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define EAGLEGATE_HEAD_VEC 1
// Head sizes 64 and 128 in vector registers (a 64-wide row is 4 AVX-512 registers or 8 AVX2 ones): the accumulators
// stay in registers where they fit and each dot product is reduced by one fixed shuffle sequence.
// The cache rows a step reads were evicted by the weights streamed since the last step, and a row's keys are
// gathered by slot, so the hardware prefetcher sees no stream: fetch the key (value) row this many ahead.
constexpr int64_t kPrefetchKeys = 32;

template <int D, typename C>
inline void prefetch_row(const C* row) {  // one head's D cached values
  for (size_t b = 0; b < D * sizeof(C); b += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + b, _MM_HINT_T0);
}

#ifdef __AVX512F__
struct Vec {  // 16 float32 lanes
  using T = __m512;
  static constexpr int W = 16;
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load(const c10::BFloat16* p) {  // bfloat16 is float32's upper half: widen and shift, exactly
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static T zero() { return _mm512_setzero_ps(); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  // The lane sums of 16 vectors, out[i] = sum of v[i]'s lanes, by one fixed tree of shuffles and adds: about 3
  // instructions a vector, where a horizontal reduce of each is 8.
  static T sums(const T* v) {
    T a[8], b[4];
    for (int i = 0; i < 8; ++i)  // 256-bit halves: [v2i: q0+q2, q1+q3 | v2i+1: q0+q2, q1+q3] (q: 128-bit quarters)
      a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int j = 0; j < 4; ++j)  // quarter L of b[j]: four partial sums of v[4j + L]
      b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    T c0 = _mm512_add_ps(_mm512_unpacklo_ps(b[0], b[1]), _mm512_unpackhi_ps(b[0], b[1]));
    T c1 = _mm512_add_ps(_mm512_unpacklo_ps(b[2], b[3]), _mm512_unpackhi_ps(b[2], b[3]));
    __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(c0), _mm512_castps_pd(c1));
    __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(c0), _mm512_castps_pd(c1));
    T d = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));  // d[4L + j] = sum of v[4j + L]
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, d);
  }
};
#else
struct Vec {  // 8 float32 lanes (AVX2 and FMA)
  using T = __m256;
  static constexpr int W = 8;
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T load(const c10::BFloat16* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static T zero() { return _mm256_setzero_ps(); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  // out[i] = sum of v[i]'s lanes for 8 vectors: pairwise adds within each 128-bit half, then the halves added.
  static T sums(const T* v) {
    T a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
    T a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
    T b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // [v0..v3 low-half sums | v0..v3 high-half sums]
    return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
  }
};
#endif
// The query heads g0 .. g0 + H of one row that share a KV head (GQA), head_dim D: each cached key and value row is
// loaded and widened once for all of them. Scores go Vec::W keys at a time through Vec::sums; each head's softmax
// and weighted sum of values run in a fixed order over the row's own keys, so its result is the same whatever other
// heads or rows run beside it.
template <typename C, int H, int D>
inline void attend_heads(const float* q, const C* k0, const C* v0, int64_t stride, const int64_t* slots, int64_t len,
                         int64_t width, float scale, float* p, float* out) {
  using V = Vec;
  constexpr int R = D / V::W;  // registers per head row
  typename V::T part[H][V::W];
  float block[V::W];
  for (int64_t t = 0; t < len && t < kPrefetchKeys; ++t) prefetch_row<D>(k0 + slots[t] * stride);
  for (int64_t t0 = 0; t0 < len; t0 += V::W) {
    int64_t n = std::min<int64_t>(V::W, len - t0);
    for (int64_t i = 0; i < n; ++i) {
      int64_t t = t0 + i;
      const C* k = k0 + slots[t] * stride;
      if (t + kPrefetchKeys < len) prefetch_row<D>(k0 + slots[t + kPrefetchKeys] * stride);
      typename V::T kr[R];
      for (int j = 0; j < R; ++j) kr[j] = V::load(k + j * V::W);
      for (int h = 0; h < H; ++h) {  // two chains (even and odd registers), then their sum
        const float* qh = q + h * D;
        typename V::T a = V::mul(V::load(qh), kr[0]), b = V::mul(V::load(qh + V::W), kr[1]);
        for (int j = 2; j < R; j += 2) {
          a = V::fmadd(V::load(qh + j * V::W), kr[j], a);
          b = V::fmadd(V::load(qh + (j + 1) * V::W), kr[j + 1], b);
        }
        part[h][i] = V::add(a, b);
      }
    }
    for (int h = 0; h < H; ++h) {
      for (int64_t i = n; i < V::W; ++i) part[h][i] = V::zero();
      V::store(block, V::mul(V::sums(part[h]), V::set1(scale)));
      std::memcpy(p + h * width + t0, block, n * sizeof(float));
    }
  }
  for (int64_t t = 0; t < len && t < kPrefetchKeys; ++t) prefetch_row<D>(v0 + slots[t] * stride);  // under the softmax
  float inv[H];
  for (int h = 0; h < H; ++h) {
    float* ph = p + h * width;
    float m = ph[0];
    for (int64_t t = 1; t < len; ++t) m = ph[t] > m ? ph[t] : m;
    for (int64_t t = 0; t < len; ++t) ph[t] = exp_approx(ph[t] - m);
    inv[h] = 1.0f / lane_sum(ph, len);
  }
  typename V::T o[H][R];
  for (int h = 0; h < H; ++h)
    for (int j = 0; j < R; ++j) o[h][j] = V::zero();
  for (int64_t t = 0; t < len; ++t) {
    const C* v = v0 + slots[t] * stride;
    if (t + kPrefetchKeys < len) prefetch_row<D>(v0 + slots[t + kPrefetchKeys] * stride);
    typename V::T vr[R];
    for (int j = 0; j < R; ++j) vr[j] = V::load(v + j * V::W);
    for (int h = 0; h < H; ++h) {
      typename V::T pt = V::set1(p[h * width + t]);
      for (int j = 0; j < R; ++j) o[h][j] = V::fmadd(pt, vr[j], o[h][j]);
    }
  }
  for (int h = 0; h < H; ++h) {
    typename V::T s = V::set1(inv[h]);
    for (int j = 0; j < R; ++j) V::store(out + h * D + V::W * j, V::mul(o[h][j], s));
  }
}

// Heads [g0, g0 + count) of one row, at most 4 at a time (AVX-512: their accumulators stay in registers).
template <int D, typename C>
inline void attend_group(const float* q, const C* k0, const C* v0, int64_t stride, const int64_t* slots, int64_t len,
                         int64_t width, float scale, float* p, float* out, int count) {
  for (int h = 0; h < count; h += 4) {
    const float* qh = q + h * D;
    float* oh = out + h * D;
    switch (std::min(4, count - h)) {
      case 1:
        attend_heads<C, 1, D>(qh, k0, v0, stride, slots, len, width, scale, p, oh);
        break;
      case 2:
        attend_heads<C, 2, D>(qh, k0, v0, stride, slots, len, width, scale, p, oh);
        break;
      case 3:
        attend_heads<C, 3, D>(qh, k0, v0, stride, slots, len, width, scale, p, oh);
        break;
      default:
        attend_heads<C, 4, D>(qh, k0, v0, stride, slots, len, width, scale, p, oh);
        break;
    }
  }
}
#endif

}  // namespace

// The KV caches: contiguous [slots, kv_heads, head_dim], one shape, float32 or bfloat16 (both alike).
void check_caches(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  auto t = k_cache.scalar_type();
  TORCH_CHECK((t == at::kFloat || t == at::kBFloat16) && v_cache.scalar_type() == t && k_cache.dim() == 3 &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes(),
              "caches must be contiguous float32 or bfloat16 [slots, kv_heads, head_dim], of one shape and dtype");
}

// Calls f(k, v) with the caches' data as float* or c10::BFloat16*.
template <typename F>
void with_cache_type(torch::Tensor& k_cache, torch::Tensor& v_cache, F&& f) {
  if (k_cache.scalar_type() == at::kBFloat16)
    f(k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>());
  else
    f(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
}

// RMSNorm of each row of x [N, C]: float32 accumulation, one rounding to x's dtype.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == x.scalar_type() && w.numel() == x.size(1),
              "weight must be contiguous, x's dtype, one per feature");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  int64_t c = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    int64_t xs = x.stride(0);
    at::parallel_for(0, x.size(0), ROW_GRAIN, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) norm_row(xp + r * xs, wp, op + r * c, c, static_cast<float>(eps));
    });
  });
  return out;
}

// The residual add and the next norm in one pass: returns (x + delta, rms_norm(x + delta)). The sum is rounded to
// x's dtype before it is normed, exactly as the unfused `x = x + delta; norm(x)` does.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor w, double eps) {
  check_rows(x, "x");
  check_rows(delta, "delta");
  TORCH_CHECK(delta.scalar_type() == x.scalar_type() && w.scalar_type() == x.scalar_type() && w.is_contiguous(),
              "x, delta and weight must share a dtype");
  TORCH_CHECK(delta.sizes() == x.sizes() && w.numel() == x.size(1), "x, delta and weight sizes differ");
  int64_t n = x.size(0), c = x.size(1);
  auto sum = torch::empty({n, c}, x.options());
  auto out = torch::empty({n, c}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* dp = delta.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    int64_t xs = x.stride(0), ds = delta.stride(0);
    at::parallel_for(0, n, ROW_GRAIN, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        scalar_t* s = sp + r * c;
        for (int64_t i = 0; i < c; ++i) s[i] = from_f<scalar_t>(to_f(xp[r * xs + i]) + to_f(dp[r * ds + i]));
        norm_row(s, wp, op + r * c, c, static_cast<float>(eps));
      }
    });
  });
  return {sum, out};
}

// silu(gate) * up for gate_up [N, 2I] (gate first): computed in float32, rounded once.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  int64_t n = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({n, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    int64_t gs = gate_up.stride(0);
    at::parallel_for(0, n, ROW_GRAIN, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* g = gp + r * gs;
        scalar_t* o = op + r * inter;
        for (int64_t i = 0; i < inter; ++i) {
          float a = to_f(g[i]);
          o[i] = from_f<scalar_t>(a / (1.0f + exp_approx(-a)) * to_f(g[inter + i]));
        }
      }
    });
  });
  return out;
}

// Neox rotary on q and k, in float32 from the float32 cos/sin rows [N, R] (R <= D: partial rotary turns the leading R
// dims), then k and v written to the caches [slots, Hkv, D] (float32, or bfloat16 for bfloat16 models) at
// slot_mapping. q, k, v: [N, heads, D] views
// with contiguous heads (slices of the fused QKV output). Returns the rotated q, [N, H, D] float32.
torch::Tensor rope_write_cache(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                               torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping) {
  int64_t n = q.size(0), h = q.size(1), hkv = k.size(1), d = q.size(2), rot = cos.size(1), half = rot / 2;
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == d && t->scalar_type() == q.scalar_type(),
                "q, k, v must be [rows, heads, head_dim] with contiguous heads and one dtype");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(0) == n && sin.sizes() == cos.sizes() && rot <= d && rot % 2 == 0,
              "cos/sin must be contiguous float32 [rows, rot], rot even and at most head_dim");
  TORCH_CHECK(k.size(0) == n && v.size(0) == n && v.size(1) == hkv, "q, k, v row or head counts differ");
  check_caches(k_cache, v_cache);
  TORCH_CHECK(k_cache.size(1) == hkv && k_cache.size(2) == d, "caches must be [slots, kv_heads, head_dim]");
  auto slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == n, "one slot per row");
  auto out = torch::empty({n, h, d}, q.options().dtype(at::kFloat));
  const int64_t* sl = slots.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  int64_t slots_total = k_cache.size(0);
  for (int64_t r = 0; r < n; ++r) TORCH_CHECK(sl[r] >= 0 && sl[r] < slots_total, "slot out of range");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "rope_write_cache", [&] {
    auto rotate = [&](const scalar_t* x, const float* c, const float* s, float* y) {
      for (int64_t i = 0; i < half; ++i) {
        float a = to_f(x[i]), b = to_f(x[i + half]);
        y[i] = a * c[i] - b * s[i];
        y[i + half] = b * c[i + half] + a * s[i + half];
      }
      for (int64_t i = rot; i < d; ++i) y[i] = to_f(x[i]);
    };
    with_cache_type(k_cache, v_cache, [&](auto* kc, auto* vc) {
      using C = std::remove_pointer_t<decltype(kc)>;
      at::parallel_for(0, n, ROW_GRAIN, [&](int64_t b, int64_t e) {
        std::vector<float> tmp(d);
        for (int64_t r = b; r < e; ++r) {
          const float* c = cp + r * rot;
          const float* s = sp + r * rot;
          for (int64_t j = 0; j < h; ++j)
            rotate(q.data_ptr<scalar_t>() + r * q.stride(0) + j * d, c, s, op + (r * h + j) * d);
          for (int64_t j = 0; j < hkv; ++j) {
            rotate(k.data_ptr<scalar_t>() + r * k.stride(0) + j * d, c, s, tmp.data());
            C* ko = kc + (sl[r] * hkv + j) * d;
            for (int64_t i = 0; i < d; ++i) ko[i] = from_f<C>(tmp[i]);
            const scalar_t* vr = v.data_ptr<scalar_t>() + r * v.stride(0) + j * d;
            C* vo = vc + (sl[r] * hkv + j) * d;
            for (int64_t i = 0; i < d; ++i) vo[i] = from_f<C>(to_f(vr[i]));
          }
        }
      });
    });
  });
  return out;
}

// Attention of each query row over exactly its own keys: q [N, H, D] float32, row_slots [N, Lr] (each row's cache
// slots in position order, the first row_counts[r] real) or [1, Lr] (one list whose first row_counts[r] slots are
// row r's keys: the causal rows of a prefill chunk). One thread computes a whole (row, KV head) (or, off the vector
// head_dim 64 and 128 paths, a whole (row, head)), each head in the same order whatever runs beside it, so the result
// depends only on that row's keys: a position gets the same bits prefilled in any chunk, decoded alone or verified in a
// tree. Returns [N, H, D] in out_dtype.
torch::Tensor attend_rows(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor row_slots,
                          torch::Tensor row_counts, double scale, at::ScalarType out_dtype) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 3, "q must be contiguous float32");
  check_caches(k_cache, v_cache);
  TORCH_CHECK(row_slots.dim() == 2, "row_slots must be [rows, width]");
  int64_t n = q.size(0), h = q.size(1), d = q.size(2), hkv = k_cache.size(1), width = row_slots.size(1);
  TORCH_CHECK(h % hkv == 0 && k_cache.size(2) == d, "head layout mismatch");
  auto slots = row_slots.to(at::kLong).contiguous();
  auto counts = row_counts.to(at::kLong).contiguous();
  bool shared = slots.size(0) == 1;  // every row reads a prefix of one list
  TORCH_CHECK((shared || slots.size(0) == n) && counts.numel() == n, "one key list per row, or one for all rows");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* cn = counts.data_ptr<int64_t>();
  int64_t slots_total = k_cache.size(0), row_stride = shared ? 0 : width;
  int64_t most = 0;
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(cn[r] >= 1 && cn[r] <= width, "each row needs 1..width keys");
    most = std::max(most, cn[r]);
  }
  for (int64_t r = 0; r < (shared ? 1 : n); ++r)  // the slots the rows read
    for (int64_t j = 0; j < (shared ? most : cn[r]); ++j)
      TORCH_CHECK(sl[r * width + j] >= 0 && sl[r * width + j] < slots_total, "key slot out of range");
  auto out = torch::empty({n, h, d}, q.options().dtype(out_dtype));
  const float* qp = q.data_ptr<float>();
  int64_t group = h / hkv;
  float sc = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, out_dtype, "attend_rows", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    with_cache_type(k_cache, v_cache, [&](auto* kc, auto* vc) {
#ifdef EAGLEGATE_HEAD_VEC
      if (d == 64 || d == 128) {  // one item per (row, KV head): its query heads share each key and value load
        at::parallel_for(0, n * hkv, 1, [&](int64_t b, int64_t e) {
          std::vector<float> p(4 * width);
          std::vector<float> acc(group * d);
          for (int64_t item = b; item < e; ++item) {
            int64_t r = item / hkv, kvh = item % hkv, first = (r * h + kvh * group) * d;
            auto group_of = d == 64 ? attend_group<64, std::remove_pointer_t<decltype(kc)>>
                                    : attend_group<128, std::remove_pointer_t<decltype(kc)>>;
            group_of(qp + first, kc + kvh * d, vc + kvh * d, hkv * d, sl + r * row_stride, cn[r], width, sc, p.data(),
                     acc.data(), static_cast<int>(group));
            for (int64_t i = 0; i < group * d; ++i) op[first + i] = from_f<scalar_t>(acc[i]);
          }
        });
        return;
      }
#endif
      at::parallel_for(0, n * h, 1, [&](int64_t b, int64_t e) {
        std::vector<float> p(width);
        std::vector<float> acc(d);
        for (int64_t item = b; item < e; ++item) {
          int64_t r = item / h, j = item % h, kvh = j / group, len = cn[r];
          const float* qr = qp + item * d;
          const int64_t* rs = sl + r * row_stride;
          for (int64_t t = 0; t < len; ++t) p[t] = dot(qr, kc + (rs[t] * hkv + kvh) * d, d) * sc;
          float m = p[0];
          for (int64_t t = 1; t < len; ++t) m = p[t] > m ? p[t] : m;
          for (int64_t t = 0; t < len; ++t) p[t] = exp_approx(p[t] - m);
          float total = lane_sum(p.data(), len);
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (int64_t t = 0; t < len; ++t) {
            const auto* vr = vc + (rs[t] * hkv + kvh) * d;
            float pt = p[t];
            for (int64_t i = 0; i < d; ++i) acc[i] += pt * to_f(vr[i]);
          }
          float inv = 1.0f / total;
          for (int64_t i = 0; i < d; ++i) op[item * d + i] = from_f<scalar_t>(acc[i] * inv);
        }
      });
    });
  });
  return out;
}

// Groupwise-quantized linear, y[M, N] = x[M, K] W^T, with w = q * scale + offset per group of 32 inputs. The layout
// puts 16 outputs in the 16 lanes of a register: per block of 16 outputs and group of 32 inputs, the codes of each
// pair of inputs (k, k+1) for the 16 outputs are 32 values in lane order (lane i holds output i's pair), and scale and
// offset are 16 float16 each (GGUF's own scale type). 4 bits: 256 bytes per block and group, bytes [32p, 32p + 32)
// hold pair 2p in their low nibbles and pair 2p + 1 in their high ones; 8 bits: 512 int8, pair t at [32t, 32t + 32).
// The codes become exact bfloat16 in registers and one AVX512-BF16 dot product takes a pair for 16 outputs (32
// products, exact in float32) per row, so a verify row costs 1/32 of an instruction per weight where torch's int4
// kernel dequantizes per row.
// Each row's sums run in one fixed order whatever rows run beside it, so a token verified in a tree gets the bits it
// gets when decoded alone.
constexpr int QGROUP = 32;
constexpr int QBLOCK = 16;  // outputs per block, one per lane
// Rows whose accumulators stay in registers together (24 of the 32), so a block's codes are widened once for up to
// 8 rows: a 5-row verify's linears cost 5.6 ms as one chunk against 6.3 ms as 3 + 2 rows (measured on CPUs without
// AMX). Past 4 rows the dot products bound the step (one per cycle), so 8 rows gain little more.
constexpr int QROWS = 8;
constexpr int64_t QTILE = 8;  // blocks of weights (128 outputs) that every row chunk passes over in turn

inline int qcode(const uint8_t* blk, int bits, int i, int k) {  // code of output lane i, input k of a block-group
  int pair = k / 2, half = k % 2;
  if (bits == 8) return static_cast<int8_t>(blk[pair * 32 + i * 2 + half]);
  uint8_t b = blk[(pair / 2) * 32 + i * 2 + half];
  return pair % 2 ? b >> 4 : b & 15;
}

// Reference path (the REFERENCE variant, for tests): the bf16 layout's sums in float32, one lane at a time.
void qlinear_generic(const float* x, const float* xsum, int64_t m, int64_t k, const uint8_t* codes, const at::Half* sz,
                     int bits, int64_t b0, int64_t b1, float* y, int64_t n) {
  const int64_t groups = k / QGROUP, gbytes = QGROUP * QBLOCK * bits / 8;
  for (int64_t blk = b0; blk < b1; ++blk)
    for (int64_t r = 0; r < m; ++r)
      for (int i = 0; i < QBLOCK && blk * QBLOCK + i < n; ++i) {
        float acc = 0.0f;
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* c = codes + (blk * groups + g) * gbytes;
          const at::Half* s = sz + (blk * groups + g) * 2 * QBLOCK;
          const float* xg = x + r * k + g * QGROUP;
          float part = 0.0f;
          for (int j = 0; j < QGROUP; ++j) part += static_cast<float>(qcode(c, bits, i, j)) * xg[j];
          acc = std::fma(part, static_cast<float>(s[i]), acc);
          acc = std::fma(static_cast<float>(s[QBLOCK + i]), xsum[r * groups + g], acc);
        }
        y[r * n + blk * QBLOCK + i] = acc;
      }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// bfloat16 of the 4-bit codes 0..15, twice: bf16_pairs' lookup table
inline __m512i code_lut() {
  return _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0,
                          0x4080, 0x4040, 0x4000, 0x3f80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120,
                          0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);
}

// The bfloat16 codes of input pairs 2p and 2p + 1 (4 bits) or pairs 2p, 2p + 1 (8 bits) for one block's 16 lanes.
template <int BITS>
inline void bf16_pairs(const uint8_t* c, int p, __m512i lut, __m512i& a, __m512i& b) {
  if constexpr (BITS == 4) {
    __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + p * 32)));
    a = _mm512_permutexvar_epi16(bytes, lut);  // the index is a word's low 5 bits; lut[i] = bf16(i & 15)
    b = _mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), lut);
  } else {
    auto pair = [&](const uint8_t* q) {
      __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
      __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
      return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // exact: |q| <= 128
    };
    a = pair(c + p * 64);
    b = pair(c + p * 64 + 32);
  }
}

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

inline int32_t input_pair(const c10::BFloat16* x) {  // inputs x[0], x[1] as one 32-bit word (x[0] in the low half)
  int32_t w;
  std::memcpy(&w, x, sizeof w);
  return w;
}

// Rows r0.. r0 + R of one block of 16 outputs: per group, two dot-product chains per row (the pairs 4p, 4p + 1 and
// 4p + 2, 4p + 3), then the group's scale and offset (more chains, or two blocks at once, measure slower).
template <int BITS, int R>
inline void qlinear_block(const c10::BFloat16* x, const float* xsum, int64_t k, const uint8_t* codes,
                          const at::Half* sz, int64_t blk, float* y, int64_t n, __m512i lut) {
  const int64_t groups = k / QGROUP, gbytes = QGROUP * QBLOCK * BITS / 8;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = codes + (blk * groups + g) * gbytes;
    __m512 ca[R], cb[R];
    for (int r = 0; r < R; ++r) ca[r] = cb[r] = _mm512_setzero_ps();
    for (int p = 0; p < QGROUP / 4; ++p) {
      __m512i a, b;
      bf16_pairs<BITS>(c, p, lut, a, b);
      for (int r = 0; r < R; ++r) {
        const c10::BFloat16* xr = x + r * k + g * QGROUP + 4 * p;
        ca[r] = _mm512_dpbf16_ps(ca[r], as_bh(a), as_bh(_mm512_set1_epi32(input_pair(xr))));
        cb[r] = _mm512_dpbf16_ps(cb[r], as_bh(b), as_bh(_mm512_set1_epi32(input_pair(xr + 2))));
      }
    }
    const at::Half* s = sz + (blk * groups + g) * 2 * QBLOCK;
    __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
    __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + QBLOCK)));
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_add_ps(ca[r], cb[r]), scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum[r * groups + g]), acc[r]);
    }
  }
  int64_t left = n - blk * QBLOCK;
  __mmask16 mask = left >= QBLOCK ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * n + blk * QBLOCK, mask, acc[r]);
}

template <int BITS, int R>
void qlinear_rows(const c10::BFloat16* x, const float* xsum, int64_t k, const uint8_t* codes, const at::Half* sz,
                  int64_t b0, int64_t b1, float* y, int64_t n) {
  const __m512i lut = code_lut();
  for (int64_t blk = b0; blk < b1; ++blk) qlinear_block<BITS, R>(x, xsum, k, codes, sz, blk, y, n, lut);
}

template <int BITS>
void qlinear_avx512(const c10::BFloat16* x, const float* xsum, int64_t m, int64_t k, const uint8_t* codes,
                    const at::Half* sz, int64_t b0, int64_t b1, float* y, int64_t n) {
  const int64_t groups = k / QGROUP;
  for (int64_t t0 = b0; t0 < b1; t0 += QTILE) {  // all row chunks pass over a tile while it is in cache
    int64_t t1 = std::min(b1, t0 + QTILE);
    int64_t chunks = (m + QROWS - 1) / QROWS;
    for (int64_t r0 = 0, rows; r0 < m; r0 += rows, --chunks) {
      rows = (m - r0 + chunks - 1) / chunks;  // even chunks: 9 rows run as 5 + 4, not 8 + 1
      const c10::BFloat16* xr = x + r0 * k;
      const float* sr = xsum + r0 * groups;
      float* yr = y + r0 * n;
      switch (rows) {
        case 1:
          qlinear_rows<BITS, 1>(xr, sr, k, codes, sz, t0, t1, yr, n);
          break;
        case 2:
          qlinear_rows<BITS, 2>(xr, sr, k, codes, sz, t0, t1, yr, n);
          break;
        case 3:
          qlinear_rows<BITS, 3>(xr, sr, k, codes, sz, t0, t1, yr, n);
          break;
        case 4:
          qlinear_rows<BITS, 4>(xr, sr, k, codes, sz, t0, t1, yr, n);
          break;
        case 5:
          qlinear_rows<BITS, 5>(xr, sr, k, codes, sz, t0, t1, yr, n);
          break;
        case 6:
          qlinear_rows<BITS, 6>(xr, sr, k, codes, sz, t0, t1, yr, n);
          break;
        case 7:
          qlinear_rows<BITS, 7>(xr, sr, k, codes, sz, t0, t1, yr, n);
          break;
        default:
          qlinear_rows<BITS, 8>(xr, sr, k, codes, sz, t0, t1, yr, n);
          break;
      }
    }
  }
}
#endif

bool g_use_amx = true;  // benchmarks and tests turn the tiles off to compare the two paths (a no-op without them)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define EAGLEGATE_AMX 1
// AMX: the tile unit takes a block-group (16 outputs x 32 inputs, one tile of input pairs) for up to 16 rows in one
// TDPBF16PS, so a verify of several rows costs little more than one decode row, where the dot-product path pays per
// row (on a CPU with AMX, the 120 int4 linears of a SmolLM2 step: 1 row 5.3 ms against 6.5, 4 rows 6.0 against
// 11.5, 16 rows 8.3 against 26.9; bench/results/kernels.json). The codes are widened to bfloat16 into a 1 KiB tile
// buffer (the same exact values); each group's sums are stored and scaled as in the vector path. Where the CPU has
// tiles every row count takes them: the tile unit's sums agree with VDPBF16PS's on all but a few outputs in a
// thousand (an ulp), so mixing the two paths by row count would let a verified row differ from the row decoded
// alone; within one path a row's bits never depend on the rows beside it.
bool amx_ready() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;  // the kernel hands out tile state on request
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// One group's sums for the tile's rows: tile TC = rows of x (tile TA) times a group's widened codes (tile TB). A macro:
// GCC's tile intrinsics take the tile numbers as literal register names.
#define AMX_GROUP_SUMS(TC, TA, TB, x, stride, weights, sums) \
  do {                                                       \
    _tile_zero(TC);                                          \
    _tile_loadd(TA, x, stride);                              \
    _tile_loadd(TB, weights, 64);                            \
    _tile_dpbf16ps(TC, TA, TB);                              \
    _tile_stored(TC, sums, 64);                              \
  } while (0)

template <int BITS>
void qlinear_amx(const c10::BFloat16* x, const float* xsum, int64_t m, int64_t k, const uint8_t* codes,
                 const at::Half* sz, int64_t b0, int64_t b1, float* y, int64_t n) {
  const int64_t groups = k / QGROUP, gbytes = QGROUP * QBLOCK * BITS / 8, stride = k * sizeof(c10::BFloat16);
  const __m512i lut = code_lut();
  // two groups in flight (tiles 0-2 and 3-5, a buffer each), so one group's tile work overlaps the other's
  alignas(64) __m512i wtile[2][QGROUP / 2];  // 16 input pairs x 16 outputs, bfloat16
  alignas(64) float sums[2][16 * QBLOCK];
  for (int64_t r0 = 0; r0 < m; r0 += 16) {
    const int rows = static_cast<int>(std::min<int64_t>(16, m - r0));
    TileConfig cfg;
    for (int t = 0; t < 6; ++t) {  // 0, 3: sums [rows, 16] float32; 1, 4: inputs [rows, 32] bfloat16; 2, 5: weights
      cfg.colsb[t] = 64;
      cfg.rows[t] = t % 3 == 2 ? QGROUP / 2 : rows;
    }
    _tile_loadconfig(&cfg);
    const c10::BFloat16* xr = x + r0 * k;
    for (int64_t blk = b0; blk < b1; ++blk) {
      __m512 acc[16];
      for (int r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
      auto add_group = [&](int64_t g, const float* gsums) {
        const at::Half* s = sz + (blk * groups + g) * 2 * QBLOCK;
        __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
        __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + QBLOCK)));
        for (int r = 0; r < rows; ++r) {
          acc[r] = _mm512_fmadd_ps(_mm512_load_ps(gsums + r * QBLOCK), scale, acc[r]);
          acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum[(r0 + r) * groups + g]), acc[r]);
        }
      };
      for (int64_t g = 0; g < groups; g += 2) {
        const bool two = g + 1 < groups;
        for (int h = 0; h < 1 + two; ++h) {
          const uint8_t* c = codes + (blk * groups + g + h) * gbytes;
          for (int p = 0; p < QGROUP / 4; ++p) bf16_pairs<BITS>(c, p, lut, wtile[h][2 * p], wtile[h][2 * p + 1]);
        }
        AMX_GROUP_SUMS(0, 1, 2, xr + g * QGROUP, stride, wtile[0], sums[0]);
        if (two) AMX_GROUP_SUMS(3, 4, 5, xr + (g + 1) * QGROUP, stride, wtile[1], sums[1]);
        add_group(g, sums[0]);
        if (two) add_group(g + 1, sums[1]);
      }
      int64_t left = n - blk * QBLOCK;
      __mmask16 mask = left >= QBLOCK ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
      for (int r = 0; r < rows; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * n + blk * QBLOCK, mask, acc[r]);
    }
  }
  _tile_release();
}
#endif

// The ways qlinear multiplies, each with its own weight layout (quant.py packs for one): `DOT_BF16` bfloat16
// activations by AVX512-BF16 dot products (AMX tiles where the CPU has them), `INT8ACT` 8-bit activations by integer
// dot products (qlinear_int8act.h), `REFERENCE` the bfloat16 layout's sums in portable float32 (tests run it).
enum QVariant : int64_t { DOT_BF16 = 0, INT8ACT = 1, REFERENCE = 2 };

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kDotBf16 = true;
#else
constexpr bool kDotBf16 = false;
#endif

// 8-bit activations by integer dot products: quantize each row (its own scales), then the blocks in parallel.
void qlinear_int8act(const torch::Tensor& x, int64_t k, const uint8_t* cp, const at::Half* sp, int64_t bits,
                     int64_t blocks, float* yp, int64_t n) {
#if defined(EAGLEGATE_INT8ACT_VNNI) || defined(EAGLEGATE_INT8ACT_AVX2)
  const int64_t m = x.size(0), groups = k / QGROUP;
  // the quantized rows live in this thread's buffers: a decode step's 120 linears would each pay three allocations
  thread_local std::vector<int8_t> a;
  thread_local std::vector<float> d;
  thread_local std::vector<int32_t> asum;
  a.resize(m * k);
  d.resize(m * groups);
  asum.resize(m * groups);
  int8_t* ap = a.data();
  float* dp = d.data();
  int32_t* qp = asum.data();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "qlinear_int8act", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, m, ROW_GRAIN, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        int8act::quantize_row(xp + r * k, k, ap + r * k, dp + r * groups, qp + r * groups,
                              [](scalar_t v) { return to_f(v); });
    });
  });
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    if (bits == 4)
      int8act::blocks<4>(ap, dp, qp, m, k, cp, sp, b0, b1, yp, n);
    else
      int8act::blocks<8>(ap, dp, qp, m, k, cp, sp, b0, b1, yp, n);
  });
#else
  TORCH_CHECK(false, "qlinear's 8-bit activation path needs AVX2 (or AVX512-VNNI), not in this build");
#endif
}

// x [M, K] bfloat16 or float32 -> [M, out_features] in x's dtype. codes and scale_offset as packed by
// worker/kernels/quant.py for `variant` (blocks of 16 outputs, zero-padded).
torch::Tensor qlinear(torch::Tensor x, torch::Tensor codes, torch::Tensor scale_offset, int64_t bits,
                      int64_t out_features, int64_t variant) {
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in_features]");
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu() && scale_offset.device().is_cpu(),
              "qlinear runs on CPU tensors");
  TORCH_CHECK(bits == 4 || bits == 8, "codes are 4 or 8 bits");
  TORCH_CHECK(variant == DOT_BF16 || variant == INT8ACT || variant == REFERENCE, "unknown qlinear variant ", variant);
  TORCH_CHECK(scale_offset.scalar_type() == at::kHalf && scale_offset.is_contiguous() && scale_offset.dim() == 4 &&
                  scale_offset.size(2) == 2 && scale_offset.size(3) == QBLOCK,
              "scale_offset must be contiguous float16 [blocks, groups, 2, 16]");
  int64_t m = x.size(0), k = x.size(1), blocks = scale_offset.size(0), groups = scale_offset.size(1);
  TORCH_CHECK(k == groups * QGROUP, "in_features ", k, " is not groups x 32 = ", groups * QGROUP);
  TORCH_CHECK(out_features > (blocks - 1) * QBLOCK && out_features <= blocks * QBLOCK, "out_features ", out_features,
              " does not fit ", blocks, " blocks of 16");
  TORCH_CHECK((codes.scalar_type() == at::kByte || codes.scalar_type() == at::kChar) && codes.is_contiguous() &&
                  codes.numel() == blocks * QBLOCK * k * bits / 8,
              "codes must be contiguous bytes, blocks x 16 x in_features x bits / 8");
  auto xc = x.contiguous();
  auto fopts = xc.options().dtype(at::kFloat);
  auto y = torch::empty({m, out_features}, fopts);
  const uint8_t* cp = static_cast<const uint8_t*>(codes.data_ptr());
  const at::Half* sp = scale_offset.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  if (variant == INT8ACT) {
    qlinear_int8act(xc, k, cp, sp, bits, blocks, yp, out_features);
    return y.to(x.scalar_type());
  }
  TORCH_CHECK(variant == REFERENCE || (kDotBf16 && xc.scalar_type() == at::kBFloat16),
              "qlinear's bfloat16 dot-product path needs bfloat16 activations and AVX512-BF16, not in this build");
  // each row's group sums, for the offsets, in one fixed order (a row's bits must not depend on m)
  auto xsum = torch::empty({m, groups}, fopts);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, xc.scalar_type(), "qlinear_xsum", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    float* sp = xsum.data_ptr<float>();
    for (int64_t i = 0; i < m * groups; ++i) {
      float total = 0.0f;
      for (int j = 0; j < QGROUP; ++j) total += to_f(xp[i * QGROUP + j]);
      sp[i] = total;
    }
  });
  const float* xsp = xsum.data_ptr<float>();
  const bool fast = variant == DOT_BF16;
  auto xf = fast ? xc : xc.to(at::kFloat);  // the portable path reads float32
#ifdef EAGLEGATE_AMX
  const bool amx = fast && g_use_amx && amx_ready();
#endif
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (fast) {
      const c10::BFloat16* xp = xc.data_ptr<c10::BFloat16>();
#ifdef EAGLEGATE_AMX
      if (amx) {
        if (bits == 4)
          qlinear_amx<4>(xp, xsp, m, k, cp, sp, b0, b1, yp, out_features);
        else
          qlinear_amx<8>(xp, xsp, m, k, cp, sp, b0, b1, yp, out_features);
        return;
      }
#endif
      if (bits == 4)
        qlinear_avx512<4>(xp, xsp, m, k, cp, sp, b0, b1, yp, out_features);
      else
        qlinear_avx512<8>(xp, xsp, m, k, cp, sp, b0, b1, yp, out_features);
      return;
    }
#endif
    qlinear_generic(xf.data_ptr<float>(), xsp, m, k, cp, sp, static_cast<int>(bits), b0, b1, yp, out_features);
  });
  return y.to(x.scalar_type());
}

// Whether qlinear runs on AMX tiles here (built for this CPU and granted by the kernel).
bool qlinear_amx_usable() {
#ifdef EAGLEGATE_AMX
  return amx_ready();
#else
  return false;
#endif
}

// The instruction set each serving variant of qlinear runs on in this build, "" where it is not built; the CPU's
// own features decide what `-march=native` builds (worker/kernels/cpu_choice.py names what is missing).
std::map<std::string, std::string> qlinear_isa() {
  std::string bf16 = kDotBf16 ? (qlinear_amx_usable() ? "amx_bf16" : "avx512_bf16") : "";
  return {{"bf16", bf16}, {"int8act", EAGLEGATE_INT8ACT_ISA}};
}

// One decoder layer of a decode or verify step, the ops above called in the order (and with the views) the
// Python layer calls them, so the bits are the same; what it saves is the ~40 us of Python and dispatch around
// them per layer (a sixth of a one-row step). Single-rank only: with tensor parallelism an all-reduce sits between.
struct QWeight {
  torch::Tensor codes, scale_offset;
  int64_t bits, out_features, variant;
  torch::Tensor operator()(const torch::Tensor& x) const {
    return qlinear(x, codes, scale_offset, bits, out_features, variant);
  }
};

struct LayerWeights {
  torch::Tensor input_norm, post_norm;
  double eps;
  QWeight qkv, o, gate_up, down;
  int64_t heads, kv_heads, head_dim;
  double scale;
};

// The layer after its input norm: h is the attention's input, x the residual stream it adds to (the same tensor
// normed in a Llama layer; in EAGLE-3's draft layer, the fused feature while h is [norm(embedding) ; norm(feature)]).
torch::Tensor layer_after_norm(const LayerWeights& w, torch::Tensor x, torch::Tensor h, torch::Tensor cos,
                               torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor slot_mapping, torch::Tensor row_slots, torch::Tensor row_counts) {
  int64_t n = x.size(0), d = w.head_dim, qs = w.heads * d, kvs = w.kv_heads * d;
  auto qkv = w.qkv(h);
  auto q =
      rope_write_cache(qkv.narrow(1, 0, qs).view({n, w.heads, d}), qkv.narrow(1, qs, kvs).view({n, w.kv_heads, d}),
                       qkv.narrow(1, qs + kvs, kvs).view({n, w.kv_heads, d}), cos, sin, k_cache, v_cache, slot_mapping);
  auto att = attend_rows(q, k_cache, v_cache, row_slots, row_counts, w.scale, x.scalar_type());
  auto normed = add_rms_norm(x, w.o(att.reshape({n, qs})), w.post_norm, w.eps);
  return normed[0] + w.down(silu_mul(w.gate_up(normed[1])));
}

torch::Tensor decoder_layer(const LayerWeights& w, torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping,
                            torch::Tensor row_slots, torch::Tensor row_counts) {
  return layer_after_norm(w, x, rms_norm(x, w.input_norm, w.eps), cos, sin, k_cache, v_cache, slot_mapping, row_slots,
                          row_counts);
}

// Every layer of a decode or verify step in one call: the same decoder_layer calls in the same order, so the bits are
// the per-layer loop's; only the Python dispatch between layers (about 13 us a layer) is gone. Returns the last
// layer's output and the residual stream after each layer in `aux_layers` (EAGLE-3's features), in layer order.
std::vector<torch::Tensor> decoder_stack(const std::vector<LayerWeights>& layers, torch::Tensor x, torch::Tensor cos,
                                         torch::Tensor sin, const std::vector<torch::Tensor>& k_caches,
                                         const std::vector<torch::Tensor>& v_caches, torch::Tensor slot_mapping,
                                         torch::Tensor row_slots, torch::Tensor row_counts,
                                         const std::vector<int64_t>& aux_layers) {
  TORCH_CHECK(k_caches.size() == layers.size() && v_caches.size() == layers.size(), "one K and V cache per layer");
  std::vector<torch::Tensor> out{x};
  for (size_t i = 0; i < layers.size(); ++i) {
    out[0] = decoder_layer(layers[i], out[0], cos, sin, k_caches[i], v_caches[i], slot_mapping, row_slots, row_counts);
    if (std::find(aux_layers.begin(), aux_layers.end(), static_cast<int64_t>(i)) != aux_layers.end())
      out.push_back(out[0]);
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<QWeight>(m, "QWeight")
      .def(pybind11::init<torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t>());
  pybind11::class_<LayerWeights>(m, "LayerWeights")
      .def(pybind11::init<torch::Tensor, torch::Tensor, double, QWeight, QWeight, QWeight, QWeight, int64_t, int64_t,
                          int64_t, double>());
  m.def("decoder_layer", &decoder_layer);
  m.def("decoder_stack", &decoder_stack);
  m.def("layer_after_norm", &layer_after_norm);
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("rope_write_cache", &rope_write_cache);
  m.def("attend_rows", &attend_rows);
  m.def("qlinear", &qlinear);
  m.def("qlinear_isa", &qlinear_isa);
  m.def("qlinear_amx", &qlinear_amx_usable);
  m.def("set_qlinear_amx", [](bool on) { g_use_amx = on; });
}
