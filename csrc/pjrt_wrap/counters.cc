// Counters and the wrapper's log lines; see counters.h.
#include "pjrt_wrap/counters.h"

#include <cstdint>
#include <cstdio>
#include <new>
#include <set>

namespace xlakit {
namespace pjrt_wrap {

void Counters::Refused(const std::string& reason) noexcept {
  try {
    std::lock_guard<std::mutex> lock(mu_);
    ++refused_[reason];
  } catch (...) {
    ++refusals_unrecorded;  // no memory for the reason: the count still grows
  }
}

std::map<std::string, uint64_t> Counters::RefusedByReason() {
  std::lock_guard<std::mutex> lock(mu_);
  return refused_;
}

Counters& GlobalCounters() {
  // Never destroyed (read at exit), and made without allocating: the first
  // call may come from a compile with no memory left.
  alignas(Counters) static unsigned char storage[sizeof(Counters)];
  static Counters* counters = new (storage) Counters();
  return *counters;
}

namespace {

void Escape(unsigned char c, std::string* line) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "\\x%02x", c);
  *line += buf;
}

// Format controls (Unicode category Cf: bidi embeddings, overrides and
// isolates such as U+202E, zero-width characters, the BOM, tags) and the
// line and paragraph separators (Zl, Zp): they reorder, hide or break what a
// terminal or a log viewer shows. Unicode 15's table (a superset of 14's).
constexpr uint32_t kFormatControls[][2] = {
    {0xAD, 0xAD},       {0x600, 0x605},     {0x61C, 0x61C},
    {0x6DD, 0x6DD},     {0x70F, 0x70F},     {0x890, 0x891},
    {0x8E2, 0x8E2},     {0x180E, 0x180E},   {0x200B, 0x200F},
    {0x2028, 0x202E},   {0x2060, 0x2064},   {0x2066, 0x206F},
    {0xFEFF, 0xFEFF},   {0xFFF9, 0xFFFB},   {0x110BD, 0x110BD},
    {0x110CD, 0x110CD}, {0x13430, 0x1343F}, {0x1BCA0, 0x1BCA3},
    {0x1D173, 0x1D17A}, {0xE0001, 0xE0001}, {0xE0020, 0xE007F}};

bool FormatControl(uint32_t cp) {
  for (const auto& range : kFormatControls) {
    if (cp >= range[0] && cp <= range[1]) return true;
  }
  return false;
}

// The code point of the `n`-byte UTF-8 sequence at `s[i]` (well formed).
uint32_t CodePoint(const std::string& s, size_t i, size_t n) {
  const unsigned char lead = static_cast<unsigned char>(s[i]);
  uint32_t cp = n == 2 ? lead & 0x1F : n == 3 ? lead & 0x0F : lead & 0x07;
  for (size_t k = 1; k < n; ++k) {
    cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  }
  return cp;
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

std::string LogLine(const std::string& message) {
  // Messages quote bytes from files and the environment (an entry's magic, a
  // key record's text, a plugin's path): control bytes (C0, DEL, C1), format
  // controls and separators, and bytes that are not UTF-8 are escaped, so a
  // NUL cannot cut the line, no escape sequence reaches a terminal and no
  // bidi override turns the text around.
  std::string line = "xlakit-pjrt: ";
  for (size_t i = 0; i < message.size();) {
    const unsigned char c = static_cast<unsigned char>(message[i]);
    const size_t n = c >= 0x80 ? Utf8Printable(message, i) : 0;
    if (c >= 0x20 && c < 0x7f) {
      line += static_cast<char>(c);
      ++i;
    } else if (n > 0 && FormatControl(CodePoint(message, i, n))) {
      char buf[16];
      std::snprintf(buf, sizeof(buf), "\\u{%04x}",
                    static_cast<unsigned>(CodePoint(message, i, n)));
      line += buf;
      i += n;
    } else if (n > 0) {
      line.append(message, i, n);
      i += n;
    } else {
      Escape(c, &line);
      ++i;
    }
  }
  return line + "\n";
}

}  // namespace

void Log(const std::string& message) noexcept {
  try {
    const std::string line = LogLine(message);
    std::fwrite(line.data(), 1, line.size(), stderr);
  } catch (...) {  // diagnostics never crash: the line is lost, and says so
    std::fputs("xlakit-pjrt: (a message was lost: out of memory)\n", stderr);
  }
  std::fflush(stderr);
}

void LogOnce(const std::string& kind, const std::string& message) noexcept {
  // As GlobalCounters: never destroyed, made without allocating.
  alignas(std::mutex) static unsigned char mu_storage[sizeof(std::mutex)];
  alignas(std::set<std::string>) static unsigned char seen_storage[sizeof(
      std::set<std::string>)];
  static std::mutex* mu = new (mu_storage) std::mutex();
  static std::set<std::string>* seen =
      new (seen_storage) std::set<std::string>();
  try {
    std::lock_guard<std::mutex> lock(*mu);
    if (!seen->insert(kind).second) return;
  } catch (...) {
    // No memory to remember the kind: logged again next time, never lost.
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
