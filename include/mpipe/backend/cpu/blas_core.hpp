// Which kernels OpenBLAS runs. A DYNAMIC_ARCH OpenBLAS picks its kernels from the CPU's
// model number when it loads; a model newer than the library (Debian 12's 0.3.21 on
// Sapphire or Emerald Rapids) falls back to Prescott's SSE3 kernels: every GEMM then
// runs at about 0.4x the AVX-512 kernels' speed (measured on an Emerald Rapids VM).
#pragma once
#include <string>
#include <string_view>

namespace mpipe::cpu {

// Call first in main, before MPI and before any work. Where OPENBLAS_CORETYPE is unset
// and the library chose kernels without AVX2 on a CPU (and OS) with AVX2 and FMA, sets
// OPENBLAS_CORETYPE to the best the CPU runs (SkylakeX with AVX-512 F/BW/DQ/VL, else
// Haswell) and re-executes the program, which OpenBLAS then reads when it loads again.
// MPIPE_BLAS_CORE=keep leaves the library's choice. Returns where nothing was changed.
void choose_blas_core(char** argv);

// Whether OpenBLAS's core of this name runs AVX2/FMA or AVX-512 single-precision kernels.
bool vector_core(std::string_view core);
// The core OpenBLAS runs now.
std::string blas_core();

// "OpenBLAS 0.3.21, SkylakeX kernels", with "(chosen by mpipe: the library took this CPU
// for Prescott)" where choose_blas_core changed them.
std::string blas_description();

}  // namespace mpipe::cpu
