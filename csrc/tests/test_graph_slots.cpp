// Graph slot bookkeeping: ids stable and in insertion order, counters per key,
// one key (and id) per engine, misuse (replay before capture, double capture)
// loud, release_all complete.
#include <stdexcept>

#include "core/graph_slots.h"
#include "tests/check.h"
#include "tests/suites.h"

namespace ortspec_test {
namespace {

using ortspec::GraphSlotKey;
using ortspec::GraphSlotRegistry;

void test_ids_are_stable_and_in_insertion_order() {
  GraphSlotRegistry registry;
  GraphSlotKey decode{"decode", 1, 4}, verify{"verify", 4, 4}, verify_b8{"verify", 4, 8};
  CHECK_EQ(registry.graph_id(verify), 1);
  CHECK_EQ(registry.graph_id(decode), 2);
  CHECK_EQ(registry.graph_id(verify), 1);
  CHECK_EQ(registry.graph_id(verify_b8), 3);
  CHECK_EQ(registry.size(), 3u);
}

void test_counters_follow_the_lifecycle() {
  GraphSlotRegistry registry;
  GraphSlotKey verify{"verify", 4, 2};
  registry.on_fallback(verify);          // first run eager (e.g. warm-up)
  registry.on_capture(verify);
  for (int step = 0; step < 3; ++step) registry.on_replay(verify);
  registry.invalidate(verify);           // addresses changed
  CHECK(!registry.is_captured(verify));
  registry.on_capture(verify);
  registry.on_replay(verify);
  const ortspec::GraphSlotCounters counters = registry.counters().at(verify);
  CHECK_EQ(counters.graph_id, 1);
  CHECK_EQ(counters.captures, 2);
  CHECK_EQ(counters.replays, 4);
  CHECK_EQ(counters.fallbacks, 1);
  CHECK_EQ(counters.invalidations, 1);
  CHECK(counters.captured);
}

void test_misuse_is_loud() {
  GraphSlotRegistry registry;
  GraphSlotKey decode{"decode", 1, 1};
  CHECK_THROWS(registry.on_replay(decode), std::logic_error,
               "decode(M=1, B=1, engine 0) (graph id 1) replayed while no graph is captured");
  registry.on_capture(decode);
  CHECK_THROWS(registry.on_capture(decode), std::logic_error, "already captured");
  CHECK_THROWS(registry.graph_id(GraphSlotKey{"", 1, 1}), std::invalid_argument, "slot name");
  CHECK_THROWS(registry.graph_id(GraphSlotKey{"decode", 0, 1}), std::invalid_argument,
               "tokens_per_row and batch_bucket must be >= 1");
  CHECK_THROWS(registry.graph_id(GraphSlotKey{"decode", 1, 1, -1}), std::invalid_argument,
               "engine must be >= 0");
}

void test_engines_of_one_shape_get_their_own_graphs() {
  // Two engines of one batch size alternate: each captures and replays its own graph
  // (its own id), so neither falls back nor invalidates the other's.
  GraphSlotRegistry registry;
  GraphSlotKey first{"decode", 1, 4, 0}, second{"decode", 1, 4, 1};
  CHECK(!(first == second));
  CHECK(first < second || second < first);
  CHECK_EQ(registry.graph_id(first), 1);
  CHECK_EQ(registry.graph_id(second), 2);
  registry.on_capture(first);
  registry.on_capture(second);
  for (int step = 0; step < 3; ++step) {
    registry.on_replay(first);
    registry.on_replay(second);
  }
  const auto counters = registry.counters();
  CHECK_EQ(counters.size(), 2u);
  for (const GraphSlotKey& key : {first, second}) {
    CHECK_EQ(counters.at(key).captures, 1);
    CHECK_EQ(counters.at(key).replays, 3);
    CHECK_EQ(counters.at(key).invalidations, 0);
  }
  CHECK(second.describe() == "decode(M=1, B=4, engine 1)");
}

void test_release_all_forgets_keys_but_never_reuses_ids() {
  GraphSlotRegistry registry;
  GraphSlotKey decode{"decode", 1, 1}, verify{"verify", 3, 1};
  registry.on_capture(decode);
  registry.on_capture(verify);
  auto released = registry.release_all();
  CHECK_EQ(released.size(), 2u);
  CHECK(released.at(decode).captured);
  CHECK_EQ(registry.size(), 0u);
  CHECK(!registry.is_captured(decode));
  CHECK_EQ(registry.graph_id(decode), 3);  // a fresh id: 1 may still be captured in ORT
}

}  // namespace

int run_graph_slot_tests() {
  test_ids_are_stable_and_in_insertion_order();
  test_counters_follow_the_lifecycle();
  test_misuse_is_loud();
  test_engines_of_one_shape_get_their_own_graphs();
  test_release_all_forgets_keys_but_never_reuses_ids();
  return 0;
}

}  // namespace ortspec_test
