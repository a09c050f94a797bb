// Entry point of xlakit's C++ test binary (built by `make cxx-check`,
// linked against TensorFlow's shared libraries for their XLA symbols):
//   xlakit_cxx_test units DIR   pure-function tests, scratch files in DIR
//   xlakit_cxx_test write DIR   process 1 of the real-PJRT cache test
//   xlakit_cxx_test load DIR    process 2, a fresh process
// Ends with std::_Exit: the TF libraries abort at teardown in the
// tsl::AsyncValue type registry once the program is done.
#include <cstdlib>
#include <iostream>
#include <string>

namespace xlakit_test {
int RunUnits(const std::string& dir);
int RunPjrtCache(const std::string& mode, const std::string& dir);
}  // namespace xlakit_test

int main(int argc, char** argv) {
  std::string mode = argc == 3 ? argv[1] : "";
  int rc = 2;
  if (mode == "units") {
    rc = xlakit_test::RunUnits(argv[2]);
  } else if (mode == "write" || mode == "load") {
    rc = xlakit_test::RunPjrtCache(mode, argv[2]);
  } else {
    std::cerr << "usage: " << argv[0] << " units|write|load DIR\n";
  }
  std::cout.flush();
  std::cerr.flush();
  std::_Exit(rc);
}
