// One token per row of CPU logits, each row from its own values and uniform (issue 25):
// temperature, then top-k, top-p over what top-k kept (over the whole row without one), min-p
// against the best, and an inverse-CDF draw, in a few passes over the row and no vocabulary sort.
//
// Why C++: as torch ops the same chain was ~40 small ops (~0.6 ms a row on 2 cores), each
// waking the intra-op threads; here a row costs a max, one vectorised exp-sum and a compare pass
// over the vocabulary, then a sort of the few hundred tokens near the best.
//
// The draw is engine/sampler.py's: a row with neither top-k nor top-p walks its kept tokens in
// vocabulary order; the others walk them best first; the token is the first whose cumulative
// weight passes u x the kept weight. A row with no finite best (all -inf, or a NaN) gives -1.
// `banned` [rows, n] (-1: none) are tokens a row may not draw (its end tokens under ignore_eos or
// min_tokens), set to -inf here so the logits need no copy to change.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr float NUCLEUS_FLOOR = 1e-6f;  // sampler.py: top-p's candidates lie within this share of the best
constexpr int64_t BLOCK = 1024;  // tokens a partial sum covers in the in-order walk

// exp(d) for d <= 0, to ~2e-7 relative, written so the compiler vectorises the loops that call it.
inline float exp_nonpositive(float d) {
    const float t = std::max(d, -126.0f) * 1.4426950408889634f;  // log2(e)
    const float whole = std::floor(t);
    const float f = t - whole;  // 2^f on [0, 1): Taylor terms of (f ln 2)^n / n!, enough for float
    float p = 1.5252733804059840e-5f;
    p = p * f + 1.5403530393381609e-4f;
    p = p * f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    p = p * f + 1.0f;
    const float scale = __builtin_bit_cast(float, (static_cast<int32_t>(whole) + 127) << 23);
    return d < -87.0f ? 0.0f : p * scale;  // below float's range (and -inf): nothing
}

struct Params {
    float temperature, top_p, min_p, u;
    int64_t top_k;
};

struct Candidate {
    float value;
    int64_t id;
};

// Best first; equal values by token id, so a row's order never depends on how it was found.
inline bool better(const Candidate& a, const Candidate& b) { return a.value > b.value || (a.value == b.value && a.id < b.id); }

// The first candidate (in the given order) whose cumulative weight exp(value - best) passes u x
// the weight of the first `kept`; the last one with weight if rounding leaves none.
int64_t walk(const std::vector<Candidate>& order, size_t kept, float best, float u) {
    double total = 0.0;
    for (size_t i = 0; i < kept; ++i) total += exp_nonpositive(order[i].value - best);
    const double target = u * total;
    double mass = 0.0;
    int64_t last = -1;
    for (size_t i = 0; i < kept; ++i) {
        const float weight = exp_nonpositive(order[i].value - best);
        if (weight <= 0.0f) continue;
        mass += weight;
        last = order[i].id;
        if (mass > target) return last;
    }
    return last;
}

// No top-k, no top-p: the tokens within min-p of the best, walked in vocabulary order. `s` (the
// tempered row) is overwritten by the tokens' weights.
int64_t draw_in_order(float* s, int64_t vocab, float best, float cut, float u) {
    float* w = s;
#pragma omp simd
    for (int64_t i = 0; i < vocab; ++i) w[i] = s[i] >= cut ? exp_nonpositive(s[i] - best) : 0.0f;
    std::vector<double> sums((vocab + BLOCK - 1) / BLOCK);
    double total = 0.0;
    for (size_t b = 0; b < sums.size(); ++b) {
        float sum = 0.0f;
        const int64_t end = std::min(vocab, int64_t(b + 1) * BLOCK);
#pragma omp simd reduction(+ : sum)
        for (int64_t i = b * BLOCK; i < end; ++i) sum += w[i];
        sums[b] = sum;
        total += sum;
    }
    const double target = u * total;
    double mass = 0.0;
    int64_t last = -1;
    for (size_t b = 0; b < sums.size(); ++b) {
        if (mass + sums[b] <= target) {  // the whole block lies before the target
            mass += sums[b];
            for (int64_t i = std::min(vocab, int64_t(b + 1) * BLOCK) - 1; i >= int64_t(b) * BLOCK; --i)
                if (w[i] > 0.0f) { last = i; break; }
            continue;
        }
        for (int64_t i = b * BLOCK, end = std::min(vocab, int64_t(b + 1) * BLOCK); i < end; ++i) {
            if (w[i] <= 0.0f) continue;
            mass += w[i];
            last = i;
            if (mass > target) return i;
        }
    }
    return last;
}

// The smallest best-first prefix of `order` whose probabilities (weight / total) reach top_p,
// then only those within min-p of the best: how many of `order` stay.
size_t truncate(const std::vector<Candidate>& order, float best, double total, float top_p, float cut) {
    size_t kept = order.size();
    if (top_p < 1.0f) {
        double mass = 0.0;
        for (size_t i = 0; i < order.size(); ++i) {
            if (mass >= top_p * total) { kept = i; break; }
            mass += exp_nonpositive(order[i].value - best);
        }
    }
    size_t within = 0;
    while (within < kept && order[within].value >= cut) ++within;
    return std::max<size_t>(within, 1);
}

