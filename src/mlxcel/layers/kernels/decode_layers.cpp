// The CPU decode step's decoder layers as one call (issue 11: single-stream decode).
//
// A decode step is a few single-token rows through 30-odd identical layers. Run as torch ops
// (eager or torch.compile'd per layer) each layer pays ~100 us of Python, guards and small-op
// dispatch around ~150 us of arithmetic; this file runs the whole stack of a Llama-layout model
// (Llama, SmolLM2, Qwen2: RMSNorm, fused q/k/v with optional bias, RoPE, paged attention, SiLU
// MLP) in C++. The weight-only matmuls are the Python path's decode kernels (`int4_linear` and
// `int8_linear` below, or ATen's 4-bit one: the same bits), attention is the op
// `mlxcel::paged_decode_attention` (paged_attention.cpp), and the glue between them (norms,
// bias, RoPE, the KV write, SiLU, residual adds) is plain loops over each row, in float32 as the
// Python modules compute it. Every row is computed on its own, so its bits do not depend on the
// batch.
//
// It also holds `mlxcel::int8_linear`, the int8 weight-only matmul (the output head, and the int8
// linears of mixed checkpoints): ATen's kernel took 2.3-3.9 ms for SmolLM2's 49,152 x 576 head at
// one row and 11.8 ms at 16; this one, over weights kept in transposed blocks of 64 outputs, 0.6
// and 5.3 ms.
//
// Built and loaded with paged_attention.cpp by mlxcel/layers/paged_attention.py; Python calls
// `torch.ops.mlxcel.decode_layers` from engine/native_step.py.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/add.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// The vector paths: AVX-512 where the CPU has it (with VNNI for the 4-bit dot products), else AVX2 with
// FMA and F16C (Zen 2/3, most desktop CPUs: 8 lanes, the same sums in the same order, so the same bits),
// else plain loops. -march=native picks one per machine (the build is keyed by the CPU's flags).
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MLXCEL_AVX2 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t INT4_GROUP = 32;  // layers/quant.py: GGUF's 4-bit types scale blocks of 32
constexpr int64_t WEIGHTS_PER_LAYER = 14;

inline float bf16_to_float(uint16_t bits) {
    const uint32_t wide = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &wide, sizeof f);
    return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch's conversion (NaN kept NaN)
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    if (std::isnan(f)) return 0x7fc0;
    bits += 0x7fff + ((bits >> 16) & 1);
    return static_cast<uint16_t>(bits >> 16);
}

// x [rows, in] float32 or bfloat16 as float32 (issue 27: the kernels take float32 activations, so
// nothing rounds them to bfloat16 on the way in).
std::vector<float> float_rows(const at::Tensor& x) {
    const at::Tensor xc = x.contiguous();
    const int64_t count = xc.numel();
    std::vector<float> out(count);
    if (xc.scalar_type() == at::kFloat) {
        std::memcpy(out.data(), xc.const_data_ptr<float>(), sizeof(float) * count);
    } else {
        const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.const_data_ptr());
        for (int64_t i = 0; i < count; ++i) out[i] = bf16_to_float(xp[i]);
    }
    return out;
}

bool is_activation(const at::Tensor& x) {
    return x.dim() == 2 && x.is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16);
}

// Writes value i of y ([rows, out], x's dtype: float32 keeps the float32 sums, bfloat16 rounds them).
struct Output {
    float* f32;
    uint16_t* bf16;
    explicit Output(at::Tensor& y)
        : f32(y.scalar_type() == at::kFloat ? y.mutable_data_ptr<float>() : nullptr),
          bf16(f32 ? nullptr : reinterpret_cast<uint16_t*>(y.mutable_data_ptr())) {}
    void set(int64_t i, float v) const {
        if (f32) f32[i] = v; else bf16[i] = float_to_bf16(v);
    }
};

// ---- group scales, in one of three stored forms (layers/quant.py `group_scales`) ----
//
// A block of W outputs (a kernel's work item) has, for each group of `group` inputs, `parts` vectors
// of W float32 values: the scales (w = code * scale) and, with parts = 2, the lows (w = low + code *
// scale). They are stored
//   F32:   float32 [groups, parts, W];
//   F16:   float16, the same (exact where the file's scales are float16: Q4_0, Q4_1, Q8_0, Q5_0);
//   Units: per superblock of 256 inputs and part, W float32 units, then [256 / group, W] integer
//          sub-scales (uint8 beside 4-bit levels, int8 beside int8 codes): value = unit * sub. A K-quant
//          stores its scales so (Q4_K: d times a 6-bit scale, dmin times a 6-bit min; Q6_K: d times an
//          int8 scale), and the float32 product is exact (at most 19 significant bits).
// Every form gives the F32 form's float32 values bit for bit, so a linear's sums do not depend on it;
// F16 and Units only read fewer bytes (issue 27: decode reads every scale once a token).
enum class Form { F32, F16, Units };

inline float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

template <Form F, int64_t W, typename Sub = uint8_t, int64_t PER_UNIT = 8>
struct Scales {
    static constexpr int64_t per_unit = PER_UNIT;  // groups a superblock (Units): 8 of 32, 16 of 16
    const uint8_t* block;  // this block's scales
    int64_t parts;

    static constexpr int64_t part_bytes() { return W * 4 + PER_UNIT * W * static_cast<int64_t>(sizeof(Sub)); }

    // Bytes of one block's scales for `groups` groups.
    int64_t block_bytes(int64_t groups) const {
        return F == Form::Units ? groups / per_unit * parts * part_bytes()
                                : groups * parts * W * (F == Form::F16 ? 2 : 4);
    }

    float at(int64_t g, int64_t part, int64_t i) const {
        if constexpr (F == Form::F32) {
            return reinterpret_cast<const float*>(block)[(g * parts + part) * W + i];
        } else if constexpr (F == Form::F16) {
            return half_to_float(reinterpret_cast<const uint16_t*>(block)[(g * parts + part) * W + i]);
        } else {
            const uint8_t* base = block + ((g / per_unit) * parts + part) * part_bytes();
            float unit;
            std::memcpy(&unit, base + 4 * i, sizeof unit);
            return unit * static_cast<float>(reinterpret_cast<const Sub*>(base + 4 * W)[(g % per_unit) * W + i]);
        }
    }

#if defined(__AVX512F__)
    // Outputs 16 v .. 16 v + 15 of group g's part.
    __m512 vec(int64_t g, int64_t part, int64_t v) const {
        if constexpr (F == Form::F32) {
            return _mm512_loadu_ps(reinterpret_cast<const float*>(block) + (g * parts + part) * W + 16 * v);
        } else if constexpr (F == Form::F16) {
            const uint16_t* h = reinterpret_cast<const uint16_t*>(block) + (g * parts + part) * W + 16 * v;
            return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
        } else {
            const uint8_t* base = block + ((g / per_unit) * parts + part) * part_bytes();
            const __m128i subs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 4 * W + (g % per_unit) * W + 16 * v));
            const __m512i wide = std::is_signed_v<Sub> ? _mm512_cvtepi8_epi32(subs) : _mm512_cvtepu8_epi32(subs);
            return _mm512_mul_ps(_mm512_loadu_ps(reinterpret_cast<const float*>(base) + 16 * v), _mm512_cvtepi32_ps(wide));
        }
    }
#elif defined(MLXCEL_AVX2)
    // Outputs 8 v .. 8 v + 7 of group g's part.
    __m256 vec(int64_t g, int64_t part, int64_t v) const {
        if constexpr (F == Form::F32) {
            return _mm256_loadu_ps(reinterpret_cast<const float*>(block) + (g * parts + part) * W + 8 * v);
        } else if constexpr (F == Form::F16) {
            const uint16_t* h = reinterpret_cast<const uint16_t*>(block) + (g * parts + part) * W + 8 * v;
            return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
        } else {
            const uint8_t* base = block + ((g / per_unit) * parts + part) * part_bytes();
            const __m128i subs = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(base + 4 * W + (g % per_unit) * W + 8 * v));
            const __m256i wide = std::is_signed_v<Sub> ? _mm256_cvtepi8_epi32(subs) : _mm256_cvtepu8_epi32(subs);
            return _mm256_mul_ps(_mm256_loadu_ps(reinterpret_cast<const float*>(base) + 8 * v), _mm256_cvtepi32_ps(wide));
        }
    }
#endif
};

