// qlinear with 8-bit activations, for CPUs without AVX512-BF16: integer dot products on AVX512-VNNI (vpdpbusd) or
// AVX2 (vpmaddubsw), as llama.cpp multiplies its 4- and 8-bit blocks. Included by cpu_kernels.cpp.
//
// Activations: each row's groups of 32 inputs as llama.cpp's Q8_0, d = max|x| / 127 and a = round(x * 127 / max|x|)
// in -127..127, with the group's sum of a. Each row has its own scales, so a row's bits never depend on the rows
// beside it and a token verified in an EAGLE tree gets the bits it gets when decoded alone.
//
// Weights (quant.pack_int8act): per block of 16 outputs and group of 32 inputs, 4 bits: four 64-byte vectors; byte
// 4i + j of vector v holds output i's codes of inputs 8v + j (low nibble) and 8v + 4 + j (high nibble). 8 bits: eight
// 64-byte vectors; byte 4i + j of vector v is output i's signed code of input 4v + j. So a 32-bit lane is one output's
// four inputs, which is how the integer dot products take them, and a broadcast of four activation bytes feeds all
// 16 outputs. Worked example, 4 bits: vector 1, byte 4 * 3 + 2 = 14, holds output 3's codes of inputs 10 and 14.
//
// Per group and row the integer sum S = sum(q * a) is exact on every path (bounds at each use), and the output
// gains   S * (scale * d) + offset * (d * sum(a))   (w = q * scale + offset) by the same two float32 fused
// multiply-adds per lane on every path: the AVX512-VNNI and AVX2 builds give the same bits.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace int8act {

constexpr int GROUP = 32;
constexpr int BLOCK = 16;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define EAGLEGATE_INT8ACT_ISA "avx512_vnni"
#define EAGLEGATE_INT8ACT_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define EAGLEGATE_INT8ACT_ISA "avx2"
#define EAGLEGATE_INT8ACT_AVX2 1
#else
#define EAGLEGATE_INT8ACT_ISA ""
#endif

// Row r's groups of 32 inputs as 8-bit codes `a`, scales `d` and code sums `asum` (see the top of the file).
template <typename T, typename ToFloat>
inline void quantize_row(const T* x, int64_t k, int8_t* a, float* d, int32_t* asum, ToFloat to_f) {
  for (int64_t g = 0; g < k / GROUP; ++g) {
    const T* xg = x + g * GROUP;
    float amax = 0.0f;
    for (int j = 0; j < GROUP; ++j) amax = std::max(amax, std::fabs(to_f(xg[j])));
    const float inv = amax > 0.0f ? std::min(127.0f / amax, 3.0e38f) : 0.0f;  // finite for a tiny amax too
    int32_t sum = 0;
    for (int j = 0; j < GROUP; ++j) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(to_f(xg[j]) * inv));  // |v| <= 127
      a[g * GROUP + j] = static_cast<int8_t>(v);
      sum += v;
    }
    d[g] = amax / 127.0f;
    asum[g] = sum;
  }
}

inline int32_t quad(const int8_t* a) {  // four activation codes as one 32-bit word, for a broadcast
  int32_t w;
  std::memcpy(&w, a, sizeof w);
  return w;
}

#ifdef EAGLEGATE_INT8ACT_VNNI
// Rows r0 .. r0 + R of one block of 16 outputs.
template <int BITS, int R>
inline void block_rows(const int8_t* a, const float* d, const int32_t* asum, int64_t k, const uint8_t* codes,
                       const at::Half* sz, int64_t blk, float* y, int64_t n) {
  const int64_t groups = k / GROUP, gbytes = GROUP * BLOCK * BITS / 8;
  const __m512i nibble = _mm512_set1_epi8(0x0f), bias = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = codes + (blk * groups + g) * gbytes;
    __m512i s[R], t[R];  // two chains per row; S = s + t
    for (int r = 0; r < R; ++r) s[r] = t[r] = _mm512_setzero_si512();
    if constexpr (BITS == 4) {  // S <= 32 * 15 * 127
      for (int v = 0; v < 4; ++v) {
        const __m512i w = _mm512_loadu_si512(c + 64 * v);
        const __m512i lo = _mm512_and_si512(w, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
        for (int r = 0; r < R; ++r) {
          const int8_t* ar = a + r * k + g * GROUP + 8 * v;
          s[r] = _mm512_dpbusd_epi32(s[r], lo, _mm512_set1_epi32(quad(ar)));
          t[r] = _mm512_dpbusd_epi32(t[r], hi, _mm512_set1_epi32(quad(ar + 4)));
        }
      }
    } else {  // vpdpbusd takes unsigned weights: q + 128, then S = sum((q + 128) * a) - 128 * sum(a), |S| < 2^20
      for (int v = 0; v < 8; v += 2) {
        const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(c + 64 * v), bias);
        const __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512(c + 64 * v + 64), bias);
        for (int r = 0; r < R; ++r) {
          const int8_t* ar = a + r * k + g * GROUP + 4 * v;
          s[r] = _mm512_dpbusd_epi32(s[r], w0, _mm512_set1_epi32(quad(ar)));
          t[r] = _mm512_dpbusd_epi32(t[r], w1, _mm512_set1_epi32(quad(ar + 4)));
        }
      }
      for (int r = 0; r < R; ++r) t[r] = _mm512_sub_epi32(t[r], _mm512_set1_epi32(128 * asum[r * groups + g]));
    }
    const at::Half* so = sz + (blk * groups + g) * 2 * BLOCK;
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(so)));
    const __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(so + BLOCK)));
    for (int r = 0; r < R; ++r) {
      const float dr = d[r * groups + g];
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(s[r], t[r]));
      acc[r] = _mm512_fmadd_ps(sum, _mm512_mul_ps(scale, _mm512_set1_ps(dr)), acc[r]);
      acc[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(dr * static_cast<float>(asum[r * groups + g])), acc[r]);
    }
  }
  const int64_t left = n - blk * BLOCK;
  const __mmask16 mask = left >= BLOCK ? 0xffff : static_cast<__mmask16>((1u << left) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * n + blk * BLOCK, mask, acc[r]);
}
constexpr int MAX_ROWS = 8;  // accumulators of 8 rows and their chains stay in the 32 registers
#endif

