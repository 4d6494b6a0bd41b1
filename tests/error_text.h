// The message of the exception a call throws, for tests that check what an error says.
#pragma once
#include <string>

namespace moeflex::test {

/// what() of the E that `f()` throws, or "<no exception>" when it returns.
template <typename E, typename F>
std::string error_text(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "<no exception>";
}

}  // namespace moeflex::test
