// A tiny test harness: CHECK macros that count failures instead of aborting,
// so one run reports every broken invariant of a suite.
#pragma once

#include <cstdio>
#include <exception>
#include <string>

namespace ortspec_test {

// Failures recorded so far in this process.
int& failure_count();

inline void report_failure(const char* file, int line, const std::string& what) {
  ++failure_count();
  std::printf("FAILED %s:%d: %s\n", file, line, what.c_str());
}

// Exit code ctest reads as "skipped" (SKIP_RETURN_CODE in CMakeLists.txt).
constexpr int kSkipReturnCode = 77;

}  // namespace ortspec_test

#define CHECK(condition)                                                         \
  do {                                                                           \
    if (!(condition)) ortspec_test::report_failure(__FILE__, __LINE__, #condition); \
  } while (0)

#define CHECK_EQ(actual, expected)                                                  \
  do {                                                                              \
    auto actual_value = (actual);                                                   \
    auto expected_value = (expected);                                               \
    if (!(actual_value == expected_value)) {                                        \
      ortspec_test::report_failure(__FILE__, __LINE__,                              \
                                   std::string(#actual " == " #expected " (got ") + \
                                       std::to_string(actual_value) + " vs " +      \
                                       std::to_string(expected_value) + ")");       \
    }                                                                               \
  } while (0)

// Checks that `statement` throws ExceptionType whose what() contains `fragment`.
#define CHECK_THROWS(statement, ExceptionType, fragment)                                  \
  do {                                                                                    \
    bool thrown = false;                                                                  \
    try {                                                                                 \
      statement;                                                                          \
    } catch (const ExceptionType& error) {                                                \
      thrown = true;                                                                      \
      if (std::string(error.what()).find(fragment) == std::string::npos) {                \
        ortspec_test::report_failure(__FILE__, __LINE__,                                  \
                                     std::string("message of " #statement " lacks '") +   \
                                         fragment + "': " + error.what());                \
      }                                                                                   \
    } catch (const std::exception& error) {                                               \
      thrown = true;                                                                      \
      ortspec_test::report_failure(__FILE__, __LINE__,                                    \
                                   std::string(#statement " threw the wrong type: ") +    \
                                       error.what());                                     \
    }                                                                                     \
    if (!thrown) {                                                                        \
      ortspec_test::report_failure(__FILE__, __LINE__, #statement " did not throw");      \
    }                                                                                     \
  } while (0)
