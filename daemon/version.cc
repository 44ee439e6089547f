#include "daemon/version.h"

namespace tsd {
const char* const kVersion = TSD_VERSION;
}  // namespace tsd
