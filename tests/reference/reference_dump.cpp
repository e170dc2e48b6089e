// Writes what the PyTorch reference needs to rebuild and check our model: initial
// parameters (keyed by global layer and name), every step's batch, the gradients of
// step 0 (and, for a model of tokens, the logits of its batch), and the loss and learning
// rate of 10 training steps (--steps). HDF5, read with h5py.
// Usage: reference_dump --model gpt|llama|mlp|FILE --out FILE.h5 [--batchnorm micro|deferred] [--lr PEAK]
//        [--steps N] [--vocab V] [--seq-len T]; llama: [--kv-heads N] [--ffn F] [--tie-embeddings on|off]
//        [--rope-theta X] [--norm-eps X]
#include <hdf5.h>

#include <cstring>
#include <string>
#include <vector>

#include "tiny_gpt.hpp"
#include "mpipe/backend/cpu/blas_core.hpp"
#include "mpipe/app/config.hpp"
#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/core/arena.hpp"
#include "mpipe/core/sanitizer.hpp"
#include "mpipe/pipeline/run/executor.hpp"

using namespace mpipe;

namespace {

void write(hid_t file, const std::string& path, const void* data, hid_t type, std::vector<hsize_t> dims) {
  hid_t lcpl = H5Pcreate(H5P_LINK_CREATE);
  H5Pset_create_intermediate_group(lcpl, 1);
  hid_t space = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
  hid_t set = H5Dcreate2(file, path.c_str(), type, space, lcpl, H5P_DEFAULT, H5P_DEFAULT);
  MPIPE_CHECK(set >= 0, "cannot create ", path);
  MPIPE_CHECK(H5Dwrite(set, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) >= 0, "cannot write ", path);
  H5Dclose(set);
  H5Sclose(space);
  H5Pclose(lcpl);
}

std::vector<hsize_t> dims_of(const Shape& s) {
  std::vector<hsize_t> d;
  for (int i = 0; i < s.rank; ++i) d.push_back(static_cast<hsize_t>(s[i]));
  return d;
}

}  // namespace

