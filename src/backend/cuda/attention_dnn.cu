// Causal attention on cuDNN's fused flash-attention engines (bf16), built through its
// graph (backend) API: the same graph of operations that NVIDIA's cudnn-frontend lowers
// its SDPA node to, written here against libcudnn's C API (opened by libraries.cuh).
//
//   forward   S = Q K^T · scale, causal mask (row >= column, else -inf), softmax with
//             stats = max + log(sum) (the lse the other paths keep, natural log), O = P V
//   backward  D = rowsum(dO · O); P = exp(S · scale - stats) under the mask;
//             dV = P^T dO; dS = P · (dO V^T - D) · scale; dQ = dS K; dK = dS^T Q
//
// The backward is the form cuDNN runs without atomics (dQ straight from dS K, no fp32
// accumulator: the frontend's "deterministic" choice on Hopper), and among the engines
// the heuristics rank, only those without CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC are
// taken: the same bits on every run. The engine is chosen by the heuristics' ranking
// (mode A, a function of the shape and the GPU), never by timing, so every rank and
// every K takes the same one for a shape.
//
// A plan is built once per shape and direction. Where cuDNN declines (no engine, no
// deterministic one, workspace over kMaxWorkspace), dnn_attention_* return false and
// attention.cu's FlashAttention-2 kernel takes the call. q, k and v are read where they
// lie in qkv (B, T, C + 2 KV): the strides say which head is where, no copies.
//
// Grouped-query attention as the frontend writes it: k and v of KVH heads (strides into
// the same rows), broadcast by the matmuls over each group of H / KVH query heads; the
// backward's dK and dV per query head (virtual, bf16), a reduction adding each group
// into its key/value head (in a fixed order: deterministic engines only, as above).
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "attention_dnn.cuh"
#include "kernels.cuh"

namespace mpipe::cuda {

namespace {

// Deprecated names in cuDNN 9's headers that are still how a graph and a plan get their
// handle (the frontend sets them too).
constexpr auto kGraphHandle = static_cast<cudnnBackendAttributeName_t>(800);  // CUDNN_ATTR_OPERATIONGRAPH_HANDLE
constexpr auto kPlanHandle = static_cast<cudnnBackendAttributeName_t>(400);   // CUDNN_ATTR_EXECUTION_PLAN_HANDLE

// The deterministic backward keeps dP (B, H, T, T) in bf16 in its workspace: 256 MiB at
// GPT-2 medium's batch 8 (H 16, T 1024), which conv_dnn.cu's 256 MiB cap would decline.
constexpr std::size_t kMaxWorkspace = std::size_t{1} << 30;
constexpr std::size_t kMaxPacks = 256;  // variant packs kept per plan (one per set of pointers)

// Why a plan could not be built: said once per shape under MPIPE_ATTENTION=verbose.
struct Declined {
  std::string why;
};

void check(cudnnStatus_t status, const char* what) {
  if (status != CUDNN_STATUS_SUCCESS) throw Declined{cat(what, ": ", lib().cudnnGetErrorString(status))};
}

// One backend descriptor, destroyed with its owner.
class Desc {
 public:
  explicit Desc(cudnnBackendDescriptorType_t type) { check(lib().cudnnBackendCreateDescriptor(type, &d_), "create"); }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  ~Desc() {
    if (d_) lib().cudnnBackendDestroyDescriptor(d_);
  }
  cudnnBackendDescriptor_t get() const { return d_; }

