// Memory that ortspec binds to ONNX Runtime: step scratch and persistent state.
//
// Two owners with two lifetimes (design: "Every bound input, output and state
// lives in device memory owned by ortspec._native"):
//
//   StepScopedArena    one fixed region, allocated once; bump allocation of
//                      256-byte-aligned blocks; reset() once per step rewinds
//                      the blocks allocated since the last pin(). A captured
//                      CUDA graph keeps the addresses it saw, so pin() before
//                      capture marks everything allocated so far as pinned:
//                      reset() never hands those bytes back, and no later block
//                      overlaps them.
//
//       offset 0        pinned_bytes          used_bytes          capacity
//       |  pinned blocks  |  step scratch  -->  |      free          |
//                         ^ reset() rewinds used_bytes to here
//
//   PersistentBuffers  named buffers (recurrent state, KV cache, positions),
//                      one allocation each, zero-filled, whose addresses never
//                      change for the Session's life.
//
// Neither is thread-safe: one step loop owns them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/device_memory.h"
#include "core/tensor_ref.h"

namespace ortspec {

class StepScopedArena;

// A typed view of memory, usually owned by an arena or PersistentBuffers.
// Copies are cheap and keep the owner alive. An arena block goes stale when a
// reset() hands its bytes back; ref() then throws rather than alias new data.
class Buffer {
 public:
  Buffer() = default;

  // A view of memory someone else owns (ONNX Runtime, torch): no lifetime link.
  static Buffer borrowed(TensorRef ref);
  // A view that keeps `owner` (whatever frees the memory) alive, e.g. page-locked host memory.
  static Buffer owning(TensorRef ref, std::shared_ptr<const void> owner);

  // The view; throws std::runtime_error when the block was handed back by reset().
  const TensorRef& ref() const;
  // The view without the staleness check, for reporting.
  const TensorRef& unchecked_ref() const { return ref_; }

  bool is_live() const;
  bool owns_memory() const { return keep_alive_ != nullptr; }
  // Non-empty for PersistentBuffers entries.
  const std::string& name() const { return name_; }
  // Whoever owns the memory (nullptr for borrowed views); held by DLPack exports.
  const std::shared_ptr<const void>& keep_alive() const { return keep_alive_; }

 private:
  friend class StepScopedArena;
  friend class PersistentBuffers;

  TensorRef ref_;
  std::string name_;
  std::shared_ptr<const void> keep_alive_;
  const StepScopedArena* arena_ = nullptr;  // set for arena blocks only
  std::size_t arena_offset_ = 0;
  std::uint64_t arena_generation_ = 0;
};

class StepScopedArena : public std::enable_shared_from_this<StepScopedArena> {
 public:
  // Allocates capacity_bytes once on `device` (zero-filled).
  static std::shared_ptr<StepScopedArena> create(std::size_t capacity_bytes, Device device);

  // A block for a [shape] tensor of dtype, at the next 256-byte boundary.
  // Throws ArenaOverflowError naming requested and available bytes.
  Buffer allocate(const Shape& shape, DType dtype);

  // Per step: hands back every block allocated since the last pin().
  void reset();
  // Marks every block allocated so far as pinned (a captured graph holds their
  // addresses): reset() never hands them back. Returns pinned_bytes().
  std::size_t pin();
  // Hands back pinned blocks too; only after every graph that holds them is released.
  void unpin_all();

  std::size_t capacity_bytes() const { return allocation_->nbytes(); }
  std::size_t used_bytes() const { return used_bytes_; }
  std::size_t pinned_bytes() const { return pinned_bytes_; }
  std::size_t available_bytes() const { return capacity_bytes() - used_bytes_; }
  std::size_t peak_bytes() const { return peak_bytes_; }
  std::uint64_t generation() const { return generation_; }
  Device device() const { return allocation_->device(); }
  // Address of byte 0 of the region.
  void* base() const { return allocation_->data(); }

  // Whether a block at `offset` allocated in `generation` still owns its bytes.
  bool is_live(std::size_t offset, std::uint64_t generation) const;

 private:
  explicit StepScopedArena(std::size_t capacity_bytes, Device device);

  std::unique_ptr<DeviceAllocation> allocation_;
  std::size_t used_bytes_ = 0;
  std::size_t pinned_bytes_ = 0;
  std::size_t peak_bytes_ = 0;
  std::uint64_t generation_ = 0;  // bumped by every reset() / unpin_all()
};

class PersistentBuffers {
 public:
  // Throws std::runtime_error at once when `device` is unusable here.
  explicit PersistentBuffers(Device device);

  // A new named, zero-filled buffer. Throws std::invalid_argument when the
  // name is taken: addresses are fixed for life, so each name is allocated once.
  Buffer allocate(const std::string& name, const Shape& shape, DType dtype);
  // Throws std::out_of_range naming the known buffers.
  Buffer get(const std::string& name) const;
  bool contains(const std::string& name) const { return buffers_.count(name) != 0; }
  // Names in allocation order.
  const std::vector<std::string>& names() const { return names_; }
  std::size_t total_bytes() const;
  // Zeroes every buffer (a new request); asynchronous on `stream` for CUDA.
  void zero_all(std::uintptr_t stream);
  Device device() const { return device_; }

 private:
  Device device_;
  std::map<std::string, Buffer> buffers_;
  std::vector<std::string> names_;
};

}  // namespace ortspec