// Calls body(scales) with the Scales view of `scale`'s form: float32 and float16 tensors are F32 and F16;
// uint8 ones [blocks, superblocks, parts, 4 W + per_unit W sizeof(Sub)] are Units, with 8 or 16 groups a
// superblock (groups of 32 or 16 inputs; a compile-time count: a division per group cost 10 %).
template <int64_t W, typename Sub, typename Body>
void with_scales(const at::Tensor& scale, int64_t parts, Body&& body) {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(scale.const_data_ptr());
    if (scale.scalar_type() == at::kFloat) {
        body(Scales<Form::F32, W, Sub>{p, parts});
    } else if (scale.scalar_type() == at::kHalf) {
        body(Scales<Form::F16, W, Sub>{p, parts});
    } else {
        const int64_t per_unit = (scale.size(3) - 4 * W) / (W * static_cast<int64_t>(sizeof(Sub)));
        TORCH_CHECK_VALUE(per_unit == 8 || per_unit == 16, "scales: ", per_unit, " groups a superblock (8 or 16)");
        if (per_unit == 8) body(Scales<Form::Units, W, Sub, 8>{p, parts});
        else body(Scales<Form::Units, W, Sub, 16>{p, parts});
    }
}

constexpr int64_t ROWS_TOGETHER = 4;  // rows that share one conversion of the weights
constexpr int64_t OUT_BLOCK = 64;  // outputs a work item: four vectors of 16

// y[r, o0 + j] = sum_k x[r, k] * w[k, j] for ROWS rows and `count` <= OUT_BLOCK outputs (w: the block's
// [in, OUT_BLOCK] weights, contiguous, so a work item streams its memory in order): the
// weights of each k converted once for all rows, one float32 accumulator per (row, output) that
// adds k = 0, 1, ... in order. A row's arithmetic is the same alone or with others (its bits do not
// depend on the batch), and no horizontal sums are needed.
// With group scales (`group` > 0, `scales` the block's [in / group, OUT_BLOCK] float32): each group of
// `group` k's sums in its own accumulators, then adds sum * its scale to the total (a GGUF Q8_0 / Q5_0 /
// Q6_K weight in its stored blocks: w = code * scale of its group). With `lows`, a group's 64 lows follow
// its 64 scales (`stride` floats a group) and w = low + code * scale: low * the group's sum of x (`xsums`,
// [ROWS, in / group]) is added too (4-bit levels fused with int8 codes: Qwen's Q4_K q/k with its Q6_K
// v). Without (group 0): one sum over k.
#if defined(__AVX512F__)
// A group's sums (per row, 64 outputs as 4 vectors) into the totals: sum * the group's scale, and with
// `lows` low * the group's sum of x (`xsums`, [ROWS, groups]); int8_block's and int6_block's last step.
template <int64_t ROWS, typename S>
inline void add_group(const __m512 (&acc)[ROWS][4], __m512 (&total)[ROWS][4], const S& scales, int64_t g, bool lows,
                      const float* xsums, int64_t groups) {
    for (int v = 0; v < 4; ++v) {
        const __m512 scale = scales.vec(g, 0, v);
        for (int64_t r = 0; r < ROWS; ++r) total[r][v] = _mm512_fmadd_ps(acc[r][v], scale, total[r][v]);
        if (lows) {
            const __m512 low = scales.vec(g, 1, v);
            for (int64_t r = 0; r < ROWS; ++r)
                total[r][v] = _mm512_fmadd_ps(low, _mm512_set1_ps(xsums[r * groups + g]), total[r][v]);
        }
    }
}
#endif

template <int64_t ROWS, typename S>
void int8_block(const float* x, int64_t in, const int8_t* w, int64_t count, int64_t group, const S& scales,
                bool lows, const float* xsums, float* sums) {
    const int64_t span = group > 0 ? group : in;
#if defined(__AVX512F__)
    if (count == OUT_BLOCK) {
        __m512 acc[ROWS][4], total[ROWS][4];
        for (int64_t r = 0; r < ROWS; ++r)
            for (int v = 0; v < 4; ++v) total[r][v] = _mm512_setzero_ps();
        for (int64_t k0 = 0; k0 < in; k0 += span) {
            for (int64_t r = 0; r < ROWS; ++r)
                for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
            for (int64_t k = k0; k < k0 + span; ++k) {
                const int8_t* wk = w + k * OUT_BLOCK;
                __m512 weights[4];
                for (int v = 0; v < 4; ++v)
                    weights[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wk + 16 * v))));
                for (int64_t r = 0; r < ROWS; ++r) {
                    const __m512 xv = _mm512_set1_ps(x[r * in + k]);
                    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(weights[v], xv, acc[r][v]);
                }
            }
            if (group > 0) {
                add_group<ROWS>(acc, total, scales, k0 / group, lows, xsums, in / group);
            } else {
                for (int64_t r = 0; r < ROWS; ++r)
                    for (int v = 0; v < 4; ++v) total[r][v] = acc[r][v];
            }
        }
        for (int64_t r = 0; r < ROWS; ++r)
            for (int v = 0; v < 4; ++v) _mm512_storeu_ps(sums + r * OUT_BLOCK + 16 * v, total[r][v]);
        return;
    }
#elif defined(MLXCEL_AVX2)
    if (count == OUT_BLOCK) {
        for (int half = 0; half < 2; ++half) {  // 32 outputs at a time (4 vectors of 8): 16 registers hold no more
            __m256 acc[ROWS][4], total[ROWS][4];
            for (int64_t r = 0; r < ROWS; ++r)
                for (int v = 0; v < 4; ++v) total[r][v] = _mm256_setzero_ps();
            for (int64_t k0 = 0; k0 < in; k0 += span) {
                for (int64_t r = 0; r < ROWS; ++r)
                    for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_ps();
                for (int64_t k = k0; k < k0 + span; ++k) {
                    const int8_t* wk = w + k * OUT_BLOCK + 32 * half;
                    __m256 weights[4];
                    for (int v = 0; v < 4; ++v)
                        weights[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wk + 8 * v))));
                    for (int64_t r = 0; r < ROWS; ++r) {
                        const __m256 xv = _mm256_set1_ps(x[r * in + k]);
                        for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_fmadd_ps(weights[v], xv, acc[r][v]);
                    }
                }
                if (group > 0) {
                    const int64_t g = k0 / group;
                    for (int v = 0; v < 4; ++v) {
                        const __m256 scale = scales.vec(g, 0, 4 * half + v);
                        for (int64_t r = 0; r < ROWS; ++r) total[r][v] = _mm256_fmadd_ps(acc[r][v], scale, total[r][v]);
                        if (lows) {
                            const __m256 low = scales.vec(g, 1, 4 * half + v);
                            for (int64_t r = 0; r < ROWS; ++r)
                                total[r][v] = _mm256_fmadd_ps(low, _mm256_set1_ps(xsums[r * (in / group) + g]), total[r][v]);
                        }
                    }
                } else {
                    for (int64_t r = 0; r < ROWS; ++r)
                        for (int v = 0; v < 4; ++v) total[r][v] = acc[r][v];
                }
            }
            for (int64_t r = 0; r < ROWS; ++r)
                for (int v = 0; v < 4; ++v) _mm256_storeu_ps(sums + r * OUT_BLOCK + 32 * half + 8 * v, total[r][v]);
        }
        return;
    }
#endif
    for (int64_t r = 0; r < ROWS; ++r)  // a partial block (or no vector path): the same order, one output at a time
        for (int64_t j = 0; j < count; ++j) {
            float total = 0.0f;
            for (int64_t k0 = 0; k0 < in; k0 += span) {
                float acc = 0.0f;
                for (int64_t k = k0; k < k0 + span; ++k)
                    acc = std::fma(static_cast<float>(w[k * OUT_BLOCK + j]), x[r * in + k], acc);
                const int64_t g = k0 / span;
                total = group > 0 ? std::fma(acc, scales.at(g, 0, j), total) : acc;
                if (lows) total = std::fma(scales.at(g, 1, j), xsums[r * (in / group) + g], total);
            }
            sums[r * OUT_BLOCK + j] = total;
        }
}

// ---- 6-bit codes: a GGUF Q6_K / Q5_0 weight's codes as the file's bits, not a byte each (issue 27) ----
//
// Q6_K's codes are -32..31 (Q5_0's -16..15; 4-bit levels fused with them 0..15): as int8 they cost a byte
// a weight where the file has 0.75, and decode reads every one a token. Packed (layers/quant.py
// `int6_blocks`), a block of 64 outputs keeps, per chunk of 16 inputs, 3 dwords an output ([chunk, 3, 64]):
// dword j holds the codes of k = 5 j .. 5 j + 4 as u = code + 32, 6 bits each from bit `base` (0, 0, 2),
// and the two other bits bits 2 j, 2 j + 1 of k = 15's code (two's complement): dwords 0 and 1 in bits
// 30-31, dword 2 in bits 0-1. A code becomes its float without a conversion: (dword & 63 << s) | the
// exponent bits of 2^(23 - s) is the float 2^(23 - s) + u, exactly, and minus (2^(23 - s) + 32) the code
// (fields past bit 17 shifted down first); k = 15's bits are funnel-shifted to bits 26-31 and shifted down
// arithmetically. The sums then run as `int8_block`'s, in the same order: the int8 codes' bits.
constexpr int64_t INT6_CHUNK = 16;  // inputs a chunk: 3 dwords an output
constexpr int64_t INT6_DWORDS = 3;

