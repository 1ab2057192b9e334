// Forwarding header: suites outside tests/tensor include the shared helper by this path.
#pragma once
#include "../test_util.h"