  template <class T>
  void set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count, const T* values,
           const char* what) {
    check(lib().cudnnBackendSetAttribute(d_, name, type, count, values), what);
  }
  void set(cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t other, const char* what) {
    set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &other, what);
  }
  void finalize(const char* what) { check(lib().cudnnBackendFinalize(d_), what); }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

using Dims = std::vector<int64_t>;

// A graph being written: its tensors and operations (kept alive with the plan), and the
// unique ids of the tensors a call binds to memory.
class GraphBuilder {
 public:
  // A tensor: `uid` > 0 names one bound at run time; virtual ones get their own. One
  // descriptor per uid: an input read by two operations is the same descriptor in both.
  cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t type, const Dims& dims, const Dims& strides,
                                  bool is_virtual, bool by_value = false) {
    Desc& t = keep(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t id = uid > 0 ? uid : next_virtual_++;
    const int64_t alignment = 16;
    const auto rank = static_cast<int64_t>(dims.size());
    t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type, "tensor type");
    t.set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, rank, dims.data(), "tensor dimensions");
    t.set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, rank, strides.data(), "tensor strides");
    t.set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &id, "tensor id");
    t.set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment, "tensor alignment");
    t.set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual, "tensor virtual");
    if (by_value) t.set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, "tensor by value");
    t.finalize("tensor");
    return t.get();
  }
  // A virtual fp32 (or `type`) tensor of dims with row-major strides.
  cudnnBackendDescriptor_t temp(const Dims& dims, cudnnDataType_t type = CUDNN_DATA_FLOAT) {
    Dims strides(dims.size());
    int64_t at = 1;
    for (std::size_t i = dims.size(); i-- > 0;) {
      strides[i] = at;
      at *= dims[i];
    }
    return tensor(0, type, dims, strides, true);
  }
  cudnnBackendDescriptor_t scalar(int64_t uid) {
    return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true);
  }

  void matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
    Desc& desc = keep(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    desc.set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute, "matmul compute type");
    desc.finalize("matmul");
    Desc& op = keep(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    op.set(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a, "matmul a");
    op.set(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b, "matmul b");
    op.set(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c, "matmul c");
    op.set(CUDNN_ATTR_OPERATION_MATMUL_DESC, desc.get(), "matmul descriptor");
    op.finalize("matmul operation");
    ops_.push_back(op.get());
  }
  // y = mode(x[, b[, t]]); `axis` for GEN_INDEX.
  void pointwise(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                 cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y, cudnnDataType_t math = CUDNN_DATA_FLOAT,
                 int64_t axis = -1) {
    Desc& desc = keep(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    desc.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, "pointwise mode");
    desc.set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math, "pointwise precision");
    if (axis >= 0) desc.set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, "pointwise axis");
    desc.finalize("pointwise");
    Desc& op = keep(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    op.set(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, desc.get(), "pointwise descriptor");
    op.set(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x, "pointwise x");
    op.set(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y, "pointwise y");
    if (b) op.set(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b, "pointwise b");
    if (t) op.set(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t, "pointwise t");
    const float one = 1.0f;
    op.set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one, "pointwise alpha1");
    op.set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one, "pointwise alpha2");
    op.finalize("pointwise operation");
    ops_.push_back(op.get());
  }
  void reduction(cudnnReduceTensorOp_t how, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    Desc& desc = keep(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    desc.set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute, "reduction compute type");
    desc.set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &how, "reduction operator");
    desc.finalize("reduction");
    Desc& op = keep(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    op.set(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x, "reduction x");
    op.set(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y, "reduction y");
    op.set(CUDNN_ATTR_OPERATION_REDUCTION_DESC, desc.get(), "reduction descriptor");
    op.finalize("reduction operation");
    ops_.push_back(op.get());
  }
  // y: x's elements under y's dims and strides (a transpose, as the frontend writes P^T).
  void reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    Desc& op = keep(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    op.set(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x, "reshape x");
    op.set(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y, "reshape y");
    op.finalize("reshape operation");
    ops_.push_back(op.get());
  }
  // The causal mask over scores s (b, h, T, T): row >= column kept, the rest -inf.
  cudnnBackendDescriptor_t causal(cudnnBackendDescriptor_t s, const Dims& dims, cudnnBackendDescriptor_t neg_inf) {
    cudnnBackendDescriptor_t row = temp(dims, CUDNN_DATA_INT32), column = temp(dims, CUDNN_DATA_INT32);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, row, CUDNN_DATA_FLOAT, 2);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, s, nullptr, nullptr, column, CUDNN_DATA_FLOAT, 3);
    cudnnBackendDescriptor_t keep_it = temp(dims, CUDNN_DATA_BOOLEAN);
    pointwise(CUDNN_POINTWISE_CMP_GE, row, column, nullptr, keep_it, CUDNN_DATA_BOOLEAN);
    cudnnBackendDescriptor_t masked = temp(dims);
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, neg_inf, keep_it, masked);
    return masked;
  }

  const std::vector<cudnnBackendDescriptor_t>& ops() const { return ops_; }
  std::vector<std::unique_ptr<Desc>>& owned() { return owned_; }

 private:
  Desc& keep(cudnnBackendDescriptorType_t type) {
    owned_.push_back(std::make_unique<Desc>(type));
    return *owned_.back();
  }
  std::vector<std::unique_ptr<Desc>> owned_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  int64_t next_virtual_ = 1000;
};