#ifdef EAGLEGATE_INT8ACT_AVX2
// Rows r0 .. r0 + R of one block of 16 outputs, as two halves of 8 (an AVX2 register's lanes): bytes 32h .. 32h + 32
// of each 64-byte vector are outputs 8h .. 8h + 8.
template <int BITS, int R>
inline void block_rows(const int8_t* a, const float* d, const int32_t* asum, int64_t k, const uint8_t* codes,
                       const at::Half* sz, int64_t blk, float* y, int64_t n) {
  const int64_t groups = k / GROUP, gbytes = GROUP * BLOCK * BITS / 8;
  const __m256i nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* c = codes + (blk * groups + g) * gbytes + 32 * h;
      __m256i s[R];
      if constexpr (BITS == 4) {
        // vpmaddubsw's 16-bit sums add up in 16 bits for the whole group: at most 16 products of 15 * 127 each
        for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
        for (int v = 0; v < 4; ++v) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * v));
          const __m256i lo = _mm256_and_si256(w, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
          for (int r = 0; r < R; ++r) {
            const int8_t* ar = a + r * k + g * GROUP + 8 * v;
            s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(quad(ar))));
            s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(quad(ar + 4))));
          }
        }
        for (int r = 0; r < R; ++r) s[r] = _mm256_madd_epi16(s[r], ones);
      } else {
        // signed x signed as |q| x (a with q's sign): each 16-bit sum is two products of at most 128 * 127
        for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
        for (int v = 0; v < 8; ++v) {
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64 * v));
          const __m256i mag = _mm256_sign_epi8(w, w);
          for (int r = 0; r < R; ++r) {
            const __m256i av = _mm256_sign_epi8(_mm256_set1_epi32(quad(a + r * k + g * GROUP + 4 * v)), w);
            s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, av), ones));
          }
        }
      }
      const at::Half* so = sz + (blk * groups + g) * 2 * BLOCK + 8 * h;
      const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(so)));
      const __m256 offset = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(so + BLOCK)));
      for (int r = 0; r < R; ++r) {
        const float dr = d[r * groups + g];
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), _mm256_mul_ps(scale, _mm256_set1_ps(dr)), acc[r]);
        acc[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(dr * static_cast<float>(asum[r * groups + g])), acc[r]);
      }
    }
    const int64_t left = n - blk * BLOCK - 8 * h;
    for (int r = 0; r < R; ++r) {
      float* out = y + r * n + blk * BLOCK + 8 * h;
      if (left >= 8) {
        _mm256_storeu_ps(out, acc[r]);
      } else if (left > 0) {
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, acc[r]);
        std::memcpy(out, tmp, left * sizeof(float));
      }
    }
  }
}
// vpmaddubsw's 8-bit weights (s[R], acc[R], codes and temporaries in 16 registers): measured at its best at 4 rows
constexpr int MAX_ROWS = 4;
#endif

#if defined(EAGLEGATE_INT8ACT_VNNI) || defined(EAGLEGATE_INT8ACT_AVX2)
template <int BITS, int R>
void blocks_rows(const int8_t* a, const float* d, const int32_t* asum, int64_t k, const uint8_t* codes,
                 const at::Half* sz, int64_t b0, int64_t b1, float* y, int64_t n) {
  for (int64_t blk = b0; blk < b1; ++blk) block_rows<BITS, R>(a, d, asum, k, codes, sz, blk, y, n);
}

using RowsFn = void (*)(const int8_t*, const float*, const int32_t*, int64_t, const uint8_t*, const at::Half*, int64_t,
                        int64_t, float*, int64_t);

template <int BITS, int... R>
constexpr std::array<RowsFn, sizeof...(R)> rows_table(std::integer_sequence<int, R...>) {
  return {blocks_rows<BITS, R + 1>...};
}

// Blocks [b0, b1) for all m rows, in chunks of at most MAX_ROWS rows that pass over a tile of 8 blocks in turn
// (the tile stays in cache), chunks of even size (with 8 rows at most, 9 rows run as 5 + 4).
template <int BITS>
void blocks(const int8_t* a, const float* d, const int32_t* asum, int64_t m, int64_t k, const uint8_t* codes,
            const at::Half* sz, int64_t b0, int64_t b1, float* y, int64_t n) {
  static constexpr auto table = rows_table<BITS>(std::make_integer_sequence<int, MAX_ROWS>{});
  const int64_t groups = k / GROUP;
  for (int64_t t0 = b0; t0 < b1; t0 += 8) {
    const int64_t t1 = std::min(b1, t0 + 8);
    int64_t chunks = (m + MAX_ROWS - 1) / MAX_ROWS;
    for (int64_t r0 = 0, rows; r0 < m; r0 += rows, --chunks) {
      rows = (m - r0 + chunks - 1) / chunks;
      table[rows - 1](a + r0 * k, d + r0 * groups, asum + r0 * groups, k, codes, sz, t0, t1, y + r0 * n, n);
    }
  }
}
#endif

}  // namespace int8act
