// Exact min-max contiguous partitioning and the per-layer cost models.
#include "mpipe/pipeline/plan/partition.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>
#include <sstream>

#include "mpipe/core/rng.hpp"
#include "mpipe/nn/params.hpp"

namespace mpipe {

int Partition::stage_of(int layer) const {
  MPIPE_CHECK(layer >= 0 && layer < bounds.back(), "layer ", layer, " outside the partition");
  return static_cast<int>(std::upper_bound(bounds.begin(), bounds.end(), layer) - bounds.begin()) - 1;
}

double Partition::stage_cost(int stage) const {
  if (layer_cost.empty()) return end(stage) - begin(stage);
  return std::accumulate(layer_cost.begin() + begin(stage), layer_cost.begin() + end(stage), 0.0);
}

std::string Partition::to_text() const {
  std::string out;
  for (int s = 0; s < stages(); ++s) out += cat(s ? " | " : "", begin(s), "-", end(s) - 1);
  return out;
}

Partition partition_from_balance(const std::vector<int>& counts, int layers) {
  MPIPE_REQUIRE(!counts.empty(), "e.g. --balance 3,5", "--balance is empty");
  Partition p;
  p.bounds.push_back(0);
  for (int c : counts) {
    MPIPE_REQUIRE(c > 0, "every stage needs at least one layer", "--balance has a stage of ", c, " layers");
    p.bounds.push_back(p.bounds.back() + c);
  }
  MPIPE_REQUIRE(p.bounds.back() == layers, cat("the model has ", layers, " layers; see 'mpipe plan' for the list"),
                "--balance adds up to ", p.bounds.back(), " layers, the model has ", layers);
  return p;
}

Partition partition_min_max(const std::vector<double>& cost, int stages, const std::vector<double>& boundary_bytes,
                            const std::vector<double>& link_cost_per_byte) {
  const int L = static_cast<int>(cost.size());
  MPIPE_REQUIRE(stages <= L, "use fewer stages or a deeper model",
                "more stages (", stages, ") than layers (", L, ")");
  MPIPE_CHECK(boundary_bytes.empty() || static_cast<int>(boundary_bytes.size()) == L + 1, "boundary bytes for ",
              boundary_bytes.size() - 1, " layers, costs for ", L);
  MPIPE_CHECK(link_cost_per_byte.empty() || !boundary_bytes.empty(), "link costs without boundary bytes");
  std::vector<double> prefix(L + 1, 0.0);
  for (int i = 0; i < L; ++i) prefix[i + 1] = prefix[i] + cost[i];
  // Model stage s over layers [j, i): its layers, and its cuts over their links.
  const auto links = link_cost_per_byte.size();
  const auto comm = [&](int s, int j, int i) {
    if (links == 0) return 0.0;
    double c = 0;
    if (j > 0) c += boundary_bytes[static_cast<std::size_t>(j)] * link_cost_per_byte[static_cast<std::size_t>(s - 1) % links];
    if (i < L) c += boundary_bytes[static_cast<std::size_t>(i)] * link_cost_per_byte[static_cast<std::size_t>(s) % links];
    return c;
  };
  const auto stage = [&](int s, int j, int i) { return prefix[i] - prefix[j] + comm(s, j, i); };
  const double inf = std::numeric_limits<double>::infinity();
  // 1. The smallest largest-stage cost: best[k][i] over layers [0, i) in k stages.
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(L + 1, inf));
  best[0][0] = 0.0;
  for (int k = 1; k <= stages; ++k)
    for (int i = k; i <= L - (stages - k); ++i)
      for (int j = k - 1; j < i; ++j) best[k][i] = std::min(best[k][i], std::max(best[k - 1][j], stage(k - 1, j, i)));
  // 2. Among the partitions whose every stage is within `near` of that (no cost model
  // is more precise: they are equally fast): the fewest bytes across the cuts (a cut
  // before the loss moves the logits, and leaves a rank next to idle), then the most
  // even stages (smallest sum of squared stage costs), then the later cut (fewer layers
  // on later stages, which also hold the loss and the head). Both sums add up stage by
  // stage, so their order is kept by the recursion: exact, like step 1.
  const double limit = best[stages][L] * (1 + partition_near);
  struct Score {
    double bytes = 0, squares = 0;
    bool operator<(const Score& o) const { return bytes != o.bytes ? bytes < o.bytes : squares < o.squares; }
  };
  const Score none{inf, inf};
  std::vector<std::vector<Score>> score(stages + 1, std::vector<Score>(L + 1, none));
  std::vector<std::vector<int>> cut(stages + 1, std::vector<int>(L + 1, -1));
  score[0][0] = Score{};
  for (int k = 1; k <= stages; ++k)
    for (int i = k; i <= L - (stages - k); ++i)
      for (int j = k - 1; j < i; ++j) {
        const double c = stage(k - 1, j, i);
        if (c > limit || score[k - 1][j].bytes == inf) continue;
        const double crossing = (j > 0 && !boundary_bytes.empty()) ? boundary_bytes[static_cast<std::size_t>(j)] : 0.0;
        const Score candidate{score[k - 1][j].bytes + crossing, score[k - 1][j].squares + c * c};
        if (candidate < score[k][i] || (!(score[k][i] < candidate) && j > cut[k][i])) {
          score[k][i] = candidate;
          cut[k][i] = j;
        }
      }
  Partition p;
  p.layer_cost = cost;
  p.bounds.assign(stages + 1, 0);
  p.bounds[stages] = L;
  for (int k = stages, i = L; k > 0; --k) {
    i = cut[k][i];
    MPIPE_CHECK(i >= 0, "partitioner: no partition within its own optimum");
    p.bounds[k - 1] = i;
  }
  if (links > 0) {
    p.link_cost_per_byte = link_cost_per_byte;
    for (int s = 0; s < stages; ++s) p.comm_cost.push_back(comm(s, p.begin(s), p.end(s)));
  }
  return p;
}

