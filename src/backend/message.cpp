// Message buffers between MPI and the compute device: host memory, device memory, or
// device memory through pinned host copies.
#include "mpipe/backend/message.hpp"

namespace mpipe {

Inbox::Inbox(const Shape& shape, DType dtype, MessagePath path) : path_(path) {
  const std::size_t bytes = static_cast<std::size_t>(shape.numel()) * dtype_size(dtype);
  if (path.device == Device::cpu) {
    host_ = FloatBuffer(static_cast<std::size_t>(shape.numel()));
    tensor_ = make_tensor(host_.data(), shape);
    wire_ = tensor_.byte_span();
    return;
  }
  device_ = cuda::DeviceBuffer(bytes);
  tensor_ = {device_.data(), shape, dtype, Device::cuda};
  if (!path.staged()) {
    wire_ = tensor_.byte_span();
    return;
  }
  staging_ = cuda::PinnedBuffer(bytes);
  wire_ = {staging_.as<std::byte>(), bytes};
  copied_.emplace();
}

void Inbox::arrived() {
  if (!path_.staged()) return;
  // Copied in on its own stream; the compute stream waits for that copy, the host does not.
  cuda::copy_to_device(tensor_.data, staging_.data(), tensor_.bytes(), cuda::StreamKind::to_device);
  copied_->record(cuda::StreamKind::to_device);
  copied_->wait(cuda::StreamKind::compute);
}

Outbox::Outbox(std::size_t bytes, MessagePath path) : path_(path) {
  if (path.device == Device::cpu) return;
  if (path.staged() && bytes > 0) staging_ = cuda::PinnedBuffer(bytes);
  ready_.emplace();
}

std::span<const std::byte> Outbox::leave(const Tensor& data) {
  if (path_.device == Device::cpu) return data.byte_span();
  // An event marks where the data is final in the compute stream; where staged, the
  // copy-out stream waits for it and copies to pinned memory.
  ready_->record(cuda::StreamKind::compute);
  if (!path_.staged()) return data.byte_span();
  ready_->wait(cuda::StreamKind::to_host);
  cuda::copy_to_host(staging_.data(), data.data, data.bytes(), cuda::StreamKind::to_host);
  ready_->record(cuda::StreamKind::to_host);
  return {staging_.as<std::byte>(), data.bytes()};
}

}  // namespace mpipe
