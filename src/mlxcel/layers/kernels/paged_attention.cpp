// Decode attention over the paged KV cache, for the CPU (issue 11: long-context decode).
//
// One query a row, grouped-query heads; each row reads its own live keys straight from the
// cache slots its block table names (no gathered copy), in chunks of CHUNK keys:
//   pass 1, one (row, chunk) per work item: for each kv head, the scores of the query heads
//           that share it, their max, exp and sum, and the chunk's weighted sum of values;
//   pass 2, one (row, query head) per work item: the chunks merged in order (log-sum-exp).
// A chunk boundary is a fixed key index of the row, and a chunk with no visible key adds
// nothing, so a row's bits depend on its own keys only: the same alone and in any batch, with
// any padding of the batch to its longest row and any number of threads.
//
// Built at run time by mlxcel/layers/paged_attention.py (g++ -O3 -march=native -fopenmp, against
// torch's headers, about 10 s once) and loaded with torch.ops.load_library: the file registers
// itself as the CPU kernel of the op `mlxcel::paged_decode_attention` (whose schema Python
// defines), so a call from the compiled step goes straight from the dispatcher to C++.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

constexpr int64_t CHUNK = 256;  // keys per work item
constexpr int64_t MAX_GROUP = 16;  // query heads per kv head
constexpr int64_t MAX_HEADS = 64;  // kv heads
constexpr int64_t WIDTH = 16;  // floats in one vector (GCC vector extension: zmm, or two ymm)
constexpr int64_t MAX_DIM = 512;  // head dim: whole vectors, then a scalar tail
constexpr int64_t MAX_BLOCKS = MAX_DIM / WIDTH;

typedef float vec __attribute__((vector_size(WIDTH * sizeof(float))));
typedef uint32_t wide_bits __attribute__((vector_size(WIDTH * sizeof(uint32_t))));
typedef uint16_t half_bits __attribute__((vector_size(WIDTH * sizeof(uint16_t))));
typedef _Float16 halves __attribute__((vector_size(WIDTH * sizeof(_Float16))));

inline vec load(const float* p) {
    vec v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
inline vec load(const uint16_t* p) {  // bfloat16: the top half of a float32
    half_bits h;
    std::memcpy(&h, p, sizeof h);
    const wide_bits w = __builtin_convertvector(h, wide_bits) << 16;
    vec v;
    std::memcpy(&v, &w, sizeof v);
    return v;
}
inline vec load(const _Float16* p) {
    halves h;
    std::memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, vec);
}

inline float load_one(const float* p) { return *p; }
inline float load_one(const uint16_t* p) {
    const uint32_t bits = static_cast<uint32_t>(*p) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}
inline float load_one(const _Float16* p) { return static_cast<float>(*p); }

typedef float vec8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vec4 __attribute__((vector_size(4 * sizeof(float))));

