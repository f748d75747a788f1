#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
// A prototype for bench/vnni.py, not a serving kernel: groupwise int4 weights times int8 activations through
// AVX512-VNNI (VPDPBUSD: 64 products an instruction, where the shipped qlinear's VPDPBF16PS takes 32). It asks what a
// verify row would cost if each row's activations were quantized to int8 per group of 32 (llama.cpp's Q4_0 x Q8_0).
//
// Layout: per block of 16 outputs and group of 32 inputs, 4 x 64 bytes; in register u, lane i's 4 bytes hold output
// i's codes for inputs 8u..8u+3 (low nibbles) and 8u+4..8u+7 (high nibbles), so one AND or shift-and-AND gives the
// unsigned 4-input words VPDPBUSD multiplies into a row's broadcast int8 quad. scale_offset is qlinear's ([blocks,
// groups, 2, 16] float16). xq [m, k] int8, xd [m, groups] float32 (each group's activation scale), xs [m, groups]
// float32 (each group's activation sum, for the offsets). Each row's sums run in one fixed order whatever rows run
// beside it, as in qlinear.
template <int R>
void block_rows(const int8_t* xq, const float* xd, const float* xs, int64_t k, const uint8_t* codes, const at::Half* sz,
                int64_t blk, float* y, int64_t n) {
  const int64_t groups = k / 32;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i mask = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = codes + (blk * groups + g) * 256;
    __m512i q[8];
    for (int u = 0; u < 4; ++u) {
      __m512i v = _mm512_loadu_si512(c + 64 * u);
      q[2 * u] = _mm512_and_si512(v, mask);
      q[2 * u + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
    }
    const at::Half* s = sz + (blk * groups + g) * 32;
    __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
    __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16)));
    for (int r = 0; r < R; ++r) {
      const int32_t* xr = reinterpret_cast<const int32_t*>(xq + r * k + g * 32);
      __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
      for (int t = 0; t < 8; t += 2) {
        a = _mm512_dpbusd_epi32(a, q[t], _mm512_set1_epi32(xr[t]));
        b = _mm512_dpbusd_epi32(b, q[t + 1], _mm512_set1_epi32(xr[t + 1]));
      }
      __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(a, b));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(scale, _mm512_set1_ps(xd[r * groups + g])), acc[r]);
      acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xs[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * n + blk * 16, acc[r]);
}
torch::Tensor qlinear_vnni(torch::Tensor xq, torch::Tensor xd, torch::Tensor xs, torch::Tensor codes, torch::Tensor sz, int64_t n) {
  int64_t m = xq.size(0), k = xq.size(1), blocks = n / 16;
  auto y = torch::empty({m, n}, torch::dtype(torch::kFloat));
  const int8_t* xp = xq.data_ptr<int8_t>(); const float* dp = xd.data_ptr<float>(); const float* sp = xs.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>(); const at::Half* zp = sz.data_ptr<at::Half>(); float* yp = y.data_ptr<float>();
  int64_t groups = k / 32;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t t0 = b0; t0 < b1; t0 += 8) {
      int64_t t1 = std::min(b1, t0 + 8);
      for (int64_t r0 = 0; r0 < m; r0 += 8) {
        int64_t rows = std::min<int64_t>(8, m - r0);
        for (int64_t blk = t0; blk < t1; ++blk) {
          const int8_t* x = xp + r0 * k; const float* d = dp + r0 * groups; const float* s = sp + r0 * groups; float* yy = yp + r0 * n;
          switch (rows) {
            case 1: block_rows<1>(x, d, s, k, cp, zp, blk, yy, n); break;
            case 2: block_rows<2>(x, d, s, k, cp, zp, blk, yy, n); break;
            case 3: block_rows<3>(x, d, s, k, cp, zp, blk, yy, n); break;
            case 4: block_rows<4>(x, d, s, k, cp, zp, blk, yy, n); break;
            case 5: block_rows<5>(x, d, s, k, cp, zp, blk, yy, n); break;
            case 6: block_rows<6>(x, d, s, k, cp, zp, blk, yy, n); break;
            case 7: block_rows<7>(x, d, s, k, cp, zp, blk, yy, n); break;
            default: block_rows<8>(x, d, s, k, cp, zp, blk, yy, n); break;
          }
        }
      }
    }
  });
  return y;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("qlinear_vnni", &qlinear_vnni); }
