# The build that pip runs (scikit-build-core, SKBUILD set): a thin project around the real one.
#
# pip builds in an isolated environment, a new temporary directory each time, so scikit-build-core
# finds its own path changed at every `pip install` and clears the CMake cache and CMakeFiles/ of the
# persistent build directory (build/{wheel_tag}, pyproject.toml) -- the object files with it: every
# extra installed afterwards (`pip install ".[server]"`) recompiled everything. And nanobind, a build
# requirement, lives in that temporary environment: its sources and headers are compiled by path, so a
# build against a new copy recompiles everything that includes them.
#
# So the real project (this CMakeLists.txt with QWENMETAL_INNER=ON) is configured and built in
# build/{wheel_tag}/inner, which scikit-build-core does not clear, against a copy of nanobind at a fixed
# path, build/{wheel_tag}/nanobind (copied file by file, only what changed). tools/pip_build.py does both
# and runs the build, showing its progress on the terminal (pip shows a build's output only with -v).
# A second install from the same tree rebuilds nothing; the module is installed from the inner tree.

# nanobind's CMake package in the isolated environment: scikit-build-core puts its site-packages on
# CMAKE_PREFIX_PATH. (Not find_package: nanobind's config runs compiler checks, and this project
# enables no language.)
if(nanobind_DIR)
    set(QM_NB_CMAKE_DIR ${nanobind_DIR})
else()
    find_file(QM_NB_CONFIG nanobind-config.cmake PATHS ${CMAKE_PREFIX_PATH} PATH_SUFFIXES nanobind/cmake
              NO_DEFAULT_PATH NO_CACHE)
    if(NOT QM_NB_CONFIG)
        message(FATAL_ERROR "nanobind not found on CMAKE_PREFIX_PATH (${CMAKE_PREFIX_PATH})")
    endif()
    get_filename_component(QM_NB_CMAKE_DIR ${QM_NB_CONFIG} DIRECTORY)
endif()
get_filename_component(QM_NB_ROOT ${QM_NB_CMAKE_DIR} DIRECTORY)

set(QM_INNER_DIR ${CMAKE_BINARY_DIR}/inner)
set(QM_NB_COPY ${CMAKE_BINARY_DIR}/nanobind)

# The settings the inner build gets: every cache entry given to this one (scikit-build-core's
# Python_*, SKBUILD_*, CMAKE_BUILD_TYPE, the cmake.define entries of pyproject.toml, CMAKE_ARGS, the
# macOS architecture and deployment target), except those that name temporary directories.
get_cmake_property(qm_vars CACHE_VARIABLES)
list(SORT qm_vars)
set(qm_init "# written by cmake/pip_build.cmake: the inner build's settings\n")
foreach(v IN LISTS qm_vars)
    get_property(t CACHE ${v} PROPERTY TYPE)
    if(t STREQUAL "INTERNAL" OR t STREQUAL "STATIC")
        continue()
    endif()
    if(v MATCHES "^(SKBUILD_(PLATLIB|DATA|HEADERS|SCRIPTS|NULL|METADATA)_DIR|CMAKE_INSTALL_PREFIX|CMAKE_PREFIX_PATH|CMAKE_FIND_ROOT_PATH_MODE_PACKAGE|nanobind_DIR|QM_.*|FETCHCONTENT_.*)$")
        continue()
    endif()
    if(t STREQUAL "UNINITIALIZED")
        set(t STRING)
    endif()
    string(APPEND qm_init "set(${v} [==[${${v}}]==] CACHE ${t} \"\" FORCE)\n")
endforeach()
string(APPEND qm_init "set(QWENMETAL_INNER ON CACHE BOOL \"\" FORCE)\n")
string(APPEND qm_init "set(nanobind_DIR [==[${QM_NB_COPY}/cmake]==] CACHE PATH \"\" FORCE)\n")
file(WRITE ${CMAKE_BINARY_DIR}/inner-init.cmake "${qm_init}")

if(NOT CMAKE_GENERATOR MATCHES "Ninja|Makefiles")
    message(FATAL_ERROR "qwenmetal builds with Ninja or Makefiles, not ${CMAKE_GENERATOR}")
endif()
add_custom_target(qwenmetal_inner ALL
    COMMAND ${Python_EXECUTABLE} ${CMAKE_SOURCE_DIR}/tools/pip_build.py
            --source ${CMAKE_SOURCE_DIR} --build ${QM_INNER_DIR} --init ${CMAKE_BINARY_DIR}/inner-init.cmake
            --generator ${CMAKE_GENERATOR} --cmake ${CMAKE_COMMAND}
            --nanobind ${QM_NB_ROOT} --nanobind-copy ${QM_NB_COPY}
    USES_TERMINAL VERBATIM)

# install: the inner tree's install rules (the module, the simulator's headers and kernel sources)
install(CODE "
    set(qm_args --install [==[${QM_INNER_DIR}]==] --prefix \"\${CMAKE_INSTALL_PREFIX}\")
    if(CMAKE_INSTALL_DO_STRIP)
        list(APPEND qm_args --strip)
    endif()
    execute_process(COMMAND [==[${CMAKE_COMMAND}]==] \${qm_args} RESULT_VARIABLE qm_rc)
    if(NOT qm_rc EQUAL 0)
        message(FATAL_ERROR \"installing the inner build failed\")
    endif()
")