constexpr int int6_base(int64_t dword) { return dword == 2 ? 2 : 0; }  // bit of a dword's first code

inline int int6_code(const uint32_t* chunk, int64_t k, int64_t j) {  // output j's code at chunk input k
    if (k < INT6_CHUNK - 1)
        return static_cast<int>((chunk[(k / 5) * OUT_BLOCK + j] >> (int6_base(k / 5) + 6 * (k % 5))) & 63) - 32;
    const uint32_t code = (chunk[j] >> 30) | (chunk[OUT_BLOCK + j] >> 30) << 2 | (chunk[2 * OUT_BLOCK + j] & 3) << 4;
    return code >= 32 ? static_cast<int>(code) - 64 : static_cast<int>(code);
}

#if defined(__AVX512F__)
// (a >> n) | (b << (32 - n)) a lane: VBMI2's funnel shift where the CPU has it.
template <int N>
inline __m512i shift_right_from(__m512i a, __m512i b) {
#if defined(__AVX512VBMI2__)
    return _mm512_shrdi_epi32(a, b, N);
#else
    return _mm512_or_si512(_mm512_srli_epi32(a, N), _mm512_slli_epi32(b, 32 - N));
#endif
}

// The codes at chunk input K of 16 outputs (their 3 dwords) as floats.
template <int K>
inline __m512 int6_values(const __m512i* d) {
    if constexpr (K == INT6_CHUNK - 1) {  // bits 0-1 atop dword 0, 2-3 atop dword 1, 4-5 at the foot of dword 2
        const __m512i top = shift_right_from<4>(d[0], shift_right_from<30>(d[1], d[2]));
        return _mm512_cvtepi32_ps(_mm512_srai_epi32(top, 26));
    } else {
        constexpr int field = K % 5, base = int6_base(K / 5);
        constexpr int shift = field < 3 ? base + 6 * field : 6 * (field - 3);  // fields 3 and 4 shifted down
        const __m512i source = field < 3 ? d[K / 5] : _mm512_srli_epi32(d[K / 5], base + 18);
        const __m512i bits = _mm512_ternarylogic_epi32(source, _mm512_set1_epi32(63 << shift),
                                                       _mm512_set1_epi32((127 + 23 - shift) << 23), 0xEA);  // (a & b) | c
        return _mm512_sub_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(static_cast<float>((1 << (23 - shift)) + 32)));
    }
}

#endif

#if defined(__AVX512F__) || defined(MLXCEL_AVX2)
template <typename Body, int... K>
inline void each_input(Body&& body, std::integer_sequence<int, K...>) {
    (body(std::integral_constant<int, K>{}), ...);
}
#endif

#if defined(MLXCEL_AVX2)
// int6_values for 8 outputs: the same bit tricks on 8 lanes (no funnel shift or ternary logic in AVX2).
template <int K>
inline __m256 int6_values8(const __m256i* d) {
    if constexpr (K == INT6_CHUNK - 1) {
        const __m256i upper = _mm256_or_si256(_mm256_srli_epi32(d[1], 30), _mm256_slli_epi32(d[2], 2));
        const __m256i top = _mm256_or_si256(_mm256_srli_epi32(d[0], 4), _mm256_slli_epi32(upper, 28));
        return _mm256_cvtepi32_ps(_mm256_srai_epi32(top, 26));
    } else {
        constexpr int field = K % 5, base = int6_base(K / 5);
        constexpr int shift = field < 3 ? base + 6 * field : 6 * (field - 3);
        const __m256i source = field < 3 ? d[K / 5] : _mm256_srli_epi32(d[K / 5], base + 18);
        const __m256i bits = _mm256_or_si256(_mm256_and_si256(source, _mm256_set1_epi32(63 << shift)),
                                             _mm256_set1_epi32((127 + 23 - shift) << 23));
        return _mm256_sub_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(static_cast<float>((1 << (23 - shift)) + 32)));
    }
}
#endif

// `int8_block` over a block of 64 outputs in 6-bit codes (`w`: its chunks), grouped (`group` a multiple of 16).
template <int64_t ROWS, typename S>
void int6_block(const float* x, int64_t in, const uint32_t* w, int64_t group, const S& scales, bool lows,
                const float* xsums, float* sums) {
#if defined(__AVX512F__)
    __m512 acc[ROWS][4], total[ROWS][4];
    for (int64_t r = 0; r < ROWS; ++r)
        for (int v = 0; v < 4; ++v) total[r][v] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < in; k0 += group) {
        for (int64_t r = 0; r < ROWS; ++r)
            for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
        for (int64_t kc = k0; kc < k0 + group; kc += INT6_CHUNK) {
            const uint32_t* chunk = w + kc / INT6_CHUNK * INT6_DWORDS * OUT_BLOCK;
            __m512i d[4][INT6_DWORDS];  // the chunk's 64 outputs: one broadcast of x an input and row
            for (int v = 0; v < 4; ++v)
                for (int64_t j = 0; j < INT6_DWORDS; ++j) d[v][j] = _mm512_loadu_si512(chunk + j * OUT_BLOCK + 16 * v);
            each_input([&](auto input) {  // each accumulator adds k in order
                constexpr int K = decltype(input)::value;
                __m512 weights[4];
                for (int v = 0; v < 4; ++v) weights[v] = int6_values<K>(d[v]);
                for (int64_t r = 0; r < ROWS; ++r) {
                    const __m512 xv = _mm512_set1_ps(x[r * in + kc + K]);
                    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(weights[v], xv, acc[r][v]);
                }
            }, std::make_integer_sequence<int, INT6_CHUNK>{});
        }
        add_group<ROWS>(acc, total, scales, k0 / group, lows, xsums, in / group);
    }
    for (int64_t r = 0; r < ROWS; ++r)
        for (int v = 0; v < 4; ++v) _mm512_storeu_ps(sums + r * OUT_BLOCK + 16 * v, total[r][v]);
#else
    for (int64_t r = 0; r < ROWS; ++r)  // int8_block's order, one output at a time
        for (int64_t j = 0; j < OUT_BLOCK; ++j) {
            float total = 0.0f;
            for (int64_t k0 = 0; k0 < in; k0 += group) {
                float acc = 0.0f;
                for (int64_t k = k0; k < k0 + group; ++k) {
                    const uint32_t* chunk = w + k / INT6_CHUNK * INT6_DWORDS * OUT_BLOCK;
                    acc = std::fma(static_cast<float>(int6_code(chunk, k % INT6_CHUNK, j)), x[r * in + k], acc);
                }
                const int64_t g = k0 / group;
                total = std::fma(acc, scales.at(g, 0, j), total);
                if (lows) total = std::fma(scales.at(g, 1, j), xsums[r * (in / group) + g], total);
            }
            sums[r * OUT_BLOCK + j] = total;
        }
#endif
}

