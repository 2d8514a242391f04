// msl_sim: what <metal_stdlib> resolves to off Apple platforms.
//   MSL_SIM_CHECK_AS : declarations for clang -fsyntax-only, with device / constant / threadgroup
//                      as distinct address spaces (tools/msl_check.py);
//   otherwise        : the simulator's kernel-side runtime (msl_sim/sim.h).
#pragma once
#if defined(MSL_SIM_CHECK_AS)
#include "msl_sim/check_as.h"
#else
#include "msl_sim/sim.h"
#endif
