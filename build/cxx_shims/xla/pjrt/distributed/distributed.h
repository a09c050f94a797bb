// xlakit cxx-check shim, declarations only: stands in for openxla's
// xla/pjrt/distributed/distributed.h, which the TensorFlow wheels do not
// ship. It declares what the checked torch_xla files use; never linked.
#ifndef XLAKIT_SHIM_XLA_PJRT_DISTRIBUTED_DISTRIBUTED_H_
#define XLAKIT_SHIM_XLA_PJRT_DISTRIBUTED_DISTRIBUTED_H_

#include <memory>
#include <string>

#include "xla/pjrt/distributed/client.h"

namespace xla {

class DistributedRuntimeService;

std::shared_ptr<DistributedRuntimeClient> GetDistributedRuntimeClient(
    std::string address, const DistributedRuntimeClient::Options& options,
    bool use_compression = false);

}  // namespace xla

#endif  // XLAKIT_SHIM_XLA_PJRT_DISTRIBUTED_DISTRIBUTED_H_
