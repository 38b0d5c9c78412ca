// Multi-threaded CPU routed-expert forward over the packed checkpoint formats (jdspark.experts).
//
// One call computes, for the host-resident experts a block of rows selected, the model's
//   h   = round_dt(swiglu(round_dt(x W1^T), round_dt(x W3^T)) * routing_weight)      [pair, F]
//   out = round_dt(h W2^T)                                                         [pair, D]
//   y[r] = sum_k out[r, k]   (fp32, in k order)                                    [R, D]
// reading each distinct expert once for all rows that selected it. Threads (OpenMP) run over
// (expert, output tile) in phase 1 (w1/w3) and phase 2 (w2), then over rows in phase 3.
// Decoding is done in registers (AVX2 + F16C + FMA when built for such a CPU, scalar otherwise):
//   ds_fp4: pshufb of the nibbles into 2 * E2M1 as int8, widened to fp32; one e8m0 scale per 32.
//   e4m3:   sign-extended byte << 7 (bit 14 cleared) is the fp16 of value / 256, then vcvtph2ps.
//   bf16:   the upper half of an fp32.
// Power-of-two scale factors (the 2 of the fp4 table, the 256 of e4m3) fold into the block scale;
// e8m0 scales multiply a block's partial sum, which equals scaling each weight (exact powers of two).
// Float32 FP8 scales multiply each block's sum too, except when the model dtype is bf16: then each
// weight is scaled and rounded to bf16 first, as the model's dequantization does.
// Weight rows go through in groups (w1 and w3 of two features; four rows of w2) so each slice of
// the inputs is read from L1 once per group: a row-at-a-time GEMV reads 4 B of fp32 input per
// 0.5 B of fp4 weight. The SIMD path is compute-bound on AVX2 (about 5 GB/s of fp4 per core); ds_fp4
// has an AVX-512 decoder (vpermps table, scales decoded 16 at a time), twice as fast on Zen 4, and
// e4m3 with block-factor scales one that converts 32 bytes per step. In a bf16 model (round_bf16), where
// the CPU has AVX512-BF16, ds_fp4 decodes to bf16 words and multiplies the bf16 inputs and h by vdpbf16ps
// (`dot_fp4_bf16`): 2.4x the fp32 decoder from cache on Zen 4, the same products (exact in fp32), another
// summation order; inputs below 2^-126 count as zero there (the instruction's DAZ).
// Built at first use by jdspark/experts/cpu_gemv.py: g++ -O3 -march=native -fopenmp -shared.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <omp.h>
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define JDS_AVX2 1
#else
#define JDS_AVX2 0
#endif
#if JDS_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define JDS_AVX512 1
#else
#define JDS_AVX512 0
#endif
#if JDS_AVX512 && defined(__AVX512BF16__)
#define JDS_BF16DOT 1  // ds_fp4 against bf16 inputs by vdpbf16ps (a bf16 model's rows: `dot_fp4_bf16`)
#else
#define JDS_BF16DOT 0
#endif

namespace {

enum Fmt { FP4 = 0, FP8_E8M0 = 1, FP8_F32 = 2, BF16 = 3 };
constexpr int MAXR = 8;  // rows handled per pass over a weight row

float E2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, 0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

inline float pow2(int e) { return std::ldexp(1.0f, e); }

// 2^(b - 127 + shift) for an e8m0 byte b, by building the float's bits (ldexp where subnormal).
inline float e8m0_times(uint32_t b, int shift) {
  const int e = int(b) + shift;
  if (e < 1 || e > 254) return pow2(int(b) - 127 + shift);
  uint32_t u = uint32_t(e) << 23;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float e4m3_value(uint8_t b) {
  int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  float mag = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
  return s ? -mag : mag;
}

inline float bf16_round(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&v, &u, 4);
  return v;
}

// The bf16 bits of v, rounded to nearest even.
inline uint16_t bf16_bits(float v) {
  v = bf16_round(v);
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return uint16_t(u >> 16);
}

inline float bf16_value(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

// Position of element i of a 32-block in the order the fp4 decoder produces: evens then odds.
inline int fp4_pos(int i) { return (i & 1) * 16 + (i >> 1); }
// Where element i of a K-long ds_fp4 row's input sits in the decoder's order: per 32-block (fp4_pos), or
// with the AVX-512 decoder (`wide`) per 128-group, element 8i + t at 16t + i (`dot_fp4_512`), the blocks
// after the last full group per 32-block.
inline int fp4_pos_in_row(int i, int K, bool wide) {
  if (wide && i < K / 128 * 128) return (i & ~127) + (i & 7) * 16 + ((i & 127) >> 3);
  return (i & ~31) + fp4_pos(i & 31);
}

// Where element i of a K-long ds_fp4 row's bf16 input sits for `dot_fp4_bf16`: per 128-group element
// 4j + t at 32t + j; in a last half group (K % 128 == 64) at 16t + j.
inline int fp4_pos_bf16(int i, int K) {
  if (i < K / 128 * 128) return (i & ~127) + (i & 3) * 32 + ((i & 127) >> 2);
  return (i & ~127) + (i & 3) * 16 + ((i & 63) >> 2);
}

struct Row {  // one weight row (an output feature) of an expert matrix [N, K]
  const uint8_t* w;   // codes / bytes of this row
  const void* s;      // fp4: e8m0 bytes of this row; fp8: the block-scale row [ceil(K/128)]
};

#ifndef JDS_FP4_PREFETCH_HINT  // where ds_fp4 rows are prefetched (JDSPARK_CPU_FP4_PREFETCH_HINT: t0 L1, t1 L2)
#define JDS_FP4_PREFETCH_HINT _MM_HINT_T1
#endif

#if JDS_AVX2
// As M rows are read block by block (`bytes` each), the line `ahead` bytes further on in each row,
// once per 64 B line (0: no prefetch), to cache level HINT: ds_fp4 into L2 (`JDS_FP4_PREFETCH_HINT`),
// the other formats into L1. Measured on Zen 4 (docs/BENCHMARKS.md): ds_fp4 prefetched into L1 read
// 11.2 GB/s on one thread against 15.5 into L2 (2 threads: 15-20 against 18-25), FP8 and bf16
// 10-15% slower into L2. Offsets in int: with the offset computed in size_t, g++ 12.2 -O3
// emitted no prefetch at all (measured: ds_fp4 back to 41% of host read; objdump showed none). The
// address is integer arithmetic: near a bank's end it may lie past the allocation, which a prefetch
// (a hint that never faults) may name but a pointer may not.
template <int M, int HINT = _MM_HINT_T0>
inline void prefetch_ahead(const uint8_t* const* w, int bytes, int b, int ahead) {
  if (!ahead || (b * bytes) % 64) return;
  const int offset = bytes * b + ahead;
  for (int m = 0; m < M; ++m) _mm_prefetch((const char*)(reinterpret_cast<uintptr_t>(w[m]) + offset), (_mm_hint)HINT);
}

inline __m256 cvt8(__m128i v8) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v8)); }

