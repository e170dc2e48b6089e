// Residual blocks, their skip paths, and the residual kind.
#include "mpipe/nn/residual.hpp"

#include <cmath>
#include <cstdint>

#include "mpipe/nn/conv_layers.hpp"
#include "mpipe/nn/dense_layers.hpp"
#include "mpipe/nn/registry.hpp"

namespace mpipe {

// ---- Residual ------------------------------------------------------------------------

Residual::Residual(std::vector<std::unique_ptr<Layer>> inner, std::vector<std::unique_ptr<Layer>> skip)
    : inner_(std::move(inner)), skip_(std::move(skip)) {
  mark_in_place(inner_);
  mark_in_place(skip_);
  fusions_ = mark_fusions(inner_) + mark_fusions(skip_);
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
  // Its backward takes from the scratch arena (backward_chain): its parts' input gradients
  // where spent memory has no room for them (`gradients`), and one part's temporaries at
  // a time.
  double scratch = 0, spent = 0, gradients = 0;
  // Its forward's peak: the parts in forward order (the inner path, then the skip path),
  // each's own peak above what the parts before it keep.
  double kept = 0, peak = 0;
  // Its parts' input gradients (backward_chain), modelled with its own memory alone: part
  // i's first-fit in what the parts after it on the path allocated, the last inner part's
  // in the block's output (`spare` bytes), beside the one it reads; the rest in two turns.
  const auto turns = [&](const std::vector<double>& region, const std::vector<double>& grad, double spare) {
    std::vector<double> start(grad.size() + 1, 0.0);
    for (std::size_t i = 0; i < grad.size(); ++i) start[i + 1] = start[i] + region[i];
    double need[2];
    first_fit(start, grad, spare, need);
    return need[0] + need[1];
  };
  // --remat selective: the light inner parts' activations (their outputs, a BatchNorm's
  // statistics) are recomputed in backward, each by its forward again.
  double recomputable = 0, recompute_flops = 0;
  const auto chain = [&](const std::vector<std::unique_ptr<Layer>>& parts, double spare) {
    Shape s = in;
    std::vector<double> region, grad;
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const Cost c = parts[i]->cost(s);
      if (&parts == &inner_ && light(i)) {
        recomputable += c.activation_bytes;
        recompute_flops += c.forward_flops;
      }
      peak = std::max(peak, kept + c.forward_peak());
      kept += c.activation_bytes;
      total += c;
      // One part's at a time; where it takes temporaries from spent memory (a
      // convolution's columns), from what the layers after the block allocated.
      scratch = std::max(scratch, c.backward_scratch_bytes - c.backward_spent_bytes);
      spent = std::max(spent, c.backward_spent_bytes);
      region.push_back(c.activation_bytes + c.contexts * sizeof(Context));
      grad.push_back(4.0 * static_cast<double>(s.numel()));
      s = parts[i]->output_shape(s);
    }
    gradients += turns(region, grad, spare);
    return s;
  };
  const Shape s = chain(inner_, 4.0 * static_cast<double>(output_shape(in).numel()));
  chain(skip_, 0.0);
  // The skip path's output, given back after the sum (forward_impl): the sum's peak had
  // it, the backward does not.
  if (gives_back_skip()) total.activation_bytes -= 4.0 * static_cast<double>(s.numel());
  total.backward_scratch_bytes = scratch + spent + gradients;
  total.backward_spent_bytes = spent + gradients;
  const double out = static_cast<double>(s.numel());
  total.forward_flops += out;
  total.backward_flops += out;
  if (!sums_in_place()) total.activation_bytes += 4 * out;  // the sum, unless over the last part's output
  total.forward_peak_bytes = peak;
  total.recomputable_bytes = recomputable;
  total.recompute_flops = recompute_flops;
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
  // --remat selective: the light parts' outputs (and a BatchNorm's statistics) into the
  // transient arena; the backward recomputes them (recompute_parts). Their contexts mark
  // where they began in this arena (nothing of theirs is there): spent memory runs
  // between such marks.
  Pass light_pass = pass;
  if (pass.transient) light_pass.arena = pass.transient;
  Tensor h = x;
  for (std::size_t i = 0; i < n; ++i) {
    if (pass.transient && light(i)) {
      const Arena::Mark here = pass.arena->mark();
      h = inner_[i]->forward(h, c[i], light_pass);
      c[i].begin = here;
      ctx.recompute_parts = true;
    } else {
      h = inner_[i]->forward(h, c[i], pass);
    }
  }
  Tensor skip = x;
  for (std::size_t j = 0; j < skip_.size(); ++j) skip = skip_[j]->forward(skip, c[n + j], pass);
  // Over the last inner layer's output where that is dead to it (a BatchNorm's); else a
  // fresh sum: a layer may keep its own output (ReLU does) or pass its input on. Either is
  // dead in the block's backward (ctx.saved[0]), the layers after it having run theirs.
  if (sums_in_place() && h.data != x.data) {
    ops::add(h, skip);
    // The skip path's output is dead now: its last part (a projection, or the BatchNorm
    // after one) allocated it last and reads it no more, so the arena takes it back (a
    // GPU stream reuses it after the sum, in stream order).
    if (gives_back_skip()) pass.arena->give_back(skip);
    ctx.saved[0] = h;
    return h;
  }
  Tensor y = pass.arena->tensor(h.shape, pass.dtype);
  ops::copy(y, h);
  ops::add(y, skip);
  ctx.saved[0] = y;
  return y;
}

// A skip path whose last part allocates its output last and does not read it (a
// projection, or the BatchNorm after one): the sum reads it last, and Residual::forward
// gives it back.
bool Residual::gives_back_skip() const {
  return sums_in_place() && !skip_.empty() && skip_.back()->output_reusable() && skip_.back()->output_last();
}

