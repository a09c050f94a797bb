// The compile cache's flow (compile_cache.h): a compile keyed, its single
// flight taken, its entry looked up (compile_cache_store.cc), the real compile
// at a miss and the entry stored; the client's identity and the key itself.
// Opening the cache is compile_cache_open.cc, its bound compile_cache_evict.cc.
#include "pjrt_wrap/compile_cache.h"

#include <chrono>
#include <string>

#include "pjrt_wrap/counters.h"
#include "pjrt_wrap/pjrt_calls.h"
#include "pjrt_wrap/proto_canon.h"

namespace xlakit {
namespace pjrt_wrap {

std::unique_ptr<EntryMac> CompileCache::NewMac() const {
  if (cfg_.key.empty()) return nullptr;
  return NewLibcryptoMac(crypto_, cfg_.key);
}

CompileCache::ClientInfo CompileCache::Info(PJRT_Client* client) {
  std::lock_guard<std::mutex> lock(mu_);
  auto found = clients_.find(client);
  if (found != clients_.end()) return found->second;
  ClientInfo info;
  std::string error;
  info.ok = PlatformName(real_, client, &info.self.platform_name, &error) &&
            PlatformVersion(real_, client, &info.self.platform_version,
                            &error) &&
            DescribeTopology(real_, client, &info.topology,
                             &info.topology_source, &error);
  info.error = error;
  if (info.ok) {
    LogOnce("topology", "cache keys cover the " +
                            std::string(info.topology_source == "devices"
                                            ? "device kinds and counts (the "
                                              "plugin has no topology "
                                              "description)"
                                            : "plugin's topology description "
                                              "and device kinds") +
                            ", not the host: the hosts of a pod share entries");
  }
  info.self.patch_series_id = std::string("pjrt-wrap/") + kWrapperVersion;
  clients_[client] = info;
  return info;
}

void CompileCache::ForgetClient(PJRT_Client* client) {
  std::lock_guard<std::mutex> lock(mu_);
  clients_.erase(client);
}

std::string CompileCache::KeyFor(const ClientInfo& info,
                                 const PJRT_Client_Compile_Args& args) {
  const PJRT_Program* program = args.program;
  if (program == nullptr || program->code == nullptr) return "";
  Sha256 sha(crypto_);
  // Each field length-prefixed, so no two different inputs hash the same
  // bytes.
  auto field = [&sha](const char* data, size_t size) {
    unsigned char n[8];
    for (int i = 0; i < 8; ++i) n[i] = static_cast<unsigned char>(size >> (8 * i));
    sha.Update(std::string_view(reinterpret_cast<const char*>(n), 8));
    sha.Update(std::string_view(data ? data : "", data ? size : 0));
  };
  auto text = [&field](const std::string& s) { field(s.data(), s.size()); };
  text("xlakit-pjrt-wrap-key");
  text(kWrapperVersion);
  text(plugin_build_);
  text(info.self.platform_name);
  text(info.self.platform_version);
  text(flags_);
  text(info.topology);
  text(key_id_);
  std::string_view format(program->format ? program->format : "",
                          program->format ? program->format_size : 0);
  text(std::string(format));
  text(CanonicalProgram(format,
                        std::string_view(program->code, program->code_size)));
  text(CanonicalCompileOptions(std::string_view(
      args.compile_options ? args.compile_options : "",
      args.compile_options ? args.compile_options_size : 0)));
  return sha.Hex();
}

KeyRecord CompileCache::RecordFor(const ClientInfo& info,
                                  const PJRT_Client_Compile_Args& args) {
  KeyRecordInputs in;
  in.plugin_build = plugin_build_;
  in.flags = &flag_parts_;
  in.codegen_env = codegen_env_;
  in.platform_name = info.self.platform_name;
  in.platform_version = info.self.platform_version;
  in.topology = info.topology;
  in.topology_source = info.topology_source;
  in.key_id = key_id_;
  return MakeKeyRecord(crypto_, in, args);
}

void CompileCache::EndFlight(const std::string& key,
                             const std::shared_ptr<Flight>& flight) noexcept {
  std::lock_guard<std::mutex> lock(flight_mu_);
  flight->done = true;
  in_flight_.erase(key);
  pthread_cond_broadcast(&flight->cv);
}

bool CompileCache::Lookup(PJRT_Client_Compile_Args* args, CompileLookup* out) {
  Counters& counters = GlobalCounters();
  out->info = Info(args->client);
  if (out->info.ok) {
    out->key = KeyFor(out->info, *args);
    if (!out->key.empty()) out->path = cfg_.dir + "/" + out->key;
  }
  if (out->path.empty()) {
    LogOnce("key", "cannot key a program for the cache (" +
                       (out->info.error.empty() ? std::string("no program bytes")
                                                : out->info.error) +
                       "); compiling without it");
    return false;
  }
  // Single flight: wait while another thread has this key in hand, then take
  // it; Compile ends the flight (and the next waiter looks up) however it
  // returns.
  {
    auto mine = std::make_shared<Flight>();
    std::unique_lock<std::mutex> lock(flight_mu_);
    for (auto it = in_flight_.find(out->key); it != in_flight_.end();
         it = in_flight_.find(out->key)) {
      std::shared_ptr<Flight> other = it->second;
      ++counters.flight_waits;
      while (!other->done) {
        pthread_cond_wait(&other->cv, lock.mutex()->native_handle());
      }
    }
    in_flight_[out->key] = mine;
    out->flight = std::move(mine);
  }
  try {
    if (TryLoad(out->info, out->key, out->path, args)) return true;
  } catch (...) {
    counters.Refused("exception");
  }
  if (cfg_.explain || !cfg_.read_only) {
    out->record = RecordFor(out->info, *args);
    if (cfg_.explain) Log(ExplainMiss(out->record, cfg_.dir, out->key));
  }
  return false;
}

PJRT_Error* CompileCache::Compile(PJRT_Client_Compile_Args* args) {
  Counters& counters = GlobalCounters();
  // Everything before the real compile may fail (no memory, a plugin call
  // that throws nothing but allocates): the compile then goes on as a miss,
  // or without the cache where no key was made. Nothing after it may lose
  // the real compile's result.
  CompileLookup lookup;
  bool hit = false;
  try {
    hit = Lookup(args, &lookup);
  } catch (...) {
    ++counters.internal_errors;  // a key made stays: the compile is a miss
    hit = false;
  }
  struct Land {  // the flight ends however this returns
    CompileCache* cache;
    const CompileLookup& lookup;
    ~Land() {
      if (lookup.flight) cache->EndFlight(lookup.key, lookup.flight);
    }
  } land{this, lookup};
  if (hit) {
    ++counters.hits;
    return nullptr;
  }
  if (lookup.path.empty()) {
    ++counters.bypassed;
    return real_->PJRT_Client_Compile(args);
  }
  ++counters.misses;
  const auto start = std::chrono::steady_clock::now();
  PJRT_Error* error = real_->PJRT_Client_Compile(args);
  const uint64_t compile_us = MicrosSince(start);
  counters.compile_us += compile_us;
  if (error == nullptr && args->executable != nullptr && !cfg_.read_only &&
      compile_us < cfg_.min_compile_us) {
    ++counters.skipped_fast;
  } else if (error == nullptr && args->executable != nullptr &&
             !cfg_.read_only) {
    try {
      Store(lookup.info, lookup.key, lookup.path, args->executable,
            lookup.record);
    } catch (...) {
      ++counters.write_failures;
    }
  }
  return error;
}

}  // namespace pjrt_wrap
}  // namespace xlakit
