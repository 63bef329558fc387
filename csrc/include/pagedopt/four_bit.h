#pragma once
// The layout of 4-bit states, shared by the CPU and CUDA kernels and the argument checks.
//
// A moment of n elements takes ceil(n / 2) bytes: element i's code (an index into a 16-entry
// codebook) is in byte i / 2, the low nibble for an even i, the high nibble for an odd i (an odd n
// leaves the last byte's high nibble 0). One fp32 absmax per kStateBlockSize4 = 128 elements. A key
// holding `stack` moments stacks them: moment s at byte s * ceil(n / 2) and absmax s * ceil(n / 128).
// A block of 128 starts at an even element, so its codes are whole bytes of its own: blocks can be
// written in parallel.
#include <cstdint>

#include "pagedopt/common.h"

namespace pagedopt {

// The width of the states of one call: 32-bit floats, 8-bit codes or 4-bit codes.
enum class StateBits : int { k32 = 32, k8 = 8, k4 = 4 };

// Bytes of one moment of n elements in 4-bit codes.
PAGEDOPT_HOST_DEVICE int64_t packed_bytes(int64_t n) { return (n + 1) / 2; }

// Element i's 4-bit code in the packed bytes.
PAGEDOPT_HOST_DEVICE uint8_t nibble_at(const uint8_t* packed, int64_t i) {
  return static_cast<uint8_t>((packed[i >> 1] >> ((i & 1) * 4)) & 0xF);
}

// The byte of two codes: `even` (element 2k) low, `odd` (element 2k + 1) high.
PAGEDOPT_HOST_DEVICE uint8_t pack_nibbles(uint8_t even, uint8_t odd) {
  return static_cast<uint8_t>((even & 0xF) | ((odd & 0xF) << 4));
}

// Elements per absmax block of a width (32-bit states: the 8-bit blocks, as the kernels walk them).
PAGEDOPT_HOST_DEVICE constexpr int64_t state_block_size(StateBits bits) {
  return bits == StateBits::k4 ? kStateBlockSize4 : kStateBlockSize;
}

}  // namespace pagedopt
