// Arena invariants: alignment, addresses stable across resets, the pinned
// region (what a captured graph holds) never reused, overflow reported with
// requested and available bytes; persistent buffers named once, stable, zeroed.
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "core/arena.h"
#include "core/errors.h"
#include "tests/check.h"
#include "tests/suites.h"

namespace ortspec_test {
namespace {

using ortspec::Buffer;
using ortspec::Device;
using ortspec::DType;
using ortspec::StepScopedArena;

std::uintptr_t address(const Buffer& buffer) {
  return reinterpret_cast<std::uintptr_t>(buffer.unchecked_ref().data);
}

bool overlaps(const Buffer& a, const Buffer& b) {
  std::uintptr_t a_begin = address(a), b_begin = address(b);
  return a_begin < b_begin + b.unchecked_ref().nbytes() &&
         b_begin < a_begin + a.unchecked_ref().nbytes();
}

void test_blocks_are_aligned_and_disjoint() {
  auto arena = StepScopedArena::create(1 << 16, Device::cpu());
  Buffer a = arena->allocate({3}, DType::kFloat16);        // 6 bytes
  Buffer b = arena->allocate({5, 7}, DType::kFloat32);     // 140 bytes
  Buffer c = arena->allocate({0}, DType::kInt64);          // empty, still its own address
  Buffer d = arena->allocate({2, 300}, DType::kInt64);     // 4800 bytes
  for (const Buffer* each : {&a, &b, &c, &d}) CHECK_EQ(address(*each) % 256, 0u);
  CHECK(!overlaps(a, b) && !overlaps(b, d) && !overlaps(a, d));
  CHECK(address(c) != address(b) && address(c) != address(d));
  CHECK_EQ(arena->used_bytes(), 256u + 256u + 256u + 4864u);
  CHECK_EQ(a.unchecked_ref().nbytes(), 6u);
}

void test_reset_gives_the_same_addresses_each_step() {
  auto arena = StepScopedArena::create(1 << 16, Device::cpu());
  Buffer first_a = arena->allocate({4, 8}, DType::kFloat32);
  Buffer first_b = arena->allocate({16}, DType::kInt64);
  arena->reset();
  Buffer second_a = arena->allocate({4, 8}, DType::kFloat32);
  Buffer second_b = arena->allocate({16}, DType::kInt64);
  CHECK(address(first_a) == address(second_a));
  CHECK(address(first_b) == address(second_b));
  CHECK(!first_a.is_live() && second_a.is_live());
  CHECK_THROWS(first_a.ref(), std::runtime_error, "stale arena block");
  CHECK_EQ(arena->generation(), 1u);
  CHECK_EQ(arena->peak_bytes(), arena->used_bytes());
}

void test_pinned_region_is_never_reused() {
  auto arena = StepScopedArena::create(1 << 16, Device::cpu());
  Buffer graph_input = arena->allocate({64}, DType::kFloat32);
  Buffer graph_output = arena->allocate({64}, DType::kInt64);
  std::memset(graph_input.ref().data, 0xAB, graph_input.ref().nbytes());
  std::size_t pinned = arena->pin();  // "capture": a graph now holds these addresses
  CHECK_EQ(pinned, arena->used_bytes());
  Buffer scratch = arena->allocate({128}, DType::kFloat32);
  for (int step = 0; step < 5; ++step) {
    arena->reset();
    Buffer reused = arena->allocate({128}, DType::kFloat32);
    std::memset(reused.ref().data, 0x11, reused.ref().nbytes());
    CHECK(address(reused) == address(scratch));  // scratch address stable across steps
    CHECK(!overlaps(reused, graph_input) && !overlaps(reused, graph_output));
    CHECK(address(reused) >= address(graph_input) + pinned);
  }
  CHECK(graph_input.is_live() && graph_output.is_live() && !scratch.is_live());
  CHECK_EQ(arena->pinned_bytes(), pinned);
  const auto* bytes = static_cast<const unsigned char*>(graph_input.ref().data);
  bool intact = true;
  for (std::size_t i = 0; i < graph_input.ref().nbytes(); ++i) intact &= bytes[i] == 0xAB;
  CHECK(intact);

  arena->unpin_all();  // every graph released: the whole region is scratch again
  CHECK(!graph_input.is_live());
  Buffer after_release = arena->allocate({8}, DType::kFloat32);
  CHECK(address(after_release) == address(graph_input));
}

void test_overflow_names_requested_and_available_bytes() {
  auto arena = StepScopedArena::create(1024, Device::cpu());
  arena->allocate({100}, DType::kFloat32);  // 400 -> 512 bytes
  arena->pin();
  CHECK_THROWS(arena->allocate({200}, DType::kFloat32), ortspec::ArenaOverflowError,
               "requested 800 bytes for float32[200] (1024 with 256-byte alignment), "
               "available 512 of 1024 bytes");
  CHECK_EQ(arena->used_bytes(), 512u);  // a failed allocation changes nothing
  Buffer fits = arena->allocate({128}, DType::kFloat32);  // exactly the rest
  CHECK_EQ(arena->available_bytes(), 0u);
  CHECK(fits.is_live());
  CHECK_THROWS(StepScopedArena::create(0, Device::cpu()), std::invalid_argument, "capacity");
}

void test_persistent_buffers() {
  ortspec::PersistentBuffers buffers(Device::cpu());
  Buffer state = buffers.allocate("gdn_state.0", {2, 4, 8, 8}, DType::kFloat32);
  Buffer positions = buffers.allocate("positions", {2}, DType::kInt64);
  CHECK_EQ(address(state) % 256, 0u);
  const auto* values = state.ref().as<const float>();
  bool zeroed = true;
  for (std::int64_t i = 0; i < state.ref().numel(); ++i) zeroed &= values[i] == 0.0f;
  CHECK(zeroed);
  CHECK(buffers.get("gdn_state.0").ref().data == state.ref().data);  // stable address
  CHECK_THROWS(buffers.allocate("positions", {4}, DType::kInt64), std::invalid_argument,
               "already holds 'positions'");
  CHECK_THROWS(buffers.get("kv_cache"), std::out_of_range, "known: gdn_state.0, positions");
  CHECK_EQ(buffers.names().size(), 2u);
  CHECK_EQ(buffers.total_bytes(), 2u * 4 * 8 * 8 * 4 + 2 * 8);
  positions.ref().as<std::int64_t>()[1] = 7;
  buffers.zero_all(0);
  CHECK_EQ(positions.ref().as<std::int64_t>()[1], 0);
  CHECK(buffers.get("positions").name() == "positions");
}

}  // namespace

int run_arena_tests() {
  test_blocks_are_aligned_and_disjoint();
  test_reset_gives_the_same_addresses_each_step();
  test_pinned_region_is_never_reused();
  test_overflow_names_requested_and_available_bytes();
  test_persistent_buffers();
  return 0;
}

}  // namespace ortspec_test
