/* A fingerprint of a block of memory that changes with any single changed word.

   Four independent lanes each fold in every fourth 8-byte word as h = rotl((h ^ w) * K, 31):
   for a fixed word each step is a bijection of h, and for a fixed h a bijection of w. So if two
   blocks differ in exactly one word, the lane holding it differs right after that step and
   every later step keeps it different: the 256-bit result (all four lanes, not mixed into one)
   differs with certainty. Blocks that differ in several words collide only by a coincidence of
   the multiplications (about 2^-64 for each lane's stretch of changes). The four chains run in
   parallel, so one core reads at memory speed. Tail bytes are folded in one by one. */

#include <stdint.h>
#include <string.h>

#define FINGERPRINT_K 0x9E3779B97F4A7C15ULL

static inline uint64_t fold(uint64_t h, uint64_t w) {
    h = (h ^ w) * FINGERPRINT_K;
    return (h << 31) | (h >> 33);
}

void semipack_fingerprint(const unsigned char *data, int64_t nbytes, uint64_t *out) {
    uint64_t h0 = 1, h1 = 2, h2 = 3, h3 = 4;
    const int64_t blocks = nbytes / 32;
    for (int64_t b = 0; b < blocks; b++) {
        uint64_t w[4];
        memcpy(w, data + b * 32, 32);
        h0 = fold(h0, w[0]);
        h1 = fold(h1, w[1]);
        h2 = fold(h2, w[2]);
        h3 = fold(h3, w[3]);
    }
    for (int64_t i = blocks * 32; i < nbytes; i++) h0 = fold(h0, data[i]);
    out[0] = h0;
    out[1] = h1;
    out[2] = h2;
    out[3] = fold(h3, (uint64_t)nbytes);
}
