// Row-major GEMMs on cuBLASLt. cuBLASLt is column-major, and a row-major (r, c) matrix
// is the column-major (c, r) one, so c = op(a) · op(b) is run as c^T = op(b)^T · op(a)^T:
// cuBLASLt's A is our b, its B our a, and (m, n, k) = (N, M, K).
//
// A call's descriptors and algorithm are made on its first use and kept per shape (and
// pointer alignment, on which the algorithm depends), so later steps allocate nothing
// and query no heuristic, and a shape always runs the same algorithm: the same bits.
// Ops are queued by the rank's one compute thread, so the cache needs no lock.
#include <map>
#include <memory>
#include <tuple>

#include "gemm.cuh"

namespace mpipe::cuda {

namespace {

// Largest power of two dividing the address, up to 16: what cuBLASLt's vectorised and
// tensor-core kernels ask for. The cap keeps the algorithm, and so the bits, the same
// whether a tensor lands 16- or 256-byte aligned (in one stage split or another).
uint32_t alignment_of(const void* p) {
  constexpr uint32_t cap = 16;
  if (!p) return cap;
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  uint32_t a = 1;
  while (a < cap && address % (2 * a) == 0) a *= 2;
  return a;
}

struct GemmKey {
  int64_t M, N, K, lda, ldb, ldc;
  bool trans_a, trans_b;
  cudaDataType_t ab_type, c_type;
  int batch;
  int64_t stride_a, stride_b, stride_c;
  cublasLtEpilogue_t epilogue;
  uint32_t align_a, align_b, align_c, align_bias, align_pre;

  auto tie() const {
    return std::tie(M, N, K, lda, ldb, ldc, trans_a, trans_b, ab_type, c_type, batch, stride_a, stride_b, stride_c,
                    epilogue, align_a, align_b, align_c, align_bias, align_pre);
  }
  bool operator<(const GemmKey& other) const { return tie() < other.tie(); }
};

// cuBLASLt's objects for one key. `heuristic` is CUBLAS_STATUS_SUCCESS when an
// algorithm was found, else why none was.
struct GemmPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // cuBLASLt's A, B, C (= D)
  cublasLtMatmulAlgo_t algo{};
  cublasStatus_t heuristic = CUBLAS_STATUS_NOT_SUPPORTED;

  GemmPlan() = default;
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;
  ~GemmPlan() {
    // Host-side objects only: safe at exit, whatever state the device is in.
    if (c) lib().cublasLtMatrixLayoutDestroy(c);
    if (b) lib().cublasLtMatrixLayoutDestroy(b);
    if (a) lib().cublasLtMatrixLayoutDestroy(a);
    if (desc) lib().cublasLtMatmulDescDestroy(desc);
  }
};

std::map<GemmKey, std::unique_ptr<GemmPlan>>& plans() {
  static std::map<GemmKey, std::unique_ptr<GemmPlan>> cache;
  return cache;
}

template <class T>
void set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const T& value) {
  CUBLAS_CHECK(lib().cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)));
}

