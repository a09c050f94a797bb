// Test driver for core/entry_mac_openssl.h: the calls the runtime's cache hook
// makes, against the system OpenSSL (tests/runtime/test_cext_envelope.py builds it).
//   entry_mac_check verify FILE      prints VerifyCacheEntry's status
//   entry_mac_check encode FILE TEXT writes TEXT as an entry (authenticated
//                                    when XLAKIT_CACHE_KEY is set)
// The key comes from XLAKIT_CACHE_KEY, as in the runtime.
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>

#include "core/entry_mac_openssl.h"
#include "core/envelope.h"

int main(int argc, char** argv) {
  std::string mode = argc > 2 ? argv[1] : "";
  std::unique_ptr<xlakit::EntryMac> mac = xlakit::NewEntryMacFromEnv();
  if (mode == "verify" && argc == 3) {
    std::ifstream in(argv[2], std::ios::binary);
    std::string data((std::istreambuf_iterator<char>(in)),
                     std::istreambuf_iterator<char>());
    xlakit::DecodeResult r =
        xlakit::VerifyCacheEntry(data, /*self=*/nullptr, mac.get());
    std::cout << xlakit::EntryStatusName(r.status) << " "
              << r.authenticated << r.tag_checked << " ";
    if (r.status == xlakit::EntryStatus::kOk) {
      std::cout << data.substr(r.header.payload_offset,
                               r.header.payload_length);
    }
    std::cout << "\n";
    return 0;
  }
  if (mode == "encode" && argc == 4) {
    xlakit::EntryHeader h;
    h.platform_name = "cpu";
    std::string out = mac ? xlakit::EncodeAuthenticatedEntry(h, argv[3], *mac)
                          : xlakit::EncodeEntry(h, argv[3]);
    std::ofstream(argv[2], std::ios::binary) << out;
    return out.empty() ? 1 : 0;
  }
  std::cerr << "usage: entry_mac_check verify FILE | encode FILE TEXT\n";
  return 2;
}
