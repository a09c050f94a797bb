// Sharded-data assembly plan; see shard_layout.h.
#include "torch_xla/csrc/runtime/xlakit/shard_layout.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace torch_xla {
namespace runtime {
namespace xlakit {
namespace {

int64_t Product(absl::Span<const int64_t> dims) {
  return std::accumulate(dims.begin(), dims.end(), int64_t{1},
                         std::multiplies<int64_t>());
}

std::string Dims(absl::Span<const int64_t> dims) {
  return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
}

std::string Range(const std::vector<int64_t>& start,
                  const std::vector<int64_t>& extent) {
  std::vector<std::string> parts;
  for (size_t j = 0; j < start.size(); ++j) {
    parts.push_back(absl::StrCat(start[j], ":", start[j] + extent[j]));
  }
  return absl::StrCat("[", absl::StrJoin(parts, ", "), "]");
}

// Row-major coordinates of `index` in `dims`.
std::vector<int64_t> Coordinates(int64_t index,
                                 absl::Span<const int64_t> dims) {
  std::vector<int64_t> out(dims.size());
  for (size_t j = dims.size(); j-- > 0;) {
    out[j] = index % dims[j];
    index /= dims[j];
  }
  return out;
}

absl::StatusOr<std::vector<ShardRegion>> PlanReplicated(
    absl::Span<const int64_t> tensor_dims,
    absl::Span<const LocalShard> shards) {
  for (size_t s = 0; s < shards.size(); ++s) {
    if (absl::Span<const int64_t>(shards[s].dims) == tensor_dims) {
      std::vector<int64_t> start(tensor_dims.size(), 0);
      return std::vector<ShardRegion>{
          {s, start,
           std::vector<int64_t>(tensor_dims.begin(), tensor_dims.end())}};
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "replicated data of shape ", Dims(tensor_dims), " has ", shards.size(),
      " local shard(s) and none of that shape",
      shards.empty() ? ""
                     : absl::StrCat(" (first: ", Dims(shards[0].dims), ")")));
}

// How many tile dimensions after the tensor's own are replica dimensions, or
// an error when the sharding's tile rank does not fit the tensor.
absl::StatusOr<size_t> ReplicaDims(const xla::OpSharding& sharding,
                                   size_t rank) {
  size_t tile_rank = sharding.tile_assignment_dimensions_size();
  size_t extra = sharding.replicate_on_last_tile_dim()
                     ? 1
                     : static_cast<size_t>(sharding.last_tile_dims_size());
  if (tile_rank != rank + extra) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sharding has ", tile_rank, " tile dimensions, expected ", rank + extra,
        " for a tensor of rank ", rank,
        extra ? absl::StrCat(" plus ", extra, " replica dimension(s)") : ""));
  }
  for (int t : sharding.last_tile_dims()) {
    if (t != xla::OpSharding::REPLICATED) {
      return absl::UnimplementedError(absl::StrCat(
          "sharding has a ", xla::OpSharding::Type_Name(t),
          " subgroup (last_tile_dims); only REPLICATED subgroups are "
          "supported"));
    }
  }
  return extra;
}

// More tiles than any device mesh has: a corrupt sharding, refused before a
// vector of that size is made.
constexpr int64_t kMaxTiles = int64_t{1} << 24;

