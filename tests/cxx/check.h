// A minimal check macro for xlakit's C++ tests (built and run by
// `make cxx-check`): a failed check prints file:line and the expression and
// is counted; main() exits non-zero when any failed.
#ifndef XLAKIT_TESTS_CXX_CHECK_H_
#define XLAKIT_TESTS_CXX_CHECK_H_

#include <iostream>

namespace xlakit_test {

inline int& Failures() {
  static int failures = 0;
  return failures;
}

}  // namespace xlakit_test

#define XLAKIT_CHECK(cond)                                                    \
  do {                                                                        \
    if (!(cond)) {                                                            \
      ++::xlakit_test::Failures();                                            \
      std::cerr << __FILE__ << ":" << __LINE__ << ": check failed: " << #cond \
                << "\n";                                                      \
    }                                                                         \
  } while (0)

#define XLAKIT_CHECK_MSG(cond, msg)                                           \
  do {                                                                        \
    if (!(cond)) {                                                            \
      ++::xlakit_test::Failures();                                            \
      std::cerr << __FILE__ << ":" << __LINE__ << ": check failed: " << #cond \
                << " (" << msg << ")\n";                                      \
    }                                                                         \
  } while (0)

#endif  // XLAKIT_TESTS_CXX_CHECK_H_
