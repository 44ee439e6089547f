// Daemon wires the parts of tsd together and runs them: it takes the instance lock, prepares
// the socket directory, starts the gRPC control plane and the side socket, then waits for a
// signal. On SIGTERM or SIGINT it stops accepting, tells attached clients, releases every region
// and returns 0.
#pragma once

#include "daemon/ops/config.h"

namespace tsd {

// Runs the daemon until SIGTERM/SIGINT; returns the process exit code.
int RunDaemon(const Config& config);

}  // namespace tsd