inline __m256 bf16_round8(__m256 v) {
  __m256i i = _mm256_castps_si256(v);
  i = _mm256_add_epi32(_mm256_add_epi32(i, _mm256_set1_epi32(0x7FFF)), _mm256_and_si256(_mm256_srli_epi32(i, 16), _mm256_set1_epi32(1)));
  return _mm256_castsi256_ps(_mm256_and_si256(i, _mm256_set1_epi32((int)0xFFFF0000u)));
}

inline float hsum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

// 16 e4m3 bytes -> two vectors of value / 256 (exact), in element order.
inline void dec_e4m3(const uint8_t* p, __m256& a, __m256& b) {
  __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p));
  w = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16((short)0xBFFF));
  a = _mm256_cvtph_ps(_mm256_castsi256_si128(w));
  b = _mm256_cvtph_ps(_mm256_extracti128_si256(w, 1));
}

// ---- multi-row SIMD kernel: M weight rows x NR input vectors per pass ---------------------------
// Every format decodes a 32-element block of a row into 4 x 8 floats (in the order the format's
// inputs are laid out) and one block factor; the partial sum of a block times its factor adds to the
// accumulator. Processing M rows together reuses each 128 B slice of an input from L1 M times
// (a row-at-a-time GEMV reads 4 B of input per 0.5 B of fp4 weight and stalls on it).
struct BlockFP4 {  // scale per 32-block: G = 1
  static constexpr int G = 1;
  static constexpr int BYTES = 16;  // of codes per 32-block
  static constexpr float OUT = 0.5f;  // the table holds 2 x E2M1
  static float factor(const void* s, int g) {
    // 2^(b - 127) is the float whose bits are b << 23 (b >= 1; checked when a bank is filled)
    uint32_t u = uint32_t(((const uint8_t*)s)[g]) << 23;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  // nibbles -> 2 x E2M1 as int8 by pshufb, widened to int32 and converted (a vpermps table with the
  // sign xored in measured slower on AMD Zen)
  static void dec(const uint8_t* w, int b, float, __m256 v[4]) {
    const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i q = _mm_loadu_si128((const __m128i*)(w + 16 * b));
    const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(q, m4));
    const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(q, 4), m4));
    v[0] = cvt8(lo); v[1] = cvt8(_mm_srli_si128(lo, 8)); v[2] = cvt8(hi); v[3] = cvt8(_mm_srli_si128(hi, 8));
  }
};
template <bool F32S, bool ROUND>
struct BlockFP8 {  // s: the row's block-scale row [ceil(K/128)]; one scale per 4 blocks of 32
  static constexpr int G = 4;
  static constexpr int BYTES = 32;
  static constexpr float OUT = 1.0f;
  static float factor(const void* s, int g) {
    const float sv = F32S ? ((const float*)s)[g] : e8m0_times(((const uint8_t*)s)[g], 0);
    return ROUND ? sv : sv * 256.0f;  // the decoder gives value / 256
  }
  static void dec(const uint8_t* w, int b, float sv, __m256 v[4]) {
    dec_e4m3(w + 32 * b, v[0], v[1]);
    dec_e4m3(w + 32 * b + 16, v[2], v[3]);
    if (ROUND) {  // value * s in fp32 as the model's dequant, rounded to bf16 (factor 1 below)
      const __m256 k = _mm256_set1_ps(256.0f), svv = _mm256_set1_ps(sv);
      for (int i = 0; i < 4; ++i) v[i] = bf16_round8(_mm256_mul_ps(_mm256_mul_ps(v[i], k), svv));
    }
  }
};
struct BlockBF16 {
  static constexpr int G = 1 << 20;
  static constexpr int BYTES = 64;
  static constexpr float OUT = 1.0f;
  static float factor(const void*, int) { return 1.0f; }
  static void dec(const uint8_t* w, int b, float, __m256 v[4]) {
    const uint16_t* p = (const uint16_t*)w + 32 * b;
    for (int i = 0; i < 4; ++i)
      v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 8 * i))), 16));
  }
};

