// Fused CPU kernels for the small per-layer ops of a decode or verify step (norms, rotary + cache write, row-wise
// attention, SiLU gate). In eager torch each of these is 3-15 tiny kernels of a few microseconds; here each is one
// pass over data already in cache. Every row is computed by one thread in a fixed order, so a row's bits never depend
// on how many rows run with it: a token verified in an EAGLE tree gets the bits it gets when decoded alone.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <cstring>
#include <vector>

namespace {

constexpr int LANES = 16;  // partial sums kept in 16 lanes: the compiler vectorises the loop, the order stays fixed

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
inline T from_f(float v) { return static_cast<T>(v); }
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

inline float dot(const float* a, const float* b, int64_t n) {
  float acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int j = 0; j < LANES; ++j) acc[j] += a[i + j] * b[i + j];
  for (; i < n; ++i) acc[0] += a[i] * b[i];
  return reduce_lanes(acc);
}

template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t c, float eps) {
  float inv = 1.0f / std::sqrt(sum_squares(x, c) / static_cast<float>(c) + eps);
  for (int64_t i = 0; i < c; ++i)
    out[i] = from_f<T>(to_f(x[i]) * inv * to_f(w[i]));
}

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be [rows, features] with contiguous features");
}

#ifdef __AVX512F__
// Head size 64 with AVX-512: a key or value row is four registers, the accumulator stays in registers, and each dot
// product is reduced by one fixed shuffle sequence.
inline void attend_head64(const float* q, const float* k0, const float* v0, int64_t stride, const int64_t* slots,
                          int64_t len, float scale, float* p, float* out) {
  __m512 q0 = _mm512_loadu_ps(q), q1 = _mm512_loadu_ps(q + 16), q2 = _mm512_loadu_ps(q + 32),
         q3 = _mm512_loadu_ps(q + 48);
  for (int64_t t = 0; t < len; ++t) {
    const float* k = k0 + slots[t] * stride;
    __m512 a = _mm512_mul_ps(q0, _mm512_loadu_ps(k));
    __m512 b = _mm512_mul_ps(q1, _mm512_loadu_ps(k + 16));
    a = _mm512_fmadd_ps(q2, _mm512_loadu_ps(k + 32), a);
    b = _mm512_fmadd_ps(q3, _mm512_loadu_ps(k + 48), b);
    p[t] = _mm512_reduce_add_ps(_mm512_add_ps(a, b)) * scale;
  }
  float m = p[0];
  for (int64_t t = 1; t < len; ++t) m = p[t] > m ? p[t] : m;
  for (int64_t t = 0; t < len; ++t) p[t] = exp_approx(p[t] - m);
  float inv = 1.0f / lane_sum(p, len);
  __m512 o0 = _mm512_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
  for (int64_t t = 0; t < len; ++t) {
    const float* v = v0 + slots[t] * stride;
    __m512 pt = _mm512_set1_ps(p[t]);
    o0 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v), o0);
    o1 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + 16), o1);
    o2 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + 32), o2);
    o3 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + 48), o3);
  }
  __m512 s = _mm512_set1_ps(inv);
  _mm512_storeu_ps(out, _mm512_mul_ps(o0, s));
  _mm512_storeu_ps(out + 16, _mm512_mul_ps(o1, s));
  _mm512_storeu_ps(out + 32, _mm512_mul_ps(o2, s));
  _mm512_storeu_ps(out + 48, _mm512_mul_ps(o3, s));
}
#endif

}  // namespace

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
    at::parallel_for(0, x.size(0), 1, [&](int64_t b, int64_t e) {
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
    at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        scalar_t* s = sp + r * c;
        for (int64_t i = 0; i < c; ++i)
          s[i] = from_f<scalar_t>(to_f(xp[r * xs + i]) + to_f(dp[r * ds + i]));
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
    at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
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
// dims), then k and v written to the float32 caches [slots, Hkv, D] at slot_mapping. q, k, v: [N, heads, D] views
// with contiguous heads (slices of the fused QKV output). Returns the rotated q, [N, H, D] float32.
torch::Tensor rope_write_cache(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos,
                               torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor slot_mapping) {
  int64_t n = q.size(0), h = q.size(1), hkv = k.size(1), d = q.size(2), rot = cos.size(1), half = rot / 2;
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->stride(1) == d && t->scalar_type() == q.scalar_type(),
                "q, k, v must be [rows, heads, head_dim] with contiguous heads and one dtype");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(0) == n && sin.sizes() == cos.sizes() && rot <= d && rot % 2 == 0,
              "cos/sin must be contiguous float32 [rows, rot], rot even and at most head_dim");
  TORCH_CHECK(k.size(0) == n && v.size(0) == n && v.size(1) == hkv, "q, k, v row or head counts differ");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.size(1) == hkv && k_cache.size(2) == d,
              "caches must be contiguous float32 [slots, kv_heads, head_dim]");
  auto slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == n, "one slot per row");
  auto out = torch::empty({n, h, d}, q.options().dtype(at::kFloat));
  const int64_t* sl = slots.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
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
    at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const float* c = cp + r * rot;
        const float* s = sp + r * rot;
        for (int64_t j = 0; j < h; ++j) rotate(q.data_ptr<scalar_t>() + r * q.stride(0) + j * d, c, s, op + (r * h + j) * d);
        for (int64_t j = 0; j < hkv; ++j) {
          rotate(k.data_ptr<scalar_t>() + r * k.stride(0) + j * d, c, s, kc + (sl[r] * hkv + j) * d);
          const scalar_t* vr = v.data_ptr<scalar_t>() + r * v.stride(0) + j * d;
          float* vo = vc + (sl[r] * hkv + j) * d;
          for (int64_t i = 0; i < d; ++i) vo[i] = to_f(vr[i]);
        }
      }
    });
  });
  return out;
}

