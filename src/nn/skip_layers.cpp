// Skip joins (concat, add) and nearest upsampling, with their registry entries.
#include "mpipe/nn/skip_layers.hpp"

#include "mpipe/backend/conv_ops.hpp"
#include "mpipe/nn/registry.hpp"

namespace mpipe {

int join_axis(const Shape& shape) { return shape.rank == 4 ? 1 : shape.rank - 1; }

namespace {
// Elements of one run along the join axis and what follows it in memory: a sample's (or
// row's) channels; a position's, for a channels-last image.
std::int64_t run_of(const Shape& s, bool channels_last) {
  if (channels_last && s.rank == 4) return s[1];
  std::int64_t n = 1;
  for (int d = join_axis(s); d < s.rank; ++d) n *= s[d];
  return n;
}
}  // namespace

Shape SkipJoin::skip_shape(const Shape& in) const {
  Shape s = skip_;
  s[0] = in[0];
  return s;
}

Shape SkipJoin::output_shape(const Shape& in) const {
  if (op_ == Op::add) return in;
  Shape out = in;
  out[join_axis(in)] += skip_[join_axis(skip_)];
  return out;
}

Cost SkipJoin::cost(const Shape& in) const {
  // Copies (and an add): memory traffic, no state kept for backward (it reads only dy).
  const double n = static_cast<double>(output_shape(in).numel());
  return {op_ == Op::add ? n : 0.0, 0.0, 0.0, 0.0};
}

Runs SkipJoin::runs(const Shape& in, bool skip, bool channels_last) const {
  const Shape out = output_shape(in), s = skip_shape(in);
  const auto run = [channels_last](const Shape& x) { return run_of(x, channels_last); };
  const std::int64_t count = out.numel() / run(out);
  return Runs{count, skip ? run(s) : run(in), run(out), skip ? run(in) : 0, skip ? run(s) : run(in), 0};
}

Tensor SkipJoin::forward_impl(const Tensor& x, Context& ctx, const Pass& pass) {
  MPIPE_CHECK(skip_index_ >= 0 && static_cast<std::size_t>(skip_index_) < pass.skips.size() &&
                  !pass.skips[static_cast<std::size_t>(skip_index_)].empty(),
              kind(), " layer ", global_index(), ": the skip '", from_, "' is not there");
  const Tensor& s = pass.skips[static_cast<std::size_t>(skip_index_)];
  MPIPE_CHECK(s.shape == skip_shape(x.shape) && s.dtype == x.dtype, kind(), " layer ", global_index(), ": skip ",
              s.shape.str(), " expected ", skip_shape(x.shape).str());
  const Tensor y = pass.arena->tensor(output_shape(x.shape), x.dtype);
  if (op_ == Op::add) {
    ops::copy(y, x);
    ops::add(y, s);
  } else {
    ops::copy_runs(y, x, runs(x.shape, false, pass.channels_last));
    ops::copy_runs(y, s, runs(x.shape, true, pass.channels_last));
  }
  return y;
}

void SkipJoin::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode, const Pass& pass) {
  MPIPE_CHECK(mode == GradMode::overwrite, kind(), " writes its gradients");
  MPIPE_CHECK(static_cast<std::size_t>(skip_index_) < pass.skip_grads.size() &&
                  !pass.skip_grads[static_cast<std::size_t>(skip_index_)].empty(),
              kind(), " layer ", global_index(), ": no buffer for the gradient of skip '", from_, "'");
  const Tensor& ds = pass.skip_grads[static_cast<std::size_t>(skip_index_)];
  const Shape in = ctx.input.shape;
  if (op_ == Op::add) {
    if (!dx.empty()) ops::copy(dx, dy);
    ops::copy(ds, dy);
    return;
  }
  // Each part's runs read back out of the output's (the same Runs, dst and src swapped).
  for (const bool skip : {false, true}) {
    const Runs r = runs(in, skip, pass.channels_last);
    if (!skip && dx.empty()) continue;
    ops::copy_runs(skip ? ds : dx, dy, Runs{r.count, r.length, r.src_stride, r.src_offset, r.dst_stride, r.dst_offset});
  }
}

