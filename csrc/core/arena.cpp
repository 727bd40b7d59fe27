#include "core/arena.h"

#include <algorithm>
#include <stdexcept>

#include "core/errors.h"

namespace ortspec {

// ---- Buffer -----------------------------------------------------------------

Buffer Buffer::borrowed(TensorRef ref) {
  Buffer buffer;
  buffer.ref_ = std::move(ref);
  return buffer;
}

Buffer Buffer::owning(TensorRef ref, std::shared_ptr<const void> owner) {
  Buffer buffer;
  buffer.ref_ = std::move(ref);
  buffer.keep_alive_ = std::move(owner);
  return buffer;
}

bool Buffer::is_live() const {
  return arena_ == nullptr || arena_->is_live(arena_offset_, arena_generation_);
}

const TensorRef& Buffer::ref() const {
  if (!is_live()) {
    throw std::runtime_error(
        "stale arena block " + ref_.describe() + " at offset " + std::to_string(arena_offset_) +
        ": StepScopedArena.reset() handed its bytes back. Allocate step scratch after reset() "
        "each step, or pin() blocks that must outlive the step");
  }
  return ref_;
}

// ---- StepScopedArena --------------------------------------------------------

StepScopedArena::StepScopedArena(std::size_t capacity_bytes, Device device)
    : allocation_(std::make_unique<DeviceAllocation>(capacity_bytes, device)) {}

std::shared_ptr<StepScopedArena> StepScopedArena::create(std::size_t capacity_bytes,
                                                         Device device) {
  if (capacity_bytes == 0) throw std::invalid_argument("StepScopedArena capacity_bytes must be > 0");
  return std::shared_ptr<StepScopedArena>(new StepScopedArena(capacity_bytes, device));
}

Buffer StepScopedArena::allocate(const Shape& shape, DType dtype) {
  std::size_t nbytes = static_cast<std::size_t>(shape_numel(shape)) * dtype_size(dtype);
  std::size_t reserved = align_up(nbytes == 0 ? 1 : nbytes);  // distinct addresses
  std::size_t offset = align_up(used_bytes_);
  if (offset > capacity_bytes() || reserved > capacity_bytes() - offset) {
    std::size_t available = offset > capacity_bytes() ? 0 : capacity_bytes() - offset;
    throw ArenaOverflowError(
        "StepScopedArena overflow: requested " + std::to_string(nbytes) + " bytes for " +
        dtype_name(dtype) + shape_to_string(shape) + " (" + std::to_string(reserved) +
        " with 256-byte alignment), available " + std::to_string(available) +
        " of " + std::to_string(capacity_bytes()) + " bytes (pinned " +
        std::to_string(pinned_bytes_) + ", step scratch " +
        std::to_string(used_bytes_ - pinned_bytes_) +
        "). Create the arena with a larger capacity_bytes, or reset() between steps");
  }
  used_bytes_ = offset + reserved;
  peak_bytes_ = std::max(peak_bytes_, used_bytes_);

  Buffer buffer;
  buffer.ref_ = TensorRef{static_cast<char*>(base()) + offset, dtype, shape, device()};
  buffer.keep_alive_ = shared_from_this();
  buffer.arena_ = this;
  buffer.arena_offset_ = offset;
  buffer.arena_generation_ = generation_;
  return buffer;
}

void StepScopedArena::reset() {
  used_bytes_ = pinned_bytes_;
  ++generation_;
}

std::size_t StepScopedArena::pin() {
  pinned_bytes_ = used_bytes_;
  return pinned_bytes_;
}

void StepScopedArena::unpin_all() {
  pinned_bytes_ = 0;
  used_bytes_ = 0;
  ++generation_;
}

bool StepScopedArena::is_live(std::size_t offset, std::uint64_t generation) const {
  return offset < pinned_bytes_ || generation == generation_;
}

// ---- PersistentBuffers ------------------------------------------------------

PersistentBuffers::PersistentBuffers(Device device) : device_(device) { require_device(device); }

Buffer PersistentBuffers::allocate(const std::string& name, const Shape& shape, DType dtype) {
  if (name.empty()) throw std::invalid_argument("PersistentBuffers: buffer name must not be empty");
  auto existing = buffers_.find(name);
  if (existing != buffers_.end()) {
    throw std::invalid_argument(
        "PersistentBuffers already holds '" + name + "' (" +
        existing->second.unchecked_ref().describe() +
        "): addresses are fixed for the session's life, so allocate each name once and reuse "
        "it with get('" + name + "')");
  }
  std::size_t nbytes = static_cast<std::size_t>(shape_numel(shape)) * dtype_size(dtype);
  auto allocation = std::make_shared<DeviceAllocation>(nbytes, device_);

  Buffer buffer;
  buffer.ref_ = TensorRef{allocation->data(), dtype, shape, device_};
  buffer.name_ = name;
  buffer.keep_alive_ = std::move(allocation);
  buffers_.emplace(name, buffer);
  names_.push_back(name);
  return buffer;
}

Buffer PersistentBuffers::get(const std::string& name) const {
  auto found = buffers_.find(name);
  if (found == buffers_.end()) {
    std::string known;
    for (const std::string& each : names_) known += (known.empty() ? "" : ", ") + each;
    throw std::out_of_range("PersistentBuffers has no buffer '" + name + "' (known: " +
                            (known.empty() ? "none" : known) + ")");
  }
  return found->second;
}

std::size_t PersistentBuffers::total_bytes() const {
  std::size_t total = 0;
  for (const auto& entry : buffers_) total += entry.second.unchecked_ref().nbytes();
  return total;
}

void PersistentBuffers::zero_all(std::uintptr_t stream) {
  for (const auto& entry : buffers_) {
    const TensorRef& ref = entry.second.unchecked_ref();
    fill_zero(ref.data, ref.device, ref.nbytes(), stream);
  }
}

}  // namespace ortspec