// The tensors a call binds, by unique id.
enum Uid : int64_t {
  kQ = 1, kK, kV, kO, kStats, kScale, kNegInf,  // forward (and backward's inputs)
  kDO, kDQ, kDK, kDV, kRowDots, kOne,            // backward
};

// A call's bound pointers (in a plan's uids order), then its workspace.
constexpr std::size_t kMaxBound = 10;
using Pointers = std::array<void*, kMaxBound + 1>;

// A finalized plan, what it was built from, and the variant packs made for it.
struct DnnAttention {
  std::vector<std::unique_ptr<Desc>> owned;  // tensors, operations, graph
  std::unique_ptr<Desc> plan;
  std::vector<int64_t> uids;  // bound at run time, in the order run() takes pointers
  std::size_t workspace = 0;
  int64_t engine = -1;
  float scale = 1.0f, neg_inf = -INFINITY, one = 1.0f;  // the by-value scalars (their addresses go in the packs)
  bool binds_one = false;  // the backward's: D = rowsum(dO · O) · 1, as the frontend writes it
  bool proven = false;  // has run once: from then on a failure is an error, not a decline
  std::map<Pointers, std::unique_ptr<Desc>> packs;
};

// The first engine config of `mode`'s ranking whose engine is deterministic, whose plan
// finalizes and whose workspace fits, into `a`; false when none (why, appended to `passed`).
bool choose_engine(DnnAttention& a, cudnnBackendDescriptor_t graph, cudnnBackendHeurMode_t mode, std::string& passed) {
  const Libraries& l = lib();
  cudnnHandle_t handle = context().dnn;
  Desc heuristics(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  heuristics.set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph, "heuristics graph");
  heuristics.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics mode");
  heuristics.finalize("heuristics");
  int64_t count = 0;
  check(l.cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0,
                                   &count, nullptr),
        "heuristics count");
  std::vector<std::unique_ptr<Desc>> configs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i) {
    configs.push_back(std::make_unique<Desc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
    raw.push_back(configs.back()->get());
  }
  int64_t returned = 0;
  if (count > 0)
    check(l.cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                     count, &returned, raw.data()),
          "heuristics results");
  passed += cat(" mode ", static_cast<int>(mode), ": ", returned, " configs");
  for (int64_t i = 0; i < returned; ++i) {
    Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
    cudnnBackendDescriptor_t engine_raw = engine.get();
    int64_t n = 0;
    if (l.cudnnBackendGetAttribute(raw[static_cast<std::size_t>(i)], CUDNN_ATTR_ENGINECFG_ENGINE,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &engine_raw) != CUDNN_STATUS_SUCCESS)
      continue;
    int64_t index = -1;
    l.cudnnBackendGetAttribute(engine_raw, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &index);
    cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
    int64_t note_count = 0;
    bool deterministic = true;
    if (l.cudnnBackendGetAttribute(engine_raw, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                                   CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &note_count, notes) == CUDNN_STATUS_SUCCESS) {
      for (int64_t j = 0; j < note_count; ++j)
        if (notes[j] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC) deterministic = false;
    }
    if (!deterministic) {
      passed += cat(", ", index, " nondeterministic");
      continue;
    }
    auto plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    plan->set(kPlanHandle, CUDNN_TYPE_HANDLE, 1, &handle, "plan handle");
    plan->set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, raw[static_cast<std::size_t>(i)], "plan engine config");
    if (const cudnnStatus_t status = l.cudnnBackendFinalize(plan->get()); status != CUDNN_STATUS_SUCCESS) {
      passed += cat(", ", index, " declined (", l.cudnnGetErrorString(status), ")");
      continue;
    }
    int64_t workspace = 0;
    check(l.cudnnBackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n,
                                     &workspace),
          "plan workspace");
    if (workspace < 0 || static_cast<std::size_t>(workspace) > kMaxWorkspace) {
      passed += cat(", ", index, " workspace ", workspace, " B");
      continue;
    }
    a.plan = std::move(plan);
    a.workspace = static_cast<std::size_t>(workspace);
    a.engine = index;
    a.owned.push_back(std::move(configs[static_cast<std::size_t>(i)]));  // the plan's engine config, as the frontend keeps it
    return true;
  }
  return false;
}