#if JDS_AVX512
// ds_fp4 with AVX-512, 128 elements (4 scale blocks, 64 bytes) a step: the 64 bytes load as 16 lanes of
// 4 bytes, and vpermps with a 16-entry table decodes the nibble at bits 4t..4t+3 of every lane (it reads
// the low 4 bits of each index), t = 0..7: lane i of decode t is element 8i + t, lanes 4j..4j+3 hold block
// j. So 8 permutes and 7 shifts decode 4 blocks (2 shuffle-port ops a block, against 3 for a widening
// load and two permutes per block), the inputs of a 128-group permuted to match (`fp4_pos_in_row`:
// element 8i + t at 16t + i), and each lane's 8 products are scaled once by its block's factor.
// Measured on Zen 5 (docs/BENCHMARKS.md): 20.5 -> 22.2 GB/s a core from cache, 2-5% from memory. Blocks after the last full group (K % 128) take
// the per-block decode of 32 elements (even then odd, as the AVX2 path).
template <int M, int NR>
inline void dot_fp4_512(const uint8_t* const* w, const void* const* s, int K, const float* const* xs, float* out, int ahead) {
  const __m512 lut = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, 0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f);
  const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);  // lane -> block of its group
  __m512 acc[M][NR];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  const int groups = K / 128;
  for (int g = 0; g < groups; ++g) {
    prefetch_ahead<M, JDS_FP4_PREFETCH_HINT>(w, 64, g, ahead);
    for (int m = 0; m < M; ++m) {
      const __m512i q = _mm512_loadu_si512((const void*)(w[m] + 64 * g));
      // the 4 blocks' factors 2^(e - 127) (the float of bits e << 23, e >= 1), each over its 4 lanes
      int bytes4;
      std::memcpy(&bytes4, (const uint8_t*)s[m] + 4 * g, 4);
      const __m128i e = _mm_cvtsi32_si128(bytes4);
      const __m512 sc = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_permutexvar_epi32(quarter, _mm512_cvtepu8_epi32(e)), 23));
      __m512 v[8];
      v[0] = _mm512_permutexvar_ps(q, lut);
      for (int t = 1; t < 8; ++t) v[t] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4 * t), lut);
      for (int r = 0; r < NR; ++r) {
        const float* x = xs[r] + 128 * g;
        __m512 sum = _mm512_mul_ps(v[0], _mm512_loadu_ps(x));
        for (int t = 1; t < 8; ++t) sum = _mm512_fmadd_ps(v[t], _mm512_loadu_ps(x + 16 * t), sum);
        acc[m][r] = _mm512_fmadd_ps(sum, sc, acc[m][r]);
      }
    }
  }
  for (int b = 4 * groups; b < K / 32; ++b) {  // the tail: per block, its 16 even inputs, then its 16 odd ones
    for (int m = 0; m < M; ++m) {
      const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(w[m] + 16 * b)));
      const __m512 even = _mm512_permutexvar_ps(q, lut), odd = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut);
      const __m512 sc = _mm512_set1_ps(BlockFP4::factor(s[m], b));
      for (int r = 0; r < NR; ++r) {
        const float* x = xs[r] + 32 * b;
        const __m512 t = _mm512_fmadd_ps(odd, _mm512_loadu_ps(x + 16), _mm512_mul_ps(even, _mm512_loadu_ps(x)));
        acc[m][r] = _mm512_fmadd_ps(t, sc, acc[m][r]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < NR; ++r) out[m * NR + r] = _mm512_reduce_add_ps(acc[m][r]);
}

// e4m3 with AVX-512: the same value / 256 trick as dec_e4m3 on 32 bytes at a time (one sign-extending
// load to 32 halfs, one shift, one and, two vcvtph2ps), about half the instructions of the AVX2 path,
// which bounds the FP8 GEMV (a core decodes ~8 GB/s of e4m3 there against ~18 GB/s of bf16 it reads).
template <int M, int NR, bool F32S>
inline void dot_fp8_512(const uint8_t* const* w, const void* const* s, int K, const float* const* xs, float* out, int ahead) {
  const __m512i keep = _mm512_set1_epi16((short)0xBFFF);
  __m512 acc[M][NR];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  const int nb = K / 32;
  for (int b0 = 0; b0 < nb; b0 += 4) {  // one block scale per 128 inputs
    const int b1 = b0 + 4 < nb ? b0 + 4 : nb;
    __m512 sc[M];
    for (int m = 0; m < M; ++m) sc[m] = _mm512_set1_ps(BlockFP8<F32S, false>::factor(s[m], b0 / 4));
    for (int b = b0; b < b1; ++b) {
      prefetch_ahead<M>(w, 32, b, ahead);
      for (int m = 0; m < M; ++m) {
        __m512i h = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w[m] + 32 * b)));
        h = _mm512_and_si512(_mm512_slli_epi16(h, 7), keep);
        const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
        const __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
        for (int r = 0; r < NR; ++r) {
          const float* x = xs[r] + 32 * b;
          const __m512 t = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(x)));
          acc[m][r] = _mm512_fmadd_ps(t, sc[m], acc[m][r]);
        }
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < NR; ++r) out[m * NR + r] = _mm512_reduce_add_ps(acc[m][r]);
}
#endif