int64_t draw_row(const float* x, int64_t vocab, const Params& p, const int64_t* banned, int64_t num_banned,
                 std::vector<float>& scaled, std::vector<Candidate>& order) {
    scaled.resize(vocab);
    float* s = scaled.data();
#pragma omp simd
    for (int64_t i = 0; i < vocab; ++i) s[i] = x[i] / p.temperature;
    for (int64_t j = 0; j < num_banned; ++j)  // end tokens under ignore_eos / min_tokens (-1: padding)
        if (banned[j] >= 0 && banned[j] < vocab) s[banned[j]] = -std::numeric_limits<float>::infinity();
    float best = -std::numeric_limits<float>::infinity();
    int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
    for (int64_t i = 0; i < vocab; ++i) {
        best = s[i] > best ? s[i] : best;
        nan |= s[i] != s[i];
    }
    if (nan || !std::isfinite(best)) return -1;
    const float min_p_cut = p.min_p > 0.0f ? best + std::log(p.min_p) : -std::numeric_limits<float>::infinity();
    const bool has_top_k = p.top_k > 0;  // one past the vocabulary keeps it all, walked best first as sampler.py does
    const int64_t top_k = std::min(p.top_k, vocab);
    if (!has_top_k && p.top_p >= 1.0f) return draw_in_order(s, vocab, best, min_p_cut, p.u);
    order.clear();
    double total = 0.0;  // the weight top-p's probabilities are shares of
    if (has_top_k) {  // the k best by a min-heap of k, then every token tied with the k-th
        std::vector<float> heap(s, s + top_k);
        std::make_heap(heap.begin(), heap.end(), std::greater<float>());
        for (int64_t i = top_k; i < vocab; ++i) {
            if (s[i] > heap.front()) {
                std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
                heap.back() = s[i];
                std::push_heap(heap.begin(), heap.end(), std::greater<float>());
            }
        }
        const float kth = heap.front();
        for (int64_t i = 0; i < vocab; ++i)
            if (s[i] >= kth) order.push_back({s[i], i});
        std::sort(order.begin(), order.end(), better);
        for (const Candidate& c : order) total += exp_nonpositive(c.value - best);
    } else {  // top-p over the whole row: the tokens near the best, unless the nucleus reaches past them
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < vocab; ++i) sum += exp_nonpositive(s[i] - best);
        total = sum;
        const float floor = std::max(p.min_p, NUCLEUS_FLOOR);
        const float near = best + std::log(floor);
        double near_mass = 0.0;
        for (int64_t i = 0; i < vocab; ++i)
            if (s[i] >= near) order.push_back({s[i], i});
        for (const Candidate& c : order) near_mass += exp_nonpositive(c.value - best);
        if (near_mass < p.top_p * total && p.min_p < NUCLEUS_FLOOR) {  // a flat row: every finite token
            order.clear();
            for (int64_t i = 0; i < vocab; ++i)
                if (s[i] > -std::numeric_limits<float>::infinity()) order.push_back({s[i], i});
        }
        std::sort(order.begin(), order.end(), better);
    }
    return walk(order, truncate(order, best, total, p.top_p, min_p_cut), best, p.u);
}

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& uniforms,
                       const at::Tensor& banned) {
    TORCH_CHECK_VALUE(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "sample_rows: logits must be "
                      "[rows, vocab] float32, not ", logits.sizes(), " ", logits.scalar_type());
    const int64_t rows = logits.size(0), vocab = logits.size(1);
    for (const at::Tensor* t : {&temperature, &top_p, &min_p, &uniforms})
        TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == rows && t->scalar_type() == at::kFloat && t->is_contiguous(),
                          "sample_rows: each row parameter must be [rows] float32");
    TORCH_CHECK_VALUE(top_k.dim() == 1 && top_k.size(0) == rows && top_k.scalar_type() == at::kLong &&
                          top_k.is_contiguous(), "sample_rows: top_k must be [rows] int64");
    TORCH_CHECK_VALUE(banned.dim() == 2 && banned.size(0) == rows && banned.scalar_type() == at::kLong &&
                          banned.is_contiguous(), "sample_rows: banned must be [rows, n] int64");
    const int64_t num_banned = banned.size(1);
    const int64_t* bans = banned.const_data_ptr<int64_t>();
    const at::Tensor x = logits.contiguous();
    at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
    const float* xs = x.const_data_ptr<float>();
    const float *t = temperature.const_data_ptr<float>(), *tp = top_p.const_data_ptr<float>(),
                *mp = min_p.const_data_ptr<float>(), *u = uniforms.const_data_ptr<float>();
    const int64_t* k = top_k.const_data_ptr<int64_t>();
    int64_t* tokens = out.mutable_data_ptr<int64_t>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {  // a row or a few run on the calling thread
        std::vector<float> scaled;
        std::vector<Candidate> order;
        for (int64_t r = begin; r < end; ++r)
            tokens[r] = draw_row(xs + r * vocab, vocab, Params{t[r], tp[r], mp[r], u[r], k[r]}, bans + r * num_banned,
                                 num_banned, scaled, order);
    });
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mlxcel, m) {
    m.def("sample_rows(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, "
          "Tensor uniforms, Tensor banned) -> Tensor");
}

TORCH_LIBRARY_IMPL(mlxcel, CPU, m) { m.impl("sample_rows", &sample_rows); }
