// Reading cache entries from files (envelope.h VerifyEntryFile, ReadEntry):
// the header first, so garbage of any size is refused after one small read
// and an entry over its cap unread; then the payload, once, through the
// checksum and the tag; never through a link.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>

#include "envelope.h"
#include "envelope_internal.h"

namespace xlakit {
namespace {

using envelope_internal::Fail;
using envelope_internal::StartsWith;
using envelope_internal::ChecksumMismatch;
using envelope_internal::ParseAuthPrefix;
using envelope_internal::Unauthenticated;
using envelope_internal::BadTag;
using envelope_internal::Authenticated;
using envelope_internal::CheckStoredKey;

// The first read of an entry: every real header fits (long strings are read
// on, up to kMaxHeaderBytes).
constexpr size_t kFirstRead = 4096;

// Reads up to `n` bytes (fewer only at end of file); false on a read error.
bool ReadUpTo(int fd, size_t n, std::string* out) {
  out->resize(n);
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::read(fd, &(*out)[got], n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return false;
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  out->resize(got);
  return true;
}

// Reads up to `n` bytes into `out` (fewer only at end of file); false on a
// read error.
bool ReadInto(int fd, char* out, size_t n, size_t* got) {
  *got = 0;
  while (*got < n) {
    ssize_t r = ::read(fd, out + *got, n - *got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return false;
    if (r == 0) break;
    *got += static_cast<size_t>(r);
  }
  return true;
}

// Closes the descriptor on every return path.
struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

DecodeResult VerifyEntryFile(const std::string& path,
                             const RuntimeIdentity* self, EntryMac* mac,
                             size_t chunk_bytes, std::string* io_error,
                             const std::string* expected_key) {
  if (mac != nullptr && !mac->Refusal().empty()) {
    return Fail(EntryStatus::kKeyRefused, mac->Refusal());
  }
  auto fail_io = [&](const char* what) {
    *io_error = std::string(what) + " " + path + ": " + std::strerror(errno);
    return DecodeResult{};
  };
  // Never follow a link: the cache writer makes none, and a tool must judge
  // the file in the folder, not whatever it points at.
  Fd file{::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW)};
  if (file.fd < 0) return fail_io("cannot open");
  struct stat st;
  if (::fstat(file.fd, &st) != 0) return fail_io("cannot stat");
  EntryCheck check;
  check.self = self;
  check.mac = mac;
  check.expected_key = expected_key;
  std::string error;
  DecodeResult r = ReadEntry(file.fd, static_cast<uint64_t>(st.st_size), check,
                             chunk_bytes, nullptr, &error);
  if (!error.empty()) *io_error = "cannot read " + path + ": " + error;
  return r;
}

DecodeResult ReadEntry(int fd, uint64_t size, const EntryCheck& check,
                       size_t chunk_bytes, EntryPayload* payload,
                       std::string* io_error) {
  auto fail_io = [&]() {
    *io_error = std::strerror(errno);
    return DecodeResult{};
  };
  if (payload != nullptr) *payload = EntryPayload{};
  EntryMac* mac = check.mac;
  if (mac != nullptr && !mac->Refusal().empty()) {
    return Fail(EntryStatus::kKeyRefused, mac->Refusal());
  }
  if (chunk_bytes == 0) chunk_bytes = 1;
  const uint64_t max_head = kAuthPrefixBytes + kMaxHeaderBytes;
  std::string head;
  if (!ReadUpTo(fd, std::min<uint64_t>(size, kAuthPrefixBytes + kFirstRead),
                &head)) {
    return fail_io();
  }
  bool keyed = StartsWith(head, kAuthMagic);
  std::string tag;
  if (keyed) {
    std::string_view tag_view;
    DecodeResult p = ParseAuthPrefix(head, size, &tag_view);
    if (p.status != EntryStatus::kOk) return Authenticated(p, false);
    tag.assign(tag_view);
  } else if (mac != nullptr && StartsWith(head, kEnvelopeMagic)) {
    return Unauthenticated();
  }
  EntryMac* tag_mac = keyed ? mac : nullptr;
  const uint64_t skip = keyed ? kAuthPrefixBytes : 0;
  auto done = [&](DecodeResult r, bool tag_checked) {
    return keyed ? Authenticated(std::move(r), tag_checked) : r;
  };
  DecodeResult r = DecodeHeader(std::string_view(head).substr(skip), size - skip);
  if (r.status == EntryStatus::kTruncated && head.size() < size &&
      head.size() < max_head) {
    // A header longer than the first read (long identity strings).
    std::string more;
    if (!ReadUpTo(fd, std::min<uint64_t>(size, max_head) - head.size(),
                  &more)) {
      return fail_io();
    }
    head += more;
    r = DecodeHeader(std::string_view(head).substr(skip), size - skip);
  }
  // A header that does not decode ends the check, unless a tag must still be
  // judged first (over every byte, as VerifyCacheEntry does).
  const bool hashing = r.status == EntryStatus::kOk;
  if (!hashing && tag_mac == nullptr) return done(r, false);
  if (size > check.max_entry_bytes) {
    return done(Fail(EntryStatus::kTooLarge,
                     "entry has " + std::to_string(size) +
                         " bytes, more than the " +
                         std::to_string(check.max_entry_bytes) +
                         " an entry may have here; refused unread"),
                false);
  }
  std::string_view inner = std::string_view(head).substr(skip);
  if (tag_mac != nullptr) tag_mac->Update(inner);
  uint64_t hash = 0;
  std::unique_ptr<char[]> buffer;
  uint64_t filled = 0;
  if (hashing) {
    const uint64_t offset = r.header.payload_offset;
    std::string_view first = inner.substr(offset);
    hash = Fnv1a64(first, Fnv1a64(inner.substr(0, offset - 8)));
    if (payload != nullptr) {
      // Not zero-filled: a page is touched only when the file's bytes land
      // in it.
      buffer.reset(new (std::nothrow) char[r.header.payload_length + 1]);
      if (!buffer) {
        *io_error = "cannot allocate " +
                    std::to_string(r.header.payload_length) +
                    " bytes for its payload";
        return DecodeResult{};
      }
      std::memcpy(buffer.get(), first.data(), first.size());
      filled = first.size();
    }
  }
  uint64_t left = size - head.size();
  std::string chunk;
  while (left > 0) {
    const size_t want = static_cast<size_t>(
        std::min<uint64_t>(left, chunk_bytes));
    std::string_view piece;
    if (buffer) {
      // Everything after the header is payload: read it where it will stay.
      size_t got = 0;
      if (!ReadInto(fd, buffer.get() + filled, want, &got)) return fail_io();
      piece = std::string_view(buffer.get() + filled, got);
      filled += got;
    } else {
      if (!ReadUpTo(fd, want, &chunk)) return fail_io();
      piece = chunk;
    }
    if (piece.empty()) break;  // the file shrank while it was read
    if (tag_mac != nullptr) tag_mac->Update(piece);
    if (hashing) hash = Fnv1a64(piece, hash);
    left -= piece.size();
  }
  const bool tag_checked = tag_mac != nullptr;
  if (tag_mac != nullptr && !tag_mac->Matches(tag)) {
    return done(BadTag(), tag_checked);
  }
  if (!hashing) return done(r, tag_checked);
  if (left > 0) {
    return done(Fail(EntryStatus::kTruncated,
                     "entry shrank while it was read (" +
                         std::to_string(left) +
                         " bytes fewer than its size said)"),
                tag_checked);
  }
  if (hash != r.header.checksum) {
    return done(ChecksumMismatch(r.header.checksum, hash), tag_checked);
  }
  if (check.self != nullptr) {
    // VerifyEntry's identity rules, applied to the header alone (re-encoded
    // with an empty payload) so they live in one place.
    DecodeResult judged = VerifyEntry(EncodeEntry(r.header, ""), *check.self);
    r.status = judged.status;
    r.message = judged.message;
  }
  CheckStoredKey(&r, check.expected_key);
  if (r.status == EntryStatus::kOk && payload != nullptr) {
    payload->data = std::move(buffer);
    payload->size = r.header.payload_length;
  }
  return done(r, tag_checked);
}

}  // namespace xlakit