// Attention of each query row over exactly its own keys: q [N, H, D] float32, row_slots [N, Lr] (each row's cache
// slots in position order, the first row_counts[r] real). One thread computes a whole (row, head), in the
// same order whatever runs beside it, so the result depends only on that row's keys. Returns [N, H, D] in out_dtype.
torch::Tensor attend_rows(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor row_slots,
                          torch::Tensor row_counts, double scale, at::ScalarType out_dtype) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 3, "q must be contiguous float32");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat && k_cache.dim() == 3 &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes(),
              "caches must be contiguous float32 [slots, kv_heads, head_dim] of one shape");
  TORCH_CHECK(row_slots.dim() == 2, "row_slots must be [rows, width]");
  int64_t n = q.size(0), h = q.size(1), d = q.size(2), hkv = k_cache.size(1), width = row_slots.size(1);
  TORCH_CHECK(h % hkv == 0 && k_cache.size(2) == d, "head layout mismatch");
  auto slots = row_slots.to(at::kLong).contiguous();
  auto counts = row_counts.to(at::kLong).contiguous();
  TORCH_CHECK(slots.size(0) == n && counts.numel() == n, "one key list per row");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* cn = counts.data_ptr<int64_t>();
  int64_t slots_total = k_cache.size(0);
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(cn[r] >= 1 && cn[r] <= width, "each row needs 1..width keys");
    for (int64_t j = 0; j < cn[r]; ++j) TORCH_CHECK(sl[r * width + j] >= 0 && sl[r * width + j] < slots_total,
                                                    "key slot out of range");
  }
  auto out = torch::empty({n, h, d}, q.options().dtype(out_dtype));
  const float* qp = q.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  int64_t group = h / hkv;
  float sc = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, out_dtype, "attend_rows", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, n * h, 1, [&](int64_t b, int64_t e) {
      std::vector<float> p(width);
      std::vector<float> acc(d);
      for (int64_t item = b; item < e; ++item) {
        int64_t r = item / h, j = item % h, kvh = j / group, len = cn[r];
        const float* qr = qp + item * d;
        const int64_t* rs = sl + r * width;
#ifdef __AVX512F__
        if (d == 64) {
          attend_head64(qr, kc + kvh * d, vc + kvh * d, hkv * d, rs, len, sc, p.data(), acc.data());
          for (int64_t i = 0; i < d; ++i) op[item * d + i] = from_f<scalar_t>(acc[i]);
          continue;
        }
#endif
        for (int64_t t = 0; t < len; ++t) p[t] = dot(qr, kc + (rs[t] * hkv + kvh) * d, d) * sc;
        float m = p[0];
        for (int64_t t = 1; t < len; ++t) m = p[t] > m ? p[t] : m;
        for (int64_t t = 0; t < len; ++t) p[t] = exp_approx(p[t] - m);
        float total = lane_sum(p.data(), len);
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t t = 0; t < len; ++t) {
          const float* vr = vc + (rs[t] * hkv + kvh) * d;
          float pt = p[t];
          for (int64_t i = 0; i < d; ++i) acc[i] += pt * vr[i];
        }
        float inv = 1.0f / total;
        for (int64_t i = 0; i < d; ++i) op[item * d + i] = from_f<scalar_t>(acc[i] * inv);
      }
    });
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("rope_write_cache", &rope_write_cache);
  m.def("attend_rows", &attend_rows);
}
