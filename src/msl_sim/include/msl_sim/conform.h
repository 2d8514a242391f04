// msl_sim conform mode: MSL attributes as clang annotations, for tools/msl_conform.py.
// Included at the end of check_as.h when MSL_SIM_CONFORM is defined (clang++ -fsyntax-only -DMSL_SIM_CHECK_AS
// -DMSL_SIM_CONFORM -Xclang -ast-dump=json). Check mode drops [[buffer(0)]], [[thread_position_in_grid]], ...
// as unknown attributes; here each becomes [[clang::annotate("msl", "<name>", args...)]], so the JSON AST
// carries every attribute on the declaration it belongs to, with the parameter's real (instantiated) type.
// The annotation's first string is not in the JSON dump; the attribute name and its arguments are (the
// annotation's argument expressions).
//   * attributes with arguments: function-like macros (buffer(n) expands only where `buffer` is followed by
//     a parenthesis);
//   * attributes without arguments: object-like macros, so these names cannot be used as identifiers in
//     kernel sources checked in this mode (MSL reserves them as attribute names anyway; `position`, a
//     graphics attribute and a common variable name, is deliberately not among them);
//   * `kernel` and the host name of INSTANTIATE_KERNEL: GNU annotate attributes (C++ attributes cannot
//     appear where `kernel` stands, nor on an explicit instantiation);
//   * [[threadgroup(n)]] reaches clang as [[threadgroup_arg(n)]] (tools/mslpp.py: `threadgroup` is the
//     address-space macro).
// An attribute not defined here stays unknown to clang, which warns about it (-Wunknown-attributes); the
// checker reports that warning.
#pragma once

#undef kernel
#define kernel __attribute__((annotate("msl", "kernel")))
#undef INSTANTIATE_KERNEL
#define INSTANTIATE_KERNEL(name, func, ...)                                                                      \
    template __attribute__((annotate("msl", "host_name", name))) decltype(func<__VA_ARGS__>) func<__VA_ARGS__>;

// resource locations (5.2.1) and function attributes (5.1.3, 5.1.10)
#define buffer(n) clang::annotate("msl", "buffer", n)
#define threadgroup_arg(n) clang::annotate("msl", "threadgroup", n)
#define texture(n) clang::annotate("msl", "texture", n)
#define host_name(n) clang::annotate("msl", "host_name", n)
#define max_total_threads_per_threadgroup(n) clang::annotate("msl", "max_total_threads_per_threadgroup", n)
#define required_threads_per_threadgroup(n) clang::annotate("msl", "required_threads_per_threadgroup", n)

// kernel function input attributes (5.2.3.6, Table 5.8)
#define dispatch_quadgroups_per_threadgroup clang::annotate("msl", "dispatch_quadgroups_per_threadgroup")
#define dispatch_simdgroups_per_threadgroup clang::annotate("msl", "dispatch_simdgroups_per_threadgroup")
#define dispatch_threads_per_threadgroup clang::annotate("msl", "dispatch_threads_per_threadgroup")
#define grid_origin clang::annotate("msl", "grid_origin")
#define grid_size clang::annotate("msl", "grid_size")
#define quadgroup_index_in_threadgroup clang::annotate("msl", "quadgroup_index_in_threadgroup")
#define quadgroups_per_threadgroup clang::annotate("msl", "quadgroups_per_threadgroup")
#define simdgroup_index_in_threadgroup clang::annotate("msl", "simdgroup_index_in_threadgroup")
#define simdgroups_per_threadgroup clang::annotate("msl", "simdgroups_per_threadgroup")
#define thread_execution_width clang::annotate("msl", "thread_execution_width")
#define thread_index_in_quadgroup clang::annotate("msl", "thread_index_in_quadgroup")
#define thread_index_in_simdgroup clang::annotate("msl", "thread_index_in_simdgroup")
#define thread_index_in_threadgroup clang::annotate("msl", "thread_index_in_threadgroup")
#define thread_position_in_grid clang::annotate("msl", "thread_position_in_grid")
#define thread_position_in_threadgroup clang::annotate("msl", "thread_position_in_threadgroup")
#define threadgroup_position_in_grid clang::annotate("msl", "threadgroup_position_in_grid")
#define threadgroups_per_grid clang::annotate("msl", "threadgroups_per_grid")
#define threads_per_grid clang::annotate("msl", "threads_per_grid")
#define threads_per_simdgroup clang::annotate("msl", "threads_per_simdgroup")
#define threads_per_threadgroup clang::annotate("msl", "threads_per_threadgroup")
#define stage_in clang::annotate("msl", "stage_in")

// graphics-function attributes with distinctive names (5.2.3.1 - 5.2.3.5): known, so that the checker
// can say they do not belong on a kernel
#define vertex_id clang::annotate("msl", "vertex_id")
#define instance_id clang::annotate("msl", "instance_id")
#define base_vertex clang::annotate("msl", "base_vertex")
#define base_instance clang::annotate("msl", "base_instance")
#define amplification_id clang::annotate("msl", "amplification_id")
#define amplification_count clang::annotate("msl", "amplification_count")
#define front_facing clang::annotate("msl", "front_facing")
#define point_coord clang::annotate("msl", "point_coord")
#define sample_id clang::annotate("msl", "sample_id")
#define sample_mask clang::annotate("msl", "sample_mask")
#define render_target_array_index clang::annotate("msl", "render_target_array_index")
#define viewport_array_index clang::annotate("msl", "viewport_array_index")
#define barycentric_coord clang::annotate("msl", "barycentric_coord")
#define patch_id clang::annotate("msl", "patch_id")