int main(int argc, char** argv) {
  mpipe::cpu::choose_blas_core(argv);  // mpipe's kernels
  std::string model = "gpt", out = "reference.h5", batchnorm = "micro";
  float lr = 1e-2f;
  int steps = 10, vocab = 50, seq_len = 16;
  ModelConfig llama;  // the Llama family's options (--model llama)
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--model") == 0) model = argv[i + 1];
    if (std::strcmp(argv[i], "--out") == 0) out = argv[i + 1];
    if (std::strcmp(argv[i], "--batchnorm") == 0) batchnorm = argv[i + 1];
    if (std::strcmp(argv[i], "--lr") == 0) lr = std::stof(argv[i + 1]);
    if (std::strcmp(argv[i], "--steps") == 0) steps = std::stoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--vocab") == 0) vocab = std::stoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--seq-len") == 0) seq_len = std::stoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--kv-heads") == 0) llama.kv_heads = std::stoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--ffn") == 0) llama.ffn = std::stoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--tie-embeddings") == 0) llama.tie_embeddings = argv[i + 1];
    if (std::strcmp(argv[i], "--rope-theta") == 0) llama.rope_theta = std::stod(argv[i + 1]);
    if (std::strcmp(argv[i], "--norm-eps") == 0) llama.norm_eps = std::stod(argv[i + 1]);
  }
  // The GPT's sizes (the Llama's too), and the MLP's (a model file has its own).
  TrainConfig c = test::tiny_gpt({.layers = 2, .d_model = 32, .heads = 4, .seq_len = seq_len, .vocab = vocab,
                                  .dropout = 0.0f, .batch_size = 8, .micro_batches = 2, .steps = steps, .seed = 3, .lr = lr,
                                  .weight_decay = 0.1f});
  c.model.kind = model;
  c.model.kv_heads = llama.kv_heads;
  c.model.ffn = llama.ffn;
  c.model.tie_embeddings = llama.tie_embeddings;
  c.model.rope_theta = llama.rope_theta;
  c.model.norm_eps = llama.norm_eps;
  c.pipeline.batchnorm = batchnorm;
  c.model.hidden = 48;
  c.model.inputs = 20;
  c.model.classes = 7;
  // 2 micro-batches: torch runs the whole batch, so this checks accumulation too.
  c.optimizer.warmup = 2;
  c.optimizer.clip_grad = 0.0f;  // torch's clip_grad_norm_ adds 1e-6 to the norm; compared elsewhere
  cpu::set_threads(2);
  MPI_Init(&argc, &argv);
  const Communicator self = Communicator::borrow(MPI_COMM_SELF);
  Executor trainer(plan_run(c, self), self);
  trainer.connect();
  trainer.allocate();

  hid_t file = H5Fcreate(out.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  MPIPE_CHECK(file >= 0, "cannot create ", out);
  const int layers = trainer.model().size();
  write(file, "/config/layers", &layers, H5T_NATIVE_INT, {1});
  const int sizes[] = {c.model.layers, c.model.d_model, c.model.heads, c.model.seq_len, c.model.vocab,
                       c.model.hidden, c.model.inputs,  c.model.classes, c.batch_size};
  write(file, "/config/sizes", sizes, H5T_NATIVE_INT, {9});
  write(file, "/config/micro_batches", &c.micro_batches, H5T_NATIVE_INT, {1});
  const int deferred = batchnorm == "deferred";
  write(file, "/config/deferred_batchnorm", &deferred, H5T_NATIVE_INT, {1});
  const float opt[] = {c.optimizer.beta1, c.optimizer.beta2, c.optimizer.eps, c.optimizer.weight_decay};
  write(file, "/config/adamw", opt, H5T_NATIVE_FLOAT, {4});
  // The Llama family's options as the model has them (kv-heads 0 resolved, ffn 0 Llama's rule).
  if (model == "llama") {
    const LayerSpec& block = trainer.model().spec().layers[1];
    auto integer = [&](const char* name) { return static_cast<int>(std::get<std::int64_t>(block.options.at(name))); };
    const int llama_sizes[] = {integer("kv-heads"), integer("ffn"), c.model.tie_embeddings == "on"};
    write(file, "/config/llama", llama_sizes, H5T_NATIVE_INT, {3});
    const double llama_reals[] = {c.model.rope_theta, c.model.norm_eps};
    write(file, "/config/llama_reals", llama_reals, H5T_NATIVE_DOUBLE, {2});
  }

  // which: initial parameters (with their decay flags), gradients, or final parameters.
  enum Which { initial, grads, final };
  auto write_all = [&](const std::string& group, Which which) {
    for (const ParamEntry& e : trainer.params().entries()) {
      if (e.tied_copy) continue;
      const Tensor t = which == grads ? trainer.params().grad(e) : trainer.params().param(e);
      write(file, group + "/" + std::to_string(e.layer) + "/" + e.name, t.data, H5T_NATIVE_FLOAT, dims_of(e.shape));
      if (which == initial) {
        const int decay = e.decay;
        write(file, "/decay/" + std::to_string(e.layer) + "/" + e.name, &decay, H5T_NATIVE_INT, {1});
      }
    }
  };
  write_all("/params", initial);

  // Every step's batch, drawn exactly as the trainer draws it.
  const Shape in = trainer.model().input_shape(c.batch_size), tg = trainer.model().target_shape(c.batch_size);
  std::vector<float> in_f(in.numel());
  std::vector<std::int32_t> in_i(in.numel()), targets(tg.numel());
  for (int step = 0; step < c.steps; ++step) {
    const bool tokens = trainer.model().tokens() > 0;
    Tensor x = tokens ? make_tensor(in_i.data(), in) : make_tensor(in_f.data(), in);
    trainer.dataset()->fill(static_cast<std::uint64_t>(step) * c.batch_size, c.batch_size, x, make_tensor(targets.data(), tg));
    const std::string base = "/batch/" + std::to_string(step);
    write(file, base + "/inputs", x.data, tokens ? H5T_NATIVE_INT32 : H5T_NATIVE_FLOAT, dims_of(in));
    write(file, base + "/targets", targets.data(), H5T_NATIVE_INT32, dims_of(tg));
  }

  // A model of tokens: the logits (B, T, V) of step 0's batch, one forward of the whole
  // batch through the layers before the loss (no dropout: evaluation).
  if (trainer.model().tokens() > 0) {
    Arena arena;
    Pass pass;
    pass.arena = &arena;
    pass.training = false;
    Tensor x = make_tensor(in_i.data(), in);
    trainer.dataset()->fill(0, c.batch_size, x, make_tensor(targets.data(), tg));
    pass.stage_input = x.data;
    Tensor y = x;
    for (int i = 0; i < trainer.model().size() && trainer.model().layer(i).kind() != "cross_entropy"; ++i) {
      Context* ctx = arena.objects<Context>(1);
      y = trainer.model().layer(i).forward(y, *ctx, pass);
    }
    write(file, "/logits", y.data, H5T_NATIVE_FLOAT, dims_of(y.shape));
  }

  const double loss0 = trainer.compute_gradients(0);
  write(file, "/loss0", &loss0, H5T_NATIVE_DOUBLE, {1});
  write_all("/grads", grads);

  std::vector<double> losses;
  std::vector<float> lrs;
  for (int step = 0; step < c.steps; ++step) {
    const StepResult r = trainer.step(step);
    losses.push_back(r.loss);
    lrs.push_back(r.lr);
  }
  write(file, "/losses", losses.data(), H5T_NATIVE_DOUBLE, {losses.size()});
  write(file, "/lrs", lrs.data(), H5T_NATIVE_FLOAT, {lrs.size()});
  write_all("/final", final);
  H5Fclose(file);
  MPI_Finalize();
  return 0;
}