// codes int8 [out, in] in -32..31 (out a multiple of 64, in of 16) -> int32 [out / 64, in / 16, 3, 64] in the
// layout above (layers/quant.py `int6_blocks`; in C++: as tensor ops it took 8 s for Qwen's head at load).
at::Tensor int6_pack(const at::Tensor& codes) {
    TORCH_CHECK_VALUE(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_cpu() &&
                          codes.size(0) % OUT_BLOCK == 0 && codes.size(1) % INT6_CHUNK == 0,
                      "int6 pack: codes ", codes.sizes(), " ", codes.scalar_type(), " are not int8 [64 n, 16 m]");
    const at::Tensor contiguous = codes.contiguous();
    const int64_t out = codes.size(0), in = codes.size(1), blocks = out / OUT_BLOCK, chunks = in / INT6_CHUNK;
    at::Tensor packed = at::empty({blocks, chunks, INT6_DWORDS, OUT_BLOCK}, codes.options().dtype(at::kInt));
    const int8_t* cp = contiguous.const_data_ptr<int8_t>();
    uint32_t* pp = reinterpret_cast<uint32_t*>(packed.mutable_data_ptr<int32_t>());
    int64_t outside = 0;
#pragma omp parallel for schedule(static) reduction(+ : outside)
    for (int64_t row = 0; row < out; ++row) {
        const int64_t b = row / OUT_BLOCK, i = row % OUT_BLOCK;
        for (int64_t c = 0; c < chunks; ++c) {
            const int8_t* k = cp + row * in + c * INT6_CHUNK;
            uint32_t* words = pp + (b * chunks + c) * INT6_DWORDS * OUT_BLOCK + i;
            const uint32_t last = static_cast<uint32_t>(k[INT6_CHUNK - 1]) & 63;
            outside += k[INT6_CHUNK - 1] < -32 || k[INT6_CHUNK - 1] > 31;
            for (int64_t j = 0; j < INT6_DWORDS; ++j) {
                uint32_t word = ((last >> (2 * j)) & 3) << (j == 2 ? 0 : 30);
                for (int64_t f = 0; f < 5; ++f) {
                    const int code = k[5 * j + f];
                    outside += code < -32 || code > 31;
                    word |= static_cast<uint32_t>(code + 32) << (int6_base(j) + 6 * f);
                }
                words[j * OUT_BLOCK] = word;
            }
        }
    }
    TORCH_CHECK_VALUE(outside == 0, "int6 pack: ", outside, " codes lie outside -32..31");
    return packed;
}

// A block's 6-bit codes [in / 16 chunks] as `int8_block` reads int8 ones ([in, 64], into `codes`): for more
// rows than one call of `int6_block` takes, the block is unpacked once and its int8 form, from L2, serves
// every group of rows (the unpacking, not the bytes, bounds `int6_block` when it reruns for each group).
void int6_to_int8(const uint32_t* w, int64_t in, int8_t* codes) {
    for (int64_t kc = 0; kc < in; kc += INT6_CHUNK) {
        const uint32_t* chunk = w + kc / INT6_CHUNK * INT6_DWORDS * OUT_BLOCK;
#if defined(__AVX512F__)
        for (int v = 0; v < 4; ++v) {
            __m512i d[INT6_DWORDS];
            for (int64_t j = 0; j < INT6_DWORDS; ++j) d[j] = _mm512_loadu_si512(chunk + j * OUT_BLOCK + 16 * v);
            each_input([&](auto input) {
                constexpr int K = decltype(input)::value;
                const __m512i code = _mm512_cvtps_epi32(int6_values<K>(d));  // small integers: exact
                _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + (kc + K) * OUT_BLOCK + 16 * v), _mm512_cvtepi32_epi8(code));
            }, std::make_integer_sequence<int, INT6_CHUNK>{});
        }
#elif defined(MLXCEL_AVX2)
        for (int v = 0; v < 8; ++v) {
            __m256i d[INT6_DWORDS];
            for (int64_t j = 0; j < INT6_DWORDS; ++j)
                d[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + j * OUT_BLOCK + 8 * v));
            each_input([&](auto input) {
                constexpr int K = decltype(input)::value;
                const __m256i code = _mm256_cvtps_epi32(int6_values8<K>(d));  // small integers: exact
                const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
                _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + (kc + K) * OUT_BLOCK + 8 * v), _mm_packs_epi16(words, words));
            }, std::make_integer_sequence<int, INT6_CHUNK>{});
        }
#else
        for (int64_t k = 0; k < INT6_CHUNK; ++k)
            for (int64_t j = 0; j < OUT_BLOCK; ++j) codes[(kc + k) * OUT_BLOCK + j] = static_cast<int8_t>(int6_code(chunk, k, j));
#endif
    }
}

// Every block of an int8 linear: x's rows in float32 (`xf`, with their sums per group for the lows) times
// the blocks' codes (int8, or 6-bit where `packed`), into y.
template <typename S>
void int8_blocks(const float* xf, const float* xsums, int64_t rows, int64_t in, const void* wp, bool packed,
                 int64_t out, int64_t group, const S& scales, const uint16_t* row_scales, const Output& yp) {
    const int64_t blocks = (out + OUT_BLOCK - 1) / OUT_BLOCK, groups = group > 0 ? in / group : 0;
    const bool lows = scales.parts == 2;
    const int64_t block_bytes = group > 0 ? scales.block_bytes(groups) : 0;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        const int64_t o0 = b * OUT_BLOCK, count = std::min(OUT_BLOCK, out - o0);
        S bs = scales;
        bs.block = group > 0 ? scales.block + b * block_bytes : nullptr;
        float sums[ROWS_TOGETHER * OUT_BLOCK];
        const int8_t* wb = static_cast<const int8_t*>(wp) + b * in * OUT_BLOCK;
        const uint32_t* w6 = static_cast<const uint32_t*>(wp) + b * (in / INT6_CHUNK) * INT6_DWORDS * OUT_BLOCK;
#if defined(__AVX512F__)
        const bool unpack = packed && rows > ROWS_TOGETHER;
#else  // no 6-bit vector path: every block is unpacked to int8 codes (vectorized on AVX2) for int8_block's
        const bool unpack = packed;
#endif
        if (unpack) {
            thread_local std::vector<int8_t> unpacked;
            unpacked.resize(in * OUT_BLOCK);
            int6_to_int8(w6, in, unpacked.data());
            wb = unpacked.data();
        }
        for (int64_t r = 0; r < rows;) {
            const int64_t n = std::min(ROWS_TOGETHER, rows - r);
            const float* xr = xf + r * in;
            const float* sr = lows ? xsums + r * groups : nullptr;
            switch (packed && !unpack ? n + 4 : n) {
                case 8: int6_block<4>(xr, in, w6, group, bs, lows, sr, sums); break;
                case 7: int6_block<3>(xr, in, w6, group, bs, lows, sr, sums); break;
                case 6: int6_block<2>(xr, in, w6, group, bs, lows, sr, sums); break;
                case 5: int6_block<1>(xr, in, w6, group, bs, lows, sr, sums); break;
                case 4: int8_block<4>(xr, in, wb, count, group, bs, lows, sr, sums); break;
                case 3: int8_block<3>(xr, in, wb, count, group, bs, lows, sr, sums); break;
                case 2: int8_block<2>(xr, in, wb, count, group, bs, lows, sr, sums); break;
                default: int8_block<1>(xr, in, wb, count, group, bs, lows, sr, sums); break;
            }
            for (int64_t i = 0; i < n; ++i)
                for (int64_t j = 0; j < count; ++j)
                    yp.set((r + i) * out + o0 + j,
                           group > 0 ? sums[i * OUT_BLOCK + j] : sums[i * OUT_BLOCK + j] * bf16_to_float(row_scales[o0 + j]));
            r += n;
        }
    }
}

