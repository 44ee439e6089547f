#include "daemon/ops/version.h"

namespace tsd {
const char* const kVersion = TSD_VERSION;
}  // namespace tsd