std::vector<double> skip_bytes(const Model& model, int micro) {
  const auto shapes = model.shapes(micro);
  std::vector<double> bytes;
  for (const Model::Skip& skip : model.skips())
    bytes.push_back(f32_bytes(static_cast<double>(shapes[static_cast<std::size_t>(skip.producer) + 1].numel())));
  return bytes;
}

std::vector<double> boundary_bytes(const Model& model, int micro, bool skips) {
  const auto shapes = model.shapes(micro);
  std::vector<double> bytes(static_cast<std::size_t>(model.size()) + 1, 0.0);
  for (int b = 1; b < model.size(); ++b) {
    const bool gradient_back = model.layer(b).input_dtype() == DType::f32;
    bytes[static_cast<std::size_t>(b)] = f32_bytes(static_cast<double>(shapes[static_cast<std::size_t>(b)].numel())) * (gradient_back ? 2 : 1);
  }
  // A skip crosses every cut between its producer and its consumer (producer < b <=
  // consumer), and its gradient comes back: a message each way per micro-batch.
  const std::vector<double> each = skips ? skip_bytes(model, micro) : std::vector<double>{};
  for (std::size_t k = 0; k < each.size(); ++k)
    for (int b = model.skips()[k].producer + 1; b <= model.skips()[k].consumer; ++b) bytes[static_cast<std::size_t>(b)] += 2 * each[k];
  return bytes;
}

std::vector<double> layer_costs(const Model& model, const std::string& method, int micro) {
  const auto shapes = model.shapes(micro);
  std::vector<double> costs;
  for (int i = 0; i < model.size(); ++i) {
    const Cost c = model.layer(i).cost(shapes[i]);
    if (method == "uniform") costs.push_back(1.0);
    else if (method == "params") costs.push_back(c.param_bytes);
    else if (method == "flops") costs.push_back(c.forward_flops + c.backward_flops);
    else throw UserError(cat("unknown partition method '", method, "'"), "use --partition uniform, params, flops or time");
  }
  return costs;
}

std::vector<double> measure_layer_times(Model& model, int micro, unsigned long long seed) {
  const auto shapes = model.shapes(micro);
  std::vector<double> seconds(model.size(), 0.0);
  Arena arena;
  // Inputs of the right kind for every layer: tokens for the embedding, noise otherwise.
  std::vector<float> noise;
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(shapes[0].numel()), 0);
  std::vector<std::int32_t> targets(static_cast<std::size_t>(model.target_shape(micro).numel()), 0);
  for (int i = 0; i < model.size(); ++i) {
    ParamStore store(model, i, i + 1, seed);
    Layer& layer = model.layer(i);
    Tensor x;
    if (layer.input_dtype() == DType::i32) {
      x = make_tensor(tokens.data(), shapes[i]);
    } else {
      noise.resize(static_cast<std::size_t>(shapes[i].numel()));
      make_stream(seed, Stream::data_setup, 9, static_cast<std::uint32_t>(i), 0).fill_normal(noise.data(), noise.size());
      x = make_tensor(noise.data(), shapes[i]);
    }
    Pass pass;
    pass.arena = &arena;
    pass.targets = make_tensor(targets.data(), model.target_shape(micro));
    pass.loss_scale = 1.0f;
    // A join reads its skip (noise too) and writes the skip's gradient.
    std::vector<Tensor> skips(model.skips().size()), skip_grads(model.skips().size());
    for (std::size_t k = 0; k < skips.size(); ++k) {
      if (model.skips()[k].consumer != i) continue;
      const Shape s = shapes[static_cast<std::size_t>(model.skips()[k].producer) + 1];
      skips[k] = arena.zeros(s);
      skip_grads[k] = arena.tensor(s);
    }
    const Arena::Mark after_skips = arena.mark();
    pass.skips = skips;
    pass.skip_grads = skip_grads;
    double best = std::numeric_limits<double>::infinity();
    for (int repeat = 0; repeat < 3; ++repeat) {  // the best of 3, after the arena warmed up
      const auto start = std::chrono::steady_clock::now();
      Context ctx;
      Tensor y = layer.forward(x, ctx, pass);
      Tensor dx = layer.input_dtype() == DType::f32 ? arena.tensor(shapes[i]) : Tensor{};
      layer.backward(ctx, y, dx, GradMode::overwrite, pass);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      arena.rewind(after_skips);
    }
    arena.reset();
    seconds[i] = best;
  }
  return seconds;
}