namespace {
bool overlaps(const Tensor& a, const Tensor& b) {
  if (a.empty() || b.empty()) return false;
  const auto x = reinterpret_cast<std::uintptr_t>(a.data), y = reinterpret_cast<std::uintptr_t>(b.data);
  return x < y + b.bytes() && y < x + a.bytes();
}
}  // namespace

// Runs layers[count-1] .. layers[0] backward from dy, the first into dx by `mode`. Part
// i's input gradient goes into spent memory where there is room for it: what the parts
// after it on its path allocated (from c[i + 1].begin up to `end`; none where `end` is
// null), else `also`, where the block's caller has room (pass.spent: the layers after it);
// else into two scratch buffers the parts take in turns (a dy is dead once its backward
// returns). The caller's live tensors (the block's dy, dx) stay untouched.
static void backward_chain(std::span<const std::unique_ptr<Layer>> layers, Context* c, const Tensor& dy, const Tensor& dx,
                           GradMode mode, const Pass& pass, const Arena::Mark* end, const Spent* also,
                           const Tensor& spare = {}) {
  const std::size_t n = layers.size();
  // dx (the caller's live[1]) is written last, from grads[1]: while the chain overwrites
  // it, the gradients before that may lie in it.
  const auto live = [&](const Spent& s, std::size_t i) {
    Spent r = s;
    if (i >= 2 && mode == GradMode::overwrite) r.live[1] = Tensor{};
    return r;
  };
  ChainGradients grads(
      n, dy, pass.dtype, *pass.arena, [&](std::size_t i) { return c[i].input.shape; },
      [&](std::size_t i, Shape shape, const Tensor& above) -> Tensor {
        if (!pass.spent) return {};
        Tensor t;
        if (end && i + 1 < n) {
          Spent own = live(*pass.spent, i);
          own.from = c[i + 1].begin;
          own.to = *end;
          t = own.take(shape, pass.dtype, {above});
        }
        if (t.empty() && !spare.empty() && i + 1 == n && shape.numel() * dtype_size(pass.dtype) <= spare.bytes()) {
          t = spare.head(shape);
          for (const Tensor& other : live(*pass.spent, i).live) t = overlaps(t, other) ? Tensor{} : t;
          if (overlaps(t, above)) t = Tensor{};
        }
        return t.empty() && also ? live(*also, i).take(shape, pass.dtype, {above}) : t;
      });
  // Each part's temporaries: in `also` beside the gradients it reads and writes, else in
  // scratch, given back when it returns (what W needs it keeps in the stash).
  const auto run = [&](std::size_t i, const Tensor& g, const Tensor& d, GradMode m) {
    Spent room;
    Pass part = pass;
    part.spent = nullptr;
    if (pass.spent && also) {
      room = live(*also, i);
      room.live[3] = g;
      room.live[4] = d;
      part.spent = &room;
    }
    const Arena::Mark temporaries = pass.arena->mark();
    layers[i]->backward(c[i], g, d, m, part);
    pass.arena->rewind(temporaries);
  };
  Tensor g = dy;
  for (std::size_t i = n; i-- > 1;) {
    const Tensor d = grads(i, g);
    run(i, g, d, GradMode::overwrite);
    g = d;
  }
  run(0, g, dx, mode);  // dx may be empty: weight gradients only
}
void Residual::backward_weight_impl(Context& ctx, const Pass& pass) {
  for (std::size_t i = inner_.size(); i-- > 0;) inner_[i]->backward_weight(ctx.children[i], pass);
  for (std::size_t j = skip_.size(); j-- > 0;) skip_[j]->backward_weight(ctx.children[inner_.size() + j], pass);
}

void Residual::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode, const Pass& pass) {
  Context* c = ctx.children;
  const std::size_t n = inner_.size();
  if (ctx.recompute_parts) {
    // --remat selective: what the forward let go, recomputed from what it kept with the
    // same ops on the same inputs (the same bits; no running statistics move): into the
    // backward's scratch, below its parts' temporaries, or where split into the stash,
    // until W. Each part after a light one reads the recomputed output.
    Pass again = pass;
    again.recompute = true;
    again.stash = nullptr;
    again.spent = nullptr;
    if (pass.stash) again.arena = pass.stash;
    for (std::size_t i = 0; i < n; ++i) {
      if (!light(i)) continue;
      const Arena::Mark began = c[i].begin;
      const Tensor out = inner_[i]->forward(c[i].input, c[i], again);
      c[i].begin = began;
      c[i + 1].input = out;
    }
  }
  // Spent memory (unsplit, pass.spent): the inner path's parts after each, up to the skip
  // path's (which its backward reads next) or, without one, through what the layers after
  // the block allocated; then, for the skip path, the whole inner path's.
  const Spent* after = pass.spent;
  Arena::Mark inner_end;
  if (after) inner_end = skip_.empty() ? after->to : c[n].begin;
  // The block's output (ctx.saved[0]), which its forward allocated and no one reads now,
  // takes the last inner part's input gradient, which no part's region after it can.
  backward_chain(inner_, c, dy, dx, mode, pass, after ? &inner_end : nullptr, after, after ? ctx.saved[0] : Tensor{});
  if (skip_.empty()) {
    if (!dx.empty()) ops::add(dx, dy);
    return;
  }
  Spent inner;
  if (after) {
    inner = *after;
    inner.from = c[0].begin;
    inner.to = c[n].begin;
  }
  backward_chain(skip_, c + n, dy, dx, GradMode::accumulate, pass, nullptr, after ? &inner : nullptr);
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