// y = x @ W.T: x [rows, in] float32 or bfloat16; w int8 [ceil(out / 64), in, 64], W's codes [out, in] in
// blocks of 64 output rows, each block transposed (layers/quant.py `int8_blocks`: zeros past `out`);
// scale either [out] bfloat16, one a row (W = codes * scale, a float weight rounded to int8), or the
// scales of a GGUF Q8_0 / Q5_0 / Q6_K weight's own codes per group of `group` inputs in the same blocks
// (`group_scales`): float32 or float16 [ceil(out / 64), in / group, 64] or [.., in / group, 2, 64] with
// lows (W = low + codes * scale), or uint8 [ceil(out / 64), in / 256, parts, 256 + 64 * 256 / group]
// (Units, int8 sub-scales); with group scales, w may instead be the codes in 6 bits, int32
// [out / 64, in / 16, 3, 64] (`int6_block`: the same sums) -> [rows, out] in x's dtype. ATen's int8 kernel took 2.6-3.9 ms for
// SmolLM2's 49,152 x 576 head at one row (and returned garbage at 100 inputs).
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
    const bool grouped = scale.dim() >= 3, units = scale.scalar_type() == at::kByte;
    // 6-bit codes: int32 [ceil(out / 64), in / 16, 3, 64] (`int6_block`), grouped only
    const bool packed = w.scalar_type() == at::kInt && w.dim() == 4;
    const int64_t inputs = packed ? w.size(1) * INT6_CHUNK : w.dim() >= 2 ? w.size(1) : -1;
    const int64_t parts = !grouped ? 1 : units ? scale.size(2) : scale.dim() == 4 ? 2 : 1;
    const int64_t group = !grouped ? 0 : units ? 256 * OUT_BLOCK / std::max<int64_t>(1, scale.size(3) - 4 * OUT_BLOCK)
                                                    : inputs / std::max<int64_t>(1, scale.size(1));
    TORCH_CHECK_VALUE(is_activation(x) && x.size(1) == inputs &&
                          (packed ? w.size(2) == INT6_DWORDS && grouped && group % INT6_CHUNK == 0
                                  : w.dim() == 3 && w.scalar_type() == at::kChar) && w.size(-1) == OUT_BLOCK &&
                          w.is_contiguous() && scale.is_contiguous() && w.is_cpu() &&
                          (grouped ? (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf || units) &&
                                         scale.size(0) == w.size(0) && scale.dim() <= 4 && group > 0 &&
                                         inputs % group == 0 && parts <= 2 &&
                                         (units ? scale.dim() == 4 && scale.size(1) * 256 == inputs &&
                                                      (scale.size(3) - 4 * OUT_BLOCK) * group == 256 * OUT_BLOCK
                                                : scale.size(-1) == OUT_BLOCK && scale.size(1) * group == inputs &&
                                                      (scale.dim() == 3 || scale.size(2) == 2))
                                   : scale.scalar_type() == at::kBFloat16 && scale.dim() == 1 &&
                                         (scale.numel() + OUT_BLOCK - 1) / OUT_BLOCK == w.size(0)),
                      "int8 linear: inconsistent inputs x ", x.sizes(), " ", x.scalar_type(), ", weight ", w.sizes(),
                      " ", w.scalar_type(), ", scale ", scale.sizes(), " ", scale.scalar_type());
    const int64_t rows = x.size(0), in = x.size(1), out = grouped ? w.size(0) * OUT_BLOCK : scale.numel();
    const std::vector<float> xs = float_rows(x);  // the rows in float32, once
    const int64_t groups = grouped ? in / group : 0;
    std::vector<float> xsums(parts == 2 ? rows * groups : 0);  // each row's sum per group, for the lows
    for (int64_t r = 0; r < rows && parts == 2; ++r)
        for (int64_t g = 0; g < groups; ++g) {
            float sum = 0.0f;
            for (int64_t k = 0; k < group; ++k) sum += xs[r * in + g * group + k];
            xsums[r * groups + g] = sum;
        }
    at::Tensor y = at::empty({rows, out}, x.options());
    const Output yp(y);
    const void* wp = w.const_data_ptr();
    if (!grouped) {
        const Scales<Form::F32, OUT_BLOCK> none{nullptr, 1};
        int8_blocks(xs.data(), nullptr, rows, in, wp, false, out, 0, none, reinterpret_cast<const uint16_t*>(scale.const_data_ptr()), yp);
    } else {
        with_scales<OUT_BLOCK, int8_t>(scale, parts, [&](const auto& scales) {
            int8_blocks(xs.data(), xsums.data(), rows, in, wp, packed, out, group, scales, nullptr, yp);
        });
    }
    return y;
}

// ---- int4: our own layout (layers/quant.py `int4_blocks`), integer dot products ----
//
// ATen's 4-bit CPU matmul took ~35 us a call at one row and ~210 us at 16 for SmolLM2's linears
// (nearly linear in rows: it converts every weight to float for every row). This one, as llama.cpp
// does, quantizes each row's activations to int8 in groups of 32 (scale = max |x| / 127) and sums
// products of 4-bit levels and int8 activations exactly in int32 (AVX-512 VNNI: 64 a instruction),
// then applies the group's float32 step and adds its low * (the sum of the row's rounded activations):
//   y = sum over groups g: step_g * dx_g * sum_k q_k * xq_k + low_g * dx_g * sum_k xq_k      (w = low + q * step)
// Weights: blocks of 16 outputs; in a block, a group is 4 vectors of 64 bytes, byte 4 i + t of vector
// v holding output i's level at k = 4 v + t (low nibble) and at k = 16 + 4 v + t (high nibble).
// Steps and lows: a `Scales` form for blocks of 16 (parts 2). A row's sums do not depend on the
// other rows, so its bits are the same alone and in any batch.

constexpr int64_t Q4_OUTS = 16;  // outputs a block
constexpr int64_t Q4_ROWS = 4;  // rows that share one unpacking of a group

struct QuantizedRows {  // the rows' activations as int8 codes, scales and the codes' sums (scaled), per group of 32
    std::vector<int8_t> codes;
    std::vector<float> scales, sums;
};

QuantizedRows quantize_rows(const at::Tensor& x) {
    const int64_t rows = x.size(0), in = x.size(1), groups = in / INT4_GROUP;
    QuantizedRows q{std::vector<int8_t>(rows * in), std::vector<float>(rows * groups), std::vector<float>(rows * groups)};
    const std::vector<float> xs = float_rows(x);
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < groups; ++g) {
            const float* group = xs.data() + r * in + g * INT4_GROUP;
            float largest = 0.0f;
            for (int64_t k = 0; k < INT4_GROUP; ++k) largest = std::max(largest, std::fabs(group[k]));
            const float scale = largest / 127.0f, inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
            int32_t codes = 0;
            for (int64_t k = 0; k < INT4_GROUP; ++k) {
                const int8_t code = static_cast<int8_t>(std::nearbyint(group[k] * inverse));
                q.codes[r * in + g * INT4_GROUP + k] = code;
                codes += code;
            }
            q.scales[r * groups + g] = scale;
            // The sum of the rounded activations, not of the exact ones (issue 27): then the row is
            // W x' for one rounded x' (as llama.cpp's Q8_1 sum does), whose error sums against the
            // centred weights (low + q * step); with the exact sum it summed against q * step alone,
            // all of one sign: 1.7x the matmul's error, 4.6x llama.cpp's KLD on SmolLM2.
            q.sums[r * groups + g] = scale * static_cast<float>(codes);
        }
    return q;
}

// out[r * Q4_OUTS + i] for ROWS rows and one block of 16 outputs.
template <int64_t ROWS, typename S>
void int4_block(const QuantizedRows& x, int64_t row0, int64_t in, const uint8_t* w, const S& scales, float* out) {
    const int64_t groups = in / INT4_GROUP;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512 total[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) total[r] = _mm512_setzero_ps();
    const __m512i low_nibbles = _mm512_set1_epi8(0x0f);
    for (int64_t g = 0; g < groups; ++g) {
        __m512i levels[8];  // k-quads 0..7 of the group, 16 outputs x 4 levels each
        for (int v = 0; v < 4; ++v) {
            const __m512i bytes = _mm512_loadu_si512(w + (g * 4 + v) * 64);
            levels[v] = _mm512_and_si512(bytes, low_nibbles);
            levels[4 + v] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles);
        }
        const __m512 step = scales.vec(g, 0, 0), low = scales.vec(g, 1, 0);
        for (int64_t r = 0; r < ROWS; ++r) {
            const int64_t row = row0 + r;
            const int32_t* codes = reinterpret_cast<const int32_t*>(x.codes.data() + row * in + g * INT4_GROUP);
            // Two chains of four (integer sums: exact in any order), so one row does not wait on eight in a row.
            __m512i dots[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
            for (int quad = 0; quad < 8; ++quad)
                dots[quad & 1] = _mm512_dpbusd_epi32(dots[quad & 1], levels[quad], _mm512_set1_epi32(codes[quad]));
            const __m512i dot = _mm512_add_epi32(dots[0], dots[1]);
            const __m512 scaled = _mm512_mul_ps(step, _mm512_set1_ps(x.scales[row * groups + g]));
            total[r] = _mm512_fmadd_ps(scaled, _mm512_cvtepi32_ps(dot), total[r]);
            total[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(x.sums[row * groups + g]), total[r]);
        }
    }
    for (int64_t r = 0; r < ROWS; ++r) _mm512_storeu_ps(out + r * Q4_OUTS, total[r]);
#elif defined(MLXCEL_AVX2)
    // No VNNI: maddubs multiplies the unsigned levels by the signed codes and adds pairs into int16 (at most
    // 2 x 15 x 127 a pair, 8 quads 30,480: no saturation), madd with ones adds pairs into int32; the same
    // exact integer dot as the VNNI path, then its float steps: the same bits. Outputs 8 h .. 8 h + 7 per half h.
    __m256 total[ROWS][2];
    for (int64_t r = 0; r < ROWS; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
    const __m256i low_nibbles = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int64_t g = 0; g < groups; ++g) {
        for (int h = 0; h < 2; ++h) {
            __m256i levels[8];
            for (int v = 0; v < 4; ++v) {
                const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (g * 4 + v) * 64 + 32 * h));
                levels[v] = _mm256_and_si256(bytes, low_nibbles);
                levels[4 + v] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_nibbles);
            }
            const __m256 step = scales.vec(g, 0, h), low = scales.vec(g, 1, h);
            for (int64_t r = 0; r < ROWS; ++r) {
                const int64_t row = row0 + r;
                const int32_t* codes = reinterpret_cast<const int32_t*>(x.codes.data() + row * in + g * INT4_GROUP);
                __m256i pairs = _mm256_setzero_si256();
                for (int quad = 0; quad < 8; ++quad)
                    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(levels[quad], _mm256_set1_epi32(codes[quad])));
                const __m256i dot = _mm256_madd_epi16(pairs, ones);
                const __m256 scaled = _mm256_mul_ps(step, _mm256_set1_ps(x.scales[row * groups + g]));
                total[r][h] = _mm256_fmadd_ps(scaled, _mm256_cvtepi32_ps(dot), total[r][h]);
                total[r][h] = _mm256_fmadd_ps(low, _mm256_set1_ps(x.sums[row * groups + g]), total[r][h]);
            }
        }
    }
    for (int64_t r = 0; r < ROWS; ++r)
        for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * Q4_OUTS + 8 * h, total[r][h]);
