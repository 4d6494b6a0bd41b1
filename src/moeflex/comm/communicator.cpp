#include "moeflex/comm/communicator.h"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <fmt/format.h>

namespace moeflex::comm {

namespace {
std::atomic<bool> g_host_oversubscribed{false};
}

void set_host_oversubscribed(bool oversubscribed) { g_host_oversubscribed.store(oversubscribed); }
bool host_oversubscribed() { return g_host_oversubscribed.load(std::memory_order_relaxed); }

Seconds comm_timeout_from_env() {
  const char* text = std::getenv("MOEFLEX_COMM_TIMEOUT");
  if (text == nullptr || *text == '\0') return kDefaultCommTimeout;
  char* end = nullptr;
  double v = std::strtod(text, &end);
  check_config(end != text && *end == '\0' && std::isfinite(v) && v >= 0,
               fmt::format("MOEFLEX_COMM_TIMEOUT='{}' must be a number of seconds >= 0 "
                           "(0 disables the communication watchdog)", text));
  return v;
}

Request& Request::operator=(Request&& other) noexcept {
  if (this != &other) {
    // Complete what this request still owns before taking over the other one.
    Request old(std::move(*this));
    state_ = std::move(other.state_);
  }
  return *this;
}

Request::~Request() {
  if (!state_) return;
  try {
    state_->wait();
  } catch (const std::exception& e) {
    abort_job(fmt::format("a pending receive failed while its Request was destroyed: {}", e.what()));
  }
}

void Request::wait() {
  if (!state_) return;
  // Released first: a failed operation is finished too, and must not be waited
  // for again by the destructor.
  std::unique_ptr<detail::RequestState> s = std::move(state_);
  s->wait();
}

bool Request::test() {
  if (!state_) return true;
  bool complete = false;
  try {
    complete = state_->test();
  } catch (...) {
    state_.reset();
    throw;
  }
  if (complete) state_.reset();
  return complete;
}

void Communicator::set_timeout(Seconds seconds) {
  check_config(std::isfinite(seconds) && seconds >= 0,
               fmt::format("communication timeout {} s must be >= 0 (0 disables the watchdog)", seconds));
  timeout_ = seconds;
}

void Communicator::check_count(std::int64_t n, const char* op) const {
  if (n < 0)
    throw CommError(fmt::format("{} on communicator '{}' (rank {} of {}): count {} is negative", op,
                                name_, rank(), size(), n));
}

void Communicator::check_peer(int peer, const char* op) const {
  if (peer < 0 || peer >= size())
    throw CommError(fmt::format("{} on communicator '{}' (rank {} of {}): peer {} is not in [0, {})", op,
                                name_, rank(), size(), peer, size()));
}

void Communicator::check_tag(int tag, const char* op) const {
  if (tag < 0)
    throw CommError(fmt::format("{} on communicator '{}' (rank {} of {}): tag {} is negative", op, name_,
                                rank(), size(), tag));
}

}  // namespace moeflex::comm
