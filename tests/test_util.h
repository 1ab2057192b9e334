// Helpers shared by the test suites.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "tensor/error.h"

// Expects `stmt` to throw kiln::Error whose message contains `substr`.
#define EXPECT_KILN_ERROR(stmt, substr)                                                   \
  do {                                                                                    \
    try {                                                                                 \
      (void)(stmt);                                                                       \
      ADD_FAILURE() << "expected kiln::Error containing \"" << (substr) << "\" from " #stmt; \
    } catch (const ::kiln::Error& e) {                                                    \
      EXPECT_NE(std::string(e.what()).find(substr), std::string::npos)                    \
          << "message: " << e.what();                                                     \
    }                                                                                     \
  } while (0)