Partition choose_partition(const std::vector<int>& balance, const std::string& method, const Model& model, int stages,
                           int micro, const std::vector<double>& measured, const std::vector<int>& placement,
                           const std::vector<double>& link_seconds_per_byte) {
  const int model_stages = placement.empty() ? stages : static_cast<int>(placement.size());
  auto rank_of = [&](int m) { return placement.empty() ? m : placement[static_cast<std::size_t>(m)]; };
  // Per cut: the link between the ranks of the model stages on its two sides.
  std::vector<double> per_cut;
  if (method == "time" && !link_seconds_per_byte.empty()) {
    const auto links = link_seconds_per_byte.size();
    for (int c = 0; c + 1 < model_stages; ++c) {
      const int a = rank_of(c), b = rank_of(c + 1);
      const int link = b == (a + 1) % stages ? a : a == (b + 1) % stages ? b : a;
      per_cut.push_back(a == b ? 0.0 : link_seconds_per_byte[static_cast<std::size_t>(link) % links]);
    }
  }
  Partition p = !balance.empty() ? partition_from_balance(balance, model.size())
                                 : partition_min_max(method == "time" ? measured : layer_costs(model, method, micro),
                                                     model_stages, boundary_bytes(model, micro), per_cut);
  MPIPE_REQUIRE(p.stages() == model_stages, "give one count per model stage (stages x virtual stages)",
                "--balance has ", p.stages(), " stages, the run ", model_stages);
  p.placement = placement;
  if (!per_cut.empty()) p.link_cost_per_byte = link_seconds_per_byte;
  return p;
}

StageCosts flop_costs(const Model& model, const Partition& partition, int micro) {
  const std::vector<Shape> shapes = model.shapes(micro);
  StageCosts costs = StageCosts::uniform(partition.stages(), 0.0, 0.0, 0.0);
  for (int s = 0; s < partition.stages(); ++s) {
    // The top layers of the model's last stage compute their weight gradients in B.
    const int whole_from = weights_in_backward_from(model, partition.begin(s), partition.end(s));
    for (int i = partition.begin(s); i < partition.end(s); ++i) {
      const Cost c = model.layer(i).cost(shapes[static_cast<std::size_t>(i)]);
      costs.forward[static_cast<std::size_t>(s)] += c.forward_flops;
      costs.backward[static_cast<std::size_t>(s)] += c.backward_flops;
      if (i < whole_from) costs.weight[static_cast<std::size_t>(s)] += c.weight_flops;
    }
  }
  return costs;
}

double parse_link_bandwidth(const std::string& text) {
  if (text == "auto") return -1;
  if (text == "off") return 0;
  const std::string hint = "give auto, off, or gigabytes per second, e.g. --link-bandwidth 12.5";
  double gbps = 0;
  try {
    std::size_t used = 0;
    gbps = std::stod(text, &used);
    MPIPE_REQUIRE(used == text.size(), hint, "--link-bandwidth '", text, "' is not a number");
  } catch (const std::logic_error&) {
    throw UserError(cat("--link-bandwidth '", text, "' is not a number"), hint);
  }
  MPIPE_REQUIRE(std::isfinite(gbps) && gbps > 0, hint, "--link-bandwidth must be positive, got ", text);
  return 1.0 / (gbps * 1e9);
}

std::vector<int> parse_balance(const std::string& text) {
  std::vector<int> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    try {
      std::size_t used = 0;
      out.push_back(std::stoi(item, &used));
      MPIPE_REQUIRE(used == item.size(), "e.g. --balance 3,5", "--balance '", text, "' is not a list of integers");
    } catch (const std::logic_error&) {
      throw UserError(cat("--balance '", text, "' is not a list of integers"), "e.g. --balance 3,5");
    }
  }
  return out;
}

}  // namespace mpipe
