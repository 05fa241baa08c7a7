// The ascend_graph::* kernel ops' CPU kernels, registered with torch's dispatcher: rows_mm,
// rows_bmm, expert_rows_mm and decode_attention (schemas, fakes and contracts: kernels/ops.py).
// Each checks its arguments (a ValueError naming the op, the argument and what was expected,
// raised before anything runs), allocates its output and calls the C entry point linked beside
// it. Written in C++ so that a compiled step's call costs the kernel and the dispatcher, not an
// interpreter.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <sstream>
#include <string>

extern "C" {
// csrc/moe.c (expert_rows_f32: the same over float32, csrc/matmul_f32.c)
int expert_rows(const void *x, const void *w, const int32_t *ends, void *out, long experts, long n, long k,
                int threads);
int expert_rows_f32(const void *x, const void *w, const int32_t *ends, void *out, long experts, long n, long k,
                    int threads);
// csrc/matmul_kn.c
int kn_rows(const void *x, const void *w, long ws, void *out, long experts, long rows, long k, long n, int threads);
// csrc/decode_attention.c
int decode_attention(const void *q, const void *qr, const void *k, const void *r, const void *v, const int32_t *table,
                     const int32_t *ctx, void *out, long rows, long hk, long g, long kw, long rw, long vw,
                     const long *strides, long tw, long bs, float scale, int bf16, int threads);
}

