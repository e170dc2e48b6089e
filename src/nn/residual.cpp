// Residual blocks, their skip paths, and the residual kind.
#include "mpipe/nn/residual.hpp"

#include <cmath>

#include "mpipe/nn/conv_layers.hpp"
#include "mpipe/nn/dense_layers.hpp"
#include "mpipe/nn/registry.hpp"

namespace mpipe {

// ---- Residual ------------------------------------------------------------------------

Residual::Residual(std::vector<std::unique_ptr<Layer>> inner, std::vector<std::unique_ptr<Layer>> skip)
    : inner_(std::move(inner)), skip_(std::move(skip)) {
  mark_in_place(inner_);
  mark_in_place(skip_);
}

// The sum goes into the last inner layer's output where that output is dead to it.
bool Residual::sums_in_place() const { return inner_.back()->output_reusable(); }

void Residual::set_global_index(int index) {
  Layer::set_global_index(index);
  for (auto& part : inner_) part->set_global_index(index);
  for (auto& part : skip_) part->set_global_index(index);
}

Shape Residual::output_shape(const Shape& in) const {
  Shape s = in;
  for (const auto& part : inner_) s = part->output_shape(s);
  return s;
}

Cost Residual::cost(const Shape& in) const {
  Cost total;
  // Its backward takes from the scratch arena, all kept until it returns (backward_chain):
  // per path, two buffers of its largest part input gradient (but the first's), which the
  // parts take in turns, and each part's own temporaries.
  double scratch = 0;
  // Its forward's peak: the parts in forward order (the inner path, then the skip path),
  // each's own peak above what the parts before it keep.
  double kept = 0, peak = 0;
  const auto chain = [&](const std::vector<std::unique_ptr<Layer>>& parts) {
    Shape s = in;
    double largest = 0;
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const Cost c = parts[i]->cost(s);
      peak = std::max(peak, kept + c.forward_peak());
      kept += c.activation_bytes;
      total += c;
      scratch += c.backward_scratch_bytes;
      if (i > 0) largest = std::max(largest, 4.0 * static_cast<double>(s.numel()));
      s = parts[i]->output_shape(s);
    }
    scratch += largest * static_cast<double>(std::min<std::size_t>(2, parts.empty() ? 0 : parts.size() - 1));
    return s;
  };
  const Shape s = chain(inner_);
  chain(skip_);
  total.backward_scratch_bytes = scratch;
  const double out = static_cast<double>(s.numel());
  total.forward_flops += out;
  total.backward_flops += out;
  if (!sums_in_place()) total.activation_bytes += 4 * out;  // the sum, unless over the last part's output
  total.forward_peak_bytes = peak;
  return total;
}

std::vector<ParamSpec> Residual::param_specs() const {
  std::vector<ParamSpec> specs;
  for (std::size_t i = 0; i < inner_.size(); ++i) append_specs(specs, cat(i, "."), *inner_[i]);
  for (std::size_t i = 0; i < skip_.size(); ++i) append_specs(specs, i == 0 ? "skip." : "skip_norm.", *skip_[i]);
  return specs;
}

void Residual::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  std::vector<Layer*> parts;
  for (auto& part : inner_) parts.push_back(part.get());
  for (auto& part : skip_) parts.push_back(part.get());
  bind_parts(params, grads, parts);
}

void Residual::parts(std::vector<Layer*>& out) {
  out.push_back(this);
  for (auto& part : inner_) part->parts(out);
  for (auto& part : skip_) part->parts(out);
}

// Children: the inner layers in order, then the skip path's.
Tensor Residual::forward_impl(const Tensor& x, Context& ctx, const Pass& pass) {
  const std::size_t n = inner_.size();
  Context* c = ctx.children = pass.arena->objects<Context>(n + skip_.size());
  Tensor h = x;
  for (std::size_t i = 0; i < n; ++i) h = inner_[i]->forward(h, c[i], pass);
  Tensor skip = x;
  for (std::size_t j = 0; j < skip_.size(); ++j) skip = skip_[j]->forward(skip, c[n + j], pass);
  // Over the last inner layer's output where that is dead to it (a BatchNorm's); else a
  // fresh sum: a layer may keep its own output (ReLU does) or pass its input on.
  if (sums_in_place() && h.data != x.data) {
    ops::add(h, skip);
    return h;
  }
  Tensor y = pass.arena->tensor(h.shape, pass.dtype);
  ops::copy(y, h);
  ops::add(y, skip);
  return y;
}