Cost Upsample2d::cost(const Shape& in) const {
  const double n = static_cast<double>(output_shape(in).numel());
  return {0.0, n, 0.0, 0.0};  // keeps nothing: its backward sums dy's blocks
}

Tensor Upsample2d::forward_impl(const Tensor& x, Context& ctx, const Pass& pass) {
  const Tensor y = pass.arena->tensor(output_shape(x.shape), x.dtype);
  ops::upsample_nearest_forward(y, x, scale_, pass.channels_last);
  return y;
}

void Upsample2d::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode, const Pass& pass) {
  MPIPE_CHECK(mode == GradMode::overwrite, "upsample2d writes its gradient");
  if (!dx.empty()) ops::upsample_nearest_backward(dx, dy, scale_, pass.channels_last);
}

// ---- registry entries ----------------------------------------------------------------

namespace {
std::unique_ptr<Layer> make_join(const LayerArgs& a, SkipJoin::Op op) {
  const std::string& from = a.text("from");
  const Shape& s = a.skip;
  const Shape& in = a.input;
  // Model resolves `from` before building: an empty shape here is a layer built alone.
  if (s.rank == 0) a.refuse("from", cat("'", from, "' is not stashed by an earlier layer"), "stash it with stash = \"" + from + "\" on an earlier layer");
  bool fits = s.rank == in.rank;
  for (int d = 1; fits && d < in.rank; ++d) fits = s[d] == in[d] || (op == SkipJoin::Op::concat && d == join_axis(in));
  // Shapes a sample (the batch dimension is 1 here).
  const auto sample = [](const Shape& x) {
    std::string t = "(";
    for (int d = 1; d < x.rank; ++d) t += cat(d > 1 ? ", " : "", x[d]);
    return t + ")";
  };
  if (!fits)
    a.refuse("from", cat("the skip '", from, "' is ", sample(s), " a sample and the input ", sample(in), op == SkipJoin::Op::concat ? ": they do not concatenate along the channels" : ": add needs equal shapes"),
             op == SkipJoin::Op::concat ? "join tensors of equal size but the channels (upsample the input to the skip's plane)" : "add tensors of one shape");
  return std::make_unique<SkipJoin>(op, from, s);
}
}  // namespace

std::vector<LayerKind> skip_layer_kinds() {
  using T = OptionType;
  std::vector<LayerKind> k;
  k.push_back({"concat", "joins a stashed tensor to the input along the channels (dim 1 of images, else the last)",
               {{"from", T::text, std::nullopt, "the name an earlier layer stashed its output under (stash = \"name\")"}},
               false, [](const LayerArgs& a) { return make_join(a, SkipJoin::Op::concat); }});
  k.push_back({"add", "adds a stashed tensor of the input's shape to the input",
               {{"from", T::text, std::nullopt, "the name an earlier layer stashed its output under (stash = \"name\")"}},
               false, [](const LayerArgs& a) { return make_join(a, SkipJoin::Op::add); }});
  k.push_back({"upsample2d", "nearest upsampling: (N, C, H, W) -> (N, C, H x scale, W x scale)",
               {{"scale", T::integer, std::int64_t{2}, "the factor of both sides"}}, false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 if (a.input.rank != 4) a.refuse("kind", cat("needs images (batch, channels, height, width), gets ", a.input.str()), "put it after a convolution");
                 constexpr std::int64_t most = 64;  // an image grows by scale² in memory
                 const std::int64_t scale = std::get<std::int64_t>(a.spec.options.at("scale"));
                 if (scale < 1 || scale > most) a.refuse("scale", cat("must be from 1 to ", most, ", got ", scale), "e.g. scale = 2");
                 return std::make_unique<Upsample2d>(scale);
               }});
  return k;
}

}  // namespace mpipe