// The plan of a written graph: the engine heuristics mode A ranks first among those
// choose_engine takes, else the fallback list's (both a function of the graph and the
// GPU, never of timing).
void finish(DnnAttention& a, GraphBuilder& g) {
  cudnnHandle_t handle = context().dnn;
  auto graph = std::make_unique<Desc>(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
  graph->set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(g.ops().size()),
             g.ops().data(), "graph operations");
  graph->set(kGraphHandle, CUDNN_TYPE_HANDLE, 1, &handle, "graph handle");
  graph->finalize("operation graph");
  std::string passed;
  for (const cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    bool chosen = false;
    try {  // a mode whose heuristics fail leaves the next one to try
      chosen = choose_engine(a, graph->get(), mode, passed);
    } catch (const Declined& d) {
      passed += cat(" mode ", static_cast<int>(mode), ": ", d.why);
    }
    if (chosen) {
      for (auto& d : g.owned()) a.owned.push_back(std::move(d));
      a.owned.push_back(std::move(graph));
      return;
    }
  }
  throw Declined{cat("no usable engine:", passed)};
}

// Shapes: b, h, T, hs; C = h · hs; q, k, v in qkv (B, T, C + 2 KV) (k and v of KVH
// heads); o, do in (B, T, C).
struct Shape : Heads {
  Dims heads() const { return {B, H, T, hs}; }
  Dims kv_heads() const { return {B, KVH, T, hs}; }
  Dims kv_heads_t() const { return {B, KVH, hs, T}; }  // K^T, V^T
  Dims scores() const { return {B, H, T, T}; }
  Dims rows() const { return {B, H, T, 1}; }
  Dims in_qkv() const { return {T * ld(), hs, ld(), 1}; }  // a head's rows in qkv, q's or k's or v's
  Dims in_qkv_t() const { return {T * ld(), hs, 1, ld()}; }
  Dims in_out() const { return {T * C(), hs, C(), 1}; }
  Dims row_strides() const { return {H * T, T, 1, 1}; }
};

constexpr cudnnDataType_t kBf16 = CUDNN_DATA_BFLOAT16;

// The tensors both directions bind: q, K^T, v (as V^T for the backward's dO V^T), o, the
// stats, and the two scalars.
struct Bound {
  cudnnBackendDescriptor_t q, kt, v, o, stats, scale, neg_inf;
};
Bound bind_common(GraphBuilder& g, const Shape& s, bool v_transposed) {
  return {g.tensor(kQ, kBf16, s.heads(), s.in_qkv(), false),
          g.tensor(kK, kBf16, s.kv_heads_t(), s.in_qkv_t(), false),
          v_transposed ? g.tensor(kV, kBf16, s.kv_heads_t(), s.in_qkv_t(), false)
                       : g.tensor(kV, kBf16, s.kv_heads(), s.in_qkv(), false),
          g.tensor(kO, kBf16, s.heads(), s.in_out(), false),
          g.tensor(kStats, CUDNN_DATA_FLOAT, s.rows(), s.row_strides(), false),
          g.scalar(kScale),
          g.scalar(kNegInf)};
}

