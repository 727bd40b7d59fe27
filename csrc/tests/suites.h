// The test suites of ortspec_native_tests (one file each).
#pragma once

namespace ortspec_test {

int run_arena_tests();
int run_graph_slot_tests();
int run_state_kernel_cpu_tests();
// Returns kSkipReturnCode, after printing SKIPPED and why, without CUDA or a device.
int run_state_kernel_cuda_tests();

}  // namespace ortspec_test
