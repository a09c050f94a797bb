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

namespace {

void Escape(unsigned char c, std::string* line) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "\\x%02x", c);
  *line += buf;
}

// The length of the well-formed UTF-8 sequence at `s[i]` that is not a C1
// control (U+0080-U+009F, which terminals act on as ESC does); 0 otherwise.
size_t Utf8Printable(const std::string& s, size_t i) {
  const unsigned char lead = static_cast<unsigned char>(s[i]);
  const size_t n = lead >= 0xC2 && lead <= 0xDF   ? 2
                   : lead >= 0xE0 && lead <= 0xEF ? 3
                   : lead >= 0xF0 && lead <= 0xF4 ? 4
                                                  : 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return 0;
  }
  const unsigned char next = static_cast<unsigned char>(s[i + 1]);
  if (lead == 0xC2 && next <= 0x9F) return 0;          // C1 controls
  if (lead == 0xE0 && next < 0xA0) return 0;           // overlong
  if (lead == 0xED && next > 0x9F) return 0;           // surrogates
  if (lead == 0xF0 && next < 0x90) return 0;           // overlong
  if (lead == 0xF4 && next > 0x8F) return 0;           // past U+10FFFF
  return n;
}

}  // namespace

void Log(const std::string& message) {
  // Messages quote bytes from files (an entry's magic, a key record's text):
  // control bytes (C0, DEL, C1) and bytes that are not UTF-8 are escaped, so a
  // NUL cannot cut the line and no escape sequence reaches a terminal.
  std::string line = "xlakit-pjrt: ";
  for (size_t i = 0; i < message.size();) {
    const unsigned char c = static_cast<unsigned char>(message[i]);
    if (c >= 0x20 && c < 0x7f) {
      line += static_cast<char>(c);
      ++i;
    } else if (size_t n = c >= 0x80 ? Utf8Printable(message, i) : 0) {
      line.append(message, i, n);
      i += n;
    } else {
      Escape(c, &line);
      ++i;
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
