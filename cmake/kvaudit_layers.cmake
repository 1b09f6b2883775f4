# One static library per pipeline layer, and include roots that let a layer reach only the layers
# it links.
#
# Sources include headers by their path from the repository root ("src/core/result.hpp",
# "kernels/ptx.cuh"). No target gets the repository root as an include directory. Instead each
# layer has an include root of its own in the build tree, ${CMAKE_BINARY_DIR}/include/<layer>,
# holding one symbolic link, <its folder> -> the source folder (include/format/src/format ->
# src/format). A layer publishes that root (PUBLIC include directory), so "src/format/x.hpp"
# resolves exactly in the targets that link kvaudit_format, directly or through a PUBLIC link of a
# layer whose headers include format's. Everywhere else the include is "No such file or directory"
# at compile time: tests/layering/ plants such includes and expects the build to fail.
#
# The direction of the pipeline is then the target graph: each folder's CMakeLists.txt names its
# sources and the layers it links, PUBLIC where its own headers include theirs, PRIVATE where only
# its sources do (so the include does not leak to the layers above).

# Makes ${CMAKE_BINARY_DIR}/include/<root_name>/<folder> a link to the source folder <folder>
# (relative to the repository root) and sets <out_var> to the include root.
function(kvaudit_include_root root_name folder out_var)
  set(root ${CMAKE_BINARY_DIR}/include/${root_name})
  set(link ${root}/${folder})
  get_filename_component(link_parent ${link} DIRECTORY)
  file(MAKE_DIRECTORY ${link_parent})
  if(NOT IS_SYMLINK ${link})
    file(CREATE_LINK ${CMAKE_SOURCE_DIR}/${folder} ${link} SYMBOLIC)
  endif()
  set(${out_var} ${root} PARENT_SCOPE)
endfunction()

# kvaudit_add_layer(<name> SOURCES <files> [CUDA_SOURCES <files>] [PUBLIC <targets>]
#                   [PRIVATE <targets>])
# Called from the layer's folder: a static library kvaudit_<name> of SOURCES (and, where CUDA is
# built, CUDA_SOURCES), relative to that folder, whose include root exposes the folder alone.
function(kvaudit_add_layer name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "" "SOURCES;CUDA_SOURCES;PUBLIC;PRIVATE")
  set(sources ${arg_SOURCES})
  if(KVAUDIT_CUDA)
    list(APPEND sources ${arg_CUDA_SOURCES})
  endif()
  file(RELATIVE_PATH folder ${CMAKE_SOURCE_DIR} ${CMAKE_CURRENT_SOURCE_DIR})
  kvaudit_include_root(${name} ${folder} include_root)

  set(target kvaudit_${name})
  add_library(${target} STATIC ${sources})
  target_include_directories(${target} PUBLIC ${include_root})
  target_link_libraries(${target} PUBLIC ${arg_PUBLIC} PRIVATE ${arg_PRIVATE})
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>)
  if(KVAUDIT_CUDA AND arg_CUDA_SOURCES)
    set_target_properties(${target} PROPERTIES CUDA_SEPARABLE_COMPILATION OFF
                                               CUDA_RUNTIME_LIBRARY Static)
    target_compile_options(${target} PRIVATE
        $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo>)
    target_link_libraries(${target} PUBLIC CUDA::cudart_static)
  endif()
endfunction()