// INVALID_ARGUMENT naming `what` unless every dimension is positive and their
// product at most kMaxTiles: a zero or negative one would size a vector with a
// negative count (length_error) or divide by zero, a huge one overflow.
absl::Status CheckTileDims(absl::Span<const int64_t> dims, const char* what) {
  int64_t product = 1;
  for (int64_t d : dims) {
    if (d <= 0 || d > kMaxTiles || product > kMaxTiles / d) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " ", Dims(dims), ": expected positive dimensions whose product "
          "is at most ", kMaxTiles));
    }
    product *= d;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<int64_t>> TileAssignmentDevices(
    const xla::OpSharding& sharding) {
  const auto& tiles = sharding.tile_assignment_dimensions();
  absl::Status fits = CheckTileDims(
      std::vector<int64_t>(tiles.begin(), tiles.end()), "tile assignment");
  if (!fits.ok()) return fits;
  int64_t count = Product(tiles);
  if (sharding.iota_reshape_dims().empty()) {
    if (sharding.tile_assignment_devices_size() != count) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sharding lists ", sharding.tile_assignment_devices_size(),
          " devices for ", count, " tiles ", Dims(tiles)));
    }
    return std::vector<int64_t>(sharding.tile_assignment_devices().begin(),
                                sharding.tile_assignment_devices().end());
  }
  // Iota form: iota(prod(reshape)).reshape(reshape).transpose(perm), flat.
  std::vector<int64_t> reshape(sharding.iota_reshape_dims().begin(),
                               sharding.iota_reshape_dims().end());
  fits = CheckTileDims(reshape, "iota tile assignment reshape");
  if (!fits.ok()) return fits;
  std::vector<int> perm(sharding.iota_transpose_perm().begin(),
                        sharding.iota_transpose_perm().end());
  if (perm.empty()) {
    perm.resize(reshape.size());
    std::iota(perm.begin(), perm.end(), 0);
  }
  std::vector<int> sorted = perm;
  std::sort(sorted.begin(), sorted.end());
  bool is_permutation = sorted.size() == reshape.size();
  for (size_t i = 0; is_permutation && i < sorted.size(); ++i) {
    is_permutation = sorted[i] == static_cast<int>(i);
  }
  if (!is_permutation || Product(reshape) != count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "iota tile assignment reshape ", Dims(reshape), " transpose [",
        absl::StrJoin(perm, ", "), "] does not describe ", count, " tiles"));
  }
  std::vector<int64_t> transposed(reshape.size());
  for (size_t i = 0; i < perm.size(); ++i) transposed[i] = reshape[perm[i]];
  std::vector<int64_t> out(count);
  for (int64_t k = 0; k < count; ++k) {
    std::vector<int64_t> at = Coordinates(k, transposed);
    std::vector<int64_t> source(reshape.size());
    for (size_t i = 0; i < perm.size(); ++i) source[perm[i]] = at[i];
    int64_t linear = 0;
    for (size_t i = 0; i < reshape.size(); ++i) {
      linear = linear * reshape[i] + source[i];
    }
    out[k] = linear;
  }
  return out;
}

