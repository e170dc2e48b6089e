// The layer base: shape checks around the virtual forward and backward, and the
// helpers composite layers share.
#include "mpipe/nn/layer.hpp"

#include <cstdlib>
#include <string_view>

namespace mpipe {

void append_specs(std::vector<ParamSpec>& out, const std::string& prefix, const Layer& part) {
  for (ParamSpec spec : part.param_specs()) {
    spec.name = prefix + spec.name;
    out.push_back(std::move(spec));
  }
}

// Hands consecutive slices of params/grads to the parts, in param_specs() order.
void bind_parts(std::span<const Tensor> params, std::span<const Tensor> grads, std::span<Layer* const> parts) {
  std::size_t at = 0;
  for (Layer* part : parts) {
    const std::size_t n = part->param_specs().size();
    part->bind(params.subspan(at, n), grads.subspan(at, n));
    at += n;
  }
  MPIPE_CHECK(at == params.size(), "bound ", at, " of ", params.size(), " parameters");
}
void bind_parts(std::span<const Tensor> params, std::span<const Tensor> grads, std::initializer_list<Layer*> parts) {
  bind_parts(params, grads, std::span<Layer* const>(parts.begin(), parts.size()));
}


void bind_weight_bias(std::span<const Tensor> params, std::span<const Tensor> grads, Tensor& weight, Tensor& dweight,
                      Tensor& bias, Tensor& dbias) {
  weight = params[0];
  dweight = grads[0];
  if (params.size() > 1) {
    bias = params[1];
    dbias = grads[1];
  }
}

std::vector<double> first_fit(const std::vector<double>& start, const std::vector<double>& grad, double spare,
                              double turns[2]) {
  const std::size_t n = grad.size();
  std::vector<double> at(n, -1.0);
  turns[0] = turns[1] = 0;
  for (std::size_t i = n; i-- > 1;) {
    const double above = i + 1 < n ? at[i + 1] : -1, above_size = i + 1 < n ? grad[i + 1] : 0;
    double a = start[i + 1];
    if (above >= 0 && a < above + above_size && above < a + grad[i]) a = above + above_size;
    if (a + grad[i] > start[n]) a = i + 1 == n && grad[i] <= spare && above != start[n] ? start[n] : -1;
    if (a < 0) turns[(n - 1 - i) % 2] = std::max(turns[(n - 1 - i) % 2], grad[i]);
    at[i] = a;
  }
  return at;
}

Tensor Spent::take(Shape shape, DType dtype, std::initializer_list<Tensor> also) const {
  if (!arena) return {};
  Tensor live_all[max_live + 2];
  std::size_t n = 0;
  for (const Tensor& t : live) live_all[n++] = t;
  for (const Tensor& t : also) {
    MPIPE_CHECK(n < std::size(live_all), "more live tensors than Spent::take holds");
    live_all[n++] = t;
  }
  Tensor t;
  t.shape = shape;
  t.dtype = dtype;
  t.device = arena->device();
  t.data = arena->spent(from, to, t.bytes(), std::span<const Tensor>(live_all, n));
  return t;
}

void Layer::enter_forward(const Tensor& x, Context& ctx, const Pass& pass) {
  const DType expected = input_dtype() == DType::i32 ? DType::i32 : pass.dtype;
  MPIPE_CHECK(x.dtype == expected, kind(), " layer ", global_index_, ": input is ", to_string(x.dtype), ", expected ",
              to_string(expected));
  ctx.input = x;
  if (pass.arena) ctx.begin = pass.arena->mark();
}

Tensor Layer::forward(const Tensor& x, Context& ctx, const Pass& pass) {
  enter_forward(x, ctx, pass);
  Tensor y = forward_impl(x, ctx, pass);
  MPIPE_CHECK(y.shape == output_shape(x.shape), kind(), " layer ", global_index_, ": output ",
              y.shape.str(), " expected ", output_shape(x.shape).str());
  return y;
}

void Layer::backward(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                     const Pass& pass) {
  MPIPE_CHECK(dy.shape == output_shape(ctx.input.shape), kind(), " layer ", global_index_,
              ": dy ", dy.shape.str(), " expected ", output_shape(ctx.input.shape).str());
  MPIPE_CHECK(dx.empty() || dx.shape == ctx.input.shape, kind(), " layer ", global_index_,
              ": dx ", dx.shape.str(), " expected ", ctx.input.shape.str());
  backward_impl(ctx, dy, dx, mode, pass);
}

void mark_in_place(std::span<const std::unique_ptr<Layer>> chain) {
  for (std::size_t i = 1; i < chain.size(); ++i) chain[i]->allow_in_place(chain[i - 1]->output_reusable());
}

bool fusions_on() {
  const char* env = std::getenv("MPIPE_FUSE");
  return !(env && std::string_view(env) == "off");
}

int mark_fusions(std::span<const std::unique_ptr<Layer>> chain) {
  const bool on = fusions_on();
  int fused_pairs = 0;
  for (std::size_t i = 0; i < chain.size(); ++i) {
    const bool fused = on && i + 1 < chain.size() && chain[i]->can_rectify_output() && chain[i + 1]->rectifies_in_place();
    chain[i]->rectify_output(fused);
    if (i + 1 < chain.size()) chain[i + 1]->input_rectified(fused);
    fused_pairs += fused;
  }
  return fused_pairs;
}

}  // namespace mpipe
