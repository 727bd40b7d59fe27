#include "core/graph_slots.h"

#include <stdexcept>
#include <tuple>

namespace ortspec {

bool GraphSlotKey::operator<(const GraphSlotKey& other) const {
  return std::tie(slot, tokens_per_row, batch_bucket, engine) <
         std::tie(other.slot, other.tokens_per_row, other.batch_bucket, other.engine);
}

bool GraphSlotKey::operator==(const GraphSlotKey& other) const {
  return slot == other.slot && tokens_per_row == other.tokens_per_row &&
         batch_bucket == other.batch_bucket && engine == other.engine;
}

std::string GraphSlotKey::describe() const {
  return slot + "(M=" + std::to_string(tokens_per_row) + ", B=" + std::to_string(batch_bucket) +
         ", engine " + std::to_string(engine) + ")";
}

void GraphSlotKey::validate() const {
  if (slot.empty()) throw std::invalid_argument("GraphSlotKey: slot name must not be empty");
  if (tokens_per_row < 1 || batch_bucket < 1) {
    throw std::invalid_argument("GraphSlotKey " + describe() +
                                ": tokens_per_row and batch_bucket must be >= 1");
  }
  if (engine < 0) throw std::invalid_argument("GraphSlotKey " + describe() + ": engine must be >= 0");
}

GraphSlotCounters& GraphSlotRegistry::entry(const GraphSlotKey& key) {
  key.validate();
  auto found = slots_.find(key);
  if (found != slots_.end()) return found->second;
  GraphSlotCounters fresh;
  fresh.graph_id = next_graph_id_++;
  return slots_.emplace(key, fresh).first->second;
}

std::int64_t GraphSlotRegistry::graph_id(const GraphSlotKey& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  return entry(key).graph_id;
}

void GraphSlotRegistry::on_capture(const GraphSlotKey& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  GraphSlotCounters& counters = entry(key);
  if (counters.captured) {
    throw std::logic_error("graph slot " + key.describe() + " (graph id " +
                           std::to_string(counters.graph_id) +
                           ") is already captured: invalidate() it before capturing again");
  }
  counters.captured = true;
  ++counters.captures;
}

void GraphSlotRegistry::on_replay(const GraphSlotKey& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  GraphSlotCounters& counters = entry(key);
  if (!counters.captured) {
    throw std::logic_error("graph slot " + key.describe() + " (graph id " +
                           std::to_string(counters.graph_id) +
                           ") replayed while no graph is captured for it (never captured, or "
                           "invalidated): capture it first");
  }
  ++counters.replays;
}

void GraphSlotRegistry::on_fallback(const GraphSlotKey& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++entry(key).fallbacks;
}

void GraphSlotRegistry::invalidate(const GraphSlotKey& key) {
  std::lock_guard<std::mutex> lock(mutex_);
  GraphSlotCounters& counters = entry(key);
  counters.captured = false;
  ++counters.invalidations;
}

bool GraphSlotRegistry::is_captured(const GraphSlotKey& key) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = slots_.find(key);
  return found != slots_.end() && found->second.captured;
}

std::map<GraphSlotKey, GraphSlotCounters> GraphSlotRegistry::counters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return slots_;
}

std::map<GraphSlotKey, GraphSlotCounters> GraphSlotRegistry::release_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::map<GraphSlotKey, GraphSlotCounters> released;
  released.swap(slots_);
  // next_graph_id_ keeps counting: an id once handed to ONNX Runtime is never
  // reused, so a stale capture in a live session can never match a new key.
  return released;
}

std::size_t GraphSlotRegistry::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return slots_.size();
}

}  // namespace ortspec