void build_forward(DnnAttention& a, const Shape& s) {
  GraphBuilder g;
  const cudnnDataType_t bf = kBf16;
  const auto [q, kt, v, o, stats, scale, neg_inf] = bind_common(g, s, false);

  auto scores = g.temp(s.scores());
  g.matmul(q, kt, scores);
  auto scaled = g.temp(s.scores());
  g.pointwise(CUDNN_POINTWISE_MUL, scores, scale, nullptr, scaled);
  auto masked = g.causal(scaled, s.scores(), neg_inf);
  auto row_max = g.temp(s.rows());
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, masked, row_max);
  auto shifted = g.temp(s.scores());
  g.pointwise(CUDNN_POINTWISE_SUB, masked, row_max, nullptr, shifted);
  auto exps = g.temp(s.scores());
  g.pointwise(CUDNN_POINTWISE_EXP, shifted, nullptr, nullptr, exps);
  auto row_sum = g.temp(s.rows());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, exps, row_sum);
  auto log_sum = g.temp(s.rows());
  g.pointwise(CUDNN_POINTWISE_LOG, row_sum, nullptr, nullptr, log_sum);
  g.pointwise(CUDNN_POINTWISE_ADD, row_max, log_sum, nullptr, stats);
  auto probs = g.temp(s.scores(), bf);
  g.pointwise(CUDNN_POINTWISE_DIV, exps, row_sum, nullptr, probs);
  g.matmul(probs, v, o);
  a.uids = {kQ, kK, kV, kO, kStats};
  finish(a, g);
}

void build_backward(DnnAttention& a, const Shape& s) {
  GraphBuilder g;
  const cudnnDataType_t bf = kBf16;
  const auto [q, kt, vt, o, stats, scale, neg_inf] = bind_common(g, s, true);
  auto d_o = g.tensor(kDO, bf, s.heads(), s.in_out(), false);
  auto dq = g.tensor(kDQ, bf, s.heads(), s.in_qkv(), false);
  auto dk = g.tensor(kDK, bf, s.kv_heads(), s.in_qkv(), false);
  auto dv = g.tensor(kDV, bf, s.kv_heads(), s.in_qkv(), false);
  // A product for dK or dV: straight into it, or grouped, per query head (virtual,
  // (B, H, T, hs) packed, bf16 as the frontend's) and each group's heads added into it.
  const auto into = [&](cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t out) {
    if (s.KVH == s.H) return g.matmul(a, b, out);
    auto per_head = g.tensor(0, bf, s.heads(), {s.H * s.T * s.hs, s.T * s.hs, s.hs, 1}, true);
    g.matmul(a, b, per_head);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, per_head, out);
  };
  auto row_dots = g.tensor(kRowDots, CUDNN_DATA_FLOAT, s.rows(), s.row_strides(), false);
  const Dims scores_t = {s.B, s.H, s.T, s.T}, scores_t_strides = {s.H * s.T * s.T, s.T * s.T, 1, s.T};

  // D = rowsum(dO · O) · 1: the frontend's graph (and its backend sample) multiply the
  // sum by a by-value scalar (the dropout's inverse scale, 1 without dropout) before it
  // is stored; the fused engines' pattern is that.
  auto products = g.tensor(0, CUDNN_DATA_FLOAT, s.heads(), {s.H * s.T * s.hs, s.T * s.hs, s.H * s.hs, 1}, true);
  g.pointwise(CUDNN_POINTWISE_MUL, d_o, o, nullptr, products);
  auto row_sums = g.temp(s.rows());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, products, row_sums);
  g.pointwise(CUDNN_POINTWISE_MUL, row_sums, g.scalar(kOne), nullptr, row_dots);
  a.binds_one = true;
  // P = exp(S · scale - stats), masked
  auto scores = g.temp(s.scores());
  g.matmul(q, kt, scores);
  auto scaled = g.temp(s.scores());
  g.pointwise(CUDNN_POINTWISE_MUL, scores, scale, nullptr, scaled);
  auto centred = g.temp(s.scores());
  g.pointwise(CUDNN_POINTWISE_SUB, scaled, stats, nullptr, centred);
  auto masked = g.causal(centred, s.scores(), neg_inf);
  auto probs = g.temp(s.scores());
  g.pointwise(CUDNN_POINTWISE_EXP, masked, nullptr, nullptr, probs);
  // dV = P^T dO
  auto probs_t = g.tensor(0, bf, scores_t, scores_t_strides, true);
  g.reshape(probs, probs_t);
  into(probs_t, d_o, dv);
  // dS = P · (dO V^T - D) · scale
  auto dprobs = g.temp(s.scores());
  g.matmul(d_o, vt, dprobs);
  auto centred_d = g.temp(s.scores());
  g.pointwise(CUDNN_POINTWISE_SUB, dprobs, row_dots, nullptr, centred_d);
  auto dscores = g.temp(s.scores());
  g.pointwise(CUDNN_POINTWISE_MUL, centred_d, probs, nullptr, dscores);
  auto dscores_scaled = g.temp(s.scores());
  g.pointwise(CUDNN_POINTWISE_MUL, dscores, scale, nullptr, dscores_scaled);
  // dK = dS^T Q
  auto dscores_t = g.tensor(0, bf, scores_t, scores_t_strides, true);
  g.reshape(dscores_scaled, dscores_t);
  into(dscores_t, q, dk);
  // dQ = dS K: K^T read back as K (b, kvh, T, hs)
  auto k = g.tensor(0, bf, s.kv_heads(), s.in_qkv(), true);
  g.reshape(kt, k);
  g.matmul(dscores_scaled, k, dq);
  a.uids = {kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kRowDots};
  finish(a, g);
}