#if JDS_BF16DOT
// ds_fp4 against bf16 inputs (a bf16 model: its rows and hidden states are bf16 values), 128 elements
// (64 bytes, 4 scale blocks) a step, no widening: the 64 bytes load as 32 words, and vpermw with a
// 32-entry table of the bf16 E2M1 values (twice over: it reads 5 index bits) decodes the nibble at
// bits 4t..4t+3 of every word after a shift by 4t, t = 0..3 (word j of decode t is element 4j + t).
// vdpbf16ps multiplies pairs of bf16 words into fp32 lanes, so fp32 lane i gets elements 8i..8i+7
// (block i / 4) from the four decodes, and one scale vector per step, its 4 e8m0 bytes spread over 4
// lanes each by variable shifts (not shuffles), scales them. A bf16 product is exact in fp32, so this
// differs from the fp32 path (`dot_fp4_512`) only in summation order (and in flushing denormal
// inputs), at 32 products an instruction against 16, and 4 shuffles per 128 elements against 9. The
// inputs of a 128-group permuted to match (`fp4_pos_bf16`: element 4j + t at 32t + j); a last 64
// elements (K % 128) by masked loads, at 16t + j. One core of the Zen 4 development machine, 4 rows of
// 4096 from cache: 21-22 GB/s of codes against dot_fp4_512's 9.0.
template <int M, int NR>
inline void dot_fp4_bf16(const uint8_t* const* w, const void* const* s, int K, const uint16_t* const* xs, float* out,
                         int ahead) {
  const __m512i lut = _mm512_setr_epi32(0x3F000000, 0x3FC03F80, 0x40404000, 0x40C04080, 0xBF008000, 0xBFC0BF80,
                                        0xC040C000, 0xC0C0C080, 0x3F000000, 0x3FC03F80, 0x40404000, 0x40C04080,
                                        0xBF008000, 0xBFC0BF80, 0xC040C000, 0xC0C0C080);
  // scale byte j of a 32-bit load to bits 23..30 of lanes 4j..4j+3: (b << (24 - 8j)) >> 1, exponent bits kept
  const __m512i spread = _mm512_setr_epi32(24, 24, 24, 24, 16, 16, 16, 16, 8, 8, 8, 8, 0, 0, 0, 0);
  const __m512i exponent = _mm512_set1_epi32(0x7F800000);
  __m512 acc[M][NR];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm512_setzero_ps();
  const int groups = (K + 64) / 128;  // the last one may be a half (64 elements, 2 blocks)
  for (int g = 0; g < groups; ++g) {
    prefetch_ahead<M, JDS_FP4_PREFETCH_HINT>(w, 64, g, ahead);
    const bool half = 128 * g + 64 == K;
    for (int m = 0; m < M; ++m) {
      const uint8_t* sb = (const uint8_t*)s[m] + 4 * g;
      uint32_t bytes4;
      if (half) {  // fixed-size loads: a memcpy of a variable size became a byte loop and a stalled reload
        uint16_t b2;
        std::memcpy(&b2, sb, 2);
        bytes4 = b2;
      } else {
        std::memcpy(&bytes4, sb, 4);
      }
      const __m512i b = _mm512_set1_epi32(int(bytes4));
      const __m512 sc = _mm512_castsi512_ps(_mm512_and_si512(_mm512_srli_epi32(_mm512_sllv_epi32(b, spread), 1), exponent));
      const __m512i q = half ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, w[m] + 64 * g)
                             : _mm512_loadu_si512((const void*)(w[m] + 64 * g));
      const __m512bh v0 = (__m512bh)_mm512_permutexvar_epi16(q, lut);
      const __m512bh v1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(q, 4), lut);
      const __m512bh v2 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(q, 8), lut);
      const __m512bh v3 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(q, 12), lut);
      for (int r = 0; r < NR; ++r) {
        const uint16_t* x = xs[r] + 128 * g;
        const int step = half ? 16 : 32;
        const __mmask32 keep = half ? 0xFFFFu : 0xFFFFFFFFu;  // a half's inputs end at x + 64: read no further
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), v0, (__m512bh)_mm512_maskz_loadu_epi16(keep, x));
        __m512 c = _mm512_dpbf16_ps(_mm512_setzero_ps(), v1, (__m512bh)_mm512_maskz_loadu_epi16(keep, x + step));
        a = _mm512_dpbf16_ps(a, v2, (__m512bh)_mm512_maskz_loadu_epi16(keep, x + 2 * step));
        c = _mm512_dpbf16_ps(c, v3, (__m512bh)_mm512_maskz_loadu_epi16(keep, x + 3 * step));
        acc[m][r] = _mm512_fmadd_ps(_mm512_add_ps(a, c), sc, acc[m][r]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < NR; ++r) out[m * NR + r] = _mm512_reduce_add_ps(acc[m][r]);
}
#endif

