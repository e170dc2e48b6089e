// The tokenizer in a checkpoint: /tokenizer/file, a uint8 dataset with name, kind, crc32.
#include "mpipe/io/checkpoint_tokenizer.hpp"

#include "mpipe/core/toml_text.hpp"
#include "mpipe/io/checkpoint_format.hpp"

namespace mpipe {

std::uint32_t TokenizerFile::crc32() const { return crc32_of(bytes.data(), bytes.size()); }

void write_checkpoint_tokenizer(hid_t file, const TokenizerFile& tokenizer, bool write_data) {
  Handle lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  H5Pset_create_intermediate_group(lcpl.get(), 1);
  const hsize_t size = tokenizer.bytes.size();
  Handle space(size ? H5Screate_simple(1, &size, nullptr) : H5Screate(H5S_NULL), H5Sclose);
  Handle set(H5Dcreate2(file, checkpoint_tokenizer_path, H5T_STD_U8LE, space.get(), lcpl.get(), H5P_DEFAULT, H5P_DEFAULT),
             H5Dclose);
  H5_CHECK(set.get(), "cannot create ", checkpoint_tokenizer_path);
  write_string_attribute(set.get(), "name", tokenizer.name);
  write_string_attribute(set.get(), "kind", tokenizer.kind);
  write_scalar_attribute<std::uint32_t>(set.get(), "crc32", H5T_STD_U32LE, tokenizer.crc32());
  if (write_data && size)
    H5_CHECK(H5Dwrite(set.get(), H5T_NATIVE_UCHAR, H5S_ALL, H5S_ALL, H5P_DEFAULT, tokenizer.bytes.data()), "cannot write ",
             checkpoint_tokenizer_path, " (disk full?)");
}

bool has_checkpoint_tokenizer(hid_t file) { return H5Lexists(file, "/tokenizer", H5P_DEFAULT) > 0; }

std::optional<TokenizerFile> read_checkpoint_tokenizer(hid_t file, std::string* problem) {
  const std::string path = checkpoint_tokenizer_path;
  auto fail = [&](const std::string& why) -> std::optional<TokenizerFile> {
    *problem = cat("the tokenizer ", path, " ", why);
    return std::nullopt;
  };
  problem->clear();
  if (!has_checkpoint_tokenizer(file)) return std::nullopt;
  for (const char* link : {"/tokenizer", checkpoint_tokenizer_path}) {
    H5L_info_t info{};
    if (H5Lexists(file, link, H5P_DEFAULT) <= 0 || H5Lget_info(file, link, &info, H5P_DEFAULT) < 0)
      return fail("is missing");
    if (info.type != H5L_TYPE_HARD) return fail(cat("is reached through a link (", link, "), not data of its own"));
  }
  H5O_info_t object{};
  if (H5Oget_info_by_name2(file, path.c_str(), &object, H5O_INFO_BASIC, H5P_DEFAULT) < 0 || object.type != H5O_TYPE_DATASET)
    return fail("is not a dataset");
  Handle set(H5Dopen2(file, path.c_str(), H5P_DEFAULT), H5Dclose);
  if (!set.ok()) return fail("cannot be opened");
  Handle type(H5Dget_type(set.get()), H5Tclose);
  if (!type.ok() || H5Tget_class(type.get()) != H5T_INTEGER || H5Tget_size(type.get()) != 1)
    return fail("is not bytes (uint8)");
  Handle space(H5Dget_space(set.get()), H5Sclose);
  TokenizerFile out;
  const H5S_class_t space_class = space.ok() ? H5Sget_simple_extent_type(space.get()) : H5S_NO_CLASS;
  if (space_class == H5S_SIMPLE) {
    if (H5Sget_simple_extent_ndims(space.get()) != 1) return fail("is not one row of bytes");
    hsize_t size = 0;
    H5Sget_simple_extent_dims(space.get(), &size, nullptr);
    hsize_t file_bytes = 0;
    const haddr_t offset = H5Dget_offset(set.get());
    // Stored whole within the file before anything is allocated by the size it claims.
    if (H5Fget_filesize(file, &file_bytes) < 0 || offset == HADDR_UNDEF || H5Dget_storage_size(set.get()) != size ||
        offset + size > file_bytes)
      return fail("has no data stored, or its data lies beyond the end of the file (truncated?)");
    out.bytes.resize(size);
    if (H5Dread(set.get(), H5T_NATIVE_UCHAR, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.bytes.data()) < 0)
      return fail("cannot be read (truncated file?)");
  } else if (space_class != H5S_NULL) {
    return fail("has no dataspace");
  }
  const auto stored = read_scalar_attribute<std::uint32_t>(set.get(), "crc32", H5T_NATIVE_UINT32);
  if (!stored) return fail("has no checksum");
  if (*stored != out.crc32()) return fail("fails its checksum (altered or damaged)");
  out.name = read_string_attribute(set.get(), "name").value_or("");
  out.kind = read_string_attribute(set.get(), "kind").value_or("");
  if (out.name.empty()) return fail("has no name");
  if (out.kind != "sentencepiece" && out.kind != "bpe") return fail(cat("is of an unknown kind '", printable_line(out.kind), "'"));
  return out;
}

}  // namespace mpipe