// MPIPE_ATTENTION: unset, cuDNN where it builds and agrees with the kernel (attention.cu
// checks); "flash", never; "verbose", as unset, each shape's choice said once on stderr.
const char* attention_mode() {
  static const char* mode = [] {
    const char* v = std::getenv("MPIPE_ATTENTION");
    return v ? v : "";
  }();
  return mode;
}

using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, bool>;  // B, T, H, KVH, hs, backward

// What the frontend refuses or works around before it builds (its SDPA validation), here
// a decline, so that cuDNN never runs a shape it may not handle: one token (s_q = s_kv =
// 1), a head size not a multiple of 8 or over 128 (our kernels' sizes are 64 and 128),
// and runtimes with known backward bugs (9.10.0-9.10.1) or that need a padding mask
// where T is not a multiple of 128 (up to 9.15.0; `cudnnGetVersion` of the library
// loaded, which may be older than the headers). Below 9.10, -inf is the lowest float.
void refuse_known_limits(int64_t T, int64_t hs, bool backward, DnnAttention& a) {
  if (T < 2) throw Declined{"one token"};
  if (hs % 8 != 0 || hs > 128) throw Declined{cat("head size ", hs, " (multiples of 8 up to 128)")};
  const std::size_t version = lib().cudnnGetVersion();
  if (version < 91000) a.neg_inf = std::numeric_limits<float>::lowest();
  if (backward && version < 91100) throw Declined{cat("cuDNN ", version, "'s backward (9.11 or later)")};
  if (backward && version <= 91500 && T % 128 != 0)
    throw Declined{cat("cuDNN ", version, " with ", T, " tokens (a multiple of 128 before 9.15.1)")};
}

// The shape's plan for a direction, built at its first use (one compute thread per rank:
// no lock); null where cuDNN declined it.
DnnAttention* plan_for(const Heads& a, bool backward) {
  static std::map<Key, std::unique_ptr<DnnAttention>> plans;  // null: declined
  const Key key{a.B, a.T, a.H, a.KVH, a.hs, backward};
  if (auto found = plans.find(key); found != plans.end()) return found->second.get();
  auto built = std::make_unique<DnnAttention>();
  built->scale = 1.0f / std::sqrt(static_cast<float>(a.hs));
  const char* direction = backward ? "backward" : "forward";
  try {
    refuse_known_limits(a.T, a.hs, backward, *built);
    const Shape shape{a};
    if (backward) build_backward(*built, shape);
    else build_forward(*built, shape);
  } catch (const Declined& d) {
    plans[key] = nullptr;
    if (dnn_attention_verbose())
      std::fprintf(stderr, "mpipe attention %s %s: cuDNN declined (%s)\n", a.text().c_str(), direction,
                   d.why.c_str());
    return nullptr;
  }
  if (dnn_attention_verbose())
    std::fprintf(stderr, "mpipe attention %s %s: cuDNN engine %lld, workspace %zu B\n", a.text().c_str(), direction,
                 static_cast<long long>(built->engine), built->workspace);
  return (plans[key] = std::move(built)).get();
}

