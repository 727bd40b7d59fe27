// Bookkeeping for CUDA graph slots: which ONNX Runtime graph id each
// (slot, tokens per row, batch bucket, engine) uses, and what happened to it.
//
// ONNX Runtime captures one CUDA graph per `gpu_graph_id` run option and
// replays it on later runs with the same id. The runtime layer keeps one key
// per distinct shape it runs under a graph (decode M=1, verify M=k+1, each
// batch bucket, each engine: a captured graph binds the addresses of one
// engine's state buffers, so two engines of one batch size need two graphs);
// this registry gives each key a stable positive id in
// insertion order and counts captures, replays, eager fallbacks and
// invalidations, so that tests and benchmarks can prove graphs were really
// replayed. Misuse (replaying a key never captured) throws: a silent replay of
// the wrong graph would corrupt state without a trace. Pure C++, thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace ortspec {

struct GraphSlotKey {
  std::string slot;              // the graph, e.g. "decode", "verify_select_k3", "decode.stage1"
  std::int64_t tokens_per_row;   // M: tokens each request row carries in one run
  std::int64_t batch_bucket;     // padded batch size the graph was captured for
  std::int64_t engine = 0;       // the engine (set of state buffers) whose addresses it binds

  bool operator<(const GraphSlotKey& other) const;
  bool operator==(const GraphSlotKey& other) const;
  // "verify(M=4, B=8, engine 0)"
  std::string describe() const;
  // Throws std::invalid_argument unless slot is non-empty, M, B >= 1 and engine >= 0.
  void validate() const;
};

struct GraphSlotCounters {
  std::int64_t graph_id = 0;    // ONNX Runtime gpu_graph_id, >= 1
  std::int64_t captures = 0;
  std::int64_t replays = 0;
  std::int64_t fallbacks = 0;   // runs of this shape done eagerly instead of by the graph
  std::int64_t invalidations = 0;
  bool captured = false;        // a graph is held now (captured, not invalidated)
};

class GraphSlotRegistry {
 public:
  // The key's gpu_graph_id, assigned on first sight (1, 2, 3, ... in insertion
  // order) and never reused for another key, not even after release_all().
  std::int64_t graph_id(const GraphSlotKey& key);

  // A graph was captured for key. Throws if one is already held (invalidate first).
  void on_capture(const GraphSlotKey& key);
  // The held graph was replayed. Throws if none is held (capture first).
  void on_replay(const GraphSlotKey& key);
  // The shape ran eagerly (gpu_graph_id -1) instead of through a graph.
  void on_fallback(const GraphSlotKey& key);
  // The held graph must not be replayed again (addresses or shapes changed).
  void invalidate(const GraphSlotKey& key);

  bool is_captured(const GraphSlotKey& key) const;
  // Snapshot of every key's counters, ordered by key.
  std::map<GraphSlotKey, GraphSlotCounters> counters() const;
  // Forgets every key (teardown) and returns the counters as they were.
  std::map<GraphSlotKey, GraphSlotCounters> release_all();
  std::size_t size() const;

 private:
  GraphSlotCounters& entry(const GraphSlotKey& key);  // caller holds mutex_

  mutable std::mutex mutex_;
  std::map<GraphSlotKey, GraphSlotCounters> slots_;
  std::int64_t next_graph_id_ = 1;
};

}  // namespace ortspec
