// ortspec_native_tests SUITE: runs one test suite and exits 0 (passed),
// 1 (failed) or 77 (skipped, e.g. CUDA suite without a device).
//
// CMakeLists.txt registers one ctest test per suite.
#include <cstdio>
#include <cstring>
#include <exception>

#include "tests/check.h"
#include "tests/suites.h"

namespace ortspec_test {
int& failure_count() {
  static int failures = 0;
  return failures;
}
}  // namespace ortspec_test

namespace {

struct Suite {
  const char* name;
  int (*run)();  // returns kSkipReturnCode to skip, anything else is ignored
};

const Suite kSuites[] = {
    {"arena", ortspec_test::run_arena_tests},
    {"graph_slots", ortspec_test::run_graph_slot_tests},
    {"state_kernels_cpu", ortspec_test::run_state_kernel_cpu_tests},
    {"state_kernels_cuda", ortspec_test::run_state_kernel_cuda_tests},
};

int usage() {
  std::printf("usage: ortspec_native_tests SUITE\nsuites:");
  for (const Suite& suite : kSuites) std::printf(" %s", suite.name);
  std::printf("\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return usage();
  for (const Suite& suite : kSuites) {
    if (std::strcmp(argv[1], suite.name) != 0) continue;
    int status = 0;
    try {
      status = suite.run();
    } catch (const std::exception& error) {
      ortspec_test::report_failure(__FILE__, __LINE__,
                                   std::string("uncaught exception: ") + error.what());
    }
    if (status == ortspec_test::kSkipReturnCode) return status;  // the suite printed why
    int failures = ortspec_test::failure_count();
    std::printf("%s: %s (%d failure%s)\n", suite.name, failures == 0 ? "PASSED" : "FAILED",
                failures, failures == 1 ? "" : "s");
    return failures == 0 ? 0 : 1;
  }
  return usage();
}
