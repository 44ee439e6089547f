// The daemon's version, from the CMake project version.
#pragma once

namespace tsd {
extern const char* const kVersion;
}  // namespace tsd