// Runs layers[count-1] .. layers[0] backward from dy, the first into dx by `mode`. The
// parts' input gradients take turns in two buffers (a dy is dead once its backward returns).
static void backward_chain(std::span<const std::unique_ptr<Layer>> layers, Context* c, const Tensor& dy, const Tensor& dx,
                    GradMode mode, const Pass& pass) {
  std::int64_t largest = 0;
  for (std::size_t i = 1; i < layers.size(); ++i) largest = std::max(largest, c[i].input.numel());
  Tensor turns[2];
  for (std::size_t t = 0; t < std::min<std::size_t>(2, layers.size() - 1); ++t) turns[t] = pass.arena->tensor(Shape{largest}, pass.dtype);
  Tensor g = dy;
  for (std::size_t i = layers.size(); i-- > 1;) {
    Tensor d = turns[(layers.size() - 1 - i) % 2].head(c[i].input.shape);
    layers[i]->backward(c[i], g, d, GradMode::overwrite, pass);
    g = d;
  }
  layers[0]->backward(c[0], g, dx, mode, pass);  // dx may be empty: weight gradients only
}

void Residual::backward_weight_impl(Context& ctx, const Pass& pass) {
  for (std::size_t i = inner_.size(); i-- > 0;) inner_[i]->backward_weight(ctx.children[i], pass);
  for (std::size_t j = skip_.size(); j-- > 0;) skip_[j]->backward_weight(ctx.children[inner_.size() + j], pass);
}

void Residual::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode, const Pass& pass) {
  Context* c = ctx.children;
  backward_chain(inner_, c, dy, dx, mode, pass);
  if (!skip_.empty()) backward_chain(skip_, c + inner_.size(), dy, dx, GradMode::accumulate, pass);
  else if (!dx.empty()) ops::add(dx, dy);
}

// ---- registry entries ----------------------------------------------------------------

namespace {

// The skip path of a residual block from `in` to `out`: none (the identity), a 1x1
// convolution with the stride that maps the plane (images), optionally followed by a
// BatchNorm, or a linear map of the channels; bias-free.
std::vector<std::unique_ptr<Layer>> projection(const LayerArgs& a, const Shape& in, const Shape& out) {
  const std::string& skip = a.text("skip");
  const bool norm = a.boolean("skip-norm");
  if (skip != "auto" && skip != "identity" && skip != "projection")
    a.refuse("skip", cat("must be auto, identity or projection, got '", skip, "'"), "e.g. skip = \"auto\"");
  std::vector<std::unique_ptr<Layer>> path;
  if (in == out && skip != "projection") {
    if (norm) a.refuse("skip-norm", "is set, but the skip path is the identity", "drop it, or give skip = \"projection\"");
    return path;
  }
  if (skip == "identity")
    a.refuse("skip", cat("is the identity, but the block maps ", in.str(), " to ", out.str()), "use skip = \"auto\" for a projection");
  if (in.rank == 4 && out.rank == 4) {
    for (std::int64_t s = 1; s <= in[2]; ++s)
      if ((in[2] - 1) / s + 1 == out[2] && (in[3] - 1) / s + 1 == out[3]) {
        path.push_back(std::make_unique<Conv2d>(in[1], out[1], 1, s, 0, 1, false,
                                                static_cast<float>(std::sqrt(2.0 / static_cast<double>(in[1])))));
        if (norm) path.push_back(std::make_unique<BatchNorm2d>(out[1], 1e-5f, 0.1f));
        return path;
      }
  } else if (in.rank == out.rank && in.rank >= 2) {
    if (norm) a.refuse("skip-norm", cat("needs images (N, C, H, W); the block maps ", in.str()), "drop it");
    bool same_rows = true;
    for (int d = 0; d + 1 < in.rank; ++d) same_rows = same_rows && in[d] == out[d];
    if (same_rows) {
      path.push_back(std::make_unique<Linear>(in[-1], out[-1], false, 0.02f));
      return path;
    }
  }
  a.refuse("kind", cat("maps ", in.str(), " to ", out.str(), ", which no 1x1 convolution or linear skip path matches"),
           "keep the plane a stride of the input's, and the rank");
}

}  // namespace


std::vector<LayerKind> residual_layer_kinds() {
  using T = OptionType;
  std::vector<LayerKind> k;
  k.push_back({"residual",
               "y = inner(x) + skip(x): the block's [[layer.layer]] tables, and the identity, or a bias-free 1x1 "
               "convolution (images) or linear map where they change the shape",
               {{"skip", T::text, std::string("auto"), "auto (identity unless the shape changes), identity or projection"},
                {"skip-norm", T::boolean, false, "a batchnorm2d after the projection convolution (ResNet's downsample)"}},
               false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 if (a.nested) a.refuse("kind", "cannot be inside another residual block", "put the blocks one after another");
                 if (a.spec.children.empty()) a.refuse("kind", "has no inner layers", "give its layers as [[layer.layer]] tables");
                 std::vector<std::unique_ptr<Layer>> inner;
                 Shape s = a.input;
                 for (std::size_t j = 0; j < a.spec.children.size(); ++j) {
                   const LayerSpec& child = a.spec.children[j];
                   inner.push_back(build_layer(child, a.model, a.index, s, cat(a.where, ", inner layer ", j, " (", child.kind, ")"), true));
                   s = inner.back()->output_shape(s);
                 }
                 auto skip = projection(a, a.input, s);
                 return std::make_unique<Residual>(std::move(inner), std::move(skip));
               }});
  return k;
}
}  // namespace mpipe