template <class Dec, int M, int NR>
inline void dot_multi(const uint8_t* const* w, const void* const* s, int K, const float* const* xs, float* out, int ahead) {
#if JDS_AVX512
  if constexpr (std::is_same<Dec, BlockFP4>::value) return dot_fp4_512<M, NR>(w, s, K, xs, out, ahead);
  if constexpr (std::is_same<Dec, BlockFP8<false, false>>::value) return dot_fp8_512<M, NR, false>(w, s, K, xs, out, ahead);
  if constexpr (std::is_same<Dec, BlockFP8<true, false>>::value) return dot_fp8_512<M, NR, true>(w, s, K, xs, out, ahead);
#endif
  constexpr bool ROUNDED = std::is_same<Dec, BlockFP8<true, true>>::value;
  __m256 acc[M][NR];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
  const int nb = K / 32;
  for (int b0 = 0; b0 < nb; b0 += Dec::G) {
    const int b1 = b0 + Dec::G < nb ? b0 + Dec::G : nb;
    float f[M];
    __m256 sc[M];
    for (int m = 0; m < M; ++m) { f[m] = Dec::factor(s[m], b0 / Dec::G); sc[m] = _mm256_set1_ps(ROUNDED ? 1.0f : f[m]); }
    for (int b = b0; b < b1; ++b) {
      prefetch_ahead<M, std::is_same<Dec, BlockFP4>::value ? JDS_FP4_PREFETCH_HINT : _MM_HINT_T0>(w, Dec::BYTES, b, ahead);
      for (int m = 0; m < M; ++m) {
        __m256 v[4];
        Dec::dec(w[m], b, f[m], v);
        for (int r = 0; r < NR; ++r) {
          const float* x = xs[r] + 32 * b;
          __m256 t = _mm256_mul_ps(v[0], _mm256_loadu_ps(x));
          t = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(x + 8), t);
          t = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(x + 16), t);
          t = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(x + 24), t);
          acc[m][r] = _mm256_fmadd_ps(t, sc[m], acc[m][r]);
        }
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < NR; ++r) out[m * NR + r] = Dec::OUT * hsum(acc[m][r]);
}
#if JDS_BF16DOT
template <class Dec, int M, int NR>  // bf16 inputs: ds_fp4 only (`dot_many`'s xbs)
inline void dot_multi(const uint8_t* const* w, const void* const* s, int K, const uint16_t* const* xs, float* out, int ahead) {
  dot_fp4_bf16<M, NR>(w, s, K, xs, out, ahead);
}
#endif
#endif  // JDS_AVX2


// Scalar versions (any CPU); same element order conventions (fp4 inputs permuted per block).
template <int NR>
inline void dot_fp4_scalar(const uint8_t* w, const uint8_t* s, int K, const float* const* xs, float* out) {
  float acc[MAXR] = {0};
  for (int b = 0; b < K / 32; ++b) {
    float blk[MAXR] = {0};
    for (int j = 0; j < 16; ++j) {
      uint8_t q = w[16 * b + j];
      float v0 = E2M1[q & 15], v1 = E2M1[q >> 4];
      for (int r = 0; r < NR; ++r) blk[r] += v0 * xs[r][32 * b + fp4_pos(2 * j)] + v1 * xs[r][32 * b + fp4_pos(2 * j + 1)];
    }
    float sc = e8m0_times(s[b], 0);
    for (int r = 0; r < NR; ++r) acc[r] += blk[r] * sc;
  }
  for (int r = 0; r < NR; ++r) out[r] = acc[r];
}

template <int NR, bool F32S, bool ROUND>
inline void dot_fp8_scalar(const uint8_t* w, const void* srow, int K, const float* const* xs, float* out) {
  float acc[MAXR] = {0};
  for (int b = 0; b < (K + 127) / 128; ++b) {
    const float sv = F32S ? ((const float*)srow)[b] : e8m0_times(((const uint8_t*)srow)[b], 0);
    float blk[MAXR] = {0};
    for (int k = 128 * b; k < K && k < 128 * (b + 1); ++k) {
      float v = ROUND ? bf16_round(e4m3_value(w[k]) * sv) : e4m3_value(w[k]);
      for (int r = 0; r < NR; ++r) blk[r] += v * xs[r][k];
    }
    for (int r = 0; r < NR; ++r) acc[r] += ROUND ? blk[r] : blk[r] * sv;
  }
  for (int r = 0; r < NR; ++r) out[r] = acc[r];
}

template <int NR>
inline void dot_bf16_scalar(const uint16_t* w, int K, const float* const* xs, float* out) {
  float acc[MAXR] = {0};
  for (int k = 0; k < K; ++k) {
    float v = bf16_value(w[k]);
    for (int r = 0; r < NR; ++r) acc[r] += v * xs[r][k];
  }
  for (int r = 0; r < NR; ++r) out[r] = acc[r];
}

struct Mat {  // one expert matrix [N, K] inside an expert's run
  const uint8_t* w;
  const void* s;
  int N, K;
  int fmt;
  bool round_w;  // FP8_F32 with a bf16 model: round each scaled weight to bf16
};

template <int NR>
void dot_rows_t(const Mat& m, int row, const float* const* xs, float* out) {
  const int K = m.K;
  if (m.fmt == FP4) {
    const uint8_t* w = m.w + size_t(row) * (K / 2);
    const uint8_t* s = (const uint8_t*)m.s + size_t(row) * (K / 32);
    return dot_fp4_scalar<NR>(w, s, K, xs, out);
  }
  if (m.fmt == BF16) {
    const uint16_t* w = (const uint16_t*)m.w + size_t(row) * K;
    return dot_bf16_scalar<NR>(w, K, xs, out);
  }
  const uint8_t* w = m.w + size_t(row) * K;
  const int nb = (K + 127) / 128;
  const bool f32s = m.fmt == FP8_F32;
  const void* srow = f32s ? (const void*)((const float*)m.s + size_t(row / 128) * nb)
                          : (const void*)((const uint8_t*)m.s + size_t(row / 128) * nb);
  if (!f32s) return dot_fp8_scalar<NR, false, false>(w, srow, K, xs, out);
  if (m.round_w) return dot_fp8_scalar<NR, true, true>(w, srow, K, xs, out);
  return dot_fp8_scalar<NR, true, false>(w, srow, K, xs, out);
}