absl::StatusOr<std::vector<ShardRegion>> PlanShardAssembly(
    const xla::OpSharding& sharding, absl::Span<const int64_t> tensor_dims,
    absl::Span<const LocalShard> shards) {
  if (sharding.type() == xla::OpSharding::REPLICATED ||
      sharding.type() == xla::OpSharding::UNKNOWN) {
    return PlanReplicated(tensor_dims, shards);
  }
  if (sharding.type() != xla::OpSharding::OTHER) {
    return absl::UnimplementedError(absl::StrCat(
        "sharding type ", xla::OpSharding::Type_Name(sharding.type()),
        " is not supported; only REPLICATED, UNKNOWN and OTHER (tiled)"));
  }
  const size_t rank = tensor_dims.size();
  for (int64_t d : tensor_dims) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor of shape ", Dims(tensor_dims),
                       " has a negative dimension"));
    }
  }
  absl::StatusOr<size_t> replica_dims = ReplicaDims(sharding, rank);
  if (!replica_dims.ok()) return replica_dims.status();
  absl::StatusOr<std::vector<int64_t>> devices =
      TileAssignmentDevices(sharding);
  if (!devices.ok()) return devices.status();
  std::vector<int64_t> tiles(sharding.tile_assignment_dimensions().begin(),
                             sharding.tile_assignment_dimensions().end());
  absl::Span<const int64_t> data_tiles(tiles.data(), rank);
  if (shards.empty()) {
    return absl::InvalidArgumentError("sharded data has no local shard");
  }
  // XLA pads every shard to one shape; offsets come from the buffers' own
  // dimensions, never from a sharding spec that may describe other data.
  const std::vector<int64_t>& shard_dims = shards[0].dims;
  for (const LocalShard& shard : shards) {
    if (shard.dims != shard_dims) {
      return absl::InvalidArgumentError(
          absl::StrCat("local shards differ in shape: ", Dims(shard_dims),
                       " and ", Dims(shard.dims)));
    }
  }
  if (shard_dims.size() != rank) {
    return absl::InvalidArgumentError(
        absl::StrCat("shards of shape ", Dims(shard_dims),
                     " for a tensor of shape ", Dims(tensor_dims)));
  }
  for (int64_t d : shard_dims) {
    if (d < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shards of shape ", Dims(shard_dims), " have a negative dimension"));
    }
  }
  for (size_t j = 0; j < rank; ++j) {
    if (shard_dims[j] * data_tiles[j] < tensor_dims[j]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shards of shape ", Dims(shard_dims), " in ", Dims(data_tiles),
          " tiles do not cover a tensor of shape ", Dims(tensor_dims)));
    }
  }

  std::map<int64_t, size_t> local;  // device ordinal -> shard index
  for (size_t s = 0; s < shards.size(); ++s) {
    local.emplace(shards[s].device_ordinal, s);
  }
  const int64_t tile_count = Product(data_tiles);
  const int64_t replicas =
      Product(absl::Span<const int64_t>(tiles.data() + rank, *replica_dims));
  // best[tile] = (replica, shard) of the lowest local replica.
  std::vector<std::pair<int64_t, size_t>> best(tile_count, {replicas, 0});
  std::vector<std::vector<int64_t>> holders(tile_count);
  size_t matched = 0;
  for (size_t i = 0; i < devices->size(); ++i) {
    int64_t tile = static_cast<int64_t>(i) / replicas;
    int64_t replica = static_cast<int64_t>(i) % replicas;
    int64_t device = (*devices)[i];
    holders[tile].push_back(device);
    auto it = local.find(device);
    if (it == local.end()) continue;
    ++matched;
    if (replica < best[tile].first) best[tile] = {replica, it->second};
  }
  if (matched != shards.size()) {
    std::vector<int64_t> assigned(devices->begin(), devices->end());
    std::sort(assigned.begin(), assigned.end());
    for (const LocalShard& shard : shards) {
      if (!std::binary_search(assigned.begin(), assigned.end(),
                              shard.device_ordinal)) {
        return absl::InvalidArgumentError(
            absl::StrCat("local shard on device ", shard.device_ordinal,
                         " is not in the sharding's tile assignment [",
                         absl::StrJoin(*devices, ", "), "]"));
      }
    }
    return absl::InvalidArgumentError(
        "a device appears more than once among the local shards");
  }

  std::vector<ShardRegion> regions;
  std::vector<std::string> missing;
  for (int64_t tile = 0; tile < tile_count; ++tile) {
    std::vector<int64_t> at = Coordinates(tile, data_tiles);
    ShardRegion region;
    bool empty = false;
    for (size_t j = 0; j < rank; ++j) {
      int64_t begin = std::min(at[j] * shard_dims[j], tensor_dims[j]);
      int64_t end = std::min((at[j] + 1) * shard_dims[j], tensor_dims[j]);
      region.start.push_back(begin);
      region.extent.push_back(end - begin);
      empty = empty || end == begin;
    }
    if (empty) continue;  // all padding: nothing of the tensor lives there
    if (best[tile].first == replicas) {
      missing.push_back(
          absl::StrCat("elements ", Range(region.start, region.extent),
                       " (devices ", absl::StrJoin(holders[tile], ", "), ")"));
      continue;
    }
    region.shard = best[tile].second;
    regions.push_back(std::move(region));
  }
  if (!missing.empty()) {
    size_t shown = std::min<size_t>(missing.size(), 4);
    return absl::FailedPreconditionError(absl::StrCat(
        missing.size(), " of ", tile_count, " tiles are on no local device: ",
        absl::StrJoin(missing.begin(), missing.begin() + shown, "; "),
        missing.size() > shown ? "; ..." : "",
        ". This host holds only its own shards (a multi-host job); save "
        "sharded state with xlakit.dcp_save"));
  }
  return regions;
}

}  // namespace xlakit
}  // namespace runtime
}  // namespace torch_xla
