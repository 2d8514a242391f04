// qwenmetal._core: the compiled part of qwenmetal. Each family registers itself (registry.h).
#include "bindings/registry.h"

NB_MODULE(_core, m) {
    m.doc() = "qwenmetal compiled core";
    qwenmetal::bindings::register_quant(m);
    qwenmetal::bindings::register_msl_sim(m);
    qwenmetal::bindings::register_cpu_engine(m);
    qwenmetal::bindings::register_dflash(m);
    qwenmetal::bindings::register_vision(m);
    qwenmetal::bindings::register_bench(m);
    qwenmetal::bindings::register_expert_cache(m);
    qwenmetal::bindings::register_gpu(m);
}