inline float sum(vec v) {  // a fixed tree, in registers: the same order on every call
    const vec8 s8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const vec4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// exp(x) for x <= 0 (a score minus its max): Cody-Waite reduction and Cephes' degree-6
// polynomial, about 1 ulp; plain arithmetic, so a loop of it vectorises (std::exp does not).
inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = std::floor(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

struct Shape {
    int64_t rows, keys, q_heads, kv_heads, dim, chunks, slots;
    float scale;
    int64_t window;  // sliding window (keys at q_pos - window + 1 .. q_pos), 0 = none
};

// One (row, chunk), every head: writes the chunk's max and exp-sum per query head ([Hq]) and its
// unnormalised value sums ([Hq, D]); max = -inf when no key of the chunk is visible.
// BLOCKS: the head dim in whole vectors, known at compile time for the common dims (the loops
// unroll and stay in registers); 0 for any other dim (counted at run time, then a scalar tail).
template <typename T, int64_t BLOCKS>
void attend_chunk(const Shape& s, const float* q, const T* k_cache, const T* v_cache, const int64_t* key_slots,
                  const int64_t* key_pos, const int64_t* q_pos, int64_t row, int64_t chunk, float* part_max,
                  float* part_sum, float* part_out) {
    constexpr int64_t SIZE = BLOCKS > 0 ? BLOCKS : MAX_BLOCKS;
    const int64_t groups = s.q_heads / s.kv_heads, blocks = BLOCKS > 0 ? BLOCKS : s.dim / WIDTH;
    const int64_t token = s.kv_heads * s.dim;
    const bool has_tail = BLOCKS == 0 && blocks * WIDTH < s.dim;
    const int64_t first = chunk * CHUNK, count = (first + CHUNK < s.keys ? first + CHUNK : s.keys) - first;
    const float lowest = -std::numeric_limits<float>::infinity();
    const int64_t* slots = key_slots + row * s.keys + first;
    const int64_t* positions = key_pos + row * s.keys + first;
    const int64_t item = row * s.chunks + chunk;
    float* chunk_max = part_max + item * s.q_heads;
    float* chunk_sum = part_sum + item * s.q_heads;
    float* chunk_out = part_out + item * s.q_heads * s.dim;
    std::memset(chunk_out, 0, sizeof(float) * s.q_heads * s.dim);
    float visible[CHUNK];  // 1 or 0
    int64_t seen = 0;
    for (int64_t l = 0; l < count; ++l) {
        const int64_t pos = positions[l];
        const bool on = pos >= 0 && (s.window <= 0 || pos > q_pos[row] - s.window) && slots[l] >= 0 &&
                        slots[l] < s.slots;  // a slot outside the cache is never read
        visible[l] = on ? 1.0f : 0.0f;
        seen += on;
    }
    for (int64_t h = 0; h < s.q_heads; ++h) {
        chunk_max[h] = lowest;
        chunk_sum[h] = 0.0f;
    }
    if (seen == 0) return;
    float scores[MAX_GROUP][CHUNK];  // of the kv head at hand
    for (int64_t h = 0; h < s.kv_heads; ++h) {
        vec query[MAX_GROUP][SIZE];
        for (int64_t g = 0; g < groups; ++g)
            for (int64_t b = 0; b < blocks; ++b) query[g][b] = load(q + (row * s.q_heads + h * groups + g) * s.dim + b * WIDTH);
        float best[MAX_GROUP];
        for (int64_t g = 0; g < groups; ++g) best[g] = lowest;
        for (int64_t l = 0; l < count; ++l) {
            if (visible[l] == 0.0f) {
                for (int64_t g = 0; g < groups; ++g) scores[g][l] = lowest;
                continue;
            }
            const T* key = k_cache + slots[l] * token + h * s.dim;
            vec k[SIZE];
            for (int64_t b = 0; b < blocks; ++b) k[b] = load(key + b * WIDTH);
            for (int64_t g = 0; g < groups; ++g) {
                vec acc = vec{};
                for (int64_t b = 0; b < blocks; ++b) acc += query[g][b] * k[b];
                float dot = sum(acc);
                const float* qg = q + (row * s.q_heads + h * groups + g) * s.dim;
                if (has_tail)
                    for (int64_t d = blocks * WIDTH; d < s.dim; ++d) dot += qg[d] * load_one(key + d);
                const float score = dot * s.scale;
                scores[g][l] = score;
                best[g] = score > best[g] ? score : best[g];
            }
        }
        for (int64_t g = 0; g < groups; ++g) {  // scores -> probabilities (0 where not visible)
            float* p = scores[g];
            const float top = best[g];
            float lanes[WIDTH] = {0};
            int64_t l = 0;
            for (; l + WIDTH <= count; l += WIDTH)
                for (int64_t j = 0; j < WIDTH; ++j) {
                    p[l + j] = exp_nonpositive(p[l + j] - top) * visible[l + j];
                    lanes[j] += p[l + j];
                }
            for (int64_t j = 0; l < count; ++l, ++j) {
                p[l] = exp_nonpositive(p[l] - top) * visible[l];
                lanes[j] += p[l];
            }
            vec total;
            std::memcpy(&total, lanes, sizeof total);
            chunk_max[h * groups + g] = top;
            chunk_sum[h * groups + g] = sum(total);
        }
        vec acc[MAX_GROUP][SIZE];
        float tail[MAX_GROUP][WIDTH] = {};
        for (int64_t g = 0; g < groups; ++g)
            for (int64_t b = 0; b < blocks; ++b) acc[g][b] = vec{};
        for (int64_t l = 0; l < count; ++l) {
            if (visible[l] == 0.0f) continue;
            const T* value = v_cache + slots[l] * token + h * s.dim;
            vec v[SIZE];
            for (int64_t b = 0; b < blocks; ++b) v[b] = load(value + b * WIDTH);
            for (int64_t g = 0; g < groups; ++g) {
                const float p = scores[g][l];
                for (int64_t b = 0; b < blocks; ++b) acc[g][b] += p * v[b];
                if (has_tail)
                    for (int64_t d = blocks * WIDTH; d < s.dim; ++d)
                        tail[g][d - blocks * WIDTH] += p * load_one(value + d);
            }
        }
        for (int64_t g = 0; g < groups; ++g) {
            float* o = chunk_out + (h * groups + g) * s.dim;
            std::memcpy(o, acc[g], sizeof(float) * blocks * WIDTH);
            std::memcpy(o + blocks * WIDTH, tail[g], sizeof(float) * (s.dim - blocks * WIDTH));
        }
    }
}

// One (row, query head): the chunks merged in index order into out [D] of that head.
void merge(const Shape& s, int64_t row, int64_t head, const float* part_max, const float* part_sum,
           const float* part_out, float* out) {
    const float lowest = -std::numeric_limits<float>::infinity();
    float* o = out + (row * s.q_heads + head) * s.dim;
    std::memset(o, 0, sizeof(float) * s.dim);
    float top = lowest;
    for (int64_t c = 0; c < s.chunks; ++c) {
        const float m = part_max[(row * s.chunks + c) * s.q_heads + head];
        top = m > top ? m : top;
    }
    if (top == lowest) return;  // no visible key (a padding row): zeros
    float total = 0.0f;
    for (int64_t c = 0; c < s.chunks; ++c) {
        const int64_t at = (row * s.chunks + c) * s.q_heads + head;
        if (part_max[at] == lowest) continue;
        const float w = std::exp(part_max[at] - top);
        total += w * part_sum[at];
        const float* po = part_out + at * s.dim;
        for (int64_t d = 0; d < s.dim; ++d) o[d] += w * po[d];
    }
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < s.dim; ++d) o[d] *= inv;
}

template <typename T>
int run(const float* q, const void* k_cache, const void* v_cache, const int64_t* key_slots, const int64_t* key_pos,
        const int64_t* q_pos, float* out, float* scratch, int64_t rows, int64_t keys, int64_t q_heads,
        int64_t kv_heads, int64_t dim, int64_t slots, float scale, int64_t window) {
    if (kv_heads <= 0 || kv_heads > MAX_HEADS || q_heads % kv_heads != 0 || q_heads / kv_heads > MAX_GROUP ||
        dim <= 0 || dim > MAX_DIM)
        return 1;
    const Shape s{rows, keys, q_heads, kv_heads, dim, (keys + CHUNK - 1) / CHUNK, slots, scale, window};
    const int64_t items = rows * s.chunks;
    float* part_max = scratch;
    float* part_sum = part_max + items * q_heads;
    float* part_out = part_sum + items * q_heads;
    const T* kc = static_cast<const T*>(k_cache);
    const T* vc = static_cast<const T*>(v_cache);
    void (*attend)(const Shape&, const float*, const T*, const T*, const int64_t*, const int64_t*, const int64_t*,
                   int64_t, int64_t, float*, float*, float*) = attend_chunk<T, 0>;
    switch (dim) {
        case 64: attend = attend_chunk<T, 4>; break;
        case 80: attend = attend_chunk<T, 5>; break;
        case 96: attend = attend_chunk<T, 6>; break;
        case 128: attend = attend_chunk<T, 8>; break;
        case 256: attend = attend_chunk<T, 16>; break;
        default: break;
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item)
        attend(s, q, kc, vc, key_slots, key_pos, q_pos, item / s.chunks, item % s.chunks, part_max, part_sum,
               part_out);
#pragma omp parallel for schedule(static)
    for (int64_t pair = 0; pair < rows * q_heads; ++pair)
        merge(s, pair / q_heads, pair % q_heads, part_max, part_sum, part_out, out);
    return 0;
}

// Floats of scratch space run() needs.
int64_t scratch_floats(int64_t rows, int64_t keys, int64_t q_heads, int64_t dim) {
    return rows * ((keys + CHUNK - 1) / CHUNK) * q_heads * (2 + dim);
}

bool is_long_vector(const at::Tensor& t) { return t.scalar_type() == at::kLong && t.is_contiguous() && t.is_cpu(); }

// q [rows, q_heads, dim] -> the same shape in q's dtype; k_cache, v_cache [slots, kv_heads, dim] of
// float32, bfloat16 or float16; key_slots, key_pos [rows, keys] int64 (pos -1: padding); q_pos
// [rows] int64; window 0 = none. The kernel reads raw memory: every shape, dtype and layout it
// relies on is checked first (a ValueError in Python). A key slot outside the caches is skipped.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& key_slots, const at::Tensor& key_pos, const at::Tensor& q_pos,
                                  double scale, int64_t window) {
    const auto cache_type = k_cache.scalar_type();
    TORCH_CHECK_VALUE(
        q.dim() == 3 && k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == q.size(2) &&
            v_cache.scalar_type() == cache_type &&
            (cache_type == at::kFloat || cache_type == at::kBFloat16 || cache_type == at::kHalf) &&
            k_cache.is_contiguous() && v_cache.is_contiguous() && q.is_cpu() && k_cache.is_cpu() && v_cache.is_cpu() &&
            key_slots.dim() == 2 &&
            key_slots.sizes() == key_pos.sizes() && key_slots.size(0) == q.size(0) && q_pos.dim() == 1 &&
            q_pos.size(0) == q.size(0) && is_long_vector(key_slots) && is_long_vector(key_pos) &&
            is_long_vector(q_pos),
        "paged attention: inconsistent inputs q ", q.sizes(), ", caches ", k_cache.sizes(), " ", cache_type,
        ", key slots ", key_slots.sizes(), " ", key_slots.scalar_type(), ", positions ", key_pos.sizes(),
        ", query positions ", q_pos.sizes());
    const int64_t rows = q.size(0), q_heads = q.size(1), dim = q.size(2);
    const int64_t kv_heads = k_cache.size(1), keys = key_slots.size(1), slots = k_cache.size(0);
    const at::Tensor query = q.to(at::kFloat).contiguous();
    at::Tensor out = at::empty({rows, q_heads, dim}, q.options().dtype(at::kFloat));
    at::Tensor scratch = at::empty({scratch_floats(rows, keys, q_heads, dim)}, q.options().dtype(at::kFloat));
    const float* qp = query.const_data_ptr<float>();
    const int64_t* ks = key_slots.const_data_ptr<int64_t>();
    const int64_t* kp = key_pos.const_data_ptr<int64_t>();
    const int64_t* qpos = q_pos.const_data_ptr<int64_t>();
    float* op = out.mutable_data_ptr<float>();
    float* sp = scratch.mutable_data_ptr<float>();
    const void* kc = k_cache.const_data_ptr();
    const void* vc = v_cache.const_data_ptr();
    const float sc = static_cast<float>(scale);
    int status = 1;
    if (cache_type == at::kFloat)
        status = run<float>(qp, kc, vc, ks, kp, qpos, op, sp, rows, keys, q_heads, kv_heads, dim, slots, sc, window);
    else if (cache_type == at::kBFloat16)
        status = run<uint16_t>(qp, kc, vc, ks, kp, qpos, op, sp, rows, keys, q_heads, kv_heads, dim, slots, sc, window);
    else
        status = run<_Float16>(qp, kc, vc, ks, kp, qpos, op, sp, rows, keys, q_heads, kv_heads, dim, slots, sc, window);
    TORCH_CHECK_VALUE(status == 0, "the paged attention kernel does not take ", q_heads, " query heads over ",
                      kv_heads, " kv heads of dim ", dim);
    return q.scalar_type() == at::kFloat ? out : out.to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(mlxcel, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