// Dots of weight row `row` with n (any count) input vectors, in passes of MAXR.
void dot_rows(const Mat& m, int row, const float* const* xs, int n, float* out) {
  for (int i = 0; i < n; i += MAXR) {
    int c = n - i < MAXR ? n - i : MAXR;
    switch (c) {
      case 1: dot_rows_t<1>(m, row, xs + i, out + i); break;
      case 2: dot_rows_t<2>(m, row, xs + i, out + i); break;
      case 3: dot_rows_t<3>(m, row, xs + i, out + i); break;
      case 4: dot_rows_t<4>(m, row, xs + i, out + i); break;
      case 5: dot_rows_t<5>(m, row, xs + i, out + i); break;
      case 6: dot_rows_t<6>(m, row, xs + i, out + i); break;
      case 7: dot_rows_t<7>(m, row, xs + i, out + i); break;
      default: dot_rows_t<8>(m, row, xs + i, out + i); break;
    }
  }
}


// Row pointers of weight row `row` of matrix m (codes, scale row).
inline void row_ptrs(const Mat& m, int row, const uint8_t*& w, const void*& s) {
  const int K = m.K;
  if (m.fmt == FP4) {
    w = m.w + size_t(row) * (K / 2);
    s = (const uint8_t*)m.s + size_t(row) * (K / 32);
  } else if (m.fmt == BF16) {
    w = m.w + size_t(row) * K * 2;
    s = nullptr;
  } else {
    const int nb = (K + 127) / 128;
    w = m.w + size_t(row) * K;
    s = m.fmt == FP8_F32 ? (const void*)((const float*)m.s + size_t(row / 128) * nb)
                         : (const void*)((const uint8_t*)m.s + size_t(row / 128) * nb);
  }
}

#if JDS_AVX2
// out [M][c] = the M rows' dots with c <= MAXR input vectors.
template <class Dec, int M, class X>
void multi_pass(const uint8_t* const* w, const void* const* s, int K, const X* const* xs, int c, float* out, int ahead) {
  switch (c) {
    case 1: return dot_multi<Dec, M, 1>(w, s, K, xs, out, ahead);
    case 2: return dot_multi<Dec, M, 2>(w, s, K, xs, out, ahead);
    case 3: return dot_multi<Dec, M, 3>(w, s, K, xs, out, ahead);
    case 4: return dot_multi<Dec, M, 4>(w, s, K, xs, out, ahead);
    case 5: return dot_multi<Dec, M, 5>(w, s, K, xs, out, ahead);
    case 6: return dot_multi<Dec, M, 6>(w, s, K, xs, out, ahead);
    case 7: return dot_multi<Dec, M, 7>(w, s, K, xs, out, ahead);
    default: return dot_multi<Dec, M, 8>(w, s, K, xs, out, ahead);
  }
}

template <class Dec, int M, class X>
void multi_nr(const uint8_t* const* w, const void* const* s, int K, const X* const* xs, int n, float* out, int ahead) {
  // out [M][n]; one pass writes it in place (no copy: g++ made the copy of a few floats a `rep movs`,
  // ~10% of a rows = 1 GEMV on Zen 5 by perf)
  if (n <= MAXR) return multi_pass<Dec, M, X>(w, s, K, xs, n, out, ahead);
  float tmp[M * MAXR];
  for (int i = 0; i < n; i += MAXR) {
    const int c = n - i < MAXR ? n - i : MAXR;
    multi_pass<Dec, M, X>(w, s, K, xs + i, c, tmp, ahead);
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < c; ++r) out[m * n + i + r] = tmp[m * c + r];
  }
}

template <class Dec, class X>
void multi_m(int M, const uint8_t* const* w, const void* const* s, int K, const X* const* xs, int n, float* out, int ahead) {
  if (M == 4) return multi_nr<Dec, 4, X>(w, s, K, xs, n, out, ahead);
  if (M == 2) return multi_nr<Dec, 2, X>(w, s, K, xs, n, out, ahead);
  for (int m = 0; m < M; ++m) multi_nr<Dec, 1, X>(w + m, s + m, K, xs, n, out + m * n, ahead);
}
#endif

// Dots of M rows (mats[i], rows[i]; all with the same K and format) with n input vectors:
// out [M][n]. SIMD when built for AVX2 and K % 32 == 0, else row by row in scalar code. The SIMD
// path prefetches each row's bytes `ahead` bytes further on as it reads them (0: no prefetch).
// `xbs`: the inputs' bf16 copies laid out by `fp4_pos_bf16`, for ds_fp4 rows by `dot_fp4_bf16`
// (given only where JDS_BF16DOT, the model is bf16 and K % 64 == 0; else nullptr).
void dot_many(const Mat* const* mats, const int* rows, int M, const float* const* xs, const uint16_t* const* xbs,
              int n, float* out, bool simd, int ahead) {
  const Mat& m0 = *mats[0];
  (void)m0;
  (void)xbs;
#if JDS_AVX2
  if (simd && m0.K % 32 == 0) {
    const uint8_t* w[4];
    const void* s[4];
    for (int i = 0; i < M; ++i) row_ptrs(*mats[i], rows[i], w[i], s[i]);
#if JDS_BF16DOT
    if (xbs) return multi_m<BlockFP4>(M, w, s, m0.K, xbs, n, out, ahead);
#endif
    switch (m0.fmt) {
      case FP4: return multi_m<BlockFP4>(M, w, s, m0.K, xs, n, out, ahead);
      case BF16: return multi_m<BlockBF16>(M, w, s, m0.K, xs, n, out, ahead);
      case FP8_E8M0: return multi_m<BlockFP8<false, false>>(M, w, s, m0.K, xs, n, out, ahead);
      default:
        if (m0.round_w) return multi_m<BlockFP8<true, true>>(M, w, s, m0.K, xs, n, out, ahead);
        return multi_m<BlockFP8<true, false>>(M, w, s, m0.K, xs, n, out, ahead);
    }
  }
#endif
  (void)ahead;
  for (int i = 0; i < M; ++i) dot_rows(*mats[i], rows[i], xs, n, out + i * n);
}