namespace {

using at::Tensor;

// A shape as Python prints a tuple: (2, 32), (3,), ().
std::string shape(const Tensor &t) {
    std::ostringstream s;
    s << "(";
    for (int64_t i = 0; i < t.dim(); i++) s << (i ? ", " : "") << t.size(i);
    s << (t.dim() == 1 ? ",)" : ")");
    return s.str();
}

// A dtype as Python prints it: torch.float32.
std::string dtype_name(const Tensor &t) { return "torch." + std::string(c10::getDtypeNames(t.scalar_type()).first); }

void check_shapes(const char *op, bool ok, const char *expected, std::initializer_list<const Tensor *> tensors) {
    if (ok) return;
    std::string got;
    for (auto *t : tensors) got += (got.empty() ? "" : ", ") + shape(*t);
    TORCH_CHECK_VALUE(false, op, ": expected ", expected, "; got ", got);
}

// x and the weight w: CPU tensors of one dtype, bfloat16 (or float32 where f32 is allowed).
void check_rows_dtypes(const char *op, const Tensor &x, const Tensor &w, bool f32) {
    bool dtype_ok = x.scalar_type() == at::kBFloat16 || (f32 && x.scalar_type() == at::kFloat);
    TORCH_CHECK_VALUE(dtype_ok && w.scalar_type() == x.scalar_type() && x.device().is_cpu() && w.device().is_cpu(),
                      op, ": x and w must be ", f32 ? "bfloat16 or float32" : "bfloat16",
                      " CPU tensors of one dtype, got ", dtype_name(x), "/", dtype_name(w), " on ",
                      x.device().str(), "/", w.device().str());
}

void check_status(const char *op, int status, const char *what) {
    TORCH_CHECK(status == 0, op, ": the kernel could not run (out of memory for the ", what, ")");
}

// t itself where it is int32 and contiguous (no dispatch), else an int32 contiguous copy.
Tensor as_int32(const Tensor &t) { return t.scalar_type() == at::kInt ? t.contiguous() : t.to(at::kInt).contiguous(); }

// expert_rows over checked x [P, K], w [X, N, K] (rows_mm: [N, K], one "expert") and X int32 row ends -> [P, N].
Tensor run_rows(const char *op, const Tensor &x, const Tensor &w, const int32_t *ends) {
    Tensor xc = x.contiguous(), wc = w.contiguous();
    const int64_t experts = w.dim() == 3 ? w.size(0) : 1, n = w.size(-2), k = w.size(-1);
    Tensor out = at::empty({x.size(0), n}, x.options());
    auto entry = x.scalar_type() == at::kFloat ? expert_rows_f32 : expert_rows;
    check_status(op, entry(xc.data_ptr(), wc.data_ptr(), ends, out.data_ptr(), experts, n, k, at::get_num_threads()),
                 "copied rows");
    return out;
}

Tensor rows_mm(const Tensor &x, const Tensor &w) {
    check_rows_dtypes("rows_mm", x, w, true);
    check_shapes("rows_mm", x.dim() == 2 && w.dim() == 2 && w.size(1) == x.size(1), "x [M, K] and w [N, K]", {&x, &w});
    int32_t end = static_cast<int32_t>(x.size(0));  // one "expert"
    return run_rows("rows_mm", x, w, &end);
}

Tensor expert_rows_mm(const Tensor &x, const Tensor &w, const Tensor &ends) {
    check_rows_dtypes("expert_rows_mm", x, w, true);
    check_shapes("expert_rows_mm", x.dim() == 2 && w.dim() == 3 && w.size(2) == x.size(1) && ends.dim() == 1
                 && ends.size(0) == w.size(0), "x [P, K], w [X, N, K], ends [X]", {&x, &w, &ends});
    Tensor e = as_int32(ends);
    const int32_t *p = e.data_ptr<int32_t>();
    const int64_t last = e.size(0) ? p[e.size(0) - 1] : 0;
    TORCH_CHECK_VALUE(x.size(0) == 0 || (last >= 0 && last <= x.size(0)),
                      "expert_rows_mm: ends[-1] must be in [0, the row count ", x.size(0), "], got ", last);
    Tensor out = run_rows("expert_rows_mm", x, w, p);
    if (last < x.size(0)) out.narrow(0, last, x.size(0) - last).zero_();  // rows past the last end: no expert's
    return out;
}

Tensor rows_bmm(const Tensor &x, const Tensor &w) {
    check_rows_dtypes("rows_bmm", x, w, false);
    check_shapes("rows_bmm", x.dim() == 3 && w.dim() == 3 && w.size(0) == x.size(0) && w.size(1) == x.size(2),
                 "x [X, M, K] and w [X, K, N]", {&x, &w});
    Tensor xc = x.contiguous();
    Tensor wc = w.stride(2) != 1 || w.stride(1) != w.size(2) ? w.contiguous() : w;  // entries may lie apart
    Tensor out = at::empty({x.size(0), x.size(1), w.size(2)}, x.options());
    check_status("rows_bmm", kn_rows(xc.data_ptr(), wc.data_ptr(), wc.stride(0), out.data_ptr(), x.size(0), x.size(1),
                                     x.size(2), w.size(2), at::get_num_threads()), "packed rows");
    return out;
}

// ---- decode_attention: the checks of kernels/attention.py's check_layout and check_values ----

std::string opt_shape(const std::optional<Tensor> &t) { return t ? shape(*t) : "None"; }

// (Hk, Hq / Hk), or ValueError naming the argument that is off.
std::pair<int64_t, int64_t> check_attention(const Tensor &q, const std::optional<Tensor> &q_rope, const Tensor &k,
                                            const std::optional<Tensor> &r, const Tensor &v, const Tensor &tables,
                                            const Tensor &ctx) {
    const char *op = "decode_attention";
    bool dtype_ok = q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16;
    std::string dtypes, devices = "cpu";
    for (const Tensor *t : {&q, q_rope ? &*q_rope : nullptr, &k, r ? &*r : nullptr, &v}) {
        if (!t) continue;
        dtypes += (dtypes.empty() ? "'" : ", '") + dtype_name(*t) + "'";
        dtype_ok = dtype_ok && t->scalar_type() == q.scalar_type();
        if (!t->device().is_cpu()) devices = t->device().str();
    }
    TORCH_CHECK_VALUE(dtype_ok && devices == "cpu", op, ": q, q_rope, k_cache, rope_cache and v_cache must be CPU ",
                      "tensors of one dtype, float32 or bfloat16; got [", dtypes, "] on ", devices);
    TORCH_CHECK_VALUE(tables.device().is_cpu(), op, ": block_tables must be on the CPU, got ", tables.device().str());
    TORCH_CHECK_VALUE(ctx.device().is_cpu(), op, ": context_lens must be on the CPU, got ", ctx.device().str());
    bool ok = q.dim() == 3 && k.dim() == 4 && v.dim() == 4 && k.size(0) == v.size(0) && k.size(1) == v.size(1)
              && k.size(2) == v.size(2) && q.size(2) == k.size(3) && k.size(2) >= 1 && q.size(1) % k.size(2) == 0;
    check_shapes(op, ok, "q [B, Hq, Dk], k_cache [N, S, Hk, Dk] and v_cache [N, S, Hk, Dv], Hq a multiple of Hk",
                 {&q, &k, &v});
    TORCH_CHECK_VALUE(q_rope.has_value() == r.has_value(), op, ": q_rope and rope_cache go together; got q_rope ",
                      opt_shape(q_rope), ", rope_cache ", opt_shape(r));
    if (r) {
        const Tensor &qr = *q_rope;
        check_shapes(op, qr.dim() == 3 && qr.size(0) == q.size(0) && qr.size(1) == q.size(1) && r->dim() == 4
                     && r->size(0) == k.size(0) && r->size(1) == k.size(1) && r->size(2) == k.size(2)
                     && qr.size(2) == r->size(3), "q_rope [B, Hq, R] and rope_cache [N, S, Hk, R]", {&qr, &*r});
    }
    for (auto [arg, t] : {std::pair{"k_cache", &k}, {"rope_cache", r ? &*r : nullptr}, {"v_cache", &v}}) {
        if (!t || t->stride(-1) == 1) continue;
        std::ostringstream s;
        s << "(";
        for (int64_t i = 0; i < t->dim(); i++) s << (i ? ", " : "") << t->stride(i);
        TORCH_CHECK_VALUE(false, op, ": ", arg, "'s last dimension must be contiguous, got strides ", s.str(), ")");
    }
    check_shapes(op, tables.dim() == 2 && tables.size(0) == q.size(0) && ctx.dim() == 1 && ctx.size(0) == q.size(0),
                 "block_tables [B, W] and context_lens [B]", {&q, &tables, &ctx});
    for (auto [arg, t] : {std::pair{"block_tables", &tables}, {"context_lens", &ctx}})
        TORCH_CHECK_VALUE(t->scalar_type() == at::kInt || t->scalar_type() == at::kLong, op, ": ", arg,
                          " must be int32 or int64, got ", dtype_name(*t));
    return {k.size(2), q.size(1) / k.size(2)};
}

// The range checks, on the int32 copies the kernel reads: ValueError naming the argument.
void check_ranges(const Tensor &tables, const Tensor &ctx, int64_t blocks, int64_t block_size) {
    const int64_t slots = tables.size(1) * block_size;
    const int32_t *c = ctx.data_ptr<int32_t>(), *t = tables.data_ptr<int32_t>();
    if (ctx.numel()) {
        auto [lo, hi] = std::minmax_element(c, c + ctx.numel());
        TORCH_CHECK_VALUE(*lo >= 0 && *hi <= slots, "decode_attention: context_lens must lie in [0, ", slots,
                          "] (block_tables' ", tables.size(1), " blocks of ", block_size, "), got ", *lo, "..", *hi);
    }
    if (tables.numel()) {
        auto [lo, hi] = std::minmax_element(t, t + tables.numel());
        TORCH_CHECK_VALUE(*lo >= 0 && *hi < blocks, "decode_attention: block_tables ids must lie in [0, ", blocks,
                          "), got ", *lo, "..", *hi);
    }
}

Tensor decode_attention_op(const Tensor &q, const std::optional<Tensor> &q_rope, const Tensor &k_cache,
                           const std::optional<Tensor> &rope_cache, const Tensor &v_cache, const Tensor &block_tables,
                           const Tensor &context_lens, double scale) {
    auto [hk, g] = check_attention(q, q_rope, k_cache, rope_cache, v_cache, block_tables, context_lens);
    Tensor tables = as_int32(block_tables), ctx = as_int32(context_lens);
    check_ranges(tables, ctx, k_cache.size(0), k_cache.size(1));
    Tensor qc = q.contiguous();
    std::optional<Tensor> qr = q_rope ? std::optional<Tensor>(q_rope->contiguous()) : std::nullopt;
    Tensor out = at::empty({q.size(0), q.size(1), v_cache.size(-1)}, q.options());
    if (out.numel() == 0) return out;
    const Tensor &rope = rope_cache ? *rope_cache : k_cache;
    long strides[9];
    int i = 0;
    for (const Tensor *t : {&k_cache, &rope, &v_cache})
        for (int d = 0; d < 3; d++) strides[i++] = t->stride(d);
    int status = decode_attention(qc.data_ptr(), qr ? qr->data_ptr() : nullptr, k_cache.data_ptr(), rope.data_ptr(),
                                  v_cache.data_ptr(), tables.data_ptr<int32_t>(), ctx.data_ptr<int32_t>(),
                                  out.data_ptr(), q.size(0), hk, g, q.size(2), qr ? qr->size(2) : 0, out.size(2),
                                  strides, tables.size(1), k_cache.size(1), static_cast<float>(scale),
                                  q.scalar_type() == at::kBFloat16, at::get_num_threads());
    check_status("decode_attention", status, "work list");
    return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(ascend_graph, CPU, m) {
    m.impl("rows_mm", &rows_mm);
    m.impl("rows_bmm", &rows_bmm);
    m.impl("expert_rows_mm", &expert_rows_mm);
    m.impl("decode_attention", &decode_attention_op);
}