cublasLtMatrixLayout_t make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld, int batch,
                                   int64_t stride) {
  cublasLtMatrixLayout_t layout = nullptr;
  CUBLAS_CHECK(lib().cublasLtMatrixLayoutCreate(&layout, type, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld));
  if (batch > 1) {
    const int32_t count = batch;
    CUBLAS_CHECK(lib().cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    CUBLAS_CHECK(
        lib().cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  }
  return layout;
}

cublasLtEpilogue_t epilogue_of(const Gemm& g) {
  if (g.gelu_pre) return g.bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
  return g.bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
}

// Sets the per-call pointers of the epilogue (their alignment is part of the key).
void set_epilogue_pointers(GemmPlan& plan, const Gemm& g) {
  if (g.bias) set_desc(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
  if (g.gelu_pre) set_desc(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.gelu_pre);
}

void build(GemmPlan& plan, const GemmKey& key, const Gemm& g) {
  Context& ctx = context();
  CUBLAS_CHECK(lib().cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_a = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // on our b
  const cublasOperation_t op_b = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // on our a
  set_desc(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, op_a);
  set_desc(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, op_b);
  set_desc(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, key.epilogue);
  if (g.gelu_pre) set_desc(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, g.ldc);
  set_epilogue_pointers(plan, g);

  // Stored shapes, column-major: our row-major b is (K, N), or (N, K) when transposed.
  plan.a = make_layout(g.ab_type, g.trans_b ? g.K : g.N, g.trans_b ? g.N : g.K, g.ldb, g.batch, g.stride_b);
  plan.b = make_layout(g.ab_type, g.trans_a ? g.M : g.K, g.trans_a ? g.K : g.M, g.lda, g.batch, g.stride_a);
  plan.c = make_layout(g.c_type, g.N, g.M, g.ldc, g.batch, g.stride_c);

  cublasLtMatmulPreference_t preference = nullptr;
  CUBLAS_CHECK(lib().cublasLtMatmulPreferenceCreate(&preference));
  const uint64_t workspace = ctx.lt_workspace_bytes;
  const auto set_preference = [&](cublasLtMatmulPreferenceAttributes_t attribute, const auto& value) {
    CUBLAS_CHECK(lib().cublasLtMatmulPreferenceSetAttribute(preference, attribute, &value, sizeof(value)));
  };
  set_preference(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, workspace);
  set_preference(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_b);
  set_preference(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_a);
  set_preference(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_c);
  set_preference(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_c);
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  // Not checked: an epilogue refused for these types (NOT_SUPPORTED, or INVALID_VALUE)
  // is an answer for try_gemm's caller, and gemm() reports it.
  const cublasStatus_t status = lib().cublasLtMatmulAlgoGetHeuristic(ctx.blas_lt, plan.desc, plan.a, plan.b, plan.c,
                                                               plan.c, preference, 1, &result, &returned);
  CUBLAS_CHECK(lib().cublasLtMatmulPreferenceDestroy(preference));
  plan.heuristic = status == CUBLAS_STATUS_SUCCESS && returned == 0 ? CUBLAS_STATUS_NOT_SUPPORTED : status;
  if (plan.heuristic == CUBLAS_STATUS_SUCCESS) plan.algo = result.algo;
}

// Queues g, or returns why cuBLASLt offers no algorithm for it.
cublasStatus_t run(const Gemm& g) {
  const GemmKey key{g.M,        g.N,        g.K,        g.lda,          g.ldb,
                    g.ldc,      g.trans_a,  g.trans_b,  g.ab_type,      g.c_type,
                    g.batch,    g.stride_a, g.stride_b, g.stride_c,     epilogue_of(g),
                    alignment_of(g.a), alignment_of(g.b), alignment_of(g.c), alignment_of(g.bias),
                    alignment_of(g.gelu_pre)};
  std::unique_ptr<GemmPlan>& slot = plans()[key];
  if (!slot) {
    auto plan = std::make_unique<GemmPlan>();
    build(*plan, key, g);
    slot = std::move(plan);
  } else {
    set_epilogue_pointers(*slot, g);
  }
  if (slot->heuristic != CUBLAS_STATUS_SUCCESS) return slot->heuristic;
  Context& ctx = context();
  CUBLAS_CHECK(lib().cublasLtMatmul(ctx.blas_lt, slot->desc, &g.alpha, g.b, slot->a, g.a, slot->b, &g.beta, g.c, slot->c,
                              g.c, slot->c, &slot->algo, ctx.lt_workspace, ctx.lt_workspace_bytes, ctx.compute));
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

bool try_gemm(const Gemm& g) { return run(g) == CUBLAS_STATUS_SUCCESS; }

void gemm(const Gemm& g) {
  const cublasStatus_t status = run(g);
  MPIPE_CHECK(status == CUBLAS_STATUS_SUCCESS, "cuBLASLt has no algorithm for a GEMM of (", g.M, ", ", g.K, ") x (",
              g.K, ", ", g.N, ") batch ", g.batch, ", types ", static_cast<int>(g.ab_type), " -> ",
              static_cast<int>(g.c_type), ": ", cublas_status_name(status));
}

}  // namespace mpipe::cuda