bool run_pack(DnnAttention& a, const Pointers& bound, void* workspace) {
  Pointers key = bound;
  key[kMaxBound] = workspace;
  auto found = a.packs.find(key);
  if (found == a.packs.end()) {
    if (a.packs.size() >= kMaxPacks) a.packs.clear();  // pointers that churn: start over rather than grow
    std::vector<int64_t> uids = a.uids;
    std::vector<void*> data(bound.begin(), bound.begin() + static_cast<std::ptrdiff_t>(a.uids.size()));
    uids.push_back(kScale);
    data.push_back(&a.scale);
    uids.push_back(kNegInf);
    data.push_back(&a.neg_inf);
    if (a.binds_one) {
      uids.push_back(kOne);
      data.push_back(&a.one);
    }
    std::unique_ptr<Desc> pack;
    try {
      pack = std::make_unique<Desc>(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
      pack->set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, static_cast<int64_t>(uids.size()), uids.data(),
                "variant pack ids");
      pack->set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, static_cast<int64_t>(data.size()),
                data.data(), "variant pack pointers");
      pack->set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace, "variant pack workspace");
      pack->finalize("variant pack");
    } catch (const Declined& d) {
      throw Error(cat("cuDNN attention: ", d.why));
    }
    found = a.packs.emplace(key, std::move(pack)).first;
  }
  const cudnnStatus_t status = lib().cudnnBackendExecute(context().dnn, a.plan->get(), found->second->get());
  if (status == CUDNN_STATUS_SUCCESS) return true;
  if (status == CUDNN_STATUS_NOT_SUPPORTED) return false;
  throw Error(cat("cuDNN's attention failed: ", lib().cudnnGetErrorString(status)));
}

// Runs the plan on `bound` (pointers in a.uids' order) and the workspace. The variant
// pack of a set of pointers is made once and kept: the arenas give a step's calls the
// same pointers every step, so later steps make none. False where cuDNN refuses at run
// time (not supported), and at a plan's first run whatever failed (a graph written
// without a GPU to try it on declines rather than ends the job); after that, any other
// failure is an error.
bool run(DnnAttention& a, const Pointers& bound, void* workspace) {
  if (!a.proven) {
    try {
      if (!run_pack(a, bound, workspace)) return false;
    } catch (const Error& e) {
      if (dnn_attention_verbose()) std::fprintf(stderr, "mpipe attention: cuDNN's first run failed (%s)\n", e.what());
      return false;
    }
    a.proven = true;
    return true;
  }
  return run_pack(a, bound, workspace);
}

}  // namespace

bool dnn_attention_wanted() { return std::strcmp(attention_mode(), "flash") != 0; }
bool dnn_attention_verbose() { return std::strcmp(attention_mode(), "verbose") == 0; }

bool dnn_attention_forward(bf16* out, float* lse, const bf16* qkv, const Heads& shape) {
  const bf16 *q = qkv, *k = qkv + shape.C(), *v = k + shape.KV();
  DnnAttention* a = plan_for(shape, false);
  if (!a) return false;
  void* workspace = a->workspace ? scratch(a->workspace) : nullptr;
  Pointers bound{};
  bound[0] = const_cast<bf16*>(q), bound[1] = const_cast<bf16*>(k), bound[2] = const_cast<bf16*>(v);
  bound[3] = out, bound[4] = lse;
  return run(*a, bound, workspace);
}

bool dnn_attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse,
                            const Heads& shape) {
  const bf16 *q = qkv, *k = qkv + shape.C(), *v = k + shape.KV();
  bf16 *dq = dqkv, *dk = dqkv + shape.C(), *dv = dk + shape.KV();
  DnnAttention* a = plan_for(shape, true);
  if (!a) return false;
  // The row dots D (B, H, T) and the workspace, carved from one scratch() region.
  ScratchPlan plan;
  const std::size_t dots_at = plan.reserve<float>(shape.B * shape.H * shape.T);
  const std::size_t workspace_at = plan.reserve<char>(static_cast<int64_t>(a->workspace));
  void* base = scratch(plan.bytes());
  Pointers bound{};
  bound[0] = const_cast<bf16*>(q), bound[1] = const_cast<bf16*>(k), bound[2] = const_cast<bf16*>(v);
  bound[3] = const_cast<bf16*>(out), bound[4] = const_cast<bf16*>(dout), bound[5] = const_cast<float*>(lse);
  bound[6] = dq, bound[7] = dk, bound[8] = dv, bound[9] = place<float>(base, dots_at);
  return run(*a, bound, a->workspace ? place<char>(base, workspace_at) : nullptr);
}

}  // namespace mpipe::cuda
