// tests/reference/unet.toml as text, for the tests that write it where they run (the
// mpi and cuda binaries run on machines without the source tree): 19 layers, stashes
// "top" (layer 0, taken by the add at 16), "level1" (2, by the concat at 14) and
// "level2" (5, by the concat at 11), upsampling, BatchNorm in the encoder, a label per
// pixel. The reference test reads the file itself; unit test "the U-Net text of the
// mpi and cuda tests is tests/reference/unet.toml" checks they agree.
#pragma once

namespace mpipe::test {

inline constexpr const char* unet_text = R"(input = [2, 8, 8]

[[layer]]
kind = "conv2d"
out = 4
kernel = 3
padding = 1
stash = "top"
[[layer]]
kind = "batchnorm2d"
[[layer]]
kind = "relu"
stash = "level1"
[[layer]]
kind = "maxpool2d"
kernel = 2
[[layer]]
kind = "conv2d"
out = 6
kernel = 3
padding = 1
[[layer]]
kind = "relu"
stash = "level2"
[[layer]]
kind = "avgpool2d"
kernel = 2
[[layer]]
kind = "conv2d"
out = 8
kernel = 3
padding = 1
[[layer]]
kind = "relu"
[[layer]]
kind = "upsample2d"
[[layer]]
kind = "concat"
from = "level2"
[[layer]]
kind = "conv2d"
out = 4
kernel = 3
padding = 1
[[layer]]
kind = "upsample2d"
[[layer]]
kind = "concat"
from = "level1"
[[layer]]
kind = "conv2d"
out = 4
kernel = 1
[[layer]]
kind = "add"
from = "top"
[[layer]]
kind = "gelu"
[[layer]]
kind = "conv2d"
out = 3
kernel = 1
[[layer]]
kind = "cross_entropy"
)";

}  // namespace mpipe::test