#else
    for (int64_t r = 0; r < ROWS; ++r)
        for (int64_t i = 0; i < Q4_OUTS; ++i) {
            float total = 0.0f;
            const int64_t row = row0 + r;
            for (int64_t g = 0; g < groups; ++g) {
                int32_t dot = 0;
                for (int64_t quad = 0; quad < 8; ++quad)
                    for (int64_t t = 0; t < 4; ++t) {
                        const uint8_t byte = w[(g * 4 + quad % 4) * 64 + i * 4 + t];
                        const int level = quad < 4 ? byte & 15 : byte >> 4;
                        dot += level * x.codes[row * in + g * INT4_GROUP + quad * 4 + t];
                    }
                const float scaled = scales.at(g, 0, i) * x.scales[row * groups + g];
                total = std::fma(scaled, static_cast<float>(dot), total);
                total = std::fma(scales.at(g, 1, i), x.sums[row * groups + g], total);
            }
            out[r * Q4_OUTS + i] = total;
        }
#endif
}

// Every block of a 4-bit linear, the rows' activations quantized once.
template <typename S>
void int4_blocks(const QuantizedRows& quantized, int64_t rows, int64_t in, const uint8_t* wp, int64_t blocks,
                 const S& scales, const Output& yp) {
    const int64_t out = blocks * Q4_OUTS, block_bytes = in / INT4_GROUP * 4 * 64;
    const int64_t scale_bytes = scales.block_bytes(in / INT4_GROUP);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
        float sums[Q4_ROWS * Q4_OUTS];
        S bs = scales;
        bs.block = scales.block + b * scale_bytes;
        const uint8_t* w = wp + b * block_bytes;
        for (int64_t r = 0; r < rows;) {
            const int64_t group = std::min(Q4_ROWS, rows - r);
            switch (group) {
                case 4: int4_block<4>(quantized, r, in, w, bs, sums); break;
                case 3: int4_block<3>(quantized, r, in, w, bs, sums); break;
                case 2: int4_block<2>(quantized, r, in, w, bs, sums); break;
                default: int4_block<1>(quantized, r, in, w, bs, sums); break;
            }
            for (int64_t i = 0; i < group; ++i)
                for (int64_t j = 0; j < Q4_OUTS; ++j) yp.set((r + i) * out + b * Q4_OUTS + j, sums[i * Q4_OUTS + j]);
            r += group;
        }
    }
}

// y = x @ W.T: x [rows, in] float32 or bfloat16; packed uint8 [blocks, in / 32, 4, 64] in the layout above
// and its steps and lows (`group_scales`: float32 or float16 [blocks, in / 32, 2, 16], or uint8 [blocks,
// in / 256, 2, 64 + 8 x 16], Units with uint8 sub-scales) -> [rows, blocks * 16] in x's dtype.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales) {
    const bool units = scales.scalar_type() == at::kByte;
    TORCH_CHECK_VALUE(is_activation(x) && x.size(1) % INT4_GROUP == 0 &&
                          packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                          packed.is_cpu() && packed.size(1) * INT4_GROUP == x.size(1) && packed.size(2) == 4 &&
                          packed.size(3) == 64 && scales.dim() == 4 && scales.is_contiguous() &&
                          scales.size(0) == packed.size(0) && scales.size(2) == 2 &&
                          (units ? scales.size(1) * 256 == x.size(1) && scales.size(3) == 4 * Q4_OUTS + 8 * Q4_OUTS
                                 : (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) &&
                                       scales.size(1) == packed.size(1) && scales.size(3) == Q4_OUTS),
                      "int4 linear: inconsistent inputs x ", x.sizes(), " ", x.scalar_type(), ", packed ",
                      packed.sizes(), " ", packed.scalar_type(), ", scales ", scales.sizes(), " ", scales.scalar_type());
    const int64_t rows = x.size(0), in = x.size(1), blocks = packed.size(0);
    const QuantizedRows quantized = quantize_rows(x);
    at::Tensor y = at::empty({rows, blocks * Q4_OUTS}, x.options());
    const Output yp(y);
    with_scales<Q4_OUTS, uint8_t>(scales, 2, [&](const auto& s) {
        int4_blocks(quantized, rows, in, packed.const_data_ptr<uint8_t>(), blocks, s, yp);
    });
    return y;
}

// One weight-only quantized linear of layers/quant.py's QuantLinear: packed weight, its scales
// and an optional bias (empty tensor: none).
struct Linear {
    at::Tensor weight, scale, bias;

    // x: [rows, in] float32 -> [rows, out] float32, bias added in float32, as QuantLinear does (ATen's
    // 4-bit kernel takes and gives bfloat16).
    at::Tensor operator()(const at::Tensor& x) const {
        const at::Tensor y = weight.scalar_type() == at::kChar || weight.scalar_type() == at::kInt
                                 ? int8_linear(x, weight, scale)
                             : weight.dim() == 4 ? int4_linear(x, weight, scale)
                                                 : at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), weight,
                                                                                   INT4_GROUP, scale).to(at::kFloat);
        return bias.numel() ? at::add(y, bias) : y;
    }
};

struct Layer {
    at::Tensor input_norm, post_norm;  // float32 [hidden]
    Linear qkv, o, gate_up, down;
    at::Tensor k_cache, v_cache;  // [slots, kv_heads, head_dim], float32 / bfloat16 / float16
    int64_t window;  // 0: full attention
};

struct Dims {
    int64_t rows, hidden, q_heads, kv_heads, head_dim, intermediate;
    float eps, scale;
};

// y = x / rms(x) * weight, in float32, each row on its own (the linears' input).
void rms_norm(const Dims& d, const float* x, const float* weight, float* out) {
    for (int64_t r = 0; r < d.rows; ++r) {
        const float* row = x + r * d.hidden;
        float squares = 0.0f;
        for (int64_t i = 0; i < d.hidden; ++i) squares += row[i] * row[i];
        const float inv = 1.0f / std::sqrt(squares / static_cast<float>(d.hidden) + d.eps);
        for (int64_t i = 0; i < d.hidden; ++i) out[r * d.hidden + i] = row[i] * inv * weight[i];
    }
}

// HF's rotate-half RoPE on [heads, head_dim] of one row: x * cos + roll(x, half) * sin_signed.
void rope(float* x, int64_t heads, int64_t dim, const float* cos, const float* sin_signed) {
    const int64_t half = dim / 2;
    float turned[1024];
    for (int64_t h = 0; h < heads; ++h) {
        float* v = x + h * dim;
        for (int64_t i = 0; i < dim; ++i) turned[i] = v[i] * cos[i] + v[(i + half) % dim] * sin_signed[i];
        std::memcpy(v, turned, sizeof(float) * dim);
    }
}

template <typename T>
void store(T* dst, const float* src, int64_t count);
template <>
void store<float>(float* dst, const float* src, int64_t count) { std::memcpy(dst, src, sizeof(float) * count); }
template <>
void store<uint16_t>(uint16_t* dst, const float* src, int64_t count) {
    for (int64_t i = 0; i < count; ++i) dst[i] = float_to_bf16(src[i]);
}
template <>
void store<_Float16>(_Float16* dst, const float* src, int64_t count) {
    for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<_Float16>(src[i]);
}

// Each row's new key and value [kv_heads * head_dim] into its cache slot.
void write_kv(const at::Tensor& cache, const float* values, const int64_t* slots, int64_t rows, int64_t stride,
              int64_t offset, int64_t width) {
    const int64_t token = cache.size(1) * cache.size(2);
    for (int64_t r = 0; r < rows; ++r) {
        const float* src = values + r * stride + offset;
        const int64_t slot = slots[r];
        switch (cache.scalar_type()) {
            case at::kFloat: store(cache.mutable_data_ptr<float>() + slot * token, src, width); break;
            case at::kBFloat16:
                store(reinterpret_cast<uint16_t*>(cache.mutable_data_ptr()) + slot * token, src, width);
                break;
            default: store(reinterpret_cast<_Float16*>(cache.mutable_data_ptr()) + slot * token, src, width); break;
        }
    }
}

