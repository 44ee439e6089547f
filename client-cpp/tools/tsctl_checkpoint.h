// `tsctl checkpoint JOB FILE`: has tsd write a job's optimizer state into FILE, atomically.
#pragma once

#include <string>

#include "tsd/client.h"

namespace tsd::tools {

// Opens a temporary file beside `file` as the caller, passes its descriptor to tsd (which writes
// `job`'s state with checksums into it and never opens a path itself), then fsyncs it, renames
// it over `file` and fsyncs the directory. On failure the temporary file is removed and `file`
// is left as it was. Prints what happened; returns the exit code.
int Checkpoint(Client& client, const std::string& job, const std::string& file);

}  // namespace tsd::tools
