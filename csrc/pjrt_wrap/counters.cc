// Counters and the wrapper's log lines; see counters.h.
#include "pjrt_wrap/counters.h"

#include <cstdio>
#include <set>

namespace xlakit {
namespace pjrt_wrap {

void Counters::Refused(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  ++refused_[reason];
}

std::map<std::string, uint64_t> Counters::RefusedByReason() {
  std::lock_guard<std::mutex> lock(mu_);
  return refused_;
}

Counters& GlobalCounters() {
  static Counters* counters = new Counters();  // never destroyed: read at exit
  return *counters;
}

void Log(const std::string& message) {
  // Messages quote bytes from files (an entry's magic): control bytes are
  // escaped, so a NUL cannot cut the line and no escape reaches a terminal.
  std::string line = "xlakit-pjrt: ";
  for (unsigned char c : message) {
    if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      line += buf;
    } else {
      line += static_cast<char>(c);
    }
  }
  line += "\n";
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

void LogOnce(const std::string& kind, const std::string& message) {
  static std::mutex* mu = new std::mutex();
  static std::set<std::string>* seen = new std::set<std::string>();
  {
    std::lock_guard<std::mutex> lock(*mu);
    if (!seen->insert(kind).second) return;
  }
  Log(message);
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

}  // namespace pjrt_wrap
}  // namespace xlakit
