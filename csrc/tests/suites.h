// The test suites of ortspec_native_tests (one file each).
#pragma once

namespace ortspec_test {

int run_arena_tests();
int run_graph_slot_tests();
int run_state_kernel_cpu_tests();
// Returns kSkipReturnCode, after printing SKIPPED and why, without CUDA or a device.
int run_state_kernel_cuda_tests();
// The transition commit's tests, run inside the two state kernel suites (test_transition_kernels.cpp).
void run_transition_kernel_cpu_tests();
void run_transition_kernel_cuda_tests();  // CUDA builds only

}  // namespace ortspec_test