at::Tensor attention(const at::Tensor& q, const Layer& layer, const at::Tensor& key_slots, const at::Tensor& key_pos,
                     const at::Tensor& q_pos, double scale) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("mlxcel::paged_decode_attention", "")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                 const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                                 int64_t)>();
    return op.call(q, layer.k_cache, layer.v_cache, key_slots, key_pos, q_pos, scale, layer.window);
}

void run_layer(const Dims& d, const Layer& layer, float* x, const float* cos, const float* sin_signed,
               const int64_t* slots, const at::Tensor& key_slots, const at::Tensor& key_pos, const at::Tensor& q_pos,
               at::Tensor& normed) {
    const int64_t q_width = d.q_heads * d.head_dim, kv_width = d.kv_heads * d.head_dim;
    const int64_t qkv_width = q_width + 2 * kv_width;
    float* np = normed.mutable_data_ptr<float>();
    rms_norm(d, x, layer.input_norm.const_data_ptr<float>(), np);
    at::Tensor qkv = layer.qkv(normed);  // [rows, q | k | v] float32
    float* qkvp = qkv.mutable_data_ptr<float>();
    for (int64_t r = 0; r < d.rows; ++r) {
        float* row = qkvp + r * qkv_width;
        rope(row, d.q_heads, d.head_dim, cos + r * d.head_dim, sin_signed + r * d.head_dim);
        rope(row + q_width, d.kv_heads, d.head_dim, cos + r * d.head_dim, sin_signed + r * d.head_dim);
    }
    write_kv(layer.k_cache, qkvp, slots, d.rows, qkv_width, q_width, kv_width);
    write_kv(layer.v_cache, qkvp, slots, d.rows, qkv_width, q_width + kv_width, kv_width);
    const at::Tensor q = qkv.narrow(1, 0, q_width).view({d.rows, d.q_heads, d.head_dim});
    const at::Tensor attended = attention(q, layer, key_slots, key_pos, q_pos, d.scale);  // float32
    const at::Tensor projected = layer.o(attended.reshape({d.rows, q_width}));
    const float* pp = projected.const_data_ptr<float>();
    for (int64_t i = 0; i < d.rows * d.hidden; ++i) x[i] += pp[i];
    rms_norm(d, x, layer.post_norm.const_data_ptr<float>(), np);
    const at::Tensor gate_up = layer.gate_up(normed);  // [rows, gate | up] float32
    // SiLU(gate) * up through ATen's vectorised kernels: the eager path's very ops, so its bits
    const at::Tensor hidden =
        at::mul(at::silu(gate_up.narrow(1, 0, d.intermediate)), gate_up.narrow(1, d.intermediate, d.intermediate));
    const at::Tensor down = layer.down(hidden);
    const float* dp = down.const_data_ptr<float>();
    for (int64_t i = 0; i < d.rows * d.hidden; ++i) x[i] += dp[i];
}

bool is_long_vector(const at::Tensor& t) { return t.scalar_type() == at::kLong && t.is_contiguous() && t.is_cpu(); }

void check_linear(const Linear& lin, int64_t in, int64_t out, const char* name, int64_t index) {
    const bool int4 = lin.weight.scalar_type() == at::kByte, int6 = lin.weight.scalar_type() == at::kInt;
    const bool int8 = lin.weight.scalar_type() == at::kChar || int6;
    const bool bias_ok = lin.bias.numel() == 0 || (lin.bias.scalar_type() == at::kFloat &&
                                                   lin.bias.is_contiguous() && lin.bias.numel() == out);
    TORCH_CHECK_VALUE((int4 || int8) && lin.weight.is_cpu() && bias_ok &&
                          (int6 ? lin.weight.dim() == 4 && lin.weight.size(1) * INT6_CHUNK == in &&
                                      lin.scale.dim() >= 3 && lin.weight.size(0) * OUT_BLOCK == out
                           : int8 ? lin.weight.dim() == 3 && lin.weight.size(1) == in &&
                                      (lin.scale.dim() >= 3 ? lin.weight.size(0) * OUT_BLOCK == out
                                                            : lin.scale.numel() == out)
                           : lin.weight.dim() == 4  // ours (int4_linear)
                               ? lin.weight.size(0) * Q4_OUTS == out && lin.weight.size(1) * INT4_GROUP == in
                               : in % INT4_GROUP == 0 && lin.scale.dim() == 3 && lin.scale.size(0) == in / INT4_GROUP &&
                                     lin.scale.size(1) == out),
                      "decode layers: layer ", index, "'s ", name, " is not a packed ", in, " -> ", out,
                      " linear (weight ", lin.weight.sizes(), " ", lin.weight.scalar_type(), ", bias ",
                      lin.bias.sizes(), ")");
}

// x [rows, hidden] float32 (the embedded tokens) -> the last layer's output, same shape; writes each
// row's key and value of every layer at slot_mapping. cos, sin_signed [rows, head_dim] float32 (the
// rotary tables at the rows' positions, sin's first half negated: layers/rope.py). weights: 14 a
// layer (input norm; qkv weight, scale, bias; o weight, scale, bias; post norm; gate_up weight,
// scale, bias; down weight, scale, bias; an empty tensor where a bias is absent). caches: k and v a
// layer. windows: a layer's sliding window, 0 = none. dims: q heads, kv heads, head dim.
at::Tensor decode_layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin_signed,
                         const at::Tensor& slot_mapping, const at::Tensor& key_slots, const at::Tensor& key_pos,
                         const at::Tensor& q_pos, at::TensorList weights, at::TensorList k_caches,
                         at::TensorList v_caches, at::IntArrayRef windows, at::IntArrayRef dims, double eps,
                         double scale) {
    const int64_t num_layers = static_cast<int64_t>(k_caches.size());
    TORCH_CHECK_VALUE(dims.size() == 3 && x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_cpu() &&
                          static_cast<int64_t>(weights.size()) == num_layers * WEIGHTS_PER_LAYER &&
                          static_cast<int64_t>(v_caches.size()) == num_layers &&
                          static_cast<int64_t>(windows.size()) == num_layers,
                      "decode layers: inconsistent inputs (x ", x.sizes(), " ", x.scalar_type(), ", ", weights.size(),
                      " weights for ", num_layers, " layers, ", windows.size(), " windows, ", dims.size(), " dims)");
    const int64_t rows = x.size(0), hidden = x.size(1);
    Dims d{rows, hidden, dims[0], dims[1], dims[2], 0, static_cast<float>(eps), static_cast<float>(scale)};
    TORCH_CHECK_VALUE(d.q_heads > 0 && d.kv_heads > 0 && d.head_dim > 0 && d.head_dim <= 1024 &&
                          d.head_dim % 2 == 0 && d.q_heads % d.kv_heads == 0,
                      "decode layers: ", d.q_heads, " query heads over ", d.kv_heads, " kv heads of ", d.head_dim);
    TORCH_CHECK_VALUE(cos.scalar_type() == at::kFloat && sin_signed.scalar_type() == at::kFloat &&
                          cos.is_contiguous() && sin_signed.is_contiguous() && cos.numel() == rows * d.head_dim &&
                          sin_signed.numel() == rows * d.head_dim && is_long_vector(slot_mapping) &&
                          slot_mapping.numel() == rows,
                      "decode layers: rotary tables ", cos.sizes(), " / slot mapping ", slot_mapping.sizes(),
                      " do not match ", rows, " rows of head dim ", d.head_dim);
    std::vector<Layer> layers;
    layers.reserve(num_layers);
    for (int64_t i = 0; i < num_layers; ++i) {
        const at::Tensor* w = weights.data() + i * WEIGHTS_PER_LAYER;
        Layer layer{w[0].contiguous(),
                    w[7].contiguous(),
                    {w[1], w[2], w[3]},
                    {w[4], w[5], w[6]},
                    {w[8], w[9], w[10]},
                    {w[11], w[12], w[13]},
                    k_caches[i],
                    v_caches[i],
                    windows[i]};
        if (i == 0)
            d.intermediate = layer.down.weight.scalar_type() == at::kChar  ? layer.down.weight.size(1)
                             : layer.down.weight.scalar_type() == at::kInt ? layer.down.weight.size(1) * INT6_CHUNK
                             : layer.down.weight.dim() == 4                ? layer.down.weight.size(1) * INT4_GROUP
                                                                          : layer.down.scale.size(0) * INT4_GROUP;
        const int64_t kv_width = d.kv_heads * d.head_dim;
        check_linear(layer.qkv, hidden, d.q_heads * d.head_dim + 2 * kv_width, "q/k/v", i);
        check_linear(layer.o, d.q_heads * d.head_dim, hidden, "o_proj", i);
        check_linear(layer.gate_up, hidden, 2 * d.intermediate, "gate/up", i);
        check_linear(layer.down, d.intermediate, hidden, "down_proj", i);
        for (const at::Tensor* cache : {&layer.k_cache, &layer.v_cache}) {
            const auto type = cache->scalar_type();
            TORCH_CHECK_VALUE(cache->dim() == 3 && cache->size(1) == d.kv_heads && cache->size(2) == d.head_dim &&
                                  cache->is_contiguous() && cache->is_cpu() &&
                                  (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf),
                              "decode layers: layer ", i, "'s cache ", cache->sizes(), " ", type, " does not hold ",
                              d.kv_heads, " heads of ", d.head_dim);
        }
        TORCH_CHECK_VALUE(layer.input_norm.scalar_type() == at::kFloat && layer.post_norm.scalar_type() == at::kFloat &&
                              layer.input_norm.numel() == hidden && layer.post_norm.numel() == hidden,
                          "decode layers: layer ", i, "'s norms are not float32 of size ", hidden);
        layers.push_back(std::move(layer));
    }
    const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
    const int64_t num_slots = num_layers ? layers[0].k_cache.size(0) : 0;
    for (int64_t r = 0; r < rows; ++r)
        TORCH_CHECK_VALUE(slots[r] >= 0 && slots[r] < num_slots, "decode layers: slot ", slots[r], " of row ", r,
                          " lies outside the cache's ", num_slots, " slots");
    at::Tensor out = x.clone();
    at::Tensor normed = at::empty({rows, hidden}, x.options());
    for (const Layer& layer : layers)
        run_layer(d, layer, out.mutable_data_ptr<float>(), cos.const_data_ptr<float>(),
                  sin_signed.const_data_ptr<float>(), slots, key_slots, key_pos, q_pos, normed);
    return out;
}

