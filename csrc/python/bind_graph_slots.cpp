// Python face of the graph slot registry (core/graph_slots.h).
//
// Keys may be a GraphSlotKey, a (slot, tokens_per_row, batch_bucket[, engine])
// tuple, or any object with those attributes (the runtime layer's frozen
// dataclass ortspec.runtime.graph_slots.SlotKey), so Python code keeps its own
// key type. engine defaults to 0 where it is not given.
#include <pybind11/stl.h>

#include <string>

#include "core/graph_slots.h"
#include "python/bindings.h"

namespace ortspec::python {
namespace {

GraphSlotKey key_arg(py::handle key) {
  if (py::isinstance<GraphSlotKey>(key)) return key.cast<GraphSlotKey>();
  if (py::isinstance<py::tuple>(key) && (py::len(key) == 3 || py::len(key) == 4)) {
    py::tuple fields = py::reinterpret_borrow<py::tuple>(key);
    return GraphSlotKey{fields[0].cast<std::string>(), fields[1].cast<std::int64_t>(),
                        fields[2].cast<std::int64_t>(),
                        py::len(key) == 4 ? fields[3].cast<std::int64_t>() : 0};
  }
  if (py::hasattr(key, "slot") && py::hasattr(key, "tokens_per_row") &&
      py::hasattr(key, "batch_bucket")) {
    return GraphSlotKey{key.attr("slot").cast<std::string>(),
                        key.attr("tokens_per_row").cast<std::int64_t>(),
                        key.attr("batch_bucket").cast<std::int64_t>(),
                        py::hasattr(key, "engine") ? key.attr("engine").cast<std::int64_t>() : 0};
  }
  throw py::type_error("graph slot key must be a GraphSlotKey, a (slot, tokens_per_row, "
                       "batch_bucket[, engine]) tuple, or an object with those attributes; got " +
                       std::string(py::str(py::type::handle_of(key).attr("__name__"))));
}

py::dict counters_dict(const std::map<GraphSlotKey, GraphSlotCounters>& slots) {
  py::dict result;
  for (const auto& [key, counters] : slots) {
    py::dict entry;
    entry["graph_id"] = counters.graph_id;
    entry["captures"] = counters.captures;
    entry["replays"] = counters.replays;
    entry["fallbacks"] = counters.fallbacks;
    entry["invalidations"] = counters.invalidations;
    entry["captured"] = counters.captured;
    result[py::make_tuple(key.slot, key.tokens_per_row, key.batch_bucket, key.engine)] = entry;
  }
  return result;
}

}  // namespace

void bind_graph_slots(py::module_& module) {
  py::class_<GraphSlotKey>(module, "GraphSlotKey",
                           "(slot name, tokens per row M, batch bucket, engine): one captured "
                           "shape over one engine's buffers.")
      .def(py::init([](std::string slot, std::int64_t tokens_per_row, std::int64_t batch_bucket,
                       std::int64_t engine) {
             GraphSlotKey key{std::move(slot), tokens_per_row, batch_bucket, engine};
             key.validate();
             return key;
           }),
           py::arg("slot"), py::arg("tokens_per_row"), py::arg("batch_bucket"),
           py::arg("engine") = 0)
      .def_readonly("slot", &GraphSlotKey::slot)
      .def_readonly("tokens_per_row", &GraphSlotKey::tokens_per_row)
      .def_readonly("batch_bucket", &GraphSlotKey::batch_bucket)
      .def_readonly("engine", &GraphSlotKey::engine)
      .def("__eq__", [](const GraphSlotKey& key, py::handle other) {
        return py::isinstance<GraphSlotKey>(other) && key == other.cast<GraphSlotKey>();
      })
      .def("__hash__", [](const GraphSlotKey& key) {
        return py::hash(py::make_tuple(key.slot, key.tokens_per_row, key.batch_bucket, key.engine));
      })
      .def("__repr__", [](const GraphSlotKey& key) {
        return "GraphSlotKey('" + key.slot + "', tokens_per_row=" +
               std::to_string(key.tokens_per_row) + ", batch_bucket=" +
               std::to_string(key.batch_bucket) + ", engine=" + std::to_string(key.engine) + ")";
      });

  py::class_<GraphSlotRegistry>(module, "GraphSlotRegistry", R"doc(
gpu_graph_id per graph slot key, and counters of what happened to each slot:
captures, replays, fallbacks (eager runs), invalidations. Ids are positive, in
insertion order, never reused. on_replay before on_capture, or on_capture of a
slot already captured, raises RuntimeError.)doc")
      .def(py::init<>())
      .def("graph_id", [](GraphSlotRegistry& r, py::handle key) { return r.graph_id(key_arg(key)); },
           py::arg("key"))
      .def("on_capture", [](GraphSlotRegistry& r, py::handle key) { r.on_capture(key_arg(key)); },
           py::arg("key"))
      .def("on_replay", [](GraphSlotRegistry& r, py::handle key) { r.on_replay(key_arg(key)); },
           py::arg("key"))
      .def("on_fallback", [](GraphSlotRegistry& r, py::handle key) { r.on_fallback(key_arg(key)); },
           py::arg("key"))
      .def("invalidate", [](GraphSlotRegistry& r, py::handle key) { r.invalidate(key_arg(key)); },
           py::arg("key"))
      .def("is_captured",
           [](const GraphSlotRegistry& r, py::handle key) { return r.is_captured(key_arg(key)); },
           py::arg("key"))
      .def("counters", [](const GraphSlotRegistry& r) { return counters_dict(r.counters()); },
           "{(slot, tokens_per_row, batch_bucket, engine): {graph_id, captures, replays, "
           "fallbacks, invalidations, captured}}")
      .def("release_all", [](GraphSlotRegistry& r) { return counters_dict(r.release_all()); },
           "Forgets every slot (teardown); returns the counters as they were.")
      .def("__len__", &GraphSlotRegistry::size);
}

}  // namespace ortspec::python
