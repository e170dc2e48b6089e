// Messages between MPI and the device a rank computes on (the transport's and the pair
// sums'), the device chosen once below the pipeline: on the CPU a message is the tensor's own memory; on a GPU it is device
// memory that MPI reads and writes itself when it is CUDA-aware, or otherwise a pinned
// host copy made on the copy streams, ordered against the compute stream by events. The
// transport and the pair sums ask these objects and never branch on the device.
#pragma once
#include <cstddef>
#include <optional>
#include <span>

#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/core/buffer.hpp"
#include "mpipe/core/tensor.hpp"

namespace mpipe {

// How a rank's messages reach MPI.
struct MessagePath {
  Device device = Device::cpu;
  bool cuda_aware = false;  // MPI takes device pointers (GPU only)
  // MPI moves device memory through pinned host copies (a GPU without CUDA-aware MPI).
  bool staged() const { return device == Device::cuda && !cuda_aware; }
};

// Where one incoming message lands: what MPI receives into (wire()) and what compute
// reads (tensor()), one memory unless the path is staged.
class Inbox {
 public:
  Inbox() = default;  // none: the model's first (last) stage receives no activations (gradients)
  Inbox(const Shape& shape, DType dtype, MessagePath path);
  bool empty() const { return tensor_.empty(); }
  const Tensor& tensor() const { return tensor_; }
  std::span<std::byte> wire() const { return wire_; }
  // The message has arrived in wire(): where staged, it is copied into tensor() on the
  // copy-in stream and the compute stream waits for that copy (the host does not).
  void arrived();

 private:
  MessagePath path_;
  FloatBuffer host_;                   // CPU
  cuda::DeviceBuffer device_;          // GPU
  cuda::PinnedBuffer staging_;         // staged
  std::optional<cuda::Event> copied_;  // staged: the copy-in is done
  Tensor tensor_;
  std::span<std::byte> wire_;
};

// Where one outgoing message leaves from: a tensor's data once the compute stream has
// made it final, as MPI may read it.
class Outbox {
 public:
  Outbox() = default;  // unused: keeps a table's indexing
  // For messages of up to `bytes` bytes.
  Outbox(std::size_t bytes, MessagePath path);
  // `data` is final in compute order: the bytes MPI sends (on a GPU, once ready() says so;
  // where staged, copied out on the copy-out stream first).
  std::span<const std::byte> leave(const Tensor& data);
  // Whether the bytes of the last leave() may go, without waiting; wait() until they may.
  bool ready() const { return !ready_ || ready_->done(); }
  void wait() const {
    if (ready_) ready_->synchronize();
  }

 private:
  MessagePath path_;
  cuda::PinnedBuffer staging_;        // staged
  std::optional<cuda::Event> ready_;  // GPU: the data (its staged copy) is final
};

}  // namespace mpipe
