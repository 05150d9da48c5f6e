// The NCCL transport: one rank of a ring on an NCCL communicator the host
// application created (built only with CUDA and NCCL).
#pragma once

#include <memory>

#include "ring/transport.hpp"

namespace attn::ring {

// nccl_comm is an ncclComm_t, still owned by the caller, who must keep it
// alive while the transport (and ring plans made with it) live. Creates a
// communication stream and events on the communicator's device. Throws
// COMMUNICATION_ERROR (NCCL failures) or BACKEND_ERROR (CUDA failures).
std::shared_ptr<Transport> make_nccl_transport(void* nccl_comm);

}  // namespace attn::ring
