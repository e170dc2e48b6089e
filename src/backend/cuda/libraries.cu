// Loading cuBLAS, cuBLASLt and cuDNN at the first use of the GPU: see libraries.cuh.
#include <dlfcn.h>

#include <mutex>
#include <string>

#include "libraries.cuh"
#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/core/error.hpp"

#define MPIPE_STRINGIFY_EXPANDED(x) MPIPE_STRINGIFY(x)
#define MPIPE_STRINGIFY(x) #x

namespace mpipe::cuda {

namespace {

// By soname (the major version these headers declare) through the usual search
// (LD_LIBRARY_PATH, the executable's run path, ldconfig), then in the directory the
// build found it in.
void* open_library(const std::string& soname, const char* build_directory) {
  if (void* handle = ::dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL)) return handle;
  const std::string first_error = ::dlerror();
  const std::string at_build = std::string(build_directory) + "/" + soname;
  if (void* handle = ::dlopen(at_build.c_str(), RTLD_NOW | RTLD_LOCAL)) return handle;
  throw Error(cat("cannot load ", soname, " for the CUDA backend (", first_error,
                  "); hint: install it, or add its directory to LD_LIBRARY_PATH"));
}

template <class F>
void find(F& function, void* handle, const char* name, const std::string& soname) {
  function = reinterpret_cast<F>(::dlsym(handle, name));
  if (!function) throw Error(cat(soname, " has no function ", name, ": a different version from the one mpipe was built with"));
}

Libraries load() {
  Libraries l;
  const std::string cublas = cat("libcublas.so.", CUBLAS_VER_MAJOR), cublas_lt = cat("libcublasLt.so.", CUBLAS_VER_MAJOR),
                    cudnn = cat("libcudnn.so.", CUDNN_MAJOR);
  // Each list's functions, looked up in its library.
#define MPIPE_FIND(name) find(l.name, handle, MPIPE_STRINGIFY_EXPANDED(name), soname);
  {
    void* const handle = open_library(cublas_lt, MPIPE_CUBLAS_DIRECTORY);
    const std::string& soname = cublas_lt;
    MPIPE_CUBLASLT_FUNCTIONS(MPIPE_FIND)
  }
  {
    void* const handle = open_library(cublas, MPIPE_CUBLAS_DIRECTORY);
    const std::string& soname = cublas;
    MPIPE_CUBLAS_FUNCTIONS(MPIPE_FIND)
  }
  {
    void* const handle = open_library(cudnn, MPIPE_CUDNN_DIRECTORY);
    const std::string& soname = cudnn;
    MPIPE_CUDNN_FUNCTIONS(MPIPE_FIND)
  }
#undef MPIPE_FIND
  return l;  // the libraries stay open for the life of the process
}

}  // namespace

const Libraries& lib() {
  static const Libraries libraries = load();  // a failed load throws, and the next call tries again
  return libraries;
}

void load_libraries() { lib(); }

}  // namespace mpipe::cuda