// Bytes of one stored weight row of K elements (scales apart).
inline int row_bytes(int fmt, int K) { return fmt == FP4 ? K / 2 : (fmt == BF16 ? 2 * K : K); }

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

}  // namespace

extern "C" {

int jds_has_simd() { return JDS_AVX2; }
int jds_has_bf16dot() { return JDS_BF16DOT; }  // ds_fp4 x bf16 inputs by vdpbf16ps (`dot_fp4_bf16`)

// Host-side read bandwidth probe: sums `n` bytes (as uint64) with `nthreads` threads, `reps` times.
uint64_t jds_read_sum(const uint64_t* p, int64_t n_words, int reps, int nthreads) {
  uint64_t total = 0;
  for (int rep = 0; rep < reps; ++rep) {
#pragma omp parallel for num_threads(nthreads) reduction(+ : total) schedule(static)
    for (int64_t c = 0; c < (n_words + 4095) / 4096; ++c) {
      const int64_t a = c * 4096, b = a + 4096 < n_words ? a + 4096 : n_words;
#if JDS_AVX2
      __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
      int64_t i = a;
      for (; i + 16 <= b; i += 16) {
        s0 = _mm256_add_epi64(s0, _mm256_load_si256((const __m256i*)(p + i)));
        s1 = _mm256_add_epi64(s1, _mm256_load_si256((const __m256i*)(p + i + 4)));
        s2 = _mm256_add_epi64(s2, _mm256_load_si256((const __m256i*)(p + i + 8)));
        s3 = _mm256_add_epi64(s3, _mm256_load_si256((const __m256i*)(p + i + 12)));
      }
      alignas(32) uint64_t t[4];
      _mm256_store_si256((__m256i*)t, _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3)));
      uint64_t s = t[0] + t[1] + t[2] + t[3];
      for (; i < b; ++i) s += p[i];
#else
      uint64_t s = 0;
      for (int64_t i = a; i < b; ++i) s += p[i];
#endif
      total += s;
    }
  }
  return total;
}

// The routed-expert forward of the host experts of one block of rows.
//   data: bank base; tensor t (w1, w3, w2, s1, s3, s2) of slot s at data + off[t] + s * stride[t]
//   x [R, D]; pairs sorted by expert: pstart [n_uniq + 1], uniq_slot [n_uniq], pair_row [P],
//   pair_w [P] (routing weight), pair_out [P] (= r * K + k); covered [R * K] (1 where a pair wrote)
//   scratch: xp [R, D], h [P, F], out [R * K, D]; y [R, D] (written).
int jds_moe_forward(int fmt, const uint8_t* data, const int64_t* stride, const int64_t* off,
                    int D, int F, int R, int K, const float* x,
                    int n_uniq, const int32_t* uniq_slot, const int32_t* pstart,
                    const int32_t* pair_row, const float* pair_w, const int32_t* pair_out,
                    const uint8_t* covered, float* xp, float* h, float* out, float* y,
                    float limit, int round_bf16, int nthreads, int tile_f, int tile_d, int use_simd, int prefetch) {
  if (fmt < 0 || fmt > 3) return -1;
  if (fmt == FP4 && (D % 32 || F % 32)) return -2;
  const bool simd = use_simd && JDS_AVX2;
  const bool perm = fmt == FP4;  // fp4 reads its inputs in the decoder's order
  const bool wide = simd && JDS_AVX512;  // ... that of the AVX-512 decoder (`fp4_pos_in_row`)
  const bool rnd = round_bf16 != 0;
  // a bf16 model's ds_fp4 experts: inputs and h as bf16 words (in xp's and h's memory), `dot_fp4_bf16`
  const bool bfdot = simd && JDS_BF16DOT && fmt == FP4 && rnd && D % 64 == 0 && F % 64 == 0;
  uint16_t* const xb = reinterpret_cast<uint16_t*>(xp);
  uint16_t* const hb = reinterpret_cast<uint16_t*>(h);
  const int nft = (F + tile_f - 1) / tile_f, ndt = (D + tile_d - 1) / tile_d;
  auto dt = [rnd](float v) { return rnd ? bf16_round(v) : v; };
  // Software prefetch, `prefetch` groups of rows ahead: as a group's rows are read, the same bytes of
  // the next group's rows are fetched (a group holds 2 rows of each of w1 / w3 in phase 1, 4 rows of
  // w2 in phase 2, consecutive in memory). The hardware prefetchers alone leave a core at ~half the
  // rate it reaches from cache: each stream is one or two 4 KiB pages long before the next starts.
  const int ahead1 = prefetch * 2 * row_bytes(fmt, D), ahead2 = prefetch * 4 * row_bytes(fmt, F);

  // phase 0 (serial, R x D floats): inputs in the decoder's order
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < D; ++i) {
      if (bfdot) xb[size_t(r) * D + fp4_pos_bf16(i, D)] = bf16_bits(x[size_t(r) * D + i]);
      else xp[size_t(r) * D + (perm ? fp4_pos_in_row(i, D, wide) : i)] = x[size_t(r) * D + i];
    }

