// How a long computation (a multi-chunk CPU prefill, a token-by-token GPU prefill, a GPU decode loop)
// can be abandoned part-way. The engines call an InterruptPoll between chunks / tokens / steps, never
// inside one; the poll throws to abandon the call, and the engine then restores the state of the
// call's start before rethrowing, so an abandoned call changes nothing. The Python bindings pass a
// poll that runs the interpreter's signal handlers (src/bindings/forward_call.h): a Ctrl-C raises
// KeyboardInterrupt there. nullptr: no poll (the call runs to the end).
#pragma once

namespace qwenmetal {

using InterruptPoll = void (*)();

}  // namespace qwenmetal