// Issue 40: the routed experts of a mixture-of-experts layer over weight-only quantized linears
// (layers/moe.py `QuantExperts`). x [T, hidden] float32, ids [T, k] int64, weights [T, k] float32 (the
// router's picks); linears: 6 an expert (gate|up weight, scale, bias; down weight, scale, bias, as
// `Linear`), gate rows before up rows. The (token, slot) pairs are counted per expert; each expert
// that some row chose runs once over all those rows (decode rows and prefill chunks alike), and its
// weighted output is added to each row's sum in expert order (a row's bits do not depend on the others).
// activation: "silu" / "gelu" / "gelu_pytorch_tanh" / "relu" of gate times up, or "swiglu_clamped"
// (gpt-oss: gate.clamp(max=limit), up.clamp(-limit, limit), (up + 1) * gate * sigmoid(alpha * gate)).
at::Tensor quant_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                         at::TensorList linears, c10::string_view activation, double limit, double alpha) {
    const int64_t num_experts = static_cast<int64_t>(linears.size()) / 6;
    TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_cpu() && ids.dim() == 2 &&
                          ids.size(0) == x.size(0) && is_long_vector(ids) && weights.sizes() == ids.sizes() &&
                          weights.scalar_type() == at::kFloat && weights.is_contiguous() &&
                          linears.size() % 6 == 0 && num_experts > 0,
                      "quant experts: inconsistent inputs x ", x.sizes(), " ", x.scalar_type(), ", ids ", ids.sizes(),
                      " ", ids.scalar_type(), ", weights ", weights.sizes(), " ", weights.scalar_type(), ", ",
                      linears.size(), " linear tensors");
    const bool swiglu = activation == "swiglu_clamped";
    TORCH_CHECK_VALUE(swiglu || activation == "silu" || activation == "swish" || activation == "gelu" ||
                          activation == "gelu_pytorch_tanh" || activation == "relu",
                      "quant experts: unsupported activation ", activation);
    const int64_t rows = x.size(0), hidden = x.size(1), top_k = ids.size(1), pairs = rows * top_k;
    const int64_t* id = ids.const_data_ptr<int64_t>();
    std::vector<int64_t> starts(num_experts + 1, 0), order(pairs);
    for (int64_t p = 0; p < pairs; ++p) {
        TORCH_CHECK_VALUE(id[p] >= 0 && id[p] < num_experts, "quant experts: expert ", id[p], " of row ", p / top_k,
                          " is not one of the ", num_experts, " experts");
        ++starts[id[p] + 1];
    }
    for (int64_t e = 0; e < num_experts; ++e) starts[e + 1] += starts[e];
    std::vector<int64_t> fill(starts.begin(), starts.end() - 1);
    for (int64_t p = 0; p < pairs; ++p) order[fill[id[p]]++] = p;  // pairs by expert, in row order
    const at::Tensor xc = x.contiguous();
    const float* xp = xc.const_data_ptr<float>();
    const float* wp = weights.const_data_ptr<float>();
    at::Tensor out = at::zeros({rows, hidden}, x.options());
    float* op = out.mutable_data_ptr<float>();
    for (int64_t e = 0; e < num_experts; ++e) {
        const int64_t count = starts[e + 1] - starts[e];
        if (!count) continue;
        const at::Tensor* w = linears.data() + 6 * e;
        TORCH_CHECK_VALUE(w[0].is_cpu() && w[3].is_cpu(), "quant experts: expert ", e, "'s weights are not on the CPU");
        const Linear gate_up{w[0], w[1], w[2]}, down{w[3], w[4], w[5]};
        at::Tensor picked = at::empty({count, hidden}, x.options());
        float* pp = picked.mutable_data_ptr<float>();
        for (int64_t j = 0; j < count; ++j)
            std::memcpy(pp + j * hidden, xp + order[starts[e] + j] / top_k * hidden, sizeof(float) * hidden);
        const at::Tensor projected = gate_up(picked);  // [count, gate | up]
        const int64_t width = projected.size(1) / 2;
        at::Tensor gate = projected.narrow(1, 0, width), up = projected.narrow(1, width, width), hidden_rows;
        if (swiglu) {
            gate = at::clamp(gate, c10::nullopt, limit);
            up = at::clamp(up, -limit, limit);
            hidden_rows = at::mul(at::add(up, 1.0), at::mul(gate, at::sigmoid(at::mul(gate, alpha))));
        } else {
            const at::Tensor act = activation == "gelu"                ? at::gelu(gate)
                                   : activation == "gelu_pytorch_tanh" ? at::gelu(gate, "tanh")
                                   : activation == "relu"              ? at::relu(gate)
                                                                       : at::silu(gate);
            hidden_rows = at::mul(act, up);
        }
        const at::Tensor y = down(hidden_rows.contiguous());
        TORCH_CHECK_VALUE(y.size(0) == count && y.size(1) == hidden, "quant experts: expert ", e, "'s down projection gives ",
                          y.sizes(), ", not ", count, " x ", hidden);
        const float* yp = y.const_data_ptr<float>();
        for (int64_t j = 0; j < count; ++j) {
            const int64_t pair = order[starts[e] + j];
            float* dst = op + pair / top_k * hidden;
            const float scale = wp[pair];
            for (int64_t i = 0; i < hidden; ++i) dst[i] += scale * yp[j * hidden + i];
        }
    }
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mlxcel, m) {
    m.def("decode_layers(Tensor x, Tensor cos, Tensor sin_signed, Tensor slot_mapping, Tensor key_slots, "
          "Tensor key_pos, Tensor q_pos, Tensor[] weights, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
          "int[] windows, int[] dims, float eps, float scale) -> Tensor");
    m.def("int8_linear(Tensor x, Tensor w, Tensor scale) -> Tensor");
    m.def("int4_linear(Tensor x, Tensor packed, Tensor scales) -> Tensor");
    m.def("int6_pack(Tensor codes) -> Tensor");
    m.def("quant_experts(Tensor x, Tensor ids, Tensor weights, Tensor[] linears, str activation, float limit, "
          "float alpha) -> Tensor");
}

TORCH_LIBRARY_IMPL(mlxcel, CPU, m) {
    m.impl("decode_layers", &decode_layers);
    m.impl("int8_linear", &int8_linear);
    m.impl("int4_linear", &int4_linear);
    m.impl("int6_pack", &int6_pack);
    m.impl("quant_experts", &quant_experts);
}
