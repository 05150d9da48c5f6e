// The in-process transport: N ranks that are threads of one process, each
// with its own communicator, exchanging through a shared group object.
#pragma once

#include <memory>
#include <vector>

#include "ring/transport.hpp"

namespace attn::ring {

// Creates the n transports of a new group (rank i at index i). timeout_ms
// bounds every wait of an exchange (0: no bound); when it expires the group
// is aborted.
std::vector<std::shared_ptr<Transport>> make_inprocess_group(int32_t n, int64_t timeout_ms);

}  // namespace attn::ring
