# The CUDA backend (issue 6): three static libraries that exist only with
# -DMOEFLEX_CUDA=ON, so the CPU build neither compiles nor links any CUDA code.
#   moeflex_cuda_core  core/cuda/:  device arena, pinned host pool, streams/events, errors
#   moeflex_cuda_ops   ops/cuda/:   kernels and cuBLAS wrappers (bf16 / fp32)
#   moeflex_nccl       comm/nccl/:   the NCCL Communicator
# MOEFLEX_CUDA defaults to ON when nvcc is found (on the PATH, CUDACXX, or
# /usr/local/cuda/bin). Code is built for sm_90 (H100/H200) plus compute_90 PTX,
# which newer GPUs compile at load time.
include(CheckLanguage)
if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
  find_program(MOEFLEX_NVCC nvcc PATHS /usr/local/cuda/bin)
  if(MOEFLEX_NVCC)
    set(CMAKE_CUDA_COMPILER ${MOEFLEX_NVCC})
  endif()
endif()
check_language(CUDA)
set(moeflex_cuda_default OFF)
if(CMAKE_CUDA_COMPILER)
  set(moeflex_cuda_default ON)
endif()
option(MOEFLEX_CUDA "Build the CUDA backend (nvcc, cuBLAS, NCCL)" ${moeflex_cuda_default})

# What the backend tests (tests/test_backend_*.cpp, tests/test_cuda_*.cpp) link:
# only the layers they test, not the training engine.
set(MOEFLEX_BACKEND_TEST_LIBS moeflex_ops moeflex_comm)

if(NOT MOEFLEX_CUDA)
  message(STATUS "moeflex: CUDA backend off (no nvcc found, or -DMOEFLEX_CUDA=OFF)")
  return()
endif()
if(NOT CMAKE_CUDA_COMPILER)
  message(FATAL_ERROR "MOEFLEX_CUDA=ON but no CUDA compiler was found: put nvcc on the PATH, "
                      "set CUDACXX, or configure with -DMOEFLEX_CUDA=OFF")
endif()

if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES "90-real;90-virtual")
endif()
enable_language(CUDA)
# CMake 3.25 predates nvcc's C++20 support (12.0+): tell it the flag, as newer CMake
# releases do, so the C++20 of the project applies to .cu files too.
if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION AND CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 12.0)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
endif()
set(CMAKE_CUDA_STANDARD 20)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
find_package(CUDAToolkit REQUIRED)
find_library(MOEFLEX_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_LIBRARY_ROOT}/lib64)
find_path(MOEFLEX_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
if(NOT MOEFLEX_NCCL_LIBRARY OR NOT MOEFLEX_NCCL_INCLUDE_DIR)
  message(FATAL_ERROR "MOEFLEX_CUDA=ON needs NCCL (libnccl.so and nccl.h) beside the CUDA toolkit "
                      "(${CUDAToolkit_LIBRARY_DIR}); found '${MOEFLEX_NCCL_LIBRARY}' and '${MOEFLEX_NCCL_INCLUDE_DIR}'")
endif()
message(STATUS "moeflex: CUDA backend on (nvcc ${CMAKE_CUDA_COMPILER_VERSION}, archs ${CMAKE_CUDA_ARCHITECTURES}, "
               "NCCL ${MOEFLEX_NCCL_LIBRARY})")

# Host warnings for the .cu files' host code (nvcc itself does not take -Wall);
# .cu files hold kernels and their launchers only (no fmt: nvcc's front end rejects
# its consteval format strings), host logic is in .cpp files built by the C++ compiler.
# -lineinfo maps SASS to source lines for profilers at no run-time cost.
set(moeflex_cuda_flags "$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Wno-unused-parameter>"
                       "$<$<COMPILE_LANGUAGE:CUDA>:-lineinfo>")

file(GLOB moeflex_cuda_core_srcs CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/src/moeflex/core/cuda/*.cpp
     ${CMAKE_SOURCE_DIR}/src/moeflex/core/cuda/*.cu)
add_library(moeflex_cuda_core STATIC ${moeflex_cuda_core_srcs})
target_include_directories(moeflex_cuda_core PUBLIC ${CMAKE_SOURCE_DIR}/src)
target_link_libraries(moeflex_cuda_core PUBLIC moeflex_core CUDA::cudart)
target_compile_options(moeflex_cuda_core PRIVATE ${moeflex_cuda_flags})

file(GLOB moeflex_cuda_ops_srcs CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/src/moeflex/ops/cuda/*.cpp
     ${CMAKE_SOURCE_DIR}/src/moeflex/ops/cuda/*.cu)
add_library(moeflex_cuda_ops STATIC ${moeflex_cuda_ops_srcs})
target_link_libraries(moeflex_cuda_ops PUBLIC moeflex_cuda_core moeflex_ops CUDA::cublas CUDA::cublasLt)
target_compile_options(moeflex_cuda_ops PRIVATE ${moeflex_cuda_flags})

file(GLOB moeflex_nccl_srcs CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/src/moeflex/comm/nccl/*.cpp
     ${CMAKE_SOURCE_DIR}/src/moeflex/comm/nccl/*.cu)
add_library(moeflex_nccl STATIC ${moeflex_nccl_srcs})
target_include_directories(moeflex_nccl PUBLIC ${MOEFLEX_NCCL_INCLUDE_DIR})
target_link_libraries(moeflex_nccl PUBLIC moeflex_cuda_core moeflex_comm ${MOEFLEX_NCCL_LIBRARY})
target_compile_options(moeflex_nccl PRIVATE ${moeflex_cuda_flags})

list(APPEND MOEFLEX_BACKEND_TEST_LIBS moeflex_cuda_ops moeflex_nccl)

# The training engine on the GPU (`moeflex train --device cuda`): the trainer creates
# the CUDA backend (ops/cuda/backend.h); the model reaches it through ops::Backend.
target_link_libraries(moeflex_train PUBLIC moeflex_cuda_ops)
target_compile_definitions(moeflex_train PUBLIC MOEFLEX_HAVE_CUDA=1)
