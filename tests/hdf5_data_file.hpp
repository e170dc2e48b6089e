// A data file as --data hdf5:PATH reads it (docs/data.md), for the tests: /inputs as
// float32 and /labels as int32, each of the dimensions given.
#pragma once
#include <hdf5.h>

#include <cstdint>
#include <string>
#include <vector>

namespace mpipe::testing {

inline void write_data_file(const std::string& path, const std::vector<hsize_t>& dims, const std::vector<float>& inputs,
                            const std::vector<hsize_t>& label_dims, const std::vector<std::int32_t>& labels) {
  const hid_t file = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
  const hid_t space = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
  const hid_t label_space = H5Screate_simple(static_cast<int>(label_dims.size()), label_dims.data(), nullptr);
  const hid_t in = H5Dcreate2(file, "inputs", H5T_NATIVE_FLOAT, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  H5Dwrite(in, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, inputs.data());
  const hid_t ls = H5Dcreate2(file, "labels", H5T_NATIVE_INT32, label_space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  H5Dwrite(ls, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, labels.data());
  for (hid_t id : {space, label_space}) H5Sclose(id);
  H5Dclose(in);
  H5Dclose(ls);
  H5Fclose(file);
}

}  // namespace mpipe::testing