#pragma omp parallel num_threads(nthreads)
  {

    // phase 1: gate / up / SwiGLU / routing weight, tiles of F per expert
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < int64_t(n_uniq) * nft; ++item) {
      const int u = int(item / nft), ft = int(item % nft);
      const int64_t s = uniq_slot[u];
      Mat w1{data + off[0] + s * stride[0], data + off[3] + s * stride[3], F, D, fmt, rnd && fmt == FP8_F32};
      Mat w3{data + off[1] + s * stride[1], data + off[4] + s * stride[4], F, D, fmt, rnd && fmt == FP8_F32};
      const int p0 = pstart[u], np = pstart[u + 1] - p0;
      const float* xs[64];
      const uint16_t* xbs[64];
      for (int c0 = 0; c0 < np; c0 += 64) {
        const int nc = np - c0 < 64 ? np - c0 : 64;
        for (int i = 0; i < nc; ++i) {
          xs[i] = xp + size_t(pair_row[p0 + c0 + i]) * D;
          xbs[i] = xb + size_t(pair_row[p0 + c0 + i]) * D;
        }
        const int f_end = (ft + 1) * tile_f < F ? (ft + 1) * tile_f : F;
        for (int f = ft * tile_f; f < f_end; f += 2) {
          const int two = f + 1 < f_end ? 2 : 1;
          const Mat* mats[4] = {&w1, &w3, &w1, &w3};
          const int rows[4] = {f, f, f + 1, f + 1};
          float gu[4 * 64];  // [w1 f, w3 f, w1 f+1, w3 f+1][pair]
          dot_many(mats, rows, 2 * two, xs, bfdot ? xbs : nullptr, nc, gu, simd, ahead1);
          for (int j = 0; j < two; ++j) {
            const int fj = f + j;
            const int fpos = bfdot ? fp4_pos_bf16(fj, F) : (perm ? fp4_pos_in_row(fj, F, wide) : fj);
            for (int i = 0; i < nc; ++i) {
              float gv = dt(gu[(2 * j) * nc + i]), uv = dt(gu[(2 * j + 1) * nc + i]);
              if (limit > 0) {
                gv = gv < limit ? gv : limit;
                uv = uv < -limit ? -limit : (uv > limit ? limit : uv);
              }
              const int p = p0 + c0 + i;
              const float hv = dt(silu(gv) * uv * pair_w[p]);
              if (bfdot) hb[size_t(p) * F + fpos] = bf16_bits(hv);
              else h[size_t(p) * F + fpos] = hv;
            }
          }
        }
      }
    }

    // phase 2: down projection, tiles of D per expert
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < int64_t(n_uniq) * ndt; ++item) {
      const int u = int(item / ndt), dtile = int(item % ndt);
      const int64_t s = uniq_slot[u];
      Mat w2{data + off[2] + s * stride[2], data + off[5] + s * stride[5], D, F, fmt, rnd && fmt == FP8_F32};
      const int p0 = pstart[u], np = pstart[u + 1] - p0;
      const float* hs[64];
      const uint16_t* hbs[64];
      for (int c0 = 0; c0 < np; c0 += 64) {
        const int nc = np - c0 < 64 ? np - c0 : 64;
        for (int i = 0; i < nc; ++i) {
          hs[i] = h + size_t(p0 + c0 + i) * F;
          hbs[i] = hb + size_t(p0 + c0 + i) * F;
        }
        const int d_end = (dtile + 1) * tile_d < D ? (dtile + 1) * tile_d : D;
        for (int d = dtile * tile_d; d < d_end; d += 4) {
          const int nm = d + 4 <= d_end ? 4 : d_end - d;
          const Mat* mats[4] = {&w2, &w2, &w2, &w2};
          const int rows[4] = {d, d + 1, d + 2, d + 3};
          float o[4 * 64];
          dot_many(mats, rows, nm, hs, bfdot ? hbs : nullptr, nc, o, simd, ahead2);
          for (int j = 0; j < nm; ++j)
            for (int i = 0; i < nc; ++i) out[size_t(pair_out[p0 + c0 + i]) * D + d + j] = dt(o[j * nc + i]);
        }
      }
    }

    // phase 3: y[r] = sum_k out[r, k] in k order, over the pairs that were computed
#pragma omp for schedule(static)
    for (int64_t item = 0; item < int64_t(R) * ((D + 255) / 256); ++item) {
      const int r = int(item / ((D + 255) / 256)), d0 = int(item % ((D + 255) / 256)) * 256;
      const int d1 = d0 + 256 < D ? d0 + 256 : D;
      float* yr = y + size_t(r) * D;
      for (int d = d0; d < d1; ++d) yr[d] = 0.0f;
      for (int k = 0; k < K; ++k) {
        if (!covered[r * K + k]) continue;
        const float* src = out + size_t(r * K + k) * D;
        for (int d = d0; d < d1; ++d) yr[d] += src[d];
      }
    }
  }
  return 0;
}

}  // extern "C"
